"""Cost of distributed training statistics: ours vs NVIDIA-style ``report``, ``self.log(sync_dist=True)``
and torchmetrics.

Part 1, one process: ``report(name, x)`` of a float32 CPU tensor ``x`` of every size from 1 to 2**20
(powers of two, 17 and a few odd sizes), each size timed against

(a) the anchor: NVIDIA's ``training_stats.report`` algorithm for a tensor (StyleGAN2-ADA/StyleGAN3/
    EDM), written here from its description: flatten, cast to float32, stack
    ``[ones_like(x).sum(), x.sum(), x.square().sum()]``, cast to float64 and add into a float64
    counter per (name, device);
(b) one ``torch.sum`` over the same tensor (the least any statistic of it costs);

with ``torch.utils.benchmark.Timer.blocked_autorange``, at torch's default thread count and at one
thread, in interleaved rounds (anchor, ours, sum). Targets: ours <= NVIDIA-style at every size;
ours <= 2x ``torch.sum`` at 2**20; no step of ours > 2x between neighbouring sizes (neighbours
differ at most 2x in size).

Part 2, two gloo ranks on CPU (spawned by this script), K in {1, 10, 100} names reported every step,
each value a 0-dim float32 CPU tensor (what a loss looks like):

(a) ours: ``report(name, value)`` per name per step + ``Collector.update()`` every 50 steps, its two
    all_reduces through ``lightning_ext.distributed.all_reduce_`` (shared memory: both ranks on one
    host); "ours (gloo)" is the same with ``LIGHTNING_EXT_SHM_COLLECTIVES=0`` (gloo's all_reduce);
(b) Lightning's per-key path: ``_ResultCollection.log(..., on_step=True, sync_dist=True)`` per name
    per step — the object ``LightningModule.log`` forwards to — with ``sync_dist_fn`` =
    ``lightning.fabric.utilities.distributed._sync_ddp_if_available``, exactly what
    ``DDPStrategy.reduce`` calls (barrier + all_reduce + division per key per step);
(c) torchmetrics: K ``MeanMetric``s, ``update()`` per step and a synced ``compute()`` (+ ``reset()``)
    every 50 steps.

Collectives are counted in a separate pass (``_common.CollectiveCounter``, benchmark only). Targets:
``report()`` of a Python float <= 10 µs; K=100 flush >= 100x faster than torchmetrics' synced
compute; >= 50x cheaper per step than ``sync_dist=True`` at K=10.

Part 3, the flush near its floor (2 gloo ranks, spawned): ``Collector.update()`` of K in {10, 100,
1000} names, one value each, against its floor: the same two async all_reduces (MAX of ``2 + 4K``
float64, SUM of ``4K`` float64) through ``lightning_ext.distributed.all_reduce_``, timed in the same
run, interleaved; medians of the slower rank. Each timed region, flush and floor alike, starts after
the same K ``report()`` calls (untimed): a flush follows training work, whose memory traffic leaves
the caches cold, and a floor timed right after the flush would find the collective's code and segment
warm instead, and look cheaper than the same all-reduces inside the flush. Target: flush <= 2x floor.
Also ``report()`` per call (µs, best of 5 ``timeit`` repeats) of a Python float, a 0-dim tensor and
``torch.ones(20)``: target <= 3 µs each.

Part 4, quantile sketches: the flush of part 3 at K=100 with 0, 10 and 100 names sketched for
quantiles (their float64 counts in the SUM all-reduce; the floor grows with them), and ``report()`` of
a 2**20-element float32 tensor with and without its sketch, interleaved; and ``TrainingStats``' flush
with the slowest rank of 2 names (read with ``straggler()``) and the 10 sketched names' histograms
written to a ``TensorBoardLogger`` on rank zero. Target: the K=100 flush with no sketched name, and
the one with the slowest rank and the histograms, keep flush <= 2x floor. ``--quantiles-only`` runs
this part alone.

Usage: ``python benchmarks/bench_stats.py [--quick] [--sweep-only | --flush-only]``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.benchmark as tb

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import CollectiveCounter, align_ranks, environ, write_result  # noqa: E402

from lightning_ext import distributed  # noqa: E402

METHODS = ("ours", "ours (gloo)", "lightning", "torchmetrics")
SWEEP_SIZES = sorted({2**i for i in range(21)} | {17, 255, 1000, 4097, 65_537, 999_999})
SWEEP_NAME = "Bench/sweep"
DEFAULT_THREADS = torch.get_num_threads()  # torch's default, before anything sets it


# ------------------------------------------------------------------------------------------------
# Part 1: report() of one tensor, by size.

# The anchor's state: (name, device) -> float64 (3,) counter [count, sum, sum of squares].
_nvidia_counters: dict[tuple[str, torch.device], torch.Tensor] = {}


def nvidia_style_report(name: str, value: torch.Tensor) -> torch.Tensor:
    """The anchor: what NVIDIA's ``training_stats.report`` does with a tensor, per its description.

    Flatten and cast to float32, stack the count, sum and sum of squares, cast them to float64 and add
    them into the float64 counter of ``(name, device)``. No collector matching: every name counts.
    """
    x = value.detach().flatten().to(torch.float32)
    if x.numel() == 0:
        return value
    moments = torch.stack([torch.ones_like(x).sum(), x.sum(), x.square().sum()]).to(torch.float64)
    key = (name, moments.device)
    counter = _nvidia_counters.get(key)
    if counter is None:
        counter = _nvidia_counters[key] = torch.zeros_like(moments)
    counter.add_(moments)
    return value


def _timer(stmt: str, fn, x: torch.Tensor, num_threads: int) -> tb.Timer:
    return tb.Timer(stmt=stmt, globals={"fn": fn, "x": x, "name": SWEEP_NAME}, num_threads=num_threads)


def measure_sweep(
    num_threads: int, rounds: int, min_run_time: float, sizes: list[int] = SWEEP_SIZES
) -> list[dict[str, float]]:
    """Per size: median µs of ours, the NVIDIA-style anchor and ``torch.sum`` (median over ``rounds``
    interleaved rounds of ``blocked_autorange`` medians) and the paired ratio ours / anchor (median
    over rounds of each round's ratio), at ``num_threads`` threads."""
    from lightning_ext.stats import Collector, clear_statistics, report

    clear_statistics()
    _nvidia_counters.clear()
    collector = Collector(regex="Bench/.*")  # report() accumulates only names a collector wants
    rows = []
    for size in sizes:
        x = torch.randn(size, generator=torch.Generator().manual_seed(size)) + 1.0
        timers = {
            "nvidia": _timer("fn(name, x)", nvidia_style_report, x, num_threads),
            "ours": _timer("fn(name, x)", report, x, num_threads),
            "sum": _timer("fn(x)", torch.sum, x, num_threads),
        }
        times: dict[str, list[float]] = {k: [] for k in timers}
        for _ in range(rounds):
            for key, timer in timers.items():
                times[key].append(timer.blocked_autorange(min_run_time=min_run_time).median * 1e6)
        ratios = [o / a for o, a in zip(times["ours"], times["nvidia"])]
        rows.append(
            {
                "size": size,
                **{k: statistics.median(v) for k, v in times.items()},
                "paired": statistics.median(ratios),
            }
        )
        collector.update()  # keep the pending table small; untimed
    clear_statistics()
    _nvidia_counters.clear()
    return rows


def sweep_targets(rows: list[dict[str, float]]) -> list[tuple[str, str, str, bool]]:
    """(label, measured, goal, met) of the three targets of the size sweep."""
    worst = max(rows, key=lambda r: r["paired"])
    steps = [(b["ours"] / a["ours"], a["size"], b["size"]) for a, b in itertools.pairwise(rows)]
    step, lo, hi = max(steps) if steps else (1.0, rows[0]["size"], rows[0]["size"])
    last = rows[-1]
    vs_sum = last["ours"] / last["sum"]
    return [
        (
            "ours / NVIDIA-style, worst size",
            f"{worst['paired']:.2f}× at {worst['size']}",
            "≤ 1× at every size",
            all(r["paired"] <= 1.0 for r in rows),
        ),
        (f"ours / torch.sum at {last['size']}", f"{vs_sum:.2f}×", "≤ 2×", vs_sum <= 2.0),
        (
            "largest step of ours between neighbouring sizes",
            f"{step:.2f}× ({lo} → {hi})",
            "≤ 2×",
            step <= 2.0,
        ),
    ]


def format_sweep(results: dict[int, list[dict[str, float]]], rounds: int) -> str:
    lines = [
        "## `report()` of one CPU tensor by size (`bench_stats.py`)",
        "",
        "One process; `report(name, x)` of a float32 CPU tensor `x` (a collector wants the name), against "
        "the anchor: NVIDIA's `training_stats.report` algorithm for a tensor (flatten, cast to float32, "
        "stack count, sum and sum of squares, cast to float64, add into a float64 counter per (name, "
        "device); written in `bench_stats.py` from that description), and one `torch.sum` over `x`. "
        f"`torch.utils.benchmark.Timer.blocked_autorange` medians, {rounds} interleaved rounds (anchor, "
        "ours, sum) per size, median over rounds; ratio = median over rounds of ours / anchor; step = "
        "ours at this size / ours at the previous size (neighbours differ at most 2× in size).",
    ]
    for threads, rows in results.items():
        lines += [
            "",
            f"**{threads} thread{'s' if threads > 1 else ''}** "
            + (
                "(torch's default on this machine)"
                if threads == DEFAULT_THREADS
                else "(`torch.set_num_threads(1)`)"
            ),
            "",
            "| size | ours µs | NVIDIA-style µs | ratio | torch.sum µs | ours / sum | step |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        previous = None
        for r in rows:
            step = f"{r['ours'] / previous:.2f}×" if previous else "—"
            lines.append(
                f"| {r['size']} | {r['ours']:.2f} | {r['nvidia']:.2f} | {r['paired']:.2f}× | "
                f"{r['sum']:.2f} | {r['ours'] / r['sum']:.2f}× | {step} |"
            )
            previous = r["ours"]
        lines += ["", "| target | measured | goal | met |", "|---|---:|---:|:---:|"]
        for label, value, goal, met in sweep_targets(rows):
            lines.append(f"| {label} | {value} | {goal} | {'yes' if met else 'NO'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Part 2: the three methods on two ranks; each returns a callable doing one step, and one that flushes.


def _ours(k: int):
    from lightning_ext.stats import Collector, clear_statistics, report

    clear_statistics()
    collector = Collector()
    names = [f"Metric/{i}" for i in range(k)]

    def step(values: list[torch.Tensor]) -> None:
        for name, value in zip(names, values):
            report(name, value)

    def flush() -> None:
        collector.update()

    return step, flush


def _lightning(k: int):
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    names = [f"Metric/{i}" for i in range(k)]

    def step(values: list[torch.Tensor]) -> None:
        for name, value in zip(names, values):
            results.log(
                "training_step",
                name,
                value,
                on_step=True,
                on_epoch=False,
                sync_dist=True,
                sync_dist_fn=_sync_ddp_if_available,
                batch_size=1,
            )

    def flush() -> None:  # the values were synchronized as they were logged
        pass

    return step, flush


def _torchmetrics(k: int):
    from torchmetrics import MeanMetric

    metrics = [MeanMetric() for _ in range(k)]

    def step(values: list[torch.Tensor]) -> None:
        for metric, value in zip(metrics, values):
            metric.update(value)

    def flush() -> None:
        for metric in metrics:
            metric.compute()
            metric.reset()

    return step, flush


_FACTORIES = {"ours": _ours, "lightning": _lightning, "torchmetrics": _torchmetrics}


def _run_method(method: str, k: int, steps: int, flush_every: int, rank: int) -> dict[str, float]:
    if method == "ours (gloo)":  # our Collector with its all_reduces on gloo instead of shared memory
        with environ(**{distributed.SHM_ENV_VAR: "0"}):
            return _run_method("ours", k, steps, flush_every, rank)
    step, flush = _FACTORIES[method](k)
    gen = torch.Generator().manual_seed(rank)
    values = [[torch.rand((), generator=gen) for _ in range(k)] for _ in range(flush_every)]
    # Lightning syncs inside every step, identically: a few steps suffice to warm up and count.
    probe = 2 if method == "lightning" else flush_every
    # Warm-up period (the first update agrees on the names; allocations; lazy imports).
    for s in range(probe):
        step(values[s])
    flush()
    # Count the collectives of one steady-state period.
    with CollectiveCounter() as counter:
        for s in range(probe):
            step(values[s])
        per_step_calls = counter.count / probe
        before = counter.count
        flush()
        flush_calls = counter.count - before
    align_ranks()
    step_time = 0.0
    flush_times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step(values[s % flush_every])
        step_time += time.perf_counter() - t0
        if (s + 1) % flush_every == 0:
            align_ranks()  # not timed: keeps rank skew of the step loop out of the flush figure
            t1 = time.perf_counter()
            flush()
            flush_times.append(time.perf_counter() - t1)
    return {
        "step_us": 1e6 * (step_time + sum(flush_times)) / steps,  # amortised, flushes included
        "flush_ms": 1e3 * statistics.median(flush_times) if flush_times else 0.0,  # robust to noise
        "collectives_per_period": per_step_calls * flush_every + flush_calls,
        "collectives_per_flush": flush_calls,
    }


def _worker(rank: int, world_size: int, init_file: str, config: dict, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        distributed.shm_available()  # set the shared-memory segment up now, outside every counted pass
        results: dict[str, dict[int, dict[str, float]]] = {m: {} for m in METHODS}
        for k in config["ks"]:
            for method in METHODS:
                steps = config["steps"]
                if method == "lightning":  # 2k collectives per step: fewer steps, same per-step figure
                    steps = config["lightning_steps"] or max(config["flush_every"], steps * 10 // max(k, 10))
                stats = _run_method(method, k, steps, config["flush_every"], rank)
                # Both ranks did the same work; report the slower rank's timings.
                t = torch.tensor([stats["step_us"], stats["flush_ms"]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                stats["step_us"], stats["flush_ms"] = t.tolist()
                results[method][k] = stats
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def run_benchmark(
    ks: tuple[int, ...] = (1, 10, 100),
    steps: int = 500,
    flush_every: int = 50,
    world_size: int = 2,
    lightning_steps: int | None = None,
) -> dict[str, dict[int, dict[str, float]]]:
    """Spawn ``world_size`` gloo ranks and time the methods; returns ``{method: {K: figures}}``.

    ``lightning_steps`` (default: ``max(flush_every, steps * 10 // K)``) is the number of timed
    steps of the Lightning path, whose per-step cost does not depend on the flush period.

    Figures: ``step_us`` (per-step cost amortised over flushes), ``flush_ms`` (one flush),
    ``collectives_per_period`` (per ``flush_every`` steps, flush included), ``collectives_per_flush``.
    """
    with tempfile.TemporaryDirectory(prefix="bench_stats_") as tmp:
        init_file, out_file = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        config = {
            "ks": tuple(ks),
            "steps": steps,
            "flush_every": flush_every,
            "lightning_steps": lightning_steps,
        }
        with environ(OMP_NUM_THREADS="1"):
            mp.spawn(_worker, args=(world_size, init_file, config, out_file), nprocs=world_size, join=True)
        return torch.load(out_file)


def measure_float_report(calls: int) -> float:
    """``report()`` µs per call of a Python float in this process (best of three loops)."""
    from lightning_ext.stats import Collector, clear_statistics, report

    clear_statistics()
    collector = Collector()
    for _ in range(100):
        report("Bench/value", 0.5)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            report("Bench/value", 0.5)
        best = min(best, (time.perf_counter() - t0) / calls)
    collector.update()
    clear_statistics()
    return best * 1e6


def measure_report_calls(number: int = 20_000, repeat: int = 5) -> dict[str, tuple[float, float]]:
    """``report()`` µs per call of a Python float, a 0-dim float32 tensor and ``torch.ones(20)``, in this
    process, a collector wanting the name, and the anchor's (:func:`nvidia_style_report` of the value as
    NVIDIA's ``report`` takes it, ``torch.as_tensor``): ``{label: (ours, anchor)}``, each the best of
    ``repeat`` ``timeit`` loops of ``number`` calls, ours and the anchor's loops alternating (a machine's
    slow phase slows both)."""
    import timeit

    from lightning_ext.stats import Collector, clear_statistics, report

    clear_statistics()
    collector = Collector()
    values = {"Python float": 0.5, "0-dim tensor": torch.tensor(0.5), "torch.ones(20)": torch.ones(20)}
    result = {}
    for label, value in values.items():
        report("Bench/value", value)  # the first report of a name sets its accumulator up: untimed
        nvidia_style_report("Bench/value", torch.as_tensor(value))
        fns = (lambda v=value: report("Bench/value", v),
               lambda v=value: nvidia_style_report("Bench/value", torch.as_tensor(v)))  # fmt: skip
        loops = [[timeit.timeit(fn, number=number) for fn in fns] for _ in range(repeat)]
        result[label] = tuple(min(times) / number * 1e6 for times in zip(*loops))
        collector.update()
    clear_statistics()
    return result


def measure_tensorboard(keys: int = 100, flushes: int = 50) -> dict[str, float]:
    """ms per flush of writing ``keys`` scalars to a ``TensorBoardLogger``, the writer thread waited
    for (``flush()``): Lightning's ``log_metrics`` (an event a key, TensorBoard's own checksums: the
    anchor) against ``TrainingStats``' one event (checksummed as its ``setup`` has TensorBoard's writer
    do), alternating; medians over ``flushes`` each, in this process."""
    import tempfile

    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    from lightning_ext.callbacks.training_stats import (
        _fast_tensorboard_checksums,
        _tensorboard_writer,
        _write_event,
    )

    _fast_tensorboard_checksums()
    checksums = {"anchor": pywrap_tensorflow.masked_crc32c, "ours": record_writer.masked_crc32c}

    metrics = {f"Metric/{i}": 0.5 + i for i in range(keys)}
    with tempfile.TemporaryDirectory(prefix="bench_tb_") as tmp:
        anchor, ours = (TensorBoardLogger(tmp, name=name, version=0) for name in ("anchor", "ours"))
        writes = {
            "anchor": lambda step: (anchor.log_metrics(metrics, step), anchor.experiment.flush()),
            "ours": lambda step: (_write_event(_tensorboard_writer(ours), None, metrics, [], step),
                                  ours.experiment.flush()),
        }  # fmt: skip
        times: dict[str, list[float]] = {label: [] for label in writes}
        for step in range(flushes):
            for label, write in writes.items():
                record_writer.masked_crc32c = checksums[label]  # (the writer thread reads it per record)
                start = time.perf_counter()
                write(step)
                times[label].append(time.perf_counter() - start)
        record_writer.masked_crc32c = checksums["ours"]
        anchor.finalize("success"), ours.finalize("success")
    return {label: 1e3 * statistics.median(t) for label, t in times.items()}


def format_tensorboard(ms: dict[str, float], keys: int = 100) -> str:
    return "\n".join([
        "## Writing a flush to TensorBoard (`bench_stats.py --flush-only`)",
        "",
        f"{keys} scalars a flush to a `TensorBoardLogger`, the event writer's thread waited for "
        "(`experiment.flush()`), medians over 50 alternating flushes in one process: Lightning's "
        "`log_metrics` writes an event a key into a queue of 10, checksummed by TensorBoard in pure Python, "
        "`TrainingStats` one event holding them all (`_write_event`; the same values read back: "
        "`test_training_stats.py`), checksummed by google-crc32c.",
        "",
        "| anchor: `log_metrics` ms | ours: one event ms | ours / anchor |",
        "|---:|---:|---:|",
        f"| {ms['anchor']:.2f} | {ms['ours']:.2f} | {ms['ours'] / ms['anchor']:.2f}× |",
    ])  # fmt: skip


class _Recorder:
    """Records the all-reduces ``Collector.update()`` issues (benchmark only): ``(op, numel, async)`` each,
    through the name the collector module calls (shared memory or the process group alike)."""

    def __init__(self) -> None:
        from lightning_ext.stats import collector as module

        self.module, self.real, self.calls = module, module.all_reduce_, []

    def __enter__(self) -> _Recorder:
        def recorded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append((op, tensor.numel(), async_op))
            return self.real(tensor, op=op, group=group, async_op=async_op)

        self.module.all_reduce_ = recorded
        return self

    def __exit__(self, *exc) -> None:
        self.module.all_reduce_ = self.real


def _floor(calls: list[tuple]) -> tuple:
    """The flush's collectives alone: float64 buffers of the recorded sizes, reduced by
    ``lightning_ext.distributed.all_reduce_`` with the recorded ops, the asynchronous ones together
    (as the flush issues them), the others one after another."""
    from lightning_ext.distributed import all_reduce_

    buffers = [(op, torch.zeros(numel, dtype=torch.float64), async_op) for op, numel, async_op in calls]

    def floor() -> None:
        works = []
        for op, buffer, async_op in buffers:
            work = all_reduce_(buffer, op=op, async_op=async_op)
            works += [work] if async_op else []
        for work in works:
            work.wait()

    return floor, 8 * sum(b.numel() for _, b, _ in buffers)


def _flush_worker(rank: int, world_size: int, init_file: str, config: dict, out_file: str) -> None:
    torch.set_num_threads(1)
    if config["transport"] == "gloo":
        os.environ[distributed.SHM_ENV_VAR] = "0"  # before the first reduction, which decides it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from lightning_ext.stats import Collector, clear_statistics, report

        distributed.shm_available()
        results = {}
        for case in config["cases"]:
            k, sketched, straggled, throughput = (*case, 0, 0)[:4]
            clear_statistics()
            tracked = "Straggled/.*|Throughput/sec_per_sample"  # TrainingStats' default tracks the latter
            collector = Collector(quantiles="Sketched/.*", stragglers=tracked)
            names = [f"Sketched/{i}" if i < sketched else f"Metric/{i}" for i in range(k - straggled)]
            names += [f"Straggled/{i}" for i in range(straggled)]
            gen = torch.Generator().manual_seed(rank)
            values = [torch.rand((), generator=gen) for _ in range(k)]
            flush = _signal_flush(collector, names, config["tmp"], rank) if straggled else collector.update
            flush = _throughput_flush(collector, rank) if throughput else flush
            for _ in range(2):  # the first update agrees on the names; the second is the steady state
                for name, value in zip(names, values):
                    report(name, value)
                with _Recorder() as recorder:
                    flush()
            floor, nbytes = _floor(recorder.calls)
            floor()
            times: dict[str, list[float]] = {"flush": [], "floor": []}
            for _ in range(config["rounds"]):
                for key, fn in (("flush", flush), ("floor", floor)):
                    for name, value in zip(names, values):  # untimed, before each: the same cache state
                        report(name, value)
                    align_ranks()
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            t = torch.tensor(
                [statistics.median(times["flush"]), statistics.median(times["floor"])], dtype=torch.float64
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[case] = {"flush_ms": 1e3 * t[0].item(), "floor_ms": 1e3 * t[1].item(), "bytes": nbytes,
                             "collectives": len(recorder.calls)}  # fmt: skip
        clear_statistics()
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


_SIGNAL_CASE = (100, 10, 2)  # K names, sketched (histograms written), with the straggler tracked
_THROUGHPUT_CASE = (100, 0, 0, 1)  # K names and what Throughput adds to the flush
_FLUSH_CASES = ((10, 0), (100, 0), (1000, 0), (100, 100), _SIGNAL_CASE, _THROUGHPUT_CASE)


def _throughput_flush(collector, rank: int):
    """What ``Throughput`` adds to a flush (``before_stats_flush`` and ``stats_flush_metrics``, without
    a Trainer): its per-rank values of the interval reported, rank zero's goodput ledger ``report0``-ed,
    the slowest rank by throughput read and the global rates, MFU and spread derived after the update.
    Its names ride in the same two all-reduces (the floor carries them too)."""
    from lightning_ext.callbacks.throughput import _throughput_metrics
    from lightning_ext.perf import LOST_TIME_CAUSES, GoodputLedger
    from lightning_ext.stats import report, report0

    ledger = GoodputLedger()
    samples = 32 + 16 * rank

    def flush() -> None:
        ledger.productive(0.01)
        train_sec = 0.05 + 0.01 * rank
        report("Throughput/train_sec", train_sec)
        report("Throughput/samples", samples)
        report("Throughput/sec_per_sample", train_sec / samples)
        report("Throughput/tokens", 128 * samples)
        report("Throughput/flops", 1e9 * samples)
        report("Throughput/peak_flops_per_sec", 1e12)
        summary = ledger.summary()
        report0("Goodput/goodput", summary["goodput"])
        for part in ("productive", *LOST_TIME_CAUSES, "other"):
            report0(f"Goodput/{part}_sec", summary[part])
        collector.update()
        _throughput_metrics(collector)

    return flush


def _signal_flush(collector, names: list[str], tmp: str, rank: int):
    """What ``TrainingStats.flush`` adds to ``collector.update()`` for the straggler and the
    histograms: every straggler name's :meth:`straggler`, and on rank zero every sketched name's
    histogram written to a real ``TensorBoardLogger`` (its event file in ``tmp``) as the flush writes
    them (one event), the event writer's thread's work included (``flush()``)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_ext.callbacks.training_stats import (
        _fast_tensorboard_checksums,
        _tensorboard_writer,
        _write_event,
    )

    logger = TensorBoardLogger(tmp, name="tb", version=rank) if rank == 0 else None
    if logger is not None:
        _fast_tensorboard_checksums()  # as TrainingStats' setup does
    straggled = [n for n in names if n.startswith("Straggled/")]
    sketched = [n for n in names if n.startswith("Sketched/")]
    steps = iter(range(1 << 30))

    def flush() -> None:
        collector.update()
        for name in straggled:
            collector.straggler(name)
        if logger is not None:  # (the writer thread's work in the flush's time, not in the floor's)
            writer = _tensorboard_writer(logger)
            _write_event(writer, collector, {}, [(n, n + "/hist") for n in sketched], next(steps))
            writer.flush()

    return flush


def run_flush_floor(
    cases: tuple[tuple[int, ...], ...] = _FLUSH_CASES, rounds: int = 200, world_size: int = 2,
    transport: str = "shm",
) -> dict[tuple[int, ...], dict[str, float]]:  # fmt: skip
    """Spawn ``world_size`` gloo ranks (``transport``: ``"shm"``, the shared-memory path, or ``"gloo"``,
    the process group's); per (K names, of which sketched[, of which with the straggler]) the median ms
    of ``Collector.update()`` (with the straggler reads and histogram writes of ``TrainingStats`` when
    some names have the straggler) and of its floor, the bytes per rank and collectives of one flush."""
    with tempfile.TemporaryDirectory(prefix="bench_stats_") as tmp:
        init_file, out_file = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        config = {"cases": tuple(cases), "rounds": rounds, "tmp": tmp, "transport": transport}
        with environ(OMP_NUM_THREADS="1"):
            mp.spawn(
                _flush_worker, args=(world_size, init_file, config, out_file), nprocs=world_size, join=True
            )
        return torch.load(out_file)


def _case_label(case: tuple[int, ...]) -> str:
    k, sketched, straggled, throughput = (*case, 0, 0)[:4]
    extra = f", {sketched} sketched" if sketched else ""
    extra += " + Throughput's fields (15 names, its straggler, the derived rates)" if throughput else ""
    return f"{k}{extra}{f' + histograms, {straggled} with the straggler' if straggled else ''}"


def format_flush_floor(floors: dict[str, dict], calls: dict[str, tuple[float, float]], rounds: int) -> str:
    lines = [
        "## Flush vs its floor, and `report()` per call (`bench_stats.py`)",
        "",
        "2 gloo ranks on CPU, one thread each: `Collector.update()` of K names (one 0-dim value each, "
        "reported untimed before each timed region, flush and floor alike, so that both start from the same "
        "cache state), some sketched for quantiles, against its floor: the "
        "all-reduces the flush issued (recorded in its steady state), with the same sizes and ops through "
        "`lightning_ext.distributed.all_reduce_`, the asynchronous ones together as the flush issues them, "
        f"interleaved in the same run; medians over {rounds} flushes, slower rank; ranks aligned (untimed) "
        "before each. `shm`: the shared-memory path of `all_reduce_`; `gloo`: the process group's "
        "(`LIGHTNING_EXT_SHM_COLLECTIVES=0`). The case with histograms is `TrainingStats`' flush with the "
        "straggler of 2 names and the 10 sketched names' histograms written to a `TensorBoardLogger` on "
        "rank zero as `TrainingStats` writes them (one event), the event writer's thread waited for inside "
        "the flush (else its work lands in the floor's time), its records checksummed by google-crc32c as "
        "`TrainingStats` has TensorBoard's writer do (TensorBoard's own CRC32C, in pure Python, costs "
        "about 0.3 µs a byte; a histogram's buckets take 16 bytes each). The one with Throughput's fields "
        "times what `Throughput` adds to `TrainingStats`' flush.",
        "",
        "| transport | K | bytes / rank | collectives | flush ms | floor ms | flush / floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    worst = {"names": 0.0, "throughput": 0.0}  # issue targets: K names (sketched or not); with Throughput
    for transport, floor in floors.items():
        for case, r in floor.items():
            ratio = r["flush_ms"] / r["floor_ms"]
            straggled, throughput = (*case, 0, 0)[2:4]
            if not straggled:
                key = "throughput" if throughput else "names"
                worst[key] = max(worst[key], ratio)
            lines.append(
                f"| {transport} | {_case_label(case)} | {r['bytes']} | {r['collectives']} | "
                f"{r['flush_ms']:.3f} | {r['floor_ms']:.3f} | {ratio:.1f}× |"
            )
    lines += [
        "",
        "`report(name, value)` per call in one process (best of 5 `timeit` loops), a collector "
        "wanting the name, against the anchor (NVIDIA's `training_stats.report` as `nvidia_style_report` "
        "does it, the value through `torch.as_tensor`), their loops alternating:",
        "",
        "| value | ours µs / call | anchor µs / call | ours / anchor |",
        "|---|---:|---:|---:|",
        *(f"| {label} | {us:.2f} | {anchor:.2f} | {us / anchor:.2f}× |"
          for label, (us, anchor) in calls.items()),
        "",
        "| target | measured | goal | met |",
        "|---|---:|---:|:---:|",
        *(f"| flush / floor, worst {label} | {w:.1f}× | ≤ 2× | {'yes' if w <= 2 else 'NO'} |"
          for label, w in zip(("of K names", "with Throughput's fields"), worst.values())),
    ]
    slowest = max(us for us, _ in calls.values())
    met = "yes" if slowest <= 3 else "NO"
    lines.append(f"| `report()` per call, slowest value | {slowest:.2f} µs | ≤ 3 µs | {met} |")
    return "\n".join(lines)


def format_world_sizes(curve: dict[int, dict], rounds: int) -> str:
    lines = [
        "## The flush by world size (`bench_stats.py --world-sizes`)",
        "",
        "W gloo ranks on this host (shared memory), one thread each, as the flush above; bytes per rank of "
        "one steady-state flush exactly (the float64 elements of its all-reduces), time as flush / floor "
        f"(medians over {rounds} flushes, slowest rank). The host's cores are shared by the W ranks: "
        "absolute times grow with W, the ratio is what the flush adds. The bytes of the names without a "
        "sketch do not depend on W. A sketched name's window is the buckets between the min and max over "
        "every rank's values (more ranks' draws span more of them) with `log2(W n)` bits per count: it "
        "grows with W until it reaches its cap, 640 words (5 KiB) whatever W, where the sketch collapses.",
        "",
        "| W | K | bytes / rank | collectives | flush / floor |",
        "|---:|---|---:|---:|---:|",
    ]
    for w, floor in curve.items():
        for case, r in floor.items():
            lines.append(f"| {w} | {_case_label(case)} | {r['bytes']} | {r['collectives']} | "
                         f"{r['flush_ms'] / r['floor_ms']:.1f}× |")  # fmt: skip
    return "\n".join(lines)


# The cost model: NCCL's own tuning model (src/graph/tuning.cc of NVIDIA/nccl, 2.19-2.21), all-reduce by
# double binary tree, 8 GPUs per node on NVLink, the nodes on a network: latency in µs
# baseLat + 2 ((ppn - 1) hwLat[NVLink] + log2(nodes) hwLat[NET]) per protocol, plus bytes / algorithm
# bandwidth.
# The bandwidths are assumptions of this model (one 400 Gb/s NIC per GPU: 50 GB/s), named in the table.
_NCCL_TREE = {  # protocol: (baseLat, hwLat NVLink, hwLat NET) µs, algorithm bandwidth GB/s
    "LL": (6.8, 0.6, 5.0, 10.2),  # LL: the bus bandwidth capped by llMaxBw (20.4 GB/s), halved (tree)
    "LL128": (14.0, 1.25, 8.5, 0.5 * 0.92 * 120 / 128 * 50),  # tree LL128: .92, 120/128, halved
}


def nccl_all_reduce_us(nbytes: float, ranks: int, ppn: int = 8) -> tuple[float, str]:
    """Modelled time of one NCCL all-reduce of ``nbytes`` over ``ranks`` GPUs (``ppn`` per node), µs,
    and the protocol the model picks (the fastest)."""
    nodes = max(1, ranks // ppn)
    times = {p: base + 2 * ((ppn - 1) * nvl + math.log2(nodes) * net) + nbytes / (1e3 * bw)
             for p, (base, nvl, net, bw) in _NCCL_TREE.items()}  # fmt: skip
    protocol = min(times, key=times.get)
    return times[protocol], protocol


def cost_model(ks: tuple[int, ...] = (100, 1000), sketched: tuple[int, ...] = (0, 100),
               ranks: tuple[int, ...] = (1024, 16384), words: int = 640) -> str:  # fmt: skip
    """The cost model of one steady-state flush at scale: bytes per rank and collectives of this flush
    (MAX ``8 (7 + 5K)`` B, SUM ``8 (5K + Q W)`` B, ``W <= 640`` words per sketched name: the cap) and of
    the flush before it (a configuration slot per rank in the MAX, 2767 float64 per sketched name), and
    their modelled NCCL time (:func:`nccl_all_reduce_us`; the two all-reduces one after the other)."""
    lines = [
        "## The flush at 1,024 and 16,384 ranks: a cost model (`bench_stats.py --cost-model`)",
        "",
        "Bytes per rank of one steady-state flush (exact, from the layout), 2 all-reduces; time from NCCL's "
        "own tuning model (`src/graph/tuning.cc` of NVIDIA/nccl 2.19-2.21: tree all-reduce, 8 GPUs per "
        "node, latency `baseLat + 2 ((ppn-1) hwLat[NVLink] + log2(nodes) hwLat[NET])` + bytes / bandwidth, "
        "the faster of LL (10.2 GB/s) and LL128 (21.6 GB/s, assuming one 400 Gb/s NIC per GPU)). "
        f"Sketched names at the cap ({words} words = 5 KiB each): an upper bound. `before`: the layout of "
        "the previous flush (a slot per rank in the MAX, 2767 float64 per sketched name).",
        "",
        "| ranks | K | sketched | bytes / rank | modelled µs | before: bytes / rank | before: µs |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in ranks:
        for k in ks:
            for q in sketched:
                now = (8 * (7 + 5 * k), 8 * (5 * k + q * words))
                old = (8 * (w + 2 + 5 * k), 8 * (4 * k + q * 2767))
                t_now = sum(nccl_all_reduce_us(b, w)[0] for b in now)
                t_old = sum(nccl_all_reduce_us(b, w)[0] for b in old)
                lines.append(f"| {w} | {k} | {q} | {sum(now)} | {t_now:.0f} | {sum(old)} | {t_old:.0f} |")
    return "\n".join(lines)


def measure_report_histogram(repeat: int = 20) -> dict[str, float]:
    """ms per ``report()`` of a 2**20-element float32 tensor, without and with its quantile sketch
    (best of ``repeat``, interleaved), in this process on the automatic CPU backend."""
    from lightning_ext.stats import Collector, clear_statistics, report

    clear_statistics()
    collector = Collector(quantiles="Sketched")
    x = torch.randn(2**20, generator=torch.Generator().manual_seed(0)).exp()
    times: dict[str, list[float]] = {"Plain": [], "Sketched": []}
    for name in times:
        report(name, x)  # sets the accumulator up: untimed
    for _ in range(repeat):
        for name in times:
            t0 = time.perf_counter()
            report(name, x)
            times[name].append(time.perf_counter() - t0)
        collector.update()
    clear_statistics()
    return {name: 1e3 * min(t) for name, t in times.items()}


def format_quantiles(report_ms: dict[str, float]) -> str:
    from lightning_ext.stats import LogHistogram

    plain, sketched = report_ms["Plain"], report_ms["Sketched"]
    return "\n".join([
        "## Quantile sketches: `report()` of a large tensor (`bench_stats.py`)",
        "",
        f"One process, the automatic CPU backend: `report()` of a 2^20-element float32 tensor without and "
        f"with its sketch (α = 1 %, {LogHistogram().size} float64 counts per name and device; the flush "
        "sends only their window, at most 5 KiB: see the flush table), best of 20, interleaved.",
        "",
        "| report() | ms |",
        "|---|---:|",
        f"| moments only | {plain:.3f} |",
        f"| moments + histogram | {sketched:.3f} ({sketched / plain:.1f}×) |",
    ])  # fmt: skip


def format_markdown(results: dict, float_us: float, flush_every: int = 50) -> str:
    lines = [
        "## Training statistics, 2 ranks (`bench_stats.py`)",
        "",
        "2 gloo ranks on CPU, K names reported every step (0-dim float32 tensors), "
        f"flush every {flush_every} steps. (a) ours: `report()` + `Collector.update()`; "
        "(b) Lightning: `_ResultCollection.log(..., "
        "on_step=True, sync_dist=True)` with `_sync_ddp_if_available` (what `self.log(sync_dist=True)` runs "
        "per key per step: barrier + all_reduce); (c) torchmetrics: K `MeanMetric` with synced "
        "`compute()` + `reset()` per flush. Step cost is amortised (flushes included); the slower rank "
        "counts; an untimed all_reduce aligns the ranks before each flush so rank skew is not "
        "counted as flush time; "
        "flush ms is the median over the flushes of the run.",
        "",
        f"| K | method | µs / step | flush ms | collectives / {flush_every} steps | collectives / flush |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for k in sorted(results["ours"]):
        for method in METHODS:
            r = results[method][k]
            lines.append(
                f"| {k} | {method} | {r['step_us']:.1f} | {r['flush_ms']:.3f} | "
                f"{r['collectives_per_period']:.0f} | {r['collectives_per_flush']:.0f} |"
            )
    lines += ["", "| target | measured | goal | met |", "|---|---:|---:|:---:|"]
    for label, value, goal, met in targets(results, float_us):
        lines.append(f"| {label} | {value} | {goal} | {'yes' if met else 'NO'} |")
    return "\n".join(lines)


def targets(results: dict, float_us: float) -> list[tuple[str, str, str, bool]]:
    """(label, measured, goal, met) of the scalar ``report()`` cost and the two-rank targets."""
    rows = [("`report()` Python float", f"{float_us:.2f} µs", "≤ 10 µs", float_us <= 10)]
    if 100 in results["ours"]:
        ratio = results["torchmetrics"][100]["flush_ms"] / results["ours"][100]["flush_ms"]
        rows.append(
            ("K=100 flush: torchmetrics compute / ours update", f"{ratio:.0f}×", "≥ 100×", ratio >= 100)
        )
    if 10 in results["ours"]:
        ratio = results["lightning"][10]["step_us"] / results["ours"][10]["step_us"]
        rows.append(("K=10 per step: sync_dist=True / ours", f"{ratio:.0f}×", "≥ 50×", ratio >= 50))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (smoke run)")
    parser.add_argument("--sweep-only", action="store_true", help="only part 1, the size sweep")
    parser.add_argument("--flush-only", action="store_true", help="only part 3, flush vs floor and report()")
    parser.add_argument("--quantiles-only", action="store_true", help="only part 4, quantile sketches")
    parser.add_argument("--transports", default="shm,gloo", help="part 3's transports: shm, gloo or both")
    parser.add_argument("--world-sizes", help="only the flush by world size, e.g. 2,4,8,16 (gloo ranks)")
    parser.add_argument("--cost-model", action="store_true", help="only print the cost model at scale")
    args = parser.parse_args()
    flush_rounds = 50 if args.quick else 300
    if args.cost_model:  # (printed only: the full run writes it into RESULTS.md)
        print(cost_model(), flush=True)
        return 0
    if args.world_sizes:
        sizes = [int(w) for w in args.world_sizes.split(",")]
        cases = ((100, 0), (100, 100))
        curve = {w: run_flush_floor(cases, rounds=flush_rounds // 2, world_size=w) for w in sizes}
        markdown = format_world_sizes(curve, flush_rounds // 2)
        print(markdown, flush=True)
        write_result("stats_world_sizes", markdown, quick=args.quick)
        return 0
    if args.quantiles_only:
        return _quantiles(args.quick)
    if args.flush_only:
        return _flush(args, flush_rounds)
    rounds, min_run_time = (1, 0.02) if args.quick else (3, 0.2)
    sweep = {}
    for threads in dict.fromkeys((DEFAULT_THREADS, 1)):
        sweep[threads] = measure_sweep(threads, rounds, min_run_time)
    markdown = format_sweep(sweep, rounds)
    print(markdown, flush=True)
    write_result("stats_sweep", markdown, quick=args.quick)
    if args.sweep_only:
        return 0
    float_us = measure_float_report(20_000 if args.quick else 200_000)
    results = run_benchmark(steps=100 if args.quick else 500)
    markdown = format_markdown(results, float_us)
    print(markdown)
    write_result("stats", markdown, quick=args.quick)
    _flush(args, flush_rounds)
    print(cost_model())
    write_result("stats_cost_model", cost_model(), quick=args.quick)
    return _quantiles(args.quick)


def _flush(args: argparse.Namespace, rounds: int) -> int:
    floors = {t: run_flush_floor(rounds=rounds, transport=t) for t in args.transports.split(",")}
    markdown = format_flush_floor(floors, measure_report_calls(), rounds)
    print(markdown, flush=True)
    write_result("stats_flush_floor", markdown, quick=args.quick)
    markdown = format_tensorboard(measure_tensorboard())
    print(markdown, flush=True)
    write_result("stats_tensorboard", markdown, quick=args.quick)
    return 0


def _quantiles(quick: bool) -> int:
    markdown = format_quantiles(measure_report_histogram())
    print(markdown, flush=True)
    write_result("stats_quantiles", markdown, quick=quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
