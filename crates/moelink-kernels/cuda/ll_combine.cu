// moelink kernel family: low-latency combine (moelink_kernels::ll::LlVariant::combine_spec). What the LL
// families share (JIT constants, memory, flag protocol, the operation frame) is in ll.cuh; the kernel and
// its roles are described above its definition at the end of this file.
#include "ll.cuh"

// ============================================================================================ constants
constexpr u32 BF16_CHUNKS = (ROW_BYTES_BF16 + CHUNK_BYTES - 1) / CHUNK_BYTES;
// Combine loads at most this many expert rows before summing them (registers: 4 per row).
constexpr u32 K_BATCH = LL_TOPK < 8 ? LL_TOPK : 8;

// ============================================================================================ combine
// Block 0 of the send phase: checks this rank's combine inputs against its dispatch (handle area) and
// writes the metadata line (problems, whether this rank received the home rank's dispatch) to every rank.
__device__ __forceinline__ void combine_check(const LlCombineArgs& a, LlShared& sm) {
  const u32 T = a.num_tokens;
  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  if ((a.host_problem & LL_PROBLEM_HANDLE) == 0) {
    const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
    u32 problem = 0;
    for (u32 i = threadIdx.x; i < T * LL_TOPK; i += LL_THREADS) {
      if (ptx::ld_nc_u64(reinterpret_cast<const i64*>(a.topk_idx) + i) != ptx::ld_nc_u64(reinterpret_cast<const i64*>(a.home_idx) + i))
        problem |= LL_PROBLEM_TOPK_IDX_DIFFERS;
      if (has_weights &&
          ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.topk_weights) + i) != ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.home_weight) + i))
        problem |= LL_PROBLEM_WEIGHTS_DIFFER;
    }
    if (problem != 0) atomicOr(&sm.problem, problem);
  }
  __syncthreads();
  const u32 problem_all = sm.problem;
  if (threadIdx.x < a.num_ranks) {
    LlMeta* m = &ctrl_of(a.ctrl, threadIdx.x)->combine_meta[a.set][a.rank];
    ptx::st_na_u32(&m->num_tokens, T);
    ptx::st_na_u32(&m->problem, problem_all);
    ptx::st_na_u32(&m->accepted, reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x + 1]);
  }
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
}

