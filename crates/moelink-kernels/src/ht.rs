//! The high-throughput (HT) intranode kernels' host side: argument-struct mirrors of `cuda/ht_*.cu`, their
//! compile keys, the control-region and handle layouts of `cuda/ht.cuh`, and the arithmetic that sizes the
//! data region (row flags and receive slabs). Everything here is plain arithmetic: `moelink` uses it to launch
//! the kernels and to check capacity before it does, and `Buffer::ht_bytes_needed` to size buffers.
//!
//! The protocol is described in `docs/protocols.md` ("HT") and at the top of each kernel.
//!
//! ```
//! use moelink_kernels::ht::{bytes_needed, combine_row_bytes, dispatch_row_bytes, HtRegion};
//! // DeepEP's benchmark shape at EP4: 4096 tokens of hidden 7168, top-8, BF16.
//! let rows = [dispatch_row_bytes(7168, false, 8), combine_row_bytes(7168, 8)];
//! let n = bytes_needed(4096, 4, &rows);
//! let region = HtRegion { num_nvl_bytes: n, num_ranks: 4 };
//! assert!(rows.iter().all(|&row| region.slab_rows(row) >= 4096));
//! ```

use bytemuck::{NoUninit, Zeroable};
use moelink_cuda::{DevPtr, DevPtrs};

use crate::abi::MAX_RANKS;
use crate::{Family, KernelSpec};

/// FP8 scales cover this many channels each.
pub const FP8_BLOCK: usize = 128;
/// Bytes of one vectorised access; rows are multiples of it.
pub const VEC_BYTES: usize = 16;
/// Slab rows are whole multiples of this (`HT_ROW_ALIGN` in `ht.cuh`), so that every row starts on a 128-byte
/// line: a warp stores a row in 512-byte runs of 16-byte vectors, and a run that starts mid-line splits two
/// lines over two requests each on their way over NVLink.
pub const ROW_ALIGN: usize = 128;

/// Byte offsets inside a rank's HT control region (`HT_CTRL_*` in `ht.cuh`).
pub mod ctrl {
    /// `u32`: notify calls so far.
    pub const NOTIFY_EPOCH: usize = 0;
    /// `u32`: dispatch calls so far.
    pub const DISPATCH_EPOCH: usize = 4;
    /// `u32`: combine calls so far.
    pub const COMBINE_EPOCH: usize = 8;
    /// `u32`: the dispatch epoch the copy-engine pieces may signal (0: none); `ht_ce_signal.cu`.
    pub const DISPATCH_CE_GO: usize = 12;
    /// `u32`: the dispatch epoch the copy-engine wait last read.
    pub const DISPATCH_CE_SEEN: usize = 16;
    /// `u32`: the combine's [`DISPATCH_CE_GO`].
    pub const COMBINE_CE_GO: usize = 20;
    /// `u32`: the combine's [`DISPATCH_CE_SEEN`].
    pub const COMBINE_CE_SEEN: usize = 24;
    /// `u32`: finished blocks of the running dispatch.
    pub const DISPATCH_DONE: usize = 128;
    /// `u32`: finished blocks of the running combine.
    pub const COMBINE_DONE: usize = 256;
    /// `u32[MAX_RANKS]`: last dispatch epoch each source consumed.
    pub const DISPATCH_CONSUMED: usize = 384;
    /// `u32[MAX_RANKS]`: last combine epoch each source consumed.
    pub const COMBINE_CONSUMED: usize = 512;
    /// `u32[2][MAX_RANKS]`: notify flags.
    pub const NOTIFY_FLAGS: usize = 640;
    /// `u32`: next sender chunk of the running dispatch (0 between calls).
    pub const DISPATCH_CHUNK: usize = 768;
    /// `u32`: next sender chunk of the running combine (0 between calls).
    pub const COMBINE_CHUNK: usize = 896;
    /// `u32[2][MAX_RANKS][MSG_WORDS]`: notify messages.
    pub const NOTIFY_MSGS: usize = 1024;
    /// Local experts a notify message has room for.
    pub const MAX_LOCAL_EXPERTS: usize = 8192;
    /// First word of a notify message's row: the tokens its source sends to each rank (`[MAX_RANKS]`).
    pub const MSG_ROW: usize = 8;
    /// Header words of a notify message.
    pub const MSG_HEADER_WORDS: usize = MSG_ROW + super::MAX_RANKS;
    /// Words of a notify message.
    pub const MSG_WORDS: usize = MSG_HEADER_WORDS + MAX_LOCAL_EXPERTS;
    /// `u32[MAX_RANKS * MAX_LOCAL_EXPERTS]`: tokens of the running dispatch whose top-k selects each expert
    /// (0 between calls).
    pub const EXPERT_TOKENS: usize = NOTIFY_MSGS + 2 * super::MAX_RANKS * MSG_WORDS * 4;
    /// `u32[MAX_LOCAL_EXPERTS]`: rows of the running dispatch whose top-k ids select each local expert (0
    /// between calls).
    pub const RECV_EXPERT_TOKENS: usize = EXPERT_TOKENS + super::MAX_RANKS * MAX_LOCAL_EXPERTS * 4;
    /// `u32[1 + MAX_LOCAL_EXPERTS]`: the running dispatch's copy of notify's host-mapped READY word and
    /// per-expert sums.
    pub const RECV_EXPECTED: usize = RECV_EXPERT_TOKENS + MAX_LOCAL_EXPERTS * 4;
    /// Bytes of the whole control region.
    pub const BYTES: usize = RECV_EXPECTED + (1 + MAX_LOCAL_EXPERTS) * 4;
    // moelink reserves [64 KiB, 2 MiB) of its control area for HT.
    const _: () = assert!(BYTES <= (2 << 20) - (64 << 10));
}

/// `i32` words of a dispatch handle's device buffer (`HT_RT_*` in `ht.cuh`).
pub mod routing {
    use super::MAX_RANKS;
    /// `HT_STATUS_*` bits; 0 when the call moved data.
    pub const STATUS: usize = 0;
    /// The rank the status blames.
    pub const STATUS_PEER: usize = 1;
    /// Rows received.
    pub const NUM_RECV: usize = 2;
    /// Largest token count of any rank.
    pub const T_MAX: usize = 3;
    /// `[MAX_RANKS]`: first receive position of each source.
    pub const RECV_OFFSET: usize = 8;
    /// `[MAX_RANKS]`: rows received from each source.
    pub const RECV_COUNT: usize = RECV_OFFSET + MAX_RANKS;
    /// `[MAX_RANKS]`: rows sent to each rank.
    pub const SEND_COUNT: usize = RECV_COUNT + MAX_RANKS;
    /// `[R * R]`, row-major over the call's ranks: DeepEP's `rank_prefix_matrix`, `[i][j]` = tokens rank `j`
    /// receives from ranks `0..=i` (0 after a failed exchange).
    pub const RANK_PREFIX: usize = SEND_COUNT + MAX_RANKS;
    /// `[(T + 1) * R]`: tokens before `t` sent to `r`.
    pub const PREFIX: usize = RANK_PREFIX + MAX_RANKS * MAX_RANKS;

