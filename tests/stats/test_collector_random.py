"""Collector against a float64 reference over random schedules: names that come and go on some ranks,
sketched and straggler names, non-finite and empty values, ``report0``, ``keep_previous`` and
``forget_after``, on 2 and 3 ranks and on both transports (shared memory, the process group)."""

from __future__ import annotations

import math
import os
import random
import re

import numpy as np
import pytest
import torch

from lightning_ext import distributed
from lightning_ext.distributed import SHM_ENV_VAR
from lightning_ext.stats import Collector, clear_statistics, report, report0
from tests.helpers.distributed import run_distributed
from tests.helpers.float64_reference import assert_moments_close

FLUSHES = 14
FORGET = 2  # forget_after: a name no rank reported in two updates in a row is forgotten
POOL = ("A/x", "A/y", "Q/pos", "Q/both", "S/t", "N/bad", "E/empty", "R/lr")
QUANTILES, STRAGGLERS = "Q/.*|N/.*", "S/.*"
PROBES = [0.1, 0.5, 0.9]
ALPHA = 0.01  # the sketch's relative accuracy (the default), for magnitudes in its range


def _values(rng: random.Random, name: str, rank: int) -> list[float]:
    """One report's values of ``name`` on ``rank``: magnitudes from 1e-3 to 1e3 (inside the sketch's
    range, one collapse level), both signs and exact zeros where the name says so."""
    size = 0 if name == "E/empty" else rng.randint(0, 4)
    magnitude = [10.0 ** rng.uniform(-3.0, 3.0) for _ in range(size)]
    if name == "Q/both":
        return [rng.choice((-1.0, 1.0, 0.0)) * m for m in magnitude]
    if name == "S/t":  # seconds: rank r's are about (1 + r) / 100
        return [(1.0 + rank) / 100.0 + rng.random() / 1000.0 for _ in range(size)]
    if name == "N/bad":
        return [rng.choice((math.nan, math.inf, -math.inf, m)) for m in magnitude]
    if name.startswith("A/"):
        return [rng.gauss(rank, 1.0) * 100.0 for _ in range(size)]
    return magnitude  # Q/pos, R/lr


def _schedule(seed: int, world_size: int) -> list[list[list[tuple[str, list[float]]]]]:
    """``[flush][rank]``: the ``(name, values)`` that rank reports before that flush, in its order; the
    same in every process. About one flush in four most names rest (forget_after at work)."""
    rng = random.Random(seed)
    flushes = []
    for _ in range(FLUSHES):
        rate = 0.15 if rng.random() < 0.25 else 0.6
        ranks = [[(n, _values(rng, n, r)) for n in POOL if rng.random() < rate] for r in range(world_size)]
        for reports in ranks:
            rng.shuffle(reports)
        flushes.append(ranks)
    return flushes


def _snapshot(c: Collector) -> dict:
    stats = {}
    for name in c.names():
        row = [c.num(name), c.mean(name), c.std(name), c.min(name), c.max(name), c.nonfinite(name)]
        quantiles = c.quantile(name, PROBES) if re.fullmatch(QUANTILES, name) else None
        straggler = c.straggler(name) if re.fullmatch(STRAGGLERS, name) else None
        stats[name] = (row, quantiles, None if straggler is None else tuple(straggler))
    return {"names": c.names(), "updated": c.updated(), "stats": stats}


def _run(
    rank: int, world_size: int, seed: int, shared_memory: bool, keep_previous: bool, forget: int = FORGET
) -> dict:
    if not shared_memory:  # before the first reduction, which decides the transport
        os.environ[SHM_ENV_VAR] = "0"
    clear_statistics()
    c = Collector(
        quantiles=QUANTILES, stragglers=STRAGGLERS, keep_previous=keep_previous, forget_after=forget
    )
    snapshots = []
    for step, ranks in enumerate(_schedule(seed, world_size)):
        for name, values in ranks[rank]:
            (report0 if name == "R/lr" else report)(name, torch.tensor(values, dtype=torch.float64))
        c.update(step=step)
        snapshots.append(_snapshot(c))
    return {"snapshots": snapshots, "shm": distributed.shm_available()}


