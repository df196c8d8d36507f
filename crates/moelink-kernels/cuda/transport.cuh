// moelink's transport seam for the RDMA domain: every byte an internode kernel moves to a rank of another
// node goes through the functions of `namespace rdma` below, and nothing else in a kernel knows which engine
// carries it. Peers inside a node (the NVLink domain) are reached with plain peer-pointer stores, as
// intranode; this header is only about the RDMA domain.
//
// The engine is chosen at JIT time (MOELINK_TRANSPORT, from moelink_kernels::transport::Transport):
//   MOELINK_TRANSPORT_PTR      peer pointers: a put is a warp's 16-byte stores into the peer's mapped
//                              region, done when the call returns. For virtual nodes in one process (or one
//                              host's processes through CUDA IPC) and for tests.
//   MOELINK_TRANSPORT_EMU_NIC  an emulated NIC (tests only): a put becomes a descriptor in one of this rank's
//                              queues (one per QP); the last `nic_blocks` blocks of the grid are the NIC and
//                              execute the descriptors later: in order within a QP, out of order across QPs,
//                              each no earlier than `nic_delay_ns` after it was posted, through one link
//                              per rank of `nic_bytes_per_us` (no credit while it idles). With a reorder
//                              window (`nic_reorder_us`) the QPs are served in a seeded random order and
//                              every descriptor carrying data waits a further seeded random time below
//                              twice the window, while bare signals go at once: a signal posted on one QP
//                              after data on another overtakes it, as on a real
//                              NIC's independent QPs. A protocol that relies on an order real RDMA does not
//                              give (a signal on one QP after data on another, without a fence) fails here;
//                              over NVLink it would pass.
//   MOELINK_TRANSPORT_NVSHMEM  NVSHMEM's device API (IBGDA or the proxy on a cluster, P2P between PEs of one
//                              host). NVSHMEM 3.4.5 chooses the QP itself: the `qp` argument is a hint only.
//
// The contract every backend keeps (and every protocol may rely on, and nothing more):
//   - Addresses are byte offsets into the RDMA region, which is symmetric: the same offset names the same
//     object on every rank. A put's source lies in the caller's own region (RDMA reads it from registered
//     memory) and must not change until the put has completed (`quiet`, or a signal from the receiver that
//     implies it arrived).
//   - put_signal: the signal is applied at the destination only after the put's data is visible there.
//   - window: where the peer's region is reachable with stores, a warp may write there in place and signal
//     with put_window_signal_warp (the same guarantee); elsewhere it writes a staging area that the call puts.
//   - Two operations on the same QP from the same warp are delivered in issue order on emu-nic and on an RC
//     QP of a NIC — but NOT with the nvshmem backend on NVSHMEM 3.4.5, which picks the QP of every operation
//     itself (`qp` is a hint it ignores), so two operations named for one QP may travel on different ones.
//     Portable protocols order data and signal either in one put_signal or with a fence.
//   - fence(qp): operations the calling thread's rank issued before are delivered before any it issues after
//     (NVSHMEM: nvshmem_fence; IBGDA implements it as a quiet). quiet(qp): every operation issued before has
//     completed (its data is at the destination, its source may be reused).
//   - Signals are u64 words in the RDMA region, changed only by signal operations (SET or ADD) and read by
//     their owner with wait_signal_geq (acquire: once the value is seen, the data put before it is visible).
//   - wait_signal_geq has the caller's deadline on every backend; on expiry it records ERR_TIMEOUT and returns
//     false. On ptr and emu-nic every other call that can wait (a full emulated queue, fence, quiet) has it
//     too. The nvshmem backend ignores the deadline in put, put_signal, signal, fence and quiet: those are
//     NVSHMEM device calls that wait inside the library as long as it takes (a full send queue; quiet, and
//     fence under IBGDA, until the NIC reports completions), so a peer or link that stops completing RDMA
//     work can hold the kernel there; the host's bounded stream wait then reports it. Nothing traps.
//
// Calling convention: `_warp` functions are called by all 32 lanes of a warp with the same arguments;
// `_thread` functions by one thread.
//
// Frame of a kernel that uses the seam: its first statement is `if (rdma::nic_block(args.rdma, deadline))
// return;` (with the emulated NIC the last blocks of the grid serve the queues there, and nothing else),
// work is spread over `rdma::num_worker_blocks(args.rdma)` blocks, and every worker thread holds an
// `rdma::WorkerScope` for its whole life (the NIC drains and exits once every worker thread has left).
// Launch such kernels cooperatively: the NIC blocks must run alongside the workers.
#pragma once
#include "ptx.cuh"

