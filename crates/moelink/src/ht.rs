//! High-throughput (training / prefill) dispatch and combine: arguments, outputs, handles and validation.
//!
//! Semantics (every backend, bit for bit):
//! - Dispatch sends token `t` to every rank `r` with `is_token_in_rank[t, r]`, once. Rank `r` receives rows
//!   ordered by source rank, then by the source's token order.
//! - `recv_topk_idx` holds local expert ids (`e - r * E_local`) for experts on the receiving rank and `-1`
//!   otherwise, with weight 0.0 where the id is `-1`.
//! - `num_recv_tokens_per_expert[e]` counts received tokens that selected local expert `e`, rounded up to
//!   `expert_alignment`.
//! - With `num_worst_tokens > 0` the outputs have exactly that many rows; rows past the received count have
//!   `recv_topk_idx = -1`, weight 0, and unspecified payload; the per-expert list is empty.
//! - DeepEP's handle parts (optional outputs, [`DispatchOutputs`]): `rank_prefix_matrix[i][j]` = tokens rank
//!   `j` receives from ranks `0..=i`; `recv_src_idx[n]` = row `n`'s token index on its source rank; on one
//!   node, `send_head[t][r]` = token `t`'s slot among the rows sent to `r` (-1: not sent) and the channel
//!   matrices ([`ChannelOutputs`]).
//! - Combine sums, for each original token and channel, the rows returned by every rank it was sent to, in
//!   fp32, by a pairwise tree over the buffer's topology ([`crate::reduce`]): leaves `v[r]` = rank `r`'s
//!   row (exact bf16 → fp32), +0.0 for a rank the token was not sent to; each node's `L` leaves summed by
//!   `tree(x_0..x_{2m-1}) = tree(x_0..x_{m-1}) + tree(x_m..x_{2m-1})` after padding with +0.0 to a power of
//!   two; the node partials summed by the same tree (padded likewise); then
//!   `bf16_rne(((+0.0 + T) + bias[0]) + bias[1])`, each bias converted to fp32 exactly (a lone `bias[1]`
//!   acts as `bias[0]`), every add an IEEE f32 add. A single-node buffer is one node of all `R` ranks. For
//!   power-of-two nodes and ranks per node the result does not depend on the topology (1×4 = 2×2,
//!   1×8 = 2×4 = 4×2); for other shapes it depends on the split. `combined_topk_weights` is the same tree
//!   over the ranks' `topk_weights` rows, `+0.0 + T`, without biases.

use std::sync::Arc;

use crate::config::Config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Location, TensorMut, TensorRef};
use crate::validate::{
    check_at_most, check_topk_columns, check_topk_values, read_i64_matrix, Expect, MAX_HIDDEN, MAX_LOCAL_EXPERTS, MAX_ROWS, MAX_TOPK,
};

/// FP8 scales cover this many channels each.
pub const FP8_BLOCK: usize = 128;

/// Token payload of a dispatch.
#[derive(Clone, Copy)]
pub enum Payload<'a> {
    /// `bf16 [T, H]`, contiguous.
    Bf16(TensorRef<'a>),
    /// `float8_e4m3fn [T, H]` contiguous, with `float32 [T, H/128]` scales of any strides.
    Fp8 { x: TensorRef<'a>, scales: TensorRef<'a> },
}

impl<'a> Payload<'a> {
    /// The hidden-state tensor.
    pub fn x(&self) -> &TensorRef<'a> {
        match self {
            Payload::Bf16(x) | Payload::Fp8 { x, .. } => x,
        }
    }
    pub fn is_fp8(&self) -> bool {
        matches!(self, Payload::Fp8 { .. })
    }
}

/// The tensors `get_dispatch_layout` returns, as inputs to a fresh dispatch.
#[derive(Clone, Copy)]
pub struct LayoutRef<'a> {
    /// `int32 [R]`.
    pub num_tokens_per_rank: TensorRef<'a>,
    /// `int32 [E]`.
    pub num_tokens_per_expert: TensorRef<'a>,
    /// `bool [T, R]`.
    pub is_token_in_rank: TensorRef<'a>,
}

