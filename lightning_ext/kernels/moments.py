"""Statistics op family: ``accumulate_moments_`` (reference and a Triton kernel) and the flush's
``moments_payload_`` and ``moments_finish_`` (reference only: a few vector ops over the names; ``cpu``
compiles them). The moment maths of :class:`lightning_ext.stats.Collector`'s flush lives here.

An *accumulator row* is float64 ``[n, S1, S2, min, max, nonfinite]``: the count of finite values, their
sums shifted by the row's shift, ``S1 = sum(x - shift)``, ``S2 = sum((x - shift)^2)``, their extremes,
and the count of non-finite values (NaN, ``+inf``, ``-inf``), which are counted and nothing else. An
empty row is ``[0, 0, 0, +inf, -inf, 0]``. A *moment row* is ``[n, mean, m2, min, max]``, ``m2`` the sum
of squared deviations from the mean.

Sources: shifted sums (Welford 1962; Chan, Golub & LeVeque, "Algorithms for computing the sample
variance", 1983, section 3) and the parallel merge (Chan, Golub & LeVeque 1979).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, grid_stride, tl, triton
from lightning_ext.kernels.backend import define_op

__all__ = ["merge_moments", "moments_from_shifted"]  # and the ops, registered below (kernels.ops)

_UNPUBLISHED = (0.0, math.nan, math.nan, math.nan, math.nan, 0.0)  # a published row without values
EMPTY_ROW = (0.0, 0.0, 0.0, math.inf, -math.inf, 0.0)  # an accumulator row without values
_EPS = torch.finfo(torch.float64).eps

# ---------------------------------------------------------------------------- reference (pure torch)


def _start_shift_(shift: Tensor, x: Tensor) -> None:
    """A NaN ``shift`` becomes the first finite element of the non-empty ``x`` (NaN without one); no host
    sync."""
    v = x.detach().reshape(-1)
    finite = v.isfinite()
    i = finite.to(torch.uint8).argmax().reshape(1)  # the first finite element (0 without one)
    first, found = v.index_select(0, i)[0].to(torch.float64), finite.index_select(0, i)[0]
    shift.copy_(torch.where(shift.isnan() & found, first, shift))


def _accumulate_moments_reference(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """Add the finite values of ``x`` to the accumulator row ``acc`` and count the others, in place.

    ``acc += [n, sum(x - shift), sum((x - shift)^2), ., ., k]`` over the ``n`` finite elements (``k``
    the non-finite ones: NaN, ``+inf``, ``-inf``), ``acc[3] = min(acc[3], min)``, ``acc[4] = max(acc[4],
    max)`` of the finite ones. A shift near the data (its first finite value) keeps the variance
    ``(S2 - S1^2 / n) / n`` accurate (shifted-data algorithm, Chan, Golub & LeVeque 1983). Element
    arithmetic is float64, except that for float16/bfloat16/float32 input a backend may form ``x -
    shift`` and its square in float32 and sum them in runs of at most 32 terms before float64 takes them,
    where no square overflows or underflows (``cpu``: relative error at most ``34 * 2**-24`` of the
    summed magnitudes; float64 elsewhere). The sums are finite while the deviations from the shift stay
    below about ``1e154`` (their squares, float64's range): beyond, ``S2`` overflows and the variance
    published from it is NaN (NumPy's is inf), the count, sum, min and max still right.

    Args:
        acc: float64 ``(6,)`` on ``x``'s device, updated in place (the layout of the module docstring).
        x: real tensor of any shape and dtype but bool, uint16/32/64 and float8 (``report()`` converts
            those first); empty adds nothing (a tensor that requires grad is read as it is, nothing
            recorded).
        shift: float64 0-dim tensor on ``x``'s device, finite, or NaN for a row without values yet:
            then set in place to the first finite element of ``x`` first (NaN without one).

    Reference: a float64 copy, the non-finite elements masked (no host sync), a shifted sum and a dot
    product (BLAS).
    """
    if not x.numel():
        return
    _start_shift_(shift, x)
    v = x.detach().reshape(-1).to(torch.float64)
    d = v - shift  # out of place: for float64 ``x`` the copy above is ``x`` itself
    if x.is_floating_point():
        finite = v.isfinite()
        count = finite.sum(dtype=torch.float64)
        d = torch.where(finite, d, 0.0)
        lo, hi = torch.where(finite, v, math.inf).min(), torch.where(finite, v, -math.inf).max()
    else:
        count, (lo, hi) = v.new_full((), float(v.numel())), v.aminmax()  # a fill: no host-to-device copy
    acc[0:3].add_(torch.stack((count, d.sum(), torch.dot(d, d))))
    torch.minimum(acc[3], lo, out=acc[3])
    torch.maximum(acc[4], hi, out=acc[4])
    acc[5].add_(v.numel() - count)


def moments_from_shifted(acc: Tensor, shift: Tensor) -> Tensor:
    """Moment rows ``[n, mean, m2, min, max]`` of accumulator rows (a shift taken from the data keeps the
    sums small when ``|mean| >> std``).

    Args:
        acc: float64 ``(..., 5)`` or ``(..., 6)``: ``[n, sum(x - shift), sum((x - shift)^2), min, max]``
            (a sixth column, the non-finite count, is ignored).
        shift: float64 ``(...)``: the shift each row was accumulated around (non-finite counts as 0).

    Returns:
        float64 ``(..., 5)`` moment rows; rows with ``n = 0`` are ``[0, 0, 0, min, max]``.

    Example::

        >>> acc = torch.tensor([[3.0, 0.0, 2.0, 1.0, 3.0]], dtype=torch.float64)  # 1, 2, 3 about 2
        >>> moments_from_shifted(acc, torch.tensor([2.0], dtype=torch.float64)).tolist()
        [[3.0, 2.0, 2.0, 1.0, 3.0]]
    """
    n, s1, s2, lo, hi = acc[..., :5].unbind(-1)
    has = n > 0
    safe = torch.where(has, n, 1.0)
    mean = torch.where(has, torch.nan_to_num(shift, 0.0, 0.0, 0.0) + s1 / safe, 0.0)
    m2 = torch.where(has, (s2 - s1 * s1 / safe).clamp_min(0.0), 0.0)
    return torch.stack([n, mean, m2, lo, hi], -1)


def merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Chan's parallel merge of two tables of moment rows ``[n, mean, m2, min, max]`` (elementwise over
    leading dims), ``m2`` the sum of squared deviations from the mean: ``m2 = m2_a + m2_b + δ² n_a n_b /
    n`` with ``δ = mean_b - mean_a``. An empty row ``[0, 0, 0, +inf, -inf]`` is its identity. Source:
    Chan, Golub & LeVeque, "Updating formulae and a pairwise algorithm for computing sample variances"
    (1979). No host sync.

    Args:
        a, b: float64 ``(..., 5)`` moment rows, broadcastable.

    Returns:
        float64 ``(..., 5)``: the moments of the union of both samples.

    Example::

        >>> rows = torch.tensor([[2.0, 1.5, 0.5, 1.0, 2.0], [1.0, 6.0, 0.0, 6.0, 6.0]], dtype=torch.float64)
        >>> merge_moments(rows[0], rows[1]).tolist()  # 1, 2 and 6: mean 3, m2 = 14
        [3.0, 3.0, 14.0, 1.0, 6.0]
    """
    na, nb = a[..., 0], b[..., 0]
    n = na + nb
    safe = torch.where(n > 0, n, 1.0)
    mean_a, mean_b = torch.where(na > 0, a[..., 1], 0.0), torch.where(nb > 0, b[..., 1], 0.0)
    delta = mean_b - mean_a
    both = (na > 0) & (nb > 0)
    mean = torch.where(both, mean_a + delta * (nb / safe), mean_a + mean_b)
    cross = torch.where(both, delta * delta * (na * nb / safe), 0.0)
    lo, hi = torch.minimum(a[..., 3], b[..., 3]), torch.maximum(a[..., 4], b[..., 4])
    return torch.stack([n, mean, a[..., 2] + b[..., 2] + cross, lo, hi], -1)


# ---------------------------------------------------------------------------- the flush (reference)


def _moments_payload_reference(
    max_payload: Tensor, sum_payload: Tensor, rows: Tensor, shifts: Tensor, center: Tensor,
    head: list[float], counted: Tensor, rank: int, rank_bits: int,
) -> None:  # fmt: skip
    """Write one rank's accumulator rows of ``R`` statistics as the two payloads of a flush, in place.

    Each row's local moments come from its shifted sums: ``mean = shift + S1 / n``, ``m2 = max(S2 -
    S1^2 / n, 0)``; then, with ``d = mean - center`` (0 where ``n = 0``; a non-finite center counts as 0):

    * ``max_payload`` (MAX all-reduce) ``= [head | bound | max_1..R | -min_1..R | mean_1..R | -mean_1..R |
      packed_1..R]``, ``bound`` the largest ``n`` of the rows ``counted`` (at least 1), the means
      ``-inf`` where ``n = 0``; ``packed_i``: the mean with its low
      ``rank_bits`` mantissa bits replaced by ``rank`` (``-inf`` where ``n = 0``), so that the MAX names
      the rank with the largest mean (its size depends on ``R`` alone);
    * ``sum_payload`` (SUM all-reduce) ``= [n, m2, n d, n d^2, nonfinite]`` per row.

    Summed over ranks around a ``center`` shared by all, ``moments_finish_`` turns them into the
    global moments by Chan, Golub & LeVeque's merge (1979): the within-rank ``m2`` never cancels, the
    between-rank term is exact when the center is near the rank means.

    Args:
        max_payload: float64 ``(H + 1 + 5R,)``, written.
        sum_payload: float64 ``(R, 5)``, written.
        rows: float64 ``(R, 6)`` accumulator rows (module docstring; a moment row is the case
            ``S1 = 0``, ``shift = mean``).
        shifts: float64 ``(R,)``, each row's shift.
        center: float64 ``(R,)``, the same on every rank.
        head: ``H`` floats written first, as given (the flush's fingerprints).
        counted: int64 ``(Q,)``, the rows whose largest count is the ``bound`` (a sketch's bits).
        rank, rank_bits: this rank, and the low mantissa bits that hold it (``rank < 2**rank_bits``).
    """
    h, r = len(head) + 1, rows.shape[0]
    n, s1, s2, lo, hi, nonfinite = rows.unbind(1)
    has = n > 0
    safe = torch.where(has, n, 1.0)
    mean = torch.where(has, torch.nan_to_num(shifts, 0.0, 0.0, 0.0) + s1 / safe, 0.0)
    m2 = torch.where(has, (s2 - s1 * s1 / safe).clamp_min(0.0), 0.0)
    d = torch.where(has, mean - torch.nan_to_num(center, 0.0, 0.0, 0.0), 0.0)
    max_payload[:h] = torch.tensor([*head, 1.0], dtype=torch.float64)
    max_payload[h - 1] = torch.cat([n[counted], max_payload[h - 1 : h]]).max()
    ninf = torch.full_like(mean, -math.inf)
    extremes = (hi, -lo, torch.where(has, mean, ninf), torch.where(has, -mean, ninf))
    torch.stack(extremes, out=max_payload[h : h + 4 * r].view(4, r))
    bits = mean.view(torch.int64) & ~((1 << rank_bits) - 1) | rank
    max_payload[h + 4 * r :] = torch.where(has, bits.view(torch.float64), -math.inf)
    torch.stack([n, m2, n * d, n * d * d, nonfinite], 1, out=sum_payload)


def _moments_finish_reference(
    published: Tensor, next_shift: Tensor, idle: Tensor, flags: Tensor, rows: Tensor, shifts: Tensor,
    extremes: Tensor, sum_payload: Tensor, center: Tensor, keep_previous: bool, forget_after: int,
) -> None:  # fmt: skip
    """Publish the global statistics of ``R`` names from the reduced payloads of ``moments_payload_``,
    in place; say whether a row must be reduced again and how many rows are idle long enough to forget,
    and empty the accumulator rows the payloads were made of unless a row must be reduced again.

    Per row, with ``spread = max(mean) - min(mean)`` over the ranks that had finite values: ``n =
    sum(n)``, ``mean = center + sum(n d) / n`` (the only rank mean when ``spread == 0``: exact), ``m2 =
    sum(m2) + (sum(n d^2) - sum(n d)^2 / n)`` (the second term clipped at 0, exactly 0 when ``spread ==
    0``), ``std = sqrt(m2 / n)`` (population), min and max. A row with values (``n + nonfinite > 0``) is
    published as ``[n, mean, std, min, max, nonfinite]`` (NaN statistics when ``n = 0``: every value was
    non-finite), its mean goes to ``next_shift`` where ``n > 0``, its ``idle`` count to 0. A row without
    values keeps ``published`` when ``keep_previous``, else becomes ``[0, nan, nan, nan, nan, 0]``; its
    ``idle`` count grows by one.

    Args:
        published: float64 ``(R, 6)``, updated.
        next_shift: float64 ``(R,)``, updated (the center of the next flush).
        idle: float64 ``(R,)``, updated: flushes in a row without values.
        flags: float64 ``(2,)``, written: ``[again, forgettable]``. ``again`` is 1 when some row's
            between-rank term may have lost more than ``1e-10`` of its ``m2`` to cancellation (its
            rounding error is at most a few ``eps n distance^2``, distance the largest ``|rank mean -
            center|``): reduce ``sum_payload`` again around ``center = max(mean)`` (``extremes[2R :
            3R]``) and finish again; ``forgettable``: the rows idle for at least ``forget_after`` flushes.
        rows, shifts: float64 ``(R', 6)`` accumulator rows and ``(R',)`` their shifts, any ``R'``
            (those the payloads were made of): emptied (``[0, 0, 0, +inf, -inf, 0]``, NaN) unless
            ``again``.
        extremes: float64 ``(5R,)``: the reduced ``max_payload`` after its head.
        sum_payload: float64 ``(R, 5)``, reduced.
        center: float64 ``(R,)``, the center the payloads were made around.
        keep_previous: what a row without values keeps (above).
        forget_after: count the rows idle for at least this many flushes (0: none).
    """
    r = sum_payload.shape[0]
    hi, neg_lo, mean_max, neg_mean_min = extremes[: 4 * r].view(4, r)
    n, m2_within, s1, s2, nonfinite = sum_payload.unbind(1)
    c = torch.nan_to_num(center, 0.0, 0.0, 0.0)
    has, spread = n > 0, mean_max + neg_mean_min
    safe = torch.where(has, n, 1.0)
    between = torch.where(spread > 0, (s2 - s1 * s1 / safe).clamp_min(0.0), 0.0)
    m2 = torch.where(has, m2_within + between, 0.0)
    distance = torch.maximum(mean_max - c, neg_mean_min + c)
    again = (has & (spread > 0) & (8 * _EPS * n * distance * distance > 1e-10 * m2)).any()
    mean = torch.where(spread == 0, mean_max, c + s1 / safe)  # one rank's mean (or equal ones): exact
    values = torch.stack([n, mean, (m2 / safe).sqrt(), -neg_lo, hi, nonfinite], -1)
    unpublished = torch.tensor(_UNPUBLISHED, dtype=torch.float64, device=n.device)
    values = torch.where(has[:, None], values, unpublished)
    values[:, 5] = nonfinite
    seen = n + nonfinite > 0
    published.copy_(torch.where(seen[:, None], values, published if keep_previous else unpublished))
    next_shift.copy_(torch.where(has, mean, next_shift))
    idle.copy_(torch.where(seen, 0.0, idle + 1.0))
    forgettable = (idle >= forget_after).sum() if forget_after > 0 else idle.new_zeros((), dtype=torch.int64)
    flags.copy_(torch.stack([again.double(), forgettable.double()]))
    rows.copy_(torch.where(again, rows, torch.tensor(EMPTY_ROW, dtype=torch.float64, device=rows.device)))
    shifts.copy_(torch.where(again, shifts, math.nan))


# ---------------------------------------------------------------------------- Triton kernel

if HAS_TRITON:

    @triton.jit
    def _moments_kernel(
        x_ptr,  # x: (numel,) contiguous, any real dtype
        acc_ptr,  # acc: (6,) fp64 [n, sum(x - shift), sum((x - shift)^2), min, max, nonfinite], in place
        shift_ptr,  # shift: () fp64
        numel,
        n_blocks,  # cdiv(numel, BLOCK)
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Grid-stride loop over the blocks with per-lane float64 partials; one set of atomics per
        # program (a few hundred programs), not per block: the six addresses are not contended.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK)
        shift = tl.load(shift_ptr)
        count = tl.zeros([BLOCK], dtype=tl.float64)
        s1 = tl.zeros([BLOCK], dtype=tl.float64)
        s2 = tl.zeros([BLOCK], dtype=tl.float64)
        lo = tl.full([BLOCK], float("inf"), dtype=tl.float64)
        hi = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
        bad = tl.zeros([BLOCK], dtype=tl.float64)
        for b in range(pid, n_blocks, nprog):
            offs = tl.cast(b, tl.int64) * BLOCK + lanes
            mask = offs < numel
            v = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.float64)
            finite = mask & (tl.abs(v) < float("inf"))  # NaN compares false
            d = tl.where(finite, v - shift, 0.0)
            count += tl.where(finite, 1.0, 0.0)
            s1 += d
            s2 += d * d
            lo = tl.minimum(lo, tl.where(finite, v, float("inf")))
            hi = tl.maximum(hi, tl.where(finite, v, float("-inf")))
            bad += tl.where(mask & ~finite, 1.0, 0.0)
        tl.atomic_add(acc_ptr, tl.sum(count, axis=0))
        tl.atomic_add(acc_ptr + 1, tl.sum(s1, axis=0))
        tl.atomic_add(acc_ptr + 2, tl.sum(s2, axis=0))
        tl.atomic_min(acc_ptr + 3, tl.min(lo, axis=0))
        tl.atomic_max(acc_ptr + 4, tl.max(hi, axis=0))
        tl.atomic_add(acc_ptr + 5, tl.sum(bad, axis=0))


# ---------------------------------------------------------------------------- launcher


def _accumulate_moments_triton(acc: Tensor, x: Tensor, shift: Tensor) -> None:
    """ONE launch of at most 4 programs per multiprocessor; float64 atomics combine their partials.
    Non-contiguous ``x`` is flattened with a copy first."""
    if not x.numel():
        return
    _start_shift_(shift, x)
    x, block, blocks, programs = grid_stride(x)
    _moments_kernel[(programs,)](x, acc, shift, x.numel(), blocks, BLOCK=block)


# ---------------------------------------------------------------------------- the ops

accumulate_moments_ = define_op(
    "accumulate_moments_(Tensor(a0!) acc, Tensor x, Tensor(a1!) shift) -> ()",
    _accumulate_moments_reference,
    fake=lambda *_: None,
    triton=_accumulate_moments_triton,
)
moments_payload_ = define_op(
    "moments_payload_(Tensor(a0!) max_payload, Tensor(a1!) sum_payload, Tensor rows, Tensor shifts, "
    "Tensor center, float[] head, Tensor counted, int rank, int rank_bits) -> ()",
    _moments_payload_reference,
    fake=lambda *_: None,
)
moments_finish_ = define_op(
    "moments_finish_(Tensor(a0!) published, Tensor(a1!) next_shift, Tensor(a2!) idle, Tensor(a3!) flags, "
    "Tensor(a4!) rows, Tensor(a5!) shifts, Tensor extremes, Tensor sum_payload, Tensor center, "
    "bool keep_previous, int forget_after) -> ()",
    _moments_finish_reference,
    fake=lambda *_: None,
)
