"""Kernel backends: the fused ops behind SyncBatchNorm, loss scaling and ``report()``.

Callers run an op on the backend :func:`get_backend` selects, one way:
``backend.run("<op>", *args)`` (:mod:`~lightning_ext.kernels.ops` lists the ops; each op's reference
implementation documents its arguments). Every op is also a ``torch.library`` custom op, so
``torch.compile`` traces calls without graph breaks. Built-in backends:

- ``reference`` — fused ATen ops, every device, the definition of correctness (priority 0);
- ``cpu`` — compiled C++ kernels for CPU tensors, one vectorized pass per op (priority 5);
- ``triton`` — Triton kernels for CUDA (priority 10); under ``TRITON_INTERPRET=1`` they run on CPU
  tensors in Triton's interpreter (tests).

Example::

    >>> import torch
    >>> from lightning_ext.kernels import get_backend
    >>> backend = get_backend("reference", device="cpu")
    >>> grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    >>> backend.run("unscale_and_check_", grads, torch.tensor(0.5))
    tensor(1.)
    >>> grads[0]
    tensor([1., 2.])

Adding a kernel backend
-----------------------

1. Subclass :class:`ReferenceBackend` (its ops are the reference ones), set ``name`` and ``devices``
   (device types, e.g. ``("cuda",)``) and override :meth:`KernelBackend.kernel` to return your
   function for the ops you implement (``super().kernel(op)`` for the others). ``torch.compile``
   support comes from the base class (``supports_compile = False`` opts out).
2. Register a factory that builds it lazily and raises when the hardware or a dependency is missing,
   ``register_backend("cuda", CudaBackend, devices=("cuda",), priority=20)``, or from another package
   the entry-point group::

       # pyproject.toml of the plugin package
       [project.entry-points."lightning_ext.kernels"]
       my_backend = "my_pkg.kernels:MyBackend"   # a KernelBackend subclass, or a function that registers

3. Test it against ``reference`` with the parametrized tables of ``tests/kernels`` (every op, odd and
   empty sizes, every memory format), then select it with ``get_backend("my_backend")`` or
   ``LIGHTNING_EXT_KERNELS=my_backend``.

Adding an op: ``docs/guides/adding_a_kernel_op.md``.
"""

from lightning_ext.kernels._triton import TritonBackend
from lightning_ext.kernels.backend import KernelBackend, KernelOp, ReferenceBackend, define_op
from lightning_ext.kernels.batch_norm import payload_moments
from lightning_ext.kernels.cpu import CpuBackend
from lightning_ext.kernels.moments import merge_moments, moments_from_shifted
from lightning_ext.kernels.ops import OPS
from lightning_ext.kernels.registry import (
    BACKEND_ENV_VAR,
    ENTRY_POINT_GROUP,
    BackendEntry,
    available_backends,
    clear_backend_cache,
    get_backend,
    register_backend,
)

__all__ = [
    "BACKEND_ENV_VAR", "ENTRY_POINT_GROUP", "OPS", "BackendEntry", "CpuBackend", "KernelBackend", "KernelOp",
    "ReferenceBackend", "TritonBackend", "available_backends", "clear_backend_cache", "define_op",
    "get_backend", "merge_moments", "moments_from_shifted", "payload_moments", "register_backend",
]  # fmt: skip
