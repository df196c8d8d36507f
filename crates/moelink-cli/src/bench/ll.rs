//! One rank of the low-latency bench: per case a checked call, then the timed repetitions (on CUDA,
//! replays of a pipeline captured into CUDA graphs, [`moelink::graph::LlGraph`]; on the host backend the
//! calls, into the checked call's outputs).
//!
//! Dispatch carries the top-k weights (moelink's extension), so combine may pre-reduce on the expert side,
//! unless the job asks for DeepEP's API (`--ll-per-expert`): then combine sends every expert's row home.
//! The "experts" are the identity: they return their (dequantised) received rows, so combine must give
//! `x × Σ weights` up to FP8 and bf16 rounding.

use std::sync::Arc;

use moelink::graph::{LlGraph, LlGraphCombine, LlGraphSpec, LlGraphSplit};
use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, Group, LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlDispatchResult,
    LlHandle, LlQuant, Result, Tensor,
};
use moelink_testkit::differ::{ll_valid_part, Diffs};
use moelink_testkit::inputs::{Inputs, Shape};

use super::{settle, Dtype, Job, Op, RankOutcome};

/// Relative error FP8 E4M3 quantisation may add (3 mantissa bits: half an ulp is 2^-4), with slack.
const FP8_REL: f32 = 0.0625 * 1.01;

fn quant_of(dtype: Dtype) -> LlQuant {
    match dtype {
        Dtype::Bf16 => LlQuant::Bf16,
        Dtype::Fp8 => LlQuant::Fp8 { round_scale: false, use_ue8m0: false },
    }
}

struct LlTensors {
    topk: Tensor,
    weights: Tensor,
    x: Tensor,
}

impl LlTensors {
    fn host(inputs: &Inputs, rank: usize) -> Result<LlTensors> {
        let s = &inputs.shape;
        let r = &inputs.ranks[rank];
        Ok(LlTensors {
            topk: Tensor::from_vec(r.topk_idx.clone(), &[s.tokens, s.topk])?,
            weights: Tensor::from_vec(r.topk_weights.clone(), &[s.tokens, s.topk])?,
            x: Tensor::from_vec(r.x.clone(), &[s.tokens, s.hidden])?,
        })
    }

    fn upload(&self, buf: &Buffer) -> Result<LlTensors> {
        Ok(LlTensors { topk: buf.upload(&self.topk)?, weights: buf.upload(&self.weights)?, x: buf.upload(&self.x)? })
    }

    fn dispatch_args(&self, s: &Shape, dtype: Dtype, weights: bool) -> LlDispatchArgs<'_> {
        LlDispatchArgs {
            x: self.x.view(),
            topk_idx: self.topk.view(),
            topk_weights: weights.then(|| self.weights.view()),
            num_max_dispatch_tokens_per_rank: s.tokens,
            num_experts: s.experts,
            quant: quant_of(dtype),
            return_recv_hook: false,
        }
    }

    /// Combine of the expert outputs `y` of the dispatch behind `handle`, with this rank's routing and weights.
    fn combine_args<'a>(&'a self, y: &'a Tensor, handle: &'a LlHandle) -> LlCombineArgs<'a> {
        LlCombineArgs {
            x: y.view(),
            topk_idx: self.topk.view(),
            topk_weights: self.weights.view(),
            handle,
            zero_copy: false,
            return_recv_hook: false,
        }
    }
}

/// Views of a dispatch result's tensors as the outputs of the next dispatch into them (scales stored
/// `[E_local, packs, R*T_max]`, viewed as `[E_local, R*T_max, packs]`).
fn outputs_of<'a>(res: &'a mut LlDispatchResult, s: &Shape) -> Result<LlDispatchOutputs<'a>> {
    let (el, rows, cols) = (s.local_experts(), s.ranks * s.tokens, s.scale_cols());
    Ok(LlDispatchOutputs {
        recv_x: res.recv_x.view_mut(),
        recv_scales: match res.recv_x_scales.as_mut() {
            Some(t) => Some(t.view_mut_strided(&[el, rows, cols], &[(cols * rows) as isize, 1, rows as isize])?),
            None => None,
        },
        recv_count: res.recv_count.view_mut(),
        cumulative_local_expert_recv_stats: None,
        dispatch_wait_recv_cost_stats: None,
        src_info: None,
        layout_range: None,
    })
}

