//! High-throughput dispatch/combine when the ranks span nodes: the host side of
//! `moelink-kernels/cuda/hti_*.cu` (one kernel per file; `hti.cuh`'s header comment is the protocol). The calls and their modes
//! are the single-node ones (`super::ht`): CPU-synchronised or `num_worst_tokens`, cached dispatch from a
//! handle, combine with weights and biases; what differs is where the data lives — rounds of `M` tokens in
//! parts of the RDMA region (after the internode control words) and of the node's symmetric buffer — and the
//! launch, cooperative, with the emulated NIC's blocks when the transport is `emu-nic`.

use std::sync::Arc;
use std::time::Instant;

use moelink_cuda::{DevPtr, HostMapped, KernelParams, LaunchConfig};
use moelink_kernels::ht::{call_signature, CallSignature};
use moelink_kernels::ht_internode::{
    self as hti_kernels, host_notify, nvl_layout, rdma_layout, routing, HtiCombineArgs, HtiDispatchArgs, HtiLayoutArgs, HtiNotifyArgs,
    HtiVariant, NvlArgs, RdmaAt, RoutingLayout, RowSizes, HTI_MAX_LOCAL_EXPERTS, HTI_MAX_NODES, HTI_MAX_RANKS, HTI_MAX_TOPK, HTI_THREADS,
    HTI_WARPS,
};
use moelink_kernels::{kernel_name, KernelSpec};

use super::super::gpu::{ctrl, Gpu, HT_DATA};
use super::super::ht_shared::{
    check_aligned, check_dispatch_start, combine_addrs, dispatch_addrs, dispatch_plan, notify_status_error, to_u32, wait_notify_ready,
};
use super::super::pool::{pool_take, PooledBuffer};
use super::{Internode, HT_SIGNALS, INTERNODE, RDMA_CTRL_BYTES};
use crate::backend::{BackendData, HtDispatched, LayoutOutputs};
use crate::error::{Error, Phase, Result};
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec, Routing};
use crate::internode::Topology;
use crate::tensor::TensorRef;

/// Offset of the internode HT words in the HT control area of the node's symmetric buffer (after the
/// single-node HT words, which an internode buffer never uses).
const NVL_CTRL: usize = ctrl::HT + (1 << 20);
const _: () = assert!(moelink_kernels::ht::ctrl::BYTES <= 1 << 20, "the internode HT words overlap the single-node ones");

/// The internode high-throughput state of a buffer: its local state words and the host-mapped notify results.
pub(crate) struct HtiState {
    state: moelink_cuda::DeviceBuffer,
    /// The dispatch's per-expert tallies (`HtiDispatchArgs::expert_tokens`: the copy of notify's sums, the
    /// receivers' per local expert and the senders' per expert, the counts zero between calls).
    expert_tokens: moelink_cuda::DeviceBuffer,
    host_notify: Option<HostMapped<u32>>,
    notify_seq: u32,
    /// When the host saw the last CPU-synchronised notify's READY (the trace's host points).
    ready_seen: Option<Instant>,
}

impl HtiState {
    pub(crate) fn new(gpu: &Gpu) -> Result<HtiState> {
        Ok(HtiState {
            state: moelink_cuda::DeviceBuffer::zeroed(&gpu.device, hti_kernels::HTI_STATE_BYTES)?,
            expert_tokens: moelink_cuda::DeviceBuffer::zeroed(&gpu.device, hti_kernels::HTI_EXPERT_TOKENS_BYTES)?,
            host_notify: None,
            notify_seq: 0,
            ready_seen: None,
        })
    }
}

/// What the host knows about an internode dispatch (CPU-sync, or read back after a synchronous call).
#[derive(Clone, Debug)]
pub(crate) struct HostRouting {
    num_recv_tokens: usize,
    /// Received tokens per local expert, unaligned (CPU-sync mode only).
    per_expert_raw: Option<Vec<usize>>,
    /// The notify call whose host-mapped words these are (0: read back after a no-sync dispatch).
    notify_seq: u32,
}

/// Handle data of an internode dispatch: the routing buffer notify wrote, the forwarder's record of what it
/// forwarded (`fwd_entries`) and the receiver's (round, message) of every received row (`recv_route`), which
/// combine retraces; the round shape every rank agreed on.
pub(crate) struct HtiRouting {
    routing: PooledBuffer,
    fwd_entries: PooledBuffer,
    fwd_capacity: usize,
    recv_route: PooledBuffer,
    route_rows: usize,
    host: Option<HostRouting>,
    num_tokens: usize,
    round_tokens: usize,
    chunk_tokens: usize,
}

/// State between `prepare_dispatch` and `dispatch`.
pub(crate) enum HtiPlan {
    Fresh { routing: PooledBuffer, host: Option<HostRouting>, num_fwd: Option<usize>, round_tokens: usize, chunk_tokens: usize },
    Cached(Arc<BackendData>),
}

fn routing_of(data: &BackendData, rank: usize) -> Result<&HtiRouting> {
    data.get("handle", rank, INTERNODE)
}

