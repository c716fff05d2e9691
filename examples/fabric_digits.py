"""The digits job as a ``lightning.Fabric`` loop: lightning_ext without a Trainer.

Run it with ``python -m examples.fabric_digits``. It trains the CNN of
``examples/digits.py`` on scikit-learn's bundled 8×8 digits with
``Fabric(accelerator="cpu", devices=2, strategy="ddp")`` and a loop written out in :func:`train`:

- Fabric's own ``MixedPrecision("16-mixed", scaler=DynamicLossScaler(...))``: fp16 autocast with
  dynamic loss scaling (StyleGAN2-ADA's log2 schedule); a step whose gradients overflow is skipped
  by the scaler, and the loop then holds the LR schedule too;
- :func:`~lightning_ext.nn.convert_sync_batchnorm`: BatchNorm statistics synchronized across the
  processes (``torch.nn.SyncBatchNorm`` fails on CPU);
- :func:`~lightning_ext.stats.report` from the loop and the model, and a
  :class:`~lightning_ext.stats.Collector` flushed into ``fabric.log_dict`` every ``--stats-every``
  steps and after each validation;
- :class:`~lightning_ext.callbacks.IterationTimer`, :class:`~lightning_ext.callbacks.LossMonitor` and
  :class:`~lightning_ext.callbacks.PreciseBN` driven by a
  :class:`~lightning_ext.callbacks.HookRunner`.

It writes CSV (and TensorBoard) logs under ``runs/<name>/`` and exits with status 1 when the
validation accuracy is below ``--min-accuracy`` (0.95). On CPU the conv blocks run in float32 and the
MLP head in fp16, as in the Trainer job (``ConvNet(float32_features=True)``: why, there).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from examples.common import add_run_args, check_positive, loggers, start_run
from examples.digits import ConvNet, DigitsDataModule
from lightning_ext.amp import DynamicLossScaler
from lightning_ext.callbacks import HookRunner, IterationTimer, LossMonitor, PreciseBN
from lightning_ext.nn import convert_sync_batchnorm
from lightning_ext.stats import Collector, report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see ``python -m examples.fabric_digits -h``)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.fabric_digits",
        description="The digits job as a Fabric loop: DDP, fp16 loss scaling, SyncBatchNorm, hooks.",
    )
    add_run_args(parser, name="fabric_digits")
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="images per batch per process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--stats-every", type=int, default=5, help="Collector flush period in steps")
    parser.add_argument("--precise-bn-iters", type=int, default=10, help="PreciseBN batches (0: off)")
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="exit 1 below this")
    args = parser.parse_args(argv)
    check_positive(parser, args, "max_epochs", "batch_size", "width", "stats_every")
    return args


def build_fabric(args: argparse.Namespace, run_dir: Path) -> L.Fabric:
    """A Fabric with fp16 mixed precision driving a ``DynamicLossScaler``, logging into ``run_dir``."""
    on_gpu = args.accelerator == "gpu" or (args.accelerator == "auto" and torch.cuda.is_available())
    device_type = "cuda" if on_gpu else "cpu"
    # Start high (the first steps overflow and back off), then probe upwards by 0.02 per clean step.
    scaler = DynamicLossScaler(device_type, init_scale=2.0**20, schedule="log2", log2_increment=0.02)
    several = args.devices * args.num_nodes > 1
    return L.Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy or ("ddp" if several else "auto"),
        plugins=[MixedPrecision("16-mixed", device_type, scaler=scaler)],
        loggers=loggers(run_dir),
    )


def training_step(
    fabric: L.Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: tuple[torch.Tensor, torch.Tensor],
    runner: HookRunner,
) -> torch.Tensor:
    """One iteration: forward under autocast, scaled backward, optimizer step or skip, LR step or hold.

    Args:
        batch: float32 images ``(N, 1, 8, 8)`` and int64 labels ``(N,)``.

    Returns:
        The loss: float32 0-dim, detached. Reading whether the step was skipped syncs host and device
        (the scaler already did to decide the skip).
    """
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    report("Loss/train", loss.detach())
    report("Accuracy/train", (logits.argmax(dim=1) == y).float())
    fabric.backward(loss)  # MixedPrecision: scaler.scale(loss).backward(); DDP averages the gradients
    runner.after_backward()
    optimizer.step()  # MixedPrecision: scaler.step (skipped on inf/NaN gradients), then scaler.update
    optimizer.zero_grad(set_to_none=True)
    if not fabric.strategy.precision.scaler.last_step_skipped:  # a skipped step leaves the LR as well
        scheduler.step()
    return loss.detach()


def validate(model: nn.Module, loader: Any) -> None:
    """Report per-sample ``Loss/val`` and ``Accuracy/val`` on this process's share of ``loader``."""
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            logits = model(x).float()
            report("Loss/val", F.cross_entropy(logits, y, reduction="none"))
            report("Accuracy/val", (logits.argmax(dim=1) == y).float())
    model.train()


