// moelink kernel family: cross-GPU barrier.
//
// JIT constants (from moelink_kernels::BarrierVariant):
//   MAX_RANKS                    ranks the argument struct has room for (<= WARP_SIZE)
//   MOELINK_SIZEOF_BARRIER_ARGS  sizeof(moelink_kernels::abi::BarrierArgs) on the Rust side
//
// Barrier region (one per rank, inside symmetric memory; zero when created, never reset):
//   u32 arrive[MAX_RANKS]   at 0:                     arrive[src] = last epoch rank `src` reached;
//                                                      written only by rank `src` (remote store)
//   u32 epoch               at BARRIER_EPOCH_OFFSET:   barriers this rank has entered; written only by
//                                                      this rank's own barrier kernels (stream-ordered)
// Epochs only grow and are compared wrap-safely, so the barrier needs no reset between uses; a rank may run
// any number of barriers back to back. After a timeout the epochs disagree: the owner must be re-created
// (the host poisons it).
#include "ptx.cuh"

#ifndef MAX_RANKS
#error "MAX_RANKS must come from the JIT key"
#endif
#ifndef MOELINK_SIZEOF_BARRIER_ARGS
#error "MOELINK_SIZEOF_BARRIER_ARGS must come from the JIT key"
#endif
static_assert(MAX_RANKS >= 1 && MAX_RANKS <= WARP_SIZE, "one lane per peer");

constexpr u32 BARRIER_EPOCH_OFFSET = 4 * MAX_RANKS;
constexpr u32 BARRIER_EPOCH_INDEX = BARRIER_EPOCH_OFFSET / 4;
constexpr u32 BARRIER_THREADS = WARP_SIZE;

// Kernel argument (by value). Must match moelink_kernels::abi::BarrierArgs byte for byte.
struct BarrierArgs {
  u64 regions[MAX_RANKS];  // every rank's barrier region, as addressable from this rank (own included)
  u64 error_claim;         // ErrorSink::claim (device memory)
  u64 error_record;        // ErrorSink::record (host-mapped)
  u64 timeout_ns;          // per wait
  u32 rank;
  u32 num_ranks;
};
static_assert(sizeof(BarrierArgs) == MOELINK_SIZEOF_BARRIER_ARGS, "BarrierArgs differs from the Rust definition");

// One barrier, executed by one full warp; lane p handles peer p. Returns the same value on every lane:
// true when every peer reached `epoch`, false after a timeout (recorded) or an earlier error of this rank.
//
// Flag protocol:
//   signal: lanes of peers execute one fence.acq_rel.sys (one warp instruction: every earlier write of this
//           rank, including previous kernels on the stream, is ordered before it), then st.relaxed.sys
//           `epoch` into arrive[rank] of their peer's region.
//   wait:   lane p polls arrive[p] of this rank's region with ld.acquire.sys until it reaches `epoch`
//           (deadline-bounded); the acquire makes peer p's earlier writes visible, and __syncwarp passes
//           that on to the other lanes. One MEMBAR.SYS per barrier in all (the release fence).
__device__ __forceinline__ bool warp_barrier(const BarrierArgs& a, const Deadline& d, u32 epoch) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  const bool is_peer = lane < a.num_ranks && lane != a.rank;
  u32* own_region = reinterpret_cast<u32*>(a.regions[a.rank]);
  if (is_peer) {
    ptx::fence_acq_rel_sys();
    ptx::st_relaxed_sys(reinterpret_cast<u32*>(a.regions[lane]) + a.rank, epoch);
  }
  bool ok = true;
  if (is_peer) ok = wait_flag_geq(own_region + lane, epoch, d, lane);
  ok = __all_sync(FULL_WARP_MASK, ok);
  __syncwarp();  // memory ordering among the lanes: every lane now sees what every peer wrote before arriving
  return ok;
}

// Reads this rank's epoch counter (lane 0) and broadcasts it.
__device__ __forceinline__ u32 load_epoch(const BarrierArgs& a) {
  u32 e = 0;
  if (threadIdx.x == 0) e = ptx::ld_relaxed_gpu(reinterpret_cast<const u32*>(a.regions[a.rank]) + BARRIER_EPOCH_INDEX);
  return __shfl_sync(FULL_WARP_MASK, e, 0);
}

__device__ __forceinline__ void store_epoch(const BarrierArgs& a, u32 epoch) {
  if (threadIdx.x == 0) reinterpret_cast<u32*>(a.regions[a.rank])[BARRIER_EPOCH_INDEX] = epoch;
}

namespace moelink::barrier {
// moelink::barrier::gpu_barrier: every rank launches it once per barrier; it returns when all ranks have launched it.
//   grid 1 block, block BARRIER_THREADS (one warp; lane p <-> peer p)
//   reads:  own region arrive[*], epoch;   writes: arrive[rank] of every peer region, own epoch
//   on timeout: error record {ERR_TIMEOUT, rank, first peer that did not arrive, PHASE_BARRIER}
__global__ void __launch_bounds__(BARRIER_THREADS, 1) gpu_barrier(const __grid_constant__ BarrierArgs a) {
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_BARRIER);
  const u32 epoch = load_epoch(a) + 1;
  warp_barrier(a, d, epoch);
  store_epoch(a, epoch);
}

// moelink::barrier::gpu_barrier_latency: `iters` barriers back to back, timed on the GPU.
//   grid 1 block, block BARRIER_THREADS
//   one untimed barrier first (absorbs the launch skew between ranks), then `iters` timed ones;
//   writes out_ns[0] = %globaltimer ns for the timed barriers (lane 0), or ~0 after a failure.
//   flags/regions as gpu_barrier.
__global__ void __launch_bounds__(BARRIER_THREADS, 1)
    gpu_barrier_latency(const __grid_constant__ BarrierArgs a, u32 iters, u64* out_ns) {
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_BARRIER);
  u32 epoch = load_epoch(a) + 1;
  bool ok = warp_barrier(a, d, epoch);
  const u64 t0 = ptx::globaltimer();
  for (u32 i = 0; ok && i < iters; i++) {
    epoch += 1;
    ok = warp_barrier(a, d, epoch);
  }
  const u64 t1 = ptx::globaltimer();
  store_epoch(a, epoch);
  if (threadIdx.x == 0) out_ns[0] = ok ? t1 - t0 : ~0ull;
}
}  // namespace moelink::barrier
