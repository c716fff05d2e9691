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
    for rank, out in enumerate(outputs):
        assert_moments_close(
            out["jump"]["stats"]["Jump/x"], jump, f"rank {rank} Jump/x", merges=2, ways=max(world_size, 2)
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
    "value_range": (1e-6, 1e6), "stragglers": None,
}  # fmt: skip
DIFFERENCES = [  # one argument at a time: what odd ranks pass instead
    ("relative_accuracy", 0.02),
    ("value_range", (1e-3, 1e3)),
    ("quantiles", None),
    ("stragglers", "L/x"),
    ("regex", "L/.*"),
    ("keep_previous", False),
    ("stage", "validate"),
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
                c.update()
            elapsed, names = time.monotonic() - start, c.names()
            init_multiprocessing(rank, None)  # alone now: the values received before the error remain
            c.update()
            out.append((restored, arg, str(info.value), elapsed, names, c.num("L/x"), c.mean("L/x")))
    return out


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_whose_collectors_differ_all_raise_naming_the_ranks(
    world_size: int, shared_memory: bool
) -> None:
    outputs = run_distributed(_differing, world_size, shared_memory, timeout=120)
    even, odd = [r for r in range(world_size) if r % 2 == 0], [r for r in range(world_size) if r % 2]
    for rank, out in enumerate(outputs):
        assert len(out) == 2 * len(DIFFERENCES)
        for restored, arg, message, elapsed, names, num, mean in out:
            where = f"rank {rank}, {arg}{' after load_state_dict' if restored else ''}"
            same, others = (odd, even) if rank % 2 else (even, odd)
            mine = re.escape(f"{arg}={(dict(DIFFERENCES)[arg] if rank % 2 else AGREED[arg])!r}")
            assert re.match(
                rf"Collector.update: the ranks' collectors differ: ranks {re.escape(str(same))} have "
                rf"Collector\(.*{mine}.*\), ranks {re.escape(str(others))} another configuration; nothing "
                r"was published\. HINT: create the Collector",
                message,
            ), f"{where}: {message}"
            assert elapsed < 30.0, f"{where}: raised after {elapsed:.1f} s"
            assert names == (["L/x"] if restored else []), f"{where}: published {names}"
            assert (num, mean) == (2, rank + 0.5), f"{where}: the values received were lost"


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
        match=r"'Loss/totl' was never reported to Collector\(regex='Loss/\.\*'\); "
        r"close names: \['Loss/total'\]",
    ):
        c.mean("Loss/totl")
    report("Loss/empty", [])
    c.update()
    assert c.num("Loss/empty") == 0 and math.isnan(c.mean("Loss/empty"))  # known, no values: NaN
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
    assert restored.as_dict() == c.as_dict()
    clone = pickle.loads(pickle.dumps(c))  # e.g. a callback sent to ddp_spawn workers
    report("Loss", 5.0)
    clone.update()
    assert clone.mean("Loss") == 5.0 and clone.regex == "L.*"


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
    assert repr(val) == "Collector(regex='L.*', keep_previous=True, stage='validate')"


@pytest.mark.parametrize(
    ("stage", "error", "match"),
    [(3, TypeError, "`stage` must be a str or None, got 3"), ("", ValueError, "non-empty"),
     ("a\x1fb", ValueError, "without")],
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
        with pytest.raises(TypeError, match="name must be a non-empty str"):
            report("", 1.0)
        with pytest.raises(TypeError, match="name must be a non-empty str"):
            report(3, 1.0)  # type: ignore[arg-type]
    finally:
        set_stage(None)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_mean_survives_the_merged_table(value: float) -> None:
    # A name registered without values sends the drain through the merged table (moment rows about
    # their means): a non-finite mean once became 0 there, its shift taken as 0.
    clear_statistics()
    c = Collector()
    report("x", [1.0, value])
    report("registered", [])
    c.update()
    assert c.num("x") == 2
    assert (math.isnan(c.mean("x")) and math.isnan(value)) or c.mean("x") == value