    /// Bytes of the routing buffer of a rank with `num_tokens` tokens among `num_ranks`.
    pub fn bytes(num_tokens: usize, num_ranks: usize) -> usize {
        4 * (PREFIX + (num_tokens + 1) * num_ranks)
    }
}

/// Status bits of a notify exchange (`HT_STATUS_*`).
pub mod status {
    /// A rank's `num_tokens_per_rank` disagrees with its `is_token_in_rank`.
    pub const BAD_LAYOUT: u32 = 1;
    /// Call signatures differ between ranks.
    pub const MISMATCH: u32 = 2;
    /// The dispatch slab cannot hold `T_max` rows per source.
    pub const TOO_SMALL: u32 = 4;
    /// The exchange itself failed (timeout).
    pub const FAILED: u32 = 8;
    /// A rank's `num_tokens_per_expert` disagrees with its `num_tokens_per_rank` (the single-node notify).
    pub const BAD_EXPERTS: u32 = 16;
}

/// `u32` words the notify kernel writes to host-mapped memory in CPU-synchronised mode (`HT_HN_*`).
pub mod host_notify {
    use super::MAX_RANKS;
    /// The call's sequence number, written last.
    pub const READY: usize = 0;
    /// Rows received.
    pub const NUM_RECV: usize = 1;
    /// Largest token count of any rank.
    pub const T_MAX: usize = 2;
    /// Status bits.
    pub const STATUS: usize = 3;
    /// The rank the status blames.
    pub const STATUS_PEER: usize = 4;
    /// `[MAX_RANKS]`: rows from each source.
    pub const RECV_COUNT: usize = 8;
    /// `[E / R]`: received tokens per local expert (unaligned).
    pub const PER_EXPERT: usize = RECV_COUNT + MAX_RANKS;

    /// Words for `num_local_experts` experts.
    pub fn words(num_local_experts: usize) -> usize {
        PER_EXPERT + num_local_experts
    }
}

/// Bytes of a dispatch slab row: payload, then `u32` meta words (top-k ids as `i64`, FP8 scales, top-k
/// weights, the source token index) padded to 16 bytes, the row padded to [`ROW_ALIGN`]. `ht_dispatch.cu`
/// asserts the same value.
pub fn dispatch_row_bytes(hidden: usize, fp8: bool, topk: usize) -> usize {
    // Saturating: absurd sizes give usize::MAX (which no buffer satisfies) rather than overflow.
    let payload = hidden.saturating_mul(if fp8 { 1 } else { 2 });
    let scales = if fp8 { hidden / FP8_BLOCK } else { 0 };
    let meta_words = topk.saturating_mul(3).saturating_add(scales).saturating_add(1);
    let meta = meta_words.saturating_mul(4).checked_next_multiple_of(VEC_BYTES).unwrap_or(usize::MAX);
    payload.saturating_add(meta).checked_next_multiple_of(ROW_ALIGN).unwrap_or(usize::MAX)
}

/// Bytes of a combine slab row: the bf16 payload, then `topk` f32 weights, the row padded to [`ROW_ALIGN`].
pub fn combine_row_bytes(hidden: usize, topk: usize) -> usize {
    let weights = topk.saturating_mul(4).checked_next_multiple_of(VEC_BYTES).unwrap_or(usize::MAX);
    hidden.saturating_mul(2).saturating_add(weights).checked_next_multiple_of(ROW_ALIGN).unwrap_or(usize::MAX)
}

/// Data-region bytes per row-flag slot and rank: the flag arrays get `num_nvl_bytes / (R * 1024)` slots per
/// source (8 bytes of flags per KiB of buffer).
pub const FLAG_SLOT_SPACING: usize = 1024;
/// Alignment of the data region's parts.
pub const REGION_ALIGN: usize = 256;

/// How a rank's HT data region (`num_nvl_bytes` long, the same on every rank) is laid out. Fixed for the
/// buffer's lifetime except for the slab row size, which each call chooses:
/// `[dispatch row flags: R x flag_slots u32][combine row flags: same][dispatch slab][combine slab]`, the two
/// slabs of equal size; each slab holds `slab_rows(row_bytes)` rows per source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtRegion {
    pub num_nvl_bytes: usize,
    pub num_ranks: usize,
}

impl HtRegion {
    /// Row flags per source (the most tokens per rank the region can ever serve).
    pub fn flag_slots(&self) -> usize {
        (self.num_nvl_bytes / (self.num_ranks.max(1) * FLAG_SLOT_SPACING)).min(i32::MAX as usize)
    }
    fn flag_array_bytes(&self) -> usize {
        (self.num_ranks * self.flag_slots() * 4).next_multiple_of(REGION_ALIGN)
    }
    /// Offset of the dispatch row flags `[src][slot]`.
    pub fn dispatch_flags_offset(&self) -> usize {
        0
    }
    /// Offset of the combine row flags `[src][slot]`.
    pub fn combine_flags_offset(&self) -> usize {
        self.flag_array_bytes()
    }
    /// Bytes of each slab.
    pub fn slab_bytes(&self) -> usize {
        self.num_nvl_bytes.saturating_sub(2 * self.flag_array_bytes()) / 2 / REGION_ALIGN * REGION_ALIGN
    }
    /// Offset of the dispatch slab.
    pub fn dispatch_slab_offset(&self) -> usize {
        2 * self.flag_array_bytes()
    }
    /// Offset of the combine slab.
    pub fn combine_slab_offset(&self) -> usize {
        self.dispatch_slab_offset() + self.slab_bytes()
    }
    /// Rows per source a slab holds for rows of `row_bytes`: a call fits when every rank has at most this
    /// many tokens.
    pub fn slab_rows(&self, row_bytes: usize) -> usize {
        let by_bytes = self.slab_bytes() / (self.num_ranks.max(1) * row_bytes.max(1));
        by_bytes.min(self.flag_slots())
    }
}

