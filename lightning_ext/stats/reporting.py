"""Report training statistics from anywhere: ``report()``, ``report0()`` and the state behind them.

Follows NVIDIA's ``torch_utils/training_stats.py`` (StyleGAN2-ADA/StyleGAN3/EDM). ``report()`` adds a
value into the :class:`_Accumulator` of its name on its device: a float64 row ``[count, sum(x - shift),
sum((x - shift)^2), min, max]`` (the layout of the kernel op ``accumulate_moments_``), its shift (the
first value since the last drain) and the counts of the sketches some collector keeps for the name.
The rows of one device live in one :class:`_Slab`. Every ``Collector.update()`` first *drains*: the
rows become one immutable :class:`_Table` handed to every live collector, so that each collector
receives exactly the values reported since *its* previous update.

All process-wide state is the one :class:`_State` in ``_state``; :func:`clear_statistics` replaces it.
The collectors (:mod:`lightning_ext.stats.collector`) are the only consumers of the tables.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
import torch

from lightning_ext import distributed
from lightning_ext._checks import check_int
from lightning_ext.kernels import KernelBackend, get_backend, moments_from_shifted
from lightning_ext.stats.moments import _EMPTY_ROW, _as_shifted, _empty_moments, merge_moments
from lightning_ext.stats.sketch import LogHistogram

if TYPE_CHECKING:
    from lightning_ext.stats.collector import Collector

__all__ = ["clear_statistics", "init_multiprocessing", "report", "report0", "set_stage"]

T = TypeVar("T")
_CPU = torch.device("cpu")
_STAGE_SEPARATOR = "\x1f"  # a staged value is filed under the key ``stage + _STAGE_SEPARATOR + name``
_MIN_ROWS = 64  # rows of a device's first accumulator block
_STRIDED = torch.strided
_UNCOUNTABLE = frozenset(  # dtypes whose elements are no real numbers
    (torch.complex32, torch.complex64, torch.complex128, torch.qint8, torch.quint8, torch.qint32,
     torch.quint4x2, torch.quint2x4)
)  # fmt: skip


class _SyncSettings(NamedTuple):
    """How collectors synchronize (:func:`init_multiprocessing`)."""

    rank: int  # in process_group
    device: torch.device | None  # the collectives' device; None: single process, no collective
    process_group: Any  # None: the default group


@dataclasses.dataclass(slots=True)
class _SketchCounts:
    """The counts of one quantile sketch of one accumulator."""

    sketch: LogHistogram
    edges: torch.Tensor  # float64 (m + 1,): sketch.edges() on the accumulator's device
    counts: torch.Tensor  # float64 (sketch.size,), the ``hist`` of accumulate_histogram_


@dataclasses.dataclass(slots=True, eq=False)
class _Accumulator:
    """What ``report()`` adds a name's values into, on one device."""

    sums: torch.Tensor  # float64 (5,): a row of the slab
    shift: torch.Tensor  # float64 0-dim: a row of the slab
    slab: _Slab
    sketches: list[_SketchCounts]  # one per sketch some collector keeps for the name, usually none
    stamp: int = -1  # the drain count when the shift was set: the next value after a drain sets it


class _Table(NamedTuple):
    """What a drain hands the collectors: sorted distinct keys ``names`` (a name, or ``stage +
    _STAGE_SEPARATOR + name``), float64 ``(len(names), 5)`` shifted ``sums`` and float64
    ``(len(names),)`` ``shifts`` (the layout of ``accumulate_moments_`` and ``moments_payload_``), and
    ``histograms``: ``{(name, sketch): float64 (sketch.size,) counts}`` of the names with values."""

    names: list[str]
    sums: torch.Tensor
    shifts: torch.Tensor
    histograms: dict[tuple[str, LogHistogram], torch.Tensor] = {}  # noqa: RUF012 (never mutated)

    def moments(self) -> torch.Tensor:
        """Float64 ``(len(names), 5)`` moment rows ``[count, mean, m2, min, max]``."""
        return moments_from_shifted(self.sums, self.shifts)

    def copy(self) -> _Table:
        """A table that owns its tensors (a drained table may be a view of the accumulator rows)."""
        return self._replace(sums=self.sums.clone(), shifts=self.shifts.clone())


