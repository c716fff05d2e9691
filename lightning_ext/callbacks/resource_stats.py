"""Memory and throughput of every rank, ``report()``-ed for ``TrainingStats`` (StyleGAN3's ``Resources/``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_ext._checks import check_int
from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.stats import report

__all__ = ["ResourceStats"]

_GB = float(2**30)


class ResourceStats(HookBase):
    """Report this rank's memory and throughput every ``every_n_train_steps`` iterations.

    Names (float scalars; :class:`TrainingStats` logs their mean and max over all ranks, at
    Lightning's step of the batch that flushes; the report period counts :attr:`~HookBase.iter`):

    - ``Resources/cpu_mem_gb``: resident set size of the process (``psutil``), GiB;
    - ``Resources/peak_gpu_mem_gb`` and ``Resources/peak_gpu_mem_reserved_gb`` (CUDA modules only):
      peak memory allocated and reserved by PyTorch's caching allocator on the module's device since
      the previous report, GiB; the peaks are reset after each report, so with ``every_n_train_steps``
      equal to ``TrainingStats``' period the logged max is the peak of that interval over all ranks;
    - ``Resources/samples_per_sec`` and ``Resources/batches_per_sec``: this rank's training
      throughput over the ``every_n_train_steps`` iterations up to the report (Lightning's
      :class:`~lightning.fabric.utilities.throughput.Throughput`); the sum over ranks is the mean
      times the world size;
    - ``Resources/flops_per_sec``: the same for FLOPs when the ``LightningModule`` has a
      ``flops_per_batch`` attribute (as for Lightning's ``ThroughputMonitor``; measure it with
      :func:`lightning.fabric.utilities.throughput.measure_flops`).

    Host syncs: none. The allocator's counters and ``psutil`` are host reads; throughput uses host
    wall time (``time.perf_counter``), so on CUDA an interval is off by at most the work queued on
    the device at its ends.

    Args:
        every_n_train_steps: report period in iterations (see :class:`HookBase`).
        batch_size_fn: samples in a batch; default Lightning's ``extract_batch_size`` (the size of
            the first tensor's first dimension).

    Raises:
        ValueError: ``every_n_train_steps < 1``.
        TypeError: ``every_n_train_steps`` is not an int, or ``batch_size_fn`` is not callable.

    Source: StyleGAN3 ``training/training_loop.py`` (``Resources/*``, ``Timing/*``) and detectron2's
    ``TorchMemoryStats``.

    Example::

        >>> stats = ResourceStats(every_n_train_steps=10)
        >>> stats.every_n_train_steps
        10
    """

    def __init__(
        self, every_n_train_steps: int = 1, batch_size_fn: Callable[[Any], int] | None = None
    ) -> None:
        super().__init__()
        check_int("ResourceStats", "every_n_train_steps", every_n_train_steps, ge=1)
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise TypeError(f"ResourceStats: `batch_size_fn` must be callable, got {batch_size_fn!r}")
        self.every_n_train_steps = every_n_train_steps
        self.batch_size_fn = batch_size_fn or extract_batch_size
        #: the values of this rank's last report, by name (this rank only, not reduced).
        self.last_report: dict[str, float] = {}

    @override
    def before_train(self) -> None:
        # A window of every_n_train_steps + 1 updates spans the iterations since the previous report.
        self._throughput = Throughput(window_size=self.every_n_train_steps + 1)
        self._batches = self._samples = self._batches_updated = 0
        self._update_throughput()
        self.last_report = {}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        self._samples += int(self.batch_size_fn(batch))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def after_step(self) -> None:
        self._update_throughput()
        if (self.iter + 1) % self.every_n_train_steps:
            return
        values = {"cpu_mem_gb": psutil.Process().memory_info().rss / _GB}
        for key, value in self._throughput.compute().items():  # this rank's: {samples,batches,flops}_per_sec
            if key.startswith("device/"):
                values[key.removeprefix("device/")] = float(value)
        device = self.pl_module.device
        if device.type == "cuda":
            values["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / _GB
            values["peak_gpu_mem_reserved_gb"] = torch.cuda.max_memory_reserved(device) / _GB
            torch.cuda.reset_peak_memory_stats(device)
        for name, value in values.items():
            report(f"Resources/{name}", value)
        self.last_report = values

    def _update_throughput(self) -> None:
        """Hand the totals so far to ``Throughput``, with the FLOPs of the batches since its last update."""
        flops_per_batch = getattr(self.pl_module, "flops_per_batch", None)
        new_batches, self._batches_updated = self._batches - self._batches_updated, self._batches
        flops = None if flops_per_batch is None else flops_per_batch * new_batches
        self._throughput.update(
            time=time.perf_counter(), batches=self._batches, samples=self._samples, flops=flops
        )
