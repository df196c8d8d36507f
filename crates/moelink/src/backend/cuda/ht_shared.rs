//! The host side both fabrics' high-throughput calls share: the default SM budget, the alignment checks and
//! addresses of a call's tensors, the received counts a plan reports, and the wait for notify's host-mapped
//! results with the errors its status stands for.

use std::time::{Duration, Instant};

use moelink_cuda::{DevPtr, HostMapped};
use moelink_kernels::abi::{self, ErrorRecord};
use moelink_kernels::ht as kht;

use super::gpu::Gpu;
use crate::backend::BackendData;
use crate::error::{Error, Phase, Result};
use crate::ht::{CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec, Payload, Routing};
use crate::layout::align_up;
use crate::tensor::TensorMut;

/// Measured NVLink ingress ceiling per GPU in an all-to-all on 4xH200, GB/s: `moelink bench nvlink`, SM
/// stores at 132 SMs (bench/results/2026-11-21-4xnvidia-h200-2d0b9a7/nvlink.json).
const NVLINK_INGRESS_GBPS: f64 = 356.0;
/// What one SM adds with 16-byte stores and 64 KiB of loads in flight, GB/s (no file in bench/results records
/// this per-SM rate; the 8 SMs it implies reach 349 of the 356 GB/s in the all-to-all above). The dispatch
/// sender reads a token once and stores it to every destination, so this bounds its loads; the receivers'
/// copy-out and the combine senders move each byte once, so it bounds them directly.
const SM_COPY_GBPS: f64 = 46.0;
/// Headroom over the bandwidth quotient: all-to-all dips between 10 and 28 SMs (328–343 GB/s at 16–32 SMs in
/// the same nvlink.json), and the copy-out of the receivers competes with NVLink ingress for HBM.
const SM_HEADROOM: f64 = 1.5;

/// SMs a high-throughput kernel uses by default: senders to keep NVLink ingress busy
/// (`356 / 46` -> 8 SMs), the same number of receivers for the copy-out of what arrives (8 SMs), both with
/// 1.5x headroom: `2 * ceil(1.5 * 8) = 24`; even, at most this rank's share of the device's SMs.
pub(crate) fn default_num_sms(device_sms: usize) -> usize {
    let per_role = (SM_HEADROOM * (NVLINK_INGRESS_GBPS / SM_COPY_GBPS).ceil()).ceil() as usize;
    (2 * per_role).min(device_sms / 2 * 2).max(2)
}

/// SMs that carry the NVLink egress: `ceil(356 / 46)` = 8.
pub(crate) fn link_sms() -> usize {
    (NVLINK_INGRESS_GBPS / SM_COPY_GBPS).ceil() as usize
}

pub(crate) fn check_aligned(addr: u64, align: u64, arg: &'static str, rank: usize) -> Result<()> {
    if addr % align != 0 {
        return Err(Error::invalid(arg, rank, format!("address {addr:#x} must be {align}-byte aligned for the CUDA kernels")));
    }
    Ok(())
}

pub(crate) fn to_u32(v: usize, what: &'static str, rank: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(what, rank, format!("{v} does not fit the kernels' 32-bit counters")))
}

/// The inputs of a dispatch the kernels read, their alignment checked: the payload's (and FP8 scales')
/// 16- and 4-byte alignment, and, for a fresh dispatch, the top-k and layout tensors'.
fn check_dispatch_inputs(gpu: &Gpu, a: &DispatchArgs<'_>, rank: usize) -> Result<()> {
    check_aligned(gpu.addr_of(a.x.x()).addr(), 16, "x", rank)?;
    if let Payload::Fp8 { scales, .. } = a.x {
        check_aligned(scales.addr(), 4, "x_scales", rank)?;
    }
    if let Routing::Fresh { layout, topk_idx, topk_weights } = a.routing {
        if let (Some(i), Some(w)) = (topk_idx, topk_weights) {
            check_aligned(i.addr(), 8, "topk_idx", rank)?;
            check_aligned(w.addr(), 4, "topk_weights", rank)?;
        }
        check_aligned(layout.num_tokens_per_rank.addr(), 4, "num_tokens_per_rank", rank)?;
        check_aligned(layout.num_tokens_per_expert.addr(), 4, "num_tokens_per_expert", rank)?;
    }
    Ok(())
}

