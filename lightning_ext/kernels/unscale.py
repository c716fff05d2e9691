"""Fused gradient unscaling with an inf/NaN check: ``unscale_and_check_``.

Reference: ATen's ``_amp_foreach_non_finite_check_and_unscale_`` (what ``torch.amp.GradScaler``
uses), one call per (device, dtype) bucket. The Triton kernel reads each tensor once, writes it
scaled, and raises a device-side flag with an atomic max.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

__all__ = ["bucket_by_device_and_dtype", "combine_found_inf", "unscale_and_check_reference"]


def bucket_by_device_and_dtype(tensors: list[Tensor]) -> dict[torch.device, dict[torch.dtype, list[Tensor]]]:
    """Group ``tensors`` by device, then dtype, keeping their order (no copies)."""
    buckets: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
    for t in tensors:
        buckets[t.device][t.dtype].append(t)
    return buckets


def combine_found_inf(flags: list[Tensor], device: torch.device) -> Tensor:
    """Combine per-device float32 0-dim flags into one on ``device`` (``non_blocking`` copies, no sync)."""
    if len(flags) == 1 and flags[0].device == device:
        return flags[0]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    moved = [f.to(device, non_blocking=True) for f in flags]
    return torch.stack(moved).amax()


# ---------------------------------------------------------------------------- reference (pure torch)


def unscale_and_check_reference(tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
    """One ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) bucket."""
    flags = []
    for device, by_dtype in bucket_by_device_and_dtype(tensors).items():
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        flags.append(found)
    return combine_found_inf(flags, inv_scale.device)
