"""One rank of ``test_stall_gloo.py``: a process of a real gloo group on moelink's host backend. Run as
``python gloo_stall_rank.py RANK SIZE PORT DEADLINE_MS``; prints one JSON line with what the timed call did.

The last rank stalls inside the timed dispatch: it posts its first message of the call (it has met the
others in the exchange) and then stops itself with SIGSTOP, as under a debugger or a swapped-out host,
until the test kills it. Every other rank must get ``moelink.TimeoutError`` naming it within the deadline,
although the gloo group's own timeout is ten minutes. A rank that has printed its result stays up until its
stdin closes: rank 0's process hosts the store, and the others may still be reading it to tell whom to name."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import moelink
from moelink import group as moelink_group


def main() -> None:
    rank, size, port, deadline_ms = (int(v) for v in sys.argv[1:5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MOELINK_BACKEND="host",
                      MOELINK_TIMEOUT_MS=str(deadline_ms))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(minutes=10))
    stalled = size - 1
    armed = False
    post = moelink_group.TorchStoreGroup._post

    def post_then_stall(self, n, dst, message):  # type: ignore[no-untyped-def]
        post(self, n, dst, message)
        if armed:
            os.kill(os.getpid(), signal.SIGSTOP)

    if rank == stalled:
        moelink_group.TorchStoreGroup._post = post_then_stall  # type: ignore[method-assign]
    hidden, e = 256, 2 * size
    buf = moelink.Buffer(dist.group.WORLD, num_nvl_bytes=moelink.Buffer.get_dispatch_config(size)
                         .get_nvl_buffer_size_hint(hidden * 2, size), explicitly_destroy=True)
    topk_idx = (torch.arange(8 * 2).reshape(8, 2) + rank) % e
    x = torch.ones(8, hidden, dtype=torch.bfloat16)

    def dispatch() -> None:
        n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)
        buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)

    dispatch()  # a healthy round first
    armed = True
    start = time.monotonic()
    result = {"rank": rank}
    try:
        dispatch()
        result["error"] = None
    except moelink.TimeoutError as err:
        result.update(error="TimeoutError", peer=err.peer, err_rank=err.rank, message=str(err))
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
        result.update(error=type(err).__name__, message=str(err))
    result["elapsed_s"] = time.monotonic() - start
    print(json.dumps(result), flush=True)
    sys.stdin.read()  # the test closes it once every other rank has printed its result
    os._exit(0)  # the stalled rank never comes back: no collective teardown


if __name__ == "__main__":
    main()
