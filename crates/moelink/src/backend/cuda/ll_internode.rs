//! Low-latency dispatch/combine when the ranks span nodes: the host side of
//! `moelink-kernels/cuda/lli_dispatch.cu` and `lli_combine.cu` (over `lli.cuh`). The calls, hooks, buffer
//! sets, drains and reports are the single-node ones (`super::ll`); what differs is where things live — the RDMA region
//! ([`LliLayout`], after the internode control words), a local state and handle area in device memory —
//! and the launch, which adds the emulated NIC's blocks when the transport is `emu-nic`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use moelink_cuda::{DeviceBuffer, LaunchConfig};
use moelink_kernels::kernel_name;
use moelink_kernels::ll::{phase, problem, LlVariant};
use moelink_kernels::ll_internode::{check_limits, LliCombineArgs, LliDispatchArgs, LliLayout, LliVariant, LLI_THREADS};

use super::internode::RDMA_CTRL_BYTES;
use super::ll::{self as intranode, Drain, HookMarker, Outstanding, HOOK_PENDING, HOOK_RAN};
use super::{CudaBackend, PendingRecv};
use crate::backend::{LlRouting, PendingRecv as AnyPending};
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::ll::{LlCombineArgs as CombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs as DispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Location, TensorMut};

/// The internode low-latency state of a buffer: the local state words and the handle areas of both sets.
pub(crate) struct LliState {
    /// `LliState` + expected / decision / mask arrays (zeroed at creation and by clean, masks kept).
    state: DeviceBuffer,
    /// Handle areas of sets 0 and 1 for the largest shape seen (`bytes` each).
    handles: Option<(DeviceBuffer, usize)>,
}

impl LliState {
    pub(crate) fn new(b: &CudaBackend) -> Result<LliState> {
        let bytes = moelink_kernels::ll_internode::LLI_STATE_HEAD + 44 * b.num_ranks;
        Ok(LliState { state: DeviceBuffer::zeroed(&b.device, bytes)?, handles: None })
    }
}

fn variant(b: &CudaBackend, s: &LlSpec) -> Result<LliVariant> {
    let transport = b
        .internode
        .as_ref()
        .map(|i| i.rdma.transport().kernel_transport())
        .ok_or_else(|| Error::invalid("topology", s.rank, "an internode low-latency call on a single-node buffer"))?;
    Ok(LliVariant { ll: LlVariant::new(s.hidden as u32, s.topk as u32, s.quant.is_fp8()), transport })
}

/// The layout for `s` after the kernels' limits and the region's size are checked.
fn layout_for(b: &CudaBackend, s: &LlSpec) -> Result<LliLayout> {
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
fn handle_area(b: &mut CudaBackend, layout: &LliLayout, set: usize) -> Result<[u64; 7]> {
    let h = layout.handle;
    let lli = &mut b.internode.as_mut().expect("internode buffer").lli;
    if lli.handles.as_ref().is_none_or(|(_, per_set)| *per_set < h.bytes) {
        lli.handles = Some((DeviceBuffer::zeroed(&b.device, 2 * h.bytes)?, h.bytes));
    }
    let (buf, per_set) = lli.handles.as_ref().expect("allocated above");
    let base = buf.device_ptr() + (set * per_set) as u64;
    let at = |o: usize| base + o as u64;
    Ok([at(h.htoken), at(h.hj), at(h.hrow), at(h.hweight), at(h.hmeta), at(h.home_idx), at(h.home_weight)])
}

/// The launch shape: this rank's share of the GPU in worker blocks, plus the emulated NIC's blocks (all
/// co-resident: a cooperative launch when both phases run in one).
fn grid(b: &CudaBackend) -> (u32, u32) {
    let nic = b.internode.as_ref().map_or(0, |i| i.rdma.nic_blocks());
    let share = b.num_rank_sms() as u32;
    (share.saturating_sub(nic).max(1), nic)
}

fn launch<A: bytemuck::Pod>(b: &mut CudaBackend, v: &LliVariant, name: &'static str, args: &A, cooperative: bool) -> Result<()> {
    let spec = if name == kernel_name::LLI_COMBINE { v.combine_spec() } else { v.dispatch_spec() };
    let k = b.kernel(&spec, name)?;
    let (workers, nic) = grid(b);
    let mut cfg = LaunchConfig::linear(workers + nic, LLI_THREADS);
    // The emulated NIC must run beside the workers even when a phase runs alone.
    if cooperative || nic > 0 {
        cfg = cfg.with_cooperative();
    }
    b.launch(&k, &cfg, args)
}

/// Launches the drain of a dropped internode receive phase (only the hand-back runs).
pub(super) fn drain(b: &mut CudaBackend, d: &Drain) -> Result<()> {
    match d {
        Drain::InternodeDispatch(v, a) => launch(b, v, kernel_name::LLI_DISPATCH, &LliDispatchArgs { phases: phase::DRAIN, ..*a }, false),
        Drain::InternodeCombine(v, a) => launch(b, v, kernel_name::LLI_COMBINE, &LliCombineArgs { phases: phase::DRAIN, ..*a }, false),
        _ => Ok(()),
    }
}

/// A hooked internode receive phase.
pub(crate) struct PendingDispatch<'a>(Box<intranode::Pending<LliDispatchArgs, LlDispatchOutputs<'a>, LliVariant>>);
/// A hooked internode combine's receive phase.
pub(crate) struct PendingCombine<'a>(Box<intranode::Pending<LliCombineArgs, LlCombineOutputs<'a>, LliVariant>>);

