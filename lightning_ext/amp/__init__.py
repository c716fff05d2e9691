"""lightning_ext.amp: dynamic loss scaling (a ``torch.amp.GradScaler`` subclass) and schedules. Pure torch."""

from lightning_ext.amp.dynamic_loss_scaler import DynamicLossScaler
from lightning_ext.amp.per_optimizer_loss_scaler import PerOptimizerLossScaler

__all__ = ["DynamicLossScaler", "PerOptimizerLossScaler"]
