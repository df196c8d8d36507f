//! Low-latency dispatch/combine on one node: the host side of `moelink-kernels/cuda/ll_*.cu`. The protocol is in
//! `docs/protocols.md` ("Low latency"); this module picks buffer sets, lays out the low-latency region
//! ([`moelink_kernels::ll::LlLayout`]), fills the kernels' argument structs, launches them, and turns what
//! the kernels report ([`LlReport`]) into typed errors.
//!
//! - Without `return_recv_hook` one cooperative launch runs the send and receive phases; with it the send
//!   kernel returns once its stores are flagged and the pending receive launches the receive kernel.
//! - Buffer sets alternate per call of each kind (`calls & 1`, host-side, so a captured CUDA graph replays
//!   the sets it was captured with); every flag compares against a device-side epoch, so replays work.
//! - Argument problems only the GPU can see (top-k ids, combine inputs that differ from dispatch's) and
//!   call-signature mismatches between ranks come back through [`LlReport`] after the kernels ran the
//!   protocol to its end: every rank fails the call with an argument error and the buffer stays usable.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use moelink_cuda::{DevPtr, DevPtrs, Device, Kernel, LaunchConfig};
use moelink_kernels::abi::MAX_RANKS;
use moelink_kernels::kernel_name;
use moelink_kernels::ll::{phase, problem, LlCombineArgs, LlCtrl, LlDispatchArgs, LlLayout, LlVariant, LL_THREADS};

use super::super::gpu::{ctrl, CTRL_BYTES};
use super::super::ll_shared::{
    opt_addr, problem_reason, signature, CudaLlRouting, HookMarker, LlCalls, LlTrace, Pending, HOOK_PENDING, HOOK_RAN,
};
use super::{Intranode, INTRANODE};
use crate::backend::{BackendData, PendingRecv};
use crate::dtype::DType;
use crate::error::{Phase, Result};
use crate::ll::checked_layout;
use crate::ll::{LlCombineArgs as CombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs as DispatchArgs, LlDispatchOutputs, LlSpec};
use crate::opaque::{backend_of, RecvPhase};
use crate::tensor::TensorMut;

/// The receive launch a dropped hook stands for.
pub(crate) enum Drain {
    Dispatch(LlVariant, LlDispatchArgs),
    Combine(LlVariant, LlCombineArgs),
}

/// Per-buffer low-latency state.
pub(crate) struct LlState {
    pub(crate) calls: LlCalls<Drain>,
    /// Timing trace words (`KernelTracing::low_latency`).
    pub(crate) trace: LlTrace,
}

impl LlState {
    pub(crate) fn new(device: &Device, enable_shrink: bool) -> Result<LlState> {
        Ok(LlState { calls: LlCalls::new(device, enable_shrink)?, trace: LlTrace::new() })
    }
}

/// A dispatch whose receive phase has not run yet (`return_recv_hook`), boxed in a `PendingRecv`.
pub(crate) struct PendingDispatch<'a>(Pending<LlDispatchArgs, LlDispatchOutputs<'a>, LlVariant>);

/// A combine whose receive phase has not run yet (`return_recv_hook`).
pub(crate) struct PendingCombine<'a>(Pending<LlCombineArgs, LlCombineOutputs<'a>, LlVariant>);

// ------------------------------------------------------------------ layout and sizes

/// Byte offset of the low-latency data region in the symmetric buffer (after the control area and the
/// high-throughput region, as allocated by `Gpu::new`).
fn ll_data_offset(b: &Intranode) -> usize {
    CTRL_BYTES + b.num_nvl_bytes.next_multiple_of(4096)
}

/// The kernels for `s`, with the buffer's timing experiment (`Tuning::ll_experiment`, a JIT constant: 0 in
/// every real call).
/// Kernel `name` (dispatch or combine) of variant `v`, compiled and loaded on first use.
fn ll_kernel(b: &mut Intranode, v: LlVariant, name: &'static str) -> Result<Kernel> {
    let spec = if name == kernel_name::LL_COMBINE { LlVariant::combine_spec } else { LlVariant::dispatch_spec };
    b.kernel_of(v, name, spec)
}

fn variant_of(b: &Intranode, s: &LlSpec) -> LlVariant {
    variant_key(s, b.tuning.ll_experiment)
}

