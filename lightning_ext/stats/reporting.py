"""Report training statistics from anywhere: ``report()``, ``report0()`` and the module state behind them.

Follows NVIDIA's ``torch_utils/training_stats.py`` (StyleGAN2-ADA/StyleGAN3/EDM). Each collector
receives exactly the values reported since *its* previous ``update()``: every ``update()`` first
*drains* the pending values into one immutable table handed to every live collector.

The contract with :mod:`lightning_ext.stats.collector`, in both directions: a collector is a
:class:`Sink` (which names it wants, which it sketches, receiving tables, being detached); it calls
:func:`register_sink`, :func:`drain`, :func:`sync_settings` and :func:`kernel_backend`, and reads
:class:`Table` and :data:`STAGE_SEPARATOR`. Nothing else crosses. A sink of your own (another
reduction, a local log) uses the same names.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from lightning_ext import distributed as _dist
from lightning_ext._checks import check_int
from lightning_ext.kernels import KernelBackend, get_backend
from lightning_ext.kernels.moments import _moments_from_shifted
from lightning_ext.stats.moments import _EMPTY_ROW, _as_shifted, _empty_moments, _merge_moments
from lightning_ext.stats.sketch import _EDGES, LogHistogram

__all__ = [  # report()'s API, then the contract with the collectors (sinks)
    "STAGE_SEPARATOR",
    "Sink",
    "Table",
    "clear_statistics",
    "drain",
    "init_multiprocessing",
    "kernel_backend",
    "register_sink",
    "report",
    "report0",
    "set_stage",
    "sync_settings",
]

T = TypeVar("T")
_CPU = torch.device("cpu")
STAGE_SEPARATOR = "\x1f"
"""Between a stage and a name in the key a staged value is filed under: ``stage + STAGE_SEPARATOR + name``."""
_MIN_ROWS = 64  # rows of a device's first accumulator block

# One (name, device) accumulator: (float64 (5,) sums in the layout of accumulate_moments_: a row of its
# device's _Slab, float64 0-dim shift = the first value seen there since the last drain, the slab's kernel
# backend, the slab's float64 0-dim scratch that Python numbers are written into, [the drain count when
# the shift was set], the slab, the name's sketches: [sketch, its edges, float64 (B,) counts] per sketch
# some collector wants for the name, usually none). A plain tuple: report() indexes it.
_Entry = tuple[torch.Tensor, torch.Tensor, "KernelBackend", torch.Tensor, list[int], "_Slab", list[list[Any]]]


# ------------------------------------------------------------------------------------------------
# Module state (cleared by clear_statistics()).

# init_multiprocessing() arguments (rank, sync_device, process_group); None = follow torch.distributed
_settings: tuple[int, torch.device | None, Any] | None = None
_stage: str | None = None  # what set_stage() set: the stage report() files values under
_followed: tuple[Any, tuple[int, torch.device | None, Any]] | None = None  # (WORLD, its settings)
# name => {device: _Entry}: the accumulators of the names reported (kept from drain to drain, their
# rows reset by each drain; dropped with their slab's rows)
_pending: dict[str, dict[torch.device, _Entry]] = {}
_registered: set[str] = set()  # names reported without values since the last drain
_dirty = False  # something was reported since the last drain
_drains = 0  # drains so far: an accumulator whose stamp differs takes its next value as its shift
_pruning = False  # a collector died: drop the accumulators at the next drain (some may be unwanted now)
# device => _Slab: that device's accumulator rows (reused from drain to drain) and its kernel backend
_slabs: dict[torch.device, _Slab] = {}
_backends: dict[torch.device, KernelBackend] = {}  # device => its kernel backend, resolved once
_sinks: list[weakref.ref[Sink]] = []  # live collectors; each receives every drained table
_wanted: dict[str, bool] = {}  # name => some live collector's regex matches it (cache)
_sketched: list[tuple[str, _Entry]] = []  # the accumulators with sketches, in the order they came


class Table(NamedTuple):
    """What :func:`drain` hands the sinks: an immutable snapshot, sorted distinct ``names`` (keys: see
    :data:`STAGE_SEPARATOR`), float64 ``(len(names), 5)`` shifted ``sums`` and
    float64 ``(len(names),)`` ``shifts`` (the layout of the kernel ops ``accumulate_moments_`` and
    ``moments_payload_``), and ``histograms``: ``{(name, sketch): float64 (sketch.size,) counts}`` of the
    names some collector sketches (only those with values)."""

    names: list[str]
    sums: torch.Tensor
    shifts: torch.Tensor
    histograms: dict[tuple[str, LogHistogram], torch.Tensor] = {}  # noqa: RUF012 (never mutated)

    def moments(self) -> torch.Tensor:
        """Float64 ``(len(names), 5)`` moment rows ``[count, mean, m2, min, max]``."""
        return _moments_from_shifted(self.sums, self.shifts)


class Sink(Protocol):
    """What this module asks of a collector (:class:`~lightning_ext.stats.Collector` is the one kind).

    A drain hands every live (registered, not garbage-collected) sink the same :class:`Table`; the
    sink merges what it receives until its own update. Keys are names, or ``stage + STAGE_SEPARATOR +
    name`` for values reported while :func:`set_stage` had set a stage.
    """

    def wants(self, key: str) -> bool:
        """Whether the sink collects ``key`` (``report()`` drops a key no sink wants)."""

    def sketch_for(self, key: str) -> LogHistogram | None:
        """The quantile sketch ``report()`` keeps for ``key`` for this sink, or ``None``."""

    def receive(self, table: Table) -> None:
        """Take a drained table (read-only; a lent one only during the ``drain(self)`` that lent it)."""

    def detach(self) -> None:
        """Forget what was received (:func:`clear_statistics`)."""


def kernel_backend(device: torch.device) -> KernelBackend:
    """The kernel backend that ``report()`` and the sinks use on ``device``: resolved
    (:func:`lightning_ext.kernels.get_backend`) at its first use after :func:`clear_statistics`, then
    the same one, whatever ``LIGHTNING_EXT_KERNELS`` says later. Local."""
    backend = _backends.get(device)
    if backend is None:
        backend = _backends[device] = get_backend(device=device)
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
    global _settings
    check_int("init_multiprocessing", "rank", rank, ge=0)
    if sync_device is not None and not isinstance(sync_device, torch.device | str):
        raise TypeError(
            "init_multiprocessing: `sync_device` must be a torch.device, a string or None, "
            f"got {sync_device!r}"
        )
    device = torch.device(sync_device) if sync_device is not None else None
    _settings = (rank, device, process_group)


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
    global _stage
    _check_stage("set_stage", stage)
    previous, _stage = _stage, stage
    return previous


def _check_stage(owner: str, stage: Any) -> None:
    """``TypeError``/``ValueError`` naming ``owner`` unless ``stage`` is ``None`` or a non-empty str
    without :data:`STAGE_SEPARATOR`."""
    if stage is not None and not isinstance(stage, str):
        raise TypeError(f"{owner}: `stage` must be a str or None, got {stage!r}")
    if stage is not None and (not stage or STAGE_SEPARATOR in stage):
        raise ValueError(f"{owner}: `stage` must be a non-empty str without '\\x1f', got {stage!r}")


def sync_settings() -> tuple[int, torch.device | None, Any]:
    """``(rank, sync_device, process_group)`` in effect now: :func:`init_multiprocessing`'s, else
    those of ``torch.distributed`` (resolved once per default group): its rank, the collective device
    (``None`` when single-process: no collective) and ``None`` (the default group). Local."""
    global _followed
    if _settings is not None:
        return _settings
    world = torch.distributed.group.WORLD if _dist.is_distributed() else None
    if _followed is None or _followed[0] is not world:
        rank, device = (_dist.get_rank(), _dist.collective_device()) if world is not None else (0, None)
        _followed = (world, (rank, device, None))
    return _followed[1]


def register_sink(sink: Sink) -> None:
    """Add ``sink`` (kept by a weak reference). The values pending are first drained to the sinks
    registered before (a host-device sync where they live on a device), so that each sink sees
    exactly the values reported while it existed, as NVIDIA's collectors do; the accumulators are
    remade at their next value, with the sketches the sinks want now."""
    drain()
    for slab in _slabs.values():
        slab.drop()
    _sinks.append(weakref.ref(sink, _forget))
    _wanted.clear()


def _forget(_ref: weakref.ref) -> None:
    """Weakref callback: a collector died; drop it from the registry."""
    global _pruning
    _sinks[:] = [r for r in _sinks if r is not _ref and r() is not None]
    _wanted.clear()
    _pruning = True


def _sketches(name: str, device: torch.device) -> list[list[Any]]:
    """``[sketch, edges, zero counts]`` per distinct sketch the live collectors want for ``name``."""
    wanted = {s.sketch_for(name) for s in _live_sinks()} - {None}
    return [[k, k.edges(device), torch.zeros(k.size, dtype=torch.float64, device=device)] for k in wanted]


def _live_sinks() -> list[Sink]:
    return [s for s in (r() for r in _sinks) if s is not None]


def _is_wanted(name: str) -> bool:
    wanted = _wanted.get(name)
    if wanted is None:
        wanted = _wanted[name] = any(s.wants(name) for s in _live_sinks())
    return wanted


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"report(name, value): name must be a non-empty str, got {type(name).__name__} {name!r}"
        )


def _check_value(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` is numeric (checked without converting it)."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(
                f"report({name!r}, value): complex tensors are not supported, got dtype {value.dtype}"
            )
    elif not isinstance(value, numbers.Real) or isinstance(value, np.ndarray):
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


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` as a real tensor (detached; bool as uint8), else TypeError naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            _check_value(name, value)  # raises
        x = value.detach()
        return x.to(torch.uint8) if x.dtype == torch.bool else x
    if isinstance(value, numbers.Real) and not isinstance(value, np.ndarray):
        return torch.tensor(float(value), dtype=torch.float64)
    return torch.from_numpy(_as_array(name, value))


class _Slab:
    """The accumulator rows of one device: a float64 ``(5,)`` row of sums and a float64 shift per name
    reported there, kept from drain to drain, so ``report()`` finds a name's row with one dict lookup
    and the drain reads and resets all rows with a few tensor ops.

    Rows live in blocks (a new one, as large as all before it, when they are full; merged into one at
    the next drain). A drain that finds fewer than half of the rows with values forgets them all
    (names that come and go do not pile up). The kernel backend is resolved once, when the slab is
    made.
    """

    def __init__(self, device: torch.device) -> None:
        # Normal (not inference) tensors, so the first report may come from Lightning's validation
        # loop (inference_mode) and later ones from training.
        with torch.inference_mode(False):
            self.empty = torch.tensor(_EMPTY_ROW, dtype=torch.float64, device=device)
            self.scratch = torch.empty((), dtype=torch.float64, device=device)
        self.device = device
        self.backend = kernel_backend(device)
        self._forget()

    def _forget(self) -> None:
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (sums (B, 5), shifts (B,)), in row order
        self.capacity = 0  # rows in all blocks
        self.names: list[str] = []  # name of each row, in row order
        self.template: torch.Tensor | None = None  # (capacity, 5) empty rows: what a drain resets to
        self.fresh = 0  # rows that received values since the last drain
        self.table_names: list[str] | None = []  # the sorted names as a drained table's: a new list
        # whenever a name comes (a table's names never change), else the same one (collectors cache by it)
        self.views = (self.empty[:0].reshape(0, 5), self.empty[:0])  # rows(): (sums, shifts) of every row

    def _add_block(self, size: int) -> None:
        with torch.inference_mode(False):
            block = (self.empty.repeat(size, 1), torch.zeros(size, dtype=torch.float64, device=self.device))
        self.blocks.append(block)
        self.capacity += size
        self.template = None

    def take(self, name: str) -> _Entry:
        """A new, empty accumulator row for ``name`` (the caller sets its shift)."""
        row = len(self.names)
        if row == self.capacity:
            self._add_block(max(_MIN_ROWS, self.capacity))
        sums, shifts = self.blocks[-1]
        j = row - (self.capacity - sums.shape[0])
        self.names.append(name)
        self.table_names = None
        with torch.inference_mode(False):
            entry = (sums[j], shifts[j], self.backend, self.scratch, [-1], self, _sketches(name, self.device))
        if entry[6]:
            _sketched.append((name, entry))
        return entry

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """Views of the sums ``(n, 5)`` and shifts ``(n,)`` of the ``n`` rows, and their names, sorted.

        After new names came: one block for all rows, in the order of their names (the accumulators
        are remade as views of it), so that the drains read rows in order while the names stay.
        """
        if self.table_names is None:
            names = self.names
            order = sorted(range(len(names)), key=names.__getitem__)
            if len(self.blocks) > 1 or order != list(range(len(names))):
                index = torch.tensor(order, device=self.device)
                with torch.inference_mode(False):  # normal tensors, even when drained in inference mode
                    sums, shifts = (torch.cat([b[k] for b in self.blocks]) for k in (0, 1))
                sums[: len(order)], shifts[: len(order)] = sums[index], shifts[index]
                self.blocks, self.template = [(sums, shifts)], None
                self.names = [names[i] for i in order]
                self._remake_entries()
            self.table_names = list(self.names)
            sums, shifts = self.blocks[0]
            n = len(self.names)
            self.views = (sums[:n], shifts[:n])
        return *self.views, self.table_names

    def _remake_entries(self) -> None:
        sums, shifts = self.blocks[0]
        with torch.inference_mode(False):
            for i, name in enumerate(self.names):
                _, _, _, _, stamp, _, sketches = _pending[name][self.device]
                entry = (sums[i], shifts[i], self.backend, self.scratch, stamp, self, sketches)
                _pending[name][self.device] = entry
        _sketched[:] = [(n, _pending[n][e[5].device]) for n, e in _sketched]

    def reset(self) -> None:
        """After a drain copied ``rows()``: every row empty (an in-place write into a normal tensor,
        allowed in inference mode)."""
        if self.template is None:
            with torch.inference_mode(False):
                self.template = self.empty.repeat(self.capacity, 1)
        self.blocks[0][0].copy_(self.template)
        self.fresh = 0

    def drop(self) -> None:
        """Forget every row, and the accumulators that point into them."""
        for name in self.names:
            acc = _pending.get(name)
            if acc is not None:
                acc.pop(self.device, None)
                if not acc:
                    del _pending[name]
        _sketched[:] = [(n, e) for n, e in _sketched if e[5] is not self]
        self._forget()


# A drain's view of the slabs with rows: slab => (sums, shifts, names, how many rows have values)
_Used = dict[_Slab, tuple[torch.Tensor, torch.Tensor, list[str], int]]


def _slab(device: torch.device) -> _Slab:
    slab = _slabs.get(device)
    if slab is None:
        slab = _slabs[device] = _Slab(device)
    return slab


def _accumulate(name: str, acc: dict[torch.device, _Entry], x: torch.Tensor) -> None:
    """Add the non-empty, detached, real ``x`` into its device's accumulator in ``acc``."""
    global _dirty
    _dirty = True
    entry = acc.get(x.device)
    if entry is None:
        entry = acc[x.device] = _slab(x.device).take(name)
    if entry[4][0] != _drains:  # the first value since the last drain
        entry[4][0] = _drains
        entry[5].fresh += 1
        # The shift: the first value (in float64), 0 where it is not finite, since a non-finite shift
        # would turn every later difference into NaN (inf - inf). In-place writes into a normal tensor
        # are allowed in inference mode.
        entry[1].copy_(x.reshape(-1)[0]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    # The unchecked call of accumulate_moments_: sums and shift are valid by construction, x by _as_tensor.
    entry[2].run("accumulate_moments_", entry[0], x, entry[1])
    if entry[6]:
        _accumulate_sketches(entry, x)


def _accumulate_sketches(entry: _Entry, x: torch.Tensor) -> None:
    """Count ``x`` into the sketches of ``entry`` (the unchecked call: valid by construction)."""
    for _sketch, edges, counts in entry[6]:
        entry[2].run("accumulate_histogram_", counts, x, edges)


def _accumulate_number(name: str, acc: dict[torch.device, _Entry], value: float) -> None:
    """Add the Python float ``value`` into the CPU accumulator of ``acc`` (as a float64 value)."""
    global _dirty
    _dirty = True
    entry = acc.get(_CPU)
    if entry is None:
        entry = acc[_CPU] = _slab(_CPU).take(name)
    if entry[4][0] != _drains:
        entry[4][0] = _drains
        entry[5].fresh += 1
        entry[1].fill_(value if math.isfinite(value) else 0.0)  # the shift, as in _accumulate
    scratch = entry[3]
    scratch.fill_(value)  # a normal tensor: in-place writes are allowed in inference mode too
    entry[2].run("accumulate_moments_", entry[0], scratch, entry[1])
    if entry[6]:
        _accumulate_sketches(entry, scratch)


def report(name: str, value: T) -> T:
    """Accumulate ``value`` under ``name`` for every collector whose regex matches; return ``value``.

    Callable anywhere (under autocast, ``torch.no_grad`` or inference mode) on any subset of ranks,
    in any order; not thread-safe. A name nobody collects costs a dict lookup and a type check; else
    the value is accumulated where it lives (numbers and NumPy data on the CPU) by the kernel
    backend's ``accumulate_moments_``: float64 count and sums shifted by the first value (16/32-bit
    elements may be squared in float32 first), min, max. The backend is resolved once per device (the
    first value there after :func:`clear_statistics`), not per call.
    No host-device sync, no collective. An empty value registers the name (NaN until it has values).

    Under ``torch.compile`` (``fullgraph=True`` included) a tensor or Python number is reported by
    one opaque graph node, the custom op ``lightning_ext::report_``, which runs this eager path when
    the graph runs: the compiled code does not depend on this module's state, so a flush does not
    trace the model again (lists and NumPy arrays break the graph where dynamo cannot trace NumPy).

    Args:
        name: statistic name, conventionally ``"Group/quantity_unit"`` (e.g. ``"Loss/total"``).
        value: a Python number (bool/int/float, NumPy scalar), a list/tuple of numbers, a NumPy
            array of a numeric dtype, or a real tensor of any shape, dtype and device.

    Returns:
        ``value`` itself, unchanged.

    Raises:
        TypeError: ``name`` is not a non-empty str, or ``value`` is not numeric (str, object,
            complex, ...).

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
    if _stage is not None:  # the key of a staged value
        _check_name(name)
        name = _stage + STAGE_SEPARATOR + name
    acc = _pending.get(name) if isinstance(name, str) else None
    if acc is None:
        _check_name(name)
        if not _is_wanted(name):
            _check_value(name, value)
            return value
        acc = _pending[name] = {}
    if type(value) is float or (  # a Python number (float first: the common one): no tensor built
        isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor | np.ndarray)
    ):
        _accumulate_number(name, acc, float(value))
        return value
    x = _as_tensor(name, value)
    if x.numel():
        _accumulate(name, acc, x)
    else:
        _register_name(name)
    return value


def _register_name(name: str) -> None:
    global _dirty
    _dirty = True
    _registered.add(name)


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
    if (_settings[0] if _settings is not None else _dist.get_rank()) == 0:
        return report(name, value)
    _check_name(name)
    _check_value(name, value)
    report(name, [])
    return value


def drain(consumer: Sink | None = None) -> Callable[[], None]:
    """Hand the values reported since the last drain to every live sink (:meth:`Sink.receive`), then
    reset the accumulators. A sink's update calls it first, with itself as ``consumer``.

    Converts them to one :class:`Table` on the sync device (CPU when single-process), which
    synchronizes host and device where they differ. Local: no collective. The steady state (one
    device, every row with values) lends the table as views of the accumulator rows when ``consumer``
    is the only sink: the rows are then reset by the function returned, which the consumer calls once
    it has read them; otherwise that function does nothing.

    Args:
        consumer: the sink that is updating, or ``None``.

    Returns:
        The function that releases a lent table (call it once, after reading the table).
    """
    global _dirty, _pruning, _drains
    if not _dirty:
        return _nothing
    _dirty, _drains = False, _drains + 1
    used = {slab: (*slab.rows(), slab.fresh) for slab in _slabs.values() if slab.names}
    release = functools.partial(_reset, used, _pruning)
    _pruning, lent = False, False
    try:
        sinks = _live_sinks()
        lend = len(sinks) == 1 and sinks[0] is consumer
        table, lent = _table(used, lend) if sinks else (None, False)
        if _sketched and table is not None:
            table = table._replace(histograms=_take_histograms(table.sums.device))
    finally:
        if not lent:
            release()
    for sink in sinks:
        sink.receive(table)
    return release if lent else _nothing


def _nothing() -> None:
    pass


def _take_histograms(device: torch.device) -> dict[tuple[str, LogHistogram], torch.Tensor]:
    """The counts of the sketches that received values since the last drain, summed over devices on
    ``device``; their accumulators start again from zero counts."""
    histograms: dict[tuple[str, LogHistogram], torch.Tensor] = {}
    for name, entry in _sketched:
        if entry[4][0] != _drains - 1:  # no value since the last drain
            continue
        for pair in entry[6]:
            sketch, counts = pair[0], pair[2]
            key = (name, sketch)
            histograms[key] = histograms[key] + counts.to(device) if key in histograms else counts.to(device)
            with torch.inference_mode(False):  # a normal tensor, even when drained in inference mode
                pair[2] = torch.zeros_like(counts)
    return histograms


def _table(used: _Used, lend: bool) -> tuple[Table, bool]:
    """The drained table (every name with values, or registered, since the last drain), and whether it
    is made of views of the rows (``lend``, in the steady state)."""
    device = sync_settings()[1] or torch.device("cpu")
    if len(used) == 1 and not _registered:
        [(sums, shifts, names, count)] = used.values()
        if count == len(names):  # every row has values: the steady state, no merge
            lent = lend and sums.device == device
            copy = not lent
            return Table(names, sums.to(device, copy=copy), shifts.to(device, copy=copy)), lent
    parts = []  # (names, moment rows) of the rows with values, per device
    for sums, shifts, names, _count in used.values():
        rows = (sums[:, 0] > 0).nonzero().reshape(-1)
        moments = _moments_from_shifted(sums[rows], shifts[rows])
        parts.append(([names[i] for i in rows.tolist()], moments))
    names = sorted({n for part_names, _ in parts for n in part_names} | _registered)
    index = {name: i for i, name in enumerate(names)}
    rows = _empty_moments(len(names), device)
    for part_names, moments in parts:
        idx = torch.tensor([index[name] for name in part_names], dtype=torch.int64, device=device)
        rows[idx] = _merge_moments(rows[idx], moments.to(device))
    return Table(names, *_as_shifted(rows)), False


def _reset(used: _Used, prune: bool) -> None:
    """Empty every row after a drain; forget a slab's rows when fewer than half had values (or all
    of them, ``prune``)."""
    _registered.clear()
    for slab, (*_, count) in used.items():
        if prune or 2 * count < len(slab.names):
            slab.drop()
        else:
            slab.reset()
    if prune:
        _pending.clear()
        _sketched.clear()


def clear_statistics() -> None:
    """Clear all module state: pending values, the collector registry and the multiprocessing settings.

    Collectors created before ``clear_statistics()`` stop receiving values (create new ones). Use between
    independent runs in one process (e.g. several Trainers in a notebook). Local only: no collective.
    """
    global _settings, _followed, _pending, _dirty, _pruning, _drains, _stage
    for sink in _live_sinks():
        sink.detach()
    _settings, _followed, _pending, _dirty, _pruning, _drains = None, None, {}, False, False, 0
    _stage = None
    _registered.clear()
    _sketched.clear()
    _EDGES.clear()
    _slabs.clear()
    _backends.clear()
    _sinks.clear()
    _wanted.clear()
