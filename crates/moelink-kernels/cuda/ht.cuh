// moelink high-throughput (HT) intranode kernels: what the four families (ht_layout.cu, ht_notify.cu,
// ht_dispatch.cu, ht_combine.cu) share. Mirrored in Rust by moelink_kernels::ht (a test parses this file).
//
// Every HT family is compiled with MAX_RANKS defined (moelink_kernels::abi::MAX_RANKS).
//
// Memory a rank owns, and who writes it (docs/protocols.md, "HT"):
//   control region (ctrl::HT of the symmetric buffer, HT_CTRL_* byte offsets below):
//     epochs and block counters            this rank's kernels only
//     dispatch/combine consumed[src]       rank `src`'s last block: "I have read what you sent in call e"
//     notify flags[parity][src], msgs      rank `src`'s notify kernel
//   data region (HT_DATA, num_nvl_bytes; offsets computed by moelink_kernels::ht::HtRegion):
//     dispatch row flags [src][slot] u32   rank `src`'s dispatch senders (value: dispatch epoch)
//     combine row flags  [src][slot] u32   rank `src`'s combine senders (value: combine epoch)
//     dispatch slab [src][slot] rows       rank `src`'s dispatch senders
//     combine slab  [src][slot] rows       rank `src`'s combine senders
//   The flag arrays sit at fixed offsets for the buffer's lifetime (row layouts change between calls; a flag
//   must never land on stale row bytes of an earlier call), with flag_slots entries per source.
#pragma once
#include "ptx.cuh"

#if !defined(MAX_RANKS)
#error "HT kernels need MAX_RANKS"
#endif
static_assert(MAX_RANKS >= 1 && MAX_RANKS <= WARP_SIZE, "one lane per rank");

// Timing experiments (JIT constant HT_EXPERIMENT of ht_dispatch/ht_combine; 0 in every real call): each bit
// removes one role's data movement while keeping its protocol (flags, fences, waits), so that the time of
// the other role alone can be measured. Results are wrong with bits 1, 2 and 8; bit 4 leaves them right and
// drops only the dispatch's per-expert layout checks, so that their cost can be measured beside the real call.
constexpr u32 HT_EXP_NO_COPY_OUT = 1;         // receivers/reducers wait for the flags but move no payload
constexpr u32 HT_EXP_NO_REMOTE_PAYLOAD = 2;   // senders store meta words and flags but no remote payload
constexpr u32 HT_EXP_NO_EXPERT_CHECK = 4;     // no per-expert counting (check_token_ranks, store_meta, check_expert_tokens)
constexpr u32 HT_EXP_NO_OWN_PAYLOAD = 8;      // dispatch receivers store the own rows' meta words but not their payload

// Timing trace (moelink::KernelTracing::high_throughput on the host; the argument `trace` is 0 in every other call): %globaltimer
// stamps into host-mapped u64 words, per block HT_TRACE_BLOCK_WORDS(warps) of them: block start, block end,
// then per warp the start and the end of its work (sender: after the hand-back wait, until its last flag;
// receiver: after this rank's own rows, until its last row). moelink::backend::cuda::ht::trace mirrors it.
constexpr u32 HT_TRACE_BLOCK_START = 0;
constexpr u32 HT_TRACE_BLOCK_END = 1;
constexpr u32 HT_TRACE_WARP_START = 2;  // + 2 * warp
constexpr u32 HT_TRACE_WARP_END = 3;    // + 2 * warp

__device__ __forceinline__ void ht_trace_stamp(u64 trace, u32 words_per_block, u32 word) {
  if (trace != 0) reinterpret_cast<volatile u64*>(trace)[(u64)blockIdx.x * words_per_block + word] = ptx::globaltimer();
}

// FP8 scales cover this many channels each (moelink::ht::FP8_BLOCK).
constexpr u32 HT_FP8_BLOCK = 128;
// Slab rows are whole multiples of this (moelink_kernels::ht::ROW_ALIGN): every row starts on a 128-byte line,
// so a warp's 512-byte run of 16-byte stores covers whole lines on its way over NVLink.
constexpr u32 HT_ROW_ALIGN = 128;

