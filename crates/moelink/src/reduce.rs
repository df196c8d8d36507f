//! The high-throughput combine's fp32 summation order: a pairwise tree over the ranks, node by node, so that
//! a node can sum its own ranks' rows before one partial per node crosses RDMA and the result is still the
//! same bits (the internode kernels need this; a sequential sum over ranks cannot be split by node).
//!
//! Definition, per token and channel (or top-k weight), for a topology of `N` nodes × `L` ranks per node
//! (ranks `n·L .. (n+1)·L` are node `n`; a single-node buffer is `1 × R`):
//! - leaves: `v[r]` = the fp32 value of what rank `r` returned for the token if the token was sent to `r`,
//!   else +0.0;
//! - `tree(x_0 .. x_{2m-1}) = tree(x_0 .. x_{m-1}) + tree(x_m .. x_{2m-1})`, `tree(x_0) = x_0`, every add an
//!   IEEE f32 add (round to nearest even);
//! - node partial `P_n = tree(v[n·L] .. v[n·L + L - 1])`, padded with +0.0 to the next power of two `≥ L`;
//! - total `T = tree(P_0 .. P_{N-1})`, padded with +0.0 to the next power of two `≥ N`;
//! - the sum is `+0.0 + T` (the leading +0.0 turns a lone -0.0 into +0.0).
//!
//! With `L` and `N` powers of two the padded trees nest into one tree over all ranks, so the result does not
//! depend on the split (`1×4 = 2×2`, `1×8 = 2×4 = 4×2`); for other shapes it does (`1×6 ≠ 2×3`).

use crate::internode::Topology;

/// Sums rows of `width` fp32 values, one per rank, in the order above. Leaves start as +0.0 (a rank the
/// token was not sent to); write the present ranks' rows with [`TreeSum::leaf`], then [`TreeSum::sum_into`],
/// which resets every leaf to +0.0 for the next token.
#[derive(Clone, Debug)]
pub struct TreeSum {
    topology: Topology,
    /// `ranks_per_node` and `num_nodes`, each rounded up to a power of two.
    lp: usize,
    np: usize,
    width: usize,
    /// `[np][lp][width]`: node `n`'s leaves at `[n][0..L]`, padding slots +0.0.
    buf: Vec<f32>,
}

impl TreeSum {
    pub fn new(topology: Topology, width: usize) -> TreeSum {
        let lp = topology.ranks_per_node.next_power_of_two();
        let np = topology.num_nodes.next_power_of_two();
        TreeSum { topology, lp, np, width, buf: vec![0.0; np * lp * width] }
    }

    /// Rank `rank`'s leaf row (`width` values, +0.0 until written).
    pub fn leaf(&mut self, rank: usize) -> &mut [f32] {
        let t = self.topology;
        assert!(rank < t.num_ranks(), "rank {rank} of a {t} topology");
        let at = (t.node_of(rank) * self.lp + t.local_rank_of(rank)) * self.width;
        &mut self.buf[at..at + self.width]
    }

    /// Writes `+0.0 + T` per column into `out` (`width` values) and resets every leaf to +0.0.
    pub fn sum_into(&mut self, out: &mut [f32]) {
        let w = self.width;
        assert_eq!(out.len(), w, "output width");
        // Bottom-up in place: after the pass of stride s, slot i (a multiple of 2s) holds the tree of slots
        // [i, i + 2s), its left half's tree plus its right half's, as the recursive definition adds them.
        let add_slot = |buf: &mut [f32], to: usize, from: usize| {
            let (lo, hi) = buf.split_at_mut(from * w);
            for (a, b) in lo[to * w..(to + 1) * w].iter_mut().zip(&hi[..w]) {
                *a += *b;
            }
        };
        for n in 0..self.topology.num_nodes {
            let node = &mut self.buf[n * self.lp * w..(n + 1) * self.lp * w];
            let mut s = 1;
            while s < self.lp {
                for i in (0..self.lp).step_by(2 * s) {
                    add_slot(node, i, i + s);
                }
                s *= 2;
            }
        }
        // Node partials sit at slot n * lp; padding nodes' slots are +0.0.
        let mut s = 1;
        while s < self.np {
            for n in (0..self.np).step_by(2 * s) {
                add_slot(&mut self.buf, n * self.lp, (n + s) * self.lp);
            }
            s *= 2;
        }
        for (o, t) in out.iter_mut().zip(&self.buf[..w]) {
            *o = 0.0 + *t;
        }
        self.buf.fill(0.0);
    }
}

