//! Low-latency dispatch/combine on the host: the oracle for the GPU's LL kernels.
//!
//! Protocol (one `all_to_all` per call, after one `all_gather` that checks the call agrees on every rank):
//! - Dispatch: each rank quantises every token once (FP8 modes) and sends it once to each rank hosting one
//!   of its experts, in token order, with its top-k ids (and weights, when given). The receiver walks
//!   sources in ascending rank order and each source's tokens in order, and expands every token into the
//!   next free slot of each of its local experts: that is the documented row order.
//! - Combine: each rank returns, for every token it received, either one bf16 row per selected local
//!   expert (per-expert mode) or one bf16 partial `Σ_k w·y` over its local experts (pre-reduced mode); the
//!   home rank sums in the documented order.
//! - Shrink masks are applied by each rank as a receiver: dispatch drops what masked ranks sent, combine
//!   drops what masked ranks returned. Every thread still takes part in every exchange.

use std::sync::Arc;
use std::time::Instant;

use half::bf16;

use super::HOST;
use super::{bf16_bits_to_f32, f32_to_bf16_bits, input_bytes, output_bytes, HostBackend};
use crate::backend::{BackendData, PendingRecv};
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::fp8::{pack_ue8m0, quantize_token, ue8m0_byte, GROUP, UE8M0_PER_INT};
use crate::layout::{rank_of_expert, to_local_expert};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlQuant, LlSpec};
use crate::opaque::{backend_of, RecvPhase};
use crate::tensor::{Tensor, TensorMut};
use crate::validate::{read_i64_matrix, read_matrix};

/// Low-latency state that outlives a call.
pub(crate) struct LlState {
    /// Shrink mode: `mask[r]` means rank `r` is treated as failed.
    pub mask: Vec<bool>,
    /// Zero-copy combine source, `bf16 [E_local, R*T_max, H]`, handed out by `next_combine_buffer`.
    pub combine_staging: Option<Tensor>,
}

impl LlState {
    pub fn new(num_ranks: usize) -> LlState {
        LlState { mask: vec![false; num_ranks], combine_staging: None }
    }
}

/// One received token's selection of a local expert.
#[derive(Clone, Copy, Debug)]
struct Term {
    /// Position in the token's top-k row.
    k: u32,
    local_expert: u32,
    /// Row of `recv_x[local_expert]` the token was expanded into.
    slot: u32,
    /// Dispatch-time weight (0 when dispatch had no weights).
    weight: f32,
}

/// A token received from one source.
#[derive(Clone, Debug)]
struct RecvToken {
    /// Index of the token on its source rank.
    token: u32,
    /// Byte offset of its record in the source's dispatch message (used by the receive phase).
    offset: usize,
    /// Its local experts here, ascending `k`.
    terms: Vec<Term>,
}

/// Routing state of one low-latency dispatch (the handle's data on the host backend).
pub(crate) struct HostLlRouting {
    /// Home side: the `topk_idx` this rank dispatched, `[T * K]`; combine must pass the same.
    topk_idx: Vec<i64>,
    /// Home side: the dispatch-time weights (pre-reduced mode), `[T * K]`.
    topk_weights: Option<Vec<f32>>,
    /// Expert side: tokens received from each source rank, in the source's token order.
    recv_tokens: Vec<Vec<RecvToken>>,
    /// Valid rows of each local expert.
    recv_count: Vec<usize>,
}

/// A dispatch whose receive phase has not run yet (boxed in a `PendingRecv` when a hook holds it).
pub(crate) struct PendingDispatch<'a>(DispatchState<'a>);

struct DispatchState<'a> {
    spec: LlSpec,
    /// The handle's routing (a [`HostLlRouting`]).
    routing: Arc<BackendData>,
    /// Messages received from each source rank.
    recv: Vec<Vec<u8>>,
    mask: Vec<bool>,
    waited_ns: i64,
    out: LlDispatchOutputs<'a>,
}

/// A combine whose receive phase has not run yet (like [`PendingDispatch`]).
pub(crate) struct PendingCombine<'a>(CombineState<'a>);

