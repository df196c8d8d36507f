// moelink kernel family: low-latency combine across nodes (moelink_kernels::ll_internode). The protocol,
// the JIT constants and what the low-latency kernels across nodes share are in lli.cuh.
#include "lli.cuh"

// ============================================================================================ combine: send
// Block 0: compares the combine-time top-k ids (and, pre-reduced, the weights) with this rank's dispatch,
// and puts every rank a meta block: problems, whether this rank used its dispatch (rows follow only then).
__device__ __forceinline__ void lli_combine_check(const LliCombineArgs& a, const Deadline& d, LliShared& sm, u32 epoch) {
  const u32 T = a.num_tokens, R = a.rdma.num_ranks, me = a.rdma.rank;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  u32 problem = 0;
  for (u32 tk = threadIdx.x; tk < T * LL_TOPK; tk += LL_THREADS) {
    if (ptx::ld_nc_u64(idx + tk) != (u64)reinterpret_cast<const i64*>(a.home_idx)[tk]) problem |= LL_PROBLEM_TOPK_IDX_DIFFERS;
    if (weights && ptx::ld_nc_u32(wts + tk) != reinterpret_cast<const u32*>(a.home_weight)[tk]) problem |= LL_PROBLEM_WEIGHTS_DIFFER;
  }
  if (problem != 0) atomicOr(&sm.problem, problem);
  __syncthreads();
  const u32 problem_all = sm.problem;
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
  // Rows to each home: one per message it sent this rank (pre-reduced) or one per local selection, and
  // none for a home whose dispatch this rank did not use.
  const u32 lane = lane_id();
  const u32* hmeta = reinterpret_cast<const u32*>(a.hmeta);
  for (u32 i = warp_id(); i < R; i += LL_WARPS) {
    const u32 p = (me + 1 + i) % R;
    const u32 used = hmeta[2 * p + 1], msgs = used ? hmeta[2 * p] : 0u;
    u32 rows = msgs;
    if (!weights && msgs != 0) {
      u32 n = 0;
      for (u32 e = lane; e < msgs * LL_TOPK; e += WARP_SIZE) n += reinterpret_cast<const i32*>(a.hrow)[(u64)p * a.max_tokens * LL_TOPK + e] >= 0 ? 1u : 0u;
      rows = __reduce_add_sync(FULL_WARP_MASK, n);
    }
    LliMeta* m = reinterpret_cast<LliMeta*>(a.rdma.local_base + a.off_send_meta + (u64)p * sizeof(LliMeta));
    if (lane == 0) {
      m->num_msgs = a.host_problem == 0 ? rows : 0u;
      m->num_tokens = T;
      m->problem = problem_all;
      m->accepted = used;
    }
    rdma::put_signal_warp(a.rdma, p % a.rdma.num_qps, p, a.off_meta + (u64)me * sizeof(LliMeta), a.off_send_meta + (u64)p * sizeof(LliMeta),
                          sizeof(LliMeta), a.off_meta_sig + 8ull * me, epoch, SIGNAL_SET, d);
  }
}

