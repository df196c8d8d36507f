// moelink kernel family: low-latency (decode) dispatch and combine over NVLink.
//
// JIT constants (from moelink_kernels::ll::LlVariant):
//   MAX_RANKS                        ranks the argument structs have room for (<= WARP_SIZE)
//   LL_HIDDEN                        hidden size H (bf16 channels per token; multiple of 8, of 128 with FP8)
//   LL_TOPK                          experts per token K (1..=WARP_SIZE)
//   LL_FP8                           1: dispatch quantises rows to FP8 E4M3 per 128 channels; 0: bf16 rows
//   LL_THREADS                       threads per block (whole warps)
//   LL_SMEM_WORDS                    u32 words of shared scratch (per-expert counts / bases)
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
//              ctrl.X_consumed[s][d] >= ctrl.X_last_write[s] (local poll, deadline);
//          (1) data/metadata stores into every destination's region (weak, 16-byte where possible);
//          (2) every thread: fence.acq_rel.sys; __syncthreads; then the block arrives at every rank on its
//              own: red.relaxed.sys.add of (e - e') * share into ctrl.X_arrive[s][me][b % 8] of every rank (itself
//              included), e' = ctrl.X_last_write[s] = the epoch of this rank's previous call into set s, and
//              the blocks' shares summing to LL_ARRIVE_UNIT (ll_arrive_share), so that after call e the word
//              holds LL_ARRIVE_UNIT * e whatever the grid, and only once every block added. No block waits
//              for the others before its flags go out (until the sixth session the last block of a
//              grid-wide counter published, ~1.3 us after the median block). A grid counter (local) still
//              finds the last block, which stores the epoch words for the next launch.
//   recv:  lane p of warp 0 polls the sum of ctrl.X_arrive[s][p][*] >= LL_ARRIVE_UNIT * e (wrap-safe, relaxed .sys loads, deadline),
//          then fence.acq_rel.sys + __syncthreads before anyone reads p's data; the last block to finish
//          stores e into ctrl.X_consumed[s][me] of every rank (after a fence), which lets the sources write
//          set s again.
//   Masked ranks (shrink mode) are not waited for and their data is dropped; with LL_FLAG_SHRINK a missed
//   deadline masks the peer (decided once per call with a CAS on ctrl.decision, so every block agrees)
//   instead of raising ERR_TIMEOUT. Without it a missed deadline writes the error record and the kernel
//   winds down without publishing its flags, so peers time out too (no hang, no trap).
// Argument problems found on the GPU (invalid top-k ids, combine inputs that differ from dispatch's) travel
// in the metadata next to the flags: every rank finishes the protocol and reports them in LlReport, so the
// call fails on every rank with an argument error and the buffer stays usable.
#include "ptx.cuh"

#if !defined(MAX_RANKS) || !defined(LL_HIDDEN) || !defined(LL_TOPK) || !defined(LL_FP8) || !defined(LL_THREADS) || \
    !defined(LL_SMEM_WORDS) || !defined(MOELINK_SIZEOF_LL_DISPATCH_ARGS) || !defined(MOELINK_SIZEOF_LL_COMBINE_ARGS) ||  \
    !defined(MOELINK_SIZEOF_LL_CTRL) || !defined(MOELINK_SIZEOF_LL_REPORT)
#error "ll.cu needs every JIT constant listed at the top of the file"
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
// Timing experiment only (MOELINK_LL_EXPERIMENT=local_stores; results are wrong): the send phases' row
// stores go to this rank's own region instead of the destination's, so NVLink's share of their time shows;
// each destination's rows to their own slots there (slot [destination][token]: with every destination's
// rows on slot [me][token], as until run 1 of the fifth session, the writes of 2-4 SMs met on one line).
// Per-expert combine rows still share their slots.
constexpr u32 LL_FLAG_EXP_LOCAL_STORES = 65536;  // 1 << 16
// Timing experiment only (MOELINK_LL_EXPERIMENT=no_loads; results are wrong): the send phases do not load
// their payload rows (x, y) and send zeros, so the loads' share of their time shows.
constexpr u32 LL_FLAG_EXP_NO_LOADS = 131072;  // 1 << 17
// Timing experiment (MOELINK_LL_EXPERIMENT=last_arrives; results stay right): the send phases' arrivals
// are made by the last block of the grid-wide counter, once for all blocks (after a system fence), instead
// of by every block on its own (ll_send_arrive).
constexpr u32 LL_FLAG_EXP_LAST_ARRIVES = 262144;  // 1 << 18

// Argument problems (LlMeta::problem, LlReport): bits, each naming one argument on the host.
constexpr u32 LL_PROBLEM_TOPK_IDX = 1;            // dispatch: an id outside [-1, E) or an expert twice in a row
constexpr u32 LL_PROBLEM_TOPK_IDX_DIFFERS = 2;    // combine: topk_idx differs from dispatch's
constexpr u32 LL_PROBLEM_WEIGHTS_DIFFER = 4;      // combine (pre-reduced): topk_weights differ from dispatch's
constexpr u32 LL_PROBLEM_ZERO_COPY = 8;           // combine: no zero-copy buffer of this shape (host-detected)
constexpr u32 LL_PROBLEM_HANDLE = 16;             // combine: expired handle / dispatch hook not run (host)

// Shrink decisions per (kind, source).
constexpr u32 LL_KIND_DISPATCH = 0;
constexpr u32 LL_KIND_COMBINE = 1;

// Timing trace (MOELINK_LL_TRACE on the host; `trace` is 0 otherwise): thread 0 of every block stores
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
constexpr u32 LL_TRACE_WORDS = 10;
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
constexpr u32 FP8_GROUP = 128;
constexpr u32 E4M3_MAX_BITS_F32 = 0x43e00000u;  // 448.0f
constexpr u32 AMAX_FLOOR_BITS_F32 = 0x38d1b717u;  // 1e-4f
constexpr u32 ABS_MASK = 0x7fffffffu;

// Row payload in recv_x, scale groups, and the 512-byte chunks a warp moves per row.
constexpr u32 ROW_BYTES_BF16 = 2 * LL_HIDDEN;
constexpr u32 PAYLOAD_BYTES = LL_FP8 ? LL_HIDDEN : ROW_BYTES_BF16;
constexpr u32 SCALE_GROUPS = LL_HIDDEN / FP8_GROUP;
constexpr u32 UE8M0_WORDS = SCALE_GROUPS / 4;
// Register arrays of scales per lane (at least one element; UE8M0 needs H % 512 == 0, checked on the host).
constexpr u32 SCALE_ITERS = SCALE_GROUPS > WARP_SIZE ? (SCALE_GROUPS + WARP_SIZE - 1) / WARP_SIZE : 1;
constexpr u32 UE8M0_ITERS = UE8M0_WORDS > WARP_SIZE ? (UE8M0_WORDS + WARP_SIZE - 1) / WARP_SIZE : 1;
// Dispatch send: FP8 lanes read 16 channels (32 bytes) and write 16 bytes; bf16 lanes move 16 bytes.
constexpr u32 FP8_LANE_CHANNELS = 16;
constexpr u32 FP8_CHUNK_CHANNELS = WARP_SIZE * FP8_LANE_CHANNELS;
constexpr u32 FP8_GROUP_LANES = FP8_GROUP / FP8_LANE_CHANNELS;  // 8 lanes share one scale
constexpr u32 SEND_CHUNKS = (PAYLOAD_BYTES + CHUNK_BYTES - 1) / CHUNK_BYTES;
constexpr u32 RECV_CHUNKS = SEND_CHUNKS;
constexpr u32 BF16_CHUNKS = (ROW_BYTES_BF16 + CHUNK_BYTES - 1) / CHUNK_BYTES;
// Combine loads at most this many expert rows before summing them (registers: 4 per row).
constexpr u32 K_BATCH = LL_TOPK < 8 ? LL_TOPK : 8;
static_assert(FP8_CHUNK_CHANNELS == CHUNK_BYTES, "an FP8 chunk is 512 channels = 512 output bytes");

// ============================================================================================ structs
// Per-source metadata, written by the source before its flag (one 64-byte line).
struct LlMeta {
  u32 num_tokens;            // tokens the source dispatched in this call
  u32 problem;               // LL_PROBLEM_* bits of the source's arguments
  u32 accepted;              // combine: 1 when the source received this rank's dispatch (it was not masked)
  u32 reserved;
  u32 sig[LL_SIG_WORDS];     // dispatch: the call signature (hidden, topk, experts, T_max, quant, weights)
  u32 pad[4];
};
static_assert(sizeof(LlMeta) == 64, "LlMeta is one 64-byte line");

