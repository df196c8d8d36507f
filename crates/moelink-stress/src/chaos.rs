//! `moelink-stress chaos`: one rank of a process-mode group SIGKILLs itself in the middle of a collective; the
//! survivors must notice within the deadline, stay alive and carry on.
//!
//! Launch one process per GPU with `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `LOCAL_RANK` set
//! (`scripts/device/run.sh`'s `reliability` step does; torchrun would kill every worker once one dies). Every rank
//! builds a CUDA buffer with a short deadline (`--timeout-ms`), warms the phase up, then loops it: each iteration
//! is a full round trip (HT: layout → dispatch → identity combine; LL: dispatch → identity combine), checked
//! against a host-backend simulation of all ranks on the same seeded inputs. At iteration `--kill-at` (default:
//! drawn from the seed, the same on every rank) the victim enqueues the phase's kernel on a stream of its own
//! (`Buffer::on_stream`), spins a few microseconds so that the kernel is in flight, prints `CHAOS_KILL {json}` with
//! the time and sends itself SIGKILL.
//!
//! Survivors, default mode: the loop must end with `Error::Timeout` naming the victim within the deadline
//! (plus slack); the buffer must then refuse work (`Error::Poisoned`); dropping it must return; then the
//! survivors build a fresh group over themselves (a new TCP rendezvous on `--recover-port`, ranks numbered
//! in order of their old ranks, the lowest surviving rank as rank 0) and a fresh CUDA buffer, and run
//! dispatch/combine rounds on it checked bit for bit against a host-backend twin. The ranks also exchange
//! which peer each one's timeout named, so that a chain (a survivor that timed out waiting for another
//! survivor, which had itself timed out on the victim) is traced back to its root.
//!
//! `--shrink` (LL phases): the buffer is created with `enable_shrink`; the survivors keep looping a fixed
//! number of iterations: no call may fail, the victim must end up masked (and only it), and every iteration
//! after the kill must equal the host backend with the victim masked.
//!
//! What the survivors' GPUs do with the dead rank's memory: the CUDA driver documents freeing an exported
//! allocation before the importers close their mappings as undefined; in practice the importer's mapping
//! holds a reference to the physical pages (imported mappings pin the exporter's memory until they are
//! closed or the importer exits), so stores into a dead peer's buffer land in orphaned pages. In the
//! default mode survivors stop touching the victim's memory once their kernels time out (the buffer is
//! poisoned; its symmetric memory and mappings are kept, never freed under a peer); in shrink mode the
//! low-latency kernels keep writing flags and rows to the masked rank (receivers drop them) — the GPU run
//! tells whether that stays harmless.
//!
//! Across nodes (`--topology 2x2`, virtual nodes: 4 processes under CUDA MPS on one GPU, transport `ptr`,
//! `emu-nic` or `nvshmem`) every phase runs the internode kernels. The high-throughput buffers are sized for
//! rounds of a quarter of the call's tokens ([`moelink::internode::ht_bytes_needed`]), so each call runs
//! several rounds and its waits include the per-round hand-backs. What a survivor of an HT kill can assert
//! follows from `hti_*.cu`: every wait has its own deadline (from when it starts) and names the peer it
//! waits for and the domain, and a kernel that timed out winds down without handing back, so its own waiters
//! time out too; each rank records only its first timeout. Hence, per survivor:
//! - the call ends with `Error::Timeout` within the deadline (+ 2 s), in a phase of the internode HT domains
//!   that fits where the victim died: its dispatch kernel → `DispatchRdma`, `DispatchNvlink`, or (when the
//!   victim's part of the dispatch was done) `CombineRdma` / `CombineNvlink` of the same iteration; its combine
//!   kernel → `CombineRdma`, `CombineNvlink`, or `Notify` of the next iteration;
//! - the peer named is one the survivor waits for in that domain: over NVLink a rank of its own node (a
//!   forwarder, or a local receiver the forwarder writes to — the forwarder on the survivor's node that waits
//!   for the victim is named, not the victim); over RDMA a rank on its rail (the same local index: rail peers
//!   exchange every RDMA message, its own forwarder included); in notify any rank. No peer at all is accepted
//!   (a reducer waiting for its own rank's previous round, an emulated NIC's queue) and reported.
//!
//! The named peer need not be the victim, nor lead to it: a survivor can name a survivor whose own first
//! timeout named it back (independent warps: the sender waits for a rail peer's forwarder while that rank's
//! receiver waits for rows the sender never sent), or itself (a sender waits for its own forwarder, which waits
//! for the victim; rarely, as waits for a rank's own roles get twice the deadline). So across nodes the chain is traced and reported (`chain`: victim, cycle or unnamed) but
//! only one thing is asserted of the group: at least one survivor names the victim — the victim's rail peer
//! on the other node waits for it directly from the start of either kernel (the forwarder for its chunks, the
//! reducer for its partials). On one node, and for the low-latency phases, every chain must lead to the victim.
//!
//! Each surviving rank prints one line `CHAOS_RESULT {json}` and exits 0 when its checks passed.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Args, ValueEnum};
use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, CombineArgs, CombineOutputs, DType, DispatchArgs, DispatchLayout, DispatchOutputs,
    DispatchResult, Error, Group, LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlDispatchResult, LlQuant, Payload,
    Phase, Result, Routing, TcpGroup, Tensor, ThreadGroup,
};
use moelink_cli::CliError;
use moelink_testkit::rng::Rng;
use moelink_testkit::routing::{route, RouteKind};
use moelink_testkit::values::{random_bf16, random_weights};
use serde::Serialize;

use crate::soak::{self, Family};

/// Where the victim dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChaosPhase {
    /// In the middle of a high-throughput dispatch kernel.
    HtDispatch,
    /// In the middle of a high-throughput combine kernel.
    HtCombine,
    /// In the middle of a low-latency dispatch kernel.
    LlDispatch,
    /// In the middle of a low-latency combine kernel.
    LlCombine,
}