// ------------------------------------------------------------------------------------ control region
// Byte offsets inside a rank's HT control region. Counters and flags that different writers touch sit on
// their own 128-byte lines.
constexpr u32 HT_CTRL_NOTIFY_EPOCH = 0;            // u32: calls of ht_notify so far
constexpr u32 HT_CTRL_DISPATCH_EPOCH = 4;          // u32: calls of ht_dispatch so far (not counting skipped)
constexpr u32 HT_CTRL_COMBINE_EPOCH = 8;           // u32: calls of ht_combine so far (not counting skipped)
constexpr u32 HT_CTRL_DISPATCH_CE_GO = 12;         // u32: the dispatch epoch the copy-engine pieces may signal (0: none)
constexpr u32 HT_CTRL_DISPATCH_CE_SEEN = 16;       // u32: the dispatch epoch the copy-engine wait last read
constexpr u32 HT_CTRL_COMBINE_CE_GO = 20;          // u32: the same for the combine
constexpr u32 HT_CTRL_COMBINE_CE_SEEN = 24;
constexpr u32 HT_CTRL_DISPATCH_DONE = 128;         // u32: blocks of the running ht_dispatch that finished
constexpr u32 HT_CTRL_COMBINE_DONE = 256;          // u32: blocks of the running ht_combine that finished
constexpr u32 HT_CTRL_DISPATCH_CONSUMED = 384;     // u32[MAX_RANKS]: [src] = last dispatch epoch src consumed
constexpr u32 HT_CTRL_COMBINE_CONSUMED = 512;      // u32[MAX_RANKS]: [src] = last combine epoch src consumed
constexpr u32 HT_CTRL_NOTIFY_FLAGS = 640;          // u32[2][MAX_RANKS]: [parity][src] = notify epoch
constexpr u32 HT_CTRL_DISPATCH_CHUNK = 768;        // u32: next sender chunk of the running ht_dispatch (0 between calls)
constexpr u32 HT_CTRL_COMBINE_CHUNK = 896;         // u32: next sender chunk of the running ht_combine (0 between calls)
constexpr u32 HT_CTRL_NOTIFY_MSGS = 1024;          // u32[2][MAX_RANKS][HT_MSG_WORDS]
constexpr u32 HT_MAX_LOCAL_EXPERTS = 8192;         // experts per rank a notify message has room for
constexpr u32 HT_MSG_ROW = 8;                      // first word of the source's tokens per rank (below)
constexpr u32 HT_MSG_HEADER_WORDS = HT_MSG_ROW + MAX_RANKS;
constexpr u32 HT_MSG_WORDS = HT_MSG_HEADER_WORDS + HT_MAX_LOCAL_EXPERTS;
// u32[MAX_RANKS * HT_MAX_LOCAL_EXPERTS]: [e] = tokens of the running ht_dispatch whose top-k selects expert e
// (the senders count, the last block compares with num_tokens_per_expert and zeroes them: 0 between calls)
constexpr u32 HT_CTRL_EXPERT_TOKENS = HT_CTRL_NOTIFY_MSGS + 2 * MAX_RANKS * HT_MSG_WORDS * 4;
// u32[HT_MAX_LOCAL_EXPERTS]: [e] = rows of the running ht_dispatch whose top-k ids select local expert e (the
// receivers count, the last block compares with what notify summed and zeroes them: 0 between calls)
constexpr u32 HT_CTRL_RECV_EXPERT_TOKENS = HT_CTRL_EXPERT_TOKENS + MAX_RANKS * HT_MAX_LOCAL_EXPERTS * 4;
// u32[1 + HT_MAX_LOCAL_EXPERTS]: the running ht_dispatch's copy of notify's host-mapped READY word and per-expert
// sums, read once at the start (receiver warp 0), so that the last block's check reads device memory
constexpr u32 HT_CTRL_RECV_EXPECTED = HT_CTRL_RECV_EXPERT_TOKENS + HT_MAX_LOCAL_EXPERTS * 4;
constexpr u32 HT_CTRL_BYTES = HT_CTRL_RECV_EXPECTED + (1 + HT_MAX_LOCAL_EXPERTS) * 4;
static_assert(HT_CTRL_NOTIFY_FLAGS + 2 * MAX_RANKS * 4 <= HT_CTRL_NOTIFY_MSGS, "notify flags overlap the messages");
static_assert(HT_CTRL_COMBINE_CONSUMED + MAX_RANKS * 4 <= HT_CTRL_NOTIFY_FLAGS, "consumed flags overlap");
static_assert(HT_CTRL_NOTIFY_FLAGS + 2 * MAX_RANKS * 4 <= HT_CTRL_DISPATCH_CHUNK, "chunk counters overlap the notify flags");

