"""Split the world into consecutive blocks of ranks, e.g. to synchronize batch norm within a node."""

from __future__ import annotations

import torch.distributed as dist

from lightning_ext.distributed import get_rank, get_world_size, is_distributed

__all__ = ["create_process_groups"]


def create_process_groups(group_size: int) -> dist.ProcessGroup | None:
    """Create ``world_size // group_size`` groups of consecutive ranks and return this rank's group.

    Ranks ``[0, group_size)`` form the first group, ``[group_size, 2 * group_size)`` the second, and
    so on (the layout of ``torch.nn.SyncBatchNorm`` examples and of apex's ``create_syncbn_process_group``).
    Every rank calls ``torch.distributed.new_group`` for EVERY block in the same order, as
    ``new_group`` requires, so the call cannot deadlock when all ranks call it together.

    This is itself a collective: call it on every rank of the default group. It issues no
    host-device synchronization.

    Args:
        group_size: number of ranks per group, a positive divisor of the world size.

    Returns:
        The process group holding this rank, or ``None`` when ``torch.distributed`` is not
        initialized (a world of one, where no synchronization is needed).

    Raises:
        TypeError: ``group_size`` is not an ``int``.
        ValueError: ``group_size < 1``, or it does not divide the world size.

    Example::

        >>> create_process_groups(1) is None  # not distributed: a world of one
        True
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"`group_size` must be an int, got {group_size!r} of type {type(group_size).__name__}"
        )
    if group_size < 1:
        raise ValueError(f"`group_size` must be >= 1, got {group_size!r}")
    if not is_distributed():
        return None
    world_size = get_world_size()
    if world_size % group_size != 0:
        raise ValueError(
            f"`group_size`={group_size!r} must divide the world size {world_size}. "
            "HINT: use the number of processes per node."
        )
    rank = get_rank()
    mine: dist.ProcessGroup | None = None
    for start in range(0, world_size, group_size):
        ranks = list(range(start, start + group_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
