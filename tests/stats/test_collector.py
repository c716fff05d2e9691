"""Collector: single-process behaviour and gloo runs compared with a float64 computation over all ranks."""

from __future__ import annotations

import math
import os
import pickle
import random
import re
import time
import zlib

import numpy as np
import pytest
import torch

from lightning_ext.distributed import SHM_ENV_VAR
from lightning_ext.stats import Collector, clear_statistics, init_multiprocessing, report, report0, set_stage
from lightning_ext.stats import collector as collector_module
from tests.helpers.distributed import run_distributed
from tests.helpers.float64_reference import Reference, assert_moments_close, reference_moments

STATS = ("num", "mean", "std", "min", "max")


@pytest.fixture(autouse=True)
def _clean_state():
    clear_statistics()
    yield
    clear_statistics()


# ------------------------------------------------------------------------------------------------
# Reference: the schedule of reports every rank makes, and the float64 statistics it implies.


def _schedule(rank: int, world_size: int, step: int) -> list[tuple[str, str, object]]:
    """(function, name, value) reported by ``rank`` at ``step`` (1-based), in a rank-specific order."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{step}".encode()))
    last = world_size - 1
    items: list[tuple[str, str, object]] = []
    size = 0 if (rank == last and step == 2) else (rank + 1) * 3 + step  # uneven, one empty shard
    items.append(("report", "Loss/a", torch.randn(size, generator=gen) * 2 + step))
    if step <= 2:
        items += [("report", "Loss/b", rank * 10 + step + 0.5 * k) for k in range(rank + 1)]
    if step == 1:
        items.append(("report", "Loss/once", np.array([rank, -rank - 0.5])))
    items.append(("report", "Big/x", 1e6 + torch.randn(40 + rank, generator=gen, dtype=torch.float64)))
    items.append(("report", "Zero/empty", []))
    items.append(("report0", "R0/lr", 0.1 * step))
    items.append(("report", f"Only/r{rank}", rank + step))  # name sets differ between ranks
    if step >= 2 and rank == last:  # appears mid-run on one rank
        items.append(("report", "Late/x", torch.tensor([step, step + 1], dtype=torch.float16)))
    if step >= 3 and rank == 0:
        items.append(("report", "Loss/late", torch.tensor([True, False, True])))
    # Jumps by 1e9 (~1e9 standard deviations) at step 5: the SUM is redone around a rank mean.
    items.append(
        (
            "report",
            "Jump/x",
            (1e9 if step == 5 else 0.0) + torch.randn(20, generator=gen, dtype=torch.float64),
        )
    )
    random.Random(rank * 100 + step).shuffle(items)
    return items


# collector => (regex, keep_previous, steps at which it updates)
COLLECTORS = {
    "all": (".*", True, (1, 2, 3, 4)),
    "loss": ("Loss/.*", False, (2, 4)),
    "big": ("Big/.*", True, (4,)),
}
STEPS = 4


def _values(fn: str, rank: int, value: object) -> list[float]:
    """The float64 numbers a report adds (exact: every value kind converts exactly)."""
    if fn == "report0" and rank != 0:
        return []
    flat = value if torch.is_tensor(value) else torch.as_tensor(np.asarray(value, dtype=np.float64))
    return flat.to(torch.float64).reshape(-1).tolist()


def _reference(world_size: int) -> dict[str, list[dict[str, Reference | None]]]:
    """Per collector, the expected statistics after each of its updates: the correctly rounded
    moments of all ranks' values (``None``: no value yet, NaN) and the float64 rounding bound.

    The bound (``tests/helpers/float64_reference.py``) counts the merges an update makes: one table
    per step since the previous update (each update drains once), then the all-reduce across
    ``world_size`` ranks. The all-reduce sums around the previous published mean of the name (0
    before it had values) unless the name set changed, when it is redone around the largest rank
    mean, inside the data; that shift widens the span ``D`` of the bound.
    """
    import re

    out = {}
    for key, (regex, keep_previous, updates) in COLLECTORS.items():
        pattern = re.compile(regex)
        known: set[str] = set()
        previous: dict[str, Reference | None] = {}
        shift: dict[str, float] = {}  # the collector's last published mean per name
        snapshots = []
        start = 1
        for stop in updates:
            values: dict[str, list[float]] = {}
            for step in range(start, stop + 1):
                for rank in range(world_size):
                    for fn, name, value in _schedule(rank, world_size, step):
                        if pattern.fullmatch(name):
                            known.add(name)
                            values.setdefault(name, []).extend(_values(fn, rank, value))
            renamed = known != set(previous)
            snap: dict[str, Reference | None] = {}
            for name in sorted(known):
                data = values.get(name, [])
                if data:
                    snap[name] = reference_moments(
                        data,
                        shifts=() if renamed else (shift.get(name, 0.0),),
                        merges=stop - start + 2,
                        ways=max(world_size, 2),
                        lanes=True,  # some values are float32 tensors (float32 element arithmetic)
                    )
                    shift[name] = snap[name].mean
                else:
                    snap[name] = previous.get(name) if keep_previous else None
            previous = snap
            snapshots.append(snap)
            start = stop + 1
        out[key] = snapshots
    return out


class _CountingDist:
    """Stands in for ``torch.distributed`` inside the collector module to count its collectives."""

    def __init__(self, real, calls: list[str]) -> None:
        self._real = real
        self.calls = calls

    def __getattr__(self, attr):
        value = getattr(self._real, attr)
        if attr in ("all_reduce", "all_gather_object", "all_gather", "broadcast", "barrier"):

            def counted(*args, **kwargs):
                self.calls.append(attr)
                return value(*args, **kwargs)

            return counted
        return value


def _count_collectives() -> list[str]:
    """Count, in this process, the collectives the collector module issues: its ``torch.distributed``
    calls and its ``all_reduce_`` (shared memory or gloo, counted once either way)."""
    calls: list[str] = []
    collector_module.dist = _CountingDist(collector_module.dist, calls)
    real_all_reduce = collector_module.all_reduce_

    def all_reduce_(*args, **kwargs):
        calls.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    collector_module.all_reduce_ = all_reduce_
    return calls


def _distributed_schedule(rank: int, world_size: int) -> dict:
    clear_statistics()
    counted = _count_collectives()
    collectors = {
        key: Collector(regex=regex, keep_previous=keep) for key, (regex, keep, _) in COLLECTORS.items()
    }
    results: dict = {key: [] for key in COLLECTORS}
    calls: dict = {key: [] for key in COLLECTORS}
    for step in range(1, STEPS + 1):
        for fn, name, value in _schedule(rank, world_size, step):
            returned = (report if fn == "report" else report0)(name, value)
            assert returned is value
        for key, (_, _, updates) in COLLECTORS.items():
            if step in updates:
                before = len(counted)
                collectors[key].update()
                calls[key].append(counted[before:])
                results[key].append(collectors[key].as_dict())
    # Steady state: the same names again, one more update each: exactly two all_reduce.
    for fn, name, value in _schedule(rank, world_size, 4):
        (report if fn == "report" else report0)(name, value)
    before = len(counted)
    collectors["all"].update()
    steady = counted[before:]
    for fn, name, value in _schedule(rank, world_size, 5):
        (report if fn == "report" else report0)(name, value)
    before = len(counted)
    collectors["all"].update()
    jump = {"calls": counted[before:], "stats": collectors["all"].as_dict()}
    for fn, name, value in _schedule(rank, world_size, 4):  # back near 0: reduced again too
        (report if fn == "report" else report0)(name, value)
    collectors["all"].update()
    jump["after"] = collectors["all"].as_dict()["Jump/x"]  # the step-4 values alone: rows emptied
    out = {
        "results": results,
        "calls": calls,
        "steady": steady,
        "names": collectors["all"].names(),
        "jump": jump,
    }
    if world_size == 3:  # a subgroup {0, 2} reduces on its own; rank 1 stays out of its collectives
        import torch.distributed as dist

        group = dist.new_group([0, 2])  # called by every rank, as torch requires
        clear_statistics()
        if rank != 1:
            init_multiprocessing(rank=rank // 2, sync_device="cpu", process_group=group)
            sub = Collector(regex="Sub/.*")
            report("Sub/x", torch.arange(rank + 2, dtype=torch.float64) * (rank + 1))
            report0("Sub/r0", float(rank + 10))  # rank 0 of the subgroup (global rank 0) only
            sub.update()
            out["subgroup"] = sub.as_dict()
        clear_statistics()  # rank 1, outside the group, raises before any collective; rank 2 says 2
        init_multiprocessing(rank=rank, sync_device="cpu", process_group=group)  # (it is 1 there): both
        report("Sub/x", 1.0)  # ranks of the group raise (else: report0's values lost, or a hang)
        error, said = (ValueError, r"init_multiprocessing\(rank=1\) in a process outside its process_group")
        if rank != 1:
            error, said = RuntimeError, r"ranks \[1\]: init_multiprocessing\(rank=2\) on rank 1 at step=None"
        with pytest.raises(error, match=said):
            Collector(regex="Sub/.*").update()
        dist.barrier()
    return out


def _assert_snapshot_equal(got: dict, want: dict[str, Reference | None], where: str) -> None:
    assert list(got) == list(want), f"{where}: names {list(got)} != {list(want)}"
    for name, ref in want.items():
        if ref is None:
            assert got[name]["num"] == 0, f"{where} {name}: num {got[name]['num']} != 0"
            for stat in STATS[1:]:
                assert math.isnan(got[name][stat]), f"{where} {name}.{stat}: {got[name][stat]} is not NaN"
        else:
            assert_moments_close(got[name], ref, f"{where} {name}")


@pytest.mark.smoke
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_statistics_match_single_process_float64(world_size: int) -> None:
    outputs = run_distributed(_distributed_schedule, world_size, timeout=150)
    reference = _reference(world_size)
    for rank, out in enumerate(outputs):
        for key in COLLECTORS:
            assert len(out["results"][key]) == len(reference[key])
            for u, (got, want) in enumerate(zip(out["results"][key], reference[key])):
                _assert_snapshot_equal(got, want, f"rank {rank} collector {key!r} update {u}")
        # Identical on every rank, bit for bit (repr is exact for floats and makes NaN == NaN).
        assert repr(out["results"]) == repr(outputs[0]["results"])
    # Stable std for 1e6 + N(0, 1): checked above within the rounding bound (~1e-7 of it here).
    assert reference["big"][0]["Big/x"].std == pytest.approx(1.0, rel=0.1)
    calls = outputs[0]["calls"]
    # First update (no agreed names yet): MAX alone; then gather, MAX, SUM.
    first = ["all_reduce", "all_gather_object", "all_reduce", "all_reduce"]
    # Later name changes: the concurrent MAX + SUM, then gather, MAX, SUM.
    gather = ["all_reduce", "all_reduce", "all_gather_object", "all_reduce", "all_reduce"]
    steady = ["all_reduce", "all_reduce"]  # MAX + SUM in flight together
    grown = ["all_reduce", "all_reduce", "all_reduce"]  # same new names on every rank: no gather
    # "all": step 1 different name sets (Only/r*), step 2 Late/x appears, step 3 Loss/late appears,
    # step 4 steady.
    assert calls["all"] == [first, gather, gather, steady]
    # "loss": the first update sees the same Loss/* names on every rank; Loss/late appears later.
    assert calls["loss"] == [grown, gather]
    # The 1e9 jump: one more SUM, around the largest rank mean (inside the data), so the statistics
    # keep the rounding bound of shifts inside the data (one table, one all-reduce); around the
    # previous mean (~0) the between-rank term would have lost ~eps·n·1e18, far more than m2 ~ n.
    assert outputs[0]["jump"]["calls"] == ["all_reduce", "all_reduce", "all_reduce"]
    jump = [
        v
        for r in range(world_size)
        for fn, name, value in _schedule(r, world_size, 5)
        if name == "Jump/x"
        for v in value.tolist()
    ]
    back = [
        v for r in range(world_size) for _, name, value in _schedule(r, world_size, 4) if name == "Jump/x"
        for v in value.tolist()
    ]  # fmt: skip
    for rank, out in enumerate(outputs):
        assert_moments_close(
            out["jump"]["stats"]["Jump/x"], jump, f"rank {rank} Jump/x", merges=2, ways=max(world_size, 2)
        )
        assert_moments_close(  # nothing of the jump's interval left in the rows it reduced twice
            out["jump"]["after"], back, f"rank {rank} Jump/x after", merges=2, ways=max(world_size, 2)
        )
    assert calls["big"] == [grown]
    assert outputs[0]["steady"] == steady
    assert all(out["calls"] == calls for out in outputs)
    expected = sorted(
        {name for r in range(world_size) for s in range(1, 5) for _, name, _ in _schedule(r, world_size, s)}
    )
    assert outputs[0]["names"] == expected
    if world_size == 3:
        x = [v * (r + 1) for r in (0, 2) for v in range(r + 2)]  # ranks 0 and 2 only
        for rank in (0, 2):
            sub = outputs[rank]["subgroup"]
            assert_moments_close(sub["Sub/x"], x, f"rank {rank} Sub/x", merges=2)
            assert sub["Sub/r0"] == {"num": 1, "mean": 10.0, "std": 0.0, "min": 10.0, "max": 10.0}
        assert "subgroup" not in outputs[1]


# ------------------------------------------------------------------------------------------------
# Ranks whose collectors differ: every rank raises, naming the ranks, before anything is published.

AGREED = {  # what even ranks pass
    "regex": "L.*", "keep_previous": True, "stage": None, "quantiles": "L.*", "relative_accuracy": 0.01,
    "value_range": (1e-6, 1e6), "stragglers": None, "forget_after": 100,
}  # fmt: skip
DIFFERENCES = [  # one argument at a time: what odd ranks pass instead
    ("relative_accuracy", 0.02),
    ("value_range", (1e-3, 1e3)),
    ("quantiles", None),
    ("stragglers", "L/x"),
    ("regex", "L/.*"),
    ("keep_previous", False),
    ("stage", "validate"),
    ("forget_after", None),
]


def _differing(rank: int, world_size: int, shared_memory: bool) -> list:
    if not shared_memory:  # before the first reduction, which decides the transport
        os.environ[SHM_ENV_VAR] = "0"
    out = []
    for restored in (False, True):  # fresh, or with agreed names: the SUM has a size then
        for arg, value in DIFFERENCES:
            clear_statistics()
            kwargs = {**AGREED, arg: value} if rank % 2 else AGREED
            c = Collector(**kwargs)
            if restored:
                c.load_state_dict({"names": ["L/x"], "values": {}})
            outer = set_stage(kwargs.get("stage"))
            report("L/x", [rank, rank + 1.0])
            set_stage(outer)
            start = time.monotonic()
            with pytest.raises(RuntimeError) as info:
                c.update(step=7)
            elapsed, names = time.monotonic() - start, c.names()
            init_multiprocessing(rank, None)  # alone now: the values received before the error remain
            c.update()
            out.append((restored, arg, str(info.value), elapsed, names, c.num("L/x"), c.mean("L/x")))
    return out


def _ranks(ranks: list[int]) -> str:
    return re.escape(f"ranks {ranks}")


def _shm_files() -> set[str]:
    """The shared-memory segments of ``all_reduce_`` in ``/dev/shm`` (unlinked once mapped: none stay)."""
    return (
        {f for f in os.listdir("/dev/shm") if f.startswith("lightning_ext_shm_")}
        if os.path.isdir("/dev/shm")
        else set()
    )


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_whose_collectors_differ_all_raise_naming_the_ranks(
    world_size: int, shared_memory: bool
) -> None:
    """One argument differs on the odd ranks: the MAX's configuration pair says so on every rank, which
    then run ONE gather of each rank's configuration and step and raise naming both groups, before
    anything is published, fresh or restored (the SUM then has a size), on both transports."""
    before = _shm_files()
    outputs = run_distributed(_differing, world_size, shared_memory, timeout=120)
    assert _shm_files() <= before  # nothing left behind
    even, odd = [r for r in range(world_size) if r % 2 == 0], [r for r in range(world_size) if r % 2]
    for rank, out in enumerate(outputs):
        assert len(out) == 2 * len(DIFFERENCES)
        for restored, arg, message, elapsed, names, num, mean in out:
            where = f"rank {rank}, {arg}{' after load_state_dict' if restored else ''}"
            groups = [
                rf"{_ranks(ranks)}: Collector\(.*{re.escape(f'{arg}={value!r}')}.*\) at step=7"
                for ranks, value in ((even, AGREED[arg]), (odd, dict(DIFFERENCES)[arg]))
            ]
            assert re.match(
                rf"Collector.update: the ranks disagree \({groups[0]}; {groups[1]}\); nothing was published, "
                r"the values stay for the next update\. HINT: create the Collector",
                message,
            ), f"{where}: {message}"
            assert elapsed < 30.0, f"{where}: raised after {elapsed:.1f} s"
            assert names == (["L/x"] if restored else []), f"{where}: published {names}"
            assert (num, mean) == (2, rank + 0.5), f"{where}: the values received were lost"


def _wrong_rank(rank: int, world_size: int, shared_memory: bool) -> list:
    """The last rank tells init_multiprocessing it is rank 0, before the ranks ever agreed and after."""
    if not shared_memory:
        os.environ[SHM_ENV_VAR] = "0"
    out = []
    for agreed_before in (False, True):
        clear_statistics()
        c = Collector(regex="L/.*")
        if agreed_before:
            report("L/x", 1.0)
            c.update(step=1)
        init_multiprocessing(0 if rank == world_size - 1 else rank, "cpu")
        report("L/x", [rank, rank + 1.0])
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            c.update(step=2)
        elapsed = time.monotonic() - start
        init_multiprocessing(rank, None)  # alone now: the values received before the error remain
        c.update()
        out.append((agreed_before, str(info.value), elapsed, c.num("L/x"), c.mean("L/x")))
    return out


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_wrong_rank_in_init_multiprocessing_raises_on_every_rank(
    world_size: int, shared_memory: bool
) -> None:
    # It raised on the wrong rank alone, before any collective: the others waited out the group's timeout
    outputs = run_distributed(_wrong_rank, world_size, shared_memory, timeout=120)
    last = world_size - 1
    for rank, out in enumerate(outputs):
        assert len(out) == 2
        for agreed_before, message, elapsed, num, mean in out:
            where = f"rank {rank}, {'after an agreement' if agreed_before else 'fresh'}"
            assert re.match(
                rf"Collector.update: the ranks disagree \({_ranks(list(range(last)))}: Collector\(.*\) at "
                rf"step=2; {_ranks([last])}: init_multiprocessing\(rank=0\) on rank {last} at step=2\); "
                r"nothing was published",
                message,
            ), f"{where}: {message}"
            assert elapsed < 30.0, f"{where}: raised after {elapsed:.1f} s"
            assert (num, mean) == (2, rank + 0.5), f"{where}: the values received were lost"


def _skipping(rank: int, world_size: int, shared_memory: bool, with_step: bool) -> list:
    """Four intervals of one value each (``10 rank + interval``); rank 1 skips its update after
    interval 1 and, without a step, updates once more at the end (so that every update meets one)."""
    if not shared_memory:
        os.environ[SHM_ENV_VAR] = "0"
    c = Collector(regex="L.*")
    out: list = []
    for interval in range(4):
        report("L/x", float(10 * rank + interval))
        if rank == 1 and interval == 1:
            continue
        start = time.monotonic()
        try:
            c.update(step=interval if with_step else None)
        except RuntimeError as err:
            init_multiprocessing(rank, None)  # alone now: the values received before the error remain
            c.update()
            return [*out, (interval, str(err), time.monotonic() - start, c.num("L/x"), c.mean("L/x"))]
        out.append((interval, c.num("L/x"), c.mean("L/x")))
    if rank == 1 and not with_step:
        c.update()
        out.append((4, c.num("L/x"), c.mean("L/x")))
    return out


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_skipped_update_raises_on_every_rank_naming_the_steps(world_size: int, shared_memory: bool) -> None:
    """Issue 44's case: rank 1 skips one of four updates. With the step, its next update (interval 2)
    meets the others' of interval 1: every rank raises, naming each rank's step, and publishes nothing;
    the values stay (rank 1: intervals 1 and 2)."""
    before = _shm_files()
    outputs = run_distributed(_skipping, world_size, shared_memory, True, timeout=120)
    assert _shm_files() <= before
    others = [r for r in range(world_size) if r != 1]
    for rank, out in enumerate(outputs):
        [(interval, message, elapsed, num, mean)] = out[-1:]
        assert [o[0] for o in out[:-1]] == [0] and interval == (2 if rank == 1 else 1), out
        assert re.match(
            rf"Collector.update: the ranks disagree \({_ranks(others)}: Collector\(.*\) at step=1; "
            rf"{_ranks([1])}: Collector\(.*\) at step=2\); nothing was published",
            message,
        ), message
        assert elapsed < 30.0
        assert (num, mean) == ((2, 11.5) if rank == 1 else (1, 10.0 * rank + 1)), out


def test_without_a_step_a_skipped_update_meets_the_next_one() -> None:
    """What the step catches, and nothing else can: without one, rank 0's 2nd update meets rank 1's
    3rd (the k-th update of each rank meets the others' k-th) and both publish an interval mixing rank
    0's interval 1 with rank 1's intervals 1 and 2, without an error (documented in the guide)."""
    outputs = run_distributed(_skipping, 2, True, False, timeout=120)
    mixed = [(3, (1 + 11 + 12) / 3), (2, (2 + 13) / 2), (1, 3.0)]  # (num, mean) of updates 2, 3 and 4
    assert outputs[0] == [(0, 2, 5.0)] + [(i, *m) for i, m in zip((1, 2, 3), mixed)]
    assert outputs[1] == [(0, 2, 5.0)] + [(i, *m) for i, m in zip((2, 3, 4), mixed)]


# ------------------------------------------------------------------------------------------------
# Bytes per rank, whatever the world size; names that come and go; non-finite values.

K_BYTES = 5  # names of the payload-size schedule: 2 sketched, 1 with the straggler tracked


def _payload_bytes(rank: int, world_size: int) -> list:
    """Bytes of each all-reduce of three updates of the same schedule on every rank (600 values per
    sketched name and rank: counts packed 4 to a word for 2, 3 and 4 ranks alike)."""
    calls = []
    real = collector_module.all_reduce_

    def all_reduce_(tensor, op, **kwargs):
        calls.append((op, tensor.numel() * tensor.element_size()))
        return real(tensor, op=op, **kwargs)

    collector_module.all_reduce_ = all_reduce_
    c = Collector(quantiles="Q/.*", stragglers="T/x")
    gen = np.random.default_rng(0)
    for _ in range(3):
        report("Q/a", gen.lognormal(0.0, 1.0, 600))
        report("Q/b", gen.uniform(-1.0, 1.0, 600))
        report("T/x", 0.01 * (1 + rank))
        report("M/a", 1.0)
        report("M/b", [1.0, 2.0])
        c.update()
    return calls


def test_payload_bytes_per_rank_do_not_depend_on_the_world_size() -> None:
    """2, 3 and 4 ranks send exactly the same bytes per rank: the MAX holds 7 head values and 5 per
    name, the SUM 5 per name and each sketched name's window (the ranks' means of the straggler name in
    one more), nothing per rank."""
    by_size = {w: run_distributed(_payload_bytes, w, timeout=180, fresh=w == 4)[0] for w in (2, 3, 4)}
    assert by_size[2] == by_size[3] == by_size[4], by_size
    steady = by_size[2][-2:]  # the third update: the agreed names, no new one
    assert steady[0] == (torch.distributed.ReduceOp.MAX, 8 * (7 + 5 * K_BYTES))
    sketch_words = (steady[1][1] // 8 - 5 * K_BYTES) / 3
    assert steady[1][0] == torch.distributed.ReduceOp.SUM and sketch_words == int(sketch_words) <= 640, steady


def _forgetting(rank: int, world_size: int) -> list:
    """forget_after=2: ``A`` on rank 0 at every update; ``B`` on rank 1 at the first and the fifth."""
    c = Collector(forget_after=2)
    out = []
    for update in range(5):
        if rank == 0:
            report("A", float(update))
        if rank == 1 and update in (0, 4):
            report("B", [10.0 * update, 10.0 * update + 2])
        c.update()
        out.append((c.names(), c.updated(), {n: (c.num(n), c.mean(n)) for n in c.names()}))
    return out


def test_a_name_without_values_is_forgotten_alike_on_every_rank_and_comes_back_new() -> None:
    outputs = run_distributed(_forgetting, 2, timeout=120)
    assert outputs[0] == outputs[1]
    assert outputs[0] == [
        (["A", "B"], ["A", "B"], {"A": (1, 0.0), "B": (2, 1.0)}),
        (["A", "B"], ["A"], {"A": (1, 1.0), "B": (2, 1.0)}),  # B kept (keep_previous), 1 update idle
        (["A"], ["A"], {"A": (1, 2.0)}),  # 2 updates idle on every rank: forgotten
        (["A"], ["A"], {"A": (1, 3.0)}),
        (["A", "B"], ["A", "B"], {"A": (1, 4.0), "B": (2, 41.0)}),  # back, as a new name
    ]


def _nonfinite(rank: int, world_size: int, shared_memory: bool) -> dict:
    if not shared_memory:
        os.environ[SHM_ENV_VAR] = "0"
    c = Collector(quantiles="x")
    report("x", [1.0, math.nan, 2.0] if rank == 0 else [math.inf, 3.0, -math.inf] if rank == 1 else [])
    report("only", [math.nan] if rank == 0 else [])
    c.update()
    return {"x": [c.num("x"), c.nonfinite("x"), c.mean("x"), c.min("x"), c.max("x")],
            "hist": c.histogram("x")[0].sum(), "only": [c.num("only"), c.nonfinite("only")],
            "q": c.quantile("x", 1.0 - 1e-9), "updated": c.updated()}  # fmt: skip


def _jump_beside_an_idle_name(rank: int, world_size: int) -> list:
    c = Collector(forget_after=2)
    report("J", float(rank))
    report("idle", 1.0)
    c.update()
    report("J", 1e9 + rank)  # 1e9 from the last mean: the SUM is redone around a rank mean (again)
    c.update()
    seen = [c.names(), c.mean("J")]
    c.update()  # "idle" idle twice now
    return [*seen, c.names()]


def test_an_update_that_reduces_twice_counts_an_idle_name_once() -> None:
    """The rare second reduction (cancellation) finishes the update again: an idle name's count of
    updates without values must still grow by one, or forget_after forgets it early."""
    for names, mean, later in run_distributed(_jump_beside_an_idle_name, 2, timeout=60):
        assert (names, mean, later) == (["J", "idle"], 1e9 + 0.5, ["J"])


@pytest.mark.parametrize(("world_size", "shared_memory"), [(2, True), (3, False)], ids=["2-shm", "3-gloo"])
def test_non_finite_values_are_counted_over_ranks_and_hide_nothing(
    world_size: int, shared_memory: bool
) -> None:
    outputs = run_distributed(_nonfinite, world_size, shared_memory, timeout=120)
    assert all(out == outputs[0] for out in outputs)
    out = outputs[0]
    assert out["x"] == [3, 3, 2.0, 1.0, 3.0] and out["hist"] == 3 and out["only"] == [0, 1]
    assert out["q"] == pytest.approx(3.0, rel=0.01) and out["updated"] == ["only", "x"]  # finite ones only


# ------------------------------------------------------------------------------------------------
# Single process.


def test_several_collectors_each_get_values_since_their_own_last_update() -> None:
    fast = Collector(regex="A")
    slow = Collector(regex="A|B", keep_previous=False)
    everything = []
    for step in range(40):  # more than the compaction threshold of waiting tables
        report("A", float(step))
        report("B", [step, -step])
        everything.append(float(step))
        fast.update()
        assert fast.num("A") == 1 and fast.mean("A") == step
    slow.update()
    # 40 drained tables, merged one by one (in batches of 16 while waiting): at most 40 merges.
    got = slow.as_dict()
    assert_moments_close(got["A"], everything, "A", merges=40)
    assert_moments_close(got["B"], [v for step in range(40) for v in (step, -step)], "B", merges=40)
    slow.update()
    assert math.isnan(slow.mean("A")) and slow.num("A") == 0  # keep_previous=False
    fast.update()
    assert fast.mean("A") == 39.0 and fast.num("A") == 1  # keep_previous=True


def test_queries_and_bad_arguments() -> None:
    c = Collector(regex="Loss/.*")
    report("Loss/total", torch.tensor([1.0, 3.0]))
    c.update()
    assert c["Loss/total"] == 2.0 and c.as_dict() == {
        "Loss/total": {"num": 2, "mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    }
    with pytest.raises(  # matches the regex, never reported: a misspelling, not a NaN
        KeyError,
        match=r"'Loss/totl' was never reported to \(or was forgotten by\) Collector\(regex='Loss/\.\*'\); "
        r"close names: \['Loss/total'\]",
    ):
        c.mean("Loss/totl")
    report("Loss/empty", [])
    c.update()
    assert c.num("Loss/empty") == 0 and math.isnan(c.mean("Loss/empty"))  # known, no values: NaN
    assert list(c.as_dict(["Loss/total"])) == ["Loss/total"] and c.as_dict([]) == {}
    assert c.as_dict(["Loss/total"])["Loss/total"] == c.as_dict()["Loss/total"]
    with pytest.raises(KeyError, match=r"'Loss/totl' was never reported"):
        c.as_dict(["Loss/total", "Loss/totl"])
    with pytest.raises(TypeError, match=r"`names` must be a list of names, got the str 'Loss/total'"):
        c.as_dict("Loss/total")
    with pytest.raises(
        KeyError,
        match=r"'Loss_total' is not collected by Collector\(regex='Loss/\.\*'\); "
        r"close names: \['Loss/total', 'Loss/empty'\]",
    ):
        c.mean("Loss_total")
    with pytest.raises(TypeError, match=r"statistic name must be a str, got int 3"):
        c.std(3)
    with pytest.raises(ValueError, match=r"^Collector: `regex` must be a regular expression, got '\(uncl"):
        Collector(regex="(unclosed")
    with pytest.raises(TypeError, match=r"^Collector: `regex` must be a str, got 5 \(int\)$"):
        Collector(regex=5)
    with pytest.raises(TypeError, match=r"^Collector: `keep_previous` must be a bool, got 'yes' \(str\)$"):
        Collector(keep_previous="yes")


def test_state_dict_and_pickle_round_trip() -> None:
    c = Collector(regex="L.*")
    report("Loss", [1.0, 2.0])
    c.update()
    restored = Collector(regex="L.*")
    restored.load_state_dict(pickle.loads(pickle.dumps(c.state_dict())))
    restored.update()  # nothing new: keep_previous keeps the restored values
    assert restored.as_dict() == c.as_dict() and restored.updated() == []
    report("Loss", 4.0)
    restored.update()
    assert restored.updated() == ["Loss"]  # read through the host views made again at the load
    c.update()  # "Loss" idle once: the pickled idle count is 1
    clone = pickle.loads(pickle.dumps(c))  # e.g. a callback sent to ddp_spawn workers
    report("Loss", 5.0)
    clone.update()
    assert clone.mean("Loss") == 5.0 and clone.regex == "L.*"
    assert clone.updated() == ["Loss"]  # the views follow the unpickled buffers, not pickled copies


def test_a_resume_with_a_narrower_regex_loads_only_the_names_it_collects() -> None:
    c = Collector(quantiles=".*")
    report("Loss/a", [1.0, 3.0]), report("Time/b", 2.0)
    c.update()
    narrow = Collector(regex="Loss/.*", quantiles=".*", forget_after=None)
    narrow.load_state_dict(c.state_dict())
    narrow.update()
    assert narrow.names() == ["Loss/a"] and narrow.as_dict() == {"Loss/a": c.as_dict()["Loss/a"]}
    assert narrow.quantile("Loss/a", 0.5) == c.quantile("Loss/a", 0.5)
    with pytest.raises(KeyError, match="is not collected by"):  # not a stale value, published forever
        narrow.mean("Time/b")


def test_an_update_at_the_step_of_the_previous_one_is_not_counted_by_forget_after() -> None:
    # TrainingStats publishes late values (a module's on_*_epoch_end) at the step of its epoch-end
    # flush: that second update counted, and forget_after=1 forgot every other name there
    c = Collector(forget_after=2)
    report("A", 1.0), report("B", 1.0)
    c.update(step=1)
    report("A", 1.0)
    c.update(step=2)  # B: one update without values
    c.update(step=2)  # late values (none): not counted, and nothing updated
    assert (c.names(), c.updated()) == (["A", "B"], [])
    report("A", 1.0)
    c.update(step=3)  # B: two updates without values
    assert (c.names(), c.updated()) == (["A"], ["A"])


def test_a_resume_keeps_the_count_of_updates_without_values() -> None:
    # forget_after counts the updates a name went without values: a resumed run forgets it at the same
    # update as the uninterrupted one (it started every count at 1 again)
    c = Collector(forget_after=4)
    report("A", 1.0), report("B", 1.0)
    c.update()
    for _ in range(2):  # B: two updates without values
        report("A", 1.0)
        c.update()
    state, names = pickle.dumps(c.state_dict()), []
    for collector in (c, None):
        if collector is None:  # the resumed run
            clear_statistics()
            collector = Collector(forget_after=4)
            collector.load_state_dict(pickle.loads(state))
        for _ in range(2):
            report("A", 1.0)
            collector.update()
            names.append(collector.names())
    assert names == [["A", "B"], ["A"]] * 2


def test_an_interval_of_non_finite_values_only_drops_the_sketch_as_it_drops_the_statistics() -> None:
    """keep_previous keeps what a name had when it received nothing; a name that received only NaN or
    ±inf received values: its percentiles are NaN like its mean, not the last interval's."""
    kept = Collector(quantiles="x|idle")
    report("x", [1.0, 2.0, 3.0])
    report("idle", [5.0])
    kept.update()
    report("x", [math.nan, math.inf])
    kept.update()
    assert kept.updated() == ["x"] and (kept.num("x"), kept.nonfinite("x")) == (0, 2)
    assert math.isnan(kept.mean("x")) and math.isnan(kept.quantile("x", 0.5))
    assert [a.size for a in kept.histogram("x")] == [0, 0]
    assert kept.quantile("idle", 0.5) == pytest.approx(5.0, rel=0.01)  # nothing received: kept
    report("x", 4.0)
    kept.update()
    assert kept.quantile("x", 0.5) == pytest.approx(4.0, rel=0.01)


