//! Routings: which experts each token picks, drawn from an [`Rng`].

use crate::rng::Rng;

/// How tokens pick experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteKind {
    /// Scores `|randn| + 1`, top-k (DeepEP's benchmark routing).
    Uniform,
    /// 90% of tokens pick experts `0..k`: the first rank receives nearly everything.
    Skewed,
    /// Uniform, then each slot is `-1` with probability 1/4.
    WithHoles,
    /// Uniform over the experts of every rank but this one, which receives nothing.
    EmptyRank(usize),
    /// DeepSeek-V3's group-limited gating with one group per node: the experts split into `nodes` equal
    /// groups, each scored by the sum of its two best experts' scores; a token picks its top k experts among
    /// the `max_nodes` best groups only, so it reaches at most `max_nodes` nodes.
    NodeLimited { nodes: usize, max_nodes: usize },
    /// Uniform over the experts of every node but `node` (of `nodes` equal groups of ranks), which receives
    /// nothing: an empty node (slots that only its experts could fill are `-1`).
    EmptyNode { node: usize, nodes: usize },
    /// 90% of tokens pick their experts among those of `node` (of `nodes` equal groups of ranks) while it has
    /// k of them: nearly everything goes to one node.
    NodeSkewed { node: usize, nodes: usize },
}

impl RouteKind {
    /// A kind drawn for a round of `ranks` ranks: uniform 3/8, skewed 2/8, with holes 2/8, an empty rank 1/8.
    pub fn draw(rng: &mut Rng, ranks: usize) -> RouteKind {
        match rng.below(8) {
            0..=2 => RouteKind::Uniform,
            3 | 4 => RouteKind::Skewed,
            5 | 6 => RouteKind::WithHoles,
            _ => RouteKind::EmptyRank(rng.below(ranks)),
        }
    }

    /// A kind drawn for a round of `ranks` ranks on `nodes` nodes: on one node exactly [`RouteKind::draw`]
    /// (the same kinds from the same generator state); across nodes, node-limited routing 1/4 of the time
    /// (each token's experts on at most `max_nodes` nodes, drawn in `1..nodes` so that the limit bites),
    /// [`RouteKind::draw`]'s kinds otherwise.
    pub fn draw_on(rng: &mut Rng, ranks: usize, nodes: usize) -> RouteKind {
        if nodes > 1 && rng.below(4) == 0 {
            return RouteKind::NodeLimited { nodes, max_nodes: 1 + rng.below(nodes - 1) };
        }
        RouteKind::draw(rng, ranks)
    }

    /// A kind drawn for a round of `ranks` ranks on `nodes` nodes with the node-level cases (for the
    /// high-throughput kernels across nodes, whose traffic is per node): on one node exactly
    /// [`RouteKind::draw`]; across nodes node-limited routing 1/4 of the time (as [`RouteKind::draw_on`]), an
    /// empty node 1/8, a skew to one node 1/8, [`RouteKind::draw`]'s kinds otherwise.
    pub fn draw_nodes(rng: &mut Rng, ranks: usize, nodes: usize) -> RouteKind {
        if nodes <= 1 {
            return RouteKind::draw(rng, ranks);
        }
        match rng.below(8) {
            0 | 1 => RouteKind::NodeLimited { nodes, max_nodes: 1 + rng.below(nodes - 1) },
            2 => RouteKind::EmptyNode { node: rng.below(nodes), nodes },
            3 => RouteKind::NodeSkewed { node: rng.below(nodes), nodes },
            _ => RouteKind::draw(rng, ranks),
        }
    }

    /// Name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            RouteKind::Uniform => "uniform",
            RouteKind::Skewed => "skewed",
            RouteKind::WithHoles => "holes",
            RouteKind::EmptyRank(_) => "empty-rank",
            RouteKind::NodeLimited { .. } => "node-limited",
            RouteKind::EmptyNode { .. } => "empty-node",
            RouteKind::NodeSkewed { .. } => "node-skewed",
        }
    }

    /// A small number per kind, for seeds.
    pub fn code(self) -> u64 {
        match self {
            RouteKind::Uniform => 0,
            RouteKind::Skewed => 1,
            RouteKind::WithHoles => 2,
            RouteKind::EmptyRank(_) => 3,
            RouteKind::NodeLimited { .. } => 4,
            RouteKind::EmptyNode { .. } => 5,
            RouteKind::NodeSkewed { .. } => 6,
        }
    }
}

