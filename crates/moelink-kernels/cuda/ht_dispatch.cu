// moelink kernel family: high-throughput intranode dispatch (direct writes into per-source receive slabs).
//
// JIT constants (from moelink_kernels::ht::HtDispatchVariant):
//   MAX_RANKS                         ranks the argument struct has room for
//   HIDDEN                            channels per token
//   FP8                               1: e4m3 payload with fp32 scales per HT_FP8_BLOCK channels; 0: bf16
//   TOPK                              top-k entries travelling with each token (0: none, e.g. cached dispatch)
//   DISPATCH_WARPS                    warps per block (every block sends or receives, never both)
//   MAX_UNROLL                        16-byte vectors a lane keeps in flight per copy round
//   RELEASE_BATCH                     tokens a sender warp writes before one release publishes them all
//   HT_RELEASER                       1: the last warp of each sender block releases the others' rows (ht.cuh)
//   HT_EXPERIMENT                     0; timing experiments only (wrong results): HT_EXP_* bits (ht.cuh)
//   HT_CE                             1: copy-engine receive (two ranks, cached dispatch; receive_ce), else 0
//   ROW_BYTES                         slab row size as Rust computes it (moelink_kernels::ht::dispatch_row_bytes)
//   MOELINK_SIZEOF_HT_DISPATCH_ARGS   sizeof(moelink_kernels::ht::HtDispatchArgs)
#include "ht.cuh"

#if !defined(HIDDEN) || !defined(FP8) || !defined(TOPK) || !defined(DISPATCH_WARPS) || !defined(MAX_UNROLL) || \
    !defined(RELEASE_BATCH) || !defined(HT_RELEASER) || !defined(HT_EXPERIMENT) || !defined(ROW_BYTES) ||                   \
    !defined(HT_CE) || !defined(MOELINK_SIZEOF_HT_DISPATCH_ARGS)
#error "ht_dispatch.cu needs every JIT constant listed at the top of the file"
#endif

constexpr u32 VEC_BYTES = 16;
constexpr u32 PAYLOAD_BYTES = HIDDEN * (FP8 ? 1 : 2);
constexpr u32 PAYLOAD_VECS = PAYLOAD_BYTES / VEC_BYTES;
constexpr u32 NUM_SCALES = FP8 ? HIDDEN / HT_FP8_BLOCK : 0;
// A slab row: the payload, then u32 meta words: top-k ids as local i64 (2 words each, low word first), the
// FP8 scales, the top-k weights (0 where the id is -1), the source token index; padded to 16 bytes, and the
// row to HT_ROW_ALIGN.
constexpr u32 META_SCALES = 2 * TOPK;
constexpr u32 META_WEIGHTS = META_SCALES + NUM_SCALES;
constexpr u32 META_SRC = META_WEIGHTS + TOPK;
constexpr u32 META_WORDS = META_SRC + 1;
constexpr u32 META_BYTES = (META_WORDS * 4 + VEC_BYTES - 1) / VEC_BYTES * VEC_BYTES;
constexpr u32 META_ITERS = (META_WORDS + WARP_SIZE - 1) / WARP_SIZE;  // meta words per lane
static_assert(PAYLOAD_BYTES % VEC_BYTES == 0 && PAYLOAD_VECS >= 1, "rows are whole 16-byte vectors");
static_assert(!FP8 || HIDDEN % HT_FP8_BLOCK == 0, "FP8 hidden is a multiple of the scale block");
static_assert(ROW_BYTES == (PAYLOAD_BYTES + META_BYTES + HT_ROW_ALIGN - 1) / HT_ROW_ALIGN * HT_ROW_ALIGN,
              "slab row differs from moelink_kernels::ht::dispatch_row_bytes");
constexpr u32 THREADS = DISPATCH_WARPS * WARP_SIZE;
constexpr bool EXPERT_CHECK = (HT_EXPERIMENT & HT_EXP_NO_EXPERT_CHECK) == 0;  // a timing experiment turns it off
// A row is copied in ROUNDS rounds of UNROLL vectors per lane (loads first, then stores).
constexpr u32 VECS_PER_LANE = (PAYLOAD_VECS + WARP_SIZE - 1) / WARP_SIZE;
constexpr u32 ROUNDS = (VECS_PER_LANE + MAX_UNROLL - 1) / MAX_UNROLL;
constexpr u32 UNROLL = (VECS_PER_LANE + ROUNDS - 1) / ROUNDS;
static_assert(ROUNDS * UNROLL * WARP_SIZE >= PAYLOAD_VECS && UNROLL <= MAX_UNROLL, "copy rounds cover the row");
static_assert(RELEASE_BATCH >= 1, "a sender releases at least one token per fence");
constexpr u32 SENDER_WARPS = HT_SENDER_WARPS<DISPATCH_WARPS, HT_RELEASER != 0>;  // per sender block

