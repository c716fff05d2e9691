"""Throughput: global samples/s and tokens/s equal a hand count on 2 and 3 DDP ranks with
variable batches and sequence lengths per rank (gradient accumulation, validation and checkpoint saves
inside the intervals), MFU equals FlopCounterMode's FLOPs over a given peak, the slowest rank by
throughput in the straggler line, Lightning's ThroughputMonitor side by side, HFU with recomputation,
skipped steps as lost time, goodput across a SIGKILL and a resume, the ranks' agreement broken."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import Precision, TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from lightning_ext._compat import at_least
from lightning_ext.callbacks import IterationTimer, Throughput, TrainingStats
from lightning_ext.perf import LOST_TIME_CAUSES, count_flops, peaks
from lightning_ext.stats import report
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import broadcast_sigterm_flag, ddp_trainer, rank_zero_output
from tests.perf.test_flops import _Orthogonalizing

LENGTH, WIDTH = 6, 8  # tokens per sequence (padded), features per token
EVERY, ACCUMULATE, STEPS = 3, 2, 12  # flush period (iterations), micro-batches per iteration: 4 flushes
PEAK = 1.0e9  # FLOP/s given for every device
LINE = re.compile(
    r"Straggler at iteration=(\d+): rank (\d+) \(host [^)]*\), Timing/compute_sec .*; slowest by throughput: "
    r"rank (\d+) \("
)
SLEEP = 0.15  # seconds each validation run and each checkpoint write sleeps
# ThroughputMonitor takes variable batch sizes from Lightning 2.6.0 (#20236); before, it raises
# "Expected the value to increase" once a batch is smaller than the first (#20235)
MONITOR_TAKES_VARIABLE_BATCHES = at_least(lightning.__version__, "2.6")


def _batch_sizes(rank: int, fixed: bool) -> list[int]:
    """Rank ``rank``'s micro-batch sizes: 4 everywhere (``fixed``), else varying by rank and batch."""
    return (
        [4] * (ACCUMULATE * STEPS)
        if fixed
        else [1 + rank + (3 * i + rank) % 4 for i in range(ACCUMULATE * STEPS)]
    )


def _batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    """``size`` sequences of ``LENGTH`` tokens, each with 1..LENGTH real tokens (the rest padding)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (size,), generator=generator)
    mask = torch.arange(LENGTH) < lengths[:, None]
    return {"x": torch.randn(size, LENGTH, WIDTH, generator=generator), "mask": mask}


class _Model(pl.LightningModule):
    """Per-token MLP, loss over the real tokens; validation sleeps ``SLEEP``; records training_step's time."""

    def __init__(self, fixed: bool = False, slow_rank: int | None = None) -> None:
        super().__init__()
        self.fixed, self.slow_rank, self.step_sec = fixed, slow_rank, 0.0
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def loss(self, batch):
        out = self.net(batch["x"]).squeeze(-1)
        return (out.square() * batch["mask"]).sum() / batch["mask"].sum()

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(0.1)  # a rank slow in its compute: the straggler line, also on a loaded host
        start = time.perf_counter()
        loss = self.loss(batch)
        self.step_sec += time.perf_counter() - start
        return loss

    def validation_step(self, batch, batch_idx):
        time.sleep(SLEEP)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        rank = self.trainer.global_rank
        sizes = _batch_sizes(rank, self.fixed)
        return DataLoader([_batch(size, 100 * rank + i) for i, size in enumerate(sizes)], batch_size=None)

    def val_dataloader(self):
        return DataLoader([_batch(2, 0)], batch_size=None)


class _SlowWrites(TorchCheckpointIO):
    """Writes as torch does, after sleeping ``SLEEP`` (rank zero writes, the others wait for it)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(SLEEP)
        super().save_checkpoint(checkpoint, path, storage_options)


class _Clock(Callback):
    """First in ``callbacks``: when each micro-batch's ``on_train_batch_end`` calls begin."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())


