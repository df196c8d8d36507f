//! High-throughput dispatch and combine across virtual nodes: one body per backend (the host backend always;
//! CUDA with `--include-ignored` on a machine with a GPU, in thread mode: the ranks share the visible GPUs
//! round-robin, so one GPU is enough). Each is checked bit for bit against the host backend on ONE node
//! (1 x R) for the same inputs: the hierarchical path must give the single-node answers (1x4 = 2x2,
//! 1x8 = 2x4 = 4x2). Every output: received rows, FP8 scales, top-k ids and weights, the per-expert counts,
//! DeepEP's rank_prefix_matrix and recv_src_idx, the combined rows and weights; CPU-synchronised and no-sync
//! (num_worst_tokens) dispatch, a cached dispatch from a handle, combine with two biases; uniform, holed,
//! skewed, empty-rank and node-limited routing, ranks with zero tokens; buffers small enough that every call
//! runs several rounds; calls with fewer experts followed by calls with more on the same buffer. On CUDA
//! over `ptr` and over `emu-nic` (which delivers out of order across QPs; the host backend has no
//! transport). Also the rules of the calls across nodes: `get_dispatch_layout` returns
//! the tokens per node; a buffer where not one token per round fits is refused naming the region; after
//! high-throughput calls low-latency calls are refused until `clean_low_latency_buffer` (the two share the
//! RDMA region, as in DeepEP); a silent rank on another node ends every other rank's call with a timeout
//! naming a peer (on CUDA, and its domain); layout tensors that disagree are refused naming the argument and
//! the rank. The NVSHMEM transport needs one process per rank and runs from the `internode` step of
//! `scripts/device/run.sh`.
//!
//! Rank closures only make calls and return what they saw; assertions run on the test thread.

use std::sync::Arc;

use moelink::group::run_ranks;
use moelink::internode::ht_bytes_needed;
use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, CombineArgs, DispatchArgs, EmuNicOptions, Error, Fp8E4M3, LlDispatchArgs, LlQuant, Payload,
    Phase, RdmaOptions, Result, Routing, Tensor, Topology, Transport,
};
use moelink_testkit::harness::{test_options, with_buffers};
use moelink_testkit::values::random_weights;
use moelink_testkit::{backend_tests, route, Rng, RouteKind};

const HIDDEN: usize = 1024;
const TOPK: usize = 4;
/// Tokens per round the buffers are sized for: calls of up to 3x this many tokens run several rounds.
const ROUND_TOKENS: usize = 40;

#[derive(Clone, Copy, Debug)]
struct Net {
    topology: Topology,
    transport: Transport,
}

impl Net {
    fn ranks(&self) -> usize {
        self.topology.num_ranks()
    }
    fn options(&self, kind: BackendKind, base: BufferOptions) -> BufferOptions {
        let need = ht_bytes_needed(self.topology, ROUND_TOKENS, HIDDEN, TOPK, false);
        BufferOptions {
            backend: kind,
            num_nvl_bytes: need.num_nvl_bytes,
            num_rdma_bytes: need.num_rdma_bytes,
            low_latency_mode: false,
            topology: Some(self.topology),
            rdma: RdmaOptions { transport: self.transport, num_qps_per_rank: 4, ..RdmaOptions::default() },
            ..base
        }
    }
}

/// One call of every rank.
#[derive(Clone, Copy, Debug)]
struct Call {
    fp8: bool,
    /// 0: CPU-synchronised.
    num_worst_tokens: usize,
    /// Dispatch again from the handle (no routing) and combine that one.
    cached: bool,
    biases: usize,
    route: RouteKind,
    /// Experts per rank: fewer in one call than in the next, so that what that call leaves in the
    /// buffer's per-expert words lies where the next one counts.
    experts_per_rank: usize,
}

impl Call {
    fn experts(&self, net: &Net) -> usize {
        self.experts_per_rank * net.ranks()
    }
}

