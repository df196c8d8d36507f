// moelink kernel family: low-latency dispatch (moelink_kernels::ll::LlVariant::dispatch_spec). What the
// LL families share (JIT constants, memory, flag protocol, the operation frame) is in ll.cuh; the kernel
// and its roles are described above its definition at the end of this file.
#include "ll.cuh"

// ============================================================================================ helpers
// `ranks` (bits < num_ranks) rotated right by `by` (< num_ranks): bit i of the result is rank (i + by) mod R.
__device__ __forceinline__ u32 rotate_ranks(u32 ranks, u32 by, u32 num_ranks) {
  if (by == 0) return ranks;
  const u64 all = num_ranks >= 32 ? 0xffffffffull : ((1ull << num_ranks) - 1);
  return (u32)((((u64)ranks >> by) | ((u64)ranks << (num_ranks - by))) & all);
}

// ============================================================================================ dispatch: send
// Block 0 of the send phase: validates this rank's top-k rows (ids outside [-1, E), repeats), keeps its
// top-k ids/weights in the handle area (combine checks its inputs against them), writes each destination's
// counts (tokens per local expert: shared-memory atomics over the live selections, sm.words cleared by
// dispatch_send) into its receive region and the
// metadata line (tokens, problems, signature) into its control area. The per-token routing travels with
// the rows (dispatch_rows), so this block is never on the critical path (a block 0 that builds every
// destination's entries ends as late as the data, 10 us at 128 tokens, and is all of the critical path at
// 1-16 tokens: MOELINK_LL_TRACE, bench/results/2026-11-21-4xnvidia-h200-bf7279e).
__device__ __forceinline__ void dispatch_check(const LlDispatchArgs& a, LlShared& sm) {
  const u32 T = a.num_tokens, E = a.num_experts, R = a.num_ranks;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const float* wts = reinterpret_cast<const float*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;

  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  u32 problem = 0;
  for (u32 t = threadIdx.x; t < T; t += LL_THREADS) {
    i64 ids[LL_TOPK];
    bool live[LL_TOPK];
    problem |= load_topk_row(idx + (u64)t * LL_TOPK, E, ids, live);
    u32 w[LL_TOPK];
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) w[k] = has_weights ? ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + k) : 0u;
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      reinterpret_cast<i64*>(a.home_idx)[(u64)t * LL_TOPK + k] = ids[k];
      if (has_weights) reinterpret_cast<u32*>(a.home_weight)[(u64)t * LL_TOPK + k] = w[k];
      if (live[k]) atomicAdd(&sm.words[(u32)ids[k]], 1u);
    }
  }
  if (problem != 0) atomicOr(&sm.problem, problem);
  __syncthreads();
  // Counts: expert e = d * E_local + el goes to counts [me][el] of rank d (local_stores: the own region's
  // counts [d][el]).
  constexpr bool local_stores = LL_LOCAL_STORES;
  const u32 EL = a.num_local_experts;
  for (u32 e = threadIdx.x; e < E; e += LL_THREADS) {
    const u32 n = sm.words[e];
    const u32 dest = e / EL, el = e % EL;
    u8* region = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : dest]);
    ptx::st_na_u32(region + a.off_counts + ((u64)(local_stores ? dest : a.rank) * EL + el) * 4, n);
  }
  __syncthreads();
  ll_trace(sm, LL_TRACE_INDEX_CHECKED);

  const u32 problem_all = sm.problem;
  if (threadIdx.x < R) {
    LlMeta* m = &ctrl_of(a.ctrl, threadIdx.x)->dispatch_meta[a.set][a.rank];
    ptx::st_na_u32(&m->num_tokens, T);
    ptx::st_na_u32(&m->problem, problem_all);
#pragma unroll
    for (u32 i = 0; i < LL_SIG_WORDS; i++) ptx::st_na_u32(&m->sig[i], a.sig[i]);
  }
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
}

