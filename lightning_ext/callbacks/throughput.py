"""``Throughput``: global samples/s and tokens/s, MFU/HFU and goodput, written by ``TrainingStats``' flush."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor
from typing_extensions import override

from lightning_ext._checks import check_number
from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.perf import (
    LOST_TIME_CAUSES,
    FlopCounter,
    GoodputLedger,
    measure_peak_flops,
    peak_flops,
    peaks,
)
from lightning_ext.stats import Collector, report, report0

__all__ = ["Throughput"]

# The per-rank name whose slowest rank TrainingStats names (the largest seconds per sample)
_SEC_PER_SAMPLE = "Throughput/sec_per_sample"
_GOODPUT_PARTS = ("productive", *LOST_TIME_CAUSES, "other")
_READ = tuple(f"Throughput/{n}" for n in ("train_sec", "samples", "tokens", "flops", "peak_flops_per_sec",
                                            "hardware_flops", "sec_per_sample"))  # fmt: skip
# Where the callback is, between its hooks: the time since the last switch goes to the state's bucket.
_STATES = ("startup", "step", "data", "validation", "checkpoint", "flush", "other")
_CAUSES = {"startup": "startup", "data": "data_wait", "validation": "validation",
           "checkpoint": "checkpointing"}  # state => cause


def _cudnn_uses_tf32() -> bool:
    """Whether cuDNN runs float32 convolutions in TF32 (``torch.backends.cudnn.allow_tf32``, on by
    default; where torch's new ``torch.backends.cudnn.conv.fp32_precision`` was set too, that)."""
    try:
        return torch.backends.cudnn.allow_tf32
    except RuntimeError:  # (torch's legacy and new settings mixed: the new one decides)
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


def _conv_peak(name: str) -> float:
    """The peak of float32 convolutions on the CUDA device ``name`` (in the table): as cuDNN's TF32
    setting says, float32 on a device without a TF32 unit (an MI250X, where ROCm's setting is the same)."""
    try:
        return peak_flops("tf32" if _cudnn_uses_tf32() else "fp32", name)
    except ValueError:  # no TF32 column (its float32 peak was found: the device is in the table)
        return peak_flops("fp32", name)


def _compute_dtype(precision: str, plugin: Any) -> torch.dtype | str:
    """The dtype of most matmuls under a Lightning ``precision`` (``"bf16-mixed"``, ``"16-true"``, ...)
    and its precision plugin: one that says ``"32-true"`` but computes in a ``dtype`` of its own
    (``BitsandbytesPrecision``) gives that."""
    if precision.startswith("transformer-engine"):
        return "fp8"
    dtypes = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}
    dtype, own = dtypes.get(str(precision).split("-")[0], torch.float32), getattr(plugin, "dtype", None)
    return own if dtype == torch.float32 and isinstance(own, torch.dtype) and own.is_floating_point else dtype