#define MOELINK_TRANSPORT_PTR 1
#define MOELINK_TRANSPORT_EMU_NIC 2
#define MOELINK_TRANSPORT_NVSHMEM 3
#ifndef MOELINK_TRANSPORT
#error "transport.cuh needs MOELINK_TRANSPORT (moelink_kernels::transport::Transport)"
#endif
#if MOELINK_TRANSPORT != MOELINK_TRANSPORT_PTR && MOELINK_TRANSPORT != MOELINK_TRANSPORT_EMU_NIC && \
    MOELINK_TRANSPORT != MOELINK_TRANSPORT_NVSHMEM
#error "MOELINK_TRANSPORT names no backend"
#endif

// QPs a rank may name per peer (RdmaArgs::num_qps <= RDMA_MAX_QPS).
constexpr u32 RDMA_MAX_QPS = 32;
static_assert(RDMA_MAX_QPS <= WARP_SIZE, "nic_serve reads a QP a lane");
// Descriptors per emulated QP: a poster waits (deadline) while its QP holds this many undelivered ones.
constexpr u32 NIC_RING = 256;
// `qp` value of quiet_thread / fence_thread that covers every QP.
constexpr u32 RDMA_ALL_QPS = 0xffffffffu;

// Signal operations.
constexpr u32 SIGNAL_SET = 0;
constexpr u32 SIGNAL_ADD = 1;

#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_NVSHMEM
#include "transport_nvshmem.cuh"
#endif

// What a kernel needs to reach the RDMA domain (moelink_kernels::transport::RdmaArgs; 64 bytes).
struct RdmaArgs {
  u64 local_base;      // this rank's RDMA region (device address)
  u64 peer_bases;      // ptr / emu-nic: device address of u64[num_ranks], every rank's region mapped here
  u64 nic_state;       // emu-nic: this rank's NicState (device memory); 0 otherwise
  u64 nic_delay_ns;    // emu-nic: a descriptor runs no earlier than this long after it was posted
  u32 nic_bytes_per_us;  // emu-nic: rate cap of this rank's NIC (0: none)
  u32 nic_reorder_us;  // emu-nic: reorder window in microseconds (0: QPs served in turn, no extra waits)
  u32 nic_blocks;      // emu-nic: blocks at the end of the grid that act as the NIC (0 otherwise)
  u32 nic_seed;        // emu-nic: scheduler seed (mixed with the rank and a per-launch counter)
  u32 rank;            // this rank in the RDMA domain (the world)
  u32 num_ranks;
  u32 num_qps;         // QPs per peer, 1..RDMA_MAX_QPS
  u32 nvlink_ranks_per_node;  // emu-nic: peers of this rank's node (ranks / this) go over NVLink, as pointer
                              // stores (0: every peer through the NIC); the other backends ignore it
};
static_assert(sizeof(RdmaArgs) == 64, "RdmaArgs is 64 bytes (moelink_kernels::transport::RdmaArgs)");

// ============================================================================================ emulated NIC
// One work request (64 bytes). `ready` = ticket + 1 once the poster has written the rest (release).
struct NicDesc {
  u64 src_off, dst_off, sig_off, value, post_ns;
  u32 bytes, pe, kind, ready;
  u32 sig_op, pad;
};
static_assert(sizeof(NicDesc) == 48 + 16, "NicDesc is 64 bytes");

constexpr u32 NIC_PUT = 1;
constexpr u32 NIC_SIGNAL = 2;
constexpr u32 NIC_PUT_SIGNAL = NIC_PUT | NIC_SIGNAL;

// One QP: posters take tickets from `tail`; a NIC block that claimed the QP (`busy`) executes its next ticket
// and publishes `head` (executed so far) with release, which frees ring slots and completes quiets, then lets
// the claim go: one descriptor of a QP at a time, in ticket order.
struct alignas(128) NicQueue {
  u32 tail;
  u32 pad0[31];
  u32 head;
  u32 busy;
  u32 pad1[30];
};

// A rank's NIC (moelink_kernels::transport::NIC_STATE_BYTES), zeroed once when the buffer is created;
// counters are monotonic across launches (ticket arithmetic is wrap-safe).
struct NicState {
  NicQueue queue[RDMA_MAX_QPS];
  alignas(128) u32 workers_exited;  // worker threads of this launch that have finished
  alignas(128) u32 nics_exited;     // NIC blocks of this launch that have finished
  alignas(128) u32 launches;        // launches served (scheduler seed)
  alignas(128) u64 link_free_ns;    // the rank's link, shared by its NIC blocks: when the puts admitted so far have left
  alignas(128) NicDesc ring[RDMA_MAX_QPS][NIC_RING];
};

#ifdef MOELINK_SIZEOF_NIC_STATE
static_assert(sizeof(NicState) == MOELINK_SIZEOF_NIC_STATE, "NicState mirrors moelink_kernels::transport::NIC_STATE_BYTES");
#endif