impl ChaosPhase {
    fn is_ll(self) -> bool {
        matches!(self, ChaosPhase::LlDispatch | ChaosPhase::LlCombine)
    }
    fn name(self) -> &'static str {
        match self {
            ChaosPhase::HtDispatch => "ht-dispatch",
            ChaosPhase::HtCombine => "ht-combine",
            ChaosPhase::LlDispatch => "ll-dispatch",
            ChaosPhase::LlCombine => "ll-combine",
        }
    }
}

/// Backend of the buffers under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChaosBackend {
    /// CUDA kernels (the real test).
    Cuda,
    /// The host backend: exercises the harness without a GPU (a dead peer then shows up as a group error).
    Host,
}

/// Options of `moelink-stress chaos`.
#[derive(Args, Debug, Clone)]
pub struct ChaosArgs {
    /// The collective the victim dies in.
    #[arg(long, value_enum)]
    pub phase: ChaosPhase,
    /// The rank that kills itself.
    #[arg(long, default_value_t = 3)]
    pub victim: usize,
    /// Low-latency shrink mode: survivors mask the victim and keep serving.
    #[arg(long)]
    pub shrink: bool,
    /// The buffers' deadline (`timeout_ms`).
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
    /// Iterations: the fixed loop length in shrink mode; otherwise the most a survivor runs before it gives
    /// up waiting for an error.
    #[arg(long, default_value_t = 120)]
    pub iterations: usize,
    /// Iteration in which the victim dies (default: drawn from the seed in [iterations/5, iterations/2]).
    #[arg(long)]
    pub kill_at: Option<usize>,
    /// Port of the survivors' new rendezvous (default: MASTER_PORT + 2).
    #[arg(long)]
    pub recover_port: Option<u16>,
    /// Rounds run on the rebuilt buffer (each checked against the host backend).
    #[arg(long, default_value_t = 3)]
    pub verify_rounds: usize,
    /// Wall-clock limit of a survivor's loop, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub limit_s: f64,
    /// Seed of the inputs and of the kill iteration.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Backend: cuda (default) or host (harness check without a GPU; no shrink mode).
    #[arg(long, value_enum, default_value_t = ChaosBackend::Cuda)]
    pub backend: ChaosBackend,
    /// The ranks as NODESxRANKS_PER_NODE (virtual nodes on one host, e.g. 2x2): the victim dies in a call
    /// across nodes (any phase; the high-throughput ones run several rounds per call). The survivors'
    /// rebuilt buffer spans one node.
    #[arg(long, value_name = "NODESxRANKS")]
    pub topology: Option<String>,
    /// With --topology: the RDMA transport between nodes, ptr, emu-nic or nvshmem.
    #[arg(long, default_value = "emu-nic")]
    pub transport: String,
}

/// The topology and RDMA settings of `--topology` / `--transport` for `world` ranks; `None` on one node.
fn chaos_topology(a: &ChaosArgs, world: usize) -> std::result::Result<Option<(moelink::Topology, moelink::RdmaOptions)>, CliError> {
    let Some(spec) = &a.topology else { return Ok(None) };
    let topology = spec.parse::<moelink::Topology>().map_err(|e| CliError(format!("--topology: {e}")))?;
    if topology.num_ranks() != world {
        return Err(CliError(format!("--topology {topology} is {} ranks, not WORLD_SIZE {world}", topology.num_ranks())));
    }
    if !topology.is_internode() {
        return Ok(None);
    }
    let transport = a.transport.parse::<moelink::Transport>().map_err(|e| CliError(format!("--transport: {e}")))?;
    let rdma = moelink::RdmaOptions {
        transport,
        // NVSHMEM's installation and the CUDA headers, as `moelink bench transport` finds them.
        nvshmem_home: std::env::var_os("NVSHMEM_HOME").map(std::path::PathBuf::from),
        cuda_home: std::env::var_os("CUDA_HOME").map(std::path::PathBuf::from),
        ..Default::default()
    };
    Ok(Some((topology, rdma)))
}

/// Problem size of the loop (small: the point is the failure, not the bandwidth).
#[derive(Clone, Copy, Debug, Serialize)]
struct Shape {
    ranks: usize,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
}

impl Shape {
    fn new(ranks: usize, ll: bool) -> Shape {
        Shape { ranks, tokens: if ll { 16 } else { 64 }, hidden: 2048, topk: 8, experts: ranks * 8 }
    }
    fn rows(&self) -> usize {
        self.ranks * self.tokens
    }
    /// Across nodes: the high-throughput round the buffers are sized for, a quarter of the call's tokens, so
    /// that every call runs several rounds (and its waits include the hand-backs between them).
    fn ht_round_tokens(&self) -> usize {
        (self.tokens / 4).max(1)
    }
}

/// Where the survivors of a rank killed in `kill` may time out across nodes (the module docs say why).
fn internode_ht_phases(kill: ChaosPhase) -> &'static [Phase] {
    match kill {
        ChaosPhase::HtDispatch => &[Phase::DispatchRdma, Phase::DispatchNvlink, Phase::CombineRdma, Phase::CombineNvlink],
        _ => &[Phase::CombineRdma, Phase::CombineNvlink, Phase::Notify],
    }
}

/// Checks a survivor's timeout after a rank died in an HT call across nodes: the phase fits where the victim
/// died, and the peer named (if any) is one rank `me` waits for in that domain (module docs).
fn check_internode_ht_timeout(
    kill: ChaosPhase,
    t: moelink::Topology,
    me: usize,
    peer: usize,
    phase: Phase,
) -> std::result::Result<(), String> {
    let allowed = internode_ht_phases(kill);
    if !allowed.contains(&phase) {
        let names: Vec<String> = allowed.iter().map(|p| p.to_string()).collect();
        return Err(format!("timeout in {phase}; a rank killed in {} ends the survivors' calls in {}", kill.name(), names.join(", ")));
    }
    if peer == usize::MAX {
        return Ok(());
    }
    if peer >= t.num_ranks() {
        return Err(format!("the timeout names rank {peer}, not a rank of {t}"));
    }
    match phase {
        Phase::DispatchNvlink | Phase::CombineNvlink if t.node_of(peer) != t.node_of(me) => {
            Err(format!("an NVLink-domain timeout ({phase}) names rank {peer}, not a rank of rank {me}'s node"))
        }
        Phase::DispatchRdma | Phase::CombineRdma if t.local_rank_of(peer) != t.local_rank_of(me) => {
            Err(format!("an RDMA-domain timeout ({phase}) names rank {peer}, not a rank on rank {me}'s rail (local index)"))
        }
        _ => Ok(()),
    }
}

