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

use std::path::PathBuf;
use std::process::Command;

use moelink_kernels::transport::{Transport, TransportVariant, TRANSPORT_HEADER, TRANSPORT_SOURCE};

/// Threads per block in the emulation (eight warps: several warps per block post at once).
const EMU_THREADS: u32 = 256;

fn run(cxx: &str, transport: Transport) {
    let spec = TransportVariant { transport }.spec();
    let dir: PathBuf = std::env::temp_dir().join(format!("moelink-transport-emu-{}-{}", std::process::id(), transport.name()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("transport.cu"), TRANSPORT_SOURCE).unwrap();
    std::fs::write(dir.join("transport.cuh"), TRANSPORT_HEADER).unwrap();
    std::fs::write(dir.join("ptx.cuh"), common::emulated_ptx()).unwrap();
    let bin = dir.join("transport_emu");
    let mut flags: Vec<String> = ["-std=c++17", "-O1", "-g0", "-Wno-unknown-pragmas", "-DMOELINK_HOST_EMULATION"].map(String::from).into();
    for (k, v) in &spec.defines {
        let v = if k == "TRANSPORT_THREADS" { EMU_THREADS.to_string() } else { v.clone() };
        flags.push(format!("-D{k}={v}"));
    }
    if let Err(e) = common::compile(cxx, &flags, &dir, &common::emu_dir().join("transport_emu.cpp"), &bin) {
        panic!("{}: compiling the emulator failed:\n{e}", spec.variant);
    }
    let out = Command::new(&bin).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{}:\n{}", spec.variant, String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "{}: the transport seam failed its emulation:\n{}\n{}",
        spec.variant,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
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
