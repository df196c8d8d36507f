//! Runs the RDMA transport seam (`cuda/transport.cuh`, through the kernels of `cuda/transport.cu`) on the CPU
//! emulator shared with the HT and LL tests (`emu/`, see `common/`), for the two backends that can run
//! without a GPU: `ptr` (peer pointers) and `emu-nic` (the emulated NIC, whose blocks run beside the
//! workers). `emu/transport_emu.cpp` checks conformance (every byte of every message, at 2–4 ranks, several
//! QPs, random sizes, reordering and delays), that the emulated NIC catches a planted ordering bug, its rate
//! cap, a silent peer (timeouts, no hang) and the micro-benchmark's modes.
//!
//! Index math and protocol only: the emulator does not model the GPU memory model or timing. Skips (printing
//! why) without a C++17 compiler unless `MOELINK_REQUIRE_EMU=1`.

mod common;

use moelink_kernels::transport::{Transport, TransportVariant, TRANSPORT_HEADER, TRANSPORT_SOURCE};

/// Threads per block in the emulation (eight warps: several warps per block post at once).
const EMU_THREADS: u32 = 256;

fn run(cxx: &str, transport: Transport) {
    let spec = TransportVariant { transport }.spec();
    let files = [("transport.cu", TRANSPORT_SOURCE), ("transport.cuh", TRANSPORT_HEADER)];
    let h = common::Harness {
        spec: &spec,
        files: &files,
        harness: "transport_emu.cpp",
        extra_flags: &["-DMOELINK_HOST_EMULATION"],
        override_: Some(("TRANSPORT_THREADS", EMU_THREADS.to_string())),
    };
    common::run_harness(cxx, &h, "the transport seam failed its emulation");
}

#[test]
fn peer_pointers_keep_the_contract() {
    let Some(cxx) = common::compiler() else {
        eprintln!("skipping the transport emulation: no C++ compiler");
        return;
    };
    run(&cxx, Transport::Ptr);
}

#[test]
fn the_emulated_nic_keeps_the_contract_and_catches_a_missing_fence() {
    let Some(cxx) = common::compiler() else {
        eprintln!("skipping the transport emulation: no C++ compiler");
        return;
    };
    run(&cxx, Transport::EmuNic);
}
