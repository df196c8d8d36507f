"""Host cost per call of each operation through the Python API, moelink beside DeepEP (``python -m moelink.bench
--host-cost``).

    torchrun --nproc_per_node=2 -m moelink.bench --host-cost --json hostcost.json        # GPUs, DeepEP's shapes
    MOELINK_BACKEND=host torchrun --nproc_per_node=2 -m moelink.bench --host-cost --quick  # CPU smoke run

Ops: ``ll_dispatch`` (FP8), ``ll_combine``, ``ll_dispatch_combine``, ``ht_layout``, ``ht_dispatch`` (fresh, with
the layout tensors, CPU-synchronised as DeepEP's default), ``ht_cached_dispatch`` (bf16 and fp8), ``ht_combine``,
on DeepEP's shapes (LL: 128 tokens, hidden 7168, top-8 of 288; HT: 4096 tokens, hidden 7168, top-8 of 256, 24
SMs). Systems: ``moelink`` (and ``moelink-noreuse``, the same without reusing unreferenced outputs, with
``--reuse-ab``) and ``deepep`` when ``import deep_ep`` works. Three numbers per op, the slowest rank's:

- ``cpu_us_per_call``: a loop of ``--calls`` calls (at least 100 on a GPU) without synchronising, host time per
  call: what the API costs the CPU;
- ``loop_us_per_call``: the same loop timed up to a final ``synchronize``: the rate a CPU-bound loop reaches;
- ``sync_us``: the median of 20 single calls, each followed by a ``synchronize``: one call's latency
  (``sync_call_us``: the median host time of the call itself within it, before the ``synchronize``).

Every loop starts after a barrier with the device idle. On the host backend (no GPU) the calls run the CPU
reference implementation and exchange through the process group: the numbers measure that, not a GPU, and the
output says so.

``--graph`` (CUDA only) also captures one LL dispatch + combine pair in a CUDA graph per system, replays it, and
reports the replay time beside the pair's kernels back to back, with the GPU activity of one replay from the
torch profiler (every kernel, memset and copy with its duration and the gap before it), so that what a
replay spends beyond the two kernels can be read off one run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

#: Records' note on the host backend, where every figure is CPU work.
HOST_NOTE = ("host backend: CPU threads run the reference implementation and exchange through the process group; "
             "these times are not GPU figures")


class Shapes:
    """DeepEP's benchmark shapes, or small ones for ``--quick``."""

    def __init__(self, quick: bool) -> None:
        if quick:
            self.ll_tokens, self.ll_hidden, self.ll_topk, self.ll_experts = 16, 512, 4, 16
            self.ht_tokens, self.ht_hidden, self.ht_topk, self.ht_experts = 64, 256, 4, 16
        else:
            self.ll_tokens, self.ll_hidden, self.ll_topk, self.ll_experts = 128, 7168, 8, 288
            self.ht_tokens, self.ht_hidden, self.ht_topk, self.ht_experts = 4096, 7168, 8, 256


