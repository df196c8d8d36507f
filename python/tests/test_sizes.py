"""Sizes the machine cannot hold are refused before allocation, naming the argument and the bytes needed
(never torch's out-of-memory error, which names no argument).

``moelink.Buffer`` allocates every output with torch; before it does, ``Buffer._alloc`` checks that the
outputs an argument sizes fit the device's memory. Here, without torch: that check, and ``Buffer._alloc``
as ``Buffer.dispatch`` calls it for a no-sync dispatch planned by the host backend whose ``num_worst_tokens``
rows a small machine cannot hold. ``python/tests/gpu`` runs the same through ``moelink.Buffer`` with torch
(``test_ht.py``, ``test_ll.py``; on the host backend with ``MOELINK_BACKEND=host`` under torchrun).
"""

from __future__ import annotations

from typing import Any, List

import numpy as np
import pytest

from helpers import ThreadGroup, arg, bf16_bits, run_ranks
from moelink import _args
from moelink.buffer import Buffer
from test_native import in_rank, inputs, new_buffer

I32_MAX = (1 << 31) - 1


class _Dtype:
    """Stands in for a torch dtype: its name (``str`` gives ``torch.NAME``) and ``itemsize``."""

    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __str__(self) -> str:
        return f"torch.{self.name}"


class _Machine:
    """What ``Buffer._alloc`` uses of a buffer (``rank``, ``_memory``, ``_empty``), on a machine of ``memory``
    bytes; ``_empty`` records what would be allocated."""

    def __init__(self, rank: int, memory: int) -> None:
        self.rank, self._memory = rank, (memory, "memory on this machine")
        self.allocated: List[Any] = []

    def _empty(self, shape, dtype) -> Any:
        self.allocated.append((tuple(shape), str(dtype)))
        return self.allocated[-1]


def test_the_check_names_the_argument_and_the_bytes():
    rows = 1 << 31
    outputs = [("recv_x", (rows, 7168), "bfloat16", 2), ("recv_topk_idx", (rows, 8), "int64", 8)]
    need = rows * 7168 * 2 + rows * 8 * 8
    with pytest.raises(ValueError) as info:
        _args.check_fits("num_worst_tokens", 3, outputs, 1 << 40, "memory on this machine")
    e = info.value
    assert (e.argument, e.rank) == ("num_worst_tokens", 3)
    assert str(e).startswith("invalid argument `num_worst_tokens` on rank 3: the outputs it sizes need "
                             f"{need} bytes (recv_x bfloat16 [{rows}, 7168], recv_topk_idx int64 [{rows}, 8]), "
                             f"more than the {1 << 40} bytes of memory on this machine"), str(e)
    _args.check_fits("x", 0, outputs, need, "memory on this machine")  # exactly what there is
    _args.check_fits("x", 0, outputs, None, "an unknown device")  # unknown memory: no check
    memory = _args.host_memory_bytes()
    assert memory is not None and memory > 1 << 20


def test_buffer_alloc_checks_before_it_allocates():
    bf16, f32, i32 = _Dtype("bfloat16", 2), _Dtype("float32", 4), _Dtype("int32", 4)
    machine = _Machine(1, memory=1 << 20)
    with pytest.raises(ValueError) as info:
        Buffer._alloc(machine, "num_experts", ("num_tokens_per_expert", (1 << 40,), i32))
    assert info.value.argument == "num_experts" and f"{4 << 40} bytes" in str(info.value)
    # Refused as a whole: the first output would fit, the two together do not; nothing was allocated.
    with pytest.raises(ValueError):
        Buffer._alloc(machine, "x", ("recv_x", (256, 1024), bf16), ("recv_x_scales", (256, 1024), f32))
    assert machine.allocated == []
    got = Buffer._alloc(machine, "x", ("recv_x", (4, 8), bf16), None, ("recv_src_idx", (4,), i32))
    assert got == [((4, 8), "torch.bfloat16"), None, ((4,), "torch.int32")]


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_no_sync_dispatch_rows_a_machine_cannot_hold(num_ranks):
    """The host backend plans a no-sync dispatch of ``num_worst_tokens = 2^31 - 1`` rows (the most it
    accepts); the outputs ``Buffer.dispatch`` would allocate for them are refused, naming the argument."""
    e, k = 4 * num_ranks, 3
    every = [inputs(r, e, k, seed=2) for r in range(num_ranks)]

    def rank_fn(g: ThreadGroup) -> bool:
        r = g.rank()
        buf = new_buffer(g)
        inp = every[r]
        t = inp["x"].shape[0]
        per_rank, per_expert, itr = np.zeros(num_ranks, np.int32), np.zeros(e, np.int32), np.zeros((t, num_ranks), bool)
        buf.get_dispatch_layout_into(arg(inp["idx"]), e, arg(per_rank), arg(per_expert), arg(itr))
        assert (itr == in_rank(inp["idx"], e, num_ranks)).all()
        plan = buf.prepare_dispatch(arg(bf16_bits(inp["x"]), "bfloat16"), num_tokens_per_rank=arg(per_rank),
                                    num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr),
                                    topk_idx=arg(inp["idx"]), topk_weights=arg(inp["w"]), num_worst_tokens=I32_MAX)
        n = plan.num_recv_rows
        assert n == I32_MAX and plan.has_topk
        machine = _Machine(r, memory=1 << 30)
        with pytest.raises(ValueError) as info:
            Buffer._alloc(machine, "num_worst_tokens", ("recv_x", (n, plan.hidden), _Dtype("bfloat16", 2)),
                          ("recv_topk_idx", (n, plan.topk), _Dtype("int64", 8)),
                          ("recv_topk_weights", (n, plan.topk), _Dtype("float32", 4)),
                          ("recv_src_idx", (n,), _Dtype("int32", 4)))
        need = n * (plan.hidden * 2 + plan.topk * 12 + 4)
        assert info.value.argument == "num_worst_tokens" and info.value.rank == r
        assert f"need {need} bytes" in str(info.value) and machine.allocated == []
        return True

    assert all(run_ranks(num_ranks, rank_fn))