fn calls(net: &Net) -> Vec<Call> {
    let nodes = net.topology.num_nodes;
    let node_limited = RouteKind::NodeLimited { nodes, max_nodes: (nodes / 2).max(1) };
    let worst = 3 * ROUND_TOKENS * net.ranks();
    vec![
        Call { fp8: false, num_worst_tokens: 0, cached: true, biases: 2, route: RouteKind::Uniform, experts_per_rank: 4 },
        Call { fp8: true, num_worst_tokens: 0, cached: false, biases: 0, route: RouteKind::Skewed, experts_per_rank: 2 },
        Call { fp8: false, num_worst_tokens: worst, cached: false, biases: 1, route: RouteKind::WithHoles, experts_per_rank: 4 },
        Call { fp8: true, num_worst_tokens: 0, cached: true, biases: 0, route: node_limited, experts_per_rank: 2 },
        Call { fp8: false, num_worst_tokens: 0, cached: false, biases: 0, route: RouteKind::EmptyRank(1), experts_per_rank: 4 },
        Call { fp8: false, num_worst_tokens: worst, cached: false, biases: 2, route: node_limited, experts_per_rank: 4 },
    ]
}

#[derive(Clone)]
struct Inputs {
    tokens: usize,
    x: Vec<bf16>,
    fp8: Vec<Fp8E4M3>,
    scales: Vec<f32>,
    idx: Vec<i64>,
    w: Vec<f32>,
    y_seed: u64,
}

fn inputs(net: &Net, call: &Call, call_no: usize, rank: usize) -> Inputs {
    let mut rng = Rng::new(0x47_1a7e ^ ((call_no as u64) << 16) ^ rank as u64);
    // Rank 1 sends nothing in every other call; the others send up to 3 rounds' worth.
    let tokens = if rank == 1 && call_no % 2 == 1 { 0 } else { [3 * ROUND_TOKENS, 7, 55, 1, 90, 0, 33, 120][(rank + call_no) % 8] };
    let idx = route(&mut rng, call.route, tokens, TOPK, call.experts(net), net.ranks());
    let x = (0..tokens * HIDDEN).map(|_| bf16::from_f64(rng.normal())).collect();
    // FP8 payload: any byte but the two NaN patterns, with positive scales.
    let fp8 = (0..tokens * HIDDEN).map(|_| Fp8E4M3((rng.next_u64() as u8) & 0xfe)).collect();
    let scales = (0..tokens * HIDDEN / 128).map(|_| 0.001 + rng.uniform() as f32).collect();
    Inputs { tokens, x, fp8, scales, idx, w: random_weights(&mut rng, tokens * TOPK), y_seed: rng.next_u64() }
}

/// What a rank saw in one call.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    recv: Vec<u8>,
    scales: Vec<u8>,
    idx: Vec<i64>,
    w: Vec<f32>,
    per_expert: Vec<usize>,
    rank_prefix: Vec<i32>,
    src_idx: Vec<i32>,
    combined: Vec<u8>,
    combined_w: Vec<u8>,
}

/// The rows that matter: the received ones (no-sync outputs are num_worst_tokens long).
fn first_rows<T: Clone>(v: Vec<T>, rows: usize, per_row: usize) -> Vec<T> {
    v[..(rows * per_row).min(v.len())].to_vec()
}

