"""The ``cpu`` backend: compiled C++ kernels for CPU tensors (``lightning_ext/csrc/kernels_cpu.cpp``).

Each op is ONE vectorized, multi-threaded pass where ATen needs several: float32 arithmetic per
element (float64 for float64 and integer input), partial sums of a few dozen to a few thousand
elements added into float64 totals; compiled for x86-64-v3 (AVX2, FMA) and the baseline, picked at
load time. ``unscale_and_check_`` is ATen's one-pass op, as in ``reference``.

The build. :func:`torch.utils.cpp_extension.load` (a C++ compiler and ``ninja``) builds the extension
the first time a process of an environment needs it, in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions/py<version>_<cpu|cuXY>``); ``python -m lightning_ext.kernels`` builds it
ahead of time and prints where. A build that cannot run or fails raises ONE short line with the cause
(no compiler on ``PATH``: torch is not even asked; else the compiler's first error line); the
compiler's whole output goes to this module's logger at ``DEBUG``.

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

What is verified. A build ends by writing ``manifest.json`` beside the library (a temporary file
renamed into place): the extension's name, the library's size and its SHA-256. A later process loads
the library itself (``importlib``: no compiler, no ``ninja``, no lock, nothing written, so a prebuilt
cache loads from a read-only directory and whichever ``ninja`` is on ``PATH``) only when the manifest
is this build's and the library's bytes match it. A library that does not (missing, truncated,
damaged, replaced, or without a manifest) never reaches the dynamic loader, where a truncated one
kills the process with ``SIGBUS``: it is rebuilt where the directory can be written and a compiler
runs, else refused with one line that names the file and why. Trust, as ssh's for ``~/.ssh``: before
anything is read, the cache directory, the build directory and the files read must belong to the
current user or root and be writable by their owner only; else one line names the path, its owner and
mode, with a HINT. Directories created here and the files of a build are made so (``go-w``: the build
runs under umask 022), and a build starts from the source alone: every earlier file of its directory
(an object file, ninja's records) is removed first, so nothing another user could have written is
linked.

Builds take turns: a process builds under an advisory lock on ``lightning_ext.lock`` in the build
directory, which the kernel releases when its holder dies (a killed build leaves no stale lock; torch's
own lock file, which a killed build leaves behind in torch 2.13 and older, is removed under it). A
process that blocks on a build, its own or another process's (the ranks of one machine wait for the
one that builds), says so ONCE, on every rank, through this module's logger: a ``WARNING`` naming the
build directory, after ``_ANNOUNCE_AFTER_SECONDS`` (a verified load is silent).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from lightning_ext._compat import extension_build_directory, owner_writable
from lightning_ext.kernels.backend import ReferenceBackend

__all__ = ["CpuBackend"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kernels_cpu.cpp"
_NAME = "lightning_ext_kernels_cpu"  # + "_<build key>" (see the module docstring)
# -fopenmp: ATen's at::parallel_for is inline OpenMP code, serial unless compiled with OpenMP; the
# runtime (libgomp.so.1) is the one torch already loaded. No -march: the build must run on any CPU
# that shares the extension cache (target_clones picks AVX2 at load time). -fno-trapping-math: no
# floating-point trap is observed (IEEE results are unchanged), so a loop that selects between values
# it computed vectorizes (the moments' careful pass, per element, is ~6x faster with it).
_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]
_MANIFEST = "manifest.json"  # beside the library: {"name", "bytes", "sha256"} of the build
_LOCK = "lightning_ext.lock"  # in the build directory: flock-ed by the process that builds there
_ANNOUNCE_AFTER_SECONDS = 3.0  # a load taking longer than this is a build: say so

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
        waiting: another process builds there (else this process builds).
    """
    global _announced
    with _announce_lock:
        if _announced:
            return
        _announced = True
    log.warning(
        "lightning_ext: %s the compiled CPU kernels in %s, about 30 s once per environment. "
        "`python -m lightning_ext.kernels` builds them ahead of time.",
        "waiting for another process to build" if waiting else "building",
        build_directory,
    )


@contextlib.contextmanager
def _announced_if_slow(build_directory: Path, waiting: bool = False) -> Iterator[None]:
    """Run the block; :func:`_announce` if it lasts longer than ``_ANNOUNCE_AFTER_SECONDS``."""
    timer = threading.Timer(_ANNOUNCE_AFTER_SECONDS, _announce, args=(build_directory, waiting))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _forget_announcement() -> None:
    """Let the next build that blocks this process say so again (the cache's reset, called by
    :func:`~lightning_ext.kernels.clear_backend_cache`)."""
    global _announced
    with _announce_lock:
        _announced = False


def _check_trusted(path: Path) -> None:
    """Raise unless ``path`` (a directory or file of the cache) belongs to this user or root and only
    its owner can write it, as ssh requires of ``~/.ssh``: else another user could plant code that
    this process would run."""
    info, me = path.stat(), os.geteuid()
    if info.st_uid not in (me, 0):
        why = f"owned by uid {info.st_uid}"
        hint = (
            f"set TORCH_EXTENSIONS_DIR to a directory of your own, or `chown -R {me} {path}` if it is yours"
        )
    elif info.st_mode & 0o022:
        why, hint = "writable by group or others", f"`chmod go-w {path}`"
    else:
        return
    raise RuntimeError(
        f"refusing the kernel cache {path}: {why} ({stat.filemode(info.st_mode)}); it must belong to you "
        f"(uid {me}) or root and be writable by its owner only. HINT: {hint}"
    )


