"""Registry of kernel backends (its public names are re-exported by :mod:`lightning_ext.kernels`):
registration, entry points, selection and the per-process cache, after Liger-Kernel's
``ops/backends/registry.py``. :func:`clear_backend_cache` clears the process-wide state of the
kernels: this module's, and through their own resets the caches of the backends and ops; not
registrations.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import torch

from lightning_ext._checks import check_bool, check_int
from lightning_ext._compat import assume_constant_result
from lightning_ext.kernels._triton import TritonBackend, forget_sm_counts
from lightning_ext.kernels.backend import KernelBackend, ReferenceBackend
from lightning_ext.kernels.cpu import CpuBackend, _forget_announcement
from lightning_ext.kernels.unscale import _forget_launch_metadata

__all__ = [
    "BACKEND_ENV_VAR", "ENTRY_POINT_GROUP", "BackendEntry", "available_backends", "clear_backend_cache",
    "get_backend", "register_backend",
]  # fmt: skip

BACKEND_ENV_VAR = "LIGHTNING_EXT_KERNELS"  # environment variable naming the backend to use
ENTRY_POINT_GROUP = "lightning_ext.kernels"  # entry-point group third-party backends register in
_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")

_lock = threading.RLock()
_entries: dict[str, BackendEntry] = {}  # name -> entry, in registration order
_built: dict[str, KernelBackend | Exception] = {}  # name -> its factory's backend or exception (once)
_cache: dict[tuple[str | None, str], KernelBackend] = {}  # (requested name, device type) -> backend
_entry_points_loaded = False  # entry-point group read (once per process, again after a clear)
_from_entry_points: dict[str, BackendEntry] = {}  # name -> entry an entry point registered
_fallback_warned = False  # the one auto-fallback warning of this process was issued


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend, validated: the arguments of :func:`register_backend`.

    Raises:
        ValueError, TypeError: as :func:`register_backend`.
    """

    name: str
    factory: Callable[[], KernelBackend]
    devices: tuple[str, ...]
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(f"`name` must match {_NAME_RE.pattern!r} (e.g. 'triton'), got {self.name!r}")
        if not callable(self.factory):
            raise TypeError(f"`factory` must be callable returning a KernelBackend, got {self.factory!r}")
        devices = (self.devices,) if isinstance(self.devices, str) else self.devices
        if not isinstance(devices, tuple | list):
            raise TypeError(f"`devices` must be a tuple of device types like ('cuda',), got {self.devices!r}")
        if not devices:
            raise ValueError(f"`devices` must name at least one device type, got {self.devices!r}")
        object.__setattr__(self, "devices", tuple(map(_device_type, devices)))
        check_int("BackendEntry", "priority", self.priority)


def _device_type(device: str) -> str:
    """``torch.device(device).type``, else the error of :func:`register_backend`."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"`devices` contains {device!r}, which is not a torch device type") from None


def register_backend(
    name: str, factory: Callable[[], KernelBackend], devices: tuple[str, ...] | list[str] | str = ("cuda",),
    priority: int = 0, *, replace: bool = False,
) -> BackendEntry:  # fmt: skip
    """Register a kernel backend under ``name``.

    Args:
        name: lower-case identifier (``[a-z][a-z0-9_-]*``), e.g. ``"my_cuda"``.
        factory: zero-argument callable (e.g. the :class:`KernelBackend` subclass) building the backend.
            It runs lazily on first use, once per process; raise from it when dependencies or hardware
            are missing.
        devices: device types (``torch.device.type``) it supports, e.g. ``("cuda",)``.
        priority: auto-selection prefers higher values (``reference`` has 0).
        replace: allow replacing an existing registration of ``name``.

    Returns:
        The validated :class:`BackendEntry`.

    Raises:
        ValueError: invalid ``name``/``devices``, or ``name`` already registered and ``replace=False``.
        TypeError: ``factory`` not callable, ``priority`` not an int, ``replace`` not a bool.

    Example::

        >>> from lightning_ext.kernels import ReferenceBackend
        >>> _ = register_backend("my_reference", ReferenceBackend, devices=("cpu",), priority=-1)
        >>> "my_reference" in available_backends()
        True
    """
    check_bool("register_backend", "replace", replace)
    entry = BackendEntry(name, factory, devices, priority)
    with _lock:
        if name in _entries and not replace:
            raise ValueError(
                f"kernel backend {name!r} is already registered; pass replace=True to replace it"
            )
        _entries[name] = entry
        _built.pop(name, None)
        _cache.clear()
    return entry


def _load_entry_points() -> None:
    """Read the entry-point group once per process. An entry point's object is a :class:`KernelBackend`
    subclass (registered under the entry point's name with its ``devices`` and ``priority`` class
    attributes) or a callable without arguments that registers; a broken one warns and is skipped."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            before = dict(_entries)
            try:
                obj = ep.load()
                if not (isinstance(obj, type) and issubclass(obj, KernelBackend)):
                    obj()  # a function that registers
                elif ep.name not in _entries:
                    register_backend(ep.name, obj, obj.devices, getattr(obj, "priority", 0))
            except Exception as exc:  # a broken plugin must not break the others
                message = f"lightning_ext: kernel backend entry point {ep.name!r} ({ep.value}) failed to load"
                warnings.warn(f"{message}: {exc!r}", RuntimeWarning, stacklevel=3)
            _from_entry_points.update((n, e) for n, e in _entries.items() if before.get(n) is not e)