fn run_call(buf: &mut Buffer, net: &Net, call: &Call, inp: &Inputs) -> Result<Seen> {
    let t = inp.tokens;
    let idx = buf.upload(&Tensor::from_vec(inp.idx.clone(), &[t, TOPK])?)?;
    let w = buf.upload(&Tensor::from_vec(inp.w.clone(), &[t, TOPK])?)?;
    let x_bf16 = buf.upload(&Tensor::from_vec(inp.x.clone(), &[t, HIDDEN])?)?;
    let x_fp8 = buf.upload(&Tensor::from_vec(inp.fp8.clone(), &[t, HIDDEN])?)?;
    let scales = buf.upload(&Tensor::from_vec(inp.scales.clone(), &[t, HIDDEN / 128])?)?;
    let payload = if call.fp8 { Payload::Fp8 { x: x_fp8.view(), scales: scales.view() } } else { Payload::Bf16(x_bf16.view()) };
    let layout = buf.get_dispatch_layout(idx.view(), call.experts(net))?;
    let args = DispatchArgs {
        x: payload,
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
        expert_alignment: 1,
        num_worst_tokens: call.num_worst_tokens,
        config: None,
    };
    let mut d = buf.dispatch(&args)?;
    if call.cached {
        let again = DispatchArgs { routing: Routing::Cached(&d.handle), ..args };
        let c = buf.dispatch(&again)?;
        if c.recv_x.to_host_bytes()? != d.recv_x.to_host_bytes()? {
            return Err(Error::invalid("x", buf.rank(), "the cached dispatch received other rows than the fresh one"));
        }
        d.recv_x = c.recv_x;
    }
    let n = d.handle.num_recv_tokens().unwrap_or(0);
    let rows = if call.num_worst_tokens > 0 { call.num_worst_tokens } else { n };
    // The experts: a deterministic bf16 value per received row and channel (from the row's bytes), so that
    // every rank's combine input depends on what it received.
    let recv = d.recv_x.to_host_bytes()?;
    let rb = if call.fp8 { HIDDEN } else { 2 * HIDDEN };
    let y: Vec<bf16> = (0..rows * HIDDEN)
        .map(|i| {
            let (r, c) = (i / HIDDEN, i % HIDDEN);
            let b = if r < n { recv[r * rb + c * rb / HIDDEN] } else { 0 };
            let v = ((b as f64) - 128.0) / 16.0 * if (c + inp.y_seed as usize) % 7 == 0 { 64.0 } else { 1.0 };
            bf16::from_f64(if b == 0x80 { -0.0 } else { v })
        })
        .collect();
    let y = buf.upload(&Tensor::from_vec(y, &[rows, HIDDEN])?)?;
    let bias: Vec<Tensor> = (0..2)
        .map(|k| {
            let mut rng = Rng::new(inp.y_seed ^ k);
            buf.upload(&Tensor::from_vec((0..t * HIDDEN).map(|_| bf16::from_f64(rng.normal() * 4.0)).collect::<Vec<_>>(), &[t, HIDDEN])?)
        })
        .collect::<Result<_>>()?;
    let recv_w = d.recv_topk_weights.as_ref().expect("top-k travelled");
    let c = buf.combine(&CombineArgs {
        x: y.view(),
        handle: &d.handle,
        topk_weights: Some(recv_w.view()),
        bias: [(call.biases >= 1).then(|| bias[0].view()), (call.biases >= 2).then(|| bias[1].view())],
        config: None,
    })?;
    Ok(Seen {
        recv: first_rows(recv, n, rb),
        scales: d
            .recv_x_scales
            .as_ref()
            .map(|s| s.to_host_bytes())
            .transpose()?
            .map(|s| first_rows(s, n, 4 * HIDDEN / 128))
            .unwrap_or_default(),
        idx: first_rows(d.recv_topk_idx.as_ref().expect("top-k").to_vec()?, n, TOPK),
        w: first_rows(recv_w.to_vec()?, n, TOPK),
        per_expert: d.num_recv_tokens_per_expert.clone(),
        rank_prefix: d.rank_prefix_matrix.to_vec()?,
        src_idx: first_rows(d.recv_src_idx.to_vec()?, n, 1),
        combined: c.combined_x.to_host_bytes()?,
        combined_w: c.combined_topk_weights.as_ref().map(|t| t.to_host_bytes()).transpose()?.unwrap_or_default(),
    })
}

