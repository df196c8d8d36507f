//! High-throughput dispatch/combine on GPUs: what to launch, with which arguments, after which checks. The
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

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moelink_cuda::{DeviceBuffer, HostMapped, LaunchConfig};
use moelink_kernels::abi::{self, ErrorRecord};
use moelink_kernels::ht::{
    self as kht, host_notify, routing, CallSignature, HtCombineArgs, HtCombineVariant, HtDispatchArgs, HtDispatchVariant, HtLayoutArgs,
    HtLayoutVariant, HtNotifyArgs, HtNotifyVariant, HtRegion,
};
use moelink_kernels::kernel_name;

use super::{ctrl, CudaBackend, HT_DATA};
use crate::backend::{HtDispatched, HtRouting, LayoutOutputs, PlanState};
use crate::config::Tuning;
use crate::error::{Error, Phase, Result};
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec, Payload, Routing};
use crate::layout::align_up;
use crate::tensor::{TensorMut, TensorRef};

const _: () = assert!(kht::ctrl::BYTES <= ctrl::LL - ctrl::HT, "the HT control region overflows its slot");

// ------------------------------------------------------------------------------------------ SM budget

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
pub(crate) fn default_num_sms(b: &CudaBackend) -> usize {
    default_num_sms_for(b.num_rank_sms())
}

fn default_num_sms_for(device_sms: usize) -> usize {
    let per_role = (SM_HEADROOM * (NVLINK_INGRESS_GBPS / SM_COPY_GBPS).ceil()).ceil() as usize;
    (2 * per_role).min(device_sms / 2 * 2).max(2)
}

/// SMs that carry the NVLink egress: `ceil(356 / 46)` = 8.
fn link_sms() -> usize {
    (NVLINK_INGRESS_GBPS / SM_COPY_GBPS).ceil() as usize
}

/// Combine sender blocks: a third of the blocks, but at least the link SMs as long as that leaves half for
/// the reducers. Measured on 4xH200 (EP4, 4096 tokens, H 7168, interleaved chunks): 24 SMs 6/8/10/12
/// senders 690/566/568/578 µs; 48 SMs 8/16: 561/554; 64 SMs 8/16/21: 561/543/539 (bench/results/
/// 2026-11-21-4xnvidia-h200-52de077-sweeps, -run23); a plain third starved the senders below 24 SMs.
fn default_send_blocks(num_sms: usize) -> usize {
    (num_sms / 3).max(link_sms().min(num_sms / 2)).clamp(1, num_sms - 1)
}

/// Dispatch senders (`Tuning::ht_dispatch_send_blocks` overrides, clamped to `[1, num_sms - 1]`): the link
/// SMs (at most half), at every SM count. The dispatch is bound by its senders' NVLink stores, and more
/// sender SMs land in the all-to-all dip between 10 and 28 SMs (`SM_HEADROOM`): measured on 4xH200 (EP4,
/// 4096 tokens, H 7168, BF16 dispatch, µs) 24 SMs 6/8/10/12 senders 711/588/646/635; 32 SMs 8/10: 592/643;
/// 48 SMs 8/16: 585/597; 64 SMs 8/16/21: 585/590/638 (bench/results/2026-11-21-4xnvidia-h200-52de077-sweeps,
/// -run23). The receivers copy this rank's own rows and the arriving rows out.
fn dispatch_send_blocks(t: &Tuning, num_sms: usize) -> usize {
    match t.ht_dispatch_send_blocks {
        Some(n) => n.clamp(1, num_sms - 1),
        None => link_sms().min(num_sms / 2).clamp(1, num_sms - 1),
    }
}

/// Combine senders (`Tuning::ht_combine_send_blocks` overrides, clamped to `[1, num_sms - 1]`).
fn combine_send_blocks(t: &Tuning, num_sms: usize) -> usize {
    t.ht_combine_send_blocks.map_or_else(|| default_send_blocks(num_sms), |n| n.clamp(1, num_sms - 1))
}