// Pre-reduced rows (weights given at dispatch): work item = a received message (source p, index i), one
// warp: per 256-channel step the lanes sum, from +0.0, f32(w) * f32(y) over this rank's selections in
// ascending k (each product rounded before the add), round to bf16 into the staging row, and put the row
// into slot [token][j] of the home, signal ADD 1. Per-expert rows (no weights at dispatch): work item =
// (message, k) with a local expert; the row is put from the zero-copy buffer (copied there first when y is
// another tensor) into slot [token][k].
__device__ __forceinline__ void lli_combine_rows(const LliCombineArgs& a, const Deadline& d, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 R = a.rdma.num_ranks, TM = a.max_tokens, me = a.rdma.rank;
  const u8* y = reinterpret_cast<const u8*>(a.y);
  const u32* hmeta = reinterpret_cast<const u32*>(a.hmeta);
  const bool prereduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  // Messages of every used source, counted in order: item -> (p, i) by walking the sources.
  const u32 per = prereduced ? 1 : LL_TOPK;
  u32 p = 0, before = 0;
  for (u32 item = first_warp;; item += num_warps) {
    const u32 g = item / per, k = item % per;
    while (p < R && g >= before + (hmeta[2 * p + 1] ? hmeta[2 * p] : 0u)) {
      before += hmeta[2 * p + 1] ? hmeta[2 * p] : 0u;
      p++;
    }
    if (p >= R) break;
    const u32 i = g - before;
    const u64 h = (u64)p * TM + i;
    const u32 token = reinterpret_cast<const u32*>(a.htoken)[h];
    if (prereduced) {
      i32 hrow = -1;
      float w = 0.0f;
      if (lane < LL_TOPK) {
        hrow = reinterpret_cast<const i32*>(a.hrow)[h * LL_TOPK + lane];
        w = bits_f32(reinterpret_cast<const u32*>(a.hweight)[h * LL_TOPK + lane]);
      }
      const u32 live = __ballot_sync(FULL_WARP_MASK, hrow >= 0);
      const u64 stage = a.off_send_rows + h * ROW_BYTES_BF16;
      u8* out = reinterpret_cast<u8*>(a.rdma.local_base + stage);
      for (u32 c = 0; c < LLI_COMBINE_CHUNKS; c++) {
        const u32 ch = c * LLI_COMBINE_CHANNELS + lane * 8;
        float acc[8];
#pragma unroll
        for (u32 q = 0; q < 8; q++) acc[q] = 0.0f;
        for (u32 m = live; m != 0; m &= m - 1) {
          const u32 k2 = __ffs(m) - 1;
          const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, hrow, k2);
          const float wk = __shfl_sync(FULL_WARP_MASK, w, k2);
          if (ch < LL_HIDDEN) {
            const u32x4 v = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)r * ROW_BYTES_BF16 + (u64)ch * 2));
#pragma unroll
            for (u32 q = 0; q < 4; q++) {
              acc[2 * q] = ptx::add_rn_f32(acc[2 * q], ptx::mul_rn_f32(wk, bf16_lo(word_of(v, q))));
              acc[2 * q + 1] = ptx::add_rn_f32(acc[2 * q + 1], ptx::mul_rn_f32(wk, bf16_hi(word_of(v, q))));
            }
          }
        }
        if (ch < LL_HIDDEN) {
          u32x4 o;
          o.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
          o.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
          o.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
          o.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
          ptx::st_v4(reinterpret_cast<u32x4*>(out + (u64)ch * 2), o);
        }
      }
      const u32 j = reinterpret_cast<const u32*>(a.hj)[h];
      rdma::put_signal_warp(a.rdma, (token + p) % a.rdma.num_qps, p, a.off_rows + ((u64)token * LL_TOPK + j) * ROW_BYTES_BF16, stage,
                            ROW_BYTES_BF16, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
    } else {
      const i32 hrow = reinterpret_cast<const i32*>(a.hrow)[h * LL_TOPK + k];
      if (hrow < 0) continue;
      const u64 src = a.off_zero_copy + (u64)hrow * ROW_BYTES_BF16;
      if (a.y_is_zero_copy == 0) {
        u8* dst = reinterpret_cast<u8*>(a.rdma.local_base + src);
        for (u32 off = lane * VEC_BYTES; off < ROW_BYTES_BF16; off += CHUNK_BYTES)
          ptx::st_v4(reinterpret_cast<u32x4*>(dst + off), ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)hrow * ROW_BYTES_BF16 + off)));
      }
      rdma::put_signal_warp(a.rdma, (token + p) % a.rdma.num_qps, p, a.off_rows + ((u64)token * LL_TOPK + k) * ROW_BYTES_BF16, src,
                            ROW_BYTES_BF16, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
    }
  }
}