def _merged(names: list[str], tables: list[_Table], device: torch.device) -> _Table:
    """The table of ``names`` on ``device``: per name, the merge of its rows in ``tables`` (empty rows
    for names no table has; names not in ``names`` are left out), histograms summed."""
    histograms: dict[tuple[str, LogHistogram], torch.Tensor] = {}
    kept = set(names) if any(table.histograms for table in tables) else ()
    for table in tables:
        for key, counts in table.histograms.items():
            if key[0] in kept:
                counts = counts.to(device)
                histograms[key] = histograms[key] + counts if key in histograms else counts
    if len(tables) == 1 and tables[0].names == names:  # nothing to reorder
        return _Table(names, tables[0].sums.to(device), tables[0].shifts.to(device), histograms)
    index = {name: i for i, name in enumerate(names)}
    rows = _empty_moments(len(names), device)
    for table in tables:
        pairs = [(index[n], i) for i, n in enumerate(table.names) if n in index]
        if pairs:
            dst = torch.tensor([p[0] for p in pairs], device=device)
            src = torch.tensor([p[1] for p in pairs], device=table.sums.device)
            rows[dst] = merge_moments(rows[dst], table.moments()[src].to(device))
    return _Table(names, *_as_shifted(rows), histograms)


class _Slab:
    """The accumulator rows of one device: a float64 ``(5,)`` row of sums and a float64 shift per name
    reported there, kept from drain to drain, so that ``report()`` finds a name's row with one dict
    lookup and a drain reads and resets every row with a few tensor ops.

    Rows live in blocks (a new one, as large as all before it, when they are full), merged into one
    block in the order of the names at the next drain. All tensors are normal ones (not inference
    tensors), so that the first value may come from Lightning's validation loop (inference mode) and
    later ones from training: in-place writes into normal tensors are allowed in inference mode.
    """

    def __init__(self, device: torch.device, backend: KernelBackend) -> None:
        with torch.inference_mode(False):
            self.empty = torch.tensor(_EMPTY_ROW, dtype=torch.float64, device=device)
            self.scratch = torch.empty((), dtype=torch.float64, device=device)  # Python numbers go here
        self.device, self.backend = device, backend
        self.clear()

    def clear(self) -> None:
        """Forget every row."""
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (sums (B, 5), shifts (B,)), in row order
        self.capacity = 0  # rows in all blocks
        self.names: list[str] = []  # the name of each row
        self.accumulators: list[_Accumulator] = []  # the accumulator of each row
        self.template: torch.Tensor | None = None  # (capacity, 5) empty rows: what a drain resets to
        self.fresh = 0  # rows that received values since the last drain
        # rows() of the last drain: a new names list whenever a name came, else the same one (the
        # collectors recognize an unchanged name set by its identity)
        self.views: tuple[torch.Tensor, torch.Tensor, list[str]] | None = None

    def take(self, name: str, sketches: list[_SketchCounts]) -> _Accumulator:
        """A new, empty accumulator row for ``name``."""
        if len(self.names) == self.capacity:
            size = max(_MIN_ROWS, self.capacity)
            with torch.inference_mode(False):
                self.blocks.append((self.empty.repeat(size, 1), self.empty.new_zeros(size)))
            self.capacity += size
            self.template = None
        sums, shifts = self.blocks[-1]
        j = len(self.names) - (self.capacity - sums.shape[0])
        with torch.inference_mode(False):
            accumulator = _Accumulator(sums[j], shifts[j], self, sketches)
        self.names.append(name)
        self.accumulators.append(accumulator)
        self.views = None
        return accumulator

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Views of the sums ``(n, 5)`` and shifts ``(n,)`` of the ``n`` rows, and their names, sorted.
        After new names came, one block holds every row in the order of the names."""
        if self.views is None:
            order = sorted(range(len(self.names)), key=self.names.__getitem__)
            if len(self.blocks) > 1 or order != list(range(len(order))):
                index = torch.tensor(order, device=self.device)
                with torch.inference_mode(False):
                    sums, shifts = (torch.cat([b[k] for b in self.blocks]) for k in (0, 1))
                    sums[: len(order)], shifts[: len(order)] = sums[index], shifts[index]
                    self.names = [self.names[i] for i in order]
                    self.accumulators = [self.accumulators[i] for i in order]
                    for i, accumulator in enumerate(self.accumulators):
                        accumulator.sums, accumulator.shift = sums[i], shifts[i]
                self.blocks, self.template = [(sums, shifts)], None
            n = len(self.names)
            self.views = (self.blocks[0][0][:n], self.blocks[0][1][:n], list(self.names))
        return self.views

    def reset(self) -> None:
        """After a drain read ``rows()``: every row empty."""
        if self.template is None:
            with torch.inference_mode(False):
                self.template = self.empty.repeat(self.capacity, 1)
        self.blocks[0][0].copy_(self.template)
        self.fresh = 0


# What a drain reads of each slab with rows: slab => (sums, shifts, names, rows with values)
_Used = dict[_Slab, tuple[torch.Tensor, torch.Tensor, list[str], int]]


@dataclasses.dataclass(slots=True)
class _State:
    """All process-wide state of ``report()`` and the collectors' registry."""

    settings: _SyncSettings | None = None  # init_multiprocessing()'s; None: follow torch.distributed
    followed: tuple[Any, _SyncSettings] | None = None  # (WORLD, its settings), resolved once per group
    stage: str | None = None  # set_stage()'s: the stage report() files values under
    accumulators: dict[str, dict[torch.device, _Accumulator]] = dataclasses.field(default_factory=dict)
    registered: set[str] = dataclasses.field(default_factory=set)  # names reported empty since the drain
    drains: int = 0  # drains so far
    pruning: bool = False  # a collector died: forget every row at the next drain (some are unwanted now)
    slabs: dict[torch.device, _Slab] = dataclasses.field(default_factory=dict)
    backends: dict[torch.device, KernelBackend] = dataclasses.field(default_factory=dict)  # resolved once
    collectors: list[weakref.ref[Collector]] = dataclasses.field(default_factory=list)  # live ones
    wanted: dict[str, bool] = dataclasses.field(default_factory=dict)  # key => some collector wants it
    sketched: list[tuple[str, _Accumulator]] = dataclasses.field(default_factory=list)  # with sketches

    def live(self) -> list[Collector]:
        return [c for c in (ref() for ref in self.collectors) if c is not None]

    def forget(self, ref: weakref.ref) -> None:
        """Weakref callback: a collector died."""
        self.collectors[:] = [r for r in self.collectors if r is not ref and r() is not None]
        self.wanted.clear()
        self.pruning = True

    def wants(self, key: str) -> bool:
        wanted = self.wanted.get(key)
        if wanted is None:
            wanted = self.wanted[key] = any(c._wants(key) for c in self.live())
        return wanted

    def new_accumulator(self, name: str, device: torch.device) -> _Accumulator:
        """A row of ``device``'s slab for ``name``, with the sketches the live collectors keep for it."""
        slab = self.slabs.get(device)
        if slab is None:
            slab = self.slabs[device] = _Slab(device, _kernel_backend(device))
        with torch.inference_mode(False):
            sketches = [
                _SketchCounts(s, s.edges(device), torch.zeros(s.size, dtype=torch.float64, device=device))
                for s in {c._sketch_for(name) for c in self.live()} - {None}
            ]
        accumulator = slab.take(name, sketches)
        if sketches:
            self.sketched.append((name, accumulator))
        return accumulator

    def drop(self, slab: _Slab) -> None:
        """Forget every row of ``slab``, and the accumulators that point into them."""
        for name in slab.names:
            per_device = self.accumulators.get(name)
            if per_device is not None:
                per_device.pop(slab.device, None)
                if not per_device:
                    del self.accumulators[name]
        self.sketched[:] = [(n, a) for n, a in self.sketched if a.slab is not slab]
        slab.clear()

    def reset_rows(self, used: _Used, prune: bool) -> None:
        """Empty every row after a drain; forget a slab's rows when fewer than half had values (names
        that come and go do not pile up), or all of them (``prune``)."""
        self.registered.clear()
        for slab, (*_, count) in used.items():
            if prune or 2 * count < len(slab.names):
                self.drop(slab)
            else:
                slab.reset()
        if prune:
            self.accumulators.clear()
            self.sketched.clear()

    def take_histograms(self, device: torch.device) -> dict[tuple[str, LogHistogram], torch.Tensor]:
        """The counts of the sketches with values since the last drain, summed over devices on
        ``device``; their accumulators start again from zero counts."""
        histograms: dict[tuple[str, LogHistogram], torch.Tensor] = {}
        for name, accumulator in self.sketched:
            if accumulator.stamp != self.drains - 1:  # no value since the last drain
                continue
            for sketch in accumulator.sketches:
                key, counts = (name, sketch.sketch), sketch.counts.to(device)
                histograms[key] = histograms[key] + counts if key in histograms else counts
                with torch.inference_mode(False):
                    sketch.counts = torch.zeros_like(sketch.counts)
        return histograms


