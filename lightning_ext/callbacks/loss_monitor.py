"""``LossMonitor``: non-finite loss detection agreed across ranks, and periodic loss/data-time writing."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_ext._checks import check_bool, check_int
from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.distributed import get_rank, get_world_size
from lightning_ext.stats import Collector, report, set_stage

# The runs of every LossMonitor of this process, in the order they start: each run's own stage (two
# monitors driven side by side saw each other's losses on a stage named by their state_key alone)
_RUNS = itertools.count()

__all__ = ["LossMonitor"]


def _extract_losses(outputs: Any, accumulate_grad_batches: int = 1) -> dict[str, torch.Tensor]:
    """The losses of a ``training_step`` output, as ``{name: 0-dim tensor}`` (detached).

    A tensor is the total loss ``{"loss": outputs}``. A mapping contributes its ``"loss"`` entry
    (the total that is back-propagated) and every other scalar tensor entry whose key starts
    with ``"loss"`` (detectron2's ``loss_cls``, ``loss_box_reg``, ...). Lightning divides the
    ``"loss"`` it passes to ``on_train_batch_end`` by ``accumulate_grad_batches``; that factor is
    multiplied back so the values are those ``training_step`` returned.

    Raises:
        ValueError: ``outputs`` holds no loss (``None``, or a mapping without ``"loss"``).
        TypeError: the loss is not a tensor with one element.

    Example::

        >>> _extract_losses({"loss": torch.tensor(2.0), "loss_box": torch.tensor(0.5), "acc": 0.9})
        {'loss': tensor(2.), 'loss_box': tensor(0.5000)}
    """
    if isinstance(outputs, torch.Tensor):
        outputs = {"loss": outputs}
    if not isinstance(outputs, Mapping) or outputs.get("loss") is None:
        raise ValueError(
            f"LossMonitor: `training_step` returned no loss (its output reached `on_train_batch_end` as "
            f"{outputs!r:.120}); LossMonitor needs the loss tensor or a dict with a 'loss' entry. "
            "HINT: return the loss from `training_step` (with a HookRunner: pass it to "
            "`runner.after_step(loss)`), or remove LossMonitor from the callbacks."
        )
    loss = outputs["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"LossMonitor: the 'loss' returned by `training_step` must be a tensor with one "
            f"element, got {loss!r:.120}"
        )
    extras = {
        k: v.detach().reshape(()) for k, v in outputs.items()
        if isinstance(k, str) and k.startswith("loss") and k != "loss"
        and isinstance(v, torch.Tensor) and v.numel() == 1
    }  # fmt: skip
    return {"loss": loss.detach().reshape(()) * accumulate_grad_batches, **dict(sorted(extras.items()))}


# One rank's row of the rare all_gather: (its first non-finite iteration since the last agreement point,
# inf if none; its losses then; whether its writer failed).
_RankRow = tuple[float, list[float], bool]


def _summarize(collector: Collector, keys: list[str], ranks: list[_RankRow] | None) -> dict[str, Any]:
    """An agreement point's summary: the loss means and ``Timing/data_sec_max`` from ``collector`` (the
    same on every rank) and, from every rank's :data:`_RankRow` (``ranks``, gathered only when a total
    loss was non-finite or a writer failed), the first non-finite iteration, the ranks that saw it
    then, the losses of the lowest of them, and the ranks whose writer failed."""
    summary: dict[str, Any] = {
        "means": {key: collector.mean(key) for key in keys},
        "data_sec_max": collector.max("data_sec"),
        "writer_failed_ranks": [r for r, row in enumerate(ranks or ()) if row[2]],
        "bad": False,
    }
    first = min((row[0] for row in ranks or ()), default=math.inf)
    if math.isfinite(first):
        bad_ranks = [r for r, row in enumerate(ranks) if row[0] == first]
        losses = dict(zip(keys, ranks[bad_ranks[0]][1]))
        summary.update(bad=True, first_bad_iter=int(first), bad_ranks=bad_ranks, bad_loss_dict=losses)
    return summary


class LossMonitor(HookBase):
    """Raise on a non-finite loss on every rank alike; write loss means and data time every N steps.

    Every micro-batch, the losses returned by ``training_step`` (a tensor: ``"loss"``; a mapping: its
    ``"loss"`` and every other one-element tensor whose key starts with ``"loss"``; under a
    :class:`~lightning_ext.callbacks.hook_runner.HookRunner`, those given to ``after_step``) are
    :func:`~lightning_ext.stats.report`-ed under this monitor's own stage
    (:func:`~lightning_ext.stats.set_stage`: other collectors, ``TrainingStats``'s included, do not see
    them), and the first non-finite total loss is kept on the device: no host–device synchronization,
    no collective on the step. Every ``every_n_train_steps`` iterations and at the end of training comes
    an *agreement point*: this monitor's :class:`~lightning_ext.stats.Collector` updates (its two
    all-reduces, on the training thread, with the iteration as the step every rank must share: a rank
    that agrees at another iteration raises on every rank). From the published statistics, which every
    rank holds:

    - if a total loss was non-finite, EVERY rank raises ``FloatingPointError("Loss became infinite
      or NaN at iteration=I on rank(s) [...]!\\nloss_dict = {...}")``, ``I`` being the first such
      iteration (:attr:`~HookBase.iter`) on any rank and ``loss_dict`` that rank's losses then (or
      warns, with ``raise_on_nonfinite=False``); the ranks and losses come from one
      ``all_gather_object`` that every rank runs only then; no rank raises while another waits in a
      collective;
    - rank zero writes to every logger, and every rank to ``trainer.callback_metrics`` (so
      ``ModelCheckpoint`` can monitor them): ``LossMonitor/<key>``, the mean of each loss over ranks
      and micro-batches (of the finite ones), and ``Timing/data_sec_max``, the max over ranks of the mean
      data time per
      iteration. The step is :attr:`~HookBase.iter`, Lightning's own for the batch: ``i`` after
      iteration ``i``, the number of iterations at the end of training.

    Reading the published values synchronizes host and device once per agreement point. With
    ``async_write=True`` the logger writes run on one worker thread, in order, and each outcome (the
    metrics, the non-finite decision) is applied at the next iteration's ``after_step``; use loggers
    that tolerate writes from two threads (TensorBoard's ``SummaryWriter`` does; ``CSVLogger`` is not
    documented as thread-safe). A logger that raises: on one process the exception is re-raised at
    once (or at that next ``after_step``); on several it is flagged at the next agreement point and
    raised there on every rank (the failing rank re-raises it, the others a ``RuntimeError`` naming it);
    after the last one, training's successful end asks every rank (one ``all_gather_object``).

    Checkpoints: the monitor keeps no state. A non-finite loss is acted on at the next agreement point,
    not when a checkpoint is saved: a run resumed from a checkpoint saved in between does not raise for
    it (its weights are those the checkpoint holds: finite when a loss scaler skipped that step, as
    :class:`~lightning_ext.plugins.LossScalingPrecision` does). Save checkpoints at agreement points
    (``every_n_train_steps`` dividing ``ModelCheckpoint``'s interval) to keep the alarm.

    Source: detectron2's ``SimpleTrainer._write_metrics`` (``engine/train_loop.py``), which checks
    on rank 0 only (the other ranks hang in the next collective) and drops writer exceptions.

    Args:
        every_n_train_steps: iterations between agreement points (cross-rank check + writing).
        raise_on_nonfinite: raise ``FloatingPointError`` (``True``) or only warn (``False``).
        async_write: write to the loggers on a worker thread instead of the training thread.

    Raises:
        ValueError: ``every_n_train_steps < 1`` (at construction); ``training_step`` returned no
            loss (at the first step, on every rank whose step returned none).
        TypeError: ``every_n_train_steps`` is not an int, ``raise_on_nonfinite``/``async_write`` are
            not bools (at construction); the loss is not a one-element tensor.
        FloatingPointError: a total loss became non-finite (see above).

    Example::

        >>> monitor = LossMonitor(every_n_train_steps=10)
    """

    def __init__(
        self, every_n_train_steps: int = 20, raise_on_nonfinite: bool = True, async_write: bool = False
    ) -> None:
        super().__init__()
        check_int("LossMonitor", "every_n_train_steps", every_n_train_steps, ge=1)
        check_bool("LossMonitor", "raise_on_nonfinite", raise_on_nonfinite)
        check_bool("LossMonitor", "async_write", async_write)
        self.every_n_train_steps, self.raise_on_nonfinite = every_n_train_steps, raise_on_nonfinite
        self.async_write = async_write
        #: summary dict of the last agreement point (means, data_sec_max, bad, ...); for inspection.
        self.last_summary: dict[str, Any] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._collector: Collector | None = None  # created at before_train, on this monitor's stage
        self._reset_run()

    def _reset_run(self) -> None:
        self._keys: list[str] | None = None  # loss names, fixed at the first step
        self._new_interval()
        # The last agreement's async write, its metrics and the exception it decided (raised after it).
        self._pending: tuple[Future, dict[str, float], BaseException | None] | None = None
        self._writer_error: BaseException | None = None  # local writer failure not yet agreed

    def _new_interval(self) -> None:
        # The first non-finite total loss since the last agreement point, on the loss device: float64
        # 0-dim iteration (inf if none) and float64 (K,) losses then; None before the interval's first
        # micro-batch.
        self._first_bad: tuple[torch.Tensor, torch.Tensor] | None = None
        self._iters = 0  # iterations since the last agreement point
        self._data_sec = 0.0  # data seconds since the last agreement point

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_executor": None, "_pending": None, "_collector": None}

    @override
    def before_train(self) -> None:
        self._reset_run()
        # the same on every rank (each starts the same runs in the same order; else the collectors' own
        # agreement names the ranks); apart from other collectors' values and other monitors' losses
        self._stage = f"{self.state_key}#{next(_RUNS)}"
        self._collector = Collector(keep_previous=False, stage=self._stage)
        if self.async_write and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="LossMonitor-writer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        automatic = isinstance(trainer, pl.Trainer) and pl_module.automatic_optimization  # not HookRunner
        self._fold(_extract_losses(outputs, trainer.accumulate_grad_batches if automatic else 1))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _fold(self, losses: dict[str, torch.Tensor]) -> None:
        """Report this micro-batch's losses (names new since the first step are ignored) and keep the
        first non-finite total loss: device ops only."""
        if self._keys is None:
            self._keys = list(losses)  # "loss" first
        self._report({key: losses[key] for key in self._keys if key in losses})
        loss = losses["loss"]
        row = torch.stack([losses.get(key, loss.new_zeros(())).double() for key in self._keys])
        if self._first_bad is None:
            self._first_bad = (torch.full((), math.inf, dtype=torch.float64, device=row.device), row)
        first_iter, first_row = self._first_bad
        new = ~torch.isfinite(loss) & torch.isinf(first_iter)
        self._first_bad = (torch.where(new, float(self.iter), first_iter), torch.where(new, row, first_row))

    def _report(self, values: dict[str, Any]) -> None:
        """:func:`~lightning_ext.stats.report` ``values`` on this monitor's stage."""
        previous = set_stage(self._stage)
        try:
            for name, value in values.items():
                report(name, value)
        finally:
            set_stage(previous)

    @override
    def after_step(self) -> None:
        self._iters += 1
        self._data_sec += self.data_sec
        if self._pending is not None:
            self._collect()
        if self._steps_done % self.every_n_train_steps == 0:
            self._agree()

    @override
    def after_train(self) -> None:
        try:
            if self.exception is None:  # success: every rank is here, collectives are safe
                if self._pending is not None:
                    self._collect()
                if self._first_bad is not None:  # iterations since the last agreement point (every rank)
                    self._agree(final=True)
                if self._keys is not None:  # (set at the first iteration: on every rank alike)
                    self._agree_on_writers()
        finally:
            if self._executor is not None:
                failed = self.exception is not None
                self._executor.shutdown(wait=not failed, cancel_futures=failed)
                self._executor = None
            self._pending, self._collector = None, None  # (a finished run's collector takes no values)

    def _agree(self, final: bool = False) -> None:
        """Update the collector (its all-reduces), gather the ranks' rows if something went wrong,
        decide, then write (on the worker thread when async)."""
        if self._keys is None:
            return
        self._report({"data_sec": self._data_sec / max(self._iters, 1),
                      "writer_failed": float(self._writer_error is not None)})  # fmt: skip
        collector = self._collector
        collector.update(step=self.iter)  # the same iteration on every rank, or every rank raises
        bad = collector.nonfinite("loss") > 0  # some rank's total loss was (the same on every rank)
        ranks = self._gather() if bad or collector.max("writer_failed") > 0 else None
        self.last_summary = summary = _summarize(collector, self._keys, ranks)
        error = self._decide(summary)
        self._writer_error = None
        self._new_interval()
        metrics = {f"LossMonitor/{key}": value for key, value in summary["means"].items()}
        metrics["Timing/data_sec_max"] = summary["data_sec_max"]
        step = self.iter  # Lightning's step: i after iteration i, n at the end
        if self.async_write and not final and self._executor is not None:
            self._pending = (self._executor.submit(self._write, metrics, step), metrics, error)
        else:
            self._finish(lambda: self._write(metrics, step), metrics, error)

    def _agree_on_writers(self) -> None:
        """After the last write: raise on every rank when it failed on one (only rank zero writes, so
        only it knows: one ``all_gather_object`` on several ranks)."""
        failed = [rank for rank, row in enumerate(self._gather()) if row[2]]
        if self._writer_error is not None:
            raise self._writer_error
        if failed:
            raise RuntimeError(f"LossMonitor: the writer failed on rank(s) {failed}; see that rank's error")

    def _decide(self, summary: dict[str, Any]) -> BaseException | None:
        """The exception an agreement point raises on every rank once written: the non-finite loss (a
        warning instead with ``raise_on_nonfinite=False``), else a writer failure (this rank's own)."""
        if summary["bad"]:
            message = (
                f"Loss became infinite or NaN at iteration={summary['first_bad_iter']} on rank(s) "
                f"{summary['bad_ranks']}!\nloss_dict = {summary['bad_loss_dict']}"
            )
            if self.raise_on_nonfinite:
                return FloatingPointError(message)
            self._warn(message)
        failed = summary["writer_failed_ranks"]
        if self._writer_error is not None or not failed:  # this rank's own failure, or none anywhere
            return self._writer_error
        return RuntimeError(f"LossMonitor: the writer failed on rank(s) {failed}; see that rank's error")

    def _gather(self) -> list[_RankRow]:
        """Every rank's :data:`_RankRow`: a host read, and one ``all_gather_object`` on several ranks."""
        first_iter, losses = self._first_bad if self._first_bad is not None else (math.inf, [])
        row = (float(first_iter), torch.as_tensor(losses).tolist(), self._writer_error is not None)
        if get_world_size() == 1:
            return [row]
        rows: list[Any] = [None] * get_world_size()
        dist.all_gather_object(rows, row)
        return rows

    def _write(self, metrics: dict[str, float], step: int) -> None:
        """Rank zero's logger writes (on the worker thread when async)."""
        if get_rank() == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _collect(self) -> None:
        """Wait for the last asynchronous job and raise what it found (see the class docstring)."""
        future, metrics, error = self._pending
        self._pending = None
        self._finish(future.result, metrics, error)

    def _finish(self, job: Callable[[], Any], metrics: dict[str, float], error: BaseException | None) -> None:
        """Run ``job`` (the writer, or the wait for it), then, on the training thread, publish ``metrics``
        and raise ``error``; on several processes a writer failure is kept for the next agreement point
        instead of raising on this rank alone."""
        try:
            job()
        except Exception as exc:
            if get_world_size() == 1:
                raise
            self._writer_error = exc
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if error is not None:
            raise error
