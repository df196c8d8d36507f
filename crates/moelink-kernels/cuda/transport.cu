// moelink kernel family: the RDMA transport seam's own kernels — a barrier of every rank of the RDMA domain
// (internode buffers' barrier), a conformance check that every backend keeps the contract of
// transport.cuh, and a micro-benchmark of put and put+signal (latency and bandwidth).
//
// JIT constants (from moelink_kernels::transport::TransportVariant):
//   MOELINK_TRANSPORT                  the backend (transport.cuh)
//   TRANSPORT_THREADS                  threads per block (whole warps)
//   MOELINK_SIZEOF_TRANSPORT_CHECK_ARGS  sizeof(moelink_kernels::transport::TransportCheckArgs)
//   MOELINK_SIZEOF_TRANSPORT_BENCH_ARGS  sizeof(moelink_kernels::transport::TransportBenchArgs)
//   MOELINK_SIZEOF_NIC_STATE           moelink_kernels::transport::NIC_STATE_BYTES
//   MOELINK_SIZEOF_TRANSPORT_BARRIER_ARGS  sizeof(moelink_kernels::transport::TransportBarrierArgs)
//
// RDMA region of every rank (offsets from moelink_kernels::transport::CheckLayout / BenchLayout):
//   [0, TRANSPORT_SIGNAL_BYTES)   u64 signals: check — one counter per source rank; bench — ping-pong word
//                                 (0), bandwidth counter (1), start words per source (2 + source)
//   recv slots                    check: [source][message] slots of `slot_bytes`; bench: `bytes` per message
//   send slots                    [message] slots of `slot_bytes` (a put's source stays untouched until the
//                                 end of the launch, which quiets)
#include "transport.cuh"

#if !defined(TRANSPORT_THREADS) || !defined(MOELINK_SIZEOF_TRANSPORT_CHECK_ARGS) || !defined(MOELINK_SIZEOF_TRANSPORT_BENCH_ARGS) || \
    !defined(MOELINK_SIZEOF_NIC_STATE) || !defined(MOELINK_SIZEOF_TRANSPORT_BARRIER_ARGS)
#error "transport.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(sizeof(NicState) == MOELINK_SIZEOF_NIC_STATE, "NicState mirrors moelink_kernels::transport::NIC_STATE_BYTES");
static_assert(TRANSPORT_THREADS % WARP_SIZE == 0, "whole warps");

constexpr u32 TRANSPORT_WARPS = TRANSPORT_THREADS / WARP_SIZE;
constexpr u64 TRANSPORT_SIGNAL_BYTES = 4096;

struct TransportBarrierArgs {
  RdmaArgs rdma;
  u64 error_claim, error_record, timeout_ns;
  u64 counter;     // device u64 (local): barriers this rank has entered, incremented here (graph replays too)
  u64 signal_off;  // RDMA-region offset of u64[num_ranks]: barrier words, [p] set by rank p
};
static_assert(sizeof(TransportBarrierArgs) == MOELINK_SIZEOF_TRANSPORT_BARRIER_ARGS, "TransportBarrierArgs mirrors Rust");

// transport_barrier: one worker block (+ the emulated NIC's), TRANSPORT_THREADS threads, cooperative.
// Thread 0 takes the next barrier number e (counter + 1, stored back), sets word [me] of every rank to e
// (signal SET on QP p % num_qps), then waits until its own word [p] reached e for every rank p (deadline,
// naming p). Every rank counts its barriers the same way, so the numbers agree; a word only grows.
extern "C" __global__ void __launch_bounds__(TRANSPORT_THREADS, 1) transport_barrier(const __grid_constant__ TransportBarrierArgs a) {
  const Deadline dl = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_BARRIER);
  if (rdma::nic_block(a.rdma, dl)) return;
  rdma::WorkerScope scope(a.rdma);
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  u64* counter = reinterpret_cast<u64*>(a.counter);
  const u64 e = *counter + 1;
  *counter = e;
  const u32 me = a.rdma.rank, n = a.rdma.num_ranks;
  for (u32 i = 0; i < n; i++) {
    const u32 p = (me + i) % n;
    if (!rdma::signal_thread(a.rdma, p % a.rdma.num_qps, p, a.signal_off + 8ull * me, e, SIGNAL_SET, dl)) return;
  }
  for (u32 i = 0; i < n; i++) {
    const u32 p = (me + i) % n;
    if (!rdma::wait_signal_geq(a.rdma, a.signal_off + 8ull * p, e, dl, p)) return;
  }
}

