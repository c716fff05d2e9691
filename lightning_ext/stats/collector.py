"""``Collector``: reduce the values reported since its last ``update()`` across devices and ranks."""

from __future__ import annotations

import bisect
import difflib
import functools
import hashlib
import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from lightning_ext._checks import check_bool, check_int, check_label, check_number, check_regex
from lightning_ext.distributed import all_reduce_, is_distributed
from lightning_ext.stats import reporting
from lightning_ext.stats._wire import Store
from lightning_ext.stats.sketch import LogHistogram

__all__ = ["Collector", "Straggler"]

_UNPUBLISHED = (0.0, math.nan, math.nan, math.nan, math.nan, 0.0)  # [n, mean, std, min, max, nonfinite]
_HEAD = 7  # the MAX's head: [configuration, -configuration, names, -names, step, -step, count bound]
WORDS = 640  # float64 words of one sketch row's window in the SUM at most: 5 KiB
_CPU = torch.device("cpu")


def _fingerprint(text: str | list[str]) -> float:
    """A 48-bit hash of ``text`` (of a list of names: with their number), never 0, as an exactly
    representable float64 (for MAX agreement)."""
    text = text if isinstance(text, str) else f"{len(text)}\x00" + "\x00".join(text)
    return float(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big") + 1)


class Straggler(NamedTuple):
    """The rank whose mean of a statistic was the largest in an interval (:meth:`Collector.straggler`).

    ``rank``: its rank in the collector's process group; ``mean``: its mean (to ``2**(b - 52)``
    relatively, ``b`` the bits of the largest rank: the rank rides in the low bits of the float64
    mean); ``median``: the median of the ranks' means (the mean of the two middle ones for an even
    number of ranks: of both, with two), within the sketch's relative accuracy; ``ratio``: ``mean /
    median``.
    """

    rank: int
    mean: float
    median: float
    ratio: float


@functools.cache
def _field_shifts(bits: int) -> np.ndarray:
    """int64 ``(53 // bits,)``: the shift ``f bits`` of each field ``f`` of a packed word (none for 0
    bits: a row without values)."""
    return np.arange(0, 53 // bits * bits, bits, dtype=np.int64) if bits else np.zeros(0, np.int64)


def _rank_bits(world_size: int) -> int:
    """Low mantissa bits of a packed rank mean that hold the rank."""
    return max(1, (world_size - 1).bit_length())


def _nonzero(words: list[float], bits: int) -> Iterator[tuple[int, int]]:
    """``(slot, count)`` of each non-zero count packed in ``words`` (``bits`` bits a field, ``53 // bits``
    fields a word, field ``f`` of word ``w`` the slot ``w (53 // bits) + f``), in slot order."""
    k, ones = 53 // bits, (1 << bits) - 1
    for w, word in enumerate(map(int, words)):
        while word:  # the lowest field with a set bit, then the word without it
            f = ((word & -word).bit_length() - 1) // bits
            yield w * k + f, (word >> f * bits) & ones
            word &= ~(ones << f * bits)


class Collector:
    """Collect the statistics reported with :func:`~lightning_ext.stats.report` whose names match ``regex``.

    :meth:`update` reduces across ranks what was reported since this collector's previous update on
    every device of this process, and publishes per name the count ``num`` of finite values, their
    mean, population standard deviation (divide by ``num``, as NVIDIA's ``training_stats``), min and
    max, and the count of non-finite values (NaN, ``±inf``: :meth:`nonfinite`), identical on every
    rank; each collector sees every value once. The queries (``num``, ``mean``, ``std``, ``min``,
    ``max``, ``c[name]`` for the mean) give 0/NaN for a name without finite values in the interval and
    raise ``KeyError`` (listing close names) for a name not among :meth:`names` (never reported on any
    rank before the last update, forgotten, or one ``regex`` excludes), ``TypeError`` for a non-str. A
    collector sees the values reported while it exists.

    Opt-in per name: :meth:`quantile` and :meth:`histogram` for the names ``quantiles`` matches, from a
    mergeable sketch (:class:`~lightning_ext.stats.LogHistogram`: relative accuracy
    ``relative_accuracy`` for magnitudes in ``value_range``; at most 5 KiB per name per flush on the
    wire), and :meth:`straggler`, the rank with the largest mean and its ratio to the median rank, for
    the names ``stragglers`` matches. Both ride in the same two all-reduces.

    Distributed protocol, over the ``R`` names agreed at the previous update; the buffers' layout is
    in ``_layout``, O(1) per name whatever the number of ranks:

    1. *agree*: the MAX carries pairs ``[x, -x]`` of what every rank must share, equal on every rank
       iff ``max(x) == -max(-x)``: a fingerprint of the configuration (every argument), the step
       (``update(step=...)``, ``-1`` without) and a fingerprint of the sorted names this rank knows
       now. A configuration or step that differs: every rank (each sees the same MAX) runs ONE
       ``all_gather_object`` of its configuration and step and raises a ``RuntimeError`` naming the
       ranks and their values, before anything is published; the values stay for the next update.
       Names that differ: one ``all_gather_object`` agrees on their sorted union, and the MAX runs
       again on the new rows. Until the ranks agreed once, the SUM (whose size depends on the
       configuration) waits for this check.
    2. *reduce*: the kernel backend's ``moments_payload_`` (the maths:
       :mod:`lightning_ext.kernels.moments`) writes each name's extremes and rank mean (``-inf``
       without local values) for the MAX, and ``[n, m2, n d, n d^2, nonfinite]`` (``d`` the local mean
       minus the mean published by the previous update) for the SUM, after which come the sketch
       windows (``pack_windows_``, :mod:`lightning_ext.kernels.histogram`), cut where the MAX says
       every rank's values lie. Without sketched names both all-reduces run together (async), else
       the SUM follows the MAX.
    3. *finish*: ``moments_finish_`` publishes the statistics in one pass, empties the accumulator
       rows for the next interval, and says whether a name lost precision to cancellation (then the
       SUM is redone around the largest rank mean: rare) and whether names went ``forget_after``
       updates without values on any rank: they are forgotten on every rank alike, and come back as
       new names when reported again.

    On the steady path (the same names as before) the flush runs no Python per name: two ops (three
    with sketches), two all-reduces, two host reads. Over a gloo group on one host the all-reduces
    use shared memory (:func:`lightning_ext.distributed.all_reduce_`). Without ``torch.distributed`` (or after
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
        forget_after: updates in a row without a value on any rank after which a name is forgotten
            (an int ``>= 1``; ``None``: never), so that the flush costs what the names in use cost; an
            update at the ``step`` of the previous one (a publication of late values) does not count.

    Raises:
        TypeError: ``regex``/``quantiles``/``stragglers`` is not a str (the last two: or None),
            ``keep_previous`` not a bool, ``stage`` not a str or None, a sketch parameter not a number,
            ``forget_after`` not an int or None.
        ValueError: a pattern does not compile, ``stage`` is empty or holds a control character,
            a sketch parameter is out of range (:class:`~lightning_ext.stats.LogHistogram`),
            ``forget_after < 1``.

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report
        >>> clear_statistics(); c = Collector(regex="Loss/.*", quantiles="Loss/total")
        >>> _ = report("Loss/total", [1.0, 2.0, 3.0, float("nan")]); _ = report("Other", 5.0)
        >>> c.update(); c.names(), c.mean("Loss/total"), round(c.std("Loss/total"), 4)
        (['Loss/total'], 2.0, 0.8165)
        >>> c.num("Loss/total"), c.nonfinite("Loss/total")  # the NaN counts apart
        (3, 1)
        >>> round(c.quantile("Loss/total", 0.5), 2)  # 2.0 within 1 %
        1.99
        >>> c.update(); c["Loss/total"]  # keep_previous=True: nothing new, previous values kept
        2.0
    """

    def __init__(
        self, regex: str = ".*", keep_previous: bool = True, stage: str | None = None,
        quantiles: str | None = None, relative_accuracy: float = 0.01,
        value_range: tuple[float, float] = (1e-6, 1e6), stragglers: str | None = None,
        forget_after: int | None = 100,
    ) -> None:  # fmt: skip
        self._pattern = check_regex("Collector", "regex", regex)
        check_bool("Collector", "keep_previous", keep_previous)
        if stage is not None:
            check_label("Collector", "stage", stage)
        tracked = {"quantiles": quantiles, "stragglers": stragglers}.items()  # None: matching nothing
        self._tracked = {a: check_regex("Collector", a, "(?!)" if p is None else p) for a, p in tracked}
        self.sketch = LogHistogram(relative_accuracy, value_range)  # checks them
        check_int("Collector", "forget_after", forget_after, ge=1, optional=True)
        self.regex, self.keep_previous, self.stage = regex, keep_previous, stage
        self.quantiles, self.stragglers, self.forget_after = quantiles, stragglers, forget_after
        self._index, self._row = {}, {}  # (what _layout carries over: nothing yet)
        self._layout([], _CPU, 1)
        self._agreed_in: Any = None  # the (device, group) in which the ranks agreed on the configuration
        self._step: int | None = None  # of the last update
        self._fingerprint = _fingerprint(repr(self))
        self._attach()

    def _attach(self) -> None:
        sketch = self.sketch if self.quantiles is not None else None
        self._store = Store(self.stage, self._pattern.fullmatch, self._tracked["quantiles"].fullmatch, sketch)
        self._store.layout(self._names)
        reporting._attach(self, self._store)

    def __repr__(self) -> str:
        """Every argument: what the ranks' collectors must share (what is reduced and published)."""
        return (
            f"Collector(regex={self.regex!r}, keep_previous={self.keep_previous}, stage={self.stage!r}, "
            f"quantiles={self.quantiles!r}, relative_accuracy={self.sketch.relative_accuracy!r}, "
            f"value_range={self.sketch.value_range!r}, stragglers={self.stragglers!r}, "
            f"forget_after={self.forget_after!r})"
        )

    def _tracks(self, arg: str, name: str) -> bool:
        """Whether the pattern ``arg`` (``"quantiles"`` or ``"stragglers"``) tracks ``name``."""
        return self._tracked[arg].fullmatch(name) is not None

    @torch.inference_mode(False)
    def _layout(self, names: list[str], device: torch.device, world: int) -> None:
        """Agree on ``names`` (sorted) on ``device`` among ``world`` ranks, keeping what was published
        for the names that stay. Over ``R`` names, ``N`` sketch rows (the names ``quantiles`` matches:
        their values, then those ``stragglers`` matches: their ranks' means; ``at``: each row's name)::

            max (7 + 5R,)    [configuration, -c, names, -n, step, -s, bound | max | -min | mean | -mean |
                              mean with the rank in its low bits]
            sum (5R + N W,)  [n, m2, n d, n d^2, nonfinite] per name | the N sketch windows, packed

        (``moments_payload_``, ``pack_windows_`` and ``moments_finish_`` write and read them, ``W <= 640``
        words per window): the MAX's size depends on ``R`` alone (the configuration is checked in it),
        the SUM's on the configuration too. Kept: ``published`` float64 ``(R, 6)`` ``[n, mean, std, min,
        max, nonfinite]``; ``next_shift`` ``(R,)``, the center of the next SUM (each name's last mean);
        ``idle`` ``(R,)``, updates in a row without values; on the host each sketch row's window
        ``(level, start, counts)`` and the reduced packed rank means. The buffers are scratch: a failed
        update leaves what was published. Normal tensors, not inference tensors: an update in inference
        mode may lay out what training updates use."""
        r, f64 = len(names), {"dtype": torch.float64, "device": device}
        rows = [(arg, i) for arg in self._tracked for i, n in enumerate(names) if self._tracks(arg, n)]
        state = torch.tensor(_UNPUBLISHED, **f64).repeat(r, 1), torch.zeros(r, **f64), torch.zeros(r, **f64)
        pairs = [(i, self._index[n]) for i, n in enumerate(names) if n in self._index]
        if pairs:
            dst, src = (torch.tensor(ix, device=device) for ix in zip(*pairs))
            for new, old in zip(state, (self._published, self._next_shift, self._idle)):
                new[dst] = old.to(device)[src]
        self._published, self._next_shift, self._idle = state
        sketch = np.zeros((3, len(rows)), np.int64), np.zeros((len(rows), 1)), np.full(len(rows), -math.inf)
        pairs = [(j, self._row[a, names[i]]) for j, (a, i) in enumerate(rows) if (a, names[i]) in self._row]
        if pairs:  # (0 bits: no values)
            dst, src = map(list, zip(*pairs))
            sketch = sketch[0], np.zeros((len(rows), self._words.shape[1])), sketch[2]
            for new, old in zip((sketch[0].T, *sketch[1:]), (self._windows.T, self._words, self._slowest)):
                new[dst] = old[src]
        self._windows, self._words, self._slowest = sketch  # each sketch row's level, start and bits a
        # count; its words (float64 words: their integers, below 2^53, are exact); its name's packed
        # largest rank mean (-inf: no rank had values; read for the stragglers' rows)
        self._memo: dict[Any, Any] = {}  # what the queries read from the last update, read once (_once)
        self._names, self._device, self._world = names, device, world
        self._index, self._names_fp = {n: i for i, n in enumerate(names)}, _fingerprint(names)
        self._row = {(a, names[i]): j for j, (a, i) in enumerate(rows)}
        self._q = sum(a == "quantiles" for a, _ in rows)
        self._named = np.array([i for _, i in rows], np.int64)  # each sketch row's name, on the host
        self._at = torch.from_numpy(self._named).to(device)
        self._max = torch.full((_HEAD + 5 * r,), -math.inf, **f64)
        self._sum = torch.zeros(5 * r + len(rows) * WORDS, **f64)
        self._extremes, self._moments = self._max[_HEAD:], self._sum[: 5 * r].view(r, 5)
        self._counted, self._edges = self._at[: self._q], self.sketch.edges(device) if rows else None
        self._packed = self._sum[5 * r :]  # the sketch windows' part of the SUM
        self._cut = torch.zeros(3 * len(rows) + 2, dtype=torch.int64, device=device)  # pack_windows_'s layout
        self._flags = torch.zeros(2, **f64)  # moments_finish_'s [again, forgettable]
        # NumPy views of the buffers read on the host, made once: a fresh tensor.numpy() costs several
        # times a NumPy read in a flush that starts with cold caches (bench_stats.py)
        host = ("max", "sum", "idle", "cut", "published", "flags") if device.type == "cpu" else ()
        self._views = {key: getattr(self, f"_{key}").numpy() for key in host}

    def _host(self, key: str) -> np.ndarray:
        """The buffer ``_<key>`` (``"max"``, ``"sum"``, ``"idle"``, ``"cut"``, ``"published"`` or
        ``"flags"``) as NumPy: the view kept on the CPU, else a copy (a host-device sync)."""
        return self._views[key] if key in self._views else getattr(self, f"_{key}").cpu().numpy()

    def discard(self) -> None:
        """Drop what was reported since the last update (e.g. the values of Lightning's sanity check).
        Local: no collective."""
        self._store.reset()

    def __getstate__(self) -> dict[str, Any]:
        # pending values stay in the process that reported them; the ranks agree again where it runs
        return {**self.__dict__, "_store": None, "_agreed_in": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._layout(self._names, self._device, self._world)  # the buffers' views again
        self._attach()

    def update(self, step: int | None = None) -> None:
        """Reduce everything reported since the last ``update()`` and publish it.

        Must be called on every rank, in the same order relative to other collectors' updates.
        Synchronizes host and device (it reads the agreement of the MAX all-reduce, and whether a name
        needs another reduction). Collectives on the sync device: two all-reduces; more when the name
        set changed, a name needs another reduction, or the ranks disagree (class docstring).

        Args:
            step: the training step (iteration) of this update, an int ``>= 0`` that every rank passes
                alike (or ``None`` on every rank): a rank that skipped or added an update then raises
                with the others, naming the steps. Without a step, each rank's k-th update meets the
                others' k-th, whatever step they are at.

        Raises:
            RuntimeError: the ranks' collectors differ in their arguments or step, or
                :func:`~lightning_ext.stats.init_multiprocessing` gave a rank another rank than its own
                in its ``process_group`` (on every rank, naming the ranks and their arguments, steps or
                wrong ranks); nothing is published and the values received stay for the next update.
            TypeError, ValueError: ``step`` is not an int ``>= 0`` or ``None``.
            ValueError: :func:`~lightning_ext.stats.init_multiprocessing` was given a
                ``process_group`` this process is outside of.
        """
        if not (step is None or (type(step) is int and step >= 0)):  # (the check's cost, in every flush)
            check_int("Collector.update", "step", step, ge=0, optional=True)
        rank, device, group = settings = self._store.settings()
        world = dist.get_world_size(group=group) if device is not None and is_distributed() else 1
        self._said = None if world == 1 or rank == (true := dist.get_rank(group)) else (rank, true)
        if self._said and true < 0:  # outside the group: no collective to join (inside: every rank raises)
            raise ValueError(f"Collector.update: init_multiprocessing(rank={rank}) in a process outside "
                             "its process_group: pass the group this process belongs to")
        if device is None:  # single process: where the values are
            device = next(iter(self._store.slabs)) if len(self._store.slabs) == 1 else _CPU
        if device != self._device or world != self._world:
            self._layout(self._names, device, world)
        same, self._step = step is not None and step == self._step, step  # late values at a step: an
        forget, rank = 0 if same else self.forget_after or 0, rank if world > 1 else 0  # uncounted update
        forgettable = self._reduce(float(-1 if step is None else step), rank, settings, forget)
        if same:  # its names without values: not updated(), nor one more update without values
            self._idle.sub_(self._idle.gt(0) * (1.0 - 2.0**-20))
        if forgettable:  # the same on every rank: the idle counts come from the reduced counts
            names = [n for n, i in zip(self._names, self._host("idle")) if i < self.forget_after]
            self._layout(names, self._device, self._world)
            self._store.layout(names)

    def _reduce(self, step: float, rank: int, settings: Any, forget: int) -> int:
        """Agree, reduce and finish (class docstring); the names that may be forgotten."""
        store, group, world = self._store, settings[2], self._world
        extra, local = store.extra(), store.local(self._device)
        names = sorted({*self._names, *extra}) if extra else self._names
        self._write(local, self._next_shift, rank, _fingerprint(names) if extra else self._names_fp, step)
        together = not self._row and self._agreed_in == settings[1:]  # (not the rank: it may be wrong)
        works = [_all_reduce(self._max, dist.ReduceOp.MAX, group, world, True)]
        works += [_all_reduce(self._moments, dist.ReduceOp.SUM, group, world, True)] if together else []
        for work in filter(None, works):
            work.wait()
        head = self._host("max")[:_HEAD].tolist()  # pairs [x, -x], alike on all ranks iff max(x) == -max(-x)
        if head[0] != -head[1] or head[4] != -head[5]:  # the configuration or the step
            self._disagree(group, world, step)
        self._agreed_in, center, bound = settings[1:], self._next_shift, head[-1]
        if extra or head[2] != -head[3]:  # the names: the same decision on every rank
            if head[2] != -head[3]:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, names, group=group)
                names = sorted(set().union(*gathered))
            store.layout(names)
            self._layout(names, self._device, world)
            local = store.local(self._device)
            self._write(local, self._next_shift, rank, self._names_fp, step)
            _all_reduce(self._max, dist.ReduceOp.MAX, group, world)
            center, together, bound = self._recenter(local, rank), False, self._max[_HEAD - 1].item()
        windows = self._pack(local, int(bound * world).bit_length()) if self._row else None
        if not together:
            size = 5 * len(self._names) + (len(self._named) * int(windows[-2]) if windows is not None else 0)
            _all_reduce(self._sum[:size], dist.ReduceOp.SUM, group, world)
        again, forgettable = self._finish(local, center, forget)  # (the rows emptied unless again)
        if again:  # rare; the same on every rank
            self._idle.sub_(1).clamp_(min=0)  # (the second finish counts the idle names' update again)
            center = self._recenter(local, rank)
            _all_reduce(self._moments, dist.ReduceOp.SUM, group, world)
            again, forgettable = self._finish(local, center, forget)
        if windows is not None:
            self._publish_sketches(windows)
        if again or not local[3]:  # rows not emptied, or merged from several devices' (and their counts)
            store.reset()
        return forgettable

    def _write(self, local: tuple, center: torch.Tensor, rank: int, names_fp: float, step: float) -> None:
        """Both payloads from this process's rows ``local`` (``Store.local``), about ``center``; the MAX's
        head holds the pairs of the configuration's fingerprint, ``names_fp`` and ``step``, and the
        largest count of a name with values sketched here."""
        fp = -1.0 - self._said[1] if self._said else self._fingerprint  # a wrong rank: what no rank shares
        head = [fp, -fp, names_fp, -names_fp, step, -step]
        args = (*local[:2], center, head, self._counted, rank, _rank_bits(self._world))
        self._store.backend(self._device).run("moments_payload_", self._max, self._moments, *args)

    def _recenter(self, local: tuple, rank: int) -> torch.Tensor:
        """Write the SUM's moments again about the largest rank mean (inside the data), keeping the
        reduced MAX; returns that center."""
        center, reduced = self._extremes.view(5, len(self._names))[2].clone(), self._max.clone()  # rank means
        self._write(local, center, rank, 0.0, 0.0)
        self._max.copy_(reduced)
        return center

    def _finish(self, local: tuple, center: torch.Tensor, forget: int) -> tuple[int, int]:
        """Publish (``moments_finish_``, which empties the rows ``local`` unless ``again``); ``(again,
        forgettable)``, one host read."""
        out, self._memo = (self._published, self._next_shift, self._idle, self._flags, *local[:2]), {}
        args = (self._extremes, self._moments, center, self.keep_previous, forget)
        self._store.backend(self._device).run("moments_finish_", *out, *args)
        return tuple(int(flag) for flag in self._host("flags").tolist())  # (again, forgettable)

    def _pack(self, local: tuple, bits: int) -> np.ndarray:
        """Write this rank's sketch windows after the moments in the SUM (``pack_windows_``, which zeroes
        the counts it reads), cut where the reduced MAX says each row's values lie; their layout
        (``pack_windows_``'s)."""
        args = (*local[:2], self._extremes, self._at, self._edges, bits, WORDS)
        self._store.backend(self._device).run("pack_windows_", self._packed, local[2], self._cut, *args)
        return self._host("cut")

    def _publish_sketches(self, layout: np.ndarray) -> None:
        """Keep the reduced windows of the rows with values, packed (the others keep theirs with
        ``keep_previous``; a straggler name's rank means are of its last interval only)."""
        n, r, (w, full), summed = len(self._named), len(self._names), layout[-2:].tolist(), self._host("sum")
        words = summed[5 * r : 5 * r + n * w].reshape(n, w).copy()
        windows = layout[: 3 * n].reshape(3, n).copy()  # level, start, bits a count (0: no values)
        if full < n:  # the rows of names without values (nor non-finite ones) keep their window
            idle = summed[4 : 5 * r : 5][self._named] == 0  # (keep_previous, as the statistics)
            keep = (windows[2] == 0) & idle & (np.arange(n) < self._q) & self.keep_previous
            kept, old = np.zeros((n, max(w, self._words.shape[1]))), self._words
            kept[:, :w], kept[keep, : old.shape[1]] = words, old[keep]  # (words without values: 0)
            windows, words = np.where(keep, self._windows, windows), kept
        self._windows, self._words = windows, words
        self._slowest = self._host("max")[_HEAD + 4 * r :][self._named]

    def _disagree(self, group: Any, world: int, step: float) -> None:
        """The rare round: every rank (each saw the same MAX) gathers each rank's configuration and step,
        then raises naming them; nothing was published."""
        gathered: list[Any] = [None] * world
        said = f"init_multiprocessing(rank={self._said[0]}) on rank {self._said[1]}" if self._said else None
        dist.all_gather_object(gathered, (said or repr(self), None if step < 0 else int(step)), group=group)
        said = "; ".join(  # each distinct (configuration, step) with its first ranks
            f"ranks {[r for r, v in enumerate(gathered) if v == (c, at)][:16]}: {c} at step={at}"
            for c, at in dict.fromkeys(gathered))  # fmt: skip
        raise RuntimeError(
            f"Collector.update: the ranks disagree ({said}); nothing was published, the values stay for "
            "the next update. HINT: create the Collector (or TrainingStats) with the same arguments on "
            "every rank, give init_multiprocessing each process's own rank, and update at the same steps "
            "(a rank that skipped or added an update?)"
        )

    # ------------------------------------------------------------------ queries

    def names(self) -> list[str]:
        """Sorted names known to any rank at the last ``update()`` (matching ``regex``)."""
        return list(self._names)

    def updated(self) -> list[str]:
        """Sorted names that received values (on any rank, finite or not) in the last ``update()``'s
        interval: the rest of :meth:`names` only repeat earlier statistics (``keep_previous``) or NaN."""
        return list(self._once("updated", lambda: [  # (one host read of the idle counts per update)
            n for n, i in zip(self._names, self._host("idle").tolist()) if not i]))  # fmt: skip

    def _once(self, key: Any, read: Any) -> Any:
        """``read()``, called once per update (a host read of its buffers, or what is derived from one)."""
        return self._memo[key] if key in self._memo else self._memo.setdefault(key, read())

    def _read(self) -> dict[str, list[float]]:
        """``{name: [n, mean, std, min, max, nonfinite]}``, read from the device once per update."""
        return self._once("values", lambda: dict(zip(self._names, self._rows().tolist())))

    def _rows(self) -> np.ndarray:
        """float64 ``(R, 6)``: every name's published row, read from the device once per update."""
        return self._once("published", lambda: self._host("published"))

    def _get(self, name: str) -> list[float]:
        """``name``'s published row ``[n, mean, std, min, max, nonfinite]`` (its own row of the one host
        read: a query need not read every name's)."""
        if isinstance(name, str) and (i := self._index.get(name)) is not None:
            return self._rows()[i].tolist()
        if not isinstance(name, str):
            raise TypeError(f"statistic name must be a str, got {type(name).__name__} {name!r}")
        close = difflib.get_close_matches(name, self.names(), n=5, cutoff=0.5)
        why, hint = (
            ("was never reported to (or was forgotten by)", "check the spelling, or update() after it")
            if self._pattern.fullmatch(name)
            else ("is not collected by", "widen the regex or create another Collector for it")
        )
        raise KeyError(f"{name!r} {why} Collector(regex={self.regex!r}); close names: {close}. HINT: {hint}.")

    def num(self, name: str) -> int:
        """Number of finite values of ``name`` in the last interval, over all ranks."""
        return round(self._get(name)[0])

    def mean(self, name: str) -> float:
        """Mean of the finite values of ``name`` over the last interval and all ranks."""
        return self._get(name)[1]

    def std(self, name: str) -> float:
        """Population standard deviation (divide by ``num``) of the finite values of ``name``."""
        return self._get(name)[2]

    def min(self, name: str) -> float:
        """Minimum of the finite values of ``name`` over the last interval and all ranks."""
        return self._get(name)[3]

    def max(self, name: str) -> float:
        """Maximum of the finite values of ``name`` over the last interval and all ranks."""
        return self._get(name)[4]

    def nonfinite(self, name: str) -> int:
        """Number of non-finite values (NaN, ``±inf``) of ``name`` in the last interval, over all ranks;
        they count in none of the other statistics."""
        return round(self._get(name)[5])

    def __getitem__(self, name: str) -> float:
        return self.mean(name)

    def _tracked_row(self, arg: str, name: str) -> int:
        """``name``'s sketch row for ``arg`` (``"quantiles"`` or ``"stragglers"``), else ``KeyError``."""
        self._get(name)  # raises for names regex excludes
        if not self._tracks(arg, name):
            raise KeyError(f"{name!r} is not matched by Collector({arg}={getattr(self, arg)!r})")
        return self._row[arg, name]

    def _sketch(self, name: str) -> tuple[int, int, np.ndarray] | None:
        """``name``'s published window of values ``(level, start, counts)``, ``None`` without values."""
        return self._once(j := self._tracked_row("quantiles", name), lambda: self._unpack(j))

    def _unpack(self, j: int) -> tuple[int, int, np.ndarray] | None:
        """Sketch row ``j``'s window ``(level, start, counts)``, ``None`` without values."""
        level, start, bits = self._windows[:, j].tolist()
        words = self._words[j].astype(np.int64)[:, None]  # exact: below 2^53 (integer ops: a 25th of
        # float64 floor division's time on a full window)
        counts = ((words >> _field_shifts(bits)) & ((1 << bits) - 1)).reshape(-1).astype(np.float64)
        return (level, start, counts) if counts.any() else None

    def quantile(self, name: str, q: Any) -> Any:
        """The ``q``-quantile of ``name``'s finite values in the last interval over all ranks (NumPy's
        ``method="inverted_cdf"``), within the sketch's relative accuracy for values in ``value_range``
        (:class:`~lightning_ext.stats.LogHistogram` says where it collapses and what happens outside
        the range); NaN without values. A list or tuple ``q`` gives a list (one pass over the sketch).
        Local: no sync beyond the update's.

        Raises:
            TypeError, ValueError: ``q`` (or one of them) is not a number in ``(0, 1)``.
            KeyError: ``quantiles`` does not match ``name`` (or ``regex`` excludes it).
        """
        for p in q if isinstance(q, list | tuple) else [q]:
            check_number("Collector.quantile", "q", p, gt=0.0, lt=1.0)
        sketch = self._sketch(name) or (0, 0, np.zeros(0))
        return self.sketch.quantile(*sketch, q, *self._get(name)[3:5])

    def histogram(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``name``'s sketch of the last update, merged over all ranks, as :func:`numpy.histogram`
        returns one: float64 ``counts`` ``(k,)`` and ``edges`` ``(k + 1,)``, bucket ``i`` holding the
        values between ``edges[i]`` and ``edges[i + 1]``; the buckets from the first to the last one
        with values (``k = 0`` without values), the edges clipped to the exact min and max. The counts
        sum to ``num``.

        Raises:
            KeyError: ``quantiles`` does not match ``name`` (or it was never reported).
        """
        level, start, counts = self._sketch(name) or (0, 0, np.zeros(0))
        used = np.flatnonzero(counts)
        if not used.size:
            return np.zeros(0), np.zeros(0)
        limits = self.sketch.limits(level)[start + used[0] : start + used[-1] + 2]
        return counts[used[0] : used[-1] + 1].copy(), np.clip(limits, *self._get(name)[3:5])

    def straggler(self, name: str) -> Straggler | None:
        """The rank whose mean of ``name`` was the largest in the last interval, its mean, the
        median of the ranks' means and their ratio (:class:`Straggler`); ``None`` when no rank had
        values of ``name`` then. The first query after an update reads every straggler name's at once.

        Raises:
            KeyError: ``stragglers`` does not match ``name`` (or ``regex`` excludes it).
        """
        self._tracked_row("stragglers", name)
        return self._once("stragglers", self._stragglers).get(name)

    def _stragglers(self) -> dict[str, Straggler]:
        """Every straggler name with values: its :class:`Straggler`, from its row of the MAX (the rank in
        the low bits of its largest mean) and its sketch of the ranks' means: the mean of the buckets of
        ranks ``(n + 1) // 2`` and ``n // 2 + 1`` by cumulative count, ``n`` the ranks with values (the
        two middle ones; ``quantile(0.5 + 0.5 / n)`` would round up to ``(n + 3) / 2`` for some odd ``n``,
        e.g. 29). A window holds a count a rank, so it is read sparsely in Python (:func:`_nonzero`): a
        few host reads for every name together, where NumPy's dense unpacking costs several per name."""
        q, mask, found = self._q, (1 << _rank_bits(self._world)) - 1, {}
        rows = zip(self._named[q:].tolist(), self._windows[:, q:].T.tolist(), self._words[q:].tolist(),
                   self._slowest[q:].tolist(), self._slowest[q:].view(np.int64).tolist())  # fmt: skip
        for i, (level, start, bits), words, packed, rank in filter(lambda r: r[1][2] and any(r[2]), rows):
            (slots, counts), name = zip(*_nonzero(words, bits)), self._names[i]
            cumulative, (lo, hi) = list(itertools.accumulate(counts)), self._get(name)[3:5]
            n = cumulative[-1]  # the ranks with values; the lower and the upper middle one (1-based):
            middle = (slots[bisect.bisect_left(cumulative, nth)] for nth in ((n + 1) // 2, n // 2 + 1))
            median = sum(self.sketch.value(level, start + slot, lo, hi) for slot in middle) / 2
            found[name] = Straggler(rank & mask, packed, median, packed / median if median else math.inf)
        return found

    def unmatched(self) -> dict[str, list[str]]:
        """``{argument: names}`` for each pattern (``regex``, ``quantiles``, ``stragglers``) that matched
        none of :meth:`names` at the last update, with the names it may have meant: for ``regex``
        (matched nothing on any rank) the first names this process reported to this stage that it
        refused, for the others :meth:`names`. Local, no collective."""
        names = self.names()
        if not names:
            return {"regex": sorted(self._store.refused)}
        asked = [arg for arg in self._tracked if getattr(self, arg) is not None]  # (None: nothing asked)
        return {arg: names for arg in asked if not any(self._tracks(arg, n) for n in names)}

    def as_dict(self, names: Iterable[str] | None = None) -> dict[str, dict[str, float]]:
        """``{name: {"num", "mean", "std", "min", "max"}}`` for each of ``names`` (``None``: every name of
        :meth:`names`, from one host read per update).

        Raises:
            KeyError: a name of ``names`` is not among :meth:`names` (as the queries raise it).
            TypeError: ``names`` is a str, or holds a name that is not.
        """
        if isinstance(names, str):
            raise TypeError(f"Collector.as_dict: `names` must be a list of names, got the str {names!r}")
        rows = self._read() if names is None else {n: self._get(n) for n in names}
        return {k: dict(num=round(r[0]), mean=r[1], std=r[2], min=r[3], max=r[4]) for k, r in rows.items()}

    def state_dict(self) -> dict[str, Any]:
        """The published statistics and agreed names, the quantile sketches (what ``keep_previous``
        needs after a resume) and the updates each name went without values (``forget_after``'s)."""
        kept = {name: self._sketch(name) for arg, name in self._row if arg == "quantiles"}
        sketches = {name: (int(s[0]), int(s[1]), torch.from_numpy(s[2])) for name, s in kept.items() if s}
        settings = (self.sketch.relative_accuracy, tuple(self.sketch.value_range))
        return {"names": self.names(), "values": dict(self._read()), "sketches": sketches, "sketch": settings,
                "idle": dict(zip(self._names, self._host("idle").tolist()))}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same checkpoint must be loaded on every rank), of the names
        ``regex`` matches (a narrower ``regex`` on resume drops the others). Rows of five
        values (no non-finite count) load with a count of 0; sketches saved in another layout or with
        another ``relative_accuracy`` or ``value_range`` (their buckets are others) are not restored; a
        name without its count of updates without values (an older checkpoint) gets 1."""
        names, values = sorted(n for n in state["names"] if self._pattern.fullmatch(n)), state["values"]
        rows = [[*values[n], 0.0][:6] if n in values else _UNPUBLISHED for n in names]
        self._index = {n: i for i, n in enumerate(names)}
        self._published = published = torch.tensor(rows, dtype=torch.float64).reshape(-1, 6)
        self._next_shift = torch.where(published[:, 0] > 0, published[:, 1], 0.0)
        self._idle = torch.tensor([state.get("idle", {}).get(n, 1.0) for n in names], dtype=torch.float64)
        ours = state.get("sketch") == (self.sketch.relative_accuracy, tuple(self.sketch.value_range))
        saved = {n: s for n, s in state.get("sketches", {}).items() if isinstance(s, tuple) and ours}
        self._row = {("quantiles", n): j for j, n in enumerate(saved)}  # one count a word
        self._slowest = np.full(len(saved), -math.inf)  # (no straggler kept)
        self._windows = np.array([[s[0], s[1], 53] for s in saved.values()], np.int64).reshape(-1, 3).T
        counts = [s[2].double() for s in saved.values()]
        self._words = torch.nn.utils.rnn.pad_sequence(counts, batch_first=True).numpy() if counts else None
        self._layout(names, self._device, self._world)  # keeps what was set here
        self._store.layout(names)
        self._agreed_in = None  # the SUM's size depends on the configuration again


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, world: int, async_op: bool = False) -> Any:
    """:func:`~lightning_ext.distributed.all_reduce_` over several ranks; nothing for one."""
    return all_reduce_(tensor, op=op, group=group, async_op=async_op) if world > 1 else None
