"""The straggler in real DDP Trainer runs on 2 and 3 ranks: a rank sleeping in ``training_step`` or in
its data loader is named, with SyncBatchNorm (the fast ranks wait inside the forward's all-reduce) and
with plain DDP, and a job without a straggler prints no line.

Three fits (Lightning's ``"ddp"`` on the harness's workers, ``tests/helpers/lightning_ddp.py``) hold
every case, each in phases of ``PHASE`` steps that start at a flush: with SyncBatchNorm, 2 ranks run
quiet, then rank 1 slow in its step, then slow in its data loader; 3 ranks quiet, then slow in its
step; plain DDP on 2 ranks is slow in its step throughout. A quiet phase comes first (a slow phase's
count of flushes in a row would otherwise end in it); each test reads the flushes of its phase.
"""

from __future__ import annotations

import csv
import re
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_ext.callbacks import IterationTimer, TrainingStats
from lightning_ext.plugins import SyncBatchNormPlugin
from lightning_ext.stats import Straggler
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import ddp_trainer, rank_zero_output

SLOW_RANK = 1
EXTRA_SEC = 0.04  # the slow rank's extra time per step, in training_step or in its data loader
EVERY, WARMUP, BATCH = 5, 3, 16
PHASE = 6 * EVERY  # steps of a phase: 6 flushes
JOBS = {  # (world, SyncBatchNorm) -> its phases, in order
    (2, True): (None, "step", "data"),
    (3, True): (None, "step"),
    (2, False): ("step",),
}
LINE = re.compile(r"Straggler at iteration=(\d+): rank (\d+) \(host [^)]*\), (\S+) ")
MISSPELT = "TrainingStats: `stragglers`='Timing/compute_secs' matched none of the names"


def _slow(phases: tuple[str | None, ...], step: int) -> str | None:
    """What the slow rank sleeps in at ``step`` (0-based)."""
    return phases[min(step // PHASE, len(phases) - 1)]


class _Data(Dataset):
    """Random features for one epoch of the job's steps on ``world`` ranks; the slow rank's loader
    sleeps ``EXTRA_SEC`` per batch of the ``"data"`` phase (its batch counted by the items it fetched:
    Lightning's sampler shuffles). Lightning fetches a batch one step ahead: the sleep lands in the
    data time of the step before it, so a data phase starts one step early."""

    def __init__(self, phases: tuple[str | None, ...], world: int) -> None:
        self.x, self.phases, self.fetched = torch.randn(world * len(phases) * PHASE * BATCH, 32), phases, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        step, self.fetched = self.fetched // BATCH, self.fetched + 1
        if torch.distributed.get_rank() == SLOW_RANK and _slow(self.phases, step) == "data":
            time.sleep(EXTRA_SEC / BATCH)
        return self.x[index]


class _Model(pl.LightningModule):
    def __init__(self, phases: tuple[str | None, ...]) -> None:
        super().__init__()
        self.phases = phases
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
        )

    def training_step(self, batch, batch_idx):
        if self.global_rank == SLOW_RANK and _slow(self.phases, self.global_step) == "step":
            time.sleep(EXTRA_SEC)  # before the forward: with SyncBatchNorm the others wait inside it
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_Data(self.phases, self.trainer.world_size), batch_size=BATCH)


