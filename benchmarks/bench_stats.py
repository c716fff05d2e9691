"""Cost of distributed training statistics: ours vs Lightning ``self.log(sync_dist=True)`` vs torchmetrics.

Two gloo ranks on CPU (spawned by this script), K ∈ {1, 10, 100} names reported every step, each
value a 0-dim float32 CPU tensor (what a loss looks like):

(a) ours: ``report(name, value)`` per name per step + ``Collector.update()`` every 50 steps, its two
    all_reduces through shared memory (``lightning_ext.shm_collectives``; both ranks on one host);
    "ours (gloo)" is the same with ``LIGHTNING_EXT_SHM_COLLECTIVES=0`` (gloo's all_reduce);
(b) Lightning's per-key path: ``_ResultCollection.log(..., on_step=True, sync_dist=True)`` per name
    per step — the object ``LightningModule.log`` forwards to — with ``sync_dist_fn`` =
    ``lightning.fabric.utilities.distributed._sync_ddp_if_available``, exactly what
    ``DDPStrategy.reduce`` calls (barrier + all_reduce + division per key per step);
(c) torchmetrics: K ``MeanMetric``s, ``update()`` per step and a synced ``compute()`` (+ ``reset()``)
    every 50 steps.

Collectives are counted in a separate pass by wrapping the ``torch.distributed`` functions in the
worker processes (benchmark only). Also: ``report()`` µs per call for a Python float and a 1,000-element
CPU tensor. Targets (issue 2 §5): ``report()`` ≤ 10 µs for a scalar; K=100 flush ≥ 100× faster than
torchmetrics' synced compute; ≥ 50× cheaper per step than ``sync_dist=True`` at K=10.

Usage: ``python benchmarks/bench_stats.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import align_ranks  # noqa: E402

from lightning_ext import shm_collectives  # noqa: E402

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "barrier",
    "broadcast",
)
METHODS = ("ours", "ours (gloo)", "lightning", "torchmetrics")


# ------------------------------------------------------------------------------------------------
# The three methods: each returns a callable doing one step, and one that flushes.


def _ours(k: int):
    from lightning_ext.stats import Collector, report, reset

    reset()
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


# ------------------------------------------------------------------------------------------------
# Worker.


class _Counter:
    """Wrap the torch.distributed collectives and ``shm_collectives.all_reduce`` to count calls
    (benchmark workers only); a shared-memory all_reduce counts once, also when it falls back to gloo."""

    def __init__(self) -> None:
        self.count = 0
        self._inside_shm = False
        self._originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
        self._shm_all_reduce = shm_collectives.all_reduce

    def __enter__(self) -> _Counter:
        for name, fn in self._originals.items():

            def counted(*args, _fn=fn, **kwargs):
                self.count += 0 if self._inside_shm else 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)

        def shm_counted(*args, **kwargs):
            self.count += 1
            self._inside_shm = True
            try:
                return self._shm_all_reduce(*args, **kwargs)
            finally:
                self._inside_shm = False

        shm_collectives.all_reduce = shm_counted
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        shm_collectives.all_reduce = self._shm_all_reduce


def _run_method(method: str, k: int, steps: int, flush_every: int, rank: int) -> dict[str, float]:
    if method == "ours (gloo)":  # our Collector with its all_reduces on gloo instead of shared memory
        os.environ[shm_collectives._ENV] = "0"
        try:
            return _run_method("ours", k, steps, flush_every, rank)
        finally:
            del os.environ[shm_collectives._ENV]
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
    with _Counter() as counter:
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
    """Spawn ``world_size`` gloo ranks and time the three methods; returns ``{method: {K: figures}}``.

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
        env = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            mp.spawn(_worker, args=(world_size, init_file, config, out_file), nprocs=world_size, join=True)
        finally:
            if env is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env
        return torch.load(out_file)


def measure_report_cost(calls: int = 200_000) -> dict[str, float]:
    """``report()`` µs per call in this process: a Python float and a 1,000-element CPU float32 tensor,
    the tensor both on its host path (NumPy) and, as the anchor, through the kernel backend's
    ``accumulate_moments_`` (the path it took before; forced by lowering the host-path limit)."""
    from lightning_ext.stats import Collector, report, reporting, reset

    reset()
    collector = Collector()
    out = {}
    x = torch.randn(1000)
    host_limit = reporting._HOST_ARRAY_MAX_NUMEL
    cases = (
        ("float", 0.5, calls, host_limit),
        ("tensor1000", x, max(calls // 50, 100), host_limit),
        ("tensor1000_kernel", x, max(calls // 50, 100), 0),
    )
    try:
        for label, value, n, limit in cases:
            reporting._HOST_ARRAY_MAX_NUMEL = limit
            for _ in range(100):
                report("Bench/value", value)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    report("Bench/value", value)
                best = min(best, (time.perf_counter() - t0) / n)
            out[label] = best * 1e6
    finally:
        reporting._HOST_ARRAY_MAX_NUMEL = host_limit
    collector.update()
    reset()
    return out


def format_markdown(results: dict, report_us: dict[str, float], flush_every: int = 50) -> str:
    lines = [
        "## Training statistics (`bench_stats.py`)",
        "",
        "2 gloo ranks on CPU, K names reported every step (0-dim float32 tensors), "
        f"flush every {flush_every} steps. (a) ours: `report()` + `Collector.update()`; "
        "(b) Lightning: `_ResultCollection.log(..., "
        "on_step=True, sync_dist=True)` with `_sync_ddp_if_available` (what `self.log(sync_dist=True)` runs "
        "per key per step: barrier + all_reduce); (c) torchmetrics: K `MeanMetric` with synced "
        "`compute()` + `reset()` per flush. Step cost is amortised (flushes included); the slower rank "
        "counts; an untimed shared-memory all_reduce aligns the ranks before each flush so rank skew is not "
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
    for label, value, goal, met in targets(results, report_us):
        lines.append(f"| {label} | {value} | {goal} | {'yes' if met else 'NO'} |")
    return "\n".join(lines)


def targets(results: dict, report_us: dict[str, float]) -> list[tuple[str, str, str, bool]]:
    """(label, measured, goal, met) for the three targets of issue 2 §5 (and the tensor report cost)."""
    rows = [
        ("`report()` Python float", f"{report_us['float']:.2f} µs", "≤ 10 µs", report_us["float"] <= 10),
        (
            "`report()` 1,000-element CPU tensor (host path, NumPy)",
            f"{report_us['tensor1000']:.1f} µs",
            f"(no target; through the kernel backend: {report_us['tensor1000_kernel']:.1f} µs, "
            f"{report_us['tensor1000_kernel'] / report_us['tensor1000']:.1f}x)",
            True,
        ),
    ]
    kmax = max(results["ours"])
    if kmax == 100:
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
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke test)")
    args = parser.parse_args()
    steps = 100 if args.quick else 500
    report_us = measure_report_cost(50_000 if args.quick else 200_000)
    results = run_benchmark(steps=steps)
    markdown = format_markdown(results, report_us)
    print(markdown)
    from _common import write_result

    print(f"wrote {write_result('stats', markdown)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