// ------------------------------------------------------------------------------------ copy-engine staging
// With HT_CE (two ranks; ht_ce_signal.cu issues the signals), a rank's copy engines push rows into its slab at
// the peer ([src] of the peer's slab) in pieces, and piece p is complete when row flag [src][p] at the peer
// holds the call's epoch. The staging: a header line (the source's FP8 scale strides, i64 per token and per
// group, which ht_ce_signal stores), then rows of payload bytes from HT_CE_HEADER_BYTES, then a second area
// at a line-aligned offset:
//   dispatch (cached): row t is the source's token t (its whole x), pieces of ce_piece_tokens tokens; the
//     second area is the source's x_scales storage as it is (FP8).
//   combine: row j is the j-th row this rank received from the peer (x rows [recv_offset[peer], + count)), pieces
//     of ce_piece_rows rows; the second area is their top-k weights, TOPK f32 a row.
constexpr u32 HT_CE_HEADER_BYTES = HT_ROW_ALIGN;
constexpr u32 HT_CE_WAIT = 0xffffffffu;  // ht_ce_signal's `piece` for the wait before the first piece

// Words of a notify message (what a rank tells each destination before a fresh dispatch).
constexpr u32 HT_MSG_COUNT = 0;        // tokens the source sends to this destination
constexpr u32 HT_MSG_NUM_TOKENS = 1;   // the source's token count T
constexpr u32 HT_MSG_STATUS = 2;       // HT_STATUS_BAD_LAYOUT / _BAD_EXPERTS when the source's layout tensors disagree
constexpr u32 HT_MSG_SIG_LO = 3;       // the source's call signature (must equal everyone's)
constexpr u32 HT_MSG_SIG_HI = 4;
// HT_MSG_ROW + r (r < MAX_RANKS): tokens the source sends to rank r (its num_tokens_per_rank, as counted from
// is_token_in_rank; 0 past num_ranks): every rank learns the whole count matrix, for rank_prefix_matrix.
// then HT_MSG_HEADER_WORDS + e: tokens the source sends to the destination's local expert e

