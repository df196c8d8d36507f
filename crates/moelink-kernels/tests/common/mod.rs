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

// emulate_ht.rs builds its harness from several families (its own runner); the other emulation tests share
// this one.
#[allow(dead_code)]
/// What one emulated build is: the kernel spec whose constants it compiles with (`override_` replaces one
/// constant, e.g. the threads per block), the sources and headers it needs beside the emulated `ptx.cuh`
/// (`(file name, contents)`), and the harness in `emu/` that drives them.
pub struct Harness<'a> {
    pub spec: &'a moelink_kernels::KernelSpec,
    pub files: &'a [(&'a str, &'a str)],
    pub harness: &'a str,
    pub extra_flags: &'a [&'a str],
    pub override_: Option<(&'a str, String)>,
}

#[allow(dead_code)]
/// Builds `h` with `cxx` in a fresh temporary folder, runs it, prints its output, and panics (with `what`
/// and the output) unless it exits 0.
pub fn run_harness(cxx: &str, h: &Harness<'_>, what: &str) {
    let spec = h.spec;
    let stem = h.harness.trim_end_matches(".cpp");
    let dir: PathBuf =
        std::env::temp_dir().join(format!("moelink-{stem}-{}-{}", std::process::id(), spec.variant.replace([',', '[', ']'], "_")));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, contents) in h.files {
        std::fs::write(dir.join(name), contents).unwrap();
    }
    std::fs::write(dir.join("ptx.cuh"), emulated_ptx()).unwrap();
    let bin = dir.join(stem);
    let mut flags: Vec<String> = ["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-Wno-unknown-pragmas"].map(String::from).into();
    flags.extend(h.extra_flags.iter().map(|f| f.to_string()));
    for (k, v) in &spec.defines {
        let v = match &h.override_ {
            Some((name, value)) if name == k => value.clone(),
            _ => v.clone(),
        };
        flags.push(format!("-D{k}={v}"));
    }
    if std::env::var_os("MOELINK_EMU_KEEP").is_some() {
        let line = format!(
            "{cxx} {} -I . -I {} {} -o {stem} -pthread\n",
            flags.join(" "),
            emu_dir().display(),
            emu_dir().join(h.harness).display()
        );
        std::fs::write(dir.join("build.sh"), line).unwrap();
    }
    if let Err(e) = compile(cxx, &flags, &dir, &emu_dir().join(h.harness), &bin) {
        panic!("{}: compiling the emulator failed:\n{e}", spec.variant);
    }
    let out = Command::new(&bin).output().unwrap();
    // MOELINK_EMU_KEEP=1 keeps the build (sources, flags in the binary's folder) to rerun or debug it.
    if std::env::var_os("MOELINK_EMU_KEEP").is_some() {
        eprintln!("kept {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!("{}:\n{}", spec.variant, String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "{}: {what}:\n{}\n{}",
        spec.variant,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
