//! High-throughput dispatch/combine on the host: rows are packed per destination in token order, exchanged
//! with one `all_to_all`, and unpacked at `recv_offset[src] + send_slot`.

use std::sync::Arc;

use super::HOST;
use super::{bf16_bits_to_f32, f32_to_bf16_bits, input_bytes, output_bytes, HostBackend};
use crate::backend::{BackendData, HtDispatched, LayoutOutputs};
use crate::error::{Error, Phase, Result};
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec, Payload, Routing};
use crate::layout::{self, align_up, to_local_expert};
use crate::reduce::TreeSum;
use crate::tensor::TensorRef;
use crate::validate::{read_i64_matrix, read_matrix};

/// Routing state kept in a handle (host backend).
pub(crate) struct HostHtRouting {
    pub num_tokens: usize,
    /// `[T * R]`.
    pub is_token_in_rank: Vec<bool>,
    /// `[T * R]`, -1 where not sent.
    pub send_slot: Vec<i32>,
    /// Rows received from each source.
    pub recv_counts: Vec<usize>,
    pub recv_offsets: Vec<usize>,
    pub num_recv_tokens: usize,
    /// Source token index of each received row.
    pub recv_src_idx: Vec<i32>,
    /// Unaligned per-local-expert receive counts (for cached dispatch).
    pub num_recv_tokens_per_expert_raw: Vec<usize>,
    /// `[R * R]`: DeepEP's `rank_prefix_matrix`, `[i][j]` = tokens rank `j` receives from ranks `0..=i`.
    pub rank_prefix_matrix: Vec<i32>,
    /// The most tokens any rank dispatched (what the buffer's receive slabs must hold).
    pub t_max: usize,
}

/// State between `prepare_dispatch` and `dispatch`.
pub(crate) struct HostPlan {
    pub(crate) routing: HostHtRouting,
}

pub(crate) fn dispatch_layout(b: &mut HostBackend, topk_idx: &TensorRef<'_>, num_experts: usize, mut out: LayoutOutputs<'_>) -> Result<()> {
    let rank = b.rank();
    let idx = read_i64_matrix(topk_idx).ok_or_else(|| Error::invalid("topk_idx", rank, "the host backend needs host tensors"))?;
    let (t, k) = (topk_idx.shape()[0], topk_idx.shape()[1]);
    let l = layout::dispatch_layout(&idx, t, k, num_experts, b.group.size());
    output_bytes(&mut out.num_tokens_per_rank, "num_tokens_per_rank", rank)?.copy_from_slice(bytemuck::cast_slice(&l.num_tokens_per_rank));
    output_bytes(&mut out.num_tokens_per_expert, "num_tokens_per_expert", rank)?
        .copy_from_slice(bytemuck::cast_slice(&l.num_tokens_per_expert));
    output_bytes(&mut out.is_token_in_rank, "is_token_in_rank", rank)?.copy_from_slice(bytemuck::cast_slice(&l.is_token_in_rank));
    if let Some(v) = out.num_tokens_per_rdma_rank.as_mut() {
        // Nodes are consecutive groups of ranks (the output has one entry per node).
        let (nr, nodes) = (b.group.size(), v.shape()[0]);
        let per_node = nr / nodes.max(1);
        let counts: Vec<i32> = (0..nodes)
            .map(|n| (0..t).filter(|&tok| (n * per_node..(n + 1) * per_node).any(|r| l.is_token_in_rank[tok * nr + r])).count() as i32)
            .collect();
        output_bytes(v, "num_tokens_per_rdma_rank", rank)?.copy_from_slice(bytemuck::cast_slice(&counts));
    }
    Ok(())
}

