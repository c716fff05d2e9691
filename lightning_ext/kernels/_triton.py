"""The ``triton`` backend, the optional Triton import the op family modules share, and the
multiprocessor count and grid-stride grid launches size by.

Kernels are plain ``@triton.jit`` functions. On CPU tensors they run in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects when it is set before ``import triton``.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from lightning_ext.kernels.backend import ReferenceBackend

try:  # Triton is an optional dependency (extra `triton`)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "TritonBackend", "forget_sm_counts", "grid_stride", "sm_count", "tl", "triton"]

HAS_TRITON = triton is not None  # whether `import triton` works in this environment
_SM_COUNT: dict[int, int] = {}  # CUDA device index -> multiprocessors


def sm_count(device: Any) -> int:
    """Multiprocessors of the CUDA ``device`` (a ``torch.device``), read once per device and cached."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def forget_sm_counts() -> None:
    """Empty the cache of :func:`sm_count` (:func:`~lightning_ext.kernels.clear_backend_cache`)."""
    _SM_COUNT.clear()


def grid_stride(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(x', BLOCK, blocks, programs)`` of one grid-stride launch over the elements of ``x``: ``x'``
    flat and contiguous (a copy where ``x`` is strided), at most 4 programs per multiprocessor; in
    Triton's interpreter (CPU tensors) 3 programs of large blocks."""
    x = x.reshape(-1).contiguous()  # the kernels read stride 1; reshape may give a strided view
    block = 4096 if x.is_cpu else 1024
    blocks = triton.cdiv(x.numel(), block)
    return x, block, blocks, min(blocks, 3 if x.is_cpu else 4 * sm_count(x.device))


def _interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1``: the kernels then run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(ReferenceBackend):
    """Every op as a Triton kernel (fp32 accumulators, any memory format by strides, any C), but the
    flush's and ``batch_norm_gather_stats``: their reference torch ops.

    Under ``TRITON_INTERPRET=1`` (set before ``import triton``) the kernels run on CPU tensors in
    Triton's interpreter, for tests; automatic selection never picks the interpreter (the registry
    lists ``triton`` for CUDA only).

    Raises:
        RuntimeError: Triton is not installed, or CUDA is not available outside the interpreter.
    """

    name: ClassVar[str] = "triton"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)

    def __init__(self) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the 'triton' kernel backend needs Triton: install lightning-ext[triton]")
        if not _interpreting() and not torch.cuda.is_available():
            raise RuntimeError(
                "the 'triton' kernel backend needs a CUDA device (torch.cuda.is_available() is False). "
                "HINT: TRITON_INTERPRET=1, set before triton is imported, runs its kernels on CPU tensors."
            )
        super().__init__()

    def supports(self, device_type: str) -> bool:
        return device_type == "cuda" or (device_type == "cpu" and _interpreting())
