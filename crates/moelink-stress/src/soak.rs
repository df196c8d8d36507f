//! `moelink-stress soak`: many small randomized rounds of every kernel family, each checked bit for bit against the
//! host backend on the same inputs, with device and host memory sampled along the way.
//!
//! Thread mode, one rank per GPU. Every rank holds two buffers over the same group: the *primary* (CUDA, or
//! the host backend with `--backend host`) and its *twin* (always the host backend, the oracle). Every round
//! runs the same operation on both with the same inputs and compares: dispatch outputs byte for byte (the
//! valid rows; in no-sync mode the tail of `-1` ids and zero weights too), combine outputs bit for bit (the
//! summation order is part of the contract).
//!
//! Families (`--families`), one round of each per outer round:
//! - `ht`: layout → fresh dispatch (BF16 or FP8, with or without top-k, CPU-sync or no-sync) → combine
//!   (identity experts, optional weights and biases); with probability `--graph-fraction` the library's
//!   CUDA-graph pipeline of layout → no-sync dispatch → combine ([`moelink::graph::HtGraph`]), replayed
//!   with three sets of inputs;
//! - `ht-cached`: a fresh dispatch, then a cached dispatch of a new payload with its handle, then combine;
//! - `ll`: low-latency dispatch (BF16 / FP8 / FP8 round-scale / UE8M0) + per-expert combine; also CUDA graph
//!   rounds (dispatch + combine in one graph, [`moelink::graph::LlGraph`], replayed with three sets of
//!   inputs);
//! - `ll-prereduced`: top-k weights given at dispatch, pre-reduced combine;
//! - `ll-hook`: both calls with `return_recv_hook`, the receive phases run through the hooks.
//!
//! Randomized per round: tokens per rank `0..=T_max` (an empty rank now and then), the hidden size (from
//! `--hidden`), the expert count, routing (uniform, skewed, holes of `-1`, a rank nobody routes to), FP8 on or
//! off, alignment, SM count, biases. Low-latency shapes (hidden, top-k, experts, `T_max`) change every
//! `--ll-block` rounds, with `clean_low_latency_buffer` between (DeepEP's rule; the layout of the LL region
//! depends on them). All ranks derive the round's plan from the same seed; inputs are per rank.
//!
//! Memory: every `--mem-every` rounds each rank reads its GPU's used memory (`cuMemGetInfo`) and rank 0 the
//! process's resident set (`VmRSS`) and the C heap's statistics (`mallinfo2`: bytes in live allocations and
//! bytes held from the system), all ranks stopped at a barrier between rounds; with `--malloc-trim` rank 0
//! then also returns the heap's free memory to the system (`malloc_trim(0)`) and reads `VmRSS` again. The
//! JSON reports, per series, the first sample, the sample after warm-up (kernels compiled, pools filled),
//! the last and the largest. A sample that falls on an LL block boundary frees the old block first, so such
//! samples hold no block or round data: a leak grows the heap's in-use bytes from sample to sample (or,
//! outside the heap, the RSS after the trim); free chunks the allocator keeps grow only the RSS and the held
//! bytes. `--time-budget-s` stops early (at an agreed round) with honest counts. Exit status 1 on any
//! mismatch or error.
//!
//! Across nodes (`--topology NxL`, virtual nodes on `ptr` or `emu-nic`) every family runs the internode
//! kernels against a host-backend twin of the same topology. The high-throughput families then run in
//! rounds: the buffers are sized with [`moelink::internode::ht_bytes_needed`] for rounds of
//! `--ht-round-tokens` tokens (default `T_max / 4`) at the largest hidden size, so a call of more tokens
//! runs several rounds (counted as `multi_round_rounds`), of `--ht-chunk-tokens` tokens per chunk. Their
//! routing adds the node-level cases ([`RouteKind::draw_nodes`]: node-limited, an empty node, a skew to one
//! node) and, now and then, a node whose ranks (or all ranks) send no token; `config.num_sms` stays between
//! what the internode kernels need (4) and the rank's share of the GPU less the emulated NIC's blocks and a
//! spare SM.
//! One buffer pair runs every family: across nodes an HT call writes the RDMA region the LL calls share
//! (DeepEP's rule; the buffer refuses LL calls until `clean_low_latency_buffer`), so the first LL round
//! after HT rounds cleans it first, with its block's shape.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use moelink::graph::{HtGraph, HtGraphSpec, LlGraph, LlGraphCombine, LlGraphSpec, LlGraphSplit};
use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, CombineArgs, Config, DType, DispatchArgs, Fp8E4M3, Group, LlCombineArgs, LlCombineOutputs,
    LlDispatchArgs, LlDispatchOutputs, LlHandle, LlQuant, Payload, Result, Routing, Tensor, TensorRef, ThreadGroup,
};
use moelink_cli::{sys, CliError};
use moelink_testkit::differ::{bytes_of, compare_dispatch, compare_layout, ll_valid_part, Diffs, SeenDispatch, SeenLayout};
use moelink_testkit::rng::{seed_of, Rng};
use moelink_testkit::routing::{route, RouteKind};
use moelink_testkit::values::{fp8_to_bf16_table, random_bf16, random_fp8, random_weights};
use serde::Serialize;

use crate::memory;

/// Kernel families the soak exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// High-throughput dispatch + combine (fresh routing; no-sync and CUDA-graph rounds included).
    Ht,
    /// High-throughput cached dispatch (re-using a handle), then combine.
    HtCached,
    /// Low-latency dispatch + per-expert combine (CUDA-graph rounds included).
    Ll,
    /// Low-latency with top-k weights at dispatch: pre-reduced combine.
    LlPrereduced,
    /// Low-latency with receive hooks on both calls.
    LlHook,
}

impl Family {
    /// Name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Family::Ht => "ht",
            Family::HtCached => "ht-cached",
            Family::Ll => "ll",
            Family::LlPrereduced => "ll-prereduced",
            Family::LlHook => "ll-hook",
        }
    }
    fn is_ll(self) -> bool {
        matches!(self, Family::Ll | Family::LlPrereduced | Family::LlHook)
    }
    fn code(self) -> u64 {
        self as u64 + 1
    }
}

/// Which backend the primary buffer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SoakBackend {
    /// CUDA when usable, else the host backend (then host is checked against host).
    Auto,
    /// CUDA kernels (fails when unavailable).
    Cuda,
    /// The host backend against itself (no GPU needed: checks the harness and the oracle's determinism).
    Host,
}

/// Options of `moelink-stress soak`.
#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Primary backend: auto, cuda or host. The twin is always the host backend.
    #[arg(long, value_enum, default_value_t = SoakBackend::Auto)]
    pub backend: SoakBackend,
    /// Ranks (threads; one GPU each on CUDA). Default: the number of GPUs, or 4 without one.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Rounds per family.
    #[arg(long, default_value_t = 10_000)]
    pub rounds: usize,
    /// Families, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ht,ht-cached,ll,ll-prereduced,ll-hook")]
    pub families: Vec<Family>,
    /// Largest high-throughput token count per rank (each round draws 0..=T_MAX).
    #[arg(long, default_value_t = 32)]
    pub t_max: usize,
    /// Largest low-latency `num_max_dispatch_tokens_per_rank` (each block draws one, each round 0..=it tokens).
    #[arg(long, default_value_t = 16)]
    pub ll_t_max: usize,
    /// Hidden sizes to draw from, comma-separated (multiples of 128; FP8 UE8M0 rounds need multiples of 512).
    #[arg(long, value_delimiter = ',', default_value = "256,2048,4096,5120,7168")]
    pub hidden: Vec<usize>,
    /// Top-k values to draw from, comma-separated (each is a JIT variant: keep the list short).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub topk: Vec<usize>,
    /// Fraction of `ht` and `ll` rounds run as CUDA-graph rounds (a pipeline built, then 3 replays; CUDA only).
    #[arg(long, default_value_t = 0.03)]
    pub graph_fraction: f64,
    /// Low-latency rounds per shape block (`clean_low_latency_buffer` between blocks).
    #[arg(long, default_value_t = 50)]
    pub ll_block: usize,
    /// Seed of every plan and input.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop after this many seconds (at an agreed round), reporting what ran.
    #[arg(long)]
    pub time_budget_s: Option<f64>,
    /// Sample memory every this many rounds.
    #[arg(long, default_value_t = 250)]
    pub mem_every: usize,
    /// At every memory sample, also return the C heap's free memory to the system (`malloc_trim(0)`) and
    /// sample the resident set again (`host_rss_after_trim`). Later RSS samples then start from a trimmed heap.
    #[arg(long)]
    pub malloc_trim: bool,
    /// Deadline of every wait inside a collective (the buffers' timeout_ms).
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Write the JSON summary to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Print progress every this many seconds (0: never).
    #[arg(long, default_value_t = 15.0)]
    pub progress_s: f64,
    /// Spread the ranks over nodes, NODESxRANKS_PER_NODE (e.g. 2x2: virtual nodes on this host). Every
    /// family then runs the internode kernels (the high-throughput ones in rounds, see --ht-round-tokens).
    #[arg(long, value_name = "NODESxRANKS")]
    pub topology: Option<String>,
    /// With --topology: size the buffers for high-throughput rounds of this many tokens per rank at the
    /// largest --hidden (smaller rows fit more), so that calls of more tokens run several rounds. Default:
    /// T_MAX / 4.
    #[arg(long, value_name = "TOKENS")]
    pub ht_round_tokens: Option<usize>,
    /// With --topology: tokens per chunk (one RDMA put with its signal) of the high-throughput kernels
    /// across nodes. Default: MOELINK_HT_SEND_CHUNK if set, else 4 (several chunks per round).
    #[arg(long, value_name = "TOKENS")]
    pub ht_chunk_tokens: Option<usize>,
    /// The RDMA transport between nodes with --topology: ptr, or emu-nic (the emulated NIC, reordering across
    /// QPs; default). One process holds every rank, so NVSHMEM cannot be used here.
    #[arg(long, default_value = "emu-nic")]
    pub transport: String,
    /// With --topology: low-latency kernels reach the ranks of their own node through the RDMA transport too
    /// (DeepEP's allow_nvlink_for_low_latency_mode = False).
    #[arg(long)]
    pub no_nvlink_in_node: bool,
}

// ================================================================================================ settings

