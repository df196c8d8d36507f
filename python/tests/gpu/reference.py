"""The semantics of every moelink operation, written in plain torch (CPU), independent of moelink.

Every rank can compute every rank's inputs (they are seeded by rank), so the references need no
communication: ``inputs(r)`` for each source rank ``r`` is all a reference looks at.

Everything is vectorised over tokens (loops run over ranks, top-k slots or local experts only), so the
references cost little next to the operations they check, also at realistic shapes (hidden 7168, top-8).
Sums keep the order the operations define (LL: ascending rank or slot, from +0.0; HT combine: the pairwise
tree over ranks of ``tree_sum``): adding a +0.0 term for an absent slot leaves an fp32 accumulator unchanged,
and an absent rank is a +0.0 leaf of the tree, so masking with zeros is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

FP8_MAX = 448.0


@dataclass
class RankInputs:
    """One rank's inputs, on the CPU."""

    x: torch.Tensor  # bf16 [T, H]
    topk_idx: torch.Tensor  # int64 [T, K], -1 = no expert
    topk_weights: torch.Tensor  # float32 [T, K]


def make_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, topk: int, seed: int = 0,
                drop: float = 0.1) -> RankInputs:
    """Seeded inputs: scores ``|randn| + 1``, top-k distinct experts, a fraction ``drop`` of slots set to -1."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    scores = torch.randn(num_tokens, num_experts, generator=g).abs() + 1
    topk_idx = scores.topk(topk, dim=1).indices.to(torch.int64)
    topk_idx[torch.rand(num_tokens, topk, generator=g) < drop] = -1
    topk_weights = torch.rand(num_tokens, topk, generator=g).to(torch.float32)
    return RankInputs(x, topk_idx, topk_weights)


def rank_of(expert: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    return expert // (num_experts // num_ranks)


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])."""
    t = topk_idx.shape[0]
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts)
    in_rank = torch.zeros(t, num_ranks, dtype=torch.bool)
    rows = torch.arange(t).unsqueeze(1).expand_as(topk_idx)[valid]
    in_rank[rows, rank_of(topk_idx[valid], num_experts, num_ranks)] = True
    return in_rank.sum(0).to(torch.int32), per_expert.to(torch.int32), in_rank


