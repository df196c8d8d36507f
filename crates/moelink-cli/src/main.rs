//! `moelink`: benchmarks, self-checks and machine facts for the moelink expert-parallel library.
//!
//! - `moelink bench` — dispatch/combine timings at DeepEP's shapes, correctness checked before timing.
//! - `moelink bench nvlink` — NVLink copy bandwidth, barrier latency, JIT times (GPU diagnostics).
//! - `moelink bench transport` — the RDMA transport seam's latency and bandwidth per backend and QP count.
//! - `moelink selftest [--process]` — group and GPU self-checks, in threads or as a torchrun rank.
//! - `moelink info` — GPUs, driver, peer access, NVRTC, and the backend `auto` picks.
//! - `moelink soak` — randomized rounds of every kernel family checked against the host backend.
//! - `moelink chaos` — kill a rank mid-collective (process mode); survivors must time out and rebuild.
//!
//! Errors print as `error: <message>` and exit with status 1. Environment variables: `moelink_cli::env`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moelink_cli::{bench, chaos, info, selftest, soak};

/// moelink: expert-parallel MoE dispatch/combine over NVLink.
#[derive(Parser, Debug)]
#[command(name = "moelink", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Time dispatch and combine (correctness is checked first); `bench nvlink` for the NVLink probes.
    ///
    /// Without a GPU it runs on the host backend (CPU threads) and says so: those times measure the
    /// reference implementation, not GPU performance.
    Bench(Box<bench::BenchCmd>),
    /// Check the process group and the GPU machinery (symmetric memory, barrier, deadlines); PASS/FAIL per
    /// check, non-zero exit on failure.
    Selftest(selftest::SelftestArgs),
    /// Show GPUs, driver, peer access, NVRTC, and which backend `auto` picks. Works without a GPU.
    Info,
    /// Randomized rounds of every kernel family, each checked bit for bit against the host backend, with
    /// device and host memory sampled (thread mode; `--backend host` runs without a GPU).
    Soak(soak::SoakArgs),
    /// Process mode: one rank SIGKILLs itself in the middle of a collective; the survivors must get a
    /// timeout naming it, stay alive and rebuild over the remaining ranks (or, with --shrink, mask it).
    Chaos(chaos::ChaosArgs),
}

fn main() -> ExitCode {
    // Checked before anything else (argument parsing reads it as `bench --backend`'s default): a typo gets
    // moelink's message naming the variable, not clap's about `--backend`, nor a CUDA error later.
    if let Some(value) = std::env::var_os("MOELINK_BACKEND") {
        let value = value.to_string_lossy();
        if moelink::BackendKind::from_name(&value).is_none() {
            eprintln!("error: MOELINK_BACKEND={value:?} is not a backend: expected one of {}", moelink::BackendKind::NAMES.join(", "));
            return ExitCode::from(1);
        }
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints "error: ..." with usage for bad arguments, and the text for --help/--version.
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(1) } else { ExitCode::SUCCESS };
        }
    };
    // The environment's tracing, tuning and JIT variables become typed options before anything runs.
    if let Err(e) = moelink_cli::env::init() {
        eprintln!("error: {e}");
        return ExitCode::from(1);
    }
    let result = match &cli.cmd {
        Cmd::Bench(b) => match &b.probe {
            Some(bench::BenchSub::Nvlink(a)) => bench::nvlink::run(a),
            Some(bench::BenchSub::Transport(a)) => bench::transport::run(a),
            None => bench::run(&b.args),
        },
        Cmd::Selftest(a) => selftest::run(a),
        Cmd::Info => info::run(),
        Cmd::Soak(a) => soak::run(a),
        Cmd::Chaos(a) => chaos::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
