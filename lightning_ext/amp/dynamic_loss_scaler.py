"""``DynamicLossScaler``: ``torch.amp.GradScaler`` with schedules, bounds, telemetry, per-optimizer scales
(``PerOptimizerLossScaler``, what ``DynamicLossScaler(per_optimizer=True)`` makes).

The schedules are the pure functions of :mod:`lightning_ext.amp.schedules`. The gradient pass runs
through the kernel backend of the gradients' device (the ops ``unscale_and_check_``, and the read-only
``check_finite`` for fused optimizers, where GradScaler rewrites every gradient at scale 1: see
:mod:`lightning_ext.kernels.unscale`). State lives on the device as 0-dim tensors and ``update`` runs
there without a host sync, as GradScaler's does. As a GradScaler subclass it uses GradScaler's private
state and hooks: those listed in ``lightning_ext._compat`` (``GRAD_SCALER_*``), tested there.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from torch.amp import GradScaler
from torch.optim import Optimizer

from lightning_ext._checks import as_number, check_bool, check_choice, check_device, check_int, check_number
from lightning_ext._compat import (
    GradScalerStage,
    new_optimizer_state,
    optimizer_handles_unscaling,
    sparse_values,
    unwrapped_optimizer,
)
from lightning_ext.amp import schedules
from lightning_ext.distributed import all_reduce_, check_process_group, is_distributed
from lightning_ext.kernels import get_backend
from lightning_ext.stats import report

__all__ = ["DynamicLossScaler", "PerOptimizerLossScaler"]

_Schedule = Literal["exponential", "log2"]
_MinScalePolicy = Literal["warn", "raise", "clamp"]
_SCHEDULES, _POLICIES = get_args(_Schedule), get_args(_MinScalePolicy)
# Our options in the state dict, and all our options (the keyword-only arguments but per_optimizer, kept
# as attributes of their names), which a per-optimizer scale copies from its parent.
_CONFIG = ("schedule", "log2_increment", "log2_decrement", "hysteresis", "consecutive_hysteresis",
           "min_scale", "max_scale")  # fmt: skip
_OPTIONS = (*_CONFIG, "on_min_scale", "skip_nonfinite", "process_group", "telemetry")
_COUNTERS = ("steps", "skipped_steps", "consecutive_overflows")  # int in the state dict, float64 on device
# Our device state beyond GradScaler's ``_scale``/``_growth_tracker``: name -> dtype.
_DEVICE_STATE = {
    "log2_scale": torch.float64,  # log2 of the scale; the authoritative value of the "log2" schedule
    "hysteresis_tracker": torch.int32,  # overflows still tolerated before a back-off
    "steps": torch.float64,  # optimizer steps counted by update(), taken or skipped
    "skipped_steps": torch.float64,  # of which skipped (non-finite gradients)
    "consecutive_overflows": torch.float64,  # skipped steps in a row, up to the last update
    "found_inf": torch.float32,  # the last update's combined flag
}


# The rule of each constructor argument and state-dict entry, by name: the constructor and
# load_state_dict check with the same rules and messages (_check).
_F32_MAX = torch.finfo(torch.float32).max
_RULES: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    **dict.fromkeys(("init_scale", "log2_increment", "log2_decrement"), (check_number, {"gt": 0.0})),
    **dict.fromkeys(("min_scale", "max_scale"), (check_number, {"gt": 0.0, "optional": True})),
    "scale": (check_number, {"ge": 0.0}),  # a state's scale: 0 once a diverged run underflowed
    "growth_factor": (check_number, {"gt": 1.0}),
    "backoff_factor": (check_number, {"gt": 0.0, "lt": 1.0}),
    "growth_interval": (check_int, {"ge": 1}),
    "hysteresis": (check_int, {"ge": 1, "le": 2**31 - 1}),  # (its tracker is an int32 device tensor)
    **dict.fromkeys(("_growth_tracker", *_COUNTERS), (check_int, {"ge": 0})),
    "schedule": (check_choice, {"choices": _SCHEDULES}),
    "on_min_scale": (check_choice, {"choices": _POLICIES}),
    **dict.fromkeys(("enabled", "consecutive_hysteresis", "skip_nonfinite", "telemetry", "per_optimizer",
                     "last_step_skipped"), (check_bool, {})),
}  # fmt: skip
# The keys of our state dict (GradScaler's come with them when enabled): all are needed to load one.
_STATE_KEYS = (*_CONFIG, "log2_scale", "_hysteresis_tracker", *_COUNTERS, "last_step_skipped")
# GradScaler's update() errors: before the scale exists, and without a step since the last update
_NO_SCALE = ("Attempted update but _scale is None.  This may indicate your script did not use "
             "scaler.scale(loss or outputs) earlier in the iteration.")  # fmt: skip
_NO_STEP = "No inf checks were recorded prior to update."
_GRAD_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _log2(scale: float) -> float:
    """``log2(scale)`` of a scale ``>= 0``; ``-inf`` for a scale that underflowed to 0."""
    return math.log2(scale) if scale > 0 else -math.inf


def _is_ours(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` is a :meth:`DynamicLossScaler.state_dict` (else a ``torch.amp.GradScaler``'s)."""
    return not set(_STATE_KEYS).isdisjoint(state)


def _check(owner: str, values: Mapping[str, Any]) -> None:
    """Check ``values``, constructor arguments or state-dict entries, by the rules of their names, then
    that ``min_scale <= init_scale (or scale) <= max_scale``: :class:`DynamicLossScaler`'s errors."""
    for key, value in values.items():
        if key in _RULES:
            check, bounds = _RULES[key]
            check(owner, key, value, **bounds)
    for key in ("init_scale", "min_scale", "max_scale"):  # the scale is a float32 tensor
        if values.get(key) is not None and not 2.0**-149 <= values[key] <= _F32_MAX:
            raise ValueError(
                f"{owner}: `{key}` must be a finite number float32 holds, in [2**-149, {_F32_MAX:.4g}], got "
                f"{values[key]!r}"
            )
    scale = "init_scale" if "init_scale" in values else "scale"
    low, high = values.get("min_scale") or 0.0, values.get("max_scale") or math.inf
    if low > high or not low <= values.get(scale, low) <= high:
        raise ValueError(
            f"{owner}: need min_scale <= {scale} <= max_scale, got min_scale={values.get('min_scale')!r}, "
            f"{scale}={values.get(scale)!r}, max_scale={values.get('max_scale')!r}"
        )


