//! The low-latency families (`cuda/ll.cuh`, `cuda/ll_dispatch.cu`, `cuda/ll_combine.cu`): their compile key
//! ([`LlVariant`]), the Rust mirrors of the structs
//! the kernels share with the host ([`LlCtrl`], [`LlReport`], [`LlDispatchArgs`], [`LlCombineArgs`]), and the
//! layout of the low-latency data region ([`LlLayout`]) — the one place where its offsets are computed; the
//! kernels receive them as arguments.
//!
//! Limits of the kernels ([`LlLimits::check`]): top-k ≤ 32, `num_experts × (ceil(T_max / 32) + 1) ≤
//! LL_SMEM_WORDS` (the dispatch sender's token bitmaps per expert, in shared memory, with room for the
//! receiver's bases), `T_max ≤ 65535` (a dispatch entry packs an expert id and a token rank in 16 bits each).

use bytemuck::{NoUninit, Pod, Zeroable};
use moelink_cuda::{DevPtr, DevPtrs};

use crate::abi::MAX_RANKS;
use crate::{Family, KernelSpec};

/// `cuda/ll.cuh`: what the low-latency families share (constants, structs, the protocol's frame).
pub const LL_HEADER: &str = include_str!("../cuda/ll.cuh");
/// `cuda/ll_dispatch.cu`.
pub const LL_DISPATCH_SOURCE: &str = include_str!("../cuda/ll_dispatch.cu");
/// `cuda/ll_combine.cu`.
pub const LL_COMBINE_SOURCE: &str = include_str!("../cuda/ll_combine.cu");

/// Threads per block of both kernels.
pub const LL_THREADS: u32 = 512;
/// u32 words of shared scratch per block (the dispatch sender's token bitmaps, the receiver's bases); with the rest of
/// the block's shared state it stays under the 48 KB of static shared memory.
pub const LL_SMEM_WORDS: u32 = 12032;
/// Largest top-k the kernels support (one lane per slot).
pub const LL_MAX_TOPK: usize = 32;
/// Largest `num_max_dispatch_tokens_per_rank` (a bound on the index arithmetic; shared memory bounds it
/// further, see [`LlLimits::check`]).
pub const LL_MAX_TOKENS: usize = 0xffff;
/// Words of the call signature compared across ranks (`LlMeta::sig`).
pub const LL_SIG_WORDS: usize = 8;
/// Top-k assumed by [`LlLayout::bytes_hint`] (DeepEP's size hint has no top-k argument).
pub const LL_HINT_TOPK: usize = 16;

/// Timing trace (`moelink::KernelTracing::low_latency`): u64 words per block, and the point each word stamps (`LL_TRACE_*` in
/// `ll.cuh`), in the order a block passes them. A kernel family's trace holds `2 * LL_TRACE_CALLS` launch
/// slots (`(epoch % LL_TRACE_CALLS) * 2 + receive-only`) of `grid` rows of `LL_TRACE_WORDS`.
pub const LL_TRACE_WORDS: usize = 12;
pub const LL_TRACE_CALLS: usize = 16;
pub const LL_TRACE_POINTS: [&str; 12] = [
    "start",
    "send_ready",
    "send_issued",
    "send_stored",
    "send_done",
    "recv_seen",
    "recv_stored",
    "end",
    "index_checked",
    "recv_indexed",
    "send_built",
    "send_routed",
];

/// Names of the signature words, in the order the host checks them (`LlMeta::sig`).
pub const SIG_FIELDS: [&str; 6] = ["hidden", "topk", "num_experts", "num_max_dispatch_tokens_per_rank", "quant", "topk_weights"];

/// Timing experiments, the bits of [`LlVariant::experiment`] (JIT constant `LL_EXPERIMENT`; 0 in every real
/// call). A variant with any bit set is a different build, so an experiment can never slip into a real run
/// unseen; [`experiment::WRONG_RESULTS`] bits also make the results wrong.
pub mod experiment {
    /// The send phases store their rows into the sender's own region (what NVLink adds shows).
    pub const LOCAL_STORES: u32 = 1;
    /// The send phases do not load their payload rows (x, y) and send zeros (what the loads take shows).
    pub const NO_LOADS: u32 = 2;
    /// The last block of a send phase arrives at every rank for the whole grid, instead of every block on
    /// its own (results stay right).
    pub const LAST_ARRIVES: u32 = 4;
    /// Experiments whose results are wrong by design.
    pub const WRONG_RESULTS: u32 = LOCAL_STORES | NO_LOADS;
    /// Every experiment by name (`MOELINK_LL_EXPERIMENT`'s words).
    pub const NAMES: [(&str, u32); 3] = [("local_stores", LOCAL_STORES), ("no_loads", NO_LOADS), ("last_arrives", LAST_ARRIVES)];