// TransportCheckArgs::mode.
constexpr u32 CHECK_PUT_SIGNAL = 0;        // put_signal: the signal rides with the data
constexpr u32 CHECK_PUT_FENCE_SIGNAL = 1;  // put on one QP, fence, signal on another
constexpr u32 CHECK_PLANTED_BUG = 2;       // put on one QP, signal on another, no fence: must fail on emu-nic

struct TransportCheckArgs {
  RdmaArgs rdma;
  u64 error_claim, error_record, timeout_ns;
  u64 mismatches;  // device u64: bytes found wrong once their signal was seen (accumulates)
  u64 expected;    // device u64[num_ranks]: messages expected from each source so far (local state)
  u32 seed;
  u32 round;
  u32 messages;    // per rank and round
  u32 max_bytes;   // per message, >= 1
  u32 slot_bytes;  // max_bytes rounded up to 16
  u32 mode;
};
static_assert(sizeof(TransportCheckArgs) == MOELINK_SIZEOF_TRANSPORT_CHECK_ARGS, "TransportCheckArgs mirrors Rust");

__device__ __forceinline__ u32 mix32(u32 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Message m of rank `src` in round `round`: destination, QP, size and the bytes it carries.
struct CheckMessage {
  u32 hash, pe, qp, bytes;
};

__device__ __forceinline__ CheckMessage check_message(const TransportCheckArgs& a, u32 src, u32 m) {
  CheckMessage msg;
  msg.hash = mix32(a.seed ^ mix32(src * 0x9E3779B1u ^ mix32(a.round * 0x85EBCA77u ^ mix32(m + 1))));
  msg.pe = msg.hash % a.rdma.num_ranks;
  msg.qp = (msg.hash >> 8) % a.rdma.num_qps;
  msg.bytes = 1 + mix32(msg.hash ^ 0x51ed27u) % a.max_bytes;
  return msg;
}

__device__ __forceinline__ u32 check_word(u32 hash, u32 w) { return mix32(hash ^ (w * 0x27d4eb2fu)); }

__device__ __forceinline__ u64 check_recv_off(const TransportCheckArgs& a, u32 src, u32 m) {
  return TRANSPORT_SIGNAL_BYTES + ((u64)src * a.messages + m) * a.slot_bytes;
}

__device__ __forceinline__ u64 check_send_off(const TransportCheckArgs& a, u32 m) {
  return TRANSPORT_SIGNAL_BYTES + ((u64)a.rdma.num_ranks * a.messages + m) * a.slot_bytes;
}

// The receive of transport_check (block 0): counts first (every source's messages of this round that name
// this rank), then every byte received this round against the pattern.
__device__ __forceinline__ void check_receive(const TransportCheckArgs& a, const Deadline& dl) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  const u32 warp = threadIdx.x / WARP_SIZE;
  const u32 me = a.rdma.rank;
  u64* expected = reinterpret_cast<u64*>(a.expected);
  if (warp == 0) {
    for (u32 s = lane; s < a.rdma.num_ranks; s += WARP_SIZE) {
      u64 count = 0;
      for (u32 m = 0; m < a.messages; m++) count += check_message(a, s, m).pe == me ? 1 : 0;
      const u64 target = expected[s] + count;
      expected[s] = target;
      rdma::wait_signal_geq(a.rdma, (u64)s * sizeof(u64), target, dl, s);
    }
  }
  __syncthreads();
  if (error_raised(dl)) return;
  u64 wrong = 0;
  for (u32 item = threadIdx.x; item < a.rdma.num_ranks * a.messages; item += blockDim.x) {
    const u32 s = item / a.messages, m = item % a.messages;
    const CheckMessage msg = check_message(a, s, m);
    if (msg.pe != me) continue;
    const u8* got = reinterpret_cast<const u8*>(a.rdma.local_base + check_recv_off(a, s, m));
    for (u32 i = 0; i < msg.bytes; i++) {
      const u8 want = (u8)(check_word(msg.hash, i / 4) >> (8 * (i % 4)));
      wrong += got[i] != want ? 1 : 0;
    }
  }
  if (wrong != 0) ptx::red_add_relaxed_gpu_u64(reinterpret_cast<u64*>(a.mismatches), wrong);
}