def _device_type(owner: str, device: Any) -> str:
    """The device type of ``device``, a str or a ``torch.device`` (``"cuda:1"``: ``"cuda"``; GradScaler
    takes both, and its scale lives on the gradients' device whatever the index)."""
    return check_device(owner, "device", device).type


def _as_flag(value: Any) -> Any:
    """``enabled`` given as ``0``/``1`` (an argparse flag) or a NumPy bool, as a bool (GradScaler takes
    any truth value); anything else as it is (then checked)."""
    value = as_number(value)
    return bool(value) if type(value) is int and value in (0, 1) else value


def _counter(name: str, doc: str) -> property:
    """The read-only property of the counter ``name`` of ``_DEVICE_STATE``, as an int."""
    return property(lambda self: int(self._read_device_state()[name]), doc=f"{doc} Syncs host and device.")


def _over_children(combine: Callable[[Any], Any], name: str, doc: str) -> property:
    """The read-only property ``name`` of a per-optimizer scaler: ``combine`` of its scalers' values."""
    return property(lambda self: combine(getattr(c, name) for c in self._children.values()),
                    doc=f"{doc} Syncs host and device.")  # fmt: skip


def _check_optimizer(optimizer: Any) -> Any:
    """``optimizer``, or the one inside Lightning's or Fabric's wrapper of it (a scale belongs to the
    optimizer inside: :func:`~lightning_ext._compat.unwrapped_optimizer`); ``TypeError`` for anything
    else."""
    if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__} {optimizer!r:.60}"
        )
    return unwrapped_optimizer(optimizer)


def _combined(state: dict[str, Any]) -> Tensor:
    """The sum of an optimizer state's per-device ``found_inf`` flags, on the first one's device."""
    flags = list(state["found_inf_per_device"].values())
    if not flags:
        return torch.zeros((), dtype=torch.float32)
    return sum((f.to(flags[0].device, non_blocking=True) for f in flags[1:]), flags[0])


class _PerOptimizerNew:
    """``DynamicLossScaler(..., per_optimizer=True)`` makes a :class:`PerOptimizerLossScaler`: the
    ``__new__`` of a base class, so that ``DynamicLossScaler``'s signature (for ``inspect`` and
    jsonargparse, hence ``LightningCLI``) stays its ``__init__``'s."""

    def __new__(cls, *args: Any, per_optimizer: bool = False, **kwargs: Any) -> Any:
        if per_optimizer is True and cls is DynamicLossScaler:
            cls = PerOptimizerLossScaler
        return super().__new__(cls)