def _unverified(library: Path, name: str) -> str | None:
    """Why ``library`` (``<build directory>/<name>.so``) must not be loaded, or ``None`` when its
    manifest vouches for it (a build of ``name`` of that size and SHA-256). Checks that the manifest
    and the library are trusted (:func:`_check_trusted`) before reading them."""
    manifest = library.with_name(_MANIFEST)
    if not library.exists():
        return "is not built"
    if not manifest.exists():
        return f"has no {_MANIFEST} (a build of another release, or an interrupted build or copy)"
    _check_trusted(manifest)
    _check_trusted(library)
    try:
        record = json.loads(manifest.read_text())
        built, size, sha256 = record["name"], record["bytes"], record["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        return f"has an unreadable {_MANIFEST} ({type(error).__name__})"
    data = library.read_bytes()
    if built != name:
        return f"has the {_MANIFEST} of another build ({built!r})"
    if len(data) != size:
        return f"is {len(data)} bytes, {size} when built (truncated or incomplete)"
    if hashlib.sha256(data).hexdigest() != sha256:
        return "does not match the SHA-256 of its build (damaged or replaced)"
    return None


def _import(name: str, library: Path) -> ModuleType:
    """The extension module ``name`` from the verified file ``library``."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cannot_build(directory: Path) -> str | None:
    """Why no build can run in ``directory`` (read-only, no compiler, no ``ninja``), or ``None``."""
    if not os.access(directory, os.W_OK):
        return f"{directory} is read-only (its owner builds there: `python -m lightning_ext.kernels`)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"C++ compiler {compiler!r} not found (install g++, or set CXX)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold the build lock of ``directory``, waiting while another process holds it (announced after
    ``_ANNOUNCE_AFTER_SECONDS``). An advisory lock: the kernel releases it when its holder dies."""
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with _announced_if_slow(directory, waiting=True):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _short_cause(output: str) -> str:
    """The line of a failed build's output that says why: the first error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error:|not found", line)]
    return (errors or lines or ["no output"])[0][:160]


def _build(name: str, library: Path, verbose: bool) -> ModuleType:
    """Build ``name`` into ``library``'s directory with torch (holding the build lock), make the
    library writable by its owner only and write its manifest; the loaded module."""
    from torch.utils.cpp_extension import load as build

    directory = library.parent
    for stale in directory.iterdir():  # every earlier file, ours or not (a group member's object file
        if stale.name != _LOCK and not stale.is_dir():  # relinked, ninja's records, a truncated
            stale.unlink(missing_ok=True)  # library, torch's lock): a whole build, from the source only
    try:
        with _announced_if_slow(directory), owner_writable():  # (every file it writes: go-w)
            module = build(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=verbose,
            )
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:  # (torch's compiler check)
        output = getattr(error, "output", None)
        cause = output.decode(errors="replace") if isinstance(output, bytes) else output or str(error)
        log.debug("lightning_ext: building the cpu kernels in %s failed:\n%s", directory, cause)
        raise RuntimeError(f"building the cpu kernels failed: {_short_cause(cause)}") from None
    library.chmod(library.stat().st_mode & ~0o022)  # (owner_writable's already)
    data = library.read_bytes()
    record = {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    temporary = directory / f".{_MANIFEST}.{os.getpid()}"  # renamed into place: never half written
    temporary.write_text(json.dumps(record))
    temporary.chmod(0o644)
    temporary.replace(library.with_name(_MANIFEST))
    return module


def _load_or_build(name: str, verbose: bool) -> ModuleType:
    """The extension ``name``: loaded when the cache holds a verified build, else built (see the
    module docstring)."""
    directory = extension_build_directory(name)
    library = directory / f"{name}.so"
    _check_trusted(directory.parent)
    _check_trusted(directory)
    problem = _unverified(library, name)
    if problem is not None:
        cannot = _cannot_build(directory)
        if cannot is not None:
            raise RuntimeError(
                cannot if not library.exists() else f"{library} {problem}; cannot rebuild: {cannot}"
            )
        with _build_lock(directory):
            problem = _unverified(library, name)  # another process may have built it meanwhile
            if problem is not None:
                return _build(name, library, verbose)
    return _import(name, library)


def _load(verbose: bool = False) -> ModuleType:
    """The compiled extension, built first when the cache holds no verified build for this environment
    and source (see the module docstring). Thread-safe; processes building at once take turns, and
    every process that blocks longer than a few seconds says so once.

    Args:
        verbose: print the compiler's output.

    Raises:
        RuntimeError: one line: an untrusted cache (owner or mode), a library that fails verification
            and cannot be rebuilt (read-only, no compiler), a build that cannot run or failed (the
            compiler's output logged at DEBUG), or a verified library that does not load.
    """
    global _module
    with _lock:
        if _module is None:
            try:
                _module = _load_or_build(_extension_name(), verbose)
            except (OSError, ImportError) as error:
                raise RuntimeError(f"loading the cpu kernels failed: {error}") from None
        return _module


# The one rule by which this backend hands a call to the reference op: op -> a test of its first
# tensor argument (x, or dy; not contiguous: channels last), asked from _LARGE elements on, true where
# the compiled kernel loses to ATen. Empty: every op, dtype, layout and size is the kernels' (float16
# converts with F16C where the CPU has it; the NCHW normalize streams its planes in memory order).
# benchmarks/bench_kernels.py fails where the automatic choice is slower than `reference`, or than the
# compiled kernel on a case this table defers (its DEFERRED: a case per rule, at _LARGE; it stops when
# a rule has none), and bench_syncbn.py compares them on whole layers, so this table follows measurement.
_LARGE = 2**22  # elements
_DEFER_TO_REFERENCE: dict[str, Callable[[torch.Tensor], bool]] = {}


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
        return lambda x, *args: (reference if x.numel() >= _LARGE and test(x) else kernel)(x, *args)

    def supports(self, device_type: str) -> bool:
        return device_type == "cpu"
