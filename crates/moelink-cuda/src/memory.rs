//! Device memory ([`DeviceBuffer`]) and page-locked host memory mapped into the device ([`HostMapped`]).

use std::ffi::c_void;
use std::marker::PhantomData;

use bytemuck::Pod;

use crate::device::{same_device, Device};
use crate::devptr::DevPtr;
use crate::error::{Error, Result};
use crate::raw::driver as drv;
use crate::stream::Stream;

fn check_range(what: &str, offset: usize, bytes: usize, len: usize) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::invalid(format!("{what}: bytes {offset}..{} out of a {len}-byte buffer", offset.saturating_add(bytes)))),
    }
}

/// Bytes of device memory the CUDA layer owns, borrowed mutably from their owner for `'a`: how the layers
/// above view that memory (as a tensor, say) without `unsafe`.
#[derive(Debug)]
pub struct DeviceSpanMut<'a> {
    addr: u64,
    len: usize,
    ordinal: usize,
    _borrow: std::marker::PhantomData<&'a mut [u8]>,
}

impl DeviceSpanMut<'_> {
    /// Device address of the first byte, as a number.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Device address of the first byte, for a kernel.
    pub fn dev_ptr(&self) -> DevPtr {
        DevPtr::from_raw(self.addr)
    }
    /// Device address of byte `offset` of the span (at most its length), for a kernel.
    pub fn ptr_at(&self, offset: usize) -> Result<DevPtr> {
        check_range("ptr_at", offset, 0, self.len)?;
        Ok(DevPtr::from_raw(self.addr + offset as u64))
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the span has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The GPU the memory is on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Sets every byte to `value`, ordered on `stream` (a stream of the span's GPU), as
    /// [`DeviceBuffer::memset_u8_async`] does for a whole buffer.
    pub fn memset_u8_async(&mut self, value: u8, stream: &Stream) -> Result<()> {
        self.check_stream("memset_u8_async", stream)?;
        // SAFETY: the span lies inside a live allocation that its owner lends for 'a (`span_of` checked the
        // range); the owner's drop orders its free after work that uses it, as for a DeviceBuffer.
        unsafe { stream.fill_d8(self.addr, value, self.len) }
    }

    /// Sets every 32-bit word to `value`, ordered on `stream` (the span must be 4-byte aligned and a
    /// multiple of 4 bytes long).
    pub fn memset_u32_async(&mut self, value: u32, stream: &Stream) -> Result<()> {
        self.check_stream("memset_u32_async", stream)?;
        if self.addr % 4 != 0 || self.len % 4 != 0 {
            return Err(Error::invalid(format!("memset_u32_async: {} bytes at {:#x} are not whole aligned words", self.len, self.addr)));
        }
        // SAFETY: as in `memset_u8_async`, and the range is whole aligned words.
        unsafe { stream.fill_d32(self.addr, value, self.len / 4) }
    }

    /// Copies bytes `[src_offset, src_offset + self.len())` of `src` into the span, ordered on `stream`.
    pub fn copy_from_device_async(&mut self, src: &DeviceBuffer, src_offset: usize, stream: &Stream) -> Result<()> {
        self.check_stream("copy_from_device_async", stream)?;
        check_range("copy_from_device_async source", src_offset, self.len, src.len_bytes())?;
        // SAFETY: the destination as in `memset_u8_async`; the source range lies inside `src`, checked above,
        // whose drop orders its free after the work that uses it.
        unsafe { stream.copy_dtod(self.addr, src.ptr + src_offset as u64, self.len) }
    }

    fn check_stream(&self, what: &str, stream: &Stream) -> Result<()> {
        if stream.device().ordinal() != self.ordinal {
            return Err(Error::invalid(format!("{what}: GPU {} memory with a GPU {} stream", self.ordinal, stream.device().ordinal())));
        }
        Ok(())
    }
}

/// `[offset, offset + bytes)` of an allocation of `len` bytes at `base` on GPU `ordinal`, checked.
pub(crate) fn span_of<'a>(what: &str, base: u64, len: usize, ordinal: usize, offset: usize, bytes: usize) -> Result<DeviceSpanMut<'a>> {
    check_range(what, offset, bytes, len)?;
    Ok(DeviceSpanMut { addr: base + offset as u64, len: bytes, ordinal, _borrow: std::marker::PhantomData })
}

/// Device memory owned by this value (`cuMemAlloc`), freed on drop. Holds its device, so the context
/// outlives the allocation.
///
/// Synchronous copies and memsets ([`DeviceBuffer::copy_to_host`], ...) run on a stream of their own and
/// are complete when they return; they are not ordered after work on other streams, so the caller finishes
/// the work whose results it reads first (every synchronous moelink operation has when it returns). They
/// do not wait for the whole device either: ranks that share a GPU share its context, and a copy that
/// waited for the device would wait for a peer's kernel that is waiting for this rank. The `_async`
/// variants are ordered on the given stream.
pub struct DeviceBuffer {
    device: Option<Device>,
    ptr: u64,
    len: usize,
    ordinal: usize,
    /// `cuMemAlloc` memory ([`DeviceBuffer::alloc_exportable`]), else memory of the device's pool.
    exportable: bool,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer(GPU {}, {:#x}, {} bytes)", self.ordinal, self.ptr, self.len)
    }
}

impl DeviceBuffer {
    /// Allocates `len_bytes` of device memory (uninitialised) from the device's memory pool, usable by any
    /// stream on return. A zero-length buffer has address 0.
    ///
    /// Pool memory is freed in stream order on drop, without waiting for the device: `cuMemFree` waits
    /// for every kernel of the context, and ranks that share a GPU share its context, so a rank freeing
    /// memory while a peer's kernel waits for it would wait for that kernel and the peer would time out.
    /// Drop a buffer only once no work uses it (every synchronous moelink operation has finished its
    /// kernels when it returns). Pool memory cannot be exported over IPC: see
    /// [`DeviceBuffer::alloc_exportable`].
    pub fn alloc(device: &Device, len_bytes: usize) -> Result<DeviceBuffer> {
        let ptr = if len_bytes == 0 {
            0
        } else {
            let stream = device.side_stream()?;
            let _g = device.bind_scoped()?;
            // SAFETY: context current, live stream; freed exactly once in Drop. The stream is synchronised
            // so that any stream may use the memory on return.
            let ptr = unsafe { drv::mem_alloc_async(len_bytes, stream.raw())? };
            stream.synchronize()?;
            ptr
        };
        Ok(DeviceBuffer { device: Some(device.clone()), ptr, len: len_bytes, ordinal: device.ordinal(), exportable: false })
    }

    /// Allocates `len_bytes` with `cuMemAlloc`, which [`DeviceBuffer::ipc_handle`] can export to other
    /// processes (the symmetric buffer). Its drop waits for every kernel on the device.
    pub fn alloc_exportable(device: &Device, len_bytes: usize) -> Result<DeviceBuffer> {
        let ptr = if len_bytes == 0 {
            0
        } else {
            let _g = device.bind_scoped()?;
            // SAFETY: context current; the allocation is freed exactly once in Drop.
            unsafe { drv::mem_alloc(len_bytes)? }
        };
        Ok(DeviceBuffer { device: Some(device.clone()), ptr, len: len_bytes, ordinal: device.ordinal(), exportable: true })
    }

    /// Allocates `len_bytes` filled with zeros (completed before returning).
    pub fn zeroed(device: &Device, len_bytes: usize) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(device, len_bytes)?;
        b.memset_u8(0)?;
        Ok(b)
    }

    /// Allocates a buffer holding a copy of `data`.
    pub fn from_host(device: &Device, data: &[u8]) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(device, data.len())?;
        b.copy_from_host(0, data)?;
        Ok(b)
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Device address of the first byte (null for a zero-length buffer), for a kernel.
    pub fn device_ptr(&self) -> DevPtr {
        DevPtr::from_raw(self.ptr)
    }

    /// Device address of byte `offset` (at most the length: one past the end is an address too), for a
    /// kernel.
    pub fn ptr_at(&self, offset: usize) -> Result<DevPtr> {
        check_range("ptr_at", offset, 0, self.len)?;
        Ok(DevPtr::from_raw(self.ptr + offset as u64))
    }

    /// Ordinal of the device holding the memory.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device holding the memory.
    pub fn device(&self) -> &Device {
        self.device.as_ref().expect("a DeviceBuffer always holds its device until dropped")
    }

    /// Copies the first `dst.len()` bytes of the buffer into `dst` (at most [`len_bytes`](Self::len_bytes)).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.copy_to_host_at(0, dst)
    }

    /// Copies `dst.len()` bytes starting at byte `offset` into `dst`.
    pub fn copy_to_host_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("copy_to_host_at", offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        let stream = self.device().side_stream()?;
        // SAFETY: `dst` is neither dropped nor read before the stream has run the copy (synchronised here).
        unsafe { self.copy_to_host_async(offset, dst, &stream)? };
        stream.synchronize()
    }

    /// Copies `src` into the buffer at byte `offset`; returns when the data is in device memory.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let stream = self.device().side_stream()?;
        // SAFETY: `src` outlives the copy (synchronised here). Waiting for the stream also covers pageable
        // memory, where the call can return once the data is staged, before it is in device memory (a
        // copy-engine read right after it would see stale bytes).
        unsafe { self.copy_from_host_async(offset, src, &stream)? };
        stream.synchronize()
    }

    /// Copies `bytes` from `src[src_offset..]` into `self[dst_offset..]` (same or peer device); returns when the
    /// copy is done.
    pub fn copy_from_device(&mut self, dst_offset: usize, src: &DeviceBuffer, src_offset: usize, bytes: usize) -> Result<()> {
        let stream = self.device().side_stream()?;
        self.copy_from_device_async(dst_offset, src, src_offset, bytes, &stream)?;
        stream.synchronize()
    }

    /// Stream-ordered version of [`copy_from_device`](Self::copy_from_device).
    pub fn copy_from_device_async(
        &mut self,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        bytes: usize,
        stream: &Stream,
    ) -> Result<()> {
        check_range("copy_from_device_async (destination)", dst_offset, bytes, self.len)?;
        check_range("copy_from_device_async (source)", src_offset, bytes, src.len)?;
        same_device("copy_from_device_async", self.device(), stream.device())?;
        // SAFETY: both ranges are inside live allocations (checked). cuMemFree synchronises, so neither
        // allocation can disappear under the pending copy.
        unsafe { stream.copy_dtod(self.ptr + dst_offset as u64, src.ptr + src_offset as u64, bytes) }
    }

    /// Stream-ordered host → device copy of `src` into the buffer at `offset`.
    ///
    /// # Safety
    /// `src` must stay alive and unmodified until the stream has executed the copy. (For pageable memory
    /// the driver stages the copy and returns late; for page-locked memory it returns at once.)
    pub unsafe fn copy_from_host_async(&mut self, offset: usize, src: &[u8], stream: &Stream) -> Result<()> {
        check_range("copy_from_host_async", offset, src.len(), self.len)?;
        same_device("copy_from_host_async", self.device(), stream.device())?;
        if src.is_empty() {
            return Ok(());
        }
        let _g = self.device().bind_scoped()?;
        drv::memcpy_htod_async(self.ptr + offset as u64, src.as_ptr(), src.len(), stream.raw())
    }

    /// Stream-ordered device → host copy from `offset` into `dst`.
    ///
    /// # Safety
    /// `dst` must stay alive and must not be read until the stream has executed the copy.
    pub unsafe fn copy_to_host_async(&self, offset: usize, dst: &mut [u8], stream: &Stream) -> Result<()> {
        check_range("copy_to_host_async", offset, dst.len(), self.len)?;
        same_device("copy_to_host_async", self.device(), stream.device())?;
        if dst.is_empty() {
            return Ok(());
        }
        let _g = self.device().bind_scoped()?;
        drv::memcpy_dtoh_async(dst.as_mut_ptr(), self.ptr + offset as u64, dst.len(), stream.raw())
    }

    /// Bytes `[offset, offset + bytes)` of the buffer, borrowed mutably.
    pub fn span_mut(&mut self, offset: usize, bytes: usize) -> Result<DeviceSpanMut<'_>> {
        span_of("span_mut", self.ptr, self.len, self.ordinal, offset, bytes)
    }

    /// Host → device copy of `src` into the buffer at `offset`, ordered after `stream`'s earlier work and
    /// complete on return (the stream is synchronised).
    pub fn copy_from_host_on(&mut self, offset: usize, src: &[u8], stream: &Stream) -> Result<()> {
        // SAFETY: `src` is borrowed until the stream, synchronised below, has executed the copy.
        unsafe { self.copy_from_host_async(offset, src, stream)? };
        stream.synchronize()
    }

    /// Device → host copy from `offset` into `dst`, ordered after `stream`'s earlier work and complete on
    /// return (the stream is synchronised).
    pub fn copy_to_host_on(&self, offset: usize, dst: &mut [u8], stream: &Stream) -> Result<()> {
        // SAFETY: `dst` is borrowed until the stream, synchronised below, has executed the copy.
        unsafe { self.copy_to_host_async(offset, dst, stream)? };
        stream.synchronize()
    }

    /// Sets every byte to `value` (completed before returning).
    pub fn memset_u8(&mut self, value: u8) -> Result<()> {
        let stream = self.device().side_stream()?;
        self.memset_u8_async(value, &stream)?;
        stream.synchronize()
    }

    /// Sets every 32-bit word to `value` (the length must be a multiple of 4; completed before returning).
    pub fn memset_u32(&mut self, value: u32) -> Result<()> {
        if self.len % 4 != 0 {
            return Err(Error::invalid(format!("memset_u32 on a {}-byte buffer (not a multiple of 4)", self.len)));
        }
        let stream = self.device().side_stream()?;
        self.memset_u32_async(value, &stream)?;
        stream.synchronize()
    }

    /// Stream-ordered [`memset_u8`](Self::memset_u8).
    pub fn memset_u8_async(&mut self, value: u8, stream: &Stream) -> Result<()> {
        same_device("memset_u8_async", self.device(), stream.device())?;
        // SAFETY: the whole live allocation.
        unsafe { stream.fill_d8(self.ptr, value, self.len) }
    }

    /// Stream-ordered [`memset_u32`](Self::memset_u32).
    pub fn memset_u32_async(&mut self, value: u32, stream: &Stream) -> Result<()> {
        same_device("memset_u32_async", self.device(), stream.device())?;
        if self.len % 4 != 0 {
            return Err(Error::invalid(format!("memset_u32_async on a {}-byte buffer (not a multiple of 4)", self.len)));
        }
        // SAFETY: the whole live allocation, word-sized.
        unsafe { stream.fill_d32(self.ptr, value, self.len / 4) }
    }

    /// Exports the allocation for another process ([`crate::IpcMapping::open`]).
    pub fn ipc_handle(&self) -> Result<crate::ipc::IpcMemHandle> {
        if self.len == 0 {
            return Err(Error::invalid("cannot export a zero-length buffer over IPC"));
        }
        if !self.exportable {
            return Err(Error::invalid("cannot export pool memory over IPC: allocate with DeviceBuffer::alloc_exportable"));
        }
        let _g = self.device().bind_scoped()?;
        // SAFETY: the pointer is the base of a live cuMemAlloc allocation.
        let bytes = unsafe { drv::ipc_get_mem_handle(self.ptr)? };
        Ok(crate::ipc::IpcMemHandle(bytes))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(device) = self.device.take() {
            if self.ptr != 0 {
                if self.exportable {
                    if let Ok(_g) = device.bind_scoped() {
                        // SAFETY: we allocated the memory and free it once; cuMemFree waits for pending work
                        // that uses it.
                        let _ = unsafe { drv::mem_free(self.ptr) };
                    }
                } else if let Ok(stream) = device.side_stream() {
                    if let Ok(_g) = device.bind_scoped() {
                        // SAFETY: pool memory we allocated, freed once; no work uses it any more (the
                        // contract of `alloc`), so the free needs no ordering after other streams.
                        let _ = unsafe { drv::mem_free_async(self.ptr, stream.raw()) };
                    }
                }
            }
        }
    }
}

