"""End-to-end: the digits model on 2 CPU ranks, every lightning_ext feature on vs plain Lightning DDP.

Anchor ("plain"): ``Trainer(strategy="ddp", devices=2, precision="16-mixed")`` — Lightning's
default ``MixedPrecision`` (which on CPU runs bf16 autocast, with a warning), plain per-rank BatchNorm, no
callbacks, no logger.

Ours, at the SAME arithmetic precision as the anchor (bf16 autocast): ``LossScalingPrecision
("bf16-mixed")`` (skip-only scaler), ``SyncBatchNormPlugin``, ``TrainingStats``,
``IterationTimer``, ``LossMonitor``, ``PreciseBN``. We also time ours with real fp16 loss scaling
(``"16-mixed"``) and print it separately: fp16 autocast on CPU is much slower than bf16 (above all
ATen's fp16 convolution backward), which is a property of the CPU kernels, not of our plugin; the
fp16 run is timed with the automatically chosen kernel backend and with ``reference``.

Compiled row: every feature on (bf16), the model (``ConvNet``, its ``report()`` included) compiled with
``torch.compile(fullgraph=True)`` (inductor) once the strategy has wrapped it; each run traces anew
(``torch._dynamo.reset()``) and its compile falls in the warm-up steps. PreciseBN's batches at the
first epoch end trace the graph again (its forward hooks and ``no_grad``: 4 more graphs, within
dynamo's recompile limit of 8); those compiles count in the mean, not in the median. Compiled,
SyncBN's all_reduces go through gloo instead of shared memory (``lightning_ext.distributed.all_reduce_``):
the "gloo" row runs the eager model with that transport (``LIGHTNING_EXT_SHM_COLLECTIVES=0``), so the
two effects separate.

Diagnostic rows: every feature on the ``reference`` kernel backend instead of the automatically
chosen one (``cpu`` where it builds; ``LIGHTNING_EXT_KERNELS=reference`` for that run), every feature
except SyncBN, and every feature with SyncBN replaced by ATen's local batch norm plus SyncBN's two
all_reduces per layer (the synchronization points without our maths; its buffers are left out of
DDP's per-forward broadcast as ``SyncBatchNormPlugin`` does for SyncBN).

Per-step time = median interval between consecutive ``on_train_batch_start`` calls on rank 0
after a warm-up, validation disabled; the forward / backward / rest phases are timed on rank 0
too. Every run happens in the SAME two worker processes, started once by this script (as
``torchrun`` would start them; each run is a fresh ``Trainer(strategy="ddp")`` + ``fit`` over the
already initialized process group), so that a run costs its steps, not a process spawn: many short
runs, interleaved (every configuration once per repeat, the order reversed every other repeat),
so that the VM's drift hits all configurations alike; the paired ratio divides each run by the
plain run next to it in time. Prints the table and the ratio; target: ours <= 1.05x plain.

Usage: ``python benchmarks/bench_end_to_end.py [--quick] [--steps 80] [--repeats 20] [--warmup 10]
[--no-fp16] [--no-compiled]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import environ, write_result  # noqa: E402

from examples.digits import DigitsDataModule, DigitsModule  # noqa: E402
from lightning_ext import kernels  # noqa: E402
from lightning_ext.distributed import SHM_ENV_VAR, all_reduce_, close_shared_memory  # noqa: E402


class StepClock(Callback):
    """Records the wall-clock time of every step's phase boundaries (every rank, in memory).

    ``times``: every ``on_train_batch_start``; ``phases``: per step ``(start, before_backward,
    after_backward)`` — forward (with the loss), backward (with DDP's gradient all_reduce) and the
    rest (optimizer step, callbacks, next batch).
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.phases: list[list[float]] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.times.append(now)
        self.phases.append([now])

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.phases[-1].append(time.perf_counter())

    @override
    def on_after_backward(self, trainer, pl_module) -> None:
        self.phases[-1].append(time.perf_counter())


def _trainer_kwargs(max_steps: int) -> dict:
    return dict(
        accelerator="cpu",
        devices=2,
        strategy="ddp",  # the processes exist already (started by this script, as torchrun would)
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )


def run_once(config: str, max_steps: int, warmup: int) -> dict[str, float]:
    """Train ``config`` for ``max_steps`` steps in this worker; median seconds per step and per phase
    after ``warmup`` (this rank's clock)."""
    L.seed_everything(0, verbose=False)
    if config == "ours-gloo":
        return _run_over_gloo(config, max_steps, warmup)
    if not config.endswith("reference"):
        return _run_once(config, max_steps, warmup)
    with environ(**{kernels.BACKEND_ENV_VAR: "reference"}):  # read at every backend lookup: this run only
        return _run_once(config, max_steps, warmup)


def _run_over_gloo(config: str, max_steps: int, warmup: int) -> dict[str, float]:
    """``_run_once`` with every small all_reduce through gloo: the groups' routes are decided at their
    next reduction, under the variable (every rank does alike), and again after it."""
    close_shared_memory()
    try:
        with environ(**{SHM_ENV_VAR: "0"}):
            return _run_once(config, max_steps, warmup)
    finally:
        close_shared_memory()


class CompiledDigitsModule(DigitsModule):
    """The digits module whose network runs ``torch.compile(fullgraph=True)``-d (inductor), compiled
    once the strategy has converted its batch norms and wrapped it in DDP."""

    @override
    def on_fit_start(self) -> None:
        torch._dynamo.reset()  # every run traces anew: runs do not pile up toward the recompile limit
        self.net = torch.compile(self.net, fullgraph=True)


def _run_once(config: str, max_steps: int, warmup: int) -> dict[str, float]:
    from lightning_ext.callbacks import IterationTimer, LossMonitor, PreciseBN, TrainingStats
    from lightning_ext.plugins import LossScalingPrecision, SyncBatchNormPlugin

    clock = StepClock()
    kwargs = _trainer_kwargs(max_steps)
    if config == "plain":
        trainer = L.Trainer(precision="16-mixed", callbacks=[clock], **kwargs)
    else:
        precision = "16-mixed" if config.startswith("ours-fp16") else "bf16-mixed"
        plugins = [LossScalingPrecision(precision)]
        if config not in ("ours-no-syncbn", "ours-collectives-only"):
            plugins.append(SyncBatchNormPlugin())
        trainer = L.Trainer(
            plugins=plugins,
            callbacks=[
                clock,
                TrainingStats(every_n_train_steps=20),
                IterationTimer(),
                LossMonitor(every_n_train_steps=20),
                PreciseBN(num_iter=4),
            ],
            **kwargs,
        )
    model = CompiledDigitsModule() if config == "ours-compiled" else DigitsModule()
    if config == "ours-collectives-only":
        model = _collectives_only(model)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    times, phases = clock.times, clock.phases
    intervals = [b - a for a, b in zip(times[warmup:], times[warmup + 1 :])]
    steps = [(p, nxt[0]) for p, nxt in zip(phases[warmup:], phases[warmup + 1 :]) if len(p) == 3]
    return {
        "step": statistics.median(intervals),
        "mean": statistics.fmean(intervals),
        "forward": statistics.median(p[1] - p[0] for p, _ in steps),
        "backward": statistics.median(p[2] - p[1] for p, _ in steps),
        "rest": statistics.median(nxt - p[2] for p, nxt in steps),
    }


def _worker(
    rank: int, port: int, configs: list[str], repeats: int, steps: int, warmup: int, out: str
) -> None:
    """One of the two ranks: every run of every configuration, in this process."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    os.environ.pop(kernels.BACKEND_ENV_VAR, None)  # automatic backend choice, except in the reference row
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):  # one banner per run otherwise
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    samples: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for repeat in range(repeats):
        # A B C ... C B A: alternate the order so that drift in the VM's speed hits no row more.
        for config in configs if repeat % 2 == 0 else configs[::-1]:
            # The fp16 row (~8x slower per step, printed apart) takes fewer steps: its median needs no more.
            n = min(steps, warmup + 30) if config.startswith("ours-fp16") else steps
            samples[config].append(run_once(config, n, warmup))
        if rank == 0:
            print(f"repeat {repeat + 1}/{repeats}: " + " ".join(
                f"{c} {samples[c][-1]['step'] * 1e3:.1f}" for c in configs), flush=True)  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _CollectiveOnly(torch.autograd.Function):
    """Identity whose backward all-reduces ``2C`` float32 zeros (SyncBN's backward collective)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, channels: int) -> torch.Tensor:
        ctx.channels = channels
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        all_reduce_(torch.zeros(2 * ctx.channels))
        return grad, None


class CollectivesOnlyBatchNorm(torch.nn.BatchNorm2d):
    """Diagnostic: ATen's local batch norm plus SyncBatchNorm's two all_reduces (same sizes, same
    places, same transport), without its maths — the cost of the synchronization points alone."""

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        all_reduce_(torch.zeros(2 * self.num_features + 1, dtype=torch.float64))
        return _CollectiveOnly.apply(super().forward(input), self.num_features)


def _collectives_only(module: DigitsModule) -> DigitsModule:
    ignored = []
    for prefix, block in module.net.features.named_children():
        if isinstance(block, torch.nn.Sequential):
            bn = block[1]
            replacement = CollectivesOnlyBatchNorm(bn.num_features)
            replacement.load_state_dict(bn.state_dict())
            block[1] = replacement
            ignored += [f"net.features.{prefix}.1.{name}" for name, _ in replacement.named_buffers()]
    # Like SyncBatchNormPlugin, take the layers' buffers out of DDP's per-forward broadcast (here
    # they drift apart across ranks: this row is a timing diagnostic only).
    module._ddp_params_and_buffers_to_ignore = ignored
    return module


CONFIGS = {
    "plain": 'plain Lightning DDP (`precision="16-mixed"` → bf16 autocast on CPU, with a warning), '
    "no callbacks",
    "ours-bf16": 'ours, all features, `LossScalingPrecision("bf16-mixed")` + SyncBN + TrainingStats + '
    "IterationTimer + LossMonitor + PreciseBN",
    "ours-compiled": "ours, all features (bf16), the model `torch.compile(fullgraph=True)`-d (inductor; "
    "compile in the warm-up)",
    "ours-gloo": "ours, all features (bf16), eager, every small all_reduce through gloo "
    "(`LIGHTNING_EXT_SHM_COLLECTIVES=0`): the transport of the compiled graph",
    "ours-reference": "ours, all features (bf16), every kernel on the `reference` backend "
    "(`LIGHTNING_EXT_KERNELS=reference`)",
    "ours-no-syncbn": "ours, every feature except SyncBN (bf16) — the cost of the rest",
    "ours-collectives-only": "diagnostic: ours with SyncBN replaced by local ATen batch norm + SyncBN's "
    "two all_reduces per layer — the cost of the 6 synchronization points alone",
    "ours-fp16": 'ours, all features, real fp16 loss scaling `LossScalingPrecision("16-mixed")`',
    "ours-fp16-reference": "ours, all features, real fp16 loss scaling, every kernel on the `reference` "
    "backend",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of 15 steps (smoke run)")
    parser.add_argument("--steps", type=int, default=80, help="steps per run")
    parser.add_argument("--repeats", type=int, default=20, help="runs per configuration")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of a run left out")
    parser.add_argument("--no-fp16", action="store_true", help="skip the fp16 timing")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled and gloo rows")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.warmup = 15, 2, 5
    with environ(**{kernels.BACKEND_ENV_VAR: None}):  # builds the cpu backend here once; every rank loads it
        backend = kernels.get_backend(None, "cpu").name
    skipped = {c for c in CONFIGS if (args.no_fp16 and c.startswith("ours-fp16"))}
    skipped |= {"ours-compiled", "ours-gloo"} if args.no_compiled else set()
    configs = [c for c in CONFIGS if c not in skipped]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.json")
        worker_args = (_free_port(), configs, args.repeats, args.steps, args.warmup, out)
        mp.spawn(_worker, args=worker_args, nprocs=2)
        samples: dict[str, list[dict[str, float]]] = json.loads(Path(out).read_text())
    med = {c: {k: statistics.median(s[k] for s in v) for k in v[0]} for c, v in samples.items()}
    plain = med["plain"]["step"]
    ratio = med["ours-bf16"]["step"] / plain
    lines = [
        "## End to end: digits model, 2 CPU ranks (`bench_end_to_end.py`)",
        "",
        f"Median per-step time over {args.repeats} interleaved runs of {args.steps} steps, all in the "
        'same two worker processes (`strategy="ddp"`, the processes started once by the script; the order '
        "of the configurations reversed every other repeat; 'paired' = median over repeats of each "
        "run's step time over the plain run of the same repeat) "
        f"(first {args.warmup} steps excluded; the fp16 row: runs of {min(args.steps, args.warmup + 30)} "
        "steps), "
        "per-rank batch 32, validation off; phases on rank 0 "
        "(forward with the loss; backward with DDP's gradient all_reduce; the rest: optimizer step, "
        "callbacks, next batch; medians, so they need not add up to the step). The mean over all "
        "steps also counts the periodic work the median leaves out: the epoch ends of both sides "
        "(22 steps per epoch), and ours' stats flushes and loss agreements (every 20 steps) and "
        "PreciseBN's update at each epoch end (4 forward batches).",
        "",
        "| configuration | ms / step | vs plain | paired vs plain | forward ms | backward ms | rest ms "
        "| mean ms / step | mean vs plain | ms / step per run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for config in configs:
        m = med[config]
        # Each run over the plain run of the same repeat (next to it in time), median over repeats.
        paired = statistics.median(s["step"] / p["step"] for s, p in zip(samples[config], samples["plain"]))
        per_run = " ".join(f"{s['step'] * 1e3:.1f}" for s in samples[config])
        lines.append(
            f"| {CONFIGS[config]} | {m['step'] * 1e3:.2f} | {m['step'] / plain:.3f}× | {paired:.3f}× | "
            f"{m['forward'] * 1e3:.2f} | {m['backward'] * 1e3:.2f} | {m['rest'] * 1e3:.2f} | "
            f"{m['mean'] * 1e3:.2f} | {m['mean'] / med['plain']['mean']:.3f}× | {per_run} |"
        )
    lines += [
        "",
        f"Target: ours (same precision) ≤ 1.05× plain — {'met' if ratio <= 1.05 else 'NOT met'} "
        f"({(ratio - 1) * 100:+.1f}%). SyncBN adds, by its nature, one blocking all_reduce per "
        "BatchNorm layer and direction (6 per step for the 3 layers here) that plain DDP does not "
        "have: they go through shared memory (`lightning_ext.distributed.all_reduce_`; "
        "`bench_all_reduce.py` times them), but each is a point where the faster rank waits for the "
        "slower one. It also removes one: "
        "SyncBN keeps its running statistics equal on every rank, so `SyncBatchNormPlugin` takes "
        "them out of the gloo broadcast of buffers that DDP runs at every forward (the model's only "
        "buffers here, so that broadcast is gone). The 'collectives only' row measures the six "
        "waits with ATen's maths (its buffers are also left out of DDP's broadcast), the 'except "
        "SyncBN' row the cost of everything else (with DDP's broadcast, as plain). "
        f"'ours' runs the automatically chosen kernel backend (`{backend}` in this run); the "
        "`reference` row runs every kernel (SyncBN, the loss scaler's gradient check, `report()`) "
        "on ATen ops driven from Python instead (results agree to rounding): its difference to "
        "'ours' is what the compiled kernels save. The fp16 row is "
        "slower because fp16 autocast kernels on CPU (conv backward above all) are slower than bf16 "
        "ones; Lightning's own `16-mixed` cannot run fp16 on CPU at all.",
    ]
    if "ours-compiled" in med:
        lines += ["", _compiled_line(med, samples)]
    text = "\n".join(lines)
    print(text)
    write_result("end_to_end", text, quick=args.quick)


def _compiled_line(med: dict[str, dict[str, float]], samples: dict[str, list[dict[str, float]]]) -> str:
    """The compiled row against eager ours (same run, paired per repeat), and against the eager run
    over gloo, the transport a compiled graph's all_reduces take."""
    paired = statistics.median(
        c["step"] / e["step"] for c, e in zip(samples["ours-compiled"], samples["ours-bf16"])
    )
    compiled, eager, gloo = (med[c]["step"] for c in ("ours-compiled", "ours-bf16", "ours-gloo"))
    return (
        f"Compiled vs eager (ours, bf16, every feature): {compiled / eager:.3f}× (paired {paired:.3f}×); "
        f"vs the eager run over gloo: {compiled / gloo:.3f}×. Eager over gloo vs shared memory: "
        f"{gloo / eager:.3f}× — what the compiled graph's collectives cost before inductor's code "
        "counts (the shared-memory path cannot be traced; see `lightning_ext.distributed.all_reduce_`)."
    )


if __name__ == "__main__":
    main()
