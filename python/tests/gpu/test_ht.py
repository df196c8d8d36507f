"""High-throughput API (layout, dispatch, combine, cached, no-sync, FP8, events, CUDA graphs) against the
plain-torch semantics of reference.py, bit for bit. With ``MOELINK_TOPOLOGY`` spanning nodes the same tests run
DeepEP's internode API (per-node counts from the layout, passed to dispatch; the 10-element handle), whose
results are the single-node ones."""

from __future__ import annotations

from typing import List

import pytest
import torch

import moelink
from checks import HT_REAL, HT_SMALL, Shape, same
from reference import RankInputs, ht_combine, ht_dispatch, layout, make_inputs


def all_inputs(shape: Shape, num_ranks: int, seed: int, drop: float = 0.1) -> List[RankInputs]:
    """Every rank's inputs; ranks send different token counts."""
    e = shape.num_experts(num_ranks)
    return [make_inputs(r, shape.tokens + 3 * r, shape.hidden, e, shape.topk, seed, drop) for r in range(num_ranks)]


def fresh(buf: moelink.Buffer, env, inp: RankInputs, num_experts: int, **kw):
    """Layout, then a fresh dispatch of ``inp`` (``x=`` overrides the rows, e.g. with an FP8 tuple), passing
    every layout tensor as DeepEP's callers do (``num_tokens_per_rdma_rank``: None on one node)."""
    idx = env.to(inp.topk_idx)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    x = kw.pop("x", env.to(inp.x))
    return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=env.to(inp.topk_weights), **kw)


def handle_class(env) -> type:
    return moelink.buffer.InternodeDispatchHandle if env.internode else moelink.buffer.DispatchHandle


