"""``DDPSyncTimer``: DDP's gradients unchanged; the last gradient all-reduce launch of each backward
recorded (the rank slow in its backward waits least from it) and DDP's buffer broadcast before each
forward timed (a rank late to its forward makes the others wait there); a user's own hook wrapped or
left alone; on spawned gloo workers."""

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
from lightning_ext.distributed.ddp_sync_timer import DDPSyncTimer
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
    ``DDPSyncTimer`` installed (torch's ``allreduce_hook``: the same mean, rounded otherwise)."""
    grads = []
    for timed in (False, True):
        model = DistributedDataParallel(_model())
        if timed:
            assert DDPSyncTimer.install(model) is not None
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
    timer = DDPSyncTimer.install(model)
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


def _forward_waits(rank: int, world_size: int, slow_rank: int) -> list[tuple[float, float]]:
    """Per step, this rank's wait in DDP's forward (the buffer broadcast of a model with BatchNorm
    buffers) and in its gradient all-reduce, ``slow_rank`` sleeping ``SLEEP`` before its forward."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)))
    timer = DDPSyncTimer.install(model)
    waits = []
    for _ in range(3):
        dist.barrier()
        if rank == slow_rank:
            time.sleep(SLEEP)
        model(torch.randn(5, 4)).sum().backward()
        end = time.perf_counter()
        (start, forward_end), *more = timer.forward_waits
        timer.forward_waits.clear()
        assert more == [], more  # one DDP forward, one interval
        waits.append((forward_end - start, end - timer.last_launch))
    return waits


@pytest.mark.timeout(120)
def test_the_fast_ranks_wait_for_a_rank_late_to_its_forward_where_ddp_makes_them():
    results = run_distributed(_forward_waits, 3, 2, timeout=90)
    # A fast rank waits about SLEEP in the buffer broadcast (a receiver waits for the root only, the
    # root for the receivers) or else at the gradient all-reduce: timed in one of the two. Margins of
    # SLEEP / 2 absorb the scheduling of the processes.
    for rank, per_step in enumerate(results):
        for forward, gradients in per_step:
            if rank == 2:
                assert forward < SLEEP / 2 and gradients < SLEEP / 2, (rank, per_step)
            else:
                assert forward + gradients > SLEEP / 2, (rank, per_step)
    assert any(forward > SLEEP / 2 for per_step in results[:2] for forward, _ in per_step), results


def _counting_hook(state, bucket):  # no annotations: DDP refuses them as strings (future annotations)
    state["calls"] += 1
    return allreduce_hook(None, bucket)


def _hooks_of_users(rank: int, world_size: int) -> tuple[int, bool, bool, bool]:
    """A user's hook wrapped in a timer (found by ``install``, called with its state); a user's hook
    alone (``install`` leaves it); ``install`` twice (the same timer, its forward hooks once)."""
    wrapped, state = DistributedDataParallel(_model()), {"calls": 0}
    timer = DDPSyncTimer(_counting_hook)
    wrapped.register_comm_hook(state, timer.hook)
    found = DDPSyncTimer.install(wrapped) is timer
    wrapped(_shard(0)).sum().backward()
    foreign = DistributedDataParallel(_model())
    foreign.register_comm_hook({"calls": 0}, _counting_hook)
    left_alone = DDPSyncTimer.install(foreign) is None and len(_compat.ddp_comm_hooks(foreign)) == 1
    plain = DistributedDataParallel(_model())
    timer = DDPSyncTimer.install(plain)
    again = DDPSyncTimer.install(plain) is timer
    plain(_shard(0)).sum().backward()
    return state["calls"], found, left_alone, again and len(timer.forward_waits) == 1  # hooks once


@pytest.mark.timeout(120)
def test_a_users_hook_is_timed_when_wrapped_and_left_alone_otherwise():
    for calls, found, left_alone, again in run_distributed(_hooks_of_users, 2, timeout=90):
        assert (calls, found, left_alone, again) == (1, True, True, True)


def test_bad_arguments_are_named():
    hook = r"None or a DDP communication hook, a callable \(state, bucket\) -> Future\[Tensor\]"
    with pytest.raises(TypeError, match=rf"^DDPSyncTimer: `hook` must be {hook}, got 42 \(int\)$"):
        DDPSyncTimer(42)
    model = r"`model` must be a DistributedDataParallel, got Linear"
    with pytest.raises(TypeError, match=rf"^DDPSyncTimer.install: {model}$"):
        DDPSyncTimer.install(nn.Linear(1, 1))
