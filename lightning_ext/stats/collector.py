"""``Collector``: reduce the values reported since its last ``update()`` across devices and ranks."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from lightning_ext._checks import check_bool
from lightning_ext.distributed import all_reduce_, is_distributed
from lightning_ext.stats import reporting
from lightning_ext.stats.moments import _fingerprint
from lightning_ext.stats.reporting import _STAGE_SEPARATOR, _merged, _SyncSettings, _Table
from lightning_ext.stats.sketch import LogHistogram

__all__ = ["Collector", "Straggler"]

_UNPUBLISHED = (0, math.nan, math.nan, math.nan, math.nan)  # (num, mean, std, min, max) without values
_COMPACT_AFTER = 16  # merge received tables once this many are waiting (bounds memory between updates)


def _compile_regex(owner: str, regex: Any, arg: str = "regex") -> re.Pattern[str]:
    """``re.compile(regex)`` for the argument ``arg`` of ``owner`` (a class name, used in the errors).

    Raises:
        TypeError: ``regex`` is not a str.
        ValueError: ``regex`` does not compile.
    """
    if not isinstance(regex, str):
        raise TypeError(f"{owner}: `{arg}` must be a str, got {regex!r} ({type(regex).__name__})")
    try:
        return re.compile(regex)
    except re.error as err:
        raise ValueError(f"{owner}: `{arg}` must be a regular expression, got {regex!r} ({err})") from None


def _check_quantile(q: Any) -> float:
    """``q`` as a float in ``(0, 1)``, else the error naming it."""
    if isinstance(q, bool) or not isinstance(q, int | float):
        raise TypeError(
            f"Collector.quantile: the quantile `q` must be a float, got {q!r} ({type(q).__name__})"
        )
    if not 0.0 < q < 1.0:
        raise ValueError(f"Collector.quantile: the quantile `q` must be in (0, 1), got {q!r}")
    return float(q)


class Straggler(NamedTuple):
    """The rank whose mean of a statistic was the largest in an interval (:meth:`Collector.straggler`).

    ``rank``: its rank in the collector's process group; ``mean``: its mean (to ``2**(b - 52)``
    relatively, ``b`` the bits of the largest rank: the rank rides in the low bits of the float64
    mean); ``median``: the median of the ranks' means (the mean of the two middle ones for an even
    number of ranks: of both, with two), within the sketch's relative accuracy;
    ``ratio``: ``mean / median``.
    """

    rank: int
    mean: float
    median: float
    ratio: float


def _rank_bits(world_size: int) -> int:
    """Low mantissa bits of a packed rank mean that hold the rank."""
    return max(1, (world_size - 1).bit_length())


class _Tracked(NamedTuple):
    """Which of a flush's names have sketches: rows of its names, for quantiles and for stragglers."""

    sketch: LogHistogram | None  # None when no name has one
    quantiled: list[int]
    straggled: list[int]


