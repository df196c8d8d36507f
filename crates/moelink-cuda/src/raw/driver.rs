//! Raw CUDA driver calls (`cudarc::driver::sys`) as `unsafe fn`s returning [`Result`].
//!
//! Contract of every `unsafe fn` here: [`ensure_loaded`] returned `Ok` earlier in this process (else cudarc
//! panics on the missing library), handles passed in are live handles of the kind named, pointers are valid
//! for the byte counts given, and the right context is current where the driver needs one.

use std::ffi::{c_void, CStr, CString};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

pub(crate) use sys::{CUcontext, CUdevice, CUevent, CUfunction, CUgraph, CUgraphExec, CUmodule, CUstream};

/// Lowest driver API version moelink accepts: `cuFuncGetParamInfo` (argument checking) needs 12.4.
pub(crate) const MIN_DRIVER_VERSION: i32 = 12040;

fn status_name(r: sys::CUresult) -> String {
    format!("{r:?}")
}

fn driver_error(r: sys::CUresult, call: &'static str) -> Error {
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: a CUresult came back, so the library is loaded; cuGetErrorString writes a pointer to a static
    // string (or leaves it null for unknown codes).
    let ok = unsafe { sys::cuGetErrorString(r, &mut s) } == sys::CUresult::CUDA_SUCCESS && !s.is_null();
    let description = if ok {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    } else {
        "no description".to_string()
    };
    Error::Driver { call, code: r as u32, name: status_name(r), description }
}

#[inline]
fn check(r: sys::CUresult, call: &'static str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(r, call))
    }
}

/// `check(sys::f(args), "f")`.
macro_rules! drv {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        check(sys::$f($($arg),*), stringify!($f))
    };
}

// ------------------------------------------------------------------------------------------------ init

/// Loads `libcuda`, runs `cuInit(0)` and checks the driver version, once per process. Never panics.
pub(crate) fn ensure_loaded() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen candidate names; it never panics.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver(
                "libcuda.so.1 could not be loaded: this machine has no NVIDIA driver, or it is not on the loader path".into(),
            ));
        }
        // SAFETY: the library is present (checked above), so cudarc can resolve the symbol.
        let r = unsafe { sys::cuInit(0) };
        if r == sys::CUresult::CUDA_ERROR_NO_DEVICE {
            return Err(Error::NoDriver("the driver loaded but reports no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)".into()));
        }
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::NoDriver(format!("cuInit failed: {}", driver_error(r, "cuInit"))));
        }
        let mut v = 0i32;
        // SAFETY: library loaded and initialised; `v` is a valid out-pointer.
        check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
        if v < MIN_DRIVER_VERSION {
            return Err(Error::DriverTooOld { found: format_version(v), required: format_version(MIN_DRIVER_VERSION) });
        }
        Ok(())
    })
    .clone()
}

/// `12040` → `"12.4"`.
pub(crate) fn format_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

pub(crate) unsafe fn driver_version() -> Result<i32> {
    let mut v = 0;
    drv!(cuDriverGetVersion(&mut v))?;
    Ok(v)
}

// ------------------------------------------------------------------------------------------------ devices

pub(crate) unsafe fn device_count() -> Result<usize> {
    let mut n = 0;
    drv!(cuDeviceGetCount(&mut n))?;
    Ok(n.max(0) as usize)
}

pub(crate) unsafe fn device_get(ordinal: usize) -> Result<CUdevice> {
    let mut d: CUdevice = 0;
    drv!(cuDeviceGet(&mut d, ordinal as i32))?;
    Ok(d)
}

pub(crate) unsafe fn device_name(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    drv!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev))?;
    Ok(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
}

pub(crate) unsafe fn device_pci_bus_id(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 64];
    drv!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev))?;
    Ok(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned())
}

/// Device attributes the safe layer reads.
#[derive(Clone, Copy, Debug)]
pub(crate) enum DeviceAttr {
    ComputeCapabilityMajor,
    ComputeCapabilityMinor,
    MultiprocessorCount,
    MaxSharedMemoryPerBlockOptin,
    L2CacheSize,
    MaxThreadsPerBlock,
    CooperativeLaunch,
    MpsEnabled,
}

