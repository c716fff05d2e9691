"""Helpers around ``torch.distributed`` (every function is public, re-exported by the package).

They take ``process_group=None`` for the default (WORLD) group and work when ``torch.distributed``
is not available or not initialized: the process is then a world of one (rank 0, world size 1).
Only :func:`~lightning_ext.distributed.create_process_groups` issues collectives; none synchronizes
host and device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_ext._checks import check_int

__all__ = [
    "check_process_group",
    "collective_device",
    "create_process_groups",
    "get_process_group",
    "get_rank",
    "get_world_size",
    "is_distributed",
]


def is_distributed() -> bool:
    """``True`` when ``torch.distributed`` is available and its default group is initialized."""
    return dist.is_available() and dist.is_initialized()


def check_process_group(process_group: Any, allow_non_member: bool = False) -> None:
    """Check a ``process_group`` argument: a ``torch.distributed.ProcessGroup`` or ``None`` (WORLD).

    Args:
        process_group: the value received.
        allow_non_member: also accept ``torch.distributed.GroupMember.NON_GROUP_MEMBER``, what
            ``torch.distributed.new_group`` returns on the ranks outside the new group.

    Raises:
        TypeError: anything else.

    Example::

        >>> check_process_group("world")
        Traceback (most recent call last):
        TypeError: `process_group` must be a torch.distributed.ProcessGroup or None, got 'world'
    """
    if process_group is None or (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        return
    if allow_non_member and dist.is_available() and process_group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    raise TypeError(
        f"`process_group` must be a torch.distributed.ProcessGroup or None, got {process_group!r}"
    )


def get_process_group(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """``process_group``, or the default (WORLD) group when it is ``None``; ``None`` when not distributed."""
    if not is_distributed():
        return None
    return process_group if process_group is not None else dist.group.WORLD


def get_rank(process_group: dist.ProcessGroup | None = None) -> int:
    """Rank of this process in ``process_group`` (default group when ``None``); 0 when not distributed."""
    return dist.get_rank(group=get_process_group(process_group)) if is_distributed() else 0


def get_world_size(process_group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``process_group`` (default group when ``None``); 1 when not distributed."""
    return dist.get_world_size(group=get_process_group(process_group)) if is_distributed() else 1


def collective_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device that tensors passed to collectives of ``process_group`` must live on.

    ``cuda:<current device>`` for NCCL groups, CPU for gloo (and when not distributed). A group with
    several backends (``"cpu:gloo,cuda:nccl"``) prefers CUDA when it is available.

    Example::

        >>> collective_device()
        device(type='cpu')
    """
    if not is_distributed():
        return torch.device("cpu")
    backend = str(dist.get_backend(get_process_group(process_group))).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def create_process_groups(group_size: int) -> dist.ProcessGroup | None:
    """Create ``world_size // group_size`` groups of consecutive ranks and return this rank's group.

    Ranks ``[0, group_size)`` form the first group, and so on (apex's ``create_syncbn_process_group``),
    e.g. to synchronize batch norm within a node. A collective: call it on every rank of the default
    group (each calls ``torch.distributed.new_group`` for every block, in the same order).

    Args:
        group_size: ranks per group, a positive divisor of the world size.

    Returns:
        The process group holding this rank, or ``None`` when not distributed.

    Raises:
        TypeError: ``group_size`` is not an ``int``.
        ValueError: ``group_size < 1``, or it does not divide the world size; the ranks passed different
            values (on every rank, naming them: one ``all_gather_object`` first, so that a rank whose
            value is refused never leaves the others waiting).

    Example::

        >>> create_process_groups(1) is None  # not distributed: a world of one
        True
    """
    if is_distributed():
        passed: list[Any] = [None] * get_world_size()
        dist.all_gather_object(passed, repr(group_size))
        if len(set(passed)) > 1:
            said = "; ".join(f"rank {r}: {v}" for r, v in enumerate(passed))
            raise ValueError(f"create_process_groups: the ranks passed different `group_size`s ({said}). "
                             "HINT: pass the same value on every rank")  # fmt: skip
    check_int("create_process_groups", "group_size", group_size, ge=1)
    if not is_distributed():
        return None
    world_size = get_world_size()
    if world_size % group_size != 0:
        raise ValueError(
            f"`group_size`={group_size!r} must divide the world size {world_size}. "
            "HINT: use the number of processes per node."
        )
    groups = [dist.new_group(list(range(s, s + group_size))) for s in range(0, world_size, group_size)]
    return groups[get_rank() // group_size]
