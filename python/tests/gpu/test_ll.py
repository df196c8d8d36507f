"""Low-latency API (dispatch in every payload mode, combine, hooks, zero-copy, stats, events, masks,
CUDA graphs) against plain-torch semantics."""

from __future__ import annotations

from typing import List

import pytest
import torch

import moelink
from reference import ExpertFn, RankInputs, fp8_quantize, ll_combine, ll_dispatch, make_inputs, ue8m0_pack
from test_ht import same

T_MAX = 32
HIDDEN = 1024
TOPK = 4


def experts_for(num_ranks: int) -> int:
    return 8 * num_ranks


def all_inputs(num_ranks: int, seed: int) -> List[RankInputs]:
    # Ranks dispatch different token counts (all <= T_MAX).
    return [make_inputs(r, T_MAX - 5 - 3 * r % 7, HIDDEN, experts_for(num_ranks), TOPK, seed) for r in range(num_ranks)]


def check_dispatch(env, inputs, recv_x, recv_count, mode: str, masked=()) -> None:
    r, nr = env.rank, env.num_ranks
    e_local, rows = experts_for(nr) // nr, nr * T_MAX
    want = ll_dispatch(inputs, r, experts_for(nr), masked)
    same(recv_count, torch.tensor(want.recv_count, dtype=torch.int32), "recv_count")
    fp8 = mode != "bf16"
    data, scales = recv_x if fp8 else (recv_x, None)
    assert tuple(data.shape) == (e_local, rows, HIDDEN)
    assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    quant = [fp8_quantize(inp.x, round_scale=mode in ("fp8-round", "ue8m0")) for inp in inputs] if fp8 else None
    if fp8:
        packs = HIDDEN // 512 if mode == "ue8m0" else HIDDEN // 128
        assert tuple(scales.shape) == (e_local, rows, packs)
        assert scales.stride() == (packs * rows, 1, rows), "scales are column-major in the last two dims"
        assert scales.dtype == (torch.int32 if mode == "ue8m0" else torch.float32)
    for e, srcs in enumerate(want.src):
        n = len(srcs)
        if n == 0:
            continue
        if not fp8:
            same(data[e, :n], torch.stack([inputs[s].x[t] for s, t, _ in srcs]), f"recv_x[{e}]")
            continue
        same(data[e, :n], torch.stack([quant[s][0][t] for s, t, _ in srcs]), f"recv_x[{e}] (fp8)")
        inv = torch.stack([quant[s][1][t] for s, t, _ in srcs])
        want_scales = ue8m0_pack(inv) if mode == "ue8m0" else inv
        same(scales[e, :n], want_scales, f"recv_x scales[{e}]")


MODES = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8-round": dict(use_fp8=True, round_scale=True),
    "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_ll_dispatch_modes(env, ll_buffer, mode):
    inputs = all_inputs(env.num_ranks, seed=11)
    mine = inputs[env.rank]
    recv_x, recv_count, handle, event, hook = ll_buffer.low_latency_dispatch(
        env.to(mine.x), env.to(mine.topk_idx), T_MAX, experts_for(env.num_ranks), **MODES[mode])
    assert hook is None and isinstance(event, moelink.EventOverlap)
    assert isinstance(recv_x, tuple) == (mode != "bf16")
    check_dispatch(env, inputs, recv_x, recv_count, mode)


