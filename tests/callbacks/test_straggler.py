"""The straggler in real ``ddp_spawn`` Trainer runs: a rank sleeping in ``training_step`` or in its
data loader is named, with SyncBatchNorm (the fast ranks wait inside the forward's all-reduce) and
with plain DDP, and a job without a straggler prints no line."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ext.callbacks import IterationTimer, TrainingStats
from lightning_ext.plugins import SyncBatchNormPlugin

SLOW_RANK = 1
EXTRA_SEC = 0.04  # the slow rank's extra time per step, in training_step or in its data loader
EVERY, WARMUP, STEPS, BATCH = 5, 3, 60, 16  # 12 flushes
LINE = re.compile(r"Straggler at iteration=(\d+): rank (\d+) \(host [^)]*\), (\S+) ")


class _Data(Dataset):
    """Random features; the slow rank's loader sleeps ``EXTRA_SEC`` per batch when ``slow_data``."""

    def __init__(self, slow_data: bool) -> None:
        self.x, self.slow_data = torch.randn(STEPS * BATCH, 32), slow_data

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.slow_data and torch.distributed.get_rank() == SLOW_RANK:
            time.sleep(EXTRA_SEC / BATCH)
        return self.x[index]


class _Model(pl.LightningModule):
    def __init__(self, slow: str | None) -> None:
        super().__init__()
        self.slow = slow
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
        )

    def training_step(self, batch, batch_idx):
        if self.slow == "step" and self.global_rank == SLOW_RANK:
            time.sleep(EXTRA_SEC)  # before the forward: with SyncBatchNorm the others wait inside it
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_Data(self.slow == "data"), batch_size=BATCH)


def run_job(tmp_path: Path, capfd, world: int, slow: str | None, sync_bn: bool = True, *extra):
    """Train ``STEPS`` steps on ``world`` ranks (with the ``extra`` callbacks); the CSV rows of the
    flushes, the straggler lines ``(iteration, rank, name)`` printed on rank zero and the stderr."""
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp_spawn",
        plugins=[SyncBatchNormPlugin()] if sync_bn else None,
        max_steps=STEPS,
        callbacks=[IterationTimer(warmup_iter=WARMUP), TrainingStats(every_n_train_steps=EVERY), *extra],
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    capfd.readouterr()
    trainer.fit(_Model(slow))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("Timing/data_sec/straggler_rank")]
    err = capfd.readouterr().err
    return rows, [(int(i), int(r), name) for i, r, name in LINE.findall(err)], err


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "slow", "sync_bn"),
    [(2, "step", True), (3, "step", True), (2, "data", True), (2, "step", False)],
)
def test_a_slow_rank_is_named_at_every_flush_after_the_first_two(tmp_path, capfd, world, slow, sync_bn):
    rows, lines, _ = run_job(tmp_path, capfd, world, slow, sync_bn)
    name = {"step": "Timing/compute_sec", "data": "Timing/data_sec"}[slow]
    assert len(rows) >= 12
    assert all(float(row[name + "/straggler_rank"]) == SLOW_RANK for row in rows[1:]), rows
    # Named from the second flush with the first timed values (patience 2), at every flush then.
    named = [i for i, rank, n in lines if n == name and rank == SLOW_RANK]
    assert len(named) >= len(rows) - 3 and all(rank == SLOW_RANK for _, rank, _ in lines), lines
    print(f"{world} ranks, slow {slow}, SyncBatchNorm {sync_bn}: named at {len(named)}/{len(rows)} flushes")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_a_job_without_a_straggler_prints_no_line(tmp_path, capfd, world):
    misspelt = TrainingStats(every_n_train_steps=EVERY, regex="Timing/.*", stragglers="Timing/compute_secs")
    rows, lines, err = run_job(tmp_path, capfd, world, None, True, misspelt)
    assert len(rows) >= 12 and lines == []
    # A straggler pattern that matched no reported name: said once, on rank zero.
    assert err.count("TrainingStats: `stragglers`='Timing/compute_secs' matched none of the names") == 1
