"""Pure functions on moment rows: the maths behind :mod:`lightning_ext.stats`, free of state.

A *moment row* is a float64 vector ``[count, mean, m2, min, max]`` (``m2`` = sum of squared
deviations from ``mean``); a table of them has shape ``(R, 5)``, one row per name. An empty row
is ``[0, 0, 0, +inf, -inf]`` so that merging with it is the identity.

Algorithms:

* Per device, values are accumulated as *shifted sums* ``[count, Σ(x-s), Σ(x-s)², min, max]``
  around a shift ``s`` taken from the data itself (the first value seen), which keeps the sums
  small when ``|mean| ≫ std`` (Welford 1962; Chan, Golub & LeVeque, "Algorithms for computing
  the sample variance", 1983, §3 "shifted data"). :func:`moments_from_shifted` turns them into
  moment rows.
* Rows from different devices / drains are combined with Chan's parallel update
  (:func:`merge_moments`; Chan, Golub & LeVeque 1979, "Updating formulae and a pairwise
  algorithm for computing sample variances").
* Across ranks, :func:`shifted_for_allreduce` re-expresses every rank's row around a shift ``c``
  all ranks agree on, so that one SUM all-reduce of ``[count, m2, count·d, count·d²]``
  (``d = mean - c``) followed by :func:`moments_from_allreduce` gives the global moments by Chan's
  merge: the within-rank ``m2`` never cancels, and the between-rank term is exact when ``c`` is
  near the rank means. ``c`` is the previous update's global mean (known to every rank, so the
  SUM can run concurrently with the MAX all-reduce); :func:`needs_recentering` flags the rare rows
  whose mean moved so far from it that cancellation could cost more than ~1e-10 of ``m2``, which
  are then reduced again around the largest rank mean (inside the data range).

None of these functions synchronizes host and device.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = [
    "EMPTY_ROW",
    "empty_moments",
    "fingerprint",
    "merge_moments",
    "moments_from_allreduce",
    "moments_from_shifted",
    "moments_of",
    "needs_recentering",
    "shifted_for_allreduce",
]

EMPTY_ROW = (0.0, 0.0, 0.0, float("inf"), float("-inf"))  # identity of merge_moments


def empty_moments(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float64 ``(rows, 5)`` table of empty moment rows on ``device``."""
    return torch.tensor(EMPTY_ROW, dtype=torch.float64, device=device).repeat(rows, 1)


def moments_of(x: torch.Tensor) -> torch.Tensor:
    """Moment row of all elements of ``x`` computed directly in float64 (a reference for tests).

    Args:
        x: tensor of any shape and real dtype; empty gives the empty row.

    Returns:
        float64 tensor of shape ``(5,)`` on ``x.device``: ``[count, mean, m2, min, max]``.
    """
    x = x.detach().reshape(-1).to(torch.float64)
    if x.numel() == 0:
        return torch.tensor(EMPTY_ROW, dtype=torch.float64, device=x.device)
    mean = x.mean()
    return torch.stack([x.new_tensor(float(x.numel())), mean, (x - mean).square().sum(), x.min(), x.max()])


