//! Compiles every kernel variant for sm_90a with NVRTC — no GPU needed — and fails on a compile error or on
//! any stack frame / spill in a kernel marked hot.
//!
//! NVRTC missing: the test prints why and passes, unless `MOELINK_REQUIRE_NVRTC=1` (CI), where it fails.
//! With `MOELINK_CUOBJDUMP=/path/to/cuobjdump` it also disassembles each CUBIN and checks that the intended
//! instructions are there (`scripts/ci-nvrtc-env.sh` installs both tools); with `MOELINK_SASS_DIR=dir` as well,
//! it writes each variant's disassembly to `dir/<variant>.sass`, so that a refactor of a kernel can be
//! checked to leave its machine code unchanged (`diff -r` of two such folders) before any GPU time is spent.

use moelink_cuda::jit::{CompileRequest, JitCache};
use moelink_cuda::{Error, NvshmemToolchain};
use moelink_kernels::transport::Transport;
use moelink_kernels::{all_variants, Family, KernelSpec};

const ARCH: &str = "sm_90a";

/// `Some(reason)` when NVRTC is not there and that is allowed.
fn skip_reason() -> Option<String> {
    match moelink_cuda::jit::nvrtc_version() {
        Ok(_) => None,
        Err(e) => {
            if std::env::var("MOELINK_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("MOELINK_REQUIRE_NVRTC=1 but NVRTC cannot be loaded: {e}");
            }
            Some(e.to_string())
        }
    }
}

/// NVSHMEM's files for the `nvshmem` transport variants (`NVSHMEM_HOME`, and `CUDA_HOME` for the CUDA
/// runtime headers; `scripts/ci-nvrtc-env.sh` installs both from PyPI). `None` (those variants are skipped,
/// saying so) when unset, unless `MOELINK_REQUIRE_NVSHMEM=1` (CI), where that fails.
fn nvshmem_toolchain() -> Option<NvshmemToolchain> {
    let required = std::env::var("MOELINK_REQUIRE_NVSHMEM").as_deref() == Ok("1");
    let Some(home) = std::env::var_os("NVSHMEM_HOME") else {
        assert!(!required, "MOELINK_REQUIRE_NVSHMEM=1 but NVSHMEM_HOME is not set");
        return None;
    };
    let cuda = std::env::var_os("CUDA_HOME");
    match NvshmemToolchain::locate(std::path::Path::new(&home), cuda.as_deref().map(std::path::Path::new)) {
        Ok(t) => Some(t),
        Err(e) => {
            assert!(!required, "MOELINK_REQUIRE_NVSHMEM=1 but {e}");
            eprintln!("NVSHMEM toolchain not usable: {e}");
            None
        }
    }
}

/// The request for `spec`: linked against NVSHMEM for the `nvshmem` transport (None: no toolchain).
fn request(spec: &KernelSpec, nvshmem: Option<&NvshmemToolchain>) -> Option<CompileRequest> {
    match Transport::of_spec(spec) {
        Some(Transport::Nvshmem) => nvshmem.map(|t| t.apply(spec.compile_request(ARCH))),
        _ => Some(spec.compile_request(ARCH)),
    }
}

#[test]
fn every_variant_compiles_without_spills() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping the NVRTC compile check: {why}");
        return;
    }
    let cache = JitCache::new(None);
    let nvshmem = nvshmem_toolchain();
    let mut failures = Vec::new();
    for spec in all_variants() {
        let Some(req) = request(&spec, nvshmem.as_ref()) else {
            eprintln!("{}: skipped (NVSHMEM_HOME not set: the nvshmem transport needs NVSHMEM's headers and device library)", spec.variant);
            continue;
        };
        let compiled = match cache.compile(&req) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{}: {e}", spec.variant));
                continue;
            }
        };
        eprintln!("{} ({} B cubin, {:.3} s):", spec.variant, compiled.cubin.len(), compiled.compile_seconds);
        for k in spec.kernels() {
            match compiled.resources_of(k.name) {
                None => failures.push(format!("{}: no ptxas report for kernel {}", spec.variant, k.name)),
                Some(r) => {
                    eprintln!("  {r}{}", if k.hot { " [hot]" } else { "" });
                    if !r.is_entry {
                        failures.push(format!("{}: {} is not an entry point", spec.variant, k.name));
                    }
                    if k.hot && r.spills() {
                        failures.push(format!("{}: hot kernel spills or has a stack frame: {r}", spec.variant));
                    }
                }
            }
        }
        if let Some(tool) = std::env::var_os("MOELINK_CUOBJDUMP") {
            failures.extend(check_sass(&tool, &spec, &compiled.cubin).into_iter().map(|f| format!("{}: {f}", spec.variant)));
        }
    }
    assert!(failures.is_empty(), "kernel compile check failed:\n{}", failures.join("\n"));
}

