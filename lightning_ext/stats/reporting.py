"""Report training statistics from anywhere: ``report()``, ``report0()`` and the state behind them.

Follows NVIDIA's ``torch_utils/training_stats.py`` (StyleGAN2-ADA/StyleGAN3/EDM). Each live
:class:`~lightning_ext.stats.Collector` owns a :class:`~lightning_ext.stats._wire.Store` of
accumulator rows (the interface between this module and the collectors: ``_wire``), which it attaches
here with :func:`_attach`, the one call of the collector's side into this module. ``report()`` finds
a name's *route* (the stores that take it in the current stage, and their accumulators per device)
with one dict lookup and adds the value into each of them with the kernel backend's
``accumulate_moments_``; a route is made at a name's first report in a stage and forgotten when a
collector comes or goes, or its rows move.

All process-wide state is the one :class:`_State` in ``_state``; :func:`clear_statistics` replaces it.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from lightning_ext import distributed
from lightning_ext._checks import check_device, check_int, check_label
from lightning_ext.stats._wire import Accumulator, Store

__all__ = ["clear_statistics", "init_multiprocessing", "report", "report0", "set_stage"]

T = TypeVar("T")
_CPU = torch.device("cpu")
_STRIDED = torch.strided
_CONVERTED = {  # dtypes the kernels do not read, and what report() converts them to (exactly)
    torch.bool: torch.uint8,
    **{getattr(torch, f"uint{b}"): torch.float64 for b in (16, 32, 64)},  # (uint64 above 2^53: rounded)
    **{getattr(torch, d): torch.float32 for d in dir(torch) if d.startswith("float8_")},
}
# Neither read nor converted: complex, quantized, sub-byte (float4, int1-7, uint1-7), bits
_UNCOUNTABLE = frozenset({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - {*_CONVERTED, *(
    getattr(torch, n) for n in "float16 bfloat16 float32 float64 int8 int16 int32 int64 uint8".split())})
_SCRATCH = torch.zeros((), dtype=torch.float64)  # a Python number's tensor on its way into the rows,
_SCRATCH_VALUE = _SCRATCH.numpy()  # written through NumPy (cheaper than a tensor op)


class _SyncSettings(NamedTuple):
    """How collectors synchronize (:func:`init_multiprocessing`)."""

    rank: int  # in process_group
    device: torch.device | None  # the collectives' device; None: single process, no collective
    process_group: Any  # None: the default group


# A name's route in one stage: the stores that take it, and their accumulators per device (made at its
# first value there)
_Route = tuple[list[Store], dict[torch.device, list[Accumulator]]]


@dataclasses.dataclass(slots=True)
class _State:
    """All process-wide state of ``report()`` and the collectors' registry."""

    settings: _SyncSettings | None = None  # init_multiprocessing()'s; None: follow torch.distributed
    followed: tuple[Any, _SyncSettings] | None = None  # (WORLD, its settings), resolved once per group
    stage: str | None = None  # set_stage()'s: the stage report() files values under
    stores: list[tuple[weakref.ref, Store]] = dataclasses.field(default_factory=list)  # (collector, its)
    routes: dict[str | None, dict[str, _Route]] = dataclasses.field(default_factory=dict)  # stage => name =>
    current: dict[str, _Route] = dataclasses.field(default_factory=dict)  # routes[stage]

    def __post_init__(self) -> None:
        self.routes[self.stage] = self.current

    def forget_routes(self) -> None:
        for routes in self.routes.values():
            routes.clear()

    def forget(self, ref: weakref.ref) -> None:
        """Weakref callback: a collector died. It may run in any allocation (a garbage collection), also
        while ``_route`` reads ``stores``: a new list, not the one being read changed under it."""
        self.stores = [(r, s) for r, s in self.stores if r is not ref and r() is not None]
        self.forget_routes()


_state = _State()


