//! Raw nvJitLink calls (`libnvJitLink.so.13`, loaded with `dlopen` on first use): links a relocatable CUBIN
//! from NVRTC (`-rdc=true`) against device libraries (NVSHMEM's `libnvshmem_device.a`) into a loadable one.
//!
//! Only the internode kernels need it; nothing else loads the library.

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::Path;
use std::sync::OnceLock;

use libloading::Library;

use crate::error::{Error, Result};

type Handle = *mut c_void;

/// `nvJitLinkInputType` values (nvJitLink.h, CUDA 13.0).
const INPUT_CUBIN: c_int = 1;
const INPUT_LIBRARY: c_int = 6;

struct Api {
    create: unsafe extern "C" fn(*mut Handle, u32, *const *const c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Handle) -> c_int,
    add_data: unsafe extern "C" fn(Handle, c_int, *const c_void, usize, *const c_char) -> c_int,
    add_file: unsafe extern "C" fn(Handle, c_int, *const c_char) -> c_int,
    complete: unsafe extern "C" fn(Handle) -> c_int,
    cubin_size: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Handle, *mut c_void) -> c_int,
    error_log_size: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    error_log: unsafe extern "C" fn(Handle, *mut c_char) -> c_int,
    info_log_size: unsafe extern "C" fn(Handle, *mut usize) -> c_int,
    info_log: unsafe extern "C" fn(Handle, *mut c_char) -> c_int,
    version: unsafe extern "C" fn(*mut u32, *mut u32) -> c_int,
    /// Keeps the symbols above valid; never unloaded.
    _lib: Library,
}

// SAFETY: the API is a table of C function pointers into a library that stays loaded for the process;
// nvJitLink handles are created, used and destroyed by one caller at a time (`link`).
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

fn open() -> Result<Api> {
    // SAFETY: loading nvJitLink runs no initialisers with preconditions of ours.
    let lib = unsafe { Library::new("libnvJitLink.so.13") }.map_err(|e| {
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        Error::NvJitLinkNotFound(format!(" ({e}; LD_LIBRARY_PATH is {path:?})"))
    })?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol's C signature (nvJitLink.h, 13.0) is the field's type it is assigned to.
            let s: libloading::Symbol<'_, _> = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| Error::NvJitLinkNotFound(format!(" (symbol {}: {e})", $name)))?;
            *s
        }};
    }
    Ok(Api {
        create: sym!("nvJitLinkCreate"),
        destroy: sym!("nvJitLinkDestroy"),
        add_data: sym!("nvJitLinkAddData"),
        add_file: sym!("nvJitLinkAddFile"),
        complete: sym!("nvJitLinkComplete"),
        cubin_size: sym!("nvJitLinkGetLinkedCubinSize"),
        cubin: sym!("nvJitLinkGetLinkedCubin"),
        error_log_size: sym!("nvJitLinkGetErrorLogSize"),
        error_log: sym!("nvJitLinkGetErrorLog"),
        info_log_size: sym!("nvJitLinkGetInfoLogSize"),
        info_log: sym!("nvJitLinkGetInfoLog"),
        version: sym!("nvJitLinkVersion"),
        _lib: lib,
    })
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, Error>> = OnceLock::new();
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// nvJitLink's version `(major, minor)`, or why it cannot be loaded.
pub(crate) fn version() -> Result<(u32, u32)> {
    let api = api()?;
    let (mut major, mut minor) = (0u32, 0u32);
    // SAFETY: both out-pointers are valid.
    let rc = unsafe { (api.version)(&mut major, &mut minor) };
    if rc != 0 {
        return Err(Error::Link { kernel: String::new(), call: "nvJitLinkVersion", status: rc, log: String::new() });
    }
    Ok((major, minor))
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} {s:.40?} contains a NUL byte")))
}

