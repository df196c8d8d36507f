// moelink kernel family: high-throughput combine across nodes (moelink_kernels::ht_internode). The
// protocol, the JIT constants and what the internode kernels share are in hti.cuh.
#include "hti.cuh"

// A node's partial when one of its ranks held the token: that rank's bf16 vector, as the node tree sums it
// with the +0.0 leaves of the absent ranks (x + 0.0: -0.0 becomes +0.0; a tree of one leaf adds nothing).
__device__ __forceinline__ void single_contributor_partial(const u32x4& v, float (&x)[8]) {
  bf16x8_to_f32(v, x);
  if (Tree<RANKS_PER_NODE, 8>::W > 1) {
#pragma unroll
    for (u32 c = 0; c < 8; c++) x[c] = ptx::add_rn_f32(x[c], 0.0f);
  }
}

// ============================================================================================== combine
namespace hti_combine {

// A received row `pos` (its bf16 payload, then its TOPK weights) into `row` of a forwarder's combine part.
__device__ __forceinline__ void stage_combine_row(const HtiCombineArgs& a, u8* row, u32 pos, u32 lane) {
  copy_vecs<COPY_UNROLL, true>(reinterpret_cast<u32x4*>(row), reinterpret_cast<const u32x4*>(a.x) + (u64)pos * (CPAYLOAD_BYTES / VEC_BYTES),
                  CPAYLOAD_BYTES / VEC_BYTES, lane);
  if (TOPK > 0 && lane < TOPK)
    reinterpret_cast<u32*>(row + CPAYLOAD_BYTES)[lane] = reinterpret_cast<const u32*>(a.topk_weights)[(u64)pos * TOPK + lane];
}

// The rows just staged at `slots[0..sent)`: every lane fences its stores (each wrote part of every row), then
// lane x flags slot slots[x] with `cseq`.
__device__ __forceinline__ void release_combine_rows(u32* flag, const u32 (&slots)[RELEASE_ROWS], u32 sent, u32 cseq, u32 lane) {
  __syncwarp();
  ptx::fence_acq_rel_sys();
  __syncwarp();
  if (lane < sent) {
    u32 my_slot = 0;
#pragma unroll
    for (u32 x = 0; x < RELEASE_ROWS; x++)
      if (x == lane) my_slot = slots[x];
    ptx::st_relaxed_sys(flag + my_slot, cseq);
  }
  __syncwarp();
}

// A sender's first release holds one row, later ones up to RELEASE_ROWS: a forwarder's first chunk needs the
// first row of many senders, and a warp takes microseconds a row, so a first batch of RELEASE_ROWS would hold
// back the first put by that many row copies.
__device__ __forceinline__ u32 release_limit(bool first) { return first ? 1u : RELEASE_ROWS; }

// Expert-side sender warp `w` of `n`: lane i serves source s = w + i * n. Each received row of s goes back
// to its forwarder (this node's rank with s's local index) into combine part [me_local][node(s)] at
// (message mod M), flagged cseq of its round, once that forwarder handed the part back for the round before.
// Sources are served in turn, up to release_limit rows of one round per turn, without blocking on any.
__device__ __forceinline__ void send(const HtiCombineArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  const u32 s = w + lane * n;
  const bool mine = s < NUM_RANKS;
  u32 next = 0, count = 0, offset = 0;
  if (mine) {
    offset = (u32)f.routing[f.at.recv_offset + s];
    count = (u32)f.routing[f.at.recv_count + s];
  }
  const u64* route = reinterpret_cast<const u64*>(a.recv_route);
  const u64* cconsumed = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_cconsumed);
  u32 pending = __ballot_sync(FULL_WARP_MASK, mine && next < count);
  IdleClock idle;
  while (pending != 0u) {
    bool progressed = false;
    for (u32 todo = pending; todo != 0u; todo &= todo - 1) {
      const u32 i = __ffs(todo) - 1;
      const u32 src = __shfl_sync(FULL_WARP_MASK, s, i);
      const u32 q0 = __shfl_sync(FULL_WARP_MASK, next, i), cnt = __shfl_sync(FULL_WARP_MASK, count, i);
      const u32 base_pos = __shfl_sync(FULL_WARP_MASK, offset, i);
      const u32 l = local_of(src), an = node_of(src);
      // The round of the next row (rows of a source come in round order).
      const u32 pos0 = base_pos + q0;
      if (pos0 >= a.num_x_rows) {
        // No-sync overflow (dispatch reported it): the row was never received, nothing goes back.
        if (lane == i) next = cnt;
        progressed = true;
        continue;
      }
      const u32 k = (u32)(route[pos0] >> 32);
      u64 handed = 0;
      if (lane == 0) handed = ptx::ld_acquire_sys_u64(cconsumed + (u64)l * NUM_NODES + an);
      handed = __shfl_sync(FULL_WARP_MASK, handed, 0);
      if ((i64)(handed - ((u64)f.base + k)) < 0) continue;
      (void)ptx::ld_acquire_sys_u64(cconsumed + (u64)l * NUM_NODES + an);
      const u32 cseq = f.base + k + 1;
      u32 sent = 0;
      u32 slots[RELEASE_ROWS];
      const u32 limit = release_limit(q0 == 0);
      for (; sent < limit && q0 + sent < cnt; sent++) {
        const u32 pos = base_pos + q0 + sent;
        if (pos >= a.num_x_rows) break;
        const u64 r = route[pos];
        if ((u32)(r >> 32) != k) break;
        slots[sent] = (u32)r % M;
        stage_combine_row(a, reinterpret_cast<u8*>(a.nvl.base[l] + a.nvl.off_cparts + ((u64)f.me_local * NUM_NODES + an) * a.nvl.part_bytes) +
                                 (u64)slots[sent] * COMBINE_ROW_BYTES,
                          pos, lane);
      }
      release_combine_rows(reinterpret_cast<u32*>(a.nvl.base[l] + a.nvl.off_cflags) + ((u64)f.me_local * NUM_NODES + an) * a.nvl.flag_slots,
                           slots, sent, cseq, lane);
      if (sent > 0) progressed = true;
      if (lane == i) next += sent;
    }
    pending = __ballot_sync(FULL_WARP_MASK, mine && next < count);
    if (pending != 0u && idle.expired(progressed, pending, s, f, dr, dn)) break;
  }
}

