// moelink kernel family: low-latency dispatch and combine when the ranks span nodes
// (moelink_kernels::ll_internode). Every byte a rank sends goes through the RDMA transport seam
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
//          (2) the other blocks (block 0 too when alone): one warp per token: routing counted over the
//              earlier rows, the message staged (FP8 in registers), put_signal(ADD 1) into slot [me][n] of
//              every destination's data word [s][me].
//   recv:  every block waits, per source p, for meta word [s][p] >= e, then for data word [s][p] >=
//          expected[s][p] + messages (deadline; shrink: soft, decided once per call); scans counts into
//          bases; expands messages into recv_x; the last block adds the messages to `expected` and signals
//          consumed[s][me] = e at every source.
// Combine is the same protocol on the combine words with rows going home. Argument problems travel in the
// meta blocks (LlReport on every rank); timeouts record ERR_TIMEOUT naming the peer and the call winds down
// without handing back, so the peers time out too.
#include "ll.cuh"
#include "transport.cuh"

#if !defined(LLI_MAX_RANKS) || !defined(LLI_SMEM_WORDS) || !defined(MOELINK_SIZEOF_LLI_DISPATCH_ARGS) || \
    !defined(MOELINK_SIZEOF_LLI_COMBINE_ARGS)
#error "ll_internode.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(LLI_MAX_RANKS >= 1 && LLI_MAX_RANKS <= 0xffff, "ranks fit the shared arrays");

// ============================================================================================ layout
constexpr u32 LLI_HDR_BYTES = 16;  // u32 token, then padding
constexpr u32 LLI_ROUTE_BYTES = ((8 * LL_TOPK + 15) / 16) * 16;  // entries u32 [K], weights u32 [K]
constexpr u32 LLI_SCALE_GROUPS = LL_FP8 ? SCALE_GROUPS : 0;
constexpr u32 LLI_ROW_BYTES = LL_FP8 ? LL_HIDDEN + 4 * LLI_SCALE_GROUPS : ROW_BYTES_BF16;
constexpr u32 LLI_PAYLOAD_AT = LLI_HDR_BYTES + LLI_ROUTE_BYTES;
constexpr u32 LLI_MSG_BYTES = LLI_PAYLOAD_AT + ((LLI_ROW_BYTES + 15) / 16) * 16;
// Combine: a warp sums 8 channels per lane (one 16-byte bf16 vector): 256 channels per step.
constexpr u32 LLI_COMBINE_CHANNELS = WARP_SIZE * 8;
constexpr u32 LLI_COMBINE_CHUNKS = (LL_HIDDEN + LLI_COMBINE_CHANNELS - 1) / LLI_COMBINE_CHANNELS;
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
};

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
__device__ __forceinline__ bool lli_enter(const Args& a, LliShared& sm, const Deadline& d) {
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
  }
  __syncthreads();
  return true;
}

// The last worker block of a phase (every thread calls it): true on exactly one block, with the counter
// reset for the next launch; sm.phase_ok tells it whether every block of the phase succeeded.
__device__ __forceinline__ bool lli_last_block(u32* done, LliShared& sm, u32 workers) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 mine = 1u + (sm.abort != 0 ? LL_DONE_FAILED : 0u);
    const u32 old = ptx::atom_add_acq_rel_gpu(done, mine);
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
template <typename Args>
__device__ __forceinline__ void lli_recv_end(const Args& a, LliShared& sm, u64* expected, u32 epoch, u32 workers,
                                             const Deadline& d) {
  if (lli_last_block(lli_op(a).recv_done, sm, workers) && sm.phase_ok) {
    for (u32 p = threadIdx.x; p < a.rdma.num_ranks; p += LL_THREADS) expected[p] += sm.first[p];
    ptx::fence_acq_rel_sys();
    __syncthreads();
    lli_hand_back(a, epoch, d);
  }
}

// The frame of both kernels: the emulated NIC's blocks run the NIC, the worker blocks enter (lli_enter),
// then run the send and/or the receive phase as `a.phases` says: send(d, sm, epoch, workers), likewise recv.
template <typename Args, typename Send, typename Recv>
__device__ __forceinline__ void lli_run(const Args& a, u32 phase, Send send, Recv recv) {
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, phase);
  if (rdma::nic_block(a.rdma, d)) return;
  rdma::WorkerScope scope(a.rdma);
  __shared__ LliShared sm;
  if (!lli_enter(a, sm, d)) return;
  const u32 epoch = sm.epoch, workers = rdma::num_worker_blocks(a.rdma);
  if (a.phases & LL_PHASE_SEND) send(d, sm, epoch, workers);
  if (a.phases & LL_PHASE_RECV) recv(d, sm, epoch, workers);
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

