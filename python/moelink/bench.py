"""Side-by-side benchmark: moelink vs NCCL ``all_to_all_single`` (and DeepEP when ``import deep_ep`` works).

    torchrun --nproc_per_node=4 -m moelink.bench --json results.json
    torchrun --nproc_per_node=2 -m moelink.bench --host-cost --graph --json hostcost.json   # host cost per call
    MOELINK_BACKEND=host torchrun --nproc_per_node=2 -m moelink.bench --tokens 256 --hidden 512 \\
        --experts 16 --ll-tokens 16 --ll-experts 16      # CPU/gloo smoke run (times mean nothing)

Shapes default to DeepEP's benchmark: high-throughput 4096 tokens per rank, hidden 7168, top-8 of 256
experts; low-latency 128 tokens per rank, top-8 of 288. Routing: scores ``|randn| + 1``, top-k.

Every system runs on the same inputs. Before timing, each result is checked (moelink and DeepEP against
the NCCL baseline's rows and sums; low-latency against the expected per-expert layout and ``x·Σw``).
Times: CUDA events around each repetition (ranks aligned by a barrier first; wall clock on the host
backend), median per rank, then the slowest rank (``all_reduce MAX``). Bandwidth is counted as DeepEP
does (per rank, mean over ranks): high-throughput "logical" = received rows x row bytes including the
rank's own rows (a BF16 row is 2H bytes, an FP8 row H + H/128*4; combine counts the same rows as BF16),
"wire" = rows from other ranks only; low-latency "logical" = (token, selected expert) pairs x row bytes
(an FP8 row H + H/128*4 + 16), "wire" = one row per (token, other destination rank).

The baselines are what a user would write with torch: pack rows by destination, ``all_to_all_single``,
unpack (high-throughput: counts exchanged first; low-latency: fixed ``T_max`` rows per destination, one
bf16 row per destination rank, combine pre-reduced on the expert side). Records (``--json``) have the
fields of the Rust CLI's ``moelink bench --json``.

``--host-cost`` measures something else: what each operation costs the host per call through the Python API
(``cpu_us_per_call``, ``loop_us_per_call``, ``sync_us``), moelink beside DeepEP; see ``moelink.bench_hostcost``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _env, _native, bench_hostcost


# ---------------------------------------------------------------------------------------------------- setup


class Ctx:
    """This rank's run: device, sizes, facts shared by every record."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Checked first: a typo in MOELINK_BACKEND gets moelink's message, not a CUDA error.
        self.cuda = _env.backend() != "host" and torch.cuda.is_available()
        if not self.cuda:
            os.environ["MOELINK_BACKEND"] = "host"
        # More ranks than GPUs (processes sharing a GPU under CUDA MPS): ranks share GPUs round-robin over a
        # gloo group, since NCCL refuses two ranks on one GPU. The records say so (`gpus`, `shared_gpu`).
        gpus = torch.cuda.device_count() if self.cuda else 0
        self.shared_gpu = self.cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > gpus
        if self.shared_gpu and not args.host_cost:
            raise SystemExit("moelink.bench: ranks sharing a GPU run only --host-cost (the NCCL baseline needs a GPU per rank)")
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        dist.init_process_group("nccl" if self.cuda and not self.shared_gpu else "gloo")
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        # Where the bench's own small collectives (timings, checks) live: gloo's are on the CPU.
        self.collective_device = self.device if self.cuda and not self.shared_gpu else torch.device("cpu")
        self.group = dist.group.WORLD
        self.facts = {
            "backend": "cuda" if self.cuda else "host",
            "device": torch.cuda.get_device_name(self.device) if self.cuda else cpu_model(),
            "gpus": min(self.num_ranks, gpus) if self.cuda else 0,
            "shared_gpu": self.shared_gpu,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit(),
        }

    @property
    def ranks_per_gpu(self) -> int:
        gpus = max(1, torch.cuda.device_count()) if self.cuda else 1
        return -(-int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // gpus)

    def sms_partitioned(self) -> bool:
        """Whether CUDA MPS holds each process sharing a GPU to at most its share of the SMs."""
        try:
            percentage = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
        except ValueError:
            return False
        return percentage * self.ranks_per_gpu <= 100

    def told_sms(self) -> int:
        """The SMs the CUDA runtime reports where scripts/device/share_gpus/share_sms.c is preloaded with
        MOELINK_SHARE_GPUS_SMS (and reports them), else 0. moelink reads the SMs through the driver, unaffected."""
        try:
            told = int(os.environ.get("MOELINK_SHARE_GPUS_SMS", "0"))
        except ValueError:
            return 0
        reported = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 0
        return told if told > 0 and reported == told else 0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def commit() -> str:
    """The commit records name: ``MOELINK_COMMIT``, else the one the native module was built from, else the
    checkout's beside this file (an editable install), else "unknown"."""
    if os.environ.get("MOELINK_COMMIT"):
        return os.environ["MOELINK_COMMIT"]
    built = getattr(_native, "__build_commit__", "")
    if built:
        return built
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def record(ctx: Ctx, system: str, mode: str, op: str, dtype: Optional[str], tokens: int, experts: int,
           num_sms: Optional[int], **extra: Any) -> Dict[str, Any]:
    a = ctx.args
    r: Dict[str, Any] = {"system": system, **ctx.facts, "mode": mode, "op": op, "dtype": dtype, "ranks": ctx.num_ranks,
                         "tokens": tokens, "hidden": a.hidden, "topk": a.topk, "experts": experts, "routing": "uniform",
                         "num_sms": num_sms, "time_us": None, "logical_gbps": None, "wire_gbps": None, "correct": None,
                         "status": "unavailable", "reps": a.reps, "warmup": a.warmup,
                         "timer": "cuda-events" if ctx.cuda else "wall"}
    if system != "moelink":
        r["backend"] = "cuda" if ctx.cuda else "host"
    r.update(extra)
    return r


def routing(ctx: Ctx, tokens: int, experts: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``x bf16 [T, H]``, ``topk_idx int64 [T, K]`` (scores |randn|+1, top-k) and weights."""
    g = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    x = torch.randn(tokens, ctx.args.hidden, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    idx = scores.topk(ctx.args.topk, dim=1).indices.to(torch.int64)
    w = torch.rand(tokens, ctx.args.topk, generator=g)
    return x.to(ctx.device), idx.to(ctx.device), w.to(ctx.device)


def timed(ctx: Ctx, fn: Callable[[], Any]) -> float:
    """Median microseconds of ``fn`` on this rank, then the slowest rank's."""
    for _ in range(ctx.args.warmup):
        fn()
    times: List[float] = []
    for _ in range(ctx.args.reps):
        ctx.sync()
        dist.barrier()
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=ctx.collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def mean_over_ranks(ctx: Ctx, v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=ctx.collective_device)
    dist.all_reduce(t)
    return float(t.item()) / ctx.num_ranks


def all_ok(ctx: Ctx, ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=ctx.collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def measure(ctx: Ctx, rec: Dict[str, Any], check: Callable[[], bool], fn: Callable[[], Any],
            logical: float, wire: float) -> Dict[str, Any]:
    """Checks, then times ``fn``; fills the record (status, correct, time, bandwidths)."""
    try:
        ok = all_ok(ctx, bool(check()))
        rec["correct"] = ok
        t = timed(ctx, fn)
        rec.update(time_us=t, logical_gbps=logical / (t * 1e3), wire_gbps=wire / (t * 1e3),
                   status="ok" if ok else "incorrect")
        if not ok:
            rec["error"] = "the correctness check failed; the time is not trustworthy"
    except Exception as e:  # noqa: BLE001 - one failing system must not stop the others
        rec.update(failed(e))
    return rec


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-2) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def fp8_inputs(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    t, h = x.shape
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn), torch.rand(t, h // 128, device=x.device) + 0.5


# ---------------------------------------------------------------------------------------------------- high-throughput


class NcclHt:
    """HT dispatch/combine as a torch user writes it: pack by destination, exchange counts, all_to_all_single."""

    def __init__(self, ctx: Ctx, experts: int) -> None:
        self.ctx, self.experts = ctx, experts

    def plan(self, idx: torch.Tensor) -> Dict[str, Any]:
        r = self.ctx.num_ranks
        dest = torch.where(idx >= 0, idx // (self.experts // r), torch.full_like(idx, -1))
        in_rank = torch.zeros(idx.shape[0], r, dtype=torch.bool, device=idx.device)
        rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)
        ok = dest >= 0
        in_rank[rows[ok], dest[ok]] = True
        dst, tok = in_rank.t().nonzero(as_tuple=True)  # by destination, then token order
        send_counts = in_rank.sum(0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        return {"tok": tok, "dst": dst, "send": send_counts.tolist(), "recv": recv_counts.tolist(), "in_rank": in_rank}

    def a2a(self, rows: torch.Tensor, p: Dict[str, Any], back: bool = False) -> torch.Tensor:
        send, recv = (p["recv"], p["send"]) if back else (p["send"], p["recv"])
        out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv, send)
        return out

    def dispatch(self, payload: Any, idx: torch.Tensor, w: torch.Tensor) -> Tuple[Any, Dict[str, Any]]:
        p = self.plan(idx)
        tok = p["tok"]
        if isinstance(payload, tuple):
            x = self.a2a(payload[0][tok].view(torch.uint8), p).view(torch.float8_e4m3fn)
            out: Any = (x, self.a2a(payload[1][tok].contiguous(), p))
        else:
            out = self.a2a(payload[tok], p)
        # Top-k travels too, as local expert ids (what combine and the experts need).
        recv_idx = self.a2a(idx[tok], p)
        recv_w = self.a2a(w[tok], p)
        num_local = self.experts // self.ctx.num_ranks
        lo = self.ctx.rank * num_local
        local = (recv_idx >= lo) & (recv_idx < lo + num_local)
        p["recv_idx"] = torch.where(local, recv_idx - lo, torch.full_like(recv_idx, -1))
        p["recv_w"] = torch.where(local, recv_w, torch.zeros_like(recv_w))
        return out, p

    def combine(self, y: torch.Tensor, p: Dict[str, Any], num_tokens: int) -> torch.Tensor:
        back = self.a2a(y, p, back=True)
        acc = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        acc.index_add_(0, p["tok"], back.float())
        return acc.to(torch.bfloat16)


def run_ht(ctx: Ctx, systems: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    a = ctx.args
    t, e = a.tokens, a.experts
    x, idx, w = routing(ctx, t, e, seed=1)
    x8 = fp8_inputs(x)
    nccl = NcclHt(ctx, e)
    # The baseline's results are the reference of the other systems.
    ref_bf16, plan = nccl.dispatch(x, idx, w)
    ref_fp8, _ = nccl.dispatch(x8, idx, w)
    ref_combined = nccl.combine(ref_bf16, plan, t)
    n = sum(plan["recv"])
    own = int(plan["in_rank"][:, ctx.rank].sum())
    rows = {"bf16": 2 * a.hidden, "fp8": a.hidden + a.hidden // 128 * 4}
    recv_rows, other_rows = mean_over_ranks(ctx, n), mean_over_ranks(ctx, n - own)

    def bytes_of(dtype: str) -> Tuple[float, float]:
        return recv_rows * rows[dtype], other_rows * rows[dtype]

    for dtype, payload in (("bf16", x), ("fp8", x8)):
        rec = record(ctx, "nccl", "ht", "dispatch", dtype, t, e, None)
        records.append(measure(ctx, rec, lambda: True, lambda payload=payload: nccl.dispatch(payload, idx, w), *bytes_of(dtype)))
    rec = record(ctx, "nccl", "ht", "combine", "bf16", t, e, None)
    records.append(measure(ctx, rec, lambda: True, lambda: nccl.combine(ref_bf16, plan, t), *bytes_of("bf16")))

    refs = {"bf16": ref_bf16, "fp8": ref_fp8, "combined": ref_combined}
    for name, mod in systems.items():
        records.extend(ht_system(ctx, name, mod, (x, x8, idx, w), plan, refs, bytes_of))


HT_CASES = (("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16"))


def failed(err: BaseException) -> Dict[str, Any]:
    """Status and message of a system that could not run a case."""
    unavailable = isinstance(err, ImportError) or "not built yet" in str(err) or "unavailable" in str(err).lower()
    return {"status": "unavailable" if unavailable else "error", "error": f"{type(err).__name__}: {err}"}


def ht_system(ctx: Ctx, name: str, mod: Any, inputs: Tuple[Any, ...], plan: Dict[str, Any], refs: Dict[str, Any],
              bytes_of: Callable[[str], Tuple[float, float]]) -> List[Dict[str, Any]]:
    """HT dispatch (bf16, fp8) and combine of one DeepEP-API system (moelink or DeepEP), checked against ``refs``."""
    a = ctx.args
    t, e = a.tokens, a.experts
    x, x8, idx, w = inputs
    if isinstance(mod, str):  # why the system is unavailable
        return [record(ctx, name, "ht", op, dtype, t, e, a.num_sms, error=mod) for op, dtype in HT_CASES]
    try:
        mod.Buffer.set_num_sms(a.num_sms)
        buf = mod.Buffer(ctx.group, num_nvl_bytes=a.nvl_bytes, num_rdma_bytes=0)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
        cfg, ccfg = mod.Buffer.get_dispatch_config(ctx.num_ranks), mod.Buffer.get_combine_config(ctx.num_ranks)
    except Exception as err:  # noqa: BLE001
        return [record(ctx, name, "ht", op, dtype, t, e, a.num_sms, **failed(err)) for op, dtype in HT_CASES]

    def dispatch(payload: Any) -> Any:
        return buf.dispatch(payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=cfg)

    def check_bf16() -> bool:
        recv_x, recv_idx, recv_w, _, _, _ = dispatch(x)
        return (torch.equal(recv_x, refs["bf16"]) and torch.equal(recv_idx, plan["recv_idx"])
                and torch.equal(recv_w, plan["recv_w"]))

    def check_fp8() -> bool:
        (rx, rs), _, _, _, _, _ = dispatch(x8)
        return torch.equal(rx.view(torch.uint8), refs["fp8"][0].view(torch.uint8)) and torch.equal(rs, refs["fp8"][1])

    out = [measure(ctx, record(ctx, name, "ht", "dispatch", "bf16", t, e, a.num_sms), check_bf16, lambda: dispatch(x),
                   *bytes_of("bf16")),
           measure(ctx, record(ctx, name, "ht", "dispatch", "fp8", t, e, a.num_sms), check_fp8, lambda: dispatch(x8),
                   *bytes_of("fp8"))]
    rec = record(ctx, name, "ht", "combine", "bf16", t, e, a.num_sms)
    try:
        recv_x, _, _, _, handle, _ = dispatch(x)
    except Exception as err:  # noqa: BLE001
        return out + [{**rec, **failed(err)}]

    def combine() -> Any:
        return buf.combine(recv_x, handle, config=ccfg)

    return out + [measure(ctx, rec, lambda: close(combine()[0], refs["combined"]), combine, *bytes_of("bf16"))]


# ---------------------------------------------------------------------------------------------------- low-latency


class NcclLl:
    """LL dispatch/combine with torch: T_max rows per destination rank (one bf16 row per token and destination),
    all_to_all_single with equal splits, expanded into the per-expert layout; combine pre-reduces per (source,
    token) on the expert side and sums the returned partials."""

    def __init__(self, ctx: Ctx, experts: int, t_max: int) -> None:
        self.ctx, self.experts, self.t_max = ctx, experts, t_max

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, Any]]:
        r, t, tm = self.ctx.num_ranks, x.shape[0], self.t_max
        el = self.experts // r
        dest = torch.where(idx >= 0, idx // el, torch.full_like(idx, -1))
        to_rank = torch.stack([(dest == d).any(1) for d in range(r)])  # [R, T]
        send_x = torch.zeros(r, tm, x.shape[1], dtype=x.dtype, device=x.device)
        send_x[:, :t] = torch.where(to_rank.unsqueeze(-1), x.unsqueeze(0), torch.zeros_like(x).unsqueeze(0))
        send_meta = torch.full((r, tm, idx.shape[1]), -1, dtype=torch.int64, device=x.device)
        send_meta[:, :t] = torch.where(to_rank.unsqueeze(-1), idx.unsqueeze(0), torch.full_like(idx, -1).unsqueeze(0))
        send_w = torch.zeros(r, tm, idx.shape[1], dtype=torch.float32, device=x.device)
        send_w[:, :t] = w.unsqueeze(0)
        recv_x, recv_meta, recv_w = torch.empty_like(send_x), torch.empty_like(send_meta), torch.empty_like(send_w)
        for src, dst in ((send_x, recv_x), (send_meta, recv_meta), (send_w, recv_w)):
            dist.all_to_all_single(dst, src)
        local = recv_meta - self.ctx.rank * el
        valid = (local >= 0) & (local < el)  # [R, T_max, K]
        src_rank, tok, k = valid.nonzero(as_tuple=True)  # source rank, then token order
        expert = local[src_rank, tok, k]
        order = torch.sort(expert, stable=True).indices
        expert, src_rank, tok, k = expert[order], src_rank[order], tok[order], k[order]
        counts = torch.bincount(expert, minlength=el)
        slot = torch.arange(expert.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
        packed = torch.empty(el, r * tm, x.shape[1], dtype=x.dtype, device=x.device)
        packed[expert, slot] = recv_x[src_rank, tok]
        meta = {"expert": expert, "slot": slot, "src": src_rank, "tok": tok, "w": recv_w[src_rank, tok, k], "t": t}
        return packed, counts.to(torch.int32), meta

    def combine(self, y: torch.Tensor, meta: Dict[str, Any]) -> torch.Tensor:
        r, tm = self.ctx.num_ranks, self.t_max
        partial = torch.zeros(r * tm, y.shape[2], dtype=torch.float32, device=y.device)
        partial.index_add_(0, meta["src"] * tm + meta["tok"], y[meta["expert"], meta["slot"]].float() * meta["w"].unsqueeze(1))
        send = partial.to(torch.bfloat16).view(r, tm, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.float().sum(0)[:meta["t"]].to(torch.bfloat16)


def run_ll(ctx: Ctx, systems: Dict[str, Any], records: List[Dict[str, Any]]) -> None:
    a = ctx.args
    t, e, r = a.ll_tokens, a.ll_experts, ctx.num_ranks
    el = e // r
    x, idx, w = routing(ctx, t, e, seed=2)
    expected_combine = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)
    # Expected per-expert counts and rows, from every rank's inputs.
    all_x = [torch.empty_like(x) for _ in range(r)]
    all_idx = [torch.empty_like(idx) for _ in range(r)]
    dist.all_gather(all_x, x)
    dist.all_gather(all_idx, idx)
    lo = ctx.rank * el
    expected_rows: List[torch.Tensor] = []
    for le in range(el):
        hits = [all_x[s][(all_idx[s] == lo + le).any(1)] for s in range(r)]
        expected_rows.append(torch.cat(hits))
    expected_counts = torch.tensor([len(v) for v in expected_rows], dtype=torch.int32, device=ctx.device)
    sel = float((idx >= 0).sum())
    dests = torch.stack([((idx // el) == d).any(1) for d in range(r)])
    cross = float(dests.sum() - dests[ctx.rank].sum())
    rows = {"bf16": 2 * a.hidden, "fp8": a.hidden + a.hidden // 128 * 4 + 16}
    sel_m, cross_m = mean_over_ranks(ctx, sel), mean_over_ranks(ctx, cross)

    def bytes_of(dtype: str) -> Tuple[float, float]:
        return sel_m * rows[dtype], cross_m * rows[dtype]

    def dispatch_ok(recv_x: Any, recv_count: torch.Tensor, fp8: bool) -> bool:
        if not torch.equal(recv_count, expected_counts):
            return False
        for le in range(el):
            n = int(expected_counts[le])
            want = expected_rows[le].float()
            if fp8:
                q, s = recv_x
                got = q[le, :n].float() * s[le, :n].repeat_interleave(128, dim=1)
                if not torch.allclose(got, want, rtol=0.07, atol=1e-2):
                    return False
            elif not torch.equal(recv_x[le, :n], expected_rows[le]):
                return False
        return True

    nccl = NcclLl(ctx, e, t)
    packed, counts, meta = nccl.dispatch(x, idx, w)
    rec = record(ctx, "nccl", "ll", "dispatch", "bf16", t, e, None)
    records.append(measure(ctx, rec, lambda: dispatch_ok(packed, counts, False), lambda: nccl.dispatch(x, idx, w), *bytes_of("bf16")))
    rec = record(ctx, "nccl", "ll", "combine", "bf16", t, e, None)
    records.append(measure(ctx, rec, lambda: close(nccl.combine(packed, meta), expected_combine), lambda: nccl.combine(packed, meta),
                           *bytes_of("bf16")))

    for name, mod in systems.items():
        records.extend(ll_system(ctx, name, mod, (x, idx, w), dispatch_ok, expected_combine, bytes_of))


def ll_system(ctx: Ctx, name: str, mod: Any, inputs: Tuple[Any, ...], dispatch_ok: Callable[[Any, Any, bool], bool],
              expected_combine: torch.Tensor, bytes_of: Callable[[str], Tuple[float, float]]) -> List[Dict[str, Any]]:
    """LL dispatch (bf16, fp8) and combine of one DeepEP-API system (moelink also with its pre-reduced combine)."""
    a = ctx.args
    t, e, r = a.ll_tokens, a.ll_experts, ctx.num_ranks
    x, idx, w = inputs
    cases: List[Tuple[str, str, Dict[str, Any]]] = [("dispatch", "bf16", {}), ("dispatch", "fp8", {}), ("combine", "bf16", {})]
    if name == "moelink":
        cases.append(("combine", "bf16", {"pre_reduced": True}))
    if isinstance(mod, str):
        return [record(ctx, name, "ll", op, dtype, t, e, None, error=mod, **extra) for op, dtype, extra in cases]
    try:
        hint = mod.Buffer.get_low_latency_rdma_size_hint(t, a.hidden, r, e)
        buf = mod.Buffer(ctx.group, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=max(1, e // r))
    except Exception as err:  # noqa: BLE001
        return [record(ctx, name, "ll", op, dtype, t, e, None, **failed(err), **extra) for op, dtype, extra in cases]

    def dispatch(fp8: bool, **kw: Any) -> Any:
        return buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8, **kw)

    out: List[Dict[str, Any]] = []
    for op, dtype, extra in cases:
        rec = record(ctx, name, "ll", op, dtype, t, e, None, **extra)
        fp8 = dtype == "fp8"
        if op == "dispatch":
            out.append(measure(ctx, rec, lambda fp8=fp8: dispatch_ok(*dispatch(fp8)[:2], fp8), lambda fp8=fp8: dispatch(fp8),
                               *bytes_of(dtype)))
            continue
        try:
            recv_x, _, handle, _, _ = dispatch(False, **({"topk_weights": w} if extra.get("pre_reduced") else {}))
        except Exception as err:  # noqa: BLE001
            out.append({**rec, **failed(err)})
            continue

        def combine(recv_x: Any = recv_x, handle: Any = handle) -> Any:
            return buf.low_latency_combine(recv_x, idx, w, handle)

        out.append(measure(ctx, rec, lambda combine=combine: close(combine()[0], expected_combine), combine, *bytes_of("bf16")))
    return out


# ---------------------------------------------------------------------------------------------------- report


def table(records: List[Dict[str, Any]]) -> str:
    def key(r: Dict[str, Any]) -> Tuple[Any, ...]:
        return (r["mode"], r["op"], r["dtype"], bool(r.get("pre_reduced")))

    base = {key(r): r["time_us"] for r in records if r["system"] == "nccl" and r["time_us"]}
    deepep = {key(r): r["time_us"] for r in records if r["system"] == "deepep" and r["time_us"]}
    head = f"{'mode':4} {'op':8} {'dtype':5} {'system':22} {'time_us':>10} {'logical GB/s':>12} {'wire GB/s':>10} " \
           f"{'nccl/x':>7} {'deepep/x':>8}  status"
    lines = [head, "-" * len(head)]
    def cell(v: Optional[float], fmt: str) -> str:
        return format(v, fmt) if v is not None else "-"

    def ratio(ref: Optional[float], t: Optional[float]) -> str:
        return f"{ref / t:.2f}" if (t and ref) else "-"

    for r in records:
        t = r["time_us"]
        k = (r["mode"], r["op"], r["dtype"], False)
        name = r["system"] + (" (pre-reduced)" if r.get("pre_reduced") else "")
        status = r["status"] + ("" if r["status"] == "ok" else f" ({(r.get('error') or '')[:80]})")
        lines.append(f"{r['mode']:4} {r['op']:8} {r['dtype'] or '-':5} {name:22} {cell(t, '10.1f'):>10} "
                     f"{cell(r['logical_gbps'], '12.1f'):>12} {cell(r['wire_gbps'], '10.1f'):>10} "
                     f"{ratio(base.get(k), t):>7} {ratio(deepep.get(k), t):>8}  {status}")
    return "\n".join(lines)


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moelink.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="ht,ll", help="ht, ll or ht,ll")
    p.add_argument("--tokens", type=int, default=4096, help="HT tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="HT experts in total")
    p.add_argument("--ll-tokens", type=int, default=128, help="LL tokens per rank (= num_max_dispatch_tokens_per_rank)")
    p.add_argument("--ll-experts", type=int, default=288, help="LL experts in total")
    p.add_argument("--num-sms", type=int, default=24, help="SMs of HT kernels (moelink and DeepEP)")
    p.add_argument("--nvl-bytes", type=int, default=1 << 30, help="num_nvl_bytes of the HT buffers")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--systems", default="moelink,nccl,deepep")
    p.add_argument("--json", default=None, help="write the records to this file (rank 0)")
    bench_hostcost.add_arguments(p)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    ctx = Ctx(args)
    wanted = args.systems.split(",")
    systems: Dict[str, Any] = {}
    if "moelink" in wanted:
        import moelink

        systems["moelink"] = moelink
    if "deepep" in wanted:
        try:
            import deep_ep  # type: ignore[import-not-found]

            if getattr(deep_ep, "Buffer", None) is getattr(systems.get("moelink"), "Buffer", object()):
                # A shim that imports moelink as deep_ep (to run DeepEP's tests) is not DeepEP.
                systems["deepep"] = "import deep_ep found moelink itself (a deep_ep shim on the path), not DeepEP"
            else:
                systems["deepep"] = deep_ep
        except Exception as err:  # noqa: BLE001 - ImportError, or its own init failing
            systems["deepep"] = f"import deep_ep failed: {type(err).__name__}: {err}"
    # Ops a system cannot run here: {system: (op family, why)}.
    skipped: Dict[str, Tuple[str, str]] = {}
    if ctx.shared_gpu and not isinstance(systems.get("deepep", ""), str):
        if not ctx.sms_partitioned():
            # Collective kernels of processes sharing a GPU must be resident together: unless MPS holds each
            # process to its share of the SMs, DeepEP's kernels, sized to the SMs a context sees, can wait for
            # a peer whose blocks find no SM, until DeepEP's timeout aborts the process.
            systems["deepep"] = (f"{ctx.ranks_per_gpu} ranks share a GPU: DeepEP runs only with each process held to its "
                                 f"share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE <= {100 // ctx.ranks_per_gpu})")
        elif not ctx.told_sms():
            # Its intranode kernels run so. Its low-latency ones, a cooperative grid sized from the SMs the runtime
            # reports, time out waiting on the peer unless told fewer than the MPS share.
            skipped["deepep"] = ("ll", "DeepEP's low-latency kernels, sized from the SMs the runtime reports, time out with "
                                       "ranks sharing a GPU unless told fewer (scripts/device/share_gpus/share_sms.c "
                                       "preloaded, MOELINK_SHARE_GPUS_SMS)")
        else:
            ctx.facts["deepep_told_sms"] = ctx.told_sms()  # the SMs DeepEP's kernels were sized from
    records: List[Dict[str, Any]] = []
    if args.host_cost:
        systems.pop("nccl", None)
        records = bench_hostcost.run(ctx, args, systems, skipped)
        if ctx.rank == 0:
            sharing = f", sharing {ctx.facts['gpus']} GPU(s) under MPS" if ctx.shared_gpu else ""
            print(f"moelink bench --host-cost: {ctx.num_ranks} ranks on {ctx.facts['device']} ({ctx.facts['backend']}{sharing}), "
                  f"commit {ctx.facts['commit']}, {ctx.facts['date']}")
            if ctx.shared_gpu:
                print("NOTE: ranks share a GPU: cpu_us_per_call is host time; loop and sync times are GPU-sharing figures.")
            if not ctx.cuda:
                print(f"NOTE: {bench_hostcost.HOST_NOTE}.")
            print(bench_hostcost.table(records), flush=True)
        finish(ctx, args, records)
        return 0
    modes = args.mode.split(",")
    if "ht" in modes:
        run_ht(ctx, systems, records)
    if "ll" in modes:
        run_ll(ctx, systems, records)
    if ctx.rank == 0:
        print(f"moelink bench: {ctx.num_ranks} ranks on {ctx.facts['device']} ({ctx.facts['backend']}), "
              f"commit {ctx.facts['commit']}, {ctx.facts['date']}")
        print(table(records), flush=True)
    finish(ctx, args, records)
    return 0


def finish(ctx: Ctx, args: argparse.Namespace, records: List[Dict[str, Any]]) -> None:
    """Rank 0 prints the status count and writes the records; then the group is torn down."""
    if ctx.rank == 0:
        counts: Dict[str, int] = {}
        for r in records:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        print("bench records: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=2)
                f.write("\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