/// `topk_idx [tokens, topk]` row-major for one rank of `ranks`: per token the `topk` best of `experts`
/// scores (ties by expert id), as distinct expert ids or `-1` (a hole, an expert of the empty rank, or a
/// slot past the number of experts).
pub fn route(rng: &mut Rng, kind: RouteKind, tokens: usize, topk: usize, experts: usize, ranks: usize) -> Vec<i64> {
    let per_rank = (experts / ranks.max(1)).max(1);
    // The node of an expert when the ranks form `nodes` equal groups.
    let node_of = |e: usize, nodes: usize| e / per_rank / (ranks / nodes.max(1)).max(1);
    let mut out = Vec::with_capacity(tokens * topk);
    let mut scores: Vec<(f64, usize)> = Vec::with_capacity(experts);
    for _ in 0..tokens {
        scores.clear();
        scores.extend((0..experts).map(|e| (rng.normal().abs() + 1.0, e)));
        match kind {
            RouteKind::Skewed if rng.uniform() < 0.9 => scores.iter_mut().filter(|(_, e)| *e < topk).for_each(|(s, _)| *s += 100.0),
            RouteKind::EmptyRank(r) => scores.iter_mut().filter(|(_, e)| *e / per_rank == r).for_each(|(s, _)| *s = -1.0),
            RouteKind::NodeLimited { nodes, max_nodes } if nodes > max_nodes => limit_to_best_groups(&mut scores, nodes, max_nodes),
            RouteKind::EmptyNode { node, nodes } => {
                scores.iter_mut().filter(|(_, e)| node_of(*e, nodes) == node).for_each(|(s, _)| *s = -1.0)
            }
            RouteKind::NodeSkewed { node, nodes } if rng.uniform() < 0.9 => {
                scores.iter_mut().filter(|(_, e)| node_of(*e, nodes) == node).for_each(|(s, _)| *s += 100.0)
            }
            _ => {}
        }
        // Only the top k are needed: partition, then order those k.
        let by_score = |a: &(f64, usize), b: &(f64, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if topk < scores.len() {
            scores.select_nth_unstable_by(topk, by_score);
        }
        let best = &mut scores[..topk.min(experts)];
        best.sort_by(by_score);
        for &(s, e) in best.iter() {
            let hole = kind == RouteKind::WithHoles && rng.below(4) == 0;
            out.push(if s < 0.0 || hole { -1 } else { e as i64 });
        }
        out.extend(std::iter::repeat_n(-1, topk.saturating_sub(experts)));
    }
    out
}

/// Scores of every group but the `max_groups` best (by the sum of each group's two best scores, ties by
/// group id) drop below every live score, so that the top k come from those groups while they have k experts.
/// Experts past `groups` equal groups (a remainder) belong to no group and drop too.
fn limit_to_best_groups(scores: &mut [(f64, usize)], groups: usize, max_groups: usize) {
    let per_group = scores.len() / groups.max(1);
    if per_group == 0 {
        return;
    }
    let mut group_scores: Vec<(f64, usize)> = (0..groups)
        .map(|g| {
            let mut best = [f64::NEG_INFINITY; 2];
            for &(s, _) in &scores[g * per_group..(g + 1) * per_group] {
                if s > best[0] {
                    best = [s, best[0]];
                } else if s > best[1] {
                    best[1] = s;
                }
            }
            (best[0] + best[1].max(0.0), g)
        })
        .collect();
    group_scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut chosen = vec![false; groups];
    for &(_, g) in &group_scores[..max_groups.min(groups)] {
        chosen[g] = true;
    }
    for (s, e) in scores.iter_mut() {
        if !chosen.get(*e / per_group).copied().unwrap_or(false) {
            // Below every live score (those are >= 1) but above a masked slot's -1: picked only when the
            // chosen groups have fewer than k experts, and then turned into -1 like any negative score.
            *s = -0.5;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_distinct_and_honour_holes_and_empty_ranks() {
        let mut r = Rng::new(3);
        for kind in [RouteKind::Uniform, RouteKind::Skewed, RouteKind::WithHoles, RouteKind::EmptyRank(1)] {
            let idx = route(&mut r, kind, 50, 8, 32, 4);
            assert_eq!(idx.len(), 400);
            for row in idx.chunks(8) {
                let live: Vec<i64> = row.iter().copied().filter(|&e| e >= 0).collect();
                let mut d = live.clone();
                d.sort();
                d.dedup();
                assert_eq!(d.len(), live.len(), "{kind:?}: {row:?}");
                assert!(live.iter().all(|&e| e < 32));
                if kind == RouteKind::EmptyRank(1) {
                    assert!(live.iter().all(|&e| e / 8 != 1), "{row:?}");
                }
            }
            if kind == RouteKind::WithHoles {
                let holes = idx.iter().filter(|&&e| e == -1).count();
                assert!((50..150).contains(&holes), "{holes} holes of 400");
            }
        }
        // Fewer experts than k: the rest is -1.
        assert_eq!(route(&mut r, RouteKind::Uniform, 1, 4, 2, 2).iter().filter(|&&e| e == -1).count(), 2);
    }

    #[test]
    fn node_limited_tokens_reach_at_most_max_nodes() {
        let mut rng = Rng::new(11);
        // 256 experts on 8 nodes (32 per node), top-8 within at most 4 nodes: DeepSeek-V3's gating.
        let kind = RouteKind::NodeLimited { nodes: 8, max_nodes: 4 };
        let idx = route(&mut rng, kind, 300, 8, 256, 64);
        let mut reached = [0usize; 9];
        for row in idx.chunks(8) {
            assert!(row.iter().all(|&e| (0..256).contains(&e)), "{row:?}");
            let mut nodes: Vec<i64> = row.iter().map(|&e| e / 32).collect();
            nodes.sort();
            nodes.dedup();
            assert!(nodes.len() <= 4, "{row:?}");
            reached[nodes.len()] += 1;
        }
        // Mostly 3 or 4 nodes (the best groups hold most of a token's best experts), never all 8.
        assert!(reached[3] + reached[4] > 200, "{reached:?}");
        // Groups that cannot hold k experts: the rest of the slots are -1, never an expert elsewhere.
        let few = route(&mut rng, RouteKind::NodeLimited { nodes: 4, max_nodes: 1 }, 20, 8, 16, 4);
        for row in few.chunks(8) {
            let live: Vec<i64> = row.iter().copied().filter(|&e| e >= 0).collect();
            assert_eq!(live.len(), 4, "{row:?}");
            assert!(live.iter().all(|&e| e / 4 == live[0] / 4), "{row:?}");
        }
        // As many groups allowed as there are: plain uniform routing.
        let all = route(&mut Rng::new(2), RouteKind::NodeLimited { nodes: 2, max_nodes: 4 }, 5, 4, 16, 2);
        assert_eq!(all, route(&mut Rng::new(2), RouteKind::Uniform, 5, 4, 16, 2));
    }

    #[test]
    fn skew_concentrates_on_the_first_experts() {
        let mut rng = Rng::new(7);
        let skewed = route(&mut rng, RouteKind::Skewed, 200, 8, 64, 8);
        let low = skewed.iter().filter(|&&e| (0..8).contains(&e)).count();
        assert!(low > 1200, "{low}");
    }

    #[test]
    fn draws_across_nodes_add_node_limited_routing_and_keep_single_node_draws() {
        // One node: the very same sequence as `draw`.
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        for _ in 0..100 {
            assert_eq!(RouteKind::draw_on(&mut a, 4, 1), RouteKind::draw(&mut b, 4));
        }
        // Several nodes: node-limited about a quarter of the time, always with a limit below the node count.
        let mut rng = Rng::new(4);
        let mut limited = 0;
        for _ in 0..400 {
            match RouteKind::draw_on(&mut rng, 8, 4) {
                RouteKind::NodeLimited { nodes, max_nodes } => {
                    assert_eq!(nodes, 4);
                    assert!((1..4).contains(&max_nodes), "{max_nodes}");
                    limited += 1;
                }
                RouteKind::EmptyRank(r) => assert!(r < 8),
                _ => {}
            }
        }
        assert!((60..140).contains(&limited), "{limited} of 400 node-limited");
    }

    #[test]
    fn empty_and_skewed_nodes_route_as_named() {
        // 32 experts on 8 ranks as 2 nodes of 4: node 1 holds experts 16..32.
        let mut rng = Rng::new(13);
        let empty = route(&mut rng, RouteKind::EmptyNode { node: 1, nodes: 2 }, 100, 8, 32, 8);
        assert!(empty.iter().all(|&e| (0..16).contains(&e)), "an expert of the empty node was picked");
        let skewed = route(&mut rng, RouteKind::NodeSkewed { node: 1, nodes: 2 }, 200, 8, 32, 8);
        let on_node: usize = skewed.chunks(8).filter(|row| row.iter().all(|&e| e >= 16)).count();
        assert!((160..200).contains(&on_node), "{on_node} of 200 tokens entirely on node 1");
        // Fewer experts outside the empty node than k: the rest of the slots are -1.
        let few = route(&mut rng, RouteKind::EmptyNode { node: 0, nodes: 2 }, 10, 8, 8, 2);
        for row in few.chunks(8) {
            assert_eq!(row.iter().filter(|&&e| e >= 4).count(), 4, "{row:?}");
            assert_eq!(row.iter().filter(|&&e| e == -1).count(), 4, "{row:?}");
        }
    }

    #[test]
    fn node_draws_cover_the_node_kinds_and_keep_single_node_draws() {
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        for _ in 0..100 {
            assert_eq!(RouteKind::draw_nodes(&mut a, 4, 1), RouteKind::draw(&mut b, 4));
        }
        let mut rng = Rng::new(6);
        let mut seen = [0usize; 7];
        for _ in 0..800 {
            let k = RouteKind::draw_nodes(&mut rng, 8, 2);
            match k {
                RouteKind::NodeLimited { nodes, max_nodes } => assert_eq!((nodes, max_nodes), (2, 1)),
                RouteKind::EmptyNode { node, nodes } | RouteKind::NodeSkewed { node, nodes } => assert!(node < nodes && nodes == 2),
                _ => {}
            }
            seen[k.code() as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 30), "{seen:?}");
    }

    #[test]
    fn drawn_kinds_name_a_rank_of_the_group() {
        let mut rng = Rng::new(5);
        for _ in 0..200 {
            if let RouteKind::EmptyRank(r) = RouteKind::draw(&mut rng, 3) {
                assert!(r < 3);
            }
        }
    }
}
