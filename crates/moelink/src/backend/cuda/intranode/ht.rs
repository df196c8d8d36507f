//! High-throughput dispatch/combine on one node: what to launch, with which arguments, after which checks. The
//! protocol (direct writes into per-source receive slabs, per-row flags, slab hand-back) is described in
//! `docs/protocols.md` ("HT") and at the top of each kernel in `moelink-kernels/cuda/ht_*.cu`.
//!
//! Kernels per call:
//! - `get_dispatch_layout`: `ht_layout` (local).
//! - fresh dispatch: `ht_notify` (count exchange; in CPU-sync mode the host waits for its host-mapped
//!   results), then `ht_dispatch`. Cached dispatch: `ht_dispatch` only, on the handle's routing.
//! - combine: `ht_combine`.
//!
//! Capacity: every condition that makes a call not fit the buffer is evaluated by the kernels on values all
//! ranks share (T_max from the notify exchange, the call's row size, `num_nvl_bytes`), so every rank skips the
//! same call and the epochs stay in step; where the host already knows those values (CPU-sync handles) it
//! returns [`Error::BufferTooSmall`] before launching, which is the same decision taken earlier.

use std::sync::Arc;

use moelink_cuda::{DevPtr, DevPtrs, HostMapped, KernelParams, LaunchConfig, MemRef};
use moelink_kernels::abi;
use moelink_kernels::ht::{
    self as kht, host_notify, routing, CallSignature, HtCombineArgs, HtCombineVariant, HtDispatchArgs, HtDispatchVariant, HtLayoutArgs,
    HtLayoutVariant, HtNotifyArgs, HtNotifyVariant, HtRegion,
};
use moelink_kernels::kernel_name;

use super::super::errors;
use super::super::gpu::{ctrl, HT_DATA};
use super::super::ht_shared::{
    check_aligned, check_dispatch_start, combine_addrs, dispatch_addrs, dispatch_plan, link_sms, notify_status_error, to_u32,
    wait_notify_ready,
};
use super::super::pool::{pool_take, PooledBuffer};
use super::{Intranode, INTRANODE};
use crate::backend::{BackendData, HtDispatched, LayoutOutputs};
use crate::config::Tuning;
use crate::error::{Error, Phase, Result};
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec, Payload, Routing};
use crate::tensor::TensorRef;

const _: () = assert!(kht::ctrl::BYTES <= ctrl::LL - ctrl::HT, "the HT control region overflows its slot");

// ------------------------------------------------------------------------------------------ SM split

/// Combine sender blocks: a third of the blocks, but at least the link SMs as long as that leaves half for
/// the reducers. Measured on 4xH200 (EP4, 4096 tokens, H 7168, interleaved chunks): 24 SMs 6/8/10/12
/// senders 690/566/568/578 µs; 48 SMs 8/16: 561/554; 64 SMs 8/16/21: 561/543/539 (bench/results/
/// 2026-11-21-4xnvidia-h200-52de077-sweeps, -run23); a plain third starved the senders below 24 SMs.
fn default_send_blocks(num_sms: usize) -> usize {
    (num_sms / 3).max(link_sms().min(num_sms / 2)).clamp(1, num_sms - 1)
}

/// Sender blocks of both kernels with one peer (EP2): two fifths of the blocks, at most 12. Every remote row
/// crosses to the one peer while the receivers copy as many rows again (the rank's own), and more senders
/// than with several peers pay off until the receivers run short. Measured on 2xH200 (EP2, 4096 tokens,
/// H 7168, both kernels at the same count; cached BF16 dispatch / FP8 dispatch / combine, µs): 16 SMs
/// 6/8/10: 284/321/425, 162/186/241, 279/290/369; 24 SMs 8/9/10/11/12: 223/205/202/209/225, 129/125/123/122/131,
/// 221/212/206/209/220; 32 SMs 8/10/12/14: 225/202/207/220, 130/123/118/119, 204/203/195/206; 48 SMs
/// 8/10/12/16: 230/204/204/207, 133/124/119/114, 197/201/192/196
/// (bench/results/2026-11-28-2xnvidia-h200-3e2331c-ep2-senders).
fn one_peer_send_blocks(num_sms: usize) -> usize {
    ((2 * num_sms + 2) / 5).min(12).clamp(1, num_sms - 1)
}

/// Sender blocks: `over` (a `Tuning` override) clamped to `[1, num_sms - 1]`, else `one_peer_send_blocks` with
/// one peer, else `several_peers`.
fn send_blocks(over: Option<usize>, num_sms: usize, num_ranks: usize, several_peers: impl FnOnce() -> usize) -> usize {
    match over {
        Some(n) => n.clamp(1, num_sms - 1),
        None if num_ranks == 2 => one_peer_send_blocks(num_sms),
        None => several_peers(),
    }
}

/// Dispatch senders (`Tuning::ht_dispatch_send_blocks` overrides): with one peer `one_peer_send_blocks`; else
/// the link SMs (at most half), at every SM count. The dispatch is bound by its senders' NVLink stores, and
/// more sender SMs land in the all-to-all dip between 10 and 28 SMs (`SM_HEADROOM`): measured on 4xH200 (EP4,
/// 4096 tokens, H 7168, BF16 dispatch, µs) 24 SMs 6/8/10/12 senders 711/588/646/635; 32 SMs 8/10: 592/643;
/// 48 SMs 8/16: 585/597; 64 SMs 8/16/21: 585/590/638 (bench/results/2026-11-21-4xnvidia-h200-52de077-sweeps,
/// -run23). The receivers copy this rank's own rows and the arriving rows out.
fn dispatch_send_blocks(t: &Tuning, num_sms: usize, num_ranks: usize) -> usize {
    send_blocks(t.ht_dispatch_send_blocks, num_sms, num_ranks, || link_sms().min(num_sms / 2).clamp(1, num_sms - 1))
}

/// Combine senders (`Tuning::ht_combine_send_blocks` overrides): with one peer `one_peer_send_blocks`, else
/// `default_send_blocks`.
fn combine_send_blocks(t: &Tuning, num_sms: usize, num_ranks: usize) -> usize {
    send_blocks(t.ht_combine_send_blocks, num_sms, num_ranks, || default_send_blocks(num_sms))
}