// A NIC block's statistics, stored by its thread 0 as it exits when the kernel gives them a place (a
// timing trace): %globaltimer stamps of its start, its end, its first put's start and its last put's end;
// nanoseconds it spent executing descriptors, idle with nothing posted, and idle with a put posted but held
// by the link (or the delay); the descriptors it executed and the bytes it put.
constexpr u32 NIC_STAT_START = 0, NIC_STAT_END = 1, NIC_STAT_FIRST_PUT = 2, NIC_STAT_LAST_PUT = 3, NIC_STAT_BUSY_NS = 4,
              NIC_STAT_IDLE_NS = 5, NIC_STAT_CAPPED_NS = 6, NIC_STAT_DESCRIPTORS = 7, NIC_STAT_BYTES = 8, NIC_STAT_WORDS = 9;

namespace rdma {

__device__ __forceinline__ NicState* nic_of(const RdmaArgs& a) { return reinterpret_cast<NicState*>(a.nic_state); }

__device__ __forceinline__ u64 peer_base(const RdmaArgs& a, u32 pe) {
  return reinterpret_cast<const u64*>(a.peer_bases)[pe];
}

// Blocks of the grid that do the kernel's own work (the rest, with the emulated NIC, are the NIC).
__device__ __forceinline__ u32 num_worker_blocks(const RdmaArgs& a) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  return gridDim.x - a.nic_blocks;
#else
  (void)a;
  return gridDim.x;
#endif
}

// Held by every worker thread for its whole life: its destructor tells the emulated NIC that this thread
// posts nothing more. (A destructor, so that every early `return` of a kernel counts too.)
struct WorkerScope {
  const RdmaArgs& args;
  __device__ explicit WorkerScope(const RdmaArgs& a) : args(a) {}
  __device__ ~WorkerScope() {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
    // Release: every descriptor this thread posted is visible to the NIC before it sees the count.
    ptx::red_add_release_gpu(&nic_of(args)->workers_exited, 1u);
#endif
  }
};

// 16-byte vectors then single bytes, spread over `lanes` threads starting at `lane`. Each thread keeps
// eight loads in flight before their stores: a copier's rate is its bytes in flight over the load latency,
// and a put of a whole chunk is one warp's copy.
__device__ __forceinline__ void copy_bytes(u8* dst, const u8* src, u32 bytes, u32 lane, u32 lanes) {
  constexpr u32 U = 8;
  const u32 vectors = bytes / 16;
  const bool aligned = ((reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src)) & 15) == 0;
  u32 done = 0;
  if (aligned) {
    const u32x4* from = reinterpret_cast<const u32x4*>(src);
    u32x4* to = reinterpret_cast<u32x4*>(dst);
    for (u32 base = 0; base < vectors; base += U * lanes) {
      u32x4 v[U];
#pragma unroll
      for (u32 u = 0; u < U; u++) {
        const u32 i = base + u * lanes + lane;
        if (i < vectors) v[u] = ptx::ld_v4(from + i);
      }
#pragma unroll
      for (u32 u = 0; u < U; u++) {
        const u32 i = base + u * lanes + lane;
        if (i < vectors) ptx::st_na_v4(to + i, v[u]);
      }
    }
    done = vectors * 16;
  }
  for (u32 i = done + lane; i < bytes; i += lanes) dst[i] = src[i];
}

__device__ __forceinline__ void apply_signal_sys(u64* sig, u64 value, u32 op) {
  if (op == SIGNAL_ADD) {
    ptx::red_add_relaxed_sys_u64(sig, value);
  } else {
    ptx::st_relaxed_sys_u64(sig, value);
  }
}

#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
// Posts one descriptor on `qp` (one thread). Waits (deadline) while the QP's ring is full.
__device__ __forceinline__ bool nic_post(const RdmaArgs& a, u32 qp, const NicDesc& d, const Deadline& dl) {
  NicState* nic = nic_of(a);
  NicQueue& q = nic->queue[qp];
  const u32 ticket = ptx::atom_add_relaxed_gpu(&q.tail, 1u);
  const bool room = spin_until([&]() { return (i32)(ticket - ptx::ld_acquire_gpu(&q.head)) < (i32)NIC_RING; }, dl, d.pe);
  if (!room) return false;
  NicDesc* slot = &nic->ring[qp][ticket % NIC_RING];
  slot->src_off = d.src_off;
  slot->dst_off = d.dst_off;
  slot->sig_off = d.sig_off;
  slot->value = d.value;
  slot->post_ns = ptx::globaltimer();
  slot->bytes = d.bytes;
  slot->pe = d.pe;
  slot->kind = d.kind;
  slot->sig_op = d.sig_op;
  ptx::st_release_gpu(&slot->ready, ticket + 1);
  return true;
}

