// The NVSHMEM backend of the transport seam (transport.cuh, MOELINK_TRANSPORT_NVSHMEM): the only moelink
// source that includes headers from outside the tree — NVSHMEM's (nvidia-nvshmem-cu13) and, through them,
// the CUDA runtime's and libcu++'s. Compiled by NVRTC with `-rdc=true -default-device` and linked with
// nvJitLink against libnvshmem_device.a (moelink_cuda::jit, a request with `link_nvshmem`).
//
// Two adjustments make NVSHMEM 3.4.5's headers and device library usable from NVRTC:
//   - its non_abi/device/coll/reduce.cuh names std::is_integral / is_signed / is_unsigned without
//     including anything that defines them under NVRTC: they are aliased from libcu++ first;
//   - under NVRTC, libcu++'s uint64_t is `unsigned long long`, while libnvshmem_device.a was built where it
//     is `unsigned long`. The one device-library entry point with such a parameter,
//     nvshmemi_transfer_put_signal<SCOPE>(..., uint64_t signal, ...), is therefore referenced under a name
//     the archive does not define (nvJitLink: "Undefined reference to ..._y14nvshmemi_amo_tib"). The
//     `unsigned long long` specialisations are defined here as forwarders to the `unsigned long` ones the
//     archive has; they must precede the headers' first use of the function.
#pragma once

#include <cuda/std/type_traits>
namespace std {
using cuda::std::is_integral;
using cuda::std::is_signed;
using cuda::std::is_unsigned;
}  // namespace std

#include <device_host_transport/nvshmem_common_transport.h>
#include <non_abi/device/pt-to-pt/nvshmemi_transfer_api.cuh>

template <threadgroup_t SCOPE>
__device__ void nvshmemi_transfer_put_signal(void* rptr, void* lptr, size_t bytes, void* sig_addr, unsigned long signal,
                                             nvshmemi_amo_t sig_op, int pe, bool is_nbi);

#define MOELINK_NVSHMEM_PUT_SIGNAL_FORWARDER(SCOPE)                                                                    \
  template <>                                                                                                          \
  __device__ void nvshmemi_transfer_put_signal<SCOPE>(void* rptr, void* lptr, size_t bytes, void* sig_addr,            \
                                                      unsigned long long signal, nvshmemi_amo_t sig_op, int pe,        \
                                                      bool is_nbi) {                                                   \
    nvshmemi_transfer_put_signal<SCOPE>(rptr, lptr, bytes, sig_addr, (unsigned long)signal, sig_op, pe, is_nbi);       \
  }
MOELINK_NVSHMEM_PUT_SIGNAL_FORWARDER(NVSHMEMI_THREADGROUP_THREAD)
MOELINK_NVSHMEM_PUT_SIGNAL_FORWARDER(NVSHMEMI_THREADGROUP_WARP)
MOELINK_NVSHMEM_PUT_SIGNAL_FORWARDER(NVSHMEMI_THREADGROUP_BLOCK)
#undef MOELINK_NVSHMEM_PUT_SIGNAL_FORWARDER

#include <nvshmem.h>
#include <nvshmemx.h>

// The seam's operations on NVSHMEM's device API. Addresses are local device addresses of symmetric-heap
// objects (NVSHMEM translates them for `pe`).
namespace nvshmem_seam {

__device__ __forceinline__ void put_nbi_warp(u64 dst, u64 src, u32 bytes, u32 pe) {
  nvshmemx_putmem_nbi_warp(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, (int)pe);
}

__device__ __forceinline__ int signal_op_code(u32 op) { return op == SIGNAL_ADD ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET; }

__device__ __forceinline__ void put_signal_nbi_warp(u64 dst, u64 src, u32 bytes, u64 sig, u64 value, u32 op, u32 pe) {
  nvshmemx_putmem_signal_nbi_warp(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes,
                                  reinterpret_cast<uint64_t*>(sig), (uint64_t)value, signal_op_code(op), (int)pe);
}

__device__ __forceinline__ void signal_op(u64 sig, u64 value, u32 op, u32 pe) {
  nvshmemx_signal_op(reinterpret_cast<uint64_t*>(sig), (uint64_t)value, signal_op_code(op), (int)pe);
}

// pe's copy of the symmetric object at `local` as this GPU can store to it (a peer NVSHMEM maps over
// NVLink, or this PE), or 0 when only the transport reaches it.
__device__ __forceinline__ u64 peer_ptr(u64 local, u32 pe) { return reinterpret_cast<u64>(nvshmem_ptr(reinterpret_cast<const void*>(local), (int)pe)); }

__device__ __forceinline__ void fence() { nvshmem_fence(); }

__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

}  // namespace nvshmem_seam