/// Rows a sender warp releases per fence (`moelink_kernels::ht::DEFAULT_RELEASE_BATCH`;
/// `Tuning::ht_release_batch` overrides, clamped to 1..=64).
fn release_batch(t: &Tuning) -> u32 {
    t.ht_release_batch.map_or(kht::DEFAULT_RELEASE_BATCH, |n| n.clamp(1, 64))
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
/// data movement so that the other role can be timed alone, and the results are wrong (the caller says so:
/// `moelink bench` warns and marks its records); bit 4 drops the dispatch's per-expert layout checks.
fn timing_experiment(t: &Tuning) -> u32 {
    t.ht_timing_experiment & 7
}

/// With `KernelTracing::high_throughput`, every synchronous HT dispatch and combine records `%globaltimer`
/// stamps (ht.cuh, `HT_TRACE_*`): when each role's warps started and finished their work. Off (and the
/// argument 0) in asynchronous calls and graph captures, whose kernels finish after the call returns. The
/// trace words for a launch of `blocks` blocks of `warps` warps, zeroed; 0 when not tracing.
fn trace_begin(b: &mut CudaBackend, blocks: usize, warps: u32) -> Result<u64> {
    trace_begin_words(b, blocks * kht::trace_words_per_block(warps))
}

/// `words` zeroed trace words (the internode kernels' layout differs), or 0 when not tracing this call.
pub(super) fn trace_begin_words(b: &mut CudaBackend, words: usize) -> Result<u64> {
    if !b.tracing.high_throughput || b.is_async() || b.is_capturing() {
        return Ok(0);
    }
    if b.ht.trace.as_ref().is_none_or(|t| t.len() < words) {
        b.ht.trace = Some(HostMapped::new(&b.device, words)?);
    }
    let t = b.ht.trace.as_mut().expect("allocated above");
    t.clear();
    Ok(t.device_ptr())
}

/// Most high-throughput traces kept between two timed regions (the oldest go first).
const HT_TRACES_KEPT: usize = 256;

/// Keeps the trace of the call that just finished (its kernel completed: synchronous mode) for
/// `Buffer::kernel_traces`.
fn trace_keep(b: &mut CudaBackend, kernel: &'static str, op: &'static str, blocks: usize, warps: u32, send_blocks: usize) {
    let words = trace_words(b, blocks * kht::trace_words_per_block(warps));
    if let Some(trace) = crate::trace::ht_launch(&words, blocks, warps as usize, send_blocks, kernel, op) {
        trace_push(b, trace);
    }
}

/// The first `n` trace words of the call that just finished.
pub(super) fn trace_words(b: &CudaBackend, n: usize) -> Vec<u64> {
    b.ht.trace.as_ref().map_or_else(Vec::new, |t| (0..n.min(t.len())).map(|i| t.read(i)).collect())
}

/// Keeps a decoded trace for `Buffer::kernel_traces` (the oldest goes when `HT_TRACES_KEPT` are kept).
pub(super) fn trace_push(b: &mut CudaBackend, trace: crate::trace::KernelTrace) {
    if b.ht.traces.len() == HT_TRACES_KEPT {
        b.ht.traces.remove(0);
    }
    b.ht.traces.push(trace);
}

// ------------------------------------------------------------------------------------------ state

/// Per-buffer high-throughput state (kept across calls).
#[derive(Default)]
pub(crate) struct HtState {
    pool: Arc<BufferPool>,
    /// Host-mapped notify results (CPU-sync mode), grown to the largest expert count seen.
    host_notify: Option<HostMapped<u32>>,
    notify_seq: u32,
    region_agreed: bool,
    /// Host-mapped words of the timing trace (`KernelTracing::high_throughput`), grown to the largest kernel
    /// traced.
    trace: Option<HostMapped<u64>>,
    /// The traces of the calls since the last timed region opened (at most `HT_TRACES_KEPT`).
    pub(crate) traces: Vec<crate::trace::KernelTrace>,
}

/// Device buffers for handles, recycled by size class: a dispatch never frees (`cuMemFree` synchronises the
/// device) and, once warmed up, never allocates — which is what lets a no-sync dispatch run under CUDA graph
/// capture.
#[derive(Default)]
struct BufferPool {
    free: Mutex<Vec<DeviceBuffer>>,
}

impl BufferPool {
    fn size_class(bytes: usize) -> usize {
        bytes.max(4096).next_power_of_two()
    }

    fn take(self: &Arc<Self>, b: &CudaBackend, bytes: usize) -> Result<PooledBuffer> {
        let class = Self::size_class(bytes);
        let reused =
            self.free.lock().ok().and_then(|mut free| free.iter().position(|d| d.len_bytes() == class).map(|i| free.swap_remove(i)));
        let buf = match reused {
            Some(d) => d,
            None if b.is_capturing() => {
                return Err(Error::invalid(
                    "capture",
                    b.rank,
                    "a dispatch of this shape needs handle memory that cannot be allocated during CUDA graph capture: run the same \
                     dispatch once (and drop its handle) before capturing",
                ))
            }
            None => b.device_alloc(class)?,
        };
        Ok(PooledBuffer { buf: Some(buf), pool: self.clone() })
    }
}

/// A device buffer that returns to its pool when dropped.
pub(crate) struct PooledBuffer {
    buf: Option<DeviceBuffer>,
    pool: Arc<BufferPool>,
}

impl PooledBuffer {
    pub(crate) fn buffer(&self) -> &DeviceBuffer {
        self.buf.as_ref().expect("a PooledBuffer holds its buffer until dropped")
    }
    pub(crate) fn ptr(&self) -> u64 {
        self.buffer().device_ptr()
    }
}

/// A handle buffer of at least `bytes` from the buffer's pool (see `BufferPool`).
pub(crate) fn pool_take(b: &CudaBackend, bytes: usize) -> Result<PooledBuffer> {
    b.ht.pool.clone().take(b, bytes)
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut free)) = (self.buf.take(), self.pool.free.lock()) {
            free.push(b);
        }
    }
}

/// What the host knows about a dispatch's routing (CPU-sync mode, or read back after a synchronous call).
#[derive(Clone, Debug)]
pub(crate) struct HostRouting {
    num_recv_tokens: usize,
    t_max: usize,
    /// Received tokens per local expert, unaligned (CPU-sync mode only).
    per_expert_raw: Option<Vec<usize>>,
    /// The notify call whose host-mapped words these are (0: read back after a no-sync dispatch).
    notify_seq: u32,
}

