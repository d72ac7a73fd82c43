"""Timing marks on the device's own timeline, for the step and draft costs the controller prices.

On CPU the work is synchronous: a mark is the host clock. On CUDA a host clock around launches
measures only the launches (the draft's GPU time would be charged to the next verification), so a
mark is a CUDA event recorded on the current stream, and an interval is read once its end event
has completed: at a later step, never by waiting for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class StepClock:
    """``mark()`` a point; ``measure(start, end, use)`` calls ``use(seconds)`` for the interval,
    now (CPU) or at the first :meth:`collect` after the device has passed ``end`` (CUDA)."""

    MAX_PENDING = 64  # intervals waiting for their events (beyond that the oldest are dropped)

    def __init__(self, device: torch.device | str) -> None:
        self.on_device = torch.device(device).type == "cuda"
        self._pending: list[tuple[Any, Any, Callable[[float], None]]] = []

    def mark(self) -> Any:
        if self.on_device:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def measure(self, start: Any, end: Any, use: Callable[[float], None]) -> None:
        if not self.on_device:
            use(end - start)
            return
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.pop(0)
        self._pending.append((start, end, use))

    def collect(self) -> None:
        """Hand on every pending interval whose end the device has reached (CUDA; in order)."""
        while self._pending and self._pending[0][1].query():
            start, end, use = self._pending.pop(0)
            use(start.elapsed_time(end) / 1000.0)
