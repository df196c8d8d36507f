//! CUDA-only low-latency tests (ignored unless included: `--include-ignored` on a GPU machine, with up to
//! 4 ranks of `MOELINK_TEST_RANKS`):
//! - the library's low-latency pipeline ([`LlGraph`]: dispatch + combine captured into CUDA graphs) replayed
//!   many times, with new inputs written before every replay, each replay checked bit for bit against the
//!   host backend run on the same inputs (valid rows, scales, counts, combined output);
//! - a peer that never arrives: `Error::Timeout` naming it (no hang), or with `enable_shrink` the peer is
//!   masked and the call finishes with what the others sent.
//!
//! Rank closures only make calls and return what they saw; assertions run on the test thread.

use moelink::graph::{LlGraph, LlGraphCombine, LlGraphSpec, LlGraphSplit};
use moelink::{bf16, BackendKind, Buffer, BufferOptions, LlCombineArgs, LlDispatchArgs, LlQuant, Result, Tensor};
use moelink_testkit::differ::ll_valid_part;
use moelink_testkit::experts::{bf16_bits as bits, scaled_expert_outputs};
use moelink_testkit::harness::{check_silent_peer, on, ranks_up_to, skip, test_options, with_buffers};
use moelink_testkit::values::random_weights;
use moelink_testkit::{route, Rng, RouteKind};

const PLAIN: LlQuant = LlQuant::Fp8 { round_scale: false, use_ue8m0: false };
const UE8M0: LlQuant = LlQuant::Fp8 { round_scale: true, use_ue8m0: true };

#[derive(Clone, Debug)]
struct Shape {
    ranks: usize,
    experts: usize,
    topk: usize,
    hidden: usize,
    t_max: usize,
    /// Tokens of each rank (fixed: the captured tensors have fixed shapes).
    tokens: Vec<usize>,
    quant: LlQuant,
    weights: bool,
    hook: bool,
}

impl Shape {
    fn local_experts(&self) -> usize {
        self.experts / self.ranks
    }
    fn rows(&self) -> usize {
        self.ranks * self.t_max
    }
    fn cols(&self) -> usize {
        self.quant.num_scale_cols(self.hidden)
    }
    fn row_bytes(&self) -> usize {
        if self.quant.is_fp8() {
            self.hidden
        } else {
            2 * self.hidden
        }
    }
}

/// One replay's inputs of one rank.
#[derive(Clone)]
struct Step {
    x: Vec<bf16>,
    idx: Vec<i64>,
    w: Vec<f32>,
}

fn step_inputs(sh: &Shape, rank: usize, replay: usize) -> Step {
    let mut rng = Rng::new(0x5eed ^ ((replay as u64) << 8) ^ rank as u64);
    let t = sh.tokens[rank];
    let kind = if replay % 3 == 2 { RouteKind::WithHoles } else { RouteKind::Uniform };
    let idx = route(&mut rng, kind, t, sh.topk, sh.experts, sh.ranks);
    let x = (0..t * sh.hidden).map(|i| bf16::from_f64(rng.normal() * 2f64.powi(((i / 128 + replay) % 9) as i32 - 4))).collect();
    Step { x, idx, w: random_weights(&mut rng, t * sh.topk) }
}

/// What a rank saw in one replay: counts, the valid rows (bytes) and their scales, the combined output.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    count: Vec<i32>,
    rows: Vec<u8>,
    scales: Vec<u8>,
    combined: Vec<u16>,
    /// DeepEP's handle: `src_info` of the valid rows (expert by expert) and `layout_range`.
    src_info: Vec<i32>,
    layout_range: Vec<i64>,
}

/// The valid rows of `src_info [E_local, rows]`, expert by expert.
fn valid_src_info(sh: &Shape, src_info: &[i32], count: &[i32]) -> Vec<i32> {
    let rows = sh.rows();
    count.iter().enumerate().flat_map(|(e, &n)| src_info[e * rows..e * rows + (n.max(0) as usize).min(rows)].to_vec()).collect()
}

fn valid_part(sh: &Shape, recv_x: &[u8], scales: &[u8], count: &[i32]) -> (Vec<u8>, Vec<u8>) {
    ll_valid_part(count, recv_x, scales, sh.rows(), sh.row_bytes(), sh.cols())
}