/// The addresses of a dispatch kernel's tensors, the outputs' alignment checked. `topk_idx` and
/// `topk_weights` are 0 unless top-k travels (a fresh dispatch with top-k).
pub(crate) struct DispatchAddrs {
    pub x: DevPtr,
    pub x_scales: DevPtr,
    pub scale_stride_token: i64,
    pub scale_stride_group: i64,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    /// `num_tokens_per_expert` of a fresh dispatch with top-k, which the senders check against `topk_idx`.
    pub num_tokens_per_expert: DevPtr,
    pub recv_x: DevPtr,
    pub recv_scales: DevPtr,
    pub recv_topk_idx: DevPtr,
    pub recv_topk_weights: DevPtr,
    pub recv_src_idx: DevPtr,
}

pub(crate) fn dispatch_addrs(gpu: &Gpu, s: &HtSpec, a: &DispatchArgs<'_>, out: &DispatchOutputs<'_>) -> Result<DispatchAddrs> {
    let rank = s.rank;
    let d = DispatchAddrs {
        x: gpu.addr_of(a.x.x()),
        x_scales: DevPtr::NULL,
        scale_stride_token: 0,
        scale_stride_group: 0,
        topk_idx: DevPtr::NULL,
        topk_weights: DevPtr::NULL,
        num_tokens_per_expert: DevPtr::NULL,
        recv_x: out.recv_x.device_ptr(),
        recv_scales: out_addr(&out.recv_scales),
        recv_topk_idx: out_addr(&out.recv_topk_idx),
        recv_topk_weights: out_addr(&out.recv_topk_weights),
        recv_src_idx: out_addr(&out.recv_src_idx),
    };
    check_aligned(d.recv_x.addr(), 16, "recv_x", rank)?;
    check_aligned(d.recv_scales.addr(), 4, "recv_x_scales", rank)?;
    check_aligned(d.recv_topk_idx.addr(), 8, "recv_topk_idx", rank)?;
    check_aligned(d.recv_topk_weights.addr(), 4, "recv_topk_weights", rank)?;
    check_aligned(d.recv_src_idx.addr(), 4, "recv_src_idx", rank)?;
    let (x_scales, scale_stride_token, scale_stride_group) = match a.x {
        Payload::Fp8 { scales, .. } => (scales.device_ptr(), scales.strides()[0] as i64, scales.strides()[1] as i64),
        Payload::Bf16(_) => (DevPtr::NULL, 0, 0),
    };
    let (topk_idx, topk_weights, num_tokens_per_expert) = match a.routing {
        Routing::Fresh { topk_idx: Some(i), topk_weights: Some(w), layout } if s.has_topk => {
            (i.device_ptr(), w.device_ptr(), layout.num_tokens_per_expert.device_ptr())
        }
        _ => (DevPtr::NULL, DevPtr::NULL, DevPtr::NULL),
    };
    Ok(DispatchAddrs { x_scales, scale_stride_token, scale_stride_group, topk_idx, topk_weights, num_tokens_per_expert, ..d })
}

/// The addresses of a combine kernel's tensors, alignment checked. The biases given, in order (the kernels
/// add bias0 then bias1; a lone second bias takes the first slot, which adds the same values in the same
/// order).
pub(crate) struct CombineAddrs {
    pub x: DevPtr,
    pub topk_weights: DevPtr,
    pub bias0: DevPtr,
    pub bias1: DevPtr,
    pub num_biases: usize,
    pub combined_x: DevPtr,
    pub combined_topk_weights: DevPtr,
}

pub(crate) fn combine_addrs(gpu: &Gpu, rank: usize, a: &CombineArgs<'_>, out: &CombineOutputs<'_>) -> Result<CombineAddrs> {
    let biases: Vec<DevPtr> = a.bias.iter().flatten().map(|t| t.device_ptr()).collect();
    let c = CombineAddrs {
        x: gpu.addr_of(&a.x),
        topk_weights: a.topk_weights.as_ref().map_or(DevPtr::NULL, |w| w.device_ptr()),
        bias0: biases.first().copied().unwrap_or(DevPtr::NULL),
        bias1: biases.get(1).copied().unwrap_or(DevPtr::NULL),
        num_biases: biases.len(),
        combined_x: out.combined_x.device_ptr(),
        combined_topk_weights: out_addr(&out.combined_topk_weights),
    };
    check_aligned(c.x.addr(), 16, "x", rank)?;
    check_aligned(c.topk_weights.addr(), 4, "topk_weights", rank)?;
    check_aligned(c.bias0.addr(), 16, "bias", rank)?;
    check_aligned(c.bias1.addr(), 16, "bias", rank)?;
    check_aligned(c.combined_x.addr(), 16, "combined_x", rank)?;
    check_aligned(c.combined_topk_weights.addr(), 4, "combined_topk_weights", rank)?;
    Ok(c)
}