/// Smallest `num_nvl_bytes` (a multiple of 1 MiB) whose slabs hold `num_tokens` rows per source for every
/// row size in `row_bytes`; 0 when `num_tokens` is 0; `usize::MAX` when no buffer can (the sizes overflow,
/// or more rows than the flag arrays can count).
pub fn bytes_needed(num_tokens: usize, num_ranks: usize, row_bytes: &[usize]) -> usize {
    const MIB: usize = 1 << 20;
    if num_tokens == 0 || num_ranks == 0 {
        return 0;
    }
    if num_tokens > i32::MAX as usize {
        return usize::MAX; // flag_slots() never exceeds i32::MAX
    }
    let max_row = row_bytes.iter().copied().max().unwrap_or(VEC_BYTES);
    let rows = num_ranks.checked_mul(num_tokens);
    let slabs = rows.and_then(|r| r.checked_mul(max_row)?.checked_mul(2));
    let flags = rows.and_then(|r| r.checked_mul(8));
    let spacing = rows.and_then(|r| r.checked_mul(FLAG_SLOT_SPACING));
    // A lower bound (no alignment padding), then 1 MiB steps: the flag arrays grow with the buffer.
    let Some(mut n) = (|| slabs?.checked_add(flags?)?.max(spacing?).checked_next_multiple_of(MIB))() else {
        return usize::MAX;
    };
    let fits = |n: usize| {
        let region = HtRegion { num_nvl_bytes: n, num_ranks };
        row_bytes.iter().all(|&row| region.slab_rows(row) >= num_tokens)
    };
    while !fits(n) {
        match n.checked_add(MIB) {
            Some(m) => n = m,
            None => return usize::MAX,
        }
    }
    n
}

/// What every rank must agree on in a fresh dispatch, packed into the notify message: hidden (24 bits),
/// experts (20), top-k (12), flags (fp8, has top-k, no-sync).
pub fn call_signature(sig: CallSignature) -> u64 {
    (sig.hidden as u64 & 0xff_ffff)
        | ((sig.num_experts as u64 & 0xf_ffff) << 24)
        | ((sig.topk as u64 & 0xfff) << 44)
        | ((sig.fp8 as u64) << 56)
        | ((sig.has_topk as u64) << 57)
        | ((sig.no_sync as u64) << 58)
}

/// The fields of [`call_signature`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSignature {
    pub hidden: usize,
    pub num_experts: usize,
    pub topk: usize,
    pub fp8: bool,
    pub has_topk: bool,
    pub no_sync: bool,
}

impl CallSignature {
    /// Unpacks [`call_signature`] (fields wider than their bits come back truncated).
    pub fn decode(v: u64) -> CallSignature {
        CallSignature {
            hidden: (v & 0xff_ffff) as usize,
            num_experts: ((v >> 24) & 0xf_ffff) as usize,
            topk: ((v >> 44) & 0xfff) as usize,
            fp8: (v >> 56) & 1 != 0,
            has_topk: (v >> 57) & 1 != 0,
            no_sync: (v >> 58) & 1 != 0,
        }
    }
}

impl std::fmt::Display for CallSignature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "hidden {}, {} experts, top-{}{}, {}, {}",
            self.hidden,
            self.num_experts,
            self.topk,
            if self.has_topk { "" } else { " (not sent)" },
            if self.fp8 { "fp8" } else { "bf16" },
            if self.no_sync { "no-sync" } else { "CPU-sync" }
        )
    }
}

/// Start of part `i` of `parts` equal parts of `[0, total)` (`ht_split` in `ht.cuh`): senders and receivers
/// split tokens and rows with it.
pub fn split(total: usize, i: usize, parts: usize) -> usize {
    (total as u64 * i as u64 / parts as u64) as usize
}

// ============================================================================================ arguments

/// Argument of `ht_layout` (`HtLayoutArgs` in `ht_layout.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtLayoutArgs {
    pub topk_idx: DevPtr,
    pub topk_stride_token: i64,
    pub topk_stride_k: i64,
    pub num_tokens_per_rank: DevPtr,
    pub num_tokens_per_expert: DevPtr,
    pub is_token_in_rank: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub num_tokens: u32,
    pub topk: u32,
    pub num_experts: u32,
    pub num_ranks: u32,
    pub rank: u32,
    pub reserved: u32,
}

/// Argument of `ht_notify` (`HtNotifyArgs` in `ht_notify.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtNotifyArgs {
    pub is_token_in_rank: DevPtr,
    pub num_tokens_per_rank: DevPtr,
    pub num_tokens_per_expert: DevPtr,
    pub routing: DevPtr,
    pub host_out: DevPtr,
    pub ctrl: DevPtrs<MAX_RANKS>,
    pub signature: u64,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub rank: u32,
    pub num_ranks: u32,
    pub num_tokens: u32,
    pub num_local_experts: u32,
    pub slab_rows: u32,
    pub slab_row_bytes: u32,
    pub host_seq: u32,
    pub reserved: u32,
}

/// Argument of `ht_dispatch` (`HtDispatchArgs` in `ht_dispatch.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtDispatchArgs {
    pub x: DevPtr,
    pub x_scales: DevPtr,
    pub scale_stride_token: i64,
    pub scale_stride_group: i64,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    /// `i32 [E]`: the fresh dispatch's `num_tokens_per_expert`, checked against `topk_idx`; 0: no check.
    pub num_tokens_per_expert: DevPtr,
    /// The host-mapped words ht_notify wrote for call `host_seq` (`host_notify`; CPU-synchronised fresh
    /// dispatch with top-k): the rows per local expert it summed from every source's counts are checked
    /// against the arriving rows' top-k ids, unless the words hold another call's by then; 0: no check.
    pub host_notify: DevPtr,
    pub recv_x: DevPtr,
    pub recv_scales: DevPtr,
    pub recv_topk_idx: DevPtr,
    pub recv_topk_weights: DevPtr,
    pub recv_src_idx: DevPtr,
    pub routing: DevPtr,
    pub ctrl: DevPtrs<MAX_RANKS>,
    pub data: DevPtrs<MAX_RANKS>,
    pub flags_offset: u64,
    pub slab_offset: u64,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub rank: u32,
    pub num_ranks: u32,
    pub num_tokens: u32,
    pub num_local_experts: u32,
    pub num_out_rows: u32,
    pub slab_rows: u32,
    pub flag_slots: u32,
    pub num_send_blocks: u32,
    /// Tokens per sender chunk (0: one contiguous part per warp); see `HtCursor` in ht.cuh.
    pub send_chunk: u32,
    /// Slab rows per receiver chunk, per source (0: one contiguous part per warp).
    pub recv_chunk: u32,
    /// 1: sender warps take chunks in order from the call's counter (`ht_grab_chunk`); needs `send_chunk > 0`.
    pub dynamic_send: u32,
    /// The notify call whose counts `host_notify` holds for this dispatch.
    pub host_seq: u32,
    /// Host-mapped timing trace (`HT_TRACE_*` in ht.cuh; [`trace_words_per_block`]), or 0.
    pub trace: DevPtr,
    /// `i32 [T, R]`: token t's slot among the rows this rank sends to r, -1 where it is not sent; null: not wanted.
    pub send_head: DevPtr,
    /// `i32 [R, num_channels]`: this rank's tokens for r in channels `0..=c` (all in the last); null: not wanted.
    pub channel_prefix: DevPtr,
    /// `i32 [R, num_channels]`: where channel c of source r starts among its rows (0); null: not wanted.
    pub recv_channel_prefix: DevPtr,
    /// Columns of the two channel matrices.
    pub num_channels: u32,
    /// Copy-engine receive (`HT_CE`): tokens per piece of the peer's staging.
    pub ce_piece_tokens: u32,
    /// Copy-engine receive: `i32 [num_out_rows]`, the source token of each received row (the handle's).
    pub ce_src_idx: DevPtr,
    /// Copy-engine receive: byte offset of the FP8 scales in the staging ([`ce_staging`]).
    pub ce_scales_offset: u32,
    pub reserved: u32,
}