/// The run's settings, shared by every rank.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// `cuda` or `host`.
    pub backend: String,
    /// Ranks.
    pub ranks: usize,
    /// Rounds per family asked for.
    pub rounds: usize,
    /// Families, in execution order.
    pub families: Vec<Family>,
    /// Largest HT tokens per rank.
    pub t_max: usize,
    /// Largest LL `num_max_dispatch_tokens_per_rank`.
    pub ll_t_max: usize,
    /// Hidden sizes drawn from.
    pub hidden: Vec<usize>,
    /// Top-k values drawn from.
    pub topk: Vec<usize>,
    /// Fraction of graph rounds in `ht` and `ll`.
    pub graph_fraction: f64,
    /// LL rounds per shape block.
    pub ll_block: usize,
    /// Seed.
    pub seed: u64,
    /// Time budget, seconds.
    pub time_budget_s: Option<f64>,
    /// Memory sample period in rounds.
    pub mem_every: usize,
    /// `malloc_trim(0)` at every memory sample (and the RSS after it sampled).
    pub malloc_trim: bool,
    /// Buffers' deadline.
    pub timeout_ms: u64,
    /// Bytes of each buffer's HT region.
    pub num_nvl_bytes: usize,
    /// Bytes of each buffer's LL region.
    pub num_rdma_bytes: usize,
    /// Nodes the ranks are spread over.
    pub nodes: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// The RDMA transport between nodes (`null` on one node).
    pub transport: Option<String>,
    /// Across nodes, with a high-throughput family: the HT round the buffers are sized for (tokens per rank
    /// at the largest hidden size).
    pub ht_round_tokens: Option<usize>,
    /// Across nodes: tokens per chunk of the internode HT kernels.
    pub ht_chunk_tokens: Option<usize>,
    /// Blocks the emulated NIC adds to every internode launch (0 for other transports).
    #[serde(skip)]
    nic_blocks: usize,
    #[serde(skip)]
    kind: BackendKind,
    #[serde(skip)]
    topology: Option<moelink::Topology>,
    #[serde(skip)]
    rdma: moelink::RdmaOptions,
}

impl Settings {
    fn largest_experts(&self) -> usize {
        self.ranks * 8
    }
}

/// Blocks the transport's emulated NIC adds to every internode launch.
fn nic_blocks(t: &moelink::Transport) -> usize {
    match t {
        moelink::Transport::EmuNic(o) => o.nic_blocks as usize,
        _ => 0,
    }
}

// ================================================================================================ per-rank state

/// Counters of one family on one rank.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FamilyCount {
    /// Rounds run.
    pub rounds: usize,
    /// Rounds with at least one difference.
    pub mismatches: usize,
    /// Graph rounds (each: capture + replays).
    pub graph_rounds: usize,
    /// Graph replays checked.
    pub graph_replays: usize,
    /// No-sync (worst-case sized) HT dispatches checked outside graphs.
    pub no_sync_rounds: usize,
    /// FP8 rounds.
    pub fp8_rounds: usize,
    /// Rounds where this rank dispatched no token.
    pub empty_rank_rounds: usize,
    /// Rounds with node-limited routing (drawn only across nodes: each token's experts on few nodes).
    pub node_limited_rounds: usize,
    /// HT rounds across nodes whose routing left a node without any token ([`RouteKind::EmptyNode`]).
    pub empty_node_rounds: usize,
    /// HT rounds across nodes with nearly every token going to one node ([`RouteKind::NodeSkewed`]).
    pub node_skewed_rounds: usize,
    /// HT rounds across nodes where every rank of a node (or every rank) had no token.
    pub silent_node_rounds: usize,
    /// HT calls across nodes that ran in two or more rounds (the largest token count of any rank above the
    /// buffer's tokens per round).
    pub multi_round_rounds: usize,
    /// The most rounds one HT call across nodes ran.
    pub most_rounds_per_call: usize,
}

/// One recorded problem.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    /// Family.
    pub family: String,
    /// Outer round.
    pub round: usize,
    /// Rank that saw it.
    pub rank: usize,
    /// The round's plan.
    pub plan: String,
    /// What differed, or the error.
    pub what: String,
}

/// A memory sample: (round, bytes).
type Sample = (usize, u64);

struct RankState {
    counts: Vec<FamilyCount>,
    failures: Vec<Failure>,
    error: Option<String>,
    device_mem: Vec<Sample>,
    host: HostSamples,
    ll: Option<LlBlock>,
    /// Across nodes: an HT call ran since the LL region was last cleaned (see the module docs).
    ll_dirty: bool,
    lut: [u16; 256],
}

impl RankState {
    fn new(families: usize) -> RankState {
        RankState {
            counts: vec![FamilyCount::default(); families],
            failures: Vec::new(),
            error: None,
            device_mem: Vec::new(),
            host: HostSamples::default(),
            ll: None,
            ll_dirty: false,
            lut: fp8_to_bf16_table(),
        }
    }
}

/// What one rank reports back.
struct RankReport {
    counts: Vec<FamilyCount>,
    failures: Vec<Failure>,
    error: Option<String>,
    device_mem: Vec<Sample>,
    host: HostSamples,
    rounds_done: usize,
    stop_reason: Option<String>,
}

/// Shared by the rank threads.
struct Shared {
    abort: AtomicBool,
    start: Instant,
    /// Outer rounds finished by rank 0 (progress).
    done: AtomicUsize,
    failures: Mutex<usize>,
}

/// The process's host memory, sampled by rank 0.
#[derive(Default)]
struct HostSamples {
    /// `VmRSS`.
    rss: Vec<Sample>,
    /// C heap bytes in live allocations (empty without glibc's `mallinfo2`).
    heap_in_use: Vec<Sample>,
    /// C heap bytes held from the system.
    heap_held: Vec<Sample>,
    /// `VmRSS` right after `malloc_trim(0)` (`--malloc-trim` only).
    rss_after_trim: Vec<Sample>,
}

impl HostSamples {
    fn take(&mut self, round: usize, trim: bool) {
        self.rss.push((round, memory::rss_bytes()));
        if let Some(h) = memory::heap_stats() {
            self.heap_in_use.push((round, h.in_use));
            self.heap_held.push((round, h.held));
        }
        if trim && memory::trim_heap() {
            self.rss_after_trim.push((round, memory::rss_bytes()));
        }
    }
}

/// Used bytes of one GPU (`total - free`), through the CUDA layer.
struct DeviceProbe(Option<moelink_cuda::Device>);

impl DeviceProbe {
    fn used(&self) -> Option<u64> {
        let (free, total) = self.0.as_ref()?.memory_info().ok()?;
        Some((total - free) as u64)
    }
}

// ================================================================================================ HT

#[derive(Clone, Copy, Debug)]
struct HtPlan {
    hidden: usize,
    topk: usize,
    experts: usize,
    fp8: bool,
    with_topk: bool,
    route: RouteKind,
    align: usize,
    num_sms: Option<usize>,
    no_sync: bool,
    combine_weights: bool,
    bias: usize,
    /// ht-cached: the cached payload's type, and whether combine uses the cached handle and rows.
    cached_fp8: bool,
    combine_cached: bool,
    graph: bool,
    /// Across nodes: the node whose ranks send no token this round (`nodes`: every rank), not in graph rounds.
    silent: Option<usize>,
}

impl HtPlan {
    fn draw(s: &Settings, fam: Family, round: usize, graphs: bool) -> HtPlan {
        let mut r = Rng::new(seed_of(s.seed, fam.code(), round, usize::MAX));
        let hidden = r.pick(&s.hidden);
        let topk = r.pick(&s.topk);
        let per_rank = r.pick(&[1usize, 2, 4, 8]);
        let experts = (s.ranks * per_rank).max(topk.div_ceil(s.ranks) * s.ranks);
        let fp8 = hidden % 128 == 0 && r.chance(0.4);
        let graph = graphs && fam == Family::Ht && r.chance(s.graph_fraction);
        let with_topk = graph || fam == Family::HtCached || r.chance(0.8);
        HtPlan {
            hidden,
            topk,
            experts,
            fp8: fp8 && !graph,
            with_topk,
            // Across nodes the node-level kinds join the draw (the HT kernels' traffic is per node).
            route: if s.nodes > 1 { RouteKind::draw_nodes(&mut r, s.ranks, s.nodes) } else { RouteKind::draw(&mut r, s.ranks) },
            align: r.pick(&[1, 1, 1, 4, 128]),
            num_sms: r.pick(&[None, None, Some(2), Some(8), Some(24), Some(64)]),
            no_sync: fam == Family::Ht && r.chance(0.15),
            combine_weights: r.chance(0.6),
            bias: r.pick(&[0, 0, 1, 2]),
            cached_fp8: hidden % 128 == 0 && r.chance(0.4),
            combine_cached: r.chance(0.5),
            graph,
            silent: (s.nodes > 1 && !graph && r.chance(0.08)).then(|| r.below(s.nodes + 1)),
        }
    }

    /// Whether `rank` sends no token in this round (its node, or every node, is silent).
    fn silences(&self, s: &Settings, rank: usize) -> bool {
        self.silent.is_some_and(|n| n >= s.nodes || rank / s.ranks_per_node == n)
    }
}

/// Tokens of `rank` in an HT round of `fam` under plan `p`: its generator's first draw (as `run_family`
/// draws it), 0 when its node is silent. Every rank can compute every rank's count.
fn ht_tokens(s: &Settings, fam: Family, round: usize, p: &HtPlan, rank: usize) -> usize {
    let mut rng = Rng::new(seed_of(s.seed, fam.code() << 8, round, rank));
    let t = tokens(&mut rng, s.t_max);
    if p.graph {
        t.max(1)
    } else if p.silences(s, rank) {
        0
    } else {
        t
    }
}

/// Across nodes: the rounds the internode HT kernels run for this round's dispatch (`ceil(T_max / M)`, M
/// from the buffers' sizes and the row size as the backend computes it); `None` on one node.
fn ht_rounds_per_call(s: &Settings, fam: Family, round: usize, p: &HtPlan) -> Option<usize> {
    use moelink_kernels::ht_internode as hti_kernels;
    if s.nodes <= 1 {
        return None;
    }
    let t_max = (0..s.ranks).map(|r| ht_tokens(s, fam, round, p, r)).max().unwrap_or(0);
    let topk = if p.with_topk { p.topk } else { 0 };
    let rows = hti_kernels::RowSizes::new(p.hidden, p.fp8, topk, hti_kernels::HTI_MAX_TOPK);
    let rdma = hti_kernels::rdma_layout(0, 0, s.num_rdma_bytes, s.ranks, s.nodes)?;
    let nvl = hti_kernels::nvl_layout(0, 0, s.num_nvl_bytes, s.ranks, s.nodes);
    let (m, _) = hti_kernels::round_shape(&rdma, &nvl, rows, s.ht_chunk_tokens.unwrap_or(hti_kernels::DEFAULT_CHUNK_TOKENS))?;
    Some(t_max.div_ceil(m))
}