// Waits (one thread) for source p's meta word of this call and then for its data word to reach
// `data_base + messages` (messages read from its meta). Shrink mode: the decision word makes every block
// use or drop p alike. Returns the meta head when p's data may be read, else nullptr; `meta_seen` says
// whether p's meta (and so the count of messages it sent) arrived.
template <typename Args>
__device__ __forceinline__ const LliMeta* lli_wait_source(const Args& a, u32 p, u32 epoch, u64 meta_block, u64 data_base, const Deadline& d,
                                                          LliShared& sm, u64& waited_ns, bool& meta_seen) {
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
      const u64 target = data_base + ptx::ld_cg_u32(&meta->num_msgs);
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
  ptx::fence_acq_rel_sys();
  return meta;
}

// ============================================================================================ routing
// The routing of token t in one warp: lane k < K holds its top-k slot — the expert id when live (in [0, E)
// and not an earlier slot's id), its rank among this rank's earlier tokens of that expert, and, for the
// first live slot of each destination rank, that rank and the token's compact slot there (the number of
// earlier tokens routed to it). Counted over the earlier rows 32 * RANK_ROWS at a time (ll.cuh).
struct LliRoute {
  u32 id;         // expert, or LLI_NONE
  u32 rank;       // among earlier tokens of the expert (live slots)
  u32 dest;       // destination rank when this slot is its token's first slot for it, else LLI_NONE
  u32 slot;       // the token's slot at `dest`
};

__device__ __forceinline__ LliRoute lli_route(u64 topk_idx, u32 t, u32 num_experts, u32 local_experts) {
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
  auto count = [&](const PriorRows& rows) {
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      const u32 e = __shfl_sync(FULL_WARP_MASK, r.id, k);
      const u32 dk = __shfl_sync(FULL_WARP_MASK, r.dest, k);
      u32 with_e = 0, to_d = 0;
#pragma unroll
      for (u32 i = 0; i < RANK_ROWS; i++) {
        bool hit_e = false, hit_d = false;
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) {
          const u32 v = rows.id[i][j];
          hit_e |= v == e;
          hit_d |= v < num_experts && v / local_experts == dk;
        }
        with_e += hit_e && e != LLI_NONE ? 1u : 0u;
        to_d += hit_d && dk != LLI_NONE ? 1u : 0u;
      }
      with_e = __reduce_add_sync(FULL_WARP_MASK, with_e);
      to_d = __reduce_add_sync(FULL_WARP_MASK, to_d);
      if (lane == k) {
        r.rank += with_e;
        r.slot += to_d;
      }
    }
  };
  for (u32 base = 0; base < t; base += RANK_ROWS * WARP_SIZE) count(load_prior_rows(topk_idx, t, base));
  return r;
}

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
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      reinterpret_cast<i64*>(a.home_idx)[(u64)t * LL_TOPK + k] = ids[k];
      if (has_weights) reinterpret_cast<u32*>(a.home_weight)[(u64)t * LL_TOPK + k] = ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + k);
      if (!live[k]) continue;
      atomicAdd(&sm.words[(u32)ids[k]], 1u);
      bool first = true;
#pragma unroll
      for (u32 j = 0; j < k; j++) first &= !(live[j] && (u32)ids[j] / EL == (u32)ids[k] / EL);
      if (first && a.host_problem == 0) atomicAdd(&sm.msgs[(u32)ids[k] / EL], 1u);
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

