// moelink kernel family: high-throughput intranode combine (reverse direct writes, fp32 reduction by a pairwise
// tree over the ranks, the order moelink::reduce defines for every topology).
//
// JIT constants (from moelink_kernels::ht::HtCombineVariant):
//   MAX_RANKS                         ranks the argument struct has room for
//   NUM_RANKS                         ranks of this buffer (the reduction unrolls over them)
//   HIDDEN                            bf16 channels per token
//   TOPK                              top-k weights per row to sum (0: none)
//   COMBINE_WARPS                     warps per block (every block sends or reduces, never both)
//   MAX_UNROLL                        16-byte vectors a sender lane keeps in flight per copy round
//   RELEASE_BATCH                     rows per source a sender warp writes before one release publishes them
//   HT_RELEASER                       1: the last warp of each sender block releases the others' rows (ht.cuh)
//   HT_EXPERIMENT                     0; timing experiments only (wrong results): HT_EXP_* bits (ht.cuh)
//   HT_CE                             1: every block reduces, the peer's rows from its copy engines' staging (two ranks)
//   REDUCE_LOAD_VECS                  16-byte vectors a reducer lane keeps in flight (over ranks and biases)
//   NUM_BIASES                        biases the call adds (0, 1 or 2): bias0, bias1 are non-null exactly then
//   ROW_BYTES                         slab row size as Rust computes it (moelink_kernels::ht::combine_row_bytes)
//   MOELINK_SIZEOF_HT_COMBINE_ARGS    sizeof(moelink_kernels::ht::HtCombineArgs)
#include "ht.cuh"

#if !defined(NUM_RANKS) || !defined(HIDDEN) || !defined(TOPK) || !defined(COMBINE_WARPS) || !defined(MAX_UNROLL) || \
    !defined(RELEASE_BATCH) || !defined(HT_RELEASER) || !defined(HT_EXPERIMENT) || !defined(REDUCE_LOAD_VECS) || !defined(NUM_BIASES) || !defined(ROW_BYTES) || !defined(HT_CE) || !defined(MOELINK_SIZEOF_HT_COMBINE_ARGS)
#error "ht_combine.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(NUM_RANKS >= 1 && NUM_RANKS <= MAX_RANKS, "ranks");
static_assert(!HT_CE || NUM_RANKS == 2, "the copy-engine combine serves two ranks");

constexpr u32 VEC_BYTES = 16;
constexpr u32 BF16_PER_VEC = VEC_BYTES / 2;
static_assert(NUM_BIASES <= 2, "at most two biases");
constexpr u32 PAYLOAD_BYTES = HIDDEN * 2;
constexpr u32 PAYLOAD_VECS = PAYLOAD_BYTES / VEC_BYTES;
// A slab row: the bf16 payload, then TOPK f32 weights, padded to 16 bytes, and the row to HT_ROW_ALIGN.
constexpr u32 WEIGHT_BYTES = (TOPK * 4 + VEC_BYTES - 1) / VEC_BYTES * VEC_BYTES;
static_assert(PAYLOAD_BYTES % VEC_BYTES == 0 && PAYLOAD_VECS >= 1, "rows are whole 16-byte vectors");
static_assert(ROW_BYTES == (PAYLOAD_BYTES + WEIGHT_BYTES + HT_ROW_ALIGN - 1) / HT_ROW_ALIGN * HT_ROW_ALIGN,
              "slab row differs from moelink_kernels::ht::combine_row_bytes");
