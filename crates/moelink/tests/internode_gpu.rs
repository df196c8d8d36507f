//! The internode foundation on the GPU, in thread mode: virtual nodes of one host (ranks share the visible
//! GPUs round-robin, so one GPU is enough), the RDMA transport seam's conformance on `ptr` and `emu-nic`, and
//! buffers that span virtual nodes. Ignored unless included (`--include-ignored`, on a machine with a CUDA
//! driver and GPU); the `nvshmem` backend needs one process per rank and runs from
//! `scripts/device/run.sh` step `internode` (`moelink selftest --process --transport nvshmem` under CUDA MPS).
//!
//! ```text
//! cargo test --release -p moelink --test internode_gpu -- --include-ignored --test-threads 1 --nocapture
//! ```

use std::sync::Arc;

use moelink::group::run_ranks;
use moelink::rdma_probe::{check, CheckMode, CheckOptions};
use moelink::{BackendKind, Buffer, BufferOptions, EmuNicOptions, Error, Group, RdmaOptions, Topology, Transport};

/// The visible GPU count (the tests that call this were included to run on a GPU: none is a failure).
fn gpus() -> usize {
    let n = moelink_cuda::Device::count().expect("a CUDA driver: this test runs on a GPU machine");
    assert!(n > 0, "no GPU visible: this test runs on a GPU machine");
    n
}

fn transports() -> [Transport; 3] {
    [
        Transport::Ptr,
        Transport::EmuNic(EmuNicOptions::default()),
        Transport::EmuNic(EmuNicOptions { delay_us: 20, nic_blocks: 2, seed: 7, ..EmuNicOptions::default() }),
    ]
}

fn rdma(transport: Transport, qps: usize) -> RdmaOptions {
    RdmaOptions { transport, num_qps_per_rank: qps, ..RdmaOptions::default() }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn the_seam_delivers_every_byte_before_its_signal_on_ptr_and_emu_nic() {
    let gpus = gpus();
    for ranks in [4, 8] {
        for t in transports() {
            for mode in [CheckMode::PutSignal, CheckMode::PutFenceSignal] {
                let o = CheckOptions { rdma: rdma(t, 4), mode, rounds: 3, messages: 128, max_bytes: 5000, ..CheckOptions::default() };
                let out = run_ranks(ranks, |g| check(&g, g.rank() % gpus, &o));
                let mut received = 0;
                for (rank, r) in out.into_iter().enumerate() {
                    let r = r.unwrap_or_else(|e| panic!("{} {ranks} ranks {mode:?}: rank {rank}: {e}", t.name()));
                    assert_eq!(r.wrong_bytes, 0, "{} {ranks} ranks {mode:?}: rank {rank} saw wrong bytes", t.name());
                    received += r.messages_received;
                }
                // Every message of every rank landed somewhere: 3 rounds x 128 messages x ranks.
                assert_eq!(received, 3 * 128 * ranks as u64, "{} {ranks} ranks {mode:?}", t.name());
                eprintln!("{} {ranks} ranks {mode:?}: {received} messages intact", t.name());
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn the_emulated_nic_catches_a_signal_sent_without_a_fence() {
    let gpus = gpus();
    let o = CheckOptions {
        // Data held up to 2 ms is still in flight when the receiver sees its early signal.
        rdma: rdma(Transport::EmuNic(EmuNicOptions { reorder_window_us: 1000, ..EmuNicOptions::default() }), 4),
        mode: CheckMode::PlantedBug,
        rounds: 4,
        messages: 256,
        max_bytes: 4096,
        ..CheckOptions::default()
    };
    let out = run_ranks(4, |g| check(&g, g.rank() % gpus, &o));
    let wrong: u64 = out.into_iter().map(|r| r.expect("the planted bug still completes").wrong_bytes).sum();
    eprintln!("planted bug on emu-nic: {wrong} bytes read before their data arrived");
    assert!(wrong > 0, "the emulated NIC must let a signal on another QP overtake its data");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn buffers_span_virtual_nodes_and_say_what_is_not_there_yet() {
    let gpus = gpus();
    for (nodes, per_node) in [(2, 2), (2, 4), (4, 2)] {
        for t in transports() {
            let topology = Topology { num_nodes: nodes, ranks_per_node: per_node };
            let out = run_ranks(nodes * per_node, |g| {
                let rank = g.rank();
                let opts = BufferOptions {
                    backend: BackendKind::Cuda,
                    device: Some(rank % gpus),
                    num_nvl_bytes: 1 << 20,
                    num_rdma_bytes: 1 << 20,
                    topology: Some(topology),
                    rdma: rdma(t, 2),
                    ..BufferOptions::default()
                };
                let mut buf = Buffer::new(Arc::new(g), opts)?;
                assert_eq!(buf.topology(), topology);
                // The barrier crosses the RDMA domain (transport_barrier), three times in a row.
                for _ in 0..3 {
                    buf.barrier()?;
                }
                Ok(buf.local_buffer(true)?.shape()[0])
            });
            for (rank, r) in out.into_iter().enumerate() {
                let len = r.unwrap_or_else(|e| panic!("{topology} {}: rank {rank}: {e}", t.name()));
                assert_eq!(len, 1 << 20, "the RDMA view is num_rdma_bytes long");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn a_missing_rank_is_named_by_the_transport_barrier() {
    let gpus = gpus();
    let topology = Topology { num_nodes: 2, ranks_per_node: 2 };
    let out = run_ranks(4, |g| {
        let rank = g.rank();
        let opts = BufferOptions {
            backend: BackendKind::Cuda,
            device: Some(rank % gpus),
            timeout_ms: 500,
            topology: Some(topology),
            rdma: rdma(Transport::EmuNic(EmuNicOptions::default()), 2),
            ..BufferOptions::default()
        };
        let group: Arc<dyn Group> = Arc::new(g);
        let mut buf = Buffer::new(group.clone(), opts)?;
        let r = if rank == 3 { Ok(()) } else { buf.barrier() };
        // The ranks that waited all end, naming rank 3; afterwards the buffer refuses work.
        let after = if rank == 3 { None } else { Some(matches!(buf.barrier(), Err(Error::Poisoned { .. }))) };
        group.barrier()?;
        Ok((r.err().map(|e| e.to_string()), after))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (err, refused) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        if rank == 3 {
            assert!(err.is_none());
            continue;
        }
        let err = err.unwrap_or_else(|| panic!("rank {rank}: no timeout although rank 3 never entered the barrier"));
        assert!(err.contains("for rank 3"), "rank {rank}: {err}");
        assert_eq!(refused, Some(true), "rank {rank}: the buffer must refuse work after the timeout");
    }
}
