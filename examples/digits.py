"""The main job: DDP training on scikit-learn's handwritten digits with every lightning_ext feature on.

Run it with ``python -m examples.digits`` (or ``make demo``). By default it trains a
small CNN with BatchNorm on the 1,797 real 8×8 images of ``sklearn.datasets.load_digits`` (bundled,
no download) with ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` and:

- :class:`~lightning_ext.plugins.SyncBatchNormPlugin` — BatchNorm statistics synchronized across
  the two CPU processes (Lightning's own ``sync_batchnorm=True`` fails on CPU);
- :class:`~lightning_ext.plugins.LossScalingPrecision` ``("16-mixed")`` with the log2 schedule —
  real fp16 autocast with dynamic loss scaling on CPU (Lightning's ``16-mixed`` becomes
  ``bf16-mixed`` on CPU, with a warning), and the gradient health it reports (the gradient norm
  unscaled and before clipping, the update-to-weight ratio). On CPU the conv blocks run in float32
  outside autocast and the MLP head in fp16: a CPU without native half-precision arithmetic (AVX2)
  runs fp16 and bf16 convolutions many times slower than float32, while an fp16 Linear layer stays
  cheap and its gradients still overflow at a high scale, which is what loss scaling is about. On a
  GPU the whole model runs under fp16 autocast;
- :class:`~lightning_ext.callbacks.TrainingStats` — losses, accuracy, an activation statistic,
  timing and AMP telemetry ``report()``-ed from anywhere and reduced across ranks every N steps;
- :class:`~lightning_ext.callbacks.Throughput` — global samples/s, MFU (on CPU against the float32
  matmul rate it measures: the conv blocks, most of the FLOPs, run in float32) and goodput, written
  with the statistics;
- :class:`~lightning_ext.callbacks.IterationTimer`, :class:`~lightning_ext.callbacks.LossMonitor`
  and :class:`~lightning_ext.callbacks.PreciseBN` (detectron2-style hooks).

It writes CSV (and TensorBoard) logs and checkpoints under ``runs/<name>/`` (a ``--resume`` keeps
the earlier launches' CSV as ``metrics-<k>.csv``), draws ``runs/<name>/summary.png`` (loss,
accuracy, loss scale, overflow events, the gradient norm, throughput, MFU and goodput over the
steps of every launch), prints a table of the collected statistics and the
job's throughput and goodput, and exits with status 1 when the validation accuracy is below
``--min-accuracy`` (0.95).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from examples.common import (
    ProgressBar,
    add_run_args,
    check_positive,
    loggers,
    metrics_files,
    read_metrics_csv,
    start_run,
)
from lightning_ext.perf import LOST_TIME_CAUSES
from lightning_ext.stats import report

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_digits_tensors(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Scikit-learn's bundled digits as standardized ``(N, 1, 8, 8)`` float32 images and int64 labels.

    The split is stratified and deterministic for a given ``seed``; the standardization uses the
    training split's mean and standard deviation only. scikit-learn's ``train_test_split`` rejects a
    ``val_fraction`` outside (0, 1).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        data.data, data.target, test_size=val_fraction, random_state=seed, stratify=data.target
    )
    mean, std = x_train.mean(), x_train.std()

    def to_dataset(x: Any, y: Any) -> TensorDataset:
        images = torch.as_tensor((x - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)
        return TensorDataset(images, torch.as_tensor(y, dtype=torch.int64))

    return to_dataset(x_train, y_train), to_dataset(x_val, y_val)


class DigitsDataModule(L.LightningDataModule):
    """The 8×8 digits as a LightningDataModule (1,437 training and 360 validation images).

    Args:
        batch_size: images per batch on EACH rank.
        val_fraction: share of the 1,797 images held out for validation.
        seed: seed of the stratified split.

    Example::

        >>> dm = DigitsDataModule(batch_size=16)
        >>> dm.setup("fit")
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), x.dtype, tuple(y.shape), len(dm.train_set), len(dm.val_set)
        ((16, 1, 8, 8), torch.float32, (16,), 1437, 360)
    """

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = load_digits_tensors(self.val_fraction, self.seed)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """A small CNN with BatchNorm for ``(N, 1, 8, 8)`` images and 10 classes.

    Three 3×3 conv–BatchNorm–ReLU blocks (``width``, ``2·width``, ``2·width`` channels, a 2×2 max
    pool after the second), global average pooling and a two-layer MLP head. ``forward`` reports
    the root-mean-square of the pooled features per sample as ``Activation/features_rms`` — an
    example of ``report()`` called from inside an ``nn.Module``.

    Args:
        width: channels of the first conv block.
        num_classes: outputs of the head.
        float32_features: run the conv blocks in float32 with autocast off (the head stays under the
            caller's autocast): CPUs without native half-precision arithmetic run fp16 and bf16
            convolutions many times slower than float32, while half-precision Linear layers stay cheap.

    Example::

        >>> net = ConvNet(width=8)
        >>> tuple(net(torch.randn(4, 1, 8, 8)).shape)
        (4, 10)
    """

    def __init__(self, width: int = 32, num_classes: int = 10, float32_features: bool = False) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
            )

        self.float32_features = float32_features
        self.features = nn.Sequential(
            block(1, width), block(width, 2 * width), nn.MaxPool2d(2), block(2 * width, 2 * width)
        )
        self.head = nn.Sequential(
            nn.Linear(2 * width, 2 * width), nn.ReLU(), nn.Linear(2 * width, num_classes)
        )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False) if self.float32_features else nullcontext():
            features = self.features(x.float() if self.float32_features else x).mean(dim=(2, 3))
        report("Activation/features_rms", features.detach().float().pow(2).mean(dim=1).sqrt())
        return self.head(features)


class DigitsModule(L.LightningModule):
    """Classifies the digits with :class:`ConvNet`; AdamW with warm-up + cosine LR schedule per step.

    ``training_step`` returns ``{"loss": loss}`` and reports ``Loss/train`` and ``Accuracy/train``;
    ``validation_step`` reports per-sample ``Loss`` and ``Accuracy``, so the collected means are exact
    over all ranks' samples; ``TrainingStats`` files them under the validation stage and logs them as
    ``val/Loss`` and ``val/Accuracy``.

    Args:
        lr: peak learning rate of the schedule.
        width: channel width of the first conv block.
        weight_decay: AdamW weight decay.
        float32_features: :class:`ConvNet`'s conv blocks in float32 outside autocast.
    """

    def __init__(
        self, lr: float = 1e-2, width: int = 32, weight_decay: float = 1e-4, float32_features: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = ConvNet(width=width, float32_features=float32_features)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float(), y)
        report("Loss/train", loss.detach())
        report("Accuracy/train", (logits.argmax(dim=1) == y).float())
        return {"loss": loss}

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()
        report("Loss", F.cross_entropy(logits, y, reduction="none"))
        report("Accuracy", (logits.argmax(dim=1) == y).float())

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        # Linear warm-up then cosine decay over the planned optimizer steps. The schedule is a
        # function of the step only (LambdaLR does not checkpoint plain functions), so a run
        # resumed with a larger --max-epochs stretches the schedule instead of failing.
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup_steps = max(total_steps // 10, 1)

        def lr_factor(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
            return 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line of the main job (see ``python -m examples.digits -h``)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.digits",
        description="DDP training on scikit-learn's digits with every lightning_ext feature on.",
    )
    add_run_args(parser, name="digits")
    parser.add_argument("--max-epochs", type=int, default=12)
    parser.add_argument(
        "--precision",
        default="16-mixed",
        choices=["16-mixed", "bf16-mixed", "32-true"],
        help="LossScalingPrecision mode (default: 16-mixed, real fp16 with loss scaling); on CPU "
        "the conv blocks run in float32 whatever the mode, the MLP head in it",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="images per batch per rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--stats-every", type=int, default=5, help="TrainingStats period in steps")
    parser.add_argument("--no-sync-batchnorm", action="store_true", help="plain per-rank BatchNorm")
    parser.add_argument(
        "--precise-bn-iters", type=int, default=10, help="PreciseBN batches per rank (0: off)"
    )
    parser.add_argument("--resume", default=None, metavar="PATH", help="checkpoint to resume from")
    parser.add_argument("--min-accuracy", type=float, default=0.95, help="exit 1 below this")
    parser.add_argument("--no-plot", action="store_true", help="skip summary.png")
    args = parser.parse_args(argv)
    check_positive(parser, args, "max_epochs")
    if args.resume is not None and not Path(args.resume).is_file():
        parser.error(f"--resume: no checkpoint file at {args.resume!r}")
    return args


def plot_summary(metrics_csv: str | Path | Sequence[str | Path], out_png: str | Path) -> Path:
    """Draw loss, accuracy, gradient health, loss scale, overflows, throughput, MFU and goodput over
    optimizer steps into ``out_png``.

    Reads the CSV written by Lightning's ``CSVLogger`` (``metrics.csv``; or a run's launches, in
    order: :func:`examples.common.metrics_files`). Uses matplotlib's non-interactive Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics_csv(*([metrics_csv] if isinstance(metrics_csv, str | Path) else metrics_csv))
    fig, axes = plt.subplots(3, 3, figsize=(15, 10), constrained_layout=True)

    def draw(ax: Any, keys: Sequence[str], title: str, **kwargs: Any) -> None:
        for key in keys:
            if series.get(key):
                steps, values = zip(*series[key])
                ax.plot(steps, values, label=key, **kwargs)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        if ax.lines:
            ax.legend(fontsize=8)

    draw(axes[0, 0], ["Loss/train", "val/Loss"], "Loss (mean over ranks)")
    axes[0, 0].set_yscale("log")
    draw(axes[0, 1], ["Accuracy/train", "val/Accuracy"], "Accuracy", marker=".")
    draw(axes[1, 0], ["AMP/loss_scale_log2"], "Loss scale (log2)")
    draw(axes[1, 1], ["AMP/overflow"], "Overflow frequency per flush", drawstyle="steps-post")
    draw(axes[0, 2], ["Grad/norm"], "Gradient norm (unscaled, before clipping)")
    draw(axes[1, 2], ["Grad/update_ratio"], "Update-to-weight ratio")
    for ax in axes[:2, 2]:
        ax.set_yscale("log")
    rates = [f"Throughput/{key}" for key in ("samples_per_sec", "rank_samples_per_sec/min",
                                             "rank_samples_per_sec/max")]  # fmt: skip
    draw(axes[2, 0], rates, "Throughput (samples/s: all ranks; the slowest and fastest rank)")
    draw(axes[2, 1], ["Throughput/mfu"], "MFU (model FLOPs / peak)")
    draw(axes[2, 2], ["Goodput/goodput"], "Goodput (productive / wall time since launch)")
    overflow = [(s, v) for s, v in series.get("AMP/overflow", []) if v > 0]
    if overflow:
        for ax in (axes[1, 0], axes[1, 1]):
            for step, _ in overflow:
                ax.axvline(step, color="tab:red", alpha=0.3, linewidth=1)
    fig.suptitle("lightning_ext digits run")
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def build_trainer(args: argparse.Namespace, run_dir: Path) -> tuple[L.Trainer, dict[str, Any]]:
    """The Trainer of the main job with every feature configured from ``args``.

    Returns the Trainer and the feature objects by name (``"stats"``, ``"timer"``, ``"throughput"``,
    ``"loss_monitor"``, ``"precise_bn"``, ``"precision"``) so callers can read them after ``fit``.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_ext.amp import DynamicLossScaler
    from lightning_ext.callbacks import IterationTimer, LossMonitor, PreciseBN, Throughput, TrainingStats
    from lightning_ext.plugins import LossScalingPrecision, SyncBatchNormPlugin

    # StyleGAN2-ADA's log2 schedule: start high (the first steps overflow and back off), then probe
    # upwards by 0.02 per clean step so the scale tracks the largest value fp16 can hold.
    # bf16-mixed and 32-true need no loss scaling: the plugin's default scaler then only skips
    # non-finite steps.
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    fp16 = args.precision == "16-mixed"
    scaler = DynamicLossScaler(device, 2.0**20, schedule="log2", log2_increment=0.02) if fp16 else None
    features: dict[str, Any] = {
        "timer": IterationTimer(warmup_iter=3),  # first: its step brackets the other callbacks' work
        # CPU: the peak is the float32 matmul rate measured when training starts (the conv blocks,
        # most of the FLOPs, run in float32); GPU: the datasheet's for the precision.
        "throughput": Throughput(peak_dtype=torch.float32 if device == "cpu" else None),
        "stats": TrainingStats(args.stats_every, stats=("mean", "std", "min", "max", "num")),
        "loss_monitor": LossMonitor(every_n_train_steps=20),
    }
    if args.precise_bn_iters > 0:
        features["precise_bn"] = PreciseBN(num_iter=args.precise_bn_iters)
    # The best model by validation accuracy, and last.ckpt at every epoch's end: Lightning writes a
    # monitored callback's last.ckpt only with a new best, so a plateau left it epochs behind.
    best = ModelCheckpoint(run_dir / "checkpoints", "best-{epoch}-{step}", monitor="val/Accuracy", mode="max")
    latest = ModelCheckpoint(run_dir / "checkpoints", "latest-{epoch}-{step}", save_last=True)
    callbacks = [*features.values(), best, latest, ProgressBar()]
    features["precision"] = LossScalingPrecision(args.precision, scaler=scaler, update_ratio=True)
    plugins: list[Any] = [features["precision"]]
    several = args.devices * args.num_nodes > 1
    if not args.no_sync_batchnorm and several:
        plugins.append(SyncBatchNormPlugin())
    strategy = args.strategy or ("ddp" if several else "auto")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.max_epochs,
        plugins=plugins,
        callbacks=callbacks,
        logger=loggers(run_dir, resume=args.resume is not None),
        log_every_n_steps=args.stats_every,
        default_root_dir=run_dir,
        deterministic=True,
    )
    return trainer, features


def _print_table(stats: Any, accuracy: float, console: Any) -> None:
    from rich.table import Table

    table = Table(title="Collected statistics (all ranks, last interval)")
    for column in ("name", "num", "mean", "std", "min", "max"):
        table.add_column(column, justify="left" if column == "name" else "right")
    for name, values in sorted(stats.collector.as_dict().items()):
        table.add_row(
            name,
            f"{values['num']:.0f}",
            *(f"{values[key]:.4g}" for key in ("mean", "std", "min", "max")),
        )
    console.print(table)
    console.print(f"Validation accuracy: [bold]{accuracy:.4f}[/bold]")


def _print_performance(metrics: dict[str, Any], console: Any) -> None:
    """The last flush's throughput, MFU and goodput (``trainer.callback_metrics``: all ranks')."""
    value = {key: float(v) for key, v in metrics.items() if key.startswith(("Throughput/", "Goodput/"))}
    if "Throughput/samples_per_sec" in value:
        console.print(
            f"Throughput (last interval): {value['Throughput/samples_per_sec']:.0f} samples/s, "
            f"{value['Throughput/samples_per_sec_per_device']:.0f} per device, ranks "
            f"{value['Throughput/rank_samples_per_sec/min']:.0f}-{value['Throughput/rank_samples_per_sec/max']:.0f}"
            + (f"; MFU {value['Throughput/mfu']:.2%}" if "Throughput/mfu" in value else "")
        )
    if "Goodput/goodput" in value:
        parts = {p: value.get(f"Goodput/{p}_sec") for p in ("productive", *LOST_TIME_CAUSES, "other")}
        console.print(
            f"Goodput: {value['Goodput/goodput']:.1%} of the wall time since the first launch, "
            + ", ".join(f"{part} {seconds:.1f} s" for part, seconds in parts.items() if seconds is not None)
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the process exit status (0, or 1 when accuracy < ``--min-accuracy``)."""
    args = parse_args(argv)
    run_dir = start_run(args)
    datamodule = DigitsDataModule(batch_size=args.batch_size, seed=args.seed)
    trainer, features = build_trainer(args, run_dir)
    on_cpu = trainer.strategy.root_device.type == "cpu"  # --accelerator auto included
    model = DigitsModule(lr=args.lr, width=args.width, float32_features=on_cpu)
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.resume)
    # The last validation ran after PreciseBN's last update (it runs after an epoch's last batch):
    # its accuracy is the final model's. A resumed run that trained nothing validates once.
    trained = "val/Accuracy" in trainer.callback_metrics
    if not trained:
        trainer.validate(model, datamodule=datamodule, verbose=False)
    accuracy = float(trainer.callback_metrics["val/Accuracy"])
    if trainer.is_global_zero:
        from rich.console import Console

        console = Console(soft_wrap=True)  # a line stays one line whatever the width: logs are grepped
        if trained:  # (else the statistics restored from the checkpoint: an earlier launch's)
            _print_table(features["stats"], accuracy, console)  # IterationTimer logged its speed summary
        else:
            console.print(f"Nothing left to train (the checkpoint is at --max-epochs). Validation accuracy: "
                          f"[bold]{accuracy:.4f}[/bold]")  # fmt: skip
        _print_performance(trainer.callback_metrics, console)
        if not args.no_plot:
            png = plot_summary(metrics_files(run_dir), run_dir / "summary.png")
            console.print(f"Summary figure: {png}")
        console.print(f"Logs and checkpoints: {run_dir}/")
        if accuracy < args.min_accuracy:
            console.print(f"[red]accuracy {accuracy:.4f} < --min-accuracy {args.min_accuracy}[/red]")
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
