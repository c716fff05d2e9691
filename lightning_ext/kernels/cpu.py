"""The ``cpu`` backend: compiled C++ kernels for CPU tensors (``lightning_ext/csrc/kernels_cpu.cpp``).

Each op is ONE vectorized, multi-threaded pass where ATen needs several: float32 arithmetic per
element (float64 for float64 and integer input), partial sums of a few dozen to a few thousand
elements added into float64 totals; compiled for x86-64-v3 (AVX2, FMA) and the baseline, picked at
load time. ``unscale_and_check_`` is ATen's one-pass op, as in ``reference``.

:func:`torch.utils.cpp_extension.load` (a C++ compiler and ``ninja``) builds the extension when a
process first builds this backend, cached in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions/py<version>_<cpu|cuXY>``); ``python -m lightning_ext.kernels`` builds it
ahead of time and prints where.

The build key. torch keeps ONE build per extension name and rebuilds it when the environment that
loads it differs from the one that built it last, so two environments sharing the cache (a project
venv and a notebook venv with another torch) would rebuild it in turn, ~30 s each time. The name is
therefore ``lightning_ext_kernels_cpu_<key>``, ``<key>`` the first 12 hex digits of a SHA-256 of
everything that makes a build incompatible (``_build_key``): the torch version (``2.13.0+cpu``:
it includes the CUDA/CPU variant), torch's C++ ABI (``torch.compiled_with_cxx11_abi()``, i.e.
``torch._C._GLIBCXX_USE_CXX11_ABI``), the Python implementation, version and platform (the
extension-module suffix, e.g. ``.cpython-311-x86_64-linux-gnu.so``), the compiler flags and the
bytes of the source. Each environment keeps its own build directory,
``$TORCH_EXTENSIONS_DIR/lightning_ext_kernels_cpu_<key>``, side by side with the others; a changed
source gets a new directory (remove old ones freely: they are rebuilt on demand).

A process that blocks on a build, its own or another process's (the ranks of one machine wait for
the one that builds), says so ONCE, on every rank, through this module's logger: a ``WARNING`` naming
the build directory, after ``_ANNOUNCE_AFTER_SECONDS`` (a cached load is silent).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_ext._compat import BUILD_LOCK_IS_ADVISORY, build_lock_held
from lightning_ext.kernels.backend import _OPS
from lightning_ext.kernels.reference import ReferenceBackend

__all__ = ["CpuBackend"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kernels_cpu.cpp"
_NAME = "lightning_ext_kernels_cpu"  # + "_<build key>" (see the module docstring)
# -fopenmp: ATen's at::parallel_for is inline OpenMP code, serial unless compiled with OpenMP; the
# runtime (libgomp.so.1) is the one torch already loaded. No -march: the build must run on any CPU
# that shares the extension cache (target_clones picks AVX2 at load time).
_CFLAGS = ["-O3", "-fopenmp"]
_ANNOUNCE_AFTER_SECONDS = 3.0  # a load taking longer than this is a build: say so
_STALE_LOCK_SECONDS = 600.0  # a build takes ~30 s; a lock file this old was left by a killed build

_lock = threading.Lock()
_module: ModuleType | None = None  # the loaded extension; kept by resets: a process cannot unload it
_announce_lock = threading.Lock()
_announced = False  # this process has said that it blocks on a build (once, again after a reset)


def _build_key(torch_version: str, cxx11_abi: bool, python: str, source: bytes) -> str:
    """The part of the extension's name that separates incompatible builds (see the module docstring).

    Args:
        torch_version: ``torch.__version__``, e.g. ``"2.13.0+cpu"``.
        cxx11_abi: ``torch.compiled_with_cxx11_abi()``.
        python: the interpreter's extension-module suffix, e.g. ``".cpython-311-x86_64-linux-gnu.so"``.
        source: the bytes of the C++ source.

    Returns:
        12 lowercase hex digits, the same for the same arguments (and ``_CFLAGS``) in every process.

    Example::

        >>> python, source = ".cpython-311-x86_64-linux-gnu.so", b"int f();"
        >>> key = _build_key("2.13.0+cpu", True, python, source)
        >>> len(key), key == _build_key("2.13.0+cpu", True, python, source)
        (12, True)
        >>> key == _build_key("2.14.0+cpu", True, python, source)
        False
    """
    digest = hashlib.sha256()
    for part in (torch_version, str(int(cxx11_abi)), python, " ".join(_CFLAGS)):
        digest.update(part.encode() + b"\0")
    digest.update(source)
    return digest.hexdigest()[:12]


def _extension_name() -> str:
    """``lightning_ext_kernels_cpu_<key>``: the extension's name (its build directory and module name)
    for this process's torch, Python and the source as it is now."""
    python = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    key = _build_key(torch.__version__, torch.compiled_with_cxx11_abi(), python, _SOURCE.read_bytes())
    return f"{_NAME}_{key}"


