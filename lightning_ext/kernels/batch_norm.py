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

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, cdiv, kernel, next_power_of_2, sm_count, tl, tl_dtype
from lightning_ext.kernels.backend import _memory_format, _stat_dtype

__all__ = [
    "batch_norm_backward_cpu",
    "batch_norm_backward_elemt_reference",
    "batch_norm_backward_elemt_triton",
    "batch_norm_backward_reduce_reference",
    "batch_norm_backward_reduce_triton",
    "batch_norm_elemt_reference",
    "batch_norm_elemt_triton",
    "batch_norm_stats_reference",
    "batch_norm_stats_triton",
]


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: itself when it already is (one dispatch fewer than ``t.to(dtype)``)."""
    return t if t.dtype == dtype else t.to(dtype)


_ONES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _ones(c: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A read-only ``(c,)`` tensor of ones for the ops below, which pass it to ATen as a unit
    ``running_var`` or ``weight`` (never written, never saved for autograd). Cached per (size,
    dtype) on the CPU, where these ops are dispatch-bound; made fresh elsewhere (a cached CUDA
    tensor could be read on another stream before its fill kernel ran)."""
    if device.type != "cpu":
        return torch.ones(c, dtype=dtype, device=device)
    key = (c, dtype, device)
    ones = _ONES.get(key)
    if ones is None:
        ones = torch.ones(c, dtype=dtype, device=device)
        if torch.is_inference_mode_enabled() or len(_ONES) >= 256:
            return ones  # an inference tensor must not leak into later autograd-recording calls
        _ONES[key] = ones
    return ones


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    """``(C,)`` -> ``(C, 1, ..., 1)`` broadcasting against ``(N, C, *)`` of ``ndim`` dims."""
    return t.view(-1, *([1] * (ndim - 2)))


# ---------------------------------------------------------------------------- reference (pure torch)


