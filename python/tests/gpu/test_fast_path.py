"""Calls without events (no ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream``) take the fast
path: the caller's stream, one native call, outputs of earlier calls reused once nothing references them. They
return exactly what the same calls with events return (the communication stream, events, fresh outputs: the
path every call took before), bit for bit; reuse never hands out a tensor that anything still holds; and
``num_qps_per_rank`` takes DeepEP's values."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import moelink
from checks import HT_SMALL, LL, same
from test_ht import all_inputs as ht_inputs
from test_ll import all_inputs as ll_inputs
from test_ll import valid_rows

T_MAX = LL.tokens


def equal(got: Any, want: Any, what: str) -> None:
    """Tensors (or tuples/lists of them, None alike) bit for bit."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            equal(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        same(got, want.detach().cpu(), what)
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def waited(result: Any) -> Any:
    """A call's result once its event (the last element) has been waited for."""
    result[-1].current_stream_wait()
    return result


def test_ht_fast_path_equals_event_path(env, ht_buffer):
    e = HT_SMALL.num_experts(env.num_ranks)
    mine = ht_inputs(HT_SMALL, env.num_ranks, seed=43)[env.rank]
    idx, w, x = env.to(mine.topk_idx), env.to(mine.topk_weights), env.to(mine.x)
    fast = ht_buffer.get_dispatch_layout(idx, e)
    equal(fast[:4], waited(ht_buffer.get_dispatch_layout(idx, e, async_finish=True))[:4], "layout")
    kw = dict(num_tokens_per_rank=fast[0], num_tokens_per_rdma_rank=fast[1], is_token_in_rank=fast[3],
              num_tokens_per_expert=fast[2], topk_idx=idx, topk_weights=w)
    got = ht_buffer.dispatch(x, **kw)
    for how in (dict(async_finish=True), dict(previous_event=moelink.Buffer.capture()),
                dict(allocate_on_comm_stream=True, previous_event=moelink.Buffer.capture())):
        want = waited(ht_buffer.dispatch(x, **kw, **how))
        equal(got[:4], want[:4], f"dispatch outputs ({how})")
        equal(tuple(got[4]), tuple(want[4]), f"dispatch handle ({how})")
    recv_x, _, _, _, handle, _ = got
    x8 = (x.float().clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(x.shape[0], x.shape[1] // 128).to(env.device) + 1)
    for payload, what in ((x, "bf16"), (x8, "fp8")):
        cached = ht_buffer.dispatch(payload, handle=handle)
        equal(cached[0], waited(ht_buffer.dispatch(payload, handle=handle, async_finish=True))[0], f"cached {what}")
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    combined = ht_buffer.combine(y, handle, topk_weights=got[2])
    equal(combined[:2], waited(ht_buffer.combine(y, handle, topk_weights=got[2], async_finish=True))[:2], "combine")


def test_ll_fast_path_equals_event_path(env, ll_buffer):
    e = LL.num_experts(env.num_ranks)
    rows = env.num_ranks * T_MAX
    mine = ll_inputs(env.num_ranks, seed=45)[env.rank]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    for use_fp8 in (False, True):
        got = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=use_fp8)
        want = waited(ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=use_fp8, async_finish=True)[:4])
        equal(got[1], want[1], "recv_count")
        valid = valid_rows(got[1], rows)
        for g, wt, what in zip(got[0] if use_fp8 else (got[0],), want[0] if use_fp8 else (want[0],), ("recv_x", "scales")):
            g, wt = g.cpu(), wt.cpu()
            if g.dtype == torch.float8_e4m3fn:
                g, wt = g.view(torch.uint8), wt.view(torch.uint8)
            equal(g[valid], wt[valid], f"{what} (fp8 {use_fp8})")
        equal(got[2][0].cpu()[valid], want[2][0].cpu()[valid], "src_info")
        equal(got[2][1:], want[2][1:], "handle (layout_range, sizes)")
    recv_x, _, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
    combined, _, _ = ll_buffer.low_latency_combine(recv_x, idx, w, handle)
    equal(combined, waited(ll_buffer.low_latency_combine(recv_x, idx, w, handle, async_finish=True)[:2])[0], "combine")


