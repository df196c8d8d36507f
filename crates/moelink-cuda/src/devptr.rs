//! Device addresses as kernels take them: [`DevPtr`], and [`DevPtrs`] for a table of them.
//!
//! A `DevPtr` is made only here, in the CUDA layer, from memory the layer allocated, mapped or was lent
//! (a [`crate::DeviceBuffer`], a [`crate::DeviceSpanMut`], a [`crate::MemRef`]/[`crate::MemMut`] of device
//! memory, a peer's buffer of a [`crate::SymmetricBuffer`], an [`crate::IpcMapping`], a
//! [`crate::HostMapped`] array, the NVSHMEM heap), or as [`DevPtr::NULL`]. It is not `Pod`: code above this
//! crate cannot turn bytes or integers into one, so every address in a kernel's argument struct
//! ([`crate::KernelParams`]) points into memory the CUDA layer vouched for. Offsets inside that memory
//! ([`DevPtr::byte_add`]) are the caller's to keep in bounds: the validating core checks the sizes that
//! decide them.

use bytemuck::{NoUninit, Zeroable};

/// A device address (or null) that came from the CUDA layer. 8 bytes, like the `u64`/pointer the kernel's
/// struct holds in its place.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, NoUninit, Zeroable)]
pub struct DevPtr(u64);

impl DevPtr {
    /// No memory: what a kernel reads as "absent" (an optional output, tracing off).
    pub const NULL: DevPtr = DevPtr(0);

    /// An address the CUDA layer vouches for (an allocation, mapping or lent memory of its own).
    pub(crate) fn from_raw(addr: u64) -> DevPtr {
        DevPtr(addr)
    }

    /// The address as a number (for messages and alignment checks; it cannot become a `DevPtr` again).
    pub fn addr(self) -> u64 {
        self.0
    }

    /// Whether this is [`DevPtr::NULL`].
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address `bytes` further into the same memory. Null stays null, so an absent buffer stays absent
    /// and no address is made from a number alone.
    #[must_use]
    pub fn byte_add(self, bytes: usize) -> DevPtr {
        if self.is_null() {
            return DevPtr::NULL;
        }
        DevPtr(self.0.wrapping_add(bytes as u64))
    }
}

impl std::fmt::Debug for DevPtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevPtr({:#x})", self.0)
    }
}

/// `N` device addresses in a row (a kernel's per-rank table, unused entries null). Its own type because
/// bytemuck marks arrays of only its own element types `NoUninit`.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct DevPtrs<const N: usize>(pub [DevPtr; N]);

// SAFETY: a transparent wrapper of an array of `DevPtr`, which is a transparent `u64`: no padding, every
// byte initialised.
unsafe impl<const N: usize> NoUninit for DevPtrs<N> {}
// SAFETY: all zero bytes are N null `DevPtr`s.
unsafe impl<const N: usize> Zeroable for DevPtrs<N> {}

impl<const N: usize> Default for DevPtrs<N> {
    fn default() -> DevPtrs<N> {
        DevPtrs([DevPtr::NULL; N])
    }
}

impl<const N: usize> From<[DevPtr; N]> for DevPtrs<N> {
    fn from(ptrs: [DevPtr; N]) -> DevPtrs<N> {
        DevPtrs(ptrs)
    }
}

impl<const N: usize> std::ops::Deref for DevPtrs<N> {
    type Target = [DevPtr; N];
    fn deref(&self) -> &[DevPtr; N] {
        &self.0
    }
}

impl<const N: usize> std::ops::DerefMut for DevPtrs<N> {
    fn deref_mut(&mut self) -> &mut [DevPtr; N] {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dev_ptr_is_a_u64_in_layout_and_null_stays_null() {
        assert_eq!((std::mem::size_of::<DevPtr>(), std::mem::align_of::<DevPtr>()), (8, 8));
        assert_eq!(std::mem::size_of::<DevPtrs<8>>(), 64);
        let p = DevPtr::from_raw(0x1000);
        assert_eq!(bytemuck::bytes_of(&p), &0x1000u64.to_ne_bytes());
        assert_eq!(p.byte_add(16).addr(), 0x1010);
        assert!(DevPtr::NULL.byte_add(16).is_null());
        assert!(DevPtrs::<8>::default().iter().all(|p| p.is_null()));
    }
}