// Arrival words (ll_send_arrive): a source's blocks add to LL_ARRIVE_LANES words per (set, source), block b
// to word b % LL_ARRIVE_LANES, each word alone on its 128-byte line; the receiver sums them. With one word
// per (set, source) and the sources' words on one line, the 4 x 132 remote reductions of a call met on one
// line of every GPU and every block's stores were acknowledged ~1 us later (sixth session, runs 2-3).
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
  u32 dispatch_recv_done;
  u32 combine_send_done;
  u32 combine_recv_done;
  u32 dispatch_last_write[2];
  u32 combine_last_write[2];
  u32 pad0[6];
  u32 decision[2][MAX_RANKS];           // [kind][src] = (epoch << 1) | accepted, shrink mode only
  // [set][src][lane]: the lanes' sum = LL_ARRIVE_UNIT * epoch of src's last dispatch into set
  LlArriveLine dispatch_arrive[2][MAX_RANKS][LL_ARRIVE_LANES];
  LlArriveLine combine_arrive[2][MAX_RANKS][LL_ARRIVE_LANES];
  u32 dispatch_consumed[2][MAX_RANKS];  // [set][dst] = epoch dst last finished reading set from me
  u32 combine_consumed[2][MAX_RANKS];
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
  u32 epoch;
  u32 prev_write;            // send: this rank's previous epoch in the call's buffer set (X_last_write[set])
  u32 abort;                 // a wait of this block failed: skip the data work
  u32 problem;
  u32 last;
  u32 phase_ok;              // last block: no block of the phase failed
  u64 trace_row;             // this launch's timing-trace row (ll_trace_row), or 0
};

__device__ __forceinline__ void ll_trace(const LlShared& sm, u32 point) { ll_trace_at(sm.trace_row, point, ptx::globaltimer()); }

