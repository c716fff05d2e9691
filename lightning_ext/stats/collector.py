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
from lightning_ext.kernels.moments import _UNPUBLISHED
from lightning_ext.stats import reporting as _report
from lightning_ext.stats.moments import _as_shifted, _empty_moments, _fingerprint, _merge_moments

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


def _merged(names: list[str], tables: list[_report._Table], device: torch.device) -> _report._Table:
    """The table of ``names`` on ``device``: per name, the merge of its rows in ``tables`` (empty rows
    for names no table has; names not in ``names`` are left out)."""
    if len(tables) == 1 and tables[0].names == names:  # steady state: nothing to reorder
        table = tables[0]
        return _report._Table(names, table.sums.to(device), table.shifts.to(device))
    index = {name: i for i, name in enumerate(names)}
    rows = _empty_moments(len(names), device)
    for table in tables:
        pairs = [(index[n], i) for i, n in enumerate(table.names) if n in index]
        if pairs:
            dst = torch.tensor([p[0] for p in pairs], device=device)
            src = torch.tensor([p[1] for p in pairs], device=table.sums.device)
            rows[dst] = _merge_moments(rows[dst], table.moments()[src].to(device))
    return _report._Table(names, *_as_shifted(rows))


class _Flush:
    """What a flush of the agreed names keeps from one update to the next, on the sync device.

    ``published``: float64 ``(R, 5)``, ``[count, mean, std, min, max]`` per name (the queries);
    ``next_shift``: float64 ``(R,)``, the center of the next SUM (each name's last published mean, 0
    before it had one); ``max_payload`` (``2 + 4R``) and ``sum_payload`` (``(R, 4)``): the buffers of
    the two all-reduces, laid out by the kernel op ``moments_payload_``.
    """

    def __init__(self, names: list[str], device: torch.device, previous: _Flush | None = None) -> None:
        r = len(names)
        self.names, self.index = names, {name: i for i, name in enumerate(names)}
        self.published = torch.tensor(_UNPUBLISHED, dtype=torch.float64, device=device).repeat(r, 1)
        self.next_shift = torch.zeros(r, dtype=torch.float64, device=device)
        self.max_payload = torch.empty(2 + 4 * r, dtype=torch.float64, device=device)
        self.sum_payload = torch.zeros(r, 4, dtype=torch.float64, device=device)  # counts 0 until a flush
        self.values: dict[str, tuple[int, float, float, float, float]] | None = None  # read lazily
        self.updated: list[str] = []  # names with values in the last interval (read with values)
        if previous is not None:  # keep what was published for the names that stay
            kept = [(i, previous.index[n]) for i, n in enumerate(names) if n in previous.index]
            if kept:
                dst, src = (torch.tensor(ix, device=device) for ix in zip(*kept))
                self.published[dst] = previous.published.to(device)[src]
                self.next_shift[dst] = previous.next_shift.to(device)[src]

    def payloads(self, table: _report._Table, center: torch.Tensor, fingerprint: float) -> None:
        """Write ``table``'s rows (aligned to ``names``) into both payloads, about ``center``."""
        args = (self.max_payload, self.sum_payload, table.sums, table.shifts, center, fingerprint)
        _report._backend(self.published.device).run("moments_payload_", *args)

    def finish(self, center: torch.Tensor, keep_previous: bool) -> bool:
        """Publish the reduced payloads; whether some name must be reduced again (host read)."""
        self.values = None
        args = (self.published, self.next_shift, self.max_payload, self.sum_payload, center, keep_previous)
        return bool(_report._backend(self.published.device).run("moments_finish_", *args))

    def mean_max(self) -> torch.Tensor:
        """The largest rank mean per name, from the reduced MAX payload (a center inside the data)."""
        r = len(self.names)
        return self.max_payload[2 + 2 * r : 2 + 3 * r].clone()

    def read(self, cut: int) -> dict[str, tuple[int, float, float, float, float]]:
        """``{name: (count, mean, std, min, max)}`` (names without their first ``cut`` characters: the
        stage), read from the device once per update."""
        if self.values is None:
            rows = self.published.tolist()
            self.values = {n[cut:]: (round(v[0]), *v[1:]) for n, v in zip(self.names, rows)}  # type: ignore[misc]
            self.updated = [n[cut:] for n, count in zip(self.names, self.sum_payload[:, 0].tolist()) if count]
        return self.values


