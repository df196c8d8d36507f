//! `moelink bench bytes`: the byte model of dispatch and combine across nodes, computed from routing alone
//! (no GPU, no collective): for each topology, what every rank sends over RDMA and receives over NVLink, and
//! the time the busiest NIC needs for it at a given rate — the floor a cluster run can approach.
//!
//! High-throughput (DeepEP's hierarchical design, which moelink's internode HT follows): a token crosses RDMA
//! once per distinct destination node, to the rank with its own local index there, and is forwarded over
//! NVLink to the ranks of that node hosting its experts; combine returns one partial per (token, node), summed
//! on that node first. `rdma_bytes` is DeepEP's accounting (every destination node, the sender's own included:
//! its test divides that by the time); `nic_send_bytes` / `nic_recv_bytes` count only other nodes, which is
//! what crosses a NIC; `nvl_bytes` is the rows a rank receives. Low-latency (moelink's internode LL): one
//! message per (token, distinct destination rank), peers of the same node over NVLink.
//!
//! Records use mode `"model"` and carry `nodes`, `ranks_per_node`; times are computed, never measured.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use moelink::Topology;
use moelink_testkit::{route, Rng, RouteKind};

use crate::record::{self, Record, RunFacts, Status};
use crate::table::Table;
use crate::{sys, CliError};

/// Routing of `moelink bench bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BytesRouting {
    /// DeepSeek-V3's group-limited gating, one group per node: each token's experts on at most --max-nodes
    /// nodes.
    NodeLimited,
    /// Scores |randn| + 1, top-k over all experts.
    Uniform,
}

