"""Synchronized batch normalization that works wherever ``torch.distributed`` does (gloo, NCCL, ...).

``torch.nn.SyncBatchNorm`` only runs on CUDA, all-gathers ``W * (2C + 1)`` floats per layer and
combines the gathered (mean, invstd) pairs by reconstructing the variance from ``1 / invstd**2 - eps``.
This module keeps torch's interface (same arguments, buffers, ``_version`` and state-dict migration,
so checkpoints move freely between torch BatchNorm, torch SyncBatchNorm and this one) and changes
the communication:

Forward (training): each rank computes its per-channel (count, mean, M2) with the kernel backend,
then ONE ``all_reduce`` (SUM) of a float64 payload of ``2C + 1`` numbers per layer::

    [ n_r,  n_r * (mean_r - c),  M2_r + n_r * (mean_r - c)**2 ]

about a shift ``c`` identical on every rank: the ``running_mean`` buffer (zero without running
statistics). Summed over ranks this gives ``N``, ``S1 = N * (mean - c)`` and
``S2 = sum (x - c)**2``, from which ``mean = c + S1 / N`` and ``M2 = S2 - S1**2 / N``. Sums are
exact for any split of the batch (uneven or empty shards), and since ``c`` tracks the data mean,
``S1`` is small and the subtraction does not cancel; float64 keeps it exact even when ``c`` is far
from the mean (|mean| / std up to ~1e5 loses < 1e-6 relative). Identical buffers on every rank are
guaranteed because every rank updates them from the same all-reduced values (and DDP broadcasts
buffers); if they ever differed the result would be wrong, so load the same checkpoint everywhere.

Backward: ONE ``all_reduce`` of the float32 ``(sum_dy, sum_dy_xmu)`` (``2C`` numbers), then ``dx``
with the GLOBAL count; ``grad_weight``/``grad_bias`` stay local (DDP averages them), as in torch.
The kernel backend's ``batch_norm_backward`` owns that sequence (the ``reference`` backend, on the
CPU with float16/bfloat16 input, runs ATen's fused local backward and corrects it to the global sums).

Compiled CPU kernels: for eager CPU input with the ``reference`` backend and float32/float64
buffers, the whole training forward and backward run in :mod:`lightning_ext.kernels.cpu_extension`
(C++, one call per direction from Python, the autograd node in C++ too): ONE pass over the data for
the moments (about a local shift, a value of each channel, moved to the common shift ``c`` in
float64), the all_reduce (called back into Python), ONE pass to normalize; in the backward ONE pass
for the local sums and, after the all_reduce, ONE pass for ``dx``, where the pure-torch path needs
four (ATen has no fused CPU kernel for the synchronized backward). Results agree with that path to
rounding (``tests/kernels/test_cpu_extension.py``). Without it (no compiler,
``LIGHTNING_EXT_CPU_EXTENSION=0``, other buffer dtypes) the pure-torch path runs, with its
per-channel vector maths on NumPy views of the ``(C,)`` tensors, cheaper per operation than a small
torch op's dispatch; other devices and ``torch.compile`` run the same operator-only code on tensors.

Transport: on CPU with a gloo group whose ranks share a host, both all_reduces go through shared
memory (:mod:`lightning_ext.shm_collectives`, 18-35 µs instead of gloo's 0.3-0.5 ms median on a 2-core
machine); elsewhere through the process group's own ``all_reduce``.

Checkpointing: ``torch.utils.checkpoint`` re-runs the forward during backward. A forward that runs
while an autograd graph task is executing (``torch._C._current_graph_task_id() != -1``, which is the
case for both reentrant and non-reentrant checkpointing) is a recomputation: it still joins the
collective (every rank recomputes alike) but does not touch ``running_mean``, ``running_var`` or
``num_batches_tracked``. Under ``torch.compile`` this check is skipped (compiled regions are not
recomputed by ``torch.utils.checkpoint``'s eager path).
"""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_ext import shm_collectives
from lightning_ext.distributed import collective_device, get_world_size, is_distributed

