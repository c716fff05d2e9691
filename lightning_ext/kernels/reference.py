"""The ``reference`` backend: pure torch (fused ATen ops), every device, the definition of correctness."""

from __future__ import annotations

from typing import ClassVar

from typing_extensions import override

from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.batch_norm import (
    batch_norm_backward_elemt_reference,
    batch_norm_backward_reduce_reference,
    batch_norm_elemt_reference,
    batch_norm_gather_stats_reference,
    batch_norm_moments_reference,
)
from lightning_ext.kernels.moments import accumulate_moments_reference
from lightning_ext.kernels.unscale import check_finite_reference, unscale_and_check_reference

__all__ = ["ReferenceBackend"]


class ReferenceBackend(KernelBackend):
    """Every op as ATen's fused building blocks; runs on any device torch supports.

    Example::

        >>> import torch
        >>> backend = ReferenceBackend()
        >>> backend.batch_norm_moments(torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "reference"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps", "xpu", "meta")

    _batch_norm_moments = staticmethod(batch_norm_moments_reference)
    _batch_norm_gather_stats = staticmethod(batch_norm_gather_stats_reference)
    _batch_norm_elemt = staticmethod(batch_norm_elemt_reference)
    _batch_norm_backward_reduce = staticmethod(batch_norm_backward_reduce_reference)
    _batch_norm_backward_elemt = staticmethod(batch_norm_backward_elemt_reference)
    _unscale_and_check_ = staticmethod(unscale_and_check_reference)
    _check_finite = staticmethod(check_finite_reference)
    _accumulate_moments_ = staticmethod(accumulate_moments_reference)

    @override
    def supports(self, device_type: str) -> bool:
        return True
