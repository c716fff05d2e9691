"""Recompute BatchNorm running statistics as true population statistics (detectron2's PreciseBN)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.distributed import all_reduce_, collective_device, get_world_size, is_distributed

__all__ = ["PreciseBN", "merge_batch_statistics", "update_bn_stats"]


# ------------------------------------------------------------------------------------------------
# Pure helpers


def merge_batch_statistics(
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    n: torch.Tensor,
    batch_mean: torch.Tensor,
    batch_var: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one batch into running population moments (Chan, Golub & LeVeque's parallel update).

    Args:
        count: float64 0-dim, elements per channel so far. ``mean``/``m2``: float64 ``(C,)`` mean and
            sum of squared deviations so far.
        n: float64 0-dim, elements per channel of the batch (> 1).
        batch_mean: ``(C,)`` batch mean. ``batch_var``: ``(C,)`` UNBIASED batch variance (what
            BatchNorm writes to ``running_var`` with ``momentum=1``).

    Returns:
        The merged ``(count, mean, m2)`` in float64. No host–device synchronization.
    """
    batch_mean = batch_mean.to(torch.float64)
    batch_m2 = batch_var.to(torch.float64) * (n - 1)
    total = count + n
    delta = batch_mean - mean
    mean = mean + delta * (n / total)
    m2 = m2 + batch_m2 + delta.square() * (count * n / total)
    return total, mean, m2


