"""Synchronized batch normalization that works wherever ``torch.distributed`` does (gloo, NCCL, ...).

``torch.nn.SyncBatchNorm`` only runs on CUDA, all-gathers ``W * (2C + 1)`` numbers per layer and
combines the gathered (mean, invstd) pairs by reconstructing the variance from ``1 / invstd**2 - eps``.
:class:`SyncBatchNorm` keeps its interface and changes the computation:

Forward (training): each rank computes, with the kernel backend of its input's device, the
per-channel count and sums about a shift ``c`` identical on every rank (the ``running_mean``
buffer, its non-finite entries 0; zero without running statistics) — a float64 payload of ``2C + 1`` numbers::

    [ n_r,  sum(x_r - c),  sum((x_r - c)**2) ]

— then ONE ``all_reduce`` (SUM) of it. Summed over ranks this gives ``N``, ``S1`` and ``S2``, from
which ``mean = c + S1 / N`` and ``var = S2 / N - (S1 / N)**2``: exact for any split of the batch
(uneven or empty shards), and since ``c`` tracks the data mean, the subtraction does not cancel
(shifted-data algorithm, Chan, Golub & LeVeque 1983; float64 keeps it exact even when ``c`` is far
from the mean: ``|mean| / std`` up to ~1e5 loses < 1e-6 relative). Every rank updates its running
statistics from the same all-reduced numbers (unbiased variance of the GLOBAL count), so they stay
identical (load the same checkpoint everywhere).

Backward: ONE ``all_reduce`` of ``[sum(dy), sum(dy * (x - mean))]`` (``2C`` numbers), then ``dx``
with the global count; ``grad_weight``/``grad_bias`` come from the local sums (DDP averages them),
as in torch. Float64 input is computed in float64 throughout.

The all_reduces go through :func:`lightning_ext.distributed.all_reduce_` (shared memory between CPU
ranks of one host). Which kernels run is the backend's choice (``reference``, the compiled ``cpu``
one, ``triton``): one autograd Function composes the backend's four batch-norm ops.

``torch.compile`` (``fullgraph=True`` included; inductor, the default, checked): the layer traces
without a graph break, forward and backward, training and eval. The kernels enter the graph as the
custom ops of :mod:`lightning_ext.kernels.ops`, the two all_reduces as functional collectives over
the process group (the shared-memory transport cannot be traced: see
:func:`lightning_ext.distributed.all_reduce_`). In a graph a rank whose own batch has at most one
value per channel does not read the group's count on the host, so a group with a single value per
channel does not raise there: it normalizes to ``bias`` and leaves the running statistics as they
were (as a group without values does). A backend whose ``supports_compile`` is false runs eagerly at
a graph break, with one warning.

Checkpointing: a forward that runs while an autograd graph task is executing
(``torch.utils.checkpoint``'s recomputation, reentrant or not) still joins the collective (every rank
recomputes alike) but does not touch ``running_mean``, ``running_var`` or ``num_batches_tracked``,
when the layer runs eagerly. Under ``torch.compile`` the recomputation replays a traced graph, the
update traced in: a checkpoint around a layer compiled on its own moves the statistics twice a step
(as ``torch.nn.BatchNorm2d``'s under any checkpoint); a compiled function that holds the checkpoint
moves them once with torch 2.13 and 2.14, twice with torch 2.5 (the guide's "What every rank must
call").
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_ext._checks import as_number, check_bool, check_int, check_number
from lightning_ext.distributed import (
    all_reduce_,
    check_process_group,
    get_process_group,
    get_world_size,
    is_distributed,
)
from lightning_ext.kernels import payload_moments

__all__ = ["SyncBatchNorm", "sync_batch_norm_stats"]

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_untraced_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # backends whose eager fallback was warned


def _backend(name: str | None, device: torch.device) -> Any:
    from lightning_ext.kernels import get_backend  # lazily: importing nn builds no kernel

    return get_backend(name, device=device)


def _warm_backend(name: str | None, device: torch.device | str | None) -> None:
    """Resolve the kernel backend for ``device`` now (an unknown ``name`` fails here): the registry
    caches it, and a cached lookup traces cleanly under ``torch.compile`` where a first one does not."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        _backend(name, device)


def _is_recomputing() -> bool:
    """True when this forward runs inside a backward pass (``torch.utils.checkpoint`` recomputation)."""
    if torch.compiler.is_compiling():  # a forward torch.compile traces is never a recomputation
        return False
    from lightning_ext._compat import in_backward  # reads torch's private graph-task id

    return in_backward()


