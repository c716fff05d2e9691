"""Lightning precision plugin for real fp16 loss scaling (also on CPU) with NaN/Inf step skipping.

``Trainer(plugins=[LossScalingPrecision("16-mixed", scaler=DynamicLossScaler(...))])`` replaces
Lightning's ``MixedPrecision``, which on CPU silently switches ``16-mixed`` to ``bf16-mixed``, logs
nothing about the scale and advances step-interval LR schedulers after skipped steps (Lightning
#5558, #16228).

How a skipped step holds the LR schedulers (Lightning 2.6.6): ``Strategy.setup_precision_plugin``
passes the trainer's ``LRSchedulerConfig`` list through :meth:`Precision.connect`, whose return value
the strategy keeps. :meth:`LossScalingPrecision.connect` returns, for every ``interval="step"``
scheduler, a :class:`~lightning.pytorch.utilities.types.LRSchedulerConfig` subclass whose
``frequency`` reads as an unreachable value while the current batch's optimizer step was skipped.
The training epoch loop calls ``lr_scheduler_step`` only when ``(batch_idx + 1) % frequency == 0``,
so the scheduler is simply not called: no state change and no "``lr_scheduler.step()`` before
``optimizer.step()``" warning. Nothing of torch or Lightning is patched; the scheduler objects and
their checkpoints are the user's own. Limits: ``interval="epoch"`` schedulers are not held (an epoch
is not skipped); in manual optimization Lightning never steps schedulers, so the user consults
``plugin.scaler.last_step_skipped``; with ``frequency > 1`` a skip on the batch that would have
stepped the scheduler postpones that scheduler step to the next multiple of ``frequency``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_ext.amp import DynamicLossScaler

__all__ = ["LossScalingPrecision"]

_PRECISIONS = ("16-mixed", "bf16-mixed", "32-true")
# ``(batch_idx + 1) % _NEVER`` is never 0 for a reachable batch index.
_NEVER = 2**62


class _SkipAwareLRSchedulerConfig(LRSchedulerConfig):
    """An ``LRSchedulerConfig`` whose ``frequency`` is unreachable while ``is_held()`` is true."""

    def __init__(self, config: LRSchedulerConfig, is_held: Callable[[], bool]) -> None:
        self._is_held = is_held
        super().__init__(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @property  # type: ignore[override]
    def frequency(self) -> int:
        return _NEVER if self._is_held() else self._frequency

    @frequency.setter
    def frequency(self, value: int) -> None:
        self._frequency = value


class LossScalingPrecision(Precision):
    """Mixed precision with a :class:`~lightning_ext.amp.DynamicLossScaler`: fp16 loss scaling, NaN/Inf skips.

    * ``"16-mixed"``: fp16 autocast on the model's device (CPU included) and dynamic loss scaling.
    * ``"bf16-mixed"`` / ``"32-true"``: bf16 autocast / none; the scaler runs disabled (scale 1) and
      only skips non-finite steps (``skip_nonfinite=True``) or is absent (``False``).

    Per optimizer step: the gradients are unscaled in one fused pass before
    ``on_before_optimizer_step`` (clipping and callbacks see true gradients), the step is skipped
    when any is non-finite, the scale is updated once (automatic optimization: at the accumulation
    boundary; manual optimization: once at the end of ``training_step`` whatever the number of
    optimizers), and step-interval LR schedulers are not advanced after a skipped step (see the
    module docstring for the mechanism). A skipped step still counts toward ``trainer.global_step``
    and ``max_steps`` (Lightning's semantics). The scaler state is saved in checkpoints.

    Host syncs: the skip decision reads ``found_inf`` once per optimizer step, except for fused
    optimizers (``Adam(fused=True)``), which skip on the device; for those, holding step-interval LR
    schedulers reads the flag once per step (only when such a scheduler exists).

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``.
        scaler: the scaler; default ``DynamicLossScaler(device)`` (GradScaler's schedule) for
            ``"16-mixed"`` and ``DynamicLossScaler(device, enabled=False, skip_nonfinite=True)``
            otherwise, ``device`` being ``"cuda"`` when CUDA is available, else ``"cpu"``. Must be
            enabled for ``"16-mixed"`` and disabled for the others.
        device: ``torch.autocast`` device type (``"cpu"``, ``"cuda"``); default: the model's.
        skip_nonfinite: for ``"bf16-mixed"``/``"32-true"`` without ``scaler``: skip non-finite steps.

    Raises:
        ValueError: unknown ``precision``, or a scaler whose enabled state does not fit it.
        TypeError: ``scaler`` is not a ``DynamicLossScaler``.

    Example::

        >>> plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", schedule="log2"))
        >>> plugin.scaler.schedule, plugin.precision
        ('log2', '16-mixed')
    """

    def __init__(
        self,
        precision: str = "16-mixed",
        scaler: DynamicLossScaler | None = None,
        device: str | None = None,
        skip_nonfinite: bool = True,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"`precision` must be one of {_PRECISIONS}, got {precision!r}")
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(
                f"`scaler` must be a lightning_ext.amp.DynamicLossScaler, got {type(scaler).__name__}. "
                "HINT: torch.amp.GradScaler works with Lightning's own MixedPrecision plugin."
            )
        scaler_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if precision == "16-mixed":
            scaler = scaler if scaler is not None else DynamicLossScaler(scaler_device)
            if not scaler.is_enabled():
                raise ValueError(
                    f"`precision='16-mixed'` needs an enabled scaler, got a disabled {scaler!r}. "
                    "HINT: on CPU build it as DynamicLossScaler('cpu') (GradScaler's default device "
                    "'cuda' disables it without CUDA); use 'bf16-mixed' or '32-true' for unscaled "
                    "training with NaN/Inf skipping."
                )
        else:
            if scaler is None and skip_nonfinite:
                scaler = DynamicLossScaler(scaler_device, enabled=False, skip_nonfinite=skip_nonfinite)
            if scaler is not None and scaler.is_enabled():
                raise ValueError(
                    f"`precision={precision!r}` does not scale the loss, got an enabled {scaler!r}. "
                    "HINT: pass DynamicLossScaler(device, enabled=False, skip_nonfinite=True) to keep "
                    "NaN/Inf step skipping."
                )
        self.precision = precision  # type: ignore[assignment]
        self.scaler = scaler
        self.device = device
        # Whether this batch's optimizer step was skipped: False after training_step starts, None =
        # "ask the scaler" (after an update; free unless the optimizer was fused).
        self._skipped_this_batch: bool | None = False
        self._update_pending = False

    # ----------------------------------------------------------------------------------- setup
    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        if self.device is None:
            param = next(iter(model.parameters()), None)
            self.device = param.device.type if param is not None else "cpu"
        if self.scaler is not None:
            lr_schedulers = [
                _SkipAwareLRSchedulerConfig(config, self._step_was_skipped)
                if isinstance(config, LRSchedulerConfig)
                and config.interval == "step"
                and not isinstance(config, _SkipAwareLRSchedulerConfig)
                else config
                for config in lr_schedulers
            ]
        return model, optimizers, lr_schedulers

    def _step_was_skipped(self) -> bool:
        if self._skipped_this_batch is None:
            assert self.scaler is not None
            self._skipped_this_batch = self.scaler.last_step_skipped
        return self._skipped_this_batch

    # ----------------------------------------------------------------------------------- autocast
    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` for the mixed precisions (cache disabled, as Lightning); a no-op for 32-true."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        return torch.autocast(self.device or "cpu", dtype=dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager():
            yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # Automatic optimization runs training_step inside the optimizer closure, before the step;
        # manual optimization steps inside training_step, so its single update() comes at the end.
        self._skipped_this_batch = False
        with self.forward_context():
            yield
        if self._update_pending:
            assert self.scaler is not None
            self._update_pending = False
            self.scaler.update()
            self._skipped_this_batch = None

    # ----------------------------------------------------------------------------------- backward/step
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                "LossScalingPrecision cannot step LBFGS: its closure re-evaluates the loss inside step(), "
                "after the inf/NaN check. HINT: use '32-true' without a scaler (skip_nonfinite=False)."
            )
        closure_result = closure()
        # training_step returned None in automatic optimization: no backward, nothing to step.
        skip_everything = closure_result is None and model.automatic_optimization
        if not _optimizer_handles_unscaling(optimizer) and not skip_everything:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skip_everything:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        if model.automatic_optimization:
            self.scaler.update()
            self._skipped_this_batch = None
        else:
            self._update_pending = True
        return step_output

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None and _optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping"
                " because it performs unscaling of gradients internally."
                " HINT: Are you using a 'fused' optimizer?"
            )
        super().clip_gradients(
            optimizer=optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    # ----------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