def test_outputs_are_reused_only_when_unreferenced(env, ht_buffer, ll_buffer):
    if ht_buffer._reuse is None:
        pytest.skip("this torch cannot tell whether a tensor is referenced (torch._C._storage_Use_Count)")
    e = HT_SMALL.num_experts(env.num_ranks)
    idx = env.to(ht_inputs(HT_SMALL, env.num_ranks, seed=47)[env.rank].topk_idx)
    want = [t.clone() for t in ht_buffer.get_dispatch_layout(idx, e)[:4] if t is not None]
    first = ht_buffer.get_dispatch_layout(idx, e)
    ptr = first[3].data_ptr()
    del first
    again = ht_buffer.get_dispatch_layout(idx, e)  # nothing holds the first set: it comes back, rewritten
    assert again[3].data_ptr() == ptr, "an unreferenced output set is reused"
    equal([t for t in again[:4] if t is not None], want, "reused layout outputs")
    # Whatever still reaches a set keeps it out of reuse: the tensor, a view, an alias of its storage.
    for hold in (lambda s: s[3], lambda s: s[3][1:], lambda s: s[3].detach(), lambda s: s[0].untyped_storage()):
        held = hold(again)
        busy = again[3].data_ptr(), again[0].data_ptr()
        del again
        other = ht_buffer.get_dispatch_layout(idx, e)
        assert other[3].data_ptr() != busy[0] and other[0].data_ptr() != busy[1], "a held output was handed out again"
        equal([t for t in other[:4] if t is not None], want, "layout outputs beside a held set")
        del held
        again = other
    # Low latency: recv_x comes back once dropped, not while a result still holds it.
    mine = ll_inputs(env.num_ranks, seed=49)[env.rank]
    x, idx = env.to(mine.x), env.to(mine.topk_idx)
    n = LL.num_experts(env.num_ranks)
    out = ll_buffer.low_latency_dispatch(x, idx, T_MAX, n, use_fp8=False)
    ptr = out[0].data_ptr()
    second = ll_buffer.low_latency_dispatch(x, idx, T_MAX, n, use_fp8=False)
    assert second[0].data_ptr() != ptr, "recv_x still held by a result"
    del out
    third = ll_buffer.low_latency_dispatch(x, idx, T_MAX, n, use_fp8=False)
    assert third[0].data_ptr() == ptr, "recv_x comes back once dropped"
    del second, third


def test_kept_sets_give_back_handle_memory_only_when_unreferenced():
    """What a CUDA graph capture relies on (`_Reuse.release`): a kept set that nobody references drops the
    native routing its carrier tensor holds, so that the routing's pool memory is free for the captured call;
    a set still referenced keeps it."""
    if not hasattr(torch.Tensor, "_use_count"):
        pytest.skip("this torch cannot tell whether a tensor is referenced")
    from moelink.buffer import _NATIVE_ATTR, _Reuse

    class Routing:  # stands for the native handle: alive while something references it
        pass

    reuse = _Reuse()
    free, held = (torch.zeros(4), torch.zeros(2)), (torch.zeros(4), torch.zeros(2))
    for outs in (free, held):
        setattr(outs[0], _NATIVE_ATTR, Routing())
        reuse.keep(("k", id(outs)), outs)
    kept_free = getattr(free[0], _NATIVE_ATTR)
    hold = held[0]
    del free, held
    reuse.release(_NATIVE_ATTR)
    assert all(not hasattr(outs[0], _NATIVE_ATTR) for sets in reuse._sets.values() for outs, _ in sets if outs[0] is not hold)
    assert hasattr(hold, _NATIVE_ATTR), "a set still referenced keeps its routing"
    assert isinstance(kept_free, Routing)


def test_reuse_can_be_turned_off(env, ht_buffer):
    e = HT_SMALL.num_experts(env.num_ranks)
    idx = env.to(ht_inputs(HT_SMALL, env.num_ranks, seed=51)[env.rank].topk_idx)
    saved = moelink.Buffer._reuse_outputs
    moelink.Buffer._reuse_outputs = False
    try:
        first = ht_buffer.get_dispatch_layout(idx, e)
        want = [t.clone() for t in first[:4] if t is not None]
        ptrs = {t.data_ptr() for t in first[:4] if t is not None}
        del first
        again = ht_buffer.get_dispatch_layout(idx, e)
        # torch's allocator may hand the same memory back; what matters is that the values are right.
        equal([t for t in again[:4] if t is not None], want, "layout without reuse")
        assert ptrs  # (the fresh tensors were real allocations)
    finally:
        moelink.Buffer._reuse_outputs = saved


