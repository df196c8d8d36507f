// moelink low-latency (LL) kernels: what the two families (ll_dispatch.cu, ll_combine.cu) share. Mirrored
// in Rust by moelink_kernels::ll (a test parses this file).
//
// JIT constants (from moelink_kernels::ll::LlVariant, the same for both families):
//   MAX_RANKS                        ranks the argument structs have room for (<= WARP_SIZE)
//   LL_HIDDEN                        hidden size H (bf16 channels per token; multiple of 8, of 128 with FP8)
//   LL_TOPK                          experts per token K (1..=WARP_SIZE)
//   LL_FP8                           1: dispatch quantises rows to FP8 E4M3 per 128 channels; 0: bf16 rows
//   LL_THREADS                       threads per block (whole warps)
//   LL_SMEM_WORDS                    u32 words of shared scratch (per-expert counts / bases)
//   LL_EXPERIMENT                    0; timing experiments only: LL_EXP_* bits (below)
//   MOELINK_SIZEOF_LL_DISPATCH_ARGS  sizeof(moelink_kernels::ll::LlDispatchArgs) on the Rust side
//   MOELINK_SIZEOF_LL_COMBINE_ARGS   sizeof(moelink_kernels::ll::LlCombineArgs)
//   MOELINK_SIZEOF_LL_CTRL           sizeof(moelink_kernels::ll::LlCtrl)
//   MOELINK_SIZEOF_LL_REPORT         sizeof(moelink_kernels::ll::LlReport)
//
// Memory (docs/protocols.md, "Low latency"). Every rank has, at the same offsets of its symmetric buffer:
//   LlCtrl (control area, ctrl::LL): epochs, block-completion counters, flags and per-source metadata;
//   per buffer set s in {0, 1} (chosen by the host, identical on every rank for a given call):
//     dispatch receive region  entries u32 [R][T_max][K]       per source token and live selection: expert id
//                                                              (global) << 16 | the token's rank among the
//                                                              source's tokens of that expert; ~0 for empty,
//                                                              invalid and repeated slots; written to every
//                                                              rank, routed there or not
//                              weights f32 [R][T_max][K]       the dispatch-time top-k weights
//                              counts u32 [R][E_local]         tokens each source sends each local expert
//                              rows    [R][T_max][row_stride]  FP8 payload + f32 scale_inv per 128 channels,
//                                                              or the bf16 row
//     combine receive region   bf16 rows [R][T_max] (pre-reduced partials) or [T_max][K] (one per expert)
//     handle area (local only) hrow i32 [R][T_max][K]          flat row (e * R*T_max + slot) of recv_x, or -1
//                              hweight f32 [R][T_max][K], hmeta u32 [R][2] = {tokens, accepted},
//                              home_idx i64 [T_max][K], home_weight f32 [T_max][K] (this rank's own call)
//
// Epochs, not resets: LlCtrl.dispatch_epoch counts dispatch calls on this GPU; a send kernel works as call
// e = epoch + 1 and its last block stores e back. Flags carry e (arrival words LL_ARRIVE_UNIT * e), so
// nothing is ever cleared, and CUDA-graph replays (which re-run the kernels, not the host code) advance the
// epochs like direct calls. Every rank runs the same sequence of calls, so epochs agree across ranks.
//
// Flag protocol (both families; "send" writes into peers, "recv" reads its own receive region):
//   send:  (0) wait until every unmasked destination d has consumed what this rank last wrote into set s:
//              the sum of ctrl.X_consumed[s][d][*] >= LL_ARRIVE_UNIT * ctrl.X_last_write[s] (wrap-safe,
//              local poll, deadline; the first look loaded with the epochs on entry);
//          (1) data/metadata stores into every destination's region (weak, 16-byte where possible);
//          (2) every thread: fence.acq_rel.sys; __syncthreads; then the block arrives at every rank on its
//              own: red.relaxed.sys.add of (e - e') * share into ctrl.X_arrive[s][me][b % 8] of every rank (itself
//              included), e' = ctrl.X_last_write[s] = the epoch of this rank's previous call into set s, and
//              the blocks' shares summing to LL_ARRIVE_UNIT (ll_arrive_share), so that after call e the word
//              holds LL_ARRIVE_UNIT * e whatever the grid, and only once every block added. No block waits
//              for the others before its flags go out (a last block of a grid-wide counter publishing for
//              all goes out ~1.3 us after the median block: bench/results/2026-11-21-4xnvidia-h200-0a5e7b6).
//              A grid counter (local) still finds the last block, which stores the epoch words for the next
//              launch (X_prev_write[s] = e', X_last_write[s] = e).
//   recv:  lane p of warp 0 polls the sum of ctrl.X_arrive[s][p][*] >= LL_ARRIVE_UNIT * e (wrap-safe, relaxed .sys loads, deadline),
//          then fence.acq_rel.sys + __syncthreads before anyone reads p's data; every block, once past its
//          reads, hands the set back to every rank p on its own: red.relaxed.sys.add of (e - e') * share
//          into ctrl.X_consumed[s][me][b % 8] of p (e' = the sources' previous call into set s), so that the
//          lines sum to LL_ARRIVE_UNIT * e once every block is done, which lets the sources write set s
//          again (ll_recv_end).
//   Masked ranks (shrink mode) are not waited for and their data is dropped; with LL_FLAG_SHRINK a missed
//   deadline masks the peer (decided once per call with a CAS on ctrl.decision, so every block agrees)
//   instead of raising ERR_TIMEOUT. Without it a missed deadline writes the error record and the kernel
//   winds down without publishing its flags, so peers time out too (no hang, no trap).
// Argument problems found on the GPU (invalid top-k ids, combine inputs that differ from dispatch's) travel
// in the metadata next to the flags: every rank finishes the protocol and reports them in LlReport, so the
// call fails on every rank with an argument error and the buffer stays usable.
#pragma once
#include "ptx.cuh"

#if !defined(MAX_RANKS) || !defined(LL_HIDDEN) || !defined(LL_TOPK) || !defined(LL_FP8) || !defined(LL_THREADS) || \
    !defined(LL_SMEM_WORDS) || !defined(MOELINK_SIZEOF_LL_DISPATCH_ARGS) || !defined(MOELINK_SIZEOF_LL_COMBINE_ARGS) ||  \
    !defined(MOELINK_SIZEOF_LL_CTRL) || !defined(MOELINK_SIZEOF_LL_REPORT) || !defined(LL_EXPERIMENT)
#error "the LL kernels need every JIT constant listed at the top of ll.cuh"
#endif
static_assert(MAX_RANKS >= 1 && MAX_RANKS <= WARP_SIZE, "one lane per rank");
static_assert(LL_TOPK >= 1 && LL_TOPK <= WARP_SIZE, "one lane per top-k slot");
static_assert(LL_HIDDEN % 8 == 0, "bf16 rows are moved in 16-byte vectors");
static_assert(LL_FP8 == 0 || LL_HIDDEN % 128 == 0, "FP8 rows are quantised per 128 channels");
static_assert(LL_THREADS % WARP_SIZE == 0 && LL_THREADS >= 2 * WARP_SIZE, "whole warps, at least two");
// A dispatch entry packs an expert id (< E <= LL_SMEM_WORDS / 2, the host's limit) and a token rank
// (< T_max <= 0xffff) into 16 bits each.
static_assert(LL_SMEM_WORDS <= 0xffff, "expert ids fit 16 bits of an entry");

