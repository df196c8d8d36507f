//! `moelink bench`: dispatch/combine timings at DeepEP's benchmark shapes, correctness checked first.
//!
//! Every rank is a thread of this process (one GPU each on CUDA). A run is a list of batches, one per
//! (mode, shape, routing); for each, the inputs of all ranks are generated once from the seed together with
//! the results they must produce ([`moelink_testkit::inputs`]); each rank then creates its buffer (sized once per run for the
//! largest shape of its mode) and, case by case, runs the operation once and checks it (always against
//! those backend-independent expectations, on CUDA also bit for bit against the host backend on the same
//! inputs), then times warm-up + repetitions, each in its own [`moelink::Buffer::timed`] region (a barrier
//! of all ranks, then CUDA events on the device or the wall clock on the host):
//!
//! - HT dispatch: `prepare_dispatch` + `dispatch_into` in CPU-sync mode (the count exchange, the host's
//!   wait for it and the dispatch kernel) into the checked call's outputs; then, as `cached_us`, the cached
//!   dispatch of the same payload with that call's handle (no count exchange, no host wait, no top-k; its
//!   rows checked bit for bit against the fresh call's) — what DeepEP's benchmark times
//!   (`buffer.dispatch(x, handle=handle)` in its tests' tuning loop). HT combine: `combine_into` into the
//!   checked call's output. Nothing is allocated while timing.
//! - LL on CUDA: the call captured once into a CUDA graph (outputs of the checked call), each repetition
//!   one timed replay; with `--hook` the send phase and the receive phase (`run_hook`) as two graphs, timed
//!   apart. On the host backend the plain calls. With `MOELINK_LL_TRACE=1` also each kernel's span from the
//!   in-kernel trace (`kernel_us`, with the trace points), and DeepEP's way of timing: a graph of dispatch +
//!   combine replayed back to back on an asynchronous stream, no barrier or L2 flush between calls, each
//!   kernel's span (`loop_dispatch_kernel_us`, `loop_combine_kernel_us`, `loop_pair_us`) and trace points
//!   (`loop_dispatch_trace`, `loop_combine_trace`).
//!
//! The reported time is the median over repetitions of the slowest rank: per repetition the largest time of
//! any rank, then the median of those.

pub mod bytes;
mod ht;
mod ll;
pub mod nvlink;
pub mod plot;
mod process;
pub mod transport;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use moelink::{BackendKind, Buffer, BufferOptions, Result};

use crate::record::{self, Record, RunFacts, Status};
use crate::table::{num, Table};
use crate::{sys, CliError};
use moelink_testkit::inputs::{Inputs, Shape};
use moelink_testkit::RouteKind;

/// `moelink bench [OPTIONS]` or `moelink bench nvlink [OPTIONS]`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchCmd {
    /// `nvlink`, or none for the dispatch/combine bench.
    #[command(subcommand)]
    pub probe: Option<BenchSub>,
    /// Options of the dispatch/combine bench.
    #[command(flatten)]
    pub args: BenchArgs,
}

/// Diagnostics under `bench`.
#[derive(Subcommand, Debug)]
pub enum BenchSub {
    /// NVLink copy bandwidth, cross-GPU barrier latency and JIT compile times (GPU diagnostics).
    Nvlink(nvlink::NvlinkArgs),
    /// The RDMA transport seam: put+signal latency and put bandwidth per backend (ptr, emu-nic, nvshmem),
    /// message size and QP count, each after a conformance check (not network figures without a NIC).
    Transport(transport::TransportArgs),
    /// The byte model across nodes, from routing alone: RDMA and NVLink bytes per rank for the
    /// high-throughput (hierarchical) and low-latency designs, and the busiest NIC's floor (computed, no GPU).
    Bytes(bytes::BytesArgs),
}

/// How the bench's tokens pick experts (`--routing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoutingKind {
    /// Scores |randn| + 1, top-k (DeepEP's benchmark routing).
    Uniform,
    /// 90% of tokens pick experts 0..k: the first rank receives nearly everything.
    Skewed,
    /// With --topology across nodes: DeepSeek-V3's group-limited gating, each token's experts on at most
    /// --max-nodes nodes.
    NodeLimited,
}

impl RoutingKind {
    /// Name used in tables and JSON.
    pub fn name(self) -> &'static str {
        self.kind(1, 1).name()
    }
    /// The generator's routing on `nodes` nodes (node-limited: at most `max_nodes` of them per token).
    pub fn kind(self, nodes: usize, max_nodes: usize) -> RouteKind {
        match self {
            RoutingKind::Uniform => RouteKind::Uniform,
            RoutingKind::Skewed => RouteKind::Skewed,
            RoutingKind::NodeLimited => RouteKind::NodeLimited { nodes, max_nodes },
        }
    }
}

/// Which regime to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeSel {
    /// High-throughput (training / prefill).
    Ht,
    /// Low-latency (decode).
    Ll,
    /// Both.
    All,
}

/// Dispatch payload types to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeSel {
    /// bf16 rows.
    Bf16,
    /// FP8 E4M3 rows with one fp32 scale per 128 channels.
    Fp8,
    /// Both.
    All,
}

/// Backend choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendSel {
    /// CUDA when usable, else the host backend.
    Auto,
    /// CPU threads (the reference implementation; its times say nothing about GPUs).
    Host,
    /// CUDA kernels (fails when unavailable).
    Cuda,
}

impl BackendSel {
    fn kind(self) -> BackendKind {
        match self {
            BackendSel::Auto => BackendKind::Auto,
            BackendSel::Host => BackendKind::Host,
            BackendSel::Cuda => BackendKind::Cuda,
        }
    }
}

/// Options of `moelink bench`. Sizes left out take DeepEP's benchmark shapes (HT: 4096 tokens per rank,
/// hidden 7168, top-8 of 256 experts; LL: 128 tokens, hidden 7168, top-8 of 288, FP8 dispatch), or small
/// ones with `--quick`. Lists (`--tokens`, `--ll-tokens`, `--num-sms`, `--routing`) multiply: one measurement
/// per combination. `--suite` runs a fixed set of curves in one invocation instead.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Regime: ht, ll or all.
    #[arg(long, value_enum, default_value_t = ModeSel::All)]
    pub mode: ModeSel,
    /// Tokens per rank, comma-separated for a sweep (default: HT 4096, LL 128). Applies to LL too unless
    /// --ll-tokens is given.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// LL tokens per rank (also `num_max_dispatch_tokens_per_rank`), comma-separated for a sweep.
    #[arg(long = "ll-tokens", value_delimiter = ',')]
    pub ll_tokens: Vec<usize>,
    /// Hidden size (default: 7168).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Experts per token (default: 8).
    #[arg(long)]
    pub topk: Option<usize>,
    /// Experts in total (default: HT 256, LL 288).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Ranks (default: number of GPUs; 4 on the host backend).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Dispatch payload: bf16, fp8 or all (default: HT all, LL fp8). Combine is always bf16.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeSel>,
    /// Routing, comma-separated: uniform (scores |randn|+1, top-k) and/or skewed.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "uniform")]
    pub routing: Vec<RoutingKind>,
    /// SMs for HT kernels, comma-separated for a sweep: even, 2 to 1024 (default: the backend's default;
    /// the host backend runs on CPU threads and ignores it).
    #[arg(long = "num-sms", value_delimiter = ',', value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=1024))]
    pub num_sms: Vec<usize>,
    /// The standard curves in one run, DeepEP's shapes first: HT (bf16 + FP8 dispatch, combine) at 4096 tokens
    /// and 24 SMs with uniform and skewed routing, an SM sweep 8,16,24,32,48,64 at 4096 tokens, a token sweep
    /// 512,1024,2048,8192,16384 at 24 SMs; LL (FP8 dispatch, combine) at 128 tokens, uniform and skewed, and
    /// a token sweep 1,16,64,256. Sweeps use uniform routing. --hidden/--topk/--experts/--mode/--hook apply;
    /// --quick shrinks the sizes.
    #[arg(long, conflicts_with_all = ["tokens", "ll_tokens", "num_sms", "routing", "dtype"])]
    pub suite: bool,
    /// Timed repetitions (default: CUDA 30; host 5; --quick 3).
    #[arg(long)]
    pub reps: Option<usize>,
    /// Untimed warm-up repetitions (default: CUDA 5; host and --quick 1).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Backend: auto, host or cuda.
    /// (Default: `MOELINK_BACKEND`, else auto.)
    #[arg(long, value_enum, env = "MOELINK_BACKEND", default_value_t = BackendSel::Auto)]
    pub backend: BackendSel,
    /// Write one JSON record per measurement to FILE (a JSON list), rewritten after every batch of
    /// measurements so that a run cut short keeps what it measured.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Small sizes for CI and smoke tests (HT 256 tokens, LL 32 tokens, hidden 1024, top-8 of 64).
    #[arg(long)]
    pub quick: bool,
    /// Seed of the inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Per-GPU ingress ceiling in GB/s (from `moelink bench nvlink`): adds `pct_of_p2p_ceiling` to records.
    #[arg(long, value_name = "GBPS")]
    pub p2p_ceiling_gbps: Option<f64>,
    /// On CUDA, skip the bitwise comparison against the host backend.
    #[arg(long)]
    pub no_host_check: bool,
    /// Process mode: this process is one rank of a torchrun launch (`torchrun --nproc_per_node=N --no-python
    /// moelink bench --process ...`), on GPU LOCAL_RANK; rank 0 prints and writes the records. Needed for
    /// `--transport nvshmem` (one NVSHMEM PE per process).
    #[arg(long)]
    pub process: bool,
    /// Seconds a rank waits for the others in a collective before giving up (1 to 86400: a day).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub timeout_s: u64,
    /// LL: also time receive-hook mode, the send phase and the receive phase apart (records get
    /// `send_us` and `recv_us`).
    #[arg(long)]
    pub hook: bool,
    /// LL on CUDA: stamp the kernels (as `MOELINK_LL_TRACE=1`) and also report each kernel's span (records get
    /// `kernel_us` and the trace points) and DeepEP's way of timing — dispatch + combine back to back, no
    /// barrier or L2 flush between calls, kernel durations (`loop_dispatch_kernel_us`,
    /// `loop_combine_kernel_us`).
    #[arg(long)]
    pub ll_trace: bool,
    /// LL across nodes: the ranks as NODESxRANKS_PER_NODE, e.g. `2x2` for 4 ranks. On one host these are
    /// virtual nodes, and on CUDA the ranks may then outnumber the GPUs (they share them: the times are not
    /// network or NVLink figures). Records get `nodes`, `ranks_per_node`, `transport` and the bytes each rank
    /// sends over each path (`rdma_bytes`, `nvlink_bytes`: the byte model of docs/internode.md).
    #[arg(long, value_name = "NODESxRANKS")]
    pub topology: Option<String>,
    /// With --routing node-limited: the most nodes a token's experts may be on (DeepSeek-V3: 4).
    #[arg(long, default_value_t = 4)]
    pub max_nodes: usize,
    /// With --topology: the RDMA transport between nodes, ptr or emu-nic (nvshmem needs one process per
    /// rank; the bench runs its ranks as threads).
    #[arg(long, default_value = "ptr")]
    pub transport: String,
    /// With --topology: the LL kernels reach the ranks of their own node through the RDMA transport too
    /// (DeepEP's `allow_nvlink_for_low_latency_mode=False`).
    #[arg(long)]
    pub no_nvlink_in_node: bool,
    /// Draw what was measured into FILE (PNG, 1280x720; 560 pixels taller per further row of two panels):
    /// time or GB/s (`--plot-metric`) against what was swept (tokens, SMs, or ranks across `--plot-with`
    /// files), one panel per regime and sweep, one line per operation and payload type, a baseline's lines
    /// dashed; a header names the backend and commit.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// What the plot's y axis shows.
    #[arg(long, value_enum, default_value_t = plot::Metric::Time)]
    pub plot_metric: plot::Metric,
    /// Records of other runs to draw with this one's (repeatable): a baseline's (`python -m moelink.bench
    /// --json`: NCCL, DeepEP), or moelink's at other rank counts (`--json` of earlier runs).
    #[arg(long, value_name = "FILE.json")]
    pub plot_with: Vec<PathBuf>,
}