    /// The comma-separated names of `bits` (`""` for none).
    pub fn names(bits: u32) -> String {
        NAMES.iter().filter(|(_, b)| bits & b != 0).map(|(n, _)| *n).collect::<Vec<_>>().join(",")
    }
}

/// `LlXArgs::phases`.
pub mod phase {
    /// Write into the peers and publish the flags.
    pub const SEND: u32 = 1;
    /// Wait for the peers and write the outputs.
    pub const RECV: u32 = 2;
    /// Publish the consumed flags of a receive phase that will never run.
    pub const DRAIN: u32 = 4;
}

/// `LlXArgs::flags`.
pub mod flag {
    /// FP8 scales are powers of two.
    pub const ROUND_SCALE: u32 = 1;
    /// FP8 scales are stored as UE8M0 bytes, four per int32.
    pub const UE8M0: u32 = 2;
    /// Dispatch carried top-k weights: combine pre-reduces on the expert side.
    pub const WEIGHTS: u32 = 4;
    /// Shrink mode: a peer that misses the deadline is masked instead of failing the call.
    pub const SHRINK: u32 = 8;
}

/// Argument problems (`LlReport`, `LlMeta::problem`).
pub mod problem {
    /// Dispatch: an id outside `[-1, E)` or an expert twice in a row.
    pub const TOPK_IDX: u32 = 1;
    /// Combine: `topk_idx` differs from dispatch's.
    pub const TOPK_IDX_DIFFERS: u32 = 2;
    /// Combine (pre-reduced): `topk_weights` differ from dispatch's.
    pub const WEIGHTS_DIFFER: u32 = 4;
    /// Combine: `zero_copy` without a zero-copy buffer of the handle's shape.
    pub const ZERO_COPY: u32 = 8;
    /// Combine: the handle expired or its dispatch's receive hook did not run.
    pub const HANDLE: u32 = 16;
}

/// The compile key of the low-latency families: both kernels of a variant are compiled with the same
/// constants ([`LlVariant::dispatch_spec`], [`LlVariant::combine_spec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LlVariant {
    /// Hidden size (bf16 channels per token).
    pub hidden: u32,
    /// Experts per token.
    pub topk: u32,
    /// Dispatch quantises to FP8 (else bf16 rows).
    pub fp8: bool,
    /// Timing experiments ([`experiment`] bits); 0 in every real call.
    pub experiment: u32,
}

impl LlVariant {
    /// The variant of a real call (no experiment).
    pub fn new(hidden: u32, topk: u32, fp8: bool) -> LlVariant {
        LlVariant { hidden, topk, fp8, experiment: 0 }
    }

    /// The compile key of `ll_dispatch.cu`.
    pub fn dispatch_spec(&self) -> KernelSpec {
        self.spec(Family::LlDispatch)
    }

    /// The compile key of `ll_combine.cu`.
    pub fn combine_spec(&self) -> KernelSpec {
        self.spec(Family::LlCombine)
    }

    fn spec(&self, family: Family) -> KernelSpec {
        let name = match family {
            Family::LlCombine => "ll_combine",
            _ => "ll_dispatch",
        };
        KernelSpec {
            family,
            variant: format!("{name}[h{},k{},{},x{}]", self.hidden, self.topk, if self.fp8 { "fp8" } else { "bf16" }, self.experiment),
            defines: vec![
                ("MAX_RANKS".into(), MAX_RANKS.to_string()),
                ("LL_HIDDEN".into(), self.hidden.to_string()),
                ("LL_TOPK".into(), self.topk.to_string()),
                ("LL_FP8".into(), u32::from(self.fp8).to_string()),
                ("LL_THREADS".into(), LL_THREADS.to_string()),
                ("LL_SMEM_WORDS".into(), LL_SMEM_WORDS.to_string()),
                ("LL_EXPERIMENT".into(), self.experiment.to_string()),
                ("MOELINK_SIZEOF_LL_DISPATCH_ARGS".into(), std::mem::size_of::<LlDispatchArgs>().to_string()),
                ("MOELINK_SIZEOF_LL_COMBINE_ARGS".into(), std::mem::size_of::<LlCombineArgs>().to_string()),
                ("MOELINK_SIZEOF_LL_CTRL".into(), std::mem::size_of::<LlCtrl>().to_string()),
                ("MOELINK_SIZEOF_LL_REPORT".into(), std::mem::size_of::<LlReport>().to_string()),
            ],
        }
    }

