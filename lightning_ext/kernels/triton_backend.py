"""The ``triton`` backend: Triton kernels for CUDA; on CPU, the same kernels in Triton's interpreter."""

from __future__ import annotations

import os
from functools import partial
from typing import ClassVar

import torch
from typing_extensions import override

from lightning_ext.kernels._triton import HAS_TRITON
from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.batch_norm import (
    batch_norm_backward_elemt_triton,
    batch_norm_backward_reduce_triton,
    batch_norm_elemt_triton,
    batch_norm_stats_triton,
)
from lightning_ext.kernels.moments import accumulate_moments_triton
from lightning_ext.kernels.unscale import check_finite_triton, unscale_and_check_triton

__all__ = ["TritonBackend"]


class TritonBackend(KernelBackend):
    """Every op as a Triton kernel (fp32 accumulators, any memory format by strides, any C).

    Args:
        interpret: run the kernels in Triton's interpreter on CPU tensors (slow; for tests and
            debugging; needs Triton >= 3.9, whose interpreter accepts loop bounds derived from
            ``tl.program_id``: 3.6's does not). ``False`` compiles them for CUDA on first launch.
            ``None`` (default, the registry's choice) means ``True`` exactly when the environment
            sets ``TRITON_INTERPRET=1``. The registry still lists ``triton`` for CUDA only, so
            automatic selection on CPU never picks the interpreter.

    Raises:
        RuntimeError: Triton is not installed, or ``interpret=False`` and CUDA is not available.

    Example::

        >>> import torch
        >>> backend = TritonBackend(interpret=True)
        >>> backend.batch_norm_stats(torch.tensor([[1.0], [3.0]]))[2]
        tensor([2.])
    """

    name: ClassVar[str] = "triton"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)

    def __init__(self, interpret: bool | None = None) -> None:
        if interpret is None:
            interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if not HAS_TRITON:
            raise RuntimeError(
                "the 'triton' kernel backend needs Triton: pip install 'lightning-ext[triton]'"
            )
        if not interpret and not torch.cuda.is_available():
            raise RuntimeError(
                "the 'triton' kernel backend needs a CUDA device (torch.cuda.is_available() is False). "
                "HINT: TritonBackend(interpret=True) runs the kernels on CPU in Triton's interpreter."
            )
        self.interpret = bool(interpret)
        self._batch_norm_stats = partial(batch_norm_stats_triton, interpret=self.interpret)
        self._batch_norm_elemt = partial(batch_norm_elemt_triton, interpret=self.interpret)
        self._batch_norm_backward_reduce = partial(
            batch_norm_backward_reduce_triton, interpret=self.interpret
        )
        self._batch_norm_backward_elemt = partial(batch_norm_backward_elemt_triton, interpret=self.interpret)
        self._unscale_and_check_ = partial(unscale_and_check_triton, interpret=self.interpret)
        self._accumulate_moments_ = partial(accumulate_moments_triton, interpret=self.interpret)
        super().__init__()

    @property
    @override
    def key(self) -> str:
        return "triton-interpret" if self.interpret else "triton"

    @override
    def supports(self, device_type: str) -> bool:
        return device_type == "cpu" if self.interpret else device_type == "cuda"

    @override
    def _check_finite(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        return check_finite_triton(tensors, device, interpret=self.interpret)

    @override
    def __repr__(self) -> str:
        return f"TritonBackend(interpret={self.interpret})"

    # Implementations are bound per instance in __init__ (compiled or interpreted kernels).
    _batch_norm_stats = None  # type: ignore[assignment]
    _batch_norm_elemt = None  # type: ignore[assignment]
    _batch_norm_backward_reduce = None  # type: ignore[assignment]
    _batch_norm_backward_elemt = None  # type: ignore[assignment]
    _unscale_and_check_ = None  # type: ignore[assignment]
    _accumulate_moments_ = None  # type: ignore[assignment]
