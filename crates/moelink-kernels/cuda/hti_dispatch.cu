// moelink kernel family: high-throughput dispatch across nodes (moelink_kernels::ht_internode). The
// protocol, the JIT constants and what the internode kernels share are in hti.cuh.
#include "hti.cuh"

// A warp copies one token's payload (PAYLOAD_VECS vectors at `src`) into the message of every node in
// `nodes` (lane b holds node b's message address in `node_msg`): each batch of loads is stored to every
// node, so the row is read once however many nodes it reaches. SEND_UNROLL loads a lane: a bf16 row of
// 7168 channels (28 vectors a lane) in two batches, an FP8 row in one (the senders bound the dispatch).
constexpr u32 SEND_UNROLL = 14;
__device__ __forceinline__ void copy_to_messages(u32 nodes, u64 node_msg, const u32x4* src, u32 lane) {
  constexpr u32 U = SEND_UNROLL;
  for (u32 base = 0; base < PAYLOAD_VECS; base += U * WARP_SIZE) {
    u32x4 v[U];
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      const u32 i = base + u * WARP_SIZE + lane;
      if (i < PAYLOAD_VECS) v[u] = ptx::ld_nc_na_v4(src + i);
    }
    for (u32 todo = nodes; todo != 0u; todo &= todo - 1) {
      u32x4* dst = reinterpret_cast<u32x4*>(__shfl_sync(FULL_WARP_MASK, node_msg, __ffs(todo) - 1) + MSG_PAYLOAD);
#pragma unroll
      for (u32 u = 0; u < U; u++) {
        const u32 i = base + u * WARP_SIZE + lane;
        if (i < PAYLOAD_VECS) ptx::st_na_v4(dst + i, v[u]);
      }
    }
  }
}