    /// The variants the tests and the benchmark use: hidden 2048/7168 × top-k 1..=8 × {bf16, fp8}, the
    /// small shapes of `crates/moelink/tests/ll.rs`, and DeepEP's benchmark shape (7168, top-8).
    pub fn all() -> Vec<LlVariant> {
        let mut v = Vec::new();
        for hidden in [2048, 7168] {
            for topk in 1..=8 {
                for fp8 in [false, true] {
                    v.push(LlVariant::new(hidden, topk, fp8));
                }
            }
        }
        for (hidden, topk) in [(128, 2), (256, 2), (256, 4), (512, 4), (512, 6), (1024, 4), (1024, 8)] {
            for fp8 in [false, true] {
                v.push(LlVariant::new(hidden, topk, fp8));
            }
        }
        // Every experiment compiles (at DeepEP's benchmark shape, where they are used).
        for bits in [experiment::LOCAL_STORES, experiment::NO_LOADS, experiment::LAST_ARRIVES] {
            v.push(LlVariant { experiment: bits, ..LlVariant::new(7168, 8, true) });
        }
        v
    }
}

/// Per-source metadata line (`LlMeta` in `ll.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LlMeta {
    pub num_tokens: u32,
    pub problem: u32,
    pub reserved: [u32; 2],
    pub sig: [u32; LL_SIG_WORDS],
    /// Combine: the source's epoch, argument problems and acceptance in one word (`ll_combine_status`).
    pub status: u64,
    pub pad: [u32; 2],
}

/// Arrival words per (buffer set, source), each on its own 128-byte line (`LL_ARRIVE_LANES` in `ll.cuh`).
pub const LL_ARRIVE_LANES: usize = 8;

/// One arrival word and the rest of its line (`LlArriveLine` in `ll.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct LlArriveLine {
    pub word: u32,
    pub pad: [u32; 31],
}

/// A rank's low-latency control area (`LlCtrl` in `ll.cuh`), at `ctrl::LL` of its symmetric buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct LlCtrl {
    pub dispatch_epoch: u32,
    pub combine_epoch: u32,
    pub dispatch_send_done: u32,
    pub combine_send_done: u32,
    pub dispatch_last_write: [u32; 2],
    pub combine_last_write: [u32; 2],
    pub dispatch_prev_write: [u32; 2],
    pub combine_prev_write: [u32; 2],
    pub pad0: [u32; 4],
    pub decision: [[u32; MAX_RANKS]; 2],
    pub dispatch_arrive: [[[LlArriveLine; LL_ARRIVE_LANES]; MAX_RANKS]; 2],
    pub combine_arrive: [[[LlArriveLine; LL_ARRIVE_LANES]; MAX_RANKS]; 2],
    pub dispatch_consumed: [[[LlArriveLine; LL_ARRIVE_LANES]; MAX_RANKS]; 2],
    pub combine_consumed: [[[LlArriveLine; LL_ARRIVE_LANES]; MAX_RANKS]; 2],
    pub dispatch_meta: [[LlMeta; MAX_RANKS]; 2],
    pub combine_meta: [[LlMeta; MAX_RANKS]; 2],
    pub mask: [u32; MAX_RANKS],
    pub pad1: [u32; 8],
}

impl LlCtrl {
    /// Bytes of the control area.
    pub const BYTES: usize = std::mem::size_of::<LlCtrl>();
    /// Offset of `mask`: `clean_low_latency_buffer` zeroes `[0, MASK_OFFSET)` and keeps the mask.
    pub const MASK_OFFSET: usize = std::mem::offset_of!(LlCtrl, mask);
}

