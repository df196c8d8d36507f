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

// The rows home: one received message (source p, index i) per block at a time (messages block, block +
// data_blocks, ... in source order), its rows built by every warp of the block, 256 channels (one 16-byte
// bf16 vector per lane) per step, step c by warp c % LL_WARPS.
//   Pre-reduced (weights given at dispatch): one row, slot [token][j] of the home: per step the lanes sum,
//   from +0.0, f32(w) * f32(y) over this rank's selections of the token in ascending k (each product rounded
//   before the add; every selection's load in flight before the first add), rounded to bf16.
//   Per-expert (no weights at dispatch): one row per local selection k, slot [token][k]: y's row as it is.
// Each row goes straight into the home's region when this GPU reaches it with stores (rdma::window; every
// thread fences its stores, one thread signals ADD 1 per row), else into this rank's staging — for
// per-expert rows the zero-copy buffer, which is y itself when the caller wrote there — and one warp puts
// it with put_signal. A warp walking a whole row, one load after another, left the sends on 16 blocks for
// ~112 us at 2x1 (bench/results/2026-11-28-2xnvidia-h200-33ada12-lli-trace-row-align).
__device__ __forceinline__ void lli_combine_rows(const LliCombineArgs& a, const Deadline& d, LliShared& sm, u32 block, u32 data_blocks) {
  const u32 lane = lane_id(), warp = warp_id();
  const u32 R = a.rdma.num_ranks, TM = a.max_tokens, me = a.rdma.rank;
  const u8* y = reinterpret_cast<const u8*>(a.y);
  const u32* hmeta = reinterpret_cast<const u32*>(a.hmeta);
  const bool prereduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  // The messages of each used source, as an exclusive prefix in sm.msgs (unused by the send phase otherwise).
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 run = 0;
    for (u32 p = 0; p < R; p++) {
      sm.msgs[p] = run;
      run += hmeta[2 * p + 1] ? hmeta[2 * p] : 0u;
    }
    sm.send_msgs = run;
  }
  __syncthreads();
  const u32 total = sm.send_msgs;
  for (u32 g = block; g < total; g += data_blocks) {
    u32 lo = 0, hi = R;  // the source: the last p with prefix[p] <= g
    while (hi - lo > 1) {
      const u32 mid = (lo + hi) / 2;
      if (sm.msgs[mid] <= g) lo = mid; else hi = mid;
    }
    const u32 p = lo, i = g - sm.msgs[p];
    const u64 h = (u64)p * TM + i;
    const u32 token = reinterpret_cast<const u32*>(a.htoken)[h];
    i32 hrow = -1;
    float w = 0.0f;
    if (lane < LL_TOPK) {
      hrow = reinterpret_cast<const i32*>(a.hrow)[h * LL_TOPK + lane];
      if (prereduced) w = bits_f32(reinterpret_cast<const u32*>(a.hweight)[h * LL_TOPK + lane]);
    }
    const u32 live = __ballot_sync(FULL_WARP_MASK, hrow >= 0);
    const u32 qp = (token + p) % a.rdma.num_qps;
    if (prereduced) {
      // The selections in ascending k: row and weight of the q-th (q < __popc(live)).
      u32 rows[LL_TOPK];
      float ws[LL_TOPK];
      u32 m = live;
#pragma unroll
      for (u32 q = 0; q < LL_TOPK; q++) {
        const u32 k = m != 0 ? __ffs(m) - 1 : 0u;
        rows[q] = (u32)__shfl_sync(FULL_WARP_MASK, hrow, k);
        ws[q] = __shfl_sync(FULL_WARP_MASK, w, k);
        m &= m - 1;
      }
      const u32 n = __popc(live);
      const u32 j = reinterpret_cast<const u32*>(a.hj)[h];
      const u64 dst_off = a.off_rows + ((u64)token * LL_TOPK + j) * ROW_BYTES_BF16, stage_off = a.off_send_rows + h * ROW_BYTES_BF16;
      const rdma::Window win = rdma::window(a.rdma, p, dst_off, stage_off);
      for (u32 c = warp; c < LLI_COMBINE_CHUNKS; c += LL_WARPS) {
        const u32 ch = c * LLI_COMBINE_CHANNELS + lane * 8;
        if (ch >= LL_HIDDEN) continue;
        u32x4 v[LL_TOPK];
#pragma unroll
        for (u32 q = 0; q < LL_TOPK; q++)
          if (q < n) v[q] = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)rows[q] * ROW_BYTES_BF16 + (u64)ch * 2));
        float acc[8];
