"""The ``reference`` backend: pure torch (fused ATen ops), every device, the definition of correctness."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.batch_norm import (
    batch_norm_backward_cpu,
    batch_norm_backward_elemt_reference,
    batch_norm_backward_reduce_reference,
    batch_norm_elemt_reference,
    batch_norm_stats_reference,
)
from lightning_ext.kernels.moments import accumulate_moments_reference
from lightning_ext.kernels.unscale import unscale_and_check_reference

__all__ = ["ReferenceBackend"]


class ReferenceBackend(KernelBackend):
    """Every op as ATen's fused building blocks; runs on any device torch supports.

    Example::

        >>> import torch
        >>> backend = ReferenceBackend()
        >>> count, mean, m2 = backend.batch_norm_stats(torch.tensor([[1.0], [3.0]]))
        >>> count.tolist(), mean.tolist(), m2.tolist()
        ([2.0], [2.0], [2.0])
    """

    name: ClassVar[str] = "reference"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps", "xpu", "meta")

    _batch_norm_stats = staticmethod(batch_norm_stats_reference)
    _batch_norm_elemt = staticmethod(batch_norm_elemt_reference)
    _batch_norm_backward_reduce = staticmethod(batch_norm_backward_reduce_reference)
    _batch_norm_backward_elemt = staticmethod(batch_norm_backward_elemt_reference)
    _unscale_and_check_ = staticmethod(unscale_and_check_reference)
    _accumulate_moments_ = staticmethod(accumulate_moments_reference)

    @override
    def supports(self, device_type: str) -> bool:
        return True

    @override
    def _batch_norm_backward(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        count: Tensor,
        sum_over_group: Callable[[Tensor], Tensor] | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Eager CPU, float16/bfloat16: ATen's fused local backward + a global correction (no
        # upcast copies). float32: reduce + elemt is faster (ATen's fused float32 backward is not).
        if (
            x.device.type == "cpu"
            and x.dtype in (torch.float16, torch.bfloat16)
            and x.numel() > 0
            and not torch.compiler.is_compiling()
        ):
            return batch_norm_backward_cpu(dy, x, mean, invstd, weight, count, sum_over_group)
        return super()._batch_norm_backward(dy, x, mean, invstd, weight, count, sum_over_group)