/// What a rank's kernels report to its host (`LlReport` in `ll.cuh`, host-mapped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct LlReport {
    /// [`problem`] bits of this rank's own arguments.
    pub own_problem: u32,
    /// 1 + the first peer whose call signature differs, or 0.
    pub mismatch_peer: u32,
    /// Index into [`SIG_FIELDS`].
    pub mismatch_field: u32,
    /// 1 + the first peer that reported an argument problem, or 0.
    pub peer_problem_peer: u32,
    /// That peer's [`problem`] bits.
    pub peer_problem: u32,
    pub pad: [u32; 3],
    pub mismatch_ours: u64,
    pub mismatch_theirs: u64,
}

/// Argument of `ll_dispatch` (`LlDispatchArgs` in `ll.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct LlDispatchArgs {
    /// `LlCtrl` of every rank, as addressable from this rank.
    pub ctrl: DevPtrs<MAX_RANKS>,
    /// The dispatch receive region of this call's buffer set, on every rank.
    pub recv: DevPtrs<MAX_RANKS>,
    pub x: DevPtr,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    pub recv_x: DevPtr,
    pub recv_scales: DevPtr,
    pub recv_count: DevPtr,
    pub cum_stats: DevPtr,
    pub wait_stats: DevPtr,
    /// `i32 [E_local, R*T_max]`: DeepEP's `src_info` (the source token of each row), or 0.
    pub src_info: DevPtr,
    /// `i64 [E_local, R]`: DeepEP's `layout_range` (`begin << 32 | count` per source rank), or 0.
    pub layout_range: DevPtr,
    pub hrow: DevPtr,
    pub hweight: DevPtr,
    pub hmeta: DevPtr,
    pub home_idx: DevPtr,
    pub home_weight: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub report: DevPtr,
    pub timeout_ns: u64,
    /// Host-mapped timing trace (`[block][LL_TRACE_WORDS]` %globaltimer stamps), or 0.
    pub trace: DevPtr,
    pub off_entries: u64,
    pub off_weights: u64,
    pub off_rows: u64,
    pub off_counts: u64,
    pub row_stride: u32,
    pub rank: u32,
    pub num_ranks: u32,
    pub num_tokens: u32,
    pub max_tokens: u32,
    pub num_experts: u32,
    pub num_local_experts: u32,
    pub set: u32,
    pub phases: u32,
    pub flags: u32,
    pub host_problem: u32,
    pub pad: u32,
    pub sig: [u32; LL_SIG_WORDS],
}

/// Argument of `ll_combine` (`LlCombineArgs` in `ll.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct LlCombineArgs {
    pub ctrl: DevPtrs<MAX_RANKS>,
    /// The combine receive region of this call's buffer set, on every rank.
    pub recv: DevPtrs<MAX_RANKS>,
    pub y: DevPtr,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    pub out: DevPtr,
    pub wait_stats: DevPtr,
    pub hrow: DevPtr,
    pub hweight: DevPtr,
    pub hmeta: DevPtr,
    pub home_idx: DevPtr,
    pub home_weight: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub report: DevPtr,
    pub timeout_ns: u64,
    /// Host-mapped timing trace, or 0.
    pub trace: DevPtr,
    pub rank: u32,
    pub num_ranks: u32,
    pub num_tokens: u32,
    pub max_tokens: u32,
    pub num_experts: u32,
    pub num_local_experts: u32,
    pub set: u32,
    pub phases: u32,
    pub flags: u32,
    pub host_problem: u32,
    pub pad: [u32; 2],
}

/// Shapes of a low-latency call that the kernels' limits depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLimits {
    pub num_ranks: usize,
    pub max_tokens: usize,
    pub topk: usize,
    pub num_experts: usize,
}

impl LlLimits {
    /// `Err((argument, reason))` when the CUDA kernels cannot run this shape.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.topk > LL_MAX_TOPK {
            return Err(("topk_idx", format!("top-k {} exceeds the {LL_MAX_TOPK} the CUDA low-latency kernels support", self.topk)));
        }
        if self.max_tokens > LL_MAX_TOKENS {
            return Err((
                "num_max_dispatch_tokens_per_rank",
                format!("{} exceeds the {LL_MAX_TOKENS} the CUDA low-latency kernels support", self.max_tokens),
            ));
        }
        // num_experts comes from the caller: a huge value must be refused, not wrap past the bound.
        let words = self.num_experts.saturating_mul(self.max_tokens.div_ceil(32) + 1);
        if words > LL_SMEM_WORDS as usize {
            return Err((
                "num_experts",
                format!(
                    "{} experts x {} tokens need {words} words of shared memory per block; the CUDA low-latency kernels have {LL_SMEM_WORDS} \
                     (fewer experts or a smaller num_max_dispatch_tokens_per_rank)",
                    self.num_experts, self.max_tokens
                ),
            ));
        }
        Ok(())
    }
}

