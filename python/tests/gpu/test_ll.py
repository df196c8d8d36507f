"""Low-latency API (dispatch in every payload mode, combine, hooks, zero-copy, stats, events, masks, CUDA
graphs) against the plain-torch semantics of reference.py, bit for bit. One realistic shape throughout
(hidden 7168, top-8), so that the GPU compiles two kernel variants (BF16 and FP8) for all of it."""

from __future__ import annotations

from typing import List

import pytest
import torch

import moelink
from checks import LL, same
from reference import RankInputs, expert_fn, fp8_quantize, ll_combine, ll_dispatch, make_inputs, ue8m0_pack

T_MAX = LL.tokens


def num_experts(env) -> int:
    return LL.num_experts(env.num_ranks)


def all_inputs(num_ranks: int, seed: int) -> List[RankInputs]:
    # Ranks dispatch different token counts (all <= T_MAX).
    return [make_inputs(r, T_MAX - 5 - 3 * r % 7, LL.hidden, LL.num_experts(num_ranks), LL.topk, seed)
            for r in range(num_ranks)]


def valid_rows(recv_count: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [E_local, rows]: the rows below each local expert's count."""
    return torch.arange(rows).unsqueeze(0) < recv_count.cpu().to(torch.int64).unsqueeze(1)


def check_dispatch(env, inputs, recv_x, recv_count, mode: str, masked=(), what: str = "") -> None:
    r, nr = env.rank, env.num_ranks
    e_local, rows = num_experts(env) // nr, nr * T_MAX
    want = ll_dispatch(inputs, r, num_experts(env), masked)
    what = f"{mode}{', ' + what if what else ''}"
    same(recv_count, torch.tensor(want.recv_count, dtype=torch.int32), f"recv_count ({what})")
    fp8 = mode != "bf16"
    data, scales = recv_x if fp8 else (recv_x, None)
    assert tuple(data.shape) == (e_local, rows, LL.hidden)
    assert data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    valid = valid_rows(recv_count, rows)
    if not fp8:
        same(data.cpu()[valid], want.rows([inp.x for inp in inputs]), f"recv_x ({what})")
        return
    packs = LL.hidden // 512 if mode == "ue8m0" else LL.hidden // 128
    assert tuple(scales.shape) == (e_local, rows, packs)
    assert scales.stride() == (packs * rows, 1, rows), "scales are column-major in the last two dims"
    assert scales.dtype == (torch.int32 if mode == "ue8m0" else torch.float32)
    quant = [fp8_quantize(inp.x, round_scale=mode in ("fp8-round", "ue8m0")) for inp in inputs]
    same(data.cpu()[valid], want.rows([q for q, _ in quant]), f"recv_x ({what})")
    inv = want.rows([s for _, s in quant])
    same(scales.cpu()[valid], ue8m0_pack(inv) if mode == "ue8m0" else inv, f"recv_x scales ({what})")


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
        env.to(mine.x), env.to(mine.topk_idx), T_MAX, num_experts(env), **MODES[mode])
    assert hook is None and isinstance(event, moelink.EventOverlap) and event.event is None
    assert isinstance(recv_x, tuple) == (mode != "bf16")
    assert isinstance(handle, moelink.buffer.LowLatencyHandle) and handle.num_tokens == mine.x.shape[0]
    check_dispatch(env, inputs, recv_x, recv_count, mode)


def expert_outputs(env, recv_x: torch.Tensor, recv_count: torch.Tensor) -> torch.Tensor:
    """What this rank's experts return: reference.expert_fn of each valid row; rows past the counts are NaN,
    which the combine must not read. Device work only (no host sync), so that it can be graph-captured."""
    e_local, rows = recv_x.shape[0], recv_x.shape[1]
    global_expert = torch.arange(e_local, device=recv_x.device) + env.rank * e_local
    y = expert_fn(recv_x, global_expert.view(-1, 1))
    valid = torch.arange(rows, device=recv_x.device).view(1, -1) < recv_count.view(-1, 1)
    return torch.where(valid.unsqueeze(2), y, torch.full_like(y, float("nan")))