fn topology(b: &Internode) -> Topology {
    b.topology
}

fn variant(b: &Internode, hidden: usize, fp8: bool, topk: usize, num_biases: usize) -> HtiVariant {
    let t = topology(b);
    let transport = b.rdma.transport().kernel_transport();
    HtiVariant { hidden, fp8, topk, num_biases, num_nodes: t.num_nodes, ranks_per_node: t.ranks_per_node, transport }
}

fn rdma_at(b: &Internode) -> Result<RdmaAt> {
    let t = topology(b);
    rdma_layout(HT_SIGNALS, RDMA_CTRL_BYTES, b.num_rdma_bytes, t.num_ranks(), t.num_nodes).ok_or_else(|| Error::BufferTooSmall {
        rank: b.rank,
        what: "internode high-throughput region (num_rdma_bytes)",
        needed: hti_kernels::rdma_bytes_needed(t.num_ranks(), t.num_nodes, 1, RowSizes::new(128, false, 0, 0)),
        available: b.num_rdma_bytes,
        hint: "create the Buffer with num_rdma_bytes >= moelink::internode::ht_bytes_needed(..).num_rdma_bytes".into(),
    })
}

fn nvl_args(b: &Internode) -> NvlArgs {
    let t = topology(b);
    let mut n = nvl_layout(NVL_CTRL, HT_DATA, b.num_nvl_bytes, t.num_ranks(), t.num_nodes);
    for (j, base) in n.base.iter_mut().enumerate().take(t.ranks_per_node) {
        *base = b.sym.peer_ptr(j);
    }
    n
}

/// The dispatch kernel of a call: its message and row layouts come from the call's signature (top-k ids
/// travel when the call has them), which notify made every rank agree on. Never from a tensor's address: a
/// rank without tokens has empty top-k tensors, and its kernel must still read its peers' messages.
fn dispatch_variant(b: &Internode, s: &HtSpec) -> HtiVariant {
    variant(b, s.hidden, s.fp8, if s.has_topk { s.topk } else { 0 }, 0)
}

/// The launch: `blocks` worker blocks plus the emulated NIC's, cooperative (every role of every block waits
/// for the others).
fn launch<A: KernelParams>(
    b: &mut Internode,
    v: HtiVariant,
    spec: fn(&HtiVariant) -> KernelSpec,
    name: &'static str,
    args: &A,
    blocks: u32,
) -> Result<()> {
    let k = b.kernel_of(v, name, spec)?;
    let nic = b.rdma.nic_blocks();
    b.launch(&k, &LaunchConfig::linear(blocks + nic, HTI_THREADS).with_cooperative(), args)
}

/// Blocks of each role of a dispatch (`dispatch`: true) or combine for `num_sms` worker blocks, and forwarder
/// warps per source node. A warp copies a few GB/s (its loads in flight over their latency), so every role
/// gets blocks in proportion to its work per byte: the senders read each row once and write it to every node
/// it reaches; the forwarders copy each arriving row again (dispatch) or sum a node's rows and write the
/// partial home (combine), which bounds both kernels. The forwarders are dealt evenly over the source nodes
/// (a node's chunks round-robin among its warps; at least one warp per node).
///   - Dispatch: three eighths of the blocks forward; of the rest, half (rounded down) receive and the others
///     send. The senders stage two tokens per fence, so fewer of them keep up.
///   - Combine: a third of the blocks forward; of the rest, one less than half reduce and the others send.
///
/// Measured as 2 nodes x 1 on 2xH200 over `ptr`, 24 SMs, fresh BF16 / FP8 dispatch and combine in µs:
///   - senders 7/8/9/10/11/13 with 8 forwarders: 657/646/654/678/762/1097, 436/429/431/438/477/679,
///     723/668/627/670/739/1050; 6 forwarders with 12 or 14 senders: 795/898, 522/551, 685/857
///     (bench/results/2026-11-28-2xnvidia-h200-ac9b45b-internode-roles);
///   - the dispatch of fa7e461, forwarders:senders 8:9 (then the default) / 8:8 / 9:8 / 9:7 / 10:7 / 10:6:
///     BF16 501-506 / 496 / 476 / 515 / 516 / 587, FP8 321-325 / 323 / 317 / 348 / 353 / 396
///     (bench/results/2026-11-30-2xnvidia-h200-fffbd96-internode-dispatch).
///
/// `fwd_blocks` / `send_blocks` (`Tuning::hti_fwd_blocks`, `ht_*_send_blocks`) override the split within what
/// the roles need; `config.num_sms` too small for that is refused.
fn roles(
    rank: usize,
    t: Topology,
    num_sms: usize,
    dispatch: bool,
    fwd_blocks: Option<usize>,
    send_blocks: Option<usize>,
) -> Result<(u32, u32, u32)> {
    let warps = HTI_WARPS as usize;
    let fwd_min = t.num_nodes.div_ceil(warps);
    let recv_min = t.num_ranks().div_ceil(32 * warps).max(1);
    if num_sms < fwd_min + recv_min + 1 {
        return Err(Error::invalid(
            "config.num_sms",
            rank,
            format!(
                "{num_sms}: the internode kernels need at least {} blocks for {t} (senders, forwarders, receivers)",
                fwd_min + recv_min + 1
            ),
        ));
    }
    let fwd_default = if dispatch { num_sms * 3 / 8 } else { num_sms / 3 };
    let fwd = fwd_blocks.unwrap_or(fwd_default).clamp(fwd_min, num_sms - recv_min - 1);
    let send = match send_blocks {
        Some(n) => n.clamp(1, num_sms - fwd - recv_min),
        None => {
            let rest = num_sms - fwd;
            let recv = if dispatch { rest / 2 } else { (rest / 2).saturating_sub(1) };
            rest - recv.clamp(recv_min, rest - 1)
        }
    };
    Ok((send as u32, fwd as u32, (fwd * warps / t.num_nodes) as u32))
}