def _build_directory(name: str) -> Path:
    """Where torch builds and caches the extension ``name`` (created when missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _announce(build_directory: Path, waiting: bool = False) -> None:
    """Say, once per process and on every rank, that this process blocks on a build and where.

    Args:
        build_directory: the extension's build directory.
        waiting: another process holds the build lock (else this process builds, or waits inside
            torch for another one that started at the same moment: torch does not tell which).
    """
    global _announced
    with _announce_lock:
        if _announced:
            return
        _announced = True
    if waiting:
        what = "waiting for another process to build the compiled CPU kernels"
    else:
        what = "building the compiled CPU kernels (or waiting for the process that builds them)"
    log.warning(
        "lightning_ext: %s in %s, about 30 s once per environment. "
        "`python -m lightning_ext.kernels` builds them ahead of time.",
        what,
        build_directory,
    )


def _forget_announcement() -> None:
    """Let the next build that blocks this process say so again (:func:`lightning_ext.reset`)."""
    global _announced
    with _announce_lock:
        _announced = False


def _clear_stale_lock(directory: Path) -> None:
    """Wait while another process builds in ``directory`` (announced after ``_ANNOUNCE_AFTER_SECONDS``);
    remove a lock file older than ``_STALE_LOCK_SECONDS`` (torch waits for it without a time limit,
    so a killed build would make every later process hang)."""
    lock = directory / "lock"
    start = time.monotonic()
    while True:
        try:
            if not build_lock_held(lock):
                return
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if BUILD_LOCK_IS_ADVISORY:
            age = 0.0  # its holder is alive: the kernel drops an advisory lock with its process
        if age > _STALE_LOCK_SECONDS:
            log.warning("lightning_ext: removing the stale build lock %s (%.0f s old)", lock, age)
            lock.unlink(missing_ok=True)
            return
        if time.monotonic() - start >= _ANNOUNCE_AFTER_SECONDS:
            _announce(directory, waiting=True)
        time.sleep(0.5)


def _load(verbose: bool = False) -> ModuleType:
    """The compiled extension, built first when torch's cache holds no build for this environment and
    source (see the module docstring). Thread-safe; processes building at once wait for each other
    (torch's file lock), and every process that blocks longer than a few seconds says so once.

    Args:
        verbose: print the compiler's output.

    Raises:
        RuntimeError: the build failed (no compiler, no ninja, a read-only cache); other errors of
            torch's build are raised as they are.
    """
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load as build

            name = _extension_name()
            directory = _build_directory(name)
            _clear_stale_lock(directory)
            announce = threading.Timer(_ANNOUNCE_AFTER_SECONDS, _announce, args=(directory,))
            announce.daemon = True
            announce.start()
            try:
                _module = build(
                    name=name,
                    sources=[str(_SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=verbose,
                )
            finally:
                announce.cancel()
        return _module


# The one rule by which this backend hands a call to the reference op: op -> a test of its first
# tensor argument (x, or dy) that is true where the compiled kernel loses to ATen. The float16
# reductions and forward stay scalar in the kernels where ATen's are vectorized; the float16
# backward_elemt loses only in NCHW (channels last, ATen's is several times slower); float16
# accumulate_moments_ still wins. ATen's float64 normalize and channels-last float32/float64 backward
# sums are faster, and so is its NCHW normalize from about a million elements in bfloat16 and above
# two million in float32 (below, the kernel's lower overhead wins: the digits model's layers).
# benchmarks/bench_kernels.py fails when the automatic choice is slower than `reference` anywhere, and
# bench_syncbn.py compares them on whole layers, so this table follows measurement.
_LARGE = 2**20  # elements


def _half(x: torch.Tensor) -> bool:
    return x.dtype == torch.float16


def _channels_last(x: torch.Tensor) -> bool:
    return not x.is_contiguous()


_DEFER_TO_REFERENCE: dict[str, Callable[[torch.Tensor], bool]] = {
    "batch_norm_moments": _half,
    "batch_norm_elemt": lambda x: _half(x) or x.dtype == torch.float64 or (
        not _channels_last(x)
        and (
            (x.dtype == torch.bfloat16 and x.numel() >= _LARGE)
            or (x.dtype == torch.float32 and x.numel() > 2 * _LARGE)
        )
    ),
    "batch_norm_backward_reduce": lambda dy: _half(dy) or (
        dy.dtype in (torch.float32, torch.float64) and _channels_last(dy)
    ),
    "batch_norm_backward_elemt": lambda dy: _half(dy) and not _channels_last(dy),
}


def _deferring(kernel: Callable[..., Any], reference: Callable[..., Any], test: Callable) -> Callable:
    """``kernel``, but ``reference`` where ``test(first argument)`` holds."""

    def run(*args: Any) -> Any:
        return (reference if test(args[0]) else kernel)(*args)

    return run


class CpuBackend(ReferenceBackend):
    """The ops of :class:`~lightning_ext.kernels.KernelBackend` as compiled one-pass CPU kernels.

    Raises:
        RuntimeError: the extension cannot be built or loaded (no C++ compiler or ``ninja``, a
            read-only extension cache).

    Example::

        >>> import torch
        >>> CpuBackend().batch_norm_moments(torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "cpu"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self) -> None:
        ext = _load()
        for op in _OPS:  # every op but unscale_and_check_ (ATen's, inherited)
            if hasattr(ext, op):
                kernel, test = getattr(ext, op), _DEFER_TO_REFERENCE.get(op)
                if test is not None:
                    kernel = _deferring(kernel, getattr(ReferenceBackend, f"_{op}"), test)
                setattr(self, f"_{op}", kernel)
        self._check_finite = lambda tensors, device: ext.check_finite(tensors)  # takes no device
        super().__init__()

    @override
    def supports(self, device_type: str) -> bool:
        return device_type == "cpu"


if __name__ == "__main__":  # the former entry point: runpy warns (the package imports this module first)
    sys.exit(
        "lightning_ext: `python -m lightning_ext.kernels.cpu` moved: run `python -m lightning_ext.kernels`"
    )