def _reference(seed: int, world_size: int, keep_previous: bool, forget_after: int = FORGET) -> list[dict]:
    """Per flush: the names known after the update (forgotten ones gone), those updated, and per name
    its finite values over all ranks, its non-finite count, each rank's finite values, the shift its
    sums may have been taken about (its last mean; 0 for a new name), and whether they are an earlier
    flush's (``keep_previous``)."""
    known: dict[str, dict] = {}  # name -> {"idle": updates without values, "shift", "kept": entry}
    out = []
    for ranks in _schedule(seed, world_size):
        per_name: dict[str, list[list[float]]] = {}
        for rank, reports in enumerate(ranks):
            for name, values in reports:
                counted = values if name != "R/lr" or rank == 0 else []  # report0: rank zero's only
                per_name.setdefault(name, [[] for _ in range(world_size)])[rank] += counted
        for name in per_name:
            known.setdefault(name, {"idle": 0, "shift": 0.0, "kept": None})
        entries, updated = {}, []
        for name, state in sorted(known.items()):
            by_rank = per_name.get(name, [[] for _ in range(world_size)])
            values = [v for vs in by_rank for v in vs]
            finite = [v for v in values if math.isfinite(v)]
            entry = {"finite": finite, "nonfinite": len(values) - len(finite), "shift": state["shift"],
                     "ranks": [[v for v in vs if math.isfinite(v)] for vs in by_rank]}  # fmt: skip
            state["idle"] = 0 if values else state["idle"] + 1
            if values:
                updated.append(name)
            elif keep_previous and state["kept"] is not None:
                entry = {**state["kept"], "kept": True}
            if finite:
                state["shift"] = math.fsum(finite) / len(finite)
            state["kept"] = entry
            entries[name] = entry
        for name in [n for n, state in known.items() if state["idle"] >= forget_after]:
            del known[name]  # forgotten by this update: new when reported again
        out.append({"names": sorted(known), "updated": updated, "entries": entries})
    return out


def _check_name(name: str, got: tuple, entry: dict, where: str, world_size: int) -> None:
    row, quantiles, straggler = got
    finite = entry["finite"]
    assert row[5] == entry["nonfinite"], f"{where}: nonfinite {row[5]} != {entry['nonfinite']}"
    if finite:
        stats = dict(zip(("num", "mean", "std", "min", "max"), row))
        bounds = {"shifts": (entry["shift"],), "merges": 2, "ways": max(world_size, 2)}
        assert_moments_close(stats, finite, where, **bounds)
    else:
        assert row[0] == 0 and all(math.isnan(v) for v in row[1:5]), f"{where}: {row} for no finite value"
    if quantiles is not None:
        want = np.quantile(finite, PROBES, method="inverted_cdf") if finite else [math.nan] * len(PROBES)
        for q, est, true in zip(PROBES, quantiles, want):
            ok = (math.isnan(est) and math.isnan(true)) or abs(est - true) <= ALPHA * abs(true) * (1 + 1e-9)
            assert ok, f"{where}: quantile {q} {est!r}, NumPy says {true!r} (relative accuracy {ALPHA})"
    if re.fullmatch(STRAGGLERS, name):
        means = {r: math.fsum(vs) / len(vs) for r, vs in enumerate(entry["ranks"]) if vs}
        if entry.get("kept") or not means:  # a straggler is of its last interval only
            assert straggler is None, f"{where}: straggler {straggler} without values"
            return
        rank, mean, median, _ = straggler
        slowest = max(means, key=means.get)
        assert rank == slowest and mean == pytest.approx(means[slowest], rel=2.0**-48), (
            f"{where}: {straggler}"
        )
        ordered = sorted(means.values())
        middle = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
        assert median == pytest.approx(middle, rel=ALPHA), f"{where}: median {median}, want {middle}"


@pytest.mark.slow  # processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("keep_previous", [True, False], ids=["keep", "drop"])
@pytest.mark.parametrize(("world_size", "shared_memory"), [(2, True), (3, False)], ids=["2-shm", "3-gloo"])
def test_random_schedules_match_a_float64_reference(
    world_size: int, shared_memory: bool, keep_previous: bool
):
    for seed in range(3):
        outputs = run_distributed(_run, world_size, seed, shared_memory, keep_previous, timeout=150)
        assert all(out["shm"] == shared_memory for out in outputs)  # the transport asked for
        assert repr(outputs) == repr([outputs[0]] * world_size)  # every rank alike, bit for bit
        for flush, (got, want) in enumerate(
            zip(outputs[0]["snapshots"], _reference(seed, world_size, keep_previous))
        ):
            where = f"seed {seed} flush {flush}"
            assert got["names"] == want["names"], f"{where}: names {got['names']} != {want['names']}"
            assert got["updated"] == want["updated"], (
                f"{where}: updated {got['updated']} != {want['updated']}"
            )
            for name in want["names"]:
                _check_name(name, got["stats"][name], want["entries"][name], f"{where} {name}", world_size)