// Kernel argument (by value). Must match moelink_kernels::ht::HtDispatchArgs byte for byte.
struct HtDispatchArgs {
  u64 x;                   // [T, HIDDEN] bf16 / e4m3, contiguous, 16-byte aligned
  u64 x_scales;            // f32 [T, HIDDEN / 128], any strides (FP8), else 0
  i64 scale_stride_token;  // elements
  i64 scale_stride_group;  // elements
  u64 topk_idx;            // i64 [T, TOPK], contiguous (TOPK > 0)
  u64 topk_weights;        // f32 [T, TOPK], contiguous (TOPK > 0)
  u64 num_tokens_per_expert;  // i32 [E] of a fresh dispatch, checked against topk_idx (check_token_ranks); 0: none
  u64 host_notify;         // ht_notify's host-mapped words of call host_seq (CPU-sync; HT_HN_PER_EXPERT checked); 0: none
  u64 recv_x;              // [num_out_rows, HIDDEN], 16-byte aligned
  u64 recv_scales;         // f32 [num_out_rows, HIDDEN / 128] (FP8)
  u64 recv_topk_idx;       // i64 [num_out_rows, TOPK] (TOPK > 0)
  u64 recv_topk_weights;   // f32 [num_out_rows, TOPK] (TOPK > 0)
  u64 recv_src_idx;        // i32 [num_out_rows] of the handle, or 0 (cached dispatch)
  u64 routing;             // the handle buffer ht_notify wrote (HT_RT_* words, prefix)
  u64 ctrl[MAX_RANKS];     // every rank's HT control region, as addressable from this rank
  u64 data[MAX_RANKS];     // every rank's HT data region
  u64 flags_offset;        // dispatch row flags inside a data region
  u64 slab_offset;         // dispatch slab inside a data region
  u64 error_claim;         // ErrorSink::claim
  u64 error_record;        // ErrorSink::record
  u64 timeout_ns;          // per wait
  u32 rank;
  u32 num_ranks;
  u32 num_tokens;          // T of this rank
  u32 num_local_experts;   // E / R
  u32 num_out_rows;        // rows of the outputs: N (CPU-sync) or num_worst_tokens
  u32 slab_rows;           // slab rows per source for ROW_BYTES (>= T_max, checked by ht_notify)
  u32 flag_slots;          // row flags per source (>= slab_rows)
  u32 num_send_blocks;     // blocks [0, num_send_blocks) send, the others receive
  u32 send_chunk;          // tokens per sender chunk (HtCursor; 0: one contiguous part per warp)
  u32 recv_chunk;          // slab rows per receiver chunk, per source (0: one contiguous part per warp)
  u32 dynamic_send;        // 1: sender warps take chunks from HT_CTRL_DISPATCH_CHUNK (needs send_chunk > 0)
  u32 host_seq;            // the notify call whose words host_notify holds for this dispatch
  u64 trace;               // host-mapped timing trace (ht.cuh, HT_TRACE_*), or 0
  u64 send_head;           // i32 [T, R]: token t's slot among the rows sent to r, -1 where not sent; 0: not wanted
  u64 channel_prefix;      // i32 [R, num_channels]: tokens for r in channels 0..=c (all in the last); 0: not wanted
  u64 recv_channel_prefix; // i32 [R, num_channels]: where channel c of source r starts among its rows (0); 0: not wanted
  u32 num_channels;        // columns of the two channel matrices
  u32 ce_piece_tokens;     // HT_CE: tokens per piece of the peer's staging
  u64 ce_src_idx;          // HT_CE: i32 [num_out_rows], the source token of each received row (the handle's)
  u32 ce_scales_offset;    // HT_CE: byte offset of the FP8 scales in the staging
  u32 reserved;
};
constexpr u32 TRACE_WORDS = 2 + 2 * DISPATCH_WARPS;  // per block
static_assert(sizeof(HtDispatchArgs) == MOELINK_SIZEOF_HT_DISPATCH_ARGS, "HtDispatchArgs differs from the Rust definition");

// The per-expert checks' tallies (check_token_ranks, store_meta, check_expert_counts): a sender block counts
// the tokens of every expert (HT_CTRL_EXPERT_TOKENS), a receiver block the rows of each local expert
// (HT_CTRL_RECV_EXPERT_TOKENS). When they fit, a block counts in shared memory (a shared atomic per top-k
// entry) and adds its non-zero tallies to the control region once at its end (flush_tallies); a global
// atomic per entry on the few L2 lines of the counters slowed the whole dispatch by their contention.
// DISPATCH_TALLY_SLOTS: the JIT leaves it at 2048; the CPU emulator sets fewer to reach the global atomics.
#ifndef DISPATCH_TALLY_SLOTS
#define DISPATCH_TALLY_SLOTS 2048
#endif
constexpr u32 TALLY_SLOTS = DISPATCH_TALLY_SLOTS;
__shared__ u32 s_tally[TALLY_SLOTS];

__device__ __forceinline__ u32 tally_slots(const HtDispatchArgs& a, bool sender) {
  return sender ? a.num_ranks * a.num_local_experts : a.num_local_experts;
}

__device__ __forceinline__ u32* tally_counters(const HtDispatchArgs& a, bool sender) {
  return ht_ctrl_word(a.ctrl[a.rank], sender ? HT_CTRL_EXPERT_TOKENS : HT_CTRL_RECV_EXPERT_TOKENS);
}

__device__ __forceinline__ void tally(const HtDispatchArgs& a, bool sender, u32 i) {
  if (tally_slots(a, sender) <= TALLY_SLOTS)
    atomicAdd(&s_tally[i], 1u);
  else
    ptx::red_add_relaxed_gpu(tally_counters(a, sender) + i, 1u);
}

// Whether this block's role counts in this call.
__device__ __forceinline__ bool tallies(const HtDispatchArgs& a, bool sender) {
  return EXPERT_CHECK && TOPK > 0 && (sender ? a.num_tokens_per_expert != 0 : a.host_notify != 0);
}

// Before any count: the block's tallies zeroed (ht_run_op's first __syncthreads orders it before them).
__device__ __forceinline__ void zero_tallies(const HtDispatchArgs& a) {
  if (!EXPERT_CHECK || TOPK == 0) return;
  for (u32 i = threadIdx.x; i < TALLY_SLOTS; i += blockDim.x) s_tally[i] = 0u;
}

// ht_run_op's block_end, every thread after the block's last count: the non-zero tallies added to the control
// region, fenced before the block's arrival at the done counter (the last block reads them).
__device__ __forceinline__ void flush_tallies(const HtDispatchArgs& a) {
  const bool sender = blockIdx.x < a.num_send_blocks;
  const u32 n = tally_slots(a, sender);
  if (!tallies(a, sender) || n > TALLY_SLOTS) return;
  add_tallies(tally_counters(a, sender), s_tally, n);
}

// Stores meta word `w` of the row at receive position `pos` into the outputs. With host_notify, the low word
// of each local top-k id counts the row for its expert (tally; check_expert_tokens).
__device__ __forceinline__ void store_meta(const HtDispatchArgs& a, u64 pos, u32 w, u32 word) {
  if (EXPERT_CHECK && w < META_SCALES && a.host_notify != 0 && (w & 1u) == 0u && word < a.num_local_experts) tally(a, false, word);
  if (w < META_SCALES)
    reinterpret_cast<u32*>(a.recv_topk_idx)[pos * (2 * TOPK) + w] = word;
  else if (w < META_WEIGHTS)
    reinterpret_cast<u32*>(a.recv_scales)[pos * NUM_SCALES + (w - META_SCALES)] = word;
  else if (w < META_SRC)
    reinterpret_cast<u32*>(a.recv_topk_weights)[pos * TOPK + (w - META_WEIGHTS)] = word;
  else if (a.recv_src_idx != 0)
    reinterpret_cast<u32*>(a.recv_src_idx)[pos] = word;
}