fn combine_outputs(combined: &mut Tensor) -> LlCombineOutputs<'_> {
    LlCombineOutputs { combined_x: combined.view_mut(), combine_wait_recv_cost_stats: None }
}

/// How the low-latency calls are timed: replays of CUDA graphs captured once (CUDA), or the calls (host).
fn uses_graphs(buf: &Buffer) -> bool {
    buf.backend_name() == "cuda"
}

fn timer_of(buf: &Buffer) -> &'static str {
    if uses_graphs(buf) {
        "cuda-graph-events"
    } else {
        buf.timer_name()
    }
}

/// The pipeline a timing replays: this rank's inputs of `inputs`, dispatched as `dtype`; with a combine of
/// the expert outputs `y` (`bf16 [E_local, R*T_max, H]`, written before the first replay) when given.
fn pipeline(buf: &mut Buffer, job: &Job<'_>, dtype: Dtype, hook: bool, y: Option<&[bf16]>, graphs: LlGraphSplit) -> Result<LlGraph> {
    let inputs = job.inputs;
    let s = &inputs.shape;
    let spec = LlGraphSpec {
        num_tokens: s.tokens,
        num_max_dispatch_tokens_per_rank: s.tokens,
        hidden: s.hidden,
        topk: s.topk,
        num_experts: s.experts,
        quant: quant_of(dtype),
        dispatch_weights: job.ll_dispatch_weights,
        return_recv_hook: hook,
        combine: if y.is_some() { LlGraphCombine::ExpertOutputs } else { LlGraphCombine::None },
        graphs,
    };
    let mut p = LlGraph::new(buf, spec)?;
    let r = &inputs.ranks[buf.rank()];
    p.write_inputs(&r.x, &r.topk_idx, &r.topk_weights)?;
    if let Some(y) = y {
        p.write_expert_outputs(y)?;
    }
    Ok(p)
}

/// Event times of timed repetitions and, with low-latency tracing on, the kernel trace of each.
#[derive(Default)]
struct Timed {
    us: Vec<f64>,
    traces: Vec<moelink::trace::KernelTrace>,
}

impl Timed {
    fn push(&mut self, buf: &Buffer, us: f64) {
        self.us.push(us);
        // One call per region here: its one launch (the receive launch in a hook's receive region).
        self.traces.extend(buf.kernel_traces().pop());
    }
}

/// Times replays of graph `index` of `p`, each in its own timed region (every earlier graph ran once first).
fn time_replays(buf: &mut Buffer, job: &Job<'_>, p: &LlGraph, index: usize) -> Result<Timed> {
    (0..index).try_for_each(|i| p.replay_graph(buf, i))?;
    let mut t = Timed::default();
    for i in 0..job.warmup + job.reps {
        let ((), us) = buf.timed(|b| p.replay_graph(b, index))?;
        if i >= job.warmup {
            t.push(buf, us);
        }
        job.tick(buf.rank());
    }
    Ok(t)
}

/// Times replays of the send graph `index` and the receive graph `index + 1` of `p` alternately, each in its
/// own timed region (every earlier graph ran once first).
fn time_split_replays(buf: &mut Buffer, job: &Job<'_>, p: &LlGraph, index: usize) -> Result<(Timed, Timed)> {
    (0..index).try_for_each(|i| p.replay_graph(buf, i))?;
    let (mut send_t, mut recv_t) = (Timed::default(), Timed::default());
    for i in 0..job.warmup + job.reps {
        let ((), s) = buf.timed(|b| p.replay_graph(b, index))?;
        if i >= job.warmup {
            send_t.push(buf, s);
        }
        let ((), r) = buf.timed(|b| p.replay_graph(b, index + 1))?;
        if i >= job.warmup {
            recv_t.push(buf, r);
        }
    }
    Ok((send_t, recv_t))
}