/// Follows the survivors' named peers from `start` (old ranks; `named[i]`: what survivor `survivors[i]`
/// named): "victim" when the chain reaches it, "cycle" when it comes back to a survivor, "unnamed" when it
/// ends at a survivor that named nobody (or at a rank that is not a survivor).
fn trace_chain(start: Option<usize>, victim: usize, survivors: &[usize], named: &[Option<usize>]) -> &'static str {
    let mut seen = Vec::new();
    let mut at = start;
    loop {
        match at {
            Some(p) if p == victim => return "victim",
            Some(p) if seen.contains(&p) => return "cycle",
            Some(p) => {
                seen.push(p);
                at = survivors.iter().position(|&r| r == p).and_then(|i| named[i]);
            }
            None => return "unnamed",
        }
    }
}

/// One rank's inputs for input set `set` (0 or 1: iterations alternate, so a stale output never passes).
struct Inputs {
    x: Vec<bf16>,
    idx: Vec<i64>,
    w: Vec<f32>,
}

fn inputs(sh: &Shape, seed: u64, rank: usize, set: usize) -> Inputs {
    let mut rng = Rng::new(seed ^ 0xc4a0_5000 ^ ((rank as u64) << 20) ^ ((set as u64) << 40));
    let kind = if set == 0 { RouteKind::Uniform } else { RouteKind::WithHoles };
    Inputs {
        idx: route(&mut rng, kind, sh.tokens, sh.topk, sh.experts, sh.ranks),
        x: random_bf16(&mut rng, sh.tokens * sh.hidden),
        w: random_weights(&mut rng, sh.tokens * sh.topk),
    }
}

/// What one iteration produced on one rank (compared between backends).
#[derive(Clone, Debug, PartialEq)]
struct Out {
    /// HT: received rows; LL: per-expert counts then the valid rows.
    recv: Vec<u8>,
    combined: Vec<u8>,
}

/// Tensors of one input set on a buffer's location.
struct Loaded {
    x: Tensor,
    idx: Tensor,
    w: Tensor,
}

fn load(buf: &Buffer, sh: &Shape, inp: &Inputs) -> Result<Loaded> {
    Ok(Loaded {
        x: buf.upload(&Tensor::from_vec(inp.x.clone(), &[sh.tokens, sh.hidden])?)?,
        idx: buf.upload(&Tensor::from_vec(inp.idx.clone(), &[sh.tokens, sh.topk])?)?,
        w: buf.upload(&Tensor::from_vec(inp.w.clone(), &[sh.tokens, sh.topk])?)?,
    })
}

/// Where the victim dies: right after the named kernel was enqueued.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    BeforeDispatch,
    BeforeCombine,
}

fn ll_args<'a>(sh: &Shape, inp: &'a Loaded) -> LlDispatchArgs<'a> {
    LlDispatchArgs {
        x: inp.x.view(),
        topk_idx: inp.idx.view(),
        topk_weights: None,
        num_max_dispatch_tokens_per_rank: sh.tokens,
        num_experts: sh.experts,
        quant: LlQuant::Bf16,
        return_recv_hook: false,
    }
}

fn ll_combine_args<'a>(d: &'a LlDispatchResult, inp: &'a Loaded) -> LlCombineArgs<'a> {
    LlCombineArgs {
        x: d.recv_x.view(),
        topk_idx: inp.idx.view(),
        topk_weights: inp.w.view(),
        handle: &d.handle,
        zero_copy: false,
        return_recv_hook: false,
    }
}

fn ht_args<'a>(layout: &'a DispatchLayout, inp: &'a Loaded) -> DispatchArgs<'a> {
    DispatchArgs {
        x: Payload::Bf16(inp.x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(inp.idx.view()), topk_weights: Some(inp.w.view()) },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    }
}

/// Identity experts: the received rows go back as they are, with the received weights.
fn ht_combine_args(d: &DispatchResult) -> CombineArgs<'_> {
    CombineArgs {
        x: d.recv_x.view(),
        handle: &d.handle,
        topk_weights: d.recv_topk_weights.as_ref().map(|t| t.view()),
        bias: [None, None],
        config: None,
    }
}

/// One iteration (HT: layout → dispatch → identity combine; LL: dispatch → identity combine).
fn iteration(buf: &mut Buffer, sh: &Shape, ll: bool, inp: &Loaded) -> Result<Out> {
    if ll {
        let d = buf.low_latency_dispatch(&ll_args(sh, inp))?;
        let cargs = ll_combine_args(&d, inp);
        let combined = buf.low_latency_combine(&cargs)?;
        let count: Vec<i32> = d.recv_count.to_vec()?;
        let bytes = d.recv_x.to_host_bytes()?;
        let (rows, rb) = (sh.rows(), 2 * sh.hidden);
        let mut recv: Vec<u8> = count.iter().flat_map(|c| c.to_le_bytes()).collect();
        for (e, &n) in count.iter().enumerate() {
            let n = (n.max(0) as usize).min(rows);
            recv.extend_from_slice(&bytes[e * rows * rb..(e * rows + n) * rb]);
        }
        return Ok(Out { recv, combined: combined.to_host_bytes()? });
    }
    let layout = buf.get_dispatch_layout(inp.idx.view(), sh.experts)?;
    let args = ht_args(&layout, inp);
    let d = buf.dispatch(&args)?;
    let cargs = ht_combine_args(&d);
    let c = buf.combine(&cargs)?;
    Ok(Out { recv: d.recv_x.to_host_bytes()?, combined: c.combined_x.to_host_bytes()? })
}

/// The victim's death: where, and what it prints.
#[derive(Clone, Copy)]
struct Victim {
    rank: usize,
    phase: ChaosPhase,
    iteration: usize,
    seed: u64,
}