/// Handle data of a CUDA dispatch: the routing buffer ht_notify wrote (status, counts, offsets, T_max,
/// DeepEP's rank_prefix_matrix and the token prefix per destination). The source index of each received row
/// goes to the caller's `recv_src_idx` output, when given: combine finds rows by send slot.
pub(crate) struct CudaHtRouting {
    routing: PooledBuffer,
    host: Option<HostRouting>,
}

/// The handle data a dispatch returns: built by a fresh dispatch, shared by a cached one.
enum HandleData {
    New(CudaHtRouting),
    Existing(Arc<HtRouting>),
}

/// State between `prepare_dispatch` and `dispatch`.
pub(crate) enum CudaPlan {
    Fresh { routing: PooledBuffer, host: Option<HostRouting> },
    Cached(Arc<HtRouting>),
}

fn routing_of(data: &HtRouting, rank: usize) -> Result<&CudaHtRouting> {
    data.cuda(rank)
}

// ------------------------------------------------------------------------------------------ helpers

fn region(b: &CudaBackend) -> HtRegion {
    HtRegion { num_nvl_bytes: b.num_nvl_bytes, num_ranks: b.num_ranks }
}

/// Every rank must see the same data-region layout; checked once, at the first collective HT call.
fn ensure_region_agreed(b: &mut CudaBackend) -> Result<()> {
    if !b.ht.region_agreed {
        crate::group::check_agreement(b.group.as_ref(), &[("num_nvl_bytes", b.num_nvl_bytes as u64)])?;
        b.ht.region_agreed = true;
    }
    Ok(())
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
pub(crate) fn check_dispatch_inputs(b: &CudaBackend, a: &DispatchArgs<'_>, rank: usize) -> Result<()> {
    check_aligned(b.addr_of(a.x.x()), 16, "x", rank)?;
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
    pub x: u64,
    pub x_scales: u64,
    pub scale_stride_token: i64,
    pub scale_stride_group: i64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    /// `num_tokens_per_expert` of a fresh dispatch with top-k, which the senders check against `topk_idx`.
    pub num_tokens_per_expert: u64,
    pub recv_x: u64,
    pub recv_scales: u64,
    pub recv_topk_idx: u64,
    pub recv_topk_weights: u64,
    pub recv_src_idx: u64,
}

pub(crate) fn dispatch_addrs(b: &CudaBackend, s: &HtSpec, a: &DispatchArgs<'_>, out: &DispatchOutputs<'_>) -> Result<DispatchAddrs> {
    let rank = s.rank;
    let d = DispatchAddrs {
        x: b.addr_of(a.x.x()),
        x_scales: 0,
        scale_stride_token: 0,
        scale_stride_group: 0,
        topk_idx: 0,
        topk_weights: 0,
        num_tokens_per_expert: 0,
        recv_x: out.recv_x.addr(),
        recv_scales: out_addr(&out.recv_scales),
        recv_topk_idx: out_addr(&out.recv_topk_idx),
        recv_topk_weights: out_addr(&out.recv_topk_weights),
        recv_src_idx: out_addr(&out.recv_src_idx),
    };
    check_aligned(d.recv_x, 16, "recv_x", rank)?;
    check_aligned(d.recv_scales, 4, "recv_x_scales", rank)?;
    check_aligned(d.recv_topk_idx, 8, "recv_topk_idx", rank)?;
    check_aligned(d.recv_topk_weights, 4, "recv_topk_weights", rank)?;
    check_aligned(d.recv_src_idx, 4, "recv_src_idx", rank)?;
    let (x_scales, scale_stride_token, scale_stride_group) = match a.x {
        Payload::Fp8 { scales, .. } => (scales.addr(), scales.strides()[0] as i64, scales.strides()[1] as i64),
        Payload::Bf16(_) => (0, 0, 0),
    };
    let (topk_idx, topk_weights, num_tokens_per_expert) = match a.routing {
        Routing::Fresh { topk_idx: Some(i), topk_weights: Some(w), layout } if s.has_topk => {
            (i.addr(), w.addr(), layout.num_tokens_per_expert.addr())
        }
        _ => (0, 0, 0),
    };
    Ok(DispatchAddrs { x_scales, scale_stride_token, scale_stride_group, topk_idx, topk_weights, num_tokens_per_expert, ..d })
}

/// The addresses of a combine kernel's tensors, alignment checked. The biases given, in order (the kernels
/// add bias0 then bias1; a lone second bias takes the first slot, which adds the same values in the same
/// order).
pub(crate) struct CombineAddrs {
    pub x: u64,
    pub topk_weights: u64,
    pub bias0: u64,
    pub bias1: u64,
    pub num_biases: usize,
    pub combined_x: u64,
    pub combined_topk_weights: u64,
}

pub(crate) fn combine_addrs(b: &CudaBackend, rank: usize, a: &CombineArgs<'_>, out: &CombineOutputs<'_>) -> Result<CombineAddrs> {
    let biases: Vec<u64> = a.bias.iter().flatten().map(|t| t.addr()).collect();
    let c = CombineAddrs {
        x: b.addr_of(&a.x),
        topk_weights: a.topk_weights.as_ref().map_or(0, |w| w.addr()),
        bias0: biases.first().copied().unwrap_or(0),
        bias1: biases.get(1).copied().unwrap_or(0),
        num_biases: biases.len(),
        combined_x: out.combined_x.addr(),
        combined_topk_weights: out_addr(&out.combined_topk_weights),
    };
    check_aligned(c.x, 16, "x", rank)?;
    check_aligned(c.topk_weights, 4, "topk_weights", rank)?;
    check_aligned(c.bias0, 16, "bias", rank)?;
    check_aligned(c.bias1, 16, "bias", rank)?;
    check_aligned(c.combined_x, 16, "combined_x", rank)?;
    check_aligned(c.combined_topk_weights, 4, "combined_topk_weights", rank)?;
    Ok(c)
}

/// What the error messages need to know about the buffer.
#[derive(Clone, Copy, Debug)]
struct BufferShape {
    rank: usize,
    num_ranks: usize,
    num_nvl_bytes: usize,
}

impl BufferShape {
    fn of(b: &CudaBackend) -> BufferShape {
        BufferShape { rank: b.rank, num_ranks: b.num_ranks, num_nvl_bytes: b.num_nvl_bytes }
    }
}

/// The `BufferTooSmall` error for `t_max` tokens per rank in rows of `row_bytes`.
fn too_small(b: &CudaBackend, what: &'static str, t_max: usize, row_bytes: usize) -> Error {
    too_small_for(BufferShape::of(b), what, t_max, row_bytes)
}

fn too_small_for(b: BufferShape, what: &'static str, t_max: usize, row_bytes: usize) -> Error {
    crate::ht::ht_too_small(b.rank, b.num_ranks, b.num_nvl_bytes, what, t_max, row_bytes)
}

/// The error an argument-error record (anything but a timeout) stands for.
pub(crate) fn argument_error(b: &CudaBackend, rec: &ErrorRecord) -> Error {
    argument_error_for(BufferShape::of(b), rec)
}

fn argument_error_for(b: BufferShape, rec: &ErrorRecord) -> Error {
    let rank = rec.rank as usize;
    let peer = rec.peer as usize;
    let (d0, d1) = (rec.elapsed_ns, rec.timeout_ns);
    match rec.code {
        abi::ERR_INVALID_TOPK => Error::invalid(
            "topk_idx",
            rank,
            format!(
                "entry [{}, {}] = {} is outside [-1, num_experts) or repeats an expert of its row",
                d0 >> 32,
                d0 & 0xffff_ffff,
                d1 as i64
            ),
        ),
        abi::ERR_INVALID_LAYOUT => {
            let (expert, tokens) = (d1 >> 32, d1 & 0xffff_ffff);
            if d0 == abi::layout_arg::EXPERT_TOKENS {
                return Error::invalid(
                    "num_tokens_per_expert",
                    rank,
                    format!("entry {expert} is not {tokens}, the number of tokens whose topk_idx selects expert {expert}"),
                );
            }
            if d0 == abi::layout_arg::RECV_EXPERT_TOKENS {
                return Error::invalid(
                    "num_tokens_per_expert",
                    rank,
                    format!(
                        "of some rank disagrees with its topk_idx: {tokens} rows arrived for local expert {expert} of this rank, not \
                         the number the ranks' counts give (num_recv_tokens_per_expert); the rank that passed it names itself"
                    ),
                );
            }
            let (arg, what) = match d0 {
                abi::layout_arg::PER_EXPERT => (
                    "num_tokens_per_expert",
                    "counts tokens for the experts of a rank that no token goes to, fewer tokens than go to that rank, or a \
                     negative number (num_tokens_per_rank, is_token_in_rank)",
                ),
                abi::layout_arg::IN_RANK => (
                    "is_token_in_rank",
                    "sends a token to a rank where topk_idx selects none of its experts, or not to a rank where it selects one",
                ),
                _ => ("num_tokens_per_rank", "does not match the tokens is_token_in_rank sends to each rank"),
            };
            match (peer == rank, d0) {
                (true, abi::layout_arg::IN_RANK) => {
                    Error::invalid(arg, rank, format!("{what} (token {d1}); the rows went as is_token_in_rank says"))
                }
                (true, _) => Error::invalid(arg, rank, what),
                (false, _) => Error::invalid(arg, rank, format!("rank {peer}'s {arg} {what}, so no rank dispatched")),
            }
        }
        abi::ERR_RANK_MISMATCH => Error::RankMismatch {
            what: "dispatch shape (hidden, experts, top-k, dtype, sync mode)",
            rank,
            peer,
            ours: CallSignature::decode(d0).to_string(),
            theirs: CallSignature::decode(d1).to_string(),
        },
        abi::ERR_BUFFER_TOO_SMALL => {
            let what = if rec.phase == abi::phase::COMBINE { "HT combine receive slab" } else { "HT dispatch receive slab" };
            too_small_for(b, what, d0 as usize, (d1 >> 32) as usize)
        }
        abi::ERR_RECV_OVERFLOW => {
            Error::invalid("num_worst_tokens", rank, format!("this rank receives {d0} tokens, but the outputs have {d1} rows"))
        }
        abi::ERR_PEER_LAYOUT => Error::Group {
            rank,
            reason: format!(
                "rank {peer}'s internode messages have layout {:#x}, this rank's kernel reads {:#x}: the ranks launched \
                 different kernel variants; nothing received is valid",
                d0 >> 32,
                d0 & 0xffff_ffff
            ),
        },
        code => Error::Group {
            rank,
            reason: format!(
                "a kernel recorded unknown error code {code} (phase {}, peer {}, details {d0:#x} {d1:#x})",
                rec.phase, rec.peer
            ),
        },
    }
}

/// An argument error leaves the protocol intact: forget the record (once the stream is idle) so that the
/// buffer stays usable, and pass the error on. Fatal errors stay recorded (they poison the buffer).
pub(crate) fn settle(b: &mut CudaBackend, e: Error) -> Error {
    if !e.poisons_buffer() {
        if let Err(clear) = b.clear_argument_error() {
            return clear;
        }
    }
    e
}

pub(crate) fn finish(b: &mut CudaBackend, phase: Phase) -> Result<()> {
    b.finish(phase).map_err(|e| settle(b, e))
}

fn layout_args(b: &CudaBackend) -> ([u64; abi::MAX_RANKS], [u64; abi::MAX_RANKS]) {
    (b.peer_table(ctrl::HT), b.peer_table(HT_DATA))
}

/// Reads `NUM_RECV` and `T_MAX` of a routing buffer (after the stream finished).
fn read_back_routing(buf: &PooledBuffer) -> Result<HostRouting> {
    let mut words = [0u8; 8];
    buf.buffer().copy_to_host_at(4 * routing::NUM_RECV, &mut words)?;
    debug_assert_eq!(routing::T_MAX, routing::NUM_RECV + 1);
    let num_recv = u32::from_le_bytes(words[..4].try_into().expect("4 bytes")) as usize;
    let t_max = u32::from_le_bytes(words[4..].try_into().expect("4 bytes")) as usize;
    Ok(HostRouting { num_recv_tokens: num_recv, t_max, per_expert_raw: None, notify_seq: 0 })
}

// ------------------------------------------------------------------------------------------ layout

pub(crate) fn dispatch_layout(b: &mut CudaBackend, topk_idx: &TensorRef<'_>, num_experts: usize, out: LayoutOutputs<'_>) -> Result<()> {
    if b.internode.is_some() {
        return super::ht_internode::dispatch_layout(b, topk_idx, num_experts, out);
    }
    let rank = b.rank;
    let (t, k) = (topk_idx.shape()[0], topk_idx.shape()[1]);
    check_aligned(topk_idx.addr(), 8, "topk_idx", rank)?;
    let num_tokens_per_rank = out.num_tokens_per_rank.addr();
    let num_tokens_per_expert = out.num_tokens_per_expert.addr();
    check_aligned(num_tokens_per_rank, 4, "num_tokens_per_rank", rank)?;
    check_aligned(num_tokens_per_expert, 4, "num_tokens_per_expert", rank)?;
    let kernel = b.kernel(&HtLayoutVariant.spec(), kernel_name::HT_LAYOUT)?;
    // SAFETY: both outputs were validated as contiguous int32 tensors of this device with R and E elements.
    unsafe {
        b.op_stream().memset_d32_async(num_tokens_per_rank, 0, b.num_ranks)?;
        b.op_stream().memset_d32_async(num_tokens_per_expert, 0, num_experts)?;
    }
    let (error_claim, error_record) = b.error_sink();
    let strides = topk_idx.strides();
    let args = HtLayoutArgs {
        topk_idx: b.addr_of(topk_idx),
        topk_stride_token: strides[0] as i64,
        topk_stride_k: strides[1] as i64,
        num_tokens_per_rank,
        num_tokens_per_expert,
        is_token_in_rank: out.is_token_in_rank.addr(),
        error_claim,
        error_record,
        num_tokens: to_u32(t, "topk_idx", rank)?,
        topk: to_u32(k, "topk_idx", rank)?,
        num_experts: to_u32(num_experts, "num_experts", rank)?,
        num_ranks: b.num_ranks as u32,
        rank: rank as u32,
        reserved: 0,
    };
    b.launch(&kernel, &LaunchConfig::linear(HtLayoutVariant::grid(t), HtLayoutVariant::THREADS), &args)?;
    finish(b, Phase::Layout)
}

// ------------------------------------------------------------------------------------------ dispatch

/// The received tokens per local expert a plan reports: the raw counts the host read (CPU-sync mode) rounded
/// up to `expert_alignment`; empty in no-sync mode.
pub(crate) fn per_expert_aligned(raw: Option<&[usize]>, s: &HtSpec) -> Vec<usize> {
    match raw {
        Some(raw) if s.num_worst_tokens == 0 => raw.iter().map(|&c| align_up(c, s.expert_alignment)).collect(),
        _ => Vec::new(),
    }
}

pub(crate) fn prepare_dispatch(b: &mut CudaBackend, s: HtSpec, a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    if b.internode.is_some() {
        return super::ht_internode::prepare_dispatch(b, s, a);
    }
    let rank = s.rank;
    ensure_region_agreed(b)?;
    if s.num_worst_tokens == 0 && b.is_capturing() {
        return Err(Error::invalid(
            "num_worst_tokens",
            rank,
            "a CPU-synchronised dispatch waits for the count exchange on the host and cannot be captured into a CUDA graph; \
             pass num_worst_tokens > 0",
        ));
    }
    check_dispatch_inputs(b, a, rank)?;
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
            Ok(DispatchPlan {
                spec: s,
                num_recv_tokens: host.as_ref().map(|h| h.num_recv_tokens),
                num_recv_tokens_per_expert: per_expert_aligned(host.as_ref().and_then(|h| h.per_expert_raw.as_deref()), &s),
                state: PlanState::Cuda(CudaPlan::Cached(data)),
            })
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
            let routing_buf = b.ht.pool.clone().take(b, routing::bytes(s.num_tokens, s.num_ranks))?;
            let sync = s.num_worst_tokens == 0;
            let (host_out, host_seq) = if sync {
                let words = host_notify::words(el);
                if b.ht.host_notify.as_ref().is_none_or(|m| m.len() < words) {
                    b.ht.host_notify = Some(HostMapped::new(&b.device, words.max(host_notify::words(256)))?);
                }
                b.ht.notify_seq = b.ht.notify_seq.wrapping_add(1).max(1);
                (b.ht.host_notify.as_ref().map_or(0, |m| m.device_ptr()), b.ht.notify_seq)
            } else {
                (0, 0)
            };
            let signature = kht::call_signature(CallSignature {
                hidden: s.hidden,
                num_experts: s.num_experts,
                topk: s.topk,
                fp8: s.fp8,
                has_topk: s.has_topk,
                no_sync: !sync,
            });
            let kernel = b.kernel(&HtNotifyVariant.spec(), kernel_name::HT_NOTIFY)?;
            let (error_claim, error_record) = b.error_sink();
            let args = HtNotifyArgs {
                is_token_in_rank: layout.is_token_in_rank.addr(),
                num_tokens_per_rank: layout.num_tokens_per_rank.addr(),
                num_tokens_per_expert: layout.num_tokens_per_expert.addr(),
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
            Ok(DispatchPlan {
                spec: s,
                num_recv_tokens: host.as_ref().map(|h| h.num_recv_tokens),
                num_recv_tokens_per_expert: per_expert_aligned(host.as_ref().and_then(|h| h.per_expert_raw.as_deref()), &s),
                state: PlanState::Cuda(CudaPlan::Fresh { routing: routing_buf, host }),
            })
        }
    }
}

