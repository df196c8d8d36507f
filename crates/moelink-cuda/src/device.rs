//! Devices and their primary contexts.

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::raw::driver::{self as drv, CUcontext, CUdevice, DeviceAttr};

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Driver ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// As nvidia-smi names it, e.g. "NVIDIA H200".
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` on Hopper.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
    /// Device memory, bytes.
    pub total_memory_bytes: usize,
    /// Largest dynamic shared memory a block may opt into, bytes (232448 on H100/H200).
    pub max_shared_memory_per_block_optin: usize,
    /// PCI bus id, e.g. `0000:00:06.0`.
    pub pci_bus_id: String,
    /// L2 cache, bytes.
    pub l2_cache_bytes: usize,
    /// Most threads one block may have.
    pub max_threads_per_block: usize,
    /// Cooperative launches are supported.
    pub cooperative_launch: bool,
    /// Contexts on this device are clients of a CUDA MPS server (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`).
    pub mps_enabled: bool,
    /// Hardware work queues a context gets: the driver's `CUDA_DEVICE_MAX_CONNECTIONS`, read as the driver
    /// reads it when it creates the context (8 when unset). Streams beyond them share queues, and a kernel
    /// waits for the one ahead of it in its queue.
    pub max_connections: usize,
}

impl DeviceInfo {
    /// Queries the driver without creating a context.
    pub(crate) fn query(ordinal: usize) -> Result<DeviceInfo> {
        drv::ensure_loaded()?;
        // SAFETY: the driver is loaded; `dev` comes from cuDeviceGet for an ordinal the driver accepted.
        unsafe {
            let dev = drv::device_get(ordinal)?;
            let attr = |a| drv::device_attribute(dev, a);
            Ok(DeviceInfo {
                ordinal,
                name: drv::device_name(dev)?,
                compute_capability: (attr(DeviceAttr::ComputeCapabilityMajor)?, attr(DeviceAttr::ComputeCapabilityMinor)?),
                multiprocessors: attr(DeviceAttr::MultiprocessorCount)? as usize,
                total_memory_bytes: drv::device_total_mem(dev)?,
                max_shared_memory_per_block_optin: attr(DeviceAttr::MaxSharedMemoryPerBlockOptin)? as usize,
                pci_bus_id: drv::device_pci_bus_id(dev)?,
                l2_cache_bytes: attr(DeviceAttr::L2CacheSize)? as usize,
                max_threads_per_block: attr(DeviceAttr::MaxThreadsPerBlock)? as usize,
                cooperative_launch: attr(DeviceAttr::CooperativeLaunch)? != 0,
                // Older drivers do not know the attribute: no MPS as far as moelink can tell.
                mps_enabled: attr(DeviceAttr::MpsEnabled).unwrap_or(0) != 0,
                max_connections: std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .map_or(8, |n| n.clamp(1, 32)),
            })
        }
    }

    /// The NVRTC target for this device: `sm_90a` on Hopper (arch-specific features such as `setmaxnreg`),
    /// `sm_XY` before it.
    pub fn arch(&self) -> String {
        crate::jit::arch_for(self.compute_capability)
    }
}

pub(crate) struct DeviceInner {
    pub(crate) ordinal: usize,
    pub(crate) cu_device: CUdevice,
    pub(crate) ctx: CUcontext,
    pub(crate) info: DeviceInfo,
    /// The stream of this handle's synchronous helpers ([`Device::side_stream`]), created on first use.
    side_stream: Mutex<Option<SideStream>>,
}

/// A stream handle owned by [`DeviceInner`] (destroyed before the context is released).
struct SideStream(crate::raw::driver::CUstream);
// SAFETY: a CUstream handle may be used from any thread; the driver serialises submissions.
unsafe impl Send for SideStream {}

// SAFETY: a CUcontext is a driver handle that may be used from any thread (the driver serialises what needs
// it); DeviceInner never hands out the raw pointer mutably.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; all methods take &self and only pass the handle to thread-safe driver calls.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        let side = self.side_stream.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(SideStream(raw)) = side {
            // SAFETY: the stream was created in this context and is destroyed once, with the context current
            // (the thread's previous context restored after); pending work still completes.
            unsafe {
                if let Ok(prev) = drv::ctx_get_current() {
                    if drv::ctx_set_current(self.ctx).is_ok() {
                        let _ = drv::stream_destroy(raw);
                        let _ = drv::ctx_set_current(prev);
                    }
                }
            }
        }
        // SAFETY: the primary context was retained once in Device::new; this is the matching release.
        let _ = unsafe { drv::primary_ctx_release(self.cu_device) };
    }
}

/// A GPU with its retained primary context (the one the CUDA runtime and torch use). Cheap to clone;
/// every resource created on a device holds a clone, so the context outlives them.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({} {})", self.inner.ordinal, self.inner.info.name)
    }
}

/// Restores the thread's previous context when dropped.
pub(crate) struct CtxGuard {
    prev: Option<CUcontext>,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: `prev` was current on this thread before the guard; setting it back (even to null) is
            // what the thread had.
            let _ = unsafe { drv::ctx_set_current(prev) };
        }
    }
}

