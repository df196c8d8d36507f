"""Process groups as the native module sees them: ``rank()``, ``size()``, ``all_gather(bytes) -> list[bytes]``.

The native buffer exchanges setup data (and, on the host backend, the tokens themselves) through these
objects. They stay on the CPU side of whatever group they wrap: ``all_gather_object`` works on gloo and
NCCL groups alike.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Any, List


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
