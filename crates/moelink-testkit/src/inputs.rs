//! The bench's inputs (seeded) and the results every backend must reproduce, computed here from the routing
//! alone so that the check trusts no backend.
//!
//! Token values are small integers (|x| ≤ 8, fewer for more than 32 ranks): bf16 holds them exactly, and so
//! does every sum combine forms (`x × ranks hit` stays below 256), so the HT combine check is exact.

use half::bf16;
use moelink::Fp8E4M3;

use crate::rng::Rng;
use crate::routing::{route, RouteKind};
use crate::values::{random_fp8, random_weights};

/// The problem size of one mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Ranks (threads, one GPU each on CUDA).
    pub ranks: usize,
    /// Tokens per rank.
    pub tokens: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Experts per token.
    pub topk: usize,
    /// Experts over all ranks.
    pub experts: usize,
}

impl Shape {
    /// Experts per rank.
    pub fn local_experts(&self) -> usize {
        self.experts / self.ranks
    }
    /// FP8 scale columns (one per 128 channels).
    pub fn scale_cols(&self) -> usize {
        self.hidden / 128
    }
}

/// One rank's inputs.
pub struct RankInputs {
    /// `int64 [T, K]`.
    pub topk_idx: Vec<i64>,
    /// `float32 [T, K]`, in (0.01, 1.01).
    pub topk_weights: Vec<f32>,
    /// `bf16 [T, H]`, small integers.
    pub x: Vec<bf16>,
    /// `fp8 e4m3 [T, H]` (HT FP8 dispatch is a copy, so any non-NaN values do); empty unless FP8 HT
    /// dispatch is measured.
    pub x_fp8: Vec<Fp8E4M3>,
    /// `float32 [T, H/128]` scales that travel with `x_fp8`.
    pub scales: Vec<f32>,
}

/// What the collectives must produce, from the routing of every rank.
pub struct Reference {
    /// HT: for each receiving rank, the `(source rank, token)` of every received row, in receive order
    /// (source rank major, then token order).
    pub recv_rows: Vec<Vec<(u32, u32)>>,
    /// For each rank and local expert, the `(source rank, token)` pairs that selected it, in order. Their
    /// counts are HT's `num_recv_tokens_per_expert` and LL's `recv_count`; their order is LL's packed order.
    pub expert_rows: Vec<Vec<Vec<(u32, u32)>>>,
    /// `[src][t]`: how many ranks token `t` of `src` goes to.
    pub hits: Vec<Vec<u32>>,
    /// `[src][r]`: tokens of `src` that go to rank `r` (`num_tokens_per_rank`).
    pub tokens_per_rank: Vec<Vec<i32>>,
    /// `[src][e]`: tokens of `src` that selected expert `e` (`num_tokens_per_expert`).
    pub tokens_per_expert: Vec<Vec<i32>>,
    /// `[src]`: (token, expert) selections.
    pub selections: Vec<usize>,
    /// `[src]`: (token, destination rank) pairs whose destination is another rank.
    pub cross_pairs: Vec<usize>,
}

impl Reference {
    /// Rows rank `r` receives from itself in HT dispatch.
    pub fn own_rows(&self, r: usize) -> usize {
        self.recv_rows[r].iter().filter(|(s, _)| *s as usize == r).count()
    }
}

/// All ranks' inputs for one (mode, routing) and what they must produce.
pub struct Inputs {
    /// Problem size.
    pub shape: Shape,
    /// Inputs of each rank.
    pub ranks: Vec<RankInputs>,
    /// What the collectives must produce.
    pub reference: Reference,
}

/// Largest |x| such that `x × ranks` stays an exact bf16 integer (≤ 256).
pub fn amplitude(ranks: usize) -> i32 {
    (256 / ranks.max(1)).clamp(1, 8) as i32
}