// Expert-side sender warps when there are at least as many as sources: source s = w % R has the S warps w =
// s, s + R, ...; warp j = w / R of them sends the source's received rows j, j + S, ... (round order), up to
// release_limit of one round per fence, each round once its forwarder handed that round's part back.
__device__ __forceinline__ void send_split(const HtiCombineArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  const u32 s = w % NUM_RANKS, j = w / NUM_RANKS, S = (n - s + NUM_RANKS - 1) / NUM_RANKS;
  const u32 offset = (u32)f.routing[f.at.recv_offset + s], count = (u32)f.routing[f.at.recv_count + s];
  const u32 l = local_of(s), an = node_of(s), forwarder = f.me_node * RANKS_PER_NODE + l;
  const u64* route = reinterpret_cast<const u64*>(a.recv_route);
  const u64* handed = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_cconsumed) + (u64)l * NUM_NODES + an;
  u8* part = reinterpret_cast<u8*>(a.nvl.base[l] + a.nvl.off_cparts + ((u64)f.me_local * NUM_NODES + an) * a.nvl.part_bytes);
  u32* flag = reinterpret_cast<u32*>(a.nvl.base[l] + a.nvl.off_cflags) + ((u64)f.me_local * NUM_NODES + an) * a.nvl.flag_slots;
  for (u32 q = j; q < count;) {
    // No-sync overflow (dispatch reported it): rows from here on were never received, nothing goes back.
    if (offset + q >= a.num_x_rows) break;
    const u32 k = (u32)(route[offset + q] >> 32);
    bool ok = true;
    if (lane == 0)
      ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(handed) - ((u64)f.base + k)) >= 0; }, for_peer(dn, forwarder, f.me),
                      forwarder);
    if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return;
    (void)ptx::ld_acquire_sys_u64(handed);
    u32 sent = 0;
    u32 slots[RELEASE_ROWS];
    const u32 limit = release_limit(q == j);
    for (; sent < limit && q < count; sent++, q += S) {
      const u32 pos = offset + q;
      if (pos >= a.num_x_rows) break;
      const u64 r = route[pos];
      if ((u32)(r >> 32) != k) break;
      slots[sent] = (u32)r % M;
      stage_combine_row(a, part + (u64)slots[sent] * COMBINE_ROW_BYTES, pos, lane);
    }
    release_combine_rows(flag, slots, sent, (u32)(f.base + k + 1), lane);
  }
}