impl Victim {
    fn die(self) -> ! {
        die(self.rank, self.phase, self.iteration, self.seed)
    }
}

/// The victim's last iteration: runs it up to `stop`, enqueues that call on `stream` and dies while the
/// kernel is in flight (the outputs are allocated first; nothing is dropped, the process ends). On the host
/// backend, which has no stream to leave a kernel on, the victim runs the whole iteration, then dies.
fn die_in(
    buf: &mut Buffer,
    sh: &Shape,
    ll: bool,
    inp: &Loaded,
    stop: Stop,
    stream: Option<&moelink_cuda::Stream>,
    victim: Victim,
) -> Result<()> {
    let die = || victim.die();
    let Some(stream) = stream else {
        iteration(buf, sh, ll, inp)?;
        die()
    };
    let (el, t, h, k) = (sh.experts / sh.ranks, sh.tokens, sh.hidden, sh.topk);
    if ll {
        let args = ll_args(sh, inp);
        if stop == Stop::BeforeDispatch {
            // The outputs the survivors' calls write (low_latency_dispatch allocates the same).
            let (mut recv_x, mut count) = (buf.alloc(DType::BF16, &[el, sh.rows(), h])?, buf.alloc(DType::I32, &[el])?);
            let (mut src_info, mut layout_range) = (buf.alloc(DType::I32, &[el, sh.rows()])?, buf.alloc(DType::I64, &[el, sh.ranks])?);
            let out = LlDispatchOutputs {
                recv_x: recv_x.view_mut(),
                recv_scales: None,
                recv_count: count.view_mut(),
                cumulative_local_expert_recv_stats: None,
                dispatch_wait_recv_cost_stats: None,
                src_info: Some(src_info.view_mut()),
                layout_range: Some(layout_range.view_mut()),
            };
            return buf.on_stream(stream, |s| {
                s.low_latency_dispatch_into(&args, out)?;
                die()
            });
        }
        let d = buf.low_latency_dispatch(&args)?;
        let cargs = ll_combine_args(&d, inp);
        let mut combined = buf.alloc(DType::BF16, &[t, h])?;
        let out = LlCombineOutputs { combined_x: combined.view_mut(), combine_wait_recv_cost_stats: None };
        return buf.on_stream(stream, |s| {
            s.low_latency_combine_into(&cargs, out)?;
            die()
        });
    }
    let layout = buf.get_dispatch_layout(inp.idx.view(), sh.experts)?;
    let args = ht_args(&layout, inp);
    if stop == Stop::BeforeDispatch {
        let plan = buf.prepare_dispatch(&args)?;
        let n = plan.num_recv_rows();
        let mut recv_x = buf.alloc(DType::BF16, &[n, h])?;
        let mut recv_idx = buf.alloc(DType::I64, &[n, k])?;
        let mut recv_w = buf.alloc(DType::F32, &[n, k])?;
        let (mut rank_prefix, mut src_idx) = (buf.alloc(DType::I32, &[sh.ranks, sh.ranks])?, buf.alloc(DType::I32, &[n])?);
        let out = DispatchOutputs {
            recv_x: recv_x.view_mut(),
            recv_scales: None,
            recv_topk_idx: Some(recv_idx.view_mut()),
            recv_topk_weights: Some(recv_w.view_mut()),
            rank_prefix_matrix: Some(rank_prefix.view_mut()),
            recv_src_idx: Some(src_idx.view_mut()),
            channels: None,
        };
        return buf.on_stream(stream, |s| {
            s.dispatch_into(plan, &args, out)?;
            die()
        });
    }
    let d = buf.dispatch(&args)?;
    let cargs = ht_combine_args(&d);
    let (mut cx, mut cw) = (buf.alloc(DType::BF16, &[t, h])?, buf.alloc(DType::F32, &[t, k])?);
    let out = CombineOutputs { combined_x: cx.view_mut(), combined_topk_weights: Some(cw.view_mut()) };
    buf.on_stream(stream, |s| {
        s.combine_into(&cargs, out)?;
        die()
    })
}

/// The host backend's outputs for rank `me`, both input sets, simulating every rank in threads of this
/// process (`masked`: that rank is masked on every rank, shrink semantics).
fn reference(sh: &Shape, ll: bool, seed: u64, me: usize, masked: Option<usize>) -> Result<[Out; 2]> {
    let groups = ThreadGroup::with_timeout(sh.ranks, Duration::from_secs(60));
    let results: Vec<Result<[Out; 2]>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<[Out; 2]> {
                    let r = g.rank();
                    let opts = BufferOptions {
                        backend: BackendKind::Host,
                        num_nvl_bytes: Buffer::ht_bytes_needed(sh.tokens, sh.hidden, sh.topk, sh.ranks, false),
                        num_rdma_bytes: Buffer::ll_bytes_needed(sh.tokens, sh.hidden, sh.ranks, sh.experts),
                        low_latency_mode: true,
                        enable_shrink: masked.is_some(),
                        ..Default::default()
                    };
                    let mut buf = Buffer::new(Arc::new(g), opts)?;
                    if let Some(m) = masked {
                        buf.low_latency_update_mask_buffer(m, true)?;
                    }
                    let mut outs = Vec::new();
                    for set in 0..2 {
                        let l = load(&buf, sh, &inputs(sh, seed, r, set))?;
                        outs.push(iteration(&mut buf, sh, ll, &l)?);
                    }
                    let b = outs.pop().expect("two");
                    let a = outs.pop().expect("two");
                    Ok([a, b])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::Unavailable("reference thread panicked".into())))).collect()
    });
    results.into_iter().nth(me).unwrap_or_else(|| Err(Error::Unavailable("no reference".into())))
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The kill iteration every rank agrees on.
fn kill_iteration(a: &ChaosArgs) -> usize {
    if let Some(k) = a.kill_at {
        return k;
    }
    let lo = (a.iterations / 5).max(2);
    let hi = (a.iterations / 2).max(lo + 1);
    lo + (Rng::new(a.seed ^ 0x4b11).next_u64() as usize) % (hi - lo)
}