def _job(rank: int, world: int, sync_bn: bool, log_dir: str) -> tuple[list[str], list[str]]:
    """Train the phases of ``JOBS[world, sync_bn]``, logging to a CSV file in ``log_dir``; what this
    rank logged and warned (nothing but on rank zero)."""
    phases = JOBS[world, sync_bn]
    misspelt = TrainingStats(every_n_train_steps=EVERY, regex="Timing/.*", stragglers="Timing/compute_secs")
    trainer = ddp_trainer(
        rank, world,
        plugins=[SyncBatchNormPlugin()] if sync_bn else None,
        max_steps=len(phases) * PHASE,
        callbacks=[IterationTimer(warmup_iter=WARMUP), TrainingStats(every_n_train_steps=EVERY), misspelt],
        logger=CSVLogger(log_dir, name="csv", version=0),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    with rank_zero_output() as (logged, warned):
        trainer.fit(_Model(phases))
    return logged, warned


@pytest.fixture(scope="module")
def phase(tmp_path_factory):
    """``phase(world, sync_bn, slow)``: the CSV rows of the flushes in ``slow``'s phase of the job of
    ``(world, sync_bn)``, the straggler lines ``(iteration, rank, name)`` of that phase and of the
    whole job, and the job's warnings; each job runs once, for every test that reads it."""
    jobs = {}

    def read(world: int, sync_bn: bool, slow: str | None):
        if (world, sync_bn) not in jobs:
            log_dir = tmp_path_factory.mktemp(f"job{world}{sync_bn}")
            results = run_distributed(_job, world, sync_bn, str(log_dir), timeout=200)
            # Said on rank zero only
            assert all(
                logged == [] and not any(MISSPELT in w for w in warned) for logged, warned in results[1:]
            )
            logged, warned = results[0]
            with open(log_dir / "csv" / "version_0" / "metrics.csv") as f:
                rows = [row for row in csv.DictReader(f) if row.get("Timing/data_sec/straggler_rank")]
            lines = [(int(i), int(r), name) for text in logged for i, r, name in LINE.findall(text)]
            jobs[world, sync_bn] = rows, lines, warned
        rows, lines, warned = jobs[world, sync_bn]
        # A flush after every EVERY-th step, at the step of its last one
        steps = len(JOBS[world, sync_bn]) * PHASE
        assert [int(row["step"]) for row in rows] == list(range(EVERY - 1, steps, EVERY))
        start = JOBS[world, sync_bn].index(slow) * PHASE
        within = range(start, start + PHASE)
        return (
            [r for r in rows if int(r["step"]) in within],
            [x for x in lines if x[0] in within],
            lines,
            warned,
        )

    return read


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "slow", "sync_bn"),
    [(2, "step", True), (3, "step", True), (2, "data", True), (2, "step", False)],
)
def test_a_slow_rank_is_named_at_every_flush_after_the_first_two(phase, world, slow, sync_bn):
    rows, lines, every_line, _ = phase(world, sync_bn, slow)
    name = {"step": "Timing/compute_sec", "data": "Timing/data_sec"}[slow]
    assert len(rows) == PHASE // EVERY
    assert all(float(row[name + "/straggler_rank"]) == SLOW_RANK for row in rows[1:]), rows
    # Named from the second flush of the phase (patience 2), at every flush then; a flush that misses
    # the excess costs two lines (its own and the next one's).
    named = [i for i, rank, n in lines if n == name and rank == SLOW_RANK]
    assert len(named) >= len(rows) - 3, lines
    assert all(rank == SLOW_RANK for _, rank, _ in every_line), every_line
    print(f"{world} ranks, slow {slow}, SyncBatchNorm {sync_bn}: named at {len(named)}/{len(rows)} flushes")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_a_job_without_a_straggler_prints_no_line(phase, world):
    rows, lines, _, warned = phase(world, True, None)
    assert len(rows) == PHASE // EVERY and lines == []
    # A straggler pattern that matched no reported name: said once, on rank zero.
    assert sum(MISSPELT in w for w in warned) == 1, warned


class _Reduced:
    """What ``TrainingStats`` reads of a flush's collector for the straggler: ``Timing/compute_sec``'s
    ``straggler`` (``None``: the name had no values in the interval)."""

    def __init__(self, straggler: Straggler | None) -> None:
        self.straggler_ = straggler

    def names(self) -> list[str]:
        return ["Timing/compute_sec"] if self.straggler_ else []

    def updated(self) -> list[str]:
        return self.names()

    def straggler(self, name: str) -> Straggler | None:
        return self.straggler_


def test_a_flush_without_the_names_values_ends_its_run(caplog: pytest.LogCaptureFixture) -> None:
    # The count of flushes in a row went on over a flush without values (and over the fits of a reused
    # callback): the line came one flush early.
    stats, slow = TrainingStats(straggler_patience=2), Straggler(rank=1, mean=0.05, median=0.03, ratio=5 / 3)
    stats._hosts = ["a", "b"]
    with caplog.at_level("INFO"):
        for step, straggler in enumerate([slow, None, slow, slow]):
            stats._stragglers(_Reduced(straggler), step)
    assert [m for m in caplog.messages if m.startswith("Straggler")] == [
        "Straggler at iteration=3: rank 1 (host b), Timing/compute_sec 0.05 = 1.67x the median rank (0.03), "
        "2 flushes"
    ]
