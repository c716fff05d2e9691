"""``Collector``: reduce the values reported since its last ``update()`` across devices and ranks."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

import torch
import torch.distributed as dist

from lightning_ext.distributed import all_reduce_
from lightning_ext.stats import reporting as _report
from lightning_ext.stats.moments import (
    empty_moments,
    fingerprint,
    merge_moments,
    moments_from_allreduce,
    needs_recentering,
    shifted_for_allreduce,
)

__all__ = ["Collector"]

_NAN_VALUES = (0, math.nan, math.nan, math.nan, math.nan)  # (num, mean, std, min, max) of an empty name
_COMPACT_AFTER = 16  # merge received tables once this many are waiting (bounds memory between updates)


class Collector:
    """Collect the statistics reported with :func:`~lightning_ext.stats.report` whose names match ``regex``.

    ``update()`` takes everything reported since this collector's previous ``update()`` (or its
    creation) on every device of this process, reduces it across ranks, and publishes, per name,
    the count, mean, population standard deviation (divide by ``num``, as NVIDIA's
    ``training_stats``), min and max. Several collectors with different regexes and update periods
    coexist: each sees every value once.

    Distributed protocol (``update()`` must be called on every rank of the group, in the same order
    relative to other collectors' updates). Two all-reduces are launched together (async) over the
    R names agreed at the previous update, so their lengths match on every rank:

    * MAX of ``[fp, -fp, max_1..max_R, -min_1..-min_R, mean_1..mean_R, -mean_1..-mean_R]`` where
      ``fp`` is a 48-bit fingerprint of the sorted names this rank knows now (ranks without values
      for a name send ``-inf``). All ranks know the same set iff ``max(fp) == -max(-fp)``.
    * SUM of ``[count, m2, count·d, count·d²]`` per name, ``d = mean - c``, around the shift ``c`` =
      the global mean published by the previous update (identical on every rank). The global
      ``m2`` is Chan's merge ``Σ m2_i + Σ n_i d_i² - (Σ n_i d_i)² / n`` (Chan, Golub & LeVeque
      1979/1983): the within-rank part never cancels; the between-rank part is exactly 0 when all
      rank means are equal (e.g. one rank had values), and its rounding error is bounded by
      ``eps · n · d_max²``. In the rare interval where that bound exceeds 1e-10 of ``m2`` (a mean
      jumped by ~1e3 standard deviations since the previous update) the SUM is redone around the
      largest rank mean from the MAX, which lies inside the data range.

    If the name sets differ (some rank saw a new name), one ``all_gather_object`` agrees on the
    sorted union (not needed when every rank saw the same new names), and the MAX then SUM are
    redone with aligned rows, the SUM around the largest rank mean. So the steady state costs two
    all-reduces (one round trip, as they overlap) whatever the number of names. Over a gloo group
    whose ranks share a host, the all-reduces go through shared memory
    (:func:`lightning_ext.distributed.all_reduce_`). Per-device partial
    results are merged locally first (see :mod:`lightning_ext.stats.moments`). Every rank computes
    the same numbers from the same reduced tensors, so the published statistics are identical on all
    ranks. Without ``torch.distributed`` (or after ``init_multiprocessing(rank, None)``) there are no
    collectives.

    Args:
        regex: names to collect (``re.fullmatch``).
        keep_previous: a name that received no value in an interval keeps its previous statistics
            (NaN only if it never had values); with ``False`` it becomes NaN.

    Raises:
        TypeError: ``regex`` is not a str or ``keep_previous`` not a bool.
        ValueError: ``regex`` does not compile.

    Example::

        >>> from lightning_ext.stats import Collector, report, reset
        >>> reset(); c = Collector(regex="Loss/.*")
        >>> _ = report("Loss/total", [1.0, 2.0, 3.0]); _ = report("Other", 5.0)
        >>> c.update(); c.names(), c.mean("Loss/total"), round(c.std("Loss/total"), 4)
        (['Loss/total'], 2.0, 0.8165)
        >>> c.update(); c["Loss/total"]  # keep_previous=True: nothing new, previous values kept
        2.0
    """

    def __init__(self, regex: str = ".*", keep_previous: bool = True) -> None:
        if not isinstance(regex, str):
            raise TypeError(f"Collector(regex=...) must be a str, got {type(regex).__name__} {regex!r}")
        if not isinstance(keep_previous, bool):
            raise TypeError(f"Collector(keep_previous=...) must be a bool, got {keep_previous!r}")
        try:
            self._pattern = re.compile(regex)
        except re.error as err:
            raise ValueError(
                f"Collector(regex=...) is not a valid regular expression: {regex!r} ({err})"
            ) from None
        self.regex = regex
        self.keep_previous = keep_previous
        self._init_state()
        _report._register(self)

    def _init_state(self) -> None:
        self._match_cache: dict[str, bool] = {}  # name => regex matches
        self._tables: list[_report._Table] = []  # drained tables received since the last update
        self._seen: set[str] = set()  # names this rank has had (matching), ever
        self._agreed: list[str] = []  # sorted name union agreed across ranks at the last update
        self._agreed_set: set[str] = set()
        # name => (num, mean, std, min, max) published by the last update
        self._values: dict[str, tuple[int, float, float, float, float]] = {}
        self._shift: dict[str, float] = {}  # name => last published global mean (shift of the next SUM)

    # -------------------------------------------------------------------------------- registry hooks

    def _matches(self, name: str) -> bool:
        match = self._match_cache.get(name)
        if match is None:
            match = self._match_cache[name] = self._pattern.fullmatch(name) is not None
        return match

    def _receive(self, table: _report._Table) -> None:
        self._tables.append(table)
        if len(self._tables) >= _COMPACT_AFTER:
            self._tables = [self._combine()]

    def _detach(self) -> None:
        self._tables = []

    def _discard(self) -> None:
        """Drop what was reported since the last update, locally (no collective; e.g. sanity checks)."""
        _report._drain()
        self._tables = []

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tables"] = []  # pending values stay in the process that reported them
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _report._register(self)

    # -------------------------------------------------------------------------------- update

    def _combine(self) -> _report._Table:
        """Merge the received tables into one table restricted to the names this collector matches."""
        tables = self._tables
        if len(tables) == 1 and all(self._matches(n) for n in tables[0].names):
            return tables[0]
        names = sorted({n for t in tables for n in t.names if self._matches(n)})
        if not tables:
            return _report._Table(names, empty_moments(0))
        device = tables[0].rows.device
        index = {name: i for i, name in enumerate(names)}
        rows = empty_moments(len(names), device)
        for table in tables:
            pairs = [(index[n], i) for i, n in enumerate(table.names) if self._matches(n)]
            if not pairs:
                continue
            dst = torch.tensor([p[0] for p in pairs], device=device)
            src = torch.tensor([p[1] for p in pairs], device=table.rows.device)
            rows[dst] = merge_moments(rows[dst], table.rows[src].to(device))
        return _report._Table(names, rows)

    @staticmethod
    def _aligned(names: list[str], local: _report._Table, device: torch.device) -> torch.Tensor:
        """Local moment rows in the order of ``names`` (empty rows for names without local values)."""
        if local.names == names:  # steady state: every name had values here
            return local.rows.to(device)
        rows = empty_moments(len(names), device)
        pairs = [(i, local.index[n]) for i, n in enumerate(names) if n in local.index]
        if pairs:
            dst = torch.tensor([p[0] for p in pairs], device=device)
            src = torch.tensor([p[1] for p in pairs], device=local.rows.device)
            rows[dst] = local.rows[src].to(device)
        return rows

    @staticmethod
    def _max_payload(fp: float, rows: torch.Tensor) -> torch.Tensor:
        head = torch.tensor([fp, -fp], dtype=torch.float64, device=rows.device)
        has = rows[:, 0] > 0
        ninf = torch.full_like(rows[:, 1], -math.inf)
        mean, neg_mean = torch.where(has, rows[:, 1], ninf), torch.where(has, -rows[:, 1], ninf)
        return torch.cat([head, rows[:, 4], -rows[:, 3], mean, neg_mean])

    def update(self) -> None:
        """Reduce everything reported since the last ``update()`` and publish it (see the class doc).

        Must be called on every rank. Synchronizes host and device (it reads the fingerprint head
        of the MAX all-reduce and the final statistics) and issues two collectives on the sync
        device (three to five when the name set changed, see the class docstring).
        """
        _report._drain()
        local = self._combine()
        self._tables = []
        self._seen.update(local.names)
        _rank, device, group = _report._sync_settings()
        world_size = _report._world_size(device, group)
        if self._seen <= self._agreed_set:
            candidate = self._agreed
        else:
            candidate = sorted(self._agreed_set | self._seen)
        device = device if device is not None else local.rows.device
        if world_size > 1:
            names, rows = self._reduce(candidate, local, device, group, world_size)
        else:
            names, rows = candidate, self._aligned(candidate, local, device)
        self._agreed = names
        self._agreed_set = set(names)
        self._publish(names, rows)

    def _shifts(self, names: list[str], device: torch.device) -> torch.Tensor:
        """Per name, the last published global mean (identical on every rank), 0 if none yet."""
        return torch.tensor([self._shift.get(n, 0.0) for n in names], dtype=torch.float64, device=device)

    def _reduce(
        self, candidate: list[str], local: _report._Table, device: torch.device, group: Any, world_size: int
    ) -> tuple[list[str], torch.Tensor]:
        """The protocol of the class docstring; returns (agreed names, global moment rows)."""
        # Rows follow the names agreed at the previous update (same length on every rank); the head
        # carries the fingerprint of the names this rank knows now. The SUM uses the previous
        # global means as shifts, so both all-reduces are in flight at once.
        names = self._agreed
        rows = self._aligned(names, local, device)
        payload = self._max_payload(fingerprint(candidate), rows)
        works = [all_reduce_(payload, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        shift = self._shifts(names, device)
        sums = shifted_for_allreduce(rows, shift)
        if names:
            works.append(all_reduce_(sums, op=dist.ReduceOp.SUM, group=group, async_op=True))
        for work in works:
            work.wait()
        fp_max, neg_fp_min = payload[:2].tolist()  # host sync; identical on every rank
        if fp_max != -neg_fp_min:  # ranks know different name sets: agree on the sorted union
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, candidate, group=group)
            names = sorted(set().union(*gathered))
        elif candidate != names:  # every rank saw the same new names: no need to gather them
            names = candidate
        if not names:
            return names, empty_moments(0, device)
        r = len(names)
        if names is not self._agreed:  # same decision on every rank (it follows from the reduced head)
            rows = self._aligned(names, local, device)
            payload = self._max_payload(fingerprint(names), rows)
            all_reduce_(payload, op=dist.ReduceOp.MAX, group=group)
            shift = payload[2 + 2 * r : 2 + 3 * r]  # the largest rank mean: inside the data range
            sums = shifted_for_allreduce(rows, shift)
            all_reduce_(sums, op=dist.ReduceOp.SUM, group=group)
        hi, lo = payload[2 : 2 + r], -payload[2 + r : 2 + 2 * r]
        mean_max, neg_mean_min = payload[2 + 2 * r : 2 + 3 * r], payload[2 + 3 * r :]
        spread = mean_max + neg_mean_min
        result = moments_from_allreduce(sums, shift, lo, hi, spread)
        c = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        distance = torch.maximum(mean_max - c, neg_mean_min + c)
        if bool(needs_recentering(result, spread, distance).any()):  # rare; same on every rank
            shift = mean_max
            sums = shifted_for_allreduce(rows, shift)
            all_reduce_(sums, op=dist.ReduceOp.SUM, group=group)
            result = moments_from_allreduce(sums, shift, lo, hi, spread)
        return names, result

    def _publish(self, names: list[str], rows: torch.Tensor) -> None:
        for name, (n, mean, m2, lo, hi) in zip(names, rows.tolist()):
            if n > 0:
                self._values[name] = (round(n), mean, math.sqrt(m2 / n), lo, hi)
                self._shift[name] = mean
            elif not self.keep_previous or name not in self._values:
                self._values[name] = _NAN_VALUES

    # -------------------------------------------------------------------------------- queries

    def names(self) -> list[str]:
        """Sorted names known to any rank at the last ``update()`` (matching ``regex``)."""
        return list(self._agreed)

    def _get(self, name: str) -> tuple[int, float, float, float, float]:
        values = self._values.get(name)
        if values is not None:
            return values
        if not isinstance(name, str):
            raise TypeError(f"statistic name must be a str, got {type(name).__name__} {name!r}")
        if self._matches(name):
            return _NAN_VALUES
        close = difflib.get_close_matches(name, self._agreed, n=5, cutoff=0.5)
        raise KeyError(
            f"{name!r} is not collected by Collector(regex={self.regex!r}); close names: {close}. "
            "HINT: widen the regex or create another Collector for it."
        )

    def num(self, name: str) -> int:
        """Number of values of ``name`` in the last interval (over all ranks); 0 if none.

        Raises:
            KeyError: ``regex`` excludes ``name`` (the message lists close names).
        """
        return self._get(name)[0]

    def mean(self, name: str) -> float:
        """Mean of ``name`` over the last interval and all ranks; NaN if it had no value.

        Raises:
            KeyError: ``regex`` excludes ``name`` (the message lists close names).
        """
        return self._get(name)[1]

    def std(self, name: str) -> float:
        """Population standard deviation (divide by ``num``) of ``name``; NaN if it had no value.

        Raises:
            KeyError: ``regex`` excludes ``name`` (the message lists close names).
        """
        return self._get(name)[2]

    def min(self, name: str) -> float:
        """Minimum of ``name`` over the last interval and all ranks; NaN if it had no value.

        Raises:
            KeyError: ``regex`` excludes ``name`` (the message lists close names).
        """
        return self._get(name)[3]

    def max(self, name: str) -> float:
        """Maximum of ``name`` over the last interval and all ranks; NaN if it had no value.

        Raises:
            KeyError: ``regex`` excludes ``name`` (the message lists close names).
        """
        return self._get(name)[4]

    def __getitem__(self, name: str) -> float:
        return self.mean(name)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {"num", "mean", "std", "min", "max"}}`` for every name of :meth:`names`."""
        keys = ("num", "mean", "std", "min", "max")
        return {name: dict(zip(keys, self._get(name))) for name in self._agreed}

    def state_dict(self) -> dict[str, Any]:
        """The published statistics and agreed names (what ``keep_previous`` needs after a resume)."""
        return {"names": list(self._agreed), "values": {k: list(v) for k, v in self._values.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same checkpoint must be loaded on every rank)."""
        self._agreed = sorted(state["names"])
        self._agreed_set = set(self._agreed)
        self._seen |= self._agreed_set
        self._values = {k: (int(v[0]), *map(float, v[1:])) for k, v in state["values"].items()}
        self._shift = {k: v[1] for k, v in self._values.items() if v[0] > 0 and math.isfinite(v[1])}

    def __repr__(self) -> str:
        return f"Collector(regex={self.regex!r}, keep_previous={self.keep_previous})"