/// The role split of a dispatch (`dispatch`: true) or combine on this buffer.
fn roles_of(b: &Internode, rank: usize, num_sms: usize, dispatch: bool) -> Result<(u32, u32, u32)> {
    let send = if dispatch { b.tuning.ht_dispatch_send_blocks } else { b.tuning.ht_combine_send_blocks };
    roles(rank, topology(b), num_sms, dispatch, b.tuning.hti_fwd_blocks, send)
}

/// The limits of the internode kernels, checked before anything runs (every rank refuses alike).
fn check_limits(b: &Internode, rank: usize, topk: usize, num_local_experts: usize) -> Result<()> {
    let t = topology(b);
    if t.num_ranks() > HTI_MAX_RANKS || t.num_nodes > HTI_MAX_NODES {
        return Err(Error::invalid(
            "topology",
            rank,
            format!("{t}: the internode high-throughput kernels support at most {HTI_MAX_RANKS} ranks on {HTI_MAX_NODES} nodes"),
        ));
    }
    if topk > HTI_MAX_TOPK {
        return Err(Error::invalid("topk_idx", rank, format!("top-{topk}: the internode kernels carry at most {HTI_MAX_TOPK} entries")));
    }
    if num_local_experts > HTI_MAX_LOCAL_EXPERTS {
        return Err(Error::invalid(
            "num_experts",
            rank,
            format!("{num_local_experts} experts per rank; the internode kernels support at most {HTI_MAX_LOCAL_EXPERTS}"),
        ));
    }
    Ok(())
}

/// Tokens per round and per chunk for a call of `hidden` / `fp8` / `topk` on this buffer: the core's rule
/// (`crate::internode::ht_round_shape`, which the host backend applies too), with the chunk from
/// `Tuning::ht_send_chunk`.
fn round_of(b: &Internode, hidden: usize, fp8: bool, topk: usize) -> Result<(usize, usize)> {
    let chunk = b.tuning.ht_send_chunk.filter(|&c| c > 0).map_or(hti_kernels::DEFAULT_CHUNK_TOKENS, |c| c as usize);
    crate::internode::ht_round_shape(b.rank, topology(b), b.num_nvl_bytes, b.num_rdma_bytes, hidden, fp8, topk, chunk)
}

// ------------------------------------------------------------------------------------------ layout

pub(crate) fn dispatch_layout(b: &mut Internode, topk_idx: &TensorRef<'_>, num_experts: usize, mut out: LayoutOutputs<'_>) -> Result<()> {
    let rank = b.rank;
    let t = topology(b);
    let (n, k) = (topk_idx.shape()[0], topk_idx.shape()[1]);
    check_limits(b, rank, k, num_experts / t.num_ranks())?;
    check_aligned(topk_idx.addr(), 8, "topk_idx", rank)?;
    let per_rank = out.num_tokens_per_rank.device_ptr();
    let per_expert = out.num_tokens_per_expert.device_ptr();
    let per_node = out.num_tokens_per_rdma_rank.as_ref().map_or(DevPtr::NULL, |v| v.device_ptr());
    let v = HtiVariant::control(t.num_nodes, t.ranks_per_node, variant(b, 128, false, 0, 0).transport);
    let kernel = b.kernel_of(v, kernel_name::HTI_LAYOUT, HtiVariant::layout_spec)?;
    // The outputs were validated as contiguous int32 tensors of this device with R, E and N elements.
    out.num_tokens_per_rank.device_span_mut()?.memset_u32_async(0, b.op_stream())?;
    out.num_tokens_per_expert.device_span_mut()?.memset_u32_async(0, b.op_stream())?;
    if let Some(per_node) = &mut out.num_tokens_per_rdma_rank {
        per_node.device_span_mut()?.memset_u32_async(0, b.op_stream())?;
    }
    let (error_claim, error_record) = b.error_sink();
    let strides = topk_idx.strides();
    let args = HtiLayoutArgs {
        topk_idx: b.addr_of(topk_idx),
        topk_stride_token: strides[0] as i64,
        topk_stride_k: strides[1] as i64,
        num_tokens_per_rank: per_rank,
        num_tokens_per_rdma_rank: per_node,
        num_tokens_per_expert: per_expert,
        is_token_in_rank: out.is_token_in_rank.device_ptr(),
        error_claim,
        error_record,
        num_tokens: to_u32(n, "topk_idx", rank)?,
        topk: to_u32(k, "topk_idx", rank)?,
        num_experts: to_u32(num_experts, "num_experts", rank)?,
        rank: rank as u32,
    };
    let grid = (n.div_ceil(HTI_THREADS as usize) as u32).clamp(1, 1024);
    b.launch(&kernel, &LaunchConfig::linear(grid, HTI_THREADS), &args)?;
    b.gpu.finish_settled(Phase::Layout)
}