/// One rank's HT inputs.
struct HtInputs {
    t: usize,
    idx: Vec<i64>,
    w: Vec<f32>,
    x: Vec<bf16>,
    x8: Vec<Fp8E4M3>,
    scales: Vec<f32>,
    bias: Vec<Vec<bf16>>,
}

fn ht_inputs(p: &HtPlan, rng: &mut Rng, t: usize, ranks: usize, fp8: bool) -> HtInputs {
    let h = p.hidden;
    HtInputs {
        t,
        idx: route(rng, p.route, t, p.topk, p.experts, ranks),
        w: random_weights(rng, t * p.topk),
        x: if fp8 { Vec::new() } else { random_bf16(rng, t * h) },
        x8: if fp8 { random_fp8(rng, t * h) } else { Vec::new() },
        scales: if fp8 { (0..t * (h / 128)).map(|_| 0.25 + rng.uniform() as f32).collect() } else { Vec::new() },
        bias: (0..p.bias).map(|_| random_bf16(rng, t * h)).collect(),
    }
}

/// Host tensors of a payload: (x, scales).
fn payload_tensors(inp: &HtInputs, h: usize, fp8: bool) -> Result<(Tensor, Option<Tensor>)> {
    if fp8 {
        Ok((Tensor::from_vec(inp.x8.clone(), &[inp.t, h])?, Some(Tensor::from_vec(inp.scales.clone(), &[inp.t, h / 128])?)))
    } else {
        Ok((Tensor::from_vec(inp.x.clone(), &[inp.t, h])?, None))
    }
}

fn payload<'a>(x: &'a Tensor, s: &'a Option<Tensor>) -> Payload<'a> {
    match s {
        Some(s) => Payload::Fp8 { x: x.view(), scales: s.view() },
        None => Payload::Bf16(x.view()),
    }
}

/// Combine input from received rows: the rows themselves (BF16) or their FP8 values as bf16 (exact).
fn expert_rows(buf: &Buffer, recv: &Tensor, lut: &[u16; 256]) -> Result<Option<Tensor>> {
    if recv.dtype() == DType::BF16 {
        return Ok(None);
    }
    let bytes = recv.to_host_bytes()?;
    let v: Vec<bf16> = bytes.iter().map(|&b| bf16::from_bits(lut[b as usize])).collect();
    Ok(Some(buf.upload(&Tensor::from_vec(v, recv.shape())?)?))
}

struct Pair<'b> {
    prim: &'b mut Buffer,
    twin: &'b mut Buffer,
    /// The HT call under way, for an error's message.
    step: &'static str,
}

/// One `ht` / `ht-cached` round (not a graph round).
fn ht_round(b: &mut Pair<'_>, s: &Settings, p: &HtPlan, inp: &HtInputs, inp2: Option<&HtInputs>, lut: &[u16; 256]) -> Result<Diffs> {
    let mut d = Diffs::default();
    let (t, h, k, e) = (inp.t, p.hidden, p.topk, p.experts);
    let idx_h = Tensor::from_vec(inp.idx.clone(), &[t, k])?;
    let idx_p = b.prim.upload(&idx_h)?;
    let w_h = Tensor::from_vec(inp.w.clone(), &[t, k])?;
    let w_p = b.prim.upload(&w_h)?;
    b.step = "layout";
    let lay_h = b.twin.get_dispatch_layout(idx_h.view(), e)?;
    let lay_p = b.prim.get_dispatch_layout(idx_p.view(), e)?;
    compare_layout(&mut d, "", &SeenLayout::of(&lay_h)?, &SeenLayout::of(&lay_p)?);

    let (x_h, sc_h) = payload_tensors(inp, h, p.fp8)?;
    let x_p = b.prim.upload(&x_h)?;
    let sc_p = sc_h.as_ref().map(|t| b.prim.upload(t)).transpose()?;
    let worst = if p.no_sync { s.ranks * s.t_max.max(1) } else { 0 };
    // At most what the GPU's buffer allows (ranks sharing a GPU get a share of its SMs), kept even. Across
    // nodes every launch adds the emulated NIC's blocks: those and a spare SM (as the even rounding leaves on
    // one node) come off the share, so that every rank's persistent blocks stay resident together; and at
    // least the 4 blocks the internode kernels need (senders, forwarders, receivers, up to 32 nodes).
    let (least, reserve) = if s.nodes > 1 { (4, s.nic_blocks + 1) } else { (2, 0) };
    let config = p.num_sms.map(|n| Config::with_sms(n.min(b.prim.max_num_sms().saturating_sub(reserve) & !1).max(least)));
    let fresh = |x, lay, idx, w, worst| fresh_args(p, config, x, lay, idx, w, worst);
    b.step = "dispatch";
    let res_h = b.twin.dispatch(&fresh(payload(&x_h, &sc_h), &lay_h, idx_h.view(), w_h.view(), 0))?;
    let res_p = b.prim.dispatch(&fresh(payload(&x_p, &sc_p), &lay_p, idx_p.view(), w_p.view(), worst)).inspect_err(|_| {
        // The dispatch checks the layout it is given: say whether the primary's differed from the host's.
        if !d.0.is_empty() {
            eprintln!(
                "soak: rank {} round's layout differed from the host's before the failed dispatch: {}",
                b.prim.rank(),
                d.0.join("; ")
            );
        }
    })?;
    let k_out = if p.with_topk { k } else { 0 };
    compare_dispatch(&mut d, "dispatch", &SeenDispatch::of(&res_h)?, &SeenDispatch::of(&res_p)?, worst, k_out);
    if worst == 0 {
        d.eq("num_recv_tokens_per_expert", &res_h.num_recv_tokens_per_expert, &res_p.num_recv_tokens_per_expert);
        d.eq("handle.num_recv_tokens", res_h.handle.num_recv_tokens(), res_p.handle.num_recv_tokens());
    }

    // Cached dispatch of a second payload with the fresh handle.
    let mut cached = None;
    if let Some(inp2) = inp2 {
        let (x2_h, sc2_h) = payload_tensors(inp2, h, p.cached_fp8)?;
        let x2_p = b.prim.upload(&x2_h)?;
        let sc2_p = sc2_h.as_ref().map(|t| b.prim.upload(t)).transpose()?;
        let cached_args =
            |x, handle| DispatchArgs { x, routing: Routing::Cached(handle), expert_alignment: 1, num_worst_tokens: 0, config };
        b.step = "cached dispatch";
        let c_h = b.twin.dispatch(&cached_args(payload(&x2_h, &sc2_h), &res_h.handle))?;
        let c_p = b.prim.dispatch(&cached_args(payload(&x2_p, &sc2_p), &res_p.handle))?;
        compare_dispatch(&mut d, "cached dispatch", &SeenDispatch::of(&c_h)?, &SeenDispatch::of(&c_p)?, worst, 0);
        cached = Some((c_h, c_p));
    }

    // Combine: identity experts over the fresh rows (or the cached ones), optional weights and biases.
    let (rows_h, rows_p, hd_h, hd_p, weights) = match (&cached, p.combine_cached) {
        (Some((c_h, c_p)), true) => (&c_h.recv_x, &c_p.recv_x, &c_h.handle, &c_p.handle, false),
        _ => (&res_h.recv_x, &res_p.recv_x, &res_h.handle, &res_p.handle, p.with_topk && p.combine_weights),
    };
    let y_h = expert_rows(b.twin, rows_h, lut)?;
    let y_p = expert_rows(b.prim, rows_p, lut)?;
    let bias_h: Vec<Tensor> = inp.bias.iter().map(|v| Tensor::from_vec(v.clone(), &[t, h])).collect::<Result<_>>()?;
    let bias_p: Vec<Tensor> = bias_h.iter().map(|t| b.prim.upload(t)).collect::<Result<_>>()?;
    fn bias(v: &[Tensor]) -> [Option<TensorRef<'_>>; 2] {
        [v.first().map(|t| t.view()), v.get(1).map(|t| t.view())]
    }
    b.step = "combine";
    let comb_h = b.twin.combine(&CombineArgs {
        x: y_h.as_ref().unwrap_or(rows_h).view(),
        handle: hd_h,
        topk_weights: if weights { res_h.recv_topk_weights.as_ref().map(|t| t.view()) } else { None },
        bias: bias(&bias_h),
        config,
    })?;
    let comb_p = b.prim.combine(&CombineArgs {
        x: y_p.as_ref().unwrap_or(rows_p).view(),
        handle: hd_p,
        topk_weights: if weights { res_p.recv_topk_weights.as_ref().map(|t| t.view()) } else { None },
        bias: bias(&bias_p),
        config,
    })?;
    d.bytes("combined_x", &bytes_of(&comb_h.combined_x)?, &bytes_of(&comb_p.combined_x)?);
    match (&comb_h.combined_topk_weights, &comb_p.combined_topk_weights) {
        (Some(a), Some(c)) => d.bytes("combined_topk_weights", &bytes_of(a)?, &bytes_of(c)?),
        (None, None) => {}
        _ => d.note("combined_topk_weights present on one backend only".into()),
    }
    Ok(d)
}

/// Arguments of a fresh dispatch under plan `p`.
fn fresh_args<'a>(
    p: &HtPlan,
    config: Option<Config>,
    x: Payload<'a>,
    lay: &'a moelink::DispatchLayout,
    idx: TensorRef<'a>,
    w: TensorRef<'a>,
    worst: usize,
) -> DispatchArgs<'a> {
    let routing = Routing::Fresh { layout: lay.as_ref(), topk_idx: p.with_topk.then_some(idx), topk_weights: p.with_topk.then_some(w) };
    DispatchArgs { x, routing, expert_alignment: p.align, num_worst_tokens: worst, config }
}

/// The host backend's run of a graph round's pipeline (CPU-sync).
struct HtHostRun {
    layout: SeenLayout,
    dispatch: SeenDispatch,
    cx: Vec<u8>,
    cw: Vec<u8>,
}

