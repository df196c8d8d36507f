"""Runs last: a rank that never joins makes the others' low-latency call fail with moelink.TimeoutError
naming it, instead of hanging (CUDA backend; the host backend's waits are the group's own)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import moelink
from reference import make_inputs


def test_missing_rank_is_a_timeout_naming_it(env):
    if not env.cuda:
        pytest.skip("kernel deadlines are a CUDA-backend feature")
    nr = env.num_ranks
    e = 8 * nr
    old = os.environ.get("MOELINK_TIMEOUT_MS")
    os.environ["MOELINK_TIMEOUT_MS"] = "2000"
    try:
        buf = moelink.Buffer(env.group, num_rdma_bytes=moelink.Buffer.get_low_latency_rdma_size_hint(16, 512, nr, e),
                             low_latency_mode=True)
    finally:
        if old is None:
            os.environ.pop("MOELINK_TIMEOUT_MS")
        else:
            os.environ["MOELINK_TIMEOUT_MS"] = old
    inp = make_inputs(env.rank, 8, 512, e, 2, 40, drop=0.0)
    inp.topk_idx[:, 0] = 0  # every token also goes to rank 0, so every rank waits for it
    if env.rank != 0:
        raised = None
        try:
            buf.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), 16, e, use_fp8=False)
            torch.cuda.synchronize()
            # Asynchronous operations report kernel errors at the next call.
            buf.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), 16, e, use_fp8=False)
            torch.cuda.synchronize()
        except moelink.TimeoutError as err:
            raised = err
        assert raised is not None, "the call should have failed with moelink.TimeoutError"
        assert isinstance(raised, RuntimeError)
        assert raised.rank == env.rank and raised.peer in (0, None) and isinstance(raised.phase, str)
    dist.barrier()
    buf.destroy()
