"""lightning_ext.distributed: process-group helpers and the one ``all_reduce_`` the pack uses.

:func:`all_reduce_` is the only way ``stats``, ``nn``, ``amp`` and the callbacks reduce across ranks;
how a reduction travels (shared memory between CPU ranks of one host, else the process group) is
decided in :mod:`lightning_ext.distributed.all_reduce`. Pure torch, no Lightning.
"""

from lightning_ext.distributed.all_reduce import ENV_VAR, all_reduce_, reset, shm_available
from lightning_ext.distributed.groups import (
    collective_device,
    create_process_groups,
    get_process_group,
    get_rank,
    get_world_size,
    is_distributed,
)

__all__ = [
    "ENV_VAR",
    "all_reduce_",
    "collective_device",
    "create_process_groups",
    "get_process_group",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "reset",
    "shm_available",
]