// Waits until every descriptor posted on `qp` (or on every QP) so far has been executed. The QPs' tails and
// heads are first loaded together, relaxed, and one fence after the last head seen makes it an acquire (one
// acquire load after another costs one thread ~10 us for 24 QPs, at the internode notify's end). A QP found
// behind is waited for up to its tail as read again then, which covers what was posted before.
__device__ __forceinline__ bool nic_quiet(const RdmaArgs& a, u32 qp, const Deadline& dl) {
  NicState* nic = nic_of(a);
  const u32 first = qp == RDMA_ALL_QPS ? 0 : qp, count = qp == RDMA_ALL_QPS ? a.num_qps : 1;
  u32 behind = 0;  // bit i: QP first + i has descriptors still to execute
#pragma unroll
  for (u32 i = 0; i < RDMA_MAX_QPS; i++) {
    if (i < count) {
      const u32 posted = ptx::ld_relaxed_gpu(&nic->queue[first + i].tail);
      const u32 executed = ptx::ld_relaxed_gpu(&nic->queue[first + i].head);
      if ((i32)(executed - posted) < 0) behind |= 1u << i;
    }
  }
  for (; behind != 0; behind &= behind - 1) {
    NicQueue& q = nic->queue[first + __ffs(behind) - 1];
    const u32 posted = ptx::ld_relaxed_gpu(&q.tail);
    if (!spin_until([&]() { return (i32)(ptx::ld_relaxed_gpu(&q.head) - posted) >= 0; }, dl, NO_PEER)) return false;
  }
  ptx::fence_acq_rel_gpu();
  return true;
}

// xorshift32: the scheduler's dice.
__device__ __forceinline__ u32 nic_rand(u32& s) {
  s ^= s << 13;
  s ^= s >> 17;
  s ^= s << 5;
  return s;
}

// How far ahead of the link's clock a put may be admitted: a NIC block starts its copy while the put before
// it is still on the wire, as a NIC's DMA runs ahead of its link. Idle time beyond this builds no credit.
constexpr u64 NIC_LINK_SLACK_NS = 2000;