def moments_from_shifted(acc: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Convert shifted sums to moment rows.

    Args:
        acc: float64 ``(..., 5)``: ``[count, Σ(x-shift), Σ(x-shift)², min, max]``.
        shift: float64 ``(...)``: the shift each row was accumulated around.

    Returns:
        float64 ``(..., 5)`` moment rows ``[count, mean, m2, min, max]``; rows with count 0 are empty.
    """
    n, s1, s2 = acc[..., 0], acc[..., 1], acc[..., 2]
    has = n > 0
    safe_n = torch.where(has, n, torch.ones_like(n))
    mean = torch.where(has, shift + s1 / safe_n, torch.zeros_like(n))
    m2 = torch.where(has, (s2 - s1 * s1 / safe_n).clamp_min(0.0), torch.zeros_like(n))
    return torch.stack([n, mean, m2, acc[..., 3], acc[..., 4]], dim=-1)


def merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Chan's parallel merge of two tables of moment rows (elementwise over leading dims).

    ``m2 = m2_a + m2_b + δ² · n_a n_b / n`` with ``δ = mean_b - mean_a`` (Chan, Golub & LeVeque 1979).

    Args:
        a: float64 ``(..., 5)`` moment rows.
        b: float64 ``(..., 5)`` moment rows, broadcastable with ``a``.

    Returns:
        float64 ``(..., 5)``: the moments of the union of both samples.

    Example::

        >>> x = torch.arange(10.0, dtype=torch.float64)
        >>> torch.allclose(merge_moments(moments_of(x[:3]), moments_of(x[3:])), moments_of(x))
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
    m2 = a[..., 2] + b[..., 2] + cross
    return torch.stack(
        [n, mean, m2, torch.minimum(a[..., 3], b[..., 3]), torch.maximum(a[..., 4], b[..., 4])], -1
    )


def shifted_for_allreduce(rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Re-express moment rows around a shift shared by all ranks, ready for a SUM all-reduce.

    Args:
        rows: float64 ``(R, 5)`` local moment rows.
        shift: float64 ``(R,)``, identical on every rank (non-finite entries are treated as 0).

    Returns:
        float64 ``(R, 4)``: ``[count, m2, count·d, count·d²]`` with ``d = mean - shift``; the
        within-rank ``m2`` travels on its own so that only the between-rank part can cancel.
    """
    c = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    n = rows[:, 0]
    d = torch.where(n > 0, rows[:, 1] - c, torch.zeros_like(c))
    return torch.stack([n, rows[:, 2], n * d, n * d * d], dim=-1)


def moments_from_allreduce(
    sums: torch.Tensor,
    shift: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    spread: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global moment rows from the SUM of :func:`shifted_for_allreduce` and the MAX-reduced extremes.

    ``m2 = Σ m2_i + (Σ n_i d_i² - (Σ n_i d_i)² / n)`` (Chan's merge of the rank rows around the
    shift). The between-rank term is exactly 0 when ``spread`` (largest minus smallest rank mean)
    is 0, e.g. when a single rank had values.

    Args:
        sums: float64 ``(R, 4)`` summed over ranks.
        shift: float64 ``(R,)`` the shared shift used by every rank.
        lo: float64 ``(R,)`` global minimum; hi: float64 ``(R,)`` global maximum.
        spread: float64 ``(R,)`` largest minus smallest rank mean (``-inf``/NaN where no rank had data).

    Returns:
        float64 ``(R, 5)`` moment rows.
    """
    c = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    n, m2_within, s1, s2 = sums.unbind(-1)
    has = n > 0
    safe_n = torch.where(has, n, torch.ones_like(n))
    between = (s2 - s1 * s1 / safe_n).clamp_min(0.0)
    if spread is not None:
        between = torch.where(spread > 0, between, torch.zeros_like(between))
    mean = torch.where(has, c + s1 / safe_n, torch.zeros_like(n))
    m2 = torch.where(has, m2_within + between, torch.zeros_like(n))
    return torch.stack([n, mean, m2, lo, hi], dim=-1)


def needs_recentering(rows: torch.Tensor, spread: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """Rows whose between-rank term may have lost more than ~1e-10 of ``m2`` to cancellation.

    The rounding error of ``Σ n_i d_i² - (Σ n_i d_i)² / n`` is at most a few ``eps · n · d_max²``
    where ``d_max`` (``distance``) is the largest distance of a rank mean from the shift. Such rows
    must be reduced again around a shift inside the data (e.g. the largest rank mean).

    Args:
        rows: float64 ``(R, 5)`` moment rows from :func:`moments_from_allreduce`.
        spread: float64 ``(R,)`` largest minus smallest rank mean.
        distance: float64 ``(R,)`` largest ``|mean_i - shift|`` over ranks with data.

    Returns:
        bool ``(R,)``.
    """
    n, m2 = rows[:, 0], rows[:, 2]
    bound = 8 * torch.finfo(torch.float64).eps * n * distance * distance
    return (n > 0) & (spread > 0) & (bound > 1e-10 * m2)


def fingerprint(names: list[str] | tuple[str, ...]) -> float:
    """A 48-bit hash of a sorted name list as an exactly representable float64 (for MAX/MIN agreement).

    Example::

        >>> fingerprint(["a", "b"]) == fingerprint(("a", "b")) != fingerprint(["a"])
        True
    """
    text = f"{len(names)}\x00" + "\x00".join(names)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=6).digest()
    return float(int.from_bytes(digest, "big") + 1)  # +1: never 0, so it differs from padding
