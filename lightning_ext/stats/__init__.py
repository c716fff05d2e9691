"""lightning_ext.stats: distributed training statistics (NVIDIA's ``training_stats`` pattern).

``report(name, value)`` from anywhere; ``Collector(regex).update()`` on every rank reduces what was
reported since its last update. Pure torch + ``torch.distributed``.
"""

from lightning_ext.stats.collector import Collector, Straggler
from lightning_ext.stats.reporting import clear_statistics, init_multiprocessing, report, report0, set_stage
from lightning_ext.stats.sketch import LogHistogram

__all__ = ["Collector", "LogHistogram", "Straggler", "clear_statistics", "init_multiprocessing", "report",
           "report0", "set_stage"]  # fmt: skip