/// Routing of a dispatch: fresh (layout exchange) or cached (re-use an earlier handle).
// A small Copy argument passed by reference; boxing the larger variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
pub enum Routing<'a> {
    Fresh {
        layout: LayoutRef<'a>,
        /// `int64 [T, K]`; together with `topk_weights` or not at all.
        topk_idx: Option<TensorRef<'a>>,
        /// `float32 [T, K]`.
        topk_weights: Option<TensorRef<'a>>,
    },
    Cached(&'a HtHandle),
}

/// Arguments of a high-throughput dispatch.
#[derive(Clone, Copy)]
pub struct DispatchArgs<'a> {
    pub x: Payload<'a>,
    pub routing: Routing<'a>,
    /// Per-expert counts are rounded up to this (>= 1).
    pub expert_alignment: usize,
    /// 0: CPU-synchronised, exact output sizes. >0: outputs have this many rows, no host synchronisation.
    pub num_worst_tokens: usize,
    pub config: Option<Config>,
}

/// Where a dispatch writes. Shapes: `recv_x [N, H]` (dtype of `x`), `recv_scales float32 [N, H/128]`
/// (FP8 only, contiguous), `recv_topk_idx int64 [N, K]`, `recv_topk_weights float32 [N, K]` (fresh dispatch
/// with top-k only); `N` is [`DispatchPlan::num_recv_rows`].
///
/// The optional handle outputs are the parts of DeepEP's dispatch handle that callers read (more of them, on
/// one node: [`ChannelOutputs`]); every
/// contiguous tensor of the stated shape works, written in stream order (no host synchronisation):
/// - `rank_prefix_matrix int32 [R, R]`: `[i][j]` = tokens rank `j` receives from ranks `0..=i`, so this
///   rank's rows from source `i` are `[i-1][rank] .. [i][rank]` of the outputs (from 0 for `i = 0`).
/// - `recv_src_idx int32 [N]`: the source rank's index of the token in each received row; rows past the
///   received count (no-sync mode) are left as they are.
pub struct DispatchOutputs<'a> {
    pub recv_x: TensorMut<'a>,
    pub recv_scales: Option<TensorMut<'a>>,
    pub recv_topk_idx: Option<TensorMut<'a>>,
    pub recv_topk_weights: Option<TensorMut<'a>>,
    pub rank_prefix_matrix: Option<TensorMut<'a>>,
    pub recv_src_idx: Option<TensorMut<'a>>,
    /// DeepEP's intranode handle elements about channels and send slots ([`ChannelOutputs`]); one node only.
    pub channels: Option<ChannelOutputs<'a>>,
}

/// The elements of DeepEP's intranode dispatch handle that moelink's routing implies, written by the dispatch
/// in stream order. Every contiguous `int32` tensor of the stated shape works; `C >= 1` is the caller's choice
/// (DeepEP: `config.num_sms / 2`), the same for both matrices. moelink sends each (source, destination) pair's
/// tokens as one ordered stream; in DeepEP's terms that is the last of `C` channels, the others empty.
/// - `send_head [T, R]`: token `t`'s slot among the rows this rank sends to rank `r` (it lands at row
///   `rank_prefix_matrix[rank - 1][r] + send_head[t][r]` of rank `r`'s outputs), `-1` where it is not sent.
/// - `channel_prefix_matrix [R, C]`: `[r][c]` = this rank's tokens for rank `r` in channels `0..=c`: 0 for
///   `c < C - 1`, all of them for `c = C - 1`.
/// - `recv_channel_prefix_matrix [R, C]`: where channel `c` of source `r` starts among the rows from `r`: 0.
pub struct ChannelOutputs<'a> {
    pub send_head: TensorMut<'a>,
    pub channel_prefix_matrix: TensorMut<'a>,
    pub recv_channel_prefix_matrix: TensorMut<'a>,
}

impl ChannelOutputs<'_> {
    /// The channel count `C` (validated by [`validate_dispatch_outputs`]).
    pub(crate) fn num_channels(&self) -> usize {
        self.channel_prefix_matrix.shape().get(1).copied().unwrap_or(0)
    }
}

/// A validated dispatch: sizes the caller needs to allocate outputs, and backend state between the count
/// exchange and the data movement.
pub struct DispatchPlan {
    pub(crate) spec: HtSpec,
    pub(crate) num_recv_tokens: Option<usize>,
    pub(crate) num_recv_tokens_per_expert: Vec<usize>,
    pub(crate) state: crate::opaque::BackendData,
}

