// moelink kernel family: high-throughput dispatch layout (Buffer::get_dispatch_layout). Local: touches no
// peer and no flag.
//
// JIT constants (from moelink_kernels::ht::HtLayoutVariant):
//   MAX_RANKS                       ranks the outputs have room for
//   LAYOUT_THREADS                  threads per block
//   LAYOUT_SMEM_EXPERTS             expert counters kept in shared memory (more experts: global atomics)
//   MOELINK_SIZEOF_HT_LAYOUT_ARGS   sizeof(moelink_kernels::ht::HtLayoutArgs)
#include "ht.cuh"

#if !defined(LAYOUT_THREADS) || !defined(LAYOUT_SMEM_EXPERTS) || !defined(MOELINK_SIZEOF_HT_LAYOUT_ARGS)
#error "ht_layout.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(LAYOUT_THREADS % WARP_SIZE == 0 && LAYOUT_THREADS >= MAX_RANKS, "whole warps, one thread per rank");

// Kernel argument (by value). Must match moelink_kernels::ht::HtLayoutArgs byte for byte.
struct HtLayoutArgs {
  u64 topk_idx;               // i64 [T, K], any strides
  i64 topk_stride_token;      // elements
  i64 topk_stride_k;          // elements
  u64 num_tokens_per_rank;    // i32 [R]; zeroed on the stream before the launch
  u64 num_tokens_per_expert;  // i32 [E]; zeroed on the stream before the launch
  u64 is_token_in_rank;       // bool [T, R], contiguous; every byte written here
  u64 error_claim;            // ErrorSink::claim
  u64 error_record;           // ErrorSink::record
  u32 num_tokens;
  u32 topk;
  u32 num_experts;            // a positive multiple of num_ranks
  u32 num_ranks;
  u32 rank;
  u32 reserved;
};
static_assert(sizeof(HtLayoutArgs) == MOELINK_SIZEOF_HT_LAYOUT_ARGS, "HtLayoutArgs differs from the Rust definition");

namespace moelink::intranode {
// moelink::intranode::layout: counts per rank and per expert, and is_token_in_rank.
//   grid: any (the host uses ceil(T / LAYOUT_THREADS), capped), block: LAYOUT_THREADS; one thread per token
//   (grid-stride loop).
//   Per token: expert e counts once per row; rank e / (E / R) is marked in is_token_in_rank and counted once
//   per token. An entry outside [-1, E), or an expert repeated in a row, is reported (ERR_INVALID_TOPK,
//   details: t << 32 | k, the value) and counts as -1, so nothing is indexed out of bounds.
//   Counts accumulate in shared memory, then one global atomicAdd per non-zero counter and block.
//   reads: topk_idx; writes: the three outputs. No flags, no waits.
__global__ void __launch_bounds__(LAYOUT_THREADS) layout(const __grid_constant__ HtLayoutArgs a) {
  __shared__ u32 s_rank_count[MAX_RANKS];
  __shared__ u32 s_expert_count[LAYOUT_SMEM_EXPERTS];
  const bool experts_in_smem = a.num_experts <= LAYOUT_SMEM_EXPERTS;
  const Deadline d = make_deadline(a.error_claim, a.error_record, 0, a.rank, PHASE_LAYOUT);
  u32* rank_count = reinterpret_cast<u32*>(a.num_tokens_per_rank);
  u32* expert_count = reinterpret_cast<u32*>(a.num_tokens_per_expert);
  u8* in_rank = reinterpret_cast<u8*>(a.is_token_in_rank);
  const i64* topk_idx = reinterpret_cast<const i64*>(a.topk_idx);

  for (u32 r = threadIdx.x; r < MAX_RANKS; r += LAYOUT_THREADS) s_rank_count[r] = 0;
  if (experts_in_smem)
    for (u32 e = threadIdx.x; e < a.num_experts; e += LAYOUT_THREADS) s_expert_count[e] = 0;
  __syncthreads();

  const i64 num_experts = a.num_experts;
  const i64 experts_per_rank = a.num_experts / a.num_ranks;
  for (u32 t = blockIdx.x * LAYOUT_THREADS + threadIdx.x; t < a.num_tokens; t += gridDim.x * LAYOUT_THREADS) {
    const i64* row = topk_idx + (i64)t * a.topk_stride_token;
    u32 rank_mask = 0;
    for (u32 k = 0; k < a.topk; k++) {
      const i64 e = row[(i64)k * a.topk_stride_k];
      bool valid = e >= 0 && e < num_experts;
      bool bad = e < -1 || e >= num_experts;
      for (u32 j = 0; valid && j < k; j++) {
        if (row[(i64)j * a.topk_stride_k] == e) {
          valid = false;
          bad = true;
        }
      }
      if (bad) report_error(d, ERR_INVALID_TOPK, NO_PEER, ((u64)t << 32) | k, (u64)e);
      if (!valid) continue;
      if (experts_in_smem)
        atomicAdd(&s_expert_count[e], 1u);
      else
        atomicAdd(&expert_count[e], 1u);
      rank_mask |= 1u << (u32)(e / experts_per_rank);
    }
    for (u32 r = 0; r < a.num_ranks; r++) {
      const u32 hit = (rank_mask >> r) & 1u;
      in_rank[(u64)t * a.num_ranks + r] = (u8)hit;
      if (hit != 0u) atomicAdd(&s_rank_count[r], 1u);
    }
  }
  __syncthreads();
  for (u32 r = threadIdx.x; r < a.num_ranks; r += LAYOUT_THREADS)
    if (s_rank_count[r] != 0u) atomicAdd(&rank_count[r], s_rank_count[r]);
  if (experts_in_smem)
    for (u32 e = threadIdx.x; e < a.num_experts; e += LAYOUT_THREADS)
      if (s_expert_count[e] != 0u) atomicAdd(&expert_count[e], s_expert_count[e]);
}
}  // namespace moelink::intranode