/// How the senders release their rows: the kernel's default (`moelink_kernels::ht::default_dispatch_release`,
/// `DEFAULT_COMBINE_RELEASE`), or `ONE_GPU_RELEASE` where every rank of the node runs on one GPU
/// (`node_on_one_gpu`), with `Tuning::ht_release_batch` (clamped to 1..=64) and `Tuning::ht_releaser`
/// overriding.
fn release(t: &Tuning, node_on_one_gpu: bool, kernel_default: kht::HtRelease) -> kht::HtRelease {
    let default = if node_on_one_gpu { kht::ONE_GPU_RELEASE } else { kernel_default };
    kht::HtRelease {
        releaser: t.ht_releaser.unwrap_or(default.releaser),
        batch: t.ht_release_batch.map_or(default.batch, |n| n.clamp(1, 64)),
    }
}

/// Sender work chunk of both HT kernels (`moelink_kernels::ht::HtDispatchArgs::send_chunk`): one release
/// batch. `Tuning::ht_send_chunk` overrides (0: one contiguous part per warp, the assignment before
/// interleaving; else rounded up to whole release batches).
fn send_chunk(t: &Tuning, release_batch: u32) -> u32 {
    match t.ht_send_chunk.map(|n| n.min(1 << 20)) {
        Some(0) => 0,
        Some(n) => n.div_ceil(release_batch) * release_batch,
        None => release_batch,
    }
}

/// Whether sender warps take their chunks of `send_chunk` items from the call's counter (1) or a fixed
/// interleaved share (0): dynamic unless `Tuning::ht_dynamic_send` is false or the chunks are contiguous
/// parts (0).
fn dynamic_send(t: &Tuning, send_chunk: u32) -> u32 {
    (send_chunk > 0 && t.ht_dynamic_send.unwrap_or(true)) as u32
}

/// Receiver work chunk (dispatch: slab rows per source; combine: tokens;
/// `moelink_kernels::ht::DEFAULT_RECV_CHUNK`). `Tuning::ht_recv_chunk` overrides (0: one contiguous part
/// per warp).
fn recv_chunk(t: &Tuning) -> u32 {
    t.ht_recv_chunk.map_or(kht::DEFAULT_RECV_CHUNK, |n| n.min(1 << 20))
}

/// The combine reducers' loads in flight (`HtCombineVariant::REDUCE_LOAD_VECS`; `Tuning::ht_reduce_load_vecs`
/// overrides, clamped to 1..=64).
fn reduce_load_vecs(t: &Tuning) -> u32 {
    t.ht_reduce_load_vecs.map_or(HtCombineVariant::REDUCE_LOAD_VECS, |n| n.clamp(1, 64))
}

/// `Tuning::ht_timing_experiment` (ht.cuh's `HT_EXP_*`, a JIT constant): bits 1 and 2 remove one role's
/// data movement so that the other role can be timed alone, and bit 8 the own rows' payload; the results are
/// then wrong (the caller says so: `moelink bench` warns and marks its records); bit 4 drops the dispatch's
/// per-expert layout checks.
fn timing_experiment(t: &Tuning) -> u32 {
    t.ht_timing_experiment & 15
}

// ------------------------------------------------------------------------------------------ state

/// Per-buffer high-throughput state (kept across calls).
#[derive(Default)]
pub(crate) struct HtState {
    /// Host-mapped notify results (CPU-sync mode), grown to the largest expert count seen.
    host_notify: Option<HostMapped<u32>>,
    notify_seq: u32,
    region_agreed: bool,
}

/// What the host knows about a dispatch's routing (CPU-sync mode, or read back after a synchronous call).
#[derive(Clone, Debug)]
pub(crate) struct HostRouting {
    num_recv_tokens: usize,
    t_max: usize,
    /// Received tokens per local expert, unaligned (CPU-sync mode only).
    per_expert_raw: Option<Vec<usize>>,
    /// Rows received from each source rank (CPU-sync mode only).
    recv_counts: Option<Vec<usize>>,
    /// The notify call whose host-mapped words these are (0: read back after a no-sync dispatch).
    notify_seq: u32,
}

/// Handle data of a CUDA dispatch: the routing buffer ht_notify wrote (status, counts, offsets, T_max,
/// DeepEP's rank_prefix_matrix and the token prefix per destination). The source index of each received row
/// goes to the caller's `recv_src_idx` output, when given: combine finds rows by send slot.
pub(crate) struct CudaHtRouting {
    routing: PooledBuffer,
    host: Option<HostRouting>,
    /// `i32 [N]`: the source token of each received row, kept for the copy-engine dispatch
    /// (`Tuning::ht_ce_pieces`, two ranks, CPU-sync handles).
    src_idx: Option<PooledBuffer>,
}

/// The handle data a dispatch returns: built by a fresh dispatch, shared by a cached one.
enum HandleData {
    New(CudaHtRouting),
    Existing(Arc<BackendData>),
}

/// State between `prepare_dispatch` and `dispatch`.
pub(crate) enum CudaPlan {
    Fresh { routing: PooledBuffer, host: Option<HostRouting> },
    Cached(Arc<BackendData>),
}

fn routing_of(data: &BackendData, rank: usize) -> Result<&CudaHtRouting> {
    data.get("handle", rank, INTRANODE)
}

/// The `BufferTooSmall` error for `t_max` tokens per rank in rows of `row_bytes`.
fn too_small(b: &Intranode, what: &'static str, t_max: usize, row_bytes: usize) -> Error {
    errors::too_small(b.gpu.buffer_shape(), what, t_max, row_bytes)
}

/// The trace words for a launch of `blocks` blocks of `warps` warps, zeroed; 0 when not tracing
/// ([`super::super::gpu::Gpu::ht_trace_begin`]).
fn trace_begin(b: &mut Intranode, blocks: usize, warps: u32) -> Result<DevPtr> {
    b.gpu.ht_trace_begin(blocks * kht::trace_words_per_block(warps))
}