// ============================================================================================ PTX helpers
// (named after the instruction they emit; specific to this family). The host emulator of
// tests/ll_emulation.rs (emu/ptx_emu.hpp) provides C++ versions of these.
#ifndef MOELINK_HOST_EMULATION
namespace llptx {

__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// A block's arrival at a peer (send phases): no return value, so the issuing thread does not wait for the
// NVLink round trip.
__device__ __forceinline__ void red_add_relaxed_sys(u32* p, u32 v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_gpu(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// L2-only loads: data peers wrote into this GPU's memory during the kernel (coherent at L2).
__device__ __forceinline__ u32x4 ld_cg_v4(const void* p) {
  u32x4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 ld_cg_u32(const void* p) {
  u32 v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u64 ld_nc_u64(const void* p) {
  u64 v;
  asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u32 ld_nc_u32(const void* p) {
  u32 v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void st_na_u32(void* p, u32 v) {
  asm volatile("st.global.L1::no_allocate.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_na_u64(void* p, u64 v) {
  asm volatile("st.global.L1::no_allocate.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Brings a line into L2 without waiting for it (loads issued before a wait, consumed after it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// IEEE f32 arithmetic with the rounding mode spelled out: never contracted into an FMA.
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// max.f32: when one input is NaN the other is returned (like Rust's f32::max).
__device__ __forceinline__ float max_f32(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

}  // namespace llptx
#endif

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

// Destination order of one rank's stores: me + 1, me + 2, ..., me (mod R). Every rank walking its
// destinations from the lowest rank up sent the first wave of every SM of every GPU to rank 0, then to rank
// 1, ...: one GPU's ingress saturated while the others idled (the LL send phases ran at ~200 GB/s, half the
// all-to-all ceiling; MOELINK_LL_TRACE, run 2 of the fourth session). Starting after oneself spreads each wave
// over all destinations.
__device__ __forceinline__ u32 first_dest(u32 rank, u32 num_ranks) { return rank + 1 == num_ranks ? 0 : rank + 1; }

// `ranks` (bits < num_ranks) rotated right by `by` (< num_ranks): bit i of the result is rank (i + by) mod R.
__device__ __forceinline__ u32 rotate_ranks(u32 ranks, u32 by, u32 num_ranks) {
  if (by == 0) return ranks;
  const u64 all = num_ranks >= 32 ? 0xffffffffull : ((1ull << num_ranks) - 1);
  return (u32)((((u64)ranks >> by) | ((u64)ranks << (num_ranks - by))) & all);
}

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
  for (u32 k = 0; k < LL_TOPK; k++) ids[k] = (i64)llptx::ld_nc_u64(row + k);
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

// End of a receive phase, called by every thread of every block: the block counts itself in `done` (plus
// LL_DONE_FAILED when its phase failed: sm.abort), and exactly one block — the last — gets true, with the
// counter reset for the next launch and an acquire/release fence issued by its thread 0, the thread that
// then publishes the consumed flags; sm.phase_ok tells it whether every block succeeded (a failure of
// another phase or kernel does not count). What it publishes only orders the blocks' loads of the receive
// region, which completed before their barriers; the outputs are ordered by the kernel boundary.
constexpr u32 LL_DONE_FAILED = 1u << 16;  // gridDim.x < 2^16
// `point`: the trace point stamped once the block's threads are past their work.
__device__ __forceinline__ bool ll_last_block(u32* done, LlShared& sm, u32 point) {
  __syncthreads();
  ll_trace(sm, point);
  if (threadIdx.x == 0) {
    const u32 mine = 1u + (sm.abort != 0 ? LL_DONE_FAILED : 0u);
    const u32 old = llptx::atom_add_acq_rel_gpu(done, mine);
    const bool last = (old & (LL_DONE_FAILED - 1)) == gridDim.x - 1;
    if (last) {
      ptx::fence_acq_rel_sys();
      llptx::st_relaxed_gpu(done, 0);
    }
    sm.last = last ? 1u : 0u;
    sm.phase_ok = (old + mine) < LL_DONE_FAILED ? 1u : 0u;
  }
  __syncthreads();
  return sm.last != 0;
}

// One call's arrivals from all of a source's blocks: block b's share is LL_ARRIVE_UNIT / G, block 0 adds the
// remainder. Every share is positive (G <= 65536), so the word reaches its target only once every block
// added, and a peer with another grid size (MOELINK_LL_SMS) still sums to the same unit.
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
// set. With LL_FLAG_EXP_LAST_ARRIVES the last block arrives for the whole grid instead (after a system
// fence, only when no block failed), as every send did until the sixth session.
template <typename ArriveOf>
__device__ __forceinline__ bool ll_send_arrive(u32* done, LlShared& sm, bool stored, u32 num_ranks, u32 flags, u32 epochs, ArriveOf arrive_of) {
  const bool per_block = (flags & LL_FLAG_EXP_LAST_ARRIVES) == 0;
  if (stored) ptx::fence_acq_rel_sys();
  __syncthreads();
  ll_trace(sm, LL_TRACE_SEND_STORED);
  // Warp 1, not thread 0: thread 0's counter atomic below then does not wait behind the reductions.
  if (per_block && warp_id() == 1 && lane_id() < num_ranks && sm.abort == 0)
    llptx::red_add_relaxed_sys(arrive_of(lane_id()), epochs * ll_arrive_share());
  if (threadIdx.x == 0) {
    const u32 mine = 1u + (sm.abort != 0 ? LL_DONE_FAILED : 0u);
    const u32 old = llptx::atom_add_acq_rel_gpu(done, mine);
    const bool last = (old & (LL_DONE_FAILED - 1)) == gridDim.x - 1;
    if (last) {
      llptx::st_relaxed_gpu(done, 0);
      if (!per_block && old + mine < LL_DONE_FAILED) {
        ptx::fence_acq_rel_sys();
        for (u32 p = 0; p < num_ranks; p++) llptx::red_add_relaxed_sys(arrive_of(p), epochs * LL_ARRIVE_UNIT);
      }
    }
    sm.last = last ? 1u : 0u;
  }
  __syncthreads();
  return sm.last != 0;
}

// Waits (warp 0, lane p < R) until every unmasked rank p has consumed what this rank last wrote into set
// `set` of its region (consumed[p] >= last_write). Shrink mode: a rank that misses the deadline is masked.
// Sets sm.abort on a hard failure. Called by every block; ends with __syncthreads.
__device__ __forceinline__ void ll_wait_consumed(const u32* consumed, const u32* last_write, u32* mask, u32 num_ranks,
                                                 const Deadline& d, bool soft, LlShared& sm) {
  if (threadIdx.x == 0) sm.abort = 0;
  __syncthreads();
  const u32 lane = lane_id();
  if (warp_id() == 0 && lane < num_ranks) {
    // The three words are loaded together (one round trip, not three); the wait polls only when the first
    // look at the peer's consumed flag was not enough.
    const u32 target = ptx::ld_relaxed_gpu(last_write);
    const u32 masked = ptx::ld_relaxed_gpu(mask + lane);
    const u32 seen = ptx::ld_relaxed_sys(consumed + lane);
    if (masked == 0 && (i32)(seen - target) < 0) {
      const u32 w = ll_wait_geq([&] { return ptx::ld_relaxed_sys(consumed + lane); }, target, d, lane, soft);
      if (w == LL_WAIT_SEEN) (void)ptx::ld_acquire_sys(consumed + lane);
      if (w == LL_WAIT_TIMEOUT) llptx::st_relaxed_gpu(mask + lane, 1);
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
// (LL_ARRIVE_UNIT * epoch: every block of p's send arrived), honouring its mask. Shrink mode: every block
// resolves p through the call's decision word (ll_decide), so that all blocks use or drop p's data alike
// even when they looked at different moments (p masked meanwhile, flag arriving late); a peer decided
// absent is masked for later calls.
__device__ __forceinline__ SourceState ll_wait_source(const LlArriveLine* arrive, u32 epoch, u32 target, u32* mask, u32* decision, u32 p,
                                                      const Deadline& d, bool soft, LlShared& sm) {
  SourceState s = {false, 0};
  const bool masked = ptx::ld_relaxed_gpu(mask + p) != 0;
  u32 w = LL_WAIT_TIMEOUT;
  if (!masked) {
    const u64 start = ptx::globaltimer();
    w = ll_wait_geq([&] { return ll_arrivals(arrive); }, target, d, p, soft);
    s.waited_ns = ptx::globaltimer() - start;
  }
  if (w == LL_WAIT_FAILED) {
    sm.abort = 1;
    return s;
  }
  bool seen = w == LL_WAIT_SEEN;
  if (soft) {
    seen = ll_decide(decision + p, epoch, seen);
    if (!seen && !masked) llptx::st_relaxed_gpu(mask + p, 1);
  }
  if (seen) ptx::fence_acq_rel_sys();
  s.used = seen;
  return s;
}

// ============================================================================================ operation frame
// ll_dispatch and ll_combine run one protocol on parallel LlCtrl fields (dispatch_* / combine_*). op_fields
// picks one operation's fields of a control area, for the call's set, by the argument type, so that the
// steps both kernels share are written once: ll_enter, ll_send_phase, ll_recv_end.
struct LlOpFields {
  u32* epoch;            // the operation's call counter
  u32* send_done;        // grid-wide counters of the send and the receive phase
  u32* recv_done;
  u32* last_write;       // epoch of the area's rank's last send into the set
  u32* consumed;         // [dst]
  LlArriveLine* arrive;  // [src * LL_ARRIVE_LANES + lane]
};
__device__ __forceinline__ LlOpFields op_fields(LlCtrl* c, const LlDispatchArgs& a) {
  return {&c->dispatch_epoch,          &c->dispatch_send_done,         &c->dispatch_recv_done,
          &c->dispatch_last_write[a.set], c->dispatch_consumed[a.set], &c->dispatch_arrive[a.set][0][0]};
}
__device__ __forceinline__ LlOpFields op_fields(LlCtrl* c, const LlCombineArgs& a) {
  return {&c->combine_epoch,          &c->combine_send_done,         &c->combine_recv_done,
          &c->combine_last_write[a.set], c->combine_consumed[a.set], &c->combine_arrive[a.set][0][0]};
}

// Tells every source that this rank finished reading what it wrote into the set: consumed = epoch at each.
template <typename Args>
__device__ __forceinline__ void ll_hand_back(const Args& a, u32 epoch) {
  for (u32 p = 0; p < a.num_ranks; p++) ptx::st_relaxed_sys(op_fields(ctrl_of(a.ctrl, p), a).consumed + a.rank, epoch);
}

// Kernel entry, every thread. A DRAIN launch (a receive phase that will never run: its hook was dropped)
// only hands the set back, as of this rank's last send into it, and gets false. Otherwise sm.epoch is the
// call's epoch: a send works as call e = epoch + 1; a receive-only launch belongs to the last send into its
// set (with hooks, two calls may be in flight: send e, send e+1, receive e, receive e+1).
template <typename Args>
__device__ __forceinline__ bool ll_enter(const Args& a, LlShared& sm, u64 entered) {
  const LlOpFields own = op_fields(ctrl_of(a.ctrl, a.rank), a);
  if (a.phases & LL_PHASE_DRAIN) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const u32 e = ptx::ld_relaxed_gpu(own.last_write);
      ptx::fence_acq_rel_sys();
      ll_hand_back(a, e);
    }
    return false;
  }
  if (threadIdx.x == 0) {
    sm.prev_write = ptx::ld_relaxed_gpu(own.last_write);
    sm.epoch = (a.phases & LL_PHASE_SEND) ? ptx::ld_relaxed_gpu(own.epoch) + 1u : sm.prev_write;
    sm.trace_row = ll_trace_row(a.trace, sm.epoch, a.phases);
    ll_trace_at(sm.trace_row, LL_TRACE_START, entered);
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
  ll_wait_consumed(own.consumed, own.last_write, me->mask, a.num_ranks, d, (a.flags & LL_FLAG_SHRINK) != 0, sm);
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
  const bool last = ll_send_arrive(own.send_done, sm, stored, a.num_ranks, a.flags, epoch - sm.prev_write,
                                   [&](u32 p) { return &op_fields(ctrl_of(a.ctrl, p), a).arrive[lane_line].word; });
  if (last && threadIdx.x == 0) {
    *own.epoch = epoch;
    *own.last_write = epoch;
  }
  ll_trace(sm, LL_TRACE_SEND_DONE);
}

// End of a receive phase, every thread of every block: the last block hands the set back to every source
// when every block of the phase succeeded.
template <typename Args>
__device__ __forceinline__ void ll_recv_end(const Args& a, LlShared& sm, u32 epoch) {
  if (ll_last_block(op_fields(ctrl_of(a.ctrl, a.rank), a).recv_done, sm, LL_TRACE_RECV_STORED) && threadIdx.x == 0 && sm.phase_ok) ll_hand_back(a, epoch);
}

// ============================================================================================ dispatch: send
// Block 0 of the send phase: validates this rank's top-k rows (ids outside [-1, E), repeats), keeps its
// top-k ids/weights in the handle area (combine checks its inputs against them), writes each destination's
// counts (tokens per local expert: shared-memory atomics over the live selections, sm.words cleared by
// dispatch_send) into its receive region and the
// metadata line (tokens, problems, signature) into its control area. The per-token routing travels with
// the rows (dispatch_rows), so this block is never on the critical path (it used to build every
// destination's entries and ended as late as the data: 10 us at 128 tokens, all of the critical path at
// 1-16 tokens; run 11 of the fourth session).
__device__ __forceinline__ void dispatch_check(const LlDispatchArgs& a, LlShared& sm) {
  const u32 T = a.num_tokens, E = a.num_experts, R = a.num_ranks;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const float* wts = reinterpret_cast<const float*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;

  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  u32 problem = 0;
  for (u32 t = threadIdx.x; t < T; t += LL_THREADS) {
    i64 ids[LL_TOPK];
    bool live[LL_TOPK];
    problem |= load_topk_row(idx + (u64)t * LL_TOPK, E, ids, live);
    u32 w[LL_TOPK];
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) w[k] = has_weights ? llptx::ld_nc_u32(wts + (u64)t * LL_TOPK + k) : 0u;
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      reinterpret_cast<i64*>(a.home_idx)[(u64)t * LL_TOPK + k] = ids[k];
      if (has_weights) reinterpret_cast<u32*>(a.home_weight)[(u64)t * LL_TOPK + k] = w[k];
      if (live[k]) atomicAdd(&sm.words[(u32)ids[k]], 1u);
    }
  }
  if (problem != 0) atomicOr(&sm.problem, problem);
  __syncthreads();
  // Counts: expert e = d * E_local + el goes to counts [me][el] of rank d (local_stores: the own region's
  // counts [d][el]).
  const bool local_stores = (a.flags & LL_FLAG_EXP_LOCAL_STORES) != 0;
  const u32 EL = a.num_local_experts;
  for (u32 e = threadIdx.x; e < E; e += LL_THREADS) {
    const u32 n = sm.words[e];
    const u32 dest = e / EL, el = e % EL;
    u8* region = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : dest]);
    llptx::st_na_u32(region + a.off_counts + ((u64)(local_stores ? dest : a.rank) * EL + el) * 4, n);
  }
  __syncthreads();
  ll_trace(sm, LL_TRACE_INDEX_CHECKED);

  const u32 problem_all = sm.problem;
  if (threadIdx.x < R) {
    LlMeta* m = &ctrl_of(a.ctrl, threadIdx.x)->dispatch_meta[a.set][a.rank];
    llptx::st_na_u32(&m->num_tokens, T);
    llptx::st_na_u32(&m->problem, problem_all);
#pragma unroll
    for (u32 i = 0; i < LL_SIG_WORDS; i++) llptx::st_na_u32(&m->sig[i], a.sig[i]);
  }
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
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
  for (u32 i = 0; i < 16; i++) amax = llptx::max_f32(amax, bits_f32(f32_bits(f[i]) & ABS_MASK));
#pragma unroll
  for (u32 m = FP8_GROUP_LANES / 2; m >= 1; m /= 2) amax = llptx::max_f32(amax, __shfl_xor_sync(FULL_WARP_MASK, amax, m));
  amax = llptx::max_f32(amax, bits_f32(AMAX_FLOOR_BITS_F32));
  const float e4m3_max = bits_f32(E4M3_MAX_BITS_F32);
  float scale;
  if (round_scale) {
    const i32 e = ceil_log2_bits(f32_bits(llptx::div_rn(amax, e4m3_max)));
    scale = exp2i(-e);
    scale_inv = exp2i(e);
  } else {
    scale = llptx::div_rn(e4m3_max, amax);
    scale_inv = llptx::div_rn(amax, e4m3_max);
  }
  u32 q[4];
#pragma unroll
  for (u32 i = 0; i < 4; i++) {
    const u16 lo = ptx::cvt_rn_satfinite_e4m3x2_f32(llptx::mul_rn(f[4 * i + 1], scale), llptx::mul_rn(f[4 * i], scale));
    const u16 hi = ptx::cvt_rn_satfinite_e4m3x2_f32(llptx::mul_rn(f[4 * i + 3], scale), llptx::mul_rn(f[4 * i + 2], scale));
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

__device__ __forceinline__ PriorRows load_prior_rows(const LlDispatchArgs& a, u32 t, u32 base) {
  const u32* low = reinterpret_cast<const u32*>(a.topk_idx);  // i64 little endian: low word first
  PriorRows r;
#pragma unroll
  for (u32 i = 0; i < RANK_ROWS; i++) {
    const u32 row = base + lane_id() + i * WARP_SIZE;
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) r.id[i][k] = row < t ? llptx::ld_nc_u32(low + 2 * ((u64)row * LL_TOPK + k)) : 0xffffffffu;
  }
  return r;
}

// A token's routing, stored with its chunk-0 item into every rank (routed there or not, so that every slot
// t < num_tokens of this source holds this call's): lane k < K writes, if the token's k-th id is live (in
// [0, E), `id`, and not an earlier slot's id), id << 16 | the token's rank among this rank's tokens that
// selected that expert, else ~0, into entries [me][t][k], and its weight bits into weights [me][t][k].
// With the source's counts (dispatch_check) the receiver places the row without looking at any other
// token (dispatch_recv). The rank is counted here, by the warp, over the earlier rows (`first`: rows 0 ..
// 32 RANK_ROWS - 1, loaded with the item's payload; later passes load their own): no shared state, so no
// block-wide step between the hand-back wait and the first stores (sender-side bitmaps built during that
// wait delayed every block's stores by 0.8 us at 128 tokens: sixth session, run 1).
__device__ __forceinline__ void dispatch_routing(const LlDispatchArgs& a, u32 t, u32 id, u32 wbits, bool local_stores, const PriorRows& first) {
  const u32 lane = lane_id();
  bool live = id != 0xffffffffu;
#pragma unroll
  for (u32 j = 0; j < LL_TOPK; j++) {
    const u32 other = __shfl_sync(FULL_WARP_MASK, id, j);
    if (j < lane && other == id) live = false;
  }
  u32 rank = 0;
  auto count = [&](const PriorRows& r) {
#pragma unroll
    for (u32 k = 0; k < LL_TOPK; k++) {
      const u32 e = __shfl_sync(FULL_WARP_MASK, id, k);
      u32 rows_with_e = 0;
#pragma unroll
      for (u32 i = 0; i < RANK_ROWS; i++) {
        bool hit = false;
#pragma unroll
        for (u32 j = 0; j < LL_TOPK; j++) hit |= r.id[i][j] == e;
        rows_with_e += hit ? 1u : 0u;
      }
      rows_with_e = __reduce_add_sync(FULL_WARP_MASK, rows_with_e);
      if (lane == k) rank += rows_with_e;
    }
  };
  count(first);
  for (u32 base = RANK_ROWS * WARP_SIZE; base < t; base += RANK_ROWS * WARP_SIZE) count(load_prior_rows(a, t, base));
  if (lane >= LL_TOPK) return;
  const u32 entry = live ? (id << 16) | rank : 0xffffffffu;
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u32 dest0 = first_dest(a.rank, a.num_ranks);
  for (u32 i = 0; i < a.num_ranks; i++) {
    const u32 p = dest0 + i >= a.num_ranks ? dest0 + i - a.num_ranks : dest0 + i;
    u8* region = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]);
    const u64 at = ((u64)(local_stores ? p : a.rank) * a.max_tokens + t) * LL_TOPK * 4 + lane * 4;
    llptx::st_na_u32(region + a.off_entries + at, entry);
    if (has_weights) llptx::st_na_u32(region + a.off_weights + at, wbits);
  }
}

// Rows: work item = (token, 512-byte chunk of its payload), dealt over the data warps. The warp finds the
// token's destination ranks from its top-k ids (valid ids only; each rank once), quantises the chunk once
// (FP8) and stores it into slot [me][token] of every destination (16 bytes per lane; FP8 scale_inv as 4
// bytes per 128-channel group after the payload); the chunk-0 item then also stores the token's routing
// (dispatch_routing; the earlier rows it counts are loaded with the payload).
// Returns whether this warp stored anything.
__device__ __forceinline__ bool dispatch_rows(const LlDispatchArgs& a, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 E = a.num_experts, EL = a.num_local_experts;
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32* wts = reinterpret_cast<const u32*>(a.topk_weights);
  const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  const u32 items = a.num_tokens * SEND_CHUNKS;
  bool stored = false;
  const bool local_stores = (a.flags & LL_FLAG_EXP_LOCAL_STORES) != 0;
  const bool loads = (a.flags & LL_FLAG_EXP_NO_LOADS) == 0;
  const u32 dest0 = first_dest(a.rank, a.num_ranks);
  for (u32 item = first_warp; item < items; item += num_warps) {
    const u32 t = item / SEND_CHUNKS, c = item % SEND_CHUNKS;
    // The row chunk is loaded together with the top-k ids (independent loads in flight at once).
    PriorRows prior;
    if (c == 0) prior = load_prior_rows(a, t, 0);
#if LL_FP8
    const u32 ch = c * FP8_CHUNK_CHANNELS + lane * FP8_LANE_CHANNELS;
    const bool active = ch < LL_HIDDEN;
    u32x4 v0 = {0, 0, 0, 0}, v1 = {0, 0, 0, 0};
    if (active && loads) {
      const u32x4* src = reinterpret_cast<const u32x4*>(x + ((u64)t * LL_HIDDEN + ch) * 2);
      v0 = ptx::ld_nc_na_v4(src);
      v1 = ptx::ld_nc_na_v4(src + 1);
    }
#else
    const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
    const bool active = off < PAYLOAD_BYTES;
    u32x4 v = {0, 0, 0, 0};
    if (active && loads) v = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(x + (u64)t * ROW_BYTES_BF16 + off));
#endif
    u32 ranks = 0, id = 0xffffffffu, wbits = 0;
    if (lane < LL_TOPK) {
      const i64 e = (i64)llptx::ld_nc_u64(idx + (u64)t * LL_TOPK + lane);
      if (c == 0 && has_weights) wbits = llptx::ld_nc_u32(wts + (u64)t * LL_TOPK + lane);
      if (e >= 0 && e < (i64)E) {
        ranks = 1u << ((u32)e / EL);
        id = (u32)e;
      }
    }
    ranks = __reduce_or_sync(FULL_WARP_MASK, ranks);
    if (c == 0) stored = true;  // the routing, below
    if (ranks != 0) stored = true;
    // local_stores: into the own region's slot [p][token] (distinct per destination, like the real stores).
    auto slot_of = [&](u32 p) { return a.off_rows + ((u64)(local_stores ? p : a.rank) * a.max_tokens + t) * a.row_stride; };
#if LL_FP8
    float scale_inv;
    const u32x4 q = quantize16(v0, v1, (a.flags & LL_FLAG_ROUND_SCALE) != 0, scale_inv);
    for (u32 rot = rotate_ranks(ranks, dest0, a.num_ranks); rot != 0; rot &= rot - 1) {
      const u32 i = __ffs(rot) - 1 + dest0;
      const u32 p = i >= a.num_ranks ? i - a.num_ranks : i;
      u8* row = reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]) + slot_of(p);
      if (active) {
        ptx::st_na_v4(reinterpret_cast<u32x4*>(row + ch), q);
        if (lane % FP8_GROUP_LANES == 0) llptx::st_na_u32(row + LL_HIDDEN + (ch / FP8_GROUP) * 4, f32_bits(scale_inv));
      }
    }
#else
    for (u32 rot = rotate_ranks(ranks, dest0, a.num_ranks); rot != 0; rot &= rot - 1) {
      const u32 i = __ffs(rot) - 1 + dest0;
      const u32 p = i >= a.num_ranks ? i - a.num_ranks : i;
      if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : p]) + slot_of(p) + off), v);
    }
#endif
    if (c == 0) dispatch_routing(a, t, id, wbits, local_stores, prior);
  }
  return stored;
}