class _Record(Callback):
    """Per flush, on each rank: what the flush wrote, the reduced per-rank times, this rank's hand count
    of the interval, its wall time between flush ends and its training_step seconds; saved per rank."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.rows, self.last_flush = out_dir, [], -1
        self.samples = self.tokens = 0
        self.batch_ends: list[float] = []  # seconds of each on_train_batch_end, all callbacks

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.samples += len(batch["x"])
        self.tokens += int(batch["mask"].sum())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = next(c for c in trainer.callbacks if isinstance(c, TrainingStats))
        now = time.perf_counter()
        self.batch_ends.append(now - next(c for c in trainer.callbacks if isinstance(c, _Clock)).ends[-1])
        if stats.last_flush_step == self.last_flush:
            return
        self.last_flush = stats.last_flush_step
        c = stats.collector
        throughput = next(c for c in trainer.callbacks if isinstance(c, Throughput))
        self.rows.append({
            "written": dict(throughput.last_metrics),
            "train_sec": (c.max("Throughput/train_sec"), c.min("Throughput/train_sec")),
            "flush_sec": c.max("Timing/stats_flush_sec") if "Timing/stats_flush_sec" in c.names() else 0.0,
            "samples": self.samples, "tokens": self.tokens, "wall": now - self.start,
            "step_sec": pl_module.step_sec, "batch_ends": self.batch_ends,
            "slowest": float(trainer.callback_metrics["Throughput/sec_per_sample/straggler_rank"]),
        })  # fmt: skip
        self.samples = self.tokens = 0
        self.start, pl_module.step_sec, self.batch_ends = now, 0.0, []

    def on_train_end(self, trainer, pl_module):
        torch.save(self.rows, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


class _Metrics(Logger):
    """Keeps what rank zero logs (ThroughputMonitor logs through the loggers) and saves it at the end."""

    @property
    def name(self):
        return "metrics"

    @property
    def version(self):
        return 0

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.rows = path, []

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    @rank_zero_only
    def finalize(self, status):
        torch.save(self.rows, self.path)


def _tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["mask"].sum()  # the real tokens, a tensor (summed on its device)


def _samples(batch: dict[str, torch.Tensor]) -> int:
    return len(batch["x"])


def _fit_job(
    rank: int, world: int, out_dir: str, fixed: bool, monitor: bool, slow_rank: int | None
) -> list[str]:
    """One rank of :func:`_fit` (Lightning's ``"ddp"`` on the harness's workers); what it logged."""
    first = [ThroughputMonitor(batch_size_fn=_samples, window_size=EVERY * ACCUMULATE + 1)] if monitor else []
    first += [IterationTimer()] if slow_rank else []
    throughput = Throughput(tokens_fn=_tokens, peak_flops_per_sec=PEAK)
    stats = TrainingStats(every_n_train_steps=EVERY, on_epoch=False)
    trainer = ddp_trainer(
        rank, world, max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE, use_distributed_sampler=False, val_check_interval=16,
        limit_val_batches=1, num_sanity_val_steps=0, plugins=[_SlowWrites()],
        callbacks=[_Clock(), *first, throughput, stats, _Record(out_dir),
                   ModelCheckpoint(Path(out_dir) / "ckpt", every_n_train_steps=7)],
        logger=_Metrics(str(Path(out_dir) / "logged.pt")), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with rank_zero_output() as (logged, _):
        trainer.fit(_Model(fixed, slow_rank))
    return logged


def _fit(tmp_path: Path, world: int, fixed: bool, monitor: bool = False, slow_rank: int | None = None):
    """Train on ``world`` DDP ranks; each rank's rows of ``_Record``, rank zero's logged rows and the
    straggler lines it printed. With ``slow_rank``, IterationTimer times the steps, so that
    TrainingStats names that rank."""
    logged = run_distributed(_fit_job, world, str(tmp_path), fixed, monitor, slow_rank, timeout=200)
    assert all(lines == [] for lines in logged[1:])  # rank zero's lines only
    rows = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    return rows, torch.load(tmp_path / "logged.pt"), LINE.findall("\n".join(logged[0]))


def _flops_per_sample() -> float:
    """Model FLOPs of one sample's forward and backward, by FlopCounterMode itself."""
    model, batch = _Model(), _batch(5, 0)
    with FlopCounterMode(display=False) as counter:
        model.loss(batch).backward()
    return counter.get_total_flops() / 5


def _check_flushes(rows: list[list[dict]], world: int) -> None:
    """Every flush: the global rates against the hand count and the agreed time, MFU against
    FlopCounterMode's FLOPs over PEAK, the time bounds, the same values on every rank."""
    flops_per_sample = _flops_per_sample()
    assert len(rows[0]) == STEPS // EVERY
    for k, flush in enumerate(zip(*rows)):
        written = flush[0]["written"]
        assert all(r["written"] == written and r["train_sec"] == flush[0]["train_sec"] for r in flush)
        seconds, shortest = flush[0]["train_sec"]
        samples, tokens = sum(r["samples"] for r in flush), sum(r["tokens"] for r in flush)
        assert written["Throughput/samples_per_sec"] * seconds == pytest.approx(samples, rel=1e-12)
        assert written["Throughput/tokens_per_sec"] * seconds == pytest.approx(tokens, rel=1e-12)
        assert written["Throughput/samples_per_sec_per_device"] * world * seconds == pytest.approx(samples)
        assert written["Throughput/mfu"] == pytest.approx(
            flops_per_sample * samples / seconds / (world * PEAK)
        )
        # A rank's training time holds its training steps and leaves out the flush (the wall time
        # between flush ends holds one) and what slept in validation and checkpoint writes; the
        # slowest rank's is the agreed time. (Each rank's own time is within its own wall time; the
        # ranks leave a flush's collective at slightly different times, so the agreed time is bounded
        # by the longest wall time, not by every rank's.)
        excluded = 2 * SLEEP * (k == 2)  # validation after micro-batch 15, a save after iteration 6
        assert all(r["step_sec"] < seconds for r in flush), (k, flush, seconds)
        assert seconds <= max(r["wall"] for r in flush) - excluded, (k, flush, seconds)
        # The ranks' spread: each rank's samples over its training seconds, which lie in [shortest,
        # seconds]; the slowest rank by throughput is the one with the fewest samples when that bound
        # sets it apart from the second fewest.
        counts = sorted((r["samples"], rank) for rank, r in enumerate(flush))
        assert written["Throughput/rank_samples_per_sec/min"] >= counts[0][0] / seconds * (1 - 1e-6)
        assert written["Throughput/rank_samples_per_sec/max"] <= counts[-1][0] / shortest * (1 + 1e-6)
        if counts[0][0] / shortest < counts[1][0] / seconds:
            assert flush[0]["slowest"] == counts[0][1], (k, counts, flush[0]["slowest"])


