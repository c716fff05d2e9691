"""Kernel backends: the fused ops behind SyncBatchNorm, loss scaling and ``report()``.

A :class:`KernelBackend` provides six ops (see its docstrings for dtypes, shapes and sync behaviour):
``batch_norm_stats``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
``batch_norm_backward_elemt``, ``unscale_and_check_`` and ``accumulate_moments_``. Backends:

- ``reference`` — fused ATen ops, every device, the definition of correctness (priority 0);
- ``triton`` — Triton kernels for CUDA (priority 10); on CPU,
  ``TritonBackend(interpret=True)`` runs the same kernels in Triton's interpreter (tests);
- ``cuda`` — reserved for a C++/CUDA extension (see "Adding a kernel backend").

On eager CPU input, :class:`~lightning_ext.nn.SyncBatchNorm` runs the ``reference`` maths as
compiled kernels (:mod:`lightning_ext.kernels.cpu_extension`, C++ built just in time by torch: one
pass over the data per step of the algorithm; agrees to rounding with the pure-torch path it falls
back to).

Pick one with :func:`get_backend`: explicit ``name`` > ``LIGHTNING_EXT_KERNELS`` > automatic
(highest priority that supports the device and loads; on failure, ``reference`` with one warning).
Every op is also a ``torch.library`` custom op (``torch.ops.lightning_ext.*``), so ``torch.compile``
traces calls without graph breaks.

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
   and implement the six private methods ``_batch_norm_stats``, ``_batch_norm_elemt``,
   ``_batch_norm_backward_reduce``, ``_batch_norm_backward_elemt``, ``_unscale_and_check_`` and
   ``_accumulate_moments_`` with the public methods' signatures. Arguments arrive validated; autograd,
   ``torch.compile`` and input checks come from the base class. Put each op family's kernels and
   launchers in its file (``batch_norm.py``, ``unscale.py``, ``moments.py``), as ``triton`` does.
2. Register a factory that builds it lazily and raises if the hardware or a dependency is missing:
   ``register_backend("cuda", CudaBackend, devices=("cuda",), priority=20)``. The built-in ``cuda``
   slot is this call in ``registry.py``, with a factory that loads the C++/CUDA extension
   (``torch.utils.cpp_extension.load``). From another package, use the entry-point group instead::

       # pyproject.toml of the plugin package
       [project.entry-points."lightning_ext.kernels"]
       my_backend = "my_pkg.kernels:MyBackend"   # a KernelBackend subclass, or a function that registers

3. Test it against ``reference`` with the parametrized tables of ``tests/kernels`` (every op, odd and
   empty sizes, every memory format, low-precision error at most 2x the reference's), then select it
   with ``get_backend("my_backend")`` or ``LIGHTNING_EXT_KERNELS=my_backend``.
"""

from lightning_ext.kernels import ops as _ops  # noqa: F401  (registers torch.ops.lightning_ext.*)
from lightning_ext.kernels.backend import KernelBackend
from lightning_ext.kernels.reference import ReferenceBackend
from lightning_ext.kernels.registry import (
    ENTRY_POINT_GROUP,
    ENV_VAR,
    BackendEntry,
    available_backends,
    get_backend,
    register_backend,
)
from lightning_ext.kernels.triton_backend import TritonBackend

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "BackendEntry",
    "KernelBackend",
    "ReferenceBackend",
    "TritonBackend",
    "available_backends",
    "get_backend",
    "register_backend",
]