/// Page-locked host memory holding `len` values of `T`, mapped into every device's address space. The device
/// writes it with plain (system-scope) stores; the host reads it with volatile loads, so a value written by
/// a running kernel is seen without a copy — moelink uses it for receive counts and error records.
pub struct HostMapped<T: Pod> {
    device: Device,
    host: *mut T,
    device_ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

// SAFETY: the memory is owned by this value; access goes through volatile reads/writes of Pod values, which
// cannot create invalid values whatever the device writes concurrently.
unsafe impl<T: Pod> Send for HostMapped<T> {}
// SAFETY: as above; `&self` methods only perform volatile reads.
unsafe impl<T: Pod> Sync for HostMapped<T> {}

impl<T: Pod> std::fmt::Debug for HostMapped<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMapped({} x {} B, device {:#x})", self.len, std::mem::size_of::<T>(), self.device_ptr)
    }
}

impl<T: Pod> HostMapped<T> {
    /// Allocates `len` zeroed values, mapped for `device` (and, being portable, every other device).
    pub fn new(device: &Device, len: usize) -> Result<HostMapped<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| Error::invalid("HostMapped size overflows"))?.max(1);
        let _g = device.bind_scoped()?;
        // SAFETY: context current; the allocation is freed once in Drop; it is zeroed before anyone reads it
        // (zero is a valid Pod value); the device pointer lookup is for this fresh allocation.
        let (host, device_ptr) = unsafe {
            let p = drv::mem_host_alloc_mapped(bytes)?;
            std::ptr::write_bytes(p as *mut u8, 0, bytes);
            match drv::mem_host_get_device_pointer(p) {
                Ok(d) => (p as *mut T, d),
                Err(e) => {
                    let _ = drv::mem_free_host(p);
                    return Err(e);
                }
            }
        };
        Ok(HostMapped { device: device.clone(), host, device_ptr, len, _t: PhantomData })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address kernels use.
    pub fn device_ptr(&self) -> DevPtr {
        DevPtr::from_raw(self.device_ptr)
    }