// ------------------------------------------------------------------------------------ routing (handle)
// A dispatch handle's device buffer: i32 words. Written by ht_notify, read by ht_dispatch and ht_combine.
constexpr u32 HT_RT_STATUS = 0;                              // HT_STATUS_* (0: the call may move data)
constexpr u32 HT_RT_STATUS_PEER = 1;                         // rank the status blames, or NO_PEER
constexpr u32 HT_RT_NUM_RECV = 2;                            // rows this rank receives (N)
constexpr u32 HT_RT_T_MAX = 3;                               // largest token count of any rank
constexpr u32 HT_RT_RECV_OFFSET = 8;                         // [MAX_RANKS] first receive position of each source
constexpr u32 HT_RT_RECV_COUNT = HT_RT_RECV_OFFSET + MAX_RANKS;  // [MAX_RANKS] rows from each source
constexpr u32 HT_RT_SEND_COUNT = HT_RT_RECV_COUNT + MAX_RANKS;   // [MAX_RANKS] rows this rank sends each rank
constexpr u32 HT_RT_RANK_PREFIX = HT_RT_SEND_COUNT + MAX_RANKS;  // [R * R] DeepEP's rank_prefix_matrix (below)
constexpr u32 HT_RT_PREFIX = HT_RT_RANK_PREFIX + MAX_RANKS * MAX_RANKS;  // [(T + 1) * R]: prefix[t][r] = tokens < t sent to r
// HT_RT_RANK_PREFIX + i * R + j (i, j < R, row-major over the call's R ranks): tokens rank j receives from
// ranks 0..=i (DeepEP's rank_prefix_matrix; rank j's rows from source i are [[i-1][j], [i][j]) of its
// outputs); 0 when the exchange failed.
static_assert(HT_RT_PREFIX % 4 == 0, "prefix rows start 16-byte aligned");

// Status bits (agreed by every rank: derived from every rank's notify message).
constexpr u32 HT_STATUS_BAD_LAYOUT = 1;  // some rank's num_tokens_per_rank disagrees with its is_token_in_rank
constexpr u32 HT_STATUS_MISMATCH = 2;    // call signatures differ
constexpr u32 HT_STATUS_TOO_SMALL = 4;   // the dispatch slab cannot hold T_max rows per source
constexpr u32 HT_STATUS_FAILED = 8;      // the notify exchange itself failed (timeout)
constexpr u32 HT_STATUS_BAD_EXPERTS = 16;  // some rank's num_tokens_per_expert disagrees with its num_tokens_per_rank

// ------------------------------------------------------------------------------------ host-mapped notify
// u32 words ht_notify writes for the host in CPU-synchronised mode; HT_HN_READY last (release).
constexpr u32 HT_HN_READY = 0;        // the call's sequence number once everything else is written
constexpr u32 HT_HN_NUM_RECV = 1;
constexpr u32 HT_HN_T_MAX = 2;
constexpr u32 HT_HN_STATUS = 3;
constexpr u32 HT_HN_STATUS_PEER = 4;
constexpr u32 HT_HN_RECV_COUNT = 8;   // [MAX_RANKS]
constexpr u32 HT_HN_PER_EXPERT = HT_HN_RECV_COUNT + MAX_RANKS;  // [E / R] received tokens per local expert
static_assert(HT_HN_PER_EXPERT == 16, "moelink_kernels::ht::host_notify::PER_EXPERT");

// ------------------------------------------------------------------------------------ helpers

// Start of part `i` of `parts` equal parts of [0, total) (parts i and i + 1 meet; part `parts` ends at total).
__device__ __forceinline__ u32 ht_split(u32 total, u32 i, u32 parts) { return (u32)((u64)total * i / parts); }

__device__ __forceinline__ u64 ht_min_u64(u64 a, u64 b) { return a < b ? a : b; }

// Work assignment of items [0, count) (tokens, or one source's slab rows) to warp `w` of `n`, one chunk
// [next, end) at a time. chunk > 0: interleaved — chunks of `chunk` items, warp w takes chunks
// w - rotate, w - rotate + n, ... (mod n), so that every warp works near the same front of the item order;
// the senders and the receivers both walk the token order, so the rows a receiver waits for are the ones
// being sent now (with one contiguous part per warp, a receiver warp whose part a sender warp reaches
// late idled for most of the call, and the receivers fell behind). chunk == 0: one contiguous part per
// warp (ht_split). A cursor with next == end after ht_next_chunk is finished.
struct HtCursor {
  u32 next;
  u32 end;
};

__device__ __forceinline__ HtCursor ht_first_chunk(u32 count, u32 chunk, u32 w, u32 n, u32 rotate) {
  if (chunk == 0) return HtCursor{ht_split(count, w, n), ht_split(count, w + 1, n)};
  const u64 start = (u64)((w + n - rotate % n) % n) * chunk;
  if (start >= count) return HtCursor{count, count};
  return HtCursor{(u32)start, (u32)ht_min_u64(start + chunk, count)};
}

