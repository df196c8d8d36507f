//! Seeded inputs for the bench: the same generator and routing as the library's tests
//! (`crates/moelink/tests/common`), so that a case seen in the bench can be replayed in a test.

/// A small, seeded generator (splitmix64): every rank and backend sees the same inputs.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// How tokens pick experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingKind {
    /// Scores |randn| + 1, top-k (DeepEP's benchmark routing).
    Uniform,
    /// 90% of tokens pick experts 0..k: the first rank receives nearly everything.
    Skewed,
}

impl RoutingKind {
    /// Name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            RoutingKind::Uniform => "uniform",
            RoutingKind::Skewed => "skewed",
        }
    }
}

/// `topk_idx [T, K]`, row-major, for one rank: the `topk` best of `num_experts` scores `|randn| + 1`.
pub fn routing(rng: &mut Rng, kind: RoutingKind, num_tokens: usize, topk: usize, num_experts: usize) -> Vec<i64> {
    let mut out = Vec::with_capacity(num_tokens * topk);
    let mut scores: Vec<(f64, usize)> = Vec::with_capacity(num_experts);
    for _ in 0..num_tokens {
        scores.clear();
        scores.extend((0..num_experts).map(|e| (rng.normal().abs() + 1.0, e)));
        if kind == RoutingKind::Skewed && rng.uniform() < 0.9 {
            for (s, e) in scores.iter_mut() {
                if *e < topk {
                    *s += 100.0;
                }
            }
        }
        // Only the top k are needed: partition, then order those k (ties by expert id, as the tests do).
        let by_score = |a: &(f64, usize), b: &(f64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if topk < scores.len() {
            scores.select_nth_unstable_by(topk, by_score);
        }
        let best = &mut scores[..topk.min(num_experts)];
        best.sort_by(by_score);
        out.extend(best.iter().map(|&(_, e)| e as i64));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_picks_distinct_valid_experts_and_skew_concentrates() {
        let mut rng = Rng::new(7);
        let idx = routing(&mut rng, RoutingKind::Uniform, 200, 8, 64);
        assert_eq!(idx.len(), 1600);
        for row in idx.chunks(8) {
            let mut r = row.to_vec();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), 8);
            assert!(r.iter().all(|&e| (0..64).contains(&e)));
        }
        let skewed = routing(&mut rng, RoutingKind::Skewed, 200, 8, 64);
        let low = skewed.iter().filter(|&&e| e < 8).count();
        assert!(low > 1200, "{low}");
    }

    #[test]
    fn the_generator_is_seeded() {
        let a: Vec<u64> = (0..4).scan(Rng::new(3), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..4).scan(Rng::new(3), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(a, (0..4).scan(Rng::new(4), |r, _| Some(r.next_u64())).collect::<Vec<_>>());
    }
}
