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


def _positions(j: Tensor, sign: Tensor, m: int, level: Tensor) -> Tensor:
    """Positions at collapse level ``level`` of magnitude indices ``j`` (edges below ``|v|``, ``m + 1``
    for an overflow) of sign ``sign``, broadcasting: ``G + 1 + sign g``, ``G = ceil(m / 2^c)`` groups per
    sign, ``g = ceil(j / 2^c)`` (``G + 1`` for an overflow)."""
    step = 1 << level
    groups = (m + step - 1) // step
    return groups + 1 + sign * torch.where(j > m, groups + 1, (j + step - 1) // step)


def _pack_windows_reference(
    words: Tensor, hist: Tensor, layout: Tensor, rows: Tensor, shifts: Tensor, extremes: Tensor, at: Tensor,
    edges: Tensor, bits: int, max_words: int,
) -> None:  # fmt: skip
    """A flush's sketch windows: per sketch row, the buckets between its min and max over all ranks at
    the smallest collapse level where they fit in ``max_words`` words, their counts packed, in place.

    Row ``i`` of ``N`` is a name's values (``i < Q``: its counts ``hist[i]``, read and zeroed) or this
    rank's mean of a name (``i >= Q``: one count, where ``rows`` has values), the name ``at[i]``. Its
    window runs from the position of ``lo`` to that of ``hi`` (``[-min, max]`` of the values or
    ``[-mean, mean]`` of the rank means in ``extremes``; none where ``lo > hi``) at the level ``c`` of
    UDDSketch's uniform collapse (group ``g`` of a sign holds the buckets ``(g - 1) 2^c + 1 .. g 2^c``
    of :func:`_accumulate_histogram_reference`'s layout) where it holds at most ``max_words k`` buckets,
    ``k = 53 // bits``. Every row gets ``W`` words, the least power of two (at most ``max_words``) that
    holds the widest window; field ``f`` (bits ``f bits .. (f + 1) bits - 1``) of word ``w`` holds the
    count of the window's bucket ``w k + f``: a sum over ranks of packed words is the packed sum while
    the counts' sum stays below ``2^bits``. Sources: Masson, Rim & Lee (DDSketch, VLDB 2019); Epicoco et
    al., "UDDSketch" (IEEE Access 2020). Synchronizes host and device (``W``).

    Args:
        words: float64 ``(>= N W,)``, its first ``N W`` written (row-major ``(N, W)``).
        hist: float64 ``(Q, 2m + 3)`` contiguous level-0 counts, of values between the row's own min
            and max in ``rows`` (so also in ``[lo, hi]``); zeroed (the compiled kernel reads and zeroes
            the buckets between those two, where the counts are).
        layout: int64 ``(3N + 2,)`` contiguous, written: each row's level, first position and bits a
            count (``bits``; 0 where no rank had values), then ``W`` and the number of rows with values.
        rows, shifts: float64 ``(R, 6)`` accumulator rows, ``(R,)`` shifts (this rank's means).
        extremes: float64 ``(5R,)``, a reduced flush MAX after its head (``moments_payload_``).
        at: int64 ``(N,)``, each row's name.
        edges: float64 ``(m + 1,)``, the histogram's edges.
        bits: bits per count, 1 to 53.
        max_words: words per row at most, ``max_words k >= 5`` (every window then fits at some level).
    """
    q, n, r, m = hist.shape[0], at.numel(), rows.shape[0], edges.numel() - 1
    k, ranks = 53 // bits, torch.arange(n, device=at.device) >= q
    hi, lo = extremes[at + 2 * r * ranks], -extremes[at + 2 * r * ranks + r]
    has = lo <= hi
    lo, hi = (torch.where(has, v, 0.0)[:, None] for v in (lo, hi))
    levels = torch.arange(max(1, m.bit_length() + 1), device=at.device)  # the last: one group a sign
    first, last = (
        _positions(torch.searchsorted(edges, v.abs()), v.sign().long(), m, levels) for v in (lo, hi)
    )
    level = torch.where(has, torch.argmax((last - first < max_words * k).long(), 1), 0)
    start = torch.where(has, first.gather(1, level[:, None])[:, 0], 0)
    width = torch.where(has, last.gather(1, level[:, None])[:, 0] - start + 1, 0)
    w = min(max_words, 1 << (-(-int(width.max()) // k) - 1).bit_length()) if n and has.any() else 1
    counts = torch.zeros(n, w * k, dtype=torch.float64, device=hist.device)
    b = torch.arange(2 * m + 3, device=hist.device) - (m + 1)  # signed magnitude index of each bucket
    slot = _positions(b.abs(), b.sign(), m, level[:q, None]) - start[:q, None]
    counts[:q].scatter_add_(1, slot.clamp(0, w * k - 1), hist)
    hist.zero_()
    n_r, s1 = rows[at[q:], 0], rows[at[q:], 1]  # this rank's means (counts: 0 or >= 1)
    mean = (shifts[at[q:]].nan_to_num(0.0, 0.0, 0.0) + s1 / n_r.clamp_min(1.0))[:, None]
    slot = _positions(torch.searchsorted(edges, mean.abs()), mean.sign().long(), m, level[q:, None])
    one = ((n_r > 0) & (width[q:] > 0)).double()[:, None]
    counts[q:].scatter_(1, (slot - start[q:, None]).clamp(0, w * k - 1), one)
    fields = 2.0 ** (bits * torch.arange(k, device=hist.device, dtype=torch.float64))
    words[: n * w] = (counts.view(n, w, k) * fields).sum(2).reshape(-1)
    layout[: 3 * n] = torch.cat([level, start, torch.where(has, bits, 0)])
    layout[3 * n :] = torch.stack([torch.tensor(w, device=at.device), has.sum()])


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


pack_windows_ = define_op(
    "pack_windows_(Tensor(a0!) words, Tensor(a1!) hist, Tensor(a2!) layout, Tensor rows, Tensor shifts, "
    "Tensor extremes, Tensor at, Tensor edges, int bits, int max_words) -> ()",
    _pack_windows_reference,
    fake=lambda *_: None,
)
accumulate_histogram_ = define_op(
    "accumulate_histogram_(Tensor(a0!) hist, Tensor x, Tensor edges) -> ()",
    _accumulate_histogram_reference,
    fake=lambda *_: None,
    triton=_accumulate_histogram_triton,
)