// How many of entries [from, to) are fp32 partials (the same on every lane); a lane has 8 loads in flight.
__device__ __forceinline__ u32 count_multi(const u32* entries, u32 from, u32 to, u32 lane) {
  constexpr u32 U = 8;
  u32 n = 0;
  for (u32 base = from; base < to; base += U * WARP_SIZE) {
    u32 e[U];
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      const u32 i = base + u * WARP_SIZE + lane;
      e[u] = i < to ? entries[i] : 0u;
    }
#pragma unroll
    for (u32 u = 0; u < U; u++) n += __popc(__ballot_sync(FULL_WARP_MASK, entry_is_multi(e[u])));
  }
  return n;
}

// Forwarder warp `p` of the `P` = fwd_per_node warps of source node `an`: per round, its chunks of Q
// messages (chunk c with c % P == p; fwd_entries say which ranks each message went to), each message the
// rows of those ranks summed as the node level of the tree; the chunk's partials (packed: combine_msg_at)
// staged and put home with its chunk word. The warp that finishes a round's last chunk hands the round's
// parts back to the node's ranks (HtiForward::combine_chunks_done counts; a round's rows arrive only after the
// hand-back of the round before).
__device__ __forceinline__ void forward(const HtiCombineArgs& a, const Frame& f, u32 an, u32 p, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens, Q = a.chunk_tokens, P = a.fwd_per_node;
  HtiForward* shared = hti_forward(a.state);
  const u32 s = an * RANKS_PER_NODE + f.me_local;
  const u32 tokens = (u32)f.routing[f.at.tokens_of + s];
  const u32 rounds = rounds_of(f, tokens);
  const u32 first = (u32)f.routing[f.at.fwd_offset + an], total = (u32)f.routing[f.at.fwd_count + an];
  const u32* entries = reinterpret_cast<const u32*>(a.fwd_entries);
  u32 g = 0;  // messages of s before this round
  // Round k's parts go back to the node's ranks, after round k - 1's: a round without messages from this
  // node goes back as soon as a warp reaches it, possibly before a warp still finishing the round before,
  // and a hand-back word must never go down. false: a deadline passed.
  auto nvl_hand_back = [&](u32 k, u64 value) -> bool {
    bool ok = true;
    if (lane == 0) ok = spin_until([&]() { return ptx::ld_acquire_gpu(&shared->combine_rounds_back[an]) >= k; }, for_peer(dn, NO_PEER, f.me), NO_PEER);
    if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return false;
    __syncwarp();
    ptx::fence_acq_rel_sys();
    __syncwarp();
    if (lane < RANKS_PER_NODE) {
      u64* word = reinterpret_cast<u64*>(a.nvl.base[lane] + a.nvl.off_cconsumed) + (u64)f.me_local * NUM_NODES + an;
      ptx::st_relaxed_sys_u64(word, value);
    }
    __syncwarp();
    if (lane == 0) ptx::st_release_gpu(&shared->combine_rounds_back[an], k + 1);
    __syncwarp();
    return true;
  };
  for (u32 k = 0; k < rounds; k++) {
    const u32 cseq = f.base + k + 1;
    // This round's messages: entries [g, g + cnt) carry round k (entries of one source are in round order).
    u32 lo = g, hi = total;
    while (lo < hi) {
      const u32 mid = lo + (hi - lo) / 2;
      if ((entries[first + mid] >> ENTRY_ROUND_SHIFT) <= k) lo = mid + 1;
      else hi = mid;
    }
    const u32 cnt = lo - g;
    const u32 chunks = (cnt + Q - 1) / Q;
    if (p < chunks) {
      const u64* consumed = rdma_word(a.rdma, a.at.off_cconsumed + 8ull * an);
      if (!warp_wait_u64(consumed, (u64)f.base + k, for_peer(dr, s, f.me), s)) return;
    }
    // fp32 partials among the round's messages [0, multi_counted): where the next chunk starts.
    u32 multi_counted = 0, multi_before = 0;
    for (u32 c0 = p * Q; c0 < cnt; c0 += P * Q) {
      const u32 c1 = hti_min(c0 + Q, cnt);
      const u32 trace_chunk = k * ((M + Q - 1) / Q) + c0 / Q;
      hti_stamp_fwd(a.trace, an, trace_chunk, 0);
      if (RANKS_PER_NODE > 1) multi_before += count_multi(entries + first + g, multi_counted, c0, lane);
      const u64 chunk_at = combine_msg_at(c0, multi_before);
      u64 msg_at = chunk_at;
      for (u32 m = c0; m < c1; m++) {
        const u32 message = g + m;
        const u32 mask = entries[first + message] & 0xffu;
        const bool single = !entry_is_multi(mask);
        // Lane j waits for j's row (NVLink domain), then every lane acquires each flag.
        bool ok = true;
        const u32 slot = message % M;
        if (lane < RANKS_PER_NODE && ((mask >> lane) & 1u) != 0u) {
          const u32* flag = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_cflags) +
                            ((u64)lane * NUM_NODES + an) * a.nvl.flag_slots + slot;
          const u32 peer = f.me_node * RANKS_PER_NODE + lane;
          ok = wait_flag_geq<true>(flag, cseq, for_peer(dn, peer, f.me), peer);
        }
        if (!__all_sync(FULL_WARP_MASK, ok)) return;
        for (u32 j = 0; j < RANKS_PER_NODE; j++)
          if (((mask >> j) & 1u) != 0u)
            (void)ptx::ld_acquire_sys(reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_cflags) +
                                      ((u64)j * NUM_NODES + an) * a.nvl.flag_slots + slot);
        // In place at home where stores reach it, else staged for the put.
        const u64 home_at = a.at.off_crecv + (u64)f.me_node * a.at.part_bytes + msg_at;
        u8* out = rdma::window(a.rdma, s, home_at, a.at.off_csend + (u64)an * a.at.part_bytes + msg_at).ptr;
        auto row_of = [&](u32 j) -> const u8* {
          return reinterpret_cast<const u8*>(a.nvl.base[f.me_local] + a.nvl.off_cparts + ((u64)j * NUM_NODES + an) * a.nvl.part_bytes) +
                 (u64)slot * COMBINE_ROW_BYTES;
        };
        // One rank of the node holds the token: its bf16 row goes home as it is (half the bytes of an fp32
        // partial; the reducer applies the tree's +0.0 padding, single_contributor_partial).
        constexpr u32 VECS = CPAYLOAD_BYTES / VEC_BYTES;
        if (single) copy_vecs<COPY_UNROLL, false>(reinterpret_cast<u32x4*>(out), reinterpret_cast<const u32x4*>(row_of(__ffs(mask) - 1)), VECS, lane);
        // 8 channels (one bf16 vector) per lane and step: the node tree over the local ranks. A lane loads
        // the vectors of NODE_STEPS steps before it sums any (NODE_STEPS x ranks loads in flight): the sum
        // of a row is otherwise one load latency per step.
        constexpr u32 W = Tree<RANKS_PER_NODE, 8>::W;
        constexpr u32 NODE_STEPS = W >= 8 ? 1 : 8 / W;
        const u32x4* rows[RANKS_PER_NODE];
#pragma unroll
        for (u32 j = 0; j < RANKS_PER_NODE; j++) rows[j] = reinterpret_cast<const u32x4*>(row_of(j));
        for (u32 v0 = lane; v0 < VECS && !single; v0 += NODE_STEPS * WARP_SIZE) {
          u32x4 in[NODE_STEPS][RANKS_PER_NODE];
#pragma unroll
          for (u32 u = 0; u < NODE_STEPS; u++) {
            const u32 v = v0 + u * WARP_SIZE;
#pragma unroll
            for (u32 j = 0; j < RANKS_PER_NODE; j++)
              if (v < VECS && ((mask >> j) & 1u) != 0u) in[u][j] = ptx::ld_na_v4(rows[j] + v);
          }
#pragma unroll
          for (u32 u = 0; u < NODE_STEPS; u++) {
            const u32 v = v0 + u * WARP_SIZE;
            if (v >= VECS) break;
            Tree<RANKS_PER_NODE, 8> tree;
#pragma unroll
            for (u32 j = 0; j < W; j++) {
              float x[8];
              if (j < RANKS_PER_NODE && ((mask >> j) & 1u) != 0u) {
                bf16x8_to_f32(in[u][j < RANKS_PER_NODE ? j : 0], x);
              } else {
#pragma unroll
                for (u32 c = 0; c < 8; c++) x[c] = 0.0f;
              }
              tree.push(j, x);
            }
            u32x4 lo4, hi4;
            lo4.x = ptx::bits_from_f32(tree.result(0));
            lo4.y = ptx::bits_from_f32(tree.result(1));
            lo4.z = ptx::bits_from_f32(tree.result(2));
            lo4.w = ptx::bits_from_f32(tree.result(3));
            hi4.x = ptx::bits_from_f32(tree.result(4));
            hi4.y = ptx::bits_from_f32(tree.result(5));
            hi4.z = ptx::bits_from_f32(tree.result(6));
            hi4.w = ptx::bits_from_f32(tree.result(7));
            ptx::st_na_v4(reinterpret_cast<u32x4*>(out) + 2 * v, lo4);
            ptx::st_na_v4(reinterpret_cast<u32x4*>(out) + 2 * v + 1, hi4);
          }
        }
        if (TOPK > 0 && lane < TOPK) {
          Tree<RANKS_PER_NODE, 1> tree;
#pragma unroll
          for (u32 j = 0; j < Tree<RANKS_PER_NODE, 1>::W; j++) {
            float x[1] = {0.0f};
            if (j < RANKS_PER_NODE && ((mask >> j) & 1u) != 0u)
              x[0] = ptx::f32_from_bits(reinterpret_cast<const u32*>(row_of(j) + CPAYLOAD_BYTES)[lane]);
            tree.push(j, x);
          }
          reinterpret_cast<float*>(out + (single ? CPAYLOAD_BYTES : 4 * HIDDEN))[lane] = tree.result(0);
        }
        msg_at += single ? COMBINE_ROW_BYTES : COMBINE_MSG_BYTES;
        multi_before += single ? 0u : 1u;
      }
      multi_counted = c1;
      // The chunk's partials, then its chunk word, in one operation.
      __syncwarp();
      hti_stamp_fwd(a.trace, an, trace_chunk, 1);
      const u32 chunk = c0 / Q;
      const u64 dst = a.at.off_crecv + (u64)f.me_node * a.at.part_bytes + chunk_at;
      const u64 src = a.at.off_csend + (u64)an * a.at.part_bytes + chunk_at;
      const u64 sig = a.at.off_cchunk + ((u64)f.me_node * HTI_MAX_CHUNKS + chunk) * 8;
      const u32 bytes = (u32)(msg_at - chunk_at);
      if (!rdma::put_window_signal_warp(a.rdma, chunk % a.rdma.num_qps, s, rdma::window(a.rdma, s, dst, src), dst, src, bytes,
                                        sig, ((u64)cseq << 32) | c1, SIGNAL_SET, dr))
        return;
      hti_stamp_fwd(a.trace, an, trace_chunk, 2);
      // The round's last chunk read the last rows of the round: every local rank may write its part again.
      u32 done = 0;
      if (lane == 0) done = ptx::atom_add_acq_rel_gpu(&shared->combine_chunks_done[an], 1u) + 1;
      done = __shfl_sync(FULL_WARP_MASK, done, 0);
      if (done == chunks) {
        if (lane == 0) shared->combine_chunks_done[an] = 0;
        if (!nvl_hand_back(k, hand_back_value(f, k, rounds))) return;
      }
    }
    g += cnt;
    // A round without messages from this node: nothing to read, the part goes back at once.
    if (chunks == 0 && p == 0 && !nvl_hand_back(k, hand_back_value(f, k, rounds))) return;
  }
  if (rounds == 0 && p == 0) (void)nvl_hand_back(0, (u64)f.base + f.rounds);
}

