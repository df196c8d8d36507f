// What the low-latency kernels across nodes share (moelink_kernels::ll_internode; one kernel per file:
// lli_dispatch.cu, lli_combine.cu). Every byte a rank sends goes through the RDMA transport seam
// (transport.cuh): peers of the same node over NVLink when the seam is told so (nvlink_ranks_per_node), the
// others through the RDMA engine. What the LL families share (the FP8 quantiser, top-k rows, waits,
// constants, LlReport) is in ll.cuh; the outputs are exactly the single-node kernels' (recv_x, scales,
// recv_count, combined_x), bit for bit.
//
// JIT constants: those of ll.cuh (from moelink_kernels::ll::LlVariant), and
//   MOELINK_TRANSPORT                 the seam's backend (transport.cuh)
//   LLI_MAX_RANKS                     ranks the shared-memory arrays have room for
//   LLI_SMEM_WORDS                    u32 words of shared scratch for per-(source, local expert) bases (>= E)
//   MOELINK_SIZEOF_LLI_DISPATCH_ARGS  sizeof(moelink_kernels::ll_internode::LliDispatchArgs)
//   MOELINK_SIZEOF_LLI_COMBINE_ARGS   sizeof(moelink_kernels::ll_internode::LliCombineArgs)
//
// One message per (token, destination rank), not per expert: the token's FP8 (or bf16) row and its routing
// (every top-k slot's `expert << 16 | rank`, rank = the token's rank among this source's tokens of that
// expert, and the weights), staged once and put to every destination. Slots are compact: the n-th token this
// rank sends to d lands in slot [me][n] of d, so d reads slots 0 .. n_msgs - 1.
//
// RDMA region of every rank (offsets from moelink_kernels::ll_internode::LliLayout), per buffer set s:
//   signals u64 [R]           dispatch meta (SET epoch), dispatch data (ADD 1 per message, cumulative),
//                             dispatch consumed (SET epoch, by the destination), and the same three for combine
//   dispatch meta [R]         per source: LliMeta (messages, tokens, problem, signature) + counts u32 [E_local]
//   dispatch msgs [R][T_max]  per source, compact: messages of LLI_MSG_BYTES
//   send meta [R], send msgs [T_max]  this rank's staging (a put's source stays untouched until the
//                             destination hands the set back)
//   combine meta [R] (LliMeta: problem, accepted), combine rows bf16 [T_max][K]: pre-reduced partials at
//   [token][j] (j = the sender's index among the token's ranks in ascending order) or one row per expert at
//   [token][k]; combine staging [R][T_max] rows. And, once, the zero-copy combine buffer
//   bf16 [E_local][R * T_max][H] (per-expert rows are put straight from it).
// Local state (LliState + u64 expected[2 kinds][2 sets][R], u32 decision[2][R], u32 mask[R]) and the
// handle area (htoken, hj u32 [R][T_max]; hrow i32, hweight f32 [R][T_max][K]; hmeta u32 [R][2] =
// {messages, used}; home_idx i64 / home_weight f32 [T_max][K]) are device memory of this rank only.
//
// Epochs as in ll.cuh: a send works as call e = epoch + 1 and its last block stores e back; a receive-only
// launch takes last_write[set]. Signals only grow: meta and consumed words hold epochs, data words count
// messages since the buffer was created (the receiver keeps what it expects in `expected`).
//
// Flag protocol (ordering comes from the seam's put_signal: a signal never overtakes its own data):
//   send:  (0) wait until every unmasked destination d handed set s back: consumed[s][d] >= last_write[s];
//          (1) block 0: validation, handle copies, per-destination counts; meta to every rank with
//              put_signal(SET e) on its meta word [s][me];
//          (2) the other blocks (block 0 too when alone): one token per block at a time, its message built
//              by every warp (one warp counts the token's destinations and slots over the earlier rows, the
//              others quantise or load the row's chunks into registers), then delivered into slot [me][n]
//              of every destination: stored there from the registers where stores reach it (the routing
//              warp adds the header and entries), fenced, and signalled with ADD 1 on its data word [s][me];
//              elsewhere stored into the staging and put with put_signal(ADD 1) by one warp.
//   recv:  every block waits, per source p, for meta word [s][p] >= e, then for data word [s][p] >=
//          expected[s][p] + messages (deadline; shrink: soft, decided once per call); scans counts into
//          bases; expands messages into recv_x; the last block adds the messages to `expected` and signals
//          consumed[s][me] = e at every source.
// Combine is the same protocol on the combine words with rows going home. Argument problems travel in the
// meta blocks (LlReport on every rank); timeouts record ERR_TIMEOUT naming the peer and the call winds down
// without handing back, so the peers time out too.
#ifndef MOELINK_LLI_CUH
#define MOELINK_LLI_CUH
#include "ll.cuh"
#include "transport.cuh"

