"""``TrainingStats``: flush :mod:`lightning_ext.stats` to every Lightning logger and ``callback_metrics``."""

from __future__ import annotations

import contextlib
import difflib
import functools
import re
import socket
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ext import distributed as _dist
from lightning_ext._checks import check_bool, check_int, check_number, check_regex
from lightning_ext.callbacks.hook_base import _iterations_done
from lightning_ext.callbacks.iteration_timer import IterationTimer
from lightning_ext.callbacks.throughput import _SEC_PER_SAMPLE
from lightning_ext.kernels import get_backend
from lightning_ext.stats import Collector, LogHistogram, init_multiprocessing, report, set_stage

__all__ = ["TrainingStats"]

_STATS = ("mean", "std", "min", "max", "num")
_PERCENTILE = re.compile(r"p[1-9]\d?(\.\d+)?")  # "p1", "p50", "p99.9": a percentile in [1, 100)
_FLUSH_TIME_NAME = "Timing/stats_flush_sec"
_TIMER_NAMES = tuple(f"Timing/{part}_sec" for part in (
    "iteration", "data", "forward", "backward", "optimizer", "compute", "collective"))  # fmt: skip
_SUFFIXES = ("nonfinite", "straggler_rank", "straggler_ratio")  # keys a flush derives beside `stats`
_CHECK_AFTER = 3  # training flushes (or the first epoch) after which unmatched patterns are warned about
_WANDB_BINS = 512  # the most buckets a wandb.Histogram takes
_ARGUMENTS = (  # the arguments that are no collector's (the ranks must agree on them all)
    "every_n_train_steps", "stats", "prefix", "on_step", "on_epoch", "stragglers", "straggler_excess",
    "straggler_min_sec", "straggler_patience",
)  # fmt: skip
# Lightning's stages whose values are collected apart, and what their statistics are logged under
STAGE_PREFIXES = {"validate": "val/", "test": "test/"}