/// Values every rank must agree on for a dispatch.
fn agree(b: &HostBackend, s: &HtSpec, cached: bool) -> Result<()> {
    b.check_agreement(
        Phase::Notify,
        &[
            ("hidden", s.hidden as u64),
            ("fp8", s.fp8 as u64),
            ("num_experts", s.num_experts as u64),
            ("topk", s.topk as u64),
            ("cached", cached as u64),
            ("num_worst_tokens > 0", (s.num_worst_tokens > 0) as u64),
        ],
    )
}

pub(crate) fn prepare_dispatch(b: &mut HostBackend, s: HtSpec, a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    let (rank, nr, el) = (s.rank, s.num_ranks, s.num_local_experts());
    // An argument problem only this rank can see (its layout, or more rows arriving than its
    // num_worst_tokens): every rank learns of it and fails the call, as on the GPU.
    let mut problem: Option<Error> = None;
    let fresh = matches!(a.routing, Routing::Fresh { .. });
    let routing = match a.routing {
        Routing::Cached(h) => {
            agree(b, &s, true)?;
            let r = h.data.get::<HostHtRouting>("handle", rank, HOST)?;
            HostHtRouting {
                num_tokens: r.num_tokens,
                is_token_in_rank: r.is_token_in_rank.clone(),
                send_slot: r.send_slot.clone(),
                recv_counts: r.recv_counts.clone(),
                recv_offsets: r.recv_offsets.clone(),
                num_recv_tokens: r.num_recv_tokens,
                recv_src_idx: r.recv_src_idx.clone(),
                num_recv_tokens_per_expert_raw: r.num_recv_tokens_per_expert_raw.clone(),
                rank_prefix_matrix: r.rank_prefix_matrix.clone(),
                t_max: r.t_max,
            }
        }
        Routing::Fresh { layout: l, topk_idx, .. } => {
            agree(b, &s, false)?;
            let per_rank: Vec<i32> =
                read_matrix(&l.num_tokens_per_rank).ok_or_else(|| Error::invalid("num_tokens_per_rank", rank, "needs a host tensor"))?;
            let per_expert: Vec<i32> = read_matrix(&l.num_tokens_per_expert)
                .ok_or_else(|| Error::invalid("num_tokens_per_expert", rank, "needs a host tensor"))?;
            let in_rank: Vec<bool> = input_bytes(&l.is_token_in_rank, "is_token_in_rank", rank)?.iter().map(|&v| v != 0).collect();
            let send_slot = layout::send_slots(&in_rank, s.num_tokens, nr);
            // The layout tensors must describe the tokens (crate::layout::check_layout). A problem is reported
            // after the exchange, on every rank (below), so that nobody is left waiting.
            let idx = match topk_idx {
                Some(t) => {
                    Some(read_i64_matrix(&t).ok_or_else(|| Error::invalid("topk_idx", rank, "the host backend needs host tensors"))?)
                }
                None => None,
            };
            let routed =
                layout::LayoutRef { is_token_in_rank: &in_rank, num_tokens_per_rank: &per_rank, num_tokens_per_expert: &per_expert };
            problem = layout::check_layout(&routed, idx.as_deref(), s.num_tokens, s.topk, nr)
                .err()
                .map(|(arg, reason)| Error::invalid(arg, rank, reason));
            // Notify: send each rank this rank's whole count row (every rank learns every rank's counts, for
            // rank_prefix_matrix), the counts of its experts and this rank's token count (T_max).
            let num_tokens = i32::try_from(s.num_tokens).unwrap_or(i32::MAX);
            let msgs: Vec<Vec<u8>> = (0..nr)
                .map(|r| {
                    let mut m = Vec::with_capacity(4 * (nr + el + 1));
                    for c in &per_rank {
                        m.extend_from_slice(&c.to_le_bytes());
                    }
                    for e in &per_expert[r * el..(r + 1) * el] {
                        m.extend_from_slice(&e.to_le_bytes());
                    }
                    m.extend_from_slice(&num_tokens.to_le_bytes());
                    m
                })
                .collect();
            let recv = b.all_to_all(Phase::Notify, msgs)?;
            let mut recv_counts = vec![0usize; nr];
            let mut per_local_expert = vec![0usize; el];
            let mut rank_prefix_matrix = vec![0i32; nr * nr];
            let mut t_max = 0usize;
            for (src, m) in recv.iter().enumerate() {
                let ints: Vec<i32> = m.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
                if ints.len() != nr + el + 1 {
                    return Err(Error::Group { rank, reason: format!("rank {src} sent a malformed count message") });
                }
                // A negative count is an argument problem its rank reports below; it counts as 0 here.
                recv_counts[src] = ints[rank].max(0) as usize;
                for j in 0..nr {
                    let below = if src == 0 { 0 } else { rank_prefix_matrix[(src - 1) * nr + j] };
                    rank_prefix_matrix[src * nr + j] = below.wrapping_add(ints[j]);
                }
                for (e, c) in ints[nr..nr + el].iter().enumerate() {
                    per_local_expert[e] += (*c).max(0) as usize;
                }
                t_max = t_max.max(ints[nr + el] as usize);
            }
            let mut recv_offsets = vec![0usize; nr];
            let mut acc = 0usize;
            for src in 0..nr {
                recv_offsets[src] = acc;
                acc += recv_counts[src];
            }
            HostHtRouting {
                num_tokens: s.num_tokens,
                is_token_in_rank: in_rank,
                send_slot,
                recv_counts,
                recv_offsets,
                num_recv_tokens: acc,
                recv_src_idx: Vec::new(),
                num_recv_tokens_per_expert_raw: per_local_expert,
                rank_prefix_matrix,
                t_max,
            }
        }
    };
    let n = routing.num_recv_tokens;
    if s.num_worst_tokens > 0 && n > s.num_worst_tokens && problem.is_none() {
        problem = Some(Error::invalid("num_worst_tokens", rank, format!("{} rows, but this rank receives {n} tokens", s.num_worst_tokens)));
    }
    if fresh {
        agree_on_problems(b, problem)?;
    }
    // The buffer's capacity, decided on T_max, which every rank has: all ranks refuse the call together.
    b.check_ht_capacity(
        "HT dispatch receive slab",
        routing.t_max,
        moelink_kernels::ht::dispatch_row_bytes(s.hidden, s.fp8, s.topk),
        Some((s.hidden, s.fp8, s.topk)),
    )?;
    let per_expert_aligned: Vec<usize> = if s.num_worst_tokens > 0 {
        Vec::new()
    } else {
        routing.num_recv_tokens_per_expert_raw.iter().map(|&c| align_up(c, s.expert_alignment)).collect()
    };
    Ok(DispatchPlan {
        spec: s,
        num_recv_tokens: Some(n),
        num_recv_tokens_per_expert: per_expert_aligned,
        state: BackendData::new(HOST, HostPlan { routing }),
    })
}

