"""Memory of every rank, ``report()``-ed for ``TrainingStats`` (StyleGAN3's ``Resources/``)."""

from __future__ import annotations

import psutil
import torch
from typing_extensions import override

from lightning_ext._checks import check_int
from lightning_ext.callbacks.hook_base import HookBase, _module_device
from lightning_ext.stats import report

__all__ = ["ResourceStats"]

_GB = float(2**30)


class ResourceStats(HookBase):
    """Report this rank's memory every ``every_n_train_steps`` iterations.

    Names (float scalars; :class:`TrainingStats` logs their mean and max over all ranks, at
    Lightning's step of the batch that flushes; the report period counts iterations, as
    :class:`HookBase` says):

    - ``Resources/cpu_mem_gb``: resident set size of the process (``psutil``), GiB;
    - ``Resources/peak_gpu_mem_gb`` and ``Resources/peak_gpu_mem_reserved_gb`` (CUDA modules only):
      peak memory allocated and reserved by PyTorch's caching allocator on the module's device since
      the previous report, GiB; the peaks are reset after each report, so with ``every_n_train_steps``
      equal to ``TrainingStats``' period the logged max is the peak of that interval over all ranks.

    Throughput (global samples/s and tokens/s, MFU, goodput): :class:`Throughput`.

    Host syncs: none (the allocator's counters and ``psutil`` are host reads).

    Args:
        every_n_train_steps: report period in iterations (see :class:`HookBase`).

    Raises:
        ValueError: ``every_n_train_steps < 1``.
        TypeError: ``every_n_train_steps`` is not an int.

    Source: StyleGAN3 ``training/training_loop.py`` (``Resources/*``, ``Timing/*``) and detectron2's
    ``TorchMemoryStats``.

    Example::

        >>> stats = ResourceStats(every_n_train_steps=10)
        >>> stats.every_n_train_steps
        10
    """

    def __init__(self, every_n_train_steps: int = 1) -> None:
        super().__init__()
        check_int("ResourceStats", "every_n_train_steps", every_n_train_steps, ge=1)
        self.every_n_train_steps = every_n_train_steps
        #: the values of this rank's last report, by name (this rank only, not reduced).
        self.last_report: dict[str, float] = {}

    @override
    def before_train(self) -> None:
        self.last_report = {}

    @override
    def after_step(self) -> None:
        if self._steps_done % self.every_n_train_steps:
            return
        values = {"cpu_mem_gb": psutil.Process().memory_info().rss / _GB}
        device = _module_device(self.pl_module)
        if device.type == "cuda":
            values["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(device) / _GB
            values["peak_gpu_mem_reserved_gb"] = torch.cuda.max_memory_reserved(device) / _GB
            torch.cuda.reset_peak_memory_stats(device)
        for name, value in values.items():
            report(f"Resources/{name}", value)
        self.last_report = values