/// Options of `moelink bench bytes`.
#[derive(Args, Debug, Clone)]
pub struct BytesArgs {
    /// Topologies as NODESxRANKS_PER_NODE, comma-separated (default: DeepEP's EP16, EP32, EP64 on 8-GPU
    /// nodes).
    #[arg(long, value_delimiter = ',', default_value = "2x8,4x8,8x8")]
    pub topology: Vec<String>,
    /// High-throughput tokens per rank.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Low-latency tokens per rank.
    #[arg(long = "ll-tokens", default_value_t = 128)]
    pub ll_tokens: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub topk: usize,
    /// Experts in total (a multiple of the ranks and of the nodes).
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
    /// Routing.
    #[arg(long, value_enum, default_value_t = BytesRouting::NodeLimited)]
    pub routing: BytesRouting,
    /// With node-limited routing: the most nodes a token's experts may be on (DeepSeek-V3: 4).
    #[arg(long, default_value_t = 4)]
    pub max_nodes: usize,
    /// NIC rate per GPU in GB/s each way (400 Gb/s: 50).
    #[arg(long, default_value_t = 50.0)]
    pub nic_gbps: f64,
    /// Seed of the routing.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the records to FILE (a JSON list).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Per-rank counts of one topology's routing, in tokens/rows/messages (bytes come from the row sizes).
#[derive(Debug, Default, PartialEq)]
struct Counts {
    /// HT: (token, destination node) pairs each rank sends, its own node included (DeepEP's accounting).
    ht_node_pairs: Vec<usize>,
    /// HT: pairs to other nodes each rank sends over its NIC (dispatch), and that each rank receives over its
    /// NIC as the rail peer (same local index) of the sources.
    ht_nic_send: Vec<usize>,
    ht_nic_recv: Vec<usize>,
    /// HT: of those pairs, the ones whose node holds the token on two or more ranks (moelink's combine sends
    /// their partial home in fp32, the others' as the one holder's bf16 row): all, sent, received.
    ht_node_multi: Vec<usize>,
    ht_nic_multi_send: Vec<usize>,
    ht_nic_multi_recv: Vec<usize>,
    /// HT: rows each rank receives (what arrives over NVLink, forwarded or from its own node).
    ht_recv_rows: Vec<usize>,
    /// LL: messages each rank sends to / receives from ranks of other nodes, and to / from its own node.
    ll_nic_send: Vec<usize>,
    ll_nic_recv: Vec<usize>,
    ll_nvl_send: Vec<usize>,
    /// Mean distinct destination nodes per HT token.
    nodes_per_token: f64,
}

/// Counts for `topology` over every rank's routing (`routing[r]`: `topk_idx [T, K]` of rank `r`).
fn count(topology: &Topology, routing: &[Vec<i64>], topk: usize, experts: usize) -> Counts {
    let ranks = topology.num_ranks();
    let per_rank = (experts / ranks).max(1);
    let mut c = Counts {
        ht_node_pairs: vec![0; ranks],
        ht_nic_send: vec![0; ranks],
        ht_nic_recv: vec![0; ranks],
        ht_node_multi: vec![0; ranks],
        ht_nic_multi_send: vec![0; ranks],
        ht_nic_multi_recv: vec![0; ranks],
        ht_recv_rows: vec![0; ranks],
        ll_nic_send: vec![0; ranks],
        ll_nic_recv: vec![0; ranks],
        ll_nvl_send: vec![0; ranks],
        nodes_per_token: 0.0,
    };
    let (mut tokens, mut node_pairs) = (0usize, 0usize);
    for (src, idx) in routing.iter().enumerate() {
        let home = topology.node_of(src);
        for token in idx.chunks(topk.max(1)) {
            let mut dests: Vec<usize> = token.iter().filter(|&&e| e >= 0).map(|&e| (e as usize / per_rank).min(ranks - 1)).collect();
            dests.sort_unstable();
            dests.dedup();
            let mut nodes: Vec<usize> = dests.iter().map(|&d| topology.node_of(d)).collect();
            nodes.dedup(); // ranks of a node are contiguous, so equal nodes are adjacent
            tokens += 1;
            node_pairs += nodes.len();
            c.ht_node_pairs[src] += nodes.len();
            for &n in &nodes {
                let multi = dests.iter().filter(|&&d| topology.node_of(d) == n).count() > 1;
                c.ht_node_multi[src] += multi as usize;
                if n == home {
                    continue;
                }
                c.ht_nic_send[src] += 1;
                // The rail peer: the rank of node n with the source's local index.
                let rail = topology.ranks_of_node(n).start + topology.local_rank_of(src);
                c.ht_nic_recv[rail] += 1;
                c.ht_nic_multi_send[src] += multi as usize;
                c.ht_nic_multi_recv[rail] += multi as usize;
            }
            for &d in &dests {
                c.ht_recv_rows[d] += 1;
                if d == src {
                    continue;
                }
                if topology.node_of(d) == home {
                    c.ll_nvl_send[src] += 1;
                } else {
                    c.ll_nic_send[src] += 1;
                    c.ll_nic_recv[d] += 1;
                }
            }
        }
    }
    c.nodes_per_token = node_pairs as f64 / tokens.max(1) as f64;
    c
}

fn mean(v: &[usize]) -> f64 {
    v.iter().sum::<usize>() as f64 / v.len().max(1) as f64
}

fn max(v: &[usize]) -> usize {
    v.iter().copied().max().unwrap_or(0)
}

/// One row of the model: an operation, its bytes per rank, and the NIC floor.
struct Line {
    op: &'static str,
    dtype: &'static str,
    tokens: usize,
    /// DeepEP's RDMA accounting (HT), mean per rank; `None` for LL.
    rdma_bytes: Option<f64>,
    nic_send_max: usize,
    nic_recv_max: usize,
    nvl_bytes: f64,
}

impl Line {
    fn floor_us(&self, nic_gbps: f64) -> f64 {
        self.nic_send_max.max(self.nic_recv_max) as f64 / (nic_gbps * 1e3)
    }
}

fn lines(a: &BytesArgs, ht: &Counts, ll: &Counts) -> Vec<Line> {
    let h = a.hidden;
    let bf16_row = 2 * h;
    let fp8_row = h + 4 * h.div_ceil(128);
    // `row` crosses the RDMA domain, `nvl_row` NVLink.
    let ht_line = |op, dtype, row: usize, nvl_row: usize, combine: bool| Line {
        op,
        dtype,
        tokens: a.tokens,
        rdma_bytes: Some(mean(&ht.ht_node_pairs) * row as f64),
        // Combine runs the dispatch backwards: a rank's NIC sends what it received as the rail peer.
        nic_send_max: row * max(if combine { &ht.ht_nic_recv } else { &ht.ht_nic_send }),
        nic_recv_max: row * max(if combine { &ht.ht_nic_send } else { &ht.ht_nic_recv }),
        nvl_bytes: mean(&ht.ht_recv_rows) * nvl_row as f64,
    };
    // LL combine returns one bf16 row per dispatch message, so it runs the counts backwards too.
    let ll_line = |op, dtype, unit: usize, combine: bool| Line {
        op,
        dtype,
        tokens: a.ll_tokens,
        rdma_bytes: None,
        nic_send_max: unit * max(if combine { &ll.ll_nic_recv } else { &ll.ll_nic_send }),
        nic_recv_max: unit * max(if combine { &ll.ll_nic_send } else { &ll.ll_nic_recv }),
        nvl_bytes: mean(&ll.ll_nvl_send) * unit as f64,
    };
    // DeepEP sends a node's partial home as bf16; moelink as fp32 where two or more ranks of the node held
    // the token, so that the sum is the one-node sum bit for bit (docs/oracle.md), and as the holder's bf16
    // row where one did: twice DeepEP's bytes for the first kind of pair.
    let extra = 4 * h - bf16_row;
    let per_rank =
        |pairs: &[usize], multi: &[usize]| -> Vec<usize> { pairs.iter().zip(multi).map(|(p, m)| p * bf16_row + m * extra).collect() };
    let moelink_combine = Line {
        op: "combine (moelink)",
        dtype: "bf16 rows, fp32 partials",
        tokens: a.tokens,
        rdma_bytes: Some(mean(&per_rank(&ht.ht_node_pairs, &ht.ht_node_multi))),
        nic_send_max: max(&per_rank(&ht.ht_nic_recv, &ht.ht_nic_multi_recv)),
        nic_recv_max: max(&per_rank(&ht.ht_nic_send, &ht.ht_nic_multi_send)),
        nvl_bytes: mean(&ht.ht_recv_rows) * bf16_row as f64,
    };
    vec![
        ht_line("dispatch", "bf16", bf16_row, bf16_row, false),
        ht_line("dispatch", "fp8", fp8_row, fp8_row, false),
        ht_line("combine", "bf16", bf16_row, bf16_row, true),
        moelink_combine,
        ll_line("ll dispatch", "fp8", moelink::internode::ll_message_bytes(h, a.topk, true), false),
        ll_line("ll combine", "bf16", bf16_row, true),
    ]
}

/// Every rank's routing of `tokens` tokens (seeded per rank).
fn routing(a: &BytesArgs, topology: &Topology, tokens: usize) -> Vec<Vec<i64>> {
    let kind = match a.routing {
        BytesRouting::NodeLimited => RouteKind::NodeLimited { nodes: topology.num_nodes, max_nodes: a.max_nodes },
        BytesRouting::Uniform => RouteKind::Uniform,
    };
    let ranks = topology.num_ranks();
    (0..ranks)
        .map(|r| {
            let mut rng = Rng::new(a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((r as u64) << 32) ^ kind.code());
            route(&mut rng, kind, tokens, a.topk, a.experts, ranks)
        })
        .collect()
}

/// Runs `moelink bench bytes`.
pub fn run(a: &BytesArgs) -> Result<(), CliError> {
    if let Some(path) = &a.json {
        record::check_output("--json", path, None).map_err(CliError)?;
    }
    if a.topk == 0 || a.hidden == 0 || a.max_nodes == 0 || a.nic_gbps <= 0.0 {
        return Err(CliError("--topk, --hidden, --max-nodes and --nic-gbps must be positive".into()));
    }
    let facts = RunFacts {
        system: "moelink".into(),
        backend: "model".into(),
        device: "none (computed from routing)".into(),
        gpus: 0,
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    println!(
        "moelink bench bytes | {} routing{}, {} tokens (LL {}), hidden {}, top-{} of {} | NIC {} GB/s per GPU each way | commit {}",
        match a.routing {
            BytesRouting::NodeLimited => "node-limited",
            BytesRouting::Uniform => "uniform",
        },
        if a.routing == BytesRouting::NodeLimited { format!(" (at most {} nodes)", a.max_nodes) } else { String::new() },
        a.tokens,
        a.ll_tokens,
        a.hidden,
        a.topk,
        a.experts,
        a.nic_gbps,
        facts.commit
    );
    println!("computed, not measured: bytes per rank from the routing, and the time the busiest NIC needs for them");
    let mut t = Table::new(
        &["ranks", "nodes", "op", "dtype", "tokens", "nodes/token", "RDMA MB (DeepEP)", "NIC MB max", "NVLink MB", "NIC floor µs"],
        &[true, false, false, false, true, true, true, true, true, true],
    );
    let mut records = Vec::new();
    for spec in &a.topology {
        let topology = spec.parse::<Topology>().map_err(|e| CliError(format!("--topology {spec}: {e}")))?;
        let ranks = topology.num_ranks();
        if a.experts % ranks != 0 || a.experts % topology.num_nodes != 0 {
            return Err(CliError(format!("--experts {} is not a multiple of the {ranks} ranks of --topology {spec}", a.experts)));
        }
        let ht = count(&topology, &routing(a, &topology, a.tokens), a.topk, a.experts);
        let ll = count(&topology, &routing(a, &topology, a.ll_tokens), a.topk, a.experts);
        for l in lines(a, &ht, &ll) {
            let floor = l.floor_us(a.nic_gbps);
            let mb = |b: f64| format!("{:.1}", b / 1e6);
            t.row(vec![
                ranks.to_string(),
                format!("{}x{}", topology.num_nodes, topology.ranks_per_node),
                l.op.into(),
                l.dtype.into(),
                l.tokens.to_string(),
                format!("{:.2}", if l.op.starts_with("ll") { ll.nodes_per_token } else { ht.nodes_per_token }),
                l.rdma_bytes.map_or("-".into(), mb),
                mb(l.nic_send_max.max(l.nic_recv_max) as f64),
                mb(l.nvl_bytes),
                format!("{floor:.1}"),
            ]);
            let (mode, op) = match l.op.strip_prefix("ll ") {
                Some(op) => ("model-ll", op),
                None => ("model-ht", l.op),
            };
            let mut r = Record::new(&facts, mode, op, ranks);
            r.dtype = Some(l.dtype.into());
            r.tokens = Some(l.tokens);
            r.hidden = Some(a.hidden);
            r.topk = Some(a.topk);
            r.experts = Some(a.experts);
            r.routing =
                Some(if a.routing == BytesRouting::NodeLimited { format!("node-limited-{}", a.max_nodes) } else { "uniform".into() });
            r.nodes = Some(topology.num_nodes);
            r.ranks_per_node = Some(topology.ranks_per_node);
            r.status = Status::Ok;
            if let Some(b) = l.rdma_bytes {
                r.extra.insert("rdma_bytes".into(), serde_json::json!(b));
            }
            r.extra.insert("nic_send_bytes_max".into(), serde_json::json!(l.nic_send_max));
            r.extra.insert("nic_recv_bytes_max".into(), serde_json::json!(l.nic_recv_max));
            r.extra.insert("nvl_bytes".into(), serde_json::json!(l.nvl_bytes));
            r.extra.insert("nic_gbps".into(), serde_json::json!(a.nic_gbps));
            r.extra.insert("nic_floor_us".into(), serde_json::json!(floor));
            records.push(r);
        }
    }
    println!("{}", t.render());
    println!(
        "HT: a token crosses RDMA once per destination node (to the rank with its local index) and NVLink inside it; \
         RDMA MB is DeepEP's accounting (every destination node, the own one included), NIC MB counts other nodes only, \
         the larger of send and receive of the busiest rank. LL: one message per (token, destination rank)."
    );
    if let Some(path) = &a.json {
        record::write_json(path, &records).map_err(CliError)?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_hierarchy() {
        // 2x2, one expert per rank. Rank 0 (node 0): token 0 picks experts 0, 1, 2, 3 (both nodes), token 1
        // picks expert 3 and a hole. Rank 3 (node 1, local index 1): token 0 picks expert 2 (its own node).
        let t: Topology = "2x2".parse().unwrap();
        let routing = vec![vec![0, 1, 2, 3, 3, -1, -1, -1], vec![], vec![], vec![2, -1, -1, -1]];
        let c = count(&t, &routing, 4, 4);
        assert_eq!(c.ht_node_pairs, vec![3, 0, 0, 1]);
        // Rank 0 sends 2 pairs to node 1; both arrive at rank 2, node 1's rank with local index 0.
        assert_eq!((c.ht_nic_send, c.ht_nic_recv), (vec![2, 0, 0, 0], vec![0, 0, 2, 0]));
        assert_eq!(c.ht_recv_rows, vec![1, 1, 2, 2]);
        // Token 0 of rank 0 has two holders on each node: fp32 partials; the others one holder.
        assert_eq!(
            (&c.ht_node_multi, &c.ht_nic_multi_send, &c.ht_nic_multi_recv),
            (&vec![2, 0, 0, 0], &vec![1, 0, 0, 0], &vec![0, 0, 1, 0])
        );
        assert_eq!((c.ll_nic_send, c.ll_nic_recv, c.ll_nvl_send), (vec![3, 0, 0, 0], vec![0, 0, 1, 2], vec![1, 0, 0, 1]));
        assert!((c.nodes_per_token - 4.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn node_limited_routing_bounds_the_nodes_and_the_floor_scales() {
        let a = BytesArgs {
            topology: vec![],
            tokens: 512,
            ll_tokens: 32,
            hidden: 7168,
            topk: 8,
            experts: 256,
            routing: BytesRouting::NodeLimited,
            max_nodes: 4,
            nic_gbps: 50.0,
            seed: 1,
            json: None,
        };
        let t: Topology = "8x8".parse().unwrap();
        let ht = count(&t, &routing(&a, &t, a.tokens), a.topk, a.experts);
        assert!(ht.nodes_per_token <= 4.0 && ht.nodes_per_token > 3.0, "{}", ht.nodes_per_token);
        let uniform = BytesArgs { routing: BytesRouting::Uniform, ..a.clone() };
        let hu = count(&t, &routing(&uniform, &t, a.tokens), a.topk, a.experts);
        assert!(hu.nodes_per_token > ht.nodes_per_token, "uniform reaches more nodes");
        let l = lines(&a, &ht, &ht);
        // FP8 rows are ~half of BF16 ones, and the floor is the busiest NIC's bytes over the rate.
        assert!(l[1].floor_us(50.0) < l[0].floor_us(50.0) * 0.6);
        assert_eq!(l[0].floor_us(50.0), l[0].nic_send_max.max(l[0].nic_recv_max) as f64 / 50e3);
    }
}