impl DispatchPlan {
    /// Rows the outputs must have: the received count (CPU-sync) or `num_worst_tokens`.
    pub fn num_recv_rows(&self) -> usize {
        if self.spec.num_worst_tokens > 0 {
            self.spec.num_worst_tokens
        } else {
            self.num_recv_tokens.unwrap_or(0)
        }
    }
    /// Tokens this rank receives, when known on the host (CPU-sync mode).
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.num_recv_tokens
    }
    /// Received tokens per local expert, rounded up to `expert_alignment` (empty in no-sync mode).
    pub fn num_recv_tokens_per_expert(&self) -> &[usize] {
        &self.num_recv_tokens_per_expert
    }
    pub fn hidden(&self) -> usize {
        self.spec.hidden
    }
    pub fn topk(&self) -> usize {
        self.spec.topk
    }
    pub fn is_fp8(&self) -> bool {
        self.spec.fp8
    }
    pub fn has_topk(&self) -> bool {
        self.spec.has_topk
    }
}

/// Everything a backend needs to know about a validated dispatch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HtSpec {
    pub rank: usize,
    pub num_ranks: usize,
    pub num_tokens: usize,
    pub hidden: usize,
    pub num_experts: usize,
    /// 0 when no top-k travels with the tokens.
    pub topk: usize,
    pub has_topk: bool,
    pub fp8: bool,
    pub expert_alignment: usize,
    pub num_worst_tokens: usize,
    pub num_sms: usize,
}

impl HtSpec {
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }
    /// Payload bytes of one row (hidden states only).
    pub fn x_row_bytes(&self) -> usize {
        self.hidden * if self.fp8 { 1 } else { 2 }
    }
    pub fn num_scales(&self) -> usize {
        if self.fp8 {
            self.hidden / FP8_BLOCK
        } else {
            0
        }
    }
}

/// Routing state of one dispatch, needed by `combine` and by cached dispatch. Opaque to callers.
#[derive(Clone)]
pub struct HtHandle {
    pub(crate) buffer_id: u64,
    pub(crate) rank: usize,
    pub(crate) num_tokens: usize,
    pub(crate) num_experts: usize,
    pub(crate) num_recv_tokens: Option<usize>,
    pub(crate) num_worst_tokens: usize,
    pub(crate) data: Arc<crate::opaque::BackendData>,
}

impl HtHandle {
    /// Tokens this rank dispatched.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
    /// Tokens this rank received, when known on the host.
    pub fn num_recv_tokens(&self) -> Option<usize> {
        self.num_recv_tokens
    }
    /// Rows of the received tensors (`num_worst_tokens` in no-sync mode).
    pub fn num_recv_rows(&self) -> usize {
        if self.num_worst_tokens > 0 {
            self.num_worst_tokens
        } else {
            self.num_recv_tokens.unwrap_or(0)
        }
    }
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
}

/// Arguments of a high-throughput combine.
#[derive(Clone, Copy)]
pub struct CombineArgs<'a> {
    /// `bf16 [N, H]`, contiguous: one row per received token.
    pub x: TensorRef<'a>,
    pub handle: &'a HtHandle,
    /// `float32 [N, K]`: summed per original token into `combined_topk_weights`.
    pub topk_weights: Option<TensorRef<'a>>,
    /// Up to two `bf16 [T, H]` tensors added to the output.
    pub bias: [Option<TensorRef<'a>>; 2],
    pub config: Option<Config>,
}

/// Where a combine writes: `combined_x bf16 [T, H]`, `combined_topk_weights float32 [T, K]` (when
/// `topk_weights` was given).
pub struct CombineOutputs<'a> {
    pub combined_x: TensorMut<'a>,
    pub combined_topk_weights: Option<TensorMut<'a>>,
}

/// Validated combine.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CombineSpec {
    pub rank: usize,
    pub num_ranks: usize,
    pub num_tokens: usize,
    pub num_recv_rows: usize,
    pub hidden: usize,
    /// 0 when no weights.
    pub topk: usize,
    pub num_sms: usize,
}

pub(crate) struct BufferFacts {
    pub buffer_id: u64,
    pub rank: usize,
    pub num_ranks: usize,
    pub location: Location,
    pub default_num_sms: usize,
    pub max_num_sms: usize,
    /// The buffer's options that decide which low-latency calls fit it ([`BufferOptions`](crate::BufferOptions));
    /// the high-throughput capacity depends on every rank's tokens and is checked after the count exchange.
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
}

