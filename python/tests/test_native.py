"""The native module on the host backend, driven with numpy arrays by ranks that are threads (no torch).

Inputs are small integers and power-of-two weights, so every reference below is exact in numpy.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import pytest

from helpers import ThreadGroup, arg, bf16_bits, bf16_values, e4m3_values, run_ranks, view_from_native
from moelink import _native

H = 64


def inputs(rank: int, num_experts: int, topk: int, seed: int, tokens: Optional[int] = None) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * seed + rank)
    t = tokens if tokens is not None else 5 + rank
    x = rng.integers(-8, 9, size=(t, H)).astype(np.float32)
    idx = np.stack([rng.permutation(num_experts)[:topk] for _ in range(t)]).astype(np.int64) if t else np.zeros((0, topk), np.int64)
    idx[rng.random((t, topk)) < 0.2] = -1
    w = rng.choice([0.25, 0.5, 1.0], size=(t, topk)).astype(np.float32)
    return {"x": x, "idx": idx, "w": w}


def in_rank(idx: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    out = np.zeros((idx.shape[0], num_ranks), dtype=bool)
    for t, row in enumerate(idx):
        for e in row[row >= 0]:
            out[t, e // (num_experts // num_ranks)] = True
    return out


def new_buffer(group: ThreadGroup, **kw) -> "_native.Buffer":
    """A host buffer with room for the small shapes of these tests (the host backend applies the CUDA
    backend's capacity rules: 64 MiB of each region is more than any of them needs)."""
    kw.setdefault("low_latency_mode", True)
    return _native.Buffer(group, 64 << 20, 64 << 20, backend="host", **kw)


def ht_dispatch(buf, inp, num_experts: int, *, fresh: bool = True, handle=None, worst: int = 0, alignment: int = 1):
    """The two-phase native dispatch: prepare, allocate with numpy, dispatch_into."""
    r = buf.num_ranks
    t = inp["x"].shape[0]
    x = bf16_bits(inp["x"])
    kw = {}
    if fresh:
        per_rank = np.zeros(r, np.int32)
        per_expert = np.zeros(num_experts, np.int32)
        itr = np.zeros((t, r), bool)
        buf.get_dispatch_layout_into(arg(inp["idx"]), num_experts, arg(per_rank), arg(per_expert), arg(itr))
        kw = dict(num_tokens_per_rank=arg(per_rank), num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr),
                  topk_idx=arg(inp["idx"]), topk_weights=arg(inp["w"]))
        layout = (per_rank, per_expert, itr)
    else:
        layout = None
    plan = buf.prepare_dispatch(arg(x, "bfloat16"), handle=handle, expert_alignment=alignment, num_worst_tokens=worst, **kw)
    n = plan.num_recv_rows
    recv_x = np.zeros((n, plan.hidden), np.uint16)
    recv_idx = np.zeros((n, plan.topk), np.int64) if plan.has_topk else None
    recv_w = np.zeros((n, plan.topk), np.float32) if plan.has_topk else None
    h = buf.dispatch_into(plan, arg(recv_x, "bfloat16"), None, None if recv_idx is None else arg(recv_idx),
                          None if recv_w is None else arg(recv_w))
    return dict(plan=plan, layout=layout, recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, handle=h)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_ht_dispatch_combine_match_numpy(num_ranks):
    e, k = 4 * num_ranks, 3
    every = [inputs(r, e, k, seed=1) for r in range(num_ranks)]

    def rank_fn(g: ThreadGroup):
        r = g.rank()
        buf = new_buffer(g)
        assert (buf.rank, buf.num_ranks, buf.backend, buf.device) == (r, num_ranks, "host", -1)
        d = ht_dispatch(buf, every[r], e, alignment=2)
        # Layout.
        per_rank, per_expert, itr = d["layout"]
        want_itr = in_rank(every[r]["idx"], e, num_ranks)
        assert (itr == want_itr).all() and (per_rank == want_itr.sum(0)).all()
        assert (per_expert == np.bincount(every[r]["idx"][every[r]["idx"] >= 0], minlength=e)).all()
        # Dispatch: rows by source rank, then token order.
        src = [(s, t) for s in range(num_ranks) for t in np.nonzero(in_rank(every[s]["idx"], e, num_ranks)[:, r])[0]]
        assert d["plan"].num_recv_tokens == len(src) == d["handle"].num_recv_tokens
        want_x = np.stack([every[s]["x"][t] for s, t in src])
        assert (bf16_values(d["recv_x"]) == want_x).all()
        el = e // num_ranks
        lo = r * el
        want_idx = np.stack([np.where((every[s]["idx"][t] >= lo) & (every[s]["idx"][t] < lo + el), every[s]["idx"][t] - lo, -1)
                             for s, t in src])
        assert (d["recv_idx"] == want_idx).all()
        want_w = np.stack([np.where(want_idx[i] >= 0, every[s]["w"][t], 0) for i, (s, t) in enumerate(src)])
        assert (d["recv_w"] == want_w).all()
        counts = [int((want_idx == le).sum()) for le in range(el)]
        assert d["plan"].num_recv_tokens_per_expert == [-(-c // 2) * 2 for c in counts]

        # Combine: every rank returns the rows it received (plus a bias); each token sums over its ranks.
        t = every[r]["x"].shape[0]
        bias = np.full((t, H), 2.0, np.float32)
        out = np.zeros((t, H), np.uint16)
        out_w = np.zeros((t, k), np.float32)
        buf.combine_into(arg(d["recv_x"], "bfloat16"), d["handle"], arg(out, "bfloat16"), topk_weights=arg(d["recv_w"]),
                         combined_topk_weights=arg(out_w), bias_0=arg(bf16_bits(bias), "bfloat16"))
        fanout = want_itr.sum(1, keepdims=True)
        assert (bf16_values(out) == every[r]["x"] * fanout + bias).all()
        assert (out_w == every[r]["w"] * (every[r]["idx"] >= 0)).all()

        # Cached dispatch re-uses the routing.
        again = ht_dispatch(buf, every[r], e, fresh=False, handle=d["handle"])
        assert (again["recv_x"] == d["recv_x"]).all() and again["recv_idx"] is None

        # No-sync mode: worst-case rows, -1 past the real count, no per-expert list.
        worst = sum(x["x"].shape[0] for x in every)
        ns = ht_dispatch(buf, every[r], e, worst=worst)
        n = len(src)
        assert ns["recv_x"].shape[0] == worst and ns["plan"].num_recv_tokens_per_expert == []
        assert (ns["recv_x"][:n] == d["recv_x"]).all() and (ns["recv_idx"][n:] == -1).all()
        return True

    assert all(run_ranks(num_ranks, rank_fn))


def ll_alloc(el: int, rows: int, hidden: int, fp8: bool, ue8m0: bool = False):
    recv_x = np.zeros((el, rows, hidden), np.uint8 if fp8 else np.uint16)
    scales = None
    if fp8:
        packs = hidden // 512 if ue8m0 else hidden // 128
        scales = np.zeros((el, packs, rows), np.int32 if ue8m0 else np.float32).transpose(0, 2, 1)
    return recv_x, scales, np.zeros(el, np.int32)


@pytest.mark.parametrize("pre_reduced", [False, True])
@pytest.mark.parametrize("use_hook", [False, True])
def test_ll_dispatch_combine_match_numpy(pre_reduced, use_hook):
    nr, e, k, t_max = 3, 6, 2, 8
    el, rows = e // nr, nr * t_max
    every = [inputs(r, e, k, seed=2) for r in range(nr)]

    def rank_fn(g: ThreadGroup):
        r = g.rank()
        buf = new_buffer(g)
        inp = every[r]
        recv_x, _, recv_count = ll_alloc(el, rows, H, fp8=False)
        stats = np.zeros(el, np.int32)
        wait = np.zeros(nr, np.int64)
        handle, hook = buf.low_latency_dispatch_into(
            arg(bf16_bits(inp["x"]), "bfloat16"), arg(inp["idx"]), t_max, e, arg(recv_x, "bfloat16"), arg(recv_count),
            topk_weights=arg(inp["w"]) if pre_reduced else None, use_fp8=False, return_recv_hook=use_hook,
            cumulative_local_expert_recv_stats=arg(stats), dispatch_wait_recv_cost_stats=arg(wait))
        if use_hook:
            assert hook is not None and hook.pending
            buf.run_hook(hook)
            assert not hook.pending
            with pytest.raises(ValueError, match="hook"):
                buf.run_hook(hook)
        else:
            assert hook is None
        assert handle.pre_reduced == pre_reduced and handle.num_tokens == inp["x"].shape[0]
        # Rows per local expert: by source rank, then token.
        for le in range(el):
            ge = r * el + le
            src = [(s, t) for s in range(nr) for t in range(every[s]["x"].shape[0]) if ge in every[s]["idx"][t]]
            assert recv_count[le] == len(src) == stats[le]
            if src:
                assert (bf16_values(recv_x[le, :len(src)]) == np.stack([every[s]["x"][t] for s, t in src])).all()
        assert (wait >= 0).all()

        # Combine: the experts return what they received (zero-copy for the pre-reduced case).
        out = np.zeros(inp["x"].shape, np.uint16)
        zero_copy = pre_reduced
        if zero_copy:
            staging = view_from_native(buf.get_next_low_latency_combine_buffer(handle), np.uint16)
            staging[...] = recv_x
        hook = buf.low_latency_combine_into(arg(recv_x, "bfloat16"), arg(inp["idx"]), arg(inp["w"]), handle,
                                            arg(out, "bfloat16"), zero_copy=zero_copy, return_recv_hook=use_hook)
        if use_hook:
            buf.run_hook(hook)
        want = inp["x"] * (inp["w"] * (inp["idx"] >= 0)).sum(1, keepdims=True)
        assert (bf16_values(out) == want).all()
        return True

    assert all(run_ranks(nr, rank_fn))


@pytest.mark.parametrize("mode", ["fp8", "round", "ue8m0"])
def test_ll_fp8_scales_are_column_major_and_dequantise(mode):
    nr, e, t_max, hidden = 2, 4, 4, 512
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((3, hidden)).astype(np.float32) for _ in range(nr)]
    xs = [bf16_values(bf16_bits((x.view(np.uint32) & 0xFFFF0000).view(np.float32))) for x in xs]
    idxs = [np.array([[0, 3], [1, -1], [2, 3]], np.int64) for _ in range(nr)]

    def rank_fn(g: ThreadGroup):
        r = g.rank()
        buf = new_buffer(g)
        recv_x, scales, recv_count = ll_alloc(e // nr, nr * t_max, hidden, fp8=True, ue8m0=mode == "ue8m0")
        assert scales.strides[1] == scales.itemsize  # column-major in the last two dims
        buf.low_latency_dispatch_into(arg(bf16_bits(xs[r]), "bfloat16"), arg(idxs[r]), t_max, e, arg(recv_x, "float8_e4m3fn"),
                                      arg(recv_count), recv_x_scales=arg(scales), use_fp8=True,
                                      round_scale=mode != "fp8", use_ue8m0=mode == "ue8m0")
        for le in range(e // nr):
            ge = r * (e // nr) + le
            src = [(s, t) for s in range(nr) for t in range(3) if ge in idxs[s][t]]
            assert recv_count[le] == len(src)
            for slot, (s, t) in enumerate(src):
                if mode == "ue8m0":
                    packed = scales[le, slot].astype(np.int64) & 0xFFFFFFFF
                    exps = np.stack([(packed >> (8 * b)) & 0xFF for b in range(4)], 1).reshape(-1)
                    inv = np.exp2(exps.astype(np.float64) - 127).astype(np.float32)
                else:
                    inv = scales[le, slot]
                if mode != "fp8":
                    assert (np.log2(inv) == np.round(np.log2(inv))).all(), "round_scale gives powers of two"
                deq = e4m3_values(recv_x[le, slot]) * np.repeat(inv, 128)
                x = xs[s][t]
                assert np.all(np.abs(deq - x) <= np.abs(x) / 8 + np.repeat(inv, 128)), "dequantised values stay close"
        return True

    assert all(run_ranks(nr, rank_fn))


def test_argument_errors_name_the_argument():
    def rank_fn(g: ThreadGroup):
        buf = new_buffer(g, enable_shrink=False)
        x = bf16_bits(np.ones((4, H), np.float32))
        idx = np.zeros((4, 2), np.int64)
        idx[:, 1] = 1

        def raises(exc, name, fn, *a, **kw):
            with pytest.raises(exc) as info:
                fn(*a, **kw)
            assert info.value.argument == name, repr(info.value)
            assert f"`{name}`" in str(info.value)
            assert info.value.rank == g.rank()

        per_rank, per_expert, itr = np.zeros(2, np.int32), np.zeros(4, np.int32), np.zeros((4, 2), bool)
        lay = dict(num_tokens_per_rank=arg(per_rank), num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr))
        buf.get_dispatch_layout_into(arg(idx), 4, arg(per_rank), arg(per_expert), arg(itr))
        raises(TypeError, "x", buf.prepare_dispatch, arg(x, "float16"), **lay)  # a dtype moelink does not know
        raises(TypeError, "x", buf.prepare_dispatch, arg(np.ones((4, H), np.float32)), **lay)  # a wrong known dtype
        raises(ValueError, "num_tokens_per_rank", buf.prepare_dispatch, arg(x, "bfloat16"),
               num_tokens_per_expert=arg(per_expert), is_token_in_rank=arg(itr))
        raises(ValueError, "topk_weights", buf.prepare_dispatch, arg(x, "bfloat16"), **lay, topk_idx=arg(idx),
               topk_weights=arg(np.ones((4, 3), np.float32)))
        raises(ValueError, "topk_idx", buf.get_dispatch_layout_into, arg(np.full((4, 2), 9, np.int64)), 4, arg(per_rank),
               arg(per_expert), arg(itr))
        raises(ValueError, "num_experts", buf.get_dispatch_layout_into, arg(idx), 3, arg(per_rank), arg(per_expert), arg(itr))
        raises(ValueError, "x", buf.prepare_dispatch, (x.ctypes.data, "bfloat16", (4, H), (-H, 1), -1), **lay)
        raises(ValueError, "config.num_sms", buf.prepare_dispatch, arg(x, "bfloat16"), **lay, config=(3, 6, 256, 6, 256))
        raises(ValueError, "enable_shrink", buf.low_latency_update_mask_buffer, 0, True)
        raises(ValueError, "use_ue8m0", buf.low_latency_dispatch_into, arg(x, "bfloat16"), arg(idx), 4, 4,
               arg(np.zeros((2, 8, H), np.uint8), "float8_e4m3fn"), arg(np.zeros(2, np.int32)), use_fp8=True, use_ue8m0=True)
        # A plan is used once; handles and plans stay with their buffer.
        plan = buf.prepare_dispatch(arg(x, "bfloat16"), **lay)
        rx = np.zeros((plan.num_recv_rows, H), np.uint16)
        handle = buf.dispatch_into(plan, arg(rx, "bfloat16"))
        raises(ValueError, "plan", buf.dispatch_into, plan, arg(rx, "bfloat16"))
        other = new_buffer(g)
        raises(ValueError, "handle", other.combine_into, arg(rx, "bfloat16"), handle, arg(np.zeros((4, H), np.uint16), "bfloat16"))
        with pytest.raises(RuntimeError, match="no communication buffer"):
            buf.local_buffer(False)
        with pytest.raises(ValueError) as info:
            _native.Buffer(g, backend="gpu")
        assert info.value.argument == "backend"
        buf.destroy()
        assert buf.destroyed
        with pytest.raises(RuntimeError, match="destroyed"):
            buf.barrier()
        return True

    assert all(run_ranks(2, rank_fn))


def test_shrink_masks_through_the_native_module():
    def rank_fn(g: ThreadGroup):
        buf = new_buffer(g, enable_shrink=True)
        assert buf.low_latency_query_mask_buffer() == [False, False]
        buf.low_latency_update_mask_buffer(1, True)
        assert buf.low_latency_query_mask_buffer() == [False, True]
        with pytest.raises(ValueError) as info:
            buf.low_latency_update_mask_buffer(5, True)
        assert info.value.argument == "rank"
        buf.low_latency_clean_mask_buffer()
        assert buf.low_latency_query_mask_buffer() == [False, False]
        buf.clean_low_latency_buffer(4, H, 4)
        buf.barrier()
        return True

    assert all(run_ranks(2, rank_fn))


def test_topology_and_rdma_options_reach_the_buffer():
    """Virtual nodes and the RDMA settings go through the native constructor; bad values name the argument."""

    def rank_fn(g: ThreadGroup):
        buf = new_buffer(g, topology="2x2", transport="emu-nic", num_qps_per_rank=4, allow_nvlink_for_low_latency_mode=False)
        assert buf.topology == (2, 2)
        assert new_buffer(g).topology == (1, 4)  # one host: one node
        for kw, name in [({"topology": "3x2"}, "topology"), ({"topology": "two"}, "topology"),
                         ({"transport": "carrier-pigeon"}, "transport"), ({"num_qps_per_rank": 0}, "num_qps_per_rank")]:
            with pytest.raises(ValueError) as info:
                new_buffer(g, **kw)
            assert info.value.argument == name, repr(info.value)
        return True

    assert all(run_ranks(4, rank_fn))


class FailingGroup:
    """A group whose all_gather raises (or returns too few messages)."""

    def __init__(self, short: bool) -> None:
        self.short = short

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def all_gather(self, data: bytes) -> List[bytes]:
        if self.short:
            return [data]
        raise ConnectionError("peer went away")


def test_group_failures_become_runtime_errors_with_the_cause():
    with pytest.raises(RuntimeError) as info:
        _native.Buffer(FailingGroup(short=False), backend="host")
    assert isinstance(info.value.__cause__, ConnectionError)
    assert "peer went away" in str(info.value)
    with pytest.raises(RuntimeError, match="1 messages for 2 ranks"):
        _native.Buffer(FailingGroup(short=True), backend="host")
    with pytest.raises(AttributeError):
        _native.Buffer(object(), backend="host")  # not a group at all


def test_module_metadata():
    assert isinstance(_native.__version__, str)
    assert issubclass(_native.TimeoutError, RuntimeError)
    assert _native.TimeoutError.__module__ == "moelink"
    assert set(_native.dtype_names()) >= {"bfloat16", "float8_e4m3fn", "float32", "int64", "int32", "bool"}
    info = _native.cuda_info()
    assert set(info) == {"available", "reason", "driver_version", "nvrtc", "devices"}
    if not info["available"]:
        assert info["reason"]
    assert _native.low_latency_rdma_size_hint(128, 7168, 4, 288) > 2 * 128 * 4 * 7168 * 2
    assert _native.nvl_buffer_size_hint((20, 6, 256, 6, 128), 7168 * 2, 4) > 0
    assert _native.rdma_buffer_size_hint((20, 6, 256, 6, 128), 7168 * 2, 4) == 0


@pytest.mark.parametrize("value", ["cpu", "HOST", "gpu", "", "cuda "])
def test_a_backend_typo_gets_moelinks_message(monkeypatch, value):
    from moelink import _env

    monkeypatch.setenv("MOELINK_BACKEND", value)
    with pytest.raises(ValueError) as info:
        _env.backend()
    assert info.value.argument == "MOELINK_BACKEND"
    assert all(name in str(info.value) for name in ("auto", "host", "cuda")), str(info.value)
    assert repr(value) in str(info.value) or f'"{value}"' in str(info.value), str(info.value)


def test_backend_and_timeout_from_the_environment(monkeypatch):
    from moelink import _env

    monkeypatch.delenv("MOELINK_BACKEND", raising=False)
    monkeypatch.delenv("MOELINK_TIMEOUT_MS", raising=False)
    assert (_env.backend(), _env.timeout_ms()) == ("auto", 10_000)
    for name in ("auto", "host", "cuda"):
        monkeypatch.setenv("MOELINK_BACKEND", name)
        assert _env.backend() == name
    for bad in ("10s", "0", "-5", "9223372036854775807", str(_env.MAX_TIMEOUT_MS + 1)):
        monkeypatch.setenv("MOELINK_TIMEOUT_MS", bad)
        with pytest.raises(ValueError) as info:
            _env.timeout_ms()
        assert info.value.argument == "MOELINK_TIMEOUT_MS"
        if bad.isdigit() and int(bad) > 0:
            assert "one day" in str(info.value), str(info.value)
    monkeypatch.setenv("MOELINK_TIMEOUT_MS", str(_env.MAX_TIMEOUT_MS))
    assert _env.timeout_ms() == _env.MAX_TIMEOUT_MS


def test_a_deadline_longer_than_a_day_is_refused_by_the_core():
    # The native constructor refuses what the environment parser refuses, naming timeout_ms.
    with pytest.raises(ValueError) as info:
        _native.Buffer(ThreadGroup.create(1)[0], 0, 0, False, backend="host", timeout_ms=9223372036854775807)
    assert info.value.argument == "timeout_ms" and "one day" in str(info.value), str(info.value)


def test_size_hints_are_the_rust_apis():
    # One formula: what the buffers require (Buffer::ll_bytes_needed / ht_bytes_needed).
    ll = _native.low_latency_rdma_size_hint(128, 7168, 4, 288)
    assert ll > 2 * 128 * 4 * 7168 * 2
    assert _native.low_latency_rdma_size_hint(256, 7168, 4, 288) > ll
    assert _native.ht_bytes_needed(4096, 7168, 8, 4, False) > 4 * 4096 * 7168 * 2 * 2
