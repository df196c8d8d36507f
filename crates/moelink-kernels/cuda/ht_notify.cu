// moelink kernel family: high-throughput notify (the count exchange before a fresh dispatch).
//
// JIT constants (from moelink_kernels::ht::HtNotifyVariant):
//   MAX_RANKS                       ranks the argument struct has room for
//   NOTIFY_THREADS                  threads of the single block (a multiple of 32, at most 1024)
//   MOELINK_SIZEOF_HT_NOTIFY_ARGS   sizeof(moelink_kernels::ht::HtNotifyArgs)
#include "ht.cuh"

#if !defined(NOTIFY_THREADS) || !defined(MOELINK_SIZEOF_HT_NOTIFY_ARGS)
#error "ht_notify.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(NOTIFY_THREADS % WARP_SIZE == 0 && NOTIFY_THREADS <= 1024 && NOTIFY_THREADS >= MAX_RANKS, "block shape");
constexpr u32 NOTIFY_WARPS = NOTIFY_THREADS / WARP_SIZE;

// Kernel argument (by value). Must match moelink_kernels::ht::HtNotifyArgs byte for byte.
struct HtNotifyArgs {
  u64 is_token_in_rank;       // bool [T, R], contiguous (the layout's)
  u64 num_tokens_per_rank;    // i32 [R] (the layout's; checked against is_token_in_rank)
  u64 num_tokens_per_expert;  // i32 [E] (the layout's)
  u64 routing;                // this call's handle buffer (HT_RT_* words + prefix), written here
  u64 host_out;               // host-mapped u32 words (HT_HN_*), or 0 in no-sync mode
  u64 ctrl[MAX_RANKS];        // every rank's HT control region, as addressable from this rank
  u64 signature;              // what every rank must agree on (moelink_kernels::ht::call_signature)
  u64 error_claim;            // ErrorSink::claim
  u64 error_record;           // ErrorSink::record
  u64 timeout_ns;             // per wait
  u32 rank;
  u32 num_ranks;
  u32 num_tokens;             // T of this rank
  u32 num_local_experts;      // E / R, at most HT_MAX_LOCAL_EXPERTS
  u32 slab_rows;              // dispatch slab rows per source for this call's row size (0: no room)
  u32 slab_row_bytes;         // that row size (error details only)
  u32 host_seq;               // written to host_out[HT_HN_READY] last
  u32 reserved;
};
static_assert(sizeof(HtNotifyArgs) == MOELINK_SIZEOF_HT_NOTIFY_ARGS, "HtNotifyArgs differs from the Rust definition");

__device__ __forceinline__ u32* notify_flag(u64 ctrl, u32 parity, u32 src) {
  return ht_ctrl_word(ctrl, HT_CTRL_NOTIFY_FLAGS) + parity * MAX_RANKS + src;
}

__device__ __forceinline__ u32* notify_msg(u64 ctrl, u32 parity, u32 src) {
  return ht_ctrl_word(ctrl, HT_CTRL_NOTIFY_MSGS) + ((u64)parity * MAX_RANKS + src) * HT_MSG_WORDS;
}

