"""The package's environment knobs, read and checked at the edge before anything touches CUDA."""

from __future__ import annotations

import os

from . import _native
from ._args import invalid

#: The deadline of every wait when ``MOELINK_TIMEOUT_MS`` is not set.
DEFAULT_TIMEOUT_MS = 10_000
#: The longest deadline the library takes (``moelink::MAX_TIMEOUT_MS``): one day.
MAX_TIMEOUT_MS = 24 * 60 * 60 * 1000


def backend() -> str:
    """``MOELINK_BACKEND`` (default ``auto``): ``auto``, ``host`` or ``cuda``, exactly; anything else raises
    ``ValueError`` naming the variable and listing the three (a typo must not reach torch's CUDA init)."""
    return str(_native.check_backend(os.environ.get("MOELINK_BACKEND", "auto"), "MOELINK_BACKEND"))


def timeout_ms() -> int:
    """``MOELINK_TIMEOUT_MS`` (default 10000): a whole number of milliseconds from 1 to ``MAX_TIMEOUT_MS``
    (one day)."""
    raw = os.environ.get("MOELINK_TIMEOUT_MS")
    if raw is None:
        return DEFAULT_TIMEOUT_MS
    try:
        value = int(raw.strip())
    except ValueError:
        raise invalid(ValueError, "MOELINK_TIMEOUT_MS", -1, f"{raw!r} is not a whole number of milliseconds") from None
    if value <= 0 or value > MAX_TIMEOUT_MS:
        raise invalid(ValueError, "MOELINK_TIMEOUT_MS", -1,
                      f"{value} ms: a deadline must be between 1 ms and {MAX_TIMEOUT_MS} ms (one day)")
    return value


def topology() -> str | None:
    """``MOELINK_TOPOLOGY`` (default: unset, ranks grouped by host): ``NODESxRANKS_PER_NODE``, e.g. ``2x4``
    for virtual nodes on one host. Checked by the buffer, whose error names the variable's value."""
    raw = os.environ.get("MOELINK_TOPOLOGY")
    return raw.strip() if raw and raw.strip() else None


def transport() -> str | None:
    """``MOELINK_TRANSPORT`` (default: unset, NVSHMEM): ``nvshmem``, ``ptr`` or ``emu-nic``, the engine that
    carries bytes between nodes."""
    raw = os.environ.get("MOELINK_TRANSPORT")
    return raw.strip() if raw and raw.strip() else None


def nvshmem_home() -> str | None:
    """``NVSHMEM_HOME``, else the ``nvidia/nvshmem`` folder of the ``nvidia-nvshmem-cu13`` wheel when it is
    installed (torch pulls it in), else None (only buffers whose ranks span nodes need NVSHMEM)."""
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        return home
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])


def cuda_home() -> str | None:
    """``CUDA_HOME`` (the CUDA headers the NVSHMEM kernels are compiled with), else None (the library looks
    in ``/usr/local/cuda`` and beside NVSHMEM)."""
    return os.environ.get("CUDA_HOME") or None
