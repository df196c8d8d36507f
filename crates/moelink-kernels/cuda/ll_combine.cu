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
// writes its status word (problems, whether this rank received the home rank's dispatch) to every rank.
__device__ __forceinline__ void combine_check(const LlCombineArgs& a, LlShared& sm, u32 epoch) {
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
    const bool accepted = reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x + 1] != 0;
    ptx::st_relaxed_sys_u64(&m->status, ll_combine_status(epoch, problem_all, accepted));
  }
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
}

// Rows back: work item = (token, home rank, 512-byte chunk = 256 channels). Pre-reduced mode: one bf16
// partial per (home, token): sum over this rank's selections of the token in ascending k, from +0.0, of
// f32(w) * f32(y) rounded to f32 before each add, into slot [me][token] of the home's region. Per-expert
// mode: each selection's row y into slot [token][k].
// A warp takes items first_warp + i * num_warps, COMBINE_ITEMS of them per round with every expert-row load
// of the round in flight together: an item has only ~K/R rows here, so one item per round left each warp a
// chain of dependent HBM round trips (~7 items per warp at 128 tokens, the combine send's largest cost;
// with two items per round the send still takes ~11 us without NVLink: MOELINK_LL_EXPERIMENT=local_stores,
// bench/results/2026-11-21-4xnvidia-h200-ll-trace).
// COMBINE_ROWS expert rows of each item are loaded per batch (both modes), and a round takes as many batches
// as its fullest item needs. An item has ~K/R rows: with top-8 over 4 ranks ~2, which 3 items x 4 rows cover
// in one batch; over 2 ranks ~4, and 3 x 4 then needs a second batch in most rounds (any item over 4), where
// 2 items x 6 rows rarely do. Both shapes hold the same registers. Per expert at one or two ranks, one item
// and all its rows (up to 8) a round: it takes 1.4 us less than 2 x 6 at 128 tokens, where 3 x 4 and 4 x 4
// take 2 us more (bench/results/2026-11-30-2xnvidia-h200-6376730-ll-expert-batch). Returns whether this warp
// stored anything.
template <u32 COMBINE_ITEMS, u32 COMBINE_ROWS>
__device__ __forceinline__ bool combine_rows(const LlCombineArgs& a, LlShared& sm, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 R = a.num_ranks, TM = a.max_tokens;
  const bool pre_reduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* y = reinterpret_cast<const u8*>(a.y);
  const u32 items = R * TM * BF16_CHUNKS;
  bool stored = false;
  constexpr bool local_stores = LL_LOCAL_STORES;
  constexpr bool loads = !LL_NO_LOADS;
  // Rows in (token, home) order, homes starting after this rank (first_dest): consecutive items, and so
  // every wave of stores, spread over all homes instead of filling one home's region after the other.
  const u32 dest0 = first_dest(a.rank, R);
  auto home_of = [&](u32 st) {
    const u32 h = st % R + dest0;
    return h >= R ? h - R : h;
  };
  // The handle entries (row, weight) of an item are loaded one round ahead: the expert rows' loads depend on
  // them, so loading them at the top of each item put two dependent round trips on every item's path.
  auto load_entry = [&](u32 it, i32& row, float& w) {
    row = -1;
    w = 0.0f;
    const u32 st = it / BF16_CHUNKS, h = home_of(st), t = st / R;
    if (it < items && lane < LL_TOPK && t < sm.ntok[h]) {
      const u64 at = ((u64)h * TM + t) * LL_TOPK + lane;
      row = (i32)ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hrow) + at);
      if (pre_reduced) w = bits_f32(ptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hweight) + at));
    }
  };
  i32 row_ahead[COMBINE_ITEMS];
  float w_ahead[COMBINE_ITEMS];
#pragma unroll
  for (u32 j = 0; j < COMBINE_ITEMS; j++) load_entry(first_warp + j * num_warps, row_ahead[j], w_ahead[j]);
  for (u32 base = first_warp; base < items; base += COMBINE_ITEMS * num_warps) {
    i32 row[COMBINE_ITEMS];
    float w[COMBINE_ITEMS];
    u32 valid[COMBINE_ITEMS];
    u32 off[COMBINE_ITEMS];
    u8* dst[COMBINE_ITEMS];
#pragma unroll
    for (u32 j = 0; j < COMBINE_ITEMS; j++) {
      row[j] = row_ahead[j];
      w[j] = w_ahead[j];
      load_entry(base + (COMBINE_ITEMS + j) * num_warps, row_ahead[j], w_ahead[j]);
      // load_entry gives row -1 to items past the end and to tokens the home did not send: valid == 0.
      const u32 item = base + j * num_warps;
      const u32 c = item % BF16_CHUNKS, st = item / BF16_CHUNKS;
      const u32 h = home_of(st), t = st / R;
      valid[j] = __ballot_sync(FULL_WARP_MASK, row[j] >= 0);
      off[j] = c * CHUNK_BYTES + lane * VEC_BYTES;
      u8* region = item < items ? reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : h]) : nullptr;
      // local_stores: the own region's slot [h][token] (distinct per home, like the real stores).
      dst[j] = region == nullptr ? nullptr
                                 : region + (pre_reduced ? ((u64)(local_stores ? h : a.rank) * TM + t) * ROW_BYTES_BF16
                                                         : (u64)t * LL_TOPK * ROW_BYTES_BF16);
      if (valid[j] != 0) stored = true;
    }
    // Pre-reduced: the sums start from +0.0. Per expert: acc stays unused.
    float acc[COMBINE_ITEMS][8];
#pragma unroll
    for (u32 j = 0; j < COMBINE_ITEMS; j++)
