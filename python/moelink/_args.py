"""Argument checks in the native module's error format (``argument``/``rank`` attributes): counts, output sizes."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Tuple


def invalid(exc_type: type, arg: str, rank: int, reason: str) -> Exception:
    """``exc_type("invalid argument `arg` on rank R: reason")`` with ``argument`` and ``rank`` attributes
    (``rank`` is -1 where no buffer, hence no rank, is involved)."""
    where = f" on rank {rank}" if rank >= 0 else ""
    err = exc_type(f"invalid argument `{arg}`{where}: {reason}")
    err.argument = arg  # type: ignore[attr-defined]
    err.rank = rank  # type: ignore[attr-defined]
    return err


def count(value: Any, name: str, rank: int = -1) -> int:
    """A non-negative int argument (the native module alone would only say "can't convert")."""
    if type(value) is int and value >= 0:  # the usual argument, in one test
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value.__index__())
        except (AttributeError, TypeError):
            raise invalid(TypeError, name, rank, f"expected an int, got {type(value).__name__}") from None
    if value < 0:
        raise invalid(ValueError, name, rank, f"{value} is negative")
    return value


def host_memory_bytes() -> Optional[int]:
    """This machine's memory in bytes (``MemTotal``, as ``moelink bench`` reads it), or None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return None


def check_fits(arg: str, rank: int, outputs: Sequence[Tuple[str, Sequence[int], str, int]], capacity: Optional[int],
               where: str) -> None:
    """Refuses, before anything is allocated, outputs sized by argument ``arg`` that together need more than
    ``capacity`` bytes (the memory of ``where``, the device they would be allocated on; None: unknown, no
    check): a ``ValueError`` naming ``arg`` and the bytes needed, as the Rust API's allocating calls refuse
    such sizes (torch's allocation error names no argument). ``outputs``: ``(name, shape, dtype name, bytes
    per element)``."""
    needed = 0
    for _, shape, _, item in outputs:
        n = item
        for d in shape:
            n *= int(d)
        needed += n
    if capacity is not None and needed > capacity:
        what = ", ".join(f"{name} {dtype} {list(shape)}" for name, shape, dtype, _ in outputs)
        raise invalid(ValueError, arg, rank,
                      f"the outputs it sizes need {needed} bytes ({what}), more than the {capacity} bytes of {where}")