_state = _State()


# ------------------------------------------------------------------------------------------------
# Settings.


def _kernel_backend(device: torch.device) -> KernelBackend:
    """The kernel backend ``report()`` and the collectors use on ``device``: resolved at its first use
    after :func:`clear_statistics`, then the same one, whatever ``LIGHTNING_EXT_KERNELS`` says later."""
    backend = _state.backends.get(device)
    if backend is None:
        backend = _state.backends[device] = get_backend(device=device)
    return backend


def init_multiprocessing(
    rank: int, sync_device: torch.device | str | None, process_group: Any = None
) -> None:
    """Set how collectors synchronize across processes (as NVIDIA's ``init_multiprocessing``).

    Optional: without it (or after :func:`clear_statistics`) the settings follow ``torch.distributed``
    (its rank and :func:`lightning_ext.distributed.collective_device`). ``TrainingStats`` calls it.

    Args:
        rank: rank of this process in ``process_group`` (decides what :func:`report0` keeps).
        sync_device: device the collectives run on (``cpu`` for gloo, the local CUDA device for
            NCCL), or ``None`` for single-process mode (``update()`` issues no collective).
        process_group: group to reduce over; ``None`` = the default group.

    Raises:
        TypeError: ``rank`` is not an int or ``sync_device`` is not a device, string or ``None``.
        ValueError: ``rank`` is negative.
    """
    check_int("init_multiprocessing", "rank", rank, ge=0)
    if sync_device is not None and not isinstance(sync_device, torch.device | str):
        raise TypeError(
            "init_multiprocessing: `sync_device` must be a torch.device, a string or None, "
            f"got {sync_device!r}"
        )
    device = torch.device(sync_device) if sync_device is not None else None
    _state.settings = _SyncSettings(rank, device, process_group)


