"""High-throughput calls on a buffer whose ranks span nodes (topology 2x2), on the host backend, without torch:
the layout's per-node counts, and dispatch / cached dispatch / combine giving exactly what the same calls give
on one node (1x4), their handle outputs included; the capacity rule of the rounds; DeepEP's rule that
low-latency calls wait for ``clean_low_latency_buffer`` after high-throughput ones across nodes; the Python
internode handle's tuple behaviour and the recommended configs (``python/tests/gpu`` checks the handle's
elements through ``moelink.Buffer`` with torch).
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest

from helpers import ThreadGroup, arg, bf16_bits, bf16_values, run_ranks
from moelink import Buffer, Config, _native
from moelink import buffer as pybuffer
from test_native import H, in_rank, inputs

NR, NODES, PER_NODE = 4, 2, 2


def host_buffer(group: ThreadGroup, topology: str, **kw) -> "_native.Buffer":
    kw.setdefault("low_latency_mode", True)
    return _native.Buffer(group, kw.pop("nvl", 64 << 20), kw.pop("rdma", 64 << 20), backend="host", topology=topology, **kw)


def layout(buf, inp: Dict[str, np.ndarray], e: int, per_node: bool = True):
    t = inp["x"].shape[0]
    out = dict(num_tokens_per_rank=np.full(NR, -7, np.int32), num_tokens_per_expert=np.full(e, -7, np.int32),
               is_token_in_rank=np.zeros((t, NR), bool))
    rdma = np.full(buf.topology[0], -7, np.int32) if per_node else None
    buf.get_dispatch_layout_into(arg(inp["idx"]), e, *(arg(out[k]) for k in out),
                                 num_tokens_per_rdma_rank=None if rdma is None else arg(rdma))
    return out, rdma


def dispatch(buf, inp, e: int, *, handle=None, worst: int = 0, topk: bool = True, fp8: bool = False,
             alignment: int = 1) -> Dict[str, object]:
    """Layout (fresh), prepare, dispatch_into with every output; the arrays and the handle."""
    t, hidden = inp["x"].shape
    if fp8:
        xa = arg((np.abs(inp["x"]).astype(np.uint8) & 0x7E).astype(np.uint8), "float8_e4m3fn")
        sa = arg((np.arange(t * (hidden // 128), dtype=np.float32).reshape(hidden // 128, t).T + 1) / 8)
    else:
        xa, sa = arg(bf16_bits(inp["x"]), "bfloat16"), None
    kw: Dict[str, object] = {}
    if handle is None:
        out, _ = layout(buf, inp, e)
        kw = {k: arg(v) for k, v in out.items()}
        if topk:
            kw.update(topk_idx=arg(inp["idx"]), topk_weights=arg(inp["w"]))
    plan = buf.prepare_dispatch(xa, x_scales=sa, handle=handle, num_worst_tokens=worst, expert_alignment=alignment, **kw)
    n = plan.num_recv_rows
    got = dict(recv_x=np.zeros((n, hidden), np.uint8 if fp8 else np.uint16),
               recv_s=np.zeros((n, hidden // 128), np.float32) if fp8 else None,
               recv_idx=np.zeros((n, plan.topk), np.int64) if plan.has_topk else None,
               recv_w=np.zeros((n, plan.topk), np.float32) if plan.has_topk else None,
               rank_prefix=np.full((NR, NR), -5, np.int32), src_idx=np.full(n, -5, np.int32),
               counts=list(plan.num_recv_tokens_per_expert), num_recv_tokens=plan.num_recv_tokens)
    h = buf.dispatch_into(plan, arg(got["recv_x"], "float8_e4m3fn" if fp8 else "bfloat16"),
                          None if got["recv_s"] is None else arg(got["recv_s"]),
                          None if got["recv_idx"] is None else arg(got["recv_idx"]),
                          None if got["recv_w"] is None else arg(got["recv_w"]),
                          rank_prefix_matrix=arg(got["rank_prefix"]), recv_src_idx=arg(got["src_idx"]))
    got["handle"] = h
    return got


def combine(buf, got, t: int, k: int, bias: bool) -> Dict[str, np.ndarray]:
    out = np.zeros((t, H), np.uint16)
    out_w = np.zeros((t, k), np.float32)
    bias_arg = arg(bf16_bits(np.full((t, H), 2.0, np.float32)), "bfloat16") if bias else None
    buf.combine_into(arg(got["recv_x"], "bfloat16"), got["handle"], arg(out, "bfloat16"),
                     topk_weights=None if got["recv_w"] is None else arg(got["recv_w"]),
                     combined_topk_weights=None if got["recv_w"] is None else arg(out_w), bias_0=bias_arg)
    return dict(combined_x=out, combined_w=out_w)


def comparable(d: Dict[str, object]) -> Dict[str, object]:
    return {k: v for k, v in d.items() if k != "handle"}


def assert_same(a: Dict[str, object], b: Dict[str, object], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype, f"{k} ({what})"
            assert (x == y).all(), f"{k} differs between 2x2 and 1x4 ({what})"
        else:
            assert x == y, f"{k}: {x} != {y} ({what})"


def test_layout_counts_tokens_per_node():
    """``num_tokens_per_rdma_rank`` across nodes: a token counts once per node it reaches; the other outputs
    are the single-node layout's."""
    e, k = 4 * NR, 3
    every = [inputs(r, e, k, seed=60, tokens=9 + r) for r in range(NR)]

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        out, rdma = layout(host_buffer(g, "2x2"), every[me], e)
        itr = in_rank(every[me]["idx"], e, NR)
        assert (rdma == itr.reshape(-1, NODES, PER_NODE).any(2).sum(0)).all()
        assert (out["is_token_in_rank"] == itr).all() and (out["num_tokens_per_rank"] == itr.sum(0)).all()
        single, none = layout(host_buffer(g, "1x4"), every[me], e, per_node=False)
        assert none is None and all((out[key] == single[key]).all() for key in out)
        # The per-node output is checked like the others: int32 [num_nodes].
        with pytest.raises(ValueError) as info:
            host_buffer(g, "2x2").get_dispatch_layout_into(
                arg(every[me]["idx"]), e, arg(np.zeros(NR, np.int32)), arg(np.zeros(e, np.int32)),
                arg(np.zeros((9 + me, NR), bool)), num_tokens_per_rdma_rank=arg(np.zeros(3, np.int32)))
        assert info.value.argument == "num_tokens_per_rdma_rank"
        return True

    assert all(run_ranks(NR, rank_fn))