// ============================================================================================== dispatch
namespace hti_dispatch {

// expert_tokens' parts, at offsets that do not move with the call's expert count (so no call's counts lie
// where another call's copy was): notify's expected counts [1 + E_local] (copy_expected), the receivers'
// rows per local expert [E_local], the senders' tokens per expert [E].
constexpr u32 ET_EXPECTED = 0, ET_RECEIVED = 1 + HTI_MAX_LOCAL_EXPERTS, ET_SENT = 1 + 2 * HTI_MAX_LOCAL_EXPERTS;

// The per-expert checks' tallies (check_token_ranks, copy_out, check_expert_counts): a sender block counts the
// tokens of every expert (ET_SENT), a receiver block the rows of each local expert (ET_RECEIVED). When they
// fit, a block counts in shared memory (a shared atomic per top-k entry) and adds its non-zero tallies once
// at its end (flush_tallies), not a global atomic per entry on the counters' few L2 lines.
// DISPATCH_TALLY_SLOTS: the JIT leaves it at 2048; the CPU emulator sets fewer to reach the global atomics.
#ifndef DISPATCH_TALLY_SLOTS
#define DISPATCH_TALLY_SLOTS 2048
#endif
constexpr u32 TALLY_SLOTS = DISPATCH_TALLY_SLOTS;
__shared__ u32 s_tally[TALLY_SLOTS];

__device__ __forceinline__ u32 tally_slots(const HtiDispatchArgs& a, bool sender) {
  return sender ? NUM_RANKS * a.num_local_experts : a.num_local_experts;
}

__device__ __forceinline__ u32* tally_counters(const HtiDispatchArgs& a, bool sender) {
  return reinterpret_cast<u32*>(a.expert_tokens) + (sender ? ET_SENT : ET_RECEIVED);
}

__device__ __forceinline__ void tally(const HtiDispatchArgs& a, bool sender, u32 i) {
  if (tally_slots(a, sender) <= TALLY_SLOTS)
    atomicAdd(&s_tally[i], 1u);
  else
    ptx::red_add_relaxed_gpu(tally_counters(a, sender) + i, 1u);
}

// Before any count: the block's tallies zeroed (hti_run's first __syncthreads orders it before them).
__device__ __forceinline__ void zero_tallies() {
  if (TOPK == 0) return;
  for (u32 i = threadIdx.x; i < TALLY_SLOTS; i += blockDim.x) s_tally[i] = 0u;
}

// hti_run's block_end, every thread of a worker block after its last count: the non-zero tallies of a sender
// or receiver block added to expert_tokens, fenced before the block's arrival at the done counter.
__device__ __forceinline__ void flush_tallies(const HtiDispatchArgs& a, Role role) {
  if (TOPK == 0 || role == Role::FORWARD) return;
  const bool sender = role == Role::SEND;
  const u32 n = tally_slots(a, sender);
  if ((sender ? a.num_tokens_per_expert : a.host_notify) == 0 || n > TALLY_SLOTS) return;
  add_tallies(tally_counters(a, sender), s_tally, n);
}

// What meta word `w` of a dispatch row is made of, read from the message once for every local rank it goes
// to: the global top-k id (ids and weights), the raw word (scales, weights, the token index).
struct MetaIn {
  i32 id;
  u32 raw;
};
constexpr u32 META_ITERS = (META_WORDS + WARP_SIZE - 1) / WARP_SIZE;  // meta words per lane

__device__ __forceinline__ MetaIn load_meta_in(const u8* msg, u32 w) {
  const u32* ids = reinterpret_cast<const u32*>(msg + MSG_IDS);
  MetaIn m = {-1, 0u};
  if (w < META_SCALES) {
    m.id = (i32)ids[w / 2];
  } else if (w < META_WEIGHTS) {
    m.raw = reinterpret_cast<const u32*>(msg + MSG_SCALES)[w - META_SCALES];
  } else if (w < META_SRC) {
    m.id = (i32)ids[w - META_WEIGHTS];
    m.raw = reinterpret_cast<const u32*>(msg + MSG_WEIGHTS)[w - META_WEIGHTS];
  } else if (w == META_SRC) {
    m.raw = reinterpret_cast<const u32*>(msg)[0];
  }
  return m;
}

// The meta word `w` as global rank `dst_rank` sees it: ids remapped to its local experts (-1 elsewhere, as
// i64 in two words), weights zeroed where the id is -1 there; the message index and round for combine.
__device__ __forceinline__ u32 meta_word(const HtiDispatchArgs& a, const MetaIn& m, u32 w, u32 dst_rank, u32 round, u32 message) {
  if (w >= META_SCALES && w < META_WEIGHTS) return m.raw;
  if (w == META_SRC) return m.raw;
  if (w == META_MESSAGE) return message;
  if (w == META_ROUND) return round;
  const i64 first = (i64)dst_rank * a.num_local_experts;
  const bool here = m.id >= 0 && m.id >= first && m.id < first + (i64)a.num_local_experts;
  if (w < META_SCALES) {
    const i64 local = here ? (i64)m.id - first : -1;
    return (w & 1u) != 0u ? (u32)((u64)local >> 32) : (u32)(u64)local;
  }
  return here ? m.raw : 0u;
}

// Checks token t's is_token_in_rank row (through the prefix) against the ranks of its top-k experts (TOPK
// > 0): lane k < TOPK loads its k-th expert's rank, lane i tests ranks i, i + 32, ... against them. A rank in
// one set and not in the other is reported (ERR_INVALID_LAYOUT, LAYOUT_ARG_IN_RANK, the token): a row sent
// where it selects no expert arrives with every top-k id -1, and an expert whose rank gets no row misses the
// token. The rows still travel as is_token_in_rank says; the call fails on this rank once the collective has
// run. The expert ids are the ones the message staging reads next (L1), the prefix rows the slots' (L2).
// With num_tokens_per_expert, each of the token's experts is also counted (tally; check_expert_tokens
// compares): every token passes here once, whatever its destinations.
__device__ __forceinline__ void check_token_ranks(const HtiDispatchArgs& a, const Frame& f, const i32* prefix, u32 t, u32 lane,
                                                  const Deadline& d) {
  if (TOPK == 0) return;
  const i64 el = a.num_local_experts;
  i32 rank_of_k = -1;
  if (lane < TOPK) {
    const i64 e = reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + lane];
    if (e >= 0 && e < (i64)NUM_RANKS * el) {
      rank_of_k = (i32)(e / el);
      if (a.num_tokens_per_expert != 0) tally(a, true, (u32)e);
    }
  }
  bool bad = false;
  for (u32 r = lane; r < (NUM_RANKS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE; r += WARP_SIZE) {
    bool want = false;
#pragma unroll
    for (u32 k = 0; k < TOPK; k++) {
      const i32 rank_k = __shfl_sync(FULL_WARP_MASK, rank_of_k, k);  // every lane shuffles: no short circuit
      want = want || rank_k == (i32)r;
    }
    const bool sent = r < NUM_RANKS && prefix[(u64)(t + 1) * NUM_RANKS + r] > prefix[(u64)t * NUM_RANKS + r];
    bad = bad || (r < NUM_RANKS && want != sent);
  }
  if (__any_sync(FULL_WARP_MASK, bad) && lane == 0) report_error(d, ERR_INVALID_LAYOUT, f.me, LAYOUT_ARG_IN_RANK, t);
}

// The last block (every thread): the senders' and receivers' counts checked (check_expert_counts; counted by
// check_token_ranks, copy_out and flush_tallies), each count zeroed for the next call.
__device__ __forceinline__ void check_expert_tokens(const HtiDispatchArgs& a, const Deadline& d) {
  if (TOPK == 0) return;
  u32* expert_tokens = reinterpret_cast<u32*>(a.expert_tokens);
  ExpertCounts c{expert_tokens + ET_SENT,
                 reinterpret_cast<const i32*>(a.num_tokens_per_expert),
                 expert_tokens + ET_RECEIVED,
                 a.host_notify != 0 ? expert_tokens + ET_EXPECTED : nullptr,
                 NUM_RANKS * a.num_local_experts,
                 a.num_local_experts,
                 a.host_seq,
                 a.rdma.rank};
  check_expert_counts(c, d);
}

// Receiver warp 0, first: copy_notify_expected into expert_tokens (ET_EXPECTED).
__device__ __forceinline__ void copy_expected(const HtiDispatchArgs& a, u32 lane) {
  u32* expected = reinterpret_cast<u32*>(a.expert_tokens) + ET_EXPECTED;
  copy_notify_expected(expected, reinterpret_cast<const volatile u32*>(a.host_notify), HN_READY, HN_PER_EXPERT, a.num_local_experts, lane);
}

// Sender warp: SEND_GROUP consecutive tokens at a time from the call's counter, in order. A chunk of Q tokens
// goes out as soon as its tokens are staged, by whichever warp stages its last one (a chunk never straddles a
// round: M is a multiple of Q): several warps stage a chunk at once, so the first put leaves about one group's
// staging time after the launch, and the puts follow the token order. A group's tokens are staged one after
// the other and released by one fence and one count per chunk they fall in: the counter's round trip, the
// fence's wait for the stores to land and the count's round trip, most of a token's time rather than its
// bytes, are paid once per group. The call's first chunk is taken a token at a time: its put then leaves
// after one token's staging instead of a group's, and until it does a NIC's link idles. Lane b < N handles
// node b's hand-back wait, message range and put.
constexpr u32 SEND_GROUP = 2;

// Stages token t (of the round that starts at token round_start) into the message of every node it reaches:
// the layout check, the header, slots, top-k entries and scales, then the payload.
__device__ __forceinline__ void stage_token(const HtiDispatchArgs& a, const Frame& f, const Deadline& dr, u32 t, u32 round_start, u32 lane) {
  const i32* prefix = f.routing + f.at.prefix;
  const i32* node_prefix = f.routing + f.at.node_prefix;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  check_token_ranks(a, f, prefix, t, lane, dr);
  u32 m = 0;
  bool in = false;
  if (lane < NUM_NODES) {
    const i32 p0 = node_prefix[(u64)t * NUM_NODES + lane], p1 = node_prefix[(u64)(t + 1) * NUM_NODES + lane];
    in = p1 > p0;
    m = (u32)(p0 - node_prefix[(u64)round_start * NUM_NODES + lane]);
  }
  const u32 nodes = __ballot_sync(FULL_WARP_MASK, in);
  // What every node's message of t carries, read once: lane k < TOPK its top-k entry, lane i scales
  // i, i + 32, ...
  i32 id = -1;
  u32 weight = 0;
  if (TOPK > 0 && lane < TOPK) {
    id = (i32)reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + lane];
    weight = reinterpret_cast<const u32*>(a.topk_weights)[(u64)t * TOPK + lane];
  }
  constexpr u32 SCALES_PER_LANE = (NUM_SCALES + WARP_SIZE - 1) / WARP_SIZE;
  u32 scale[SCALES_PER_LANE > 0 ? SCALES_PER_LANE : 1];
#pragma unroll
  for (u32 i = 0; i < SCALES_PER_LANE; i++) {
    const u32 g = lane + i * WARP_SIZE;
    if (g < NUM_SCALES) scale[i] = reinterpret_cast<const u32*>(a.x_scales)[(i64)t * a.scale_stride_token + (i64)g * a.scale_stride_group];
  }
  u64 node_msg = 0;  // lane b: where node b's message goes
  for (u32 todo = nodes; todo != 0u; todo &= todo - 1) {
    const u32 b = __ffs(todo) - 1;
    const u32 mb = __shfl_sync(FULL_WARP_MASK, m, b);
    // In place at the rail peer where stores reach it, else staged for the put.
    u8* msg = rdma::window(a.rdma, b * RANKS_PER_NODE + f.me_local, a.at.off_drecv + (u64)f.me_node * a.at.part_bytes + (u64)mb * MSG_BYTES,
                           a.at.off_dsend + (u64)b * a.at.part_bytes + (u64)mb * MSG_BYTES)
                  .ptr;
    if (lane == b) node_msg = reinterpret_cast<u64>(msg);
    // Head and slots: lane j < L gives the slot at (b, j).
    u32 mask = 0;
    if (lane < RANKS_PER_NODE) {
      const u32 r = b * RANKS_PER_NODE + lane;
      const i32 s0 = prefix[(u64)t * NUM_RANKS + r], s1 = prefix[(u64)(t + 1) * NUM_RANKS + r];
      const i32 slot = MSG_COMPACT ? (i32)((u32)s0 % f.round_tokens) : s0;
      reinterpret_cast<MsgSlot*>(msg + MSG_SLOTS)[lane] = (MsgSlot)(s1 > s0 ? slot : -1);
      mask = s1 > s0 ? 1u : 0u;
    }
    mask = __ballot_sync(FULL_WARP_MASK, mask != 0u) & ((1u << RANKS_PER_NODE) - 1u);
    if (lane == 0) {
      reinterpret_cast<u32*>(msg)[0] = t;
      reinterpret_cast<u32*>(msg)[1] = mask;
      reinterpret_cast<u32*>(msg)[2] = MSG_TAG;
    }
    if (TOPK > 0 && lane < TOPK) {
      reinterpret_cast<i32*>(msg + MSG_IDS)[lane] = id;
      reinterpret_cast<u32*>(msg + MSG_WEIGHTS)[lane] = weight;
    }
#pragma unroll
    for (u32 i = 0; i < SCALES_PER_LANE; i++) {
      const u32 g = lane + i * WARP_SIZE;
      if (g < NUM_SCALES) reinterpret_cast<u32*>(msg + MSG_SCALES)[g] = scale[i];
    }
  }
  // The payload: read once, stored into every node's message.
  copy_to_messages(nodes, node_msg, reinterpret_cast<const u32x4*>(x + (u64)t * PAYLOAD_BYTES), lane);
}

