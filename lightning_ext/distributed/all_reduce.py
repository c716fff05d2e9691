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
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_ext._compat import group_timeout
from lightning_ext.distributed import shm
from lightning_ext.distributed.groups import collective_device

__all__ = ["SHM_ENV_VAR", "all_reduce_", "close_shared_memory", "collective_seconds", "shm_available"]

SHM_ENV_VAR = "LIGHTNING_EXT_SHM_COLLECTIVES"  # "0" on any rank turns the shared-memory path off
_X86 = platform.machine().lower() in ("x86_64", "amd64")  # total store order: see shm's docstring
_AGREED_MAX = 4096  # descriptors a process-group route remembers as agreed (then it forgets them all)

_waited = [0.0]  # host seconds spent inside all_reduce_ by this process (see collective_seconds)
_routes: weakref.WeakKeyDictionary[Any, _Route] = weakref.WeakKeyDictionary()
_routes_lock = threading.Lock()  # process group -> how its reductions travel, decided once

_R = dist.ReduceOp
_OP_NAMES = {_R.SUM: "SUM", _R.PRODUCT: "PRODUCT", _R.MIN: "MIN", _R.MAX: "MAX", _R.BAND: "BAND",
             _R.BOR: "BOR", _R.BXOR: "BXOR", _R.AVG: "AVG"}  # fmt: skip
_OP_CODES = {op: code for code, op in enumerate(_OP_NAMES, 1)}  # 0: any other op
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)  # fmt: skip
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES, 1)}  # 0: any other dtype


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
    agreed: set[int] = field(default_factory=set)  # descriptors the ranks agreed on (process-group path)


def _descriptor(tensor: torch.Tensor, op: Any) -> int:
    """What every rank must agree on for one reduction, as one int64 word: element count, layout,
    dtype and op (bits 17 and up, bit 16, bits 8-15, bits 0-7)."""
    sparse = tensor.layout != torch.strided
    return tensor.numel() << 17 | sparse << 16 | _DTYPE_CODES.get(tensor.dtype, 0) << 8 | _OP_CODES.get(op, 0)


def _describe(descriptor: int) -> str:
    """``"SUM of 9 float32"``: a descriptor in words."""
    op = next((name for o, name in _OP_NAMES.items() if _OP_CODES[o] == descriptor & 0xFF), "another op")
    code = descriptor >> 8 & 0xFF
    dtype = str(_DTYPES[code - 1]).removeprefix("torch.") if code else "another dtype"
    layout = " (not strided)" if descriptor >> 16 & 1 else ""
    return f"{op} of {descriptor >> 17} {dtype}{layout}"


def _check_agreement(descriptors: list[int], group: Any, transport: str) -> None:
    """Raise on every rank (each holds every rank's descriptor) unless the ranks reduce alike."""
    if len(set(descriptors)) == 1:
        return
    ranks = "; ".join(
        f"rank {dist.get_global_rank(group, r)}: {_describe(d)}" for r, d in enumerate(descriptors)
    )
    raise RuntimeError(
        f"all_reduce_ ({transport}): the {len(descriptors)} ranks of the group disagree on what they reduce "
        f"({ranks}). Every rank must run the same reductions in the same order, with tensors of the same "
        "dtype and element count. HINT: is a layer (its channel count) or a statistics collector "
        "configured differently on one rank?"
    )


def _agree(route: _Route, descriptor: int, group: Any) -> None:
    """Process-group path: the ranks agree on ``descriptor`` before its first reduction over ``group``.

    Each new descriptor costs one ``all_gather`` of one int64 per rank (and a host read of it); a
    descriptor agreed once is not checked again, so two descriptors that were each agreed before and
    then meet each other are not caught on this path (the shared-memory path checks every reduction).
    """
    if descriptor in route.agreed:
        return
    mine = torch.tensor([descriptor], dtype=torch.int64, device=route.device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    _check_agreement([int(d) for d in gathered], group, "process group")
    if len(route.agreed) >= _AGREED_MAX:
        route.agreed.clear()  # on every rank alike: they agreed on the same descriptors in the same order
    route.agreed.add(descriptor)


def _route(group: Any) -> _Route:
    """How reductions over ``group`` travel, decided at its first reduction (a collective, once).

    A shared-memory segment exactly for a gloo group of several ranks all on this host (the set-up
    maps one ``/dev/shm`` file on every rank or gives up on all), on x86-64, unless
    ``LIGHTNING_EXT_SHM_COLLECTIVES=0`` on any rank: every rank decides alike (one MIN all_reduce of
    whether it could). Its waits end with the group's timeout.
    """
    route = _routes.get(group)
    if route is None:
        device, world_size = collective_device(group), dist.get_world_size(group)
        capable = (
            _X86
            and os.environ.get(SHM_ENV_VAR, "1") != "0"
            and "gloo" in str(dist.get_backend(group)).lower()
        )
        if world_size > 1 and shm._all_ranks_agree(capable, group, device):
            segment = shm._create(group, group_timeout(group, device))
        else:
            segment = None
        route = _Route(device, segment)
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

    Same contract as ``torch.distributed.all_reduce``: every rank of ``group`` calls it in the same
    order with a tensor of the same element count and dtype, and the same ``op``; here a disagreement
    raises on every rank instead of aborting or hanging a process, and before anything is reduced. A
    tensor off the group's collective device (e.g. CUDA with gloo) is reduced through a copy there.

    Transports (every rank takes the same one for the same call):

    - shared memory, between the CPU ranks of one host of a gloo group (see ``_route``): every call
      exchanges a descriptor (op, dtype, layout, element count) in the segment's header and checks it;
      a strided tensor of at most 128 KiB reduced by SUM, MAX, MIN or PRODUCT is then reduced in the
      segment, in rank order (the result is bitwise identical on every rank; it may differ from
      gloo's in the last bits), anything else by the process group.
    - the process group's ``all_reduce``: the first reduction of each descriptor over a group is
      preceded by an ``all_gather`` of one int64 per rank that checks it; later ones are not checked.

    The first call on a group decides its route (one collective; setting a segment up: four more,
    once). While ``torch.compile`` traces, it is the process group's ``all_reduce``, unchecked (see the
    module docstring; ``async_op`` then reduces at once and returns a completed handle), on a
    ``tensor`` on a device of the group's backend. Waits end with the group's timeout.

    Args:
        tensor: any shape and dtype; reduced in place.
        op: ``torch.distributed.ReduceOp``.
        group: process group (default: WORLD).
        async_op: return a handle with ``wait()`` (already completed on the shared-memory path).

    Returns:
        ``None``, or the work handle when ``async_op``.

    Raises:
        RuntimeError: on every rank, when the ranks disagree on the op, dtype, layout or element count,
            naming each rank's; a rank did not join within the group's timeout, or its process exited
            (shared memory), naming the ranks; or what ``torch.distributed.all_reduce`` raises.

    Synchronizes host and device when ``tensor`` must move to the collective device, and on the
    process-group path at the first reduction of each descriptor (reading the gathered descriptors).
    """
    group = group if group is not None else dist.group.WORLD
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
    route = _route(group)
    if tensor.device != route.device:
        moved = tensor.to(route.device)
        _all_reduce(moved, op, group, False)
        tensor.copy_(moved)
        return _Done() if async_op else None
    descriptor = _descriptor(tensor, op)
    if route.segment is not None:
        _check_agreement(route.segment.all_reduce_(tensor, op, descriptor), group, "shared memory")
        if shm._fits(tensor, op):
            return _Done() if async_op else None
    elif dist.get_world_size(group) > 1:
        _agree(route, descriptor, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


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
