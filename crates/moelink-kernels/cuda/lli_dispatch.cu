// moelink kernel family: low-latency dispatch across nodes (moelink_kernels::ll_internode). The protocol,
// the JIT constants and what the low-latency kernels across nodes share are in lli.cuh.
#include "lli.cuh"

// ============================================================================================ dispatch: send
// Block 0 of the send phase: validates the top-k rows, keeps them (and the weights) in the handle area for
// combine, counts tokens per expert and messages per destination in shared memory, and puts every rank its
// meta block (head + counts of its local experts) with a signal SET e.
__device__ __forceinline__ void lli_dispatch_check(const LliDispatchArgs& a, const Deadline& d, LliShared& sm, u32 epoch) {
  const u32 T = a.num_tokens, E = a.num_experts, R = a.rdma.num_ranks, EL = a.num_local_experts, me = a.rdma.rank;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  for (u32 e = threadIdx.x; e < E; e += LL_THREADS) sm.words[e] = 0;
  for (u32 p = threadIdx.x; p < R; p += LL_THREADS) sm.msgs[p] = 0;
  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  u32 problem = 0;
  for (u32 t = threadIdx.x; t < T; t += LL_THREADS) {
    i64 ids[LL_TOPK];
    bool live[LL_TOPK];
    problem |= load_topk_row(idx + (u64)t * LL_TOPK, E, ids, live);
    u32 w[LL_TOPK];  // loaded together with the ids, before any store
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) w[k] = has_weights ? ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + k) : 0u;
    u32 dest[LL_TOPK];  // the rank of each live slot's expert, one division per slot
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) dest[k] = live[k] ? (u32)ids[k] / EL : LLI_NONE;
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      reinterpret_cast<i64*>(a.home_idx)[(u64)t * LL_TOPK + k] = ids[k];
      if (has_weights) reinterpret_cast<u32*>(a.home_weight)[(u64)t * LL_TOPK + k] = w[k];
      if (!live[k]) continue;
      atomicAdd(&sm.words[(u32)ids[k]], 1u);
      bool first = true;
#pragma unroll
      for (u32 j = 0; j < k; j++) first &= dest[j] != dest[k];
      if (first && a.host_problem == 0) atomicAdd(&sm.msgs[dest[k]], 1u);
    }
  }
  if (problem != 0) atomicOr(&sm.problem, problem);
  __syncthreads();
  const u32 problem_all = sm.problem;
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
  // Meta blocks: warp w fills and puts those of ranks w, w + warps, ...
  const u32 lane = lane_id();
  for (u32 i = warp_id(); i < R; i += LL_WARPS) {
    const u32 p = (me + 1 + i) % R;
    u8* block = reinterpret_cast<u8*>(a.rdma.local_base + a.off_send_meta + (u64)p * a.meta_bytes);
    LliMeta* m = reinterpret_cast<LliMeta*>(block);
    if (lane == 0) {
      m->num_msgs = sm.msgs[p];
      m->num_tokens = T;
      m->problem = problem_all;
      m->accepted = 0;
    }
    if (lane < LL_SIG_WORDS) m->sig[lane] = a.sig[lane];
    u32* counts = reinterpret_cast<u32*>(block + sizeof(LliMeta));
    for (u32 el = lane; el < EL; el += WARP_SIZE) counts[el] = sm.words[p * EL + el];
    rdma::put_signal_warp(a.rdma, p % a.rdma.num_qps, p, a.off_meta + (u64)me * a.meta_bytes, a.off_send_meta + (u64)p * a.meta_bytes,
                          a.meta_bytes, a.off_meta_sig + 8ull * me, epoch, SIGNAL_SET, d);
  }
}

// A message's destinations, shared by the block that sends it: ranks in send order (me + 1, me + 2, ...,
// every rank starting elsewhere) and the token's compact slot at each.
struct LliDests {
  u32 rank[LL_TOPK];
  u32 slot[LL_TOPK];
  u32 count;
};

