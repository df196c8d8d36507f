//! Low-latency (decode) dispatch and combine: arguments, outputs, handles and validation.
//!
//! Semantics (every backend, bit for bit):
//! - Dispatch: every token goes once to each rank hosting one of its experts; there it is expanded into the
//!   packed per-expert layout `recv_x[e_local, slot, :]`. Within local expert `e_local`, rows are ordered
//!   by source rank, then by source token index; `recv_count[e_local]` rows are valid; the rest is unspecified.
//!   DeepEP's handle parts (optional outputs, [`LlDispatchOutputs`]): `src_info[e_local][n]` = row `n`'s
//!   token index on its source; `layout_range[e_local][j] = begin << 32 | count`, the rows from rank `j`.
//! - FP8 (`use_fp8`): per token and 128-channel group, `amax = max(max |x|, 1e-4)` in fp32; without
//!   `round_scale`: `scale = 448 / amax`, `scale_inv = amax / 448` (IEEE fp32 division); with `round_scale`:
//!   `scale_inv = 2^ceil(log2(amax / 448))` (exact, from the bits of the fp32 quotient) and `scale = 1 /
//!   scale_inv`; each value is `e4m3(x * scale)` (one fp32 multiply, then round-to-nearest-even with
//!   saturation to ±448, as `cvt.rn.satfinite.e4m3x2.f32`). Scales are stored as fp32 `scale_inv`, or with
//!   `use_ue8m0` as the exponent byte `log2(scale_inv) + 127`, four per int32 (little-endian: group 4j in the
//!   low byte). Scale tensors are column-major in their last two dimensions.
//! - Combine: `combined_x[t] = bf16(sum_k w[t,k] * y[t,k])` in fp32 over `k` with `topk_idx[t,k] != -1`,
//!   each term `w * y` rounded to fp32 before the add (no fused multiply-add), ascending `k`, from +0.0.
//!   When `topk_weights` were given at dispatch (an extension), each expert rank first reduces its own
//!   experts' terms for the token the same way and rounds that partial to bf16; the token's home rank then
//!   sums the partials in fp32 in ascending rank order and rounds to bf16. The two forms differ by at most
//!   one bf16 rounding of each partial; the oracle implements both exactly.

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ht::{BufferFacts, FP8_BLOCK};
use crate::tensor::{Location, TensorMut, TensorRef};
use crate::validate::{check_at_most, check_topk_columns, check_topk_values, read_i64_matrix, Expect, MAX_HIDDEN};
use moelink_kernels::ll::{LlLayout, LlLimits};

/// UE8M0 scales pack this many 128-channel groups into one int32.
pub const UE8M0_PER_INT: usize = 4;

/// How a low-latency dispatch encodes the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LlQuant {
    /// Send bf16 rows as they are.
    Bf16,
    /// Quantise to FP8 E4M3 per 128 channels.
    Fp8 { round_scale: bool, use_ue8m0: bool },
}

impl LlQuant {
    /// From DeepEP's three flags; `use_ue8m0` requires `round_scale` and `use_fp8`.
    pub fn from_flags(use_fp8: bool, round_scale: bool, use_ue8m0: bool, rank: usize) -> Result<LlQuant> {
        match (use_fp8, round_scale, use_ue8m0) {
            (false, false, false) => Ok(LlQuant::Bf16),
            (false, _, _) => Err(Error::invalid("use_fp8", rank, "round_scale/use_ue8m0 need use_fp8=True")),
            (true, false, true) => Err(Error::invalid("use_ue8m0", rank, "use_ue8m0 requires round_scale=True")),
            (true, round_scale, use_ue8m0) => Ok(LlQuant::Fp8 { round_scale, use_ue8m0 }),
        }
    }
    pub fn is_fp8(&self) -> bool {
        matches!(self, LlQuant::Fp8 { .. })
    }
    /// Columns of the scale tensor for rows of `hidden` channels: none (BF16), `hidden/128` (FP8 with
    /// `float32` scales) or `hidden/512` (UE8M0: four exponent bytes per `int32`).
    pub fn num_scale_cols(&self, hidden: usize) -> usize {
        match self {
            LlQuant::Bf16 => 0,
            LlQuant::Fp8 { use_ue8m0: false, .. } => hidden / FP8_BLOCK,
            LlQuant::Fp8 { use_ue8m0: true, .. } => hidden / FP8_BLOCK / UE8M0_PER_INT,
        }
    }
}

