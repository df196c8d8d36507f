//! Runs the high-throughput kernels' real CUDA sources on the CPU and checks what they compute, on a machine
//! without a GPU. `emu/` holds the emulator (`runtime.hpp`: each block an OS thread, each CUDA thread a
//! fiber, warp collectives as rendezvous; `ptx_emu.hpp`: the `ptx` namespace of `ptx.cuh` as C++ atomics;
//! shared with `ll_emulation.rs` through `common/`) and a harness (`ht_harness.cpp`) that drives the
//! kernels like moelink's CUDA backend for R ranks in one process: layout, notify (CPU-sync and no-sync),
//! dispatch, combine with biases (also with the timing trace on: every stamp present and ordered), cached
//! dispatch, a second round in the same buffers (epochs, hand-back, changing row layouts), no-sync overflow,
//! a buffer too small for the call, an invalid `topk_idx`, layout tensors that disagree (per-expert counts
//! without tokens: notify's BAD_EXPERTS on every rank; a token kept from a rank its experts live on: the
//! sender's `is_token_in_rank` report), and a rank that never arrives (timeouts instead of hangs). Every output is compared with a reference; combine sums are checked bit for bit in the
//! documented order (the pairwise tree over ranks, `moelink::reduce`), which the 4- and 8-rank cases tell
//! apart from an ascending-rank sum.
//!
//! Needs `g++` (C++20). Without it the test prints why and passes, unless `MOELINK_REQUIRE_EMU=1`.
//! It cannot check the GPU memory model's weak orderings, timing or register use (see `compile_all.rs`).

mod common;

use std::path::Path;
use std::process::Command;

use moelink_kernels::ht::{combine_row_bytes, dispatch_row_bytes, HtCombineArgs, HtDispatchArgs, HtLayoutArgs, HtNotifyArgs};

/// One compiled configuration: rank count, row shape, and the block shapes to use.
#[derive(Clone, Copy, Debug)]
struct EmuCase {
    ranks: usize,
    hidden: usize,
    topk: usize,
    fp8: bool,
    local_experts: usize,
    /// 16-byte vectors per lane and copy round (small values exercise multi-round and partial rounds).
    max_unroll: usize,
    /// Experts whose counters one layout block owns (fewer than E: several ranges, some blocks owning more
    /// than one, since the harness launches at most two blocks).
    experts_per_block: usize,
    /// Rows a sender warp releases per fence (1, partial and whole batches).
    release_batch: usize,
    /// Sender chunk (tokens / rows per source; 0: contiguous parts), a multiple of release_batch as the
    /// backend passes it.
    send_chunk: usize,
    /// Receiver chunk (dispatch rows per source / combine tokens; 0: contiguous parts).
    recv_chunk: usize,
    /// Sender warps take chunks from the per-call counter (needs send_chunk > 0).
    dynamic_send: bool,
    /// The dispatch's per-expert tallies a block keeps in shared memory (fewer than the experts: global atomics).
    tally_slots: usize,
    /// A warp of each sender block releases the others' rows (`HT_RELEASER`).
    releaser: bool,
}

const HT: &str = include_str!("../cuda/ht.cuh");

fn strip_header(src: &str) -> String {
    src.lines().filter(|l| !l.starts_with("#pragma once") && !l.starts_with("#include")).collect::<Vec<_>>().join("\n")
}

fn family(name: &str, defines: &[(&str, String)], source: &str, ptx: &str) -> String {
    let mut s = String::new();
    for (k, v) in defines {
        s += &format!("#define {k} {v}\n");
    }
    s += &format!("namespace {name} {{\n{ptx}\n{}\n{}\n}}  // namespace {name}\n", strip_header(HT), strip_header(source));
    for (k, _) in defines {
        s += &format!("#undef {k}\n");
    }
    s
}