/// SMs of the HT kernels in `--suite` outside its SM sweep: the SM budget of the HT targets (≤ 24 SMs,
/// docs/perf-notes.md) and the CUDA backend's default on H200.
pub const SUITE_SMS: usize = 24;
/// `--suite`'s HT SM sweep.
const SUITE_SM_SWEEP: [usize; 6] = [8, 16, 24, 32, 48, 64];

/// Regime of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// High-throughput.
    Ht,
    /// Low-latency.
    Ll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ht => "ht",
            Mode::Ll => "ll",
        }
    }
}

/// Collective of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Tokens to the experts' ranks.
    Dispatch,
    /// Expert outputs back, summed.
    Combine,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
        }
    }
}

/// Payload type of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bf16.
    Bf16,
    /// FP8 E4M3 + fp32 scales.
    Fp8,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

/// One measurement to make.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// Regime.
    pub mode: Mode,
    /// Collective.
    pub op: Op,
    /// Payload type.
    pub dtype: Dtype,
    /// Routing of the inputs.
    pub routing: RoutingKind,
    /// HT: `Some(n)` from `--num-sms`, `None` for the backend's default. Always `None` for LL.
    pub num_sms: Option<usize>,
}

/// What one rank saw for one case.
#[derive(Debug, Default)]
pub struct RankOutcome {
    /// Timed repetitions, microseconds (empty when not timed).
    pub times_us: Vec<f64>,
    /// How they were taken: `"cuda-events"`, `"cuda-graph-events"` or `"wall"`.
    pub timer: Option<&'static str>,
    /// Correctness failures (empty = correct).
    pub failures: Vec<String>,
    /// `Some(why)` when the backend cannot run this case.
    pub unavailable: Option<String>,
    /// The operation failed with this error.
    pub error: Option<String>,
    /// SMs actually used (HT).
    pub num_sms: Option<usize>,
    /// Whether the result matched the host backend bit for bit (CUDA only).
    pub matches_host: Option<bool>,
    /// Receive-hook mode (LL, `--hook`): send-phase times, microseconds.
    pub send_us: Vec<f64>,
    /// Receive-hook mode: receive-phase (`run_hook`) times, microseconds.
    pub recv_us: Vec<f64>,
    /// HT dispatch: times of the cached dispatch (the call's handle re-used), microseconds.
    pub cached_us: Vec<f64>,
    /// LL with `MOELINK_LL_TRACE=1`: kernel traces of the timed repetitions (fused call; hook send; hook
    /// receive), whose spans are the kernels' durations without the launch.
    pub traces: [Vec<moelink::diag::KernelTrace>; 3],
    /// LL combine with `MOELINK_LL_TRACE=1`: DeepEP's way of timing — dispatch + combine back to back,
    /// kernel durations: [dispatch spans, combine spans, event µs per pair].
    pub loop_times: [Vec<f64>; 3],
    /// The same regions' kernel traces, [dispatch, combine]: where the time goes with no barrier between
    /// calls (the per-call traces above start every call after a barrier, so a late peer shows there).
    pub loop_traces: [Vec<moelink::diag::KernelTrace>; 2],
}

/// Everything a rank worker needs, shared by reference across rank threads.
pub struct Job<'a> {
    /// Inputs of every rank and the expected results.
    pub inputs: &'a Inputs,
    /// Cases to run, in order (the same on every rank).
    pub cases: &'a [Case],
    /// Backend to measure.
    pub backend: BackendKind,
    /// Also run the host backend on the same inputs and compare bit for bit (CUDA).
    pub host_check: bool,
    /// Untimed repetitions.
    pub warmup: usize,
    /// Timed repetitions.
    pub reps: usize,
    /// LL: also time receive-hook mode.
    pub hook: bool,
    /// Ticked once per repetition by rank 0.
    pub progress: &'a ProgressBar,
    /// What every buffer starts from (backend and sizes are set per buffer): tracing and tuning.
    pub base: &'a BufferOptions,
}

impl Job<'_> {
    /// Runs `op` warm-up + reps times, each in its own [`Buffer::timed`] region (a barrier of all ranks,
    /// then device events on CUDA or the wall clock on the host); returns the timed repetitions' µs.
    pub fn time(&self, buf: &mut Buffer, op: impl FnMut(&mut Buffer) -> Result<()>) -> Result<Vec<f64>> {
        self.time_reps(buf, op, true)
    }

    /// [`Job::time`] for a second measurement of a case, which the progress bar does not count.
    pub fn time_quietly(&self, buf: &mut Buffer, op: impl FnMut(&mut Buffer) -> Result<()>) -> Result<Vec<f64>> {
        self.time_reps(buf, op, false)
    }

    fn time_reps(&self, buf: &mut Buffer, mut op: impl FnMut(&mut Buffer) -> Result<()>, counted: bool) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(self.reps);
        for i in 0..self.warmup + self.reps {
            let ((), us) = buf.timed(&mut op)?;
            if self.base.kernel_tracing.high_throughput {
                print_ht_traces(buf);
            }
            if i >= self.warmup {
                times.push(us);
            }
            if counted {
                self.tick(buf.rank());
            }
        }
        Ok(times)
    }

    /// Counts one repetition on the progress bar (rank 0 only).
    pub fn tick(&self, rank: usize) {
        if rank == 0 {
            self.progress.inc(1);
        }
    }

    /// Advances the progress bar past a case that will not be timed.
    pub fn skip(&self, rank: usize) {
        if rank == 0 {
            self.progress.inc((self.warmup + self.reps) as u64);
        }
    }
}

/// One stderr line per high-throughput kernel trace of the last timed region (`MOELINK_HT_TRACE=1`): when
/// the blocks started and ended and each role's warps started and finished their work, in µs after the
/// kernel's first block (min / median / max).
fn print_ht_traces(buf: &Buffer) {
    for t in buf.kernel_traces().iter().filter(|t| t.kernel.starts_with("moelink::intranode::")) {
        let at = |name: &str| t.point(name).map_or("-".to_string(), |p| format!("+{:.1}/+{:.1}/+{:.1}", p.min_us, p.median_us, p.max_us));
        eprintln!(
            "moelink trace: rank {} {} ({}): span {:.1} us; block start {}, senders start {} end {}, receivers start {} end {}, \
             block end {} (us, min/median/max)",
            buf.rank(),
            t.op,
            t.kernel,
            t.span_us,
            at("start"),
            at("send_start"),
            at("send_end"),
            at("recv_start"),
            at("recv_end"),
            at("end")
        );
    }
}

/// The most telling error among ranks: a rank's own failure rather than the timeouts it caused elsewhere.
fn first_cause(errors: &[&moelink::Error]) -> Option<String> {
    use moelink::Error;
    let secondary = |e: &Error| matches!(e, Error::Timeout { .. } | Error::Group { .. } | Error::Poisoned { .. });
    errors.iter().find(|e| !secondary(e)).or_else(|| errors.first()).map(|e| e.to_string())
}

