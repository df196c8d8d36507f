"""High-throughput API (layout, dispatch, combine, cached, no-sync, FP8, events) against plain-torch semantics."""

from __future__ import annotations

from typing import List

import pytest
import torch

import moelink
from reference import RankInputs, ht_combine, ht_dispatch, layout, make_inputs


def experts_for(num_ranks: int) -> int:
    return 8 * num_ranks


def all_inputs(num_ranks: int, tokens: int, hidden: int, topk: int, seed: int) -> List[RankInputs]:
    return [make_inputs(r, tokens + 3 * r, hidden, experts_for(num_ranks), topk, seed) for r in range(num_ranks)]


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want) if got.dtype != torch.bool else (got ^ want)
        if bad.dim() > 1:
            bad = bad.flatten(1).any(1)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} rows differ (first: {torch.nonzero(bad).flatten()[:5].tolist()})")


def fresh(buf: moelink.Buffer, env, inp: RankInputs, **kw):
    idx = env.to(inp.topk_idx)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts_for(env.num_ranks))
    x = kw.pop("x", env.to(inp.x))
    return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=env.to(inp.topk_weights), **kw)


def test_layout(env, ht_buffer):
    e = experts_for(env.num_ranks)
    for seed in range(3):
        inp = make_inputs(env.rank, 77, 128, e, 6, seed, drop=0.3)
        per_rank, rdma, per_expert, in_rank, event = ht_buffer.get_dispatch_layout(env.to(inp.topk_idx), e)
        want = layout(inp.topk_idx, e, env.num_ranks)
        assert rdma is None
        assert isinstance(event, moelink.EventOverlap)
        assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        same(per_rank, want[0], "num_tokens_per_rank")
        same(per_expert, want[1], "num_tokens_per_expert")
        same(in_rank, want[2], "is_token_in_rank")


@pytest.mark.parametrize("expert_alignment", [1, 4])
@pytest.mark.parametrize("bias_kind", ["none", "one", "two"])
def test_dispatch_combine_bf16(env, ht_buffer, expert_alignment, bias_kind):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 64, 256, 4, seed=1)
    mine = inputs[r]
    recv_x, recv_idx, recv_w, per_expert, handle, event = fresh(ht_buffer, env, mine, expert_alignment=expert_alignment)
    want = ht_dispatch(inputs, r, experts_for(nr), expert_alignment)
    same(recv_x, want.x, "recv_x")
    same(recv_idx, want.topk_idx, "recv_topk_idx")
    same(recv_w, want.topk_weights, "recv_topk_weights")
    assert per_expert == want.num_recv_tokens_per_expert
    assert isinstance(per_expert, list)

    # Experts' outputs: rank-dependent scaling of what arrived; gradients of the weights: doubled weights.
    def returned(rank: int, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * ((rank + 1) / 4)).to(torch.bfloat16)

    g = torch.Generator().manual_seed(5 + r)
    t, h = mine.x.shape
    biases = [torch.randn(t, h, generator=g).to(torch.bfloat16) for _ in range({"none": 0, "one": 1, "two": 2}[bias_kind])]
    bias = None if not biases else env.to(biases[0]) if len(biases) == 1 else tuple(env.to(b) for b in biases)
    combined, combined_w, _ = ht_buffer.combine(returned(r, recv_x), handle, topk_weights=recv_w * 2, bias=bias)
    received = [ht_dispatch(inputs, k, experts_for(nr)) for k in range(nr)]
    want_x, want_w = ht_combine([(rec, returned(k, rec.x), rec.topk_weights * 2) for k, rec in enumerate(received)], r, t, biases)
    same(combined, want_x, "combined_x")
    same(combined_w, want_w, "combined_topk_weights")
    assert combined.dtype == torch.bfloat16 and combined_w.dtype == torch.float32


