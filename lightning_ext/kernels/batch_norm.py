"""Batch-norm op family: moments for the all_reduce, normalization and the two backward pieces, after
``torch.nn.SyncBatchNorm``'s CUDA building blocks.

Per op: the reference implementation (fused ATen ops; its docstring is the op's contract), the Triton
kernels and their launchers, which own allocation, grid, float32 accumulators and layout (after
Liger-Kernel ``ops/layer_norm.py``), and the op's registration at the end of the module.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, sm_count, tl, triton
from lightning_ext.kernels.backend import define_op

__all__ = ["payload_moments"]  # an op family: its ops are registered below (lightning_ext.kernels.ops)


def _output(x: Tensor) -> Tensor:
    """An empty tensor like ``x`` in the memory format of the elementwise ops' output (ATen's
    ``batch_norm``'s, the ``cpu`` kernels'): channels-last for a 4-d (5-d) ``x`` in channels-last
    (3d) and not contiguous, else contiguous. Their fakes say the same: inductor checks the strides."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    fmt = formats.get(x.dim(), torch.contiguous_format)
    if x.is_contiguous() or not x.is_contiguous(memory_format=fmt):
        fmt = torch.contiguous_format
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of per-channel sums for input ``x``: float64 for float64 input, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _memory_format(x: Tensor) -> torch.memory_format:
    """The memory format ``x`` is dense in (``contiguous_format`` when none is)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


# ---------------------------------------------------------------------------- reference (pure torch)


def _batch_norm_moments_reference(x: Tensor, shift: Tensor) -> Tensor:
    """Per-channel count and sums about ``shift``: the payload of SyncBatchNorm's all_reduce.

    Args:
        x: ``(N, C, *)`` float16/bfloat16/float32/float64, any memory format.
        shift: float32/float64 ``(C,)``; the running mean, identical on every rank.

    Returns:
        float64 ``(2C + 1,)``: ``[n, S1_1..S1_C, S2_1..S2_C]`` with ``n = N * prod(*)``,
        ``S1 = sum(x - shift)`` and ``S2 = sum((x - shift)^2)`` per channel. Summed over ranks, it
        gives the global ``mean = shift + S1 / n`` and ``M2 = S2 - S1^2 / n`` for any split of the
        batch; summing about a shift near the mean keeps ``M2`` free of cancellation (the
        shifted-data algorithm, Chan, Golub & LeVeque 1983). Empty ``x``: all zeros.

    Float32 sums of squares (ATen's, and ``triton``'s) are finite while they stay below float32's
    largest value (about 3e38: a channel spread below about 1e17 at 4096 elements); ``cpu`` redoes
    such a pass in float64, finite for every finite input.

    ATen's fused ``batch_norm_update_stats`` (mean, biased variance), re-expressed about ``shift``;
    low-precision input passes float32 scratch running buffers so that ATen accumulates and returns
    float32 without copying ``x``. On the CPU, ATen's statistics are exact to float32 only for float32
    NCHW input with a spatial size above 1; elsewhere they keep running sums whose error grows with the
    element count: float32 in its channels-last kernel, which also serves ``(N, C)`` input (BatchNorm1d's
    shape; the variance of 2M values at ``1e3 ± 1`` off 15-92x), narrower for float16/bfloat16 (the
    variance off 350x, the mean by 16). So every other CPU input goes through a float32 NCHW copy,
    ``(N, C)`` as ``(1, C, N)``.
    """
    c = x.shape[1]
    payload = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
    n = x.numel() // c if c else 0
    payload[:1].fill_(n)  # a kernel with the count as its argument: no host-to-device copy (CUDA graphs)
    if n == 0:
        return payload
    if x.device.type == "cpu" and x.dtype != torch.float64:  # float32 NCHW with spatial size > 1 (docstring)
        x = x.reshape(n, c).t().unsqueeze(0) if n == x.shape[0] else x  # (N, C), (N, C, 1, ...): (1, C, N)
        x = x.to(torch.float32, memory_format=torch.contiguous_format)  # (no copy when it is that already)
    if x.dtype in (torch.float32, torch.float64):
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    else:
        scratch = torch.empty(2, c, dtype=torch.float32, device=x.device)
        mean, var = torch.batch_norm_update_stats(x, scratch[0], scratch[1], 0.0)
    dev = mean.double() - shift
    payload[1 : c + 1] = dev * n
    payload[c + 1 :] = (var.double() + dev * dev) * n
    return payload


def payload_moments(payload: Tensor, shift: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(count, mean, var)`` from a summed ``batch_norm_moments`` payload, in float64: 0-dim count,
    ``(C,)`` mean and biased variance; an empty group (count 0) gives ``mean = shift``, ``var = 0``.
    The one reading of the payload (``_batch_norm_gather_stats_reference``, ``sync_batch_norm_stats``)."""
    n = payload[0]
    dev, sq = payload[1:].view(2, -1) / n.clamp_min(1.0)  # mean - shift, E[(x - shift)^2]
    var = torch.addcmul(sq, dev, dev, value=-1.0).clamp_min_(0.0)
    return n, dev.add_(shift), var