__device__ __forceinline__ void dispatch_send(const LlDispatchArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  // The check block's top-k rows are sent towards L2 before the hand-back wait, whose round trips (~1 us)
  // they then overlap; not by warp 0 (its lanes poll the hand-back words, whose loads would queue behind the
  // prefetches). The data warps do not prefetch: with a prefetch per lane of their first row chunk the
  // wait took 1.9 us instead of 1.0 and the warps issued their stores no earlier (runs 3-7).
  if (blockIdx.x == 0) {
    for (u32 e = threadIdx.x; e < a.num_experts; e += LL_THREADS) sm.words[e] = 0;  // dispatch_check's counts
    if (warp_id() != 0) {
      for (u32 t = threadIdx.x - WARP_SIZE; t < a.num_tokens; t += LL_THREADS - WARP_SIZE)
        llptx::prefetch_l2(reinterpret_cast<const i64*>(a.topk_idx) + (u64)t * LL_TOPK);
    }
  }
  ll_send_phase(a, d, sm, epoch, [&] { dispatch_check(a, sm); },
                [&](u32 first_warp, u32 num_warps) { return dispatch_rows(a, first_warp, num_warps); });
}

// ============================================================================================ dispatch: receive
// Warp 0 of every block waits for every source (lane p <-> source p) and checks its metadata: a source is
// used when its flag arrived (shrink: the call's decision says so), its call signature equals ours and it
// reported no argument problem. Block 0 records the wait times and reports mismatches/problems (lowest peer).
__device__ __forceinline__ void dispatch_wait_sources(const LlDispatchArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  const u32 lane = lane_id();
  if (threadIdx.x == 0) sm.abort = 0;
  __syncthreads();
  if (warp_id() == 0) {
    bool used = false;
    u32 ntok = 0, mismatch_field = LL_SIG_WORDS, problem = 0;
    u64 waited = 0;
    if (lane < a.num_ranks) {
      const SourceState s =
          ll_wait_source(me->dispatch_arrive[a.set][lane], epoch, epoch * LL_ARRIVE_UNIT, me->mask, me->decision[LL_KIND_DISPATCH], lane, d, soft, sm);
      waited = s.waited_ns;
      if (s.used) {
        const LlMeta* m = &me->dispatch_meta[a.set][lane];
        // Every word is loaded before any is compared: independent loads in flight together, not one L2
        // round trip per word.
        u32 sig[LL_SIG_WORDS];
#pragma unroll
        for (u32 i = 0; i < LL_SIG_WORDS; i++) sig[i] = llptx::ld_cg_u32(&m->sig[i]);
        problem = llptx::ld_cg_u32(&m->problem);
        const u32 n = llptx::ld_cg_u32(&m->num_tokens);
#pragma unroll
        for (u32 i = LL_SIG_WORDS; i-- > 0;)
          if (sig[i] != a.sig[i]) mismatch_field = i;
        ntok = n < a.max_tokens ? n : a.max_tokens;
        used = mismatch_field == LL_SIG_WORDS && problem == 0;
      }
      sm.ok[lane] = used ? 1u : 0u;
      sm.ntok[lane] = used ? ntok : 0u;
    }
    if (blockIdx.x == 0) {
      if (lane < a.num_ranks && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[lane] += (i64)waited;
      LlReport* rep = reinterpret_cast<LlReport*>(a.report);
      const u32 mism = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && mismatch_field != LL_SIG_WORDS);
      if (mism != 0 && lane == __ffs(mism) - 1) {
        const LlMeta* m = &me->dispatch_meta[a.set][lane];
        ptx::st_relaxed_sys_u64(&rep->mismatch_ours, a.sig[mismatch_field]);
        ptx::st_relaxed_sys_u64(&rep->mismatch_theirs, llptx::ld_cg_u32(&m->sig[mismatch_field]));
        ptx::st_relaxed_sys(&rep->mismatch_field, mismatch_field);
        ptx::st_relaxed_sys(&rep->mismatch_peer, lane + 1);
      }
      const u32 bad = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && lane != a.rank && problem != 0);
      if (bad != 0 && lane == __ffs(bad) - 1) {
        ptx::st_relaxed_sys(&rep->peer_problem, problem);
        ptx::st_relaxed_sys(&rep->peer_problem_peer, lane + 1);
      }
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void dispatch_recv(const LlDispatchArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  const u32 R = a.num_ranks, EL = a.num_local_experts, TM = a.max_tokens;
  const u32 rows = R * TM;
  const u8* region = reinterpret_cast<const u8*>(a.recv[a.rank]);
  // Placement: the slot of (source p, token t) in expert el's rows is the tokens of el from the used
  // sources before p (bases, from the counts each source's block 0 wrote) plus t's rank among p's tokens of
  // el (in its entry): rows in (source, token) order, no atomics, nothing rebuilt here (until the sixth
  // session every block rebuilt per-source token bitmaps from all received ids: 1.7-1.9 us after the flags).
  const u32 first_expert = a.rank * EL;
  u32* bases = sm.words;  // [R][EL]: first each pair's count, then its base
  dispatch_wait_sources(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_RECV_SEEN);

  if (sm.abort == 0) {
    // Expansion (below): work item = (source, token, 512-byte chunk), dealt over every warp of the grid.
    // Each item's payload chunk, entry and weight are loaded one item ahead: a warp's items were a chain
    // of L2 round trips (~3.4 items per warp at 128 tokens x 4 ranks); now the next item's loads fly during
    // this one's stores, and the first item's during the count loads.
    const u32 lane = lane_id();
    const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
    const u32 items = rows * RECV_CHUNKS;
    const u32 stride = gridDim.x * LL_WARPS;
    struct Ahead {
      u32x4 v;
      u32 entry;
      u32 w;
    };
    auto load_ahead = [&](u32 item) {
      Ahead l = {u32x4{0, 0, 0, 0}, 0xffffffffu, 0};
      const u32 c = item % RECV_CHUNKS, st = item / RECV_CHUNKS;
      const u32 p = st / TM, t = st % TM;
      if (item >= items || sm.ok[p] == 0 || t >= sm.ntok[p]) return l;
      const u8* msg = region + a.off_rows + ((u64)p * TM + t) * a.row_stride;
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      if (off < PAYLOAD_BYTES) l.v = llptx::ld_cg_v4(msg + off);
      if (lane < LL_TOPK) {
        const u64 at = (((u64)p * TM + t) * LL_TOPK + lane) * 4;
        l.entry = llptx::ld_cg_u32(region + a.off_entries + at);
        if (c == 0 && has_weights) l.w = llptx::ld_cg_u32(region + a.off_weights + at);
      }
      return l;
    };
    Ahead next = load_ahead(blockIdx.x * LL_WARPS + warp_id());

    for (u32 pe = threadIdx.x; pe < R * EL; pe += LL_THREADS)
      bases[pe] = sm.ok[pe / EL] != 0 ? llptx::ld_cg_u32(region + a.off_counts + (u64)pe * 4) : 0u;
    __syncthreads();
    // Each expert's exclusive scan over sources.
    for (u32 e = threadIdx.x; e < EL; e += LL_THREADS) {
      u32 run = 0;
      for (u32 p = 0; p < R; p++) {
        const u32 n = bases[p * EL + e];
        bases[p * EL + e] = run;
        run += n;
      }
      if (blockIdx.x == 0) {
        reinterpret_cast<i32*>(a.recv_count)[e] = (i32)run;
        if (a.cum_stats != 0) reinterpret_cast<i32*>(a.cum_stats)[e] += (i32)run;
      }
    }
    if (blockIdx.x == 0 && threadIdx.x < R) {
      reinterpret_cast<u32*>(a.hmeta)[2 * threadIdx.x] = sm.ntok[threadIdx.x];
      reinterpret_cast<u32*>(a.hmeta)[2 * threadIdx.x + 1] = sm.ok[threadIdx.x];
    }
    __syncthreads();
    ll_trace(sm, LL_TRACE_RECV_INDEXED);

    for (u32 item = blockIdx.x * LL_WARPS + warp_id(); item < items; item += stride) {
      const Ahead cur = next;
      next = load_ahead(item + stride);
      const u32 c = item % RECV_CHUNKS, st = item / RECV_CHUNKS;
      const u32 p = st / TM, t = st % TM;
      if (sm.ok[p] == 0 || t >= sm.ntok[p]) continue;
      const u8* msg = region + a.off_rows + ((u64)p * TM + t) * a.row_stride;
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      const bool active = off < PAYLOAD_BYTES;
      const u32x4 v = cur.v;
      const u64 entry_at = ((u64)p * TM + t) * LL_TOPK + lane;
      i32 row = -1;
      if (lane < LL_TOPK) {
        const u32 el = (cur.entry >> 16) - first_expert;  // other ranks' experts wrap past EL
        if (cur.entry != 0xffffffffu && el < EL) {
          const u32 slot = bases[p * EL + el] + (cur.entry & 0xffffu);
          if (slot < rows) row = (i32)(el * rows + slot);
        }
        if (c == 0) {
          reinterpret_cast<i32*>(a.hrow)[entry_at] = row;
          if (has_weights) reinterpret_cast<u32*>(a.hweight)[entry_at] = cur.w;
        }
      }
      const u32 valid = __ballot_sync(FULL_WARP_MASK, row >= 0);
      if (valid == 0) continue;
      u8* recv_x = reinterpret_cast<u8*>(a.recv_x);
      for (u32 m = valid; m != 0; m &= m - 1) {
        const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
        if (active) ptx::st_na_v4(reinterpret_cast<u32x4*>(recv_x + (u64)r * PAYLOAD_BYTES + off), v);
      }
#if LL_FP8
      // Scales (column-major [E_local][cols][rows]) with the chunk-0 item of the row.
      if (c == 0) {
        if ((a.flags & LL_FLAG_UE8M0) == 0) {
          u32 s[SCALE_ITERS];
#pragma unroll
          for (u32 i = 0; i < SCALE_ITERS; i++) {
            const u32 g = lane + i * WARP_SIZE;
            s[i] = g < SCALE_GROUPS ? llptx::ld_cg_u32(msg + LL_HIDDEN + 4 * g) : 0u;
          }
          for (u32 m = valid; m != 0; m &= m - 1) {
            const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
            u32* col0 = reinterpret_cast<u32*>(a.recv_scales) + (u64)(r / rows) * SCALE_GROUPS * rows + r % rows;
#pragma unroll
            for (u32 i = 0; i < SCALE_ITERS; i++) {
              const u32 g = lane + i * WARP_SIZE;
              if (g < SCALE_GROUPS) col0[(u64)g * rows] = s[i];
            }
          }
        } else {
          u32 s[UE8M0_ITERS];
#pragma unroll
          for (u32 i = 0; i < UE8M0_ITERS; i++) {
            const u32 j = lane + i * WARP_SIZE;
            s[i] = 0;
            if (j < UE8M0_WORDS) {
              const u32x4 f = llptx::ld_cg_v4(msg + LL_HIDDEN + 16 * j);
              s[i] = ((f.x >> 23) & 0xffu) | (((f.y >> 23) & 0xffu) << 8) | (((f.z >> 23) & 0xffu) << 16) | (((f.w >> 23) & 0xffu) << 24);
            }
          }
          for (u32 m = valid; m != 0; m &= m - 1) {
            const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row, __ffs(m) - 1);
            u32* col0 = reinterpret_cast<u32*>(a.recv_scales) + (u64)(r / rows) * UE8M0_WORDS * rows + r % rows;
#pragma unroll
            for (u32 i = 0; i < UE8M0_ITERS; i++) {
              const u32 j = lane + i * WARP_SIZE;
              if (j < UE8M0_WORDS) col0[(u64)j * rows] = s[i];
            }
          }
        }
      }
#endif
    }
  }

  ll_recv_end(a, sm, epoch);
}

// ll_dispatch: low-latency dispatch, send and/or receive phase.
//   grid: G blocks (one per SM; cooperative when both phases run in one launch), block: LL_THREADS.
//   SEND  roles: every block first waits (warp 0) until the destinations consumed this set's previous use;
//         block 0 = checks (dispatch_check: top-k validation, handle copies, counts and metadata lines);
//         blocks 1..G-1 (block 0 too when G == 1) = rows: work item (token, 512-byte chunk) per warp, FP8
//         quantisation in registers, 16-byte stores into every destination rank's slot [me][token]; chunk 0
//         then stores the token's entries (expert id, rank counted over the earlier rows) and weights into
//         every rank (dispatch_routing).
//         Every block then arrives at every rank (ll_send_arrive); the last one stores dispatch_epoch =
//         last_write[set] = e.
//   RECV  warp 0 of every block waits for every source's arrivals (deadline) and checks its metadata; every
//         block scans the received counts into bases per (source, local expert) in shared memory; work item
//         (source, token, chunk) per warp:
//         one 16-byte load, one store per selected local expert into recv_x[e][slot] (slots in (source,
//         token) order: base + the token's rank among the source's tokens of e), scales column-major,
//         handle rows/weights; block 0: recv_count, cumulative stats, wait stats, handle metadata, report.
//         Last block: consumed flags to every source.
//   DRAIN a receive phase that will never run (its hook was dropped): only the consumed flags.
//   reads:  x, topk_idx, topk_weights; own receive region of the set; own LlCtrl.
//   writes: every rank's receive region of the set (send) and LlCtrl flags/metadata; recv_x, recv_scales,
//           recv_count, stats, handle area (recv); LlReport; error record on timeout.
extern "C" __global__ void __launch_bounds__(LL_THREADS, 1) ll_dispatch(const __grid_constant__ LlDispatchArgs a) {
  __shared__ LlShared sm;
  const u64 entered = ptx::globaltimer();
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_LL_DISPATCH);
  if (!ll_enter(a, sm, entered)) return;
  const u32 epoch = sm.epoch;
  if (a.phases & LL_PHASE_SEND) dispatch_send(a, d, sm, epoch);
  if (a.phases & LL_PHASE_RECV) dispatch_recv(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_END);
}

