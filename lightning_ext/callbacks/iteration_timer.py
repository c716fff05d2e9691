"""Per-iteration data/step timing and the end-of-training speed summary (detectron2's IterationTimer)."""

from __future__ import annotations

import datetime
import itertools
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_ext._checks import check_int
from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.distributed import collective_seconds
from lightning_ext.stats import report

__all__ = ["IterationTimer"]


class IterationTimer(HookBase):
    """Time every iteration and log the overall training speed at the end of training.

    Every iteration it ``report()``-s ``Timing/data_sec``, the seconds waiting for data (from the end
    of the previous micro-batch, the start of the epoch or the end of a validation run to the start
    of the next micro-batch, summed over the iteration), and after the first ``warmup_iter``
    iterations ``Timing/step_sec``, the seconds of the iteration itself (forward, backward, optimizer
    step and the hooks in between, data time excluded), and per micro-batch ``Timing/forward_sec``,
    from its start to ``on_before_backward`` (the ``training_step``), and ``Timing/compute_sec``, that
    time less the seconds spent in the package's collectives meanwhile
    (:func:`~lightning_ext.distributed.collective_seconds`: SyncBatchNorm's all-reduce, a statistics
    flush). A fast rank waits for a slow one in a collective: in DDP's gradient all-reduce, after
    ``on_before_backward``, or in SyncBatchNorm's, inside the forward and subtracted; so the slow rank's
    ``compute_sec`` is the longest (:class:`~lightning_ext.callbacks.TrainingStats` names it) while the
    step times are alike. Times are host wall time on CPU; on CUDA, events recorded at those hooks
    and read once a later iteration finds them completed (``Event.query()``), so no per-step
    synchronization but values one or more iterations late (``compute_sec`` then subtracts the host
    seconds of the collectives, which misses an NCCL wait on the device).
    :class:`~lightning_ext.callbacks.TrainingStats` writes them, at Lightning's step of the batch
    that flushes (see :attr:`~HookBase.iter`).

    At ``after_train`` (also after a failure) it logs detectron2's summary on rank zero
    (``rank_zero_info``) and keeps it in :attr:`summary`::

        Overall training speed: 97 iterations in 0:00:03 (0.0311 s / it)
        Total training time: 0:00:04 (0:00:00 on hooks)

    The speed counts the iterations after warm-up and their data + step time; the total is the wall
    time since warm-up, "hooks" the time outside iterations (validation, checkpoints, epoch hooks).
    On CUDA ``after_train`` synchronizes the device once. Put this hook first in ``callbacks``.

    Args:
        warmup_iter: number of first iterations excluded from ``Timing/step_sec`` and the summary.

    Raises:
        TypeError: ``warmup_iter`` is not an int.
        ValueError: ``warmup_iter < 0``.

    Source: detectron2 ``engine/hooks.py`` ``IterationTimer``.

    Example::

        >>> timer = IterationTimer(warmup_iter=2)
        >>> timer.warmup_iter, timer.summary
        (2, None)
    """

    def __init__(self, warmup_iter: int = 3) -> None:
        super().__init__()
        check_int("IterationTimer", "warmup_iter", warmup_iter, ge=0)
        self.warmup_iter = warmup_iter
        #: the two summary lines logged at the end of the last training run (``None`` before).
        self.summary: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._step_start = 0.0  # perf_counter at before_step
        self._timed_start: float | None = None  # perf_counter when warm-up ended
        self._timed_sec = 0.0  # data + step seconds of the iterations after warm-up
        self._timed_iters = 0  # number of those iterations
        self._cuda_start: torch.cuda.Event | None = None
        self._forward_start: float | torch.cuda.Event | None = None  # of the current micro-batch
        self._collective_start = 0.0  # collective_seconds() at the start of the current micro-batch
        # (name, start, end, seconds to subtract) of CUDA timings not read yet
        self._pending_events: deque[tuple[str, torch.cuda.Event, torch.cuda.Event, float]] = deque()

    @property
    def timed_iters(self) -> int:
        """Number of iterations after warm-up of the current/last run."""
        return self._timed_iters

    @property
    def timed_seconds(self) -> float:
        """Data + step seconds of the iterations after warm-up of the current/last run."""
        return self._timed_sec

    @override
    def before_train(self) -> None:
        self._reset()
        self._timed_start = time.perf_counter() if self.warmup_iter == 0 else None

    def _timed(self) -> bool:
        return self.iter - self.start_iter >= self.warmup_iter

    def _on_cuda(self) -> bool:
        return self.pl_module is not None and _device_type(self.pl_module) == "cuda"

    @override
    def before_step(self) -> None:
        self._step_start = time.perf_counter()
        self._cuda_start = _now_or_event(True) if self._on_cuda() and self._timed() else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._forward_start = _now_or_event(self._on_cuda()) if self._timed() else None
        self._collective_start = collective_seconds()

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        start, self._forward_start = self._forward_start, None
        waited = collective_seconds() - self._collective_start
        if isinstance(start, float):
            forward = report("Timing/forward_sec", time.perf_counter() - start)
            report("Timing/compute_sec", forward - waited)
        elif start is not None:
            end = _now_or_event(True)
            self._pending_events.extend([("Timing/forward_sec", start, end, 0.0),
                                         ("Timing/compute_sec", start, end, waited)])  # fmt: skip

    @override
    def after_step(self) -> None:
        now = time.perf_counter()
        step_sec = now - self._step_start - self._data_sec_later  # later micro-batches' waits are data
        report("Timing/data_sec", self.data_sec)
        iters_done = self.iter - self.start_iter + 1
        if iters_done > self.warmup_iter:
            self._timed_sec += step_sec + self.data_sec
            self._timed_iters += 1
            if self._cuda_start is not None:
                self._pending_events.append(("Timing/step_sec", self._cuda_start, _now_or_event(True), 0.0))
                self._report_completed_events()
            else:
                report("Timing/step_sec", step_sec)
        elif iters_done == self.warmup_iter:
            self._timed_start = now

    def _report_completed_events(self) -> None:
        while self._pending_events and self._pending_events[0][2].query():
            name, start, end, waited = self._pending_events.popleft()
            report(name, start.elapsed_time(end) / 1000.0 - waited)

    @override
    def after_train(self) -> None:
        if self._pending_events:
            torch.cuda.synchronize()  # once per run, documented
            self._report_completed_events()
        total = 0.0 if self._timed_start is None else time.perf_counter() - self._timed_start
        hooks = max(total - self._timed_sec, 0.0)
        lines = []
        if self._timed_iters > 0 and self._timed_sec > 0:
            lines.append(
                f"Overall training speed: {self._timed_iters} iterations in "
                f"{_fmt(self._timed_sec)} ({self._timed_sec / self._timed_iters:.4f} s / it)"
            )
        lines.append(f"Total training time: {_fmt(total)} ({_fmt(hooks)} on hooks)")
        self.summary = "\n".join(lines)
        for line in lines:
            rank_zero_info(line)


def _now_or_event(cuda: bool) -> Any:
    """A CUDA event recorded now (``cuda``), else the host's ``perf_counter()``."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _device_type(module: torch.nn.Module) -> str:
    """``module.device.type`` (a LightningModule's), else that of its first parameter or buffer."""
    device = getattr(module, "device", None)
    if device is None:
        device = next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
    return torch.device(device).type


def _fmt(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))