// A token's routing, stored with its chunk-0 item into every rank (routed there or not, so that every slot
// t < num_tokens of this source holds this call's): lane k < K writes, if the token's k-th id is live (in
// [0, E), `id`, and not an earlier slot's id), id << 16 | the token's rank among this rank's tokens that
// selected that expert, else ~0, into entries [me][t][k], and its weight bits into weights [me][t][k].
// With the source's counts (dispatch_check) the receiver places the row without looking at any other
// token (dispatch_recv). The rank is counted here, by the warp, over the earlier rows (`first`: rows 0 ..
// 32 RANK_ROWS - 1, loaded with the item's payload; later passes load their own): no shared state, so no
// block-wide step between the hand-back wait and the first stores (sender-side bitmaps built during that
// wait delay every block's stores by 0.8 us at 128 tokens on 4xH200; the A/B is in commit a40da02's message).
__device__ __forceinline__ void dispatch_routing(const LlDispatchArgs& a, u32 t, u32 id, u32 wbits, bool local_stores, const PriorRows& first) {
  const u32 lane = lane_id();
  bool live = id != 0xffffffffu;
#pragma unroll
  for (u32 j = 0; j < LL_TOPK; j++) {
    const u32 other = __shfl_sync(FULL_WARP_MASK, id, j);
    if (j < lane && other == id) live = false;
  }
  u32 rank = 0;
  add_rows_with_id(id, first, rank);
  for (u32 base = RANK_ROWS * WARP_SIZE; base < t; base += RANK_ROWS * WARP_SIZE) add_rows_with_id(id, load_prior_rows(a.topk_idx, t, base), rank);
  if (lane >= LL_TOPK) return;
  const u32 entry = live ? (id << 16) | rank : 0xffffffffu;
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u32 dest0 = first_dest(a.rank, a.num_ranks);
  for (u32 i = 0; i < a.num_ranks; i++) {
    const u32 p = dest0 + i >= a.num_ranks ? dest0 + i - a.num_ranks : dest0 + i;
    u8* region = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]);
    const u64 at = ((u64)(local_stores ? p : a.rank) * a.max_tokens + t) * LL_TOPK * 4 + lane * 4;
    ptx::st_na_u32(region + a.off_entries + at, entry);
    if (has_weights) ptx::st_na_u32(region + a.off_weights + at, wbits);
  }
}

// Rows: work item = (token, 512-byte chunk of its payload), dealt over the data warps. The warp finds the
// token's destination ranks from its top-k ids (valid ids only; each rank once), quantises the chunk once
// (FP8) and stores it into slot [me][token] of every destination (16 bytes per lane; FP8 scale_inv as 4
// bytes per 128-channel group after the payload); the chunk-0 item then also stores the token's routing
// (dispatch_routing; the earlier rows it counts are loaded with the payload).
// Returns whether this warp stored anything.
__device__ __forceinline__ bool dispatch_rows(const LlDispatchArgs& a, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 E = a.num_experts, EL = a.num_local_experts;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  const u32 items = a.num_tokens * SEND_CHUNKS;
  bool stored = false;
  constexpr bool local_stores = LL_LOCAL_STORES;
  constexpr bool loads = !LL_NO_LOADS;
  const u32 dest0 = first_dest(a.rank, a.num_ranks);
  for (u32 item = first_warp; item < items; item += num_warps) {
    const u32 t = item / SEND_CHUNKS, c = item % SEND_CHUNKS;
    // The row chunk is loaded together with the top-k ids (independent loads in flight at once).
    PriorRows prior;
    if (c == 0) prior = load_prior_rows(a.topk_idx, t, 0);
#if LL_FP8
    const u32 ch = c * FP8_CHUNK_CHANNELS + lane * FP8_LANE_CHANNELS;
    const bool active = ch < LL_HIDDEN;
    u32x4 v0 = {0, 0, 0, 0}, v1 = {0, 0, 0, 0};
    if (active && loads) {
      const u32x4* src = reinterpret_cast<const u32x4*>(x + ((u64)t * LL_HIDDEN + ch) * 2);
      v0 = ptx::ld_nc_na_v4(src);
      v1 = ptx::ld_nc_na_v4(src + 1);
    }
#else
    const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
    const bool active = off < PAYLOAD_BYTES;
    u32x4 v = {0, 0, 0, 0};
    if (active && loads) v = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(x + (u64)t * ROW_BYTES_BF16 + off));
#endif
    u32 ranks = 0, id = 0xffffffffu, wbits = 0;
    if (lane < LL_TOPK) {
      const i64 e = (i64)ptx::ld_nc_u64(idx + (u64)t * LL_TOPK + lane);
      if (c == 0 && has_weights) wbits = ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + lane);
      if (e >= 0 && e < (i64)E) {
        ranks = 1u << ((u32)e / EL);
        id = (u32)e;
      }
    }
    ranks = __reduce_or_sync(FULL_WARP_MASK, ranks);
    if (c == 0) stored = true;  // the routing, below
    if (ranks != 0) stored = true;
    // local_stores: into the own region's slot [p][token] (distinct per destination, like the real stores).
    auto slot_of = [&](u32 p) { return a.off_rows + ((u64)(local_stores ? p : a.rank) * a.max_tokens + t) * a.row_stride; };
