"""Where the host time of an eager call goes on the GPU machine, piece by piece (issue 26): torch's stream and
capture queries, the reuse checks on a kept tensor, a tiny torch kernel's launch, and moelink's and DeepEP's LL
dispatch + combine, each on the current (default) stream and on a side stream, with moelink's driver launch time
from its host-time split.

    torchrun --nproc_per_node=2 scripts/device/launch_cost.py --json launch-cost.json

Every figure is host time per call over a loop without synchronising (the slowest rank's); none is a GPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist


def per_call(fn: Callable[[], Any], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def slowest(values: Dict[str, float], device: Any) -> Dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    out: Dict[str, float] = {}

    # torch's queries and the reuse checks, as the Python layer makes them.
    c = torch._C
    idx = dev.index
    kept = torch.empty(1024, device=dev)
    storage = kept.untyped_storage()._cdata
    for where, ctx in (("default", torch.cuda.stream(torch.cuda.current_stream())), ("side", torch.cuda.stream(side))):
        with ctx:
            out[f"raw_stream_{where}"] = per_call(lambda: c._cuda_getCurrentRawStream(idx))
            out[f"is_capturing_{where}"] = per_call(lambda: c._cuda_isCurrentStreamCapturing())
            one = torch.zeros(1, device=dev)
            out[f"torch_add_launch_{where}"] = per_call(lambda: one.add_(1))
    out["reuse_checks_one_tensor"] = per_call(lambda: (sys.getrefcount(kept), kept._use_count(), c._storage_Use_Count(storage)))
    out["mode_enabled"] = per_call(lambda: c._is_torch_function_mode_enabled())
    torch.cuda.synchronize()

    # LL dispatch + combine at DeepEP's shapes, on each stream.
    t, h, k, e = 128, 7168, 8, 288
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    topk = (torch.randn(t, e, generator=g).abs() + 1).topk(k, dim=1).indices.to(dev)
    w = torch.rand(t, k, generator=g).to(dev)
    systems = []
    import moelink
    systems.append(("moelink", moelink))
    try:
        import deep_ep
        systems.append(("deepep", deep_ep))
    except ImportError:
        pass
    for name, mod in systems:
        hint = mod.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
        buf = mod.Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                         num_qps_per_rank=e // world)
        native = getattr(buf, "_native", None)
        ids = topk.to(getattr(mod, "topk_idx_t", torch.int64))
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, t, e, use_fp8=True)
        y = torch.randn(e // world, world * t, h, device=dev).to(torch.bfloat16)
        buf.low_latency_combine(y, ids, w, handle)  # compiles and loads the combine before anything is timed
        for where, stream in (("default", torch.cuda.current_stream()), ("side", side)):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                def pair() -> None:
                    _, _, hd, _, _ = buf.low_latency_dispatch(x, ids, t, e, use_fp8=True)
                    buf.low_latency_combine(y, ids, w, hd)
                torch.cuda.synchronize()
                dist.barrier()
                if native is not None:
                    native.set_host_timing(True)
                out[f"{name}_ll_pair_{where}"] = per_call(pair, n=200)
                if native is not None:
                    sums = native.host_times()
                    native.set_host_timing(False)
                    calls = sum(v[0] for v in sums.values())
                    out[f"{name}_ll_launch_{where}"] = sum(v[4] for v in sums.values()) / max(calls, 1) / 1e3
                    out[f"{name}_ll_backend_{where}"] = sum(v[2] for v in sums.values()) / max(calls, 1) / 1e3
                torch.cuda.synchronize()
            torch.cuda.current_stream().wait_stream(stream)
        del buf
        torch.cuda.synchronize()
        dist.barrier()

    res = slowest(out, dev)
    if rank == 0:
        print(f"host us per call, slowest of {world} ranks, {torch.cuda.get_device_name()}:")
        for key, v in res.items():
            print(f"  {key:36} {v:8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world, "device": torch.cuda.get_device_name(), "us_per_call": res}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