// Meta word `w` of token t's row, before it is remapped for a destination: the top-k id it carries (-1 for
// words without one) and the raw word (scale, weight or token index).
struct MetaSource {
  i64 expert;
  u32 raw;
};

__device__ __forceinline__ MetaSource load_meta(const HtDispatchArgs& a, u32 t, u32 w) {
  MetaSource m = {-1, 0u};
  if (w < META_SCALES) {
    m.expert = reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + w / 2];
  } else if (w < META_WEIGHTS) {
    m.raw = reinterpret_cast<const u32*>(a.x_scales)[(i64)t * a.scale_stride_token + (i64)(w - META_SCALES) * a.scale_stride_group];
  } else if (w < META_SRC) {
    m.expert = reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + (w - META_WEIGHTS)];
    m.raw = reinterpret_cast<const u32*>(a.topk_weights)[(u64)t * TOPK + (w - META_WEIGHTS)];
  } else {
    m.raw = t;
  }
  return m;
}

// The word as destination rank r sees it: top-k ids remapped to r's local experts (-1 elsewhere, as i64 in
// two words), weights zeroed where the id is -1 there; scales and the token index as they are. Loaded once
// per word (load_meta) and remapped per destination: loads between the remote stores would be re-issued
// after each store (possible aliasing), one round trip per destination.
__device__ __forceinline__ u32 meta_for(const HtDispatchArgs& a, const MetaSource& m, u32 w, u32 r) {
  if (w >= META_SCALES && (w < META_WEIGHTS || w >= META_SRC)) return m.raw;
  const i64 first = (i64)r * a.num_local_experts;
  const i64 local = m.expert >= first && m.expert < first + (i64)a.num_local_experts ? m.expert - first : -1;
  if (w < META_SCALES) return (w & 1u) != 0u ? (u32)((u64)local >> 32) : (u32)(u64)local;
  return local >= 0 ? m.raw : 0u;
}

// One row's payload read by the warp in rounds of UNROLL 16-byte vectors per lane, all in flight before the
// round's stores: store(round, v) writes round `round`, whose vector u is element (round * UNROLL + u) *
// WARP_SIZE + lane (valid below PAYLOAD_VECS). READ_ONLY: src does not change during the kernel (x:
// ld.global.nc); otherwise (the slab, which peers write during the kernel) plain loads. Rounds before
// first_round were loaded by the caller.
template <bool READ_ONLY, typename Store>
__device__ __forceinline__ void load_payload(const u32x4* src, u32 lane, Store store, u32 first_round = 0) {
#pragma unroll 1
  for (u32 round = first_round; round < ROUNDS; round++) {
    u32x4 v[UNROLL];
#pragma unroll
    for (u32 u = 0; u < UNROLL; u++) {
      const u32 i = (round * UNROLL + u) * WARP_SIZE + lane;
      if (i < PAYLOAD_VECS) v[u] = READ_ONLY ? ptx::ld_nc_na_v4(src + i) : ptx::ld_na_v4(src + i);
    }
    store(round, v);
  }
}

// Stores one round of load_payload's vectors into the row at out.
__device__ __forceinline__ void store_payload_round(u32x4* out, u32 round, const u32x4 (&v)[UNROLL], u32 lane) {
#pragma unroll
  for (u32 u = 0; u < UNROLL; u++) {
    const u32 i = (round * UNROLL + u) * WARP_SIZE + lane;
    if (i < PAYLOAD_VECS) ptx::st_na_v4(out + i, v[u]);
  }
}

// Checks token t's destinations against its top-k experts (TOPK > 0): `goes_here` on lane r < R says whether
// the token goes to rank r (is_token_in_rank, through the prefix); lanes k, k + 32, ... load its k-th expert
// (the words load_meta reads again from L1 right after). A rank in one set and not in the other is reported
// (ERR_INVALID_LAYOUT, LAYOUT_ARG_IN_RANK, the token): a row sent where it selects no expert arrives with every
// top-k id -1, and an expert whose rank gets no row misses the token. The rows still travel as
// is_token_in_rank says; the call fails on this rank once the collective has run.
// With num_tokens_per_expert, each of the token's experts is also counted (tally; check_expert_tokens
// compares): every token passes here once, whatever its destinations.
__device__ __forceinline__ void check_token_ranks(const HtDispatchArgs& a, const Deadline& d, u32 t, bool goes_here, u32 lane) {
  if (TOPK == 0) return;
  u32 want = 0;
  const i64 num_experts = (i64)a.num_ranks * a.num_local_experts;
  const bool count = EXPERT_CHECK && a.num_tokens_per_expert != 0;
  for (u32 k = lane; k < TOPK; k += WARP_SIZE) {
    const i64 e = reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + k];
    if (e >= 0 && e < num_experts) {
      want |= 1u << (u32)(e / a.num_local_experts);
      if (count) tally(a, true, (u32)e);
    }
  }
  want = __reduce_or_sync(FULL_WARP_MASK, want);
  const u32 sent = __ballot_sync(FULL_WARP_MASK, goes_here);
  if (want != sent && lane == 0) report_error(d, ERR_INVALID_LAYOUT, a.rank, LAYOUT_ARG_IN_RANK, t);
}

// A token's first loads when its payload is one round of registers (FP8 at hidden 7168): the sources of its
// meta words and the payload. The sender stages a token before its stores are due, and the next batch's
// first token before the batch's fence, whose wait then hides their round trip. Rows of several rounds are
// not staged: their staged round and the next round's loads need twice the registers (the bf16 rows at
// hidden 7168 spill), and staging only their meta words made the fresh bf16 dispatch slower (2xH200, EP2:
// bench/results/2026-11-30-2xnvidia-h200-f38b5fa-stage-next).
constexpr bool STAGE = ROUNDS == 1;
struct StagedToken {
  MetaSource meta[META_ITERS];
  u32x4 v[UNROLL];
};