pub(crate) fn dispatch<'a>(
    b: &mut CudaBackend,
    s: LlSpec,
    a: &DispatchArgs<'_>,
    out: LlDispatchOutputs<'a>,
) -> Result<(Arc<LlRouting>, Option<AnyPending<'a>>)> {
    let layout = layout_for(b, &s)?;
    intranode::begin_call(b)?;
    let v = variant(b, &s)?;
    let set = (b.ll.dispatch_calls & 1) as usize;
    let generation = b.ll.dispatch_calls;
    let (error_claim, error_record) = b.error_sink();
    let [htoken, hj, hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, set)?;
    let inter = b.internode.as_ref().expect("internode buffer");
    let ls = layout.dispatch[set];
    let args = LliDispatchArgs {
        rdma: inter.rdma_args(),
        state: inter.lli.state.device_ptr(),
        x: a.x.addr(),
        topk_idx: a.topk_idx.addr(),
        topk_weights: a.topk_weights.map_or(0, |w| w.addr()),
        recv_x: out.recv_x.addr(),
        recv_scales: intranode::opt_addr(out.recv_scales.as_ref()),
        recv_count: out.recv_count.addr(),
        cum_stats: intranode::opt_addr(out.cumulative_local_expert_recv_stats.as_ref()),
        wait_stats: intranode::opt_addr(out.dispatch_wait_recv_cost_stats.as_ref()),
        src_info: intranode::opt_addr(out.src_info.as_ref()),
        layout_range: intranode::opt_addr(out.layout_range.as_ref()),
        htoken,
        hj,
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.ll.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        off_meta_sig: ls.meta_sig as u64,
        off_data_sig: ls.data_sig as u64,
        off_consumed: ls.consumed as u64,
        off_meta: ls.meta as u64,
        off_msgs: ls.data as u64,
        off_send_meta: ls.send_meta as u64,
        off_send_msgs: ls.send_data as u64,
        meta_bytes: layout.meta_bytes as u32,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: intranode::flags(b, &s),
        host_problem: 0,
        pad: 0,
        sig: intranode::signature(&s),
    };
    b.ll.dispatch_calls += 1;
    let marker: HookMarker = Arc::new(AtomicU8::new(if s.return_recv_hook { HOOK_PENDING } else { HOOK_RAN }));
    let routing = Arc::new(LlRouting::Cuda(intranode::CudaLlRouting { set, generation, recv: marker.clone() }));
    if s.return_recv_hook {
        let send = LliDispatchArgs { phases: phase::SEND, ..args };
        let recv = LliDispatchArgs { phases: phase::RECV, ..args };
        b.ll.outstanding.push(Outstanding::new(marker.clone(), Drain::InternodeDispatch(v, recv)));
        let pending = PendingDispatch(Box::new(intranode::Pending::new(recv, v, marker, out)));
        launch(b, &v, kernel_name::LLI_DISPATCH, &send, false)?;
        b.finish(Phase::LowLatencyDispatch)?;
        intranode::take_report(b, None)?;
        Ok((routing, Some(AnyPending::Cuda(PendingRecv::LliDispatch(pending)))))
    } else {
        launch(b, &v, kernel_name::LLI_DISPATCH, &args, true)?;
        b.finish(Phase::LowLatencyDispatch)?;
        intranode::take_report(b, None)?;
        Ok((routing, None))
    }
}

pub(crate) fn finish_dispatch(b: &mut CudaBackend, p: PendingDispatch<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    intranode::drain_abandoned(b)?;
    launch(b, &p.variant, kernel_name::LLI_DISPATCH, &p.args, false)?;
    b.finish(Phase::LowLatencyDispatch)?;
    intranode::take_report(b, None)
}

