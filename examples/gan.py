"""A GAN on scikit-learn's digits with one loss scale per optimizer (StyleGAN2-ADA's training setup).

Run it with ``python -m examples.gan``. By default it trains an MLP generator (with
BatchNorm) against an MLP discriminator on the 1,797 real 8×8 images of
``sklearn.datasets.load_digits`` with ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``,
manual optimization (the non-saturating logistic loss, and StyleGAN2's lazy R1 regularization: a
second discriminator step every ``--r1-interval`` batches) and:

- :class:`~lightning_ext.plugins.LossScalingPrecision` ``("16-mixed")`` with
  ``DynamicLossScaler(per_optimizer=True, schedule="log2")``: real fp16 on CPU, the generator and the
  discriminator each with their own scale (``AMP/G/...``, ``AMP/D/...``), so the discriminator's
  overflows do not drag the generator's scale down;
- :class:`~lightning_ext.plugins.SyncBatchNormPlugin` for the generator's BatchNorm;
- :class:`~lightning_ext.callbacks.TrainingStats`, :class:`~lightning_ext.callbacks.IterationTimer`,
  :class:`~lightning_ext.callbacks.Throughput` (samples/s over all ranks and goodput),
  :class:`~lightning_ext.callbacks.LossMonitor`, :class:`~lightning_ext.callbacks.ResourceStats` and
  Lightning's ``LearningRateMonitor``.

Quality is measured: the Fréchet distance (torchmetrics' ``FrechetInceptionDistance``) between real
and generated images in the feature space of a digits classifier trained at the start of the job
(its penultimate layer; nothing is downloaded), over all ranks, before and after training. The job
exits with status 1 unless the final FID is at most ``--max-fid-ratio`` (0.5) times the initial one.
It writes logs and checkpoints under ``runs/<name>/``, ``samples.png`` (a grid of generated digits)
and ``loss_scales.png`` (both loss scales and both overflow frequencies over steps). On CPU the
models are MLPs (fp16 convolution backward is very slow there); ``--arch conv`` (the default with
``--accelerator gpu``) uses transposed and strided convolutions.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.image.fid import FrechetInceptionDistance
from typing_extensions import override

from examples import common
from lightning_ext.stats import report

_Z_DIM = 32


# ---------------------------------------------------------------------------------------------
# Data and the FID feature extractor
# ---------------------------------------------------------------------------------------------


def load_gan_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as float32 ``(N, 1, 8, 8)`` images in ``[-1, 1]`` and int64 ``(N,)`` labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.as_tensor(data.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    return images, torch.as_tensor(data.target, dtype=torch.int64)


class DigitsFeatures(nn.Module):
    """A digits classifier whose penultimate layer is the FID feature space (``num_features`` = 64).

    ``forward`` maps float ``(N, 1, 8, 8)`` images in ``[-1, 1]`` to float32 ``(N, 64)`` features;
    :meth:`fit` trains it (Adam, cross-entropy, full-batch epochs) deterministically for a seed.
    """

    num_features = 64

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images.float())

    def fit(self, images: torch.Tensor, labels: torch.Tensor, steps: int = 300, seed: int = 0) -> float:
        """Train on ``images``/``labels``; returns the training accuracy afterwards."""
        generator = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            for layer in (*self.body, self.head):
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
        optimizer = torch.optim.Adam(self.parameters(), lr=3e-3)
        for _ in range(steps):
            index = torch.randint(len(images), (256,), generator=generator)
            loss = F.cross_entropy(self.head(self(images[index])), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            return float((self.head(self(images)).argmax(1) == labels).float().mean())


class FID(Callback):
    """FID of the generator against the real images before and after training, over all ranks.

    Each rank feeds its shard of ``real`` and ``num_fake // world_size`` samples (seeded per rank)
    to one ``FrechetInceptionDistance`` with ``feature=extractor``; ``compute()`` sums the feature
    moments over the ranks. Reads ``pl_module.sample(n, generator)``. ``start`` and ``end``
    hold the values (on every rank); ``FID/start`` and ``FID/end`` are ``report()``-ed.
    """

    def __init__(self, extractor: nn.Module, real: torch.Tensor, num_fake: int = 1000, seed: int = 0) -> None:
        self.extractor, self.real, self.num_fake, self.seed = extractor, real, num_fake, seed
        self.start: float | None = None
        self.end: float | None = None

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        rank, world = trainer.global_rank, trainer.world_size
        metric = FrechetInceptionDistance(feature=self.extractor, reset_real_features=True)
        metric = metric.to(pl_module.device)
        metric.update(self.real[rank::world].to(pl_module.device), real=True)
        generator = torch.Generator(pl_module.device).manual_seed(self.seed + rank)
        metric.update(pl_module.sample(self.num_fake // world, generator), real=False)
        return float(metric.compute())

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = self.measure(trainer, pl_module)
        report("FID/start", self.start)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end = self.measure(trainer, pl_module)
        report("FID/end", self.end)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _mlp_generator(width: int = 256) -> nn.Module:
    """``(N, _Z_DIM)`` noise -> ``(N, 1, 8, 8)`` images in ``[-1, 1]``; BatchNorm after each hidden layer."""
    return nn.Sequential(
        nn.Linear(_Z_DIM, width), nn.BatchNorm1d(width), nn.LeakyReLU(0.2),
        nn.Linear(width, width), nn.BatchNorm1d(width), nn.LeakyReLU(0.2),
        nn.Linear(width, 64), nn.Tanh(), nn.Unflatten(1, (1, 8, 8)),
    )  # fmt: skip


def _mlp_discriminator(width: int = 256) -> nn.Module:
    """``(N, 1, 8, 8)`` images -> ``(N, 1)`` logits."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
        nn.Linear(width, 1),
    )  # fmt: skip