__device__ __forceinline__ void stage_token(const HtDispatchArgs& a, u32 t, u32 lane, StagedToken& s) {
  if constexpr (STAGE) {
#pragma unroll
    for (u32 k = 0; k < META_ITERS; k++)
      if (lane + k * WARP_SIZE < META_WORDS) s.meta[k] = load_meta(a, t, lane + k * WARP_SIZE);
    const u32x4* src = reinterpret_cast<const u32x4*>(a.x) + (u64)t * PAYLOAD_VECS;
#pragma unroll
    for (u32 u = 0; u < UNROLL; u++) {
      const u32 i = u * WARP_SIZE + lane;
      if (i < PAYLOAD_VECS) s.v[u] = ptx::ld_nc_na_v4(src + i);
    }
  }
}

// Sends token t, staged in `s` when STAGE (stage_token), to every remote destination r it goes to: lane r < R holds
// p0 = prefix[t][r] and p1 = prefix[t + 1][r] (the token goes to r when they differ, at send slot p0; lane
// `me` holds its own pair for check_token_ranks only). The payload is read once (ld.global.nc, UNROLL
// vectors per lane in flight) and stored into every such destination's slab row [me][p0]
// (st.global.L1::no_allocate over NVLink), then the meta words, remapped per destination.
__device__ __forceinline__ void send_token(const HtDispatchArgs& a, const Deadline& d, u32 t, i32 p0, i32 p1, bool peer_lane, u32 lane,
                                           const StagedToken& s) {
  check_token_ranks(a, d, t, lane < a.num_ranks && p1 > p0, lane);
  const bool in = peer_lane && p1 > p0;
  const u64 dst = in ? a.data[lane] + a.slab_offset + ((u64)a.rank * a.slab_rows + (u32)p0) * ROW_BYTES : 0;
  const u32 mask = __ballot_sync(FULL_WARP_MASK, in);
  if (mask == 0) return;
  u64 dst_of[MAX_RANKS];
#pragma unroll
  for (u32 r = 0; r < MAX_RANKS; r++) dst_of[r] = __shfl_sync(FULL_WARP_MASK, dst, r);
  // Unstaged, the meta words' sources are loaded before the payload, so that their latency hides behind it.
  MetaSource meta[META_ITERS];
#pragma unroll
  for (u32 k = 0; k < META_ITERS; k++)
    if (lane + k * WARP_SIZE < META_WORDS) meta[k] = STAGE ? s.meta[k] : load_meta(a, t, lane + k * WARP_SIZE);
  auto store_round = [&](u32 round, const u32x4 (&v)[UNROLL]) {
#pragma unroll
    for (u32 r = 0; r < MAX_RANKS; r++)
      if (((mask >> r) & 1u) != 0u && (HT_EXPERIMENT & HT_EXP_NO_REMOTE_PAYLOAD) == 0) store_payload_round(reinterpret_cast<u32x4*>(dst_of[r]), round, v, lane);
  };
  if constexpr (STAGE) store_round(0, s.v);
  load_payload<true>(reinterpret_cast<const u32x4*>(a.x) + (u64)t * PAYLOAD_VECS, lane, store_round, STAGE ? 1u : 0u);

  // The meta words, per destination the token goes to: a loop over the mask's bits issues each word's store
  // once per such destination, not once per possible rank with a predicate.
  for (u32 todo = mask; todo != 0u; todo &= todo - 1) {
    const u32 r = __ffs(todo) - 1;
    u8* out = reinterpret_cast<u8*>(__shfl_sync(FULL_WARP_MASK, dst, r)) + PAYLOAD_BYTES;
#pragma unroll
    for (u32 k = 0; k < META_ITERS; k++) {
      const u32 w = lane + k * WARP_SIZE;
      if (w < META_WORDS) ptx::st_na_u32(out + 4 * w, meta_for(a, meta[k], w, r));
    }
  }
}