constexpr u32 THREADS = COMBINE_WARPS * WARP_SIZE;
constexpr u32 SENDER_WARPS = HT_SENDER_WARPS<COMBINE_WARPS, HT_RELEASER != 0>;  // per sender block
constexpr u32 VECS_PER_LANE = (PAYLOAD_VECS + WARP_SIZE - 1) / WARP_SIZE;
// Sender: one step sends a row to every pending source (the NUM_SOURCES other ranks), in ROUNDS rounds; a
// round loads UNROLL vectors per lane of every source's row before storing any (all sources' loads in flight
// together: loading and storing one row after the other paid a load latency per row), at most MAX_UNROLL +
// MAX_UNROLL / 2 in all.
constexpr u32 NUM_SOURCES = NUM_RANKS > 1 ? NUM_RANKS - 1 : 1;
constexpr u32 SEND_LOAD_VECS = MAX_UNROLL + MAX_UNROLL / 2;
constexpr u32 SEND_MAX_UNROLL = SEND_LOAD_VECS / NUM_SOURCES > 0 ? SEND_LOAD_VECS / NUM_SOURCES : 1;
constexpr u32 ROUNDS = (VECS_PER_LANE + SEND_MAX_UNROLL - 1) / SEND_MAX_UNROLL;
constexpr u32 UNROLL = (VECS_PER_LANE + ROUNDS - 1) / ROUNDS;
// Reducer: RED_UNROLL vectors of every rank's row (and of each bias) per round.
constexpr u32 RED_MAX_UNROLL = REDUCE_LOAD_VECS / (NUM_RANKS + NUM_BIASES) > 0 ? REDUCE_LOAD_VECS / (NUM_RANKS + NUM_BIASES) : 1;
constexpr u32 RED_ROUNDS = (VECS_PER_LANE + RED_MAX_UNROLL - 1) / RED_MAX_UNROLL;
constexpr u32 RED_UNROLL = (VECS_PER_LANE + RED_ROUNDS - 1) / RED_ROUNDS;
static_assert(ROUNDS * UNROLL * WARP_SIZE >= PAYLOAD_VECS && RED_ROUNDS * RED_UNROLL * WARP_SIZE >= PAYLOAD_VECS, "rounds cover a row");

// Kernel argument (by value). Must match moelink_kernels::ht::HtCombineArgs byte for byte.
struct HtCombineArgs {
  u64 x;                      // bf16 [num_x_rows, HIDDEN]: one row per received token, 16-byte aligned
  u64 topk_weights;           // f32 [num_x_rows, TOPK] (TOPK > 0)
  u64 bias0;                  // bf16 [T, HIDDEN] or 0
  u64 bias1;                  // bf16 [T, HIDDEN] or 0 (only with bias0)
  u64 combined_x;             // bf16 [T, HIDDEN]
  u64 combined_topk_weights;  // f32 [T, TOPK] (TOPK > 0)
  u64 routing;                // the dispatch handle's buffer (HT_RT_* words, prefix)
  u64 ctrl[MAX_RANKS];        // every rank's HT control region, as addressable from this rank
  u64 data[MAX_RANKS];        // every rank's HT data region
  u64 flags_offset;           // combine row flags inside a data region
  u64 slab_offset;            // combine slab inside a data region
  u64 error_claim;            // ErrorSink::claim
  u64 error_record;           // ErrorSink::record
  u64 timeout_ns;             // per wait
  u32 rank;
  u32 num_tokens;             // T of this rank (the handle's)
  u32 num_x_rows;             // rows of x (N, or num_worst_tokens in no-sync mode)
  u32 slab_rows;              // slab rows per source for ROW_BYTES
  u32 flag_slots;             // row flags per source (>= slab_rows)
  u32 num_send_blocks;        // blocks [0, num_send_blocks) send, the others reduce
  u32 send_chunk;             // rows per sender chunk, per source (HtCursor; 0: one contiguous part per warp)
  u32 recv_chunk;             // tokens per reducer chunk (0: one contiguous part per warp)
  u32 dynamic_send;           // 1: sender warps take chunks from HT_CTRL_COMBINE_CHUNK (needs send_chunk > 0)
  u32 ce_piece_rows;          // HT_CE: rows per piece of the peer's staging
  u64 trace;                  // host-mapped timing trace (ht.cuh, HT_TRACE_*), or 0
  u32 ce_weights_offset;      // HT_CE: byte offset of the top-k weights in the staging
  u32 reserved;
};
constexpr u32 TRACE_WORDS = 2 + 2 * COMBINE_WARPS;  // per block
static_assert(sizeof(HtCombineArgs) == MOELINK_SIZEOF_HT_COMBINE_ARGS, "HtCombineArgs differs from the Rust definition");

__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[BF16_PER_VEC], const u32x4& v) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (u32 m = 0; m < 4; m++) {
    acc[2 * m] = ptx::add_rn_f32(acc[2 * m], ptx::f32_from_bits(w[m] << 16));
    acc[2 * m + 1] = ptx::add_rn_f32(acc[2 * m + 1], ptx::f32_from_bits(w[m] & 0xffff0000u));
  }
}