__all__ = ["SyncBatchNorm", "sync_batch_norm_stats"]

_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)  # buffer dtypes NumPy can view
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _get_backend(name: str | None, device: torch.device):
    # Imported lazily so that importing ``lightning_ext.nn`` never compiles a kernel.
    from lightning_ext.kernels import get_backend

    return get_backend(name, device=device)


def _warm_backend(name: str | None, device: torch.device | str | None) -> None:
    """Resolve (and cache) the kernel backend for ``device`` now, eagerly.

    ``get_backend`` caches per (name, device type); a cached lookup traces cleanly under
    ``torch.compile``, a first lookup (entry-point loading) does not. Resolving at construction and
    at every eager forward keeps compiled forwards on the cached path. Also surfaces an unknown
    ``backend`` name at construction.
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        _get_backend(name, device)


def _is_recomputing() -> bool:
    """True when this forward runs inside a backward pass (``torch.utils.checkpoint`` recomputation)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _host_arrays(*tensors: Tensor) -> list[Any]:
    """NumPy views of CPU tensors (no copy), for the per-channel arithmetic on the host.

    On ``(C,)`` vectors a NumPy operation costs less than a small torch op's dispatch, and a layer
    does about 25 of them per forward. The moment arithmetic below uses only Python operators, slicing and
    ``clip``, so it runs unchanged on these views or on torch tensors (other devices, ``torch.compile``).
    """
    return [t.numpy() for t in tensors]


def _to_float64(a: Any) -> Any:
    return a.astype(np.float64) if isinstance(a, np.ndarray) else a.to(torch.float64)


def _quiet_nan(a: Any) -> Any:
    """Silences NumPy's warnings for NumPy ``a`` (0/0 with an empty group, inf - inf with non-finite
    input: NaN is the result, as torch gives it, silently); tensors never warn, so a no-op for them."""
    return np.errstate(invalid="ignore", divide="ignore") if isinstance(a, np.ndarray) else nullcontext()


def _pack_moments(count: int, mean: Any, m2: Any, shift: Any, out: Any = None) -> Any:
    """Per-rank float64 payload ``[n, n * (mean - c), M2 + n * (mean - c)**2]`` of shape ``(2C + 1,)``.

    Args:
        count: elements per channel on this rank (host integer, exact).
        mean: float32/float64 ``(C,)`` local mean; ignored when ``count == 0``.
        m2: float32/float64 ``(C,)`` local sum of squared deviations from ``mean``.
        shift: float64 ``(C,)`` shift ``c``, identical on every rank.
        out: float64 ``(2C + 1,)`` to write into (default: a new tensor on ``shift``'s device).

    Torch tensors or NumPy arrays alike (all of one kind); returns ``out``.
    """
    channels = shift.shape[0]
    if out is None:
        out = torch.empty(2 * channels + 1, dtype=torch.float64, device=shift.device)
    out[0] = float(count)
    if count == 0:
        out[1:] = 0.0
        return out
    dev = mean - shift  # promoted to float64
    s1 = dev * count
    out[1 : channels + 1] = s1
    out[channels + 1 :] = m2 + s1 * dev
    return out


def _sum_over_group(tensor: Tensor, process_group: dist.ProcessGroup | None) -> Tensor:
    """SUM ``tensor`` over the group on its collective device (one all_reduce); back on its own device.

    Small CPU tensors of a gloo group on one host go through shared memory
    (:mod:`lightning_ext.shm_collectives`: 11-20x lower median latency than gloo, measured by
    ``benchmarks/bench_shm_collectives.py``); a CUDA tensor with a gloo group is copied to the CPU
    and back (a host sync).
    """
    comm_device = collective_device(process_group)
    if comm_device != tensor.device:
        moved = tensor.to(comm_device)
        shm_collectives.all_reduce(moved, group=process_group)
        return moved.to(tensor.device)
    shm_collectives.all_reduce(tensor, group=process_group)
    return tensor