/// The [`Error::BufferTooSmall`] of a high-throughput call whose largest rank has `t_max` tokens in slab rows
/// of `row_bytes` (`what`: which slab), on a buffer of `num_nvl_bytes` per rank over `num_ranks` ranks.
pub(crate) fn ht_too_small(
    rank: usize,
    num_ranks: usize,
    num_nvl_bytes: usize,
    what: &'static str,
    t_max: usize,
    row_bytes: usize,
) -> Error {
    let needed = moelink_kernels::ht::bytes_needed(t_max, num_ranks, &[row_bytes]);
    Error::BufferTooSmall {
        rank,
        what,
        needed,
        available: num_nvl_bytes,
        hint: format!(
            "a rank has {t_max} tokens in {row_bytes}-byte rows; create the Buffer with num_nvl_bytes >= \
             Buffer::ht_bytes_needed(max tokens per rank, hidden, topk, {num_ranks}, fp8)"
        ),
    }
}

/// The capacity rule of every backend's high-throughput calls: a call fits when the rank with the most
/// tokens (`t_max`, a value every rank learns in the count exchange, so every rank decides alike) fits a
/// receive slab of the buffer's region ([`moelink_kernels::ht::HtRegion`], the layout the CUDA kernels use).
pub(crate) fn check_ht_capacity(
    rank: usize,
    num_ranks: usize,
    num_nvl_bytes: usize,
    what: &'static str,
    t_max: usize,
    row_bytes: usize,
) -> Result<()> {
    let region = moelink_kernels::ht::HtRegion { num_nvl_bytes, num_ranks };
    if t_max > region.slab_rows(row_bytes) {
        return Err(ht_too_small(rank, num_ranks, num_nvl_bytes, what, t_max, row_bytes));
    }
    Ok(())
}

fn check_config(cfg: &Option<Config>, f: &BufferFacts) -> Result<usize> {
    let num_sms = cfg.map_or(f.default_num_sms, |c| c.num_sms);
    if num_sms < 2 || num_sms % 2 != 0 {
        return Err(Error::invalid("config.num_sms", f.rank, format!("{num_sms}: must be even and at least 2")));
    }
    if num_sms > f.max_num_sms {
        // A persistent grid larger than the rank's share of a GPU it shares with other ranks cannot be
        // resident together with theirs: its blocks would wait for peers' blocks that wait for SMs.
        return Err(Error::invalid(
            "config.num_sms",
            f.rank,
            format!("{num_sms}: more than the {} SMs this rank may use (Buffer::max_num_sms: its GPU's SMs, divided among the ranks that share that GPU)", f.max_num_sms),
        ));
    }
    Ok(num_sms)
}

fn check_handle(h: &HtHandle, f: &BufferFacts) -> Result<()> {
    if h.buffer_id != f.buffer_id || h.rank != f.rank {
        return Err(Error::invalid("handle", f.rank, "the handle comes from another buffer (or another rank)"));
    }
    Ok(())
}

/// Validates the arguments of `get_dispatch_layout`; returns `(num_tokens, topk)`.
pub(crate) fn validate_layout(topk_idx: &TensorRef<'_>, num_experts: usize, f: &BufferFacts) -> Result<(usize, usize)> {
    let r = f.rank;
    let shape = Expect { arg: "topk_idx", rank: r, location: f.location, dtypes: &[DType::I64], shape: &[None, None], contiguous: false }
        .view(topk_idx)?;
    let (t, k) = (shape[0], shape[1]);
    check_at_most(t, MAX_ROWS, "topk_idx", r)?;
    check_topk_columns(k, "topk_idx", r)?;
    check_num_experts(num_experts, f)?;
    if let Some(idx) = read_i64_matrix(topk_idx) {
        check_topk_values(&idx, k, num_experts, "topk_idx", r)?;
    }
    Ok((t, k))
}

pub(crate) fn check_num_experts(num_experts: usize, f: &BufferFacts) -> Result<()> {
    if num_experts == 0 || num_experts % f.num_ranks != 0 {
        return Err(Error::invalid(
            "num_experts",
            f.rank,
            format!("{num_experts} is not a positive multiple of the {} ranks", f.num_ranks),
        ));
    }
    if num_experts / f.num_ranks > MAX_LOCAL_EXPERTS {
        return Err(Error::invalid(
            "num_experts",
            f.rank,
            format!("{} experts per rank exceed the supported {MAX_LOCAL_EXPERTS}", num_experts / f.num_ranks),
        ));
    }
    Ok(())
}

