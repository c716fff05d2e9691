"""lightning_ext.plugins"""

from lightning_ext.plugins.fsdp_precision import LossScalingFSDPPrecision
from lightning_ext.plugins.loss_scaling_precision import LossScalingPrecision
from lightning_ext.plugins.sync_batch_norm_plugin import SyncBatchNormPlugin

__all__ = ["LossScalingFSDPPrecision", "LossScalingPrecision", "SyncBatchNormPlugin"]
