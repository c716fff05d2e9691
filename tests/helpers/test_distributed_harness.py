import time

import pytest
import torch
import torch.distributed as dist

from lightning_ext.distributed import collective_device, get_rank, get_world_size, is_distributed
from tests.helpers.distributed import run_distributed


def _sum_ranks(rank: int, world_size: int, offset: int) -> dict:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {
        "sum": t,
        "rank": get_rank(),
        "world_size": get_world_size(),
        "device": str(collective_device()),
        "distributed": is_distributed(),
    }


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits here; the harness must not hang


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(60)  # stays alive, so rank 0 waits in the barrier


def test_results_come_back_per_rank():
    out = run_distributed(_sum_ranks, 3, 10, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["sum"].item() == 10 + 11 + 12
        assert o["world_size"] == 3 and o["device"] == "cpu" and o["distributed"]


def test_worker_exception_names_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 .*raised:(.|\n)*boom on purpose"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)


def test_hang_becomes_timeout():
    with pytest.raises(TimeoutError, match=r"timed out after 8s; ranks \[0, 1\]"):
        run_distributed(_hang_on_rank_zero, 2, timeout=8)


def test_single_process_defaults():
    assert not is_distributed()
    assert get_rank() == 0 and get_world_size() == 1
    assert collective_device() == torch.device("cpu")