/// Every rank shares whether it found an argument problem; this rank's own problem comes back as is, a
/// peer's as an `InvalidArgument` naming the same argument and that peer (the lowest one).
fn agree_on_problems(b: &HostBackend, problem: Option<Error>) -> Result<()> {
    /// The arguments a rank can find wrong only after its own checks (its layout, its received count): the
    /// exchanged code is the index in this list plus one.
    const ARGS: [&str; 4] = ["num_tokens_per_rank", "num_worst_tokens", "num_tokens_per_expert", "is_token_in_rank"];
    let rank = b.rank();
    let code = match &problem {
        None => 0u8,
        Some(e) => ARGS.iter().position(|&a| e.argument() == Some(a)).map_or(2, |i| i as u8 + 1),
    };
    let all = b.all_gather(Phase::Notify, &[code])?;
    if let Some(e) = problem {
        return Err(e);
    }
    if let Some((peer, c)) = all.iter().enumerate().find_map(|(p, m)| m.first().filter(|&&c| c != 0).map(|&c| (p, c))) {
        let arg = ARGS.get(usize::from(c) - 1).copied().unwrap_or("num_worst_tokens");
        return Err(Error::invalid(arg, rank, format!("rank {peer} passed an invalid `{arg}`; the call is abandoned on every rank")));
    }
    Ok(())
}