// ============================================================================================ combine
// Block 0 of the send phase: checks this rank's combine inputs against its dispatch (handle area) and
// writes the metadata line (problems, whether this rank received the home rank's dispatch) to every rank.
__device__ __forceinline__ void combine_check(const LlCombineArgs& a, LlShared& sm) {
  const u32 T = a.num_tokens;
  if (threadIdx.x == 0) sm.problem = a.host_problem;
  __syncthreads();
  if ((a.host_problem & LL_PROBLEM_HANDLE) == 0) {
    const bool has_weights = (a.flags & LL_FLAG_WEIGHTS) != 0;
    u32 problem = 0;
    for (u32 i = threadIdx.x; i < T * LL_TOPK; i += LL_THREADS) {
      if (llptx::ld_nc_u64(reinterpret_cast<const i64*>(a.topk_idx) + i) != llptx::ld_nc_u64(reinterpret_cast<const i64*>(a.home_idx) + i))
        problem |= LL_PROBLEM_TOPK_IDX_DIFFERS;
      if (has_weights &&
          llptx::ld_nc_u32(reinterpret_cast<const u32*>(a.topk_weights) + i) != llptx::ld_nc_u32(reinterpret_cast<const u32*>(a.home_weight) + i))
        problem |= LL_PROBLEM_WEIGHTS_DIFFER;
    }
    if (problem != 0) atomicOr(&sm.problem, problem);
  }
  __syncthreads();
  const u32 problem_all = sm.problem;
  if (threadIdx.x < a.num_ranks) {
    LlMeta* m = &ctrl_of(a.ctrl, threadIdx.x)->combine_meta[a.set][a.rank];
    llptx::st_na_u32(&m->num_tokens, T);
    llptx::st_na_u32(&m->problem, problem_all);
    llptx::st_na_u32(&m->accepted, reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x + 1]);
  }
  if (threadIdx.x == 0 && problem_all != 0) ptx::st_relaxed_sys(&reinterpret_cast<LlReport*>(a.report)->own_problem, problem_all);
}

