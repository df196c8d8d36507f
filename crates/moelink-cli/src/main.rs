//! `moelink`: benchmarks, self-checks and machine facts for the moelink expert-parallel library.
//!
//! - `moelink bench` — dispatch/combine timings at DeepEP's shapes, correctness checked before timing.
//! - `moelink bench nvlink` — NVLink copy bandwidth, barrier latency, JIT times (GPU diagnostics).
//! - `moelink bench transport` — the RDMA transport seam's latency and bandwidth per backend and QP count.
//! - `moelink bench bytes` — the byte model across nodes, computed from routing alone.
//! - `moelink selftest [--process]` — group and GPU self-checks, in threads or as a torchrun rank.
//! - `moelink info` — GPUs, driver, peer access, NVRTC, and the backend `auto` picks.
//!
//! The soak and chaos runs are the `moelink-stress` binary's.
//!
//! Errors print as `error: <message>` and exit with status 1. Environment variables: `moelink_cli::env`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moelink_cli::{bench, info, selftest};

/// moelink: expert-parallel MoE dispatch/combine over NVLink.
#[derive(Parser, Debug)]
#[command(
    name = "moelink",
    version,
    after_help = "Every command:\n  \
        moelink bench              dispatch/combine timings, correctness checked first\n  \
        moelink bench nvlink       NVLink copy bandwidth, barrier latency, JIT times (GPU diagnostics)\n  \
        moelink bench transport    the RDMA transport seam's latency and bandwidth per backend and QP count\n  \
        moelink bench bytes        the byte model across nodes, computed from routing (no GPU)\n  \
        moelink selftest           group and GPU self-checks, in threads or as a torchrun rank\n  \
        moelink info               GPUs, driver, peer access, NVRTC, and the backend `auto` picks\n\
        `moelink <command> --help` for a command's options."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Time dispatch and combine (correctness is checked first); `bench nvlink`, `bench transport` and
    /// `bench bytes` for the diagnostics.
    ///
    /// Without a GPU it runs on the host backend (CPU threads) and says so: those times measure the
    /// reference implementation, not GPU performance.
    Bench(Box<bench::BenchCmd>),
    /// Check the process group and the GPU machinery (symmetric memory, barrier, deadlines); PASS/FAIL per
    /// check, non-zero exit on failure.
    Selftest(selftest::SelftestArgs),
    /// Show GPUs, driver, peer access, NVRTC, and which backend `auto` picks. Works without a GPU.
    Info,
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
    moelink_cli::main_of(|cli: Cli| match &cli.cmd {
        Cmd::Bench(b) => match &b.probe {
            Some(bench::BenchSub::Nvlink(a)) => bench::nvlink::run(a),
            Some(bench::BenchSub::Transport(a)) => bench::transport::run(a),
            Some(bench::BenchSub::Bytes(a)) => bench::bytes::run(a),
            None => bench::run(&b.args),
        },
        Cmd::Selftest(a) => selftest::run(a),
        Cmd::Info => info::run(),
    })
}
