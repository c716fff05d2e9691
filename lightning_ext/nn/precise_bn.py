"""Recompute BatchNorm running statistics as true population statistics (fvcore's ``update_bn_stats``,
behind detectron2's PreciseBN hook). Pure torch: any loop; :class:`~lightning_ext.callbacks.PreciseBN`
runs it from a Lightning Trainer."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_ext._checks import check_int
from lightning_ext._compat import BatchNormBase
from lightning_ext.distributed import all_reduce_, collective_device, get_world_size, is_distributed
from lightning_ext.kernels import merge_moments
from lightning_ext.nn.sync_batch_norm import SyncBatchNorm

__all__ = ["update_bn_stats"]


def _agree(state: float) -> float:
    """The MIN over ranks of each rank's ``state`` (1: has a batch, 0: has none, -1: failed), so that
    every rank stops, or raises, at the same batch (one tiny all_reduce when distributed)."""
    if get_world_size() <= 1:
        return state
    flag = torch.tensor([state], device=collective_device())
    all_reduce_(flag, op=dist.ReduceOp.MIN)
    return flag.item()


def update_bn_stats(
    model: nn.Module, batches: Iterable[Any], num_iter: int, forward_fn: Callable[[nn.Module, Any], Any]
) -> int:
    """Set the running statistics of ``model``'s BatchNorm layers to population statistics.

    Updated: ``_BatchNorm`` layers in training mode with ``track_running_stats`` (eval-mode ones stay
    frozen, as do other norm layers with running statistics in eval mode, e.g. ``InstanceNorm``). With
    them at ``momentum=1`` and every other module put in training mode,
    ``forward_fn(model, batch)`` runs under ``torch.no_grad()`` on up to ``num_iter`` batches; each
    layer's batch statistics are merged in float64 (Chan, Golub & LeVeque's update), weighted by
    elements per channel (``N·H·W…``), into the exact mean and UNBIASED variance (what
    ``running_var`` estimates) of all the elements it normalized, written in place in the buffers'
    dtype, whatever they held (NaN left by a diverged run included: at ``momentum=1`` BatchNorm's update
    ``0 * old + batch`` keeps a NaN, so non-finite entries are made finite first). Training flags,
    momenta and ``num_batches_tracked`` are restored, and the running statistics too when the update
    fails (an exception from ``forward_fn``, an interrupt, the error below).

    Source: fvcore ``nn/precise_bn.py`` (``update_bn_stats``), which also weighs batches by elements
    per channel but writes the biased variance and leaves modes to its caller (every difference:
    the "coming from detectron2" page).

    Distributed: ``SyncBatchNorm`` layers (ours or torch's) give statistics over their group, counts
    summed (one all_reduce per group at the end): each rank gets the union's (fvcore weighs by the
    rank's own counts: uneven ranks disagree); plain BatchNorm layers get their rank's own. Before
    each batch the ranks agree that all have one (one all_reduce, a host–device sync): no hang.

    Args:
        model: the module whose BatchNorm layers to update.
        batches: iterable of batches, already on the model's device.
        num_iter: maximum number of batches.
        forward_fn: runs the model on one batch.

    Returns:
        The number of batches used (0: nothing changed).

    Raises:
        RuntimeError: a BatchNorm layer did not run exactly once in a forward; distributed, on every
            rank at the same batch (the others name the failure as another rank's).
        TypeError: ``model`` not a module, ``batches`` not iterable, ``num_iter`` not an int, ``forward_fn``
            not callable.
        ValueError: ``num_iter < 1``.

    Example::

        >>> bn = nn.BatchNorm1d(2, momentum=0.1)
        >>> data = [torch.tensor([[0.0, 1.0], [2.0, 3.0]]), torch.tensor([[4.0, 5.0], [6.0, 7.0]])]
        >>> update_bn_stats(bn, data, num_iter=2, forward_fn=lambda m, b: m(b))
        2
        >>> bn.running_mean, bn.running_var, bn.momentum  # mean and unbiased variance of all four rows
        (tensor([3., 4.]), tensor([6.6667, 6.6667]), 0.1)
    """
    _check_arguments(model, batches, num_iter, forward_fn)
    layers = [
        m for m in model.modules() if isinstance(m, BatchNormBase) and m.training and m.track_running_stats
    ]
    if not layers:
        return 0
    with _population_mode(model, layers) as records:
        used = _run_batches(model, layers, records, batches, num_iter, forward_fn)
        if used:
            _write_population_stats(layers, records)
    return used


def _check_arguments(model: Any, batches: Any, num_iter: Any, forward_fn: Any) -> None:
    check_int("update_bn_stats", "num_iter", num_iter, ge=1)
    for name, value, ok, kind in (
        ("model", model, isinstance(model, nn.Module), "a torch.nn.Module"),
        ("batches", batches, isinstance(batches, Iterable), "an iterable of batches"),
        ("forward_fn", forward_fn, callable(forward_fn), "callable"),
    ):
        if not ok:
            raise TypeError(f"update_bn_stats: `{name}` must be {kind}, got {value!r:.80}")


def _run_batches(
    model: nn.Module,
    layers: list[BatchNormBase],
    records: list[list[_Record]],
    batches: Iterable[Any],
    num_iter: int,
    forward_fn: Callable[[nn.Module, Any], Any],
) -> int:
    """Forward up to ``num_iter`` batches while every rank has one; the number run. Before each batch
    the ranks agree (one all_reduce), so they stop, or raise, at the same batch. A layer that did not
    run exactly once in a forward fails the update."""
    used, error = 0, None
    iterator = iter(batches)
    while True:
        has_batch = used < num_iter and (batch := next(iterator, _END)) is not _END
        state = _agree(-1.0 if error else float(has_batch))
        if state < 0:  # every rank raises together: none waits in a collective for the others
            raise RuntimeError(error or "PreciseBN: a BatchNorm layer failed on another rank")
        if not state:
            return used
        with torch.no_grad():
            forward_fn(model, batch)
        used += 1
        for i, (layer, runs) in enumerate(zip(layers, records)):
            if len(runs) != used:  # raised at the next agreement, on every rank
                error = (
                    f"PreciseBN: BatchNorm layer {i} ({type(layer).__name__}) ran {len(runs) - used + 1} "
                    "times in one forward; each layer must run once"
                )
                break


_END = object()
_Record = tuple[float, torch.Tensor, torch.Tensor]  # (elements per channel, float64 running_mean, _var)


@contextlib.contextmanager
def _population_mode(model: nn.Module, layers: list[BatchNormBase]) -> Iterator[list[list[_Record]]]:
    """The mode :func:`update_bn_stats` describes, restored on exit; yields per layer the list of
    ``_Record`` its forward hook appends after each run."""
    flags = {m: m.training for m in model.modules()}
    saved = [(bn.momentum, bn.num_batches_tracked.clone()) for bn in layers]  # (track_running_stats)
    found = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in layers]
    records: list[list[_Record]] = [[] for _ in layers]
    handles = [bn.register_forward_hook(functools.partial(_record, r)) for bn, r in zip(layers, records)]
    handles += [bn.register_forward_pre_hook(_finite_running_stats) for bn in layers]
    try:
        for bn in layers:
            bn.momentum = 1.0
        model.train()
        for module, flag in flags.items():
            if isinstance(module, _NormBase) and not flag:  # BatchNorm, InstanceNorm: frozen ones stay
                module.eval()
        yield records
    except BaseException:  # a failed update (an error, an interrupt) leaves the statistics it found
        for bn, (mean, var) in zip(layers, found):
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
        raise
    finally:
        for handle in handles:
            handle.remove()
        for bn, (momentum, tracked) in zip(layers, saved):
            bn.momentum = momentum
            bn.num_batches_tracked.copy_(tracked)
        for module, flag in flags.items():
            module.training = flag


def _finite_running_stats(layer: BatchNormBase, args: tuple) -> None:
    """Make non-finite running statistics finite before a forward at ``momentum=1``, which replaces them
    by the batch's (``0 * old + batch``: a NaN left by a diverged run would stay NaN)."""
    layer.running_mean.nan_to_num_(0.0, 0.0, 0.0)
    layer.running_var.nan_to_num_(1.0, 1.0, 1.0)


def _record(runs: list[_Record], layer: BatchNormBase, args: tuple, output: Any) -> None:
    x = args[0]
    n = float(x.numel() // x.shape[1])  # (BatchNorm layers take (N, C, *) only)
    runs.append((n, layer.running_mean.double().clone(), layer.running_var.double().clone()))


def _write_population_stats(layers: list[BatchNormBase], records: list[list[_Record]]) -> None:
    """Merge each layer's batch statistics, weighted by global element counts, into its running stats
    (Chan, Golub & LeVeque's merge, :func:`lightning_ext.kernels.merge_moments`, in float64)."""
    counts = torch.tensor([[r[0] for r in runs] for runs in records], dtype=torch.float64)  # (layer, batch)
    synchronized: dict[Any, list[int]] = {}  # process group => its layers: one all_reduce of their counts
    for i, layer in enumerate(layers):
        synced = isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)) and is_distributed()
        if synced and get_world_size(layer.process_group) > 1:  # (as its forward: not outside its group)
            synchronized.setdefault(layer.process_group, []).append(i)
    for group, indices in synchronized.items():
        packed = counts[indices].to(collective_device(group))
        all_reduce_(packed, group=group)
        counts[indices] = packed.cpu()
    for layer, ns, runs in zip(layers, counts.tolist(), records):
        # Moment rows [n, mean, m2, min, max] (extremes unused) of the batches BatchNorm updated on (n > 1).
        rows = [
            F.pad(torch.stack([torch.full_like(mean, n), mean, var * (n - 1)], -1), (0, 2))
            for n, (_, mean, var) in zip(ns, runs)
            if n > 1
        ]
        if rows:
            count, mean, m2 = functools.reduce(merge_moments, rows).unbind(-1)[:3]
            layer.running_mean.copy_(mean)
            layer.running_var.copy_(m2 / (count - 1))
