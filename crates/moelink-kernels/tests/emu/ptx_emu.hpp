// The `ptx` namespace of cuda/ptx.cuh, emulated on the host (see emu.hpp): tests/emulate_ht.rs splices this
// in place of the real namespace (which is inline PTX), keeping the rest of ptx.cuh (error records, deadline
// waits) as written. Scopes map to C++ orders: relaxed -> relaxed, acquire/release -> acquire/release, the
// fences -> seq_cst fences. Loads used in spin loops (flags, timer) let the other fibers of the block run.
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
__device__ __forceinline__ void red_add_release_sys(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELEASE); }
__device__ __forceinline__ void red_add_relaxed_sys(u32* p, u32 v) { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ u32 atom_add_relaxed_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
__device__ __forceinline__ u32 atom_cas_acq_rel_gpu(u32* p, u32 expected, u32 desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
}
__device__ __forceinline__ void fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ __forceinline__ void fence_acq_rel_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

__device__ __forceinline__ u32x4 ld_nc_na_v4(const u32x4* p) {
  u32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__device__ __forceinline__ u32x4 ld_na_v4(const u32x4* p) { return ld_nc_na_v4(p); }
__device__ __forceinline__ u32x4 ld_v4(const u32x4* p) { return ld_nc_na_v4(p); }
__device__ __forceinline__ void st_na_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, sizeof v); }
__device__ __forceinline__ void st_v4(u32x4* p, const u32x4& v) { std::memcpy(p, &v, sizeof v); }

__device__ __forceinline__ u64 globaltimer() {
  emu::yield();
  return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Not used by the HT kernels (TMA): present so that ptx.cuh's mbarrier_wait_parity compiles.
__device__ __forceinline__ bool mbarrier_try_wait_parity(u32, u32) { return true; }

__device__ __forceinline__ float add_rn_f32(float a, float b) {
  volatile float r = a + b;  // one IEEE single add, round to nearest even (SSE, no FTZ)
  return r;
}
__device__ __forceinline__ float f32_from_bits(u32 v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
__device__ __forceinline__ u32 bits_from_f32(float f) {
  u32 v;
  std::memcpy(&v, &f, 4);
  return v;
}
// cvt.rn.bf16.f32: round to nearest even; NaN stays NaN (canonical quiet NaN).
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

}  // namespace ptx