fn ht_host_pipeline(twin: &mut Buffer, p: &HtPlan, inp: &HtInputs) -> Result<HtHostRun> {
    let (t, h, k) = (inp.t, p.hidden, p.topk);
    let idx = Tensor::from_vec(inp.idx.clone(), &[t, k])?;
    let w = Tensor::from_vec(inp.w.clone(), &[t, k])?;
    let x = Tensor::from_vec(inp.x.clone(), &[t, h])?;
    let lay = twin.get_dispatch_layout(idx.view(), p.experts)?;
    let r = twin.dispatch(&DispatchArgs {
        x: Payload::Bf16(x.view()),
        routing: Routing::Fresh { layout: lay.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })?;
    let c = twin.combine(&CombineArgs {
        x: r.recv_x.view(),
        handle: &r.handle,
        topk_weights: r.recv_topk_weights.as_ref().map(|t| t.view()),
        bias: [None, None],
        config: None,
    })?;
    Ok(HtHostRun {
        layout: SeenLayout::of(&lay)?,
        dispatch: SeenDispatch::of(&r)?,
        cx: bytes_of(&c.combined_x)?,
        cw: c.combined_topk_weights.as_ref().map(bytes_of).transpose()?.unwrap_or_default(),
    })
}

/// An HT graph round: the library's pipeline built on the primary, then replayed once per input set, each
/// replay checked against the host backend's CPU-sync run of the same inputs. Returns the diffs and the
/// replays checked.
fn ht_graph_round(b: &mut Pair<'_>, s: &Settings, p: &HtPlan, sets: &[HtInputs]) -> Result<(Diffs, usize)> {
    let mut d = Diffs::default();
    let worst = s.ranks * s.t_max.max(1);
    let spec = HtGraphSpec {
        num_tokens: sets[0].t,
        hidden: p.hidden,
        topk: p.topk,
        num_experts: p.experts,
        num_worst_tokens: worst,
        config: None,
    };
    b.step = "graph";
    let mut g = HtGraph::new(b.prim, spec)?;
    let mut replays = 0;
    for (i, inp) in sets.iter().enumerate() {
        g.write_inputs(&inp.x, &inp.idx, &inp.w)?;
        g.replay(b.prim)?;
        let host = ht_host_pipeline(b.twin, p, inp)?;
        let what = format!("graph replay {i}");
        let layout = SeenLayout::from_tensors(g.num_tokens_per_rank(), g.num_tokens_per_expert(), g.is_token_in_rank())?;
        compare_layout(&mut d, &what, &host.layout, &layout);
        let prim = SeenDispatch {
            rows: worst,
            x: bytes_of(g.recv_x())?,
            scales: Vec::new(),
            idx: g.recv_topk_idx().to_vec()?,
            w: g.recv_topk_weights().to_vec()?,
        };
        compare_dispatch(&mut d, &what, &host.dispatch, &prim, worst, p.topk);
        d.bytes(&format!("{what} combined_x"), &host.cx, &bytes_of(g.combined_x())?);
        d.bytes(&format!("{what} combined_topk_weights"), &host.cw, &bytes_of(g.combined_topk_weights())?);
        replays += 1;
    }
    Ok((d, replays))
}

// ================================================================================================ LL

/// Shape of a block of low-latency rounds, and the per-block tensors of both buffers.
struct LlBlock {
    id: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    t_max: usize,
    prim: LlTensors,
    twin: LlTensors,
    /// Expert outputs for FP8 rounds (`bf16 [E_local, R*T_max, H]`), the same values in both.
    y_prim: Tensor,
    y_twin: Tensor,
}

/// Outputs of one buffer, reused by every round of a block.
struct LlTensors {
    recv_bf16: Tensor,
    recv_fp8: Tensor,
    scales_f32: Tensor,
    scales_ue8m0: Tensor,
    count: Tensor,
}

impl LlTensors {
    fn new(buf: &Buffer, el: usize, rows: usize, h: usize) -> Result<LlTensors> {
        Ok(LlTensors {
            recv_bf16: buf.alloc(DType::BF16, &[el, rows, h])?,
            recv_fp8: buf.alloc(DType::Fp8E4M3, &[el, rows, h])?,
            scales_f32: buf.alloc(DType::F32, &[el, h / 128, rows])?,
            scales_ue8m0: buf.alloc(DType::I32, &[el, (h / 512).max(1), rows])?,
            count: buf.alloc(DType::I32, &[el])?,
        })
    }

    fn outputs(&mut self, quant: LlQuant) -> Result<LlDispatchOutputs<'_>> {
        let [el, rows, h] = [self.recv_bf16.shape()[0], self.recv_bf16.shape()[1], self.recv_bf16.shape()[2]];
        let (recv_x, recv_scales) = match quant {
            LlQuant::Bf16 => (self.recv_bf16.view_mut(), None),
            LlQuant::Fp8 { use_ue8m0, .. } => {
                let (cols, t) = if use_ue8m0 { (h / 512, &mut self.scales_ue8m0) } else { (h / 128, &mut self.scales_f32) };
                let sc = t.view_mut_strided(&[el, rows, cols], &[(cols * rows) as isize, 1, rows as isize])?;
                (self.recv_fp8.view_mut(), Some(sc))
            }
        };
        Ok(LlDispatchOutputs {
            recv_x,
            recv_scales,
            recv_count: self.count.view_mut(),
            cumulative_local_expert_recv_stats: None,
            dispatch_wait_recv_cost_stats: None,
            src_info: None,
            layout_range: None,
        })
    }

    /// (count, valid rows, valid scales) of the last dispatch.
    fn seen(&self, quant: LlQuant) -> Result<(Vec<i32>, Vec<u8>, Vec<u8>)> {
        let count: Vec<i32> = self.count.to_vec()?;
        let [_, rows, h] = [self.recv_bf16.shape()[0], self.recv_bf16.shape()[1], self.recv_bf16.shape()[2]];
        let (recv, rb) = if quant.is_fp8() { (&self.recv_fp8, h) } else { (&self.recv_bf16, 2 * h) };
        let (scales, cols) = match quant {
            LlQuant::Bf16 => (Vec::new(), 0),
            LlQuant::Fp8 { use_ue8m0: false, .. } => (self.scales_f32.to_host_bytes()?, h / 128),
            LlQuant::Fp8 { use_ue8m0: true, .. } => (self.scales_ue8m0.to_host_bytes()?, h / 512),
        };
        let (r, s) = ll_valid_part(&count, &recv.to_host_bytes()?, &scales, rows, rb, cols);
        Ok((count, r, s))
    }
}

impl LlBlock {
    fn new(b: &mut Pair<'_>, s: &Settings, id: usize) -> Result<LlBlock> {
        let mut r = Rng::new(seed_of(s.seed, 0x11b0c, id, usize::MAX));
        let hidden = r.pick(&s.hidden);
        let topk = r.pick(&s.topk);
        let per_rank = r.pick(&[1usize, 2, 4, 8]);
        let experts = (s.ranks * per_rank).max(topk.div_ceil(s.ranks) * s.ranks).min(s.largest_experts().max(topk));
        let t_max = r.pick(&[1, s.ll_t_max / 2, s.ll_t_max, s.ll_t_max, s.ll_t_max, s.ll_t_max]).max(1);
        let (el, rows) = (experts / s.ranks, s.ranks * t_max);
        // Block-wide expert outputs for FP8 rounds (seeded by block, identical on both buffers).
        let mut yr = Rng::new(seed_of(s.seed, 0x11b0d, id, b.prim.rank()));
        let y = Tensor::from_vec(random_bf16(&mut yr, el * rows * hidden), &[el, rows, hidden])?;
        b.prim.clean_low_latency_buffer(t_max, hidden, experts)?;
        b.twin.clean_low_latency_buffer(t_max, hidden, experts)?;
        Ok(LlBlock {
            id,
            hidden,
            topk,
            experts,
            t_max,
            prim: LlTensors::new(b.prim, el, rows, hidden)?,
            twin: LlTensors::new(b.twin, el, rows, hidden)?,
            y_prim: b.prim.upload(&y)?,
            y_twin: y,
        })
    }
}

#[derive(Clone, Copy, Debug)]
struct LlPlan {
    quant: LlQuant,
    weights: bool,
    hook: bool,
    route: RouteKind,
    graph: bool,
}

impl LlPlan {
    fn draw(s: &Settings, fam: Family, round: usize, blk: &LlBlock, graphs: bool) -> LlPlan {
        let mut r = Rng::new(seed_of(s.seed, fam.code(), round, usize::MAX));
        let ue8m0_ok = blk.hidden % 512 == 0;
        let graph = graphs && fam == Family::Ll && r.chance(s.graph_fraction);
        let quant = match r.below(5) {
            _ if graph => LlQuant::Bf16,
            0 | 1 => LlQuant::Bf16,
            2 => LlQuant::Fp8 { round_scale: false, use_ue8m0: false },
            3 => LlQuant::Fp8 { round_scale: true, use_ue8m0: false },
            _ => LlQuant::Fp8 { round_scale: true, use_ue8m0: ue8m0_ok },
        };
        let weights = match fam {
            Family::LlPrereduced => true,
            Family::LlHook => r.chance(0.5),
            _ => graph && r.chance(0.5),
        };
        // Across nodes node-limited routing joins the draw (DeepSeek-V3's gating: a token's experts on few nodes).
        LlPlan { quant, weights, hook: fam == Family::LlHook, route: RouteKind::draw_on(&mut r, s.ranks, s.nodes), graph }
    }
}

/// One rank's LL inputs.
struct LlInputs {
    t: usize,
    x: Vec<bf16>,
    idx: Vec<i64>,
    w: Vec<f32>,
}

fn ll_inputs(blk: &LlBlock, p: &LlPlan, rng: &mut Rng, t: usize, ranks: usize) -> LlInputs {
    LlInputs {
        t,
        idx: route(rng, p.route, t, blk.topk, blk.experts, ranks),
        x: random_bf16(rng, t * blk.hidden),
        w: random_weights(rng, t * blk.topk),
    }
}

/// What a low-latency round produced: (recv_count, valid rows, valid scales, combined bytes).
type LlSeen = (Vec<i32>, Vec<u8>, Vec<u8>, Vec<u8>);