#if !defined(LLI_MAX_RANKS) || !defined(LLI_SMEM_WORDS) || !defined(MOELINK_SIZEOF_LLI_DISPATCH_ARGS) || \
    !defined(MOELINK_SIZEOF_LLI_COMBINE_ARGS)
#error "lli.cuh needs every JIT constant listed at the top of the file"
#endif
static_assert(LLI_MAX_RANKS >= 1 && LLI_MAX_RANKS <= 0xffff, "ranks fit the shared arrays");

// ============================================================================================ layout
constexpr u32 LLI_HDR_BYTES = 16;  // u32 token, then padding
constexpr u32 LLI_ROUTE_BYTES = ((8 * LL_TOPK + 15) / 16) * 16;  // entries u32 [K], weights u32 [K]
constexpr u32 LLI_SCALE_GROUPS = LL_FP8 ? SCALE_GROUPS : 0;
constexpr u32 LLI_ROW_BYTES = LL_FP8 ? LL_HIDDEN + 4 * LLI_SCALE_GROUPS : ROW_BYTES_BF16;
constexpr u32 LLI_PAYLOAD_AT = LLI_HDR_BYTES + LLI_ROUTE_BYTES;
constexpr u32 LLI_MSG_BYTES = LLI_PAYLOAD_AT + ((LLI_ROW_BYTES + 15) / 16) * 16;
// The 512-byte chunks of a row each warp of a sending block holds in registers (lli_dispatch_rows).
constexpr u32 LLI_WARP_CHUNKS = (SEND_CHUNKS + LL_WARPS - 1) / LL_WARPS;
// Combine: a warp sums 8 channels per lane (one 16-byte bf16 vector): 256 channels per step.
constexpr u32 LLI_COMBINE_CHANNELS = WARP_SIZE * 8;
constexpr u32 LLI_COMBINE_CHUNKS = (LL_HIDDEN + LLI_COMBINE_CHANNELS - 1) / LLI_COMBINE_CHANNELS;
// A bf16 row in 512-byte chunks (one 16-byte vector per lane).
constexpr u32 LLI_ROW_CHUNKS = (ROW_BYTES_BF16 + CHUNK_BYTES - 1) / CHUNK_BYTES;
constexpr u32 LLI_NONE = 0xffffffffu;

__device__ __forceinline__ u32 lli_min(u32 x, u32 y) { return x < y ? x : y; }

// The head of a meta block (64 bytes); dispatch meta blocks continue with counts u32 [E_local].
struct LliMeta {
  u32 num_msgs;    // dispatch: messages to this destination; combine: rows to this home
  u32 num_tokens;  // dispatch: tokens of the call
  u32 problem;     // LL_PROBLEM_* of the sender's arguments (its host's included)
  u32 accepted;    // combine: 1 when the sender used this home's dispatch (shrink: not masked)
  u32 sig[LL_SIG_WORDS];
  u32 pad[4];
};
static_assert(sizeof(LliMeta) == 64, "LliMeta is one 64-byte head");