// Rows back: work item = (token, home rank, 512-byte chunk = 256 channels). Pre-reduced mode: one bf16
// partial per (home, token): sum over this rank's selections of the token in ascending k, from +0.0, of
// f32(w) * f32(y) rounded to f32 before each add, into slot [me][token] of the home's region. Per-expert
// mode: each selection's row y into slot [token][k].
// A warp takes items first_warp + i * num_warps, COMBINE_ITEMS of them per round with every expert-row load
// of the round in flight together: an item has only ~K/R rows here, so one item per round left each warp a
// chain of dependent HBM round trips (~7 items per warp at 128 tokens, the combine send's largest cost;
// with two items per round the send still took ~11 us without NVLink, run 2's local_stores experiment).
// Returns whether this warp stored anything.
constexpr u32 COMBINE_ITEMS = 3;
// Expert rows loaded per item and batch (pre-reduced): with top-8 over 4 ranks an item has ~2.2 of them.
constexpr u32 COMBINE_ROWS = LL_TOPK < 4 ? LL_TOPK : 4;
__device__ __forceinline__ bool combine_rows(const LlCombineArgs& a, LlShared& sm, u32 first_warp, u32 num_warps) {
  const u32 lane = lane_id();
  const u32 R = a.num_ranks, TM = a.max_tokens;
  const bool pre_reduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* y = reinterpret_cast<const u8*>(a.y);
  const u32 items = R * TM * BF16_CHUNKS;
  bool stored = false;
  const bool local_stores = (a.flags & LL_FLAG_EXP_LOCAL_STORES) != 0;
  const bool loads = (a.flags & LL_FLAG_EXP_NO_LOADS) == 0;
  // Rows in (token, home) order, homes starting after this rank (first_dest): consecutive items, and so
  // every wave of stores, spread over all homes instead of filling one home's region after the other.
  const u32 dest0 = first_dest(a.rank, R);
  auto home_of = [&](u32 st) {
    const u32 h = st % R + dest0;
    return h >= R ? h - R : h;
  };
  // The handle entries (row, weight) of an item are loaded one round ahead: the expert rows' loads depend on
  // them, so loading them at the top of each item put two dependent round trips on every item's path.
  auto load_entry = [&](u32 it, i32& row, float& w) {
    row = -1;
    w = 0.0f;
    const u32 st = it / BF16_CHUNKS, h = home_of(st), t = st / R;
    if (it < items && lane < LL_TOPK && t < sm.ntok[h]) {
      const u64 at = ((u64)h * TM + t) * LL_TOPK + lane;
      row = (i32)llptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hrow) + at);
      if (pre_reduced) w = bits_f32(llptx::ld_nc_u32(reinterpret_cast<const u32*>(a.hweight) + at));
    }
  };
  i32 row_ahead[COMBINE_ITEMS];
  float w_ahead[COMBINE_ITEMS];