impl Device {
    /// Number of devices the driver sees.
    pub fn count() -> Result<usize> {
        drv::ensure_loaded()?;
        // SAFETY: driver loaded.
        unsafe { drv::device_count() }
    }

    /// Retains the primary context of device `ordinal` and reads its properties.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let info = DeviceInfo::query(ordinal)?;
        // SAFETY: driver loaded; the ordinal is in range; the retained context is released in Drop.
        let (cu_device, ctx) = unsafe {
            let dev = drv::device_get(ordinal)?;
            (dev, drv::primary_ctx_retain(dev)?)
        };
        Ok(Device { inner: Arc::new(DeviceInner { ordinal, cu_device, ctx, info, side_stream: Mutex::new(None) }) })
    }

    /// Driver ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Properties read at creation.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Makes this device's primary context current on the calling thread (and leaves it there).
    pub fn bind_to_thread(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as `self` lives.
        unsafe { drv::ctx_set_current(self.inner.ctx) }
    }

    /// Makes the context current for the guard's lifetime, restoring the caller's afterwards (torch keeps
    /// its own current device; moelink must not change it behind its back).
    pub(crate) fn bind_scoped(&self) -> Result<CtxGuard> {
        // SAFETY: querying and setting the current context only needs the driver loaded, which holds since a
        // Device exists; the context is retained while `self` lives.
        unsafe {
            let prev = drv::ctx_get_current()?;
            if prev == self.inner.ctx {
                return Ok(CtxGuard { prev: None });
            }
            drv::ctx_set_current(self.inner.ctx)?;
            Ok(CtxGuard { prev: Some(prev) })
        }
    }

    /// The stream this handle's synchronous copies, memsets, pool allocations and frees run on (each waits
    /// for its own work only). One per handle, made once: ranks of a process that share a GPU share its
    /// hardware queues, and a stream made per call would sooner or later land in the queue of a peer's
    /// kernel that waits for this rank. Clones of a [`Device`] share it; [`Device::new`] makes another.
    pub(crate) fn side_stream(&self) -> Result<crate::stream::Stream> {
        let mut side = self.inner.side_stream.lock().unwrap_or_else(|e| e.into_inner());
        let raw = match side.as_ref() {
            Some(s) => s.0,
            None => {
                let _g = self.bind_scoped()?;
                // SAFETY: the context is current; DeviceInner destroys the stream before releasing it.
                let raw = unsafe { drv::stream_create_non_blocking()? };
                *side = Some(SideStream(raw));
                raw
            }
        };
        // SAFETY: the stream lives as long as `self.inner`, which the returned value holds (a Device clone).
        Ok(unsafe { crate::stream::Stream::borrow_raw(self, raw as usize as u64) })
    }

    /// SMs this process's kernels may run on: the device's, or fewer under CUDA MPS with an active-thread
    /// percentage (the context's execution affinity). Ranks that share the GPU divide this, not the device's.
    pub fn available_sms(&self) -> usize {
        let all = self.inner.info.multiprocessors;
        let Ok(_g) = self.bind_scoped() else { return all };
        // SAFETY: the device's context is current; the call only reads its affinity.
        match unsafe { drv::ctx_exec_affinity_sm_count() } {
            Some(n) if n > 0 && (n as usize) < all => n as usize,
            _ => all,
        }
    }

    /// Waits until all work on this device has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.bind_scoped()?;
        // SAFETY: the device's context is current.
        unsafe { drv::ctx_synchronize() }
    }

    /// `(free, total)` device memory, bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        let _g = self.bind_scoped()?;
        // SAFETY: the device's context is current.
        unsafe { drv::mem_get_info() }
    }

    /// Whether this device can map `peer`'s memory (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer.ordinal() == self.ordinal() {
            return Ok(true);
        }
        // SAFETY: both device handles come from cuDeviceGet.
        unsafe { drv::device_can_access_peer(self.inner.cu_device, peer.inner.cu_device) }
    }

    /// Lets kernels on this device read and write `peer`'s memory through plain pointers. Idempotent.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        if !self.can_access_peer(peer)? {
            return Err(Error::invalid(format!(
                "GPU {} cannot access GPU {}'s memory (cuDeviceCanAccessPeer = 0: no NVLink/P2P path between them)",
                self.ordinal(),
                peer.ordinal()
            )));
        }
        let _g = self.bind_scoped()?;
        // SAFETY: this device's context is current; the peer context is retained by `peer`.
        unsafe { drv::ctx_enable_peer_access(peer.inner.ctx) }
    }

    pub(crate) fn same_as(&self, other: &Device) -> bool {
        self.ordinal() == other.ordinal()
    }
}

/// Ensures that `a` and `b` belong to the same device.
pub(crate) fn same_device(what: &str, a: &Device, b: &Device) -> Result<()> {
    if a.same_as(b) {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what}: GPU {} resource used with a GPU {} stream", a.ordinal(), b.ordinal())))
    }
}
