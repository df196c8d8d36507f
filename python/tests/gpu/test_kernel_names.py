"""Kernels found where DeepEP's are found: code that times DeepEP with the torch profiler (DeepEP's
``bench_kineto``) looks for exactly one row of the kineto kernel table containing ``dispatch`` / ``combine``,
and for the chrome-trace events whose name contains ``::dispatch`` / ``::combine``. This profiles one
dispatch + combine of each mode on this rank's GPU and applies those two rules. CUDA backend only: on the
host backend there are no kernels to find (skipped).

The same names are checked without a GPU, from the compiled kernels' symbols, by
``crates/moelink-kernels/tests/compile_all.rs`` (profilers_find_one_dispatch_and_one_combine_kernel_per_mode).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, List

import pytest
import torch

from checks import HT_SMALL, LL
from reference import make_inputs

EXPECTED = {
    "high-throughput": ("moelink::intranode::dispatch(HtDispatchArgs)", "moelink::intranode::combine(HtCombineArgs)"),
    "low-latency": ("moelink::low_latency::dispatch(LlDispatchArgs)", "moelink::low_latency::combine(LlCombineArgs)"),
}


def profile(fn: Callable[[], None]):
    fn()  # compiles and loads the kernels outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events: List[str] = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    return table, events


def check_mode(mode: str, table: List[str], events: List[str]) -> None:
    for word, want in zip(("dispatch", "combine"), EXPECTED[mode]):
        rows = [line for line in table if word in line]
        assert len(rows) == 1, f"{mode}: {len(rows)} kernel-table rows contain {word!r}: {rows}"
        assert want in rows[0], f"{mode}: the {word!r} row is {rows[0]!r}, expected {want!r}"
        named = sorted({name for name in events if f"::{word}" in name})
        assert named == [want], f"{mode}: chrome-trace events containing '::{word}': {named}"


def test_profiler_finds_one_dispatch_and_one_combine_kernel_per_mode(env, ht_buffer, ll_buffer):
    if not env.cuda:
        pytest.skip("kernel names: the host backend launches no kernels")
    r, nr = env.rank, env.num_ranks

    e_ht = HT_SMALL.num_experts(nr)
    ht = make_inputs(r, HT_SMALL.tokens, HT_SMALL.hidden, e_ht, HT_SMALL.topk, seed=31)

    def ht_step() -> None:
        idx = env.to(ht.topk_idx)
        per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e_ht)
        recv_x, _, recv_w, _, handle, _ = ht_buffer.dispatch(
            env.to(ht.x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=env.to(ht.topk_weights))
        ht_buffer.combine(recv_x, handle, topk_weights=recv_w)

    e_ll = LL.num_experts(nr)
    ll = make_inputs(r, LL.tokens, LL.hidden, e_ll, LL.topk, seed=32)

    def ll_step() -> None:
        idx = env.to(ll.topk_idx)
        recv_x, _, handle, _, _ = ll_buffer.low_latency_dispatch(env.to(ll.x), idx, LL.tokens, e_ll, use_fp8=False)
        ll_buffer.low_latency_combine(recv_x, idx, env.to(ll.topk_weights), handle)

    for mode, step in (("high-throughput", ht_step), ("low-latency", ll_step)):
        table, events = profile(step)
        check_mode(mode, table, events)