/// Bytes of one packed row: payload, scales, top-k ids (i64) and weights (f32), source token index (i32).
fn packed_row_bytes(s: &HtSpec) -> usize {
    s.x_row_bytes() + 4 * s.num_scales() + 12 * s.topk + 4
}

pub(crate) fn dispatch(
    b: &mut HostBackend,
    plan: DispatchPlan,
    a: &DispatchArgs<'_>,
    mut out: DispatchOutputs<'_>,
) -> Result<HtDispatched> {
    let s = plan.spec;
    let rank = s.rank;
    let nr = s.num_ranks;
    let el = s.num_local_experts();
    let mut routing = plan.state.take::<HostPlan>("plan", rank, HOST)?.routing;
    let x = input_bytes(a.x.x(), "x", rank)?;
    let scales: Option<Vec<f32>> = match a.x {
        Payload::Fp8 { scales, .. } => Some(read_matrix(&scales).ok_or_else(|| Error::invalid("x_scales", rank, "needs a host tensor"))?),
        Payload::Bf16(_) => None,
    };
    let (topk_idx, topk_w): (Option<Vec<i64>>, Option<Vec<f32>>) = match a.routing {
        Routing::Fresh { topk_idx: Some(i), topk_weights: Some(w), .. } => (read_i64_matrix(&i), read_matrix(&w)),
        _ => (None, None),
    };
    let (rb, ns, k) = (s.x_row_bytes(), s.num_scales(), s.topk);
    let row = packed_row_bytes(&s);

    // Pack per destination, in token order (= send-slot order).
    let mut msgs: Vec<Vec<u8>> = (0..nr).map(|_| Vec::new()).collect();
    for (r, m) in msgs.iter_mut().enumerate() {
        let count = (0..s.num_tokens).filter(|&t| routing.is_token_in_rank[t * nr + r]).count();
        m.reserve_exact(count * row);
        for t in 0..s.num_tokens {
            if !routing.is_token_in_rank[t * nr + r] {
                continue;
            }
            m.extend_from_slice(&x[t * rb..(t + 1) * rb]);
            if let Some(sc) = &scales {
                for v in &sc[t * ns..(t + 1) * ns] {
                    m.extend_from_slice(&v.to_le_bytes());
                }
            }
            if let (Some(idx), Some(w)) = (&topk_idx, &topk_w) {
                let local: Vec<i64> = idx[t * k..(t + 1) * k].iter().map(|&e| to_local_expert(e, r, el)).collect();
                for l in &local {
                    m.extend_from_slice(&l.to_le_bytes());
                }
                for (j, l) in local.iter().enumerate() {
                    let wv = if *l < 0 { 0.0f32 } else { w[t * k + j] };
                    m.extend_from_slice(&wv.to_le_bytes());
                }
            }
            m.extend_from_slice(&(t as i32).to_le_bytes());
        }
    }
    let recv = b.all_to_all(Phase::Dispatch, msgs)?;

    // Unpack at recv_offset[src] + slot.
    let n = routing.num_recv_tokens;
    let rx = super::output_bytes(&mut out.recv_x, "recv_x", rank)?;
    let mut recv_src_idx = vec![0i32; n];
    let mut rs = match out.recv_scales.as_mut() {
        Some(t) => Some(super::output_bytes(t, "recv_x_scales", rank)?),
        None => None,
    };
    let mut ri = match out.recv_topk_idx.as_mut() {
        Some(t) => Some(super::output_bytes(t, "recv_topk_idx", rank)?),
        None => None,
    };
    let mut rw = match out.recv_topk_weights.as_mut() {
        Some(t) => Some(super::output_bytes(t, "recv_topk_weights", rank)?),
        None => None,
    };
    for (src, m) in recv.iter().enumerate() {
        let cnt = routing.recv_counts[src];
        if m.len() != cnt * row {
            return Err(Error::Group { rank, reason: format!("rank {src} sent {} bytes, expected {cnt} rows of {row}", m.len()) });
        }
        for j in 0..cnt {
            let p = &m[j * row..(j + 1) * row];
            let pos = routing.recv_offsets[src] + j;
            rx[pos * rb..(pos + 1) * rb].copy_from_slice(&p[..rb]);
            let mut off = rb;
            if let Some(rs) = rs.as_deref_mut() {
                rs[pos * 4 * ns..(pos + 1) * 4 * ns].copy_from_slice(&p[off..off + 4 * ns]);
                off += 4 * ns;
            }
            if let (Some(ri), Some(rw)) = (ri.as_deref_mut(), rw.as_deref_mut()) {
                ri[pos * 8 * k..(pos + 1) * 8 * k].copy_from_slice(&p[off..off + 8 * k]);
                off += 8 * k;
                rw[pos * 4 * k..(pos + 1) * 4 * k].copy_from_slice(&p[off..off + 4 * k]);
                off += 4 * k;
            }
            recv_src_idx[pos] = i32::from_le_bytes(p[off..off + 4].try_into().expect("4 bytes"));
        }
    }
    // No-sync mode: rows past the received count carry no expert.
    if s.num_worst_tokens > 0 {
        if let (Some(ri), Some(rw)) = (ri, rw) {
            for pos in n..s.num_worst_tokens {
                for j in 0..k {
                    ri[(pos * k + j) * 8..(pos * k + j + 1) * 8].copy_from_slice(&(-1i64).to_le_bytes());
                    rw[(pos * k + j) * 4..(pos * k + j + 1) * 4].copy_from_slice(&0f32.to_le_bytes());
                }
            }
        }
    }
    if let Some(t) = out.rank_prefix_matrix.as_mut() {
        super::output_bytes(t, "rank_prefix_matrix", rank)?.copy_from_slice(bytemuck::cast_slice(&routing.rank_prefix_matrix));
    }
    if let Some(t) = out.recv_src_idx.as_mut() {
        super::output_bytes(t, "recv_src_idx", rank)?[..4 * n].copy_from_slice(bytemuck::cast_slice(&recv_src_idx));
    }
    if let Some(c) = out.channels.as_mut() {
        let cols = c.num_channels();
        super::output_bytes(&mut c.send_head, "send_head", rank)?.copy_from_slice(bytemuck::cast_slice(&routing.send_slot));
        let sent_to = |r: usize| (0..s.num_tokens).filter(|&t| routing.is_token_in_rank[t * nr + r]).count() as i32;
        let sent: Vec<i32> = (0..nr * cols).map(|i| if i % cols == cols - 1 { sent_to(i / cols) } else { 0 }).collect();
        super::output_bytes(&mut c.channel_prefix_matrix, "channel_prefix_matrix", rank)?.copy_from_slice(bytemuck::cast_slice(&sent));
        super::output_bytes(&mut c.recv_channel_prefix_matrix, "recv_channel_prefix_matrix", rank)?.fill(0);
    }
    routing.recv_src_idx = recv_src_idx;
    Ok(HtDispatched { data: Arc::new(BackendData::new(HOST, routing)), num_recv_tokens: Some(n) })
}

