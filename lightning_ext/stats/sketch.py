"""``LogHistogram``: the quantile sketch of :class:`~lightning_ext.stats.Collector` (DDSketch's
logarithmic buckets over a pinned range, so that sketches merge by an element-wise sum)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np
import torch

__all__ = ["LogHistogram"]


def _check_real(owner: str, arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: `{arg}` must be a float, got {value!r} ({type(value).__name__})")


@dataclasses.dataclass(frozen=True)
class LogHistogram:
    """A fixed-size log-bucket histogram with relative accuracy ``relative_accuracy`` on ``value_range``.

    DDSketch's logarithmic mapping (Masson, Rim & Lee, "DDSketch: A Fast and Fully-Mergeable Quantile
    Sketch with Relative-Error Guarantees", VLDB 2019) with the bucket index range pinned by
    ``value_range``: ``gamma = (1 + alpha) / (1 - alpha)``, bucket ``k`` holds the magnitudes in
    ``(gamma^(k-1), gamma^k]`` for ``k`` from ``ceil(log_gamma(low))`` to ``ceil(log_gamma(high))``,
    one set per sign, plus a zero bucket and an overflow bucket per sign (the layout of the kernel op
    ``accumulate_histogram_``, :mod:`lightning_ext.kernels.histogram`). Two sketches of the same
    parameters merge by adding their counts (float64: exact to ``2**53`` values per bucket), so the
    sketches of every rank ride in one SUM all-reduce.

    Quantiles, by the inverted CDF (NumPy's ``method="inverted_cdf"``: the smallest value whose
    cumulative count reaches ``q n``): a quantile ``v`` with ``low <= |v| <= high`` is estimated within
    ``alpha |v|`` (the bucket's representative ``2 gamma^k / (gamma + 1)``, signed); every estimate is
    clipped to the exact ``[min, max]``. Outside the range: a value with ``|v| < low`` (zeros too)
    falls in the zero bucket and reads as 0 (absolute error below ``low``); one with ``|v| > high``
    (``±inf`` too) in an overflow bucket, which reads as the exact max (or min): only bounded. NaN is
    not counted (the quantiles are those of the other values; ``num``, ``mean`` count NaN).

    Memory: :attr:`size` float64 counts per tracked name (2767, about 22 KB, for the defaults), in each
    device's accumulator, in the flush's SUM payload and in the published sketch.

    Args:
        relative_accuracy: ``alpha``, in ``(0, 0.5)``.
        value_range: ``(low, high)``, ``0 < low < high < inf``.

    Raises:
        TypeError: a parameter is not a real number (or ``value_range`` not a pair).
        ValueError: ``relative_accuracy`` not in ``(0, 0.5)``, or not ``0 < low < high < inf``.

    Example::

        >>> sketch = LogHistogram(relative_accuracy=0.01)
        >>> sketch.size, round(sketch.gamma, 6)
        (2767, 1.020202)
    """

    relative_accuracy: float = 0.01
    value_range: tuple[float, float] = (1e-6, 1e6)

    def __post_init__(self) -> None:
        owner = "LogHistogram"
        _check_real(owner, "relative_accuracy", self.relative_accuracy)
        if not 0.0 < self.relative_accuracy < 0.5:
            raise ValueError(
                f"{owner}: `relative_accuracy` must be in (0, 0.5), got {self.relative_accuracy!r}"
            )
        pair = self.value_range
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(f"{owner}: `value_range` must be a pair (low, high), got {pair!r}")
        for value in pair:
            _check_real(owner, "value_range", value)
        if not 0.0 < pair[0] < pair[1] < math.inf:
            raise ValueError(
                f"{owner}: `value_range` must be (low, high) with 0 < low < high < inf, got {pair!r}"
            )
        object.__setattr__(self, "relative_accuracy", float(self.relative_accuracy))
        object.__setattr__(self, "value_range", (float(pair[0]), float(pair[1])))

    @property
    def gamma(self) -> float:
        """The ratio of consecutive bucket edges, ``(1 + alpha) / (1 - alpha)``."""
        return (1.0 + self.relative_accuracy) / (1.0 - self.relative_accuracy)

    @property
    def first(self) -> int:
        """Index ``k`` of the first bucket, ``ceil(log_gamma(low))``."""
        return math.ceil(math.log(self.value_range[0]) / math.log(self.gamma))

    @property
    def buckets(self) -> int:
        """``m``, the buckets per sign."""
        return math.ceil(math.log(self.value_range[1]) / math.log(self.gamma)) - self.first + 1

    @property
    def size(self) -> int:
        """``2m + 3``, the float64 counts of one histogram."""
        return 2 * self.buckets + 3

    def edges(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float64 ``(m + 1,)``: ``gamma^k`` for ``k = first - 1 .. last``, the upper edges of the zero
        bucket and of the buckets (the ``edges`` of ``accumulate_histogram_``); a normal tensor, even
        when asked for in inference mode."""
        with torch.inference_mode(False):
            k = torch.arange(self.first - 1, self.first + self.buckets, dtype=torch.float64)
            return (k * math.log(self.gamma)).exp_().to(device)

    def quantile(self, counts: np.ndarray, q: float, lo: float, hi: float) -> float:
        """The ``q``-quantile (inverted CDF) estimated from ``counts``; NaN when they are all 0.

        Args:
            counts: float64 ``(size,)`` (NumPy), a merged histogram.
            q: in ``(0, 1)``.
            lo, hi: the exact min and max of the values (the estimate is clipped to them).
        """
        cumulative = np.cumsum(counts)
        n = cumulative[-1]
        if n <= 0:
            return math.nan
        index = n * q - 1  # NumPy's inverted_cdf: the value of 0-based rank ceil(n q - 1), clipped
        rank = min(max(math.floor(index) if index == math.floor(index) else math.floor(index) + 1, 0), n - 1)
        position = int(np.searchsorted(cumulative, rank + 1, side="left"))
        m = self.buckets
        if position == 0:
            return lo
        if position == 2 * m + 2:
            return hi
        j = position - (m + 1)  # signed bucket number, 0 = the zero bucket
        value = (
            0.0
            if j == 0
            else math.copysign(2.0 * self.gamma ** (self.first - 1 + abs(j)) / (self.gamma + 1.0), j)
        )
        return min(max(value, lo), hi) if lo <= hi else value
