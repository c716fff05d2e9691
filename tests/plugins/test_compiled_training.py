"""A compiled LightningModule on 2 CPU processes (``ddp_spawn``) with every feature on, vs eager.

The module's ``configure_model`` compiles its network (conv net with SyncBatchNorm layers) with
``fullgraph=True`` and the default (inductor) backend, in each fresh ``ddp_spawn`` worker;
``LossScalingPrecision("16-mixed")`` scales the loss (fp16 autocast on CPU), ``TrainingStats``
collects what ``training_step`` reports. The same run without compiling gives the reference:
per-step losses, the final weights and running statistics, the loss scale and the collected
statistics. The reference runs Lightning's DDP inside the test harness's two gloo workers (as under
torchrun; the same DDP, data and steps) rather than in two more spawned processes.

Tolerance: inductor fuses the pointwise ops around the convolutions and SyncBatchNorm's kernels and
keeps the fused intermediates in float32, where eager autocast rounds each op's output to float16
(unit roundoff ``u = 2**-11``); the loss and the gradients of one step then differ by a few ``u``
relative, and after ``STEPS`` SGD steps (learning rate 0.1) the weights by a few ``u`` relative to
their magnitude: ``rtol = atol = 4e-3`` (8 ``u``) leaves room for that and fails on any real
difference (a missed collective changes the statistics by tens of percent).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import TrainingStats
from lightning_ext.nn import SyncBatchNorm, convert_sync_batchnorm
from lightning_ext.plugins import LossScalingPrecision
from lightning_ext.stats import report
from tests.helpers.distributed import run_distributed

STEPS = 3
RTOL = ATOL = 4e-3  # module docstring


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = 2.0 * torch.randn(2 * STEPS * 4, 1, 8, 8, generator=g) + 1.0
    return TensorDataset(x, torch.randint(0, 3, (x.shape[0],), generator=g))


class _ConvNet(LightningModule):
    def __init__(self, compiled: bool, optimize_ddp: bool | None = None) -> None:
        super().__init__()
        self.compiled = compiled
        self.optimize_ddp = optimize_ddp
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
        )  # fmt: skip
        self.net = convert_sync_batchnorm(net)

    @override
    def configure_model(self) -> None:
        if self.optimize_ddp is not None:  # this worker's dynamo: see _fit_compiled
            torch._dynamo.config.optimize_ddp = self.optimize_ddp
        if self.compiled:  # in each worker, before DDP wraps the module (Lightning's pattern)
            self.net = torch.compile(self.net, fullgraph=True)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        report("Loss/train", loss.detach())
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=4, shuffle=False)


class _Record(Callback):
    """Each rank saves its losses, final state, loss scale and collected metrics."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: list[torch.Tensor] = []
        self.graphs = 0  # dynamo's count before the fit (a harness worker may have compiled before)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        self.graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        net = getattr(pl_module.net, "_orig_mod", pl_module.net)  # the module torch.compile wraps
        torch.save(
            {
                "losses": torch.stack(self.losses),
                "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
                "classes": sorted({type(m).__name__ for m in net.modules()}),
                "scale": torch.as_tensor(trainer.precision_plugin.scaler.get_scale()),
                "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
                "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - self.graphs,
            },
            Path(self.path) / f"rank{trainer.global_rank}.pt",
        )


def _trainer(out: Path, strategy: str) -> Trainer:
    """The Trainer of both runs, on 2 CPU processes, recording into ``out``."""
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[LossScalingPrecision("16-mixed")],
        callbacks=[TrainingStats(every_n_train_steps=STEPS), _Record(str(out))],
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _records(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def _fit_eager_worker(rank: int, world_size: int, out: str) -> None:
    """Lightning DDP inside the harness's process group (as under torchrun), without compiling."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    trainer = _trainer(Path(out), strategy="ddp")
    assert trainer.global_rank == rank
    trainer.fit(_ConvNet(compiled=False))


def _fit_eager(tmp_path: Path) -> list[dict]:
    out = tmp_path / "eager"
    out.mkdir()
    run_distributed(_fit_eager_worker, 2, str(out), timeout=150)
    return _records(out)


def _fit_compiled(tmp_path: Path, optimize_ddp: bool | None = None) -> list[dict]:
    """The compiled run (``ddp_spawn``); where dynamo's DDPOptimizer rejects the graph (torch 2.5: it
    cannot split a graph holding a higher-order op, which SyncBatchNorm's autograd.Function becomes,
    pytorch#104674), again with the workaround torch's error names and the guide documents."""
    out = tmp_path / f"compiled-{optimize_ddp}"
    out.mkdir()
    try:
        _trainer(out, strategy="ddp_spawn").fit(_ConvNet(compiled=True, optimize_ddp=optimize_ddp))
    except Exception as exc:
        if optimize_ddp is not None or "DDPOptimizer backend: Found a higher order op" not in str(exc):
            raise
        return _fit_compiled(tmp_path, optimize_ddp=False)
    return _records(out)


@pytest.mark.timeout(300)
def test_compiled_module_trains_like_eager_with_loss_scaling_and_training_stats(tmp_path: Path) -> None:
    eager, compiled = _fit_eager(tmp_path), _fit_compiled(tmp_path)
    for rank in range(2):
        ours, ref = compiled[rank], eager[rank]
        assert ours["classes"] == ref["classes"] and SyncBatchNorm.__name__ in ours["classes"]
        assert ours["graphs"] >= 1 and ref["graphs"] == 0  # compiled, and eager
        assert ours["losses"].shape == (STEPS,)
        torch.testing.assert_close(ours["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
        assert ours["state"].keys() == ref["state"].keys()
        for key, value in ours["state"].items():
            torch.testing.assert_close(value, ref["state"][key], rtol=RTOL, atol=ATOL, msg=key)
        torch.testing.assert_close(ours["scale"], ref["scale"], rtol=0, atol=0)
        assert "Loss/train" in ours["metrics"]
        loss, expected = ours["metrics"]["Loss/train"], ref["metrics"]["Loss/train"]
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    # The statistics are synchronized: both ranks hold the same running statistics.
    for key, value in compiled[0]["state"].items():
        if "running" in key:
            torch.testing.assert_close(value, compiled[1]["state"][key], rtol=0, atol=0, msg=key)