#[test]
fn a_compile_error_names_the_kernel_and_carries_the_log() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let req = CompileRequest::new("broken.cu", "extern \"C\" __global__ void k() { undefined_thing(); }", ARCH);
    match JitCache::new(None).compile(&req) {
        Err(Error::Compile { kernel, arch, log }) => {
            assert_eq!(kernel, "broken.cu");
            assert_eq!(arch, ARCH);
            assert!(log.contains("undefined_thing"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn disk_cache_hits_after_a_cold_compile() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("moelink-jit-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let req = moelink_kernels::BarrierVariant.spec().compile_request(ARCH);
    let (cold, src1) = JitCache::new(Some(dir.clone())).compile_traced(&req).unwrap();
    let fresh = JitCache::new(Some(dir.clone()));
    let (warm, src2) = fresh.compile_traced(&req).unwrap();
    let (again, src3) = fresh.compile_traced(&req).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    use moelink_cuda::jit::CacheSource::*;
    assert_eq!((src1, src2, src3), (Compiled, Disk, Memory));
    assert_eq!(cold.cubin, warm.cubin);
    assert_eq!(cold.resources, warm.resources);
    assert!(std::sync::Arc::ptr_eq(&warm, &again));
}

/// Instructions each family must contain (substrings of cuobjdump -sass lines), and ones no kernel may.
fn check_sass(tool: &std::ffi::OsStr, spec: &moelink_kernels::KernelSpec, cubin: &[u8]) -> Vec<String> {
    let family = spec.family;
    let path = std::env::temp_dir().join(format!("moelink-sass-{}-{}.cubin", std::process::id(), family.file_name()));
    if let Err(e) = std::fs::write(&path, cubin) {
        return vec![format!("cannot write {}: {e}", path.display())];
    }
    let out = std::process::Command::new(tool).arg("-sass").arg(&path).output();
    let _ = std::fs::remove_file(&path);
    let sass = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => return vec![format!("cuobjdump failed: {}", String::from_utf8_lossy(&o.stderr))],
        Err(e) => return vec![format!("cannot run cuobjdump: {e}")],
    };
    if let Some(dir) = std::env::var_os("MOELINK_SASS_DIR") {
        let file = std::path::Path::new(&dir).join(format!("{}.sass", spec.variant));
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&file, &sass)) {
            return vec![format!("cannot write {}: {e}", file.display())];
        }
    }
    let functions = split_functions(&sass);
    let expect: &[(&str, &[&str])] = match family {
        Family::Barrier => &[
            ("gpu_barrier", &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS", "CCTL.IVALL"]),
            ("gpu_barrier_latency", &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS"]),
        ],
        Family::Copy => &[
            ("copy_sm", &["LDG.E.NA.LTC256B.128.CONSTANT", "STG.E.NA.128"]),
            ("copy_tma", &["UBLKCP.S.G", "UBLKCP.G.S", "SYNCS"]),
            ("fill_pattern", &["STG.E.128"]),
            ("verify_pattern", &["LDG.E.128"]),
        ],
        Family::HtLayout => &[("ht_layout", &["ATOMS"])],
        Family::HtNotify => &[("ht_notify", &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS"])],
        // Senders: streamed 16-byte loads of the inputs, 16-byte stores into peers' slabs, fence + flag;
        // receivers: weak 16-byte loads of the slab after an acquire (LDG.STRONG.SYS + CCTL.IVALL).
        Family::HtDispatch => &[(
            "ht_dispatch",
            &["LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.NA.128", "STG.E.NA.128", "MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "CCTL.IVALL"],
        )],
        Family::HtCombine => &[(
            "ht_combine",
            &[
                "LDG.E.NA.LTC256B.128.CONSTANT",
                "LDG.E.NA.128",
                "STG.E.NA.128",
                "MEMBAR.ALL.SYS",
                "STG.E.STRONG.SYS",
                "F2FP.BF16.F32.PACK_AB",
            ],
        )],
        // 16-byte streamed loads/stores, L2-coherent 16-byte loads of what peers wrote, system-scope fences;
        // FP8 dispatch converts with cvt.rn.satfinite.e4m3x2; combine rounds with cvt.rn.bf16x2.
        Family::LlDispatch if spec.define("LL_FP8") == Some("1") => &[(
            "ll_dispatch",
            &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS", "F2FP.SATFINITE.E4M3.F32.PACK_AB"],
        )],
        Family::LlDispatch => {
            &[("ll_dispatch", &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS"])]
        }
        Family::LlCombine => &[(
            "ll_combine",
            &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS", "F2FP.BF16.F32.PACK_AB"],
        )],
        // NVSHMEM's device code keeps a stack frame and calls into its transfer functions: nothing to expect.
        Family::Transport if Transport::of_spec(spec) == Some(Transport::Nvshmem) => &[],
        // Signals: a system fence before a 64-bit system-scope reduction or store into the peer's word.
        Family::Transport => &[
            ("transport_barrier", &["STG.E.64.STRONG.SYS", "LDG.E.64.STRONG.SYS"]),
            ("transport_check", &["MEMBAR.ALL.SYS"]),
            ("transport_bench", &["MEMBAR.ALL.SYS"]),
        ],
    };
    let mut failures = Vec::new();
    for (kernel, wanted) in expect {
        let Some(body) = functions.iter().find(|(n, _)| n == kernel).map(|(_, b)| b) else {
            failures.push(format!("{kernel}: not found in the SASS"));
            continue;
        };
        for w in *wanted {
            if !body.contains(w) {
                failures.push(format!("{kernel}: expected `{w}` in the SASS"));
            }
        }
        for banned in ["LDL", "STL", "BPT.TRAP"] {
            if body.lines().any(|l| l.split_whitespace().any(|t| t.starts_with(banned))) {
                failures.push(format!("{kernel}: SASS contains {banned} (local memory or trap)"));
            }
        }
        // The combine sums must round every product before the add: no fused multiply-add anywhere in it.
        if *kernel == "ll_combine" && body.lines().any(|l| l.split_whitespace().any(|t| t.starts_with("FFMA"))) {
            failures.push(format!("{kernel}: SASS contains FFMA (a contracted w * y + acc)"));
        }
    }
    failures
}

/// `(function name, its SASS)` from cuobjdump's output.
fn split_functions(sass: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in sass.lines() {
        if let Some(rest) = line.trim().strip_prefix("Function : ") {
            out.push((rest.trim().to_string(), String::new()));
        } else if let Some((_, body)) = out.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}
