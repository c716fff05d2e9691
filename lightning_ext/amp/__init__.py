"""lightning_ext.amp: dynamic loss scaling (a ``torch.amp.GradScaler`` subclass) and schedules. Pure torch."""

from lightning_ext.amp.dynamic_loss_scaler import DynamicLossScaler, PerOptimizerLossScaler

__all__ = ["DynamicLossScaler", "PerOptimizerLossScaler"]