fn assemble(c: &EmuCase) -> String {
    let ptx = strip_header(&common::emulated_ptx());
    let warps = "2".to_string();
    let mut s = String::new();
    for (k, v) in [
        ("MAX_RANKS", moelink_kernels::abi::MAX_RANKS.to_string()),
        ("LAYOUT_THREADS", "64".into()),
        ("LAYOUT_EXPERTS_PER_BLOCK", c.experts_per_block.to_string()),
        ("NOTIFY_THREADS", "64".into()),
        ("MOELINK_SIZEOF_HT_LAYOUT_ARGS", std::mem::size_of::<HtLayoutArgs>().to_string()),
        ("MOELINK_SIZEOF_HT_NOTIFY_ARGS", std::mem::size_of::<HtNotifyArgs>().to_string()),
        ("EMU_RANKS", c.ranks.to_string()),
        ("EMU_HIDDEN", c.hidden.to_string()),
        ("EMU_TOPK", c.topk.to_string()),
        ("EMU_FP8", (c.fp8 as u32).to_string()),
        ("EMU_LOCAL_EXPERTS", c.local_experts.to_string()),
        ("EMU_SEND_CHUNK", c.send_chunk.to_string()),
        ("EMU_RECV_CHUNK", c.recv_chunk.to_string()),
        ("EMU_DYNAMIC_SEND", (c.dynamic_send as u32).to_string()),
    ] {
        s += &format!("#define {k} {v}\n");
    }
    s += "#include \"runtime.hpp\"\n";
    s += &family("k_layout", &[], moelink_kernels::HT_LAYOUT_SOURCE, &ptx);
    s += &family("k_notify", &[], moelink_kernels::HT_NOTIFY_SOURCE, &ptx);
    let dispatch = |hidden: usize, fp8: bool, topk: usize| {
        vec![
            ("HIDDEN", hidden.to_string()),
            ("FP8", (fp8 as u32).to_string()),
            ("TOPK", topk.to_string()),
            ("DISPATCH_WARPS", warps.clone()),
            ("MAX_UNROLL", c.max_unroll.to_string()),
            ("RELEASE_BATCH", c.release_batch.to_string()),
            ("HT_RELEASER", (c.releaser as u32).to_string()),
            ("HT_EXPERIMENT", "0".into()),
            ("HT_CE", "0".into()),
            ("ROW_BYTES", dispatch_row_bytes(hidden, fp8, topk).to_string()),
            ("MOELINK_SIZEOF_HT_DISPATCH_ARGS", std::mem::size_of::<HtDispatchArgs>().to_string()),
            ("DISPATCH_TALLY_SLOTS", c.tally_slots.to_string()),
        ]
    };
    s += &family("k_disp", &dispatch(c.hidden, c.fp8, c.topk), moelink_kernels::HT_DISPATCH_SOURCE, &ptx);
    s += &family("k_disp0", &dispatch(c.hidden, false, 0), moelink_kernels::HT_DISPATCH_SOURCE, &ptx);
    let combine = |num_biases: u32| {
        vec![
            ("NUM_RANKS", c.ranks.to_string()),
            ("HIDDEN", c.hidden.to_string()),
            ("TOPK", c.topk.to_string()),
            ("COMBINE_WARPS", warps.clone()),
            ("MAX_UNROLL", c.max_unroll.to_string()),
            ("RELEASE_BATCH", c.release_batch.to_string()),
            ("HT_RELEASER", (c.releaser as u32).to_string()),
            ("HT_EXPERIMENT", "0".into()),
            ("REDUCE_LOAD_VECS", "4".into()),
            ("NUM_BIASES", num_biases.to_string()),
            ("HT_CE", "0".into()),
            ("ROW_BYTES", combine_row_bytes(c.hidden, c.topk).to_string()),
            ("MOELINK_SIZEOF_HT_COMBINE_ARGS", std::mem::size_of::<HtCombineArgs>().to_string()),
        ]
    };
    s += &family("k_comb", &combine(2), moelink_kernels::HT_COMBINE_SOURCE, &ptx);
    s += &family("k_comb0", &combine(0), moelink_kernels::HT_COMBINE_SOURCE, &ptx);
    s += "#include \"ht_harness.cpp\"\n";
    s
}