/// CPU-sync mode: waits (deadline) for the notify kernel's host-mapped results of call `seq`, then decides
/// whether this call dispatches. Only a fatal error ends the wait early, and the decision rests on the
/// exchange's status alone — the value every rank computed from the same messages — never on an argument
/// error an earlier asynchronous call may have left in the record (that one surfaces when the dispatch
/// finishes, after the collective ran), so every rank launches the dispatch or none does.
fn read_notify(b: &mut CudaBackend, seq: u32, s: &HtSpec, row_bytes: usize) -> Result<HostRouting> {
    let rank = b.rank;
    if b.ht.host_notify.is_none() {
        return Err(Error::invalid("num_worst_tokens", rank, "internal: no host-mapped notify area"));
    }
    let start = wait_notify_ready(b, rank, seq, |b| b.ht.host_notify.as_ref().map_or(0, |m| m.read(host_notify::READY)))?;
    let m = b.ht.host_notify.as_ref().expect("checked above");
    let status = m.read(host_notify::STATUS);
    let host = HostRouting {
        num_recv_tokens: m.read(host_notify::NUM_RECV) as usize,
        t_max: m.read(host_notify::T_MAX) as usize,
        per_expert_raw: Some((0..s.num_local_experts()).map(|e| m.read(host_notify::PER_EXPERT + e) as usize).collect()),
        notify_seq: seq,
    };
    if status == 0 {
        return Ok(host);
    }
    let peer = m.read(host_notify::STATUS_PEER) as usize;
    let e =
        notify_status_error(b, s, status, peer, start).unwrap_or_else(|| too_small(b, "HT dispatch receive slab", host.t_max, row_bytes));
    Err(settle(b, e))
}