def _sync_settings() -> _SyncSettings:
    """The settings in effect: :func:`init_multiprocessing`'s, else those of ``torch.distributed``
    (resolved once per default group): its rank, the collective device (``None`` single-process)."""
    state = _state
    if state.settings is not None:
        return state.settings
    world = torch.distributed.group.WORLD if distributed.is_distributed() else None
    if state.followed is None or state.followed[0] is not world:
        device = distributed.collective_device() if world is not None else None
        state.followed = (world, _SyncSettings(distributed.get_rank(), device, None))
    return state.followed[1]


def _attach(collector: Any, store: Store) -> None:
    """Make ``report()`` add the values of the names ``store`` takes into it while ``collector`` lives
    (the one call of the collector's side into this module; ``store`` gets ``settings`` and
    ``forget_routes``). A collector sees the values reported while it exists."""
    state = _state
    store.settings, store.forget_routes = _sync_settings, state.forget_routes
    state.stores.append((weakref.ref(collector, state.forget), store))
    state.forget_routes()


# ------------------------------------------------------------------------------------------------
# Settings.


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
        ValueError: ``rank`` is negative, or ``sync_device`` a string that names no device.
    """
    check_int("init_multiprocessing", "rank", rank, ge=0)
    device = check_device("init_multiprocessing", "sync_device", sync_device, optional=True)
    _state.settings = _SyncSettings(rank, device, process_group)


def set_stage(stage: str | None) -> str | None:
    """File the values reported from now on under ``stage`` (``None``: no stage, the default).

    Values of different stages never mix: a :class:`~lightning_ext.stats.Collector` collects one
    stage (its ``stage`` argument), so the same ``report("Loss/x", ...)`` in a ``forward`` that
    serves training and validation feeds a training collector and a validation one separately.
    :class:`~lightning_ext.callbacks.TrainingStats` sets Lightning's stage (``"validate"``,
    ``"test"``, ``"predict"``) while those loops run; plain and Fabric loops call it themselves if
    they want stages. Process-local: no collective, no sync. Under ``torch.compile`` it breaks the graph
    (with ``fullgraph=True`` the compile raises): call it outside the compiled region.

    Args:
        stage: a non-empty str of printable characters (any name, e.g. ``"validate"``) or ``None``.

    Returns:
        The stage set before, to restore it.

    Raises:
        TypeError: ``stage`` is neither a str nor ``None``.
        ValueError: ``stage`` is empty or holds a control character (``"\\n"``, ``"\\x1f"``, ...).

    Example::

        >>> from lightning_ext.stats import Collector, clear_statistics, report, set_stage
        >>> clear_statistics(); train, val = Collector(), Collector(stage="validate")
        >>> _ = report("x", 1.0); previous = set_stage("validate"); _ = report("x", 5.0)
        >>> _ = set_stage(previous); train.update(); val.update(); train.mean("x"), val.mean("x")
        (1.0, 5.0)
    """
    if torch.compiler.is_compiling():  # (traced, it would take effect after the graph's reports)
        torch._dynamo.graph_break()
    if stage is not None:
        check_label("set_stage", "stage", stage)
    previous, _state.stage = _state.stage, stage
    _state.current = _state.routes.setdefault(stage, {})
    return previous


# ------------------------------------------------------------------------------------------------
# report().


def _check_tensor(name: str, value: torch.Tensor) -> None:
    """TypeError naming ``name`` unless the elements of ``value`` can be counted: real numbers in
    strided storage (one dtype lookup and three flags: the cost of report() of a tensor)."""
    if value.dtype in _UNCOUNTABLE or value.layout is not _STRIDED or value.is_nested or value.is_meta:
        if value.is_complex():
            raise TypeError(f"report({name!r}, value): complex tensors are not supported, got {value.dtype}")
        kind = " nested" if value.is_nested else " quantized" if value.is_quantized else ""
        raise TypeError(
            f"report({name!r}, value): value must be a tensor of real numbers in strided storage, got "
            f"a{kind} {value.dtype} tensor on device {value.device} with layout {value.layout}. HINT: report "
            "a dense copy (`value.to_dense()`, `value.dequantize()`, `value.float()`, ...) or one with data"
        )


def _check_value(name: str, value: Any) -> None:
    """TypeError naming ``name`` unless ``value`` can be counted (checked without converting a tensor)."""
    if isinstance(value, torch.Tensor):
        return _check_tensor(name, value)
    _as_float(name, value) if _is_number(value) else _as_array(name, value)


def _as_array(name: str, value: Any) -> np.ndarray:
    """Flat float64 array of a list/tuple/ndarray of numbers, else TypeError naming ``name``."""
    try:
        array = np.asarray(value) if isinstance(value, list | tuple | np.ndarray | np.generic) else None
    except (ValueError, TypeError) as err:  # a ragged list, ...
        raise TypeError(f"report({name!r}, value): cannot read {value!r:.80} as numbers ({err})") from None
    if array is None or (array.dtype.kind not in "biuf" and array.size):
        raise TypeError(
            f"report({name!r}, value): value must be a number, a list/tuple of numbers, a numeric NumPy "
            f"array or a real tensor, got {type(value).__name__} {value!r:.80}"
        )
    return np.ascontiguousarray(array, dtype=np.float64).reshape(-1)


def _is_number(value: Any) -> bool:
    """A Python or NumPy real number (not a tensor or an array)."""
    return type(value) is float or (not isinstance(value, torch.Tensor | np.ndarray)
                                    and isinstance(value, numbers.Real))  # fmt: skip


def _as_float(name: str, value: Any) -> float:
    """``float(value)`` of a real number, else OverflowError naming ``name`` (an int beyond float64)."""
    try:
        return float(value)
    except OverflowError:
        raise OverflowError(f"report({name!r}, value): {value!r:.40} is beyond float64's range "
                            "(about 1.8e308)") from None  # fmt: skip


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` as a countable real tensor (bool, uint16/32/64 and float8 converted as ``_CONVERTED``
    says; the kernels read a tensor that requires grad without recording it), else TypeError naming
    ``name``."""
    if isinstance(value, torch.Tensor):
        _check_tensor(name, value)
        dtype = _CONVERTED.get(value.dtype)
        return value if dtype is None else value.detach().to(dtype)
    if _is_number(value):
        return torch.tensor(_as_float(name, value), dtype=torch.float64)
    return torch.from_numpy(_as_array(name, value))


