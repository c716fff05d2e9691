"""``all_reduce_``: the one place that decides how a small reduction travels between ranks.

The pack reduces a few hundred numbers at a time (SyncBatchNorm, ``Collector``, the loss scaler),
where a collective's latency is the cost: between CPU ranks of one host they go through a
shared-memory segment (:mod:`lightning_ext.distributed.shm`), everything else through the process
group's own ``all_reduce``. Both check that the ranks reduce alike (``shm``: a header; the process
group: :mod:`lightning_ext.distributed.agreement`).

Under ``torch.compile`` a reduction always takes the process group's ``all_reduce``, which dynamo
traces as a functional collective (a graph node that inductor schedules, ``fullgraph=True``
included). The shared-memory path cannot be traced: it is host code that spins on flags in a mapped
file, and hidden in an opaque custom op it would give the compiler a reduction without collective
semantics, free to reorder against other collectives. Neither check runs there (it is host code
too), and a MAX or MIN keeps NaNs as the backend does. Eager and compiled reductions over one group
may alternate: each collective is matched on one transport, as every rank runs the same program.

Outside tracing, a floating MAX or MIN keeps a NaN of any rank where it is, on both transports (the
process group's own keeps it from rank 0 only, with gloo): there one flag element rides along, and only
when a rank holds a NaN, a second reduction places them (``_keeping_nans``).
"""

from __future__ import annotations

import math
import os
import platform
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ext._compat import group_timeout
from lightning_ext.distributed import shm
from lightning_ext.distributed.agreement import _Agreement, _check_agreement, _descriptor
from lightning_ext.distributed.groups import collective_device

__all__ = [
    "CHECK_ENV_VAR", "SHM_ENV_VAR", "all_reduce_", "close_shared_memory", "collective_seconds",
    "shm_available",
]  # fmt: skip

SHM_ENV_VAR = "LIGHTNING_EXT_SHM_COLLECTIVES"  # off on any rank: every rank takes the process group
CHECK_ENV_VAR = "LIGHTNING_EXT_CHECK_COLLECTIVES"  # on on any rank: the process group checks every reduction
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")  # a switch's words (stripped, any case)
_X86 = platform.machine().lower() in ("x86_64", "amd64")  # total store order: see shm's docstring

_waited = [0.0]  # host seconds spent inside all_reduce_ by this process (see collective_seconds)
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
    agreement: _Agreement | None = None  # the process-group path's check (None: a segment, a group of one)


def _switch(value: str | None, default: bool) -> bool | None:
    """An environment variable's value as a switch: unset or empty is ``default``; ``None``: not allowed."""
    value = (value or "").strip().lower()
    return default if not value else True if value in _ON else False if value in _OFF else None


