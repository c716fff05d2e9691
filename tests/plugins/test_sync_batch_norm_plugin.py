"""SyncBatchNormPlugin: a Trainer on 2 CPU processes (where sync_batchnorm=True fails) vs one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext.nn import SyncBatchNorm
from lightning_ext.plugins import SyncBatchNormPlugin

N, F = 16, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = 5.0 + 3.0 * torch.randn(N, F, generator=g)
    return x, x.sum(1, keepdim=True) / 10


class BatchNormRegressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.BatchNorm1d(F), nn.Linear(F, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data()), batch_size=3, shuffle=False)


class RecordStats(Callback):
    """Each rank writes its layer classes and running stats (the main process only sees rank 0)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module):
        self.classes = [type(m).__name__ for m in pl_module.net]
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].clone())

    def on_train_end(self, trainer, pl_module):
        bn = pl_module.net[0]
        torch.save(
            {
                "classes": self.classes,
                "batches": self.batches,
                "running_mean": bn.running_mean.clone(),
                "running_var": bn.running_var.clone(),
                "num_batches_tracked": bn.num_batches_tracked.clone(),
            },
            Path(self.directory) / f"rank{trainer.global_rank}.pt",
        )


def _reference_running_stats(per_rank_batches):
    """One process, float64 BatchNorm1d on each global batch (the concatenation of the ranks' batches)."""
    bn = nn.BatchNorm1d(F).double()
    for step_batches in zip(*per_rank_batches):
        bn(torch.cat(step_batches).double())
    return bn


@pytest.mark.timeout(240)
def test_trainer_ddp_spawn_on_cpu_synchronizes_and_reverts(tmp_path):
    model = BatchNormRegressor()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        plugins=[SyncBatchNormPlugin(group_size=2)],
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[RecordStats(str(tmp_path))],
    )
    trainer.fit(model)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = _reference_running_stats([rec["batches"] for rec in ranks])
    assert [len(b) for b in ranks[0]["batches"]] == [3, 3, 2]  # each rank has 8 of the 16 samples
    assert not torch.equal(ranks[0]["batches"][0], ranks[1]["batches"][0])
    for rec in ranks:
        assert rec["classes"] == ["SyncBatchNorm", "Linear", "SyncBatchNorm", "Linear"]
        assert int(rec["num_batches_tracked"]) == 3
        torch.testing.assert_close(rec["running_mean"].double(), reference.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rec["running_var"].double(), reference.running_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(ranks[0]["running_var"], ranks[1]["running_var"])
    # The user's module keeps its classes and received the trained state.
    assert [type(m) for m in model.net] == [nn.BatchNorm1d, nn.Linear, nn.BatchNorm1d, nn.Linear]
    torch.testing.assert_close(model.net[0].running_var, ranks[0]["running_var"])
    assert not torch.equal(model.net[1].weight, initial["net.1.weight"])
    assert torch.isfinite(model.net[3].weight).all()


def test_apply_and_revert_without_trainer():
    plugin = SyncBatchNormPlugin(backend="reference")
    model = BatchNormRegressor()
    converted = plugin.apply(model)
    assert isinstance(converted.net[0], SyncBatchNorm) and converted.net[0].backend == "reference"
    reverted = plugin.revert(converted)
    assert type(reverted.net[0]) is nn.BatchNorm1d and reverted.net[0].weight is model.net[0].weight


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"pass either `process_group` or `group_size`, not both"):
        SyncBatchNormPlugin(process_group=object(), group_size=2)
    with pytest.raises(ValueError, match=r"`group_size` must be >= 1, got 0"):
        SyncBatchNormPlugin(group_size=0)
    with pytest.raises(TypeError, match=r"`group_size` must be an int or None, got '2'"):
        SyncBatchNormPlugin(group_size="2")
    with pytest.raises(TypeError, match=r"`backend` must be a kernel backend name \(str\) or None, got 5"):
        SyncBatchNormPlugin(backend=5)
