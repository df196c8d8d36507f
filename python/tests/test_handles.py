"""DeepEP's handle data on the host backend, without torch: the native module's handle outputs
(``rank_prefix_matrix``, ``recv_src_idx``; ``src_info``, ``layout_range``) in every dispatch mode, each computed
here from the routing with plain numpy and compared exactly, the received rows checked through them; and the
tuple behaviour of the Python handle classes (``python/tests/gpu/test_handles.py`` runs the same checks
through ``moelink.Buffer`` with torch).
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np
import pytest

from helpers import ThreadGroup, arg, bf16_bits, bf16_values, run_ranks
from moelink import buffer as pybuffer
from test_native import H, in_rank, inputs, ll_alloc, new_buffer

INT_MASK = (1 << 32) - 1


# ------------------------------------------------------------------------------------- high-throughput


def want_rank_prefix(every: Sequence[dict], e: int, nr: int) -> np.ndarray:
    counts = np.stack([in_rank(inp["idx"], e, nr).sum(0) for inp in every])  # [src, dst]
    return counts.cumsum(0).astype(np.int32)


def want_src_idx(every: Sequence[dict], e: int, nr: int, me: int) -> np.ndarray:
    return np.concatenate([np.nonzero(in_rank(inp["idx"], e, nr)[:, me])[0] for inp in every]).astype(np.int32)


def ht_call(buf, inp, e: int, *, handle=None, worst: int = 0, topk: bool = True, fp8: bool = False):
    """Prepare + dispatch_into with the handle outputs; returns (recv_x, rank_prefix, recv_src_idx, handle)."""
    r, (t, hidden) = buf.num_ranks, inp["x"].shape
    if fp8:
        x = (np.abs(inp["x"]).astype(np.uint8) & 0x7E).astype(np.uint8)  # some e4m3 byte per value
        scales = (np.arange(t * (hidden // 128), dtype=np.float32).reshape(hidden // 128, t).T + 1) / 8  # column-major
        xa, sa = arg(x, "float8_e4m3fn"), arg(scales)
    else:
        xa, sa = arg(bf16_bits(inp["x"]), "bfloat16"), None
    kw = {}
    if handle is None:
        per_rank, per_expert, itr = np.zeros(r, np.int32), np.zeros(e, np.int32), np.zeros((t, r), bool)
        buf.get_dispatch_layout_into(arg(inp["idx"]), e, arg(per_rank), arg(per_expert), arg(itr))
        kw = dict(num_tokens_per_rank=arg(per_rank), num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr))
        if topk:
            kw.update(topk_idx=arg(inp["idx"]), topk_weights=arg(inp["w"]))
    plan = buf.prepare_dispatch(xa, x_scales=sa, handle=handle, num_worst_tokens=worst, **kw)
    n = plan.num_recv_rows
    recv_x = np.zeros((n, hidden), np.uint8 if fp8 else np.uint16)
    recv_s = np.zeros((n, hidden // 128), np.float32) if fp8 else None
    recv_idx = np.zeros((n, plan.topk), np.int64) if plan.has_topk else None
    recv_w = np.zeros((n, plan.topk), np.float32) if plan.has_topk else None
    rank_prefix = np.full((r, r), -5, np.int32)
    src_idx = np.full(n, -5, np.int32)
    h = buf.dispatch_into(plan, arg(recv_x, "float8_e4m3fn" if fp8 else "bfloat16"), None if recv_s is None else arg(recv_s),
                          None if recv_idx is None else arg(recv_idx), None if recv_w is None else arg(recv_w),
                          rank_prefix_matrix=arg(rank_prefix), recv_src_idx=arg(src_idx))
    return recv_x, rank_prefix, src_idx, h


@pytest.mark.parametrize("mode", ["bf16", "bf16-no-topk", "fp8", "fp8-no-topk"])
@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_ht_handle_outputs_every_mode(mode, num_ranks):
    """Fresh (CPU-sync and, with top-k, no-sync) and cached dispatch: rank_prefix_matrix and recv_src_idx exact,
    and the rows between the matrix's boundaries are the tokens recv_src_idx names on that source."""
    nr, e, k = num_ranks, 4 * num_ranks, 3
    fp8, topk = mode.startswith("fp8"), not mode.endswith("no-topk")
    every = [inputs(r, e, k, seed=21) for r in range(nr)]
    for inp in every:  # hidden 128 (FP8 scales cover 128 channels)
        inp["x"] = np.repeat(inp["x"], 128 // H, axis=1)

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        buf = new_buffer(g)
        want_matrix, want_src = want_rank_prefix(every, e, nr), want_src_idx(every, e, nr, me)
        n = want_src.size

        def check(recv_x, rank_prefix, src_idx, what):
            assert (rank_prefix == want_matrix).all(), f"rank_prefix_matrix ({what})"
            assert (src_idx[:n] == want_src).all(), f"recv_src_idx ({what})"
            start = 0
            for s in range(nr):
                end = int(rank_prefix[s, me])
                want_rows = every[s]["x"][src_idx[start:end]]
                got = recv_x[start:end]
                if fp8:
                    assert (got == (np.abs(want_rows).astype(np.uint8) & 0x7E)).all(), f"rows from rank {s} ({what})"
                else:
                    assert (bf16_values(got) == want_rows).all(), f"rows from rank {s} ({what})"
                start = end
            assert start == n

        recv_x, rank_prefix, src_idx, handle = ht_call(buf, every[me], e, topk=topk, fp8=fp8)
        check(recv_x, rank_prefix, src_idx, "fresh")
        cached = ht_call(buf, every[me], e, handle=handle, fp8=fp8)
        check(*cached[:3], "cached")
        if topk:
            worst = sum(inp["x"].shape[0] for inp in every) + 3
            recv_x, rank_prefix, src_idx, _ = ht_call(buf, every[me], e, worst=worst, fp8=fp8)
            assert src_idx.shape == (worst,) and (src_idx[n:] == -5).all(), "rows past the count are left as they are"
            check(recv_x, rank_prefix, src_idx, "num_worst_tokens")
        return True

    assert all(run_ranks(nr, rank_fn))


def test_ht_handle_outputs_are_validated():
    def rank_fn(g: ThreadGroup):
        buf = new_buffer(g)
        inp = inputs(g.rank(), 8, 2, seed=22)
        x = arg(bf16_bits(inp["x"]), "bfloat16")
        t = inp["x"].shape[0]
        per_rank, per_expert, itr = np.zeros(2, np.int32), np.zeros(8, np.int32), np.zeros((t, 2), bool)
        buf.get_dispatch_layout_into(arg(inp["idx"]), 8, arg(per_rank), arg(per_expert), arg(itr))
        lay = dict(num_tokens_per_rank=arg(per_rank), num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr))
        plan = buf.prepare_dispatch(x, **lay)
        rx = arg(np.zeros((plan.num_recv_rows, H), np.uint16), "bfloat16")
        with pytest.raises(ValueError) as info:
            buf.dispatch_into(plan, rx, rank_prefix_matrix=arg(np.zeros((2, 3), np.int32)))
        assert info.value.argument == "rank_prefix_matrix"
        plan = buf.prepare_dispatch(x, **lay)  # a refused plan is spent: prepare again (collective)
        with pytest.raises(TypeError) as info:
            buf.dispatch_into(plan, rx, recv_src_idx=arg(np.zeros(plan.num_recv_rows, np.int64)))
        assert info.value.argument == "recv_src_idx"
        return True

    assert all(run_ranks(2, rank_fn))