// ============================================================================================ constants
constexpr u32 LL_WARPS = LL_THREADS / WARP_SIZE;
constexpr u32 LL_SIG_WORDS = 8;

// Phases of one launch (LlXArgs::phases).
constexpr u32 LL_PHASE_SEND = 1;
constexpr u32 LL_PHASE_RECV = 2;
constexpr u32 LL_PHASE_DRAIN = 4;

// LlXArgs::flags.
constexpr u32 LL_FLAG_ROUND_SCALE = 1;
constexpr u32 LL_FLAG_UE8M0 = 2;
constexpr u32 LL_FLAG_WEIGHTS = 4;
constexpr u32 LL_FLAG_SHRINK = 8;

// Timing experiments (JIT constant LL_EXPERIMENT, moelink_kernels::ll::experiment; 0 in every real call):
// each bit changes what the send phases do so that one cost can be measured apart.
// local_stores (results are wrong): the send phases' row stores go to this rank's own region instead of the
// destination's, so NVLink's share of their time shows; each destination's rows to their own slots there
// (slot [destination][token]: with every destination's rows on slot [me][token] the writes of 2-4 SMs met
// on one line). Per-expert combine rows still share their slots.
constexpr u32 LL_EXP_LOCAL_STORES = 1;
// no_loads (results are wrong): the send phases do not load their payload rows (x, y) and send zeros, so
// the loads' share of their time shows.
constexpr u32 LL_EXP_NO_LOADS = 2;
// last_arrives (results stay right): the send phases' arrivals are made by the last block of the grid-wide
// counter, once for all blocks (after a system fence), instead of by every block on its own
// (ll_send_arrive).
constexpr u32 LL_EXP_LAST_ARRIVES = 4;
constexpr bool LL_LOCAL_STORES = (LL_EXPERIMENT & LL_EXP_LOCAL_STORES) != 0;
constexpr bool LL_NO_LOADS = (LL_EXPERIMENT & LL_EXP_NO_LOADS) != 0;
constexpr bool LL_LAST_ARRIVES = (LL_EXPERIMENT & LL_EXP_LAST_ARRIVES) != 0;

// Argument problems (LlMeta::problem, LlReport): bits, each naming one argument on the host.
constexpr u32 LL_PROBLEM_TOPK_IDX = 1;            // dispatch: an id outside [-1, E) or an expert twice in a row
constexpr u32 LL_PROBLEM_TOPK_IDX_DIFFERS = 2;    // combine: topk_idx differs from dispatch's
constexpr u32 LL_PROBLEM_WEIGHTS_DIFFER = 4;      // combine (pre-reduced): topk_weights differ from dispatch's
constexpr u32 LL_PROBLEM_ZERO_COPY = 8;           // combine: no zero-copy buffer of this shape (host-detected)
constexpr u32 LL_PROBLEM_HANDLE = 16;             // combine: expired handle / dispatch hook not run (host)

// Shrink decisions per (kind, source).
constexpr u32 LL_KIND_DISPATCH = 0;
constexpr u32 LL_KIND_COMBINE = 1;

// Timing trace (moelink::KernelTracing::low_latency on the host; `trace` is 0 otherwise): thread 0 of every block stores
// %globaltimer into u64 words (device memory) as it passes these points, in a row per (launch slot, block):
// slot = (epoch % LL_TRACE_CALLS) * 2 + (receive-only launch), so that back-to-back calls (a replayed graph
// of many calls) each keep their own stamps. The host reads them after a timed region
// (moelink::backend::cuda::ll, trace_summaries): each launch's span (first start to last end, what a
// profiler's kernel duration measures) and when its blocks passed each point.
constexpr u32 LL_TRACE_START = 0;        // block entry
constexpr u32 LL_TRACE_SEND_READY = 1;   // send: hand-back wait done
constexpr u32 LL_TRACE_SEND_ISSUED = 2;  // send: thread 0's warp has issued its stores (before the fence)
constexpr u32 LL_TRACE_SEND_STORED = 3;  // send: every thread of the block fenced its stores
constexpr u32 LL_TRACE_SEND_DONE = 4;    // send: arrived at every rank and counted
constexpr u32 LL_TRACE_RECV_SEEN = 5;    // recv: every source's flag seen
constexpr u32 LL_TRACE_RECV_STORED = 6;  // recv: this block's outputs written
constexpr u32 LL_TRACE_END = 7;          // block exit
constexpr u32 LL_TRACE_INDEX_CHECKED = 8;  // dispatch send, block 0 (dispatch_check): rows validated, handle copies
constexpr u32 LL_TRACE_RECV_INDEXED = 9;  // dispatch receive: counts scanned into bases
constexpr u32 LL_TRACE_SEND_BUILT = 10;   // send across nodes: the block's (last) message built in the staging
constexpr u32 LL_TRACE_SEND_ROUTED = 11;  // send across nodes: the routing warp's (last) routing counted
constexpr u32 LL_TRACE_WORDS = 12;
constexpr u32 LL_TRACE_CALLS = 16;

// The row of this launch and block (0 when tracing is off).
__device__ __forceinline__ u64 ll_trace_row(u64 trace, u32 epoch, u32 phases) {
  if (trace == 0) return 0;
  const u32 slot = (epoch % LL_TRACE_CALLS) * 2 + ((phases & LL_PHASE_SEND) != 0 ? 0u : 1u);
  return trace + ((u64)slot * gridDim.x + blockIdx.x) * LL_TRACE_WORDS * sizeof(u64);
}

__device__ __forceinline__ void ll_trace_at(u64 row, u32 point, u64 when) {
  if (row != 0 && threadIdx.x == 0) reinterpret_cast<volatile u64*>(row)[point] = when;
}

// One warp moves 32 lanes x 16 bytes per instruction.
constexpr u32 VEC_BYTES = 16;
constexpr u32 CHUNK_BYTES = WARP_SIZE * VEC_BYTES;
constexpr u32 ROW_BYTES_BF16 = 2 * LL_HIDDEN;  // bytes of a bf16 row

// ============================================================================================ structs
// Per-source metadata, written by the source before its flag (one 64-byte line).
struct LlMeta {
  u32 num_tokens;            // dispatch: tokens the source dispatched in this call
  u32 problem;               // dispatch: LL_PROBLEM_* bits of the source's arguments
  u32 reserved[2];
  u32 sig[LL_SIG_WORDS];     // dispatch: the call signature (hidden, topk, experts, T_max, quant, weights)
  u64 status;                // combine: ll_combine_status of the source's call (one atomic word)
  u32 pad[2];
};
static_assert(sizeof(LlMeta) == 64, "LlMeta is one 64-byte line");

