"""``all_reduce_`` (shared memory between CPU ranks of one host, else the process group) vs gloo's own
``all_reduce``, on spawned gloo workers (world sizes 2 and 3)."""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from lightning_ext.distributed import (
    CHECK_ENV_VAR,
    SHM_ENV_VAR,
    all_reduce_,
    close_shared_memory,
    collective_seconds,
    shm,
    shm_available,
)
from lightning_ext.distributed import all_reduce as all_reduce_module
from tests.distributed.test_agreement import _counting
from tests.helpers.distributed import run_distributed

X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_shm = pytest.mark.skipif(
    not X86, reason="the shared-memory path is x86-64 only (elsewhere all_reduce_ is gloo's)"
)

_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-50, 50, shape, generator=generator, dtype=dtype)


def _assert_matches_gloo(ours: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, op, world_size: int) -> None:
    """``ours`` equals gloo's ``ref`` up to the order of the floating point operations.

    Integers, MAX and MIN are exact. A SUM of W values in two orders differs by at most
    (W - 1) * eps * sum_r |x_r| (each order is within (W - 1) * eps/2 * sum_r |x_r| of the exact sum,
    Higham 4.2; results that underflow are exact); a PRODUCT by (W - 1) * eps * |product| (each order
    rounds W - 1 times by a relative eps/2). ``sum_r |x_r|`` is itself all-reduced by gloo.
    """
    if not x.dtype.is_floating_point or op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        assert torch.equal(ours, ref), (x.dtype, tuple(x.shape), op, ours, ref)
        return
    eps = torch.finfo(x.dtype).eps
    if op == dist.ReduceOp.SUM:
        scale = x.detach().abs().double().contiguous()
        dist.all_reduce(scale)
    else:
        scale = ref.abs().double() * (1 + 4 * world_size * eps)  # |exact product|, to first order
    err = (ours.double() - ref.double()).abs()
    bound = (world_size - 1) * eps * scale
    assert bool((err <= bound).all()), (x.dtype, tuple(x.shape), op, (err - bound).max().item())