def inputs(ctx: Any, tokens: int, hidden: int, topk: int, experts: int, seed: int,
           idx_dtype: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``x bf16 [T, H]``, ``topk_idx [T, K]`` (scores ``|randn| + 1``, top-k) and weights."""
    g = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    idx = scores.topk(topk, dim=1).indices.to(idx_dtype)
    w = torch.rand(tokens, topk, generator=g)
    return x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)


def fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(t, h // 128, device=x.device) + 0.5


def slowest(ctx: Any, values: List[float]) -> List[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def aligned(ctx: Any) -> None:
    """The device idle and every rank here."""
    ctx.sync()
    dist.barrier()
    ctx.sync()


def measure(ctx: Any, op: Callable[[], Any], calls: int, singles: int = 20) -> Dict[str, float]:
    """``cpu_us_per_call``, ``loop_us_per_call`` and ``sync_us`` of ``op`` (warmed up first), slowest rank."""
    for _ in range(3):
        op()
    aligned(ctx)
    t0 = time.perf_counter()
    for _ in range(calls):
        op()
    t1 = time.perf_counter()
    ctx.sync()
    t2 = time.perf_counter()
    cpu, loop = (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6
    single: List[float] = []
    called: List[float] = []
    for _ in range(singles):
        aligned(ctx)
        s0 = time.perf_counter()
        op()
        s1 = time.perf_counter()
        ctx.sync()
        single.append((time.perf_counter() - s0) * 1e6)
        called.append((s1 - s0) * 1e6)
    cpu, loop, sync, call = slowest(ctx, [cpu, loop, statistics.median(single), statistics.median(called)])
    return {"cpu_us_per_call": cpu, "loop_us_per_call": loop, "sync_us": sync, "sync_call_us": call}


def native_split(ctx: Any, buf: Any, fn: Callable[[], Any], calls: int = 100) -> Dict[str, Any]:
    """moelink only: where a call's host time goes, from the native module's host timing over a loop of
    ``calls`` calls timed as ``cpu_us_per_call`` is (slowest rank): reading the tensor arguments, the backend
    (GIL released; of it, the driver's launch calls), the native rest; the Python layer is that loop's time
    per call minus those, all from the same loop."""
    native = getattr(buf, "_native", None)
    if native is None or not hasattr(native, "set_host_timing"):
        return {}
    aligned(ctx)
    native.set_host_timing(True)
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loop_us = (time.perf_counter() - t0) / calls * 1e6
        sums = native.host_times()
    finally:
        native.set_host_timing(False)
    ctx.sync()
    read, backend, rest, launch, launches = (sum(v[i] for v in sums.values()) / calls / (1e3 if i < 5 else 1)
                                             for i in (1, 2, 3, 4, 5))
    loop_us, read, backend, rest, launch, launches = slowest(ctx, [loop_us, read, backend, rest, launch, launches])
    return {"native_read_us": read, "native_backend_us": backend, "native_launch_us": launch,
            "launches_per_call": launches, "native_rest_us": rest, "split_loop_us": loop_us,
            "python_us": max(0.0, loop_us - read - backend - rest)}


def failed(err: BaseException) -> Dict[str, Any]:
    return {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}


# Each family's ops, (op, dtype), in the order measured.
HT_OPS = (("ht_layout", "-"), ("ht_dispatch", "bf16"), ("ht_cached_dispatch", "bf16"), ("ht_cached_dispatch", "fp8"),
          ("ht_combine", "bf16"))
LL_OPS = (("ll_dispatch", "fp8"), ("ll_combine", "bf16"), ("ll_dispatch_combine", "fp8"))


class Runner:
    """One system's ops on this rank."""

    def __init__(self, ctx: Any, name: str, mod: Any, shapes: Shapes, calls: int) -> None:
        self.ctx, self.name, self.mod, self.s, self.calls = ctx, name, mod, shapes, calls
        self.idx_dtype = getattr(mod, "topk_idx_t", torch.int64)

    def record(self, op: str, dtype: str, **extra: Any) -> Dict[str, Any]:
        c = self.ctx
        r: Dict[str, Any] = {"system": self.name, "op": op, "dtype": dtype, "ranks": c.num_ranks, **c.facts,
                             "mode": "host-cost", "calls": self.calls, "status": "ok"}
        if not c.cuda:
            r["note"] = HOST_NOTE
        route = getattr(getattr(self.mod, "_native", None), "tensor_route", None)
        if route is not None:
            r["tensor_route"] = route()  # how moelink's native module reads tensors ("shim" or "attributes")
        r.update(extra)
        return r

    def run(self, op: str, dtype: str, fn: Callable[[], Any], buf: Any = None, **extra: Any) -> Dict[str, Any]:
        rec = self.record(op, dtype, **extra)
        try:
            rec.update(measure(self.ctx, fn, self.calls))
            rec.update(native_split(self.ctx, buf, fn))
            if self.ctx.cuda and op.startswith("ll_"):
                rec["sync_activity"] = profile_single(self.ctx, fn)
        except Exception as err:  # noqa: BLE001 - one failing op must not stop the others
            rec.update(failed(err))
        return rec

    # ------------------------------------------------------------------------------------------------ LL

    def ll(self, graph: bool) -> List[Dict[str, Any]]:
        s, c, mod = self.s, self.ctx, self.mod
        t, h, k, e, r = s.ll_tokens, s.ll_hidden, s.ll_topk, s.ll_experts, c.num_ranks
        shape = {"tokens": t, "hidden": h, "topk": k, "experts": e}
        try:
            x, idx, w = inputs(c, t, h, k, e, 2, self.idx_dtype)
            hint = mod.Buffer.get_low_latency_rdma_size_hint(t, h, r, e)
            # num_qps_per_rank as DeepEP's users (and its own test) pass it: experts per rank.
            buf = mod.Buffer(c.group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True,
                             num_qps_per_rank=max(1, e // r))
            # The expert outputs combine sends: bf16 [E_local, R*T, H], as DeepEP's test simulates its GEMM.
            y = torch.randn(e // r, r * t, h, device=c.device).to(torch.bfloat16)
        except Exception as err:  # noqa: BLE001
            return [self.record(op, dt, **shape, **failed(err)) for op, dt in LL_OPS]

        def pair() -> Any:
            _, _, hd, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
            return buf.low_latency_combine(y, idx, w, hd)

        def combines() -> Callable[[], Any]:
            # A handle from the dispatch just before: a low-latency handle serves combines until two later
            # dispatches have reused its buffer set.
            _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
            return lambda: buf.low_latency_combine(y, idx, w, handle)

        out = [self.run("ll_dispatch", "fp8", lambda: buf.low_latency_dispatch(x, idx, t, e, use_fp8=True), buf, **shape)]
        try:
            combine = combines()
        except Exception as err:  # noqa: BLE001
            out.append(self.record("ll_combine", "bf16", **shape, **failed(err)))
        else:
            out.append(self.run("ll_combine", "bf16", combine, buf, **shape))
        out.append(self.run("ll_dispatch_combine", "fp8", pair, buf, **shape))
        if graph and c.cuda:
            out.append(self.graph_replay(buf, pair, shape))
        if c.cuda:
            out.append(self.deepep_style(buf, x, idx, w, y, shape))
        return out

    def deepep_style(self, buf: Any, x: Any, idx: Any, w: Any, y: Any, shape: Dict[str, Any]) -> Dict[str, Any]:
        """The pair as DeepEP's ``test_low_latency.py`` times it ("Dispatch + combine"): with the default device
        set to the GPU (its ``init_dist`` calls ``torch.set_default_device('cuda')``), its ``test_func`` (FP8
        dispatch with ``cumulative_local_expert_recv_stats``, then combine), 50 warm-up calls, then 50 calls each
        between two CUDA events on the current stream, the first dropped; avg / min / max. Beside it the host time
        of each half in that loop and the activity of a few pairs (torch profiler): host-side CUDA API calls per
        pair, and each GPU kernel, memset or copy with the gap before it. Then the host time of each half in
        variants of the loop (without the default device, without the events, the plain pair), split for moelink
        into Python, reading the tensor arguments, the backend and the rest (``host_split``)."""
        c, t, e = self.ctx, self.s.ll_tokens, self.s.ll_experts
        rec = self.record("ll_deepep_bench", "fp8", **shape)
        try:
            stats = torch.zeros(e // c.num_ranks, dtype=torch.int32, device=c.device)
            host = {"dispatch": 0.0, "combine": 0.0}

            def pair(as_deepep: bool) -> None:
                """The pair with test_func's arguments (the stats tensor included), or the plain call."""
                h0 = time.perf_counter()
                if as_deepep:
                    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, cumulative_local_expert_recv_stats=stats,
                                                                  use_fp8=True, async_finish=False, return_recv_hook=False)
                else:
                    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True)
                h1 = time.perf_counter()
                if as_deepep:
                    buf.low_latency_combine(y, idx, w, handle, return_recv_hook=False)
                else:
                    buf.low_latency_combine(y, idx, w, handle)
                h2 = time.perf_counter()
                host["dispatch"] += h1 - h0
                host["combine"] += h2 - h1

            def test_func() -> None:
                pair(True)

            # As in DeepEP's test, the checks before leave a dispatch's outputs referenced (made with
            # async_finish, and with a receive hook) while the timed calls run.
            left = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True, async_finish=True)
            left[3].current_stream_wait()
            hooked = buf.low_latency_dispatch(x, idx, t, e, use_fp8=True, return_recv_hook=True)
            hooked[4]()
            aligned(c)
            tests = 50
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(tests)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(tests)]
            with torch.device(c.device):
                for _ in range(50):
                    test_func()
                host.update(dispatch=0.0, combine=0.0)
                for i in range(tests):
                    starts[i].record()
                    test_func()
                    ends[i].record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(en) * 1e3 for s, en in zip(starts, ends)][1:]
            avg, lo, hi, hd, hc = slowest(c, [sum(times) / len(times), min(times), max(times),
                                              host["dispatch"] / tests * 1e6, host["combine"] / tests * 1e6])
            rec.update(avg_us=avg, min_us=lo, max_us=hi, host_dispatch_us=hd, host_combine_us=hc)

            native = getattr(buf, "_native", None)
            timing = native is not None and hasattr(native, "set_host_timing")
            splits: Dict[str, Any] = {}
            for name, default_device, with_events, as_deepep in (("as DeepEP", True, True, True), ("no default device", False, True, True),
                                                              ("no events", True, False, True), ("plain pair", False, True, False)):
                aligned(c)
                for _ in range(20):
                    pair(as_deepep)
                aligned(c)
                host.update(dispatch=0.0, combine=0.0)
                if timing:
                    native.set_host_timing(True)
                n = 100
                with torch.device(c.device) if default_device else contextlib.nullcontext():
                    for i in range(n):
                        if with_events:
                            starts[i % tests].record()
                        pair(as_deepep)
                        if with_events:
                            ends[i % tests].record()
                sums = native.host_times() if timing else {}
                if timing:
                    native.set_host_timing(False)
                torch.cuda.synchronize()
                row = [host["dispatch"] / n * 1e6, host["combine"] / n * 1e6]
                for op in ("low_latency_dispatch", "low_latency_combine"):
                    calls, read, backend, rest = sums.get(op, (0, 0, 0, 0, 0, 0))[:4]
                    row += [read / max(calls, 1) / 1e3, backend / max(calls, 1) / 1e3, rest / max(calls, 1) / 1e3]
                row = slowest(c, row)
                splits[name] = {"dispatch_us": row[0], "combine_us": row[1]}
                if timing:
                    splits[name].update(dispatch_read_us=row[2], dispatch_backend_us=row[3], dispatch_rest_us=row[4],
                                        combine_read_us=row[5], combine_backend_us=row[6], combine_rest_us=row[7])
            rec["host_split"] = splits
            rec.update(profile_calls(c, test_func))
            del left, hooked
        except Exception as err:  # noqa: BLE001
            rec.update(failed(err))
        return rec

    def graph_replay(self, buf: Any, pair: Callable[[], Any], shape: Dict[str, Any]) -> Dict[str, Any]:
        """The LL pair captured in one CUDA graph: replay time, the pair's kernels back to back, and the GPU
        activity of one replay (torch profiler)."""
        c = self.ctx
        rec = self.record("ll_dispatch_combine_graph", "fp8", **shape)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    pair()
            torch.cuda.current_stream().wait_stream(stream)
            aligned(c)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                pair()
            aligned(c)
            for _ in range(3):
                g.replay()
            replays = 50
            per_replay = []
            for _ in range(5):
                aligned(c)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    g.replay()
                end.record()
                end.synchronize()
                per_replay.append(start.elapsed_time(end) * 1e3 / replays)
            # The same pair without a graph, issued ahead of the device (GPU time per pair once the launch
            # queue is full), for comparison.
            for _ in range(3):
                pair()
            aligned(c)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                pair()
            end.record()
            end.synchronize()
            eager = start.elapsed_time(end) * 1e3 / replays
            activity = profile_replays(c, g)
            replay_us, eager_us = slowest(c, [statistics.median(per_replay), eager])
            rec.update(replay_us=replay_us, eager_loop_us=eager_us, **activity)
            if activity.get("kernel_sum_us"):
                rec["replay_minus_kernels_us"] = replay_us - activity["kernel_sum_us"]
        except Exception as err:  # noqa: BLE001
            rec.update(failed(err))
        return rec

    # ------------------------------------------------------------------------------------------------ HT

    def ht(self, num_sms: int, nvl_bytes: int) -> List[Dict[str, Any]]:
        s, c, mod = self.s, self.ctx, self.mod
        t, h, k, e = s.ht_tokens, s.ht_hidden, s.ht_topk, s.ht_experts
        shape = {"tokens": t, "hidden": h, "topk": k, "experts": e, "num_sms": num_sms}
        try:
            x, idx, w = inputs(c, t, h, k, e, 1, self.idx_dtype)
            x8 = fp8(x)
            mod.Buffer.set_num_sms(num_sms)
            buf = mod.Buffer(c.group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=0)
            cfg, ccfg = mod.Buffer.get_dispatch_config(c.num_ranks), mod.Buffer.get_combine_config(c.num_ranks)
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)

            def fresh() -> Any:
                return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg)

            recv_x, _, _, _, handle, _ = fresh()
        except Exception as err:  # noqa: BLE001
            return [self.record(op, dt, **shape, **failed(err)) for op, dt in HT_OPS]
        fresh_rec = self.run("ht_dispatch", "bf16", fresh, buf, **shape, cpu_synced=True)
        if c.cuda and fresh_rec.get("status") == "ok":
            # Where a fresh, CPU-synced dispatch's time goes on the GPU: its kernels and the gaps between them.
            fresh_rec.update(profile_calls(c, fresh, n=4))
        return [self.run("ht_layout", "-", lambda: buf.get_dispatch_layout(idx, e), buf, **shape),
                fresh_rec,
                self.run("ht_cached_dispatch", "bf16", lambda: buf.dispatch(x, handle=handle, config=cfg), buf, **shape),
                self.run("ht_cached_dispatch", "fp8", lambda: buf.dispatch(x8, handle=handle, config=cfg), buf, **shape),
                self.run("ht_combine", "bf16", lambda: buf.combine(recv_x, handle, config=ccfg), buf, **shape)]