// transport_check: grid = worker blocks (+ the emulated NIC's), TRANSPORT_THREADS threads, cooperative.
// Roles: every worker warp sends messages g, g + W, ... (W = worker warps): writes the pattern into its send
// slot, then per `mode` puts it into slot [me][m] of the destination and adds 1 to the destination's
// counter for this rank. Warp 0 of block 0 then waits, per source s (lane s), until its counter reaches the
// messages expected from s so far (every rank derives every rank's messages from the seed), and block 0
// compares every byte received this round with the pattern; every warp quiets last. Wrong bytes are added
// to `mismatches`; a correct backend and protocol leave it at 0.
extern "C" __global__ void __launch_bounds__(TRANSPORT_THREADS, 1) transport_check(const __grid_constant__ TransportCheckArgs a) {
  const Deadline dl = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_TRANSPORT);
  if (rdma::nic_block(a.rdma, dl)) return;
  rdma::WorkerScope scope(a.rdma);
  const u32 lane = threadIdx.x % WARP_SIZE;
  const u32 warp = threadIdx.x / WARP_SIZE;
  const u32 num_warps = rdma::num_worker_blocks(a.rdma) * TRANSPORT_WARPS;
  const u32 me = a.rdma.rank;

  for (u32 m = blockIdx.x * TRANSPORT_WARPS + warp; m < a.messages; m += num_warps) {
    const CheckMessage msg = check_message(a, me, m);
    const u64 src_off = check_send_off(a, m);
    u32* src = reinterpret_cast<u32*>(a.rdma.local_base + src_off);
    for (u32 w = lane; w < (msg.bytes + 3) / 4; w += WARP_SIZE) src[w] = check_word(msg.hash, w);
    const u64 dst_off = check_recv_off(a, me, m);
    const u64 sig_off = (u64)me * sizeof(u64);
    if (a.mode == CHECK_PUT_SIGNAL) {
      rdma::put_signal_warp(a.rdma, msg.qp, msg.pe, dst_off, src_off, msg.bytes, sig_off, 1, SIGNAL_ADD, dl);
    } else {
      // The planted bug keeps the last QP for signals (with 2+ QPs), so that no signal queues behind data
      // and a missing fence shows however the emulated NIC orders its queues.
      const bool bug = a.mode == CHECK_PLANTED_BUG && a.rdma.num_qps > 1;
      const u32 data_qp = bug ? msg.qp % (a.rdma.num_qps - 1) : msg.qp;
      const u32 signal_qp = bug ? a.rdma.num_qps - 1 : (msg.qp + 1) % a.rdma.num_qps;
      rdma::put_warp(a.rdma, data_qp, msg.pe, dst_off, src_off, msg.bytes, dl);
      if (lane == 0) {
        if (a.mode == CHECK_PUT_FENCE_SIGNAL) rdma::fence_thread(a.rdma, data_qp, dl);
        rdma::signal_thread(a.rdma, signal_qp, msg.pe, sig_off, 1, SIGNAL_ADD, dl);
      }
      __syncwarp();
    }
  }
  if (blockIdx.x == 0) check_receive(a, dl);
  // Every warp's operations complete before the launch ends — after the receive, so that block 0 looks at
  // the bytes as soon as its counts arrive (with its own puts possibly still in flight): data that a
  // protocol lets land after its signal is caught there, not hidden by this rank's own quiet.
  if (lane == 0) rdma::quiet_thread(a.rdma, RDMA_ALL_QPS, dl);
  __syncwarp();
}

