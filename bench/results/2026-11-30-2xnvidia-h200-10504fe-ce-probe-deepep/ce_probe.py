"""Issue 31 probe (call 128): would a copy engine for the HT dispatch's own rows meet 175 / 95 us?

torchrun --nproc_per_node=2 .dv/ce_probe.py OUT.json
Per rank, 4096 tokens, hidden 7168, top-8 of 256, 24 SMs, cached dispatch through moelink's Python API:
  - a: the cached dispatch alone (20 calls between two events, per call);
  - b: the own rows' bytes copied by torch copy_ (cudaMemcpyAsync D2D) alone, 20 between two events;
  - c: both, the copy on a side stream beside each dispatch (per pair);
for MOELINK_HT_TIMING_EXPERIMENT=0 (real) and =8 (receivers skip the own rows' payload) at several
MOELINK_HT_DISPATCH_SEND_BLOCKS. A profile of one copy says whether it ran on a copy engine (a memcpy
activity) or as a kernel.
"""
import json, os, statistics, sys
import torch
import torch.distributed as dist
import moelink as ml

dist.init_process_group("nccl")
rank, R = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
T, H, K, E = 4096, 7168, 8, 256
g = torch.Generator(device=dev).manual_seed(1234 + rank)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
scores = torch.randn(T, E, device=dev, generator=g).abs() + 1
idx = scores.topk(K, dim=1).indices.to(torch.int64)
w = torch.rand(T, K, device=dev, generator=g)
xs = x.float().view(T, H // 128, 128)
amax = xs.abs().amax(-1).clamp(min=1e-4)
x8 = ((xs * (448.0 / amax.unsqueeze(-1))).to(torch.float8_e4m3fn).view(T, H), (amax / 448.0).contiguous())


def per_call(fn, n=20, reps=7):
    for _ in range(3):
        fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1000 / n)
    t = torch.tensor([statistics.median(out)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(t.item(), 1)


side = torch.cuda.Stream()
recs = []
configs = [("0", None), ("8", None), ("8", "12"), ("8", "14"), ("8", "16"), ("0", "12")]
for exp, send_blocks in configs:
    os.environ["MOELINK_HT_TIMING_EXPERIMENT"] = exp
    if send_blocks is None:
        os.environ.pop("MOELINK_HT_DISPATCH_SEND_BLOCKS", None)
    else:
        os.environ["MOELINK_HT_DISPATCH_SEND_BLOCKS"] = send_blocks
    ml.Buffer.set_num_sms(24)
    buf = ml.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30, num_rdma_bytes=0)
    cfg = ml.Buffer.get_dispatch_config(R)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg)
    own = int(in_rank[:, rank].sum().item())
    for dt, payload in (("bf16", x), ("fp8", x8)):
        src = payload if dt == "bf16" else payload[0]
        src_rows = src[:own]
        dst = torch.empty_like(src_rows)
        sc_src = None if dt == "bf16" else payload[1][:own]
        sc_dst = None if sc_src is None else torch.empty_like(sc_src)

        def copy():
            dst.copy_(src_rows)
            if sc_src is not None:
                sc_dst.copy_(sc_src)

        def disp():
            buf.dispatch(payload, handle=handle, config=cfg)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()
            disp()
            torch.cuda.current_stream().wait_stream(side)

        rec = {"experiment": int(exp), "send_blocks": send_blocks or "default", "dtype": dt, "own_rows": own,
               "copy_bytes": dst.numel() * dst.element_size() + (0 if sc_dst is None else sc_dst.numel() * 4),
               "dispatch_us": per_call(disp), "copy_us": per_call(copy), "both_us": per_call(both)}
        recs.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    del buf
    torch.cuda.synchronize(); dist.barrier()

if rank == 0:
    prof_src, prof_dst = x[:4096], torch.empty_like(x[:4096])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        prof_dst.copy_(prof_src)
        torch.cuda.synchronize()
    names = sorted({e.name for e in p.events()})
    print("profile of one copy_:", names, flush=True)
    recs.append({"profile_names": names})
    json.dump(recs, open(sys.argv[1], "w"), indent=1)
dist.barrier()
dist.destroy_process_group()
