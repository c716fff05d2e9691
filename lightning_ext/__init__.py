"""lightning_ext: training infrastructure of the best research codebases for any ``lightning.Trainer``.

Subpackages (imported lazily so ``import lightning_ext`` stays cheap):

- :mod:`lightning_ext.stats` — ``report()`` / ``Collector``: distributed training statistics.
- :mod:`lightning_ext.amp` — ``DynamicLossScaler``: GradScaler-compatible dynamic loss scaling.
- :mod:`lightning_ext.nn` — ``SyncBatchNorm`` for every backend, with lossless convert/revert.
- :mod:`lightning_ext.kernels` — kernel-backend registry (reference, Triton).
- :mod:`lightning_ext.callbacks` / :mod:`lightning_ext.plugins` — the Lightning adapters.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("amp", "callbacks", "distributed", "examples", "kernels", "nn", "plugins", "stats")
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