def _settings(group: Any, device: torch.device) -> tuple[bool, bool]:
    """Collective (one MIN all_reduce): whether every rank can take shared memory, and whether any rank
    asks for every process-group reduction to be checked. Raises ``ValueError`` on every rank when a
    switch has a value that is not allowed on any rank (after the collective: every rank joins it)."""
    shm_on = _switch(os.environ.get(SHM_ENV_VAR), True)
    check = _switch(os.environ.get(CHECK_ENV_VAR), False)
    capable = _X86 and bool(shm_on) and "gloo" in str(dist.get_backend(group)).lower()
    valid = None not in (shm_on, check)
    votes = torch.tensor([capable, check is not True, valid], dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    capable, unchecked, valid = votes.tolist()
    if not valid:
        _raise_invalid_switches(group)
    return bool(capable), not unchecked


def _raise_invalid_switches(group: Any) -> None:
    """Every rank: gather every rank's switches (one all_gather_object) and raise naming the bad ones."""
    mine = [os.environ.get(SHM_ENV_VAR), os.environ.get(CHECK_ENV_VAR)]
    values = [mine] * dist.get_world_size(group)
    dist.all_gather_object(values, mine, group=group)
    bad = [
        f"rank {dist.get_global_rank(group, r)}: {name}={value!r}"
        for r, pair in enumerate(values)
        for name, value in zip((SHM_ENV_VAR, CHECK_ENV_VAR), pair)
        if _switch(value, False) is None
    ]
    raise ValueError(
        f"all_reduce_: environment variables with values not allowed ({'; '.join(bad)}): {SHM_ENV_VAR} and "
        f"{CHECK_ENV_VAR} must be unset, empty, or one of 1, true, on, yes, 0, false, off, no (any case)."
    )


def _route(group: Any) -> _Route:
    """How reductions over ``group`` travel, decided at its first reduction (a collective, once).

    A shared-memory segment exactly for a gloo group of several ranks all on this host (the set-up
    maps one ``/dev/shm`` file on every rank or gives up on all), on x86-64, unless
    ``LIGHTNING_EXT_SHM_COLLECTIVES`` turns it off on any rank: every rank decides alike (one MIN
    all_reduce, which also agrees on ``LIGHTNING_EXT_CHECK_COLLECTIVES``). Its waits end with the
    group's timeout.
    """
    route = _routes.get(group)
    if route is None:
        device, world_size = collective_device(group), dist.get_world_size(group)
        capable, check_every = _settings(group, device)
        segment = shm._create(group, group_timeout(group, device)) if world_size > 1 and capable else None
        agreement = _Agreement(device, check_every) if world_size > 1 and segment is None else None
        route = _Route(device, segment, agreement)
        with _routes_lock:
            _routes[group] = route
    return route


def all_reduce_(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed.all_reduce`` of ``tensor`` in place, on any device, by the fastest transport,
    checking that every rank reduces alike.

    Same contract as ``torch.distributed.all_reduce`` (same order, element count, dtype and ``op`` on
    every rank; a tensor that requires grad is reduced in place outside autograd, as c10d does); a
    disagreement raises on every rank, before anything is reduced, instead of aborting or hanging. A
    tensor off the collective device, or not contiguous (gloo mis-reduces a strided one), is reduced
    through a contiguous copy there. Transports (the same for the same call on every rank):

    - shared memory, between the CPU ranks of one host of a gloo group (``_route``): every call checks
      a descriptor (op, dtype, layout, element count) in the segment's header; at most 128 KiB reduced
      by SUM, MAX, MIN or PRODUCT is reduced in the segment in rank order (bitwise identical on every
      rank; with 3+ ranks a float sum's last bits may differ from the process group's, which adds in
      its own order), anything else by the process group once the header agreed.
    - the process group's ``all_reduce``, checked as :mod:`lightning_ext.distributed.agreement` says
      (steady state: one ``all_reduce`` of the tensor staged with one flag element), reduced before
      the call returns, ``async_op`` included; a floating MAX or MIN keeps a NaN of any rank (module
      docstring).

    The first call on a group decides its route (one collective; a segment's set-up: four more, once).
    Under ``torch.compile`` tracing: the process group's ``all_reduce``, unchecked (module docstring).
    Waits end with the group's timeout.

    Args:
        tensor: any shape and dtype; reduced in place.
        op: ``torch.distributed.ReduceOp`` (``ReduceOp.MAX`` or an instance ``ReduceOp(ReduceOp.MAX)``).
        group: process group (default: WORLD); on a rank outside it
            (``torch.distributed.GroupMember.NON_GROUP_MEMBER``), nothing is done, as by torch.
        async_op: return a handle with ``wait()`` (completed, but for a tensor beyond a shm slot).

    Returns:
        ``None``, or the work handle when ``async_op``.

    Raises:
        RuntimeError: on every rank, when the ranks disagree on the op, dtype, layout or element count,
            naming each rank's; a rank did not join within the group's timeout, or its process exited
            (shared memory), naming the ranks; or what ``torch.distributed.all_reduce`` raises.
        ValueError: on every rank, at a group's first reduction, when ``LIGHTNING_EXT_SHM_COLLECTIVES``
            or ``LIGHTNING_EXT_CHECK_COLLECTIVES`` has a value other than unset, empty, 1, true, on,
            yes, 0, false, off or no on any rank, naming the ranks and values.

    Synchronizes host and device when ``tensor`` must move to the collective device, and on the
    process-group path at every reduction (a host read of the flag or the check).
    """
    group = group if group is not None else dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # this rank is outside the group: as torch, nothing
        return _Done() if async_op else None
    if torch.compiler.is_compiling():
        dist.all_reduce(tensor, op=op, group=group)  # traced as a functional collective
        return _Done() if async_op else None
    start = time.perf_counter()
    try:
        return _all_reduce(tensor, op, group, async_op)
    finally:
        _waited[0] += time.perf_counter() - start


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
    """:func:`all_reduce_` outside ``torch.compile`` tracing."""
    if type(op) is dist.ReduceOp and op.op != dist.ReduceOp.PREMUL_SUM:  # ReduceOp(MAX): compares
        op = op.op  # unequal to ReduceOp.MAX, the op type every check and table here knows
    tensor = tensor.detach() if tensor.requires_grad else tensor  # (in place through the same storage)
    route = _route(group)
    strided = tensor.layout == torch.strided and not tensor.is_contiguous()  # (gloo mis-reduces one)
    if tensor.device != route.device or strided:  # through a contiguous copy there, written back
        staged = tensor.to(route.device).contiguous()
        _all_reduce(staged, op, group, False)
        tensor.copy_(staged)
        return _Done() if async_op else None
    if route.segment is not None:
        descriptors = route.segment.all_reduce_(tensor, op, _descriptor(tensor, op))
        _check_agreement(descriptors, group, "shared memory")
        if shm._fits(tensor, op):
            return _Done() if async_op else None
        if not _drops_nans(tensor, op):
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        _keeping_nans(tensor, op, lambda buffer, staged: dist.all_reduce(buffer, op=op, group=group))
    elif route.agreement is not None:
        def reduce(buffer: torch.Tensor, staged: bool = False) -> None:  # (staged: named as the caller's)
            route.agreement.all_reduce_(buffer, op, _descriptor(buffer, op, staged), group)

        if _drops_nans(tensor, op):
            _keeping_nans(tensor, op, reduce)
        else:
            reduce(tensor)
    else:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _Done() if async_op else None


def _drops_nans(tensor: torch.Tensor, op: Any) -> bool:
    """Whether the process group's reduction of ``tensor`` by ``op`` may drop a NaN: a floating MAX or MIN."""
    return op in _NAN_FLAG and tensor.is_floating_point()


_NAN_FLAG = {dist.ReduceOp.MAX: 1, dist.ReduceOp.MIN: -1}  # a rank's "I hold a NaN", as the op keeps it


def _keeping_nans(tensor: torch.Tensor, op: Any, reduce: Any) -> None:
    """A floating ``tensor`` reduced by MAX or MIN through ``reduce(buffer, staged)`` (the process group's
    reduction in place; ``staged``: ``tensor`` with a flag element), a NaN of any rank kept where it is,
    as the shared-memory path keeps it (``torch.maximum``): gloo keeps it only from rank 0, and NCCL's
    comparisons may drop it. The flag element rides along (one host read); when a rank flagged, a second
    reduction of the ranks' NaN masks places them."""
    flat, flag = tensor.reshape(-1), _NAN_FLAG[op]
    nans = torch.isnan(flat)
    staged = torch.cat((flat, (nans.any() * flag).to(flat.dtype).reshape(1)))
    reduce(staged, True)
    result = staged[:-1]
    if staged[-1].item() != 0:  # the same on every rank: the second reduction is everyone's
        mask = (nans * flag).to(flat.dtype)
        reduce(mask, False)
        result = result.masked_fill(mask != 0, math.nan)
    tensor.copy_(result.view_as(tensor))


def shm_available(group: dist.ProcessGroup | None = None) -> bool:
    """Whether :func:`all_reduce_` of a small float tensor over ``group`` takes the shared-memory path
    (``False`` when not distributed, or on a rank outside ``group``). Like :func:`all_reduce_`, the
    first call on a group is a collective, which raises its ``ValueError`` for a switch's value. No
    host sync."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = group if group is not None else dist.group.WORLD
    return group is not dist.GroupMember.NON_GROUP_MEMBER and _route(group).segment is not None


def close_shared_memory() -> None:
    """Close the shared-memory segments of :func:`all_reduce_` (each is unmapped once no reduction
    holds it) and forget every group's route. Local, no collective, but call it on every rank: the
    next reduction over a group decides its route again (a collective) and sets a segment up anew."""
    with _routes_lock:
        _routes.clear()


def collective_seconds() -> float:
    """Host seconds this process has spent inside :func:`all_reduce_` so far (monotonic, all groups).

    The difference of two readings is the time a stretch of code spent reducing or waiting for
    the other ranks in the package's own collectives (SyncBatchNorm, the statistics flush, the loss
    scaler): subtracted from the stretch's wall time, it leaves the time this rank computed, which
    names a slow rank even when the fast ones wait for it inside a collective
    (:class:`~lightning_ext.callbacks.IterationTimer`'s ``Timing/compute_sec``). Not counted: the
    reductions of a compiled graph, collectives outside the package (DDP's gradient all-reduce), and
    the device-side wait of an asynchronous CUDA (NCCL) reduction. No host sync.
    """
    return _waited[0]
