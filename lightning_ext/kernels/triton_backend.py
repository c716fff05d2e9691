"""The ``triton`` backend: Triton kernels for CUDA (on CPU tensors, Triton's interpreter)."""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from typing_extensions import override

from lightning_ext.kernels import batch_norm, histogram, moments, unscale
from lightning_ext.kernels._triton import HAS_TRITON
from lightning_ext.kernels.backend import _bind_ops
from lightning_ext.kernels.reference import ReferenceBackend

__all__ = ["TritonBackend"]


def _interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1``: the kernels then run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@_bind_ops("triton", batch_norm, histogram, moments, unscale)
class TritonBackend(ReferenceBackend):
    """Every op as a Triton kernel (the ``*_triton`` functions of the op files: fp32 accumulators, any
    memory format by strides, any C), except ``batch_norm_gather_stats``: the reference's torch ops.

    Under ``TRITON_INTERPRET=1`` (set before ``import triton``) the kernels run on CPU tensors in
    Triton's interpreter, for tests; automatic selection never picks the interpreter (the registry
    lists ``triton`` for CUDA only).

    Raises:
        RuntimeError: Triton is not installed, or CUDA is not available outside the interpreter.

    Example::

        >>> import torch
        >>> backend = TritonBackend()  # doctest: +SKIP
        >>> backend.batch_norm_moments(torch.tensor([[1.0], [3.0]]), torch.zeros(1))  # doctest: +SKIP
        tensor([ 2.,  4., 10.], dtype=torch.float64)
    """

    name: ClassVar[str] = "triton"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)

    def __init__(self) -> None:
        if not HAS_TRITON:
            raise RuntimeError(
                "the 'triton' kernel backend needs Triton: pip install 'lightning-ext[triton]'"
            )
        if not _interpreting() and not torch.cuda.is_available():
            raise RuntimeError(
                "the 'triton' kernel backend needs a CUDA device (torch.cuda.is_available() is False). "
                "HINT: TRITON_INTERPRET=1, set before triton is imported, runs its kernels on CPU tensors."
            )
        super().__init__()

    @override
    def supports(self, device_type: str) -> bool:
        return device_type == "cuda" or (device_type == "cpu" and _interpreting())