struct CombineState<'a> {
    spec: LlSpec,
    /// The combine-time `topk_idx` and weights, `[T * K]`.
    topk_idx: Vec<i64>,
    topk_weights: Vec<f32>,
    recv: Vec<Vec<u8>>,
    mask: Vec<bool>,
    waited_ns: i64,
    out: LlCombineOutputs<'a>,
}

// ------------------------------------------------------------------ collective checks

/// Encodes the payload mode for the agreement check.
fn quant_code(q: LlQuant) -> u64 {
    match q {
        LlQuant::Bf16 => 0,
        LlQuant::Fp8 { round_scale, use_ue8m0 } => 1 | (u64::from(round_scale) << 1) | (u64::from(use_ue8m0) << 2),
    }
}

/// Values every rank of a low-latency call must share.
fn shared_values(s: &LlSpec) -> [(&'static str, u64); 6] {
    [
        ("hidden", s.hidden as u64),
        ("topk", s.topk as u64),
        ("num_experts", s.num_experts as u64),
        ("num_max_dispatch_tokens_per_rank", s.num_max_tokens as u64),
        ("quant", quant_code(s.quant)),
        ("topk_weights", u64::from(s.has_weights)),
    ]
}

/// One `all_gather` that checks the values every rank must share and spreads each rank's local argument
/// failures, so that a bad argument on one rank fails the call everywhere instead of leaving the other
/// ranks waiting in the data exchange. The failing rank gets its own `InvalidArgument`; the others get
/// `RankMismatch` (shared values) or an `InvalidArgument` naming the rank at fault.
fn collective_check(b: &HostBackend, phase: Phase, shared: &[(&'static str, u64)], local: &[(&'static str, Option<String>)]) -> Result<()> {
    let me = b.rank();
    let failed = local.iter().enumerate().fold(0u64, |m, (i, (_, why))| m | (u64::from(why.is_some()) << i));
    let mut msg: Vec<u8> = shared.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
    msg.extend_from_slice(&failed.to_le_bytes());
    let all = b.all_gather(phase, &msg)?;
    if let Some((arg, Some(why))) = local.iter().find(|(_, why)| why.is_some()) {
        return Err(Error::invalid(arg, me, why.clone()));
    }
    let word = |m: &[u8], i: usize| -> Option<u64> { Some(u64::from_le_bytes(m.get(8 * i..8 * i + 8)?.try_into().ok()?)) };
    for (peer, theirs) in all.iter().enumerate() {
        if theirs.len() != msg.len() {
            return Err(Error::Group { rank: me, reason: format!("rank {peer} sent a malformed low-latency call signature") });
        }
        for (i, (what, ours)) in shared.iter().enumerate() {
            let t = word(theirs, i).unwrap_or_default();
            if t != *ours {
                return Err(Error::RankMismatch { what, rank: me, peer, ours: ours.to_string(), theirs: t.to_string() });
            }
        }
    }
    for (peer, theirs) in all.iter().enumerate() {
        let flags = word(theirs, shared.len()).unwrap_or_default();
        if let Some((arg, _)) = local.iter().enumerate().find(|(i, _)| flags >> i & 1 == 1).map(|(_, l)| l) {
            return Err(Error::invalid(arg, me, format!("rank {peer} passed an invalid `{arg}`; the call is abandoned on every rank")));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ dispatch

/// Byte layout of one token record in a dispatch message:
/// `[u32 token][payload: bf16 row | fp8 row + f32 scale_inv per group][i64 ids x K][f32 weights x K]`.
struct DispatchRecord {
    payload: usize,
    scales: usize,
    topk: usize,
    weights: bool,
}

impl DispatchRecord {
    fn new(s: &LlSpec) -> DispatchRecord {
        let (payload, scales) = if s.quant.is_fp8() { (s.hidden, 4 * (s.hidden / GROUP)) } else { (2 * s.hidden, 0) };
        DispatchRecord { payload, scales, topk: s.topk, weights: s.has_weights }
    }
    fn ids_at(&self) -> usize {
        4 + self.payload + self.scales
    }
    fn weights_at(&self) -> usize {
        self.ids_at() + 8 * self.topk
    }
    fn bytes(&self) -> usize {
        self.weights_at() + if self.weights { 4 * self.topk } else { 0 }
    }
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}
fn le_i64(b: &[u8], at: usize) -> i64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    i64::from_le_bytes(w)
}
fn le_f32(b: &[u8], at: usize) -> f32 {
    f32::from_bits(le_u32(b, at))
}

pub(crate) fn dispatch<'a>(
    b: &mut HostBackend,
    s: LlSpec,
    a: &LlDispatchArgs<'_>,
    out: LlDispatchOutputs<'a>,
) -> Result<(Arc<BackendData>, Option<PendingRecv<'a>>)> {
    let (rank, nr) = (s.rank, s.num_ranks);
    collective_check(b, Phase::LowLatencyDispatch, &shared_values(&s), &[])?;

    let x = input_bytes(&a.x, "x", rank)?;
    let topk_idx = read_i64_matrix(&a.topk_idx).ok_or_else(|| Error::invalid("topk_idx", rank, "the host backend needs host tensors"))?;
    let topk_weights: Option<Vec<f32>> = match &a.topk_weights {
        Some(w) => Some(read_matrix(w).ok_or_else(|| Error::invalid("topk_weights", rank, "the host backend needs host tensors"))?),
        None => None,
    };
    let (h, k) = (s.hidden, s.topk);
    let rec = DispatchRecord::new(&s);

    // Send phase: encode each token once (quantising it in FP8 modes), append it to each destination.
    let mut msgs: Vec<Vec<u8>> = vec![Vec::new(); nr];
    let mut encoded = Vec::with_capacity(rec.bytes());
    let mut row = vec![bf16::ZERO; h];
    let (mut q, mut scale_inv) = (vec![0u8; h], vec![0f32; h / GROUP]);
    for t in 0..s.num_tokens {
        let ids = &topk_idx[t * k..(t + 1) * k];
        let mut to_rank = vec![false; nr];
        for &e in ids.iter().filter(|&&e| e >= 0) {
            to_rank[rank_of_expert(e, s.num_experts, nr)] = true;
        }
        if !to_rank.contains(&true) {
            continue;
        }
        encoded.clear();
        encoded.extend_from_slice(&(t as u32).to_le_bytes());
        let xr = &x[t * 2 * h..(t + 1) * 2 * h];
        match s.quant {
            LlQuant::Bf16 => encoded.extend_from_slice(xr),
            LlQuant::Fp8 { round_scale, .. } => {
                for (v, c) in row.iter_mut().zip(xr.chunks_exact(2)) {
                    *v = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
                quantize_token(&row, round_scale, &mut q, &mut scale_inv);
                encoded.extend_from_slice(&q);
                for si in &scale_inv {
                    encoded.extend_from_slice(&si.to_le_bytes());
                }
            }
        }
        for e in ids {
            encoded.extend_from_slice(&e.to_le_bytes());
        }
        if let Some(w) = &topk_weights {
            for v in &w[t * k..(t + 1) * k] {
                encoded.extend_from_slice(&v.to_le_bytes());
            }
        }
        for (m, _) in msgs.iter_mut().zip(&to_rank).filter(|(_, &go)| go) {
            m.extend_from_slice(&encoded);
        }
    }
    let started = Instant::now();
    let recv = b.all_to_all(Phase::LowLatencyDispatch, msgs)?;
    let waited_ns = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);

    // Assign slots now (the handle must exist when the call returns); rows are written by the receive phase.
    let mask = b.ll.mask.clone();
    let (el, rows) = (s.num_local_experts(), s.rows_per_expert());
    let mut recv_count = vec![0usize; el];
    let mut recv_tokens: Vec<Vec<RecvToken>> = vec![Vec::new(); nr];
    for (src, m) in recv.iter().enumerate() {
        if mask[src] {
            continue;
        }
        if m.len() % rec.bytes() != 0 {
            return Err(Error::Group {
                rank,
                reason: format!("rank {src} sent {} bytes, not a whole number of {}-byte tokens", m.len(), rec.bytes()),
            });
        }
        for offset in (0..m.len()).step_by(rec.bytes()) {
            let token = le_u32(m, offset);
            let mut terms = Vec::new();
            for kk in 0..k {
                let local = to_local_expert(le_i64(m, offset + rec.ids_at() + 8 * kk), rank, el);
                if local < 0 {
                    continue;
                }
                let e = local as usize;
                if recv_count[e] >= rows {
                    return Err(Error::Group { rank, reason: format!("local expert {e} received more than {rows} tokens") });
                }
                let weight = if rec.weights { le_f32(m, offset + rec.weights_at() + 4 * kk) } else { 0.0 };
                terms.push(Term { k: kk as u32, local_expert: e as u32, slot: recv_count[e] as u32, weight });
                recv_count[e] += 1;
            }
            recv_tokens[src].push(RecvToken { token, offset, terms });
        }
    }
    let routing = Arc::new(BackendData::new(HOST, HostLlRouting { topk_idx, topk_weights, recv_tokens, recv_count }));
    let pending = PendingDispatch(DispatchState { spec: s, routing: routing.clone(), recv, mask, waited_ns, out });
    if s.return_recv_hook {
        Ok((routing, Some(PendingRecv::new(pending))))
    } else {
        finish_dispatch(b, pending)?;
        Ok((routing, None))
    }
}

/// The receive phase of a dispatch: expands the received tokens into the outputs.
fn finish_dispatch(_b: &mut HostBackend, p: PendingDispatch<'_>) -> Result<()> {
    let DispatchState { spec: s, routing, recv, mask, waited_ns, mut out } = p.0;
    let rank = s.rank;
    let routing = routing.get::<HostLlRouting>("handle", rank, HOST)?;
    let rec = DispatchRecord::new(&s);
    let (rows, groups) = (s.rows_per_expert(), s.hidden / GROUP);
    let row_bytes = rec.payload;

    let rx = output_bytes(&mut out.recv_x, "recv_x", rank)?;
    for (src, toks) in routing.recv_tokens.iter().enumerate() {
        let m = &recv[src];
        for tok in toks {
            let payload = &m[tok.offset + 4..tok.offset + 4 + row_bytes];
            for term in &tok.terms {
                let at = (term.local_expert as usize * rows + term.slot as usize) * row_bytes;
                rx[at..at + row_bytes].copy_from_slice(payload);
            }
        }
    }

    if let (Some(scales), LlQuant::Fp8 { use_ue8m0, .. }) = (out.recv_scales.as_mut(), s.quant) {
        // Column-major scales: element (e, slot, col) lives at e*s0 + slot*s1 + col*s2.
        let st: Vec<usize> = scales.strides().iter().map(|&v| v as usize).collect();
        let sb = output_bytes(scales, "recv_x_scales", rank)?;
        let mut put = |e: usize, slot: usize, col: usize, word: [u8; 4]| {
            let at = 4 * (e * st[0] + slot * st[1] + col * st[2]);
            sb[at..at + 4].copy_from_slice(&word);
        };
        for (src, toks) in routing.recv_tokens.iter().enumerate() {
            let m = &recv[src];
            for tok in toks {
                let base = tok.offset + 4 + row_bytes;
                let inv: Vec<f32> = (0..groups).map(|g| le_f32(m, base + 4 * g)).collect();
                for term in &tok.terms {
                    let (e, slot) = (term.local_expert as usize, term.slot as usize);
                    if use_ue8m0 {
                        for (j, four) in inv.chunks_exact(UE8M0_PER_INT).enumerate() {
                            let word = pack_ue8m0([ue8m0_byte(four[0]), ue8m0_byte(four[1]), ue8m0_byte(four[2]), ue8m0_byte(four[3])]);
                            put(e, slot, j, word.to_le_bytes());
                        }
                    } else {
                        for (g, v) in inv.iter().enumerate() {
                            put(e, slot, g, v.to_le_bytes());
                        }
                    }
                }
            }
        }
    }

    let counts = output_bytes(&mut out.recv_count, "recv_count", rank)?;
    for (c, n) in counts.chunks_exact_mut(4).zip(&routing.recv_count) {
        c.copy_from_slice(&(*n as i32).to_le_bytes());
    }
    if let Some(t) = out.cumulative_local_expert_recv_stats.as_mut() {
        let stats = output_bytes(t, "cumulative_local_expert_recv_stats", rank)?;
        for (c, n) in stats.chunks_exact_mut(4).zip(&routing.recv_count) {
            let old = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            c.copy_from_slice(&old.wrapping_add(*n as i32).to_le_bytes());
        }
    }
    if let Some(t) = out.dispatch_wait_recv_cost_stats.as_mut() {
        add_wait(output_bytes(t, "dispatch_wait_recv_cost_stats", rank)?, &mask, waited_ns);
    }
    if let Some(t) = out.src_info.as_mut() {
        let info = output_bytes(t, "src_info", rank)?;
        for tok in routing.recv_tokens.iter().flatten() {
            for term in &tok.terms {
                let at = 4 * (term.local_expert as usize * rows + term.slot as usize);
                info[at..at + 4].copy_from_slice(&(tok.token as i32).to_le_bytes());
            }
        }
    }
    if let Some(t) = out.layout_range.as_mut() {
        // Rows of each expert are ordered by source rank: source j's begin is the rows of sources below it.
        let nr = s.num_ranks;
        let mut ranges = vec![0i64; s.num_local_experts() * nr];
        let mut filled = vec![0i64; s.num_local_experts()];
        for (src, toks) in routing.recv_tokens.iter().enumerate() {
            let mut count = vec![0i64; filled.len()];
            for term in toks.iter().flat_map(|tok| &tok.terms) {
                count[term.local_expert as usize] += 1;
            }
            for (e, c) in count.iter().enumerate() {
                ranges[e * nr + src] = filled[e] << 32 | c;
                filled[e] += c;
            }
        }
        output_bytes(t, "layout_range", rank)?.copy_from_slice(bytemuck::cast_slice(&ranges));
    }
    Ok(())
}

/// `stats[src] += waited_ns` for every source that was waited for (all but masked ranks). The host
/// exchange delivers every source at once, so each one is charged the whole wait.
fn add_wait(stats: &mut [u8], mask: &[bool], waited_ns: i64) {
    for (c, masked) in stats.chunks_exact_mut(8).zip(mask) {
        if *masked {
            continue;
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        c.copy_from_slice(&i64::from_le_bytes(w).wrapping_add(waited_ns).to_le_bytes());
    }
}

// ------------------------------------------------------------------ combine

/// A combine record: `[u32 token][u32 k (u32::MAX for a pre-reduced partial)][bf16 row]`.
fn combine_record_bytes(hidden: usize) -> usize {
    8 + 2 * hidden
}

pub(crate) fn combine<'a>(
    b: &mut HostBackend,
    cs: LlCombineSpec,
    a: &LlCombineArgs<'_>,
    out: LlCombineOutputs<'a>,
) -> Result<Option<PendingRecv<'a>>> {
    let s = cs.ll;
    let (rank, h) = (s.rank, s.hidden);
    let routing = a.handle.data.get::<HostLlRouting>("handle", rank, HOST)?;
    let topk_idx = read_i64_matrix(&a.topk_idx).ok_or_else(|| Error::invalid("topk_idx", rank, "the host backend needs host tensors"))?;
    let topk_weights: Vec<f32> =
        read_matrix(&a.topk_weights).ok_or_else(|| Error::invalid("topk_weights", rank, "the host backend needs host tensors"))?;
    let (el, rows) = (s.num_local_experts(), s.rows_per_expert());

    // Arguments that only this rank can check; a failure must still reach the other ranks.
    let idx_problem = (topk_idx != routing.topk_idx).then(|| "differs from the topk_idx given to low_latency_dispatch".to_string());
    let weights_problem = match &routing.topk_weights {
        Some(w) if w.iter().zip(&topk_weights).any(|(d, c)| d.to_bits() != c.to_bits()) => Some(
            "differs from the topk_weights given to low_latency_dispatch; the expert side pre-reduces with the dispatch-time weights"
                .to_string(),
        ),
        _ => None,
    };
    let staging_ok = matches!(&b.ll.combine_staging, Some(t) if t.dtype() == DType::BF16 && t.shape() == [el, rows, h]);
    let staging_problem = (cs.zero_copy && !staging_ok).then(|| {
        "no combine buffer of this shape: call get_next_low_latency_combine_buffer(handle) and write the expert outputs there".to_string()
    });
    collective_check(
        b,
        Phase::LowLatencyCombine,
        &shared_values(&s),
        &[("topk_idx", idx_problem), ("topk_weights", weights_problem), ("zero_copy", staging_problem)],
    )?;

    let y: &[u8] = if cs.zero_copy {
        match b.ll.combine_staging.as_ref().and_then(|t| t.view().host_bytes()) {
            Some(bytes) => bytes,
            None => return Err(Error::invalid("zero_copy", rank, "the combine buffer is not in host memory")),
        }
    } else {
        input_bytes(&a.x, "x", rank)?
    };

    // Expert side: per source, one record per (token, local expert) or one pre-reduced partial per token.
    let rec_bytes = combine_record_bytes(h);
    let y_row = |e: u32, slot: u32| {
        let at = (e as usize * rows + slot as usize) * 2 * h;
        &y[at..at + 2 * h]
    };
    let mut partial = vec![0f32; h];
    let msgs: Vec<Vec<u8>> = routing
        .recv_tokens
        .iter()
        .map(|toks| {
            let mut m = Vec::with_capacity(toks.len() * rec_bytes);
            for tok in toks {
                if s.has_weights {
                    // Σ over this rank's experts, ascending k, each w*y rounded to f32, from +0.0.
                    partial.iter_mut().for_each(|v| *v = 0.0);
                    for term in &tok.terms {
                        for (acc, c) in partial.iter_mut().zip(y_row(term.local_expert, term.slot).chunks_exact(2)) {
                            let product = term.weight * bf16_bits_to_f32(c[0], c[1]);
                            *acc += product;
                        }
                    }
                    m.extend_from_slice(&tok.token.to_le_bytes());
                    m.extend_from_slice(&u32::MAX.to_le_bytes());
                    for v in &partial {
                        m.extend_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
                    }
                } else {
                    for term in &tok.terms {
                        m.extend_from_slice(&tok.token.to_le_bytes());
                        m.extend_from_slice(&term.k.to_le_bytes());
                        m.extend_from_slice(y_row(term.local_expert, term.slot));
                    }
                }
            }
            m
        })
        .collect();
    let started = Instant::now();
    let recv = b.all_to_all(Phase::LowLatencyCombine, msgs)?;
    let waited_ns = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);

    let pending = PendingCombine(CombineState { spec: s, topk_idx, topk_weights, recv, mask: b.ll.mask.clone(), waited_ns, out });
    if cs.return_recv_hook {
        Ok(Some(PendingRecv::new(pending)))
    } else {
        finish_combine(b, pending)?;
        Ok(None)
    }
}