def _check_monitor(rows: list[list[dict]], logged: list, fixed: bool) -> None:
    """Lightning's ThroughputMonitor: rank zero's samples times the world size, over its window of
    ``EVERY * ACCUMULATE`` micro-batches, which are those of the flush's intervals 2 and 4 (neither
    holds a validation run or a checkpoint write). Its window runs from its reading in one
    ``on_train_batch_end`` to its reading in another; the flush's interval on rank zero from the end of
    the flush in the first to the start of the next flush in the second: both readings lie within the
    callbacks' ``on_train_batch_end`` of their batch (``batch_ends``), and the agreed time is the
    slowest rank's, up to the ranks' spread above rank zero's. Those bound the difference of the times."""
    theirs = {round(m["train/samples"]): m for _, m in logged if "train/samples_per_sec" in m}
    world, ours = len(rows), rows[0]
    for k in (1, 3):
        rank0 = sum(_batch_sizes(0, fixed)[: (k + 1) * EVERY * ACCUMULATE])
        monitor = theirs[rank0]
        assert monitor["train/samples_per_sec"] == pytest.approx(
            world * monitor["train/device/samples_per_sec"]
        )
        window = sum(_batch_sizes(0, fixed)[k * EVERY * ACCUMULATE : (k + 1) * EVERY * ACCUMULATE])
        their_sec = window / monitor["train/device/samples_per_sec"]
        seconds, shortest = ours[k]["train_sec"]
        total = sum(r[k]["samples"] for r in rows)
        # theirs is off by rank zero's share of the samples times the world size: 1 with fixed batches
        factor = world * window / total
        assert (factor == 1.0) == fixed and ours[k]["samples"] == window
        low = their_sec - ours[k - 1]["batch_ends"][-1]  # rank zero's interval, at least
        high = their_sec + ours[k]["batch_ends"][-1] + (seconds - shortest)
        assert low <= seconds <= high, (k, low, seconds, high)
        mine = ours[k]["written"]["Throughput/samples_per_sec"]
        assert monitor["train/samples_per_sec"] / factor == pytest.approx(mine, rel=(high - low) / seconds)
        print(
            f"flush {k}: ours {mine:.1f} samples/s, ThroughputMonitor {monitor['train/samples_per_sec']:.1f} "
            f"(factor {factor:.3f}), times {seconds:.4f} vs {their_sec:.4f} s"
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_global_rates_equal_a_hand_count_with_variable_batches(tmp_path: Path, world: int) -> None:
    monitor = world == 2 and MONITOR_TAKES_VARIABLE_BATCHES
    slow_rank = 1 if world == 2 else None
    rows, logged, lines = _fit(tmp_path, world, fixed=False, monitor=monitor, slow_rank=slow_rank)
    _check_flushes(rows, world)
    if world == 3:
        return
    if monitor:
        _check_monitor(rows, logged, fixed=False)
    # Rank 1 sleeps in its steps: the straggler line names it by Timing/compute_sec, and ends with the
    # slowest rank by throughput (rank 0: the fewer samples in the same time), as written at that flush.
    slowest = {round(step): row["Throughput/sec_per_sample/straggler_rank"] for step, row in logged
               if "Throughput/sec_per_sample/straggler_rank" in row}  # fmt: skip
    assert lines and all(rank == "1" and int(by) == slowest[int(step)] for step, rank, by in lines), lines
    print(lines)


@pytest.mark.smoke
@pytest.mark.timeout(300)
def test_fixed_batches_agree_with_lightning_throughput_monitor(tmp_path: Path) -> None:
    rows, logged, _ = _fit(tmp_path, 2, fixed=True, monitor=True)
    _check_flushes(rows, 2)
    _check_monitor(rows, logged, fixed=True)


class _Disagreeing(Callback):
    """First in ``callbacks``: rank 1's Throughput counts tokens, rank 0's does not."""

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 1:
            next(c for c in trainer.callbacks if isinstance(c, Throughput)).tokens_fn = _tokens


def _disagreeing_fit(rank: int, world: int) -> str:
    """A fit in which rank 1's Throughput counts tokens (Lightning's ``"ddp"`` on the harness's
    workers); the error it raised on this rank."""
    trainer = ddp_trainer(
        rank, world, max_steps=2, logger=False,
        callbacks=[_Disagreeing(), Throughput(), TrainingStats(every_n_train_steps=1)],
        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(_Model())
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(240)
def test_ranks_with_another_throughput_raise_at_setup_naming_them() -> None:
    """A rank that counts tokens beside one that does not would sum its tokens alone: TrainingStats'
    setup raises on every rank first, naming the ranks and their Throughput."""
    for message in run_distributed(_disagreeing_fit, 2, timeout=200):
        assert re.match(
            r"TrainingStats: the ranks' arguments differ: contributors=\(\"Throughput\(samples_fn=None, "
            r"tokens_fn=None, .*\) on ranks \[0\], \(\"Throughput\(samples_fn=None, tokens_fn=_tokens, "
            r".* on ranks \[1\]",
            message,
        ), message


def test_bad_arguments_raise() -> None:
    with pytest.raises(
        TypeError, match=r"^Throughput: `samples_fn` must be None or a callable \(batch -> count\), got 3$"
    ):
        Throughput(samples_fn=3)
    with pytest.raises(
        TypeError, match=r"^Throughput: `tokens_fn` must be None or a callable .*, got 'count'$"
    ):
        Throughput(tokens_fn="count")
    with pytest.raises(
        TypeError, match=r"^Throughput: `flops_fn` must be 'count', None or a callable .*, got 'counted'"
    ):
        Throughput(flops_fn="counted")
    with pytest.raises(ValueError, match=r"^Throughput: `peak_flops_per_sec` must be .*> 0.*, got 0\.0"):
        Throughput(peak_flops_per_sec=0.0)
    with pytest.raises(TypeError, match=r"`peak_flops_per_sec` must be a finite number.*got 'fast'"):
        Throughput(peak_flops_per_sec="fast")


# ---------------------------------------------------------------------------------- goodput

KILL_AT, SAVE_EVERY, GOODPUT_STEPS = 6, 4, 12


class _KillAt(Callback):
    """SIGKILLs this process after iteration ``KILL_AT`` (the checkpoint of ``SAVE_EVERY`` written)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class _Dump(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        throughput = next(c for c in trainer.callbacks if isinstance(c, Throughput))
        summary = throughput.ledger.summary()
        Path(self.path).write_text(
            json.dumps({**summary, "first_launch": throughput.ledger.first_launch, "now": time.time()})
        )


def goodput_job(root: str, resume: str | None) -> None:
    """One process of the job: 12 iterations (a validation run and a slow checkpoint write every
    4), killed after iteration 6 unless ``resume`` (a checkpoint to resume from)."""
    throughput = Throughput(tokens_fn=_tokens)  # the first launch: now
    last = _KillAt() if resume is None else _Dump(f"{root}/summary.json")
    checkpoint = ModelCheckpoint(f"{root}/ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=GOODPUT_STEPS, plugins=[_SlowWrites()],
        val_check_interval=SAVE_EVERY * ACCUMULATE, accumulate_grad_batches=ACCUMULATE, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=2), last, checkpoint],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True), ckpt_path=resume)


def _launch(root: Path, resume: str | None) -> subprocess.CompletedProcess:
    code = f"from tests.callbacks.test_throughput import goodput_job; goodput_job({str(root)!r}, {resume!r})"
    repository = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repository}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], cwd=repository, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip


@pytest.mark.slow  # two jobs in new processes
@pytest.mark.timeout(600)
def test_goodput_adds_up_across_a_sigkill_and_a_resume(tmp_path: Path) -> None:
    launched = time.time()
    first = _launch(tmp_path, None)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    killed = time.time()
    time.sleep(1.0)  # the queue
    checkpoint = tmp_path / "ckpt" / f"epoch=0-step={SAVE_EVERY}.ckpt"
    relaunched = time.time()
    second = _launch(tmp_path, str(checkpoint))
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    parts = ["productive", *LOST_TIME_CAUSES, "other"]
    # The parts add up to the wall time since the first launch, which the first process made.
    assert sum(summary[p] for p in parts) == pytest.approx(summary["wall"], rel=1e-12)
    assert launched < summary["first_launch"] < killed
    assert summary["wall"] == pytest.approx(summary["now"] - summary["first_launch"], abs=1e-2)
    assert summary["restarts"] == 1 and min(summary[p] for p in parts) >= 0.0
    # The restart holds the work after the checkpoint, the kill and the queue, up to the load.
    assert relaunched - killed < summary["restart"] < summary["now"] - launched
    # Validation runs after iterations 8 and 12 (the one after 4 follows the save at 4: in the
    # restart); slow writes at 8 and 12 (the one at 4 follows the taking of its own state).
    assert summary["validation"] >= 2 * SLEEP and summary["checkpointing"] >= 2 * SLEEP
    assert summary["productive"] > 0.0 and 0.0 < summary["goodput"] < 1.0
    assert summary["startup"] > 0.0  # of both launches: after the first one, after the load
    print({key: round(value, 3) for key, value in summary.items()})


class _Checkpointed(pl.LightningModule):
    """Two blocks under activation checkpointing, in fp16 autocast with a loss scale that overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)
        )

    def loss(self, batch):
        h = batch["x"]
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return h.float().square().mean()

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader([_batch(4, i) for i in range(8)], batch_size=None)


