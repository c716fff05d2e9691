"""Agreement is checked, never assumed: every value the ranks must share is put out of agreement, one
at a time, on 2 and 3 spawned gloo ranks over both transports of ``all_reduce_`` (shared memory and the
process group); every rank must raise a message naming the ranks and their values, within the group's
timeout, and leave nothing in ``/dev/shm``."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import platform
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_ext.distributed import (
    CHECK_ENV_VAR,
    SHM_ENV_VAR,
    all_reduce_,
    close_shared_memory,
    shm_available,
)
from lightning_ext.distributed.agreement import _describe, _descriptor
from lightning_ext.nn import SyncBatchNorm
from tests.helpers.distributed import run_distributed

X86 = platform.machine().lower() in ("x86_64", "amd64")
TRANSPORTS = [
    pytest.param(
        "shm",
        marks=pytest.mark.skipif(
            platform.machine().lower() not in ("x86_64", "amd64"), reason="shared memory is x86-64 only"
        ),
    ),
    "process group",
]
BROKEN_TRANSPORTS = ["shm", "process group"] if X86 else ["process group"]  # each job below runs both
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


def _disagree(rank: int, world_size: int, what: str) -> tuple[str, bool]:
    """The last rank reduces a tensor that differs from the others' in ``what``; every rank reports
    its error. A second reduction afterwards, alike on every rank, still works (nothing is stuck)."""
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


def _sync_batch_norm_widths(rank: int, world_size: int) -> tuple[str, list[float]]:
    """``SyncBatchNorm(4)`` on every rank but the last, ``SyncBatchNorm(8)`` there (a width from a flag)."""
    channels = 8 if rank == world_size - 1 else 4
    layer = SyncBatchNorm(channels)
    x = torch.randn(3, channels, 5, 5, generator=torch.Generator().manual_seed(rank))
    message = _error_of(lambda: layer(x))
    return message, layer.running_mean.tolist()


WHATS = ("numel", "dtype", "op", "slot")


def _one_rank_differs(rank: int, world_size: int, transports: list[str]) -> dict[tuple[str, str], tuple]:
    """Per (transport, what): ``_disagree``'s result, and per (transport, "widths")
    ``_sync_batch_norm_widths``'s; each case on a new route of the default group, taken with
    ``transport`` (so one call of the pool serves every case; a case that left anything stuck would
    fail the next ones)."""
    results = {}
    for transport in transports:
        _use(transport)
        for what in (*WHATS, "widths"):
            close_shared_memory()  # every rank alike: the next reduction takes a new route
            case = _sync_batch_norm_widths if what == "widths" else functools.partial(_disagree, what=what)
            results[transport, what] = case(rank, world_size)
    return results


@pytest.fixture(scope="module")
def one_rank_differs() -> dict[int, Any]:
    """Per world size: the per-rank results of ``_one_rank_differs`` on the pool; under ``"segments
    left"`` the shared-memory files left after both calls."""
    before = _segments()
    results: dict[Any, Any] = {
        n: run_distributed(_one_rank_differs, n, BROKEN_TRANSPORTS, timeout=90) for n in (2, 3)
    }
    results["segments left"] = _segments() - before
    return results


@pytest.mark.slow  # the fixture's calls start processes
@pytest.mark.timeout(240)
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
    one_rank_differs: dict, world_size: int, transport: str, what: str, mine: str, theirs: str
) -> None:
    last = world_size - 1
    for message, recovered in (result[transport, what] for result in one_rank_differs[world_size]):
        assert "disagree on what they reduce" in message, message
        assert f"rank 0: {mine}" in message and f"rank {last}: {theirs}" in message, message
        assert recovered
    assert not one_rank_differs["segments left"]


@pytest.mark.slow  # the fixture's calls start processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_batch_norm_of_different_widths_raises_on_every_rank(
    one_rank_differs: dict, world_size: int, transport: str
) -> None:
    results = [result[transport, "widths"] for result in one_rank_differs[world_size]]
    for rank, (message, running_mean) in enumerate(results):
        assert "disagree on what they reduce" in message and "channel count" in message, message
        assert f"rank {world_size - 1}: SUM of " in message
        assert running_mean == [0.0] * len(running_mean), rank  # nothing updated from stale bytes


# Seconds: the timeout of the group in which a peer comes late. Its ranks leave new_group together and
# meet in its set-up reduction within milliseconds, far within it. Rank 0's wait must then end within
# [WAIT_TIMEOUT - 0.5, WAIT_TIMEOUT + 5] s: 5 s for the shared-memory waiter's spin before its clock
# starts and for the scheduling of a loaded machine.
WAIT_TIMEOUT = 2.0
PEER_PATIENCE = 30.0  # seconds the late peer waits for rank 0 to give up before it reduces anyway


