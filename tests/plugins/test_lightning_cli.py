"""LightningCLI: our plugins and callbacks as ``class_path`` entries of a YAML config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import IterationTimer, LossMonitor, Throughput, TrainingStats
from lightning_ext.plugins import LossScalingPrecision

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (dev extras)")

CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  plugins:
    - class_path: lightning_ext.plugins.LossScalingPrecision
      init_args:
        precision: 16-mixed
        scaler:
          class_path: lightning_ext.amp.DynamicLossScaler
          init_args:
            device: cpu
            init_scale: 1024.0
            schedule: {schedule}
            min_scale: 1.0
  callbacks:
    - class_path: lightning_ext.callbacks.IterationTimer
      init_args:
        warmup_iter: 1
    - class_path: lightning_ext.callbacks.Throughput
      init_args:
        samples_fn: tests.plugins.test_lightning_cli.samples_in
        flops_fn: null
    - class_path: lightning_ext.callbacks.TrainingStats
      init_args:
        every_n_train_steps: 3
        stats: [mean, max]
    - class_path: lightning_ext.callbacks.LossMonitor
      init_args:
        every_n_train_steps: 2
model:
  lr: 0.05
"""


def samples_in(batch) -> int:  # (-> int: LightningCLI refused a function typed so for Throughput's)
    return len(batch[0])


class CliModel(LightningModule):
    """Linear regression whose hyperparameters come from the YAML ``model:`` section."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Linear(4, 1)

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @override
    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _cli(tmp_path: Path, schedule: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(schedule=schedule))
    return LightningCLI(CliModel, args=["fit", "--config", str(config)], save_config_callback=None)


def test_yaml_with_our_plugins_and_callbacks_trains(tmp_path: Path):
    cli = _cli(tmp_path, schedule="log2")
    trainer = cli.trainer
    assert trainer.global_step == 6 and cli.model.lr == 0.05
    plugin = trainer.precision_plugin
    assert isinstance(plugin, LossScalingPrecision)
    assert plugin.scaler.schedule == "log2" and plugin.scaler.min_scale == 1.0 and plugin.scaler.steps == 6
    kinds = {type(c) for c in trainer.callbacks}
    assert {IterationTimer, LossMonitor, TrainingStats} <= kinds
    assert next(c for c in trainer.callbacks if isinstance(c, TrainingStats)).stats == ("mean", "max")
    throughput = next(c for c in trainer.callbacks if isinstance(c, Throughput))
    assert throughput.samples_fn is samples_in and throughput.last_metrics["Throughput/samples_per_sec"] > 0


def test_a_wrong_value_in_the_yaml_is_a_clear_parser_error(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(tmp_path, schedule="cosine")
    assert info.value.code != 0
    err = capsys.readouterr().err
    # jsonargparse checks the value against the Literal type hint and names the argument.
    assert "schedule" in err and "cosine" in err
