"""Process-group helpers and :func:`all_reduce_`, the one way the pack reduces across ranks. Pure
torch, no Lightning."""

from lightning_ext.distributed.all_reduce import (
    CHECK_ENV_VAR,
    SHM_ENV_VAR,
    all_reduce_,
    close_shared_memory,
    collective_seconds,
    shm_available,
)
from lightning_ext.distributed.ddp_sync_timer import DDPSyncTimer
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
    "CHECK_ENV_VAR", "SHM_ENV_VAR", "DDPSyncTimer", "all_reduce_", "check_process_group",
    "close_shared_memory", "collective_device", "collective_seconds", "create_process_groups",
    "get_process_group", "get_rank", "get_world_size", "is_distributed", "shm_available",
]  # fmt: skip