fn variant_key(s: &LlSpec, experiment: u32) -> LlVariant {
    LlVariant { experiment, ..LlVariant::new(s.hidden as u32, s.topk as u32, s.quant.is_fp8()) }
}

/// The layout for `s`, after checking the kernels' limits and that the region holds it (`with_staging`:
/// the zero-copy buffer too).
fn layout_for(b: &Intranode, s: &LlSpec, with_staging: bool) -> Result<LlLayout> {
    checked_layout(b.num_rdma_bytes, s, with_staging)
}

/// `num_rdma_bytes` a buffer needs for low-latency calls of this shape (see [`LlLayout::bytes_hint`]).
pub(crate) fn bytes_needed(num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_ranks: usize, num_experts: usize) -> usize {
    LlLayout::bytes_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).unwrap_or(usize::MAX)
}

/// Blocks per low-latency launch: one per SM of this rank's share of the GPU, or `Tuning::ll_sms` (at most
/// that).
fn grid_size(b: &Intranode) -> u32 {
    let sms = b.num_rank_sms();
    b.tuning.ll_sms.map_or(sms, |n| n.clamp(1, sms)) as u32
}

/// Addresses shared by both argument structs: every rank's `LlCtrl`, and every rank's copy of the region
/// at `offset` of the low-latency data region.
fn tables(b: &Intranode, offset: usize) -> (DevPtrs<MAX_RANKS>, DevPtrs<MAX_RANKS>) {
    (b.peer_table(ctrl::LL), b.peer_table(ll_data_offset(b) + offset))
}

/// The handle area of `set` on this rank: (hrow, hweight, hmeta, home_idx, home_weight).
fn handle_area(b: &Intranode, layout: &LlLayout, set: usize) -> Result<[DevPtr; 5]> {
    let base = b.peer_addr(b.rank, ll_data_offset(b) + layout.handle_at[set])?;
    let h = layout.handle;
    Ok([base, base.byte_add(h.hweight), base.byte_add(h.hmeta), base.byte_add(h.home_idx), base.byte_add(h.home_weight)])
}

// ------------------------------------------------------------------ timing trace

/// The trace address of kernel family `family` (0 dispatch, 1 combine) for a launch, or null when tracing
/// is off.
fn trace_ptr(b: &mut Intranode, family: usize) -> Result<DevPtr> {
    let (enabled, max_blocks) = (b.tracing.low_latency, b.num_device_sms());
    b.ll.trace.ptr(&b.gpu.device, enabled, max_blocks, family)
}

/// The traces of every low-latency launch since the trace was last cleared (empty when tracing is off).
/// Called once the timed region's work has completed.
pub(crate) fn trace_summaries(b: &Intranode) -> Vec<crate::trace::KernelTrace> {
    b.ll.trace.summaries(b.num_device_sms(), grid_size(b) as usize, [kernel_name::LL_DISPATCH, kernel_name::LL_COMBINE])
}

// ------------------------------------------------------------------ reports, drains

/// Publishes the consumed flags of receive phases whose hooks were dropped unrun, so that the peers may
/// write those buffer sets again.
fn drain_abandoned(b: &mut Intranode) -> Result<()> {
    let cfg = LaunchConfig::linear(1, LL_THREADS);
    for drain in b.ll.calls.take_dropped() {
        match drain {
            Drain::Dispatch(v, mut a) => {
                a.phases = phase::DRAIN;
                let k = ll_kernel(b, v, kernel_name::LL_DISPATCH)?;
                b.launch(&k, &cfg, &a)?;
            }
            Drain::Combine(v, mut a) => {
                a.phases = phase::DRAIN;
                let k = ll_kernel(b, v, kernel_name::LL_COMBINE)?;
                b.launch(&k, &cfg, &a)?;
            }
        }
    }
    Ok(())
}

/// What every low-latency call does first: drain dropped hooks, surface a report left by an earlier
/// asynchronous call.
fn begin_call(b: &mut Intranode) -> Result<()> {
    drain_abandoned(b)?;
    take_report(b, None)
}

