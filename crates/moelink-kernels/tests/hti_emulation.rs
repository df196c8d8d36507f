//! Runs the high-throughput kernels across nodes (`cuda/hti_*.cu` over `hti.cuh`) on the CPU emulator shared with the
//! other kernel tests (`emu/`, see `common/`): `emu/hti_emu.cpp` drives R ranks as virtual nodes over the
//! RDMA transport seam — peer pointers, or the emulated NIC reordering across QPs — with rounds of a few
//! tokens (so that every call runs several rounds of several chunks), and checks every output against a
//! reference written from the documented semantics: the layout, received rows, scales, top-k ids and
//! weights, recv_src_idx, rank_prefix_matrix, per-expert counts, a cached dispatch, no-sync padding rows,
//! and the combined output and weights bit for bit (the hierarchical fp32 tree); zero tokens, one token,
//! skewed and node-limited routing; a slow rank; a silent rank (a timeout naming a peer and a domain, no
//! hang); a variant without top-k (what a cached dispatch runs).
//!
//! Index math and protocol only (not the GPU memory model or timing). Skips (printing why) without a C++17
//! compiler unless `MOELINK_REQUIRE_EMU=1`.

mod common;

use moelink_kernels::ht_internode::{
    HtiVariant, HTI_COMBINE_SOURCE, HTI_DISPATCH_SOURCE, HTI_HEADER, HTI_LAYOUT_SOURCE, HTI_NOTIFY_SOURCE,
};
use moelink_kernels::transport::{Transport, TRANSPORT_HEADER};

/// Warps per block in the emulation.
const EMU_WARPS: u32 = 2;

/// `tally_slots`: the dispatch's shared-memory tallies (`DISPATCH_TALLY_SLOTS`), fewer than the experts to
/// reach the global atomics.
fn run_variant(cxx: &str, v: HtiVariant, tally_slots: Option<u32>) {
    // Every kernel file takes the same constants: the dispatch's key names the build.
    let spec = v.dispatch_spec();
    let files = [
        ("hti.cuh", HTI_HEADER),
        ("hti_layout.cu", HTI_LAYOUT_SOURCE),
        ("hti_notify.cu", HTI_NOTIFY_SOURCE),
        ("hti_dispatch.cu", HTI_DISPATCH_SOURCE),
        ("hti_combine.cu", HTI_COMBINE_SOURCE),
        ("transport.cuh", TRANSPORT_HEADER),
    ];
    // The kernels once more without top-k (the cached dispatch's TOPK 0): the layout a rank without tokens
    // launched when its host picked the variant from topk_idx's address, for the variant-mismatch scenario
    // (run when this variant carries top-k).
    let peer = HtiVariant { topk: 0, ..v }.dispatch_spec();
    let mut peer_flags: Vec<String> = ["TOPK", "HTI_MSG_BYTES", "HTI_ROW_BYTES", "HTI_COMBINE_ROW_BYTES", "HTI_COMBINE_MSG_BYTES"]
        .iter()
        .map(|name| format!("-DHTI_EMU_PEER_{name}={}", peer.define(name).expect("every HT-internode spec defines it")))
        .collect();
    peer_flags.extend(tally_slots.map(|n| format!("-DDISPATCH_TALLY_SLOTS={n}")));
    let peer_flags: Vec<&str> = peer_flags.iter().map(String::as_str).collect();
    let h = common::Harness {
        spec: &spec,
        files: &files,
        harness: "hti_emu.cpp",
        extra_flags: &peer_flags,
        override_: Some(("HTI_WARPS", EMU_WARPS.to_string())),
    };
    common::run_harness(cxx, &h, "the emulated kernels disagree with the reference");
}

macro_rules! emulate {
    ($($name:ident: $nodes:expr, $rpn:expr, $hidden:expr, $fp8:expr, $topk:expr, $biases:expr, $transport:expr, $tally:expr;)*) => {$(
        #[test]
        fn $name() {
            let Some(cxx) = common::compiler() else {
                eprintln!("skipping the internode HT emulation: no C++ compiler");
                return;
            };
            run_variant(&cxx, HtiVariant {
                hidden: $hidden, fp8: $fp8, topk: $topk, num_biases: $biases, num_nodes: $nodes, ranks_per_node: $rpn,
                transport: $transport,
            }, $tally);
        }
    )*};
}

emulate! {
    emu_nic_2x2_fp8_hidden_256_top4: 2, 2, 256, true, 4, 1, Transport::EmuNic, None;
    ptr_2x2_bf16_hidden_128_top3: 2, 2, 128, false, 3, 2, Transport::Ptr, None;
    // The tallies in global atomics (fewer shared slots than experts).
    emu_nic_4x2_bf16_hidden_64_top8: 4, 2, 64, false, 8, 0, Transport::EmuNic, Some(2);
    ptr_2x4_fp8_hidden_128_top6: 2, 4, 128, true, 6, 2, Transport::Ptr, Some(2);
    emu_nic_3x1_bf16_hidden_32_top2: 3, 1, 32, false, 2, 0, Transport::EmuNic, None;
    // No top-k travelling with the rows: the cached dispatch's variant.
    emu_nic_2x2_bf16_hidden_128_top0: 2, 2, 128, false, 0, 1, Transport::EmuNic, None;
}
