//! Compiles every kernel variant for sm_90a with NVRTC — no GPU needed — and fails on a compile error or on
//! any stack frame / spill in a kernel marked hot.
//!
//! NVRTC missing: the test prints why and passes, unless `MOELINK_REQUIRE_NVRTC=1` (CI), where it fails.
//! With `MOELINK_CUOBJDUMP=/path/to/cuobjdump` it also disassembles each CUBIN and checks that the intended
//! instructions are there (`scripts/ci-nvrtc-env.sh` installs both tools); with `MOELINK_SASS_DIR=dir` as well,
//! it writes each variant's disassembly to `dir/<variant>.sass`, so that a refactor of a kernel can be
//! checked to leave its machine code unchanged (`diff -r` of two such folders) before any GPU time is spent.

use moelink_cuda::jit::{CompileRequest, Compiled, JitCache};
use moelink_cuda::{Error, NvshmemToolchain};
use moelink_kernels::transport::Transport;
use moelink_kernels::{all_variants, kernel_name, Family, KernelSpec};

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

/// NVSHMEM's files for the `nvshmem` transport variants (`NVSHMEM_HOME`, and for the CUDA runtime headers
/// `MOELINK_TEST_CUDA_HOME`, which `scripts/ci-nvrtc-env.sh` sets instead of `CUDA_HOME` so that cudarc's
/// build script does not rerun, else `CUDA_HOME`; that script installs both from PyPI). `None` (those variants are skipped,
/// saying so) when unset, unless `MOELINK_REQUIRE_NVSHMEM=1` (CI), where that fails.
fn nvshmem_toolchain() -> Option<NvshmemToolchain> {
    let required = std::env::var("MOELINK_REQUIRE_NVSHMEM").as_deref() == Ok("1");
    let Some(home) = std::env::var_os("NVSHMEM_HOME") else {
        assert!(!required, "MOELINK_REQUIRE_NVSHMEM=1 but NVSHMEM_HOME is not set");
        return None;
    };
    let cuda = std::env::var_os("MOELINK_TEST_CUDA_HOME").or_else(|| std::env::var_os("CUDA_HOME"));
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
    // MOELINK_COMPILE_FILTER=substring compiles only the variants whose name contains it (while iterating
    // on one kernel); CI compiles every variant.
    let filter = std::env::var("MOELINK_COMPILE_FILTER").unwrap_or_default();
    for spec in all_variants().into_iter().filter(|s| s.variant.contains(&filter)) {
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
            failures.extend(check_sass(&tool, &spec, &compiled).into_iter().map(|f| format!("{}: {f}", spec.variant)));
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

/// The names a profiler shows for moelink's kernels: the demangled symbols (`c++filt` of NVRTC's lowered
/// names, which are the cubin's symbols). Each must be the kernel's C++ name with its parameter list, and
/// the tools that time DeepEP must find exactly one dispatch and one combine kernel per mode the way
/// DeepEP's `bench_kineto` does: one row of the kineto table containing `dispatch` / `combine` (the table
/// cuts names at 100 characters), and the chrome-trace events whose name contains `::dispatch` /
/// `::combine`. A profile of one mode holds that mode's kernels and the barrier (which `Buffer` drop and
/// `clean_low_latency_buffer` launch).
#[test]
fn profilers_find_one_dispatch_and_one_combine_kernel_per_mode() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping the kernel-name check: {why}");
        return;
    }
    let params = |name: &str| -> &str {
        match name {
            kernel_name::BARRIER => "(BarrierArgs)",
            kernel_name::BARRIER_LATENCY => "(BarrierArgs, unsigned int, unsigned long long*)",
            kernel_name::COPY_SM | kernel_name::COPY_TMA => "(CopyArgs)",
            kernel_name::FILL_PATTERN => "(unsigned long long, unsigned long long, unsigned int, unsigned long long)",
            kernel_name::VERIFY_PATTERN => "(unsigned long long, unsigned long long, unsigned int, unsigned long long, unsigned long long)",
            kernel_name::HT_LAYOUT => "(HtLayoutArgs)",
            kernel_name::HT_NOTIFY => "(HtNotifyArgs)",
            kernel_name::HT_DISPATCH => "(HtDispatchArgs)",
            kernel_name::HT_COMBINE => "(HtCombineArgs)",
            kernel_name::HT_CE_SIGNAL => "(HtCeSignalArgs)",
            kernel_name::LL_DISPATCH => "(LlDispatchArgs)",
            kernel_name::LL_COMBINE => "(LlCombineArgs)",
            kernel_name::LLI_DISPATCH => "(LliDispatchArgs)",
            kernel_name::LLI_COMBINE => "(LliCombineArgs)",
            kernel_name::HTI_LAYOUT => "(HtiLayoutArgs)",
            kernel_name::HTI_NOTIFY => "(HtiNotifyArgs)",
            kernel_name::HTI_DISPATCH => "(HtiDispatchArgs)",
            kernel_name::HTI_COMBINE => "(HtiCombineArgs)",
            other => panic!("{other}: add its parameter list here"),
        }
    };
    // One variant per family: the names do not depend on the constants.
    let cache = JitCache::new(None);
    let mut symbols: Vec<(&'static str, String)> = Vec::new();
    let mut families: Vec<Family> = Vec::new();
    for spec in all_variants() {
        // The transport family's check and benchmark kernels are test kernels with `extern "C"` names.
        if families.contains(&spec.family) || spec.family == Family::Transport {
            continue;
        }
        families.push(spec.family);
        let compiled = cache.compile(&spec.compile_request(ARCH)).unwrap_or_else(|e| panic!("{}: {e}", spec.variant));
        for k in spec.kernels() {
            let symbol = compiled.lowered_name(k.name).unwrap_or_else(|| panic!("{}: no lowered name", k.name)).to_string();
            let in_cubin =
                compiled.cubin.windows(symbol.len() + 1).any(|w| w[..symbol.len()] == *symbol.as_bytes() && w[symbol.len()] == 0);
            assert!(in_cubin, "{}: symbol {symbol} is not in the cubin's string table", k.name);
            symbols.push((k.name, symbol));
        }
    }
    let Some(shown) = demangle(&symbols.iter().map(|(_, s)| s.as_str()).collect::<Vec<_>>()) else { return };
    let shown: Vec<(&str, String)> = symbols.iter().map(|(n, _)| *n).zip(shown).collect();
    for (name, demangled) in &shown {
        assert_eq!(*demangled, format!("{name}{}", params(name)), "what a profiler shows for {name}");
    }
    let barrier = [kernel_name::BARRIER, kernel_name::BARRIER_LATENCY];
    let modes: [(&str, Vec<&str>, [&str; 2]); 4] = [
        (
            "high-throughput",
            [kernel_name::HT_LAYOUT, kernel_name::HT_NOTIFY, kernel_name::HT_DISPATCH, kernel_name::HT_COMBINE]
                .into_iter()
                .chain(barrier)
                .collect(),
            [kernel_name::HT_DISPATCH, kernel_name::HT_COMBINE],
        ),
        (
            "low-latency",
            [kernel_name::LL_DISPATCH, kernel_name::LL_COMBINE].into_iter().chain(barrier).collect(),
            [kernel_name::LL_DISPATCH, kernel_name::LL_COMBINE],
        ),
        (
            "low-latency across nodes",
            [kernel_name::LLI_DISPATCH, kernel_name::LLI_COMBINE].into_iter().chain(barrier).collect(),
            [kernel_name::LLI_DISPATCH, kernel_name::LLI_COMBINE],
        ),
        (
            "high-throughput across nodes",
            [kernel_name::HTI_LAYOUT, kernel_name::HTI_NOTIFY, kernel_name::HTI_DISPATCH, kernel_name::HTI_COMBINE]
                .into_iter()
                .chain(barrier)
                .collect(),
            [kernel_name::HTI_DISPATCH, kernel_name::HTI_COMBINE],
        ),
    ];
    for (mode, kernels, [dispatch, combine]) in modes {
        let profile: Vec<&(&str, String)> = shown.iter().filter(|(n, _)| kernels.contains(n)).collect();
        assert_eq!(profile.len(), kernels.len());
        for (_, demangled) in &profile {
            assert!(demangled.len() <= 100, "{demangled}: longer than the kineto table's name column");
        }
        for (word, want) in [("dispatch", dispatch), ("combine", combine)] {
            let rows: Vec<&str> = profile.iter().filter(|(_, d)| d.contains(word)).map(|(n, _)| *n).collect();
            assert_eq!(rows, [want], "{mode}: kernel-table rows containing `{word}`");
            let events: Vec<&str> = profile.iter().filter(|(_, d)| d.contains(&format!("::{word}"))).map(|(n, _)| *n).collect();
            assert_eq!(events, [want], "{mode}: chrome-trace events containing `::{word}`");
        }
    }
}

/// `c++filt` of each symbol, in order; None (the test then skips, saying why) when c++filt does not run,
/// unless `MOELINK_REQUIRE_NVRTC=1`, where that is a failure.
fn demangle(symbols: &[&str]) -> Option<Vec<String>> {
    use std::io::Write;
    let child = std::process::Command::new("c++filt").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            assert!(std::env::var("MOELINK_REQUIRE_NVRTC").as_deref() != Ok("1"), "c++filt does not run: {e}");
            eprintln!("skipping the demangled-name check: c++filt does not run: {e}");
            return None;
        }
    };
    child.stdin.take().expect("piped").write_all(symbols.join("\n").as_bytes()).expect("c++filt reads its input");
    let out = child.wait_with_output().expect("c++filt runs");
    assert!(out.status.success(), "c++filt failed");
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(lines.len(), symbols.len(), "c++filt printed one line per symbol");
    Some(lines)
}