/// The receive phase of a combine: sums what came back, in the documented order.
fn finish_combine(_b: &mut HostBackend, p: PendingCombine<'_>) -> Result<()> {
    let CombineState { spec: s, topk_idx, topk_weights, recv, mask, waited_ns, mut out } = p.0;
    let (rank, nr, h, k, t_count) = (s.rank, s.num_ranks, s.hidden, s.topk, s.num_tokens);
    let rec_bytes = combine_record_bytes(h);
    let pre_reduced = s.has_weights;

    // Index what came back: per-expert mode by (token, k), pre-reduced mode by (token, rank).
    let width = if pre_reduced { nr } else { k };
    let mut found: Vec<Option<(usize, usize)>> = vec![None; t_count * width];
    for (src, m) in recv.iter().enumerate() {
        if mask[src] {
            continue;
        }
        if m.len() % rec_bytes != 0 {
            return Err(Error::Group { rank, reason: format!("rank {src} returned {} bytes, not whole {rec_bytes}-byte rows", m.len()) });
        }
        for offset in (0..m.len()).step_by(rec_bytes) {
            let (t, kk) = (le_u32(m, offset) as usize, le_u32(m, offset + 4));
            let col = if pre_reduced {
                (kk == u32::MAX).then_some(src)
            } else {
                let kk = kk as usize;
                (kk < k && t < t_count && {
                    let e = topk_idx[t * k + kk];
                    e >= 0 && rank_of_expert(e, s.num_experts, nr) == src
                })
                .then_some(kk)
            };
            match col {
                Some(c) if t < t_count && found[t * width + c].is_none() => found[t * width + c] = Some((src, offset + 8)),
                _ => return Err(Error::Group { rank, reason: format!("rank {src} returned an unexpected row for token {t}") }),
            }
        }
    }

    let cx = output_bytes(&mut out.combined_x, "combined_x", rank)?;
    let mut acc = vec![0f32; h];
    for t in 0..t_count {
        acc.iter_mut().for_each(|v| *v = 0.0);
        for c in 0..width {
            let Some((src, at)) = found[t * width + c] else { continue };
            let row = &recv[src][at..at + 2 * h];
            if pre_reduced {
                // Partials in ascending rank order.
                for (a, p) in acc.iter_mut().zip(row.chunks_exact(2)) {
                    *a += bf16_bits_to_f32(p[0], p[1]);
                }
            } else {
                // Terms in ascending k, each w*y rounded to f32 before the add.
                let w = topk_weights[t * k + c];
                for (a, p) in acc.iter_mut().zip(row.chunks_exact(2)) {
                    let product = w * bf16_bits_to_f32(p[0], p[1]);
                    *a += product;
                }
            }
        }
        let o = &mut cx[t * 2 * h..(t + 1) * 2 * h];
        for (dst, v) in o.chunks_exact_mut(2).zip(&acc) {
            dst.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
        }
    }
    if let Some(t) = out.combine_wait_recv_cost_stats.as_mut() {
        add_wait(output_bytes(t, "combine_wait_recv_cost_stats", rank)?, &mask, waited_ns);
    }
    Ok(())
}

