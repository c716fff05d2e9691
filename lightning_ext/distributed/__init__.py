"""Process-group helpers and :func:`all_reduce_`, the one way the pack reduces across ranks. Pure
torch, no Lightning."""

from lightning_ext.distributed.all_reduce import ENV_VAR, all_reduce_, reset, shm_available
from lightning_ext.distributed.groups import (
    check_process_group,
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
    "check_process_group",
    "collective_device",
    "create_process_groups",
    "get_process_group",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "reset",
    "shm_available",
]
