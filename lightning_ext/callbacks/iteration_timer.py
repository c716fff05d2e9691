"""Per-iteration timing, in parts that add up, and the end-of-training speed summary (detectron2's
IterationTimer)."""

from __future__ import annotations

import datetime
import itertools
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ext._checks import check_int
from lightning_ext._clock import elapsed, now
from lightning_ext.callbacks.hook_base import HookBase, _module_device
from lightning_ext.distributed import collective_seconds, get_world_size
from lightning_ext.distributed.ddp_sync_timer import DDPSyncTimer
from lightning_ext.stats import report

__all__ = ["IterationTimer"]

_PARTS = ("forward", "backward", "optimizer", "collective")  # summed from the marks of an iteration


class IterationTimer(HookBase):
    """Time every iteration in parts that add up, and log the overall training speed at the end.

    After the first ``warmup_iter`` iterations it ``report()``-s, per iteration (micro-batches summed)::

        Timing/iteration_sec  = data_sec + forward_sec + backward_sec + optimizer_sec
                              = data_sec + compute_sec + collective_sec

    - ``Timing/data_sec``: the wait for data (``HookBase.data_sec``: from the end of the previous
      micro-batch to the start of the next, which holds the loading, the batch's transfer and the
      end-of-batch work of the callbacks after this one, a statistics flush included).
    - ``Timing/forward_sec``: from the start of a micro-batch to ``on_before_backward`` (the
      ``training_step``), and between a backward and the next (manual optimization); and the waits in
      collectives since the previous micro-batch (``HookBase.sync_sec``: under a Trainer, Lightning's
      broadcast of the SIGTERM flag before each fetch, from Lightning 2.5.2, and a statistics flush's
      all-reduces), synchronizations of the ranks that are not data.
    - ``Timing/backward_sec``: from ``on_before_backward`` to ``on_after_backward``.
    - ``Timing/optimizer_sec``: from the last ``on_after_backward`` to the end of the micro-batch
      (gradient clipping, the optimizer step, LR schedulers, the hooks around them).
    - ``Timing/collective_sec``: the seconds of the last three spent waiting in collectives: the
      package's own (:func:`~lightning_ext.distributed.collective_seconds`: SyncBatchNorm's all-reduce,
      a loss scaler's), DDP's (:class:`~lightning_ext.distributed.DDPSyncTimer`): its buffer
      broadcast before the forward and its gradient all-reduce, from this rank's last bucket launch to
      the end of its backward, and ``HookBase.sync_sec``.
    - ``Timing/compute_sec``: forward + backward + optimizer less those waits.

    So the iteration is the wall time from the end of the previous iteration to the end of this one,
    validation runs (with the fetch of the batch after one: ``HookBase.data_sec``) and epoch boundaries
    excepted (up to the microseconds of this hook's own work).
    A fast rank waits for a slow one inside a collective (SyncBatchNorm's in the forward and the
    backward, DDP's gradient all-reduce at the end of the backward), which makes the phase times alike
    on every rank; ``compute_sec`` leaves the waits out, so the slow rank's is the longest, whether it
    is slow in its forward, its backward or its optimizer step
    (:class:`~lightning_ext.callbacks.TrainingStats` names it; a slow loader shows in ``data_sec``).

    DDP. At ``before_train``, when the trainer's ``strategy.model`` (or, under a
    :class:`~lightning_ext.callbacks.HookRunner`, ``pl_module``) holds a ``DistributedDataParallel``,
    the hook installs a ``DDPSyncTimer`` on it (a communication hook doing the same all-reduce and two
    forward pre-hooks: no extra collective). DDP takes one communication hook: when the model has one
    of its own, nothing is installed; wrap your hook, ``DDPSyncTimer(your_hook).hook``, to have it
    timed. Where the waits of the model's synchronization are not timed (DDP with a hook of its own;
    several processes without a DDP model: FSDP, DeepSpeed, a loop that all-reduces by itself), a fast
    rank's wait would count as its compute and make it look the slowest: ``compute_sec`` and
    ``collective_sec`` are then not reported, and a warning says so once. Without
    ``on_before_backward`` (a ``HookRunner``), ``forward_sec`` holds the backward too.

    CUDA. The phases and DDP's waits are timed by CUDA events recorded at those hooks (and in DDP's)
    and read once a later iteration finds them completed (``Event.query()``), so no
    per-step synchronization but values one or more iterations late. The package's collectives count
    in host seconds, which miss their NCCL wait on the device (NCCL completes on the device): with
    ``SyncBatchNormPlugin`` on CUDA, the waits inside SyncBatchNorm stay in ``compute_sec``.
    Everywhere else, host wall time. :class:`~lightning_ext.callbacks.TrainingStats` writes the
    values, at Lightning's step of the batch that flushes (see :attr:`~HookBase.iter`).

    At ``after_train`` (also after a failure) it logs detectron2's summary on rank zero
    (``rank_zero_info``) and keeps it in :attr:`summary`::

        Overall training speed: 97 iterations in 0:00:03 (0.0311 s / it)
        Total training time: 0:00:04 (0:00:00 on hooks)

    The speed counts the iterations after warm-up and their host iteration time; the total is the
    wall time since warm-up, "hooks" the time outside iterations (validation, checkpoints, epoch
    hooks). On CUDA ``after_train`` synchronizes the device once. Put this hook first in ``callbacks``.

    Args:
        warmup_iter: number of first iterations left out of the timings and the summary.

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
        self._batch_start = 0.0  # perf_counter at the start of the current micro-batch
        self._busy_sec = 0.0  # host seconds of the current iteration's micro-batches (start to end)
        self._timed_start: float | None = None  # perf_counter when warm-up ended
        self._timed_sec = 0.0  # host seconds of the iterations after warm-up
        self._timed_iters = 0  # number of those iterations
        self._cuda = False  # the module is on a CUDA device: the phases are timed by events
        self._ddp_sync: DDPSyncTimer | None = None  # the DDP model's, when it has ours
        self._waits_timed = True  # the waits in the synchronization of the model are timed (or none)
        self._launches = 0  # its backward passes seen
        self._iters_done = 0  # iterations ended (after_step) in this run
        # Of the timed iteration: (phase opened, perf_counter or CUDA event, collective_seconds(), DDP's
        # waits (start, end or None: this mark) in the phase this mark closes)
        self._marks: list[tuple[str, Any, float, list]] = []
        self._pending: deque[tuple[float, float, list]] = deque()  # (data, Lightning's broadcast, marks)

    @property
    def timed_iters(self) -> int:
        """Number of iterations after warm-up of the current/last run."""
        return self._timed_iters

    @property
    def timed_seconds(self) -> float:
        """Host seconds of the iterations after warm-up of the current/last run (data included)."""
        return self._timed_sec

    @override
    def before_train(self) -> None:
        self._reset()
        self._timed_start = time.perf_counter() if self.warmup_iter == 0 else None
        self._cuda = self.pl_module is not None and _module_device(self.pl_module).type == "cuda"
        models = (getattr(self.trainer.strategy, "model", None), self.pl_module)
        ddp = next((m for model in models if isinstance(model, torch.nn.Module) for m in model.modules()
                    if isinstance(m, DistributedDataParallel)), None)  # fmt: skip
        self._ddp_sync = None if ddp is None else DDPSyncTimer.install(ddp)
        self._launches = 0 if self._ddp_sync is None else self._ddp_sync.launches
        self._waits_timed = self._ddp_sync is not None or (ddp is None and get_world_size() == 1)
        if not self._waits_timed:
            why = "the DDP model has a communication hook of its own" if ddp is not None else (
                f"{get_world_size()} processes train without a DistributedDataParallel model")
            self._warn(
                f"IterationTimer: {why}, so the waits in the model's synchronizations are not timed: "
                "Timing/compute_sec and Timing/collective_sec are not reported (a fast rank's wait would "
                "count as its compute, naming it the slowest rank). HINT: with DDP, register "
                "DDPSyncTimer(your_hook).hook (lightning_ext.distributed) instead."
            )

    def _timed(self) -> bool:
        return self._iters_done >= self.warmup_iter  # (not self.iter: manual optimization counts batches)

    def _mark(self, phase: str) -> None:
        """Open ``phase`` now (in a timed iteration); the mark keeps DDP's waits in the phase it closes."""
        sync, waits = self._ddp_sync, []
        if sync is not None:
            waits, sync.forward_waits = sync.forward_waits, []
            if sync.launches != self._launches:  # a backward all-reduced: its wait lasts until now
                self._launches = sync.launches
                waits.append((sync.last_launch, None))
        if self._timed():
            self._marks.append((phase, now(self._cuda), collective_seconds(), waits))

    @override
    def before_step(self) -> None:
        self._busy_sec, self._marks = 0.0, []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._batch_start = time.perf_counter()
        self._mark("forward")

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._marks and self._marks[-1][0] == "optimizer":  # code between two backward passes
            self._marks[-1] = ("forward", *self._marks[-1][1:])
        self._mark("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_after_backward(trainer, pl_module)
        if self._marks and self._marks[-1][0] == "optimizer":  # another micro-batch's forward and
            self._marks[-1] = ("forward", *self._marks[-1][1:])  # backward (no on_before_backward)
        self._mark("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._busy_sec += time.perf_counter() - self._batch_start
        self._mark("data")  # until the next micro-batch: counted by HookBase.data_sec
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def after_step(self) -> None:
        now = time.perf_counter()
        self._iters_done = iters_done = self._iters_done + 1
        if iters_done > self.warmup_iter:  # (a validation run between its micro-batches left out)
            self._timed_sec += self.data_sec + self.sync_sec + self._busy_sec
            self._timed_iters += 1
            self._pending.append((self.data_sec, self.sync_sec, self._marks))
            self._report_completed()
        elif iters_done == self.warmup_iter:
            self._timed_start = now

    def _report_completed(self) -> None:
        """Report the timings of the iterations whose marks are all taken (CUDA: completed)."""
        while self._pending and _completed(self._pending[0][-1][-1][1]):
            data, sync, marks = self._pending.popleft()
            parts = dict(zip(_PARTS, (sync, 0.0, 0.0, sync)))  # (Lightning's broadcast: forward, waited)
            for (phase, start, waited, _), (_, end, waited_end, waits) in itertools.pairwise(marks):
                if phase != "data":  # (no overlap: the package's collectives in a backward end before DDP's)
                    ddp = sum(elapsed(a, end if b is None else b) for a, b in waits)
                    parts[phase] += elapsed(start, end)
                    parts["collective"] += waited_end - waited + ddp
            busy = parts["forward"] + parts["backward"] + parts["optimizer"]
            parts.update(data=data, compute=busy - parts["collective"], iteration=data + busy)
            for part, seconds in parts.items():
                if self._waits_timed or part not in ("compute", "collective"):
                    report(f"Timing/{part}_sec", seconds)

    @override
    def after_train(self) -> None:
        if self._pending:
            torch.cuda.synchronize()  # once per run, documented (CPU: nothing pending)
            self._report_completed()
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
        for line in lines if self.trainer.is_global_zero else ():  # (a runner in workers that
            rank_zero_info(line)  # torch.multiprocessing started: Lightning's rank is unknown there)


def _completed(mark: Any) -> bool:
    return isinstance(mark, float) or mark.query()


def _fmt(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))
