"""``LogHistogram``: the quantile sketch of :class:`~lightning_ext.stats.Collector` (DDSketch's
logarithmic buckets over a pinned range, merged by an element-wise sum) and its quantiles. A flush sends
a window of its buckets, collapsed where the window is wide, its counts packed several to a float64
(the kernel op ``pack_windows_``, :mod:`lightning_ext.kernels.histogram`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import torch

from lightning_ext._checks import check_number

__all__ = ["LogHistogram"]

_MAX_SIZE = 1 << 20  # counts of one sketch at most (8 MiB of float64)


@dataclasses.dataclass(frozen=True)
class LogHistogram:
    """A fixed-size log-bucket histogram with relative accuracy ``relative_accuracy`` on ``value_range``.

    DDSketch's logarithmic mapping (Masson, Rim & Lee, "DDSketch: A Fast and Fully-Mergeable Quantile
    Sketch with Relative-Error Guarantees", VLDB 2019) with the bucket index range pinned by
    ``value_range``: ``gamma = (1 + alpha) / (1 - alpha)``, bucket ``k`` holds the magnitudes in
    ``(gamma^(k-1), gamma^k]`` for ``k`` from ``ceil(log_gamma(low))`` to ``ceil(log_gamma(high))``,
    one set per sign, plus a zero bucket and an overflow bucket per sign (the layout of the kernel op
    ``accumulate_histogram_``, :mod:`lightning_ext.kernels.histogram`), finite values only. Sketches of
    the same parameters merge by adding their counts.

    Each device keeps the whole layout of a sketched name (:attr:`size` float64 counts); a flush sends
    only the *window* of buckets between the interval's min and max over all ranks (known from the
    flush's MAX reduction, so every rank cuts the same window): one-sided for a name whose values are
    all of one sign, through the zero bucket otherwise. Where the window holds more buckets than fit in
    5 KiB, it is *collapsed* (UDDSketch's uniform collapse: Epicoco, Melle, Cafaro, Pulimeno & Morleo,
    "UDDSketch: Accurate Tracking of Quantiles in Data Streams", IEEE Access 2020): at level ``c``, each
    bucket merges ``2^c`` neighbours, ``gamma_c = gamma^(2^c)``, relative accuracy ``alpha_c =
    (gamma_c - 1) / (gamma_c + 1)`` (about ``2^c alpha``): the smallest level whose window fits. The
    counts travel as integers packed ``k`` to a float64 (``f`` bits each, ``f`` the bits of a bound on
    the interval's count: world size times the largest count of a rank; ``k = 53 // f``), so an
    interval of fewer than ``2^13`` values per name (``k = 4``) sends 2,560 buckets in 5 KiB: the whole
    default range of one sign, or both signs for magnitudes from ``1e-6`` to ``1e5``.

    Quantiles, by the inverted CDF (NumPy's ``method="inverted_cdf"``: the smallest value whose
    cumulative count reaches ``q n``): a quantile ``v`` with ``low <= |v| <= high`` is estimated within
    ``alpha_c |v|`` (the bucket's representative ``2 gamma_c^k / (gamma_c + 1)``, signed); every
    estimate is clipped to the exact ``[min, max]``. Outside the range: a value with ``|v| < low`` (zeros
    too) falls in the zero bucket and reads as 0 (absolute error below ``low``); one with ``|v| > high``
    in an overflow bucket, which reads as the exact max (or min): only bounded.

    Args:
        relative_accuracy: ``alpha``, in ``(0, 0.5)``.
        value_range: ``(low, high)``, ``0 < low < high < inf``.

    Raises:
        TypeError: a parameter is not a finite number (or ``value_range`` not a pair).
        ValueError: ``relative_accuracy`` not in ``(0, 0.5)``, or not ``0 < low < high``, or the sketch
            would hold more than ``2**20`` counts (8 MiB per name and device).

    Example::

        >>> sketch = LogHistogram(relative_accuracy=0.01)
        >>> sketch.size, round(sketch.gamma, 6), round(sketch.accuracy(1), 4)
        (2767, 1.020202, 0.02)
    """

    relative_accuracy: float = 0.01
    value_range: tuple[float, float] = (1e-6, 1e6)

    def __post_init__(self) -> None:
        owner, pair = "LogHistogram", self.value_range
        check_number(owner, "relative_accuracy", self.relative_accuracy, gt=0.0, lt=0.5)
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(f"{owner}: `value_range` must be a pair (low, high), got {pair!r}")
        check_number(owner, "value_range[0]", pair[0], gt=0.0)
        check_number(owner, "value_range[1]", pair[1], gt=pair[0])
        object.__setattr__(self, "relative_accuracy", float(self.relative_accuracy))
        object.__setattr__(self, "value_range", (float(pair[0]), float(pair[1])))
        if self.size > _MAX_SIZE:
            raise ValueError(
                f"{owner}: relative_accuracy={self.relative_accuracy!r} over value_range={pair!r} needs "
                f"{self.size} counts ({self.size * 8 / 2**20:.4g} MiB per name and device); at most "
                f"{_MAX_SIZE} are allowed. HINT: a larger relative_accuracy or a narrower value_range"
            )

    @functools.cached_property
    def gamma(self) -> float:
        """The ratio of consecutive bucket edges, ``(1 + alpha) / (1 - alpha)``."""
        return (1.0 + self.relative_accuracy) / (1.0 - self.relative_accuracy)

    @functools.cached_property
    def first(self) -> int:
        """Index ``k`` of the first bucket, ``ceil(log_gamma(low))``."""
        return math.ceil(math.log(self.value_range[0]) / math.log(self.gamma))

    @functools.cached_property
    def buckets(self) -> int:
        """``m``, the buckets per sign."""
        return math.ceil(math.log(self.value_range[1]) / math.log(self.gamma)) - self.first + 1

    @functools.cached_property
    def size(self) -> int:
        """``2m + 3``, the float64 counts of one histogram."""
        return 2 * self.buckets + 3

    def accuracy(self, level: int) -> float:
        """``alpha_c``, the relative accuracy of the buckets at collapse level ``level`` (0: ``alpha``)."""
        g = self.gamma ** (1 << level)
        return (g - 1.0) / (g + 1.0)

    def edges(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float64 ``(m + 1,)``: ``gamma^k`` for ``k = first - 1 .. last``, the upper edges of the zero
        bucket and of the buckets (the ``edges`` of ``accumulate_histogram_``); a normal tensor, even
        when asked for in inference mode."""
        with torch.inference_mode(False):
            k = torch.arange(self.first - 1, self.first + self.buckets, dtype=torch.float64)
            return (k * math.log(self.gamma)).exp_().to(device)

    def _groups(self, level: int) -> int:
        """``M_c``: the buckets per sign at collapse level ``level``."""
        return -(-self.buckets // (1 << level))

    def quantile(self, level: int, start: int, window: np.ndarray, q: Any, lo: float, hi: float) -> Any:
        """The ``q``-quantile (inverted CDF) of the counts ``window`` of the buckets from position
        ``start`` at collapse level ``level``; NaN when they are all 0. A list or tuple ``q`` gives a list,
        from one pass over the counts.

        Args:
            level, start: the window's collapse level and first bucket (``pack_windows_``).
            window: float64 ``(L,)`` (NumPy), merged counts.
            q: in ``(0, 1)``, or a list or tuple of them.
            lo, hi: the exact min and max of the values (the estimate is clipped to them).
        """
        qs = q if isinstance(q, list | tuple) else [q]
        cumulative = window.cumsum()  # (the methods: half the time of np.cumsum's dispatch)
        n = float(cumulative[-1]) if cumulative.size else 0.0  # (Python numbers from here: cheaper)
        # NumPy's inverted_cdf: the value of 0-based rank ceil(n q - 1), clipped
        ranks = [min(max(math.ceil(n * p - 1), 0), n - 1) + 1 for p in qs]
        found = cumulative.searchsorted(ranks).tolist() if n > 0 else [None] * len(qs)
        values = [math.nan if b is None else self.value(level, start + b, lo, hi) for b in found]
        return values if qs is q else values[0]

    def value(self, level: int, position: int, lo: float, hi: float) -> float:
        """The estimate of the bucket at ``position`` of the layout at collapse level ``level``: its
        representative ``2 gamma_c^k / (gamma_c + 1)``, signed (0 in the zero bucket), clipped to
        ``[lo, hi]``; ``lo`` or ``hi`` in an overflow bucket."""
        step, groups = 1 << level, self._groups(level)
        g = position - groups - 1
        if abs(g) > groups:  # an overflow bucket
            return lo if g < 0 else hi
        value = 2.0 * self.gamma ** (self.first - 1 + abs(g) * step) / (self.gamma**step + 1.0)
        return min(max(math.copysign(value, g) if g else 0.0, lo), hi)

    def limits(self, level: int) -> np.ndarray:
        """float64 ``(2 M_c + 4,)``: the bucket limits of the layout at ``level``, ``-inf .. +inf`` (bucket
        ``p`` between limits ``p`` and ``p + 1``; the zero bucket between ``-e_0`` and ``e_0``); read-only,
        made once per level (a histogram read slices it)."""
        limits = self._limits.get(level)
        if limits is None:
            edges = self.edges().numpy()  # (made once per level)
            edges = edges[np.minimum(np.arange(self._groups(level) + 1) << level, self.buckets)]
            limits = self._limits[level] = np.concatenate(([-np.inf], -edges[::-1], edges, [np.inf]))
            limits.flags.writeable = False
        return limits

    @functools.cached_property
    def _limits(self) -> dict[int, np.ndarray]:
        return {}