/// Reads and clears what the kernels reported (`local`: a problem this rank found on the host).
fn take_report(b: &mut Intranode, local: Option<(&'static str, String)>) -> Result<()> {
    let rank = b.gpu.rank;
    b.ll.calls.take_report(rank, local)
}

// ------------------------------------------------------------------ dispatch

pub(crate) fn dispatch<'a>(
    b: &mut Intranode,
    s: LlSpec,
    a: &DispatchArgs<'_>,
    out: LlDispatchOutputs<'a>,
) -> Result<(Arc<BackendData>, Option<PendingRecv<'a>>)> {
    let layout = layout_for(b, &s, false)?;
    begin_call(b)?;
    let variant = variant_of(b, &s);
    let kernel = ll_kernel(b, variant, kernel_name::LL_DISPATCH)?;
    let set = (b.ll.calls.dispatch_calls & 1) as usize;
    let generation = b.ll.calls.dispatch_calls;
    let (error_claim, error_record) = b.error_sink();
    let (ctrl_table, recv_table) = tables(b, layout.dispatch_at[set]);
    let [hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, set)?;
    let args = LlDispatchArgs {
        ctrl: ctrl_table,
        recv: recv_table,
        x: a.x.device_ptr(),
        topk_idx: a.topk_idx.device_ptr(),
        topk_weights: a.topk_weights.map_or(DevPtr::NULL, |w| w.device_ptr()),
        recv_x: out.recv_x.device_ptr(),
        recv_scales: opt_addr(out.recv_scales.as_ref()),
        recv_count: out.recv_count.device_ptr(),
        cum_stats: opt_addr(out.cumulative_local_expert_recv_stats.as_ref()),
        wait_stats: opt_addr(out.dispatch_wait_recv_cost_stats.as_ref()),
        src_info: opt_addr(out.src_info.as_ref()),
        layout_range: opt_addr(out.layout_range.as_ref()),
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.ll.calls.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        trace: trace_ptr(b, 0)?,
        off_entries: layout.dispatch.entries as u64,
        off_weights: layout.dispatch.weights as u64,
        off_rows: layout.dispatch.rows as u64,
        off_counts: layout.dispatch.counts as u64,
        row_stride: layout.dispatch.row_stride as u32,
        rank: s.rank as u32,
        num_ranks: s.num_ranks as u32,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: b.ll.calls.flags(&s),
        host_problem: 0,
        pad: 0,
        sig: signature(&s),
    };
    let grid = grid_size(b);
    b.ll.calls.dispatch_calls += 1;
    let marker: HookMarker = Arc::new(AtomicU8::new(if s.return_recv_hook { HOOK_PENDING } else { HOOK_RAN }));
    let routing = Arc::new(BackendData::new(INTRANODE, CudaLlRouting { set, generation, recv: marker.clone() }));
    if s.return_recv_hook {
        let send = LlDispatchArgs { phases: phase::SEND, ..args };
        let recv = LlDispatchArgs { phases: phase::RECV, ..args };
        b.ll.calls.hand_out(marker.clone(), Drain::Dispatch(variant, recv));
        let pending = PendingDispatch(Pending::new(recv, variant, marker, out));
        b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS), &send)?;
        b.finish(Phase::LowLatencyDispatch)?;
        take_report(b, None)?;
        Ok((routing, Some(PendingRecv::new(pending))))
    } else {
        b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS).with_cooperative(), &args)?;
        b.finish(Phase::LowLatencyDispatch)?;
        take_report(b, None)?;
        Ok((routing, None))
    }
}

/// The receive phase of a hooked dispatch.
fn finish_dispatch(b: &mut Intranode, p: PendingDispatch<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    drain_abandoned(b)?;
    let kernel = ll_kernel(b, p.variant, kernel_name::LL_DISPATCH)?;
    let grid = grid_size(b);
    b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS), &p.args)?;
    b.finish(Phase::LowLatencyDispatch)?;
    take_report(b, None)
}

// ------------------------------------------------------------------ combine