// A combine source's status word: its call's epoch (the tag that makes the word valid for this call), its
// LL_PROBLEM_* bits and whether it received this rank's dispatch. One 64-bit store, so that a receiver may
// read it in the same polls as the arrival words, without acquiring first: a word tagged with the call's
// epoch is this call's, whenever it was loaded.
__device__ __forceinline__ u64 ll_combine_status(u32 epoch, u32 problem, bool accepted) {
  return ((u64)epoch << 32) | ((u64)problem << 1) | (accepted ? 1u : 0u);
}
__device__ __forceinline__ bool ll_status_current(u64 status, u32 epoch) { return (u32)(status >> 32) == epoch; }
__device__ __forceinline__ u32 ll_status_problem(u64 status) { return (u32)status >> 1; }
__device__ __forceinline__ bool ll_status_accepted(u64 status) { return (status & 1u) != 0; }

// Arrival words (ll_send_arrive): a source's blocks add to LL_ARRIVE_LANES words per (set, source), block b
// to word b % LL_ARRIVE_LANES, each word alone on its 128-byte line; the receiver sums them. With one word
// per (set, source) and the sources' words on one line, the 4 x 132 remote reductions of a call meet on one
// line of every GPU and every block's stores are acknowledged 0.7-0.8 us later (EP4, 128 tokens, 4xH200; the
// A/B is in commit f055f94's message).
constexpr u32 LL_ARRIVE_LANES = 8;
struct LlArriveLine {
  u32 word;
  u32 pad[31];
};
static_assert(sizeof(LlArriveLine) == 128, "one arrival word per 128-byte line");

// The control area of one rank (ctrl::LL). Fields above `dispatch_arrive` are written only by this rank's
// kernels; the arrays from `dispatch_arrive` to `combine_meta` are written by peers; `mask` by this rank's
// kernels (shrink) and the host. moelink_kernels::ll::LlCtrl mirrors it.
struct LlCtrl {
  u32 dispatch_epoch;
  u32 combine_epoch;
  u32 dispatch_send_done;
  u32 combine_send_done;
  u32 dispatch_last_write[2];
  u32 combine_last_write[2];
  u32 dispatch_prev_write[2];           // [set]: this rank's call into the set before last_write
  u32 combine_prev_write[2];
  u32 pad0[4];
  u32 decision[2][MAX_RANKS];           // [kind][src] = (epoch << 1) | accepted, shrink mode only
  // [set][src][lane]: the lanes' sum = LL_ARRIVE_UNIT * epoch of src's last dispatch into set
  LlArriveLine dispatch_arrive[2][MAX_RANKS][LL_ARRIVE_LANES];
  LlArriveLine combine_arrive[2][MAX_RANKS][LL_ARRIVE_LANES];
  // [set][dst][lane]: the lanes' sum = LL_ARRIVE_UNIT * epoch of dst's last finished read of set from me
  LlArriveLine dispatch_consumed[2][MAX_RANKS][LL_ARRIVE_LANES];
  LlArriveLine combine_consumed[2][MAX_RANKS][LL_ARRIVE_LANES];
  LlMeta dispatch_meta[2][MAX_RANKS];   // [set][src]
  LlMeta combine_meta[2][MAX_RANKS];
  u32 mask[MAX_RANKS];                  // 1 = rank masked (shrink); not cleared by clean_low_latency_buffer
  u32 pad1[8];
};
static_assert(sizeof(LlCtrl) == MOELINK_SIZEOF_LL_CTRL, "LlCtrl differs from the Rust definition");  // offsets: ll.rs tests

// What the host reads after a call (host-mapped). Each field has one writer per call.
struct LlReport {
  u32 own_problem;        // LL_PROBLEM_* of this rank's own arguments (send, block 0)
  u32 mismatch_peer;      // 1 + first peer whose call signature differs (dispatch recv, block 0)
  u32 mismatch_field;     // index into the signature
  u32 peer_problem_peer;  // 1 + first peer that reported an argument problem (recv, block 0)
  u32 peer_problem;       // that peer's LL_PROBLEM_* bits
  u32 pad[3];
  u64 mismatch_ours;
  u64 mismatch_theirs;
};
static_assert(sizeof(LlReport) == MOELINK_SIZEOF_LL_REPORT, "LlReport differs from the Rust definition");

// Kernel argument of ll_dispatch (by value). Must match moelink_kernels::ll::LlDispatchArgs byte for byte.
struct LlDispatchArgs {
  u64 ctrl[MAX_RANKS];   // LlCtrl of every rank, as addressable from this rank (own included)
  u64 recv[MAX_RANKS];   // dispatch receive region of this call's set, on every rank
  u64 x;                 // bf16 [T, H]
  u64 topk_idx;          // i64 [T, K]
  u64 topk_weights;      // f32 [T, K], or 0
  u64 recv_x;            // [E_local, R*T_max, H] fp8 or bf16
  u64 recv_scales;       // f32 [E_local][H/128][R*T_max] or i32 [E_local][H/512][R*T_max], or 0
  u64 recv_count;        // i32 [E_local]
  u64 cum_stats;         // i32 [E_local], or 0
  u64 wait_stats;        // i64 [R], or 0
  u64 src_info;          // i32 [E_local, R*T_max]: DeepEP's handle, the source token of each row; or 0
  u64 layout_range;      // i64 [E_local, R]: DeepEP's handle, begin << 32 | count per source rank; or 0
  u64 hrow;              // handle area of this call's set (local)
  u64 hweight;
  u64 hmeta;
  u64 home_idx;
  u64 home_weight;
  u64 error_claim;
  u64 error_record;
  u64 report;            // LlReport (host-mapped)
  u64 timeout_ns;
  u64 trace;             // host-mapped timing trace (LL_TRACE_*), or 0
  u64 off_entries;       // offsets inside a dispatch receive region (entries at 0)
  u64 off_weights;
  u64 off_rows;
  u64 off_counts;
  u32 row_stride;        // bytes per row slot (16-byte multiple)
  u32 rank;
  u32 num_ranks;
  u32 num_tokens;
  u32 max_tokens;
  u32 num_experts;
  u32 num_local_experts;
  u32 set;
  u32 phases;            // LL_PHASE_*
  u32 flags;             // LL_FLAG_*
  u32 host_problem;      // LL_PROBLEM_* found by the host (sent to every peer; data is skipped)
  u32 pad;
  u32 sig[LL_SIG_WORDS];
};
static_assert(sizeof(LlDispatchArgs) == MOELINK_SIZEOF_LL_DISPATCH_ARGS, "LlDispatchArgs differs from the Rust definition");