#if LL_FP8
    float scale_inv;
    const u32x4 q = quantize16(v0, v1, (a.flags & LL_FLAG_ROUND_SCALE) != 0, scale_inv);
    for (u32 rot = rotate_ranks(ranks, dest0, a.num_ranks); rot != 0; rot &= rot - 1) {
      const u32 i = __ffs(rot) - 1 + dest0;
      const u32 p = i >= a.num_ranks ? i - a.num_ranks : i;
      u8* row = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]) + slot_of(p);
      if (active) {
        ptx::st_na_v4(reinterpret_cast<u32x4*>(row + ch), q);
        if (lane % FP8_GROUP_LANES == 0) ptx::st_na_u32(row + LL_HIDDEN + (ch / FP8_GROUP) * 4, f32_bits(scale_inv));
      }
    }
#else
    for (u32 rot = rotate_ranks(ranks, dest0, a.num_ranks); rot != 0; rot &= rot - 1) {
      const u32 i = __ffs(rot) - 1 + dest0;
      const u32 p = i >= a.num_ranks ? i - a.num_ranks : i;
      if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]) + slot_of(p) + off), v);
    }
#endif
    if (c == 0) dispatch_routing(a, t, id, wbits, local_stores, prior);
  }
  return stored;
}

__device__ __forceinline__ void dispatch_send(const LlDispatchArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  // The check block's top-k rows are sent towards L2 before the hand-back wait, whose round trips (~1 us)
  // they then overlap; not by warp 0 (its lanes poll the hand-back words, whose loads would queue behind the
  // prefetches). The data warps do not prefetch: a prefetch per lane of their first row chunk lengthens the
  // wait (~1.9 us instead of ~1.0 at EP4) and brings their stores no earlier.
  if (blockIdx.x == 0) {
    for (u32 e = threadIdx.x; e < a.num_experts; e += LL_THREADS) sm.words[e] = 0;  // dispatch_check's counts
    if (warp_id() != 0) {
      for (u32 t = threadIdx.x - WARP_SIZE; t < a.num_tokens; t += LL_THREADS - WARP_SIZE)
        ptx::prefetch_l2(reinterpret_cast<const i64*>(a.topk_idx) + (u64)t * LL_TOPK);
    }
  }
  ll_send_phase(a, d, sm, epoch, [&] { dispatch_check(a, sm); },
                [&](u32 first_warp, u32 num_warps) { return dispatch_rows(a, first_warp, num_warps); });
}

// ============================================================================================ dispatch: receive
// A source's metadata line, as warp 0's lane p holds it.
struct SourceMeta {
  u32 sig[LL_SIG_WORDS];
  u32 problem;
  u32 num_tokens;
};

// Every word is loaded before any is used: independent loads in flight together.
__device__ __forceinline__ SourceMeta load_source_meta(const LlMeta* m) {
  SourceMeta meta;
#pragma unroll
  for (u32 i = 0; i < LL_SIG_WORDS; i++) meta.sig[i] = ptx::ld_cg_u32(&m->sig[i]);
  meta.problem = ptx::ld_cg_u32(&m->problem);
  meta.num_tokens = ptx::ld_cg_u32(&m->num_tokens);
  return meta;
}