def _unpack_moments(payload: Any, shift: Any) -> tuple[Any, Any, Any]:
    """Global ``(count, mean, m2)`` in float64 from the summed payload of :func:`_pack_moments`.

    ``count`` is 0-dim; ``mean`` and ``m2`` are ``(C,)``. With ``count == 0`` they are NaN. Torch
    tensors or NumPy arrays alike.
    """
    channels = shift.shape[0]
    n = payload[0]
    s1 = payload[1 : channels + 1]
    s2 = payload[channels + 1 :]
    with _quiet_nan(payload):  # count 0: NaN, as documented
        dev = s1 / n
        mean = shift + dev
        m2 = (s2 - s1 * dev).clip(min=0.0)
    return n, mean, m2


def sync_batch_norm_stats(
    x: Tensor,
    shift: Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    backend: str | None = None,
    sync: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Global per-channel (count, mean, M2) of ``x`` over the ranks of ``process_group``.

    One ``all_reduce`` of ``2C + 1`` float64 numbers (see the module docstring for the form and
    why it is exact with uneven counts and free of catastrophic cancellation). Every rank of the
    group must call it, also ranks whose ``x`` is empty.

    Args:
        x: float16/bfloat16/float32 tensor of shape ``(N, C, *)``, any memory format.
        shift: float64 ``(C,)`` shift identical on every rank (e.g. the running mean); zeros if ``None``.
        process_group: group to reduce over (default: WORLD).
        backend: kernel backend name for the local statistics (default: auto).
        sync: ``False`` computes the same quantities locally, without a collective.

    Returns:
        ``(count, mean, m2)``: float64 0-dim global count of elements per channel, float64 ``(C,)``
        mean and float64 ``(C,)`` sum of squared deviations. NaN mean/m2 when the global count is 0.
        Not differentiable (computed from ``x.detach()``).

    Raises:
        TypeError: ``x`` is not a float16/bfloat16/float32/float64 tensor, or ``shift`` is neither
            ``None`` nor a floating point tensor.
        ValueError: ``x`` has fewer than 2 dims, or ``shift`` is not of shape ``(C,)`` on ``x``'s device.

    Synchronizes host and device only when the group's collective device differs from ``x``'s
    (e.g. gloo with CUDA tensors: the payload is copied to CPU).
    """
    from lightning_ext.kernels.backend import _check_channel_vector, _check_x

    x = _check_x(x).detach()
    channels = x.shape[1]
    _check_channel_vector(shift, "shift", channels, x.device, optional=True)
    if shift is None:
        shift = torch.zeros(channels, dtype=torch.float64, device=x.device)
    host = _on_host(x)
    ops = _get_backend(backend, x.device)
    shift = shift.detach().to(torch.float64)  # as documented; NumPy cannot view e.g. bfloat16
    count, mean, m2 = _global_moments(x, shift.numpy() if host else shift, process_group, ops, sync, host)
    if host:
        return torch.tensor(count, dtype=torch.float64), torch.from_numpy(mean), torch.from_numpy(m2)
    return count, mean, m2


def _on_host(x: Tensor) -> bool:
    """Whether the per-channel arithmetic of ``x``'s layer runs in NumPy (eager CPU)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _reference_backend_type() -> type:
    from lightning_ext.kernels.reference import ReferenceBackend

    return ReferenceBackend


_KERNELS_ENV_VAR = "LIGHTNING_EXT_KERNELS"  # lightning_ext.kernels.registry.ENV_VAR (imported lazily there)
# Per module: (what decides it, whether its eager CPU forward takes the compiled kernels).
_COMPILED_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REDUCE_GROUPS: dict[int, dist.ProcessGroup | None] = {}  # id(group) -> group (kept alive: ids stay unique)
_reducer_registered_with: Any = None  # the extension module the reducer was registered with


def _group_key(group: dist.ProcessGroup | None) -> int:
    """An integer naming ``group`` for the compiled kernels' all_reduce callback."""
    key = id(group)
    if key not in _REDUCE_GROUPS:
        _REDUCE_GROUPS[key] = group
    return key


def _reduce_for_extension(tensor: Tensor, group_key: int) -> Tensor:
    """The compiled kernels' all_reduce: :func:`_sum_over_group` over the group ``group_key`` names."""
    return _sum_over_group(tensor, _REDUCE_GROUPS[group_key])


def _load_cpu_extension() -> Any:
    """:func:`lightning_ext.kernels.cpu_extension.load` (cached after the first call), with the
    all_reduce callback registered."""
    global _reducer_registered_with
    from lightning_ext.kernels import cpu_extension

    ext = cpu_extension.load()
    if ext is not None and ext is not _reducer_registered_with:
        ext.set_reducer(_reduce_for_extension)
        _reducer_registered_with = ext
    return ext


def _global_moments(
    x: Tensor, shift: Any, process_group: dist.ProcessGroup | None, ops: Any, sync: bool, host: bool
) -> tuple[Any, Any, Any]:
    """:func:`sync_batch_norm_stats` as NumPy arrays (``host``) or tensors; ``x`` detached, ``shift``
    float64 (a NumPy array when ``host``), ``ops`` the kernel backend."""
    channels = x.shape[1]
    count = x.numel() // channels
    if count > 0:
        _, mean, m2 = ops._dispatch_batch_norm_stats(x)  # x: checked by the callers, detached
    else:
        mean = m2 = torch.zeros(channels, dtype=torch.float32, device=x.device)
    if host:
        payload_h = np.empty(2 * channels + 1, dtype=np.float64)
        mean, m2 = _host_arrays(mean, m2)
        _pack_moments(count, mean, m2, shift, payload_h)
        payload = torch.from_numpy(payload_h)
    else:
        payload = _pack_moments(count, mean, m2, shift)
    if sync:
        payload = _sum_over_group(payload, process_group)
    return _unpack_moments(payload.numpy() if host else payload, shift)


def _update_running_stats(
    running_mean: Any,
    running_var: Any,
    num_batches_tracked: Any,
    momentum: float | None,
    count: Any,
    mean: Any,
    m2: Any,
) -> None:
    """In-place exponential (or cumulative, ``momentum=None``) update from the unbiased variance.

    ``m2 / (count - 1)`` uses the GLOBAL count. The caller skips the update when the global count
    is 0 (as ATen does for an empty batch). No host sync: the cumulative factor
    ``1 / num_batches_tracked`` stays a device tensor. Torch tensors or NumPy views alike.
    """
    unbiased = m2 / (count - 1)
    if momentum is None:
        assert num_batches_tracked is not None
        factor = 1.0 / _to_float64(num_batches_tracked)
    else:
        factor = momentum
    running_mean *= 1.0 - factor
    running_mean += mean * factor
    running_var *= 1.0 - factor
    running_var += unbiased * factor


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalization with a backward that all-reduces ``(sum_dy, sum_dy_xmu)`` once.

    ``mean``/``invstd`` are the global statistics computed (without autograd) by the caller; the
    backward accounts for their dependence on ``x`` in closed form (Ioffe & Szegedy 2015, and the
    ``batch_norm_backward_elemt`` of ``torch.nn.SyncBatchNorm``).
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        invstd: Tensor,
        count: Tensor,
        process_group: dist.ProcessGroup | None,
        sync: bool,
        ops: Any,
    ) -> Tensor:
        # The arguments are the module's own, built for this call: no checks (dispatch-bound on CPU).
        y = ops._dispatch_batch_norm_elemt(x, mean, invstd, weight, bias)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.process_group = process_group
        ctx.sync = sync
        ctx.ops = ops
        return y

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, weight, mean, invstd, count = ctx.saved_tensors
        ops = ctx.ops
        grad_x = None
        if ctx.needs_input_grad[0]:
            process_group = ctx.process_group
            sum_over_group = (lambda packed: _sum_over_group(packed, process_group)) if ctx.sync else None
            # The arguments are this module's own (and autograd matched grad_output to y): no checks.
            grad_x, sum_dy, sum_dy_xmu = ops._batch_norm_backward_checked(
                grad_output, x, mean, invstd, weight, count, sum_over_group
            )
        elif x.numel() > 0:
            sum_dy, sum_dy_xmu = ops.batch_norm_backward_reduce(grad_output, x, mean, invstd)
        else:
            sum_dy = sum_dy_xmu = torch.zeros_like(mean)
        grad_weight, grad_bias = _parameter_grads(
            sum_dy, sum_dy_xmu, invstd, weight, *ctx.needs_input_grad[1:3]
        )
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