__device__ __forceinline__ void send(const HtiDispatchArgs& a, const Frame& f, const Deadline& dr) {
  const u32 lane = threadIdx.x % WARP_SIZE, T = a.num_tokens, Q = a.chunk_tokens, M = f.round_tokens;
  const i32* node_prefix = f.routing + f.at.node_prefix;
  u32* counter = &hti_state(a.state)->dispatch_token;
  u32* chunk_staged = hti_forward(a.state)->chunk_staged;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  u32 rounds_ready = 0;  // lane b: node b handed back every round before this many (this warp has seen)
  // Ticket i < lead is token i; later tickets are groups of SEND_GROUP tokens from lead on.
  const u32 lead = hti_min(Q, T);
  for (;;) {
    u32 ticket = 0;
    if (lane == 0) ticket = ptx::atom_add_relaxed_gpu(counter, 1u);
    ticket = __shfl_sync(FULL_WARP_MASK, ticket, 0);
    const u32 t_first = ticket < lead ? ticket : lead + (ticket - lead) * SEND_GROUP;
    if (t_first >= T) break;
    const u32 t_end = hti_min(t_first + (ticket < lead ? 1u : SEND_GROUP), T);
    // The rows are contiguous in x: on their way to L2 while the warp waits and reads the routing.
    if (lane == 0) ptx::prefetch_l2_bulk(x + (u64)t_first * PAYLOAD_BYTES, (t_end - t_first) * PAYLOAD_BYTES);
    // A round's tokens count only after the round before was handed back, which needs its chunks put: the
    // group is released in parts that do not straddle a round.
    for (u32 part = t_first; part < t_end;) {
      const u32 part_end = hti_min(t_end, (part / M + 1) * M);
      for (u32 t = part; t < part_end; t++) {
        const u32 q = t / Q, k = t / M;
        if (t == q * Q) hti_stamp_chunk(a.trace, q, 0);
        // Lane b: (b, l) handed round k - 1 back, once per round this warp reaches.
        bool ok = true;
        if (lane < NUM_NODES && k >= rounds_ready) {
          const u64* consumed = rdma_word(a.rdma, a.at.off_dconsumed + 8ull * lane);
          const u32 peer = lane * RANKS_PER_NODE + f.me_local;
          ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(consumed) - ((u64)f.base + k)) >= 0; }, for_peer(dr, peer, f.me), peer);
          rounds_ready = k + 1;
        }
        if (!__all_sync(FULL_WARP_MASK, ok)) return;
        stage_token(a, f, dr, t, k * M, lane);
      }
      // Every lane fences its part of the messages (system scope: in place, they went to the peer) before the
      // group's tokens count into their chunks; the warp that counts a chunk's last token puts the chunk, so
      // the put (its signal after a fence, or a NIC's read of the staging area) follows every warp's stores.
      __syncwarp();
      ptx::fence_acq_rel_sys();
      __syncwarp();
      // Each chunk the part falls in: [seg, seg_end) of its tokens.
      for (u32 seg = part; seg < part_end;) {
        const u32 q = seg / Q, t0 = q * Q, t1 = hti_min(t0 + Q, T), seg_end = hti_min(t1, part_end);
        const u32 k = t0 / M, round_start = k * M, chunk = (t0 - round_start) / Q;
        const u64 seq = (u64)f.base + k + 1;
        // The word counts chunk `chunk` of every round so far: rounds before k had Q tokens there (only the
        // call's last chunk is short), and round k's tokens count only once every node handed round k - 1
        // back, after its puts.
        u32 staged = 0;
        if (lane == 0) staged = ptx::atom_add_acq_rel_gpu(chunk_staged + chunk, seg_end - seg) + (seg_end - seg);
        staged = __shfl_sync(FULL_WARP_MASK, staged, 0);
        seg = seg_end;
        if (staged != k * Q + (t1 - t0)) continue;
        hti_stamp_chunk(a.trace, q, 1);
        // Lane b: the chunk's messages [m0, m1) for node b.
        u32 m0 = 0, m1 = 0;
        if (lane < NUM_NODES) {
          const i32 start = node_prefix[(u64)round_start * NUM_NODES + lane];
          m0 = (u32)(node_prefix[(u64)t0 * NUM_NODES + lane] - start);
          m1 = (u32)(node_prefix[(u64)t1 * NUM_NODES + lane] - start);
        }
        // One put per node: the chunk's messages, then its chunk word (SET seq << 32 | m1).
        for (u32 b = 0; b < NUM_NODES; b++) {
          const u32 b0 = __shfl_sync(FULL_WARP_MASK, m0, b), b1 = __shfl_sync(FULL_WARP_MASK, m1, b);
          const u32 peer = b * RANKS_PER_NODE + f.me_local;
          const u64 sig = a.at.off_dchunk + ((u64)f.me_node * HTI_MAX_CHUNKS + chunk) * 8;
          const u64 value = (seq << 32) | b1;
          const u32 qp = chunk % a.rdma.num_qps;
          bool sent = true;
          if (b1 > b0) {
            const u64 dst = a.at.off_drecv + (u64)f.me_node * a.at.part_bytes + (u64)b0 * MSG_BYTES;
            const u64 src = a.at.off_dsend + (u64)b * a.at.part_bytes + (u64)b0 * MSG_BYTES;
            sent = rdma::put_window_signal_warp(a.rdma, qp, peer, rdma::window(a.rdma, peer, dst, src), dst, src, (b1 - b0) * MSG_BYTES, sig,
                                                value, SIGNAL_SET, dr);
          } else {
            if (lane == 0) sent = rdma::signal_thread(a.rdma, qp, peer, sig, value, SIGNAL_SET, dr);
            sent = __shfl_sync(FULL_WARP_MASK, sent ? 1u : 0u, 0) != 0;
          }
          if (!sent) return;
        }
        hti_stamp_chunk(a.trace, q, 2);
      }
      part = part_end;
    }
  }
}

