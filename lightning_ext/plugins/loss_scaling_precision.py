"""Lightning precision plugin for real fp16 loss scaling (also on CPU) with NaN/Inf step skipping.

``Trainer(plugins=[LossScalingPrecision("16-mixed", scaler=DynamicLossScaler(...))])`` replaces
Lightning's ``MixedPrecision``, which on CPU switches ``16-mixed`` to ``bf16-mixed`` (with a warning), logs
nothing about the scale and advances step-interval LR schedulers after skipped steps (Lightning
#5558, #16228).

How a skipped step holds the step-interval LR schedulers (Lightning 2.4–2.6.6): the strategy keeps the
``LRSchedulerConfig`` list returned by :meth:`Precision.connect`, where each ``interval="step"`` config
becomes a subclass whose ``frequency`` reads as an unreachable value while the current batch's
optimizer step was skipped. The training epoch loop calls ``lr_scheduler_step`` only when
``(batch_idx + 1) % frequency == 0`` (an upstream detail this relies on, kept and tested in
``lightning_ext._compat``), so the scheduler is simply not called: no state change, no
"``lr_scheduler.step()`` before ``optimizer.step()``" warning, nothing of torch or Lightning patched;
the scheduler objects and their checkpoints stay the user's. Limits: ``interval="epoch"`` schedulers
are not held (an epoch is not skipped); in manual optimization Lightning never steps schedulers, so
the user reads ``plugin.scaler.last_step_skipped`` (per optimizer:
``scaler.optimizer_scaler(opt).last_step_skipped``); with ``frequency > 1`` a skip on the batch that
would have stepped the scheduler postpones that step to the next multiple of ``frequency``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, get_args

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_ext._checks import check_bool, check_choice
from lightning_ext._compat import UNREACHABLE_FREQUENCY, optimizer_handles_unscaling, unwrapped_optimizer
from lightning_ext.amp import DynamicLossScaler
from lightning_ext.stats import report

__all__ = ["LossScalingPrecision"]

_PrecisionMode = Literal["16-mixed", "bf16-mixed", "32-true"]
_PRECISIONS = get_args(_PrecisionMode)


class _SkipAwareLRSchedulerConfig(LRSchedulerConfig):
    """An ``LRSchedulerConfig`` whose ``frequency`` is unreachable while ``is_held()`` is true."""

    def __init__(self, config: LRSchedulerConfig, is_held: Callable[[], bool]) -> None:
        self._is_held = is_held
        super().__init__(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})

    @property  # type: ignore[override]
    def frequency(self) -> int:
        return UNREACHABLE_FREQUENCY if self._is_held() else self._frequency

    @frequency.setter
    def frequency(self, value: int) -> None:
        self._frequency = value


class LossScalingPrecision(Precision):
    """Mixed precision with a :class:`~lightning_ext.amp.DynamicLossScaler`: fp16 loss scaling, NaN/Inf skips.

    * ``"16-mixed"``: fp16 autocast on the model's device (CPU included) and dynamic loss scaling.
    * ``"bf16-mixed"`` / ``"32-true"``: bf16 autocast / none; the scaler runs disabled (scale 1) and
      only skips non-finite steps (``skip_nonfinite=True``) or is absent (``False``).

    Every optimizer step is one scaled step: its gradients are unscaled in one fused pass before
    ``on_before_optimizer_step`` (clipping and callbacks see true gradients; in manual optimization
    ``self.clip_gradients(opt, ...)`` before ``opt.step()`` unscales them first, unlike Lightning's
    ``MixedPrecision``, which clips the scaled ones), it is skipped when any is non-finite, and then the
    scale that owns it moves: in automatic optimization at the accumulation
    boundary; in manual optimization a per-optimizer scale right after its optimizer's ``step()``, a
    shared scale before the next backward or at the end of ``training_step`` (one backward may feed
    several optimizers' steps, GradScaler's pattern; the gradients of an optimizer that has not stepped
    since, accumulating over batches, are brought to the new scale). An optimizer may step several
    times per ``training_step`` (a WGAN-GP critic loop, StyleGAN2-ADA's lazy regularization), each step
    checked, skipped and counted on its own. A skipped step does not advance step-interval LR
    schedulers (module docstring) but counts toward ``trainer.global_step`` and ``max_steps``.
    Checkpoints hold the scaler's state.

    With one scale per optimizer (``DynamicLossScaler(..., per_optimizer=True)``, StyleGAN2-ADA's GAN
    setup) each backward is scaled by the scale of the optimizer that will step its gradients: the one
    being stepped in automatic optimization; in manual optimization the one named with
    :meth:`backward_for`, else the only one whose parameters require gradients (as after
    ``self.toggle_optimizer(opt)``), else ``ValueError``. Scales are named by ``optimizer_names`` or
    their position in ``configure_optimizers`` (telemetry ``AMP/<name>/...``).

    Gradient health, per optimizer step that was taken (``report()``-ed on the device, no host sync;
    ``Grad/<name>/...`` with several optimizers): ``Grad/norm``, the total L2 norm of the gradients
    UNSCALED and before clipping (a fused optimizer unscales inside its step, so callbacks see its
    gradients scaled; the plugin divides by the scale), at the cost of one read of the gradients;
    with ``update_ratio``, ``Grad/update_ratio`` = ‖Δw‖ / ‖w‖ over the optimizer's parameters with
    gradients (w before the step), at the cost of a copy of those parameters during the step and two
    more reads of them. A skipped step reports neither (its norm is inf or NaN; ``AMP/skipped_steps``
    counts it); a fused optimizer decides on the device, so its skipped steps report too (norm inf or
    NaN, ratio 0). ``LossScalingFSDPPrecision`` sums the squares over the ranks' shards first (one
    ``all_reduce`` per step); under DDP every rank has the whole gradient. Without a scaler
    (``skip_nonfinite=False`` in bf16/fp32) nothing is reported.

    Under DDP every rank skips the same steps without a collective (as with ``torch.amp.GradScaler``):
    DDP's all-reduce leaves every rank the same gradients. Gradients that differ by rank after it (a
    hook or callback writing into ``.grad`` on some ranks, parameters DDP ignores) would let the ranks
    skip different steps and their replicas part: give the scaler the group, e.g.
    ``self.trainer.precision_plugin.scaler.process_group = torch.distributed.group.WORLD`` in
    ``LightningModule.setup``, and ``found_inf`` is agreed by one ``all_reduce`` (MAX) per step, as
    ``LossScalingFSDPPrecision`` does for its shards.

    Host syncs: the skip decision reads ``found_inf`` once per optimizer step, except for fused
    optimizers (``Adam(fused=True)``), which skip on the device; for those, holding step-interval LR
    schedulers reads the flag once per step (only when such a scheduler exists).

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"`` or ``"32-true"``.
        scaler: the scaler; default ``DynamicLossScaler(device)`` (GradScaler's schedule, no bounds)
            for ``"16-mixed"`` and ``DynamicLossScaler(device, enabled=False, skip_nonfinite=True)``
            otherwise, ``device`` being ``"cuda"`` when CUDA is available, else ``"cpu"``. Must be
            enabled for ``"16-mixed"`` and disabled for the others.
        device: ``torch.autocast`` device type (``"cpu"``, ``"cuda"``); default: the model's.
        skip_nonfinite: for ``"bf16-mixed"``/``"32-true"`` without ``scaler``: skip non-finite steps.
            Default ``True``, unlike :class:`~lightning_ext.amp.DynamicLossScaler`'s ``False`` (kept
            for GradScaler compatibility): the plugin replaces Lightning's precision, not a
            GradScaler, so it guards every precision against a non-finite step by default.
        optimizer_names: names of the optimizers' scales with a ``per_optimizer`` scaler (and of their
            gradient health with several optimizers), in the order of ``configure_optimizers``;
            default ``"0"``, ``"1"``, ...
        grad_norm: report ``Grad/norm`` (above).
        update_ratio: report ``Grad/update_ratio`` (above; off by default for its memory).

    Raises:
        ValueError: unknown ``precision``, or a scaler whose enabled state does not fit it.
        TypeError: ``precision`` not a str, ``skip_nonfinite``, ``grad_norm`` or ``update_ratio`` not
            a bool, ``scaler`` not a ``DynamicLossScaler``, ``device`` not a str or None, or
            ``optimizer_names`` not a sequence of distinct non-empty strings.

    Example::

        >>> plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", schedule="log2"))
        >>> plugin.scaler.schedule, plugin.precision
        ('log2', '16-mixed')
    """

    def __init__(
        self,
        precision: _PrecisionMode = "16-mixed",
        scaler: DynamicLossScaler | None = None,
        device: str | None = None,
        skip_nonfinite: bool = True,
        optimizer_names: Sequence[str] | None = None,
        grad_norm: bool = True,
        update_ratio: bool = False,
    ) -> None:
        check_choice(type(self).__name__, "precision", precision, _PRECISIONS)
        if device is not None and not (isinstance(device, str) and device):
            raise TypeError(
                f"{type(self).__name__}: `device` must be a device type str ('cuda', 'cpu': torch.autocast's "
                f"device_type) or None (the model's), got {type(device).__name__} {device!r}"
            )
        for name, value in (("skip_nonfinite", skip_nonfinite), ("grad_norm", grad_norm),
                            ("update_ratio", update_ratio)):  # fmt: skip
            check_bool(type(self).__name__, name, value)
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(
                f"{type(self).__name__}: `scaler` must be a lightning_ext.amp.DynamicLossScaler, got "
                f"{type(scaler).__name__}. "
                "HINT: torch.amp.GradScaler works with Lightning's own MixedPrecision plugin."
            )
        if optimizer_names is not None and (
            isinstance(optimizer_names, str)
            or not all(isinstance(n, str) and n for n in optimizer_names)
            or len(set(optimizer_names)) != len(optimizer_names)
        ):
            raise TypeError(
                f"{type(self).__name__}: `optimizer_names` must be distinct non-empty strings, got "
                f"{optimizer_names!r}"
            )
        self.precision = precision  # type: ignore[assignment]
        self.scaler = _default_scaler(precision, scaler, device, skip_nonfinite)
        self.device = device
        self.optimizer_names = list(optimizer_names) if optimizer_names is not None else None
        self.grad_norm = grad_norm
        self.update_ratio = update_ratio
        self._optimizers: list[Optimizer] = []  # the trainer's, from connect()
        self._backward_optimizer: Optimizer | None = None  # set while a step's closure or backward_for runs
        # Whether this batch's optimizer step was skipped: False after training_step starts, None =
        # "ask the scaler" (after an update; free unless the optimizer was fused).
        self._skipped_this_batch: bool | None = False
        self._update_pending = False  # a step of the shared scale awaits its update
        self._stepped: set[int] = set()  # id(optimizer) of those stepped since the last update
        # id(optimizer) -> its health: unscaled for its next step (manual optimization's clipping, or
        # this step's); None outside optimizer_step (while it runs, clipping finds them unscaled)
        self._unscaled: dict[int, Any] | None = {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={self.precision!r}, scaler={self.scaler!r}, "
            f"device={self.device!r}, optimizer_names={self.optimizer_names!r}, grad_norm={self.grad_norm}, "
            f"update_ratio={self.update_ratio})"
        )

    # ----------------------------------------------------------------------------------- setup
    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        if self.device is None:
            self.device = next((p.device.type for p in model.parameters()), "cpu")
        previous, self._optimizers, self._unscaled = self._optimizers, list(optimizers), {}
        if self.scaler is None:
            return model, optimizers, lr_schedulers
        if self.scaler.per_optimizer:
            names = self._names()
            if len(names) != len(optimizers):
                raise ValueError(
                    f"{type(self).__name__}: `optimizer_names` names {len(names)} optimizers, "
                    "configure_optimizers gave "
                    f"{len(optimizers)}: {names!r}"
                )
            for optimizer in previous:  # a new fit's optimizers (made again) carry their scales on
                self.scaler.unregister_optimizer(optimizer)
            for optimizer, name in zip(optimizers, names):
                self.scaler.register_optimizer(optimizer, name)
        lr_schedulers = [
            _SkipAwareLRSchedulerConfig(config, self._step_was_skipped)
            if isinstance(config, LRSchedulerConfig)
            and config.interval == "step"
            and not isinstance(config, _SkipAwareLRSchedulerConfig)
            else config
            for config in lr_schedulers
        ]
        return model, optimizers, lr_schedulers

    def _names(self) -> list[str]:
        """The per-optimizer scales' names, in the order of ``configure_optimizers``."""
        return self.optimizer_names or [str(i) for i in range(len(self._optimizers))]

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
        self._skipped_this_batch = False
        with self.forward_context():
            yield
        if self.scaler is not None:
            self._update()

    # ----------------------------------------------------------------------------------- backward/step
    @contextlib.contextmanager
    def backward_for(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """Scale the backward passes inside by the scale of ``optimizer`` (a ``per_optimizer`` scaler).

        For manual optimization when the optimizer cannot be told from the parameters that require
        gradients, e.g. a generator loss that also flows through the discriminator without
        ``toggle_optimizer``::

            with self.trainer.precision_plugin.backward_for(opt_g):
                self.manual_backward(loss_g)

        Raises:
            TypeError: ``optimizer`` is not one of the trainer's optimizers.
        """
        optimizer = unwrapped_optimizer(optimizer)  # (self.optimizers() gives Lightning's wrappers)
        if self._optimizers and not any(optimizer is o for o in self._optimizers):
            raise TypeError(
                f"{type(self).__name__}.backward_for: `optimizer` must be one of the trainer's optimizers, "
                f"got {optimizer!r:.80}"
            )
        previous, self._backward_optimizer = self._backward_optimizer, optimizer
        try:
            yield
        finally:
            self._backward_optimizer = previous

    def _owner(self) -> Optimizer:
        """The optimizer whose scale scales this backward (see the class docstring)."""
        if self._backward_optimizer is not None:
            return self._backward_optimizer
        owners = [
            o for o in self._optimizers if any(p.requires_grad for g in o.param_groups for p in g["params"])
        ]
        if len(self._optimizers) == 1 or len(owners) == 1:
            return (owners or self._optimizers)[0]
        names = [self._names()[self._optimizers.index(o)] for o in owners or self._optimizers]
        raise ValueError(
            f"LossScalingPrecision with per-optimizer scales cannot tell which optimizer steps the "
            f"gradients of this backward: parameters of the optimizers {names} require grad. HINT: call "
            "self.toggle_optimizer(opt) before self.manual_backward(loss), or wrap it in `with "
            "self.trainer.precision_plugin.backward_for(opt):`."
        )

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            if self._unscaled:
                raise RuntimeError(
                    "LossScalingPrecision: self.clip_gradients(opt) unscaled the gradients of an optimizer "
                    "that has not stepped since, and another backward would add scaled gradients to them. "
                    "HINT: clip once per step, after the last backward, right before opt.step()"
                )
            self._update()  # a shared scale moves before the next backward, not between two steps
            owner = self._owner() if self.scaler.per_optimizer else None
            tensor = self.scaler.scale(tensor, optimizer=owner)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                "LossScalingPrecision cannot step LBFGS: its closure re-evaluates the loss inside step(), "
                "after the inf/NaN check. HINT: use '32-true' without a scaler (skip_nonfinite=False)."
            )
        with self.backward_for(optimizer) if model.automatic_optimization else contextlib.nullcontext():
            closure_result = closure()
        # training_step returned None in automatic optimization: no backward, nothing to step.
        skip_everything = closure_result is None and model.automatic_optimization
        if not skip_everything:
            self._unscale(optimizer)  # (done already where manual optimization clipped)
        health, unscaled, self._unscaled = self._unscaled.pop(id(optimizer), None), self._unscaled, None
        try:
            self._after_closure(model, optimizer)  # (its clipping finds them unscaled, or skipped)
        finally:
            self._unscaled = unscaled
        if skip_everything:
            return closure_result
        stepped: list[bool] = []  # optimizer.step ran: the step was taken (or a fused one decided)
        hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
        try:
            step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        finally:
            hook.remove()
        if health is not None:
            self._report_health(optimizer, *health, taken=bool(stepped))
        self._update_pending = True
        self._stepped.add(id(optimizer))
        if self.scaler.per_optimizer or model.automatic_optimization:
            self._update(optimizer)
        return step_output

    def _unscale(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients for its next step (not a fused optimizer's: it does) and
        measure their health then, before any clipping; once per step."""
        if id(optimizer) not in self._unscaled:
            if not optimizer_handles_unscaling(optimizer):
                self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
            self._unscaled[id(optimizer)] = self._health_before_step(optimizer)

    # ----------------------------------------------------------------------------------- gradient health
    def _health_before_step(self, optimizer: Optimizer) -> tuple[Tensor, list[Tensor] | None] | None:
        """The squared norm of ``optimizer``'s unscaled gradients (float32 0-dim, on their device; a
        fused optimizer's are still scaled: divided here) and, with ``update_ratio``, a copy of its
        parameters that have gradients. No host sync."""
        if not (self.grad_norm or self.update_ratio):
            return None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params]  # (repeated
        # indices of an uncoalesced gradient summed before they are squared)
        squares = _sum_of_squares(grads)
        scale = self._scale_of(optimizer)
        if scale is not None and optimizer_handles_unscaling(optimizer):
            squares = squares / scale.to(squares.device).double().square().float()
        return squares, [p.detach().clone() for p in params] if self.update_ratio else None

    def _scale_of(self, optimizer: Optimizer) -> Tensor | None:
        """The scale of ``optimizer``'s gradients (``None``: not scaled)."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        scaler = self.scaler.optimizer_scaler(optimizer) if self.scaler.per_optimizer else self.scaler
        return scaler.scale_tensor

    def _report_health(
        self, optimizer: Optimizer, grad_squares: Tensor, before: list[Tensor] | None, taken: bool
    ) -> None:
        """``report()`` the gradient norm and the update-to-weight ratio of a taken step (no host sync)."""
        values = [grad_squares]
        if before is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            values.append(_sum_of_squares(before).to(grad_squares.device))  # ||w||^2 before the step
            for old, new in zip(before, params):
                old.sub_(new.detach())  # -Δw, in the copy's memory
            values.append(_sum_of_squares(before).to(grad_squares.device))
        norms = self._reduce_squares(torch.stack(values)).sqrt()
        if not taken:
            return  # the scaler counts it (AMP/skipped_steps); its norm is inf or NaN
        several = len(self._optimizers) > 1
        prefix = f"Grad/{self._names()[self._optimizers.index(optimizer)]}/" if several else "Grad/"
        if self.grad_norm:
            report(prefix + "norm", norms[0])
        if before is not None:
            report(prefix + "update_ratio", norms[2] / norms[1])

    def _reduce_squares(self, squares: Tensor) -> Tensor:
        """Sums of squares of this rank's gradients and parameters -> those of the whole model (the
        same on every rank: DDP replicates both)."""
        return squares

    def _update(self, optimizer: Optimizer | None = None) -> None:
        """Move the scale for the steps since the last update (only ``optimizer``'s own, if given)."""
        if self._update_pending:
            held = self._held_gradients() if optimizer is None else []
            before = self.scaler.scale_tensor.clone() if held else None
            self.scaler.update(optimizer=optimizer)
            if before is not None:  # at the new scale, as the next backward adds to them (no host sync)
                ratio = (self.scaler.scale_tensor.double() / before.double()).float()
                for grad in held:
                    grad.mul_(ratio.to(grad.device, grad.dtype))
            self._update_pending = False
            self._skipped_this_batch = None
        self._stepped.clear()

    def _held_gradients(self) -> list[Tensor]:
        """The scaled gradients of the optimizers that did not step since the last update of a shared
        scale (manual optimization accumulating for one optimizer while another steps)."""
        if self.scaler.per_optimizer or self.scaler.scale_tensor is None or len(self._optimizers) < 2:
            return []
        done = self._stepped | set(self._unscaled or {})  # (unscaled ones wait for their step, unscaled)
        held = [o for o in self._optimizers if id(o) not in done]
        return [p.grad for o in held for g in o.param_groups for p in g["params"] if p.grad is not None]

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        optimizer = unwrapped_optimizer(optimizer)  # (manual optimization's LightningOptimizer)
        if clip_val > 0 and self.scaler is not None and optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping"
                " because it performs unscaling of gradients internally."
                " HINT: Are you using a 'fused' optimizer?"
            )
        if clip_val > 0 and self.scaler is not None and self._unscaled is not None:  # manual optimization
            self._unscale(optimizer)  # clips before the step: unscale first
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # ----------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of another of our plugins (``LossScalingPrecision`` into
        ``LossScalingFSDPPrecision``, or a subclass) or of Lightning's ``MixedPrecision``
        (``FSDPPrecision``) resumes with its scale and counters (Lightning reads a plugin's state under
        the plugin's class name only: the scale went back to ``init_scale``); per-optimizer scales start
        at ``init_scale`` from Lightning's one scale, said in a warning."""
        ours = ("LossScalingPrecision", "LossScalingFSDPPrecision")
        found = next((key for key in (*ours, "MixedPrecision", "FSDPPrecision") if checkpoint.get(key)), None)
        if type(self).__qualname__ in checkpoint or found is None or self.scaler is None:
            return
        theirs = checkpoint[found]
        if self.scaler.per_optimizer and found not in ours:
            rank_zero_warn(
                "LossScalingPrecision: the checkpoint holds one loss scale of Lightning's precision plugin; "
                "the per-optimizer scales start at init_scale"
            )
            return
        self.load_state_dict(theirs)


def _default_scaler(
    precision: str, scaler: DynamicLossScaler | None, device: str | None, skip_nonfinite: bool
) -> DynamicLossScaler | None:
    """``scaler``, or the default for ``precision``; raises when its enabled state does not fit."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if precision == "16-mixed":
        scaler = scaler if scaler is not None else DynamicLossScaler(device)
        if not scaler.is_enabled():
            raise ValueError(
                f"`precision='16-mixed'` needs an enabled scaler, got a disabled {scaler!r}. "
                "HINT: on CPU build it as DynamicLossScaler('cpu') (GradScaler's default device "
                "'cuda' disables it without CUDA); use 'bf16-mixed' or '32-true' for unscaled "
                "training with NaN/Inf skipping."
            )
        return scaler
    if scaler is None and skip_nonfinite:
        scaler = DynamicLossScaler(device, enabled=False, skip_nonfinite=True)
    if scaler is not None and scaler.is_enabled():
        raise ValueError(
            f"`precision={precision!r}` does not scale the loss, got an enabled {scaler!r}. "
            "HINT: pass DynamicLossScaler(device, enabled=False, skip_nonfinite=True) to keep "
            "NaN/Inf step skipping."
        )
    return scaler


def _sum_of_squares(tensors: list[Tensor]) -> Tensor:
    """``sum(||t||^2)`` in float32 (a 0-dim tensor on the first tensor's device, 0 without tensors)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    device = tensors[0].device
    norms = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32).to(device) for t in tensors]
    return torch.stack(norms).square().sum()