def test_the_start_up_is_its_own_part_and_the_sanity_check_validation() -> None:
    throughput = Throughput(flops_fn=None)  # the first launch
    time.sleep(1.0)  # what the script prepares after it
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, num_sanity_val_steps=1, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True))
    summary = throughput.ledger.summary()
    parts = ["productive", *LOST_TIME_CAUSES, "other"]
    assert sum(summary[p] for p in parts) == pytest.approx(summary["wall"], rel=1e-12)
    # The second slept and Lightning's setup are the start-up, not "other" (the epoch ends, the
    # flushes); the sanity check's sleep is validation.
    assert summary["startup"] >= 1.0 > summary["other"] >= 0.0 and summary["validation"] >= SLEEP
    written = trainer.callback_metrics["Goodput/startup_sec"].item()  # (float32)
    assert written == pytest.approx(summary["startup"], rel=1e-6)


def test_hfu_counts_recomputation_and_skipped_steps_are_lost_time() -> None:
    from lightning_ext.amp import DynamicLossScaler
    from lightning_ext.perf import count_flops
    from lightning_ext.plugins import LossScalingPrecision

    model, throughput = _Checkpointed(), Throughput(peak_flops_per_sec=PEAK)
    count = count_flops(model.loss, _batch(4, 0))
    model.zero_grad()
    scaler = DynamicLossScaler("cpu", 2.0**40, growth_interval=1000)  # fp16 overflows until 2**15 or so
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[LossScalingPrecision("16-mixed", scaler=scaler)],
        callbacks=[throughput, TrainingStats(every_n_train_steps=8, regex="(Throughput|Goodput|AMP)/.*")],
    )  # fmt: skip
    trainer.fit(model)
    written = throughput.last_metrics
    # HFU / MFU is the recomputation's share that FlopCounter counted: one forward of each block again.
    assert count.recomputed == count.forward > 0
    assert written["Throughput/hfu"] / written["Throughput/mfu"] == pytest.approx(
        count.hardware / count.model
    )
    # The scale backs off from 2**40 in steps the scaler skipped: their time is lost, not productive.
    summary = throughput.ledger.summary()
    assert scaler.skipped_steps > 0 and summary["skipped_steps"] > 0.0
    assert trainer.callback_metrics["Goodput/skipped_steps_sec"] == pytest.approx(summary["skipped_steps"])


