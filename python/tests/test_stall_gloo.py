"""A rank that stalls after it has met the others in an exchange, on real gloo processes on the host backend
(2 and 4 ranks): the others end with ``moelink.TimeoutError`` naming it within moelink's deadline, not after
gloo's own timeout (ten minutes here). Needs torch (a CPU build is enough); skipped without it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

DEADLINE_MS = 1500
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_stall_rank.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_stalled_after_meeting_is_a_timeout_naming_it(size):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, RANK_SCRIPT, str(r), str(size), str(port), str(DEADLINE_MS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(size)]
    stalled = procs[-1]
    try:
        results = []
        for r, p in enumerate(procs[:-1]):
            out, err = p.communicate(timeout=120)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"rank {r} printed no result (exit {p.returncode}): {err[-2000:]}"
            results.append(json.loads(lines[-1]))
        # The stalled rank is stopped, not gone.
        time.sleep(0.1)
        assert stalled.poll() is None, "the stalled rank exited instead of stopping"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for res in results:
        r = res["rank"]
        assert res["error"] == "TimeoutError", res
        assert (res["err_rank"], res["peer"]) == (r, size - 1), res
        # Each exchange waits at most the deadline; a rank that got through the exchange the stalled rank
        # left half done waits one more deadline in the next (every rank starts it at once), never longer.
        assert res["elapsed_s"] < DEADLINE_MS / 1000 + 2.0, res
        assert res["elapsed_s"] >= 0.9 * DEADLINE_MS / 1000, res