fn run_case(cxx: &str, c: &EmuCase, dir: &Path) -> Result<String, String> {
    let name = format!("r{}_h{}_k{}_{}", c.ranks, c.hidden, c.topk, if c.fp8 { "fp8" } else { "bf16" });
    let src = dir.join(format!("{name}.cpp"));
    let bin = dir.join(&name);
    std::fs::write(&src, assemble(c)).map_err(|e| e.to_string())?;
    let flags = ["-std=c++20", "-O1", "-g", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unused"];
    common::compile(cxx, flags, dir, &src, &bin).map_err(|e| format!("{name}: compile failed:\n{e}"))?;
    let run = Command::new(&bin).output().map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    if run.status.success() {
        Ok(format!("{name}:\n{text}"))
    } else {
        Err(format!("{name} ({:?}):\n{text}", run.status))
    }
}

#[test]
fn ht_kernels_run_on_the_cpu_emulator() {
    let Some(cxx) = common::compiler() else {
        eprintln!("skipping the CPU emulation of the HT kernels: no C++ compiler (g++ or $CXX)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("moelink-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let cases = [
        EmuCase {
            ranks: 2,
            hidden: 1000,
            topk: 4,
            fp8: false,
            local_experts: 4,
            max_unroll: 3,
            experts_per_block: 64,
            release_batch: 1,
            send_chunk: 0,
            recv_chunk: 0,
            dynamic_send: false,
            tally_slots: 2048,
            releaser: false,
        },
        EmuCase {
            ranks: 4,
            hidden: 256,
            topk: 8,
            fp8: true,
            local_experts: 8,
            max_unroll: 8,
            experts_per_block: 16,
            release_batch: 4,
            send_chunk: 8,
            recv_chunk: 8,
            dynamic_send: true,
            tally_slots: 16,
            releaser: true,
        },
        EmuCase {
            ranks: 3,
            hidden: 64,
            topk: 2,
            fp8: false,
            local_experts: 2,
            max_unroll: 1,
            experts_per_block: 64,
            release_batch: 2,
            send_chunk: 2,
            recv_chunk: 1,
            dynamic_send: false,
            tally_slots: 2048,
            releaser: true,
        },
        EmuCase {
            ranks: 1,
            hidden: 128,
            topk: 4,
            fp8: false,
            local_experts: 4,
            max_unroll: 8,
            experts_per_block: 64,
            release_batch: 3,
            send_chunk: 6,
            recv_chunk: 3,
            dynamic_send: true,
            tally_slots: 2048,
            releaser: false,
        },
        EmuCase {
            ranks: 8,
            hidden: 32,
            topk: 8,
            fp8: false,
            local_experts: 8,
            max_unroll: 8,
            experts_per_block: 64,
            release_batch: 8,
            send_chunk: 8,
            recv_chunk: 2,
            dynamic_send: true,
            tally_slots: 4,
            releaser: true,
        },
        EmuCase {
            ranks: 2,
            hidden: 136,
            topk: 1,
            fp8: false,
            local_experts: 3,
            max_unroll: 2,
            experts_per_block: 1,
            release_batch: 5,
            send_chunk: 5,
            recv_chunk: 0,
            dynamic_send: true,
            tally_slots: 2048,
            releaser: true,
        },
    ];
    let only = std::env::var("MOELINK_EMU_CASE").ok();
    let mut failures = Vec::new();
    for c in &cases {
        if only.as_deref().is_some_and(|o| !format!("{c:?}").contains(o)) {
            continue;
        }
        match run_case(&cxx, c, &dir) {
            Ok(report) => eprintln!("{report}"),
            Err(e) => failures.push(e),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "emulated HT kernels failed:\n{}", failures.join("\n"));
}