#pragma unroll
      for (u32 i = 0; i < 8; i++) acc[j][i] = 0.0f;
    // The selected rows of each item, compacted (the q-th row is the q-th set bit of valid, ascending k):
    // ~K/R of them per item, so one batch of COMBINE_ROWS loads covers nearly every item and the registers
    // go to more items in flight rather than to empty slots of K. Every load of a batch is issued before
    // any of its rows is used: per expert too, where a store right after each load would wait out one
    // round trip per row.
    u32 most = 0;
#pragma unroll
    for (u32 j = 0; j < COMBINE_ITEMS; j++) most = (u32)__popc(valid[j]) > most ? (u32)__popc(valid[j]) : most;
    for (u32 qb = 0; qb < most; qb += COMBINE_ROWS) {
      u32x4 v[COMBINE_ITEMS][COMBINE_ROWS];
      u32 kq[COMBINE_ITEMS][COMBINE_ROWS];  // k of each loaded row, WARP_SIZE when none
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) {
        u32 m = valid[j];
        for (u32 i = 0; i < qb && m != 0; i++) m &= m - 1;
#pragma unroll
        for (u32 q = 0; q < COMBINE_ROWS; q++) {
          v[j][q] = u32x4{0, 0, 0, 0};
          kq[j][q] = WARP_SIZE;
          if (m != 0) {
            const u32 k = __ffs(m) - 1;
            m &= m - 1;
            kq[j][q] = k;
            const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row[j], k);
            if (off[j] < ROW_BYTES_BF16 && loads) v[j][q] = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)r * ROW_BYTES_BF16 + off[j]));
          }
        }
      }
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) {
#pragma unroll
        for (u32 q = 0; q < COMBINE_ROWS; q++) {
          if (kq[j][q] >= WARP_SIZE) continue;
          if (pre_reduced) {
            const float wk = __shfl_sync(FULL_WARP_MASK, w[j], kq[j][q]);
#pragma unroll
            for (u32 i = 0; i < 4; i++) {
              const u32 word = word_of(v[j][q], i);
              acc[j][2 * i] = ptx::add_rn_f32(acc[j][2 * i], ptx::mul_rn_f32(wk, bf16_lo(word)));
              acc[j][2 * i + 1] = ptx::add_rn_f32(acc[j][2 * i + 1], ptx::mul_rn_f32(wk, bf16_hi(word)));
            }
          } else if (off[j] < ROW_BYTES_BF16) {
            ptx::st_na_v4(reinterpret_cast<u32x4*>(dst[j] + (u64)kq[j][q] * ROW_BYTES_BF16 + off[j]), v[j][q]);
          }
        }
      }
    }
    if (pre_reduced) {
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) {
        if (valid[j] == 0 || off[j] >= ROW_BYTES_BF16) continue;
        const u32x4 out = {ptx::cvt_rn_bf16x2_f32(acc[j][1], acc[j][0]), ptx::cvt_rn_bf16x2_f32(acc[j][3], acc[j][2]),
                           ptx::cvt_rn_bf16x2_f32(acc[j][5], acc[j][4]), ptx::cvt_rn_bf16x2_f32(acc[j][7], acc[j][6])};
        ptx::st_na_v4(reinterpret_cast<u32x4*>(dst[j] + off[j]), out);
      }
    }
  }
  return stored;
}

__device__ __forceinline__ void combine_send(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  // Tokens per home rank, from this rank's own dispatch handle: loaded before the hand-back wait (whose
  // barriers publish them to the block), so that their latency hides behind it.
  if (threadIdx.x < a.num_ranks) sm.ntok[threadIdx.x] = reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x];
  ll_send_phase(a, d, sm, epoch, [&] { combine_check(a, sm, epoch); },
                [&](u32 first_warp, u32 num_warps) {
                  if (a.num_ranks <= 2) {
                    if ((a.flags & LL_FLAG_WEIGHTS) == 0) return combine_rows<1, (LL_TOPK < 8 ? LL_TOPK : 8)>(a, sm, first_warp, num_warps);
                    return combine_rows<2, (LL_TOPK < 6 ? LL_TOPK : 6)>(a, sm, first_warp, num_warps);
                  }
                  return combine_rows<3, (LL_TOPK < 4 ? LL_TOPK : 4)>(a, sm, first_warp, num_warps);
                });
}

// Warp 0 of every block waits for every expert rank r (lane r); r's rows are used when its flag arrived
// (shrink: decided so), r is not masked, r reported no problem and r received this rank's dispatch (its
// status word, read in the same polls as its arrivals: no round trip after the flag).
__device__ __forceinline__ void combine_wait_sources(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  const u32 lane = lane_id();
  if (warp_id() == 0) {
    // Only warp 0 writes sm.abort before the barrier below, and every read of it in the send phase came
    // before that phase's last barrier.
    if (lane == 0) sm.abort = 0;
    __syncwarp();
    u32 problem = 0;
    u64 waited = 0;
    if (lane < a.num_ranks) {
      u64 status;
      const SourceState s = ll_wait_source(me->combine_arrive[a.set][lane], &me->combine_meta[a.set][lane].status, status, epoch,
                                           epoch * LL_ARRIVE_UNIT, me->mask, me->decision[LL_KIND_COMBINE], lane, d, soft, sm);
      waited = s.waited_ns;
      bool used = false;
      if (s.used) {
        problem = ll_status_problem(status);
        used = problem == 0 && ll_status_accepted(status);
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
//         in f32, one bf16 rounding, 16-byte store into out. Block 0: wait stats, report. Every
//         block, once past its reads: its share of the hand-back to every expert rank (ll_recv_end).
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
