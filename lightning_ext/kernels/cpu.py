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
loads it differs from the one that built it last, so environments sharing the cache (a project venv
and a notebook venv, or two venvs with the same torch at different paths) would rebuild it in turn,
30-90 s each time. The name is therefore ``lightning_ext_kernels_cpu_<key>``, ``<key>`` the first 12
hex digits of a SHA-256 of everything that makes a build belong to one environment (``_build_key``):
the torch version (``2.13.0+cpu``: it includes the CUDA/CPU variant) and install location (the
directory of ``torch/__init__.py``, whose headers and libraries the build uses), torch's C++ ABI
(``torch.compiled_with_cxx11_abi()``), the Python executable's prefix (``sys.prefix``) and extension
suffix (implementation, version and platform, e.g. ``.cpython-311-x86_64-linux-gnu.so``), the source's
location (torch's build file names the source by its path: two checkouts sharing one venv would
rebuild in turn), the compiler flags and the bytes of the source. Each environment keeps its own
build directory, ``$TORCH_EXTENSIONS_DIR/lightning_ext_kernels_cpu_<key>``, side by side with the
others; a changed source gets a new directory (remove old ones freely: they are rebuilt on demand).

A build that cannot run or fails raises ONE short line with the cause (no compiler on ``PATH``: torch
is not even asked; else the compiler's first error line); the compiler's whole output goes to this
module's logger at ``DEBUG``.

A process that blocks on a build, its own or another process's (the ranks of one machine wait for
the one that builds), says so ONCE, on every rank, through this module's logger: a ``WARNING`` naming
the build directory, after ``_ANNOUNCE_AFTER_SECONDS`` (a cached load is silent).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from lightning_ext._compat import BUILD_LOCK_IS_ADVISORY, build_lock_held, extension_build_directory
from lightning_ext.kernels.backend import ReferenceBackend

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


def _build_key(environment: tuple[str, ...], source: bytes) -> str:
    """The part of the extension's name that separates builds of different environments (see the
    module docstring).

    Args:
        environment: strings naming the environment, as :func:`_environment` gives them.
        source: the bytes of the C++ source.

    Returns:
        12 lowercase hex digits, the same for the same arguments (and ``_CFLAGS``) in every process.

    Example::

        >>> env = ("2.13.0+cpu", "/venv/lib/python3.11/site-packages/torch", "1", "/venv", ".cpython-311.so")
        >>> key = _build_key(env, b"int f();")
        >>> len(key), key == _build_key(env, b"int f();")
        (12, True)
        >>> key == _build_key(("2.13.0+cpu", "/other/venv/torch", *env[2:]), b"int f();")
        False
    """
    digest = hashlib.sha256()
    for part in (*environment, " ".join(_CFLAGS)):
        digest.update(part.encode() + b"\0")
    digest.update(source)
    return digest.hexdigest()[:12]


def _environment() -> tuple[str, ...]:
    """This process's torch version, torch install location, C++ ABI, ``sys.prefix``, Python
    extension suffix and the source's location: what a build belongs to."""
    python = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    torch_dir = str(Path(torch.__file__).resolve().parent)
    abi = str(int(torch.compiled_with_cxx11_abi()))
    return torch.__version__, torch_dir, abi, sys.prefix, python, str(_SOURCE)


def _extension_name() -> str:
    """``lightning_ext_kernels_cpu_<key>``: the extension's name (its build directory and module name)
    for this environment and the source as it is now."""
    return f"{_NAME}_{_build_key(_environment(), _SOURCE.read_bytes())}"


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