/// The test's experts ([`scaled_expert_outputs`]) on this rank's received rows.
fn expert_outputs(sh: &Shape, me: usize, recv_x: &[u8], scales: &[u8], count: &[i32]) -> Vec<bf16> {
    scaled_expert_outputs(me, sh.local_experts(), sh.rows(), sh.hidden, sh.quant, recv_x, scales, count)
}

/// One eager round on `buf` (any backend): dispatch this rank's `step`, the experts (the identity, or
/// [`expert_outputs`] computed on the host), combine; what the rank saw.
fn eager_round(buf: &mut Buffer, sh: &Shape, s: &Step, identity: bool) -> Result<Seen> {
    let (me, t) = (buf.rank(), sh.tokens[buf.rank()]);
    let x = on(buf, Tensor::from_vec(s.x.clone(), &[t, sh.hidden])?);
    let idx = on(buf, Tensor::from_vec(s.idx.clone(), &[t, sh.topk])?);
    let w = on(buf, Tensor::from_vec(s.w.clone(), &[t, sh.topk])?);
    let args = LlDispatchArgs {
        x: x.view(),
        topk_idx: idx.view(),
        topk_weights: sh.weights.then(|| w.view()),
        num_max_dispatch_tokens_per_rank: sh.t_max,
        num_experts: sh.experts,
        quant: sh.quant,
        return_recv_hook: false,
    };
    let d = buf.low_latency_dispatch(&args)?;
    let recv_x = d.recv_x.to_host_bytes()?;
    let scales = d.recv_x_scales.as_ref().map(|t| t.to_host_bytes()).transpose()?.unwrap_or_default();
    let count: Vec<i32> = d.recv_count.to_vec()?;
    let y = if identity {
        on(buf, d.recv_x.to_host()?)
    } else {
        on(buf, Tensor::from_vec(expert_outputs(sh, me, &recv_x, &scales, &count), &[sh.local_experts(), sh.rows(), sh.hidden])?)
    };
    let cargs = LlCombineArgs {
        x: y.view(),
        topk_idx: idx.view(),
        topk_weights: w.view(),
        handle: &d.handle,
        zero_copy: false,
        return_recv_hook: false,
    };
    let out = buf.low_latency_combine(&cargs)?;
    let (rows, sc) = valid_part(sh, &recv_x, &scales, &count);
    let src_info = valid_src_info(sh, &d.src_info.to_vec()?, &count);
    Ok(Seen { count, rows, scales: sc, combined: bits(&out)?, src_info, layout_range: d.layout_range.to_vec()? })
}

/// The host backend on every replay's inputs: what each rank must see.
fn host_reference(sh: &Shape, steps: &[Vec<Step>], identity: bool) -> Vec<Vec<Seen>> {
    with_buffers(BackendKind::Host, sh.ranks, test_options(), |buf| {
        let me = buf.rank();
        steps.iter().map(|step| eager_round(buf, sh, &step[me], identity)).collect()
    })
}

/// CUDA: the library's pipeline, built once, replayed once per step with that step's inputs.
/// `identity` (bf16): one graph holds dispatch and combine, the experts being the identity (`y = recv_x`).
/// Otherwise two graphs: dispatch, then (after the host computed the experts into the expert outputs)
/// combine. With `hook`, each receive phase runs through its hook inside the graphs.
fn cuda_replays(sh: &Shape, steps: &[Vec<Step>], identity: bool) -> Vec<Vec<Seen>> {
    with_buffers(BackendKind::Cuda, sh.ranks, test_options(), |buf| {
        let me = buf.rank();
        let spec = LlGraphSpec {
            num_tokens: sh.tokens[me],
            num_max_dispatch_tokens_per_rank: sh.t_max,
            hidden: sh.hidden,
            topk: sh.topk,
            num_experts: sh.experts,
            quant: sh.quant,
            dispatch_weights: sh.weights,
            return_recv_hook: sh.hook,
            combine: if identity { LlGraphCombine::ReceivedRows } else { LlGraphCombine::ExpertOutputs },
            graphs: if identity { LlGraphSplit::One } else { LlGraphSplit::PerCall },
        };
        let mut g = LlGraph::new(buf, spec)?;
        let mut seen = Vec::new();
        for step in steps {
            let s = &step[me];
            g.write_inputs(&s.x, &s.idx, &s.w)?;
            g.replay_graph(buf, 0)?;
            let recv_x = g.recv_x().to_host_bytes()?;
            let scales = g.recv_x_scales().map(|t| t.to_host_bytes()).transpose()?.unwrap_or_default();
            let count: Vec<i32> = g.recv_count().to_vec()?;
            if !identity {
                g.write_expert_outputs(&expert_outputs(sh, me, &recv_x, &scales, &count))?;
                g.replay_graph(buf, 1)?;
            }
            let (rows, sc) = valid_part(sh, &recv_x, &scales, &count);
            let combined = g.combined_x().map(bits).transpose()?.unwrap_or_default();
            let src_info = valid_src_info(sh, &g.src_info().to_vec()?, &count);
            seen.push(Seen { count, rows, scales: sc, combined, src_info, layout_range: g.layout_range().to_vec()? });
        }
        buf.barrier()?;
        Ok(seen)
    })
}

