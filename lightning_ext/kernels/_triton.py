"""Triton plumbing shared by the op files: the optional import and launch arithmetic.

Kernels are plain ``@triton.jit`` functions. On CPU tensors they run in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects when it is set before ``import triton`` (the test suite does so when no
GPU is present).
"""

from __future__ import annotations

from typing import Any

try:  # Triton is an optional dependency (extra `triton`)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "cdiv", "next_power_of_2", "sm_count", "tl", "tl_dtype", "triton"]

HAS_TRITON = triton is not None  # whether `import triton` works in this environment
_SM_COUNT: dict[int, int] = {}  # CUDA device index -> multiprocessors


def sm_count(device: Any) -> int:
    """Multiprocessors of the CUDA ``device`` (a ``torch.device``), read once per device and cached."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch arithmetic on the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def tl_dtype(acc_float64: bool) -> Any:
    """The Triton accumulator dtype: float64 for float64 inputs, float32 otherwise."""
    return tl.float64 if acc_float64 else tl.float32