/// Both logs of a live handle.
///
/// # Safety
/// `h` is a live handle of `api`.
unsafe fn logs(api: &Api, h: Handle) -> String {
    let read = |size: unsafe extern "C" fn(Handle, *mut usize) -> c_int, get: unsafe extern "C" fn(Handle, *mut c_char) -> c_int| {
        let mut n = 0usize;
        // SAFETY: `h` is live (caller); the buffer has the size nvJitLink reported, plus a NUL.
        unsafe {
            if size(h, &mut n) != 0 || n == 0 {
                return String::new();
            }
            let mut buf = vec![0u8; n + 1];
            if get(h, buf.as_mut_ptr().cast()) != 0 {
                return String::new();
            }
            String::from_utf8_lossy(&buf).trim_end_matches('\0').trim().to_string()
        }
    };
    let (e, i) = (read(api.error_log_size, api.error_log), read(api.info_log_size, api.info_log));
    match (e.is_empty(), i.is_empty()) {
        (true, true) => String::new(),
        (false, true) => e,
        (true, false) => i,
        (false, false) => format!("{e}\n{i}"),
    }
}

/// Links `cubin` (relocatable, named `name` in diagnostics) against the device `libraries` for `arch`
/// (e.g. `sm_90a`); returns the linked CUBIN and nvJitLink's log.
pub(crate) fn link(name: &str, arch: &str, cubin: &[u8], libraries: &[&Path]) -> Result<(Vec<u8>, String)> {
    let api = api()?;
    let option = cstring(&format!("-arch={arch}"), "link option")?;
    let options = [option.as_ptr()];
    let cname = cstring(name, "kernel name")?;
    let fail = |call: &'static str, status: c_int, log: String| Error::Link { kernel: name.to_string(), call, status, log };
    let mut h: Handle = std::ptr::null_mut();
    // SAFETY: `options` outlives the call; `h` receives a new handle.
    let rc = unsafe { (api.create)(&mut h, 1, options.as_ptr()) };
    if rc != 0 {
        return Err(fail("nvJitLinkCreate", rc, String::new()));
    }
    let result = (|| -> Result<(Vec<u8>, String)> {
        // SAFETY: `h` is live; `cubin` and `cname` outlive the call (nvJitLink copies the input).
        let rc = unsafe { (api.add_data)(h, INPUT_CUBIN, cubin.as_ptr().cast(), cubin.len(), cname.as_ptr()) };
        if rc != 0 {
            // SAFETY: `h` is live.
            return Err(fail("nvJitLinkAddData", rc, unsafe { logs(api, h) }));
        }
        for lib in libraries {
            let path = cstring(&lib.to_string_lossy(), "device library path")?;
            // SAFETY: `h` is live; `path` outlives the call.
            let rc = unsafe { (api.add_file)(h, INPUT_LIBRARY, path.as_ptr()) };
            if rc != 0 {
                // SAFETY: `h` is live.
                return Err(fail("nvJitLinkAddFile", rc, format!("{}: {}", lib.display(), unsafe { logs(api, h) })));
            }
        }
        // SAFETY: `h` is live.
        let rc = unsafe { (api.complete)(h) };
        if rc != 0 {
            // SAFETY: `h` is live.
            return Err(fail("nvJitLinkComplete", rc, unsafe { logs(api, h) }));
        }
        let mut size = 0usize;
        // SAFETY: `h` is live and complete.
        let rc = unsafe { (api.cubin_size)(h, &mut size) };
        if rc != 0 {
            return Err(fail("nvJitLinkGetLinkedCubinSize", rc, String::new()));
        }
        let mut out = vec![0u8; size];
        // SAFETY: `out` has the size nvJitLink reported.
        let rc = unsafe { (api.cubin)(h, out.as_mut_ptr().cast()) };
        if rc != 0 {
            return Err(fail("nvJitLinkGetLinkedCubin", rc, String::new()));
        }
        // SAFETY: `h` is live.
        Ok((out, unsafe { logs(api, h) }))
    })();
    // SAFETY: `h` was created above and is destroyed once, here.
    unsafe { (api.destroy)(&mut h) };
    result
}
