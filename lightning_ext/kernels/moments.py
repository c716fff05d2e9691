"""Shifted moments and extremes of a tensor, accumulated in float64: ``accumulate_moments_``.

Used by :func:`lightning_ext.stats.report`: ``acc = [count, sum(x - shift), sum((x - shift)^2), min, max]``.
Subtracting a shift close to the data (the first value seen) before summing squares keeps the
variance accurate (Chan, Golub & LeVeque 1983, "shifted data"). The Triton kernel does it in one
launch with float64 atomics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, kernel, tl, triton

__all__ = ["accumulate_moments_reference", "accumulate_moments_triton"]


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


# ---------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    def _moments_kernel(
        x_ptr,  # x: (numel,) contiguous, any real dtype
        acc_ptr,  # acc: (5,) fp64 [count, sum(x - shift), sum((x - shift)^2), min, max], updated in place
        shift_ptr,  # shift: () fp64
        numel,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float64)
        d = tl.where(mask, v - tl.load(shift_ptr), 0.0)
        # Each program adds its own count (exact in float64; no special case when numel is a constexpr).
        tl.atomic_add(acc_ptr, tl.sum(mask.to(tl.float64), axis=0))
        tl.atomic_add(acc_ptr + 1, tl.sum(d, axis=0))
        tl.atomic_add(acc_ptr + 2, tl.sum(d * d, axis=0))
        tl.atomic_min(acc_ptr + 3, tl.min(tl.where(mask, v, float("inf")), axis=0))
        tl.atomic_max(acc_ptr + 4, tl.max(tl.where(mask, v, float("-inf")), axis=0))


# ---------------------------------------------------------------------------- launcher


def accumulate_moments_triton(acc: Tensor, x: Tensor, shift: Tensor, interpret: bool = False) -> None:
    """Launcher: ONE kernel launch; float64 atomics combine the programs' partial sums and extremes.

    Non-contiguous ``x`` is flattened with a copy first. NaN in ``x`` makes the sums NaN; min/max
    follow the hardware atomics (NaN is not guaranteed to propagate there).
    """
    x = x.reshape(-1)
    block = 4096 if interpret else 1024
    kernel(_moments_kernel, interpret)[(triton.cdiv(x.numel(), block),)](
        x, acc, shift, x.numel(), BLOCK=block
    )
