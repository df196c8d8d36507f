//! The `moelink` command's implementation, as a library so that other tools (baseline harnesses, result
//! collectors) can reuse its pieces — above all [`record::Record`], the JSON shape of every measurement.
//!
//! - [`bench`](mod@bench) — `moelink bench` (dispatch/combine) and `moelink bench nvlink` (GPU probes).
//! - [`selftest`] — `moelink selftest`, thread or process (torchrun) mode.
//! - [`info`] — `moelink info`.
//! - [`record`] — one measurement as written to `--json FILE`.
//! - [`sys`] — what machine and code a result comes from.
//! - [`env`](mod@env) — the environment variables the command reads, turned into typed options at start-up.
//!
//! The stress tools (`moelink-stress soak`, `moelink-stress chaos`) live in the `moelink-stress` crate, on
//! this library.

pub mod bench;
pub mod env;
pub mod info;
pub mod record;
pub mod selftest;
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

/// A binary's `main`: parses the command line into `C`, turns the environment's tracing, tuning and JIT
/// variables into typed options ([`env::init`]) and runs it. Bad arguments print clap's message (with
/// usage) and exit 1, `--help`/`--version` print and exit 0; a failed run prints `error: <message>` and
/// exits 1.
pub fn main_of<C: clap::Parser>(run: impl FnOnce(C) -> Result<(), CliError>) -> std::process::ExitCode {
    let cli = match C::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints "error: ..." with usage for bad arguments, and the text for --help/--version.
            let _ = e.print();
            return if e.use_stderr() { std::process::ExitCode::from(1) } else { std::process::ExitCode::SUCCESS };
        }
    };
    if let Err(e) = env::init() {
        eprintln!("error: {e}");
        return std::process::ExitCode::from(1);
    }
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

impl From<moelink::Error> for CliError {
    fn from(e: moelink::Error) -> Self {
        CliError(e.to_string())
    }
}