/// Arguments of a low-latency dispatch.
#[derive(Clone, Copy)]
pub struct LlDispatchArgs<'a> {
    /// `bf16 [T, H]`, contiguous, `T <= num_max_dispatch_tokens_per_rank`.
    pub x: TensorRef<'a>,
    /// `int64 [T, K]`.
    pub topk_idx: TensorRef<'a>,
    /// (ext) `float32 [T, K]`: lets combine pre-reduce on the expert side.
    pub topk_weights: Option<TensorRef<'a>>,
    pub num_max_dispatch_tokens_per_rank: usize,
    pub num_experts: usize,
    pub quant: LlQuant,
    /// Run only the send phase now; the receive phase runs when the returned hook is run.
    pub return_recv_hook: bool,
}

/// Where a low-latency dispatch writes.
pub struct LlDispatchOutputs<'a> {
    /// `[E_local, R*T_max, H]`, bf16 or float8_e4m3fn, contiguous.
    pub recv_x: TensorMut<'a>,
    /// FP8 only: `float32 [E_local, R*T_max, H/128]` or (UE8M0) `int32 [E_local, R*T_max, H/512]`, with
    /// strides `(packs*R*T_max, 1, R*T_max)`.
    pub recv_scales: Option<TensorMut<'a>>,
    /// `int32 [E_local]`.
    pub recv_count: TensorMut<'a>,
    /// `int32 [E_local]`, incremented by the per-expert counts.
    pub cumulative_local_expert_recv_stats: Option<TensorMut<'a>>,
    /// `int64 [R]`, incremented by the time (ns) spent waiting for each source rank.
    pub dispatch_wait_recv_cost_stats: Option<TensorMut<'a>>,
    /// DeepEP's handle, written by the receive phase with the rows (no host synchronisation):
    /// `int32 [E_local, R*T_max]`, `src_info[e][n]` = the source rank's index of the token in row `n` of
    /// local expert `e` (rows past `recv_count[e]` are left as they are).
    pub src_info: Option<TensorMut<'a>>,
    /// `int64 [E_local, R]`: `layout_range[e][j] = begin << 32 | count`, the rows `begin .. begin + count` of
    /// local expert `e` came from rank `j` (`begin` = the rows of lower ranks; masked ranks count 0).
    pub layout_range: Option<TensorMut<'a>>,
}

/// Validated low-latency dispatch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LlSpec {
    pub rank: usize,
    pub num_ranks: usize,
    pub num_tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub num_experts: usize,
    pub num_max_tokens: usize,
    pub quant: LlQuant,
    pub has_weights: bool,
    pub return_recv_hook: bool,
}

impl LlSpec {
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }
    /// Rows per local expert in the packed outputs: `R * T_max`.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.num_max_tokens
    }
    /// Columns of the scale tensor (`H/128`, or `H/512` for UE8M0).
    pub fn num_scale_cols(&self) -> usize {
        self.quant.num_scale_cols(self.hidden)
    }
}

/// Routing state of one low-latency dispatch. Opaque to callers.
#[derive(Clone)]
pub struct LlHandle {
    pub(crate) buffer_id: u64,
    pub(crate) spec: LlSpec,
    pub(crate) data: Arc<crate::opaque::BackendData>,
}

impl LlHandle {
    pub fn num_tokens(&self) -> usize {
        self.spec.num_tokens
    }
    pub fn hidden(&self) -> usize {
        self.spec.hidden
    }
    pub fn num_max_dispatch_tokens_per_rank(&self) -> usize {
        self.spec.num_max_tokens
    }
    pub fn num_experts(&self) -> usize {
        self.spec.num_experts
    }
    /// True when dispatch carried `topk_weights`, so combine pre-reduces on the expert side.
    pub fn pre_reduced(&self) -> bool {
        self.spec.has_weights
    }
}