def _stats_channels_first(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 ``(mean, m2)`` per channel of a contiguous float32 ``(N, C, *)`` tensor, in two passes.

    ATen's float32 ``batch_norm_update_stats`` walks a contiguous ``(N, C, S)`` tensor channel by
    channel with a scalar Welford loop (measured 4.0 ms at (32, 64, 32, 32) on one core, vs 0.4 ms
    channels-last). Here: pass 1, row sums over the contiguous ``S`` (vectorized) give the mean;
    pass 2, ``(x - mean)`` and its row dot products give ``m2`` (textbook two-pass variance, no
    cancellation); rows are combined over ``N`` in float64. About 2x faster at that shape (1.9 ms).
    """
    n, c = x.shape[0], x.shape[1]
    rows = x.view(n, c, -1)  # (N, C, S)
    count = rows.shape[0] * rows.shape[2]
    mean = rows.sum(dim=2).sum(dim=0, dtype=torch.float64).div_(count).to(torch.float32)  # (C,)
    dev = rows - mean.view(1, c, 1)  # (N, C, S)
    if torch.is_autocast_enabled(x.device.type):
        # vecdot is on autocast's lower-precision list: under bf16/fp16 autocast it would square
        # in bfloat16 and lose m2 to ~3 digits.
        with torch.autocast(x.device.type, enabled=False):
            m2 = torch.linalg.vecdot(dev, dev, dim=2)
    else:
        m2 = torch.linalg.vecdot(dev, dev, dim=2)
    m2 = m2.sum(dim=0, dtype=torch.float64).to(torch.float32)
    return mean, m2


def batch_norm_stats_reference(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(count, mean, m2)`` per channel with ATen's fused ``batch_norm_update_stats``.

    Low-precision input passes float32 scratch running buffers so ATen takes its mixed-dtype path,
    which accumulates and returns float32 without copying ``x``. Contiguous float32 input of at least
    64Ki elements and a spatial size >= 32 takes a faster two-pass route (:func:`_stats_channels_first`).
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
    if (
        x.dtype == torch.float32
        and x.dim() > 2
        and x.is_contiguous()
        and x.shape[2:].numel() >= 32
        and x.numel() >= 1 << 16
    ):
        return count, *_stats_channels_first(x)
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

    ``torch.batch_norm`` in eval mode with ``running_var = 1``, ``eps = 0`` and ``weight * invstd`` as
    its weight computes ``(x - mean) * (invstd * weight) + bias`` in one pass, keeping the memory
    format (any sign of ``invstd``: the autograd wiring passes negative scales).
    """
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        return torch.empty_like(x)
    scale = _as(invstd, dtype)
    if weight is not None:
        scale = scale * _as(weight, dtype)
    return torch.batch_norm(
        x,
        scale,
        _as(bias, dtype) if bias is not None else None,
        _as(mean, dtype),
        _ones(x.shape[1], dtype, x.device),
        False,
        0.0,
        0.0,
        False,
    )


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
    ones = _ones(c, dtype, x.device)
    # ATen's CPU kernel loses the float32 accumulation unless dy and x are dense in one layout.
    fmt = _memory_format(x)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    # weight = ones: grad_weight is then sum(dy * (x - mean)) (CUDA's kernel also needs a weight).
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, ones, None, None, _as(mean, dtype), ones, True, 0.0, [False, True, True]
    )
    return _as(sum_dy, dtype), _as(sum_dy_xmu, dtype)


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
    memory format, then ``u += dy * c`` in place (``addcmul_``). Low-precision input is upcast to
    float32 first (two more passes) because ``u`` and ``dy * c`` can nearly cancel.
    """
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        return torch.empty_like(x)
    invstd = _as(invstd, dtype)
    c = invstd * _as(weight, dtype) if weight is not None else invstd
    count = _as(count, dtype)
    a = _as(sum_dy, dtype) / count
    b = invstd * invstd * _as(sum_dy_xmu, dtype) / count
    ones = _ones(x.shape[1], dtype, x.device)
    # u and dy*c nearly cancel when dx is small: keep u in float32 for low-precision input.
    xs = _as(x, dtype)
    u = torch.batch_norm(xs, -b * c, -a * c, _as(mean, dtype), ones, False, 0.0, 0.0, False)
    u.addcmul_(dy, _channel_view(c, x.dim()))
    return u if u.dtype == x.dtype else u.to(x.dtype)


def batch_norm_backward_cpu(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    count: Tensor,
    sum_over_group: Callable[[Tensor], Tensor] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Group batch-norm backward on the CPU: ATen's fused LOCAL backward, then a global correction.

    ``native_batch_norm_backward`` in training mode, given the global ``mean``/``invstd``, returns in
    one fused call (no upcast copies of low-precision input) ``dx_local`` — the input gradient as if
    this shard were the whole batch — and the local sums ``S1 = sum(dy)``, ``S2 = sum(dy (x - mean))``.
    The exact group gradient differs from it by a per-channel affine function of ``x``::

        dx = dx_local + k1 (x - mean) + k0,  k0 = w i (S1 / n - G1 / N),  k1 = w i^3 (S2 / n - G2 / N)

    (``i = invstd``, ``w = weight``, ``n``/``N`` the local/global count, ``G`` the group sums), which
    one fused inference batch norm computes and one ``add_`` applies: three passes over the data in
    the input dtype, where reduce + elemt take five for low-precision input (two upcast copies).
    ``benchmarks/bench_kernels.py`` times this op against reduce + elemt per dtype: for float32 input
    reduce + elemt is the faster (ATen's fused float32 CPU backward is slow for contiguous NCHW),
    so the reference backend uses this for float16/bfloat16 only. The per-channel coefficients are
    NumPy arithmetic on ``(C,)`` vectors (cheaper than a small torch op's dispatch).

    Args:
        dy: gradient of the output, ``x``'s shape and dtype, dense in ``x``'s memory format (as
            :meth:`KernelBackend.batch_norm_backward` passes it).
        x: non-empty CPU float16/bfloat16 (also float32/float64) tensor ``(N, C, *)``.
        mean, invstd: float32 ``(C,)`` global statistics of the forward; ``invstd > 0``.
        weight: ``(C,)`` or ``None`` (ones).
        count: float32 ``(C,)``, the GLOBAL number of elements per channel.
        sum_over_group: callable summing a float32 ``(2C,)`` tensor over the group, or ``None``.

    Returns:
        ``(dx, sum_dy, sum_dy_xmu)``: ``dx`` in ``x``'s shape, dtype and memory format; the LOCAL
        float32 ``(C,)`` sums.

    Raises nothing of its own (arguments are validated by the public op). No host-device sync
    (CPU tensors; ``sum_over_group`` is one collective).
    """
    dtype = _stat_dtype(x)
    channels = x.shape[1]
    x = x.contiguous(memory_format=_memory_format(x))  # dy: dense in this layout already
    mean = _as(mean, dtype)
    invstd = _as(invstd, dtype)
    ones = _ones(channels, dtype, x.device)
    w = _as(weight.detach(), dtype) if weight is not None else ones
    dx, grad_weight, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, invstd, True, 0.0, [True, True, True]
    )
    # Per-channel arithmetic on NumPy views (no copies): packing the two sums for the collective
    # and the correction's coefficients.
    i, wn, n_global = invstd.detach().numpy(), w.numpy(), count.detach().numpy()
    s1 = sum_dy.numpy()
    s2 = grad_weight.numpy() / i  # grad_weight = S2 * invstd
    g1, g2 = s1, s2
    if sum_over_group is not None:
        packed = np.concatenate((s1, s2))
        total = sum_over_group(torch.from_numpy(packed)).numpy()
        g1, g2 = total[:channels], total[channels:]
    n_local = x.numel() // channels
    wi = wn * i
    k0 = wi * (s1 / n_local - g1 / n_global)
    k1 = wi * i * i * (s2 / n_local - g2 / n_global)
    dx.add_(
        torch.batch_norm(x, torch.from_numpy(k1), torch.from_numpy(k0), mean, ones, False, 0.0, 0.0, False)
    )
    return dx, sum_dy, torch.from_numpy(s2)


