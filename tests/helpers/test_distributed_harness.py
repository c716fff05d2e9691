import os
import pickle
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


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _change_process_state(rank: int, world_size: int) -> None:
    os.environ["LIGHTNING_EXT_HARNESS_PROBE"] = "set by the previous call"
    os.environ.pop("LIGHTNING_EXT_HARNESS_PARENT", None)
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    dist.new_group([0, 1])  # unreferenced when the call returns: the harness destroys it


def _process_state(rank: int, world_size: int) -> dict:
    return {
        "pid": os.getpid(),
        "probe": os.environ.get("LIGHTNING_EXT_HARNESS_PROBE"),
        "parent": os.environ.get("LIGHTNING_EXT_HARNESS_PARENT"),
        "cwd": os.getcwd(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "random": torch.rand(1),
    }


def _echo(rank: int, world_size: int, value: torch.Tensor) -> torch.Tensor:
    return value


def _keep_a_subgroup(rank: int, world_size: int) -> None:
    global _kept
    _kept = dist.new_group([0, 1])


@pytest.mark.smoke
def test_results_come_back_per_rank():
    out = run_distributed(_sum_ranks, 3, 10, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        assert o["sum"].item() == 10 + 11 + 12
        assert o["world_size"] == 3 and o["device"] == "cpu" and o["distributed"]


def test_worker_exception_names_rank():
    """On fresh workers; the pool's case is in test_the_pool_serves_every_call_and_a_failure_restarts_it."""
    with pytest.raises(RuntimeError, match=r"rank 1 .*raised:(.|\n)*boom on purpose"):
        run_distributed(_raise_on_rank_one, 2, timeout=60, fresh=True)


def test_hang_becomes_timeout():
    """On fresh workers; the pool's case is in test_the_pool_serves_every_call_and_a_failure_restarts_it.
    On a quiet machine two fresh workers start and meet in about 3 s (test_worker_exception_names_rank's
    time): the barrier then hangs for the last 2 s of the timeout (on a loaded one they may still be
    starting; the harness names them alike)."""
    with pytest.raises(TimeoutError, match=r"timed out after 5s; ranks \[0, 1\]"):
        run_distributed(_hang_on_rank_zero, 2, timeout=5, fresh=True)


def test_the_pool_serves_every_call_and_a_failure_restarts_it():
    """A worker's exception names its rank, and a hang becomes a timeout naming the ranks, as on fresh
    workers; either kills the pool, and the next call starts a new one."""
    first = run_distributed(_pid, 2, timeout=60)
    assert run_distributed(_pid, 2, timeout=60) == first  # the same processes
    fresh = run_distributed(_pid, 2, timeout=60, fresh=True)
    assert set(fresh).isdisjoint(first)
    with pytest.raises(RuntimeError, match=r"rank 1 .*raised:(.|\n)*boom on purpose"):
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    after = run_distributed(_sum_ranks, 2, 0, timeout=60)  # a new pool
    assert [o["sum"].item() for o in after] == [1.0, 1.0]
    second = run_distributed(_pid, 2, timeout=60)
    assert set(second).isdisjoint(first)
    # The pool runs: the workers are in the barrier (rank 0) and asleep (rank 1) long before 2 s.
    with pytest.raises(TimeoutError, match=r"timed out after 2s; ranks \[0, 1\]"):
        run_distributed(_hang_on_rank_zero, 2, timeout=2)
    assert set(run_distributed(_pid, 2, timeout=60)).isdisjoint(second)  # a new pool again


def test_a_call_sees_the_parents_environment_and_nothing_of_the_previous_call(monkeypatch):
    monkeypatch.setenv("LIGHTNING_EXT_HARNESS_PARENT", "from the parent")
    before = run_distributed(_process_state, 2, timeout=60)
    run_distributed(_change_process_state, 2, timeout=60)
    after = run_distributed(_process_state, 2, timeout=60)
    for b, a in zip(before, after):
        assert a["pid"] == b["pid"]  # the pool served the three calls
        assert a["probe"] is None and a["parent"] == "from the parent"
        assert a["cwd"] == b["cwd"] and a["dtype"] == torch.float32 and a["grad"]
        assert a["groups"] == b["groups"] == 1  # the subgroup of the previous call is gone
        assert torch.equal(a["random"], b["random"])  # torch's seed is the start-up one again


def test_a_subgroup_still_referenced_after_the_call_fails_it():
    with pytest.raises(RuntimeError, match="still referenced after it returned"):
        run_distributed(_keep_a_subgroup, 2, timeout=60)


def test_tensor_arguments_reach_every_rank_and_unpicklable_ones_raise_at_once():
    value = torch.arange(5.0)
    assert all(torch.equal(out, value) for out in run_distributed(_echo, 3, value, timeout=60))
    # An argument that cannot be pickled kills the pool it was sent to: here the 2-rank one, down
    # already after the test above (this costs a start that is killed at once), so the 3-rank pool
    # still serves the next tests.
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError), match="pickle"):
        run_distributed(_echo, 2, lambda: None, timeout=60)


def test_world_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_distributed(_pid, 0)


def test_single_process_defaults():
    assert not is_distributed()
    assert get_rank() == 0 and get_world_size() == 1
    assert collective_device() == torch.device("cpu")