def _matches_gloo(rank: int, world_size: int) -> list[torch.Tensor]:
    assert shm_available()
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
                assert all_reduce_(ours, op) is None
                dist.all_reduce(ref, op=op)
                _assert_matches_gloo(ours, ref, x, op, world_size)
                results.append(ours)
    # Any memory layout, different on every rank (rank 0 dense, the others strided): reduced in the
    # logical order of the elements, written back in the caller's layout; the results agree bit for bit
    # on every rank (checked by the parent).
    for x in (
        _random((6, 4), torch.float64, generator).t(),
        _random((2, 3, 4, 5), torch.float32, generator).contiguous(memory_format=torch.channels_last),
        _random((9,), torch.float64, generator)[::2],
        _random((5, 6), torch.float16, generator).t(),
    ):
        ours, ref = x.clone(memory_format=torch.preserve_format), x.contiguous().clone()
        if rank == 0:  # layouts differ between ranks
            ours = ours.contiguous()
        stride_before, ptr_before = ours.stride(), ours.data_ptr()
        all_reduce_(ours)
        dist.all_reduce(ref)
        _assert_matches_gloo(ours, ref, x, dist.ReduceOp.SUM, world_size)
        assert ours.stride() == stride_before and ours.data_ptr() == ptr_before
        results.append(ours.contiguous())
    # Larger than a slot: goes to gloo, same answer.
    big = _random((shm._SLOT_BYTES // 8 + 1,), torch.float64, generator)
    ref = big.clone()
    x = big.clone()
    all_reduce_(big)
    dist.all_reduce(ref)
    _assert_matches_gloo(big, ref, x, dist.ReduceOp.SUM, world_size)
    # async_op gives a waitable handle on both paths.
    for n in (3, shm._SLOT_BYTES // 4 + 1):
        x = torch.ones(n)
        work = all_reduce_(x, async_op=True)
        assert work.wait()
        assert torch.equal(x, torch.full((n,), float(world_size)))
    # Many back-to-back calls exercise both buffers of the double buffer.
    acc = torch.zeros(5, dtype=torch.float64)
    for step in range(200):
        y = torch.full((5,), float(rank + step), dtype=torch.float64)
        all_reduce_(y)
        acc += y
    expected = sum(float(r + s) for r in range(world_size) for s in range(200))
    assert torch.equal(acc, torch.full((5,), expected, dtype=torch.float64))  # integers: exact
    return results


@pytest.mark.smoke
@needs_shm
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_matches_gloo_and_is_identical_on_every_rank(world_size: int) -> None:
    per_rank = run_distributed(_matches_gloo, world_size, timeout=150)
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            assert torch.equal(a, b)  # bitwise: every rank reduces the same slots in rank order


def _written_back(rank: int, world_size: int, device: str) -> list[torch.Tensor]:
    """Tensors of every size and layout on ``device``, reduced over the gloo group: the caller's tensor
    (same object, same storage, same strides) holds the sum afterwards."""
    results = []
    for shape, layout in (((5,), "dense"), ((6, 4), "transposed"), ((shm._SLOT_BYTES // 4 + 7,), "dense")):
        base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) + rank
        x = (base.t().contiguous().t() if layout == "transposed" else base.clone()).to(device)
        strides, ptr = x.stride(), x.data_ptr()
        work = all_reduce_(x, async_op=True)
        assert work.wait()
        assert x.device.type == device and x.stride() == strides and x.data_ptr() == ptr
        expected = sum(base - rank + r for r in range(world_size))  # integers below 2**24: exact
        assert torch.equal(x.cpu(), expected), (shape, layout)
        y = (base.clone()).to(device)
        assert all_reduce_(y, dist.ReduceOp.MAX) is None
        assert torch.equal(y.cpu(), base - rank + world_size - 1)
        results.append(x.cpu())
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",  # the collective device of gloo: reduced in place, through shared memory or gloo
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),  # not gloo's device: reduced through a copy on the CPU and written back
    ],
)
def test_all_reduce_writes_the_result_into_the_callers_tensor(device: str) -> None:
    per_rank = run_distributed(_written_back, 2, device, timeout=150)
    for a, b in zip(*per_rank):
        assert torch.equal(a, b)


def _close_and_reduce(rank: int, world_size: int) -> list[float]:
    world = dist.group.WORLD
    sums = []
    x = torch.tensor([float(rank + 1)])
    all_reduce_(x)
    sums.append(float(x))
    first = all_reduce_module._routes[world].segment
    assert first is not None and first.seq == 1
    close_shared_memory()  # every rank, between the same two reductions
    assert world not in all_reduce_module._routes
    for _ in range(3):  # the first of these sets the segment up again (a collective on every rank)
        x = torch.tensor([float(rank + 1)])
        all_reduce_(x)
        sums.append(float(x))
    second = all_reduce_module._routes[world].segment
    assert second is not None and second is not first and second.seq == 3  # a fresh segment
    assert shm_available()
    return sums


@needs_shm
@pytest.mark.timeout(120)
def test_close_shared_memory_sets_the_segment_up_again_on_the_next_reduction() -> None:
    assert run_distributed(_close_and_reduce, 2, timeout=90) == [[3.0] * 4] * 2


def _subgroup(rank: int, world_size: int) -> list[float]:
    group = dist.new_group([0, 2])
    sums = []
    assert shm_available(group) == (rank != 1)  # (rank 1: False, not a TypeError)
    if rank in (0, 2):
        for _ in range(20):
            x = torch.tensor([float(rank + 1)], dtype=torch.float64)
            all_reduce_(x, group=group)
            sums.append(float(x))
    # The WORLD group has its own segment; the subgroup's sequence is independent of it.
    y = torch.tensor([1.0])
    all_reduce_(y)
    assert float(y) == world_size
    return sums


@needs_shm
@pytest.mark.timeout(120)
def test_subgroup_with_a_rank_outside() -> None:
    assert run_distributed(_subgroup, 3, timeout=90) == [[4.0] * 20, [], [4.0] * 20]


def _disabled(rank: int, world_size: int) -> bool:
    os.environ[SHM_ENV_VAR] = "0"
    x = torch.tensor([1.0])
    all_reduce_(x)
    assert float(x) == world_size
    return shm_available()


@pytest.mark.timeout(120)
def test_environment_switch_uses_gloo() -> None:
    assert run_distributed(_disabled, 2, timeout=90) == [False, False]


def _missing_rank(rank: int, world_size: int) -> str:
    assert shm_available()  # sets the segment up together (a collective)
    if rank == 1:
        dist.barrier()
        return "absent"
    all_reduce_module._routes[dist.group.WORLD].segment.timeout = 0.5
    try:
        all_reduce_(torch.ones(2))
    except RuntimeError as err:
        message = str(err)
    else:  # pragma: no cover - the test fails below
        message = "no error"
    dist.barrier()
    return message


@needs_shm
@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_raises_naming_it_instead_of_hanging() -> None:
    message, absent = run_distributed(_missing_rank, 2, timeout=90)
    assert absent == "absent"
    assert "timed out" in message and "[1]" in message and "same order" in message


def test_single_process_takes_the_process_group_path() -> None:
    assert not shm_available()  # not distributed
    close_shared_memory()  # nothing to forget: a no-op


def test_process_alive_tells_running_from_exited_processes() -> None:
    assert shm._process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    assert not shm._process_alive(child.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while shm._process_alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped yet: a zombie counts as exited
    assert not shm._process_alive(zombie.pid)
    zombie.wait()


@pytest.mark.timeout(60)
def test_waiting_for_a_rank_whose_process_exited_raises_at_once() -> None:
    """A 2-rank segment whose rank 1 is a process that already exited: rank 0 fails fast, naming it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    world_size = 2
    storage = torch.zeros(world_size * shm._LINE + 2 * world_size * shm._SLOT_BYTES, dtype=torch.uint8)
    group = shm._ShmGroup(storage, 0, world_size, [os.getpid(), child.pid], timeout=1800.0)
    with pytest.raises(RuntimeError, match=rf"group ranks \[1\] \(pids \[{child.pid}\]\) exited"):
        group.all_reduce_(torch.ones(3), dist.ReduceOp.SUM, descriptor=0)


@pytest.mark.timeout(60)
def test_a_wait_on_a_busy_host_ends_with_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host so busy that every ``sched_yield`` gives the core away for a millisecond: the wait for a
    rank that never joins still ends after the segment's timeout, counted from the call."""
    world_size, timeout = 2, 1.0
    storage = torch.zeros(world_size * shm._LINE + 2 * world_size * shm._SLOT_BYTES, dtype=torch.uint8)
    group = shm._ShmGroup(storage, 0, world_size, [os.getpid(), os.getpid()], timeout=timeout)
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(1e-3))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 1s waiting for group ranks \[1\]"):
        group.all_reduce_(torch.ones(3), dist.ReduceOp.SUM, descriptor=0)
    assert timeout <= time.monotonic() - start < timeout + 2.0  # a count of 20,000 polls waited 20 s more


def _waits(rank: int, world_size: int) -> float:
    """Rank 1 computes for 1 s before a reduction; rank 0 waits for it inside ``all_reduce_``."""
    all_reduce_(torch.ones(2))  # the route set up outside the measured stretch
    before = collective_seconds()
    if rank == 1:
        time.sleep(1.0)
    all_reduce_(torch.ones(2))
    return collective_seconds() - before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm_env", ["1", "0"])
def test_collective_seconds_counts_the_time_a_rank_waits_for_the_others(shm_env: str) -> None:
    os.environ[SHM_ENV_VAR] = shm_env  # the spawned workers inherit it
    try:
        waited, computed = run_distributed(_waits, 2, timeout=90)
    finally:
        os.environ.pop(SHM_ENV_VAR)
    assert waited >= 0.9 and computed < 0.5, (waited, computed)


def _strided(rank: int, world_size: int) -> list[bool]:
    """Every other element of a rank's values, 1-D (a view gloo's all_reduce mis-reduces), of a slot's
    size and larger than a slot, on every rank or on rank 0 alone, each reduced 12 times (before and
    after the process-group path predicts it): whether each result is the exact sum."""
    correct = []
    for n, everywhere in ((7, True), (shm._SLOT_BYTES // 8 + 3, True), (7, False)):
        expected = sum(torch.arange(2 * n, dtype=torch.float64)[::2] + 100 * r for r in range(world_size))
        for _ in range(12):
            x = torch.arange(2 * n, dtype=torch.float64) + 100 * rank
            x = x[::2] if everywhere or rank == 0 else x[::2].contiguous()
            all_reduce_(x)
            correct.append(torch.equal(x, expected))
    return correct


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm_env", ["1", "0"])
def test_a_strided_tensor_is_reduced_exactly_on_both_transports(shm_env: str) -> None:
    # Handed to gloo's all_reduce as it was (a reduction not predicted yet, one larger than a
    # shared-memory slot), a 1-D strided view came back wrong and different on every rank; in a slot,
    # shared memory raised. It is reduced through a contiguous copy.
    os.environ[SHM_ENV_VAR] = shm_env  # the spawned workers inherit it
    try:
        results = run_distributed(_strided, 3, timeout=90)
    finally:
        os.environ.pop(SHM_ENV_VAR)
    assert all(all(rank) for rank in results), results


def _nans(rank: int, world_size: int) -> list[tuple]:
    """A NaN on one rank (each rank in turn), in a tensor of a slot and one larger than a slot, float32 and
    float64, by MAX and by MIN, twice (before and after the process-group path predicts it): every rank's
    result, and the expected one (``torch.maximum``/``torch.minimum`` over the ranks' tensors)."""
    out = []
    for n in (5, shm._SLOT_BYTES // 4 + 3):
        ops = (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp(dist.ReduceOp.MAX))  # (an instance too)
        for dtype, op, at in itertools.product((torch.float32, torch.float64), ops, range(world_size)):
            tensors = [torch.arange(n, dtype=dtype) * (1 + r) - 2 * r for r in range(world_size)]
            tensors[at][1] = tensors[(at + 1) % world_size][3] = math.nan
            combine = torch.maximum if op == dist.ReduceOp.MAX else torch.minimum
            expected = functools.reduce(combine, tensors)
            for _ in range(2):
                x = tensors[rank].clone()
                all_reduce_(x, op=op)
                same_nans = torch.equal(x.isnan(), expected.isnan())
                out.append((same_nans, torch.equal(x.nan_to_num(), expected.nan_to_num())))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm_env", ["1", "0"])
def test_a_nan_on_any_rank_survives_max_and_min_on_both_transports(shm_env: str) -> None:
    # gloo's MAX and MIN keep a NaN only from rank 0: on the process group (and for a tensor larger
    # than a shared-memory slot) a NaN on another rank was dropped, the finite extreme published.
    os.environ[SHM_ENV_VAR] = shm_env
    try:
        results = run_distributed(_nans, 3, timeout=90)
    finally:
        os.environ.pop(SHM_ENV_VAR)
    assert all(all(a and b for a, b in rank) for rank in results), results


def _instances_and_grads(rank: int, world_size: int) -> tuple[list, str]:
    """Ops given as ``ReduceOp`` instances and tensors that require grad, as torch takes them: each
    result against ``dist.all_reduce``'s of a plain copy; then ranks passing different instances."""
    results = []
    for op in (dist.ReduceOp(dist.ReduceOp.SUM), dist.ReduceOp(dist.ReduceOp.MAX), dist.ReduceOp.MIN):
        for n in (3, shm._SLOT_BYTES // 4 + 3):
            x = torch.arange(n, dtype=torch.float32) * (rank + 1) - rank
            leaf = x.clone().requires_grad_()
            dist.all_reduce(want := x.clone(), op=op)
            all_reduce_(leaf, op=op)
            all_reduce_(view := x.clone().requires_grad_()[1:] * 1.0, op=op)  # a non-leaf
            results.append(torch.equal(leaf.detach(), want) and torch.equal(view.detach(), want[1:]))
    op = dist.ReduceOp(dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    with pytest.raises(RuntimeError) as info:  # (SUM and MAX both read as "another op" before: half of each)
        all_reduce_(torch.ones(4), op=op)
    return results, str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm_env", ["1", "0"])
def test_reduce_op_instances_and_tensors_that_require_grad_as_torch_takes_them(
    shm_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHM_ENV_VAR, shm_env)  # (the spawned ranks inherit it)
    for rank, (results, message) in enumerate(run_distributed(_instances_and_grads, 2, timeout=90)):
        assert all(results), (rank, results)
        assert "rank 0: SUM of 4 float32" in message and "rank 1: MAX of 4 float32" in message, message


# ------------------------------------------------------------------ the process-group path's results

_CASES = [
    (dtype, op)
    for dtype in (torch.float32, torch.float64, torch.int64)
    for op in (
        dist.ReduceOp.SUM,
        dist.ReduceOp.MAX,
        dist.ReduceOp.MIN,
        dist.ReduceOp.PRODUCT,
        dist.ReduceOp.AVG,
    )
    if not (dtype == torch.int64 and op == dist.ReduceOp.AVG)  # gloo has no integer AVG
]
_SHAPES = [(), (1,), (7,), (3, 5), (0,), (1023,), (6, 4)]


def _assert_matches_torch(
    ours: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, op, world_size: int
) -> None:
    """As ``_assert_matches_gloo``; AVG: the SUM's bound over ``world_size`` plus both divisions' rounding."""
    if op != dist.ReduceOp.AVG:
        _assert_matches_gloo(ours, ref, x, op, world_size)
        return
    eps = torch.finfo(x.dtype).eps
    scale = x.abs().double().contiguous()
    dist.all_reduce(scale)
    bound = (world_size - 1) * eps * scale / world_size + eps * ref.abs().double()
    assert bool(((ours.double() - ref.double()).abs() <= bound).all()), (x.dtype, tuple(x.shape), ours, ref)


def _gloo_ops() -> list:
    """The ops of ``_CASES`` that the default (gloo) group reduces: AVG only where torch's gloo has it
    (pytorch#149781; torch 2.5 refuses it on every rank alike, before any communication)."""
    ops = []
    for op in dict.fromkeys(op for _, op in _CASES):
        try:
            dist.all_reduce(torch.ones(1), op=op)
        except RuntimeError as err:
            assert op == dist.ReduceOp.AVG and "Cannot use ReduceOp.AVG with Gloo" in str(err), err
            continue
        ops.append(op)
    return ops


def _matches_torch_over_the_process_group(rank: int, world_size: int) -> list[list[int]]:
    """Three passes over float32/float64/int64 x SUM/MAX/MIN/PRODUCT/AVG on random data (a transposed
    tensor among them), each against ``torch.distributed.all_reduce`` of the same data; per pass, the
    collectives each reduction took (2: checked, then reduced; 1: the predicted wire)."""
    os.environ[SHM_ENV_VAR] = "0"
    assert not shm_available()  # the route set up outside the count
    generator = torch.Generator().manual_seed(100 + rank)
    ops = _gloo_ops()
    cases = [(case, shape) for case, shape in zip(_CASES, _SHAPES * 3) if case[1] in ops]
    passes = []
    for _ in range(3):
        counts = []
        for (dtype, op), shape in cases:
            x = _random(shape, dtype, generator)
            if len(shape) == 2:
                x = x.t()  # not contiguous: staged in the caller's element order, written back in place
            ours, ref = x.clone(memory_format=torch.preserve_format), x.clone()
            with _counting() as calls:
                assert all_reduce_(ours, op) is None
            dist.all_reduce(ref, op=op)
            _assert_matches_torch(ours, ref, x, op, world_size)
            assert ours.stride() == x.stride()
            counts.append(len(calls))
        passes.append(counts)
    return passes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_process_group_path_matches_torch_checked_and_predicted(world_size: int) -> None:
    for first, _, third in run_distributed(_matches_torch_over_the_process_group, world_size, timeout=150):
        assert len(first) >= len(_CASES) - 2  # without AVG where gloo has none (its two float dtypes)
        assert first == [2] * len(first)  # nothing predicted yet: the slow path
        assert third == [1] * len(first)  # every context seen: the predicted wire


def _special_tensors(rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """Over the process group: a NaN on rank 0 in a predicted SUM stays in its element only (the flag
    is an element of its own); a sparse tensor always takes the slow path."""
    os.environ[SHM_ENV_VAR] = "0"
    assert not shm_available()
    dense_counts, sparse_counts = [], []
    for _ in range(12):  # the first 9 checked: contexts of 0 to 8 agreed reductions, each new
        x = torch.arange(4.0) + rank
        if rank == 0:
            x[1] = float("nan")
        with _counting() as calls:
            all_reduce_(x)
        expected = torch.arange(4.0) * world_size + sum(range(world_size))
        expected[1] = float("nan")
        torch.testing.assert_close(x, expected, rtol=0, atol=0, equal_nan=True)
        dense_counts.append(len(calls))
    for _ in range(12):
        sparse = torch.sparse_coo_tensor([[rank]], [1.0], (world_size,), check_invariants=True)
        with _counting() as calls:
            all_reduce_(sparse)
        assert torch.equal(sparse.to_dense(), torch.ones(world_size))
        sparse_counts.append(len(calls))
    return dense_counts, sparse_counts


@pytest.mark.timeout(120)
def test_a_nan_stays_in_its_element_and_sparse_tensors_are_always_checked() -> None:
    for dense_counts, sparse_counts in run_distributed(_special_tensors, 2, timeout=90):
        assert dense_counts == [2] * 9 + [1] * 3
        # The first sparse one meets the dense prediction (wire, flag, check, reduce); then, however
        # often it is seen, checked before it is reduced.
        assert sparse_counts == [3] + [2] * 11


# ------------------------------------------------------------------ the environment switches


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


SHM_SWITCHES = [  # LIGHTNING_EXT_SHM_COLLECTIVES on ranks 0 and 1; whether shared memory is on
    (("false", "false"), False),
    (("OFF", "off"), False),
    (("No", "no"), False),
    (("off", None), False),  # off on one rank: off on every rank
    (("yes", "0"), False),
    ((" True ", "ON"), True),
    (("1", None), True),
    (("", None), True),  # empty: unset
]
BAD_SWITCHES = [("maybe", "maybe"), (None, "2")]  # values not allowed on ranks 0 and 1


def _switches(rank: int, world_size: int) -> dict[tuple, tuple]:
    """Each case of the two tests below on a new route of the default group (so one call of the pool
    serves them all): per values of ``SHM_SWITCHES``, whether shared memory is on and a reduced value;
    per (variable, values of ``BAD_SWITCHES``), the error and a reduced value once every rank unset it."""
    results = {}
    for values, _ in SHM_SWITCHES:
        close_shared_memory()  # every rank alike: the next reduction decides the route anew
        _set(SHM_ENV_VAR, values[rank])
        x = torch.ones(2)
        all_reduce_(x)
        results[values] = (shm_available(), float(x[0]))
    _set(SHM_ENV_VAR, None)
    for name in (SHM_ENV_VAR, CHECK_ENV_VAR):
        for values in BAD_SWITCHES:
            close_shared_memory()
            _set(name, values[rank])
            try:
                all_reduce_(torch.ones(2))
                message = "no error"
            except ValueError as err:
                message = str(err)
            _set(name, None)
            x = torch.ones(2)
            all_reduce_(x)
            results[name, values] = (message, float(x[0]))
    return results


@pytest.fixture(scope="module")
def switches() -> list[dict[tuple, tuple]]:
    """The per-rank results of ``_switches`` on 2 ranks."""
    return run_distributed(_switches, 2, timeout=90)


@pytest.mark.slow  # its fixture starts processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("values", "on"), SHM_SWITCHES)
def test_the_shared_memory_switch_reads_the_usual_words_and_every_rank_takes_one_path(
    switches, values, on
) -> None:
    assert [result[values] for result in switches] == [(on and X86, 2.0)] * 2


@pytest.mark.slow  # its fixture starts processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [SHM_ENV_VAR, CHECK_ENV_VAR])
@pytest.mark.parametrize("values", BAD_SWITCHES)
def test_a_switch_value_not_allowed_raises_on_every_rank_naming_the_ranks(
    switches, name: str, values: tuple
) -> None:
    for message, total in (result[name, values] for result in switches):
        named = [f"rank {rank}: {name}={value!r}" for rank, value in enumerate(values) if value is not None]
        assert re.match(
            rf"all_reduce_: environment variables with values not allowed \({re.escape('; '.join(named))}\): "
            rf"{SHM_ENV_VAR} and {CHECK_ENV_VAR} must be unset, empty, or one of 1, true, on, yes, 0, false, "
            r"off, no \(any case\)\.$",
            message,
        ), message
        assert total == 2.0