// The NIC: runs on the last `nic_blocks` blocks, which serve every QP through the rank's one link (a clock
// of when the link is free, which each admitted put moves on by its bytes over the rate). Warp 0 picks the
// next descriptor (the scheduler): at the head of a QP no block holds, past its hold, one of the block's
// own QPs (q % nic_blocks), else the oldest of any (with reordering, a random QP's); thread 0 claims the
// QP, the whole block copies the bytes, then after the block's barrier thread 0 alone fences at system
// scope (cumulative over the block's stores), applies the signal, publishes the QP's head and lets the QP
// go. Any block serves any QP, as a NIC's DMA engines are not tied to QPs (blocks tied to QPs are busy in
// proportion to their QPs, and the few with more set the pace). Ends once every worker thread has left and
// every QP is drained — or, after a fatal error of this rank, once the workers have left (what is still
// queued is dropped, like a link that went down; the peers' deadlines name this rank).
// `stats`: where this block's NIC_STAT_WORDS go (host-mapped), or 0.
__device__ __forceinline__ void nic_serve(const RdmaArgs& a, const Deadline& dl, u64 stats) {
  NicState* nic = nic_of(a);
  const u32 me = blockIdx.x - (gridDim.x - a.nic_blocks);
  const u32 expected_workers = (gridDim.x - a.nic_blocks) * blockDim.x;
  __shared__ NicDesc s_desc;
  __shared__ u32 s_action;  // 0: idle, 1: execute s_desc (QP s_qp), 2: exit
  __shared__ u32 s_qp;
  u32 rng = (a.nic_seed * 0x9E3779B1u) ^ (a.rank * 0x85EBCA77u) ^ (ptx::ld_relaxed_gpu(&nic->launches) * 0xC2B2AE3Du) ^ (me + 1);
  if (rng == 0) rng = 1;
  const u64 start_ns = ptx::globaltimer();
  // Thread 0's statistics, in shared memory (registers are what the workers' code is short of): the time
  // since its last look goes to what it decided then.
  __shared__ u64 s_stat[NIC_STAT_WORDS];
  __shared__ u64 s_last_look;
  __shared__ u32 s_state;
  if (threadIdx.x == 0) {
    for (u32 w = 0; w < NIC_STAT_WORDS; w++) s_stat[w] = 0;
    s_last_look = start_ns;
    s_state = NIC_STAT_IDLE_NS;
  }
  auto spend = [&](u64 until) {
    s_stat[s_state] += until - s_last_look;
    s_last_look = until;
  };
  for (;;) {
    if (threadIdx.x < WARP_SIZE) {
      // Warp 0 schedules: lane q looks at QP q's next descriptor, lane 0 decides.
      const u32 lane = threadIdx.x;
      u32 action = 0;
      u64 now = 0;
      if (lane == 0) {
        now = ptx::globaltimer();
        spend(now);
      }
      now = __shfl_sync(FULL_WARP_MASK, now, 0);
      // Free (no block holds the QP), posted, and past its hold: data waits a seeded random part of the
      // reorder window (a function of the seed, QP and ticket, so the wait is fixed once posted); bare
      // signals do not.
      bool may_go = false, held = false;
      u64 posted = ~0ull;
      if (lane < a.num_qps && ptx::ld_relaxed_gpu(&nic->queue[lane].busy) == 0u) {
        const u32 next = ptx::ld_acquire_gpu(&nic->queue[lane].head);
        const NicDesc* d = &nic->ring[lane][next % NIC_RING];
        if (ptx::ld_acquire_gpu(&d->ready) == next + 1) {
          u64 hold = 0;
          if (a.nic_reorder_us != 0 && (d->kind & NIC_PUT) != 0) {
            const u32 h = (a.nic_seed * 0x9E3779B1u) ^ (lane * 0x85EBCA77u) ^ (next * 0xC2B2AE3Du) ^ 0x27d4eb2fu;
            hold = (u64)((h ^ (h >> 15)) * 0x2c1b3c6du % (2u * a.nic_reorder_us)) * 1000;
          }
          posted = d->post_ns;
          held = now - posted < a.nic_delay_ns + hold;
          may_go = !held;
        }
      }
      bool capped = __any_sync(FULL_WARP_MASK, held);
      // Which: one of this block's own QPs (q % nic_blocks == this block) when one is ready, so that the
      // blocks do not race for one claim; else the oldest ready descriptor of another QP (the blocks with
      // fewer QPs, or less queued, take over the others' backlog). When reordering, the first ready QP from
      // a random one on (older descriptors of other QPs may wait: a NIC slower than its posters would
      // otherwise still deliver in posting order).
      const u32 all_ready = __ballot_sync(FULL_WARP_MASK, may_go);
      const u32 own_ready = __ballot_sync(FULL_WARP_MASK, may_go && lane % a.nic_blocks == me);
      const u32 ready = own_ready != 0u ? own_ready : all_ready;
      u32 pick = RDMA_MAX_QPS;
      if (ready != 0u && a.nic_reorder_us != 0) {
        u32 first = 0;
        if (lane == 0) first = nic_rand(rng) % a.num_qps;
        first = __shfl_sync(FULL_WARP_MASK, first, 0);
        const u32 rotated = (u32)((((u64)ready << 32) | ready) >> first);
        pick = (first + __ffs(rotated) - 1) % WARP_SIZE;
      } else if (ready != 0u) {
        u64 best = ((ready >> lane) & 1u) != 0u ? posted : ~0ull;
        u32 best_qp = lane;
        for (u32 o = WARP_SIZE / 2; o > 0; o >>= 1) {
          const u64 other = __shfl_xor_sync(FULL_WARP_MASK, best, o);
          const u32 other_qp = __shfl_xor_sync(FULL_WARP_MASK, best_qp, o);
          if (other < best || (other == best && other_qp < best_qp)) {
            best = other;
            best_qp = other_qp;
          }
        }
        pick = best_qp;
      }
      // Lane 0 claims it (a block that loses the claim looks again); the head read after the claim is the
      // one to execute, since only a claim holder moves it.
      if (lane == 0 && pick < RDMA_MAX_QPS && ptx::atom_cas_acq_rel_gpu(&nic->queue[pick].busy, 0u, 1u) == 0u) {
        NicQueue& queue = nic->queue[pick];
        const u32 next = ptx::ld_acquire_gpu(&queue.head);
        const NicDesc* d = &nic->ring[pick][next % NIC_RING];
        bool go = ptx::ld_acquire_gpu(&d->ready) == next + 1;
        // The link: a put goes once the link's clock is within the slack of now, and moves it on by its
        // bytes at the rate (a block that loses the race to another looks again).
        if (go && a.nic_bytes_per_us != 0 && (d->kind & NIC_PUT) != 0) {
          const u64 free_ns = ptx::ld_relaxed_sys_u64(&nic->link_free_ns);
          const u64 next_free = (free_ns > now ? free_ns : now) + (u64)d->bytes * 1000 / a.nic_bytes_per_us;
          if (free_ns > now + NIC_LINK_SLACK_NS || ptx::atom_cas_relaxed_gpu_u64(&nic->link_free_ns, free_ns, next_free) != free_ns) {
            capped = true;
            go = false;
          }
        }
        if (go) {
          s_desc = *d;
          s_qp = pick;
          action = 1;
        } else {
          ptx::st_release_gpu(&queue.busy, 0u);
        }
      }
      if (lane == 0) s_state = action == 1 ? NIC_STAT_BUSY_NS : capped ? NIC_STAT_CAPPED_NS : NIC_STAT_IDLE_NS;
      // Idle: done once every worker thread has left and every QP is drained, lane q reading QP q's words: read
      // one after the other by one lane, they held the launch's end ~10 us past its workers'.
      if (__shfl_sync(FULL_WARP_MASK, action, 0) == 0u) {
        const bool exited = ptx::ld_acquire_gpu(&nic->workers_exited) == expected_workers;
        const bool drained = lane >= a.num_qps || ptx::ld_relaxed_gpu(&nic->queue[lane].head) == ptx::ld_relaxed_gpu(&nic->queue[lane].tail);
        if (__all_sync(FULL_WARP_MASK, exited) && (__all_sync(FULL_WARP_MASK, drained) || error_raised(dl))) action = 2;
      }
      if (lane == 0) s_action = action;
    }
    __syncthreads();
    const u32 action = s_action;
    if (action == 2) break;
    if (action == 1) {
      const NicDesc d = s_desc;
      if ((d.kind & NIC_PUT) != 0) {
        copy_bytes(reinterpret_cast<u8*>(peer_base(a, d.pe) + d.dst_off), reinterpret_cast<const u8*>(a.local_base + d.src_off),
                   d.bytes, threadIdx.x, blockDim.x);
      }
      __syncthreads();  // the block's stores, before thread 0's fence
      if (threadIdx.x == 0) {
        s_stat[NIC_STAT_DESCRIPTORS]++;
        if ((d.kind & NIC_PUT) != 0) {
          ptx::fence_acq_rel_sys();  // the block's copy (ordered before it by the barrier), before the signal and the head
          if (s_stat[NIC_STAT_FIRST_PUT] == 0) s_stat[NIC_STAT_FIRST_PUT] = s_last_look;
          s_stat[NIC_STAT_LAST_PUT] = ptx::globaltimer();
          s_stat[NIC_STAT_BYTES] += d.bytes;
        }
        if ((d.kind & NIC_SIGNAL) != 0) {
          apply_signal_sys(reinterpret_cast<u64*>(peer_base(a, d.pe) + d.sig_off), d.value, d.sig_op);
          ptx::fence_acq_rel_sys();
        }
        ptx::st_release_gpu(&nic->queue[s_qp].head, ptx::ld_relaxed_gpu(&nic->queue[s_qp].head) + 1);
        ptx::st_release_gpu(&nic->queue[s_qp].busy, 0u);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && stats != 0) {
    volatile u64* w = reinterpret_cast<volatile u64*>(stats);
    spend(ptx::globaltimer());
    s_stat[NIC_STAT_START] = start_ns;
    s_stat[NIC_STAT_END] = s_last_look;
    for (u32 i = 0; i < NIC_STAT_WORDS; i++) w[i] = s_stat[i];
  }
  // The last NIC block out resets the launch counters for the next launch (stream-ordered after this one).
  if (threadIdx.x == 0 && ptx::atom_add_acq_rel_gpu(&nic->nics_exited, 1u) + 1 == a.nic_blocks) {
    ptx::st_release_gpu(&nic->workers_exited, 0u);
    ptx::st_relaxed_sys_u64(&nic->link_free_ns, 0);
    ptx::st_release_gpu(&nic->nics_exited, 0u);
    ptx::st_release_gpu(&nic->launches, ptx::ld_relaxed_gpu(&nic->launches) + 1);
  }
}
#endif

// True on the blocks that acted as the emulated NIC (the kernel returns at once); false on worker blocks
// and with the other backends. `stats`: where a NIC block's NIC_STAT_WORDS go, or 0.
__device__ __forceinline__ bool nic_block(const RdmaArgs& a, const Deadline& dl, u64 stats = 0) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  if (blockIdx.x < gridDim.x - a.nic_blocks) return false;
  nic_serve(a, dl, stats);
  return true;
#else
  (void)a;
  (void)dl;
  (void)stats;
  return false;
#endif
}

// Peer-pointer operations (the ptr backend, and NVLink peers with the emulated NIC): a warp's stores, every
// lane's system fence (one lane's fence does not cover the others' stores) and a warp rendezvous, so that
// the put is complete when the call returns and any later operation of the warp — a signal from one lane
// included — is ordered after all of it.
__device__ __forceinline__ void ptr_put_warp(const RdmaArgs& a, u32 pe, u64 dst_off, u64 src_off, u32 bytes) {
  __syncwarp();
  copy_bytes(reinterpret_cast<u8*>(peer_base(a, pe) + dst_off), reinterpret_cast<const u8*>(a.local_base + src_off), bytes,
             threadIdx.x % WARP_SIZE, WARP_SIZE);
  ptx::fence_acq_rel_sys();
  __syncwarp();
}

__device__ __forceinline__ void ptr_put_signal_warp(const RdmaArgs& a, u32 pe, u64 dst_off, u64 src_off, u32 bytes, u64 sig_off, u64 value,
                                                    u32 sig_op) {
  ptr_put_warp(a, pe, dst_off, src_off, bytes);
  if (threadIdx.x % WARP_SIZE == 0) apply_signal_sys(reinterpret_cast<u64*>(peer_base(a, pe) + sig_off), value, sig_op);
  __syncwarp();
}

// Whether `pe` is reached over NVLink instead of the emulated NIC.
__device__ __forceinline__ bool over_nvlink(const RdmaArgs& a, u32 pe) {
  return a.nvlink_ranks_per_node != 0 && pe / a.nvlink_ranks_per_node == a.rank / a.nvlink_ranks_per_node;
}

// ============================================================================================ operations

// Puts `bytes` from this rank's region at `src_off` to rank `pe`'s region at `dst_off` (non-blocking).
// The warp's lanes may have written the source just before: the call orders their stores first.
__device__ __forceinline__ bool put_warp(const RdmaArgs& a, u32 qp, u32 pe, u64 dst_off, u64 src_off, u32 bytes, const Deadline& dl) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)qp;
  (void)dl;
  ptr_put_warp(a, pe, dst_off, src_off, bytes);
  return true;
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  if (over_nvlink(a, pe)) {
    ptr_put_warp(a, pe, dst_off, src_off, bytes);
    return true;
  }
  ptx::fence_acq_rel_gpu();  // this lane's source stores, before the NIC block reads them
  __syncwarp();
  bool ok = true;
  if (threadIdx.x % WARP_SIZE == 0) {
    NicDesc d{};
    d.src_off = src_off;
    d.dst_off = dst_off;
    d.bytes = bytes;
    d.pe = pe;
    d.kind = NIC_PUT;
    ok = nic_post(a, qp % a.num_qps, d, dl);
  }
  return __shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) != 0;
