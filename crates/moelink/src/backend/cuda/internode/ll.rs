//! Low-latency dispatch/combine when the ranks span nodes: the host side of
//! `moelink-kernels/cuda/lli_dispatch.cu` and `lli_combine.cu` (over `lli.cuh`). The calls, hooks, buffer
//! sets, drains and reports are the single-node ones (`super::super::ll_shared`); what differs is where things live — the RDMA region
//! ([`LliLayout`], after the internode control words), a local state and handle area in device memory —
//! and the launch, which adds the emulated NIC's blocks when the transport is `emu-nic`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use moelink_cuda::{DevPtr, DeviceBuffer, KernelParams, LaunchConfig};
use moelink_kernels::kernel_name;
use moelink_kernels::ll::{phase, problem, LlVariant};
use moelink_kernels::ll_internode::{check_limits, LliCombineArgs, LliDispatchArgs, LliLayout, LliVariant, LLI_THREADS};

use super::super::gpu::Gpu;
use super::super::ll_shared::{
    opt_addr, problem_reason, signature, CudaLlRouting, HookMarker, LlCalls, LlTrace, Pending, HOOK_PENDING, HOOK_RAN,
};
use super::{Internode, INTERNODE, RDMA_CTRL_BYTES};
use crate::backend::{BackendData, PendingRecv};
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::ll::{LlCombineArgs as CombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs as DispatchArgs, LlDispatchOutputs, LlSpec};
use crate::opaque::{backend_of, RecvPhase};
use crate::tensor::TensorMut;

/// The internode low-latency state of a buffer: the local state words and the handle areas of both sets.
pub(crate) struct LliState {
    /// `LliState` + expected / decision / mask arrays (zeroed at creation and by clean, masks kept).
    state: DeviceBuffer,
    /// Handle areas of sets 0 and 1 for the largest shape seen (`bytes` each).
    handles: Option<(DeviceBuffer, usize)>,
    /// Smaller handle areas a larger shape replaced: a captured graph may still address them, so they stay
    /// until the buffer goes (`Gpu::replay`).
    retired_handles: Vec<DeviceBuffer>,
    pub(crate) calls: LlCalls<Drain>,
    /// Timing trace words (`KernelTracing::low_latency`).
    pub(crate) trace: LlTrace,
}

/// The receive launch a dropped hook stands for.
pub(crate) enum Drain {
    Dispatch(LliVariant, LliDispatchArgs),
    Combine(LliVariant, LliCombineArgs),
}

impl LliState {
    pub(crate) fn new(gpu: &Gpu, enable_shrink: bool) -> Result<LliState> {
        let bytes = moelink_kernels::ll_internode::LLI_STATE_HEAD + 44 * gpu.num_ranks;
        Ok(LliState {
            state: DeviceBuffer::zeroed(&gpu.device, bytes)?,
            handles: None,
            retired_handles: Vec::new(),
            calls: LlCalls::new(&gpu.device, enable_shrink)?,
            trace: LlTrace::new(),
        })
    }
}

fn variant(b: &Internode, s: &LlSpec) -> LliVariant {
    LliVariant { ll: LlVariant::new(s.hidden as u32, s.topk as u32, s.quant.is_fp8()), transport: b.rdma.transport().kernel_transport() }
}

/// The layout for `s` after the kernels' limits and the region's size are checked.
fn layout_for(b: &Internode, s: &LlSpec) -> Result<LliLayout> {
    check_limits(s.num_ranks, s.num_max_tokens, s.topk, s.num_experts).map_err(|(arg, why)| Error::invalid(arg, s.rank, why))?;
    let layout = LliLayout::new(RDMA_CTRL_BYTES, s.num_ranks, s.num_max_tokens, s.hidden, s.topk, s.num_experts, s.quant.is_fp8())
        .ok_or_else(|| {
            Error::invalid("num_max_dispatch_tokens_per_rank", s.rank, "the low-latency buffer size overflows for this shape")
        })?;
    let needed = layout.end - RDMA_CTRL_BYTES;
    if needed > b.num_rdma_bytes {
        return Err(Error::BufferTooSmall {
            rank: s.rank,
            what: "internode low-latency region (num_rdma_bytes)",
            needed,
            available: b.num_rdma_bytes,
            hint: format!(
                "create the Buffer with num_rdma_bytes >= Buffer::ll_bytes_needed({}, {}, {}, {})",
                s.num_max_tokens, s.hidden, s.num_ranks, s.num_experts
            ),
        });
    }
    Ok(layout)
}