// Dynamic sender chunks: warps take chunk indices 0, 1, 2, ... from a per-call counter (in order, so the
// front of the token order stays where every warp works), each as soon as it is done with the last one, so that
// the sender warps end together (with a fixed share per warp the slowest end ~25% after the median, and the
// kernel with them). Lane 0's atomic, broadcast; relaxed: an acq_rel one would make lane 0 wait for its
// outstanding NVLink stores (the flags just published) once per chunk, which costs more than the balance gains.
__device__ __forceinline__ u32 ht_grab_chunk(u32* counter) {
  u32 q = 0;
  if (threadIdx.x % WARP_SIZE == 0) q = ptx::atom_add_relaxed_gpu(counter, 1u);
  return __shfl_sync(FULL_WARP_MASK, q, 0);
}

// Items [q * chunk, (q + 1) * chunk) of [0, count), or a finished cursor past the end.
__device__ __forceinline__ HtCursor ht_chunk_at(u32 q, u32 chunk, u32 count) {
  const u64 start = (u64)q * chunk;
  if (start >= count) return HtCursor{count, count};
  return HtCursor{(u32)start, (u32)ht_min_u64(start + chunk, count)};
}

// Moves a cursor whose chunk is done (next == end) to the warp's next chunk, or leaves it finished.
__device__ __forceinline__ void ht_next_chunk(HtCursor& c, u32 count, u32 chunk, u32 n) {
  if (chunk == 0 || c.end == 0 || c.next != c.end) return;
  const u64 start = (u64)((c.end - 1) / chunk) * chunk + (u64)n * chunk;
  if (start >= count) {
    c.next = c.end = count;
    return;
  }
  c.next = (u32)start;
  c.end = (u32)ht_min_u64(start + chunk, count);
}

__device__ __forceinline__ u32* ht_ctrl_word(u64 ctrl, u32 byte_offset) {
  return reinterpret_cast<u32*>(ctrl + byte_offset);
}

// One operation's words in the control region (HT_CTRL_* byte offsets): its call counter, its blocks' done
// counter, its sender chunk counter and its consumed flags.
struct HtOpWords {
  u32 epoch, done, chunk, consumed, ce_go, ce_seen;
};
constexpr HtOpWords HT_DISPATCH_WORDS = {HT_CTRL_DISPATCH_EPOCH,     HT_CTRL_DISPATCH_DONE,  HT_CTRL_DISPATCH_CHUNK,
                                         HT_CTRL_DISPATCH_CONSUMED, HT_CTRL_DISPATCH_CE_GO, HT_CTRL_DISPATCH_CE_SEEN};
constexpr HtOpWords HT_COMBINE_WORDS = {HT_CTRL_COMBINE_EPOCH,     HT_CTRL_COMBINE_DONE,  HT_CTRL_COMBINE_CHUNK,
                                        HT_CTRL_COMBINE_CONSUMED, HT_CTRL_COMBINE_CE_GO, HT_CTRL_COMBINE_CE_SEEN};

// HT_CE's block end (thread 0 of every block, before its arrival): waits until this call's copy-engine wait
// kernel has published ce_seen (the epoch it read), so that the last block cannot advance the epoch first.
__device__ __forceinline__ void ht_ce_block_end(u64 ctrl_me, HtOpWords w, const Deadline& d, u32 rank) {
  if (threadIdx.x != 0) return;
  const u32* seen = ht_ctrl_word(ctrl_me, w.ce_seen);
  const u32 epoch = ptx::ld_relaxed_gpu(ht_ctrl_word(ctrl_me, w.epoch)) + 1;
  (void)spin_until([&]() { return ptx::ld_relaxed_gpu(seen) == epoch; }, d, rank);
}