__device__ __forceinline__ void lli_combine_send(const LliCombineArgs& a, const Deadline& d, LliShared& sm, u32 epoch, u32 workers) {
  lli_wait_consumed(a, d, sm);
  lli_trace(sm, LL_TRACE_SEND_READY);
  if (sm.abort == 0) {
    if (blockIdx.x == 0) {
      lli_combine_check(a, d, sm, epoch);
      lli_trace(sm, LL_TRACE_INDEX_CHECKED);
    }
    if (a.host_problem == 0 && (blockIdx.x != 0 || workers == 1)) {
      const u32 data_blocks = workers == 1 ? 1 : workers - 1;
      const u32 block = workers == 1 ? 0 : blockIdx.x - 1;
      lli_combine_rows(a, d, block * LL_WARPS + warp_id(), data_blocks * LL_WARPS);
      lli_trace(sm, LL_TRACE_SEND_ISSUED);  // thread 0: its warp's messages are out
    }
  }
  const LliOp op = lli_op(a);
  if (lli_last_block(op.send_done, sm, workers, LL_TRACE_SEND_DONE) && threadIdx.x == 0 && sm.phase_ok) {
    *op.epoch = epoch;
    *op.last_write = epoch;
  }
}

// ============================================================================================ combine: receive
// Every block waits for every rank's meta (problems, whether it used this rank's dispatch, how many rows it
// sent) and then for those rows. Work item = (token, 256-channel step) per warp: the sum
// in f32 from +0.0 of the ranks' partials in ascending rank order (pre-reduced) or of w * y in ascending k
// with the combine-time weights, skipping ranks whose data is not used; one cvt.rn.bf16x2 per pair.
__device__ __forceinline__ void lli_combine_recv(const LliCombineArgs& a, const Deadline& d, LliShared& sm, u32 epoch, u32 workers) {
  const u32 R = a.rdma.num_ranks, EL = a.num_local_experts, E = a.num_experts, T = a.num_tokens, me = a.rdma.rank;
  const bool prereduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const i64* home = reinterpret_cast<const i64*>(a.home_idx);
  u64* expected = lli_expected(a.state, LL_KIND_COMBINE, a.set, R);
  LlReport* rep = reinterpret_cast<LlReport*>(a.report);
  // Every rank's meta says how many rows it sent this rank (none when it did not use this rank's dispatch).
  for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
    u64 waited = 0;
    bool meta_seen = false;
    const LliMeta* m = lli_wait_source(a, p, epoch, a.off_meta + (u64)p * sizeof(LliMeta), expected[p], d, sm, waited, meta_seen);
    u32 used = 0;
    if (m != nullptr) {
      const u32 problem = ptx::ld_cg_u32(&m->problem);
      used = ptx::ld_cg_u32(&m->accepted) != 0 ? 1u : 0u;
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
    sm.first[p] = meta_seen ? ptx::ld_cg_u32(&reinterpret_cast<const LliMeta*>(a.rdma.local_base + a.off_meta + (u64)p * sizeof(LliMeta))->num_msgs) : 0u;
    if (blockIdx.x == 0 && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[p] += (i64)waited;
  }
  __syncthreads();
  lli_trace(sm, LL_TRACE_RECV_SEEN);
  if (sm.abort == 0) {
    const u32 lane = lane_id();
    const float* wts = reinterpret_cast<const float*>(a.topk_weights);
    const u8* rows_at = reinterpret_cast<const u8*>(a.rdma.local_base + a.off_rows);
    u8* out = reinterpret_cast<u8*>(a.out);
    const u32 items = T * LLI_COMBINE_CHUNKS;
    for (u32 item = blockIdx.x * LL_WARPS + warp_id(); item < items; item += workers * LL_WARPS) {
      const u32 t = item / LLI_COMBINE_CHUNKS, c = item % LLI_COMBINE_CHUNKS;
      const u32 ch = c * LLI_COMBINE_CHANNELS + lane * 8;
      // The token's slots, in the home's own order (lane k: expert k).
      u32 id = LLI_NONE;
      float wk = 0.0f;
      if (lane < LL_TOPK) {
        const i64 e = home[(u64)t * LL_TOPK + lane];
        if (e >= 0 && e < (i64)E) id = (u32)e;
        if (!prereduced) wk = wts[(u64)t * LL_TOPK + lane];
      }
      bool live = id != LLI_NONE;
      const u32 dest = live ? id / EL : LLI_NONE;
      bool firstd = live;
#pragma unroll
      for (u32 j = 0; j < LL_TOPK; j++) {
        const u32 other = __shfl_sync(FULL_WARP_MASK, id, j);
        const u32 od = __shfl_sync(FULL_WARP_MASK, dest, j);
        if (j < lane && other == id) live = false;
        if (j < lane && od == dest) firstd = false;
      }
      float acc[8];
#pragma unroll
      for (u32 q = 0; q < 8; q++) acc[q] = 0.0f;
      if (prereduced) {
        // Distinct destination ranks in ascending order: slot j holds the j-th's partial.
        const u32 ranks_mask = __ballot_sync(FULL_WARP_MASK, firstd && live);
        const u32 n = __popc(ranks_mask);
        const u32 key = (firstd && live) ? dest : LLI_NONE;
        u32 taken = 0;
        for (u32 j = 0; j < n; j++) {
          u32 best = (key != LLI_NONE && ((taken >> lane) & 1) == 0) ? key : LLI_NONE;
#pragma unroll
          for (u32 m = WARP_SIZE / 2; m >= 1; m /= 2) best = lli_min(best, __shfl_xor_sync(FULL_WARP_MASK, best, m));
          const u32 owner = __ffs(__ballot_sync(FULL_WARP_MASK, key == best && ((taken >> lane) & 1) == 0)) - 1;
          taken |= 1u << owner;
          if (sm.used[best] == 0 || ch >= LL_HIDDEN) continue;
          const u32x4 v = ptx::ld_cg_v4(rows_at + ((u64)t * LL_TOPK + j) * ROW_BYTES_BF16 + (u64)ch * 2);
#pragma unroll
          for (u32 q = 0; q < 4; q++) {
            acc[2 * q] = ptx::add_rn_f32(acc[2 * q], bf16_lo(word_of(v, q)));
            acc[2 * q + 1] = ptx::add_rn_f32(acc[2 * q + 1], bf16_hi(word_of(v, q)));
          }
        }
      } else {
        const u32 lives = __ballot_sync(FULL_WARP_MASK, live);
        for (u32 m = lives; m != 0; m &= m - 1) {
          const u32 k = __ffs(m) - 1;
          const u32 dk = __shfl_sync(FULL_WARP_MASK, dest, k);
          const float w = __shfl_sync(FULL_WARP_MASK, wk, k);
          if (sm.used[dk] == 0 || ch >= LL_HIDDEN) continue;
          const u32x4 v = ptx::ld_cg_v4(rows_at + ((u64)t * LL_TOPK + k) * ROW_BYTES_BF16 + (u64)ch * 2);
#pragma unroll
          for (u32 q = 0; q < 4; q++) {
            acc[2 * q] = ptx::add_rn_f32(acc[2 * q], ptx::mul_rn_f32(w, bf16_lo(word_of(v, q))));
            acc[2 * q + 1] = ptx::add_rn_f32(acc[2 * q + 1], ptx::mul_rn_f32(w, bf16_hi(word_of(v, q))));
          }
        }
      }
      if (ch < LL_HIDDEN) {
        u32x4 o;
        o.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
        o.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
        o.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
        o.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
        ptx::st_na_v4(reinterpret_cast<u32x4*>(out + ((u64)t * LL_HIDDEN + ch) * 2), o);
      }
    }
  }
  lli_recv_end(a, sm, expected, epoch, workers, d);
}

namespace moelink::internode_ll {
// moelink::internode_ll::combine: low-latency combine across nodes, send and/or receive phase.
//   grid, phases: as moelink::internode_ll::dispatch.
//   SEND  every block waits until the homes handed the combine set back; block 0 checks the combine-time
//         top-k against the dispatch and puts every rank its meta; the other blocks put one pre-reduced row
//         per received (source, token), or one row per selection (source, token, k), with put_signal(ADD 1).
//   RECV  every block waits for every rank's meta and, when it used this rank's dispatch, its rows; work
//         item (token, 256 channels) per warp: the fixed-order f32 sum, rounded to bf16 into out. The last
//         block hands the set back.
__global__ void __launch_bounds__(LL_THREADS, 1) combine(const __grid_constant__ LliCombineArgs a) {
  lli_run(
      a, PHASE_LL_COMBINE,
      [&](const Deadline& d, LliShared& sm, u32 epoch, u32 workers) { lli_combine_send(a, d, sm, epoch, workers); },
      [&](const Deadline& d, LliShared& sm, u32 epoch, u32 workers) { lli_combine_recv(a, d, sm, epoch, workers); });
}
}  // namespace moelink::internode_ll