def _short_cause(output: str) -> str:
    """The line of a failed build's output that says why: the first error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error:|not found", line)]
    return (errors or lines or ["no output"])[0][:160]


def _load(verbose: bool = False) -> ModuleType:
    """The compiled extension, built first when torch's cache holds no build for this environment and
    source (see the module docstring). Thread-safe; processes building at once wait for each other
    (torch's file lock), and every process that blocks longer than a few seconds says so once.

    Args:
        verbose: print the compiler's output.

    Raises:
        RuntimeError: the build cannot run or failed (no compiler or ``ninja``, a compiler error, a
            read-only cache): one short line with the cause, the compiler's output logged at DEBUG.
    """
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import is_ninja_available
            from torch.utils.cpp_extension import load as build

            compiler = os.environ.get("CXX", "c++")
            if shutil.which(compiler) is None:
                raise RuntimeError(f"C++ compiler {compiler!r} not found (install g++, or set CXX)")
            if not is_ninja_available():
                raise RuntimeError("ninja is not installed (pip install ninja)")
            name = _extension_name()
            directory = extension_build_directory(name)
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
            except (RuntimeError, OSError) as error:
                log.debug("lightning_ext: building the cpu kernels in %s failed:\n%s", directory, error)
                raise RuntimeError(f"building the cpu kernels failed: {_short_cause(str(error))}") from None
            finally:
                announce.cancel()
        return _module


# The one rule by which this backend hands a call to the reference op: op -> a test of its first
# tensor argument (x, or dy; not contiguous: channels last) that is true where the compiled kernel
# loses to ATen. The float16 reductions and forward stay scalar in the kernels where ATen's are
# vectorized; the float16 backward_elemt loses only in NCHW (channels last, ATen's is several times
# slower); float16 accumulate_moments_ still wins. ATen's float64 normalize and channels-last
# float32/float64 backward sums are faster, and so is its NCHW normalize from about a million
# elements in bfloat16 and above two million in float32 (below, the kernel's lower overhead wins: the
# digits model's layers). benchmarks/bench_kernels.py fails when the automatic choice is slower than
# `reference` anywhere, and bench_syncbn.py compares them on whole layers, so this table follows
# measurement.
_LARGE = 2**20  # elements
_DEFER_TO_REFERENCE: dict[str, Callable[[torch.Tensor], bool]] = {
    "batch_norm_moments": lambda x: x.dtype == torch.float16,
    "batch_norm_elemt": lambda x: (
        x.dtype in (torch.float16, torch.float64)
        or (x.is_contiguous() and x.dtype == torch.bfloat16 and x.numel() >= _LARGE)
        or (x.is_contiguous() and x.dtype == torch.float32 and x.numel() > 2 * _LARGE)
    ),
    "batch_norm_backward_reduce": lambda dy: (
        dy.dtype == torch.float16 or (dy.dtype in (torch.float32, torch.float64) and not dy.is_contiguous())
    ),
    "batch_norm_backward_elemt": lambda dy: dy.dtype == torch.float16 and dy.is_contiguous(),
}


class CpuBackend(ReferenceBackend):
    """Every op as the compiled extension's function of the same name (the reference where it has
    none: ``unscale_and_check_``, ATen's one-pass op), but where ``_DEFER_TO_REFERENCE`` says the
    kernel loses to ATen.

    Raises:
        RuntimeError: the extension cannot be built or loaded (see ``_load``).

    Example::

        >>> import torch
        >>> CpuBackend().run("batch_norm_moments", torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "cpu"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self) -> None:
        self._extension = _load()
        super().__init__()

    def kernel(self, op: str) -> Callable[..., Any]:
        kernel, reference = getattr(self._extension, op, None), super().kernel(op)
        test = _DEFER_TO_REFERENCE.get(op)
        if kernel is None or test is None:
            return kernel or reference
        return lambda *args: (reference if test(args[0]) else kernel)(*args)

    def supports(self, device_type: str) -> bool:
        return device_type == "cpu"


if __name__ == "__main__":  # the former entry point: runpy warns (the package imports this module first)
    sys.exit(
        "lightning_ext: `python -m lightning_ext.kernels.cpu` moved: run `python -m lightning_ext.kernels`"
    )