def _sync_settings() -> _SyncSettings:
    """The settings in effect: :func:`init_multiprocessing`'s, else those of ``torch.distributed``
    (resolved once per default group): its rank, the collective device (``None`` single-process)."""
    state = _state
    if state.settings is not None:
        return state.settings
    world = torch.distributed.group.WORLD if distributed.is_distributed() else None
    if state.followed is None or state.followed[0] is not world:
        single = world is None
        rank, device = (0, None) if single else (distributed.get_rank(), distributed.collective_device())
        state.followed = (world, _SyncSettings(rank, device, None))
    return state.followed[1]


def set_stage(stage: str | None) -> str | None:
    """File the values reported from now on under ``stage`` (``None``: no stage, the default).

    Values of different stages never mix: a :class:`~lightning_ext.stats.Collector` collects one
    stage (its ``stage`` argument), so the same ``report("Loss/x", ...)`` in a ``forward`` that
    serves training and validation feeds a training collector and a validation one separately.
    :class:`~lightning_ext.callbacks.TrainingStats` sets Lightning's stage (``"validate"``,
    ``"test"``, ``"predict"``) while those loops run; plain and Fabric loops call it themselves if
    they want stages. Process-local: no collective, no sync.

    Args:
        stage: a non-empty str (any name, e.g. ``"validate"``) or ``None``.

    Returns:
        The stage set before, to restore it.

    Raises:
        TypeError: ``stage`` is neither a str nor ``None``.
        ValueError: ``stage`` is empty or contains ``"\\x1f"`` (the separator of stage and name).

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report, set_stage
        >>> clear_statistics(); train, val = Collector(), Collector(stage="validate")
        >>> _ = report("x", 1.0); previous = set_stage("validate"); _ = report("x", 5.0)
        >>> _ = set_stage(previous); train.update(); val.update(); train.mean("x"), val.mean("x")
        (1.0, 5.0)
    """
    _check_stage("set_stage", stage)
    previous, _state.stage = _state.stage, stage
    return previous


