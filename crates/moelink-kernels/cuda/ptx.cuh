// moelink PTX primitives.
//
// Header-free by design: NVRTC <= 13.2 bundles no CUDA headers, so everything the kernels need is defined
// here with inline PTX. Each function is named after the instruction it emits (`ld_acquire_sys` emits
// `ld.acquire.sys.global.u32`). Besides the instructions this header holds the kernel/host ABI of error
// records and the deadline wait every spin loop must use: no kernel spins without a deadline, and no kernel
// ever executes `trap` — on expiry it writes an error record for the host and returns.
//
// Constants shared with Rust live in `moelink_kernels::abi`; a Rust test parses this file and checks that
// both sides agree.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// 16 bytes, the unit of vectorised global memory access.
struct alignas(16) u32x4 {
  u32 x, y, z, w;
};

constexpr u32 WARP_SIZE = 32;
constexpr u32 FULL_WARP_MASK = 0xffffffffu;

// ============================================================================================ ABI
// Error codes written into ErrorRecord::code (0 = no error).
constexpr u32 ERR_NONE = 0;
constexpr u32 ERR_TIMEOUT = 1;
// Argument errors found on the device (reported with report_error: the kernels keep the protocol going, so
// the buffer stays usable once the host has read and cleared the record). ErrorRecord::elapsed_ns and
// ::timeout_ns carry two code-specific details instead of times (moelink_kernels::abi documents them).
constexpr u32 ERR_INVALID_TOPK = 2;      // topk_idx entry outside [-1, E) or repeated in its row
constexpr u32 ERR_INVALID_LAYOUT = 3;    // the layout tensors disagree; detail0: which one (LAYOUT_ARG_*)
constexpr u32 ERR_RANK_MISMATCH = 4;     // ranks called with different shapes / dtypes / expert counts
constexpr u32 ERR_BUFFER_TOO_SMALL = 5;  // a receive slab of num_nvl_bytes cannot hold the call
constexpr u32 ERR_RECV_OVERFLOW = 6;     // no-sync dispatch received more rows than num_worst_tokens
// Fatal like a timeout (raise_error): a peer's message has another layout than this rank's kernel reads, so
// the ranks launched different kernel variants and nothing received can be trusted.
constexpr u32 ERR_PEER_LAYOUT = 7;
// ERR_INVALID_LAYOUT's detail0: the argument that disagrees (detail1: the token, for LAYOUT_ARG_IN_RANK; the
// expert << 32 | the tokens selecting it, for LAYOUT_ARG_EXPERT_TOKENS and _RECV_EXPERT_TOKENS).
constexpr u32 LAYOUT_ARG_PER_RANK = 0;       // num_tokens_per_rank vs the tokens is_token_in_rank sends
constexpr u32 LAYOUT_ARG_PER_EXPERT = 1;     // num_tokens_per_expert vs num_tokens_per_rank
constexpr u32 LAYOUT_ARG_IN_RANK = 2;        // is_token_in_rank vs the ranks of the token's topk_idx experts
constexpr u32 LAYOUT_ARG_EXPERT_TOKENS = 3;  // num_tokens_per_expert[e] vs the tokens whose topk_idx selects e
constexpr u32 LAYOUT_ARG_RECV_EXPERT_TOKENS = 4;  // the sources' counts for local expert e vs the rows that arrived

// Values of the claim word (ErrorSink::claim): nothing recorded, a fatal error (waits give up), or an
// argument error (waits carry on; a later fatal error still takes the record over).
constexpr u32 CLAIM_NONE = 0;
constexpr u32 CLAIM_FATAL = 1;
constexpr u32 CLAIM_ARGUMENT = 2;

// Phases written into ErrorRecord::phase; the host maps them to moelink::Phase.
constexpr u32 PHASE_BARRIER = 1;
constexpr u32 PHASE_COPY = 2;
constexpr u32 PHASE_LAYOUT = 3;
constexpr u32 PHASE_NOTIFY = 4;
constexpr u32 PHASE_DISPATCH = 5;
constexpr u32 PHASE_COMBINE = 6;
constexpr u32 PHASE_LL_DISPATCH = 7;
constexpr u32 PHASE_LL_COMBINE = 8;
constexpr u32 PHASE_TRANSPORT = 9;
constexpr u32 PHASE_OTHER = 15;

// ErrorRecord::peer when no single peer is to blame.
constexpr u32 NO_PEER = 0xffffffffu;

// How many spins between two deadline checks (a %globaltimer read and a look at the error claim word).
constexpr u32 DEADLINE_POLL_SPINS = 256;