def _late_peer(rank: int, transport: str, marker: str) -> tuple[str, float] | None:
    """Ranks 0 and 1 in a group created with ``WAIT_TIMEOUT`` seconds (every rank creates it): rank 1
    reduces only once rank 0's reduction gave up (rank 0 then writes ``marker``), so rank 0's wait can
    only end by the timeout; rank 0's message and the seconds it waited. Were there no timeout, rank 1
    would reduce after ``PEER_PATIENCE`` seconds and rank 0's reduction would succeed."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=WAIT_TIMEOUT))
    if rank > 1:
        return None
    _use(transport)
    all_reduce_(torch.ones(2), group=group)  # sets the route up together
    if rank == 1:
        deadline = time.monotonic() + PEER_PATIENCE
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
    start = time.monotonic()
    message = _error_of(lambda: all_reduce_(torch.ones(2), group=group))
    waited = time.monotonic() - start
    if rank == 0:
        open(marker, "w").close()
    return message, waited


@pytest.mark.slow  # the fixture's job starts processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_wait_ends_with_the_groups_timeout(breaking_job: list[dict], transport: str) -> None:
    message, waited = breaking_job[0]["late", transport]
    assert message != "no error"
    assert WAIT_TIMEOUT - 0.5 <= waited <= WAIT_TIMEOUT + 5, (waited, message)  # not gloo's default 1800 s
    if transport == "shm":
        assert f"timed out after {WAIT_TIMEOUT:.0f}s" in message and "[1]" in message, message


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


# ------------------------------------------------------------ the process group's check (issue 44)

GROUP_TIMEOUT = 60.0  # seconds: a disagreement must raise well within it
# the torch.distributed collectives a worker counts
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
)
F64 = torch.float64


@contextlib.contextmanager
def _counting() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives called through the package's attributes (as
    ``all_reduce_`` calls them) while the block runs; the originals are restored after it."""
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _reduce(group: Any, n: int, dtype: torch.dtype = torch.float32, op: Any = dist.ReduceOp.SUM) -> None:
    all_reduce_(torch.ones(n, dtype=dtype), op, group)


def _flush(group: Any) -> None:
    """A Collector-like update: MAX of 5 and SUM of 7 float64, issued async, then waited in order."""
    works = [all_reduce_(torch.ones(5, dtype=F64), dist.ReduceOp.MAX, group, async_op=True)]
    works.append(all_reduce_(torch.ones(7, dtype=F64), group=group, async_op=True))
    for work in works:
        work.wait()


def _issue_a(odd: bool, group: Any) -> Callable[[], None]:
    """Issue 44's first sequence: every rank reduces float32 x4, then the odd rank x8, the others x4."""
    _reduce(group, 4)
    return lambda: _reduce(group, 8 if odd else 4)


def _issue_a_predicted(odd: bool, group: Any) -> Callable[[], None]:
    """The same once x4 is predicted (ten of them): x8 meets x4 on the predicted wire."""
    for _ in range(10):
        _reduce(group, 4)
    return lambda: _reduce(group, 8 if odd else 4)


def _issue_b(odd: bool, group: Any) -> Callable[[], None]:
    """Every rank knows x4 and x8 (alternating, predicted); then they cross: the others reduce x8
    where x4 is due (they flag), the odd rank x4."""
    for _ in range(8):
        _reduce(group, 4)
        _reduce(group, 8)
    return lambda: _reduce(group, 4 if odd else 8)


def _issue_c(odd: bool, group: Any) -> Callable[[], None]:
    """A periodic sequence a, a, b, c (SUM 9 float32, SUM 8 float32, MAX 3 float64) predicted, then the
    odd rank skips b in the middle of a period."""
    period = [(9, torch.float32, dist.ReduceOp.SUM)] * 2 + [(8, torch.float32, dist.ReduceOp.SUM)]
    period.append((3, F64, dist.ReduceOp.MAX))
    for n, dtype, op in period * 5 + period[:2]:
        _reduce(group, n, dtype, op)
    return lambda: _reduce(group, *(period[3] if odd else period[2]))


def _issue_d(odd: bool, group: Any) -> Callable[[], None]:
    """Training steps (a SyncBatchNorm forward, SUM of 2C + 1 float32, and backward, SUM of 2C, C = 4)
    each with a flush, predicted; then the odd rank flushes once more before its next forward."""
    for _ in range(4):
        _reduce(group, 9)
        _reduce(group, 8)
        _flush(group)

    def diverge() -> None:
        if odd:
            _flush(group)
        _reduce(group, 9)

    return diverge


