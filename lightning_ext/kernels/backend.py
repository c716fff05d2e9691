"""The :class:`KernelBackend` interface: the six per-channel / fused ops every backend provides.

A backend subclasses :class:`KernelBackend`, sets :attr:`~KernelBackend.name` and
:attr:`~KernelBackend.devices`, and implements the private ``_op`` methods. The public methods
defined here validate their arguments once for every backend (errors name the argument, the value
and what is allowed), wire autograd where gradients flow (:func:`batch_norm_stats` and
:func:`batch_norm_elemt`), and route through the ``torch.library`` custom ops of
:mod:`lightning_ext.kernels.ops` while ``torch.compile`` traces, so compiled graphs stay whole.

Conventions shared by all ops (after ``torch.nn.SyncBatchNorm`` and Apex's ``syncbn``):

- ``x``/``dy``: float16/bfloat16/float32 (float64 accepted for gradient checks) tensor of shape
  ``(N, C, *)`` — ``N`` the batch, ``C`` the channels, ``*`` any spatial dims — in any memory format
  (contiguous, ``channels_last``, ``channels_last_3d``).
- Statistics (``count``, ``mean``, ``m2``, ``invstd``, ``sum_dy``, ``sum_dy_xmu``) are float32 of shape
  ``(C,)`` (float64 when ``x`` is float64). Accumulation is in float32 at least.
- No op synchronizes host and device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_ext.kernels.unscale import check_finite_reference

__all__ = ["KernelBackend"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # allowed dtypes of x / dy
_LIVE: dict[str, KernelBackend] = {}  # instance key -> live backend, how the custom ops find theirs


def _stat_dtype(x: Tensor) -> torch.dtype:
    """Dtype of the per-channel statistics for input ``x``: float64 for float64 input, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _memory_format(x: Tensor) -> torch.memory_format:
    """The memory format ``x`` is dense in (``contiguous_format`` when none is)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _check_x(x: object, arg: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"`{arg}` must be a torch.Tensor of shape (N, C, *), got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(
            f"`{arg}` must have shape (N, C, *) with at least 2 dims, got shape {tuple(x.shape)!r}"
        )
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"`{arg}` must be float16, bfloat16, float32 or float64, got dtype {x.dtype!r}")
    return x


def _check_channel_vector(t: object, arg: str, channels: int, device: torch.device, optional: bool) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        allowed = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"`{arg}` must be {allowed} of shape (C,)=({channels},), got {type(t).__name__}")
    if tuple(t.shape) != (channels,):
        raise ValueError(f"`{arg}` must have shape (C,)=({channels},), got shape {tuple(t.shape)!r}")
    if not t.is_floating_point():
        raise TypeError(f"`{arg}` must be a floating point tensor, got dtype {t.dtype!r}")
    if t.device != device:
        raise ValueError(f"`{arg}` must be on the device of `x` ({device}), got device {t.device}")


def _check_same_shape(dy: Tensor, x: Tensor) -> None:
    if dy.shape != x.shape:
        raise ValueError(f"`dy` must have the shape of `x` {tuple(x.shape)!r}, got shape {tuple(dy.shape)!r}")
    if dy.device != x.device:
        raise ValueError(f"`dy` must be on the device of `x` ({x.device}), got device {dy.device}")


def _check_count(count: object, channels: int, device: torch.device) -> None:
    if not isinstance(count, Tensor) or tuple(count.shape) not in ((), (channels,)):
        got = tuple(count.shape) if isinstance(count, Tensor) else type(count).__name__
        raise ValueError(f"`count` must be a tensor of shape () or (C,)=({channels},), got {got!r}")
    if count.device != device:
        raise ValueError(f"`count` must be on the device of `x` ({device}), got device {count.device}")


def _dense_like(dy: Tensor, x: Tensor) -> Tensor:
    """``dy`` dense in ``x``'s memory format (a copy only when it is not; e.g. the expanded, stride-0
    gradient of a ``.sum()``), so every backend's backward sees one layout for both tensors."""
    fmt = _memory_format(x)
    return dy if dy.is_contiguous(memory_format=fmt) else dy.contiguous(memory_format=fmt)


def _check_backward_args(
    dy: object, x: object, mean: object, invstd: object, weight: object, count: object
) -> int:
    """Validate the arguments the backward ops share; returns ``C``."""
    _check_x(x)
    _check_x(dy, "dy")
    _check_same_shape(dy, x)
    c = x.shape[1]
    _check_channel_vector(mean, "mean", c, x.device, optional=False)
    _check_channel_vector(invstd, "invstd", c, x.device, optional=False)
    _check_channel_vector(weight, "weight", c, x.device, optional=True)
    _check_count(count, c, x.device)
    return c