// The first failure of a rank, in page-locked host memory mapped into the device. Written once per rank:
// fields first, `code` last with release semantics, so a host that sees code != 0 sees the whole record.
struct ErrorRecord {
  u32 code;        // ERR_*; 0 while no error
  u32 rank;        // rank that gave up
  u32 peer;        // rank it was waiting for, or NO_PEER
  u32 phase;       // PHASE_*
  u64 elapsed_ns;  // how long it waited
  u64 timeout_ns;  // the deadline it had
};
static_assert(sizeof(ErrorRecord) == 32, "ErrorRecord is 32 bytes (moelink_kernels::abi::ErrorRecord)");

// Where a kernel reports: `claim` is a device-memory word (atomicCAS 0 -> 1 by the first failing thread of
// the rank; atomics on host memory over PCIe are not guaranteed), `record` is the host-mapped record.
struct ErrorSink {
  u32* claim;
  ErrorRecord* record;
};

namespace ptx {

// ============================================================================================ flags, atomics
// Scope .sys: ordered with respect to other GPUs (NVLink peers) and the host.

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u32 ld_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u32 ld_relaxed_gpu(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u64(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_gpu(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(u32* p, u32 v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// No return value, so the issuing thread does not wait for the (NVLink) round trip.
__device__ __forceinline__ void red_add_relaxed_sys(u32* p, u32 v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_gpu(u32* p, u32 v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_gpu_u64(u64* p, u64 v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_min_relaxed_gpu_u64(u64* p, u64 v) {
  asm volatile("red.relaxed.gpu.global.min.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// 64-bit signal words (the RDMA transport seam, transport.cuh).
__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u64 ld_relaxed_sys_u64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_add_relaxed_sys_u64(u64* p, u64 v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// GPU scope: between blocks of one GPU (the emulated NIC's queues).
__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(u32* p, u32 v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_gpu(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// No ordering: for counters that hand out work, where an acq_rel atomic would first wait until every prior
// store of the thread (NVLink stores included) is performed.
__device__ __forceinline__ u32 atom_add_relaxed_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ u32 atom_cas_acq_rel_gpu(u32* p, u32 expected, u32 desired) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory");
  return old;
}

__device__ __forceinline__ u64 atom_cas_relaxed_gpu_u64(u64* p, u64 expected, u64 desired) {
  u64 old;
  asm volatile("atom.relaxed.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expected), "l"(desired) : "memory");
  return old;
}

// A release/acquire fence at system scope (MEMBAR.ALL.SYS). Release pattern: one fence, then relaxed stores
// to any number of flags. (st.release / red.release each pay such a fence; ld.acquire does not.)
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Scope .cta, generic addresses (shared memory): hand-offs between the warps of one block.
__device__ __forceinline__ u32 ld_acquire_cta(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_cta(u32* p, u32 v) { asm volatile("st.release.cta.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory"); }

// ============================================================================================ 16-byte accesses

// Streamed read: non-coherent path, no L1 allocation, 256-byte L2 prefetch. Only for data no kernel writes
// while this one runs.
__device__ __forceinline__ u32x4 ld_nc_na_v4(const u32x4* p) {
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Weak read without L1 allocation: for data other GPUs write while this kernel runs, read once after an
// acquire (the .nc path may serve stale lines there).
__device__ __forceinline__ u32x4 ld_na_v4(const u32x4* p) {
  u32x4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ u32x4 ld_v4(const u32x4* p) {
  u32x4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Streamed write (local or peer memory): no L1 allocation.
__device__ __forceinline__ void st_na_v4(u32x4* p, const u32x4& v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_v4(u32x4* p, const u32x4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// ============================================================================================ scalar and L2-only accesses

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

// Non-coherent (read-only path) loads: only for data no kernel writes while this one runs.
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

// Starts bringing `bytes` (a multiple of 16, at a 16-byte aligned address) into L2 with one bulk request
// (the TMA unit walks it; the issuing thread does not wait): rows a warp will read one after another then
// come from L2 instead of DRAM.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// ============================================================================================ time

// Nanoseconds of the GPU's global timer (same clock on every SM).
__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ============================================================================================ shared memory, mbarrier, TMA

// 32-bit shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ u32 cvta_to_shared(const void* p) {
  u32 a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void mbarrier_init(u32 bar, u32 arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes mbarrier initialisation visible to the async (TMA) proxy.
__device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA) reads of them.
__device__ __forceinline__ void fence_proxy_async_shared_cta() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One arrival that also announces `bytes` of transactions the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait_parity(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// 1-D bulk copy global -> shared; completes `bytes` transactions on the mbarrier `bar`.
__device__ __forceinline__ void cp_async_bulk_global_to_shared(u32 smem_dst, const void* gmem_src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_dst),
               "l"(gmem_src), "r"(bytes), "r"(bar)
               : "memory");
}

// 1-D bulk copy shared -> global (local or peer memory); completion tracked by bulk groups.
__device__ __forceinline__ void cp_async_bulk_shared_to_global(void* gmem_dst, u32 smem_src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N bulk groups are incomplete (their writes performed).
template <int N>
__device__ __forceinline__ void cp_async_bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// True on exactly one lane of the (converged, full) warp.
__device__ __forceinline__ bool elect_sync() {
  u32 elected;
  asm volatile("{ .reg .pred p; .reg .b32 lane; elect.sync lane|p, %1; selp.u32 %0, 1, 0, p; }" : "=r"(elected) : "r"(FULL_WARP_MASK));
  return elected != 0;
}

// ============================================================================================ bf16 / fp8

__device__ __forceinline__ u16 cvt_rn_bf16_f32(float f) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Two floats to packed bf16: `hi` in the upper half, `lo` in the lower.
__device__ __forceinline__ u32 cvt_rn_bf16x2_f32(float hi, float lo) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// IEEE single add, round to nearest even, never contracted or reassociated (the reduction order of
// combine is part of its contract).
__device__ __forceinline__ float add_rn_f32(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// IEEE single multiply and divide, round to nearest even, never contracted into an FMA.
__device__ __forceinline__ float mul_rn_f32(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float div_rn_f32(float a, float b) {
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

__device__ __forceinline__ float f32_from_bits(u32 v) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(v));
  return f;
}

__device__ __forceinline__ u32 bits_from_f32(float f) {
  u32 v;
  asm("mov.b32 %0, %1;" : "=r"(v) : "f"(f));
  return v;
}

__device__ __forceinline__ float cvt_f32_bf16(u16 h) {
  float f;
  asm("cvt.f32.bf16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Two floats to packed e4m3 (saturating to +-448): `hi` in the upper byte, `lo` in the lower.
__device__ __forceinline__ u16 cvt_rn_satfinite_e4m3x2_f32(float hi, float lo) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Packed e4m3 pair to packed f16 pair (exact).
__device__ __forceinline__ u32 cvt_rn_f16x2_e4m3x2(u16 v) {
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}

__device__ __forceinline__ float cvt_f32_f16(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Packed e4m3 pair to two floats (exact): lower byte -> lo, upper byte -> hi.
__device__ __forceinline__ void e4m3x2_to_f32x2(u16 v, float& lo, float& hi) {
  const u32 h2 = cvt_rn_f16x2_e4m3x2(v);
  lo = cvt_f32_f16((u16)(h2 & 0xffffu));
  hi = cvt_f32_f16((u16)(h2 >> 16));
}

}  // namespace ptx

// ============================================================================================ deadlines

// What a waiting thread needs to give up properly: its budget per wait and where to report.
struct Deadline {
  u64 timeout_ns;
  ErrorSink sink;
  u32 rank;
  u32 phase;
};

__device__ __forceinline__ Deadline make_deadline(u64 error_claim, u64 error_record, u64 timeout_ns, u32 rank, u32 phase) {
  Deadline d;
  d.timeout_ns = timeout_ns;
  d.sink.claim = reinterpret_cast<u32*>(error_claim);
  d.sink.record = reinterpret_cast<ErrorRecord*>(error_record);
  d.rank = rank;
  d.phase = phase;
  return d;
}

// Records this rank's first failure (first writer wins) and returns. Never traps. (Inlined: a call would
// give hot kernels an ABI stack frame.)
__device__ __forceinline__ void raise_error(const Deadline& d, u32 code, u32 peer, u64 elapsed_ns) {
  u32 old = ptx::atom_cas_acq_rel_gpu(d.sink.claim, CLAIM_NONE, CLAIM_FATAL);
  // A recorded argument error gives way: a fatal error is what the host must see (and the waits must stop).
  if (old == CLAIM_ARGUMENT) {
    const bool upgraded = ptx::atom_cas_acq_rel_gpu(d.sink.claim, CLAIM_ARGUMENT, CLAIM_FATAL) == CLAIM_ARGUMENT;
    old = upgraded ? CLAIM_NONE : CLAIM_FATAL;
  }
  if (old != CLAIM_NONE) return;
  ErrorRecord* r = d.sink.record;
  ptx::st_relaxed_sys(&r->rank, d.rank);
  ptx::st_relaxed_sys(&r->peer, peer);
  ptx::st_relaxed_sys(&r->phase, d.phase);
  ptx::st_relaxed_sys_u64(&r->elapsed_ns, elapsed_ns);
  ptx::st_relaxed_sys_u64(&r->timeout_ns, d.timeout_ns);
  ptx::st_release_sys(&r->code, code);  // publishes the fields above
}

// Records an argument error found on the device (first record wins; a later raise_error still takes it
// over) and returns: unlike raise_error it does not make waits give up, so the caller keeps the flag protocol
// going (treating the bad input as harmless) and every rank stays in step. `detail0`/`detail1` land in
// ErrorRecord::elapsed_ns/timeout_ns.
__device__ __forceinline__ void report_error(const Deadline& d, u32 code, u32 peer, u64 detail0, u64 detail1) {
  if (ptx::atom_cas_acq_rel_gpu(d.sink.claim, CLAIM_NONE, CLAIM_ARGUMENT) != CLAIM_NONE) return;
  ErrorRecord* r = d.sink.record;
  ptx::st_relaxed_sys(&r->rank, d.rank);
  ptx::st_relaxed_sys(&r->peer, peer);
  ptx::st_relaxed_sys(&r->phase, d.phase);
  ptx::st_relaxed_sys_u64(&r->elapsed_ns, detail0);
  ptx::st_relaxed_sys_u64(&r->timeout_ns, detail1);
  ptx::st_release_sys(&r->code, code);
}

// The dispatch kernels' per-expert checks, block-collective: adds the block's non-zero shared-memory tallies
// [0, n) to `counters` (one red.add each), then fences them before the block's arrival at its done counter,
// after which the last block reads the counters.
__device__ __forceinline__ void add_tallies(u32* counters, const u32* tally, u32 n) {
  bool added = false;
  for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
    const u32 v = tally[i];
    if (v != 0u) {
      ptx::red_add_relaxed_gpu(counters + i, v);
      added = true;
    }
  }
  if (added) ptx::fence_acq_rel_gpu();
}

// Where a dispatch kernel's per-expert counts are and what they are checked against (check_expert_counts).
struct ExpertCounts {
  u32* sent;             // [num_experts]: each expert's tokens, counted by the sender blocks
  const i32* claimed;    // num_tokens_per_expert, or null: the senders' counts are not checked
  u32* received;         // [num_local_experts]: each local expert's rows, counted by the receiver blocks
  const u32* expected;   // [1 + num_local_experts]: copy_notify_expected's copy, or null: not checked
  u32 num_experts, num_local_experts;
  u32 host_seq;          // the notify call the expected counts must come from
  u32 rank;
};

// The last block of a dispatch, after every sender and receiver block has counted (their fences and the
// blocks' done counter order the counts before this), each count zeroed for the next call:
//   - expert e's tokens against num_tokens_per_expert[e] (ERR_INVALID_LAYOUT, LAYOUT_ARG_EXPERT_TOKENS,
//     e << 32 | count): this rank's list is wrong;
//   - the rows that arrived for local expert e against what notify summed from the sources' lists, which the
//     host returns as num_recv_tokens_per_expert (LAYOUT_ARG_RECV_EXPERT_TOKENS, e << 32 | rows): some
//     rank's list is wrong, and this rank would otherwise return it.
// A grouped GEMM sized by those lists would read rows that do not exist, or miss some.
__device__ __forceinline__ void check_expert_counts(const ExpertCounts& c, const Deadline& d) {
  if (c.claimed != nullptr) {
    for (u32 e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
      const u32 counted = ptx::ld_relaxed_gpu(c.sent + e);
      c.sent[e] = 0u;
      if ((i64)c.claimed[e] != (i64)counted) report_error(d, ERR_INVALID_LAYOUT, c.rank, LAYOUT_ARG_EXPERT_TOKENS, ((u64)e << 32) | counted);
    }
  }
  if (c.expected != nullptr) {
    const bool ours = c.expected[0] == c.host_seq;  // else a later notify has rewritten the host words
    for (u32 e = threadIdx.x; e < c.num_local_experts; e += blockDim.x) {
      const u32 counted = ptx::ld_relaxed_gpu(c.received + e);
      c.received[e] = 0u;
      if (ours && c.expected[1 + e] != counted)
        report_error(d, ERR_INVALID_LAYOUT, c.rank, LAYOUT_ARG_RECV_EXPERT_TOKENS, ((u64)e << 32) | counted);
    }
  }
}

// Receiver warp 0 of a dispatch, first: notify's host-mapped READY word (`host[ready]`) and per-expert sums
// (`host[per_expert + e]`) into `expected`, so that check_expert_counts at the end of the kernel reads device
// memory, not the host's over PCIe (the copy overlaps the wait for the first rows; the warp's block arrives
// at the done counter after it).
__device__ __forceinline__ void copy_notify_expected(u32* expected, const volatile u32* host, u32 ready, u32 per_expert,
                                                     u32 num_local_experts, u32 lane) {
  if (lane == 0) expected[0] = host[ready];
  for (u32 e = lane; e < num_local_experts; e += WARP_SIZE) expected[1 + e] = host[per_expert + e];
}

// The notify kernels' per-expert layout check (LAYOUT_ARG_PER_EXPERT), warp-collective: whether the `el`
// counts `per_expert` (num_tokens_per_expert for one destination rank's experts) disagree with the `sent`
// tokens is_token_in_rank sends that rank. Each token sent there selects at least one of its experts, so they
// count none when nothing goes there and at least `sent` otherwise, and no count is negative. u64 lanes, a
// shuffle tree; every lane gets the answer.
__device__ __forceinline__ bool expert_counts_disagree(const i32* per_expert, u32 el, u64 sent, u32 lane) {
  // Four loads in flight per lane: the check is on a notify's critical path.
  constexpr u32 U = 4;
  u64 sum = 0;
  bool negative = false;
  for (u32 e0 = lane; e0 < el; e0 += U * WARP_SIZE) {
    i32 c[U];
#pragma unroll
    for (u32 u = 0; u < U; u++) c[u] = e0 + u * WARP_SIZE < el ? per_expert[e0 + u * WARP_SIZE] : 0;
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      negative = negative || c[u] < 0;
      sum += c[u] < 0 ? 0ull : (u64)c[u];
    }
  }
#pragma unroll
  for (u32 offset = WARP_SIZE / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(FULL_WARP_MASK, sum, offset);
  negative = __any_sync(FULL_WARP_MASK, negative) != 0;
  return negative || (sent == 0) != (sum == 0) || sum < sent;
}

// True once any thread of this rank has raised a fatal error (device memory: cheap to poll). Argument errors
// (report_error) do not count: the protocol goes on after them.
__device__ __forceinline__ bool error_raised(const Deadline& d) { return ptx::ld_relaxed_gpu(d.sink.claim) == CLAIM_FATAL; }

// Spins until done() returns true. Returns false when `d.timeout_ns` passes first — after recording
// {ERR_TIMEOUT, rank, peer, phase, elapsed} — or as soon as another thread of this rank has failed, so that a
// failing kernel winds down quickly. The clock and the error word are read every DEADLINE_POLL_SPINS polls.
template <typename Done>
__device__ __forceinline__ bool spin_until(Done done, const Deadline& d, u32 peer) {
  if (done()) return true;
  const u64 start = ptx::globaltimer();
  u32 spins = 0;
  while (!done()) {
    if (++spins % DEADLINE_POLL_SPINS == 0) {
      const u64 waited = ptx::globaltimer() - start;
      if (waited > d.timeout_ns) {
        raise_error(d, ERR_TIMEOUT, peer, waited);
        return false;
      }
      if (error_raised(d)) return false;
    }
  }
  return true;
}

// Spins until the flag reaches `target` (wrap-safe: (i32)(flag - target) >= 0), polling with ld.acquire.sys
// (LDG.STRONG.SYS + L1 invalidate, no MEMBAR): on success the writer's release is synchronised with, so its
// earlier writes are visible to this thread. Deadline rules: spin_until.
// RELAXED_POLL: spin with ld.relaxed.sys (no L1 invalidate per poll: cheaper for a data-heavy SM that waits
// often) and acquire once the value is seen.
template <bool RELAXED_POLL = false>
__device__ __forceinline__ bool wait_flag_geq(const u32* flag, u32 target, const Deadline& d, u32 peer) {
  const bool seen = spin_until(
      [&]() { return (i32)((RELAXED_POLL ? ptx::ld_relaxed_sys(flag) : ptx::ld_acquire_sys(flag)) - target) >= 0; }, d, peer);
  if (seen && RELAXED_POLL) (void)ptx::ld_acquire_sys(flag);
  return seen;
}

// Waits for an mbarrier phase (TMA completion) with the same deadline rules.
__device__ __forceinline__ bool mbarrier_wait_parity(u32 bar, u32 parity, const Deadline& d, u32 peer) {
  return spin_until([&]() { return ptx::mbarrier_try_wait_parity(bar, parity); }, d, peer);
}