// The combine's sum over ranks (moelink::reduce): a pairwise tree over the ranks padded with +0.0 to a
// power of two, tree(x_0..x_{2m-1}) = tree(x_0..x_{m-1}) + tree(x_m..x_{2m-1}). Intranode is one node, so
// this is the whole tree; with power-of-two ranks it is also the tree of any split into nodes, which is
// what keeps intranode and internode results the same bits.
constexpr u32 RANKS_POW2 = NUM_RANKS <= 1 ? 1u : NUM_RANKS <= 2 ? 2u : NUM_RANKS <= 4 ? 4u : NUM_RANKS <= 8 ? 8u : NUM_RANKS <= 16 ? 16u : 32u;
static_assert(RANKS_POW2 >= NUM_RANKS && RANKS_POW2 < 2 * NUM_RANKS, "RANKS_POW2 is the next power of two");
// tree over ranks [LO, LO + N) of the padded list (N a power of two, LO < NUM_RANKS). A half made only of
// padding is left out instead of added as +0.0: x + (+0.0) is x except for x = -0.0 (or a NaN's payload,
// which the GPU's add canonicalises anyway), and a zero's sign inside the tree changes at most the sign of
// a zero total, which the leading +0.0 of the caller normalises — the same bits as the host's literal tree.
template <u32 LO, u32 N>
__device__ __forceinline__ float tree_sum(const float (&x)[NUM_RANKS]) {
  if constexpr (N == 1) {
    return x[LO];
  } else if constexpr (LO + N / 2 >= NUM_RANKS) {
    return tree_sum<LO, N / 2>(x);
  } else {
    return ptx::add_rn_f32(tree_sum<LO, N / 2>(x), tree_sum<LO + N / 2, N / 2>(x));
  }
}

// acc[c] = +0.0 + tree over ranks of channel c of v[r] (8 bf16 channels; an absent rank's v is zeros, +0.0).
// One channel's tree at a time: its leaves are unpacked from the words already in registers.
__device__ __forceinline__ void tree_sum_bf16x8(float (&acc)[BF16_PER_VEC], const u32x4 (&v)[NUM_RANKS]) {
#pragma unroll
  for (u32 m = 0; m < 4; m++) {
    float lo[NUM_RANKS], hi[NUM_RANKS];
#pragma unroll
    for (u32 r = 0; r < NUM_RANKS; r++) {
      const u32 w = m == 0 ? v[r].x : m == 1 ? v[r].y : m == 2 ? v[r].z : v[r].w;
      lo[r] = ptx::f32_from_bits(w << 16);
      hi[r] = ptx::f32_from_bits(w & 0xffff0000u);
    }
    acc[2 * m] = ptx::add_rn_f32(0.0f, tree_sum<0, RANKS_POW2>(lo));
    acc[2 * m + 1] = ptx::add_rn_f32(0.0f, tree_sum<0, RANKS_POW2>(hi));
  }
}

