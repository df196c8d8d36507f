//! The `moelink` command's implementation, as a library so that other tools (baseline harnesses, result
//! collectors) can reuse its pieces — above all [`record::Record`], the JSON shape of every measurement.
//!
//! - [`bench`](mod@bench) — `moelink bench` (dispatch/combine) and `moelink bench nvlink` (GPU probes).
//! - [`selftest`] — `moelink selftest`, thread or process (torchrun) mode.
//! - [`info`] — `moelink info`.
//! - [`soak`] — `moelink soak` (randomized rounds checked against the host backend).
//! - [`chaos`] — `moelink chaos` (a rank killed mid-collective, process mode).
//! - [`record`] — one measurement as written to `--json FILE`.
//! - [`env`] — the environment variables the command reads, turned into typed options at start-up.

pub mod bench;
pub mod chaos;
pub mod env;
pub mod info;
pub mod ranks;
pub mod record;
pub mod rng;
pub mod selftest;
pub mod soak;
pub mod sys;
pub mod table;

use std::fmt;

/// A user-facing error: printed as `error: <message>`, exit status 1.
#[derive(Debug)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

impl From<moelink::Error> for CliError {
    fn from(e: moelink::Error) -> Self {
        CliError(e.to_string())
    }
}