pub(crate) fn combine<'a>(
    b: &mut Intranode,
    cs: LlCombineSpec,
    a: &CombineArgs<'_>,
    out: LlCombineOutputs<'a>,
) -> Result<Option<PendingRecv<'a>>> {
    let s = cs.ll;
    let me = s.rank;
    let routing = a.handle.data.get::<CudaLlRouting>("handle", me, INTRANODE)?;
    let layout = layout_for(b, &s, false)?;
    begin_call(b)?;

    let (mut host_problem, mut local) = b.ll.calls.handle_problems(routing);
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    let y = if cs.zero_copy {
        if b.ll.calls.staging != Some(shape) || layout_for(b, &s, true).is_err() {
            host_problem |= problem::ZERO_COPY;
            local.get_or_insert(("zero_copy", problem_reason(problem::ZERO_COPY).1.to_string()));
            DevPtr::NULL
        } else {
            b.peer_addr(b.rank, ll_data_offset(b) + layout.staging_at)?
        }
    } else {
        a.x.device_ptr()
    };

    let variant = variant_of(b, &s);
    let kernel = ll_kernel(b, variant, kernel_name::LL_COMBINE)?;
    let set = (b.ll.calls.combine_calls & 1) as usize;
    let (error_claim, error_record) = b.error_sink();
    let (ctrl_table, recv_table) = tables(b, layout.combine_at[set]);
    let [hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, routing.set)?;
    let args = LlCombineArgs {
        ctrl: ctrl_table,
        recv: recv_table,
        y,
        topk_idx: a.topk_idx.device_ptr(),
        topk_weights: a.topk_weights.device_ptr(),
        out: out.combined_x.device_ptr(),
        wait_stats: opt_addr(out.combine_wait_recv_cost_stats.as_ref()),
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.ll.calls.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        trace: trace_ptr(b, 1)?,
        rank: s.rank as u32,
        num_ranks: s.num_ranks as u32,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: b.ll.calls.flags(&s),
        host_problem,
        pad: [0; 2],
    };
    let grid = grid_size(b);
    b.ll.calls.combine_calls += 1;
    if cs.return_recv_hook {
        let send = LlCombineArgs { phases: phase::SEND, ..args };
        let recv = LlCombineArgs { phases: phase::RECV, ..args };
        let marker: HookMarker = Arc::new(AtomicU8::new(HOOK_PENDING));
        b.ll.calls.hand_out(marker.clone(), Drain::Combine(variant, recv));
        let pending = PendingCombine(Pending::new(recv, variant, marker, out));
        b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS), &send)?;
        b.finish(Phase::LowLatencyCombine)?;
        take_report(b, local)?;
        Ok(Some(PendingRecv::new(pending)))
    } else {
        b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS).with_cooperative(), &args)?;
        b.finish(Phase::LowLatencyCombine)?;
        take_report(b, local)?;
        Ok(None)
    }
}

/// The receive phase of a hooked combine.
fn finish_combine(b: &mut Intranode, p: PendingCombine<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    drain_abandoned(b)?;
    let kernel = ll_kernel(b, p.variant, kernel_name::LL_COMBINE)?;
    let grid = grid_size(b);
    b.launch(&kernel, &LaunchConfig::linear(grid, LL_THREADS), &p.args)?;
    b.finish(Phase::LowLatencyCombine)?;
    take_report(b, None)
}

impl RecvPhase for PendingDispatch<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_dispatch(backend_of::<Intranode>(backend, rank, INTRANODE)?, *self)
    }
}

impl RecvPhase for PendingCombine<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_combine(backend_of::<Intranode>(backend, rank, INTRANODE)?, *self)
    }
}

// ------------------------------------------------------------------ zero-copy buffer, clean, masks

/// The zero-copy combine buffer for `s`'s shape: `bf16 [E_local, R*T_max, H]` inside this rank's
/// low-latency region (local memory; peers never write it). Combine with `zero_copy` reads it in place of
/// `x`.
pub(crate) fn next_combine_buffer<'b>(b: &'b mut Intranode, s: &LlSpec) -> Result<TensorMut<'b>> {
    let layout = layout_for(b, s, true)?;
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    b.ll.calls.staging = Some(shape);
    let offset = ll_data_offset(b) + layout.staging_at;
    let strides = [(shape[1] * shape[2]) as isize, shape[2] as isize, 1];
    // Inside this rank's symmetric buffer (layout_for checked the region holds it); only combine (a later
    // call, which needs the backend again) reads it.
    let span = b.gpu.sym.local_mut().span_mut(offset, shape.iter().product::<usize>() * DType::BF16.size_bytes())?;
    TensorMut::from_memory(span, DType::BF16, &shape, &strides)
}

