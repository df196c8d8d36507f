"""moelink: expert-parallel MoE communication (dispatch/combine) over NVLink, a drop-in for DeepEP's ``Buffer``.

``import moelink as deep_ep`` (or ``from moelink import Buffer``) is all an integration changes. The package
works without a GPU on the host backend (CPU tensors, any ``torch.distributed`` group such as gloo); the
native module :mod:`moelink._native` imports without torch at all.
"""

from __future__ import annotations

from typing import Any

from . import _native
from ._native import TimeoutError  # noqa: A004 - a RuntimeError subclass with rank/peer/phase
from .buffer import Buffer
from .config import Config
from .event import EventOverlap

__version__: str = _native.__version__

__all__ = ["Buffer", "Config", "EventOverlap", "TimeoutError", "topk_idx_t", "__version__"]


def __getattr__(name: str) -> Any:
    # `topk_idx_t` is `torch.int64`; resolved on first use so that `import moelink` works without torch.
    if name == "topk_idx_t":
        from ._torch import require_torch

        return require_torch().int64
    raise AttributeError(f"module 'moelink' has no attribute {name!r}")
