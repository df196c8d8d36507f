"""Prints the LL kernel-trace summaries of `moelink bench --json` files (run with --ll-trace or
MOELINK_LL_TRACE=1), one line per record and launch kind: the kernel span next to the event time, then each
trace point as median/last over blocks (/b0: block 0, the dispatch send's check block), µs after the kernel's
first block started; and the back-to-back (DeepEP's method) kernel times.

Runs anywhere, on the JSON a device run returned:
    python3 scripts/ll-trace-points.py bench/results/<run>/bench.json
"""
import json
import sys

for f in sys.argv[1:]:
    for r in json.load(open(f)):
        if r.get("mode") != "ll":
            continue
        name = f"{f.split('/')[-1]} {r.get('op')} EP{r.get('ranks')} T={r.get('tokens')}"
        b0 = lambda p: "" if p.get("block0_us") is None else f"/b0 {p['block0_us']:.1f}"
        for k in ("kernel", "send_kernel", "recv_kernel"):
            pts = r.get(k + "_trace")
            if pts:
                desc = " ".join(f"{p['point']}={p['median_us']:.1f}/{p['last_us']:.1f}{b0(p)}" for p in pts)
                print(f"{name} {k}: span {r.get(k + '_us', 0):.1f} us (event {r.get('time_us', 0):.1f}) | {desc}")
        for k in ("dispatch", "combine"):
            pts = r.get(f"loop_{k}_trace")
            if pts:
                desc = " ".join(f"{p['point']}={p['median_us']:.1f}/{p['last_us']:.1f}{b0(p)}" for p in pts)
                print(f"{name} back-to-back {k}: span {r.get(f'loop_{k}_kernel_us', 0):.1f} us | {desc}")
        if "loop_dispatch_kernel_us" in r:
            print(f"{name} back to back (DeepEP's method): dispatch {r['loop_dispatch_kernel_us']:.1f} us + "
                  f"combine {r['loop_combine_kernel_us']:.1f} us kernel time; {r['loop_pair_us']:.1f} us per pair with launches")