class _SkipsTheFirstBatch(_Checkpointed):
    """``training_step`` returns ``None`` for the first batch: Lightning skips its backward."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 0 else self.loss(batch)


def test_a_first_batch_skipped_by_training_step_is_not_the_one_counted_and_counts_its_forward() -> None:
    # Counted, the skipped batch ran a forward only: every flush published about a third of the FLOPs.
    # Its samples were then billed a forward and a backward (FLOPs and MFU 9.5 % high in a job that
    # skipped one batch in five): they count their forward only.
    from lightning_ext.perf import count_flops

    model, throughput = _SkipsTheFirstBatch(), Throughput(peak_flops_per_sec=PEAK)
    count = count_flops(model.loss, _batch(4, 0))
    model.zero_grad()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[throughput, TrainingStats(every_n_train_steps=4)],
    )  # fmt: skip
    trainer.fit(model)
    metrics = throughput.last_metrics
    written = metrics["Throughput/flops_per_sec"] / metrics["Throughput/samples_per_sec"]
    per_sample = (12 * count.model / 4 + 4 * count.forward / 4) / 16  # batches 0-3; 0 ran no backward
    assert count.backward > 0 and written == pytest.approx(per_sample, rel=1e-12)  # 4 samples a batch


class _ComputesInBfloat16(Precision):
    """Says ``"32-true"`` but computes in bfloat16 (as Lightning's ``BitsandbytesPrecision``)."""

    dtype = torch.bfloat16


def test_a_precision_plugin_computing_in_a_dtype_of_its_own_gets_that_dtypes_peak() -> None:
    from lightning_ext.perf import measure_peak_flops

    throughput = Throughput()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[_ComputesInBfloat16()],
        callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True))
    assert trainer.precision == "32-true"
    metrics, bf16 = throughput.last_metrics, measure_peak_flops(torch.bfloat16)  # (measured once)
    assert metrics["Throughput/flops_per_sec"] / metrics["Throughput/mfu"] == pytest.approx(bf16, rel=1e-6)
    assert bf16 != measure_peak_flops(torch.float32)


def test_without_a_peak_no_mfu_and_without_a_flush_nothing_is_written() -> None:
    throughput = Throughput(peak_dtype="fp8")  # no fp8 matmul to measure on a CPU
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"Throughput: no peak for MFU \(measure_peak_flops: no 'fp8' matmul"
    ):
        trainer.fit(_Model(fixed=True))
    assert (
        "Throughput/flops_per_sec" in throughput.last_metrics
        and "Throughput/mfu" not in throughput.last_metrics
    )
    lonely = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Throughput(flops_fn=None)],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="Throughput: no TrainingStats flush ran, so nothing was written"):
        lonely.fit(_Model(fixed=True))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_model_keeps_running_compiled_and_its_flops_are_not_counted(fullgraph: bool) -> None:
    # A step under FlopCounterMode made dynamo run the compiled code eagerly for the rest of the
    # process (the rates then those of an eager model), and raise with fullgraph=True.
    calls = []

    def backend(graph, inputs):  # runs the traced graph, counting its calls
        return lambda *args: calls.append(1) or graph.forward(*args)

    model = _Model(fixed=True)
    model.net = torch.compile(model.net, backend=backend, fullgraph=fullgraph)
    throughput = Throughput(peak_flops_per_sec=PEAK)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="Throughput: flops_fn='count' counts a micro-batch under Flop"):
        trainer.fit(model)
    assert len(calls) == 4  # every step ran the compiled code
    assert "Throughput/samples_per_sec" in throughput.last_metrics
    assert "Throughput/mfu" not in throughput.last_metrics


def test_the_time_after_a_validate_outside_a_fit_is_not_data_wait_nor_validation() -> None:
    throughput = Throughput(flops_fn=None)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    model = _Model(fixed=True)
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    time.sleep(SLEEP)  # (a notebook's pause before the next fit)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model)
    summary = throughput.ledger.summary()
    assert summary["data_wait"] < SLEEP and summary["validation"] < 3 * SLEEP + SLEEP / 2, summary
    assert summary["other"] >= SLEEP, summary


