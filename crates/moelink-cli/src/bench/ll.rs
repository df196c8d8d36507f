//! One rank of the low-latency bench: per case a checked call, then the timed repetitions into its outputs
//! (CUDA-graph replays on CUDA).
//!
//! Dispatch carries the top-k weights (moelink's extension), so combine may pre-reduce on the expert side.
//! The "experts" are the identity: they return their (dequantised) received rows, so combine must give
//! `x × Σ weights` up to FP8 and bf16 rounding.

use std::sync::Arc;

use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, CapturedGraph, Group, LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs,
    LlDispatchResult, LlHandle, LlQuant, Result, Tensor, ThreadGroup,
};

use super::inputs::{e4m3_to_f32, Inputs, Shape};
use super::{settle, Dtype, Job, Op, RankOutcome};

/// Relative error FP8 E4M3 quantisation may add (3 mantissa bits: half an ulp is 2^-4), with slack.
const FP8_REL: f32 = 0.0625 * 1.01;

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

    fn dispatch_args(&self, s: &Shape, dtype: Dtype) -> LlDispatchArgs<'_> {
        LlDispatchArgs {
            x: self.x.view(),
            topk_idx: self.topk.view(),
            topk_weights: Some(self.weights.view()),
            num_max_dispatch_tokens_per_rank: s.tokens,
            num_experts: s.experts,
            quant: match dtype {
                Dtype::Bf16 => LlQuant::Bf16,
                Dtype::Fp8 => LlQuant::Fp8 { round_scale: false, use_ue8m0: false },
            },
            return_recv_hook: false,
        }
    }
}

