"""Convert batch-norm layers to :class:`SyncBatchNorm` and back, losslessly.

Unlike ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (no inverse) and Lightning's
``TorchSyncBatchNorm.revert`` (a private ``_BatchNormXd`` class), each converted layer keeps a
*template* of the layer it replaced: a shallow copy without parameters, buffers or children (it holds
no tensor, follows no ``.to()`` and is not in ``state_dict``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ext._compat import BatchNormBase, module_tables, set_module_tables
from lightning_ext.nn.sync_batch_norm import SyncBatchNorm, _warm_backend

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm"]

_TEMPLATE_ATTR = "_lightning_ext_original"  # attribute of a converted layer holding its template
_SETTINGS = ("num_features", "eps", "momentum", "affine", "track_running_stats")  # a batch norm's own


def _strip(module: nn.Module) -> nn.Module:
    """Shallow copy of ``module`` without parameters, buffers or children (a class + attribute template)."""
    template = copy.copy(module)
    template.__dict__ = dict(module.__dict__)
    set_module_tables(template, {}, {}, module_tables(module)[2], children={})
    return template


def _bn_args(module: BatchNormBase) -> tuple[Any, ...]:
    """The positional constructor arguments of a batch-norm layer like ``module``: its settings."""
    return tuple(getattr(module, name) for name in _SETTINGS)


def _share_state(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the parameters, buffers (same objects), hooks (the same tables: a hook registered
    on either is on both, such as quantization-aware training's observers), training flag and
    ``qconfig`` of ``source``."""
    set_module_tables(target, *module_tables(source))
    target.__dict__.update({k: v for k, v in vars(source).items() if k.startswith("_") and "hook" in k})
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


class _BatchNormXd(BatchNormBase):
    """Local batch norm accepting any ``(N, C, *)`` input: what a layer built as SyncBatchNorm reverts to."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, *), got shape {tuple(input.shape)}")


def _check_convertible(module: Any, backend: Any) -> None:
    """The ``TypeError`` of :func:`convert_sync_batchnorm` for ``module`` and ``backend``, if any."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"`backend` must be a kernel backend name (str) or None, got {backend!r}")
    if isinstance(module, torch.jit.ScriptModule) and any(
        "BatchNorm" in getattr(m, "original_name", "") for m in module.modules()
    ):  # (its layers are compiled: none would be converted, silently)
        raise TypeError(
            f"convert_sync_batchnorm: {type(module).__name__} {getattr(module, 'original_name', '')!r} is a "
            "TorchScript module holding batch norms, which cannot be replaced. HINT: convert the model "
            "before torch.jit.script"
        )


def convert_sync_batchnorm(
    module: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    backend: str | None = None,
) -> nn.Module:
    """Replace every batch-norm layer in ``module`` by ours, recursively: every instance of torch's
    ``_BatchNorm`` (``BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm``, their subclasses and your own
    subclasses of ``_BatchNorm``), as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does.

    Parameters, buffers and hooks are SHARED with the original layers (the same tensor objects and
    hook tables: a hook registered on either layer fires on both); ``training`` and ``qconfig`` are
    copied. A subclass's own ``forward`` (an activation fused into the layer)
    gives way to :class:`SyncBatchNorm`'s, as with torch's converter; :func:`revert_sync_batchnorm`
    gives it back. Layers that already are :class:`SyncBatchNorm` are left as they are; a layer used
    under several names becomes one layer (torch's converter converts its first name only). No
    collective, no host sync.

    Args:
        module: any module (e.g. a LightningModule).
        process_group: group whose ranks share statistics (default: WORLD).
        backend: kernel backend name for the converted layers (default: auto).

    Returns:
        ``module`` with converted children, or a new layer when ``module`` itself is a batch norm.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``backend`` is not a string, or a TorchScript
            module (``torch.jit.script``) holds batch norms (none could be replaced).
        ValueError: a lazy batch norm (``LazyBatchNorm2d``, ...) has not seen an input yet (its
            parameters are not made: run one forward pass first).

    Example::

        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
        >>> net = convert_sync_batchnorm(net)
        >>> type(net[1]).__name__
        'SyncBatchNorm'
        >>> type(revert_sync_batchnorm(net)[1]).__name__
        'BatchNorm2d'
    """
    return _convert(module, process_group, backend, {})


def _convert(module: nn.Module, process_group: Any, backend: Any, done: dict[int, nn.Module]) -> nn.Module:
    """:func:`convert_sync_batchnorm` of ``module``; ``done``: the modules converted so far, by id (a
    layer used under two names stays one layer)."""
    if id(module) in done:
        return done[id(module)]
    _check_convertible(module, backend)
    converted = done[id(module)] = module
    if isinstance(module, BatchNormBase) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(
                f"convert_sync_batchnorm: the lazy layer {module!r} has not seen an input yet, so it has "
                "no parameters to share. HINT: run one forward pass of the model first"
            )
        converted = SyncBatchNorm(
            *_bn_args(module), process_group=process_group, device="meta", backend=backend
        )
        _share_state(module, converted)
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        _warm_backend(backend, tensors[0].device if tensors else None)
        object.__setattr__(converted, _TEMPLATE_ATTR, _strip(module))
        done[id(module)] = converted
    for name, child in list(module._modules.items()):  # (every name: named_children skips a repeat)
        if child is not None:
            converted.add_module(name, _convert(child, process_group, backend, done))
    return converted


def revert_sync_batchnorm(module: nn.Module, layers: Collection[nn.Module] | None = None) -> nn.Module:
    """Undo :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` gets its ORIGINAL class back.

    The restored layer is a copy of the original (same class and attributes) holding the converted
    layer's current settings (``eps``, ``momentum``, ``track_running_stats``, ..., as a schedule or
    Lightning's ``BaseFinetuning.freeze`` left them), parameters and buffers (shared tensor objects,
    after any ``.to()`` or ``load_state_dict``), hooks (those registered while converted too),
    training flag and ``qconfig``; ``revert(convert(m))``
    has an identical ``state_dict`` and outputs. A :class:`SyncBatchNorm` built directly becomes a
    local batch norm accepting any ``(N, C, *)`` input. No collective, no host sync.

    Args:
        module: any module.
        layers: revert only these :class:`SyncBatchNorm` layers (e.g. those one conversion made, not
            the ones the model was built with); ``None``: every one.

    Returns:
        ``module`` with reverted children, or the reverted layer when ``module`` is one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"`module` must be a torch.nn.Module, got {module!r}")
    return _revert(module, layers, {})


def _revert(module: nn.Module, layers: Collection[nn.Module] | None, done: dict[int, nn.Module]) -> nn.Module:
    """:func:`revert_sync_batchnorm` of ``module``; ``done``: the modules reverted so far, by id."""
    if id(module) in done:
        return done[id(module)]
    reverted = done[id(module)] = module
    if isinstance(module, SyncBatchNorm) and (layers is None or module in layers):
        template = module.__dict__.get(_TEMPLATE_ATTR)
        reverted = (
            _strip(template) if template is not None else _BatchNormXd(*_bn_args(module), device="meta")
        )
        for name in _SETTINGS:  # (as they are now)
            setattr(reverted, name, getattr(module, name))
        _share_state(module, reverted)
        done[id(module)] = reverted
    for name, child in list(module._modules.items()):  # (every name: named_children skips a repeat)
        if child is not None:
            reverted.add_module(name, _revert(child, layers, done))
    return reverted