/// Turns an operation's result into either a value or a finished outcome (unavailable / failed).
pub fn settle<T>(r: Result<T>, out: &mut RankOutcome) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(moelink::Error::Unavailable(why)) => {
            out.unavailable = Some(why);
            None
        }
        Err(e) => {
            out.error = Some(e.to_string());
            None
        }
    }
}

/// One (mode, shape, routing) of a run: its cases share the inputs and each rank's buffer.
#[derive(Clone, Debug)]
struct Batch {
    mode: Mode,
    shape: Shape,
    routing: RoutingKind,
    /// Dispatch payloads to measure (combine is always measured, bf16).
    dtypes: Vec<Dtype>,
    /// HT: the SM counts to measure (`None`: the backend's default); LL: `[None]`.
    sms: Vec<Option<usize>>,
}

/// Communication buffer sizes of a run, `(num_nvl_bytes, num_rdma_bytes)`: what the largest batch of each
/// mode needs on the CUDA backend ([`Buffer::ht_bytes_needed`] over the dispatch types measured, bf16
/// always since combine dispatches bf16; [`Buffer::ll_bytes_needed`]). Every batch of a mode gets the same
/// size, so the points of a curve differ only in what they measure. The host backend applies the same
/// capacity rules, so it gets the same sizes.
fn buffer_bytes(batches: &[Batch], internode: Option<moelink::Topology>) -> (usize, usize) {
    let (mut nvl, mut rdma) = (0, 0);
    for b in batches {
        let s = &b.shape;
        match (b.mode, internode) {
            // Across nodes: one round holds every token (the kernels' rounds are then DeepEP's one pass).
            (Mode::Ht, Some(t)) => {
                for use_fp8 in [false, b.dtypes.contains(&Dtype::Fp8)] {
                    let need = moelink::internode::ht_bytes_needed(t, s.tokens.max(1), s.hidden, s.topk, use_fp8);
                    nvl = nvl.max(need.num_nvl_bytes);
                    rdma = rdma.max(need.num_rdma_bytes);
                }
            }
            (Mode::Ht, None) => {
                for use_fp8 in [false, b.dtypes.contains(&Dtype::Fp8)] {
                    nvl = nvl.max(Buffer::ht_bytes_needed(s.tokens, s.hidden, s.topk, s.ranks, use_fp8));
                }
            }
            (Mode::Ll, _) => rdma = rdma.max(Buffer::ll_bytes_needed(s.tokens, s.hidden, s.ranks, s.experts)),
        }
    }
    (nvl, rdma)
}

/// The resolved plan of one bench run.
struct Plan {
    backend: BackendKind,
    fallback_reason: Option<String>,
    ranks: usize,
    /// Up to how many ranks share a GPU, when they do (`--topology` on fewer GPUs than ranks).
    gpus_shared_by: Option<usize>,
    /// GPUs the ranks run on.
    gpus: usize,
    /// `--process`: every rank a process of a torchrun launch.
    process: bool,
    /// `--topology` across nodes, with its RDMA settings; `None` on one node.
    internode: Option<(moelink::Topology, moelink::RdmaOptions)>,
    reps: usize,
    warmup: usize,
    batches: Vec<Batch>,
}

/// `process_ranks`: the launch's world size in process mode.
fn plan(a: &BenchArgs, process_ranks: Option<usize>) -> std::result::Result<Plan, CliError> {
    let (backend, fallback_reason) = sys::resolve_backend(a.backend.kind()).map_err(CliError)?;
    let gpus = sys::gpu_count();
    let ranks = match (process_ranks.or(a.ranks), backend) {
        (Some(r), _) => r,
        (None, BackendKind::Cuda) if gpus > 0 => gpus,
        (None, BackendKind::Cuda) => return Err(CliError("cannot tell how many GPUs there are; pass --ranks".into())),
        (None, _) => 4,
    };
    if ranks == 0 {
        return Err(CliError("--ranks must be at least 1".into()));
    }
    let internode = internode_plan(a, ranks)?;
    if a.routing.contains(&RoutingKind::NodeLimited) && internode.is_none() {
        return Err(CliError("--routing node-limited needs --topology across nodes (e.g. 2x2)".into()));
    }
    if a.max_nodes == 0 {
        return Err(CliError("--max-nodes must be at least 1".into()));
    }
    // With --topology (virtual nodes) ranks may share GPUs; otherwise one rank per GPU. In process mode the
    // ranks on this host are torchrun's LOCAL_WORLD_SIZE.
    let host_ranks = match process_ranks {
        Some(_) => std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(ranks),
        None => ranks,
    };
    let gpus_shared_by = (backend == BackendKind::Cuda && gpus > 0 && host_ranks > gpus).then(|| host_ranks.div_ceil(gpus));
    if gpus_shared_by.is_some() && a.topology.is_none() {
        return Err(CliError(format!("--ranks {ranks} needs {ranks} GPUs, this machine has {gpus} (--topology lets ranks share them)")));
    }
    let cuda = backend == BackendKind::Cuda;
    let reps = a.reps.unwrap_or(if a.quick {
        3
    } else if cuda {
        30
    } else {
        5
    });
    let warmup = a.warmup.unwrap_or(if cuda && !a.quick { 5 } else { 1 });
    if reps == 0 {
        return Err(CliError("--reps must be at least 1".into()));
    }
    for &n in &a.num_sms {
        if n < 2 || n % 2 != 0 {
            return Err(CliError(format!("--num-sms {n}: SM counts must be even and at least 2")));
        }
    }
    let wanted: &[Mode] = match a.mode {
        ModeSel::Ht => &[Mode::Ht],
        ModeSel::Ll => &[Mode::Ll],
        ModeSel::All => &[Mode::Ht, Mode::Ll],
    };
    let mut batches = Vec::new();
    for &mode in wanted {
        let (t, e) = match (mode, a.quick) {
            (Mode::Ht, false) => (4096, 256),
            (Mode::Ll, false) => (128, 288),
            (Mode::Ht, true) => (256, 64),
            (Mode::Ll, true) => (32, 64),
        };
        let base = Shape {
            ranks,
            tokens: t,
            hidden: a.hidden.unwrap_or(if a.quick { 1024 } else { 7168 }),
            topk: a.topk.unwrap_or(8),
            experts: a.experts.unwrap_or(e),
        };
        let mode_batches = if a.suite { suite_batches(mode, base, a.quick) } else { flag_batches(mode, base, a) };
        for b in &mode_batches {
            check_shape(mode, &b.shape, &b.dtypes)?;
            check_fits_memory(mode, &b.shape, sys::host_memory_bytes(), !a.ll_tokens.is_empty())?;
        }
        batches.extend(mode_batches);
    }
    // HT first, then LL, except that the suite measures DeepEP's shapes (both modes) before its sweeps.
    if a.suite {
        let deepep = |b: &Batch| match b.mode {
            Mode::Ht => b.shape.tokens == if a.quick { 256 } else { 4096 },
            Mode::Ll => b.shape.tokens == if a.quick { 32 } else { 128 },
        };
        batches.sort_by_key(|b| !deepep(b));
    }
    let gpus = if backend == BackendKind::Cuda { gpus_shared_by.map_or(ranks, |n| host_ranks.div_ceil(n)) } else { 0 };
    Ok(Plan { backend, fallback_reason, ranks, gpus_shared_by, gpus, process: process_ranks.is_some(), internode, reps, warmup, batches })
}

/// The topology and RDMA settings of `--topology`/`--transport`/`--no-nvlink-in-node`; `None` for one node.
fn internode_plan(a: &BenchArgs, ranks: usize) -> std::result::Result<Option<(moelink::Topology, moelink::RdmaOptions)>, CliError> {
    let Some(t) = &a.topology else {
        if a.no_nvlink_in_node {
            return Err(CliError("--no-nvlink-in-node needs --topology".into()));
        }
        return Ok(None);
    };
    let topology = t.parse::<moelink::Topology>().map_err(|e| CliError(format!("--topology: {e}")))?;
    if topology.num_ranks() != ranks {
        return Err(CliError(format!("--topology {topology} is {} ranks, not --ranks {ranks}", topology.num_ranks())));
    }
    if !topology.is_internode() {
        return Ok(None);
    }
    let transport = a.transport.parse::<moelink::Transport>().map_err(|e| CliError(format!("--transport: {e}")))?;
    if transport == moelink::Transport::Nvshmem && !a.process {
        return Err(CliError("--transport nvshmem needs one process per rank: launch with torchrun and pass --process".into()));
    }
    let rdma = moelink::RdmaOptions {
        transport,
        allow_nvlink_for_low_latency_mode: !a.no_nvlink_in_node,
        // Where NVSHMEM is (the nvshmem transport), as `bench transport` and moelink-stress find it.
        nvshmem_home: std::env::var_os("NVSHMEM_HOME").map(PathBuf::from),
        ..Default::default()
    };
    Ok(Some((topology, rdma)))
}

/// Batches of one mode from the flags: every combination of token count and routing, each with every SM
/// count.
fn flag_batches(mode: Mode, base: Shape, a: &BenchArgs) -> Vec<Batch> {
    let tokens = match mode {
        Mode::Ll if !a.ll_tokens.is_empty() => a.ll_tokens.clone(),
        _ if !a.tokens.is_empty() => a.tokens.clone(),
        _ => vec![base.tokens],
    };
    let dtypes = match (a.dtype, mode) {
        (Some(DtypeSel::Bf16), _) => vec![Dtype::Bf16],
        (Some(DtypeSel::Fp8), _) | (None, Mode::Ll) => vec![Dtype::Fp8],
        (Some(DtypeSel::All), _) | (None, Mode::Ht) => vec![Dtype::Bf16, Dtype::Fp8],
    };
    let sms = match mode {
        Mode::Ht if !a.num_sms.is_empty() => a.num_sms.iter().map(|&n| Some(n)).collect(),
        _ => vec![None],
    };
    let mut routings = a.routing.clone();
    routings.dedup();
    let mut out = Vec::new();
    for &t in &tokens {
        for &routing in &routings {
            out.push(Batch { mode, shape: Shape { tokens: t, ..base }, routing, dtypes: dtypes.clone(), sms: sms.clone() });
        }
    }
    out
}

