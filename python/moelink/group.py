"""Process groups as the native module sees them: ``rank()``, ``size()``, ``all_gather(bytes) -> list[bytes]``,
and, where the group can keep a deadline, ``all_gather_within(bytes, timeout_ms)`` and
``all_to_all_within(list[bytes], timeout_ms)``.

The native buffer exchanges setup data (and, on the host backend, the tokens themselves) through these
objects. They stay on the CPU side of whatever group they wrap: ``all_gather_object`` works on gloo and
NCCL groups alike, but waits as long as the group's own timeout (30 minutes by default). The host backend's
exchanges therefore go through the group's key-value store (``TorchStoreGroup``), bytes included, where every
wait has moelink's deadline (``MOELINK_TIMEOUT_MS``) and a rank that does not arrive is named.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence


def process_key() -> int:
    """A 64-bit key equal for ranks in one process and different across processes (host name and pid)."""
    digest = hashlib.blake2b(f"{socket.gethostname()}:{os.getpid()}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _local_rank(rank: int) -> int:
    from ._torch import torch

    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", rank))


class TorchGroup:
    """Byte all-gather over a ``torch.distributed`` process group (``all_gather_object``)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._rank = int(group.rank())
        self._size = int(group.size())

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        """The GPU this rank uses: the current CUDA device, else ``LOCAL_RANK``, else the rank."""
        return _local_rank(self._rank)

    def process_key(self) -> int:
        return process_key()

    def all_gather(self, data: bytes) -> List[bytes]:
        import torch.distributed as dist

        out: List[Any] = [None] * self._size
        dist.all_gather_object(out, bytes(data), group=self.group)
        return out


# The TCPStore's server refuses values above 8 MiB (and a refused value closes the client's connection):
# messages travel in pieces of at most this many bytes.
_PIECE_BYTES = 1 << 20