def expert_outputs(env, recv_x: torch.Tensor, recv_count: torch.Tensor) -> torch.Tensor:
    """What this rank's experts return: ExpertFn of each valid row; rows past the count are garbage."""
    e_local = recv_x.shape[0]
    out = torch.randn(recv_x.shape, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    out = env.to(out)
    for e in range(e_local):
        n = int(recv_count[e])
        g = env.rank * e_local + e
        out[e, :n] = (recv_x[e, :n].float() * ((g + 1) / 8)).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("pre_reduced", [False, True])
@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_ll_combine(env, ll_buffer, pre_reduced, zero_copy, with_out):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    inputs = all_inputs(nr, seed=12)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(
        x, idx, T_MAX, e, use_fp8=False, topk_weights=w if pre_reduced else None)
    y = expert_outputs(env, recv_x, recv_count)
    if zero_copy:
        staging = ll_buffer.get_next_low_latency_combine_buffer(handle)
        assert tuple(staging.shape) == tuple(y.shape) and staging.dtype == torch.bfloat16
        staging.copy_(y)
    out = env.to(torch.empty(mine.x.shape, dtype=torch.bfloat16)) if with_out else None
    combined, event, hook = ll_buffer.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy, out=out)
    assert hook is None
    if with_out:
        assert combined is out
    want = ll_combine(mine, ExpertFn(), r, e, nr, pre_reduced)
    same(combined, want, f"combined_x (pre_reduced={pre_reduced}, zero_copy={zero_copy})")


def test_ll_stats(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    inputs = all_inputs(nr, seed=13)
    mine = inputs[r]
    cumulative = env.to(torch.zeros(e // nr, dtype=torch.int32))
    wait = env.to(torch.zeros(nr, dtype=torch.int64))
    for _ in range(2):
        recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(
            env.to(mine.x), env.to(mine.topk_idx), T_MAX, e, cumulative_local_expert_recv_stats=cumulative,
            dispatch_wait_recv_cost_stats=wait, use_fp8=False)
    same(cumulative, (recv_count * 2).cpu(), "cumulative_local_expert_recv_stats")
    assert bool((wait >= 0).all())
    combine_wait = env.to(torch.zeros(nr, dtype=torch.int64))
    ll_buffer.low_latency_combine(recv_x, env.to(mine.topk_idx), env.to(mine.topk_weights), handle,
                                  combine_wait_recv_cost_stats=combine_wait)
    assert bool((combine_wait >= 0).all())


def test_ll_receive_hooks(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    inputs = all_inputs(nr, seed=14)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, event, hook = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=True,
                                                                            return_recv_hook=True)
    assert callable(hook) and event.event is None
    hook()
    check_dispatch(env, inputs, recv_x, recv_count, "fp8")
    with pytest.raises(ValueError) as err:
        hook()  # a receive phase runs once
    assert err.value.argument == "hook"

    recv_x, recv_count, handle, _, hook = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False,
                                                                        return_recv_hook=True)
    hook()
    y = expert_outputs(env, recv_x, recv_count)
    combined, event, hook = ll_buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
    assert callable(hook)
    hook()
    same(combined, ll_combine(mine, ExpertFn(), r, e, nr, False), "combined_x (hook)")

    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, async_finish=True, return_recv_hook=True)
    assert err.value.argument == "return_recv_hook"
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_combine(y, idx, w, handle, use_logfmt=True)
    assert err.value.argument == "use_logfmt"


def test_ll_async_finish(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    inputs = all_inputs(nr, seed=15)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, event, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False, async_finish=True)
    with event:
        pass
    if env.cuda:
        assert event.event is not None and event.extra_tensors
    check_dispatch(env, inputs, recv_x, recv_count, "bf16")
    y = expert_outputs(env, recv_x, recv_count)
    combined, event, _ = ll_buffer.low_latency_combine(y, idx, w, handle, async_finish=True)
    event.current_stream_wait()
    same(combined, ll_combine(mine, ExpertFn(), r, e, nr, False), "combined_x (async)")


def test_ll_errors_name_the_argument(env, ll_buffer):
    nr = env.num_ranks
    e = experts_for(nr)
    inp = make_inputs(env.rank, T_MAX + 1, HIDDEN, e, TOPK, 16)
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), T_MAX, e)
    assert err.value.argument == "x"  # more tokens than num_max_dispatch_tokens_per_rank
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4]), T_MAX, e, use_fp8=True, use_ue8m0=True)
    assert err.value.argument == "use_ue8m0"
    with pytest.raises(TypeError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4].int()), T_MAX, e)
    assert err.value.argument == "topk_idx"