// TransportBenchArgs::mode.
constexpr u32 BENCH_LATENCY = 0;    // ping-pong between rank pairs (r, r ^ 1): put_signal, or put + fence + signal
constexpr u32 BENCH_BANDWIDTH = 1;  // every rank streams `messages` puts of `bytes` to rank (r + 1) % R

struct TransportBenchArgs {
  RdmaArgs rdma;
  u64 error_claim, error_record, timeout_ns;
  u64 result;      // device u64[2]: elapsed ns, bytes received by this rank
  u64 epoch;       // this launch's number, from 1 (the start words are compared against it)
  u64 signal_base; // what this rank's ping-pong word (latency) or counter (bandwidth) held before the launch
  u32 mode;
  u32 bytes;       // per message (multiple of 16)
  u32 messages;    // latency: round trips; bandwidth: messages per rank
  u32 use_signal;  // 1 = every message is a put_signal; 0 = plain puts (latency: each followed by a fence and
                   // a signal; bandwidth: one fence + signal per warp after its puts)
};
static_assert(sizeof(TransportBenchArgs) == MOELINK_SIZEOF_TRANSPORT_BENCH_ARGS, "TransportBenchArgs mirrors Rust");

// transport_bench: grid = worker blocks (+ the emulated NIC's), TRANSPORT_THREADS threads, cooperative.
// Start: thread 0 of block 0 sets start word [me] of every rank to `epoch` and waits for every rank's, so
// all ranks start together; __syncthreads spreads that to block 0, a grid-wide signal to the others.
//   latency:   warp 0 of block 0 of ranks r and r ^ 1: the even one puts `bytes` to the odd one and sets
//              its ping-pong word to i, then waits for the same back, `messages` times; result = ns per
//              round trip × messages (the host halves it). Round i uses QP i % num_qps. With use_signal the
//              put and its signal are one put_signal; without, they are a plain put, a fence and a signal
//              (SET) on the same QP — what a protocol pays when it cannot carry its signal with the data
//              (NVSHMEM's own put ping-pong test orders them the same way).
//   bandwidth: every worker warp puts its share of `messages` messages of `bytes` into rank (me+1) % R,
//              each with a signal ADD 1 (use_signal) or as plain puts followed by one fence and a signal
//              ADD (its message count); rank me waits until its counter reached signal_base + messages;
//              result = ns from the start to the last signal, and the bytes received.
extern "C" __global__ void __launch_bounds__(TRANSPORT_THREADS, 1) transport_bench(const __grid_constant__ TransportBenchArgs a) {
  const Deadline dl = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_TRANSPORT);
  if (rdma::nic_block(a.rdma, dl)) return;
  rdma::WorkerScope scope(a.rdma);
  const u32 lane = threadIdx.x % WARP_SIZE;
  const u32 warp = threadIdx.x / WARP_SIZE;
  const u32 me = a.rdma.rank, n = a.rdma.num_ranks;
  const u32 workers = rdma::num_worker_blocks(a.rdma);
  const u64 pingpong_off = 0, counter_off = 8, start_off = 16;
  u64* result = reinterpret_cast<u64*>(a.result);

  // Start together: block 0 meets the other ranks, then releases this rank's other blocks.
  __shared__ u32 s_ok;
  if (threadIdx.x == 0) {
    bool ok = true;
    if (blockIdx.x == 0) {
      for (u32 p = 0; p < n; p++) ok = ok && rdma::signal_thread(a.rdma, 0, p, start_off + 8 * me, a.epoch, SIGNAL_SET, dl);
      for (u32 p = 0; p < n && ok; p++) ok = rdma::wait_signal_geq(a.rdma, start_off + 8 * p, a.epoch, dl, p);
      // The other blocks wait for this rank's own start word of this epoch, set last, by its block 0.
      if (ok) ptx::st_relaxed_sys_u64(reinterpret_cast<u64*>(a.rdma.local_base + start_off + 8 * n), a.epoch);
    } else {
      ok = spin_until(
          [&]() { return (i64)(ptx::ld_acquire_sys_u64(reinterpret_cast<const u64*>(a.rdma.local_base + start_off + 8 * n)) - a.epoch) >= 0; },
          dl, me);
    }
    s_ok = ok ? 1 : 0;
  }
  __syncthreads();
  if (s_ok == 0) return;
  const u64 t0 = ptx::globaltimer();
  const u64 recv_off = TRANSPORT_SIGNAL_BYTES;
  const u64 send_off = TRANSPORT_SIGNAL_BYTES + (u64)a.messages * a.bytes;

  if (a.mode == BENCH_LATENCY) {
    const u32 partner = me ^ 1;
    if (blockIdx.x != 0 || warp != 0 || partner >= n) return;
    const bool leader = (me & 1) == 0;
    const u64 base = a.signal_base;  // the ping-pong word only grows: values of earlier launches are below
    // One message of round i to the partner: the data, then its ping-pong word set to base + i.
    auto send = [&](u32 i) -> bool {
      const u32 qp = i % a.rdma.num_qps;
      if (a.use_signal != 0) {
        return rdma::put_signal_warp(a.rdma, qp, partner, recv_off, send_off, a.bytes, pingpong_off, base + i, SIGNAL_SET, dl);
      }
      bool ok = rdma::put_warp(a.rdma, qp, partner, recv_off, send_off, a.bytes, dl);
      if (lane == 0 && ok) {
        ok = rdma::fence_thread(a.rdma, qp, dl) && rdma::signal_thread(a.rdma, qp, partner, pingpong_off, base + i, SIGNAL_SET, dl);
      }
      return __shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) != 0;
    };
    for (u32 i = 1; i <= a.messages; i++) {
      if (leader) {
        if (!send(i) || !rdma::wait_signal_geq(a.rdma, pingpong_off, base + i, dl, partner)) return;
      } else {
        if (!rdma::wait_signal_geq(a.rdma, pingpong_off, base + i, dl, partner) || !send(i)) return;
      }
    }
    if (lane == 0) {
      rdma::quiet_thread(a.rdma, RDMA_ALL_QPS, dl);
      result[0] = ptx::globaltimer() - t0;
      result[1] = (u64)a.messages * a.bytes;
    }
    return;
  }

  // Bandwidth.
  const u32 dst = (me + 1) % n;
  const u32 num_warps = workers * TRANSPORT_WARPS;
  const u32 g = blockIdx.x * TRANSPORT_WARPS + warp;
  u32 sent = 0;
  for (u32 m = g; m < a.messages; m += num_warps) {
    const u32 qp = g % a.rdma.num_qps;
    if (a.use_signal != 0) {
      rdma::put_signal_warp(a.rdma, qp, dst, recv_off + (u64)m * a.bytes, send_off + (u64)m * a.bytes, a.bytes, counter_off, 1, SIGNAL_ADD, dl);
    } else {
      rdma::put_warp(a.rdma, qp, dst, recv_off + (u64)m * a.bytes, send_off + (u64)m * a.bytes, a.bytes, dl);
    }
    sent++;
  }
  if (lane == 0) {
    if (a.use_signal == 0 && sent != 0) {
      rdma::fence_thread(a.rdma, g % a.rdma.num_qps, dl);
      rdma::signal_thread(a.rdma, g % a.rdma.num_qps, dst, counter_off, sent, SIGNAL_ADD, dl);
    }
    rdma::quiet_thread(a.rdma, RDMA_ALL_QPS, dl);
  }
  __syncwarp();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (rdma::wait_signal_geq(a.rdma, counter_off, a.signal_base + a.messages, dl, (me + n - 1) % n)) {
      result[0] = ptx::globaltimer() - t0;
      result[1] = (u64)a.messages * a.bytes;
    }
  }
}