// A chunk is forwarded in FWD_UNITS units (contiguous shares of its messages), each by its own warp: a unit
// is one warp's serial chain of round trips, so a chunk's rows reach the node sooner, and the round's end
// (its hand-back, the call's end) waits for its last chunk, which nothing overlaps. A unit costs its warp the
// chunk words' waits, a fence and the round's counters. Where the source's rows come through a NIC, the
// link sets the pace and the forwarders have that time to spare: every chunk is cut. Where they come by
// stores (`ptr`, NVSHMEM peers it maps), the forwarders set the pace: only the round's last FWD_TAIL_CHUNKS
// are cut (bench/results/2026-11-30-2xnvidia-h200-7d7fa53-forward-units: every chunk cut is 6-13 us faster
// over the emulated NIC and 31-42 us slower over `ptr`).
constexpr u32 FWD_UNITS = 4, FWD_TAIL_CHUNKS = 2;
// Unit u of a round of `chunks` chunks whose last TAIL are cut: its chunk, its share and the chunk's number of
// shares.
struct FwdUnit {
  u32 chunk, part, parts;
};
template <u32 TAIL>
__device__ __forceinline__ u32 fwd_units(u32 chunks) {
  const u32 tail = chunks < TAIL ? chunks : TAIL;
  return chunks - tail + tail * FWD_UNITS;
}
template <u32 TAIL>
__device__ __forceinline__ FwdUnit fwd_unit(u32 chunks, u32 u) {
  const u32 whole = chunks < TAIL ? 0u : chunks - TAIL;
  if (u < whole) return FwdUnit{u, 0u, 1u};
  return FwdUnit{whole + (u - whole) / FWD_UNITS, (u - whole) % FWD_UNITS, FWD_UNITS};
}

