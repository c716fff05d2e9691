"""Agreement is checked, never assumed: every value the ranks must share is put out of agreement, one
at a time, on 2 and 3 spawned gloo ranks over both transports of ``all_reduce_`` (shared memory and the
process group); every rank must raise a message naming the ranks and their values, within the group's
timeout, and leave nothing in ``/dev/shm``."""

from __future__ import annotations

import glob
import os
import platform
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_ext.distributed import SHM_ENV_VAR, all_reduce_, shm_available
from lightning_ext.nn import SyncBatchNorm
from tests.helpers.distributed import run_distributed

TRANSPORTS = [
    pytest.param(
        "shm",
        marks=pytest.mark.skipif(
            platform.machine().lower() not in ("x86_64", "amd64"), reason="shared memory is x86-64 only"
        ),
    ),
    "process group",
]
SEGMENTS = "/dev/shm/lightning_ext_shm_*"


def _segments() -> set[str]:
    """The package's shared-memory files now (a test compares the set before and after it runs)."""
    return set(glob.glob(SEGMENTS))


def _use(transport: str) -> None:
    """Take ``transport`` for the reductions of this worker (before its first reduction)."""
    os.environ[SHM_ENV_VAR] = "1" if transport == "shm" else "0"


def _error_of(fn) -> str:
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _disagree(rank: int, world_size: int, transport: str, what: str) -> tuple[str, bool]:
    """The last rank reduces a tensor that differs from the others' in ``what``; every rank reports
    its error. A second reduction afterwards, alike on every rank, still works (nothing is stuck)."""
    _use(transport)
    odd = rank == world_size - 1
    x, op = torch.ones(4), dist.ReduceOp.SUM
    if odd and what == "numel":
        x = torch.ones(5)
    if odd and what == "dtype":
        x = torch.ones(4, dtype=torch.float64)
    if odd and what == "op":
        op = dist.ReduceOp.MAX
    if what == "slot":  # the others' tensor fits a shared-memory slot, the last rank's does not
        x = torch.ones(40_000 if odd else 4)
    message = _error_of(lambda: all_reduce_(x, op))
    y = torch.ones(3)
    all_reduce_(y)
    return message, bool(torch.equal(y, torch.full((3,), float(world_size))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("what", "mine", "theirs"),
    [
        ("numel", "SUM of 4 float32", "SUM of 5 float32"),
        ("dtype", "SUM of 4 float32", "SUM of 4 float64"),
        ("op", "SUM of 4 float32", "MAX of 4 float32"),
        ("slot", "SUM of 4 float32", "SUM of 40000 float32"),
    ],
)
def test_a_reduction_that_differs_on_one_rank_raises_on_every_rank(
    world_size: int, transport: str, what: str, mine: str, theirs: str
) -> None:
    before = _segments()
    results = run_distributed(_disagree, world_size, transport, what, timeout=90)
    last = world_size - 1
    for message, recovered in results:
        assert "disagree on what they reduce" in message, message
        assert f"rank 0: {mine}" in message and f"rank {last}: {theirs}" in message, message
        assert recovered
    assert _segments() <= before


def _sync_batch_norm_widths(rank: int, world_size: int, transport: str) -> tuple[str, list[float]]:
    """``SyncBatchNorm(4)`` on every rank but the last, ``SyncBatchNorm(8)`` there (a width from a flag)."""
    _use(transport)
    channels = 8 if rank == world_size - 1 else 4
    layer = SyncBatchNorm(channels)
    x = torch.randn(3, channels, 5, 5, generator=torch.Generator().manual_seed(rank))
    message = _error_of(lambda: layer(x))
    return message, layer.running_mean.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_batch_norm_of_different_widths_raises_on_every_rank(world_size: int, transport: str) -> None:
    results = run_distributed(_sync_batch_norm_widths, world_size, transport, timeout=90)
    for rank, (message, running_mean) in enumerate(results):
        assert "disagree on what they reduce" in message and "channel count" in message, message
        assert f"rank {world_size - 1}: SUM of " in message
        assert running_mean == [0.0] * len(running_mean), rank  # nothing updated from stale bytes


def _late_peer(rank: int, world_size: int, transport: str, timeout: float) -> tuple[str, float]:
    """A group created with ``timeout`` seconds; the last rank sleeps 4x longer before reducing."""
    _use(transport)
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=timeout))
    all_reduce_(torch.ones(2), group=group)  # sets the route up together
    if rank == world_size - 1:
        time.sleep(4 * timeout)
    start = time.monotonic()
    message = _error_of(lambda: all_reduce_(torch.ones(2), group=group))
    return message, time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_wait_ends_with_the_groups_timeout(transport: str) -> None:
    timeout = 3.0
    results = run_distributed(_late_peer, 2, transport, timeout, timeout=90, fresh=True)
    message, waited = results[0]
    assert message != "no error"
    assert timeout - 0.5 <= waited <= timeout + 5, (waited, message)  # not gloo's default 1800 s
    if transport == "shm":
        assert "timed out after 3s" in message and "[1]" in message, message


def _exit_during_set_up(rank: int, world_size: int) -> str:
    """The last rank dies right after receiving the segment's path, before it maps the segment."""
    from lightning_ext.distributed import shm

    _use("shm")
    if rank == world_size - 1:
        shm._map = lambda info, size: os._exit(3)
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=5))
    return _error_of(lambda: all_reduce_(torch.ones(2), group=group))


@pytest.mark.timeout(120)
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_no_segment_outlives_a_set_up_that_a_peer_left() -> None:
    # Rank 0's reduction fails (the peer closed its connections) and its function returns; the harness
    # then reports the dead peer, or rank 0's failing teardown barrier, whichever it sees first.
    before = _segments()
    with pytest.raises(RuntimeError, match=r"exited with code 3|after the test function returned"):
        run_distributed(_exit_during_set_up, 2, timeout=60, fresh=True)
    assert _segments() <= before


def _switch_on_one_rank(rank: int, world_size: int) -> tuple[bool, float]:
    """``LIGHTNING_EXT_SHM_COLLECTIVES=0`` on rank 0 only: every rank takes the process group."""
    _use("process group" if rank == 0 else "shm")
    x = torch.full((3,), float(rank + 1))
    all_reduce_(x)
    return shm_available(), float(x[0])


@pytest.mark.timeout(120)
def test_the_transport_is_chosen_alike_when_one_rank_turns_shared_memory_off() -> None:
    expected = float(sum(range(1, 4)))
    assert run_distributed(_switch_on_one_rank, 3, timeout=90) == [(False, expected)] * 3
