"""lightning_ext.stats: distributed training statistics (NVIDIA ``training_stats`` pattern, fixed).

``report(name, value)`` from anywhere; ``Collector(regex).update()`` on every rank reduces what was
reported since its last update with two overlapping all-reduces in the steady state, whatever the
number of names. Pure torch + ``torch.distributed``.
"""

from lightning_ext.stats.collector import Collector
from lightning_ext.stats.reporting import init_multiprocessing, report, report0, reset

__all__ = ["Collector", "init_multiprocessing", "report", "report0", "reset"]
