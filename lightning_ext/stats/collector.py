"""``Collector``: reduce the values reported since its last ``update()`` across devices and ranks."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

import torch
import torch.distributed as dist

from lightning_ext._checks import check_bool
from lightning_ext.distributed import all_reduce_, is_distributed
from lightning_ext.stats import reporting as _report
from lightning_ext.stats.moments import (
    _empty_moments,
    _fingerprint,
    _merge_moments,
    _moments_from_allreduce,
    _needs_recentering,
    _shifted_for_allreduce,
)

__all__ = ["Collector"]

_NAN_VALUES = (0, math.nan, math.nan, math.nan, math.nan)  # (num, mean, std, min, max) of an empty name
_COMPACT_AFTER = 16  # merge received tables once this many are waiting (bounds memory between updates)


def _compile_regex(owner: str, regex: Any) -> re.Pattern[str]:
    """``re.compile(regex)`` for the ``regex`` argument of ``owner`` (a class name, used in the errors).

    Raises:
        TypeError: ``regex`` is not a str.
        ValueError: ``regex`` does not compile.
    """
    if not isinstance(regex, str):
        raise TypeError(f"{owner}: `regex` must be a str, got {regex!r} ({type(regex).__name__})")
    try:
        return re.compile(regex)
    except re.error as err:
        raise ValueError(f"{owner}: `regex` must be a regular expression, got {regex!r} ({err})") from None


def _merged_rows(names: list[str], tables: list[_report._Table], device: torch.device) -> torch.Tensor:
    """Float64 ``(len(names), 5)`` moment rows on ``device``: per name, the merge of its rows in ``tables``
    (empty rows for names no table has; names not in ``names`` are left out)."""
    if len(tables) == 1 and tables[0].names == names:  # steady state: nothing to reorder
        return tables[0].rows.to(device)
    index = {name: i for i, name in enumerate(names)}
    rows = _empty_moments(len(names), device)
    for table in tables:
        pairs = [(index[n], i) for i, n in enumerate(table.names) if n in index]
        if pairs:
            dst = torch.tensor([p[0] for p in pairs], device=device)
            src = torch.tensor([p[1] for p in pairs], device=table.rows.device)
            rows[dst] = _merge_moments(rows[dst], table.rows[src].to(device))
    return rows


def _max_payload(fp: float, rows: torch.Tensor) -> torch.Tensor:
    """The MAX all-reduce payload (see :class:`Collector`)."""
    head = torch.tensor([fp, -fp], dtype=torch.float64, device=rows.device)
    has = rows[:, 0] > 0
    ninf = torch.full_like(rows[:, 1], -math.inf)
    mean, neg_mean = torch.where(has, rows[:, 1], ninf), torch.where(has, -rows[:, 1], ninf)
    return torch.cat([head, rows[:, 4], -rows[:, 3], mean, neg_mean])


class Collector:
    """Collect the statistics reported with :func:`~lightning_ext.stats.report` whose names match ``regex``.

    :meth:`update` reduces across ranks what was reported since this collector's previous update on
    every device of this process, and publishes per name the count, mean, population standard
    deviation (divide by ``num``, as NVIDIA's ``training_stats``), min and max, identical on every
    rank; each collector sees every value once. The queries (``num``, ``mean``, ``std``, ``min``,
    ``max``, ``c[name]`` for the mean) give 0/NaN for a matching name without values and raise
    ``KeyError`` (listing close names) for a name ``regex`` excludes, ``TypeError`` for a non-str.

    Distributed protocol (maths in :mod:`lightning_ext.stats.moments`): over the R names agreed at
    the previous update (same lengths on every rank), two async all-reduces run together:

    * MAX of ``[fp, -fp, max_1..R, -min_1..R, mean_1..R, -mean_1..R]``, ``fp`` a 48-bit fingerprint
      of the sorted names this rank knows now (``-inf`` for names without local values): all ranks
      know the same names iff ``max(fp) == -max(-fp)``;
    * SUM of ``_shifted_for_allreduce`` rows around the means published by the previous update,
      redone around the largest rank mean from the MAX where ``_needs_recentering`` flags a row.

    If the name sets differ, one ``all_gather_object`` agrees on the sorted union (skipped when every
    rank saw the same new names), then the MAX and the SUM (around the largest rank mean) are redone
    on aligned rows. Over a gloo group on one host the all-reduces use shared memory
    (:func:`lightning_ext.distributed.all_reduce_`). Without ``torch.distributed`` (or after
    ``init_multiprocessing(rank, None)``) there are no collectives.

    Args:
        regex: names to collect (``re.fullmatch``).
        keep_previous: a name that received no value in an interval keeps its previous statistics
            (NaN only if it never had values); with ``False`` it becomes NaN.

    Raises:
        TypeError: ``regex`` is not a str or ``keep_previous`` not a bool.
        ValueError: ``regex`` does not compile.

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report
        >>> clear_statistics(); c = Collector(regex="Loss/.*")
        >>> _ = report("Loss/total", [1.0, 2.0, 3.0]); _ = report("Other", 5.0)
        >>> c.update(); c.names(), c.mean("Loss/total"), round(c.std("Loss/total"), 4)
        (['Loss/total'], 2.0, 0.8165)
        >>> c.update(); c["Loss/total"]  # keep_previous=True: nothing new, previous values kept
        2.0
    """

    def __init__(self, regex: str = ".*", keep_previous: bool = True) -> None:
        self._pattern = _compile_regex("Collector", regex)
        check_bool("Collector", "keep_previous", keep_previous)
        self.regex = regex
        self.keep_previous = keep_previous
        self._match_cache: dict[str, bool] = {}  # name => regex matches
        self._tables: list[_report._Table] = []  # drained tables received since the last update
        self._seen: set[str] = set()  # names this rank has had (matching), ever
        self._agreed: list[str] = []  # sorted name union agreed across ranks at the last update
        self._agreed_set: set[str] = set()
        # name => (num, mean, std, min, max) published by the last update
        self._values: dict[str, tuple[int, float, float, float, float]] = {}
        self._shift: dict[str, float] = {}  # name => last published global mean (shift of the next SUM)
        # Caches of the steady state (the same name lists, by identity, from update to update):
        self._combined: tuple[list[str] | None, list[str]] = (None, [])  # drained names -> matching ones
        self._seen_from: list[str] | None = None  # the names last added to _seen
        self._fp: tuple[list[str] | None, float] = (None, 0.0)  # names -> _fingerprint(names)
        self._shift_rows: tuple[list[str] | None, torch.Tensor | None] = (None, None)  # names -> float64
        # (len(names),) of self._shift.get(name, 0.0), on the sync device
        _report._register(self)

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
        return {**self.__dict__, "_tables": []}  # pending values stay in the process that reported them

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _report._register(self)

    def _combine(self) -> _report._Table:
        """Merge the received tables into one table restricted to the names this collector matches."""
        if len(self._tables) == 1:  # the usual case: one drain since the last update
            table = self._tables[0]  # its names are sorted and distinct
            source, names = self._combined
            if table.names is not source:  # a drain reuses its name list while the names repeat
                names = [n for n in table.names if self._matches(n)]
                names = table.names if len(names) == len(table.names) else names
                self._combined = (table.names, names)
            if names is table.names:
                return table
            return _report._Table(names, _merged_rows(names, self._tables, table.rows.device))
        names = sorted({n for t in self._tables for n in t.names if self._matches(n)})
        device = self._tables[0].rows.device if self._tables else torch.device("cpu")
        return _report._Table(names, _merged_rows(names, self._tables, device))

    def update(self) -> None:
        """Reduce everything reported since the last ``update()`` and publish it.

        Must be called on every rank, in the same order relative to other collectors' updates.
        Synchronizes host and device (it reads the fingerprint head of the MAX all-reduce and the
        final statistics). Collectives on the sync device: two all-reduces, three to five when the
        name set changed (see the class docstring).
        """
        _report._drain()
        local = self._combine()
        self._tables = []
        if local.names is not self._seen_from:
            self._seen.update(local.names)
            self._seen_from = local.names
        _rank, device, group = _report._sync_settings()
        world_size = dist.get_world_size(group=group) if device is not None and is_distributed() else 1
        candidate = self._agreed if self._seen <= self._agreed_set else sorted(self._agreed_set | self._seen)
        device = device if device is not None else local.rows.device
        if world_size > 1:
            names, rows = self._reduce(candidate, local, device, group, world_size)
        else:
            names, rows = candidate, _merged_rows(candidate, [local], device)
        if names is not self._agreed:
            self._agreed, self._agreed_set = names, set(names)
        self._publish(names, rows)

    def _publish(self, names: list[str], rows: torch.Tensor) -> None:
        """Write the global moment ``rows`` of ``names`` into the published values and shifts (one host
        read of all rows, no Python arithmetic per name unless some names had no values)."""
        n = rows[:, 0]
        counts = n.round().to(torch.int64).tolist()
        # std = sqrt(m2 / n) in float64, element for element what math.sqrt(m2 / n) gives
        means, stds, los, his = torch.stack(
            [rows[:, 1], (rows[:, 2] / n).sqrt(), rows[:, 3], rows[:, 4]]
        ).tolist()
        values = dict(zip(names, zip(counts, means, stds, los, his)))
        shifts = dict(zip(names, means))
        if 0 in counts:  # names without values in this interval
            for name, count in zip(names, counts):
                if count == 0:
                    del shifts[name]
                    if self.keep_previous and name in self._values:
                        del values[name]
                    else:
                        values[name] = _NAN_VALUES
        self._values.update(values)
        self._shift.update(shifts)
        cached_names, previous = self._shift_rows
        if cached_names is names and previous is not None and previous.device == rows.device:
            self._shift_rows = (names, torch.where(n > 0, rows[:, 1], previous))
        else:
            self._shift_rows = (None, None)  # rebuilt from self._shift when needed

    def _shift_tensor(self, names: list[str], device: torch.device) -> torch.Tensor:
        """Float64 ``(len(names),)``: the shift of the next SUM per name (last published mean, else 0)."""
        cached_names, shift = self._shift_rows
        if cached_names is not names or shift is None or shift.device != device:
            shift = torch.tensor([self._shift.get(n, 0.0) for n in names], dtype=torch.float64, device=device)
            self._shift_rows = (names, shift)
        return shift

    def _fingerprint(self, names: list[str]) -> float:
        """:func:`_fingerprint` of ``names``, cached while the same list comes back."""
        cached_names, fp = self._fp
        if cached_names is not names:
            fp = _fingerprint(names)
            self._fp = (names, fp)
        return fp

    def _reduce(
        self, candidate: list[str], local: _report._Table, device: torch.device, group: Any, world_size: int
    ) -> tuple[list[str], torch.Tensor]:
        """The protocol of the class docstring; returns (agreed names, global moment rows)."""
        names = self._agreed
        rows = _merged_rows(names, [local], device)
        payload = _max_payload(self._fingerprint(candidate), rows)
        works = [all_reduce_(payload, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        shift = self._shift_tensor(names, device)
        sums = _shifted_for_allreduce(rows, shift)
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
            return names, _empty_moments(0, device)
        r = len(names)
        if names is not self._agreed:  # same decision on every rank (it follows from the reduced head)
            rows = _merged_rows(names, [local], device)
            payload = _max_payload(self._fingerprint(names), rows)
            all_reduce_(payload, op=dist.ReduceOp.MAX, group=group)
            shift = payload[2 + 2 * r : 2 + 3 * r]  # the largest rank mean: inside the data range
            sums = _shifted_for_allreduce(rows, shift)
            all_reduce_(sums, op=dist.ReduceOp.SUM, group=group)
        hi, neg_lo, mean_max, neg_mean_min = payload[2:].view(4, r)
        lo, spread = -neg_lo, mean_max + neg_mean_min
        result = _moments_from_allreduce(sums, shift, lo, hi, spread)
        c = torch.nan_to_num(shift, nan=0.0, posinf=0.0, neginf=0.0)
        distance = torch.maximum(mean_max - c, neg_mean_min + c)
        if bool(_needs_recentering(result, spread, distance).any()):  # rare; same on every rank
            shift = mean_max
            sums = _shifted_for_allreduce(rows, shift)
            all_reduce_(sums, op=dist.ReduceOp.SUM, group=group)
            result = _moments_from_allreduce(sums, shift, lo, hi, spread)
        return names, result

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
        """Number of values of ``name`` in the last interval, over all ranks."""
        return self._get(name)[0]

    def mean(self, name: str) -> float:
        """Mean of ``name`` over the last interval and all ranks."""
        return self._get(name)[1]

    def std(self, name: str) -> float:
        """Population standard deviation (divide by ``num``) of ``name``."""
        return self._get(name)[2]

    def min(self, name: str) -> float:
        """Minimum of ``name`` over the last interval and all ranks."""
        return self._get(name)[3]

    def max(self, name: str) -> float:
        """Maximum of ``name`` over the last interval and all ranks."""
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
