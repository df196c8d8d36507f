"""``python -m moelink.bench --host-cost --quick`` on the host backend (2 ranks under torchrun, gloo): it runs
every op and writes its records. Needs torch (skipped without it); host numbers are CPU figures, and the
output says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moelink._torch import torch

OPS = {("ht_layout", "-"), ("ht_dispatch", "bf16"), ("ht_cached_dispatch", "bf16"), ("ht_cached_dispatch", "fp8"),
       ("ht_combine", "bf16"), ("ll_dispatch", "fp8"), ("ll_combine", "bf16"), ("ll_dispatch_combine", "fp8")}


@pytest.mark.skipif(torch is None, reason="the bench runs moelink.Buffer, which needs torch")
def test_host_cost_quick_mode_writes_records(tmp_path):
    out = tmp_path / "hostcost.json"
    env = {**os.environ, "MOELINK_BACKEND": "host", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "moelink.bench",
           "--host-cost", "--quick", "--reuse-ab", "--systems", "moelink,deepep", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "not GPU figures" in run.stdout, run.stdout
    records = json.loads(out.read_text())
    for system in ("moelink", "moelink-noreuse"):
        mine = {(r["op"], r["dtype"]): r for r in records if r["system"] == system}
        assert set(mine) == OPS, sorted(mine)
        for r in mine.values():
            assert r["status"] == "ok", r
            for field in ("cpu_us_per_call", "loop_us_per_call", "sync_us"):
                assert r[field] > 0, (field, r)
            for field in ("system", "op", "dtype", "ranks", "device", "date", "commit"):
                assert r.get(field) not in (None, ""), (field, r)
            assert r["ranks"] == 2 and r["backend"] == "host" and "not GPU figures" in r["note"]
    # DeepEP is a row of its own either way: measured where it imports, else unavailable with the reason.
    assert any(r["system"] == "deepep" for r in records)


@pytest.mark.skipif(torch is None, reason="the host-cost module imports torch")
def test_ops_a_system_cannot_run_are_recorded_unavailable_with_the_reason():
    # As DeepEP's LL ops with ranks sharing a GPU: no buffer is made, each op is a record with the reason,
    # and the table says why once, above the rows.
    import argparse
    import types

    from moelink import bench_hostcost

    ctx = types.SimpleNamespace(cuda=False, num_ranks=2, facts={"device": "cpu", "date": "-", "commit": "-"})
    args = argparse.Namespace(quick=True, calls=None, reuse_ab=False, ops="ll", graph=False, num_sms=24, nvl_bytes=0)
    why = "its low-latency kernels do not run here"
    system = types.SimpleNamespace(Buffer=type("Buffer", (), {}))
    records = bench_hostcost.run(ctx, args, {"other": system}, {"other": ("ll", why)})
    assert {(r["op"], r["dtype"]) for r in records} == set(bench_hostcost.LL_OPS)
    assert all(r["status"] == "unavailable" and r["error"] == why and r["system"] == "other" for r in records)
    table = bench_hostcost.table(records)
    assert table.count(why) == 1, table
    # The same for the HT family.
    args.ops = "ht"
    records = bench_hostcost.run(ctx, args, {"other": system}, {"other": ("ht", why)})
    assert {(r["op"], r["dtype"]) for r in records} == set(bench_hostcost.HT_OPS)
    assert all(r["status"] == "unavailable" and r["error"] == why for r in records)


@pytest.mark.skipif(torch is None, reason="moelink.bench imports torch")
def test_records_name_moelink_commit_else_the_commit_the_module_was_built_from(monkeypatch):
    from moelink import _native, bench

    monkeypatch.setenv("MOELINK_COMMIT", "feedbee")
    assert bench.commit() == "feedbee"
    monkeypatch.delenv("MOELINK_COMMIT")
    if _native.__build_commit__:
        assert bench.commit() == _native.__build_commit__
