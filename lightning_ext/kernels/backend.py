"""An op and a backend: :class:`KernelOp`, the one registration of an op, and :class:`KernelBackend`,
which runs every op on the devices it serves.

An op is defined once, by :func:`define_op` in its op family module (``batch_norm``, ``moments``,
``histogram``, ``unscale``): its ``torch.library`` schema, its fake (the outputs' shapes, dtypes and
strides for ``torch.compile``), its reference implementation in pure torch (whose docstring is the
op's contract), its argument check, and the implementations of other backends by backend name. Every
caller runs it one way, ``backend.run("<op>", *args)``. No op is differentiable and no op
synchronizes host and device.

Tensors of the batch-norm ops: ``x``/``dy`` of shape ``(N, C, *)`` in any memory format, per-channel
vectors ``(C,)`` on ``x``'s device; element arithmetic is float32 (float64 for float64 input), sums
over many elements are accumulated in float64 or in float32 blocks added in float64.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["OPS", "KernelBackend", "KernelOp", "ReferenceBackend", "define_op"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # allowed dtypes of x / dy
OPS: dict[str, KernelOp] = {}  # op name -> its registration (by define_op; kept, as torch's custom ops)
_LIVE: dict[str, KernelBackend] = {}  # backend name -> live instance: how the custom ops find theirs


@dataclass(frozen=True)
class KernelOp:
    """One op, as :func:`define_op` registers it.

    Attributes:
        name: the op's name, e.g. ``"batch_norm_moments"`` (``torch.ops.lightning_ext.<name>``).
        impls: implementation by backend name; ``"reference"`` always present.
        check: raises ``TypeError``/``ValueError`` naming the argument, the value and what is allowed
            for arguments the op does not take (``backend.run(..., check=True)``).
    """

    name: str
    impls: dict[str, Callable[..., Any]]
    check: Callable[..., None] = field(repr=False)


def define_op(
    schema: str,
    reference: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    check: Callable[..., None],
    clone: bool = False,
    **impls: Callable[..., Any],
) -> KernelOp:
    """Register an op: the custom op ``torch.ops.lightning_ext.<name>`` and its implementations.

    Args:
        schema: ``"<name>(<args>) -> <returns>"`` in ``torch.library`` syntax; arguments it writes carry
            an alias annotation, e.g. ``Tensor(a0!) acc`` (they become the op's ``mutates_args``).
        reference: the pure-torch implementation, any device: the definition of correctness.
        fake: the fake implementation (the op's arguments; outputs with the real ones' metadata).
        check: the argument check (see :class:`KernelOp`).
        clone: the custom op returns copies (a kernel's outputs may alias each other or its state).
        impls: the implementation of other backends by backend name, e.g. ``triton=...``.

    Returns:
        The :class:`KernelOp`, also in :data:`OPS` under its name.

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
        if backend is None:  # e.g. a graph deserialized in a fresh process
            from lightning_ext.kernels.registry import get_backend

            where = next(a for a in args if isinstance(a, Tensor | torch.device))
            backend = get_backend(key, where if isinstance(where, torch.device) else where.device)
        out = backend._kernels[name](*args)
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
        name: registry name, e.g. ``"reference"``, ``"cpu"``, ``"triton"``.
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
        self._kernels = _Kernels(self)
        _LIVE[self.name] = self

    def kernel(self, op: str) -> Callable[..., Any]:
        """The function that runs ``op`` eagerly (looked up once per op); a backend overrides it to
        bring kernels of its own."""
        impls = OPS[op].impls
        name = next((c.name for c in type(self).__mro__ if getattr(c, "name", None) in impls), "reference")
        return impls[name]

    def supports(self, device_type: str) -> bool:
        """Whether this backend can run on tensors of ``device_type`` (e.g. ``"cuda"``)."""
        return device_type in self.devices

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, devices={self.devices!r})"

    def run(self, op: str, *args: Any, check: bool = False) -> Any:
        """Run the op named ``op`` (e.g. ``"batch_norm_elemt"``) on ``args``, as its reference
        implementation documents them (:mod:`lightning_ext.kernels.ops` lists the ops).

        Arguments are taken as valid (callers whose arguments are valid by construction pay nothing);
        ``check=True`` checks them first. Eager calls run the backend's kernel; under ``torch.compile``
        the op's custom op ``torch.ops.lightning_ext.<op>`` (one graph node).

        Raises:
            TypeError, ValueError: with ``check=True``, an argument the op does not take (the message
                names it, the value received and what is allowed).
        """
        if check:
            OPS[op].check(*args)
        if torch.compiler.is_compiling():
            return getattr(torch.ops.lightning_ext, op)(*args, self.name)
        return self._kernels[op](*args)


class _Kernels(dict):
    """A backend's kernels by op name, each looked up on first use (also for ops defined later)."""

    def __init__(self, backend: KernelBackend) -> None:
        super().__init__()
        self.backend = backend

    def __missing__(self, op: str) -> Callable[..., Any]:
        self[op] = self.backend.kernel(op)
        return self[op]


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
        return True


# ---------------------------------------------------------------------------- argument checks


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of per-channel sums for input ``x``: float64 for float64 input, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _got(t: object) -> object:
    """What an error message reports for a tensor argument: its dtype, else its type's name."""
    return t.dtype if isinstance(t, Tensor) else type(t).__name__


def _check_x(x: object, arg: str = "x", like: Tensor | None = None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"`{arg}` must be a torch.Tensor of shape (N, C, *), got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"`{arg}` must have shape (N, C, *) with at least 2 dims, got {tuple(x.shape)!r}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"`{arg}` must be float16, bfloat16, float32 or float64, got dtype {x.dtype!r}")
    if like is not None and (x.shape != like.shape or x.device != like.device):
        raise ValueError(
            f"`{arg}` must have the shape and device of `x` {tuple(like.shape)!r} on {like.device}, "
            f"got {tuple(x.shape)!r} on {x.device}"
        )


def _check_vector(t: object, arg: str, size: int, device: torch.device, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor) or t.dtype not in (torch.float32, torch.float64):
        allowed = " or None" if optional else ""
        raise TypeError(
            f"`{arg}` must be a float32/float64 tensor of shape ({size},){allowed}, got {_got(t)!r}"
        )
    if tuple(t.shape) != (size,) or t.device != device:
        raise ValueError(
            f"`{arg}` must have shape ({size},) on {device}, got {tuple(t.shape)!r} on {t.device}"
        )


def _check_float64(t: object, arg: str, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.float64:
        raise TypeError(f"`{arg}` must be a float64 tensor of shape {shape}, got {_got(t)!r}")
    if tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"`{arg}` must be a contiguous tensor of shape {shape} on {device}, "
            f"got shape {tuple(t.shape)} on {t.device}"
        )


def _check_real(x: object) -> None:
    if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"`x` must be a real (float or integer) tensor, got {_got(x)!r}")


def _check_float_tensors(tensors: object) -> None:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"`tensors` must be a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"`tensors[{i}]` must be a floating point tensor, got {_got(t)!r}")