// Kernel argument of ll_combine (by value). Must match moelink_kernels::ll::LlCombineArgs byte for byte.
struct LlCombineArgs {
  u64 ctrl[MAX_RANKS];
  u64 recv[MAX_RANKS];   // combine receive region of this call's set, on every rank
  u64 y;                 // bf16 [E_local, R*T_max, H]: expert outputs (x, or the zero-copy buffer)
  u64 topk_idx;          // i64 [T, K], combine-time
  u64 topk_weights;      // f32 [T, K], combine-time
  u64 out;               // bf16 [T, H]
  u64 wait_stats;        // i64 [R], or 0
  u64 hrow;              // handle area of the dispatch's set (local)
  u64 hweight;
  u64 hmeta;
  u64 home_idx;
  u64 home_weight;
  u64 error_claim;
  u64 error_record;
  u64 report;
  u64 timeout_ns;
  u64 trace;             // host-mapped timing trace (LL_TRACE_*), or 0
  u32 rank;
  u32 num_ranks;
  u32 num_tokens;
  u32 max_tokens;
  u32 num_experts;
  u32 num_local_experts;
  u32 set;
  u32 phases;
  u32 flags;
  u32 host_problem;
  u32 pad[2];
};
static_assert(sizeof(LlCombineArgs) == MOELINK_SIZEOF_LL_COMBINE_ARGS, "LlCombineArgs differs from the Rust definition");

// Shared memory of one block.
struct LlShared {
  u32 words[LL_SMEM_WORDS];  // dispatch send, block 0: counts [E]; dispatch recv: bases [R][E_local]
  u32 ok[MAX_RANKS];         // recv: source/expert rank p's data is used in this call
  u32 ntok[MAX_RANKS];       // recv: tokens of source p / combine send: tokens of home p
  u32 handed[MAX_RANKS];      // send: each destination's hand-back sum, as loaded on entry (ll_enter)
  u32 masked[MAX_RANKS];     // send: each rank's mask word, as loaded on entry
  u32 epoch;
  u32 prev_write;            // this rank's last call into the set before this launch (X_last_write[set] on entry)
  u32 recv_prev;             // recv: the sources' call into the set before this one (the hand-back's step)
  u32 abort;                 // a wait of this block failed: skip the data work
  u32 problem;
  u32 last;
  u64 trace_row;             // this launch's timing-trace row (ll_trace_row), or 0
};

__device__ __forceinline__ void ll_trace(const LlShared& sm, u32 point) { ll_trace_at(sm.trace_row, point, ptx::globaltimer()); }

// ============================================================================================ small helpers
__device__ __forceinline__ u32 lane_id() { return threadIdx.x % WARP_SIZE; }
__device__ __forceinline__ u32 warp_id() { return threadIdx.x / WARP_SIZE; }

__device__ __forceinline__ LlCtrl* ctrl_of(const u64* table, u32 r) { return reinterpret_cast<LlCtrl*>(table[r]); }

__device__ __forceinline__ float bits_f32(u32 b) { return __uint_as_float(b); }
__device__ __forceinline__ u32 f32_bits(float f) { return __float_as_uint(f); }