/// `--suite`'s batches of one mode. HT: DeepEP's shape with uniform routing at the SM sweep (24 first: the
/// DeepEP-shape row), the same with skewed routing at 24 SMs, then the token sweep at 24 SMs; LL (FP8):
/// DeepEP's shape with uniform and skewed routing, then the token sweep. Each point is measured once.
fn suite_batches(mode: Mode, base: Shape, quick: bool) -> Vec<Batch> {
    let at = |tokens: usize, routing: RoutingKind, dtypes: &[Dtype], sms: Vec<Option<usize>>| Batch {
        mode,
        shape: Shape { tokens, ..base },
        routing,
        dtypes: dtypes.to_vec(),
        sms,
    };
    let sweep: &[usize] = match (mode, quick) {
        (Mode::Ht, false) => &[512, 1024, 2048, 8192, 16384],
        (Mode::Ht, true) => &[64, 128, 512],
        (Mode::Ll, false) => &[1, 16, 64, 256],
        (Mode::Ll, true) => &[1, 8, 64],
    };
    let mut out = Vec::new();
    match mode {
        Mode::Ht => {
            let both = [Dtype::Bf16, Dtype::Fp8];
            let mut sm_sweep = vec![Some(SUITE_SMS)];
            sm_sweep.extend(SUITE_SM_SWEEP.iter().filter(|&&n| n != SUITE_SMS).map(|&n| Some(n)));
            out.push(at(base.tokens, RoutingKind::Uniform, &both, sm_sweep));
            out.push(at(base.tokens, RoutingKind::Skewed, &both, vec![Some(SUITE_SMS)]));
            out.extend(sweep.iter().map(|&t| at(t, RoutingKind::Uniform, &both, vec![Some(SUITE_SMS)])));
        }
        Mode::Ll => {
            out.push(at(base.tokens, RoutingKind::Uniform, &[Dtype::Fp8], vec![None]));
            out.push(at(base.tokens, RoutingKind::Skewed, &[Dtype::Fp8], vec![None]));
            out.extend(sweep.iter().map(|&t| at(t, RoutingKind::Uniform, &[Dtype::Fp8], vec![None])));
        }
    }
    out
}

fn check_shape(mode: Mode, s: &Shape, dtypes: &[Dtype]) -> std::result::Result<(), CliError> {
    let m = mode.name();
    let err = |msg: String| Err(CliError(format!("{m}: {msg}")));
    if s.tokens == 0 {
        return err("--tokens must be at least 1".into());
    }
    if s.topk == 0 || s.topk > s.experts {
        return err(format!("--topk {} must be between 1 and the number of experts ({})", s.topk, s.experts));
    }
    if s.experts % s.ranks != 0 {
        return err(format!("--experts {} must be a multiple of the {} ranks", s.experts, s.ranks));
    }
    if s.hidden == 0 || s.hidden % 8 != 0 {
        return err(format!("--hidden {} must be a positive multiple of 8 (rows of 16-byte multiples)", s.hidden));
    }
    if dtypes.contains(&Dtype::Fp8) && s.hidden % 128 != 0 {
        return err(format!("--hidden {} must be a multiple of 128 for FP8 (one scale per 128 channels)", s.hidden));
    }
    Ok(())
}

/// Refuses a shape whose inputs cannot fit this machine's memory (`memory`: bytes, when known) before
/// anything is allocated: the bench generates every rank's bf16 tokens on the host, `ranks x tokens x hidden x
/// 2` bytes at least (checked arithmetic: an overflow is "more than any machine"). The error names the token
/// flag (`ll_flag`: the LL sizes came from `--ll-tokens`) and the bytes needed.
fn check_fits_memory(mode: Mode, s: &Shape, memory: Option<usize>, ll_flag: bool) -> std::result::Result<(), CliError> {
    let flag = if mode == Mode::Ll && ll_flag { "--ll-tokens" } else { "--tokens" };
    let needed = s.ranks.checked_mul(s.tokens).and_then(|n| n.checked_mul(s.hidden)).and_then(|n| n.checked_mul(2));
    let what = format!(
        "{}: {flag} {} needs at least {} bytes of host memory for the inputs alone ({} ranks x {} tokens x hidden {} x 2 bytes)",
        mode.name(),
        s.tokens,
        needed.map_or_else(|| format!("more than {}", usize::MAX), |n| n.to_string()),
        s.ranks,
        s.tokens,
        s.hidden
    );
    match (needed, memory) {
        (None, _) => Err(CliError(format!("{what}; no machine has that much"))),
        (Some(n), Some(m)) if n > m => Err(CliError(format!("{what}; this machine has {m} bytes"))),
        _ => Ok(()),
    }
}

/// Cases of one batch, in the order the rank workers run them.
fn cases(b: &Batch) -> Vec<Case> {
    let (mode, routing) = (b.mode, b.routing);
    let mut out = Vec::new();
    match mode {
        Mode::Ht => {
            for &num_sms in &b.sms {
                for &dtype in &b.dtypes {
                    out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms });
                }
                out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms });
            }
        }
        Mode::Ll => {
            for &dtype in &b.dtypes {
                out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms: None });
            }
            out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms: None });
        }
    }
    out
}

/// Bytes per rank (mean over ranks) that a case moves: (logical, wire).
fn bytes_moved(case: &Case, inputs: &Inputs) -> (f64, f64) {
    let s = &inputs.shape;
    let r = &inputs.reference;
    let n = s.ranks as f64;
    match case.mode {
        Mode::Ht => {
            let row = match (case.op, case.dtype) {
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4,
                _ => 2 * s.hidden,
            } as f64;
            let recv: usize = r.recv_rows.iter().map(|v| v.len()).sum();
            let own: usize = (0..s.ranks).map(|k| r.own_rows(k)).sum();
            (recv as f64 * row / n, (recv - own) as f64 * row / n)
        }
        Mode::Ll => {
            let row = match (case.op, case.dtype) {
                // DeepEP counts 16 bytes of per-token metadata with each FP8 row.
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4 + 16,
                _ => 2 * s.hidden,
            } as f64;
            let sel: usize = r.selections.iter().sum();
            let cross: usize = r.cross_pairs.iter().sum();
            (sel as f64 * row / n, cross as f64 * row / n)
        }
    }
}

/// Bytes each rank sends over each path in one low-latency call across nodes.
struct PathBytes {
    rdma: Vec<usize>,
    nvlink: Vec<usize>,
}

/// The internode byte model (`docs/internode.md`) on these inputs: one message per (token, distinct
/// destination rank); dispatch sends [`moelink::internode::ll_message_bytes`] from the token's rank, combine
/// a bf16 row back from the destination (pre-reduced: dispatch carries the weights). A message to a rank of
/// the sender's own node goes over NVLink when `nvlink_in_node`, over RDMA otherwise; one to itself nowhere.
/// Meta blocks (a few hundred bytes per peer) are not counted.
fn ll_path_bytes(case: &Case, inputs: &Inputs, topology: &moelink::Topology, nvlink_in_node: bool) -> PathBytes {
    let s = &inputs.shape;
    let mut paths = PathBytes { rdma: vec![0; s.ranks], nvlink: vec![0; s.ranks] };
    let msg = match case.op {
        Op::Dispatch => moelink::internode::ll_message_bytes(s.hidden, s.topk, case.dtype == Dtype::Fp8),
        Op::Combine => 2 * s.hidden,
    };
    let experts_per_rank = s.local_experts().max(1);
    for (src, r) in inputs.ranks.iter().enumerate() {
        for token in r.topk_idx.chunks(s.topk.max(1)) {
            let mut dests: Vec<usize> = token.iter().filter(|&&e| e >= 0).map(|&e| e as usize / experts_per_rank).collect();
            dests.sort_unstable();
            dests.dedup();
            for dst in dests.into_iter().filter(|&d| d != src && d < s.ranks) {
                let sender = if case.op == Op::Dispatch { src } else { dst };
                let receiver = if case.op == Op::Dispatch { dst } else { src };
                if nvlink_in_node && topology.node_of(sender) == topology.node_of(receiver) {
                    paths.nvlink[sender] += msg;
                } else {
                    paths.rdma[sender] += msg;
                }
            }
        }
    }
    paths
}