pub(crate) fn combine<'a>(
    b: &mut CudaBackend,
    cs: LlCombineSpec,
    a: &CombineArgs<'_>,
    out: LlCombineOutputs<'a>,
) -> Result<Option<AnyPending<'a>>> {
    let s = cs.ll;
    let me = s.rank;
    let routing = a.handle.data.cuda(me)?;
    let layout = layout_for(b, &s)?;
    intranode::begin_call(b)?;
    let (mut host_problem, mut local) = intranode::handle_problems(b, routing);
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    let zero_copy_addr = b.internode.as_ref().expect("internode buffer").rdma.local_base() + layout.zero_copy as u64;
    let (y, y_is_zero_copy) = if cs.zero_copy {
        if b.ll.staging != Some(shape) {
            host_problem |= problem::ZERO_COPY;
            local.get_or_insert(("zero_copy", intranode::problem_reason(problem::ZERO_COPY).1.to_string()));
            (0, 0)
        } else {
            (zero_copy_addr, 1)
        }
    } else {
        (a.x.addr(), 0)
    };
    let v = variant(b, &s)?;
    let set = (b.ll.combine_calls & 1) as usize;
    let (error_claim, error_record) = b.error_sink();
    let [htoken, hj, hrow, hweight, hmeta, home_idx, home_weight] = handle_area(b, &layout, routing.set)?;
    let inter = b.internode.as_ref().expect("internode buffer");
    let ls = layout.combine[set];
    let args = LliCombineArgs {
        rdma: inter.rdma_args(),
        state: inter.lli.state.device_ptr(),
        y,
        topk_idx: a.topk_idx.addr(),
        topk_weights: a.topk_weights.addr(),
        out: out.combined_x.addr(),
        wait_stats: intranode::opt_addr(out.combine_wait_recv_cost_stats.as_ref()),
        htoken,
        hj,
        hrow,
        hweight,
        hmeta,
        home_idx,
        home_weight,
        error_claim,
        error_record,
        report: b.ll.report.device_ptr(),
        timeout_ns: b.timeout_ns,
        off_meta_sig: ls.meta_sig as u64,
        off_data_sig: ls.data_sig as u64,
        off_consumed: ls.consumed as u64,
        off_meta: ls.meta as u64,
        off_rows: ls.data as u64,
        off_send_meta: ls.send_meta as u64,
        off_send_rows: ls.send_data as u64,
        off_zero_copy: layout.zero_copy as u64,
        num_tokens: s.num_tokens as u32,
        max_tokens: s.num_max_tokens as u32,
        num_experts: s.num_experts as u32,
        num_local_experts: s.num_local_experts() as u32,
        set: set as u32,
        phases: phase::SEND | phase::RECV,
        flags: intranode::flags(b, &s),
        host_problem,
        y_is_zero_copy,
        pad: [0; 3],
    };
    b.ll.combine_calls += 1;
    if cs.return_recv_hook {
        let send = LliCombineArgs { phases: phase::SEND, ..args };
        let recv = LliCombineArgs { phases: phase::RECV, ..args };
        let marker: HookMarker = Arc::new(AtomicU8::new(HOOK_PENDING));
        b.ll.outstanding.push(Outstanding::new(marker.clone(), Drain::InternodeCombine(v, recv)));
        let pending = PendingCombine(Box::new(intranode::Pending::new(recv, v, marker, out)));
        launch(b, &v, kernel_name::LLI_COMBINE, &send, false)?;
        b.finish(Phase::LowLatencyCombine)?;
        intranode::take_report(b, local)?;
        Ok(Some(AnyPending::Cuda(PendingRecv::LliCombine(pending))))
    } else {
        launch(b, &v, kernel_name::LLI_COMBINE, &args, true)?;
        b.finish(Phase::LowLatencyCombine)?;
        intranode::take_report(b, local)?;
        Ok(None)
    }
}

pub(crate) fn finish_combine(b: &mut CudaBackend, p: PendingCombine<'_>) -> Result<()> {
    let p = &p.0;
    p.marker.store(HOOK_RAN, Ordering::Release);
    intranode::drain_abandoned(b)?;
    launch(b, &p.variant, kernel_name::LLI_COMBINE, &p.args, false)?;
    b.finish(Phase::LowLatencyCombine)?;
    intranode::take_report(b, None)
}

