import json, sys
for f in sys.argv[1:]:
    recs = json.load(open(f))
    recs = recs if isinstance(recs, list) else recs.get("records", [])
    for x in recs:
        if x.get("op") not in ("dispatch", "combine"):
            continue
        print(f, x["op"], "time", round(x.get("time_us", 0), 1), "kernel", x.get("kernel_us"), "loop", x.get("loop_dispatch_kernel_us"), x.get("loop_combine_kernel_us"))
        for key in ("kernel_trace", "loop_dispatch_trace", "loop_combine_trace"):
            if key in x:
                print("   ", key, " | ".join(f"{p['point']} {p['median_us']:.1f}/{p['last_us']:.1f}" for p in x[key]))
