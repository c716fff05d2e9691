"""The compiled CPU kernels of :class:`~lightning_ext.nn.SyncBatchNorm` (``csrc/sync_batch_norm_cpu.cpp``).

On small CPU layers SyncBatchNorm's cost is not the arithmetic but the passes over the data and the
host-side operations around them: the pure-torch path (the ``reference`` kernel backend's ATen ops)
makes about 45 per layer and step and four passes over the activations per backward, since ATen has
no fused CPU kernel for the synchronized backward. This extension runs the training forward and
backward as one C++ call each (a ``torch::autograd::Function``): one pass for the moments, the
all_reduce (a Python callback: ``torch.distributed`` / :mod:`lightning_ext.shm_collectives`), one
pass to normalize; one pass for the backward's local sums, the all_reduce, one pass for ``dx``.
Loops are vectorized per channel (float32 arithmetic, float64 for float64 input; float64 totals)
and compiled for AVX2 and the baseline, picked by the CPU at load time.
``benchmarks/bench_end_to_end.py`` and ``benchmarks/bench_syncbn.py`` measure it against the
pure-torch path.

Built just-in-time with :func:`torch.utils.cpp_extension.load` (needs a C++ compiler and ninja) the
first time a process asks for it, cached by torch in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) keyed on the source, and loaded from there by every later process (tens
of milliseconds). ``python -m lightning_ext.kernels.cpu_extension`` builds it ahead of time (the
Makefile does, after installing). A build that fails leaves SyncBatchNorm on its Python path, with one
``RuntimeWarning`` per process; ``LIGHTNING_EXT_CPU_EXTENSION=0`` turns the extension off.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["ANNOUNCE_AFTER_SECONDS", "ENV_VAR", "SOURCE", "STALE_LOCK_SECONDS", "enabled", "load"]

# -fopenmp-simd: only the `#pragma omp simd` loop annotations (vectorized per-channel reductions),
# no OpenMP runtime. No -march: the build must run on any CPU that shares the torch extension cache.
_CFLAGS = ["-O3", "-fopenmp-simd"]
ENV_VAR = "LIGHTNING_EXT_CPU_EXTENSION"  # "0" / "false" / "off": never build or load it
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "sync_batch_norm_cpu.cpp"
_NAME = "lightning_ext_sync_batch_norm_cpu"

ANNOUNCE_AFTER_SECONDS = 3.0  # a load taking longer than this is a build: say so (rank 0, INFO)
STALE_LOCK_SECONDS = 600.0  # a build takes ~40 s; a lock file this old was left by a killed build
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    """Whether ``LIGHTNING_EXT_CPU_EXTENSION`` allows the extension (unset, or anything but
    ``0``/``false``/``off``/``no``)."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _lock_path() -> Path:
    """The lock file torch's JIT build holds in this extension's build directory."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_NAME, verbose=False)) / "lock"


def _clear_stale_lock() -> None:
    """Wait while another process builds, and remove a lock left by a build that was killed.

    torch's ``FileBaton`` waits for the lock file to disappear without a time limit, so a build
    interrupted by Ctrl-C or a killed worker would make every later process hang. A lock older than
    :data:`STALE_LOCK_SECONDS` is removed with a ``RuntimeWarning``; a younger one is waited for.
    """
    lock = _lock_path()
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            warnings.warn(
                f"lightning_ext: removing the stale build lock {lock} ({age:.0f} s old: a build of the "
                "CPU extension was interrupted)",
                RuntimeWarning,
                stacklevel=3,
            )
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _announce_build() -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(
        f"lightning_ext: building the compiled CPU SyncBatchNorm kernels ({SOURCE.name}) once, about "
        "30 s; torch caches it for later runs. `python -m lightning_ext.kernels.cpu_extension` "
        f"builds it ahead of time, {ENV_VAR}=0 skips it."
    )


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled extension module, building it first if torch's cache does not hold this source.

    Args:
        verbose: print the compiler's output (the first build takes about 30 s on 2 cores).

    Returns:
        The module, or ``None`` when disabled by ``LIGHTNING_EXT_CPU_EXTENSION`` or when it cannot be
        built or loaded (then one ``RuntimeWarning`` names the error; not retried in this process).

    Thread-safe; concurrent processes building at once wait for each other (torch's file lock; a
    lock left by a killed build is removed after :data:`STALE_LOCK_SECONDS`, so nobody waits forever).
    """
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if enabled():
            try:
                from torch.utils.cpp_extension import load as _load

                _clear_stale_lock()
                # A first build stalls the first SyncBatchNorm forward for ~30 s: tell the user why.
                announce = threading.Timer(ANNOUNCE_AFTER_SECONDS, _announce_build)
                announce.daemon = True
                announce.start()
                try:
                    _module = _load(name=_NAME, sources=[str(SOURCE)], extra_cflags=_CFLAGS, verbose=verbose)
                finally:
                    announce.cancel()
            except Exception as err:  # no compiler, no ninja, a read-only cache: Python path
                warnings.warn(
                    f"lightning_ext: the compiled CPU SyncBatchNorm kernels could not be built or loaded "
                    f"({type(err).__name__}: {err}); SyncBatchNorm uses its pure-torch path on CPU "
                    f"(results equal to rounding, slower per layer). Set {ENV_VAR}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _tried = True
        return _module


def _reset_for_tests() -> None:
    """Forget the loaded module so that the next :func:`load` reads the environment again."""
    global _module, _tried
    with _lock:
        _module, _tried = None, False


if __name__ == "__main__":
    start = time.perf_counter()
    module = load(verbose=True)
    if module is None:
        raise SystemExit(f"the CPU extension is {'unavailable' if enabled() else 'disabled by ' + ENV_VAR}")
    print(f"lightning_ext CPU extension ready ({time.perf_counter() - start:.1f} s): {module.__file__}")