// The messages: one warp per token (worker warps first_warp, first_warp + num_warps, ...). The warp counts
// the token's routing over the earlier rows, stages the message (header, entries, weights, the row —
// quantised to FP8 in registers, 16 channels per lane, or copied as bf16) and puts it to every destination
// rank's slot, starting after this rank.
__device__ __forceinline__ void lli_dispatch_rows(const LliDispatchArgs& a, const Deadline& d, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 R = a.rdma.num_ranks, me = a.rdma.rank, TM = a.max_tokens;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  for (u32 t = first_warp; t < a.num_tokens; t += num_warps) {
    const LliRoute r = lli_route(a.topk_idx, t, a.num_experts, a.num_local_experts);
    const u64 src_off = a.off_send_msgs + (u64)t * LLI_MSG_BYTES;
    u8* msg = reinterpret_cast<u8*>(a.rdma.local_base + src_off);
    if (lane == 0) reinterpret_cast<u32*>(msg)[0] = t;
    if (lane < LL_TOPK) {
      u32* route = reinterpret_cast<u32*>(msg + LLI_HDR_BYTES);
      route[lane] = r.id != LLI_NONE ? (r.id << 16) | r.rank : LLI_NONE;
      route[LL_TOPK + lane] = has_weights ? ptx::ld_nc_u32(wts + (u64)t * LL_TOPK + lane) : 0u;
    }
    u8* row = msg + LLI_PAYLOAD_AT;
#if LL_FP8
    const bool round_scale = (a.flags & LL_FLAG_ROUND_SCALE) != 0;
    for (u32 c = 0; c < SEND_CHUNKS; c++) {
      const u32 ch = c * FP8_CHUNK_CHANNELS + lane * FP8_LANE_CHANNELS;
      const bool active = ch < LL_HIDDEN;
      u32x4 v0 = {0, 0, 0, 0}, v1 = {0, 0, 0, 0};
      if (active) {
        const u32x4* src = reinterpret_cast<const u32x4*>(x + ((u64)t * LL_HIDDEN + ch) * 2);
        v0 = ptx::ld_nc_na_v4(src);
        v1 = ptx::ld_nc_na_v4(src + 1);
      }
      float scale_inv;
      const u32x4 q = quantize16(v0, v1, round_scale, scale_inv);
      if (active) {
        ptx::st_v4(reinterpret_cast<u32x4*>(row + ch), q);
        if (lane % FP8_GROUP_LANES == 0) reinterpret_cast<u32*>(row + LL_HIDDEN)[ch / FP8_GROUP] = f32_bits(scale_inv);
      }
    }
#else
    for (u32 off = lane * VEC_BYTES; off < ROW_BYTES_BF16; off += CHUNK_BYTES)
      ptx::st_v4(reinterpret_cast<u32x4*>(row + off), ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(x + (u64)t * ROW_BYTES_BF16 + off)));
#endif
    // One put_signal per destination, in the order me + 1, me + 2, ... (every rank starting elsewhere).
    u32 dests = __ballot_sync(FULL_WARP_MASK, r.dest != LLI_NONE);
    while (dests != 0) {
      // The next destination after me: the lane whose rank is nearest above me (mod R).
      const u32 key = (r.dest != LLI_NONE && ((dests >> lane) & 1)) ? (r.dest + R - me - 1) % R : LLI_NONE;
      u32 best = key;
#pragma unroll
      for (u32 m = WARP_SIZE / 2; m >= 1; m /= 2) best = lli_min(best, __shfl_xor_sync(FULL_WARP_MASK, best, m));
      const u32 owner = __ffs(__ballot_sync(FULL_WARP_MASK, key == best)) - 1;
      const u32 p = __shfl_sync(FULL_WARP_MASK, r.dest, owner);
      const u32 slot = __shfl_sync(FULL_WARP_MASK, r.slot, owner);
      rdma::put_signal_warp(a.rdma, (t + p) % a.rdma.num_qps, p, a.off_msgs + ((u64)me * TM + slot) * LLI_MSG_BYTES, src_off, LLI_MSG_BYTES,
                            a.off_data_sig + 8ull * me, 1, SIGNAL_ADD, d);
      dests &= ~(1u << owner);
    }
  }
}