def _batch_norm_gather_stats_reference(
    payload: Tensor, shift: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    momentum: Tensor, eps: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The group's mean and ``invstd`` from the summed ``batch_norm_moments``; running statistics.

    ``mean = shift + S1 / n``, ``var = S2 / n - (S1 / n)^2`` (biased, clipped at 0),
    ``invstd = 1 / sqrt(var + eps)``; with running statistics given,
    ``running = (1 - momentum) * running + momentum * statistic`` in place, from the unbiased
    variance ``var * n / (n - 1)``: the role of ``torch.batch_norm_gather_stats_with_counts``. A
    group without elements (``n = 0``) gives ``mean = shift``, ``invstd = 1 / sqrt(eps)``.

    Args:
        payload: float64 ``(2C + 1,)``, the moments summed over the group.
        shift: float64 ``(C,)``, the shift the moments are about.
        running_mean, running_var: ``(C,)`` floating buffers to update in place (the caller
            passes them only for a group of at least 2 elements per channel), or both ``None``.
        momentum: 0-dim float64 tensor (on the CPU or the payload's device) in ``[0, 1]``; a tensor
            so that a cumulative average's ``1 / num_batches_tracked`` needs no host read.
        eps: added to the variance, ``> 0``.

    Returns:
        ``(mean, invstd)``: float64 ``(C,)`` each.
    """
    n, mean, var = payload_moments(payload, shift)
    if running_mean is not None:
        running_mean.mul_(1.0 - momentum).add_(mean * momentum)
        running_var.mul_(1.0 - momentum).add_(var * (n / (n - 1.0) * momentum))
    return mean, var.add_(eps).rsqrt_()


def _batch_norm_elemt_reference(
    x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
) -> Tensor:
    """Normalize: ``y = (x - mean) * invstd * weight + bias`` per channel.

    Args:
        x: ``(N, C, *)`` float tensor, any memory format.
        mean, invstd: float32/float64 ``(C,)``; ``invstd = 1 / sqrt(var + eps)``.
        weight, bias: float32/float64 ``(C,)`` or ``None`` (ones / zeros).

    Returns:
        ``y`` of ``x``'s shape, dtype and memory format.

    ATen's fused inference batch norm (one pass, keeps the memory format) with ``running_var = 1``
    and ``eps = 0`` computes exactly ``(x - mean) * (invstd * weight) + bias``.
    """
    if x.numel() == 0:
        return torch.empty_like(x)
    x = x.contiguous(memory_format=_memory_format(x))  # (the output's memory format: _output's)
    dtype = _stat_dtype(x)
    scale = invstd.to(dtype) if weight is None else invstd.to(dtype) * weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    ones = x.new_ones(x.shape[1], dtype=dtype)
    return torch.batch_norm(x, scale, bias, mean.to(dtype), ones, False, 0.0, 0.0, False)


def _batch_norm_backward_reduce_reference(dy: Tensor, x: Tensor, mean: Tensor) -> Tensor:
    """Per-channel ``[sum(dy), sum(dy * (x - mean))]`` of this shard, packed for one all_reduce
    (``grad_bias = sum(dy)``, ``grad_weight = sum(dy * (x - mean)) * invstd``).

    Args:
        dy: gradient of the output, ``x``'s shape, any memory format.
        x: ``(N, C, *)`` float tensor; may be empty.
        mean: float32/float64 ``(C,)``, the mean the forward normalized with.

    Returns:
        ``(2C,)`` in float32 (float64 for float64 ``x``): both sums, concatenated.

    ATen's fused ``native_batch_norm_backward`` asked for ``(grad_weight, grad_bias)`` with
    ``weight = save_invstd = 1`` returns exactly the two sums. Its CPU kernel accumulates in float32
    only when ``dy`` and ``x`` are dense in one layout, so both are made so; ``(N, C)`` input (running
    float32 sums in its channels-last path) goes as ``(1, C, N)``.
    """
    c, dtype = x.shape[1], _stat_dtype(x)
    if x.numel() == 0:
        return torch.zeros(2 * c, dtype=dtype, device=x.device)
    ones = x.new_ones(c, dtype=dtype)
    if x.device.type == "cpu" and x.numel() == x.shape[0] * c:  # (N, C), (N, C, 1, ...): as (1, C, N)
        x, dy = (t.reshape(-1, c).t().unsqueeze(0) for t in (x, dy))  # (ATen's channels-last path there)
    fmt = _memory_format(x)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, ones, None, None, mean.to(dtype), ones, True, 0.0, [False, True, True]
    )
    return torch.cat([sum_dy, sum_dy_xmu]).to(dtype)


def _batch_norm_backward_elemt_reference(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, sums: Tensor, count: Tensor
) -> Tensor:
    """Input gradient of training-mode batch norm from the group's sums:
    ``dx = (dy - G1 / n - (x - mean) * invstd^2 * G2 / n) * invstd * weight`` (Ioffe & Szegedy 2015).

    Args:
        dy: gradient of the output, ``x``'s shape, any memory format.
        x: ``(N, C, *)`` float tensor.
        mean, invstd: float32/float64 ``(C,)``, the statistics of the forward.
        weight: float32/float64 ``(C,)`` or ``None`` (ones).
        sums: ``(G1, G2)``, ``batch_norm_backward_reduce`` summed over the group, ``(2C,)`` float.
        count: ``n``, 0-dim float tensor on ``x``'s device: the GLOBAL number of elements per channel.

    Returns:
        ``dx`` of ``x``'s shape, dtype and memory format.

    Two fused ATen passes: an inference batch norm gives ``u = (x - mean) * (-b s) - a s`` in ``x``'s
    memory format (``a = G1 / n``, ``b = invstd^2 G2 / n``, ``s = invstd w``), then ``u += dy * s``
    in place. Low-precision input is computed in float32 (``u`` and ``dy * s`` can nearly cancel).
    """
    if x.numel() == 0:
        return torch.empty_like(x)
    x = x.contiguous(memory_format=_memory_format(x))  # (the output's memory format: _output's)
    c, dtype = x.shape[1], _stat_dtype(x)
    invstd = invstd.to(dtype)
    s = invstd if weight is None else invstd * weight.to(dtype)
    sums, count = sums.to(dtype), count.to(dtype)
    a = sums[:c] / count
    b = invstd * invstd * sums[c:] / count
    ones = x.new_ones(c, dtype=dtype)
    u = torch.batch_norm(x.to(dtype), -b * s, -a * s, mean.to(dtype), ones, False, 0.0, 0.0, False)
    u.addcmul_(dy, s.view(-1, *([1] * (x.dim() - 2))))
    return u.to(x.dtype)


# ---------------------------------------------------------------------------- Triton kernels
# Every tensor is addressed as (N, C, S) through strides (sn, sc, ss): contiguous NCHW has
# (C*S, S, 1), channels_last(_3d) (S*C, 1, C), (N, C) input S = 1; N is folded into S when every
# tensor of a call allows it. A tile is BLOCK_S positions x BLOCK_C channels, masked at both edges.
# Reductions split the (n, spatial block) units of each channel block over SPLIT programs with
# per-lane float32 (float64 for float64 input) accumulators, write (SPLIT, 2, C) partials, and a
# small kernel sums them in float64 in a fixed order (deterministic). Moments: each program sums about
# the mean of its first tile (a value of the data's bulk, whatever one element is) and writes it with
# its count, (SPLIT, 4, C) float64; the combine moves each partial to the caller's shift in float64.

_TILE, _NUM_WARPS = 2048, 4  # elementwise: elements per tile, warps
_RED_TILE, _RED_NUM_WARPS = 4096, 8  # reductions
_PROGRAMS_PER_SM = 4  # reductions: programs per multiprocessor to aim for
_COMBINE_ROWS = 128  # partials summed per step of the combine kernel
if HAS_TRITON:

    @triton.jit
    def _bn_sums_kernel(
        u_ptr,  # u: (N, C, S) strided: x (MOMENTS) or dy
        v_ptr,  # v: (N, C, S) strided: x (unused for MOMENTS)
        mean_ptr,  # (C,) float: the mean (unused for MOMENTS)
        part_ptr,  # partials: (SPLIT, 2, C) ACC; MOMENTS (SPLIT, 4, C) float64 [S1, S2, center, count]
        N, C, S, un, uc, us, vn, vc, vs,
        s_blocks, units_per_split,  # spatial blocks per image; (n, block) units per program
        ACC: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # MOMENTS: [sum(x - f), sum((x - f)^2), f, count], f the mean of the program's first tile (0 when
        # not finite); else [sum(dy), sum(dy * (x - mean))].
        pid_s = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        c64 = cols.to(tl.int64)
        lanes = tl.arange(0, BLOCK_S)
        u0 = pid_s * units_per_split
        if MOMENTS:
            n = tl.cast(u0 // s_blocks, tl.int64)
            pos = (u0 % s_blocks) * BLOCK_S + lanes.to(tl.int64)
            valid = (pos < S) & (u0 + tl.zeros([BLOCK_S], dtype=tl.int32) < N * s_blocks)
            mask = valid[:, None] & cmask[None, :]
            g = tl.load(u_ptr + n * un + (pos * us)[:, None] + (c64 * uc)[None, :], mask=mask, other=0.0)
            center = tl.sum(g.to(ACC), axis=0) / tl.maximum(tl.sum(valid.to(ACC), axis=0), 1.0)
            center = tl.where(tl.abs(center) < float("inf"), center, 0.0)  # (NaN too: no inf - inf)
            count = tl.zeros([BLOCK_C], dtype=tl.float64)
        else:
            center = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(ACC)
        a1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        a2 = tl.zeros([BLOCK_S, BLOCK_C], dtype=ACC)
        for u in range(u0, u0 + units_per_split):  # the last split's extra units are masked out
            n = tl.cast(u // s_blocks, tl.int64)
            pos = (u % s_blocks) * BLOCK_S + lanes.to(tl.int64)
            valid = (pos < S) & (u + tl.zeros([BLOCK_S], dtype=tl.int32) < N * s_blocks)
            mask = valid[:, None] & cmask[None, :]
            g = tl.load(u_ptr + n * un + (pos * us)[:, None] + (c64 * uc)[None, :], mask=mask, other=0.0)
            g = g.to(ACC)
            if MOMENTS:
                d = tl.where(mask, g - center[None, :], 0.0)
                a1 += d
                a2 += d * d
                count += tl.sum(valid.to(tl.float64), axis=0)
            else:
                x = tl.load(v_ptr + n * vn + (pos * vs)[:, None] + (c64 * vc)[None, :], mask=mask, other=0.0)
                a1 += g
                a2 += tl.where(mask, g * (x.to(ACC) - center[None, :]), 0.0)
        rows = 4 if MOMENTS else 2
        tl.store(part_ptr + pid_s * rows * C + cols, tl.sum(a1, axis=0), mask=cmask)
        tl.store(part_ptr + (pid_s * rows + 1) * C + cols, tl.sum(a2, axis=0), mask=cmask)
        if MOMENTS:
            tl.store(part_ptr + (pid_s * rows + 2) * C + cols, center, mask=cmask)
            tl.store(part_ptr + (pid_s * rows + 3) * C + cols, count, mask=cmask)

    @triton.jit
    def _bn_combine_kernel(
        part_ptr,  # partials: (SPLIT, 2, C) ACC; MOMENTS (SPLIT, 4, C) float64 [S1, S2, center, count]
        shift_ptr,  # (C,) float (MOMENTS only): the caller's shift
        out_ptr,  # MOMENTS: (2C + 1,) float64 [n, S1, S2]; else (2C,) [sum(dy), sum(dy (x - mean))]
        C, SPLIT,
        MOMENTS: tl.constexpr, BLOCK_SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        rows = tl.arange(0, BLOCK_SPLIT)
        width = 4 if MOMENTS else 2
        t1 = tl.zeros([BLOCK_C], dtype=tl.float64)
        t2 = tl.zeros([BLOCK_C], dtype=tl.float64)
        if MOMENTS:
            c = tl.load(shift_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
        for i0 in range(0, SPLIT, BLOCK_SPLIT):  # fixed order: the same result on every run
            r = i0 + rows
            mask = (r < SPLIT)[:, None] & cmask[None, :]
            base = part_ptr + (r * width * C)[:, None] + cols[None, :]
            s1 = tl.load(base, mask=mask, other=0.0).to(tl.float64)
            s2 = tl.load(base + C, mask=mask, other=0.0).to(tl.float64)
            if MOMENTS:  # each partial from its center f to the shift c: S1 + n d, S2 + 2 d S1 + n d^2
                d = tl.load(base + 2 * C, mask=mask, other=0.0) - c[None, :]
                n = tl.load(base + 3 * C, mask=mask, other=0.0)
                s1, s2 = s1 + n * d, s2 + 2.0 * d * s1 + n * d * d
            t1 += tl.sum(s1, axis=0)
            t2 += tl.sum(s2, axis=0)
        first = 1 if MOMENTS else 0  # (MOMENTS: out[0] = n is written by the launcher)
        tl.store(out_ptr + first + cols, t1.to(out_ptr.dtype.element_ty), mask=cmask)
        tl.store(out_ptr + first + C + cols, t2.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _bn_affine_kernel(
        u_ptr,  # u: (N, C, S) strided: x (elemt) or dy (backward)
        v_ptr,  # v: (N, C, S) strided: x (backward only)
        o_ptr,  # out: (N, C, S) strided (x's layout), x's dtype
        mean_ptr, invstd_ptr, w_ptr, b_ptr, sums_ptr, count_ptr,  # (C,) float; sums (2C,); count ()
        N, C, S, un, uc, us, vn, vc, vs, on, oc, os,
        ACC: tl.constexpr, BACKWARD: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # elemt: y = (x - mean) * invstd * w + b; backward: dx = (dy - a - (x - mean) * b2) * invstd * w.
        pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = (pos < S)[:, None] & cmask[None, :]
        c64 = cols.to(tl.int64)
        p64 = pos.to(tl.int64)
        mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0).to(ACC)
        invstd = tl.load(invstd_ptr + cols, mask=cmask, other=0.0).to(ACC)
        scale = invstd
        if HAS_W:
            scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)
        if BACKWARD:
            count = tl.load(count_ptr).to(ACC)
            a = tl.load(sums_ptr + cols, mask=cmask, other=0.0).to(ACC) / count
            b2 = tl.load(sums_ptr + C + cols, mask=cmask, other=0.0).to(ACC) * invstd * invstd / count
        elif HAS_B:
            bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ACC)
        for n in range(tl.program_id(2), N, tl.num_programs(2)):
            n64 = tl.cast(n, tl.int64)
            u = tl.load(u_ptr + n64 * un + (p64 * us)[:, None] + (c64 * uc)[None, :], mask=mask, other=0.0)
            if BACKWARD:
                x = tl.load(
                    v_ptr + n64 * vn + (p64 * vs)[:, None] + (c64 * vc)[None, :], mask=mask, other=0.0
                )
                out = (u.to(ACC) - a[None, :] - (x.to(ACC) - mean[None, :]) * b2[None, :]) * scale[None, :]
            else:
                out = (u.to(ACC) - mean[None, :]) * scale[None, :]
                if HAS_B:
                    out = out + bias[None, :]
            o_ptrs = o_ptr + n64 * on + (p64 * os)[:, None] + (c64 * oc)[None, :]
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- launchers


def _ncs(x: Tensor) -> tuple[Tensor, int, int, int, int]:
    """View ``x`` (N, C, *) as (N, C, S) by strides: ``(x', S, sn, sc, ss)``; copies only if the
    spatial dims cannot be collapsed into one stride (e.g. a sliced spatial dim)."""
    sizes, strides = x.shape[2:], x.stride()[2:]
    dims = [(n, st) for n, st in zip(sizes, strides) if n != 1]
    if not all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1)):
        return _ncs(x.contiguous())
    return x, sizes.numel(), x.stride(0), x.stride(1), dims[-1][1] if dims else 1


def _geometry(*tensors: Tensor) -> tuple[list[Tensor], int, int, int, list[int]]:
    """``(tensors', N, C, S, [sn, sc, ss of each tensor])`` of same-shape ``(N, C, *)`` tensors, with
    N folded into S when every tensor allows it (``sn == S * ss``, or ``S == 1``)."""
    views = [_ncs(t) for t in tensors]
    n, c, s = tensors[0].shape[0], tensors[0].shape[1], views[0][1]
    strides = [(sn, sc, ss) for _, _, sn, sc, ss in views]
    if n > 1 and all(s == 1 or sn == s * ss for sn, _, ss in strides):
        strides = [(0, sc, sn if s == 1 else ss) for sn, sc, ss in strides]
        n, s = 1, n * s
    return [v[0] for v in views], n, c, s, [st for triple in strides for st in triple]


def _tiles(c: int, s: int, channels_contiguous: bool, tile: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_C) of ``tile`` elements: wide in channels when channels are contiguous in
    memory (channels_last, (N, C)), wide in positions otherwise (NCHW), so a warp's loads coalesce."""
    if channels_contiguous:
        block_c = min(triton.next_power_of_2(c), 64)
        return max(tile // block_c, 1), block_c
    block_s = min(triton.next_power_of_2(s), tile)
    return block_s, min(triton.next_power_of_2(c), max(tile // block_s, 1))


def _opts(x: Tensor, reduction: bool) -> dict:
    """Launch options; none in Triton's interpreter (CPU tensors)."""
    return {} if x.is_cpu else {"num_warps": _RED_NUM_WARPS if reduction else _NUM_WARPS}


def _acc(x: Tensor) -> object:
    """The Triton accumulator dtype: float64 for float64 input, float32 otherwise."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _channel_sums(u: Tensor, v: Tensor, mean: Tensor, out: Tensor, shift: Tensor | None) -> Tensor:
    """Launch the sums kernel and the combine kernel (MOMENTS when ``shift`` is given) into ``out``."""
    moments = shift is not None
    (u, v), n, c, s, strides = _geometry(u, v)
    block_s, block_c = _tiles(c, s, strides[1] == 1, _RED_TILE)
    if not moments:
        block_s = max(block_s // 2, 1)  # the backward loads two tensors per element
    c_blocks, s_blocks = triton.cdiv(c, block_c), triton.cdiv(s, block_s)
    units = n * s_blocks
    target = 4 if u.is_cpu else sm_count(u.device) * _PROGRAMS_PER_SM
    per = triton.cdiv(units, max(1, min(units, target // c_blocks)))
    split = triton.cdiv(units, per)
    part = torch.empty(split, 4 if moments else 2, c, dtype=torch.float64 if moments else _stat_dtype(u),
                       device=u.device)  # fmt: skip
    _bn_sums_kernel[(c_blocks, split)](
        u, v, mean, part, n, c, s, *strides, s_blocks, per,
        ACC=_acc(u), MOMENTS=moments, BLOCK_S=block_s, BLOCK_C=block_c, **_opts(u, True),
    )  # fmt: skip
    block = min(triton.next_power_of_2(c), 64)
    _bn_combine_kernel[(triton.cdiv(c, block),)](
        part, shift if moments else mean, out, c, split,
        MOMENTS=moments, BLOCK_SPLIT=_COMBINE_ROWS, BLOCK_C=block, **_opts(u, True),
    )  # fmt: skip
    return out


def _batch_norm_moments_triton(x: Tensor, shift: Tensor) -> Tensor:
    """Per-block sums about the mean of each program's first tile, then a float64 combine into the
    payload."""
    c = x.shape[1]
    out = torch.zeros(2 * c + 1, dtype=torch.float64, device=x.device)
    if x.numel() == 0:
        return out
    out[:1].fill_(x.numel() // c)  # no host-to-device copy: capturable in a CUDA graph
    return _channel_sums(x, x, shift, out, shift)


def _batch_norm_backward_reduce_triton(dy: Tensor, x: Tensor, mean: Tensor) -> Tensor:
    """Per-block sums of ``dy`` and ``dy * (x - mean)``, combined in float64."""
    out = torch.zeros(2 * x.shape[1], dtype=_stat_dtype(x), device=x.device)
    return _channel_sums(dy, x, mean, out, None) if x.numel() else out


def _affine(
    u: Tensor, v: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None = None,
    sums: Tensor | None = None, count: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Launch the elementwise kernel: ``out`` in ``v``'s (``x``'s) memory format from ``u`` and ``v``;
    the backward when ``sums`` and ``count`` are given."""
    out = _output(v)
    if v.numel() == 0:
        return out
    (u, v, out), n, c, s, strides = _geometry(u, v, out)
    block_s, block_c = _tiles(c, s, strides[1] == 1, _TILE)
    grid = (triton.cdiv(s, block_s), triton.cdiv(c, block_c), min(n, 65535))
    vectors = [mean if t is None else t.contiguous() for t in (mean, invstd, weight, bias, sums, count)]
    _bn_affine_kernel[grid](
        u, v, out, *vectors, n, c, s, *strides,
        ACC=_acc(out), BACKWARD=sums is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_S=block_s, BLOCK_C=block_c, **_opts(out, False),
    )  # fmt: skip
    return out


def _batch_norm_elemt_triton(
    x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
) -> Tensor:
    """One elementwise kernel writing ``y`` in ``x``'s memory format."""
    return _affine(x, x, mean, invstd, weight, bias)


def _batch_norm_backward_elemt_triton(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, sums: Tensor, count: Tensor
) -> Tensor:
    """One elementwise kernel reading ``dy`` and ``x``, writing ``dx`` in ``x``'s memory format."""
    return _affine(dy, x, mean, invstd, weight, None, sums, count)


# ---------------------------------------------------------------------------- argument check


def _check_moments(x: Tensor, shift: Tensor) -> None:
    """The arguments of ``batch_norm_moments``, the op a user reaches with tensors of their own
    (:func:`~lightning_ext.nn.sync_batch_norm_stats`); the other ops take the module's own."""
    if not isinstance(x, Tensor):
        raise TypeError(f"`x` must be a torch.Tensor of shape (N, C, *), got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"`x` must have shape (N, C, *) with at least 2 dims, got {tuple(x.shape)!r}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"`x` must be float16, bfloat16, float32 or float64, got dtype {x.dtype!r}")
    c = x.shape[1]
    if not isinstance(shift, Tensor) or shift.dtype not in (torch.float32, torch.float64):
        got = shift.dtype if isinstance(shift, Tensor) else type(shift).__name__
        raise TypeError(f"`shift` must be a float32/float64 tensor of shape ({c},), got {got!r}")
    if tuple(shift.shape) != (c,) or shift.device != x.device:
        raise ValueError(
            f"`shift` must have shape ({c},) on {x.device}, got {tuple(shift.shape)!r} on {shift.device}"
        )


# ---------------------------------------------------------------------------- the ops

batch_norm_moments = define_op(
    "batch_norm_moments(Tensor x, Tensor shift) -> Tensor",
    _batch_norm_moments_reference,
    fake=lambda x, shift: x.new_empty((2 * x.shape[1] + 1,), dtype=torch.float64),
    check=_check_moments,
    triton=_batch_norm_moments_triton,
)
batch_norm_gather_stats = define_op(
    "batch_norm_gather_stats(Tensor payload, Tensor shift, Tensor(a2!)? running_mean, "
    "Tensor(a3!)? running_var, Tensor momentum, float eps) -> (Tensor, Tensor)",
    _batch_norm_gather_stats_reference,
    fake=lambda payload, shift, *_: (torch.empty_like(shift), torch.empty_like(shift)),
    clone=True,
)
batch_norm_elemt = define_op(
    "batch_norm_elemt(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) -> Tensor",
    _batch_norm_elemt_reference,
    fake=lambda x, *_: _output(x),
    triton=_batch_norm_elemt_triton,
)
batch_norm_backward_reduce = define_op(
    "batch_norm_backward_reduce(Tensor dy, Tensor x, Tensor mean) -> Tensor",
    _batch_norm_backward_reduce_reference,
    fake=lambda dy, x, mean: x.new_empty((2 * x.shape[1],), dtype=_stat_dtype(x)),
    triton=_batch_norm_backward_reduce_triton,
)
batch_norm_backward_elemt = define_op(
    "batch_norm_backward_elemt(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, "
    "Tensor sums, Tensor count) -> Tensor",
    _batch_norm_backward_elemt_reference,
    fake=lambda dy, x, *_: _output(x),
    triton=_batch_norm_backward_elemt_triton,
)