def available_backends() -> dict[str, BackendEntry]:
    """All registered backends (built-in and entry points), by name, highest priority first; loads
    (builds) none of them.

    Example::

        >>> {"reference", "triton"} <= set(available_backends())
        True
    """
    _load_entry_points()
    with _lock:
        return dict(sorted(_entries.items(), key=lambda kv: -kv[1].priority))


def _instantiate(entry: BackendEntry) -> KernelBackend:
    """Build ``entry``'s backend once per process; re-raise a cached failure."""
    if entry.name not in _built:
        try:
            backend = entry.factory()
            if not isinstance(backend, KernelBackend):
                raise TypeError(
                    f"factory of kernel backend {entry.name!r} returned {backend!r}, not a KernelBackend"
                )
        except Exception as exc:
            backend = exc
        else:
            backend.serve_as(entry.name)
        _built[entry.name] = backend
    if isinstance(_built[entry.name], Exception):
        raise _built[entry.name]
    return _built[entry.name]


def _explicit(name: str, device: torch.device, source: str) -> KernelBackend:
    """The backend ``name`` asked for by ``source``; raises when it is unknown, elsewhere or broken."""
    what = f"kernel backend {name!r} (from {source})"
    registered = f"registered backends: {sorted(_entries)}"
    entry = _entries.get(name)
    if entry is None:
        raise ValueError(f"unknown {what}; {registered}")
    try:
        backend = _instantiate(entry)
    except Exception as exc:
        raise RuntimeError(f"{what} failed to load: {exc!r}; {registered}") from exc
    # Named explicitly, a backend also serves a device it supports beyond its registration (Triton's
    # interpreter on CPU tensors).
    if device.type not in entry.devices and not backend.supports(device.type):
        raise ValueError(f"{what} supports devices {entry.devices}, not {device.type!r}; {registered}")
    return backend


