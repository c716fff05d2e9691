"""lightning_ext.amp: dynamic loss scaling for fp16 training and NaN/Inf step skipping (torch only)."""

from lightning_ext.amp.dynamic_loss_scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler"]
