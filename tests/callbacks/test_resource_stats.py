"""ResourceStats: names, units and cross-rank reduction in a 2-process DDP run; CUDA peaks."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext import reset
from lightning_ext.callbacks import TrainingStats
from lightning_ext.callbacks.resource_stats import ResourceStats
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import ddp_trainer

EVERY, BATCH = 2, 4
BALLAST_GB = 0.25


class _Module(pl.LightningModule):
    """Linear regression; rank 1 holds ``BALLAST_GB`` of touched memory, so its RSS is the larger."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    @override
    def on_train_start(self):
        if self.global_rank == 1:
            self.ballast = torch.ones(int(BALLAST_GB * 2**30) // 4)

    @override
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).square().mean()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @override
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 3)), batch_size=BATCH)


class _Record(Callback):
    """This rank's resident set size before the module's ``on_train_start`` (GiB); after each flush:
    this rank's last ResourceStats values and the reduced ones of TrainingStats."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.rows: list[dict] = []

    @override
    def on_train_start(self, trainer, pl_module):  # callbacks' hooks run before the module's
        self.start_gb = psutil.Process().memory_info().rss / 2**30

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % EVERY == 0:
            resources = next(c for c in trainer.callbacks if isinstance(c, ResourceStats))
            collector = next(c for c in trainer.callbacks if isinstance(c, TrainingStats)).collector
            reduced = {
                name: (collector.num(name), collector.mean(name), collector.max(name))
                for name in collector.names()
            }
            self.rows.append({"local": dict(resources.last_report), "reduced": reduced})

    @override
    def on_train_end(self, trainer, pl_module):
        torch.save((self.start_gb, self.rows), Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def _fit(rank: int, world: int, out_dir: str) -> None:
    """One rank of a 2-rank DDP fit (Lightning's ``"ddp"`` on the harness's workers)."""
    reset()
    trainer = ddp_trainer(
        rank, world, max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            ResourceStats(every_n_train_steps=EVERY),
            TrainingStats(every_n_train_steps=EVERY, regex="Resources/.*", stats=("mean", "max", "num")),
            _Record(out_dir),
        ],
    )  # fmt: skip
    trainer.fit(_Module())


@pytest.mark.timeout(240)
def test_two_ranks_report_names_units_and_the_max_over_ranks(tmp_path: Path):
    run_distributed(_fit, 2, str(tmp_path), timeout=200)
    (start0, rows0), (start1, rows1) = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert len(rows0) == len(rows1) == 4
    names = {"Resources/cpu_mem_gb"}  # (throughput: the Throughput callback)
    for row0, row1 in zip(rows0, rows1):
        assert set(row0["reduced"]) == names
        assert row0["reduced"] == row1["reduced"]
        # One report per rank per flush: num 2, max and mean of the two ranks' values (float32
        # storage: relative error <= 2**-24 each).
        for name, (num, mean, high) in row0["reduced"].items():
            a, b = row0["local"][name.split("/")[1]], row1["local"][name.split("/")[1]]
            assert num == 2
            assert high == pytest.approx(max(a, b), rel=2**-23)
            assert mean == pytest.approx((a + b) / 2, rel=2**-22)
        # Rank 1's ballast: its resident set grew by it beyond rank 0's (the workers' sizes before the
        # fit differ by what earlier calls left).
        grown = row1["local"]["cpu_mem_gb"] - start1 - (row0["local"]["cpu_mem_gb"] - start0)
        assert grown > 0.8 * BALLAST_GB, (start0, start1, row0, row1)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"^ResourceStats: `every_n_train_steps` must be an int >= 1, got 0"):
        ResourceStats(every_n_train_steps=0)
    with pytest.raises(TypeError, match=r"`every_n_train_steps` must be an int >= 1, got True \(bool\)$"):
        ResourceStats(every_n_train_steps=True)


class _CudaModule(_Module):
    """Allocates ``BALLAST_GB`` on the device during step 2 only."""

    @override
    def on_train_start(self):
        pass

    @override
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            torch.ones(int(BALLAST_GB * 2**30) // 4, device=self.device).sum()
        return super().training_step(batch, batch_idx)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peaks_cover_the_interval_and_reset_after_each_report():
    reset()
    resources = ResourceStats(every_n_train_steps=1)
    peaks = []

    class _Peaks(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            peaks.append(resources.last_report["peak_gpu_mem_gb"])
            assert resources.last_report["peak_gpu_mem_reserved_gb"] >= peaks[-1]

    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[resources, _Peaks()],
    )  # fmt: skip
    trainer.fit(_CudaModule())
    assert peaks[2] >= BALLAST_GB
    assert max(peaks[3:]) < BALLAST_GB / 2
