//! Memory that Rust did not allocate, lent by its owner for `'a`: a torch tensor's storage, another engine's
//! device allocation, a host array. [`MemRef::from_raw`] and [`MemMut::from_raw`] are the one door through
//! which such memory enters; everything above builds its views on these types without `unsafe`.

use std::marker::PhantomData;

use crate::devptr::DevPtr;
use crate::error::{Error, Result};
use crate::memory::{span_of, DeviceBuffer, DeviceSpanMut};

/// Where lent memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Place {
    /// Host (CPU) memory.
    Host,
    /// Device memory of GPU `ordinal`.
    Device(usize),
}

/// What both lent types say about their bytes.
macro_rules! accessors {
    () => {
        /// Address of the first byte (host or device).
        pub fn addr(&self) -> u64 {
            self.addr
        }
        /// Bytes.
        pub fn len(&self) -> usize {
            self.len
        }
        /// Whether there are no bytes.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }
        /// Where the bytes live.
        pub fn place(&self) -> Place {
            self.place
        }
        /// Address of the first byte for a kernel, when the bytes live on a GPU.
        pub fn dev_ptr(&self) -> Option<DevPtr> {
            matches!(self.place, Place::Device(_)).then(|| DevPtr::from_raw(self.addr))
        }
    };
}

/// `len` readable bytes at `addr`, lent for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct MemRef<'a> {
    addr: u64,
    len: usize,
    place: Place,
    _borrow: PhantomData<&'a [u8]>,
}

/// `len` bytes at `addr` that only this value reads or writes for `'a`.
#[derive(Debug)]
pub struct MemMut<'a> {
    addr: u64,
    len: usize,
    place: Place,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> MemRef<'a> {
    /// Memory owned elsewhere.
    ///
    /// # Safety
    /// `len` bytes at `addr` (host memory, or device memory of the GPU `place` names) must stay valid and
    /// unwritten by anyone else for `'a`; for device memory, until the stream work that reads them has
    /// completed.
    pub unsafe fn from_raw(addr: u64, len: usize, place: Place) -> MemRef<'a> {
        MemRef { addr, len, place, _borrow: PhantomData }
    }

    /// A host slice.
    pub fn host(bytes: &'a [u8]) -> MemRef<'a> {
        MemRef { addr: bytes.as_ptr() as u64, len: bytes.len(), place: Place::Host, _borrow: PhantomData }
    }

    /// The whole of a device allocation of the CUDA layer.
    pub fn device(buffer: &'a DeviceBuffer) -> MemRef<'a> {
        MemRef {
            addr: buffer.device_ptr().addr(),
            len: buffer.len_bytes(),
            place: Place::Device(buffer.device_ordinal()),
            _borrow: PhantomData,
        }
    }

    accessors!();

    /// The bytes, when they live on the host.
    pub fn host_bytes(&self) -> Option<&'a [u8]> {
        if self.place != Place::Host {
            return None;
        }
        if self.len == 0 {
            return Some(&[]);
        }
        // SAFETY: host memory lent for 'a and unwritten by others: a borrowed slice (`host`) or the contract
        // of `from_raw`.
        Some(unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) })
    }
}

impl<'a> MemMut<'a> {
    /// Memory owned elsewhere, lent exclusively.
    ///
    /// # Safety
    /// As [`MemRef::from_raw`], and nobody else reads or writes the bytes for `'a`.
    pub unsafe fn from_raw(addr: u64, len: usize, place: Place) -> MemMut<'a> {
        MemMut { addr, len, place, _borrow: PhantomData }
    }

    /// A host slice.
    pub fn host(bytes: &'a mut [u8]) -> MemMut<'a> {
        MemMut { addr: bytes.as_mut_ptr() as u64, len: bytes.len(), place: Place::Host, _borrow: PhantomData }
    }

    /// The whole of a device allocation of the CUDA layer.
    pub fn device(buffer: &'a mut DeviceBuffer) -> MemMut<'a> {
        MemMut {
            addr: buffer.device_ptr().addr(),
            len: buffer.len_bytes(),
            place: Place::Device(buffer.device_ordinal()),
            _borrow: PhantomData,
        }
    }

    accessors!();

    /// Read-only reborrow.
    pub fn as_ref(&self) -> MemRef<'_> {
        MemRef { addr: self.addr, len: self.len, place: self.place, _borrow: PhantomData }
    }

    /// Writable reborrow.
    pub fn reborrow(&mut self) -> MemMut<'_> {
        MemMut { addr: self.addr, len: self.len, place: self.place, _borrow: PhantomData }
    }

    /// The bytes, when they live on the host.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.place != Place::Host {
            return None;
        }
        if self.len == 0 {
            return Some(&mut []);
        }
        // SAFETY: host memory lent exclusively for 'a (a borrowed slice, or the contract of `from_raw`); the
        // slice borrows `self` mutably, so it is the only one.
        Some(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) })
    }

    /// Bytes `[offset, offset + bytes)`, when they live on a GPU: what stream-ordered fills and copies take.
    pub fn device_span_mut(&mut self, offset: usize, bytes: usize) -> Result<DeviceSpanMut<'_>> {
        match self.place {
            Place::Device(ordinal) => span_of("device_span_mut", self.addr, self.len, ordinal, offset, bytes),
            Place::Host => Err(Error::invalid("device_span_mut: the memory is on the host".to_string())),
        }
    }
}

impl<'a> From<DeviceSpanMut<'a>> for MemMut<'a> {
    fn from(span: DeviceSpanMut<'a>) -> MemMut<'a> {
        MemMut { addr: span.addr(), len: span.len(), place: Place::Device(span.ordinal()), _borrow: PhantomData }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_reads_back_and_device_memory_does_not() {
        let mut bytes = [1u8, 2, 3, 4];
        let mut m = MemMut::host(&mut bytes);
        m.host_bytes_mut().unwrap()[0] = 9;
        assert_eq!(m.as_ref().host_bytes(), Some(&[9u8, 2, 3, 4][..]));
        assert!(m.device_span_mut(0, 4).is_err());
        // SAFETY: never read through: a device address only carried and checked.
        let mut d = unsafe { MemMut::from_raw(0x1000, 64, Place::Device(0)) };
        assert!(d.as_ref().host_bytes().is_none());
        assert_eq!(d.device_span_mut(16, 48).unwrap().addr(), 0x1010);
        assert!(d.device_span_mut(16, 49).is_err());
    }
}
