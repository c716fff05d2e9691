"""Statistics op family: ``accumulate_moments_`` (reference and a Triton kernel) and the flush's
``moments_payload_`` and ``moments_finish_`` (reference only: a few vector ops over the names; ``cpu``
compiles them). The moment maths of the flush lives here; :mod:`lightning_ext.stats.moments`
re-exports it.

Sources: shifted sums (Welford 1962; Chan, Golub & LeVeque, "Algorithms for computing the sample
variance", 1983, section 3) and the parallel merge (Chan, Golub & LeVeque 1979).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, grid_stride, tl, triton
from lightning_ext.kernels.backend import define_op

__all__ = ["moments_from_shifted"]  # an op family: its ops are registered below (lightning_ext.kernels.ops)

_UNPUBLISHED = (0.0, math.nan, math.nan, math.nan, math.nan)  # a published row without values

# ---------------------------------------------------------------------------- reference (pure torch)


def _accumulate_moments_reference(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """Add the count, shifted sums and extremes of ``x`` into ``acc``, in place, totals in float64.

    ``acc += [numel, sum(x - shift), sum((x - shift)^2)]``, ``acc[3] = min(acc[3], min(x))``,
    ``acc[4] = max(acc[4], max(x))``; start from ``[0, 0, 0, +inf, -inf]``. A shift near the data
    (its first value) keeps the variance ``(S2 - S1^2 / n) / n`` accurate (shifted-data algorithm,
    Chan, Golub & LeVeque 1983). Element arithmetic is float64, except that for
    float16/bfloat16/float32 input a backend may form ``x - shift`` and its square in float32 and
    sum them in runs of at most 32 terms before float64 takes them, where no square overflows or
    underflows (``cpu``: relative error at most ``34 * 2**-24`` of the summed magnitudes; float64
    elsewhere, so every finite input gives finite sums). NaN in ``x`` makes the sums and extremes NaN.

    Args:
        acc: float64 ``(5,)`` on ``x``'s device, updated in place.
        x: real tensor of any shape and dtype (bool and complex excluded); empty adds nothing.
        shift: float64 0-dim tensor on ``x``'s device.

    Reference: a float64 copy, shifted sum and dot product (BLAS), ``aminmax`` (it propagates NaN).
    """
    if not x.numel():
        return
    # Out of place: for float64 ``x``, ``.to(float64)`` aliases ``x`` and ``sub_`` would modify it.
    xd = x.reshape(-1).to(torch.float64) - shift
    mn, mx = torch.aminmax(x.reshape(-1))
    acc[0].add_(x.numel())
    acc[1:3].add_(torch.stack((xd.sum(), torch.dot(xd, xd))))
    torch.minimum(acc[3], mn.to(torch.float64), out=acc[3])
    torch.maximum(acc[4], mx.to(torch.float64), out=acc[4])


# ---------------------------------------------------------------------------- the flush (reference)
# Moment rows ``[count, mean, m2, min, max]`` (m2: sum of squared deviations from the mean) and the two
# payloads of a flush; the references of moments_payload_ and moments_finish_ below state the contracts.


def moments_from_shifted(acc: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Convert shifted sums to moment rows (a shift taken from the data keeps the sums small when
    ``|mean| ≫ std``).

    Args:
        acc: float64 ``(..., 5)``: ``[count, Σ(x-shift), Σ(x-shift)², min, max]``.
        shift: float64 ``(...)``: the shift each row was accumulated around.

    Returns:
        float64 ``(..., 5)`` moment rows; rows with count 0 are empty.
    """
    n, s1, s2, lo, hi = acc.unbind(-1)  # the same maths as one rank's row with no within-rank m2
    return _moments_from_allreduce(torch.stack([n, torch.zeros_like(n), s1, s2], -1), shift, lo, hi)