// Sender warp `warp_id` of `num_warps` (expert side): for every source s != me, chunks of send_chunk
// received rows of s — chunk q = rows [q * send_chunk, ...) of every source, q taken in order from the
// call's chunk counter (dynamic_send, ht_grab_chunk), or the warp's interleaved share (HtCursor over
// [0, cnt_s)); cnt_s = recv_count[s]; row j is x[recv_offset[s] + j] — go
// back to s's combine slab row [me][j] with their top-k weights. First waits until every peer consumed the
// previous combine. Each step sends the next row of every source whose chunk is not done (lane s holds s's
// cursor); after RELEASE_BATCH steps or at the end of the chunks the batch is released — row flag [me][j]
// of s = the combine epoch for each row j of the batch: with HT_RELEASER posted to the block's releaser
// warp (ht_post_batch), else __syncwarp, fence.acq_rel.sys by every lane, __syncwarp, and lane s
// st.relaxed.sys's the flags (one fence per batch, not per row: a fence waits for the warp's NVLink stores
// to be acknowledged); then sources whose chunk is done move to their next one. A row past num_x_rows (no-sync
// overflow) goes back as zeros.
__device__ __forceinline__ void send_rows(const HtCombineArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps,
                                          HtReleaseBox<SENDER_WARPS>& box, u32& posts) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank;
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  if (!ht_wait_consumed(a.ctrl[me], HT_CTRL_COMBINE_CONSUMED, me, NUM_RANKS, epoch, d)) return;
  const u32 trace_warp = 2 * (threadIdx.x / WARP_SIZE);
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_START + trace_warp);
  const bool peer_lane = lane < NUM_RANKS && lane != me;
  // Dynamic chunks: chunk q is rows [q * send_chunk, ...) of every source; the warp goes on while some source
  // has rows there (chunk indices only grow, so later ones are empty too). The next index is taken before
  // the chunk's last fence, whose wait hides the atomic's round trip; not at the chunk's start, where a warp
  // would hold two chunks when the counter runs out, and the sender warps would end up to two chunks apart.
  u32* counter = a.dynamic_send != 0 ? ht_ctrl_word(a.ctrl[me], HT_CTRL_COMBINE_CHUNK) : nullptr;
  u32 q = counter != nullptr ? ht_grab_chunk(counter) : 0u;
  HtCursor chunk = {0, 0};
  u32 count = 0, offset = 0;
  if (peer_lane) {
    count = (u32)routing[HT_RT_RECV_COUNT + lane];
    chunk = counter != nullptr ? ht_chunk_at(q, a.send_chunk, count) : ht_first_chunk(count, a.send_chunk, warp_id, num_warps, 0);
    offset = (u32)routing[HT_RT_RECV_OFFSET + lane];
  }
  auto more = [&]() -> bool {
    return counter != nullptr ? __any_sync(FULL_WARP_MASK, peer_lane && (u64)q * a.send_chunk < count)
                              : __any_sync(FULL_WARP_MASK, chunk.next < chunk.end);
  };
  const u32* weights = reinterpret_cast<const u32*>(a.topk_weights);
  while (more()) {
    if (__any_sync(FULL_WARP_MASK, error_raised(d))) break;
    const u32 batch_first = chunk.next;  // lane s: the first row of this batch for source s
#pragma unroll 1
    for (u32 step = 0; step < RELEASE_BATCH; step++) {
      const u32 next = chunk.next;
      const bool active = next < chunk.end;
      const u32 mask = __ballot_sync(FULL_WARP_MASK, active);
      if (mask == 0u) break;
      const u32 pos = offset + next;
      u64 dst = 0;
      bool have_row = false;
      if (active) {
        dst = a.data[lane] + a.slab_offset + ((u64)me * a.slab_rows + next) * ROW_BYTES;
        have_row = pos < a.num_x_rows;
        if (!have_row) report_error(d, ERR_RECV_OVERFLOW, NO_PEER, (u32)routing[HT_RT_NUM_RECV], a.num_x_rows);
      }
      // Source k is rank (me + 1 + k) % NUM_RANKS: the registers are sized for the other ranks only.
      u32 row_pos[NUM_SOURCES];
      bool sending[NUM_SOURCES], row_valid[NUM_SOURCES];
      u8* out[NUM_SOURCES];
#pragma unroll
      for (u32 k = 0; k < NUM_SOURCES; k++) {
        const u32 r = (me + 1 + k) % NUM_RANKS;
        sending[k] = NUM_RANKS > 1 && ((mask >> r) & 1u) != 0u;
        row_pos[k] = __shfl_sync(FULL_WARP_MASK, pos, r);
        row_valid[k] = __shfl_sync(FULL_WARP_MASK, have_row, r);
        out[k] = reinterpret_cast<u8*>(__shfl_sync(FULL_WARP_MASK, dst, r));
      }
      // The rows' top-k weights are loaded before the payload, so that their latency hides behind it: a load
      // after the remote stores would wait for them (possible aliasing), a round trip per row.
      u32 weight_bits[NUM_SOURCES];
#pragma unroll
      for (u32 k = 0; k < NUM_SOURCES; k++) {
        weight_bits[k] = 0u;
        if (TOPK > 0 && lane < TOPK && sending[k] && row_valid[k]) weight_bits[k] = weights[(u64)row_pos[k] * TOPK + lane];
      }
      const u32x4* x = reinterpret_cast<const u32x4*>(a.x);
#pragma unroll 1
      for (u32 round = 0; round < ROUNDS; round++) {
        u32x4 v[NUM_SOURCES][UNROLL];
#pragma unroll
        for (u32 k = 0; k < NUM_SOURCES; k++) {
          if (!sending[k]) continue;
#pragma unroll
          for (u32 u = 0; u < UNROLL; u++) {
            const u32 i = (round * UNROLL + u) * WARP_SIZE + lane;
            v[k][u] = u32x4{0u, 0u, 0u, 0u};
            if (i < PAYLOAD_VECS && row_valid[k]) v[k][u] = ptx::ld_nc_na_v4(x + (u64)row_pos[k] * PAYLOAD_VECS + i);
          }
        }
#pragma unroll
        for (u32 k = 0; k < NUM_SOURCES; k++) {
          if (!sending[k] || (HT_EXPERIMENT & HT_EXP_NO_REMOTE_PAYLOAD) != 0) continue;
#pragma unroll
          for (u32 u = 0; u < UNROLL; u++) {
            const u32 i = (round * UNROLL + u) * WARP_SIZE + lane;
            if (i < PAYLOAD_VECS) ptx::st_na_v4(reinterpret_cast<u32x4*>(out[k]) + i, v[k][u]);
          }
        }
      }
      if (TOPK > 0 && lane < TOPK) {
#pragma unroll
        for (u32 k = 0; k < NUM_SOURCES; k++)
          if (sending[k]) reinterpret_cast<u32*>(out[k] + PAYLOAD_BYTES)[lane] = weight_bits[k];
      }
      if (active) chunk.next++;
    }
    const bool chunk_done = !__any_sync(FULL_WARP_MASK, chunk.next < chunk.end);
    const u32 q_next = counter != nullptr && chunk_done ? ht_grab_chunk(counter) : 0u;
    if (HT_RELEASER) {
      if (!ht_post_batch(box, threadIdx.x / WARP_SIZE, posts, peer_lane ? (i32)batch_first : 0, peer_lane ? (i32)chunk.next : 0, d)) break;
    } else {
      // Every lane fences its own row stores before the flag lanes publish (see ht_dispatch.cu).
      __syncwarp();
      ptx::fence_acq_rel_sys();
      __syncwarp();
      if (lane < NUM_RANKS && lane != me) {
        u32* flags = reinterpret_cast<u32*>(a.data[lane] + a.flags_offset) + (u64)me * a.flag_slots;
        for (u32 row = batch_first; row < chunk.next; row++) ptx::st_relaxed_sys(flags + row, epoch);
      }
    }
    if (counter == nullptr) {
      ht_next_chunk(chunk, count, a.send_chunk, num_warps);
    } else if (chunk_done) {
      q = q_next;
      if (peer_lane) chunk = ht_chunk_at(q, a.send_chunk, count);
    }
  }
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_END + trace_warp);
}