def test_clean_low_latency_buffer(env, ll_buffer):
    ll_buffer.clean_low_latency_buffer(T_MAX, HIDDEN, experts_for(env.num_ranks))
    inputs = all_inputs(env.num_ranks, seed=17)
    mine = inputs[env.rank]
    recv_x, recv_count, *_ = ll_buffer.low_latency_dispatch(env.to(mine.x), env.to(mine.topk_idx), T_MAX,
                                                            experts_for(env.num_ranks), use_fp8=False)
    check_dispatch(env, inputs, recv_x, recv_count, "bf16")


def test_shrink_masks(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_update_mask_buffer(0, True)
    assert err.value.argument == "enable_shrink"
    hint = moelink.Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, nr, e)
    buf = moelink.Buffer(env.group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True)
    status = env.to(torch.zeros(nr, dtype=torch.int32))
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * nr
    buf.low_latency_update_mask_buffer(nr - 1, True)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * (nr - 1) + [1]
    inputs = all_inputs(nr, seed=18)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
    check_dispatch(env, inputs, recv_x, recv_count, "bf16", masked=[nr - 1])
    combined, _, _ = buf.low_latency_combine(expert_outputs(env, recv_x, recv_count), idx, w, handle)
    same(combined, ll_combine(mine, ExpertFn(), r, e, nr, False, masked=[nr - 1]), "combined_x (masked)")
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * nr
    buf.destroy()


def test_ll_cuda_graph_capture_replay(env, ll_buffer):
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend")
    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    first = all_inputs(nr, seed=19)
    x, idx, w = env.to(first[r].x), env.to(first[r].topk_idx), env.to(first[r].topk_weights)
    scale = env.to(torch.tensor([(r * (e // nr) + k + 1) / 8 for k in range(e // nr)]).view(-1, 1, 1))

    def step():
        recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
        y = (recv_x.float() * scale).to(torch.bfloat16)
        combined, _, _ = ll_buffer.low_latency_combine(y, idx, w, handle)
        return recv_count, combined

    step()  # warm-up (JIT, buffers) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_count, combined = step()
    for seed in (20, 21):
        # The graph's shapes are fixed: same token counts, new values and routing.
        everyone = [make_inputs(k, first[k].x.shape[0], HIDDEN, e, TOPK, seed) for k in range(nr)]
        x.copy_(env.to(everyone[r].x))
        idx.copy_(env.to(everyone[r].topk_idx))
        w.copy_(env.to(everyone[r].topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        same(recv_count, torch.tensor(ll_dispatch(everyone, r, e).recv_count, dtype=torch.int32), "recv_count (replay)")
        same(combined, ll_combine(everyone[r], ExpertFn(), r, e, nr, False), "combined_x (replay)")


def test_ht_no_sync_cuda_graph_capture_replay(env, ht_buffer):
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend")
    from reference import ht_combine, ht_dispatch

    r, nr = env.rank, env.num_ranks
    e = experts_for(nr)
    tokens = 24
    worst = nr * tokens
    inp = make_inputs(r, tokens, 256, e, TOPK, 30)
    x, idx, w = env.to(inp.x), env.to(inp.topk_idx), env.to(inp.topk_weights)

    def step():
        per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
        recv_x, recv_idx, recv_w, _, handle, _ = ht_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w, num_worst_tokens=worst)
        combined, _, _ = ht_buffer.combine((recv_x.float() * ((r + 1) / 4)).to(torch.bfloat16), handle)
        return combined

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        combined = step()
    for seed in (31, 32):
        new = make_inputs(r, tokens, 256, e, TOPK, seed)
        x.copy_(env.to(new.x))
        idx.copy_(env.to(new.topk_idx))
        w.copy_(env.to(new.topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        everyone = [make_inputs(k, tokens, 256, e, TOPK, seed) for k in range(nr)]
        received = [ht_dispatch(everyone, k, e) for k in range(nr)]
        want, _ = ht_combine([(rec, (rec.x.float() * ((k + 1) / 4)).to(torch.bfloat16), None) for k, rec in enumerate(received)],
                             r, tokens)
        same(combined, want, "combined_x (HT no-sync replay)")