/// Arguments of a low-latency combine.
#[derive(Clone, Copy)]
pub struct LlCombineArgs<'a> {
    /// `bf16 [E_local, R*T_max, H]` laid out like `recv_x` (ignored with `zero_copy`).
    pub x: TensorRef<'a>,
    /// `int64 [T, K]`, as given to dispatch.
    pub topk_idx: TensorRef<'a>,
    /// `float32 [T, K]`.
    pub topk_weights: TensorRef<'a>,
    pub handle: &'a LlHandle,
    /// The expert outputs were written into the buffer returned by `get_next_low_latency_combine_buffer`.
    pub zero_copy: bool,
    pub return_recv_hook: bool,
}

/// Where a low-latency combine writes.
pub struct LlCombineOutputs<'a> {
    /// `bf16 [T, H]`.
    pub combined_x: TensorMut<'a>,
    /// `int64 [R]`, incremented by the time (ns) spent waiting for each rank.
    pub combine_wait_recv_cost_stats: Option<TensorMut<'a>>,
}

/// Validated low-latency combine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LlCombineSpec {
    pub ll: LlSpec,
    pub zero_copy: bool,
    pub return_recv_hook: bool,
}

pub(crate) fn validate_ll_dispatch(a: &LlDispatchArgs<'_>, f: &BufferFacts) -> Result<LlSpec> {
    let (r, loc) = (f.rank, f.location);
    crate::ht::check_num_experts(a.num_experts, f)?;
    let shape = Expect { arg: "x", rank: r, location: loc, dtypes: &[DType::BF16], shape: &[None, None], contiguous: true }.view(&a.x)?;
    let (num_tokens, hidden) = (shape[0], shape[1]);
    if a.num_max_dispatch_tokens_per_rank == 0 {
        return Err(Error::invalid("num_max_dispatch_tokens_per_rank", r, "must be at least 1"));
    }
    if num_tokens > a.num_max_dispatch_tokens_per_rank {
        return Err(Error::invalid(
            "x",
            r,
            format!("{num_tokens} tokens exceed num_max_dispatch_tokens_per_rank = {}", a.num_max_dispatch_tokens_per_rank),
        ));
    }
    let group = match a.quant {
        LlQuant::Bf16 => 8,
        LlQuant::Fp8 { use_ue8m0: false, .. } => FP8_BLOCK,
        LlQuant::Fp8 { use_ue8m0: true, .. } => FP8_BLOCK * UE8M0_PER_INT,
    };
    if hidden == 0 || hidden % group != 0 {
        return Err(Error::invalid("x", r, format!("hidden {hidden} must be a positive multiple of {group} for this dispatch mode")));
    }
    check_at_most(hidden, MAX_HIDDEN, "x", r)?;
    let topk =
        Expect { arg: "topk_idx", rank: r, location: loc, dtypes: &[DType::I64], shape: &[Some(num_tokens), None], contiguous: true }
            .view(&a.topk_idx)?[1];
    check_topk_columns(topk, "topk_idx", r)?;
    // The kernels' limits (tokens, top-k, experts x tokens in shared memory) hold for every backend, so the
    // host oracle accepts exactly what the GPUs do — and no size argument can ask for an absurd allocation.
    let limits = LlLimits { num_ranks: f.num_ranks, max_tokens: a.num_max_dispatch_tokens_per_rank, topk, num_experts: a.num_experts };
    limits.check().map_err(|(arg, why)| Error::invalid(arg, r, why))?;
    if let Some(w) = &a.topk_weights {
        Expect {
            arg: "topk_weights",
            rank: r,
            location: loc,
            dtypes: &[DType::F32],
            shape: &[Some(num_tokens), Some(topk)],
            contiguous: true,
        }
        .view(w)?;
    }
    if let Some(v) = read_i64_matrix(&a.topk_idx) {
        check_topk_values(&v, topk, a.num_experts, "topk_idx", r)?;
    }
    let spec = LlSpec {
        rank: r,
        num_ranks: f.num_ranks,
        num_tokens,
        hidden,
        topk,
        num_experts: a.num_experts,
        num_max_tokens: a.num_max_dispatch_tokens_per_rank,
        quant: a.quant,
        has_weights: a.topk_weights.is_some(),
        return_recv_hook: a.return_recv_hook,
    };
    check_ll_buffer(f, &spec, false)?;
    Ok(spec)
}