class _BatchNormStatsFn(torch.autograd.Function):
    """Autograd for ``(count, mean, m2) = stats(x)``: ``dx = dmean / count + 2 * dm2 * (x - mean)``."""

    @staticmethod
    def forward(ctx, backend: KernelBackend, x: Tensor):  # type: ignore[override]
        count, mean, m2 = backend._dispatch_batch_norm_stats(x)
        ctx.backend = backend
        ctx.save_for_backward(x, count, mean)
        ctx.mark_non_differentiable(count)
        return count, mean, m2

    @staticmethod
    def backward(ctx, _grad_count: Tensor, grad_mean: Tensor, grad_m2: Tensor):  # type: ignore[override]
        if not ctx.needs_input_grad[1]:
            return None, None
        x, count, mean = ctx.saved_tensors
        # dx = (x - mean) * (2 * dm2) + dmean / count: exactly one `batch_norm_elemt`.
        scale = 2.0 * grad_m2
        shift = grad_mean / count.clamp_min(1.0)
        dx = ctx.backend._dispatch_batch_norm_elemt(x, mean, scale, None, shift)
        return None, dx


class _BatchNormElemtFn(torch.autograd.Function):
    """Autograd for ``y = (x - mean) * invstd * weight + bias`` built from the backend's own ops."""

    @staticmethod
    def forward(ctx, backend, x, mean, invstd, weight, bias):  # type: ignore[override]
        ctx.backend = backend
        ctx.has_weight = weight is not None
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, mean, invstd, weight)
        return backend._dispatch_batch_norm_elemt(x, mean, invstd, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, mean, invstd, weight = ctx.saved_tensors
        backend: KernelBackend = ctx.backend
        _, need_x, need_mean, need_invstd, need_weight, need_bias = ctx.needs_input_grad
        dx = dmean = dinvstd = dweight = dbias = None
        if need_x:
            scale = invstd * weight if weight is not None else invstd
            dx = backend._dispatch_batch_norm_elemt(dy, torch.zeros_like(mean), scale, None, None)
        if need_mean or need_invstd or need_weight or need_bias:
            sum_dy, sum_dy_xmu = backend._dispatch_batch_norm_backward_reduce(dy, x, mean, invstd)
            w = weight if weight is not None else torch.ones_like(invstd)
            if need_mean:
                dmean = -(invstd * w * sum_dy).to(mean.dtype)
            if need_invstd:
                dinvstd = (w * sum_dy_xmu).to(invstd.dtype)
            if need_weight and ctx.has_weight:
                dweight = (invstd * sum_dy_xmu).to(weight.dtype)
            if need_bias and ctx.has_bias:
                dbias = sum_dy
        return None, dx, dmean, dinvstd, dweight, dbias


class KernelBackend(abc.ABC):
    """A set of fused ops for SyncBatchNorm, loss scaling and ``report()``, for some device types.

    Subclasses set :attr:`name` and :attr:`devices` and implement ``_batch_norm_stats``,
    ``_batch_norm_elemt``, ``_batch_norm_backward_reduce``, ``_batch_norm_backward_elemt``,
    ``_unscale_and_check_`` and ``_accumulate_moments_`` with the signatures of the public methods;
    inputs reach them validated. ``reference`` (:class:`~lightning_ext.kernels.reference.ReferenceBackend`)
    is the definition of correctness.

    Attributes:
        name: registry name, e.g. ``"reference"``, ``"triton"``.
        devices: device types (``torch.device.type``) the backend runs on, e.g. ``("cuda",)``.
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        _LIVE.setdefault(self.key, self)

    def supports(self, device_type: str) -> bool:
        """Whether this backend can run on tensors of ``device_type`` (e.g. ``"cuda"``)."""
        return device_type in self.devices

    @property
    def key(self) -> str:
        """Unique key of this backend flavour, passed to the ``torch.library`` ops to find it again."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, devices={self.devices!r})"

    # ------------------------------------------------------------------ public ops

    def batch_norm_stats(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-channel element count, mean and sum of squared deviations of ``x``.

        Args:
            x: float16/bfloat16/float32 tensor of shape ``(N, C, *)``, any memory format.

        Returns:
            ``(count, mean, m2)``, float32 tensors of shape ``(C,)``: ``count`` the elements per channel
            (``N * prod(*)``), ``mean`` their mean and ``m2 = sum((x - mean)^2)``. An empty ``x`` gives
            zeros. Several shards combine with Chan et al.'s parallel formula. Differentiable in ``x``.

        Raises:
            TypeError: ``x`` is not a tensor or has another dtype.
            ValueError: ``x`` has fewer than 2 dims.

        Does not synchronize host and device. Algorithm: Welford (1962) within a block, Chan, Golub &
        LeVeque (1979) across blocks, accumulated in float32.
        """
        _check_x(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _BatchNormStatsFn.apply(self, x)
        return self._dispatch_batch_norm_stats(x)

    def batch_norm_elemt(
        self, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
    ) -> Tensor:
        """Normalize: ``y = (x - mean) * invstd * weight + bias`` per channel.

        Args:
            x: float16/bfloat16/float32 tensor of shape ``(N, C, *)``, any memory format.
            mean: float32 tensor ``(C,)``.
            invstd: float32 tensor ``(C,)``, ``1 / sqrt(var + eps)``.
            weight: float tensor ``(C,)`` or ``None`` (ones).
            bias: float tensor ``(C,)`` or ``None`` (zeros).

        Returns:
            ``y``: tensor of ``x``'s shape, dtype and memory format, computed in float32.
            Differentiable in every tensor argument.

        Raises:
            TypeError: an argument is not a tensor (``weight``/``bias``: or None) or has a wrong dtype.
            ValueError: a per-channel argument has a shape other than ``(C,)`` or another device.

        Does not synchronize host and device.
        """
        _check_x(x)
        c = x.shape[1]
        _check_channel_vector(mean, "mean", c, x.device, optional=False)
        _check_channel_vector(invstd, "invstd", c, x.device, optional=False)
        _check_channel_vector(weight, "weight", c, x.device, optional=True)
        _check_channel_vector(bias, "bias", c, x.device, optional=True)
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, mean, invstd, weight, bias)
        ):
            return _BatchNormElemtFn.apply(self, x, mean, invstd, weight, bias)
        return self._dispatch_batch_norm_elemt(x, mean, invstd, weight, bias)

    def batch_norm_backward_reduce(
        self, dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Per-channel ``sum_dy = sum(dy)`` and ``sum_dy_xmu = sum(dy * (x - mean))``.

        ``grad_bias = sum_dy`` and ``grad_weight = sum_dy_xmu * invstd``.

        Args:
            dy: gradient of the output, ``x``'s shape and dtype, any memory format.
            x: float16/bfloat16/float32 tensor ``(N, C, *)``.
            mean: float32 ``(C,)``.
            invstd: float32 ``(C,)`` (not used by the sums; part of the signature for kernels that
                fuse ``grad_weight``).

        Returns:
            ``(sum_dy, sum_dy_xmu)``, float32 ``(C,)`` each (float64 for float64 input), accumulated in
            float32. Not differentiable (it is itself a backward).

        Raises:
            TypeError / ValueError: as :meth:`batch_norm_elemt`; ``dy`` of another shape or device.

        Does not synchronize host and device.
        """
        _check_x(x)
        _check_x(dy, "dy")
        _check_same_shape(dy, x)
        c = x.shape[1]
        _check_channel_vector(mean, "mean", c, x.device, optional=False)
        _check_channel_vector(invstd, "invstd", c, x.device, optional=False)
        with torch.no_grad():
            return self._dispatch_batch_norm_backward_reduce(dy, x, mean, invstd)

    def batch_norm_backward_elemt(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        sum_dy: Tensor,
        sum_dy_xmu: Tensor,
        count: Tensor,
    ) -> Tensor:
        """Input gradient of batch norm in training mode, from globally reduced sums.

        ``dx = (dy - sum_dy / count - (x - mean) * invstd^2 * sum_dy_xmu / count) * invstd * weight``.

        Args:
            dy: gradient of the output, ``x``'s shape, any memory format.
            x: float16/bfloat16/float32 tensor ``(N, C, *)``.
            mean, invstd: float32 ``(C,)``, the statistics used in the forward.
            weight: float ``(C,)`` or ``None`` (ones).
            sum_dy, sum_dy_xmu: float32 ``(C,)``, :meth:`batch_norm_backward_reduce` summed over ranks.
            count: float32 tensor ``(C,)`` or 0-dim, the GLOBAL number of elements per channel.

        Returns:
            ``dx``: ``x``'s shape, dtype and memory format, computed in float32. Not differentiable.

        Raises:
            TypeError / ValueError: as :meth:`batch_norm_elemt`; ``count`` not a tensor of shape
            ``(C,)`` or ``()``.

        Does not synchronize host and device.
        """
        c = _check_backward_args(dy, x, mean, invstd, weight, count)
        _check_channel_vector(sum_dy, "sum_dy", c, x.device, optional=False)
        _check_channel_vector(sum_dy_xmu, "sum_dy_xmu", c, x.device, optional=False)
        with torch.no_grad():
            return self._dispatch_batch_norm_backward_elemt(
                dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count.to(_stat_dtype(x)).expand(c)
            )

    def batch_norm_backward(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        count: Tensor,
        sum_over_group: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Whole training-mode backward of a batch norm whose statistics span a group of shards.

        The local sums ``(sum_dy, sum_dy_xmu)`` of this shard, packed as ONE float32 tensor of shape
        ``(2C,)``, are handed to ``sum_over_group``, which must return their sum over the group (one
        ``all_reduce``; every rank calls it, also ranks whose ``x`` is empty); ``dx`` is then the
        :meth:`batch_norm_backward_elemt` of the global sums and ``count``. The default composes
        :meth:`batch_norm_backward_reduce` and :meth:`batch_norm_backward_elemt` (the scheme of
        ``torch.nn.SyncBatchNorm``); a backend may fuse differently (the ``reference`` backend on the
        CPU: ATen's fused local backward, then a per-channel affine correction to the global sums).

        Args:
            dy: gradient of the output, ``x``'s shape and dtype, any strides (made dense in ``x``'s
                memory format before the backend sees it).
            x: float16/bfloat16/float32 tensor ``(N, C, *)``; may be empty (``N = 0``).
            mean, invstd: float32 ``(C,)``, the global statistics the forward normalized with;
                ``invstd`` positive and finite.
            weight: float ``(C,)`` or ``None`` (ones).
            count: float32 tensor ``(C,)`` or 0-dim, the GLOBAL number of elements per channel.
            sum_over_group: callable taking and returning a float32 ``(2C,)`` tensor on ``x``'s
                device; ``None``: this shard is the whole batch.

        Returns:
            ``(dx, sum_dy, sum_dy_xmu)``: ``dx`` of ``x``'s shape, dtype and memory format; the LOCAL
            float32 ``(C,)`` sums (``grad_bias = sum_dy``, ``grad_weight = sum_dy_xmu * invstd``).

        Raises:
            TypeError / ValueError: as :meth:`batch_norm_backward_elemt`; ``sum_over_group`` not
            callable.

        Does not synchronize host and device itself (``sum_over_group`` may).
        """
        _check_backward_args(dy, x, mean, invstd, weight, count)
        if sum_over_group is not None and not callable(sum_over_group):
            raise TypeError(
                f"`sum_over_group` must be a callable or None, got {type(sum_over_group).__name__}"
            )
        return self._batch_norm_backward_checked(dy, x, mean, invstd, weight, count, sum_over_group)

    def _batch_norm_backward_checked(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        count: Tensor,
        sum_over_group: Callable[[Tensor], Tensor] | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`batch_norm_backward` for arguments known to be valid (validated above, or built by
        the caller itself, as ``SyncBatchNorm``'s autograd Function does: its per-layer cost is
        dispatch-bound on the CPU). A ``count`` already of shape ``(C,)`` in the statistics' dtype
        is passed through as is."""
        c = x.shape[1]
        dy = _dense_like(dy, x)
        stat_dtype = _stat_dtype(x)
        if count.dim() == 0 or count.dtype != stat_dtype:
            count = count.to(stat_dtype).expand(c)
        with torch.no_grad():
            return self._batch_norm_backward(dy, x, mean, invstd, weight, count, sum_over_group)

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
        """Reduce, sum over the group, elemt. Override to fuse; ``count`` arrives as ``(C,)``."""
        c = x.shape[1]
        if x.numel() > 0:
            sum_dy, sum_dy_xmu = self._dispatch_batch_norm_backward_reduce(dy, x, mean, invstd)
        else:
            sum_dy = torch.zeros(c, dtype=_stat_dtype(x), device=x.device)
            sum_dy_xmu = torch.zeros_like(sum_dy)
        total_dy, total_dy_xmu = sum_dy, sum_dy_xmu
        if sum_over_group is not None:
            total = sum_over_group(torch.cat([sum_dy, sum_dy_xmu]))
            total_dy, total_dy_xmu = total[:c], total[c:]
        if x.numel() == 0:
            return torch.empty_like(x), sum_dy, sum_dy_xmu
        dx = self._dispatch_batch_norm_backward_elemt(
            dy, x, mean, invstd, weight, total_dy, total_dy_xmu, count
        )
        return dx, sum_dy, sum_dy_xmu

    def unscale_and_check_(self, tensors: Sequence[Tensor], inv_scale: Tensor) -> Tensor:
        """Multiply every tensor in place by ``inv_scale`` and flag any inf/NaN, in one pass.

        Args:
            tensors: floating point tensors (gradients), any dtypes and devices; bucketed per
                (device, dtype) internally.
            inv_scale: float32 0-dim (or one-element) tensor, ``1 / scale``.

        Returns:
            ``found_inf``: float32 0-dim tensor on ``inv_scale.device``, 1.0 iff any element of any
            tensor was inf or NaN before scaling, else 0.0.

        Raises:
            TypeError: ``tensors`` is not a sequence of floating point tensors, or ``inv_scale`` is not a
                float32 tensor.
            ValueError: ``inv_scale`` has more than one element.

        Does not synchronize host and device (with tensors on several devices, the per-device flags
        are copied to ``inv_scale.device`` with ``non_blocking=True``). Follows
        ``torch._amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler``).
        """
        tensors = self._check_float_tensors(tensors)
        if not isinstance(inv_scale, Tensor) or inv_scale.dtype != torch.float32:
            got = inv_scale.dtype if isinstance(inv_scale, Tensor) else type(inv_scale).__name__
            raise TypeError(f"`inv_scale` must be a float32 tensor, got {got!r}")
        if inv_scale.numel() != 1:
            raise ValueError(f"`inv_scale` must have one element, got shape {tuple(inv_scale.shape)!r}")
        with torch.no_grad():
            return self._dispatch_unscale_and_check_(tensors, inv_scale.reshape(()))

    def check_finite(self, tensors: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
        """Whether any element of ``tensors`` is inf/NaN, reading them without writing (where cheaper).

        The check fused optimizers need (they unscale inside their own step): GradScaler runs its
        multiply-and-check op at scale 1 for it, which also rewrites every gradient. The default
        implementation (backends override ``_check_finite`` for a device kernel; the ``triton``
        backend reads each element once in one launch per dtype) reads large CPU tensors once with
        ``aminmax`` and sends the rest through the multi-tensor op at scale 1, which leaves the
        values bitwise unchanged.

        Args:
            tensors: floating point tensors of any dtypes and devices.
            device: where to return the flag (default: the first tensor's device, else CPU).

        Returns:
            ``found_inf``: float32 0-dim tensor on ``device``, 1.0 iff any element is inf or NaN.

        Raises:
            TypeError: ``tensors`` is not a sequence of floating point tensors.

        Does not synchronize host and device.
        """
        tensors = self._check_float_tensors(tensors)
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        with torch.no_grad():
            return self._check_finite(tensors, torch.device(device))

    def _check_finite(self, tensors: list[Tensor], device: torch.device) -> Tensor:
        """Override for a device kernel; ``tensors`` are validated floating point tensors."""
        return check_finite_reference(tensors, device)

    @staticmethod
    def _check_float_tensors(tensors: Any) -> list[Tensor]:
        if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"`tensors` must be a list of tensors, got {type(tensors).__name__}")
        try:
            all_float = all(map(torch.is_floating_point, tensors))
        except TypeError:  # a non-tensor entry
            all_float = False
        if not all_float:
            for i, t in enumerate(tensors):
                if not isinstance(t, Tensor) or not t.is_floating_point():
                    got = t.dtype if isinstance(t, Tensor) else type(t).__name__
                    raise TypeError(f"`tensors[{i}]` must be a floating point tensor, got {got!r}")
        return list(tensors)

    def accumulate_moments_(self, acc: Tensor, x: Tensor, shift: Tensor) -> None:
        """Add the shifted moments and extremes of ``x`` into ``acc`` in place.

        ``acc += [numel, sum(x - shift), sum((x - shift)^2)]`` and ``acc[3] = min(acc[3], min(x))``,
        ``acc[4] = max(acc[4], max(x))``. Start from ``[0, 0, 0, +inf, -inf]``. The shift (e.g. the
        first value seen) keeps the variance ``(s2 - s1^2 / n) / n`` accurate (shifted-data algorithm,
        Chan, Golub & LeVeque 1983).

        Args:
            acc: float64 tensor of shape ``(5,)`` on ``x``'s device, updated in place.
            x: real tensor of any shape and dtype (bool and complex excluded); an empty ``x`` adds nothing.
            shift: float64 0-dim tensor on ``x``'s device.

        Raises:
            TypeError: ``acc``/``shift`` not float64 tensors, or ``x`` not a real tensor.
            ValueError: ``acc`` not of shape ``(5,)``, ``shift`` not 0-dim, or devices differ.

        Computed in float64. Does not synchronize host and device. NaN in ``x`` propagates to every
        entry (a NaN sum; min/max NaN with the reference backend).
        """
        if not isinstance(acc, Tensor) or acc.dtype != torch.float64:
            got = acc.dtype if isinstance(acc, Tensor) else type(acc).__name__
            raise TypeError(f"`acc` must be a float64 tensor of shape (5,), got {got!r}")
        if tuple(acc.shape) != (5,):
            raise ValueError(f"`acc` must have shape (5,), got shape {tuple(acc.shape)!r}")
        if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_complex():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"`x` must be a real (float or integer) tensor, got {got!r}")
        if not isinstance(shift, Tensor) or shift.dtype != torch.float64:
            got = shift.dtype if isinstance(shift, Tensor) else type(shift).__name__
            raise TypeError(f"`shift` must be a float64 0-dim tensor, got {got!r}")
        if shift.dim() != 0:
            raise ValueError(f"`shift` must be 0-dim, got shape {tuple(shift.shape)!r}")
        if acc.device != x.device or shift.device != x.device:
            raise ValueError(
                f"`acc` ({acc.device}) and `shift` ({shift.device}) must be on the device of `x` ({x.device})"
            )
        if x.numel() == 0:
            return
        with torch.no_grad():
            self._dispatch_accumulate_moments_(acc, x.detach(), shift)

    # ------------------------------------------------------------------ dispatch (eager vs traced)

    def _dispatch_batch_norm_stats(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return torch.ops.lightning_ext.batch_norm_stats(x, self.key)
        return self._batch_norm_stats(x)

    def _dispatch_batch_norm_elemt(self, x, mean, invstd, weight, bias) -> Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.lightning_ext.batch_norm_elemt(x, mean, invstd, weight, bias, self.key)
        return self._batch_norm_elemt(x, mean, invstd, weight, bias)

    def _dispatch_batch_norm_backward_reduce(self, dy, x, mean, invstd) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return torch.ops.lightning_ext.batch_norm_backward_reduce(dy, x, mean, invstd, self.key)
        return self._batch_norm_backward_reduce(dy, x, mean, invstd)

    def _dispatch_batch_norm_backward_elemt(self, dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        if torch.compiler.is_compiling():
            return torch.ops.lightning_ext.batch_norm_backward_elemt(
                dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count, self.key
            )
        return self._batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)

    def _dispatch_unscale_and_check_(self, tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.lightning_ext.unscale_and_check_(tensors, inv_scale, self.key)
        return self._unscale_and_check_(tensors, inv_scale)

    def _dispatch_accumulate_moments_(self, acc: Tensor, x: Tensor, shift: Tensor) -> None:
        if torch.compiler.is_compiling():
            torch.ops.lightning_ext.accumulate_moments_(acc, x, shift, self.key)
            return
        self._accumulate_moments_(acc, x, shift)

    # ------------------------------------------------------------------ what a backend implements

    @abc.abstractmethod
    def _batch_norm_stats(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...

    @abc.abstractmethod
    def _batch_norm_elemt(
        self, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
    ) -> Tensor: ...

    @abc.abstractmethod
    def _batch_norm_backward_reduce(
        self, dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor
    ) -> tuple[Tensor, Tensor]: ...

    @abc.abstractmethod
    def _batch_norm_backward_elemt(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        sum_dy: Tensor,
        sum_dy_xmu: Tensor,
        count: Tensor,
    ) -> Tensor:
        """``count`` arrives as a ``(C,)`` tensor of the statistics dtype (possibly an expanded view)."""

    @abc.abstractmethod
    def _unscale_and_check_(self, tensors: list[Tensor], inv_scale: Tensor) -> Tensor:
        """``tensors`` is a list of floating point tensors, ``inv_scale`` float32 0-dim."""

    @abc.abstractmethod
    def _accumulate_moments_(self, acc: Tensor, x: Tensor, shift: Tensor) -> None:
        """``x`` is non-empty and detached."""
