"""Deferred torch import: ``import moelink`` must work where torch is absent (CI, tooling)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

torch: Any
try:  # pragma: no cover - exercised by whichever environment runs the tests
    import torch
except ImportError:  # pragma: no cover
    torch = None


def require_torch() -> ModuleType:
    """Returns the torch module, or raises ``ImportError`` saying what needs it."""
    if torch is None:
        raise ImportError("moelink's Buffer, EventOverlap and topk_idx_t need PyTorch (pip install torch); "
                          "moelink._native works without it")
    return torch