/// The low-latency buffer rules of every backend: the buffer serves low-latency calls (`low_latency_mode`,
/// as DeepEP requires) and its `num_rdma_bytes` hold this shape's region (the zero-copy combine buffer too
/// with `with_staging`), laid out as the CUDA kernels use it.
pub(crate) fn check_ll_buffer(f: &BufferFacts, s: &LlSpec, with_staging: bool) -> Result<()> {
    check_low_latency_mode(f)?;
    checked_layout(f.num_rdma_bytes, s, with_staging).map(|_| ())
}

/// `Err` unless the buffer was created for low-latency calls.
pub(crate) fn check_low_latency_mode(f: &BufferFacts) -> Result<()> {
    if !f.low_latency_mode {
        return Err(Error::invalid(
            "low_latency_mode",
            f.rank,
            "low-latency calls need a Buffer created with low_latency_mode = true and num_rdma_bytes >= \
             Buffer::ll_bytes_needed(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)",
        ));
    }
    Ok(())
}

/// The layout of the low-latency region for `s`, after checking the kernels' limits and that a region of
/// `num_rdma_bytes` holds it (`with_staging`: the zero-copy combine buffer too).
pub(crate) fn checked_layout(num_rdma_bytes: usize, s: &LlSpec, with_staging: bool) -> Result<LlLayout> {
    let limits = LlLimits { num_ranks: s.num_ranks, max_tokens: s.num_max_tokens, topk: s.topk, num_experts: s.num_experts };
    limits.check().map_err(|(arg, why)| Error::invalid(arg, s.rank, why))?;
    let layout = LlLayout::new(s.num_ranks, s.num_max_tokens, s.hidden, s.topk, s.num_experts).ok_or_else(|| {
        Error::invalid("num_max_dispatch_tokens_per_rank", s.rank, "the low-latency buffer size overflows for this shape")
    })?;
    let needed = if with_staging { layout.bytes } else { layout.bytes_without_staging };
    if needed > num_rdma_bytes {
        // The size the message names is the one the function it names returns.
        let hint = crate::Buffer::ll_bytes_needed(s.num_max_tokens, s.hidden, s.num_ranks, s.num_experts).max(needed);
        return Err(Error::BufferTooSmall {
            rank: s.rank,
            what: if with_staging {
                "low-latency region with the zero-copy combine buffer (num_rdma_bytes)"
            } else {
                "low-latency region (num_rdma_bytes)"
            },
            needed,
            available: num_rdma_bytes,
            hint: format!(
                "create the Buffer with num_rdma_bytes >= Buffer::ll_bytes_needed({}, {}, {}, {}) = {hint}{}",
                s.num_max_tokens,
                s.hidden,
                s.num_ranks,
                s.num_experts,
                if hint > needed {
                    format!(
                        ", which is more than this call's {needed} because it also holds the zero-copy combine buffer and \
                         the layout across nodes, so that every low-latency call of this shape fits"
                    )
                } else {
                    String::new()
                }
            ),
        });
    }
    Ok(layout)
}