/// Every call on the host backend over ONE node of all the ranks, and on `kind` over `net`.
fn check_net(kind: BackendKind, net: Net) {
    let ranks = net.ranks();
    let calls = calls(&net);
    let all: Vec<Vec<Inputs>> = calls.iter().enumerate().map(|(n, c)| (0..ranks).map(|r| inputs(&net, c, n, r)).collect()).collect();
    let body = |buf: &mut Buffer| -> Result<Vec<Seen>> {
        let me = buf.rank();
        calls.iter().zip(&all).map(|(c, inp)| run_call(buf, &net, c, &inp[me])).collect()
    };
    let one_node = BufferOptions { topology: Some(Topology::single_node(ranks)), ..test_options() };
    let want = with_buffers(BackendKind::Host, ranks, one_node, body);
    let got = with_buffers(kind, ranks, net.options(kind, test_options()), body);
    for me in 0..ranks {
        for (n, call) in calls.iter().enumerate() {
            let (g, w) = (&got[me][n], &want[me][n]);
            let what = format!("{kind:?} {} {}: rank {me} call {n} {call:?}", net.topology, net.transport.name());
            assert_eq!(g.rank_prefix, w.rank_prefix, "{what}: rank_prefix_matrix");
            assert_eq!(g.per_expert, w.per_expert, "{what}: num_recv_tokens_per_expert");
            assert!(g.recv == w.recv, "{what}: received rows differ from one node's");
            assert!(g.scales == w.scales, "{what}: scales differ from one node's");
            assert_eq!(g.idx, w.idx, "{what}: recv_topk_idx");
            assert_eq!(g.w, w.w, "{what}: recv_topk_weights");
            assert_eq!(g.src_idx, w.src_idx, "{what}: recv_src_idx");
            if let Some(i) = g.combined.chunks(2).zip(w.combined.chunks(2)).position(|(a, b)| a != b) {
                panic!("{what}: combined[{}, {}] differs from one node's", i / HIDDEN, i % HIDDEN);
            }
            assert!(g.combined_w == w.combined_w, "{what}: combined_topk_weights");
        }
        eprintln!("{kind:?} {} {}: rank {me}: {} calls match one node's answers", net.topology, net.transport.name(), calls.len());
    }
}

/// The body of `layouts_that_disagree_are_refused_across_nodes` on one topology (its doc says what it checks).
fn layouts_that_disagree_are_refused(kind: BackendKind, topology: Topology) {
    let opts = if topology.num_nodes > 1 {
        Net { topology, transport: Transport::Ptr }.options(kind, test_options())
    } else {
        BufferOptions {
            backend: kind,
            topology: Some(topology),
            num_nvl_bytes: Buffer::ht_bytes_needed(24, HIDDEN, TOPK, 4, false),
            num_rdma_bytes: 0,
            low_latency_mode: false,
            ..test_options()
        }
    };
    let opts = BufferOptions { timeout_ms: 10_000, ..opts };
    let (t, e) = (24usize, 4 * topology.num_ranks());
    // The first expert of rank 1, whose count rank 0 overstates in case (c).
    let bad_expert = e / 4;
    for case in ["nothing sent, experts counted", "is_token_in_rank from another routing", "an expert's count 5 too high"] {
        let with_topk = !case.starts_with("nothing");
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let results = run_ranks(4, |g| -> Result<(Option<Error>, usize)> {
            let mut buf = Buffer::new(Arc::new(g), opts.clone())?;
            let me = buf.rank();
            let mut rng = Rng::new(0x1a_7001 + me as u64);
            let idx = buf.upload(&Tensor::from_vec(route(&mut rng, RouteKind::Uniform, t, TOPK, e, 4), &[t, TOPK])?)?;
            let other_idx = buf.upload(&Tensor::from_vec(route(&mut rng, RouteKind::Skewed, t, TOPK, e, 4), &[t, TOPK])?)?;
            let w = buf.upload(&Tensor::from_vec(random_weights(&mut rng, t * TOPK), &[t, TOPK])?)?;
            let x =
                buf.upload(&Tensor::from_vec((0..t * HIDDEN).map(|i| bf16::from_f64((i % 13) as f64)).collect::<Vec<_>>(), &[t, HIDDEN])?)?;
            let good = buf.get_dispatch_layout(idx.view(), e)?;
            let other = buf.get_dispatch_layout(other_idx.view(), e)?;
            let none_in_rank = buf.upload(&Tensor::from_bools(&vec![false; t * 4], &[t, 4])?)?;
            let zero_per_rank = buf.upload(&Tensor::from_vec(vec![0i32; 4], &[4])?)?;
            let mut per_expert: Vec<i32> = good.num_tokens_per_expert.to_vec()?;
            per_expert[bad_expert] += 5;
            let overstated = buf.upload(&Tensor::from_vec(per_expert, &[e])?)?;
            let mut layout = good.as_ref();
            if me == 0 {
                if case.starts_with("nothing") {
                    layout.is_token_in_rank = none_in_rank.view();
                    layout.num_tokens_per_rank = zero_per_rank.view();
                } else if case.starts_with("is_token_in_rank") {
                    layout.is_token_in_rank = other.is_token_in_rank.view();
                    layout.num_tokens_per_rank = other.num_tokens_per_rank.view();
                } else {
                    layout.num_tokens_per_expert = overstated.view();
                }
            }
            let (topk_idx, topk_weights) = if with_topk { (Some(idx.view()), Some(w.view())) } else { (None, None) };
            let args = |layout| DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout, topk_idx, topk_weights },
                expert_alignment: 1,
                num_worst_tokens: 0,
                config: None,
            };
            let err = buf.dispatch(&args(layout)).err();
            let again = buf.dispatch(&args(good.as_ref()))?;
            Ok((err, again.handle.num_recv_tokens().unwrap_or(0)))
        });
        for (rank, r) in results.into_iter().enumerate() {
            let what = format!("{case} ({topology:?}): rank {rank}");
            let (err, received) = r.unwrap_or_else(|e| panic!("{what}: the call after the bad one failed: {e}"));
            assert!(received > 0, "{what}: the good call received nothing");
            let Some(err) = err else {
                // Rank 1 receives the overstated expert's rows: its per-expert list would be wrong.
                assert!(rank != 0 && with_topk && !(case.starts_with("an expert") && rank == 1), "{what}: accepted the layout");
                continue;
            };
            let msg = err.to_string();
            let arg = err.argument().unwrap_or_else(|| panic!("{what}: not an argument error: {msg}"));
            if case.starts_with("is_token_in_rank") {
                assert!(["is_token_in_rank", "num_tokens_per_expert", "num_tokens_per_rank"].contains(&arg), "{what}: {msg}");
            } else {
                assert_eq!(arg, "num_tokens_per_expert", "{what}: {msg}");
            }
            if case.starts_with("an expert") && rank == 0 {
                assert!(msg.contains(&format!("expert {bad_expert}")), "{what}: the error must name the expert: {msg}");
            }
            // A receiving rank on CUDA knows only that the rows disagree with the counts some rank sent.
            assert!(msg.contains("rank 0") || (rank != 0 && msg.contains("some rank")), "{what}: the error must name rank 0: {msg}");
        }
        eprintln!("{case} ({topology:?}): refused, naming rank 0; the buffer stays usable");
    }
}