/// The sum of one value per rank (`leaves[r]`, +0.0 for a rank the token was not sent to) in the order
/// above, `+0.0 + T`.
pub fn tree_sum(topology: Topology, leaves: &[f32]) -> f32 {
    assert_eq!(leaves.len(), topology.num_ranks(), "one leaf per rank");
    let mut t = TreeSum::new(topology, 1);
    for (r, v) in leaves.iter().enumerate() {
        t.leaf(r)[0] = *v;
    }
    let mut out = [0.0];
    t.sum_into(&mut out);
    out[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(num_nodes: usize, ranks_per_node: usize) -> Topology {
        Topology { num_nodes, ranks_per_node }
    }

    /// The definition as written: recursive halves over a list padded with +0.0.
    fn literal(topology: Topology, leaves: &[f32]) -> f32 {
        fn tree(x: &[f32]) -> f32 {
            if x.len() == 1 {
                x[0]
            } else {
                let m = x.len() / 2;
                tree(&x[..m]) + tree(&x[m..])
            }
        }
        fn padded(mut x: Vec<f32>) -> Vec<f32> {
            x.resize(x.len().next_power_of_two(), 0.0);
            x
        }
        let l = topology.ranks_per_node;
        let partials: Vec<f32> = leaves.chunks(l).map(|node| tree(&padded(node.to_vec()))).collect();
        0.0 + tree(&padded(partials))
    }

    /// Random bf16 values (sign, 8-bit mantissa, exponent spread over 2^-20..2^19): an f32 sum of a few rounds, so
    /// its bits depend on the order of the adds. Every fourth is +0.0 (a rank the token did not go to).
    fn random_leaves(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        (0..n)
            .map(|_| {
                let r = next();
                if r % 4 == 0 {
                    return 0.0;
                }
                let bits = ((r >> 8) as u32 & 0x8000) | ((107 + (r >> 16) % 40) as u32) << 7 | ((r >> 32) as u32 & 0x7f);
                f32::from_bits(bits << 16)
            })
            .collect()
    }

    fn sequential(leaves: &[f32]) -> f32 {
        leaves.iter().fold(0.0f32, |acc, v| acc + v)
    }

    #[test]
    fn the_tree_is_not_the_ascending_sum() {
        // (2^24 + 1) rounds to 2^24 (a tie, to even), so ascending order loses both ones:
        // ((2^24 + 1) + 1) - 2^24 = 0, while the tree adds 1 - 2^24 exactly: (2^24 + 1) + (1 - 2^24) = 1.
        let big = 16_777_216.0f32;
        let v = [big, 1.0, 1.0, -big];
        assert_eq!(sequential(&v), 0.0);
        for t in [topo(1, 4), topo(2, 2), topo(4, 1)] {
            assert_eq!(tree_sum(t, &v), 1.0, "{t}");
        }
        // 1 x 3 is ((v0 + v1) + (v2 + 0)): here 2^24 + 1 rounds down before -2^24 comes in.
        assert_eq!(tree_sum(topo(1, 3), &[big, 1.0, -big]), 0.0);
        assert_eq!(tree_sum(topo(1, 3), &[1.0, -big, big]), 1.0);
    }

    #[test]
    fn matches_the_literal_definition_with_padding() {
        for (n, l) in [(1, 1), (1, 2), (1, 3), (1, 5), (1, 6), (1, 7), (2, 3), (3, 2), (3, 3), (2, 5), (5, 1), (3, 8), (6, 7)] {
            let t = topo(n, l);
            for seed in 0..200 {
                let v = random_leaves(seed * 31 + (n * 10 + l) as u64, n * l);
                assert_eq!(tree_sum(t, &v).to_bits(), literal(t, &v).to_bits(), "{t} seed {seed}: {v:?}");
            }
        }
    }

    #[test]
    fn power_of_two_splits_agree_bit_for_bit() {
        let mut differs_from_sequential = 0;
        for seed in 0..2000 {
            let v4 = random_leaves(seed, 4);
            let a = tree_sum(topo(1, 4), &v4);
            assert_eq!(a.to_bits(), tree_sum(topo(2, 2), &v4).to_bits(), "seed {seed}: {v4:?}");
            assert_eq!(a.to_bits(), tree_sum(topo(4, 1), &v4).to_bits(), "seed {seed}: {v4:?}");
            let v8 = random_leaves(seed + 1_000_000, 8);
            let b = tree_sum(topo(1, 8), &v8);
            for t in [topo(2, 4), topo(4, 2), topo(8, 1)] {
                assert_eq!(b.to_bits(), tree_sum(t, &v8).to_bits(), "{t} seed {seed}: {v8:?}");
            }
            differs_from_sequential += (b.to_bits() != sequential(&v8).to_bits()) as usize;
        }
        // The inputs are ones where the order shows.
        assert!(differs_from_sequential > 100, "{differs_from_sequential} of 2000 differ from the ascending sum");
    }

    #[test]
    fn other_splits_depend_on_the_topology() {
        // 1 x 6 = ((v0+v1) + (v2+v3)) + ((v4+v5) + 0); 2 x 3 = ((v0+v1) + (v2+0)) + ((v3+v4) + (v5+0)).
        let big = 16_777_216.0f32;
        let v = [big, 1.0, 0.0, 1.0, -big, 0.0];
        assert_eq!(tree_sum(topo(1, 6), &v), 0.0);
        assert_eq!(tree_sum(topo(2, 3), &v), 1.0);
        assert_eq!(tree_sum(topo(3, 2), &v), literal(topo(3, 2), &v));
    }

    #[test]
    fn zeros_come_out_positive_and_rows_reset() {
        let t = topo(2, 3);
        assert_eq!(tree_sum(t, &[-0.0; 6]).to_bits(), 0.0f32.to_bits());
        assert_eq!(tree_sum(topo(1, 1), &[-0.0]).to_bits(), 0.0f32.to_bits());
        let mut s = TreeSum::new(t, 3);
        s.leaf(0).copy_from_slice(&[1.0, 2.0, 3.0]);
        s.leaf(5).copy_from_slice(&[10.0, 20.0, 30.0]);
        let mut out = [0.0; 3];
        s.sum_into(&mut out);
        assert_eq!(out, [11.0, 22.0, 33.0]);
        // Every leaf is +0.0 again.
        s.leaf(4)[1] = 5.0;
        s.sum_into(&mut out);
        assert_eq!(out, [0.0, 5.0, 0.0]);
    }
}
