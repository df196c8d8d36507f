//! Routing arithmetic shared by every backend: which rank each token goes to, how many tokens each rank
//! and expert receives, and where each token lands at each destination.
//!
//! Conventions (identical on host and GPU):
//! - `topk_idx[t, k]` is a global expert id in `0..num_experts`, or `-1` for "no expert".
//! - Expert `e` lives on rank `e / (num_experts / num_ranks)`; its local id there is
//!   `e % (num_experts / num_ranks)`.
//! - A token is sent to a rank once, however many of its experts live there.
//! - `send_slot[t, r]` is the position of token `t` among the tokens this rank sends to rank `r`
//!   (an exclusive prefix count over tokens), or `-1` when `t` is not sent to `r`. Receivers place rows
//!   from source `s` at `recv_offset[s] + send_slot`, so the receive order is source rank, then source token
//!   order, and no atomics are needed.

/// Per-rank routing facts computed from `topk_idx`, as `get_dispatch_layout` returns them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutingLayout {
    /// `[num_ranks]`: tokens this rank sends to each rank.
    pub num_tokens_per_rank: Vec<i32>,
    /// `[num_experts]`: tokens this rank sends to each (global) expert.
    pub num_tokens_per_expert: Vec<i32>,
    /// `[num_tokens * num_ranks]`, row-major: token `t` goes to rank `r`.
    pub is_token_in_rank: Vec<bool>,
}

/// The layout tensors a fresh dispatch is given, as host slices (row-major `is_token_in_rank [T * R]`).
pub struct LayoutRef<'a> {
    pub is_token_in_rank: &'a [bool],
    pub num_tokens_per_rank: &'a [i32],
    pub num_tokens_per_expert: &'a [i32],
}