namespace moelink::intranode {
// moelink::intranode::notify: one block of NOTIFY_THREADS.
//   1. Prefix: thread i scans a contiguous chunk of tokens; a block-wide exclusive scan per destination gives
//      routing.prefix[t][r] (tokens before t that go to r; t's send slot at r when it goes there) for
//      t = 0..T, and send_count[r] = prefix[T][r]. send_count differing from num_tokens_per_rank marks this
//      rank's message HT_STATUS_BAD_LAYOUT.
//   1b. Warp w sums num_tokens_per_expert over the experts of ranks w, w + NOTIFY_WARPS, ... (u64 lanes, then
//      a shuffle tree): each token sent to rank r selects at least one of r's experts, so r's experts count
//      no tokens when send_count[r] is 0 and at least send_count[r] otherwise, and no count is negative; a
//      disagreement marks the message HT_STATUS_BAD_EXPERTS. It reads the E counts that step 2 sends anyway
//      (one more pass over E words, 1 KiB at E = 256, and five shuffles per rank).
//   2. Message to every rank r (itself included) at notify_msg(r's ctrl, parity, me), parity = epoch & 1:
//      {send_count[r], T, status, signature, send_count[0..R), num_tokens_per_expert[r's experts]}: the
//      whole send_count row goes to every rank, so that every rank knows every rank's counts.
//   3. Flags: threads r < R: one fence.acq_rel.sys, then st.relaxed.sys epoch into notify_flag(r, parity, me).
//      Threads s < R wait (deadline) until notify_flag(own, parity, s) >= epoch, then ld.acquire it.
//      Parity double-buffering is enough: a rank writes call e's message only after its call e-1 saw every
//      peer's call e-1 message, which each peer sent after finishing its call e-2 (stream order).
//   4. rank_prefix_matrix[i][j] = sum over sources s <= i of their send_count[j] (0 after a failed
//      exchange), recv_count[s], recv_offset[s] (exclusive scan over sources), N, T_max = max T_s, and the
//      agreed status:
//      any source's BAD_LAYOUT or BAD_EXPERTS, else any signature != ours (MISMATCH), else T_max > slab_rows
//      (TOO_SMALL); a non-zero status is also reported (ERR_INVALID_LAYOUT with LAYOUT_ARG_PER_RANK or
//      _PER_EXPERT / ERR_RANK_MISMATCH / ERR_BUFFER_TOO_SMALL).
//      Written to the routing header; with host_out, also N, T_max, status (+ peer), recv counts and the received
//      tokens per local expert, then host_out[READY] = host_seq (fence + release store).
//   5. Thread 0 stores the epoch.
//   reads: is_token_in_rank, the layout counts (num_tokens_per_expert twice), own notify flags/messages;
//   writes: routing, host_out, peers' notify flags/messages, own epoch.
//   on timeout: error record {ERR_TIMEOUT, rank, peer, PHASE_NOTIFY}; the routing status becomes FAILED so a
//   dispatch launched behind this kernel returns at once.
__global__ void __launch_bounds__(NOTIFY_THREADS, 1) notify(const __grid_constant__ HtNotifyArgs a) {
  __shared__ u32 s_epoch;
  __shared__ u32 s_local_status;
  __shared__ u32 s_warp_total[NOTIFY_WARPS][MAX_RANKS];
  __shared__ u32 s_total[MAX_RANKS];
  __shared__ u32 s_recv_count[MAX_RANKS];
  __shared__ u32 s_num_tokens[MAX_RANKS];
  __shared__ u32 s_status[MAX_RANKS];
  __shared__ u64 s_signature[MAX_RANKS];

  const u32 tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const u32 me = a.rank, num_ranks = a.num_ranks, num_tokens = a.num_tokens;
  const u64 ctrl_me = a.ctrl[me];
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, me, PHASE_NOTIFY);
  i32* routing = reinterpret_cast<i32*>(a.routing);
  i32* prefix = routing + HT_RT_PREFIX;
  u32* host = reinterpret_cast<u32*>(a.host_out);
  const u8* in_rank = reinterpret_cast<const u8*>(a.is_token_in_rank);

  if (tid == 0) {
    s_epoch = ptx::ld_relaxed_gpu(ht_ctrl_word(ctrl_me, HT_CTRL_NOTIFY_EPOCH)) + 1;
    s_local_status = 0;
  }
  __syncthreads();
  const u32 epoch = s_epoch, parity = epoch & 1u;