/// Dispatch + combine on one buffer; the hook variants run the receive phases through the hooks.
#[allow(clippy::too_many_arguments)]
fn ll_call(
    buf: &mut Buffer,
    out: &mut LlTensors,
    y_fp8: &Tensor,
    blk_shape: (usize, usize),
    p: &LlPlan,
    x: &Tensor,
    idx: &Tensor,
    w: &Tensor,
    hook: bool,
) -> Result<LlSeen> {
    let (t_max, experts) = blk_shape;
    let args = LlDispatchArgs {
        x: x.view(),
        topk_idx: idx.view(),
        topk_weights: p.weights.then(|| w.view()),
        num_max_dispatch_tokens_per_rank: t_max,
        num_experts: experts,
        quant: p.quant,
        return_recv_hook: hook,
    };
    let handle: LlHandle = {
        let outputs = out.outputs(p.quant)?;
        let (h, pending) = buf.low_latency_dispatch_into(&args, outputs)?;
        if let Some(pending) = pending {
            buf.run_hook(pending)?;
        }
        h
    };
    let (count, rows, scales) = out.seen(p.quant)?;
    let y = if p.quant.is_fp8() { y_fp8.view() } else { out.recv_bf16.view() };
    let mut combined = buf.alloc(DType::BF16, &[x.shape()[0], x.shape()[1]])?;
    let cargs =
        LlCombineArgs { x: y, topk_idx: idx.view(), topk_weights: w.view(), handle: &handle, zero_copy: false, return_recv_hook: hook };
    {
        let pending =
            buf.low_latency_combine_into(&cargs, LlCombineOutputs { combined_x: combined.view_mut(), combine_wait_recv_cost_stats: None })?;
        if let Some(pending) = pending {
            buf.run_hook(pending)?;
        }
    }
    Ok((count, rows, scales, bytes_of(&combined)?))
}

fn ll_round(b: &mut Pair<'_>, blk: &mut LlBlock, p: &LlPlan, inp: &LlInputs) -> Result<Diffs> {
    let mut d = Diffs::default();
    let (t, h, k) = (inp.t, blk.hidden, blk.topk);
    let x = Tensor::from_vec(inp.x.clone(), &[t, h])?;
    let idx = Tensor::from_vec(inp.idx.clone(), &[t, k])?;
    let w = Tensor::from_vec(inp.w.clone(), &[t, k])?;
    let (xp, idxp, wp) = (b.prim.upload(&x)?, b.prim.upload(&idx)?, b.prim.upload(&w)?);
    let shape = (blk.t_max, blk.experts);
    let want = ll_call(b.twin, &mut blk.twin, &blk.y_twin, shape, p, &x, &idx, &w, false)?;
    let got = ll_call(b.prim, &mut blk.prim, &blk.y_prim, shape, p, &xp, &idxp, &wp, p.hook)?;
    d.eq("recv_count", &want.0, &got.0);
    d.bytes("recv_x (valid rows)", &want.1, &got.1);
    d.bytes("recv_x_scales (valid rows)", &want.2, &got.2);
    d.bytes("combined_x", &want.3, &got.3);
    Ok(d)
}

/// An LL graph round (BF16, identity experts, dispatch + combine in one graph): the library's pipeline built
/// on the primary, then replayed once per input set, each replay checked against the host backend.
fn ll_graph_round(b: &mut Pair<'_>, blk: &mut LlBlock, p: &LlPlan, sets: &[LlInputs]) -> Result<(Diffs, usize)> {
    let mut d = Diffs::default();
    let (t, h, k) = (sets[0].t, blk.hidden, blk.topk);
    let spec = LlGraphSpec {
        num_tokens: t,
        num_max_dispatch_tokens_per_rank: blk.t_max,
        hidden: h,
        topk: k,
        num_experts: blk.experts,
        quant: LlQuant::Bf16,
        dispatch_weights: p.weights,
        return_recv_hook: false,
        combine: LlGraphCombine::ReceivedRows,
        graphs: LlGraphSplit::One,
    };
    let mut g = LlGraph::new(b.prim, spec)?;
    let rows = b.prim.num_ranks() * blk.t_max;
    let mut replays = 0;
    for (i, inp) in sets.iter().enumerate() {
        g.write_inputs(&inp.x, &inp.idx, &inp.w)?;
        g.replay(b.prim)?;
        let x = Tensor::from_vec(inp.x.clone(), &[t, h])?;
        let idx = Tensor::from_vec(inp.idx.clone(), &[t, k])?;
        let w = Tensor::from_vec(inp.w.clone(), &[t, k])?;
        let want = ll_call(b.twin, &mut blk.twin, &blk.y_twin, (blk.t_max, blk.experts), p, &x, &idx, &w, false)?;
        let count: Vec<i32> = g.recv_count().to_vec()?;
        let (valid, _) = ll_valid_part(&count, &bytes_of(g.recv_x())?, &[], rows, 2 * h, 0);
        let what = format!("graph replay {i}");
        d.eq(&format!("{what} recv_count"), &want.0, &count);
        d.bytes(&format!("{what} recv_x (valid rows)"), &want.1, &valid);
        let combined = g.combined_x().map(bytes_of).transpose()?.unwrap_or_default();
        d.bytes(&format!("{what} combined_x"), &want.3, &combined);
        replays += 1;
    }
    Ok((d, replays))
}

// ================================================================================================ driver

/// Tokens of a rank in a round: none now and then, else 1..=t_max.
fn tokens(rng: &mut Rng, t_max: usize) -> usize {
    if rng.chance(0.06) {
        0
    } else {
        1 + rng.below(t_max)
    }
}

/// Runs one round of `fam` on this rank; returns the differences and whether it was a graph round (and
/// how many replays it checked), plus a plan description for reports.
fn run_family(b: &mut Pair<'_>, s: &Settings, st: &mut RankState, fam: Family, round: usize) -> Result<(Diffs, String)> {
    let me = b.prim.rank();
    let graphs = s.kind == BackendKind::Cuda;
    let fi = s.families.iter().position(|f| *f == fam).expect("family listed");
    let mut rng = Rng::new(seed_of(s.seed, fam.code() << 8, round, me));
    if !fam.is_ll() {
        let p = HtPlan::draw(s, fam, round, graphs);
        // Across nodes this HT call writes the RDMA region the LL calls share: the next LL round cleans it.
        st.ll_dirty |= s.nodes > 1;
        let c = &mut st.counts[fi];
        c.node_limited_rounds += usize::from(matches!(p.route, RouteKind::NodeLimited { .. }));
        c.empty_node_rounds += usize::from(matches!(p.route, RouteKind::EmptyNode { .. }));
        c.node_skewed_rounds += usize::from(matches!(p.route, RouteKind::NodeSkewed { .. }));
        c.silent_node_rounds += usize::from(p.silent.is_some());
        if let Some(k) = ht_rounds_per_call(s, fam, round, &p) {
            c.multi_round_rounds += usize::from(k >= 2);
            c.most_rounds_per_call = c.most_rounds_per_call.max(k);
        }
        if p.graph {
            let t = tokens(&mut rng, s.t_max).max(1);
            let sets: Vec<HtInputs> = (0..3).map(|_| ht_inputs(&p, &mut rng, t, s.ranks, false)).collect();
            let (d, replays) = ht_graph_round(b, s, &p, &sets)?;
            c.graph_rounds += 1;
            c.graph_replays += replays;
            return Ok((d, format!("{p:?} t={t}")));
        }
        let t = tokens(&mut rng, s.t_max);
        // A silent node's ranks draw as the others do (the same generator states), then send nothing.
        let t = if p.silences(s, me) { 0 } else { t };
        let inp = ht_inputs(&p, &mut rng, t, s.ranks, p.fp8);
        let inp2 = (fam == Family::HtCached).then(|| ht_inputs(&p, &mut rng, t, s.ranks, p.cached_fp8));
        c.no_sync_rounds += usize::from(p.no_sync);
        c.fp8_rounds += usize::from(p.fp8);
        c.empty_rank_rounds += usize::from(t == 0);
        let d = ht_round(b, s, &p, &inp, inp2.as_ref(), &st.lut)?;
        return Ok((d, format!("{p:?} t={t}")));
    }
    let block = round / s.ll_block.max(1);
    if st.ll.as_ref().is_none_or(|blk| blk.id != block) {
        st.ll = None; // free the old block's tensors first
        st.ll = Some(LlBlock::new(b, s, block)?); // cleans the LL region of both buffers
        st.ll_dirty = false;
    }
    let blk = st.ll.as_mut().expect("block");
    // One buffer pair runs both kinds: across nodes the HT calls since the last clean wrote the RDMA region
    // the LL calls share, and the buffers refuse LL calls until it is cleaned (DeepEP's rule). LL calls need
    // nothing the other way: the HT kernels' signals live in the control area, their data is rewritten.
    if st.ll_dirty {
        b.prim.clean_low_latency_buffer(blk.t_max, blk.hidden, blk.experts)?;
        b.twin.clean_low_latency_buffer(blk.t_max, blk.hidden, blk.experts)?;
        st.ll_dirty = false;
    }
    let p = LlPlan::draw(s, fam, round, blk, graphs);
    let desc = format!("{p:?} hidden={} topk={} experts={} t_max={}", blk.hidden, blk.topk, blk.experts, blk.t_max);
    let c = &mut st.counts[fi];
    c.node_limited_rounds += usize::from(matches!(p.route, RouteKind::NodeLimited { .. }));
    if p.graph {
        let t = tokens(&mut rng, blk.t_max).max(1);
        let sets: Vec<LlInputs> = (0..3).map(|_| ll_inputs(blk, &p, &mut rng, t, s.ranks)).collect();
        let (d, replays) = ll_graph_round(b, blk, &p, &sets)?;
        c.graph_rounds += 1;
        c.graph_replays += replays;
        return Ok((d, format!("{desc} t={t}")));
    }
    let t = tokens(&mut rng, blk.t_max);
    let inp = ll_inputs(blk, &p, &mut rng, t, s.ranks);
    c.fp8_rounds += usize::from(p.quant.is_fp8());
    c.empty_rank_rounds += usize::from(t == 0);
    let d = ll_round(b, blk, &p, &inp)?;
    Ok((d, format!("{desc} t={t}")))
}

const MAX_FAILURES_KEPT: usize = 20;
/// Outer rounds between the ranks' stop votes.
const VOTE_EVERY: usize = 8;