/// Keeps the trace of the call that just finished (its kernel completed: synchronous mode) for
/// `Buffer::kernel_traces`.
fn trace_keep(b: &mut Intranode, kernel: &'static str, op: &'static str, blocks: usize, warps: u32, send_blocks: usize) {
    let words = b.gpu.ht_trace_words(blocks * kht::trace_words_per_block(warps));
    if let Some(trace) = crate::trace::ht_launch(&words, blocks, warps as usize, send_blocks, kernel, op) {
        b.gpu.ht_trace_push(trace);
    }
}

// ------------------------------------------------------------------------------------------ helpers

fn region(b: &Intranode) -> HtRegion {
    HtRegion { num_nvl_bytes: b.num_nvl_bytes, num_ranks: b.num_ranks }
}

/// Every rank must see the same data-region layout; checked once, at the first collective HT call.
fn ensure_region_agreed(b: &mut Intranode) -> Result<()> {
    if !b.ht.region_agreed {
        crate::group::check_agreement(b.group.as_ref(), &[("num_nvl_bytes", b.num_nvl_bytes as u64)])?;
        b.ht.region_agreed = true;
    }
    Ok(())
}

fn layout_args(b: &Intranode) -> (DevPtrs<{ abi::MAX_RANKS }>, DevPtrs<{ abi::MAX_RANKS }>) {
    (b.peer_table(ctrl::HT), b.peer_table(HT_DATA))
}

/// Reads `NUM_RECV` and `T_MAX` of a routing buffer (after the stream finished).
fn read_back_routing(buf: &PooledBuffer) -> Result<HostRouting> {
    let mut words = [0u8; 8];
    buf.buffer().copy_to_host_at(4 * routing::NUM_RECV, &mut words)?;
    debug_assert_eq!(routing::T_MAX, routing::NUM_RECV + 1);
    let num_recv = u32::from_le_bytes(words[..4].try_into().expect("4 bytes")) as usize;
    let t_max = u32::from_le_bytes(words[4..].try_into().expect("4 bytes")) as usize;
    Ok(HostRouting { num_recv_tokens: num_recv, t_max, per_expert_raw: None, recv_counts: None, notify_seq: 0 })
}

// ------------------------------------------------------------------------------------------ layout

pub(crate) fn dispatch_layout(b: &mut Intranode, topk_idx: &TensorRef<'_>, num_experts: usize, out: LayoutOutputs<'_>) -> Result<()> {
    let rank = b.rank;
    let (t, k) = (topk_idx.shape()[0], topk_idx.shape()[1]);
    check_aligned(topk_idx.addr(), 8, "topk_idx", rank)?;
    let num_tokens_per_rank = out.num_tokens_per_rank.device_ptr();
    let num_tokens_per_expert = out.num_tokens_per_expert.device_ptr();
    check_aligned(num_tokens_per_rank.addr(), 4, "num_tokens_per_rank", rank)?;
    check_aligned(num_tokens_per_expert.addr(), 4, "num_tokens_per_expert", rank)?;
    // The kernel stores every counter (nothing to zero first): one launch is the whole call.
    let kernel = b.kernel_of(HtLayoutVariant, kernel_name::HT_LAYOUT, HtLayoutVariant::spec)?;
    let (error_claim, error_record) = b.error_sink();
    let strides = topk_idx.strides();
    let args = HtLayoutArgs {
        topk_idx: b.addr_of(topk_idx),
        topk_stride_token: strides[0] as i64,
        topk_stride_k: strides[1] as i64,
        num_tokens_per_rank,
        num_tokens_per_expert,
        is_token_in_rank: out.is_token_in_rank.device_ptr(),
        error_claim,
        error_record,
        num_tokens: to_u32(t, "topk_idx", rank)?,
        topk: to_u32(k, "topk_idx", rank)?,
        num_experts: to_u32(num_experts, "num_experts", rank)?,
        num_ranks: b.num_ranks as u32,
        rank: rank as u32,
        reserved: 0,
    };
    b.launch(&kernel, &LaunchConfig::linear(HtLayoutVariant::grid(num_experts), HtLayoutVariant::THREADS), &args)?;
    b.gpu.finish_settled(Phase::Layout)
}

// ------------------------------------------------------------------------------------------ dispatch

pub(crate) fn prepare_dispatch(b: &mut Intranode, s: HtSpec, a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    let rank = s.rank;
    ensure_region_agreed(b)?;
    check_dispatch_start(b, &s, a)?;
    let row_bytes = kht::dispatch_row_bytes(s.hidden, s.fp8, s.topk);
    let slab_rows = region(b).slab_rows(row_bytes);
    match a.routing {
        Routing::Cached(h) => {
            let data = h.data.clone();
            let host = routing_of(&data, rank)?.host.clone();
            if let Some(hr) = &host {
                if hr.t_max > slab_rows {
                    return Err(too_small(b, "HT dispatch receive slab", hr.t_max, row_bytes));
                }
            }
            Ok(dispatch_plan(
                s,
                host.as_ref().map(|h| h.num_recv_tokens),
                host.as_ref().and_then(|h| h.per_expert_raw.as_deref()),
                BackendData::new(INTRANODE, CudaPlan::Cached(data)),
            ))
        }
        Routing::Fresh { layout, .. } => {
            let el = s.num_local_experts();
            if el > kht::ctrl::MAX_LOCAL_EXPERTS {
                return Err(Error::invalid(
                    "num_experts",
                    rank,
                    format!("{el} experts per rank; the CUDA kernels support at most {}", kht::ctrl::MAX_LOCAL_EXPERTS),
                ));
            }
            let num_tokens = to_u32(s.num_tokens, "x", rank)?;
            let routing_buf = pool_take(&b.gpu, routing::bytes(s.num_tokens, s.num_ranks))?;
            let sync = s.num_worst_tokens == 0;
            let (host_out, host_seq) = if sync {
                let words = host_notify::words(el);
                if b.ht.host_notify.as_ref().is_none_or(|m| m.len() < words) {
                    b.ht.host_notify = Some(HostMapped::new(&b.gpu.device, words.max(host_notify::words(256)))?);
                }
                b.ht.notify_seq = b.ht.notify_seq.wrapping_add(1).max(1);
                (b.ht.host_notify.as_ref().map_or(DevPtr::NULL, |m| m.device_ptr()), b.ht.notify_seq)
            } else {
                (DevPtr::NULL, 0)
            };
            let signature = kht::call_signature(CallSignature {
                hidden: s.hidden,
                num_experts: s.num_experts,
                topk: s.topk,
                fp8: s.fp8,
                has_topk: s.has_topk,
                no_sync: !sync,
            });
            let kernel = b.kernel_of(HtNotifyVariant, kernel_name::HT_NOTIFY, HtNotifyVariant::spec)?;
            let (error_claim, error_record) = b.error_sink();
            let args = HtNotifyArgs {
                is_token_in_rank: layout.is_token_in_rank.device_ptr(),
                num_tokens_per_rank: layout.num_tokens_per_rank.device_ptr(),
                num_tokens_per_expert: layout.num_tokens_per_expert.device_ptr(),
                routing: routing_buf.ptr(),
                host_out,
                ctrl: b.peer_table(ctrl::HT),
                signature,
                error_claim,
                error_record,
                timeout_ns: b.timeout_ns,
                rank: rank as u32,
                num_ranks: s.num_ranks as u32,
                num_tokens,
                num_local_experts: el as u32,
                slab_rows: slab_rows.min(u32::MAX as usize) as u32,
                slab_row_bytes: row_bytes as u32,
                host_seq,
                reserved: 0,
            };
            b.launch(&kernel, &LaunchConfig::linear(1, HtNotifyVariant::THREADS), &args)?;
            let host = if sync { Some(read_notify(b, host_seq, &s, row_bytes)?) } else { None };
            let (num_recv, per_expert_raw) =
                (host.as_ref().map(|h| h.num_recv_tokens), host.as_ref().and_then(|h| h.per_expert_raw.clone()));
            Ok(dispatch_plan(
                s,
                num_recv,
                per_expert_raw.as_deref(),
                BackendData::new(INTRANODE, CudaPlan::Fresh { routing: routing_buf, host }),
            ))
        }
    }
}