// Forwarder warp `p` of the `P` = fwd_per_node warps of source node `an` (rail source s = an * L + l): its
// rounds in order, and in each the units u with u % P == p (fwd_unit: a whole chunk, or a share of one;
// see FWD_UNITS). Lane j < L keeps local rank j's state: the unit's first slot not
// yet flagged and how many, the warp's rows to j this round, whether j handed this round's part back. The
// warps of `an` share, per round, the units done, the rows per local rank and the messages of earlier
// rounds (HtiForward); the one that finishes a round's last unit ends the round: done words, then the RDMA
// hand-back. A round's chunks arrive only after the hand-back of
// the round before, which comes after that round's end reset the shared counts: no warp counts into a round
// that is still ending.
__device__ __forceinline__ void forward(const HtiDispatchArgs& a, const Frame& f, u32 an, u32 p, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens, Q = a.chunk_tokens, P = a.fwd_per_node;
  const u32 s = an * RANKS_PER_NODE + f.me_local;
  const u32 tokens = (u32)f.routing[f.at.tokens_of + s];
  const u32 rounds = rounds_of(f, tokens);
  const u32 first = (u32)f.routing[f.at.fwd_offset + an];
  u32* entries = reinterpret_cast<u32*>(a.fwd_entries);
  HtiForward* shared = hti_forward(a.state);
  const u32 j_rank = f.me_node * RANKS_PER_NODE + lane;  // lane j's global rank (lanes < L)
  const u64* chunk_words = rdma_word(a.rdma, a.at.off_dchunk + (u64)an * HTI_MAX_CHUNKS * 8);
  auto consumed_of = [&](u32 j) {
    return reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_consumed) + (u64)j * NUM_NODES + an;
  };
  // Every chunk is cut when s's puts go through a NIC, else a round's last FWD_TAIL_CHUNKS (see FWD_UNITS).
  const bool cut_all = !rdma::window(a.rdma, s, a.at.off_drecv, a.at.off_dsend).direct;
  for (u32 k = 0; k < rounds; k++) {
    const u64 seq = (u64)f.base + k + 1;
    const u32 chunks = (round_tokens_of(f, tokens, k) + Q - 1) / Q;
    u32 rows = 0, pending_from = 0, pending = 0;  // lane j: rows to j this round; unflagged slots [from, from + n)
    bool handed_back = false;
    // Every lane fences its row stores, then lane j flags j's rows written since the last release.
    auto release = [&]() {
      __syncwarp();
      ptx::fence_acq_rel_sys();
      __syncwarp();
      if (lane < RANKS_PER_NODE && pending > 0) {
        u32* flags = reinterpret_cast<u32*>(a.nvl.base[lane] + a.nvl.off_dflags) + (u64)s * a.nvl.flag_slots;
        for (u32 i = 0; i < pending; i++) ptx::st_relaxed_sys(flags + (pending_from + i) % M, (u32)seq);
        pending = 0;
      }
      __syncwarp();
    };
    // Lane j waits until j handed its part for s back for the round before.
    auto wait_handed_back = [&]() -> bool {
      bool ok = true;
      if (lane < RANKS_PER_NODE && !handed_back) {
        ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(consumed_of(lane)) - ((u64)f.base + k)) >= 0; },
                        for_peer(dn, j_rank, f.me), j_rank);
        handed_back = ok;
      }
      return __all_sync(FULL_WARP_MASK, ok);
    };
    u32 g = 0;  // messages of s before this round (read once this warp has a unit of it)
    const u32 units = cut_all ? fwd_units<HTI_MAX_CHUNKS>(chunks) : fwd_units<FWD_TAIL_CHUNKS>(chunks);
    for (u32 u = p; u < units; u += P) {
      const FwdUnit unit = cut_all ? fwd_unit<HTI_MAX_CHUNKS>(chunks, u) : fwd_unit<FWD_TAIL_CHUNKS>(chunks, u);
      const u32 c = unit.chunk, part = unit.part;
      // The chunk's messages [end of chunk c - 1, end of chunk c): both words carry this round's seq.
      if (!warp_wait_u64(chunk_words + c, seq << 32, for_peer(dr, s, f.me), s)) return;
      if (c > 0 && !warp_wait_u64(chunk_words + c - 1, seq << 32, for_peer(dr, s, f.me), s)) return;
      const u32 trace_chunk = k * ((M + Q - 1) / Q) + c;
      if (part == 0) hti_stamp_fwd(a.trace, an, trace_chunk, 0);
      const u32 chunk_end = (u32)ptx::ld_relaxed_sys_u64(chunk_words + c);
      const u32 chunk_begin = c > 0 ? (u32)ptx::ld_relaxed_sys_u64(chunk_words + c - 1) : 0u;
      // This unit's share of the chunk's messages.
      u32 m = chunk_begin + (chunk_end - chunk_begin) * part / unit.parts;
      const u32 m_end = chunk_begin + (chunk_end - chunk_begin) * (part + 1) / unit.parts;
      // The chunk's messages are contiguous: on their way to L2 while the warp reads the first.
      if (lane == 0 && m_end > m)
        ptx::prefetch_l2_bulk(rdma_bytes(a.rdma, a.at.off_drecv + (u64)an * a.at.part_bytes + (u64)m * MSG_BYTES), (m_end - m) * MSG_BYTES);
      if (u == p) g = ptx::ld_acquire_gpu(&shared->messages_before[an]);
      for (; m < m_end; m++) {
        const u8* msg = rdma_bytes(a.rdma, a.at.off_drecv + (u64)an * a.at.part_bytes + (u64)m * MSG_BYTES);
        // The header, the slots and the meta words' sources in one round trip, before the payload: a load
        // issued after the row's stores waits for them (the row may alias the message, as far as the
        // compiler knows). A row of one batch (FP8) is loaded in the same round trip, not once the header
        // is checked; a bf16 row's first batch held across the check spills ~200 bytes a thread, which costs
        // more than the round trip saved (bench/results/2026-11-30-2xnvidia-h200-df3b4e9-internode-quiet-forward).
        constexpr bool row_with_header = ROW_BATCHES == 1;
        const u32x4* payload = reinterpret_cast<const u32x4*>(msg + MSG_PAYLOAD);
        VecBatch<ROW_UNROLL> row_batch;
        if (row_with_header) load_batch<ROW_UNROLL, false>(row_batch, payload, 0, PAYLOAD_VECS, lane);
        const u32 tag = reinterpret_cast<const u32*>(msg)[2];
        const u32 mask = reinterpret_cast<const u32*>(msg)[1];
        i32 slot = -1;
        if (lane < RANKS_PER_NODE) slot = reinterpret_cast<const MsgSlot*>(msg + MSG_SLOTS)[lane];
        MetaIn meta[META_ITERS];
#pragma unroll
        for (u32 i = 0; i < META_ITERS; i++)
          if (lane + i * WARP_SIZE < META_WORDS) meta[i] = load_meta_in(msg, lane + i * WARP_SIZE);
        if (tag != MSG_TAG) {
          if (lane == 0) raise_error(dr, ERR_PEER_LAYOUT, s, ((u64)tag << 32) | MSG_TAG);
          return;
        }
        if (__any_sync(FULL_WARP_MASK, slot >= 0 && !handed_back) && !wait_handed_back()) return;
        __syncwarp();
        for (u32 todo = mask; todo != 0u; todo &= todo - 1) {
          const u32 j = __ffs(todo) - 1;
          const u32 slot_j = (u32)__shfl_sync(FULL_WARP_MASK, slot, j);
          u8* row = reinterpret_cast<u8*>(a.nvl.base[j] + a.nvl.off_dparts + (u64)s * a.nvl.part_bytes) + (u64)(slot_j % M) * ROW_BYTES;
          if (row_with_header)
            store_batch<ROW_UNROLL>(row_batch, reinterpret_cast<u32x4*>(row), 0, PAYLOAD_VECS, lane);
          else
            copy_vecs<ROW_UNROLL, false>(reinterpret_cast<u32x4*>(row), payload, PAYLOAD_VECS, lane);
          const u32 dst_rank = f.me_node * RANKS_PER_NODE + j;
#pragma unroll
          for (u32 i = 0; i < META_ITERS; i++) {
            const u32 w = lane + i * WARP_SIZE;
            if (w < META_WORDS) reinterpret_cast<u32*>(row + PAYLOAD_BYTES)[w] = meta_word(a, meta[i], w, dst_rank, k, g + m);
          }
        }
        if (lane < RANKS_PER_NODE && slot >= 0) {
          if (pending == 0) pending_from = (u32)slot;
          pending++;
          rows++;
        }
        if (lane == 0) {
          if (first + g + m < a.fwd_capacity)
            entries[first + g + m] = mask | (k << ENTRY_ROUND_SHIFT);
          else
            report_error(dr, ERR_RECV_OVERFLOW, NO_PEER, (u64)f.routing[RT_NUM_FWD], a.fwd_capacity);
        }
        if (__any_sync(FULL_WARP_MASK, pending >= RELEASE_ROWS)) release();
      }
      // A unit's rows to j have consecutive slots; the next unit of this warp does not follow them.
      if (part == 0) hti_stamp_fwd(a.trace, an, trace_chunk, 1);
      release();
      if (part == 0) hti_stamp_fwd(a.trace, an, trace_chunk, 2);
      if (lane < RANKS_PER_NODE && rows > 0) atomicAdd(&shared->round_rows[an][lane], rows);
      rows = 0;
      __syncwarp();
      u32 done = 0;
      if (lane == 0) done = ptx::atom_add_acq_rel_gpu(&shared->units_done[an], 1u) + 1;
      done = __shfl_sync(FULL_WARP_MASK, done, 0);
      if (done != units) continue;
      // The round's last unit: every local rank learns the round's row count — once it is past the round
      // before, even when this round brought it no row (its done word still holds that round's count until
      // then); then s may reuse its part here.
      if (!wait_handed_back()) return;
      if (lane < RANKS_PER_NODE) {
        const u32 total = ptx::ld_acquire_gpu(&shared->round_rows[an][lane]);
        shared->round_rows[an][lane] = 0;
        u64* done_word = reinterpret_cast<u64*>(a.nvl.base[lane] + a.nvl.off_done) + s;
        ptx::st_relaxed_sys_u64(done_word, (seq << 32) | total);
      }
      if (lane == 0) {
        shared->messages_before[an] = g + (u32)ptx::ld_relaxed_sys_u64(chunk_words + chunks - 1);
        shared->units_done[an] = 0;
        ptx::fence_acq_rel_sys();
        const u64 sig = a.at.off_dconsumed + 8ull * f.me_node;
        (void)rdma::signal_thread(a.rdma, an % a.rdma.num_qps, s, sig, hand_back_value(f, k, rounds), SIGNAL_SET, dr);
      }
      __syncwarp();
    }
  }
  if (rounds == 0 && p == 0 && lane == 0) {
    const u64 sig = a.at.off_dconsumed + 8ull * f.me_node;
    (void)rdma::signal_thread(a.rdma, an % a.rdma.num_qps, s, sig, (u64)f.base + f.rounds, SIGNAL_SET, dr);
  }
}

