"""Kernel backends: the fused ops behind SyncBatchNorm, loss scaling and ``report()``.

Callers use the public methods of :class:`KernelBackend` (the ops and their contracts) on the backend
:func:`get_backend` selects; every op is also a ``torch.library`` custom op, so ``torch.compile``
traces calls without graph breaks. Built-in backends:

- ``reference`` — fused ATen ops, every device, the definition of correctness (priority 0);
- ``cpu`` — compiled C++ kernels for CPU tensors, one vectorized pass per op (priority 5);
- ``triton`` — Triton kernels for CUDA (priority 10); under ``TRITON_INTERPRET=1`` they run on CPU
  tensors in Triton's interpreter (tests).

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

1. Subclass :class:`KernelBackend`, set ``name`` and ``devices`` (device types, e.g. ``("cuda",)``)
   and implement ``_<op>`` for each op, i.e. each public op method of :class:`KernelBackend`, with
   that method's signature (each is abstract: instantiation names a missing one); arguments arrive
   validated, ``torch.compile`` support comes from the base class (``supports_compile = False``
   opts out: see :class:`KernelBackend`). Subclass :class:`ReferenceBackend` instead to keep its ops
   where you do not override them.
2. Register a factory that builds it lazily and raises when the hardware or a dependency is missing,
   ``register_backend("cuda", CudaBackend, devices=("cuda",), priority=20)``, or from another package
   the entry-point group::

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
    BACKEND_ENV_VAR,
    ENTRY_POINT_GROUP,
    BackendEntry,
    available_backends,
    clear_backend_cache,
    get_backend,
    register_backend,
)
from lightning_ext.kernels.triton_backend import TritonBackend

__all__ = [
    "BACKEND_ENV_VAR",
    "ENTRY_POINT_GROUP",
    "BackendEntry",
    "CpuBackend",
    "KernelBackend",
    "ReferenceBackend",
    "TritonBackend",
    "available_backends",
    "clear_backend_cache",
    "get_backend",
    "register_backend",
]
