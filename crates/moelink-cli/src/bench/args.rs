//! `moelink bench`'s command line: the subcommands, the options and their value types.

use super::*;

use clap::{Args, Subcommand, ValueEnum};

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
    pub(super) fn kind(self) -> BackendKind {
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
    /// LL: dispatch without the top-k weights, as DeepEP's API does, so that combine sends every expert's
    /// row to its home rank and the home sums them (records get `ll_combine: per_expert`). Without it dispatch
    /// carries the weights (moelink's extension) and combine pre-reduces on the expert side (`pre_reduced`).
    #[arg(long)]
    pub ll_per_expert: bool,
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
    /// rank; the bench runs its ranks as threads). The emulated NIC takes settings, e.g.
    /// `emu-nic:rate=50,reorder=0` (a 50 GB/s NIC per rank, in order).
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