// The messages: one token per block at a time (tokens block, block + data_blocks, ...), its message built by
// every warp of the block. The last warp finds the token's destinations and its compact slot at each
// (lli_route_dests); meanwhile the warps load and quantise (FP8, 16 channels per lane) or load (bf16) the
// row's 512-byte chunks, chunk c by warp c % LL_WARPS, into registers. Then each warp stores its chunk
// straight into every destination it reaches with stores (rdma::window), and into this rank's staging when
// another is put from there; the last warp counts the token's ranks per expert (lli_route_ranks) while those
// stores fly, and stores the header, entries and weights likewise. Every thread fences, and one thread
// signals ADD 1 to a direct destination; another is put from the staging by one warp with put_signal.
// A warp carrying whole messages (quantise, stage, copy, fence, one dependent step after another) left the
// sends of 128 tokens on 8 blocks for ~64 us at 2x1 (bench/results/2026-11-28-2xnvidia-h200-33ada12-lli-trace-row-align);
// staging every message and copying it out from there put an L2 round trip between the route and the stores.
__device__ __forceinline__ void lli_dispatch_rows(const LliDispatchArgs& a, const Deadline& d, const LliShared& sm, u32 block,
                                                  u32 data_blocks) {
  __shared__ LliDests dests[2];  // alternate per token: the next token's routing never waits on this one's readers
  constexpr u32 ROUTE_WARP = LL_WARPS - 1;
  const u32 lane = lane_id(), warp = warp_id();
  const u32 R = a.rdma.num_ranks, me = a.rdma.rank, TM = a.max_tokens;
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  u32 parity = 0;
  for (u32 t = block; t < a.num_tokens; t += data_blocks, parity ^= 1) {
    LliDests& ds = dests[parity];
    const u64 src_off = a.off_send_msgs + (u64)t * LLI_MSG_BYTES;
    u8* msg = reinterpret_cast<u8*>(a.rdma.local_base + src_off);
    auto dst_off_of = [&](u32 i) { return a.off_msgs + ((u64)me * TM + ds.slot[i]) * LLI_MSG_BYTES; };
    LliRoute r;
    if (warp == ROUTE_WARP) {
      r = lli_route_dests(a.topk_idx, t, a.num_experts, a.num_local_experts);
      // A destination's place in the send order: the destinations before it, counted from me + 1.
      const bool has = r.dest != LLI_NONE;
      const u32 key = has ? (r.dest + R - me - 1) % R : LLI_NONE;
      u32 place = 0;
#pragma unroll
      for (u32 j = 0; j < LL_TOPK; j++) place += __shfl_sync(FULL_WARP_MASK, key, j) < key ? 1u : 0u;
      const u32 count = __popc(__ballot_sync(FULL_WARP_MASK, has));
      if (has) {
        ds.rank[place] = r.dest;
        ds.slot[place] = r.slot;
      }
      if (lane == 0) {
        ds.count = count;
        if (sm.trace_row != 0) reinterpret_cast<volatile u64*>(sm.trace_row)[LL_TRACE_SEND_ROUTED] = ptx::globaltimer();
      }
    }
    // This warp's chunks c = warp + k * LL_WARPS (k < LLI_WARP_CHUNKS), in registers.
#if LL_FP8
    u32x4 q[LLI_WARP_CHUNKS];
    float scale_inv[LLI_WARP_CHUNKS];
#pragma unroll
    for (u32 k = 0; k < LLI_WARP_CHUNKS; k++) {
      const u32 c = warp + k * LL_WARPS;
      const u32 ch = c * FP8_CHUNK_CHANNELS + lane * FP8_LANE_CHANNELS;
      u32x4 v0 = {0, 0, 0, 0}, v1 = {0, 0, 0, 0};
      if (c < SEND_CHUNKS && ch < LL_HIDDEN) {
        const u32x4* src = reinterpret_cast<const u32x4*>(x + ((u64)t * LL_HIDDEN + ch) * 2);
        v0 = ptx::ld_nc_na_v4(src);
        v1 = ptx::ld_nc_na_v4(src + 1);
      }
      q[k] = u32x4{0, 0, 0, 0};
      scale_inv[k] = 0.0f;
      if (c < SEND_CHUNKS) q[k] = quantize16(v0, v1, (a.flags & LL_FLAG_ROUND_SCALE) != 0, scale_inv[k]);  // warp-uniform
    }
    auto store_chunks = [&](u8* to) {
#pragma unroll
      for (u32 k = 0; k < LLI_WARP_CHUNKS; k++) {
        const u32 ch = (warp + k * LL_WARPS) * FP8_CHUNK_CHANNELS + lane * FP8_LANE_CHANNELS;
        if (warp + k * LL_WARPS < SEND_CHUNKS && ch < LL_HIDDEN) {
          ptx::st_v4(reinterpret_cast<u32x4*>(to + LLI_PAYLOAD_AT + ch), q[k]);
          if (lane % FP8_GROUP_LANES == 0) reinterpret_cast<u32*>(to + LLI_PAYLOAD_AT + LL_HIDDEN)[ch / FP8_GROUP] = f32_bits(scale_inv[k]);
        }
      }
    };
#else
    u32x4 v[LLI_WARP_CHUNKS];
#pragma unroll
    for (u32 k = 0; k < LLI_WARP_CHUNKS; k++) {
      const u32 off = (warp + k * LL_WARPS) * CHUNK_BYTES + lane * VEC_BYTES;
      v[k] = off < ROW_BYTES_BF16 ? ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(x + (u64)t * ROW_BYTES_BF16 + off)) : u32x4{0, 0, 0, 0};
    }
    auto store_chunks = [&](u8* to) {
#pragma unroll
      for (u32 k = 0; k < LLI_WARP_CHUNKS; k++) {
        const u32 off = (warp + k * LL_WARPS) * CHUNK_BYTES + lane * VEC_BYTES;
        if (off < ROW_BYTES_BF16) ptx::st_v4(reinterpret_cast<u32x4*>(to + LLI_PAYLOAD_AT + off), v[k]);
      }
    };
#endif
    __syncthreads();
    lli_trace(sm, LL_TRACE_SEND_BUILT);
    const u32 n = ds.count;
    bool staged = false;  // some destination is put from the staging
    for (u32 i = 0; i < n; i++) {
      const rdma::Window w = rdma::window(a.rdma, ds.rank[i], dst_off_of(i), src_off);
      if (w.direct) {
        store_chunks(w.ptr);
      } else {
        staged = true;
      }
    }
    if (staged) store_chunks(msg);
    if (warp == ROUTE_WARP) {
      const u32 wbits = has_weights && lane < LL_TOPK ? ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + lane) : 0u;
      lli_route_ranks(r, a.topk_idx, t);
      const u32 entry = r.id != LLI_NONE ? (r.id << 16) | r.rank : LLI_NONE;
      auto store_head = [&](u8* to) {
        if (lane == 0) reinterpret_cast<u32*>(to)[0] = t;
        if (lane < LL_TOPK) {
          u32* route = reinterpret_cast<u32*>(to + LLI_HDR_BYTES);
          route[lane] = entry;
          route[LL_TOPK + lane] = wbits;
        }
      };
      for (u32 i = 0; i < n; i++) {
        const rdma::Window w = rdma::window(a.rdma, ds.rank[i], dst_off_of(i), src_off);
        if (w.direct) store_head(w.ptr);
      }
      if (staged) store_head(msg);
    }
    // Every thread's stores (in place, staged) are visible everywhere before any signal or put.
    ptx::fence_acq_rel_sys();
    __syncthreads();
    lli_trace(sm, LL_TRACE_SEND_STORED);
    for (u32 i = warp; i < n; i += LL_WARPS) {
      const u32 p = ds.rank[i];
      const u64 dst_off = dst_off_of(i);
      const rdma::Window w = rdma::window(a.rdma, p, dst_off, src_off);
      const u32 qp = (t + p) % a.rdma.num_qps;
      if (w.direct) {
        if (lane == 0) rdma::signal_thread(a.rdma, qp, p, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
      } else {
        rdma::put_signal_warp(a.rdma, qp, p, dst_off, src_off, LLI_MSG_BYTES, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
      }
    }
  }
}

