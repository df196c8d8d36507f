//! Runs the low-latency kernels across nodes (`cuda/lli_*.cu` over `lli.cuh`) on the CPU emulator shared with the
//! other kernel tests (`emu/`, see `common/`): `emu/lli_emu.cpp` drives R ranks over the RDMA transport seam
//! — peer pointers, or the emulated NIC reordering across QPs — as 2 × 2 and 3 × 1 virtual nodes (with and
//! without NVLink inside a node), and checks every output against `emu/ll_reference.hpp`, the documented
//! semantics the single-node harness is checked against too: rows, scales, counts, src_info, layout_range,
//! the combined output bit for bit; hooks, zero-copy, shrink masks, a silent rank (timeout / masked).
//!
//! Index math and protocol only (not the GPU memory model or timing). Skips (printing why) without a C++17
//! compiler unless `MOELINK_REQUIRE_EMU=1`.

mod common;

use moelink_kernels::ll::{LlVariant, LL_HEADER};
use moelink_kernels::ll_internode::{LliVariant, LLI_COMBINE_SOURCE, LLI_DISPATCH_SOURCE, LLI_HEADER};
use moelink_kernels::transport::{Transport, TRANSPORT_HEADER};

/// Threads per block in the emulation (two warps).
const EMU_THREADS: u32 = 64;

fn run_variant(cxx: &str, v: LliVariant) {
    // Both kernel files take the same constants: the dispatch's key names the build.
    let spec = v.dispatch_spec();
    let files = [
        ("ll.cuh", LL_HEADER),
        ("lli.cuh", LLI_HEADER),
        ("lli_dispatch.cu", LLI_DISPATCH_SOURCE),
        ("lli_combine.cu", LLI_COMBINE_SOURCE),
        ("transport.cuh", TRANSPORT_HEADER),
    ];
    let h = common::Harness {
        spec: &spec,
        files: &files,
        harness: "lli_emu.cpp",
        extra_flags: &[],
        override_: Some(("LL_THREADS", EMU_THREADS.to_string())),
    };
    common::run_harness(cxx, &h, "the emulated kernels disagree with the reference");
}

macro_rules! emulate {
    ($($name:ident: $hidden:expr, $topk:expr, $fp8:expr, $transport:expr;)*) => {$(
        #[test]
        fn $name() {
            let Some(cxx) = common::compiler() else {
                eprintln!("skipping the internode LL emulation: no C++ compiler");
                return;
            };
            run_variant(&cxx, LliVariant { ll: LlVariant::new($hidden, $topk, $fp8), transport: $transport });
        }
    )*};
}

emulate! {
    emu_nic_fp8_hidden_1024_top4: 1024, 4, true, Transport::EmuNic;
    ptr_fp8_hidden_640_top3: 640, 3, true, Transport::Ptr;
    emu_nic_bf16_hidden_264_top2: 264, 2, false, Transport::EmuNic;
    ptr_bf16_hidden_512_top8: 512, 8, false, Transport::Ptr;
    // More 512-byte chunks than the emulation's two warps: a sending warp holds several (3 and 2).
    emu_nic_bf16_hidden_1032_top4: 1032, 4, false, Transport::EmuNic;
    ptr_fp8_hidden_2048_top8: 2048, 8, true, Transport::Ptr;
}