class TorchStoreGroup(TorchGroup):
    """``TorchGroup`` whose deadline-bound exchanges move every byte through the process group's store (the
    TCPStore that ``init_process_group`` and torchrun set up, seen through the group's prefix), so that no
    wait of an exchange is left to the group's own timeout.

    Exchange ``n`` of this object: for each other rank ``dst``, a rank writes its message in pieces of at most
    1 MiB under ``moelink/<k>/<n>/<rank>/<dst>/<i>``, then the header ``moelink/<k>/<n>/<rank>/<dst>``
    (``<bytes>,<pieces>``) that says it is complete (``k`` numbers the objects created on the same torch
    group, in creation order: creating a ``Buffer`` is collective, so every rank counts alike). It then waits
    at most ``timeout_ms`` for the headers addressed to it, reads the pieces and deletes what it read (each
    message has one reader). A header that does not come in time raises ``TimeoutError`` whose ``peer`` is
    the first missing rank that is not itself waiting in the exchange before (``_missing_peer``): a rank that
    stalls halfway through posting lets some ranks through that exchange and holds the others in it, and
    those survivors, missing in the next exchange too, are not the ones to name.

    Measured against gloo's ``all_to_all_single`` on 2 cores (2 and 4 processes): faster below 100 KiB per
    message (one round of the store instead of a meeting in the store and a gloo collective), within a few
    times at 1-4 MiB, faster again at 16 MiB. The store lives in rank 0's process unless torchrun's agent
    hosts it (torchrun does): a stopped rank 0 then stops the store too, and the others' waits end at the
    store's own timeout.
    """

    _objects_per_group: Dict[str, int] = {}
    _lock = threading.Lock()

    def __init__(self, group: Any, store: Any) -> None:
        super().__init__(group)
        self._store = store
        # Counted per rank as well: ranks that are threads of one process (tests) count separately.
        name = f"{getattr(group, 'group_name', '') or id(group)}/{self._rank}"
        with TorchStoreGroup._lock:
            k = TorchStoreGroup._objects_per_group.get(name, 0)
            TorchStoreGroup._objects_per_group[name] = k + 1
        self._prefix = f"moelink/{k}"
        self._exchanges = 0

    def _key(self, n: int, src: int, dst: int) -> str:
        return f"{self._prefix}/{n}/{src}/{dst}"

    def _post(self, n: int, dst: int, message: bytes) -> None:
        """Writes one message of exchange ``n``: its pieces, then the header that completes it."""
        key = self._key(n, self._rank, dst)
        pieces = max(1, -(-len(message) // _PIECE_BYTES))
        for i in range(pieces):
            self._store.set(f"{key}/{i}", message[i * _PIECE_BYTES:(i + 1) * _PIECE_BYTES])
        self._store.set(key, f"{len(message)},{pieces}")

    def _exchange(self, send: Sequence[bytes], timeout_ms: int) -> List[bytes]:
        """``send[dst]`` to each rank; returns the messages by source, or raises ``TimeoutError`` naming the
        rank missing after ``timeout_ms``."""
        self._exchanges += 1
        n, me = self._exchanges, self._rank
        for dst in range(self._size):
            if dst != me:
                self._post(n, dst, send[dst])
        headers = {src: self._key(n, src, me) for src in range(self._size) if src != me}
        try:
            if headers:
                self._store.wait(list(headers.values()), timedelta(milliseconds=timeout_ms))
        except Exception as e:  # noqa: BLE001 - the store raises its own error type on timeout
            missing = [src for src, key in headers.items() if not self._check([key])]
            if not missing:
                raise
            peer = self._missing_peer(n, missing)
            err = TimeoutError(f"rank {me} waited {timeout_ms} ms for rank {peer} in exchange {n} of {self._prefix}")
            err.peer = peer  # type: ignore[attr-defined]
            raise err from e
        out: List[bytes] = []
        for src in range(self._size):
            if src == me:
                out.append(bytes(send[me]))
                continue
            key = headers[src]
            size, pieces = (int(v) for v in bytes(self._store.get(key)).decode().split(","))
            parts = [bytes(self._store.get(f"{key}/{i}")) for i in range(pieces)]
            message = b"".join(parts)
            if len(message) != size:
                raise RuntimeError(f"rank {me}: rank {src}'s message of exchange {n} has {len(message)} bytes, its header says {size}")
            out.append(message)
            for i in range(pieces):
                self._delete(f"{key}/{i}")
            self._delete(key)
        return out

    def _missing_peer(self, n: int, missing: List[int]) -> int:
        """The rank to name among ``missing``, the ranks whose message of exchange ``n`` did not come: the first
        one that is not itself waiting in exchange ``n - 1``, else the first one.

        This rank read every message of exchange ``n - 1``, so each missing rank posted to it there. A missing
        rank that has not read this rank's message of ``n - 1`` (its header is still there) is still in that
        exchange; it is waiting there, a survivor held up by someone else, when it has posted to every rank
        still in it and lacks a message of its own. Everyone else missing is held up by nothing but itself:
        through ``n - 1`` without posting ``n`` here, stopped partway through posting ``n - 1``, or holding
        all its messages of ``n - 1`` unread. A rank writes its messages before it waits and deletes them only
        once it has all of them, so these keys say where each rank is without waiting for anyone's word: the
        answer comes in a few store round trips past the deadline, however late the survivors give up."""
        if n == 1 or len(missing) == 1:
            return missing[0]
        me, prev = self._rank, n - 1
        within = [src for src in missing if self._check([self._key(prev, me, src)])]
        for src in missing:
            if src not in within:
                return src
            others = [self._key(prev, src, dst) for dst in within if dst != src]
            if others and not self._check(others):
                return src
            if self._check([self._key(prev, other, src) for other in range(self._size) if other != src]):
                return src
        return missing[0]

    def _check(self, keys: List[str]) -> bool:
        """Whether every key of ``keys`` is in the store."""
        try:
            return bool(self._store.check(keys))
        except Exception:  # noqa: BLE001 - a store that cannot check: count the keys as missing
            return False

    def _delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store without deletion keeps the keys
            pass

    def all_gather_within(self, data: bytes, timeout_ms: int) -> List[bytes]:
        data = bytes(data)
        if self._size == 1:  # an exchange with oneself: nobody to meet or wait for
            return [data]
        return self._exchange([data] * self._size, timeout_ms)

    def all_to_all_within(self, send: Sequence[bytes], timeout_ms: int) -> List[bytes]:
        send = [bytes(m) for m in send]
        if self._size == 1:
            return send
        return self._exchange(send, timeout_ms)


def torch_group(group: Any) -> TorchGroup:
    """The byte group for a ``torch.distributed`` group: ``TorchStoreGroup`` when torch exposes the group's
    store, else ``TorchGroup`` (whose exchanges keep the torch group's own timeout)."""
    store: Optional[Any] = None
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_process_group_store(group)
    except Exception:  # noqa: BLE001 - an older or newer torch without it: no store, the plain group
        store = None
    return TorchStoreGroup(group, store) if store is not None else TorchGroup(group)


class MpiGroup:
    """Byte all-gather over an ``mpi4py.MPI.Comm`` (``comm.allgather``)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._rank = int(comm.Get_rank())
        self._size = int(comm.Get_size())

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return _local_rank(self._rank)

    def process_key(self) -> int:
        return process_key()

    def all_gather(self, data: bytes) -> List[bytes]:
        return list(self.comm.allgather(bytes(data)))