impl LlTensors {
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

/// Event times of timed repetitions and, with low-latency tracing on, the kernel trace of each.
#[derive(Default)]
struct Timed {
    us: Vec<f64>,
    traces: Vec<moelink::diag::KernelTrace>,
}

impl Timed {
    fn push(&mut self, buf: &Buffer, us: f64) {
        self.us.push(us);
        // One call per region here: its one launch (the receive launch in a hook's receive region).
        self.traces.extend(buf.kernel_traces().pop());
    }
}

/// Times replays of `graph`, each in its own timed region.
///
/// # Safety
/// As [`Buffer::replay`]: every tensor the graph was captured with (inputs, outputs, the handle) is alive,
/// with the same shapes.
unsafe fn time_replays(buf: &mut Buffer, job: &Job<'_>, graph: &CapturedGraph) -> Result<Timed> {
    let mut t = Timed::default();
    for i in 0..job.warmup + job.reps {
        // SAFETY: forwarded contract.
        let ((), us) = buf.timed(|b| unsafe { b.replay(graph) })?;
        if i >= job.warmup {
            t.push(buf, us);
        }
        job.tick(buf.rank());
    }
    Ok(t)
}

/// Times send-graph replays and receive-graph replays alternately, each in its own timed region.
///
/// # Safety
/// As [`time_replays`], for both graphs.
unsafe fn time_split_replays(buf: &mut Buffer, job: &Job<'_>, send: &CapturedGraph, recv: &CapturedGraph) -> Result<(Timed, Timed)> {
    let (mut send_t, mut recv_t) = (Timed::default(), Timed::default());
    for i in 0..job.warmup + job.reps {
        // SAFETY: forwarded contract.
        let ((), s) = buf.timed(|b| unsafe { b.replay(send) })?;
        if i >= job.warmup {
            send_t.push(buf, s);
        }
        // SAFETY: forwarded contract.
        let ((), r) = buf.timed(|b| unsafe { b.replay(recv) })?;
        if i >= job.warmup {
            recv_t.push(buf, r);
        }
    }
    Ok((send_t, recv_t))
}

/// Runs every case of `job` on this rank; the outcomes line up with `job.cases`.
///
/// Per case: one call with outputs allocated by moelink, checked (and on CUDA compared with the host
/// backend); then the timed repetitions write into that call's outputs: on CUDA one call captured into a
/// graph and replayed (the combine graph is captured after the checked dispatch, whose handle it uses), on
/// the host backend the calls themselves.
pub fn run_rank(g: ThreadGroup, job: &Job<'_>, num_rdma_bytes: usize) -> Result<Vec<RankOutcome>> {
    let me = g.rank();
    let group: Arc<dyn Group> = Arc::new(g);
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
                let args = t.dispatch_args(&s, case.dtype);
                let Some(mut res) = settle(buf.low_latency_dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                out.failures.extend(check_dispatch(&res, inputs, me, case.dtype)?);
                if let Some(tw) = twin.as_mut() {
                    match tw.low_latency_dispatch(&host_tensors.dispatch_args(&s, case.dtype)) {
                        Ok(host_res) => {
                            let diffs = compare_dispatch(&res, &host_res, &s, case.dtype)?;
                            out.matches_host = Some(diffs.is_empty());
                            out.failures.extend(diffs.into_iter().map(|d| format!("{d} differs from the host backend")));
                        }
                        // No host reference to compare with (yet): the invariant checks above still ran.
                        Err(moelink::Error::Unavailable(_)) => {}
                        Err(e) => out.failures.push(format!("host backend comparison failed: {e}")),
                    }
                }
                let timed = if uses_graphs(&buf) {
                    let outputs = outputs_of(&mut res, &s)?;
                    buf.capture(|b| b.low_latency_dispatch_into(&args, outputs).map(drop)).and_then(|(graph, ())| {
                        // SAFETY: the graph reads `t`'s inputs and writes `res`; both outlive it (dropped here).
                        unsafe { time_replays(&mut buf, job, &graph) }
                    })
                } else {
                    job.time(&mut buf, |b| b.low_latency_dispatch_into(&args, outputs_of(&mut res, &s)?).map(drop))
                        .map(|us| Timed { us, traces: Vec::new() })
                };
                if let Some(t) = settle(timed, out) {
                    (out.times_us, out.traces[0]) = (t.us, t.traces);
                    out.timer = Some(timer_of(&buf));
                }
                if job.hook && out.error.is_none() && out.unavailable.is_none() {
                    if let Some((send, recv)) = settle(time_hook_dispatch(&mut buf, job, &args, &mut res, &s), out) {
                        (out.send_us, out.traces[1]) = (send.us, send.traces);
                        (out.recv_us, out.traces[2]) = (recv.us, recv.traces);
                    }
                }
            }
            Op::Combine => {
                let args = t.dispatch_args(&s, combine_dtype);
                let Some(d) = settle(buf.low_latency_dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                let y_host = Tensor::from_vec(expert_outputs(&d, &s, combine_dtype)?, &[s.local_experts(), s.ranks * s.tokens, s.hidden])?;
                let y = if job.backend == BackendKind::Host { y_host } else { buf.upload(&y_host)? };
                let cargs = t.combine_args(&y, &d.handle);
                let Some(mut c) = settle(buf.low_latency_combine(&cargs), out) else {
                    job.skip(me);
                    continue;
                };
                let got: Vec<bf16> = c.to_vec()?;
                out.failures.extend(check_combine(&got, inputs, me, combine_dtype));
                if let Some(tw) = twin.as_mut() {
                    match host_combine(tw, &host_tensors, &s, combine_dtype) {
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
                let timed = if uses_graphs(&buf) {
                    let outputs = combine_outputs(&mut c);
                    buf.capture(|b| b.low_latency_combine_into(&cargs, outputs).map(drop)).and_then(|(graph, ())| {
                        // SAFETY: the graph reads `y`, `t`'s routing and `d`'s handle and writes `c`; all outlive it.
                        unsafe { time_replays(&mut buf, job, &graph) }
                    })
                } else {
                    job.time(&mut buf, |b| b.low_latency_combine_into(&cargs, combine_outputs(&mut c)).map(drop))
                        .map(|us| Timed { us, traces: Vec::new() })
                };
                if let Some(t) = settle(timed, out) {
                    (out.times_us, out.traces[0]) = (t.us, t.traces);
                    out.timer = Some(timer_of(&buf));
                }
                if job.hook && out.error.is_none() && out.unavailable.is_none() {
                    if let Some((send, recv)) = settle(time_hook_combine(&mut buf, job, &cargs, &mut c), out) {
                        (out.send_us, out.traces[1]) = (send.us, send.traces);
                        (out.recv_us, out.traces[2]) = (recv.us, recv.traces);
                    }
                }
                if uses_graphs(&buf)
                    && out.error.is_none()
                    && out.unavailable.is_none()
                    // The timed replays came back with kernel traces: the backend is tracing.
                    && !out.traces[0].is_empty()
                {
                    if let Some((times, traces)) = settle(time_loop(&mut buf, job, &args, &y, t, &s), out) {
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
type LoopTimes = ([Vec<f64>; 3], [Vec<moelink::diag::KernelTrace>; 2]);
fn time_loop(buf: &mut Buffer, job: &Job<'_>, args: &LlDispatchArgs<'_>, y: &Tensor, t: &LlTensors, s: &Shape) -> Result<LoopTimes> {
    let mut d = buf.low_latency_dispatch(args)?;
    let mut c = buf.low_latency_combine(&t.combine_args(y, &d.handle))?;
    let (graph, ()) = buf.capture(|b| {
        let (handle, _) = b.low_latency_dispatch_into(args, outputs_of(&mut d, s)?)?;
        let cargs = t.combine_args(y, &handle);
        b.low_latency_combine_into(&cargs, combine_outputs(&mut c)).map(drop)
    })?;
    // The replays are enqueued asynchronously on a stream of ours, as a model's calls are (and as DeepEP's
    // test launches them): synchronous replays kept the ranks apart by a host round trip per call, and each
    // dispatch kernel then waited for its peers' launches.
    let moelink::Location::Cuda(ordinal) = buf.location() else {
        return Err(moelink::Error::invalid("backend", buf.rank(), "the back-to-back timing needs a CUDA buffer"));
    };
    let stream = moelink_cuda::Stream::new(&moelink_cuda::Device::new(ordinal)?)?;
    // SAFETY: `stream` outlives its use (set back to None below, after the timed regions waited for their
    // work); every tensor the replays touch lives until the end of this function.
    unsafe { buf.set_stream(Some(stream.raw_handle())) };
    let timed = time_loop_regions(buf, job, &graph);
    // SAFETY: back to the buffer's own stream; the regions above waited for everything enqueued on `stream`.
    unsafe { buf.set_stream(None) };
    timed
}

/// The timed regions of [`time_loop`].
fn time_loop_regions(buf: &mut Buffer, job: &Job<'_>, graph: &CapturedGraph) -> Result<LoopTimes> {
    let mut out: [Vec<f64>; 3] = Default::default();
    let mut traces: [Vec<moelink::diag::KernelTrace>; 2] = Default::default();
    for i in 0..(job.reps / 4).max(1) + 1 {
        let ((), us) = buf.timed(|b| {
            for _ in 0..LOOP_CALLS {
                // SAFETY: the graph reads the inputs and `y` and writes `d` and `c` of time_loop, all alive
                // until time_loop returns, after these regions.
                unsafe { b.replay(graph)? };
            }
            Ok(())
        })?;
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
/// replayed alternately; host: the calls. Returns (send µs, receive µs) per rep.
fn time_hook_dispatch(
    buf: &mut Buffer,
    job: &Job<'_>,
    args: &LlDispatchArgs<'_>,
    res: &mut LlDispatchResult,
    s: &Shape,
) -> Result<(Timed, Timed)> {
    let hook_args = LlDispatchArgs { return_recv_hook: true, ..*args };
    let rank = buf.rank();
    let no_hook = || moelink::Error::invalid("return_recv_hook", rank, "the dispatch returned no receive hook");
    if uses_graphs(buf) {
        let outputs = outputs_of(res, s)?;
        let (send, (_handle, hook)) = buf.capture(|b| b.low_latency_dispatch_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let (recv, ()) = buf.capture(|b| b.run_hook(hook))?;
        // SAFETY: the graphs read the caller's inputs (`args`) and write `res`, all of which outlive them.
        return unsafe { time_split_replays(buf, job, &send, &recv) };
    }
    let (mut send, mut recv) = (Timed::default(), Timed::default());
    for i in 0..job.warmup + job.reps {
        let outputs = outputs_of(res, s)?;
        let ((_handle, hook), send_us) = buf.timed(|b| b.low_latency_dispatch_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let ((), recv_us) = buf.timed(|b| b.run_hook(hook))?;
        if i >= job.warmup {
            send.push(buf, send_us);
            recv.push(buf, recv_us);
        }
    }
    Ok((send, recv))
}

/// As [`time_hook_dispatch`], for combine (into `combined`, with the checked dispatch's handle).
fn time_hook_combine(buf: &mut Buffer, job: &Job<'_>, args: &LlCombineArgs<'_>, combined: &mut Tensor) -> Result<(Timed, Timed)> {
    let hook_args = LlCombineArgs { return_recv_hook: true, ..*args };
    let rank = buf.rank();
    let no_hook = || moelink::Error::invalid("return_recv_hook", rank, "the combine returned no receive hook");
    if uses_graphs(buf) {
        let outputs = combine_outputs(combined);
        let (send, hook) = buf.capture(|b| b.low_latency_combine_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let (recv, ()) = buf.capture(|b| b.run_hook(hook))?;
        // SAFETY: the graphs read the caller's inputs and handle (`args`) and write `combined`, all of which
        // outlive them.
        return unsafe { time_split_replays(buf, job, &send, &recv) };
    }
    let (mut send, mut recv) = (Timed::default(), Timed::default());
    for i in 0..job.warmup + job.reps {
        let outputs = combine_outputs(combined);
        let (hook, send_us) = buf.timed(|b| b.low_latency_combine_into(&hook_args, outputs))?;
        let hook = hook.ok_or_else(no_hook)?;
        let ((), recv_us) = buf.timed(|b| b.run_hook(hook))?;
        if i >= job.warmup {
            send.push(buf, send_us);
            recv.push(buf, recv_us);
        }
    }
    Ok((send, recv))
}

/// The host backend's dispatch + identity experts + combine on the same inputs.
fn host_combine(tw: &mut Buffer, t: &LlTensors, s: &Shape, dtype: Dtype) -> Result<Vec<bf16>> {
    let d = tw.low_latency_dispatch(&t.dispatch_args(s, dtype))?;
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
                        y[i] = bf16::from_f32(e4m3_to_f32(q[i]) * scale);
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

/// Which valid outputs of two dispatches differ (bitwise; rows past the counts are unspecified).
fn compare_dispatch(a: &LlDispatchResult, b: &LlDispatchResult, s: &Shape, dtype: Dtype) -> Result<Vec<String>> {
    let mut d = Vec::new();
    let (ca, cb) = (counts(a, s)?, counts(b, s)?);
    if ca != cb {
        d.push("recv_count".to_string());
        return Ok(d);
    }
    let (el, rows, h) = (s.local_experts(), s.ranks * s.tokens, s.hidden);
    let row = h * if dtype == Dtype::Fp8 { 1 } else { 2 };
    let (xa, xb) = (a.recv_x.to_host_bytes()?, b.recv_x.to_host_bytes()?);
    if (0..el).any(|e| xa[e * rows * row..(e * rows + ca[e]) * row] != xb[e * rows * row..(e * rows + ca[e]) * row]) {
        d.push("recv_x".into());
    }
    if let (Some(sa), Some(sb)) = (&a.recv_x_scales, &b.recv_x_scales) {
        let (sa, sb): (Vec<f32>, Vec<f32>) = (sa.to_vec()?, sb.to_vec()?);
        let cols = s.scale_cols();
        let differs = (0..el).any(|e| {
            (0..cols).any(|c| {
                let r = (e * cols + c) * rows..(e * cols + c) * rows + ca[e];
                sa.get(r.clone()).map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                    != sb.get(r).map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            })
        });
        if differs {
            d.push("recv_x_scales".into());
        }
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
    use crate::rng::RoutingKind;

    /// The checks accept the host backend's results and reject results for other inputs (skips while the
    /// host low-latency backend reports unavailable).
    #[test]
    fn checks_pass_on_the_truth_and_catch_wrong_results() {
        let shape = Shape { ranks: 2, tokens: 16, hidden: 256, topk: 4, experts: 8 };
        let good = Inputs::generate(shape, RoutingKind::Uniform, 1, false);
        let other = Inputs::generate(shape, RoutingKind::Uniform, 2, false);
        let out = moelink::group::run_ranks(2, |g| {
            let me = g.rank();
            let num_rdma_bytes = Buffer::ll_bytes_needed(shape.tokens, shape.hidden, shape.ranks, shape.experts);
            let opts = BufferOptions { backend: BackendKind::Host, num_rdma_bytes, low_latency_mode: true, ..Default::default() };
            let mut buf = Buffer::new(Arc::new(g), opts)?;
            let t = LlTensors::host(&good, me)?;
            let mut pairs = Vec::new();
            for dtype in [Dtype::Bf16, Dtype::Fp8] {
                let d = match buf.low_latency_dispatch(&t.dispatch_args(&shape, dtype)) {
                    Err(moelink::Error::Unavailable(why)) => return Ok(Err(why)),
                    r => r?,
                };
                pairs.push((check_dispatch(&d, &good, me, dtype)?, check_dispatch(&d, &other, me, dtype)?));
                let y = Tensor::from_vec(expert_outputs(&d, &shape, dtype)?, &[4, 2 * 16, 256])?;
                let c = buf.low_latency_combine(&t.combine_args(&y, &d.handle))?;
                let got: Vec<bf16> = c.to_vec()?;
                pairs.push((check_combine(&got, &good, me, dtype), check_combine(&got, &other, me, dtype)));
            }
            Ok(Ok(pairs))
        });
        for r in out {
            match r.unwrap() {
                Err(why) => eprintln!("skipping: {why}"),
                Ok(pairs) => {
                    for (i, (truth, wrong)) in pairs.into_iter().enumerate() {
                        assert!(truth.is_empty(), "check {i}: {truth:?}");
                        assert!(!wrong.is_empty(), "check {i} accepted results for other inputs");
                    }
                }
            }
        }
    }
}
