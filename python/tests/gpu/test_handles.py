"""The handles as code written for DeepEP reads them: indexed, unpacked into DeepEP's names, every element
computed here from the routing with plain torch (reference.py) and compared exactly, and the received rows
checked through the handle (DeepEP's tests do both: ``rank_prefix_matrix = handle[0]``, or across nodes
``recv_gbl_rank_prefix_sum = handle[-4]``, then the rows between its boundaries; ``handle[0][i],
handle[1][i]`` for a low-latency expert). With ``MOELINK_TOPOLOGY`` spanning nodes the high-throughput
handle is DeepEP's internode 10-tuple. Every dispatch mode:
BF16 / FP8, with and without top-k, cached, ``num_worst_tokens``, asynchronous, CUDA-graph replay; low
latency in BF16 / FP8 / round-scale / UE8M0, with and without the receive hook, masked ranks (shrink).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
import torch

import moelink
from checks import HT_REAL, HT_SMALL, LL, Shape, same
from reference import RankInputs, layout, ll_dispatch, make_inputs

INT_MASK = (1 << 32) - 1


# ------------------------------------------------------------------------------------- high-throughput


def ht_inputs(shape: Shape, num_ranks: int, seed: int) -> List[RankInputs]:
    e = shape.num_experts(num_ranks)
    return [make_inputs(r, shape.tokens + 3 * r, shape.hidden, e, shape.topk, seed) for r in range(num_ranks)]


def expected_ht_handle(inputs: Sequence[RankInputs], rank: int, num_experts: int, num_channels: int
                       ) -> Tuple[torch.Tensor, ...]:
    """DeepEP's six intranode handle elements for ``rank`` (moelink's documented meaning for the channel
    elements)."""
    nr = len(inputs)
    counts = torch.stack([layout(inp.topk_idx, num_experts, nr)[0] for inp in inputs])  # [src, dst]
    rank_prefix_matrix = counts.cumsum(0).to(torch.int32)
    recv_src_idx = torch.cat([torch.nonzero(layout(inp.topk_idx, num_experts, nr)[2][:, rank]).flatten()
                              for inp in inputs]).to(torch.int32)
    in_rank = layout(inputs[rank].topk_idx, num_experts, nr)[2]
    channel_prefix_matrix = torch.zeros(nr, num_channels, dtype=torch.int32)
    channel_prefix_matrix[:, -1] = counts[rank]
    recv_channel_prefix_matrix = torch.zeros(nr, num_channels, dtype=torch.int32)
    send_head = position_or_minus_one(in_rank)
    return rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, in_rank, send_head


def position_or_minus_one(hit: torch.Tensor) -> torch.Tensor:
    """``[t][c]``: token ``t``'s position among the tokens with ``hit[:, c]``, -1 where not hit."""
    slot = hit.to(torch.int32).cumsum(0).to(torch.int32) - 1
    return torch.where(hit, slot, torch.full_like(slot, -1))