fn rank_main(g: ThreadGroup, s: &Settings, sh: &Shared) -> Result<RankReport> {
    let me = g.rank();
    let group: Arc<dyn Group> = Arc::new(g);
    let mut tuning = moelink_cli::env::buffer_options().tuning;
    if s.nodes > 1 {
        // Across nodes only the internode HT kernels read it: tokens per chunk.
        tuning.ht_send_chunk = s.ht_chunk_tokens.map(|c| c as u32);
    }
    let opts = BufferOptions {
        backend: s.kind,
        num_nvl_bytes: s.num_nvl_bytes,
        num_rdma_bytes: s.num_rdma_bytes,
        low_latency_mode: true,
        timeout_ms: s.timeout_ms,
        topology: s.topology,
        rdma: s.rdma.clone(),
        tuning,
        ..moelink_cli::env::buffer_options()
    };
    let mut prim = Buffer::new(group.clone(), opts.clone())?;
    let mut twin = Buffer::new(group.clone(), BufferOptions { backend: BackendKind::Host, ..opts })?;
    let probe = DeviceProbe(match prim.location() {
        moelink::Location::Cuda(ordinal) => moelink_cuda::Device::new(ordinal).ok(),
        moelink::Location::Host => None,
    });
    let mut st = RankState::new(s.families.len());
    // Every rank stops at a barrier first (`quiet`), so that the host samples see no round's temporaries,
    // and waits for rank 0 to finish sampling before it allocates again.
    let sample = |st: &mut RankState, round: usize, quiet: bool| -> Result<()> {
        if quiet {
            group.barrier()?;
        }
        if let Some(u) = probe.used() {
            st.device_mem.push((round, u));
        }
        if me == 0 {
            st.host.take(round, s.malloc_trim);
        }
        if quiet {
            group.barrier()?;
        }
        Ok(())
    };
    sample(&mut st, 0, true)?;
    let mut rounds_done = 0;
    let mut stop_reason = None;
    'outer: for round in 0..s.rounds {
        if round % VOTE_EVERY == 0 {
            let over = s.time_budget_s.is_some_and(|b| sh.start.elapsed().as_secs_f64() >= b);
            let abort = sh.abort.load(Ordering::Relaxed);
            let votes = match group.all_gather(&[u8::from(over) | u8::from(abort) << 1]) {
                Ok(v) => v,
                Err(e) => {
                    st.error = Some(format!("stop vote before round {round}: {e}"));
                    stop_reason = Some(format!("error on rank {me}"));
                    break;
                }
            };
            let any = votes.iter().fold(0u8, |a, v| a | v.first().copied().unwrap_or(2));
            if any != 0 {
                stop_reason = Some(if any & 2 != 0 {
                    "a rank failed".to_string()
                } else {
                    format!("time budget of {:?} s used up", s.time_budget_s)
                });
                break;
            }
        }
        if round > 0 && round % s.mem_every.max(1) == 0 && !sh.abort.load(Ordering::Relaxed) {
            if round % s.ll_block == 0 {
                // This round starts a new LL block anyway: free the old one first, so that every sample
                // at a block boundary (all of them with the defaults) sees the same live state.
                st.ll = None;
            }
            if let Err(e) = sample(&mut st, round, true) {
                st.error = Some(format!("memory sample before round {round}: {e}"));
                stop_reason = Some(format!("error on rank {me}"));
                break;
            }
        }
        for &fam in &s.families {
            if sh.abort.load(Ordering::Relaxed) {
                stop_reason = Some("a rank failed".into());
                break 'outer;
            }
            let mut pair = Pair { prim: &mut prim, twin: &mut twin, step: "" };
            let fi = s.families.iter().position(|f| *f == fam).expect("family listed");
            match run_family(&mut pair, s, &mut st, fam, round) {
                Ok((d, plan)) => {
                    st.counts[fi].rounds += 1;
                    if !d.0.is_empty() {
                        st.counts[fi].mismatches += 1;
                        *sh.failures.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                        if st.failures.len() < MAX_FAILURES_KEPT {
                            st.failures.push(Failure { family: fam.name().into(), round, rank: me, plan, what: d.0.join("; ") });
                        }
                    }
                }
                Err(e) => {
                    sh.abort.store(true, Ordering::Relaxed);
                    // The HT plan is a function of (seed, family, round): the failing round can be told apart.
                    let during = match fam.is_ll() {
                        false if !pair.step.is_empty() => {
                            format!(" (during {}; plan {:?})", pair.step, HtPlan::draw(s, fam, round, s.kind == BackendKind::Cuda))
                        }
                        _ => String::new(),
                    };
                    st.error = Some(format!("{} round {round}: {e}{during}", fam.name()));
                    stop_reason = Some(format!("error on rank {me}"));
                    break 'outer;
                }
            }
        }
        rounds_done = round + 1;
        if me == 0 {
            sh.done.store(rounds_done, Ordering::Relaxed);
        }
    }
    st.ll = None;
    // Every rank leaves the loop at the same round unless one failed; then no barrier (a rank may be gone).
    let agreed = stop_reason.as_deref().is_none_or(|r| r.starts_with("time budget"));
    if let Err(e) = sample(&mut st, rounds_done, agreed) {
        st.error.get_or_insert(format!("last memory sample: {e}"));
    }
    Ok(RankReport {
        counts: st.counts,
        failures: st.failures,
        error: st.error,
        device_mem: st.device_mem,
        host: st.host,
        rounds_done,
        stop_reason,
    })
}

/// Shapes of [`verify_rounds`]: (T_max, LL T_max, hidden, top-k).
const VERIFY_SHAPE: (usize, usize, usize, usize) = (32, 16, 2048, 8);

/// `(num_nvl_bytes, num_rdma_bytes)` a buffer of `ranks` ranks needs for [`verify_rounds`].
pub fn verify_buffer_bytes(ranks: usize) -> (usize, usize) {
    let (t, tl, h, k) = VERIFY_SHAPE;
    let nvl = Buffer::ht_bytes_needed(t, h, k, ranks, false).max(Buffer::ht_bytes_needed(t, h, k, ranks, true));
    (nvl, Buffer::ll_bytes_needed(tl, h, ranks, (ranks * 8).max(k.div_ceil(ranks) * ranks)))
}

/// Runs `rounds` soak rounds of each of `families` (small shapes, no graphs) on `prim` against `twin`, a
/// host-backend buffer over the same group; every rank of the group calls it with the same arguments.
/// Returns the differences found (empty: every output matched). `moelink-stress chaos` checks rebuilt
/// buffers with it.
pub fn verify_rounds(prim: &mut Buffer, twin: &mut Buffer, families: &[Family], rounds: usize, seed: u64) -> Result<Vec<String>> {
    let (t_max, ll_t_max, hidden, topk) = VERIFY_SHAPE;
    let kind = if prim.backend_name() == "cuda" { BackendKind::Cuda } else { BackendKind::Host };
    let s = Settings {
        backend: prim.backend_name().into(),
        ranks: prim.num_ranks(),
        rounds,
        families: families.to_vec(),
        t_max,
        ll_t_max,
        hidden: vec![hidden],
        topk: vec![topk],
        graph_fraction: 0.0,
        ll_block: rounds.max(1),
        seed,
        time_budget_s: None,
        mem_every: 1,
        malloc_trim: false,
        timeout_ms: prim.options().timeout_ms,
        num_nvl_bytes: prim.options().num_nvl_bytes,
        num_rdma_bytes: prim.options().num_rdma_bytes,
        nodes: prim.topology().num_nodes,
        ranks_per_node: prim.topology().ranks_per_node,
        transport: prim.topology().is_internode().then(|| prim.options().rdma.transport.name().to_string()),
        ht_round_tokens: None,
        ht_chunk_tokens: prim.options().tuning.ht_send_chunk.map(|c| c as usize).filter(|&c| c > 0),
        nic_blocks: nic_blocks(&prim.options().rdma.transport),
        kind,
        topology: Some(prim.topology()),
        rdma: prim.options().rdma.clone(),
    };
    let mut st = RankState::new(families.len());
    let mut out = Vec::new();
    for round in 0..rounds {
        for &fam in families {
            let (d, plan) = run_family(&mut Pair { prim, twin, step: "" }, &s, &mut st, fam, round)?;
            out.extend(d.0.into_iter().map(|x| format!("{} round {round}: {x} [{plan}]", fam.name())));
        }
    }
    Ok(out)
}

// ================================================================================================ summary

/// Memory figures of one series (bytes).
#[derive(Clone, Debug, Serialize)]
pub struct MemSeries {
    /// Rank (device series) or `None` (host RSS of the process).
    pub rank: Option<usize>,
    /// First sample (after the buffers were created).
    pub start: u64,
    /// First sample after warm-up (round `mem_every`, or the last when the run was shorter).
    pub after_warmup: u64,
    /// Last sample.
    pub end: u64,
    /// Largest sample.
    pub max: u64,
    /// `end - after_warmup` (negative: shrank).
    pub growth_after_warmup: i64,
    /// Every sample: (round, bytes).
    pub samples: Vec<(usize, u64)>,
}

fn series(rank: Option<usize>, v: &[Sample]) -> Option<MemSeries> {
    let first = v.first()?;
    let warm = v.get(1).or(v.last())?;
    let last = v.last()?;
    Some(MemSeries {
        rank,
        start: first.1,
        after_warmup: warm.1,
        end: last.1,
        max: v.iter().map(|s| s.1).max().unwrap_or(0),
        growth_after_warmup: last.1 as i64 - warm.1 as i64,
        samples: v.to_vec(),
    })
}

/// Per family over all ranks: the ranks' [`FamilyCount`]s merged by `FamilySummary::add_rank` (JSON: the
/// family, then the counts' fields).
#[derive(Clone, Debug, Serialize)]
pub struct FamilySummary {
    /// Family.
    pub family: Family,
    /// `rounds`: every rank ran each round (the least of the ranks'); `mismatches`, `empty_rank_rounds`:
    /// summed over ranks (a round differing on two ranks counts twice); graph, no-sync, FP8, node-level
    /// routing and multi-round counts: rank 0's (the same on every rank).
    #[serde(flatten)]
    pub counts: FamilyCount,
}

impl FamilySummary {
    fn new(family: Family) -> Self {
        Self { family, counts: FamilyCount { rounds: usize::MAX, ..FamilyCount::default() } }
    }

    fn add_rank(&mut self, rank: usize, c: &FamilyCount) {
        let s = &mut self.counts;
        s.rounds = s.rounds.min(c.rounds);
        s.mismatches += c.mismatches;
        s.empty_rank_rounds += c.empty_rank_rounds;
        if rank == 0 {
            s.graph_rounds = c.graph_rounds;
            s.graph_replays = c.graph_replays;
            s.no_sync_rounds = c.no_sync_rounds;
            s.fp8_rounds = c.fp8_rounds;
            s.node_limited_rounds = c.node_limited_rounds;
            s.empty_node_rounds = c.empty_node_rounds;
            s.node_skewed_rounds = c.node_skewed_rounds;
            s.silent_node_rounds = c.silent_node_rounds;
            s.multi_round_rounds = c.multi_round_rounds;
            s.most_rounds_per_call = c.most_rounds_per_call;
        }
    }
}