def test_refusals_before_the_native_call_name_the_argument(env, ht_buffer, ll_buffer):
    e = HT_SMALL.num_experts(env.num_ranks)
    mine = ht_inputs(HT_SMALL, env.num_ranks, seed=53)[env.rank]
    idx = env.to(mine.topk_idx)
    with pytest.raises(TypeError) as err:
        ht_buffer.get_dispatch_layout(idx.tolist(), e)
    assert err.value.argument == "topk_idx" and "expected a torch.Tensor, got list" in str(err.value)
    per_rank, per_node, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
    with pytest.raises(TypeError) as err:
        ht_buffer.dispatch(env.to(mine.x), num_tokens_per_rank=per_rank.tolist(), is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=idx)
    assert err.value.argument == "num_tokens_per_rank"
    with pytest.raises(TypeError) as err:
        ll_buffer.low_latency_dispatch(env.to(mine.x).tolist(), idx, T_MAX, LL.num_experts(env.num_ranks))
    assert err.value.argument == "x"
    # A tensor on a device that is neither the CPU nor a GPU is named, not read.
    with pytest.raises(ValueError) as err:
        ht_buffer.get_dispatch_layout(torch.empty(idx.shape, dtype=torch.int64, device="meta"), e)
    assert err.value.argument == "topk_idx" and "meta" in str(err.value)
    # The buffer is in step on every rank afterwards (each refused collective call was counted once).
    got = ht_buffer.dispatch(env.to(mine.x), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                             topk_weights=env.to(mine.topk_weights))
    assert got[0].shape[1] == HT_SMALL.hidden


def test_num_qps_per_rank_as_deepep_users_pass_it(env):
    # DeepEP's tests and users pass num_experts // num_ranks: 144 at 2 ranks, 72 at 4, 36 at 8.
    moelink.buffer._qps_warned = False
    for qps in (288 // env.num_ranks, 1, 1000):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            buf = moelink.Buffer(env.group, num_nvl_bytes=0, num_rdma_bytes=0, num_qps_per_rank=qps, explicitly_destroy=True)
        assert buf.num_qps_per_rank == qps
        capped = [w for w in seen if "num_qps_per_rank" in str(w.message)]
        # Across nodes a count above the transport's is capped, with a warning once per process; on one node
        # the QPs are unused and nothing is said.
        if env.internode and qps > moelink._native.MAX_QPS_PER_RANK and qps == 288 // env.num_ranks:
            assert len(capped) == 1 and str(moelink._native.MAX_QPS_PER_RANK) in str(capped[0].message)
        else:
            assert not capped, [str(w.message) for w in capped]
        buf.destroy()
    with pytest.raises(ValueError) as err:
        moelink.Buffer(env.group, num_nvl_bytes=0, num_rdma_bytes=0, num_qps_per_rank=0)
    assert err.value.argument == "num_qps_per_rank"


def test_calls_under_a_default_device_mode_return_the_same(env, ht_buffer, ll_buffer):
    """``torch.set_default_device`` (DeepEP's tests call it) puts a torch function mode on the stack; the calls
    run with modes off (each tensor attribute would cost ~1 µs under it) and must return exactly what they
    return without it, and leave the caller's mode in force."""
    e_ht, e_ll = HT_SMALL.num_experts(env.num_ranks), LL.num_experts(env.num_ranks)
    mine = ht_inputs(HT_SMALL, env.num_ranks, seed=53)[env.rank]
    idx, w, x = env.to(mine.topk_idx), env.to(mine.topk_weights), env.to(mine.x)
    ll_mine = ll_inputs(env.num_ranks, seed=55)[env.rank]
    lx, lidx, lw = env.to(ll_mine.x), env.to(ll_mine.topk_idx), env.to(ll_mine.topk_weights)

    def calls() -> Any:
        layout = ht_buffer.get_dispatch_layout(idx, e_ht)
        got = ht_buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                 num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        combined = ht_buffer.combine(got[0], got[4], topk_weights=got[2])
        recv_x, count, handle, _, _ = ll_buffer.low_latency_dispatch(lx, lidx, T_MAX, e_ll, use_fp8=False)
        ll_combined, _, _ = ll_buffer.low_latency_combine(recv_x, lidx, lw, handle)
        return ([t.clone() for t in layout[:4] if t is not None], got[0].clone(), combined[0].clone(),
                recv_x.clone(), count.clone(), ll_combined.clone())

    def valid_ll_rows(result: Any) -> Any:
        # Only the rows the count says were received are defined (outside the mode: the helper builds CPU tensors).
        *rest, recv_x, count, ll_combined = result
        return (*rest, recv_x.cpu()[valid_rows(count, env.num_ranks * T_MAX)], ll_combined)

    want = calls()
    with torch.device(env.device):
        assert torch._C._is_torch_function_mode_enabled()
        got = calls()
        assert torch._C._is_torch_function_mode_enabled(), "the caller's mode is still in force after the calls"
        assert torch.empty(1).device.type == torch.device(env.device).type
    equal(valid_ll_rows(got), valid_ll_rows(want), "outputs under a default-device mode")
