// moelink kernel family: the copy primitive (bulk bytes into peer memory) and pattern fill/verify.
//
// JIT constants (from moelink_kernels::CopyVariant):
//   MAX_PEERS                  destinations the argument struct has room for
//   COPY_SM_THREADS            threads per block of copy_sm
//   COPY_SM_UNROLL             16-byte vectors each copy_sm thread has in flight
//   TMA_CHUNK_BYTES            bytes per TMA bulk copy (multiple of 16)
//   TMA_STAGES                 shared-memory slots per TMA pipeline
//   TMA_WARPS                  warps (= independent pipelines) per copy_tma block
//   PATTERN_THREADS            threads per block of fill_pattern / verify_pattern
//   MOELINK_SIZEOF_COPY_ARGS   sizeof(moelink_kernels::abi::CopyArgs) on the Rust side
//
// No kernel here touches a flag: completion is the end of the kernel (stream order); a following barrier
// (barrier.cu) publishes the written bytes to the receivers.
#include "ptx.cuh"

#if !defined(MAX_PEERS) || !defined(COPY_SM_THREADS) || !defined(COPY_SM_UNROLL) || !defined(TMA_CHUNK_BYTES) || \
    !defined(TMA_STAGES) || !defined(TMA_WARPS) || !defined(PATTERN_THREADS) || !defined(MOELINK_SIZEOF_COPY_ARGS)
#error "copy.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(TMA_CHUNK_BYTES % 16 == 0, "TMA copies move multiples of 16 bytes");
static_assert(COPY_SM_THREADS % WARP_SIZE == 0 && TMA_WARPS >= 1, "whole warps");

constexpr u32 VEC_BYTES = 16;
constexpr u32 COPY_SM_UNIT_VECS = COPY_SM_THREADS * COPY_SM_UNROLL;
constexpr u32 MBARRIER_BYTES = 8;
constexpr u32 TMA_SMEM_ALIGN = 128;
// Dynamic shared memory of copy_tma: the mbarriers [TMA_WARPS][TMA_STAGES], padded to TMA_SMEM_ALIGN, then
// the slots [TMA_WARPS][TMA_STAGES][TMA_CHUNK_BYTES]. moelink_kernels::CopyVariant::tma_smem_bytes mirrors it.
constexpr u32 TMA_BARRIER_REGION = (TMA_WARPS * TMA_STAGES * MBARRIER_BYTES + TMA_SMEM_ALIGN - 1) / TMA_SMEM_ALIGN * TMA_SMEM_ALIGN;
constexpr u32 TMA_PIPELINE_BYTES = TMA_STAGES * TMA_CHUNK_BYTES;

// Kernel argument (by value). Must match moelink_kernels::abi::CopyArgs byte for byte.
struct CopyArgs {
  u64 src[MAX_PEERS];       // source slice for destination i (this GPU's memory), 16-byte aligned
  u64 dst[MAX_PEERS];       // destination slice i (usually a peer's symmetric memory), 16-byte aligned
  u32 dst_rank[MAX_PEERS];  // rank owning dst[i], for error records
  u64 bytes_per_peer;       // bytes copied to each destination, multiple of 16
  u64 error_claim;          // ErrorSink::claim
  u64 error_record;         // ErrorSink::record
  u64 timeout_ns;           // per wait (TMA completion)
  u32 num_peers;            // destinations used, <= MAX_PEERS
  u32 rank;
};
static_assert(sizeof(CopyArgs) == MOELINK_SIZEOF_COPY_ARGS, "CopyArgs differs from the Rust definition");