/// CPU-sync mode: waits (deadline) for the notify kernel's host-mapped results of call `seq`, then decides
/// whether this call dispatches. Only a fatal error ends the wait early, and the decision rests on the
/// exchange's status alone — the value every rank computed from the same messages — never on an argument
/// error an earlier asynchronous call may have left in the record (that one surfaces when the dispatch
/// finishes, after the collective ran), so every rank launches the dispatch or none does.
fn read_notify(b: &mut Intranode, seq: u32, s: &HtSpec, row_bytes: usize) -> Result<HostRouting> {
    let rank = b.rank;
    let Some(m) = b.ht.host_notify.as_ref() else {
        return Err(Error::invalid("num_worst_tokens", rank, "internal: no host-mapped notify area"));
    };
    let start = wait_notify_ready(&b.gpu, rank, seq, m, host_notify::READY)?;
    let status = m.read(host_notify::STATUS);
    let host = HostRouting {
        num_recv_tokens: m.read(host_notify::NUM_RECV) as usize,
        t_max: m.read(host_notify::T_MAX) as usize,
        per_expert_raw: Some((0..s.num_local_experts()).map(|e| m.read(host_notify::PER_EXPERT + e) as usize).collect()),
        recv_counts: Some((0..s.num_ranks).map(|r| m.read(host_notify::RECV_COUNT + r) as usize).collect()),
        notify_seq: seq,
    };
    if status == 0 {
        return Ok(host);
    }
    let peer = m.read(host_notify::STATUS_PEER) as usize;
    let e =
        notify_status_error(b, s, status, peer, start).unwrap_or_else(|| too_small(b, "HT dispatch receive slab", host.t_max, row_bytes));
    Err(b.gpu.settle(e))
}