pub(crate) fn combine(b: &mut HostBackend, s: CombineSpec, a: &CombineArgs<'_>, mut out: CombineOutputs<'_>) -> Result<()> {
    let rank = s.rank;
    let nr = s.num_ranks;
    let routing = a.handle.data.get::<HostHtRouting>("handle", rank, HOST)?;
    b.check_agreement(Phase::Combine, &[("hidden", s.hidden as u64), ("topk (combine weights)", s.topk as u64)])?;
    b.check_ht_capacity("HT combine receive slab", routing.t_max, moelink_kernels::ht::combine_row_bytes(s.hidden, s.topk), None)?;
    let x = input_bytes(&a.x, "x", rank)?;
    let w: Option<Vec<f32>> = a.topk_weights.as_ref().and_then(read_matrix);
    let (h, k) = (s.hidden, s.topk);
    let rb = 2 * h;
    let row = rb + 4 * k;

    // Expert side: send each received row back to its source, in receive order (= the source's slot order).
    let msgs: Vec<Vec<u8>> = (0..nr)
        .map(|src| {
            let (off, cnt) = (routing.recv_offsets[src], routing.recv_counts[src]);
            let mut m = Vec::with_capacity(cnt * row);
            for pos in off..off + cnt {
                m.extend_from_slice(&x[pos * rb..(pos + 1) * rb]);
                if let Some(w) = &w {
                    for v in &w[pos * k..(pos + 1) * k] {
                        m.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
            m
        })
        .collect();
    let recv = b.all_to_all(Phase::Combine, msgs)?;
    for (r, m) in recv.iter().enumerate() {
        let expect = (0..s.num_tokens).filter(|&t| routing.is_token_in_rank[t * nr + r]).count() * row;
        if m.len() != expect {
            return Err(Error::Group { rank, reason: format!("rank {r} returned {} bytes, expected {expect}", m.len()) });
        }
    }

    // Source side: the rows of the ranks the token went to, summed in fp32 by the topology's tree
    // (crate::reduce), then the biases, then rounded to bf16.
    let biases: Vec<&[u8]> = a.bias.iter().flatten().map(|t| input_bytes(t, "bias", rank)).collect::<Result<_>>()?;
    let cx = super::output_bytes(&mut out.combined_x, "combined_x", rank)?;
    let mut rows = TreeSum::new(b.topology, h);
    let mut acc = vec![0f32; h];
    for t in 0..s.num_tokens {
        for (r, m) in recv.iter().enumerate() {
            if !routing.is_token_in_rank[t * nr + r] {
                continue;
            }
            let j = routing.send_slot[t * nr + r] as usize;
            let p = &m[j * row..j * row + rb];
            for (c, v) in rows.leaf(r).iter_mut().enumerate() {
                *v = bf16_bits_to_f32(p[2 * c], p[2 * c + 1]);
            }
        }
        rows.sum_into(&mut acc);
        for bias in &biases {
            let p = &bias[t * rb..(t + 1) * rb];
            for (c, v) in acc.iter_mut().enumerate() {
                *v += bf16_bits_to_f32(p[2 * c], p[2 * c + 1]);
            }
        }
        let o = &mut cx[t * rb..(t + 1) * rb];
        for (c, v) in acc.iter().enumerate() {
            o[2 * c..2 * c + 2].copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
        }
    }
    if let Some(cw) = out.combined_topk_weights.as_mut() {
        let cw = super::output_bytes(cw, "combined_topk_weights", rank)?;
        let mut weights = TreeSum::new(b.topology, k);
        let mut sums = vec![0f32; k];
        for t in 0..s.num_tokens {
            for (r, m) in recv.iter().enumerate() {
                if !routing.is_token_in_rank[t * nr + r] {
                    continue;
                }
                let j = routing.send_slot[t * nr + r] as usize;
                let p = &m[j * row + rb..(j + 1) * row];
                for (kk, v) in weights.leaf(r).iter_mut().enumerate() {
                    *v = f32::from_le_bytes(p[4 * kk..4 * kk + 4].try_into().expect("4 bytes"));
                }
            }
            weights.sum_into(&mut sums);
            for (kk, v) in sums.iter().enumerate() {
                cw[(t * k + kk) * 4..(t * k + kk + 1) * 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(())
}