/// The victim's end: a short spin so the kernel is in flight, a line saying when, then SIGKILL.
fn die(rank: usize, phase: ChaosPhase, iteration: usize, seed: u64) -> ! {
    let spin_us = (Rng::new(seed ^ std::process::id() as u64).next_u64() % 30) as u128;
    let t0 = Instant::now();
    while t0.elapsed().as_micros() < spin_us {
        std::hint::spin_loop();
    }
    let line = serde_json::json!({
        "rank": rank, "phase": phase.name(), "iteration": iteration, "spin_us": spin_us as u64,
        "kill_unix_ms": unix_ms(), "pid": std::process::id(),
    });
    println!("CHAOS_KILL {line}");
    let _ = std::io::stdout().flush();
    // SAFETY: kill(2) on our own pid with a valid signal number; it does not return for SIGKILL.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::thread::sleep(Duration::from_secs(2));
    eprintln!("rank {rank}: still alive after SIGKILL");
    std::process::exit(3)
}

/// What a survivor reports.
#[derive(Debug, Default, Serialize)]
struct Report {
    rank: usize,
    world: usize,
    /// Nodes of the buffer the victim dies in (virtual nodes with --topology), and their RDMA transport.
    nodes: usize,
    transport: Option<String>,
    victim: usize,
    phase: String,
    shrink: bool,
    backend: String,
    timeout_ms: u64,
    kill_at: usize,
    /// Iterations completed (and checked) before the failure, or in total (shrink).
    iterations_done: usize,
    /// Iterations whose outputs differed from the host backend's.
    mismatching_iterations: usize,
    mismatches: Vec<String>,
    /// The error that ended the loop.
    error: Option<String>,
    error_kind: Option<String>,
    /// The peer the timeout named (`None`: not a timeout, or no peer).
    peer_named: Option<usize>,
    names_victim: bool,
    /// The timeout's phase (across nodes it says the domain: RDMA or NVLink).
    timeout_phase: Option<String>,
    /// Root cause after following the survivors' "timed out waiting for" chain.
    root_cause: Option<usize>,
    /// Where that chain ends: "victim", "cycle" (back to a survivor) or "unnamed".
    chain: Option<String>,
    /// Survivors whose timeout names the victim directly.
    survivors_naming_victim: Option<usize>,
    error_unix_ms: Option<u64>,
    /// Wall time of the call that failed, from its start to its error.
    failing_call_ms: Option<f64>,
    within_deadline: bool,
    /// The next call's error (must be `Poisoned`).
    after_error: Option<String>,
    poisoned_afterwards: bool,
    drop_ms: Option<f64>,
    /// Rebuild over the survivors.
    new_rank: Option<usize>,
    new_world: Option<usize>,
    rebuild_ms: Option<f64>,
    recovered: bool,
    recovery_detail: Option<String>,
    /// Shrink mode.
    mask: Option<Vec<bool>>,
    mask_ok: bool,
    slowest_call_ms: f64,
    verdict: String,
    reasons: Vec<String>,
}

fn kind_of(e: &Error) -> &'static str {
    match e {
        Error::Timeout { .. } => "timeout",
        Error::Group { .. } => "group",
        Error::Poisoned { .. } => "poisoned",
        Error::Cuda(_) => "cuda",
        Error::InvalidArgument { .. } => "invalid-argument",
        Error::RankMismatch { .. } => "rank-mismatch",
        Error::BufferTooSmall { .. } => "buffer-too-small",
        Error::Unavailable(_) => "unavailable",
        Error::Io(_) => "io",
    }
}