/// Checks that a dispatch's layout tensors agree with each other and, when given (`topk_idx`, row-major
/// `[num_tokens, topk]`, values already checked), with `topk_idx` — the layout [`dispatch_layout`] computes
/// from it. Returns the first disagreement as (argument, reason):
/// - `is_token_in_rank`: a token sent to a rank where it selects no expert, or not sent to a rank where it
///   selects one (its received row would carry top-k ids that are all -1, or miss an expert);
/// - `num_tokens_per_rank`: a count that is not the tokens `is_token_in_rank` sends there;
/// - `num_tokens_per_expert`: a negative count; with `topk_idx`, a count that is not the tokens selecting the
///   expert; without it, the experts of a rank counting tokens while no token goes to that rank, or fewer
///   tokens than go there (each token sent to a rank selects at least one of its experts).
///
/// A grouped GEMM sizes its work by the per-expert counts, so a count that the rows do not back is refused
/// rather than returned.
pub fn check_layout(
    l: &LayoutRef<'_>,
    topk_idx: Option<&[i64]>,
    num_tokens: usize,
    topk: usize,
    num_ranks: usize,
) -> Result<(), (&'static str, String)> {
    let num_experts = l.num_tokens_per_expert.len();
    let per_rank_experts = num_experts / num_ranks.max(1);
    if let Some(idx) = topk_idx.filter(|_| topk > 0 && per_rank_experts > 0) {
        let mut selects = vec![false; num_ranks];
        for t in 0..num_tokens {
            selects.iter_mut().for_each(|v| *v = false);
            for &e in idx[t * topk..(t + 1) * topk].iter().filter(|&&e| e >= 0) {
                selects[rank_of_expert(e, num_experts, num_ranks)] = true;
            }
            for (r, &wanted) in selects.iter().enumerate() {
                let sent = l.is_token_in_rank[t * num_ranks + r];
                if sent != wanted {
                    let why = if sent {
                        format!("sends token {t} to rank {r}, where topk_idx selects none of its experts")
                    } else {
                        format!("does not send token {t} to rank {r}, where topk_idx selects one of its experts")
                    };
                    return Err(("is_token_in_rank", why));
                }
            }
        }
    }
    for r in 0..num_ranks {
        let sent = (0..num_tokens).filter(|&t| l.is_token_in_rank[t * num_ranks + r]).count();
        if sent != l.num_tokens_per_rank[r] as usize || l.num_tokens_per_rank[r] < 0 {
            return Err((
                "num_tokens_per_rank",
                format!("says {} tokens go to rank {r}, is_token_in_rank says {sent}", l.num_tokens_per_rank[r]),
            ));
        }
    }
    if let Some((e, c)) = l.num_tokens_per_expert.iter().enumerate().find(|(_, &c)| c < 0) {
        return Err(("num_tokens_per_expert", format!("says {c} tokens go to expert {e}")));
    }
    match topk_idx.filter(|_| topk > 0) {
        Some(idx) => {
            let mut counted = vec![0i64; num_experts];
            for &e in idx[..num_tokens * topk].iter().filter(|&&e| e >= 0) {
                counted[e as usize] += 1;
            }
            if let Some(e) = (0..num_experts).find(|&e| counted[e] != l.num_tokens_per_expert[e] as i64) {
                return Err((
                    "num_tokens_per_expert",
                    format!("says {} tokens go to expert {e}, topk_idx selects it for {}", l.num_tokens_per_expert[e], counted[e]),
                ));
            }
        }
        None => {
            for r in 0..num_ranks {
                let experts = &l.num_tokens_per_expert[r * per_rank_experts..(r + 1) * per_rank_experts];
                let sum: i64 = experts.iter().map(|&c| c as i64).sum();
                let sent = l.num_tokens_per_rank[r] as i64;
                if (sent == 0) != (sum == 0) || sum < sent {
                    return Err((
                        "num_tokens_per_expert",
                        format!(
                            "says {sum} tokens go to the experts of rank {r}, but {sent} tokens go to that rank (num_tokens_per_rank, \
                             is_token_in_rank); each token sent there selects at least one of them"
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Rank that hosts global expert `expert`.
#[inline]
pub fn rank_of_expert(expert: i64, num_experts: usize, num_ranks: usize) -> usize {
    expert as usize / (num_experts / num_ranks)
}

/// Computes the dispatch layout of one rank. `topk_idx` is row-major `[num_tokens, topk]` and must already
/// be validated (entries in `-1..num_experts`).
pub fn dispatch_layout(topk_idx: &[i64], num_tokens: usize, topk: usize, num_experts: usize, num_ranks: usize) -> RoutingLayout {
    let mut num_tokens_per_rank = vec![0i32; num_ranks];
    let mut num_tokens_per_expert = vec![0i32; num_experts];
    let mut is_token_in_rank = vec![false; num_tokens * num_ranks];
    for t in 0..num_tokens {
        let row = &topk_idx[t * topk..(t + 1) * topk];
        let in_rank = &mut is_token_in_rank[t * num_ranks..(t + 1) * num_ranks];
        for &e in row {
            if e < 0 {
                continue;
            }
            num_tokens_per_expert[e as usize] += 1;
            in_rank[rank_of_expert(e, num_experts, num_ranks)] = true;
        }
        for (r, &hit) in in_rank.iter().enumerate() {
            num_tokens_per_rank[r] += hit as i32;
        }
    }
    RoutingLayout { num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank }
}

/// `send_slot[t * num_ranks + r]`: position of token `t` among the tokens sent to rank `r`, or -1.
pub fn send_slots(is_token_in_rank: &[bool], num_tokens: usize, num_ranks: usize) -> Vec<i32> {
    let mut next = vec![0i32; num_ranks];
    let mut slots = vec![-1i32; num_tokens * num_ranks];
    for t in 0..num_tokens {
        for r in 0..num_ranks {
            if is_token_in_rank[t * num_ranks + r] {
                slots[t * num_ranks + r] = next[r];
                next[r] += 1;
            }
        }
    }
    slots
}

/// Given `counts[src * num_ranks + dst]` (tokens rank `src` sends to rank `dst`), the offset at which rows
/// from each source start in `dst`'s receive order: `recv_offsets(counts, R, dst)[src]`, plus the total.
pub fn recv_offsets(counts: &[i32], num_ranks: usize, dst: usize) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(num_ranks);
    let mut acc = 0usize;
    for src in 0..num_ranks {
        offsets.push(acc);
        acc += counts[src * num_ranks + dst] as usize;
    }
    (offsets, acc)
}

/// Rounds `n` up to a multiple of `alignment` (alignment >= 1).
#[inline]
pub fn align_up(n: usize, alignment: usize) -> usize {
    n.div_ceil(alignment) * alignment
}

/// Maps a global expert id to the local id on `rank`, or -1 when it lives elsewhere (or is -1).
#[inline]
pub fn to_local_expert(expert: i64, rank: usize, num_local_experts: usize) -> i64 {
    let lo = (rank * num_local_experts) as i64;
    if expert >= lo && expert < lo + num_local_experts as i64 {
        expert - lo
    } else {
        -1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_counts_a_token_once_per_rank() {
        // 2 ranks, 4 experts (2 per rank), top-3.
        let topk = vec![0, 1, 2, /* t1 */ -1, 3, -1, /* t2 */ -1, -1, -1];
        let l = dispatch_layout(&topk, 3, 3, 4, 2);
        assert_eq!(l.num_tokens_per_rank, vec![1, 2]);
        assert_eq!(l.num_tokens_per_expert, vec![1, 1, 1, 1]);
        assert_eq!(l.is_token_in_rank, vec![true, true, false, true, false, false]);
        let slots = send_slots(&l.is_token_in_rank, 3, 2);
        assert_eq!(slots, vec![0, 0, -1, 1, -1, -1]);
    }

    #[test]
    fn recv_offsets_are_source_major() {
        // counts[src][dst] for 3 ranks
        let counts = vec![1, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(recv_offsets(&counts, 3, 1), (vec![0, 2, 7], 15));
        assert_eq!(align_up(0, 4), 0);
        assert_eq!(align_up(5, 4), 8);
        assert_eq!(to_local_expert(5, 1, 4), 1);
        assert_eq!(to_local_expert(3, 1, 4), -1);
        assert_eq!(to_local_expert(-1, 0, 4), -1);
    }
}
