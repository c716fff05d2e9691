"""``TrainingStats``: flush :mod:`lightning_ext.stats` to every Lightning logger and ``callback_metrics``."""

from __future__ import annotations

import math
import re
import socket
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_ext import distributed as _dist
from lightning_ext._checks import check_bool, check_int
from lightning_ext.callbacks.hook_base import _iterations_done
from lightning_ext.stats import Collector, LogHistogram, init_multiprocessing, report, set_stage

__all__ = ["TrainingStats"]

_STATS = ("mean", "std", "min", "max", "num")
_PERCENTILE = re.compile(r"p(\d+(?:\.\d+)?)")  # "p50", "p99.9": a percentile in (0, 100)
_FLUSH_TIME_NAME = "Timing/stats_flush_sec"
# Lightning's stages whose values are collected apart, and what their statistics are logged under
STAGE_PREFIXES = {"validate": "val/", "test": "test/"}


def _check_pattern(arg: str, pattern: Any, optional: bool) -> None:
    """``TypeError``/``ValueError`` naming ``arg`` unless ``pattern`` is a regular expression (or None)."""
    if optional and pattern is None:
        return
    if not isinstance(pattern, str):
        raise TypeError(f"TrainingStats: `{arg}` must be a str, got {pattern!r} ({type(pattern).__name__})")
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(
            f"TrainingStats: `{arg}` must be a regular expression, got {pattern!r} ({err})"
        ) from None


