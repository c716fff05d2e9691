"""``Throughput``'s MFU on a GPU against an independent count: a matmul-heavy model, one device.

The model is a stack of bias-free ``Linear(D, D)`` layers with ReLU between them, trained with SGD in
``bf16-mixed`` on one CUDA device, ``batch`` random rows drawn on the device per step. Its model FLOPs
per step are counted by hand: ``6 * batch * D * D`` per layer (forward, the input's and the weight's
gradients), less ``2 * batch * D * D`` for the first layer's input, which needs no gradient; the ReLU
and the loss are not matmuls and are left out. The step time is the wall time over the timed steps after a
CUDA synchronize, and the peak is the datasheet's for the device and bf16 from
:func:`lightning_ext.perf.peak_flops` (dense). ``Throughput`` (FLOPs counted once by
``FlopCounterMode``, its own interval timing, no host sync per step) must agree with the hand count:
the table prints both MFUs and their ratio, and the achieved matmul rate of a bare ``D x D`` product
for scale.

Usage: ``python benchmarks/bench_mfu_gpu.py [--quick]``; without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import write_result  # noqa: E402

D, LAYERS, BATCH = 8192, 8, 8192


def _model():
    import lightning as L

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = []
            for _ in range(LAYERS):
                layers += [torch.nn.Linear(D, D, bias=False), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers[:-1])

        def training_step(self, batch, batch_idx):
            x = torch.randn(BATCH, D, device=self.device)  # made here: no host-to-device copy per step
            return self.net(x).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(1000), batch_size=None)

    return Stack()


class _WallClock(Callback):
    """Wall time of the steps after ``skip`` up to the end of the last one, synchronized at both ends
    (not after ``fit``: Lightning's teardown then moves the model to the CPU, seconds for this one)."""

    def __init__(self, skip: int) -> None:
        self.skip, self.start, self.end, self.steps = skip, 0.0, 0.0, 0

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step < self.skip:
            return
        torch.cuda.synchronize()  # (a sync per step: this clock is the benchmark's, not Throughput's)
        if trainer.global_step == self.skip:
            self.start = time.perf_counter()
        else:
            self.steps, self.end = self.steps + 1, time.perf_counter()

    def seconds(self) -> float:
        return self.end - self.start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 steps (smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mfu_gpu.py needs a CUDA GPU: nothing run")
        return 0
    import lightning as L

    from lightning_ext.callbacks import Throughput, TrainingStats
    from lightning_ext.perf import peak_flops

    steps, every = (20, 5) if args.quick else (60, 10)
    peak = peak_flops(torch.bfloat16)
    clock = _WallClock(skip=every)
    throughput = Throughput(samples_fn=lambda batch: BATCH)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=every), clock],
    )  # fmt: skip
    trainer.fit(_model())
    wall = clock.seconds()
    flops_per_step = (6.0 * LAYERS - 2.0) * BATCH * D * D
    hand_mfu = flops_per_step * clock.steps / wall / peak
    mfu = throughput.last_metrics.get("Throughput/mfu", float("nan"))
    rate = throughput.last_metrics.get("Throughput/flops_per_sec", float("nan"))
    a = torch.randn(D, D, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(D, D, device="cuda", dtype=torch.bfloat16)
    import triton.testing

    matmul = 2.0 * D**3 / (triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200) * 1e-3)
    rows = [
        ("device", torch.cuda.get_device_name()),
        ("peak (table, bf16 dense)", f"{peak / 1e12:.0f} TFLOP/s"),
        ("bare bf16 matmul D x D", f"{matmul / 1e12:.0f} TFLOP/s ({matmul / peak:.1%} of peak)"),
        ("hand count: FLOPs per step", f"{flops_per_step:.3e}"),
        ("hand count: MFU", f"{hand_mfu:.1%} ({clock.steps} steps, {wall / clock.steps * 1e3:.1f} ms each)"),
        ("Throughput/mfu (last interval)", f"{mfu:.1%}"),
        ("Throughput/flops_per_sec", f"{rate / 1e12:.0f} TFLOP/s"),
        ("ratio Throughput/mfu / hand", f"{mfu / hand_mfu:.3f}"),
    ]
    markdown = "\n".join(
        [
            "## MFU on a GPU (`bench_mfu_gpu.py`)",
            "",
            f"{LAYERS} x `Linear({D}, {D}, bias=False)` with ReLU, batch {BATCH}, bf16-mixed, SGD, one",
            f"device, {steps} steps, `TrainingStats(every_n_train_steps={every})`. Hand count: (6 x layers -",
            "2) x batch x D^2 over the synchronized wall time of the steps after the first flush;",
            "`Throughput`: FLOPs from `FlopCounterMode` on one batch, over its own interval time, no host",
            "sync per step.",
            "",
            "| what | figure |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
        ]
    )
    print(markdown, flush=True)
    write_result("mfu_gpu", markdown, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