pub(crate) fn dispatch(b: &mut Intranode, plan: DispatchPlan, a: &DispatchArgs<'_>, mut out: DispatchOutputs<'_>) -> Result<HtDispatched> {
    let s = plan.spec;
    let rank = s.rank;
    let num_out_rows = plan.num_recv_rows();
    let state = plan.state.take::<CudaPlan>("plan", rank, INTRANODE)?;
    let addrs = dispatch_addrs(b, &s, a, &out)?;
    let region = region(b);
    let release = release(&b.tuning, b.gpu.node_on_one_gpu(), kht::default_dispatch_release(s.fp8));
    let variant = HtDispatchVariant {
        release_batch: release.batch,
        releaser: release.releaser,
        experiment: timing_experiment(&b.tuning),
        ..HtDispatchVariant::new(s.hidden, s.fp8, s.topk)
    };
    let slab_rows = region.slab_rows(variant.row_bytes());

    // The handle: a fresh dispatch builds it (routing from notify); a cached one re-uses it.
    let handle = match state {
        CudaPlan::Fresh { routing, host } => {
            // The copy-engine receive finds rows by source token: the handle keeps the fresh call's.
            let src_idx = match &host {
                Some(_) if ce_pieces(&b.tuning, s.num_ranks).is_some() => Some(pool_take(&b.gpu, 4 * num_out_rows.max(1))?),
                _ => None,
            };
            HandleData::New(CudaHtRouting { routing, host, src_idx })
        }
        CudaPlan::Cached(data) => HandleData::Existing(data),
    };
    let r = match &handle {
        HandleData::New(r) => r,
        HandleData::Existing(data) => routing_of(data, rank)?,
    };

    let (ctrl_table, data_table) = layout_args(b);
    let (error_claim, error_record) = b.error_sink();
    let sender_chunk = send_chunk(&b.tuning, variant.release_batch);
    // A fresh CPU-synchronised dispatch with top-k checks the rows that arrive against the per-expert counts
    // notify left in the host-mapped words (what the host returns as num_recv_tokens_per_expert).
    let (host_notify, host_seq) = match (&handle, &r.host, &b.ht.host_notify) {
        (HandleData::New(_), Some(h), Some(m)) if s.has_topk && h.notify_seq != 0 => (m.device_ptr(), h.notify_seq),
        _ => (DevPtr::NULL, 0),
    };
    // DeepEP's channel elements of the handle, written by the kernel (validated: contiguous int32 tensors).
    let (send_head, channel_prefix, recv_channel_prefix, num_channels) = match &out.channels {
        Some(c) => {
            for (t, arg) in [
                (&c.send_head, "send_head"),
                (&c.channel_prefix_matrix, "channel_prefix_matrix"),
                (&c.recv_channel_prefix_matrix, "recv_channel_prefix_matrix"),
            ] {
                check_aligned(t.addr(), 4, arg, rank)?;
            }
            (
                c.send_head.device_ptr(),
                c.channel_prefix_matrix.device_ptr(),
                c.recv_channel_prefix_matrix.device_ptr(),
                c.num_channels() as u32,
            )
        }
        None => (DevPtr::NULL, DevPtr::NULL, DevPtr::NULL, 0),
    };
    let ce = match &handle {
        HandleData::Existing(_) => ce_dispatch_plan(b, &s, a, r, slab_rows, variant.row_bytes()),
        HandleData::New(_) => None,
    };
    let variant = HtDispatchVariant { copy_engine: ce.is_some(), ..variant };
    let kept_src_idx = match (&handle, &r.src_idx) {
        (HandleData::New(_), Some(buf)) => buf.ptr(),
        _ => DevPtr::NULL,
    };
    let args = HtDispatchArgs {
        x: addrs.x,
        x_scales: addrs.x_scales,
        scale_stride_token: addrs.scale_stride_token,
        scale_stride_group: addrs.scale_stride_group,
        topk_idx: addrs.topk_idx,
        topk_weights: addrs.topk_weights,
        num_tokens_per_expert: addrs.num_tokens_per_expert,
        host_notify,
        recv_x: addrs.recv_x,
        recv_scales: addrs.recv_scales,
        recv_topk_idx: addrs.recv_topk_idx,
        recv_topk_weights: addrs.recv_topk_weights,
        recv_src_idx: if kept_src_idx.is_null() { addrs.recv_src_idx } else { kept_src_idx },
        routing: r.routing.ptr(),
        ctrl: ctrl_table,
        data: data_table,
        flags_offset: region.dispatch_flags_offset() as u64,
        slab_offset: region.dispatch_slab_offset() as u64,
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        rank: rank as u32,
        num_ranks: s.num_ranks as u32,
        num_tokens: to_u32(s.num_tokens, "x", rank)?,
        num_local_experts: s.num_local_experts() as u32,
        num_out_rows: to_u32(num_out_rows, "num_worst_tokens", rank)?,
        slab_rows: slab_rows.min(u32::MAX as usize) as u32,
        flag_slots: region.flag_slots() as u32,
        num_send_blocks: if ce.is_some() { 0 } else { dispatch_send_blocks(&b.tuning, s.num_sms, s.num_ranks) as u32 },
        send_chunk: sender_chunk,
        recv_chunk: recv_chunk(&b.tuning),
        dynamic_send: dynamic_send(&b.tuning, sender_chunk),
        host_seq,
        trace: trace_begin(b, s.num_sms, HtDispatchVariant::WARPS)?,
        send_head,
        channel_prefix,
        recv_channel_prefix,
        num_channels,
        ce_piece_tokens: ce.as_ref().map_or(0, |c| c.piece_tokens as u32),
        ce_src_idx: ce.as_ref().map_or(DevPtr::NULL, |c| c.src_idx),
        ce_scales_offset: ce.as_ref().map_or(0, |c| c.staging.second_offset as u32),
        reserved: 0,
    };
    let kernel = b.kernel_of(variant, kernel_name::HT_DISPATCH, HtDispatchVariant::spec)?;
    let cfg = LaunchConfig::linear(s.num_sms as u32, variant.threads());
    if let Some(ce) = &ce {
        let sig = CeSignal::new(b, false, r, slab_rows, variant.row_bytes(), (args.scale_stride_token, args.scale_stride_group));
        let pieces = ce_dispatch_pieces(&s, a, ce, sig.staging);
        ce_launch(b, &sig, &pieces, &kernel, &cfg, &args)?;
    } else {
        b.launch(&kernel, &cfg, &args)?;
    }
    if !kept_src_idx.is_null() {
        if let (Some(t), Some(buf)) = (&mut out.recv_src_idx, &r.src_idx) {
            // Validated as a contiguous int32 [num_out_rows] tensor of this device; the kernel wrote the handle's copy.
            t.device_span_mut()?.copy_from_device_async(buf.buffer(), 0, b.op_stream())?;
        }
    }
    if let Some(t) = &mut out.rank_prefix_matrix {
        // The output was validated as a contiguous int32 [R, R] tensor of this device; the routing buffer holds
        // R * R words at RANK_PREFIX, written by ht_notify earlier on this stream.
        t.device_span_mut()?.copy_from_device_async(r.routing.buffer(), 4 * routing::RANK_PREFIX, b.op_stream())?;
    }
    b.gpu.finish_settled(Phase::Dispatch)?;
    if !args.trace.is_null() {
        let op = if matches!(handle, HandleData::Existing(_)) { "cached dispatch" } else { "dispatch" };
        trace_keep(b, kernel_name::HT_DISPATCH, op, s.num_sms, HtDispatchVariant::WARPS, args.num_send_blocks as usize);
    }

    // No-sync mode, but this call waited for the kernels: the counts are on the device, read them back.
    let read_back = if r.host.is_none() && !b.is_async() { Some(read_back_routing(&r.routing)?) } else { None };
    let num_recv_tokens = r.host.as_ref().or(read_back.as_ref()).map(|h| h.num_recv_tokens);
    let data = match handle {
        HandleData::New(mut r) => {
            if r.host.is_none() {
                r.host = read_back;
            }
            Arc::new(BackendData::new(INTRANODE, r))
        }
        HandleData::Existing(data) => data,
    };
    Ok(HtDispatched { data, num_recv_tokens })
}

// ------------------------------------------------------------------------------------------ copy engines

/// `Tuning::ht_ce_pieces` (clamped to 1..=64) where the copy-engine path applies: two ranks on the node.
fn ce_pieces(t: &Tuning, num_ranks: usize) -> Option<usize> {
    t.ht_ce_pieces.filter(|&n| n > 0 && num_ranks == 2).map(|n| (n as usize).min(64))
}

/// Bytes below which a piece is not worth its own copy and flag (`Tuning::ht_ce_min_piece_bytes` overrides):
/// each costs ~5 and ~4 µs of the side stream beyond its bytes (one H200,
/// `bench/results/2026-12-01-1xnvidia-h200-736b070-ce-pair-check/`), ~3.5 MB at the pair's ~390 GB/s.
const CE_MIN_PIECE_BYTES: usize = 4 << 20;

