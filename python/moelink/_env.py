"""The package's environment knobs, read and checked at the edge before anything touches CUDA."""

from __future__ import annotations

import os

from . import _native
from ._args import invalid

#: The deadline of every wait when ``MOELINK_TIMEOUT_MS`` is not set.
DEFAULT_TIMEOUT_MS = 10_000


def backend() -> str:
    """``MOELINK_BACKEND`` (default ``auto``): ``auto``, ``host`` or ``cuda``, exactly; anything else raises
    ``ValueError`` naming the variable and listing the three (a typo must not reach torch's CUDA init)."""
    return str(_native.check_backend(os.environ.get("MOELINK_BACKEND", "auto"), "MOELINK_BACKEND"))


def timeout_ms() -> int:
    """``MOELINK_TIMEOUT_MS`` (default 10000): a positive whole number of milliseconds."""
    raw = os.environ.get("MOELINK_TIMEOUT_MS")
    if raw is None:
        return DEFAULT_TIMEOUT_MS
    try:
        value = int(raw.strip())
    except ValueError:
        raise invalid(ValueError, "MOELINK_TIMEOUT_MS", -1, f"{raw!r} is not a whole number of milliseconds") from None
    if value <= 0:
        raise invalid(ValueError, "MOELINK_TIMEOUT_MS", -1, f"{value} must be positive")
    return value