fn check_replays(sh: &Shape, replays: usize, identity: bool) {
    let steps: Vec<Vec<Step>> = (0..replays).map(|r| (0..sh.ranks).map(|me| step_inputs(sh, me, r)).collect()).collect();
    let want = host_reference(sh, &steps, identity);
    let got = cuda_replays(sh, &steps, identity);
    for me in 0..sh.ranks {
        for r in 0..replays {
            let (g, w) = (&got[me][r], &want[me][r]);
            assert_eq!(g.count, w.count, "rank {me} replay {r}: recv_count ({sh:?})");
            assert!(g.rows == w.rows, "rank {me} replay {r}: valid rows differ from the host backend ({sh:?})");
            assert!(g.scales == w.scales, "rank {me} replay {r}: scales differ from the host backend ({sh:?})");
            assert_eq!(g.src_info, w.src_info, "rank {me} replay {r}: src_info ({sh:?})");
            assert_eq!(g.layout_range, w.layout_range, "rank {me} replay {r}: layout_range ({sh:?})");
            if let Some(i) = g.combined.iter().zip(&w.combined).position(|(a, b)| a != b) {
                panic!(
                    "rank {me} replay {r}: combined[{}, {}] = {:#06x}, host {:#06x} ({sh:?})",
                    i / sh.hidden,
                    i % sh.hidden,
                    g.combined[i],
                    w.combined[i]
                );
            }
        }
    }
}

fn shape(ranks: usize, quant: LlQuant, weights: bool, hook: bool) -> Shape {
    let tokens = [8, 5, 0, 7, 8, 3, 8, 1];
    Shape {
        ranks,
        experts: 4 * ranks,
        topk: 3.min(4 * ranks),
        hidden: 1024,
        t_max: 8,
        tokens: tokens[..ranks].to_vec(),
        quant,
        weights,
        hook,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn graph_replays_bf16_dispatch_and_combine_in_one_graph() {
    let ranks = ranks_up_to(BackendKind::Cuda, 4);
    for (weights, hook) in [(true, false), (false, false), (true, true)] {
        check_replays(&shape(ranks, LlQuant::Bf16, weights, hook), 12, true);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn graph_replays_fp8_dispatch_then_combine() {
    let ranks = ranks_up_to(BackendKind::Cuda, 4);
    for (quant, weights, hook) in [(PLAIN, true, false), (UE8M0, false, true)] {
        let mut sh = shape(ranks, quant, weights, hook);
        sh.hidden = 2048;
        check_replays(&sh, 8, false);
    }
}

/// One rank never calls: without shrink mode the others fail with a timeout naming it; with shrink mode
/// they mask it and finish with what the others sent (the host backend with the same mask agrees).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn a_silent_peer_times_out_or_is_masked() {
    let ranks = ranks_up_to(BackendKind::Cuda, 4);
    if ranks < 2 {
        skip("needs 2 ranks (MOELINK_TEST_RANKS)");
        return;
    }
    let silent = ranks - 1;
    let sh = Shape { hook: false, ..shape(ranks, PLAIN, true, false) };
    let steps: Vec<Step> = (0..ranks).map(|me| step_inputs(&sh, me, 0)).collect();

    let opts = BufferOptions { backend: BackendKind::Cuda, timeout_ms: 1500, ..test_options() };
    check_silent_peer(ranks, silent, &opts, |buf| {
        let me = buf.rank();
        eager_round(buf, &sh, &steps[me], false)
    });
}