/// `clean_low_latency_buffer`: resets the low-latency control area on every rank (collective): a barrier
/// (no call in flight anywhere), zero the epochs, counters, flags and metadata (not the masks), a barrier.
pub(crate) fn clean(b: &mut Intranode, _t: usize, _h: usize, _e: usize) -> Result<()> {
    b.gpu.nvlink_barrier()?;
    // The control area up to the masks; the barrier above ordered every earlier kernel (ours and the peers'
    // writes into it) before the memset on the operation stream.
    b.gpu.zero_symmetric(ctrl::LL, LlCtrl::MASK_OFFSET)?;
    b.gpu.nvlink_barrier()?;
    b.ll.calls.forget();
    Ok(())
}

fn mask_offset(rank: usize) -> usize {
    ctrl::LL + LlCtrl::MASK_OFFSET + 4 * rank
}

// The mask words are read by this rank's kernels: reads and writes are ordered after this rank's earlier
// operations on the operation stream (a caller's stream in asynchronous mode), and complete on return.

pub(crate) fn set_mask(b: &mut Intranode, rank: usize, masked: bool) -> Result<()> {
    write_mask_words(b, mask_offset(rank), &u32::from(masked).to_le_bytes())
}

pub(crate) fn mask(b: &mut Intranode) -> Result<Vec<bool>> {
    let mut bytes = vec![0u8; 4 * b.num_ranks];
    b.gpu.read_local_words(mask_offset(0), &mut bytes)?;
    Ok(bytes.chunks_exact(4).map(|w| w != [0, 0, 0, 0]).collect())
}

pub(crate) fn clear_mask(b: &mut Intranode) -> Result<()> {
    write_mask_words(b, mask_offset(0), &vec![0u8; 4 * b.num_ranks])
}

fn write_mask_words(b: &mut Intranode, offset: usize, bytes: &[u8]) -> Result<()> {
    b.gpu.write_local_words(offset, bytes)
}

#[cfg(test)]
mod tests {
    use super::super::super::ll_shared::tests::spec;
    use super::*;
    use crate::error::Error;
    use crate::ll::LlQuant;

    #[test]
    fn variant_follows_the_spec() {
        let v = LlVariant::new(7168, 8, true);
        assert_eq!(v.experiment, 0);
        assert_eq!(variant_key(&spec(LlQuant::Fp8 { round_scale: false, use_ue8m0: false }, false), 0), v);
        assert!(!variant_key(&spec(LlQuant::Bf16, true), 0).fp8);
        assert_eq!(variant_key(&spec(LlQuant::Bf16, true), 4).experiment, 4, "the experiment is part of the key");
    }

    #[test]
    fn capacity_is_checked_before_launch() {
        let s = spec(LlQuant::Fp8 { round_scale: false, use_ue8m0: false }, true);
        let l = LlLayout::new(4, 128, 7168, 8, 288).unwrap();
        assert_eq!(checked_layout(l.bytes_without_staging, &s, false).unwrap(), l);
        match checked_layout(l.bytes_without_staging - 1, &s, false) {
            Err(Error::BufferTooSmall { rank: 1, needed, available, hint, .. }) => {
                assert_eq!((needed, available), (l.bytes_without_staging, l.bytes_without_staging - 1));
                assert!(hint.contains("ll_bytes_needed(128, 7168, 4, 288)"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
        // The zero-copy buffer needs the whole layout.
        assert!(matches!(checked_layout(l.bytes - 1, &s, true), Err(Error::BufferTooSmall { .. })));
        assert!(checked_layout(l.bytes, &s, true).is_ok());
        assert!(checked_layout(bytes_needed(128, 7168, 4, 288), &s, true).is_ok(), "the hint is enough");
        // Kernel limits come first, naming the argument.
        let big = LlSpec { topk: 33, ..s };
        assert_eq!(checked_layout(usize::MAX, &big, false).unwrap_err().argument(), Some("topk_idx"));
    }

    #[test]
    fn bytes_needed_covers_the_layout_with_staging() {
        let need = bytes_needed(128, 7168, 4, 288);
        let l = LlLayout::new(4, 128, 7168, 8, 288).unwrap();
        assert!(need >= l.bytes);
        assert_eq!(bytes_needed(usize::MAX / 2, 7168, 8, 288), usize::MAX, "overflow saturates");
    }
}