// Local state of a rank (moelink_kernels::ll_internode::LliState), followed in the same allocation by
// expected u64 [2 kinds][2 sets][R], decision u32 [2 kinds][R], mask u32 [R].
struct LliState {
  u32 dispatch_epoch, combine_epoch;
  u32 dispatch_send_done, dispatch_recv_done, combine_send_done, combine_recv_done;
  u32 dispatch_last_write[2], combine_last_write[2];
  u32 pad[6];
};
static_assert(sizeof(LliState) == 64, "LliState is 64 bytes");

__device__ __forceinline__ u64* lli_expected(u64 state, u32 kind, u32 set, u32 num_ranks) {
  return reinterpret_cast<u64*>(state + sizeof(LliState)) + ((u64)kind * 2 + set) * num_ranks;
}
__device__ __forceinline__ u32* lli_decision(u64 state, u32 kind, u32 num_ranks) {
  return reinterpret_cast<u32*>(state + sizeof(LliState) + 32ull * num_ranks) + (u64)kind * num_ranks;
}
__device__ __forceinline__ u32* lli_mask(u64 state, u32 num_ranks) {
  return reinterpret_cast<u32*>(state + sizeof(LliState) + 40ull * num_ranks);
}

// ============================================================================================ arguments
// ll_internode_dispatch's argument (moelink_kernels::ll_internode::LliDispatchArgs, byte for byte).
struct LliDispatchArgs {
  RdmaArgs rdma;
  u64 state;          // LliState (local)
  u64 x;              // bf16 [T, H]
  u64 topk_idx;       // i64 [T, K]
  u64 topk_weights;   // f32 [T, K], or 0
  u64 recv_x;         // [E_local, R*T_max, H] fp8 or bf16
  u64 recv_scales;    // f32 [E_local][H/128][R*T_max] or i32 [E_local][H/512][R*T_max], or 0
  u64 recv_count;     // i32 [E_local]
  u64 cum_stats;      // i32 [E_local], or 0
  u64 wait_stats;     // i64 [R], or 0
  u64 src_info;       // i32 [E_local][R*T_max]: source token of each row, or 0
  u64 layout_range;   // i64 [E_local][R]: begin << 32 | count, or 0
  u64 htoken, hj, hrow, hweight, hmeta, home_idx, home_weight;  // handle area of this call's set
  u64 error_claim, error_record, report, timeout_ns;
  u64 off_meta_sig, off_data_sig, off_consumed;                 // this set's u64 [R] signal arrays
  u64 off_meta, off_msgs, off_send_meta, off_send_msgs;         // this set's regions
  u64 trace;          // timing trace (ll.cuh, LL_TRACE_*), or 0
  u32 meta_bytes;     // 64 + counts, 16-byte multiple
  u32 num_tokens, max_tokens, num_experts, num_local_experts, set, phases, flags, host_problem, pad;
  u32 sig[LL_SIG_WORDS];
};
static_assert(sizeof(LliDispatchArgs) == MOELINK_SIZEOF_LLI_DISPATCH_ARGS, "LliDispatchArgs mirrors Rust");

// ll_internode_combine's argument (moelink_kernels::ll_internode::LliCombineArgs, byte for byte).
struct LliCombineArgs {
  RdmaArgs rdma;
  u64 state;
  u64 y;              // bf16 [E_local, R*T_max, H]: expert outputs (the zero-copy buffer, or a tensor)
  u64 topk_idx;       // i64 [T, K], combine-time
  u64 topk_weights;   // f32 [T, K], combine-time
  u64 out;            // bf16 [T, H]
  u64 wait_stats;     // i64 [R], or 0
  u64 htoken, hj, hrow, hweight, hmeta, home_idx, home_weight;  // handle area of the dispatch's set
  u64 error_claim, error_record, report, timeout_ns;
  u64 off_meta_sig, off_data_sig, off_consumed;                 // this combine set's u64 [R] arrays
  u64 off_meta, off_rows, off_send_meta, off_send_rows;         // this combine set's regions
  u64 off_zero_copy;  // the zero-copy buffer [E_local][R*T_max][H] in the RDMA region
  u64 trace;          // timing trace (ll.cuh, LL_TRACE_*), or 0
  u32 num_tokens, max_tokens, num_experts, num_local_experts, set, phases, flags, host_problem;
  u32 y_is_zero_copy;  // y is the zero-copy buffer (per-expert rows are put from it without a copy)
  u32 pad[3];
};
static_assert(sizeof(LliCombineArgs) == MOELINK_SIZEOF_LLI_COMBINE_ARGS, "LliCombineArgs mirrors Rust");