// Rows back. Pre-reduced mode: one bf16 partial per (home, token): sum over this rank's selections of the
// token in ascending k, from +0.0, of f32(w) * f32(y) rounded to f32 before each add, into slot [me][token]
// of the home's region. Per-expert mode: each selection's row y into slot [token][k].
// Work: the (token, home) pairs in (token, home) order, homes starting after this rank (first_dest) so that
// neighbouring warps store to different homes, for the tokens below the largest count any home sent; each
// pair's row in BF16_CHUNKS 512-byte chunks (16 bytes a lane). A warp takes one contiguous run of chunks:
// it loads a pair's handle entries (row, weight) and ranks its selected rows once, then streams the chunks,
// CHUNKS of them with ROWS rows each in flight per batch. Per pair the rows' addresses and weights are
// fixed, so a batch is loads, adds and stores, with no per-chunk handle loads, ballots or compaction (when a
// round re-derived those for every chunk, the send spent most of its time issuing them).
// Returns whether this warp stored anything.
template <u32 CHUNKS, u32 ROWS>
__device__ __forceinline__ bool combine_rows(const LlCombineArgs& a, LlShared& sm, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 R = a.num_ranks, TM = a.max_tokens;
  const bool pre_reduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  constexpr bool local_stores = LL_LOCAL_STORES;
  constexpr bool loads = !LL_NO_LOADS;
  const u8* y_lane = reinterpret_cast<const u8*>(a.y) + lane * VEC_BYTES;
  const u32 dest0 = first_dest(a.rank, R);
  u32 tokens = 0;
  for (u32 h = 0; h < R; h++) tokens = sm.ntok[h] > tokens ? sm.ntok[h] : tokens;
  tokens = tokens < TM ? tokens : TM;
  const u32 total = R * tokens * BF16_CHUNKS;
  const u32 run = (total + num_warps - 1) / num_warps;
  const u32 begin = first_warp * run < total ? first_warp * run : total;
  const u32 end = total - begin < run ? total : begin + run;
  bool stored = false;
  for (u32 it = begin; it < end;) {
    const u32 st = it / BF16_CHUNKS;
    const u32 c0 = it - st * BF16_CHUNKS;
    const u32 c1 = end - it < BF16_CHUNKS - c0 ? c0 + (end - it) : BF16_CHUNKS;
    it += c1 - c0;
    const u32 hr = st % R + dest0;
    const u32 h = hr >= R ? hr - R : hr, t = st / R;
    if (t >= sm.ntok[h]) continue;
    i32 row = -1;
    float w = 0.0f;
    if (lane < LL_TOPK) {
      const u64 at = ((u64)h * TM + t) * LL_TOPK + lane;
      row = (i32)ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hrow) + at);
      if (pre_reduced) w = bits_f32(ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hweight) + at));
    }
    const u32 valid = __ballot_sync(FULL_WARP_MASK, row >= 0);
    if (valid == 0) continue;  // the home sent this token to no expert here
    stored = true;
    const u32 n = __popc(valid);
    // Lane q holds the q-th selected row in ascending k: its k, row and weight.
    u32 sel_k = 0;
    {
      u32 m = valid;
      for (u32 q = 0; m != 0; q++, m &= m - 1)
        if (lane == q) sel_k = __ffs(m) - 1;
    }
    const u32 sel_row = (u32)__shfl_sync(FULL_WARP_MASK, row, sel_k);
    const float sel_w = __shfl_sync(FULL_WARP_MASK, w, sel_k);
    // Rows qb..qb+ROWS-1 of the selection: source (this lane's 16 bytes of chunk 0), weight, k.
    auto gather = [&](u32 qb, const u8* (&src)[ROWS], float (&wq)[ROWS], u32 (&kq)[ROWS]) {
#pragma unroll
      for (u32 q = 0; q < ROWS; q++) {
        const u32 l = (qb + q) & (WARP_SIZE - 1);
        src[q] = y_lane + (u64)__shfl_sync(FULL_WARP_MASK, sel_row, l) * ROW_BYTES_BF16;
        wq[q] = __shfl_sync(FULL_WARP_MASK, sel_w, l);
        kq[q] = __shfl_sync(FULL_WARP_MASK, sel_k, l);
      }
    };
    const u8* src0[ROWS];
    float w0[ROWS];
    u32 k0[ROWS];
    gather(0, src0, w0, k0);
    u8* region = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : h]);
    // local_stores: the own region's slot [h][token] (distinct per home, like the real stores).
    u8* dst = region + lane * VEC_BYTES +
              (pre_reduced ? ((u64)(local_stores ? h : a.rank) * TM + t) * ROW_BYTES_BF16 : (u64)t * LL_TOPK * ROW_BYTES_BF16);
    for (u32 c = c0; c < c1; c += CHUNKS) {
      float acc[CHUNKS][8];
#pragma unroll
      for (u32 j = 0; j < CHUNKS; j++)
#pragma unroll
        for (u32 i = 0; i < 8; i++) acc[j][i] = 0.0f;
      for (u32 qb = 0; qb < n; qb += ROWS) {
        const u8* src[ROWS];
        float wq[ROWS];
        u32 kq[ROWS];
        if (qb == 0) {
#pragma unroll
          for (u32 q = 0; q < ROWS; q++) src[q] = src0[q], wq[q] = w0[q], kq[q] = k0[q];
        } else {
          gather(qb, src, wq, kq);
        }
        // Every load of the batch before any of its rows is used (a store right after its load would wait
        // out one round trip per row).
        u32x4 v[CHUNKS][ROWS];
#pragma unroll
        for (u32 j = 0; j < CHUNKS; j++) {
          const u32 off = (c + j) * CHUNK_BYTES;
#pragma unroll
          for (u32 q = 0; q < ROWS; q++) {
            v[j][q] = u32x4{0, 0, 0, 0};
            if (loads && qb + q < n && c + j < c1 && off + lane * VEC_BYTES < ROW_BYTES_BF16)
              v[j][q] = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(src[q] + off));
          }
        }
#pragma unroll
        for (u32 j = 0; j < CHUNKS; j++) {
          const u32 off = (c + j) * CHUNK_BYTES;
#pragma unroll
          for (u32 q = 0; q < ROWS; q++) {
            if (qb + q >= n || c + j >= c1) continue;
            if (pre_reduced) {
#pragma unroll
              for (u32 i = 0; i < 4; i++) {
                const u32 word = word_of(v[j][q], i);
                acc[j][2 * i] = ptx::add_rn_f32(acc[j][2 * i], ptx::mul_rn_f32(wq[q], bf16_lo(word)));
                acc[j][2 * i + 1] = ptx::add_rn_f32(acc[j][2 * i + 1], ptx::mul_rn_f32(wq[q], bf16_hi(word)));
              }
            } else if (off + lane * VEC_BYTES < ROW_BYTES_BF16) {
              ptx::st_na_v4(reinterpret_cast<u32x4*>(dst + (u64)kq[q] * ROW_BYTES_BF16 + off), v[j][q]);
            }
          }
        }
      }
      if (pre_reduced) {
#pragma unroll
        for (u32 j = 0; j < CHUNKS; j++) {
          const u32 off = (c + j) * CHUNK_BYTES;
          if (c + j >= c1 || off + lane * VEC_BYTES >= ROW_BYTES_BF16) continue;
          const u32x4 out = {ptx::cvt_rn_bf16x2_f32(acc[j][1], acc[j][0]), ptx::cvt_rn_bf16x2_f32(acc[j][3], acc[j][2]),
                             ptx::cvt_rn_bf16x2_f32(acc[j][5], acc[j][4]), ptx::cvt_rn_bf16x2_f32(acc[j][7], acc[j][6])};
          ptx::st_na_v4(reinterpret_cast<u32x4*>(dst + off), out);
        }
      }
    }
  }
  return stored;
}

