"""``torch.library`` custom ops (namespace ``lightning_ext``) so ``torch.compile`` traces every kernel op.

Eager calls go straight to the backend; while ``torch.compile`` traces,
:meth:`~lightning_ext.kernels.KernelBackend._call` calls these ops instead, which appear in the graph
as single nodes whose fake (meta) implementations give output shapes, dtypes and strides. The last
argument, ``backend``, is the key of the backend instance that runs the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_ext.kernels.backend import _LIVE, KernelBackend, stat_dtype

__all__ = [
    "accumulate_moments_",
    "batch_norm_backward_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_elemt",
    "batch_norm_gather_stats",
    "batch_norm_moments",
    "check_finite",
    "unscale_and_check_",
]


def _backend(key: str, device: torch.device) -> KernelBackend:
    backend = _LIVE.get(key)
    if backend is None:  # e.g. a graph deserialized in a fresh process
        from lightning_ext.kernels.registry import get_backend

        backend = get_backend(key, device)
    return backend


@torch.library.custom_op("lightning_ext::batch_norm_moments", mutates_args=())
def batch_norm_moments(x: Tensor, shift: Tensor, backend: str) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.batch_norm_moments`."""
    return _backend(backend, x.device)._batch_norm_moments(x, shift)


@batch_norm_moments.register_fake
def _(x, shift, backend):
    return x.new_empty((2 * x.shape[1] + 1,), dtype=torch.float64)


@torch.library.custom_op(
    "lightning_ext::batch_norm_gather_stats", mutates_args=("running_mean", "running_var")
)
def batch_norm_gather_stats(
    payload: Tensor,
    shift: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: Tensor,
    eps: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """Custom-op form of :meth:`KernelBackend.batch_norm_gather_stats` (mutates the running buffers)."""
    be = _backend(backend, payload.device)
    mean, invstd = be._batch_norm_gather_stats(payload, shift, running_mean, running_var, momentum, eps)
    return mean.clone(), invstd.clone()


@batch_norm_gather_stats.register_fake
def _(payload, shift, running_mean, running_var, momentum, eps, backend):
    return torch.empty_like(shift), torch.empty_like(shift)


@torch.library.custom_op("lightning_ext::batch_norm_elemt", mutates_args=())
def batch_norm_elemt(
    x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None, backend: str
) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.batch_norm_elemt`."""
    return _backend(backend, x.device)._batch_norm_elemt(x, mean, invstd, weight, bias)


@batch_norm_elemt.register_fake
def _(x, mean, invstd, weight, bias, backend):
    return torch.empty_like(x)


@torch.library.custom_op("lightning_ext::batch_norm_backward_reduce", mutates_args=())
def batch_norm_backward_reduce(dy: Tensor, x: Tensor, mean: Tensor, backend: str) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.batch_norm_backward_reduce`."""
    return _backend(backend, x.device)._batch_norm_backward_reduce(dy, x, mean)


@batch_norm_backward_reduce.register_fake
def _(dy, x, mean, backend):
    return x.new_empty((2 * x.shape[1],), dtype=stat_dtype(x))


@torch.library.custom_op("lightning_ext::batch_norm_backward_elemt", mutates_args=())
def batch_norm_backward_elemt(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    sums: Tensor,
    count: Tensor,
    backend: str,
) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.batch_norm_backward_elemt`."""
    return _backend(backend, x.device)._batch_norm_backward_elemt(dy, x, mean, invstd, weight, sums, count)


@batch_norm_backward_elemt.register_fake
def _(dy, x, mean, invstd, weight, sums, count, backend):
    return torch.empty_like(x)


@torch.library.custom_op("lightning_ext::unscale_and_check_", mutates_args=("tensors",))
def unscale_and_check_(tensors: list[Tensor], inv_scale: Tensor, backend: str) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.unscale_and_check_` (mutates ``tensors``)."""
    return _backend(backend, inv_scale.device)._unscale_and_check_(tensors, inv_scale).clone()


@unscale_and_check_.register_fake
def _(tensors, inv_scale, backend):
    return inv_scale.new_empty((), dtype=torch.float32)


@torch.library.custom_op("lightning_ext::check_finite", mutates_args=())
def check_finite(tensors: list[Tensor], device: torch.device, backend: str) -> Tensor:
    """Custom-op form of :meth:`KernelBackend.check_finite`."""
    return _backend(backend, device)._check_finite(tensors, device).clone()


@check_finite.register_fake
def _(tensors, device, backend):
    return torch.empty((), dtype=torch.float32, device=device)


@torch.library.custom_op("lightning_ext::accumulate_moments_", mutates_args=("acc",))
def accumulate_moments_(acc: Tensor, x: Tensor, shift: Tensor, backend: str) -> None:
    """Custom-op form of :meth:`KernelBackend.accumulate_moments_` (mutates ``acc``)."""
    if x.numel():
        _backend(backend, x.device)._accumulate_moments_(acc, x, shift)


@accumulate_moments_.register_fake
def _(acc, x, shift, backend):
    return None