/// Argument of `ht_combine` (`HtCombineArgs` in `ht_combine.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtCombineArgs {
    pub x: DevPtr,
    pub topk_weights: DevPtr,
    pub bias0: DevPtr,
    pub bias1: DevPtr,
    pub combined_x: DevPtr,
    pub combined_topk_weights: DevPtr,
    pub routing: DevPtr,
    pub ctrl: DevPtrs<MAX_RANKS>,
    pub data: DevPtrs<MAX_RANKS>,
    pub flags_offset: u64,
    pub slab_offset: u64,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub rank: u32,
    pub num_tokens: u32,
    pub num_x_rows: u32,
    pub slab_rows: u32,
    pub flag_slots: u32,
    pub num_send_blocks: u32,
    /// Rows per sender chunk, per source (0: one contiguous part per warp); see `HtCursor` in ht.cuh.
    pub send_chunk: u32,
    /// Tokens per reducer chunk (0: one contiguous part per warp).
    pub recv_chunk: u32,
    /// 1: sender warps take chunks in order from the call's counter (`ht_grab_chunk`); needs `send_chunk > 0`.
    pub dynamic_send: u32,
    /// Copy-engine reduce (`HT_CE`): rows per piece of the peer's staging.
    pub ce_piece_rows: u32,
    /// Host-mapped timing trace (`HT_TRACE_*` in ht.cuh; [`trace_words_per_block`]), or 0.
    pub trace: DevPtr,
    /// Copy-engine reduce: byte offset of the top-k weights in the staging ([`ce_staging`]).
    pub ce_weights_offset: u32,
    pub reserved: u32,
}

/// Argument of `ht_ce_signal` (`HtCeSignalArgs` in `ht_ce_signal.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtCeSignalArgs {
    /// The handle's routing buffer (status, T_max).
    pub routing: DevPtr,
    /// This rank's HT control region.
    pub ctrl: DevPtr,
    /// The peer's dispatch row flags of this rank as source (`[rank][0..]` of the peer's data region).
    pub peer_flags: DevPtr,
    /// This rank's staging in the peer's dispatch slab (`[rank]`, header first).
    pub peer_staging: DevPtr,
    pub error_claim: DevPtr,
    pub scale_stride_token: i64,
    pub scale_stride_group: i64,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub reserved64: u64,
    pub rank: u32,
    pub num_ranks: u32,
    /// Slab rows per source for the dispatch's row size (the dispatch moves nothing when T_max exceeds it).
    pub slab_rows: u32,
    /// The piece whose flag to store, or [`CE_WAIT`] for the wait before the first piece.
    pub piece: u32,
    /// 0: a dispatch's pieces, 1: a combine's.
    pub combine: u32,
    pub reserved: u32,
}

/// `ht_ce_signal`'s piece for the wait before the first piece (`HT_CE_WAIT`).
pub const CE_WAIT: u32 = u32::MAX;
/// Bytes of the staging's header line (`HT_CE_HEADER_BYTES`).
pub const CE_HEADER_BYTES: usize = ROW_ALIGN;

/// Where a rank's copy engines put its rows in its slab at the peer (`HT_CE` in ht.cuh, "copy-engine staging").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeStaging {
    /// Bytes of a row's payload.
    pub payload_bytes: usize,
    /// Offset of the second area (dispatch: the FP8 scales; combine: the top-k weights), after `t_max` rows,
    /// line-aligned.
    pub second_offset: usize,
    /// Bytes the staging needs.
    pub bytes: usize,
}

/// The staging of at most `t_max` rows of `payload_bytes` and a second area of `second_bytes`, or `None` when
/// it exceeds `slab_bytes_per_source`.
pub fn ce_staging(payload_bytes: usize, t_max: usize, second_bytes: usize, slab_bytes_per_source: usize) -> Option<CeStaging> {
    let second_offset = t_max.checked_mul(payload_bytes)?.checked_add(CE_HEADER_BYTES)?.checked_next_multiple_of(ROW_ALIGN)?;
    let bytes = second_bytes.checked_add(second_offset)?;
    (bytes <= slab_bytes_per_source).then_some(CeStaging { payload_bytes, second_offset, bytes })
}

/// u64 words of the timing trace per block of a kernel with `warps` warps per block (`HT_TRACE_*` in ht.cuh):
/// block start, block end, then per warp the start and the end of its work (%globaltimer, ns).
pub const fn trace_words_per_block(warps: u32) -> usize {
    2 + 2 * warps as usize
}

// ============================================================================================ variants

fn define(name: &str, value: impl ToString) -> (String, String) {
    (name.to_string(), value.to_string())
}

/// `ht_layout.cu`: one variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtLayoutVariant;

impl HtLayoutVariant {
    /// Threads per block: every block reads every row, so a wide block gives each thread few rows.
    pub const THREADS: u32 = 1024;
    /// Experts whose counters one block owns (each block reads every row once per range it owns).
    pub const EXPERTS_PER_BLOCK: u32 = 32;
    /// Most blocks a launch uses (blocks take several ranges beyond).
    pub const MAX_BLOCKS: u32 = 1024;

    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::HtLayout,
            variant: format!("ht_layout[r{}]", MAX_RANKS),
            defines: vec![
                define("MAX_RANKS", MAX_RANKS),
                define("LAYOUT_THREADS", Self::THREADS),
                define("LAYOUT_EXPERTS_PER_BLOCK", Self::EXPERTS_PER_BLOCK),
                define("MOELINK_SIZEOF_HT_LAYOUT_ARGS", std::mem::size_of::<HtLayoutArgs>()),
            ],
        }
    }

    /// Blocks for `num_experts` experts: one per range of [`Self::EXPERTS_PER_BLOCK`].
    pub fn grid(num_experts: usize) -> u32 {
        (num_experts.div_ceil(Self::EXPERTS_PER_BLOCK as usize) as u32).clamp(1, Self::MAX_BLOCKS)
    }
}

