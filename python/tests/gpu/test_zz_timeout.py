"""Runs last: a rank that never joins makes the others' low-latency call fail with moelink.TimeoutError
naming it, instead of hanging (CUDA backend; the host backend's waits are the group's own)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import moelink
from checks import LL
from reference import make_inputs


def test_missing_rank_is_a_timeout_naming_it(env):
    if not env.cuda:
        pytest.skip("kernel deadlines are a CUDA-backend feature")
    nr = env.num_ranks
    e = LL.num_experts(nr)
    t_max = 16
    old = os.environ.get("MOELINK_TIMEOUT_MS")
    os.environ["MOELINK_TIMEOUT_MS"] = "1000"
    try:
        # The low-latency shape of test_ll.py: its kernel variant is compiled already.
        buf = moelink.Buffer(env.group, num_rdma_bytes=moelink.Buffer.get_low_latency_rdma_size_hint(t_max, LL.hidden, nr, e),
                             low_latency_mode=True)
    finally:
        if old is None:
            os.environ.pop("MOELINK_TIMEOUT_MS")
        else:
            os.environ["MOELINK_TIMEOUT_MS"] = old
    inp = make_inputs(env.rank, 8, LL.hidden, e, LL.topk, 40, drop=0.0)
    # Every token also goes to expert 0 (on rank 0), so every rank waits for rank 0; ids stay distinct.
    inp.topk_idx[inp.topk_idx == 0] = -1
    inp.topk_idx[:, 0] = 0
    if env.rank != 0:
        raised = None
        try:
            buf.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), t_max, e, use_fp8=False)
            torch.cuda.synchronize()
            # Asynchronous operations report kernel errors at the next call.
            buf.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), t_max, e, use_fp8=False)
            torch.cuda.synchronize()
        except moelink.TimeoutError as err:
            raised = err
        assert raised is not None, "the call should have failed with moelink.TimeoutError"
        assert isinstance(raised, RuntimeError)
        assert raised.rank == env.rank and raised.peer in (0, None) and isinstance(raised.phase, str)
    dist.barrier()
    buf.destroy()