def _check_stats(stats: Any, quantiles: str | None) -> tuple[str, ...]:
    """``stats`` as a tuple, else the error naming it (see :class:`TrainingStats`)."""
    if isinstance(stats, str) or not isinstance(stats, Iterable):
        got = f"the str {stats!r}" if isinstance(stats, str) else repr(stats)
        raise TypeError(f"TrainingStats: `stats` must be a sequence of names, not {got}")
    stats = tuple(stats)

    bad = [s for s in stats if s not in _STATS and not (isinstance(s, str) and _PERCENTILE.fullmatch(s))]
    if not stats or bad:
        close = difflib.get_close_matches(str(bad[0]), _STATS, n=1) if bad else []
        hint = (
            f"did you mean {close[0]!r}?"
            if close
            else "'p0.99' would be ambiguous (the 0.99th "
            "percentile or the quantile 0.99): write 'p99' for the 99th percentile"
        )
        raise ValueError(
            f"TrainingStats: `stats` must be a non-empty sequence of {_STATS} and percentiles 'p<P>' "
            f"with 1 <= P < 100 (e.g. 'p99.9'), got {stats!r}. HINT: {hint}"
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
    step ``every_n_train_steps - 1``, as Lightning's ``log_every_n_steps`` row of that batch; the
    epoch-end flush at the step of the epoch's last iteration, where Lightning writes the
    ``self.log(on_epoch=True)`` values of that epoch.

    Stages. While Lightning runs validation, test or predict, the callback sets that stage
    (:func:`~lightning_ext.stats.set_stage`): a ``report()`` in a ``forward`` that serves every loop
    files validation values apart from training ones, until the next training hook (or the end of a
    ``validate``/``test``/``predict`` call): a LightningModule's ``on_validation_end`` runs after the
    callbacks'. With ``on_epoch``, the values of each validation run are written at its end (not for
    the sanity check, whose values are dropped), under ``prefix + "val/" + name``; those of a test run
    under ``prefix + "test/" + name``; those of predict are not collected. A LightningModule's
    ``on_*_epoch_end`` runs after the callbacks' too: what it (or ``on_validation_end``) reports after
    an epoch-end flush is written at the same step, at the next training hook or the call's end (for
    ``ModelCheckpoint``/``EarlyStopping`` at the next epoch end). A flush writes only the names that
    received values since the previous flush of their stage: a name is never written twice for the
    same values.

    Agreement. Every flush passes its step to :meth:`Collector.update
    <lightning_ext.stats.Collector.update>`, so ranks that flush at different steps raise on every rank
    naming them; ``setup`` checks that every rank's ``TrainingStats`` has the same arguments (with the
    host names, one ``all_gather_object``), before any flush could meet another rank's collectives.

    Non-finite values. The statistics of a name are those of its finite values; a flush where some of
    its values were NaN or ``±inf`` also writes ``name + "/nonfinite"``, their count over all ranks, and
    warns once per name (rank zero); a later flush where the name had values and none of them was
    non-finite writes no such key, and sets it to 0 in ``trainer.callback_metrics`` (what
    ``ModelCheckpoint`` and ``EarlyStopping`` monitor). A name whose values were all non-finite is
    written with ``num`` 0 and NaN for the other statistics.

    Keys. A reported name that equals a key a flush derives from another name (``"Loss/std"`` beside
    ``"Loss"`` with ``"std"`` in ``stats``, ``"Loss/nonfinite"``, ``"Loss/straggler_rank"``, ...) raises a
    ``ValueError`` on every rank at the first flush that knows both. ``Timing/stats_flush_sec`` is this
    callback's own: every ``TrainingStats`` reports the time of its flushes under it, and a value you
    report under that name joins them.

    Percentiles. ``stats`` may ask for percentiles, ``"p50"``, ``"p99"``, ``"p99.9"``, written as
    ``name + "/p50"`` for the names ``quantiles`` matches (the others get the other statistics), from
    a sketch with relative accuracy ``relative_accuracy`` over ``value_range`` that rides in the
    flush's SUM all-reduce (:class:`~lightning_ext.stats.LogHistogram`: at most 5 KiB per name). With a
    ``TensorBoardLogger`` (``WandbLogger``) each of these names' merged sketch is also written as a
    TensorBoard (W&B) histogram ``name + "/hist"`` (:meth:`~lightning_ext.stats.Collector.histogram`;
    no extra collective). With a ``TensorBoardLogger`` and ``google-crc32c`` installed (the
    ``tensorboard`` extra), ``setup`` has TensorBoard's event writer checksum its records with that C
    CRC32C, once per process: the same checksums as TensorBoard's own pure-Python ones, at a fraction
    of the time its writer thread holds the GIL for them.

    The straggler. For each name ``stragglers`` matches that received values, a flush with several
    processes writes ``name + "/straggler_rank"``, the rank whose mean was the largest, and
    ``name + "/straggler_ratio"``, its mean over the median of the ranks' means (the rank rides in the
    flush's MAX all-reduce, the ranks' means in a sketch: no extra collective, nothing per rank). It
    logs on rank zero when the same rank's excess over the median was at least ``straggler_excess``
    times the iteration time (the mean of ``Timing/iteration_sec``) and at least ``straggler_min_sec``
    at ``straggler_patience`` flushes in a row::

        Straggler at iteration=24: rank 1 (host n3), Timing/compute_sec 0.06 = 4.9x the median rank (0.012)

    The default names are :class:`~lightning_ext.callbacks.IterationTimer`'s ``Timing/data_sec`` (a
    slow data loader) and ``Timing/compute_sec`` (a rank slow in its forward, backward or optimizer
    step, net of the waits in the collectives, where the fast ranks wait for the slow one), and
    :class:`~lightning_ext.callbacks.Throughput`'s ``Throughput/sec_per_sample``: its slowest rank
    (the lowest samples/s) gets no line of its own, its keys, and a tail on each line printed
    (``; slowest by throughput: rank 0 (412 samples/s = 0.87x the median rank)``). Host names are
    gathered once, at ``setup``.

    Contributors. A callback of the Trainer that defines ``before_stats_flush()``,
    ``stats_flush_metrics(collector)``, ``after_stats_flush()`` and ``stats_flush_names`` (the names the
    first reports: :class:`~lightning_ext.callbacks.Throughput`) takes part in every training flush of
    the one ``TrainingStats`` whose ``regex`` matches any of those names, on every rank: the first is
    called right before the collector's update (it ``report()``-s its values of the interval since that
    callback's previous flush), the second after it, and returns keys derived from the reduced values
    (identical on every rank), written with the others (behind ``prefix``); the third when the flush
    ends, its writes to the loggers done (also when it raised). A publication of what was reported
    after an epoch-end flush (below) calls the first with ``late=True`` (it reports nothing then) and
    the third. Several ``TrainingStats`` collecting its names raise at ``setup`` (the flushes of each
    would cut the others' intervals), and so does a contributor that comes after it in ``callbacks``
    (its count of a batch would come after that batch's flush). The contributors' ``repr`` is among the
    arguments the ranks must agree on at ``setup``.

    Warnings, once, on rank zero: straggler names of ``IterationTimer`` asked for on several
    processes without it in the callbacks (at the start of training), and a pattern (``regex``,
    ``quantiles``, ``stragglers``) that matched no reported name after three training flushes or
    the first epoch.

    Args:
        every_n_train_steps: flush period in iterations (``>= 1``).
        regex: names to collect (``re.fullmatch``).
        stats: statistics to log, a non-empty sequence of ``"mean"``, ``"std"``, ``"min"``,
            ``"max"``, ``"num"`` and percentiles ``"p<P>"`` (``1 <= P < 100``, e.g. ``"p99.9"``; not
            ``"p0.99"``, which could mean a quantile).
        prefix: prepended to every logged key.
        on_step: flush every ``every_n_train_steps`` iterations.
        on_epoch: flush at the end of validation and training epochs.
        keep_previous: passed to ``Collector``.
        quantiles: names whose percentiles are written (``re.fullmatch``); ``None``: none.
        relative_accuracy: the percentiles' sketch's relative accuracy (``Collector``).
        value_range: the magnitudes the percentiles' sketch covers with it (``Collector``).
        stragglers: names whose straggler is written (``re.fullmatch``); ``None``: none.
        straggler_excess: the fraction of the iteration time (``>= 0``) from which the straggler's
            excess over the median rank counts.
        straggler_min_sec: the seconds (``>= 0``) from which that excess counts.
        straggler_patience: the flushes in a row (``>= 1``) at which it must count before a line.
        forget_after: passed to ``Collector``: flushes in a row without values after which a name is
            forgotten (``None``: never); the publication of late values at an epoch-end flush's step
            is no flush.

    Raises:
        ValueError: ``every_n_train_steps < 1``, ``stats`` is empty or holds an unknown statistic or
            a percentile without ``quantiles``, a pattern does not compile, a sketch or straggler
            parameter is out of range (at construction); the ranks' arguments differ, or several
            ``TrainingStats`` collect a contributor's names (at ``setup``, on every rank); a reported
            name equals a derived key (at a flush, on every rank).
        TypeError: ``every_n_train_steps`` or ``straggler_patience`` is not an int, ``regex``/``prefix``
            is not a str, ``stats`` is a str, ``on_step``/``on_epoch``/``keep_previous`` is not a
            bool, ``quantiles`` or ``stragglers`` neither a str nor None, ``straggler_excess`` or
            ``straggler_min_sec`` not a finite number (at construction); a contributor has no
            ``stats_flush_names`` (at ``setup``).

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
        stragglers: str | None = "Timing/(data|compute)_sec|Throughput/sec_per_sample",
        straggler_excess: float = 0.2,
        straggler_min_sec: float = 0.005,
        straggler_patience: int = 2,
        forget_after: int | None = 100,
    ) -> None:
        check_int("TrainingStats", "every_n_train_steps", every_n_train_steps, ge=1)
        check_number("TrainingStats", "straggler_excess", straggler_excess, ge=0.0)
        check_number("TrainingStats", "straggler_min_sec", straggler_min_sec, ge=0.0)
        check_int("TrainingStats", "straggler_patience", straggler_patience, ge=1)
        stats = _check_stats(stats, quantiles)
        self._collector_args = {  # checked below
            "regex": regex, "keep_previous": keep_previous, "quantiles": quantiles,
            "relative_accuracy": relative_accuracy, "value_range": value_range, "forget_after": forget_after,
        }  # fmt: skip
        if not isinstance(prefix, str):
            raise TypeError(f"TrainingStats: `prefix` must be a str, got {prefix!r}")
        for name, flag in (("on_step", on_step), ("on_epoch", on_epoch), ("keep_previous", keep_previous)):
            check_bool("TrainingStats", name, flag)
        for arg, pattern in (("regex", regex), ("quantiles", quantiles), ("stragglers", stragglers)):
            if pattern is not None or arg == "regex":
                check_regex("TrainingStats", arg, pattern)
        LogHistogram(relative_accuracy, value_range)  # checks them
        check_int("TrainingStats", "forget_after", forget_after, ge=1, optional=True)
        self.quantiles, self.stragglers = quantiles, stragglers
        self.straggler_excess, self.straggler_min_sec = float(straggler_excess), float(straggler_min_sec)
        self.straggler_patience = straggler_patience
        self._hosts: list[str] = []  # host name per rank, gathered at setup (with stragglers)
        self._runs: dict[str, tuple[int, int]] = {}  # straggler name => (rank, flushes in a row it counted)
        self._warned: set[str] = set()  # names whose non-finite values were said
        self._checked: dict[str | None, list[str]] = {}  # stage => the names whose keys were checked last
        self._flushes = 0  # training flushes so far
        self._unchecked = {"regex", "quantiles", "stragglers"}  # patterns not checked for matches yet
        self.every_n_train_steps, self.regex, self.stats = every_n_train_steps, regex, stats
        self.prefix = prefix
        self.on_step, self.on_epoch, self.keep_previous = on_step, on_epoch, keep_previous
        self.collector: Collector | None = None  # the training values
        self.stage_collectors: dict[str, Collector] = {}  # stage => its values (with ``on_epoch``)
        self._outer_stage: str | None = None  # the stage set before a loop's
        self._inside: str | None = None  # the loop's stage this callback set (until _leave)
        self._late: tuple[str | None, int] | None = None  # (stage, step) of the last epoch-end flush
        self._flush_sec: float | None = None  # the last flush's time, reported at the next one
        self.last_flush_step = -1  # iterations done at the last step-triggered flush
        self._iterations: int | None = None  # iterations done in this fit (None: read at its start)
        self._fitting = True  # the stage set up is a fit (a checkpoint loaded is its state)
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
        self._fitting = stage == "fit"  # (validate/test with a ckpt_path load no training state)
        if self._fitting:  # a new fit counts its iterations from its start (a resume: its checkpoint's)
            self.last_flush_step, self._iterations, self._runs = -1, None, {}
        several = _dist.is_distributed() and _dist.get_world_size() > 1
        init_multiprocessing(
            rank=trainer.global_rank, sync_device=_dist.collective_device() if several else None
        )
        if several:  # every rank, in the same order: one gather of (host, arguments)
            self._agree(trainer)
        _check_contributors(trainer)  # (after the agreement: every rank raises alike)
        untimed = not any(isinstance(c, IterationTimer) for c in trainer.callbacks) and any(
            re.fullmatch(self.stragglers or "(?!)", name) for name in _TIMER_NAMES
        )  # asks for the timer's names without it
        if several and untimed and "stragglers" in self._unchecked:
            hint = "HINT: add IterationTimer() first to `callbacks`, or pass stragglers=None."
            rank_zero_warn(f"TrainingStats: `stragglers`={self.stragglers!r} asks for IterationTimer's "
                           f"timings, but the Trainer has none: no rank is named. {hint}")  # fmt: skip
        if not several or untimed:  # said above, or no straggler on one process
            self._unchecked.discard("stragglers")
        if trainer.is_global_zero and any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers):
            _fast_tensorboard_checksums()
        for device in {torch.device("cpu"), pl_module.device} - {torch.device("meta")}:  # the kernels
            get_backend(device=device)  # load now, in the start-up (a second at the first flush)
        # New collectors at every setup (clear_statistics() between Trainers detaches the old ones), with
        # what the old ones published (keep_previous), or what a checkpoint loaded before setup holds
        carried = self._pending_state or (self.state_dict() if self.collector is not None else None)
        self.collector = Collector(**self._collector_args, stragglers=self.stragglers)
        if self.on_epoch:
            self.stage_collectors = {
                stage: Collector(**self._collector_args, stage=stage) for stage in STAGE_PREFIXES
            }
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
            self._pending_state = None
        elif carried is not None:
            self._load_collectors(carried)

    def _agree(self, trainer: pl.Trainer) -> None:
        """Gather every rank's host name and arguments; raise on every rank unless the arguments agree."""
        mine = {**self._collector_args, **{arg: getattr(self, arg) for arg in _ARGUMENTS}}
        mine["contributors"] = tuple(repr(c) for c in _contributors(trainer, self.regex))  # into the flush
        rows: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(rows, (socket.gethostname(), mine))
        self._hosts = [host for host, _ in rows]
        said = []
        for arg in mine:
            ranks: dict[Any, list[int]] = {}
            for rank, (_, arguments) in enumerate(rows):
                ranks.setdefault(arguments[arg], []).append(rank)
            if len(ranks) > 1:
                said.append(
                    f"{arg}=" + ", ".join(f"{value!r} on ranks {r[:16]}" for value, r in ranks.items())
                )
        if said:
            raise ValueError(
                f"TrainingStats: the ranks' arguments differ: {'; '.join(said)}; their flushes would not "
                "meet. "
                "HINT: give every rank the same TrainingStats arguments"
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped, self._global_step = trainer.global_step != self._global_step, trainer.global_step
        if not stepped:  # (a micro-batch that accumulated, or a training_step that did not step)
            return
        self._iterations += 1  # (Lightning's count of batches: of every batch in manual optimization)
        if self.on_step and self._iterations % self.every_n_train_steps == 0:
            self.last_flush_step = self._iterations
            self.flush(trainer)  # at Lightning's step for this batch: _iterations_done(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(trainer)
        self._global_step = trainer.global_step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._leave(trainer)
        if self._iterations is None:  # Lightning's count, restored on resume: read at the first batch
            self._iterations = _iterations_done(trainer)  # (a mid-epoch resume's after on_train_start)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(trainer, late=False)  # (the later callbacks' on_train_end may report: teardown writes)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._leave(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "validate")

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "test")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(trainer, "predict")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._late = None  # (no collective now: the other ranks may be gone)
        self._leave(trainer)  # a loop that raised leaves no stage behind

    def _enter(self, trainer: pl.Trainer, stage: str) -> None:
        """Have ``report()`` file values under ``stage`` until :meth:`_leave` (the late values of the
        previous epoch-end flush written first). Several ``TrainingStats`` alike: the first that enters
        keeps the stage outside."""
        self._leave(trainer)
        previous = set_stage(stage)
        if previous != stage:
            self._outer_stage = previous
        self._inside = stage

    def _leave(self, trainer: pl.Trainer, late: bool = True) -> None:
        """Write what was reported after the last epoch-end flush (a LightningModule's ``on_*_epoch_end``
        and ``on_*_end``, which run after the callbacks') at its step (unless not ``late``), then go back
        to the stage outside the loop; nothing to do, nothing done. The same on every rank (a
        collective when late)."""
        if late and self._late is not None:
            (stage, step), self._late = self._late, None
            with _flushing(_contributors(trainer, self.regex), late=True):  # (no values of theirs)
                self._publish(trainer, stage, step)
        if self._inside is not None:
            current = set_stage(self._outer_stage)
            if current != self._inside:  # another TrainingStats left it first: what it restored stays
                set_stage(current)
            self._inside = None

    @override
    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "validate" in self.stage_collectors:
            self.stage_collectors["validate"].discard()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch and not trainer.sanity_checking:
            self._flush_epoch(trainer, "validate")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_epoch:
            self._flush_epoch(trainer, "test")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(trainer)  # (a validation run at the epoch's end)
        if self.on_epoch:
            self._flush_epoch(trainer, None)
        if self._flushes:
            self._warn_unmatched()

    def _flush_epoch(self, trainer: pl.Trainer, stage: str | None) -> None:
        """The epoch-end flush of ``stage``; what is reported after it is written at ``_leave``. At
        Lightning's step for that epoch's ``on_epoch`` values: a validation's, or the training epoch's
        last iteration (Lightning writes the training epoch's one step below the iterations done)."""
        step = max(_iterations_done(trainer) - (stage is None), 0)
        self.flush(trainer, step, stage)
        self._late = (stage, step)

    def _warn_unmatched(self) -> None:
        """Warn, once and on rank zero, about each pattern that matched no reported name."""
        for arg, names in self.collector.unmatched().items():
            if arg in self._unchecked:
                rank_zero_warn(
                    f"TrainingStats: `{arg}`={getattr(self, arg)!r} matched none of the names reported so "
                    f"far (re.fullmatch): {names[:20]}. HINT: check the pattern; nothing is written for it."
                )
        self._unchecked.clear()

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
        ``ModelCheckpoint``/``EarlyStopping``), and the sketched names' histograms to the TensorBoard
        and W&B loggers (rank zero); to a ``TensorBoardLogger`` whose ``log_metrics`` is Lightning's,
        without a ``prefix``, all of it as one event (the same values). Its wall time is ``report()``-ed as
        ``Timing/stats_flush_sec`` at the next flush (in its interval). Must run on every rank, at the same
        ``step``: ``Collector.update(step=step)`` runs collectives and checks it. Synchronizes host and
        device once.

        Raises:
            RuntimeError: called before the Trainer ran ``setup`` (no collector yet); the ranks'
                collectors or steps differ (on every rank, naming them).
            ValueError: ``stage`` is not ``None`` or a stage collected here (``"validate"``,
                ``"test"`` with ``on_epoch``); a reported name equals a key derived from another one.
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
        start = time.perf_counter()
        if self._flush_sec is not None:  # the previous flush's own time, a training statistic
            outer = set_stage(None)
            report(_FLUSH_TIME_NAME, self._flush_sec)
            set_stage(outer)
        step = _iterations_done(trainer) if step is None else step
        contributors = _contributors(trainer, self.regex) if stage is None else None
        with _flushing(contributors or []):  # (the writes to the loggers included)
            metrics = self._publish(trainer, stage, step, contributors)
        self._flush_sec = time.perf_counter() - start
        self._flushes += stage is None
        if self._flushes == _CHECK_AFTER:
            self._warn_unmatched()
        return metrics

    def _publish(
        self, trainer: pl.Trainer, stage: str | None, step: int, contributors: list[Any] | None = None
    ) -> dict[str, float]:
        """Update the collector of ``stage`` and write its statistics at ``step`` (with ``contributors``,
        a training flush's derived keys too); what was written."""
        collector = self.collector if stage is None else self.stage_collectors[stage]
        collector.update(step=step)
        self._check_keys(collector)
        prefix = self.prefix + ("" if stage is None else STAGE_PREFIXES[stage])
        metrics = self._metrics(collector, prefix, step)
        if contributors is not None:
            metrics.update(self._derived(collector, step, contributors))
        self._write(trainer, collector, metrics, self._histograms(trainer, collector, prefix), step)
        if metrics:
            values = torch.tensor(list(metrics.values()), dtype=torch.float32)  # views of one tensor:
            trainer.callback_metrics.update(zip(metrics, values.unbind()))  # a fifth of one tensor a key
        if self._warned:  # a count of non-finite values no longer true: 0 for the monitors (not logged)
            keys = {f"{prefix}{name}/nonfinite" for name in collector.updated()} - metrics.keys()
            stale = keys & trainer.callback_metrics.keys()
            trainer.callback_metrics.update((key, torch.tensor(0.0)) for key in stale)
        return metrics

    def _check_keys(self, collector: Collector) -> None:
        """``ValueError`` (on every rank: the names are agreed) when a name equals a key derived from
        another one; checked when the names change."""
        names = collector.names()
        if names == self._checked.get(collector.stage):
            return
        suffixes = [s for s in self.stats if s != "mean"] + list(_SUFFIXES)
        known = set(names)
        clashes = [(n, f"{n}/{x}") for n in names for x in suffixes if f"{n}/{x}" in known]
        if clashes:
            said = ", ".join(f"{key!r} (reported, and derived from {name!r})" for name, key in clashes[:5])
            raise ValueError(
                f"TrainingStats: the keys {said} would be written twice at one step. HINT: rename the "
                "reported name (e.g. 'Loss/std_dev' for 'Loss/std')"
            )
        self._checked[collector.stage] = names

    def _metrics(self, collector: Collector, prefix: str, step: int) -> dict[str, float]:
        """``{prefix + name[/stat]: value}`` of the names that received values in the last interval."""
        metrics: dict[str, float] = {}
        values = collector.as_dict()
        sketched = re.compile(self.quantiles or "(?!)")
        percentiles = [stat for stat in self.stats if stat not in _STATS]
        for name in collector.updated():
            for stat in self.stats:
                key = prefix + name if stat == "mean" else f"{prefix}{name}/{stat}"
                if stat in _STATS:
                    metrics[key] = float(values[name][stat])
            if percentiles and sketched.fullmatch(name):  # one pass over the sketch for all of them
                qs = collector.quantile(name, [float(stat[1:]) / 100.0 for stat in percentiles])
                metrics.update((f"{prefix}{name}/{stat}", q) for stat, q in zip(percentiles, qs))
            bad = collector.nonfinite(name)
            if bad:
                metrics[f"{prefix}{name}/nonfinite"] = float(bad)
                if name not in self._warned:
                    self._warned.add(name)
                    rank_zero_warn(
                        f"TrainingStats: {name!r} had {bad} non-finite values (NaN or ±inf) at "
                        f"iteration={step} "
                        f"beside {values[name]['num']} finite ones: its statistics are those of the finite "
                        f"values, and '{prefix}{name}/nonfinite' counts the others at every flush that has "
                        "any "
                        "(said once per name)."
                    )
        return metrics

    def _derived(self, collector: Collector, step: int, contributors: list[Any]) -> dict[str, float]:
        """The keys a training flush derives: the stragglers' and those of the contributors."""
        metrics = self._stragglers(collector, step) if len(self._hosts) > 1 else {}
        for contributor in contributors:
            metrics.update(
                {self.prefix + k: v for k, v in contributor.stats_flush_metrics(collector).items()}
            )
        return metrics

    def _stragglers(self, collector: Collector, step: int) -> dict[str, float]:
        """The straggler and its ratio to the median rank of each straggler name with values; the log
        line where its excess counted at ``straggler_patience`` flushes in a row."""
        metrics: dict[str, float] = {}
        pattern = re.compile(self.stragglers or "(?!)")
        means = [collector.mean(n) for n in ("Timing/iteration_sec",) if n in collector.names()]
        floor = max(self.straggler_min_sec, self.straggler_excess * sum(m for m in means if m == m))  # no NaN
        stragglers = {n: collector.straggler(n) for n in collector.updated() if pattern.fullmatch(n)}
        lines, slowest = [], stragglers.get(_SEC_PER_SAMPLE)  # by throughput: said in the others' lines
        runs, self._runs = self._runs, {}  # a flush without a name's values ends its run
        for name, straggler in stragglers.items():
            if straggler is None:
                continue
            metrics[f"{self.prefix}{name}/straggler_rank"] = float(straggler.rank)
            metrics[f"{self.prefix}{name}/straggler_ratio"] = straggler.ratio
            if name == _SEC_PER_SAMPLE:
                continue
            rank, count = runs.get(name, (-1, 0))
            counted = straggler.mean - straggler.median >= floor
            count = (count + 1 if rank == straggler.rank else 1) if counted else 0
            self._runs[name] = (straggler.rank, count)
            if count >= self.straggler_patience:
                where = f"rank {straggler.rank} (host {self._hosts[straggler.rank]})"
                times = (
                    f"{straggler.mean:.4g} = {straggler.ratio:.2f}x the median rank ({straggler.median:.4g})"
                )
                lines.append(f"Straggler at iteration={step}: {where}, {name} {times}, {count} flushes")
        tail = (
            ""
            if slowest is None
            else (
                f"; slowest by throughput: rank {slowest.rank} ({1 / slowest.mean:.4g} samples/s = "
                f"{1 / slowest.ratio:.2f}x the median rank)"
            )
        )
        for line in lines:
            rank_zero_info(line + tail)
        return metrics

    def _histograms(self, trainer: pl.Trainer, collector: Collector, prefix: str) -> list[tuple[str, str]]:
        """``(name, tag)`` of each sketched name with values in the last interval (rank zero's)."""
        if not (trainer.is_global_zero and self.quantiles):
            return []
        sketched = filter(re.compile(self.quantiles).fullmatch, collector.updated())
        return [(name, f"{prefix}{name}/hist") for name in sketched]

    @staticmethod
    def _write(trainer: pl.Trainer, collector: Collector, metrics: dict[str, float],
               histograms: list[tuple[str, str]], step: int) -> None:  # fmt: skip
        """``metrics`` to every logger and the ``histograms`` to the TensorBoard and W&B ones: to a
        plain ``TensorBoardLogger`` as one event (:func:`_tensorboard_writer`), else through
        ``log_metrics`` (and one histogram a call)."""
        for logger in trainer.loggers:
            writer = _tensorboard_writer(logger) if trainer.is_global_zero else None
            if writer is not None:
                _write_event(writer, collector, metrics, histograms, step)
                continue
            if metrics:
                logger.log_metrics(metrics, step=step)
            for name, tag in histograms if isinstance(logger, TensorBoardLogger | WandbLogger) else ():
                _log_histogram(logger, collector, name, tag, step)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.collector is None:
            return self._pending_state or {
                "last_flush_step": self.last_flush_step, "iterations": self._iterations, "collector": None
            }
        stages = {stage: c.state_dict() for stage, c in self.stage_collectors.items()}
        return {
            "last_flush_step": self.last_flush_step,
            "iterations": self._iterations,
            "collector": self.collector.state_dict(),
            "stages": stages,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._fitting:  # validate/test(ckpt_path=...): the training statistics stay
            return
        self.last_flush_step = int(state_dict["last_flush_step"])
        self._iterations = state_dict.get("iterations")  # (None: a checkpoint without it)
        if self.collector is None:  # before setup made the collectors: loaded by setup
            self._pending_state = state_dict
            return
        self._load_collectors(state_dict)

    def _load_collectors(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("collector") is not None:
            self.collector.load_state_dict(state_dict["collector"])
        for stage, state in state_dict.get("stages", {}).items():
            if stage in self.stage_collectors:
                self.stage_collectors[stage].load_state_dict(state)


@contextlib.contextmanager
def _flushing(contributors: list[Any], late: bool = False) -> Iterator[None]:
    """The contributors' part of a flush: ``before_stats_flush(late=late)`` (with ``late``, their time
    only: no values of theirs), then the block, then ``after_stats_flush()``, also when it raised."""
    for contributor in contributors:
        contributor.before_stats_flush(late=late)
    try:
        yield
    finally:
        for contributor in contributors:
            contributor.after_stats_flush()


def _contributors(trainer: pl.Trainer, regex: str | None = None) -> list[Any]:
    """The callbacks that report into a training flush (:class:`~lightning_ext.callbacks.Throughput`):
    with ``regex``, those that report a name it matches (the flushes of the ``TrainingStats`` of that
    ``regex`` call them)."""
    found = [c for c in trainer.callbacks if callable(getattr(c, "stats_flush_metrics", None))]
    if regex is None:
        return found
    return [c for c in found if any(re.fullmatch(regex, n) for n in getattr(c, "stats_flush_names", ()))]


def _check_contributors(trainer: pl.Trainer) -> None:
    """``TypeError`` for a contributor without its names, ``ValueError`` for one whose names several
    ``TrainingStats`` collect (each of their flushes would report its interval and start the next, so
    every collector but the most frequent would derive rates from pieces of its interval) or that
    comes after the one that collects them."""
    stats = [cb for cb in trainer.callbacks if isinstance(cb, TrainingStats)]
    for contributor in _contributors(trainer):
        names, kind = getattr(contributor, "stats_flush_names", None), type(contributor).__name__
        if not callable(getattr(contributor, "after_stats_flush", None)):
            raise TypeError(
                f"TrainingStats: the callback {kind} defines stats_flush_metrics() but no "
                "after_stats_flush(): a contributor defines both (called when the flush ends)"
            )
        if not isinstance(names, tuple | list) or not names or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"TrainingStats: the callback {kind} defines stats_flush_metrics() but its "
                f"`stats_flush_names` is {names!r}: it must be a non-empty tuple of the names its "
                "before_stats_flush() reports (the TrainingStats whose regex matches them calls it)"
            )
        takers = [cb for cb in stats if contributor in _contributors(trainer, cb.regex)]
        if len(takers) > 1:
            exclude = "|".join(sorted({n.split("/")[0] + "/" for n in names}))
            raise ValueError(
                f"TrainingStats: {len(takers)} TrainingStats collect names that {kind} reports at a flush "
                f"(regex={[cb.regex for cb in takers]}): each flush would report its interval and start "
                f"the next, so the others' rates would be wrong. HINT: one TrainingStats collects them; "
                f"exclude them from the others, e.g. regex='(?!{exclude}).*'"
            )
        if takers and trainer.callbacks.index(contributor) > trainer.callbacks.index(takers[0]):
            raise ValueError(
                f"TrainingStats: {kind} comes after the TrainingStats that collects its names in "
                "`callbacks`: Lightning calls their on_train_batch_end in that order, so a flush there "
                f"would miss the batch {kind} counts then (every interval one batch late). HINT: put "
                f"{kind} first"
            )


def _masked_crc32c(crc32c: Callable[[bytes], int], data: bytes) -> int:
    """TensorBoard's ``masked_crc32c`` (its rotation and offset of the CRC32C) of ``crc32c(data)``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@functools.cache
def _fast_tensorboard_checksums() -> bool:
    """Whether TensorBoard's event writer checksums its records with ``google-crc32c``'s C CRC32C: made
    so here, once per process, where that library is installed with its C extension. Without
    TensorFlow, TensorBoard computes each record's masked CRC32C (TFRecord's framing) in pure Python,
    about 0.3 µs a byte in its writer thread, holding the GIL: milliseconds of the training loop's time
    for a flush with histograms. The same checksums (``test_training_stats.py`` compares them); every
    TensorBoard writer of the process gains."""
    try:
        with warnings.catch_warnings():  # (its pure-Python fallback warns at import: not used then)
            warnings.simplefilter("ignore", RuntimeWarning)
            import google_crc32c
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", None) != "c":
        return False
    if getattr(record_writer, "masked_crc32c", None) is pywrap_tensorflow.masked_crc32c:
        record_writer.masked_crc32c = functools.partial(_masked_crc32c, google_crc32c.value)  # (else: left)
    return getattr(getattr(record_writer, "masked_crc32c", None), "func", None) is _masked_crc32c


def _tensorboard_writer(logger: Any) -> Any:
    """``logger``'s ``torch.utils.tensorboard.SummaryWriter`` when a flush writes its scalars and
    histograms to it as ONE event (:func:`_write_event`): a ``TensorBoardLogger`` whose ``log_metrics``
    is Lightning's (not overridden), without a ``prefix``, writing with torch's writer; else ``None``.
    Lightning's ``log_metrics`` writes an event per key, and its writer's queue holds 10: 100 keys cost
    a flush milliseconds of waiting for the writer thread (``bench_stats.py``). Rank zero only."""
    plain = type(logger).log_metrics is TensorBoardLogger.log_metrics and not getattr(logger, "_prefix", "?")
    if not (isinstance(logger, TensorBoardLogger) and plain):
        return None
    from torch.utils.tensorboard import SummaryWriter

    writer = logger.experiment
    return writer if isinstance(writer, SummaryWriter) else None


def _write_event(writer: Any, collector: Collector, metrics: dict[str, float],
                 histograms: list[tuple[str, str]], step: int) -> None:  # fmt: skip
    """One TensorBoard event at ``step`` holding the scalars ``metrics`` (``{tag: value}``) and the
    ``histograms`` (``(name, tag)``: the name's sketch, as :func:`_log_histogram`): the values
    ``add_scalar`` and ``add_histogram_raw`` would write as one event each, read back alike."""
    from torch.utils.tensorboard.summary import Summary, histogram_raw  # (TensorBoard's proto, via torch)

    values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
    for name, tag in histograms:
        fields = _histogram_fields(collector, name)
        if fields is not None:
            values.append(histogram_raw(tag, **fields).value[0])
    if values:
        writer._get_file_writer().add_summary(Summary(value=values), step)


def _histogram_fields(collector: Collector, name: str) -> dict[str, Any] | None:
    """``name``'s histogram of the last interval (:meth:`Collector.histogram`) as TensorBoard's
    ``add_histogram_raw`` takes it, each run of empty buckets written as one empty bucket spanning them
    (a bucket is the range from the previous limit to its own: no bucket with values changes, and
    TensorBoard checksums every byte in Python); ``None`` without values."""
    counts, edges = collector.histogram(name)
    if not counts.size:
        return None
    kept = np.flatnonzero((counts != 0) | np.append(counts[1:] != 0, True))  # a run's last empty bucket
    num, mean, std = collector.num(name), collector.mean(name), collector.std(name)
    return dict(
        min=edges[0], max=edges[-1], num=int(counts.sum()), sum=num * mean,
        sum_squares=num * (std * std + mean * mean), bucket_limits=edges[1:][kept].tolist(),  # (** raises)
        bucket_counts=counts[kept].tolist(),
    )  # fmt: skip


def _log_histogram(logger: Any, collector: Collector, name: str, tag: str, step: int) -> None:
    """``name``'s histogram of the last interval (:meth:`Collector.histogram`) as a TensorBoard or W&B
    histogram ``tag`` at ``step``."""
    if isinstance(logger, TensorBoardLogger):
        fields = _histogram_fields(collector, name)
        if fields is not None:
            logger.experiment.add_histogram_raw(tag, **fields, global_step=step)
        return
    counts, edges = collector.histogram(name)
    if not counts.size:
        return
    import wandb  # the WandbLogger needs it

    starts = np.arange(0, counts.size, -(-counts.size // _WANDB_BINS))  # adjacent buckets merged
    merged = (np.add.reduceat(counts, starts), np.append(edges[starts], edges[-1]))
    logger.log_metrics({tag: wandb.Histogram(np_histogram=merged)}, step=step)
