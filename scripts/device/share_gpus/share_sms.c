// LD_PRELOAD shim for processes that share a GPU under CUDA MPS: the CUDA runtime reports MOELINK_SHARE_GPUS_SMS
// SMs instead of what it would (the process's MPS share, or the whole GPU without a limit).
//
// Why: DeepEP's low-latency kernels launch a cooperative grid, in clusters of 2, sized from multiProcessorCount,
// whose blocks wait on each other and on the peer's. Two such processes on one H200, each held to 66 SMs by MPS
// and told so, size 58 blocks of 30 warps and time out waiting on the peer; told 36 SMs, both run. The cause is
// not known; scripts/device/steps/python.sh finds the largest count that runs (DEEPEP_LL_SMS).
//
// Built on the GPU machine by scripts/device/steps/python.sh:
//   cc -shared -fPIC -O2 -I$CUDA_HOME/include share_sms.c -o libshare_sms.so -ldl
// It has no symbol versions, so it satisfies the runtime's versioned references (cudaGetDeviceProperties@libcudart.so.13).
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdlib.h>

static int share_sms(void) {
    const char *value = getenv("MOELINK_SHARE_GPUS_SMS");
    return value ? atoi(value) : 0;
}

static void *next_symbol(const char *name) {
    void *symbol = dlvsym(RTLD_NEXT, name, "libcudart.so.13");
    return symbol ? symbol : dlsym(RTLD_NEXT, name);
}

cudaError_t CUDARTAPI cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    static cudaError_t (*next)(struct cudaDeviceProp *, int);
    if (!next)
        next = (cudaError_t (*)(struct cudaDeviceProp *, int))next_symbol("cudaGetDeviceProperties");
    if (!next)
        return cudaErrorSymbolNotFound;
    cudaError_t status = next(prop, device);
    int sms = share_sms();
    if (status == cudaSuccess && sms > 0 && sms < prop->multiProcessorCount)
        prop->multiProcessorCount = sms;
    return status;
}

cudaError_t CUDARTAPI cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    static cudaError_t (*next)(int *, enum cudaDeviceAttr, int);
    if (!next)
        next = (cudaError_t (*)(int *, enum cudaDeviceAttr, int))next_symbol("cudaDeviceGetAttribute");
    if (!next)
        return cudaErrorSymbolNotFound;
    cudaError_t status = next(value, attr, device);
    int sms = share_sms();
    if (status == cudaSuccess && attr == cudaDevAttrMultiProcessorCount && sms > 0 && sms < *value)
        *value = sms;
    return status;
}