# ------------------------------------------------------------------------------------- low-latency


def want_ll(every: Sequence[dict], e: int, nr: int, me: int, masked: Sequence[int] = ()):
    """Per local expert: the (source rank, token) of each row in order, and layout_range [E_local, R]."""
    el = e // nr
    rows: List[list] = []
    ranges = np.zeros((el, nr), np.int64)
    for le in range(el):
        ge = me * el + le
        src = [(s, t) for s in range(nr) if s not in masked for t in range(every[s]["x"].shape[0]) if ge in every[s]["idx"][t]]
        rows.append(src)
        begin = 0
        for j in range(nr):
            count = sum(1 for s, _ in src if s == j)
            ranges[le, j] = (begin << 32) | count
            begin += count
    return rows, ranges


@pytest.mark.parametrize("mode", ["bf16", "fp8", "round", "ue8m0"])
@pytest.mark.parametrize("use_hook", [False, True])
def test_ll_handle_outputs_every_mode(mode, use_hook):
    nr, e, k, t_max, hidden = 3, 6, 2, 8, 512
    el, rows = e // nr, nr * t_max
    every = [inputs(r, e, k, seed=23) for r in range(nr)]
    for inp in every:  # hidden 512 (UE8M0 packs 512 channels per int32)
        inp["x"] = np.repeat(inp["x"], hidden // H, axis=1)

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        buf = new_buffer(g)
        fp8 = mode != "bf16"
        recv_x, scales, recv_count = ll_alloc(el, rows, hidden, fp8, ue8m0=mode == "ue8m0")
        src_info = np.full((el, rows), -5, np.int32)
        layout_range = np.full((el, nr), -5, np.int64)
        _, hook = buf.low_latency_dispatch_into(
            arg(bf16_bits(every[me]["x"]), "bfloat16"), arg(every[me]["idx"]), t_max, e,
            arg(recv_x, "float8_e4m3fn" if fp8 else "bfloat16"), arg(recv_count),
            recv_x_scales=None if scales is None else arg(scales), use_fp8=fp8, round_scale=mode in ("round", "ue8m0"),
            use_ue8m0=mode == "ue8m0", return_recv_hook=use_hook, src_info=arg(src_info), layout_range=arg(layout_range))
        if use_hook:
            assert (src_info == -5).all() and (layout_range == -5).all(), "the handle is written by the receive phase"
            buf.run_hook(hook)
        want_rows, want_ranges = want_ll(every, e, nr, me)
        assert (layout_range == want_ranges).all()
        for le in range(el):
            n = len(want_rows[le])
            assert recv_count[le] == n == (layout_range[le] & INT_MASK).sum()
            assert (src_info[le, :n] == [t for _, t in want_rows[le]]).all()
            assert (src_info[le, n:] == -5).all(), "rows past recv_count are left as they are"
            for j in range(nr):  # DeepEP's check: the range of rank j holds rank j's tokens
                begin, count = int(layout_range[le, j]) >> 32, int(layout_range[le, j]) & INT_MASK
                if not fp8 and count:
                    assert (bf16_values(recv_x[le, begin:begin + count]) == every[j]["x"][src_info[le, begin:begin + count]]).all()
        return True

    assert all(run_ranks(nr, rank_fn))


def test_ll_handle_outputs_with_a_masked_rank():
    nr, e, k, t_max = 3, 6, 2, 8
    el, rows = e // nr, nr * t_max
    every = [inputs(r, e, k, seed=24) for r in range(nr)]

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        buf = new_buffer(g, enable_shrink=True)
        buf.low_latency_update_mask_buffer(1, True)
        recv_x, _, recv_count = ll_alloc(el, rows, H, fp8=False)
        src_info, layout_range = np.zeros((el, rows), np.int32), np.zeros((el, nr), np.int64)
        buf.low_latency_dispatch_into(arg(bf16_bits(every[me]["x"]), "bfloat16"), arg(every[me]["idx"]), t_max, e,
                                      arg(recv_x, "bfloat16"), arg(recv_count), use_fp8=False, src_info=arg(src_info),
                                      layout_range=arg(layout_range))
        want_rows, want_ranges = want_ll(every, e, nr, me, masked=[1])
        assert (layout_range == want_ranges).all() and ((layout_range[:, 1] & INT_MASK) == 0).all()
        for le in range(el):
            assert (src_info[le, :recv_count[le]] == [t for _, t in want_rows[le]]).all()
        return True

    assert all(run_ranks(nr, rank_fn))


# ------------------------------------------------------------------------------------- the Python handles


class _Routing:
    num_tokens, num_recv_tokens, num_experts = 5, 7, 8
    hidden, num_max_dispatch_tokens_per_rank = 64, 4


class _Tensor:
    """Stands in for a torch tensor (attributes can be attached to it)."""


def test_handles_are_deepep_tuples():
    routing = _Routing()
    first = _Tensor()
    setattr(first, pybuffer._NATIVE_ATTR, routing)
    elements = (first, "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank",
                "send_head")
    h = pybuffer.DispatchHandle(elements, routing)
    assert isinstance(h, tuple) and len(h) == 6 and h[0] is first and h[-1] == "send_head" and list(h) == list(elements)
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head = h
    assert (recv_src_idx, is_token_in_rank) == ("recv_src_idx", "is_token_in_rank")
    assert (h.native, h.num_tokens, h.num_recv_tokens, h.num_experts) == (routing, 5, 7, 8)
    for same in (h, tuple(h), list(h)):
        assert pybuffer._native_of(same, pybuffer.DispatchHandle, 6, "rank_prefix_matrix", 0, "dispatch") is routing
    for bad, why in ((("x",) * 6, "was not made by moelink"), (tuple(h)[:5], "expected the handle"), (None, "NoneType")):
        with pytest.raises(TypeError) as info:
            pybuffer._native_of(bad, pybuffer.DispatchHandle, 6, "rank_prefix_matrix", 3, "dispatch")
        assert info.value.argument == "handle" and info.value.rank == 3 and why in str(info.value)

    ll = pybuffer.LowLatencyHandle((first, "layout_range", 4, 64, 8), routing)
    src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = ll
    assert isinstance(ll, tuple) and len(ll) == 5 and (num_max_dispatch_tokens_per_rank, hidden, num_experts) == (4, 64, 8)
    assert pybuffer._native_of(tuple(ll), pybuffer.LowLatencyHandle, 5, "src_info", 0, "low_latency_dispatch") is routing