class Collector:
    """Collect the statistics reported with :func:`~lightning_ext.stats.report` whose names match ``regex``.

    :meth:`update` reduces across ranks what was reported since this collector's previous update on
    every device of this process, and publishes per name the count, mean, population standard
    deviation (divide by ``num``, as NVIDIA's ``training_stats``), min and max, identical on every
    rank; each collector sees every value once. The queries (``num``, ``mean``, ``std``, ``min``,
    ``max``, ``c[name]`` for the mean) give 0/NaN for a matching name without values and raise
    ``KeyError`` (listing close names) for a name ``regex`` excludes, ``TypeError`` for a non-str.

    Distributed protocol, in three steps. Over the R names agreed at the previous update (same
    lengths on every rank), the kernel backend's ``moments_payload_`` writes two payloads (the maths
    and the layout: :meth:`~lightning_ext.kernels.KernelBackend.moments_payload_`), and two async
    all-reduces run together:

    * MAX of ``[fp, -fp, max_1..R, -min_1..R, mean_1..R, -mean_1..R]``, ``fp`` a 48-bit fingerprint
      of the sorted names this rank knows now (``-inf`` for names without local values): all ranks
      know the same names iff ``max(fp) == -max(-fp)`` (step 1, *agree names*);
    * SUM of ``[n, m2, n d, n d^2]`` per name, ``d`` the local mean minus the mean published by
      the previous update (step 2, *reduce rows*).

    ``moments_finish_`` (step 3, *finish*) turns them into the published statistics in one pass and
    says whether a name lost precision to cancellation; then the SUM is redone around the largest
    rank mean (rare). On the steady path (the same names as before) the flush runs no Python per
    name: two ops, two all-reduces, two host reads.

    If the name sets differ, one ``all_gather_object`` agrees on the sorted union (skipped when every
    rank saw the same new names), then the MAX and the SUM (around the largest rank mean) are redone
    on aligned rows. Over a gloo group on one host the all-reduces use shared memory
    (:func:`lightning_ext.distributed.all_reduce_`). Without ``torch.distributed`` (or after
    ``init_multiprocessing(rank, None)``) there are no collectives.

    Args:
        regex: names to collect (``re.fullmatch``).
        keep_previous: a name that received no value in an interval keeps its previous statistics
            (NaN only if it never had values); with ``False`` it becomes NaN. :meth:`updated` tells
            the names that had values.
        stage: the values to collect: those reported while :func:`~lightning_ext.stats.set_stage`
            had set this stage (``None``: those reported outside any stage, the default).

    Raises:
        TypeError: ``regex`` is not a str, ``keep_previous`` not a bool, ``stage`` not a str or None.
        ValueError: ``regex`` does not compile, ``stage`` is empty or holds ``"\\x1f"``.

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report
        >>> clear_statistics(); c = Collector(regex="Loss/.*")
        >>> _ = report("Loss/total", [1.0, 2.0, 3.0]); _ = report("Other", 5.0)
        >>> c.update(); c.names(), c.mean("Loss/total"), round(c.std("Loss/total"), 4)
        (['Loss/total'], 2.0, 0.8165)
        >>> c.update(); c["Loss/total"]  # keep_previous=True: nothing new, previous values kept
        2.0
    """

    def __init__(self, regex: str = ".*", keep_previous: bool = True, stage: str | None = None) -> None:
        self._pattern = _compile_regex("Collector", regex)
        check_bool("Collector", "keep_previous", keep_previous)
        _report._check_stage("Collector", stage)
        self.regex = regex
        self.keep_previous = keep_previous
        self.stage = stage
        self._prefix = "" if stage is None else stage + _report._STAGE_SEPARATOR  # of this stage's keys
        self._match_cache: dict[str, bool] = {}  # name => regex matches
        self._tables: list[_report._Table] = []  # drained tables received since the last update
        self._seen: set[str] = set()  # names this rank has had (matching), ever
        self._flush = _Flush([], torch.device("cpu"))  # the names agreed at the last update, and more
        # Caches of the steady state (the same name lists, by identity, from update to update):
        self._combined: tuple[list[str] | None, list[str]] = (None, [])  # drained names -> matching ones
        self._seen_from: list[str] | None = None  # the names last added to _seen
        self._candidate: tuple[list[str] | None, list[str]] = (None, [])  # agreed names -> candidate
        self._fp: tuple[list[str] | None, float] = (None, 0.0)  # names -> _fingerprint(names)
        self._equal: tuple[list[str] | None, list[str] | None] = (None, None)  # two lists found equal
        _report._register(self)

    def _matches(self, name: str) -> bool:
        """Whether ``regex`` matches ``name``."""
        return self._pattern.fullmatch(name) is not None

    def _wants(self, key: str) -> bool:
        """Whether a drained ``key`` (``name``, or ``stage + "\\x1f" + name``) is of this collector's
        stage and its name matches (cached)."""
        match = self._match_cache.get(key)
        if match is None:
            stage, _, name = key.rpartition(_report._STAGE_SEPARATOR)
            match = (stage or None) == self.stage and self._matches(name)
            self._match_cache[key] = match
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
                names = [n for n in table.names if self._wants(n)]
                names = table.names if len(names) == len(table.names) else names
                self._combined = (table.names, names)
            if names is table.names:
                return table
            return _merged(names, self._tables, table.sums.device)
        names = sorted({n for t in self._tables for n in t.names if self._wants(n)})
        device = self._tables[0].sums.device if self._tables else torch.device("cpu")
        return _merged(names, self._tables, device)

    def update(self) -> None:
        """Reduce everything reported since the last ``update()`` and publish it.

        Must be called on every rank, in the same order relative to other collectors' updates.
        Synchronizes host and device (it reads the fingerprint head of the MAX all-reduce and whether
        a name needs another reduction). Collectives on the sync device: two all-reduces, three to
        five when the name set changed (see the class docstring).
        """
        release = _report._drain(self)  # the rows of the values drained, lent while reading them
        try:
            self._publish(self._combine())
        finally:
            self._tables = []  # (never a lent table after its release)
            release()

    def _publish(self, local: _report._Table) -> None:
        """Agree on the names, reduce the rows of ``local`` and finish (class docstring)."""
        _rank, device, group = _report._sync_settings()
        world_size = dist.get_world_size(group=group) if device is not None and is_distributed() else 1
        device = device if device is not None else local.sums.device
        if self._flush.published.device != device:
            self._flush = _Flush(self._flush.names, device, self._flush)
        candidate = self._candidate_names(local.names)
        if world_size == 1:  # agree with no one, reduce nothing, finish
            if candidate is not self._flush.names:
                self._flush = _Flush(candidate, device, self._flush)
            flush = self._flush
            flush.payloads(self._aligned(local, device), flush.next_shift, 0.0)
            flush.finish(flush.next_shift, self.keep_previous)  # one rank: no name needs recentering
            return
        local, center = self._agree_and_reduce(candidate, local, device, group, world_size)
        if self._flush.finish(center, self.keep_previous):  # rare; the same on every rank
            center = self._flush.mean_max()
            self._sum_again(local, center, group)
            self._flush.finish(center, self.keep_previous)

    def _candidate_names(self, drained: list[str]) -> list[str]:
        """The sorted names this rank knows now: the agreed ones (the same list while no new name
        came) and those it has had."""
        if drained is not self._seen_from:
            self._seen.update(drained)
            self._seen_from = drained
            self._candidate = (None, [])
        agreed = self._flush.names
        source, candidate = self._candidate
        if source is not agreed:
            known = self._flush.index.keys()
            candidate = agreed if self._seen <= known else sorted(known | self._seen)
            self._candidate = (agreed, candidate)
        return candidate

    def _aligned(self, local: _report._Table, device: torch.device) -> _report._Table:
        """``local`` with the rows of the agreed names, in their order, on ``device``."""
        names = self._flush.names
        if self._equal[0] is not local.names or self._equal[1] is not names:  # once while both stay
            if local.names != names:
                return _merged(names, [local], device)
            self._equal = (local.names, names)
        return local if local.sums.device == device else _merged(names, [local], device)

    def _fingerprint(self, names: list[str]) -> float:
        """:func:`_fingerprint` of ``names``, cached while the same list comes back."""
        cached_names, fp = self._fp
        if cached_names is not names:
            fp = _fingerprint(names)
            self._fp = (names, fp)
        return fp

    def _agree_and_reduce(
        self, candidate: list[str], local: _report._Table, device: torch.device, group: Any, world_size: int
    ) -> tuple[_report._Table, torch.Tensor]:
        """Both all-reduces over the agreed names, and again over the union when the ranks' names
        differ (class docstring); returns the aligned local table and the center of the SUM."""
        flush = self._flush
        aligned, center = self._aligned(local, device), flush.next_shift
        flush.payloads(aligned, center, self._fingerprint(candidate))
        works = [all_reduce_(flush.max_payload, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        if flush.names:
            works.append(all_reduce_(flush.sum_payload, op=dist.ReduceOp.SUM, group=group, async_op=True))
        for work in works:
            work.wait()
        fp_max, neg_fp_min = flush.max_payload[:2].tolist()  # host sync; identical on every rank
        names = flush.names
        if fp_max != -neg_fp_min:  # ranks know different name sets: agree on the sorted union
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, candidate, group=group)
            names = sorted(set().union(*gathered))
        elif candidate != names:  # every rank saw the same new names: no need to gather them
            names = candidate
        if names is flush.names:
            return aligned, center
        flush = self._flush = _Flush(names, device, flush)  # the same decision on every rank
        aligned = _merged(names, [local], device)
        flush.payloads(aligned, flush.next_shift, self._fingerprint(names))
        all_reduce_(flush.max_payload, op=dist.ReduceOp.MAX, group=group)
        center = flush.mean_max()  # the largest rank mean: inside the data range
        self._sum_again(aligned, center, group)
        return aligned, center

    def _sum_again(self, aligned: _report._Table, center: torch.Tensor, group: Any) -> None:
        """Redo the SUM all-reduce about ``center``, keeping the reduced MAX payload."""
        flush = self._flush
        reduced = flush.max_payload.clone()
        flush.payloads(aligned, center, 0.0)
        flush.max_payload.copy_(reduced)
        all_reduce_(flush.sum_payload, op=dist.ReduceOp.SUM, group=group)

    def names(self) -> list[str]:
        """Sorted names known to any rank at the last ``update()`` (matching ``regex``)."""
        cut = len(self._prefix)
        return [n[cut:] for n in self._flush.names]

    def updated(self) -> list[str]:
        """Sorted names that received values (on any rank) in the last ``update()``'s interval: the
        rest of :meth:`names` only repeat earlier statistics (``keep_previous``) or NaN."""
        self._flush.read(len(self._prefix))
        return list(self._flush.updated)

    def _get(self, name: str) -> tuple[int, float, float, float, float]:
        values = self._flush.read(len(self._prefix)).get(name)
        if values is not None:
            return values
        if not isinstance(name, str):
            raise TypeError(f"statistic name must be a str, got {type(name).__name__} {name!r}")
        if self._matches(name):
            return _NAN_VALUES
        close = difflib.get_close_matches(name, self.names(), n=5, cutoff=0.5)
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
        return {name: dict(zip(keys, values)) for name, values in self._flush.read(len(self._prefix)).items()}

    def state_dict(self) -> dict[str, Any]:
        """The published statistics and agreed names (what ``keep_previous`` needs after a resume)."""
        values = self._flush.read(len(self._prefix))
        return {"names": self.names(), "values": {k: list(v) for k, v in values.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same checkpoint must be loaded on every rank)."""
        names, values = sorted(state["names"]), state["values"]
        rows = [values.get(name, _UNPUBLISHED) for name in names]
        names = [self._prefix + name for name in names]
        self._seen.update(names)
        self._flush = flush = _Flush(names, self._flush.published.device)
        flush.published.copy_(torch.tensor(rows, dtype=torch.float64).reshape(-1, 5))
        has = flush.published[:, 0] > 0
        flush.next_shift.copy_(torch.where(has, flush.published[:, 1], 0.0).nan_to_num(0.0, 0.0, 0.0))

    def __repr__(self) -> str:
        stage = "" if self.stage is None else f", stage={self.stage!r}"
        return f"Collector(regex={self.regex!r}, keep_previous={self.keep_previous}{stage})"