__device__ __forceinline__ void combine_send(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  // Tokens per home rank, from this rank's own dispatch handle: loaded before the hand-back wait (whose
  // barriers publish them to the block), so that their latency hides behind it.
  if (threadIdx.x < a.num_ranks) sm.ntok[threadIdx.x] = reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x];
  ll_send_phase(a, d, sm, epoch, [&] { combine_check(a, sm); },
                [&](u32 first_warp, u32 num_warps) {
                  // ~K/R selected rows per pair: at 2 ranks 3 chunks x 4 rows in flight, else 4 x 2.
                  if (a.num_ranks <= 2) return combine_rows<3, (LL_TOPK < 4 ? LL_TOPK : 4)>(a, sm, first_warp, num_warps);
                  return combine_rows<4, (LL_TOPK < 2 ? LL_TOPK : 2)>(a, sm, first_warp, num_warps);
                });
}

// Warp 0 of every block waits for every expert rank r (lane r); r's rows are used when its flag arrived
// (shrink: decided so), r is not masked, r reported no problem and r received this rank's dispatch.
__device__ __forceinline__ void combine_wait_sources(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  const u32 lane = lane_id();
  if (threadIdx.x == 0) sm.abort = 0;
  __syncthreads();
  if (warp_id() == 0) {
    u32 problem = 0;
    u64 waited = 0;
    if (lane < a.num_ranks) {
      const SourceState s =
          ll_wait_source(me->combine_arrive[a.set][lane], epoch, epoch * LL_ARRIVE_UNIT, me->mask, me->decision[LL_KIND_COMBINE], lane, d, soft, sm);
      waited = s.waited_ns;
      bool used = false;
      if (s.used) {
        const LlMeta* m = &me->combine_meta[a.set][lane];
        problem = ptx::ld_cg_u32(&m->problem);
        used = problem == 0 && ptx::ld_cg_u32(&m->accepted) != 0;
      }
      sm.ok[lane] = used ? 1u : 0u;
    }
    if (blockIdx.x == 0) {
      if (lane < a.num_ranks && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[lane] += (i64)waited;
      const u32 bad = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && lane != a.rank && problem != 0);
      if (bad != 0 && lane == __ffs(bad) - 1) {
        LlReport* rep = reinterpret_cast<LlReport*>(a.report);
        ptx::st_relaxed_sys(&rep->peer_problem, problem);
        ptx::st_relaxed_sys(&rep->peer_problem_peer, lane + 1);
      }
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void combine_recv(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  const u32 R = a.num_ranks, TM = a.max_tokens, E = a.num_experts, EL = a.num_local_experts;
  const u32 lane = lane_id();
  const bool pre_reduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* region = reinterpret_cast<const u8*>(a.recv[a.rank]);
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32 items = a.num_tokens * BF16_CHUNKS;
  const u32 stride = gridDim.x * LL_WARPS;
  // The top-k ids (and weights) of an item are loaded one item ahead: the partials' loads depend on them,
  // two dependent round trips per item otherwise. They are this rank's own inputs, so the first item's are
  // loaded before the flag wait, whose latency they then share.
  auto load_ids = [&](u32 item, i64& e, u32& wbits) {
    e = -1;
    wbits = 0;
    const u32 t = item / BF16_CHUNKS;
    if (item < items && lane < LL_TOPK) {
      e = (i64)ptx::ld_nc_u64(idx + (u64)t * LL_TOPK + lane);
      if (!pre_reduced) wbits = ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.topk_weights) + (u64)t * LL_TOPK + lane);
    }
  };
  i64 e_next;
  u32 w_next;
  load_ids(blockIdx.x * LL_WARPS + warp_id(), e_next, w_next);
  combine_wait_sources(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_RECV_SEEN);
  if (sm.abort == 0) {
    for (u32 item = blockIdx.x * LL_WARPS + warp_id(); item < items; item += stride) {
      const u32 t = item / BF16_CHUNKS, c = item % BF16_CHUNKS;
      const i64 e = e_next;
      const u32 wbits = w_next;
      load_ids(item + stride, e_next, w_next);
      bool use = false;
      u32 r = 0;
      float w = 0.0f;
      if (lane < LL_TOPK) {
        if (e >= 0 && e < (i64)E) {
          r = (u32)e / EL;
          use = sm.ok[r] != 0;
        }
        w = bits_f32(wbits);
      }
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      const bool active = off < ROW_BYTES_BF16;
      float acc[8];
#pragma unroll
      for (u32 j = 0; j < 8; j++) acc[j] = 0.0f;
      if (pre_reduced) {
        // Partials of the ranks the token was sent to, in ascending rank order.
        const u32 hit = __reduce_or_sync(FULL_WARP_MASK, use ? 1u << r : 0u);
        u32x4 v[MAX_RANKS];
#pragma unroll
        for (u32 q = 0; q < MAX_RANKS; q++) {
          v[q] = u32x4{0, 0, 0, 0};
          if (((hit >> q) & 1u) && active) v[q] = ptx::ld_cg_v4(region + ((u64)q * TM + t) * ROW_BYTES_BF16 + off);
        }
#pragma unroll
        for (u32 q = 0; q < MAX_RANKS; q++) {
          if ((hit >> q) & 1u) {
#pragma unroll
            for (u32 i = 0; i < 4; i++) {
              const u32 word = word_of(v[q], i);
              acc[2 * i] = ptx::add_rn_f32(acc[2 * i], bf16_lo(word));
              acc[2 * i + 1] = ptx::add_rn_f32(acc[2 * i + 1], bf16_hi(word));
            }
          }
        }
      } else {
        // One row per selection, in ascending k, weighted with the combine-time weights.
        const u32 sel = __ballot_sync(FULL_WARP_MASK, use);
#pragma unroll
        for (u32 kb = 0; kb < LL_TOPK; kb += K_BATCH) {
          u32x4 v[K_BATCH];
#pragma unroll
          for (u32 j = 0; j < K_BATCH; j++) {
            const u32 k = kb + j;
            v[j] = u32x4{0, 0, 0, 0};
            if (k < LL_TOPK && ((sel >> k) & 1u) && active) v[j] = ptx::ld_cg_v4(region + ((u64)t * LL_TOPK + k) * ROW_BYTES_BF16 + off);
          }
#pragma unroll
          for (u32 j = 0; j < K_BATCH; j++) {
            const u32 k = kb + j;
            if (k < LL_TOPK && ((sel >> k) & 1u)) {
              const float wk = __shfl_sync(FULL_WARP_MASK, w, k);
#pragma unroll
              for (u32 i = 0; i < 4; i++) {
                const u32 word = word_of(v[j], i);
                acc[2 * i] = ptx::add_rn_f32(acc[2 * i], ptx::mul_rn_f32(wk, bf16_lo(word)));
                acc[2 * i + 1] = ptx::add_rn_f32(acc[2 * i + 1], ptx::mul_rn_f32(wk, bf16_hi(word)));
              }
            }
          }
        }
      }
      if (active) {
        const u32x4 o = {ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]), ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]), ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]),
                         ptx::cvt_rn_bf16x2_f32(acc[7], acc[6])};
        ptx::st_na_v4(reinterpret_cast<u32x4*>(reinterpret_cast<u8*>(a.out) + (u64)t * ROW_BYTES_BF16 + off), o);
      }
    }
  }
  ll_recv_end(a, sm, epoch);
}