// bf16 pair (low half = first element) to two floats, exactly.
__device__ __forceinline__ float bf16_lo(u32 w) { return bits_f32(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return bits_f32(w & 0xffff0000u); }

__device__ __forceinline__ u32 word_of(const u32x4& v, u32 i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Destination order of one rank's stores: me + 1, me + 2, ..., me (mod R). With every rank walking its
// destinations from the lowest rank up, the first wave of every SM of every GPU goes to rank 0, then to rank
// 1, ...: one GPU's ingress saturates while the others idle (the LL send phases ran at ~200 GB/s, half the
// all-to-all ceiling; MOELINK_LL_TRACE, bench/results/2026-11-21-4xnvidia-h200-ll-trace). Starting after
// oneself spreads each wave over all destinations.
__device__ __forceinline__ u32 first_dest(u32 rank, u32 num_ranks) { return rank + 1 == num_ranks ? 0 : rank + 1; }

// ============================================================================================ waits
enum : u32 { LL_WAIT_SEEN = 0, LL_WAIT_TIMEOUT = 1, LL_WAIT_FAILED = 2 };

// Spins until read() >= target (wrap-safe; read() polls with relaxed .sys loads). Hard (soft == false): a
// missed deadline records ERR_TIMEOUT naming `peer` and returns LL_WAIT_FAILED. Soft (shrink mode): a
// missed deadline returns LL_WAIT_TIMEOUT without recording anything. Either way LL_WAIT_FAILED once
// another thread of this rank has recorded an error. The caller acquires (fence or ld.acquire) after
// LL_WAIT_SEEN.
template <typename Read>
__device__ __forceinline__ u32 ll_wait_geq(Read read, u32 target, const Deadline& d, u32 peer, bool soft) {
  if ((i32)(read() - target) >= 0) return LL_WAIT_SEEN;
  const u64 start = ptx::globaltimer();
  u32 spins = 0;
  while ((i32)(read() - target) < 0) {
    if (++spins % DEADLINE_POLL_SPINS == 0) {
      const u64 waited = ptx::globaltimer() - start;
      if (waited > d.timeout_ns) {
        if (soft) return LL_WAIT_TIMEOUT;
        raise_error(d, ERR_TIMEOUT, peer, waited);
        return LL_WAIT_FAILED;
      }
      if (error_raised(d)) return LL_WAIT_FAILED;
    }
  }
  return LL_WAIT_SEEN;
}

// A source's arrivals in one (set, source) slot: the sum of its lanes (independent loads, one round trip).
__device__ __forceinline__ u32 ll_arrivals(const LlArriveLine* lines) {
  u32 w[LL_ARRIVE_LANES];
#pragma unroll
  for (u32 i = 0; i < LL_ARRIVE_LANES; i++) w[i] = ptx::ld_relaxed_sys(&lines[i].word);
  u32 sum = 0;
#pragma unroll
  for (u32 i = 0; i < LL_ARRIVE_LANES; i++) sum += w[i];
  return sum;
}

// The acquire of a slot whose sum was seen: every lane loaded again with ld.acquire.sys (one round trip),
// which costs less than a system fence here.
__device__ __forceinline__ void ll_acquire_arrivals(const LlArriveLine* lines) {
#pragma unroll
  for (u32 i = 0; i < LL_ARRIVE_LANES; i++) (void)ptx::ld_acquire_sys(&lines[i].word);
}

// Shrink mode: the one decision of this call about a peer, shared by every block. The first block to
// resolve the peer (flag seen, or deadline missed) stores (epoch << 1 | seen) with a CAS; every other block
// adopts it. Returns whether the peer's data is used.
__device__ __forceinline__ bool ll_decide(u32* word, u32 epoch, bool seen) {
  const u32 tag = epoch & 0x7fffffffu;
  const u32 mine = (tag << 1) | (seen ? 1u : 0u);
  u32 v = ptx::ld_relaxed_gpu(word);
  while ((v >> 1) != tag) {
    const u32 w = ptx::atom_cas_acq_rel_gpu(word, v, mine);
    if (w == v) {
      v = mine;
      break;
    }
    v = w;
  }
  return (v & 1u) != 0;
}

// A grid-wide counter's word: the blocks that finished, plus LL_DONE_FAILED per block whose phase failed.
constexpr u32 LL_DONE_FAILED = 1u << 16;  // gridDim.x < 2^16

// One call's arrivals from all of a source's blocks: block b's share is LL_ARRIVE_UNIT / G, block 0 adds the
// remainder. Every share is positive (G <= 65536), so the word reaches its target only once every block
// added, and a peer with another grid size (moelink's Tuning::ll_sms) still sums to the same unit.
constexpr u32 LL_ARRIVE_UNIT = 65536;
__device__ __forceinline__ u32 ll_arrive_share() {
  const u32 share = LL_ARRIVE_UNIT / gridDim.x;
  return blockIdx.x == 0 ? LL_ARRIVE_UNIT - share * (gridDim.x - 1) : share;
}

// End of a send phase, called by every thread of every block after its stores: a thread that wrote into
// peer memory (`stored`) fences them at system scope; after the block's barrier it arrives at every rank on
// its own (the arrival word of this rank in rank p's control area, `arrive_of(p)`, += epochs x its share,
// a relaxed reduction by lane p of warp 1: the fences and the barrier order the block's stores before it)
// unless its phase failed (sm.abort: the peers then time out naming this rank instead of reading garbage).
// A local grid-wide counter (`done`) still finds the last block, which gets true with the counter reset for
// the next launch; nothing waits for it. `epochs`: this call's epoch minus this rank's previous one in the
// set. With the last_arrives experiment (LL_LAST_ARRIVES) the last block arrives for the whole grid instead
// (after a system fence, only when no block failed).
template <typename ArriveOf>
__device__ __forceinline__ bool ll_send_arrive(u32* done, LlShared& sm, bool stored, u32 num_ranks, u32 epochs, ArriveOf arrive_of) {
  constexpr bool per_block = !LL_LAST_ARRIVES;
  if (stored) ptx::fence_acq_rel_sys();
  __syncthreads();
  ll_trace(sm, LL_TRACE_SEND_STORED);
  // Warp 1, not thread 0: thread 0's counter atomic below then does not wait behind the reductions.
  const u32 lane = lane_id();
  if (per_block && warp_id() == 1 && lane < num_ranks && sm.abort == 0) ptx::red_add_relaxed_sys(arrive_of(lane), epochs * ll_arrive_share());
  if (threadIdx.x == 0) {
    const u32 mine = 1u + (sm.abort != 0 ? LL_DONE_FAILED : 0u);
    const u32 old = ptx::atom_add_acq_rel_gpu(done, mine);
    const bool last = (old & (LL_DONE_FAILED - 1)) == gridDim.x - 1;
    if (last) {
      ptx::st_relaxed_gpu(done, 0);
      if (!per_block && old + mine < LL_DONE_FAILED) {
        ptx::fence_acq_rel_sys();
        for (u32 p = 0; p < num_ranks; p++) ptx::red_add_relaxed_sys(arrive_of(p), epochs * LL_ARRIVE_UNIT);
      }
    }
    sm.last = last ? 1u : 0u;
  }
  __syncthreads();
  return sm.last != 0;
}

// Waits (warp 0, lane p < R) until every unmasked rank p has consumed what this rank last wrote into set
// `set` of its region: p's hand-back lines (`consumed`, p's at consumed[p * LL_ARRIVE_LANES]) sum to at
// least LL_ARRIVE_UNIT * last_write (wrap-safe). ll_enter loaded the first look with the epochs (sm.handed,
// sm.masked), so a wait that needs no polling costs no round trip here. Shrink mode: a rank that misses the
// deadline is masked. Sets sm.abort on a hard failure. Called by every block; ends with __syncthreads.
__device__ __forceinline__ void ll_wait_consumed(const LlArriveLine* consumed, u32* mask, u32 num_ranks, const Deadline& d, bool soft,
                                                 LlShared& sm) {
  const u32 lane = lane_id();
  if (warp_id() == 0 && lane < num_ranks) {
    const u32 target = sm.prev_write * LL_ARRIVE_UNIT;
    if (sm.masked[lane] == 0 && (i32)(sm.handed[lane] - target) < 0) {
      const LlArriveLine* lines = consumed + lane * LL_ARRIVE_LANES;
      const u32 w = ll_wait_geq([&] { return ll_arrivals(lines); }, target, d, lane, soft);
      if (w == LL_WAIT_SEEN) ll_acquire_arrivals(lines);
      if (w == LL_WAIT_TIMEOUT) ptx::st_relaxed_gpu(mask + lane, 1);
      if (w == LL_WAIT_FAILED) sm.abort = 1;
    }
  }
  __syncthreads();
}

// Result of waiting for one source in a receive phase.
struct SourceState {
  bool used;      // flag seen (or decided seen) and not masked: the source's metadata/data may be read
  u64 waited_ns;  // time spent waiting
};

// Waits for rank `p`'s arrivals of this call (lane p of warp 0; `arrive`: p's lines) to reach `target`
// (LL_ARRIVE_UNIT * epoch: every block of p's send arrived), honouring its mask. With `status` (combine: p's
// status word, written before its arrivals), the same polls also wait for the word of this call, returned
// in `status_seen`. Shrink mode: every block resolves p through the call's decision word (ll_decide), so
// that all blocks use or drop p's data alike even when they looked at different moments (p masked
// meanwhile, flag arriving late); a peer decided absent is masked for later calls.
// `local` (p is this rank: its writers share this GPU): the acquire is a GPU-scope fence. The mask word and the
// first look at the arrivals are loaded together.
__device__ __forceinline__ SourceState ll_wait_source(const LlArriveLine* arrive, const u64* status, u64& status_seen, u32 epoch, u32 target,
                                                      u32* mask, u32* decision, u32 p, const Deadline& d, bool soft, LlShared& sm,
                                                      bool local = false) {
  SourceState s = {false, 0};
  status_seen = 0;
  // Until the status word is this call's, the sum reads as short of the target.
  auto read = [&] {
    const u32 sum = ll_arrivals(arrive);
    if (status == nullptr) return sum;
    status_seen = ptx::ld_relaxed_sys_u64(status);
    return ll_status_current(status_seen, epoch) ? sum : target - 1u;
  };
  const u32 mask_word = ptx::ld_relaxed_gpu(mask + p);
  const u32 first = read();
  const bool masked = mask_word != 0;
  u32 w = LL_WAIT_TIMEOUT;
  if (!masked) {
    const u64 start = ptx::globaltimer();
    w = (i32)(first - target) >= 0 ? LL_WAIT_SEEN : ll_wait_geq(read, target, d, p, soft);
    s.waited_ns = ptx::globaltimer() - start;
  }
  if (w == LL_WAIT_FAILED) {
    sm.abort = 1;
    return s;
  }
  bool seen = w == LL_WAIT_SEEN;
  if (soft) {
    seen = ll_decide(decision + p, epoch, seen);
    if (!seen && !masked) ptx::st_relaxed_gpu(mask + p, 1);
  }
  if (seen) {
    if (local)
      ptx::fence_acq_rel_gpu();
    else if (w == LL_WAIT_SEEN)
      ll_acquire_arrivals(arrive);
    else
      ptx::fence_acq_rel_sys();  // seen by another block's decision (shrink): this thread acquired nothing
    // Decided seen by another block: the word is this call's now (written before p's arrivals).
    if (status != nullptr && !ll_status_current(status_seen, epoch)) status_seen = ptx::ld_relaxed_sys_u64(status);
  }
  s.used = seen;
  return s;
}

// ============================================================================================ operation frame
// ll_dispatch and ll_combine run one protocol on parallel LlCtrl fields (dispatch_* / combine_*). op_fields
// picks one operation's fields of a control area, for the call's set, by the argument type, so that the
// steps both kernels share are written once: ll_enter, ll_send_phase, ll_recv_end.
struct LlOpFields {
  u32* epoch;            // the operation's call counter
  u32* send_done;          // grid-wide counter of the send phase
  u32* last_write;         // epoch of the area's rank's last send into the set
  u32* prev_write;         // epoch of its send into the set before that one
  LlArriveLine* consumed;  // [dst * LL_ARRIVE_LANES + lane]
  LlArriveLine* arrive;    // [src * LL_ARRIVE_LANES + lane]
};
__device__ __forceinline__ LlOpFields op_fields(LlCtrl* c, const LlDispatchArgs& a) {
  return {&c->dispatch_epoch,          &c->dispatch_send_done,          &c->dispatch_last_write[a.set],
          &c->dispatch_prev_write[a.set], &c->dispatch_consumed[a.set][0][0], &c->dispatch_arrive[a.set][0][0]};
}
__device__ __forceinline__ LlOpFields op_fields(LlCtrl* c, const LlCombineArgs& a) {
  return {&c->combine_epoch,          &c->combine_send_done,          &c->combine_last_write[a.set],
          &c->combine_prev_write[a.set], &c->combine_consumed[a.set][0][0], &c->combine_arrive[a.set][0][0]};
}

// Tells source p that this rank (or one of its blocks) finished reading what p wrote into the set: adds
// `amount` to this rank's hand-back line `line` in p's control area.
template <typename Args>
__device__ __forceinline__ void ll_hand_back(const Args& a, u32 p, u32 line, u32 amount) {
  ptx::red_add_relaxed_sys(&op_fields(ctrl_of(a.ctrl, p), a).consumed[a.rank * LL_ARRIVE_LANES + line].word, amount);
}

// Kernel entry, every thread. A DRAIN launch (a receive phase that will never run: its hook was dropped)
// only hands the set back, as of this rank's last send into it (the whole step from the send before, at
// once), and gets false. Otherwise sm.epoch is the call's epoch: a send works as call e = epoch + 1; a
// receive-only launch belongs to the last send into its set (with hooks, two calls may be in flight: send e,
// send e+1, receive e, receive e+1), and its hand-back steps from the send into the set before that one.
// Warp 0 loads everything the launch needs from its own control area in one round trip: the epochs and,
// for a send, each destination's hand-back sum and mask word (ll_wait_consumed only compares them).
template <typename Args>
__device__ __forceinline__ bool ll_enter(const Args& a, LlShared& sm, u64 entered) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const LlOpFields own = op_fields(me, a);
  const u32 lane = lane_id();
  if (a.phases & LL_PHASE_DRAIN) {
    if (blockIdx.x == 0 && threadIdx.x < a.num_ranks) {
      const u32 e = ptx::ld_relaxed_gpu(own.last_write);
      const u32 before = ptx::ld_relaxed_gpu(own.prev_write);
      ptx::fence_acq_rel_sys();
      ll_hand_back(a, threadIdx.x, 0, (e - before) * LL_ARRIVE_UNIT);
    }
    return false;
  }
  if (warp_id() == 0) {
    const bool send = (a.phases & LL_PHASE_SEND) != 0;
    const u32 epoch = ptx::ld_relaxed_gpu(own.epoch);
    const u32 last_write = ptx::ld_relaxed_gpu(own.last_write);
    const u32 prev_write = ptx::ld_relaxed_gpu(own.prev_write);
    u32 masked = 0, handed = 0;
    if (send && lane < a.num_ranks) {
      masked = ptx::ld_relaxed_gpu(me->mask + lane);
      handed = ll_arrivals(own.consumed + lane * LL_ARRIVE_LANES);
      sm.masked[lane] = masked;
      sm.handed[lane] = handed;
    }
    if (lane == 0) {
      sm.prev_write = last_write;
      sm.epoch = send ? epoch + 1u : last_write;
      sm.recv_prev = send ? last_write : prev_write;
      sm.abort = 0;
      sm.trace_row = ll_trace_row(a.trace, sm.epoch, a.phases);
      ll_trace_at(sm.trace_row, LL_TRACE_START, entered);
    }
  }
  __syncthreads();
  return true;
}

// A send phase, every thread of every block: waits until the destinations consumed this set's previous use;
// then block 0 runs `check()` (validation, metadata lines: always stores into peers) and blocks 1..G-1 (block
// 0 too when G == 1) run `rows(first_warp, num_warps)` (true when the thread stored into peer memory) unless
// the host found a problem; every block arrives at every rank (ll_send_arrive) and the last one records the
// call: epoch = last_write[set] = e.
template <typename Args, typename Check, typename Rows>
__device__ __forceinline__ void ll_send_phase(const Args& a, const Deadline& d, LlShared& sm, u32 epoch, Check check, Rows rows) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const LlOpFields own = op_fields(me, a);
  ll_wait_consumed(own.consumed, me->mask, a.num_ranks, d, (a.flags & LL_FLAG_SHRINK) != 0, sm);
  ll_trace(sm, LL_TRACE_SEND_READY);
  bool stored = false;
  if (sm.abort == 0) {
    if (blockIdx.x == 0) {
      check();
      stored = true;
    }
    if (a.host_problem == 0 && (blockIdx.x != 0 || gridDim.x == 1)) {
      const u32 data_blocks = gridDim.x == 1 ? 1 : gridDim.x - 1;
      const u32 block = gridDim.x == 1 ? 0 : blockIdx.x - 1;
      stored |= rows(block * LL_WARPS + warp_id(), data_blocks * LL_WARPS);
    }
  }
  ll_trace(sm, LL_TRACE_SEND_ISSUED);
  const u32 lane_line = a.rank * LL_ARRIVE_LANES + blockIdx.x % LL_ARRIVE_LANES;
  const bool last = ll_send_arrive(own.send_done, sm, stored, a.num_ranks, epoch - sm.prev_write,
                                   [&](u32 p) { return &op_fields(ctrl_of(a.ctrl, p), a).arrive[lane_line].word; });
  if (last && threadIdx.x == 0) {
    *own.epoch = epoch;
    *own.prev_write = sm.prev_write;
    *own.last_write = epoch;
  }
  ll_trace(sm, LL_TRACE_SEND_DONE);
}