// Shared memory of one block.
struct LliShared {
  u32 words[LLI_SMEM_WORDS];   // dispatch send (block 0): counts [E]; recv: bases [R][E_local]
  u32 used[LLI_MAX_RANKS];     // recv: source p's data is read in this call
  u32 msgs[LLI_MAX_RANKS];     // recv: messages of p used / send (block 0): messages to p
  u32 first[LLI_MAX_RANKS];    // recv: exclusive prefix of msgs (dispatch) / rows expected from p (combine)
  u32 epoch;
  u32 prev_write;
  u32 abort;
  u32 problem;
  u32 last;
  u32 phase_ok;
  u32 send_msgs;               // combine send: the messages of every used source
  u64 trace_row;               // this launch's timing-trace row (ll_trace_row), or 0
};

__device__ __forceinline__ void lli_trace(const LliShared& sm, u32 point) { ll_trace_at(sm.trace_row, point, ptx::globaltimer()); }

// ============================================================================================ frame
__device__ __forceinline__ LliState* lli_state(u64 s) { return reinterpret_cast<LliState*>(s); }

// The operation's fields of this rank's state: epoch, done counters, last_write of the set.
struct LliOp {
  u32* epoch;
  u32* send_done;
  u32* recv_done;
  u32* last_write;
  u32 kind;
};
__device__ __forceinline__ LliOp lli_op(const LliDispatchArgs& a) {
  LliState* s = lli_state(a.state);
  return {&s->dispatch_epoch, &s->dispatch_send_done, &s->dispatch_recv_done, &s->dispatch_last_write[a.set], LL_KIND_DISPATCH};
}
__device__ __forceinline__ LliOp lli_op(const LliCombineArgs& a) {
  LliState* s = lli_state(a.state);
  return {&s->combine_epoch, &s->combine_send_done, &s->combine_recv_done, &s->combine_last_write[a.set], LL_KIND_COMBINE};
}

// Hands set `a.set` back to every unmasked source: consumed[set][me] = epoch at each (a signal SET, one
// thread per source of block 0's... called by one block, every thread).
template <typename Args>
__device__ __forceinline__ void lli_hand_back(const Args& a, u32 epoch, const Deadline& d) {
  const u32 R = a.rdma.num_ranks, me = a.rdma.rank;
  const u32* mask = lli_mask(a.state, R);
  for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
    if (ptx::ld_relaxed_gpu(mask + p) != 0) continue;
    rdma::signal_thread(a.rdma, p % a.rdma.num_qps, p, a.off_consumed + 8ull * me, epoch, SIGNAL_SET, d);
  }
}

// Kernel entry (every worker thread). DRAIN: only the hand-back of the set as of this rank's last send
// into it (a receive phase that will never run). Otherwise sm.epoch is the call's epoch.
template <typename Args>
__device__ __forceinline__ bool lli_enter(const Args& a, LliShared& sm, const Deadline& d, u64 entered) {
  const LliOp op = lli_op(a);
  if (a.phases & LL_PHASE_DRAIN) {
    if (blockIdx.x == 0) {
      __shared__ u32 e;
      if (threadIdx.x == 0) e = ptx::ld_relaxed_gpu(op.last_write);
      __syncthreads();
      lli_hand_back(a, e, d);
    }
    return false;
  }
  if (threadIdx.x == 0) {
    sm.prev_write = ptx::ld_relaxed_gpu(op.last_write);
    sm.epoch = (a.phases & LL_PHASE_SEND) ? ptx::ld_relaxed_gpu(op.epoch) + 1u : sm.prev_write;
    sm.abort = 0;
    sm.trace_row = ll_trace_row(a.trace, sm.epoch, a.phases);
    ll_trace_at(sm.trace_row, LL_TRACE_START, entered);
  }
  __syncthreads();
  return true;
}