__device__ __forceinline__ void lli_dispatch_send(const LliDispatchArgs& a, const Deadline& d, LliShared& sm, u32 epoch, u32 workers) {
  lli_wait_consumed(a, d, sm);
  if (sm.abort == 0) {
    if (blockIdx.x == 0) lli_dispatch_check(a, d, sm, epoch);
    if (a.host_problem == 0 && (blockIdx.x != 0 || workers == 1)) {
      const u32 data_blocks = workers == 1 ? 1 : workers - 1;
      const u32 block = workers == 1 ? 0 : blockIdx.x - 1;
      lli_dispatch_rows(a, d, block * LL_WARPS + warp_id(), data_blocks * LL_WARPS);
    }
  }
  const LliOp op = lli_op(a);
  if (lli_last_block(op.send_done, sm, workers) && threadIdx.x == 0 && sm.phase_ok) {
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
    const LliMeta* m = lli_wait_source(a, p, epoch, a.off_meta + (u64)p * a.meta_bytes, expected[p], d, sm, waited, meta_seen);
    u32 used = 0, n = 0, problem = 0, mismatch_field = LL_SIG_WORDS;
    if (m != nullptr) {
      u32 sig[LL_SIG_WORDS];
#pragma unroll
      for (u32 i = 0; i < LL_SIG_WORDS; i++) sig[i] = ptx::ld_cg_u32(&m->sig[i]);
      problem = ptx::ld_cg_u32(&m->problem);
      n = ptx::ld_cg_u32(&m->num_msgs);
#pragma unroll
      for (u32 i = LL_SIG_WORDS; i-- > 0;)
        if (sig[i] != a.sig[i]) mismatch_field = i;
      used = mismatch_field == LL_SIG_WORDS && problem == 0 && n <= TM ? 1u : 0u;
      if (blockIdx.x == 0 && mismatch_field != LL_SIG_WORDS) {
        // The lowest mismatching peer wins: CAS on the 1-based peer word from 0 or a higher peer.
        u32 cur = ptx::ld_relaxed_sys(&rep->mismatch_peer);
        while (cur == 0 || cur > p + 1) {
          const u32 seen = ptx::atom_cas_acq_rel_gpu(&rep->mismatch_peer, cur, p + 1);
          if (seen == cur) {
            ptx::st_relaxed_sys_u64(&rep->mismatch_ours, a.sig[mismatch_field]);
            ptx::st_relaxed_sys_u64(&rep->mismatch_theirs, sig[mismatch_field]);
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
    sm.first[p] = meta_seen && m != nullptr ? ptx::ld_cg_u32(&m->num_msgs) : 0;
    if (blockIdx.x == 0 && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[p] += (i64)waited;
  }
  __syncthreads();
  if (sm.abort == 0) {
    // Bases per (source, local expert): counts of the used sources, scanned over sources per expert.
    u32* bases = sm.words;
    for (u32 pe = threadIdx.x; pe < R * EL; pe += LL_THREADS) {
      const u32 p = pe / EL;
      bases[pe] = sm.used[p] ? ptx::ld_cg_u32(reinterpret_cast<const u32*>(a.rdma.local_base + a.off_meta + (u64)p * a.meta_bytes + sizeof(LliMeta)) + pe % EL) : 0u;
    }
    __syncthreads();
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
    // Message prefix per source (in `first`, after the expected counts were read by block 0 of the end).
    __shared__ u32 total_msgs;
    if (threadIdx.x == 0) {
      u32 run = 0;
      for (u32 p = 0; p < R; p++) {
        const u32 n = sm.msgs[p];
        sm.msgs[p] = run;  // now the exclusive prefix
        run += n;
      }
      total_msgs = run;
    }
    if (blockIdx.x == 0) {
      for (u32 p = threadIdx.x; p < R; p += LL_THREADS) reinterpret_cast<u32*>(a.hmeta)[2 * p + 1] = sm.used[p];
    }
    __syncthreads();
    if (blockIdx.x == 0) {
      for (u32 p = threadIdx.x; p < R; p += LL_THREADS) {
        const u32 end = p + 1 < R ? sm.msgs[p + 1] : total_msgs;
        reinterpret_cast<u32*>(a.hmeta)[2 * p] = end - sm.msgs[p];
      }
    }
    // Expansion: work item = (message, chunk), dealt over every warp of the grid.
    const u32 lane = lane_id();
    const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
    const u32 items = total_msgs * RECV_CHUNKS;
    for (u32 item = blockIdx.x * LL_WARPS + warp_id(); item < items; item += workers * LL_WARPS) {
      const u32 g = item / RECV_CHUNKS, c = item % RECV_CHUNKS;
      u32 lo = 0, hi = R;  // the source: the last p with prefix[p] <= g
      while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (sm.msgs[mid] <= g) lo = mid; else hi = mid;
      }
      const u32 p = lo, i = g - sm.msgs[p];
      const u8* msg = reinterpret_cast<const u8*>(a.rdma.local_base + a.off_msgs + ((u64)p * TM + i) * LLI_MSG_BYTES);
      const u8* payload = msg + LLI_PAYLOAD_AT;
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      const bool active = off < PAYLOAD_BYTES;
      const u32x4 v = active ? ptx::ld_cg_v4(payload + off) : u32x4{0, 0, 0, 0};
      u32 entry = LLI_NONE, w = 0;
      if (lane < LL_TOPK) {
        entry = ptx::ld_cg_u32(msg + LLI_HDR_BYTES + 4 * lane);
        if (c == 0 && has_weights) w = ptx::ld_cg_u32(msg + LLI_HDR_BYTES + 4 * (LL_TOPK + lane));
      }
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
        const u32 token = ptx::ld_cg_u32(msg);
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
          reinterpret_cast<u32*>(a.htoken)[h] = token;
          reinterpret_cast<u32*>(a.hj)[h] = j;
        }
        if (lane < LL_TOPK) {
          reinterpret_cast<i32*>(a.hrow)[h * LL_TOPK + lane] = row;
          if (has_weights) reinterpret_cast<u32*>(a.hweight)[h * LL_TOPK + lane] = w;
          if (row >= 0 && a.src_info != 0) reinterpret_cast<i32*>(a.src_info)[(u64)el * rows + slot] = (i32)token;
        }
      }
      const u32 valid = __ballot_sync(FULL_WARP_MASK, row >= 0);
      u8* recv_x = reinterpret_cast<u8*>(a.recv_x);
      for (u32 m = valid; m != 0; m &= m - 1) {
        const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
        if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(recv_x + (u64)r * PAYLOAD_BYTES + off), v);
      }
#if LL_FP8
      if (c == 0 && valid != 0) {
        const u8* scales = payload + LL_HIDDEN;
        if ((a.flags & LL_FLAG_UE8M0) == 0) {
          for (u32 m = valid; m != 0; m &= m - 1) {
            const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
            u32* col0 = reinterpret_cast<u32*>(a.recv_scales) + (u64)(r / rows) * SCALE_GROUPS * rows + r % rows;
            for (u32 gidx = lane; gidx < SCALE_GROUPS; gidx += WARP_SIZE) col0[(u64)gidx * rows] = ptx::ld_cg_u32(scales + 4 * gidx);
          }
        } else {
          for (u32 m = valid; m != 0; m &= m - 1) {
            const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
            u32* col0 = reinterpret_cast<u32*>(a.recv_scales) + (u64)(r / rows) * UE8M0_WORDS * rows + r % rows;
            for (u32 jw = lane; jw < UE8M0_WORDS; jw += WARP_SIZE) {
              const u32x4 f = ptx::ld_cg_v4(scales + 16 * jw);
              col0[(u64)jw * rows] =
                  ((f.x >> 23) & 0xffu) | (((f.y >> 23) & 0xffu) << 8) | (((f.z >> 23) & 0xffu) << 16) | (((f.w >> 23) & 0xffu) << 24);
            }
          }
        }
      }
#endif
    }
  }
  lli_recv_end(a, sm, expected, epoch, workers, d);
}

namespace moelink::internode_ll {
// moelink::internode_ll::dispatch: low-latency dispatch across nodes, send and/or receive phase.
//   grid: W worker blocks (+ the emulated NIC's, transport.cuh), LL_THREADS threads; cooperative when both
//         phases run in one launch.
//   SEND  every block waits until the destinations handed the set back; block 0 validates, keeps the
//         handle copies and puts every rank its meta block; the other blocks (block 0 when alone) put one
//         message per (token, destination) with put_signal(ADD 1). The last block stores the epoch.
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
  if (sm.abort == 0) {
    if (blockIdx.x == 0) lli_combine_check(a, d, sm, epoch);
    if (a.host_problem == 0 && (blockIdx.x != 0 || workers == 1)) {
      const u32 data_blocks = workers == 1 ? 1 : workers - 1;
      const u32 block = workers == 1 ? 0 : blockIdx.x - 1;
      lli_combine_rows(a, d, block * LL_WARPS + warp_id(), data_blocks * LL_WARPS);
    }
  }
  const LliOp op = lli_op(a);
  if (lli_last_block(op.send_done, sm, workers) && threadIdx.x == 0 && sm.phase_ok) {
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
