"""Shapes shared by the suite and the comparison every test uses.

Each distinct (hidden, top-k, FP8) combination JIT-compiles a kernel variant on the GPU, so the suite uses
few: one small high-throughput shape for the API's modes, one realistic high-throughput shape (DeepSeek's
hidden 7168, top-8 of 256) and one realistic low-latency shape for everything low-latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    tokens: int  # per rank (ranks add a few so that counts differ); LL: num_max_dispatch_tokens_per_rank
    hidden: int
    topk: int
    experts_per_rank: int = 8
    experts: int = 0  # fixed expert count (0: experts_per_rank per rank)

    def num_experts(self, num_ranks: int) -> int:
        return self.experts or self.experts_per_rank * num_ranks


HT_SMALL = Shape(tokens=64, hidden=256, topk=4)
HT_REAL = Shape(tokens=256, hidden=7168, topk=8, experts=256)
LL = Shape(tokens=32, hidden=7168, topk=8)

HT_NVL_BYTES = 256 << 20
# Across nodes (MOELINK_TOPOLOGY), the high-throughput buffer holds rounds of this many tokens of HT_REAL rows:
# HT_REAL's calls run several rounds.
HT_ROUND_TOKENS = 64


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality (FP8 compared as bytes), with the first differing rows in the message."""
    got = got.detach().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want) if got.dtype != torch.bool else (got ^ want)
        if bad.dim() > 1:
            bad = bad.flatten(1).any(1)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} rows differ "
                             f"(first: {torch.nonzero(bad).flatten()[:5].tolist()})")