/// DeepEP's internode accounting for the high-throughput calls (its `test_internode.py`), per rank: RDMA
/// bytes = the rank's tokens times their distinct destination nodes (its own node included) times the row;
/// NVLink bytes = the rows the rank receives times the row. Rows: FP8 `H + 4 H / 128`, bf16 `2 H`; combine
/// moves bf16 rows back the same ways. What crosses a NIC is less (a token's own node is not); `moelink
/// bench bytes` counts both.
fn ht_path_bytes(case: &Case, inputs: &Inputs, topology: &moelink::Topology) -> PathBytes {
    let s = &inputs.shape;
    let row = match (case.op, case.dtype) {
        (Op::Dispatch, Dtype::Fp8) => s.hidden + 4 * s.hidden / 128,
        _ => 2 * s.hidden,
    };
    let mut paths = PathBytes { rdma: vec![0; s.ranks], nvlink: vec![0; s.ranks] };
    let experts_per_rank = s.local_experts().max(1);
    for (src, r) in inputs.ranks.iter().enumerate() {
        for token in r.topk_idx.chunks(s.topk.max(1)) {
            let mut ranks: Vec<usize> = token.iter().filter(|&&e| e >= 0).map(|&e| e as usize / experts_per_rank).collect();
            ranks.sort_unstable();
            ranks.dedup();
            let mut nodes: Vec<usize> = ranks.iter().map(|&d| topology.node_of(d)).collect();
            nodes.dedup();
            paths.rdma[src] += nodes.len() * row;
            for d in ranks.into_iter().filter(|&d| d < s.ranks) {
                paths.nvlink[d] += row;
            }
        }
    }
    paths
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Per repetition, the slowest rank's time.
fn slowest_per_rep(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let reps = per_rank.iter().map(|v| v.len()).min().unwrap_or(0);
    (0..reps).map(|i| per_rank.iter().map(|v| v[i]).fold(0.0, f64::max)).collect()
}

/// Median over repetitions of the slowest rank.
fn slowest_rank_median(per_rank: &[Vec<f64>]) -> f64 {
    median(slowest_per_rep(per_rank))
}

/// Kernel-trace points over ranks and repetitions: per point, the median over repetitions of the blocks'
/// median stamp, last stamp and block 0's stamp (µs after the kernel's first block started), the largest
/// over ranks.
fn trace_points_json<'a>(per_rank: impl Iterator<Item = &'a [moelink::diag::KernelTrace]>) -> serde_json::Value {
    let mut points: Vec<(&'static str, f64, f64, f64)> = Vec::new();
    for traces in per_rank {
        let names: Vec<&'static str> = traces.first().map(|t| t.points.iter().map(|p| p.name).collect()).unwrap_or_default();
        for name in names {
            let of = |f: fn(&moelink::diag::TracePoint) -> f64| {
                median(traces.iter().filter_map(|t| t.points.iter().find(|p| p.name == name)).map(f).collect())
            };
            let (med, last, b0) = (of(|p| p.median_us), of(|p| p.max_us), of(|p| p.block0_us.unwrap_or(f64::NAN)));
            match points.iter_mut().find(|p| p.0 == name) {
                Some(p) => {
                    p.1 = p.1.max(med);
                    p.2 = p.2.max(last);
                    p.3 = p.3.max(b0);
                }
                None => points.push((name, med, last, b0)),
            }
        }
    }
    serde_json::Value::Array(
        points
            .into_iter()
            .map(|(n, m, l, b0)| serde_json::json!({"point": n, "median_us": m, "last_us": l, "block0_us": b0.is_finite().then_some(b0)}))
            .collect(),
    )
}

/// Runs `moelink bench`.
pub fn run(a: &BenchArgs) -> std::result::Result<(), CliError> {
    // Every buffer of the run starts from these: the environment's tracing and tuning, and --ll-trace.
    let mut base = crate::env::buffer_options();
    base.kernel_tracing.low_latency |= a.ll_trace;
    let group: Option<Arc<dyn moelink::Group>> = if a.process {
        let g = moelink::TcpGroup::from_env().map_err(|e| CliError(format!("--process: cannot join the process group: {e}")))?;
        Some(Arc::new(g))
    } else {
        None
    };
    let p = plan(a, group.as_ref().map(|g| g.size()))?;
    // In process mode every rank measures; rank 0 alone reports.
    let quiet = group.as_ref().is_some_and(|g| g.rank() != 0);
    // Where the results go is checked before anything is measured: a bad path must not cost the run.
    if let Some(path) = a.json.as_ref().filter(|_| !quiet) {
        record::check_output("--json", path, None).map_err(CliError)?;
    }
    let mut plot_with = Vec::new();
    if let Some(path) = a.plot.as_ref().filter(|_| !quiet) {
        record::check_output("--plot", path, Some("png")).map_err(CliError)?;
        for extra in &a.plot_with {
            plot_with.push(plot::other_run(extra, record::read_json(extra).map_err(|e| CliError(format!("--plot-with {e}")))?));
        }
    }
    if let Some((topology, rdma)) = &p.internode {
        base.topology = Some(*topology);
        base.rdma = rdma.clone();
    }
    let facts = RunFacts {
        system: "moelink".into(),
        backend: sys::backend_name(p.backend).into(),
        device: sys::device_name(p.backend),
        gpus: p.gpus,
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    let (num_nvl_bytes, num_rdma_bytes) = buffer_bytes(&p.batches, p.internode.as_ref().map(|(t, _)| *t));
    if !quiet {
        println!("{}", header(&p, &facts, num_nvl_bytes, num_rdma_bytes));
    }
    let all_cases: Vec<Vec<Case>> = p.batches.iter().map(cases).collect();
    let total = (all_cases.iter().map(Vec::len).sum::<usize>() * (p.warmup + p.reps)) as u64;
    let progress = if std::io::stderr().is_terminal() && !quiet { ProgressBar::new(total) } else { ProgressBar::hidden() };
    progress.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} reps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut records = Vec::new();
    let started = Instant::now();
    for (i, (batch, case_list)) in p.batches.iter().zip(&all_cases).enumerate() {
        let batch_start = Instant::now();
        let what = format!("{} {} tokens {}", batch.mode.name(), batch.shape.tokens, batch.routing.name());
        progress.set_message(format!("{what}: inputs"));
        let want_fp8_payload = batch.mode == Mode::Ht && batch.dtypes.contains(&Dtype::Fp8);
        let nodes = p.internode.as_ref().map_or(1, |(t, _)| t.num_nodes);
        let inputs = Inputs::generate(batch.shape, batch.routing.kind(nodes, a.max_nodes), a.seed, want_fp8_payload);
        progress.set_message(what.clone());
        let job = Job {
            inputs: &inputs,
            cases: case_list,
            backend: p.backend,
            host_check: p.backend == BackendKind::Cuda && !a.no_host_check,
            warmup: p.warmup,
            reps: p.reps,
            hook: a.hook,
            progress: &progress,
            base: &base,
        };
        let run_rank = |g: Arc<dyn moelink::Group>| match batch.mode {
            Mode::Ht => ht::run_rank(g, &job, num_nvl_bytes, num_rdma_bytes),
            Mode::Ll => ll::run_rank(g, &job, num_rdma_bytes),
        };
        let results = match &group {
            Some(g) => process::gather(g.as_ref(), run_rank(g.clone())).map_err(|e| CliError(format!("--process: {e}")))?,
            None => {
                let timeout = Duration::from_secs(a.timeout_s.max(1));
                moelink::group::run_ranks_with_timeout(p.ranks, timeout, |g| run_rank(Arc::new(g)))
            }
        };
        if quiet {
            continue;
        }
        let mut new = summarize(case_list, &inputs, &results, &facts, &p, a);
        // Tuning and experiments act on the CUDA kernels only (the host backend ignores them).
        if p.backend == BackendKind::Cuda {
            for r in &mut new {
                r.extra.extend(crate::env::record_fields(&base.tuning).into_iter().map(|(k, v)| (k.to_string(), v)));
            }
        }
        let failed = new.iter().filter(|r| !matches!(r.status, Status::Ok | Status::Unavailable)).count();
        let line = format!(
            "batch {}/{}: {what}, {} cases{} in {:.1} s (total {:.1} s)",
            i + 1,
            p.batches.len(),
            new.len(),
            if failed > 0 { format!(", {failed} FAILED") } else { String::new() },
            batch_start.elapsed().as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        if progress.is_hidden() {
            println!("{line}");
        } else {
            progress.println(line);
        }
        records.extend(new);
        if let Some(path) = &a.json {
            record::write_json(path, &records).map_err(CliError)?;
        }
    }
    progress.finish_and_clear();
    if quiet {
        return Ok(());
    }

    println!("{}", render(&records, p.backend));
    if let Some(path) = &a.json {
        println!("wrote {} records to {}", records.len(), path.display());
    }
    if let Some(path) = &a.plot {
        let mut all = records.clone();
        all.extend(plot_with.into_iter().flatten());
        plot::draw(path, &all, a.plot_metric).map_err(CliError)?;
        println!("wrote the plot to {}", path.display());
    }
    let bad: Vec<&Record> = records.iter().filter(|r| matches!(r.status, Status::Incorrect | Status::Error)).collect();
    if !bad.is_empty() {
        return Err(CliError(format!(
            "{} of {} measurements failed (first: {} {} {}: {})",
            bad.len(),
            records.len(),
            bad[0].mode,
            bad[0].op,
            bad[0].dtype.as_deref().unwrap_or("-"),
            bad[0].error.as_deref().unwrap_or("?")
        )));
    }
    Ok(())
}

/// What the times are, in a line.
fn timer_line(backend: BackendKind) -> &'static str {
    match backend {
        BackendKind::Cuda => {
            "CUDA events behind a GPU barrier and an L2 flush, per rep: HT prepare_dispatch + dispatch_into (count exchange \
             + host wait + dispatch) and combine_into into preallocated outputs; LL one CUDA-graph replay (--hook: send and \
             receive graphs apart; MOELINK_LL_TRACE=1: kernel spans, and dispatch + combine back to back as DeepEP times)"
        }
        _ => "wall clock after a barrier, per rep, around the plain calls (preallocated outputs)",
    }
}

fn header(p: &Plan, f: &RunFacts, nvl: usize, rdma: usize) -> String {
    let backend = match (p.backend, &p.fallback_reason) {
        (BackendKind::Cuda, _) => format!("cuda on {} x {}", p.gpus, f.device),
        (_, Some(why)) => format!(
            "host (CPU threads on {}; no usable GPU: {why}) -- these times measure the CPU reference, not GPU performance",
            f.device
        ),
        (_, None) => format!("host (CPU threads on {}) -- these times measure the CPU reference, not GPU performance", f.device),
    };
    let mib = |b: usize| b.div_ceil(1 << 20);
    let nodes = match &p.internode {
        Some((t, rdma)) => format!(
            "\n  nodes {t} ({} transport, peers of a node over {}){}",
            rdma.transport.name(),
            if rdma.allow_nvlink_for_low_latency_mode { "NVLink" } else { "the transport" },
            if p.backend == BackendKind::Cuda {
                " -- virtual nodes on this machine: no NIC is crossed, so the times are not network latency \
                 (rdma_bytes and rdma_floor_us_400g give the byte model's figures)"
            } else {
                ""
            }
        ),
        None => String::new(),
    };
    let shared = match p.gpus_shared_by {
        Some(n) => format!(
            "\n  up to {n} ranks share each GPU ({}): they exchange through its memory, so no time here is an \
             NVLink or network figure",
            if p.process { "one process each" } else { "thread mode" }
        ),
        None => String::new(),
    };
    format!(
        "moelink bench | backend: {backend}{nodes}{shared}\n  ranks {} | reps {} (+{} warm-up) | {} batches | buffers: HT {} MiB, LL {} MiB | commit {} | {}\n  \
         timer: {}",
        p.ranks,
        p.reps,
        p.warmup,
        p.batches.len(),
        mib(nvl),
        mib(rdma),
        f.commit,
        f.date,
        timer_line(p.backend)
    )
}

/// Folds the ranks' outcomes of each case into a record.
fn summarize(
    cases: &[Case],
    inputs: &Inputs,
    results: &[Result<Vec<RankOutcome>>],
    facts: &RunFacts,
    p: &Plan,
    a: &BenchArgs,
) -> Vec<Record> {
    let s = &inputs.shape;
    let rank_errors: Vec<&moelink::Error> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let whole_run_error = first_cause(&rank_errors);
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut rec = Record::new(facts, c.mode.name(), c.op.name(), p.ranks);
            rec.dtype = Some(c.dtype.name().into());
            rec.tokens = Some(s.tokens);
            rec.hidden = Some(s.hidden);
            rec.topk = Some(s.topk);
            rec.experts = Some(s.experts);
            rec.routing = Some(c.routing.name().into());
            if c.routing == RoutingKind::NodeLimited {
                rec.extra.insert("max_nodes".into(), serde_json::json!(a.max_nodes));
            }
            rec.num_sms = c.num_sms;
            if let Some((topology, rdma)) = &p.internode {
                rec.nodes = Some(topology.num_nodes);
                rec.ranks_per_node = Some(topology.ranks_per_node);
                rec.transport = Some(rdma.transport.name().into());
                let paths = match c.mode {
                    Mode::Ll => ll_path_bytes(c, inputs, topology, rdma.allow_nvlink_for_low_latency_mode),
                    Mode::Ht => ht_path_bytes(c, inputs, topology),
                };
                let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
                let max_rdma = paths.rdma.iter().copied().max().unwrap_or(0);
                rec.extra.insert("rdma_bytes".into(), serde_json::json!(mean(&paths.rdma)));
                rec.extra.insert("rdma_bytes_max".into(), serde_json::json!(max_rdma));
                rec.extra.insert("nvlink_bytes".into(), serde_json::json!(mean(&paths.nvlink)));
                rec.extra.insert("nvl_bytes".into(), serde_json::json!(mean(&paths.nvlink)));
                // The floor one 400 Gb/s NIC per GPU (50 GB/s) would set: the busiest rank's RDMA bytes.
                rec.extra.insert("rdma_floor_us_400g".into(), serde_json::json!(max_rdma as f64 / 50e3));
            }
            let outs: Vec<&RankOutcome> = results.iter().filter_map(|r| r.as_ref().ok()).filter_map(|v| v.get(i)).collect();
            if let Some(err) = &whole_run_error {
                rec.status = Status::Error;
                rec.error = Some(err.clone());
                return rec;
            }
            if c.mode == Mode::Ht {
                rec.num_sms = outs.iter().find_map(|o| o.num_sms).or(c.num_sms);
            }
            if let Some(why) = outs.iter().find_map(|o| o.unavailable.clone()) {
                rec.status = Status::Unavailable;
                rec.error = Some(why);
                return rec;
            }
            if let Some(e) = outs.iter().find_map(|o| o.error.clone()) {
                rec.status = Status::Error;
                rec.error = Some(e);
                return rec;
            }
            let per_rank: Vec<Vec<f64>> = outs.iter().map(|o| o.times_us.clone()).collect();
            let slowest = slowest_per_rep(&per_rank);
            let t = median(slowest.clone());
            let (logical, wire) = bytes_moved(c, inputs);
            rec.time_us = Some(t);
            rec.logical_gbps = Some(logical / (t * 1e3));
            // Across nodes, the byte model's bytes per rank over the slowest rank's time (DeepEP's "RDMA" and
            // "NVL" GB/s).
            for (bytes, gbps) in [("rdma_bytes", "rdma_gbps"), ("nvl_bytes", "nvl_gbps")] {
                if let Some(b) = rec.extra.get(bytes).and_then(|v| v.as_f64()) {
                    rec.extra.insert(gbps.into(), serde_json::json!(b / (t * 1e3)));
                }
            }
            rec.wire_gbps = Some(wire / (t * 1e3));
            rec.reps = Some(p.reps);
            rec.warmup = Some(p.warmup);
            rec.timer = outs.iter().find_map(|o| o.timer).map(String::from);
            if !slowest.is_empty() {
                rec.extra.insert("time_us_min".into(), serde_json::json!(slowest.iter().copied().fold(f64::INFINITY, f64::min)));
                rec.extra.insert("time_us_max".into(), serde_json::json!(slowest.iter().copied().fold(0.0, f64::max)));
            }
            let failures: Vec<String> =
                outs.iter().enumerate().flat_map(|(r, o)| o.failures.iter().map(move |f| format!("rank {r}: {f}"))).collect();
            rec.correct = Some(failures.is_empty());
            rec.status = if failures.is_empty() { Status::Ok } else { Status::Incorrect };
            if let Some(first) = failures.first() {
                rec.error =
                    Some(format!("{first}{}", if failures.len() > 1 { format!(" (+{} more)", failures.len() - 1) } else { String::new() }));
            }
            if p.backend == BackendKind::Cuda {
                if let Some(m) = outs.iter().map(|o| o.matches_host).collect::<Option<Vec<bool>>>() {
                    rec.extra.insert("matches_host".into(), serde_json::json!(m.iter().all(|&b| b)));
                }
            }
            if let Some(ceiling) = a.p2p_ceiling_gbps.filter(|c| *c > 0.0) {
                rec.extra.insert("pct_of_p2p_ceiling".into(), serde_json::json!(100.0 * wire / (t * 1e3) / ceiling));
            }
            let send: Vec<Vec<f64>> = outs.iter().map(|o| o.send_us.clone()).collect();
            let recv: Vec<Vec<f64>> = outs.iter().map(|o| o.recv_us.clone()).collect();
            if send.iter().all(|v| !v.is_empty()) && recv.iter().all(|v| !v.is_empty()) {
                rec.extra.insert("send_us".into(), serde_json::json!(slowest_rank_median(&send)));
                rec.extra.insert("recv_us".into(), serde_json::json!(slowest_rank_median(&recv)));
            }
            for (i, key) in ["kernel", "send_kernel", "recv_kernel"].iter().enumerate() {
                let spans: Vec<Vec<f64>> = outs.iter().map(|o| o.traces[i].iter().map(|t| t.span_us).collect()).collect();
                if spans.iter().all(|v| !v.is_empty()) {
                    rec.extra.insert(format!("{key}_us"), serde_json::json!(slowest_rank_median(&spans)));
                    rec.extra.insert(format!("{key}_trace"), trace_points_json(outs.iter().map(|o| o.traces[i].as_slice())));
                }
            }
            for (i, key) in ["loop_dispatch_kernel_us", "loop_combine_kernel_us", "loop_pair_us"].iter().enumerate() {
                let v: Vec<Vec<f64>> = outs.iter().map(|o| o.loop_times[i].clone()).collect();
                if v.iter().all(|v| !v.is_empty()) {
                    rec.extra.insert((*key).into(), serde_json::json!(slowest_rank_median(&v)));
                }
            }
            for (i, key) in ["loop_dispatch_trace", "loop_combine_trace"].iter().enumerate() {
                if outs.iter().all(|o| !o.loop_traces[i].is_empty()) {
                    rec.extra.insert((*key).into(), trace_points_json(outs.iter().map(|o| o.loop_traces[i].as_slice())));
                }
            }
            let cached: Vec<Vec<f64>> = outs.iter().map(|o| o.cached_us.clone()).collect();
            if cached.iter().all(|v| !v.is_empty()) {
                let ct = slowest_rank_median(&cached);
                rec.extra.insert("cached_us".into(), serde_json::json!(ct));
                rec.extra.insert("cached_logical_gbps".into(), serde_json::json!(logical / (ct * 1e3)));
            }
            if c.mode == Mode::Ll {
                // Dispatch carried the top-k weights, so combine pre-reduces on the expert side (moelink's
                // extension; DeepEP sends one row per expert instead).
                rec.extra.insert("pre_reduced".into(), serde_json::json!(true));
            }
            rec
        })
        .collect()
}