def expected_internode_handle(inputs: Sequence[RankInputs], rank: int, num_experts: int, num_channels: int,
                              nodes: int, per_node: int, num_rows: int) -> Tuple[torch.Tensor, ...]:
    """DeepEP's ten internode handle elements for ``rank`` on ``nodes`` x ``per_node`` ranks, with ``num_rows``
    output rows (``moelink.buffer.InternodeDispatchHandle`` says what each holds in moelink)."""
    nr = len(inputs)
    lays = [layout(inp.topk_idx, num_experts, nr) for inp in inputs]
    counts = torch.stack([lay[0] for lay in lays])  # [src, dst]
    in_rank = lays[rank][2]
    reach = in_rank.view(-1, nodes, per_node).any(2)  # [T, nodes]
    received = counts[:, rank].to(torch.int32).contiguous()  # rows from each source rank
    gbl_sum = received.cumsum(0).to(torch.int32)
    node_received = received.view(nodes, per_node).sum(1).to(torch.int32)
    node_sum = node_received.cumsum(0).to(torch.int32)
    node_start = node_sum - node_received
    n = int(gbl_sum[-1])

    def last_channel(values: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(values.numel(), num_channels, dtype=torch.int32)
        m[:, -1] = values
        return m

    src_rank = torch.repeat_interleave(torch.arange(nr), received.to(torch.int64))
    src_token = torch.cat([torch.nonzero(lay[2][:, rank]).flatten() for lay in lays]).to(torch.int32)
    meta = torch.full((num_rows, 2), -1, dtype=torch.int32)
    meta[:n, 0] = (src_rank // per_node).to(torch.int32)
    meta[:n, 1] = src_token
    send_nvl_head = torch.full((num_rows, max(8, per_node)), -1, dtype=torch.int32)
    send_nvl_head[:n, rank % per_node] = (torch.arange(n) - node_start[src_rank // per_node]).to(torch.int32)
    return (in_rank, last_channel(reach.sum(0)), last_channel(counts[rank]), last_channel(node_received), node_sum,
            (gbl_sum - received).unsqueeze(1).expand(nr, num_channels).contiguous(), gbl_sum,
            meta.view(torch.uint8), position_or_minus_one(reach), send_nvl_head)


def num_received(inputs: Sequence[RankInputs], rank: int, num_experts: int) -> int:
    nr = len(inputs)
    return sum(int(layout(inp.topk_idx, num_experts, nr)[0][rank]) for inp in inputs)


INTRANODE_NAMES = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                   "is_token_in_rank", "send_head")
INTERNODE_NAMES = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                   "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                   "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


def check_ht_handle(env, handle, inputs: Sequence[RankInputs], num_experts: int, num_channels: int,
                    in_rank: torch.Tensor, num_rows: int, what: str) -> None:
    """The handle is DeepEP's tuple for the buffer's topology (intranode 6, internode 10 elements) with exactly
    the expected elements (intranode ``recv_src_idx``: its first rows, up to the received count; the tensor
    has one entry per output row)."""
    r = env.rank
    if env.internode:
        assert isinstance(handle, tuple) and len(handle) == 10, what
        (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
         recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
         send_rdma_head, send_nvl_head) = handle
        assert handle[0] is is_token_in_rank and handle[-1] is send_nvl_head and handle[-4] is recv_gbl_rank_prefix_sum
        assert is_token_in_rank is in_rank, f"is_token_in_rank is the tensor the dispatch was given ({what})"
        assert recv_src_meta.dtype == torch.uint8 and recv_src_meta.shape == (num_rows, 8), what
        want = expected_internode_handle(inputs, r, num_experts, num_channels, env.num_nodes, env.ranks_per_node,
                                         num_rows)
        for name, got, expected in zip(INTERNODE_NAMES, handle, want, strict=True):
            same(got, expected, f"{name} ({what})")
        return
    assert isinstance(handle, tuple) and len(handle) == 6, what
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head = handle
    assert handle[0] is rank_prefix_matrix and handle[-1] is send_head and list(handle)[3] is recv_src_idx, what
    assert is_token_in_rank is in_rank, f"is_token_in_rank is the tensor the dispatch was given ({what})"
    want = expected_ht_handle(inputs, r, num_experts, num_channels)
    n = want[3].numel()
    assert recv_src_idx.dtype == torch.int32 and recv_src_idx.shape == (num_rows,), what
    for i, (name, got, expected) in enumerate(zip(INTRANODE_NAMES, handle, want, strict=True)):
        same(got[:n] if i == 3 else got, expected, f"{name} ({what})")


def check_rows_through_handle(recv_rows: torch.Tensor, handle, rank: int, sources: Sequence[torch.Tensor],
                              what: str) -> None:
    """As DeepEP's tests: the rows between consecutive boundaries of the received prefix (intranode
    ``rank_prefix_matrix[:, rank]``, internode ``recv_gbl_rank_prefix_sum``) came from that source, and the
    source token index of each row (intranode ``recv_src_idx``, internode the second int32 of ``recv_src_meta``)
    names its token there (``sources[s]``: source ``s``'s rows, e.g. x)."""
    if len(handle) == 10:
        prefix = handle[6].cpu()
        src_idx = handle[7].cpu().view(torch.int32)[:, 1].to(torch.int64)
    else:
        prefix = handle[0][:, rank].cpu()
        src_idx = handle[3].cpu().to(torch.int64)
    rows = recv_rows.cpu()
    start = 0
    for i, src in enumerate(sources):
        end = int(prefix[i].item())
        same(rows[start:end], src[src_idx[start:end]], f"rows from rank {i} ({what})")
        start = end


def carrier_index(env) -> int:
    """The handle element whose tensor carries moelink's routing in a plain-tuple copy."""
    return moelink.buffer.InternodeDispatchHandle.CARRIER if env.internode else 0


def layout_of(buf: moelink.Buffer, env, inp: RankInputs, num_experts: int):
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(env.to(inp.topk_idx), num_experts)
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)


HT_MODES = {  # name: (shape, fp8, with top-k)
    "bf16": (HT_SMALL, False, True),
    "bf16-no-topk": (HT_SMALL, False, False),
    "fp8": (HT_REAL, True, True),
    "fp8-no-topk": (HT_REAL, True, False),
}


def fp8_payload(inputs: Sequence[RankInputs]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    fp8 = [inp.x.float().clamp(-400, 400).to(torch.float8_e4m3fn) for inp in inputs]
    scales = [torch.rand(inp.x.shape[1] // 128, inp.x.shape[0], generator=torch.Generator().manual_seed(k)).t()
              for k, inp in enumerate(inputs)]  # column-major, as DeepEP's callers pass them
    return fp8, scales


@pytest.mark.parametrize("mode", list(HT_MODES))
def test_ht_handle_every_mode(env, ht_buffer, mode):
    """Fresh dispatch (CPU-sync, and no-sync with ``num_worst_tokens`` where top-k travels), the handle
    element by element, the rows through it; then a cached dispatch and a combine through the handle and
    through a plain-tuple copy of it."""
    shape, fp8, with_topk = HT_MODES[mode]
    r, nr = env.rank, env.num_ranks
    e = shape.num_experts(nr)
    inputs = ht_inputs(shape, nr, seed=40)
    mine = inputs[r]
    fp8_x, fp8_scales = fp8_payload(inputs) if fp8 else ([], [])
    x = (env.to(fp8_x[r]), env.to(fp8_scales[r])) if fp8 else env.to(mine.x)
    sources = [f.view(torch.uint8) for f in fp8_x] if fp8 else [inp.x for inp in inputs]
    lay = layout_of(ht_buffer, env, mine, e)
    topk = dict(topk_idx=env.to(mine.topk_idx), topk_weights=env.to(mine.topk_weights)) if with_topk else {}
    channels = moelink.Buffer.get_dispatch_config(nr).num_sms // 2
    n = num_received(inputs, r, e)
    recv_x, _, _, _, handle, _ = ht_buffer.dispatch(x, **lay, **topk)
    data = recv_x[0] if fp8 else recv_x
    check_ht_handle(env, handle, inputs, e, channels, lay["is_token_in_rank"], n, mode)
    check_rows_through_handle(data.view(torch.uint8) if fp8 else data, handle, r, sources, mode)
    if fp8:
        check_rows_through_handle(recv_x[1], handle, r, [s.contiguous() for s in fp8_scales], f"{mode} scales")

    if with_topk:  # num_worst_tokens (DeepEP: forward only, with top-k): the same handle, worst-case rows
        worst = sum(inp.x.shape[0] for inp in inputs) + 8
        worst_x, _, _, counts, worst_handle, _ = ht_buffer.dispatch(x, **lay, **topk, num_worst_tokens=worst)
        assert counts == []
        check_ht_handle(env, worst_handle, inputs, e, channels, lay["is_token_in_rank"], worst,
                        f"{mode}, num_worst_tokens")
        worst_data = worst_x[0] if fp8 else worst_x
        check_rows_through_handle((worst_data.view(torch.uint8) if fp8 else worst_data)[:n], worst_handle, r, sources,
                                  f"{mode}, num_worst_tokens")

    # Cached dispatch and combine through the handle and through tuple(handle) (plain tuples, as a caller
    # that copied or re-packed the handle passes them).
    for h, how in ((handle, "handle"), (tuple(handle), "tuple(handle)"), (list(handle), "list(handle)")):
        out = ht_buffer.dispatch(x, handle=h)
        assert out[1:5] == (None, None, None, None), how
        cached = out[0][0] if fp8 else out[0]
        check_rows_through_handle(cached.view(torch.uint8) if fp8 else cached, handle, r, sources, f"cached via {how}")
        if not fp8:
            combined, _, _ = ht_buffer.combine(cached, h)
            fanout = lay["is_token_in_rank"].sum(1, keepdim=True).cpu().float()
            same(combined, (mine.x.float() * fanout).to(torch.bfloat16), f"combine via {how}")


def test_ht_handle_channels_follow_config(env, ht_buffer):
    """The channel elements have DeepEP's ``[R or nodes, num_sms // 2]`` shapes for the call's config."""
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = ht_inputs(HT_SMALL, nr, seed=41)
    lay = layout_of(ht_buffer, env, inputs[r], e)
    for sms in (4 if env.internode else 2, 8):  # across nodes the kernels need at least 3 blocks (2x2)
        _, _, _, _, handle, _ = ht_buffer.dispatch(env.to(inputs[r].x), **lay, config=moelink.Config(sms, 6, 256, 6, 128))
        check_ht_handle(env, handle, inputs, e, sms // 2, lay["is_token_in_rank"], num_received(inputs, r, e),
                        f"{sms} SMs")


def test_ht_handle_async_and_comm_stream_allocation(env, ht_buffer):
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = ht_inputs(HT_SMALL, nr, seed=42)
    mine = inputs[r]
    lay = layout_of(ht_buffer, env, mine, e)
    recv_x, _, _, _, handle, event = ht_buffer.dispatch(
        env.to(mine.x), **lay, topk_idx=env.to(mine.topk_idx), topk_weights=env.to(mine.topk_weights),
        previous_event=moelink.Buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    check_ht_handle(env, handle, inputs, e, moelink.Buffer.get_dispatch_config(nr).num_sms // 2, lay["is_token_in_rank"],
                    num_received(inputs, r, e), "async")
    check_rows_through_handle(recv_x, handle, r, [inp.x for inp in inputs], "async")


def test_ht_handle_errors(env, ht_buffer):
    """A handle that is not one (another length, or a tuple of tensors moelink did not make) is refused with a
    TypeError naming ``handle``, before anything runs; the buffer stays usable."""
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    inputs = ht_inputs(HT_SMALL, nr, seed=43)
    x = env.to(inputs[r].x)
    lay = layout_of(ht_buffer, env, inputs[r], e)
    _, _, _, _, handle, _ = ht_buffer.dispatch(x, **lay)
    at = carrier_index(env)
    forged = tuple(handle[:at]) + (handle[at].clone(),) + tuple(handle[at + 1:])
    for bad in (forged, tuple(handle)[:5], "handle"):
        for call in (lambda h: ht_buffer.dispatch(x, handle=h), lambda h: ht_buffer.combine(x, h)):
            with pytest.raises(TypeError) as err:
                call(bad)
            assert err.value.argument == "handle" and "handle" in str(err.value)
    recv_x, *_ = ht_buffer.dispatch(x, handle=handle)
    check_rows_through_handle(recv_x, handle, r, [inp.x for inp in inputs], "after refused handles")


def test_ht_handle_cuda_graph_replay(env, ht_buffer):
    """No-sync dispatch captured in a CUDA graph: every replay rewrites the handle's tensors on the device."""
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend; this run uses the host backend (CPU tensors)")
    r, nr = env.rank, env.num_ranks
    e = HT_SMALL.num_experts(nr)
    first = ht_inputs(HT_SMALL, nr, seed=44)
    worst = sum(inp.x.shape[0] for inp in first)
    x, idx, w = env.to(first[r].x), env.to(first[r].topk_idx), env.to(first[r].topk_weights)
    channels = moelink.Buffer.get_dispatch_config(nr).num_sms // 2

    def step():
        per_rank, _, per_expert, in_rank, _ = ht_buffer.get_dispatch_layout(idx, e)
        recv_x, _, _, _, handle, _ = ht_buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w, num_worst_tokens=worst)
        return recv_x, in_rank, handle

    step()  # warm-up (JIT, allocations) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, in_rank, handle = step()
    for seed in (45, 46):
        everyone = ht_inputs(HT_SMALL, nr, seed)
        x.copy_(env.to(everyone[r].x))
        idx.copy_(env.to(everyone[r].topk_idx))
        w.copy_(env.to(everyone[r].topk_weights))
        graph.replay()
        torch.cuda.synchronize()
        check_ht_handle(env, handle, everyone, e, channels, in_rank, worst, f"replay, seed {seed}")
        check_rows_through_handle(recv_x[:num_received(everyone, r, e)], handle, r, [inp.x for inp in everyone],
                                  f"replay, seed {seed}")


# ------------------------------------------------------------------------------------- low-latency

T_MAX = LL.tokens

LL_MODES = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8-round": dict(use_fp8=True, round_scale=True),
    "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}


def ll_inputs(num_ranks: int, seed: int) -> List[RankInputs]:
    return [make_inputs(r, T_MAX - 5 - 3 * r % 7, LL.hidden, LL.num_experts(num_ranks), LL.topk, seed)
            for r in range(num_ranks)]


def expected_ll_handle(inputs: Sequence[RankInputs], rank: int, num_experts: int, masked: Sequence[int] = ()
                       ) -> Tuple[List[torch.Tensor], torch.Tensor, List[int]]:
    """``src_info`` rows (the valid ones, per local expert), ``layout_range [E_local, R]`` and ``recv_count``."""
    nr = len(inputs)
    want = ll_dispatch(inputs, rank, num_experts, masked)
    counts = torch.zeros(len(want.recv_count), nr, dtype=torch.int64)
    for e, src in enumerate(want.src_rank):
        counts[e] = torch.bincount(src, minlength=nr)
    begin = counts.cumsum(1) - counts
    layout_range = (begin << 32) | counts
    return [t.to(torch.int32) for t in want.src_token], layout_range, want.recv_count


def check_ll_handle(env, handle, inputs: Sequence[RankInputs], recv_x, recv_count, mode: str, masked: Sequence[int] = (),
                    what: str = "") -> None:
    """DeepEP's 5-tuple, each element exact, and (DeepEP's own checks) the counts in ``layout_range`` summing
    to ``recv_count``, every rank's range holding that rank's tokens as ``src_info`` names them."""
    r, nr = env.rank, env.num_ranks
    e = LL.num_experts(nr)
    what = f"{mode}{', ' + what if what else ''}"
    assert isinstance(handle, tuple) and len(handle) == 5, what
    src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
    assert (num_max_dispatch_tokens_per_rank, hidden, num_experts) == (T_MAX, LL.hidden, e), what
    e_local, rows = e // nr, nr * T_MAX
    assert src_info.dtype == torch.int32 and tuple(src_info.shape) == (e_local, rows), what
    assert layout_range.dtype == torch.int64 and tuple(layout_range.shape) == (e_local, nr), what
    want_info, want_range, want_count = expected_ll_handle(inputs, r, e, masked)
    same(layout_range, want_range, f"layout_range ({what})")
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    for i in range(e_local):
        count = int(recv_count[i].item())
        assert count == want_count[i] == int((layout_range[i] & INT_MASK).sum().item()), f"expert {i} ({what})"
        same(src_info[i][:count], want_info[i], f"src_info of local expert {i} ({what})")
        if mode != "bf16":
            continue
        for j in range(nr):  # DeepEP's check: the range of rank j holds rank j's tokens
            begin, n = int(layout_range[i][j].item()) >> 32, int(layout_range[i][j].item()) & INT_MASK
            assert n == 0 or j not in masked, f"a masked rank has rows ({what})"
            tokens = src_info[i][begin:begin + n].cpu().to(torch.int64)
            same(data[i][begin:begin + n], inputs[j].x[tokens], f"rows of rank {j} in local expert {i} ({what})")


@pytest.mark.parametrize("mode", list(LL_MODES))
@pytest.mark.parametrize("hook", [False, True])
def test_ll_handle_every_mode(env, ll_buffer, mode, hook):
    """Every payload mode, with and without the receive hook (the handle is written with the rows, by the
    hook); then combine and the zero-copy buffer through the handle and through ``tuple(handle)``."""
    r, nr = env.rank, env.num_ranks
    e = LL.num_experts(nr)
    inputs = ll_inputs(nr, seed=50)
    mine = inputs[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, recv_count, handle, event, run_hook = ll_buffer.low_latency_dispatch(
        x, idx, T_MAX, e, **LL_MODES[mode], async_finish=not hook, return_recv_hook=hook)
    if hook:
        run_hook()
    else:
        event.current_stream_wait()
    check_ll_handle(env, handle, inputs, recv_x, recv_count, mode, what=f"hook={hook}")
    if mode != "bf16":
        return
    for h, how in ((handle, "handle"), (tuple(handle), "tuple(handle)")):
        staging = ll_buffer.get_next_low_latency_combine_buffer(h)
        assert tuple(staging.shape) == tuple(recv_x.shape), how
        combined, _, _ = ll_buffer.low_latency_combine(recv_x, idx, w, h)
        assert tuple(combined.shape) == tuple(mine.x.shape) and not bool(combined.isnan().any()), how


def test_ll_handle_errors(env, ll_buffer):
    r, nr = env.rank, env.num_ranks
    e = LL.num_experts(nr)
    mine = ll_inputs(nr, seed=51)[r]
    x, idx, w = env.to(mine.x), env.to(mine.topk_idx), env.to(mine.topk_weights)
    recv_x, _, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
    forged = (handle[0].clone(),) + tuple(handle[1:])
    for bad in (forged, tuple(handle)[:4], None):
        with pytest.raises(TypeError) as err:
            ll_buffer.low_latency_combine(recv_x, idx, w, bad)
        assert err.value.argument == "handle"
        with pytest.raises(TypeError) as err:
            ll_buffer.get_next_low_latency_combine_buffer(bad)
        assert err.value.argument == "handle"
    ll_buffer.low_latency_combine(recv_x, idx, w, handle)  # nothing above reached a collective


def test_ll_handle_shrink_masked_rank(env):
    """Shrink mode: the masked rank's range has count 0 on every expert, the others' rows are unchanged."""
    r, nr = env.rank, env.num_ranks
    e = LL.num_experts(nr)
    hint = moelink.Buffer.get_low_latency_rdma_size_hint(T_MAX, LL.hidden, nr, e)
    buf = moelink.Buffer(env.group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True)
    try:
        inputs = ll_inputs(nr, seed=52)
        mine = inputs[r]
        masked = [nr - 1]
        buf.low_latency_update_mask_buffer(nr - 1, True)
        for mode in ("bf16", "ue8m0"):
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(env.to(mine.x), env.to(mine.topk_idx), T_MAX, e,
                                                                        **LL_MODES[mode])
            check_ll_handle(env, handle, inputs, recv_x, recv_count, mode, masked=masked, what=f"rank {nr - 1} masked")
    finally:
        buf.destroy()


def test_ll_handle_cuda_graph_replay(env, ll_buffer):
    """Captured low-latency dispatches: every replay rewrites src_info and layout_range on the device."""
    if not env.cuda:
        pytest.skip("CUDA graphs need the CUDA backend; this run uses the host backend (CPU tensors)")
    r, nr = env.rank, env.num_ranks
    e = LL.num_experts(nr)
    first = ll_inputs(nr, seed=53)
    x, idx = env.to(first[r].x), env.to(first[r].topk_idx)

    def step():
        fp8_x, fp8_count, fp8_handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, **LL_MODES["ue8m0"])
        recv_x, recv_count, handle, _, _ = ll_buffer.low_latency_dispatch(x, idx, T_MAX, e, use_fp8=False)
        return fp8_x, fp8_count, fp8_handle, recv_x, recv_count, handle

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_x, fp8_count, fp8_handle, recv_x, recv_count, handle = step()
    for seed in (54, 55):
        everyone = ll_inputs(nr, seed)
        x.copy_(env.to(everyone[r].x))
        idx.copy_(env.to(everyone[r].topk_idx))
        graph.replay()
        torch.cuda.synchronize()
        check_ll_handle(env, fp8_handle, everyone, fp8_x, fp8_count, "ue8m0", what=f"replay, seed {seed}")
        check_ll_handle(env, handle, everyone, recv_x, recv_count, "bf16", what=f"replay, seed {seed}")