#pragma unroll
        for (u32 e = 0; e < 8; e++) acc[e] = 0.0f;
#pragma unroll
        for (u32 q = 0; q < LL_TOPK; q++) {
          if (q >= n) break;
#pragma unroll
          for (u32 e = 0; e < 4; e++) {
            acc[2 * e] = ptx::add_rn_f32(acc[2 * e], ptx::mul_rn_f32(ws[q], bf16_lo(word_of(v[q], e))));
            acc[2 * e + 1] = ptx::add_rn_f32(acc[2 * e + 1], ptx::mul_rn_f32(ws[q], bf16_hi(word_of(v[q], e))));
          }
        }
        u32x4 o;
        o.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
        o.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
        o.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
        o.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
        u32x4* out = reinterpret_cast<u32x4*>(win.ptr + (u64)ch * 2);
        if (win.direct) ptx::st_na_v4(out, o); else ptx::st_v4(out, o);
      }
      ptx::fence_acq_rel_sys();
      __syncthreads();
      if (warp == 0) {
        if (win.direct) {
          if (lane == 0) rdma::signal_thread(a.rdma, qp, p, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
        } else {
          rdma::put_signal_warp(a.rdma, qp, p, dst_off, stage_off, ROW_BYTES_BF16, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
        }
      }
    } else {
      // Item (selection q, 512-byte chunk) per warp; the q-th live selection is slot k of the token. A warp
      // takes ITEMS items at a time and issues their loads before any store (a store right after its load
      // would wait out one round trip per item).
      constexpr u32 ITEMS = 3;
      const u32 n = __popc(live);
      for (u32 first = warp; first < n * LLI_ROW_CHUNKS; first += ITEMS * LL_WARPS) {
        u32x4 v[ITEMS];
        u32x4* out[ITEMS];
        bool direct[ITEMS];
#pragma unroll
        for (u32 b = 0; b < ITEMS; b++) {
          out[b] = nullptr;
          direct[b] = true;
          const u32 item = first + b * LL_WARPS;
          if (item >= n * LLI_ROW_CHUNKS) continue;
          const u32 q = item / LLI_ROW_CHUNKS, c = item % LLI_ROW_CHUNKS;
          u32 m = live;
          for (u32 s2 = 0; s2 < q; s2++) m &= m - 1;
          const u32 k = __ffs(m) - 1;
          const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, hrow, k);
          const u64 src_off = a.off_zero_copy + (u64)r * ROW_BYTES_BF16;
          const u64 dst_off = a.off_rows + ((u64)token * LL_TOPK + k) * ROW_BYTES_BF16;
          const rdma::Window win = rdma::window(a.rdma, p, dst_off, src_off);
          const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
          if (off >= ROW_BYTES_BF16 || (!win.direct && a.y_is_zero_copy != 0)) continue;  // staged from y itself
          v[b] = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)r * ROW_BYTES_BF16 + off));
          out[b] = reinterpret_cast<u32x4*>(win.ptr + off);
          direct[b] = win.direct;
        }
