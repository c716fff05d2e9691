"""lightning_ext: training infrastructure of the best research codebases for any ``lightning.Trainer``.

Importing it checks the installed torch and Lightning against the supported floors (``ImportError``
naming both versions otherwise) and imports torch; its subpackages are imported lazily, so
``import lightning_ext`` imports nothing else:

- :mod:`lightning_ext.stats` — ``report()`` / ``Collector``: distributed training statistics.
- :mod:`lightning_ext.amp` — ``DynamicLossScaler``: a ``torch.amp.GradScaler`` with more schedules.
- :mod:`lightning_ext.nn` — ``SyncBatchNorm`` for every backend, with lossless convert/revert.
- :mod:`lightning_ext.kernels` — the kernel-backend registry (reference, cpu, triton).
- :mod:`lightning_ext.distributed` — process-group helpers and the one ``all_reduce_``.
- :mod:`lightning_ext.perf` — performance accounting: FLOPs, device peaks, MFU, goodput.
- :mod:`lightning_ext.callbacks` / :mod:`lightning_ext.plugins` — the Lightning adapters.
"""

import importlib
from typing import Any

from lightning_ext import _compat  # noqa: F401  (checks the installed torch and Lightning)

__version__ = "0.1.0"

_SUBMODULES = ("amp", "callbacks", "distributed", "kernels", "nn", "perf", "plugins", "stats")
__all__ = ["__version__", "reset", *_SUBMODULES]


def reset() -> None:
    """Clear every process-wide cache of the package, the one call that does: reported values not yet
    collected, the collectors' registration and the multiprocessing settings
    (:func:`lightning_ext.stats.clear_statistics`); the built kernel backends, their selection and
    every other kernel cache (:func:`lightning_ext.kernels.clear_backend_cache`); the shared-memory
    segments and the groups' routes (:func:`lightning_ext.distributed.close_shared_memory`); the
    matmul rates :func:`lightning_ext.perf.measure_peak_flops` measured
    (:func:`lightning_ext.perf.clear_peak_cache`).

    For notebooks and tests that run several jobs in one process; local, no collective, but call it on
    every rank (a later reduction sets its segment up again, a collective). What it keeps: the
    registered backends, the loaded ``cpu`` extension (a process cannot unload a compiled module) and
    the ``torch.ops.lightning_ext`` ops (registered once per process).
    """
    from lightning_ext import distributed, kernels, perf, stats

    stats.clear_statistics()
    kernels.clear_backend_cache()
    distributed.close_shared_memory()
    perf.clear_peak_cache()


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