#pragma unroll
  for (u32 j = 0; j < COMBINE_ITEMS; j++) load_entry(first_warp + j * num_warps, row_ahead[j], w_ahead[j]);
  for (u32 base = first_warp; base < items; base += COMBINE_ITEMS * num_warps) {
    i32 row[COMBINE_ITEMS];
    float w[COMBINE_ITEMS];
    u32 valid[COMBINE_ITEMS];
    u32 off[COMBINE_ITEMS];
    u8* dst[COMBINE_ITEMS];
#pragma unroll
    for (u32 j = 0; j < COMBINE_ITEMS; j++) {
      row[j] = row_ahead[j];
      w[j] = w_ahead[j];
      load_entry(base + (COMBINE_ITEMS + j) * num_warps, row_ahead[j], w_ahead[j]);
      // load_entry gives row -1 to items past the end and to tokens the home did not send: valid == 0.
      const u32 item = base + j * num_warps;
      const u32 c = item % BF16_CHUNKS, st = item / BF16_CHUNKS;
      const u32 h = home_of(st), t = st / R;
      valid[j] = __ballot_sync(FULL_WARP_MASK, row[j] >= 0);
      off[j] = c * CHUNK_BYTES + lane * VEC_BYTES;
      u8* region = item < items ? reinterpret_cast<u8*>(a.recv[local_stores ? a.rank : h]) : nullptr;
      // local_stores: the own region's slot [h][token] (distinct per home, like the real stores).
      dst[j] = region == nullptr ? nullptr
                                 : region + (pre_reduced ? ((u64)(local_stores ? h : a.rank) * TM + t) * ROW_BYTES_BF16
                                                         : (u64)t * LL_TOPK * ROW_BYTES_BF16);
      if (valid[j] != 0) stored = true;
    }
    if (pre_reduced) {
      float acc[COMBINE_ITEMS][8];
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++)
#pragma unroll
        for (u32 i = 0; i < 8; i++) acc[j][i] = 0.0f;
      // The selected rows of each item, compacted (the q-th row is the q-th set bit of valid, ascending k):
      // ~K/R of them per item, so one batch of COMBINE_ROWS loads covers nearly every item and the registers
      // go to more items in flight rather than to empty slots of K.
      u32 most = 0;
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) most = (u32)__popc(valid[j]) > most ? (u32)__popc(valid[j]) : most;
      for (u32 qb = 0; qb < most; qb += COMBINE_ROWS) {
        u32x4 v[COMBINE_ITEMS][COMBINE_ROWS];
        u32 kq[COMBINE_ITEMS][COMBINE_ROWS];  // k of each loaded row, WARP_SIZE when none
#pragma unroll
        for (u32 j = 0; j < COMBINE_ITEMS; j++) {
          u32 m = valid[j];
          for (u32 i = 0; i < qb && m != 0; i++) m &= m - 1;
#pragma unroll
          for (u32 q = 0; q < COMBINE_ROWS; q++) {
            v[j][q] = u32x4{0, 0, 0, 0};
            kq[j][q] = WARP_SIZE;
            if (m != 0) {
              const u32 k = __ffs(m) - 1;
              m &= m - 1;
              kq[j][q] = k;
              const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row[j], k);
              if (off[j] < ROW_BYTES_BF16 && loads) v[j][q] = ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)r * ROW_BYTES_BF16 + off[j]));
            }
          }
        }
#pragma unroll
        for (u32 j = 0; j < COMBINE_ITEMS; j++) {
#pragma unroll
          for (u32 q = 0; q < COMBINE_ROWS; q++) {
            if (kq[j][q] < WARP_SIZE) {
              const float wk = __shfl_sync(FULL_WARP_MASK, w[j], kq[j][q]);
#pragma unroll
              for (u32 i = 0; i < 4; i++) {
                const u32 word = word_of(v[j][q], i);
                acc[j][2 * i] = llptx::add_rn(acc[j][2 * i], llptx::mul_rn(wk, bf16_lo(word)));
                acc[j][2 * i + 1] = llptx::add_rn(acc[j][2 * i + 1], llptx::mul_rn(wk, bf16_hi(word)));
              }
            }
          }
        }
      }
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) {
        if (valid[j] == 0 || off[j] >= ROW_BYTES_BF16) continue;
        const u32x4 out = {ptx::cvt_rn_bf16x2_f32(acc[j][1], acc[j][0]), ptx::cvt_rn_bf16x2_f32(acc[j][3], acc[j][2]),
                           ptx::cvt_rn_bf16x2_f32(acc[j][5], acc[j][4]), ptx::cvt_rn_bf16x2_f32(acc[j][7], acc[j][6])};
        ptx::st_na_v4(reinterpret_cast<u32x4*>(dst[j] + off[j]), out);
      }
    } else {
#pragma unroll
      for (u32 j = 0; j < COMBINE_ITEMS; j++) {
        for (u32 m = valid[j]; m != 0; m &= m - 1) {
          const u32 k = __ffs(m) - 1;
          const u32 r = (u32)__shfl_sync(FULL_WARP_MASK, row[j], k);
          if (off[j] < ROW_BYTES_BF16) {
            const u32x4 v = loads ? ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(y + (u64)r * ROW_BYTES_BF16 + off[j])) : u32x4{0, 0, 0, 0};
            ptx::st_na_v4(reinterpret_cast<u32x4*>(dst[j] + (u64)k * ROW_BYTES_BF16 + off[j]), v);
          }
        }
      }
    }
  }
  return stored;
}

__device__ __forceinline__ void combine_send(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  // Tokens per home rank, from this rank's own dispatch handle: loaded before the hand-back wait (whose
  // barriers publish them to the block), so that their latency hides behind it.
  if (threadIdx.x < a.num_ranks) sm.ntok[threadIdx.x] = reinterpret_cast<const u32*>(a.hmeta)[2 * threadIdx.x];
  ll_send_phase(a, d, sm, epoch, [&] { combine_check(a, sm); },
                [&](u32 first_warp, u32 num_warps) { return combine_rows(a, sm, first_warp, num_warps); });
}

