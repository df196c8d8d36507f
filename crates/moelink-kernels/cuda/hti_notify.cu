// moelink kernel family: the count exchange before a high-throughput dispatch across nodes
// (moelink_kernels::ht_internode). The protocol, the JIT constants and what the internode kernels share are
// in hti.cuh.
#include "hti.cuh"

// ============================================================================================== notify
namespace moelink::internode {
// moelink::internode::notify: the count exchange before a fresh dispatch. One worker block (THREADS) plus,
//   with the emulated NIC, its blocks; launched cooperatively.
//   1. Prefixes (routing): for every destination rank r, prefix[t][r] = tokens before t that go to r (t's
//      slot there); for every node n, node_prefix[t][n] = tokens before t that reach n (t's message index
//      in the stream to n's rail peer) and, with several ranks per node, multi_prefix[t][n] = those of
//      them that go to two or more of n's ranks (the combine messages that are fp32 partials, which sets
//      where a message starts in the packed combine parts); t = 0..T; a block-wide scan per column, whose
//      totals (every column counted first) are all step 2 needs: the prefixes are stored after its puts.
//   2. A message to every rank r (itself included), staged in this rank's notify send area and put with
//      SET epoch on r's notify signal [parity][me]: {tokens to r, T, status, signature, tokens to r's
//      node, the whole count row, tokens per local expert of r}. Then, after the prefixes, wait (deadline,
//      RDMA domain) for every source's signal. Parity double-buffering holds as intranode: a rank writes
//      call e's message only after its call e-1 saw every call e-1 message, which each peer sent after its
//      call e-2 (stream order); a quiet at the end completes this call's puts before the next call rewrites
//      the send area.
//   3. From the messages: recv_count / recv_offset per source, N, T_max, every rank's T, DeepEP's
//      rank_prefix_matrix, the forwarder's per-source-node message counts (from the rail sources (a, l)),
//      K = ceil(T_max / M), the agreed status (the first source with BAD_LAYOUT or BAD_EXPERTS, reported as
//      ERR_INVALID_LAYOUT naming it and the argument, else a signature differing from ours); with host_out
//      the same for the host, the received tokens per local expert, then READY = host_seq.
//   The layout checks read only what the message sends anyway: a send count differing from
//   num_tokens_per_rank marks the message BAD_LAYOUT; warp w checks the per-expert counts of ranks w,
//   w + HTI_WARPS, ... (expert_counts_disagree, ptx.cuh), a disagreement marks it BAD_EXPERTS.
__global__ void __launch_bounds__(THREADS, 1) notify(const __grid_constant__ HtiNotifyArgs a) {
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_NOTIFY);
  if (rdma::nic_block(a.rdma, d)) return;
  rdma::WorkerScope scope(a.rdma);
  // Prefix columns per pass, and warp steps whose loads are in flight at once while counting.
  constexpr u32 SCAN_COLUMNS = 4, SCAN_STEPS = 4;
  __shared__ u32 s_send_count[NUM_RANKS];
  __shared__ u32 s_node_count[NUM_NODES];
  __shared__ u32 s_status, s_epoch, s_ok;
  const u32 tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const u32 me = a.rdma.rank, T = a.num_tokens;
  i32* routing = reinterpret_cast<i32*>(a.routing);
  const RoutingAt at = routing_at(T);
  const u8* in_rank = reinterpret_cast<const u8*>(a.is_token_in_rank);
  HtiState* st = hti_state(a.state);
  if (tid == 0) {
    hti_stamp(a.trace, NOTIFY_TRACE_START);
    s_epoch = ptx::ld_relaxed_gpu(&st->notify_epoch) + 1;
    s_status = 0;
    s_ok = 1;
  }
  __syncthreads();
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_EPOCH);
  const u32 epoch = s_epoch, parity = epoch & 1u;

  // 1. Prefix columns: ranks, nodes (a token reaches a node when it goes to one of its ranks), then with
  //    several ranks per node the multi-holder columns (one rank per node: every message is a bf16 row and
  //    the columns stay unwritten; nothing reads them).
  //    Warp w takes tokens [w * per_warp, (w + 1) * per_warp) in steps of 32, lane l token step + l: its
  //    loads and its stores of a step are coalesced (a thread per contiguous chunk of tokens would store 32
  //    scattered words per warp instruction, the column's cost at thousands of tokens). Every column is
  //    counted first, warp by warp (s_warp), so that the messages, which need only the totals, leave before
  //    the prefixes are stored; a step's prefix is then a warp scan plus the warp's carry. A pass takes
  //    SCAN_COLUMNS columns, whose counts and scans interleave; the passes share one loop body (the kernel
  //    runs once per call, its code cold).
  constexpr u32 MULTI_COLUMNS = RANKS_PER_NODE > 1 ? NUM_NODES : 0;
  constexpr u32 COLUMNS = NUM_RANKS + NUM_NODES + MULTI_COLUMNS;
  constexpr u32 PASS_COLUMNS = (COLUMNS + SCAN_COLUMNS - 1) / SCAN_COLUMNS * SCAN_COLUMNS;
  __shared__ u32 s_warp[PASS_COLUMNS * HTI_WARPS];  // [column][warp]: the warp's tokens that hit the column
  const u32 per_warp = (T + HTI_WARPS * WARP_SIZE - 1) / (HTI_WARPS * WARP_SIZE) * WARP_SIZE;
  const u32 w0 = hti_min(T, warp * per_warp), w1 = hti_min(T, w0 + per_warp);
  // Rank columns read one byte, node columns the node's RANKS_PER_NODE bytes (a hit: any, or two or more).
  auto hit = [&](u32 t, u32 col) -> u32 {
    if (t >= w1 || col >= COLUMNS) return 0u;
    const u32 kind = col < NUM_RANKS ? 0u : col < NUM_RANKS + NUM_NODES ? 1u : 2u;
    const u32 first = kind == 0 ? col : kind == 1 ? (col - NUM_RANKS) * RANKS_PER_NODE : (col - NUM_RANKS - NUM_NODES) * RANKS_PER_NODE;
    const u32 width = kind == 0 ? 1u : RANKS_PER_NODE, need = kind == 2 ? 2u : 1u;
    u32 holders = 0;
#pragma unroll 1
    for (u32 j = 0; j < width; j++) holders += in_rank[(u64)t * NUM_RANKS + first + j] != 0 ? 1u : 0u;
    return holders >= need ? 1u : 0u;
  };
  auto prefix_out = [&](u32 col) -> i32* {
    return routing + (col < NUM_RANKS ? at.prefix : col < NUM_RANKS + NUM_NODES ? at.node_prefix : at.multi_prefix);
  };
  auto column_of = [&](u32 col) -> u32 { return col < NUM_RANKS ? col : (col - NUM_RANKS) % NUM_NODES; };
  auto row_width = [&](u32 col) -> u64 { return col < NUM_RANKS ? NUM_RANKS : NUM_NODES; };
  // 1a. Counts, SCAN_STEPS steps' loads in flight.