// ------------------------------------------------------------------------------------------ dispatch

pub(crate) fn prepare_dispatch(b: &mut Internode, s: HtSpec, a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    let rank = s.rank;
    let t = topology(b);
    check_limits(b, rank, s.topk, s.num_local_experts())?;
    roles_of(b, rank, s.num_sms, true)?;
    check_dispatch_start(b, &s, a)?;
    let layout = match a.routing {
        Routing::Cached(h) => {
            let data = h.data.clone();
            let r = routing_of(&data, rank)?;
            let host = r.host.clone();
            return Ok(dispatch_plan(
                s,
                host.as_ref().map(|h| h.num_recv_tokens),
                host.as_ref().and_then(|h| h.per_expert_raw.as_deref()),
                BackendData::new(INTERNODE, HtiPlan::Cached(data)),
            ));
        }
        Routing::Fresh { layout, .. } => layout,
    };
    let (round_tokens, chunk_tokens) = round_of(b, s.hidden, s.fp8, s.topk)?;
    let el = s.num_local_experts();
    let routing_buf = pool_take(&b.gpu, 4 * RoutingLayout::new(t.num_ranks(), t.num_nodes, s.num_tokens).words)?;
    let sync = s.num_worst_tokens == 0;
    let hti = &mut b.hti;
    let (host_out, host_seq) = if sync {
        let words = host_notify::words(el);
        if hti.host_notify.as_ref().is_none_or(|m| m.len() < words) {
            hti.host_notify = Some(HostMapped::new(&b.gpu.device, words.max(host_notify::words(256)))?);
        }
        hti.notify_seq = hti.notify_seq.wrapping_add(1).max(1);
        (hti.host_notify.as_ref().map_or(DevPtr::NULL, |m| m.device_ptr()), hti.notify_seq)
    } else {
        (DevPtr::NULL, 0)
    };
    let state = hti.state.device_ptr();
    let signature = call_signature(CallSignature {
        hidden: s.hidden,
        num_experts: s.num_experts,
        topk: s.topk,
        fp8: s.fp8,
        has_topk: s.has_topk,
        no_sync: !sync,
    });
    let v = HtiVariant::control(t.num_nodes, t.ranks_per_node, variant(b, 128, false, 0, 0).transport);
    let (error_claim, error_record) = b.error_sink();
    let args = HtiNotifyArgs {
        rdma: b.rdma_args(),
        at: rdma_at(b)?,
        is_token_in_rank: layout.is_token_in_rank.device_ptr(),
        num_tokens_per_rank: layout.num_tokens_per_rank.device_ptr(),
        num_tokens_per_expert: layout.num_tokens_per_expert.device_ptr(),
        routing: routing_buf.ptr(),
        host_out,
        state,
        signature,
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        num_tokens: to_u32(s.num_tokens, "x", rank)?,
        num_local_experts: el as u32,
        round_tokens: round_tokens as u32,
        host_seq,
        // Only a CPU-synchronised notify: the host reads its stamps before the dispatch reuses the words.
        trace: if sync { b.gpu.ht_trace_begin(hti_kernels::NOTIFY_TRACE_WORDS)? } else { DevPtr::NULL },
    };
    launch(b, v, HtiVariant::notify_spec, kernel_name::HTI_NOTIFY, &args, 1)?;
    let (host, num_fwd) = if sync {
        let (h, f) = read_notify(b, host_seq, &s)?;
        b.hti.ready_seen = Some(Instant::now());
        if !args.trace.is_null() {
            let words = b.gpu.ht_trace_words(hti_kernels::NOTIFY_TRACE_WORDS);
            if let Some(trace) = crate::trace::notify_launch(&words, kernel_name::HTI_NOTIFY) {
                b.gpu.ht_trace_push(trace);
            }
        }
        (Some(h), Some(f))
    } else {
        (None, None)
    };
    let (num_recv, per_expert_raw) = (host.as_ref().map(|h| h.num_recv_tokens), host.as_ref().and_then(|h| h.per_expert_raw.clone()));
    Ok(dispatch_plan(
        s,
        num_recv,
        per_expert_raw.as_deref(),
        BackendData::new(INTERNODE, HtiPlan::Fresh { routing: routing_buf, host, num_fwd, round_tokens, chunk_tokens }),
    ))
}