def to_local(topk_idx: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    lo = rank * num_local
    inside = (topk_idx >= lo) & (topk_idx < lo + num_local)
    return torch.where(inside, topk_idx - lo, torch.full_like(topk_idx, -1))


@dataclass
class HtReceived:
    """What rank ``rank`` receives from a high-throughput dispatch (one row per received token)."""

    src_rank: torch.Tensor  # int64 [N]: the source rank of each row, in receive order
    src_token: torch.Tensor  # int64 [N]: the row's token on its source rank
    x: torch.Tensor
    topk_idx: torch.Tensor  # local ids, -1 elsewhere
    topk_weights: torch.Tensor  # 0 where -1
    num_recv_tokens_per_expert: List[int]

    @property
    def num_rows(self) -> int:
        return int(self.src_rank.numel())


def ht_dispatch(all_inputs: Sequence[RankInputs], rank: int, num_experts: int, expert_alignment: int = 1,
                payloads: Optional[Sequence[torch.Tensor]] = None) -> HtReceived:
    """Rows from every source rank (ascending), each source's tokens in order, once per destination rank.

    ``payloads[s]`` replaces ``all_inputs[s].x`` as the rows moved (e.g. FP8 bytes or scales).
    """
    num_ranks = len(all_inputs)
    num_local = num_experts // num_ranks
    src_rank, src_token, rows, idx, w = [], [], [], [], []
    for s, inp in enumerate(all_inputs):
        _, _, in_rank = layout(inp.topk_idx, num_experts, num_ranks)
        toks = torch.nonzero(in_rank[:, rank]).flatten()
        data = inp.x if payloads is None else payloads[s]
        local = to_local(inp.topk_idx[toks], rank, num_local)
        src_rank.append(torch.full_like(toks, s))
        src_token.append(toks)
        rows.append(data[toks])
        idx.append(local)
        w.append(torch.where(local >= 0, inp.topk_weights[toks], torch.zeros_like(inp.topk_weights[toks])))
    topk_idx = torch.cat(idx)
    counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_local).tolist()
    aligned = [-(-c // expert_alignment) * expert_alignment for c in counts]
    return HtReceived(torch.cat(src_rank), torch.cat(src_token), torch.cat(rows), topk_idx, torch.cat(w), aligned)


def tree_sum(leaves: Sequence[torch.Tensor], ranks_per_node: Optional[int] = None) -> torch.Tensor:
    """The HT combine's fp32 sum over ranks (``moelink::reduce``), elementwise: ``leaves[r]`` is rank r's
    tensor (+0.0 where it returned nothing). Each node's ``ranks_per_node`` consecutive leaves (default: all,
    one node) are summed by a pairwise tree, ``tree(x_0..x_2m-1) = tree(x_0..x_m-1) + tree(x_m..x_2m-1)``,
    after padding with +0.0 to a power of two; the node partials by the same tree; then ``+0.0 + T``."""
    def tree(x: List[torch.Tensor]) -> torch.Tensor:
        n = 1
        while n < len(x):
            n *= 2
        x = x + [torch.zeros_like(x[0])] * (n - len(x))
        while len(x) > 1:  # one level of the tree: adjacent pairs, left + right
            x = [x[i] + x[i + 1] for i in range(0, len(x), 2)]
        return x[0]

    per_node = ranks_per_node or len(leaves)
    partials = [tree(list(leaves[i:i + per_node])) for i in range(0, len(leaves), per_node)]
    total = tree(partials)
    return torch.zeros_like(total) + total


def ht_combine(all_returned: Sequence[Tuple[HtReceived, torch.Tensor, Optional[torch.Tensor]]], rank: int,
               num_tokens: int, bias: Sequence[torch.Tensor] = (),
               ranks_per_node: Optional[int] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """For each of ``rank``'s tokens: the fp32 ``tree_sum`` over ranks of the rows every rank returns for it
    (``all_returned[r] = (what r received, its combine x, its combine topk_weights)``; +0.0 for a rank the
    token did not go to; ``ranks_per_node``: the buffer's topology, default one node), plus the biases in
    order, rounded to bf16; and the same tree sum of the weights (None without weights)."""
    hidden = all_returned[0][1].shape[1]
    w0 = all_returned[0][2]
    rows, weights = [], []
    for received, x, w in all_returned:  # rank order; a token arrives at a rank at most once
        mine = received.src_rank == rank
        toks = received.src_token[mine]
        leaf = torch.zeros(num_tokens, hidden, dtype=torch.float32)
        leaf[toks] = x[mine].float()
        rows.append(leaf)
        if w0 is not None:
            leaf_w = torch.zeros(num_tokens, w0.shape[1], dtype=torch.float32)
            if w is not None:
                leaf_w[toks] = w[mine].float()
            weights.append(leaf_w)
    acc = tree_sum(rows, ranks_per_node)
    for b in bias:
        acc = acc + b.float()
    return acc.to(torch.bfloat16), tree_sum(weights, ranks_per_node) if w0 is not None else None


def fp8_quantize(x: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token and 128 channels: ``amax = max(max|x|, 1e-4)``; ``scale_inv = amax/448`` (or with
    ``round_scale`` the next power of two, exactly); values ``e4m3(x * (1/scale_inv or 448/amax))``.
    Returns ``(fp8 [T, H], scale_inv float32 [T, H/128])``."""
    t, h = x.shape
    g = x.float().view(t, h // 128, 128)
    amax = g.abs().amax(dim=2).clamp_min(1e-4)
    # IEEE divisions of two tensors: torch turns `scalar / tensor` (and may turn `tensor / scalar`) into a
    # multiply by a rounded reciprocal, which is not the quantiser's rule.
    fp8_max = torch.full_like(amax, FP8_MAX)
    if round_scale:
        mant, exp = torch.frexp(amax / fp8_max)
        one = torch.ones_like(amax)
        scale_inv = torch.where(mant == 0.5, torch.ldexp(one, exp - 1), torch.ldexp(one, exp))
        scale = one / scale_inv
    else:
        scale = fp8_max / amax
        scale_inv = amax / fp8_max
    q = (g * scale.unsqueeze(2)).view(t, h).to(torch.float8_e4m3fn)
    return q, scale_inv


def ue8m0_pack(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales ``[..., G]`` as exponent bytes (``log2 + 127``), four per int32, little-endian."""
    lead, groups = scale_inv.shape[:-1], scale_inv.shape[-1]
    byte = ((scale_inv.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64).view(*lead, groups // 4, 4)
    word = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


@dataclass
class LlReceived:
    """What rank ``rank`` receives from a low-latency dispatch: row ``j`` of local expert ``e`` is token
    ``src_token[e][j]`` of rank ``src_rank[e][j]``."""

    src_rank: List[torch.Tensor]  # per local expert, int64 [recv_count[e]]
    src_token: List[torch.Tensor]
    recv_count: List[int]

    def rows(self, per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
        """The valid rows of every local expert, concatenated in expert order, taken from ``per_rank[s]``
        (a ``[T_s, ...]`` tensor per source rank: tokens, FP8 bytes, scales)."""
        t_max = max(int(p.shape[0]) for p in per_rank)
        padded = torch.stack([torch.cat([p, p.new_zeros((t_max - p.shape[0],) + tuple(p.shape[1:]))]) for p in per_rank])
        return padded[torch.cat(self.src_rank), torch.cat(self.src_token)]


def ll_dispatch(all_inputs: Sequence[RankInputs], rank: int, num_experts: int, masked: Sequence[int] = ()) -> LlReceived:
    """Within local expert e, rows by source rank, then source token; tokens of masked sources are dropped."""
    num_ranks = len(all_inputs)
    num_local = num_experts // num_ranks
    src_rank: List[List[torch.Tensor]] = [[] for _ in range(num_local)]
    src_token: List[List[torch.Tensor]] = [[] for _ in range(num_local)]
    for s, inp in enumerate(all_inputs):
        if s in masked:
            continue
        local = to_local(inp.topk_idx, rank, num_local)
        for e in range(num_local):  # top-k experts are distinct: a token reaches expert e at most once
            toks = torch.nonzero((local == e).any(dim=1)).flatten()
            src_rank[e].append(torch.full_like(toks, s))
            src_token[e].append(toks)
    empty = torch.empty(0, dtype=torch.int64)
    ranks = [torch.cat(v) if v else empty for v in src_rank]
    tokens = [torch.cat(v) if v else empty for v in src_token]
    return LlReceived(ranks, tokens, [int(v.numel()) for v in ranks])


def expert_fn(x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the experts: ``bf16(x * (e + 1) / 8)`` for global expert ``e``, row-wise
    (``x [..., H]``, ``expert`` broadcastable to ``x.shape[:-1]``)."""
    return (x.float() * ((expert.to(torch.float32) + 1) / 8).unsqueeze(-1)).to(torch.bfloat16)


def ll_combine(inp: RankInputs, rank: int, num_experts: int, num_ranks: int, pre_reduced: bool,
               masked: Sequence[int] = ()) -> torch.Tensor:
    """``bf16(Σ_k w[t,k]·y[t,k])`` over ``k`` with ``topk_idx[t,k] != -1``, each product rounded to fp32, in
    ascending ``k`` from +0.0, where ``y[t,k] = expert_fn(x[t], topk_idx[t,k])`` is what the experts
    computed. Pre-reduced (dispatch carried weights): each expert rank sums its own experts' terms that way
    and rounds to bf16; the home rank sums those partials in ascending rank order. Terms of experts on
    ``masked`` ranks are dropped (and a masked rank's own tokens get nothing back)."""
    t, k = inp.topk_idx.shape
    acc = torch.zeros(t, inp.x.shape[1], dtype=torch.float32)
    if rank in masked:
        return acc.to(torch.bfloat16)  # a masked rank's tokens reached no expert (receivers drop them)
    idx = inp.topk_idx
    expert_rank = torch.where(idx >= 0, rank_of(idx.clamp_min(0), num_experts, num_ranks), torch.full_like(idx, -1))
    live = (idx >= 0) & ~torch.isin(expert_rank, torch.tensor(list(masked), dtype=torch.int64))
    y = expert_fn(inp.x.unsqueeze(1), idx.clamp_min(0))  # [T, K, H]
    terms = inp.topk_weights.unsqueeze(2) * y.float()  # each product rounded to fp32
    zero = torch.zeros(t, inp.x.shape[1], dtype=torch.float32)
    if not pre_reduced:
        for kk in range(k):
            acc = acc + torch.where(live[:, kk:kk + 1], terms[:, kk], zero)
        return acc.to(torch.bfloat16)
    for r in range(num_ranks):
        partial = torch.zeros_like(acc)
        for kk in range(k):
            partial = partial + torch.where((live[:, kk] & (expert_rank[:, kk] == r)).unsqueeze(1), terms[:, kk], zero)
        acc = acc + partial.to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)
