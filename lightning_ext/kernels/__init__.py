"""Kernel backends: the fused ops behind SyncBatchNorm, loss scaling and ``report()``.

A :class:`KernelBackend` provides seven ops (see its docstrings for dtypes, shapes and contracts):
``batch_norm_moments``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
``batch_norm_backward_elemt``, ``unscale_and_check_``, ``check_finite`` and ``accumulate_moments_``.
Callers use only these public methods. Backends:

- ``reference`` — fused ATen ops, every device, the definition of correctness (priority 0);
- ``cpu`` — compiled C++ kernels for CPU tensors, one vectorized pass per op, built just in time on
  first use (:mod:`lightning_ext.kernels.cpu`; priority 5);
- ``triton`` — Triton kernels for CUDA (priority 10); under ``TRITON_INTERPRET=1`` the same kernels
  run on CPU tensors in Triton's interpreter (tests).

Pick one with :func:`get_backend`: explicit ``name`` > ``LIGHTNING_EXT_KERNELS`` > automatic
(highest priority that supports the device and loads; on failure, ``reference`` with one warning).
Every op is also a ``torch.library`` custom op (``torch.ops.lightning_ext.*``), so ``torch.compile``
traces calls without graph breaks. No op synchronizes host and device.

Example::

    >>> import torch
    >>> from lightning_ext.kernels import get_backend
    >>> backend = get_backend("reference", device="cpu")
    >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    >>> backend.unscale_and_check_(grads, torch.tensor(0.5))
    tensor(1.)
    >>> grads[0]
    tensor([1., 2.])

Adding a kernel backend
-----------------------

1. Subclass :class:`KernelBackend`; set ``name`` and ``devices`` (device types, e.g. ``("cuda",)``)
   and implement the seven private methods ``_batch_norm_moments``, ``_batch_norm_elemt``,
   ``_batch_norm_backward_reduce``, ``_batch_norm_backward_elemt``, ``_unscale_and_check_``,
   ``_check_finite`` and ``_accumulate_moments_`` with the public methods' signatures (arguments
   arrive validated; ``torch.compile`` support comes from the base class). Subclassing
   :class:`ReferenceBackend` instead keeps its ops for what you do not override, as ``cpu`` does.
2. Register a factory that builds it lazily and raises when the hardware or a dependency is missing:
   ``register_backend("cuda", CudaBackend, devices=("cuda",), priority=20)``. From another package,
   use the entry-point group instead::

       # pyproject.toml of the plugin package
       [project.entry-points."lightning_ext.kernels"]
       my_backend = "my_pkg.kernels:MyBackend"   # a KernelBackend subclass, or a function that registers

3. Test it against ``reference`` with the parametrized tables of ``tests/kernels`` (every op, odd and
   empty sizes, every memory format), then select it with ``get_backend("my_backend")`` or
   ``LIGHTNING_EXT_KERNELS=my_backend``.
"""

from lightning_ext.kernels import ops as _ops  # noqa: F401  (registers torch.ops.lightning_ext.*)
from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.cpu import CpuBackend
from lightning_ext.kernels.reference import ReferenceBackend
from lightning_ext.kernels.registry import (
    ENTRY_POINT_GROUP,
    ENV_VAR,
    BackendEntry,
    available_backends,
    get_backend,
    register_backend,
    reset,
)
from lightning_ext.kernels.triton_backend import TritonBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "BackendEntry",
    "CpuBackend",
    "KernelBackend",
    "ReferenceBackend",
    "TritonBackend",
    "available_backends",
    "get_backend",
    "register_backend",
    "reset",
]