/// CPU-sync mode: waits (deadline) for notify's host-mapped results of call `seq`; a non-zero status is the
/// error every rank sees alike.
/// This buffer's host-mapped notify words (allocated by `prepare_dispatch` before it launches notify).
fn read_notify(b: &mut Internode, seq: u32, s: &HtSpec) -> Result<(HostRouting, usize)> {
    let Some(m) = b.hti.host_notify.as_ref() else {
        return Err(Error::invalid("num_worst_tokens", s.rank, "internal: no host-mapped notify area"));
    };
    let start = wait_notify_ready(&b.gpu, s.rank, seq, m, host_notify::READY)?;
    let status = m.read(host_notify::STATUS);
    let host = HostRouting {
        num_recv_tokens: m.read(host_notify::NUM_RECV) as usize,
        per_expert_raw: Some((0..s.num_local_experts()).map(|e| m.read(host_notify::PER_EXPERT + e) as usize).collect()),
        notify_seq: seq,
    };
    let num_fwd = m.read(host_notify::NUM_FWD) as usize;
    let peer = m.read(host_notify::STATUS_PEER) as usize;
    if status == 0 {
        return Ok((host, num_fwd));
    }
    // The internode notify sets only the shared bits.
    let e = notify_status_error(&b.gpu, s, status, peer, start)
        .unwrap_or_else(|| Error::Group { rank: s.rank, reason: format!("notify reported unknown status bits {status:#x}") });
    Err(b.gpu.settle(e))
}

pub(crate) fn dispatch(b: &mut Internode, plan: DispatchPlan, a: &DispatchArgs<'_>, mut out: DispatchOutputs<'_>) -> Result<HtDispatched> {
    let s = plan.spec;
    let rank = s.rank;
    let t = topology(b);
    let num_out_rows = plan.num_recv_rows();
    let state = plan.state.take::<HtiPlan>("plan", rank, INTERNODE)?;
    let addrs = dispatch_addrs(b, &s, a, &out)?;
    let (send_blocks, fwd_blocks, fwd_per_node) = roles_of(b, rank, s.num_sms, true)?;

    // The handle: a fresh dispatch builds it; a cached one re-uses it (its routing, and the buffers the
    // kernel rewrites with the same values).
    let handle = match state {
        HtiPlan::Fresh { routing, host, num_fwd, round_tokens, chunk_tokens } => {
            let fwd_capacity = num_fwd.unwrap_or(s.num_worst_tokens).max(1);
            let route_rows = num_out_rows.max(1);
            let fwd_entries = pool_take(&b.gpu, 4 * fwd_capacity)?;
            let recv_route = pool_take(&b.gpu, 8 * route_rows)?;
            let r = HtiRouting {
                routing,
                fwd_entries,
                fwd_capacity,
                recv_route,
                route_rows,
                host,
                num_tokens: s.num_tokens,
                round_tokens,
                chunk_tokens,
            };
            Handle::New(Box::new(r))
        }
        HtiPlan::Cached(data) => Handle::Existing(data),
    };
    let r: &HtiRouting = match &handle {
        Handle::New(r) => r,
        Handle::Existing(d) => routing_of(d, rank)?,
    };
    if num_out_rows > r.route_rows {
        return Err(Error::invalid(
            "num_worst_tokens",
            rank,
            format!("{num_out_rows} output rows, more than the {} of the dispatch that made the handle", r.route_rows),
        ));
    }
    // The call's round shape is the handle's (a cached dispatch of other rows is refused when they do not fit).
    let (round_tokens, _) = round_of(b, s.hidden, s.fp8, s.topk)?;
    if round_tokens < r.round_tokens {
        return Err(Error::invalid(
            "x",
            rank,
            format!(
                "rows of this cached dispatch fit {round_tokens} tokens per round, the handle's dispatch ran rounds of {}",
                r.round_tokens
            ),
        ));
    }
    let v = dispatch_variant(b, &s);
    let (error_claim, error_record) = b.error_sink();
    // A fresh CPU-synchronised dispatch with top-k checks the rows that arrive against the per-expert counts
    // notify left in the host-mapped words (what the host returns as num_recv_tokens_per_expert).
    let (host_notify, host_seq) = match (&handle, &r.host, &b.hti.host_notify) {
        (Handle::New(_), Some(h), Some(m)) if s.has_topk && h.notify_seq != 0 => (m.device_ptr(), h.notify_seq),
        _ => (DevPtr::NULL, 0),
    };
    let args = HtiDispatchArgs {
        rdma: b.rdma_args(),
        at: rdma_at(b)?,
        nvl: nvl_args(b),
        x: addrs.x,
        x_scales: addrs.x_scales,
        scale_stride_token: addrs.scale_stride_token,
        scale_stride_group: addrs.scale_stride_group,
        topk_idx: addrs.topk_idx,
        topk_weights: addrs.topk_weights,
        num_tokens_per_expert: addrs.num_tokens_per_expert,
        expert_tokens: b.hti.expert_tokens.device_ptr(),
        host_notify,
        recv_x: addrs.recv_x,
        recv_scales: addrs.recv_scales,
        recv_topk_idx: addrs.recv_topk_idx,
        recv_topk_weights: addrs.recv_topk_weights,
        recv_src_idx: addrs.recv_src_idx,
        routing: r.routing.ptr(),
        fwd_entries: r.fwd_entries.ptr(),
        recv_route: r.recv_route.ptr(),
        state: b.hti.state.device_ptr(),
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        num_tokens: to_u32(s.num_tokens, "x", rank)?,
        num_out_rows: to_u32(num_out_rows, "num_worst_tokens", rank)?,
        fwd_capacity: to_u32(r.fwd_capacity, "num_worst_tokens", rank)?,
        num_local_experts: s.num_local_experts() as u32,
        chunk_tokens: r.chunk_tokens as u32,
        num_send_blocks: send_blocks,
        num_fwd_blocks: fwd_blocks,
        fwd_per_node,
        host_seq,
        pad: 0,
        trace: trace_begin(b, s.num_sms)?,
    };
    let launch_at = Instant::now();
    launch(b, v, HtiVariant::dispatch_spec, kernel_name::HTI_DISPATCH, &args, s.num_sms as u32)?;
    let launched = Instant::now();
    if let Some(m) = &mut out.rank_prefix_matrix {
        // The output was validated as a contiguous int32 [R, R] tensor of this device; the routing buffer holds
        // R * R words at rank_prefix, written by notify earlier on this stream.
        let at = RoutingLayout::new(t.num_ranks(), t.num_nodes, s.num_tokens).rank_prefix;
        m.device_span_mut()?.copy_from_device_async(r.routing.buffer(), 4 * at, b.op_stream())?;
    }
    finish_or_dump(b, Phase::Dispatch, "dispatch", &r.routing, r.round_tokens)?;
    if !args.trace.is_null() {
        let fresh = matches!(handle, Handle::New(_));
        let op = if fresh { "dispatch" } else { "cached dispatch" };
        // A fresh CPU-synchronised dispatch: the host's part of the gap after notify.
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        let host: Vec<(&'static str, f64)> = match b.hti.ready_seen.take() {
            Some(ready) if fresh => vec![("host_ready_us", us(launch_at - ready)), ("host_launch_us", us(launched - launch_at))],
            _ => Vec::new(),
        };
        trace_keep(b, kernel_name::HTI_DISPATCH, op, s.num_sms, (send_blocks, fwd_blocks), &host);
    }
    // No-sync mode, but this call waited for the kernels: the received count is on the device.
    let data = match handle {
        Handle::New(mut r) => {
            if r.host.is_none() && !b.is_async() {
                r.host = Some(read_back(&r)?);
            }
            Arc::new(BackendData::new(INTERNODE, *r))
        }
        Handle::Existing(d) => d,
    };
    let n = routing_of(&data, rank)?.host.as_ref().map(|h| h.num_recv_tokens);
    Ok(HtDispatched { data, num_recv_tokens: n })
}

