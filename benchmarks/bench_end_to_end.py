"""End-to-end: the digits model on 2 CPU ranks, every lightning_ext feature on vs plain Lightning DDP.

Anchor ("plain"): ``Trainer(strategy="ddp_spawn", devices=2, precision="16-mixed")`` — Lightning's
default ``MixedPrecision`` (which on CPU silently runs bf16 autocast), plain per-rank BatchNorm, no
callbacks, no logger.

Ours, at the SAME arithmetic precision as the anchor (bf16 autocast): ``LossScalingPrecision
("bf16-mixed")`` (skip-only scaler), ``SyncBatchNormPlugin``, ``TrainingStats``,
``IterationTimer``, ``LossMonitor``, ``PreciseBN``. We also time ours with real fp16 loss scaling
(``"16-mixed"``) and print it separately: fp16 autocast on CPU is much slower than bf16 (fp16
conv backward, see DESIGN.md), which is a property of the CPU kernels, not of our plugin.

Per-step time = median interval between consecutive ``on_train_batch_start`` calls on rank 0
after a warm-up, validation disabled. Runs are interleaved (plain, ours, plain, ours, ...) so
machine noise hits both alike. Prints the table and the ratio; target: ours <= 1.05x plain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

from lightning_ext.examples.digits import DigitsDataModule, DigitsModule


class StepClock(Callback):
    """Records on rank 0 the wall-clock time of every ``on_train_batch_start`` into a JSON file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.times: list[float] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.times))


def _trainer_kwargs(max_steps: int) -> dict:
    return dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )


def run_once(config: str, max_steps: int, warmup: int) -> float:
    """Train ``config`` for ``max_steps`` steps; return the median per-step seconds after ``warmup``."""
    from lightning_ext.callbacks import IterationTimer, LossMonitor, PreciseBN, TrainingStats
    from lightning_ext.plugins import LossScalingPrecision, SyncBatchNormPlugin

    L.seed_everything(0)
    with tempfile.TemporaryDirectory() as tmp:
        clock = StepClock(os.path.join(tmp, "times.json"))
        kwargs = _trainer_kwargs(max_steps)
        if config == "plain":
            trainer = L.Trainer(precision="16-mixed", callbacks=[clock], **kwargs)
        else:
            precision = "16-mixed" if config == "ours-fp16" else "bf16-mixed"
            plugins = [LossScalingPrecision(precision)]
            if config != "ours-no-syncbn":
                plugins.append(SyncBatchNormPlugin())
            trainer = L.Trainer(
                plugins=plugins,
                callbacks=[
                    clock,
                    TrainingStats(every_n_train_steps=20),
                    IterationTimer(),
                    LossMonitor(period=20),
                    PreciseBN(num_iter=4),
                ],
                **kwargs,
            )
        trainer.fit(DigitsModule(), datamodule=DigitsDataModule(batch_size=32))
        times = json.loads(Path(clock.path).read_text())
    intervals = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    return statistics.median(intervals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-fp16", action="store_true", help="skip the fp16 timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = ["plain", "ours-bf16", "ours-no-syncbn"] + ([] if args.no_fp16 else ["ours-fp16"])
    samples: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for config in configs:
            samples[config].append(run_once(config, args.steps, args.warmup))
    med = {c: statistics.median(v) for c, v in samples.items()}
    ratio = med["ours-bf16"] / med["plain"]
    lines = [
        "## End to end: digits model, 2 CPU ranks (`bench_end_to_end.py`)",
        "",
        f"Median per-step time over {args.repeats} interleaved runs of {args.steps} steps "
        f"(first {args.warmup} steps excluded), per-rank batch 32, validation off.",
        "",
        "| configuration | ms / step | vs plain |",
        "|---|---:|---:|",
        f'| plain Lightning DDP (`precision="16-mixed"` → bf16 autocast on CPU), no callbacks | '
        f"{med['plain'] * 1e3:.2f} | 1.00× |",
        f'| ours, all features, `LossScalingPrecision("bf16-mixed")` + SyncBN + TrainingStats + '
        f"IterationTimer + LossMonitor + PreciseBN | {med['ours-bf16'] * 1e3:.2f} | {ratio:.3f}× |",
    ]
    lines.append(
        "| ours, every feature except SyncBN (bf16) — the cost of the rest | "
        f"{med['ours-no-syncbn'] * 1e3:.2f} | {med['ours-no-syncbn'] / med['plain']:.3f}× |"
    )
    if "ours-fp16" in med:
        lines.append(
            f'| ours, all features, real fp16 loss scaling `LossScalingPrecision("16-mixed")` | '
            f"{med['ours-fp16'] * 1e3:.2f} | {med['ours-fp16'] / med['plain']:.3f}× |"
        )
    lines += [
        "",
        f"Target: ours (same precision) ≤ 1.05× plain — {'met' if ratio <= 1.05 else 'NOT met'} "
        f"({(ratio - 1) * 100:+.1f}%). SyncBN adds, by its nature, one blocking all_reduce per "
        "BatchNorm layer and direction (6 per step for the 3 layers here) that plain DDP does not "
        "have: they go through shared memory (~25 µs each, `lightning_ext.shm_collectives`), but "
        "each is a point where the faster rank waits for the slower one, and at these tiny layers "
        "(8x8 images) our per-layer Python glue is comparable to ATen's whole fused batch norm; the "
        "'except SyncBN' row separates that from the cost of everything else. "
        "The fp16 row is slower because fp16 autocast kernels on CPU "
        "(conv backward above all) are slower than bf16 ones; Lightning's own `16-mixed` cannot run "
        "fp16 on CPU at all.",
    ]
    text = "\n".join(lines)
    print(text)
    write_result("end_to_end", text)


if __name__ == "__main__":
    main()
