//! Raw NVSHMEM 3.4 host calls, resolved at run time from `libnvshmem_host.so.3` (the `nvidia-nvshmem-cu13`
//! wheel's `lib/`, or an NVSHMEM install): no link-time dependency, no nvcc, nothing loaded unless an
//! internode buffer asks for it.
//!
//! Only exported, ABI-stable entry points are used. The header's `nvshmem_init`/`nvshmemx_init_attr` are
//! inline functions calling into the device library, so a `dlopen` user initialises with
//! `nvshmemx_hostlib_init_attr` and the unique-id bootstrap, and finalises with its pair
//! `nvshmemx_hostlib_finalize` (the header's inline `nvshmem_finalize` ends in the same teardown, through the
//! device library). The library is opened `RTLD_NOW | RTLD_GLOBAL` (its bootstrap and transport plugins,
//! which it `dlopen`s itself, must see this one instance) and never closed: each initialisation registers an
//! `atexit` handler of its own (the bootstrap's teardown) that must find the library loaded.

use std::ffi::{c_int, c_uint, c_void};
use std::path::Path;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{Error, Result};

/// `nvshmemx_uniqueid_v1` (bootstrap_device_host/nvshmem_uniqueid.h): 128 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub version: c_int,
    pub internal: [u8; 124],
}

/// `nvshmemx_uniqueid_args_v1`: 24 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueIdArgs {
    pub version: c_int,
    pub id: *mut UniqueId,
    pub myrank: c_int,
    pub nranks: c_int,
}

/// `nvshmemx_init_args_v1` (device_host/nvshmem_types.h): 128 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct InitArgs {
    pub version: c_int,
    pub uid_args: UniqueIdArgs,
    pub content: [u8; 96],
}

/// `nvshmemx_init_attr_v1`: 144 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct InitAttr {
    pub version: c_int,
    pub mpi_comm: *mut c_void,
    pub args: InitArgs,
}

const _: () = assert!(std::mem::size_of::<UniqueId>() == 128);
const _: () = assert!(std::mem::size_of::<UniqueIdArgs>() == 24);
const _: () = assert!(std::mem::size_of::<InitArgs>() == 128);
const _: () = assert!(std::mem::size_of::<InitAttr>() == 144);
const _: () = assert!(std::mem::offset_of!(InitAttr, args) == 16);
const _: () = assert!(std::mem::offset_of!(InitArgs, uid_args) == 8);
const _: () = assert!(std::mem::offset_of!(InitArgs, content) == 32);

/// Every versioned struct's first word: `(1 << 16) + sizeof(struct)`.
const fn struct_version(size: usize) -> c_int {
    (1 << 16) + size as c_int
}

impl UniqueId {
    /// `NVSHMEMX_UNIQUEID_INITIALIZER`.
    pub fn empty() -> UniqueId {
        UniqueId { version: struct_version(128), internal: [0; 124] }
    }

    pub fn to_bytes(self) -> [u8; 128] {
        let mut b = [0u8; 128];
        b[..4].copy_from_slice(&self.version.to_le_bytes());
        b[4..].copy_from_slice(&self.internal);
        b
    }

    pub fn from_bytes(b: &[u8]) -> Option<UniqueId> {
        if b.len() != 128 {
            return None;
        }
        let mut u = UniqueId::empty();
        u.version = c_int::from_le_bytes(b[..4].try_into().ok()?);
        u.internal.copy_from_slice(&b[4..]);
        Some(u)
    }
}

impl InitAttr {
    /// `NVSHMEMX_INIT_ATTR_INITIALIZER`.
    pub fn empty() -> InitAttr {
        InitAttr {
            version: struct_version(144),
            mpi_comm: std::ptr::null_mut(),
            args: InitArgs {
                version: struct_version(128),
                uid_args: UniqueIdArgs { version: struct_version(24), id: std::ptr::null_mut(), myrank: -1, nranks: -1 },
                content: [0; 96],
            },
        }
    }
}

/// `NVSHMEMX_INIT_WITH_UNIQUEID` (host/nvshmemx_api.h).
pub(crate) const INIT_WITH_UNIQUEID: c_uint = 1 << 3;
/// `nvshmemx_init_status()` once the device side is initialised (`NVSHMEM_STATUS_IS_INITIALIZED`); with
/// several PEs on one GPU it reports `NVSHMEM_STATUS_LIMITED_MPG` (3: no CUDA MPS, PEs time-slice; team
/// split is unavailable) or `NVSHMEM_STATUS_FULL_MPG` (4: under MPS), both initialised too.
pub(crate) const STATUS_IS_INITIALIZED: c_int = 2;
/// `NVSHMEM_STATUS_FULL_MPG`: the last initialised state.
pub(crate) const STATUS_FULL_MPG: c_int = 4;