/// Byte offsets of one buffer set's dispatch receive region, relative to its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatchRegion {
    /// `u32 [R][T_max][K]`: every source token's live selections, `expert id << 16 | the token's rank among
    /// the source's tokens of that expert` (`!0` elsewhere).
    pub entries: usize,
    /// `f32 [R][T_max][K]`.
    pub weights: usize,
    /// `u32 [R][E_local]`: tokens each source sends each local expert.
    pub counts: usize,
    /// `[R][T_max][row_stride]`.
    pub rows: usize,
    /// Bytes per row slot: room for a bf16 row (`2H`), which also holds an FP8 row and its scales.
    pub row_stride: usize,
    /// Bytes of the region.
    pub bytes: usize,
}

/// Byte offsets of one buffer set's handle area (local only), relative to its start (`hrow` at 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleArea {
    /// `f32 [R][T_max][K]`.
    pub hweight: usize,
    /// `u32 [R][2]`.
    pub hmeta: usize,
    /// `i64 [T_max][K]`.
    pub home_idx: usize,
    /// `f32 [T_max][K]`.
    pub home_weight: usize,
    /// Bytes of the area.
    pub bytes: usize,
}

/// Layout of the low-latency data region (`num_rdma_bytes` long, after the HT region):
/// `[dispatch receive region ×2][combine receive region ×2][handle area ×2][zero-copy buffer]`, each part
/// 4096-byte aligned. It depends on (R, T_max, H, K, E) only — not on the payload mode — so ranks that
/// disagree on the mode still address the same bytes (the mismatch is then reported, not corrupted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    pub dispatch: DispatchRegion,
    /// Offsets of the two dispatch receive regions.
    pub dispatch_at: [usize; 2],
    /// Bytes of one combine receive region: `max(R*T_max, T_max*K)` bf16 rows of `2H`.
    pub combine_bytes: usize,
    /// Offsets of the two combine receive regions.
    pub combine_at: [usize; 2],
    pub handle: HandleArea,
    /// Offsets of the two handle areas.
    pub handle_at: [usize; 2],
    /// Offset of the zero-copy combine buffer `bf16 [E_local][R*T_max][H]`.
    pub staging_at: usize,
    /// Bytes of the zero-copy combine buffer.
    pub staging_bytes: usize,
    /// Bytes every low-latency call needs (everything but the zero-copy buffer).
    pub bytes_without_staging: usize,
    /// Bytes including the zero-copy buffer.
    pub bytes: usize,
}

const ALIGN: usize = 4096;

fn align(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(ALIGN)
}

