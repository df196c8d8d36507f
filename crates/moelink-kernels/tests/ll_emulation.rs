//! Runs the low-latency kernels (`cuda/ll_dispatch.cu`, `cuda/ll_combine.cu`) on the CPU: `emu/ll_emu.cpp` compiles them with the host C++
//! compiler on the emulator shared with `emulate_ht.rs` (`emu/runtime.hpp`: one OS thread per block, one
//! fiber per CUDA thread; `emu/ptx_emu.hpp` spliced into the real `ptx.cuh`, see `common/`) and checks, rank
//! by rank, what they write against references computed from the documented semantics: counts, every valid
//! row and scale, combined outputs bit for bit, hooks (two in flight), drained hooks, masks, shrink-mode
//! and hard timeouts, argument problems and signature mismatches reported on every rank.
//!
//! This checks index math and the flag protocol without a GPU; it is not a memory-model or timing test.
//! Skips (printing why) without a C++17 compiler (`g++`, or `$CXX`), unless `MOELINK_REQUIRE_EMU=1`.

mod common;

use moelink_kernels::ll::{experiment, LlVariant, LL_COMBINE_SOURCE, LL_DISPATCH_SOURCE, LL_HEADER};

/// Threads per block in the emulation (two warps: the "warp 0 waits, others work" split is exercised).
const EMU_THREADS: u32 = 64;

fn run_variant(cxx: &str, v: LlVariant) {
    let spec = v.dispatch_spec();
    assert_eq!(spec.defines, v.combine_spec().defines, "one build holds both kernels");
    // The sources (and emu/ll_emu.cpp, through -I) include the build folder's "ptx.cuh": the emulated one.
    let files = [("ll.cuh", LL_HEADER), ("ll_dispatch.cu", LL_DISPATCH_SOURCE), ("ll_combine.cu", LL_COMBINE_SOURCE)];
    let h = common::Harness {
        spec: &spec,
        files: &files,
        harness: "ll_emu.cpp",
        extra_flags: &[],
        override_: Some(("LL_THREADS", EMU_THREADS.to_string())),
    };
    common::run_harness(cxx, &h, "the emulated kernels disagree with the reference");
}

macro_rules! emulate {
    ($($name:ident: $hidden:expr, $topk:expr, $fp8:expr, $experiment:expr;)*) => {$(
        #[test]
        fn $name() {
            let Some(cxx) = common::compiler() else {
                eprintln!("skipping the LL emulation: no C++ compiler");
                return;
            };
            run_variant(&cxx, LlVariant { hidden: $hidden, topk: $topk, fp8: $fp8, experiment: $experiment });
        }
    )*};
}

// The last_arrives timing experiment keeps results right: its build (a JIT constant) runs every scenario too.
emulate! {
    fp8_hidden_1024_top4: 1024, 4, true, 0;
    fp8_hidden_640_top3: 640, 3, true, 0;
    bf16_hidden_264_top2: 264, 2, false, 0;
    bf16_hidden_512_top8: 512, 8, false, 0;
    last_arrives_bf16_hidden_264_top2: 264, 2, false, experiment::LAST_ARRIVES;
}
