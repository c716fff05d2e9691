"""The ``cpu`` backend: compiled C++ kernels for CPU tensors (``lightning_ext/csrc/kernels_cpu.cpp``).

Each op is ONE vectorized, multi-threaded pass where ATen needs several: float32 arithmetic per
element (float64 for float64 and integer input), partial sums of a few dozen to a few thousand
elements added into float64 totals; compiled for x86-64-v3 (AVX2, FMA) and the baseline, picked at
load time. ``unscale_and_check_`` is ATen's one-pass op, as in ``reference``.

:func:`torch.utils.cpp_extension.load` (a C++ compiler and ``ninja``) builds the extension when a
process first builds this backend, cached in ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) keyed on the source; ``python -m lightning_ext.kernels.cpu`` builds it
ahead of time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import ClassVar

from typing_extensions import override

from lightning_ext.kernels.backend import OPS
from lightning_ext.kernels.reference import ReferenceBackend

__all__ = ["SOURCE", "CpuBackend", "load"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kernels_cpu.cpp"
_NAME = "lightning_ext_kernels_cpu"
# -fopenmp: ATen's at::parallel_for is inline OpenMP code, serial unless compiled with OpenMP; the
# runtime (libgomp.so.1) is the one torch already loaded. No -march: the build must run on any CPU
# that shares the extension cache (target_clones picks AVX2 at load time).
_CFLAGS = ["-O3", "-fopenmp"]
_ANNOUNCE_AFTER_SECONDS = 3.0  # a load taking longer than this is a build: say so
_STALE_LOCK_SECONDS = 600.0  # a build takes ~30 s; a lock file this old was left by a killed build

_lock = threading.Lock()
_module: ModuleType | None = None  # the loaded extension (one per process)


def _clear_stale_lock() -> None:
    """Wait while another process builds; remove a lock file older than ``_STALE_LOCK_SECONDS`` (torch
    waits for it without a time limit, so a killed build would make every later process hang)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(_NAME, verbose=False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_SECONDS:
            log.warning("lightning_ext: removing the stale build lock %s (%.0f s old)", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _announce() -> None:
    if os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning(
            "lightning_ext: building the compiled CPU kernels (%s) once, about 30 s; torch caches them. "
            "`python -m lightning_ext.kernels.cpu` builds them ahead of time.",
            SOURCE.name,
        )


def load(verbose: bool = False) -> ModuleType:
    """The compiled extension, built first when torch's cache does not hold this source. Thread-safe;
    processes building at once wait for each other (torch's file lock).

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

            _clear_stale_lock()
            announce = threading.Timer(_ANNOUNCE_AFTER_SECONDS, _announce)
            announce.daemon = True
            announce.start()
            try:
                _module = build(
                    name=_NAME,
                    sources=[str(SOURCE)],
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=verbose,
                )
            finally:
                announce.cancel()
        return _module


class CpuBackend(ReferenceBackend):
    """The ops of :class:`~lightning_ext.kernels.KernelBackend` as compiled one-pass CPU kernels.

    Raises:
        RuntimeError: the extension cannot be built or loaded (as :func:`lightning_ext.kernels.cpu.load`).

    Example::

        >>> import torch
        >>> CpuBackend().batch_norm_moments(torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "cpu"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self) -> None:
        ext = load()
        for op in OPS:  # every op but unscale_and_check_ (ATen's, inherited)
            if hasattr(ext, op):
                setattr(self, f"_{op}", getattr(ext, op))
        self._check_finite = lambda tensors, device: ext.check_finite(tensors)  # takes no device
        super().__init__()

    @override
    def supports(self, device_type: str) -> bool:
        return device_type == "cpu"


if __name__ == "__main__":
    start = time.perf_counter()
    module = load(verbose=True)
    print(f"lightning_ext cpu kernels ready ({time.perf_counter() - start:.1f} s): {module.__file__}")