// Sender warp `warp_id` of `num_warps` (a channel): chunks of send_chunk tokens — taken in order from the
// call's chunk counter (dynamic_send, ht_grab_chunk: the next one at the current one's last fence), or its
// interleaved share (HtCursor) — so that every warp sends near the same front of the token order; remote
// destinations only (this rank's own rows are the receivers' work: see copy_own_rows).
//   First waits (lane per peer) until every peer consumed the previous dispatch (its slab may be rewritten).
//   Lane r < R keeps prefix[t][r], prefix[t + 1][r] of the next token, loaded a token ahead (and the next
//   chunk's first pair during this chunk's last fence), so that no token waits for its prefix row; with send_head,
//   stores the token's slot there (-1 where it does not go to r); send_token, on the token stage_token loaded
//   (each token is staged right after the one before it is stored).
//   Release, once per RELEASE_BATCH tokens of a chunk, of row flag [me][slot] of remote destination r for each
//   slot the batch filled there (consecutive: the batch's tokens are), value the dispatch epoch: with
//   HT_RELEASER the batch is posted to the block's releaser warp (ht_post_batch); else the warp fences itself
//   (a fence waits until the warp's NVLink stores are acknowledged; one per token left each warp idle for a
//   round trip per row): __syncwarp, every lane executes fence.acq_rel.sys (one warp instruction; the next
//   batch's first token is staged before it), __syncwarp, then lane r < R st.relaxed.sys's the flags.
__device__ __forceinline__ void send_rows(const HtDispatchArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps,
                                          HtReleaseBox<SENDER_WARPS>& box, u32& posts) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank, num_ranks = a.num_ranks;
  const i32* prefix = reinterpret_cast<const i32*>(a.routing) + HT_RT_PREFIX;
  if (!ht_wait_consumed(a.ctrl[me], HT_CTRL_DISPATCH_CONSUMED, me, num_ranks, epoch, d)) return;
  const u32 trace_warp = 2 * (threadIdx.x / WARP_SIZE);
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_START + trace_warp);
  const bool peer_lane = lane < num_ranks && lane != me;
  i32* send_head = reinterpret_cast<i32*>(a.send_head);
  // Lane `me` loads its own pair too, for send_token's layout check (its rows are the receivers' work).
  auto load_prefix = [&](u32 t) -> i32 { return lane < num_ranks ? prefix[(u64)t * num_ranks + lane] : 0; };
  u32* counter = a.dynamic_send != 0 ? ht_ctrl_word(a.ctrl[me], HT_CTRL_DISPATCH_CHUNK) : nullptr;
  HtCursor chunk = counter != nullptr ? ht_chunk_at(ht_grab_chunk(counter), a.send_chunk, a.num_tokens)
                                      : ht_first_chunk(a.num_tokens, a.send_chunk, warp_id, num_warps, 0);
  i32 chunk_p0 = 0, chunk_p1 = 0;
  StagedToken staged;
  if (chunk.next < chunk.end) {
    chunk_p0 = load_prefix(chunk.next);
    chunk_p1 = load_prefix(chunk.next + 1);
    stage_token(a, chunk.next, lane, staged);
  }
  while (chunk.next < chunk.end) {
    HtCursor following = chunk;
    following.next = following.end;
    i32 following_p0 = 0, following_p1 = 0;
    i32 slot_next = chunk_p0, slot_after = chunk_p1;
    for (u32 batch_begin = chunk.next; batch_begin < chunk.end; batch_begin += RELEASE_BATCH) {
      if (__any_sync(FULL_WARP_MASK, error_raised(d))) return;
      const u32 batch_end = batch_begin + RELEASE_BATCH < chunk.end ? batch_begin + RELEASE_BATCH : chunk.end;
      const i32 batch_first_slot = slot_next;  // the batch's rows for r take slots [batch_first_slot, slot_next)
#pragma unroll 1
      for (u32 t = batch_begin; t < batch_end; t++) {
        const i32 p0 = slot_next, p1 = slot_after;
        slot_next = p1;
        if (t + 2 <= chunk.end) slot_after = load_prefix(t + 2);
        if (send_head != nullptr && lane < num_ranks) send_head[(u64)t * num_ranks + lane] = p1 > p0 ? p0 : -1;
        send_token(a, d, t, p0, p1, peer_lane, lane, staged);
        if (t + 1 < batch_end) stage_token(a, t + 1, lane, staged);
      }
      // After the chunk's last token the warp takes its next chunk and loads that chunk's first prefix pair,
      // before the fence, whose wait hides both round trips. Not at the chunk's start: a warp would then hold
      // two chunks when the counter runs out, and the sender warps end up to two chunks apart.
      if (batch_end == chunk.end) {
        if (counter != nullptr)
          following = ht_chunk_at(ht_grab_chunk(counter), a.send_chunk, a.num_tokens);
        else
          ht_next_chunk(following, a.num_tokens, a.send_chunk, num_warps);
        if (following.next < following.end) {
          following_p0 = load_prefix(following.next);
          following_p1 = load_prefix(following.next + 1);
        }
      }
      // The next batch's first token is staged before the fence, so that its loads' round trip overlaps the
      // fence's wait instead of following it.
      if (batch_end < chunk.end)
        stage_token(a, batch_end, lane, staged);
      else if (following.next < following.end)
        stage_token(a, following.next, lane, staged);
      if (HT_RELEASER) {
        if (!ht_post_batch(box, threadIdx.x / WARP_SIZE, posts, peer_lane ? batch_first_slot : 0, peer_lane ? slot_next : 0, d)) return;
        continue;
      }
      // Every lane fences its own row stores (a fence orders the fencing thread's writes; a single lane's
      // fence left other lanes' 16-byte stores in flight when the flag landed — seen as stale 16-byte
      // vectors by the soak on 4xH200), then lane r publishes the flags of the batch's rows for r.
      __syncwarp();
      ptx::fence_acq_rel_sys();
      __syncwarp();
      if (peer_lane) {
        u32* flags = reinterpret_cast<u32*>(a.data[lane] + a.flags_offset) + (u64)me * a.flag_slots;
        for (i32 slot = batch_first_slot; slot < slot_next; slot++) ptx::st_relaxed_sys(flags + (u32)slot, epoch);
      }
    }
    chunk = following;
    chunk_p0 = following_p0;
    chunk_p1 = following_p1;
  }
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_END + trace_warp);
}

// A sender block's warps (ht_send_block).
__device__ __forceinline__ void send(const HtDispatchArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
  ht_send_block<DISPATCH_WARPS, SENDER_WARPS, TRACE_WORDS, HT_RELEASER != 0>(
      a, a.num_ranks, epoch, d, warp_id, num_warps,
      [&](HtReleaseBox<SENDER_WARPS>& box, u32 w, u32 n, u32& posts) { send_rows(a, epoch, d, w, n, box, posts); });
}

// The last block: the senders' and receivers' counts checked (check_expert_counts; counted by
// check_token_ranks, store_meta and flush_tallies).
__device__ __forceinline__ void check_expert_tokens(const HtDispatchArgs& a, const Deadline& d) {
  if (TOPK == 0 || !EXPERT_CHECK) return;
  const u64 ctrl = a.ctrl[a.rank];
  ExpertCounts c{ht_ctrl_word(ctrl, HT_CTRL_EXPERT_TOKENS),
                 reinterpret_cast<const i32*>(a.num_tokens_per_expert),
                 ht_ctrl_word(ctrl, HT_CTRL_RECV_EXPERT_TOKENS),
                 a.host_notify != 0 ? ht_ctrl_word(ctrl, HT_CTRL_RECV_EXPECTED) : nullptr,
                 a.num_ranks * a.num_local_experts,
                 a.num_local_experts,
                 a.host_seq,
                 a.rank};
  check_expert_counts(c, d);
}

// One row's payload from src to out by the warp (load_payload, store_payload_round).
template <bool READ_ONLY>
__device__ __forceinline__ void copy_payload(const u32x4* src, u32x4* out, u32 lane) {
  load_payload<READ_ONLY>(src, lane, [&](u32 round, const u32x4 (&v)[UNROLL]) { store_payload_round(out, round, v, lane); });
}

