"""Process groups as the native module sees them: ``rank()``, ``size()``, ``all_gather(bytes) -> list[bytes]``,
and, where the group can keep a deadline, ``all_gather_within(bytes, timeout_ms)`` and
``all_to_all_within(list[bytes], timeout_ms)``.

The native buffer exchanges setup data (and, on the host backend, the tokens themselves) through these
objects. They stay on the CPU side of whatever group they wrap: ``all_gather_object`` works on gloo and
NCCL groups alike, but waits as long as the group's own timeout (30 minutes by default). The host backend's
exchanges therefore go through the group's key-value store (``TorchStoreGroup``), where every wait has
moelink's deadline (``MOELINK_TIMEOUT_MS``) and a rank that does not arrive is named.
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


class TorchStoreGroup(TorchGroup):
    """``TorchGroup`` whose deadline-bound exchanges first meet in the process group's store (the TCPStore that
    ``init_process_group`` and torchrun set up, seen through the group's prefix), then move the bytes over
    the group itself.

    Exchange ``n`` of this object: each rank writes the sizes of its messages under
    ``moelink/<k>/<n>/<rank>`` (``k`` numbers the objects created on the same torch group, in creation order:
    creating a ``Buffer`` is collective, so every rank counts alike) and waits at most ``timeout_ms`` for the
    other ranks' keys; a missing key raises ``TimeoutError`` with ``peer`` naming the first rank that did not
    write. Once every rank is there, the messages go through one ``all_to_all_single`` of bytes (gloo), or
    ``all_gather_object`` on other backends. Store values stay small (the TCPStore slows down sharply with
    megabyte values). Once exchange ``n`` has completed, every rank has finished exchange ``n - 1``, so a rank
    deletes its key of ``n - 1`` then.
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
        self._last_key: Optional[str] = None
        self._gloo: Optional[bool] = None

    def _key(self, n: int, src: int) -> str:
        return f"{self._prefix}/{n}/{src}"

    def _meet(self, sizes: Sequence[int], timeout_ms: int) -> List[List[int]]:
        """The arrival round of the next exchange: every rank's message sizes (one per destination), or
        ``TimeoutError`` naming the first rank missing after ``timeout_ms``."""
        self._exchanges += 1
        n = self._exchanges
        mine = self._key(n, self._rank)
        self._store.set(mine, ",".join(str(int(v)) for v in sizes))
        keys = [self._key(n, src) for src in range(self._size)]
        try:
            self._store.wait(keys, timedelta(milliseconds=timeout_ms))
        except Exception as e:  # noqa: BLE001 - the store raises its own error type on timeout
            missing = [src for src, key in enumerate(keys) if not self._check(key)]
            if not missing:
                raise
            err = TimeoutError(f"rank {self._rank} waited {timeout_ms} ms for rank {missing[0]} in exchange {n} of "
                               f"{self._prefix}")
            err.peer = missing[0]  # type: ignore[attr-defined]
            raise err from e
        every = [[int(v) for v in bytes(raw).decode().split(",") if v] for raw in self._store.multi_get(keys)]
        if self._last_key is not None:
            try:
                self._store.delete_key(self._last_key)
            except Exception:  # noqa: BLE001 - a store without deletion keeps the keys
                pass
        self._last_key = mine
        return every

    def _check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:  # noqa: BLE001 - a store that cannot check: count the key as missing
            return False

    def _move(self, send: Sequence[bytes], every_sizes: List[List[int]]) -> List[bytes]:
        """Moves ``send[dst]`` to each rank once all are known to be here (``every_sizes[src][dst]``: the
        sizes each rank declared); returns the messages by source."""
        me = self._rank
        if self._gloo is None:
            import torch.distributed as dist

            self._gloo = dist.get_backend(self.group) == "gloo"
        if not self._gloo:
            return [m[me] for m in self._gather_objects(list(send))]
        import torch
        import torch.distributed as dist

        recv_sizes = [sizes[me] for sizes in every_sizes]
        data = b"".join(send)
        inp = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        dist.all_to_all_single(out, inp, output_split_sizes=recv_sizes, input_split_sizes=[len(m) for m in send],
                               group=self.group)
        raw = out.numpy().tobytes()
        parts, at = [], 0
        for size in recv_sizes:
            parts.append(raw[at:at + size])
            at += size
        return parts

    def _gather_objects(self, obj: Any) -> List[Any]:
        import torch.distributed as dist

        out: List[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_within(self, data: bytes, timeout_ms: int) -> List[bytes]:
        data = bytes(data)
        if self._size == 1:  # an exchange with oneself: nobody to meet or wait for
            return [data]
        every = self._meet([len(data)] * self._size, timeout_ms)
        return self._move([data] * self._size, every)

    def all_to_all_within(self, send: Sequence[bytes], timeout_ms: int) -> List[bytes]:
        send = [bytes(m) for m in send]
        if self._size == 1:
            return send
        every = self._meet([len(m) for m in send], timeout_ms)
        return self._move(send, every)


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
