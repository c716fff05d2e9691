"""The one interface between ``report()``'s side (:mod:`~lightning_ext.stats.reporting`) and the
collector's side (:mod:`~lightning_ext.stats.collector`): what a collector's values are kept in, in
what layout, and who may touch what.

- An *accumulator row* (the layout of the kernel op ``accumulate_moments_``,
  :mod:`lightning_ext.kernels.moments`): float64 ``[n, S1, S2, min, max, nonfinite]``, the finite
  values' count, sums shifted by the row's *shift* (the first finite value after a reset: NaN until
  then), extremes, and the count of NaN and ``±inf``.
- :class:`Store`: one collector's rows in one order for every device: its agreed names (sorted), then
  the names reported since, and the sketch counts of the sketched ones in the same order; one
  :class:`Slab` of tensors per device its names' values lived on. ``report()``'s side asks
  ``wants(name)`` once per name and stage, then adds values into the views ``accumulator(name,
  device)`` gives (an empty value only makes the row) until the rows move. The collector's side lays
  the rows out for its agreed names (``layout``) and reads them (``extra``, ``local``); after a
  publication the flush's kernels have emptied the rows ``local`` gave when they are the store's own
  (``moments_finish_``, ``pack_windows_``), else it empties them (``reset``). At
  ``reporting._attach`` (the one call of the collector's side into ``report()``'s), ``report()``'s
  side gives the store ``settings()``, the synchronization settings (rank, collective device, process
  group), and ``forget_routes()``, called when rows move.

Nothing here runs a collective or synchronizes host and device, except ``local`` when a collector's
values lived on another device than its collectives (one copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lightning_ext.kernels import KernelBackend, get_backend, moments_from_shifted
from lightning_ext.kernels.moments import EMPTY_ROW, merge_moments
from lightning_ext.stats.sketch import LogHistogram

__all__: list[str] = []  # private: the interface of the two sides of lightning_ext.stats

_MIN_ROWS = 64  # rows of a slab at least (it doubles when full)
_HINTS = 20  # names a store remembers having refused (for Collector.unmatched)


# What report() adds a value into: a name's accumulator row, its shift and its sketch counts (or None)
# in a slab: views, made again when the slab is laid out again (the routes are forgotten then)
Accumulator = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, "Slab"]


class Slab:
    """A store's rows on one device: float64 ``rows`` ``(capacity, 6)``, ``shifts`` ``(capacity,)`` (one
    storage, NaN: no finite value yet, the kernel sets it to the first one) and sketch counts ``hist``, in
    the store's order, with the ``views`` of the agreed ones. Normal tensors (not inference tensors): a
    first value in Lightning's validation loop (inference mode) leaves rows that training values may
    be added into."""

    def __init__(self, device: torch.device, sketch: LogHistogram | None) -> None:
        self.device, self.size = device, sketch.size if sketch is not None else 0
        self.backend: KernelBackend = get_backend(device=device)
        # The ops' eager kernels, called without run()'s checks (report() is never traced: it checked)
        kernel = self.backend.kernel
        self.moments, self.histogram = kernel("accumulate_moments_"), kernel("accumulate_histogram_")
        self.edges = sketch.edges(device) if sketch is not None else None
        self.rows = self.shifts = self.hist = torch.zeros(0, 0)

    @torch.inference_mode(False)
    def layout(self, moved: dict[str, tuple[tuple[int, int | None], tuple[int, int | None]]],
               capacity: tuple[int, int], agreed: tuple[int, int]) -> None:  # fmt: skip
        """Rows for ``capacity`` names and sketches, the rows of the names ``moved`` (``{name: (old
        place, new place)}``, a place ``(row, sketch row or None)``) kept, the others emptied."""
        c, f64 = max(_MIN_ROWS, capacity[0]), {"dtype": torch.float64, "device": self.device}
        self.template = torch.full((7 * c,), math.nan, **f64)  # the rows (c, 6), then the shifts (c,)
        self.template[: 6 * c].view(c, 6).copy_(torch.tensor(EMPTY_ROW, **f64))
        flat = self.template.clone()
        rows, shifts = flat[: 6 * c].view(c, 6), flat[6 * c :]
        hist = torch.zeros(max(8, capacity[1]) if self.size else 0, self.size, **f64)
        for new, old, k in ((rows, self.rows, 0), (shifts, self.shifts, 0), (hist, self.hist, 1)):
            pairs = [(b[k], a[k]) for a, b in moved.values() if b[k] is not None and a[k] < len(old)]
            if pairs:
                new[[b for b, _ in pairs]] = old[[a for _, a in pairs]]
        self.flat, self.rows, self.shifts, self.hist = flat, rows, shifts, hist
        self.views = rows[: agreed[0]], shifts[: agreed[0]], hist[: agreed[1]]

    def reset(self) -> None:
        """Every row empty, every shift NaN, every sketch count zero."""
        self.flat.copy_(self.template)
        self.hist.zero_()


class Store:
    """One collector's accumulators (module docstring).

    Args:
        stage: the stage whose values the collector takes (``None``: outside any stage).
        wants: whether the collector takes a name (of its stage).
        sketched: whether it keeps a sketch of a name it takes.
        sketch: the sketch it keeps (``None``: none).
    """

    def __init__(self, stage: str | None, wants: Callable[[str], bool], sketched: Callable[[str], bool],
                 sketch: LogHistogram | None) -> None:  # fmt: skip
        self.stage, self._wants, self.sketch = stage, wants, sketch
        self.is_sketched = sketched if sketch is not None else lambda name: False
        self.slabs: dict[torch.device, Slab] = {}
        self.places: dict[str, tuple[int, int | None]] = {}  # name -> (row, sketch row or None)
        self.counts = self.agreed = (0, 0)  # (names, sketched names) in all, and agreed
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
        """``name``'s accumulator on ``device``, its rows made if it has none."""
        slab = self.slabs.get(device)
        if slab is None:
            slab = self.slabs[device] = Slab(device, self.sketch)
            slab.layout({n: (p, p) for n, p in self.places.items()}, self.counts, self.agreed)
        i, j = self.places.get(name) or self._add(name)
        if i >= len(slab.rows) or (j is not None and j >= len(slab.hist)):
            slab.layout({n: (p, p) for n, p in self.places.items()}, (2 * len(slab.rows), 2 * len(slab.hist)),
                        self.agreed)  # fmt: skip
            self.forget_routes()
        with torch.inference_mode(False):
            return slab.rows[i], slab.shifts[i], None if j is None else slab.hist[j], slab

    def _add(self, name: str) -> tuple[int, int | None]:
        n, q = self.counts
        place = self.places[name] = (n, q if self.is_sketched(name) else None)
        self.counts = (n + 1, q + (place[1] is not None))
        return place

    def backend(self, device: torch.device) -> KernelBackend:
        """The kernel backend of ``device``: its slab's (resolved at its first value), else resolved now."""
        slab = self.slabs.get(device)
        return slab.backend if slab is not None else get_backend(device=device)

    def extra(self) -> list[str]:
        """The names reported here (with values or empty) that are not agreed yet."""
        if self.counts == self.agreed:  # the steady state: no Python per name
            return []
        return [n for n, p in self.places.items() if p[0] >= self.agreed[0]]

    def layout(self, names: list[str]) -> None:
        """Lay the rows out for the agreed ``names`` (sorted), dropping the rows of other names."""
        sketched = [n for n in names if self.is_sketched(n)]
        where = {n: j for j, n in enumerate(sketched)}
        places = {n: (i, where.get(n)) for i, n in enumerate(names)}
        moved = {n: (self.places[n], p) for n, p in places.items() if n in self.places}
        self.places, self.counts = places, (len(names), len(sketched))
        self.agreed = self.counts
        for slab in self.slabs.values():
            slab.layout(moved, self.counts, self.agreed)
        self.forget_routes()

    def local(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """This process's accumulator rows ``(R, 6)``, shifts ``(R,)`` and sketch counts ``(Q, size)`` of
        the agreed names on ``device``, contiguous, and whether they are the slab's own: views when it is
        the only one and on ``device``, else the merge of every slab's (Chan's merge, about each name's
        mean)."""
        slabs = list(self.slabs.values())
        if len(slabs) == 1 and slabs[0].device == device:
            return (*slabs[0].views, True)
        (r, q), size = self.agreed, self.sketch.size if self.sketch is not None else 0
        moments = torch.tensor(EMPTY_ROW[:5], dtype=torch.float64, device=device).repeat(r, 1)
        nonfinite, hist = moments.new_zeros(r), moments.new_zeros(q, size)
        for slab in slabs:
            rows, shifts, counts = slab.views
            moments = merge_moments(moments, moments_from_shifted(rows, shifts).to(device))
            nonfinite += rows[:, 5].to(device)
            hist += counts.to(device)
        n, mean, m2, lo, hi = moments.unbind(1)  # (mean: a strided view, made contiguous below)
        return torch.stack([n, torch.zeros_like(n), m2, lo, hi, nonfinite], 1), mean.contiguous(), hist, False

    def reset(self) -> None:
        """Every row empty and every sketch count zero (``discard``; after a publication whose
        ``moments_finish_`` did not empty the rows)."""
        for slab in self.slabs.values():
            slab.reset()

    def detach(self) -> None:
        """Forget every value (``clear_statistics``): the collector receives nothing more."""
        self.slabs.clear()
        self.layout([n for n, (i, _) in self.places.items() if i < self.agreed[0]])
