"""``TrainingStats``: flush :mod:`lightning_ext.stats` to every Lightning logger and ``callback_metrics``."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ext import distributed as _dist
from lightning_ext._checks import check_bool, check_int
from lightning_ext.callbacks.hook_base import _iterations_done
from lightning_ext.stats import Collector, init_multiprocessing, report, set_stage
from lightning_ext.stats.collector import _compile_regex

__all__ = ["TrainingStats"]

_STATS = ("mean", "std", "min", "max", "num")
_FLUSH_TIME_NAME = "Timing/stats_flush_sec"
# Lightning's stages whose values are collected apart, and what their statistics are logged under
STAGE_PREFIXES = {"validate": "val/", "test": "test/"}


class TrainingStats(Callback):
    """Collect what the model ``report()``-s and log it, identical on every rank, every N iterations.

    ``setup`` calls :func:`~lightning_ext.stats.init_multiprocessing` (the trainer's rank; the
    default group's collective device when several processes run) and creates a
    :class:`~lightning_ext.stats.Collector`. Every rank calls :meth:`flush` every
    ``every_n_train_steps`` iterations when ``on_step`` (optimizer steps in automatic optimization,
    ``training_step`` calls that stepped in manual optimization: see
    :class:`~lightning_ext.callbacks.HookBase`), and at the
    end of each training epoch when ``on_epoch``. A flush writes at the step at which Lightning logs
    the ``self.log`` values of the same batch: the flush after ``every_n_train_steps`` iterations at
    step ``every_n_train_steps - 1``, as Lightning's ``log_every_n_steps`` row of that batch.

    Stages. While Lightning runs validation, test or predict, the callback sets that stage
    (:func:`~lightning_ext.stats.set_stage`): a ``report()`` in a ``forward`` that serves every loop
    files validation values apart from training ones. With ``on_epoch``, the values of each
    validation run are written once, at its end (not for the sanity check, whose values are
    dropped), under ``prefix + "val/" + name``; those of a test run under ``prefix + "test/" +
    name``; those of predict are not collected. A flush writes only the names that received values
    since the previous flush of their stage: a name is never written twice for the same values.

    Args:
        every_n_train_steps: flush period in iterations (``>= 1``).
        regex: names to collect (``re.fullmatch``).
        stats: statistics to log, a non-empty sequence of ``"mean"``, ``"std"``, ``"min"``,
            ``"max"``, ``"num"``.
        prefix: prepended to every logged key.
        on_step: flush every ``every_n_train_steps`` iterations.
        on_epoch: flush at the end of validation and training epochs.
        keep_previous: passed to ``Collector``.

    Raises:
        ValueError: ``every_n_train_steps < 1``, ``stats`` is empty or holds an unknown statistic, or
            ``regex`` does not compile.
        TypeError: ``every_n_train_steps`` is not an int, ``regex``/``prefix`` is not a str, ``stats``
            is a str, or ``on_step``/``on_epoch``/``keep_previous`` is not a bool.

    Example::

        >>> cb = TrainingStats(every_n_train_steps=10, regex="Loss/.*", stats=("mean", "std"))
        >>> cb.state_key
        "TrainingStats{'every_n_train_steps': 10, 'regex': 'Loss/.*', 'stats': ('mean', 'std'), 'prefix': ''}"
    """

    def __init__(
        self,
        every_n_train_steps: int = 50,
        regex: str = ".*",
        stats: tuple[str, ...] | list[str] = ("mean",),
        prefix: str = "",
        on_step: bool = True,
        on_epoch: bool = True,
        keep_previous: bool = True,
    ) -> None:
        check_int("TrainingStats", "every_n_train_steps", every_n_train_steps, ge=1)
        if isinstance(stats, str):
            raise TypeError(f"TrainingStats: `stats` must be a sequence of names, not the str {stats!r}")
        stats = tuple(stats)
        unknown = [s for s in stats if s not in _STATS]
        if not stats or unknown:
            raise ValueError(f"TrainingStats: `stats` must be a non-empty subset of {_STATS}, got {stats!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"TrainingStats: `prefix` must be a str, got {prefix!r}")
        for name, flag in (("on_step", on_step), ("on_epoch", on_epoch), ("keep_previous", keep_previous)):
            check_bool("TrainingStats", name, flag)
        _compile_regex("TrainingStats", regex)
        self.every_n_train_steps = every_n_train_steps
        self.regex = regex
        self.stats = stats
        self.prefix = prefix
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.keep_previous = keep_previous
        self.collector: Collector | None = None  # the training values
        self.stage_collectors: dict[str, Collector] = {}  # stage => its values (with ``on_epoch``)
        self._outer_stage: str | None = None  # the stage set before a loop's
        self.last_flush_step = -1  # iterations done at the last step-triggered flush
        self._global_step = 0  # trainer.global_step at the end of the previous batch
        self._pending_state: dict[str, Any] | None = None  # loaded before setup created the collector

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_train_steps=self.every_n_train_steps,
            regex=self.regex,
            stats=self.stats,
            prefix=self.prefix,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        several = _dist.is_distributed() and _dist.get_world_size() > 1
        init_multiprocessing(
            rank=trainer.global_rank, sync_device=_dist.collective_device() if several else None
        )
        if self.collector is None:
            self.collector = Collector(regex=self.regex, keep_previous=self.keep_previous)
            if self.on_epoch:
                self.stage_collectors = {
                    stage: Collector(regex=self.regex, keep_previous=self.keep_previous, stage=stage)
                    for stage in STAGE_PREFIXES
                }
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
            self._pending_state = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._global_step = trainer.global_step != self._global_step, trainer.global_step
        done = _iterations_done(trainer) + 1  # this batch's iteration included
        if self.on_step and stepped and done > self.last_flush_step and done % self.every_n_train_steps == 0:
            self.last_flush_step = done
            self.flush(trainer)  # at Lightning's step for this batch: _iterations_done(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._global_step = trainer.global_step

    def _enter(self, stage: str) -> None:
        self._outer_stage = set_stage(stage)

    def _leave(self) -> None:
        set_stage(self._outer_stage)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave()

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "validate" in self.stage_collectors:
            self.stage_collectors["validate"]._discard()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch and not trainer.sanity_checking:
            self.flush(trainer, stage="validate")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch:
            self.flush(trainer, stage="test")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch:
            self.flush(trainer)

    def flush(
        self, trainer: pl.Trainer, step: int | None = None, stage: str | None = None
    ) -> dict[str, float]:
        """Update the collector of ``stage`` (``None``: training) and write the statistics; returns
        what was written.

        Writes the chosen statistics of each name that received values since the previous flush of
        ``stage`` as ``prefix + name`` (mean) and ``prefix + name + "/std"`` (``/min``, ``/max``,
        ``/num``), ``name`` behind the stage's prefix (``"val/"``, ``"test/"``), to every logger at ``step``
        (default: the step Lightning logs the current batch's ``self.log`` values at, which
        :attr:`HookBase.iter <lightning_ext.callbacks.HookBase.iter>` reads: ``i`` in iteration ``i``
        and in a validation run after it, the number of iterations at the end of an epoch; so the steps of
        a logger never go backwards) and to ``trainer.callback_metrics`` (float32 0-dim CPU tensors, for
        ``ModelCheckpoint``/``EarlyStopping``). Its wall time is ``report()``-ed as
        ``Timing/stats_flush_sec`` (seen at the next flush). Must run on every rank:
        ``Collector.update()`` runs collectives. Synchronizes host and device once.

        Raises:
            RuntimeError: called before the Trainer ran ``setup`` (no collector yet).
            ValueError: ``stage`` is not ``None`` or a stage collected here (``"validate"``,
                ``"test"`` with ``on_epoch``).
        """
        if self.collector is None:
            raise RuntimeError(
                "TrainingStats.flush() needs a Trainer that ran setup(); call trainer.fit/validate first"
            )
        if stage is not None and stage not in self.stage_collectors:
            raise ValueError(
                f"TrainingStats.flush: `stage` must be None or one of {sorted(self.stage_collectors)}, "
                f"got {stage!r}"
            )
        collector = self.collector if stage is None else self.stage_collectors[stage]
        start = time.perf_counter()
        collector.update()
        metrics = self._metrics(collector, self.prefix + ("" if stage is None else STAGE_PREFIXES[stage]))
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=_iterations_done(trainer) if step is None else step)
            trainer.callback_metrics.update(
                {k: torch.tensor(v, dtype=torch.float32) for k, v in metrics.items()}
            )
        outer = set_stage(None)  # the flush's own time is a training statistic
        report(_FLUSH_TIME_NAME, time.perf_counter() - start)
        set_stage(outer)
        return metrics

    def _metrics(self, collector: Collector, prefix: str) -> dict[str, float]:
        """``{prefix + name[/stat]: value}`` of the names that received values in the last interval."""
        metrics: dict[str, float] = {}
        values = collector.as_dict()
        for name in collector.updated():
            if math.isnan(values[name]["mean"]):
                continue
            for stat in self.stats:
                key = prefix + name if stat == "mean" else f"{prefix}{name}/{stat}"
                metrics[key] = float(values[name][stat])
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.collector is None:
            return self._pending_state or {"last_flush_step": self.last_flush_step, "collector": None}
        stages = {stage: c.state_dict() for stage, c in self.stage_collectors.items()}
        return {
            "last_flush_step": self.last_flush_step,
            "collector": self.collector.state_dict(),
            "stages": stages,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_flush_step = int(state_dict["last_flush_step"])
        if self.collector is None:  # before setup made the collectors: loaded by setup
            self._pending_state = state_dict
            return
        if state_dict.get("collector") is not None:
            self.collector.load_state_dict(state_dict["collector"])
        for stage, state in state_dict.get("stages", {}).items():
            if stage in self.stage_collectors:
                self.stage_collectors[stage].load_state_dict(state)
