"""Batch-norm op family: per-channel statistics, normalization and the two backward pieces.

Layout (STYLE.md rule 6, after Liger-Kernel ``ops/layer_norm.py``): the reference implementations in
pure torch (fused ATen ops, no chains of eager ops), then the Triton kernels, then their launchers
that own allocation, grid, float32 accumulators and layout checks. The autograd wiring lives in
:mod:`lightning_ext.kernels.backend`; modules (``SyncBatchNorm``) live in :mod:`lightning_ext.nn`.

The maths follows ``torch.nn.SyncBatchNorm``'s CUDA building blocks (``batch_norm_stats``,
``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``), except that the
statistics are ``(count, mean, m2)`` so shards combine with Chan et al.'s formula in one all_reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels.backend import _stat_dtype

__all__ = [
    "batch_norm_backward_elemt_reference",
    "batch_norm_backward_reduce_reference",
    "batch_norm_elemt_reference",
    "batch_norm_stats_reference",
]


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    """``(C,)`` -> ``(C, 1, ..., 1)`` broadcasting against ``(N, C, *)`` of ``ndim`` dims."""
    return t.view(-1, *([1] * (ndim - 2)))


# ---------------------------------------------------------------------------- reference (pure torch)


def batch_norm_stats_reference(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(count, mean, m2)`` per channel with ATen's fused ``batch_norm_update_stats``.

    Low-precision input passes float32 scratch running buffers so ATen takes its mixed-dtype path,
    which accumulates and returns float32 without copying ``x``.
    """
    c = x.shape[1]
    dtype = _stat_dtype(x)
    n = x.numel() // c if c else 0
    count = torch.full((c,), float(n), dtype=dtype, device=x.device)
    if x.numel() == 0:
        return (
            count,
            torch.zeros(c, dtype=dtype, device=x.device),
            torch.zeros(c, dtype=dtype, device=x.device),
        )
    if x.dtype in (torch.float32, torch.float64):
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    else:
        scratch = torch.empty(2, c, dtype=dtype, device=x.device)
        mean, var = torch.batch_norm_update_stats(x, scratch[0], scratch[1], 0.0)
    return count, mean, var * n


def batch_norm_elemt_reference(
    x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
) -> Tensor:
    """``(x - mean) * invstd * weight + bias`` with ATen's fused inference batch norm.

    ``torch.batch_norm`` in eval mode with ``running_var = invstd^-2`` and ``eps = 0`` computes exactly
    ``(x - mean) * invstd`` (up to rounding of the reciprocal), in one pass, keeping the memory format.
    """
    dtype = _stat_dtype(x)
    var = invstd.to(dtype).pow(-2)
    mean = mean.to(dtype)
    weight = weight.to(dtype) if weight is not None else None
    bias = bias.to(dtype) if bias is not None else None
    if x.numel() == 0:
        return torch.empty_like(x)
    return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, 0.0, False)


def batch_norm_backward_reduce_reference(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor
) -> tuple[Tensor, Tensor]:
    """``(sum(dy), sum(dy * (x - mean)))`` with ATen's fused ``native_batch_norm_backward``.

    Asking it for ``(grad_weight, grad_bias)`` with ``save_invstd = 1`` yields exactly the two sums.
    """
    c = x.shape[1]
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        zero = torch.zeros(c, dtype=dtype, device=x.device)
        return zero, zero.clone()
    ones = torch.ones(c, dtype=dtype, device=x.device)
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, None, None, None, mean.to(dtype), ones, True, 0.0, [False, True, True]
    )
    return sum_dy.to(dtype), sum_dy_xmu.to(dtype)


def batch_norm_backward_elemt_reference(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: Tensor,
) -> Tensor:
    """``dx = (dy - a - (x - mean) * b) * c`` with ``a = sum_dy/count``, ``b = invstd^2 sum_dy_xmu/count``.

    Two fused ATen passes: an inference batch norm gives ``u = (x - mean) * (-b c) - a c`` in ``x``'s
    memory format, then ``u += dy * c`` in place (``addcmul_``).
    """
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        return torch.empty_like(x)
    invstd = invstd.to(dtype)
    c = invstd * weight.to(dtype) if weight is not None else invstd
    count = count.to(dtype)
    a = sum_dy.to(dtype) / count
    b = invstd * invstd * sum_dy_xmu.to(dtype) / count
    ones = torch.ones_like(invstd)
    u = torch.batch_norm(x, -b * c, -a * c, mean.to(dtype), ones, False, 0.0, 0.0, False)
    return u.addcmul_(dy, _channel_view(c, x.dim()))