// Copies one arrived row (part [s][slot % M]) to its output position, with its meta words. With host_notify,
// the low word of each local top-k id counts the row for its expert (check_expert_tokens).
__device__ __forceinline__ void copy_out(const HtiDispatchArgs& a, const Frame& f, u32 s, u32 slot, u32 pos, u32 lane) {
  const u8* row = reinterpret_cast<const u8*>(a.nvl.base[f.me_local] + a.nvl.off_dparts + (u64)s * a.nvl.part_bytes) +
                  (u64)(slot % f.round_tokens) * ROW_BYTES;
  // The meta words (and lane 0 the route's two) are loaded with the payload's first batch, not after its
  // stores: one round trip per row instead of one per batch of words.
  const u32* meta = reinterpret_cast<const u32*>(row + PAYLOAD_BYTES);
  u32 words[META_ITERS];
#pragma unroll
  for (u32 i = 0; i < META_ITERS; i++)
    if (lane + i * WARP_SIZE < META_WORDS) words[i] = meta[lane + i * WARP_SIZE];
  u64 route = 0;
  if (lane == 0) route = ((u64)meta[META_ROUND] << 32) | meta[META_MESSAGE];
  copy_vecs<ROW_UNROLL, false>(reinterpret_cast<u32x4*>(a.recv_x) + (u64)pos * PAYLOAD_VECS, reinterpret_cast<const u32x4*>(row), PAYLOAD_VECS,
                               lane);
#pragma unroll
  for (u32 i = 0; i < META_ITERS; i++) {
    const u32 w = lane + i * WARP_SIZE;
    if (w >= META_WORDS) continue;
    const u32 v = words[i];
    if (w < META_SCALES && a.host_notify != 0 && (w & 1u) == 0u && v < a.num_local_experts)
      tally(a, false, v);
    if (w < META_SCALES) reinterpret_cast<u32*>(a.recv_topk_idx)[(u64)pos * 2 * TOPK + w] = v;
    else if (w < META_WEIGHTS) reinterpret_cast<u32*>(a.recv_scales)[(u64)pos * NUM_SCALES + (w - META_SCALES)] = v;
    else if (w < META_SRC) reinterpret_cast<u32*>(a.recv_topk_weights)[(u64)pos * TOPK + (w - META_WEIGHTS)] = v;
    else if (w == META_SRC && a.recv_src_idx != 0) reinterpret_cast<u32*>(a.recv_src_idx)[pos] = v;
  }
  if (lane == 0) reinterpret_cast<u64*>(a.recv_route)[pos] = route;
}

