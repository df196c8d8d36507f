// moelink kernel family: high-throughput dispatch layout (Buffer::get_dispatch_layout). Local: touches no
// peer and no flag.
//
// JIT constants (from moelink_kernels::ht::HtLayoutVariant):
//   MAX_RANKS                       ranks the outputs have room for
//   LAYOUT_THREADS                  threads per block
//   LAYOUT_EXPERTS_PER_BLOCK        experts whose counters one block owns
//   MOELINK_SIZEOF_HT_LAYOUT_ARGS   sizeof(moelink_kernels::ht::HtLayoutArgs)
#include "ht.cuh"

#if !defined(LAYOUT_THREADS) || !defined(LAYOUT_EXPERTS_PER_BLOCK) || !defined(MOELINK_SIZEOF_HT_LAYOUT_ARGS)
#error "ht_layout.cu needs every JIT constant listed at the top of the file"
#endif
static_assert(LAYOUT_THREADS % WARP_SIZE == 0 && LAYOUT_THREADS >= MAX_RANKS, "whole warps, one thread per rank");
static_assert(MAX_RANKS <= 32, "a token's ranks are one 32-bit mask");
// Rows of at most this many entries are read into registers at once (longer rows entry by entry).
constexpr u32 LAYOUT_REG_TOPK = 16;

// Kernel argument (by value). Must match moelink_kernels::ht::HtLayoutArgs byte for byte.
struct HtLayoutArgs {
  u64 topk_idx;               // i64 [T, K], any strides
  i64 topk_stride_token;      // elements
  i64 topk_stride_k;          // elements
  u64 num_tokens_per_rank;    // i32 [R]; every element written here (no zeroing before the launch)
  u64 num_tokens_per_expert;  // i32 [E]; every element written here (no zeroing before the launch)
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
//   grid: any (the host uses one block per LAYOUT_EXPERTS_PER_BLOCK experts), block: LAYOUT_THREADS.
//   The experts are cut into ranges of LAYOUT_EXPERTS_PER_BLOCK; block b owns ranges b, b + grid, ... and, for
//   each, reads every row (one thread per token) and counts its range in shared memory, then stores the
//   counts. Block 0 also owns the ranks: it marks is_token_in_rank, counts tokens per rank, and reports
//   invalid entries. Each counter is stored once by its owner, so nothing is zeroed before the launch and
//   no global atomic is needed.
//   Per token: expert e counts once per row; rank e / (E / R) is marked and counted once per token. An entry
//   outside [-1, E), or an expert repeated in a row, is reported (ERR_INVALID_TOPK, details: t << 32 | k,
//   the value) and counts as -1, so nothing is indexed out of bounds.
//   reads: topk_idx; writes: the three outputs. No flags, no waits.
__global__ void __launch_bounds__(LAYOUT_THREADS) layout(const __grid_constant__ HtLayoutArgs a) {
  __shared__ u32 s_rank_count[MAX_RANKS];
  __shared__ u32 s_expert_count[LAYOUT_EXPERTS_PER_BLOCK];
  const Deadline d = make_deadline(a.error_claim, a.error_record, 0, a.rank, PHASE_LAYOUT);
  u32* rank_count = reinterpret_cast<u32*>(a.num_tokens_per_rank);
  u32* expert_count = reinterpret_cast<u32*>(a.num_tokens_per_expert);
  u8* in_rank = reinterpret_cast<u8*>(a.is_token_in_rank);
  const i64* topk_idx = reinterpret_cast<const i64*>(a.topk_idx);
  const i64 num_experts = a.num_experts;
  const u32 experts_per_rank = a.num_experts / a.num_ranks;

  // E > 0, so block 0 always has the range that starts at expert 0, and with it the ranks.
  for (u32 first = blockIdx.x * LAYOUT_EXPERTS_PER_BLOCK; first < a.num_experts;
       first += gridDim.x * LAYOUT_EXPERTS_PER_BLOCK) {
    const bool owns_ranks = first == 0;
    const u32 owned = a.num_experts - first < LAYOUT_EXPERTS_PER_BLOCK ? a.num_experts - first : LAYOUT_EXPERTS_PER_BLOCK;
    for (u32 r = threadIdx.x; r < MAX_RANKS; r += LAYOUT_THREADS) s_rank_count[r] = 0;
    for (u32 i = threadIdx.x; i < owned; i += LAYOUT_THREADS) s_expert_count[i] = 0;
    __syncthreads();
    for (u32 t = threadIdx.x; t < a.num_tokens; t += LAYOUT_THREADS) {
      const i64* row = topk_idx + (i64)t * a.topk_stride_token;
      u32 rank_mask = 0;
      // One entry: counted when valid and in this block's range, reported (once, by block 0) when invalid.
      auto take = [&](u32 k, i64 e, bool valid, bool bad) {
        if (bad && owns_ranks) report_error(d, ERR_INVALID_TOPK, NO_PEER, ((u64)t << 32) | k, (u64)e);
        if (!valid) return;
        if ((u64)(e - first) < owned) atomicAdd(&s_expert_count[e - first], 1u);
        rank_mask |= 1u << ((u32)e / experts_per_rank);
      };
      if (a.topk <= LAYOUT_REG_TOPK) {
        // The row in registers: its loads are independent, and the repeat check reads no memory.
        i64 ids[LAYOUT_REG_TOPK];
#pragma unroll
        for (u32 k = 0; k < LAYOUT_REG_TOPK; k++) ids[k] = k < a.topk ? row[(i64)k * a.topk_stride_k] : -1;
#pragma unroll
        for (u32 k = 0; k < LAYOUT_REG_TOPK; k++) {
          if (k < a.topk) {
            const i64 e = ids[k];
            bool valid = e >= 0 && e < num_experts;
            bool bad = e < -1 || e >= num_experts;
#pragma unroll
            for (u32 j = 0; j < k; j++) {
              if (valid && ids[j] == e) {
                valid = false;
                bad = true;
              }
            }
            take(k, e, valid, bad);
          }
        }
      } else {
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
          take(k, e, valid, bad);
        }
      }
      if (owns_ranks) {
        for (u32 r = 0; r < a.num_ranks; r++) {
          const u32 hit = (rank_mask >> r) & 1u;
          in_rank[(u64)t * a.num_ranks + r] = (u8)hit;
          if (hit != 0u) atomicAdd(&s_rank_count[r], 1u);
        }
      }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < owned; i += LAYOUT_THREADS) expert_count[first + i] = s_expert_count[i];
    if (owns_ranks)
      for (u32 r = threadIdx.x; r < a.num_ranks; r += LAYOUT_THREADS) rank_count[r] = s_rank_count[r];
    __syncthreads();  // the shared counters are zeroed again for the next range
  }
}
}  // namespace moelink::intranode