namespace moelink::copy {
// moelink::copy::copy_sm: SM loads and 16-byte stores.
//   grid: any (the benchmark uses 1 block per SM), block: COPY_SM_THREADS
//   work unit: COPY_SM_UNIT_VECS vectors of one destination (64 KiB at 512 threads x 8); units are dealt
//   round-robin over destinations, so every block writes to every peer (spreads the NVLink traffic).
//   Each thread issues COPY_SM_UNROLL streamed loads (ld.global.nc.L1::no_allocate) before its stores
//   (st.global.L1::no_allocate): 128 bytes in flight per thread at 8.
//   reads src[i][0, bytes_per_peer), writes dst[i][0, bytes_per_peer); a tail shorter than a unit is copied
//   by a grid-stride loop.
__global__ void __launch_bounds__(COPY_SM_THREADS, 1) copy_sm(const __grid_constant__ CopyArgs a) {
  const u64 vecs_per_peer = a.bytes_per_peer / VEC_BYTES;
  const u32 units_per_peer = (u32)(vecs_per_peer / COPY_SM_UNIT_VECS);
  const u32 num_units = units_per_peer * a.num_peers;
  for (u32 unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const u32 peer = unit % a.num_peers;
    const u64 first = (u64)(unit / a.num_peers) * COPY_SM_UNIT_VECS + threadIdx.x;
    const u32x4* src = reinterpret_cast<const u32x4*>(a.src[peer]) + first;
    u32x4* dst = reinterpret_cast<u32x4*>(a.dst[peer]) + first;
    u32x4 v[COPY_SM_UNROLL];
#pragma unroll
    for (u32 k = 0; k < COPY_SM_UNROLL; k++) v[k] = ptx::ld_nc_na_v4(src + k * COPY_SM_THREADS);
#pragma unroll
    for (u32 k = 0; k < COPY_SM_UNROLL; k++) ptx::st_na_v4(dst + k * COPY_SM_THREADS, v[k]);
  }
  const u64 tail_first = (u64)units_per_peer * COPY_SM_UNIT_VECS;
  const u64 tail_vecs = vecs_per_peer - tail_first;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < tail_vecs * a.num_peers; i += (u64)gridDim.x * blockDim.x) {
    const u32 peer = (u32)(i % a.num_peers);
    const u64 v = tail_first + i / a.num_peers;
    ptx::st_na_v4(reinterpret_cast<u32x4*>(a.dst[peer]) + v, ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(a.src[peer]) + v));
  }
}

// moelink::copy::copy_tma: TMA bulk copies through shared memory.
//   grid: any (1 block per SM), block: TMA_WARPS warps; dynamic smem: see TMA_BARRIER_REGION above.
//   Roles: one elected lane per warp runs a private pipeline (the other lanes exit at once). Pipeline j of
//   P = gridDim.x * TMA_WARPS takes chunks j, j + P, ... of the list of (destination, chunk) units dealt
//   round-robin over destinations. Per chunk: bulk load global -> slot (completes on the slot's mbarrier),
//   wait (deadline-bounded), bulk store slot -> destination (bulk group); once the store has read the slot
//   (wait_group.read) the slot is refilled with the chunk TMA_STAGES ahead. The kernel ends after every
//   store has completed (wait_group 0).
//   reads src[i][0, bytes_per_peer), writes dst[i][0, bytes_per_peer).
//   on timeout: error record {ERR_TIMEOUT, rank, dst_rank of the chunk, PHASE_COPY}; the lane stops.
__global__ void __launch_bounds__(TMA_WARPS * WARP_SIZE, 1) copy_tma(const __grid_constant__ CopyArgs a) {
  extern __shared__ __attribute__((aligned(TMA_SMEM_ALIGN))) u8 smem[];
  if (!ptx::elect_sync()) return;
  const u32 warp = threadIdx.x / WARP_SIZE;
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_COPY);
  const u32 bars = ptx::cvta_to_shared(smem) + warp * TMA_STAGES * MBARRIER_BYTES;
  const u32 slots = ptx::cvta_to_shared(smem) + TMA_BARRIER_REGION + warp * TMA_PIPELINE_BYTES;