/// Runs every case of `job` on this rank; the outcomes line up with `job.cases`.
///
/// Per case: one call with outputs allocated by moelink, checked (and on CUDA compared with the host
/// backend); then the timed repetitions: on CUDA replays of the same call captured in a pipeline (the
/// combine's pipeline replays its dispatch once, then times the combine graph), on the host backend the
/// calls themselves, into the checked call's outputs.
pub fn run_rank(group: Arc<dyn Group>, job: &Job<'_>, num_rdma_bytes: usize) -> Result<Vec<RankOutcome>> {
    let me = group.rank();
    let inputs = job.inputs;
    let s = inputs.shape;
    let mut outs: Vec<RankOutcome> = job.cases.iter().map(|_| RankOutcome::default()).collect();
    let ll_opts = |backend| BufferOptions { backend, num_rdma_bytes, low_latency_mode: true, ..job.base.clone() };
    let mut buf = match Buffer::new(group.clone(), ll_opts(job.backend)) {
        Ok(b) => b,
        Err(moelink::Error::Unavailable(why)) => {
            for o in &mut outs {
                o.unavailable = Some(why.clone());
                job.skip(me);
            }
            return Ok(outs);
        }
        Err(e) => return Err(e),
    };
    let host_tensors = LlTensors::host(inputs, me)?;
    let tensors = if job.backend == BackendKind::Host { None } else { Some(host_tensors.upload(&buf)?) };
    let t = tensors.as_ref().unwrap_or(&host_tensors);
    let mut twin = if job.host_check { Some(Buffer::new(group.clone(), ll_opts(BackendKind::Host))?) } else { None };
    // Combine runs on the rows of the first measured dispatch type.
    let combine_dtype = job.cases.iter().find(|c| c.op == Op::Dispatch).map_or(Dtype::Fp8, |c| c.dtype);

    for (case, out) in job.cases.iter().zip(outs.iter_mut()) {
        match case.op {
            Op::Dispatch => {
                let args = t.dispatch_args(&s, case.dtype, job.ll_dispatch_weights);
                let Some(mut res) = settle(buf.low_latency_dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                out.failures.extend(check_dispatch(&res, inputs, me, case.dtype)?);
                if let Some(tw) = twin.as_mut() {
                    match tw.low_latency_dispatch(&host_tensors.dispatch_args(&s, case.dtype, job.ll_dispatch_weights)) {
                        Ok(host_res) => {
                            let diffs = compare_dispatch(&res, &host_res, &s, case.dtype)?;
                            out.matches_host = Some(diffs.is_empty());
                            out.failures.extend(diffs.0.into_iter().map(|d| format!("differs from the host backend: {d}")));
                        }
                        // No host reference to compare with (yet): the invariant checks above still ran.
                        Err(moelink::Error::Unavailable(_)) => {}
                        Err(e) => out.failures.push(format!("host backend comparison failed: {e}")),
                    }
                }
                let timed = if uses_graphs(&buf) {
                    pipeline(&mut buf, job, case.dtype, false, None, LlGraphSplit::PerCall).and_then(|p| time_replays(&mut buf, job, &p, 0))
                } else {
                    job.time(&mut buf, |b| b.low_latency_dispatch_into(&args, outputs_of(&mut res, &s)?).map(drop))
                        .map(|us| Timed { us, traces: Vec::new() })
                };
                if let Some(t) = settle(timed, out) {
                    (out.times_us, out.traces[0]) = (t.us, t.traces);
                    out.timer = Some(timer_of(&buf));
                }
                if job.hook && out.error.is_none() && out.unavailable.is_none() {
                    if let Some((send, recv)) = settle(time_hook_dispatch(&mut buf, job, &args, &mut res), out) {
                        (out.send_us, out.traces[1]) = (send.us, send.traces);
                        (out.recv_us, out.traces[2]) = (recv.us, recv.traces);
                    }
                }
            }
            Op::Combine => {
                let args = t.dispatch_args(&s, combine_dtype, job.ll_dispatch_weights);
                let Some(d) = settle(buf.low_latency_dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                let y_values = expert_outputs(&d, &s, combine_dtype)?;
                let y_host = Tensor::from_vec(y_values.clone(), &[s.local_experts(), s.ranks * s.tokens, s.hidden])?;
                let y = if job.backend == BackendKind::Host { y_host } else { buf.upload(&y_host)? };
                let cargs = t.combine_args(&y, &d.handle);
                let Some(mut c) = settle(buf.low_latency_combine(&cargs), out) else {
                    job.skip(me);
                    continue;
                };
                let got: Vec<bf16> = c.to_vec()?;
                out.failures.extend(check_combine(&got, inputs, me, combine_dtype));
                if let Some(tw) = twin.as_mut() {
                    match host_combine(tw, &host_tensors, &s, combine_dtype, job.ll_dispatch_weights) {
                        Ok(want) => {
                            out.matches_host = Some(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
                            let far =
                                got.iter().zip(&want).filter(|(a, b)| (a.to_f32() - b.to_f32()).abs() > b.to_f32().abs() / 64.0 + 1e-3);
                            let n = far.count();
                            if n > 0 {
                                out.failures.push(format!("{n} combined values differ from the host backend beyond bf16 rounding"));
                            }
                        }
                        Err(moelink::Error::Unavailable(_)) => {}
                        Err(e) => out.failures.push(format!("host backend comparison failed: {e}")),
                    }
                }
                let graphs = uses_graphs(&buf);
                let timed = if graphs {
                    pipeline(&mut buf, job, combine_dtype, false, Some(&y_values), LlGraphSplit::PerCall)
                        .and_then(|p| time_replays(&mut buf, job, &p, 1))
                } else {
                    job.time(&mut buf, |b| b.low_latency_combine_into(&cargs, combine_outputs(&mut c)).map(drop))
                        .map(|us| Timed { us, traces: Vec::new() })
                };
                if let Some(t) = settle(timed, out) {
                    (out.times_us, out.traces[0]) = (t.us, t.traces);
                    out.timer = Some(timer_of(&buf));
                }
                if job.hook && out.error.is_none() && out.unavailable.is_none() {
                    let hooked = if graphs {
                        pipeline(&mut buf, job, combine_dtype, true, Some(&y_values), LlGraphSplit::PerPhase)
                            .and_then(|p| time_split_replays(&mut buf, job, &p, 2))
                    } else {
                        time_hook_combine(&mut buf, job, &cargs, &mut c)
                    };
                    if let Some((send, recv)) = settle(hooked, out) {
                        (out.send_us, out.traces[1]) = (send.us, send.traces);
                        (out.recv_us, out.traces[2]) = (recv.us, recv.traces);
                    }
                }
                if graphs
                    && out.error.is_none()
                    && out.unavailable.is_none()
                    // The timed replays came back with kernel traces: the backend is tracing.
                    && !out.traces[0].is_empty()
                {
                    let looped = pipeline(&mut buf, job, combine_dtype, false, Some(&y_values), LlGraphSplit::One)
                        .and_then(|p| time_loop(&mut buf, job, &p));
                    if let Some((times, traces)) = settle(looped, out) {
                        out.loop_times = times;
                        out.loop_traces = traces;
                    }
                }
            }
        }
    }
    Ok(outs)
}

/// Pairs of calls per timed region in [`time_loop`] (the trace keeps 16 launches of each kernel).
const LOOP_CALLS: usize = 8;

/// DeepEP's way of timing (its test_low_latency: kernel durations from a profiler over dispatch + combine
/// called back to back, no barrier or L2 flush between calls): one graph holding a dispatch and the combine
/// of its rows, LOOP_CALLS replays per timed region, each kernel's duration from the trace
/// (low-latency tracing on). Returns [dispatch spans, combine spans, event µs per pair] (the pair time includes
/// the launches between replays) and the traces themselves, [dispatch, combine].
type LoopTimes = ([Vec<f64>; 3], [Vec<moelink::trace::KernelTrace>; 2]);
fn time_loop(buf: &mut Buffer, job: &Job<'_>, pipeline: &LlGraph) -> Result<LoopTimes> {
    // The replays are enqueued asynchronously on a stream of ours, as a model's calls are (and as DeepEP's
    // test launches them): synchronous replays kept the ranks apart by a host round trip per call, and each
    // dispatch kernel then waited for its peers' launches.
    let moelink::Location::Cuda(ordinal) = buf.location() else {
        return Err(moelink::Error::invalid("backend", buf.rank(), "the back-to-back timing needs a CUDA buffer"));
    };
    let stream = moelink_cuda::Stream::new(&moelink_cuda::Device::new(ordinal)?)?;
    let mut out: [Vec<f64>; 3] = Default::default();
    let mut traces: [Vec<moelink::trace::KernelTrace>; 2] = Default::default();
    for i in 0..(job.reps / 4).max(1) + 1 {
        let ((), us) = buf.on_stream(&stream, |scope| scope.timed(|scope| (0..LOOP_CALLS).try_for_each(|_| scope.replay(pipeline))))?;
        if i == 0 {
            continue; // warm-up region
        }
        for tr in buf.kernel_traces() {
            let k = usize::from(tr.op == "combine");
            out[k].push(tr.span_us);
            traces[k].push(tr);
        }
        out[2].push(us / LOOP_CALLS as f64);
    }
    Ok((out, traces))
}

/// Receive-hook mode: times the send phase (the call returns without waiting for data) and the receive
/// phase (`run_hook`) apart, each in its own timed region (so the receive phase starts with the data
/// already sent, as when compute overlaps the wait). CUDA: the two phases captured as two graphs and
/// replayed alternately; host: the calls into `res`. Returns (send µs, receive µs) per rep.
fn time_hook_dispatch(buf: &mut Buffer, job: &Job<'_>, args: &LlDispatchArgs<'_>, res: &mut LlDispatchResult) -> Result<(Timed, Timed)> {
    if uses_graphs(buf) {
        let dtype = if args.quant.is_fp8() { Dtype::Fp8 } else { Dtype::Bf16 };
        let p = pipeline(buf, job, dtype, true, None, LlGraphSplit::PerPhase)?;
        return time_split_replays(buf, job, &p, 0);
    }
    let hook_args = LlDispatchArgs { return_recv_hook: true, ..*args };
    let rank = buf.rank();
    let no_hook = || moelink::Error::invalid("return_recv_hook", rank, "the dispatch returned no receive hook");
    time_host_hooks(buf, job, |buf| {
        let outputs = outputs_of(res, &job.inputs.shape)?;
        let ((_handle, hook), send_us) = buf.timed(|b| b.low_latency_dispatch_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let ((), recv_us) = buf.timed(|b| b.run_hook(hook))?;
        Ok((send_us, recv_us))
    })
}

/// The host backend's hook timing: `rep` times one send phase and one receive phase; warm-up + reps of it.
fn time_host_hooks(buf: &mut Buffer, job: &Job<'_>, mut rep: impl FnMut(&mut Buffer) -> Result<(f64, f64)>) -> Result<(Timed, Timed)> {
    let (mut send, mut recv) = (Timed::default(), Timed::default());
    for i in 0..job.warmup + job.reps {
        let (send_us, recv_us) = rep(buf)?;
        if i >= job.warmup {
            send.push(buf, send_us);
            recv.push(buf, recv_us);
        }
    }
    Ok((send, recv))
}

/// As [`time_hook_dispatch`] for combine on the host backend (into `combined`, with the checked dispatch's
/// handle).
fn time_hook_combine(buf: &mut Buffer, job: &Job<'_>, args: &LlCombineArgs<'_>, combined: &mut Tensor) -> Result<(Timed, Timed)> {
    let hook_args = LlCombineArgs { return_recv_hook: true, ..*args };
    let rank = buf.rank();
    let no_hook = || moelink::Error::invalid("return_recv_hook", rank, "the combine returned no receive hook");
    time_host_hooks(buf, job, |buf| {
        let outputs = combine_outputs(combined);
        let (hook, send_us) = buf.timed(|b| b.low_latency_combine_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let ((), recv_us) = buf.timed(|b| b.run_hook(hook))?;
        Ok((send_us, recv_us))
    })
}

/// The host backend's dispatch + identity experts + combine on the same inputs.
fn host_combine(tw: &mut Buffer, t: &LlTensors, s: &Shape, dtype: Dtype, weights: bool) -> Result<Vec<bf16>> {
    let d = tw.low_latency_dispatch(&t.dispatch_args(s, dtype, weights))?;
    let y = Tensor::from_vec(expert_outputs(&d, s, dtype)?, &[s.local_experts(), s.ranks * s.tokens, s.hidden])?;
    let c = tw.low_latency_combine(&t.combine_args(&y, &d.handle))?;
    c.to_vec()
}

/// Valid rows per local expert, clamped to the buffer (a broken backend must not make us index out of range).
fn counts(d: &LlDispatchResult, s: &Shape) -> Result<Vec<usize>> {
    let rows = s.ranks * s.tokens;
    Ok(d.recv_count.to_vec::<i32>()?.iter().map(|&c| (c.max(0) as usize).min(rows)).collect())
}

/// What identity experts return: the received rows as bf16 (dequantised for FP8), zeros past the counts.
fn expert_outputs(d: &LlDispatchResult, s: &Shape, dtype: Dtype) -> Result<Vec<bf16>> {
    let (el, rows, h) = (s.local_experts(), s.ranks * s.tokens, s.hidden);
    let counts = counts(d, s)?;
    let mut y = vec![bf16::ZERO; el * rows * h];
    match dtype {
        Dtype::Bf16 => {
            let x: Vec<bf16> = d.recv_x.to_vec()?;
            for (e, &n) in counts.iter().enumerate().take(el) {
                let range = e * rows * h..(e * rows + n) * h;
                y[range.clone()].copy_from_slice(&x[range]);
            }
        }
        Dtype::Fp8 => {
            let q = d.recv_x.to_host_bytes()?;
            let scales: Vec<f32> = match &d.recv_x_scales {
                Some(t) => t.to_vec()?,
                None => return Err(moelink::Error::invalid("recv_x_scales", 0, "FP8 low-latency dispatch returned no scales")),
            };
            let cols = s.scale_cols();
            for (e, &n) in counts.iter().enumerate().take(el) {
                for slot in 0..n {
                    for c in 0..h {
                        // Scales are stored [E_local, H/128, R*T] (column-major in the logical view).
                        let scale = scales.get((e * cols + c / 128) * rows + slot).copied().unwrap_or(f32::NAN);
                        let i = (e * rows + slot) * h + c;
                        y[i] = bf16::from_f32(moelink::fp8::e4m3_to_f32(q[i]) * scale);
                    }
                }
            }
        }
    }
    Ok(y)
}

/// recv_count equals the reference; every valid row is its source token (bitwise for bf16, within FP8
/// rounding for FP8), in the packed order (source rank, then token).
fn check_dispatch(d: &LlDispatchResult, inputs: &Inputs, me: usize, dtype: Dtype) -> Result<Vec<String>> {
    let s = &inputs.shape;
    let (el, rows, h) = (s.local_experts(), s.ranks * s.tokens, s.hidden);
    let mut f = Vec::new();
    if d.recv_x.shape() != [el, rows, h] {
        f.push(format!("recv_x is {:?}, expected [{el}, {rows}, {h}]", d.recv_x.shape()));
        return Ok(f);
    }
    let want_rows = &inputs.reference.expert_rows[me];
    let got_counts = counts(d, s)?;
    let want_counts: Vec<usize> = want_rows.iter().map(|v| v.len()).collect();
    if got_counts != want_counts {
        f.push(format!("recv_count {got_counts:?} != reference {want_counts:?}"));
    }
    let y = expert_outputs(d, s, dtype)?;
    let mut bad = 0usize;
    let mut first = None;
    for e in 0..el {
        for (slot, &(src, t)) in want_rows[e].iter().enumerate().take(got_counts[e]) {
            let x = &inputs.ranks[src as usize].x[t as usize * h..(t as usize + 1) * h];
            let got = &y[(e * rows + slot) * h..(e * rows + slot + 1) * h];
            let ok = match dtype {
                Dtype::Bf16 => got.iter().zip(x).all(|(a, b)| a.to_bits() == b.to_bits()),
                Dtype::Fp8 => got.chunks(128).zip(x.chunks(128)).all(|(ga, xa)| {
                    let amax = xa.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                    ga.iter().zip(xa).all(|(a, b)| (a.to_f32() - b.to_f32()).abs() <= b.to_f32().abs() * FP8_REL + amax * 1e-3)
                }),
            };
            if !ok {
                bad += 1;
                first.get_or_insert((e, slot, src, t));
            }
        }
    }
    if let Some((e, slot, src, t)) = first {
        f.push(format!("{bad} received rows differ from their source token (first: expert {e} slot {slot}, rank {src} token {t})"));
    }
    Ok(f)
}

/// How a dispatch differs from the host backend's (bitwise, over the valid rows and their scales: rows past
/// the counts are unspecified).
fn compare_dispatch(res: &LlDispatchResult, host: &LlDispatchResult, s: &Shape, dtype: Dtype) -> Result<Diffs> {
    let mut d = Diffs::default();
    let (rows, row_bytes, cols) = (s.ranks * s.tokens, s.hidden * if dtype == Dtype::Fp8 { 1 } else { 2 }, s.scale_cols());
    let valid = |r: &LlDispatchResult| -> Result<(Vec<i32>, Vec<u8>, Vec<u8>)> {
        let count: Vec<i32> = r.recv_count.to_vec()?;
        let scales = r.recv_x_scales.as_ref().map(|t| t.to_host_bytes()).transpose()?.unwrap_or_default();
        let cols = if scales.is_empty() { 0 } else { cols };
        let (x, sc) = ll_valid_part(&count, &r.recv_x.to_host_bytes()?, &scales, rows, row_bytes, cols);
        Ok((count, x, sc))
    };
    let (want, got) = (valid(host)?, valid(res)?);
    d.eq("recv_count", &want.0, &got.0);
    if d.is_empty() {
        d.bytes("recv_x (valid rows)", &want.1, &got.1);
        d.bytes("recv_x_scales (valid rows)", &want.2, &got.2);
    }
    Ok(d)
}

/// Combine of identity experts ≈ `x × Σ_k w_k` (FP8 and bf16 rounding allowed).
fn check_combine(got: &[bf16], inputs: &Inputs, me: usize, dtype: Dtype) -> Vec<String> {
    let s = &inputs.shape;
    let r = &inputs.ranks[me];
    if got.len() != s.tokens * s.hidden {
        return vec![format!("combined_x has {} values, expected {}", got.len(), s.tokens * s.hidden)];
    }
    let q = if dtype == Dtype::Fp8 { FP8_REL } else { 0.0 };
    let mut bad = 0usize;
    let mut first = None;
    for t in 0..s.tokens {
        let wsum: f32 = (0..s.topk).filter(|&k| r.topk_idx[t * s.topk + k] >= 0).map(|k| r.topk_weights[t * s.topk + k]).sum();
        for c in 0..s.hidden {
            let x = r.x[t * s.hidden + c].to_f32();
            let want = x * wsum;
            let tol = x.abs() * wsum * q + want.abs() / 64.0 + 1e-3;
            let g = got[t * s.hidden + c].to_f32();
            if (g - want).abs() > tol || g.is_nan() {
                bad += 1;
                first.get_or_insert((t, c, g, want));
            }
        }
    }
    match first {
        None => Vec::new(),
        Some((t, c, g, w)) => {
            vec![format!("{bad} combined values are not x x sum(weights) (first: token {t} channel {c}: {g} instead of ~{w})")]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The checks accept the host backend's results and reject results for other inputs.
    #[test]
    fn checks_pass_on_the_truth_and_catch_wrong_results() {
        let shape = Shape { ranks: 2, tokens: 16, hidden: 256, topk: 4, experts: 8 };
        let (good, other) = super::super::tests::good_and_other(shape, false);
        let num_rdma_bytes = Buffer::ll_bytes_needed(shape.tokens, shape.hidden, shape.ranks, shape.experts);
        super::super::tests::assert_checks_on_host(
            BufferOptions { num_rdma_bytes, low_latency_mode: true, ..Default::default() },
            |buf, me| {
                let t = LlTensors::host(&good, me)?;
                let mut pairs = Vec::new();
                for (dtype, weights) in [(Dtype::Bf16, true), (Dtype::Fp8, true), (Dtype::Fp8, false)] {
                    let d = buf.low_latency_dispatch(&t.dispatch_args(&shape, dtype, weights))?;
                    pairs.push((check_dispatch(&d, &good, me, dtype)?, check_dispatch(&d, &other, me, dtype)?));
                    let y = Tensor::from_vec(expert_outputs(&d, &shape, dtype)?, &[4, 2 * 16, 256])?;
                    let c = buf.low_latency_combine(&t.combine_args(&y, &d.handle))?;
                    let got: Vec<bf16> = c.to_vec()?;
                    pairs.push((check_combine(&got, &good, me, dtype), check_combine(&got, &other, me, dtype)));
                }
                Ok(pairs)
            },
        );
    }
}