/// Rows per piece: `t_max` rows of `row_bytes` in equal pieces, `pieces` of them, or as many as leave none
/// below `min_bytes` (at least one).
fn ce_piece_rows(t_max: usize, pieces: usize, row_bytes: usize, min_bytes: usize) -> usize {
    let fitting = t_max.saturating_mul(row_bytes).checked_div(min_bytes).unwrap_or(pieces);
    t_max.div_ceil(pieces.min(fitting).max(1)).max(1)
}

fn ce_min_piece_bytes(t: &Tuning) -> usize {
    t.ht_ce_min_piece_bytes.unwrap_or(CE_MIN_PIECE_BYTES)
}

/// Whether a call may take the copy-engine path at all: no graph capture (the pieces run on a side stream)
/// and an SM of this rank's share left beside the kernel's blocks for the signal kernels, which they wait for.
fn ce_possible(b: &Intranode, num_sms: usize) -> bool {
    !b.gpu.is_capturing() && num_sms < b.gpu.num_rank_sms()
}

/// One copy of a piece: `bytes` of `src` from `src_offset` to byte `dst` of the peer's symmetric buffer.
struct CeCopy<'a> {
    dst: usize,
    src: MemRef<'a>,
    src_offset: usize,
    bytes: usize,
}

/// What the signals of one call's pieces need (`ht_ce_signal.cu`).
struct CeSignal {
    combine: bool,
    routing: DevPtr,
    slab_rows: u32,
    /// Byte offsets in the symmetric buffer of this rank's staging and row flags at the peer.
    staging: usize,
    flags: usize,
    scale_strides: (i64, i64),
}

impl CeSignal {
    /// The signals of one call of the dispatch or the combine (`combine`), whose slab holds `slab_rows` rows of
    /// `row_bytes` per source: this rank's part of that slab and of its row flags at the peer.
    fn new(b: &Intranode, combine: bool, r: &CudaHtRouting, slab_rows: usize, row_bytes: usize, scale_strides: (i64, i64)) -> CeSignal {
        let region = region(b);
        let (slab, flags) = if combine {
            (region.combine_slab_offset(), region.combine_flags_offset())
        } else {
            (region.dispatch_slab_offset(), region.dispatch_flags_offset())
        };
        CeSignal {
            combine,
            routing: r.routing.ptr(),
            slab_rows: slab_rows.min(u32::MAX as usize) as u32,
            staging: HT_DATA + slab + b.rank * slab_rows * row_bytes,
            flags: HT_DATA + flags + 4 * b.rank * region.flag_slots(),
            scale_strides,
        }
    }
}

/// The copy-engine path of one call: on the side stream the wait for the peer's hand-back, then each piece's
/// copies followed by its flag; then `kernel` (every block receiving) on the operation stream; then the
/// operation stream joins the side stream, so that the inputs are read before the call's later work. The
/// side work is issued first: should both streams share a hardware queue, the kernel then queues behind the
/// copies it waits for, never before them.
fn ce_launch<A: KernelParams>(
    b: &mut Intranode,
    sig: &CeSignal,
    pieces: &[Vec<CeCopy<'_>>],
    kernel: &moelink_cuda::Kernel,
    cfg: &LaunchConfig,
    args: &A,
) -> Result<()> {
    let (rank, peer) = (b.rank, 1 - b.rank);
    let signal = b.kernel_of(kht::HtCeSignalVariant, kernel_name::HT_CE_SIGNAL, kht::HtCeSignalVariant::spec)?;
    let (error_claim, error_record) = b.error_sink();
    let base = kht::HtCeSignalArgs {
        routing: sig.routing,
        ctrl: b.gpu.peer_addr(rank, ctrl::HT)?,
        peer_flags: b.gpu.peer_addr(peer, sig.flags)?,
        peer_staging: b.gpu.peer_addr(peer, sig.staging)?,
        error_claim,
        scale_stride_token: sig.scale_strides.0,
        scale_stride_group: sig.scale_strides.1,
        error_record,
        timeout_ns: b.timeout_ns,
        rank: rank as u32,
        num_ranks: 2,
        slab_rows: sig.slab_rows,
        piece: kht::CE_WAIT,
        combine: sig.combine as u32,
        ..Default::default()
    };
    let one = LaunchConfig::linear(1, kht::HtCeSignalVariant::THREADS);
    b.gpu.fork_side()?;
    let issued = (|| -> Result<()> {
        let side = b.gpu.side_stream()?;
        b.gpu.launch_on(side, &signal, &one, &base)?;
        for (p, copies) in pieces.iter().enumerate() {
            for c in copies {
                b.gpu.sym.copy_to_peer_async(peer, c.dst, &c.src, c.src_offset, c.bytes, side)?;
            }
            b.gpu.launch_on(side, &signal, &one, &kht::HtCeSignalArgs { piece: p as u32, ..base })?;
        }
        b.launch(kernel, cfg, args)
    })();
    // Joined also after a failed launch: whatever the side stream was given still reads the inputs.
    let joined = b.gpu.join_side();
    issued.and(joined)
}

/// A cached dispatch by copy engines: its pieces' tokens and the staging.
struct CeDispatch {
    piece_tokens: usize,
    staging: kht::CeStaging,
    /// The handle's source token of each received row.
    src_idx: DevPtr,
}

/// The copy-engine plan of a cached dispatch, or `None` for the SM senders: it needs `ce_pieces`, a handle
/// that kept its source indices and knows T_max on the host, `ce_possible`, and a staging that fits the slab
/// (`slab_rows` rows of the call's `row_bytes` per source).
fn ce_dispatch_plan(
    b: &Intranode,
    s: &HtSpec,
    a: &DispatchArgs<'_>,
    r: &CudaHtRouting,
    slab_rows: usize,
    row_bytes: usize,
) -> Option<CeDispatch> {
    let (Some(pieces), Some(host), Some(src_idx)) = (ce_pieces(&b.tuning, s.num_ranks), &r.host, &r.src_idx) else {
        return None;
    };
    if !ce_possible(b, s.num_sms) {
        return None;
    }
    let scale_bytes = match &a.x {
        Payload::Fp8 { scales, .. } => scales.span_bytes(),
        Payload::Bf16(_) => 0,
    };
    let payload_bytes = s.hidden * if s.fp8 { 1 } else { 2 };
    let staging = kht::ce_staging(payload_bytes, host.t_max, scale_bytes, slab_rows * row_bytes)?;
    Some(CeDispatch {
        piece_tokens: ce_piece_rows(host.t_max, pieces, payload_bytes, ce_min_piece_bytes(&b.tuning)),
        staging,
        src_idx: src_idx.ptr(),
    })
}

/// The cached dispatch's pieces: this rank's x by token index (the first piece also the FP8 scales' storage
/// as it is) into its staging at the peer, which begins at `staging`.
fn ce_dispatch_pieces<'a>(s: &HtSpec, a: &DispatchArgs<'a>, ce: &CeDispatch, staging: usize) -> Vec<Vec<CeCopy<'a>>> {
    let pb = ce.staging.payload_bytes;
    let mut pieces = Vec::new();
    for first in (0..s.num_tokens).step_by(ce.piece_tokens) {
        let mut copies = Vec::with_capacity(2);
        if let (0, Payload::Fp8 { scales, .. }) = (first, &a.x) {
            copies.push(CeCopy { dst: staging + ce.staging.second_offset, src: scales.mem(), src_offset: 0, bytes: scales.span_bytes() });
        }
        let n = ce.piece_tokens.min(s.num_tokens - first);
        copies.push(CeCopy { dst: staging + kht::CE_HEADER_BYTES + first * pb, src: a.x.x().mem(), src_offset: first * pb, bytes: n * pb });
        pieces.push(copies);
    }
    pieces
}