class _Flush:
    """What a flush of the agreed names keeps from one update to the next, on the sync device, and the
    payloads of its two all-reduces. Over ``R`` names, ``Q`` of them with quantile sketches and ``S``
    with the slowest rank tracked (``B`` = the sketch's size), ``W`` ranks::

        max_buffer (W + 2 + 5R,)    [configuration_1..W | fp, -fp | max, -min, mean, -mean, slowest per name]
        sum_buffer (4R + (Q+S) B,)  [n, m2, n d, n d^2] per name | Q value histograms | S rank-mean histograms

    ``configuration_r``: rank ``r``'s fingerprint of its collector's configuration (``-inf`` from the
    others, so that MAX gives every rank's); ``[fp, -fp | 4R]`` (``max_payload``) and the first
    ``4R`` of the SUM (``sum_payload``) written by the kernel op ``moments_payload_``; ``slowest``: a
    rank's mean with its rank in the low bits (MAX picks the slowest rank and names it; ``-inf`` for
    names without); a rank-mean histogram counts each rank's mean once (its median). The MAX's size
    depends on ``W`` and ``R`` alone, the SUM's on the configuration too.

    Kept (what the queries read): ``published``, float64 ``(R, 5)`` ``[count, mean, std, min, max]``;
    ``counts``, float64 ``(R,)``, the values of the last interval; ``next_shift``, float64 ``(R,)``,
    the center of the next SUM (each name's last published mean, 0 before it had one); ``sketches``,
    float64 ``(Q + S, B)``, and ``slowest``, float64 ``(S,)``, the published histograms and slowest
    ranks. The payloads are scratch: a failed update leaves what was published. All are normal tensors
    (not inference tensors): an update in inference mode may make the flush that training updates.
    """

    @torch.inference_mode(False)
    def __init__(
        self,
        names: list[str],
        device: torch.device,
        world_size: int = 1,
        tracked: _Tracked | None = None,
        previous: _Flush | None = None,
    ) -> None:
        r, w = len(names), world_size
        self.names, self.index, self.world_size = names, {name: i for i, name in enumerate(names)}, w
        self.sketch, self.quantiled, self.straggled = tracked or _Tracked(None, [], [])
        q, s, size = len(self.quantiled), len(self.straggled), self.sketch.size if self.sketch else 0
        self.published = torch.tensor(_UNPUBLISHED, dtype=torch.float64, device=device).repeat(r, 1)
        self.counts = torch.zeros(r, dtype=torch.float64, device=device)
        self.next_shift = torch.zeros(r, dtype=torch.float64, device=device)
        self.max_buffer = torch.full((w + 2 + 5 * r,), -math.inf, dtype=torch.float64, device=device)
        self.sum_buffer = torch.zeros(4 * r + (q + s) * size, dtype=torch.float64, device=device)
        self.configurations = self.max_buffer[:w]
        self.max_payload, self.rank_max = self.max_buffer[w : w + 2 + 4 * r], self.max_buffer[w + 2 + 4 * r :]
        self.sum_payload = self.sum_buffer[: 4 * r].view(r, 4)
        self.histograms = self.sum_buffer[4 * r :].view(q + s, size)
        self.sketches = torch.zeros(q + s, size, dtype=torch.float64, device=device)
        self.slowest = torch.full((s,), -math.inf, dtype=torch.float64, device=device)
        self._sketch_rows = torch.tensor(self.quantiled + self.straggled, dtype=torch.int64, device=device)
        self._straggled_rows = torch.tensor(self.straggled, dtype=torch.int64, device=device)
        self._edges = self.sketch.edges(device) if self.straggled else None
        self.values: dict[str, tuple[int, float, float, float, float]] | None = None  # read lazily
        self.updated: list[str] = []  # names with values in the last interval (read with values)
        self._host_sketches: tuple[np.ndarray, list[float]] | None = None  # read lazily
        if previous is not None:  # keep what was published for the names that stay
            self._keep(previous)

    def _keep(self, previous: _Flush) -> None:
        device = self.published.device
        kept = [(i, previous.index[n]) for i, n in enumerate(self.names) if n in previous.index]
        if kept:
            dst, src = (torch.tensor(ix, device=device) for ix in zip(*kept))
            self.published[dst] = previous.published.to(device)[src]
            self.next_shift[dst] = previous.next_shift.to(device)[src]
        if self.sketch is not None and self.sketch == previous.sketch:
            before = {previous.names[i]: j for j, i in enumerate(previous.quantiled)}
            for j, i in enumerate(self.quantiled):
                if self.names[i] in before:
                    self.sketches[j] = previous.sketches[before[self.names[i]]].to(device)

    def payloads(self, table: _Table, center: torch.Tensor, fingerprint: float, rank: int) -> None:
        """Write ``table``'s rows (aligned to ``names``) into both buffers, about ``center``."""
        backend = reporting._kernel_backend(self.published.device)
        args = (self.max_payload, self.sum_payload, table.sums, table.shifts, center, fingerprint)
        backend.run("moments_payload_", *args)
        if self.sketch is None:
            return
        q, zero = len(self.quantiled), self.sketches.new_zeros(())
        if q:  # each name's counts, zeros for a name without values here
            counts = [table.histograms.get((self.names[i], self.sketch), zero) for i in self.quantiled]
            torch.stack([c.expand(self.sketch.size) for c in counts], out=self.histograms[:q])
        if self.straggled:
            self._rank_means(table, rank, backend)

    def _rank_means(self, table: _Table, rank: int, backend: Any) -> None:
        """This rank's mean of each straggler name: packed with its rank into ``rank_max``, counted
        into its rank-mean histogram."""
        histograms = self.histograms[len(self.quantiled) :]
        histograms.zero_()
        index = self._straggled_rows.to(table.sums.device)
        rows = table._replace(sums=table.sums[index], shifts=table.shifts[index]).moments()
        rows = rows.to(histograms.device)
        has = (rows[:, 0] > 0) & rows[:, 1].isfinite()
        mask = (1 << _rank_bits(self.world_size)) - 1
        packed = ((rows[:, 1].view(torch.int64) & ~mask) | rank).view(torch.float64)
        self.rank_max[self._straggled_rows] = torch.where(has, packed, -math.inf)
        means = torch.where(has, rows[:, 1], math.nan)  # NaN is not counted
        for j in range(len(self.straggled)):
            backend.run("accumulate_histogram_", histograms[j], means[j : j + 1], self._edges)

    def finish(self, center: torch.Tensor, keep_previous: bool) -> bool:
        """Publish the reduced buffers; whether some name must be reduced again (host read)."""
        self.values, self._host_sketches = None, None
        args = (self.published, self.next_shift, self.max_payload, self.sum_payload, center, keep_previous)
        again = bool(reporting._kernel_backend(self.published.device).run("moments_finish_", *args))
        self.counts.copy_(self.sum_payload[:, 0])
        if self.sketch is not None:
            has = (self.sum_payload[self._sketch_rows, 0] > 0)[:, None]
            self.sketches.copy_(torch.where(has, self.histograms, self.sketches if keep_previous else 0.0))
            self.slowest.copy_(self.rank_max[self._straggled_rows])
        return again

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
            self.updated = [n[cut:] for n, count in zip(self.names, self.counts.tolist()) if count]
        return self.values

    def host_sketches(self) -> tuple[np.ndarray, list[float]]:
        """The published histograms (NumPy ``(Q + S, B)``) and the packed slowest means, read once."""
        if self._host_sketches is None:
            self._host_sketches = (self.sketches.cpu().numpy(), self.slowest.tolist())
        return self._host_sketches


