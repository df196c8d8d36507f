"""Issue 31 probe: could copy engines carry the EP2 HT rows between the pair of GPUs?

    python3 scripts/device/ce_pair.py ce-pair.json   (one process, GPUs 0 and 1, peer access through torch)
At DeepEP's shape (4096 tokens, hidden 7168), per direction, both directions at once:
  1. ce:        rank r's payload rows (BF16 58.7 MB, FP8 29.4 MB; the scales' 0.9 MB left out) pushed by one
                copy to the peer's staging;
  2. ce-chunks: the same in 8 copies (what a pipelined path would issue), and the host time to issue them;
  3. sm:        a local copy of twice the rows on 24 SMs (Triton, 24 programs), what the receivers move;
  4. ce+sm:     1 and 3 at once on separate streams: do the copy engines and the SMs' local copy overlap?
  5. pipelineN: the copy-engine dispatch end to end: N pieces, each followed by its flag in the peer (a 4-byte
                copy, or a stream write: cuStreamWriteValue32), on one side stream or alternating over two,
                while 24 Triton programs copy the own rows and then each piece once its flag is set;
                ce-pieces8-*: the same pieces and flags without receivers.
Times: CUDA events, median of 20 reps, the slower GPU; the host issues each case while the GPUs sleep.
"""
import ctypes, json, statistics, sys, time
import torch

# Flags written by the stream itself (cuStreamWriteValue32, with its memory barrier before the write), the
# form a path of our own would use, beside flags written by 4-byte copies.
_libcuda = ctypes.CDLL("libcuda.so.1")
_write_value = _libcuda.cuStreamWriteValue32_v2
_write_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
_write_value.restype = ctypes.c_int


def stream_write_value(stream, ptr, value):
    rc = _write_value(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(ptr), ctypes.c_uint32(value), 0)
    if rc != 0:
        raise RuntimeError(f"cuStreamWriteValue32_v2 returned {rc}")

OUT = sys.argv[1] if len(sys.argv) > 1 else "ce_pair.json"
T, H = 4096, 7168
# With one GPU both sides are that GPU: a check of the script, no link figure.
ONE_GPU = torch.cuda.device_count() < 2
devs = [torch.device("cuda", 0), torch.device("cuda", 0 if ONE_GPU else 1)]
if ONE_GPU:
    print("one GPU: both sides share it, so no figure here is a link figure")
