//! Topology and RDMA options at buffer creation, on the host backend (no GPU): the launcher's layout is
//! detected, virtual nodes are accepted, and bad combinations are refused naming the argument and the rank.

use std::sync::Arc;

use moelink::group::run_ranks;
use moelink::{BackendKind, Buffer, BufferOptions, RdmaOptions, Topology};

fn host(topology: Option<Topology>, rdma: RdmaOptions) -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        topology,
        rdma,
        num_nvl_bytes: 1 << 20,
        num_rdma_bytes: 1 << 20,
        ..BufferOptions::default()
    }
}

#[test]
fn the_launchers_layout_is_one_node_for_threads() {
    let out = run_ranks(4, |g| Ok(Buffer::new(Arc::new(g), host(None, RdmaOptions::default()))?.topology()));
    for t in out {
        assert_eq!(t.unwrap(), Topology::single_node(4));
    }
}

#[test]
fn virtual_nodes_are_accepted() {
    for (nodes, per_node) in [(2, 2), (4, 1), (1, 4)] {
        let t = Topology { num_nodes: nodes, ranks_per_node: per_node };
        let out = run_ranks(4, |g| Ok(Buffer::new(Arc::new(g), host(Some(t), RdmaOptions::default()))?.topology()));
        for r in out {
            assert_eq!(r.unwrap(), t);
        }
    }
}

#[test]
fn bad_topologies_and_rdma_options_are_refused_by_name() {
    let cases: Vec<(Topology, RdmaOptions, &str, &str)> = vec![
        (Topology { num_nodes: 3, ranks_per_node: 1 }, RdmaOptions::default(), "topology", "not the group's 4 ranks"),
        (Topology { num_nodes: 0, ranks_per_node: 4 }, RdmaOptions::default(), "topology", "must be positive"),
        (
            Topology { num_nodes: 2, ranks_per_node: 2 },
            RdmaOptions { num_qps_per_rank: 0, ..RdmaOptions::default() },
            "num_qps_per_rank",
            "must be positive",
        ),
        (
            Topology { num_nodes: 2, ranks_per_node: 2 },
            RdmaOptions { address_family: Some("ipv4".into()), ..RdmaOptions::default() },
            "address_family",
            "AF_INET",
        ),
    ];
    for (t, rdma, arg, text) in cases {
        let out = run_ranks(4, |g| Buffer::new(Arc::new(g), host(Some(t), rdma.clone())).map(|_| ()));
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("refused");
            assert_eq!(e.argument(), Some(arg), "{t}: {e}");
            let msg = e.to_string();
            assert!(msg.contains(text) && msg.contains(&format!("rank {rank}")), "{t}: {msg}");
        }
    }
    // More ranks per node than an NVLink domain holds.
    let out = run_ranks(9, |g| {
        Buffer::new(Arc::new(g), host(Some(Topology { num_nodes: 1, ranks_per_node: 9 }), RdmaOptions::default())).map(|_| ())
    });
    for r in out {
        let e = r.expect_err("refused");
        assert!(e.to_string().contains("at most 8"), "{e}");
    }
}