// The frame of ht_dispatch and ht_combine, run by every thread of the grid (WARPS warps per block, trace
// stamps TRACE_WORDS apart per block):
//   - Nothing moves when the handle's routing status is non-zero (every rank saw the same notify messages,
//     so every rank returns here; ht_notify reported why), nor when T_max (every rank's largest token count)
//     exceeds slab_rows for this row size (a cached call of bigger rows; block 0 reports
//     ERR_BUFFER_TOO_SMALL, details T_max and row_bytes << 32 | slab_rows). Either way the epoch does not
//     advance, on any rank.
//   - The call's epoch is the counter + 1. Blocks [0, num_send_blocks) run send(epoch, deadline, warp,
//     warps), the others receive(...), each numbering its role's warps from 0.
//   - End, after every block's last access to the slabs: the last block to arrive at the done counter
//     (acq_rel at GPU scope, so it sees every other block's reads as done) resets it and the sender chunk
//     counter, then — after one system-scope fence — tells every peer that this rank has consumed call
//     `epoch` (consumed[rank] = epoch in the peer's control region) and stores the epoch for the next call.
//     Before its arrival every thread of a block runs block_end() (what the block counted goes out), and after
//     it every thread of the last block runs last_block(deadline): checks of what the whole grid counted.
template <u32 WARPS, u32 TRACE_WORDS, typename Args, typename Send, typename Receive, typename BlockEnd, typename LastBlock>
__device__ __forceinline__ void ht_run_op(const Args& a, u32 phase, u32 num_ranks, u32 row_bytes, HtOpWords w, Send send,
                                          Receive receive, BlockEnd block_end, LastBlock last_block) {
  __shared__ u32 s_epoch;
  __shared__ bool s_last;
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  if (routing[HT_RT_STATUS] != 0) return;
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, phase);
  const u32 t_max = (u32)routing[HT_RT_T_MAX];
  if (t_max > a.slab_rows) {
    if (blockIdx.x == 0 && threadIdx.x == 0) report_error(d, ERR_BUFFER_TOO_SMALL, NO_PEER, t_max, ((u64)row_bytes << 32) | a.slab_rows);
    return;
  }
  const u32 warp = threadIdx.x / WARP_SIZE;
  if (threadIdx.x == 0) {
    ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_BLOCK_START);
    s_epoch = ptx::ld_relaxed_gpu(ht_ctrl_word(a.ctrl[a.rank], w.epoch)) + 1;
  }
  __syncthreads();
  const u32 epoch = s_epoch;
  if (blockIdx.x < a.num_send_blocks)
    send(epoch, d, blockIdx.x * WARPS + warp, a.num_send_blocks * WARPS);
  else
    receive(epoch, d, (blockIdx.x - a.num_send_blocks) * WARPS + warp, (gridDim.x - a.num_send_blocks) * WARPS);
  __syncthreads();
  block_end();
  __syncthreads();
  if (threadIdx.x == 0) {
    ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_BLOCK_END);
    u32* done = ht_ctrl_word(a.ctrl[a.rank], w.done);
    s_last = ptx::atom_add_acq_rel_gpu(done, 1u) == gridDim.x - 1;
    if (s_last) {
      *done = 0u;
      *ht_ctrl_word(a.ctrl[a.rank], w.chunk) = 0u;  // every sender warp is done taking chunks
      ptx::fence_acq_rel_sys();
      for (u32 r = 0; r < num_ranks; r++)
        if (r != a.rank) ptx::st_relaxed_sys(ht_ctrl_word(a.ctrl[r], w.consumed) + a.rank, epoch);
      *ht_ctrl_word(a.ctrl[a.rank], w.epoch) = epoch;
    }
  }
  __syncthreads();
  if (s_last) last_block(d);
}