/// The JSON written by `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Always "moelink-stress soak".
    pub tool: String,
    /// Code version.
    pub commit: String,
    /// UTC, ISO-8601.
    pub date: String,
    /// GPU name or CPU model.
    pub device: String,
    /// Settings of the run.
    pub settings: Settings,
    /// Wall seconds.
    pub elapsed_s: f64,
    /// Outer rounds completed (each runs one round of every family).
    pub rounds_done: usize,
    /// Why the run stopped before `rounds`, if it did.
    pub stopped_early: Option<String>,
    /// Per family.
    pub families: Vec<FamilySummary>,
    /// Sum of mismatches.
    pub total_mismatches: usize,
    /// Errors (a failing call ends the run).
    pub errors: Vec<String>,
    /// The first differences seen.
    pub failures: Vec<Failure>,
    /// GPU memory used per rank.
    pub device_memory: Vec<MemSeries>,
    /// Resident set of the process (`VmRSS`).
    pub host_rss: Option<MemSeries>,
    /// C heap bytes in live allocations (glibc `mallinfo2`: `uordblks + hblkhd`); flat after warm-up
    /// unless something leaks on the heap.
    pub host_heap_in_use: Option<MemSeries>,
    /// C heap bytes held from the system (`arena + hblkhd`): in use plus free chunks kept for reuse.
    pub host_heap_held: Option<MemSeries>,
    /// Resident set right after `malloc_trim(0)` (`--malloc-trim`): the RSS without the heap's free pages.
    pub host_rss_after_trim: Option<MemSeries>,
    /// "pass" (every round ran to the end or to the budget, no mismatch, no error) or "fail".
    pub verdict: String,
}

/// Runs `moelink-stress soak`.
pub fn run(a: &SoakArgs) -> Result<(), CliError> {
    let kind = match a.backend {
        SoakBackend::Host => BackendKind::Host,
        SoakBackend::Cuda => sys::resolve_backend(BackendKind::Cuda).map_err(CliError)?.0,
        SoakBackend::Auto => sys::resolve_backend(BackendKind::Auto).map_err(CliError)?.0,
    };
    let gpus = if kind == BackendKind::Cuda { sys::gpu_count() } else { 0 };
    let ranks = a.ranks.unwrap_or(if gpus > 0 { gpus } else { 4 });
    if ranks == 0 || a.families.is_empty() || a.hidden.is_empty() || a.topk.is_empty() {
        return Err(CliError("--ranks, --families, --hidden and --topk must not be empty".into()));
    }
    if let Some(h) = a.hidden.iter().find(|&&h| h == 0 || h % 128 != 0) {
        return Err(CliError(format!("--hidden {h}: every hidden size must be a positive multiple of 128")));
    }
    if a.topk.iter().any(|&k| k == 0 || k > 16) || a.t_max == 0 || a.ll_t_max == 0 {
        return Err(CliError("--topk must be in 1..=16, --t-max and --ll-t-max at least 1".into()));
    }
    let topology = match &a.topology {
        Some(t) => {
            let t = t.parse::<moelink::Topology>().map_err(|e| CliError(format!("--topology: {e}")))?;
            if t.num_ranks() != ranks {
                return Err(CliError(format!("--topology {t} is {} ranks, not --ranks {ranks}", t.num_ranks())));
            }
            Some(t)
        }
        None => None,
    };
    let internode = topology.is_some_and(|t| t.is_internode());
    if a.ht_round_tokens == Some(0) || a.ht_chunk_tokens == Some(0) {
        return Err(CliError("--ht-round-tokens and --ht-chunk-tokens must be at least 1".into()));
    }
    let transport = a.transport.parse::<moelink::Transport>().map_err(|e| CliError(format!("--transport: {e}")))?;
    if transport == moelink::Transport::Nvshmem {
        return Err(CliError("--transport nvshmem needs one process per rank; the soak runs its ranks as threads".into()));
    }
    let rdma =
        moelink::RdmaOptions { transport, allow_nvlink_for_low_latency_mode: !a.no_nvlink_in_node, ..moelink::RdmaOptions::default() };
    let max_h = *a.hidden.iter().max().expect("non-empty");
    let max_k = *a.topk.iter().max().expect("non-empty");
    let nvl = Buffer::ht_bytes_needed(a.t_max, max_h, max_k, ranks, false).max(Buffer::ht_bytes_needed(a.t_max, max_h, max_k, ranks, true));
    let rdma_bytes = Buffer::ll_bytes_needed(a.ll_t_max, max_h, ranks, (ranks * 8).max(max_k.div_ceil(ranks) * ranks));
    // Across nodes with an HT family: both regions sized for rounds of `ht_round_tokens` tokens at the largest
    // rows (bf16 or FP8, whichever needs more), smaller than most rounds' token counts so that calls run in
    // several rounds; the RDMA region holds the LL calls' needs too (the two share it, as in DeepEP).
    let ht_across = internode && a.families.iter().any(|f| !f.is_ll());
    let ht_round_tokens = ht_across.then(|| a.ht_round_tokens.unwrap_or(a.t_max / 4).max(1));
    let (nvl, rdma_bytes) = match (topology, ht_round_tokens) {
        (Some(t), Some(m)) => {
            let (b, f) = (
                moelink::internode::ht_bytes_needed(t, m, max_h, max_k, false),
                moelink::internode::ht_bytes_needed(t, m, max_h, max_k, true),
            );
            (b.num_nvl_bytes.max(f.num_nvl_bytes), b.num_rdma_bytes.max(f.num_rdma_bytes).max(rdma_bytes))
        }
        _ => (nvl, rdma_bytes),
    };
    let env_chunk = moelink_cli::env::buffer_options().tuning.ht_send_chunk.map(|c| c as usize).filter(|&c| c > 0);
    let ht_chunk_tokens = internode.then(|| a.ht_chunk_tokens.or(env_chunk).unwrap_or(4));
    let s = Settings {
        backend: sys::backend_name(kind).into(),
        ranks,
        rounds: a.rounds,
        families: a.families.clone(),
        t_max: a.t_max,
        ll_t_max: a.ll_t_max,
        hidden: a.hidden.clone(),
        topk: a.topk.clone(),
        graph_fraction: a.graph_fraction,
        ll_block: a.ll_block.max(1),
        seed: a.seed,
        time_budget_s: a.time_budget_s,
        mem_every: a.mem_every.max(1),
        malloc_trim: a.malloc_trim,
        timeout_ms: a.timeout_ms,
        num_nvl_bytes: nvl,
        num_rdma_bytes: rdma_bytes,
        nodes: topology.map_or(1, |t| t.num_nodes),
        ranks_per_node: topology.map_or(ranks, |t| t.ranks_per_node),
        transport: internode.then(|| rdma.transport.name().to_string()),
        ht_round_tokens,
        ht_chunk_tokens,
        nic_blocks: nic_blocks(&rdma.transport),
        kind,
        topology,
        rdma,
    };
    println!(
        "moelink-stress soak | {} vs host | {ranks} ranks{} | {} rounds x {} families | T<={} LL T<={} | hidden {:?} | seed {} | commit {}",
        s.backend,
        match (&s.transport, s.ht_round_tokens) {
            (Some(t), Some(m)) => format!(
                " as {} nodes x {} over {t}, buffers for HT rounds of {m} tokens at hidden {max_h}, chunks of {}",
                s.nodes,
                s.ranks_per_node,
                s.ht_chunk_tokens.unwrap_or(0)
            ),
            (Some(t), None) => format!(" as {} nodes x {} over {t}", s.nodes, s.ranks_per_node),
            _ => String::new(),
        },
        s.rounds,
        s.families.len(),
        s.t_max,
        s.ll_t_max,
        s.hidden,
        s.seed,
        sys::commit()
    );
    let sh = Shared { abort: AtomicBool::new(false), start: Instant::now(), done: AtomicUsize::new(0), failures: Mutex::new(0) };
    let group_timeout = Duration::from_millis(a.timeout_ms.saturating_mul(3).max(120_000));
    let finished = AtomicBool::new(false);
    let reports = std::thread::scope(|scope| {
        if a.progress_s > 0.0 {
            let (sh, finished, s) = (&sh, &finished, &s);
            scope.spawn(move || {
                let mut last = Instant::now();
                while !finished.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed().as_secs_f64() >= a.progress_s {
                        last = Instant::now();
                        let done = sh.done.load(Ordering::Relaxed);
                        let bad = *sh.failures.lock().unwrap_or_else(|e| e.into_inner());
                        eprintln!(
                            "[soak] {:.0} s: {done}/{} rounds of each family, {bad} mismatching rank-rounds",
                            sh.start.elapsed().as_secs_f64(),
                            s.rounds
                        );
                    }
                }
            });
        }
        let r = moelink::group::run_ranks_with_timeout(ranks, group_timeout, |g| rank_main(g, &s, &sh));
        finished.store(true, Ordering::Relaxed);
        r
    });
    let elapsed_s = sh.start.elapsed().as_secs_f64();

    let mut families: Vec<FamilySummary> = s.families.iter().map(|&f| FamilySummary::new(f)).collect();
    let (mut errors, mut failures, mut device_memory, mut host) = (Vec::new(), Vec::new(), Vec::new(), HostSamples::default());
    let mut rounds_done = usize::MAX;
    let mut stopped = None;
    for (rank, r) in reports.into_iter().enumerate() {
        match r {
            Ok(rep) => {
                for (fs, c) in families.iter_mut().zip(&rep.counts) {
                    fs.add_rank(rank, c);
                }
                failures.extend(rep.failures);
                if let Some(e) = rep.error {
                    errors.push(format!("rank {rank}: {e}"));
                }
                if let Some(m) = series(Some(rank), &rep.device_mem) {
                    device_memory.push(m);
                }
                if rank == 0 {
                    host = rep.host;
                }
                rounds_done = rounds_done.min(rep.rounds_done);
                stopped = stopped.or(rep.stop_reason);
            }
            Err(e) => errors.push(format!("rank {rank}: {e}")),
        }
    }
    for f in &mut families {
        if f.counts.rounds == usize::MAX {
            f.counts.rounds = 0;
        }
    }
    if rounds_done == usize::MAX {
        rounds_done = 0;
    }
    failures.truncate(MAX_FAILURES_KEPT);
    let total_mismatches: usize = families.iter().map(|f| f.counts.mismatches).sum();
    let budget_stop = stopped.as_deref().is_some_and(|r| r.starts_with("time budget"));
    let verdict = if total_mismatches == 0 && errors.is_empty() && (stopped.is_none() || budget_stop) { "pass" } else { "fail" };
    let summary = Summary {
        tool: "moelink-stress soak".into(),
        commit: sys::commit(),
        date: sys::utc_now(),
        device: sys::device_name(kind),
        settings: s.clone(),
        elapsed_s,
        rounds_done,
        stopped_early: stopped,
        families,
        total_mismatches,
        errors,
        failures,
        device_memory,
        host_rss: series(None, &host.rss),
        host_heap_in_use: series(None, &host.heap_in_use),
        host_heap_held: series(None, &host.heap_held),
        host_rss_after_trim: series(None, &host.rss_after_trim),
        verdict: verdict.into(),
    };
    print_summary(&summary);
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&summary).map_err(|e| CliError(format!("cannot encode the summary: {e}")))?;
        std::fs::write(path, text + "\n").map_err(|e| CliError(format!("cannot write {}: {e}", path.display())))?;
        println!("wrote {}", path.display());
    }
    if summary.verdict == "pass" {
        Ok(())
    } else {
        Err(CliError(format!(
            "soak failed: {total_mismatches} mismatching rank-rounds, {} errors{}",
            summary.errors.len(),
            summary.stopped_early.as_deref().map(|r| format!(", stopped early: {r}")).unwrap_or_default()
        )))
    }
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

