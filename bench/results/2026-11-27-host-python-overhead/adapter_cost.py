"""Host cost per call of the Python API with the native work made small: one rank (no exchange), the host
backend, tiny shapes. Two figures per op: ``total`` (the call) and ``adapter`` (the call less the time spent
inside the native module's operations, timed around each native call: what the Python layer costs, torch's
allocations included; a native call's argument parsing and tensor reading count as native). The native part is
the CPU reference's work, which no GPU does: compare ``adapter`` across versions. CPU figures, not GPU ones;
the least of 7 repetitions, as the machine is shared.

    python adapter_cost.py [--label NAME] [--calls N] [--json out.json]

Run it against each version of the package (PYTHONPATH pointing at the installed wheel) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["MOELINK_BACKEND"] = "host"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moelink  # noqa: E402
from moelink import group as mgroup  # noqa: E402

# One rank exchanges with itself: both versions skip the store the same way (the package does so from this
# change on; an older one is given the same shortcut here), so that the figures are the adapter's.
_gather, _a2a = mgroup.TorchStoreGroup.all_gather_within, mgroup.TorchStoreGroup.all_to_all_within
mgroup.TorchStoreGroup.all_gather_within = lambda self, d, t: [bytes(d)] if self._size == 1 else _gather(self, d, t)
mgroup.TorchStoreGroup.all_to_all_within = lambda self, s, t: [bytes(m) for m in s] if self._size == 1 else _a2a(self, s, t)


class TimedNative:
    """Forwards to a native buffer, adding the time spent in its methods to ``spent`` (less the time of Python
    callbacks they make, e.g. ``dispatch``'s ``alloc``, which is the adapter's)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.spent = 0.0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*args, **kwargs):
            inside = [0.0]
            if name == "dispatch" and len(args) > 1 and callable(args[1]):
                alloc = args[1]

                def timed_alloc(*a):
                    t = time.perf_counter()
                    try:
                        return alloc(*a)
                    finally:
                        inside[0] += time.perf_counter() - t

                args = (args[0], timed_alloc, *args[2:])
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0 - inside[0]

        return timed


def per_call(fn, natives, calls: int, repeats: int = 7):
    for _ in range(20):
        fn()
    totals, adapters = [], []
    for _ in range(repeats):
        for n in natives:
            n.spent = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - t0
        totals.append(total / calls * 1e6)
        adapters.append((total - sum(n.spent for n in natives)) / calls * 1e6)
    return round(min(totals), 2), round(min(adapters), 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="current")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--json", default=None)
    p.add_argument("--no-reuse", action="store_true", help="turn output reuse off (Buffer._reuse_outputs)")
    a = p.parse_args()
    if a.no_reuse:
        moelink.Buffer._reuse_outputs = False
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    g = torch.Generator().manual_seed(1)
    # LL: 8 tokens, hidden 512, top-4 of 8 experts; HT: 64 tokens, hidden 256, top-4 of 8.
    T, H, K, E = 8, 512, 4, 8
    ll = moelink.Buffer(dist.group.WORLD, num_rdma_bytes=moelink.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                        low_latency_mode=True)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    w = torch.rand(T, K, generator=g)
    y = torch.randn(E, T, H, generator=g).to(torch.bfloat16)
    _, _, handle, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=True)

    def pair():
        _, _, h, _, _ = ll.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        return ll.low_latency_combine(y, idx, w, h)

    HT_T, HT_H = 64, 256
    ht = moelink.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20)
    hx = torch.randn(HT_T, HT_H, generator=g).to(torch.bfloat16)
    hx8 = (hx.float().to(torch.float8_e4m3fn), torch.rand(HT_T, HT_H // 128, generator=g) + 0.5)
    hidx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(HT_T)]).to(torch.int64)
    hw = torch.rand(HT_T, K, generator=g)
    per_rank, _, per_expert, in_rank, _ = ht.get_dispatch_layout(hidx, E)

    def fresh():
        return ht.dispatch(hx, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=hidx, topk_weights=hw)

    recv_x, _, _, _, hh, _ = fresh()
    ops = {
        "ll_dispatch": lambda: ll.low_latency_dispatch(x, idx, T, E, use_fp8=True),
        "ll_combine": lambda: ll.low_latency_combine(y, idx, w, handle),
        "ll_dispatch_combine": pair,
        "ht_layout": lambda: ht.get_dispatch_layout(hidx, E),
        "ht_dispatch": fresh,
        "ht_cached_dispatch_bf16": lambda: ht.dispatch(hx, handle=hh),
        "ht_cached_dispatch_fp8": lambda: ht.dispatch(hx8, handle=hh),
        "ht_combine": lambda: ht.combine(recv_x, hh),
    }
    natives = [TimedNative(ll._native), TimedNative(ht._native)]
    ll._native, ht._native = natives
    out = {}
    for name, fn in ops.items():
        total, adapter = per_call(fn, natives, a.calls)
        out[name] = {"total_us": total, "adapter_us": adapter}
        print(f"{a.label:10} {name:26} total {total:8.2f} us   adapter {adapter:7.2f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"label": a.label, "us_per_call": out, "note": "host backend, 1 rank, tiny shapes: CPU"}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
