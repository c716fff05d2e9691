"""Report training statistics from anywhere: ``report()``, ``report0()`` and the module state behind them.

Follows NVIDIA's ``torch_utils/training_stats.py`` (StyleGAN2-ADA/StyleGAN3/EDM). Each collector
receives exactly the values reported since *its* previous ``update()``: every ``update()`` first
*drains* the pending values into one immutable table handed to every live collector.
"""

from __future__ import annotations

import numbers
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
import torch

from lightning_ext import distributed as _dist
from lightning_ext._checks import check_int
from lightning_ext.kernels import get_backend
from lightning_ext.stats.moments import _EMPTY_ROW, _empty_moments, _merge_moments, _moments_from_shifted

if TYPE_CHECKING:
    from lightning_ext.stats.collector import Collector

__all__ = ["clear_statistics", "init_multiprocessing", "report", "report0"]

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------
# Module state (cleared by clear_statistics()).

# init_multiprocessing() arguments (rank, sync_device, process_group); None = follow torch.distributed
_settings: tuple[int, torch.device | None, Any] | None = None
# name => {device: (float64 (5,) sums in the layout of accumulate_moments_, float64 0-dim shift)}:
# the values reported since the last drain; the shift is the first value seen on that device
_pending: dict[str, dict[torch.device, tuple[torch.Tensor, torch.Tensor]]] = {}
_sinks: list[weakref.ref[Collector]] = []  # live collectors; each receives every drained table
_wanted: dict[str, bool] = {}  # name => some live collector's regex matches it (cache)


class _Table(NamedTuple):
    """An immutable drained snapshot: sorted ``names`` and float64 moment rows ``(len(names), 5)``."""

    names: list[str]
    rows: torch.Tensor


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


def _sync_settings() -> tuple[int, torch.device | None, Any]:
    """(rank, sync_device or None when single-process, process_group) in effect now."""
    if _settings is not None:
        return _settings
    if _dist.is_distributed():
        return _dist.get_rank(), _dist.collective_device(), None
    return 0, None, None


def _register(sink: Collector) -> None:
    """Add a collector: flush pending values to the existing ones first, so it starts empty."""
    _drain()
    _sinks.append(weakref.ref(sink, _forget))
    _wanted.clear()


def _forget(_ref: weakref.ref) -> None:
    """Weakref callback: a collector died; drop it from the registry."""
    _sinks[:] = [r for r in _sinks if r is not _ref and r() is not None]
    _wanted.clear()


def _live_sinks() -> list[Collector]:
    return [s for s in (r() for r in _sinks) if s is not None]


def _is_wanted(name: str) -> bool:
    wanted = _wanted.get(name)
    if wanted is None:
        wanted = _wanted[name] = any(s._matches(name) for s in _live_sinks())
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
        _check_value(name, value)
        x = value.detach()
        return x.to(torch.uint8) if x.dtype == torch.bool else x
    if isinstance(value, numbers.Real) and not isinstance(value, np.ndarray):
        return torch.tensor(float(value), dtype=torch.float64)
    return torch.from_numpy(_as_array(name, value))


def _accumulate(acc: dict[torch.device, tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> None:
    entry = acc.get(x.device)
    if entry is None:
        # Normal (not inference) tensors, so the first report may come from Lightning's validation
        # loop (inference_mode) and later ones from training.
        with torch.inference_mode(False):
            sums = torch.tensor(_EMPTY_ROW, dtype=torch.float64, device=x.device)
            # A non-finite shift would turn every later difference into NaN (inf - inf): use 0.
            first = x.reshape(-1)[0].to(torch.float64)
            shift = torch.nan_to_num(first, nan=0.0, posinf=0.0, neginf=0.0)
        entry = acc[x.device] = (sums, shift)
    get_backend(device=x.device).accumulate_moments_(entry[0], x, entry[1])


def report(name: str, value: T) -> T:
    """Accumulate ``value`` under ``name`` for every collector whose regex matches; return ``value``.

    Callable anywhere (under autocast, ``torch.no_grad`` or inference mode) on any subset of ranks,
    in any order; not thread-safe. A name nobody collects costs a dict lookup and a type check; else
    the value is accumulated where it lives (numbers and NumPy data on the CPU) by the kernel
    backend's ``accumulate_moments_``: float64 count and sums shifted by the first value (16/32-bit
    elements may be squared in float32 first), min, max.
    No host-device sync, no collective. An empty value registers the name (NaN until it has values).

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
    acc = _pending.get(name) if isinstance(name, str) else None
    if acc is None:
        _check_name(name)
        if not _is_wanted(name):
            _check_value(name, value)
            return value
        acc = _pending[name] = {}
    x = _as_tensor(name, value)
    if x.numel():
        _accumulate(acc, x)
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


def _drain() -> None:
    """Hand the values reported since the last drain to every live collector, then forget them.

    Converts them to one table of moment rows on the sync device (CPU when single-process), which
    synchronizes host and device.
    """
    global _pending
    if not _pending:
        return
    pending, _pending = _pending, {}
    sinks = _live_sinks()
    if not sinks:
        return
    device = _sync_settings()[1] or torch.device("cpu")
    names = sorted(pending)
    rows = _empty_moments(len(names), device)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, name in enumerate(names):
        for dev, (sums, shift) in pending[name].items():
            by_device.setdefault(dev, []).append((i, sums, shift))
    for entries in by_device.values():
        index, accs, shifts = zip(*entries)
        converted = _moments_from_shifted(torch.stack(accs), torch.stack(shifts)).to(device)
        idx = torch.tensor(index, device=device)
        rows[idx] = _merge_moments(rows[idx], converted)
    table = _Table(names, rows)
    for sink in sinks:
        sink._receive(table)


def clear_statistics() -> None:
    """Clear all module state: pending values, the collector registry and the multiprocessing settings.

    Collectors created before ``clear_statistics()`` stop receiving values (create new ones). Use between
    independent runs in one process (e.g. several Trainers in a notebook). Local only: no collective.
    """
    global _settings, _pending
    for sink in _live_sinks():
        sink._detach()
    _settings, _pending = None, {}
    _sinks.clear()
    _wanted.clear()