// End of a receive phase, every thread of every block: once its threads are past their work, the block
// hands the set back to every source on its own (lane p of warp 0: (e - e') x its share, e' = sm.recv_prev,
// onto its hand-back line at p), unless its phase failed (sm.abort); after every block the lines sum to
// LL_ARRIVE_UNIT * e. No fence and no grid-wide counter: a hand-back orders the block's loads of its receive
// region, and each load whose value counts completed before the barrier (the value was stored into an
// output or decided a branch); the outputs are ordered by the kernel boundary. A last block of a grid-wide
// counter publishing for all ends the kernel 1.1-1.4 us after the blocks' median receive end
// (bench/results/2026-11-30-2xnvidia-h200-15bc694-ll-receive).
template <typename Args>
__device__ __forceinline__ void ll_recv_end(const Args& a, LlShared& sm, u32 epoch) {
  __syncthreads();
  ll_trace(sm, LL_TRACE_RECV_STORED);
  if (warp_id() == 0 && lane_id() < a.num_ranks && sm.abort == 0)
    ll_hand_back(a, lane_id(), blockIdx.x % LL_ARRIVE_LANES, (epoch - sm.recv_prev) * ll_arrive_share());
}

// The first of a warp's receive work items, dealt over `blocks` blocks of LL_WARPS warps with stride
// blocks * LL_WARPS: block-major (item i to block i % blocks), so that when the items do not fill every warp
// equally each block still gets a near-equal share of the bytes: dealt warp by warp, 3,584 items over 132
// blocks of 16 warps would give blocks 0-91 two items a warp and 92-131 one, and a block's store rate bounds
// its expansion (bench/results/2026-11-30-2xnvidia-h200-d40541a-ll-block-major).
__device__ __forceinline__ u32 first_item_of_warp(u32 blocks) { return warp_id() * blocks + blockIdx.x; }