#pragma unroll
  for (u32 s = 0; s < TMA_STAGES; s++) ptx::mbarrier_init(bars + s * MBARRIER_BYTES, 1);
  ptx::fence_mbarrier_init_release_cluster();

  const u64 chunks_per_peer = (a.bytes_per_peer + TMA_CHUNK_BYTES - 1) / TMA_CHUNK_BYTES;
  const u64 num_units = chunks_per_peer * a.num_peers;
  const u64 num_pipelines = (u64)gridDim.x * TMA_WARPS;
  const u64 pipeline = (u64)blockIdx.x * TMA_WARPS + warp;
  const u64 mine = pipeline < num_units ? (num_units - pipeline + num_pipelines - 1) / num_pipelines : 0;

  // Unit k of this pipeline: destination index, byte offset within the slice, and length.
  auto unit_peer = [&](u64 k) -> u32 { return (u32)((pipeline + k * num_pipelines) % a.num_peers); };
  auto unit_offset = [&](u64 k) -> u64 { return (pipeline + k * num_pipelines) / a.num_peers * TMA_CHUNK_BYTES; };
  auto unit_bytes = [&](u64 k) -> u32 {
    const u64 left = a.bytes_per_peer - unit_offset(k);
    return (u32)(left < TMA_CHUNK_BYTES ? left : TMA_CHUNK_BYTES);
  };
  auto issue_load = [&](u64 k) {
    const u32 slot = (u32)(k % TMA_STAGES);
    const u32 bytes = unit_bytes(k);
    ptx::mbarrier_arrive_expect_tx(bars + slot * MBARRIER_BYTES, bytes);
    ptx::cp_async_bulk_global_to_shared(slots + slot * TMA_CHUNK_BYTES, reinterpret_cast<const u8*>(a.src[unit_peer(k)]) + unit_offset(k),
                                        bytes, bars + slot * MBARRIER_BYTES);
  };

  for (u64 k = 0; k < mine && k < TMA_STAGES; k++) issue_load(k);
  for (u64 k = 0; k < mine; k++) {
    const u32 slot = (u32)(k % TMA_STAGES);
    const u32 parity = (u32)((k / TMA_STAGES) & 1);
    const u32 peer = unit_peer(k);
    if (!mbarrier_wait_parity(bars + slot * MBARRIER_BYTES, parity, d, a.dst_rank[peer])) break;
    ptx::cp_async_bulk_shared_to_global(reinterpret_cast<u8*>(a.dst[peer]) + unit_offset(k), slots + slot * TMA_CHUNK_BYTES, unit_bytes(k));
    ptx::cp_async_bulk_commit_group();
    // The slot of unit k-1 is free once its store has read it (only unit k's group may still be reading).
    if (k >= 1 && k - 1 + TMA_STAGES < mine) {
      ptx::cp_async_bulk_wait_group_read<1>();
      issue_load(k - 1 + TMA_STAGES);
    }
  }
  ptx::cp_async_bulk_wait_group<0>();
}
}  // namespace moelink::copy

// The pattern: word w of a buffer filled with `seed` (a hash, so shifted or swapped data is caught).
__device__ __forceinline__ u32 pattern_word(u64 w, u32 seed) {
  constexpr u32 MUL_LO = 2654435761u, MUL_HI = 0x85ebca6bu, MUL_SEED = 0x9e3779b9u, MIX1 = 0x7feb352du, MIX2 = 0x846ca68bu;
  u32 x = (u32)w * MUL_LO ^ (u32)(w >> 32) * MUL_HI ^ seed * MUL_SEED;
  x ^= x >> 16;
  x *= MIX1;
  x ^= x >> 15;
  x *= MIX2;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ u32x4 pattern_vec(u64 first_word, u32 seed) {
  u32x4 v;
  v.x = pattern_word(first_word, seed);
  v.y = pattern_word(first_word + 1, seed);
  v.z = pattern_word(first_word + 2, seed);
  v.w = pattern_word(first_word + 3, seed);
  return v;
}

namespace moelink::copy {
// moelink::copy::fill_pattern: dst[i] = pattern vector of words (first_word + 4i ...), for i < num_vecs.
//   grid: any, block: PATTERN_THREADS; grid-stride loop; dst may be peer memory (remote 16-byte stores).
__global__ void __launch_bounds__(PATTERN_THREADS) fill_pattern(u64 dst, u64 num_vecs, u32 seed, u64 first_word) {
  u32x4* out = reinterpret_cast<u32x4*>(dst);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < num_vecs; i += (u64)gridDim.x * blockDim.x)
    ptx::st_v4(out + i, pattern_vec(first_word + 4 * i, seed));
}

// moelink::copy::verify_pattern: counts the 32-bit words of src[0, num_vecs) that differ from fill_pattern's.
//   grid: any, block: PATTERN_THREADS; result[0] += mismatching words, result[1] = min(index of a
//   mismatching word) (the host sets result to {0, ~0} first).
__global__ void __launch_bounds__(PATTERN_THREADS)
    verify_pattern(u64 src, u64 num_vecs, u32 seed, u64 first_word, u64 result) {
  const u32x4* in = reinterpret_cast<const u32x4*>(src);
  u64* out = reinterpret_cast<u64*>(result);
  u64 bad = 0, first_bad = ~0ull;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < num_vecs; i += (u64)gridDim.x * blockDim.x) {
    const u64 w = first_word + 4 * i;
    const u32x4 got = ptx::ld_v4(in + i), want = pattern_vec(w, seed);
    const u32 n = (got.x != want.x) + (got.y != want.y) + (got.z != want.z) + (got.w != want.w);
    if (n != 0 && bad == 0) first_bad = 4 * i + (got.x != want.x ? 0 : got.y != want.y ? 1 : got.z != want.z ? 2 : 3);
    bad += n;
  }
  if (bad != 0) {
    ptx::red_add_relaxed_gpu_u64(out, bad);
    ptx::red_min_relaxed_gpu_u64(out + 1, first_bad);
  }
}
}  // namespace moelink::copy
