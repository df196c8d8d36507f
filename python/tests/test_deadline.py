"""The host backend's deadline through the package's store-backed group (``moelink.group.TorchStoreGroup``),
without torch: a key-value store with the TCPStore's methods stands in for the torch group's store (which
carries every byte of the exchanges), and the ranks are threads. A rank that never arrives, or that raised on its own bad input and went on to its next
call, is a ``moelink.TimeoutError`` naming it on every other rank within ``timeout_ms``, and their buffers
are poisoned; nothing waits for the store's or the group's own timeouts. ``gpu/test_zz_timeout.py`` runs the
same cases through ``moelink.Buffer`` over a real gloo group (``MOELINK_BACKEND=host`` under torchrun)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from helpers import arg, bf16_bits
from moelink import _native
from moelink.group import TorchStoreGroup

H, K, T = 128, 2, 4
DEADLINE_MS = 500


class FakeStore:
    """The methods of ``torch.distributed.Store`` that ``TorchStoreGroup`` uses, over a dict."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.cv = threading.Condition()

    def set(self, key: str, value: "bytes | str") -> None:
        with self.cv:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cv.notify_all()

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        with self.cv:
            self.data.update(zip(keys, (bytes(v) for v in values)))
            self.cv.notify_all()

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        end = time.monotonic() + timeout.total_seconds()
        with self.cv:
            while not all(k in self.data for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"wait timeout after {timeout}")  # the TCPStore raises a RuntimeError too
                self.cv.wait(left)

    def check(self, keys: Sequence[str]) -> bool:
        with self.cv:
            return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        with self.cv:
            return self.data[key]

    def delete_key(self, key: str) -> bool:
        with self.cv:
            return self.data.pop(key, None) is not None


class FakeProcessGroup:
    def __init__(self, rank: int, size: int, name: str) -> None:
        self._rank, self._size, self.group_name = rank, size, name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def store_groups(size: int, name: str) -> tuple:
    store = FakeStore()
    return store, [TorchStoreGroup(FakeProcessGroup(r, size, name), store) for r in range(size)]


def new_buffer(group: TorchStoreGroup) -> "_native.Buffer":
    nvl = _native.ht_bytes_needed(T, H, K, group.size(), False)
    return _native.Buffer(group, nvl, 0, False, backend="host", timeout_ms=DEADLINE_MS)


def dispatch(buf, *, bad: bool = False) -> None:
    """A fresh BF16 dispatch of T tokens; ``bad`` passes an f32 ``x`` (refused before any exchange)."""
    r, e = buf.num_ranks, 2 * buf.num_ranks
    idx = (np.arange(T * K, dtype=np.int64).reshape(T, K) + buf.rank) % e
    per_rank, per_expert, itr = np.zeros(r, np.int32), np.zeros(e, np.int32), np.zeros((T, r), bool)
    buf.get_dispatch_layout_into(arg(idx), e, arg(per_rank), arg(per_expert), arg(itr))
    x = np.ones((T, H), np.float32)
    x_arg = arg(x) if bad else arg(bf16_bits(x), "bfloat16")
    plan = buf.prepare_dispatch(x_arg, num_tokens_per_rank=arg(per_rank), num_tokens_per_expert=arg(per_expert),
                                is_token_in_rank=arg(itr))
    recv_x = np.zeros((plan.num_recv_rows, H), np.uint16)
    buf.dispatch_into(plan, arg(recv_x, "bfloat16"))