// Warp 0, once every source is resolved (lane p: `source`, its metadata `meta`): a source seen is used when
// its call signature equals ours and it reported no argument problem (sm.ok, sm.ntok). Block 0 records the
// wait times and reports mismatches/problems (lowest peer).
__device__ __forceinline__ void dispatch_check_sources(const LlDispatchArgs& a, LlShared& sm, const SourceState& source, const SourceMeta& meta) {
  const u32 lane = lane_id();
  const bool seen = lane < a.num_ranks && source.used;
  u32 mismatch_field = LL_SIG_WORDS;
  if (seen) {
#pragma unroll
    for (u32 i = LL_SIG_WORDS; i-- > 0;)
      if (meta.sig[i] != a.sig[i]) mismatch_field = i;
  }
  const u32 problem = seen ? meta.problem : 0u;
  const bool used = seen && mismatch_field == LL_SIG_WORDS && problem == 0;
  if (lane < a.num_ranks) {
    sm.ok[lane] = used ? 1u : 0u;
    sm.ntok[lane] = used ? (meta.num_tokens < a.max_tokens ? meta.num_tokens : a.max_tokens) : 0u;
  }
  if (blockIdx.x == 0) {
    if (lane < a.num_ranks && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[lane] += (i64)source.waited_ns;
    LlReport* rep = reinterpret_cast<LlReport*>(a.report);
    const u32 mism = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && mismatch_field != LL_SIG_WORDS);
    if (mism != 0 && lane == __ffs(mism) - 1) {
      const LlMeta* m = &ctrl_of(a.ctrl, a.rank)->dispatch_meta[a.set][lane];
      ptx::st_relaxed_sys_u64(&rep->mismatch_ours, a.sig[mismatch_field]);
      ptx::st_relaxed_sys_u64(&rep->mismatch_theirs, ptx::ld_cg_u32(&m->sig[mismatch_field]));
      ptx::st_relaxed_sys(&rep->mismatch_field, mismatch_field);
      ptx::st_relaxed_sys(&rep->mismatch_peer, lane + 1);
    }
    const u32 bad = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && lane != a.rank && problem != 0);
    if (bad != 0 && lane == __ffs(bad) - 1) {
      ptx::st_relaxed_sys(&rep->peer_problem, problem);
      ptx::st_relaxed_sys(&rep->peer_problem_peer, lane + 1);
    }
  }
}