def _odd_one(n: int, dtype: torch.dtype, op: Any, warm: bool) -> Callable[[bool, Any], Callable[[], None]]:
    """The odd rank reduces ``n`` ``dtype`` by ``op`` where the others reduce SUM of 4 float32: at the
    first reduction, or after ten float32 x4 when ``warm`` (on the predicted wire)."""

    def scenario(odd: bool, group: Any) -> Callable[[], None]:
        for _ in range(10 if warm else 0):
            _reduce(group, 4)
        return lambda: _reduce(group, *((n, dtype, op) if odd else (4,)))

    return scenario


SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX
SCENARIOS: dict[str, tuple[Callable[[bool, Any], Callable[[], None]], str, str, int]] = {
    # name: (scenario, rank 0's reduction, the odd rank's, collectives on the process-group path)
    "numel": (_odd_one(5, torch.float32, SUM, False), "SUM of 4 float32", "SUM of 5 float32", 2),
    "op": (_odd_one(4, torch.float32, MAX, False), "SUM of 4 float32", "MAX of 4 float32", 2),
    "a": (_issue_a, "SUM of 4 float32", "SUM of 8 float32", 2),
    "a predicted": (_issue_a_predicted, "SUM of 4 float32", "SUM of 8 float32", 3),
    "b": (_issue_b, "SUM of 8 float32", "SUM of 4 float32", 3),
    "c": (_issue_c, "SUM of 8 float32", "MAX of 3 float64", 3),
    "d": (_issue_d, "SUM of 9 float32", "MAX of 5 float64", 3),
    "e uint16": (_odd_one(4, torch.uint16, SUM, False), "SUM of 4 float32", "SUM of 4 uint16", 2),
    "e uint16 predicted": (_odd_one(4, torch.uint16, SUM, True), "SUM of 4 float32", "SUM of 4 uint16", 3),
    "e float8": (
        _odd_one(4, torch.float8_e4m3fn, SUM, False),
        "SUM of 4 float32",
        "SUM of 4 float8_e4m3fn",
        2,
    ),
}


def _recovers(group: Any) -> bool:
    """Whether an agreed reduction over ``group`` gives the right sum (nothing is stuck)."""
    y = torch.ones(3)
    all_reduce_(y, group=group)
    return torch.equal(y, torch.full((3,), float(dist.get_world_size(group))))


def _diverge(rank: int, size: int, transports: list[str]) -> dict[tuple[str, str], tuple]:
    """Every scenario over every transport in a group of ranks ``0 .. size - 1`` (every rank creates
    it), each on a fresh route of a group with a 60 s timeout. Per (transport, scenario): the message
    the diverging step raised, the seconds it took, the collectives it issued, and whether an agreed
    reduction afterwards gave the right sum."""
    odd = rank == size - 1
    results = {}
    for transport in transports:
        group = dist.new_group(list(range(size)), timeout=timedelta(seconds=GROUP_TIMEOUT))
        if rank >= size:
            continue
        _use(transport)
        for name, (scenario, *_) in SCENARIOS.items():
            close_shared_memory()  # every rank alike: a new route, with no history
            assert shm_available(group) == (transport == "shm")  # the route set up outside the count
            diverge = scenario(odd, group)
            start = time.monotonic()
            with _counting() as calls:
                message = _error_of(diverge)
            results[transport, name] = (message, time.monotonic() - start, calls, _recovers(group))
        # Agreed on a dtype gloo cannot reduce: a clean error on every rank (not ours), nothing stuck.
        message = _error_of(functools.partial(_reduce, group, 4, torch.float8_e4m3fn))
        results[transport, "float8 everywhere"] = (message, 0.0, [], _recovers(group))
    return results


def _breaking(rank: int, world_size: int, transports: list[str], markers: str) -> dict[tuple, Any]:
    """The tests that break collectives, in one job of 3 fresh ranks: the issue's sequences in a group
    of all 3 and in one of ranks 0 and 1, then a late peer on each transport (last, as its groups time
    out)."""
    results: dict[tuple, Any] = {("issues", size): _diverge(rank, size, transports) for size in (3, 2)}
    for transport in transports:
        results["late", transport] = _late_peer(rank, transport, os.path.join(markers, transport))
    return results