impl DeviceAttr {
    fn raw(self) -> sys::CUdevice_attribute {
        use sys::CUdevice_attribute as A;
        match self {
            DeviceAttr::ComputeCapabilityMajor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            DeviceAttr::ComputeCapabilityMinor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            DeviceAttr::MultiprocessorCount => A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            DeviceAttr::MaxSharedMemoryPerBlockOptin => A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            DeviceAttr::L2CacheSize => A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
            DeviceAttr::MaxThreadsPerBlock => A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            DeviceAttr::CooperativeLaunch => A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH,
            DeviceAttr::MpsEnabled => A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
        }
    }
}

pub(crate) unsafe fn device_attribute(dev: CUdevice, attr: DeviceAttr) -> Result<i32> {
    let mut v = 0;
    drv!(cuDeviceGetAttribute(&mut v, attr.raw(), dev))?;
    Ok(v)
}

pub(crate) unsafe fn device_total_mem(dev: CUdevice) -> Result<usize> {
    let mut n = 0usize;
    drv!(cuDeviceTotalMem_v2(&mut n, dev))?;
    Ok(n)
}

pub(crate) unsafe fn device_can_access_peer(dev: CUdevice, peer: CUdevice) -> Result<bool> {
    let mut v = 0;
    drv!(cuDeviceCanAccessPeer(&mut v, dev, peer))?;
    Ok(v != 0)
}

// ------------------------------------------------------------------------------------------------ contexts

pub(crate) unsafe fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext> {
    let mut c: CUcontext = std::ptr::null_mut();
    drv!(cuDevicePrimaryCtxRetain(&mut c, dev))?;
    Ok(c)
}

pub(crate) unsafe fn primary_ctx_release(dev: CUdevice) -> Result<()> {
    drv!(cuDevicePrimaryCtxRelease_v2(dev))
}

pub(crate) unsafe fn ctx_get_current() -> Result<CUcontext> {
    let mut c: CUcontext = std::ptr::null_mut();
    drv!(cuCtxGetCurrent(&mut c))?;
    Ok(c)
}

pub(crate) unsafe fn ctx_set_current(ctx: CUcontext) -> Result<()> {
    drv!(cuCtxSetCurrent(ctx))
}