// Waits (one lane per peer) until every peer has consumed call `epoch - 1` of this family, i.e. may be
// written again. Returns the same value on every lane: false after a timeout or an earlier fatal error.
__device__ __forceinline__ bool ht_wait_consumed(u64 ctrl_me, u32 consumed_offset, u32 rank, u32 num_ranks, u32 epoch,
                                                 const Deadline& d) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  bool ok = true;
  if (lane < num_ranks && lane != rank) {
    const u32* flag = ht_ctrl_word(ctrl_me, consumed_offset) + lane;
    ok = wait_flag_geq(flag, epoch - 1, d, lane);
    if (ok) (void)ptx::ld_acquire_sys(flag);
  }
  ok = __all_sync(FULL_WARP_MASK, ok);
  __syncwarp();
  return ok;
}

// ------------------------------------------------------------------------------- the senders' releaser warp
// With HT_RELEASER (a JIT constant of ht_dispatch and ht_combine), the last warp of every sender block stores
// the row flags for the block's other warps, so that no warp that stores rows waits for their NVLink
// acknowledgements: over NVLink the senders' own fences cost ~10 µs of a call (docs/perf-notes.md, item 3).
//   - A sender warp posts a batch (lane r: the slots [first, end) it filled at destination r) with a CTA-scope
//     release by every lane, each to its own word: a fence orders only its own thread's writes.
//   - Releaser lane l acquires sender lane l's word; then every releaser lane fences at system scope, which
//     orders what its acquire observed (cumulativity) before the flags that lane r then stores.
//   - One fence covers every batch posted since the last. A sender posts its next batch once the flags of
//     the one before are out, so that a warp needs one slot range per destination.
constexpr u32 HT_RELEASE_OPEN = 0xffffffffu;
// Warps of a sender block that send rows: all of them, or all but the releaser.
template <u32 WARPS, bool RELEASER>
constexpr u32 HT_SENDER_WARPS = RELEASER ? WARPS - 1 : WARPS;
template <u32 SENDERS>
struct HtReleaseBox {
  static_assert(SENDERS >= 1 && SENDERS <= 32, "a releaser's ready mask is one word");
  u32 posted[SENDERS][WARP_SIZE];  // batches lane l of sender warp w posted
  u32 released[SENDERS];           // batches of w whose flags are out (the releaser's lane 0 writes it)
  u32 final_posts[SENDERS];        // w's batch count once w is done; HT_RELEASE_OPEN before
  i32 first[SENDERS][MAX_RANKS];   // the pending batch's slots [first, end) per destination
  i32 end[SENDERS][MAX_RANKS];
};

// Every thread of a sender block, before any warp posts.
template <u32 SENDERS>
__device__ __forceinline__ void ht_release_box_init(HtReleaseBox<SENDERS>& box) {
  for (u32 i = threadIdx.x; i < SENDERS * WARP_SIZE; i += blockDim.x) (&box.posted[0][0])[i] = 0u;
  for (u32 i = threadIdx.x; i < SENDERS; i += blockDim.x) {
    box.released[i] = 0u;
    box.final_posts[i] = HT_RELEASE_OPEN;
  }
  __syncthreads();
}

// Sender warp w posts a batch (lane r < MAX_RANKS: slots [first, end) at r; first == end for no row).
// `posts` counts w's batches. False on every lane once a fatal error was raised or the wait timed out.
template <u32 SENDERS>
__device__ __forceinline__ bool ht_post_batch(HtReleaseBox<SENDERS>& box, u32 w, u32& posts, i32 first, i32 end, const Deadline& d) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  bool ok = true;
  if (lane == 0) ok = spin_until([&]() { return ptx::ld_acquire_cta(&box.released[w]) == posts; }, d, NO_PEER);
  if (!__shfl_sync(FULL_WARP_MASK, ok, 0)) return false;
  if (lane < MAX_RANKS) {
    box.first[w][lane] = first;
    box.end[w][lane] = end;
  }
  posts++;
  ptx::st_release_cta(&box.posted[w][lane], posts);
  return true;
}

