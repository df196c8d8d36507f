//! What a case moves: bytes per rank (logical and on the wire) and, across nodes, per path (RDMA, NVLink).

use super::*;

/// Bytes per rank (mean over ranks) that a case moves: (logical, wire).
pub(super) fn bytes_moved(case: &Case, inputs: &Inputs) -> (f64, f64) {
    let s = &inputs.shape;
    let r = &inputs.reference;
    let n = s.ranks as f64;
    match case.mode {
        Mode::Ht => {
            let row = match (case.op, case.dtype) {
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4,
                _ => 2 * s.hidden,
            } as f64;
            let recv: usize = r.recv_rows.iter().map(|v| v.len()).sum();
            let own: usize = (0..s.ranks).map(|k| r.own_rows(k)).sum();
            (recv as f64 * row / n, (recv - own) as f64 * row / n)
        }
        Mode::Ll => {
            let row = match (case.op, case.dtype) {
                // DeepEP counts 16 bytes of per-token metadata with each FP8 row.
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4 + 16,
                _ => 2 * s.hidden,
            } as f64;
            let sel: usize = r.selections.iter().sum();
            let cross: usize = r.cross_pairs.iter().sum();
            (sel as f64 * row / n, cross as f64 * row / n)
        }
    }
}

/// Bytes each rank sends over each path in one low-latency call across nodes.
pub(super) struct PathBytes {
    pub(super) rdma: Vec<usize>,
    pub(super) nvlink: Vec<usize>,
}

/// The internode byte model (`docs/internode.md`) on these inputs: one message per (token, distinct
/// destination rank); dispatch sends [`moelink::internode::ll_message_bytes`] from the token's rank, combine
/// a bf16 row back from the destination (pre-reduced: dispatch carries the weights). A message to a rank of
/// the sender's own node goes over NVLink when `nvlink_in_node`, over RDMA otherwise; one to itself nowhere.
/// Meta blocks (a few hundred bytes per peer) are not counted.
pub(super) fn ll_path_bytes(case: &Case, inputs: &Inputs, topology: &moelink::Topology, nvlink_in_node: bool) -> PathBytes {
    let s = &inputs.shape;
    let mut paths = PathBytes { rdma: vec![0; s.ranks], nvlink: vec![0; s.ranks] };
    let msg = match case.op {
        Op::Dispatch => moelink::internode::ll_message_bytes(s.hidden, s.topk, case.dtype == Dtype::Fp8),
        Op::Combine => 2 * s.hidden,
    };
    let experts_per_rank = s.local_experts().max(1);
    for (src, r) in inputs.ranks.iter().enumerate() {
        for token in r.topk_idx.chunks(s.topk.max(1)) {
            let mut dests: Vec<usize> = token.iter().filter(|&&e| e >= 0).map(|&e| e as usize / experts_per_rank).collect();
            dests.sort_unstable();
            dests.dedup();
            for dst in dests.into_iter().filter(|&d| d != src && d < s.ranks) {
                let sender = if case.op == Op::Dispatch { src } else { dst };
                let receiver = if case.op == Op::Dispatch { dst } else { src };
                if nvlink_in_node && topology.node_of(sender) == topology.node_of(receiver) {
                    paths.nvlink[sender] += msg;
                } else {
                    paths.rdma[sender] += msg;
                }
            }
        }
    }
    paths
}

/// DeepEP's internode accounting for the high-throughput calls (its `test_internode.py`), per rank: RDMA
/// bytes = the rank's tokens times their distinct destination nodes (its own node included) times the row;
/// NVLink bytes = the rows the rank receives times the row. Rows: FP8 `H + 4 H / 128`, bf16 `2 H`; combine
/// moves bf16 rows back the same ways. What crosses a NIC is less (a token's own node is not); `moelink
/// bench bytes` counts both.
pub(super) fn ht_path_bytes(case: &Case, inputs: &Inputs, topology: &moelink::Topology) -> PathBytes {
    let s = &inputs.shape;
    let row = match (case.op, case.dtype) {
        (Op::Dispatch, Dtype::Fp8) => s.hidden + 4 * s.hidden / 128,
        _ => 2 * s.hidden,
    };
    let mut paths = PathBytes { rdma: vec![0; s.ranks], nvlink: vec![0; s.ranks] };
    let experts_per_rank = s.local_experts().max(1);
    for (src, r) in inputs.ranks.iter().enumerate() {
        for token in r.topk_idx.chunks(s.topk.max(1)) {
            let mut ranks: Vec<usize> = token.iter().filter(|&&e| e >= 0).map(|&e| e as usize / experts_per_rank).collect();
            ranks.sort_unstable();
            ranks.dedup();
            let mut nodes: Vec<usize> = ranks.iter().map(|&d| topology.node_of(d)).collect();
            nodes.dedup();
            paths.rdma[src] += nodes.len() * row;
            for d in ranks.into_iter().filter(|&d| d < s.ranks) {
                paths.nvlink[d] += row;
            }
        }
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn across_nodes_the_ll_bytes_split_by_path() {
        // 4 ranks as 2x2, one expert per rank; token 0 of rank 0 picks experts 0 (itself), 1 (its node) and
        // 2, 3 (the other node); token 1 picks expert 3 twice and a -1 slot.
        let shape = Shape { ranks: 4, tokens: 2, hidden: 256, topk: 4, experts: 4 };
        let mut inputs = Inputs::generate(shape, RouteKind::Uniform, 1, false);
        for (r, rank) in inputs.ranks.iter_mut().enumerate() {
            rank.topk_idx = if r == 0 { vec![0, 1, 2, 3, 3, 3, -1, -1] } else { vec![-1; 8] };
        }
        let topology: moelink::Topology = "2x2".parse().unwrap();
        let case = |op, dtype| Case { mode: Mode::Ll, op, dtype, routing: RoutingKind::Uniform, num_sms: None };
        let msg = moelink::internode::ll_message_bytes(256, 4, true);
        let d = ll_path_bytes(&case(Op::Dispatch, Dtype::Fp8), &inputs, &topology, true);
        assert_eq!((d.rdma, d.nvlink), (vec![3 * msg, 0, 0, 0], vec![msg, 0, 0, 0]));
        let d = ll_path_bytes(&case(Op::Dispatch, Dtype::Fp8), &inputs, &topology, false);
        assert_eq!((d.rdma, d.nvlink), (vec![4 * msg, 0, 0, 0], vec![0; 4]));
        // Combine: each destination returns one bf16 row per message it received.
        let c = ll_path_bytes(&case(Op::Combine, Dtype::Bf16), &inputs, &topology, true);
        assert_eq!((c.rdma, c.nvlink), (vec![0, 0, 512, 1024], vec![0, 512, 0, 0]));
    }

    #[test]
    fn ht_bytes_follow_deepep_accounting() {
        let shape = Shape { ranks: 2, tokens: 16, hidden: 256, topk: 2, experts: 4 };
        let inputs = Inputs::generate(shape, RouteKind::Uniform, 1, false);
        let recv: usize = inputs.reference.recv_rows.iter().map(|v| v.len()).sum();
        let c = Case { mode: Mode::Ht, op: Op::Dispatch, dtype: Dtype::Fp8, routing: RoutingKind::Uniform, num_sms: None };
        let (logical, wire) = bytes_moved(&c, &inputs);
        assert_eq!(logical, recv as f64 * (256.0 + 2.0 * 4.0) / 2.0);
        assert!(wire < logical);
    }
}