/// The plan of a dispatch: the received count the host knows (CPU-sync mode, or a handle's), the received
/// tokens per local expert (the raw counts rounded up to `expert_alignment`; empty in no-sync mode) and the
/// fabric's `state`.
pub(crate) fn dispatch_plan(
    s: HtSpec,
    num_recv_tokens: Option<usize>,
    per_expert_raw: Option<&[usize]>,
    state: BackendData,
) -> DispatchPlan {
    let num_recv_tokens_per_expert = match per_expert_raw {
        Some(raw) if s.num_worst_tokens == 0 => raw.iter().map(|&c| align_up(c, s.expert_alignment)).collect(),
        _ => Vec::new(),
    };
    DispatchPlan { spec: s, num_recv_tokens, num_recv_tokens_per_expert, state }
}

/// What both fabrics check before a dispatch's count exchange: a CPU-synchronised dispatch cannot be
/// captured (the host waits for notify), and the inputs the kernels read are aligned.
pub(crate) fn check_dispatch_start(gpu: &Gpu, s: &HtSpec, a: &DispatchArgs<'_>) -> Result<()> {
    if s.num_worst_tokens == 0 && gpu.is_capturing() {
        return Err(Error::invalid(
            "num_worst_tokens",
            s.rank,
            "a CPU-synchronised dispatch waits for the count exchange on the host and cannot be captured into a CUDA graph; \
             pass num_worst_tokens > 0",
        ));
    }
    check_dispatch_inputs(gpu, a, s.rank)
}

/// CPU-synchronised mode: waits (deadline + slack) until word `ready` of notify's host-mapped `words` reads
/// call `seq`; a fatal recorded error ends the wait early. Returns when the wait started.
pub(crate) fn wait_notify_ready(gpu: &Gpu, rank: usize, seq: u32, words: &HostMapped<u32>, ready: usize) -> Result<Instant> {
    let start = Instant::now();
    let limit = Duration::from_nanos(gpu.timeout_ns) + Duration::from_secs(5);
    while words.read(ready) != seq {
        if let Some(e) = gpu.recorded_error().filter(|e| e.poisons_buffer()) {
            return Err(e);
        }
        if start.elapsed() > limit {
            return Err(Error::Timeout { rank, peer: usize::MAX, phase: Phase::Notify, waited_ms: start.elapsed().as_millis() as u64 });
        }
        std::hint::spin_loop();
    }
    Ok(start)
}

/// The error every rank gives for notify's agreed status bits `status` (blaming `peer`), for the bits both
/// notify kernels share (`moelink_kernels::ht::status`: FAILED, BAD_LAYOUT, MISMATCH); `None` for the rest
/// (the single-node slab's TOO_SMALL).
pub(crate) fn notify_status_error(gpu: &Gpu, s: &HtSpec, status: u32, peer: usize, start: Instant) -> Option<Error> {
    let rank = s.rank;
    let recorded = gpu.recorded_error();
    if status & kht::status::FAILED != 0 {
        return Some(recorded.unwrap_or(Error::Timeout {
            rank,
            peer: usize::MAX,
            phase: Phase::Notify,
            waited_ms: start.elapsed().as_millis() as u64,
        }));
    }
    if status & (kht::status::BAD_LAYOUT | kht::status::BAD_EXPERTS) != 0 {
        // The argument the agreed status names: a bad num_tokens_per_rank first (the per-expert check rests on it).
        let which = if status & kht::status::BAD_LAYOUT != 0 { abi::layout_arg::PER_RANK } else { abi::layout_arg::PER_EXPERT };
        return Some(gpu.argument_error(&ErrorRecord {
            code: abi::ERR_INVALID_LAYOUT,
            rank: rank as u32,
            peer: peer as u32,
            elapsed_ns: which,
            ..Default::default()
        }));
    }
    if status & kht::status::MISMATCH != 0 {
        return Some(match recorded {
            Some(e @ Error::RankMismatch { .. }) => e,
            _ => Error::RankMismatch {
                what: "dispatch shape (hidden, experts, top-k, dtype, sync mode)",
                rank,
                peer,
                ours: format!("hidden {}, {} experts, top-{}, fp8 {}", s.hidden, s.num_experts, s.topk, s.fp8),
                theirs: "something else".into(),
            },
        });
    }
    None
}

fn out_addr(t: &Option<TensorMut<'_>>) -> DevPtr {
    t.as_ref().map_or(DevPtr::NULL, |t| t.device_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sms_follow_the_formula() {
        assert_eq!(default_num_sms(132), 24);
        assert_eq!(default_num_sms(16), 16);
        assert_eq!(default_num_sms(17), 16);
        assert_eq!(default_num_sms(1), 2);
        assert_eq!(link_sms(), 8);
    }
}