def test_a_straggler_is_kept_when_another_name_is_forgotten_in_the_same_update() -> None:
    c = Collector(stragglers="S", forget_after=1)
    report("S", [2.0, 4.0])
    report("gone", [])  # registered without values: forgotten by this update, which lays out anew
    c.update()
    rank, mean, median, ratio = c.straggler("S")
    assert c.names() == ["S"] and (rank, mean) == (0, 3.0)
    assert median == pytest.approx(3.0, rel=0.01) and ratio == pytest.approx(1.0, rel=0.01)


def test_updated_names_and_stages_keep_values_apart() -> None:
    clear_statistics()
    train, val = Collector(regex="L.*"), Collector(regex="L.*", stage="validate")
    report("Loss", [1.0, 3.0])
    outer = set_stage("validate")
    report("Loss", 10.0)
    report("Late", 7.0)
    assert set_stage(outer) == "validate"
    train.update()
    val.update()
    assert train.names() == train.updated() == ["Loss"]
    assert train.mean("Loss") == 2.0 and train.num("Loss") == 2
    assert val.names() == val.updated() == ["Late", "Loss"] and val.as_dict()["Loss"]["mean"] == 10.0
    report("Loss", 5.0)
    train.update()
    val.update()  # nothing new in validation: kept, but not updated
    assert train.updated() == ["Loss"] and train.mean("Loss") == 5.0
    assert val.updated() == [] and val.mean("Loss") == 10.0 and val.num("Late") == 1
    restored = Collector(regex="L.*", stage="validate")
    restored.load_state_dict(val.state_dict())
    assert restored.as_dict() == val.as_dict() and restored.updated() == []
    assert repr(val) == (  # every argument: what the ranks agree on
        "Collector(regex='L.*', keep_previous=True, stage='validate', quantiles=None, "
        "relative_accuracy=0.01, value_range=(1e-06, 1000000.0), stragglers=None, forget_after=100)"
    )


