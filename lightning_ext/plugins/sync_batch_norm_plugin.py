"""Lightning ``LayerSync`` plugin: our SyncBatchNorm on any accelerator, reverted losslessly at teardown."""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from typing_extensions import override

from lightning_ext.nn import convert_sync_batchnorm, create_process_groups, revert_sync_batchnorm

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

    Args:
        process_group: group whose ranks share statistics (default: WORLD). Exclusive with ``group_size``.
        group_size: synchronize within consecutive blocks of this many ranks (e.g. the devices of a node),
            created at :meth:`apply` time on every rank with
            :func:`lightning_ext.nn.create_process_groups`.
        backend: kernel backend name for the layers (default: auto).

    Raises:
        ValueError: both ``process_group`` and ``group_size`` are given, or ``group_size < 1``.
        TypeError: ``group_size`` is not an int or ``backend`` is not a string.

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
        self.process_group = process_group
        self.group_size = group_size
        self.backend = backend

    @override
    def apply(self, model: Module) -> Module:
        """Convert every BatchNorm layer of ``model`` (shared parameters and buffers).

        With ``group_size``, first creates the process groups: a collective that every rank runs here.
        """
        process_group = self.process_group
        if self.group_size is not None:
            process_group = create_process_groups(self.group_size)
        return convert_sync_batchnorm(model, process_group=process_group, backend=self.backend)

    @override
    def revert(self, model: Module) -> Module:
        """Give every converted layer its original class back, with the current parameters and buffers."""
        return revert_sync_batchnorm(model)