class _EveryFlush(Callback):
    """The keys of every flush of the ``TrainingStats`` ``stats`` (its own ``flush``, wrapped)."""

    def __init__(self, stats: TrainingStats) -> None:
        self.rows: list[dict[str, float]] = []
        flush = stats.flush
        stats.flush = lambda *args, **kwargs: self.rows.append(flush(*args, **kwargs)) or self.rows[-1]


def test_one_training_stats_takes_its_names_and_another_one_cuts_no_interval() -> None:
    # A loss written every iteration beside the rest every 4: the loss's flushes neither report
    # Throughput's interval nor start a new one, so the every-4 flush derives its rates from 4 whole
    # iterations (with both calling it, samples_per_sec was the sum of 4 one-iteration pieces over the
    # longest one: near 4 times the rate).
    throughput = Throughput(flops_fn=None)
    losses, rest = TrainingStats(every_n_train_steps=1, regex="Loss/.*"), TrainingStats(every_n_train_steps=4)
    recorded = _EveryFlush(rest)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[throughput, losses, rest],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True))
    periodic = [row for row in recorded.rows if "Throughput/samples_per_sec" in row][:2]  # (epoch ends aside)
    assert len(periodic) == 2
    for row in periodic:  # 4 iterations of 4 samples each, in the interval's seconds (one rank)
        assert row["Throughput/samples"] == 16.0
        rate = row["Throughput/samples_per_sec"]
        assert rate * row["Throughput/train_sec"] == pytest.approx(16.0, rel=1e-12)
        assert row["Throughput/samples_per_sec_per_device"] == rate
    # Two TrainingStats collecting its names: setup raises, naming them and the fix.
    both = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Throughput(flops_fn=None), TrainingStats(every_n_train_steps=1),
                   TrainingStats(every_n_train_steps=4)],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"2 TrainingStats collect names that Throughput reports .*"
                       r"regex=\['\.\*', '\.\*'\].*regex='\(\?!Goodput/\|Throughput/\)\.\*'"):  # fmt: skip
        both.fit(_Model(fixed=True))
    # After the TrainingStats that collects its names: a flush at a batch's end ran before Throughput
    # counted that batch, and every interval's samples came one batch late (setup raises now).
    late = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainingStats(every_n_train_steps=1), Throughput(flops_fn=None)],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Throughput comes after the TrainingStats .* HINT: put Throughput"):
        late.fit(_Model(fixed=True))


def test_validating_a_checkpoint_after_the_fit_is_no_restart(tmp_path: Path) -> None:
    # Lightning loads the callbacks' states for validate/test(ckpt_path=...) too: the ledger is the
    # job's, so such a load leaves it (it rewound it to the checkpoint and booked a restart).
    throughput = Throughput(flops_fn=None)
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[throughput, TrainingStats(every_n_train_steps=2), saves],
    )  # fmt: skip
    model = _Model(fixed=True)
    trainer.fit(model)
    booked = throughput.ledger.state_dict()
    first = sorted(tmp_path.glob("*.ckpt"), key=lambda path: path.stat().st_mtime)[0]
    trainer.validate(model, ckpt_path=str(first), verbose=False)
    assert throughput.ledger.restarts == 0 and throughput.ledger.state_dict()["lost"] == booked["lost"]
    assert throughput.ledger.state_dict()["productive"] == booked["productive"]


def test_resuming_from_a_checkpoint_without_its_state_says_that_goodput_starts_anew(tmp_path: Path) -> None:
    # Lightning skips a callback whose state the checkpoint lacks without a word: the ledger started
    # from the resume, and goodput was published as the job's.
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=tmp_path)],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True))
    resumed = pl.Trainer(
        accelerator="cpu", max_steps=4, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[Throughput(flops_fn=None), TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    said = r"Throughput: the checkpoint holds no state of Throughput\{'index': 0\}, so the goodput ledger"
    with pytest.warns(UserWarning, match=said):
        resumed.fit(_Model(fixed=True), ckpt_path=str(next(tmp_path.glob("*.ckpt"))))


class _SlowStream(torch.utils.data.IterableDataset):
    """A validation stream whose iterator takes ``SLEEP`` to open (Lightning opens it before
    ``on_validation_start``)."""

    def __iter__(self):
        time.sleep(SLEEP)
        yield _batch(2, 0)


class _SlowToValidateAndToGather(_Model):
    """Its validation loader opens slowly, and gathering its weights for a checkpoint takes ``SLEEP``
    (as FSDP's all-gather of a full state dict: Lightning gathers them before any callback's hook)."""

    def val_dataloader(self):
        return DataLoader(_SlowStream(), batch_size=None)

    def state_dict(self, *args, **kwargs):
        time.sleep(SLEEP)
        return super().state_dict(*args, **kwargs)


def test_opening_the_validation_loader_and_gathering_a_checkpoint_are_not_training(tmp_path: Path) -> None:
    # Both come after the end of a micro-batch and before the hook that tells them: they were booked
    # as the wait for the next batch (training time, and goodput's data_wait).
    throughput = Throughput(flops_fn=None)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, val_check_interval=4, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=8),
                   ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)],
    )  # fmt: skip
    trainer.fit(_SlowToValidateAndToGather(fixed=True))
    summary, saves = throughput.ledger.summary(), len(list(tmp_path.glob("*.ckpt")))
    assert saves >= 4
    assert summary["validation"] >= 2 * SLEEP  # a run (after step 4): its loader's opening and its step
    assert summary["checkpointing"] >= saves * SLEEP
    assert summary["data_wait"] < SLEEP  # (they were: at least (1 + saves) SLEEP)