__device__ __forceinline__ void dispatch_recv(const LlDispatchArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  const u32 R = a.num_ranks, EL = a.num_local_experts, TM = a.max_tokens;
  const u32 rows = R * TM;
  const u8* region = reinterpret_cast<const u8*>(a.recv[a.rank]);
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const u32 lane = lane_id();
  // Placement: the slot of (source p, token t) in expert el's rows is the tokens of el from the used
  // sources before p (bases, from the counts each source's block 0 wrote) plus t's rank among p's tokens of
  // el (in its entry): rows in (source, token) order, no atomics, nothing rebuilt here (rebuilding per-source
  // token bitmaps from all received ids takes every block 1.7-1.9 us after the flags at EP4, 128 tokens:
  // bench/results/2026-11-21-4xnvidia-h200-0a5e7b6).
  const u32 first_expert = a.rank * EL;
  u32* bases = sm.words;  // [R][EL]: first each pair's count, then its base
  const u32* counts = reinterpret_cast<const u32*>(region + a.off_counts);

  // Nothing before the flags: loads or stores on this GPU while the peers' rows land (the counts read early,
  // the own rows expanded first) make every peer's flag visible ~1 us later
  // (bench/results/2026-11-30-2xnvidia-h200-15bc694-ll-receive).
  SourceState source = {false, 0};
  if (warp_id() == 0) {
    if (lane == 0) sm.abort = 0;
    __syncwarp();
    if (lane < R) {
      u64 no_status;
      source = ll_wait_source(me->dispatch_arrive[a.set][lane], nullptr, no_status, epoch, epoch * LL_ARRIVE_UNIT, me->mask,
                              me->decision[LL_KIND_DISPATCH], lane, d, (a.flags & LL_FLAG_SHRINK) != 0, sm, lane == a.rank);
    }
  }
  __syncthreads();
  ll_trace(sm, LL_TRACE_RECV_SEEN);
  if (sm.abort != 0) {
    ll_recv_end(a, sm, epoch);
    return;
  }

  // Expansion: work item = (source, token, 512-byte chunk), dealt over every warp of the grid, one item's
  // payload chunk, entry and weight loaded one item ahead, so that a warp's items (~1.7 per warp at 128
  // tokens x 2 ranks) are not a chain of L2 round trips: the next item's loads fly during this one's stores.
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u32 stride = gridDim.x * LL_WARPS;
  const u32 items = R * TM * RECV_CHUNKS;
  struct Item {
    u32 p, t, c;
  };
  struct Ahead {
    u32x4 v;
    u32 entry;
    u32 w;
#if LL_FP8
    RowScales scales;  // chunk 0
#endif
  };
  auto item_of = [&](u32 i) {
    const u32 c = i % RECV_CHUNKS, st = i / RECV_CHUNKS;
    return Item{st / TM, st % TM, c};
  };
  // `checked`: only items of a used source below its token count are loaded (the others come back empty).
  auto load_item = [&](u32 i, bool checked) {
    Ahead l = {u32x4{0, 0, 0, 0}, 0xffffffffu, 0};
    const Item it = item_of(i);
    if (i >= items || (checked && (sm.ok[it.p] == 0 || it.t >= sm.ntok[it.p]))) return l;
    const u8* msg = region + a.off_rows + ((u64)it.p * TM + it.t) * a.row_stride;
    const u32 off = it.c * CHUNK_BYTES + lane * VEC_BYTES;
    if (off < PAYLOAD_BYTES) l.v = ptx::ld_cg_v4(msg + off);
    if (lane < LL_TOPK) {
      const u64 at = (((u64)it.p * TM + it.t) * LL_TOPK + lane) * 4;
      l.entry = ptx::ld_cg_u32(region + a.off_entries + at);
      if (it.c == 0 && has_weights) l.w = ptx::ld_cg_u32(region + a.off_weights + at);
    }
#if LL_FP8
    if (it.c == 0) load_row_scales(msg + LL_HIDDEN, (a.flags & LL_FLAG_UE8M0) != 0, l.scales);
#endif
    return l;
  };
  // One item: one store of the chunk into recv_x[e][base + rank] per selected local expert; chunk 0 also the
  // scales, the handle rows and weights and DeepEP's src_info.
  auto expand = [&](const Item& it, const Ahead& cur) {
    const u32 p = it.p, t = it.t, c = it.c;
    if (sm.ok[p] == 0 || t >= sm.ntok[p]) return;
    const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
    const bool active = off < PAYLOAD_BYTES;
    const u32x4 v = cur.v;
    const u64 entry_at = ((u64)p * TM + t) * LL_TOPK + lane;
    i32 row = -1;
    if (lane < LL_TOPK) {
      const u32 el = (cur.entry >> 16) - first_expert;  // other ranks' experts wrap past EL
      if (cur.entry != 0xffffffffu && el < EL) {
        const u32 slot = bases[p * EL + el] + (cur.entry & 0xffffu);
        if (slot < rows) row = (i32)(el * rows + slot);
      }
      if (c == 0) {
        reinterpret_cast<i32*>(a.hrow)[entry_at] = row;
        if (has_weights) reinterpret_cast<u32*>(a.hweight)[entry_at] = cur.w;
        // DeepEP's src_info [E_local][R*T_max] is indexed like the rows: the row's source token.
        if (row >= 0 && a.src_info != 0) reinterpret_cast<i32*>(a.src_info)[row] = (i32)t;
      }
    }
    const u32 valid = __ballot_sync(FULL_WARP_MASK, row >= 0);
    if (valid == 0) return;
    u8* recv_x = reinterpret_cast<u8*>(a.recv_x);
    for (u32 m = valid; m != 0; m &= m - 1) {
      const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
      if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(recv_x + (u64)r * PAYLOAD_BYTES + off), v);
    }
#if LL_FP8
    // Scales with the chunk-0 item of the row.
    if (c == 0) store_row_scales(cur.scales, (a.flags & LL_FLAG_UE8M0) != 0, valid, row, rows, reinterpret_cast<u32*>(a.recv_scales));
#endif
  };

  // After the flags, one round trip brings what the expansion needs first: every warp's first item
  // (whichever source it belongs to: an item of a source found unused is skipped, its values unused), the
  // counts, and warp 0's metadata lines (loaded before the counts, checked after).
  const u32 first_item = first_item_of_warp(gridDim.x);
  Ahead next = load_item(first_item, false);
  SourceMeta meta = {};
  if (warp_id() == 0 && lane < R && source.used) meta = load_source_meta(&me->dispatch_meta[a.set][lane]);
  for (u32 pe = threadIdx.x; pe < R * EL; pe += LL_THREADS) bases[pe] = ptx::ld_cg_u32(counts + pe);
  if (warp_id() == 0) dispatch_check_sources(a, sm, source, meta);
  __syncthreads();
  // Each expert's exclusive scan over the used sources; block 0 also writes DeepEP's layout_range from it
  // (a source not used, e.g. masked, counts 0).
  i64* layout_range = blockIdx.x == 0 ? reinterpret_cast<i64*>(a.layout_range) : nullptr;
  for (u32 e = threadIdx.x; e < EL; e += LL_THREADS) {
    u32 run = 0;
    for (u32 p = 0; p < R; p++) {
      const u32 n = sm.ok[p] != 0 ? bases[p * EL + e] : 0u;
      bases[p * EL + e] = run;
      if (layout_range != nullptr) layout_range[(u64)e * R + p] = (i64)(((u64)run << 32) | n);
      run += n;
    }
    if (blockIdx.x == 0) {
      reinterpret_cast<i32*>(a.recv_count)[e] = (i32)run;
      if (a.cum_stats != 0) reinterpret_cast<i32*>(a.cum_stats)[e] += (i32)run;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < R) {
    reinterpret_cast<u32*>(a.hmeta)[2 * threadIdx.x] = sm.ntok[threadIdx.x];
    reinterpret_cast<u32*>(a.hmeta)[2 * threadIdx.x + 1] = sm.ok[threadIdx.x];
  }
  __syncthreads();
  ll_trace(sm, LL_TRACE_RECV_INDEXED);

  for (u32 i = first_item; i < items; i += stride) {
    const Ahead cur = next;
    next = load_item(i + stride, true);
    expand(item_of(i), cur);
  }

  ll_recv_end(a, sm, epoch);
}