/// `num_rdma_bytes` the internode kernels need for this shape, for top-k up to 16 and either payload.
pub(crate) fn bytes_needed(max_tokens: usize, hidden: usize, num_ranks: usize, num_experts: usize) -> usize {
    LliLayout::new(RDMA_CTRL_BYTES, num_ranks, max_tokens, hidden, moelink_kernels::ll::LL_HINT_TOPK, num_experts, false)
        .map_or(usize::MAX, |l| l.end - RDMA_CTRL_BYTES)
}

/// Device addresses of set `set`'s handle area: (htoken, hj, hrow, hweight, hmeta, home_idx, home_weight).
fn handle_area(b: &mut Internode, layout: &LliLayout, set: usize) -> Result<[DevPtr; 7]> {
    let h = layout.handle;
    let lli = &mut b.lli;
    if lli.handles.as_ref().is_none_or(|(_, per_set)| *per_set < h.bytes) {
        let grown = (DeviceBuffer::zeroed(&b.gpu.device, 2 * h.bytes)?, h.bytes);
        if let Some((old, _)) = lli.handles.replace(grown) {
            lli.retired_handles.push(old);
        }
    }
    let (buf, per_set) = lli.handles.as_ref().expect("allocated above");
    let base = buf.ptr_at(set * per_set)?;
    let at = |o: usize| base.byte_add(o);
    Ok([at(h.htoken), at(h.hj), at(h.hrow), at(h.hweight), at(h.hmeta), at(h.home_idx), at(h.home_weight)])
}

/// The launch shape: this rank's share of the GPU in worker blocks, plus the emulated NIC's blocks (all
/// co-resident: a cooperative launch when both phases run in one).
fn grid(b: &Internode) -> (u32, u32) {
    let nic = b.rdma.nic_blocks();
    let share = b.num_rank_sms() as u32;
    (share.saturating_sub(nic).max(1), nic)
}

fn launch<A: KernelParams>(b: &mut Internode, v: &LliVariant, name: &'static str, args: &A, cooperative: bool) -> Result<()> {
    let spec = if name == kernel_name::LLI_COMBINE { LliVariant::combine_spec } else { LliVariant::dispatch_spec };
    let k = b.kernel_of(*v, name, spec)?;
    let (workers, nic) = grid(b);
    let mut cfg = LaunchConfig::linear(workers + nic, LLI_THREADS);
    // The emulated NIC must run beside the workers even when a phase runs alone.
    if cooperative || nic > 0 {
        cfg = cfg.with_cooperative();
    }
    b.launch(&k, &cfg, args)
}

/// The trace address of kernel family `family` (0 dispatch, 1 combine) for a launch, or null when tracing
/// is off.
fn trace_ptr(b: &mut Internode, family: usize) -> Result<DevPtr> {
    let (enabled, max_blocks) = (b.tracing.low_latency, b.num_device_sms());
    b.lli.trace.ptr(&b.gpu.device, enabled, max_blocks, family)
}

/// The traces of every low-latency launch since the trace was last cleared (empty when tracing is off).
/// Called once the timed region's work has completed.
pub(crate) fn trace_summaries(b: &Internode) -> Vec<crate::trace::KernelTrace> {
    let (workers, nic) = grid(b);
    let blocks = (workers + nic) as usize;
    b.lli.trace.summaries(b.num_device_sms(), blocks, [kernel_name::LLI_DISPATCH, kernel_name::LLI_COMBINE])
}

