"""Runs last: a rank that never joins makes the others' call fail with moelink.TimeoutError naming it,
instead of hanging: on the CUDA backend through the kernels' deadline, on the host backend (gloo) through the
deadline of every exchange in the torch group's store — also when the rank raised on its own bad input and
went on to its next call."""

from __future__ import annotations

import os
import time

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


def _host_buffer(env, timeout_ms: int) -> moelink.Buffer:
    old = os.environ.get("MOELINK_TIMEOUT_MS")
    os.environ["MOELINK_TIMEOUT_MS"] = str(timeout_ms)
    try:
        return moelink.Buffer(env.group, num_nvl_bytes=moelink.Buffer.get_dispatch_config(env.num_ranks)
                              .get_nvl_buffer_size_hint(512 * 2, env.num_ranks), explicitly_destroy=True)
    finally:
        if old is None:
            os.environ.pop("MOELINK_TIMEOUT_MS")
        else:
            os.environ["MOELINK_TIMEOUT_MS"] = old


def _dispatch(buf: moelink.Buffer, env, x) -> None:
    e = 2 * env.num_ranks
    topk_idx = (torch.arange(8 * 2).reshape(8, 2) + env.rank) % e
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)
    buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)


@pytest.mark.parametrize("fault", ["never_arrives", "bad_input_then_next_call"])
def test_host_missing_rank_is_a_timeout_naming_it(env, fault):
    if env.cuda:
        pytest.skip("the host backend's exchange deadline (MOELINK_BACKEND=host)")
    deadline_ms = 1000
    buf = _host_buffer(env, deadline_ms)
    faulty = env.num_ranks - 1
    x = torch.ones(8, 512, dtype=torch.bfloat16)
    _dispatch(buf, env, x)  # one healthy round
    start = time.monotonic()
    if env.rank == faulty and fault == "never_arrives":
        time.sleep(3 * deadline_ms / 1000)  # alive, busy elsewhere, past the others' deadline
    else:
        if env.rank == faulty:
            with pytest.raises(TypeError) as own:
                _dispatch(buf, env, x.float().numpy())  # not a tensor: refused by the Python layer
            assert own.value.argument == "x"
        with pytest.raises(moelink.TimeoutError) as info:
            _dispatch(buf, env, x)
        elapsed = time.monotonic() - start
        expected_peer = 0 if env.rank == faulty else faulty
        assert (info.value.rank, info.value.peer) == (env.rank, expected_peer), str(info.value)
        assert elapsed < deadline_ms / 1000 + 2.0, f"{elapsed:.2f} s"
        if fault == "never_arrives":
            assert elapsed >= 0.9 * deadline_ms / 1000, f"gave up after {elapsed:.2f} s"
        with pytest.raises(RuntimeError, match="unusable"):
            _dispatch(buf, env, x)
    dist.barrier()
    buf.destroy()