// Home-side reducer warp: tokens one at a time, in order, from the call's counter, one round at a time (a
// token of round k waits until round k - 1 is reduced, so that hand-backs go out in round order). A chunk's
// tokens become ready together (one chunk word per node), so the warps that took them reduce them side by
// side: the last chunk's tail is one token's reduction, not Q of them in a row. Lane b finds node b's
// partial (chunk word, RDMA domain); the upper tree over the nodes, + 0.0, the biases, bf16.
__device__ __forceinline__ void reduce(const HtiCombineArgs& a, const Frame& f, const Deadline& dr) {
  const u32 lane = threadIdx.x % WARP_SIZE, T = a.num_tokens, Q = a.chunk_tokens, M = f.round_tokens;
  const i32* node_prefix = f.routing + f.at.node_prefix;
  const i32* multi_prefix = f.routing + f.at.multi_prefix;
  // Node n's fp32 partials before token t of the round that starts at token rs (none with one rank per node).
  auto multi_before = [&](u32 t, u32 rs, u32 n) -> u32 {
    return RANKS_PER_NODE > 1 ? (u32)(multi_prefix[(u64)t * NUM_NODES + n] - multi_prefix[(u64)rs * NUM_NODES + n]) : 0u;
  };
  HtiState* st = hti_state(a.state);
  const u32 rounds = rounds_of(f, T);
  auto hand_back_all = [&](u64 value) {
    if (lane < NUM_NODES) {
      const u32 peer = lane * RANKS_PER_NODE + f.me_local;
      (void)rdma::signal_thread(a.rdma, lane % a.rdma.num_qps, peer, a.at.off_cconsumed + 8ull * f.me_node, value, SIGNAL_SET, dr);
    }
    __syncwarp();
  };
  if (rounds == 0) {
    if (threadIdx.x < WARP_SIZE && blockIdx.x == a.num_send_blocks + a.num_fwd_blocks) hand_back_all((u64)f.base + f.rounds);
    return;
  }
  const u32* bias0 = reinterpret_cast<const u32*>(a.bias0);
  const u32* bias1 = reinterpret_cast<const u32*>(a.bias1);
  for (;;) {
    u32 t0 = 0;
    if (lane == 0) t0 = ptx::atom_add_relaxed_gpu(&st->combine_token, 1u);
    t0 = __shfl_sync(FULL_WARP_MASK, t0, 0);
    if (t0 >= T) break;
    // The trace keeps chunk records: taken and seen by the chunk's first token, reduced by its last.
    const u32 q = t0 / Q, t1 = t0 + 1, k = t0 / M, round_start = k * M;
    const bool chunk_first = t0 % Q == 0, chunk_last = t1 == hti_min((q + 1) * Q, T);
    const u32 cseq = f.base + k + 1;
    if (chunk_first) hti_stamp_chunk(a.trace, q, 0);
    // Lane b: node b's partials of the chunk's tokens are contiguous, on their way to L2 while the warp waits.
    if (lane < NUM_NODES) {
      const i32 start = node_prefix[(u64)round_start * NUM_NODES + lane];
      const u32 m0 = (u32)(node_prefix[(u64)t0 * NUM_NODES + lane] - start), m1 = (u32)(node_prefix[(u64)t1 * NUM_NODES + lane] - start);
      const u64 at0 = combine_msg_at(m0, multi_before(t0, round_start, lane));
      const u64 at1 = combine_msg_at(m1, multi_before(t1, round_start, lane));
      if (m1 > m0) ptx::prefetch_l2_bulk(rdma_bytes(a.rdma, a.at.off_crecv + (u64)lane * a.at.part_bytes + at0), (u32)(at1 - at0));
    }
    // Rounds in order: wait until the reducers finished round k - 1.
    if (k > 0) {
      bool ok = true;
      if (lane == 0) ok = spin_until([&]() { return ptx::ld_acquire_gpu(&st->combine_rounds_done) >= k; }, for_peer(dr, NO_PEER, f.me), NO_PEER);
      if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return;
    }
    for (u32 t = t0; t < t1; t++) {
      u32 m = 0;
      u64 msg_at = 0;
      bool in = false, multi = false, ok = true;
      if (lane < NUM_NODES) {
        const i32 p0 = node_prefix[(u64)t * NUM_NODES + lane], p1 = node_prefix[(u64)(t + 1) * NUM_NODES + lane];
        in = p1 > p0;
        m = (u32)(p0 - node_prefix[(u64)round_start * NUM_NODES + lane]);
        const u32 mb = multi_before(t, round_start, lane);
        multi = in && multi_before(t + 1, round_start, lane) > mb;
        msg_at = combine_msg_at(m, mb);
        if (in) {
          const u32 peer = lane * RANKS_PER_NODE + f.me_local;
          ok = rdma::wait_signal_geq(a.rdma, a.at.off_cchunk + ((u64)lane * HTI_MAX_CHUNKS + m / Q) * 8, (u64)cseq << 32,
                                     for_peer(dr, peer, f.me), peer);
        }
      }
      if (!__all_sync(FULL_WARP_MASK, ok)) return;
      if (chunk_first) hti_stamp_chunk(a.trace, q, 1);
      const u32 nodes = __ballot_sync(FULL_WARP_MASK, in);
      // Nodes where one rank held the token sent its bf16 row instead of an fp32 partial.
      const u32 single = __ballot_sync(FULL_WARP_MASK, in && !multi);
      for (u32 b = 0; b < NUM_NODES; b++)
        if (((nodes >> b) & 1u) != 0u) (void)ptx::ld_acquire_sys_u64(rdma_word(a.rdma, a.at.off_cchunk + ((u64)b * HTI_MAX_CHUNKS + __shfl_sync(FULL_WARP_MASK, m, b) / Q) * 8));
      u64 part[NUM_NODES];
#pragma unroll
      for (u32 b = 0; b < NUM_NODES; b++)
        part[b] = a.rdma.local_base + a.at.off_crecv + (u64)b * a.at.part_bytes + __shfl_sync(FULL_WARP_MASK, msg_at, b);
      u32x4* out = reinterpret_cast<u32x4*>(a.combined_x) + (u64)t * (CPAYLOAD_BYTES / VEC_BYTES);
      // 8 channels per lane and step; a lane loads the partials of REDUCE_STEPS steps before it sums any
      // (the sum of a token is otherwise one load latency per step).
      constexpr u32 VECS = CPAYLOAD_BYTES / VEC_BYTES;
      constexpr u32 W = Tree<NUM_NODES, 8>::W;
      constexpr u32 REDUCE_STEPS = W >= 4 ? 1 : 4 / W;
      for (u32 v0 = lane; v0 < VECS; v0 += REDUCE_STEPS * WARP_SIZE) {
        u32x4 in[REDUCE_STEPS][NUM_NODES][2];
#pragma unroll
        for (u32 u = 0; u < REDUCE_STEPS; u++) {
          const u32 v = v0 + u * WARP_SIZE;
#pragma unroll
          for (u32 b = 0; b < NUM_NODES; b++) {
            if (v < VECS && ((single >> b) & 1u) != 0u) {
              in[u][b][0] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + v);
            } else if (v < VECS && ((nodes >> b) & 1u) != 0u) {
              in[u][b][0] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + 2 * v);
              in[u][b][1] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + 2 * v + 1);
            }
          }
        }
#pragma unroll
        for (u32 u = 0; u < REDUCE_STEPS; u++) {
          const u32 v = v0 + u * WARP_SIZE;
          if (v >= VECS) break;
          Tree<NUM_NODES, 8> tree;
#pragma unroll
          for (u32 b = 0; b < W; b++) {
            float x[8];
            if (b < NUM_NODES && ((single >> b) & 1u) != 0u) {
              single_contributor_partial(in[u][b < NUM_NODES ? b : 0][0], x);
            } else if (b < NUM_NODES && ((nodes >> b) & 1u) != 0u) {
              const u32x4 lo4 = in[u][b < NUM_NODES ? b : 0][0], hi4 = in[u][b < NUM_NODES ? b : 0][1];
              x[0] = ptx::f32_from_bits(lo4.x);
              x[1] = ptx::f32_from_bits(lo4.y);
              x[2] = ptx::f32_from_bits(lo4.z);
              x[3] = ptx::f32_from_bits(lo4.w);
              x[4] = ptx::f32_from_bits(hi4.x);
              x[5] = ptx::f32_from_bits(hi4.y);
              x[6] = ptx::f32_from_bits(hi4.z);
              x[7] = ptx::f32_from_bits(hi4.w);
            } else {
#pragma unroll
              for (u32 c = 0; c < 8; c++) x[c] = 0.0f;
            }
            tree.push(b, x);
          }
          float acc[8];
#pragma unroll
          for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(0.0f, tree.result(c));
          if (NUM_BIASES >= 1) {
            float bx[8];
            bf16x8_to_f32(ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(bias0) + (u64)t * VECS + v), bx);
#pragma unroll
            for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(acc[c], bx[c]);
          }
          if (NUM_BIASES >= 2) {
            float bx[8];
            bf16x8_to_f32(ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(bias1) + (u64)t * VECS + v), bx);
#pragma unroll
            for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(acc[c], bx[c]);
          }
          u32x4 o;
          o.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
          o.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
          o.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
          o.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
          ptx::st_na_v4(out + v, o);
        }
      }
      if (TOPK > 0 && lane < TOPK) {
        Tree<NUM_NODES, 1> tree;
#pragma unroll
        for (u32 b = 0; b < Tree<NUM_NODES, 1>::W; b++) {
          float x[1] = {0.0f};
          if (b < NUM_NODES && ((nodes >> b) & 1u) != 0u)
            x[0] = reinterpret_cast<const float*>(part[b] + (((single >> b) & 1u) != 0u ? CPAYLOAD_BYTES : 4 * HIDDEN))[lane];
          tree.push(b, x);
        }
        reinterpret_cast<float*>(a.combined_topk_weights)[(u64)t * TOPK + lane] = ptx::add_rn_f32(0.0f, tree.result(0));
      }
    }
    // The token is reduced; the round's last one hands the round back to every rail peer.
    __syncwarp();
    if (chunk_last) hti_stamp_chunk(a.trace, q, 2);
    u32 finished = 0;
    if (lane == 0) finished = ptx::atom_add_acq_rel_gpu(&st->combine_round_tokens, t1 - t0) + (t1 - t0);
    finished = __shfl_sync(FULL_WARP_MASK, finished, 0);
    if (finished == round_tokens_of(f, T, k)) {
      hand_back_all(hand_back_value(f, k, rounds));
      if (lane == 0) {
        st->combine_round_tokens = 0;
        ptx::st_release_gpu(&st->combine_rounds_done, k + 1);
      }
      __syncwarp();
    }
  }
}
}  // namespace hti_combine