def run(size: int, fault: str, name: str) -> List[Optional[dict]]:
    faulty = size - 1
    store, groups = store_groups(size, name)
    seen: List[Optional[dict]] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def body(r: int) -> None:
        try:
            buf = new_buffer(groups[r])
            for _ in range(3):  # healthy rounds first (and the store's old keys go away)
                dispatch(buf)
            t0 = time.monotonic()
            if r == faulty and fault == "never":
                time.sleep(3 * DEADLINE_MS / 1000)
                return
            if r == faulty:
                with pytest.raises(TypeError) as own:
                    dispatch(buf, bad=True)
                assert own.value.argument == "x" and buf.poisoned is None
            with pytest.raises(_native.TimeoutError) as info:
                dispatch(buf)
            elapsed = time.monotonic() - t0
            with pytest.raises(RuntimeError, match="unusable"):
                dispatch(buf)
            seen[r] = dict(peer=info.value.peer, rank=info.value.rank, elapsed=elapsed, poisoned=buf.poisoned,
                           exchanges={k.split("/")[2] for k in list(store.data)})
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hung"
    for e in errors:
        if e is not None:
            raise e
    return seen


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("fault", ["never", "bad_input_then_next_call"])
def test_a_missing_rank_is_a_timeout_naming_it(size, fault):
    faulty = size - 1
    seen = run(size, fault, f"{fault}-{size}")
    for r, s in enumerate(seen):
        if r == faulty and fault == "never":
            assert s is None
            continue
        assert s is not None
        # Every other rank names the faulty one; the faulty rank (in its next call) names the first missing.
        assert (s["rank"], s["peer"]) == (r, 0 if r == faulty else faulty), s
        assert s["elapsed"] < DEADLINE_MS / 1000 + 2.0, s
        if fault == "never":
            assert s["elapsed"] >= 0.9 * DEADLINE_MS / 1000, s
        assert s["poisoned"] and "timeout" in s["poisoned"], s
        # Healthy exchanges left no key behind: what remains belongs to the exchange that failed (and, where
        # the faulty rank went on to its next call, the one after it).
        assert len(s["exchanges"]) <= 2, s


def test_store_group_exchanges_deliver_by_rank_and_clean_up():
    store, groups = store_groups(3, "plain")
    out: List[Optional[tuple]] = [None] * 3

    def body(r: int) -> None:
        g = groups[r]
        rounds = []
        for n in range(5):
            gathered = g.all_gather_within(bytes([r, n]), 5000)
            got = g.all_to_all_within([bytes([r, dst, n]) for dst in range(3)], 5000)
            rounds.append((gathered, got))
        out[r] = tuple(rounds)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r, rounds in enumerate(out):
        assert rounds is not None
        for n, (gathered, got) in enumerate(rounds):
            assert gathered == [bytes([s, n]) for s in range(3)]
            assert got == [bytes([s, r, n]) for s in range(3)]
    # Every message was read, and its reader deleted it.
    assert not store.data, sorted(store.data)


def test_a_store_timeout_names_the_rank_whose_key_is_missing():
    _, groups = store_groups(3, "missing")
    with pytest.raises(TimeoutError) as info:
        groups[0].all_gather_within(b"x", 100)
    assert info.value.peer == 1


def test_store_group_moves_messages_larger_than_a_store_value_in_pieces():
    _, groups = store_groups(2, "pieces")
    big = [bytes(range(256)) * (10 * 1024 + r) for r in range(2)]  # 2.5 MiB and a bit: three pieces each
    out: List[Optional[List[bytes]]] = [None] * 2

    def body(r: int) -> None:
        out[r] = groups[r].all_to_all_within([big[r], big[r][::-1]], 5000)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == [big[0], big[1]]
    assert out[1] == [big[0][::-1], big[1][::-1]]


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_that_stalls_after_posting_to_one_peer_is_named_by_every_other(size):
    """The last rank writes its message to rank 0 and stops (a debugger, SIGSTOP) before writing the others:
    the ranks it did not reach give up in this exchange, rank 0 in the next one, and every one of them names
    the stalled rank, within the deadline of the exchange it waits in."""
    stalled = size - 1
    _, groups = store_groups(size, f"stall-{size}")
    release = threading.Event()
    seen: List[Optional[tuple]] = [None] * size
    deadline_ms = 300

    def body(r: int) -> None:
        g = groups[r]
        g.all_to_all_within([bytes([r])] * size, 5000)  # a healthy exchange first
        if r == stalled:
            g._exchanges += 1
            g._post(g._exchanges, 0, b"late")
            release.wait(10)
            return
        t0 = time.monotonic()
        try:
            for _ in range(2):  # rank 0 gets through the first one
                g.all_to_all_within([bytes([r])] * size, deadline_ms)
        except TimeoutError as e:
            seen[r] = (e.peer, time.monotonic() - t0)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads[:stalled]:
        t.join(30)
    release.set()
    threads[stalled].join(30)
    for r in range(stalled):
        assert seen[r] is not None, f"rank {r} did not time out"
        peer, elapsed = seen[r]
        assert peer == stalled, (r, seen)
        assert elapsed < 2 * deadline_ms / 1000 + 1.0, (r, seen)