/// `ht_notify.cu`: one variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtNotifyVariant;

impl HtNotifyVariant {
    /// Threads of the single block.
    pub const THREADS: u32 = 1024;

    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::HtNotify,
            variant: format!("ht_notify[r{}]", MAX_RANKS),
            defines: vec![
                define("MAX_RANKS", MAX_RANKS),
                define("NOTIFY_THREADS", Self::THREADS),
                define("MOELINK_SIZEOF_HT_NOTIFY_ARGS", std::mem::size_of::<HtNotifyArgs>()),
            ],
        }
    }
}

/// `ht_dispatch.cu`, specialised on the row shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtDispatchVariant {
    pub hidden: usize,
    pub fp8: bool,
    /// Top-k entries travelling with each token (0: none).
    pub topk: usize,
    /// Tokens a sender warp writes before one release publishes them (see ht_dispatch.cu).
    pub release_batch: u32,
    /// The last warp of each sender block releases the other warps' rows (`HT_RELEASER`, ht.cuh).
    pub releaser: bool,
    /// 0, or `HT_EXP_*` bits of ht.cuh for timing experiments (results are wrong with bits 1, 2 and 8).
    pub experiment: u32,
    /// Copy-engine receive (`HT_CE`, two ranks, cached dispatch): every block receives, the peer's rows from the
    /// staging its copy engines filled ([`ce_staging`]).
    pub copy_engine: bool,
}

/// How an HT sender warp's rows are released: `batch` rows (dispatch: tokens; combine: rows per source) a
/// release, and whether the last warp of each sender block does it for the others (`HT_RELEASER`, ht.cuh)
/// or every warp fences its own (`fence.acq_rel.sys`, which waits until the warp's NVLink stores are
/// acknowledged: one per row leaves each warp idle for a round trip per row; a batch amortises it, at the
/// cost of the receivers seeing rows later).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtRelease {
    pub releaser: bool,
    pub batch: u32,
}

/// The dispatch's release. With the releaser, a smaller batch no longer costs the senders a fence: BF16
/// takes it with batches of 2 (EP2 on 2xH200, against own fences and batches of 4: 4096 tokens fresh
/// 224 -> 218 µs, cached 189 both; 512-2048 tokens 1-7 µs lower). FP8 does not: with the releaser its
/// 512-token calls are 3-7 µs slower with batches of 4, and its cached 4096-token call 10-20 µs slower with
/// batches of 2 (bench/results/2026-11-30-2xnvidia-h200-07315f6-ht-releaser).
pub fn default_dispatch_release(fp8: bool) -> HtRelease {
    if fp8 {
        HtRelease { releaser: false, batch: 4 }
    } else {
        HtRelease { releaser: true, batch: 2 }
    }
}

/// The combine's release: the releaser warp, batches of 2 rows per source (EP2 on 2xH200: 4096 tokens
/// 200-201 -> 194 µs, 512-2048 tokens 2-4 µs lower; same folder).
pub const DEFAULT_COMBINE_RELEASE: HtRelease = HtRelease { releaser: true, batch: 2 };

/// Both kernels' release where every rank of the node shares one GPU: the senders' own fences, batches of 4.
/// The releaser hides a fence's wait for stores to cross a link; with no link that wait is short, and the
/// releaser's warp is worth more as a sender. Four ranks on one H200: fresh BF16 dispatch 902-910 -> 887-894
/// µs, combine 735-744 -> 725-730; two ranks give up 1.5-1.8 % (bench/results/2026-12-01-1xnvidia-h200-
/// 5ddfa0d-one-gpu-release).
pub const ONE_GPU_RELEASE: HtRelease = HtRelease { releaser: false, batch: 4 };

/// Work chunks of the HT kernels' warps (`HtCursor` in ht.cuh): every warp takes every n-th chunk, so that
/// senders and receivers walk the token order together; 0 gives each warp one contiguous part instead.
/// Senders take one release batch per chunk; receivers this many items (dispatch: slab rows of a source;
/// combine: tokens): one, so that the last rows that land are copied by many warps, not a few (a receiver
/// warp copies ~3.5 GB/s). Measured on 4xH200 (EP4, 4096 tokens, H 7168, 24 SMs, dynamic sender chunks;
/// bench/results/2026-11-21-4xnvidia-h200-1a4aa1b/recvchunk): 1 / 2 / 4 items: BF16 dispatch 564 / 564 /
/// 576 µs, FP8 341 / 342 / 347, combine 521 / 528 / 544; with fixed sender shares (…-192c69d-chunks) 4 / 8 /
/// 16 rows and contiguous parts: 596 / 605 / 619 / 663 µs BF16.
pub const DEFAULT_RECV_CHUNK: u32 = 1;

impl HtDispatchVariant {
    /// The variant with the default release (`default_dispatch_release`).
    pub fn new(hidden: usize, fp8: bool, topk: usize) -> Self {
        let release = default_dispatch_release(fp8);
        Self { hidden, fp8, topk, release_batch: release.batch, releaser: release.releaser, experiment: 0, copy_engine: false }
    }

    /// Warps per block.
    pub const WARPS: u32 = 16;
    /// 16-byte vectors a lane keeps in flight per copy round.
    pub const MAX_UNROLL: u32 = 16;

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        Self::WARPS * 32
    }
    /// Bytes of a slab row.
    pub fn row_bytes(&self) -> usize {
        dispatch_row_bytes(self.hidden, self.fp8, self.topk)
    }

    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::HtDispatch,
            variant: format!(
                "ht_dispatch[h{},{},k{},b{},e{},x{},c{}]",
                self.hidden,
                if self.fp8 { "fp8" } else { "bf16" },
                self.topk,
                self.release_batch,
                self.releaser as u32,
                self.experiment,
                self.copy_engine as u32
            ),
            defines: vec![
                define("MAX_RANKS", MAX_RANKS),
                define("HIDDEN", self.hidden),
                define("FP8", self.fp8 as u32),
                define("TOPK", self.topk),
                define("DISPATCH_WARPS", Self::WARPS),
                define("MAX_UNROLL", Self::MAX_UNROLL),
                define("RELEASE_BATCH", self.release_batch),
                define("HT_RELEASER", self.releaser as u32),
                define("HT_EXPERIMENT", self.experiment),
                define("HT_CE", self.copy_engine as u32),
                define("ROW_BYTES", self.row_bytes()),
                define("MOELINK_SIZEOF_HT_DISPATCH_ARGS", std::mem::size_of::<HtDispatchArgs>()),
            ],
        }
    }
}

