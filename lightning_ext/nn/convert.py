"""Convert batch-norm layers to :class:`SyncBatchNorm` and back, losslessly.

``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` has no inverse, and Lightning's
``TorchSyncBatchNorm.revert`` turns every layer into a private ``_BatchNormXd`` because the original
class is lost. Here each converted layer keeps a *template* of the layer it replaced: a shallow
copy of the original module with its parameters, buffers and children removed (so it holds no
tensor, follows no ``.to()`` and never appears in ``state_dict``). :func:`revert_sync_batchnorm`
copies the template again and gives it the converted layer's CURRENT parameters and buffers (the
same tensor objects, after any ``.to(device)`` or ``load_state_dict``), training flag and children,
so ``BatchNorm2d`` comes back as ``BatchNorm2d`` and a user's subclass keeps its class and attributes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_ext.nn.sync_batch_norm import SyncBatchNorm, warm_backend

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm"]

_TEMPLATE_ATTR = "_lightning_ext_original"  # attribute of a converted layer holding its template
_CONVERTIBLE = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _strip(module: nn.Module) -> nn.Module:
    """Shallow copy of ``module`` without parameters, buffers or children (a class + attribute template)."""
    template = copy.copy(module)
    template.__dict__ = dict(module.__dict__)
    template._parameters = {}
    template._buffers = {}
    template._modules = {}
    template._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return template


class _BatchNormXd(_BatchNorm):
    """Local batch norm accepting any ``(N, C, *)`` input: what a layer built as SyncBatchNorm reverts to."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, *), got shape {tuple(input.shape)}")


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    backend: str | None = None,
) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` and ``torch.nn.SyncBatchNorm`` in ``module`` by ours.

    Parameters and buffers are SHARED with the original layers (the same tensor objects), and
    ``training`` and ``qconfig`` are copied. Layers that already are :class:`SyncBatchNorm` are left
    as they are (their ``process_group``/``backend`` are not changed). Works recursively; when
    ``module`` itself is a batch-norm layer a new module is returned. No collective, no host sync.

    Args:
        module: any module (e.g. a LightningModule).
        process_group: group whose ranks share statistics (default: WORLD).
        backend: kernel backend name for the converted layers (default: auto).

    Returns:
        ``module`` with converted children, or the converted layer when ``module`` is one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or ``backend`` is not a string.

    Example::

        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
        >>> net = convert_sync_batchnorm(net)
        >>> type(net[1]).__name__
        'SyncBatchNorm'
        >>> type(revert_sync_batchnorm(net)[1]).__name__
        'BatchNorm2d'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"`backend` must be a kernel backend name (str) or None, got {backend!r}")
    converted = module
    if isinstance(module, _CONVERTIBLE) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group=process_group,
            device="meta",
            backend=backend,
        )
        _share_state(module, converted)
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        warm_backend(backend, tensors[0].device if tensors else None)
        object.__setattr__(converted, _TEMPLATE_ATTR, _strip(module))
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group, backend))
    return converted


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` gets its ORIGINAL class back.

    The restored layer is a copy of the original (same class and attributes, e.g. a
    ``torch.nn.SyncBatchNorm`` keeps its ``process_group``) holding the converted layer's current
    parameters and buffers (shared tensor objects), training flag and ``qconfig``. A
    :class:`SyncBatchNorm` that was built directly (not converted) becomes a local batch norm
    accepting any ``(N, C, *)`` input. ``revert(convert(m))`` has an identical ``state_dict`` and
    identical outputs. No collective, no host sync.

    Args:
        module: any module.

    Returns:
        ``module`` with reverted children, or the reverted layer when ``module`` is one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r}")
    reverted = module
    if isinstance(module, SyncBatchNorm):
        template = module.__dict__.get(_TEMPLATE_ATTR)
        if template is not None:
            reverted = _strip(template)
        else:
            reverted = _BatchNormXd(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                device="meta",
            )
        _share_state(module, reverted)
        if hasattr(module, "qconfig"):
            reverted.qconfig = module.qconfig
    for name, child in module.named_children():
        reverted.add_module(name, revert_sync_batchnorm(child))
    return reverted


def _share_state(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the parameters and buffers of ``source`` (same objects) and its training flag."""
    target._parameters = dict(source._parameters)
    target._buffers = dict(source._buffers)
    target._non_persistent_buffers_set = set(source._non_persistent_buffers_set)
    target.train(source.training)