// ============================================================================================ rows: FP8, top-k
constexpr u32 FP8_GROUP = 128;
constexpr u32 E4M3_MAX_BITS_F32 = 0x43e00000u;  // 448.0f
constexpr u32 AMAX_FLOOR_BITS_F32 = 0x38d1b717u;  // 1e-4f
constexpr u32 ABS_MASK = 0x7fffffffu;

// Row payload in recv_x, scale groups, and the 512-byte chunks a warp moves per row (ll.cuh: ROW_BYTES_BF16,
// CHUNK_BYTES).
constexpr u32 PAYLOAD_BYTES = LL_FP8 ? LL_HIDDEN : ROW_BYTES_BF16;
constexpr u32 SCALE_GROUPS = LL_HIDDEN / FP8_GROUP;
constexpr u32 UE8M0_WORDS = SCALE_GROUPS / 4;
// Register arrays of scales per lane (at least one element; UE8M0 needs H % 512 == 0, checked on the host).
constexpr u32 SCALE_ITERS = SCALE_GROUPS > WARP_SIZE ? (SCALE_GROUPS + WARP_SIZE - 1) / WARP_SIZE : 1;
constexpr u32 UE8M0_ITERS = UE8M0_WORDS > WARP_SIZE ? (UE8M0_WORDS + WARP_SIZE - 1) / WARP_SIZE : 1;
// Four f32 scales that are powers of two (round_scale) as one UE8M0 word: their biased exponents, the first
// in the low byte (DeepEP's packed scale layout).
__device__ __forceinline__ u32 ue8m0_pack4(const u32x4& f) {
  return ((f.x >> 23) & 0xffu) | (((f.y >> 23) & 0xffu) << 8) | (((f.z >> 23) & 0xffu) << 16) | (((f.w >> 23) & 0xffu) << 24);
}
// A received row's FP8 scales as one lane carries them from the message to recv_scales: float scales of groups
// lane + 32 k, or (UE8M0) the four float scales of packed word lane + 32 k. The receivers load them one work
// item ahead with the payload: loaded after the payload's stores, they are a round trip on the critical path
// of every block that holds a chunk-0 item.
struct RowScales {
  u32 scale[SCALE_ITERS];
  u32x4 ue8m0[UE8M0_ITERS];
};
__device__ __forceinline__ void load_row_scales(const u8* scales, bool ue8m0, RowScales& s) {
  const u32 lane = lane_id();
  if (!ue8m0) {
#pragma unroll
    for (u32 k = 0; k < SCALE_ITERS; k++) {
      const u32 g = lane + k * WARP_SIZE;
      if (g < SCALE_GROUPS) s.scale[k] = ptx::ld_cg_u32(scales + 4 * g);
    }
  } else {
#pragma unroll
    for (u32 k = 0; k < UE8M0_ITERS; k++) {
      const u32 j = lane + k * WARP_SIZE;
      if (j < UE8M0_WORDS) s.ue8m0[k] = ptx::ld_cg_v4(scales + 16 * j);
    }
  }
}
// The scales into column `row % rows` of expert `row / rows` of recv_scales (column-major [E_local][cols]
// [rows]) for every lane in `valid`, whose `row` names one of the row's places.
__device__ __forceinline__ void store_row_scales(const RowScales& s, bool ue8m0, u32 valid, i32 row, u32 rows, u32* recv_scales) {
  const u32 lane = lane_id();
  if (!ue8m0) {
    for (u32 m = valid; m != 0; m &= m - 1) {
      const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
      u32* col0 = recv_scales + (u64)(r / rows) * SCALE_GROUPS * rows + r % rows;
#pragma unroll
      for (u32 k = 0; k < SCALE_ITERS; k++) {
        const u32 g = lane + k * WARP_SIZE;
        if (g < SCALE_GROUPS) col0[(u64)g * rows] = s.scale[k];
      }
    }
  } else {
    u32 packed[UE8M0_ITERS];
#pragma unroll
    for (u32 k = 0; k < UE8M0_ITERS; k++) packed[k] = ue8m0_pack4(s.ue8m0[k]);
    for (u32 m = valid; m != 0; m &= m - 1) {
      const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
      u32* col0 = recv_scales + (u64)(r / rows) * UE8M0_WORDS * rows + r % rows;
#pragma unroll
      for (u32 k = 0; k < UE8M0_ITERS; k++) {
        const u32 j = lane + k * WARP_SIZE;
        if (j < UE8M0_WORDS) col0[(u64)j * rows] = packed[k];
      }
    }
  }
}
// Dispatch send: FP8 lanes read 16 channels (32 bytes) and write 16 bytes; bf16 lanes move 16 bytes.
constexpr u32 FP8_LANE_CHANNELS = 16;
constexpr u32 FP8_CHUNK_CHANNELS = WARP_SIZE * FP8_LANE_CHANNELS;
constexpr u32 FP8_GROUP_LANES = FP8_GROUP / FP8_LANE_CHANNELS;  // 8 lanes share one scale
constexpr u32 SEND_CHUNKS = (PAYLOAD_BYTES + CHUNK_BYTES - 1) / CHUNK_BYTES;
constexpr u32 RECV_CHUNKS = SEND_CHUNKS;
static_assert(FP8_CHUNK_CHANNELS == CHUNK_BYTES, "an FP8 chunk is 512 channels = 512 output bytes");

// ceil(log2(x)) of a positive f32 from its bits (fp8::ceil_log2): exponent, +1 when any mantissa bit is set;
// subnormals as m * 2^-149; +inf gives 128.
__device__ __forceinline__ i32 ceil_log2_bits(u32 bits) {
  const u32 biased = (bits >> 23) & 0xffu;
  const u32 mantissa = bits & 0x7fffffu;
  if (biased == 0) {
    if (mantissa == 0) return -149;
    return -149 + (i32)(32 - __clz(mantissa - 1));
  }
  return (i32)biased - 127 + (mantissa != 0 ? 1 : 0);
}

