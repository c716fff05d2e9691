"""Lightning ``LayerSync`` plugin: our SyncBatchNorm on any accelerator, reverted losslessly at teardown."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_ext.distributed import collective_device, get_world_size, is_distributed
from lightning_ext.nn import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    create_process_groups,
    revert_sync_batchnorm,
)

__all__ = ["SyncBatchNormPlugin"]


class SyncBatchNormPlugin(LayerSync):
    """Synchronize every batch-norm layer of the model with :class:`lightning_ext.nn.SyncBatchNorm`.

    Lightning's ``Trainer(sync_batchnorm=True)`` uses ``torch.nn.SyncBatchNorm``, which fails on CPU
    ("SyncBatchNorm layers only work with GPU modules") and reverts every layer to a private
    ``_BatchNormXd``. This plugin works wherever ``torch.distributed`` does (gloo, NCCL, ...) and gives
    the layers back with their original classes, parameters and buffers.

    Pass it in ``plugins=`` (no ``sync_batchnorm=True`` needed, and not together with it): Lightning's
    accelerator connector hands any ``LayerSync`` plugin to the DDP strategies, which call
    :meth:`apply` in ``setup`` when fitting (after the process group exists, before DDP wraps the
    model) and :meth:`revert` in ``teardown``. With ``ddp_spawn`` the conversion happens in the
    workers; the main process's module is never converted and receives the trained state through
    Lightning's usual state-dict hand-over (same keys), so it keeps its original classes too.
    Single-device strategies ignore ``LayerSync`` plugins (nothing to synchronize).

    DDP's buffer broadcast: by default ``DistributedDataParallel`` broadcasts every buffer from rank
    0 at the start of every forward (``broadcast_buffers=True``), a blocking collective per step.
    SyncBatchNorm layers keep ``running_mean``/``running_var``/``num_batches_tracked`` identical on
    every rank of their group themselves (every rank applies the same update to the same
    all-reduced statistics), so for the layers whose group is the whole world that broadcast only
    copies equal values. Unless ``ddp_broadcast_buffers=True``, :meth:`apply` (when
    ``torch.distributed`` is initialized) broadcasts those buffers once from rank 0 (one collective
    per buffer dtype) and adds their names to the model's ``_ddp_params_and_buffers_to_ignore``
    (the list DDP reads when it wraps the model), so DDP neither syncs them at construction nor
    broadcasts them at each forward; :meth:`revert` restores the attribute. Other buffers of the
    model are broadcast by DDP as before, and DDP skips its per-forward collective entirely when
    SyncBatchNorm's buffers were the only ones. Layers synchronized within a subgroup
    (``group_size`` smaller than the world, or a layer built with its own subgroup) keep DDP's
    broadcast, whose semantics (every group ends up with rank 0's statistics) are unchanged.

    Args:
        process_group: group whose ranks share statistics (default: WORLD). Exclusive with ``group_size``.
        group_size: synchronize within consecutive blocks of this many ranks (e.g. the devices of a node),
            created at :meth:`apply` time on every rank with
            :func:`lightning_ext.nn.create_process_groups`.
        backend: kernel backend name for the layers (default: auto).
        ddp_broadcast_buffers: keep DDP's per-forward broadcast of the synchronized layers' buffers
            (see above; default ``False``).

    Raises:
        ValueError: both ``process_group`` and ``group_size`` are given, or ``group_size < 1``.
        TypeError: ``group_size`` is not an int, ``backend`` is not a string or
            ``ddp_broadcast_buffers`` is not a bool.

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
                "pass either `process_group` or `group_size`, not both "
                f"(got process_group={process_group!r}, group_size={group_size!r})"
            )
        if group_size is not None:
            if isinstance(group_size, bool) or not isinstance(group_size, int):
                raise TypeError(f"`group_size` must be an int or None, got {group_size!r}")
            if group_size < 1:
                raise ValueError(f"`group_size` must be >= 1, got {group_size!r}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"`backend` must be a kernel backend name (str) or None, got {backend!r}")
        if not isinstance(ddp_broadcast_buffers, bool):
            raise TypeError(f"`ddp_broadcast_buffers` must be a bool, got {ddp_broadcast_buffers!r}")
        self.process_group = process_group
        self.group_size = group_size
        self.backend = backend
        self.ddp_broadcast_buffers = ddp_broadcast_buffers
        # (model, its own `_ddp_params_and_buffers_to_ignore` or None) while applied.
        self._ddp_ignore: tuple[Module, Any] | None = None

    @override
    def apply(self, model: Module) -> Module:
        """Convert every BatchNorm layer of ``model`` (shared parameters and buffers).

        With ``group_size``, first creates the process groups; when distributed and not
        ``ddp_broadcast_buffers``, broadcasts the world-synchronized layers' buffers from rank 0 and
        excludes them from DDP's buffer sync (see the class docstring). Both are collectives that
        every rank runs here, in the same order. The broadcast synchronizes host and device once
        for CUDA buffers.
        """
        process_group = self.process_group
        if self.group_size is not None:
            process_group = create_process_groups(self.group_size)
        model = convert_sync_batchnorm(model, process_group=process_group, backend=self.backend)
        if not self.ddp_broadcast_buffers and is_distributed():
            self._exclude_from_ddp_buffer_sync(model)
        return model

    @override
    def revert(self, model: Module) -> Module:
        """Give every converted layer its original class back, with the current parameters and buffers.

        Also restores the model's ``_ddp_params_and_buffers_to_ignore`` as it was before :meth:`apply`.
        """
        if self._ddp_ignore is not None:
            applied, previous = self._ddp_ignore
            self._ddp_ignore = None
            if previous is None:
                applied.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
            else:
                applied._ddp_params_and_buffers_to_ignore = previous
        return revert_sync_batchnorm(model)

    def _exclude_from_ddp_buffer_sync(self, model: Module) -> None:
        world_size = get_world_size()
        names: list[str] = []
        buffers: list[torch.Tensor] = []
        for prefix, layer in model.named_modules():
            if not isinstance(layer, SyncBatchNorm) or get_world_size(layer.process_group) != world_size:
                continue
            for name, buffer in layer.named_buffers(recurse=False):
                if buffer is not None:
                    names.append(f"{prefix}.{name}" if prefix else name)
                    buffers.append(buffer)
        if not buffers or any(b.is_meta for b in buffers):
            return  # nothing to exclude, or not materialized yet: leave DDP's sync as it is
        _broadcast_from_rank0(buffers)
        previous = model.__dict__.get("_ddp_params_and_buffers_to_ignore")
        model._ddp_params_and_buffers_to_ignore = [*(previous or ()), *names]
        self._ddp_ignore = (model, previous)


def _broadcast_from_rank0(buffers: list[torch.Tensor]) -> None:
    """Overwrite ``buffers`` with rank 0's values in place: one broadcast per dtype, in fixed order."""
    device = collective_device()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([b.detach().reshape(-1).to(device) for b in group])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for b in group:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
