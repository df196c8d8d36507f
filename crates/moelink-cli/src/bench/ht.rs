//! One rank of the high-throughput bench: layout, then per case a checked call and the timed repetitions
//! into its outputs.

use std::collections::HashMap;
use std::sync::Arc;

use super::{settle, Dtype, Job, Op, RankOutcome};
use moelink::{
    bf16, fresh, BackendKind, Buffer, BufferOptions, CombineArgs, CombineOutputs, Config, DispatchArgs, DispatchLayout, DispatchOutputs,
    DispatchResult, Group, Payload, Result, Routing, Tensor,
};
use moelink_testkit::differ::{compare_dispatch, Diffs, SeenDispatch};
use moelink_testkit::inputs::{Inputs, Shape};

/// One rank's input tensors (on the host, or uploaded to the buffer's device).
pub(super) struct HtTensors {
    topk: Tensor,
    weights: Tensor,
    x: Tensor,
    x_fp8: Option<Tensor>,
    scales: Option<Tensor>,
}

impl HtTensors {
    fn host(inputs: &Inputs, rank: usize) -> Result<HtTensors> {
        let s = &inputs.shape;
        let r = &inputs.ranks[rank];
        let fp8 = !r.x_fp8.is_empty();
        Ok(HtTensors {
            topk: Tensor::from_vec(r.topk_idx.clone(), &[s.tokens, s.topk])?,
            weights: Tensor::from_vec(r.topk_weights.clone(), &[s.tokens, s.topk])?,
            x: Tensor::from_vec(r.x.clone(), &[s.tokens, s.hidden])?,
            x_fp8: if fp8 { Some(Tensor::from_vec(r.x_fp8.clone(), &[s.tokens, s.hidden])?) } else { None },
            scales: if fp8 { Some(Tensor::from_vec(r.scales.clone(), &[s.tokens, s.scale_cols()])?) } else { None },
        })
    }

    fn upload(&self, buf: &Buffer) -> Result<HtTensors> {
        let up = |t: &Option<Tensor>| t.as_ref().map(|t| buf.upload(t)).transpose();
        Ok(HtTensors {
            topk: buf.upload(&self.topk)?,
            weights: buf.upload(&self.weights)?,
            x: buf.upload(&self.x)?,
            x_fp8: up(&self.x_fp8)?,
            scales: up(&self.scales)?,
        })
    }

    fn payload(&self, dtype: Dtype) -> Result<Payload<'_>> {
        match (dtype, &self.x_fp8, &self.scales) {
            (Dtype::Bf16, _, _) => Ok(Payload::Bf16(self.x.view())),
            (Dtype::Fp8, Some(x), Some(scales)) => Ok(Payload::Fp8 { x: x.view(), scales: scales.view() }),
            (Dtype::Fp8, _, _) => Err(moelink::Error::invalid("x", 0, "internal: FP8 inputs were not generated")),
        }
    }

    fn dispatch_args<'a>(&'a self, layout: &'a DispatchLayout, dtype: Dtype, config: Option<Config>) -> Result<DispatchArgs<'a>> {
        Ok(DispatchArgs {
            x: self.payload(dtype)?,
            routing: fresh(layout, Some(self.topk.view()), Some(self.weights.view())),
            expert_alignment: 1,
            num_worst_tokens: 0,
            config,
        })
    }
}

/// The host-backend twin of a CUDA run (same group, same inputs) for the bitwise comparison. Its results do
/// not depend on the SM count, so each is computed once per batch.
struct HostTwin {
    buf: Buffer,
    tensors: HtTensors,
    layout: DispatchLayout,
    dispatched: HashMap<Dtype, DispatchResult>,
    combined: Option<Vec<u8>>,
}

impl HostTwin {
    fn dispatch(&mut self, dtype: Dtype) -> Result<&DispatchResult> {
        if !self.dispatched.contains_key(&dtype) {
            let res = self.buf.dispatch(&self.tensors.dispatch_args(&self.layout, dtype, None)?)?;
            self.dispatched.insert(dtype, res);
        }
        Ok(&self.dispatched[&dtype])
    }