/// Runs `moelink-stress chaos` on this rank.
pub fn run(a: &ChaosArgs) -> std::result::Result<(), CliError> {
    if a.shrink && !a.phase.is_ll() {
        return Err(CliError("--shrink applies to the low-latency phases (ll-dispatch, ll-combine)".into()));
    }
    if a.shrink && a.backend == ChaosBackend::Host {
        return Err(CliError("--shrink needs the CUDA backend (the host backend needs every rank in every exchange)".into()));
    }
    let cfg = moelink::group::TcpConfig::from_env().map_err(|e| CliError(format!("cannot read the launch environment: {e}")))?;
    let (me, world) = (cfg.rank, cfg.size);
    if world < 2 || a.victim >= world {
        return Err(CliError(format!("--victim {} needs a group of at least 2 ranks containing it (WORLD_SIZE {world})", a.victim)));
    }
    let internode = chaos_topology(a, world)?;
    let g = TcpGroup::connect(&cfg.addr, cfg.port, me, world, cfg.local_rank, cfg.timeout)
        .map_err(|e| CliError(format!("cannot join the process group: {e}")))?;
    let kill_at = kill_iteration(a);
    let mut rep = Report {
        rank: me,
        world,
        victim: a.victim,
        phase: a.phase.name().into(),
        shrink: a.shrink,
        backend: format!("{:?}", a.backend).to_lowercase(),
        timeout_ms: a.timeout_ms,
        kill_at,
        nodes: internode.as_ref().map_or(1, |(t, _)| t.num_nodes),
        transport: internode.as_ref().map(|(_, r)| r.transport.name().to_string()),
        ..Default::default()
    };
    let outcome = survive(a, g, &cfg, internode, kill_at, &mut rep);
    if let Err(e) = outcome {
        rep.reasons.push(format!("harness error: {e}"));
    }
    rep.verdict = if rep.reasons.is_empty() { "pass".into() } else { "fail".into() };
    println!("CHAOS_RESULT {}", serde_json::to_string(&rep).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")));
    let _ = std::io::stdout().flush();
    if rep.reasons.is_empty() {
        Ok(())
    } else {
        Err(CliError(format!("rank {me}: {}", rep.reasons.join("; "))))
    }
}

/// Everything after the rendezvous. Returns only on survivors (the victim dies inside).
fn survive(
    a: &ChaosArgs,
    g: TcpGroup,
    cfg: &moelink::group::TcpConfig,
    internode: Option<(moelink::Topology, moelink::RdmaOptions)>,
    kill_at: usize,
    rep: &mut Report,
) -> Result<()> {
    let (me, world, ll) = (g.rank(), g.size(), a.phase.is_ll());
    let sh = Shape::new(world, ll);
    let backend = match a.backend {
        ChaosBackend::Cuda => BackendKind::Cuda,
        ChaosBackend::Host => BackendKind::Host,
    };
    let ll_bytes = Buffer::ll_bytes_needed(sh.tokens, sh.hidden, world, sh.experts);
    let (num_nvl_bytes, num_rdma_bytes) = match &internode {
        // HT across nodes: rounds of a quarter of the call's tokens (the RDMA region, shared with the LL
        // calls, holds their needs too).
        Some((t, _)) if !ll => {
            let need = moelink::internode::ht_bytes_needed(*t, sh.ht_round_tokens(), sh.hidden, sh.topk, false);
            (need.num_nvl_bytes, need.num_rdma_bytes.max(ll_bytes))
        }
        _ => (Buffer::ht_bytes_needed(sh.tokens, sh.hidden, sh.topk, world, false), ll_bytes),
    };
    let topology = internode.as_ref().map(|(t, _)| *t);
    let opts = BufferOptions {
        backend,
        num_nvl_bytes,
        num_rdma_bytes,
        low_latency_mode: true,
        timeout_ms: a.timeout_ms,
        enable_shrink: a.shrink,
        topology: internode.as_ref().map(|(t, _)| *t),
        rdma: internode.map(|(_, r)| r).unwrap_or_default(),
        ..moelink_cli::env::buffer_options()
    };
    let group: Arc<dyn Group> = Arc::new(g);
    let mut buf = Buffer::new(group.clone(), opts)?;
    let sets = [load(&buf, &sh, &inputs(&sh, a.seed, me, 0))?, load(&buf, &sh, &inputs(&sh, a.seed, me, 1))?];
    let healthy = reference(&sh, ll, a.seed, me, None)?;
    let masked = if a.shrink { Some(reference(&sh, ll, a.seed, me, Some(a.victim))?) } else { None };
    // The victim's stream for its last, asynchronous call (a CUDA stream of its device; none on the host).
    let stream = match (backend, buf.location()) {
        (BackendKind::Cuda, moelink::Location::Cuda(ordinal)) => {
            let dev = moelink_cuda::Device::new(ordinal)?;
            Some(moelink_cuda::Stream::new(&dev)?)
        }
        _ => None,
    };
    // Warm-up (kernels compiled, handle pools filled) and a group barrier, so the loop starts together.
    for (i, set) in sets.iter().enumerate() {
        let out = iteration(&mut buf, &sh, ll, set)?;
        if out != healthy[i] {
            rep.mismatching_iterations += 1;
            rep.mismatches.push(format!("warm-up {i} differs from the host backend"));
        }
    }
    group.barrier()?;

    let start = Instant::now();
    let limit = Duration::from_secs_f64(a.limit_s);
    let stop_at =
        if a.phase == ChaosPhase::HtDispatch || a.phase == ChaosPhase::LlDispatch { Stop::BeforeDispatch } else { Stop::BeforeCombine };
    let mut failure: Option<(Error, f64)> = None;
    for it in 0..a.iterations {
        if !a.shrink && start.elapsed() > limit {
            break;
        }
        let set = &sets[it % 2];
        if me == a.victim && it == kill_at {
            let victim = Victim { rank: me, phase: a.phase, iteration: it, seed: a.seed };
            let _ = die_in(&mut buf, &sh, ll, set, stop_at, stream.as_ref(), victim);
            victim.die();
        }
        let t0 = Instant::now();
        let r = iteration(&mut buf, &sh, ll, set);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        rep.slowest_call_ms = rep.slowest_call_ms.max(ms);
        match r {
            Ok(out) => {
                rep.iterations_done = it + 1;
                // The kill iteration itself may or may not include the victim's rows: not checked.
                let want = match &masked {
                    Some(m) if it > kill_at => &m[it % 2],
                    _ => &healthy[it % 2],
                };
                if it != kill_at && out != *want {
                    rep.mismatching_iterations += 1;
                    if rep.mismatches.len() < 5 {
                        let part = if out.recv != want.recv { "received rows" } else { "combined rows" };
                        rep.mismatches.push(format!("iteration {it}: {part} differ from the host backend"));
                    }
                }
            }
            Err(e) => {
                failure = Some((e, ms));
                break;
            }
        }
    }
    if rep.mismatching_iterations > 0 {
        rep.reasons.push(format!("{} iterations differ from the host backend", rep.mismatching_iterations));
    }
    if a.shrink {
        return judge_shrink(&mut buf, a, failure, rep);
    }
    let Some((err, ms)) = failure else {
        rep.reasons.push(format!("no error within {} iterations / {:.0} s although rank {} died", a.iterations, a.limit_s, a.victim));
        return Ok(());
    };
    judge_error(&err, ms, a, topology, rep);
    // The buffer must refuse further work.
    let after = iteration(&mut buf, &sh, ll, &sets[0]);
    match after {
        Err(e @ Error::Poisoned { .. }) => {
            rep.poisoned_afterwards = buf.poisoned().is_some();
            rep.after_error = Some(e.to_string());
        }
        Err(e) => rep.after_error = Some(e.to_string()),
        Ok(_) => rep.after_error = Some("the next call succeeded".into()),
    }
    if !rep.poisoned_afterwards {
        rep.reasons.push(format!("the buffer did not refuse work after the error: {}", rep.after_error.clone().unwrap_or_default()));
    }
    let t0 = Instant::now();
    drop(sets);
    drop(buf);
    drop(group);
    let drop_ms = t0.elapsed().as_secs_f64() * 1e3;
    rep.drop_ms = Some(drop_ms);
    if drop_ms > (a.timeout_ms + 6000) as f64 {
        rep.reasons.push(format!("dropping the poisoned buffer took {drop_ms:.0} ms"));
    }
    rebuild(a, cfg, backend, rep)
}

fn judge_error(err: &Error, ms: f64, a: &ChaosArgs, topology: Option<moelink::Topology>, rep: &mut Report) {
    rep.error = Some(err.to_string());
    rep.error_kind = Some(kind_of(err).into());
    rep.error_unix_ms = Some(unix_ms());
    rep.failing_call_ms = Some(ms);
    let slack_ms = 2000.0;
    rep.within_deadline = ms <= a.timeout_ms as f64 + slack_ms;
    match err {
        Error::Timeout { peer, phase, .. } => {
            rep.peer_named = (*peer != usize::MAX).then_some(*peer);
            rep.names_victim = *peer == a.victim;
            rep.timeout_phase = Some(phase.to_string());
            if let Some(t) = topology.filter(|t| t.is_internode() && !a.phase.is_ll()) {
                if let Err(why) = check_internode_ht_timeout(a.phase, t, rep.rank, *peer, *phase) {
                    rep.reasons.push(why);
                }
            }
        }
        // The host backend: a dead peer closes its socket; the group error names it in words.
        Error::Group { reason, .. } if a.backend == ChaosBackend::Host => {
            rep.names_victim = reason.contains(&format!("rank {}", a.victim));
        }
        _ => {}
    }
    if a.backend == ChaosBackend::Cuda && !matches!(err, Error::Timeout { .. }) {
        rep.reasons.push(format!("expected a timeout, got: {err}"));
    }
    if !rep.within_deadline {
        rep.reasons.push(format!("the failing call took {ms:.0} ms for a {} ms deadline", a.timeout_ms));
    }
}

/// Shrink mode: no call may fail; the victim (and only it) ends up masked.
fn judge_shrink(buf: &mut Buffer, a: &ChaosArgs, failure: Option<(Error, f64)>, rep: &mut Report) -> Result<()> {
    if let Some((e, ms)) = failure {
        rep.error = Some(e.to_string());
        rep.error_kind = Some(kind_of(&e).into());
        rep.failing_call_ms = Some(ms);
        rep.reasons.push(format!("a call failed in shrink mode: {e}"));
        return Ok(());
    }
    let mask = buf.low_latency_query_mask_buffer()?;
    rep.mask_ok = mask.iter().enumerate().all(|(r, &m)| m == (r == a.victim));
    rep.mask = Some(mask);
    if !rep.mask_ok {
        rep.reasons.push(format!("mask {:?}: expected exactly rank {} masked", rep.mask, a.victim));
    }
    rep.within_deadline = rep.slowest_call_ms <= 2.0 * a.timeout_ms as f64 + 2000.0;
    if !rep.within_deadline {
        rep.reasons.push(format!("the slowest call took {:.0} ms for a {} ms deadline", rep.slowest_call_ms, a.timeout_ms));
    }
    Ok(())
}

/// The survivors' new group (ranks in order of their old ranks) and buffer, checked against a host twin.
fn rebuild(a: &ChaosArgs, cfg: &moelink::group::TcpConfig, backend: BackendKind, rep: &mut Report) -> Result<()> {
    let survivors: Vec<usize> = (0..rep.world).filter(|&r| r != a.victim).collect();
    let new_rank = survivors.iter().position(|&r| r == rep.rank).expect("a survivor");
    let new_world = survivors.len();
    rep.new_rank = Some(new_rank);
    rep.new_world = Some(new_world);
    let port = a.recover_port.unwrap_or_else(|| cfg.port.wrapping_add(1));
    let t0 = Instant::now();
    let g = TcpGroup::connect(&cfg.addr, port, new_rank, new_world, cfg.local_rank, Duration::from_secs(60))?;
    // Trace timeouts back to their root: each survivor tells which old rank its timeout named.
    let named = g.all_gather(&(rep.peer_named.map_or(u64::MAX, |p| p as u64)).to_le_bytes())?;
    let named: Vec<Option<usize>> = named
        .iter()
        .map(|b| b.get(..8).map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes"))).filter(|&v| v != u64::MAX).map(|v| v as usize))
        .collect();
    let chain = trace_chain(rep.peer_named, a.victim, &survivors, &named);
    rep.root_cause = (chain == "victim").then_some(a.victim);
    rep.chain = Some(chain.into());
    let naming_victim = named.iter().filter(|&&n| n == Some(a.victim)).count();
    rep.survivors_naming_victim = Some(naming_victim);
    if rep.error_kind.as_deref() == Some("timeout") {
        if rep.nodes > 1 && !a.phase.is_ll() {
            // Across nodes an HT timeout may name a survivor that named it back (module docs): the group
            // must still have seen the victim.
            if naming_victim == 0 {
                rep.reasons.push(format!("no survivor's timeout names rank {} (named: {named:?})", a.victim));
            }
        } else if chain != "victim" {
            rep.reasons.push(format!("the timeout chain does not lead to rank {} (named {:?}; {chain})", a.victim, rep.peer_named));
        }
    }
    let (nvl, rdma) = soak::verify_buffer_bytes(new_world);
    let opts = BufferOptions {
        backend,
        num_nvl_bytes: nvl,
        num_rdma_bytes: rdma,
        low_latency_mode: true,
        timeout_ms: a.timeout_ms,
        ..moelink_cli::env::buffer_options()
    };
    let group: Arc<dyn Group> = Arc::new(g);
    let mut prim = Buffer::new(group.clone(), opts.clone())?;
    let mut twin = Buffer::new(group, BufferOptions { backend: BackendKind::Host, ..opts })?;
    rep.rebuild_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
    let fam = if a.phase.is_ll() { Family::Ll } else { Family::Ht };
    match soak::verify_rounds(&mut prim, &mut twin, &[fam], a.verify_rounds, a.seed ^ 0x5eb0) {
        Ok(d) if d.is_empty() => {
            rep.recovered = true;
            rep.recovery_detail =
                Some(format!("{} {} rounds over {new_world} ranks matched the host backend", a.verify_rounds, fam.name()));
        }
        Ok(d) => {
            rep.recovery_detail = Some(d.join("; "));
            rep.reasons.push("the rebuilt buffer's results differ from the host backend".into());
        }
        Err(e) => {
            rep.recovery_detail = Some(e.to_string());
            rep.reasons.push(format!("the rebuilt buffer failed: {e}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The options of a 4-rank run that kills rank 3 in an LL dispatch on the host backend.
    fn args() -> ChaosArgs {
        ChaosArgs {
            phase: ChaosPhase::LlDispatch,
            victim: 3,
            shrink: false,
            timeout_ms: 3000,
            iterations: 120,
            kill_at: None,
            recover_port: None,
            verify_rounds: 3,
            limit_s: 60.0,
            seed: 7,
            backend: ChaosBackend::Host,
            topology: None,
            transport: "emu-nic".into(),
        }
    }

    #[test]
    fn the_kill_iteration_is_agreed_and_in_range() {
        let a = args();
        let k = kill_iteration(&a);
        assert_eq!(k, kill_iteration(&a));
        assert!((24..60).contains(&k), "{k}");
        assert_eq!(kill_iteration(&ChaosArgs { kill_at: Some(5), ..a }), 5);
    }

    #[test]
    fn virtual_nodes_take_every_phase_and_refuse_bad_topologies() {
        let a = ChaosArgs {
            phase: ChaosPhase::LlCombine,
            shrink: true,
            backend: ChaosBackend::Cuda,
            topology: Some("2x2".into()),
            transport: "ptr".into(),
            ..args()
        };
        let (t, rdma) = chaos_topology(&a, 4).unwrap().expect("2x2 spans nodes");
        assert_eq!((t.num_nodes, rdma.transport.name()), (2, "ptr"));
        assert!(chaos_topology(&ChaosArgs { topology: Some("1x4".into()), ..a.clone() }, 4).unwrap().is_none());
        for phase in [ChaosPhase::HtDispatch, ChaosPhase::HtCombine] {
            let b = ChaosArgs { phase, shrink: false, transport: "nvshmem".into(), ..a.clone() };
            assert_eq!(chaos_topology(&b, 4).unwrap().expect("HT across nodes").1.transport.name(), "nvshmem");
        }
        for (b, says) in [
            (ChaosArgs { topology: Some("3x2".into()), ..a.clone() }, "WORLD_SIZE"),
            (ChaosArgs { transport: "tcp".into(), ..a.clone() }, "--transport"),
        ] {
            let e = chaos_topology(&b, 4).expect_err("refused").0;
            assert!(e.contains(says), "{e}");
        }
        // Across nodes the HT buffers run several rounds per call.
        assert!(Shape::new(4, false).tokens >= 3 * Shape::new(4, false).ht_round_tokens());
    }

    #[test]
    fn internode_ht_timeouts_must_fit_the_domain_and_the_kill() {
        let t = moelink::Topology { num_nodes: 2, ranks_per_node: 2 };
        let ok = |kill, me, peer, phase| check_internode_ht_timeout(kill, t, me, peer, phase);
        // Rank 1 (node 0, local 1) is rank 3's rail peer: over RDMA it names 3, or itself (its own forwarder).
        assert!(ok(ChaosPhase::HtDispatch, 1, 3, Phase::DispatchRdma).is_ok());
        assert!(ok(ChaosPhase::HtDispatch, 1, 1, Phase::DispatchRdma).is_ok());
        assert!(ok(ChaosPhase::HtDispatch, 0, 2, Phase::CombineRdma).is_ok());
        assert!(ok(ChaosPhase::HtDispatch, 0, 3, Phase::DispatchRdma).unwrap_err().contains("rail"));
        // Over NVLink: a rank of the survivor's node (the forwarder waiting for the victim), or the victim
        // when they share the node.
        assert!(ok(ChaosPhase::HtDispatch, 0, 1, Phase::DispatchNvlink).is_ok());
        assert!(ok(ChaosPhase::HtCombine, 2, 3, Phase::CombineNvlink).is_ok());
        assert!(ok(ChaosPhase::HtCombine, 0, 3, Phase::CombineNvlink).unwrap_err().contains("node"));
        // Notify: any rank; only after a kill in combine (the next iteration's count exchange).
        assert!(ok(ChaosPhase::HtCombine, 0, 3, Phase::Notify).is_ok());
        assert!(ok(ChaosPhase::HtDispatch, 0, 3, Phase::Notify).unwrap_err().contains("timeout in"));
        assert!(ok(ChaosPhase::HtCombine, 0, 1, Phase::DispatchNvlink).unwrap_err().contains("timeout in"));
        assert!(ok(ChaosPhase::HtDispatch, 0, 3, Phase::Dispatch).is_err(), "the host-side wait is not a domain");
        // No peer: accepted; a rank outside the group: not.
        assert!(ok(ChaosPhase::HtCombine, 0, usize::MAX, Phase::CombineRdma).is_ok());
        assert!(ok(ChaosPhase::HtCombine, 0, 4, Phase::Notify).unwrap_err().contains("not a rank"));
    }

    #[test]
    fn chains_end_at_the_victim_in_a_cycle_or_unnamed() {
        let survivors = [0, 1, 2];
        // 0 -> 2 -> 3 (the victim); 1 names itself; 2 named the victim.
        let named = [Some(2), Some(1), Some(3)];
        assert_eq!(trace_chain(Some(2), 3, &survivors, &named), "victim");
        assert_eq!(trace_chain(Some(3), 3, &survivors, &named), "victim");
        assert_eq!(trace_chain(Some(1), 3, &survivors, &named), "cycle");
        assert_eq!(trace_chain(None, 3, &survivors, &named), "unnamed");
        // 0 <-> 2.
        assert_eq!(trace_chain(Some(2), 3, &survivors, &[Some(2), None, Some(0)]), "cycle");
        assert_eq!(trace_chain(Some(1), 3, &survivors, &[Some(2), None, Some(0)]), "unnamed");
    }

    #[test]
    fn references_differ_between_sets_and_with_a_mask() {
        for ll in [false, true] {
            let sh = Shape::new(4, ll);
            let h = reference(&sh, ll, 1, 2, None).unwrap();
            assert_ne!(h[0], h[1], "the two input sets must give different outputs");
            if ll {
                let m = reference(&sh, ll, 1, 2, Some(3)).unwrap();
                assert_ne!(h[0], m[0], "masking rank 3 must change rank 2's results");
            }
        }
    }
}