def _find_bn_layers(model: nn.Module) -> list[_BatchNorm]:
    """BatchNorm layers that track running statistics and are in training mode (as fvcore)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]


def _is_synchronized(layer: _BatchNorm) -> bool:
    from lightning_ext.nn import SyncBatchNorm

    return isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)) and is_distributed()


def _agree_has_batch(has_batch: bool) -> bool:
    """True iff every rank has a batch (one tiny all_reduce MIN when distributed)."""
    if get_world_size() <= 1:
        return has_batch
    flag = torch.tensor([1.0 if has_batch else 0.0], device=collective_device())
    all_reduce_(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def update_bn_stats(
    model: nn.Module,
    batches: Iterable[Any],
    num_iter: int,
    forward_fn: Callable[[nn.Module, Any], Any],
) -> int:
    """Set the running statistics of ``model``'s BatchNorm layers to population statistics.

    Runs ``forward_fn(model, batch)`` under ``torch.no_grad()`` on up to ``num_iter`` batches, with the
    model in training mode and every updated layer's ``momentum`` set to 1 so that each forward writes
    that batch's mean and unbiased variance to ``running_mean``/``running_var`` (fvcore's
    ``update_bn_stats``). Unlike fvcore (equal weight per batch, variance = mean of the batch
    variances), the batches are merged with :func:`merge_batch_statistics`, weighted by the
    elements per channel they hold, so the result is the exact mean and unbiased variance of all
    the normalized elements, between-batch spread included. For :class:`lightning_ext.nn.SyncBatchNorm`
    (and ``torch.nn.SyncBatchNorm``) the per-batch statistics are global over its process group and
    so are the element counts (one all_reduce at the end).

    Updated layers: ``_BatchNorm`` modules in training mode with ``track_running_stats``; BatchNorm
    layers in eval mode are left untouched (fvcore's ``model.train()`` would silently update them
    with their own momentum), every other module runs in training mode as in fvcore. Afterwards
    every module's ``training`` flag, every layer's ``momentum`` and ``num_batches_tracked`` are
    restored. When distributed, every rank runs the same number of batches: before each batch the
    ranks agree (one all_reduce) that all of them have one, so synchronized layers never hang on
    uneven loaders. Synchronizes host and device once per batch (that agreement) when distributed.

    Args:
        model: the module whose BatchNorm layers to update.
        batches: iterable of batches, already on the model's device.
        num_iter: maximum number of batches.
        forward_fn: runs the model on one batch.

    Returns:
        The number of batches used (0: nothing changed).
    """
    layers = _find_bn_layers(model)
    if not layers:
        return 0
    flags = {m: m.training for m in model.modules()}
    momenta = [layer.momentum for layer in layers]
    tracked = [
        layer.num_batches_tracked.clone() if layer.num_batches_tracked is not None else None
        for layer in layers
    ]
    counts: list[list[float]] = [[] for _ in layers]  # local elements per channel, per layer and batch
    stats: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]  # (mean, var) per batch

    def count_hook(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0]
            counts[index].append(float(x.numel() // x.shape[1]) if x.dim() > 1 else 0.0)

        return hook

    handles = [layer.register_forward_pre_hook(count_hook(i)) for i, layer in enumerate(layers)]
    used = 0
    try:
        for layer in layers:
            layer.momentum = 1.0
        model.train()
        for module, flag in flags.items():  # frozen (eval-mode) BatchNorm stays frozen
            if isinstance(module, _BatchNorm) and not flag:
                module.eval()
        iterator = iter(batches)
        while used < num_iter:
            batch = next(iterator, _END)
            if not _agree_has_batch(batch is not _END):
                break
            with torch.no_grad():
                forward_fn(model, batch)
            for i, layer in enumerate(layers):
                if len(counts[i]) != len(stats[i]) + 1:
                    raise RuntimeError(
                        f"PreciseBN: BatchNorm layer {i} ({type(layer).__name__}) ran "
                        f"{len(counts[i]) - len(stats[i])} times in one forward; each layer must run once"
                    )
                stats[i].append((layer.running_mean.clone(), layer.running_var.clone()))
            used += 1
        if used:
            _write_population_stats(layers, counts, stats)
    finally:
        for handle in handles:
            handle.remove()
        for layer, momentum, n in zip(layers, momenta, tracked):
            layer.momentum = momentum
            if n is not None:
                layer.num_batches_tracked.copy_(n)
        for module, flag in flags.items():
            module.training = flag
    return used


_END = object()


def _write_population_stats(
    layers: list[_BatchNorm], counts: list[list[float]], stats: list[list[tuple[torch.Tensor, torch.Tensor]]]
) -> None:
    # Global element counts of synchronized layers: one all_reduce per distinct process group.
    count_tensors = [torch.tensor(c, dtype=torch.float64) for c in counts]
    groups: dict[Any, list[int]] = {}
    for i, layer in enumerate(layers):
        if _is_synchronized(layer):
            groups.setdefault(getattr(layer, "process_group", None), []).append(i)
    for group, indices in groups.items():
        packed = torch.stack([count_tensors[i] for i in indices]).to(collective_device(group))
        all_reduce_(packed, group=group)
        for row, i in zip(packed.cpu(), indices):
            count_tensors[i] = row
    for i, layer in enumerate(layers):
        device = layer.running_mean.device
        count = torch.zeros((), dtype=torch.float64, device=device)
        mean = torch.zeros(layer.running_mean.shape, dtype=torch.float64, device=device)
        m2 = torch.zeros_like(mean)
        for n, (batch_mean, batch_var) in zip(count_tensors[i].tolist(), stats[i]):
            if n <= 1:
                continue  # BatchNorm does not update (or rejects) such batches
            count, mean, m2 = merge_batch_statistics(
                count, mean, m2, torch.tensor(n, dtype=torch.float64, device=device), batch_mean, batch_var
            )
        if not stats[i] or all(n <= 1 for n in count_tensors[i].tolist()):
            continue
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(m2 / (count - 1))


def _default_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


# ------------------------------------------------------------------------------------------------
# The hook


class PreciseBN(HookBase):
    """Recompute BatchNorm running statistics with true population averages during training.

    BatchNorm's running statistics are an exponential moving average over batches whose model
    weights kept changing, which can differ markedly from the statistics of the final weights;
    PreciseBN (Wu & Johnson, "Rethinking 'Batch' in BatchNorm", 2021; detectron2
    ``hooks.PreciseBN`` / fvcore ``update_bn_stats``) re-estimates them with frozen weights over
    ``num_iter`` batches. See :func:`update_bn_stats` for the exact procedure (population mean and
    unbiased variance weighted by batch size, synchronized statistics for
    :class:`lightning_ext.nn.SyncBatchNorm`, every rank running the same number of batches,
    training flags, momenta and ``num_batches_tracked`` restored).

    When: with ``period=None`` after the last iteration of each training epoch (before the
    end-of-epoch validation runs, so validation sees the new statistics); with ``period=k`` after
    every ``k``-th iteration; and in any case at the end of a successful training run if the
    statistics are older than the last iteration. Never after a failed run (``after_train`` with an
    exception), because the forwards of synchronized layers are collectives.

    Data: ``data_loader`` is an iterable of batches, or a zero-argument callable returning one (called
    at each update); ``None`` reuses ``trainer.train_dataloader`` (with its distributed sampler).
    Batches are moved to the device by the strategy (``batch_to_device``) and the forward runs under
    the precision plugin's ``forward_context()`` (autocast as in training). With ``period`` set and a
    DataLoader using ``persistent_workers=True``, pass a separate loader: restarting the training
    loader mid-epoch would reset its workers. ``forward_fn(pl_module, batch)`` runs the model; by
    default ``pl_module(batch[0])`` for tuple/list batches and ``pl_module(batch)`` otherwise.
    Values ``report()``-ed inside the forward are reported as in any forward.

    Args:
        period: iterations between updates, or ``None`` for once per epoch.
        num_iter: number of batches per update (fewer if the loader runs out; a warning says so).
        data_loader: iterable or zero-argument callable returning an iterable, or ``None``.
        forward_fn: ``(pl_module, batch) -> Any``; ``None`` for the default above.

    Raises:
        ValueError: ``period`` or ``num_iter`` is not a positive int.
        TypeError: ``data_loader`` is neither iterable nor callable, a callable ``data_loader``
            returned a non-iterable, or ``forward_fn`` is not callable.

    Example::

        >>> bn = nn.BatchNorm1d(2, momentum=0.1)
        >>> data = [torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[4.0, 5.0], [6.0, 7.0]])]
        >>> update_bn_stats(bn, data, num_iter=2, forward_fn=lambda m, b: m(b))
        2
        >>> bn.running_mean, bn.running_var  # mean and unbiased variance of all four rows
        (tensor([3., 4.]), tensor([6.6667, 6.6667]))
        >>> bn.momentum
        0.1
        >>> hook = PreciseBN(period=100, num_iter=50, data_loader=data)
    """

    def __init__(
        self,
        period: int | None = None,
        num_iter: int = 200,
        data_loader: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
        forward_fn: Callable[[pl.LightningModule, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        if period is not None and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
            raise ValueError(
                f"PreciseBN: `period` must be a positive int or None (every epoch), got {period!r}"
            )
        if isinstance(num_iter, bool) or not isinstance(num_iter, int) or num_iter < 1:
            raise ValueError(f"PreciseBN: `num_iter` must be a positive int, got {num_iter!r}")
        if data_loader is not None and not callable(data_loader) and not isinstance(data_loader, Iterable):
            raise TypeError(
                "PreciseBN: `data_loader` must be an iterable of batches, a zero-argument callable "
                f"returning one, or None (the training loader), got {data_loader!r}"
            )
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"PreciseBN: `forward_fn` must be callable or None, got {forward_fn!r}")
        self.period = period
        self.num_iter = num_iter
        self.data_loader = data_loader
        self.forward_fn = forward_fn
        self._last_update_step: int | None = None  # trainer.global_step of the last update
        #: number of batches used by each update so far (for inspection).
        self.batches_used: list[int] = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_update_step": self._last_update_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_update_step = state_dict["last_update_step"]

    def _loader(self) -> Iterable[Any]:
        if self.data_loader is None:
            return self.trainer.train_dataloader
        loader = self.data_loader() if callable(self.data_loader) else self.data_loader
        if not isinstance(loader, Iterable):
            raise TypeError(f"PreciseBN: `data_loader()` must return an iterable of batches, got {loader!r}")
        return loader

    def update_stats(self) -> int:
        """Run the update now on every rank (collectives when distributed); returns the batches used."""
        trainer, module = self.trainer, self.pl_module
        strategy = trainer.strategy
        forward = self.forward_fn or _default_forward
        batches = (
            strategy.batch_to_device(batch) for batch in itertools.islice(self._loader(), self.num_iter)
        )

        def run(model: nn.Module, batch: Any) -> Any:
            with strategy.precision_plugin.forward_context():
                return forward(model, batch)

        used = update_bn_stats(module, batches, self.num_iter, run)
        self._last_update_step = trainer.global_step
        self.batches_used.append(used)
        if used < self.num_iter:
            rank_zero_warn(
                f"PreciseBN: only {used} of num_iter={self.num_iter} batches were available on every rank"
            )
        return used

    @override
    def after_step(self) -> None:
        if self.period is None:
            due = self.trainer.is_last_batch
        else:
            due = (self._iter + 1) % self.period == 0
        if due:
            self.update_stats()

    @override
    def after_train(self) -> None:
        if self.exception is None and self._last_update_step != self.trainer.global_step:
            self.update_stats()