def _check_stage(owner: str, stage: Any) -> None:
    """``TypeError``/``ValueError`` naming ``owner`` unless ``stage`` is ``None`` or a non-empty str
    without the separator of stage and name."""
    if stage is not None and not isinstance(stage, str):
        raise TypeError(f"{owner}: `stage` must be a str or None, got {stage!r}")
    if stage is not None and (not stage or _STAGE_SEPARATOR in stage):
        raise ValueError(f"{owner}: `stage` must be a non-empty str without '\\x1f', got {stage!r}")


def _register(collector: Collector) -> None:
    """Add ``collector`` (kept by a weak reference). The values pending are first drained to the
    collectors registered before (a host-device sync where they live on a device), so that each sees
    exactly the values reported while it existed, as NVIDIA's collectors do; the accumulators are
    remade at their next value, with the sketches the collectors keep now."""
    _drain()
    for slab in _state.slabs.values():
        _state.drop(slab)
    _state.collectors.append(weakref.ref(collector, _state.forget))
    _state.wanted.clear()


# ------------------------------------------------------------------------------------------------
# report().


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"report(name, value): name must be a non-empty str, got {type(name).__name__} {name!r}"
        )


def _check_tensor(name: str, value: torch.Tensor) -> None:
    """TypeError naming ``name`` unless the elements of ``value`` can be counted: real numbers in
    strided storage (one dtype lookup and three flags: the cost of report() of a tensor)."""
    if value.dtype in _UNCOUNTABLE or value.layout is not _STRIDED or value.is_nested or value.is_meta:
        if value.is_complex():
            raise TypeError(f"report({name!r}, value): complex tensors are not supported, got {value.dtype}")
        kind = " nested" if value.is_nested else " quantized" if value.is_quantized else ""
        raise TypeError(
            f"report({name!r}, value): value must be a tensor with real strided storage, got a{kind} "
            f"tensor on device {value.device} with layout {value.layout}. HINT: report a dense copy "
            "(`value.to_dense()`, `value.dequantize()`, ...) or a tensor that holds data (not on 'meta')"
        )