// Sender warp w has posted its last batch (`posts` in all), on every path out of its work.
template <u32 SENDERS>
__device__ __forceinline__ void ht_sender_done(HtReleaseBox<SENDERS>& box, u32 w, u32 posts) {
  __syncwarp();
  if (threadIdx.x % WARP_SIZE == 0) ptx::st_release_cta(&box.final_posts[w], posts);
}

// The releaser warp, until every sender warp of its block is done and released, or a fatal error was raised.
// Lane r (r < num_ranks, r != me) stores the epoch into flags_of(r)[slot] for the slots posted for r.
template <u32 SENDERS, typename FlagsOf>
__device__ __forceinline__ void ht_release_loop(HtReleaseBox<SENDERS>& box, u32 me, u32 num_ranks, u32 epoch, FlagsOf flags_of,
                                                const Deadline& d) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  const bool dest_lane = lane < num_ranks && lane != me;
  u32* flags = dest_lane ? flags_of(lane) : nullptr;
  u32 idle = 0;
  while (true) {
    u32 ready = 0;
    bool open = false;
#pragma unroll 1
    for (u32 w = 0; w < SENDERS; w++) {
      const u32 released = box.released[w];
      if (__all_sync(FULL_WARP_MASK, ptx::ld_acquire_cta(&box.posted[w][lane]) != released))
        ready |= 1u << w;
      else
        open = open || ptx::ld_acquire_cta(&box.final_posts[w]) != released;
    }
    if (ready == 0u) {
      if (!__any_sync(FULL_WARP_MASK, open)) return;
      if (++idle % DEADLINE_POLL_SPINS == 0 && __any_sync(FULL_WARP_MASK, error_raised(d))) return;
      continue;
    }
    ptx::fence_acq_rel_sys();
    __syncwarp();
    if (dest_lane) {
      for (u32 todo = ready; todo != 0u; todo &= todo - 1) {
        const u32 w = __ffs(todo) - 1;
        for (i32 slot = box.first[w][lane]; slot < box.end[w][lane]; slot++) ptx::st_relaxed_sys(flags + (u32)slot, epoch);
      }
    }
    __syncwarp();
    if (lane == 0)
      for (u32 todo = ready; todo != 0u; todo &= todo - 1) {
        const u32 w = __ffs(todo) - 1;
        ptx::st_release_cta(&box.released[w], box.released[w] + 1);
      }
    __syncwarp();
  }
}

// The senders of one block of ht_dispatch / ht_combine (WARPS warps, SENDERS of them send). With RELEASER
// the last warp runs ht_release_loop for the others, and send_rows(box, warp, warps, posts) numbers the
// senders without it; every sender posts its batches and then says it is done.
template <u32 WARPS, u32 SENDERS, u32 TRACE_WORDS, bool RELEASER, typename Args, typename SendRows>
__device__ __forceinline__ void ht_send_block(const Args& a, u32 num_ranks, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps,
                                              SendRows send_rows) {
  static_assert(SENDERS == HT_SENDER_WARPS<WARPS, RELEASER>, "the releaser is one of the block's warps");
  __shared__ HtReleaseBox<SENDERS> box;
  u32 posts = 0;
  if (!RELEASER) {
    send_rows(box, warp_id, num_warps, posts);
    return;
  }
  const u32 block_warp = threadIdx.x / WARP_SIZE;
  ht_release_box_init(box);
  if (block_warp == SENDERS) {
    const u32 me = a.rank;
    auto flags_of = [&](u32 r) { return reinterpret_cast<u32*>(a.data[r] + a.flags_offset) + (u64)me * a.flag_slots; };
    const u32 trace_warp = 2 * block_warp;
    if (threadIdx.x % WARP_SIZE == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_START + trace_warp);
    ht_release_loop(box, me, num_ranks, epoch, flags_of, d);
    if (threadIdx.x % WARP_SIZE == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_END + trace_warp);
    return;
  }
  send_rows(box, warp_id / WARPS * SENDERS + block_warp, num_warps / WARPS * SENDERS, posts);
  ht_sender_done(box, block_warp, posts);
}