impl LlLayout {
    /// The layout for `num_ranks` ranks, `max_tokens` tokens per rank, `hidden` channels, `topk` experts
    /// per token out of `num_experts`; `None` when the sizes overflow.
    pub fn new(num_ranks: usize, max_tokens: usize, hidden: usize, topk: usize, num_experts: usize) -> Option<LlLayout> {
        let (r, tm, h, k) = (num_ranks, max_tokens, hidden, topk);
        let el = num_experts.checked_div(r)?;
        let pairs = r.checked_mul(tm)?.checked_mul(k)?;
        let entries_bytes = align(pairs.checked_mul(4)?)?;
        let row_stride = h.checked_mul(2)?.checked_next_multiple_of(16)?;
        let rows_bytes = r.checked_mul(tm)?.checked_mul(row_stride)?;
        let counts_bytes = align(r.checked_mul(el)?.checked_mul(4)?)?;
        let rows_at = (2 * entries_bytes).checked_add(counts_bytes)?;
        let dispatch = DispatchRegion {
            entries: 0,
            weights: entries_bytes,
            counts: 2 * entries_bytes,
            rows: rows_at,
            row_stride,
            bytes: align(rows_at.checked_add(rows_bytes)?)?,
        };
        let combine_rows = (r.checked_mul(tm)?).max(tm.checked_mul(k)?);
        let combine_bytes = align(combine_rows.checked_mul(h.checked_mul(2)?)?)?;
        let hw = align(pairs.checked_mul(4)?)?;
        let hmeta = 2 * hw;
        let home_idx = hmeta + align(r.checked_mul(8)?)?;
        let home_weight = home_idx + align(tm.checked_mul(k)?.checked_mul(8)?)?;
        let handle =
            HandleArea { hweight: hw, hmeta, home_idx, home_weight, bytes: home_weight + align(tm.checked_mul(k)?.checked_mul(4)?)? };
        let mut at = 0usize;
        let mut take = |n: usize| -> Option<usize> {
            let here = at;
            at = at.checked_add(n)?;
            Some(here)
        };
        let dispatch_at = [take(dispatch.bytes)?, take(dispatch.bytes)?];
        let combine_at = [take(combine_bytes)?, take(combine_bytes)?];
        let handle_at = [take(handle.bytes)?, take(handle.bytes)?];
        let staging_bytes = align(el.checked_mul(r)?.checked_mul(tm)?.checked_mul(h.checked_mul(2)?)?)?;
        let staging_at = take(staging_bytes)?;
        Some(LlLayout {
            dispatch,
            dispatch_at,
            combine_bytes,
            combine_at,
            handle,
            handle_at,
            staging_at,
            staging_bytes,
            bytes_without_staging: staging_at,
            bytes: at,
        })
    }