@pytest.mark.parametrize(
    ("stage", "error", "match"),
    [(3, TypeError, "`stage` must be a str, got int 3"), ("", ValueError, "non-empty str of printable"),
     ("a\x1fb", ValueError, "without control characters such as")],
)  # fmt: skip
def test_bad_stages_name_the_argument(stage, error, match) -> None:
    with pytest.raises(error, match=match):
        set_stage(stage)
    with pytest.raises(error, match=match):
        Collector(stage=stage)


def test_a_staged_report_checks_its_name() -> None:
    clear_statistics()
    set_stage("validate")
    try:
        with pytest.raises(ValueError, match="`name` must be a non-empty str"):
            report("", 1.0)
        with pytest.raises(TypeError, match="`name` must be a str"):
            report(3, 1.0)  # type: ignore[arg-type]
    finally:
        set_stage(None)


def test_bad_steps_and_forget_after_name_the_argument() -> None:
    c = Collector()
    with pytest.raises(ValueError, match=r"^Collector.update: `step` must be an int >= 0 or None, got -1$"):
        c.update(step=-1)
    with pytest.raises(TypeError, match=r"^Collector.update: `step` must be an int >= 0.*got 1.5 \(float\)$"):
        c.update(step=1.5)
    with pytest.raises(ValueError, match=r"^Collector: `forget_after` must be an int >= 1.*got 0$"):
        Collector(forget_after=0)