class Collector:
    """Collect the statistics reported with :func:`~lightning_ext.stats.report` whose names match ``regex``.

    :meth:`update` reduces across ranks what was reported since this collector's previous update on
    every device of this process, and publishes per name the count, mean, population standard
    deviation (divide by ``num``, as NVIDIA's ``training_stats``), min and max, identical on every
    rank; each collector sees every value once. The queries (``num``, ``mean``, ``std``, ``min``,
    ``max``, ``c[name]`` for the mean) give 0/NaN for a name without values in the interval and raise
    ``KeyError`` (listing close names) for a name never reported on any rank before the last update or
    one ``regex`` excludes, ``TypeError`` for a non-str.

    A collector sees the values reported while it exists: creating one first hands the values
    pending to the collectors created before.

    Opt-in per name: :meth:`quantile` for the names ``quantiles`` matches, from a mergeable sketch
    (:class:`~lightning_ext.stats.LogHistogram`: relative accuracy ``relative_accuracy`` for
    magnitudes in ``value_range``; about 22 KB per name with the defaults), and :meth:`straggler`,
    the rank with the largest mean and its ratio to the median rank, for the names ``stragglers``
    matches. Both ride in the same two all-reduces.

    Distributed protocol, in three named steps over the R names agreed at the previous update (same
    lengths on every rank); the buffers' layout is ``_Flush``'s:

    1. *agree*: the MAX all-reduce carries each rank's fingerprint of its configuration (every
       argument above) in its own slot: ranks whose collectors differ raise on every rank, naming the
       ranks, before anything is published (until the ranks agreed once, the SUM, whose size depends
       on the configuration, waits for this check). It carries ``[fp, -fp]`` too, ``fp`` a 48-bit
       fingerprint of the sorted names this rank knows now: all ranks know the same names iff
       ``max(fp) == -max(-fp)``; if not, one ``all_gather_object`` agrees on the sorted union
       (skipped when every rank saw the same new names), and both all-reduces are redone on aligned
       rows;
    2. *reduce rows*: the kernel backend's ``moments_payload_`` (the maths:
       :mod:`lightning_ext.kernels.moments`) writes each name's extremes and rank mean (``-inf``
       without local values) for the MAX, and ``[n, m2, n d, n d^2]`` (``d`` the local mean minus
       the mean published by the previous update) for the SUM, after which come the
       sketches' counts; the two all-reduces run together (async);
    3. *finish*: ``moments_finish_`` publishes the statistics in one pass and says whether a name lost
       precision to cancellation; then the SUM is redone around the largest rank mean (rare).

    On the steady path (the same names as before) the flush runs no Python per name: two ops, two
    all-reduces, two host reads. Over a gloo group on one host the all-reduces use shared memory
    (:func:`lightning_ext.distributed.all_reduce_`). Without ``torch.distributed`` (or after
    ``init_multiprocessing(rank, None)``) there are no collectives.

    Args:
        regex: names to collect (``re.fullmatch``).
        keep_previous: a name that received no value in an interval keeps its previous statistics
            (and sketch; NaN only if it never had values); with ``False`` it becomes NaN.
            :meth:`updated` tells the names that had values.
        stage: the values to collect: those reported while :func:`~lightning_ext.stats.set_stage`
            had set this stage (``None``: those reported outside any stage, the default).
        quantiles: names (of those ``regex`` matches, ``re.fullmatch``) to sketch for
            :meth:`quantile`; ``None``: none.
        relative_accuracy: the sketch's ``alpha``, in ``(0, 0.5)``.
        value_range: ``(low, high)``, the magnitudes the sketch covers with that accuracy.
        stragglers: names (``re.fullmatch``) whose slowest rank :meth:`straggler` names; ``None``: none.

    Raises:
        TypeError: ``regex``/``quantiles``/``stragglers`` is not a str (the last two: or None),
            ``keep_previous`` not a bool, ``stage`` not a str or None, a sketch parameter not a number.
        ValueError: a pattern does not compile, ``stage`` is empty or holds ``"\\x1f"``,
            ``relative_accuracy`` is not in ``(0, 0.5)``, ``value_range`` not ``0 < low < high < inf``.

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report
        >>> clear_statistics(); c = Collector(regex="Loss/.*", quantiles="Loss/total")
        >>> _ = report("Loss/total", [1.0, 2.0, 3.0]); _ = report("Other", 5.0)
        >>> c.update(); c.names(), c.mean("Loss/total"), round(c.std("Loss/total"), 4)
        (['Loss/total'], 2.0, 0.8165)
        >>> round(c.quantile("Loss/total", 0.5), 2)  # 2.0 within 1 %
        1.99
        >>> c.update(); c["Loss/total"]  # keep_previous=True: nothing new, previous values kept
        2.0
    """

    def __init__(
        self,
        regex: str = ".*",
        keep_previous: bool = True,
        stage: str | None = None,
        quantiles: str | None = None,
        relative_accuracy: float = 0.01,
        value_range: tuple[float, float] = (1e-6, 1e6),
        stragglers: str | None = None,
    ) -> None:
        self._pattern = _compile_regex("Collector", regex)
        check_bool("Collector", "keep_previous", keep_previous)
        reporting._check_stage("Collector", stage)
        self._tracked = {
            arg: None if p is None else _compile_regex("Collector", p, arg)
            for arg, p in (("quantiles", quantiles), ("stragglers", stragglers))
        }
        self.sketch = LogHistogram(relative_accuracy, value_range)  # checks them
        self.regex, self.keep_previous, self.stage = regex, keep_previous, stage
        self.quantiles, self.stragglers = quantiles, stragglers
        self._prefix = "" if stage is None else stage + _STAGE_SEPARATOR  # of this stage's keys
        self._match_cache: dict[str, bool] = {}  # key => of this stage and regex matches its name
        self._tables: list[_Table] = []  # drained tables received since the last update
        self._seen: set[str] = set()  # names this rank has had (matching), ever
        self._flush = _Flush([], torch.device("cpu"))  # the names agreed at the last update, and more
        self._agreed_in: _SyncSettings | None = None  # settings in which the ranks agreed on the arguments
        # Caches of the steady state (the same name lists, by identity, from update to update):
        self._combined: tuple[list[str] | None, list[str]] = (None, [])  # drained names -> matching ones
        self._seen_from: list[str] | None = None  # the names last added to _seen
        self._candidate: tuple[list[str] | None, list[str]] = (None, [])  # agreed names -> candidate
        self._fp: tuple[list[str] | None, float] = (None, 0.0)  # names -> _fingerprint(names)
        self._equal: tuple[list[str] | None, list[str] | None] = (None, None)  # two lists found equal
        self._slot: tuple[tuple[int, int], torch.Tensor] | None = None  # (rank, W) -> configurations
        reporting._register(self)

    def _configuration(self) -> str:
        """What the ranks' collectors must share: every argument (what is reduced and published)."""
        return (
            f"Collector(regex={self.regex!r}, keep_previous={self.keep_previous}, stage={self.stage!r}, "
            f"quantiles={self.quantiles!r}, relative_accuracy={self.sketch.relative_accuracy!r}, "
            f"value_range={self.sketch.value_range!r}, stragglers={self.stragglers!r})"
        )

    def _matches(self, name: str) -> bool:
        """Whether ``regex`` matches ``name``."""
        return self._pattern.fullmatch(name) is not None

    def _wants(self, key: str) -> bool:
        """Whether a drained ``key`` (``name``, or ``stage + "\\x1f" + name``) is of this collector's
        stage and its name matches (cached)."""
        match = self._match_cache.get(key)
        if match is None:
            stage, _, name = key.rpartition(_STAGE_SEPARATOR)
            match = (stage or None) == self.stage and self._matches(name)
            self._match_cache[key] = match
        return match

    def _tracks(self, arg: str, key: str) -> bool:
        """Whether the pattern ``arg`` (``"quantiles"`` or ``"stragglers"``) tracks ``key``."""
        pattern = self._tracked[arg]
        name = key[len(self._prefix) :]
        return pattern is not None and self._wants(key) and pattern.fullmatch(name) is not None

    def _sketch_for(self, key: str) -> LogHistogram | None:
        """The sketch ``report()`` keeps for ``key`` for this collector, or ``None``."""
        return self.sketch if self._tracks("quantiles", key) else None

    def _new_flush(self, names: list[str], device: torch.device, world_size: int) -> _Flush:
        """A flush of ``names`` that keeps what the current one published for the names that stay."""
        quantiled = [i for i, n in enumerate(names) if self._tracks("quantiles", n)]
        straggled = [i for i, n in enumerate(names) if self._tracks("stragglers", n)]
        tracked = _Tracked(self.sketch if quantiled or straggled else None, quantiled, straggled)
        return _Flush(names, device, world_size, tracked, self._flush)

    def _receive(self, table: _Table) -> None:
        """Take a drained table (read-only; a lent one only until the update that drained it ends)."""
        self._tables.append(table)
        if len(self._tables) >= _COMPACT_AFTER:
            self._tables = [self._combine()]

    def _detach(self) -> None:
        """Forget what was received (``clear_statistics()``)."""
        self._tables = []

    def discard(self) -> None:
        """Drop what was reported since the last update (e.g. the values of Lightning's sanity check).
        Local: no collective; values pending for other collectors are handed to them."""
        reporting._drain()
        self._tables = []

    def __getstate__(self) -> dict[str, Any]:
        # pending values stay in the process that reported them; the ranks agree again where it runs
        return {**self.__dict__, "_tables": [], "_agreed_in": None, "_slot": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        reporting._register(self)

    def _combine(self) -> _Table:
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
        Synchronizes host and device (it reads the fingerprints of the MAX all-reduce and whether
        a name needs another reduction). Collectives on the sync device: two all-reduces, three to
        five when the name set changed (see the class docstring).

        Raises:
            RuntimeError: the ranks' collectors differ in their arguments (on every rank, naming the
                ranks and this rank's arguments); nothing is published and the values received stay
                for the next update.
        """
        release = reporting._drain(self)  # the rows of the values drained, lent while reading them
        try:
            table = self._combine()
            self._tables = []
            try:
                self._publish(table)
            except BaseException:
                self._tables = [table.copy()]  # nothing lost: the next update reduces them
                raise
        finally:
            release()

    def _publish(self, local: _Table) -> None:
        """Agree, reduce the rows of ``local`` and finish (class docstring)."""
        settings = reporting._sync_settings()
        rank, device, group = settings
        world_size = dist.get_world_size(group=group) if device is not None and is_distributed() else 1
        rank = rank if world_size > 1 else 0
        device = device if device is not None else local.sums.device
        if self._flush.published.device != device or self._flush.world_size != world_size:
            self._flush = self._new_flush(self._flush.names, device, world_size)
        candidate = self._candidate_names(local.names)
        if world_size == 1:  # agree with no one, reduce nothing, finish
            if candidate is not self._flush.names:
                self._flush = self._new_flush(candidate, device, world_size)
            flush = self._flush
            flush.payloads(self._aligned(local, device), flush.next_shift, 0.0, rank)
            flush.finish(flush.next_shift, self.keep_previous)  # one rank: no name needs recentering
            return
        local, center = self._agree_and_reduce(candidate, local, settings._replace(rank=rank), world_size)
        if self._flush.finish(center, self.keep_previous):  # rare; the same on every rank
            center = self._flush.mean_max()
            self._reduce_sum_again(local, center, rank, group)
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

    def _aligned(self, local: _Table, device: torch.device) -> _Table:
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

    def _payloads(
        self, flush: _Flush, table: _Table, center: torch.Tensor, names: list[str], rank: int
    ) -> None:
        """Both payloads of ``flush``, with this rank's fingerprints of its configuration and ``names``."""
        if self._slot is None or self._slot[0] != (rank, flush.world_size):
            slot = torch.full((flush.world_size,), -math.inf, dtype=torch.float64)
            slot[rank] = _fingerprint([self._configuration()])
            self._slot = ((rank, flush.world_size), slot)
        flush.configurations.copy_(self._slot[1])
        flush.payloads(table, center, self._fingerprint(names), rank)

    def _agree_and_reduce(
        self, candidate: list[str], local: _Table, settings: _SyncSettings, world_size: int
    ) -> tuple[_Table, torch.Tensor]:
        """Steps 1 and 2 (class docstring): both all-reduces over the agreed names, and again over
        the union when the ranks' names differ; returns the aligned local table and the SUM's center."""
        rank, _, group = settings
        flush, device = self._flush, self._flush.published.device
        aligned, center = self._aligned(local, device), flush.next_shift
        self._payloads(flush, aligned, center, candidate, rank)
        works = [all_reduce_(flush.max_buffer, op=dist.ReduceOp.MAX, group=group, async_op=True)]
        head = None
        if self._agreed_in != settings:  # the SUM's size depends on the configuration: check it first
            works.pop().wait()
            head = self._check_configurations(rank)
        if flush.sum_buffer.numel():
            works.append(all_reduce_(flush.sum_buffer, op=dist.ReduceOp.SUM, group=group, async_op=True))
        for work in works:
            work.wait()
        fp_max, neg_fp_min = head if head is not None else self._check_configurations(rank)
        self._agreed_in = settings
        if fp_max != -neg_fp_min:  # ranks know different name sets: agree on the sorted union
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, candidate, group=group)
            names = sorted(set().union(*gathered))
        elif candidate == flush.names:
            return aligned, center
        else:
            names = candidate
        flush = self._flush = self._new_flush(names, device, world_size)  # the same decision on every rank
        aligned = _merged(names, [local], device)
        self._payloads(flush, aligned, flush.next_shift, names, rank)
        all_reduce_(flush.max_buffer, op=dist.ReduceOp.MAX, group=group)
        center = flush.mean_max()  # the largest rank mean: inside the data range
        self._reduce_sum_again(aligned, center, rank, group)
        return aligned, center

    def _check_configurations(self, rank: int) -> list[float]:
        """Raise on every rank unless the reduced MAX holds the same configuration from every rank;
        else return its ``[max(fp), max(-fp)]`` of the names (a host read)."""
        flush = self._flush
        head = flush.max_buffer[: flush.world_size + 2].tolist()  # identical on every rank
        configurations, mine = head[: flush.world_size], head[rank]
        others = [r for r, fp in enumerate(configurations) if fp != mine]
        if others:
            same = [r for r, fp in enumerate(configurations) if fp == mine]
            raise RuntimeError(
                f"Collector.update: the ranks' collectors differ: ranks {same} have "
                f"{self._configuration()}, ranks {others} another configuration; nothing was published. "
                "HINT: create the Collector (or TrainingStats) with the same arguments on every rank."
            )
        return head[flush.world_size :]

    def _reduce_sum_again(self, aligned: _Table, center: torch.Tensor, rank: int, group: Any) -> None:
        """Redo the SUM all-reduce about ``center``, keeping the reduced MAX buffer."""
        flush = self._flush
        reduced = flush.max_buffer.clone()
        flush.payloads(aligned, center, 0.0, rank)
        flush.max_buffer.copy_(reduced)
        all_reduce_(flush.sum_buffer, op=dist.ReduceOp.SUM, group=group)

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
        close = difflib.get_close_matches(name, self.names(), n=5, cutoff=0.5)
        never = self._matches(name)  # a misspelt name, or one asked for before its first update
        why, hint = (
            ("was never reported to", "check the spelling, or update() after reporting it")
            if never
            else ("is not collected by", "widen the regex or create another Collector for it")
        )
        raise KeyError(f"{name!r} {why} Collector(regex={self.regex!r}); close names: {close}. HINT: {hint}.")

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

    def _sketch_row(self, arg: str, name: str) -> int | None:
        """Row of ``name``'s published histogram for ``arg`` (``"quantiles"``: its values,
        ``"stragglers"``: its rank means), or ``None`` when it has none yet."""
        self._get(name)  # raises for names regex excludes
        if not self._tracks(arg, self._prefix + name):
            raise KeyError(f"{name!r} is not matched by Collector({arg}={getattr(self, arg)!r})")
        flush = self._flush
        i = flush.index.get(self._prefix + name)
        if arg == "quantiles":
            return flush.quantiled.index(i) if i in flush.quantiled else None
        return len(flush.quantiled) + flush.straggled.index(i) if i in flush.straggled else None

    def quantile(self, name: str, q: float) -> float:
        """The ``q``-quantile of ``name``'s values in the last interval over all ranks (NumPy's
        ``method="inverted_cdf"``), within ``relative_accuracy`` for values in ``value_range``
        (:class:`~lightning_ext.stats.LogHistogram` says what happens outside it); NaN without
        values. Reads the sketches from the device once per update.

        Raises:
            TypeError, ValueError: ``q`` is not a number in ``(0, 1)``.
            KeyError: ``quantiles`` does not match ``name`` (or ``regex`` excludes it).
        """
        q = _check_quantile(q)
        row = self._sketch_row("quantiles", name)
        if row is None:
            return math.nan
        _, _, _, lo, hi = self._get(name)
        return self.sketch.quantile(self._flush.host_sketches()[0][row], q, lo, hi)

    def histogram(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``name``'s sketch of the last update, merged over all ranks, as :func:`numpy.histogram`
        returns one: float64 ``counts`` ``(k,)`` and ``edges`` ``(k + 1,)``, bucket ``i`` holding the
        values between ``edges[i]`` and ``edges[i + 1]``; the buckets from the first to the last one
        with values (``k = 0`` without values), the edges clipped to the exact min and max (not NaN). The
        counts sum to ``num`` minus the NaNs. Reads the sketches from the device once per update.

        Raises:
            KeyError: ``quantiles`` does not match ``name`` (or it was never reported).
        """
        row = self._sketch_row("quantiles", name)
        counts = np.zeros(0) if row is None else self._flush.host_sketches()[0][row]
        edges = self.sketch.edges().numpy()
        edges = np.concatenate(([-np.inf], -edges[::-1], edges, [np.inf]))  # the kernel op's layout
        used = np.flatnonzero(counts)
        if not used.size:
            return np.zeros(0), np.zeros(0)
        _, _, _, lo, hi = self._get(name)
        return counts[used[0] : used[-1] + 1].copy(), np.fmin(np.fmax(edges[used[0] : used[-1] + 2], lo), hi)

    def unmatched(self) -> dict[str, list[str]]:
        """``{argument: names}`` for each pattern (``regex``, ``quantiles``, ``stragglers``) that matched
        none of :meth:`names` at the last update, with the names it may have meant: for ``regex``
        (matched nothing on any rank) the names this process reported to this stage since the last
        collector was created, for the others :meth:`names`. Local, no collective."""
        names = self.names()
        if not names:
            keys = (key.rpartition(_STAGE_SEPARATOR) for key in reporting._state.wanted)
            return {"regex": sorted(name for stage, _, name in keys if (stage or None) == self.stage)}
        return {
            arg: names
            for arg, pattern in self._tracked.items()
            if pattern is not None and not any(self._tracks(arg, self._prefix + n) for n in names)
        }

    def straggler(self, name: str) -> Straggler | None:
        """The rank whose mean of ``name`` was the largest in the last interval, its mean, the
        median of the ranks' means and their ratio (:class:`Straggler`); ``None`` when no rank had
        values of ``name`` then.

        Raises:
            KeyError: ``stragglers`` does not match ``name`` (or ``regex`` excludes it).
        """
        row = self._sketch_row("stragglers", name)
        if row is None:
            return None
        counts, slowest = self._flush.host_sketches()
        packed = slowest[row - len(self._flush.quantiled)]
        if not math.isfinite(packed):
            return None
        rank = int(np.float64(packed).view(np.int64)) & ((1 << _rank_bits(self._flush.world_size)) - 1)
        _, _, _, lo, hi = self._get(name)
        upper = 0.5 + 0.5 / counts[row].sum()  # the upper middle rank: the two middle ones' mean
        median = sum(self.sketch.quantile(counts[row], q, lo, hi) for q in (0.5, upper)) / 2
        return Straggler(rank, packed, median, packed / median if median else math.inf)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {"num", "mean", "std", "min", "max"}}`` for every name of :meth:`names`."""
        keys = ("num", "mean", "std", "min", "max")
        return {name: dict(zip(keys, values)) for name, values in self._flush.read(len(self._prefix)).items()}

    def state_dict(self) -> dict[str, Any]:
        """The published statistics and agreed names, and the quantile sketches (what
        ``keep_previous`` needs after a resume)."""
        values = self._flush.read(len(self._prefix))
        flush, cut = self._flush, len(self._prefix)
        sketches = {flush.names[i][cut:]: flush.sketches[j].cpu() for j, i in enumerate(flush.quantiled)}
        return {
            "names": self.names(),
            "values": {k: list(v) for k, v in values.items()},
            "sketches": sketches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same checkpoint must be loaded on every rank)."""
        names, values = sorted(state["names"]), state["values"]
        rows = [values.get(name, _UNPUBLISHED) for name in names]
        names = [self._prefix + name for name in names]
        self._seen.update(names)
        device = self._flush.published.device
        self._flush = _Flush([], device, self._flush.world_size)
        self._flush = flush = self._new_flush(names, device, self._flush.world_size)
        self._agreed_in = None  # the SUM's size depends on the configuration again
        flush.published.copy_(torch.tensor(rows, dtype=torch.float64).reshape(-1, 5))
        has = flush.published[:, 0] > 0
        flush.next_shift.copy_(torch.where(has, flush.published[:, 1], 0.0).nan_to_num(0.0, 0.0, 0.0))
        sketches, cut = state.get("sketches", {}), len(self._prefix)
        for j, i in enumerate(flush.quantiled):
            counts = sketches.get(names[i][cut:])
            if counts is not None and counts.numel() == flush.sketches.shape[1]:
                flush.sketches[j].copy_(counts)

    def __repr__(self) -> str:
        extras = "" if self.stage is None else f", stage={self.stage!r}"
        extras += "" if self.quantiles is None else f", quantiles={self.quantiles!r}"
        extras += "" if self.stragglers is None else f", stragglers={self.stragglers!r}"
        return f"Collector(regex={self.regex!r}, keep_previous={self.keep_previous}{extras})"