  // 1. Per-thread counts over a contiguous chunk of tokens, then an exclusive scan over threads.
  const u64 chunk = ((u64)num_tokens + NOTIFY_THREADS - 1) / NOTIFY_THREADS;
  const u64 t_begin = ht_min_u64(num_tokens, tid * chunk), t_end = ht_min_u64(num_tokens, t_begin + chunk);
  u32 count[MAX_RANKS];
#pragma unroll
  for (u32 r = 0; r < MAX_RANKS; r++) count[r] = 0;
  for (u64 t = t_begin; t < t_end; t++) {
#pragma unroll
    for (u32 r = 0; r < MAX_RANKS; r++)
      if (r < num_ranks) count[r] += in_rank[t * num_ranks + r] != 0 ? 1u : 0u;
  }
  u32 running[MAX_RANKS];
#pragma unroll
  for (u32 r = 0; r < MAX_RANKS; r++) {
    u32 inclusive = count[r];
#pragma unroll
    for (u32 offset = 1; offset < WARP_SIZE; offset <<= 1) {
      const u32 below = __shfl_up_sync(FULL_WARP_MASK, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    if (lane == WARP_SIZE - 1) s_warp_total[warp][r] = inclusive;
    running[r] = inclusive - count[r];
  }
  __syncthreads();
#pragma unroll
  for (u32 r = 0; r < MAX_RANKS; r++)
    for (u32 w = 0; w < warp; w++) running[r] += s_warp_total[w][r];
  if (tid < MAX_RANKS) {
    u32 total = 0;
    for (u32 w = 0; w < NOTIFY_WARPS; w++) total += s_warp_total[w][tid];
    s_total[tid] = total;
  }
  for (u64 t = t_begin; t < t_end; t++) {
#pragma unroll
    for (u32 r = 0; r < MAX_RANKS; r++) {
      if (r < num_ranks) {
        prefix[t * num_ranks + r] = (i32)running[r];
        running[r] += in_rank[t * num_ranks + r] != 0 ? 1u : 0u;
      }
    }
  }
  __syncthreads();
  if (tid < num_ranks) {
    prefix[(u64)num_tokens * num_ranks + tid] = (i32)s_total[tid];
    routing[HT_RT_SEND_COUNT + tid] = (i32)s_total[tid];
    if ((i32)s_total[tid] != reinterpret_cast<const i32*>(a.num_tokens_per_rank)[tid]) atomicOr(&s_local_status, HT_STATUS_BAD_LAYOUT);
  }
  __syncthreads();

  // 1b. The per-expert counts against the tokens sent to each rank.
  const u32 el = a.num_local_experts;
  const i32* per_expert = reinterpret_cast<const i32*>(a.num_tokens_per_expert);
  for (u32 r = warp; r < num_ranks; r += NOTIFY_WARPS) {
    const bool bad = expert_counts_disagree(per_expert + (u64)r * el, el, s_total[r], lane);
    if (lane == 0 && bad) atomicOr(&s_local_status, HT_STATUS_BAD_EXPERTS);
  }
  __syncthreads();

  // 2. Messages (plain stores; published by the flags below).
  const u32 words = HT_MSG_HEADER_WORDS + el;
  for (u32 i = tid; i < num_ranks * words; i += NOTIFY_THREADS) {
    const u32 r = i / words, w = i % words;
    u32 v = 0;
    if (w >= HT_MSG_HEADER_WORDS) v = (u32)per_expert[(u64)r * el + (w - HT_MSG_HEADER_WORDS)];
    else if (w >= HT_MSG_ROW) v = w - HT_MSG_ROW < num_ranks ? s_total[w - HT_MSG_ROW] : 0u;
    else if (w == HT_MSG_COUNT) v = s_total[r];
    else if (w == HT_MSG_NUM_TOKENS) v = num_tokens;
    else if (w == HT_MSG_STATUS) v = s_local_status;
    else if (w == HT_MSG_SIG_LO) v = (u32)a.signature;
    else if (w == HT_MSG_SIG_HI) v = (u32)(a.signature >> 32);
    notify_msg(a.ctrl[r], parity, me)[w] = v;
  }
  __syncthreads();

  // 3. Publish, then wait for every source.
  if (tid < num_ranks) {
    ptx::fence_acq_rel_sys();
    ptx::st_relaxed_sys(notify_flag(a.ctrl[tid], parity, me), epoch);
  }
  bool ok = true;
  if (tid < num_ranks) {
    const u32* flag = notify_flag(ctrl_me, parity, tid);
    ok = wait_flag_geq(flag, epoch, d, tid);
    if (ok) (void)ptx::ld_acquire_sys(flag);
  }
  const bool all_ok = __syncthreads_and(ok) != 0;

  // 4. The count matrix as DeepEP's rank_prefix_matrix (column j: a scan over the sources' rows), then what
  //    this rank receives.
  if (tid < num_ranks) {
    u32 received = 0;
    for (u32 s = 0; s < num_ranks; s++) {
      if (all_ok) received += notify_msg(ctrl_me, parity, s)[HT_MSG_ROW + tid];
      routing[HT_RT_RANK_PREFIX + s * num_ranks + tid] = (i32)received;
    }
  }
  if (all_ok) {
    if (tid < num_ranks) {
      const u32* msg = notify_msg(ctrl_me, parity, tid);
      s_recv_count[tid] = msg[HT_MSG_COUNT];
      s_num_tokens[tid] = msg[HT_MSG_NUM_TOKENS];
      s_status[tid] = msg[HT_MSG_STATUS];
      s_signature[tid] = (u64)msg[HT_MSG_SIG_LO] | ((u64)msg[HT_MSG_SIG_HI] << 32);
    }
    if (host != nullptr) {
      for (u32 e = tid; e < el; e += NOTIFY_THREADS) {
        u32 sum = 0;
        for (u32 s = 0; s < num_ranks; s++) sum += notify_msg(ctrl_me, parity, s)[HT_MSG_HEADER_WORDS + e];
        host[HT_HN_PER_EXPERT + e] = sum;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    u32 status = HT_STATUS_FAILED, peer = NO_PEER, num_recv = 0, t_max = 0;
    if (all_ok) {
      status = 0;
      for (u32 s = 0; s < num_ranks; s++) {
        routing[HT_RT_RECV_OFFSET + s] = (i32)num_recv;
        routing[HT_RT_RECV_COUNT + s] = (i32)s_recv_count[s];
        if (host != nullptr) host[HT_HN_RECV_COUNT + s] = s_recv_count[s];
        num_recv += s_recv_count[s];
        t_max = s_num_tokens[s] > t_max ? s_num_tokens[s] : t_max;
      }
      for (u32 s = 0; s < num_ranks && status == 0; s++) {
        if ((s_status[s] & (HT_STATUS_BAD_LAYOUT | HT_STATUS_BAD_EXPERTS)) != 0u) {
          status = s_status[s] & (HT_STATUS_BAD_LAYOUT | HT_STATUS_BAD_EXPERTS);
          peer = s;
        }
      }
      for (u32 s = 0; s < num_ranks && status == 0; s++) {
        if (s_signature[s] != a.signature) {
          status = HT_STATUS_MISMATCH;
          peer = s;
        }
      }
      if (status == 0 && t_max > a.slab_rows) status = HT_STATUS_TOO_SMALL;
      if ((status & (HT_STATUS_BAD_LAYOUT | HT_STATUS_BAD_EXPERTS)) != 0u)
        report_error(d, ERR_INVALID_LAYOUT, peer, (status & HT_STATUS_BAD_LAYOUT) != 0u ? LAYOUT_ARG_PER_RANK : LAYOUT_ARG_PER_EXPERT, 0);
      if (status == HT_STATUS_MISMATCH) report_error(d, ERR_RANK_MISMATCH, peer, a.signature, s_signature[peer]);
      if (status == HT_STATUS_TOO_SMALL)
        report_error(d, ERR_BUFFER_TOO_SMALL, NO_PEER, t_max, ((u64)a.slab_row_bytes << 32) | a.slab_rows);
    }
    routing[HT_RT_STATUS] = (i32)status;
    routing[HT_RT_STATUS_PEER] = (i32)peer;
    routing[HT_RT_NUM_RECV] = (i32)num_recv;
    routing[HT_RT_T_MAX] = (i32)t_max;
    if (host != nullptr) {
      host[HT_HN_NUM_RECV] = num_recv;
      host[HT_HN_T_MAX] = t_max;
      host[HT_HN_STATUS] = status;
      host[HT_HN_STATUS_PEER] = peer;
    }
  }
  __syncthreads();
  if (tid == 0) {
    if (host != nullptr) {
      ptx::fence_acq_rel_sys();
      ptx::st_release_sys(host + HT_HN_READY, a.host_seq);
    }
    *ht_ctrl_word(ctrl_me, HT_CTRL_NOTIFY_EPOCH) = epoch;
  }
}
}  // namespace moelink::intranode
