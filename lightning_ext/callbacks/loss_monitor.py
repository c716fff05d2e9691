"""``LossMonitor``: non-finite loss detection agreed across ranks, and periodic loss/data-time writing."""

from __future__ import annotations

import dataclasses
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
from lightning_ext.distributed import collective_device, get_rank, get_world_size

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
            f"{_short(outputs)}); LossMonitor needs the loss tensor or a dict with a 'loss' entry. "
            "HINT: return the loss from `training_step` (with a HookRunner: pass it to "
            "`runner.after_step(loss)`), or remove LossMonitor from the callbacks."
        )
    loss = outputs["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"LossMonitor: the 'loss' returned by `training_step` must be a tensor with one "
            f"element, got {_short(loss)}"
        )
    loss = loss.detach().reshape(())
    if accumulate_grad_batches != 1:
        loss = loss * accumulate_grad_batches
    extras = {k: v for k, v in outputs.items() if k != "loss" and isinstance(k, str) and k.startswith("loss")}
    scalars = {
        k: v.detach().reshape(()) for k, v in extras.items() if isinstance(v, torch.Tensor) and v.numel() == 1
    }
    return {"loss": loss, **dict(sorted(scalars.items()))}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _local_row(
    rows: torch.Tensor,
    counts: list[int],
    iterations: list[int],
    accumulate: int,
    data_sec: float,
    writer_failed: bool,
) -> torch.Tensor:
    """One rank's row for the agreement gather, from the losses buffered since the last agreement.

    Args:
        rows: float64 ``(M, K)`` on the loss device: the ``K`` losses of the ``M`` micro-batches
            (total loss first; absent losses as 0).
        counts: host ``(K,)`` number of micro-batches that had each loss.
        iterations: host ``(M,)`` iteration of each micro-batch.
        accumulate: factor Lightning divided the total loss by (multiplied back here).
        data_sec: mean data seconds per iteration; ``writer_failed``: this rank's writer failed.

    Returns:
        float64 ``(3K + 4,)`` on ``rows.device``: ``[sums (K), counts (K), bad, first_bad_iter,
        bad_values (K), data_sec, writer_failed]``, where ``bad`` is 1 iff some total loss is
        non-finite, ``first_bad_iter`` the iteration of the first such micro-batch (``inf`` if
        none) and ``bad_values`` its losses (NaN if none). No host–device synchronization.
    """
    k, device = rows.shape[1], rows.device
    if accumulate != 1:
        rows = torch.cat([rows[:, :1] * accumulate, rows[:, 1:]], dim=1)
    if rows.shape[0] == 0:  # one finite zero row changes neither the sums nor the decision
        rows, iterations = rows.new_zeros(1, k), [0]
    nonfinite = ~torch.isfinite(rows[:, 0])
    first = nonfinite.to(torch.uint8).argmax().reshape(1)  # first non-finite micro-batch (0 if none)
    bad = nonfinite.any().reshape(1).to(torch.float64)
    iters = torch.tensor(iterations, dtype=torch.float64).to(device, non_blocking=True)
    first_bad = torch.where(bad > 0, iters.index_select(0, first), math.inf)
    bad_values = torch.where(bad > 0, rows.index_select(0, first)[0], math.nan)
    host = torch.tensor(counts, dtype=torch.float64)
    tail = torch.tensor([data_sec, float(writer_failed)], dtype=torch.float64)
    return torch.cat([rows.sum(0), host.to(device), bad, first_bad, bad_values, tail.to(device)])


def _summarize_gathered(gathered: torch.Tensor, keys: list[str]) -> dict[str, Any]:
    """Reduce the ``_local_row`` of every rank (host float64 ``(world_size, 3K + 4)``, ``K = len(keys)``).

    Returns the means over ranks and micro-batches per key, the max over ranks of data time, whether
    any rank saw a non-finite total loss, the first such iteration, the ranks that saw it then and
    the losses of the lowest of them, and the ranks whose writer failed.
    """
    k = len(keys)
    sums, counts = gathered[:, :k].sum(0), gathered[:, k : 2 * k].sum(0)
    bad, first_bad = gathered[:, 2 * k], gathered[:, 2 * k + 1]
    result: dict[str, Any] = {
        "means": {
            key: (sums[i] / counts[i]).item() if counts[i] > 0 else math.nan for i, key in enumerate(keys)
        },
        "data_sec_max": gathered[:, 3 * k + 2].max().item(),
        "writer_failed_ranks": [r for r in range(gathered.shape[0]) if gathered[r, 3 * k + 3] > 0],
        "bad": bool((bad > 0).any()),
    }
    if result["bad"]:
        iteration = first_bad.min()
        ranks = [r for r in range(gathered.shape[0]) if bad[r] > 0 and first_bad[r] == iteration]
        values = gathered[ranks[0], 2 * k + 2 : 3 * k + 2]
        result["first_bad_iter"] = int(iteration.item())
        result["bad_ranks"] = ranks
        result["bad_loss_dict"] = {key: values[i].item() for i, key in enumerate(keys)}
    return result


