//! The CPU emulator of CUDA that `emulate_ht.rs` and `ll_emulation.rs` run the kernels' real sources on:
//! `emu/runtime.hpp` (every block an OS thread, every CUDA thread a fiber, the CUDA built-ins) and
//! `emu/ptx_emu.hpp` (the `ptx` namespace as C++ atomics and IEEE arithmetic), spliced into the
//! real `cuda/ptx.cuh` in place of its inline-PTX `namespace ptx`; and the compiler that builds it.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

const PTX: &str = include_str!("../../cuda/ptx.cuh");
const PTX_EMU: &str = include_str!("../../emu/ptx_emu.hpp");

/// The emulator's folder: `runtime.hpp`, `ptx_emu.hpp` and the harnesses (`ht_harness.cpp`, `ll_emu.cpp`).
pub fn emu_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("emu")
}

/// `cuda/ptx.cuh` with its `namespace ptx { ... }` replaced by `emu/ptx_emu.hpp`; the rest (ABI constants,
/// error records, deadlines, `wait_flag_geq`) as written. Needs `runtime.hpp` included before it.
pub fn emulated_ptx() -> String {
    let start = PTX.find("namespace ptx {").expect("ptx.cuh has a ptx namespace");
    let end_marker = "}  // namespace ptx";
    let end = PTX.find(end_marker).expect("ptx.cuh closes its ptx namespace") + end_marker.len();
    format!("{}{}{}", &PTX[..start], PTX_EMU, &PTX[end..])
}

/// The C++ compiler (`$CXX`, else `g++`), or None when it does not run (the caller skips, saying why) —
/// unless `MOELINK_REQUIRE_EMU=1`, which makes that a failure.
pub fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    match Command::new(&cxx).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cxx),
        _ => {
            let required = std::env::var("MOELINK_REQUIRE_EMU").as_deref() == Ok("1");
            assert!(!required, "MOELINK_REQUIRE_EMU=1 but no C++ compiler ({cxx}, or $CXX) runs");
            None
        }
    }
}

/// Compiles `src` into `bin` with `flags`, finding includes in `include_dir` and then in the emulator's
/// folder. Err: the compiler's diagnostics.
pub fn compile<S: AsRef<OsStr>>(
    cxx: &str,
    flags: impl IntoIterator<Item = S>,
    include_dir: &Path,
    src: &Path,
    bin: &Path,
) -> Result<(), String> {
    let out = Command::new(cxx)
        .args(flags)
        .arg("-I")
        .arg(include_dir)
        .arg("-I")
        .arg(emu_dir())
        .arg(src)
        .arg("-o")
        .arg(bin)
        .arg("-pthread")
        .output()
        .map_err(|e| format!("cannot run {cxx}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}