// A sender block's warps (ht_send_block).
__device__ __forceinline__ void send(const HtCombineArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
  ht_send_block<COMBINE_WARPS, SENDER_WARPS, TRACE_WORDS, HT_RELEASER != 0>(
      a, NUM_RANKS, epoch, d, warp_id, num_warps,
      [&](HtReleaseBox<SENDER_WARPS>& box, u32 w, u32 n, u32& posts) { send_rows(a, epoch, d, w, n, box, posts); });
}

// Reducer warp `warp_id` of `num_warps` (source side): its chunks of recv_chunk tokens of this rank
// (HtCursor over [0, T)). Per token: lane r < R holds prefix[t][r], prefix[t + 1][r]; for every remote rank r
// the token went to, every lane waits (deadline) until row flag [r][slot] reached the combine epoch, polling
// it with ld.acquire. The output is, per channel, ((+0.0 + T) + bias0) + bias1, T the pairwise tree over the ranks
// (tree_sum: a rank the token did not go to is +0.0; this rank's row read straight from x at
// recv_offset[me] + slot), each add an IEEE f32 add.rn, rounded to bf16 by cvt.rn.bf16x2.f32 — the host
// backend's order bit for bit. Weights: +0.0 + the same tree over the rows' top-k weights.
__device__ __forceinline__ void reduce(const HtCombineArgs& a, u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) {
  const u32 lane = threadIdx.x % WARP_SIZE, me = a.rank;
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  const i32* prefix = routing + HT_RT_PREFIX;
  const u32 recv_offset_me = (u32)routing[HT_RT_RECV_OFFSET + me];
  const u32* flags = reinterpret_cast<const u32*>(a.data[me] + a.flags_offset);
  const u64 slab = a.data[me] + a.slab_offset;
  const u32x4* bias0 = reinterpret_cast<const u32x4*>(a.bias0);
  const u32x4* bias1 = reinterpret_cast<const u32x4*>(a.bias1);
  u32x4* combined = reinterpret_cast<u32x4*>(a.combined_x);
  const u32 trace_warp = 2 * (threadIdx.x / WARP_SIZE);
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_START + trace_warp);
  HtCursor chunk = ht_first_chunk(a.num_tokens, a.recv_chunk, warp_id, num_warps, 0);
  // Lane r < R keeps prefix[t][r], prefix[t + 1][r] of the next token, loaded a token ahead: no token waits
  // for its prefix row.
  auto load_prefix = [&](u32 t) -> i32 { return lane < NUM_RANKS ? prefix[(u64)t * NUM_RANKS + lane] : 0; };
  i32 next_p0 = 0, next_p1 = 0;
  if (chunk.next < chunk.end) {
    next_p0 = load_prefix(chunk.next);
    next_p1 = load_prefix(chunk.next + 1);
  }
  for (u32 t = chunk.next; t < chunk.end; t = chunk.next) {
    chunk.next = t + 1;
    ht_next_chunk(chunk, a.num_tokens, a.recv_chunk, num_warps);
    const i32 p0 = next_p0, p1 = next_p1;
    if (chunk.next < chunk.end) {
      next_p0 = load_prefix(chunk.next);
      next_p1 = load_prefix(chunk.next + 1);
    }
    bool in = false;
    u64 row = 0, weight_row = 0;
    if (lane < NUM_RANKS) {
      in = p1 > p0;
      if (in && lane == me) {
        const u32 pos = recv_offset_me + (u32)p0;
        if (pos < a.num_x_rows) {
          row = a.x + (u64)pos * PAYLOAD_BYTES;
          weight_row = a.topk_weights + (u64)pos * TOPK * 4;
        } else {
          in = false;  // no-sync overflow (reported by dispatch and the senders): counts as no row
        }
      } else if (in && HT_CE) {
        const u64 staging = slab + (u64)lane * a.slab_rows * ROW_BYTES;
        row = staging + HT_CE_HEADER_BYTES + (u64)p0 * PAYLOAD_BYTES;
        weight_row = staging + a.ce_weights_offset + (u64)p0 * TOPK * 4;
      } else if (in) {
        row = slab + ((u64)lane * a.slab_rows + (u32)p0) * ROW_BYTES;
        weight_row = row + PAYLOAD_BYTES;
      }
    }
    const u32 mask = __ballot_sync(FULL_WARP_MASK, in);
    // Every lane reads part of every row, so every lane waits for each remote row's flag with an acquire of
    // its own (one broadcast load per poll): a row that has arrived costs one round trip before its loads.
    bool ok = true;
#pragma unroll
    for (u32 r = 0; r < NUM_RANKS; r++) {
      const u32 slot = __shfl_sync(FULL_WARP_MASK, (u32)p0, r);
      // HT_CE: the flag of the slot's piece.
      const u32 flag = HT_CE ? slot / a.ce_piece_rows : slot;
      if (r != me && ((mask >> r) & 1u) != 0u && ok) ok = wait_flag_geq(flags + (u64)r * a.flag_slots + flag, epoch, d, r);
    }
    if (!__all_sync(FULL_WARP_MASK, ok)) break;
    const u32x4* rows[NUM_RANKS];
    const u32* weight_rows[NUM_RANKS];
#pragma unroll
    for (u32 r = 0; r < NUM_RANKS; r++) {
      rows[r] = reinterpret_cast<const u32x4*>(__shfl_sync(FULL_WARP_MASK, row, r));
      weight_rows[r] = reinterpret_cast<const u32*>(__shfl_sync(FULL_WARP_MASK, weight_row, r));
    }

#pragma unroll 1
    for (u32 round = 0; round < ((HT_EXPERIMENT & HT_EXP_NO_COPY_OUT) == 0 ? RED_ROUNDS : 0u); round++) {
      u32x4 v[RED_UNROLL][NUM_RANKS], b0[RED_UNROLL], b1[RED_UNROLL];
#pragma unroll
      for (u32 u = 0; u < RED_UNROLL; u++) {
        const u32 i = (round * RED_UNROLL + u) * WARP_SIZE + lane;
        if (i >= PAYLOAD_VECS) continue;
#pragma unroll
        for (u32 r = 0; r < NUM_RANKS; r++) {
          v[u][r] = u32x4{0u, 0u, 0u, 0u};  // a rank the token did not go to: the tree's +0.0 leaf
          if (((mask >> r) & 1u) == 0u) continue;
          v[u][r] = r == me ? ptx::ld_nc_na_v4(rows[r] + i) : ptx::ld_na_v4(rows[r] + i);
        }
        if (NUM_BIASES >= 1) b0[u] = ptx::ld_nc_na_v4(bias0 + (u64)t * PAYLOAD_VECS + i);
        if (NUM_BIASES >= 2) b1[u] = ptx::ld_nc_na_v4(bias1 + (u64)t * PAYLOAD_VECS + i);
      }
#pragma unroll
      for (u32 u = 0; u < RED_UNROLL; u++) {
        const u32 i = (round * RED_UNROLL + u) * WARP_SIZE + lane;
        if (i >= PAYLOAD_VECS) continue;
        float acc[BF16_PER_VEC];
        tree_sum_bf16x8(acc, v[u]);
        if (NUM_BIASES >= 1) accumulate_bf16x8(acc, b0[u]);
        if (NUM_BIASES >= 2) accumulate_bf16x8(acc, b1[u]);
        u32x4 out;
        out.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
        out.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
        out.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
        out.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
        ptx::st_na_v4(combined + (u64)t * PAYLOAD_VECS + i, out);
      }
    }

    if (TOPK > 0 && lane < TOPK) {
      float w[NUM_RANKS];
#pragma unroll
      for (u32 r = 0; r < NUM_RANKS; r++) w[r] = ((mask >> r) & 1u) != 0u ? ptx::f32_from_bits(weight_rows[r][lane]) : 0.0f;
      reinterpret_cast<float*>(a.combined_topk_weights)[(u64)t * TOPK + lane] = ptx::add_rn_f32(0.0f, tree_sum<0, RANKS_POW2>(w));
    }
  }
  if (lane == 0) ht_trace_stamp(a.trace, TRACE_WORDS, HT_TRACE_WARP_END + trace_warp);
}