else:
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1), "1->0:", torch.cuda.can_device_access_peer(1, 0))
try:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr, NPROG: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, NPROG * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    def sm_copy(src, dst, sms=24):
        n = src.numel()
        copy_kernel[(sms,)](src, dst, n, BLOCK=8192, NPROG=sms, num_warps=16)
    sm_kind = "triton, 24 programs"

    # The receivers of a copy-engine dispatch: this rank's own rows first, then each staged piece once its
    # flag holds this rep's epoch (a bounded spin: a lost flag leaves wrong data, which the check reports).
    @triton.jit(do_not_specialize=["epoch"])
    def receive_kernel(own_src, own_dst, n_own, stage, out, flags, piece, n_pieces, epoch, BLOCK: tl.constexpr, NPROG: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n_own, NPROG * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_own
            tl.store(own_dst + offs, tl.load(own_src + offs, mask=m), mask=m)
        for p in range(n_pieces):
            f = tl.load(flags + p, volatile=True)
            spins = 0
            while (f < epoch) & (spins < 50_000_000):
                f = tl.load(flags + p, volatile=True)
                spins += 1
            base = p * piece
            for start in range(pid * BLOCK, piece, NPROG * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                m = offs < piece
                tl.store(out + base + offs, tl.load(stage + base + offs, mask=m), mask=m)
except Exception as e:  # noqa: BLE001
    print("no triton:", e)

    def sm_copy(src, dst, sms=24):
        torch.mul(src, 1, out=dst)
    sm_kind = "torch.mul over every SM"

res = {"sm_kind": sm_kind, "one_gpu": ONE_GPU, "gpus": [torch.cuda.get_device_name(d) for d in devs], "cases": []}
streams = [torch.cuda.Stream(device=d) for d in devs]
side = [torch.cuda.Stream(device=d) for d in devs]
side2 = [torch.cuda.Stream(device=d) for d in devs]


SLEEP_CYCLES = 4_000_000  # ~2 ms at 1.98 GHz: longer than the host takes to issue any case


def timed(issue, reps=20, warm=3):
    """issue(i) enqueues GPU i's work on streams[i] / side[i]; returns per-GPU (µs) medians and the host µs to issue."""
    per = [[], []]
    host = []
    for rep in range(warm + reps):
        for d in devs:
            torch.cuda.synchronize(d)
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in devs]
        # The GPUs sleep while the host issues the case (torch's copies cost ~20-150 µs of host time each,
        # which the driver's own cuMemcpyAsync would not), so the events time the GPU's work alone.
        for i in range(2):
            with torch.cuda.device(devs[i]):
                with torch.cuda.stream(streams[i]):
                    torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for i in range(2):
            with torch.cuda.device(devs[i]):
                ev[i][0].record(streams[i])
                side[i].wait_stream(streams[i])
        for i in range(2):
            with torch.cuda.device(devs[i]):
                issue(i)
        for i in range(2):
            with torch.cuda.device(devs[i]):
                streams[i].wait_stream(side[i])
                ev[i][1].record(streams[i])
        t1 = time.perf_counter()
        for i in range(2):
            ev[i][1].synchronize()
        if rep >= warm:
            host.append((t1 - t0) * 1e6)
            for i in range(2):
                per[i].append(ev[i][0].elapsed_time(ev[i][1]) * 1e3)
    med = [statistics.median(p) for p in per]
    return max(med), med, statistics.median(host)


for dtype, row_bytes in (("bf16", H * 2), ("fp8", H)):
    nbytes = T * row_bytes
    x = [torch.randint(0, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=d) for d in devs]
    stage = [torch.zeros(nbytes // 4, dtype=torch.int32, device=d) for d in devs]  # stage[i]: rows from the peer
    local_src = [torch.randint(0, 2**31 - 1, (2 * nbytes // 4,), dtype=torch.int32, device=d) for d in devs]
    local_dst = [torch.zeros_like(s) for s in local_src]

    def ce(i, chunks=1):
        peer = 1 - i
        with torch.cuda.stream(side[i]):
            n = x[i].numel()
            for c in range(chunks):
                a, b = n * c // chunks, n * (c + 1) // chunks
                stage[peer][a:b].copy_(x[i][a:b], non_blocking=True)

    def sm(i):
        with torch.cuda.stream(streams[i]):
            sm_copy(local_src[i], local_dst[i])

    # The pipeline: PIECES copies, each followed by a 4-byte copy of the rep's epoch into the peer's flag p
    # (stream order: the flag lands after its piece), while 24 programs receive. Own rows are local_src's
    # first half, so the receivers move what a dispatch's receivers move: own rows and the peer's.
    PIECES = 8
    flags = [torch.zeros(PIECES, dtype=torch.int32, device=d) for d in devs]
    epoch_word = [torch.zeros(1, dtype=torch.int32, device=d) for d in devs]
    out = [torch.zeros(nbytes // 4, dtype=torch.int32, device=d) for d in devs]
    own = [local_src[i][: nbytes // 4] for i in range(2)]
    own_out = [local_dst[i][: nbytes // 4] for i in range(2)]
    epoch = [0]

    def pipeline(i, receive=True, pieces=PIECES, flag="copy", num_streams=1):
        """pieces copies (alternating over num_streams side streams), each followed by its flag: a 4-byte
        copy ("copy") or a stream write ("write")."""
        peer = 1 - i
        if i == 0:
            epoch[0] += 1
        e = epoch[0]
        with torch.cuda.stream(streams[i]):
            epoch_word[i].fill_(e)
        lanes = [side[i], side2[i]][:num_streams]
        for lane in lanes:
            lane.wait_stream(streams[i])
        n = x[i].numel()
        for c in range(pieces):
            lane = lanes[c % num_streams]
            a, b = n * c // pieces, n * (c + 1) // pieces
            with torch.cuda.stream(lane):
                stage[peer][a:b].copy_(x[i][a:b], non_blocking=True)
                if flag == "copy":
                    flags[peer][c : c + 1].copy_(epoch_word[i], non_blocking=True)
                else:
                    stream_write_value(lane, flags[peer].data_ptr() + 4 * c, e)
        for lane in lanes[1:]:
            side[i].wait_stream(lane)
        if receive:
            with torch.cuda.stream(streams[i]):
                receive_kernel[(24,)](own[i], own_out[i], own[i].numel(), stage[i], out[i], flags[i], n // pieces, pieces, e,
                                      BLOCK=8192, NPROG=24, num_warps=16)

    cases = {
        "ce": lambda i: ce(i),
        "ce-chunks8": lambda i: ce(i, 8),
        "sm": sm,
        "ce+sm": lambda i: (ce(i), sm(i)),
        "ce-chunks8+sm": lambda i: (ce(i, 8), sm(i)),
        "ce-pieces8-flags": lambda i: pipeline(i, receive=False),
        "ce-pieces8-writes": lambda i: pipeline(i, receive=False, flag="write"),
        "ce-pieces8-writes-2streams": lambda i: pipeline(i, receive=False, flag="write", num_streams=2),
        "pipeline8": pipeline,
        "pipeline8-writes": lambda i: pipeline(i, flag="write"),
        "pipeline8-writes-2streams": lambda i: pipeline(i, flag="write", num_streams=2),
        "pipeline4-writes": lambda i: pipeline(i, pieces=4, flag="write"),
        "pipeline4-writes-2streams": lambda i: pipeline(i, pieces=4, flag="write", num_streams=2),
    }
    if sm_kind.startswith("torch"):
        cases = {k: v for k, v in cases.items() if not k.startswith("pipeline")}
    for name, issue in cases.items():
        t, med, host = timed(issue)
        moved = nbytes if name.startswith("ce") else 0
        rec = {"dtype": dtype, "case": name, "us": round(t, 1), "per_gpu_us": [round(m, 1) for m in med], "host_issue_us": round(host, 1),
               "bytes_per_direction": moved, "ce_gbps_per_direction": round(moved / (t * 1e-6) / 1e9, 1) if moved else None,
               "local_bytes": 2 * nbytes if ("sm" in name or name.startswith("pipeline")) else 0}
        res["cases"].append(rec)
        print(f"{dtype} {name:14s} {t:8.1f} us  per GPU {rec['per_gpu_us']}  host {host:6.1f} us  CE GB/s/dir {rec['ce_gbps_per_direction']}", flush=True)
    # The staged rows arrived intact (the last case's copies).
    for i in range(2):
        torch.cuda.synchronize(devs[i])
    ok = all(torch.equal(stage[1 - i].cpu(), x[i].cpu()) for i in range(2))
    received = all(torch.equal(out[i].cpu(), x[1 - i].cpu()) and torch.equal(own_out[i].cpu(), own[i].cpu()) for i in range(2))
    print(f"{dtype} staged rows equal: {ok}; pipeline's received rows equal: {received}")
    res["cases"].append({"dtype": dtype, "staged_rows_equal": ok, "pipeline_received_equal": received})
json.dump(res, open(OUT, "w"), indent=1)