fn print_summary(s: &Summary) {
    println!(
        "family          rounds  mismatches  graph(rounds/replays)  no-sync  fp8  empty-rank  node-limited  empty-node  node-skewed  \
         silent-node  multi-round (most)"
    );
    for FamilySummary { family, counts: f } in &s.families {
        println!(
            "{:<15} {:>6}  {:>10}  {:>10}/{:<10}  {:>7}  {:>4}  {:>10}  {:>12}  {:>10}  {:>11}  {:>11}  {:>11} ({})",
            family.name(),
            f.rounds,
            f.mismatches,
            f.graph_rounds,
            f.graph_replays,
            f.no_sync_rounds,
            f.fp8_rounds,
            f.empty_rank_rounds,
            f.node_limited_rounds,
            f.empty_node_rounds,
            f.node_skewed_rounds,
            f.silent_node_rounds,
            f.multi_round_rounds,
            f.most_rounds_per_call
        );
    }
    for m in &s.device_memory {
        println!(
            "GPU memory rank {}: start {} MiB, after warm-up {} MiB, end {} MiB, max {} MiB ({} samples)",
            m.rank.unwrap_or(0),
            mib(m.start),
            mib(m.after_warmup),
            mib(m.end),
            mib(m.max),
            m.samples.len()
        );
    }
    let host = [
        ("host RSS", &s.host_rss),
        ("host heap in use", &s.host_heap_in_use),
        ("host heap held", &s.host_heap_held),
        ("host RSS after malloc_trim", &s.host_rss_after_trim),
    ];
    for (what, m) in host {
        if let Some(m) = m {
            println!(
                "{what}: start {} MiB, after warm-up {} MiB, end {} MiB, max {} MiB ({} samples)",
                mib(m.start),
                mib(m.after_warmup),
                mib(m.end),
                mib(m.max),
                m.samples.len()
            );
        }
    }
    for e in &s.errors {
        println!("ERROR {e}");
    }
    for f in s.failures.iter().take(5) {
        println!("MISMATCH {} round {} rank {}: {} [{}]", f.family, f.round, f.rank, f.what, f.plan);
    }
    println!(
        "soak: {} after {:.1} s, {} rounds per family{}",
        s.verdict.to_uppercase(),
        s.elapsed_s,
        s.rounds_done,
        s.stopped_early.as_deref().map(|r| format!(" (stopped: {r})")).unwrap_or_default()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of a short host-against-host soak across 2x2 virtual nodes on emu-nic.
    fn across_nodes(families: Vec<Family>, json: &std::path::Path) -> SoakArgs {
        SoakArgs {
            backend: SoakBackend::Host,
            ranks: Some(4),
            rounds: 4,
            families,
            t_max: 8,
            ll_t_max: 4,
            hidden: vec![256],
            topk: vec![2],
            graph_fraction: 0.0,
            ll_block: 2,
            seed: 3,
            time_budget_s: None,
            mem_every: 2,
            malloc_trim: false,
            timeout_ms: 10_000,
            json: Some(json.to_path_buf()),
            progress_s: 0.0,
            topology: Some("2x2".into()),
            ht_round_tokens: None,
            ht_chunk_tokens: None,
            transport: "emu-nic".into(),
            no_nvlink_in_node: true,
        }
    }

    fn summary(json: &std::path::Path) -> serde_json::Value {
        let v = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        let _ = std::fs::remove_file(json);
        v
    }

    fn sum(v: &serde_json::Value, key: &str) -> u64 {
        v["families"].as_array().unwrap().iter().map(|f| f[key].as_u64().unwrap()).sum()
    }

    #[test]
    fn every_family_soaks_across_virtual_nodes_on_one_buffer_pair_and_bad_settings_are_refused() {
        let json = std::env::temp_dir().join(format!("moelink-soak-nodes-test-{}.json", std::process::id()));
        let mut a = across_nodes(vec![Family::Ll, Family::LlPrereduced, Family::LlHook], &json);
        run(&a).expect("host against host must agree across virtual nodes");
        let v = summary(&json);
        assert_eq!(
            (v["verdict"].as_str(), v["settings"]["nodes"].as_u64(), v["settings"]["transport"].as_str()),
            (Some("pass"), Some(2), Some("emu-nic"))
        );
        // LL only: no HT round size.
        assert!(v["settings"]["ht_round_tokens"].is_null());
        // Across nodes the draw includes node-limited routing, and those rounds agree too.
        assert!(sum(&v, "node_limited_rounds") > 0, "no node-limited round in {}", v["families"]);
        // HT and LL families on one buffer pair: every LL round after HT rounds cleans the shared RDMA region
        // first (the buffers refuse LL calls otherwise), in and between LL blocks.
        a.families = vec![Family::Ht, Family::Ll, Family::HtCached, Family::LlHook];
        run(&a).expect("HT then LL rounds across nodes on one buffer pair");
        let v = summary(&json);
        assert_eq!(v["verdict"], "pass");
        assert_eq!(v["settings"]["ht_round_tokens"], 2, "T_MAX / 4 by default");
        assert_eq!(v["settings"]["ht_chunk_tokens"], 4);
        a.families = vec![Family::Ll];
        a.transport = "nvshmem".into();
        assert!(run(&a).unwrap_err().0.contains("one process per rank"));
        a.transport = "emu-nic".into();
        a.ht_round_tokens = Some(0);
        assert!(run(&a).unwrap_err().0.contains("--ht-round-tokens"));
        a.ht_round_tokens = None;
        a.topology = Some("3x2".into());
        assert!(run(&a).unwrap_err().0.contains("--topology"));
    }

    #[test]
    fn high_throughput_rounds_across_two_by_two_virtual_nodes_agree_with_the_twin() {
        let json = std::env::temp_dir().join(format!("moelink-soak-ht-nodes-test-{}.json", std::process::id()));
        let a = SoakArgs {
            rounds: 16,
            t_max: 12,
            hidden: vec![256, 512],
            topk: vec![2, 4],
            graph_fraction: 0.5,
            ht_round_tokens: Some(2),
            ht_chunk_tokens: Some(1),
            seed: 11,
            ..across_nodes(vec![Family::Ht, Family::HtCached], &json)
        };
        run(&a).expect("HT across 2x2 virtual nodes, host against host");
        let v = summary(&json);
        assert_eq!(v["verdict"], "pass", "{v}");
        assert!(v["families"].as_array().unwrap().iter().all(|f| f["rounds"] == 16 && f["mismatches"] == 0));
        // Buffers for 2 tokens per round at hidden 512: most calls run several rounds.
        assert!(sum(&v, "multi_round_rounds") >= 16, "{}", v["families"]);
        assert!(v["families"][0]["most_rounds_per_call"].as_u64().unwrap() >= 3);
        // The node-level cases are drawn: node-limited, an empty node, a skew to one node, a silent node.
        for key in ["node_limited_rounds", "empty_node_rounds", "node_skewed_rounds", "silent_node_rounds", "empty_rank_rounds"] {
            assert!(sum(&v, key) > 0, "no {key} in {}", v["families"]);
        }
        // The host backend has no CUDA graph: none drawn.
        assert_eq!(sum(&v, "graph_rounds"), 0);
    }

    #[test]
    fn a_short_host_soak_passes_and_writes_its_summary() {
        let json = std::env::temp_dir().join(format!("moelink-soak-test-{}.json", std::process::id()));
        let a = SoakArgs {
            backend: SoakBackend::Host,
            ranks: Some(3),
            rounds: 6,
            families: vec![Family::Ht, Family::HtCached, Family::Ll, Family::LlPrereduced, Family::LlHook],
            t_max: 8,
            ll_t_max: 4,
            hidden: vec![256, 512],
            topk: vec![2, 4],
            graph_fraction: 0.5,
            ll_block: 2,
            seed: 5,
            time_budget_s: None,
            mem_every: 2,
            malloc_trim: true,
            timeout_ms: 10_000,
            json: Some(json.clone()),
            progress_s: 0.0,
            topology: None,
            ht_round_tokens: None,
            ht_chunk_tokens: None,
            transport: "emu-nic".into(),
            no_nvlink_in_node: false,
        };
        run(&a).expect("host against host must agree");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let _ = std::fs::remove_file(&json);
        assert_eq!(v["verdict"], "pass");
        assert_eq!(v["rounds_done"], 6);
        assert_eq!(v["families"].as_array().unwrap().len(), 5);
        assert!(v["families"].as_array().unwrap().iter().all(|f| f["rounds"] == 6 && f["mismatches"] == 0));
        // One node: no node-limited routing is drawn.
        assert!(v["families"].as_array().unwrap().iter().all(|f| f["node_limited_rounds"] == 0));
        assert!(v["host_rss"]["max"].as_u64().unwrap() > 0);
        // A sample at rounds 0, 2, 4 and the end (6) of every host series.
        for key in ["host_rss", "host_heap_in_use", "host_heap_held", "host_rss_after_trim"] {
            let rounds: Vec<u64> = v[key]["samples"].as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap()).collect();
            assert_eq!(rounds, [0, 2, 4, 6], "{key}");
        }
        assert!(v["host_heap_held"]["max"].as_u64() >= v["host_heap_in_use"]["max"].as_u64());
    }
}