/// `ht_ce_signal.cu`: one variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtCeSignalVariant;

impl HtCeSignalVariant {
    /// Threads per block (one block; the wait uses a lane per rank, a flag one thread).
    pub const THREADS: u32 = 32;

    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::HtCeSignal,
            variant: "ht_ce_signal".to_string(),
            defines: vec![
                define("MAX_RANKS", MAX_RANKS),
                define("MOELINK_SIZEOF_HT_CE_SIGNAL_ARGS", std::mem::size_of::<HtCeSignalArgs>()),
            ],
        }
    }
}

/// `ht_combine.cu`, specialised on the rank count and the row shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtCombineVariant {
    pub num_ranks: usize,
    pub hidden: usize,
    /// Top-k weights per row (0: none).
    pub topk: usize,
    /// Rows per source a sender warp writes before one release publishes them (see ht_combine.cu).
    pub release_batch: u32,
    /// The last warp of each sender block releases the other warps' rows (`HT_RELEASER`, ht.cuh).
    pub releaser: bool,
    /// 0, or `HT_EXP_*` bits of ht.cuh for timing experiments (results are wrong with bits 1 and 2).
    pub experiment: u32,
    /// 16-byte vectors a reducer lane keeps in flight per round (spread over ranks and biases).
    pub reduce_load_vecs: u32,
    /// Biases the call adds (0..=2).
    pub num_biases: u32,
    /// Copy-engine reduce (`HT_CE`, two ranks): every block reduces, the peer's rows from the staging its
    /// copy engines filled ([`ce_staging`]).
    pub copy_engine: bool,
}

impl HtCombineVariant {
    /// The variant with the default release (`DEFAULT_COMBINE_RELEASE`).
    pub fn new(num_ranks: usize, hidden: usize, topk: usize) -> Self {
        Self {
            num_ranks,
            hidden,
            topk,
            release_batch: DEFAULT_COMBINE_RELEASE.batch,
            releaser: DEFAULT_COMBINE_RELEASE.releaser,
            experiment: 0,
            reduce_load_vecs: Self::REDUCE_LOAD_VECS,
            num_biases: 0,
            copy_engine: false,
        }
    }

    /// Warps per block.
    pub const WARPS: u32 = 12;
    /// 16-byte vectors a sender lane keeps in flight per copy round.
    pub const MAX_UNROLL: u32 = 16;
    /// 16-byte vectors a reducer lane keeps in flight per round (spread over ranks and biases).
    pub const REDUCE_LOAD_VECS: u32 = 24;

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        Self::WARPS * 32
    }
    /// Bytes of a slab row.
    pub fn row_bytes(&self) -> usize {
        combine_row_bytes(self.hidden, self.topk)
    }

    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::HtCombine,
            variant: format!(
                "ht_combine[r{},h{},k{},n{},b{},e{},x{},l{},c{}]",
                self.num_ranks,
                self.hidden,
                self.topk,
                self.num_biases,
                self.release_batch,
                self.releaser as u32,
                self.experiment,
                self.reduce_load_vecs,
                self.copy_engine as u32
            ),
            defines: vec![
                define("MAX_RANKS", MAX_RANKS),
                define("NUM_RANKS", self.num_ranks),
                define("HIDDEN", self.hidden),
                define("TOPK", self.topk),
                define("COMBINE_WARPS", Self::WARPS),
                define("MAX_UNROLL", Self::MAX_UNROLL),
                define("RELEASE_BATCH", self.release_batch),
                define("HT_RELEASER", self.releaser as u32),
                define("HT_EXPERIMENT", self.experiment),
                define("REDUCE_LOAD_VECS", self.reduce_load_vecs),
                define("NUM_BIASES", self.num_biases),
                define("HT_CE", self.copy_engine as u32),
                define("ROW_BYTES", self.row_bytes()),
                define("MOELINK_SIZEOF_HT_COMBINE_ARGS", std::mem::size_of::<HtCombineArgs>()),
            ],
        }
    }
}