__device__ __forceinline__ void lli_dispatch_send(const LliDispatchArgs& a, const Deadline& d, LliShared& sm, u32 epoch, u32 workers) {
  // The top-k rows are sent towards L2 before the hand-back wait, whose round trips they then overlap: the
  // check block and every route warp read them after it. Not by warp 0, whose lanes poll the hand-back words.
  if (blockIdx.x == 0 && warp_id() != 0) {
    for (u32 t = threadIdx.x - WARP_SIZE; t < a.num_tokens; t += LL_THREADS - WARP_SIZE)
      ptx::prefetch_l2(reinterpret_cast<const i64*>(a.topk_idx) + (u64)t * LL_TOPK);
  }
  lli_wait_consumed(a, d, sm);
  lli_trace(sm, LL_TRACE_SEND_READY);
  if (sm.abort == 0) {
    if (blockIdx.x == 0) {
      lli_dispatch_check(a, d, sm, epoch);
      lli_trace(sm, LL_TRACE_INDEX_CHECKED);
    }
    if (a.host_problem == 0 && (blockIdx.x != 0 || workers == 1)) {
      const u32 data_blocks = workers == 1 ? 1 : workers - 1;
      const u32 block = workers == 1 ? 0 : blockIdx.x - 1;
      lli_dispatch_rows(a, d, sm, block, data_blocks);
      lli_trace(sm, LL_TRACE_SEND_ISSUED);  // thread 0: its warp's messages are out
    }
  }
  const LliOp op = lli_op(a);
  if (lli_last_block(op.send_done, sm, workers, LL_TRACE_SEND_DONE) && threadIdx.x == 0 && sm.phase_ok) {
    *op.epoch = epoch;
    *op.last_write = epoch;
  }
}