/// Validates a dispatch. Reads `topk_idx` values when it lives on the host.
pub(crate) fn validate_dispatch(a: &DispatchArgs<'_>, f: &BufferFacts) -> Result<HtSpec> {
    let r = f.rank;
    let loc = f.location;
    let num_sms = check_config(&a.config, f)?;
    let (x, fp8) = match a.x {
        Payload::Bf16(x) => (x, false),
        Payload::Fp8 { x, .. } => (x, true),
    };
    let want = if fp8 { DType::Fp8E4M3 } else { DType::BF16 };
    let shape = Expect { arg: "x", rank: r, location: loc, dtypes: &[want], shape: &[None, None], contiguous: true }.view(&x)?;
    let (num_tokens, hidden) = (shape[0], shape[1]);
    check_at_most(num_tokens, MAX_ROWS, "x", r)?;
    check_at_most(hidden, MAX_HIDDEN, "x", r)?;
    let row_bytes = hidden * want.size_bytes();
    if hidden == 0 || row_bytes % 16 != 0 {
        return Err(Error::invalid("x", r, format!("row bytes {row_bytes} (hidden {hidden} x {want}) must be a positive multiple of 16")));
    }
    if let Payload::Fp8 { scales, .. } = a.x {
        if hidden % FP8_BLOCK != 0 {
            return Err(Error::invalid("x", r, format!("FP8 hidden {hidden} must be a multiple of {FP8_BLOCK}")));
        }
        Expect {
            arg: "x_scales",
            rank: r,
            location: loc,
            dtypes: &[DType::F32],
            shape: &[Some(num_tokens), Some(hidden / FP8_BLOCK)],
            contiguous: false,
        }
        .view(&scales)?;
    }
    if a.expert_alignment == 0 {
        return Err(Error::invalid("expert_alignment", r, "must be at least 1"));
    }
    check_at_most(a.expert_alignment, MAX_ROWS, "expert_alignment", r)?;
    check_at_most(a.num_worst_tokens, MAX_ROWS, "num_worst_tokens", r)?;
    let (num_experts, topk, has_topk) = match a.routing {
        Routing::Fresh { layout, topk_idx, topk_weights } => {
            Expect {
                arg: "num_tokens_per_rank",
                rank: r,
                location: loc,
                dtypes: &[DType::I32],
                shape: &[Some(f.num_ranks)],
                contiguous: true,
            }
            .view(&layout.num_tokens_per_rank)?;
            let e =
                Expect { arg: "num_tokens_per_expert", rank: r, location: loc, dtypes: &[DType::I32], shape: &[None], contiguous: true }
                    .view(&layout.num_tokens_per_expert)?[0];
            check_num_experts(e, f).map_err(|err| match err {
                Error::InvalidArgument { rank, reason, .. } => Error::InvalidArgument { arg: "num_tokens_per_expert", rank, reason },
                other => other,
            })?;
            Expect {
                arg: "is_token_in_rank",
                rank: r,
                location: loc,
                dtypes: &[DType::Bool],
                shape: &[Some(num_tokens), Some(f.num_ranks)],
                contiguous: true,
            }
            .view(&layout.is_token_in_rank)?;
            match (topk_idx, topk_weights) {
                (Some(idx), Some(w)) => {
                    let k = Expect {
                        arg: "topk_idx",
                        rank: r,
                        location: loc,
                        dtypes: &[DType::I64],
                        shape: &[Some(num_tokens), None],
                        contiguous: true,
                    }
                    .view(&idx)?[1];
                    check_topk_columns(k, "topk_idx", r)?;
                    Expect {
                        arg: "topk_weights",
                        rank: r,
                        location: loc,
                        dtypes: &[DType::F32],
                        shape: &[Some(num_tokens), Some(k)],
                        contiguous: true,
                    }
                    .view(&w)?;
                    if let Some(v) = read_i64_matrix(&idx) {
                        check_topk_values(&v, k, e, "topk_idx", r)?;
                    }
                    (e, k, true)
                }
                (None, None) => (e, 0, false),
                (Some(_), None) => return Err(Error::invalid("topk_weights", r, "topk_idx was given without topk_weights")),
                (None, Some(_)) => return Err(Error::invalid("topk_idx", r, "topk_weights was given without topk_idx")),
            }
        }
        Routing::Cached(h) => {
            check_handle(h, f)?;
            if h.num_tokens != num_tokens {
                return Err(Error::invalid("x", r, format!("{num_tokens} tokens, but the cached handle dispatched {}", h.num_tokens)));
            }
            (h.num_experts, 0, false)
        }
    };
    let num_worst_tokens = match a.routing {
        Routing::Cached(h) => h.num_worst_tokens,
        Routing::Fresh { .. } => a.num_worst_tokens,
    };
    Ok(HtSpec {
        rank: r,
        num_ranks: f.num_ranks,
        num_tokens,
        hidden,
        num_experts,
        topk,
        has_topk,
        fp8,
        expert_alignment: a.expert_alignment,
        num_worst_tokens,
        num_sms,
    })
}