#else
  (void)qp;
  (void)dl;
  ptx::fence_acq_rel_sys();
  __syncwarp();
  nvshmem_seam::put_nbi_warp(a.local_base + dst_off, a.local_base + src_off, bytes, pe);
  return true;
#endif
}

// As put_warp, then `sig_op(value)` on the u64 signal at `sig_off` of rank `pe`, applied only once the
// data is visible there.
__device__ __forceinline__ bool put_signal_warp(const RdmaArgs& a, u32 qp, u32 pe, u64 dst_off, u64 src_off, u32 bytes, u64 sig_off,
                                                u64 value, u32 sig_op, const Deadline& dl) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)qp;
  (void)dl;
  ptr_put_signal_warp(a, pe, dst_off, src_off, bytes, sig_off, value, sig_op);
  return true;
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  if (over_nvlink(a, pe)) {
    ptr_put_signal_warp(a, pe, dst_off, src_off, bytes, sig_off, value, sig_op);
    return true;
  }
  ptx::fence_acq_rel_gpu();
  __syncwarp();
  bool ok = true;
  if (threadIdx.x % WARP_SIZE == 0) {
    NicDesc d{};
    d.src_off = src_off;
    d.dst_off = dst_off;
    d.sig_off = sig_off;
    d.value = value;
    d.bytes = bytes;
    d.pe = pe;
    d.kind = NIC_PUT_SIGNAL;
    d.sig_op = sig_op;
    ok = nic_post(a, qp % a.num_qps, d, dl);
  }
  return __shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) != 0;