// ============================================================================================ dispatch: receive
__device__ __forceinline__ void lli_dispatch_recv(const LliDispatchArgs& a, const Deadline& d, LliShared& sm, u32 epoch, u32 workers) {
  const u32 R = a.rdma.num_ranks, EL = a.num_local_experts, TM = a.max_tokens, me = a.rdma.rank;
  const u32 rows = R * TM, first_expert = me * EL;
  u64* expected = lli_expected(a.state, LL_KIND_DISPATCH, a.set, R);
  LlReport* rep = reinterpret_cast<LlReport*>(a.report);
  // Sources: thread p (strided) waits for p, checks its meta, and reports (block 0).
  for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
    u64 waited = 0;
    bool meta_seen = false;
    LliMetaWords words = {};
    const LliMeta* m = lli_wait_source(a, p, epoch, a.off_meta + (u64)p * a.meta_bytes, expected[p], d, sm, waited, meta_seen, words);
    u32 used = 0, n = 0, problem = 0, mismatch_field = LL_SIG_WORDS;
    if (m != nullptr) {
      problem = words.problem;
      n = words.num_msgs;
#pragma unroll
      for (u32 i = LL_SIG_WORDS; i-- > 0;)
        if (words.sig[i] != a.sig[i]) mismatch_field = i;
      used = mismatch_field == LL_SIG_WORDS && problem == 0 && n <= TM ? 1u : 0u;
      if (blockIdx.x == 0 && mismatch_field != LL_SIG_WORDS) {
        // The lowest mismatching peer wins: CAS on the 1-based peer word from 0 or a higher peer.
        u32 cur = ptx::ld_relaxed_sys(&rep->mismatch_peer);
        while (cur == 0 || cur > p + 1) {
          const u32 seen = ptx::atom_cas_acq_rel_gpu(&rep->mismatch_peer, cur, p + 1);
          if (seen == cur) {
            ptx::st_relaxed_sys_u64(&rep->mismatch_ours, a.sig[mismatch_field]);
            ptx::st_relaxed_sys_u64(&rep->mismatch_theirs, words.sig[mismatch_field]);
            ptx::st_relaxed_sys(&rep->mismatch_field, mismatch_field);
            break;
          }
          cur = seen;
        }
      }
      if (blockIdx.x == 0 && problem != 0 && p != me) {
        u32 cur = ptx::ld_relaxed_sys(&rep->peer_problem_peer);
        while (cur == 0 || cur > p + 1) {
          const u32 seen = ptx::atom_cas_acq_rel_gpu(&rep->peer_problem_peer, cur, p + 1);
          if (seen == cur) {
            ptx::st_relaxed_sys(&rep->peer_problem, problem);
            break;
          }
          cur = seen;
        }
      }
    }
    sm.used[p] = used;
    sm.msgs[p] = used ? n : 0;
    // What the data word will have counted once this call is over (the last block adds it).
    sm.first[p] = meta_seen && m != nullptr ? words.num_msgs : 0;
    if (blockIdx.x == 0 && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[p] += (i64)waited;
  }
  __syncthreads();
  lli_trace(sm, LL_TRACE_RECV_SEEN);
  if (sm.abort == 0) {
    // Message prefix per source (sm.msgs becomes the exclusive prefix; sm.first keeps the counts the end
    // adds to what the next call expects), so that every warp locates its first item before the counts.
    __shared__ u32 total_msgs;
    if (threadIdx.x == 0) {
      u32 run = 0;
      for (u32 p = 0; p < R; p++) {
        const u32 n = sm.msgs[p];
        sm.msgs[p] = run;
        run += n;
      }
      total_msgs = run;
    }
    __syncthreads();
    // Expansion: work item = (message, 512-byte chunk), dealt over every warp of the grid. An item's payload
    // chunk, entries, weights, token and scales are loaded one item ahead: the first item's with the
    // counts (one round trip for both), the next one's during this one's stores. The scales are loaded
    // once per item, not once per expert row.
    const u32 lane = lane_id();
    const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
    const u32 items = total_msgs * RECV_CHUNKS;
    struct Item {
      u32 p, i, c;
      bool live;
    };
    struct Ahead {
      u32x4 v;
      u32 entry, w, token;
#if LL_FP8
      RowScales scales;
#endif
    };
    auto item_of = [&](u32 item) {
      if (item >= items) return Item{0, 0, 0, false};
      const u32 g = item / RECV_CHUNKS;
      u32 lo = 0, hi = R;  // the source: the last p with prefix[p] <= g
      while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (sm.msgs[mid] <= g) lo = mid; else hi = mid;
      }
      return Item{lo, g - sm.msgs[lo], item % RECV_CHUNKS, true};
    };
    auto message = [&](const Item& it) {
      return reinterpret_cast<const u8*>(a.rdma.local_base + a.off_msgs + ((u64)it.p * TM + it.i) * LLI_MSG_BYTES);
    };
    auto load_item = [&](const Item& it) {
      Ahead l = {};
      l.entry = LLI_NONE;
      if (!it.live) return l;
      const u8* msg = message(it);
      const u8* payload = msg + LLI_PAYLOAD_AT;
      const u32 off = it.c * CHUNK_BYTES + lane * VEC_BYTES;
      if (off < PAYLOAD_BYTES) l.v = ptx::ld_cg_v4(payload + off);
      if (lane < LL_TOPK) {
        l.entry = ptx::ld_cg_u32(msg + LLI_HDR_BYTES + 4 * lane);
        if (it.c == 0 && has_weights) l.w = ptx::ld_cg_u32(msg + LLI_HDR_BYTES + 4 * (LL_TOPK + lane));
      }
      if (it.c == 0) {
        l.token = ptx::ld_cg_u32(msg);
#if LL_FP8
        load_row_scales(payload + LL_HIDDEN, (a.flags & LL_FLAG_UE8M0) != 0, l.scales);
#endif
      }
      return l;
    };
    const u32 first_item = first_item_of_warp(workers);
    Item next_it = item_of(first_item);
    Ahead next = load_item(next_it);

    // Bases per (source, local expert): counts of the used sources, scanned over sources per expert.
    u32* bases = sm.words;
    for (u32 pe = threadIdx.x; pe < R * EL; pe += LL_THREADS) {
      const u32 p = pe / EL;
      bases[pe] = sm.used[p] ? ptx::ld_cg_u32(reinterpret_cast<const u32*>(a.rdma.local_base + a.off_meta + (u64)p * a.meta_bytes + sizeof(LliMeta)) + pe % EL) : 0u;
    }
    __syncthreads();
    lli_trace(sm, LL_TRACE_RECV_INDEXED);
    for (u32 e = threadIdx.x; e < EL; e += LL_THREADS) {
      u32 run = 0;
      for (u32 p = 0; p < R; p++) {
        const u32 n = bases[p * EL + e];
        bases[p * EL + e] = run;
        if (blockIdx.x == 0 && a.layout_range != 0) reinterpret_cast<i64*>(a.layout_range)[(u64)e * R + p] = (i64)(((u64)run << 32) | n);
        run += n;
      }
      if (blockIdx.x == 0) {
        reinterpret_cast<i32*>(a.recv_count)[e] = (i32)run;
        if (a.cum_stats != 0) reinterpret_cast<i32*>(a.cum_stats)[e] += (i32)run;
      }
    }
    if (blockIdx.x == 0) {
      for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
        const u32 end = p + 1 < R ? sm.msgs[p + 1] : total_msgs;
        reinterpret_cast<u32*>(a.hmeta)[2 * p] = end - sm.msgs[p];
        reinterpret_cast<u32*>(a.hmeta)[2 * p + 1] = sm.used[p];
      }
    }
    __syncthreads();

    // One item: one store of the chunk into recv_x[e][slot] per selected local expert; chunk 0 also the
    // scales, the handle rows, weights, token and destination index, and DeepEP's src_info.
    auto expand = [&](const Item& it, const Ahead& cur) {
      const u32 p = it.p, i = it.i, c = it.c;
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      const bool active = off < PAYLOAD_BYTES;
      const u32 entry = cur.entry;
      i32 row = -1;
      u32 el = LLI_NONE, slot = 0;
      if (entry != LLI_NONE) {
        el = (entry >> 16) - first_expert;  // other ranks' experts wrap past EL
        if (el < EL) {
          slot = bases[p * EL + el] + (entry & 0xffffu);
          if (slot < rows) row = (i32)(el * rows + slot);
        }
      }
      if (c == 0) {
        // j: this rank's index among the token's destination ranks, in ascending order.
        const u32 dest = entry != LLI_NONE ? (entry >> 16) / EL : LLI_NONE;
        bool firstd = dest != LLI_NONE;
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) {
          const u32 other = __shfl_sync(FULL_WARP_MASK, dest, j);
          if (j < lane && other == dest) firstd = false;
        }
        const u32 j = __popc(__ballot_sync(FULL_WARP_MASK, firstd && dest < me));
        const u64 h = (u64)p * TM + i;
        if (lane == 0) {
          reinterpret_cast<u32*>(a.htoken)[h] = cur.token;
          reinterpret_cast<u32*>(a.hj)[h] = j;
        }
        if (lane < LL_TOPK) {
          reinterpret_cast<i32*>(a.hrow)[h * LL_TOPK + lane] = row;
          if (has_weights) reinterpret_cast<u32*>(a.hweight)[h * LL_TOPK + lane] = cur.w;
          if (row >= 0 && a.src_info != 0) reinterpret_cast<i32*>(a.src_info)[(u64)el * rows + slot] = (i32)cur.token;
        }
      }
      const u32 valid = __ballot_sync(FULL_WARP_MASK, row >= 0);
      u8* recv_x = reinterpret_cast<u8*>(a.recv_x);
      for (u32 m = valid; m != 0; m &= m - 1) {
        const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
        if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(recv_x + (u64)r * PAYLOAD_BYTES + off), cur.v);
      }