def _as_vector(t: Tensor | None) -> Tensor | None:
    """A parameter as the kernels take it: float32/float64 (a half-precision module's in float32)."""
    return t if t is None or t.dtype in (torch.float32, torch.float64) else t.float()


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over a process group: one all_reduce per direction (module docstring).

    ``group``: the process group, or ``None`` for no collective (the statistics of this shard).
    ``momentum``: a float, or ``None`` for the cumulative average ``1 / num_batches_tracked``. The
    backend's ops are called through its unchecked entry point: the arguments are the module's own.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                update, group, backend):  # type: ignore[override]  # fmt: skip
        c = x.shape[1]
        if running_mean is not None:  # (one non-finite batch left it inf or NaN: no shift there)
            shift = running_mean.to(torch.float64, copy=True).nan_to_num_(0.0, 0.0, 0.0)
        else:
            shift = torch.zeros(c, dtype=torch.float64, device=x.device)
        payload = backend.run("batch_norm_moments", x, shift)
        if group is not None:
            all_reduce_(payload, group=group)
        count = payload[0]
        few = x.numel() <= c and torch.compiler.is_compiling()  # no host read in a graph: see _undo_if_few
        nonempty = x.numel() > c or few or _global_count(count, x) > 0  # raises on one value per channel
        update = update and running_mean is not None and nonempty
        if update and momentum is None:  # the cumulative average, without a host read
            factor = num_batches_tracked.double().reciprocal()
        else:
            factor = torch.tensor(momentum or 0.0, dtype=torch.float64)
        running = (running_mean, running_var) if update else (None, None)
        before = [t.clone() for t in running] if update and few else None
        mean, invstd = backend.run("batch_norm_gather_stats", payload, shift, *running, factor, eps)
        if before is not None:
            _undo_if_few(running, before, count)
        ctx.param_dtype = weight.dtype if weight is not None else torch.float32
        weight, bias = _as_vector(weight), _as_vector(bias)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group, ctx.backend = group, backend
        return backend.run("batch_norm_elemt", x, mean, invstd, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, invstd, count = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        backend, c = ctx.backend, x.shape[1]
        sums = backend.run("batch_norm_backward_reduce", dy, x, mean)
        grad_weight = (sums[c:] * invstd).to(ctx.param_dtype) if need_weight else None
        grad_bias = sums[:c].to(ctx.param_dtype, copy=True) if need_bias else None
        grad_x = None
        if need_x:  # else no collective: only dx needs the group's sums (every rank decides alike)
            if ctx.group is not None:
                all_reduce_(sums, group=ctx.group)
            grad_x = backend.run("batch_norm_backward_elemt", dy, x, mean, invstd, weight, sums, count)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _undo_if_few(running: tuple[Tensor, Tensor], before: list[Tensor], count: Tensor) -> None:
    """Under ``torch.compile``, on a rank whose own batch has at most one value per channel: give the
    running statistics back their values ``before`` the update unless the group has 2 values per
    channel or more. Eager code reads the count on the host instead (``_global_count``), which in a
    graph would break it on this rank only: the ranks would then reduce on different transports (the
    eager part through shared memory) and wait for each other forever."""
    few = count < 2
    for buffer, old in zip(running, before, strict=True):
        buffer.copy_(torch.where(few, old, buffer))


def _global_count(count: Tensor, x: Tensor) -> int:
    """The group's count per channel on the host, for a rank whose own batch has at most one value per
    channel (others know it is > 1). Raises as torch does when it is 1: every rank sees the same count,
    so all raise together. Host sync on device input."""
    total = int(count.item())
    if total == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)} on "
            "this rank and 1 value per channel over the process group"
        )
    return total


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization whose batch statistics span the ranks of a process group, on any backend.

    A drop-in for ``torch.nn.SyncBatchNorm`` (same arguments in the same order, parameters, buffers,
    ``_version`` and state dict) that computes as the module docstring says: on CPU/gloo too, with ONE
    ``all_reduce`` of ``2C + 1`` float64 numbers per layer, exact for uneven and empty per-rank batches.
    It is not a subclass of torch's class: ``DistributedDataParallel`` refuses every
    ``torch.nn.SyncBatchNorm`` of a CPU model.

    It synchronizes exactly when ``torch.nn.SyncBatchNorm`` does: in training mode, when
    ``torch.distributed`` is initialized and the group has several ranks. Otherwise, and always in
    eval mode (also with ``track_running_stats=False``, which then normalizes with the local batch's
    statistics), it is plain local batch norm (ATen) and calls no collective, so one rank may run
    inference alone. In training, every rank of the group must run the layer the same number of times
    (ranks with an empty batch included).

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance for numerical stability, ``> 0``.
        momentum: factor of the running-statistics update in ``[0, 1]``, or ``None`` for a
            cumulative moving average.
        affine: learn a per-channel scale ``weight`` (and shift ``bias``).
        track_running_stats: keep ``running_mean``/``running_var``/``num_batches_tracked`` buffers.
        process_group: group whose ranks share statistics (default: WORLD); see
            :func:`lightning_ext.distributed.create_process_groups`.
        device, dtype: of parameters and buffers.
        bias: with ``affine``, learn ``bias`` too (torch's keyword).
        backend: kernel backend name (``None``: ``LIGHTNING_EXT_KERNELS``, else the best for the
            input's device).

    Shape:
        - Input: float16/bfloat16/float32/float64 ``(N, C, *)``, any memory format; also under autocast
          (the kernels see the input's own dtype).
        - Output: same shape, dtype and memory format as the input.

    Raises:
        ValueError: ``eps <= 0``, ``momentum`` outside ``[0, 1]``, ``num_features < 1``; at forward,
            an input of fewer than 2 dims or whose ``C`` differs from ``num_features``, or a training
            batch with a single value per channel over the whole group.
        TypeError: ``num_features`` not an int, ``eps`` or ``momentum`` not a finite number, a
            non-floating input, a ``backend`` that is not a string, or a ``process_group`` that is
            not a process group.

    Host-device synchronization: none in the common case. A rank whose local batch has at most one
    value per channel reads the global count (``.item()``) to decide whether to raise; all ranks see the
    same count after the ``all_reduce``, so they raise together and nobody hangs. Under
    ``torch.compile`` it reads nothing (module docstring).

    Example::

        >>> bn = SyncBatchNorm(3)
        >>> y = bn(torch.randn(4, 3, 5, 5))  # not distributed: plain local batch norm
        >>> y.shape, int(bn.num_batches_tracked)
        (torch.Size([4, 3, 5, 5]), 1)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        backend: str | None = None,
    ) -> None:
        owner = type(self).__name__
        num_features, eps, momentum = (as_number(x) for x in (num_features, eps, momentum))  # (as torch's)
        check_int(owner, "num_features", num_features, ge=1)
        check_number(owner, "eps", eps, gt=0.0)
        check_number(
            owner, "momentum", momentum, ge=0.0, le=1.0, optional=True, hint="None: a cumulative average."
        )
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"`backend` must be a kernel backend name (str) or None, got {backend!r}")
        check_process_group(process_group, allow_non_member=True)
        # Older torch has no `bias` keyword: pass it only when it differs from the default.
        factory = {"device": device, "dtype": dtype, **({} if bias else {"bias": False})}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **factory)
        self.process_group = process_group
        self.backend = backend
        _warm_backend(backend, device)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """torch's ``SyncBatchNorm.convert_sync_batchnorm(module, process_group)``: every batch norm of
        ``module`` becomes this class (:func:`~lightning_ext.nn.convert_sync_batchnorm`, which says
        what is shared and raised; :func:`~lightning_ext.nn.revert_sync_batchnorm` undoes it)."""
        from lightning_ext.nn.convert import convert_sync_batchnorm  # (convert imports this module)

        return convert_sync_batchnorm(module, process_group)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"expected input of shape (N, {self.num_features}, *) (num_features={self.num_features}), "
                f"got shape {tuple(input.shape)}"
            )
        if input.dtype not in _INPUT_DTYPES:
            raise TypeError(
                f"expected a float16, bfloat16, float32 or float64 input, got dtype {input.dtype!r}. "
                "HINT: convert integer data with `.float()`."
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        update = self.training and self.track_running_stats and not _is_recomputing()
        if update:
            self.num_batches_tracked.add_(1)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        group = get_process_group(self.process_group)
        if self.training and is_distributed() and get_world_size(group) > 1:
            return self._function(input, update, group)
        if self.training and self.track_running_stats and self.momentum is None:
            return self._cumulative(input, update)
        # torch's rule: no synchronization; plain local batch norm (ATen).
        running_mean, running_var = self.running_mean, self.running_var
        if self.training and not self.track_running_stats:
            running_mean = running_var = None
        elif bn_training and not update and running_mean is not None:  # a recomputation: throw-away copies
            running_mean, running_var = running_mean.clone(), running_var.clone()
        factor = self.momentum if self.momentum is not None else 0.0
        return F.batch_norm(
            input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps
        )

    def _cumulative(self, input: Tensor, update: bool) -> Tensor:
        """Local training with ``momentum=None``: ATen's batch norm by the batch's own statistics
        (differentiable twice, as torch's), the running statistics moved toward them by ``1 /
        num_batches_tracked`` on the device (torch reads that count on the host: a sync)."""
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if update and input.numel() > input.shape[1]:  # (F.batch_norm raised for one value a channel)
            with torch.no_grad():
                x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
                dims = [0, *range(2, input.dim())]  # (var_mean's mean of an inf is NaN, not torch's inf)
                mean, var = x.mean(dims), x.var(dims, correction=1)
                factor = self.num_batches_tracked.double().reciprocal().to(self.running_mean.dtype)
                for running, batch in ((self.running_mean, mean), (self.running_var, var)):
                    running.mul_(1 - factor).add_(batch.to(running.dtype) * factor)  # (ATen's order)
        return output

    def _function(self, input: Tensor, update: bool, group: dist.ProcessGroup | None) -> Tensor:
        """The training forward through the kernels, over ``group`` (one all_reduce; ``None``: this rank
        alone), with autocast off around them; eager under ``torch.compile`` if the backend is not
        traceable."""
        backend = _backend(self.backend, input.device)
        if torch.compiler.is_compiling() and not backend.supports_compile:
            from lightning_ext.nn._untraced import _untraced_function  # imports torch._dynamo: only now

            return _untraced_function(self._eager_function, input, update, group, backend)
        running = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        args = (input, self.weight, self.bias, *running, self.num_batches_tracked, self.momentum, self.eps,
                update, group, backend)  # fmt: skip
        device_type = input.device.type
        autocast = device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            return _SyncBatchNormFunction.apply(*args)

    def _eager_function(
        self, input: Tensor, update: bool, group: dist.ProcessGroup | None, backend: Any
    ) -> Tensor:
        """:meth:`_function`, which ``torch.compile`` runs outside the graph (a graph break; with
        ``fullgraph=True`` it raises instead) for a backend whose ``supports_compile`` is false. Warns
        once per backend instance (one per process; again after :func:`lightning_ext.reset`)."""
        if backend not in _untraced_warned:
            _untraced_warned.add(backend)
            warnings.warn(
                f"lightning_ext: kernel backend {backend.name!r} does not support torch.compile "
                f"({type(backend).__name__}.supports_compile is False): SyncBatchNorm runs its kernels "
                "eagerly, with a graph break around each layer (warned once). HINT: select a backend "
                "that supports it, e.g. SyncBatchNorm(backend='reference').",
                RuntimeWarning,
                stacklevel=2,
            )
        return self._function(input, update, group)


def sync_batch_norm_stats(
    x: Tensor,
    shift: Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    sync: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Global per-channel ``(count, mean, M2)`` of ``x`` over the ranks of ``process_group``.

    One ``all_reduce`` of ``2C + 1`` float64 numbers (see the module docstring). Every rank of the
    group must call it, also ranks whose ``x`` is empty.

    Args:
        x: float16/bfloat16/float32/float64 tensor of shape ``(N, C, *)``, any memory format.
        shift: ``(C,)`` float tensor identical on every rank (e.g. the running mean; a non-finite
            entry counts as 0); zeros if ``None``.
        process_group: group to reduce over (default: WORLD).
        backend: kernel backend name (default: auto).
        sync: ``False`` computes the same quantities locally, without a collective.

    Returns:
        ``(count, mean, m2)``: float64 0-dim count of elements per channel, float64 ``(C,)`` mean and
        ``(C,)`` sum of squared deviations; NaN mean/m2 when the count is 0. Not differentiable.

    Raises:
        TypeError, ValueError: as the ``batch_norm_moments`` op (:mod:`lightning_ext.kernels.batch_norm`);
            ``TypeError``: ``sync`` is not a bool, ``process_group`` not a process group or ``None``.

    Synchronizes host and device only when the group's collective device differs from ``x``'s.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"`x` must be a torch.Tensor of shape (N, C, *), got {type(x).__name__}")
    check_bool("sync_batch_norm_stats", "sync", sync)
    check_process_group(process_group, allow_non_member=True)
    if shift is None and x.dim() >= 2:
        shift = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    if isinstance(shift, Tensor) and shift.dtype not in (torch.float32, torch.float64):
        shift = shift.double()
    if isinstance(shift, Tensor):  # a non-finite entry takes 0 (moments about it would be NaN)
        shift = shift.nan_to_num(0.0, 0.0, 0.0)
    payload = _backend(backend, x.device).run("batch_norm_moments", x.detach(), shift, check=True)
    if sync and is_distributed():
        all_reduce_(payload, group=process_group)
    count, mean, var = payload_moments(payload, shift.double())
    nan = torch.full_like(mean, torch.nan)  # no element in the group: no statistics
    return count, torch.where(count > 0, mean, nan), torch.where(count > 0, var * count, nan)