namespace moelink::low_latency {
// moelink::low_latency::dispatch: low-latency dispatch, send and/or receive phase.
//   grid: G blocks (one per SM; cooperative when both phases run in one launch), block: LL_THREADS.
//   SEND  roles: every block first waits (warp 0) until the destinations consumed this set's previous use;
//         block 0 = checks (dispatch_check: top-k validation, handle copies, counts and metadata lines);
//         blocks 1..G-1 (block 0 too when G == 1) = rows: work item (token, 512-byte chunk) per warp, FP8
//         quantisation in registers, 16-byte stores into every destination rank's slot [me][token]; chunk 0
//         then stores the token's entries (expert id, rank counted over the earlier rows) and weights into
//         every rank (dispatch_routing).
//         Every block then arrives at every rank (ll_send_arrive); the last one stores dispatch_epoch =
//         last_write[set] = e.
//   RECV  warp 0 of every block waits for every source's arrivals (deadline) and checks its metadata; every
//         block scans the received counts into bases per (source, local expert) in shared memory; work item
//         (source, token, chunk) per warp:
//         one 16-byte load, one store per selected local expert into recv_x[e][slot] (slots in (source,
//         token) order: base + the token's rank among the source's tokens of e), scales column-major,
//         handle rows/weights and DeepEP's src_info (chunk 0); block 0: recv_count, cumulative stats, wait
//         stats, DeepEP's layout_range, handle metadata, report.
//         Every block, once past its reads: its share of the hand-back to every source (ll_recv_end).
//   DRAIN a receive phase that will never run (its hook was dropped): only the consumed flags.
//   reads:  x, topk_idx, topk_weights; own receive region of the set; own LlCtrl.
//   writes: every rank's receive region of the set (send) and LlCtrl flags/metadata; recv_x, recv_scales,
//           recv_count, stats, src_info, layout_range, handle area (recv); LlReport; error record on timeout.
__global__ void __launch_bounds__(LL_THREADS, 1) dispatch(const __grid_constant__ LlDispatchArgs a) {
  __shared__ LlShared sm;
  const u64 entered = ptx::globaltimer();
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_LL_DISPATCH);
  if (!ll_enter(a, sm, entered)) return;
  const u32 epoch = sm.epoch;
  if (a.phases & LL_PHASE_SEND) dispatch_send(a, d, sm, epoch);
  if (a.phases & LL_PHASE_RECV) dispatch_recv(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_END);
}
}  // namespace moelink::low_latency