def min_sms(env) -> int:
    """The fewest SMs a call may ask for: 2, or across nodes what the internode kernels' roles need (a sender,
    a forwarder per 16 nodes, receivers for up to 512 ranks), rounded up to even."""
    if not env.internode:
        return 2
    need = -(-env.num_nodes // 16) + max(1, -(-env.num_ranks // 512)) + 1
    return need + need % 2


def expert_out(rank: int, x: torch.Tensor) -> torch.Tensor:
    """What rank ``rank``'s experts return for received rows ``x`` (a rank-dependent scaling)."""
    return (x.float() * ((rank + 1) / 4)).to(torch.bfloat16)


def check_received(got, want, what: str) -> None:
    recv_x, recv_idx, recv_w, counts = got
    same(recv_x, want.x, f"recv_x ({what})")
    same(recv_idx, want.topk_idx, f"recv_topk_idx ({what})")
    same(recv_w, want.topk_weights, f"recv_topk_weights ({what})")
    assert isinstance(counts, list) and counts == want.num_recv_tokens_per_expert, f"num_recv_tokens_per_expert ({what})"


def test_module_and_buffer_attributes(env, ht_buffer):
    assert moelink.topk_idx_t is torch.int64
    assert ht_buffer.rank == env.rank and ht_buffer.group_size == env.num_ranks and ht_buffer.group is env.group
    assert ht_buffer.num_nvl_bytes == env.ht_nvl_bytes and ht_buffer.num_rdma_bytes == env.ht_rdma_bytes
    assert ht_buffer.topology == (env.num_nodes, env.ranks_per_node)
    assert ht_buffer.low_latency_mode is False and ht_buffer.explicitly_destroy is True
    assert ht_buffer.backend == ("cuda" if env.cuda else "host")
    sm90 = moelink.Buffer.is_sm90_compiled()
    assert isinstance(sm90, bool)
    if env.cuda:
        assert sm90 == (torch.cuda.get_device_capability() >= (9, 0))
    for cfg in (moelink.Buffer.get_dispatch_config(env.num_ranks), moelink.Buffer.get_combine_config(env.num_ranks)):
        assert isinstance(cfg, moelink.Config) and cfg.num_sms > 0 and cfg.num_sms % 2 == 0
        assert cfg.get_nvl_buffer_size_hint(HT_REAL.hidden * 2, env.num_ranks) > 0
        # DeepEP's hint: 0 up to 8 ranks (one node of its 8 GPUs), even on virtual nodes.
        assert cfg.get_rdma_buffer_size_hint(HT_REAL.hidden * 2, env.num_ranks) == 0


def test_layout(env, ht_buffer):
    nr = env.num_ranks
    for shape, seed, drop in ((HT_SMALL, 1, 0.3), (HT_REAL, 2, 0.1), (HT_SMALL, 3, 1.0)):  # 1.0: no expert at all
        e = shape.num_experts(nr)
        inp = make_inputs(env.rank, shape.tokens + 5 * env.rank, shape.hidden, e, shape.topk, seed, drop)
        per_rank, rdma, per_expert, in_rank, event = ht_buffer.get_dispatch_layout(env.to(inp.topk_idx), e)
        want = layout(inp.topk_idx, e, nr)
        what = f"topk {shape.topk} of {e}, drop {drop}"
        if env.internode:  # tokens per destination node: a token counts once per node it reaches
            reach = want[2].view(-1, env.num_nodes, env.ranks_per_node).any(2)
            same(rdma, reach.sum(0).to(torch.int32), f"num_tokens_per_rdma_rank ({what})")
        else:
            assert rdma is None, "intranode: no RDMA counts"
        assert isinstance(event, moelink.EventOverlap)
        same(per_rank, want[0], f"num_tokens_per_rank ({what})")
        same(per_expert, want[1], f"num_tokens_per_expert ({what})")
        same(in_rank, want[2], f"is_token_in_rank ({what})")


def test_dispatch_combine_bf16_alignment_and_bias(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=1)
    mine = inputs[r]
    t, h = mine.x.shape
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    for alignment in (1, 4):
        recv_x, recv_idx, recv_w, counts, handle, event = fresh(ht_buffer, env, mine, e, expert_alignment=alignment)
        assert isinstance(event, moelink.EventOverlap) and isinstance(handle, handle_class(env))
        assert len(handle) == (10 if env.internode else 6)
        check_received((recv_x, recv_idx, recv_w, counts), ht_dispatch(inputs, r, e, alignment),
                       f"expert_alignment {alignment}")
    # Combine through the last handle: experts' outputs, doubled weights (as a weight gradient), 0-2 biases.
    g = torch.Generator().manual_seed(5 + r)
    biases = [torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range(2)]
    for num_bias in (0, 1, 2):
        bias = None if num_bias == 0 else env.to(biases[0]) if num_bias == 1 else tuple(env.to(b) for b in biases)
        combined, combined_w, event = ht_buffer.combine(expert_out(r, recv_x), handle, topk_weights=recv_w * 2, bias=bias)
        assert isinstance(event, moelink.EventOverlap)
        want_x, want_w = ht_combine([(rec, expert_out(k, rec.x), rec.topk_weights * 2) for k, rec in enumerate(received)],
                                    r, t, biases[:num_bias])
        same(combined, want_x, f"combined_x ({num_bias} biases)")
        same(combined_w, want_w, f"combined_topk_weights ({num_bias} biases)")


def test_realistic_shape_bf16(env, ht_buffer):
    """Hidden 7168, top-8 of 256 experts, a few hundred tokens per rank: dispatch and combine with weights."""
    r, nr = env.rank, env.num_ranks
    e = HT_REAL.num_experts(nr)
    inputs = all_inputs(HT_REAL, nr, seed=21)
    mine = inputs[r]
    recv_x, recv_idx, recv_w, counts, handle, _ = fresh(ht_buffer, env, mine, e)
    check_received((recv_x, recv_idx, recv_w, counts), ht_dispatch(inputs, r, e), "hidden 7168")
    combined, combined_w, _ = ht_buffer.combine(expert_out(r, recv_x), handle, topk_weights=recv_w)
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    want_x, want_w = ht_combine([(rec, expert_out(k, rec.x), rec.topk_weights) for k, rec in enumerate(received)],
                                r, mine.x.shape[0])
    same(combined, want_x, "combined_x (hidden 7168)")
    same(combined_w, want_w, "combined_topk_weights (hidden 7168)")


def test_realistic_shape_fp8_column_major_scales_and_cached(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_REAL.num_experts(nr)
    inputs = all_inputs(HT_REAL, nr, seed=22)
    fp8 = [inp.x.float().clamp(-400, 400).to(torch.float8_e4m3fn) for inp in inputs]
    scales = [torch.rand(inp.x.shape[1] // 128, inp.x.shape[0], generator=torch.Generator().manual_seed(k)).t()
              for k, inp in enumerate(inputs)]  # column-major [T, H/128], as DeepEP's callers pass them
    assert not scales[r].is_contiguous()
    (recv_x, recv_s), recv_idx, recv_w, counts, handle, _ = fresh(ht_buffer, env, inputs[r], e,
                                                                  x=(env.to(fp8[r]), env.to(scales[r])))
    assert recv_x.dtype == torch.float8_e4m3fn and recv_s.dtype == torch.float32
    check_received((recv_x, recv_idx, recv_w, counts), ht_dispatch(inputs, r, e, payloads=fp8), "fp8")
    want_s = ht_dispatch(inputs, r, e, payloads=[s.contiguous() for s in scales]).x
    same(recv_s, want_s, "recv_x scales")
    # A cached FP8 dispatch (same routing, other values) keeps the tuple and returns no top-k or handle.
    fp8_2 = [(-f.float()).to(torch.float8_e4m3fn) for f in fp8]
    scales_2 = [s * 2 for s in scales]
    out = ht_buffer.dispatch((env.to(fp8_2[r]), env.to(scales_2[r])), handle=handle)
    assert isinstance(out[0], tuple) and out[1:5] == (None, None, None, None)
    same(out[0][0], ht_dispatch(inputs, r, e, payloads=fp8_2).x, "cached recv_x (fp8)")
    same(out[0][1], ht_dispatch(inputs, r, e, payloads=[s.contiguous() for s in scales_2]).x, "cached scales")


def test_dispatch_without_topk_then_cached(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=3)
    idx = env.to(inputs[r].topk_idx)
    per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
    recv_x, recv_idx, recv_w, counts, handle, _ = ht_buffer.dispatch(
        env.to(inputs[r].x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    want = ht_dispatch(inputs, r, e)
    assert recv_idx is None and recv_w is None
    same(recv_x, want.x, "recv_x (no top-k)")
    assert counts == want.num_recv_tokens_per_expert
    # Training: combine's backward is a cached dispatch of the gradients along the same routing...
    grads = [torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(50 + k)).to(torch.bfloat16)
             for k, inp in enumerate(inputs)]
    recv_g, a, b, c, d, event = ht_buffer.dispatch(env.to(grads[r]), handle=handle)
    assert (a, b, c, d) == (None, None, None, None) and isinstance(event, moelink.EventOverlap)
    same(recv_g, ht_dispatch(inputs, r, e, payloads=grads).x, "cached recv_x")
    # ... and dispatch's backward is a combine without weights.
    combined, combined_w, _ = ht_buffer.combine(recv_g, handle)
    assert combined_w is None
    received = [ht_dispatch(inputs, k, e, payloads=grads) for k in range(nr)]
    want_x, _ = ht_combine([(rec, rec.x, None) for rec in received], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (no weights)")


def test_no_sync_worst_case_rows(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=4)
    # Every token of every rank, plus rows no rank can fill (with one rank every token arrives).
    worst = sum(inp.x.shape[0] for inp in inputs) + 8
    recv_x, recv_idx, recv_w, counts, handle, _ = fresh(ht_buffer, env, inputs[r], e, num_worst_tokens=worst)
    want = ht_dispatch(inputs, r, e)
    n = want.num_rows
    assert n < worst, "the test needs rows past the received count"
    assert recv_x.shape[0] == worst and recv_idx.shape[0] == worst and recv_w.shape[0] == worst
    assert counts == [], "no-sync dispatch returns no per-expert counts"
    same(recv_x[:n], want.x, "recv_x")
    same(recv_idx[:n], want.topk_idx, "recv_topk_idx")
    same(recv_w[:n], want.topk_weights, "recv_topk_weights")
    assert bool((recv_idx[n:] == -1).all()), "rows past the received count must have recv_topk_idx = -1"
    combined, combined_w, _ = ht_buffer.combine(recv_x, handle, topk_weights=recv_w)
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    want_x, want_w = ht_combine([(rec, rec.x, rec.topk_weights) for rec in received], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (no-sync)")
    same(combined_w, want_w, "combined_topk_weights (no-sync)")


def test_rank_without_tokens(env, ht_buffer):
    """The last rank sends nothing (T = 0); the others still receive and combine correctly."""
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=8)
    inputs[nr - 1] = make_inputs(nr - 1, 0, HT_SMALL.hidden, e, HT_SMALL.topk, 8)
    recv_x, recv_idx, recv_w, counts, handle, _ = fresh(ht_buffer, env, inputs[r], e)
    check_received((recv_x, recv_idx, recv_w, counts), ht_dispatch(inputs, r, e), "a rank with no tokens")
    combined, _, _ = ht_buffer.combine(expert_out(r, recv_x), handle)
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    want_x, _ = ht_combine([(rec, expert_out(k, rec.x), None) for k, rec in enumerate(received)], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (a rank with no tokens)")


def test_overlap_events_and_comm_stream_allocation(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=6)
    idx = env.to(inputs[r].topk_idx)
    previous = moelink.Buffer.capture()
    assert isinstance(previous, moelink.EventOverlap) and (previous.event is not None) == env.cuda
    per_rank, _, per_expert, in_rank, ev = ht_buffer.get_dispatch_layout(idx, e, previous_event=previous, async_finish=True,
                                                                         allocate_on_comm_stream=True)
    ev.current_stream_wait()
    recv_x, recv_idx, recv_w, counts, handle, ev = ht_buffer.dispatch(
        env.to(inputs[r].x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=env.to(inputs[r].topk_weights), previous_event=moelink.Buffer.capture(),
        async_finish=True, allocate_on_comm_stream=True)
    with ev:
        pass  # work that overlaps the dispatch would go here; the current stream waits on exit
    if env.cuda:
        assert ev.event is not None and ev.extra_tensors, "async_finish returns an event keeping the tensors alive"
        assert isinstance(ht_buffer.get_comm_stream(), torch.cuda.Stream)
    else:
        assert ev.event is None and ht_buffer.get_comm_stream() is None
    check_received((recv_x, recv_idx, recv_w, counts), ht_dispatch(inputs, r, e), "async")
    combined, _, ev = ht_buffer.combine(recv_x, handle, previous_event=moelink.Buffer.capture(), async_finish=True,
                                        allocate_on_comm_stream=True)
    ev.current_stream_wait()
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    want_x, _ = ht_combine([(rec, rec.x, None) for rec in received], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (async)")


def test_config_num_sms(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = all_inputs(HT_SMALL, nr, seed=7)
    want = ht_dispatch(inputs, r, e).x
    for sms in (min_sms(env), 24):
        recv_x, *_ = fresh(ht_buffer, env, inputs[r], e, config=moelink.Config(sms, 6, 256, 6, 256))
        same(recv_x, want, f"recv_x with {sms} SMs")
    with pytest.raises(ValueError) as err:
        fresh(ht_buffer, env, inputs[r], e, config=moelink.Config(num_sms=3))
    assert err.value.argument == "config.num_sms"
    if env.internode and env.cuda:  # fewer blocks than the internode kernels' roles need: refused alike
        with pytest.raises(ValueError) as err:
            fresh(ht_buffer, env, inputs[r], e, config=moelink.Config(num_sms=min_sms(env) - 2))
        assert err.value.argument == "config.num_sms"
    with pytest.raises(ValueError):
        moelink.Buffer.set_num_sms(5)
    old = moelink.Buffer.num_sms
    try:
        moelink.Buffer.set_num_sms(8)
        assert moelink.Buffer.get_dispatch_config(nr).num_sms == 8
        recv_x, *_ = fresh(ht_buffer, env, inputs[r], e)  # the class-wide default
        same(recv_x, want, "recv_x with set_num_sms(8)")
    finally:
        moelink.Buffer.set_num_sms(old)
    assert moelink.Buffer.get_combine_config(nr).num_sms == old


def test_argument_errors_name_the_argument(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inp = make_inputs(r, 8, HT_SMALL.hidden, e, HT_SMALL.topk, 8)
    idx = env.to(inp.topk_idx)
    per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
    lay = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def raises(exc: type, arg: str, fn, *a, **kw) -> None:
        with pytest.raises(exc) as info:
            fn(*a, **kw)
        assert getattr(info.value, "argument", None) == arg, f"{info.value!r} should name `{arg}`"
        assert arg in str(info.value)

    raises(TypeError, "x", ht_buffer.dispatch, env.to(inp.x.float()), **lay)
    raises(ValueError, "topk_weights", ht_buffer.dispatch, env.to(inp.x), **lay, topk_idx=idx,
           topk_weights=env.to(inp.topk_weights[:, :1].contiguous()))
    raises(ValueError, "num_tokens_per_rank", ht_buffer.dispatch, env.to(inp.x), is_token_in_rank=in_rank,
           num_tokens_per_expert=per_expert)
    raises(TypeError, "handle", ht_buffer.dispatch, env.to(inp.x), handle=("not", "a", "handle"))
    if env.internode:  # DeepEP's per-node counts: int32, one per node
        raises(ValueError, "num_tokens_per_rdma_rank", ht_buffer.dispatch, env.to(inp.x), **lay,
               num_tokens_per_rdma_rank=per_rank)
        raises(TypeError, "num_tokens_per_rdma_rank", ht_buffer.dispatch, env.to(inp.x), **lay,
               num_tokens_per_rdma_rank=torch.zeros(env.num_nodes, dtype=torch.int64, device=env.device))
    raises(TypeError, "handle", ht_buffer.combine, env.to(inp.x), handle=None)
    if nr > 1:  # any expert count divides among one rank
        raises(ValueError, "num_experts", ht_buffer.get_dispatch_layout, idx, e + 1)
    raises(ValueError, "expert_alignment", ht_buffer.dispatch, env.to(inp.x), **lay, expert_alignment=0)
    raises(TypeError, "x", ht_buffer.dispatch, "not a tensor", **lay)
    raises(ValueError, "x", ht_buffer.dispatch, (env.to(inp.x),), **lay)  # an FP8 tuple has two tensors
    if env.cuda:
        raises(ValueError, "x", ht_buffer.dispatch, inp.x, **lay)  # a CPU tensor on a CUDA buffer
    else:
        raises(ValueError, "topk_idx", ht_buffer.get_dispatch_layout, torch.full_like(inp.topk_idx, e), e)
    # Nothing above reached a collective: the buffer still works.
    recv_x, *_ = ht_buffer.dispatch(env.to(inp.x), **lay)
    assert recv_x.shape[1] == HT_SMALL.hidden


def test_sizes_the_device_cannot_hold_name_the_argument(env, ht_buffer):
    """Outputs that an argument sizes beyond the device's memory are refused before torch allocates them,
    naming the argument and the bytes needed (torch's out-of-memory error names no argument)."""
    r, nr = env.rank, env.num_ranks
    e = HT_REAL.num_experts(nr)
    inp = make_inputs(r, 8, HT_REAL.hidden, e, HT_REAL.topk, 9)
    idx = env.to(inp.topk_idx)
    per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
    lay = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
               topk_weights=env.to(inp.topk_weights))
    worst = (1 << 31) - 1  # the most the native layer accepts: 30 TB of rows at hidden 7168
    with pytest.raises(ValueError) as err:
        ht_buffer.dispatch(env.to(inp.x), **lay, num_worst_tokens=worst)
    need = worst * (HT_REAL.hidden * 2 + HT_REAL.topk * (8 + 4) + 4)
    assert err.value.argument == "num_worst_tokens" and f"need {need} bytes" in str(err.value), str(err.value)
    with pytest.raises(ValueError) as err:
        ht_buffer.get_dispatch_layout(idx, 1 << 42)
    assert err.value.argument == "num_experts"
    # 2^40 SMs: the CUDA backend refuses more than its GPU has; the host's DeepEP-shaped channel outputs
    # ([ranks, num_sms / 2] each) are what no machine holds.
    with pytest.raises(ValueError) as err:
        ht_buffer.dispatch(env.to(inp.x), **lay, config=moelink.Config(num_sms=1 << 40))
    assert err.value.argument == "config.num_sms"
    recv_x, *_ = ht_buffer.dispatch(env.to(inp.x), **lay)  # the buffer still works
    assert recv_x.shape[1] == HT_REAL.hidden


def test_local_buffer_tensor(env, ht_buffer):
    if not env.cuda:
        with pytest.raises(RuntimeError):
            ht_buffer.get_local_buffer_tensor(torch.int32)
        return
    whole = ht_buffer.get_local_buffer_tensor(torch.uint8)
    assert whole.numel() == ht_buffer.num_nvl_bytes and whole.device == env.device
    part = ht_buffer.get_local_buffer_tensor(torch.int32, torch.Size([4, 4]), offset=32)  # bytes, as DeepEP's
    part.fill_(env.rank + 1)
    assert int(whole[32:96].view(torch.int32).sum()) == 16 * (env.rank + 1)
    assert ht_buffer.get_local_buffer_tensor(torch.int32, offset=32).numel() == (ht_buffer.num_nvl_bytes - 32) // 4
    with pytest.raises(ValueError) as err:
        ht_buffer.get_local_buffer_tensor(torch.int32, torch.Size([ht_buffer.num_nvl_bytes]))
    assert err.value.argument == "size"
    with pytest.raises(ValueError) as err:
        ht_buffer.get_local_buffer_tensor(torch.int32, offset=6)  # not a whole element
    assert err.value.argument == "offset"


def test_no_sync_cuda_graph_capture_replay(env, ht_buffer):
    """Layout, no-sync dispatch (num_worst_tokens), the experts and combine captured in one CUDA graph, then
    replayed with new values and new routing (same token counts), checked against the reference each time."""
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend; this run uses the host backend (CPU tensors)")
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    first = all_inputs(HT_SMALL, nr, seed=30)
    worst = sum(inp.x.shape[0] for inp in first)
    x, idx, w = env.to(first[r].x), env.to(first[r].topk_idx), env.to(first[r].topk_weights)

    def step():
        per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
        recv_x, recv_idx, recv_w, _, handle, _ = ht_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w, num_worst_tokens=worst)
        combined, combined_w, _ = ht_buffer.combine(expert_out(r, recv_x), handle, topk_weights=recv_w)
        return recv_x, recv_idx, combined, combined_w

    step()  # warm-up (JIT, allocations) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_idx, combined, combined_w = step()
    for seed in (31, 32):
        everyone = all_inputs(HT_SMALL, nr, seed)
        x.copy_(env.to(everyone[r].x))
        idx.copy_(env.to(everyone[r].topk_idx))
        w.copy_(env.to(everyone[r].topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        want = ht_dispatch(everyone, r, e)
        n = want.num_rows
        same(recv_x[:n], want.x, f"recv_x (replay, seed {seed})")
        same(recv_idx[:n], want.topk_idx, f"recv_topk_idx (replay, seed {seed})")
        assert bool((recv_idx[n:] == -1).all()), "rows past the received count must have recv_topk_idx = -1"
        received = [ht_dispatch(everyone, k, e) for k in range(nr)]
        want_x, want_w = ht_combine([(rec, expert_out(k, rec.x), rec.topk_weights) for k, rec in enumerate(received)],
                                    r, everyone[r].x.shape[0])
        same(combined, want_x, f"combined_x (replay, seed {seed})")
        same(combined_w, want_w, f"combined_topk_weights (replay, seed {seed})")