/// The handle data a dispatch returns: built by a fresh dispatch, shared by a cached one.
enum Handle {
    New(Box<HtiRouting>),
    Existing(Arc<BackendData>),
}

fn read_back(r: &HtiRouting) -> Result<HostRouting> {
    let mut word = [0u8; 4];
    r.routing.buffer().copy_to_host_at(4 * routing::NUM_RECV, &mut word)?;
    Ok(HostRouting { num_recv_tokens: u32::from_le_bytes(word) as usize, per_expert_raw: None, notify_seq: 0 })
}

// ------------------------------------------------------------------------------------------ diagnostics

/// The protocol's words as this rank sees them once a call failed (HT tracing only): the local state
/// (`HtiState`, the forwarders' shared counts), the RDMA signals (chunk words, hand-backs), the node's
/// hand-back and done words and the first flags of every part, and the routing header of the call. Read
/// after the kernel gave up; peers may still be writing, so it is a snapshot, not a proof.
fn protocol_dump(b: &Internode, op: &str, routing_buf: &PooledBuffer, round_tokens: usize) -> String {
    use std::fmt::Write;
    let t = topology(b);
    let (r, n, l) = (t.num_ranks(), t.num_nodes, t.ranks_per_node);
    let mut out = String::new();
    let _ = write!(out, "rank {} {op} protocol state ({t}, M {round_tokens}):", b.rank);
    let u32s = |bytes: &[u8]| -> Vec<u32> { bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
    let u64s = |bytes: &[u8]| -> Vec<u64> { bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect() };
    let word = |v: u64| format!("{}:{}", v >> 32, v & 0xffff_ffff);
    // Local state.
    let mut st = vec![0u8; hti_kernels::HTI_STATE_BYTES];
    if b.hti.state.copy_to_host(&mut st).is_ok() {
        let w = u32s(&st);
        let _ = write!(
            out,
            "\n  state: notify_epoch {} dispatch_base {} combine_base {} dispatch_done {} combine_done {} dispatch_token {} combine_token {} combine_round_tokens {} combine_rounds_done {}",
            w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8]
        );
        let f = &w[16..];
        let mx = HTI_MAX_NODES;
        let _ = write!(
            out,
            "\n  forward: units_done {:?} messages_before {:?} round_rows {:?} combine_chunks_done {:?} combine_rounds_back {:?}",
            &f[..n],
            &f[mx..mx + n],
            (0..n).map(|a| f[2 * mx + 8 * a..2 * mx + 8 * a + l].to_vec()).collect::<Vec<_>>(),
            &f[10 * mx..10 * mx + n],
            &f[11 * mx..11 * mx + n]
        );
        // The senders' staged-token counts of the first chunks (zero between calls).
        let staged = 12 * mx + HTI_MAX_RANKS;
        let _ = write!(out, "\n  send: chunk_staged[..4] {:?}", &f[staged..staged + 4]);
    }
    // RDMA signals.
    if let Ok(at) = rdma_at(b) {
        let read = |off: u64, words: usize| -> Vec<u64> {
            let mut v = vec![0u8; 8 * words];
            match b.rdma.read_local(&b.device, off as usize, &mut v) {
                Ok(()) => u64s(&v),
                Err(_) => Vec::new(),
            }
        };
        let chunks = 4.min(hti_kernels::HTI_MAX_CHUNKS);
        for node in 0..n {
            let d: Vec<String> =
                read(at.off_dchunk + (node * hti_kernels::HTI_MAX_CHUNKS * 8) as u64, chunks).into_iter().map(word).collect();
            let c: Vec<String> =
                read(at.off_cchunk + (node * hti_kernels::HTI_MAX_CHUNKS * 8) as u64, chunks).into_iter().map(word).collect();
            let _ = write!(out, "\n  from node {node}: dchunk[..{chunks}] {d:?} cchunk {c:?}");
        }
        let _ = write!(out, "\n  rdma hand-backs: dconsumed {:?} cconsumed {:?}", read(at.off_dconsumed, n), read(at.off_cconsumed, n));
    }
    // The node's words.
    let nvl = nvl_args(b);
    let sym = b.sym.local();
    let read_nvl = |off: u64, bytes: usize| -> Vec<u8> {
        let mut v = vec![0u8; bytes];
        if sym.copy_to_host_at(off as usize, &mut v).is_err() {
            v.clear();
        }
        v
    };
    let done: Vec<String> = u64s(&read_nvl(nvl.off_done, 8 * r)).into_iter().map(word).collect();
    let _ = write!(out, "\n  done (per source) {done:?}");
    let _ = write!(
        out,
        "\n  nvl hand-backs [local rank][node]: consumed {:?} cconsumed {:?}",
        u64s(&read_nvl(nvl.off_consumed, 8 * l * n)),
        u64s(&read_nvl(nvl.off_cconsumed, 8 * l * n))
    );
    let slots = round_tokens.min(nvl.flag_slots as usize).min(64);
    for s in 0..r {
        let f = u32s(&read_nvl(nvl.off_dflags + (s * nvl.flag_slots as usize * 4) as u64, 4 * slots));
        let _ = write!(out, "\n  dflags from {s}[..{slots}]: {}", runs(&f));
    }
    for j in 0..l {
        for a in 0..n {
            let f = u32s(&read_nvl(nvl.off_cflags + (((j * n + a) * nvl.flag_slots as usize) * 4) as u64, 4 * slots));
            let _ = write!(out, "\n  cflags from local {j} node {a}[..{slots}]: {}", runs(&f));
        }
    }
    let mut head = vec![0u8; 4 * routing::HEADER];
    if routing_buf.buffer().copy_to_host_at(0, &mut head).is_ok() {
        let _ = write!(out, "\n  routing header {:?}", u32s(&head));
    }
    out
}