pub(crate) fn validate_ll_dispatch_outputs(s: &LlSpec, o: &LlDispatchOutputs<'_>, loc: Location) -> Result<()> {
    let r = s.rank;
    let (el, rows) = (s.num_local_experts(), s.rows_per_expert());
    let xd = if s.quant.is_fp8() { DType::Fp8E4M3 } else { DType::BF16 };
    Expect { arg: "recv_x", rank: r, location: loc, dtypes: &[xd], shape: &[Some(el), Some(rows), Some(s.hidden)], contiguous: true }
        .view_mut(&o.recv_x)?;
    match (&o.recv_scales, s.quant) {
        (None, LlQuant::Bf16) => {}
        (Some(_), LlQuant::Bf16) => return Err(Error::invalid("recv_x_scales", r, "a BF16 dispatch has no scales output")),
        (None, LlQuant::Fp8 { .. }) => return Err(Error::invalid("recv_x_scales", r, "an FP8 dispatch needs a scales output")),
        (Some(t), LlQuant::Fp8 { use_ue8m0, .. }) => {
            let dt = if use_ue8m0 { DType::I32 } else { DType::F32 };
            let cols = s.num_scale_cols();
            Expect {
                arg: "recv_x_scales",
                rank: r,
                location: loc,
                dtypes: &[dt],
                shape: &[Some(el), Some(rows), Some(cols)],
                contiguous: false,
            }
            .view_mut(t)?;
            let want = [(cols * rows) as isize, 1, rows as isize];
            if el > 0 && rows > 0 && cols > 0 && t.strides() != want {
                return Err(Error::invalid(
                    "recv_x_scales",
                    r,
                    format!(
                        "strides {:?}, expected column-major {want:?} (allocate [E_local, {cols}, {rows}] and transpose the last two dims)",
                        t.strides()
                    ),
                ));
            }
        }
    }
    Expect { arg: "recv_count", rank: r, location: loc, dtypes: &[DType::I32], shape: &[Some(el)], contiguous: true }
        .view_mut(&o.recv_count)?;
    if let Some(t) = &o.cumulative_local_expert_recv_stats {
        Expect {
            arg: "cumulative_local_expert_recv_stats",
            rank: r,
            location: loc,
            dtypes: &[DType::I32],
            shape: &[Some(el)],
            contiguous: true,
        }
        .view_mut(t)?;
    }
    if let Some(t) = &o.dispatch_wait_recv_cost_stats {
        Expect {
            arg: "dispatch_wait_recv_cost_stats",
            rank: r,
            location: loc,
            dtypes: &[DType::I64],
            shape: &[Some(s.num_ranks)],
            contiguous: true,
        }
        .view_mut(t)?;
    }
    if let Some(t) = &o.src_info {
        Expect { arg: "src_info", rank: r, location: loc, dtypes: &[DType::I32], shape: &[Some(el), Some(rows)], contiguous: true }
            .view_mut(t)?;
    }
    if let Some(t) = &o.layout_range {
        Expect {
            arg: "layout_range",
            rank: r,
            location: loc,
            dtypes: &[DType::I64],
            shape: &[Some(el), Some(s.num_ranks)],
            contiguous: true,
        }
        .view_mut(t)?;
    }
    Ok(())
}

pub(crate) fn validate_ll_combine(a: &LlCombineArgs<'_>, f: &BufferFacts) -> Result<LlCombineSpec> {
    let (r, loc) = (f.rank, f.location);
    let h = a.handle;
    if h.buffer_id != f.buffer_id || h.spec.rank != r {
        return Err(Error::invalid("handle", r, "the handle comes from another buffer (or another rank)"));
    }
    let s = h.spec;
    if !a.zero_copy {
        Expect {
            arg: "x",
            rank: r,
            location: loc,
            dtypes: &[DType::BF16],
            shape: &[Some(s.num_local_experts()), Some(s.rows_per_expert()), Some(s.hidden)],
            contiguous: true,
        }
        .view(&a.x)?;
    }
    Expect { arg: "topk_idx", rank: r, location: loc, dtypes: &[DType::I64], shape: &[Some(s.num_tokens), Some(s.topk)], contiguous: true }
        .view(&a.topk_idx)?;
    Expect {
        arg: "topk_weights",
        rank: r,
        location: loc,
        dtypes: &[DType::F32],
        shape: &[Some(s.num_tokens), Some(s.topk)],
        contiguous: true,
    }
    .view(&a.topk_weights)?;
    if let Some(v) = read_i64_matrix(&a.topk_idx) {
        check_topk_values(&v, s.topk, s.num_experts, "topk_idx", r)?;
    }
    check_ll_buffer(f, &s, a.zero_copy)?;
    Ok(LlCombineSpec { ll: s, zero_copy: a.zero_copy, return_recv_hook: a.return_recv_hook })
}

pub(crate) fn validate_ll_combine_outputs(s: &LlCombineSpec, o: &LlCombineOutputs<'_>, loc: Location) -> Result<()> {
    let r = s.ll.rank;
    Expect {
        arg: "out",
        rank: r,
        location: loc,
        dtypes: &[DType::BF16],
        shape: &[Some(s.ll.num_tokens), Some(s.ll.hidden)],
        contiguous: true,
    }
    .view_mut(&o.combined_x)?;
    if let Some(t) = &o.combine_wait_recv_cost_stats {
        Expect {
            arg: "combine_wait_recv_cost_stats",
            rank: r,
            location: loc,
            dtypes: &[DType::I64],
            shape: &[Some(s.ll.num_ranks)],
            contiguous: true,
        }
        .view_mut(t)?;
    }
    Ok(())
}