/// Publishes the consumed flags of receive phases whose hooks were dropped unrun (only the hand-back runs),
/// so that the peers may write those buffer sets again.
fn drain_abandoned(b: &mut Internode) -> Result<()> {
    for drain in b.lli.calls.take_dropped() {
        match drain {
            Drain::Dispatch(v, a) => launch(b, &v, kernel_name::LLI_DISPATCH, &LliDispatchArgs { phases: phase::DRAIN, ..a }, false)?,
            Drain::Combine(v, a) => launch(b, &v, kernel_name::LLI_COMBINE, &LliCombineArgs { phases: phase::DRAIN, ..a }, false)?,
        }
    }
    Ok(())
}

/// What every low-latency call does first: drain dropped hooks, surface a report left by an earlier
/// asynchronous call.
fn begin_call(b: &mut Internode) -> Result<()> {
    drain_abandoned(b)?;
    take_report(b, None)
}

/// Reads and clears what the kernels reported (`local`: a problem this rank found on the host).
fn take_report(b: &mut Internode, local: Option<(&'static str, String)>) -> Result<()> {
    let rank = b.gpu.rank;
    b.lli.calls.take_report(rank, local)
}

/// A hooked internode receive phase.
pub(crate) struct PendingDispatch<'a>(Pending<LliDispatchArgs, LlDispatchOutputs<'a>, LliVariant>);
/// A hooked internode combine's receive phase.
pub(crate) struct PendingCombine<'a>(Pending<LliCombineArgs, LlCombineOutputs<'a>, LliVariant>);

impl RecvPhase for PendingDispatch<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_dispatch(backend_of::<Internode>(backend, rank, INTERNODE)?, *self)
    }
}

impl RecvPhase for PendingCombine<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_combine(backend_of::<Internode>(backend, rank, INTERNODE)?, *self)
    }
}

pub(crate) fn dispatch<'a>(
    b: &mut Internode,
    s: LlSpec,
    a: &DispatchArgs<'_>,
    out: LlDispatchOutputs<'a>,
) -> Result<(Arc<BackendData>, Option<PendingRecv<'a>>)> {
    let layout = layout_for(b, &s)?;
    begin_call(b)?;
    let v = variant(b, &s);
    let set = (b.lli.calls.dispatch_calls & 1) as usize;
    let generation = b.lli.calls.dispatch_calls;
    let (error_claim, error_record) = b.error_sink();
    let [htoken, hj, hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, set)?;
    let ls = layout.dispatch[set];
    let args = LliDispatchArgs {
        rdma: b.rdma_args(),
        state: b.lli.state.device_ptr(),
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
        htoken,
        hj,
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.lli.calls.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        off_meta_sig: ls.meta_sig as u64,
        off_data_sig: ls.data_sig as u64,
        off_consumed: ls.consumed as u64,
        off_meta: ls.meta as u64,
        off_msgs: ls.data as u64,
        off_send_meta: ls.send_meta as u64,
        off_send_msgs: ls.send_data as u64,
        trace: trace_ptr(b, 0)?,
        meta_bytes: layout.meta_bytes as u32,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: b.lli.calls.flags(&s),
        host_problem: 0,
        pad: 0,
        sig: signature(&s),
    };
    b.lli.calls.dispatch_calls += 1;
    let marker: HookMarker = Arc::new(AtomicU8::new(if s.return_recv_hook { HOOK_PENDING } else { HOOK_RAN }));
    let routing = Arc::new(BackendData::new(INTERNODE, CudaLlRouting { set, generation, recv: marker.clone() }));
    if s.return_recv_hook {
        let send = LliDispatchArgs { phases: phase::SEND, ..args };
        let recv = LliDispatchArgs { phases: phase::RECV, ..args };
        b.lli.calls.hand_out(marker.clone(), Drain::Dispatch(v, recv));
        let pending = PendingDispatch(Pending::new(recv, v, marker, out));
        launch(b, &v, kernel_name::LLI_DISPATCH, &send, false)?;
        b.finish(Phase::LowLatencyDispatch)?;
        take_report(b, None)?;
        Ok((routing, Some(PendingRecv::new(pending))))
    } else {
        launch(b, &v, kernel_name::LLI_DISPATCH, &args, true)?;
        b.finish(Phase::LowLatencyDispatch)?;
        take_report(b, None)?;
        Ok((routing, None))
    }
}

