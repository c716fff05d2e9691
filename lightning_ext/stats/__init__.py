"""lightning_ext.stats: distributed training statistics (NVIDIA's ``training_stats`` pattern).

``report(name, value)`` from anywhere; ``Collector(regex).update()`` on every rank reduces what was
reported since its last update. Pure torch + ``torch.distributed``.
"""

from lightning_ext.stats.collector import Collector, Straggler
from lightning_ext.stats.reporting import (
    STAGE_SEPARATOR,
    Sink,
    Table,
    clear_statistics,
    drain,
    init_multiprocessing,
    kernel_backend,
    register_sink,
    report,
    report0,
    set_stage,
    sync_settings,
)
from lightning_ext.stats.sketch import LogHistogram

__all__ = [
    "STAGE_SEPARATOR",
    "Collector",
    "LogHistogram",
    "Sink",
    "Straggler",
    "Table",
    "clear_statistics",
    "drain",
    "init_multiprocessing",
    "kernel_backend",
    "register_sink",
    "report",
    "report0",
    "set_stage",
    "sync_settings",
]
