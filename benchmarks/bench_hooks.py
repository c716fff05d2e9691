"""Per-step overhead of ``IterationTimer`` + ``LossMonitor`` on the digits model, 2 gloo CPU ranks.

Two ranks are spawned by this script; inside them Lightning runs ``Trainer(strategy="ddp", devices=2)``
on the already-initialized process group (as under ``torchrun``), with the main job's
``DigitsModule`` (small CNN with BatchNorm) and ``DigitsDataModule(batch_size=64)``. In the same
processes and interleaved (A, B, C, A, B, C, ...) to share the machine's noise, three Trainers that
differ only in their callbacks:

- ``baseline``: no hooks;
- ``hooks``: ``IterationTimer()`` + ``LossMonitor(every_n_train_steps=20)``;
- ``hooks_async``: ``IterationTimer()`` + ``LossMonitor(every_n_train_steps=20, async_write=True)``.

A first-positioned probe callback timestamps every ``on_train_batch_start``; the step time is the
median of consecutive differences after 10 warm-up steps (everything included: data, forward,
backward, DDP all-reduce, optimizer, every callback). The hooks' own cost is also measured directly
by timing their Lightning batch-hook methods (wrapped per instance in this script; amortized
agreement collective included). Target: overhead ≤ 2% of the step time.

Usage: ``python benchmarks/bench_hooks.py [--quick]``.
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
for path in (HERE.parent, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

WORLD_SIZE = 2
CONFIGS = ("baseline", "hooks", "hooks_async")
WARMUP = 10


def _make_probe():
    from lightning.pytorch.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

    return Probe()


def _time_hook_methods(hook: Any, per_step: dict[int, float], probe: Any) -> None:
    """Wrap this instance's per-step Lightning methods; time spent in them adds to ``per_step[step]``."""
    for name in ("on_train_batch_start", "on_after_backward", "on_train_batch_end"):
        method = getattr(hook, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                step = len(probe.starts)
                per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - start

        setattr(hook, name, timed)


def _run_once(config: str, steps: int) -> tuple[float, float, float]:
    import lightning as L

    from examples.digits import DigitsDataModule, DigitsModule
    from lightning_ext.callbacks import IterationTimer, LossMonitor

    torch.manual_seed(0)
    probe = _make_probe()
    per_step: dict[int, float] = {}
    hooks: list[Any] = []
    if config != "baseline":
        hooks = [IterationTimer(), LossMonitor(every_n_train_steps=20, async_write=config == "hooks_async")]
        for hook in hooks:
            _time_hook_methods(hook, per_step, probe)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy="ddp",
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe, *hooks],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(DigitsModule(lr=1e-2, width=32), DigitsDataModule(batch_size=64, seed=0))
    diffs = [b - a for a, b in zip(probe.starts[WARMUP:], probe.starts[WARMUP + 1 :])]
    hook_times = [per_step.get(i, 0.0) for i in range(WARMUP + 1, len(probe.starts) + 1)]
    return statistics.median(diffs), statistics.fmean(hook_times), statistics.median(hook_times)


def _worker(rank: int, init_file: str, repeats: int, steps: int, out_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank))
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    results: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CONFIGS}
    try:
        for _ in range(repeats):
            for config in CONFIGS:
                results[config].append(_run_once(config, steps))
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of 40 steps (smoke run)")
    args = parser.parse_args()
    repeats, steps = (2, 40) if args.quick else (5, 90)
    import warnings

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.pt")
        from _common import environ

        with environ(OMP_NUM_THREADS="1"):
            mp.spawn(
                _worker,
                args=(os.path.join(tmp, "store"), repeats, steps, out_file),
                nprocs=WORLD_SIZE,
                join=True,
            )
        results = torch.load(out_file)

    def summary(config: str) -> tuple[float, float, float]:
        return tuple(statistics.median(r[i] for r in results[config]) for i in range(3))

    base_step = summary("baseline")[0]
    lines = [
        "## Hooks: IterationTimer + LossMonitor overhead (`bench_hooks.py`)",
        "",
        f'Digits CNN (`DigitsModule(width=32)`, batch 64 per rank), `Trainer(strategy="ddp")` on 2 gloo '
        f"CPU ranks, {steps} steps per run, {repeats} interleaved runs per configuration; step time = median "
        f"of the per-step wall time after {WARMUP} warm-up steps (median over runs). Hook time = time "
        "spent inside the two hooks' batch methods on rank 0, per step: mean (agreement points every 20 "
        "steps amortized, including the wait for the other rank in the all_gather) and median (an ordinary "
        "step). Target: ≤ 2% of the step time.",
        "",
        "| configuration | step (ms) | vs baseline | hooks mean (ms/step) | hooks median (ms/step) "
        "| hooks mean / step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        step, hook_mean, hook_median = summary(config)
        delta = (step / base_step - 1) * 100
        if config == "baseline":
            lines.append(f"| {config} | {step * 1e3:.2f} | — | — | — | — |")
        else:
            lines.append(
                f"| {config} | {step * 1e3:.2f} | {delta:+.1f}% | {hook_mean * 1e3:.3f} | "
                f"{hook_median * 1e3:.3f} | {hook_mean / step * 100:.2f}% |"
            )
    lines += [
        "",
        "Step-time differences between configurations carry the run-to-run noise of the machine; the "
        "time inside the hooks is the direct measure of their cost.",
    ]
    markdown = "\n".join(lines)
    print(markdown)
    from _common import write_result

    write_result("hooks", markdown, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
