//! # moelink-cuda
//!
//! moelink's CUDA layer and the only crate of the workspace with `unsafe` CUDA code. Layered like cudarc:
//!
//! - `raw` (private): every call into `cudarc::driver::sys` / `cudarc::nvrtc::sys`, as thin `unsafe`
//!   functions returning [`Result`]; errors name the call and the status ([`Error::Driver`]).
//! - safe RAII types: [`Device`] (primary context), [`Stream`], [`Event`], [`DeviceBuffer`],
//!   [`HostMapped`], [`IpcMapping`], [`Module`]/[`Kernel`] (launch through `cuLaunchKernelEx`),
//!   [`Graph`]/[`GraphExec`], and [`SymmetricBuffer`] (one buffer per rank, every rank's pointer on every
//!   rank).
//! - [`DevPtr`]: a device address only this crate makes, from memory it allocated, mapped or was lent; the
//!   argument structs of kernels hold these, and [`KernelParams`] + [`Kernel::typed`] make a launch safe
//!   ([`TypedKernel::launch`]).
//! - [`MemRef`]/[`MemMut`]: memory that Rust did not allocate (torch tensors, host arrays), lent for a lifetime;
//!   their `from_raw` constructors are the one `unsafe` door for it, as [`ForeignStream::from_raw`] is for streams.
//! - [`jit`]: NVRTC → CUBIN with disk and memory caches (and nvJitLink for kernels that link a device
//!   library).
//! - [`Nvshmem`]: the internode transport's engine, loaded only when an internode buffer asks for it.
//!
//! Libraries are loaded at run time. Nothing here panics when they are missing: the driver is checked
//! before its first call ([`Error::NoDriver`]) and so is NVRTC ([`Error::NvrtcNotFound`]).
//!
//! ```
//! // On a machine without a GPU this is an error, not a panic.
//! match moelink_cuda::system_info() {
//!     Ok(info) => println!("{} GPU(s), driver {}", info.devices.len(), info.driver_version),
//!     Err(e) => println!("no CUDA here: {e}"),
//! }
//! ```

#![warn(missing_docs)]

mod device;
mod devptr;
mod error;
mod graph;
mod ipc;
pub mod jit;
mod lent;
mod memory;
mod module;
mod nvshmem;
mod raw;
mod stream;
mod symmetric;

pub use device::{Device, DeviceInfo};
pub use devptr::{DevPtr, DevPtrs};
pub use error::{Error, Result};
pub use graph::{Graph, GraphExec};
pub use ipc::{IpcMapping, IpcMemHandle};
pub use lent::{MemMut, MemRef, Place};
pub use memory::{DeviceBuffer, DeviceSpanMut, HostMapped};
pub use module::{launch_timing, Kernel, KernelArgs, KernelAttributes, KernelParams, LaunchConfig, Module, TypedKernel};
pub use nvshmem::{Nvshmem, NvshmemHeap, NvshmemToolchain, NvshmemVersion};
pub use stream::{Event, ForeignStream, Stream};
pub use symmetric::{AllGather, Exchange, PeerAccess, SymmetricBuffer};

/// Re-export of the traits kernel arguments ([`NoUninit`]) and host-mapped values ([`Pod`]) implement.
pub use bytemuck::{NoUninit, Pod, Zeroable};

/// What the CUDA layer found on this machine.
#[derive(Clone, Debug)]
pub struct SystemInfo {
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: i32,
    /// Every device the driver sees.
    pub devices: Vec<DeviceInfo>,
    /// `[i][j]`: device i can access device j's memory.
    pub peer_access: Vec<Vec<bool>>,
    /// NVRTC (major, minor), or why it is unavailable.
    pub nvrtc: Result<(i32, i32), String>,
}

/// Probes the driver, the devices and NVRTC without creating contexts. Errors only when the driver cannot
/// be used (none installed, no device, too old).
pub fn system_info() -> Result<SystemInfo> {
    raw::driver::ensure_loaded()?;
    // SAFETY: the driver is loaded and initialised (ensure_loaded returned Ok).
    let driver_version = unsafe { raw::driver::driver_version()? };
    let n = Device::count()?;
    let devices = (0..n).map(DeviceInfo::query).collect::<Result<Vec<_>>>()?;
    let mut peer_access = vec![vec![false; n]; n];
    for (i, row) in peer_access.iter_mut().enumerate() {
        for (j, cell) in row.iter_mut().enumerate() {
            // SAFETY: both ordinals are below the device count; cuDeviceGet/CanAccessPeer need no context.
            *cell = i == j || unsafe { raw::driver::device_can_access_peer(raw::driver::device_get(i)?, raw::driver::device_get(j)?)? };
        }
    }
    let nvrtc = jit::nvrtc_version().map_err(|e| e.to_string());
    Ok(SystemInfo { driver_version, devices, peer_access, nvrtc })
}

/// Loads the driver (once) and reports whether CUDA is usable, without panicking.
pub fn driver_available() -> Result<()> {
    raw::driver::ensure_loaded()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without an NVIDIA driver (CI, this dev box) every entry point returns a typed error.
    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        let Err(e) = driver_available() else {
            eprintln!("a CUDA driver is present; this test checks the driverless path only");
            return;
        };
        assert!(e.is_unavailable(), "{e:?}");
        let msg = system_info().unwrap_err().to_string();
        assert!(msg.contains("no CUDA") || msg.contains("driver"), "{msg}");
        assert!(matches!(Device::new(0), Err(ref e) if e.is_unavailable()));
        assert!(matches!(Device::count(), Err(ref e) if e.is_unavailable()));
    }

    #[test]
    fn missing_nvrtc_is_an_error_not_a_panic() {
        match jit::nvrtc_version() {
            Ok(v) => eprintln!("NVRTC {v:?} is present; the missing-library path is not exercised here"),
            Err(e) => {
                assert!(matches!(e, Error::NvrtcNotFound(_)), "{e:?}");
                assert!(e.to_string().contains("LD_LIBRARY_PATH"));
                let req = jit::CompileRequest::new("k.cu", "extern \"C\" __global__ void k() {}", "sm_90a");
                assert!(matches!(jit::JitCache::new(None).compile(&req), Err(Error::NvrtcNotFound(_))));
            }
        }
    }

    #[test]
    fn error_messages_name_the_call_and_status() {
        let e =
            Error::Driver { call: "cuMemAlloc_v2", code: 2, name: "CUDA_ERROR_OUT_OF_MEMORY".into(), description: "out of memory".into() };
        assert_eq!(e.to_string(), "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
        assert_eq!(e.driver_status(), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert!(!e.is_unavailable());
    }

    #[test]
    fn kernel_args_pack_pod_values() {
        #[repr(C)]
        #[derive(Clone, Copy, Pod, Zeroable)]
        struct S {
            a: [u64; 3],
            b: u32,
            c: u32,
        }
        let s = S { a: [1, 2, 3], b: 4, c: 5 };
        let args = KernelArgs::new().arg(7u64).arg(s).arg(1.5f32);
        assert_eq!(args.len(), 3);
        assert_eq!(args.bytes(0).unwrap(), &7u64.to_le_bytes());
        assert_eq!(args.bytes(1).unwrap(), bytemuck::bytes_of(&s));
        assert_eq!(args.bytes(2).unwrap(), &1.5f32.to_le_bytes());
        assert!(args.bytes(3).is_none());
    }
}
