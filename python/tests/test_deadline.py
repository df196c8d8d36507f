"""The host backend's deadline through the package's store-backed group (``moelink.group.TorchStoreGroup``),
without torch: a key-value store with the TCPStore's methods stands in for the torch group's store, the
ranks are threads, and a shared mailbox stands in for gloo's ``all_to_all_single`` once they have met. A rank that never arrives, or that raised on its own bad input and went on to its next
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

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        with self.cv:
            return [self.data[k] for k in keys]

    def delete_key(self, key: str) -> bool:
        with self.cv:
            return self.data.pop(key, None) is not None


class Mailbox:
    """What gloo's all_to_all_single does for ``TorchStoreGroup`` here: messages by (exchange, source, dest)."""

    def __init__(self) -> None:
        self.messages: Dict[tuple, bytes] = {}
        self.cv = threading.Condition()

    def post(self, n: int, src: int, send: Sequence[bytes]) -> None:
        with self.cv:
            for dst, m in enumerate(send):
                self.messages[(n, src, dst)] = m
            self.cv.notify_all()

    def take(self, n: int, dst: int, size: int) -> List[bytes]:
        with self.cv:
            # Every rank has met in the store already, so every message is on its way.
            assert self.cv.wait_for(lambda: all((n, s, dst) in self.messages for s in range(size)), 30)
            return [self.messages.pop((n, s, dst)) for s in range(size)]


class ThreadStoreGroup(TorchStoreGroup):
    def __init__(self, group: "FakeProcessGroup", store: FakeStore, mailbox: Mailbox) -> None:
        super().__init__(group, store)
        self.mailbox = mailbox

    def _move(self, send: Sequence[bytes], every_sizes: List[List[int]]) -> List[bytes]:
        assert [len(m) for m in send] == every_sizes[self._rank]
        self.mailbox.post(self._exchanges, self._rank, send)
        return self.mailbox.take(self._exchanges, self._rank, self._size)


class FakeProcessGroup:
    def __init__(self, rank: int, size: int, name: str) -> None:
        self._rank, self._size, self.group_name = rank, size, name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def store_groups(size: int, name: str) -> tuple:
    store, mailbox = FakeStore(), Mailbox()
    return store, [ThreadStoreGroup(FakeProcessGroup(r, size, name), store, mailbox) for r in range(size)]


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
                           keys=len(store.data))
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
        # Healthy exchanges deleted their old keys: what remains is at most each rank's last two.
        assert s["keys"] <= 2 * size, s


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
    # Only each rank's key of the last exchange stays.
    assert len(store.data) == 3, sorted(store.data)


def test_a_store_timeout_names_the_rank_whose_key_is_missing():
    _, groups = store_groups(3, "missing")
    with pytest.raises(TimeoutError) as info:
        groups[0].all_gather_within(b"x", 100)
    assert info.value.peer == 1