#else
  (void)qp;
  (void)dl;
  ptx::fence_acq_rel_sys();
  __syncwarp();
  nvshmem_seam::put_signal_nbi_warp(a.local_base + dst_off, a.local_base + src_off, bytes, a.local_base + sig_off, value, sig_op, pe);
  return true;
#endif
}

// Where a warp writes bytes bound for rank `pe`'s region at `dst_off`: straight there when this GPU reaches
// pe's region with stores (ptr; the emulated NIC's NVLink peers; a peer NVSHMEM maps, or this rank), else
// this rank's own region at `stage_off`, for put_window_signal_warp to carry. Writing in place saves the
// copy a put does on the SMs when no NIC does it. The same on every lane.
struct Window {
  u8* ptr;
  bool direct;
};
__device__ __forceinline__ Window window(const RdmaArgs& a, u32 pe, u64 dst_off, u64 stage_off) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)stage_off;
  return Window{reinterpret_cast<u8*>(peer_base(a, pe) + dst_off), true};
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  if (over_nvlink(a, pe)) return Window{reinterpret_cast<u8*>(peer_base(a, pe) + dst_off), true};
  return Window{reinterpret_cast<u8*>(a.local_base + stage_off), false};
#else
  const u64 p = nvshmem_seam::peer_ptr(a.local_base + dst_off, pe);
  if (p != 0) return Window{reinterpret_cast<u8*>(p), true};
  return Window{reinterpret_cast<u8*>(a.local_base + stage_off), false};
