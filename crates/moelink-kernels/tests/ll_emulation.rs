//! Runs the low-latency kernels (`cuda/ll.cu`) on the CPU: `emu/ll_emu.cpp` compiles them with the host C++
//! compiler against `emu/ptx.cuh` (one OS thread per block, one fiber per CUDA thread) and checks, rank by
//! rank, what they write against references computed from the documented semantics: counts, every valid
//! row and scale, combined outputs bit for bit, hooks (two in flight), drained hooks, masks, shrink-mode
//! and hard timeouts, argument problems and signature mismatches reported on every rank.
//!
//! This checks index math and the flag protocol without a GPU; it is not a memory-model or timing test.
//! Skips (printing why) without a C++17 compiler (`c++`, or `$CXX`), unless `MOELINK_REQUIRE_EMULATION=1`.

use std::path::PathBuf;
use std::process::Command;

use moelink_kernels::ll::{LlVariant, LL_SOURCE};

const EMU_PTX: &str = include_str!("../emu/ptx.cuh");
const EMU_MAIN: &str = include_str!("../emu/ll_emu.cpp");
/// Threads per block in the emulation (two warps: the "warp 0 waits, others work" split is exercised).
const EMU_THREADS: u32 = 64;

fn compiler() -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    match Command::new(&cxx).arg("--version").output() {
        Ok(o) if o.status.success() => Some(cxx),
        _ => {
            if std::env::var("MOELINK_REQUIRE_EMULATION").as_deref() == Ok("1") {
                panic!("MOELINK_REQUIRE_EMULATION=1 but no C++ compiler ({cxx}) runs");
            }
            None
        }
    }
}

fn run_variant(cxx: &str, v: LlVariant) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("moelink-ll-emu-{}-{}", std::process::id(), v.spec().variant.replace([',', '[', ']'], "_")));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("ll.cu"), LL_SOURCE).unwrap();
    std::fs::write(dir.join("ptx.cuh"), EMU_PTX).unwrap();
    std::fs::write(dir.join("ll_emu.cpp"), EMU_MAIN).unwrap();
    let bin = dir.join("ll_emu");
    let mut cmd = Command::new(cxx);
    cmd.args(["-std=c++17", "-O1", "-g0", "-ffp-contract=off", "-Wno-unknown-pragmas", "-DMOELINK_HOST_EMULATION"]);
    for (k, val) in &v.spec().defines {
        let val = if k == "LL_THREADS" { EMU_THREADS.to_string() } else { val.clone() };
        cmd.arg(format!("-D{k}={val}"));
    }
    cmd.arg("-I").arg(&dir).arg(dir.join("ll_emu.cpp")).arg("-o").arg(&bin).arg("-pthread");
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}: compiling the emulator failed:\n{}", v.spec().variant, String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&bin).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{}:\n{}", v.spec().variant, String::from_utf8_lossy(&run.stdout));
    assert!(
        run.status.success(),
        "{}: the emulated kernels disagree with the reference:\n{}\n{}",
        v.spec().variant,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}

macro_rules! emulate {
    ($($name:ident: $hidden:expr, $topk:expr, $fp8:expr;)*) => {$(
        #[test]
        fn $name() {
            let Some(cxx) = compiler() else {
                eprintln!("skipping the LL emulation: no C++ compiler");
                return;
            };
            run_variant(&cxx, LlVariant { hidden: $hidden, topk: $topk, fp8: $fp8 });
        }
    )*};
}

emulate! {
    fp8_hidden_1024_top4: 1024, 4, true;
    fp8_hidden_640_top3: 640, 3, true;
    bf16_hidden_264_top2: 264, 2, false;
    bf16_hidden_512_top8: 512, 8, false;
}