/// The zero-copy combine buffer `bf16 [E_local, R*T_max, H]`, inside this rank's RDMA region (per-expert
/// rows are put straight from it).
pub(crate) fn next_combine_buffer<'b>(b: &'b mut CudaBackend, s: &LlSpec) -> Result<TensorMut<'b>> {
    let layout = layout_for(b, s)?;
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    b.ll.staging = Some(shape);
    let addr = b.internode.as_ref().expect("internode buffer").rdma.local_base() + layout.zero_copy as u64;
    let strides = [(shape[1] * shape[2]) as isize, shape[2] as isize, 1];
    // SAFETY: [addr, addr + E_local*R*T_max*H*2) lies inside this rank's RDMA region (layout_for checked its
    // end against num_rdma_bytes), which lives as long as the backend; the view borrows the backend mutably.
    unsafe { TensorMut::from_raw_parts(addr, Location::Cuda(b.device.ordinal()), DType::BF16, &shape, &strides) }
}

/// `clean_low_latency_buffer` across nodes (collective): a barrier, zero the signal words of the RDMA
/// region and the local state (masks kept), a barrier.
pub(crate) fn clean(b: &mut CudaBackend, t: usize, h: usize, e: usize) -> Result<()> {
    let topk = moelink_kernels::ll::LL_HINT_TOPK;
    let layout = LliLayout::new(RDMA_CTRL_BYTES, b.num_ranks, t, h, topk, e, false).ok_or_else(|| {
        Error::invalid("num_max_dispatch_tokens_per_rank", b.rank, "the low-latency buffer size overflows for this shape")
    })?;
    b.gpu_barrier()?;
    let inter = b.internode.as_ref().expect("internode buffer");
    let sig_addr = inter.rdma.local_base() + layout.signals as u64;
    let state_addr = inter.lli.state.device_ptr();
    let mask_at = moelink_kernels::ll_internode::LLI_STATE_HEAD + 40 * b.num_ranks;
    if layout.signals_end - RDMA_CTRL_BYTES <= b.num_rdma_bytes {
        // SAFETY: [signals, signals_end) lies inside the RDMA region (checked above); the barrier ordered
        // every kernel that writes it before this memset on the operation stream.
        unsafe { b.op_stream().memset_d8_async(sig_addr, 0, layout.signals_end - layout.signals)? };
    }
    // SAFETY: the state allocation holds mask_at bytes before the mask words; nothing else runs (barrier).
    unsafe { b.op_stream().memset_d8_async(state_addr, 0, mask_at)? };
    b.gpu_barrier()?;
    b.ll.outstanding.clear();
    b.ll.report.write(0, Default::default());
    Ok(())
}

fn mask_offset(b: &CudaBackend, rank: usize) -> usize {
    moelink_kernels::ll_internode::LLI_STATE_HEAD + 40 * b.num_ranks + 4 * rank
}

// The mask words are read by this rank's kernels: reads and writes are ordered after this rank's earlier
// operations on the operation stream, and complete on return.

fn write_mask_words(b: &mut CudaBackend, offset: usize, bytes: &[u8]) -> Result<()> {
    let stream = match &b.mode {
        super::StreamMode::Own => &b.stream,
        super::StreamMode::External(s) => s,
    };
    let state = &mut b.internode.as_mut().expect("internode buffer").lli.state;
    // SAFETY: `bytes` outlives the copy (the stream is synchronised below).
    unsafe { state.copy_from_host_async(offset, bytes, stream)? };
    stream.synchronize()?;
    Ok(())
}

pub(crate) fn set_mask(b: &mut CudaBackend, rank: usize, masked: bool) -> Result<()> {
    let at = mask_offset(b, rank);
    write_mask_words(b, at, &u32::from(masked).to_le_bytes())
}

pub(crate) fn mask(b: &mut CudaBackend) -> Result<Vec<bool>> {
    let mut bytes = vec![0u8; 4 * b.num_ranks];
    let at = mask_offset(b, 0);
    let state = &b.internode.as_ref().expect("internode buffer").lli.state;
    // SAFETY: `bytes` is read only after the stream has run the copy (synchronised below).
    unsafe { state.copy_to_host_async(at, &mut bytes, b.op_stream())? };
    b.op_stream().synchronize()?;
    Ok(bytes.chunks_exact(4).map(|w| w != [0, 0, 0, 0]).collect())
}

pub(crate) fn clear_mask(b: &mut CudaBackend) -> Result<()> {
    let at = mask_offset(b, 0);
    let zeros = vec![0u8; 4 * b.num_ranks];
    write_mask_words(b, at, &zeros)
}