def test_dispatch_fp8_any_stride_scales(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 48, 512, 4, seed=2)
    fp8 = [inp.x.float().clamp(-400, 400).to(torch.float8_e4m3fn) for inp in inputs]
    scales = [torch.rand(inp.x.shape[1] // 128, inp.x.shape[0], generator=torch.Generator().manual_seed(k)).t()
              for k, inp in enumerate(inputs)]  # column-major [T, H/128]
    assert not scales[r].is_contiguous()
    (recv_x, recv_s), recv_idx, _, per_expert, handle, _ = fresh(ht_buffer, env, inputs[r], x=(env.to(fp8[r]), env.to(scales[r])))
    same(recv_x, ht_dispatch(inputs, r, experts_for(nr), payloads=fp8).x, "recv_x (fp8)")
    same(recv_s, ht_dispatch(inputs, r, experts_for(nr), payloads=[s.contiguous() for s in scales]).x, "recv_x scales")
    assert recv_x.dtype == torch.float8_e4m3fn and recv_s.dtype == torch.float32
    # Cached FP8 dispatch keeps the tuple.
    out = ht_buffer.dispatch((env.to(fp8[r]), env.to(scales[r])), handle=handle)
    assert isinstance(out[0], tuple) and out[1:5] == (None, None, None, None)
    same(out[0][0], recv_x.cpu(), "cached recv_x (fp8)")
    same(out[0][1], recv_s.cpu(), "cached scales")


def test_dispatch_without_topk_and_cached(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 40, 128, 3, seed=3)
    idx = env.to(inputs[r].topk_idx)
    per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, experts_for(nr))
    recv_x, recv_idx, recv_w, counts, handle, _ = ht_buffer.dispatch(
        env.to(inputs[r].x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    want = ht_dispatch(inputs, r, experts_for(nr))
    assert recv_idx is None and recv_w is None
    same(recv_x, want.x, "recv_x")
    assert counts == want.num_recv_tokens_per_expert
    # The backward of combine: a cached dispatch of other rows along the same routing.
    grads = [torch.randn(inp.x.shape, generator=torch.Generator().manual_seed(50 + k)).to(torch.bfloat16)
             for k, inp in enumerate(inputs)]
    recv_g, a, b, c, d, event = ht_buffer.dispatch(env.to(grads[r]), handle=handle)
    assert (a, b, c, d) == (None, None, None, None) and isinstance(event, moelink.EventOverlap)
    same(recv_g, ht_dispatch(inputs, r, experts_for(nr), payloads=grads).x, "cached recv_x")


def test_no_sync_worst_case_rows(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 32, 256, 4, seed=4)
    worst = sum(inp.x.shape[0] for inp in inputs)
    recv_x, recv_idx, recv_w, counts, handle, _ = fresh(ht_buffer, env, inputs[r], num_worst_tokens=worst)
    want = ht_dispatch(inputs, r, experts_for(nr))
    n = len(want.src)
    assert recv_x.shape[0] == worst and recv_idx.shape[0] == worst and counts == []
    same(recv_x[:n], want.x, "recv_x")
    same(recv_idx[:n], want.topk_idx, "recv_topk_idx")
    same(recv_w[:n], want.topk_weights, "recv_topk_weights")
    assert bool((recv_idx[n:] == -1).all()), "rows past the received count must have recv_topk_idx = -1"
    combined, _, _ = ht_buffer.combine(recv_x, handle)
    received = [ht_dispatch(inputs, k, experts_for(nr)) for k in range(nr)]
    want_x, _ = ht_combine([(rec, rec.x, None) for rec in received], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (no-sync)")


def test_overlap_events_and_comm_stream_allocation(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 50, 128, 4, seed=6)
    e = experts_for(nr)
    idx = env.to(inputs[r].topk_idx)
    previous = moelink.Buffer.capture()
    per_rank, _, per_expert, in_rank, ev = ht_buffer.get_dispatch_layout(idx, e, previous_event=previous, async_finish=True,
                                                                         allocate_on_comm_stream=True)
    ev.current_stream_wait()
    recv_x, recv_idx, recv_w, counts, handle, ev = ht_buffer.dispatch(
        env.to(inputs[r].x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=env.to(inputs[r].topk_weights), previous_event=moelink.Buffer.capture(),
        async_finish=True, allocate_on_comm_stream=True)
    with ev:
        pass  # work that overlaps the dispatch would go here
    if env.cuda:
        assert ev.event is not None and ev.extra_tensors, "async_finish returns an event keeping the tensors alive"
        assert isinstance(ht_buffer.get_comm_stream(), torch.cuda.Stream)
    else:
        assert ev.event is None and ht_buffer.get_comm_stream() is None
    want = ht_dispatch(inputs, r, e)
    same(recv_x, want.x, "recv_x (async)")
    combined, _, ev = ht_buffer.combine(recv_x, handle, async_finish=True, allocate_on_comm_stream=True)
    ev.current_stream_wait()
    received = [ht_dispatch(inputs, k, e) for k in range(nr)]
    want_x, _ = ht_combine([(rec, rec.x, None) for rec in received], r, inputs[r].x.shape[0])
    same(combined, want_x, "combined_x (async)")


def test_config_num_sms(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    inputs = all_inputs(nr, 16, 128, 2, seed=7)
    for sms in (2, 8, 24):
        recv_x, *_ = fresh(ht_buffer, env, inputs[r], config=moelink.Config(sms))
        same(recv_x, ht_dispatch(inputs, r, experts_for(nr)).x, f"recv_x with {sms} SMs")
    with pytest.raises(ValueError) as err:
        fresh(ht_buffer, env, inputs[r], config=moelink.Config(num_sms=3))
    assert err.value.argument == "config.num_sms"
    with pytest.raises(ValueError):
        moelink.Buffer.set_num_sms(5)
    old = moelink.Buffer.num_sms
    moelink.Buffer.set_num_sms(24)
    assert moelink.Buffer.get_dispatch_config(nr).num_sms == 24
    moelink.Buffer.set_num_sms(old)
    assert moelink.Buffer.get_combine_config(nr).num_sms == old


def test_argument_errors_name_the_argument(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    inp = make_inputs(r, 8, 128, e, 2, 8)
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
    raises(TypeError, "handle", ht_buffer.combine, env.to(inp.x), handle=None)
    raises(ValueError, "num_experts", ht_buffer.get_dispatch_layout, idx, e + 1)
    raises(ValueError, "expert_alignment", ht_buffer.dispatch, env.to(inp.x), **lay, expert_alignment=0)
    raises(TypeError, "x", ht_buffer.dispatch, "not a tensor", **lay)
    if env.cuda:
        raises(ValueError, "x", ht_buffer.dispatch, inp.x, **lay)  # a CPU tensor on a CUDA buffer
    else:
        raises(ValueError, "topk_idx", ht_buffer.get_dispatch_layout, torch.full_like(inp.topk_idx, e), e)
    # Nothing above reached a collective: the buffer still works.
    recv_x, *_ = ht_buffer.dispatch(env.to(inp.x), **lay)
    assert recv_x.shape[1] == 128


def test_local_buffer_tensor(env, ht_buffer):
    if not env.cuda:
        with pytest.raises(RuntimeError):
            ht_buffer.get_local_buffer_tensor(torch.int32)
        return
    whole = ht_buffer.get_local_buffer_tensor(torch.uint8)
    assert whole.numel() == ht_buffer.num_nvl_bytes and whole.device == env.device
    part = ht_buffer.get_local_buffer_tensor(torch.int32, torch.Size([4, 4]), offset=8)
    part.fill_(env.rank + 1)
    assert int(whole[32:96].view(torch.int32).sum()) == 16 * (env.rank + 1)
    with pytest.raises(ValueError) as err:
        ht_buffer.get_local_buffer_tensor(torch.int32, torch.Size([ht_buffer.num_nvl_bytes]))
    assert err.value.argument == "size"