/// Validates dispatch outputs against a plan.
pub(crate) fn validate_dispatch_outputs(p: &DispatchPlan, o: &DispatchOutputs<'_>, loc: Location, num_nodes: usize) -> Result<()> {
    let s = &p.spec;
    let (r, n) = (s.rank, p.num_recv_rows());
    let xd = if s.fp8 { DType::Fp8E4M3 } else { DType::BF16 };
    Expect { arg: "recv_x", rank: r, location: loc, dtypes: &[xd], shape: &[Some(n), Some(s.hidden)], contiguous: true }
        .view_mut(&o.recv_x)?;
    match (&o.recv_scales, s.fp8) {
        (Some(t), true) => {
            Expect {
                arg: "recv_x_scales",
                rank: r,
                location: loc,
                dtypes: &[DType::F32],
                shape: &[Some(n), Some(s.num_scales())],
                contiguous: true,
            }
            .view_mut(t)?;
        }
        (None, true) => return Err(Error::invalid("recv_x_scales", r, "FP8 dispatch needs a scales output")),
        (Some(_), false) => return Err(Error::invalid("recv_x_scales", r, "BF16 dispatch has no scales output")),
        (None, false) => {}
    }
    for (arg, t, dt) in [("recv_topk_idx", &o.recv_topk_idx, DType::I64), ("recv_topk_weights", &o.recv_topk_weights, DType::F32)] {
        match (t, s.has_topk) {
            (Some(t), true) => {
                Expect { arg, rank: r, location: loc, dtypes: &[dt], shape: &[Some(n), Some(s.topk)], contiguous: true }.view_mut(t)?;
            }
            (None, true) => return Err(Error::invalid(arg, r, "a dispatch with top-k needs this output")),
            (Some(_), false) => return Err(Error::invalid(arg, r, "a dispatch without top-k has no such output")),
            (None, false) => {}
        }
    }
    let nr = s.num_ranks;
    if let Some(t) = &o.rank_prefix_matrix {
        Expect { arg: "rank_prefix_matrix", rank: r, location: loc, dtypes: &[DType::I32], shape: &[Some(nr), Some(nr)], contiguous: true }
            .view_mut(t)?;
    }
    if let Some(t) = &o.recv_src_idx {
        Expect { arg: "recv_src_idx", rank: r, location: loc, dtypes: &[DType::I32], shape: &[Some(n)], contiguous: true }.view_mut(t)?;
    }
    if let Some(c) = &o.channels {
        if num_nodes > 1 {
            return Err(Error::invalid(
                "send_head",
                r,
                format!("DeepEP's intranode handle elements; a buffer over {num_nodes} nodes returns the internode handle"),
            ));
        }
        let i32_matrix = |arg: &'static str, t: &TensorMut<'_>, rows: usize, cols: Option<usize>| {
            Expect { arg, rank: r, location: loc, dtypes: &[DType::I32], shape: &[Some(rows), cols], contiguous: true }
                .view_mut(t)
                .map(|shape| shape[1])
        };
        i32_matrix("send_head", &c.send_head, s.num_tokens, Some(nr))?;
        let cols = i32_matrix("channel_prefix_matrix", &c.channel_prefix_matrix, nr, None)?;
        if cols == 0 || cols > u32::MAX as usize {
            return Err(Error::invalid("channel_prefix_matrix", r, format!("{cols} channels; needs 1 to {}", u32::MAX)));
        }
        i32_matrix("recv_channel_prefix_matrix", &c.recv_channel_prefix_matrix, nr, Some(cols))?;
    }
    Ok(())
}

