"""``EventOverlap``: a CUDA event plus the tensors that must outlive the work it marks (DeepEP semantics)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._torch import require_torch, torch


class EventOverlap:
    """A CUDA event recorded after communication work, for overlapping it with computation.

    ``current_stream_wait()`` makes the current stream wait for the event. As a context manager, the body
    runs without waiting and the current stream waits on exit::

        _, _, event = buffer.combine(x, handle, async_finish=True)
        with event:
            do_something_independent()      # overlaps with the combine
        # the current stream now waits for the combine

    ``extra_tensors`` keeps tensors (inputs and outputs of the work) alive as long as this object, which is
    how asynchronous results stay valid without ``record_stream`` (that CUDA graphs do not allow). On the
    host backend (CPU tensors) work is finished when a call returns and ``event`` is ``None``: waiting is
    a no-op.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Sequence[Any]] = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """The current stream (``torch.cuda.current_stream()``) waits for the event."""
        if self.event is not None:
            require_torch().cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        kept = 0 if self.extra_tensors is None else len(self.extra_tensors)
        return f"EventOverlap(event={self.event!r}, extra_tensors={kept} tensors)"


if torch is not None:

    class EventHandle(torch.cuda.Event):
        """A ``torch.cuda.Event`` with DeepEP's ``EventHandle.current_stream_wait()``."""

        def current_stream_wait(self) -> None:
            torch.cuda.current_stream().wait_event(self)

else:  # pragma: no cover
    EventHandle = None  # type: ignore[assignment,misc]


def record_event(stream: Any = None) -> "EventHandle":
    """An ``EventHandle`` recorded on ``stream`` (default: the current stream)."""
    t = require_torch()
    event = EventHandle()
    event.record(stream if stream is not None else t.cuda.current_stream())
    return event
