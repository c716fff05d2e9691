"""Correctly rounded float64 moments of a sample, and how far a float64 implementation may stray from them.

Tests compare what :mod:`lightning_ext.stats` publishes (count, mean, population std, min, max) with
:func:`reference_moments`, which sums with ``math.fsum`` (correctly rounded), so that the
tolerance is the rounding bound of the implementation plus a few ulps of the reference, derived
below, and never one CPU's summation order.

Error model (first order in ``eps = 2**-52``; Higham, *Accuracy and Stability of Numerical
Algorithms*, 2002, §4.2: summing ``k`` float64 terms ``t_j`` in ANY order and grouping is off by
at most ``(k - 1)·eps/2·Σ|t_j|``). The implementation forms, per partial sample ("leaf": one device's
accumulator between two drains, one rank), ``s1 = Σ(x - c)`` and ``s2 = Σ(x - c)²`` around a shift
``c``, converts them to ``mean = c + s1/n`` and ``m2 = s2 - s1²/n``, then combines partial results in
up to ``merges`` rounds, each of at most ``ways`` rows (Chan's merge: 2; the all-reduce across ranks:
the world size). Every shift is a data value, a mean of a subset, or one of ``shifts`` (e.g. the
previous update's mean), so every ``|x - c|`` and every difference of means is at most
``D = hi - lo``, the span of the data and ``shifts``; ``M = max(|lo|, |hi|)``. Let
``A = Σ max(x - lo, hi - x)`` and ``Q = Σ max(x - lo, hi - x)²``: they bound ``Σ|x - c|`` and
``Σ(x - c)²`` for any assignment of shifts in ``[lo, hi]``.

* mean, leaf: ``|Δs1| ≤ n·eps/2·Σ|x - c|`` (the subtractions included), divided by ``n``, plus the
  division and the addition of ``c``: at most ``eps·(A + M)`` overall, whatever the leaves' sizes
  (a weighted average of their errors). Each merge round: the difference of two means, its weight
  and the addition (or, across ``ways`` ranks, ``Σ n_i (mean_i - c)``): at most
  ``eps·(ways·D + 2M)``. The reference ``fsum(x)/n``: ``eps·M``. So
  ``tol_mean = eps·(A + 2M + merges·(ways·D + 2M))``.
* m2, leaf: ``|Δs2| ≤ (n + 2)·eps/2·Σ(x - c)²``; ``|Δ(s1²/n)| ≤ eps·(Σ|x - c|)² + 1.5·eps·Σ(x - c)²
  ≤ (n + 1.5)·eps·Σ(x - c)²`` (Cauchy–Schwarz); the final subtraction ``eps/2·s2``: together at
  most ``5·N·eps·Q``. Each merge round: the rounding of the between-row term
  (``Σ n_i d_i² - (Σ n_i d_i)²/n``, or Chan's ``δ²·n_a n_b/n``; a leaf-like sum of ``ways`` terms:
  ``≤ 3·ways·eps·N·D²``) and of the sum of the rows' ``m2`` (``ways·eps·m2``), and the errors of
  the merged means, which enter it with weight ``2·n_i·|mean_i - mean| ≤ 2·n_i·D``:
  ``2·N·D·tol_mean``. The reference ``fsum((x - mean_ref)²)``: ``2·eps·m2`` from the roundings,
  plus ``N·(eps·M)²`` because ``mean_ref`` is off by up to ``eps·M``. So
  ``tol_m2 = 5·N·eps·Q + merges·(ways·eps·(3·N·D² + m2) + 2·N·D·tol_mean) + 2·eps·m2 + N·(eps·M)²``.
* std ``= sqrt(m2/N)``: ``|√a - √b| ≤ min(√|a - b|, |a - b|/√b)``, plus two roundings on each side:
  ``tol_std = min(sqrt(tol_m2/N), tol_m2/(N·std)) + 2·eps·std``.
* count, min and max are exact: every value reported is the float64 value of a number the test
  knows (float16, bfloat16, float32 and integers below 2**53 convert exactly).

Float32 element arithmetic (``lanes=True``): the ``cpu`` kernel backend computes ``x - c`` and its
square in float32 for float16/bfloat16/float32 tensors and sums them in lanes of at most 32 terms
before a float64 total takes them. With the float32 unit roundoff ``u = 2**-24``: each ``d = x - c``
is off by ``u·|d|``, each ``d²`` by ``3u·d²``, and a lane's sum of at most 32 terms adds ``31u``
of their magnitudes, so a leaf's ``|Δs1| ≤ 32u·Σ|x - c|`` and ``|Δs2| ≤ 34u·Σ(x - c)²``; then
``|Δ(s1²/n)| ≤ 2|s1|·|Δs1|/n ≤ 64u·Q`` (Cauchy–Schwarz). The leaf terms of the bounds gain
``32u·A/n`` (mean; ``A/n`` bounds a leaf's mean ``|x - c|`` for the largest leaf: the whole sample)
and ``100u·Q`` (m2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["EPS", "U32", "Reference", "assert_moments_close", "reference_moments"]

EPS = 2.0**-52  # float64 machine epsilon (spacing of floats in [1, 2))
U32 = 2.0**-24  # float32 unit roundoff


@dataclass(frozen=True)
class Reference:
    """Correctly rounded moments of a sample and the tolerances of a float64 implementation."""

    num: int
    mean: float
    std: float
    min: float
    max: float
    tol_mean: float
    tol_std: float


def _as_floats(values: Iterable[float] | torch.Tensor) -> list[float]:
    if isinstance(values, torch.Tensor):
        return values.detach().to(torch.float64).reshape(-1).tolist()
    return [float(v) for v in values]


def reference_moments(
    values: Iterable[float] | torch.Tensor,
    *,
    shifts: Iterable[float] = (),
    merges: int = 0,
    ways: int = 2,
    lanes: bool = False,
) -> Reference:
    """Moments of ``values`` by ``math.fsum`` and the module docstring's tolerances.

    Args:
        values: the sample (finite; a tensor of any shape and real dtype, or numbers).
        shifts: shifts the implementation may have used besides data values and subset means.
        merges: rounds of merges between the partial results (0: one accumulator).
        ways: the most partial results one round combines (2 for Chan's merge, the world size for
            an all-reduce).
        lanes: some values were float16/bfloat16/float32 tensors accumulated with float32 element
            arithmetic (the ``cpu`` backend; module docstring).

    Raises:
        ValueError: ``values`` is empty or not finite.
    """
    x = _as_floats(values)
    if not x or not all(math.isfinite(v) for v in x):
        raise ValueError(f"reference_moments needs a finite, non-empty sample, got {len(x)} values")
    n = len(x)
    mean = math.fsum(x) / n
    m2 = math.fsum((v - mean) ** 2 for v in x)
    std = math.sqrt(m2 / n)
    span = [*x, *(float(c) for c in shifts)]
    lo, hi = min(span), max(span)
    d, m = hi - lo, max(abs(lo), abs(hi))
    a = math.fsum(max(v - lo, hi - v) for v in x)
    q = math.fsum(max(v - lo, hi - v) ** 2 for v in x)
    tol_mean = EPS * (a + 2 * m + merges * (ways * d + 2 * m)) + (32 * U32 * a / n if lanes else 0.0)
    tol_m2 = (
        5 * n * EPS * q
        + (100 * U32 * q if lanes else 0.0)
        + merges * (ways * EPS * (3 * n * d * d + m2) + 2 * n * d * tol_mean)
        + 2 * EPS * m2
        + n * (EPS * m) ** 2
    )
    tol_std = min(math.sqrt(tol_m2 / n), tol_m2 / (n * std) if std > 0 else math.inf) + 2 * EPS * std
    return Reference(n, mean, std, min(x), max(x), tol_mean, tol_std)


def assert_moments_close(
    got: Mapping[str, float],
    values: Iterable[float] | torch.Tensor | Reference,
    where: str = "",
    **bounds: object,
) -> None:
    """Assert that ``got`` (``num``, ``mean``, ``std``, ``min``, ``max``) matches the reference moments.

    ``num``, ``min`` and ``max`` must be equal; ``mean`` and ``std`` within the derived tolerances.
    ``bounds`` are passed to :func:`reference_moments`.
    """
    ref = values if isinstance(values, Reference) else reference_moments(values, **bounds)  # type: ignore[arg-type]
    prefix = f"{where}: " if where else ""
    assert got["num"] == ref.num, f"{prefix}num {got['num']} != {ref.num}"
    assert (got["min"], got["max"]) == (ref.min, ref.max), (
        f"{prefix}(min, max) {(got['min'], got['max'])} != {(ref.min, ref.max)}"
    )
    for stat, want, tol in (("mean", ref.mean, ref.tol_mean), ("std", ref.std, ref.tol_std)):
        error = abs(got[stat] - want)
        assert error <= tol, (
            f"{prefix}{stat} {got[stat]!r} differs from {want!r} by {error:.3g} > bound {tol:.3g}"
        )
