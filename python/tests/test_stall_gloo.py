"""A rank that stalls after it has met the others in an exchange, on real gloo processes on the host backend
(2 and 4 ranks): the others end with ``moelink.TimeoutError`` naming it within moelink's deadline, not after
gloo's own timeout (ten minutes here). Needs torch (a CPU build is enough); skipped without it."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("torch")

DEADLINE_MS = 1500
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_stall_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_result(p: subprocess.Popen, r: int, err, deadline: float) -> dict:
    """The JSON line rank ``r`` prints, read without waiting for the process to end (it stays up until its
    stdin closes)."""
    out = b""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while True:
            lines = [line for line in out.splitlines(keepends=True) if line.startswith(b"{") and line.endswith(b"\n")]
            if lines:
                return json.loads(lines[-1])
            left = deadline - time.monotonic()
            chunk = os.read(p.stdout.fileno(), 65536) if left > 0 and sel.select(left) else b""
            if not chunk:
                err.seek(0)
                pytest.fail(f"rank {r} printed no result (exit {p.poll()}): {err.read().decode(errors='replace')[-2000:]}")
            out += chunk


def run_ranks(deadlines_ms: list) -> list:
    """Runs one rank per deadline, the last one stalling; the others' results, by rank."""
    size, port = len(deadlines_ms), free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    errs = [tempfile.TemporaryFile() for _ in range(size)]
    procs = [subprocess.Popen([sys.executable, RANK_SCRIPT, str(r), str(size), str(port), str(deadlines_ms[r])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errs[r], env=env) for r in range(size)]
    stalled = procs[-1]
    try:
        deadline = time.monotonic() + 120
        results = [read_result(p, r, errs[r], deadline) for r, p in enumerate(procs[:-1])]
        # The stalled rank is stopped, not gone.
        time.sleep(0.1)
        assert stalled.poll() is None, "the stalled rank exited instead of stopping"
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            if p is not stalled:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait(10)
            p.stdout.close()
        for err in errs:
            err.close()
    return results


def check_named(res: dict, stalled: int, deadline_ms: int) -> None:
    r = res["rank"]
    assert res["error"] == "TimeoutError", res
    assert (res["err_rank"], res["peer"]) == (r, stalled), res
    # Each exchange waits at most the deadline; a rank that got through the exchange the stalled rank
    # left half done waits one more deadline in the next (every rank starts it at once), never longer.
    assert res["elapsed_s"] < deadline_ms / 1000 + 2.0, res
    assert res["elapsed_s"] >= 0.9 * deadline_ms / 1000, res


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_stalled_after_meeting_is_a_timeout_naming_it(size):
    for res in run_ranks([DEADLINE_MS] * size):
        check_named(res, size - 1, DEADLINE_MS)


def test_a_rank_past_the_half_done_exchange_names_the_stalled_rank_while_the_others_still_wait_in_it():
    """Rank 0, the one the stalled rank reached, gets through that exchange and misses ranks 1 to 3 in the
    next one. Its shorter deadline ends while ranks 1 and 2 still wait for the stalled rank: it must tell them
    from the stalled rank by what the store holds, not by their word, which has not come."""
    deadlines = [DEADLINE_MS // 3] + [DEADLINE_MS] * 3
    for res in run_ranks(deadlines):
        check_named(res, 3, deadlines[res["rank"]])