def _route(name: Any) -> _Route:
    """The route of ``name`` in the current stage, made now (its name checked once)."""
    check_label("report(name, value)", "name", name)
    state = _state
    stores = [store for _, store in state.stores if store.stage == state.stage and store.wants(name)]
    return state.current.setdefault(name, (stores, {}))


def report(name: str, value: T) -> T:
    """Accumulate ``value`` under ``name`` for every collector whose regex matches; return ``value``.

    Callable anywhere (under autocast, ``torch.no_grad`` or inference mode) on any subset of ranks, in any
    order; not thread-safe. A name nobody collects costs a dict lookup and a type check; else the value is
    accumulated where it lives (numbers and NumPy data on the CPU) by the kernel backend's
    ``accumulate_moments_``, once per collector that takes it: float64 count and sums of the finite elements
    shifted by the first finite value (16/32-bit elements may be squared in float32), min, max, and the count
    of NaN and ``±inf`` elements. A name's first report in a stage checks it; an empty value registers it (NaN
    until it has values). No host-device sync, no collective. Under ``torch.compile`` (``fullgraph=True``
    included) a tensor or number is one opaque graph node, the custom op ``lightning_ext::report_``, running
    this eager path: a flush does not retrace the model (lists and NumPy arrays break the graph; a Python
    number is a constant of the graph: one that changes between calls recompiles, and with ``fullgraph=True``
    raises past dynamo's recompile limit, so report it outside).

    Args:
        name: statistic name, printable, conventionally ``"Group/quantity_unit"`` (``"Loss/total"``).
        value: a Python number (bool/int/float, NumPy scalar), a list/tuple of numbers, a numeric
            NumPy array, or a real tensor of any shape, dtype (bool, uint16/32/64 and float8 are
            converted) and device, strided (not on ``meta``, not nested, not quantized).

    Raises:
        TypeError: ``name`` is not a str, or ``value`` is not numeric (str, object, complex, ...), or a
            tensor without real strided storage (sparse, nested, quantized, sub-byte, MKL-DNN, on
            ``meta``).
        ValueError: ``name`` is empty or holds a control character (``"\\n"``, ``"\\x1f"``, ...).
        OverflowError: ``value`` is a Python int beyond float64's range. Nothing is accumulated then.

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
    route = _state.current.get(name) if type(name) is str else None
    stores, per_device = route if route is not None else _route(name)
    if not stores:
        _check_value(name, value)
        return value
    if isinstance(value, torch.Tensor):
        x = _as_tensor(name, value)
        device = x.device
    elif _is_number(value):
        _SCRATCH_VALUE[()] = value if type(value) is float else _as_float(name, value)
        x, device = _SCRATCH, _CPU
    else:
        x, device = torch.from_numpy(_as_array(name, value)), _CPU
    accumulators = per_device.get(device)
    if accumulators is None:  # (an empty value makes the rows: it registers the name)
        accumulators = per_device[device] = [store.accumulator(name, device) for store in stores]
    if x.numel():
        for row, shift, hist, slab in accumulators:
            slab.moments(row, x, shift)
            if hist is not None:
                slab.histogram(hist, x, slab.edges)
    return value


@torch.library.custom_op("lightning_ext::report_", mutates_args=("token",))
def _report_op(x: torch.Tensor, token: torch.Tensor, name: str) -> None:
    """``report(name, x)`` as one node of a compiled graph, run eagerly when the graph runs. It
    declares that it writes ``token`` (it does not), so that the compiler keeps the node."""
    report(name, x)


_report_op.register_fake(lambda x, token, name: None)
_TOKEN = torch.zeros(())  # what _report_op "writes"


def _report_traced(name: str, value: T) -> T:
    """What ``report()`` traces under ``torch.compile``: the value as a tensor, into the custom op (a
    NumPy scalar, which dynamo traces as a 0-dim array, as a float64 tensor)."""
    check_label("report(name, value)", "name", name)
    scalar = isinstance(value, (np.ndarray, np.generic)) and value.ndim == 0  # (a tuple: dynamo traces it)
    x = torch.as_tensor(value, dtype=torch.float64) if scalar else _as_tensor(name, value)
    _report_op(x, _TOKEN, name)
    return value


def report0(name: str, value: T) -> T:
    """Like :func:`report`, but only rank 0's values count; other ranks register ``name`` only.

    Use for values that are identical on every rank (learning rate, loss scale) so they are not
    counted ``world_size`` times. No sync, no collective.

    Returns:
        ``value`` itself, unchanged.

    Raises:
        TypeError, ValueError, OverflowError: as :func:`report`.
    """
    if _sync_settings().rank == 0:
        return report(name, value)
    _check_value(name, value)
    if torch.compiler.is_compiling() or type(name) is not str or name not in _state.current:
        report(name, torch.zeros(0))  # registered (and checked) once per stage; a graph node under compile
    return value


def clear_statistics() -> None:
    """Clear all module state: pending values, the collector registry and the multiprocessing settings.

    Collectors created before ``clear_statistics()`` stop receiving values (create new ones). Use between
    independent runs in one process (e.g. several Trainers in a notebook). Local only: no collective.
    """
    global _state
    for _, store in _state.stores:
        store.detach()
    _state = _State()
