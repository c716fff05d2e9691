"""Small helpers around ``torch.distributed`` shared by every module of the pack.

They all accept ``process_group=None`` for the default (WORLD) group and work when
``torch.distributed`` is not available or not initialized, in which case the process is
treated as a world of one (rank 0, world size 1). None of them synchronizes host and device
or issues a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "collective_device",
    "get_process_group",
    "get_rank",
    "get_world_size",
    "is_distributed",
]


def is_distributed() -> bool:
    """Return ``True`` when ``torch.distributed`` is available and its default group is initialized."""
    return dist.is_available() and dist.is_initialized()


def get_process_group(process_group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """Return ``process_group``, or the default (WORLD) group when it is ``None``.

    Returns ``None`` when ``torch.distributed`` is not initialized.
    """
    if not is_distributed():
        return None
    return process_group if process_group is not None else dist.group.WORLD


def get_rank(process_group: dist.ProcessGroup | None = None) -> int:
    """Rank of this process in ``process_group`` (default group when ``None``); 0 when not distributed."""
    if not is_distributed():
        return 0
    return dist.get_rank(group=get_process_group(process_group))


def get_world_size(process_group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``process_group`` (default group when ``None``); 1 when not distributed."""
    if not is_distributed():
        return 1
    return dist.get_world_size(group=get_process_group(process_group))


def collective_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device that tensors passed to collectives of ``process_group`` must live on.

    ``cuda:<current device>`` for NCCL groups, CPU for gloo (and when not distributed).
    A group with several backends (``"cpu:gloo,cuda:nccl"``) prefers CUDA when it is available.

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