    /// Reads value `i` with a volatile load (sees concurrent device writes), followed by an acquire fence:
    /// when the device published the value with a release store, later reads see what it wrote before.
    /// A multi-word `T` is not read atomically; read the word the device publishes last first.
    pub fn read(&self, i: usize) -> T {
        assert!(i < self.len, "HostMapped::read({i}) out of {} values", self.len);
        // SAFETY: in bounds; the memory is live and properly aligned (page-locked allocations are page
        // aligned and T's stride keeps alignment); any bit pattern is a valid Pod.
        let v = unsafe { std::ptr::read_volatile(self.host.add(i)) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        v
    }

    /// Writes value `i` with a volatile store.
    pub fn write(&mut self, i: usize, value: T) {
        assert!(i < self.len, "HostMapped::write({i}) out of {} values", self.len);
        // SAFETY: in bounds, live, aligned; exclusive access through `&mut self` on the host side.
        unsafe { std::ptr::write_volatile(self.host.add(i), value) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    }

    /// Volatile copy of all values.
    pub fn read_all(&self) -> Vec<T> {
        (0..self.len).map(|i| self.read(i)).collect()
    }

    /// Sets every value to zero.
    pub fn clear(&mut self) {
        for i in 0..self.len {
            self.write(i, T::zeroed());
        }
    }
}

impl<T: Pod> Drop for HostMapped<T> {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            let _ = unsafe { drv::mem_free_host(self.host as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_stay_inside_their_allocation() {
        let s = span_of("t", 0x1000, 256, 3, 16, 32).unwrap();
        assert_eq!((s.addr(), s.len(), s.ordinal()), (0x1010, 32, 3));
        assert!(span_of("t", 0x1000, 256, 0, 250, 7).is_err());
        assert!(span_of("t", 0x1000, 256, 0, usize::MAX, 2).is_err());
        assert!(span_of("t", 0x1000, 256, 0, 256, 0).unwrap().is_empty());
    }
}