    /// Combine of identity experts after a bf16 dispatch, as bytes.
    fn combined(&mut self) -> Result<&[u8]> {
        if self.combined.is_none() {
            self.dispatch(Dtype::Bf16)?;
            let d = &self.dispatched[&Dtype::Bf16];
            let c = self.buf.combine(&CombineArgs {
                x: d.recv_x.view(),
                handle: &d.handle,
                topk_weights: None,
                bias: [None, None],
                config: None,
            })?;
            self.combined = Some(c.combined_x.to_host_bytes()?);
        }
        Ok(self.combined.as_deref().unwrap_or_default())
    }
}

/// Views of a dispatch result's tensors as the outputs of the next dispatch into them.
fn outputs_of(res: &mut DispatchResult) -> DispatchOutputs<'_> {
    DispatchOutputs {
        recv_x: res.recv_x.view_mut(),
        recv_scales: res.recv_x_scales.as_mut().map(|t| t.view_mut()),
        recv_topk_idx: res.recv_topk_idx.as_mut().map(|t| t.view_mut()),
        recv_topk_weights: res.recv_topk_weights.as_mut().map(|t| t.view_mut()),
        rank_prefix_matrix: None,
        recv_src_idx: None,
        channels: None,
    }
}

/// Runs every case of `job` on this rank; the outcomes line up with `job.cases`.
///
/// Per case: one call with outputs allocated by moelink, checked (and on CUDA compared bit for bit with the
/// host backend); then the timed repetitions write into that call's outputs. Dispatch times
/// `prepare_dispatch` + `dispatch_into` (CPU-sync mode: the count exchange and the host's wait for it are
/// part of the call), then the cached dispatch with that call's handle (what DeepEP's benchmark times);
/// combine times `combine_into` with the checked dispatch's handle.
pub fn run_rank(group: Arc<dyn Group>, job: &Job<'_>, num_nvl_bytes: usize, num_rdma_bytes: usize) -> Result<Vec<RankOutcome>> {
    let me = group.rank();
    let inputs = job.inputs;
    let s = inputs.shape;
    let mut outs: Vec<RankOutcome> = job.cases.iter().map(|_| RankOutcome::default()).collect();
    let opts = BufferOptions {
        backend: job.backend,
        num_nvl_bytes,
        num_rdma_bytes: num_rdma_bytes.max(job.base.num_rdma_bytes),
        ..job.base.clone()
    };
    let mut buf = match Buffer::new(group.clone(), opts.clone()) {
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
    let host_tensors = HtTensors::host(inputs, me)?;
    let tensors = if job.backend == BackendKind::Host { None } else { Some(host_tensors.upload(&buf)?) };
    let mut twin = if job.host_check {
        let mut hb = Buffer::new(group.clone(), BufferOptions { backend: BackendKind::Host, ..opts.clone() })?;
        let layout = hb.get_dispatch_layout(host_tensors.topk.view(), s.experts)?;
        Some(HostTwin { buf: hb, tensors: HtTensors::host(inputs, me)?, layout, dispatched: HashMap::new(), combined: None })
    } else {
        None
    };
    let t = tensors.as_ref().unwrap_or(&host_tensors);

    let mut layout_outcome = RankOutcome::default();
    let Some(layout) = settle(buf.get_dispatch_layout(t.topk.view(), s.experts), &mut layout_outcome) else {
        for o in &mut outs {
            o.unavailable.clone_from(&layout_outcome.unavailable);
            o.error.clone_from(&layout_outcome.error);
            job.skip(me);
        }
        return Ok(outs);
    };
    let mut layout_failures = check_layout(&layout, inputs, me)?;

    for (case, out) in job.cases.iter().zip(outs.iter_mut()) {
        let config = case.num_sms.map(Config::with_sms);
        out.num_sms = Some(case.num_sms.unwrap_or(buf.default_num_sms()));
        match case.op {
            Op::Dispatch => {
                out.failures.append(&mut layout_failures);
                let args = t.dispatch_args(&layout, case.dtype, config)?;
                let Some(mut res) = settle(buf.dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                out.failures.extend(check_dispatch(&res, inputs, me, case.dtype)?);
                if let Some(tw) = twin.as_mut() {
                    let diffs = compare_to_host(&res, tw.dispatch(case.dtype)?, s.topk)?;
                    out.matches_host = Some(diffs.is_empty());
                    out.failures.extend(diffs.0.into_iter().map(|d| format!("differs from the host backend: {d}")));
                }
                let timed = job.time(&mut buf, |b| {
                    let plan = b.prepare_dispatch(&args)?;
                    b.dispatch_into(plan, &args, outputs_of(&mut res)).map(drop)
                });
                if let Some(times) = settle(timed, out) {
                    out.times_us = times;
                    out.timer = Some(buf.timer_name());
                }
                // The cached dispatch of the same payload with this call's handle (no count exchange, no host
                // wait, no top-k): what DeepEP's benchmark times (`buffer.dispatch(x, handle=handle)`).
                let cargs = DispatchArgs { x: t.payload(case.dtype)?, routing: Routing::Cached(&res.handle), ..args };
                let Some(mut cached) = settle(buf.dispatch(&cargs), out) else {
                    continue;
                };
                out.failures.extend(compare_cached(&cached, &res)?);
                let timed = job.time_quietly(&mut buf, |b| {
                    let plan = b.prepare_dispatch(&cargs)?;
                    b.dispatch_into(plan, &cargs, outputs_of(&mut cached)).map(drop)
                });
                if let Some(times) = settle(timed, out) {
                    out.cached_us = times;
                }
            }
            Op::Combine => {
                // A fresh dispatch (its handle and rows) to combine: identity experts return recv_x as is.
                let args = t.dispatch_args(&layout, Dtype::Bf16, config)?;
                let Some(d) = settle(buf.dispatch(&args), out) else {
                    job.skip(me);
                    continue;
                };
                let cargs = CombineArgs { x: d.recv_x.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config };
                let Some(mut c) = settle(buf.combine(&cargs), out) else {
                    job.skip(me);
                    continue;
                };
                out.failures.extend(check_combine(&c.combined_x, inputs, me)?);
                if let Some(tw) = twin.as_mut() {
                    let same = c.combined_x.to_host_bytes()? == tw.combined()?;
                    out.matches_host = Some(same);
                    if !same {
                        out.failures.push("combined_x differs from the host backend".into());
                    }
                }
                let timed = job.time(&mut buf, |b| {
                    let out = CombineOutputs {
                        combined_x: c.combined_x.view_mut(),
                        combined_topk_weights: c.combined_topk_weights.as_mut().map(|t| t.view_mut()),
                    };
                    b.combine_into(&cargs, out)
                });
                if let Some(times) = settle(timed, out) {
                    out.times_us = times;
                    out.timer = Some(buf.timer_name());
                }
            }
        }
    }
    Ok(outs)
}

fn check_layout(l: &DispatchLayout, inputs: &Inputs, me: usize) -> Result<Vec<String>> {
    let s = &inputs.shape;
    let r = &inputs.reference;
    let mut f = Vec::new();
    if l.num_tokens_per_rank.to_vec::<i32>()? != r.tokens_per_rank[me] {
        f.push("get_dispatch_layout: num_tokens_per_rank is wrong".into());
    }
    if l.num_tokens_per_expert.to_vec::<i32>()? != r.tokens_per_expert[me] {
        f.push("get_dispatch_layout: num_tokens_per_expert is wrong".into());
    }
    let el = s.local_experts();
    let mut want = vec![false; s.tokens * s.ranks];
    for (i, &e) in inputs.ranks[me].topk_idx.iter().enumerate() {
        if e >= 0 {
            want[(i / s.topk) * s.ranks + e as usize / el] = true;
        }
    }
    if l.is_token_in_rank.to_bools()? != want {
        f.push("get_dispatch_layout: is_token_in_rank is wrong".into());
    }
    Ok(f)
}

fn row_bytes(s: &Shape, dtype: Dtype) -> usize {
    s.hidden * if dtype == Dtype::Fp8 { 1 } else { 2 }
}

/// Every received row equals its source token's row (and scales, top-k), in receive order; per-expert counts
/// equal the reference.
fn check_dispatch(res: &DispatchResult, inputs: &Inputs, me: usize, dtype: Dtype) -> Result<Vec<String>> {
    let s = &inputs.shape;
    let rows = &inputs.reference.recv_rows[me];
    let n = rows.len();
    let mut f = Vec::new();
    if res.recv_x.shape() != [n, s.hidden] {
        f.push(format!("recv_x is {:?}, expected [{n}, {}]", res.recv_x.shape(), s.hidden));
        return Ok(f);
    }
    let got = res.recv_x.to_host_bytes()?;
    let rb = row_bytes(s, dtype);
    let source = |src: usize, t: usize| -> &[u8] {
        let r = &inputs.ranks[src];
        match dtype {
            Dtype::Bf16 => &bytemuck::cast_slice::<bf16, u8>(&r.x)[t * rb..(t + 1) * rb],
            Dtype::Fp8 => &bytemuck::cast_slice(&r.x_fp8)[t * rb..(t + 1) * rb],
        }
    };
    let bad: Vec<usize> = (0..n).filter(|&i| got[i * rb..(i + 1) * rb] != *source(rows[i].0 as usize, rows[i].1 as usize)).collect();
    if let Some(&i) = bad.first() {
        let (src, t) = rows[i];
        f.push(format!("{} of {n} received rows differ from their source token (first: row {i}, rank {src} token {t})", bad.len()));
    }
    if dtype == Dtype::Fp8 {
        let cols = s.scale_cols();
        match &res.recv_x_scales {
            Some(sc) if sc.shape() == [n, cols] => {
                let got: Vec<f32> = sc.to_vec()?;
                let bad = (0..n)
                    .filter(|&i| {
                        let (src, t) = (rows[i].0 as usize, rows[i].1 as usize);
                        got[i * cols..(i + 1) * cols] != inputs.ranks[src].scales[t * cols..(t + 1) * cols]
                    })
                    .count();
                if bad > 0 {
                    f.push(format!("{bad} of {n} received scale rows differ from their source"));
                }
            }
            Some(sc) => f.push(format!("recv_x_scales is {:?}, expected [{n}, {cols}]", sc.shape())),
            None => f.push("FP8 dispatch returned no scales".into()),
        }
    }
    let k = s.topk;
    let el = s.local_experts();
    let mut want_idx = Vec::with_capacity(n * k);
    let mut want_w = Vec::with_capacity(n * k);
    for &(src, t) in rows {
        let r = &inputs.ranks[src as usize];
        for j in 0..k {
            let e = r.topk_idx[t as usize * k + j];
            let local = e >= 0 && e as usize / el == me;
            want_idx.push(if local { (e as usize % el) as i64 } else { -1 });
            want_w.push(if local { r.topk_weights[t as usize * k + j] } else { 0.0 });
        }
    }
    match (&res.recv_topk_idx, &res.recv_topk_weights) {
        (Some(idx), Some(w)) => {
            if idx.to_vec::<i64>()? != want_idx {
                f.push("recv_topk_idx is wrong".into());
            }
            let got_w: Vec<u32> = w.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect();
            if got_w != want_w.iter().map(|v| v.to_bits()).collect::<Vec<_>>() {
                f.push("recv_topk_weights is wrong".into());
            }
        }
        _ => f.push("dispatch with top-k returned no recv_topk_idx / recv_topk_weights".into()),
    }
    let want_counts: Vec<usize> = inputs.reference.expert_rows[me].iter().map(|v| v.len()).collect();
    if res.num_recv_tokens_per_expert != want_counts {
        f.push(format!("num_recv_tokens_per_expert {:?} != reference {:?}", res.num_recv_tokens_per_expert, want_counts));
    }
    Ok(f)
}

/// How a dispatch differs from the host backend's on the same inputs (bitwise, every output).
fn compare_to_host(res: &DispatchResult, host: &DispatchResult, topk: usize) -> Result<Diffs> {
    let mut d = Diffs::default();
    compare_dispatch(&mut d, "dispatch", &SeenDispatch::of(host)?, &SeenDispatch::of(res)?, 0, topk);
    d.eq("num_recv_tokens_per_expert", &host.num_recv_tokens_per_expert, &res.num_recv_tokens_per_expert);
    Ok(d)
}

/// A cached dispatch of the same payload must reproduce the fresh dispatch's rows (and scales) bit for bit.
fn compare_cached(cached: &DispatchResult, fresh: &DispatchResult) -> Result<Vec<String>> {
    let mut diffs = Vec::new();
    if cached.recv_x.to_host_bytes()? != fresh.recv_x.to_host_bytes()? {
        diffs.push("cached dispatch: recv_x differs from the fresh dispatch".to_string());
    }
    let scales = |r: &DispatchResult| r.recv_x_scales.as_ref().map(|t| t.to_host_bytes()).transpose();
    if scales(cached)? != scales(fresh)? {
        diffs.push("cached dispatch: recv_scales differ from the fresh dispatch".to_string());
    }
    Ok(diffs)
}

/// Combine of identity experts returns `x × (ranks the token went to)`, exactly (small integers).
fn check_combine(combined: &Tensor, inputs: &Inputs, me: usize) -> Result<Vec<String>> {
    let s = &inputs.shape;
    if combined.shape() != [s.tokens, s.hidden] {
        return Ok(vec![format!("combined_x is {:?}, expected [{}, {}]", combined.shape(), s.tokens, s.hidden)]);
    }
    let got: Vec<bf16> = combined.to_vec()?;
    let x = &inputs.ranks[me].x;
    let hits = &inputs.reference.hits[me];
    let mut bad = 0usize;
    let mut first = None;
    for (t, &h) in hits.iter().enumerate().take(s.tokens) {
        for c in 0..s.hidden {
            let i = t * s.hidden + c;
            let want = if h == 0 { bf16::ZERO } else { bf16::from_f32(x[i].to_f32() * h as f32) };
            if got[i].to_bits() != want.to_bits() {
                bad += 1;
                first.get_or_insert((t, c, got[i], want));
            }
        }
    }
    Ok(match first {
        None => Vec::new(),
        Some((t, c, g, w)) => {
            vec![format!("{bad} combined values differ from x x ranks-hit (first: token {t} channel {c}: {g} instead of {w})")]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The checks accept the host backend's results and reject results for other inputs.
    #[test]
    fn checks_pass_on_the_truth_and_catch_wrong_results() {
        let shape = Shape { ranks: 2, tokens: 32, hidden: 256, topk: 4, experts: 8 };
        let (good, other) = super::super::tests::good_and_other(shape, true);
        let num_nvl_bytes = Buffer::ht_bytes_needed(shape.tokens, shape.hidden, shape.topk, shape.ranks, false);
        super::super::tests::assert_checks_on_host(BufferOptions { num_nvl_bytes, ..Default::default() }, |buf, me| {
            let t = HtTensors::host(&good, me)?;
            let layout = buf.get_dispatch_layout(t.topk.view(), shape.experts)?;
            let mut pairs = vec![(check_layout(&layout, &good, me)?, check_layout(&layout, &other, me)?)];
            for dtype in [Dtype::Bf16, Dtype::Fp8] {
                let d = buf.dispatch(&t.dispatch_args(&layout, dtype, None)?)?;
                pairs.push((check_dispatch(&d, &good, me, dtype)?, check_dispatch(&d, &other, me, dtype)?));
            }
            let d = buf.dispatch(&t.dispatch_args(&layout, Dtype::Bf16, None)?)?;
            let cargs = CombineArgs { x: d.recv_x.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None };
            let c = buf.combine(&cargs)?;
            pairs.push((check_combine(&c.combined_x, &good, me)?, check_combine(&c.combined_x, &other, me)?));
            Ok(pairs)
        });
    }
}
