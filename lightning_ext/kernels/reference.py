"""The ``reference`` backend: pure torch (fused ATen ops), every device, the definition of correctness."""

from __future__ import annotations

from typing import ClassVar

from typing_extensions import override

from lightning_ext.kernels import batch_norm, histogram, moments, unscale
from lightning_ext.kernels.backend import KernelBackend, _bind_ops

__all__ = ["ReferenceBackend"]


@_bind_ops("reference", batch_norm, histogram, moments, unscale)
class ReferenceBackend(KernelBackend):
    """Every op as ATen's fused building blocks (the ``*_reference`` functions of the op files); runs
    on any device torch supports.

    Example::

        >>> import torch
        >>> backend = ReferenceBackend()
        >>> backend.batch_norm_moments(torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "reference"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps", "xpu", "meta")

    @override
    def supports(self, device_type: str) -> bool:
        return True