/// A combine by copy engines: the rows this rank received from the peer (`rows` from row `first_row` of x, in
/// pieces of `piece_rows`) go back into its staging at the peer.
struct CeCombine {
    piece_rows: usize,
    staging: kht::CeStaging,
    first_row: usize,
    rows: usize,
}

/// The copy-engine plan of a combine, or `None` for the SM senders: it needs `ce_pieces`, a handle that knows
/// T_max and the rows from each source on the host, `ce_possible`, and a staging that fits the slab.
fn ce_combine_plan(b: &Intranode, s: &CombineSpec, r: &CudaHtRouting, slab_rows: usize, row_bytes: usize) -> Option<CeCombine> {
    let pieces = ce_pieces(&b.tuning, s.num_ranks)?;
    let host = r.host.as_ref()?;
    let counts = host.recv_counts.as_ref()?;
    if !ce_possible(b, s.num_sms) {
        return None;
    }
    let peer = 1 - s.rank;
    let staging = kht::ce_staging(2 * s.hidden, host.t_max, host.t_max * s.topk * 4, slab_rows * row_bytes)?;
    Some(CeCombine {
        piece_rows: ce_piece_rows(host.t_max, pieces, 2 * s.hidden, ce_min_piece_bytes(&b.tuning)),
        staging,
        first_row: counts[..peer].iter().sum(),
        rows: counts[peer],
    })
}

/// The combine's pieces: the peer's rows of x and of the top-k weights, by their slot, into this rank's
/// staging at the peer, which begins at `staging`.
fn ce_combine_pieces<'a>(s: &CombineSpec, a: &CombineArgs<'a>, ce: &CeCombine, staging: usize) -> Vec<Vec<CeCopy<'a>>> {
    let (pb, wb) = (ce.staging.payload_bytes, 4 * s.topk);
    let mut pieces = Vec::new();
    for first in (0..ce.rows).step_by(ce.piece_rows) {
        let n = ce.piece_rows.min(ce.rows - first);
        let row = ce.first_row + first;
        let mut copies =
            vec![CeCopy { dst: staging + kht::CE_HEADER_BYTES + first * pb, src: a.x.mem(), src_offset: row * pb, bytes: n * pb }];
        if let (Some(w), true) = (&a.topk_weights, wb > 0) {
            copies.push(CeCopy { dst: staging + ce.staging.second_offset + first * wb, src: w.mem(), src_offset: row * wb, bytes: n * wb });
        }
        pieces.push(copies);
    }
    pieces
}

// ------------------------------------------------------------------------------------------ combine