namespace moelink::intranode {
// moelink::intranode::combine: grid num_sms blocks (persistent, one per SM), block THREADS.
//   Blocks [0, num_send_blocks) send expert outputs back, the others reduce (see send and reduce above); with
//   HT_CE no block sends (num_send_blocks 0): the side stream's copy engines moved the rows (ht_ce_signal.cu).
//   The frame (ht.cuh, ht_run_op): nothing moves when the handle's routing status is non-zero or T_max
//   exceeds slab_rows for this row size, and every rank returns.
//   Flags: row flags (data region, [src][slot], value = combine epoch) from senders to reducers; the last
//   block hands the combine slab back (consumed[me] = epoch in every peer's control region).
//   reads: x, top-k weights, biases, routing, own combine slab and row flags;
//   writes: peers' combine slabs and row flags, combined_x, combined_topk_weights, consumed flags.
__global__ void __launch_bounds__(THREADS, 1) combine(const __grid_constant__ HtCombineArgs a) {
  ht_run_op<COMBINE_WARPS, TRACE_WORDS>(
      a, PHASE_COMBINE, NUM_RANKS, ROW_BYTES, HT_COMBINE_WORDS,
      [&](u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) { send(a, epoch, d, warp_id, num_warps); },
      [&](u32 epoch, const Deadline& d, u32 warp_id, u32 num_warps) { reduce(a, epoch, d, warp_id, num_warps); },
      [&]() {
        if (HT_CE) ht_ce_block_end(a.ctrl[a.rank], HT_COMBINE_WORDS, make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_COMBINE), a.rank);
      },
      [](const Deadline&) {});
}
}  // namespace moelink::intranode
