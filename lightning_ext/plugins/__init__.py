"""lightning_ext.plugins"""

from lightning_ext.plugins.loss_scaling_precision import LossScalingPrecision

__all__: list[str] = ["LossScalingPrecision"]