class _CutAt3(_Model):
    """Ends each epoch at its batch 3 (Lightning's ``on_train_batch_start`` returning -1)."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 3 else None


def test_a_batch_that_the_module_cancels_is_not_counted(tmp_path: Path) -> None:
    # Lightning calls the callbacks' on_train_batch_start before the module's, which may cancel the
    # batch: its samples, tokens and FLOPs were counted (16 samples an epoch where 12 trained).
    throughput = Throughput(tokens_fn=_tokens, peak_flops_per_sec=PEAK)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, limit_val_batches=0, logger=_Metrics(str(tmp_path / "m.pt")),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=100)],
    )  # fmt: skip
    module = _CutAt3(fixed=True)
    trainer.fit(module)
    written = [row for _, row in torch.load(tmp_path / "m.pt") if "Throughput/samples" in row]
    batches = [_batch(4, i) for i in range(3)]  # each epoch's three trained batches
    assert trainer.global_step == 6 and [row["Throughput/samples"] for row in written] == [12.0, 12.0]
    assert [row["Throughput/tokens"] for row in written] == [float(sum(_tokens(b) for b in batches))] * 2
    flops = _flops_per_sample() * 12
    assert [row["Throughput/flops"] for row in written] == [pytest.approx(flops, rel=1e-12)] * 2


class _Orthogonalized(_Model):
    def configure_optimizers(self):
        return _Orthogonalizing(self.parameters(), lr=0.01)  # (with Lightning's closure)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_optimizer_with_matmuls_in_its_step_adds_no_model_flops(accumulate: int) -> None:
    # The counted micro-batch steps without accumulation: the step's matmuls were counted as forward
    # FLOPs (72x the model's for an MLP under Muon), not with accumulation.
    throughput = Throughput(peak_flops_per_sec=PEAK)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=2)],
    )  # fmt: skip
    trainer.fit(_Orthogonalized(fixed=True))
    assert throughput._flops_per_sample[0] == pytest.approx(_flops_per_sample(), rel=1e-12)


class _SlowLogger(_Metrics):
    """Writes as :class:`_Metrics` does, after sleeping ``SLEEP``: a logger slow to write a flush."""

    def log_metrics(self, metrics, step=None):
        time.sleep(SLEEP)
        super().log_metrics(metrics, step)


class _ReportsAtEpochEnd(_Model):
    """Reports in its ``on_train_epoch_end``, which Lightning runs after the callbacks' (a late value)."""

    def on_train_epoch_end(self):
        report("Epoch/score", float(self.current_epoch))


def test_the_flushes_writes_to_the_loggers_are_not_training(tmp_path: Path) -> None:
    # They come after the flush's derived keys, and those of a late value at the next epoch's start:
    # they were booked as the wait for the next batch (training time, and goodput's data_wait), so a
    # slow logger lowered samples/s and MFU.
    throughput, stats = Throughput(flops_fn=None), TrainingStats(every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, limit_train_batches=4, limit_val_batches=0,
        logger=_SlowLogger(str(tmp_path / "m.pt")), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[throughput, stats],
    )  # fmt: skip
    trainer.fit(_ReportsAtEpochEnd(fixed=True))
    rows = [row for _, row in torch.load(tmp_path / "m.pt")]
    written = [row for row in rows if "Throughput/train_sec" in row]
    assert len(written) == 4 and sum("Epoch/score" in row for row in rows) == 2  # (the late ones written)
    # 2 iterations of a small MLP an interval, against a write of SLEEP after each earlier flush
    assert all(row["Throughput/train_sec"] < SLEEP for row in written), written
    assert throughput.ledger.summary()["data_wait"] < SLEEP  # (it was: at least 3 SLEEP)


def test_the_wait_in_lightnings_sigterm_broadcast_is_the_steps_and_not_data(monkeypatch) -> None:
    # With several ranks Lightning broadcasts a SIGTERM flag before each batch's fetch, where the fast
    # ranks wait for one slow in its optimizer step: the wait of a synchronization inside training, as
    # one in DDP's gradient all-reduce, not goodput's data_wait (it was).
    broadcast_sigterm_flag(monkeypatch, lambda: time.sleep(SLEEP / 3))
    throughput = Throughput(flops_fn=None)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[throughput, TrainingStats(every_n_train_steps=3)],
    )  # fmt: skip
    trainer.fit(_Model(fixed=True))
    summary = throughput.ledger.summary()
    assert summary["data_wait"] < SLEEP / 3 and summary["productive"] >= SLEEP, summary
    assert trainer.callback_metrics["Throughput/train_sec"] >= SLEEP  # (training time, as it was)