// Warp 0 of every block waits for every expert rank r (lane r); r's rows are used when its flag arrived
// (shrink: decided so), r is not masked, r reported no problem and r received this rank's dispatch.
__device__ __forceinline__ void combine_wait_sources(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  LlCtrl* me = ctrl_of(a.ctrl, a.rank);
  const bool soft = (a.flags & LL_FLAG_SHRINK) != 0;
  const u32 lane = lane_id();
  if (threadIdx.x == 0) sm.abort = 0;
  __syncthreads();
  if (warp_id() == 0) {
    u32 problem = 0;
    u64 waited = 0;
    if (lane < a.num_ranks) {
      const SourceState s =
          ll_wait_source(me->combine_arrive[a.set][lane], epoch, epoch * LL_ARRIVE_UNIT, me->mask, me->decision[LL_KIND_COMBINE], lane, d, soft, sm);
      waited = s.waited_ns;
      bool used = false;
      if (s.used) {
        const LlMeta* m = &me->combine_meta[a.set][lane];
        problem = llptx::ld_cg_u32(&m->problem);
        used = problem == 0 && llptx::ld_cg_u32(&m->accepted) != 0;
      }
      sm.ok[lane] = used ? 1u : 0u;
    }
    if (blockIdx.x == 0) {
      if (lane < a.num_ranks && a.wait_stats != 0) reinterpret_cast<i64*>(a.wait_stats)[lane] += (i64)waited;
      const u32 bad = __ballot_sync(FULL_WARP_MASK, lane < a.num_ranks && lane != a.rank && problem != 0);
      if (bad != 0 && lane == __ffs(bad) - 1) {
        LlReport* rep = reinterpret_cast<LlReport*>(a.report);
        ptx::st_relaxed_sys(&rep->peer_problem, problem);
        ptx::st_relaxed_sys(&rep->peer_problem_peer, lane + 1);
      }
    }
  }
  __syncthreads();
}

__device__ __forceinline__ void combine_recv(const LlCombineArgs& a, const Deadline& d, LlShared& sm, u32 epoch) {
  const u32 R = a.num_ranks, TM = a.max_tokens, E = a.num_experts, EL = a.num_local_experts;
  const u32 lane = lane_id();
  const bool pre_reduced = (a.flags & LL_FLAG_WEIGHTS) != 0;
  const u8* region = reinterpret_cast<const u8*>(a.recv[a.rank]);
  const i64* idx = reinterpret_cast<const i64*>(a.topk_idx);
  const u32 items = a.num_tokens * BF16_CHUNKS;
  const u32 stride = gridDim.x * LL_WARPS;
  // The top-k ids (and weights) of an item are loaded one item ahead: the partials' loads depend on them,
  // two dependent round trips per item otherwise. They are this rank's own inputs, so the first item's are
  // loaded before the flag wait, whose latency they then share.
  auto load_ids = [&](u32 item, i64& e, u32& wbits) {
    e = -1;
    wbits = 0;
    const u32 t = item / BF16_CHUNKS;
    if (item < items && lane < LL_TOPK) {
      e = (i64)llptx::ld_nc_u64(idx + (u64)t * LL_TOPK + lane);
      if (!pre_reduced) wbits = llptx::ld_nc_u32(reinterpret_cast<const u32*>(a.topk_weights) + (u64)t * LL_TOPK + lane);
    }
  };
  i64 e_next;
  u32 w_next;
  load_ids(blockIdx.x * LL_WARPS + warp_id(), e_next, w_next);
  combine_wait_sources(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_RECV_SEEN);
  if (sm.abort == 0) {
    for (u32 item = blockIdx.x * LL_WARPS + warp_id(); item < items; item += stride) {
      const u32 t = item / BF16_CHUNKS, c = item % BF16_CHUNKS;
      const i64 e = e_next;
      const u32 wbits = w_next;
      load_ids(item + stride, e_next, w_next);
      bool use = false;
      u32 r = 0;
      float w = 0.0f;
      if (lane < LL_TOPK) {
        if (e >= 0 && e < (i64)E) {
          r = (u32)e / EL;
          use = sm.ok[r] != 0;
        }
        w = bits_f32(wbits);
      }
      const u32 off = c * CHUNK_BYTES + lane * VEC_BYTES;
      const bool active = off < ROW_BYTES_BF16;
      float acc[8];
#pragma unroll
      for (u32 j = 0; j < 8; j++) acc[j] = 0.0f;
      if (pre_reduced) {
        // Partials of the ranks the token was sent to, in ascending rank order.
        const u32 hit = __reduce_or_sync(FULL_WARP_MASK, use ? 1u << r : 0u);
        u32x4 v[MAX_RANKS];
#pragma unroll
        for (u32 q = 0; q < MAX_RANKS; q++) {
          v[q] = u32x4{0, 0, 0, 0};
          if (((hit >> q) & 1u) && active) v[q] = llptx::ld_cg_v4(region + ((u64)q * TM + t) * ROW_BYTES_BF16 + off);
        }
#pragma unroll
        for (u32 q = 0; q < MAX_RANKS; q++) {
          if ((hit >> q) & 1u) {
#pragma unroll
            for (u32 i = 0; i < 4; i++) {
              const u32 word = word_of(v[q], i);
              acc[2 * i] = llptx::add_rn(acc[2 * i], bf16_lo(word));
              acc[2 * i + 1] = llptx::add_rn(acc[2 * i + 1], bf16_hi(word));
            }
          }
        }
      } else {
        // One row per selection, in ascending k, weighted with the combine-time weights.
        const u32 sel = __ballot_sync(FULL_WARP_MASK, use);
#pragma unroll
        for (u32 kb = 0; kb < LL_TOPK; kb += K_BATCH) {
          u32x4 v[K_BATCH];
#pragma unroll
          for (u32 j = 0; j < K_BATCH; j++) {
            const u32 k = kb + j;
            v[j] = u32x4{0, 0, 0, 0};
            if (k < LL_TOPK && ((sel >> k) & 1u) && active) v[j] = llptx::ld_cg_v4(region + ((u64)t * LL_TOPK + k) * ROW_BYTES_BF16 + off);
          }
#pragma unroll
          for (u32 j = 0; j < K_BATCH; j++) {
            const u32 k = kb + j;
            if (k < LL_TOPK && ((sel >> k) & 1u)) {
              const float wk = __shfl_sync(FULL_WARP_MASK, w, k);
#pragma unroll
              for (u32 i = 0; i < 4; i++) {
                const u32 word = word_of(v[j], i);
                acc[2 * i] = llptx::add_rn(acc[2 * i], llptx::mul_rn(wk, bf16_lo(word)));
                acc[2 * i + 1] = llptx::add_rn(acc[2 * i + 1], llptx::mul_rn(wk, bf16_hi(word)));
              }
            }
          }
        }
      }
      if (active) {
        const u32x4 o = {ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]), ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]), ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]),
                         ptx::cvt_rn_bf16x2_f32(acc[7], acc[6])};
        ptx::st_na_v4(reinterpret_cast<u32x4*>(reinterpret_cast<u8*>(a.out) + (u64)t * ROW_BYTES_BF16 + off), o);
      }
    }
  }
  ll_recv_end(a, sm, epoch);
}

// ll_combine: low-latency combine, send and/or receive phase.
//   grid: G blocks (cooperative when both phases run in one launch), block: LL_THREADS.
//   SEND  every block waits (warp 0) until the home ranks consumed this set's previous use; block 0 checks
//         the combine-time topk_idx/weights against the dispatch's and writes the metadata lines; blocks
//         1..G-1 (block 0 too when G == 1): work item (home rank, token, 256-channel chunk) per warp, rows
//         from the handle area, loads of the expert outputs y (16 bytes per lane), pre-reduced sum or
//         per-expert copies, 16-byte stores into the home rank's combine region. Every block arrives at
//         every rank (ll_send_arrive); the last one stores combine_epoch = last_write[set] = e.
//   RECV  warp 0 of every block waits for every expert rank; work item (token, chunk) per warp: sum of the
//         partials in ascending rank order (pre-reduced) or of w * y in ascending k (per expert), from +0.0
//         in f32, one bf16 rounding, 16-byte store into out. Block 0: wait stats, report. Last block:
//         consumed flags to every expert rank.
//   DRAIN consumed flags only (a dropped hook).
//   reads:  y, topk_idx, topk_weights, handle area; own combine region; own LlCtrl.
//   writes: every home rank's combine region and LlCtrl flags/metadata (send); out, stats, LlReport (recv).
extern "C" __global__ void __launch_bounds__(LL_THREADS, 1) ll_combine(const __grid_constant__ LlCombineArgs a) {
  __shared__ LlShared sm;
  const u64 entered = ptx::globaltimer();
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, PHASE_LL_COMBINE);
  if (!ll_enter(a, sm, entered)) return;
  const u32 epoch = sm.epoch;
  if (a.phases & LL_PHASE_SEND) combine_send(a, d, sm, epoch);
  if (a.phases & LL_PHASE_RECV) combine_recv(a, d, sm, epoch);
  ll_trace(sm, LL_TRACE_END);
}