// Receiver warp `warp_id` of `num_warps`, first: this rank's own rows, tokens [T * id / n, T * (id+1) / n):
// token t with prefix[t + 1][me] > prefix[t][me] is copied from x to recv_x[recv_offset[me] + prefix[t][me]]
// with its meta words (ids remapped to this rank's experts). Done here rather than by the senders: the
// senders bound the dispatch (measured: bench/results/2026-11-21-4xnvidia-h200-58851bb-roles), while the
// receivers wait for remote rows anyway. A row past num_out_rows (no-sync overflow, reported) is dropped.
__device__ __forceinline__ void copy_own_rows(const HtDispatchArgs& a, u32 warp_id, u32 num_warps) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank, num_ranks = a.num_ranks;
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  const i32* prefix = routing + HT_RT_PREFIX;
  const u32 recv_offset_me = (u32)routing[HT_RT_RECV_OFFSET + me];
  const u32 t_begin = ht_split(a.num_tokens, warp_id, num_warps), t_end = ht_split(a.num_tokens, warp_id + 1, num_warps);
  const u32x4* x = reinterpret_cast<const u32x4*>(a.x);
  u32x4* recv_x = reinterpret_cast<u32x4*>(a.recv_x);
  // Lane i looks at token t0 + i: one pass of prefix loads per 32 tokens, then the warp copies the hits.
  for (u32 t0 = t_begin; t0 < t_end; t0 += WARP_SIZE) {
    const u32 t_lane = t0 + lane;
    u32 pos = 0;
    bool hit = false;
    if (t_lane < t_end) {
      const i32 p0 = prefix[(u64)t_lane * num_ranks + me], p1 = prefix[(u64)(t_lane + 1) * num_ranks + me];
      pos = recv_offset_me + (u32)p0;
      hit = p1 > p0 && pos < a.num_out_rows;
    }
    for (u32 m = __ballot_sync(FULL_WARP_MASK, hit); m != 0u; m &= m - 1) {
      const u32 i = __ffs(m) - 1, t = t0 + i;
      const u64 row_pos = __shfl_sync(FULL_WARP_MASK, pos, i);
      // The meta words' sources are loaded with the payload, not after its stores: one round trip per row
      // fewer.
      MetaSource meta[META_ITERS];
#pragma unroll
      for (u32 k = 0; k < META_ITERS; k++)
        if (lane + k * WARP_SIZE < META_WORDS) meta[k] = load_meta(a, t, lane + k * WARP_SIZE);
      if ((HT_EXPERIMENT & HT_EXP_NO_OWN_PAYLOAD) == 0) copy_payload<true>(x + (u64)t * PAYLOAD_VECS, recv_x + row_pos * PAYLOAD_VECS, lane);
#pragma unroll
      for (u32 k = 0; k < META_ITERS; k++) {
        const u32 w = lane + k * WARP_SIZE;
        if (w < META_WORDS) store_meta(a, row_pos, w, meta_for(a, meta[k], w, me));
      }
    }
  }
}

// Copies slab row [s][j] of this rank to receive position `pos` (payload, meta words). The meta words are
// loaded (L2, ld.global.cg) before the payload, so that their round trip is the payload's.
__device__ __forceinline__ void copy_out_row(const HtDispatchArgs& a, u32 s, u32 j, u32 pos, u32 lane) {
  if (pos >= a.num_out_rows) return;  // no-sync overflow: reported once, rows dropped
  const u8* row = reinterpret_cast<const u8*>(a.data[a.rank] + a.slab_offset) + ((u64)s * a.slab_rows + j) * ROW_BYTES;
  const u32* meta = reinterpret_cast<const u32*>(row + PAYLOAD_BYTES);
  u32 words[META_ITERS];
#pragma unroll
  for (u32 k = 0; k < META_ITERS; k++)
    if (lane + k * WARP_SIZE < META_WORDS) words[k] = ptx::ld_cg_u32(meta + lane + k * WARP_SIZE);
  copy_payload<false>(reinterpret_cast<const u32x4*>(row), reinterpret_cast<u32x4*>(a.recv_x) + (u64)pos * PAYLOAD_VECS, lane);
#pragma unroll
  for (u32 k = 0; k < META_ITERS; k++) {
    const u32 w = lane + k * WARP_SIZE;
    if (w < META_WORDS) store_meta(a, pos, w, words[k]);
  }
}