@pytest.mark.parametrize("pre_reduced", [False, True])
def test_ll_combine(env, ll_buffer, pre_reduced):
    """Plain and pre-reduced combine (dispatch carried the weights), each with and without zero-copy and a
    caller-provided output."""
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    inputs = all_inputs(nr, seed=12)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    want = ll_combine(mine, r, e, nr, pre_reduced)
    for zero_copy in (False, True):
        for with_out in (False, True):
            what = f"pre_reduced={pre_reduced}, zero_copy={zero_copy}, out={with_out}"
            recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(
                x, idx, T_MAX, e, use_fp8=False, topk_weights=w if pre_reduced else None)
            y = expert_outputs(env, recv_x, recv_count)
            if zero_copy:
                staging = ll_buffer.get_next_low_latency_combine_buffer(handle)
                assert tuple(staging.shape) == tuple(y.shape) and staging.dtype == torch.bfloat16, what
                staging.copy_(y)
            out = env.to(torch.empty(mine.x.shape, dtype=torch.bfloat16)) if with_out else None
            combined, event, hook = ll_buffer.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy, out=out)
            assert hook is None and isinstance(event, moelink.EventOverlap), what
            if with_out:
                assert combined is out, what
            same(combined, want, f"combined_x ({what})")


def test_ll_stats(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    mine = all_inputs(nr, seed=13)[r]
    cumulative = env.to(torch.zeros(e // nr, dtype=torch.int32))
    wait = env.to(torch.zeros(nr, dtype=torch.int64))
    for _ in range(2):
        recv_x, _, handle, _, _ = ll_buffer.low_latency_dispatch(
            env.to(mine.x), env.to(mine.topk_idx), T_MAX, e, cumulative_local_expert_recv_stats=cumulative,
            dispatch_wait_recv_cost_stats=wait, use_fp8=False)
    want_count = torch.tensor(ll_dispatch(all_inputs(nr, seed=13), r, e).recv_count, dtype=torch.int32)
    same(cumulative, want_count * 2, "cumulative_local_expert_recv_stats")
    assert bool((wait >= 0).all()), "wait statistics only grow"
    combine_wait = env.to(torch.zeros(nr, dtype=torch.int64))
    ll_buffer.low_latency_combine(recv_x, env.to(mine.topk_idx), env.to(mine.topk_weights), handle,
                                  combine_wait_recv_cost_stats=combine_wait)
    assert bool((combine_wait >= 0).all()), "wait statistics only grow"


def test_ll_receive_hooks(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    inputs = all_inputs(nr, seed=14)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, event, hook = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=True,
                                                                            return_recv_hook=True)
    assert callable(hook) and event.event is None
    hook()
    check_dispatch(env, inputs, recv_x, recv_count, "fp8", what="hook")
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
    same(combined, ll_combine(mine, r, e, nr, False), "combined_x (hook)")

    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, async_finish=True, return_recv_hook=True)
    assert err.value.argument == "return_recv_hook"
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_combine(y, idx, w, handle, use_logfmt=True)
    assert err.value.argument == "use_logfmt"


def test_ll_async_finish(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    inputs = all_inputs(nr, seed=15)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, event, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False, async_finish=True)
    with event:
        pass  # work that overlaps the dispatch would go here; the current stream waits on exit
    if env.cuda:
        assert event.event is not None and event.extra_tensors, "async_finish returns an event keeping the tensors alive"
    else:
        assert event.event is None
    check_dispatch(env, inputs, recv_x, recv_count, "bf16", what="async")
    y = expert_outputs(env, recv_x, recv_count)
    combined, event, _ = ll_buffer.low_latency_combine(y, idx, w, handle, async_finish=True)
    event.current_stream_wait()
    same(combined, ll_combine(mine, r, e, nr, False), "combined_x (async)")


def test_ll_errors_name_the_argument(env, ll_buffer):
    e = num_experts(env)
    inp = make_inputs(env.rank, T_MAX + 1, LL.hidden, e, LL.topk, 16)
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x), env.to(inp.topk_idx), T_MAX, e)
    assert err.value.argument == "x"  # more tokens than num_max_dispatch_tokens_per_rank
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4]), T_MAX, e, use_fp8=True, use_ue8m0=True)
    assert err.value.argument == "use_ue8m0"  # UE8M0 needs round_scale
    with pytest.raises(TypeError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4].int()), T_MAX, e)
    assert err.value.argument == "topk_idx"
    with pytest.raises(TypeError) as err:
        ll_buffer.low_latency_combine(env.to(inp.x[:4]), env.to(inp.topk_idx[:4]), env.to(inp.topk_weights[:4]), "handle")
    assert err.value.argument == "handle"
    # Outputs no device holds are refused before torch allocates them, naming the argument that sizes them.
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4]), 1 << 40, e)
    assert err.value.argument == "num_max_dispatch_tokens_per_rank" and "bytes" in str(err.value)
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_dispatch(env.to(inp.x[:4]), env.to(inp.topk_idx[:4]), T_MAX, env.num_ranks << 42)
    assert err.value.argument == "num_experts" and "bytes" in str(err.value)


