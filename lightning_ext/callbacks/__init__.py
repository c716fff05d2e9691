"""lightning_ext.callbacks"""

from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.callbacks.hook_runner import HookRunner
from lightning_ext.callbacks.iteration_timer import IterationTimer
from lightning_ext.callbacks.loss_monitor import LossMonitor
from lightning_ext.callbacks.precise_bn import PreciseBN
from lightning_ext.callbacks.resource_stats import ResourceStats
from lightning_ext.callbacks.throughput import Throughput
from lightning_ext.callbacks.training_stats import TrainingStats

__all__ = [
    "HookBase",
    "HookRunner",
    "IterationTimer",
    "LossMonitor",
    "PreciseBN",
    "ResourceStats",
    "Throughput",
    "TrainingStats",
]