#pragma unroll 1
  for (u32 col0 = 0; col0 < COLUMNS; col0 += SCAN_COLUMNS) {
    u32 count[SCAN_COLUMNS] = {};
#pragma unroll 1
    for (u32 t = w0 + lane; t < w1; t += SCAN_STEPS * WARP_SIZE) {
      u32 h[SCAN_STEPS][SCAN_COLUMNS];
#pragma unroll
      for (u32 u = 0; u < SCAN_STEPS; u++)
#pragma unroll
        for (u32 j = 0; j < SCAN_COLUMNS; j++) h[u][j] = hit(t + u * WARP_SIZE, col0 + j);
#pragma unroll
      for (u32 u = 0; u < SCAN_STEPS; u++)
#pragma unroll
        for (u32 j = 0; j < SCAN_COLUMNS; j++) count[j] += h[u][j];
    }
#pragma unroll
    for (u32 j = 0; j < SCAN_COLUMNS; j++) {
#pragma unroll
      for (u32 o = WARP_SIZE / 2; o > 0; o >>= 1) count[j] += __shfl_xor_sync(FULL_WARP_MASK, count[j], o);
    }
    if (lane == 0) {
#pragma unroll
      for (u32 j = 0; j < SCAN_COLUMNS; j++) s_warp[(col0 + j) * HTI_WARPS + warp] = count[j];
    }
  }
  __syncthreads();
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_COUNTED);
  // 1b. Totals: prefix row T, the send counts and the layout checks.
  for (u32 col = tid; col < COLUMNS; col += THREADS) {
    u32 sum = 0;
#pragma unroll 1
    for (u32 x = 0; x < HTI_WARPS; x++) sum += s_warp[col * HTI_WARPS + x];
    prefix_out(col)[(u64)T * row_width(col) + column_of(col)] = (i32)sum;
    if (col < NUM_RANKS) s_send_count[col] = sum;
    else if (col < NUM_RANKS + NUM_NODES) s_node_count[col - NUM_RANKS] = sum;
  }
  __syncthreads();
  for (u32 r = tid; r < NUM_RANKS; r += THREADS)
    if ((i32)s_send_count[r] != reinterpret_cast<const i32*>(a.num_tokens_per_rank)[r]) atomicOr(&s_status, HTI_STATUS_BAD_LAYOUT);
  const u32 el = a.num_local_experts, words = MSG_W_ROW + NUM_RANKS + el;
  const i32* per_expert = reinterpret_cast<const i32*>(a.num_tokens_per_expert);
  for (u32 r = warp; r < NUM_RANKS; r += HTI_WARPS) {
    const bool bad = expert_counts_disagree(per_expert + (u64)r * el, el, s_send_count[r], lane);
    if (lane == 0 && bad) atomicOr(&s_status, HTI_STATUS_BAD_EXPERTS);
  }
  __syncthreads();
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_CHECKED);

  // 2. Messages: warp w builds and puts the messages of ranks w, w + HTI_WARPS, ...; they travel while the
  //    prefixes are stored (1c).
  for (u32 r = warp; r < NUM_RANKS; r += HTI_WARPS) {
    u32* msg = reinterpret_cast<u32*>(rdma_bytes(a.rdma, a.at.off_notify_send)) + (u64)r * a.at.msg_words;
    for (u32 w = lane; w < words; w += WARP_SIZE) {
      u32 v = 0;
      if (w >= MSG_W_ROW + NUM_RANKS) v = (u32)per_expert[(u64)r * el + (w - MSG_W_ROW - NUM_RANKS)];
      else if (w >= MSG_W_ROW) v = s_send_count[w - MSG_W_ROW];
      else if (w == MSG_W_COUNT) v = s_send_count[r];
      else if (w == MSG_W_TOKENS) v = T;
      else if (w == MSG_W_STATUS) v = s_status;
      else if (w == MSG_W_SIG_LO) v = (u32)a.signature;
      else if (w == MSG_W_SIG_HI) v = (u32)(a.signature >> 32);
      else if (w == MSG_W_NODE_COUNT) v = s_node_count[node_of(r)];
      msg[w] = v;
    }
    const u64 bytes = (u64)words * 4;
    const u64 dst = a.at.off_notify + ((u64)parity * NUM_RANKS + me) * a.at.msg_words * 4;
    const u64 src = a.at.off_notify_send + (u64)r * a.at.msg_words * 4;
    const u64 sig = a.at.off_notify_sig + ((u64)parity * NUM_RANKS + me) * 8;
    if (!rdma::put_signal_warp(a.rdma, r % a.rdma.num_qps, r, dst, src, (u32)bytes, sig, epoch, SIGNAL_SET, d) && lane == 0) s_ok = 0;
  }
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_SENT);

  // 1c. Prefixes: run = the tokens of the warps before this one, then the warp's steps.
