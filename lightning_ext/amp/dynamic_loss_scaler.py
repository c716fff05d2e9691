"""Dynamic loss scaling with telemetry, hysteresis and a floor: a drop-in for ``torch.amp.GradScaler``.

The scaler multiplies the loss by a scale ``S`` before backward so that small fp16 gradients do not
underflow, divides the gradients by ``S`` before the optimizer step, skips the step when a gradient
is non-finite and adapts ``S``. It follows three models:

* ``torch.amp.GradScaler``: the public surface (``scale``/``unscale_``/``step``/``update``/
  ``state_dict``), per-optimizer stage tracking, the fused-optimizer protocol
  (``optimizer.grad_scale``/``optimizer.found_inf``) and the ``"exponential"`` schedule
  (``x growth_factor`` after ``growth_interval`` clean steps, ``x backoff_factor`` on overflow).
* StyleGAN2-ADA's training loop (Karras et al. 2020, ``training/training_loop.py``): the ``"log2"``
  schedule (``log2(S) += log2_increment`` per clean step, ``-= log2_decrement`` per overflow) and the
  ``AMP/loss_scale_log2`` / overflow-frequency telemetry.
* DeepSpeed / Megatron-LM ``DynamicGradScaler``: ``hysteresis`` (back off only after ``hysteresis``
  overflows), ``min_scale`` / ``max_scale``.

Hysteresis follows Megatron-LM exactly: an overflow decrements a tracker that starts at
``hysteresis``; the scale backs off on an overflow that leaves the tracker ``<= 0``; the tracker is
reset to ``hysteresis`` only when the scale grows (after ``growth_interval`` clean steps for
``"exponential"``, after every clean step for ``"log2"``). Every overflowing step is skipped whatever
the tracker says. ``hysteresis=1`` is GradScaler's behaviour.

All state (scale, trackers, counters) lives on the device as 0-dim tensors and :meth:`update` runs
there with no host sync. The host syncs are: the skip decision in :meth:`step` for optimizers that
cannot take ``found_inf`` themselves (one ``.item()``, as in GradScaler), the floor check of
``on_min_scale="warn"|"raise"`` on steps that overflowed, and the host-side accessors
(:meth:`get_scale`, :attr:`last_step_skipped`, :meth:`state_dict`).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterable
from enum import Enum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ext import shm_collectives
from lightning_ext.distributed import collective_device, is_distributed
from lightning_ext.kernels import get_backend
from lightning_ext.stats import report

__all__ = ["DynamicLossScaler"]

_SCHEDULES = ("exponential", "log2")
_MIN_SCALE_POLICIES = ("warn", "raise", "clamp")
# Keys that only our state dicts carry; their absence marks a ``torch.amp.GradScaler`` state dict.
_OWN_KEY = "schedule"
_SCHEDULE_KEYS = (
    "schedule", "growth_factor", "backoff_factor", "growth_interval", "log2_increment",
    "log2_decrement", "hysteresis", "min_scale", "max_scale",
)  # fmt: skip
# The scaler's device state, all 0-dim: scale (float32), log2 of it (float64), growth and hysteresis
# trackers (int32), step/skip/consecutive-overflow counters (float64), last-step-skipped flag (bool).
_STATE_TENSORS = (
    "_scale",
    "_log2_scale",
    "_growth_tracker",
    "_hysteresis_tracker",
    "_steps",
    "_skipped_steps",
    "_consecutive_overflows",
    "_last_step_skipped",
)


class _Stage(Enum):
    READY = 0  # no unscale_/step since the last update()
    UNSCALED = 1  # unscale_() done, found_inf recorded
    STEPPED = 2  # step() done (or skipped)


def _new_optimizer_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf": None}


# ------------------------------------------------------------------------------------------------
# Pure schedule maths (device tensors in, device tensors updated in place, no host sync)
# ------------------------------------------------------------------------------------------------


def _update_scale_(
    scale: Tensor,
    log2_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_inf: Tensor,
    *,
    schedule: str,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    log2_increment: float,
    log2_decrement: float,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
    need_floor: bool = True,
) -> Tensor | None:
    """Advance the loss-scale schedule by one optimizer step, in place, on the tensors' device.

    Args:
        scale: float32 0-dim tensor, the current scale ``S``; updated in place.
        log2_scale: float64 0-dim tensor holding ``log2(S)``; the authoritative value for
            ``schedule="log2"``; kept equal to ``log2(scale)`` for ``"exponential"``.
        growth_tracker: int32 0-dim tensor, clean steps since the last growth or overflow.
        hysteresis_tracker: int32 0-dim tensor, overflows still tolerated before backing off.
        found_inf: float32 0-dim tensor, nonzero iff this step's gradients had an inf/NaN.
        schedule: ``"exponential"`` or ``"log2"``.
        growth_factor, backoff_factor, growth_interval: the exponential schedule.
        log2_increment, log2_decrement: the log2 schedule, in units of log2(scale).
        hysteresis: tracker value after a growth.
        min_scale, max_scale: the scale is clamped to ``[min_scale, max_scale]``.
        need_floor: compute the returned flag (``False`` saves its small ops when no one reads it).

    Returns:
        bool 0-dim tensor on the same device: ``True`` iff this step backed off and the backed-off
        scale would have fallen below ``min_scale`` (the floor was hit); ``None`` without
        ``need_floor``. No host sync.
    """
    if schedule == "exponential" and hysteresis == 1:
        # GradScaler's own fused update (one kernel), then the [min, max] clamp. The hysteresis
        # tracker is not needed (every overflow backs off) and stays at 1.
        before = scale.clone() if need_floor else None
        torch._amp_update_scale_(
            scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
        )
        scale.clamp_(min_scale, max_scale)
        torch.log2(scale.double(), out=log2_scale)
        return (found_inf > 0) & (before * backoff_factor < min_scale) if before is not None else None
    overflow = found_inf > 0
    hyst_after = torch.where(overflow, hysteresis_tracker - 1, hysteresis_tracker)
    back_off = overflow & (hyst_after <= 0)
    log2_min, log2_max = math.log2(min_scale), math.log2(max_scale)
    if schedule == "exponential":
        tracker_after = torch.where(overflow, torch.zeros_like(growth_tracker), growth_tracker + 1)
        grow = ~overflow & (tracker_after >= growth_interval)
        tracker_after = torch.where(grow, torch.zeros_like(tracker_after), tracker_after)
        proposed = torch.where(
            back_off, scale * backoff_factor, torch.where(grow, scale * growth_factor, scale)
        )
        hit_floor = back_off & (proposed < min_scale)
        new_scale = proposed.clamp(min_scale, max_scale)
        growth_tracker.copy_(tracker_after)
        scale.copy_(new_scale)
        log2_scale.copy_(torch.log2(new_scale.double()))
    elif schedule == "log2":
        grow = ~overflow
        proposed = torch.where(
            back_off,
            log2_scale - log2_decrement,
            torch.where(grow, log2_scale + log2_increment, log2_scale),
        )
        hit_floor = back_off & (proposed < log2_min)
        new_log2 = proposed.clamp(log2_min, log2_max)
        growth_tracker.copy_(torch.where(overflow, torch.zeros_like(growth_tracker), growth_tracker + 1))
        log2_scale.copy_(new_log2)
        scale.copy_(torch.exp2(new_log2).float())
    else:  # pragma: no cover - validated in the constructor
        raise AssertionError(schedule)
    hysteresis_tracker.copy_(torch.where(grow, torch.full_like(hyst_after, hysteresis), hyst_after))
    return hit_floor if need_floor else None


def _update_scale_on_host_(
    scale: Tensor,
    log2_scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    overflow: bool,
    *,
    schedule: str,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    log2_increment: float,
    log2_decrement: float,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> bool:
    """:func:`_update_scale_` for CPU state tensors, branching on host values in Python.

    On CPU, reading a 0-dim tensor is not a host-device sync, and a dozen Python comparisons cost
    less than the ~20 small tensor ops of the device path. Only the tensors whose value changes are
    written: after a large optimizer step every distinct small op pays a cold-cache penalty of
    ~5-25 us on CPU, so a clean step that neither grows nor backs off writes one tracker instead of
    four tensors (``benchmarks/bench_loss_scaling.py``, after 11M-parameter steps on 2 cores: the
    whole ``update()`` 125-166 us and GradScaler's one-op update 42-72 us in the same run; 191-245 us
    in the same harness when every tensor was written). The arithmetic mirrors the device path bit
    for bit: float32 products and comparisons as ATen rounds them (``np.float32``), the
    transcendental ``log2``/``exp2`` still by torch; ``log2_scale`` must hold ``log2(scale)`` on entry
    for ``"exponential"`` (the scaler keeps it so). ``tests/amp`` checks the equality on random
    overflow sequences.

    Returns:
        Whether this step backed off below ``min_scale`` (the floor was hit).
    """
    f32 = np.float32
    before = float(scale.item())
    tracker_before = int(growth_tracker.item())
    hyst_before = int(hysteresis_tracker.item())
    s, tracker, hyst = before, tracker_before, hyst_before
    if schedule == "exponential" and hysteresis == 1:
        # torch._amp_update_scale_ (CPU kernel: float * double, then cast), then the clamp.
        if overflow:
            s = float(f32(s * backoff_factor))
            tracker = 0
        elif tracker + 1 == growth_interval:
            grown = float(f32(s * growth_factor))
            if math.isfinite(grown):
                s = grown
            tracker = 0
        else:
            tracker += 1
        if s != before:  # the scale on entry already lies in [min_scale, max_scale]
            s = float(min(max(f32(s), f32(min_scale)), f32(max_scale)))
        hit_floor = overflow and float(f32(before) * f32(backoff_factor)) < float(f32(min_scale))
    elif schedule == "exponential":
        hyst_after = hyst - 1 if overflow else hyst
        back_off = overflow and hyst_after <= 0
        tracker = 0 if overflow else tracker + 1
        grow = not overflow and tracker >= growth_interval
        if grow:
            tracker = 0
        # A float32 tensor times a Python scalar: the scalar is rounded to float32 first.
        if back_off:
            proposed = f32(s) * f32(backoff_factor)
        elif grow:
            proposed = f32(s) * f32(growth_factor)
        else:
            proposed = f32(s)
        hit_floor = back_off and proposed < f32(min_scale)
        s = float(min(max(proposed, f32(min_scale)), f32(max_scale)))
        hyst = hysteresis if grow else hyst_after
    else:  # log2
        hyst_after = hyst - 1 if overflow else hyst
        back_off = overflow and hyst_after <= 0
        grow = not overflow
        log2_before = float(log2_scale.item())
        log2 = log2_before
        if back_off:
            log2 -= log2_decrement
        elif grow:
            log2 += log2_increment
        log2_min, log2_max = math.log2(min_scale), math.log2(max_scale)
        hit_floor = back_off and log2 < log2_min
        tracker = 0 if overflow else tracker + 1
        log2 = min(max(log2, log2_min), log2_max)
        if log2 != log2_before:
            log2_scale.fill_(log2)
            scale.copy_(torch.exp2(log2_scale))
        hyst = hysteresis if grow else hyst_after
    if schedule == "exponential" and s != before:
        scale.fill_(s)
        torch.log2(scale.double(), out=log2_scale)
    if tracker != tracker_before:
        growth_tracker.fill_(tracker)
    if hyst != hyst_before:
        hysteresis_tracker.fill_(hyst)
    return bool(hit_floor)


def _update_counters_(
    steps: Tensor,
    skipped_steps: Tensor,
    consecutive_overflows: Tensor,
    last_step_skipped: Tensor,
    found_inf: Tensor,
) -> None:
    """Count one optimizer step (float64 counters, bool flag), in place, no host sync."""
    overflow = found_inf > 0
    steps.add_(1)
    skipped_steps.add_(overflow.double())
    consecutive_overflows.copy_(torch.where(overflow, consecutive_overflows + 1, 0.0))
    last_step_skipped.copy_(overflow)


def _check_positive(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        allowed = "an int" if integer else "a float"
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} of type {type(value).__name__}")


# ------------------------------------------------------------------------------------------------
# The scaler
# ------------------------------------------------------------------------------------------------


class DynamicLossScaler:
    """Dynamic loss scaler with exponential/log2 schedules, hysteresis, a floor and telemetry.

    A drop-in for ``torch.amp.GradScaler`` in plain loops, Fabric and Lightning's own
    ``MixedPrecision(scaler=...)``; :class:`lightning_ext.plugins.LossScalingPrecision` adds the
    Lightning integration (LR schedulers held on skipped steps, one update per training step).

    Args:
        init_scale: initial scale ``S`` (GradScaler's default ``2**16``).
        growth_factor: ``"exponential"``: ``S *= growth_factor`` after ``growth_interval`` clean steps.
        backoff_factor: ``"exponential"``: ``S *= backoff_factor`` on overflow; in ``(0, 1)``.
        growth_interval: ``"exponential"``: clean steps between growths, ``>= 1``.
        schedule: ``"exponential"`` (GradScaler) or ``"log2"`` (StyleGAN2-ADA).
        log2_increment: ``"log2"``: ``log2(S)`` grows by this per clean step (StyleGAN2-ADA: 1e-3).
        log2_decrement: ``"log2"``: ``log2(S)`` drops by this per back-off (StyleGAN2-ADA: 1).
        hysteresis: back off only on the ``hysteresis``-th overflow since the last growth
            (Megatron-LM semantics, see the module docstring); ``1`` = GradScaler.
        min_scale: floor of ``S``; ``> 0``.
        max_scale: ceiling of ``S``; ``>= min_scale``.
        on_min_scale: what an overflow at the floor does: ``"clamp"`` (stay at the floor silently),
            ``"warn"`` (stay and warn), ``"raise"`` (``FloatingPointError``). The last two read a
            flag back to the host on steps that overflowed (on every step with fused optimizers,
            whose skip decision stays on the device); ``"clamp"`` never syncs.
        enabled: ``False`` fixes ``S = 1`` (bf16/fp32 training); non-finite steps are still skipped
            when ``skip_nonfinite`` (the check is the same fused pass, multiplying by 1).
        skip_nonfinite: only for ``enabled=False``: check gradients and skip non-finite steps
            (default). ``enabled=False, skip_nonfinite=False`` passes every call through.
        process_group: when gradients are sharded (FSDP, ZeRO), the group whose ranks must agree;
            ``found_inf`` is MAX-reduced over it with one all_reduce per ``unscale_`` (through shared
            memory between CPU ranks of one host, :mod:`lightning_ext.shm_collectives`). Leave ``None``
            for replicated gradients (DDP): they are identical on every rank already.
        telemetry: ``report()`` ``AMP/loss_scale_log2``, ``AMP/overflow`` (0/1 per step; its mean
            is the overflow frequency) and ``AMP/skipped_steps`` (running total) at every update.

    Raises:
        ValueError: ``growth_factor <= 1``, ``backoff_factor`` outside ``(0, 1)``,
            ``growth_interval < 1``, ``hysteresis < 1``, non-positive increments or scales,
            ``min_scale > max_scale``, ``init_scale`` outside ``[min_scale, max_scale]``, or an unknown
            ``schedule`` / ``on_min_scale``.
        TypeError: a numeric argument of the wrong type.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = DynamicLossScaler(init_scale=2.0**10, telemetry=False)
        >>> loss = model(torch.ones(2, 3)).square().mean()
        >>> scaler.scale(loss).backward()
        >>> _ = scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.last_step_skipped
        (1024.0, False)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        schedule: str = "exponential",
        log2_increment: float = 1e-3,
        log2_decrement: float = 1.0,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        on_min_scale: str = "warn",
        enabled: bool = True,
        skip_nonfinite: bool = True,
        process_group: dist.ProcessGroup | None = None,
        telemetry: bool = True,
    ) -> None:
        self._enabled = bool(enabled)
        self._skip_nonfinite = bool(skip_nonfinite)
        self.process_group = process_group
        self.telemetry = bool(telemetry)
        if not self._enabled:
            init_scale, min_scale, max_scale = 1.0, 1.0, 1.0
        self._config: dict[str, Any] = {}
        self._set_config(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            schedule=schedule,
            log2_increment=log2_increment,
            log2_decrement=log2_decrement,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
        )
        self._device = torch.device("cpu")
        self._placed = False
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        # log2 of the float32 scale, as every update computes it (the CPU update writes it only when
        # the scale changes).
        self._log2_scale = torch.log2(self._scale.double())
        self._growth_tracker = torch.tensor(0, dtype=torch.int32)
        self._hysteresis_tracker = torch.tensor(hysteresis, dtype=torch.int32)
        self._steps = torch.tensor(0.0, dtype=torch.float64)
        self._skipped_steps = torch.tensor(0.0, dtype=torch.float64)
        self._consecutive_overflows = torch.tensor(0.0, dtype=torch.float64)
        self._last_step_skipped = torch.tensor(False)
        self._last_step_skipped_host: bool | None = False
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_new_optimizer_state)
        # Kernel backend per gradient device, resolved (get_backend) at first use: the check runs
        # at every optimizer step, where a lookup's argument checks would cost more than the op.
        self._backends: dict[torch.device, Any] = {}

    # -------------------------------------------------------------------------------- config
    def _set_config(self, **config: Any) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "log2_increment", "log2_decrement"):
            _check_positive(name, config[name])
        for name in ("min_scale", "max_scale"):
            _check_positive(name, config[name])
        for name in ("growth_interval", "hysteresis"):
            _check_positive(name, config[name], integer=True)
        if config["schedule"] not in _SCHEDULES:
            raise ValueError(f"`schedule` must be one of {_SCHEDULES}, got {config['schedule']!r}")
        if config["on_min_scale"] not in _MIN_SCALE_POLICIES:
            raise ValueError(
                f"`on_min_scale` must be one of {_MIN_SCALE_POLICIES}, got {config['on_min_scale']!r}"
            )
        if not config["growth_factor"] > 1.0:
            raise ValueError(f"`growth_factor` must be > 1, got {config['growth_factor']!r}")
        if not 0.0 < config["backoff_factor"] < 1.0:
            raise ValueError(f"`backoff_factor` must be in (0, 1), got {config['backoff_factor']!r}")
        if config["growth_interval"] < 1:
            raise ValueError(f"`growth_interval` must be >= 1, got {config['growth_interval']!r}")
        if config["hysteresis"] < 1:
            raise ValueError(f"`hysteresis` must be >= 1, got {config['hysteresis']!r}")
        for name in ("log2_increment", "log2_decrement", "min_scale"):
            if not config[name] > 0.0:
                raise ValueError(f"`{name}` must be > 0, got {config[name]!r}")
        if not math.isfinite(config["max_scale"]):
            raise ValueError(f"`max_scale` must be finite, got {config['max_scale']!r}")
        if config["min_scale"] > config["max_scale"]:
            raise ValueError(
                f"`min_scale` must be <= `max_scale`, got min_scale={config['min_scale']!r} > "
                f"max_scale={config['max_scale']!r}"
            )
        if not config["min_scale"] <= config["init_scale"] <= config["max_scale"]:
            raise ValueError(
                f"`init_scale` must lie in [min_scale, max_scale] = [{config['min_scale']!r}, "
                f"{config['max_scale']!r}], got {config['init_scale']!r}"
            )
        self._config = dict(config)
        # The entries the scale update takes as keyword arguments, built once (update() runs every step).
        self._schedule_kwargs = {k: config[k] for k in _SCHEDULE_KEYS}

    def __getattr__(self, name: str) -> Any:
        # Read-only access to the configuration: scaler.growth_interval, scaler.schedule, ...
        config = self.__dict__.get("_config", {})
        if name in config:
            return config[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in self._config.items() if k != "init_scale")
        return f"{type(self).__name__}(enabled={self._enabled}, {config})"

    # -------------------------------------------------------------------------------- state on device
    def __getstate__(self) -> dict[str, Any]:
        # Pickle the state as Python numbers: tensors sent to spawned workers (ddp_spawn) would
        # otherwise travel through shared memory and every rank would update the same scale.
        state = self.__dict__.copy()
        for name in _STATE_TENSORS:
            tensor = state[name]
            state[name] = (tensor.item(), tensor.dtype)
        state["_device"], state["_placed"] = torch.device("cpu"), False
        state["_per_optimizer_states"] = {}
        state["_backends"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in _STATE_TENSORS:
            value, dtype = state[name]
            state[name] = torch.tensor(value, dtype=dtype)
        state["_per_optimizer_states"] = defaultdict(_new_optimizer_state)
        state["_backends"] = {}
        # Derived from the configuration, so pickles of earlier versions (without it) load too.
        state["_schedule_kwargs"] = {k: state["_config"][k] for k in _SCHEDULE_KEYS}
        self.__dict__.update(state)

    def _place(self, device: torch.device) -> None:
        """At first use, move the state to ``device`` (of the first loss or gradient seen); later no-op."""
        if self._placed:
            return
        self._placed = True
        if device == self._device:
            return
        for name in _STATE_TENSORS:
            setattr(self, name, getattr(self, name).to(device))
        self._device = device

    @property
    def _checks(self) -> bool:
        return self._enabled or self._skip_nonfinite

    # -------------------------------------------------------------------------------- public surface
    def is_enabled(self) -> bool:
        """``True`` when the scale is dynamic (``enabled=True``); ``False`` for the fixed scale 1."""
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Syncs host and device."""
        return float(self._scale.item()) if self._enabled else 1.0

    @property
    def scale_tensor(self) -> Tensor:
        """The current scale: float32 0-dim tensor on the state's device. No sync."""
        return self._scale

    @property
    def last_step_skipped_tensor(self) -> Tensor:
        """bool 0-dim device tensor: the last :meth:`update` counted a skipped step. No sync."""
        return self._last_step_skipped

    @property
    def last_step_skipped(self) -> bool:
        """Whether the optimizer step(s) before the last :meth:`update` were skipped.

        Free when :meth:`step` already read the decision to the host (non-fused optimizers);
        otherwise (fused optimizers) reads a device flag: one host sync.
        """
        if self._last_step_skipped_host is None:
            self._last_step_skipped_host = bool(self._last_step_skipped.item())
        return self._last_step_skipped_host

    @property
    def steps(self) -> int:
        """Optimizer steps counted by :meth:`update` (taken or skipped). Syncs host and device."""
        return int(self._steps.item())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was non-finite. Syncs host and device."""
        return int(self._skipped_steps.item())

    @property
    def consecutive_overflows(self) -> int:
        """Overflowing steps in a row up to the last update. Syncs host and device."""
        return int(self._consecutive_overflows.item())

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor or nested list/tuple of tensors) by the scale. No sync.

        Returns ``outputs`` unchanged when the scaler is disabled (scale fixed at 1).
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            self._place(outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise TypeError(f"`outputs` must be a Tensor or an iterable of Tensors, got {type(outputs).__name__}")

    def _params_with_grads(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[Tensor]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not allow_fp16 and self._enabled and any(g.dtype is torch.float16 for g in grads):
            raise ValueError(
                "Attempting to unscale FP16 gradients. HINT: keep the parameters in float32 "
                "and run the forward under autocast (the optimizer needs fp32 master weights)."
            )
        if any(g.is_sparse for g in grads):  # rare: unscale the values of sparse gradients
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None and param.grad.is_sparse and param.grad.dtype is torch.float16:
                        param.grad = param.grad.coalesce()
            grads = [
                p.grad._values() if p.grad.is_sparse else p.grad
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            ]
        return grads

    def _unscale_and_check(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor | None, allow_fp16: bool
    ) -> Tensor:
        """One ``unscale_and_check_`` call per device over the optimizer's gradients.

        ``inv_scale=None`` only checks (``check_finite``, reading without rewriting: fused
        optimizers unscale in their own step, and a disabled scaler's scale is 1). Returns float32
        0-dim ``found_inf`` on the scale's device (1.0 iff any inf/NaN), MAX-reduced over
        ``process_group`` when one is set. No host sync.
        """
        grads = self._params_with_grads(optimizer, allow_fp16)
        if not grads:
            found_inf = torch.zeros((), dtype=torch.float32, device=self._device)
        else:
            self._place(grads[0].device)
            if self._device.type == "cpu" and all(g.is_cpu for g in grads):
                per_device: Iterable = ((self._device, grads),)  # the common case, without a dict pass
            else:
                groups: dict[torch.device, list[Tensor]] = defaultdict(list)
                for grad in grads:
                    groups[grad.device].append(grad)
                per_device = groups.items()
            flags = []
            # The backends' unchecked entry points: these are gradients of floating point parameters,
            # which the public ones would validate again at every step.
            with torch.no_grad():
                for device, tensors in per_device:
                    backend = self._backends.get(device)
                    if backend is None:
                        backend = self._backends[device] = get_backend(device=device)
                    if inv_scale is None:
                        flags.append(backend._check_finite(tensors, self._device))
                        continue
                    device_inv_scale = inv_scale if inv_scale.device == device else inv_scale.to(device)
                    flag = backend._dispatch_unscale_and_check_(tensors, device_inv_scale.reshape(()))
                    flags.append(flag.to(self._device))
            found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
        if self.process_group is not None and is_distributed():
            comm_device = collective_device(self.process_group)
            flag = found_inf.to(comm_device)
            shm_collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
            found_inf = flag.to(self._device)
        return found_inf

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is inf/NaN.

        One fused ``unscale_and_check_`` pass per device (``lightning_ext.kernels``); a disabled
        scaler (scale 1) only checks, with ``check_finite``, which reads the gradients without
        rewriting them. Call it before clipping so the clip sees true gradients. No host sync (one
        all_reduce with ``process_group``).

        Raises:
            RuntimeError: called twice for ``optimizer`` since the last :meth:`update`, or after :meth:`step`.
            ValueError: the gradients are float16 (the optimizer needs float32 master parameters).
        """
        if not self._checks:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # Disabled (scale fixed at 1): only the inf/NaN check, reading the gradients without the
        # write pass a multiply by 1 would cost (KernelBackend.check_finite).
        inv_scale = self._scale.double().reciprocal().float().to(self._device) if self._enabled else None
        state["found_inf"] = self._unscale_and_check(optimizer, inv_scale, allow_fp16=False)
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran), then ``optimizer.step(*args, **kwargs)`` unless non-finite.

        Optimizers with ``_step_supports_amp_scaling`` (``fused=True`` Adam/AdamW/SGD) get
        ``optimizer.grad_scale`` / ``optimizer.found_inf`` and skip on the device: no host sync; their
        gradients are only checked (``KernelBackend.check_finite``: read, not rewritten as GradScaler
        does by unscaling at scale 1). Others: the skip decision reads ``found_inf`` to the host (one
        sync per optimizer step).

        Returns:
            ``optimizer.step``'s return value, or ``None`` when the step was skipped.

        Raises:
            RuntimeError: ``step`` already called for ``optimizer`` since the last :meth:`update`, or a
                ``closure`` was passed.
        """
        if not self._checks:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "Closure use is not supported by DynamicLossScaler.step(): the gradients must exist "
                "before the inf/NaN check. HINT: run the closure yourself, then call step(optimizer)."
            )
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if state["stage"] is _Stage.READY:
                state["found_inf"] = self._unscale_and_check(optimizer, None, allow_fp16=True)
                previous = getattr(optimizer, "grad_scale", None)
                optimizer.grad_scale = self._scale if previous is None else self._scale * previous  # type: ignore[attr-defined]
            else:
                optimizer.grad_scale = getattr(optimizer, "grad_scale", None)  # type: ignore[attr-defined]
            optimizer.found_inf = state["found_inf"]  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            state["stage"] = _Stage.STEPPED
            state["host_skipped"] = None
            return retval
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        retval = None
        # The skip decision: the one documented host sync of the step.
        skipped = bool(state["found_inf"].item())
        if not skipped:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        state["host_skipped"] = skipped
        return retval

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Advance the schedule and the counters once for all optimizers stepped since the last update.

        Call once per iteration after every :meth:`step`; with gradient accumulation, only at the
        accumulation boundary. Runs on the device, no host sync, except with
        ``on_min_scale="warn"|"raise"`` on a step that overflowed (reads one flag). With the state
        on the CPU, the same update branches on host values instead (reading CPU tensors is no
        sync; same results bit for bit, writing only the state tensors whose value changes).

        Args:
            new_scale: set the scale to this value instead of following the schedule (GradScaler's
                semantics; trackers untouched). A float must lie in ``[min_scale, max_scale]``.

        Raises:
            RuntimeError: no optimizer called :meth:`step` since the last update.
            ValueError: ``new_scale`` outside ``[min_scale, max_scale]``.
            FloatingPointError: ``on_min_scale="raise"`` and an overflow hit the floor.
        """
        if not self._checks:
            return
        states = [s for s in self._per_optimizer_states.values() if s["stage"] is _Stage.STEPPED]
        if not states:
            raise RuntimeError(
                "update() was called but no optimizer called step() since the last update(). "
                "HINT: call scaler.step(optimizer) for every optimizer first, then update() once."
            )
        found_inf = (
            states[0]["found_inf"]
            if len(states) == 1
            else torch.stack([s["found_inf"] for s in states]).amax()
        )
        host_flags = [s.get("host_skipped") for s in states]
        host_skipped = None if any(f is None for f in host_flags) else any(host_flags)
        self._per_optimizer_states = defaultdict(_new_optimizer_state)

        cfg = self._config
        if self._device.type == "cpu":
            # CPU state: reading it is no host-device sync; branching in Python on host values and
            # writing only what changes costs a fraction of the device path's small tensor ops
            # (same results, tested).
            overflow = host_skipped if host_skipped is not None else bool(found_inf.item() > 0)
            self._count_on_host(overflow)
            if self._enabled and new_scale is not None:
                self._set_scale(new_scale)
            elif self._enabled:
                hit = _update_scale_on_host_(
                    self._scale,
                    self._log2_scale,
                    self._growth_tracker,
                    self._hysteresis_tracker,
                    overflow,
                    **self._schedule_kwargs,
                )
                if hit and cfg["on_min_scale"] != "clamp":
                    self._floor_hit(int(self._consecutive_overflows.item()))
            self._report_telemetry(found_inf)
            return
        if host_skipped is not None:
            # The skip decision is already on the host (non-fused optimizers): count with it, three
            # small ops instead of the eight of the device-side counting below; no sync either way.
            self._count_on_host(host_skipped)
        else:
            counters = (self._steps, self._skipped_steps, self._consecutive_overflows)
            _update_counters_(*counters, self._last_step_skipped, found_inf)
            self._last_step_skipped_host = None
        if self._enabled:
            if new_scale is not None:
                self._set_scale(new_scale)
            else:
                need_floor = cfg["on_min_scale"] != "clamp" and host_skipped is not False
                hit_floor = _update_scale_(
                    self._scale,
                    self._log2_scale,
                    self._growth_tracker,
                    self._hysteresis_tracker,
                    found_inf,
                    **self._schedule_kwargs,
                    need_floor=need_floor,
                )
                if need_floor:
                    # Host sync, only on steps that overflowed (or whose decision stayed on the device).
                    hit, consecutive = torch.stack([hit_floor.double(), self._consecutive_overflows]).tolist()
                    if hit:
                        self._floor_hit(int(consecutive))
        self._report_telemetry(found_inf)

    def _count_on_host(self, overflow: bool) -> None:
        """Count one optimizer step whose skip decision is known on the host (no sync).

        Writes only what changes: after a clean step (``_last_step_skipped_host is False``) the run
        of overflows is already 0 and the flag already False, so a clean step after a clean step is
        one op (``load_state_dict`` refuses states that break this).
        """
        self._steps.add_(1)
        if overflow:
            self._skipped_steps.add_(1)
            self._consecutive_overflows.add_(1)
        elif self._last_step_skipped_host is not False:
            self._consecutive_overflows.zero_()
        if overflow is not self._last_step_skipped_host:
            self._last_step_skipped.fill_(overflow)
        self._last_step_skipped_host = overflow

    def _report_telemetry(self, found_inf: Tensor) -> None:
        if self.telemetry:
            # Clones: the state tensors change in place at the next update.
            report("AMP/loss_scale_log2", self._log2_scale.clone())
            report("AMP/overflow", found_inf)
            report("AMP/skipped_steps", self._skipped_steps.clone())

    def _floor_hit(self, consecutive: int) -> None:
        """Warn or raise (``on_min_scale``): an overflowing step backed off below ``min_scale``."""
        message = (
            f"the loss scale hit its floor min_scale={self._config['min_scale']!r} after "
            f"{consecutive} consecutive overflowing step(s): the gradients are non-finite even "
            "unscaled. HINT: lower the learning rate, check the data and the loss for inf/NaN."
        )
        if self._config["on_min_scale"] == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _set_scale(self, new_scale: float | Tensor) -> None:
        if isinstance(new_scale, Tensor):
            value = new_scale.to(device=self._device, dtype=torch.float32).reshape(())
            self._scale.copy_(value.clamp(self._config["min_scale"], self._config["max_scale"]))
        else:
            lo, hi = self._config["min_scale"], self._config["max_scale"]
            if not (isinstance(new_scale, (int, float)) and lo <= new_scale <= hi):
                raise ValueError(f"`new_scale` must be a float in [{lo!r}, {hi!r}], got {new_scale!r}")
            self._scale.fill_(float(new_scale))
        self._log2_scale.copy_(torch.log2(self._scale.double()))

    # -------------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """Scale, trackers, counters and configuration as Python numbers. Syncs host and device.

        The GradScaler keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) are included, so GradScaler can load it too.
        """
        values = torch.stack(
            [
                self._log2_scale,
                self._growth_tracker.double(),
                self._hysteresis_tracker.double(),
                self._steps,
                self._skipped_steps,
                self._consecutive_overflows,
                self._last_step_skipped.double(),
            ]
        ).tolist()
        cfg = {k: v for k, v in self._config.items() if k != "init_scale"}
        return {
            "scale": float(self._scale.item()),
            "growth_factor": cfg.pop("growth_factor"),
            "backoff_factor": cfg.pop("backoff_factor"),
            "growth_interval": cfg.pop("growth_interval"),
            "_growth_tracker": int(values[1]),
            **cfg,
            "enabled": self._enabled,
            "skip_nonfinite": self._skip_nonfinite,
            "log2_scale": values[0],
            "_hysteresis_tracker": int(values[2]),
            "steps": int(values[3]),
            "skipped_steps": int(values[4]),
            "consecutive_overflows": int(values[5]),
            "last_step_skipped": bool(values[6]),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, or adopt a ``torch.amp.GradScaler`` state dict.

        A GradScaler state gives the scale, growth tracker and exponential-schedule factors; the other
        settings of this scaler stay, the counters restart at zero and the hysteresis tracker is full.

        Raises:
            ValueError: the state dict is empty (from a disabled GradScaler), misses keys, its values
                break the constructor's rules, or ``consecutive_overflows`` is nonzero while
                ``last_step_skipped`` is false or the reverse (the state was not saved by this class).
        """
        if not state_dict:
            if not self._enabled:
                return
            raise ValueError(
                "`state_dict` is empty, possibly because it was saved from a disabled GradScaler; "
                "expected the keys 'scale', 'growth_factor', 'backoff_factor', 'growth_interval', "
                "'_growth_tracker'"
            )
        missing = [
            k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval") if k not in state_dict
        ]
        if missing:
            raise ValueError(f"`state_dict` misses the keys {missing}; got keys {sorted(state_dict)!r}")
        cfg = dict(self._config)
        ours = _OWN_KEY in state_dict
        if ours and bool(state_dict.get("consecutive_overflows", 0)) != bool(
            state_dict.get("last_step_skipped", False)
        ):
            raise ValueError(
                "`state_dict` has consecutive_overflows="
                f"{state_dict.get('consecutive_overflows', 0)!r} with last_step_skipped="
                f"{state_dict.get('last_step_skipped', False)!r}: the run of overflows is nonzero "
                "exactly when the last step was skipped"
            )
        for key in cfg:
            if (
                key in state_dict
                and key != "init_scale"
                and (ours or key in ("growth_factor", "backoff_factor", "growth_interval"))
            ):
                cfg[key] = state_dict[key]
        if ours:
            self._enabled = bool(state_dict["enabled"])
            self._skip_nonfinite = bool(state_dict["skip_nonfinite"])
        scale = float(state_dict["scale"])
        cfg["init_scale"] = scale
        if not self._enabled:
            cfg["init_scale"], cfg["min_scale"], cfg["max_scale"] = 1.0, 1.0, 1.0
        self._set_config(**cfg)
        device = self._device
        self._scale = torch.tensor(cfg["init_scale"], dtype=torch.float32, device=device)
        if ours:
            self._log2_scale = torch.tensor(
                float(state_dict["log2_scale"]), dtype=torch.float64, device=device
            )
        else:
            self._log2_scale = torch.log2(self._scale.double())
        self._growth_tracker = torch.tensor(
            int(state_dict.get("_growth_tracker", 0)), dtype=torch.int32, device=device
        )
        hyst = state_dict["_hysteresis_tracker"] if ours else cfg["hysteresis"]
        self._hysteresis_tracker = torch.tensor(int(hyst), dtype=torch.int32, device=device)
        counters = [
            state_dict.get(k, 0) if ours else 0 for k in ("steps", "skipped_steps", "consecutive_overflows")
        ]
        self._steps, self._skipped_steps, self._consecutive_overflows = (
            torch.tensor(float(c), dtype=torch.float64, device=device) for c in counters
        )
        skipped = bool(state_dict.get("last_step_skipped", False)) if ours else False
        self._last_step_skipped = torch.tensor(skipped, device=device)
        self._last_step_skipped_host = skipped
        self._per_optimizer_states = defaultdict(_new_optimizer_state)