// Receiver warp `w` of `n`: lane i serves source s = w + i * n (one lane per source: n >= R / 32). Sources
// are served in turn without blocking on any: a window of up to 32 rows from the next slot, copied once
// their flags reached the round's seq; the round ends when done[s] says how many rows it had. The window
// stays inside [round start, round start + M): a slot further on aliases one of this round's.
// What every receiver warp `w` of `n` does first: no-sync outputs' rows past the received count get top-k -1
// and weight 0 (spread over the warps); more rows than the outputs hold is reported.
__device__ __forceinline__ void pad_outputs(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  const u32 num_recv = (u32)f.routing[RT_NUM_RECV];
  if (TOPK > 0 && a.num_out_rows > num_recv) {
    const u64 total = (u64)a.num_out_rows * TOPK;
    for (u64 i = (u64)num_recv * TOPK + (u64)w * WARP_SIZE + lane; i < total; i += (u64)n * WARP_SIZE) {
      reinterpret_cast<i64*>(a.recv_topk_idx)[i] = -1;
      reinterpret_cast<u32*>(a.recv_topk_weights)[i] = 0u;
    }
  }
  if (w == 0 && lane == 0 && num_recv > a.num_out_rows) report_error(dn, ERR_RECV_OVERFLOW, NO_PEER, num_recv, a.num_out_rows);
}

// The part of source `s` at this rank goes back to its forwarder (this node's rank with s's local index):
// s may write it again, after round k (the last: base + K).
__device__ __forceinline__ void receiver_hand_back(const HtiDispatchArgs& a, const Frame& f, u32 s, u64 value) {
  u64* consumed = reinterpret_cast<u64*>(a.nvl.base[local_of(s)] + a.nvl.off_consumed) + (u64)f.me_local * NUM_NODES + node_of(s);
  ptx::st_relaxed_sys_u64(consumed, value);
}

__device__ __forceinline__ void receive(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr, const Deadline& dn) {
  constexpr u32 UNKNOWN = 0xffffffffu;
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  pad_outputs(a, f, w, n, dn);
  const u32 s = w + lane * n;
  const bool mine = s < NUM_RANKS;
  // Lane state: round k of `rounds`; next slot; the round's first slot and end slot (UNKNOWN until done[s]).
  u32 k = 0, rounds = 0, next = 0, round_start = 0, round_end = UNKNOWN, offset = 0;
  if (mine) {
    rounds = rounds_of(f, (u32)f.routing[f.at.tokens_of + s]);
    offset = (u32)f.routing[f.at.recv_offset + s];
  }
  const u64* done = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_done);
  const u32* flags_base = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_dflags);
  auto hand_back = [&](u64 value) { receiver_hand_back(a, f, s, value); };
  if (mine && rounds == 0) hand_back((u64)f.base + f.rounds);
  u32 pending = __ballot_sync(FULL_WARP_MASK, mine && k < rounds);
  IdleClock idle;
  while (pending != 0u) {
    bool progressed = false;
    for (u32 todo = pending; todo != 0u; todo &= todo - 1) {
      const u32 i = __ffs(todo) - 1;
      const u32 src = __shfl_sync(FULL_WARP_MASK, s, i);
      const u32 seq = (u32)(f.base + __shfl_sync(FULL_WARP_MASK, k, i) + 1);
      const u32 q = __shfl_sync(FULL_WARP_MASK, next, i), start = __shfl_sync(FULL_WARP_MASK, round_start, i);
      u32 end = __shfl_sync(FULL_WARP_MASK, round_end, i);
      const u32 base_pos = __shfl_sync(FULL_WARP_MASK, offset, i);
      // The round's row count, once its forwarder said it.
      if (end == UNKNOWN) {
        u64 dw = 0;
        if (lane == 0) dw = ptx::ld_acquire_sys_u64(done + src);
        dw = __shfl_sync(FULL_WARP_MASK, dw, 0);
        if ((u32)(dw >> 32) == seq) end = start + (u32)dw;
      }
      // Lane x polls the flag of slot q + x.
      const u32 limit = end == UNKNOWN ? start + M : end;
      const u32 slot = q + lane;
      const u32* flag = flags_base + (u64)src * a.nvl.flag_slots + slot % M;
      const bool arrived = slot < limit && ptx::ld_relaxed_sys(flag) == seq;
      const u32 arrived_mask = __ballot_sync(FULL_WARP_MASK, arrived);
      const u32 ready = arrived_mask == FULL_WARP_MASK ? WARP_SIZE : (u32)__ffs(~arrived_mask) - 1;
      for (u32 r = 0; r < ready; r++) {
        // Every lane reads part of the row: every lane acquires its flag.
        (void)ptx::ld_acquire_sys(flags_base + (u64)src * a.nvl.flag_slots + (q + r) % M);
        const u32 pos = base_pos + q + r;
        if (pos < a.num_out_rows) copy_out(a, f, src, q + r, pos, lane);
      }
      const bool complete = end != UNKNOWN && q + ready == end;
      if (ready > 0 || complete) progressed = true;
      // The round's rows are read by every lane: every lane's fence before the part goes back.
      if (complete) {
        __syncwarp();
        ptx::fence_acq_rel_sys();
        __syncwarp();
      }
      if (lane == i) {
        next = q + ready;
        round_end = end;
        if (complete) {
          hand_back(hand_back_value(f, k, rounds));
          k++;
          round_start = next;
          round_end = UNKNOWN;
        }
      }
      __syncwarp();
    }
    pending = __ballot_sync(FULL_WARP_MASK, mine && k < rounds);
    if (pending != 0u && idle.expired(progressed, pending, s, f, dr, dn)) break;
  }
}