def flush(fabric: L.Fabric, stats: Collector, step: int) -> dict[str, float]:
    """Reduce what was reported since the last flush over all processes and log the means.

    Every process must call it (``Collector.update()`` runs collectives); returns the means.
    """
    stats.update()
    means = {name: values["mean"] for name, values in stats.as_dict().items() if values["num"] > 0}
    fabric.log_dict(means, step=step)
    return means


def train(fabric: L.Fabric, args: argparse.Namespace, net: nn.Module | None = None) -> int:
    """The job on one process (``fabric.launch`` runs it on each); returns the exit status.

    Args:
        net: the classifier of ``(N, 1, 8, 8)`` images into 10 classes (default: ``ConvNet``).

    Raises:
        FloatingPointError: the loss became non-finite on some process (raised on every process).
    """
    data = DigitsDataModule(batch_size=args.batch_size, seed=args.seed)
    data.setup("fit")
    on_cpu = fabric.device.type == "cpu"
    net = net if net is not None else ConvNet(width=args.width, float32_features=on_cpu)
    if fabric.world_size > 1:
        net = convert_sync_batchnorm(net)  # before fabric.setup wraps the model in DDP
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    model, optimizer = fabric.setup(net, optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    total_steps = args.max_epochs * len(train_loader)
    warmup = max(total_steps // 10, 1)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay
        if step < warmup:
            return (step + 1) / warmup
        return 0.02 + 0.49 * (
            1.0 + math.cos(math.pi * min((step - warmup) / max(total_steps - warmup, 1), 1))
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    timer = IterationTimer(warmup_iter=3)  # first: its step time brackets the other hooks' work
    hooks = [timer, LossMonitor(every_n_train_steps=20)]
    if args.precise_bn_iters > 0:  # at each epoch's last step, before the validation
        hooks.append(PreciseBN(num_iter=args.precise_bn_iters))
    stats = Collector(keep_previous=False)
    with HookRunner(hooks, model, fabric=fabric, train_dataloader=train_loader) as runner:
        for _epoch in range(args.max_epochs):
            runner.before_epoch()
            for i, batch in enumerate(train_loader):
                runner.before_step()
                step = runner.iter  # this iteration's log step, as a Trainer's self.log uses
                loss = training_step(fabric, model, optimizer, scheduler, batch, runner)
                runner.after_step(loss, is_last_batch=i + 1 == len(train_loader))
                if (step + 1) % args.stats_every == 0:
                    flush(fabric, stats, step)
            validate(model, val_loader)
            means = flush(fabric, stats, step)  # after the epoch's last iteration, as Lightning does
    for logger in fabric.loggers:
        logger.finalize("success")
    accuracy = means["Accuracy/val"]  # over every process's validation share
    scaler = fabric.strategy.precision.scaler
    fabric.print(f"Skipped steps (overflow): {scaler.skipped_steps} of {scaler.steps}")
    fabric.print(f"Validation accuracy: {accuracy:.4f}")
    if accuracy < args.min_accuracy:
        fabric.print(f"accuracy {accuracy:.4f} < --min-accuracy {args.min_accuracy}")
    return 0 if accuracy >= args.min_accuracy else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns this process's exit status (0, or 1 when accuracy < ``--min-accuracy``)."""
    args = parse_args(argv)
    fabric = build_fabric(args, start_run(args))
    return fabric.launch(train, args)


if __name__ == "__main__":
    sys.exit(main())