/// The zero-copy combine source for `s`'s shape, created (zeroed) on first use or when the shape changes.
pub(crate) fn next_combine_buffer<'b>(b: &'b mut HostBackend, s: &LlSpec) -> Result<TensorMut<'b>> {
    let shape = [s.num_local_experts(), s.rows_per_expert(), s.hidden];
    let fits = matches!(&b.ll.combine_staging, Some(t) if t.dtype() == DType::BF16 && t.shape() == shape);
    if !fits {
        b.ll.combine_staging = Some(Tensor::zeros(DType::BF16, &shape)?);
    }
    match b.ll.combine_staging.as_mut() {
        Some(t) => Ok(t.view_mut()),
        None => Err(Error::invalid("handle", s.rank, "no combine buffer")),
    }
}

// The receive phases left by [`dispatch`] and [`combine`] with `return_recv_hook`.
impl RecvPhase for PendingDispatch<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_dispatch(backend_of::<HostBackend>(backend, rank, HOST)?, *self)
    }
}

impl RecvPhase for PendingCombine<'_> {
    fn run(self: Box<Self>, backend: &mut dyn std::any::Any, rank: usize) -> Result<()> {
        finish_combine(backend_of::<HostBackend>(backend, rank, HOST)?, *self)
    }
}

/// Nothing persists between host low-latency calls except the zero-copy staging buffer (collective).
pub(crate) fn clean(b: &mut HostBackend, _num_max_dispatch_tokens_per_rank: usize, _hidden: usize, _num_experts: usize) -> Result<()> {
    b.ll.combine_staging = None;
    b.all_gather(Phase::Barrier, &[]).map(|_| ())
}

/// Shrink mode: marks `rank` as failed or healthy.
pub(crate) fn set_mask(b: &mut HostBackend, rank: usize, masked: bool) -> Result<()> {
    b.ll.mask[rank] = masked;
    Ok(())
}

/// Shrink mode: the mask.
pub(crate) fn mask(b: &mut HostBackend) -> Result<Vec<bool>> {
    Ok(b.ll.mask.clone())
}

/// Shrink mode: unmasks every rank.
pub(crate) fn clear_mask(b: &mut HostBackend) -> Result<()> {
    b.ll.mask.iter_mut().for_each(|m| *m = false);
    Ok(())
}