@dataclasses.dataclass
class _Agreement:
    """Outcome of one agreement point, filled by the (possibly asynchronous) writer job."""

    writer_error: BaseException | None  # this rank's writer failure that the gathered table reports
    summary: dict[str, Any] | None = None  # _summarize_gathered() of the gathered table
    error: FloatingPointError | None = None  # the non-finite loss decision
    metrics: dict[str, float] | None = None  # what rank zero wrote to the loggers


class LossMonitor(HookBase):
    """Raise on a non-finite loss on every rank alike; write loss means and data time every N steps.

    Every micro-batch, the losses returned by ``training_step`` (a tensor: ``"loss"``; a mapping: its
    ``"loss"`` and every other one-element tensor whose key starts with ``"loss"``; under a
    :class:`~lightning_ext.callbacks.hook_runner.HookRunner`, those given to ``after_step``) are kept
    on their device: no other tensor op, no host–device synchronization, no collective on the step.
    Every ``every_n_train_steps`` iterations and at the end of training comes an *agreement point*: ONE
    ``all_gather`` of each rank's row of loss sums, counts and flags (``3K + 4`` float64, ``K`` losses)
    on the training thread.
    From the gathered data, which every rank holds:

    - if a total loss was non-finite, EVERY rank raises ``FloatingPointError("Loss became infinite
      or NaN at iteration=I on rank(s) [...]!\\nloss_dict = {...}")``, ``I`` being the first such
      iteration (:attr:`~HookBase.iter`) on any rank and ``loss_dict`` that rank's losses then (or
      warns, with ``raise_on_nonfinite=False``); no rank raises while another waits in a collective;
    - rank zero writes to every logger, and every rank to ``trainer.callback_metrics`` (so
      ``ModelCheckpoint`` can monitor them): ``LossMonitor/<key>``, the mean of each loss over ranks
      and micro-batches, and ``Timing/data_sec_max``, the max over ranks of the mean data time per
      iteration. The step is :attr:`~HookBase.iter`, Lightning's own for the batch: ``i`` after
      iteration ``i``, the number of iterations at the end of training.

    Reading the gathered values synchronizes host and device once per agreement point. With
    ``async_write=True`` that read, the decision and the logger writes run on one worker thread, in
    order, and each outcome is applied at the next iteration's ``after_step``; use loggers that
    tolerate writes from two threads (TensorBoard's ``SummaryWriter`` does; ``CSVLogger`` is not
    documented as thread-safe). A logger that raises: on one process the exception is re-raised at
    once (or at that next ``after_step``); on several it is flagged in the next gather and raised
    there on every rank (the failing rank re-raises it, the others a ``RuntimeError`` naming it).

    Source: detectron2's ``SimpleTrainer._write_metrics`` (``engine/train_loop.py``), which checks
    on rank 0 only (the other ranks hang in the next collective) and drops writer exceptions.

    Args:
        every_n_train_steps: iterations between agreement points (cross-rank check + writing).
        raise_on_nonfinite: raise ``FloatingPointError`` (``True``) or only warn (``False``).
        async_write: read back and write on a worker thread instead of the training thread.

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
        self.every_n_train_steps = every_n_train_steps
        self.raise_on_nonfinite = raise_on_nonfinite
        self.async_write = async_write
        #: summary dict of the last agreement point (means, data_sec_max, bad, ...); for inspection.
        self.last_summary: dict[str, Any] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self._keys: list[str] | None = None  # loss names, fixed at the first step
        self._new_accumulators()
        self._accumulate = 1  # factor Lightning divided the returned "loss" by
        self._pending: tuple[Future, _Agreement] | None = None  # async job of the last agreement
        self._writer_error: BaseException | None = None  # local writer failure not yet agreed

    def _new_accumulators(self) -> None:
        # The K 0-dim losses of each micro-batch since the last agreement point (absent ones as 0),
        # on the loss device; stacked into one (M, K) float64 buffer at the agreement point.
        self._rows: list[tuple[torch.Tensor, ...]] = []
        self._counts = [0] * len(self._keys or ())  # micro-batches that had each key
        self._micro_iters: list[int] = []  # iteration of each buffered micro-batch
        self._iters = 0  # iterations since the last agreement point
        self._data_sec = 0.0  # data seconds since the last agreement point

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_executor": None, "_pending": None}

    @override
    def before_train(self) -> None:
        self._reset_run()
        if self.async_write and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="LossMonitor-writer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        automatic = isinstance(trainer, pl.Trainer) and pl_module.automatic_optimization  # not HookRunner
        self._accumulate = trainer.accumulate_grad_batches if automatic else 1
        self._fold(_extract_losses(outputs), loss_is_copy=automatic)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _fold(self, losses: dict[str, torch.Tensor], loss_is_copy: bool = False) -> None:
        """Keep this micro-batch's losses until the agreement point; absent ones count nothing, names
        new since the first step are ignored. ``losses["loss"]`` is kept by reference if it is
        Lightning's own detached copy (``loss_is_copy``), other tensors are cloned (the user may
        change them in place)."""
        if self._keys is None:
            self._keys = list(losses)
            self._new_accumulators()
        loss = losses["loss"] if loss_is_copy else losses["loss"].clone()  # "loss" is always first
        extras = (losses[key].clone() if key in losses else loss.new_zeros(()) for key in self._keys[1:])
        self._rows.append((loss, *extras))
        self._counts = [c + (key in losses) for c, key in zip(self._counts, self._keys)]
        self._micro_iters.append(self.iter)

    @override
    def after_step(self) -> None:
        self._iters += 1
        self._data_sec += self.data_sec
        if self._pending is not None:
            self._collect()
        if (self.iter + 1) % self.every_n_train_steps == 0:
            self._agree()

    @override
    def after_train(self) -> None:
        try:
            if self.exception is None:  # success: every rank is here, collectives are safe
                if self._pending is not None:
                    self._collect()
                if self._micro_iters or self._writer_error is not None:
                    self._agree(final=True)
                if self._writer_error is not None:  # the final write itself failed on this rank
                    raise self._writer_error
        finally:
            if self._executor is not None:
                failed = self.exception is not None
                self._executor.shutdown(wait=not failed, cancel_futures=failed)
                self._executor = None
            self._pending = None

    def _agree(self, final: bool = False) -> None:
        """Gather the accumulators of every rank (one collective), then decide and write."""
        if self._keys is None:
            return
        data_sec = self._data_sec / max(self._iters, 1)
        failed = self._writer_error is not None
        k, flat = len(self._keys), [loss for row in self._rows for loss in row]
        rows = (
            torch.stack(flat).to(torch.float64).view(-1, k)
            if flat
            else torch.zeros(0, k, dtype=torch.float64)
        )
        row = _local_row(rows, self._counts, self._micro_iters, self._accumulate, data_sec, failed)
        world_size = get_world_size()
        if world_size > 1:
            row = row.to(collective_device())
            gathered = [torch.empty_like(row) for _ in range(world_size)]
            dist.all_gather(gathered, row)
            table = torch.stack(gathered)
        else:
            table = row.unsqueeze(0)
        keys, step = list(self._keys), self.iter  # Lightning's step: i after iteration i, n at the end
        self._new_accumulators()
        agreement = _Agreement(self._writer_error)
        self._writer_error = None
        if self.async_write and not final and self._executor is not None:
            future = self._executor.submit(self._decide_and_write, table, keys, step, agreement)
            self._pending = (future, agreement)
            return
        self._finish(lambda: self._decide_and_write(table, keys, step, agreement), agreement)

    def _decide_and_write(
        self, table: torch.Tensor, keys: list[str], step: int, agreement: _Agreement
    ) -> None:
        """Host read-back, non-finite decision and logger writes (on the worker thread when async)."""
        summary = _summarize_gathered(table.detach().to("cpu", torch.float64), keys)
        agreement.summary = summary
        self.last_summary = summary
        if summary["bad"]:
            message = (
                f"Loss became infinite or NaN at iteration={summary['first_bad_iter']} on rank(s) "
                f"{summary['bad_ranks']}!\nloss_dict = {summary['bad_loss_dict']}"
            )
            if self.raise_on_nonfinite:
                agreement.error = FloatingPointError(message)
            else:
                self._warn(message)
        metrics = {f"LossMonitor/{key}": value for key, value in summary["means"].items()}
        metrics["Timing/data_sec_max"] = summary["data_sec_max"]
        agreement.metrics = metrics  # identical on every rank
        if get_rank() == 0:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _collect(self) -> None:
        """Wait for the last asynchronous job and raise what it found (see the class docstring)."""
        future, agreement = self._pending
        self._pending = None
        self._finish(future.result, agreement)

    def _finish(self, job: Callable[[], Any], agreement: _Agreement) -> None:
        """Run ``job`` (the writer, or the wait for it), then :meth:`_apply`; on several processes a
        writer failure is kept for the next agreement point instead of raising on this rank alone."""
        try:
            job()
        except Exception as exc:
            if get_world_size() == 1:
                raise
            self._writer_error = exc
        self._apply(agreement)

    def _apply(self, agreement: _Agreement) -> None:
        """On the training thread: publish the metrics, then raise what the gathered data decided."""
        if agreement.metrics is not None:  # not from the worker: Lightning reads this dict meanwhile
            self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in agreement.metrics.items()})
        if agreement.error is not None:
            raise agreement.error
        failed = agreement.summary["writer_failed_ranks"] if agreement.summary is not None else []
        if failed:
            if agreement.writer_error is not None:
                raise agreement.writer_error
            raise RuntimeError(f"LossMonitor: the writer failed on rank(s) {failed}; see that rank's error")
