"""Shared-memory all_reduce vs gloo's own, on spawned gloo workers (world sizes 2 and 3)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lightning_ext import shm_collectives
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the shared-memory path is x86-64 only (elsewhere all_reduce is gloo's)",
)

_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-50, 50, shape, generator=generator, dtype=dtype)


def _matches_gloo(rank: int, world_size: int) -> list[torch.Tensor]:
    assert shm_collectives.shm_available()
    generator = torch.Generator().manual_seed(1234 + rank)
    results = []
    shapes = [(), (1,), (7,), (3, 5), (1023,), (0,), (4, 4, 4)]
    for dtype in _DTYPES:
        for shape in shapes:
            for op in _OPS:
                if op == dist.ReduceOp.PRODUCT and dtype in (torch.bfloat16, torch.float16):
                    continue
                x = _random(shape, dtype, generator)
                ours, ref = x.clone(), x.clone()
                assert shm_collectives.all_reduce(ours, op) is None
                dist.all_reduce(ref, op=op)
                if dtype.is_floating_point and op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
                    # Summation order may differ from gloo's in the last bits.
                    tol = {torch.bfloat16: 2e-2, torch.float16: 1e-2}.get(dtype, 1e-5)  # order: last bits
                    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
                else:
                    assert torch.equal(ours, ref), (dtype, shape, op, ours, ref)
                results.append(ours)
    # Any memory layout (ranks may differ there: rank 0's dense copy goes through NumPy, the others'
    # strided tensors through torch ops; the results must still agree bit for bit, checked below).
    for x in (
        _random((6, 4), torch.float64, generator).t(),
        _random((2, 3, 4, 5), torch.float32, generator).contiguous(memory_format=torch.channels_last),
        _random((9,), torch.float64, generator)[::2],
        _random((5, 6), torch.float16, generator).t(),  # float16: NumPy and torch round alike
    ):
        ours, ref = x.clone(memory_format=torch.preserve_format), x.contiguous().clone()
        if rank == 0:  # layouts differ between ranks
            ours = ours.contiguous()
        stride_before = ours.stride()
        shm_collectives.all_reduce(ours)
        dist.all_reduce(ref)
        torch.testing.assert_close(ours, ref)
        assert ours.stride() == stride_before
        results.append(ours.contiguous())
    # Larger than a slot: falls back to gloo, same answer.
    big = _random((shm_collectives._SLOT_BYTES // 8 + 1,), torch.float64, generator)
    ref = big.clone()
    shm_collectives.all_reduce(big)
    dist.all_reduce(ref)
    torch.testing.assert_close(big, ref)
    # async_op gives a waitable handle on both paths.
    x = torch.ones(3)
    work = shm_collectives.all_reduce(x, async_op=True)
    assert work.wait()
    assert torch.equal(x, torch.full((3,), float(world_size)))
    # Many back-to-back calls exercise both buffers of the double buffer.
    acc = torch.zeros(5, dtype=torch.float64)
    for step in range(200):
        y = torch.full((5,), float(rank + step), dtype=torch.float64)
        shm_collectives.all_reduce(y)
        acc += y
    expected = sum(float(r + s) for r in range(world_size) for s in range(200))
    assert torch.equal(acc, torch.full((5,), expected, dtype=torch.float64))
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_matches_gloo_and_is_identical_on_every_rank(world_size: int) -> None:
    per_rank = run_distributed(_matches_gloo, world_size)
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            assert torch.equal(a, b)  # bitwise: every rank reduces the same slots in rank order


def _subgroup(rank: int, world_size: int) -> list[float]:
    group = dist.new_group([0, 2])
    sums = []
    if rank in (0, 2):
        for _ in range(20):
            x = torch.tensor([float(rank + 1)], dtype=torch.float64)
            shm_collectives.all_reduce(x, group=group)
            sums.append(float(x))
    # The WORLD group has its own segment; the subgroup's sequence is independent of it.
    y = torch.tensor([1.0])
    shm_collectives.all_reduce(y)
    assert float(y) == world_size
    return sums


@pytest.mark.timeout(120)
def test_subgroup_with_a_rank_outside() -> None:
    assert run_distributed(_subgroup, 3) == [[4.0] * 20, [], [4.0] * 20]


def _disabled(rank: int, world_size: int) -> bool:
    os.environ[shm_collectives._ENV] = "0"
    x = torch.tensor([1.0])
    shm_collectives.all_reduce(x)
    assert float(x) == world_size
    return shm_collectives.shm_available()


@pytest.mark.timeout(120)
def test_environment_switch_uses_gloo() -> None:
    assert run_distributed(_disabled, 2) == [False, False]


def _missing_rank(rank: int, world_size: int) -> str:
    group = shm_collectives._shm_group(dist.group.WORLD)  # set up together (a collective)
    assert group is not None
    if rank == 1:
        dist.barrier()
        return "absent"
    group.timeout = 0.5
    try:
        shm_collectives.all_reduce(torch.ones(2))
    except RuntimeError as err:
        message = str(err)
    else:  # pragma: no cover - the test fails below
        message = "no error"
    dist.barrier()
    return message


@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_raises_naming_it_instead_of_hanging() -> None:
    message, absent = run_distributed(_missing_rank, 2)
    assert absent == "absent"
    assert "timed out" in message and "[1]" in message and "same order" in message


def test_single_process_and_non_cpu_inputs_use_the_process_group_path() -> None:
    assert not shm_collectives.shm_available()  # not distributed


def test_process_alive_tells_running_from_exited_processes() -> None:
    assert shm_collectives._process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    assert not shm_collectives._process_alive(child.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while shm_collectives._process_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped yet: a zombie counts as exited
    assert not shm_collectives._process_alive(zombie.pid)
    zombie.wait()


def test_waiting_for_a_rank_whose_process_exited_raises_at_once() -> None:
    """A 2-rank segment whose rank 1 is a process that already exited: rank 0 fails fast, naming it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    world_size = 2
    storage = torch.zeros(
        world_size * shm_collectives._LINE + 2 * world_size * shm_collectives._SLOT_BYTES, dtype=torch.uint8
    )
    group = shm_collectives._ShmGroup(storage, 0, world_size, [os.getpid(), child.pid])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"group ranks \[1\] \(pids \[{child.pid}\]\) exited"):
        group.all_reduce_(torch.ones(3), dist.ReduceOp.SUM)
    assert time.monotonic() - start < 30  # not the 30-minute timeout
