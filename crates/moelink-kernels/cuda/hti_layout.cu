// moelink kernel family: get_dispatch_layout when the ranks span nodes (moelink_kernels::ht_internode).
// The protocol, the JIT constants and what the internode kernels share are in hti.cuh.
#include "hti.cuh"

// ============================================================================================== layout
namespace moelink::internode {
// moelink::internode::layout: get_dispatch_layout on a buffer across nodes. grid: any (grid-stride over
//   tokens), block THREADS; one thread per token. Per token: expert e counts once per row; rank e / (E / R)
//   is marked in is_token_in_rank and counted once per token, its node once per token. An entry outside
//   [-1, E) or repeated in its row is reported (ERR_INVALID_TOPK) and counts as -1. Counts accumulate in
//   shared memory, then one global atomic per non-zero counter and block. No flags, no waits.
__global__ void __launch_bounds__(THREADS) layout(const __grid_constant__ HtiLayoutArgs a) {
  __shared__ u32 s_rank[NUM_RANKS];
  __shared__ u32 s_node[NUM_NODES];
  const Deadline d = make_deadline(a.error_claim, a.error_record, 0, a.rank, PHASE_LAYOUT);
  for (u32 r = threadIdx.x; r < NUM_RANKS; r += THREADS) s_rank[r] = 0;
  for (u32 n = threadIdx.x; n < NUM_NODES; n += THREADS) s_node[n] = 0;
  __syncthreads();
  const i64* topk_idx = reinterpret_cast<const i64*>(a.topk_idx);
  u32* expert_count = reinterpret_cast<u32*>(a.num_tokens_per_expert);
  u8* in_rank = reinterpret_cast<u8*>(a.is_token_in_rank);
  const i64 num_experts = a.num_experts, per_rank = a.num_experts / NUM_RANKS;
  for (u32 t = blockIdx.x * THREADS + threadIdx.x; t < a.num_tokens; t += gridDim.x * THREADS) {
    const i64* row = topk_idx + (i64)t * a.topk_stride_token;
    for (u32 r = 0; r < NUM_RANKS; r++) in_rank[(u64)t * NUM_RANKS + r] = 0;
    u32 nodes = 0;
    for (u32 k = 0; k < a.topk; k++) {
      const i64 e = row[(i64)k * a.topk_stride_k];
      bool valid = e >= 0 && e < num_experts, bad = e < -1 || e >= num_experts;
      for (u32 j = 0; valid && j < k; j++) {
        if (row[(i64)j * a.topk_stride_k] == e) {
          valid = false;
          bad = true;
        }
      }
      if (bad) report_error(d, ERR_INVALID_TOPK, NO_PEER, ((u64)t << 32) | k, (u64)e);
      if (!valid) continue;
      atomicAdd(expert_count + e, 1u);
      const u32 r = (u32)(e / per_rank);
      u8* mark = in_rank + (u64)t * NUM_RANKS + r;
      if (*mark == 0) {
        *mark = 1;
        atomicAdd(&s_rank[r], 1u);
      }
      nodes |= 1u << node_of(r);
    }
    for (u32 n = 0; n < NUM_NODES; n++)
      if (((nodes >> n) & 1u) != 0u) atomicAdd(&s_node[n], 1u);
  }
  __syncthreads();
  for (u32 r = threadIdx.x; r < NUM_RANKS; r += THREADS)
    if (s_rank[r] != 0u) atomicAdd(reinterpret_cast<u32*>(a.num_tokens_per_rank) + r, s_rank[r]);
  if (a.num_tokens_per_rdma_rank != 0)
    for (u32 n = threadIdx.x; n < NUM_NODES; n += THREADS)
      if (s_node[n] != 0u) atomicAdd(reinterpret_cast<u32*>(a.num_tokens_per_rdma_rank) + n, s_node[n]);
}
}  // namespace moelink::internode
