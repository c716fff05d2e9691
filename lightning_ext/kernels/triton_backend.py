"""The ``triton`` backend: Triton kernels for CUDA (on CPU tensors, Triton's interpreter)."""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from typing_extensions import override

from lightning_ext.kernels._triton import HAS_TRITON
from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.batch_norm import (
    batch_norm_backward_elemt_triton,
    batch_norm_backward_reduce_triton,
    batch_norm_elemt_triton,
    batch_norm_gather_stats_reference,
    batch_norm_moments_triton,
)
from lightning_ext.kernels.moments import accumulate_moments_triton
from lightning_ext.kernels.unscale import check_finite_triton, unscale_and_check_triton

__all__ = ["TritonBackend"]


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1``: the kernels then run in Triton's interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(KernelBackend):
    """Every op as a Triton kernel (fp32 accumulators, any memory format by strides, any C).

    Under ``TRITON_INTERPRET=1`` (set before ``import triton``) the kernels run on CPU tensors in
    Triton's interpreter, for tests and debugging; the registry still lists ``triton`` for CUDA only,
    so automatic selection never picks the interpreter.

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
        if not interpreting() and not torch.cuda.is_available():
            raise RuntimeError(
                "the 'triton' kernel backend needs a CUDA device (torch.cuda.is_available() is False). "
                "HINT: TRITON_INTERPRET=1, set before triton is imported, runs its kernels on CPU tensors."
            )
        super().__init__()

    @override
    def supports(self, device_type: str) -> bool:
        return device_type == "cuda" or (device_type == "cpu" and interpreting())

    _batch_norm_moments = staticmethod(batch_norm_moments_triton)
    _batch_norm_gather_stats = staticmethod(batch_norm_gather_stats_reference)  # per-channel torch ops
    _batch_norm_elemt = staticmethod(batch_norm_elemt_triton)
    _batch_norm_backward_reduce = staticmethod(batch_norm_backward_reduce_triton)
    _batch_norm_backward_elemt = staticmethod(batch_norm_backward_elemt_triton)
    _unscale_and_check_ = staticmethod(unscale_and_check_triton)
    _check_finite = staticmethod(check_finite_triton)
    _accumulate_moments_ = staticmethod(accumulate_moments_triton)
