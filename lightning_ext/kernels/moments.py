"""Shifted moments and extremes of a tensor, accumulated in float64: ``accumulate_moments_``.

Used by :func:`lightning_ext.stats.report`: ``acc = [count, sum(x - shift), sum((x - shift)^2), min, max]``.
Subtracting a shift close to the data (the first value seen) before summing squares keeps the
variance accurate (Chan, Golub & LeVeque 1983, "shifted data"). The Triton kernel does it in one
launch with float64 atomics.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["accumulate_moments_reference"]


# ---------------------------------------------------------------------------- reference (pure torch)


def accumulate_moments_reference(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """float64 copy, shifted sum and dot product (BLAS), ``aminmax``; five in-place updates of ``acc``."""
    # Out of place: for float64 ``x``, ``.to(float64)`` aliases ``x`` and ``sub_`` would modify it.
    xd = x.reshape(-1).to(torch.float64) - shift
    mn, mx = torch.aminmax(x.reshape(-1))
    acc[0].add_(x.numel())
    acc[1:3].add_(torch.stack((xd.sum(), torch.dot(xd, xd))))
    torch.minimum(acc[3], mn.to(torch.float64), out=acc[3])
    torch.maximum(acc[4], mx.to(torch.float64), out=acc[4])
