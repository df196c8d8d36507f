"""The semantics of every moelink operation, written in plain torch (CPU), independent of moelink.

Every rank can compute every rank's inputs (they are seeded by rank), so the references need no
communication: ``inputs(r)`` for each source rank ``r`` is all a reference looks at.
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
    per_expert = torch.zeros(num_experts, dtype=torch.int64)
    per_expert.index_add_(0, topk_idx[valid], torch.ones(int(valid.sum()), dtype=torch.int64))
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
    """What rank ``rank`` receives from a high-throughput dispatch."""

    src: List[Tuple[int, int]]  # (source rank, source token) of each row, in receive order
    x: torch.Tensor
    topk_idx: torch.Tensor  # local ids, -1 elsewhere
    topk_weights: torch.Tensor  # 0 where -1
    num_recv_tokens_per_expert: List[int]


def ht_dispatch(all_inputs: Sequence[RankInputs], rank: int, num_experts: int, expert_alignment: int = 1,
                payloads: Optional[Sequence[torch.Tensor]] = None) -> HtReceived:
    """Rows from every source rank (ascending), each source's tokens in order, once per destination rank.

    ``payloads[s]`` replaces ``all_inputs[s].x`` as the rows moved (e.g. FP8 bytes or scales).
    """
    num_ranks = len(all_inputs)
    num_local = num_experts // num_ranks
    src, rows, idx, w = [], [], [], []
    for s, inp in enumerate(all_inputs):
        _, _, in_rank = layout(inp.topk_idx, num_experts, num_ranks)
        data = inp.x if payloads is None else payloads[s]
        for tok in torch.nonzero(in_rank[:, rank]).flatten().tolist():
            src.append((s, tok))
            rows.append(data[tok])
            local = to_local(inp.topk_idx[tok], rank, num_local)
            idx.append(local)
            w.append(torch.where(local >= 0, inp.topk_weights[tok], torch.zeros_like(inp.topk_weights[tok])))
    k = all_inputs[0].topk_idx.shape[1]
    data0 = all_inputs[0].x if payloads is None else payloads[0]
    x = torch.stack(rows) if rows else data0.new_empty((0,) + tuple(data0.shape[1:]))
    topk_idx = torch.stack(idx) if idx else torch.empty(0, k, dtype=torch.int64)
    topk_weights = torch.stack(w) if w else torch.empty(0, k, dtype=torch.float32)
    counts = [int((topk_idx == e).sum()) for e in range(num_local)]
    aligned = [-(-c // expert_alignment) * expert_alignment for c in counts]
    return HtReceived(src, x, topk_idx, topk_weights, aligned)


def ht_combine(all_returned: Sequence[Tuple[HtReceived, torch.Tensor, Optional[torch.Tensor]]], rank: int,
               num_tokens: int, bias: Sequence[torch.Tensor] = ()) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """For each of ``rank``'s tokens: the fp32 sum, in ascending rank order from +0.0, of the rows every rank
    returns for it (``all_returned[r] = (what r received, its combine x, its combine topk_weights)``), plus the
    biases in order, rounded to bf16; and the same sum of the weights."""
    hidden = all_returned[0][1].shape[1]
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    has_w = all_returned[0][2] is not None
    acc_w = torch.zeros(num_tokens, all_returned[0][2].shape[1], dtype=torch.float32) if has_w else None
    for received, x, w in all_returned:
        for row, (s, tok) in enumerate(received.src):
            if s == rank:
                acc[tok] = acc[tok] + x[row].float()
                if acc_w is not None and w is not None:
                    acc_w[tok] = acc_w[tok] + w[row]
    for b in bias:
        acc = acc + b.float()
    return acc.to(torch.bfloat16), acc_w


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
    """Power-of-two fp32 scales ``[T, G]`` as exponent bytes (``log2 + 127``), four per int32, little-endian."""
    t, groups = scale_inv.shape
    byte = ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.int64).view(t, groups // 4, 4)
    word = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


@dataclass
class LlReceived:
    """What rank ``rank`` receives from a low-latency dispatch, per local expert."""

    src: List[List[Tuple[int, int, int]]]  # per local expert: (source rank, source token, k)
    recv_count: List[int]


def ll_dispatch(all_inputs: Sequence[RankInputs], rank: int, num_experts: int, masked: Sequence[int] = ()) -> LlReceived:
    """Within local expert e, rows by source rank, then source token; tokens of masked sources are dropped."""
    num_ranks = len(all_inputs)
    num_local = num_experts // num_ranks
    src: List[List[Tuple[int, int, int]]] = [[] for _ in range(num_local)]
    for s, inp in enumerate(all_inputs):
        if s in masked:
            continue
        local = to_local(inp.topk_idx, rank, num_local)
        for tok in range(local.shape[0]):
            for k in range(local.shape[1]):
                e = int(local[tok, k])
                if e >= 0:
                    src[e].append((s, tok, k))
    return LlReceived(src, [len(v) for v in src])


def ll_combine(inp: RankInputs, expert_output: "ExpertFn", rank: int, num_experts: int, num_ranks: int,
               pre_reduced: bool, masked: Sequence[int] = ()) -> torch.Tensor:
    """``bf16(Σ_k w[t,k]·y[t,k])`` over ``k`` with ``topk_idx[t,k] != -1``, each product rounded to fp32, in
    ascending ``k`` from +0.0. Pre-reduced (dispatch carried weights): each expert rank sums its own
    experts' terms that way and rounds to bf16; the home rank sums those partials in ascending rank order.
    ``expert_output(token_x_bf16, global_expert) -> bf16 row`` is what the experts computed. Terms of experts
    on ``masked`` ranks are dropped (and a masked rank's own tokens get nothing back)."""
    t, k = inp.topk_idx.shape
    acc = torch.zeros(t, inp.x.shape[1], dtype=torch.float32)
    if rank in masked:
        return acc.to(torch.bfloat16)  # a masked rank's tokens reached no expert (receivers drop them)
    for tok in range(t):
        if pre_reduced:
            partial = {}
            for kk in range(k):
                e = int(inp.topk_idx[tok, kk])
                if e < 0:
                    continue
                r = int(rank_of(torch.tensor(e), num_experts, num_ranks))
                if r in masked:
                    continue
                term = inp.topk_weights[tok, kk] * expert_output(inp.x[tok], e).float()
                partial[r] = partial.get(r, torch.zeros_like(term)) + term
            for r in sorted(partial):
                acc[tok] = acc[tok] + partial[r].to(torch.bfloat16).float()
        else:
            for kk in range(k):
                e = int(inp.topk_idx[tok, kk])
                if e < 0 or int(rank_of(torch.tensor(e), num_experts, num_ranks)) in masked:
                    continue
                acc[tok] = acc[tok] + inp.topk_weights[tok, kk] * expert_output(inp.x[tok], e).float()
    return acc.to(torch.bfloat16)


class ExpertFn:
    """A deterministic stand-in for expert ``e``: ``bf16(x * (e + 1) / 8)`` (exact in bf16 for small e)."""

    def __call__(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return (x.float() * ((expert + 1) / 8)).to(torch.bfloat16)