# ---------------------------------------------------------------------------- Triton kernels
# Every tensor is addressed as (N, C, S) through strides (sn, sc, ss): contiguous NCHW has
# (C*S, S, 1), channels_last(_3d) (S*C, 1, C), (N, C) input S = 1. When every tensor of a call allows
# it (sn == S*ss, or S == 1), N is folded into S (channels_last and (N, C) become one image of N*S
# rows). A tile is BLOCK_S positions x BLOCK_C channels, masked at both edges; addresses are
# n*sn + s*ss + c*sc with no integer division per element, and Triton coalesces along whichever of
# ss, sc is 1 (it specializes stride arguments equal to 1).
# Reductions split the (n, spatial block) units of each channel block over SPLIT programs, keep
# per-lane float32 (float64 for float64 input) accumulators and reduce the tile once at the end;
# with SPLIT > 1 a small kernel sums the (SPLIT, 2, C) partials in float64 in a fixed order
# (deterministic).
# Statistics use sums of x - shift with shift = x[0, c, 0] (shifted data, Chan, Golub & LeVeque
# 1983): m2 = S2 - S1^2 / n loses nothing to cancellation while the shift is within a few standard
# deviations of the mean, whatever the mean.

# Launch constants, from a sweep on an H100 (benchmarks/tune_kernels_gpu.py): elementwise kernels
# want many small programs; reductions fewer, larger ones (and so fewer partials to combine).
_TILE, _NUM_WARPS = 2048, 4  # elementwise: elements per tile, warps
_RED_TILE, _RED_NUM_WARPS = 4096, 8  # reductions
_PROGRAMS_PER_SM = 4  # reductions: programs per multiprocessor to aim for
_COMBINE_ROWS = 128  # partials summed per step of the combine kernel (8 warps)
if HAS_TRITON:

    def _bn_stats_kernel(
        x_ptr,  # x: (N, C, S) strided, fp16/bf16/fp32/fp64
        part_ptr,  # partials: (SPLIT, 2, C) ACC [sum(x - shift), sum((x - shift)^2)] (unused if FINAL)
        count_ptr, mean_ptr, m2_ptr,  # results: (C,) ACC each (written only if FINAL)
        N, C, S, sn, sc, ss,
        s_blocks, units_per_split,  # spatial blocks per image; (n, block) units per program
        ACC: tl.constexpr, FINAL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pid_c = tl.program_id(0)
        pid_s = tl.program_id(1)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        coff = cols.to(tl.int64) * sc
        shift = tl.load(x_ptr + coff, mask=cmask, other=0.0).to(ACC)  # x[0, c, 0]
        lanes = tl.arange(0, BLOCK_S)
        s1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        s2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        u0 = pid_s * units_per_split
        for u in range(u0, u0 + units_per_split):  # the last split's extra units are masked out
            n = u // s_blocks
            pos = (u % s_blocks) * BLOCK_S + lanes
            valid = (pos < S) & (u + tl.zeros([BLOCK_S], dtype=tl.int32) < N * s_blocks)
            mask = valid[:, None] & cmask[None, :]
            ptrs = x_ptr + tl.cast(n, tl.int64) * sn + (pos.to(tl.int64) * ss)[:, None] + coff[None, :]
            v = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
            d = tl.where(mask, v - shift[None, :], 0.0)
            s1 += d
            s2 += d * d
        t1 = tl.sum(s1, axis=0)
        t2 = tl.sum(s2, axis=0)
        if FINAL:
            count = tl.zeros([BLOCK_C], dtype=ACC) + N * S
            tl.store(count_ptr + cols, count, mask=cmask)
            tl.store(mean_ptr + cols, shift + t1 / count, mask=cmask)
            tl.store(m2_ptr + cols, tl.maximum(t2 - t1 * (t1 / count), 0.0), mask=cmask)
        else:
            tl.store(part_ptr + pid_s * 2 * C + cols, t1, mask=cmask)
            tl.store(part_ptr + (pid_s * 2 + 1) * C + cols, t2, mask=cmask)

    def _bn_combine_kernel(
        part_ptr,  # partials: (SPLIT, 2, C) ACC
        x_ptr,  # x (STATS only: the shift x[0, c, 0])
        out0_ptr, out1_ptr, out2_ptr,  # STATS: count, mean, m2; else: sum0, sum1 (out2 unused)
        C, SPLIT, sc, total,
        STATS: tl.constexpr, BLOCK_SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # Sums the partials in float64, BLOCK_SPLIT rows at a time (a tree within each chunk): the
        # result does not depend on how many programs the reduction used, to float32 rounding.
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        rows = tl.arange(0, BLOCK_SPLIT)
        t1 = tl.zeros([BLOCK_C], dtype=tl.float64)
        t2 = tl.zeros([BLOCK_C], dtype=tl.float64)
        for i0 in range(0, SPLIT, BLOCK_SPLIT):  # fixed order: the same result on every run
            r = i0 + rows
            mask = (r < SPLIT)[:, None] & cmask[None, :]
            base = part_ptr + (r * 2 * C)[:, None] + cols[None, :]
            t1 += tl.sum(tl.load(base, mask=mask, other=0.0).to(tl.float64), axis=0)
            t2 += tl.sum(tl.load(base + C, mask=mask, other=0.0).to(tl.float64), axis=0)
        if STATS:
            shift = tl.load(x_ptr + cols.to(tl.int64) * sc, mask=cmask, other=0.0).to(tl.float64)
            count = tl.zeros([BLOCK_C], dtype=tl.float64) + total
            tl.store(out0_ptr + cols, count.to(out0_ptr.dtype.element_ty), mask=cmask)
            tl.store(out1_ptr + cols, (shift + t1 / count).to(out1_ptr.dtype.element_ty), mask=cmask)
            m2 = tl.maximum(t2 - t1 * (t1 / count), 0.0)
            tl.store(out2_ptr + cols, m2.to(out2_ptr.dtype.element_ty), mask=cmask)
        else:
            tl.store(out0_ptr + cols, t1.to(out0_ptr.dtype.element_ty), mask=cmask)
            tl.store(out1_ptr + cols, t2.to(out1_ptr.dtype.element_ty), mask=cmask)

    def _bn_elemt_kernel(
        x_ptr,  # x: (N, C, S) strided
        y_ptr,  # y: (N, C, S) strided (x's layout), x's dtype
        mean_ptr, invstd_ptr, w_ptr, b_ptr,  # (C,) contiguous; w/b unused without HAS_W/HAS_B
        N, C, S, sn, sc, ss, yn, yc, ys,
        ACC: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (pos < S)[:, None] & cmask[None, :]
        c64 = cols.to(tl.int64)
        p64 = pos.to(tl.int64)
        mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(ACC)
        scale = tl.load(invstd_ptr + cols, mask=cmask, other=0.0).to(ACC)
        if HAS_W:
            scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
        if HAS_B:
            bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)
        for n in range(tl.program_id(2), N, tl.num_programs(2)):
            n64 = tl.cast(n, tl.int64)
            x = tl.load(x_ptr + n64 * sn + (p64 * ss)[:, None] + (c64 * sc)[None, :], mask=mask, other=0.0)
            y = (x.to(ACC) - mean[None, :]) * scale[None, :]
            if HAS_B:
                y = y + bias[None, :]
            tl.store(y_ptr + n64 * yn + (p64 * ys)[:, None] + (c64 * yc)[None, :], y.to(x.dtype), mask=mask)

    def _bn_backward_reduce_kernel(
        dy_ptr,  # dy: (N, C, S) strided
        x_ptr,  # x: (N, C, S) strided (may differ from dy's layout)
        mean_ptr,  # (C,) contiguous
        part_ptr,  # partials: (SPLIT, 2, C) ACC [sum(dy), sum(dy * (x - mean))] (unused if FINAL)
        sum_dy_ptr, sum_dy_xmu_ptr,  # results: (C,) ACC (written only if FINAL)
        N, C, S, dn, dc, ds, sn, sc, ss,
        s_blocks, units_per_split,
        ACC: tl.constexpr, FINAL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pid_c = tl.program_id(0)
        pid_s = tl.program_id(1)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        c64 = cols.to(tl.int64)
        mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(ACC)
        lanes = tl.arange(0, BLOCK_S)
        acc_dy = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        acc_dy_xmu = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        u0 = pid_s * units_per_split
        for u in range(u0, u0 + units_per_split):  # the last split's extra units are masked out
            n = tl.cast(u // s_blocks, tl.int64)
            pos = (u % s_blocks) * BLOCK_S + lanes.to(tl.int64)
            valid = (pos < S) & (u + tl.zeros([BLOCK_S], dtype=tl.int32) < N * s_blocks)
            mask = valid[:, None] & cmask[None, :]
            dy = tl.load(dy_ptr + n * dn + (pos * ds)[:, None] + (c64 * dc)[None, :], mask=mask, other=0.0)
            x = tl.load(x_ptr + n * sn + (pos * ss)[:, None] + (c64 * sc)[None, :], mask=mask, other=0.0)
            dy = dy.to(ACC)
            acc_dy += dy
            acc_dy_xmu += tl.where(mask, dy * (x.to(ACC) - mean[None, :]), 0.0)
        t1 = tl.sum(acc_dy, axis=0)
        t2 = tl.sum(acc_dy_xmu, axis=0)
        if FINAL:
            tl.store(sum_dy_ptr + cols, t1, mask=cmask)
            tl.store(sum_dy_xmu_ptr + cols, t2, mask=cmask)
        else:
            tl.store(part_ptr + pid_s * 2 * C + cols, t1, mask=cmask)
            tl.store(part_ptr + (pid_s * 2 + 1) * C + cols, t2, mask=cmask)

    def _bn_backward_elemt_kernel(
        dy_ptr,  # dy: (N, C, S) strided
        x_ptr,  # x: (N, C, S) strided
        dx_ptr,  # dx: (N, C, S) strided (x's layout), x's dtype
        mean_ptr, invstd_ptr, w_ptr, sum_dy_ptr, sum_dy_xmu_ptr, count_ptr,  # (C,) contiguous
        N, C, S, dn, dc, ds, sn, sc, ss, on, oc, os,
        ACC: tl.constexpr, HAS_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (pos < S)[:, None] & cmask[None, :]
        c64 = cols.to(tl.int64)
        p64 = pos.to(tl.int64)
        mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(ACC)
        invstd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0).to(ACC)
        count = tl.load(count_ptr + cols, mask=cmask, other=1.0).to(ACC)
        a = tl.load(sum_dy_ptr + cols, mask=cmask, other=0.0).to(ACC) / count
        b = tl.load(sum_dy_xmu_ptr + cols, mask=cmask, other=0.0).to(ACC) * invstd * invstd / count
        c = invstd
        if HAS_W:
            c = c * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
        for n in range(tl.program_id(2), N, tl.num_programs(2)):
            n64 = tl.cast(n, tl.int64)
            dy = tl.load(dy_ptr + n64 * dn + (p64 * ds)[:, None] + (c64 * dc)[None, :], mask=mask, other=0.0)
            x = tl.load(x_ptr + n64 * sn + (p64 * ss)[:, None] + (c64 * sc)[None, :], mask=mask, other=0.0)
            dx = (dy.to(ACC) - a[None, :] - (x.to(ACC) - mean[None, :]) * b[None, :]) * c[None, :]
            tl.store(dx_ptr + n64 * on + (p64 * os)[:, None] + (c64 * oc)[None, :], dx.to(x.dtype), mask=mask)


# ---------------------------------------------------------------------------- launchers


def _ncs(x: Tensor) -> tuple[Tensor, int, int, int, int]:
    """View ``x`` (N, C, *) as (N, C, S) by strides: ``(x', S, sn, sc, ss)``; copies only if the
    spatial dims cannot be collapsed into one stride (e.g. a sliced spatial dim).
    """
    sizes, strides = x.shape[2:], x.stride()[2:]
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    ok = all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))
    if not ok:
        x = x.contiguous()
        return _ncs(x)
    s = 1
    for n in sizes:
        s *= n
    ss = dims[-1][1] if dims else 1
    return x, s, x.stride(0), x.stride(1), ss


def _geometry(*tensors: Tensor) -> tuple[list[Tensor], int, int, int, list[tuple[int, int, int]]]:
    """``(tensors', N, C, S, [(sn, sc, ss) per tensor])`` of same-shape ``(N, C, *)`` tensors, with N
    folded into S when every tensor allows it (``sn == S * ss``, or ``S == 1``)."""
    views = [_ncs(t) for t in tensors]
    n, c, s = tensors[0].shape[0], tensors[0].shape[1], views[0][1]
    strides = [(sn, sc, ss) for _, _, sn, sc, ss in views]
    if n > 1 and all(s == 1 or sn == s * ss for sn, _, ss in strides):
        strides = [(0, sc, sn if s == 1 else ss) for sn, sc, ss in strides]
        n, s = 1, n * s
    return [v[0] for v in views], n, c, s, strides


def _tiles(c: int, s: int, channels_contiguous: bool, tile: int | None = None) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C) of ``tile`` elements (default ``_TILE``): wide in channels when channels are
    contiguous in memory (channels_last, (N, C)), wide in positions otherwise (NCHW), so that a warp's
    loads coalesce."""
    tile = tile or _TILE
    if channels_contiguous:
        block_c = min(next_power_of_2(c), 64)
        return max(tile // block_c, 1), block_c
    block_s = min(next_power_of_2(s), tile)
    return block_s, min(next_power_of_2(c), max(tile // block_s, 1))


def _target_programs(device: torch.device, interpret: bool) -> int:
    if interpret:
        return 4
    return sm_count(device) * _PROGRAMS_PER_SM


def _reduction_split(
    n: int, s: int, c_blocks: int, block_s: int, device: torch.device, interpret: bool
) -> tuple[int, int, int]:
    """``(SPLIT, units_per_split, s_blocks)``: enough programs to fill the device, each with whole units."""
    s_blocks = cdiv(s, block_s)
    units = n * s_blocks
    split = max(1, min(units, _target_programs(device, interpret) // c_blocks))
    per = cdiv(units, split)
    return cdiv(units, per), per, s_blocks


def _launch_opts(interpret: bool, reduction: bool = False) -> dict:
    if interpret:
        return {}
    return {"num_warps": _RED_NUM_WARPS if reduction else _NUM_WARPS}


def batch_norm_stats_triton(x: Tensor, interpret: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Launcher: one reduction kernel; with several splits, a small kernel combines the partials.
    Two launches at most; three separate output tensors (no aliasing)."""
    c = x.shape[1]
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        n = float(x.numel() // c) if c else 0.0
        full = torch.full((c,), n, dtype=dtype, device=x.device)
        return (
            full,
            torch.zeros(c, dtype=dtype, device=x.device),
            torch.zeros(c, dtype=dtype, device=x.device),
        )
    (x,), n, c, s, [(sn, sc, ss)] = _geometry(x)
    block_s, block_c = _tiles(c, s, sc == 1, _RED_TILE)
    c_blocks = cdiv(c, block_c)
    split, per, s_blocks = _reduction_split(n, s, c_blocks, block_s, x.device, interpret)
    # Separate tensors: the outputs of the traced custom op must not alias each other.
    outs = [torch.empty(c, dtype=dtype, device=x.device) for _ in range(3)]
    part = outs[0] if split == 1 else torch.empty(split, 2, c, dtype=dtype, device=x.device)
    acc = tl_dtype(dtype == torch.float64)
    kernel(_bn_stats_kernel, interpret)[(c_blocks, split)](
        x, part, outs[0], outs[1], outs[2], n, c, s, sn, sc, ss, s_blocks, per,
        ACC=acc, FINAL=split == 1, BLOCK_S=block_s, BLOCK_C=block_c, **_launch_opts(interpret, True),
    )  # fmt: skip
    if split > 1:
        block = min(next_power_of_2(c), 64)
        kernel(_bn_combine_kernel, interpret)[(cdiv(c, block),)](
            part, x, outs[0], outs[1], outs[2], c, split, sc, n * s,
            STATS=True, BLOCK_SPLIT=_COMBINE_ROWS, BLOCK_C=block, **_launch_opts(interpret, True),
        )  # fmt: skip
    return outs[0], outs[1], outs[2]


def batch_norm_elemt_triton(
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    interpret: bool = False,
) -> Tensor:
    """Launcher: one elementwise kernel writing ``y`` in ``x``'s memory format."""
    if x.numel() == 0:
        return torch.empty_like(x)
    x, _, _, _, _ = _ncs(x)
    y = torch.empty_like(x)
    (x, y), n, c, s, [(sn, sc, ss), (yn, yc, ys)] = _geometry(x, y)
    block_s, block_c = _tiles(c, s, sc == 1)
    grid = (cdiv(s, block_s), cdiv(c, block_c), min(n, 65535))
    w = weight.contiguous() if weight is not None else mean
    b = bias.contiguous() if bias is not None else mean
    kernel(_bn_elemt_kernel, interpret)[grid](
        x, y, mean.contiguous(), invstd.contiguous(), w, b,
        n, c, s, sn, sc, ss, yn, yc, ys,
        ACC=tl_dtype(x.dtype == torch.float64), HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_S=block_s, BLOCK_C=block_c, **_launch_opts(interpret),
    )  # fmt: skip
    return y


def batch_norm_backward_reduce_triton(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, interpret: bool = False
) -> tuple[Tensor, Tensor]:
    """Launcher: one reduction kernel; with several splits, a small kernel sums the partials."""
    c = x.shape[1]
    dtype = _stat_dtype(x)
    if x.numel() == 0:
        return torch.zeros(c, dtype=dtype, device=x.device), torch.zeros(c, dtype=dtype, device=x.device)
    (dy, x), n, c, s, [(dn, dc, ds), (sn, sc, ss)] = _geometry(dy, x)
    block_s, block_c = _tiles(c, s, sc == 1, _RED_TILE)
    block_s = max(block_s // 2, 1)  # two (BLOCK_S, BLOCK_C) accumulators live in registers
    c_blocks = cdiv(c, block_c)
    split, per, s_blocks = _reduction_split(n, s, c_blocks, block_s, x.device, interpret)
    outs = [torch.empty(c, dtype=dtype, device=x.device) for _ in range(2)]
    part = outs[0] if split == 1 else torch.empty(split, 2, c, dtype=dtype, device=x.device)
    acc = tl_dtype(dtype == torch.float64)
    kernel(_bn_backward_reduce_kernel, interpret)[(c_blocks, split)](
        dy, x, mean.contiguous(), part, outs[0], outs[1], n, c, s, dn, dc, ds, sn, sc, ss, s_blocks, per,
        ACC=acc, FINAL=split == 1, BLOCK_S=block_s, BLOCK_C=block_c, **_launch_opts(interpret, True),
    )  # fmt: skip
    if split > 1:
        block = min(next_power_of_2(c), 64)
        kernel(_bn_combine_kernel, interpret)[(cdiv(c, block),)](
            part, x, outs[0], outs[1], outs[1], c, split, 0, 0,
            STATS=False, BLOCK_SPLIT=_COMBINE_ROWS, BLOCK_C=block, **_launch_opts(interpret, True),
        )  # fmt: skip
    return outs[0], outs[1]


def batch_norm_backward_elemt_triton(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    count: Tensor,
    interpret: bool = False,
) -> Tensor:
    """Launcher: one elementwise kernel reading ``dy`` and ``x``, writing ``dx`` in ``x``'s layout."""
    if x.numel() == 0:
        return torch.empty_like(x)
    x, _, _, _, _ = _ncs(x)
    dx = torch.empty_like(x)
    (dy, x, dx), n, c, s, [(dn, dc, ds), (sn, sc, ss), (on, oc, os)] = _geometry(dy, x, dx)
    block_s, block_c = _tiles(c, s, sc == 1)
    grid = (cdiv(s, block_s), cdiv(c, block_c), min(n, 65535))
    kernel(_bn_backward_elemt_kernel, interpret)[grid](
        dy, x, dx, mean.contiguous(), invstd.contiguous(),
        weight.contiguous() if weight is not None else mean,
        sum_dy.contiguous(), sum_dy_xmu.contiguous(), count.contiguous(),
        n, c, s, dn, dc, ds, sn, sc, ss, on, oc, os,
        ACC=tl_dtype(x.dtype == torch.float64), HAS_W=weight is not None,
        BLOCK_S=block_s, BLOCK_C=block_c, **_launch_opts(interpret),
    )  # fmt: skip
    return dx
