"""The one interface between ``report()``'s side (:mod:`~lightning_ext.stats.reporting`) and the
collector's side (:mod:`~lightning_ext.stats.collector`): what a collector's values are kept in, in
what layout, and who may touch what.

- An *accumulator row* (the layout of the kernel op ``accumulate_moments_``,
  :mod:`lightning_ext.kernels.moments`): float64 ``[n, S1, S2, min, max, nonfinite]``, the finite
  values' count, sums shifted by the row's *shift* (the first value after a reset, 0 if not finite),
  extremes, and the count of NaN and ``±inf``.
- :class:`Store`: one collector's rows, one :class:`Slab` per device its names' values lived on.
  ``report()``'s side asks ``wants(name)`` once per name and stage, then adds values through
  ``accumulator(name, device).add(x)`` (an empty value only makes the row). The collector's
  side lays the rows out in the order of its agreed names (``layout``), reads them (``extra``,
  ``local``) and empties them after a publication (``reset``). At ``reporting._attach`` (the one call
  of the collector's side into ``report()``'s), ``report()``'s side gives the store two functions:
  ``settings()``, the synchronization settings (rank, collective device, process group), and
  ``forget_routes()``, called when rows are dropped.
- :func:`merge_moments` and :func:`check_label`, shared by both sides.
- How a sketch's window travels in the SUM: at most ``WORDS`` float64 per name, its integer counts
  packed several to a word (:func:`packing`, :func:`pack`, :func:`unpack`).

Nothing here runs a collective or synchronizes host and device, except ``local`` when a collector's
values lived on another device than its collectives (one copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_ext.kernels import KernelBackend, get_backend, moments_from_shifted
from lightning_ext.stats.sketch import LogHistogram

__all__ = ["merge_moments"]  # the one public name here, re-exported by lightning_ext.stats

EMPTY_ROW = (0.0, 0.0, 0.0, math.inf, -math.inf, 0.0)  # an accumulator row without values
WORDS = 640  # float64 words of one name's sketch window in the SUM at most: 5 KiB
_MIN_ROWS = 64  # rows of a slab at least (it doubles when full)
_HINTS = 20  # names a store remembers having refused (for Collector.unmatched)


def check_label(owner: str, arg: str, value: Any) -> None:
    """``TypeError``/``ValueError`` naming ``owner`` and ``arg`` unless ``value`` is a non-empty str of
    printable characters (a statistic's name, a stage): no control character such as ``"\\n"``."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}: `{arg}` must be a str, got {type(value).__name__} {value!r:.80}")
    if not value or not value.isprintable():
        raise ValueError(
            f"{owner}: `{arg}` must be a non-empty str of printable characters, without control "
            f"characters such as '\\n' or '\\x1f', got {value!r:.80}"
        )


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


def packing(bound: float) -> tuple[int, int]:
    """``(f, k)``: bits per count and counts per float64 word for counts of at most ``bound`` (a sum over
    ranks of integers below ``2^f`` never carries into the next field, and ``k f <= 53``)."""
    bits = max(1, int(bound).bit_length())
    return bits, max(1, 53 // bits)


def pack(counts: np.ndarray, bits: int, k: int) -> np.ndarray:
    """float64 ``(N, L / k)`` words holding the integer counts ``(N, L)`` (``L`` a multiple of ``k``),
    ``k`` fields of ``bits`` bits each: exact, and the sum of packed words is the packed sum."""
    fields = counts.astype(np.int64).reshape(len(counts), -1, k) << (bits * np.arange(k))
    return fields.sum(2).astype(np.float64)


def unpack(words: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The float64 counts ``(N, L)`` of :func:`pack`'s words ``(N, L / k)``."""
    fields = (words.astype(np.int64)[:, :, None] >> (bits * np.arange(k))) & ((1 << bits) - 1)
    return fields.reshape(len(words), -1).astype(np.float64)


class Accumulator:
    """One name's row (and sketch counts) in one slab: what ``report()`` adds a value into."""

    __slots__ = ("hist", "row", "shift", "slab", "stamp")

    def __init__(self, slab: Slab) -> None:
        self.slab, self.stamp = slab, -1  # stamp: the slab's resets when the shift was set

    def add(self, x: torch.Tensor) -> None:
        """Add the non-empty countable tensor ``x`` (on the slab's device): one op, two with a sketch."""
        slab = self.slab
        if self.stamp != slab.resets:  # the first value since the last reset sets the shift
            self.stamp = slab.resets
            self.shift.copy_(x.reshape(-1)[0]).nan_to_num_(0.0, 0.0, 0.0)
        slab.moments(self.row, x, self.shift)
        if self.hist is not None:
            slab.histogram(self.hist, x, slab.edges)


class Slab:
    """A store's rows on one device: float64 ``rows`` ``(capacity, 6)`` and ``shifts`` ``(capacity,)``
    in the order of ``names`` (the store's agreed names first, then the names new here), and the sketch
    counts ``hist`` of the sketched ones in the order of ``sketched``. Normal tensors (not inference
    tensors): a first value in Lightning's validation loop (inference mode) leaves rows that training
    values may be added into."""

    def __init__(self, device: torch.device, sketch: LogHistogram | None) -> None:
        self.device, self.sketch, self.resets = device, sketch, 0
        self.backend: KernelBackend = get_backend(device=device)
        # The ops' eager kernels, called without run()'s checks (report() is never traced: it checked)
        self.moments, self.histogram = map(
            self.backend.kernel, ("accumulate_moments_", "accumulate_histogram_")
        )
        self.edges = sketch.edges(device) if sketch is not None else None
        self.names: list[str] = []
        self.sketched: list[str] = []
        self.accumulators: dict[str, Accumulator] = {}
        self.layout([], [])

    @torch.inference_mode(False)
    def layout(self, names: list[str], sketched: list[str], grow: bool = False) -> bool:
        """Rows for ``names`` in this order and sketch rows for ``sketched`` (the sketched ones of
        ``names``), their values kept; twice the rows with ``grow``. Whether a name was dropped."""
        f64 = {"dtype": torch.float64, "device": self.device}
        capacity = max(_MIN_ROWS, len(names), 2 * len(self.names) if grow else 0)
        template = torch.tensor(EMPTY_ROW, **f64).repeat(capacity, 1)
        rows, shifts = template.clone(), torch.zeros(capacity, **f64)
        size = self.sketch.size if self.sketch is not None else 0
        hist = torch.zeros(
            max(8, len(sketched), 2 * len(self.sketched) if grow else 0) if size else 0, size, **f64
        )
        for new, old, new_names, old_names in ((rows, "rows", names, self.names),
                                               (shifts, "shifts", names, self.names),
                                               (hist, "hist", sketched, self.sketched)):  # fmt: skip
            index = {n: i for i, n in enumerate(old_names)}
            kept = [(i, index[n]) for i, n in enumerate(new_names) if n in index]
            if kept:
                dst, src = (torch.tensor(ix, device=self.device) for ix in zip(*kept))
                new[dst] = getattr(self, old)[src]
        self.rows, self.shifts, self.hist, self.template = rows, shifts, hist, template
        self.names, self.sketched = list(names), list(sketched)
        dropped = self.accumulators.keys() - set(names)
        self.accumulators = {n: a for n, a in self.accumulators.items() if n not in dropped}
        where = {n: j for j, n in enumerate(sketched)}
        for i, name in enumerate(self.names):
            if name in self.accumulators:
                self._point(self.accumulators[name], i, where.get(name))
        return bool(dropped)

    def _point(self, accumulator: Accumulator, i: int, j: int | None) -> None:
        accumulator.row, accumulator.shift = self.rows[i], self.shifts[i]
        accumulator.hist = None if j is None else self.hist[j]

    def accumulator(self, name: str, sketched: bool) -> Accumulator:
        """``name``'s accumulator, made (a new row at the end) if it has none."""
        accumulator = self.accumulators.get(name)
        if accumulator is None:
            if len(self.names) == self.rows.shape[0] or (
                sketched and len(self.sketched) == self.hist.shape[0]
            ):
                self.layout(self.names, self.sketched, grow=True)
            self.names.append(name)
            self.sketched += [name] if sketched else []
            accumulator = self.accumulators[name] = Accumulator(self)
            with torch.inference_mode(False):
                self._point(accumulator, len(self.names) - 1, len(self.sketched) - 1 if sketched else None)
        return accumulator

    def reset(self, cleared: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Every row empty (on the CPU, of the sketch counts those at ``cleared``'s rows and columns,
        where the only values were); the next value of each name sets its shift."""
        self.rows.copy_(self.template)
        if cleared is not None and self.device.type == "cpu":
            self.hist.numpy()[cleared] = 0.0
        elif self.hist.numel():
            self.hist.zero_()
        self.resets += 1


class Store:
    """One collector's accumulators (module docstring).

    Args:
        stage: the stage whose values the collector takes (``None``: outside any stage).
        wants: whether the collector takes a name (of its stage).
        sketched: whether it keeps a sketch of a name it takes.
        sketch: the sketch it keeps (``None``: none).
    """

    def __init__(
        self, stage: str | None, wants: Callable[[str], bool], sketched: Callable[[str], bool],
        sketch: LogHistogram | None,
    ) -> None:  # fmt: skip
        self.stage, self._wants, self.is_sketched, self.sketch = stage, wants, sketched, sketch
        self.slabs: dict[torch.device, Slab] = {}
        self.names: list[str] = []  # the agreed names: the first rows of every slab
        self.sketched: list[str] = []  # those with a sketch, in order
        self.refused: list[str] = []  # the first names of this stage the collector did not take
        self.settings: Callable[[], Any] = lambda: None  # set by reporting._attach
        self.forget_routes: Callable[[], None] = lambda: None  # set by reporting._attach

    def wants(self, name: str) -> bool:
        """Whether the collector takes ``name`` (asked once per name by ``report()``'s side)."""
        wanted = self._wants(name)
        if not wanted and len(self.refused) < _HINTS:
            self.refused.append(name)
        return wanted

    def accumulator(self, name: str, device: torch.device) -> Accumulator:
        slab = self.slabs.get(device)
        if slab is None:
            slab = self.slabs[device] = Slab(device, self.sketch)
            slab.layout(self.names, self.sketched)
        return slab.accumulator(name, self.sketch is not None and self.is_sketched(name))

    def backend(self, device: torch.device) -> KernelBackend:
        """The kernel backend of ``device``: its slab's (resolved at its first value), else resolved now."""
        slab = self.slabs.get(device)
        return slab.backend if slab is not None else get_backend(device=device)

    def extra(self) -> list[str]:
        """The names reported here (with values or empty) that are not agreed yet, sorted."""
        r = len(self.names)
        return sorted({n for slab in self.slabs.values() for n in slab.names[r:]})

    def layout(self, names: list[str]) -> None:
        """Lay every slab out for the agreed ``names`` (sorted), dropping the rows of other names."""
        self.names = list(names)
        self.sketched = [n for n in names if self.is_sketched(n)] if self.sketch is not None else []
        if any([slab.layout(self.names, self.sketched) for slab in self.slabs.values()]):
            self.forget_routes()

    def local(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This process's accumulator rows ``(R, 6)``, shifts ``(R,)`` and sketch counts ``(Q, size)`` of
        the agreed names on ``device``: views of the slab's rows when it is the only one and on
        ``device``, else the merge of every slab's (Chan's merge, about each name's mean)."""
        r, q = len(self.names), len(self.sketched)
        slabs = list(self.slabs.values())
        if len(slabs) == 1 and slabs[0].device == device:
            return slabs[0].rows[:r], slabs[0].shifts[:r], slabs[0].hist[:q]
        moments = torch.tensor(EMPTY_ROW[:5], dtype=torch.float64, device=device).repeat(r, 1)
        nonfinite = moments.new_zeros(r)
        hist = moments.new_zeros(q, self.sketch.size if self.sketch is not None else 0)
        for slab in slabs:
            rows = slab.rows[:r]
            moments = merge_moments(moments, moments_from_shifted(rows, slab.shifts[:r]).to(device))
            nonfinite += rows[:, 5].to(device)
            hist += slab.hist[:q].to(device)
        n, mean, m2, lo, hi = moments.unbind(1)
        return torch.stack([n, torch.zeros_like(n), m2, lo, hi, nonfinite], 1), mean, hist

    def reset(self, cleared: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """After a publication: every row empty (``cleared``: the sketch rows and columns that held
        values, ``(P, 1)`` and ``(P, L)``; ``None``: every count)."""
        for slab in self.slabs.values():
            slab.reset(cleared if len(self.slabs) == 1 else None)

    def detach(self) -> None:
        """Forget every value (``clear_statistics``): the collector receives nothing more."""
        self.slabs.clear()
