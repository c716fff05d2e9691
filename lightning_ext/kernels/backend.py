"""An op and a backend: :class:`KernelOp`, the one registration of an op, and :class:`KernelBackend`,
which runs every op on the devices it serves.

An op is defined once, by :func:`~lightning_ext.kernels.define_op` in its op family module
(``batch_norm``, ``moments``, ``histogram``, ``unscale``): its ``torch.library`` schema, its fake
(the outputs' shapes, dtypes and strides for ``torch.compile``), its reference implementation in
pure torch (whose docstring is the op's contract), the implementations of other backends by backend
name and, for an op a user can reach with arguments of their own, its argument check. Every caller
runs it one way, ``backend.run("<op>", *args)``. No op is differentiable and no op synchronizes host
and device.

Tensors of the batch-norm ops: ``x``/``dy`` of shape ``(N, C, *)`` in any memory format, per-channel
vectors ``(C,)`` on ``x``'s device; element arithmetic is float32 (float64 for float64 input), sums
over many elements are accumulated in float64 or in float32 blocks added in float64.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

__all__ = ["OPS", "KernelBackend", "KernelOp", "ReferenceBackend", "define_op"]

OPS: dict[str, KernelOp] = {}  # op name -> its registration (by define_op; kept, as torch's custom ops)
# backend name -> its latest instance: how the custom ops find theirs. Kept by resets: a graph traced
# before one still runs (an instance built again replaces its entry).
_LIVE: dict[str, KernelBackend] = {}


@dataclass(frozen=True)
class KernelOp:
    """One op, as :func:`define_op` registers it.

    Attributes:
        name: the op's name, e.g. ``"batch_norm_moments"`` (``torch.ops.lightning_ext.<name>``).
        impls: implementation by backend name; ``"reference"`` always present.
        check: raises ``TypeError``/``ValueError`` naming the argument, the value and what is allowed
            for arguments the op does not take (``backend.run(..., check=True)``); ``None`` for an op
            only this package's modules call, with arguments valid by construction.
    """

    name: str
    impls: dict[str, Callable[..., Any]]
    check: Callable[..., None] | None = field(default=None, repr=False)


def define_op(
    schema: str,
    reference: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    check: Callable[..., None] | None = None,
    clone: bool = False,
    **impls: Callable[..., Any],
) -> KernelOp:
    """Register an op: the custom op ``torch.ops.lightning_ext.<name>`` and its implementations.

    Args:
        schema: ``"<name>(<args>) -> <returns>"`` in ``torch.library`` syntax; arguments it writes carry
            an alias annotation, e.g. ``Tensor(a0!) acc`` (they become the op's ``mutates_args``).
        reference: the pure-torch implementation, any device: the definition of correctness.
        fake: the fake implementation (the op's arguments; outputs with the real ones' metadata).
        check: the argument check, where a user can call the op (see :class:`KernelOp`).
        clone: the custom op returns copies (a kernel's outputs may alias each other or its state).
        impls: the implementation of other backends by backend name, e.g. ``triton=...``.

    Returns:
        The :class:`KernelOp`, also in :data:`~lightning_ext.kernels.OPS` under its name.

    Raises:
        ValueError: an op of that name is already registered.
    """
    name, _, signature = schema.partition("(")
    if name in OPS:
        raise ValueError(f"kernel op {name!r} is already registered: {OPS[name]!r}")
    mutates = re.findall(r"\(\w+!\)\S* (\w+)", signature)

    def run(*args: Any) -> Any:
        *args, key = args
        backend = _LIVE.get(key)
        if backend is None:
            raise RuntimeError(
                f"torch.ops.lightning_ext.{name} runs kernel backend {key!r}, which this process has not "
                f"built (a graph traced in another process). HINT: call lightning_ext.kernels.get_backend"
                f"({key!r}, device) before running it"
            )
        out = backend._kernel(name)(*args)
        if clone:
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        return out

    full = f"({signature.replace(') ->', ', str backend) ->')}"
    op = torch.library.custom_op(f"lightning_ext::{name}", run, mutates_args=mutates, schema=full)
    op.register_fake(lambda *args: fake(*args[:-1]))
    OPS[name] = KernelOp(name, {"reference": reference, **impls}, check)
    return OPS[name]


class KernelBackend:
    """Runs every op for tensors of some device types: the implementation registered under its
    ``name`` (or a base class's), else the reference one.

    Attributes:
        name: registry name, e.g. ``"reference"``, ``"cpu"``, ``"triton"``; the registry sets it on the
            instance it builds to the name it registered (:meth:`serve_as`).
        devices: device types (``torch.device.type``) the backend runs on, e.g. ``("cuda",)``.
        supports_compile: whether ``torch.compile`` may trace calls of the ops (as custom ops whose
            fakes give the outputs' shapes, dtypes and strides). ``False`` for a backend whose ops
            cannot run inside a ``torch.library`` op or return other strides than documented:
            ``SyncBatchNorm`` then runs its kernels eagerly under ``torch.compile`` (a graph break,
            one warning).
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ()
    supports_compile: ClassVar[bool] = True

    def __init__(self) -> None:
        self._kernels: dict[str, Callable[..., Any]] = {}  # op -> kernel(op), looked up on first use
        _LIVE.setdefault(self.name, self)  # (the registry's instance takes it over: serve_as)

    def serve_as(self, name: str) -> None:
        """Be the backend registered as ``name``: compiled graphs, whose ops name their backend, run this
        instance's kernels under that name (two registrations of one class stay apart, and a subclass
        that kept its parent's ``name`` does not take the parent's place)."""
        self.name = name  # type: ignore[misc]  # (the instance's, over the class's)
        _LIVE[name] = self

    def kernel(self, op: str) -> Callable[..., Any]:
        """The function that runs ``op`` eagerly (looked up once per op); a backend overrides it to
        bring kernels of its own."""
        impls = OPS[op].impls
        name = next((c.name for c in type(self).__mro__ if getattr(c, "name", None) in impls), "reference")
        return impls[name]

    def _kernel(self, op: str) -> Callable[..., Any]:
        """:meth:`kernel`, looked up once per op (also for an op defined after this backend)."""
        if op not in self._kernels:
            self._kernels[op] = self.kernel(op)
        return self._kernels[op]

    def supports(self, device_type: str) -> bool:
        """Whether this backend can run on tensors of ``device_type`` (e.g. ``"cuda"``)."""
        return device_type in self.devices

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, devices={self.devices!r})"

    def run(self, op: str, *args: Any, check: bool = False) -> Any:
        """Run the op named ``op`` (e.g. ``"batch_norm_elemt"``) on ``args``, as its reference
        implementation documents them (:mod:`lightning_ext.kernels.ops` lists the ops).

        Arguments are taken as valid (callers whose arguments are valid by construction pay nothing);
        ``check=True`` checks them first where the op has a check (``batch_norm_moments``, which
        :func:`~lightning_ext.nn.sync_batch_norm_stats` calls with a user's tensors). Eager calls run
        the backend's kernel; under ``torch.compile`` the op's custom op
        ``torch.ops.lightning_ext.<op>`` (one graph node).

        Raises:
            TypeError, ValueError: with ``check=True``, an argument the op does not take (the message
                names it, the value received and what is allowed).
        """
        if check and OPS[op].check is not None:
            OPS[op].check(*args)
        if torch.compiler.is_compiling():
            return getattr(torch.ops.lightning_ext, op)(*args, self.name)
        return self._kernel(op)(*args)


class ReferenceBackend(KernelBackend):
    """Every op as its reference implementation (fused ATen ops); runs on any device torch supports.

    Example::

        >>> import torch
        >>> backend = ReferenceBackend()
        >>> backend.run("batch_norm_moments", torch.tensor([[1.0], [3.0]]), torch.zeros(1)).tolist()
        [2.0, 4.0, 10.0]
    """

    name: ClassVar[str] = "reference"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "mps", "xpu", "meta")

    def supports(self, device_type: str) -> bool:
        # any device torch supports; a subclass, the devices it declares
        return type(self).devices is ReferenceBackend.devices or device_type in self.devices
