"""Pure functions on moment rows: the maths behind :mod:`lightning_ext.stats`, free of state. A *moment
row* is a float64 vector ``[count, mean, m2, min, max]`` (``m2`` = sum of squared deviations from
``mean``); a table of them has shape ``(R, 5)``, one row per name. An empty row is ``[0, 0, 0, +inf,
-inf]`` so that merging with it is the identity. Sources: shifted sums (Welford 1962; Chan, Golub &
LeVeque, "Algorithms for computing the sample variance", 1983, §3) and the parallel merge (Chan,
Golub & LeVeque 1979, "Updating formulae and a pairwise algorithm for computing sample variances").
The flush's own maths (shifted sums to moments, the payloads of the all-reduces) is in
``lightning_ext.kernels.moments``, behind the kernel backend's ops. None of these functions
synchronizes host and device. :func:`~lightning_ext.stats.merge_moments` is public (``PreciseBN``
merges batch moments with it); the other helpers serve ``report()`` and ``Collector`` and are tested
directly.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["merge_moments"]

_EMPTY_ROW = (0.0, 0.0, 0.0, float("inf"), float("-inf"))  # identity of merge_moments


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


def merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Chan's parallel merge of two tables of moment rows (elementwise over leading dims).

    ``m2 = m2_a + m2_b + δ² · n_a n_b / n`` with ``δ = mean_b - mean_a``.

    Args:
        a, b: float64 ``(..., 5)`` moment rows, broadcastable.

    Returns:
        float64 ``(..., 5)``: the moments of the union of both samples.

    Example::

        >>> x = torch.arange(10.0, dtype=torch.float64)
        >>> torch.allclose(merge_moments(_moments_of(x[:3]), _moments_of(x[3:])), _moments_of(x))
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


def _as_shifted(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Moment rows as the shifted sums of the flush ops: ``[n, 0, m2, min, max]`` about each mean.

    Args:
        rows: float64 ``(R, 5)`` moment rows.

    Returns:
        float64 ``(R, 5)`` sums and ``(R,)`` shifts (``mean = shift + 0 / n`` and ``m2`` exactly; a
        non-finite mean stays in the sums, ``n · mean`` about a shift of 0, since the flush takes a
        non-finite shift as 0).
    """
    sums, mean = rows.clone(), rows[:, 1]
    finite = mean.isfinite()
    sums[:, 1] = torch.where(finite, 0.0, mean * rows[:, 0])
    return sums, torch.where(finite, mean, 0.0)


def _fingerprint(names: list[str] | tuple[str, ...]) -> float:
    """A 48-bit hash of a sorted name list as an exactly representable float64 (for MAX/MIN agreement).

    Example::

        >>> _fingerprint(["a", "b"]) == _fingerprint(("a", "b")) != _fingerprint(["a"])
        True
    """
    text = f"{len(names)}\x00" + "\x00".join(names)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=6).digest()
    return float(int.from_bytes(digest, "big") + 1)  # +1: never 0, so it differs from padding