def _automatic(device: torch.device) -> KernelBackend:
    """The highest-priority backend for ``device`` that loads (``reference``, priority 0, always does;
    it also serves a device no backend names); one short warning per process, the cause first, when a
    preferred one fails to load."""
    global _fallback_warned
    candidates = sorted(  # (reference at its priority, 0: one below it is never chosen)
        (e for e in _entries.values() if device.type in e.devices), key=lambda e: (-e.priority, e.name)
    )
    failed = []
    for entry in candidates:
        try:
            backend = _instantiate(entry)
            break
        except Exception as exc:
            # (cut at 2000 characters: whole with the paths of a deep checkout or temporary directory)
            failed.append(f"kernel backend {entry.name!r} failed to load ({exc!s:.2000})")
    else:  # no preferred backend loads: `reference`, which always does
        backend = _instantiate(_entries["reference"])
    if failed and not _fallback_warned:
        _fallback_warned = True
        warnings.warn(
            f"lightning_ext: {'; '.join(failed)}; using {backend.name!r} for {device.type} tensors "
            f"(warned once per process; {BACKEND_ENV_VAR}={backend.name} silences it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return backend


def get_backend(name: str | None = None, device: torch.device | str | None = None) -> KernelBackend:
    """The kernel backend to use for tensors on ``device``.

    Selection: explicit ``name`` > ``LIGHTNING_EXT_KERNELS`` > automatic (``""``/``"auto"``): the
    highest-priority registered backend that supports the device type and loads, ``reference`` last.
    While ``torch.compile`` traces, the selection (and a first build) runs outside the graph, which
    keeps the backend selected then until a reset (:func:`clear_backend_cache`) makes it trace again.

    Args:
        name: backend name, or ``None`` for the environment variable or automatic selection.
        device: where the tensors live (``x.device``); ``None`` means ``torch.get_default_device()``.

    Returns:
        The backend, built on first use and cached per (requested name, device type) for the process.

    Raises:
        ValueError: the requested backend (argument or variable) is unknown or does not support
            ``device``; the message names the registered backends.
        RuntimeError: the requested backend failed to load (the cause is chained).
        TypeError: ``name`` not a string or ``device`` not a device.

    Warns:
        RuntimeWarning: once per process, when an automatically selected backend fails to load and
            another (in the end ``reference``) is used instead.

    Example::

        >>> get_backend("reference", device="cpu").name
        'reference'
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"`name` must be a backend name (str) or None, got {name!r}")
    if device is not None and not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"`device` must be a torch.device, str or None, got {device!r}")
    device = torch.get_default_device() if device is None else torch.device(device)
    if torch.compiler.is_compiling():
        # The key first: dynamo runs _selection outside the graph, which may fill _cache, and torch 2.5's
        # dynamo reads a dict as it is when its name is loaded (loaded first, it missed the new entry)
        key = _selection(name, device.type), device.type
        return _cache[key]
    return _lookup(name, device)


def _requested(name: str | None) -> tuple[str | None, str]:
    """The backend asked for (``None``: automatic selection) and by what: ``name``, else the
    environment variable."""
    if name is not None:
        return name, "argument `name`"
    env = os.environ.get(BACKEND_ENV_VAR, "").strip()
    return (None if env in ("", "auto") else env), f"environment variable {BACKEND_ENV_VAR}"


def _lookup(name: str | None, device: torch.device) -> KernelBackend:
    """:func:`get_backend` on checked arguments: from the cache, else selected, built and cached."""
    requested, source = _requested(name)
    backend = _cache.get((requested, device.type))
    if backend is None:
        _load_entry_points()
        with _lock:
            backend = _automatic(device) if requested is None else _explicit(requested, device, source)
            _cache[requested, device.type] = backend
    return backend


@assume_constant_result
def _selection(name: str | None, device_type: str) -> str | None:
    """The backend asked for (:func:`_requested`), selected (and built) now for ``device_type``: what
    :func:`get_backend` caches it under. ``torch.compile`` calls it outside the graph and keeps the
    value, as dynamo cannot trace loading (a first lookup in a fresh worker process, after a reset, on
    a new device); the graph then takes the cached backend, guarded: a reset makes it trace again."""
    _lookup(name, torch.device(device_type))
    return _requested(name)[0]


def clear_backend_cache() -> None:
    """Forget every process-wide cache of the kernels: the built backends and failed builds, the
    selection cache, the fallback warning, the backends entry points registered (the group is read
    again at the next lookup) and, through each cache's own reset, the Triton kernels' launch metadata
    and multiprocessor counts and whether a ``cpu`` build was announced.

    Registrations made with :func:`register_backend` stay, and so do the loaded ``cpu`` extension (a
    compiled module cannot be unloaded from a process; the next :func:`get_backend` builds the backend
    from it again without compiling) and the latest instance of each backend, which the
    ``torch.library`` ops run (a graph traced before the reset still runs; a backend built again
    replaces it). Local, no collective; :func:`lightning_ext.reset` calls it.

    Example::

        >>> before = get_backend("reference", device="cpu")
        >>> clear_backend_cache()
        >>> get_backend("reference", device="cpu") is before
        False
    """
    global _fallback_warned, _entry_points_loaded
    with _lock:
        for name, entry in _from_entry_points.items():
            if _entries.get(name) is entry:  # not replaced by a register_backend() call since
                del _entries[name]
        for cache in (_built, _cache, _from_entry_points):
            cache.clear()
        _fallback_warned = _entry_points_loaded = False
    forget_sm_counts()
    _forget_launch_metadata()
    _forget_announcement()


register_backend("reference", ReferenceBackend, ReferenceBackend.devices, priority=0)
register_backend("cpu", CpuBackend, ("cpu",), priority=5)
register_backend("triton", TritonBackend, ("cuda",), priority=10)
