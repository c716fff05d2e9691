"""The optional Triton import shared by the op files, and the multiprocessor count launches size by.

Kernels are plain ``@triton.jit`` functions. On CPU tensors they run in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects when it is set before ``import triton``.
"""

from __future__ import annotations

from typing import Any

try:  # Triton is an optional dependency (extra `triton`)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "sm_count", "tl", "triton"]

HAS_TRITON = triton is not None  # whether `import triton` works in this environment
_SM_COUNT: dict[int, int] = {}  # CUDA device index -> multiprocessors


def sm_count(device: Any) -> int:
    """Multiprocessors of the CUDA ``device`` (a ``torch.device``), read once per device and cached."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