// Receiver warp `warp_id` of `num_warps`: for every source s != me, its chunks of recv_chunk rows of s's
// sub-slab (HtCursor over [0, cnt_s), cnt_s = recv_count[s], rotated by s * n / R so that a warp's chunks of
// different sources fall due at different times; row j lands at recv_offset[s] + j). Lane s keeps source
// s's chunk. Sources are served in turn: lane i polls row flag [s][next + i] (relaxed, local memory); the
// leading run of rows whose flag reached the epoch is copied to the outputs, each row after every lane
// acquired its flag (ld.acquire.sys, one broadcast load: every lane reads part of the row). A pass without
// progress counts towards the deadline (measured from the last progress); on expiry the warp records
// {ERR_TIMEOUT, peer: the first source it still waits for}.
//   Before that: rows [N, num_out_rows) get top-k ids -1 and weights 0 (no-sync outputs); N > num_out_rows
//   is reported once (ERR_RECV_OVERFLOW, details N and num_out_rows); this rank's own rows (copy_own_rows).
__device__ __forceinline__ void receive(const HtDispatchArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank, num_ranks = a.num_ranks;
  if (EXPERT_CHECK && a.host_notify != 0 && warp_id == 0)
    copy_notify_expected(ht_ctrl_word(a.ctrl[me], HT_CTRL_RECV_EXPECTED), reinterpret_cast<const volatile u32*>(a.host_notify), HT_HN_READY,
                         HT_HN_PER_EXPERT, a.num_local_experts, lane);
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  const u32 num_recv = (u32)routing[HT_RT_NUM_RECV];
  if (TOPK > 0 && a.num_out_rows > num_recv) {
    const u64 total = (u64)a.num_out_rows * TOPK;
    for (u64 i = (u64)num_recv * TOPK + (u64)warp_id * WARP_SIZE + lane; i < total; i += (u64)num_warps * WARP_SIZE) {
      reinterpret_cast<i64*>(a.recv_topk_idx)[i] = -1;
      reinterpret_cast<u32*>(a.recv_topk_weights)[i] = 0u;
    }
  }
  if (warp_id == 0 && lane == 0 && num_recv > a.num_out_rows) report_error(d, ERR_RECV_OVERFLOW, NO_PEER, num_recv, a.num_out_rows);
  if ((HT_EXPERIMENT & HT_EXP_NO_COPY_OUT) == 0) copy_own_rows(a, warp_id, num_warps);
  const u32 trace_warp = 2 * (threadIdx.x / WARP_SIZE);
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_START + trace_warp);

  HtCursor chunk = {0, 0};
  u32 count = 0, offset = 0;
  if (lane < num_ranks && lane != me) {
    count = (u32)routing[HT_RT_RECV_COUNT + lane];
    chunk = ht_first_chunk(count, a.recv_chunk, warp_id, num_warps, lane * num_warps / num_ranks);
    offset = (u32)routing[HT_RT_RECV_OFFSET + lane];
  }
  const u32* flags = reinterpret_cast<const u32*>(a.data[me] + a.flags_offset);
  u32 pending = __ballot_sync(FULL_WARP_MASK, chunk.next < chunk.end);
  u64 idle_since = 0;
  u32 idle_spins = 0;
  while (pending != 0u) {
    bool progressed = false;
    for (u32 todo = pending; todo != 0u; todo &= todo - 1) {
      const u32 s = __ffs(todo) - 1;
      const u32 j = __shfl_sync(FULL_WARP_MASK, chunk.next, s), stop = __shfl_sync(FULL_WARP_MASK, chunk.end, s);
      const u32 n = stop - j < WARP_SIZE ? stop - j : WARP_SIZE;
      // One row due (recv_chunk 1): every lane polls its flag with the acquire the copy needs, one round
      // trip per row fewer; several: lane i polls row i, relaxed, and each row is acquired before its copy.
      const bool one_row = n == 1;
      const u32* flag = flags + (u64)s * a.flag_slots + j + (one_row ? 0u : lane);
      const bool arrived = one_row ? (i32)(ptx::ld_acquire_sys(flag) - epoch) >= 0 : lane < n && (i32)(ptx::ld_relaxed_sys(flag) - epoch) >= 0;
      const u32 arrived_mask = __ballot_sync(FULL_WARP_MASK, arrived);
      // One row: ready only when every lane's own acquire saw the flag.
      const u32 ready = one_row ? (arrived_mask == FULL_WARP_MASK ? 1u : 0u)
                                : arrived_mask == FULL_WARP_MASK ? WARP_SIZE : (u32)__ffs(~arrived_mask) - 1;
      if (ready == 0) continue;
      const u32 base = __shfl_sync(FULL_WARP_MASK, offset, s);
      for (u32 i = 0; i < ready; i++) {
        // Every lane reads part of the row: every lane acquires its flag (one broadcast load).
        if (!one_row) (void)ptx::ld_acquire_sys(flags + (u64)s * a.flag_slots + j + i);
        if ((HT_EXPERIMENT & HT_EXP_NO_COPY_OUT) == 0) copy_out_row(a, s, j + i, base + j + i, lane);
      }
      if (lane == s) {
        chunk.next += ready;
        ht_next_chunk(chunk, count, a.recv_chunk, num_warps);
      }
      progressed = true;
    }
    pending = __ballot_sync(FULL_WARP_MASK, chunk.next < chunk.end);
    if (progressed) {
      idle_spins = 0;
      continue;
    }
    if (idle_spins++ == 0) idle_since = ptx::globaltimer();
    if (idle_spins % DEADLINE_POLL_SPINS == 0) {
      const u64 waited = __shfl_sync(FULL_WARP_MASK, ptx::globaltimer() - idle_since, 0);
      if (waited > d.timeout_ns) {
        if (lane == 0) raise_error(d, ERR_TIMEOUT, (u32)__ffs(pending) - 1, waited);
        break;
      }
      if (__any_sync(FULL_WARP_MASK, error_raised(d))) break;
    }
  }
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_END + trace_warp);
}

// DeepEP's channel matrices of the handle (block 0, when wanted): this rank sends each destination's rows as
// one ordered stream, which DeepEP's terms call the last of num_channels channels, the others empty. The
// send counts are ht_notify's (routing, HT_RT_SEND_COUNT), written before this kernel in stream order.
__device__ __forceinline__ void write_channel_prefixes(const HtDispatchArgs& a) {
  if (blockIdx.x != 0 || a.channel_prefix == 0 || a.num_channels == 0) return;
  const i32* send_count = reinterpret_cast<const i32*>(a.routing) + HT_RT_SEND_COUNT;
  i32* channel_prefix = reinterpret_cast<i32*>(a.channel_prefix);
  i32* recv_channel_prefix = reinterpret_cast<i32*>(a.recv_channel_prefix);
  for (u32 i = threadIdx.x; i < a.num_ranks * a.num_channels; i += blockDim.x) {
    channel_prefix[i] = i % a.num_channels == a.num_channels - 1 ? send_count[i / a.num_channels] : 0;
    recv_channel_prefix[i] = 0;
  }
}

// Rows a copy-engine receiver warp takes from the call's counter at a time.
constexpr u32 CE_RECV_CHUNK = 4;
constexpr u32 CE_SCALE_ITERS = FP8 ? (NUM_SCALES + WARP_SIZE - 1) / WARP_SIZE : 1;  // FP8 scales per lane
static_assert(!HT_CE || TOPK == 0, "the copy-engine receive serves cached dispatches (no top-k)");