/// CPU-synchronised mode: waits (deadline + slack) until `ready` reads call `seq` from notify's host-mapped
/// words; a fatal recorded error ends the wait early. Returns when the wait started.
pub(crate) fn wait_notify_ready(b: &CudaBackend, rank: usize, seq: u32, ready: impl Fn(&CudaBackend) -> u32) -> Result<Instant> {
    let start = Instant::now();
    let limit = Duration::from_nanos(b.timeout_ns) + Duration::from_secs(5);
    while ready(b) != seq {
        if let Some(e) = b.recorded_error().filter(|e| e.poisons_buffer()) {
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
pub(crate) fn notify_status_error(b: &CudaBackend, s: &HtSpec, status: u32, peer: usize, start: Instant) -> Option<Error> {
    let rank = s.rank;
    let recorded = b.recorded_error();
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
        return Some(argument_error(
            b,
            &ErrorRecord { code: abi::ERR_INVALID_LAYOUT, rank: rank as u32, peer: peer as u32, elapsed_ns: which, ..Default::default() },
        ));
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

fn out_addr(t: &Option<TensorMut<'_>>) -> u64 {
    t.as_ref().map_or(0, |t| t.addr())
}

pub(crate) fn dispatch(b: &mut CudaBackend, plan: DispatchPlan, a: &DispatchArgs<'_>, out: DispatchOutputs<'_>) -> Result<HtDispatched> {
    if b.internode.is_some() {
        return super::ht_internode::dispatch(b, plan, a, out);
    }
    let s = plan.spec;
    let rank = s.rank;
    let num_out_rows = plan.num_recv_rows();
    let state = plan.state.into_cuda(rank)?;
    let addrs = dispatch_addrs(b, &s, a, &out)?;
    let region = region(b);
    let variant = HtDispatchVariant {
        release_batch: release_batch(&b.tuning),
        experiment: timing_experiment(&b.tuning),
        ..HtDispatchVariant::new(s.hidden, s.fp8, s.topk)
    };
    let slab_rows = region.slab_rows(variant.row_bytes());

    // The handle: a fresh dispatch builds it (routing from notify); a cached one re-uses it.
    let handle = match state {
        CudaPlan::Fresh { routing, host } => HandleData::New(CudaHtRouting { routing, host }),
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
        _ => (0, 0),
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
        recv_src_idx: addrs.recv_src_idx,
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
        num_send_blocks: dispatch_send_blocks(&b.tuning, s.num_sms) as u32,
        send_chunk: sender_chunk,
        recv_chunk: recv_chunk(&b.tuning),
        dynamic_send: dynamic_send(&b.tuning, sender_chunk),
        host_seq,
        trace: trace_begin(b, s.num_sms, HtDispatchVariant::WARPS)?,
    };
    let kernel = b.kernel(&variant.spec(), kernel_name::HT_DISPATCH)?;
    b.launch(&kernel, &LaunchConfig::linear(s.num_sms as u32, variant.threads()), &args)?;
    if let Some(t) = &out.rank_prefix_matrix {
        // SAFETY: the output was validated as a contiguous int32 [R, R] tensor of this device, and the routing
        // buffer (alive with the handle) holds R * R words at RANK_PREFIX, written by ht_notify earlier on
        // this stream.
        unsafe {
            b.op_stream().memcpy_dtod_async(t.addr(), r.routing.ptr() + 4 * routing::RANK_PREFIX as u64, 4 * s.num_ranks * s.num_ranks)?;
        }
    }
    finish(b, Phase::Dispatch)?;
    if args.trace != 0 {
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
            Arc::new(HtRouting::Cuda(r))
        }
        HandleData::Existing(data) => data,
    };
    Ok(HtDispatched { data, num_recv_tokens })
}

// ------------------------------------------------------------------------------------------ combine

pub(crate) fn combine(b: &mut CudaBackend, s: CombineSpec, a: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
    if b.internode.is_some() {
        return super::ht_internode::combine(b, s, a, out);
    }
    let rank = s.rank;
    let r = routing_of(&a.handle.data, rank)?;
    let c = combine_addrs(b, rank, a, &out)?;
    let variant = HtCombineVariant {
        num_biases: c.num_biases as u32,
        release_batch: release_batch(&b.tuning),
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
        num_send_blocks: combine_send_blocks(&b.tuning, s.num_sms) as u32,
        send_chunk: sender_chunk,
        recv_chunk: recv_chunk(&b.tuning),
        dynamic_send: dynamic_send(&b.tuning, sender_chunk),
        reserved: 0,
        trace: trace_begin(b, s.num_sms, HtCombineVariant::WARPS)?,
    };
    let kernel = b.kernel(&variant.spec(), kernel_name::HT_COMBINE)?;
    b.launch(&kernel, &LaunchConfig::linear(s.num_sms as u32, variant.threads()), &args)?;
    finish(b, Phase::Combine)?;
    if args.trace != 0 {
        trace_keep(b, kernel_name::HT_COMBINE, "combine", s.num_sms, HtCombineVariant::WARPS, args.num_send_blocks as usize);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sms_follow_the_formula() {
        assert_eq!(default_num_sms_for(132), 24);
        assert_eq!(default_num_sms_for(16), 16);
        assert_eq!(default_num_sms_for(17), 16);
        assert_eq!(default_num_sms_for(1), 2);
        let d = Tuning::default();
        for sms in (2..=132).step_by(2) {
            assert!(dispatch_send_blocks(&d, sms) >= 1 && dispatch_send_blocks(&d, sms) < sms);
            assert!(combine_send_blocks(&d, sms) >= 1 && combine_send_blocks(&d, sms) < sms);
        }
        assert_eq!((dispatch_send_blocks(&d, 24), combine_send_blocks(&d, 24)), (8, 8));
        assert_eq!([2, 8, 16, 64, 132].map(|n| dispatch_send_blocks(&d, n)), [1, 4, 8, 8, 8]);
        assert_eq!([8, 16, 64].map(default_send_blocks), [4, 8, 21]);
    }

    #[test]
    fn tuning_overrides_are_clamped_where_they_are_used() {
        let d = Tuning::default();
        assert_eq!(
            (release_batch(&d), recv_chunk(&d), reduce_load_vecs(&d)),
            (kht::DEFAULT_RELEASE_BATCH, kht::DEFAULT_RECV_CHUNK, HtCombineVariant::REDUCE_LOAD_VECS)
        );
        assert_eq!((send_chunk(&d, 4), dynamic_send(&d, 4), timing_experiment(&d)), (4, 1, 0));
        let t = Tuning {
            ht_dispatch_send_blocks: Some(99),
            ht_combine_send_blocks: Some(0),
            ht_release_batch: Some(100),
            ht_send_chunk: Some(5),
            ht_dynamic_send: Some(false),
            ht_reduce_load_vecs: Some(0),
            ht_timing_experiment: 7,
            ..d
        };
        assert_eq!((dispatch_send_blocks(&t, 24), combine_send_blocks(&t, 24)), (23, 1));
        assert_eq!((release_batch(&t), send_chunk(&t, 4), dynamic_send(&t, 4)), (64, 8, 0));
        assert_eq!((reduce_load_vecs(&t), timing_experiment(&t)), (1, 7));
        assert_eq!(send_chunk(&Tuning { ht_send_chunk: Some(0), ..Tuning::default() }, 4), 0, "0: contiguous parts");
    }

    #[test]
    fn argument_records_become_the_documented_errors() {
        let b = BufferShape { rank: 1, num_ranks: 4, num_nvl_bytes: 1 << 20 };
        let rec = |code, peer, d0, d1, phase| ErrorRecord { code, rank: 1, peer, phase, elapsed_ns: d0, timeout_ns: d1 };
        let e = argument_error_for(b, &rec(abi::ERR_INVALID_TOPK, abi::NO_PEER, (7 << 32) | 3, (-5i64) as u64, abi::phase::LAYOUT));
        assert!(matches!(&e, Error::InvalidArgument { arg: "topk_idx", rank: 1, reason } if reason.contains("[7, 3] = -5")), "{e}");
        let e = argument_error_for(b, &rec(abi::ERR_INVALID_LAYOUT, 1, 0, 0, abi::phase::NOTIFY));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_rank", reason, .. } if reason.contains("does not match")),
            "{e}"
        );
        let e = argument_error_for(b, &rec(abi::ERR_INVALID_LAYOUT, 3, 0, 0, abi::phase::NOTIFY));
        assert!(matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_rank", reason, .. } if reason.contains("rank 3")), "{e}");
        // Which layout argument: the notify kernel's per-expert check, the dispatch senders' top-k check.
        let e = argument_error_for(b, &rec(abi::ERR_INVALID_LAYOUT, 3, abi::layout_arg::PER_EXPERT, 0, abi::phase::NOTIFY));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason } if reason.contains("rank 3's num_tokens_per_expert")),
            "{e}"
        );
        let e = argument_error_for(b, &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::IN_RANK, 17, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "is_token_in_rank", rank: 1, reason } if reason.contains("token 17") && reason.contains("topk_idx")),
            "{e}"
        );
        assert!(!e.poisons_buffer());
        let e =
            argument_error_for(b, &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::EXPERT_TOKENS, (33 << 32) | 6, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason }
                if reason.contains("entry 33 is not 6") && reason.contains("selects expert 33")),
            "{e}"
        );
        assert!(!e.poisons_buffer());
        let e = argument_error_for(
            b,
            &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::RECV_EXPERT_TOKENS, (5 << 32) | 9, abi::phase::DISPATCH),
        );
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason }
                if reason.contains("9 rows arrived for local expert 5") && reason.contains("some rank")),
            "{e}"
        );
        let ours = CallSignature { hidden: 7168, num_experts: 256, topk: 8, fp8: true, has_topk: true, no_sync: false };
        let theirs = CallSignature { fp8: false, ..ours };
        let e = argument_error_for(
            b,
            &rec(abi::ERR_RANK_MISMATCH, 2, kht::call_signature(ours), kht::call_signature(theirs), abi::phase::NOTIFY),
        );
        assert!(matches!(&e, Error::RankMismatch { peer: 2, ours: o, theirs: t, .. } if o.contains("fp8") && t.contains("bf16")), "{e}");
        let row = kht::dispatch_row_bytes(7168, false, 8);
        let e = argument_error_for(b, &rec(abi::ERR_BUFFER_TOO_SMALL, abi::NO_PEER, 4096, ((row as u64) << 32) | 17, abi::phase::NOTIFY));
        match &e {
            Error::BufferTooSmall { what, needed, available, hint, .. } => {
                assert_eq!(*what, "HT dispatch receive slab");
                assert_eq!(*available, 1 << 20);
                assert!(HtRegion { num_nvl_bytes: *needed, num_ranks: 4 }.slab_rows(row) >= 4096);
                assert!(hint.contains("ht_bytes_needed"));
            }
            other => panic!("{other}"),
        }
        let e = argument_error_for(b, &rec(abi::ERR_BUFFER_TOO_SMALL, abi::NO_PEER, 10, (64 << 32) | 1, abi::phase::COMBINE));
        assert!(matches!(e, Error::BufferTooSmall { what: "HT combine receive slab", .. }));
        let e = argument_error_for(b, &rec(abi::ERR_RECV_OVERFLOW, abi::NO_PEER, 90, 64, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_worst_tokens", reason, .. } if reason.contains("90") && reason.contains("64"))
        );
        assert!(!e.poisons_buffer());
        let e = argument_error_for(b, &rec(99, abi::NO_PEER, 0, 0, abi::phase::OTHER));
        assert!(e.poisons_buffer(), "an unknown code must poison the buffer: {e}");
    }

    #[test]
    fn pool_classes() {
        assert_eq!(BufferPool::size_class(0), 4096);
        assert_eq!(BufferPool::size_class(4097), 8192);
        assert_eq!(BufferPool::size_class(routing::bytes(4096, 4)), 128 << 10);
    }
}