/// The HT variants `compile_all` checks: the test suite's shapes (hidden 128..7168, top-k 0..8, ranks 1..8)
/// and DeepEP's benchmark shapes (hidden 7168, top-8, BF16 and FP8).
pub fn variants() -> Vec<KernelSpec> {
    let mut v = vec![HtLayoutVariant.spec(), HtNotifyVariant.spec()];
    let dispatch = [
        (128, false, 0),
        (128, false, 4),
        (128, false, 8),
        (256, false, 0),
        (256, false, 8),
        (256, true, 8),
        (512, false, 8),
        (1024, true, 8),
        (4096, false, 1),
        (7168, false, 0),
        (7168, false, 8),
        (7168, true, 0),
        (7168, true, 8),
    ];
    v.extend(dispatch.iter().map(|&(hidden, fp8, topk)| HtDispatchVariant::new(hidden, fp8, topk).spec()));
    let combine = [
        (1, 256, 4),
        (2, 256, 8),
        (2, 512, 8),
        (4, 128, 0),
        (4, 256, 8),
        (4, 4096, 1),
        (4, 7168, 0),
        (4, 7168, 8),
        (8, 128, 8),
        (8, 7168, 8),
    ];
    v.extend(combine.iter().map(|&(num_ranks, hidden, topk)| HtCombineVariant::new(num_ranks, hidden, topk).spec()));
    // Biases change the reducer's registers: the largest shapes with one and two.
    for (num_ranks, num_biases) in [(4, 1), (4, 2), (8, 2)] {
        v.push(HtCombineVariant { num_biases, ..HtCombineVariant::new(num_ranks, 7168, 8) }.spec());
    }
    // The releaser warp, both ways, at DeepEP's shapes.
    for releaser in [false, true] {
        for (fp8, topk) in [(false, 8), (true, 8), (true, 0)] {
            v.push(HtDispatchVariant { releaser, ..HtDispatchVariant::new(7168, fp8, topk) }.spec());
        }
        for num_ranks in [2, 8] {
            v.push(HtCombineVariant { releaser, ..HtCombineVariant::new(num_ranks, 7168, 8) }.spec());
        }
    }
    // The copy-engine receive (cached dispatch: no top-k), the copy-engine reduce, and their signals.
    for fp8 in [false, true] {
        v.push(HtDispatchVariant { copy_engine: true, ..HtDispatchVariant::new(7168, fp8, 0) }.spec());
    }
    for num_biases in [0, 2] {
        v.push(HtCombineVariant { copy_engine: true, num_biases, ..HtCombineVariant::new(2, 7168, 8) }.spec());
    }
    v.push(HtCeSignalVariant.spec());
    v.sort_by(|a, b| a.variant.cmp(&b.variant));
    v.dedup_by(|a, b| a.variant == b.variant);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `constexpr u32 NAME = <integer>;` in `ht.cuh`.
    fn header_value(name: &str) -> usize {
        let header = crate::HT_HEADER;
        let needle = format!("constexpr u32 {name} = ");
        let start = header.find(&needle).unwrap_or_else(|| panic!("{name} is not defined in ht.cuh")) + needle.len();
        let text: String = header[start..].chars().take_while(|c| c.is_ascii_digit()).collect();
        text.parse().unwrap_or_else(|_| panic!("{name} is not a plain integer in ht.cuh"))
    }

    #[test]
    fn layouts_agree_with_ht_header() {
        let pairs: &[(&str, usize)] = &[
            ("HT_FP8_BLOCK", FP8_BLOCK),
            ("HT_ROW_ALIGN", ROW_ALIGN),
            ("HT_CTRL_NOTIFY_EPOCH", ctrl::NOTIFY_EPOCH),
            ("HT_CTRL_DISPATCH_EPOCH", ctrl::DISPATCH_EPOCH),
            ("HT_CTRL_COMBINE_EPOCH", ctrl::COMBINE_EPOCH),
            ("HT_CTRL_DISPATCH_CE_GO", ctrl::DISPATCH_CE_GO),
            ("HT_CTRL_DISPATCH_CE_SEEN", ctrl::DISPATCH_CE_SEEN),
            ("HT_CTRL_COMBINE_CE_GO", ctrl::COMBINE_CE_GO),
            ("HT_CTRL_COMBINE_CE_SEEN", ctrl::COMBINE_CE_SEEN),
            ("HT_CTRL_DISPATCH_DONE", ctrl::DISPATCH_DONE),
            ("HT_CTRL_COMBINE_DONE", ctrl::COMBINE_DONE),
            ("HT_CTRL_DISPATCH_CONSUMED", ctrl::DISPATCH_CONSUMED),
            ("HT_CTRL_COMBINE_CONSUMED", ctrl::COMBINE_CONSUMED),
            ("HT_CTRL_NOTIFY_FLAGS", ctrl::NOTIFY_FLAGS),
            ("HT_CTRL_DISPATCH_CHUNK", ctrl::DISPATCH_CHUNK),
            ("HT_CTRL_COMBINE_CHUNK", ctrl::COMBINE_CHUNK),
            ("HT_CTRL_NOTIFY_MSGS", ctrl::NOTIFY_MSGS),
            ("HT_MAX_LOCAL_EXPERTS", ctrl::MAX_LOCAL_EXPERTS),
            ("HT_MSG_ROW", ctrl::MSG_ROW),
            ("HT_RT_STATUS", routing::STATUS),
            ("HT_RT_STATUS_PEER", routing::STATUS_PEER),
            ("HT_RT_NUM_RECV", routing::NUM_RECV),
            ("HT_RT_T_MAX", routing::T_MAX),
            ("HT_RT_RECV_OFFSET", routing::RECV_OFFSET),
            ("HT_STATUS_BAD_LAYOUT", status::BAD_LAYOUT as usize),
            ("HT_STATUS_MISMATCH", status::MISMATCH as usize),
            ("HT_STATUS_TOO_SMALL", status::TOO_SMALL as usize),
            ("HT_STATUS_FAILED", status::FAILED as usize),
            ("HT_STATUS_BAD_EXPERTS", status::BAD_EXPERTS as usize),
            ("HT_HN_READY", host_notify::READY),
            ("HT_HN_NUM_RECV", host_notify::NUM_RECV),
            ("HT_HN_T_MAX", host_notify::T_MAX),
            ("HT_HN_STATUS", host_notify::STATUS),
            ("HT_HN_STATUS_PEER", host_notify::STATUS_PEER),
            ("HT_HN_RECV_COUNT", host_notify::RECV_COUNT),
        ];
        for &(name, rust) in pairs {
            assert_eq!(header_value(name), rust, "{name}");
        }
        let h = crate::HT_HEADER;
        assert!(h.contains("constexpr u32 HT_RT_RECV_COUNT = HT_RT_RECV_OFFSET + MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_RT_SEND_COUNT = HT_RT_RECV_COUNT + MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_RT_RANK_PREFIX = HT_RT_SEND_COUNT + MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_RT_PREFIX = HT_RT_RANK_PREFIX + MAX_RANKS * MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_MSG_HEADER_WORDS = HT_MSG_ROW + MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_HN_PER_EXPERT = HT_HN_RECV_COUNT + MAX_RANKS;"));
        assert!(h.contains("constexpr u32 HT_MSG_WORDS = HT_MSG_HEADER_WORDS + HT_MAX_LOCAL_EXPERTS;"));
        assert!(h.contains("constexpr u32 HT_CTRL_EXPERT_TOKENS = HT_CTRL_NOTIFY_MSGS + 2 * MAX_RANKS * HT_MSG_WORDS * 4;"));
        assert!(h.contains("constexpr u32 HT_CTRL_RECV_EXPERT_TOKENS = HT_CTRL_EXPERT_TOKENS + MAX_RANKS * HT_MAX_LOCAL_EXPERTS * 4;"));
        assert!(h.contains("constexpr u32 HT_CTRL_RECV_EXPECTED = HT_CTRL_RECV_EXPERT_TOKENS + HT_MAX_LOCAL_EXPERTS * 4;"));
        assert!(h.contains("constexpr u32 HT_CTRL_BYTES = HT_CTRL_RECV_EXPECTED + (1 + HT_MAX_LOCAL_EXPERTS) * 4;"));
        assert!(h.contains("constexpr u32 HT_CE_HEADER_BYTES = HT_ROW_ALIGN;") && CE_HEADER_BYTES == ROW_ALIGN);
        assert_eq!(routing::PREFIX % 4, 0, "prefix rows 16-byte aligned");
        assert_eq!(host_notify::PER_EXPERT, 16);
    }

    #[test]
    fn struct_sizes() {
        assert_eq!(std::mem::size_of::<HtLayoutArgs>(), 8 * 8 + 6 * 4);
        assert_eq!(std::mem::size_of::<HtNotifyArgs>(), 5 * 8 + 8 * MAX_RANKS + 4 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<HtDispatchArgs>(), 14 * 8 + 16 * MAX_RANKS + 5 * 8 + 12 * 4 + 8 + 3 * 8 + 2 * 4 + 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<HtCeSignalArgs>(), 5 * 8 + 2 * 8 + 3 * 8 + 6 * 4);
        assert_eq!(std::mem::size_of::<HtCombineArgs>(), 7 * 8 + 16 * MAX_RANKS + 5 * 8 + 10 * 4 + 8 + 2 * 4);
    }

    #[test]
    fn ce_staging_fits_or_refuses() {
        // FP8 7168, 4096 tokens, scales [4096, 56]: header line, payloads, line-aligned scales.
        let st = ce_staging(7168, 4096, 4096 * 56 * 4, usize::MAX).expect("fits");
        assert_eq!((st.payload_bytes, st.second_offset), (7168, 128 + 4096 * 7168));
        assert_eq!(st.bytes, st.second_offset + 4096 * 56 * 4);
        assert_eq!(ce_staging(7168, 4096, 4096 * 56 * 4, st.bytes), Some(st), "exactly the slab");
        assert_eq!(ce_staging(7168, 4096, 4096 * 56 * 4, st.bytes - 1), None, "one byte short");
        let bf16 = ce_staging(200, 3, 0, usize::MAX).expect("fits");
        assert_eq!((bf16.payload_bytes, bf16.second_offset, bf16.bytes), (200, 768, 768));
        assert_eq!(ce_staging(usize::MAX, 2, 0, usize::MAX), None, "overflow refuses");
        // The combine's rows fit the slab whenever its rows do: payload and weights are at most a slab row.
        for (hidden, topk, t_max) in [(7168, 8, 4096), (128, 1, 1), (256, 0, 7)] {
            let row = combine_row_bytes(hidden, topk);
            assert!(ce_staging(2 * hidden, t_max, t_max * topk * 4, (t_max + 2) * row).is_some(), "{hidden} {topk} {t_max}");
        }
    }

    #[test]
    fn row_sizes() {
        // BF16 7168 top-8: 14336 payload + (16 + 0 + 8 + 1) words = 100 bytes -> 112, the row to 128.
        assert_eq!(dispatch_row_bytes(7168, false, 8), 14336 + 128);
        // FP8 7168 top-8: 7168 + (16 + 56 + 8 + 1) * 4 = 324 -> 336, the row to 128.
        assert_eq!(dispatch_row_bytes(7168, true, 8), 7168 + 384);
        // No top-k: the source index alone, the row padded.
        assert_eq!(dispatch_row_bytes(128, false, 0), 256 + 128);
        assert_eq!(combine_row_bytes(7168, 8), 14336 + 128);
        assert_eq!(combine_row_bytes(7168, 0), 14336);
        assert_eq!(combine_row_bytes(256, 1), 512 + 128);
        for h in [128, 256, 7168] {
            for k in 0..10 {
                assert_eq!(dispatch_row_bytes(h, false, k) % ROW_ALIGN, 0);
                assert_eq!(dispatch_row_bytes(h, true, k) % ROW_ALIGN, 0);
                assert_eq!(combine_row_bytes(h, k) % ROW_ALIGN, 0);
            }
        }
    }

    #[test]
    fn region_parts_are_disjoint_and_inside() {
        for nvl in [0usize, 1000, 4096, 1 << 20, 3 << 20, (1 << 30) + 12345] {
            for r in 1..=MAX_RANKS {
                let g = HtRegion { num_nvl_bytes: nvl, num_ranks: r };
                let fs = g.flag_slots();
                assert_eq!(fs, nvl / (r * 1024));
                assert!(g.dispatch_flags_offset() + r * fs * 4 <= g.combine_flags_offset());
                assert!(g.combine_flags_offset() + r * fs * 4 <= g.dispatch_slab_offset());
                assert_eq!(g.dispatch_slab_offset() + g.slab_bytes(), g.combine_slab_offset());
                assert!(g.combine_slab_offset() + g.slab_bytes() <= nvl.max(g.combine_slab_offset()));
                assert_eq!(g.dispatch_slab_offset() % REGION_ALIGN, 0);
                assert_eq!(g.combine_slab_offset() % REGION_ALIGN, 0);
                for row in [32usize, 272, 14448] {
                    let rows = g.slab_rows(row);
                    assert!(rows <= fs);
                    assert!(r * rows * row <= g.slab_bytes(), "nvl {nvl} r {r} row {row}");
                }
            }
        }
    }

    #[test]
    fn bytes_needed_fits_and_is_tight() {
        for (t, h, k, r, fp8) in
            [(4096, 7168, 8, 4, false), (4096, 7168, 8, 4, true), (1, 128, 1, 2, false), (8192, 128, 4, 2, false), (50, 1024, 8, 8, true)]
        {
            let rows = [dispatch_row_bytes(h, fp8, k), combine_row_bytes(h, k)];
            let n = bytes_needed(t, r, &rows);
            let g = HtRegion { num_nvl_bytes: n, num_ranks: r };
            assert!(rows.iter().all(|&row| g.slab_rows(row) >= t), "{t} {h} {k} {r} {fp8}");
            let smaller = HtRegion { num_nvl_bytes: n - (1 << 20), num_ranks: r };
            assert!(rows.iter().any(|&row| smaller.slab_rows(row) < t), "not tight: {t} {h} {k} {r} {fp8}");
            assert_eq!(n % (1 << 20), 0);
        }
        assert_eq!(bytes_needed(0, 4, &[1024]), 0);
        // The benchmark shape needs under half a GiB per rank.
        let bench = bytes_needed(4096, 4, &[dispatch_row_bytes(7168, false, 8), combine_row_bytes(7168, 8)]);
        assert!(bench < 480 << 20, "{bench}");
    }

    #[test]
    fn signature_round_trips() {
        let s = CallSignature { hidden: 7168, num_experts: 256, topk: 8, fp8: true, has_topk: true, no_sync: false };
        assert_eq!(CallSignature::decode(call_signature(s)), s);
        let t = CallSignature { fp8: false, ..s };
        assert_ne!(call_signature(s), call_signature(t));
        assert!(s.to_string().contains("hidden 7168"));
    }

    #[test]
    fn split_partitions() {
        for total in [0usize, 1, 5, 31, 4096, 4097] {
            for parts in [1usize, 2, 3, 12, 192] {
                assert_eq!(split(total, 0, parts), 0);
                assert_eq!(split(total, parts, parts), total);
                let mut covered = 0;
                for i in 0..parts {
                    let (a, b) = (split(total, i, parts), split(total, i + 1, parts));
                    assert!(a <= b && b - a <= total.div_ceil(parts));
                    covered += b - a;
                }
                assert_eq!(covered, total);
            }
        }
    }
}