/// Validates a combine.
pub(crate) fn validate_combine(a: &CombineArgs<'_>, f: &BufferFacts) -> Result<CombineSpec> {
    let r = f.rank;
    let loc = f.location;
    let num_sms = check_config(&a.config, f)?;
    check_handle(a.handle, f)?;
    let n = a.handle.num_recv_rows();
    let hidden =
        Expect { arg: "x", rank: r, location: loc, dtypes: &[DType::BF16], shape: &[Some(n), None], contiguous: true }.view(&a.x)?[1];
    check_at_most(hidden, MAX_HIDDEN, "x", r)?;
    if hidden == 0 || (hidden * 2) % 16 != 0 {
        return Err(Error::invalid("x", r, format!("hidden {hidden}: row bytes must be a positive multiple of 16")));
    }
    let topk = match &a.topk_weights {
        Some(w) => Expect { arg: "topk_weights", rank: r, location: loc, dtypes: &[DType::F32], shape: &[Some(n), None], contiguous: true }
            .view(w)?[1],
        None => 0,
    };
    check_at_most(topk, MAX_TOPK, "topk_weights", r)?;
    let t = a.handle.num_tokens;
    let mut num_bias = 0;
    for (i, b) in a.bias.iter().enumerate() {
        if let Some(b) = b {
            if i != num_bias {
                return Err(Error::invalid("bias", r, "bias[1] given without bias[0]"));
            }
            Expect { arg: "bias", rank: r, location: loc, dtypes: &[DType::BF16], shape: &[Some(t), Some(hidden)], contiguous: true }
                .view(b)?;
            num_bias += 1;
        }
    }
    Ok(CombineSpec { rank: r, num_ranks: f.num_ranks, num_tokens: t, num_recv_rows: n, hidden, topk, num_sms })
}

/// Validates combine outputs.
pub(crate) fn validate_combine_outputs(s: &CombineSpec, o: &CombineOutputs<'_>, loc: Location) -> Result<()> {
    let r = s.rank;
    Expect {
        arg: "combined_x",
        rank: r,
        location: loc,
        dtypes: &[DType::BF16],
        shape: &[Some(s.num_tokens), Some(s.hidden)],
        contiguous: true,
    }
    .view_mut(&o.combined_x)?;
    match (&o.combined_topk_weights, s.topk) {
        (Some(t), k) if k > 0 => {
            Expect {
                arg: "combined_topk_weights",
                rank: r,
                location: loc,
                dtypes: &[DType::F32],
                shape: &[Some(s.num_tokens), Some(k)],
                contiguous: true,
            }
            .view_mut(t)?;
        }
        (None, 0) => {}
        (None, _) => return Err(Error::invalid("combined_topk_weights", r, "combine with topk_weights needs this output")),
        (Some(_), _) => return Err(Error::invalid("combined_topk_weights", r, "combine without topk_weights has no such output")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(max_num_sms: usize) -> BufferFacts {
        BufferFacts {
            buffer_id: 1,
            rank: 3,
            num_ranks: 4,
            location: Location::Cuda(0),
            default_num_sms: 24,
            max_num_sms,
            num_rdma_bytes: 0,
            low_latency_mode: false,
        }
    }

    #[test]
    fn num_sms_is_even_and_within_the_ranks_share() {
        assert_eq!(check_config(&None, &facts(132)).unwrap(), 24);
        assert_eq!(check_config(&Some(Config::with_sms(132)), &facts(132)).unwrap(), 132);
        assert_eq!(check_config(&Some(Config::with_sms(32)), &facts(33)).unwrap(), 32);
        for (sms, max) in [(34, 33), (64, 33), (3, 132), (0, 132)] {
            let e = check_config(&Some(Config::with_sms(sms)), &facts(max)).unwrap_err();
            assert_eq!(e.argument(), Some("config.num_sms"), "{sms} of {max}: {e}");
            assert!(e.to_string().contains("rank 3"), "{e}");
        }
        let e = check_config(&Some(Config::with_sms(64)), &facts(33)).unwrap_err().to_string();
        assert!(e.contains("more than the 33 SMs"), "{e}");
    }
}