// 2^e as f32, exactly (fp8::exp2i): +inf above 2^127, subnormal below 2^-126, 0 below 2^-149.
__device__ __forceinline__ float exp2i(i32 e) {
  if (e > 127) return bits_f32(0x7f800000u);
  if (e >= -126) return bits_f32((u32)(e + 127) << 23);
  if (e >= -149) return bits_f32(1u << (u32)(e + 149));
  return 0.0f;
}

// Loads one token's top-k row into registers and marks its live selections: live[k] when ids[k] is in
// [0, E) and not selected earlier in the row (an id repeated later counts once, at its first slot).
// Returns LL_PROBLEM_TOPK_IDX when the row holds an id outside [-1, E) or a repeat, else 0.
__device__ __forceinline__ u32 load_topk_row(const i64* row, u32 num_experts, i64 (&ids)[LL_TOPK], bool (&live)[LL_TOPK]) {
  u32 problem = 0;
#pragma unroll
  for (u32 k = 0; k < LL_TOPK; k++) ids[k] = (i64)ptx::ld_nc_u64(row + k);
#pragma unroll
  for (u32 k = 0; k < LL_TOPK; k++) {
    const bool valid = ids[k] >= 0 && ids[k] < (i64)num_experts;
    if (ids[k] < -1 || ids[k] >= (i64)num_experts) problem = LL_PROBLEM_TOPK_IDX;
    bool repeat = false;
#pragma unroll
    for (u32 j = 0; j < k; j++) repeat |= ids[j] == ids[k];
    if (valid && repeat) problem = LL_PROBLEM_TOPK_IDX;
    live[k] = valid && !repeat;
  }
  return problem;
}

// Quantises one lane's 16 channels (two 16-byte bf16 vectors) to FP8 with the scale of its 128-channel
// group (8 lanes). Bitwise equal to fp8::quantize_token: amax = max(|x|) over the group, floored at 1e-4;
// scale = 448 / amax and scale_inv = amax / 448 (IEEE divisions), or with round_scale scale_inv =
// 2^ceil(log2(amax / 448)) from the quotient's bits and scale = its exact inverse; q = e4m3(x * scale) with
// one f32 multiply and cvt.rn.satfinite. All 32 lanes must call it (shuffles); inactive lanes pass zeros.
__device__ __forceinline__ u32x4 quantize16(const u32x4& v0, const u32x4& v1, bool round_scale, float& scale_inv) {
  float f[16];
#pragma unroll
  for (u32 i = 0; i < 4; i++) {
    f[2 * i] = bf16_lo(word_of(v0, i));
    f[2 * i + 1] = bf16_hi(word_of(v0, i));
    f[8 + 2 * i] = bf16_lo(word_of(v1, i));
    f[8 + 2 * i + 1] = bf16_hi(word_of(v1, i));
  }
  float amax = 0.0f;
#pragma unroll
  for (u32 i = 0; i < 16; i++) amax = ptx::max_f32(amax, bits_f32(f32_bits(f[i]) & ABS_MASK));
#pragma unroll
  for (u32 m = FP8_GROUP_LANES / 2; m >= 1; m /= 2) amax = ptx::max_f32(amax, __shfl_xor_sync(FULL_WARP_MASK, amax, m));
  amax = ptx::max_f32(amax, bits_f32(AMAX_FLOOR_BITS_F32));
  const float e4m3_max = bits_f32(E4M3_MAX_BITS_F32);
  float scale;
  if (round_scale) {
    const i32 e = ceil_log2_bits(f32_bits(ptx::div_rn_f32(amax, e4m3_max)));
    scale = exp2i(-e);
    scale_inv = exp2i(e);
  } else {
    scale = ptx::div_rn_f32(e4m3_max, amax);
    scale_inv = ptx::div_rn_f32(amax, e4m3_max);
  }
  u32 q[4];
#pragma unroll
  for (u32 i = 0; i < 4; i++) {
    const u16 lo = ptx::cvt_rn_satfinite_e4m3x2_f32(ptx::mul_rn_f32(f[4 * i + 1], scale), ptx::mul_rn_f32(f[4 * i], scale));
    const u16 hi = ptx::cvt_rn_satfinite_e4m3x2_f32(ptx::mul_rn_f32(f[4 * i + 3], scale), ptx::mul_rn_f32(f[4 * i + 2], scale));
    q[i] = (u32)lo | ((u32)hi << 16);
  }
  return u32x4{q[0], q[1], q[2], q[3]};
}

// Earlier tokens' top-k rows, which a chunk-0 warp counts to rank its token: lane l holds rows
// base + l + 32 i (i < RANK_ROWS) below t, only the low 32 bits of each id (~0 for rows past t): valid ids
// are < E < 2^16, and an id whose low word aliases a valid one lies outside [-1, E) and fails the call on
// every rank anyway (LL_PROBLEM_TOPK_IDX).
constexpr u32 RANK_ROWS = LL_TOPK <= 8 ? 4 : LL_TOPK <= 16 ? 2 : 1;
struct PriorRows {
  u32 id[RANK_ROWS][LL_TOPK];
};

__device__ __forceinline__ PriorRows load_prior_rows(u64 topk_idx, u32 t, u32 base) {
  const u32* low = reinterpret_cast<const u32*>(topk_idx);  // i64 little endian: low word first
  PriorRows r;
#pragma unroll
  for (u32 i = 0; i < RANK_ROWS; i++) {
    const u32 row = base + lane_id() + i * WARP_SIZE;
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) r.id[i][k] = row < t ? ptx::ld_nc_u32(low + 2 * ((u64)row * LL_TOPK + k)) : 0xffffffffu;
  }
  return r;
}

// Lane k < LL_TOPK adds to `rank` how many of `rows` hold the id that lane k holds in `id` (its rank among
// those rows' tokens of that expert); other lanes add nothing. Every lane calls it (shuffles, reductions).
// `kSkipDead`: a lane holding ~0 (no expert) adds nothing, instead of counting the rows past t.
template <bool kSkipDead = false>
__device__ __forceinline__ void add_rows_with_id(u32 id, const PriorRows& rows, u32& rank) {
  const u32 lane = lane_id();
#pragma unroll
  for (u32 k = 0; k < LL_TOPK; k++) {
    const u32 e = __shfl_sync(FULL_WARP_MASK, id, k);
    u32 rows_with_e = 0;
#pragma unroll
    for (u32 i = 0; i < RANK_ROWS; i++) {
      bool hit = false;
#pragma unroll
      for (u32 j = 0; j < LL_TOPK; j++) hit |= rows.id[i][j] == e;
      rows_with_e += hit && (!kSkipDead || e != 0xffffffffu) ? 1u : 0u;
    }
    rows_with_e = __reduce_add_sync(FULL_WARP_MASK, rows_with_e);
    if (lane == k) rank += rows_with_e;
  }
}