#endif
}

// Delivers the `bytes` written through `w` (window(a, pe, dst_off, stage_off)), then `sig_op(value)` on rank
// `pe`'s signal at `sig_off`, applied only once the bytes are visible there: in place, every lane fences its
// stores before one lane signals; staged, one put_signal. The bytes are the warp's, or other threads' that
// fenced their stores at system scope before a release this warp acquired (several warps staging one put).
__device__ __forceinline__ bool put_window_signal_warp(const RdmaArgs& a, u32 qp, u32 pe, const Window& w, u64 dst_off, u64 stage_off, u32 bytes,
                                                       u64 sig_off, u64 value, u32 sig_op, const Deadline& dl);

// `sig_op(value)` on the u64 signal at `sig_off` of rank `pe`. Not ordered after earlier puts: fence first
// when it announces them (or use put_signal).
__device__ __forceinline__ bool signal_thread(const RdmaArgs& a, u32 qp, u32 pe, u64 sig_off, u64 value, u32 sig_op, const Deadline& dl) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)qp;
  (void)dl;
  apply_signal_sys(reinterpret_cast<u64*>(peer_base(a, pe) + sig_off), value, sig_op);
  return true;
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  if (over_nvlink(a, pe)) {
    apply_signal_sys(reinterpret_cast<u64*>(peer_base(a, pe) + sig_off), value, sig_op);
    return true;
  }
  NicDesc d{};
  d.sig_off = sig_off;
  d.value = value;
  d.pe = pe;
  d.kind = NIC_SIGNAL;
  d.sig_op = sig_op;
  return nic_post(a, qp % a.num_qps, d, dl);
#else
  (void)qp;
  (void)dl;
  nvshmem_seam::signal_op(a.local_base + sig_off, value, sig_op, pe);
  return true;
#endif
}

__device__ __forceinline__ bool put_window_signal_warp(const RdmaArgs& a, u32 qp, u32 pe, const Window& w, u64 dst_off, u64 stage_off, u32 bytes,
                                                       u64 sig_off, u64 value, u32 sig_op, const Deadline& dl) {
  if (!w.direct) return put_signal_warp(a, qp, pe, dst_off, stage_off, bytes, sig_off, value, sig_op, dl);
  __syncwarp();
  ptx::fence_acq_rel_sys();
  __syncwarp();
  bool ok = true;
  if (threadIdx.x % WARP_SIZE == 0) ok = signal_thread(a, qp, pe, sig_off, value, sig_op, dl);
  return __shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) != 0;
}

// Operations issued before (by this rank) are delivered before operations this thread issues after.
__device__ __forceinline__ bool fence_thread(const RdmaArgs& a, u32 qp, const Deadline& dl) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)a;
  (void)qp;
  (void)dl;
  ptx::fence_acq_rel_sys();
  return true;
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  (void)qp;
  // Across QPs only completion orders: the emulated NIC's fence is a quiet (as NVSHMEM's under IBGDA); the
  // system fence orders this thread's NVLink stores.
  ptx::fence_acq_rel_sys();
  return nic_quiet(a, RDMA_ALL_QPS, dl);
#else
  (void)a;
  (void)qp;
  (void)dl;
  nvshmem_seam::fence();
  return true;
#endif
}

// Operations issued before on `qp` (RDMA_ALL_QPS: on every QP) have completed.
__device__ __forceinline__ bool quiet_thread(const RdmaArgs& a, u32 qp, const Deadline& dl) {
#if MOELINK_TRANSPORT == MOELINK_TRANSPORT_PTR
  (void)a;
  (void)qp;
  (void)dl;
  ptx::fence_acq_rel_sys();
  return true;
#elif MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC
  ptx::fence_acq_rel_sys();
  return nic_quiet(a, qp == RDMA_ALL_QPS ? qp : qp % a.num_qps, dl);
#else
  (void)a;
  (void)qp;
  (void)dl;
  nvshmem_seam::quiet();
  return true;
#endif
}

// This rank's u64 signal at `sig_off`, now (relaxed).
__device__ __forceinline__ u64 read_signal(const RdmaArgs& a, u64 sig_off) {
  return ptx::ld_relaxed_sys_u64(reinterpret_cast<const u64*>(a.local_base + sig_off));
}

// Waits until this rank's u64 signal at `sig_off` reaches `target` (wrap-safe); acquire, so that the data
// put before the signal operations that reached it is visible. Deadline rules: spin_until (names `peer`).
__device__ __forceinline__ bool wait_signal_geq(const RdmaArgs& a, u64 sig_off, u64 target, const Deadline& dl, u32 peer) {
  const u64* sig = reinterpret_cast<const u64*>(a.local_base + sig_off);
  return spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(sig) - target) >= 0; }, dl, peer);
}

}  // namespace rdma