def _compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or one of its submodules runs under ``torch.compile`` (``torch.compile(m)``,
    ``m.compile()``, or a LightningModule compiled before ``fit``)."""
    compiled = (hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) for m in module.modules())
    return getattr(module, "_compiler_ctx", None) is not None or any(compiled)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", repr(fn)) if fn is not None else "None"


class Throughput(HookBase):
    """Global samples/s and tokens/s, MFU (HFU) and goodput, in the flush of
    :class:`~lightning_ext.callbacks.TrainingStats`, identical on every rank, without a host sync per
    step or a collective of its own.

    Counting, per micro-batch (gradient accumulation: every micro-batch counts): ``samples_fn(batch)``
    samples (default Lightning's ``extract_batch_size``, a host int from the shapes), ``tokens_fn(batch)``
    tokens when given (e.g. the non-padding count ``batch["mask"].sum()``: a tensor is summed on its device,
    never read on the host), and the model FLOPs: ``flops_fn="count"`` counts the first micro-batch of a
    run with :class:`~lightning_ext.perf.FlopCounter` (``FlopCounterMode``'s conventions, in the real
    step, under its precision; a micro-batch that ``training_step`` skipped by returning ``None`` ran
    no backward: the next one is counted) and scales them with the samples (those of a skipped
    micro-batch by the forward's FLOPs only; they count as samples); a callable gives a micro-batch's
    FLOPs (variable sequence lengths: a formula of the batch, called for skipped ones too); ``None``
    counts none.

    Time, host wall time. Every second of a rank goes to one part, switched by this callback's Lightning
    hooks: the start-up (from the callback's construction, or a resume's load of its state, to the start
    of training: the spawn, the setup, the preparation, a peak measured); a training step
    (``on_train_batch_start`` to ``on_train_batch_end`` of each micro-batch, and the wait before its
    fetch in Lightning's SIGTERM broadcast, 2.5.2+, where the fast ranks wait for one slow in its
    optimizer step, as they would in DDP's gradient all-reduce); data wait (from there to the
    next micro-batch, or from the start of an epoch or the end of a validation run: the loading, the
    transfer and the end-of-batch work of the callbacks after this one); validation
    (``on_validation_start`` to ``on_validation_end``, the sanity check included, after which the start-up
    goes on; after a micro-batch, from its end: Lightning makes the validation loader's iterator, which
    may start workers and load a first batch, before ``on_validation_start``); checkpointing (from
    Lightning's call of ``state_dict``, when it gathers a checkpoint, or after a micro-batch or a
    validation run from its end: the model's weights are gathered first, an all-gather under FSDP, to
    this callback's next hook: the write and Lightning's barrier after it, and for a save at the end of a
    batch the next batch's fetch; a weights-only save is not seen); the flush (its reductions and its
    writes to the loggers: ``before_stats_flush`` to ``after_stats_flush``); the rest (epoch ends). A
    rank's training time in an interval is its wall time less validation, checkpointing and the flush.
    On CUDA a part ends when the host leaves it (device work still queued lands in the next part), and
    before a flush it synchronizes the device, so that an interval holds all of its device work (the
    flush's read would wait for the same work).

    Per rank and flush it ``report()``-s (ordinary names: ``TrainingStats`` writes their statistics)
    ``Throughput/samples``, ``Throughput/train_sec`` and ``Throughput/sec_per_sample`` (its training
    seconds over its samples: ``TrainingStats`` names the rank with the largest, the slowest by
    throughput, as ``Throughput/sec_per_sample/straggler_rank``); with tokens ``Throughput/tokens``; with
    FLOPs ``Throughput/flops``, ``Throughput/peak_flops_per_sec`` (its device's peak) and, when the count
    saw activation checkpointing recompute a forward, ``Throughput/hardware_flops``. From their reduced
    values the flush writes, identical on every rank::

        Throughput/samples_per_sec = SUM over ranks of samples / T   (also tokens_per_sec, flops_per_sec)
        T = MAX over ranks of Throughput/train_sec                    (a rank that waited counts the wait)
        Throughput/samples_per_sec_per_device = Throughput/samples_per_sec / ranks
        Throughput/mfu = SUM of flops / (T · SUM of peaks)            (hfu: with hardware_flops)
        Throughput/rank_samples_per_sec/min|median|max                (1 / the ranks' sec_per_sample)

    The median (from the straggler sketch, within its 1 % accuracy; with an even number of ranks the
    harmonic mean of the two middle rates) needs ``TrainingStats``' ``stragglers`` to match
    ``Throughput/sec_per_sample`` (its default does). A rank reports nothing at a flush without an
    iteration since the previous one (the epoch-end flush right after a periodic one).

    Goodput. A :class:`~lightning_ext.perf.GoodputLedger` made at construction (the first launch: make the
    callback early) books the steps that updated the model as productive, those the loss scaler skipped
    (:class:`~lightning_ext.amp.DynamicLossScaler`'s ``last_step_skipped_tensor``, read on the device,
    summed at the flush) as ``skipped_steps``, and the start-up, data wait, validation and checkpointing
    parts above; it rides in the checkpoint (this callback's state), and a resumed job books the time
    since the checkpoint as ``restart`` (a fit from the checkpoint: ``test``/``validate`` with a
    ``ckpt_path`` leave the ledger as it is; a fit from a checkpoint without this callback's state warns
    that the ledger starts from this launch). Rank zero's ledger is the job's (the one the checkpoint
    carries): ``report0()``-ed as ``Goodput/goodput`` and ``Goodput/<part>_sec`` (``productive``, the
    causes of :data:`~lightning_ext.perf.LOST_TIME_CAUSES`, ``other``), which add up to the wall time
    since the first launch.

    The peak (``peak_flops_per_sec=None``): :func:`~lightning_ext.perf.peak_flops` of the CUDA device
    for ``peak_dtype`` (default: the compute dtype of the Trainer's precision, or of its precision
    plugin's ``dtype`` under ``"32-true"``: ``BitsandbytesPrecision`` computes in it); on a CPU,
    :func:`~lightning_ext.perf.measure_peak_flops` at the start of training (every rank at once, as they
    share the machine while training). No peak known: no MFU, said once. In float32 on CUDA, cuDNN runs
    the convolutions as ``torch.backends.cudnn.allow_tf32`` says (TF32 by default) and the matmuls as
    the matmul precision says: where their peaks differ, a count weighs them by its FLOPs (the peak is
    then ``model / (convolution / conv peak + rest / peak)``, the rate of doing each at its own peak);
    with a callable ``flops_fn`` and a model with convolutions it is said once. ``flops_fn="count"``
    counts nothing for a model that holds a ``torch.compile``-d module (said once): dynamo would run
    its code eagerly for the rest of the process after a step under ``FlopCounterMode`` (a function
    compiled inside the forward is not detected).

    Put it before ``TrainingStats`` in ``callbacks`` (``setup`` raises otherwise: a flush at a batch's
    end would come before it counted that batch); one ``TrainingStats`` collects its names (the
    intervals are those of its flushes): with several, give the others a ``regex`` that excludes them
    (``setup`` raises otherwise). ``TrainingStats`` checks at ``setup`` that every rank has the same
    ``Throughput`` (its ``repr``). Host syncs: one at the first micro-batch with
    ``flops_fn="count"`` (the samples counted, when a tensor), at each flush one on CUDA and one with a
    loss scaler (the skipped time). Collectives: none of its own.

    Args:
        samples_fn: samples in a micro-batch (an int, or an integer tensor); ``None``:
            ``extract_batch_size``.
        tokens_fn: tokens in a micro-batch (an int, or an integer tensor); ``None``: none counted (a
            ``report("Throughput/tokens", n)`` of your own counts too).
        flops_fn: ``"count"``, a callable giving a micro-batch's model FLOPs, or ``None``.
        peak_flops_per_sec: one device's peak FLOP/s (> 0); ``None``: as above.
        peak_dtype: the dtype of the peak (``torch.float32``, ``"fp8"``, ...); ``None``: the precision's.

    Raises:
        TypeError: ``samples_fn``/``tokens_fn`` neither ``None`` nor callable, ``flops_fn`` neither
            ``"count"``, ``None`` nor callable, ``peak_flops_per_sec`` not a finite number.
        ValueError: ``peak_flops_per_sec <= 0``; ``peak_dtype`` not a matmul dtype or a column of the
            peak table (:func:`~lightning_ext.perf.peak_flops`).

    Example::

        >>> throughput = Throughput(tokens_fn=lambda batch: batch["mask"].sum(), peak_flops_per_sec=989.4e12)
        >>> throughput.flops_fn, throughput.ledger.restarts
        ('count', 0)
    """

    #: the names :meth:`before_stats_flush` reports: the ``TrainingStats`` whose ``regex`` matches them
    #: calls it at its flushes (one may; ``TrainingStats`` raises at ``setup`` when several do).
    stats_flush_names: tuple[str, ...] = (
        "Throughput/train_sec", "Throughput/samples", _SEC_PER_SAMPLE, "Throughput/tokens",
        "Throughput/flops", "Throughput/peak_flops_per_sec", "Throughput/hardware_flops", "Goodput/goodput",
        *(f"Goodput/{part}_sec" for part in _GOODPUT_PARTS),
    )  # fmt: skip

    def __init__(
        self,
        samples_fn: Callable[[Any], Any] | None = None,  # (-> int | Tensor: LightningCLI reads a class
        tokens_fn: Callable[[Any], Any] | None = None,  # in the return type as one to instantiate)
        flops_fn: Callable[[Any], Any] | Literal["count"] | None = "count",
        peak_flops_per_sec: float | None = None,
        peak_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__()
        for arg, fn in (("samples_fn", samples_fn), ("tokens_fn", tokens_fn), ("flops_fn", flops_fn)):
            if not (fn is None or callable(fn) or (arg == "flops_fn" and fn == "count")):
                allowed = "'count', None or a callable" if arg == "flops_fn" else "None or a callable"
                raise TypeError(f"Throughput: `{arg}` must be {allowed} (batch -> count), got {fn!r}")
        if peak_flops_per_sec is not None:
            check_number("Throughput", "peak_flops_per_sec", peak_flops_per_sec, gt=0.0)
        known = isinstance(peak_dtype, str) and peak_dtype in peaks._DTYPE_KEYS
        known = known or any(peak_dtype is d for d in (None, *peaks._MATMUL_DTYPES, *peaks._FP8))
        if not known:  # (else no MFU for the whole run, said once at its start)
            raise ValueError(
                f"Throughput: `peak_dtype` must be None, a matmul dtype (torch.float16, torch.bfloat16, "
                f"torch.float32, torch.float64, a torch.float8 type) or one of {peaks._DTYPE_KEYS}, "
                f"got {peak_dtype!r}"
            )
        self.samples_fn, self.tokens_fn, self.flops_fn = samples_fn, tokens_fn, flops_fn
        self.peak_flops_per_sec, self.peak_dtype = peak_flops_per_sec, peak_dtype
        #: the job's goodput ledger (this rank's; rank zero's is written and checkpointed).
        self.ledger = GoodputLedger()
        #: the keys the last flush with an interval derived (identical on every rank).
        self.last_metrics: dict[str, float] = {}
        self._state, self._since = "startup", time.perf_counter()  # (the same clock in spawned ranks)
        self._validated_from = "data"  # the state a validation run returns to (the sanity check: startup)
        self._peak: float | None = None  # this device's peak FLOP/s in use
        self._conv_peak: float | None = None  # its convolutions' own, where it differs
        self._flops_per_sample: tuple[float, ...] | None = None  # (model, hardware, forward), counted
        self._counter: FlopCounter | None = None  # open over the counted micro-batch
        self._counts = flops_fn == "count"  # whether it counts (not a compiled model: before_train)
        self._flushes = 0
        self._fitting = True  # the stage set up is a fit (a checkpoint loaded resumes the job)
        self._unbooked()
        self._restart()

    def __repr__(self) -> str:
        flops = self.flops_fn if self.flops_fn in ("count", None) else _name(self.flops_fn)
        return (
            f"Throughput(samples_fn={_name(self.samples_fn)}, tokens_fn={_name(self.tokens_fn)}, "
            f"flops_fn={flops!r}, peak_flops_per_sec={self.peak_flops_per_sec!r}, "
            f"peak_dtype={self.peak_dtype!r})"
        )

    def _restart(self) -> None:
        """Zero the interval's counts and seconds."""
        self._interval = dict.fromkeys(_STATES, 0.0)  # seconds by state since the last flush
        self._samples: int | Tensor = 0
        self._forward_only: int | Tensor = 0  # of which in micro-batches that ran no backward
        self._tokens: int | Tensor = 0
        self._flops: float | Tensor = 0.0  # with a flops_fn
        self._iterations = 0

    def _unbooked(self) -> None:
        """Zero what the ledger has not booked yet."""
        self._pending = dict.fromkeys(_CAUSES, 0.0)  # seconds by state
        self._step_sec = 0.0  # of the current iteration's steps
        self._taken = 0.0  # of the finished iterations' steps
        self._skipped: float | Tensor = 0.0  # of which in skipped steps (float64 on the device)

    def _switch(self, state: str) -> str:
        """Give the time since the last switch to the current state, enter ``state``; the previous one."""
        now = time.perf_counter()
        previous, elapsed = self._state, now - self._since
        self._interval[previous] += elapsed
        if previous == "step":
            self._step_sec += elapsed
        elif previous in self._pending:
            self._pending[previous] += elapsed
        self._state, self._since = state, now
        return previous

    def _book(self) -> None:
        """Book in the ledger the finished iterations and the parts since the last booking."""
        skipped = min(float(self._skipped), self._taken)  # a host read with a loss scaler
        self.ledger.productive(self._taken - skipped)
        if skipped:
            self.ledger.add("skipped_steps", skipped)
        for state, cause in _CAUSES.items():
            if self._pending[state]:  # (most intervals have no validation or checkpoint)
                self.ledger.add(cause, self._pending[state])
        step_sec = self._step_sec  # the current iteration's: booked at its end
        self._unbooked()
        self._step_sec = step_sec

    # ------------------------------------------------------------------ Lightning's hooks

    @override
    def before_train(self) -> None:
        self._counts = self.flops_fn == "count" and not _compiled(self.pl_module)
        if self.flops_fn == "count" and not self._counts:
            self._warn("Throughput: flops_fn='count' counts a micro-batch under FlopCounterMode, which makes "
                       "torch.compile run the model's compiled code eagerly for the rest of the process (and "
                       "raise with fullgraph=True): no FLOPs are counted, so no MFU. HINT: count them once "
                       "on the eager model with lightning_ext.perf.FlopCounter and pass flops_fn=lambda "
                       "batch: flops_per_sample * len(batch).")  # fmt: skip
        self._flops_per_sample, self._peak = None, self._find_peak()  # (a measured peak: in the start-up)
        self._switch("other")
        self._restart()
        scaler = getattr(self.trainer.strategy.precision_plugin, "scaler", None)
        self._skip_flag = getattr(scaler, "last_step_skipped_tensor", None) is not None

    def _find_peak(self) -> float | None:
        """This device's peak FLOP/s (see the class docstring); ``None`` (said once) when unknown."""
        self._conv_peak = None
        if not (self._counts or callable(self.flops_fn)) or self.peak_flops_per_sec is not None:
            return self.peak_flops_per_sec
        device, trainer = self.pl_module.device, self.trainer
        dtype = self.peak_dtype or _compute_dtype(trainer.precision, trainer.strategy.precision_plugin)
        try:
            if device.type == "cuda":
                name = torch.cuda.get_device_name(device)
                peak = peak_flops(dtype, name)
                if dtype == torch.float32:  # (cuDNN's setting for the convolutions, not the matmuls')
                    conv_peak = _conv_peak(name)
                    self._conv_peak = conv_peak if conv_peak != peak else None
                    self._warn_mixed_peaks()
                return peak
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"measure_peak_flops: no {dtype!r} matmul to measure")
            return measure_peak_flops(dtype, str(device))
        except ValueError as err:
            self._warn(f"Throughput: no peak for MFU ({err}). HINT: pass peak_flops_per_sec.")
            return None

    def _warn_mixed_peaks(self) -> None:
        """Say so when the model's convolutions run at another float32 peak than its matmuls and the
        FLOPs are the user's (a count splits them: :meth:`_mixed_peak`)."""
        if self._conv_peak is None or self.flops_fn == "count":
            return
        if any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in self.pl_module.modules()):
            conv, matmul = ("TF32", "float32") if _cudnn_uses_tf32() else ("float32", "TF32")
            self._warn(
                f"Throughput: MFU is against the peak of float32 matmuls, which run in {matmul}, but cuDNN "
                f"runs this model's convolutions in {conv} (torch.backends.cudnn.allow_tf32): where they "
                "are most of the FLOPs, MFU is off by up to 8x. HINT: flops_fn='count' weighs the two "
                "peaks by the counted FLOPs, or pass peak_flops_per_sec."
            )

    def _mixed_peak(self, count: Any) -> float | None:
        """The peak of ``count``'s FLOPs when its convolutions have a peak of their own: the FLOP/s of
        doing each at its peak, ``model / (convolution / conv peak + rest / peak)``."""
        if self._conv_peak is None or self._peak is None or not count.model:
            return self._peak
        rest = count.model - count.convolution
        return count.model / (count.convolution / self._conv_peak + rest / self._peak)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._switch("step")
        if self._counts and self._flops_per_sample is None and self._counter is None:
            self._counter = FlopCounter().__enter__()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Counted at the end: the module's on_train_batch_start, after this callback's, may cancel a batch
        samples = (self.samples_fn or extract_batch_size)(batch)
        self._samples = self._samples + samples
        if self.tokens_fn is not None:
            self._tokens = self._tokens + self.tokens_fn(batch)
        if callable(self.flops_fn):
            self._flops = self._flops + self.flops_fn(batch)
        count = self._close_counter()
        skipped = not outputs and pl_module.automatic_optimization  # no loss, no backward: count the next
        if count is not None and samples and not skipped:  # (a host read of a tensor, once)
            per_sample = (count.model, count.hardware, count.forward)
            self._flops_per_sample = tuple(flops / float(samples) for flops in per_sample)
            self._peak = self._mixed_peak(count)
        if skipped:  # its samples count their forward's FLOPs only
            self._forward_only = self._forward_only + samples
        self._switch("data")
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def _in_lightnings_broadcast(self, broadcast: Any) -> None:
        """The wait for the other ranks before a batch's fetch: the step's time, as DDP's waits, not data."""
        previous = self._switch("step")
        try:
            super()._in_lightnings_broadcast(broadcast)
        finally:
            self._switch(previous)

    def _close_counter(self) -> Any:
        """The FLOPs counted, ``None`` without an open count."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        return counter.count if counter is not None else None

    @override
    def after_step(self) -> None:
        self._taken += self._step_sec
        if self._skip_flag:  # on the device: no sync
            skipped = self.trainer.strategy.precision_plugin.scaler.last_step_skipped_tensor
            self._skipped = self._skipped + skipped.to(torch.float64) * self._step_sec
        self._step_sec = 0.0
        self._iterations += 1

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._switch("data")
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_counter()  # a batch the module cancelled (which ends the epoch) counts nothing
        self._switch("other")
        super().on_train_epoch_end(trainer, pl_module)

    def _since_the_batch(self, state: str) -> str:
        """Enter ``state``, the time since the end of the last micro-batch (or validation run) its own:
        what Lightning did before the hook that tells ``state`` (no data is fetched then); the state left."""
        previous = self._state
        if previous == "data":
            self._state = state
        self._switch(state)
        return previous

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated_from = self._since_the_batch("validation")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (the sanity check's start-up; a trainer.validate() outside a fit's: the time until the next fit)
        self._switch(self._validated_from if self._validated_from in ("startup", "other") else "data")
        super().on_validation_end(trainer, pl_module)

    @override
    def after_train(self) -> None:  # also after a failure
        self._close_counter()
        self._switch("other")
        self._book()
        if not self._flushes and self.exception is None:
            self._warn("Throughput: no TrainingStats flush ran, so nothing was written. HINT: add "
                       "TrainingStats() after it to `callbacks`, its regex matching Throughput's names "
                       "(Throughput.stats_flush_names).")  # fmt: skip

    @override
    def state_dict(self) -> dict[str, Any]:
        self._since_the_batch("checkpoint")  # Lightning gathers the checkpoint, then writes it
        self._book()
        return {"goodput": self.ledger.state_dict()}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._fitting = stage == "fit"

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._fitting and self.state_key not in checkpoint.get("callbacks", {}):  # (Lightning: silent)
            self._warn(
                f"Throughput: the checkpoint holds no state of {self.state_key}, so the goodput ledger "
                "starts from this launch: the job's earlier time and restarts are not counted. HINT: "
                "resume from a checkpoint written with the same Throughput in `callbacks`."
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._fitting:  # test/validate(ckpt_path=...): no restart; the job's ledger stays
            return
        self.ledger.load_state_dict(state_dict["goodput"])  # books the time since it was saved,
        self._switch("startup")  # (from here to the training: this start-up's rest)
        self._unbooked()  # which holds what this process did until now

    # ------------------------------------------------------------------ TrainingStats' flush

    def before_stats_flush(self, late: bool = False) -> None:
        """``report()`` this rank's values of the interval since the last flush (see the class
        docstring); :class:`~lightning_ext.callbacks.TrainingStats` calls it on every rank right
        before its collector's update; on CUDA it synchronizes the device first. With ``late`` (the
        publication of values reported after an epoch-end flush), only enter the flush's part of the
        time (no sync)."""
        if not late and self.pl_module.device.type == "cuda":
            torch.cuda.synchronize(self.pl_module.device)  # (the flush's read would wait for it)
        self._resume = self._switch("flush")
        if late:
            return
        self._book()
        self._flushes += 1
        if self._iterations:
            self._report_interval()
        summary = self.ledger.summary()
        report0("Goodput/goodput", summary["goodput"])
        for part in _GOODPUT_PARTS:
            report0(f"Goodput/{part}_sec", summary[part])

    def _report_interval(self) -> None:
        seconds, samples = self._interval, self._samples
        train_sec = seconds["step"] + seconds["data"] + seconds["other"]
        report("Throughput/train_sec", train_sec)
        report("Throughput/samples", samples)
        if isinstance(samples, Tensor) or samples > 0:
            report(_SEC_PER_SAMPLE, train_sec / samples)
        if self.tokens_fn is not None:
            report("Throughput/tokens", self._tokens)
        flops = hardware = None
        if self._flops_per_sample is not None:
            model, hardware, forward = self._flops_per_sample
            stepped, forward_only = samples - self._forward_only, self._forward_only
            flops, hardware = (x * stepped + forward * forward_only for x in (model, hardware))
        elif callable(self.flops_fn):
            flops = self._flops
        if flops is not None:
            report("Throughput/flops", flops)
            if self._peak is not None:
                report("Throughput/peak_flops_per_sec", self._peak)
            if hardware is not None and self._flops_per_sample[1] > self._flops_per_sample[0]:
                report("Throughput/hardware_flops", hardware)
        self._restart()

    def stats_flush_metrics(self, collector: Collector) -> dict[str, float]:
        """The keys derived from the reduced values (see the class docstring), identical on every
        rank; :class:`~lightning_ext.callbacks.TrainingStats` writes them with its own. Local."""
        metrics = _throughput_metrics(collector)
        self.last_metrics = metrics or self.last_metrics
        return metrics

    def after_stats_flush(self) -> None:
        """Leave the flush's part of the time (:class:`~lightning_ext.callbacks.TrainingStats` calls it
        when the flush ends, its writes to the loggers done)."""
        self._switch(self._resume)


def _throughput_metrics(collector: Collector) -> dict[str, float]:
    """Global rates, MFU/HFU and the ranks' spread from the reduced per-rank values of a flush (its rows
    read once: ``as_dict`` of the names that had values)."""
    updated = set(collector.updated())
    if not {"Throughput/train_sec", "Throughput/samples"} <= updated:
        return {}
    rows = collector.as_dict([n for n in _READ if n in updated])
    seconds, ranks = rows["Throughput/train_sec"]["max"], rows["Throughput/train_sec"]["num"]
    if not seconds > 0:
        return {}
    # the SUM over ranks (and reports) of each name, per second
    per_sec = {n.split("/")[1]: row["mean"] * row["num"] / seconds for n, row in rows.items()}
    metrics = {}
    for name in ("samples", "tokens"):
        if name in per_sec:
            metrics[f"Throughput/{name}_per_sec"] = per_sec[name]
            metrics[f"Throughput/{name}_per_sec_per_device"] = per_sec[name] / ranks
    if "flops" in per_sec:
        metrics["Throughput/flops_per_sec"] = per_sec["flops"]
    if "flops" in per_sec and "peak_flops_per_sec" in per_sec:
        peaks = per_sec["peak_flops_per_sec"] * seconds  # the SUM of the ranks' peaks
        metrics["Throughput/mfu"] = per_sec["flops"] / peaks
        if "hardware_flops" in per_sec:
            metrics["Throughput/hfu"] = per_sec["hardware_flops"] / peaks
    spread = rows.get(_SEC_PER_SAMPLE)
    if spread and spread["num"]:
        metrics["Throughput/rank_samples_per_sec/min"] = 1.0 / spread["max"]
        metrics["Throughput/rank_samples_per_sec/max"] = 1.0 / spread["min"]
        tracked = re.fullmatch(collector.stragglers or "(?!)", _SEC_PER_SAMPLE)
        straggler = collector.straggler(_SEC_PER_SAMPLE) if tracked else None
        if straggler is not None and straggler.median > 0:
            metrics["Throughput/rank_samples_per_sec/median"] = 1.0 / straggler.median
    return metrics
