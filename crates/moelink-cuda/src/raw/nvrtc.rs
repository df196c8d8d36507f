//! Raw NVRTC calls (`cudarc::nvrtc::sys`) as `unsafe fn`s returning [`Result`].
//!
//! Contract of every `unsafe fn` here: [`ensure_loaded`] returned `Ok` earlier in this process, and program
//! handles passed in are live (created by [`create_program`], not yet destroyed).

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

pub(crate) use sys::nvrtcProgram;

fn check(r: sys::nvrtcResult, call: &'static str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Nvrtc { call, name: format!("{r:?}"), log: String::new() })
    }
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("{what} {s:.40?} contains a NUL byte")))
}

/// Loads `libnvrtc` once per process and returns its version `(major, minor)`. Never panics.
pub(crate) fn ensure_loaded() -> Result<(i32, i32)> {
    static INIT: OnceLock<Result<(i32, i32)>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen candidate names; it never panics.
        if !unsafe { sys::is_culib_present() } {
            let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            return Err(Error::NvrtcNotFound(format!(" (LD_LIBRARY_PATH is {path:?})")));
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present (checked above); both out-pointers are valid.
        check(unsafe { sys::nvrtcVersion(&mut major, &mut minor) }, "nvrtcVersion")?;
        Ok((major, minor))
    })
    .clone()
}

/// Creates a program from `source` (named `name` in diagnostics) with in-memory headers `(include name,
/// contents)`.
pub(crate) unsafe fn create_program(source: &str, name: &str, headers: &[(String, String)]) -> Result<nvrtcProgram> {
    let src = cstring(source, "kernel source")?;
    let name = cstring(name, "kernel name")?;
    let contents: Vec<CString> = headers.iter().map(|(_, c)| cstring(c, "header")).collect::<Result<_>>()?;
    let names: Vec<CString> = headers.iter().map(|(n, _)| cstring(n, "header name")).collect::<Result<_>>()?;
    let content_ptrs: Vec<*const c_char> = contents.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nvrtcProgram = std::ptr::null_mut();
    check(
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            headers.len() as i32,
            if headers.is_empty() { std::ptr::null() } else { content_ptrs.as_ptr() },
            if headers.is_empty() { std::ptr::null() } else { name_ptrs.as_ptr() },
        ),
        "nvrtcCreateProgram",
    )?;
    Ok(prog)
}

/// Asks NVRTC to keep the lowered (mangled) name of `expression` (a C++ name such as `ns::kernel`) for
/// [`lowered_name`]; before [`compile_program`].
pub(crate) unsafe fn add_name_expression(prog: nvrtcProgram, expression: &str) -> Result<()> {
    let expr = cstring(expression, "name expression")?;
    check(sys::nvrtcAddNameExpression(prog, expr.as_ptr()), "nvrtcAddNameExpression")
}

/// The lowered name of an expression added with [`add_name_expression`]; after a successful compile.
pub(crate) unsafe fn lowered_name(prog: nvrtcProgram, expression: &str) -> Result<String> {
    let expr = cstring(expression, "name expression")?;
    let mut lowered: *const c_char = std::ptr::null();
    check(sys::nvrtcGetLoweredName(prog, expr.as_ptr(), &mut lowered), "nvrtcGetLoweredName")?;
    if lowered.is_null() {
        return Err(Error::Nvrtc { call: "nvrtcGetLoweredName", name: "null name".into(), log: expression.to_string() });
    }
    // The string is owned by the program and valid until it is destroyed; copied here.
    Ok(std::ffi::CStr::from_ptr(lowered).to_string_lossy().into_owned())
}

/// Compiles; `Ok(false)` when the source was rejected (the log says why), `Err` for other failures.
pub(crate) unsafe fn compile_program(prog: nvrtcProgram, options: &[String]) -> Result<bool> {
    let opts: Vec<CString> = options.iter().map(|o| cstring(o, "compile option")).collect::<Result<_>>()?;
    let ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let r = sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
    if r == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
        return Ok(false);
    }
    check(r, "nvrtcCompileProgram").map(|_| true)
}

pub(crate) unsafe fn program_log(prog: nvrtcProgram) -> Result<String> {
    let mut n = 0usize;
    check(sys::nvrtcGetProgramLogSize(prog, &mut n), "nvrtcGetProgramLogSize")?;
    let mut buf = vec![0u8; n.max(1)];
    check(sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char), "nvrtcGetProgramLog")?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

pub(crate) unsafe fn program_cubin(prog: nvrtcProgram) -> Result<Vec<u8>> {
    let mut n = 0usize;
    check(sys::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize")?;
    let mut buf = vec![0u8; n];
    check(sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
    Ok(buf)
}

pub(crate) unsafe fn destroy_program(prog: &mut nvrtcProgram) -> Result<()> {
    check(sys::nvrtcDestroyProgram(prog), "nvrtcDestroyProgram")
}
