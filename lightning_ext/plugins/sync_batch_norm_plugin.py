"""Lightning ``LayerSync`` plugin: our SyncBatchNorm on any accelerator, reverted losslessly at teardown."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_ext._checks import check_bool, check_int
from lightning_ext._compat import ddp_ignored, set_ddp_ignored
from lightning_ext.distributed import (
    check_process_group,
    collective_device,
    create_process_groups,
    get_world_size,
    is_distributed,
)
from lightning_ext.kernels import available_backends
from lightning_ext.nn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

__all__ = ["SyncBatchNormPlugin"]


class SyncBatchNormPlugin(LayerSync):
    """Synchronize every batch-norm layer of the model with :class:`lightning_ext.nn.SyncBatchNorm`.

    Unlike ``Trainer(sync_batchnorm=True)`` (``torch.nn.SyncBatchNorm``: fails on CPU with "SyncBatchNorm
    layers only work with GPU modules", reverts to a private ``_BatchNormXd``) it works wherever
    ``torch.distributed`` does (gloo, NCCL, ...) and gives the layers back with their original classes,
    parameters and buffers. Pass it in ``plugins=``, not with ``sync_batchnorm=True``: the DDP
    strategies call :meth:`apply` in ``setup`` when fitting (after the process group exists, before DDP
    wraps the model) and :meth:`revert` in ``teardown``. With ``ddp_spawn`` only the workers' modules
    are converted; the main process's gets the trained state through Lightning's state-dict hand-over
    (same keys). Single-device strategies ignore ``LayerSync`` plugins (nothing to synchronize).

    DDP's buffer broadcast: ``DistributedDataParallel(broadcast_buffers=True)`` (the default) broadcasts
    every buffer from rank 0 at every forward, a blocking collective per step, while a SyncBatchNorm
    keeps its buffers identical on every rank of its group itself (same update from the same
    all-reduced statistics). So, unless ``ddp_broadcast_buffers=True``, :meth:`apply` (when
    distributed) broadcasts the buffers of the layers synchronized over the whole world once from rank
    0 (one collective per buffer dtype; one host-device sync for CUDA buffers) and adds their names to
    the model's ``_ddp_params_and_buffers_to_ignore``, so DDP neither syncs them when it wraps the
    model nor broadcasts them per forward; :meth:`revert` restores that attribute. DDP still
    broadcasts the other buffers (and skips its per-forward collective when there are none), those of
    layers synchronized within a subgroup included (every group then ends up with rank 0's statistics).

    Args:
        process_group: group whose ranks share statistics (default: WORLD). Exclusive with ``group_size``.
        group_size: synchronize within consecutive blocks of this many ranks (e.g. the devices of a node),
            created in :meth:`apply` on every rank (a collective) with
            :func:`lightning_ext.distributed.create_process_groups`.
        backend: kernel backend name for the layers, one of
            :func:`lightning_ext.kernels.available_backends`; ``None`` (default): automatic
            (``LIGHTNING_EXT_KERNELS``, else the best backend for the layers' device).
        ddp_broadcast_buffers: keep DDP's per-forward broadcast of the synchronized layers' buffers
            (see above; default ``False``).

    Raises:
        ValueError: both ``process_group`` and ``group_size`` are given, ``group_size < 1``, or
            ``backend`` is not a registered backend name.
        TypeError: ``process_group`` is not a process group, ``group_size`` not an int, ``backend``
            not a string or ``ddp_broadcast_buffers`` not a bool.

    Example::

        >>> from lightning import Trainer
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn",
        ...                   plugins=[SyncBatchNormPlugin()])  # doctest: +SKIP
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        group_size: int | None = None,
        backend: str | None = None,
        ddp_broadcast_buffers: bool = False,
    ) -> None:
        if process_group is not None and group_size is not None:
            raise ValueError(
                "SyncBatchNormPlugin: pass either `process_group` or `group_size`, not both "
                f"(got process_group={process_group!r}, group_size={group_size!r})"
            )
        check_process_group(process_group, allow_non_member=True)
        check_int("SyncBatchNormPlugin", "group_size", group_size, ge=1, optional=True)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                f"SyncBatchNormPlugin: `backend` must be a kernel backend name (str) or None, got {backend!r}"
            )
        if backend is not None and backend not in available_backends():
            raise ValueError(
                f"SyncBatchNormPlugin: `backend` must be a registered kernel backend "
                f"{sorted(available_backends())} or None "
                f"(automatic selection), got {backend!r}. HINT: pass None, not 'auto', for automatic "
                "selection; register other backends with lightning_ext.kernels.register_backend."
            )
        check_bool("SyncBatchNormPlugin", "ddp_broadcast_buffers", ddp_broadcast_buffers)
        self.process_group = process_group
        self.group_size = group_size
        self.backend = backend
        self.ddp_broadcast_buffers = ddp_broadcast_buffers
        # (model, its own `_ddp_params_and_buffers_to_ignore` or None) while applied.
        self._ddp_ignore: tuple[Module, Any] | None = None
        self._converted: set[int] = set()  # id() of the layers apply() converted (alive until revert)

    @override
    def apply(self, model: Module) -> Module:
        """Convert every BatchNorm layer of ``model`` (sharing their parameters and buffers).

        Runs the collectives of the class docstring (``group_size``'s groups; the buffer broadcast),
        every rank alike and in the same order.
        """
        group = self.process_group if self.group_size is None else create_process_groups(self.group_size)
        built = {id(m) for m in model.modules() if isinstance(m, SyncBatchNorm)}  # the model's own: kept
        model = convert_sync_batchnorm(model, process_group=group, backend=self.backend)
        self._converted = {id(m) for m in model.modules() if isinstance(m, SyncBatchNorm)} - built
        if not self.ddp_broadcast_buffers and is_distributed():
            self._exclude_from_ddp_buffer_sync(model)
        return model

    @override
    def revert(self, model: Module) -> Module:
        """Give every layer :meth:`apply` converted its original class back, with the current parameters
        and buffers (the :class:`~lightning_ext.nn.SyncBatchNorm` layers the model was built with stay as
        they are), and the model its ``_ddp_params_and_buffers_to_ignore`` as before :meth:`apply`."""
        if self._ddp_ignore is not None:
            (applied, previous), self._ddp_ignore = self._ddp_ignore, None
            set_ddp_ignored(applied, previous)
        converted, self._converted = self._converted, set()
        return revert_sync_batchnorm(model, layers=[m for m in model.modules() if id(m) in converted])

    def _exclude_from_ddp_buffer_sync(self, model: Module) -> None:
        buffers = {  # name in the model => buffer, of the layers synchronized over the whole world
            name: buffer
            for prefix, layer in model.named_modules()
            if isinstance(layer, SyncBatchNorm) and get_world_size(layer.process_group) == get_world_size()
            for name, buffer in layer.named_buffers(prefix, recurse=False)
        }
        if not buffers or any(b.is_meta for b in buffers.values()):
            return  # nothing to exclude, or not materialized yet: leave DDP's sync as it is
        _broadcast_from_rank0(list(buffers.values()))
        previous = ddp_ignored(model)
        set_ddp_ignored(model, [*(previous or ()), *buffers])
        self._ddp_ignore = (model, previous)


def _broadcast_from_rank0(buffers: list[torch.Tensor]) -> None:
    """Overwrite BatchNorm ``buffers`` (no autograd) with rank 0's values in place: one broadcast per dtype,
    in the same order on every rank."""
    device = collective_device()
    for _, same_dtype in itertools.groupby(sorted(buffers, key=lambda b: str(b.dtype)), lambda b: b.dtype):
        group = list(same_dtype)
        flat = torch.cat([b.reshape(-1).to(device) for b in group])
        dist.broadcast(flat, src=0)
        for b, value in zip(group, flat.split([b.numel() for b in group])):
            b.copy_(value.view_as(b))
