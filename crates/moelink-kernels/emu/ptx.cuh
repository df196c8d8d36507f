// Host emulation of ptx.cuh and of the CUDA built-ins the kernels use, for tests/ll_emulation.rs: the
// kernels of ll.cu compile with g++ (-DMOELINK_HOST_EMULATION) and run on the CPU, one OS thread per block
// and one fiber (ucontext) per CUDA thread, so that their index math and flag protocol can be checked
// without a GPU. Not a timing model; memory ordering is x86's plus full fences where the kernels fence.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <ucontext.h>
#include <vector>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

struct alignas(16) u32x4 {
  u32 x, y, z, w;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

constexpr u32 WARP_SIZE = 32;
constexpr u32 FULL_WARP_MASK = 0xffffffffu;

// ============================================================================================ fiber runtime
namespace emu {

struct dim3 {
  u32 x = 0, y = 0, z = 0;
};

struct Warp {
  u64 slot[WARP_SIZE];
  u64 snapshot[WARP_SIZE];
  u32 arrived = 0;
  u64 gen = 0;
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  ucontext_t main;
  u32 current = 0;
  u32 bar_arrived = 0;
  u64 bar_gen = 0;
  dim3 block_idx, grid_dim;
};

inline thread_local Block* g_block = nullptr;

inline void yield() { swapcontext(&g_block->fibers[g_block->current].ctx, &g_block->main); }

inline dim3 thread_idx() {
  dim3 d;
  d.x = g_block->current;
  return d;
}

// All LL_THREADS threads of the block must call it (the kernels only call it uniformly).
inline void syncthreads() {
  Block& b = *g_block;
  const u64 gen = b.bar_gen;
  if (++b.bar_arrived == b.fibers.size()) {
    b.bar_arrived = 0;
    b.bar_gen++;
  } else {
    while (b.bar_gen == gen) yield();
  }
}

// A full-warp collective: every lane deposits a value, all lanes see every value.
inline const u64* warp_exchange(u64 v) {
  Block& b = *g_block;
  const u32 tid = b.current;
  Warp& w = b.warps[tid / WARP_SIZE];
  w.slot[tid % WARP_SIZE] = v;
  const u64 gen = w.gen;
  if (++w.arrived == WARP_SIZE) {
    std::memcpy(w.snapshot, w.slot, sizeof(w.slot));
    w.arrived = 0;
    w.gen++;
  } else {
    while (w.gen == gen) yield();
  }
  return w.snapshot;
}

template <typename T>
inline u64 to_bits(T v) {
  u64 b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(u64 b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::g_block->block_idx)
#define gridDim (emu::g_block->grid_dim)

inline void __syncthreads() { emu::syncthreads(); }

template <typename T>
inline T __shfl_sync(u32, T v, u32 src) {
  const u64* s = emu::warp_exchange(emu::to_bits(v));
  return emu::from_bits<T>(s[src % WARP_SIZE]);
}
template <typename T>
inline T __shfl_xor_sync(u32, T v, u32 m) {
  const u64* s = emu::warp_exchange(emu::to_bits(v));
  return emu::from_bits<T>(s[(emu::g_block->current % WARP_SIZE) ^ m]);
}
inline u32 __ballot_sync(u32, bool p) {
  const u64* s = emu::warp_exchange(p ? 1 : 0);
  u32 r = 0;
  for (u32 i = 0; i < WARP_SIZE; i++) r |= (s[i] ? 1u : 0u) << i;
  return r;
}
inline u32 __reduce_or_sync(u32, u32 v) {
  const u64* s = emu::warp_exchange(v);
  u32 r = 0;
  for (u32 i = 0; i < WARP_SIZE; i++) r |= (u32)s[i];
  return r;
}

inline u32 __reduce_add_sync(u32, u32 v) {
  const u64* s = emu::warp_exchange(v);
  u32 r = 0;
  for (u32 i = 0; i < WARP_SIZE; i++) r += (u32)s[i];
  return r;
}

inline u32 __popc(u32 v) { return (u32)__builtin_popcount(v); }
inline i32 __ffs(u32 v) { return __builtin_ffs((int)v); }
inline i32 __clz(u32 v) { return v == 0 ? 32 : __builtin_clz(v); }
inline float __uint_as_float(u32 b) { return emu::from_bits<float>(b); }
inline u32 __float_as_uint(float f) { return (u32)emu::to_bits(f); }
// Shared-memory atomics: one OS thread runs a whole block, so plain read-modify-writes suffice.
inline u32 atomicOr(u32* p, u32 v) {
  const u32 old = *p;
  *p = old | v;
  return old;
}

inline u32 atomicAdd(u32* p, u32 v) {
  const u32 old = *p;
  *p = old + v;
  return old;
}

// ============================================================================================ ABI (as ptx.cuh)
constexpr u32 ERR_NONE = 0;
constexpr u32 ERR_TIMEOUT = 1;
constexpr u32 PHASE_BARRIER = 1;
constexpr u32 PHASE_COPY = 2;
constexpr u32 PHASE_LAYOUT = 3;
constexpr u32 PHASE_NOTIFY = 4;
constexpr u32 PHASE_DISPATCH = 5;
constexpr u32 PHASE_COMBINE = 6;
constexpr u32 PHASE_LL_DISPATCH = 7;
constexpr u32 PHASE_LL_COMBINE = 8;
constexpr u32 PHASE_OTHER = 15;
constexpr u32 NO_PEER = 0xffffffffu;
constexpr u32 DEADLINE_POLL_SPINS = 256;

struct ErrorRecord {
  u32 code;
  u32 rank;
  u32 peer;
  u32 phase;
  u64 elapsed_ns;
  u64 timeout_ns;
};

struct ErrorSink {
  u32* claim;
  ErrorRecord* record;
};

namespace ptx {

inline u32 ld_acquire_sys(const u32* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
// Polled in spin loops: lets the block's other fibers run.
inline u32 ld_relaxed_sys(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline u32 ld_relaxed_gpu(const u32* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void st_release_sys(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void st_relaxed_sys(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void st_relaxed_sys_u64(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline u32 atom_cas_acq_rel_gpu(u32* p, u32 expected, u32 desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
}
inline void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void fence_acq_rel_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline u32x4 ld_nc_na_v4(const u32x4* p) {
  u32x4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline u32x4 ld_v4(const u32x4* p) { return ld_nc_na_v4(p); }
inline void st_na_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, 16); }
inline void st_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, 16); }

inline u64 globaltimer() {
  return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// f32 -> bf16, round to nearest even; NaN -> canonical 0x7fff (cvt.rn.bf16.f32).
inline u16 bf16_rn(float f) {
  const u32 b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline u32 cvt_rn_bf16x2_f32(float hi, float lo) { return (u32)bf16_rn(lo) | ((u32)bf16_rn(hi) << 16); }

// f32 -> e4m3 as cvt.rn.satfinite (moelink::fp8::f32_to_e4m3).
inline u8 e4m3_rn_satfinite(float x) {
  const u32 bits = __float_as_uint(x);
  const u8 sign = (u8)((bits >> 24) & 0x80);
  const u32 abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;
  if (__uint_as_float(abs) > 448.0f) return sign | 0x7e;
  const i32 biased = (i32)(abs >> 23);
  if (biased == 0) return sign;
  const i32 exp = biased - 127;
  const u64 significand = (u64)((abs & 0x7fffffu) | 0x800000u);
  i32 quantum_exp = (exp > -6 ? exp : -6) - 3;
  const u32 shift = (u32)(23 + quantum_exp - exp);
  u64 n;
  if (shift > 63) {
    n = 0;
  } else {
    const u64 kept = significand >> shift, rest = significand & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    n = (rest > half || (rest == half && (kept & 1))) ? kept + 1 : kept;
  }
  if (n >= 16) {
    n >>= 1;
    quantum_exp += 1;
  }
  const u64 code = n >= 8 ? (((u64)(quantum_exp + 3 + 7)) << 3) | (n - 8) : n;
  return (u8)(sign | (u8)code);
}
inline u16 cvt_rn_satfinite_e4m3x2_f32(float hi, float lo) { return (u16)(e4m3_rn_satfinite(lo) | (e4m3_rn_satfinite(hi) << 8)); }

}  // namespace ptx

// ============================================================================================ deadlines (as ptx.cuh)
struct Deadline {
  u64 timeout_ns;
  ErrorSink sink;
  u32 rank;
  u32 phase;
};

inline Deadline make_deadline(u64 error_claim, u64 error_record, u64 timeout_ns, u32 rank, u32 phase) {
  Deadline d;
  d.timeout_ns = timeout_ns;
  d.sink.claim = reinterpret_cast<u32*>(error_claim);
  d.sink.record = reinterpret_cast<ErrorRecord*>(error_record);
  d.rank = rank;
  d.phase = phase;
  return d;
}

inline void raise_error(const Deadline& d, u32 code, u32 peer, u64 elapsed_ns) {
  if (ptx::atom_cas_acq_rel_gpu(d.sink.claim, 0u, 1u) != 0u) return;
  ErrorRecord* r = d.sink.record;
  r->rank = d.rank;
  r->peer = peer;
  r->phase = d.phase;
  r->elapsed_ns = elapsed_ns;
  r->timeout_ns = d.timeout_ns;
  ptx::st_release_sys(&r->code, code);
}

inline bool error_raised(const Deadline& d) { return ptx::ld_relaxed_gpu(d.sink.claim) != 0u; }

inline bool wait_flag_geq(const u32* flag, u32 target, const Deadline& d, u32 peer) {
  if ((i32)(ptx::ld_relaxed_sys(flag) - target) >= 0) return true;
  const u64 start = ptx::globaltimer();
  u32 spins = 0;
  while ((i32)(ptx::ld_relaxed_sys(flag) - target) < 0) {
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

// ============================================================================================ ll.cu's own PTX helpers
namespace llptx {
inline u32 atom_add_relaxed_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline u32 atom_add_acq_rel_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
inline void st_relaxed_gpu(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline void red_add_relaxed_sys(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline u32x4 ld_cg_v4(const void* p) {
  u32x4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline u32 ld_cg_u32(const void* p) { return __atomic_load_n(reinterpret_cast<const u32*>(p), __ATOMIC_RELAXED); }
inline u64 ld_nc_u64(const void* p) {
  u64 v;
  std::memcpy(&v, p, 8);
  return v;
}
inline u32 ld_nc_u32(const void* p) {
  u32 v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void st_na_u32(void* p, u32 v) { std::memcpy(p, &v, 4); }
inline void st_na_u64(void* p, u64 v) { std::memcpy(p, &v, 8); }
inline void prefetch_l2(const void*) {}
// Compiled with -ffp-contract=off: one rounding per operation, as mul.rn / add.rn / div.rn.
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
inline float div_rn(float a, float b) { return a / b; }
inline float max_f32(float a, float b) { return std::fmax(a, b); }
}  // namespace llptx
