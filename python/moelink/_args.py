"""Argument errors in the native module's format: the message and the ``argument``/``rank`` attributes."""

from __future__ import annotations

from typing import Any


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
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value.__index__())
        except (AttributeError, TypeError):
            raise invalid(TypeError, name, rank, f"expected an int, got {type(value).__name__}") from None
    if value < 0:
        raise invalid(ValueError, name, rank, f"{value} is negative")
    return value