fn topo(num_nodes: usize, ranks_per_node: usize) -> Topology {
    Topology { num_nodes, ranks_per_node }
}

fn emu_nic() -> Transport {
    Transport::EmuNic(EmuNicOptions::default())
}

/// The transports a topology runs over: both seams on CUDA; the host backend has none (one pass).
fn transports(kind: BackendKind) -> Vec<Transport> {
    if kind == BackendKind::Host {
        vec![Transport::Ptr]
    } else {
        vec![Transport::Ptr, emu_nic()]
    }
}

/// The rules' shape: a small hidden size, 16 experts over 4 ranks.
const RULE_HIDDEN: usize = 256;
const RULE_EXPERTS: usize = 16;

fn rule_opts(kind: BackendKind, topology: Topology, num_nvl_bytes: usize, num_rdma_bytes: usize) -> BufferOptions {
    BufferOptions {
        backend: kind,
        topology: Some(topology),
        num_nvl_bytes,
        num_rdma_bytes,
        low_latency_mode: true,
        rdma: RdmaOptions { transport: Transport::Ptr, num_qps_per_rank: 4, ..RdmaOptions::default() },
        ..test_options()
    }
}

fn two_by_two() -> Topology {
    topo(2, 2)
}

/// One rank's inputs: `tokens` tokens with node-skewed routing and bf16 rows.
fn rule_inputs(rank: usize, tokens: usize) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng::new(0x5eed ^ rank as u64);
    let idx = route(&mut rng, RouteKind::Skewed, tokens, TOPK, RULE_EXPERTS, 4);
    let x: Vec<bf16> = (0..tokens * RULE_HIDDEN).map(|_| bf16::from_f64(rng.normal())).collect();
    let w: Vec<f32> = (0..tokens * TOPK).map(|_| rng.uniform() as f32).collect();
    (
        Tensor::from_vec(x, &[tokens, RULE_HIDDEN]).unwrap(),
        Tensor::from_vec(idx, &[tokens, TOPK]).unwrap(),
        Tensor::from_vec(w, &[tokens, TOPK]).unwrap(),
    )
}

