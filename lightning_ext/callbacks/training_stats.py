"""``TrainingStats``: flush :mod:`lightning_ext.stats` to every Lightning logger and ``callback_metrics``."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ext import distributed as _dist
from lightning_ext.stats import Collector, init_multiprocessing, report

__all__ = ["TrainingStats"]

_STATS = ("mean", "std", "min", "max", "num")
FLUSH_TIME_NAME = "Timing/stats_flush_sec"


class TrainingStats(Callback):
    """Collect what the model ``report()``-s and log it, identical on every rank, every N optimizer steps.

    At ``setup`` it calls :func:`~lightning_ext.stats.init_multiprocessing` from the strategy (rank,
    and the collective device of the default process group when ``torch.distributed`` is
    initialized; single-process otherwise) and creates a :class:`~lightning_ext.stats.Collector`.
    Then, on every rank:

    * every ``every_n_train_steps`` optimizer steps (``trainer.global_step``, so accumulation
      micro-batches do not count) when ``on_step``;
    * at the end of each validation epoch (not the sanity check, whose values are dropped) and each
      training epoch when ``on_epoch``,

    it calls ``Collector.update()`` (two collectives in the steady state, see ``Collector``) and
    writes, for each collected name with values, the chosen statistics as ``prefix + name``
    (mean), ``prefix + name + "/std"``, ``"/min"``, ``"/max"``, ``"/num"`` to every logger in
    ``trainer.loggers`` (``log_metrics(metrics, step=trainer.global_step)``) and to
    ``trainer.callback_metrics`` as float32 0-dim CPU tensors, so ``ModelCheckpoint(monitor=...)``
    and ``EarlyStopping`` can monitor them. The values are the same on every rank because they come
    out of the same all-reduces. Each flush synchronizes host and device once; its wall time is
    ``report()``-ed as ``Timing/stats_flush_sec`` and appears in the next flush.

    Args:
        every_n_train_steps: flush period in optimizer steps (``>= 1``).
        regex: names to collect (``re.fullmatch``).
        stats: statistics to log, a non-empty sequence of ``"mean"``, ``"std"``, ``"min"``,
            ``"max"``, ``"num"``.
        prefix: prepended to every logged key.
        on_step: flush every ``every_n_train_steps`` optimizer steps.
        on_epoch: flush at the end of validation and training epochs.
        keep_previous: passed to ``Collector``.

    Raises:
        ValueError: ``every_n_train_steps`` is not a positive int, ``stats`` is empty or holds an
            unknown statistic, or ``regex`` does not compile.
        TypeError: ``regex``/``prefix`` is not a str, or ``stats`` is a str.

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
        if (
            isinstance(every_n_train_steps, bool)
            or not isinstance(every_n_train_steps, int)
            or every_n_train_steps < 1
        ):
            raise ValueError(
                f"TrainingStats(every_n_train_steps=...) must be an int >= 1, got {every_n_train_steps!r}"
            )
        if isinstance(stats, str):
            raise TypeError(f"TrainingStats(stats=...) must be a sequence of names, not the str {stats!r}")
        stats = tuple(stats)
        unknown = [s for s in stats if s not in _STATS]
        if not stats or unknown:
            raise ValueError(
                f"TrainingStats(stats=...) must be a non-empty subset of {_STATS}, got {stats!r}"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"TrainingStats(prefix=...) must be a str, got {prefix!r}")
        if not isinstance(regex, str):
            raise TypeError(f"TrainingStats(regex=...) must be a str, got {type(regex).__name__} {regex!r}")
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(
                f"TrainingStats(regex=...) is not a valid regular expression: {regex!r} ({err})"
            ) from None
        self.every_n_train_steps = every_n_train_steps
        self.regex = regex
        self.stats = stats
        self.prefix = prefix
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.keep_previous = keep_previous
        self.collector: Collector | None = None
        self.last_flush_step = -1  # global_step of the last step-triggered flush
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

    # ---------------------------------------------------------------------------------------- hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        sync_device = (
            _dist.collective_device() if _dist.is_distributed() and _dist.get_world_size() > 1 else None
        )
        init_multiprocessing(rank=trainer.global_rank, sync_device=sync_device)
        if self.collector is None:
            self.collector = Collector(regex=self.regex, keep_previous=self.keep_previous)
        if self._pending_state is not None:
            self.collector.load_state_dict(self._pending_state)
            self._pending_state = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.on_step and step > self.last_flush_step and step > 0 and step % self.every_n_train_steps == 0:
            self.last_flush_step = step
            self.flush(trainer)

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.collector is not None:
            self.collector._discard()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch and not trainer.sanity_checking:
            self.flush(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch:
            self.flush(trainer)

    # ---------------------------------------------------------------------------------------- flush

    def flush(self, trainer: pl.Trainer) -> dict[str, float]:
        """Update the collector on every rank and write the statistics; returns what was written.

        Must be called on every rank (it runs collectives). Synchronizes host and device.

        Raises:
            RuntimeError: called before the Trainer ran ``setup`` (no collector yet).
        """
        if self.collector is None:
            raise RuntimeError(
                "TrainingStats.flush() needs a Trainer that ran setup(); call trainer.fit/validate first"
            )
        start = time.perf_counter()
        self.collector.update()
        metrics: dict[str, float] = {}
        for name, values in self.collector.as_dict().items():
            if values["num"] == 0 or math.isnan(values["mean"]):
                continue
            for stat in self.stats:
                key = self.prefix + name if stat == "mean" else f"{self.prefix}{name}/{stat}"
                metrics[key] = float(values[stat])
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            callback_metrics = trainer.callback_metrics
            for key, value in metrics.items():
                callback_metrics[key] = torch.tensor(value, dtype=torch.float32)
        report(FLUSH_TIME_NAME, time.perf_counter() - start)
        return metrics

    # ---------------------------------------------------------------------------------------- state

    @override
    def state_dict(self) -> dict[str, Any]:
        collector = self.collector.state_dict() if self.collector is not None else self._pending_state
        return {"last_flush_step": self.last_flush_step, "collector": collector}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_flush_step = int(state_dict["last_flush_step"])
        collector_state = state_dict.get("collector")
        if collector_state is None:
            return
        if self.collector is not None:
            self.collector.load_state_dict(collector_state)
        else:
            self._pending_state = collector_state