@pytest.fixture(scope="module")
def breaking_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The per-rank results of ``_breaking`` on fresh processes (so the harness also checks that every
    rank exits with status 0, no SIGABRT), and ``"segments left"``: the shared-memory files it left."""
    before = _segments()
    markers = str(tmp_path_factory.mktemp("late_peer"))
    results = run_distributed(_breaking, 3, BROKEN_TRANSPORTS, markers, timeout=300, fresh=True)
    return [{**result, "segments left": _segments() - before} for result in results]


@pytest.mark.slow  # the fixture's job starts processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_issues_sequences_raise_on_every_rank_naming_each_ranks_reduction(
    breaking_job: list[dict], world_size: int
) -> None:
    results = [result["issues", world_size] for result in breaking_job[:world_size]]
    last = world_size - 1
    for transport in BROKEN_TRANSPORTS:
        words = "shared memory" if transport == "shm" else "process group"
        for name, (_, mine, theirs, count) in SCENARIOS.items():
            per_rank = [result[transport, name] for result in results]
            for message, elapsed, calls, recovered in per_rank:
                where = (transport, name, message)
                assert f"all_reduce_ ({words}): the {world_size} ranks of the group disagree" in message
                assert f"rank 0: {mine}" in message and f"rank {last}: {theirs}" in message, where
                assert elapsed < GROUP_TIMEOUT / 4, (where, elapsed)  # not a wait to the timeout
                assert recovered, where
                # The same collectives on every rank: the predicted wire (if any), the check and the
                # all_gather that names the ranks. Shared memory: none (the descriptors in the header).
                pg = words == "process group"
                assert calls == (["all_reduce"] * (count - 1) + ["all_gather"] if pg else []), where
        for message, _, _, recovered in (result[transport, "float8 everywhere"] for result in results):
            assert message != "no error" and "disagree" not in message and recovered, (transport, message)
    assert not breaking_job[0]["segments left"]


def _collectives_per_reduction(rank: int, world_size: int, check: tuple[str | None, ...]) -> list[list[str]]:
    """A SyncBatchNorm-like periodic sequence a, a, b, c repeated 50 times over the process group, with
    ``LIGHTNING_EXT_CHECK_COLLECTIVES`` = ``check[rank]`` (``None``: unset); the collectives of each
    reduction. Each result is checked against its exact sum, max or min."""
    _use("process group")
    if check[rank] is not None:
        os.environ[CHECK_ENV_VAR] = check[rank]
    shm_available()  # the route set up outside the count
    period = [(9, dist.ReduceOp.SUM), (9, dist.ReduceOp.SUM), (8, dist.ReduceOp.MAX), (3, dist.ReduceOp.MIN)]
    expected = {dist.ReduceOp.SUM: sum(range(1, world_size + 1)), dist.ReduceOp.MAX: world_size}
    per_reduction = []
    for n, op in period * 50:
        x = torch.full((n,), float(rank + 1))
        with _counting() as calls:
            all_reduce_(x, op)
        assert torch.equal(x, torch.full((n,), float(expected.get(op, 1)))), (op, x)
        per_reduction.append(calls)
    return per_reduction


@pytest.mark.smoke
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_steady_state_costs_one_collective_per_reduction(world_size: int) -> None:
    for per_reduction in run_distributed(_collectives_per_reduction, world_size, (None,) * 3, timeout=150):
        # Slow path (check + payload) while the context of 8 agreed reductions is new: the first 8
        # reductions, then the 4 of one period; then predicted, one all_reduce each.
        assert per_reduction == [["all_reduce"] * 2] * 12 + [["all_reduce"]] * 188


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", [("1", "1"), ("on", None), (None, "Yes")])
def test_the_debug_mode_checks_every_reduction_on_every_rank_when_any_rank_asks(check: tuple) -> None:
    for per_reduction in run_distributed(_collectives_per_reduction, 2, check, timeout=150):
        assert per_reduction == [["all_reduce"] * 2] * 200


# ------------------------------------------------------------------ descriptors (one process)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental", "ignore:torch.quantize_per_tensor")
def test_every_dtype_of_torch_has_its_own_code_and_is_named() -> None:
    dtypes = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    assert {"uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "complex32", "bits8"} <= set(dtypes)
    descriptors = set()
    for name, dtype in dtypes.items():
        descriptor = _descriptor(torch.empty(3, dtype=dtype, device="meta"), dist.ReduceOp.SUM)
        assert _describe(descriptor) == f"SUM of 3 {name}"
        descriptors.add(descriptor)
    assert len(descriptors) == len(dtypes)  # no two dtypes share a code


def test_a_descriptor_names_op_count_and_layout_and_fits_a_max_pair() -> None:
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"):
        assert _describe(_descriptor(torch.ones(2), getattr(dist.ReduceOp, op))) == f"{op} of 2 float32"
    sparse = torch.ones(5).to_sparse()
    assert _describe(_descriptor(sparse, dist.ReduceOp.SUM)) == "SUM of 5 float32 (not strided)"
    largest = torch.empty(2**46 - 1, dtype=torch.uint8, device="meta")  # 70 TB
    assert 0 <= _descriptor(largest, dist.ReduceOp.PREMUL_SUM) < 2**62  # [d, -d] rides in an int64 MAX