/// Dispatch, experts (each received row doubled, some channels scaled up so that the summation order
/// matters), combine; returns the bytes of recv_x and combined_x.
fn round_trip(buf: &mut Buffer, tokens: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    let (x, idx, w) = rule_inputs(buf.rank(), tokens);
    let (x, idx, w) = (buf.upload(&x)?, buf.upload(&idx)?, buf.upload(&w)?);
    let layout = buf.get_dispatch_layout(idx.view(), RULE_EXPERTS)?;
    let d = buf.dispatch(&DispatchArgs {
        x: Payload::Bf16(x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })?;
    let rows: Vec<bf16> = d.recv_x.to_vec()?;
    let hidden = RULE_HIDDEN;
    let y: Vec<bf16> = rows.iter().enumerate().map(|(i, v)| bf16::from_f64(v.to_f64() * if i % 5 == 0 { 4096.0 } else { 2.0 })).collect();
    let y = buf.upload(&Tensor::from_vec(y, &[rows.len() / hidden, hidden])?)?;
    let c = buf.combine(&CombineArgs { x: y.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None })?;
    Ok((d.recv_x.to_host_bytes()?, c.combined_x.to_host_bytes()?))
}

backend_tests! {
    fn ht_across_two_nodes_of_two_matches_one_node(kind: BackendKind) {
        for transport in transports(kind) {
            check_net(kind, Net { topology: topo(2, 2), transport });
        }
    }

    fn ht_across_two_nodes_of_four_and_four_nodes_of_two_matches_one_node(kind: BackendKind) {
        check_net(kind, Net { topology: topo(2, 4), transport: emu_nic() });
        for transport in transports(kind) {
            check_net(kind, Net { topology: topo(4, 2), transport });
        }
    }

    /// Rank 3 (node 1) never calls: every other rank's dispatch ends with a timeout naming a peer (on CUDA in a
    /// phase that says the domain); nothing hangs.
    fn a_silent_rank_across_nodes_is_a_timeout_naming_the_domain(kind: BackendKind) {
        let net = Net { topology: topo(2, 2), transport: emu_nic() };
        let opts = BufferOptions { timeout_ms: 2000, ..net.options(kind, test_options()) };
        let inp: Vec<Inputs> = (0..4).map(|r| inputs(&net, &calls(&net)[0], 0, r)).collect();
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let results = run_ranks(4, |g| -> Result<Option<Result<Seen>>> {
            let group = Arc::new(g);
            let mut buf = Buffer::new(group.clone(), opts.clone())?;
            let me = buf.rank();
            let r = if me == 3 { None } else { Some(run_call(&mut buf, &net, &calls(&net)[0], &inp[me])) };
            // On CUDA a rank keeps its buffer until every rank is done: a peer's kernels may still write into
            // it. The host backend moves bytes inside its collectives, whose sequence the silent rank left.
            if kind != BackendKind::Host {
                moelink::Group::barrier(group.as_ref())?;
            }
            Ok(r)
        });
        for (me, r) in results.into_iter().enumerate() {
            let Some(seen) = r.unwrap_or_else(|e| panic!("rank {me}: {e}")) else { continue };
            match seen {
                Err(Error::Timeout { peer, phase, .. }) => {
                    assert!(peer < 4 && peer != me, "rank {me}: the timeout names rank {peer}");
                    assert!(phase != Phase::Notify || peer == 3, "rank {me}: the count exchange should name rank 3, named {peer}");
                    assert!(
                        kind == BackendKind::Host || matches!(phase, Phase::Notify | Phase::DispatchRdma | Phase::DispatchNvlink),
                        "rank {me}: the timeout should say its domain, got {phase}"
                    );
                }
                other => panic!("rank {me}: expected a timeout, got {other:?}"),
            }
        }
    }

    /// Layout tensors that disagree, passed by rank 0 of 4 (2x2 nodes, and one node of 4: the single-node
    /// kernels), the others passing their own, correct ones:
    /// (a) nothing sent (`is_token_in_rank` all false, `num_tokens_per_rank` 0) while `num_tokens_per_expert`
    /// counts tokens: notify's check refuses it on every rank, naming `num_tokens_per_expert` and rank 0;
    /// (b) `is_token_in_rank` and `num_tokens_per_rank` from another routing than `topk_idx`: rank 0's call fails
    /// naming a layout argument and rank 0 (the senders' check, or notify's when the counts give it away), any
    /// other rank's error names rank 0 too;
    /// (c) `num_tokens_per_expert` 5 too high for one expert of rank 1 (the per-rank sums still agree): rank 0's
    /// call fails naming `num_tokens_per_expert`, rank 0 and the expert, and rank 1's, whose per-expert list
    /// would count 5 rows that never come (on CUDA the senders count each expert's tokens and the receivers
    /// each local expert's rows, and the last block compares; the host backend tells every rank).
    /// After each, the same call with the right layout goes through on every rank: an argument error does not
    /// poison the buffer.
    fn layouts_that_disagree_are_refused_across_nodes(kind: BackendKind) {
        for topology in [topo(2, 2), Topology::single_node(4)] {
            layouts_that_disagree_are_refused(kind, topology);
        }
    }

    fn the_layout_across_nodes_counts_tokens_per_node(kind: BackendKind) {
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let out = run_ranks(4, |g| {
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, two_by_two(), 1 << 24, 1 << 24))?;
            let idx = buf.upload(&rule_inputs(buf.rank(), 37).1)?;
            let l = buf.get_dispatch_layout(idx.view(), RULE_EXPERTS)?;
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
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, Topology::single_node(4), 1 << 24, 1 << 24))?;
            let idx = buf.upload(&rule_inputs(buf.rank(), 5).1)?;
            Ok(buf.get_dispatch_layout(idx.view(), RULE_EXPERTS)?.num_tokens_per_rdma_rank.is_none())
        });
        assert!(one_node.into_iter().all(|r| r.unwrap()), "one node: no tokens per node, as DeepEP's intranode layout");
    }

    fn across_nodes_the_answers_are_one_nodes_bit_for_bit(kind: BackendKind) {
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let need = ht_bytes_needed(two_by_two(), 16, RULE_HIDDEN, TOPK, false);
        let across = run_ranks(4, |g| {
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, two_by_two(), need.num_nvl_bytes, need.num_rdma_bytes))?;
            let t = 60 - 13 * buf.rank();
            round_trip(&mut buf, t)
        });
        let one = run_ranks(4, |g| {
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, Topology::single_node(4), 1 << 24, 1 << 24))?;
            let t = 60 - 13 * buf.rank();
            round_trip(&mut buf, t)
        });
        for (rank, (a, o)) in across.into_iter().zip(one).enumerate() {
            let (a, o) = (a.unwrap(), o.unwrap());
            assert!(a.0 == o.0, "rank {rank}: received rows differ between 2x2 and 1x4");
            assert!(a.1 == o.1, "rank {rank}: combined rows differ between 2x2 and 1x4");
        }
    }

    fn a_buffer_without_one_token_per_round_is_refused_naming_the_region(kind: BackendKind) {
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let out = run_ranks(4, |g| {
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, two_by_two(), 1 << 24, 4096))?;
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

    fn low_latency_calls_after_high_throughput_ones_across_nodes_need_a_clean(kind: BackendKind) {
        let _gpus = (kind != BackendKind::Host).then(moelink_testkit::harness::cuda_lock);
        let out = run_ranks(4, |g| {
            let mut buf = Buffer::new(Arc::new(g), rule_opts(kind, two_by_two(), 1 << 24, 1 << 26))?;
            round_trip(&mut buf, 9)?;
            let (x, idx, _) = rule_inputs(buf.rank(), 9);
            let (x, idx) = (buf.upload(&x)?, buf.upload(&idx)?);
            let ll = |buf: &mut Buffer| {
                buf.low_latency_dispatch(&LlDispatchArgs {
                    x: x.view(),
                    topk_idx: idx.view(),
                    topk_weights: None,
                    num_max_dispatch_tokens_per_rank: 16,
                    num_experts: RULE_EXPERTS,
                    quant: LlQuant::Bf16,
                    return_recv_hook: false,
                })
                .map(|_| ())
            };
            let refused = ll(&mut buf);
            buf.clean_low_latency_buffer(16, RULE_HIDDEN, RULE_EXPERTS)?;
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
}