// The last worker block of a phase (every thread calls it): true on exactly one block, with the counter
// reset for the next launch; sm.phase_ok tells it whether every block of the phase succeeded.
// `point` is stamped once every thread of the block got here. `release`: the count orders the block's
// stores before it (acq_rel); otherwise it is relaxed and orders nothing but the count.
__device__ __forceinline__ bool lli_last_block(u32* done, LliShared& sm, u32 workers, u32 point, bool release = true) {
  __syncthreads();
  lli_trace(sm, point);
  if (threadIdx.x == 0) {
    const u32 mine = 1u + (sm.abort != 0 ? LL_DONE_FAILED : 0u);
    const u32 old = release ? ptx::atom_add_acq_rel_gpu(done, mine) : ptx::atom_add_relaxed_gpu(done, mine);
    const bool last = (old & (LL_DONE_FAILED - 1)) == workers - 1;
    if (last) ptx::st_relaxed_gpu(done, 0);
    sm.last = last ? 1u : 0u;
    sm.phase_ok = (old + mine) < LL_DONE_FAILED ? 1u : 0u;
  }
  __syncthreads();
  return sm.last != 0;
}

// The end of a receive phase (every thread of every worker block): the last block adds this call's
// messages per source (sm.first) to what the next call on this set expects, then hands the set back.
// No fence, and a relaxed count: the hand-back orders the blocks' loads of the receive region, and each
// load whose value counts completed before its block's barrier (the value was stored into an output or
// decided a branch), as in the one-node kernels (ll_recv_end); `expected` and the outputs are ordered by
// the kernel boundary. An acq_rel count and a system fence made the last block wait for its outputs' stores
// and ended the kernel ~2.2 us after the last block's receive (bench/results/2026-11-30-2xnvidia-h200-6b1a4d8-lli).
template <typename Args>
__device__ __forceinline__ void lli_recv_end(const Args& a, LliShared& sm, u64* expected, u32 epoch, u32 workers,
                                             const Deadline& d) {
  if (lli_last_block(lli_op(a).recv_done, sm, workers, LL_TRACE_RECV_STORED, false) && sm.phase_ok) {
    for (u32 p = threadIdx.x; p < a.rdma.num_ranks; p += LL_THREADS) expected[p] += sm.first[p];
    __syncthreads();
    lli_hand_back(a, epoch, d);
  }
}

// The frame of both kernels: the emulated NIC's blocks run the NIC, the worker blocks enter (lli_enter),
// then run the send and/or the receive phase as `a.phases` says: send(d, sm, epoch, workers), likewise recv.
template <typename Args, typename Send, typename Recv>
__device__ __forceinline__ void lli_run(const Args& a, u32 phase, Send send, Recv recv) {
  const u64 entered = ptx::globaltimer();
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, phase);
  if (rdma::nic_block(a.rdma, d)) return;
  rdma::WorkerScope scope(a.rdma);
  __shared__ LliShared sm;
  if (!lli_enter(a, sm, d, entered)) return;
  const u32 epoch = sm.epoch, workers = rdma::num_worker_blocks(a.rdma);
  if (a.phases & LL_PHASE_SEND) send(d, sm, epoch, workers);
  if (a.phases & LL_PHASE_RECV) recv(d, sm, epoch, workers);
  lli_trace(sm, LL_TRACE_END);
}