/// The host entry points moelink uses.
pub(crate) struct Api {
    pub get_uniqueid: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub set_attr_uniqueid_args: unsafe extern "C" fn(c_int, c_int, *const UniqueId, *mut InitAttr) -> c_int,
    pub hostlib_init_attr: unsafe extern "C" fn(c_uint, *mut InitAttr) -> c_int,
    pub hostlib_finalize: unsafe extern "C" fn(),
    pub init_status: unsafe extern "C" fn() -> c_int,
    pub my_pe: unsafe extern "C" fn() -> c_int,
    pub n_pes: unsafe extern "C" fn() -> c_int,
    pub malloc: unsafe extern "C" fn(usize) -> *mut c_void,
    pub free: unsafe extern "C" fn(*mut c_void),
    pub ptr: unsafe extern "C" fn(*const c_void, c_int) -> *mut c_void,
    pub barrier_all: unsafe extern "C" fn(),
    pub cumodule_init: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub cumodule_finalize: unsafe extern "C" fn(*mut c_void) -> c_int,
    /// `nvshmemx_vendor_get_version_info`: the library's own version, compiled in; callable before init.
    pub vendor_version: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int),
    /// The library stays loaded for the process.
    _lib: std::mem::ManuallyDrop<Library>,
}

// SAFETY: a table of C function pointers into a library that is never unloaded; NVSHMEM's host API is
// thread-safe for the calls moelink makes from one buffer at a time (the safe layer serialises init).
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// Opens `path` (`libnvshmem_host.so.3`) and resolves the entry points.
pub(crate) fn open(path: &Path) -> Result<Api> {
    // SAFETY: loading NVSHMEM's host library runs its static initialisers, which need nothing of ours.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| Error::Nvshmem(format!("cannot load {}: {e}", path.display())))?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol's C signature (NVSHMEM 3.4 host headers) is the field's type it is assigned to.
            let s: libloading::os::unix::Symbol<_> = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| Error::Nvshmem(format!("{} lacks {}: {e} (NVSHMEM 3.4 or newer is needed)", path.display(), $name)))?;
            *s
        }};
    }
    Ok(Api {
        get_uniqueid: sym!("nvshmemx_get_uniqueid"),
        set_attr_uniqueid_args: sym!("nvshmemx_set_attr_uniqueid_args"),
        hostlib_init_attr: sym!("nvshmemx_hostlib_init_attr"),
        hostlib_finalize: sym!("nvshmemx_hostlib_finalize"),
        init_status: sym!("nvshmemx_init_status"),
        my_pe: sym!("nvshmem_my_pe"),
        n_pes: sym!("nvshmem_n_pes"),
        malloc: sym!("nvshmem_malloc"),
        free: sym!("nvshmem_free"),
        ptr: sym!("nvshmem_ptr"),
        barrier_all: sym!("nvshmem_barrier_all"),
        cumodule_init: sym!("nvshmemx_cumodule_init"),
        cumodule_finalize: sym!("nvshmemx_cumodule_finalize"),
        vendor_version: sym!("nvshmemx_vendor_get_version_info"),
        _lib: std::mem::ManuallyDrop::new(lib),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_round_trips_through_bytes() {
        let mut u = UniqueId::empty();
        u.internal[0] = 7;
        u.internal[123] = 9;
        let b = u.to_bytes();
        let back = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(back.version, (1 << 16) + 128);
        assert_eq!((back.internal[0], back.internal[123]), (7, 9));
        assert!(UniqueId::from_bytes(&b[..127]).is_none());
    }

    #[test]
    fn initializers_carry_struct_versions() {
        let a = InitAttr::empty();
        assert_eq!(a.version, (1 << 16) + 144);
        assert_eq!(a.args.version, (1 << 16) + 128);
        assert_eq!(a.args.uid_args.version, (1 << 16) + 24);
    }

    #[test]
    fn a_missing_library_is_an_error() {
        let e = open(Path::new("/nonexistent/libnvshmem_host.so.3")).err().expect("no such library");
        assert!(e.to_string().contains("/nonexistent/libnvshmem_host.so.3"), "{e}");
    }
}