#pragma unroll 1
  for (u32 col0 = 0; col0 < COLUMNS; col0 += SCAN_COLUMNS) {
    u32 run[SCAN_COLUMNS] = {};
#pragma unroll 1
    for (u32 x = 0; x < warp; x++) {
#pragma unroll
      for (u32 j = 0; j < SCAN_COLUMNS; j++) run[j] += s_warp[(col0 + j) * HTI_WARPS + x];
    }
#pragma unroll 1
    for (u32 step = w0; step < w1; step += WARP_SIZE) {
      const u32 t = step + lane;
      u32 h[SCAN_COLUMNS], inclusive[SCAN_COLUMNS];
#pragma unroll
      for (u32 j = 0; j < SCAN_COLUMNS; j++) inclusive[j] = h[j] = hit(t, col0 + j);
#pragma unroll
      for (u32 o = 1; o < WARP_SIZE; o <<= 1) {
#pragma unroll
        for (u32 j = 0; j < SCAN_COLUMNS; j++) {
          const u32 below = __shfl_up_sync(FULL_WARP_MASK, inclusive[j], o);
          if (lane >= o) inclusive[j] += below;
        }
      }
#pragma unroll
      for (u32 j = 0; j < SCAN_COLUMNS; j++) {
        const u32 col = col0 + j;
        if (t < w1 && col < COLUMNS) prefix_out(col)[(u64)t * row_width(col) + column_of(col)] = (i32)(run[j] + inclusive[j] - h[j]);
        run[j] += __shfl_sync(FULL_WARP_MASK, inclusive[j], WARP_SIZE - 1);
      }
    }
  }
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_PREFIXED);
  for (u32 s = tid; s < NUM_RANKS; s += THREADS) {
    const u64 sig = a.at.off_notify_sig + ((u64)parity * NUM_RANKS + s) * 8;
    if (!rdma::wait_signal_geq(a.rdma, sig, epoch, for_peer(d, s, me), s)) s_ok = 0;
  }
  __syncthreads();
  if (tid == 0) hti_stamp(a.trace, NOTIFY_TRACE_RECEIVED);
  const bool all_ok = s_ok != 0 && !error_raised(d);
  auto msg_of = [&](u32 s) -> const u32* {
    return reinterpret_cast<const u32*>(rdma_bytes(a.rdma, a.at.off_notify)) + ((u64)parity * NUM_RANKS + s) * a.at.msg_words;
  };

  // 3. What this rank receives and forwards, and the agreed status.
  u32* host = reinterpret_cast<u32*>(a.host_out);
  for (u32 j = tid; j < NUM_RANKS; j += THREADS) {
    u32 received = 0;
#pragma unroll 1
    for (u32 s = 0; s < NUM_RANKS; s++) {
      if (all_ok) received += msg_of(s)[MSG_W_ROW + j];
      routing[at.rank_prefix + s * NUM_RANKS + j] = (i32)received;
    }
  }
  if (all_ok && host != nullptr) {
    for (u32 e = tid; e < el; e += THREADS) {
      u32 sum = 0;
#pragma unroll 1
      for (u32 s = 0; s < NUM_RANKS; s++) sum += msg_of(s)[MSG_W_ROW + NUM_RANKS + e];
      host[HN_PER_EXPERT + e] = sum;
    }
  }
  if (tid == 0) {
    u32 status = HTI_STATUS_FAILED, peer = NO_PEER, num_recv = 0, t_max = 0, num_fwd = 0;
    if (all_ok) {
      status = 0;
#pragma unroll 1
      for (u32 s = 0; s < NUM_RANKS; s++) {
        const u32* m = msg_of(s);
        routing[at.recv_offset + s] = (i32)num_recv;
        routing[at.recv_count + s] = (i32)m[MSG_W_COUNT];
        routing[at.tokens_of + s] = (i32)m[MSG_W_TOKENS];
        num_recv += m[MSG_W_COUNT];
        t_max = m[MSG_W_TOKENS] > t_max ? m[MSG_W_TOKENS] : t_max;
        if (status == 0 && (m[MSG_W_STATUS] & (HTI_STATUS_BAD_LAYOUT | HTI_STATUS_BAD_EXPERTS)) != 0u) {
          // A bad num_tokens_per_rank first: the per-expert check rests on it.
          status = (m[MSG_W_STATUS] & HTI_STATUS_BAD_LAYOUT) != 0u ? HTI_STATUS_BAD_LAYOUT : HTI_STATUS_BAD_EXPERTS;
          peer = s;
        }
      }
#pragma unroll 1
      for (u32 n = 0; n < NUM_NODES; n++) {
        const u32 cnt = msg_of(n * RANKS_PER_NODE + local_of(me))[MSG_W_NODE_COUNT];
        routing[at.fwd_offset + n] = (i32)num_fwd;
        routing[at.fwd_count + n] = (i32)cnt;
        num_fwd += cnt;
      }
#pragma unroll 1
      for (u32 s = 0; s < NUM_RANKS && status == 0; s++) {
        const u32* m = msg_of(s);
        const u64 sig = (u64)m[MSG_W_SIG_LO] | ((u64)m[MSG_W_SIG_HI] << 32);
        if (sig != a.signature) {
          status = HTI_STATUS_MISMATCH;
          peer = s;
          report_error(d, ERR_RANK_MISMATCH, s, a.signature, sig);
        }
      }
      if (status == HTI_STATUS_BAD_LAYOUT) report_error(d, ERR_INVALID_LAYOUT, peer, LAYOUT_ARG_PER_RANK, 0);
      if (status == HTI_STATUS_BAD_EXPERTS) report_error(d, ERR_INVALID_LAYOUT, peer, LAYOUT_ARG_PER_EXPERT, 0);
    }
    const u32 rounds = a.round_tokens == 0 ? 0 : (t_max + a.round_tokens - 1) / a.round_tokens;
    routing[RT_STATUS] = (i32)status;
    routing[RT_STATUS_PEER] = (i32)peer;
    routing[RT_NUM_RECV] = (i32)num_recv;
    routing[RT_T_MAX] = (i32)t_max;
    routing[RT_NUM_ROUNDS] = (i32)rounds;
    routing[RT_ROUND_TOKENS] = (i32)a.round_tokens;
    routing[RT_NUM_FWD] = (i32)num_fwd;
    if (host != nullptr) {
      host[HN_NUM_RECV] = num_recv;
      host[HN_T_MAX] = t_max;
      host[HN_STATUS] = status;
      host[HN_STATUS_PEER] = peer;
      host[HN_NUM_FWD] = num_fwd;
    }
  }
  __syncthreads();
  if (tid == 0) {
    hti_stamp(a.trace, NOTIFY_TRACE_END);
    if (host != nullptr) {
      ptx::fence_acq_rel_sys();
      ptx::st_release_sys(host + HN_READY, a.host_seq);
    }
    // After READY: the host's turn-around overlaps the wait for this call's puts to complete, which only the
    // next call's rewrite of the send area needs (a failure here is recorded, and seen by the next call).
    (void)rdma::quiet_thread(a.rdma, RDMA_ALL_QPS, d);
    st->notify_epoch = epoch;
  }
}
}  // namespace moelink::internode