// HT_CE: every warp of the grid receives (num_send_blocks 0; two ranks). Items are this rank's rows, then the
// peer's, each in receive order (for the peer: its token order, the order its pieces land); warps take
// CE_RECV_CHUNK items at a time from the call's counter (HT_CTRL_DISPATCH_CHUNK, which no sender uses here).
// Row pos comes from token t = ce_src_idx[pos]: own rows from x and x_scales, the peer's from its staging
// once the flag of piece t / ce_piece_tokens holds the epoch (lane 0 waits with the deadline, then every lane
// acquires it: every lane reads part of the row). Pieces land in order, so a warp acquires each piece once.
__device__ __forceinline__ void receive_ce(const HtDispatchArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank, peer = 1u - me;
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  const u32 own_first = (u32)routing[HT_RT_RECV_OFFSET + me], own_count = (u32)routing[HT_RT_RECV_COUNT + me];
  const u32 peer_first = (u32)routing[HT_RT_RECV_OFFSET + peer], peer_count = (u32)routing[HT_RT_RECV_COUNT + peer];
  const u32 total = own_count + peer_count;
  const u8* staging = reinterpret_cast<const u8*>(a.data[me] + a.slab_offset) + (u64)peer * a.slab_rows * ROW_BYTES;
  const u32* piece_flags = reinterpret_cast<const u32*>(a.data[me] + a.flags_offset) + (u64)peer * a.flag_slots;
  const i32* src_idx = reinterpret_cast<const i32*>(a.ce_src_idx);
  u32* counter = ht_ctrl_word(a.ctrl[me], HT_CTRL_DISPATCH_CHUNK);
  // DeepEP's send_head, which the SM senders write as they go: no sender here.
  if (a.send_head != 0) {
    const i32* prefix = routing + HT_RT_PREFIX;
    for (u32 t = warp_id * WARP_SIZE + lane; t < a.num_tokens; t += num_warps * WARP_SIZE)
      for (u32 r = 0; r < a.num_ranks; r++) {
        const i32 p0 = prefix[(u64)t * a.num_ranks + r], p1 = prefix[(u64)(t + 1) * a.num_ranks + r];
        reinterpret_cast<i32*>(a.send_head)[(u64)t * a.num_ranks + r] = p1 > p0 ? p0 : -1;
      }
  }
  u32 pieces_ready = 0;
  i64 peer_stride_token = 0, peer_stride_group = 0;
  while (true) {
    const HtCursor c = ht_chunk_at(ht_grab_chunk(counter), CE_RECV_CHUNK, total);
    if (c.next == c.end) return;
    for (u32 k = c.next; k < c.end; k++) {
      const bool own = k < own_count;
      const u32 pos = own ? own_first + k : peer_first + (k - own_count);
      if (pos >= a.num_out_rows) continue;
      const u32 t = (u32)src_idx[pos];
      if (a.recv_src_idx != 0 && lane == 0) reinterpret_cast<i32*>(a.recv_src_idx)[pos] = (i32)t;
      const u32x4* src;
      const u32* scales;
      i64 stride_token, stride_group;
      if (own) {
        src = reinterpret_cast<const u32x4*>(a.x) + (u64)t * PAYLOAD_VECS;
        scales = reinterpret_cast<const u32*>(a.x_scales);
        stride_token = a.scale_stride_token;
        stride_group = a.scale_stride_group;
      } else {
        const u32 piece = t / a.ce_piece_tokens;
        if (piece >= pieces_ready) {
          bool ok = true;
          if (lane == 0) ok = wait_flag_geq(piece_flags + piece, epoch, d, peer);
          if (!__shfl_sync(FULL_WARP_MASK, ok, 0)) return;
          (void)ptx::ld_acquire_sys(piece_flags + piece);
          pieces_ready = piece + 1;
          const i64* header = reinterpret_cast<const i64*>(staging);
          peer_stride_token = header[0];
          peer_stride_group = header[1];
        }
        src = reinterpret_cast<const u32x4*>(staging + HT_CE_HEADER_BYTES + (u64)t * PAYLOAD_BYTES);
        scales = reinterpret_cast<const u32*>(staging + a.ce_scales_offset);
        stride_token = peer_stride_token;
        stride_group = peer_stride_group;
      }
      // The scales are loaded with the payload, so that their round trip is the payload's.
      u32 scale[CE_SCALE_ITERS];
#pragma unroll
      for (u32 i = 0; i < CE_SCALE_ITERS; i++) {
        const u32 g = lane + i * WARP_SIZE;
        if (FP8 && g < NUM_SCALES) scale[i] = scales[(i64)t * stride_token + (i64)g * stride_group];
      }
      if (own)
        copy_payload<true>(src, reinterpret_cast<u32x4*>(a.recv_x) + (u64)pos * PAYLOAD_VECS, lane);
      else
        copy_payload<false>(src, reinterpret_cast<u32x4*>(a.recv_x) + (u64)pos * PAYLOAD_VECS, lane);
#pragma unroll
      for (u32 i = 0; i < CE_SCALE_ITERS; i++) {
        const u32 g = lane + i * WARP_SIZE;
        if (FP8 && g < NUM_SCALES) reinterpret_cast<u32*>(a.recv_scales)[(u64)pos * NUM_SCALES + g] = scale[i];
      }
    }
  }
}

namespace moelink::intranode {
// moelink::intranode::dispatch: grid num_sms blocks (persistent, one per SM), block THREADS.
//   Blocks [0, num_send_blocks) are senders, the others receivers; every warp is one channel (see send and
//   receive above). The frame (ht.cuh, ht_run_op): nothing moves when the handle's routing status is
//   non-zero or T_max exceeds slab_rows for this row size (a cached dispatch of bigger rows), and the epoch
//   then does not advance, on any rank; the epoch is read at start (counter + 1) and stored by the last block.
//   Flags: row flags (data region, [src][slot], value = dispatch epoch) from senders to receivers; at the end
//   the last block hands the slab back: consumed[me] = epoch in every peer's control region, which the
//   peers' senders of the next dispatch wait for.
//   reads: x, scales, top-k, routing, own slab and row flags;
//   reports: a token whose is_token_in_rank row disagrees with the ranks of its top-k experts (check_token_ranks),
//   an expert whose num_tokens_per_expert is not the tokens selecting it (check_expert_tokens, the last block);
//   writes: peers' slabs and row flags (senders), the outputs and recv_src_idx (receivers: own rows from x,
//   remote rows from the slab), consumed flags; when wanted, DeepEP's send_head (senders) and channel
//   matrices (block 0, write_channel_prefixes).
__global__ void __launch_bounds__(THREADS, 1) dispatch(const __grid_constant__ HtDispatchArgs a) {
  write_channel_prefixes(a);
  zero_tallies(a);
  ht_run_op<DISPATCH_WARPS, TRACE_WORDS>(
      a, PHASE_DISPATCH, a.num_ranks, ROW_BYTES, HT_DISPATCH_WORDS,
      [&](u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) { send(a, epoch, d, warp_id, num_warps); },
      [&](u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
        if (HT_CE)
          receive_ce(a, epoch, d, warp_id, num_warps);
        else
          receive(a, epoch, d, warp_id, num_warps);
      },
      [&]() {
        flush_tallies(a);
        if (HT_CE) ht_ce_block_end(a.ctrl[a.rank], HT_DISPATCH_WORDS, make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_DISPATCH), a.rank);
      },
      [&](const Deadline& d) { check_expert_tokens(a, d); });
}
}  // namespace moelink::intranode