class _Contributor(Callback):
    """A contributor of its own that reports and derives nothing."""

    stats_flush_names = ("Mine/x",)

    def before_stats_flush(self):
        pass

    def stats_flush_metrics(self, collector):
        return {}

    def after_stats_flush(self):
        pass


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"stats_flush_names": None},
         r"stats_flush_metrics\(\) but its `stats_flush_names` is None: it must be a non-empty tuple"),
        ({"after_stats_flush": None}, r"_Contributor defines stats_flush_metrics\(\) but no after_stats"),
    ],
)
def test_a_contributor_without_its_names_or_its_end_raises_at_setup(change, match) -> None:
    contributor = _Contributor()
    vars(contributor).update(change)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[contributor, TrainingStats(every_n_train_steps=1)],
    )  # fmt: skip
    with pytest.raises(TypeError, match=match):
        trainer.fit(_Model(fixed=True))


class _ConvNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(288, 4))


class _TrainerOf:
    """What the peak's choice and the count's hooks read of a Trainer."""

    precision, progress_bar_callback, callbacks, global_step = "32-true", None, [], 0
    strategy = types.SimpleNamespace(precision_plugin=None)


def _on_cuda(module: pl.LightningModule, monkeypatch, **kwargs) -> tuple[Throughput, _TrainerOf]:
    """A Throughput attached to ``module`` as if on an H100 (the peak's choice is tested without a GPU:
    the module says it is on one, torch names the device), and its Trainer (keep it: a weak reference)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    module._device = torch.device("cuda", 0)
    throughput, trainer = Throughput(**kwargs), _TrainerOf()
    throughput._attach(trainer, module)
    return throughput, trainer


def _counted_step(throughput: Throughput, module: pl.LightningModule, x: torch.Tensor) -> None:
    """One micro-batch through the hooks that count its FLOPs (the step itself on the CPU)."""
    throughput.on_train_batch_start(throughput.trainer, module, x, 0)
    module.net(x).sum().backward()
    throughput.on_train_batch_end(throughput.trainer, module, {"loss": 0.0}, x, 0)


def test_float32_on_a_device_without_tf32_gets_its_float32_peak(monkeypatch) -> None:
    # cuDNN's TF32 setting is on by default, also on ROCm: the convolutions' TF32 peak was looked up on
    # a device without a TF32 unit, which raised, and the matmuls' float32 peak was lost with it (no MFU).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    module = _ConvNet()
    throughput, _trainer = _on_cuda(module, monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct MI250X/MI250")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert throughput._find_peak() == peaks.peak_flops(torch.float32, "AMD Instinct MI250X/MI250") > 0
    assert throughput._conv_peak is None  # the convolutions at the same float32 peak


@pytest.mark.parametrize("conv_tf32", [True, False])
def test_an_fp32_convolution_net_on_cuda_gets_the_peak_of_its_counted_convolutions_and_matmuls(
    monkeypatch, conv_tf32: bool
) -> None:
    # cuDNN runs float32 convolutions in TF32 by default (allow_tf32), matmuls as the matmul precision
    # says: against the float32 peak an fp32 ResNet's MFU read up to 8x too high (over 100 %); with
    # TF32 matmuls and float32 convolutions it read too low. The count weighs the two peaks.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", conv_tf32)
    monkeypatch.setattr(peaks, "_matmuls_use_tf32", lambda: not conv_tf32)
    module = _ConvNet()
    throughput, _trainer = _on_cuda(module, monkeypatch)
    x = torch.randn(2, 3, 8, 8)
    count = count_flops(module.net, x)
    module.zero_grad()
    conv, rest = count.convolution, count.model - count.convolution
    assert conv == 2 * (2 * 2 * 8 * 36 * 27) and rest > 0  # forward and the weight's gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the count splits the FLOPs
        matmul_peak = throughput._peak = throughput._find_peak()
    conv_peak, other = (494.7e12, 66.9e12) if conv_tf32 else (66.9e12, 494.7e12)
    assert matmul_peak == pytest.approx(other)
    _counted_step(throughput, module, x)
    assert throughput._flops_per_sample[0] == count.model / 2
    assert throughput._peak == pytest.approx(count.model / (conv / conv_peak + rest / other))


def test_a_flops_formula_for_an_fp32_convolution_net_on_cuda_hears_of_the_two_peaks(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(peaks, "_matmuls_use_tf32", lambda: False)
    throughput, _trainer = _on_cuda(_ConvNet(), monkeypatch, flops_fn=lambda batch: 1e9)
    said = r"matmuls, which run in float32, but cuDNN runs this model's convolutions in TF32 .* HINT:"
    with pytest.warns(UserWarning, match=said):
        assert throughput._find_peak() == pytest.approx(66.9e12)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # both in float32: one peak
    throughput, _trainer = _on_cuda(_ConvNet(), monkeypatch, flops_fn=lambda batch: 1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert throughput._find_peak() == pytest.approx(66.9e12)


@pytest.mark.parametrize("peak_dtype", ["garbage", "", False, 0, [1], torch.int8])
def test_a_peak_dtype_the_table_cannot_take_is_refused_at_construction(peak_dtype) -> None:
    # Anything was taken: the run then went without MFU (a warning at its start), and a falsy value
    # silently meant the precision's dtype.
    with pytest.raises(ValueError, match=r"`peak_dtype` must be None, a matmul dtype"):
        Throughput(peak_dtype=peak_dtype)
    assert Throughput(peak_dtype="fp8").peak_dtype == "fp8" and Throughput(peak_dtype=torch.float64)