#pragma unroll
        for (u32 b = 0; b < ITEMS; b++) {
          if (out[b] == nullptr) continue;
          if (direct[b]) ptx::st_na_v4(out[b], v[b]); else ptx::st_v4(out[b], v[b]);
        }
      }
      ptx::fence_acq_rel_sys();
      __syncthreads();
      u32 m = live;
      for (u32 q = 0; q < n; q++, m &= m - 1) {
        if (q % LL_WARPS != warp) continue;
        const u32 k = __ffs(m) - 1;
        const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, hrow, k);
        const u64 src_off = a.off_zero_copy + (u64)r * ROW_BYTES_BF16;
        const u64 dst_off = a.off_rows + ((u64)token * LL_TOPK + k) * ROW_BYTES_BF16;
        const rdma::Window win = rdma::window(a.rdma, p, dst_off, src_off);
        if (win.direct) {
          if (lane == 0) rdma::signal_thread(a.rdma, qp, p, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
        } else {
          rdma::put_signal_warp(a.rdma, qp, p, dst_off, src_off, ROW_BYTES_BF16, a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
        }
      }
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
      lli_combine_rows(a, d, sm, block, data_blocks);
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
    LliMetaWords words = {};
    const LliMeta* m = lli_wait_source(a, p, epoch, a.off_meta + (u64)p * sizeof(LliMeta), expected[p], d, sm, waited, meta_seen, words);
    u32 used = 0;
    if (m != nullptr) {
      const u32 problem = words.problem;
      used = words.accepted != 0 ? 1u : 0u;
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
    sm.first[p] = meta_seen ? words.num_msgs : 0u;
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
      // Bit q of `use`: slot q of the token is summed, in ascending q, every load in flight before the
      // first add. Pre-reduced: slot j holds the partial of the token's j-th destination rank (ascending),
      // skipped when that rank's data is not used; per expert: slot k holds expert k's row, weighted.
      u32 use = 0;
      if (prereduced) {
        const bool is_dest = firstd && live;
        u32 place = 0;
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) place += __shfl_sync(FULL_WARP_MASK, is_dest ? dest : LLI_NONE, j) < dest ? 1u : 0u;
        const u32 dests = __ballot_sync(FULL_WARP_MASK, is_dest);
        const u32 used_dests = __ballot_sync(FULL_WARP_MASK, is_dest && sm.used[dest] != 0);
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) {
          const u32 owner = __ffs(__ballot_sync(FULL_WARP_MASK, is_dest && place == j)) - 1;
          if (j < (u32)__popc(dests) && ((used_dests >> owner) & 1)) use |= 1u << j;
        }
      } else {
        use = __ballot_sync(FULL_WARP_MASK, live && sm.used[dest] != 0);
      }
      u32x4 v[LL_TOPK];
#pragma unroll
      for (u32 q = 0; q < LL_TOPK; q++)
        if (((use >> q) & 1) && ch < LL_HIDDEN) v[q] = ptx::ld_cg_v4(rows_at + ((u64)t * LL_TOPK + q) * ROW_BYTES_BF16 + (u64)ch * 2);
      float acc[8];
#pragma unroll
      for (u32 e = 0; e < 8; e++) acc[e] = 0.0f;
#pragma unroll
      for (u32 q = 0; q < LL_TOPK; q++) {
        const float w = __shfl_sync(FULL_WARP_MASK, wk, q);
        if (((use >> q) & 1) == 0 || ch >= LL_HIDDEN) continue;
#pragma unroll
        for (u32 e = 0; e < 4; e++) {
          if (prereduced) {
            acc[2 * e] = ptx::add_rn_f32(acc[2 * e], bf16_lo(word_of(v[q], e)));
            acc[2 * e + 1] = ptx::add_rn_f32(acc[2 * e + 1], bf16_hi(word_of(v[q], e)));
          } else {
            acc[2 * e] = ptx::add_rn_f32(acc[2 * e], ptx::mul_rn_f32(w, bf16_lo(word_of(v[q], e))));
            acc[2 * e + 1] = ptx::add_rn_f32(acc[2 * e + 1], ptx::mul_rn_f32(w, bf16_hi(word_of(v[q], e))));
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
//         top-k against the dispatch and puts every rank its meta; the other blocks send one pre-reduced
//         row per received (source, token), or one row per selection (source, token, k), a message per
//         block at a time, built by all its warps, each row counted by an ADD 1 on the home's data word.
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