namespace moelink::low_latency {
// moelink::low_latency::combine: low-latency combine, send and/or receive phase.
//   grid: G blocks (cooperative when both phases run in one launch), block: LL_THREADS.
//   SEND  every block waits (warp 0) until the home ranks consumed this set's previous use; block 0 checks
//         the combine-time topk_idx/weights against the dispatch's and writes the metadata lines; blocks
//         1..G-1 (block 0 too when G == 1): work item (home rank, token, 256-channel chunk) per warp, rows
//         from the handle area, loads of the expert outputs y (16 bytes per lane), pre-reduced sum or
//         per-expert copies, 16-byte stores into the home rank's combine region. Every block arrives at
//         every rank (ll_send_arrive); the last one stores combine_epoch = last_write[set] = e.
//   RECV  warp 0 of every block waits for every expert rank; work item (token, chunk) per warp: sum of the
//         partials in ascending rank order (pre-reduced) or of w * y in ascending k (per expert), from +0.0
//         in f32, one bf16 rounding, 16-byte store into out. Block 0: wait stats, report. Last block:
//         consumed flags to every expert rank.
//   DRAIN consumed flags only (a dropped hook).
//   reads:  y, topk_idx, topk_weights, handle area; own combine region; own LlCtrl.
//   writes: every home rank's combine region and LlCtrl flags/metadata (send); out, stats, LlReport (recv).
__global__ void __launch_bounds__(LL_THREADS, 1) combine(const __grid_constant__ LlCombineArgs a) {
  __shared__ LlShared sm;
  const u64 entered = ptx::globaltimer();
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_LL_COMBINE);
  if (!ll_enter(a, sm, entered)) return;
  const u32 epoch = sm.epoch;
  if (a.phases & LL_PHASE_SEND) combine_send(a, d, sm, epoch);
  if (a.phases & LL_PHASE_RECV) combine_recv(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_END);
}
}  // namespace moelink::low_latency
