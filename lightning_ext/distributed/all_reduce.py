"""``all_reduce_``: the one place that decides how a small reduction travels between ranks.

The pack reduces a few hundred numbers at a time (SyncBatchNorm, ``Collector``, the loss scaler),
where a collective's latency is the cost: between CPU ranks of one host they go through a
shared-memory segment (:mod:`lightning_ext.distributed.shm`), everything else through the process
group's own ``all_reduce``.

Under ``torch.compile`` a reduction always takes the process group's ``all_reduce``, which dynamo
traces as a functional collective (a graph node that inductor schedules, ``fullgraph=True``
included). The shared-memory path cannot be traced: it is host code that spins on flags in a mapped
file, and hidden in an opaque custom op it would give the compiler a reduction without collective
semantics, free to reorder against other collectives. Eager and compiled reductions over one group
may alternate: each collective is matched on one transport, as every rank runs the same program.
"""

from __future__ import annotations

import os
import platform
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ext.distributed import shm
from lightning_ext.distributed.groups import collective_device

__all__ = ["SHM_ENV_VAR", "all_reduce_", "close_shared_memory", "shm_available"]

SHM_ENV_VAR = "LIGHTNING_EXT_SHM_COLLECTIVES"  # "0" turns the shared-memory path off (on every rank)
_X86 = platform.machine().lower() in ("x86_64", "amd64")  # total store order: see shm's docstring

_routes: weakref.WeakKeyDictionary[Any, _Route] = weakref.WeakKeyDictionary()
_routes_lock = threading.Lock()  # process group -> how its reductions travel, decided once


class _Done:
    """The completed work handle ``async_op=True`` returns when :func:`all_reduce_` reduced itself."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class _Route:
    device: torch.device  # the group's collective device
    segment: shm._ShmGroup | None  # its shared-memory segment, or None: the group's own all_reduce


def _route(group: Any) -> _Route:
    """How reductions over ``group`` travel, decided at its first reduction (a collective, once).

    A shared-memory segment exactly for a gloo group of several ranks all on this host (the set-up
    maps one ``/dev/shm`` file on every rank or gives up on all), on x86-64, unless
    ``LIGHTNING_EXT_SHM_COLLECTIVES=0``: every rank decides alike. :func:`all_reduce_` then sends a
    strided CPU tensor of at most ``shm._SLOT_BYTES`` bytes reduced by ``SUM``, ``MAX``, ``MIN`` or
    ``PRODUCT`` through the segment, outside ``torch.compile`` tracing.
    """
    route = _routes.get(group)
    if route is None:
        capable = (
            _X86
            and os.environ.get(SHM_ENV_VAR, "1") != "0"
            and dist.get_world_size(group) > 1
            and "gloo" in str(dist.get_backend(group)).lower()
        )
        route = _Route(collective_device(group), shm._create(group) if capable else None)
        with _routes_lock:
            _routes[group] = route
    return route


def all_reduce_(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed.all_reduce`` of ``tensor`` in place, on any device, by the fastest transport.

    Same contract as ``torch.distributed.all_reduce``: every rank of ``group`` calls it in the same
    order with a tensor of the same shape and dtype. A tensor off the group's collective device (e.g.
    CUDA with gloo) is reduced through a copy there. On the shared-memory path (see ``_route``)
    ranks reduce in rank order: the result is bitwise identical on every rank (it may differ from
    gloo's in the last bits). The first call on a group decides its route (setting a segment up: four
    collectives, once). While ``torch.compile`` traces, it is the process group's ``all_reduce``
    (see the module docstring; ``async_op`` then reduces at once and returns a completed handle), on
    a ``tensor`` on a device of the group's backend.

    Args:
        tensor: any shape and dtype; reduced in place.
        op: ``torch.distributed.ReduceOp``.
        group: process group (default: WORLD).
        async_op: return a handle with ``wait()`` (already completed on the shared-memory path).

    Returns:
        ``None``, or the work handle when ``async_op``.

    Raises:
        RuntimeError: a rank did not join within the group's timeout, or its process exited
            (shared memory), naming the ranks; or what ``torch.distributed.all_reduce`` raises.

    Synchronizes host and device only when ``tensor`` must move to the collective device.
    """
    group = group if group is not None else dist.group.WORLD
    if torch.compiler.is_compiling():
        dist.all_reduce(tensor, op=op, group=group)  # traced as a functional collective
        return _Done() if async_op else None
    route = _route(group)
    if tensor.device != route.device:
        moved = tensor.to(route.device)
        all_reduce_(moved, op, group)
        tensor.copy_(moved)
        return _Done() if async_op else None
    fits = tensor.layout == torch.strided and tensor.numel() * tensor.element_size() <= shm._SLOT_BYTES
    if route.segment is None or not fits or op not in shm._OPS:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if tensor.numel():
        route.segment.all_reduce_(tensor, op)
    return _Done() if async_op else None


def shm_available(group: dist.ProcessGroup | None = None) -> bool:
    """Whether :func:`all_reduce_` of a small float tensor over ``group`` takes the shared-memory path
    (``False`` when not distributed). Like :func:`all_reduce_`, the first call on a group is a
    collective. No host sync."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = group if group is not None else dist.group.WORLD
    return _route(group).segment is not None


def close_shared_memory() -> None:
    """Close the shared-memory segments of :func:`all_reduce_` (each is unmapped once no reduction
    holds it) and forget every group's route. Local, no collective, but call it on every rank: the
    next reduction over a group decides its route again (a collective) and sets a segment up anew."""
    with _routes_lock:
        _routes.clear()
