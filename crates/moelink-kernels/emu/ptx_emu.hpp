// The `ptx` namespace of cuda/ptx.cuh, emulated on the host (see runtime.hpp). The test drivers (tests/common/mod.rs) splice this whole file in place of ptx.cuh's real
// `namespace ptx { ... }` (inline PTX), keeping the rest of ptx.cuh (ABI constants, error records, deadline
// waits) as written. Scopes map to C++ orders: relaxed -> relaxed, acquire/release -> acquire/release, the
// fences -> seq_cst fences. Loads used in spin loops (flags, timer) let the other fibers of the block run.
// Arithmetic is one IEEE single operation, round to nearest even (SSE, no FTZ; the drivers compile with
// -ffp-contract=off, and add_rn_f32 goes through a volatile besides).
namespace ptx {

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ u32 ld_relaxed_sys(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ u32 ld_relaxed_gpu(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ void st_release_sys(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ void st_relaxed_sys(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void st_relaxed_sys_u64(u64* p, u64 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void st_relaxed_gpu(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void red_add_release_sys(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ void red_add_relaxed_sys(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ u64 ld_relaxed_sys_u64(const u64* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ void red_add_relaxed_sys_u64(u64* p, u64 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void red_add_relaxed_gpu(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ void red_add_relaxed_gpu_u64(u64* p, u64 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ void st_release_gpu(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ void red_add_release_gpu(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ u32 atom_add_relaxed_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
__device__ __forceinline__ u32 atom_cas_acq_rel_gpu(u32* p, u32 expected, u32 desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
}
__device__ __forceinline__ u64 atom_cas_relaxed_gpu_u64(u64* p, u64 expected, u64 desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
__device__ __forceinline__ void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ __forceinline__ void fence_acq_rel_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ __forceinline__ u32 ld_acquire_cta(const u32* p) {
  emu::yield();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ void st_release_cta(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

__device__ __forceinline__ u32x4 ld_nc_na_v4(const u32x4* p) {
  u32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__device__ __forceinline__ u32x4 ld_na_v4(const u32x4* p) { return ld_nc_na_v4(p); }
__device__ __forceinline__ u32x4 ld_v4(const u32x4* p) { return ld_nc_na_v4(p); }
__device__ __forceinline__ void st_na_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, sizeof v); }
__device__ __forceinline__ void st_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, sizeof v); }

__device__ __forceinline__ u32x4 ld_cg_v4(const void* p) {
  u32x4 v;
  std::memcpy(&v, p, 16);
  return v;
}
__device__ __forceinline__ u32 ld_cg_u32(const void* p) { return __atomic_load_n(static_cast<const u32*>(p), __ATOMIC_RELAXED); }
__device__ __forceinline__ u64 ld_nc_u64(const void* p) {
  u64 v;
  std::memcpy(&v, p, 8);
  return v;
}
__device__ __forceinline__ u32 ld_nc_u32(const void* p) {
  u32 v;
  std::memcpy(&v, p, 4);
  return v;
}
__device__ __forceinline__ void st_na_u32(void* p, u32 v) { std::memcpy(p, &v, 4); }
__device__ __forceinline__ void st_na_u64(void* p, u64 v) { std::memcpy(p, &v, 8); }
__device__ __forceinline__ void prefetch_l2(const void*) {}
__device__ __forceinline__ void prefetch_l2_bulk(const void*, u32) {}

__device__ __forceinline__ u64 globaltimer() {
  emu::yield();
  return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Not used by the kernels run here (TMA): present so that ptx.cuh's mbarrier_wait_parity compiles.
__device__ __forceinline__ bool mbarrier_try_wait_parity(u32, u32) { return true; }

__device__ __forceinline__ float add_rn_f32(float a, float b) {
  volatile float r = a + b;  // one IEEE single add, round to nearest even (SSE, no FTZ)
  return r;
}
// -ffp-contract=off: one rounding per operation, as mul.rn / div.rn.
__device__ __forceinline__ float mul_rn_f32(float a, float b) { return a * b; }
__device__ __forceinline__ float div_rn_f32(float a, float b) { return a / b; }
// max.f32: when one input is NaN the other is returned.
__device__ __forceinline__ float max_f32(float a, float b) { return std::fmax(a, b); }
__device__ __forceinline__ float f32_from_bits(u32 v) { return emu::bit_cast<float>(v); }
__device__ __forceinline__ u32 bits_from_f32(float f) { return emu::bit_cast<u32>(f); }

// cvt.rn.bf16.f32: round to nearest even; NaN stays NaN (canonical quiet NaN 0x7fff).
__device__ __forceinline__ u16 cvt_rn_bf16_f32(float f) {
  u32 u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}
__device__ __forceinline__ u32 cvt_rn_bf16x2_f32(float hi, float lo) {
  return ((u32)cvt_rn_bf16_f32(hi) << 16) | cvt_rn_bf16_f32(lo);
}
__device__ __forceinline__ float cvt_f32_bf16(u16 h) { return f32_from_bits((u32)h << 16); }

// One f32 to e4m3 as cvt.rn.satfinite (moelink::fp8::f32_to_e4m3): round to nearest even, finite values
// beyond +-448 saturate to +-448, NaN -> 0x7f. (Not a ptx.cuh function: the lane of the pair below.)
__device__ __forceinline__ u8 e4m3_rn_satfinite(float x) {
  const u32 bits = bits_from_f32(x);
  const u8 sign = (u8)((bits >> 24) & 0x80);
  const u32 abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;
  if (f32_from_bits(abs) > 448.0f) return sign | 0x7e;
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
// Two floats to packed e4m3: `hi` in the upper byte, `lo` in the lower.
__device__ __forceinline__ u16 cvt_rn_satfinite_e4m3x2_f32(float hi, float lo) {
  return (u16)(e4m3_rn_satfinite(lo) | (e4m3_rn_satfinite(hi) << 8));
}

}  // namespace ptx