fn finish_dispatch(b: &mut Internode, p: PendingDispatch<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    drain_abandoned(b)?;
    launch(b, &p.variant, kernel_name::LLI_DISPATCH, &p.args, false)?;
    b.finish(Phase::LowLatencyDispatch)?;
    take_report(b, None)
}

pub(crate) fn combine<'a>(
    b: &mut Internode,
    cs: LlCombineSpec,
    a: &CombineArgs<'_>,
    out: LlCombineOutputs<'a>,
) -> Result<Option<PendingRecv<'a>>> {
    let s = cs.ll;
    let me = s.rank;
    let routing = a.handle.data.get::<CudaLlRouting>("handle", me, INTERNODE)?;
    let layout = layout_for(b, &s)?;
    begin_call(b)?;
    let (mut host_problem, mut local) = b.lli.calls.handle_problems(routing);
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    let zero_copy_addr = b.rdma.local_base().byte_add(layout.zero_copy);
    let (y, y_is_zero_copy) = if cs.zero_copy {
        if b.lli.calls.staging != Some(shape) {
            host_problem |= problem::ZERO_COPY;
            local.get_or_insert(("zero_copy", problem_reason(problem::ZERO_COPY).1.to_string()));
            (DevPtr::NULL, 0)
        } else {
            (zero_copy_addr, 1)
        }
    } else {
        (a.x.device_ptr(), 0)
    };
    let v = variant(b, &s);
    let set = (b.lli.calls.combine_calls & 1) as usize;
    let (error_claim, error_record) = b.error_sink();
    let [htoken, hj, hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, routing.set)?;
    let ls = layout.combine[set];
    let args = LliCombineArgs {
        rdma: b.rdma_args(),
        state: b.lli.state.device_ptr(),
        y,
        topk_idx: a.topk_idx.device_ptr(),
        topk_weights: a.topk_weights.device_ptr(),
        out: out.combined_x.device_ptr(),
        wait_stats: opt_addr(out.combine_wait_recv_cost_stats.as_ref()),
        htoken,
        hj,
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.lli.calls.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        off_meta_sig: ls.meta_sig as u64,
        off_data_sig: ls.data_sig as u64,
        off_consumed: ls.consumed as u64,
        off_meta: ls.meta as u64,
        off_rows: ls.data as u64,
        off_send_meta: ls.send_meta as u64,
        off_send_rows: ls.send_data as u64,
        off_zero_copy: layout.zero_copy as u64,
        trace: trace_ptr(b, 1)?,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: b.lli.calls.flags(&s),
        host_problem,
        y_is_zero_copy,
        pad: [0; 3],
    };
    b.lli.calls.combine_calls += 1;
    if cs.return_recv_hook {
        let send = LliCombineArgs { phases: phase::SEND, ..args };
        let recv = LliCombineArgs { phases: phase::RECV, ..args };
        let marker: HookMarker = Arc::new(AtomicU8::new(HOOK_PENDING));
        b.lli.calls.hand_out(marker.clone(), Drain::Combine(v, recv));
        let pending = PendingCombine(Pending::new(recv, v, marker, out));
        launch(b, &v, kernel_name::LLI_COMBINE, &send, false)?;
        b.finish(Phase::LowLatencyCombine)?;
        take_report(b, local)?;
        Ok(Some(PendingRecv::new(pending)))
    } else {
        launch(b, &v, kernel_name::LLI_COMBINE, &args, true)?;
        b.finish(Phase::LowLatencyCombine)?;
        take_report(b, local)?;
        Ok(None)
    }
}