/// Instructions each family must contain (substrings of cuobjdump -sass lines), and ones no kernel may.
fn check_sass(tool: &std::ffi::OsStr, spec: &moelink_kernels::KernelSpec, compiled: &Compiled) -> Vec<String> {
    let family = spec.family;
    let cubin = &compiled.cubin;
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
            (kernel_name::BARRIER, &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS", "CCTL.IVALL"]),
            (kernel_name::BARRIER_LATENCY, &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS"]),
        ],
        Family::Copy => &[
            (kernel_name::COPY_SM, &["LDG.E.NA.LTC256B.128.CONSTANT", "STG.E.NA.128"]),
            (kernel_name::COPY_TMA, &["UBLKCP.S.G", "UBLKCP.G.S", "SYNCS"]),
            (kernel_name::FILL_PATTERN, &["STG.E.128"]),
            (kernel_name::VERIFY_PATTERN, &["LDG.E.128"]),
        ],
        Family::HtLayout => &[(kernel_name::HT_LAYOUT, &["ATOMS"])],
        Family::HtNotify => &[(kernel_name::HT_NOTIFY, &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "LDG.E.STRONG.SYS"])],
        // Senders: streamed 16-byte loads of the inputs, 16-byte stores into peers' slabs, fence + flag;
        // receivers: weak 16-byte loads of the slab after an acquire (LDG.STRONG.SYS + CCTL.IVALL).
        Family::HtDispatch => &[(
            kernel_name::HT_DISPATCH,
            &["LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.NA.128", "STG.E.NA.128", "MEMBAR.ALL.SYS", "STG.E.STRONG.SYS", "CCTL.IVALL"],
        )],
        // The copy-engine pieces' flags: a system fence, then the peer's flag.
        Family::HtCeSignal => &[(kernel_name::HT_CE_SIGNAL, &["MEMBAR.ALL.SYS", "STG.E.STRONG.SYS"])],
        Family::HtCombine => &[(
            kernel_name::HT_COMBINE,
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
            kernel_name::LL_DISPATCH,
            &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS", "F2FP.SATFINITE.E4M3.F32.PACK_AB"],
        )],
        Family::LlDispatch => {
            &[(kernel_name::LL_DISPATCH, &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS"])]
        }
        Family::LlCombine => &[(
            kernel_name::LL_COMBINE,
            &["STG.E.NA.128", "LDG.E.NA.LTC256B.128.CONSTANT", "LDG.E.128.STRONG.GPU", "MEMBAR.ALL.SYS", "F2FP.BF16.F32.PACK_AB"],
        )],
        // NVSHMEM's device code keeps a stack frame and calls into its transfer functions: nothing to expect.
        Family::Transport if Transport::of_spec(spec) == Some(Transport::Nvshmem) => &[],
        Family::LliDispatch | Family::LliCombine | Family::HtiLayout | Family::HtiNotify | Family::HtiDispatch | Family::HtiCombine => &[],
        // Signals: a system fence before a 64-bit system-scope reduction or store into the peer's word.
        Family::Transport => &[
            ("transport_barrier", &["STG.E.64.STRONG.SYS", "LDG.E.64.STRONG.SYS"]),
            ("transport_check", &["MEMBAR.ALL.SYS"]),
            ("transport_bench", &["MEMBAR.ALL.SYS"]),
        ],
    };
    // The no_loads timing experiment (LL) loads no payload: no streamed loads to find.
    let ll_experiment = spec.define("LL_EXPERIMENT").and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
    let skipped = |w: &str| w == "LDG.E.NA.LTC256B.128.CONSTANT" && ll_experiment & moelink_kernels::ll::experiment::NO_LOADS != 0;
    let mut failures = Vec::new();
    for (kernel, wanted) in expect {
        // Namespaced kernels by their lowered symbol; `extern "C"` ones (transport) by their name.
        let symbol = compiled.lowered_name(kernel).unwrap_or(kernel);
        let Some(body) = functions.iter().find(|(n, _)| n == symbol).map(|(_, b)| b) else {
            failures.push(format!("{kernel}: not found in the SASS"));
            continue;
        };
        for w in wanted.iter().filter(|w| !skipped(w)) {
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
        if *kernel == kernel_name::LL_COMBINE && body.lines().any(|l| l.split_whitespace().any(|t| t.starts_with("FFMA"))) {
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