def _parameter_grads(
    sum_dy: Tensor,
    sum_dy_xmu: Tensor,
    invstd: Tensor,
    weight: Tensor | None,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(grad_weight, grad_bias) = (sum_dy_xmu * invstd, sum_dy)`` from the LOCAL sums (DDP averages
    them, as for torch's SyncBatchNorm), in the parameters' dtype; ``None`` where not needed."""
    grad_weight = grad_bias = None
    if need_weight:
        grad_weight = sum_dy_xmu * invstd
        if grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
    if need_bias:
        bias_dtype = weight.dtype if weight is not None else torch.float32
        grad_bias = sum_dy if sum_dy.dtype == bias_dtype else sum_dy.to(bias_dtype)
    return grad_weight, grad_bias


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization whose batch statistics span all ranks of a process group, on any backend.

    A drop-in for ``torch.nn.SyncBatchNorm`` (same arguments, parameters, buffers, ``_version``
    and ``_load_from_state_dict`` migration) that also runs on CPU/gloo, sends ``2C + 1`` float64
    numbers per layer in ONE ``all_reduce`` instead of all-gathering ``W * (2C + 1)`` floats, and is
    exact for uneven and empty per-rank batches. See the module docstring for the algorithm
    (parallel-variance combination about a shared shift, after Chan, Golub & LeVeque 1979).

    Training forward: local (count, mean, M2) by the kernel backend, one ``all_reduce``, global
    mean/biased variance for normalization, running statistics from the unbiased variance of the
    GLOBAL count (``momentum=None``: cumulative average, no host sync). Backward: one ``all_reduce``
    of ``(sum_dy, sum_dy_xmu)``; ``dx`` with the global count; ``grad_weight``/``grad_bias`` local.

    Plain local batch norm (ATen, no collective) is used when ``torch.distributed`` is not
    initialized, the group has one rank, or in eval mode with running statistics;
    ``track_running_stats=False`` synchronizes in eval mode too. Every rank of the group must run
    the layer the same number of times (ranks with an empty batch included).

    Args:
        num_features: ``C``, the number of channels.
        eps: added to the variance for numerical stability, ``> 0``.
        momentum: factor of the running-statistics update in ``[0, 1]``, or ``None`` for a
            cumulative moving average.
        affine: learn a per-channel scale ``weight`` and shift ``bias``.
        track_running_stats: keep ``running_mean``/``running_var``/``num_batches_tracked`` buffers.
        process_group: group whose ranks share statistics (default: WORLD); see
            :func:`lightning_ext.nn.create_process_groups`.
        device: device of parameters and buffers.
        dtype: dtype of parameters and buffers (float32 recommended; statistics are float32/64 anyway).
        backend: kernel backend name for the local statistics and elementwise ops (``None``: the
            ``LIGHTNING_EXT_KERNELS`` environment variable, else the best for the input's device).

    Shape:
        - Input: float16/bfloat16/float32 ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or
          ``(N, C, D, H, W)``, contiguous or channels_last(_3d); also under autocast.
        - Output: same shape, dtype and memory format as the input.

    Raises:
        ValueError: ``eps <= 0``, ``momentum`` outside ``[0, 1]``, ``num_features < 1``; at forward,
            an input that is not 2d-5d or whose ``C`` differs from ``num_features``, or a training
            batch with a single value per channel over the whole group.
        TypeError: an integer (or otherwise non-floating) input, or a ``backend`` that is not a string.

    Host-device synchronization: none in the common case. A rank whose local batch has at most one
    value per channel reads the global count back to the host (``.item()``) to decide whether to
    raise; all ranks see the same global count after the ``all_reduce``, so they all raise together
    and nobody hangs.

    Example::

        >>> import torch
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
        backend: str | None = None,
    ) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"`num_features` must be a positive int, got {num_features!r}")
        if not eps > 0:
            raise ValueError(f"`eps` must be > 0, got {eps!r}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"`momentum` must be in [0, 1] or None (cumulative average), got {momentum!r}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"`backend` must be a kernel backend name (str) or None, got {backend!r}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.backend = backend
        _warm_backend(backend, device)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() not in (2, 3, 4, 5):
            raise ValueError(
                f"expected a 2D, 3D, 4D or 5D input of shape (N, {self.num_features}, *), "
                f"got {input.dim()}D input of shape {tuple(input.shape)}"
            )
        if input.shape[1] != self.num_features:
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
        recomputing = _is_recomputing()
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        update_stats = self.training and self.track_running_stats and not recomputing
        process_group = self.process_group
        sync = bn_training and is_distributed() and get_world_size(process_group) > 1
        cumulative = self.training and self.track_running_stats and self.momentum is None
        if (sync or cumulative) and _on_host(input):
            ext = self._compiled_kernels(input.device)
            if ext is not None:  # eager CPU: the compiled kernels (they count the batch too)
                return self._forward_compiled(ext, input, sync, update_stats)
        if update_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if not sync and not cumulative:
            # Plain local batch norm (ATen): no collective, running stats updated by ATen if needed.
            running_mean, running_var = self.running_mean, self.running_var
            if bn_training and not update_stats and running_mean is not None:
                # Checkpoint recomputation: ATen updates throw-away copies, so that the op (and the
                # tensors it saves for backward) is the same as in the original forward.
                running_mean, running_var = running_mean.clone(), running_var.clone()
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                0.0 if self.momentum is None else self.momentum,
                self.eps,
            )
        return self._forward_synced(input, sync, update_stats)

    def _shift(self, channels: int, device: torch.device, host: bool) -> Any:
        """float64 ``(C,)`` shift of the moments, identical on every rank: the running mean (zeros
        without one); a NumPy array when ``host``."""
        running_mean = self.running_mean
        if running_mean is None:
            return np.zeros(channels) if host else torch.zeros(channels, dtype=torch.float64, device=device)
        if host and running_mean.dtype in _NUMPY_FLOATS:
            return running_mean.numpy().astype(np.float64)
        shift = running_mean.to(torch.float64)
        return shift.numpy() if host else shift

    def _cpu_extension(self, ops: Any) -> Any:
        """The compiled CPU kernels when they compute what the Python path would: the ``reference``
        backend's maths (not a subclass's) and float32/float64 running buffers (NumPy's arithmetic on
        other buffer dtypes is left to the Python path); else ``None``."""
        if type(ops) is not _reference_backend_type():
            return None
        for buffer in (self.running_mean, self.running_var):
            if buffer is not None and buffer.dtype not in (torch.float32, torch.float64):
                return None
        return _load_cpu_extension()

    def _compiled_kernels(self, device: torch.device) -> Any:
        """:meth:`_cpu_extension` of the backend for ``device`` (eager CPU input), with the decision
        memoized per module: it runs at every forward, where the backend lookup and the checks cost
        more than the layer's own host work. The memo is keyed on everything the decision reads
        (``backend``, ``LIGHTNING_EXT_KERNELS``, the running buffers' dtypes); the extension itself
        is asked for at every call (it can be turned off and on: ``cpu_extension``). Host only, no
        device sync; returns the extension module or ``None`` (the pure-torch path)."""
        buffers = self._buffers
        running_mean, running_var = buffers.get("running_mean"), buffers.get("running_var")
        key = (
            self.backend,
            os.environ.get(_KERNELS_ENV_VAR),
            None if running_mean is None else running_mean.dtype,
            None if running_var is None else running_var.dtype,
        )
        memo = _COMPILED_MEMO.get(self)
        if memo is None or memo[0] != key:
            memo = (key, self._cpu_extension(_get_backend(self.backend, device)) is not None)
            _COMPILED_MEMO[self] = memo
        return _load_cpu_extension() if memo[1] else None

    def _forward_compiled(self, ext: Any, input: Tensor, sync: bool, update_stats: bool) -> Tensor:
        """The synchronized training forward through the compiled CPU kernels (eager CPU), one call
        (autograd-recorded, backward compiled too): the moments pass (which also counts the batch in
        ``num_batches_tracked`` when ``update_stats``), the all_reduce (:func:`_sum_over_group`,
        called back from C++), the normalization."""
        return ext.sync_batch_norm(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.num_batches_tracked,
            self.momentum,
            self.eps,
            update_stats,
            sync,
            _group_key(self.process_group),
        )

    def _forward_synced(self, input: Tensor, sync: bool, update_stats: bool) -> Tensor:
        """Global statistics (one all_reduce when ``sync``), running update, normalization.

        The per-channel arithmetic runs on NumPy views for eager CPU input, on tensors otherwise
        (the same code: :func:`_pack_moments` and friends take either).
        """
        channels = self.num_features
        local_count = input.numel() // channels
        host = _on_host(input)
        ops = _get_backend(self.backend, input.device)
        with torch.no_grad():
            shift = self._shift(channels, input.device, host)
            count, mean, m2 = _global_moments(input.detach(), shift, self.process_group, ops, sync, host)
            nonempty = True  # a rank with >= 2 values per channel knows the global count is >= 2
            if local_count <= 1:
                # Host sync (device input), only on ranks that cannot know the global count is > 1.
                # All ranks see the same all-reduced count, so if it is 1 every rank has
                # local_count <= 1 and raises.
                global_count = int(count) if host else int(count.item())
                nonempty = global_count > 0
                if global_count == 1:
                    raise ValueError(
                        "Expected more than 1 value per channel when training, got input size "
                        f"{tuple(input.shape)} on this rank and 1 value per channel over the process group"
                    )
            if update_stats and nonempty:
                buffers = (self.running_mean, self.running_var, self.num_batches_tracked)
                if not host:
                    _update_running_stats(*buffers, self.momentum, count, mean, m2)
                elif self.running_mean.dtype in _NUMPY_FLOATS:
                    _update_running_stats(*_host_arrays(*buffers), self.momentum, count, mean, m2)
                else:  # e.g. a module cast to bfloat16, which NumPy cannot view
                    _update_running_stats(
                        *buffers, self.momentum, count, torch.from_numpy(mean), torch.from_numpy(m2)
                    )
            with _quiet_nan(m2):  # global count 0: NaN, never used
                invstd = (m2 / count + self.eps) ** -0.5
            if host:
                mean32 = torch.from_numpy(mean.astype(np.float32))
                invstd32 = torch.from_numpy(invstd.astype(np.float32))
                # (C,) in the statistics' dtype, as the backward op takes it without conversion.
                stat_dtype = np.float64 if input.dtype == torch.float64 else np.float32
                count32 = torch.from_numpy(np.full(channels, count, dtype=stat_dtype))
            else:
                mean32 = mean.to(torch.float32)
                invstd32 = invstd.to(torch.float32)
                count32 = count.to(torch.float32)
        weight = self.weight
        bias = self.bias
        args = (input, weight, bias, mean32, invstd32, count32, self.process_group, sync, ops)
        device_type = input.device.type
        if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
            return _SyncBatchNormFunction.apply(*args)
        # The kernels see the input's own dtype, not autocast's choice.
        if torch.compiler.is_compiling():
            with torch.autocast(device_type=device_type, enabled=False):
                return _SyncBatchNormFunction.apply(*args)
        # Eager: toggle the flag (a few µs less per layer than entering a new autocast context).
        torch.set_autocast_enabled(device_type, False)
        try:
            return _SyncBatchNormFunction.apply(*args)
        finally:
            torch.set_autocast_enabled(device_type, True)