impl Inputs {
    /// Inputs for every rank from `seed` (the same on every backend and run).
    pub fn generate(shape: Shape, kind: RouteKind, seed: u64, with_fp8_payload: bool) -> Inputs {
        let Shape { ranks, tokens, hidden, topk, experts } = shape;
        let amp = amplitude(ranks);
        let span = (2 * amp + 1) as u64;
        // One thread per rank: at 16384 tokens of 7168 channels this is ~1 GB of payload per run.
        let one_rank = |r: usize| {
            let salt = seed.wrapping_mul(0x100_0000_01B3) ^ ((r as u64) << 40) ^ (kind.code() << 56);
            let mut rng = Rng::new(salt);
            let topk_idx = route(&mut rng, kind, tokens, topk, experts, ranks);
            let topk_weights = random_weights(&mut rng, tokens * topk);
            // Eight values per draw: generating 10^8 values one draw each would dominate the bench.
            let mut x = Vec::with_capacity(tokens * hidden);
            while x.len() < tokens * hidden {
                let bits = rng.next_u64();
                for b in bits.to_le_bytes() {
                    if x.len() < tokens * hidden {
                        x.push(bf16::from_f32(((b as u64 % span) as i32 - amp) as f32));
                    }
                }
            }
            let (x_fp8, scales) = if with_fp8_payload {
                let values = random_fp8(&mut rng, tokens * hidden);
                let scales = (0..tokens * (hidden / 128)).map(|_| 0.5 + rng.uniform() as f32).collect();
                (values, scales)
            } else {
                (Vec::new(), Vec::new())
            };
            RankInputs { topk_idx, topk_weights, x, x_fp8, scales }
        };
        let ranks_in: Vec<RankInputs> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..ranks).map(|r| sc.spawn(move || one_rank(r))).collect();
            handles.into_iter().map(|h| h.join().expect("input generation does not panic")).collect()
        });
        let reference = reference(&shape, &ranks_in);
        Inputs { shape, ranks: ranks_in, reference }
    }
}

fn reference(s: &Shape, inputs: &[RankInputs]) -> Reference {
    let (nr, el) = (s.ranks, s.local_experts());
    let mut r = Reference {
        recv_rows: vec![Vec::new(); nr],
        expert_rows: vec![vec![Vec::new(); el]; nr],
        hits: vec![vec![0; s.tokens]; nr],
        tokens_per_rank: vec![vec![0; nr]; nr],
        tokens_per_expert: vec![vec![0; s.experts]; nr],
        selections: vec![0; nr],
        cross_pairs: vec![0; nr],
    };
    let mut hit = vec![false; nr];
    for (src, inp) in inputs.iter().enumerate() {
        for t in 0..s.tokens {
            hit.iter_mut().for_each(|h| *h = false);
            for &e in &inp.topk_idx[t * s.topk..(t + 1) * s.topk] {
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                r.expert_rows[e / el][e % el].push((src as u32, t as u32));
                r.tokens_per_expert[src][e] += 1;
                r.selections[src] += 1;
                hit[e / el] = true;
            }
            for (dst, _) in hit.iter().enumerate().filter(|(_, h)| **h) {
                r.recv_rows[dst].push((src as u32, t as u32));
                r.tokens_per_rank[src][dst] += 1;
                r.hits[src][t] += 1;
                if dst != src {
                    r.cross_pairs[src] += 1;
                }
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_counts_agree_with_each_other() {
        let shape = Shape { ranks: 4, tokens: 64, hidden: 256, topk: 4, experts: 16 };
        let inp = Inputs::generate(shape, RouteKind::Uniform, 3, true);
        let r = &inp.reference;
        for dst in 0..4 {
            let from_layout: i32 = (0..4).map(|src| r.tokens_per_rank[src][dst]).sum();
            assert_eq!(r.recv_rows[dst].len() as i32, from_layout);
            for e in 0..4 {
                let global = dst * 4 + e;
                let from_layout: i32 = (0..4).map(|src| r.tokens_per_expert[src][global]).sum();
                assert_eq!(r.expert_rows[dst][e].len() as i32, from_layout);
            }
            // Receive order: source rank major, then token.
            assert!(r.recv_rows[dst].windows(2).all(|w| w[0] < w[1]));
        }
        let total_hits: u32 = r.hits.iter().flatten().sum();
        assert_eq!(total_hits as usize, r.recv_rows.iter().map(|v| v.len()).sum::<usize>());
        assert_eq!(r.selections.iter().sum::<usize>(), 4 * 64 * 4);
        assert!(inp.ranks[0].x.iter().all(|v| v.to_f32().abs() <= 8.0 && v.to_f32().fract() == 0.0));
        assert_eq!(inp.ranks[0].x_fp8.len(), 64 * 256);
        assert!(inp.ranks[0].x_fp8.iter().all(|b| b.0 & 0x7f != 0x7f));
    }

    #[test]
    fn amplitude_keeps_combine_exact() {
        for r in [1, 2, 4, 8, 32, 64, 256] {
            assert!(amplitude(r) as usize * r <= 256 || amplitude(r) == 1);
        }
    }
}