pub(crate) fn combine(b: &mut Intranode, s: CombineSpec, a: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
    let rank = s.rank;
    let r = routing_of(&a.handle.data, rank)?;
    let c = combine_addrs(b, rank, a, &out)?;
    let release = release(&b.tuning, b.gpu.node_on_one_gpu(), kht::DEFAULT_COMBINE_RELEASE);
    let variant = HtCombineVariant {
        num_biases: c.num_biases as u32,
        release_batch: release.batch,
        releaser: release.releaser,
        experiment: timing_experiment(&b.tuning),
        reduce_load_vecs: reduce_load_vecs(&b.tuning),
        ..HtCombineVariant::new(s.num_ranks, s.hidden, s.topk)
    };
    let region = region(b);
    let slab_rows = region.slab_rows(variant.row_bytes());
    if let Some(h) = &r.host {
        if h.t_max > slab_rows {
            return Err(too_small(b, "HT combine receive slab", h.t_max, variant.row_bytes()));
        }
    }
    let ce = ce_combine_plan(b, &s, r, slab_rows, variant.row_bytes());
    let variant = HtCombineVariant { copy_engine: ce.is_some(), ..variant };
    let (ctrl_table, data_table) = layout_args(b);
    let (error_claim, error_record) = b.error_sink();
    let sender_chunk = send_chunk(&b.tuning, variant.release_batch);
    let args = HtCombineArgs {
        x: c.x,
        topk_weights: c.topk_weights,
        bias0: c.bias0,
        bias1: c.bias1,
        combined_x: c.combined_x,
        combined_topk_weights: c.combined_topk_weights,
        routing: r.routing.ptr(),
        ctrl: ctrl_table,
        data: data_table,
        flags_offset: region.combine_flags_offset() as u64,
        slab_offset: region.combine_slab_offset() as u64,
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        rank: rank as u32,
        num_tokens: to_u32(s.num_tokens, "x", rank)?,
        num_x_rows: to_u32(s.num_recv_rows, "x", rank)?,
        slab_rows: slab_rows.min(u32::MAX as usize) as u32,
        flag_slots: region.flag_slots() as u32,
        num_send_blocks: if ce.is_some() { 0 } else { combine_send_blocks(&b.tuning, s.num_sms, s.num_ranks) as u32 },
        send_chunk: sender_chunk,
        recv_chunk: recv_chunk(&b.tuning),
        dynamic_send: dynamic_send(&b.tuning, sender_chunk),
        ce_piece_rows: ce.as_ref().map_or(0, |c| c.piece_rows as u32),
        trace: trace_begin(b, s.num_sms, HtCombineVariant::WARPS)?,
        ce_weights_offset: ce.as_ref().map_or(0, |c| c.staging.second_offset as u32),
        reserved: 0,
    };
    let kernel = b.kernel_of(variant, kernel_name::HT_COMBINE, HtCombineVariant::spec)?;
    let cfg = LaunchConfig::linear(s.num_sms as u32, variant.threads());
    if let Some(ce) = &ce {
        let sig = CeSignal::new(b, true, r, slab_rows, variant.row_bytes(), (0, 0));
        let pieces = ce_combine_pieces(&s, a, ce, sig.staging);
        ce_launch(b, &sig, &pieces, &kernel, &cfg, &args)?;
    } else {
        b.launch(&kernel, &cfg, &args)?;
    }
    b.gpu.finish_settled(Phase::Combine)?;
    if !args.trace.is_null() {
        trace_keep(b, kernel_name::HT_COMBINE, "combine", s.num_sms, HtCombineVariant::WARPS, args.num_send_blocks as usize);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sender_blocks_follow_the_formula() {
        let d = Tuning::default();
        for sms in (2..=132).step_by(2) {
            for ranks in [2, 4, 8] {
                assert!(dispatch_send_blocks(&d, sms, ranks) >= 1 && dispatch_send_blocks(&d, sms, ranks) < sms);
                assert!(combine_send_blocks(&d, sms, ranks) >= 1 && combine_send_blocks(&d, sms, ranks) < sms);
            }
        }
        assert_eq!((dispatch_send_blocks(&d, 24, 4), combine_send_blocks(&d, 24, 4)), (8, 8));
        assert_eq!([2, 8, 16, 64, 132].map(|n| dispatch_send_blocks(&d, n, 8)), [1, 4, 8, 8, 8]);
        // One peer: the measured best counts at 16, 24, 32 and 48 SMs.
        assert_eq!([2, 16, 24, 32, 48, 132].map(|n| dispatch_send_blocks(&d, n, 2)), [1, 6, 10, 12, 12, 12]);
        assert_eq!(combine_send_blocks(&d, 24, 2), 10);
        assert_eq!([8, 16, 64].map(default_send_blocks), [4, 8, 21]);
    }

    #[test]
    fn tuning_overrides_are_clamped_where_they_are_used() {
        let d = Tuning::default();
        assert_eq!(
            (release(&d, false, kht::DEFAULT_COMBINE_RELEASE), recv_chunk(&d), reduce_load_vecs(&d)),
            (kht::DEFAULT_COMBINE_RELEASE, kht::DEFAULT_RECV_CHUNK, HtCombineVariant::REDUCE_LOAD_VECS)
        );
        assert_eq!((send_chunk(&d, 4), dynamic_send(&d, 4), timing_experiment(&d)), (4, 1, 0));
        let t = Tuning {
            ht_dispatch_send_blocks: Some(99),
            ht_combine_send_blocks: Some(0),
            ht_release_batch: Some(100),
            ht_send_chunk: Some(5),
            ht_dynamic_send: Some(false),
            ht_reduce_load_vecs: Some(0),
            ht_timing_experiment: 15,
            ..d
        };
        assert_eq!((dispatch_send_blocks(&t, 24, 2), combine_send_blocks(&t, 24, 2)), (23, 1));
        assert_eq!((release(&t, false, kht::default_dispatch_release(true)).batch, send_chunk(&t, 4), dynamic_send(&t, 4)), (64, 8, 0));
        let off = Tuning { ht_releaser: Some(false), ..Tuning::default() };
        assert_eq!(release(&off, false, kht::DEFAULT_COMBINE_RELEASE), kht::HtRelease { releaser: false, batch: 2 });
        assert_eq!(release(&d, true, kht::DEFAULT_COMBINE_RELEASE), kht::ONE_GPU_RELEASE, "a node on one GPU");
        let on = Tuning { ht_releaser: Some(true), ..Tuning::default() };
        assert_eq!(
            release(&on, true, kht::DEFAULT_COMBINE_RELEASE),
            kht::HtRelease { releaser: true, batch: 4 },
            "the tuning still overrides"
        );
        assert_eq!((reduce_load_vecs(&t), timing_experiment(&t)), (1, 15));
        assert_eq!(send_chunk(&Tuning { ht_send_chunk: Some(0), ..Tuning::default() }, 4), 0, "0: contiguous parts");
        let ce = |n| Tuning { ht_ce_pieces: n, ..Tuning::default() };
        assert_eq!([ce(None), ce(Some(0)), ce(Some(4)), ce(Some(1000))].map(|t| ce_pieces(&t, 2)), [None, None, Some(4), Some(64)]);
        assert_eq!(ce_pieces(&ce(Some(4)), 4), None, "two ranks only");
        // 4096 FP8 rows of 7168 bytes (29 MB) in 4 pieces; 512 of them (3.7 MB) in one.
        let min = ce_min_piece_bytes(&d);
        // 4096 FP8 rows of 7168 bytes (29 MB): 4 pieces; 2048 (14.7 MB): 3 equal ones; 512 (3.7 MB): one.
        assert_eq!([4096, 2048, 512, 0].map(|t| ce_piece_rows(t, 4, 7168, min)), [1024, 683, 512, 1]);
        assert_eq!(ce_piece_rows(4096, 64, 14336, min), 293, "14 pieces of 4 MiB or more");
        assert_eq!((ce_piece_rows(512, 4, 7168, 0), ce_piece_rows(0, 4, 7168, 0)), (128, 1), "0: every piece kept");
    }
}