def profile_replays(ctx: Any, g: Any, n: int = 5) -> Dict[str, Any]:
    """The GPU activity of ``n`` replays of ``g`` (torch profiler): the middle replay's kernels, memsets and
    copies in order, each with its duration and the gap before it, their sum and the replay's span."""
    try:
        aligned(ctx)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                g.replay()
            torch.cuda.synchronize()
        events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA),
                        key=lambda v: v[0])
    except Exception as err:  # noqa: BLE001 - the replay time stands without the profile
        return {"profile_error": f"{type(err).__name__}: {err}"[:300]}
    if not events or len(events) % n != 0:
        return {"profile_events": len(events), "profile_error": f"{len(events)} GPU events for {n} replays"}
    per = len(events) // n
    mid = events[(n // 2) * per:(n // 2 + 1) * per]
    activity = []
    last_end: Optional[float] = None
    for start, end, name in mid:
        activity.append({"name": name[:120], "dur_us": round(end - start, 2),
                         "gap_before_us": None if last_end is None else round(start - last_end, 2)})
        last_end = end
    return {"replay_activity": activity, "kernel_sum_us": round(sum(a["dur_us"] for a in activity), 2),
            "replay_span_us": round(mid[-1][1] - mid[0][0], 2), "gpu_events_per_replay": per}


def profile_calls(ctx: Any, fn: Callable[[], Any], n: int = 6) -> Dict[str, Any]:
    """The activity of ``n`` eager calls of ``fn`` (torch profiler): host-side CUDA API calls per call (name:
    count, total µs) and the GPU activity from the middle call's first kernel on, each with the gap before it."""
    try:
        aligned(ctx)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        gpu, api = [], {}
        for e in prof.events():
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                gpu.append((e.time_range.start, e.time_range.end, e.name))
            elif e.name.startswith(("cuda", "cu")) and e.name != "cudaDeviceSynchronize":
                count, total = api.get(e.name, (0, 0.0))
                api[e.name] = (count + 1, total + (e.time_range.end - e.time_range.start))
        gpu.sort(key=lambda v: v[0])
    except Exception as err:  # noqa: BLE001 - the timings stand without the profile
        return {"profile_error": f"{type(err).__name__}: {err}"[:300]}
    per = len(gpu) // n if n else 0
    mid = gpu[(n // 2) * per:(n // 2 + 1) * per + 1] if per else []
    activity, last_end = [], None
    for start, end, name in mid:
        activity.append({"name": name[:120], "dur_us": round(end - start, 2),
                         "gap_before_us": None if last_end is None else round(start - last_end, 2)})
        last_end = end
    return {"host_api_per_call": {k: {"count": round(v[0] / n, 2), "us": round(v[1] / n, 2)}
                                  for k, v in sorted(api.items(), key=lambda kv: -kv[1][1])},
            "gpu_activity": activity, "gpu_events_per_call": len(gpu) / n if n else 0}


def profile_single(ctx: Any, fn: Callable[[], Any]) -> List[Dict[str, Any]]:
    """What one call after an idle, aligned device does (as ``sync_us`` times it; torch profiler): each host
    CUDA API call and each GPU event, in order, with its start from the first host call and its duration."""
    try:
        aligned(ctx)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = []
        for e in prof.events():
            gpu = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            if gpu or e.name.startswith(("cuda", "cu")):
                rows.append((e.time_range.start, e.time_range.end, ("gpu " if gpu else "api ") + e.name))
        rows.sort(key=lambda v: v[0])
    except Exception as err:  # noqa: BLE001 - the timings stand without the profile
        return [{"name": f"profile error: {type(err).__name__}: {err}"[:300], "at_us": 0.0, "dur_us": 0.0}]
    t0 = rows[0][0] if rows else 0.0
    return [{"name": name[:120], "at_us": round(start - t0, 2), "dur_us": round(end - start, 2)} for start, end, name in rows]


def activity_lines(activity: List[Dict[str, Any]]) -> List[str]:
    """One line per GPU event of a profile: duration, gap before it, name."""
    return [f"    {a['dur_us']:8.2f} us  gap {a['gap_before_us'] if a['gap_before_us'] is not None else '-':>6}  {a['name']}"
            for a in activity]


def table(records: List[Dict[str, Any]]) -> str:
    """Side by side: each op's three numbers per system, and moelink's over DeepEP's."""
    systems = sorted({r["system"] for r in records if "cpu_us_per_call" in r}, key=lambda n: (n != "moelink", n))
    lines_unavailable = list(dict.fromkeys(
        f"{r['system']}{'' if r['op'] == '-' else ', ' + r['op'].split('_')[0].upper() + ' ops'}: {r['status']} ({r.get('error', '')})"
        for r in records if r["op"] == "-" or r.get("status") == "unavailable"))
    keys: List[Tuple[str, str]] = []
    for r in records:
        if (r["op"], r["dtype"]) not in keys and "cpu_us_per_call" in r:
            keys.append((r["op"], r["dtype"]))
    by = {(r["system"], r["op"], r["dtype"]): r for r in records}

    def cell(r: Optional[Dict[str, Any]], f: str) -> str:
        return "-" if r is None or r.get(f) is None else f"{r[f]:.1f}"

    head = f"{'op':22} {'dtype':5} " + " ".join(f"{s[:15]:>15} {'cpu/loop/sync us':>22}" for s in systems)
    lines = lines_unavailable + [head, "-" * len(head)]
    for op, dt in keys:
        cols = []
        for s in systems:
            r = by.get((s, op, dt))
            status = "" if r is None or r.get("status") == "ok" else " (" + str(r.get("status")) + ")"
            cols.append(f"{'':>15} {cell(r, 'cpu_us_per_call') + ' / ' + cell(r, 'loop_us_per_call') + ' / ' + cell(r, 'sync_us') + status:>22}")
        lines.append(f"{op:22} {dt:5} " + " ".join(cols))
    if "deepep" in systems:
        lines.append("")
        lines.append("moelink / DeepEP (targets: cpu <= 0.5 except ht_dispatch, loop and sync <= 1.0):")
        for op, dt in keys:
            m, d = by.get(("moelink", op, dt)), by.get(("deepep", op, dt))
            if not m or not d:
                continue
            ratios = []
            for f in ("cpu_us_per_call", "loop_us_per_call", "sync_us"):
                if m.get(f) and d.get(f):
                    ratios.append(f"{f.split('_')[0]} {m[f] / d[f]:.2f}")
            if ratios:
                lines.append(f"  {op:22} {dt:5} " + ", ".join(ratios))
    split = [r for r in records if "native_backend_us" in r]
    if split:
        lines.append("")
        lines.append("moelink's host time per call, one loop: Python layer + native (reading tensor arguments + backend "
                     "[of it: driver launch calls] + rest), us; tensors read through: "
                     f"{split[0].get('tensor_route', '-')}")
        for r in split:
            lines.append(f"  {r['system']:16} {r['op']:22} {r['dtype']:5} {r.get('split_loop_us', 0):6.1f} = "
                         f"{r['python_us']:6.1f} + ({r['native_read_us']:5.1f} + {r['native_backend_us']:6.1f} "
                         f"[{r.get('native_launch_us', 0):5.1f} in {r.get('launches_per_call', 0):.1f}] + "
                         f"{r['native_rest_us']:4.1f})")
    graphs = [r for r in records if r["op"] == "ll_dispatch_combine_graph"]
    for r in graphs:
        lines.append("")
        if r.get("status") != "ok":
            lines.append(f"{r['system']}: LL pair in a CUDA graph: {r.get('status')} {r.get('error', '')}")
            continue
        lines.append(f"{r['system']}: LL pair in a CUDA graph: replay {r.get('replay_us', 0):.1f} us, GPU activity "
                     f"{r.get('kernel_sum_us', '-')} us in {r.get('gpu_events_per_replay', '-')} events over a span of "
                     f"{r.get('replay_span_us', '-')} us; the same pair issued eagerly {r.get('eager_loop_us', 0):.1f} us")
        lines += activity_lines(r.get("replay_activity", []))
    for r in (r for r in records if r["op"] == "ht_dispatch" and r.get("gpu_activity")):
        lines.append("")
        lines.append(f"{r['system']}: GPU activity of one fresh CPU-synced HT dispatch ({r.get('gpu_events_per_call', '-')} events per call):")
        lines += activity_lines(r["gpu_activity"])
        for name, v in list(r.get("host_api_per_call", {}).items())[:6]:
            lines.append(f"    host {name}: {v['count']} per call, {v['us']} us")
    for r in (r for r in records if r["op"] == "ll_deepep_bench"):
        lines.append("")
        if r.get("status") != "ok":
            lines.append(f"{r['system']}: LL pair as DeepEP's test times it: {r.get('status')} {r.get('error', '')}")
            continue
        lines.append(f"{r['system']}: LL pair as DeepEP's test_low_latency times it: avg {r['avg_us']:.1f} us "
                     f"(min {r['min_us']:.1f}, max {r['max_us']:.1f}); host {r['host_dispatch_us']:.1f} us in dispatch, "
                     f"{r['host_combine_us']:.1f} us in combine; {r.get('gpu_events_per_call', '-')} GPU events per pair")
        for name, v in r.get("host_split", {}).items():
            line = f"    host per call, {name:17}: dispatch {v['dispatch_us']:.1f} us, combine {v['combine_us']:.1f} us"
            if "dispatch_read_us" in v:
                line += (f" (native: dispatch read {v['dispatch_read_us']:.1f} + backend {v['dispatch_backend_us']:.1f} + rest "
                         f"{v['dispatch_rest_us']:.1f}; combine read {v['combine_read_us']:.1f} + backend "
                         f"{v['combine_backend_us']:.1f} + rest {v['combine_rest_us']:.1f})")
            lines.append(line)
        for name, v in list(r.get("host_api_per_call", {}).items())[:8]:
            lines.append(f"    host {name}: {v['count']} per pair, {v['us']} us")
        lines += activity_lines(r.get("gpu_activity", []))
    for r in (r for r in records if r.get("sync_activity")):
        lines.append("")
        lines.append(f"{r['system']}: one {r['op']} call and a synchronize ({r.get('sync_us', 0):.1f} us, the call "
                     f"{r.get('sync_call_us', 0):.1f} us of it; profiled, so slower): start and duration in us")
        lines += [f"    {a['at_us']:9.2f} {a['dur_us']:8.2f}  {a['name']}" for a in r["sync_activity"]]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("host cost (--host-cost)")
    g.add_argument("--host-cost", action="store_true", help="measure host cost per call of each op (this module)")
    g.add_argument("--quick", action="store_true", help="small shapes and few calls (CI on the host backend)")
    g.add_argument("--calls", type=int, default=None, help="calls per loop (default 200; --quick 20)")
    g.add_argument("--graph", action="store_true", help="also the LL pair captured in a CUDA graph (CUDA only)")
    g.add_argument("--reuse-ab", action="store_true",
                   help="also moelink without reusing unreferenced outputs (system moelink-noreuse)")
    g.add_argument("--ops", default="ll,ht", help="ll, ht or ll,ht")


def run(ctx: Any, args: argparse.Namespace, systems: Dict[str, Any],
        skipped: Optional[Dict[str, Tuple[str, str]]] = None) -> List[Dict[str, Any]]:
    """Every op of every system; records in the order measured. ``skipped``: ``{system: (family, why)}`` for a
    family of ops (``"ll"`` or ``"ht"``) that system cannot run here, recorded as unavailable."""
    skipped = skipped or {}
    shapes = Shapes(args.quick)
    calls = args.calls or (20 if args.quick else 200)
    if ctx.cuda and calls < 100 and not args.quick:
        calls = 100
    records: List[Dict[str, Any]] = []
    runs: List[Tuple[str, Any, Optional[bool]]] = []
    for name, mod in systems.items():
        runs.append((name, mod, None))
        if name == "moelink" and args.reuse_ab and not isinstance(mod, str):
            runs.append(("moelink-noreuse", mod, False))
    wanted = args.ops.split(",")
    for name, mod, reuse in runs:
        if isinstance(mod, str):  # why the system is unavailable
            records.append({"system": name, "op": "-", "dtype": "-", "ranks": ctx.num_ranks, **ctx.facts,
                            "mode": "host-cost", "status": "unavailable", "error": mod})
            continue
        runner = Runner(ctx, name, mod, shapes, calls)
        saved = getattr(mod.Buffer, "_reuse_outputs", None)
        if reuse is not None:
            mod.Buffer._reuse_outputs = reuse
        family, why = skipped.get(name, ("", ""))
        try:
            if "ht" in wanted and family != "ht":
                records.extend(runner.ht(args.num_sms, args.nvl_bytes if not args.quick else 64 << 20))
            if "ll" in wanted and family != "ll":
                records.extend(runner.ll(args.graph))
            if family in wanted:
                records.extend(runner.record(op, dtype, status="unavailable", error=why)
                               for op, dtype in (HT_OPS if family == "ht" else LL_OPS))
        finally:
            if reuse is not None:
                mod.Buffer._reuse_outputs = saved
    return records
