"""The ``accumulate_histogram_`` op (contract: its reference implementation below): counts of values
in the buckets of a signed histogram whose bucket edges are given.

With ``edges`` the ``m + 1`` increasing positive upper edges ``e_0 < e_1 < ... < e_m``, the histogram has
``B = 2m + 3`` float64 counts, ordered by value::

    [0]             v < -e_m: the negative overflow
    [1 .. m]        -e_j <= v < -e_(j-1) for j = m .. 1
    [m + 1]         |v| <= e_0 (zeros included): the zero bucket
    [m + 2 .. 2m+1] e_(j-1) < v <= e_j for j = 1 .. m
    [2m + 2]        v > e_m: the positive overflow

i.e. position ``m + 1 ± j`` (the sign of ``v``) for ``j`` the number of edges below ``|v|``
(``torch.bucketize(|v|, edges)``). Only finite values are counted (NaN and ``±inf`` are not).
Geometric edges ``e_j = e_0 gamma^j`` make it
DDSketch's logarithmic mapping (Masson, Rim & Lee, "DDSketch: A Fast and Fully-Mergeable Quantile Sketch
with Relative-Error Guarantees", VLDB 2019); :class:`lightning_ext.stats.Collector` builds them.
Every implementation compares the float64 value with the float64 edges, so all agree exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, grid_stride, tl, triton
from lightning_ext.kernels.backend import define_op

__all__: list[str] = []  # an op family: its op is registered below (lightning_ext.kernels.ops)


# ---------------------------------------------------------------------------- reference (pure torch)


def _accumulate_histogram_reference(hist: Tensor, x: Tensor, edges: Tensor) -> None:
    """Count the values of ``x`` into the buckets of a signed histogram with the given edges, in place.

    Args:
        hist: float64 ``(2m + 3,)`` on ``x``'s device, contiguous, updated in place (the layout above).
        x: real tensor of any shape and dtype (bool and complex excluded); empty adds nothing. NaN and
            ``±inf`` are not counted.
        edges: float64 ``(m + 1,)`` on ``x``'s device, contiguous, positive, finite, strictly
            increasing (not checked: that would synchronize host and device).

    ``bucketize`` (a binary search) of the float64 magnitudes, ``bincount`` of the positions.

    Example::

        >>> from lightning_ext.kernels import get_backend
        >>> hist = torch.zeros(7, dtype=torch.float64)
        >>> edges = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
        >>> x = torch.tensor([-5.0, 0.0, 1.0, 1.5, 3.0, float("nan"), float("inf")])
        >>> get_backend("reference").run("accumulate_histogram_", hist, x, edges)
        >>> hist.tolist()
        [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    """
    v = x.reshape(-1).to(torch.float64)
    v = v[v.isfinite()]
    j = torch.bucketize(v.abs(), edges)
    positions = torch.where(v < 0, -j, j).add_(edges.numel())
    hist.add_(torch.bincount(positions, minlength=hist.numel()).to(torch.float64))


# ---------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    @triton.jit
    def _histogram_kernel(
        x_ptr,  # x: (numel,) contiguous, any real dtype
        hist_ptr,  # hist: (2m + 3,) fp64 counts, updated in place
        edges_ptr,  # edges: (m + 1,) fp64, increasing
        numel,
        n_blocks,  # cdiv(numel, BLOCK)
        m,
        STEPS: tl.constexpr,  # binary search steps: 2^STEPS > m + 1
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK)
        for b in range(pid, n_blocks, nprog):
            offs = tl.cast(b, tl.int64) * BLOCK + lanes
            mask = offs < numel
            v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float64)
            a = tl.abs(v)
            lo = tl.zeros([BLOCK], dtype=tl.int32)  # the number of edges below a, searched in [lo, hi]
            hi = tl.zeros([BLOCK], dtype=tl.int32) + (m + 1)
            for _ in tl.static_range(STEPS):
                mid = (lo + hi) // 2
                e = tl.load(edges_ptr + tl.minimum(mid, m), mask=mask, other=0.0)
                below = (mid <= m) & (e < a) & (lo < hi)
                lo = tl.where(below, mid + 1, lo)
                hi = tl.where(below | (lo >= hi), hi, mid)
            pos = tl.where(v < 0, -lo, lo) + (m + 1)
            valid = mask & (a < float("inf"))  # NaN and +-inf are not counted
            tl.atomic_add(hist_ptr + pos, tl.where(valid, 1.0, 0.0).to(tl.float64), mask=valid)


def _accumulate_histogram_triton(hist: Tensor, x: Tensor, edges: Tensor) -> None:
    """ONE launch of at most 4 programs per multiprocessor: a binary search over the edges and a
    float64 atomic add per value."""
    if not x.numel():
        return
    x, block, blocks, programs = grid_stride(x)
    m = edges.numel() - 1
    steps = (m + 2).bit_length()
    _histogram_kernel[(programs,)](x, hist, edges, x.numel(), blocks, m, STEPS=steps, BLOCK=block)


accumulate_histogram_ = define_op(
    "accumulate_histogram_(Tensor(a0!) hist, Tensor x, Tensor edges) -> ()",
    _accumulate_histogram_reference,
    fake=lambda *_: None,
    triton=_accumulate_histogram_triton,
)
