//! `moelink-stress`: randomized soaks and rank-killing chaos runs for the moelink expert-parallel library.
//!
//! - `moelink-stress soak` — randomized rounds of every kernel family checked against the host backend.
//! - `moelink-stress chaos` — kill a rank mid-collective (process mode); survivors must time out and rebuild.
//!
//! Errors print as `error: <message>` and exit with status 1.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moelink_stress::{chaos, soak};

/// moelink-stress: soak and chaos runs of moelink's collectives.
#[derive(Parser, Debug)]
#[command(name = "moelink-stress", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Randomized rounds of every kernel family, each checked bit for bit against the host backend, with
    /// device and host memory sampled (thread mode; `--backend host` runs without a GPU).
    Soak(soak::SoakArgs),
    /// Process mode: one rank SIGKILLs itself in the middle of a collective; the survivors must get a
    /// timeout naming it, stay alive and rebuild over the remaining ranks (or, with --shrink, mask it).
    Chaos(chaos::ChaosArgs),
}

fn main() -> ExitCode {
    moelink_cli::main_of(|cli: Cli| match &cli.cmd {
        Cmd::Soak(a) => soak::run(a),
        Cmd::Chaos(a) => chaos::run(a),
    })
}