/// One column of the bench's table: a title, whether it is numeric (right-aligned), each record's cell, and
/// what its unit means (printed under the table when the column is shown).
struct Column {
    title: &'static str,
    numeric: bool,
    cells: Vec<String>,
    legend: Option<&'static str>,
}

/// The bench's one table: a row per measurement. Columns whose value is the same in every row (ranks, shape,
/// routing) move into a line above it; columns only some runs fill (cached dispatch, receive hook, kernel
/// spans, SMs on the GPU) appear when a row has them. Under the table, what each unit is.
fn render(records: &[Record], backend: BackendKind) -> String {
    let opt = |v: Option<usize>| v.map_or("-".to_string(), |n| n.to_string());
    let measured = |r: &Record| matches!(r.status, Status::Ok | Status::Incorrect);
    let extra = |r: &Record, k: &str| r.extra.get(k).and_then(|v| v.as_f64());
    let col =
        |title, numeric, legend, f: &dyn Fn(&Record) -> String| Column { title, numeric, legend, cells: records.iter().map(f).collect() };
    // Identity columns: always mode/op/dtype; the others fold into the line above the table when constant.
    let mut lead = vec![
        col("mode", false, None, &|r| r.mode.clone()),
        col("op", false, None, &|r| r.op.clone()),
        col("dtype", false, None, &|r| r.dtype.clone().unwrap_or_else(|| "-".into())),
    ];
    let mut foldable = vec![
        col("ranks", true, None, &|r| r.ranks.to_string()),
        col("tokens", true, None, &|r| opt(r.tokens)),
        col("hidden", true, None, &|r| opt(r.hidden)),
        col("topk", true, None, &|r| opt(r.topk)),
        col("experts", true, None, &|r| opt(r.experts)),
        col("routing", false, None, &|r| r.routing.clone().unwrap_or_else(|| "-".into())),
    ];
    // Across nodes: the topology and the transport between nodes.
    if records.iter().any(|r| r.nodes.is_some()) {
        foldable.push(col("nodes", false, None, &|r| format!("{}x{}", r.nodes.unwrap_or(1), r.ranks_per_node.unwrap_or(r.ranks))));
        foldable.push(col("transport", false, None, &|r| r.transport.clone().unwrap_or_else(|| "-".into())));
    }
    // SMs only mean something for the GPU's kernels; the host backend runs on CPU threads.
    if backend == BackendKind::Cuda {
        foldable.push(col("SMs", true, Some("SMs: the blocks the high-throughput kernels ran on (one per SM)"), &|r| opt(r.num_sms)));
    }
    let mut same = Vec::new();
    for c in foldable {
        match c.cells.first() {
            Some(first) if records.len() > 1 && c.cells.iter().all(|v| v == first) => same.push(format!("{} {first}", c.title)),
            _ => lead.push(c),
        }
    }
    let time = |r: &Record, v: Option<f64>| if measured(r) { v.map_or("-".into(), num) } else { String::new() };
    let pair = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{}+{}", num(a), num(b)),
        _ => "-".into(),
    };
    let mut body = vec![
        col("time µs", true, Some("time µs: the median over repetitions of the slowest rank (per repetition the largest time of any rank)"), &|r| {
            time(r, r.time_us)
        }),
        col("min-max µs", true, Some("min-max µs: the fastest and the slowest repetition (slowest rank each)"), &|r| {
            match (extra(r, "time_us_min"), extra(r, "time_us_max")) {
                (Some(lo), Some(hi)) if measured(r) => format!("{}-{}", num(lo), num(hi)),
                _ => "-".into(),
            }
        }),
        col(
            "logical GB/s",
            true,
            Some("logical GB/s: the bytes of the rows a rank receives, its own rows included (DeepEP's accounting), per rank, over time µs"),
            &|r| time(r, r.logical_gbps),
        ),
        col(
            "wire GB/s",
            true,
            Some("wire GB/s: the same without the rows a rank sends to itself, i.e. the bytes that cross between ranks (NVLink on a GPU node)"),
            &|r| time(r, r.wire_gbps),
        ),
        col("cached µs", true, Some("cached µs: the same dispatch again with the first one's handle (no count exchange, no top-k), as DeepEP's benchmark times"), &|r| {
            extra(r, "cached_us").map_or("-".into(), num)
        }),
        col("send+recv µs", true, Some("send+recv µs: receive-hook mode (--hook), the send phase and the receive phase timed apart"), &|r| {
            pair(extra(r, "send_us"), extra(r, "recv_us"))
        }),
        col("kernel µs", true, Some("kernel µs: the kernel's own span from its trace (--ll-trace), without the launch"), &|r| {
            extra(r, "kernel_us").map_or("-".into(), num)
        }),
        col(
            "back-to-back µs",
            true,
            Some("back-to-back µs: dispatch+combine kernel spans replayed back to back with no barrier between calls (--ll-trace), as DeepEP times"),
            &|r| pair(extra(r, "loop_dispatch_kernel_us"), extra(r, "loop_combine_kernel_us")),
        ),
        col(
            "RDMA KB/rank",
            true,
            Some(
                "RDMA KB/rank (max), NVLink KB/rank: across nodes, the bytes a call sends per rank over each path by the byte model \
                 of docs/internode.md (HT as DeepEP's internode test counts them, LL per destination rank; meta blocks not \
                 counted), the mean over ranks and the busiest rank's",
            ),
            &|r| match (extra(r, "rdma_bytes"), extra(r, "rdma_bytes_max")) {
                (Some(mean), Some(max)) => format!("{:.1} ({:.1})", mean / 1e3, max / 1e3),
                _ => "-".into(),
            },
        ),
        col("NVLink KB/rank", true, None, &|r| extra(r, "nvlink_bytes").map_or("-".into(), |b| format!("{:.1}", b / 1e3))),
        col(
            "400G floor µs",
            true,
            Some("400G floor µs: the time the busiest rank's RDMA bytes take on one 400 Gb/s NIC (50 GB/s)"),
            &|r| extra(r, "rdma_floor_us_400g").map_or("-".into(), |v| format!("{v:.1}")),
        ),
        col(
            "RDMA GB/s",
            true,
            Some(
                "RDMA GB/s, NVL GB/s: those bytes over time µs (DeepEP's figures); ranks sharing one GPU or the emulated NIC \
                 cross no network, so these are not NIC or NVLink figures",
            ),
            &|r| time(r, extra(r, "rdma_gbps")),
        ),
        col("NVL GB/s", true, None, &|r| time(r, extra(r, "nvl_gbps"))),
        col("correct", false, Some("correct: checked bit for bit against the expected results before timing (on CUDA also against the host backend)"), &|r| {
            match r.status {
                Status::Ok => "yes".into(),
                Status::Incorrect => format!("NO: {}", r.error.as_deref().unwrap_or("?")),
                _ => String::new(),
            }
        }),
    ];
    // Optional measurements appear only when some row has them.
    body.retain(|c| c.cells.iter().any(|v| v != "-" && !v.is_empty()) || matches!(c.title, "time µs" | "correct"));
    let titles: Vec<&str> = lead.iter().chain(&body).map(|c| c.title).collect();
    let numeric: Vec<bool> = lead.iter().chain(&body).map(|c| c.numeric).collect();
    let mut t = Table::new(&titles, &numeric);
    for (i, r) in records.iter().enumerate() {
        let head: Vec<String> = lead.iter().map(|c| c.cells[i].clone()).collect();
        match r.status {
            Status::Unavailable => t.note(head, format!("unavailable: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Error => t.note(head, format!("error: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Ok | Status::Incorrect => t.row(head.into_iter().chain(body.iter().map(|c| c.cells[i].clone())).collect()),
        }
    }
    let mut out = String::new();
    if !same.is_empty() {
        out += &format!("every row: {}\n", same.join(", "));
    }
    out += &t.render();
    for legend in lead.iter().chain(&body).filter_map(|c| c.legend) {
        out += &format!("  {legend}\n");
    }
    out
}

#[cfg(test)]
mod tests {

    #[test]
    fn shapes_beyond_memory_are_refused_naming_the_flag() {
        let s = Shape { ranks: 4, tokens: 256, hidden: 1024, topk: 8, experts: 64 };
        assert!(check_fits_memory(Mode::Ht, &s, Some(1 << 30), false).is_ok());
        let e = check_fits_memory(Mode::Ht, &Shape { tokens: 1 << 20, ..s }, Some(1 << 30), false).unwrap_err().0;
        assert!(e.contains("--tokens 1048576") && e.contains(&format!("{} bytes", 4usize << 31)), "{e}");
        let e = check_fits_memory(Mode::Ll, &Shape { tokens: usize::MAX / 2, ..s }, None, true).unwrap_err().0;
        assert!(e.contains("--ll-tokens") && e.contains("no machine"), "{e}");
    }

    use super::*;
    use clap::Parser;

    /// Inputs the result checks must accept (seed 1) and inputs of the same shape they must reject (seed 2).
    pub(super) fn good_and_other(shape: Shape, fp8: bool) -> (Inputs, Inputs) {
        (Inputs::generate(shape, RouteKind::Uniform, 1, fp8), Inputs::generate(shape, RouteKind::Uniform, 2, fp8))
    }

    /// Runs `checks` on both ranks of a host-backend group (buffers of `opts`) and asserts the (check on the
    /// truth, check on other inputs) pairs it returns: the first finds nothing, the second finds something.
    pub(super) fn assert_checks_on_host<F>(opts: moelink::BufferOptions, checks: F)
    where
        F: Fn(&mut Buffer, usize) -> moelink::Result<Vec<(Vec<String>, Vec<String>)>> + Sync,
    {
        let per_rank = moelink::group::run_ranks(2, |g| {
            let me = moelink::Group::rank(&g);
            let mut buf = Buffer::new(std::sync::Arc::new(g), moelink::BufferOptions { backend: BackendKind::Host, ..opts.clone() })?;
            checks(&mut buf, me)
        });
        for (rank, r) in per_rank.into_iter().enumerate() {
            let pairs = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for (i, (truth, wrong)) in pairs.into_iter().enumerate() {
                assert!(truth.is_empty(), "rank {rank} check {i}: {truth:?}");
                assert!(!wrong.is_empty(), "rank {rank} check {i} accepted results for other inputs");
            }
        }
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn args(flags: &[&str]) -> BenchArgs {
        let mut argv = vec!["bench", "--backend", "host"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).expect("valid flags").args
    }

    #[test]
    fn across_nodes_the_bytes_split_by_path_and_bad_flags_are_refused() {
        // 4 ranks as 2x2, one expert per rank; token 0 of rank 0 picks experts 0 (itself), 1 (its node) and
        // 2, 3 (the other node); token 1 picks expert 3 twice and a -1 slot.
        let shape = Shape { ranks: 4, tokens: 2, hidden: 256, topk: 4, experts: 4 };
        let mut inputs = Inputs::generate(shape, RouteKind::Uniform, 1, false);
        for (r, rank) in inputs.ranks.iter_mut().enumerate() {
            rank.topk_idx = if r == 0 { vec![0, 1, 2, 3, 3, 3, -1, -1] } else { vec![-1; 8] };
        }
        let topology: moelink::Topology = "2x2".parse().unwrap();
        let case = |op, dtype| Case { mode: Mode::Ll, op, dtype, routing: RoutingKind::Uniform, num_sms: None };
        let msg = moelink::internode::ll_message_bytes(256, 4, true);
        let d = ll_path_bytes(&case(Op::Dispatch, Dtype::Fp8), &inputs, &topology, true);
        assert_eq!((d.rdma, d.nvlink), (vec![3 * msg, 0, 0, 0], vec![msg, 0, 0, 0]));
        let d = ll_path_bytes(&case(Op::Dispatch, Dtype::Fp8), &inputs, &topology, false);
        assert_eq!((d.rdma, d.nvlink), (vec![4 * msg, 0, 0, 0], vec![0; 4]));
        // Combine: each destination returns one bf16 row per message it received.
        let c = ll_path_bytes(&case(Op::Combine, Dtype::Bf16), &inputs, &topology, true);
        assert_eq!((c.rdma, c.nvlink), (vec![0, 0, 512, 1024], vec![0, 512, 0, 0]));

        let p = plan(&args(&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "emu-nic"]), None).unwrap();
        let (t, rdma) = p.internode.expect("2x2 spans nodes");
        assert_eq!((t.num_nodes, t.ranks_per_node, rdma.transport.name()), (2, 2, "emu-nic"));
        assert!(plan(&args(&["--mode", "ll", "--ranks", "4", "--topology", "1x4"]), None).unwrap().internode.is_none());
        // Both families run across nodes.
        assert!(plan(&args(&["--mode", "ht", "--ranks", "4", "--topology", "2x2"]), None).unwrap().internode.is_some());
        assert!(plan(&args(&["--ranks", "4", "--topology", "2x2"]), None).unwrap().internode.is_some());
        for (flags, says) in [
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x3"][..], "--topology"),
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "nvshmem"][..], "one process per rank"),
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "tcp"][..], "--transport"),
            (&["--mode", "ll", "--no-nvlink-in-node"][..], "--topology"),
            (&["--mode", "ll", "--routing", "node-limited"][..], "--topology across nodes"),
        ] {
            let e = plan(&args(flags), None).err().expect("refused").0;
            assert!(e.contains(says), "{flags:?}: {e}");
        }
    }

    #[test]
    fn slowest_rank_median_takes_the_max_per_rep_then_the_median() {
        let per_rank = vec![vec![1.0, 5.0, 3.0], vec![2.0, 1.0, 9.0]];
        assert_eq!(slowest_per_rep(&per_rank), vec![2.0, 5.0, 9.0]);
        assert_eq!(slowest_rank_median(&per_rank), 5.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn ht_bytes_follow_deepep_accounting() {
        let shape = Shape { ranks: 2, tokens: 16, hidden: 256, topk: 2, experts: 4 };
        let inputs = Inputs::generate(shape, RouteKind::Uniform, 1, false);
        let recv: usize = inputs.reference.recv_rows.iter().map(|v| v.len()).sum();
        let c = Case { mode: Mode::Ht, op: Op::Dispatch, dtype: Dtype::Fp8, routing: RoutingKind::Uniform, num_sms: None };
        let (logical, wire) = bytes_moved(&c, &inputs);
        assert_eq!(logical, recv as f64 * (256.0 + 2.0 * 4.0) / 2.0);
        assert!(wire < logical);
    }

    #[test]
    fn the_default_plan_is_deepeps_shapes() {
        let p = plan(&args(&[]), None).unwrap();
        let shapes: Vec<(Mode, usize, usize, usize, usize)> =
            p.batches.iter().map(|b| (b.mode, b.shape.tokens, b.shape.hidden, b.shape.topk, b.shape.experts)).collect();
        assert_eq!(shapes, vec![(Mode::Ht, 4096, 7168, 8, 256), (Mode::Ll, 128, 7168, 8, 288)]);
        assert_eq!(p.batches[0].dtypes, vec![Dtype::Bf16, Dtype::Fp8]);
        assert_eq!(p.batches[1].dtypes, vec![Dtype::Fp8]);
        assert!(p.batches.iter().all(|b| b.routing == RoutingKind::Uniform && b.sms == vec![None]));
    }

    #[test]
    fn token_lists_sweep_each_mode() {
        let p = plan(&args(&["--tokens", "512,1024", "--ll-tokens", "1,16,64", "--routing", "uniform,skewed"]), None).unwrap();
        let ht: Vec<(usize, RoutingKind)> = p.batches.iter().filter(|b| b.mode == Mode::Ht).map(|b| (b.shape.tokens, b.routing)).collect();
        assert_eq!(
            ht,
            [512, 512, 1024, 1024].into_iter().zip([RoutingKind::Uniform, RoutingKind::Skewed].into_iter().cycle()).collect::<Vec<_>>()
        );
        let ll: Vec<usize> = p.batches.iter().filter(|b| b.mode == Mode::Ll).map(|b| b.shape.tokens).collect();
        assert_eq!(ll, vec![1, 1, 16, 16, 64, 64]);
        // Without --ll-tokens, --tokens applies to LL too.
        let p = plan(&args(&["--mode", "ll", "--tokens", "8,32"]), None).unwrap();
        assert_eq!(p.batches.iter().map(|b| b.shape.tokens).collect::<Vec<_>>(), vec![8, 32]);
    }

    #[test]
    fn buffers_fit_the_largest_shape_of_each_mode() {
        let p = plan(&args(&["--tokens", "512,16384", "--ll-tokens", "1,256"]), None).unwrap();
        let (nvl, rdma) = buffer_bytes(&p.batches, None);
        for fp8 in [false, true] {
            assert!(nvl >= Buffer::ht_bytes_needed(16384, 7168, 8, 4, fp8));
        }
        assert_eq!(rdma, Buffer::ll_bytes_needed(256, 7168, 4, 288));
        // DeepEP's shapes: exactly what the CUDA backend asks for.
        let (nvl, rdma) = buffer_bytes(&plan(&args(&[]), None).unwrap().batches, None);
        assert_eq!(nvl, Buffer::ht_bytes_needed(4096, 7168, 8, 4, false).max(Buffer::ht_bytes_needed(4096, 7168, 8, 4, true)));
        assert_eq!(rdma, Buffer::ll_bytes_needed(128, 7168, 4, 288));
    }

    #[test]
    fn the_suite_measures_deepeps_shapes_first_then_the_sweeps() {
        let p = plan(&args(&["--suite"]), None).unwrap();
        let b: Vec<(Mode, usize, RoutingKind, Vec<Option<usize>>)> =
            p.batches.iter().map(|b| (b.mode, b.shape.tokens, b.routing, b.sms.clone())).collect();
        let s24 = vec![Some(24)];
        let u = RoutingKind::Uniform;
        assert_eq!(b[0], (Mode::Ht, 4096, u, [24, 8, 16, 32, 48, 64].map(Some).to_vec()));
        assert_eq!(b[1], (Mode::Ht, 4096, RoutingKind::Skewed, s24.clone()));
        assert_eq!(b[2], (Mode::Ll, 128, u, vec![None]));
        assert_eq!(b[3], (Mode::Ll, 128, RoutingKind::Skewed, vec![None]));
        let ht_sweep: Vec<usize> = b[4..].iter().filter(|x| x.0 == Mode::Ht).map(|x| x.1).collect();
        assert_eq!(ht_sweep, vec![512, 1024, 2048, 8192, 16384]);
        let ll_sweep: Vec<usize> = b[4..].iter().filter(|x| x.0 == Mode::Ll).map(|x| x.1).collect();
        assert_eq!(ll_sweep, vec![1, 16, 64, 256]);
        assert!(p.batches.iter().all(|b| b.mode == Mode::Ll || b.dtypes == vec![Dtype::Bf16, Dtype::Fp8]));
        assert!(p.batches.iter().all(|b| b.mode == Mode::Ht || b.dtypes == vec![Dtype::Fp8]));
        assert!(Cli::try_parse_from(["bench", "--suite", "--tokens", "8"]).is_err());
    }
}
