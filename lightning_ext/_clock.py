"""The timestamps of the timers (``IterationTimer``, ``DDPSyncTimer``): host or CUDA-event time."""

from __future__ import annotations

import time
from typing import Any

import torch


def now(cuda: bool) -> Any:
    """A CUDA event recorded now on the current stream (``cuda``), else ``time.perf_counter()``."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(start: Any, end: Any) -> float:
    """Seconds from ``start`` to ``end``: two ``perf_counter()`` readings or two completed CUDA events."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000.0
