"""The slowest rank and the step-time percentiles in a real 3-process ``ddp_spawn`` Trainer run."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext.callbacks import IterationTimer, TrainingStats

SLOW_RANK = 1
EXTRA_SEC = 0.05  # the slow rank's extra time in every training_step
EVERY = 4
WARMUP = 2


class SleepyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if self.global_rank == SLOW_RANK:
            time.sleep(EXTRA_SEC)
        (x,) = batch
        return self.lin(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(96, 4)), batch_size=4)


@pytest.mark.timeout(300)
def test_the_logs_name_the_slow_rank_in_the_first_interval_after_warm_up(tmp_path: Path, capfd) -> None:
    stats = TrainingStats(
        every_n_train_steps=EVERY, stats=("mean", "p50", "p99", "max"), quantiles="Timing/.*", on_epoch=False
    )
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=3,
        strategy="ddp_spawn",
        max_steps=2 * EVERY,
        callbacks=[IterationTimer(warmup_iter=WARMUP), stats],
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(SleepyModule())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("Timing/forward_sec/slowest_rank")]
    # The first flush (after EVERY iterations, WARMUP of them untimed) already names the slow rank.
    assert [int(row["step"]) for row in rows] == [EVERY - 1, 2 * EVERY - 1]
    for row in rows:
        assert float(row["Timing/forward_sec/slowest_rank"]) == SLOW_RANK
        assert float(row["Timing/forward_sec/slowest_ratio"]) > 2.0
        p50, p99, top = (float(row[f"Timing/step_sec/{s}"]) for s in ("p50", "p99", "max"))
        assert 0 < p50 <= p99 <= top  # percentiles over every rank and step
    lines = re.findall(
        r"Slowest rank at iteration=\d+: rank \d+ \(host [^)]*\), Timing/forward_sec .*",
        capfd.readouterr().err,
    )
    assert lines and all(f": rank {SLOW_RANK} (host" in line for line in lines), lines
    print(lines[0])