def _check_stats(stats: Any, quantiles: str | None) -> tuple[str, ...]:
    """``stats`` as a tuple, else the error naming it (see :class:`TrainingStats`)."""
    if isinstance(stats, str):
        raise TypeError(f"TrainingStats: `stats` must be a sequence of names, not the str {stats!r}")
    stats = tuple(stats)

    def known(stat: Any) -> bool:
        match = _PERCENTILE.fullmatch(stat) if isinstance(stat, str) else None
        return stat in _STATS or (match is not None and 0.0 < float(match[1]) < 100.0)

    if not stats or not all(map(known, stats)):
        raise ValueError(
            f"TrainingStats: `stats` must be a non-empty sequence of {_STATS} and percentiles 'p<P>' "
            f"with 0 < P < 100 (e.g. 'p99.9'), got {stats!r}"
        )
    percentiles = [s for s in stats if s not in _STATS]
    if percentiles and quantiles is None:
        raise ValueError(
            f"TrainingStats: `stats` asks for percentiles {percentiles} but `quantiles` is None: "
            "pass the names to sketch, e.g. quantiles='Timing/.*'"
        )
    return stats


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

    Percentiles. ``stats`` may ask for percentiles, ``"p50"``, ``"p99"``, ``"p99.9"``, written as
    ``name + "/p50"`` for the names ``quantiles`` matches (the others get the other statistics), from
    a sketch with relative accuracy ``relative_accuracy`` over ``value_range`` that rides in the
    flush's SUM all-reduce (:class:`~lightning_ext.stats.LogHistogram`: about 22 KB per name).

    The slowest rank. For each name ``stragglers`` matches that received values, a flush with several
    processes writes ``name + "/slowest_rank"``, the rank whose mean was the largest, and
    ``name + "/slowest_ratio"``, its mean over the median of the ranks' means (the rank rides in the
    flush's MAX all-reduce, the ranks' means in a sketch: no extra collective, nothing per rank), and
    logs on rank zero, when the ratio is at least ``straggler_ratio``::

        Slowest rank at iteration=24: rank 1 (host n3), Timing/forward_sec 0.06 = 4.9x the median rank (0.012)

    The default names are :class:`~lightning_ext.callbacks.IterationTimer`'s ``Timing/data_sec`` (a
    slow data loader) and ``Timing/forward_sec`` (a slow ``training_step``): under DDP the step time
    is the same on every rank, the fast ones waiting for the slow one in the gradient all-reduce.
    Host names are gathered once, at ``setup``.

    Args:
        every_n_train_steps: flush period in iterations (``>= 1``).
        regex: names to collect (``re.fullmatch``).
        stats: statistics to log, a non-empty sequence of ``"mean"``, ``"std"``, ``"min"``,
            ``"max"``, ``"num"`` and percentiles ``"p<P>"`` (``0 < P < 100``, e.g. ``"p99.9"``).
        prefix: prepended to every logged key.
        on_step: flush every ``every_n_train_steps`` iterations.
        on_epoch: flush at the end of validation and training epochs.
        keep_previous: passed to ``Collector``.
        quantiles: names whose percentiles are written (``re.fullmatch``); ``None``: none.
        relative_accuracy, value_range: the percentiles' sketch (``Collector``).
        stragglers: names whose slowest rank is written (``re.fullmatch``); ``None``: none.
        straggler_ratio: the ratio from which the slowest rank is logged (``>= 1``).

    Raises:
        ValueError: ``every_n_train_steps < 1``, ``stats`` is empty or holds an unknown statistic or
            a percentile without ``quantiles``, a pattern does not compile, a sketch parameter or
            ``straggler_ratio`` is out of range.
        TypeError: ``every_n_train_steps`` is not an int, ``regex``/``prefix`` is not a str, ``stats``
            is a str, ``on_step``/``on_epoch``/``keep_previous`` is not a bool, ``quantiles`` or
            ``stragglers`` neither a str nor None, ``straggler_ratio`` not a number.

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
        quantiles: str | None = None,
        relative_accuracy: float = 0.01,
        value_range: tuple[float, float] = (1e-6, 1e6),
        stragglers: str | None = "Timing/(data|forward)_sec",
        straggler_ratio: float = 1.25,
    ) -> None:
        check_int("TrainingStats", "every_n_train_steps", every_n_train_steps, ge=1)
        stats = _check_stats(stats, quantiles)
        self._collector_args = {  # checked below
            "regex": regex, "keep_previous": keep_previous, "quantiles": quantiles,
            "relative_accuracy": relative_accuracy, "value_range": value_range,
        }  # fmt: skip
        if isinstance(straggler_ratio, bool) or not isinstance(straggler_ratio, int | float):
            raise TypeError(f"TrainingStats: `straggler_ratio` must be a float, got {straggler_ratio!r}")
        if not straggler_ratio >= 1.0:
            raise ValueError(f"TrainingStats: `straggler_ratio` must be >= 1, got {straggler_ratio!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"TrainingStats: `prefix` must be a str, got {prefix!r}")
        for name, flag in (("on_step", on_step), ("on_epoch", on_epoch), ("keep_previous", keep_previous)):
            check_bool("TrainingStats", name, flag)
        for arg, pattern in (("regex", regex), ("quantiles", quantiles), ("stragglers", stragglers)):
            _check_pattern(arg, pattern, optional=arg != "regex")
        LogHistogram(relative_accuracy, value_range)  # checks them
        self.quantiles, self.stragglers, self.straggler_ratio = quantiles, stragglers, float(straggler_ratio)
        self._hosts: list[str] = []  # host name per rank, gathered at setup (with stragglers)
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
        if several and self.stragglers is not None:  # every rank, in the same order: one gather
            self._hosts = [""] * _dist.get_world_size()
            torch.distributed.all_gather_object(self._hosts, socket.gethostname())
        if self.collector is None:
            self.collector = Collector(**self._collector_args, stragglers=self.stragglers)
            if self.on_epoch:
                self.stage_collectors = {
                    stage: Collector(**self._collector_args, stage=stage) for stage in STAGE_PREFIXES
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
            self.stage_collectors["validate"].discard()

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
        step = _iterations_done(trainer) if step is None else step
        metrics = self._metrics(collector, self.prefix + ("" if stage is None else STAGE_PREFIXES[stage]))
        if stage is None and len(self._hosts) > 1:
            metrics.update(self._stragglers(collector, step))
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
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
        sketched = re.compile(self.quantiles or "(?!)")
        for name in collector.updated():
            if math.isnan(values[name]["mean"]):
                continue
            for stat in self.stats:
                key = prefix + name if stat == "mean" else f"{prefix}{name}/{stat}"
                if stat in _STATS:
                    metrics[key] = float(values[name][stat])
                elif sketched.fullmatch(name):
                    metrics[key] = collector.quantile(name, float(stat[1:]) / 100.0)
        return metrics

    def _stragglers(self, collector: Collector, step: int) -> dict[str, float]:
        """The slowest rank and its ratio to the median rank of each straggler name with values;
        the log line where the ratio reaches ``straggler_ratio``."""
        metrics: dict[str, float] = {}
        pattern = re.compile(self.stragglers or "(?!)")
        for name in collector.updated():
            slowest = collector.straggler(name) if pattern.fullmatch(name) else None
            if slowest is None:
                continue
            metrics[f"{self.prefix}{name}/slowest_rank"] = float(slowest.rank)
            metrics[f"{self.prefix}{name}/slowest_ratio"] = slowest.ratio
            if slowest.ratio >= self.straggler_ratio:
                where = f"rank {slowest.rank} (host {self._hosts[slowest.rank]})"
                times = f"{slowest.mean:.4g} = {slowest.ratio:.2f}x the median rank ({slowest.median:.4g})"
                rank_zero_info(f"Slowest rank at iteration={step}: {where}, {name} {times}")
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
