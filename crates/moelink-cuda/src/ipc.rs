//! CUDA IPC: sharing a device allocation with another process.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::raw::driver as drv;

/// The 64-byte handle `cuIpcGetMemHandle` returns for an allocation. Plain bytes: send it to the other
/// process any way you like.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

impl IpcMemHandle {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }

    /// Parses 64 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<IpcMemHandle> {
        let arr: [u8; 64] = bytes.try_into().map_err(|_| Error::invalid(format!("an IPC handle has 64 bytes, got {}", bytes.len())))?;
        Ok(IpcMemHandle(arr))
    }
}

/// Another process's allocation mapped into this process on `device` (`cuIpcOpenMemHandle`, peer access
/// enabled lazily). Unmapped on drop. The exporting process must keep the allocation alive meanwhile.
pub struct IpcMapping {
    device: Device,
    ptr: u64,
    len: usize,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcMapping(on GPU {}, {:#x}, {} bytes)", self.device.ordinal(), self.ptr, self.len)
    }
}

impl IpcMapping {
    /// Maps the allocation behind `handle` for kernels on `device`. Fails if it is smaller than
    /// `expected_len` bytes. Opening a handle exported by the *same* process fails (use the pointer).
    pub fn open(device: &Device, handle: &IpcMemHandle, expected_len: usize) -> Result<IpcMapping> {
        let _g = device.bind_scoped()?;
        // SAFETY: context current; the driver validates the handle; the mapping is closed once in Drop.
        let ptr = unsafe { drv::ipc_open_mem_handle(&handle.0)? };
        // SAFETY: `ptr` is the base of the mapping just opened.
        let size = match unsafe { drv::mem_get_address_range(ptr) } {
            Ok((_, size)) => size,
            Err(e) => {
                // SAFETY: close what we opened.
                let _ = unsafe { drv::ipc_close_mem_handle(ptr) };
                return Err(e);
            }
        };
        if size < expected_len {
            // SAFETY: close what we opened.
            let _ = unsafe { drv::ipc_close_mem_handle(ptr) };
            return Err(Error::invalid(format!("IPC allocation has {size} bytes, expected at least {expected_len}")));
        }
        Ok(IpcMapping { device: device.clone(), ptr, len: expected_len })
    }

    /// Address usable by kernels on the mapping device.
    pub fn device_ptr(&self) -> crate::DevPtr {
        crate::DevPtr::from_raw(self.ptr)
    }

    /// Bytes of the mapping the caller asked for.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The device the allocation is mapped on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: opened in `open`, closed once.
            let _ = unsafe { drv::ipc_close_mem_handle(self.ptr) };
        }
    }
}