// Send phase start, every thread: waits until every unmasked destination handed the set back (consumed
// word >= this rank's last write into the set). Shrink: a destination that misses the deadline is masked.
template <typename Args>
__device__ __forceinline__ void lli_wait_consumed(const Args& a, const Deadline& d, LliShared& sm) {
  const u32 R = a.rdma.num_ranks;
  u32* mask = lli_mask(a.state, R);
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  const u32 target = sm.prev_write;
  for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
    if (ptx::ld_relaxed_gpu(mask + p) != 0) continue;
    const u64* word = reinterpret_cast<const u64*>(a.rdma.local_base + a.off_consumed + 8ull * p);
    const u32 w = ll_wait_geq([&] { return (u32)ptx::ld_relaxed_sys_u64(word); }, target, d, p, soft);
    if (w == LL_WAIT_SEEN) (void)ptx::ld_acquire_sys_u64(word);
    if (w == LL_WAIT_TIMEOUT) ptx::st_relaxed_gpu(mask + p, 1);
    if (w == LL_WAIT_FAILED) sm.abort = 1;
  }
  __syncthreads();
}

// The words of a source's meta head, loaded together once its meta signal is seen (lli_wait_source).
struct LliMetaWords {
  u32 num_msgs, problem, accepted;
  u32 sig[LL_SIG_WORDS];
};

// Waits (one thread) for source p's meta word of this call and then for its data word to reach
// `data_base + messages` (messages read from its meta). The meta head's words are loaded into `words` as
// soon as the meta is seen, in one round trip, before the data wait (not after it, on the critical path).
// Shrink mode: the decision word makes every block use or drop p alike. Returns the meta head when p's
// data may be read, else nullptr; `meta_seen` says whether p's meta (and so `words`) arrived.
template <typename Args>
__device__ __forceinline__ const LliMeta* lli_wait_source(const Args& a, u32 p, u32 epoch, u64 meta_block, u64 data_base, const Deadline& d,
                                                          LliShared& sm, u64& waited_ns, bool& meta_seen, LliMetaWords& words) {
  const u32 R = a.rdma.num_ranks;
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  u32* mask = lli_mask(a.state, R);
  meta_seen = false;
  const bool masked = ptx::ld_relaxed_gpu(mask + p) != 0;
  const LliMeta* meta = reinterpret_cast<const LliMeta*>(a.rdma.local_base + meta_block);
  u32 w = LL_WAIT_TIMEOUT;
  const u64 start = ptx::globaltimer();
  if (!masked) {
    const u64* mword = reinterpret_cast<const u64*>(a.rdma.local_base + a.off_meta_sig + 8ull * p);
    w = ll_wait_geq([&] { return (u32)ptx::ld_relaxed_sys_u64(mword); }, epoch, d, p, soft);
    if (w == LL_WAIT_SEEN) {
      (void)ptx::ld_acquire_sys_u64(mword);
      meta_seen = true;
      words.num_msgs = ptx::ld_cg_u32(&meta->num_msgs);
      words.problem = ptx::ld_cg_u32(&meta->problem);
      words.accepted = ptx::ld_cg_u32(&meta->accepted);
#pragma unroll
      for (u32 i = 0; i < LL_SIG_WORDS; i++) words.sig[i] = ptx::ld_cg_u32(&meta->sig[i]);
      const u64 target = data_base + words.num_msgs;
      const u64* dword = reinterpret_cast<const u64*>(a.rdma.local_base + a.off_data_sig + 8ull * p);
      w = ll_wait_geq([&] { return (u32)ptx::ld_relaxed_sys_u64(dword); }, (u32)target, d, p, soft);
      if (w == LL_WAIT_SEEN) (void)ptx::ld_acquire_sys_u64(dword);
    }
  }
  waited_ns = ptx::globaltimer() - start;
  if (w == LL_WAIT_FAILED) {
    sm.abort = 1;
    return nullptr;
  }
  bool seen = w == LL_WAIT_SEEN;
  if (soft) {
    seen = ll_decide(lli_decision(a.state, lli_op(a).kind, R) + p, epoch, seen);
    if (!seen && !masked) ptx::st_relaxed_gpu(mask + p, 1);
  }
  if (!seen) return nullptr;
  // Seen here, the acquire loads above order the reads of p's data; seen only by another block's decision
  // (shrink), a fence does. A system fence costs more than the load it would replace (1.5 us where the
  // send-start wait used one: bench/results/2026-11-30-2xnvidia-h200-6b1a4d8-lli, call 117).
  if (w != LL_WAIT_SEEN) ptx::fence_acq_rel_sys();
  return meta;
}

