"""The :class:`KernelBackend` interface: the contract every kernel backend implements.

The public methods check their arguments for every backend (errors name the argument, the value and
what is allowed), then call :meth:`~lightning_ext.kernels.KernelBackend.run`. No op is
differentiable (SyncBatchNorm's autograd Function composes them) and no op synchronizes host and
device.

The batch-norm ops follow ``torch.nn.SyncBatchNorm``'s CUDA building blocks: ``x``/``dy`` of shape
``(N, C, *)`` (``N`` the batch, ``C`` the channels, ``*`` any spatial dims) in any memory format,
per-channel vectors of shape ``(C,)`` on ``x``'s device. Their arithmetic is float32 per element
(float64 for float64 input); sums over many elements are accumulated in float64 or in float32 blocks
added in float64.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

__all__ = ["KernelBackend"]

_OPS = (  # the ops of a backend: public method `<op>`, implemented by `_<op>`
    "batch_norm_moments", "batch_norm_gather_stats", "batch_norm_elemt", "batch_norm_backward_reduce",
    "batch_norm_backward_elemt", "unscale_and_check_", "check_finite", "accumulate_moments_",
    "moments_payload_", "moments_finish_", "accumulate_histogram_",
)  # fmt: skip
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # allowed dtypes of x / dy
_LIVE: dict[str, KernelBackend] = {}  # backend key -> live instance: how the custom ops find theirs
_B = TypeVar("_B", bound="type[KernelBackend]")


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


def _check_rows(t: object, width: int, arg: str) -> int:
    """The ``R`` of a float64 ``(R, width)`` contiguous tensor ``t``, else the error naming ``arg``."""
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"`{arg}` must be a float64 tensor of shape (R, {width}), got {_got(t)!r}")
    _check_float64(t, arg, (t.shape[0], width), t.device)
    return t.shape[0]


def _check_float64(t: object, arg: str, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.float64:
        raise TypeError(f"`{arg}` must be a float64 tensor of shape {shape}, got {_got(t)!r}")
    if tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"`{arg}` must be a contiguous tensor of shape {shape} on {device}, "
            f"got shape {tuple(t.shape)} on {t.device}"
        )


def _check_float_tensors(tensors: Any) -> list[Tensor]:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"`tensors` must be a list of tensors, got {type(tensors).__name__}")
    try:  # the common case in one C call per tensor; the loop below names the culprit
        if all(map(torch.is_floating_point, tensors)):
            return list(tensors)
    except TypeError:
        pass
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"`tensors[{i}]` must be a floating point tensor, got {_got(t)!r}")
    return list(tensors)


def _bind_ops(suffix: str, *modules: ModuleType) -> Callable[[_B], _B]:
    """Class decorator: ``_<op> = staticmethod(_<op>_<suffix>)`` (the op's trailing ``_`` dropped) for
    each op of ``_OPS`` that one of the op family ``modules`` defines; other ops are inherited."""

    def bind(cls: _B) -> _B:
        for op, module in itertools.product(_OPS, modules):
            fn = getattr(module, f"_{op.rstrip('_')}_{suffix}", None)
            if fn is not None:
                setattr(cls, f"_{op}", staticmethod(fn))
        abc.update_abstractmethods(cls)
        return cls

    return bind


class KernelBackend(abc.ABC):
    """A set of fused ops for SyncBatchNorm, loss scaling and ``report()``, for some device types.

    :class:`~lightning_ext.kernels.ReferenceBackend` is the definition of correctness; the package
    docstring says how to add a backend.

    Attributes:
        name: registry name, e.g. ``"reference"``, ``"cpu"``, ``"triton"``.
        devices: device types (``torch.device.type``) the backend runs on, e.g. ``("cuda",)``.
        supports_compile: whether ``torch.compile`` may trace calls of the ops (as the custom ops of
            :mod:`~lightning_ext.kernels.ops`, whose fake kernels give the outputs' shapes, dtypes
            and strides). ``False`` for a backend whose ops cannot run inside a ``torch.library`` op
            or return other strides than the public methods document: ``SyncBatchNorm`` then runs
            its kernels eagerly under ``torch.compile`` (a graph break, one warning).
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ()
    supports_compile: ClassVar[bool] = True

    def __init__(self) -> None:
        _LIVE[self.key] = self

    def supports(self, device_type: str) -> bool:
        """Whether this backend can run on tensors of ``device_type`` (e.g. ``"cuda"``)."""
        return device_type in self.devices

    @property
    def key(self) -> str:
        """Unique key of this backend, passed to the ``torch.library`` ops to find it again."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, devices={self.devices!r})"

    def run(self, op: str, *args: Any) -> Any:
        """Run the op named ``op`` (e.g. ``"batch_norm_elemt"``) WITHOUT checking its arguments.

        For callers whose arguments are valid by construction and whose per-call cost matters
        (SyncBatchNorm's autograd Function, the loss scaler); the public method of the same name
        documents the arguments, invalid ones give undefined results or a backend's own error. Eager
        calls go to ``_<op>``; under ``torch.compile`` to the custom op of :mod:`~lightning_ext.kernels.ops`.
        """
        if torch.compiler.is_compiling():
            return getattr(torch.ops.lightning_ext, op)(*args, self.key)
        return getattr(self, "_" + op)(*args)

    @abc.abstractmethod
    def _op(self, *args: Any) -> Any:
        """What a backend implements: ``_<op>`` runs the public ``<op>`` on validated arguments (the
        ``x`` of ``_accumulate_moments_`` is non-empty and detached)."""

    _batch_norm_moments = _batch_norm_gather_stats = _batch_norm_elemt = _op
    _batch_norm_backward_reduce = _batch_norm_backward_elemt = _op
    _unscale_and_check_ = _check_finite = _accumulate_moments_ = _op
    _moments_payload_ = _moments_finish_ = _accumulate_histogram_ = _op
    del _op

    # ------------------------------------------------------------------ batch norm

    def batch_norm_moments(self, x: Tensor, shift: Tensor) -> Tensor:
        """Per-channel count and sums about ``shift``: the payload of SyncBatchNorm's all_reduce.

        Args:
            x: ``(N, C, *)`` float16/bfloat16/float32/float64, any memory format.
            shift: float32/float64 ``(C,)``; the running mean, identical on every rank.

        Returns:
            float64 ``(2C + 1,)``: ``[n, S1_1..S1_C, S2_1..S2_C]`` with ``n = N * prod(*)``,
            ``S1 = sum(x - shift)`` and ``S2 = sum((x - shift)^2)`` per channel. Summed over ranks, it
            gives the global ``mean = shift + S1 / n`` and ``M2 = S2 - S1^2 / n`` for any split of the
            batch; summing about a shift near the mean keeps ``M2`` free of cancellation (the
            shifted-data algorithm, Chan, Golub & LeVeque 1983). Empty ``x``: all zeros.

        Raises:
            TypeError, ValueError: ``x`` not a ``(N, C, *)`` float tensor; ``shift`` not a float
                ``(C,)`` tensor on ``x``'s device.
        """
        _check_x(x)
        _check_vector(shift, "shift", x.shape[1], x.device)
        return self.run("batch_norm_moments", x, shift)

    def batch_norm_gather_stats(
        self,
        payload: Tensor,
        shift: Tensor,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        momentum: Tensor,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        """The group's mean and ``invstd`` from the summed :meth:`batch_norm_moments`; running statistics.

        ``mean = shift + S1 / n``, ``var = S2 / n - (S1 / n)^2`` (biased, clipped at 0),
        ``invstd = 1 / sqrt(var + eps)``; with running statistics given,
        ``running = (1 - momentum) * running + momentum * statistic`` in place, from the unbiased
        variance ``var * n / (n - 1)``: the role of ``torch.batch_norm_gather_stats_with_counts``. A
        group without elements (``n = 0``) gives ``mean = shift``, ``invstd = 1 / sqrt(eps)``.

        Args:
            payload: float64 ``(2C + 1,)``, the moments summed over the group.
            shift: float64 ``(C,)``, the shift the moments are about.
            running_mean, running_var: ``(C,)`` floating buffers to update in place (the caller
                passes them only for a group of at least 2 elements per channel), or both ``None``.
            momentum: 0-dim float64 tensor (on the CPU or the payload's device) in ``[0, 1]``; a tensor
                so that a cumulative average's ``1 / num_batches_tracked`` needs no host read.
            eps: added to the variance, ``> 0``.

        Returns:
            ``(mean, invstd)``: float64 ``(C,)`` each.

        Raises:
            TypeError, ValueError: a tensor of another dtype, shape or device than documented, or
                only one of the running buffers.
        """
        if not isinstance(shift, Tensor) or shift.dim() != 1:
            raise TypeError(f"`shift` must be a float64 tensor of shape (C,), got {shift!r:.60}")
        c = shift.shape[0]
        _check_vector(shift, "shift", c, shift.device)
        _check_vector(payload, "payload", 2 * c + 1, shift.device)
        if (running_mean is None) != (running_var is None):
            raise ValueError("`running_mean` and `running_var` must both be tensors or both be None")
        if not isinstance(momentum, Tensor) or momentum.dim() != 0:
            raise TypeError(f"`momentum` must be a 0-dim tensor, got {momentum!r}")
        for arg, t in (("running_mean", running_mean), ("running_var", running_var)):
            if t is not None and (not isinstance(t, Tensor) or not t.is_floating_point() or t.shape != (c,)):
                raise TypeError(
                    f"`{arg}` must be a floating point tensor of shape ({c},) or None, got {t!r:.60}"
                )
        return self.run("batch_norm_gather_stats", payload, shift, running_mean, running_var, momentum, eps)

    def batch_norm_elemt(
        self, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None
    ) -> Tensor:
        """Normalize: ``y = (x - mean) * invstd * weight + bias`` per channel.

        Args:
            x: ``(N, C, *)`` float tensor, any memory format.
            mean, invstd: float32/float64 ``(C,)``; ``invstd = 1 / sqrt(var + eps)``.
            weight, bias: float32/float64 ``(C,)`` or ``None`` (ones / zeros).

        Returns:
            ``y`` of ``x``'s shape, dtype and memory format.

        Raises:
            TypeError, ValueError: as :meth:`batch_norm_moments`, for any argument.
        """
        _check_x(x)
        for arg, t in (("mean", mean), ("invstd", invstd), ("weight", weight), ("bias", bias)):
            _check_vector(t, arg, x.shape[1], x.device, optional=arg in ("weight", "bias"))
        return self.run("batch_norm_elemt", x, mean, invstd, weight, bias)

    def batch_norm_backward_reduce(self, dy: Tensor, x: Tensor, mean: Tensor) -> Tensor:
        """Per-channel ``[sum(dy), sum(dy * (x - mean))]`` of this shard, packed for one all_reduce.

        ``grad_bias = sum(dy)`` and ``grad_weight = sum(dy * (x - mean)) * invstd``.

        Args:
            dy: gradient of the output, ``x``'s shape, any memory format.
            x: ``(N, C, *)`` float tensor; may be empty.
            mean: float32/float64 ``(C,)``, the mean the forward normalized with.

        Returns:
            ``(2C,)`` in float32 (float64 for float64 ``x``): both sums, concatenated.

        Raises:
            TypeError, ValueError: as :meth:`batch_norm_elemt`; ``dy`` of another shape or device.
        """
        _check_x(x)
        _check_x(dy, "dy", like=x)
        _check_vector(mean, "mean", x.shape[1], x.device)
        return self.run("batch_norm_backward_reduce", dy, x, mean)

    def batch_norm_backward_elemt(
        self,
        dy: Tensor,
        x: Tensor,
        mean: Tensor,
        invstd: Tensor,
        weight: Tensor | None,
        sums: Tensor,
        count: Tensor,
    ) -> Tensor:
        """Input gradient of training-mode batch norm from the group's sums.

        ``dx = (dy - G1 / n - (x - mean) * invstd^2 * G2 / n) * invstd * weight`` (Ioffe & Szegedy
        2015) with ``(G1, G2)`` = ``sums`` and ``n`` = ``count``.

        Args:
            dy: gradient of the output, ``x``'s shape, any memory format.
            x: ``(N, C, *)`` float tensor.
            mean, invstd: float32/float64 ``(C,)``, the statistics of the forward.
            weight: float32/float64 ``(C,)`` or ``None`` (ones).
            sums: :meth:`batch_norm_backward_reduce` summed over the group, ``(2C,)`` float tensor.
            count: 0-dim float tensor, the GLOBAL number of elements per channel.

        Returns:
            ``dx`` of ``x``'s shape, dtype and memory format.

        Raises:
            TypeError, ValueError: as :meth:`batch_norm_backward_reduce`; ``sums`` not ``(2C,)``,
                ``count`` not a 0-dim tensor on ``x``'s device.
        """
        _check_x(x)
        _check_x(dy, "dy", like=x)
        c = x.shape[1]
        for arg, t in (("mean", mean), ("invstd", invstd), ("weight", weight)):
            _check_vector(t, arg, c, x.device, optional=arg == "weight")
        _check_vector(sums, "sums", 2 * c, x.device)
        if not isinstance(count, Tensor) or count.dim() != 0 or count.device != x.device:
            raise ValueError(f"`count` must be a 0-dim tensor on {x.device}, got {count!r}")
        return self.run("batch_norm_backward_elemt", dy, x, mean, invstd, weight, sums, count)

    # ------------------------------------------------------------------ loss scaling

    def unscale_and_check_(self, tensors: Sequence[Tensor], inv_scale: Tensor) -> Tensor:
        """Multiply every tensor in place by ``inv_scale`` and flag any inf/NaN, in one pass.

        Follows ``torch._amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler``).

        Args:
            tensors: floating point tensors (gradients) of any dtypes, on one device.
            inv_scale: float32 tensor with one element, ``1 / scale``, on the tensors' device.

        Returns:
            ``found_inf``: float32 0-dim tensor on ``inv_scale.device``, 1.0 iff any element was inf or
            NaN before scaling.

        Raises:
            TypeError: ``tensors`` is not a sequence of floating point tensors, or ``inv_scale`` is not
                a float32 tensor.
            ValueError: ``inv_scale`` has more than one element, or the devices differ.
        """
        tensors = _check_float_tensors(tensors)
        if not isinstance(inv_scale, Tensor) or inv_scale.dtype != torch.float32:
            raise TypeError(f"`inv_scale` must be a float32 tensor, got {_got(inv_scale)!r}")
        if inv_scale.numel() != 1:
            raise ValueError(f"`inv_scale` must have one element, got shape {tuple(inv_scale.shape)!r}")
        devices = {t.device for t in tensors} - {inv_scale.device}
        if devices:
            raise ValueError(
                f"`tensors` must be on the device of `inv_scale` ({inv_scale.device}): {devices}"
            )
        return self.run("unscale_and_check_", tensors, inv_scale.reshape(()))

    def check_finite(self, tensors: Sequence[Tensor], device: torch.device | str) -> Tensor:
        """Whether any element of ``tensors`` is inf/NaN, without changing them.

        The check fused optimizers need (they unscale inside their own step); ``torch.amp.GradScaler``
        runs its multiply-and-check op at scale 1 for it.

        Args:
            tensors: floating point tensors of any dtypes, on ``device``.
            device: the tensors' device (needed when ``tensors`` is empty).

        Returns:
            ``found_inf``: float32 0-dim tensor on ``device``, 1.0 iff any element is inf or NaN.

        Raises:
            TypeError: ``tensors`` is not a sequence of floating point tensors.
            ValueError: a tensor is not on ``device``.
        """
        tensors = _check_float_tensors(tensors)
        device = torch.device(device)
        if any(t.device != device for t in tensors):
            raise ValueError(f"`tensors` must all be on `device` {device}")
        return self.run("check_finite", tensors, device)

    # ------------------------------------------------------------------ statistics

    def accumulate_moments_(self, acc: Tensor, x: Tensor, shift: Tensor) -> None:
        """Add the count, shifted sums and extremes of ``x`` into ``acc``, in place, totals in float64.

        ``acc += [numel, sum(x - shift), sum((x - shift)^2)]``, ``acc[3] = min(acc[3], min(x))``,
        ``acc[4] = max(acc[4], max(x))``; start from ``[0, 0, 0, +inf, -inf]``. A shift near the data
        (its first value) keeps the variance ``(S2 - S1^2 / n) / n`` accurate (shifted-data algorithm,
        Chan, Golub & LeVeque 1983). Element arithmetic is float64, except that for
        float16/bfloat16/float32 input a backend may form ``x - shift`` and its square in float32 and
        sum them in runs of at most 32 terms before float64 takes them (``cpu``: relative error at
        most ``34 * 2**-24`` of the summed magnitudes). NaN in ``x`` makes the sums and extremes NaN.

        Args:
            acc: float64 ``(5,)`` on ``x``'s device, updated in place.
            x: real tensor of any shape and dtype (bool and complex excluded); empty adds nothing.
            shift: float64 0-dim tensor on ``x``'s device.

        Raises:
            TypeError: ``acc``/``shift`` not float64 tensors, or ``x`` not a real tensor.
            ValueError: ``acc`` not of shape ``(5,)``, ``shift`` not 0-dim, or the devices differ.
        """
        if not isinstance(acc, Tensor) or acc.dtype != torch.float64:
            raise TypeError(f"`acc` must be a float64 tensor of shape (5,), got {_got(acc)!r}")
        if tuple(acc.shape) != (5,):
            raise ValueError(f"`acc` must have shape (5,), got shape {tuple(acc.shape)!r}")
        if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"`x` must be a real (float or integer) tensor, got {_got(x)!r}")
        if not isinstance(shift, Tensor) or shift.dtype != torch.float64:
            raise TypeError(f"`shift` must be a float64 0-dim tensor, got {_got(shift)!r}")
        if shift.dim() != 0:
            raise ValueError(f"`shift` must be 0-dim, got shape {tuple(shift.shape)!r}")
        if acc.device != x.device or shift.device != x.device:
            raise ValueError(f"`acc` ({acc.device}) and `shift` ({shift.device}) must be on {x.device}")
        if x.numel():
            self.run("accumulate_moments_", acc, x.detach(), shift)

    def accumulate_histogram_(self, hist: Tensor, x: Tensor, edges: Tensor) -> None:
        """Count the values of ``x`` into the buckets of a signed histogram with the given edges, in place.

        ``edges`` are the increasing positive upper edges ``e_0 < ... < e_m`` of the zero bucket
        (``|v| <= e_0``) and of ``m`` buckets per sign (``e_(j-1) < |v| <= e_j``); an overflow bucket per
        sign takes ``|v| > e_m`` (infinities included). ``B = 2m + 3`` counts ordered by value (the
        layout: :mod:`lightning_ext.kernels.histogram`); NaN is not counted. The comparisons are in
        float64, so every backend counts alike. Counts are float64 (exact to ``2**53`` per bucket):
        histograms of several ranks merge by a SUM all-reduce. Geometric edges ``e_j = e_0 gamma^j``
        give DDSketch's logarithmic buckets (Masson, Rim & Lee, VLDB 2019), with which a bucket's
        values lie within ``(gamma - 1) / (gamma + 1)`` of its representative, relatively.

        Args:
            hist: float64 ``(2m + 3,)`` on ``x``'s device, contiguous, updated in place.
            x: real tensor of any shape and dtype (bool and complex excluded); empty adds nothing.
            edges: float64 ``(m + 1,)`` on ``x``'s device, contiguous, positive, finite, strictly
                increasing (not checked: that would synchronize host and device).

        Raises:
            TypeError: ``hist`` or ``edges`` not a float64 tensor, ``x`` not a real tensor.
            ValueError: ``edges`` not 1-D and non-empty, ``hist`` not of shape ``(2m + 3,)``, or a
                tensor on another device than ``x``.

        Example::

            >>> from lightning_ext.kernels import get_backend
            >>> hist = torch.zeros(7, dtype=torch.float64)
            >>> edges = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
            >>> x = torch.tensor([-5.0, 0.0, 1.0, 1.5, 3.0, float("nan")])
            >>> get_backend("reference").accumulate_histogram_(hist, x, edges)
            >>> hist.tolist()
            [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        """
        if not isinstance(x, Tensor) or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"`x` must be a real (float or integer) tensor, got {_got(x)!r}")
        if not isinstance(edges, Tensor) or edges.dtype != torch.float64:
            raise TypeError(f"`edges` must be a float64 tensor of shape (m + 1,), got {_got(edges)!r}")
        if edges.dim() != 1 or not edges.numel():
            raise ValueError(f"`edges` must have shape (m + 1,), m >= 0, got {tuple(edges.shape)!r}")
        _check_float64(edges, "edges", (edges.numel(),), x.device)
        _check_float64(hist, "hist", (2 * edges.numel() + 1,), x.device)
        if x.numel():
            self.run("accumulate_histogram_", hist, x.detach(), edges)

    def moments_payload_(
        self,
        max_payload: Tensor,
        sum_payload: Tensor,
        sums: Tensor,
        shifts: Tensor,
        center: Tensor,
        fingerprint: float,
    ) -> None:
        """Write one rank's moment rows of ``R`` statistics as the two payloads of a flush, in place.

        Each row's local moments come from its shifted sums: ``mean = shift + S1 / n``,
        ``m2 = max(S2 - S1^2 / n, 0)``; then, with ``d = mean - center`` (0 where ``n = 0``;
        non-finite centers count as 0):

        * ``max_payload`` (MAX all-reduce) ``= [fingerprint, -fingerprint, max_1..R, -min_1..R,
          mean_1..R, -mean_1..R]``, the means ``-inf`` where ``n = 0``;
        * ``sum_payload`` (SUM all-reduce) ``= [n, m2, n d, n d^2]`` per row.

        Summed over ranks around a ``center`` shared by all, :meth:`moments_finish_` turns them into
        the global moments by Chan, Golub & LeVeque's merge (1979): the within-rank ``m2`` never
        cancels, the between-rank term is exact when the center is near the rank means.

        Args:
            max_payload: float64 ``(2 + 4R,)``, written.
            sum_payload: float64 ``(R, 4)``, written.
            sums: float64 ``(R, 5)``, per row ``[n, S1, S2, min, max]`` with ``S1 = sum(x - shift)``,
                ``S2 = sum((x - shift)^2)`` (the layout of :meth:`accumulate_moments_`; a moment row
                ``[n, mean, m2, min, max]`` is the case ``S1 = 0``, ``shift = mean``).
            shifts: float64 ``(R,)``, each row's shift.
            center: float64 ``(R,)``, the same on every rank.
            fingerprint: a float64 identifying the names (see :class:`~lightning_ext.stats.Collector`).

        Raises:
            TypeError, ValueError: a tensor that is not float64 of the shape above, contiguous, on
                ``sums``' device.
        """
        r = _check_rows(sums, 5, "sums")
        for t, arg, shape in (
            (max_payload, "max_payload", (2 + 4 * r,)), (sum_payload, "sum_payload", (r, 4)),
            (shifts, "shifts", (r,)), (center, "center", (r,)),
        ):  # fmt: skip
            _check_float64(t, arg, shape, sums.device)
        self.run("moments_payload_", max_payload, sum_payload, sums, shifts, center, float(fingerprint))

    def moments_finish_(
        self,
        published: Tensor,
        next_shift: Tensor,
        max_payload: Tensor,
        sum_payload: Tensor,
        center: Tensor,
        keep_previous: bool,
    ) -> Tensor:
        """Publish the global moments of ``R`` statistics from the reduced payloads of
        :meth:`moments_payload_`, in place; say whether a row must be reduced again.

        Per row, with ``spread = max(mean) - min(mean)`` over the ranks that had values:
        ``n = sum(n)``, ``mean = center + sum(n d) / n`` (the only rank mean when ``spread == 0``:
        exact), ``m2 = sum(m2) + (sum(n d^2) - sum(n d)^2 / n)`` (the second term clipped at 0 and
        exactly 0 when ``spread == 0``), ``std = sqrt(m2 / n)`` (population), min and max. A row
        with ``n > 0`` is written to ``published`` and its mean to ``next_shift``; a row with
        ``n = 0`` keeps both when ``keep_previous``, else its ``published`` row becomes
        ``[0, nan, nan, nan, nan]`` (``next_shift`` is kept).

        Args:
            published: float64 ``(R, 5)``, ``[n, mean, std, min, max]`` per row, updated.
            next_shift: float64 ``(R,)``, updated (the center of the next flush).
            max_payload, sum_payload: the payloads after the MAX and SUM all-reduces.
            center: float64 ``(R,)``, the center the payloads were made around.
            keep_previous: what a row without values keeps (above).

        Returns:
            bool 0-dim tensor: some row's between-rank term may have lost more than ``1e-10`` of its
            ``m2`` to cancellation (its rounding error is at most a few ``eps n distance^2``, distance
            the largest ``|rank mean - center|``); reduce ``sum_payload`` again around
            ``center = max(mean)`` (``max_payload[2 + 2R : 2 + 3R]``) and finish again.

        Raises:
            TypeError, ValueError: as :meth:`moments_payload_`; ``keep_previous`` not a bool.
        """
        r = _check_rows(published, 5, "published")
        for t, arg, shape in (
            (next_shift, "next_shift", (r,)), (max_payload, "max_payload", (2 + 4 * r,)),
            (sum_payload, "sum_payload", (r, 4)), (center, "center", (r,)),
        ):  # fmt: skip
            _check_float64(t, arg, shape, published.device)
        if not isinstance(keep_previous, bool):
            raise TypeError(f"`keep_previous` must be a bool, got {keep_previous!r}")
        payloads = (max_payload, sum_payload)
        return self.run("moments_finish_", published, next_shift, *payloads, center, keep_previous)
