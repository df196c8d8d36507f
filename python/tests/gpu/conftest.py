"""Multi-process test session: run under torchrun, one process per rank.

    torchrun --nproc_per_node=4 --local-ranks-filter 0 -m pytest -x -q python/tests/gpu

On a GPU machine every rank uses ``cuda:LOCAL_RANK`` with an NCCL group and moelink's CUDA backend; with more
ranks than GPUs (processes sharing a GPU under CUDA MPS) the ranks share GPUs round-robin over a gloo group.
``MOELINK_TOPOLOGY=2x2`` (and ``MOELINK_TRANSPORT``) runs the tests on virtual nodes: low latency across
nodes, and high throughput with DeepEP's internode API (per-node counts, the 10-element handle; the buffer then
gets ``num_rdma_bytes`` for rounds of ``HT_ROUND_TOKENS`` tokens). With
``MOELINK_BACKEND=host`` (or without a GPU) the same tests run on CPU tensors over gloo on the host backend,
which checks the Python layer anywhere.

Every test body is collective: all ranks run the same tests in the same order. A failure on one rank is
reported on every rank (``pytest_runtest_call`` below), so the others do not run ahead into the next test's
collectives and hang.

A test that runs longer than ``MOELINK_TEST_DEADLINE_S`` seconds (default 60; 0 = no limit) is taken for a
hang: the rank prints every thread's Python stack and exits, which makes torchrun stop the others. A hung
suite then costs one deadline, not the caller's whole time limit, and says where it stood.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

import moelink
from checks import HT_NVL_BYTES, HT_REAL, HT_ROUND_TOKENS, LL


def _init() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        pytest.exit("python/tests/gpu runs under torchrun (e.g. torchrun --nproc_per_node=2 -m pytest python/tests/gpu)", 2)
    use_cuda = torch.cuda.is_available() and os.environ.get("MOELINK_BACKEND", "auto") != "host"
    # More ranks than GPUs (several processes on one GPU, under CUDA MPS): ranks share GPUs round-robin and
    # the group is gloo, since NCCL refuses two ranks on one GPU.
    shared = use_cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda and not shared else "gloo", timeout=datetime.timedelta(seconds=300))
    if not use_cuda:
        os.environ["MOELINK_BACKEND"] = "host"


_init()


class Env:
    """This rank's view of the session."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.num_ranks = dist.get_world_size()
        self.cuda = os.environ.get("MOELINK_BACKEND") != "host"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.group = dist.group.WORLD
        # The buffers' topology: MOELINK_TOPOLOGY (virtual nodes), else one node (the machines this suite runs
        # on have one host).
        spec = os.environ.get("MOELINK_TOPOLOGY", "").strip()
        self.num_nodes = int(spec.split("x")[0]) if spec else 1
        self.ranks_per_node = self.num_ranks // self.num_nodes
        self.internode = self.num_nodes > 1
        # High-throughput buffer sizes: across nodes the RDMA parts too, for rounds of HT_ROUND_TOKENS tokens of
        # the largest rows the suite sends (HT_REAL), so that its calls run several rounds.
        self.ht_nvl_bytes, self.ht_rdma_bytes = HT_NVL_BYTES, 0
        if self.internode:
            nvl, self.ht_rdma_bytes = moelink._native.ht_internode_bytes_needed(
                f"{self.num_nodes}x{self.ranks_per_node}", HT_ROUND_TOKENS, HT_REAL.hidden, HT_REAL.topk, False)
            self.ht_nvl_bytes = max(HT_NVL_BYTES, nvl)

    def to(self, t: Any) -> Any:
        return t.to(self.device) if isinstance(t, torch.Tensor) else t


@pytest.fixture(scope="session")
def env() -> Env:
    return Env()


@pytest.fixture(scope="session")
def ht_buffer(env: Env) -> Iterator[moelink.Buffer]:
    buf = moelink.Buffer(env.group, num_nvl_bytes=env.ht_nvl_bytes, num_rdma_bytes=env.ht_rdma_bytes,
                         explicitly_destroy=True)
    assert buf.topology == (env.num_nodes, env.ranks_per_node), "MOELINK_TOPOLOGY reaches the buffer"
    yield buf
    buf.destroy()


@pytest.fixture(scope="session")
def ll_buffer(env: Env) -> Iterator[moelink.Buffer]:
    hint = moelink.Buffer.get_low_latency_rdma_size_hint(LL.tokens, LL.hidden, env.num_ranks, LL.num_experts(env.num_ranks))
    buf = moelink.Buffer(env.group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    yield buf
    buf.destroy()


def _status(item: Any, excinfo: Any) -> str:
    if excinfo is None or isinstance(excinfo[1], pytest.skip.Exception):
        return ""
    return f"{excinfo[0].__name__}: {str(excinfo[1]).splitlines()[0] if str(excinfo[1]) else ''}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    outcome = yield
    mine = _status(item, outcome.excinfo)
    # One small all-reduce per test; the messages are gathered only when some rank failed.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failed = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not int(failed.item()):
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    others = [f"rank {r}: {s}" for r, s in enumerate(every) if s and r != dist.get_rank()]
    if others and not mine:
        outcome.force_exception(AssertionError("failed on another rank: " + "; ".join(others)))


_DEADLINE_S = float(os.environ.get("MOELINK_TEST_DEADLINE_S", "60"))
_stderr_fd = -1


def pytest_configure(config: Any) -> None:
    # The real stderr, kept before pytest's capture redirects fd 2 (a dump into the capture would be lost).
    global _stderr_fd
    _stderr_fd = os.dup(sys.stderr.fileno())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    if _DEADLINE_S > 0 and _stderr_fd >= 0:
        faulthandler.dump_traceback_later(_DEADLINE_S, exit=True, file=_stderr_fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _DEADLINE_S > 0 and _stderr_fd >= 0:
        faulthandler.dump_traceback_later(_DEADLINE_S, exit=True, file=_stderr_fd)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
