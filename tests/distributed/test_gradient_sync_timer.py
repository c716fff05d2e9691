"""``GradientSyncTimer``: DDP's gradients unchanged, the last gradient all-reduce launch of each backward
recorded (the rank slow in its backward waits least from it), a user's own hook wrapped or left alone,
on spawned gloo workers."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_ext import _compat
from lightning_ext.distributed.gradient_sync_timer import GradientSyncTimer
from tests.helpers.distributed import run_distributed

SHARDS = (5, 0, 3)  # samples per rank: uneven, one rank empty
SLEEP = 0.2  # seconds the slow rank sleeps in its backward


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _shard(rank: int) -> torch.Tensor:
    return torch.randn(sum(SHARDS), 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[
        sum(SHARDS[:rank]) : sum(SHARDS[: rank + 1])
    ]


def _gradients(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """Each parameter's gradient after one backward of DDP with its built-in reduction, and with a
    ``GradientSyncTimer`` installed (torch's ``allreduce_hook``: the same mean, rounded otherwise)."""
    grads = []
    for timed in (False, True):
        model = DistributedDataParallel(_model())
        if timed:
            assert GradientSyncTimer.install(model) is not None
        model(_shard(rank)).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    return grads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_timed_reduction_is_the_mean_of_the_gradients(world_size):
    results = run_distributed(_gradients, world_size, timeout=90)
    # Reference in float64, one process: each shard's gradient, then their mean over the ranks (DDP's).
    per_rank = []
    for rank in range(world_size):
        model = _model()
        model(_shard(rank)).square().sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    for i, grads in enumerate(zip(*per_rank, strict=True)):
        reference = sum(grads) / world_size
        # Each rank's own gradient is the same computation on the same shard; the reductions differ:
        # DDP's and the reference are each within (world_size + 1) * eps * sum_r |g_r| / world_size of the
        # exact mean (world_size - 1 additions, a division or a multiplication by a rounded 1 / world_size).
        eps = torch.finfo(torch.float64).eps
        bound = (2 * world_size + 2) * eps * sum(g.abs() for g in grads) / world_size
        for rank, (builtin, timed) in enumerate(results):
            for ours in (builtin, timed):
                assert ((ours[i] - reference).abs() <= bound).all(), (rank, i, ours[i], reference)


def _waits(rank: int, world_size: int, slow_rank: int) -> list[tuple[int, float]]:
    """Per backward, the timer's launches and this rank's wait (from ``last_launch`` to the end of the
    backward): 3 backward passes where ``slow_rank`` sleeps ``SLEEP`` in its backward before any
    gradient is ready, then one under ``no_sync`` (no all-reduce)."""
    model = DistributedDataParallel(_model())
    timer = GradientSyncTimer.install(model)
    waits = []
    for step in range(4):
        dist.barrier()
        with model.no_sync() if step == 3 else contextlib.nullcontext():
            out = model(_shard(0))
            if rank == slow_rank:
                out.register_hook(lambda grad: time.sleep(SLEEP))
            out.sum().backward()
        waits.append((timer.launches, time.perf_counter() - timer.last_launch))
    return waits


@pytest.mark.smoke
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fast_ranks_wait_for_the_rank_slow_in_its_backward(world_size):
    slow = world_size - 1
    results = run_distributed(_waits, world_size, slow, timeout=90)
    # The fast ranks launch their last bucket about SLEEP before the slow rank, whose all-reduce then
    # completes at once: the margins of SLEEP / 2 on either side absorb the scheduling of processes.
    for rank, per_step in enumerate(results):
        launches, waits = zip(*per_step, strict=True)
        assert launches == (1, 2, 3, 3), (rank, per_step)  # no_sync: no all-reduce, no launch
        if rank == slow:
            assert all(0 <= w < SLEEP / 2 for w in waits[:3]), (rank, per_step)
        else:
            assert all(w > SLEEP / 2 for w in waits[:3]), (rank, per_step)


def _counting_hook(state, bucket):  # no annotations: DDP refuses them as strings (future annotations)
    state["calls"] += 1
    return allreduce_hook(None, bucket)


def _hooks_of_users(rank: int, world_size: int) -> tuple[int, bool, bool, bool]:
    """A user's hook wrapped in a timer (found by ``install``, called with its state); a user's hook
    alone (``install`` leaves it); ``install`` twice (the same timer)."""
    wrapped, state = DistributedDataParallel(_model()), {"calls": 0}
    timer = GradientSyncTimer(_counting_hook)
    wrapped.register_comm_hook(state, timer.hook)
    found = GradientSyncTimer.install(wrapped) is timer
    wrapped(_shard(0)).sum().backward()
    foreign = DistributedDataParallel(_model())
    foreign.register_comm_hook({"calls": 0}, _counting_hook)
    left_alone = GradientSyncTimer.install(foreign) is None and len(_compat.ddp_comm_hooks(foreign)) == 1
    plain = DistributedDataParallel(_model())
    again = GradientSyncTimer.install(plain) is GradientSyncTimer.install(plain)
    return state["calls"], found, left_alone, again


@pytest.mark.timeout(120)
def test_a_users_hook_is_timed_when_wrapped_and_left_alone_otherwise():
    for calls, found, left_alone, again in run_distributed(_hooks_of_users, 2, timeout=90):
        assert (calls, found, left_alone, again) == (1, True, True, True)


def test_bad_arguments_are_named():
    hook = r"None or a DDP communication hook, a callable \(state, bucket\) -> Future\[Tensor\]"
    with pytest.raises(TypeError, match=rf"^GradientSyncTimer: `hook` must be {hook}, got 42 \(int\)$"):
        GradientSyncTimer(42)
    model = r"`model` must be a DistributedDataParallel, got Linear"
    with pytest.raises(TypeError, match=rf"^GradientSyncTimer.install: {model}$"):
        GradientSyncTimer.install(nn.Linear(1, 1))