namespace moelink::internode {
// moelink::internode::combine: grid = workers (persistent, cooperative) + the emulated NIC's blocks, block
//   THREADS. Blocks [0, num_send_blocks) send rows back to their forwarders (several warps per source when
//   there are at least R: send_split; else one lane per source), the next num_fwd_blocks forward (as
//   dispatch's), the rest reduce. Protocol: the top of this file. reads: x, weights,
//   biases, the handle (routing, fwd_entries, recv_route), own parts and signals; writes: node peers'
//   combine parts and flags, own RDMA send parts, peers' RDMA parts and signals, combined_x,
//   combined_topk_weights, HtiState.
__global__ void __launch_bounds__(THREADS, 1) combine(const __grid_constant__ HtiCombineArgs a) {
  const Deadline dr = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_COMBINE_RDMA);
  const Deadline dn = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_COMBINE_NVLINK);
  HtiState* st = hti_state(a.state);
  hti_run(
      a, a.num_tokens, &st->combine_base, &st->combine_done, dr,
      [&](const Frame& f, Role role, u32 w, u32 n) {
        if (role == Role::SEND && n >= NUM_RANKS) {
          hti_combine::send_split(a, f, w, n, dn);
        } else if (role == Role::SEND) {
          hti_combine::send(a, f, w, n, dr, dn);
        } else if (role == Role::FORWARD) {
          if (w < NUM_NODES * a.fwd_per_node) hti_combine::forward(a, f, w % NUM_NODES, w / NUM_NODES, dr, dn);
        } else {
          hti_combine::reduce(a, f, dr);
        }
      },
      [&]() {
        st->combine_token = 0u;
        st->combine_round_tokens = 0u;
        st->combine_rounds_done = 0u;
        for (u32 n = 0; n < NUM_NODES; n++) hti_forward(a.state)->combine_rounds_back[n] = 0u;
      },
      [](Role) {}, []() {});
}
}  // namespace moelink::internode