// ============================================================================================ routing
// The routing of token t in one warp: lane k < K holds its top-k slot — the expert id when live (in [0, E)
// and not an earlier slot's id), its rank among this rank's earlier tokens of that expert, and, for the
// first live slot of each destination rank, that rank and the token's compact slot there (the number of
// earlier tokens routed to it). Counted over the earlier rows 32 * RANK_ROWS at a time (ll.cuh), in two
// passes: the destinations and slots, which the message's stores need, then the ranks, which only its
// entries need and which are counted while the payload's stores fly.
struct LliRoute {
  u32 id;         // expert, or LLI_NONE
  u32 rank;       // among earlier tokens of the expert (live slots)
  u32 dest;       // destination rank when this slot is its token's first slot for it, else LLI_NONE
  u32 slot;       // the token's slot at `dest`
};

// Pass 1: id, dest and slot (rank 0).
__device__ __forceinline__ LliRoute lli_route_dests(u64 topk_idx, u32 t, u32 num_experts, u32 local_experts) {
  const i64* topk = reinterpret_cast<const i64*>(topk_idx);
  const u32 lane = lane_id();
  LliRoute r = {LLI_NONE, 0, LLI_NONE, 0};
  if (lane < LL_TOPK) {
    const i64 e = (i64)ptx::ld_nc_u64(topk + (u64)t * LL_TOPK + lane);
    if (e >= 0 && e < (i64)num_experts) r.id = (u32)e;
  }
  // Live: the first slot holding its id; a destination's first slot among the live ones carries it.
  const u32 dest = r.id != LLI_NONE ? r.id / local_experts : LLI_NONE;
  bool live = r.id != LLI_NONE, first_dest = dest != LLI_NONE;
#pragma unroll
  for (u32 j = 0; j < LL_TOPK; j++) {
    const u32 other = __shfl_sync(FULL_WARP_MASK, r.id, j);
    const u32 other_dest = __shfl_sync(FULL_WARP_MASK, dest, j);
    if (j < lane && other == r.id) live = false;
    if (j < lane && other_dest == dest) first_dest = false;
  }
  if (!live) r.id = LLI_NONE;
  if (first_dest) r.dest = dest;
  // A prior id v is on rank dk when v - dk * local_experts < local_experts (unsigned; the ranks' ranges tile
  // [0, E), so no id outside it falls in one): a division per id and slot, 256 per lane and pass, takes
  // ~40 us on one warp.
  auto count = [&](const PriorRows& rows) {
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      const u32 dk = __shfl_sync(FULL_WARP_MASK, r.dest, k);
      const u32 first_of_dk = dk != LLI_NONE ? dk * local_experts : 0u;
      u32 to_d = 0;
#pragma unroll
      for (u32 i = 0; i < RANK_ROWS; i++) {
        bool hit_d = false;
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) hit_d |= rows.id[i][j] - first_of_dk < local_experts;
        to_d += hit_d && dk != LLI_NONE ? 1u : 0u;
      }
      to_d = __reduce_add_sync(FULL_WARP_MASK, to_d);
      if (lane == k) r.slot += to_d;
    }
  };
  for (u32 base = 0; base < t; base += RANK_ROWS * WARP_SIZE) count(load_prior_rows(topk_idx, t, base));
  return r;
}

// Pass 2: r.rank, over the same rows, loaded again (cache hits; holding them across pass 1's stores takes
// 32 registers more than the bf16 kernel has).
__device__ __forceinline__ void lli_route_ranks(LliRoute& r, u64 topk_idx, u32 t) {
  for (u32 base = 0; base < t; base += RANK_ROWS * WARP_SIZE) add_rows_with_id<true>(r.id, load_prior_rows(topk_idx, t, base), r.rank);
}

#endif  // MOELINK_LLI_CUH
