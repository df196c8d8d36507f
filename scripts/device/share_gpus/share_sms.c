// LD_PRELOAD shim for processes that share a GPU under CUDA MPS: the CUDA runtime reports the SMs of the process's
// share (MOELINK_SHARE_GPUS_SMS) instead of the whole GPU's.
//
// Why: a kernel whose blocks wait on each other (DeepEP's low-latency dispatch and combine, launched cooperative
// with a grid sized from cudaDeviceProp::multiProcessorCount) needs every block resident at once. MPS holds a
// process to its share of the SMs but the runtime still reports them all, so such a grid can be larger than the
// share: the blocks that find no SM never run, and the peer waiting on them times out. Told its share, the
// process sizes its grid as it would on a GPU of that many SMs.
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