/// `v` as runs of equal values: `7x3 8x61` (value x count).
fn runs(v: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let j = v[i..].iter().position(|&x| x != v[i]).map_or(v.len(), |p| i + p);
        parts.push(format!("{}x{}", v[i], j - i));
        i = j;
    }
    parts.join(" ")
}

/// `finish`, printing the protocol's state on stderr when the call failed with HT tracing on.
fn finish_or_dump(b: &mut Internode, phase: Phase, op: &str, routing_buf: &PooledBuffer, round_tokens: usize) -> Result<()> {
    let r = b.gpu.finish_settled(phase);
    if r.is_err() && b.tracing.high_throughput {
        eprintln!("{}", protocol_dump(b, op, routing_buf, round_tokens));
    }
    r
}

// ------------------------------------------------------------------------------------------ combine

pub(crate) fn combine(b: &mut Internode, s: CombineSpec, a: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
    let rank = s.rank;
    let r = routing_of(&a.handle.data, rank)?;
    if s.topk > HTI_MAX_TOPK {
        return Err(Error::invalid(
            "topk_weights",
            rank,
            format!("{} weights per row; the internode kernels carry at most {HTI_MAX_TOPK}", s.topk),
        ));
    }
    let (send_blocks, fwd_blocks, fwd_per_node) = roles_of(b, rank, s.num_sms, false)?;
    let c = combine_addrs(b, rank, a, &out)?;
    if s.num_recv_rows > r.route_rows {
        return Err(Error::invalid(
            "x",
            rank,
            format!("{} rows, more than the {} the handle's dispatch received into", s.num_recv_rows, r.route_rows),
        ));
    }
    let v = variant(b, s.hidden, false, s.topk, c.num_biases);
    let (error_claim, error_record) = b.error_sink();
    let args = HtiCombineArgs {
        rdma: b.rdma_args(),
        at: rdma_at(b)?,
        nvl: nvl_args(b),
        x: c.x,
        topk_weights: c.topk_weights,
        bias0: c.bias0,
        bias1: c.bias1,
        combined_x: c.combined_x,
        combined_topk_weights: c.combined_topk_weights,
        routing: r.routing.ptr(),
        fwd_entries: r.fwd_entries.ptr(),
        recv_route: r.recv_route.ptr(),
        state: b.hti.state.device_ptr(),
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        num_tokens: to_u32(r.num_tokens, "x", rank)?,
        num_x_rows: to_u32(s.num_recv_rows, "x", rank)?,
        chunk_tokens: r.chunk_tokens as u32,
        num_send_blocks: send_blocks,
        num_fwd_blocks: fwd_blocks,
        fwd_per_node,
        trace: trace_begin(b, s.num_sms)?,
    };
    launch(b, v, HtiVariant::combine_spec, kernel_name::HTI_COMBINE, &args, s.num_sms as u32)?;
    finish_or_dump(b, Phase::Combine, "combine", &r.routing, r.round_tokens)?;
    if !args.trace.is_null() {
        trace_keep(b, kernel_name::HTI_COMBINE, "combine", s.num_sms, (send_blocks, fwd_blocks), &[]);
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------ trace

/// With `KernelTracing::high_throughput`, a synchronous internode dispatch or combine stamps its roles and
/// chunks (`HTI_TRACE_*` in hti.cuh); the words for a launch of `workers` worker blocks (plus the
/// emulated NIC's), zeroed, or 0 when not tracing.
fn trace_begin(b: &mut Internode, workers: usize) -> Result<DevPtr> {
    let nic = b.rdma.nic_blocks() as usize;
    let words = hti_kernels::trace_words(workers + nic, topology(b).num_nodes);
    b.gpu.ht_trace_begin(words)
}

/// Decodes the trace of the launch that just finished (`roles`: sender and forwarder blocks) and keeps it,
/// with `host`'s durations (µs) as points of their own.
fn trace_keep(b: &mut Internode, kernel: &'static str, op: &'static str, workers: usize, roles: (u32, u32), host: &[(&'static str, f64)]) {
    let nic = b.rdma.nic_blocks() as usize;
    let nodes = topology(b).num_nodes;
    let words = b.gpu.ht_trace_words(hti_kernels::trace_words(workers + nic, nodes));
    let shape =
        crate::trace::HtiTraceShape { blocks: workers + nic, workers, send_blocks: roles.0 as usize, fwd_blocks: roles.1 as usize, nodes };
    if let Some(mut trace) = crate::trace::hti_launch(&words, shape, kernel, op) {
        trace.points.extend(host.iter().filter_map(|&(name, us)| crate::trace::summary(name, vec![us])));
        b.gpu.ht_trace_push(trace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_cover_every_source_and_node() {
        let t = Topology { num_nodes: 2, ranks_per_node: 2 };
        // Dispatch: three eighths forward; of the rest, half receive and the others send.
        assert_eq!(roles(0, t, 24, true, None, None).unwrap(), (8, 9, 72));
        assert_eq!(roles(0, t, 48, true, None, None).unwrap(), (15, 18, 144));
        // Combine: a third forwards; of the rest, one less than half reduces and the others send.
        assert_eq!(roles(0, t, 24, false, None, None).unwrap(), (9, 8, 64));
        assert_eq!(roles(0, t, 48, false, None, None).unwrap(), (17, 16, 128));
        // The fewest blocks: a sender, a forwarder, a receiver.
        assert_eq!(roles(0, t, 3, true, None, None).unwrap(), (1, 1, 8));
        assert_eq!(roles(0, t, 3, false, None, None).unwrap(), (1, 1, 8));
        // Overrides, within what the other roles need.
        assert_eq!(roles(0, t, 24, true, Some(2), Some(15)).unwrap(), (15, 2, 16));
        assert_eq!(roles(0, t, 24, false, Some(30), Some(30)).unwrap(), (1, 22, 176));
        let t = Topology { num_nodes: 32, ranks_per_node: 8 };
        for dispatch in [true, false] {
            let (send, fwd, per_node) = roles(0, t, 24, dispatch, None, None).unwrap();
            assert_eq!((fwd, per_node), if dispatch { (9, 4) } else { (8, 4) });
            assert!(send >= 1 && (24 - send - fwd) as usize * 16 >= 256 / 32);
        }
        assert!(matches!(roles(3, t, 3, true, None, None), Err(Error::InvalidArgument { arg: "config.num_sms", rank: 3, .. })));
    }
}
