"""Our loss scaling for Lightning's ``FSDPStrategy``, which accepts only ``FSDPPrecision`` plugins."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ext.distributed import all_reduce_
from lightning_ext.plugins.loss_scaling_precision import LossScalingPrecision

__all__ = ["LossScalingFSDPPrecision"]


class LossScalingFSDPPrecision(LossScalingPrecision, FSDPPrecision):
    """:class:`LossScalingPrecision`'s loss scaling, skipped steps and telemetry under ``FSDPStrategy``.

    ``Trainer(strategy="fsdp", plugins=[LossScalingFSDPPrecision("16-mixed")])`` replaces
    Lightning's ``FSDPPrecision`` and its ``ShardedGradScaler``. Every rank holds a shard of the
    gradients, so an inf/NaN may be on one rank only: when the scaler has no ``process_group``,
    ``connect()`` (run after the process group exists) gives it the default group, and
    ``found_inf`` is then agreed with one ``all_reduce`` (MAX) per optimizer step, as
    ``ShardedGradScaler`` does, and the gradient health's sums of squares with one more (SUM) when it
    is on. Everything else is :class:`LossScalingPrecision`'s (skipped steps
    hold step-interval LR schedulers, per-optimizer scales, several steps per ``training_step``);
    FSDP's parts are ``FSDPPrecision``'s (``mixed_precision_config``: parameters, gradient
    reduction and buffers in float16/bfloat16 for the mixed precisions; gradient clipping by norm
    is refused, as FSDP needs the root module's ``clip_grad_norm_``).

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``.
        scaler, device, skip_nonfinite, optimizer_names: as for :class:`LossScalingPrecision`.

    Raises:
        ValueError, TypeError: as :class:`LossScalingPrecision`.

    Example::

        >>> from lightning_ext.amp import DynamicLossScaler
        >>> plugin = LossScalingFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cpu", schedule="log2"))
        >>> plugin.mixed_precision_config.reduce_dtype  # gradients reduced in float16
        torch.float16
    """

    _desired_input_dtype = torch.float32  # FSDPPrecision's input and init dtype in these modes

    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        if self.scaler is not None and self.scaler.process_group is None and dist.is_initialized():
            self.scaler.process_group = dist.group.WORLD
        self._shard_group = _shard_group(model)
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def _reduce_squares(self, squares: Tensor) -> Tensor:
        """Each rank holds a shard: the squares of the whole model are their SUM over the ranks that
        split the gradients, FSDP's sharding group (within a node under ``HYBRID_SHARD``; none under
        ``NO_SHARD``, where every rank holds them all)."""
        group = getattr(self, "_shard_group", None)
        if dist.is_initialized() and group is not False:
            group = group or (self.scaler.process_group if self.scaler is not None else None)
            all_reduce_(squares, op=dist.ReduceOp.SUM, group=group or dist.group.WORLD)
        return squares


def _shard_group(model: torch.nn.Module) -> Any:
    """The process group over which FSDP splits ``model``'s gradients: ``False`` when it does not
    (``NO_SHARD``), ``None`` when no ``FullyShardedDataParallel`` is found."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    fsdp = next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)
    if fsdp is None:
        return None
    return False if fsdp.sharding_strategy == ShardingStrategy.NO_SHARD else fsdp.process_group