#if LL_FP8
      if (c == 0 && valid != 0) store_row_scales(cur.scales, (a.flags & LL_FLAG_UE8M0) != 0, valid, row, rows, reinterpret_cast<u32*>(a.recv_scales));
#endif
    };
    for (u32 item = first_item; item < items; item += workers * LL_WARPS) {
      const Item it = next_it;
      const Ahead cur = next;
      next_it = item_of(item + workers * LL_WARPS);
      next = load_item(next_it);
      expand(it, cur);
    }
  }
  lli_recv_end(a, sm, expected, epoch, workers, d);
}

namespace moelink::internode_ll {
// moelink::internode_ll::dispatch: low-latency dispatch across nodes, send and/or receive phase.
//   grid: W worker blocks (+ the emulated NIC's, transport.cuh), LL_THREADS threads; cooperative when both
//         phases run in one launch.
//   SEND  every block waits until the destinations handed the set back; block 0 validates, keeps the
//         handle copies and puts every rank its meta block; the other blocks (block 0 when alone) send one
//         message per (token, destination), a token per block at a time, built by all its warps, each
//         counted by an ADD 1 on the destination's data word. The last block stores the epoch.
//   RECV  every block waits for every source (meta, then its messages) and scans the counts; work item
//         (message, 512-byte chunk) per warp: one 16-byte load, one store per selected local expert into
//         recv_x[e][slot] (slots in (source, token) order), scales column-major; chunk 0 writes the handle
//         and src_info. Block 0: recv_count, layout_range, statistics, report. The last block hands back.
//   DRAIN only the hand-back (a receive phase that will never run).
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch(const __grid_constant__ LliDispatchArgs a) {
  lli_run(
      a, PHASE_LL_DISPATCH,
      [&](const Deadline& d, LliShared& sm, u32 epoch, u32 workers) { lli_dispatch_send(a, d, sm, epoch, workers); },
      [&](const Deadline& d, LliShared& sm, u32 epoch, u32 workers) { lli_dispatch_recv(a, d, sm, epoch, workers); });
}
}  // namespace moelink::internode_ll