// Receiver warps when there are at least as many as sources: source s = w % R has the S warps w = s, s + R,
// s + 2R, ...; warp j = w / R of them copies its round's slots start + j, start + j + S, ... — each polls the
// flags of its next 32 slots and copies the rows that arrived, in order — and once past the round's end (the
// done word) counts itself out in recv_fin[s]; the last of the S to finish hands the part back. A source's
// stream is then copied by S warps at once instead of one lane's warp.
__device__ __forceinline__ void receive_split(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr,
                                              const Deadline& dn) {
  constexpr u32 UNKNOWN = 0xffffffffu;
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  pad_outputs(a, f, w, n, dn);
  const u32 s = w % NUM_RANKS, j = w / NUM_RANKS, S = (n - s + NUM_RANKS - 1) / NUM_RANKS;
  const u32 rounds = rounds_of(f, (u32)f.routing[f.at.tokens_of + s]);
  const u32 offset = (u32)f.routing[f.at.recv_offset + s];
  const u64* done = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_done);
  const u32* flags = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_dflags) + (u64)s * a.nvl.flag_slots;
  u32* fin = &hti_forward(a.state)->recv_fin[s];
  if (rounds == 0) {
    if (j == 0 && lane == 0) receiver_hand_back(a, f, s, (u64)f.base + f.rounds);
    return;
  }
  IdleClock idle;
  u32 start = 0;  // the round's first slot
  for (u32 k = 0; k < rounds; k++) {
    const u32 seq = (u32)(f.base + k + 1);
    u32 end = UNKNOWN, next = start + j;
    for (;;) {
      // The round's row count, once its forwarder said it.
      if (end == UNKNOWN) {
        u64 dw = 0;
        if (lane == 0) dw = ptx::ld_acquire_sys_u64(done + s);
        dw = __shfl_sync(FULL_WARP_MASK, dw, 0);
        if ((u32)(dw >> 32) == seq) end = start + (u32)dw;
      }
      if (end != UNKNOWN && next >= end) break;
      // Lane x polls this warp's slot next + x S (a slot past start + M aliases one of this round's).
      const u32 limit = end == UNKNOWN ? start + M : end;
      const u32 slot = next + lane * S;
      const bool arrived = slot < limit && ptx::ld_relaxed_sys(flags + slot % M) == seq;
      const u32 arrived_mask = __ballot_sync(FULL_WARP_MASK, arrived);
      const u32 ready = arrived_mask == FULL_WARP_MASK ? WARP_SIZE : (u32)__ffs(~arrived_mask) - 1;
      for (u32 r = 0; r < ready; r++) {
        const u32 q = next + r * S;
        // Every lane reads part of the row: every lane acquires its flag.
        (void)ptx::ld_acquire_sys(flags + q % M);
        if (offset + q < a.num_out_rows) copy_out(a, f, s, q, offset + q, lane);
      }
      next += ready * S;
      if (idle.expired(ready > 0, 1u, s, f, dr, dn)) return;
    }
    // This warp's rows of the round are out (every lane read some: every lane fences); the last warp of the
    // S resets the count for the next round, then hands the part back.
    __syncwarp();
    ptx::fence_acq_rel_sys();
    __syncwarp();
    if (lane == 0 && ptx::atom_add_acq_rel_gpu(fin, 1u) + 1 == S) {
      ptx::st_release_gpu(fin, 0u);
      ptx::fence_acq_rel_sys();
      receiver_hand_back(a, f, s, hand_back_value(f, k, rounds));
    }
    __syncwarp();
    start = end;
  }
}
}  // namespace hti_dispatch

namespace moelink::internode {
// moelink::internode::dispatch: grid = workers (persistent, cooperative) + the emulated NIC's blocks, block
//   THREADS. Blocks [0, num_send_blocks) send, the next num_fwd_blocks forward (warp w: source node w % N,
//   its units u with u % P == w / N (fwd_unit); never one warp for two source nodes: it could wait for the first while
//   the second's sender waits for it, so the host gives num_fwd_blocks * HTI_WARPS >= N * P), the rest
//   receive: several warps per source when there are at least R (receive_split), else one lane per source
//   (receive; warps >= R / 32). Protocol: the top of this file. reads: x, scales, top-k, routing, own RDMA receive parts and NVLink parts, signals;
//   writes: own RDMA send parts or peers' RDMA parts in place, peers' RDMA parts and signals (puts), node
//   peers' NVLink parts, flags, done
//   and consumed words, the outputs, fwd_entries and recv_route (the handle), HtiState.
__global__ void __launch_bounds__(THREADS, 1) dispatch(const __grid_constant__ HtiDispatchArgs a) {
  const Deadline dr = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_DISPATCH_RDMA);
  const Deadline dn = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_DISPATCH_NVLINK);
  HtiState* st = hti_state(a.state);
  hti_dispatch::zero_tallies();
  hti_run(
      a, a.num_tokens, &st->dispatch_base, &st->dispatch_done, dr,
      [&](const Frame& f, Role role, u32 w, u32 n) {
        if (role == Role::SEND) {
          hti_dispatch::send(a, f, dr);
        } else if (role == Role::FORWARD) {
          if (w < NUM_NODES * a.fwd_per_node) hti_dispatch::forward(a, f, w % NUM_NODES, w / NUM_NODES, dr, dn);
        } else {
          if (a.host_notify != 0 && w == 0) hti_dispatch::copy_expected(a, threadIdx.x % WARP_SIZE);
          if (n >= NUM_RANKS)
            hti_dispatch::receive_split(a, f, w, n, dr, dn);
          else
            hti_dispatch::receive(a, f, w, n, dr, dn);
        }
      },
      [&]() {
        st->dispatch_token = 0u;
        for (u32 n = 0; n < NUM_NODES; n++) hti_forward(a.state)->messages_before[n] = 0u;
      },
      [&](Role role) { hti_dispatch::flush_tallies(a, role); },
      [&]() {
        for (u32 i = threadIdx.x; i < HTI_MAX_CHUNKS; i += blockDim.x) hti_forward(a.state)->chunk_staged[i] = 0u;
        hti_dispatch::check_expert_tokens(a, dr);
      });
}
}  // namespace moelink::internode