def _conv_generator(width: int = 64) -> nn.Module:
    """The convolutional generator: 2×2 -> 4×4 -> 8×8 transposed convolutions with BatchNorm."""
    return nn.Sequential(
        nn.Linear(_Z_DIM, 2 * width * 4), nn.Unflatten(1, (2 * width, 2, 2)), nn.BatchNorm2d(2 * width),
        nn.LeakyReLU(0.2), nn.ConvTranspose2d(2 * width, width, 4, 2, 1), nn.BatchNorm2d(width),
        nn.LeakyReLU(0.2), nn.ConvTranspose2d(width, 1, 4, 2, 1), nn.Tanh(),
    )  # fmt: skip


def _conv_discriminator(width: int = 64) -> nn.Module:
    """The convolutional discriminator: 8×8 -> 4×4 -> 2×2 strided convolutions, then a linear logit."""
    return nn.Sequential(
        nn.Conv2d(1, width, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(width, 2 * width, 4, 2, 1),
        nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(2 * width * 4, 1),
    )  # fmt: skip


class GanModule(L.LightningModule):
    """Non-saturating logistic GAN with lazy R1 regularization, in manual optimization.

    Per batch: a discriminator step on ``softplus(D(fake)) + softplus(-D(real))``; every
    ``r1_interval``-th batch a second discriminator step on ``r1_gamma / 2 · r1_interval ·
    ‖∇_x D(x_real)‖²`` (StyleGAN2's lazy regularization); then a generator step on
    ``softplus(-D(G(z)))``. Each step toggles its optimizer, so the precision plugin scales each
    backward by that optimizer's scale. ``training_step`` returns ``{"loss": loss_D + loss_G,
    "loss_D": ..., "loss_G": ...}`` for :class:`~lightning_ext.callbacks.LossMonitor` and reports
    ``Loss/D``, ``Loss/G``, ``Loss/R1`` and the discriminator's mean logits ``Logits/real|fake``.

    Args:
        arch: ``"mlp"`` or ``"conv"``.
        lr: Adam learning rate of both networks (betas ``(0.5, 0.99)``).
        r1_gamma: R1 weight γ.
        r1_interval: batches between R1 steps (0: no R1).

    Raises:
        ValueError: ``arch`` is neither ``"mlp"`` nor ``"conv"``.
    """

    def __init__(
        self, arch: str = "mlp", lr: float = 2e-3, r1_gamma: float = 0.1, r1_interval: int = 4
    ) -> None:
        super().__init__()
        if arch not in ("mlp", "conv"):
            raise ValueError(f"GanModule: arch must be 'mlp' or 'conv', got {arch!r}")
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.G = _mlp_generator() if arch == "mlp" else _conv_generator()
        self.D = _mlp_discriminator() if arch == "mlp" else _conv_discriminator()

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` generated float32 images ``(n, 1, 8, 8)`` in ``[-1, 1]`` (eval mode, no grad)."""
        was_training = self.G.training
        self.G.eval()
        with torch.no_grad():
            z = torch.randn(n, _Z_DIM, generator=generator, device=self.device)
            images = self.G(z).float()
        self.G.train(was_training)
        return images

    def _optimize(self, optimizer: Any, loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()

    @override
    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(real), _Z_DIM, device=self.device)

        self.toggle_optimizer(opt_d)
        logits_fake, logits_real = self.D(self.G(z).detach()).float(), self.D(real).float()
        loss_d = F.softplus(logits_fake).mean() + F.softplus(-logits_real).mean()
        self._optimize(opt_d, loss_d)
        interval = self.hparams.r1_interval
        if interval and batch_idx % interval == 0:
            self._optimize(opt_d, self._r1_penalty(real) * (self.hparams.r1_gamma / 2 * interval))
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        loss_g = F.softplus(-self.D(self.G(z)).float()).mean()
        self._optimize(opt_g, loss_g)
        self.untoggle_optimizer(opt_g)

        report("Loss/D", loss_d.detach())
        report("Loss/G", loss_g.detach())
        report("Logits/real", logits_real.detach())
        report("Logits/fake", logits_fake.detach())
        return {"loss": (loss_d + loss_g).detach(), "loss_D": loss_d.detach(), "loss_G": loss_g.detach()}

    def _r1_penalty(self, real: torch.Tensor) -> torch.Tensor:
        """Mean over the batch of ``‖∇_x D(x)‖²`` at the real images (float32, outside autocast)."""
        real = real.detach().requires_grad_(True)
        with torch.autocast(self.device.type, enabled=False):
            (grad,) = torch.autograd.grad(self.D(real).sum(), real, create_graph=True)
        penalty = grad.square().sum(dim=(1, 2, 3)).mean()
        report("Loss/R1", penalty.detach())
        return penalty

    @override
    def configure_optimizers(self) -> Any:
        betas = (0.5, 0.99)
        return (
            torch.optim.Adam(self.G.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.D.parameters(), lr=self.hparams.lr, betas=betas),
        )


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def save_samples(images: torch.Tensor, out_png: str | Path, columns: int = 16) -> Path:
    """Draw ``images`` (float ``(N, 1, 8, 8)`` in ``[-1, 1]``) as a grid into ``out_png`` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(images) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 0.6, rows * 0.6))
    for ax, image in zip(axes.flat, images.cpu()):
        ax.imshow(image[0].numpy(), cmap="gray_r", vmin=-1, vmax=1)
    for ax in axes.flat:
        ax.axis("off")
    fig.subplots_adjust(left=0, right=1, bottom=0, top=1, wspace=0.05, hspace=0.05)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def plot_loss_scales(metrics_csv: str | Path, out_png: str | Path) -> Path:
    """Draw both loss scales (log2) and both overflow frequencies (or the shared scale's,
    ``--shared-scale``) over the logger's steps (batches: each steps the generator, the discriminator
    and, every few batches, its R1 penalty) from ``metrics.csv``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = common.read_metrics_csv(metrics_csv)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, key, title in (
        (axes[0], "loss_scale_log2", "Loss scale (log2)"),
        (axes[1], "overflow", "Overflow frequency per flush"),
    ):
        for name, column in (("G", f"AMP/G/{key}"), ("D", f"AMP/D/{key}"), ("shared", f"AMP/{key}")):
            if series.get(column):
                steps, values = zip(*series[column])
                ax.plot(steps, values, label=name, drawstyle="steps-post" if key == "overflow" else "default")
        ax.set_title(title)
        ax.set_xlabel("batch (the logger's step)")
        if ax.lines:
            ax.legend()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see ``python -m examples.gan -h``)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.gan",
        description="A GAN on scikit-learn's digits with one fp16 loss scale per optimizer.",
    )
    common.add_run_args(parser, name="gan")
    parser.add_argument(
        "--arch", default=None, choices=["mlp", "conv"], help="default: conv on gpu, else mlp"
    )
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--r1-gamma", type=float, default=0.1)
    parser.add_argument("--r1-interval", type=int, default=4, help="batches between R1 steps (0: off)")
    parser.add_argument("--shared-scale", action="store_true", help="one loss scale for both optimizers")
    parser.add_argument("--stats-every", type=int, default=10, help="TrainingStats period in steps")
    parser.add_argument("--fid-samples", type=int, default=1000, help="generated images per FID")
    parser.add_argument("--max-fid-ratio", type=float, default=0.5, help="exit 1 above final/initial FID")
    parser.add_argument("--no-plot", action="store_true", help="skip samples.png and loss_scales.png")
    args = parser.parse_args(argv)
    common.check_positive(parser, args, "max_epochs", "batch_size", "fid_samples")
    if args.arch is None:
        args.arch = "conv" if args.accelerator == "gpu" else "mlp"
    return args


def build_trainer(args: argparse.Namespace, run_dir: Path, fid: FID) -> L.Trainer:
    """The Trainer of the GAN job, with every feature configured from ``args``."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ext.amp import DynamicLossScaler
    from lightning_ext.callbacks import IterationTimer, LossMonitor, ResourceStats, Throughput, TrainingStats
    from lightning_ext.plugins import LossScalingPrecision, SyncBatchNormPlugin

    scaler = DynamicLossScaler(
        "cuda" if args.accelerator == "gpu" else "cpu", init_scale=2.0**16, schedule="log2",
        log2_increment=0.01, per_optimizer=not args.shared_scale,
    )  # fmt: skip
    precision = LossScalingPrecision("16-mixed", scaler=scaler, optimizer_names=["G", "D"])
    world = args.devices * args.num_nodes
    plugins: list[Any] = [precision] + ([SyncBatchNormPlugin()] if world > 1 else [])
    # The discriminator's parameters are unused in the generator's backward (toggled off).
    strategy = args.strategy or (DDPStrategy(find_unused_parameters=True) if world > 1 else "auto")
    callbacks = [
        IterationTimer(warmup_iter=3),
        ResourceStats(every_n_train_steps=args.stats_every),
        Throughput(flops_fn=None),  # (samples and goodput: a GAN's MFU is not this job's question)
        TrainingStats(every_n_train_steps=args.stats_every, stats=("mean", "max", "num")),
        LossMonitor(every_n_train_steps=50),
        LearningRateMonitor(logging_interval="epoch"),
        fid,
        ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True),
        common.ProgressBar(),
    ]
    return L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        max_epochs=args.max_epochs, plugins=plugins, callbacks=callbacks, logger=common.loggers(run_dir),
        log_every_n_steps=args.stats_every, default_root_dir=run_dir, limit_val_batches=0,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the GAN job; returns the exit status (0, or 1 when final FID > ``--max-fid-ratio`` × initial)."""
    args = parse_args(argv)
    run_dir = common.start_run(args)
    images, labels = load_gan_digits()
    extractor = DigitsFeatures()
    extractor.fit(images, labels, seed=args.seed)
    fid = FID(extractor.requires_grad_(False).eval(), images, num_fake=args.fid_samples, seed=args.seed)
    model = GanModule(args.arch, lr=args.lr, r1_gamma=args.r1_gamma, r1_interval=args.r1_interval)
    loader = DataLoader(TensorDataset(images), batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer = build_trainer(args, run_dir, fid)
    trainer.fit(model, train_dataloaders=loader)
    passed = fid.end <= args.max_fid_ratio * fid.start
    if trainer.is_global_zero:
        from rich.console import Console

        console = Console(soft_wrap=True)  # a line stays one line whatever the width: logs are grepped
        console.print(
            f"FID: {fid.start:.3f} at the start, {fid.end:.3f} at the end ({fid.end / fid.start:.3f}×)"
        )
        if not args.no_plot:
            generator = torch.Generator(model.device).manual_seed(args.seed)
            console.print(f"Samples: {save_samples(model.sample(128, generator), run_dir / 'samples.png')}")
            console.print(
                f"Loss scales: {plot_loss_scales(run_dir / 'metrics.csv', run_dir / 'loss_scales.png')}"
            )
        console.print(f"Logs and checkpoints: {run_dir}/")
        if not passed:
            console.print(f"[red]final FID > --max-fid-ratio {args.max_fid_ratio} × initial FID[/red]")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