class DynamicLossScaler(_PerOptimizerNew, GradScaler):
    """A ``torch.amp.GradScaler`` with log2/hysteresis schedules, bounds, telemetry and per-optimizer scales.

    A subclass with GradScaler's signature, state and methods, so code (and torch's own tests) written
    for GradScaler runs on it unchanged; with GradScaler's arguments only it is GradScaler (the same
    scales bit for bit, skips and state dict), every extra being keyword-only and opt-in. Use it
    wherever GradScaler is used (plain loops, Fabric, Lightning's ``MixedPrecision(scaler=...)``) or
    through :class:`lightning_ext.plugins.LossScalingPrecision`.

    Args:
        device: device type of the gradients, as GradScaler's (``"cuda"`` without CUDA disables the
            scaler with a warning, as GradScaler does: pass ``"cpu"`` on CPU); a str or a
            ``torch.device``, whose index is ignored (the scale lives on the gradients' device).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: GradScaler's (NumPy
            scalars and 0-dim tensors taken as the numbers they hold, here and in the options below;
            ``enabled`` also as ``0``/``1``).
        schedule: ``"exponential"`` (GradScaler) or ``"log2"`` (StyleGAN2-ADA).
        log2_increment: ``"log2"``: the ``log2(scale)`` increase per clean step.
        log2_decrement: ``"log2"``: the ``log2(scale)`` decrease per back-off.
        hysteresis: back off on the ``hysteresis``-th overflow since the last growth (Megatron-LM);
            ``1`` backs off on every overflow (GradScaler). Every overflowing step is skipped.
        consecutive_hysteresis: count ``hysteresis`` over consecutive overflows only: every clean
            step restores the tolerance, not only a growth (DeepSpeed's ``consecutive_hysteresis``).
            The ``"log2"`` schedule grows at every clean step, so it behaves so either way.
        min_scale: the scale's lower bound; ``None`` (default): unbounded, as GradScaler.
        max_scale: the scale's upper bound; ``None`` (default): unbounded, as GradScaler.
        on_min_scale: an overflow that would take the scale below ``min_scale``: ``"clamp"`` (stay at
            the floor), ``"warn"`` (stay and warn, once until the scale rises above the floor again)
            or ``"raise"`` (``FloatingPointError``). The last two read two flags to the host at every
            update, one sync (only with ``min_scale``).
        skip_nonfinite: with ``enabled=False``: still check the gradients (read-only) and skip
            non-finite steps, scale fixed at 1 (bf16/fp32 training). Default ``False``, unlike
            :class:`~lightning_ext.plugins.LossScalingPrecision`'s ``True``: a drop-in for GradScaler
            must pass a disabled scaler's steps through as GradScaler does.
        process_group: the group whose ranks hold shards of the same gradients (FSDP, ZeRO):
            ``found_inf`` is MAX-reduced over it at every ``unscale_`` (one small all_reduce).
            ``None`` for replicated gradients (DDP; but gradients that a hook or callback changes on
            some ranks after DDP's all-reduce need the group too).
        telemetry: :func:`~lightning_ext.stats.report` at every update ``AMP/loss_scale_log2``,
            ``AMP/overflow`` (0/1; its mean is the overflow frequency) and ``AMP/skipped_steps``
            (running total); with ``per_optimizer``, ``AMP/<name>/...`` per optimizer.
        per_optimizer: ``True`` makes a :class:`~lightning_ext.amp.PerOptimizerLossScaler`: one
            scale, growth tracker and set of counters per optimizer (StyleGAN2-ADA); :meth:`scale`
            then needs ``optimizer=``.

    Raises:
        TypeError: a numeric argument is not a finite number of the right type, ``device`` not a str
            or a ``torch.device``,
            a flag (``enabled``, ``consecutive_hysteresis``, ``skip_nonfinite``, ``telemetry``,
            ``per_optimizer``) not a bool, ``schedule`` or ``on_min_scale`` not a str, or
            ``process_group`` not a process group.
        ValueError: ``growth_factor <= 1``, ``backoff_factor`` outside ``(0, 1)``, an interval or
            ``hysteresis < 1`` (or ``hysteresis >= 2**31``), non-positive increments, a scale or bound
            float32 does not hold (outside ``[2**-149, 3.4e38]``), ``init_scale`` outside the bounds,
            an unknown ``schedule`` / ``on_min_scale``, or a
            ``device`` that is not a device type.

    Tiny scales and scale 0: without ``min_scale`` a run whose gradients stay non-finite backs the
    float32 scale off until it underflows to 0 (from ``2**16`` in 166 steps, as GradScaler's does).
    Below a scale of about ``2**-128`` (0 included) ``1/scale`` is inf in float32, so every step counts
    as an overflow and is skipped, weights untouched: GradScaler takes those steps and writes inf/NaN
    into the weights (ATen's check reads the gradients before multiplying them by ``1/scale``). The
    scale then only backs off; at 0 the ``"exponential"`` schedule's ``log2_scale`` is ``-inf``, the
    ``"log2"`` schedule's stays its finite float64 value and keeps counting back-offs (``-150``,
    ``-151``, ...), so it records how far the run fell. Every such state round-trips through
    :meth:`state_dict` and a checkpoint. Set ``min_scale`` to stop above that (no default sets it,
    :class:`~lightning_ext.plugins.LossScalingPrecision`'s scaler included). Growth is refused
    where the float32 scale would not be finite, for both schedules.

    Host syncs are GradScaler's (the skip decision of a non-fused optimizer's step; ``get_scale``,
    ``state_dict``) plus the documented ones of :meth:`update` (floor policy) and the properties.

    Example::

        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler("cpu", init_scale=2.0**10, schedule="log2", telemetry=False)
        >>> scaler.scale(model(torch.ones(2, 3)).square().mean()).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.state_dict()["log2_scale"] == 10 + 1e-3, scaler.last_step_skipped
        (True, False)
    """

    per_optimizer = False  # True on PerOptimizerLossScaler (what DynamicLossScaler(per_optimizer=True) is)

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        schedule: _Schedule = "exponential",
        log2_increment: float = 1e-3,
        log2_decrement: float = 1.0,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: _MinScalePolicy = "warn",
        skip_nonfinite: bool = False,
        process_group: dist.ProcessGroup | None = None,
        telemetry: bool = True,
        per_optimizer: bool = False,
    ) -> None:
        device, enabled = _device_type(type(self).__name__, device), _as_flag(enabled)
        init_scale, growth_factor, backoff_factor, growth_interval = (  # (GradScaler takes NumPy numbers
            as_number(x) for x in (init_scale, growth_factor, backoff_factor, growth_interval)  # and 0-dim
        )  # tensors; so do the options of ours)
        log2_increment, log2_decrement, hysteresis, min_scale, max_scale = (
            as_number(x) for x in (log2_increment, log2_decrement, hysteresis, min_scale, max_scale)
        )
        owner, arguments = type(self).__name__, locals()
        _check(owner, arguments)  # every argument by the rule of its name, as load_state_dict's entries
        check_process_group(process_group)
        if per_optimizer != self.per_optimizer:
            raise ValueError(
                f"{owner} takes per_optimizer={self.per_optimizer}, got {per_optimizer!r}. "
                "HINT: DynamicLossScaler(per_optimizer=True) makes a PerOptimizerLossScaler."
            )
        # GradScaler's fallback without CUDA, with a warning naming this class (GradScaler's names its own).
        if enabled and device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "DynamicLossScaler('cuda') is enabled, but CUDA is not available: disabling it (as "
                "torch.amp.GradScaler does). HINT: use DynamicLossScaler('cpu') to scale losses on CPU.",
                stacklevel=2,
            )
            enabled = False
        # GradScaler sets its settings and state only when enabled, and the skip-only mode needs them
        # too (scale 1): built enabled for "cpu" (the CUDA check is above), then given both.
        init_scale = float(init_scale) if enabled else 1.0
        super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled=True)
        self._device, self._enabled = device, enabled
        for key in _OPTIONS:  # our options, as attributes of their names (self.schedule, ...)
            setattr(self, key, arguments[key])
        self._name: str | None = None  # telemetry prefix AMP/<name>/ of a per-optimizer scale
        self._device_state: dict[str, Tensor] | None = None  # _DEVICE_STATE, created with _scale
        self._start: dict[str, float] = {"hysteresis_tracker": hysteresis}  # loaded/unpickled values
        self._floor_warned = False  # on_min_scale="warn" warned since the scale last left the floor

    # ------------------------------------------------------------------ configuration
    growth_factor = property(GradScaler.get_growth_factor, doc="GradScaler's growth factor.")
    backoff_factor = property(GradScaler.get_backoff_factor, doc="GradScaler's backoff factor.")
    growth_interval = property(GradScaler.get_growth_interval, doc="GradScaler's growth interval.")

    def __setattr__(self, key: str, value: Any) -> None:
        """An option set as an attribute (``scaler.hysteresis = 2``, as the load warning tells to change
        one on a resume) is checked as the constructor's argument: a value the scaler would refuse to
        load from its own checkpoint is refused here. A switch to the ``"log2"`` schedule starts from the
        current scale."""
        if key in _OPTIONS and key in _RULES:
            value = as_number(value)
            _check(f"{type(self).__name__}.{key}", {key: value})
        switch = key == "schedule" and value == "log2" and self.__dict__.get("schedule") not in (None, "log2")
        super().__setattr__(key, value)
        if switch and self.__dict__.get("_device_state") is not None and self._scale is not None:
            self._device_state["log2_scale"].copy_(torch.log2(self._scale.double()))  # (exponential: stale)

    def set_growth_factor(self, new_factor: float) -> None:
        """GradScaler's, checked as the constructor's ``growth_factor`` (``ValueError``/``TypeError``)."""
        super().set_growth_factor(self._checked("set_growth_factor", "growth_factor", new_factor))

    def set_backoff_factor(self, new_factor: float) -> None:
        """GradScaler's, checked as the constructor's ``backoff_factor`` (``ValueError``/``TypeError``)."""
        super().set_backoff_factor(self._checked("set_backoff_factor", "backoff_factor", new_factor))

    def set_growth_interval(self, new_interval: int) -> None:
        """GradScaler's, checked as the constructor's ``growth_interval`` (``ValueError``/``TypeError``)."""
        super().set_growth_interval(self._checked("set_growth_interval", "growth_interval", new_interval))

    def _checked(self, method: str, key: str, value: Any) -> Any:
        """``value`` for the setting ``key`` (a NumPy scalar or 0-dim tensor as its number), checked by
        its rule: a value the scaler would refuse to load from its own checkpoint is refused here."""
        value = as_number(value)
        _check(f"{type(self).__name__}.{method}", {key: value})
        return value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._device!r}, init_scale={self._init_scale!r}, growth_factor="
            f"{self._growth_factor!r}, backoff_factor={self._backoff_factor!r}, growth_interval="
            f"{self._growth_interval!r}, enabled={self._enabled!r}, schedule={self.schedule!r}, "
            f"hysteresis={self.hysteresis!r}, min_scale={self.min_scale!r}, max_scale={self.max_scale!r})"
        )

    @property
    def _checks(self) -> bool:
        """Whether gradients are checked (scaling enabled, or the skip-only mode)."""
        return self._enabled or self.skip_nonfinite

    # ------------------------------------------------------------------ per-optimizer scales
    def register_optimizer(self, optimizer: Optimizer, name: str) -> None:
        """Name ``optimizer``'s scale: see :class:`~lightning_ext.amp.PerOptimizerLossScaler`.

        Raises:
            ValueError: always on a shared scale (``per_optimizer=False``).
        """
        raise ValueError("register_optimizer() needs DynamicLossScaler(per_optimizer=True)")

    def optimizer_scaler(self, optimizer: Optimizer) -> DynamicLossScaler:
        """``optimizer``'s own scaler: see :class:`~lightning_ext.amp.PerOptimizerLossScaler`.

        Raises:
            ValueError: always on a shared scale (``per_optimizer=False``).
        """
        raise ValueError("optimizer_scaler() needs DynamicLossScaler(per_optimizer=True)")

    # ------------------------------------------------------------------ device state
    def _start_values(self) -> dict[str, float]:
        """``_DEVICE_STATE``'s starting values: zero counters, the initial scale's log2, then ``_start``
        (what a loaded state dict or unpickling gives)."""
        return {**dict.fromkeys(_DEVICE_STATE, 0), "log2_scale": _log2(self._init_scale), **self._start}

    # Eager under torch.compile (a graph break, as at GradScaler's host reads): inductor drops in-place
    # updates of 0-dim float64 CPU tensors held outside the graph (torch 2.13), which the device state is
    @torch.compiler.disable
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._device_state = {
            name: torch.empty((), dtype=dtype, device=dev) for name, dtype in _DEVICE_STATE.items()
        }
        self._fill_device_state()

    def _fill_device_state(self) -> None:
        """Write :meth:`_start_values` into the device state; the log2 schedule's scale follows its log2."""
        for name, value in self._start_values().items():
            self._device_state[name].fill_(value)
        if self.schedule == "log2" and self._enabled:
            self._scale.copy_(torch.exp2(self._device_state["log2_scale"]))

    def _has_steps(self) -> bool:
        """Whether an optimizer step was recorded since the last update."""
        return any(s["found_inf_per_device"] for s in self._per_optimizer_states.values())

    def _read_device_state(self) -> dict[str, float]:
        """Our state as Python numbers (one host sync when it lives on the device)."""
        if self._device_state is None:
            return self._start_values()
        values = torch.stack([t.double() for t in self._device_state.values()]).tolist()
        return dict(zip(_DEVICE_STATE, values))

    # ------------------------------------------------------------------ scale, unscale, step
    def scale(self, outputs: Any, *, optimizer: Optimizer | None = None) -> Any:
        """Multiply ``outputs`` (a tensor or nested list/tuple of tensors) by the scale; GradScaler's.

        Args:
            outputs: what to scale (the loss).
            optimizer: ignored by a shared scale (see :class:`~lightning_ext.amp.PerOptimizerLossScaler`).
        """
        return super().scale(outputs)

    def _grads_by_device(self, optimizer: Optimizer, allow_fp16: bool) -> dict[torch.device, list[Tensor]]:
        """The optimizer's gradients (values of sparse ones) by device, as GradScaler collects them."""
        grads: dict[torch.device, list[Tensor]] = defaultdict(list)
        for param in (p for group in optimizer.param_groups for p in group["params"] if p.grad is not None):
            grad = param.grad
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.is_sparse:
                if grad.dtype is torch.float16:  # duplicates could overflow when summed: sum them
                    param.grad = grad = grad.coalesce()
                grad = sparse_values(grad)
            grads[grad.device].append(grad)
        return grads

    def _check_grads(
        self, optimizer: Optimizer, allow_fp16: bool, inv_scale: Tensor | None
    ) -> dict[torch.device, Tensor]:
        """``found_inf`` (float32 0-dim) per device of ``optimizer``'s gradients, unscaled in place by
        ``inv_scale`` in the same pass (read-only check for ``None``). With ``process_group``, their MAX
        over the group instead, on the scale's device (else the first gradients')."""
        flags = {}
        # Below a scale of about 2**-128 (0 included) 1/scale is inf in float32: unscaling (ours, or a
        # fused optimizer's) turns every gradient into inf/NaN after ATen's check, which reads them
        # before multiplying. Such a step counts as an overflow (GradScaler would take it).
        inv = self._scale.double().reciprocal().float() if inv_scale is None and self._enabled else inv_scale
        unusable = None if inv is None else torch.isinf(inv).float()
        with torch.no_grad():
            for dev, grads in self._grads_by_device(optimizer, allow_fp16).items():
                # DTensor gradients (FSDP2, tensor parallelism): ATen's ops, which DTensor runs on every
                # shard and reduces over the mesh (a compiled kernel reads no DTensor's memory)
                distributed = any(hasattr(grad, "device_mesh") for grad in grads)
                backend = get_backend("reference") if distributed else get_backend(device=dev)
                if inv_scale is None:
                    flags[dev] = backend.run("check_finite", grads, dev)
                else:
                    inv = inv_scale.to(dev, non_blocking=True)
                    flags[dev] = backend.run("unscale_and_check_", grads, inv)
                if distributed and hasattr(flags[dev], "full_tensor"):  # (reduced over the mesh)
                    flags[dev] = flags[dev].full_tensor()
                if unusable is not None:
                    flags[dev] = torch.maximum(flags[dev], unusable.to(dev, non_blocking=True))
        if self.process_group is None or not is_distributed():
            return flags
        device = self._scale.device if self._scale is not None else next(iter(flags), torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float32, device=device)
        combined = torch.stack([zero, *(f.to(device, non_blocking=True) for f in flags.values())]).amax()
        all_reduce_(combined, op=dist.ReduceOp.MAX, group=self.process_group)
        return {device: combined}

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        return self._check_grads(optimizer, allow_fp16, inv_scale)

    def _check_inf_per_device(self, optimizer: Optimizer) -> dict[torch.device, Tensor]:
        """``found_inf`` per device without unscaling (fused optimizers, the skip-only mode), recorded."""
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._check_grads(optimizer, True, None)
        return state["found_inf_per_device"]

    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is inf/NaN.

        GradScaler's, through the kernel backend's one-pass ``unscale_and_check_``; in the skip-only
        mode a read-only check. No host sync (one all_reduce with ``process_group``).

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
            RuntimeError: called twice for ``optimizer`` since the last update, or after :meth:`step`.
            ValueError: float16 gradients (the optimizer needs float32 master parameters).
        """
        _check_optimizer(optimizer)
        if self._enabled:
            return super().unscale_(optimizer)
        if not self.skip_nonfinite:
            return None
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is GradScalerStage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is GradScalerStage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._check_inf_per_device(optimizer)
        state["stage"] = GradScalerStage.UNSCALED
        return None

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran), then ``optimizer.step(*args, **kwargs)`` unless non-finite.

        GradScaler's: fused optimizers (``_step_supports_amp_scaling``) get ``grad_scale``/``found_inf``
        and skip on the device (their gradients are only read to be checked); others read
        ``found_inf`` to the host (one sync per step) and are not called when it is set.

        Returns:
            ``optimizer.step``'s return value, or ``None`` when the step was skipped.

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
            RuntimeError: ``step`` already called for ``optimizer`` since the last update, or a ``closure``.
        """
        _check_optimizer(optimizer)
        if self._enabled or not self.skip_nonfinite:
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is GradScalerStage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is GradScalerStage.READY:
            self.unscale_(optimizer)
        found_inf = _combined(state)
        retval = None
        if optimizer_handles_unscaling(optimizer):  # skips on the device, no sync
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not found_inf.item():
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = GradScalerStage.STEPPED
        return retval

    # ------------------------------------------------------------------ update
    @torch.compiler.disable  # (see _lazy_init_scale_growth_tracker)
    def update(self, new_scale: float | Tensor | None = None, *, optimizer: Optimizer | None = None) -> None:
        """Count the optimizer steps since the last update (taken or skipped) and move the scale once,
        with their combined ``found_inf``: GradScaler's, with this scaler's schedule, bounds, counters
        and telemetry. On the device without host sync, except the floor policy (``min_scale`` with
        ``on_min_scale="warn"|"raise"``: one read of two flags).

        Args:
            new_scale: set the scale to this value (a float, or a one-element float32 tensor on the
                scaler's device type) instead of following the schedule (GradScaler's semantics).
            optimizer: ignored by a shared scale, which moves once for all (see
                :class:`~lightning_ext.amp.PerOptimizerLossScaler`).

        Raises:
            AssertionError: no optimizer step was recorded since the last update, or a ``new_scale``
                came before the scaler's first use (GradScaler's errors).
            TypeError: ``new_scale`` neither a tensor nor a finite number.
            ValueError: a number ``new_scale`` not ``> 0`` or outside ``[min_scale, max_scale]``.
            FloatingPointError: ``on_min_scale="raise"`` and an overflow hit the floor.
        """
        if not self._checks:
            return
        found_infs = [_combined(s) for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        self._per_optimizer_states = defaultdict(new_optimizer_state)
        if self._scale is None and not found_infs:  # before any step: GradScaler's
            raise AssertionError(_NO_SCALE)
        if new_scale is None and not found_infs:
            raise AssertionError(_NO_STEP)
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(found_infs[0].device)
        device = self._scale.device
        found_infs = [f.to(device, non_blocking=True) for f in found_infs]
        for found in found_infs:
            schedules._count_(*(self._device_state[key] for key in _COUNTERS), found)
        if found_infs:  # (one optimizer's flag itself: no kernel)
            combined = sum(found_infs[1:], found_infs[0])
            self._device_state["found_inf"].copy_(combined)
        else:  # update(new_scale) without a step since the last update: the last step's flag stays
            combined = torch.zeros((), dtype=torch.float32, device=device)
        if self._enabled and new_scale is not None:
            self._set_scale(new_scale)
        elif self._enabled:
            self._schedule(combined)
        if self.telemetry:
            self._report(combined)

    def _schedule(self, found_inf: Tensor) -> None:
        """One schedule step, then the bounds and the floor policy."""
        s, scale, tracker = self._device_state, self._scale, self._growth_tracker
        if self.schedule == "log2":
            back_off = schedules._log2_(
                scale, s["log2_scale"], tracker, s["hysteresis_tracker"], found_inf,
                self.log2_increment, self.log2_decrement, self.hysteresis, self._growth_interval,
            )  # fmt: skip
        else:
            back_off = schedules._exponential_(
                scale, tracker, s["hysteresis_tracker"], found_inf,
                self._growth_factor, self._backoff_factor, self._growth_interval, self.hysteresis,
                self.consecutive_hysteresis,
            )  # fmt: skip
        if self.min_scale is None and self.max_scale is None:  # unbounded: no kernel more
            return
        log2 = s["log2_scale"] if self.schedule == "log2" else None
        hit_floor = schedules._clamp_(self._scale, log2, back_off, self.min_scale, self.max_scale)
        if self.min_scale is None or self.on_min_scale == "clamp":
            return
        hit, above = torch.stack([hit_floor, self._scale > self.min_scale]).tolist()  # one host sync
        if above:  # the scale left the floor: warn at its next hit again
            self._floor_warned = False
        if hit and (self.on_min_scale == "raise" or not self._floor_warned):
            self._floor_warned = True
            message = (
                f"the loss scale hit its floor min_scale={self.min_scale!r} after "
                f"{self.consecutive_overflows} consecutive overflowing step(s): the gradients are "
                "non-finite even unscaled. HINT: lower the learning rate, check the data and the loss "
                "for inf/NaN."
            )
            if self.on_min_scale == "raise":
                raise FloatingPointError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _set_scale(self, new_scale: float | Tensor) -> None:
        """GradScaler's ``update(new_scale)``, within the bounds."""
        if isinstance(new_scale, Tensor):
            super().update(new_scale)
            if self.min_scale is not None or self.max_scale is not None:
                self._scale.clamp_(self.min_scale, self.max_scale)
        else:
            low = {"gt": 0.0} if self.min_scale is None else {"ge": self.min_scale}
            check_number(f"{type(self).__name__}.update", "new_scale", new_scale, **low, le=self.max_scale)
            super().update(float(new_scale))
        self._device_state["log2_scale"].copy_(torch.log2(self._scale.double()))

    def _report(self, found_inf: Tensor) -> None:
        prefix = "AMP/" if self._name is None else f"AMP/{self._name}/"
        if not self._enabled:
            log2 = torch.zeros((), dtype=torch.float64)
        elif self.schedule == "log2":
            log2 = self._device_state["log2_scale"].clone()
        else:
            log2 = torch.log2(self._scale)
        report(prefix + "loss_scale_log2", log2)
        report(prefix + "overflow", (found_inf > 0).float())
        report(prefix + "skipped_steps", self._device_state["skipped_steps"].clone())

    # ------------------------------------------------------------------ read-out
    steps = _counter("steps", "Optimizer steps counted by :meth:`update`, taken or skipped.")
    skipped_steps = _counter("skipped_steps", "Optimizer steps skipped because a gradient was inf/NaN.")
    consecutive_overflows = _counter("consecutive_overflows", "Skipped steps in a row up to the last update.")

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step skipped
        (:attr:`~lightning_ext.amp.DynamicLossScaler.last_step_skipped_tensor`). Syncs host and device."""
        return bool(self.last_step_skipped_tensor)

    @property
    def last_step_skipped_tensor(self) -> Tensor:
        """Whether the last optimizer step skipped, as a bool 0-dim device tensor. No sync.

        Of the steps recorded since the last update, whether any skipped (a step whose update is still
        to come, as a shared scale's in Lightning's manual optimization, which moves at the next
        backward); else whether the last update counted a skipped step."""
        pending = [_combined(s) for s in self._per_optimizer_states.values() if s["found_inf_per_device"]]
        if pending:
            return sum((f.to(pending[0].device) for f in pending[1:]), pending[0]) > 0
        state = self._device_state
        if state is None:  # before the first use: the loaded (or unpickled) state's, else False
            return torch.tensor(self._start.get("found_inf", 0.0) > 0)
        return state["found_inf"] > 0

    @property
    def scale_tensor(self) -> Tensor | None:
        """The scale as a float32 0-dim tensor on its device (``None`` before the first use). No sync."""
        return self._scale

    # ------------------------------------------------------------------ state dict and pickling
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``; so GradScaler can load it) plus the schedule, bounds and counters; with
        :class:`~lightning_ext.amp.PerOptimizerLossScaler`, ``{"per_optimizer": {name: state}}``. Empty
        when disabled without checks
        (GradScaler's). Syncs host and device."""
        if not self._checks:
            return {}
        host, base = self._read_device_state(), super().state_dict()  # GradScaler's: {} when disabled
        # The exponential schedule moves the scale alone: its log2 is derived here, as pickling does.
        log2 = host["log2_scale"] if self.schedule == "log2" else _log2(base.get("scale", 1.0))
        return {
            **base, **{key: getattr(self, key) for key in _CONFIG}, "log2_scale": log2,
            "_hysteresis_tracker": min(int(host["hysteresis_tracker"]), self.hysteresis),  # (as used)
            **{key: int(host[key]) for key in _COUNTERS}, "last_step_skipped": host["found_inf"] > 0,
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, or adopt a ``torch.amp.GradScaler`` state dict (scale, factors and
        growth tracker; the counters then restart at 0). All or nothing: the whole dict is checked first.

        Raises:
            RuntimeError: empty ``state_dict`` while enabled (GradScaler's).
            TypeError, ValueError: keys missing, an entry the constructor would refuse (the same
                message, naming the key and the value) or out of range, counters that contradict each
                other, per-optimizer state into a shared scaler or the reverse.
        """
        _check_per_optimizer_keys(state_dict, self.per_optimizer)
        if not self._checks or (not state_dict and not self._enabled):
            return
        if state_dict:
            self._check_state(state_dict, f"{type(self).__name__}.load_state_dict")
        if self._enabled:
            super().load_state_dict(state_dict)
        if not _is_ours(state_dict):  # a GradScaler's: its scale, fresh counters
            self._start = {"hysteresis_tracker": self.hysteresis}
        else:
            self._adopt_settings(state_dict)
            self._start = {
                "log2_scale": float(state_dict["log2_scale"]),
                "hysteresis_tracker": state_dict["_hysteresis_tracker"],
                **{key: float(state_dict[key]) for key in _COUNTERS},
                "found_inf": float(state_dict["last_step_skipped"]),
            }
        if self._device_state is not None:
            self._fill_device_state()

    def _adopt_settings(self, state: Mapping[str, Any]) -> None:
        """Take the settings of our ``state``, saying which it replaced (GradScaler's own settings are
        replaced silently, as GradScaler does)."""
        replaced = [f"{k}={state[k]!r} (given {getattr(self, k)!r})" for k in _CONFIG
                    if getattr(self, k) != state[k]]  # fmt: skip
        if replaced:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: the checkpoint's settings replace those given to "
                f"the constructor: {', '.join(replaced)}. HINT: to change them on a resume, set these "
                "attributes after loading.", stacklevel=3,
            )  # fmt: skip
        for key in _CONFIG:
            setattr(self, key, state[key])

    def _check_state(self, state: Mapping[str, Any], owner: str) -> None:
        """Raise unless this scaler can load ``state`` whole (see :meth:`load_state_dict`)."""
        required = (_GRAD_SCALER_KEYS if self._enabled else ()) + (_STATE_KEYS if _is_ours(state) else ())
        missing = sorted(set(required) - set(state))
        if missing:
            raise ValueError(f"{owner}: `state_dict` misses the keys {missing}; got {sorted(state)}")
        _check(owner, {**{key: getattr(self, key) for key in _CONFIG}, **state})
        if not _is_ours(state):
            return
        check_int(owner, "_hysteresis_tracker", state["_hysteresis_tracker"], le=state["hysteresis"])
        if state["log2_scale"] != -math.inf:  # -inf: the log2 of a scale that underflowed to 0
            check_number(owner, "log2_scale", state["log2_scale"])
        counters = [state[key] for key in ("consecutive_overflows", "skipped_steps", "steps")]
        # (a run of overflows ends in a skipped update; a skipped update of several optimizers whose
        # last one stepped ends the run: a shared scale counts each optimizer's step)
        if sorted(counters) != counters or (counters[0] and not state["last_step_skipped"]):
            raise ValueError(
                f"{owner}: `state_dict` has consecutive_overflows={counters[0]!r} with "
                f"last_step_skipped={state['last_step_skipped']!r}, skipped_steps={counters[1]!r}, "
                f"steps={counters[2]!r}: need consecutive_overflows <= skipped_steps <= steps, and "
                "last_step_skipped with a run of overflows"
            )

    def __getstate__(self) -> dict[str, Any]:
        # GradScaler's (the scale as a number, tensors recreated lazily), and ours alike: tensors sent
        # to spawned workers would otherwise travel through shared memory and be one state for all.
        host = self._read_device_state()
        if self.schedule != "log2":
            del host["log2_scale"]  # derived from the scale
        return {**super().__getstate__(), "_scale": None, "_growth_tracker": None, "_start": host,
                "_device_state": None}  # fmt: skip


def _check_per_optimizer_keys(state_dict: dict[str, Any], per_optimizer: bool) -> None:
    """Raise when ``state_dict`` holds per-optimizer scales and the scaler has one, or the reverse."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"`state_dict` must be a dict, got {type(state_dict).__name__}")
    if per_optimizer != ("per_optimizer" in state_dict) and state_dict:
        raise ValueError(
            f"`state_dict` {'lacks' if per_optimizer else 'has'} per-optimizer scales (keys "
            f"{sorted(state_dict)}) but this scaler has per_optimizer={per_optimizer}"
        )


class PerOptimizerLossScaler(DynamicLossScaler):
    """One scale, growth tracker and set of counters per optimizer: ``DynamicLossScaler(per_optimizer=True)``.

    ``DynamicLossScaler(..., per_optimizer=True)`` is one (same arguments, same methods), so code
    written for the scaler drives it unchanged but for ``scale(loss, optimizer=...)``: each optimizer's
    gradients are scaled by its own scale, checked and stepped or skipped on their own, and each scale
    moves with the overflows of its own optimizer. A generator whose discriminator overflows keeps its
    scale (StyleGAN2-ADA's per-``Optimizer`` loss scaling; Apex's ``num_losses``/``loss_id``).

    Each optimizer's scale is a :class:`DynamicLossScaler` with this one's settings, created at the
    optimizer's first use and named by :meth:`register_optimizer`, else ``"0"``, ``"1"``, ... in order
    of first use; telemetry ``AMP/<name>/loss_scale_log2``, ``AMP/<name>/overflow``,
    ``AMP/<name>/skipped_steps``. Host syncs: those of each optimizer's scaler.

    It takes :class:`DynamicLossScaler`'s arguments (``per_optimizer`` must be ``True`` if given).

    Raises:
        ValueError: ``per_optimizer=False``; :class:`DynamicLossScaler`'s errors.

    Example::

        >>> import torch
        >>> g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True, telemetry=False)
        >>> type(scaler).__name__
        'PerOptimizerLossScaler'
        >>> scaler.register_optimizer(opt_g, "G"); scaler.register_optimizer(opt_d, "D")
        >>> scaler.scale(d(torch.ones(1, 2)).sum(), optimizer=opt_d).backward()
        >>> d.weight.grad.fill_(float("inf"))  # D overflows
        tensor([[inf, inf]])
        >>> _ = scaler.step(opt_d)
        >>> scaler.scale(d(g(torch.ones(1, 2))).sum(), optimizer=opt_g).backward()
        >>> _ = scaler.step(opt_g)
        >>> scaler.update()
        >>> scaler.optimizer_scaler(opt_d).get_scale(), scaler.optimizer_scaler(opt_g).get_scale()
        (512.0, 1024.0)
    """

    per_optimizer = True

    def __init__(self, *args: Any, per_optimizer: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, per_optimizer=per_optimizer, **kwargs)
        self._children: dict[str, DynamicLossScaler] = {}  # name -> that optimizer's scaler
        self._names: dict[int, str] = {}  # id(optimizer) -> name
        self._pending: dict[str, dict[str, Any]] = {}  # loaded states of scalers not yet used
        self._overrides: dict[str, Any] = {}  # the settings set here since the last load

    def __setattr__(self, key: str, value: Any) -> None:
        """A setting (an attribute named as a keyword argument of :class:`DynamicLossScaler`) set here
        holds for every optimizer's scale, those made or loaded later too."""
        super().__setattr__(key, value)
        if key in _OPTIONS and "_overrides" in self.__dict__:
            self._overrides[key] = value
            for child in self._children.values():
                setattr(child, key, value)

    def register_optimizer(self, optimizer: Optimizer, name: str) -> None:
        """Name ``optimizer``'s scale: telemetry ``AMP/<name>/...`` and its state-dict key.

        Raises:
            TypeError: ``optimizer`` is not an optimizer or ``name`` not a non-empty str.
            ValueError: ``name`` already names another optimizer.
        """
        optimizer = _check_optimizer(optimizer)
        if not isinstance(name, str) or not name:
            raise TypeError(f"`name` must be a non-empty str, got {name!r}")
        old = self._names.get(id(optimizer))
        if name in self._names.values() and old != name:
            raise ValueError(f"`name` {name!r} already names another optimizer's scale")
        if old in self._children and old != name:  # named after its first use: its scale moves along
            if name in self._children:
                raise ValueError(f"`name` {name!r} already names a scale; {old!r} names this optimizer's")
            self._children[name] = self._children.pop(old)
            self._children[name]._name = name
        self._names[id(optimizer)] = name

    def unregister_optimizer(self, optimizer: Optimizer) -> None:
        """Release ``optimizer``'s name: its scale stays under that name, for the optimizer registered
        under it next (a new fit's optimizers, made again by ``configure_optimizers``, carry the scales
        on). Nothing for an optimizer without a name."""
        self._names.pop(id(_check_optimizer(optimizer)), None)

    def optimizer_scaler(self, optimizer: Optimizer) -> DynamicLossScaler:
        """The scaler holding ``optimizer``'s own scale, created (and given its loaded state) at first use.

        Raises:
            TypeError: ``optimizer`` is not an optimizer.
        """
        optimizer = _check_optimizer(optimizer)
        if id(optimizer) not in self._names:  # the first default name no optimizer holds
            taken = set(self._names.values())
            self._names[id(optimizer)] = next(str(i) for i in itertools.count() if str(i) not in taken)
        name = self._names[id(optimizer)]
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = DynamicLossScaler(
                self._device, self._init_scale, self._growth_factor, self._backoff_factor,
                self._growth_interval, self._enabled, **{key: getattr(self, key) for key in _OPTIONS},
            )  # fmt: skip
            child._name = name
            if name in self._pending:
                self._load(child, self._pending.pop(name))
            elif self._pending:
                warnings.warn(
                    f"PerOptimizerLossScaler: the loaded state holds no scale named {name!r} (it holds "
                    f"{sorted(self._pending)}): this optimizer's scale starts anew. HINT: name the "
                    "optimizers as the run that saved it did (register_optimizer).", stacklevel=2,
                )  # fmt: skip
        return child

    def get_scale(self, optimizer: Optimizer | None = None) -> float:
        """``optimizer``'s scale (:meth:`DynamicLossScaler.get_scale` of its scaler); without one (as
        GradScaler's own methods call it), the scale each optimizer's starts from. Syncs host and device."""
        return super().get_scale() if optimizer is None else self.optimizer_scaler(optimizer).get_scale()

    def set_growth_factor(self, new_factor: float) -> None:
        """GradScaler's, for every optimizer's scale (those made later too)."""
        for scaler in (super(), *self._children.values()):
            scaler.set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """GradScaler's, for every optimizer's scale (those made later too)."""
        for scaler in (super(), *self._children.values()):
            scaler.set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """GradScaler's, for every optimizer's scale (those made later too)."""
        for scaler in (super(), *self._children.values()):
            scaler.set_growth_interval(new_interval)

    def scale(self, outputs: Any, *, optimizer: Optimizer | None = None) -> Any:
        """Multiply ``outputs`` by the scale of ``optimizer``, the optimizer that will step their gradients.

        Raises:
            ValueError: no ``optimizer``.
        """
        if optimizer is None:
            raise ValueError(
                "DynamicLossScaler(per_optimizer=True).scale(outputs, optimizer=...) needs the optimizer "
                "that will step these gradients: each optimizer has its own scale"
            )
        return self.optimizer_scaler(optimizer).scale(outputs)

    def unscale_(self, optimizer: Optimizer) -> None:
        """:meth:`DynamicLossScaler.unscale_` by ``optimizer``'s own scale."""
        return self.optimizer_scaler(optimizer).unscale_(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """:meth:`DynamicLossScaler.step` with ``optimizer``'s own scale."""
        return self.optimizer_scaler(optimizer).step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | Tensor | None = None, *, optimizer: Optimizer | None = None) -> None:
        """Move the scale of ``optimizer`` (for its steps since its last update), or with ``None`` of
        every optimizer that stepped since its last update; see :meth:`DynamicLossScaler.update`."""
        if optimizer is not None:
            stepped = [self.optimizer_scaler(optimizer)]
        else:
            stepped = [c for c in self._children.values() if c._has_steps()]
        if not stepped and new_scale is None:  # (DynamicLossScaler's, GradScaler's)
            raise AssertionError(_NO_STEP if self._children else _NO_SCALE)
        for child in stepped:
            child.update(new_scale)

    steps = _over_children(sum, "steps", "Optimizer steps counted, summed over the optimizers.")
    skipped_steps = _over_children(sum, "skipped_steps", "Skipped steps, summed over the optimizers.")
    consecutive_overflows = _over_children(
        lambda runs: max(runs, default=0), "consecutive_overflows",
        "The longest run of skipped steps up to the last update over the optimizers.",
    )  # fmt: skip

    @property
    def last_step_skipped_tensor(self) -> Tensor:
        """Whether any optimizer's last step skipped (each scaler's ``last_step_skipped_tensor``), as a
        bool 0-dim device tensor (:attr:`last_step_skipped` reads it). No sync."""
        flags = [child.last_step_skipped_tensor for child in self._children.values()]
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        return torch.stack([flag.to(flags[0].device) for flag in flags]).any()

    def state_dict(self) -> dict[str, Any]:
        """``{"per_optimizer": {name: DynamicLossScaler.state_dict()}}``. Syncs host and device."""
        return {"per_optimizer": {**self._pending, **{n: c.state_dict() for n, c in self._children.items()}}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: into each optimizer's scaler now, or at its first use. All or
        nothing: every optimizer's state is checked first.

        Raises:
            TypeError, ValueError: ``state_dict`` is a shared scale's, ``"per_optimizer"`` does not map
                names to state dicts; the errors of :meth:`DynamicLossScaler.load_state_dict`.
        """
        _check_per_optimizer_keys(state_dict, True)
        states = state_dict.get("per_optimizer", {})
        if not isinstance(states, dict) or not all(isinstance(s, dict) for s in states.values()):
            raise TypeError(
                f"`state_dict['per_optimizer']` must map names to state dicts, got {states!r:.60}"
            )
        for name, state in states.items():
            self._check_state(state, f"{type(self).__name__}.load_state_dict (the scale {name!r})")
        ours = [s for s in states.values() if _is_ours(s)]
        if ours and all(all(s[k] == ours[0][k] for k in _CONFIG) for s in ours):
            self._adopt_settings(ours[0])  # (said here, once)
        self._overrides = {}
        for name, state in states.items():
            if name in self._children:
                self._load(self._children[name], state)
            else:
                self._pending[name] = state

    def _load(self, child: DynamicLossScaler, state: dict[str, Any]) -> None:
        """Load ``state`` into an optimizer's scaler, then the settings set here since the last load."""
        with warnings.catch_warnings():  # (load_state_dict said which settings the checkpoint replaced)
            warnings.filterwarnings("ignore", "DynamicLossScaler.load_state_dict: the checkpoint's settings")
            child.load_state_dict(state)
        for key, value in self._overrides.items():
            setattr(child, key, value)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_names": {}}  # object ids mean nothing in another process
