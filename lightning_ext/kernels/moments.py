"""``accumulate_moments_`` (contract: :meth:`~lightning_ext.kernels.KernelBackend.accumulate_moments_`):
``_accumulate_moments_reference`` and the Triton kernel's launcher ``_accumulate_moments_triton``."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, sm_count, tl, triton

__all__: list[str] = []  # an op family: the backends bind its `_<op>_<backend>` functions

# ---------------------------------------------------------------------------- reference (pure torch)


def _accumulate_moments_reference(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """float64 copy, shifted sum and dot product (BLAS), ``aminmax`` (it propagates NaN)."""
    # Out of place: for float64 ``x``, ``.to(float64)`` aliases ``x`` and ``sub_`` would modify it.
    xd = x.reshape(-1).to(torch.float64) - shift
    mn, mx = torch.aminmax(x.reshape(-1))
    acc[0].add_(x.numel())
    acc[1:3].add_(torch.stack((xd.sum(), torch.dot(xd, xd))))
    torch.minimum(acc[3], mn.to(torch.float64), out=acc[3])
    torch.maximum(acc[4], mx.to(torch.float64), out=acc[4])


# ---------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    @triton.jit
    def _moments_kernel(
        x_ptr,  # x: (numel,) contiguous, any real dtype
        acc_ptr,  # acc: (5,) fp64 [count, sum(x - shift), sum((x - shift)^2), min, max], updated in place
        shift_ptr,  # shift: () fp64
        numel,
        n_blocks,  # cdiv(numel, BLOCK)
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Grid-stride loop over the blocks with per-lane float64 partials; one set of atomics per
        # program (a few hundred programs), not per block: the five addresses are not contended.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK)
        shift = tl.load(shift_ptr)
        s1 = tl.zeros([BLOCK], dtype=tl.float64)
        s2 = tl.zeros([BLOCK], dtype=tl.float64)
        lo = tl.full([BLOCK], float("inf"), dtype=tl.float64)
        hi = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
        for b in range(pid, n_blocks, nprog):
            offs = tl.cast(b, tl.int64) * BLOCK + lanes
            mask = offs < numel
            v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float64)
            d = tl.where(mask, v - shift, 0.0)
            s1 += d
            s2 += d * d
            lo = tl.minimum(lo, tl.where(mask, v, float("inf")))
            hi = tl.maximum(hi, tl.where(mask, v, float("-inf")))
        # Counts come from the block ranges (exact in float64; one add per program).
        first = tl.cast(pid, tl.int64) * BLOCK
        stride = tl.cast(nprog, tl.int64) * BLOCK
        mine = tl.where(first < numel, (numel - first + stride - 1) // stride, 0)  # blocks of this program
        last = first + (mine - 1) * stride  # start of its last block
        count = tl.where(mine > 0, (mine - 1) * BLOCK + tl.minimum(numel - last, BLOCK), 0)
        tl.atomic_add(acc_ptr, count.to(tl.float64))
        tl.atomic_add(acc_ptr + 1, tl.sum(s1, axis=0))
        tl.atomic_add(acc_ptr + 2, tl.sum(s2, axis=0))
        tl.atomic_min(acc_ptr + 3, tl.min(lo, axis=0))
        tl.atomic_max(acc_ptr + 4, tl.max(hi, axis=0))


# ---------------------------------------------------------------------------- launcher


def _accumulate_moments_triton(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """ONE launch of at most 4 programs per multiprocessor; float64 atomics combine their partials.

    Non-contiguous ``x`` is flattened with a copy first. Float atomics need not propagate NaN, so one
    more op sets the extremes to NaN when the sums are.
    """
    x = x.reshape(-1)
    block = 4096 if x.is_cpu else 1024  # Triton's interpreter (CPU tensors): few, large programs
    blocks = triton.cdiv(x.numel(), block)
    programs = min(blocks, 3 if x.is_cpu else 4 * sm_count(x.device))
    _moments_kernel[(programs,)](x, acc, shift, x.numel(), blocks, BLOCK=block)
    acc[3:].masked_fill_(torch.isnan(acc[2]), float("nan"))