fn finish_combine(b: &mut Internode, p: PendingCombine<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    drain_abandoned(b)?;
    launch(b, &p.variant, kernel_name::LLI_COMBINE, &p.args, false)?;
    b.finish(Phase::LowLatencyCombine)?;
    take_report(b, None)
}

/// The zero-copy combine buffer `bf16 [E_local, R*T_max, H]`, inside this rank's RDMA region (per-expert
/// rows are put straight from it).
pub(crate) fn next_combine_buffer<'b>(b: &'b mut Internode, s: &LlSpec) -> Result<TensorMut<'b>> {
    let layout = layout_for(b, s)?;
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    b.lli.calls.staging = Some(shape);
    let strides = [(shape[1] * shape[2]) as isize, shape[2] as isize, 1];
    // Inside this rank's RDMA region (layout_for checked its end against num_rdma_bytes).
    let bytes = shape.iter().product::<usize>() * DType::BF16.size_bytes();
    let span = b.rdma.local_span_mut(&b.gpu.device, layout.zero_copy, bytes)?;
    TensorMut::from_memory(span, DType::BF16, &shape, &strides)
}

/// `clean_low_latency_buffer` across nodes (collective): a barrier, zero the signal words of the RDMA
/// region and the local state (masks kept), a barrier.
pub(crate) fn clean(b: &mut Internode, t: usize, h: usize, e: usize) -> Result<()> {
    let topk = moelink_kernels::ll::LL_HINT_TOPK;
    let layout = LliLayout::new(RDMA_CTRL_BYTES, b.num_ranks, t, h, topk, e, false).ok_or_else(|| {
        Error::invalid("num_max_dispatch_tokens_per_rank", b.rank, "the low-latency buffer size overflows for this shape")
    })?;
    b.rdma_barrier()?;
    let mask_at = moelink_kernels::ll_internode::LLI_STATE_HEAD + 40 * b.num_ranks;
    // The barrier ordered every kernel that writes these words before the memsets on the operation stream.
    let Internode { rdma, lli, gpu, .. } = b;
    if layout.signals_end - RDMA_CTRL_BYTES <= gpu.num_rdma_bytes {
        rdma.local_span_mut(&gpu.device, layout.signals, layout.signals_end - layout.signals)?.memset_u8_async(0, gpu.op_stream())?;
    }
    // The state words before the masks, which stay.
    lli.state.span_mut(0, mask_at)?.memset_u8_async(0, gpu.op_stream())?;
    b.rdma_barrier()?;
    b.lli.calls.forget();
    Ok(())
}

fn mask_offset(b: &Internode, rank: usize) -> usize {
    moelink_kernels::ll_internode::LLI_STATE_HEAD + 40 * b.num_ranks + 4 * rank
}

// The mask words are read by this rank's kernels: reads and writes are ordered after this rank's earlier
// operations on the operation stream, and complete on return.

fn write_mask_words(b: &mut Internode, offset: usize, bytes: &[u8]) -> Result<()> {
    b.gpu.write_words(&mut b.lli.state, offset, bytes)
}

pub(crate) fn set_mask(b: &mut Internode, rank: usize, masked: bool) -> Result<()> {
    let at = mask_offset(b, rank);
    write_mask_words(b, at, &u32::from(masked).to_le_bytes())
}

pub(crate) fn mask(b: &mut Internode) -> Result<Vec<bool>> {
    let mut bytes = vec![0u8; 4 * b.num_ranks];
    let at = mask_offset(b, 0);
    b.gpu.read_words(&b.lli.state, at, &mut bytes)?;
    Ok(bytes.chunks_exact(4).map(|w| w != [0, 0, 0, 0]).collect())
}

pub(crate) fn clear_mask(b: &mut Internode) -> Result<()> {
    let at = mask_offset(b, 0);
    let zeros = vec![0u8; 4 * b.num_ranks];
    write_mask_words(b, at, &zeros)
}
