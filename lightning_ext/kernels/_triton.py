"""Triton plumbing shared by the op files: optional import and lazy, cached kernel wrapping.

Kernels are written as plain Python functions and wrapped on first launch: ``triton.jit`` for GPUs,
or Triton's interpreter (``InterpretedFunction``, what ``TRITON_INTERPRET=1`` selects globally) when a
backend is built with ``interpret=True``, so CPU tests need no environment variable set before
``import triton`` and other tests in the same process are unaffected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

try:  # Triton is an optional dependency (extra `triton`)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

HAS_TRITON = triton is not None  # whether `import triton` works in this environment
_wrapped: dict[tuple[Callable, bool], Any] = {}  # (python kernel, interpret) -> launchable kernel
_interpreted: dict[Callable, Any] = {}  # python function -> InterpretedFunction (nested jit calls)
_interpret_lock = threading.Lock()  # one interpreted launch at a time (the patch below is global)


def _call_interpreted(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``JITFunction.__call__`` during an interpreted launch: run a nested ``@triton.jit`` function
    (``tl.sum``, ``tl.zeros``, ...) in the interpreter instead of refusing to be called."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = _interpreted.get(self.fn)
    if fn is None:
        fn = _interpreted[self.fn] = InterpretedFunction(self.fn)
    return fn(*args, **kwargs)


@contextmanager
def _nested_jit_interpreted() -> Iterator[None]:
    """While an interpreted kernel runs, let Triton's standard-library jit functions be interpreted.

    ``TRITON_INTERPRET=1`` makes them interpreted at import time; here the interpreter is chosen per
    backend instead, so ``JITFunction.__call__`` is redirected for the duration of the launch only.
    """
    from triton.runtime.jit import JITFunction

    with _interpret_lock:
        original = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        try:
            yield
        finally:
            JITFunction.__call__ = original


class _InterpretedKernel:
    """``kernel[grid](*args)`` running ``fn`` in Triton's interpreter on CPU tensors."""

    def __init__(self, fn: Callable) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.fn = InterpretedFunction(fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            with _nested_jit_interpreted():
                self.fn[grid](*args, **kwargs)

        return launch


def kernel(fn: Callable, interpret: bool) -> Any:
    """The launchable form of the Triton kernel ``fn``, compiled (``triton.jit``) or interpreted."""
    key = (fn, interpret)
    wrapped = _wrapped.get(key)
    if wrapped is None:
        if interpret:
            wrapped = _InterpretedKernel(fn)
        else:
            wrapped = triton.jit(fn)
        _wrapped[key] = wrapped
    return wrapped


_SM_COUNT: dict[int, int] = {}  # CUDA device index -> multiprocessors


def sm_count(device: Any) -> int:
    """Multiprocessors of the CUDA ``device`` (a ``torch.device``), read once per device and cached."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch arithmetic (``triton.cdiv`` is a jit function: ~7 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), in plain Python like :func:`cdiv`."""
    return 1 << max(n - 1, 0).bit_length()


def tl_dtype(acc_float64: bool) -> Any:
    """The Triton accumulator dtype: float64 for float64 inputs, float32 otherwise."""
    return tl.float64 if acc_float64 else tl.float32