MODES = {  # name: dispatch options
    "bf16": dict(),
    "bf16-aligned": dict(alignment=4),
    "bf16-no-topk": dict(topk=False),
    "fp8": dict(fp8=True),
    "no-sync": dict(worst=64),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_two_nodes_equal_one_node(mode):
    """Every output of a fresh dispatch, its cached re-run and a combine (with weights and a bias) on 2x2 is
    exactly the 1x4 call's, the handle outputs (rank_prefix_matrix, recv_src_idx) included."""
    e, k = 4 * NR, 3
    opts = MODES[mode]
    fp8 = bool(opts.get("fp8"))
    every = [inputs(r, e, k, seed=61, tokens=[7, 0, 12, 5][r]) for r in range(NR)]  # rank 1 sends nothing
    if fp8:
        for inp in every:
            inp["x"] = np.repeat(inp["x"], 128 // H, axis=1)

    def run(topology: str) -> List[Dict[str, object]]:
        def rank_fn(g: ThreadGroup):
            me = g.rank()
            buf = host_buffer(g, topology)
            fresh = dispatch(buf, every[me], e, **opts)
            res: Dict[str, object] = {f"fresh.{key}": v for key, v in comparable(fresh).items()}
            cached = dispatch(buf, every[me], e, handle=fresh["handle"], fp8=fp8)
            res.update({f"cached.{key}": v for key, v in comparable(cached).items()})
            if not fp8:
                t = every[me]["x"].shape[0]
                res.update({f"combine.{key}": v for key, v in combine(buf, fresh, t, k, bias=True).items()})
                res.update({f"combine-cached.{key}": v for key, v in combine(buf, cached, t, k, bias=False).items()})
            assert fresh["handle"].num_tokens == every[me]["x"].shape[0]
            return res

        return run_ranks(NR, rank_fn)

    two, one = run("2x2"), run("1x4")
    for r in range(NR):
        assert_same(two[r], one[r], f"{mode}, rank {r}")
    # And the 1x4 results are the routing's (rows by source rank, then token).
    for r in range(NR):
        want = [(s, t) for s in range(NR) for t in np.nonzero(in_rank(every[s]["idx"], e, NR)[:, r])[0]]
        n = len(want)
        assert (one[r]["fresh.src_idx"][:n] == [t for _, t in want]).all()
        if not fp8:
            rows = np.stack([every[s]["x"][t] for s, t in want]) if want else np.zeros((0, H), np.float32)
            assert (bf16_values(one[r]["fresh.recv_x"][:n]) == rows).all()


def test_rounds_fit_any_token_count_and_too_small_is_refused():
    """``ht_internode_bytes_needed`` sizes the buffers for rounds of so many tokens: a call of many more tokens
    runs in rounds; buffers that hold not even one token per round are refused on every rank, naming the
    sizing function."""
    e, k = 4 * NR, 2
    nvl, rdma = _native.ht_internode_bytes_needed("2x2", 2, H, k, False)
    small_nvl, small_rdma = _native.ht_internode_bytes_needed("2x2", 1, H, k, False)
    assert nvl > small_nvl > 0 and rdma > small_rdma > 0
    assert _native.ht_internode_bytes_needed("2x8", 4096, 7168, 8, True)[1] > _native.ht_internode_bytes_needed("2x8", 512, 7168, 8, True)[1]
    with pytest.raises(ValueError) as info:
        _native.ht_internode_bytes_needed("2x", 1, H, k, False)
    assert info.value.argument == "topology" and info.value.rank == -1
    every = [inputs(r, e, k, seed=62, tokens=40 + r) for r in range(NR)]

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        buf = host_buffer(g, "2x2", nvl=nvl, rdma=rdma)
        got = dispatch(buf, every[me], e)  # 40+ tokens through rounds of 2
        want = [(s, t) for s in range(NR) for t in np.nonzero(in_rank(every[s]["idx"], e, NR)[:, me])[0]]
        assert got["num_recv_tokens"] == len(want)
        assert (bf16_values(got["recv_x"]) == np.stack([every[s]["x"][t] for s, t in want])).all()
        tiny = host_buffer(g, "2x2", nvl=small_nvl, rdma=small_rdma - 256)
        with pytest.raises(RuntimeError, match="ht_internode_bytes_needed|ht_bytes_needed"):
            dispatch(tiny, every[me], e)
        return True

    assert all(run_ranks(NR, rank_fn))


def test_low_latency_waits_for_clean_after_high_throughput_across_nodes():
    """DeepEP's rule across nodes: the two kinds of call share the RDMA region, so after a high-throughput call
    a low-latency call is refused (every rank alike) until ``clean_low_latency_buffer``; on one node it is not."""
    e, k, t_max = 4 * NR, 2, 8
    el = e // NR
    every = [inputs(r, e, k, seed=63) for r in range(NR)]

    def ll(buf, inp):
        recv_x = np.zeros((el, NR * t_max, H), np.uint16)
        buf.low_latency_dispatch_into(arg(bf16_bits(inp["x"]), "bfloat16"), arg(inp["idx"]), t_max, e,
                                      arg(recv_x, "bfloat16"), arg(np.zeros(el, np.int32)), use_fp8=False)

    def rank_fn(g: ThreadGroup):
        me = g.rank()
        for topology, refused in (("2x2", True), ("1x4", False)):
            buf = host_buffer(g, topology)
            ll(buf, every[me])
            dispatch(buf, every[me], e)
            if refused:
                with pytest.raises(ValueError, match="clean_low_latency_buffer"):
                    ll(buf, every[me])
                buf.clean_low_latency_buffer(t_max, H, e)
            ll(buf, every[me])
        return True

    assert all(run_ranks(NR, rank_fn))


# ------------------------------------------------------------------------------------- the Python side


class _Routing:
    num_tokens, num_recv_tokens, num_experts = 5, 7, 8


class _Tensor:
    """Stands in for a torch tensor (attributes can be attached to it)."""


def test_internode_handle_is_deepeps_ten_tuple():
    routing = _Routing()
    carrier = _Tensor()
    setattr(carrier, pybuffer._NATIVE_ATTR, routing)
    names = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
             "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
             "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
    elements = tuple(carrier if i == pybuffer.InternodeDispatchHandle.CARRIER else name for i, name in enumerate(names))
    assert names[pybuffer.InternodeDispatchHandle.CARRIER] == "rdma_channel_prefix_matrix"
    h = pybuffer.InternodeDispatchHandle(elements, routing)
    assert isinstance(h, tuple) and len(h) == 10 and list(h) == list(elements)
    (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
     recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
     send_rdma_head, send_nvl_head) = h
    assert rdma_channel_prefix_matrix is carrier and h[-4] == "recv_gbl_rank_prefix_sum" and h[-1] == "send_nvl_head"
    assert (h.native, h.num_tokens, h.num_recv_tokens, h.num_experts) == (routing, 5, 7, 8)
    at = pybuffer.InternodeDispatchHandle.CARRIER
    for same in (h, tuple(h), list(h)):
        assert pybuffer._native_of(same, pybuffer.InternodeDispatchHandle, 10, "rdma_channel_prefix_matrix", 0,
                                   "dispatch", at=at) is routing
    for bad, why in ((names, "was not made by moelink"), (tuple(h)[:6], "expected the handle")):
        with pytest.raises(TypeError) as info:
            pybuffer._native_of(bad, pybuffer.InternodeDispatchHandle, 10, "rdma_channel_prefix_matrix", 2, "dispatch",
                                at=at)
        assert info.value.argument == "handle" and info.value.rank == 2 and why in str(info.value)


# DeepEP's tables (its get_dispatch_config / get_combine_config), chunk sizes after num_sms.
DEEPEP_DISPATCH = {16: (36, 288, 20, 128), 24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                   128: (20, 560, 12, 128), 160: (28, 720, 12, 128), 4: (6, 256, 6, 128)}
DEEPEP_COMBINE = {16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 96: (1, 480, 8, 128), 144: (2, 720, 8, 128),
                  2: (10, 256, 6, 128)}


def test_recommended_configs_are_deepeps_for_16_to_256_ranks():
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        for n, chunks in DEEPEP_DISPATCH.items():
            assert Buffer.get_dispatch_config(n) == Config(24, *chunks), n
        for n, chunks in DEEPEP_COMBINE.items():
            assert Buffer.get_combine_config(n) == Config(24, *chunks), n
        # Counts DeepEP does not list take the largest listed count below them (DeepEP asserts).
        assert Buffer.get_dispatch_config(256) == Buffer.get_dispatch_config(160)
        assert Buffer.get_combine_config(200) == Buffer.get_combine_config(160)
        assert Buffer.get_dispatch_config(20) == Buffer.get_dispatch_config(16)
        assert Buffer.get_dispatch_config(1) == Buffer.get_dispatch_config(2)
        for n in range(1, 257):
            cfg = Buffer.get_dispatch_config(n)
            assert cfg.num_sms == 24 and cfg.num_max_rdma_chunked_recv_tokens == 128, n
    finally:
        Buffer.num_sms = old
    with pytest.raises(ValueError) as info:
        Buffer.get_combine_config(0)
    assert info.value.argument == "num_ranks"
