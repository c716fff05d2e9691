"""The statistics ops (contracts: :class:`~lightning_ext.kernels.KernelBackend`): ``accumulate_moments_``
(``_accumulate_moments_reference`` and the Triton kernel's launcher ``_accumulate_moments_triton``), and
the flush's ``moments_payload_`` and ``moments_finish_`` (reference only: a few vector ops over the
names, which ``triton`` inherits; ``cpu`` compiles them). The moment maths of the flush lives here;
:mod:`lightning_ext.stats.moments` re-exports it.

Sources: shifted sums (Welford 1962; Chan, Golub & LeVeque, "Algorithms for computing the sample
variance", 1983, section 3) and the parallel merge (Chan, Golub & LeVeque 1979).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_ext.kernels._triton import HAS_TRITON, sm_count, tl, triton

__all__: list[str] = []  # an op family: the backends bind its `_<op>_<backend>` functions

_UNPUBLISHED = (0.0, math.nan, math.nan, math.nan, math.nan)  # a published row without values

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


# ---------------------------------------------------------------------------- the flush (reference)
# Moment rows ``[count, mean, m2, min, max]`` (m2: sum of squared deviations from the mean) and the two
# payloads of a flush; see KernelBackend.moments_payload_ / moments_finish_ for the contracts.


def _moments_from_shifted(acc: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
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
    """Local moment rows of the shifted ``sums``, written as the MAX and SUM payloads of a flush."""
    rows = _moments_from_shifted(sums, shifts)
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
    """Global rows from the reduced payloads, published as ``[count, mean, std, min, max]``."""
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
    x = x.reshape(-1).contiguous()  # the kernel reads stride 1; reshape may give a strided view
    block = 4096 if x.is_cpu else 1024  # Triton's interpreter (CPU tensors): few, large programs
    blocks = triton.cdiv(x.numel(), block)
    programs = min(blocks, 3 if x.is_cpu else 4 * sm_count(x.device))
    _moments_kernel[(programs,)](x, acc, shift, x.numel(), blocks, BLOCK=block)
    acc[3:].masked_fill_(torch.isnan(acc[2]), float("nan"))
