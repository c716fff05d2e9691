"""Pure functions on moment rows: the maths behind :mod:`lightning_ext.stats`, free of state.

A *moment row* is a float64 vector ``[count, mean, m2, min, max]`` (``m2`` = sum of squared
deviations from ``mean``); a table of them has shape ``(R, 5)``, one row per name. An empty row
is ``[0, 0, 0, +inf, -inf]`` so that merging with it is the identity. Sources: shifted sums
(Welford 1962; Chan, Golub & LeVeque, "Algorithms for computing the sample variance", 1983, §3)
and the parallel merge (Chan, Golub & LeVeque 1979, "Updating formulae and a pairwise algorithm
for computing sample variances"). None of these functions synchronizes host and device.
"""

from __future__ import annotations

import hashlib

import torch

__all__: list[str] = []  # the maths of Collector and report(): private helpers, tested directly

_EMPTY_ROW = (0.0, 0.0, 0.0, float("inf"), float("-inf"))  # identity of _merge_moments


def _empty_moments(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float64 ``(rows, 5)`` table of empty moment rows on ``device``."""
    return torch.tensor(_EMPTY_ROW, dtype=torch.float64, device=device).repeat(rows, 1)


def _moments_of(x: torch.Tensor) -> torch.Tensor:
    """Moment row of all elements of ``x`` computed directly in float64 (a reference for tests).

    Args:
        x: tensor of any shape and real dtype; empty gives the empty row.

    Returns:
        float64 ``(5,)`` on ``x.device``.
    """
    x = x.detach().reshape(-1).to(torch.float64)
    if x.numel() == 0:
        return torch.tensor(_EMPTY_ROW, dtype=torch.float64, device=x.device)
    mean = x.mean()
    return torch.stack([x.new_tensor(float(x.numel())), mean, (x - mean).square().sum(), x.min(), x.max()])


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


def _merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Chan's parallel merge of two tables of moment rows (elementwise over leading dims).

    ``m2 = m2_a + m2_b + δ² · n_a n_b / n`` with ``δ = mean_b - mean_a``.

    Args:
        a, b: float64 ``(..., 5)`` moment rows, broadcastable.

    Returns:
        float64 ``(..., 5)``: the moments of the union of both samples.

    Example::

        >>> x = torch.arange(10.0, dtype=torch.float64)
        >>> torch.allclose(_merge_moments(_moments_of(x[:3]), _moments_of(x[3:])), _moments_of(x))
        True
    """
    na, nb = a[..., 0], b[..., 0]
    n = na + nb
    safe_n = torch.where(n > 0, n, torch.ones_like(n))
    mean_a = torch.where(na > 0, a[..., 1], torch.zeros_like(na))
    mean_b = torch.where(nb > 0, b[..., 1], torch.zeros_like(nb))
    delta = mean_b - mean_a
    both = (na > 0) & (nb > 0)
    mean = torch.where(both, mean_a + delta * (nb / safe_n), mean_a + mean_b)
    cross = torch.where(both, delta * delta * (na * nb / safe_n), torch.zeros_like(n))
    lo, hi = torch.minimum(a[..., 3], b[..., 3]), torch.maximum(a[..., 4], b[..., 4])
    return torch.stack([n, mean, a[..., 2] + b[..., 2] + cross, lo, hi], -1)


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


def _fingerprint(names: list[str] | tuple[str, ...]) -> float:
    """A 48-bit hash of a sorted name list as an exactly representable float64 (for MAX/MIN agreement).

    Example::

        >>> _fingerprint(["a", "b"]) == _fingerprint(("a", "b")) != _fingerprint(["a"])
        True
    """
    text = f"{len(names)}\x00" + "\x00".join(names)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=6).digest()
    return float(int.from_bytes(digest, "big") + 1)  # +1: never 0, so it differs from padding