def _shifted_for_allreduce(rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Re-express moment rows around a shift shared by all ranks, ready for a SUM all-reduce.

    One SUM of these rows followed by :func:`_moments_from_allreduce` gives the global moments by
    Chan's merge: the within-rank ``m2`` never cancels, and the between-rank term is exact when the
    shift is near the rank means.

    Args:
        rows: float64 ``(R, 5)`` local moment rows.
        shift: float64 ``(R,)``, identical on every rank (non-finite entries are treated as 0).

    Returns:
        float64 ``(R, 4)``: ``[count, m2, count·d, count·d²]`` with ``d = mean - shift``.
    """
    c = torch.nan_to_num(shift, nan=0.0, posinf=0.0, neginf=0.0)
    n = rows[:, 0]
    d = torch.where(n > 0, rows[:, 1] - c, torch.zeros_like(c))
    return torch.stack([n, rows[:, 2], n * d, n * d * d], dim=-1)


def _moments_from_allreduce(
    sums: torch.Tensor,
    shift: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    spread: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global moment rows from the SUM of :func:`_shifted_for_allreduce` and the MAX-reduced extremes.

    ``m2 = Σ m2_i + (Σ n_i d_i² - (Σ n_i d_i)² / n)``; the between-rank term is exactly 0 when
    ``spread`` is 0 (e.g. a single rank had values).

    Args:
        sums: float64 ``(R, 4)`` summed over ranks (any leading dims work).
        shift: float64 ``(R,)`` the shared shift used by every rank.
        lo, hi: float64 ``(R,)`` global minimum and maximum.
        spread: float64 ``(R,)`` largest minus smallest rank mean (``-inf``/NaN where no rank had data).

    Returns:
        float64 ``(R, 5)`` moment rows.
    """
    c = torch.nan_to_num(shift, nan=0.0, posinf=0.0, neginf=0.0)
    n, m2_within, s1, s2 = sums.unbind(-1)
    has = n > 0
    safe_n = torch.where(has, n, torch.ones_like(n))
    between = (s2 - s1 * s1 / safe_n).clamp_min(0.0)
    if spread is not None:
        between = torch.where(spread > 0, between, torch.zeros_like(between))
    mean = torch.where(has, c + s1 / safe_n, torch.zeros_like(n))
    m2 = torch.where(has, m2_within + between, torch.zeros_like(n))
    return torch.stack([n, mean, m2, lo, hi], dim=-1)


def _needs_recentering(rows: torch.Tensor, spread: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """Rows whose between-rank term may have lost more than ~1e-10 of ``m2`` to cancellation.

    The rounding error of ``Σ n_i d_i² - (Σ n_i d_i)² / n`` is at most a few ``eps · n · distance²``.
    Such rows must be reduced again around a shift inside the data (e.g. the largest rank mean).

    Args:
        rows: float64 ``(R, 5)`` moment rows from :func:`_moments_from_allreduce`.
        spread: float64 ``(R,)`` largest minus smallest rank mean.
        distance: float64 ``(R,)`` largest ``|mean_i - shift|`` over ranks with data.

    Returns:
        bool ``(R,)``.
    """
    n, m2 = rows[:, 0], rows[:, 2]
    bound = 8 * torch.finfo(torch.float64).eps * n * distance * distance
    return (n > 0) & (spread > 0) & (bound > 1e-10 * m2)


def _moments_payload_reference(
    max_payload: Tensor, sum_payload: Tensor, sums: Tensor, shifts: Tensor, center: Tensor, fingerprint: float
) -> None:
    """Write one rank's moment rows of ``R`` statistics as the two payloads of a flush, in place.

    Each row's local moments come from its shifted sums: ``mean = shift + S1 / n``,
    ``m2 = max(S2 - S1^2 / n, 0)``; then, with ``d = mean - center`` (0 where ``n = 0``;
    non-finite centers count as 0):

    * ``max_payload`` (MAX all-reduce) ``= [fingerprint, -fingerprint, max_1..R, -min_1..R,
      mean_1..R, -mean_1..R]``, the means ``-inf`` where ``n = 0``;
    * ``sum_payload`` (SUM all-reduce) ``= [n, m2, n d, n d^2]`` per row.

    Summed over ranks around a ``center`` shared by all, ``moments_finish_`` turns them into the
    global moments by Chan, Golub & LeVeque's merge (1979): the within-rank ``m2`` never cancels,
    the between-rank term is exact when the center is near the rank means.

    Args:
        max_payload: float64 ``(2 + 4R,)``, written.
        sum_payload: float64 ``(R, 4)``, written.
        sums: float64 ``(R, 5)``, per row ``[n, S1, S2, min, max]`` with ``S1 = sum(x - shift)``,
            ``S2 = sum((x - shift)^2)`` (the layout of ``accumulate_moments_``; a moment row
            ``[n, mean, m2, min, max]`` is the case ``S1 = 0``, ``shift = mean``).
        shifts: float64 ``(R,)``, each row's shift.
        center: float64 ``(R,)``, the same on every rank.
        fingerprint: a float64 identifying the names (see :class:`~lightning_ext.stats.Collector`).
    """
    rows = moments_from_shifted(sums, shifts)
    r, has, mean = rows.shape[0], rows[:, 0] > 0, rows[:, 1]
    ninf = torch.full_like(mean, -math.inf)
    max_payload[0], max_payload[1] = fingerprint, -fingerprint
    extremes = (rows[:, 4], -rows[:, 3], torch.where(has, mean, ninf), torch.where(has, -mean, ninf))
    torch.stack(extremes, out=max_payload[2:].view(4, r))
    sum_payload.copy_(_shifted_for_allreduce(rows, center))


def _moments_finish_reference(
    published: Tensor, next_shift: Tensor, max_payload: Tensor, sum_payload: Tensor, center: Tensor,
    keep_previous: bool,
) -> Tensor:  # fmt: skip
    """Publish the global moments of ``R`` statistics from the reduced payloads of
    ``moments_payload_``, in place; say whether a row must be reduced again.

    Per row, with ``spread = max(mean) - min(mean)`` over the ranks that had values:
    ``n = sum(n)``, ``mean = center + sum(n d) / n`` (the only rank mean when ``spread == 0``:
    exact), ``m2 = sum(m2) + (sum(n d^2) - sum(n d)^2 / n)`` (the second term clipped at 0 and
    exactly 0 when ``spread == 0``), ``std = sqrt(m2 / n)`` (population), min and max. A row
    with ``n > 0`` is written to ``published`` and its mean to ``next_shift``; a row with
    ``n = 0`` keeps both when ``keep_previous``, else its ``published`` row becomes
    ``[0, nan, nan, nan, nan]`` (``next_shift`` is kept).

    Args:
        published: float64 ``(R, 5)``, ``[n, mean, std, min, max]`` per row, updated.
        next_shift: float64 ``(R,)``, updated (the center of the next flush).
        max_payload, sum_payload: the payloads after the MAX and SUM all-reduces.
        center: float64 ``(R,)``, the center the payloads were made around.
        keep_previous: what a row without values keeps (above).

    Returns:
        bool 0-dim tensor: some row's between-rank term may have lost more than ``1e-10`` of its
        ``m2`` to cancellation (its rounding error is at most a few ``eps n distance^2``, distance
        the largest ``|rank mean - center|``); reduce ``sum_payload`` again around
        ``center = max(mean)`` (``max_payload[2 + 2R : 2 + 3R]``) and finish again.
    """
    r = sum_payload.shape[0]
    hi, neg_lo, mean_max, neg_mean_min = max_payload[2:].view(4, r)
    spread = mean_max + neg_mean_min
    rows = _moments_from_allreduce(sum_payload, center, -neg_lo, hi, spread)
    c = torch.nan_to_num(center, nan=0.0, posinf=0.0, neginf=0.0)
    distance = torch.maximum(mean_max - c, neg_mean_min + c)
    needs = _needs_recentering(rows, spread, distance).any()
    n, m2 = rows[:, 0], rows[:, 2]
    has = n > 0
    mean = torch.where(spread == 0, mean_max, rows[:, 1])  # one rank's mean (or equal ones): exact
    values = torch.stack([n, mean, (m2 / n).sqrt(), rows[:, 3], rows[:, 4]], -1)
    empty = published if keep_previous else torch.tensor(_UNPUBLISHED, dtype=torch.float64, device=n.device)
    published.copy_(torch.where(has[:, None], values, empty))
    next_shift.copy_(torch.where(has, mean, next_shift))
    return needs


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
    if not x.numel():
        return
    x, block, blocks, programs = grid_stride(x)
    _moments_kernel[(programs,)](x, acc, shift, x.numel(), blocks, BLOCK=block)
    acc[3:].masked_fill_(torch.isnan(acc[2]), float("nan"))


# ---------------------------------------------------------------------------- the ops

accumulate_moments_ = define_op(
    "accumulate_moments_(Tensor(a0!) acc, Tensor x, Tensor shift) -> ()",
    _accumulate_moments_reference,
    fake=lambda *_: None,
    triton=_accumulate_moments_triton,
)
moments_payload_ = define_op(
    "moments_payload_(Tensor(a0!) max_payload, Tensor(a1!) sum_payload, Tensor sums, Tensor shifts, "
    "Tensor center, float fingerprint) -> ()",
    _moments_payload_reference,
    fake=lambda *_: None,
)
moments_finish_ = define_op(
    "moments_finish_(Tensor(a0!) published, Tensor(a1!) next_shift, Tensor max_payload, "
    "Tensor sum_payload, Tensor center, bool keep_previous) -> Tensor",
    _moments_finish_reference,
    fake=lambda published, *_: published.new_empty((), dtype=torch.bool),
    clone=True,
)