    /// `num_rdma_bytes` that fit every low-latency call of this shape with top-k up to
    /// `min(num_experts, LL_HINT_TOPK)`, zero-copy combine included (DeepEP's
    /// `get_low_latency_rdma_size_hint`); `None` on overflow.
    pub fn bytes_hint(max_tokens: usize, hidden: usize, num_ranks: usize, num_experts: usize) -> Option<usize> {
        let topk = num_experts.clamp(1, LL_HINT_TOPK);
        Some(LlLayout::new(num_ranks.max(1), max_tokens, hidden, topk, num_experts)?.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_and_offsets() {
        assert_eq!(std::mem::size_of::<LlMeta>(), 64);
        assert_eq!(std::mem::offset_of!(LlMeta, status), 48);
        let arrive = 2 * MAX_RANKS * LL_ARRIVE_LANES * 128;
        assert_eq!(LlCtrl::BYTES, 64 + 2 * 4 * MAX_RANKS + 4 * arrive + 2 * 2 * 64 * MAX_RANKS + 4 * MAX_RANKS + 32);
        assert_eq!(std::mem::offset_of!(LlCtrl, decision), 64);
        for (name, offset) in [
            ("dispatch_arrive", std::mem::offset_of!(LlCtrl, dispatch_arrive)),
            ("combine_arrive", std::mem::offset_of!(LlCtrl, combine_arrive)),
            ("dispatch_consumed", std::mem::offset_of!(LlCtrl, dispatch_consumed)),
            ("combine_consumed", std::mem::offset_of!(LlCtrl, combine_consumed)),
        ] {
            assert_eq!(offset % 128, 0, "{name}: arrival and hand-back words on their own lines");
        }
        assert_eq!(LlCtrl::MASK_OFFSET, LlCtrl::BYTES - 4 * MAX_RANKS - 32);
        assert_eq!(std::mem::size_of::<LlReport>(), 48);
        assert_eq!(std::mem::size_of::<LlDispatchArgs>(), 16 * MAX_RANKS + 24 * 8 + 12 * 4 + 4 * LL_SIG_WORDS);
        assert_eq!(std::mem::size_of::<LlCombineArgs>(), 16 * MAX_RANKS + 15 * 8 + 12 * 4);
    }

    #[test]
    fn layout_of_the_benchmark_shape() {
        // EP4, 128 tokens, hidden 7168, top-8 of 288.
        let l = LlLayout::new(4, 128, 7168, 8, 288).unwrap();
        assert_eq!(l.dispatch.row_stride, 14336);
        assert_eq!(l.dispatch.entries, 0);
        assert_eq!(l.dispatch.weights, 16384, "entries: 4 x 128 x 8 ids");
        assert_eq!(l.dispatch.counts, 2 * 16384);
        assert_eq!(l.dispatch.rows, 2 * 16384 + 4096, "counts: 4 x 72 words, one aligned page");
        assert_eq!(l.dispatch.bytes, 2 * 16384 + 4096 + 512 * 14336);
        assert_eq!(l.combine_bytes, 1024 * 14336, "per-expert mode: 128 x 8 rows");
        assert_eq!(l.dispatch_at, [0, l.dispatch.bytes]);
        assert_eq!(l.combine_at[0], 2 * l.dispatch.bytes);
        assert_eq!(l.handle_at[1] - l.handle_at[0], l.handle.bytes);
        assert_eq!(l.staging_bytes, 72 * 512 * 14336);
        assert_eq!(l.bytes, l.staging_at + l.staging_bytes);
        assert_eq!(l.bytes_without_staging, l.staging_at);
        // Every part is 4096-aligned and they do not overlap.
        let mut parts = [
            (l.dispatch_at[0], l.dispatch.bytes),
            (l.dispatch_at[1], l.dispatch.bytes),
            (l.combine_at[0], l.combine_bytes),
            (l.combine_at[1], l.combine_bytes),
            (l.handle_at[0], l.handle.bytes),
            (l.handle_at[1], l.handle.bytes),
            (l.staging_at, l.staging_bytes),
        ];
        parts.sort();
        for w in parts.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
        assert!(parts.iter().all(|(a, n)| a % 4096 == 0 && n % 4096 == 0));
        // The hint (top-16) covers top-8.
        assert!(LlLayout::bytes_hint(128, 7168, 4, 288).unwrap() >= l.bytes);
        // ~570 MB, most of it the zero-copy buffer; DeepEP's hint for this shape is ~2.1 GB.
        assert!(l.bytes < 600 << 20 && l.bytes_without_staging < 60 << 20, "{l:?}");
    }

    #[test]
    fn layout_parts_hold_their_arrays() {
        for (r, tm, h, k, e) in [(1, 1, 128, 1, 1), (2, 3, 256, 2, 4), (8, 256, 2048, 8, 32), (4, 5, 1024, 4, 16), (3, 7, 8, 3, 9)] {
            let l = LlLayout::new(r, tm, h, k, e).unwrap();
            let el = e / r;
            let d = l.dispatch;
            assert!(d.weights - d.entries >= r * tm * k * 4 && d.counts - d.weights >= r * tm * k * 4 && d.rows - d.counts >= r * el * 4);
            assert!(d.bytes >= d.rows + r * tm * d.row_stride);
            assert!(d.row_stride >= 2 * h && d.row_stride >= h + h / 32 && d.row_stride % 16 == 0);
            assert!(l.combine_bytes >= (r * tm).max(tm * k) * 2 * h);
            let a = l.handle;
            assert!(a.hweight >= r * tm * k * 4 && a.hmeta - a.hweight >= r * tm * k * 4);
            assert!(a.home_idx - a.hmeta >= r * 8 && a.home_weight - a.home_idx >= tm * k * 8 && a.bytes - a.home_weight >= tm * k * 4);
            assert!(l.staging_bytes >= el * r * tm * 2 * h);
            assert_eq!(l.handle_at[0] % 16, 0);
        }
        assert!(LlLayout::new(8, usize::MAX / 4, 7168, 8, 64).is_none(), "overflow is None");
    }

    #[test]
    fn limits() {
        let ok = LlLimits { num_ranks: 4, max_tokens: 128, topk: 8, num_experts: 288 };
        assert!(ok.check().is_ok());
        assert_eq!(LlLimits { topk: 33, ..ok }.check().unwrap_err().0, "topk_idx");
        assert_eq!(LlLimits { max_tokens: 70000, ..ok }.check().unwrap_err().0, "num_max_dispatch_tokens_per_rank");
        // 288 x (ceil(T/32) + 1) words: 896 tokens fit (288 x 29 = 8352), 1312 do not (288 x 42 = 12096).
        assert!(LlLimits { max_tokens: 896, ..ok }.check().is_ok());
        assert_eq!(LlLimits { max_tokens: 1312, ..ok }.check().unwrap_err().0, "num_experts");
        assert!(LlLimits { num_experts: 6016, max_tokens: 32, ..ok }.check().is_ok());
        assert!(LlLimits { num_experts: 6020, max_tokens: 32, ..ok }.check().is_err());
        // 2^62 experts x (96 / 32 + 1) words = 2^64: wrapped to 0 words before the bound saturated.
        assert_eq!(LlLimits { num_experts: 1 << 62, max_tokens: 96, ..ok }.check().unwrap_err().0, "num_experts");
    }

    #[test]
    fn variants_cover_the_test_and_bench_shapes() {
        let all = LlVariant::all();
        for (hidden, topk, fp8) in [(7168, 8, true), (7168, 8, false), (2048, 4, true), (2048, 1, false), (512, 6, true), (128, 2, false)] {
            assert!(all.contains(&LlVariant::new(hidden, topk, fp8)), "{hidden} {topk} {fp8}");
        }
        let v = LlVariant::new(7168, 8, true);
        let spec = v.dispatch_spec();
        assert_eq!(spec.variant, "ll_dispatch[h7168,k8,fp8,x0]");
        assert_eq!(spec.define("LL_EXPERIMENT"), Some("0"));
        assert_eq!(spec.family, Family::LlDispatch);
        assert_eq!(spec.define("LL_FP8"), Some("1"));
        assert_eq!(spec.define("MOELINK_SIZEOF_LL_CTRL"), Some(LlCtrl::BYTES.to_string().as_str()));
        let combine = v.combine_spec();
        assert_eq!((combine.family, combine.variant.as_str()), (Family::LlCombine, "ll_combine[h7168,k8,fp8,x0]"));
        assert_eq!(combine.defines, spec.defines, "both kernels see the same constants");
        let exp = LlVariant { experiment: experiment::LOCAL_STORES | experiment::LAST_ARRIVES, ..v }.dispatch_spec();
        assert_eq!((exp.variant.as_str(), exp.define("LL_EXPERIMENT")), ("ll_dispatch[h7168,k8,fp8,x5]", Some("5")));
        assert_eq!(experiment::names(5), "local_stores,last_arrives");
        assert_eq!(experiment::names(0), "");
    }

    /// The constants `ll.cuh` shares with this module have the same values on both sides.
    #[test]
    fn constants_agree_with_the_source() {
        let value_of = |name: &str| -> u32 {
            let needle = format!("constexpr u32 {name} = ");
            let start = LL_HEADER.find(&needle).unwrap_or_else(|| panic!("{name} is not defined in ll.cuh")) + needle.len();
            let text: String = LL_HEADER[start..].chars().take_while(|c| c.is_ascii_digit()).collect();
            text.parse().unwrap()
        };
        let pairs: &[(&str, u32)] = &[
            ("LL_SIG_WORDS", LL_SIG_WORDS as u32),
            ("LL_ARRIVE_LANES", LL_ARRIVE_LANES as u32),
            ("LL_TRACE_WORDS", LL_TRACE_WORDS as u32),
            ("LL_TRACE_CALLS", LL_TRACE_CALLS as u32),
            ("LL_PHASE_SEND", phase::SEND),
            ("LL_PHASE_RECV", phase::RECV),
            ("LL_PHASE_DRAIN", phase::DRAIN),
            ("LL_FLAG_ROUND_SCALE", flag::ROUND_SCALE),
            ("LL_FLAG_UE8M0", flag::UE8M0),
            ("LL_FLAG_WEIGHTS", flag::WEIGHTS),
            ("LL_FLAG_SHRINK", flag::SHRINK),
            ("LL_EXP_LOCAL_STORES", experiment::LOCAL_STORES),
            ("LL_EXP_NO_LOADS", experiment::NO_LOADS),
            ("LL_EXP_LAST_ARRIVES", experiment::LAST_ARRIVES),
            ("LL_PROBLEM_TOPK_IDX", problem::TOPK_IDX),
            ("LL_PROBLEM_TOPK_IDX_DIFFERS", problem::TOPK_IDX_DIFFERS),
            ("LL_PROBLEM_WEIGHTS_DIFFER", problem::WEIGHTS_DIFFER),
            ("LL_PROBLEM_ZERO_COPY", problem::ZERO_COPY),
            ("LL_PROBLEM_HANDLE", problem::HANDLE),
        ];
        for &(name, rust) in pairs {
            assert_eq!(value_of(name), rust, "{name}");
        }
    }
}