/// SMs the current context may use (`cuCtxGetExecAffinity`): less than the device's under CUDA MPS with
/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`. `None` when the driver does not say.
pub(crate) unsafe fn ctx_exec_affinity_sm_count() -> Option<u32> {
    let mut p: sys::CUexecAffinityParam = std::mem::zeroed();
    let r = sys::cuCtxGetExecAffinity(&mut p, sys::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT);
    (r == sys::CUresult::CUDA_SUCCESS).then_some(p.param.smCount.val)
}

pub(crate) unsafe fn ctx_synchronize() -> Result<()> {
    drv!(cuCtxSynchronize())
}

/// Enables access from the current context to `peer`'s memory; "already enabled" counts as success.
pub(crate) unsafe fn ctx_enable_peer_access(peer: CUcontext) -> Result<()> {
    let r = sys::cuCtxEnablePeerAccess(peer, 0);
    if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check(r, "cuCtxEnablePeerAccess")
}

/// `(free, total)` bytes of the current context's device.
pub(crate) unsafe fn mem_get_info() -> Result<(usize, usize)> {
    let (mut free, mut total) = (0usize, 0usize);
    drv!(cuMemGetInfo_v2(&mut free, &mut total))?;
    Ok((free, total))
}

// ------------------------------------------------------------------------------------------------ memory

pub(crate) unsafe fn mem_alloc(bytes: usize) -> Result<u64> {
    let mut p: sys::CUdeviceptr = 0;
    drv!(cuMemAlloc_v2(&mut p, bytes))?;
    Ok(p)
}

/// Stream-ordered allocation from the device's default memory pool.
pub(crate) unsafe fn mem_alloc_async(bytes: usize, stream: CUstream) -> Result<u64> {
    let mut p: sys::CUdeviceptr = 0;
    drv!(cuMemAllocAsync(&mut p, bytes, stream))?;
    Ok(p)
}

/// Stream-ordered free of a [`mem_alloc_async`] allocation: unlike cuMemFree it does not wait for the device.
pub(crate) unsafe fn mem_free_async(ptr: u64, stream: CUstream) -> Result<()> {
    drv!(cuMemFreeAsync(ptr, stream))
}

pub(crate) unsafe fn mem_free(ptr: u64) -> Result<()> {
    drv!(cuMemFree_v2(ptr))
}

/// Base and size of the allocation containing `ptr`.
pub(crate) unsafe fn mem_get_address_range(ptr: u64) -> Result<(u64, usize)> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    drv!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr))?;
    Ok((base, size))
}

pub(crate) unsafe fn memcpy_htod_async(dst: u64, src: *const u8, bytes: usize, stream: CUstream) -> Result<()> {
    drv!(cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream))
}

pub(crate) unsafe fn memcpy_dtoh_async(dst: *mut u8, src: u64, bytes: usize, stream: CUstream) -> Result<()> {
    drv!(cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream))
}

pub(crate) unsafe fn memcpy_dtod_async(dst: u64, src: u64, bytes: usize, stream: CUstream) -> Result<()> {
    drv!(cuMemcpyDtoDAsync_v2(dst, src, bytes, stream))
}

pub(crate) unsafe fn memset_d8_async(dst: u64, value: u8, count: usize, stream: CUstream) -> Result<()> {
    drv!(cuMemsetD8Async(dst, value, count, stream))
}

pub(crate) unsafe fn memset_d32_async(dst: u64, value: u32, count: usize, stream: CUstream) -> Result<()> {
    drv!(cuMemsetD32Async(dst, value, count, stream))
}

/// Page-locked host memory mapped into every context's address space (`DEVICEMAP | PORTABLE`).
pub(crate) unsafe fn mem_host_alloc_mapped(bytes: usize) -> Result<*mut c_void> {
    let mut p: *mut c_void = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    drv!(cuMemHostAlloc(&mut p, bytes, flags))?;
    Ok(p)
}

pub(crate) unsafe fn mem_free_host(p: *mut c_void) -> Result<()> {
    drv!(cuMemFreeHost(p))
}

pub(crate) unsafe fn mem_host_get_device_pointer(p: *mut c_void) -> Result<u64> {
    let mut d: sys::CUdeviceptr = 0;
    drv!(cuMemHostGetDevicePointer_v2(&mut d, p, 0))?;
    Ok(d)
}

// ------------------------------------------------------------------------------------------------ IPC

pub(crate) unsafe fn ipc_get_mem_handle(ptr: u64) -> Result<[u8; 64]> {
    let mut h: sys::CUipcMemHandle = std::mem::zeroed();
    drv!(cuIpcGetMemHandle(&mut h, ptr))?;
    let mut out = [0u8; 64];
    for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

/// Opens another process's allocation in the current context, enabling peer access lazily.
pub(crate) unsafe fn ipc_open_mem_handle(handle: &[u8; 64]) -> Result<u64> {
    let mut h: sys::CUipcMemHandle = std::mem::zeroed();
    for (c, b) in h.reserved.iter_mut().zip(handle.iter()) {
        *c = *b as _;
    }
    let mut p: sys::CUdeviceptr = 0;
    drv!(cuIpcOpenMemHandle_v2(&mut p, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32))?;
    Ok(p)
}

pub(crate) unsafe fn ipc_close_mem_handle(ptr: u64) -> Result<()> {
    drv!(cuIpcCloseMemHandle(ptr))
}

// ------------------------------------------------------------------------------------------------ streams, events

pub(crate) unsafe fn stream_create_non_blocking() -> Result<CUstream> {
    let mut s: CUstream = std::ptr::null_mut();
    drv!(cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
    Ok(s)
}

pub(crate) unsafe fn stream_destroy(s: CUstream) -> Result<()> {
    drv!(cuStreamDestroy_v2(s))
}

pub(crate) unsafe fn stream_synchronize(s: CUstream) -> Result<()> {
    drv!(cuStreamSynchronize(s))
}

/// True when all work on the stream has completed.
pub(crate) unsafe fn stream_query(s: CUstream) -> Result<bool> {
    let r = sys::cuStreamQuery(s);
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(r, "cuStreamQuery").map(|_| true)
}

pub(crate) unsafe fn stream_wait_event(s: CUstream, e: CUevent) -> Result<()> {
    drv!(cuStreamWaitEvent(s, e, 0))
}

/// `timing = false` creates a lighter event (`CU_EVENT_DISABLE_TIMING`).
pub(crate) unsafe fn event_create(timing: bool) -> Result<CUevent> {
    let mut e: CUevent = std::ptr::null_mut();
    let flags = if timing { 0 } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 };
    drv!(cuEventCreate(&mut e, flags))?;
    Ok(e)
}

pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<()> {
    drv!(cuEventDestroy_v2(e))
}

pub(crate) unsafe fn event_record(e: CUevent, s: CUstream) -> Result<()> {
    drv!(cuEventRecord(e, s))
}

pub(crate) unsafe fn event_synchronize(e: CUevent) -> Result<()> {
    drv!(cuEventSynchronize(e))
}

/// True when the work captured by the event has completed.
pub(crate) unsafe fn event_query(e: CUevent) -> Result<bool> {
    let r = sys::cuEventQuery(e);
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(r, "cuEventQuery").map(|_| true)
}

/// Milliseconds between two recorded timing events. Uses `cuEventElapsedTime_v2` (driver ≥ 12.8) and
/// falls back to the original entry point on older drivers.
pub(crate) unsafe fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    let mut ms = 0f32;
    if symbol_present("cuEventElapsedTime_v2") {
        drv!(cuEventElapsedTime_v2(&mut ms, start, end))?;
        return Ok(ms);
    }
    type F = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> sys::CUresult;
    let f: F = match sys::culib().get::<F>(b"cuEventElapsedTime") {
        Ok(sym) => *sym,
        Err(e) => return Err(Error::NoDriver(format!("libcuda has no cuEventElapsedTime: {e}"))),
    };
    check(f(&mut ms, start, end), "cuEventElapsedTime")?;
    Ok(ms)
}

/// True when libcuda exports `name` (checked without cudarc's panicking loader).
pub(crate) unsafe fn symbol_present(name: &str) -> bool {
    sys::culib().get::<*const c_void>(name.as_bytes()).is_ok()
}

// ------------------------------------------------------------------------------------------------ modules, launch

pub(crate) unsafe fn module_load_data(image: &[u8]) -> Result<CUmodule> {
    let mut m: CUmodule = std::ptr::null_mut();
    drv!(cuModuleLoadData(&mut m, image.as_ptr() as *const c_void))?;
    Ok(m)
}

pub(crate) unsafe fn module_unload(m: CUmodule) -> Result<()> {
    drv!(cuModuleUnload(m))
}

pub(crate) unsafe fn module_get_function(m: CUmodule, name: &str) -> Result<CUfunction> {
    let c = CString::new(name).map_err(|_| Error::invalid(format!("kernel name {name:?} contains a NUL byte")))?;
    let mut f: CUfunction = std::ptr::null_mut();
    drv!(cuModuleGetFunction(&mut f, m, c.as_ptr()))?;
    Ok(f)
}

/// Loads every function of `m` now. Under lazy loading (the default since CUDA 12.2) a function is
/// otherwise loaded at its first launch, and a load can synchronise the context.
pub(crate) unsafe fn module_load_functions(m: CUmodule) -> Result<()> {
    let mut count: std::ffi::c_uint = 0;
    drv!(cuModuleGetFunctionCount(&mut count, m))?;
    let mut functions: Vec<CUfunction> = vec![std::ptr::null_mut(); count as usize];
    drv!(cuModuleEnumerateFunctions(functions.as_mut_ptr(), count, m))?;
    for f in functions {
        drv!(cuFuncLoad(f))?;
    }
    Ok(())
}

/// Function attributes the safe layer reads or sets.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FuncAttr {
    MaxThreadsPerBlock,
    SharedSizeBytes,
    LocalSizeBytes,
    NumRegs,
    MaxDynamicSharedSizeBytes,
}

impl FuncAttr {
    fn raw(self) -> sys::CUfunction_attribute {
        use sys::CUfunction_attribute as A;
        match self {
            FuncAttr::MaxThreadsPerBlock => A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            FuncAttr::SharedSizeBytes => A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            FuncAttr::LocalSizeBytes => A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
            FuncAttr::NumRegs => A::CU_FUNC_ATTRIBUTE_NUM_REGS,
            FuncAttr::MaxDynamicSharedSizeBytes => A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        }
    }
}

pub(crate) unsafe fn func_get_attribute(f: CUfunction, attr: FuncAttr) -> Result<i32> {
    let mut v = 0;
    drv!(cuFuncGetAttribute(&mut v, attr.raw(), f))?;
    Ok(v)
}

pub(crate) unsafe fn func_set_attribute(f: CUfunction, attr: FuncAttr, value: i32) -> Result<()> {
    drv!(cuFuncSetAttribute(f, attr.raw(), value))
}

/// Byte sizes of the kernel's parameters, in order (`cuFuncGetParamInfo`, driver ≥ 12.4).
pub(crate) unsafe fn func_param_sizes(f: CUfunction) -> Result<Vec<usize>> {
    let mut sizes = Vec::new();
    for i in 0.. {
        let (mut off, mut size) = (0usize, 0usize);
        let r = sys::cuFuncGetParamInfo(f, i, &mut off, &mut size);
        if r == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            break;
        }
        check(r, "cuFuncGetParamInfo")?;
        sizes.push(size);
    }
    Ok(sizes)
}

/// Launch shape handed to [`launch_kernel_ex`].
pub(crate) struct RawLaunch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_smem_bytes: u32,
    pub cooperative: bool,
    pub cluster: Option<[u32; 3]>,
}

/// `cuLaunchKernelEx`. `params[i]` points at the bytes of argument `i`.
pub(crate) unsafe fn launch_kernel_ex(f: CUfunction, stream: CUstream, l: &RawLaunch, params: &mut [*mut c_void]) -> Result<()> {
    let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
    if l.cooperative {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        a.value.cooperative = 1;
        attrs.push(a);
    }
    if let Some([x, y, z]) = l.cluster {
        let mut a: sys::CUlaunchAttribute = std::mem::zeroed();
        a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        a.value.clusterDim.x = x;
        a.value.clusterDim.y = y;
        a.value.clusterDim.z = z;
        attrs.push(a);
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: l.grid[0],
        gridDimY: l.grid[1],
        gridDimZ: l.grid[2],
        blockDimX: l.block[0],
        blockDimY: l.block[1],
        blockDimZ: l.block[2],
        sharedMemBytes: l.dynamic_smem_bytes,
        hStream: stream,
        attrs: if attrs.is_empty() { std::ptr::null_mut() } else { attrs.as_mut_ptr() },
        numAttrs: attrs.len() as u32,
    };
    let params_ptr = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
    drv!(cuLaunchKernelEx(&cfg, f, params_ptr, std::ptr::null_mut()))
}

// ------------------------------------------------------------------------------------------------ graphs

/// Begins capturing the stream's work into a graph (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`, so that other
/// threads of the process — other ranks in thread mode — are not affected).
pub(crate) unsafe fn stream_begin_capture(s: CUstream) -> Result<()> {
    drv!(cuStreamBeginCapture_v2(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
}

pub(crate) unsafe fn stream_end_capture(s: CUstream) -> Result<CUgraph> {
    let mut g: CUgraph = std::ptr::null_mut();
    drv!(cuStreamEndCapture(s, &mut g))?;
    Ok(g)
}

pub(crate) unsafe fn graph_instantiate(g: CUgraph) -> Result<CUgraphExec> {
    let mut e: CUgraphExec = std::ptr::null_mut();
    drv!(cuGraphInstantiateWithFlags(&mut e, g, 0))?;
    Ok(e)
}

pub(crate) unsafe fn graph_launch(e: CUgraphExec, s: CUstream) -> Result<()> {
    drv!(cuGraphLaunch(e, s))
}

pub(crate) unsafe fn graph_destroy(g: CUgraph) -> Result<()> {
    drv!(cuGraphDestroy(g))
}

pub(crate) unsafe fn graph_exec_destroy(e: CUgraphExec) -> Result<()> {
    drv!(cuGraphExecDestroy(e))
}
