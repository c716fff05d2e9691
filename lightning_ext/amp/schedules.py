"""Loss-scale schedules as pure functions on 0-dim device tensors: one step each, in place, no host sync.

Three models:

* ``torch.amp.GradScaler`` — ``_exponential_``: ``scale *= growth_factor`` after
  ``growth_interval`` clean steps in a row, ``scale *= backoff_factor`` on an overflow
  (GradScaler's own op ``torch._amp_update_scale_``, so the scales agree bit for bit).
* StyleGAN2-ADA's training loop (Karras et al. 2020) — ``_log2_``: ``log2(scale)`` grows by
  ``increment`` per clean step and drops by ``decrement`` per back-off; ``log2(scale)`` is kept in
  float64 so that small increments accumulate exactly.
* Megatron-LM / DeepSpeed ``DynamicGradScaler`` — ``hysteresis``, for both: an overflow decrements a
  tracker that starts at ``hysteresis``; the scale backs off on an overflow that leaves it ``<= 0``;
  the tracker is refilled when the scale grows. ``hysteresis=1`` backs off on every overflow.

Every overflowing step is skipped whatever the schedule decides (the scaler's business). Each
schedule returns the bool 0-dim tensor ``back_off`` (this step backed the scale off), for the floor
policy of ``_clamp_``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_ext._compat import amp_update_scale_

__all__: list[str] = []  # the scalers' maths: private helpers, tested directly

_LOG2_FLOAT32_MAX = math.log2(torch.finfo(torch.float32).max)  # the log2 schedule's ceiling


def _hysteresis(overflow: Tensor, tracker: Tensor, hysteresis: int) -> tuple[Tensor, Tensor]:
    """``(back_off, tracker after the overflow)``: Megatron-LM's rule; a tracker above ``hysteresis``
    (lowered during the run) counts as ``hysteresis``."""
    after = tracker.clamp(max=hysteresis) - overflow.to(tracker.dtype)
    return overflow & (after <= 0), after


def _exponential_(scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor, found_inf: Tensor,
                 growth_factor: float, backoff_factor: float, growth_interval: int,
                 hysteresis: int, consecutive: bool = False) -> Tensor:  # fmt: skip
    """GradScaler's schedule with hysteresis, one optimizer step.

    Args:
        scale: float32 0-dim, updated in place (growth that would not be finite is refused, as
            GradScaler does).
        growth_tracker: int32 0-dim, clean steps since the last growth or overflow; in place.
        hysteresis_tracker: int32 0-dim, overflows still tolerated; in place (untouched for
            ``hysteresis == 1``, where every overflow backs off).
        found_inf: float32 0-dim, nonzero iff the step's gradients had an inf/NaN.
        growth_factor, backoff_factor, growth_interval: GradScaler's.
        hysteresis: the tracker's value after a growth, ``>= 1``.
        consecutive: refill the tracker after every clean step instead of after a growth only
            (DeepSpeed's ``consecutive_hysteresis``: only consecutive overflows add up).

    Returns:
        bool 0-dim ``back_off`` on the scale's device.
    """
    overflow = found_inf > 0
    if hysteresis == 1:
        amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return overflow
    back_off, after = _hysteresis(overflow, hysteresis_tracker, hysteresis)
    # A tolerated overflow resets the growth count without backing off: from -1, GradScaler's op
    # (told "clean") leaves the tracker at 0 and cannot grow (growth_interval >= 1).
    growth_tracker.copy_(torch.where(overflow & ~back_off, -1, growth_tracker))
    amp_update_scale_(scale, growth_tracker, back_off.float(), growth_factor, backoff_factor, growth_interval)
    refill = ~overflow if consecutive else ~overflow & (growth_tracker == 0)  # 0 after op: it grew
    hysteresis_tracker.copy_(torch.where(refill, hysteresis, after))
    return back_off


def _log2_(scale: Tensor, log2_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
          found_inf: Tensor, increment: float, decrement: float, hysteresis: int,
          growth_interval: int) -> Tensor:  # fmt: skip
    """StyleGAN2-ADA's schedule with hysteresis, one optimizer step.

    Args:
        scale: float32 0-dim, set to ``2 ** log2_scale`` (0 from ``log2_scale <= -150``, where
            float32 underflows).
        log2_scale: float64 0-dim, the authoritative value; in place; growth stops at
            ``log2(float32 max)`` (a scale above it would be inf).
        growth_tracker: int32 0-dim, clean steps in a row modulo ``growth_interval`` (GradScaler's range:
            the state loads into GradScaler or the exponential schedule, which grow when it reaches
            ``growth_interval - 1``); in place.
        hysteresis_tracker: int32 0-dim, overflows still tolerated; refilled on every clean step.
        found_inf: float32 0-dim, nonzero iff the step's gradients had an inf/NaN.
        increment, decrement: ``log2(scale)`` change per clean step / per back-off.
        hysteresis: the tracker's value after a clean step, ``>= 1``.
        growth_interval: the modulus of ``growth_tracker``, ``>= 1``.

    Returns:
        bool 0-dim ``back_off`` on the scale's device.
    """
    overflow = found_inf > 0
    back_off, after = _hysteresis(overflow, hysteresis_tracker, hysteresis)
    step = torch.full_like(log2_scale, increment).masked_fill_(overflow, 0.0)
    step.masked_fill_(back_off, -decrement)
    grown = log2_scale + step  # growth beyond float32's largest scale is refused, as GradScaler does
    log2_scale.copy_(torch.where(step > 0, grown.clamp(max=_LOG2_FLOAT32_MAX), grown))
    growth_tracker.copy_(torch.where(overflow, 0, (growth_tracker + 1) % growth_interval))
    hysteresis_tracker.copy_(torch.where(overflow, after, hysteresis))
    scale.copy_(torch.exp2(log2_scale))
    return back_off


def _clamp_(scale: Tensor, log2_scale: Tensor | None, back_off: Tensor, min_scale: float | None,
           max_scale: float | None) -> Tensor:  # fmt: skip
    """Keep the scale in ``[min_scale, max_scale]`` (``None``: unbounded) after a schedule step.

    Args:
        scale: float32 0-dim, clamped in place.
        log2_scale: float64 0-dim, clamped in place for the log2 schedule (``None`` otherwise).
        back_off: the schedule's return value.
        min_scale, max_scale: the bounds.

    Returns:
        bool 0-dim: this step backed off below ``min_scale`` (the floor was hit).
    """
    hit_floor = back_off & (scale < min_scale) if min_scale is not None else torch.zeros_like(back_off)
    if min_scale is None and max_scale is None:  # torch's clamp_ needs one bound
        return hit_floor
    if log2_scale is not None:
        low = math.log2(min_scale) if min_scale is not None else None
        high = math.log2(max_scale) if max_scale is not None else None
        log2_scale.clamp_(low, high)
        scale.copy_(torch.exp2(log2_scale))
    else:
        scale.clamp_(min_scale, max_scale)
    return hit_floor


def _count_(steps: Tensor, skipped_steps: Tensor, consecutive_overflows: Tensor, found_inf: Tensor) -> None:
    """Count one optimizer step (float64 0-dim counters, in place): taken or skipped, and the run of
    skipped steps ending here."""
    overflow = found_inf > 0  # bool: added to the float64 counters as 0/1
    steps.add_(1)
    skipped_steps.add_(overflow)
    consecutive_overflows.mul_(overflow).add_(overflow)