def _check_value(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` can be counted (checked without converting a tensor)."""
    if isinstance(value, torch.Tensor):
        _check_tensor(name, value)
    elif not _is_number(value):
        _as_array(name, value)


def _as_array(name: str, value: Any) -> np.ndarray:
    """Flat float64 array of a list/tuple/ndarray of numbers, else TypeError naming ``name``."""
    if isinstance(value, list | tuple | np.ndarray | np.generic):
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as err:
            raise TypeError(f"report({name!r}, value): cannot read {value!r} as numbers ({err})") from None
        if array.dtype.kind in "biuf":
            return np.ascontiguousarray(array, dtype=np.float64).reshape(-1)
        if array.size == 0:
            return np.zeros(0)
    raise TypeError(
        f"report({name!r}, value): value must be a number, a list/tuple of numbers, a numeric NumPy "
        f"array or a real tensor, got {type(value).__name__} {value!r:.80}"
    )


def _is_number(value: Any) -> bool:
    """A Python or NumPy real number (not a tensor or an array)."""
    return type(value) is float or (
        not isinstance(value, torch.Tensor | np.ndarray) and isinstance(value, numbers.Real)
    )


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` as a countable real tensor (detached; bool as uint8), else TypeError naming ``name``."""
    if isinstance(value, torch.Tensor):
        _check_tensor(name, value)
        x = value.detach()
        return x.to(torch.uint8) if x.dtype is torch.bool else x
    if _is_number(value):
        return torch.tensor(float(value), dtype=torch.float64)
    return torch.from_numpy(_as_array(name, value))


def _accumulate(
    state: _State, name: str, per_device: dict, x: torch.Tensor | float, device: torch.device
) -> None:
    """Add the non-empty countable tensor (or Python float) ``x`` into its accumulator on ``device``."""
    accumulator = per_device.get(device)
    if accumulator is None:
        accumulator = per_device[device] = state.new_accumulator(name, device)
    slab = accumulator.slab
    if type(x) is float:
        x = slab.scratch.fill_(x)
    if accumulator.stamp != state.drains:  # the first value since the last drain
        accumulator.stamp = state.drains
        slab.fresh += 1
        # The shift: the first value, 0 where it is not finite (a non-finite shift would turn every
        # later difference into NaN, inf - inf).
        accumulator.shift.copy_(x.reshape(-1)[0]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    # The unchecked calls of the ops: sums, shift and edges are valid by construction, x by _as_tensor.
    slab.backend.run("accumulate_moments_", accumulator.sums, x, accumulator.shift)
    if accumulator.sketches:
        for sketch in accumulator.sketches:
            slab.backend.run("accumulate_histogram_", sketch.counts, x, sketch.edges)


def report(name: str, value: T) -> T:
    """Accumulate ``value`` under ``name`` for every collector whose regex matches; return ``value``.

    Callable anywhere (under autocast, ``torch.no_grad`` or inference mode) on any subset of ranks,
    in any order; not thread-safe. A name nobody collects costs a dict lookup and a type check; else
    the value is accumulated where it lives (numbers and NumPy data on the CPU) by the kernel
    backend's ``accumulate_moments_``: float64 count and sums shifted by the first value (16/32-bit
    elements may be squared in float32 first), min, max. The backend is resolved once per device (the
    first value there after :func:`clear_statistics`), not per call.
    No host-device sync, no collective. An empty value registers the name (NaN until it has values).

    Under ``torch.compile`` (``fullgraph=True`` included) a tensor or number is one opaque graph node,
    the custom op ``lightning_ext::report_``, running this eager path: a flush does not retrace the
    model (lists and NumPy arrays break the graph where dynamo cannot trace NumPy).

    Args:
        name: statistic name, conventionally ``"Group/quantity_unit"`` (e.g. ``"Loss/total"``).
        value: a Python number (bool/int/float, NumPy scalar), a list/tuple of numbers, a NumPy
            array of a numeric dtype, or a real tensor of any shape, dtype and device whose elements
            are stored (strided layout, not on ``meta``, not nested, not quantized).

    Returns:
        ``value`` itself, unchanged.

    Raises:
        TypeError: ``name`` is not a non-empty str, or ``value`` is not numeric (str, object,
            complex, ...), or a tensor without real strided storage (sparse, nested, quantized,
            MKL-DNN, on the ``meta`` device). Nothing is accumulated then.

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics
        >>> clear_statistics(); c = Collector(regex="Loss/.*")
        >>> report("Loss/total", 2.0), report("Loss/total", torch.tensor([4.0, 6.0]))
        (2.0, tensor([4., 6.]))
        >>> c.update(); c.mean("Loss/total"), c.num("Loss/total")
        (4.0, 3)
    """
    if torch.compiler.is_compiling():
        return _report_traced(name, value)
    state = _state
    if state.stage is not None:  # the key of a staged value
        _check_name(name)
        name = state.stage + _STAGE_SEPARATOR + name
    per_device = state.accumulators.get(name) if isinstance(name, str) else None
    if per_device is None:
        _check_name(name)
        if not state.wants(name):
            _check_value(name, value)
            return value
        per_device = state.accumulators[name] = {}
    if type(value) is float or _is_number(value):  # no tensor built
        _accumulate(state, name, per_device, float(value), _CPU)
        return value
    x = _as_tensor(name, value)
    if x.numel():
        _accumulate(state, name, per_device, x, x.device)
    else:
        state.registered.add(name)
    return value


@torch.library.custom_op("lightning_ext::report_", mutates_args=("token",))
def _report_op(x: torch.Tensor, token: torch.Tensor, name: str) -> None:
    """``report(name, x)`` as one node of a compiled graph, run eagerly when the graph runs. It
    declares that it writes ``token`` (it does not), so that the compiler keeps the node."""
    report(name, x)


_report_op.register_fake(lambda x, token, name: None)
_TOKEN = torch.zeros(())  # what _report_op "writes"


def _report_traced(name: str, value: T) -> T:
    """What ``report()`` traces under ``torch.compile``: the value as a tensor, into the custom op."""
    _check_name(name)
    _report_op(_as_tensor(name, value), _TOKEN, name)
    return value


def report0(name: str, value: T) -> T:
    """Like :func:`report`, but only rank 0's values count; other ranks register ``name`` only.

    Use for values that are identical on every rank (learning rate, loss scale) so they are not
    counted ``world_size`` times. No sync, no collective.

    Returns:
        ``value`` itself, unchanged.

    Raises:
        TypeError: as :func:`report`.
    """
    settings = _state.settings
    if (settings.rank if settings is not None else distributed.get_rank()) == 0:
        return report(name, value)
    _check_name(name)
    _check_value(name, value)
    report(name, [])
    return value


# ------------------------------------------------------------------------------------------------
# Drains.


def _drain(consumer: Collector | None = None) -> Callable[[], None]:
    """Hand the values reported since the last drain to every live collector, then reset the
    accumulators. A collector's update calls it first, with itself as ``consumer``.

    Converts them to one :class:`_Table` on the sync device (CPU when single-process), which
    synchronizes host and device where they differ. Local: no collective. The steady state (one
    device, every row with values) lends the table as views of the accumulator rows when ``consumer``
    is the only collector: the rows are then reset by the function returned, which the consumer calls
    once it has read them; otherwise that function does nothing.
    """
    state = _state
    if not state.registered and not any(slab.fresh for slab in state.slabs.values()):
        return _nothing
    state.drains += 1
    used = {slab: (*slab.rows(), slab.fresh) for slab in state.slabs.values() if slab.names}
    release = functools.partial(state.reset_rows, used, state.pruning)
    state.pruning, lent, table = False, False, None
    collectors = state.live()
    try:
        if collectors:
            table, lent = _table(state, used, lend=len(collectors) == 1 and collectors[0] is consumer)
            if state.sketched:
                table = table._replace(histograms=state.take_histograms(table.sums.device))
    finally:
        if not lent:
            release()
    for collector in collectors:
        collector._receive(table)
    return release if lent else _nothing


def _nothing() -> None:
    pass


def _table(state: _State, used: _Used, lend: bool) -> tuple[_Table, bool]:
    """The drained table (every name with values, or registered, since the last drain), and whether it
    is made of views of the rows (``lend``, in the steady state)."""
    device = _sync_settings().device or _CPU
    if len(used) == 1 and not state.registered:
        [(sums, shifts, names, count)] = used.values()
        if count == len(names):  # every row has values: the steady state, no merge
            lent = lend and sums.device == device
            return _Table(names, sums.to(device, copy=not lent), shifts.to(device, copy=not lent)), lent
    parts = []  # the rows with values, per device
    for sums, shifts, names, _count in used.values():
        rows = (sums[:, 0] > 0).nonzero().reshape(-1)
        parts.append(_Table([names[i] for i in rows.tolist()], sums[rows], shifts[rows]))
    names = sorted({n for part in parts for n in part.names} | state.registered)
    return _merged(names, parts, device), False


def clear_statistics() -> None:
    """Clear all module state: pending values, the collector registry and the multiprocessing settings.

    Collectors created before ``clear_statistics()`` stop receiving values (create new ones). Use between
    independent runs in one process (e.g. several Trainers in a notebook). Local only: no collective.
    """
    global _state
    for collector in _state.live():
        collector._detach()
    _state = _State()
