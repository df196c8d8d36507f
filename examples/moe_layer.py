"""An expert-parallel MoE layer trained through moelink, checked against the same layer without expert parallelism.

    torchrun --nproc_per_node=4 examples/moe_layer.py               # one GPU per rank (CUDA backend)
    MOELINK_BACKEND=host torchrun --nproc_per_node=2 examples/moe_layer.py   # CPU tensors, gloo, host backend

The layer: router (linear + softmax + top-k, weights renormalised) -> dispatch -> one MLP per expert (each rank
holds E/R of them) -> combine. ``dispatch`` and ``combine`` are ``torch.autograd.Function``s with DeepEP's
backward pattern:

- dispatch backward = ``combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights)``;
- combine backward = ``dispatch(grad_combined_x, handle=handle)`` (a cached dispatch).

Every rank also computes the whole layer for the tokens of all ranks on its own device, without expert
parallelism (all parameters are seeded identically everywhere), and compares the forward output and the
gradients of the input, the router and its own experts at bf16 tolerance. Prints PASS or FAIL per check.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import moelink

TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOPK = 64, 256, 512, 4, 4


class Dispatch(torch.autograd.Function):
    """Sends tokens to their experts' ranks; backward combines the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor, buffer: moelink.Buffer,
                num_experts: int, state: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        ctx.buffer, ctx.handle = buffer, handle
        state["handle"] = handle  # combine needs it
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx: Any, grad_recv_x: torch.Tensor, grad_recv_w: Optional[torch.Tensor], _: Any) -> Tuple[Any, ...]:
        if grad_recv_w is None:
            grad_recv_w = torch.zeros(grad_recv_x.shape[0], TOPK, dtype=torch.float32, device=grad_recv_x.device)
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(), ctx.handle,
                                               topk_weights=grad_recv_w.float().contiguous())
        return grad_x, grad_w, None, None, None, None


class Combine(torch.autograd.Function):
    """Sums expert outputs back onto the tokens' ranks; backward is a cached dispatch of the gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, buffer: moelink.Buffer, state: Dict[str, Any]) -> torch.Tensor:
        ctx.buffer, ctx.handle = buffer, state["handle"]
        combined, _, _ = buffer.combine(y, state["handle"])
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        grad_y, _, _, _, _, _ = ctx.buffer.dispatch(grad.to(torch.bfloat16).contiguous(), handle=ctx.handle)
        return grad_y, None, None


class Params:
    """The layer's parameters, identical on every rank (seeded): router [H, E], experts' W1 [E, H, F], W2 [E, F, H]."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(1234)
        self.router = (torch.randn(HIDDEN, num_experts, generator=g) / HIDDEN ** 0.5).to(device).requires_grad_()
        self.w1 = (torch.randn(num_experts, HIDDEN, FFN, generator=g) / HIDDEN ** 0.5).to(device).requires_grad_()
        self.w2 = (torch.randn(num_experts, FFN, HIDDEN, generator=g) / FFN ** 0.5).to(device).requires_grad_()


def route(x: torch.Tensor, router: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(x.float() @ router, dim=-1)
    weights, idx = probs.topk(TOPK, dim=-1)
    return weights / weights.sum(-1, keepdim=True), idx


def expert(x: torch.Tensor, p: Params, e: int) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() @ p.w1[e]) @ p.w2[e]


def ep_forward(x: torch.Tensor, p: Params, buffer: moelink.Buffer, rank: int, num_experts: int) -> torch.Tensor:
    """The expert-parallel layer: this rank's experts run on the tokens dispatched to it."""
    weights, idx = route(x, p.router)
    state: Dict[str, Any] = {}
    recv_x, recv_w, recv_idx = Dispatch.apply(x, weights, idx, buffer, num_experts, state)
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=x.device)
    for local in range(EXPERTS_PER_RANK):
        rows, slot = torch.nonzero(recv_idx == local, as_tuple=True)
        if rows.numel():
            out = expert(recv_x[rows], p, rank * EXPERTS_PER_RANK + local) * recv_w[rows, slot].unsqueeze(1)
            y = y.index_add(0, rows, out)
    return Combine.apply(y.to(torch.bfloat16), buffer, state)


def dense_forward(x: torch.Tensor, p: Params) -> torch.Tensor:
    """The same layer on one device, every expert local."""
    weights, idx = route(x, p.router)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(p.w1.shape[0]):
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        if rows.numel():
            y = y.index_add(0, rows, expert(x[rows], p, e) * weights[rows, slot].unsqueeze(1))
    return y.to(torch.bfloat16)


def inputs(rank: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    grad_out = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    return x.to(device), grad_out.to(device)


def check(name: str, got: torch.Tensor, want: torch.Tensor, rank: int, rtol: float = 3e-2, atol: float = 3e-2) -> bool:
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
        ok, why = True, ""
    except AssertionError as e:
        ok, why = False, str(e).splitlines()[0] if str(e) else "mismatch"
    if rank == 0 or not ok:
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {name}{': ' + why if why else ''}", flush=True)
    return ok


def main() -> int:
    backend = os.environ.get("MOELINK_BACKEND", "auto")
    if backend not in ("auto", "host", "cuda"):
        raise SystemExit(f"MOELINK_BACKEND={backend!r}: expected auto, host or cuda")
    use_cuda = backend != "host" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        os.environ["MOELINK_BACKEND"] = "host"
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    num_experts = EXPERTS_PER_RANK * num_ranks
    buffer = moelink.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20)

    # Expert parallel: this rank's tokens, all ranks' experts through moelink.
    p = Params(num_experts, device)
    x, grad_out = inputs(rank, device)
    x.requires_grad_()
    out = ep_forward(x, p, buffer, rank, num_experts)
    out.backward(grad_out)
    router_grad = p.router.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is the sum over ranks

    # Reference: every rank's tokens through the dense layer on this device.
    q = Params(num_experts, device)
    all_x, all_grad = zip(*(inputs(r, device) for r in range(num_ranks)), strict=True)
    xs = [t.clone().requires_grad_() for t in all_x]
    ref = dense_forward(torch.cat(xs), q)
    ref.backward(torch.cat(all_grad))

    mine = slice(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    results: List[bool] = [
        check("forward output", out, ref[rank * TOKENS:(rank + 1) * TOKENS], rank),
        check("grad input", x.grad, xs[rank].grad, rank),
        check("grad router (all-reduced)", router_grad, q.router.grad, rank),
        check("grad expert W1 (local experts)", p.w1.grad[mine], q.w1.grad[mine], rank),
        check("grad expert W2 (local experts)", p.w2.grad[mine], q.w2.grad[mine], rank),
    ]
    every: List[Any] = [None] * num_ranks
    dist.all_gather_object(every, all(results))
    passed = all(every)
    if rank == 0:
        print(f"{'PASS' if passed else 'FAIL'}: MoE layer over moelink ({num_ranks} ranks, {buffer.backend} backend, "
              f"{TOKENS} tokens/rank, hidden {HIDDEN}, top-{TOPK} of {num_experts})", flush=True)
    buffer.destroy()
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
