//! The rules of the high-throughput calls across nodes, on the host backend (no GPU), which applies them as
//! the CUDA backend does: `get_dispatch_layout` returns the tokens per node; a buffer where not one token per
//! round fits is refused naming the region; after high-throughput calls low-latency calls are refused until
//! `clean_low_latency_buffer` (the two share the RDMA region, as in DeepEP); and the answers across nodes are
//! one node's, bit for bit (the combine's tree: docs/oracle.md).

use std::sync::Arc;

use moelink::group::run_ranks;
use moelink::internode::ht_bytes_needed;
use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, CombineArgs, DispatchArgs, Error, LlDispatchArgs, LlQuant, Payload, Result, Routing, Tensor,
    Topology,
};
use moelink_testkit::{route, Rng, RouteKind};

const HIDDEN: usize = 256;
const TOPK: usize = 4;
const EXPERTS: usize = 16;

fn opts(topology: Topology, num_nvl_bytes: usize, num_rdma_bytes: usize) -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        topology: Some(topology),
        num_nvl_bytes,
        num_rdma_bytes,
        low_latency_mode: true,
        ..BufferOptions::default()
    }
}

fn two_by_two() -> Topology {
    Topology { num_nodes: 2, ranks_per_node: 2 }
}

/// One rank's inputs: `tokens` tokens with node-skewed routing and bf16 rows.
fn inputs(rank: usize, tokens: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(0x5eed ^ rank as u64);
    let idx = route(&mut rng, RouteKind::Skewed, tokens, TOPK, EXPERTS, 4);
    let x: Vec<bf16> = (0..tokens * HIDDEN).map(|_| bf16::from_f64(rng.normal())).collect();
    let w: Vec<f32> = (0..tokens * TOPK).map(|_| rng.uniform() as f32).collect();
    (
        Tensor::from_vec(x, &[tokens, HIDDEN]).unwrap(),
        Tensor::from_vec(idx, &[tokens, TOPK]).unwrap(),
        Tensor::from_vec(w, &[tokens, TOPK]).unwrap(),
    )
}

/// Dispatch, experts (each received row doubled, some channels scaled up so that the summation order
/// matters), combine; returns the bytes of recv_x and combined_x.
fn round_trip(buf: &mut Buffer, tokens: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    let (x, idx, w) = inputs(buf.rank(), tokens);
    let layout = buf.get_dispatch_layout(idx.view(), EXPERTS)?;
    let d = buf.dispatch(&DispatchArgs {
        x: Payload::Bf16(x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })?;
    let rows: Vec<bf16> = d.recv_x.to_vec()?;
    let y: Vec<bf16> = rows.iter().enumerate().map(|(i, v)| bf16::from_f64(v.to_f64() * if i % 5 == 0 { 4096.0 } else { 2.0 })).collect();
    let y = Tensor::from_vec(y, &[rows.len() / HIDDEN, HIDDEN])?;
    let c = buf.combine(&CombineArgs { x: y.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None })?;
    Ok((d.recv_x.to_host_bytes()?, c.combined_x.to_host_bytes()?))
}

#[test]
fn the_layout_across_nodes_counts_tokens_per_node() {
    let out = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(two_by_two(), 1 << 24, 1 << 24))?;
        let (_, idx, _) = inputs(buf.rank(), 37);
        let l = buf.get_dispatch_layout(idx.view(), EXPERTS)?;
        let per_node: Vec<i32> = l.num_tokens_per_rdma_rank.as_ref().expect("across nodes").to_vec()?;
        let in_rank: Vec<bool> = l.is_token_in_rank.to_vec::<u8>()?.into_iter().map(|b| b != 0).collect();
        let want: Vec<i32> = (0..2).map(|n| (0..37).filter(|&t| (2 * n..2 * n + 2).any(|r| in_rank[t * 4 + r])).count() as i32).collect();
        Ok((per_node, want))
    });
    for r in out {
        let (got, want) = r.unwrap();
        assert_eq!(got, want, "num_tokens_per_rdma_rank");
    }
    let one_node = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(Topology::single_node(4), 1 << 24, 1 << 24))?;
        let (_, idx, _) = inputs(buf.rank(), 5);
        Ok(buf.get_dispatch_layout(idx.view(), EXPERTS)?.num_tokens_per_rdma_rank.is_none())
    });
    assert!(one_node.into_iter().all(|r| r.unwrap()), "one node: no tokens per node, as DeepEP's intranode layout");
}

#[test]
fn across_nodes_the_answers_are_one_nodes_bit_for_bit() {
    let need = ht_bytes_needed(two_by_two(), 16, HIDDEN, TOPK, false);
    let across = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(two_by_two(), need.num_nvl_bytes, need.num_rdma_bytes))?;
        let t = 60 - 13 * buf.rank();
        round_trip(&mut buf, t)
    });
    let one = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(Topology::single_node(4), 1 << 24, 1 << 24))?;
        let t = 60 - 13 * buf.rank();
        round_trip(&mut buf, t)
    });
    for (rank, (a, o)) in across.into_iter().zip(one).enumerate() {
        let (a, o) = (a.unwrap(), o.unwrap());
        assert!(a.0 == o.0, "rank {rank}: received rows differ between 2x2 and 1x4");
        assert!(a.1 == o.1, "rank {rank}: combined rows differ between 2x2 and 1x4");
    }
}

#[test]
fn a_buffer_without_one_token_per_round_is_refused_naming_the_region() {
    let out = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(two_by_two(), 1 << 24, 4096))?;
        round_trip(&mut buf, 8).map(|_| ())
    });
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Err(Error::BufferTooSmall { what, needed, available, .. }) => {
                assert!(what.contains("num_rdma_bytes"), "rank {rank}: {what}");
                assert_eq!(available, 4096);
                assert!(needed > available);
            }
            other => panic!("rank {rank}: expected BufferTooSmall naming num_rdma_bytes, got {other:?}"),
        }
    }
}

#[test]
fn low_latency_calls_after_high_throughput_ones_across_nodes_need_a_clean() {
    let out = run_ranks(4, |g| {
        let mut buf = Buffer::new(Arc::new(g), opts(two_by_two(), 1 << 24, 1 << 26))?;
        round_trip(&mut buf, 9)?;
        let (x, idx, _) = inputs(buf.rank(), 9);
        let ll = |buf: &mut Buffer| {
            buf.low_latency_dispatch(&LlDispatchArgs {
                x: x.view(),
                topk_idx: idx.view(),
                topk_weights: None,
                num_max_dispatch_tokens_per_rank: 16,
                num_experts: EXPERTS,
                quant: LlQuant::Bf16,
                return_recv_hook: false,
            })
            .map(|_| ())
        };
        let refused = ll(&mut buf);
        buf.clean_low_latency_buffer(16, HIDDEN, EXPERTS)?;
        let after_clean = ll(&mut buf);
        Ok((refused, after_clean))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (refused, after) = r.unwrap();
        match refused {
            Err(Error::InvalidArgument { arg: "buffer", reason, .. }) => {
                assert!(reason.contains("clean_low_latency_buffer"), "rank {rank}: {reason}")
            }
            other => panic!("rank {rank}: expected the low-latency call to be refused, got {other:?}"),
        }
        after.unwrap_or_else(|e| panic!("rank {rank}: after clean_low_latency_buffer: {e}"));
    }
}