def test_clean_low_latency_buffer(env, ll_buffer):
    ll_buffer.clean_low_latency_buffer(T_MAX, LL.hidden, num_experts(env))
    inputs = all_inputs(env.num_ranks, seed=17)
    mine = inputs[env.rank]
    recv_x, recv_count, *_ = ll_buffer.low_latency_dispatch(env.to(mine.x), env.to(mine.topk_idx), T_MAX,
                                                            num_experts(env), use_fp8=False)
    check_dispatch(env, inputs, recv_x, recv_count, "bf16", what="after clean_low_latency_buffer")


def test_shrink_masks(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    with pytest.raises(ValueError) as err:
        ll_buffer.low_latency_update_mask_buffer(0, True)
    assert err.value.argument == "enable_shrink"
    hint = moelink.Buffer.get_low_latency_rdma_size_hint(T_MAX, LL.hidden, nr, e)
    buf = moelink.Buffer(env.group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True)
    try:
        assert buf.enable_shrink is True
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
        check_dispatch(env, inputs, recv_x, recv_count, "bf16", masked=[nr - 1], what=f"rank {nr - 1} masked")
        combined, _, _ = buf.low_latency_combine(expert_outputs(env, recv_x, recv_count), idx, w, handle)
        same(combined, ll_combine(mine, r, e, nr, False, masked=[nr - 1]), "combined_x (masked)")
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * nr
        recv_x, recv_count, *_ = buf.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
        check_dispatch(env, inputs, recv_x, recv_count, "bf16", what="unmasked again")
    finally:
        buf.destroy()


def test_ll_cuda_graph_capture_replay(env, ll_buffer):
    """An FP8 (UE8M0) dispatch, a BF16 dispatch carrying weights, the experts and a pre-reduced combine
    captured in one CUDA graph, then replayed with new values and routing (same token counts), checked
    against the reference each time."""
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend; this run uses the host backend (CPU tensors)")
    r, nr = env.rank, env.num_ranks
    e = num_experts(env)
    first = all_inputs(nr, seed=19)
    x, idx, w = env.to(first[r].x), env.to(first[r].topk_idx), env.to(first[r].topk_weights)

    def step():
        fp8_x, fp8_count, _, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, **MODES["ue8m0"])
        recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False, topk_weights=w)
        y = expert_outputs(env, recv_x, recv_count)
        combined, _, _ = ll_buffer.low_latency_combine(y, idx, w, handle)
        return fp8_x, fp8_count, recv_x, recv_count, combined

    step()  # warm-up (JIT, allocations) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_x, fp8_count, recv_x, recv_count, combined = step()
    for seed in (20, 21):
        everyone = all_inputs(nr, seed)
        x.copy_(env.to(everyone[r].x))
        idx.copy_(env.to(everyone[r].topk_idx))
        w.copy_(env.to(everyone[r].topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        check_dispatch(env, everyone, fp8_x, fp8_count, "ue8m0", what=f"replay, seed {seed}")
        check_dispatch(env, everyone, recv_x, recv_count, "bf16", what=f"replay, seed {seed}")
        same(combined, ll_combine(everyone[r], r, e, nr, True), f"combined_x (replay, seed {seed})")
