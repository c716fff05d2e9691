"""TrainingStats in real Trainer runs: 2-process DDP vs a float64 computation, checkpoints, periods."""

from __future__ import annotations

import csv
import math
import re
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext._compat import at_least
from lightning_ext.callbacks import TrainingStats
from lightning_ext.stats import clear_statistics, report, report0
from tests.helpers.distributed import run_distributed
from tests.helpers.float64_reference import Reference, reference_moments
from tests.helpers.lightning_ddp import ddp_trainer, rank_zero_output

SAMPLES = 48  # 24 per rank: 8 micro-batches of 3, i.e. 4 optimizer steps with accumulate_grad_batches=2
BATCH = 3
ACCUMULATE = 2
EVERY = 2  # flush after 2 and 4 optimizer steps (every 4 micro-batches), at steps 1 and 3
F32 = 2.0**-24  # callback_metrics hold float32: rounding to nearest moves a value by <= 2**-24 of it


def _dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(SAMPLES, 2, generator=gen, dtype=torch.float64)  # large mean: stable std matters
    return TensorDataset(x.float(), torch.randn(SAMPLES, 1, generator=gen))


class ReportingModule(pl.LightningModule):
    """Reports its inputs and loss; records what each rank reported so the test can recompute."""

    def __init__(self, record_dir: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.record_dir = record_dir
        self.seen: list[tuple[int, list[float], float]] = []  # (batch_idx, x values, loss)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x - 1e4), y)
        report("Data/x", x)
        report("Loss/train", loss)
        report0("Opt/lr", 0.01)
        if self.global_rank == 1:
            report("Rank1/only", [1.0, 2.0])  # a name only one rank reports
        self.seen.append((batch_idx, x.double().reshape(-1).tolist(), loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=BATCH, shuffle=False)

    def on_train_end(self) -> None:
        cb = next(c for c in self.trainer.callbacks if isinstance(c, TrainingStats))
        keys = sorted(
            k for k in self.trainer.callback_metrics if k.startswith(("Data/", "Loss/", "Opt/", "Rank1/"))
        )
        torch.save(
            {
                "seen": self.seen,
                "callback_metrics": {k: float(self.trainer.callback_metrics[k]) for k in keys},
                "flush_steps": cb.last_flush_step,
            },
            Path(self.record_dir) / f"rank{self.global_rank}.pt",
        )


def _read_csv(log_dir: str) -> list[dict[str, str]]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _stats(values: list[float], shifts: tuple[float, ...] = ()) -> Reference:
    """Correctly rounded moments of one flush interval and the rounding bound of what TrainingStats
    publishes (``tests/helpers/float64_reference.py``): per rank one drained table, then the
    all-reduce over 2 ranks around the previous flush's mean (``shifts``) or a rank mean; the values
    are float32 tensors (float32 element arithmetic on the ``cpu`` backend)."""
    return reference_moments(values, shifts=shifts, merges=2, ways=2, lanes=True)


def _expect(ref: Reference, suffix: str) -> tuple[float, float]:
    """(expected value, tolerance) of the logged statistic ``suffix`` ("" is the mean)."""
    if suffix == "":
        return ref.mean, ref.tol_mean
    if suffix == "/std":
        return ref.std, ref.tol_std
    return {"/min": ref.min, "/max": ref.max, "/num": ref.num}[suffix], 0.0


def _logging_fit(rank: int, world: int, out_dir: str) -> tuple[list[str], str]:
    """2 ranks (Lightning's ``"ddp"`` on the harness's workers) of the job of the test below; what
    this rank warned, and TrainingStats' state key."""
    clear_statistics()
    stats = TrainingStats(every_n_train_steps=EVERY, stats=("mean", "std", "min", "max", "num"))
    checkpoint = ModelCheckpoint(dirpath=Path(out_dir) / "ckpt", monitor="Data/x", mode="max", save_top_k=1)
    trainer = ddp_trainer(
        rank,
        world,
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[stats, checkpoint],
        logger=CSVLogger(out_dir, name="csv", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with rank_zero_output() as (_, warned):
        trainer.fit(ReportingModule(out_dir))
    return warned, stats.state_key


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_ddp_logs_match_float64_and_checkpoint_round_trips(tmp_path: Path) -> None:
    (warned, state_key), (warned1, _) = run_distributed(_logging_fit, 2, str(tmp_path), timeout=200)
    # The default straggler names without IterationTimer: said once, on rank zero.
    said = "asks for IterationTimer's timings, but the Trainer has none"
    assert sum(said in w for w in warned) == 1 and not any(said in w for w in warned1), (warned, warned1)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # Single-process float64 reference over both ranks' data, per flush interval (4 micro-batches).
    micro_per_flush = EVERY * ACCUMULATE
    expected: dict[int, dict[str, Reference]] = {}
    for step in (2, 4):
        interval = range((step // EVERY - 1) * micro_per_flush, step // EVERY * micro_per_flush)
        values = {
            "Data/x": [v for rec in records for b, x, _ in rec["seen"] if b in interval for v in x],
            "Loss/train": [loss for rec in records for b, _, loss in rec["seen"] if b in interval],
            "Opt/lr": [0.01] * 4,
            "Rank1/only": [1.0, 2.0] * 4,
        }
        expected[step] = {
            name: _stats(data, (expected[2][name].mean,) if step == 4 else ())
            for name, data in values.items()
        }
        assert expected[step]["Data/x"].num == 2 * micro_per_flush * BATCH * 2
    rows = _read_csv(tmp_path / "csv" / "version_0")
    by_step: dict[int, list[dict[str, str]]] = {}
    for row in rows:
        if row.get("Data/x"):
            by_step.setdefault(int(row["step"]), []).append(row)
    # Flushes after optimizer steps 2 and 4 (not at micro-batches) at Lightning's steps of those
    # iterations, 1 and 3; the epoch end at the iterations done, 4, has no new values to write.
    assert sorted(by_step) == [1, 3] and [len(by_step[s]) for s in (1, 3)] == [1, 1]
    rows_after = {2: by_step[1], 4: by_step[3]}  # by optimizer steps done
    for step, want in expected.items():
        for row in rows_after[step]:
            for name, ref in want.items():
                for suffix in ("", "/std", "/min", "/max", "/num"):
                    got = float(row[name + suffix])  # CSV holds the float64's repr: exact
                    value, tol = _expect(ref, suffix)
                    assert abs(got - value) <= tol, (step, name + suffix, got, value, tol)
    assert float(by_step[3][0]["Timing/stats_flush_sec"]) > 0  # the first flush timed itself

    # callback_metrics: identical on both ranks, equal to the last flush.
    assert records[0]["callback_metrics"] == records[1]["callback_metrics"]
    cm = records[0]["callback_metrics"]
    data_x = expected[4]["Data/x"]
    assert abs(cm["Data/x"] - data_x.mean) <= data_x.tol_mean + F32 * abs(data_x.mean)
    assert abs(cm["Data/x/std"] - data_x.std) <= data_x.tol_std + F32 * data_x.std
    assert records[0]["flush_steps"] == records[1]["flush_steps"] == 4

    # ModelCheckpoint monitored a statistic; the checkpoint holds TrainingStats' state under its key.
    (ckpt_path,) = list((tmp_path / "ckpt").glob("*.ckpt"))
    ckpt = torch.load(ckpt_path, weights_only=False)
    (mc_state,) = [v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert abs(float(mc_state["best_model_score"]) - data_x.mean) <= data_x.tol_mean + F32 * abs(data_x.mean)
    saved = ckpt["callbacks"][state_key]
    assert saved["last_flush_step"] == 4
    assert abs(saved["collector"]["values"]["Data/x"][1] - data_x.mean) <= data_x.tol_mean

    # Resume in this process: the restored statistics are visible before any new flush.
    clear_statistics()
    resumed = TrainingStats(every_n_train_steps=EVERY, stats=("mean", "std", "min", "max", "num"))
    probe = _Probe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[resumed, probe],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        limit_train_batches=4,
    )
    (tmp_path / "resume").mkdir()
    trainer.fit(ReportingModule(str(tmp_path / "resume")), ckpt_path=ckpt_path)
    assert probe.at_start is not None
    assert probe.at_start["last_flush_step"] == 4
    assert probe.at_start["collector"]["values"] == saved["collector"]["values"]
    assert resumed.last_flush_step == 6  # 2 more optimizer steps, flushed once at step 6


class _Probe(Callback):
    at_start: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        cb = next(c for c in trainer.callbacks if isinstance(c, TrainingStats))
        self.at_start = cb.state_dict()


def test_bad_arguments_and_state_keys() -> None:
    with pytest.raises(ValueError, match=r"^TrainingStats: `every_n_train_steps` must be an int >= 1, got 0"):
        TrainingStats(every_n_train_steps=0)
    with pytest.raises(TypeError, match=r"`every_n_train_steps` must be an int >= 1, got 2\.0 \(float\)$"):
        TrainingStats(every_n_train_steps=2.0)
    with pytest.raises(
        ValueError, match=r"TrainingStats: `stats` must be a non-empty sequence of .*got \('mean', 'median'\)"
    ):
        TrainingStats(stats=("mean", "median"))
    with pytest.raises(ValueError, match=r"got \('mx',\)\. HINT: did you mean 'max'\?$"):
        TrainingStats(stats=("mx",))
    with pytest.raises(ValueError, match=r"TrainingStats: `forget_after` must be an int >= 1 or None, got 0"):
        TrainingStats(forget_after=0)
    with pytest.raises(TypeError, match=r"Stats: `stats` must be a sequence of names, not the str 'mean'"):
        TrainingStats(stats="mean")
    with pytest.raises(ValueError, match=r"TrainingStats: `regex` must be a regular expression, got '\['"):
        TrainingStats(regex="[")
    with pytest.raises(TypeError, match=r"TrainingStats: `prefix` must be a str, got 3"):
        TrainingStats(prefix=3)
    with pytest.raises(TypeError, match=r"TrainingStats: `on_epoch` must be a bool, got 'no' \(str\)$"):
        TrainingStats(on_epoch="no")
    with pytest.raises(ValueError, match=r"asks for percentiles \['p99'\] but `quantiles` is None"):
        TrainingStats(stats=("mean", "p99"))
    for bad in ("p0", "p100", "p-1", "p", "p5x", "p050", "p0.5"):
        with pytest.raises(ValueError, match=r"`stats` must be a non-empty sequence .* 1 <= P < 100"):
            TrainingStats(stats=(bad,), quantiles=".*")
    with pytest.raises(ValueError, match=r"got \('p0.99',\)\. HINT: 'p0.99' would be ambiguous .*'p99'"):
        TrainingStats(stats=("p0.99",), quantiles=".*")
    assert TrainingStats(stats=("p1", "p50", "p99.99"), quantiles=".*").stats == ("p1", "p50", "p99.99")
    with pytest.raises(ValueError, match=r"Stats: `quantiles` must be a regular expression, got '\('"):
        TrainingStats(quantiles="(")
    with pytest.raises(TypeError, match=r"TrainingStats: `stragglers` must be a str, got 3"):
        TrainingStats(stragglers=3)
    with pytest.raises(
        ValueError, match=r"`relative_accuracy` must be a finite number in \(0.0, 0.5\), got 0.5"
    ):
        TrainingStats(relative_accuracy=0.5)
    with pytest.raises(ValueError, match=r"`value_range\[1\]` must be a finite number > 1.0, got 1.0"):
        TrainingStats(value_range=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"Stats: `straggler_excess` must be a finite number >= 0.0, got -1"):
        TrainingStats(straggler_excess=-1)
    with pytest.raises(TypeError, match=r"`straggler_min_sec` must be a finite number >= 0.0, got nan"):
        TrainingStats(straggler_min_sec=math.nan)
    with pytest.raises(ValueError, match=r"Stats: `straggler_patience` must be an int >= 1, got 0"):
        TrainingStats(straggler_patience=0)
    with pytest.raises(RuntimeError, match=r"TrainingStats.flush\(\) needs a Trainer that ran setup\(\)"):
        TrainingStats().flush(None)
    a, b = TrainingStats(regex="Loss/.*"), TrainingStats(regex="AMP/.*")
    assert a.state_key != b.state_key and a.state_key.startswith("TrainingStats{")


class ValidatingModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x - 1e4), y)

    def validation_step(self, batch, batch_idx):
        # The sanity check's values must be dropped, not mixed into the first epoch.
        report("Loss/val", 1e9 if self.trainer.sanity_checking else float(self.current_epoch + 1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_dataset(), batch_size=8)


@pytest.mark.parametrize("forget_after", [100, 1])  # 1: the publication of late values is no flush
def test_validation_epoch_flush_feeds_model_checkpoint_and_drops_sanity_check(tmp_path: Path, forget_after):
    clear_statistics()
    stats = TrainingStats(
        every_n_train_steps=1000, regex="Loss/.*", prefix="stats/", forget_after=forget_after
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="stats/val/Loss/val", mode="min", save_top_k=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        callbacks=[stats, checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
    )
    trainer.fit(ValidatingModule())
    value = trainer.callback_metrics["stats/val/Loss/val"]  # (a view of the flush's one float32 tensor)
    assert value.shape == () and value.dtype == torch.float32 and value.device.type == "cpu"
    assert float(value) == 2.0  # epoch 2's, sanity 1e9 dropped
    assert float(checkpoint.best_model_score) == 1.0 and "epoch=0" in checkpoint.best_model_path
    # Validation values go to the validation stage only: training never saw Loss/val.
    val = stats.stage_collectors["validate"]
    assert val.num("Loss/val") == 2 and val.mean("Loss/val") == 2.0  # (kept by its last, late, flush)
    assert stats.collector is not None and "Loss/val" not in stats.collector.names()


class _TwoOptimizers(pl.LightningModule):
    """Manual optimization: two optimizer steps per training_step, one report per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        report("Batch/idx", float(batch_idx))
        for optimizer, net in zip(self.optimizers(), (self.a, self.b)):
            optimizer.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(net(x - 1e4), y))
            optimizer.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.01), torch.optim.SGD(self.b.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=8)


class _Steps(pl.loggers.Logger):
    name, version = "steps", 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class _ReportsAtTheEnd(pl.Callback):
    """After ``TrainingStats`` in ``callbacks``: reports a final figure in ``on_train_end`` (as
    ``examples/gan.py`` reports its final FID)."""

    def on_train_end(self, trainer, pl_module):
        report("Eval/final", 7.0)


def test_a_value_reported_in_a_later_callbacks_on_train_end_is_written() -> None:
    # TrainingStats' own on_train_end published what came after its epoch-end flush, before the
    # callbacks after it ran theirs: their values were dropped without a word (the GAN job's FID/end).
    clear_statistics()
    logger = _Steps()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[TrainingStats(every_n_train_steps=2, regex="Eval/.*"), _ReportsAtTheEnd()],
    )  # fmt: skip
    trainer.fit(_Spread())
    rows = [(step, row["Eval/final"]) for step, row in logger.logged if "Eval/final" in row]
    assert rows == [(3, 7.0)], logger.logged  # at the epoch-end flush's step (the last iteration's)


def _batch_flushes(stats: TrainingStats, model: pl.LightningModule) -> list[tuple[int, dict]]:
    """The rows holding ``Batch/idx`` that ``stats`` wrote in one epoch of ``model`` (its own Trainer)."""
    logger = _Steps()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1000,
        callbacks=[stats],
    )  # fmt: skip
    trainer.fit(model)
    return [(step, m) for step, m in logger.logged if "Batch/idx" in m]


def test_manual_optimization_flushes_every_n_training_steps() -> None:
    # global_step advances by 2 per batch; the period counts training steps (iterations).
    clear_statistics()
    stats = TrainingStats(every_n_train_steps=3, regex="Batch/.*", stats=("mean", "num"), on_epoch=False)
    flushes = _batch_flushes(stats, _TwoOptimizers())
    assert [step for step, _ in flushes] == [2, 5]  # Lightning's steps of iterations 2 and 5
    assert [m["Batch/idx"] for _, m in flushes] == [1.0, 4.0]  # batches 0-2, then 3-5
    assert all(m["Batch/idx/num"] == 3 for _, m in flushes)


class _ManualAccumulation(_TwoOptimizers):
    """Manual optimization stepping every other batch (Lightning's idiom for accumulating by hand)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        report("Batch/idx", float(batch_idx))
        for optimizer, net in zip(self.optimizers(), (self.a, self.b)):
            self.manual_backward(torch.nn.functional.mse_loss(net(x - 1e4), y))
            if batch_idx % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=6)  # 8 batches: 4 iterations


def test_manual_accumulation_counts_iterations_and_a_reused_callback_counts_from_its_new_fit() -> None:
    # Lightning's step counts every batch in manual optimization; the period counts the batches that
    # stepped (it flushed every iteration here). The same callback in a new Trainer (a second stage of
    # training) counts from that fit's start (it stayed silent until the first fit's count).
    clear_statistics()
    stats = TrainingStats(every_n_train_steps=2, regex="Batch/.*", stats=("mean", "num"), on_epoch=False)
    for fit in range(3):  # the third after clear_statistics(), which detaches every collector: it
        if fit == 2:  # wrote nothing (the callback kept its detached collectors)
            clear_statistics()
        flushes = _batch_flushes(stats, _ManualAccumulation())
        assert [step for step, _ in flushes] == [3, 7]  # iterations 2 and 4 end with batches 3 and 7
        assert [(m["Batch/idx"], m["Batch/idx/num"]) for _, m in flushes] == [(1.5, 4), (5.5, 4)]


class _LoggingModule(pl.LightningModule):
    """Calls ``self.log`` every training and validation step and reports the iteration it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.iteration = 0  # training_step calls: the iteration (no accumulation)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("lightning/iteration", float(self.iteration))
        self.log("lightning/epoch_mean", float(self.iteration), on_step=False, on_epoch=True)
        report("Batch/iteration", float(self.iteration))
        self.iteration += 1
        return torch.nn.functional.mse_loss(self.lin(x - 1e4), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.lin(x - 1e4), y)
        self.log("lightning/val_loss", loss)
        report("Loss/val", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(_dataset(), batch_size=BATCH)


def test_rows_of_every_callback_follow_lightning_steps() -> None:
    # Every row the callbacks write carries Lightning's own step for that batch (its self.log
    # step), so the steps reaching one logger never go backwards (W&B drops rows with an older
    # step): batch-end rows, validation rows, epoch-end rows and LossMonitor's on_train_end row.
    from lightning_ext.callbacks import IterationTimer, LossMonitor, ResourceStats, Throughput

    clear_statistics()
    logger = _Steps()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=6, limit_val_batches=2,
        val_check_interval=3, log_every_n_steps=2, logger=logger, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            IterationTimer(warmup_iter=1), ResourceStats(every_n_train_steps=2), Throughput(),
            LossMonitor(every_n_train_steps=5), TrainingStats(every_n_train_steps=3, stats=("mean", "max")),
        ],
    )  # fmt: skip
    trainer.fit(_LoggingModule())
    steps = [step for step, _ in logger.logged]
    assert steps == sorted(steps), [(step, sorted(m)[:2]) for step, m in logger.logged]

    def rows(key: str) -> list[tuple[int, dict]]:
        return [(step, m) for step, m in logger.logged if key in m]

    # Lightning logs batch i's self.log values at step i (every 2nd batch), validation at the
    # step of the batch it follows (batches 2, 5, 8, 11).
    assert [(s, m["lightning/iteration"]) for s, m in rows("lightning/iteration")] == [
        (i, float(i)) for i in (1, 3, 5, 7, 9, 11)
    ]
    assert [s for s, _ in rows("lightning/val_loss")] == [2, 5, 8, 11]
    # and each training epoch's on_epoch values at the step of its last batch (the epoch-end flush
    # wrote at the iteration count before them: a step back, W&B drops Lightning's row)
    assert [s for s, _ in rows("lightning/epoch_mean")] == [5, 11]
    # TrainingStats: after every 3rd iteration at that iteration's step, after each validation
    # at the validation's step, at each epoch end at its last iteration's step; it writes what
    # IterationTimer and ResourceStats report.
    flushes = [(s, m["Batch/iteration/max"]) for s, m in rows("Batch/iteration/max")]
    assert all(maximum <= step for step, maximum in flushes) and {(i, i) for i in (2, 5, 8, 11)} <= {
        (s, int(v)) for s, v in flushes
    }
    # Each validation's Loss/val, written once, at that validation's step, under the stage's prefix.
    assert [s for s, _ in rows("val/Loss/val")] == [2, 5, 8, 11] and not rows("Loss/val")
    assert rows("Timing/iteration_sec") and rows("Resources/cpu_mem_gb") and rows("Goodput/goodput")
    # Throughput's keys ride in the training flushes, not the validation ones, nor the epoch ends:
    # each follows a flush after that epoch's last iteration (an interval without an iteration).
    assert [s for s, _ in rows("Throughput/samples_per_sec")] == [s for s, _ in rows("Throughput/samples")]
    assert [s for s, _ in rows("Throughput/samples_per_sec")] == [2, 5, 8, 11]
    # The last epoch end writes only what is new since the flush after iteration 12 (step 11): the
    # flush times of that flush and of the validation after it.
    assert max(s for s, _ in rows("Timing/iteration_sec")) == 11
    assert max(s for s, _ in rows("Timing/stats_flush_sec")) == 11 and not rows("val/Timing/stats_flush_sec")
    # LossMonitor: after iterations 4 and 9, and the rest at the end of training (on_train_end),
    # which is the last row.
    assert [s for s, _ in rows("LossMonitor/loss")] == [4, 9, 12]
    assert "LossMonitor/loss" in logger.logged[-1][1]


class _ForwardReports(pl.LightningModule):
    """One ``forward`` for every loop, which reports its input (as a user following the guide would):
    training batches hold values 0..39 (4 per step), validation batches 1000 + (0..11)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)

    def forward(self, x):
        report("Input/x", x)
        return self.lin(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        self(batch[0])

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.arange(40.0)[:, None]), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(1000 + torch.arange(12.0)[:, None]), batch_size=4)


@pytest.mark.parametrize("every", [5, 10])
def test_values_of_validation_never_mix_with_training_ones(every: int) -> None:
    # 10 training steps of 4 values, a validation of 3 batches of 4 after steps 5 and 10: the
    # training statistic counts exactly the training values of its period (a period of 10 spans a
    # validation run), the validation one exactly that run's values, each row written once.
    clear_statistics()
    logger = _Steps()
    stats = TrainingStats(every, stats=("num", "mean"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, val_check_interval=5, num_sanity_val_steps=2,
        logger=logger, callbacks=[stats], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_ForwardReports())
    train = [(s, m["Input/x/num"], m["Input/x"]) for s, m in logger.logged if "Input/x/num" in m]
    val = [(s, m["val/Input/x/num"], m["val/Input/x"]) for s, m in logger.logged if "val/Input/x/num" in m]
    n = 4 * every  # values per training period k: k*n .. k*n + n - 1, written at step (k + 1) * every - 1
    assert train == [((k + 1) * every - 1, n, k * n + (n - 1) / 2) for k in range(10 // every)]
    assert val == [(4, 12, 1005.5), (9, 12, 1005.5)]  # the sanity check's 8 values dropped
    steps = [s for s, _ in logger.logged]
    assert steps == sorted(steps)
    # predict: values reported there are not collected (no stage of TrainingStats takes them)
    trainer.predict(_ForwardReports(), DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=4))
    assert stats.collector is not None and stats.collector.names() == ["Input/x", "Timing/stats_flush_sec"]


class _EpochEndReports(_ForwardReports):
    """Also reports from the LightningModule's end hooks, which Lightning runs after the callbacks':
    ``Val/run`` and ``Val/end`` (the validation run's index) and ``Epoch/metric`` (the epoch)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            report("Val/run", float(self.runs))

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            report("Val/end", float(self.runs))
            self.runs += 1

    def on_train_epoch_end(self):
        report("Epoch/metric", float(self.current_epoch))


def test_values_of_the_modules_end_hooks_are_written_at_their_step_with_two_callbacks() -> None:
    # Two TrainingStats left the stage at "validate" after the first validation run (the second one
    # restored what the first had set), so training values went into validation statistics; values
    # the module reported in on_validation_epoch_end were written one run late (the last run's never),
    # those of its on_validation_end went into training statistics, and those of on_train_epoch_end
    # were written one epoch late (the last epoch's never).
    clear_statistics()
    logger = _Steps()
    stats = TrainingStats(5, regex="Input/.*|Val/.*|Epoch/.*", stats=("num", "mean"))
    other = TrainingStats(5, regex="Other/.*", stats=("num", "mean"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, val_check_interval=5, num_sanity_val_steps=2,
        logger=logger, callbacks=[stats, other], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_EpochEndReports())

    def rows(key: str) -> list[tuple[int, float, float]]:
        return [(s, m[f"{key}/num"], m[key]) for s, m in logger.logged if f"{key}/num" in m]

    assert rows("Input/x") == [(5 * k + 4, 20, 20 * (k % 2) + 9.5) for k in range(4)]
    assert rows("val/Input/x") == [(5 * k + 4, 12, 1005.5) for k in range(4)]
    assert rows("val/Val/run") == rows("val/Val/end") == [(5 * k + 4, 1, float(k)) for k in range(4)]
    assert rows("Epoch/metric") == [(9, 1, 0.0), (19, 1, 1.0)]  # (Lightning's step of the epoch's end)
    assert "Val/end" not in stats.collector.names()  # (never a training value)
    steps = [s for s, _ in logger.logged]
    assert steps == sorted(steps)


class _Spread(pl.LightningModule):
    """Reports 8 values per step into ``Data/x`` and one NaN every second step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        report("Data/x", torch.cat([x.reshape(-1), torch.tensor([math.nan] * (batch_idx % 2))]))
        return torch.nn.functional.mse_loss(self.lin(x - 1e4), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)


class _PerKeyTensorBoardLogger(pl.loggers.TensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` with ``log_metrics`` overridden (to itself): a flush writes to
    it through ``log_metrics``, an event per key, as to any logger."""

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, step)


class _SpreadValidated(_Spread):
    """``_Spread`` with a validation loop reporting ``Data/x`` too (its flush: ``val/Data/x``)."""

    def validation_step(self, batch, batch_idx):
        report("Data/x", batch[0].reshape(-1) * 2.0)

    def val_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)


def _tensorboard_run(logger: pl.loggers.TensorBoardLogger) -> tuple[dict, dict, int]:
    """Train ``_SpreadValidated`` (flushes every 2 steps and after each validation, ``Data/x`` sketched)
    writing to ``logger``; its scalars ``{tag: [(step, value)]}``, histograms ``{tag: [(step, fields)]}``
    and events with values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    clear_statistics()
    torch.manual_seed(0)
    stats = TrainingStats(every_n_train_steps=2, stats=("mean", "std", "max", "p50"), quantiles="Data/.*")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=8, limit_val_batches=2,
        num_sanity_val_steps=0, logger=logger, callbacks=[stats], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_SpreadValidated())
    events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    histograms = {t: [(h.step, str(h.histogram_value)) for h in events.Histograms(t)]
                  for t in events.Tags()["histograms"]}  # fmt: skip
    files = list(Path(logger.log_dir).glob("events.out.tfevents.*"))
    written = sum(bool(e.summary.value) for f in files for e in EventFileLoader(str(f)).Load())
    return scalars, histograms, written


def test_a_flush_writes_tensorboard_one_event_holding_what_log_metrics_writes_an_event_a_key(tmp_path: Path):
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="one", version=0)
    scalars, histograms, events = _tensorboard_run(logger)
    per_key = _tensorboard_run(_PerKeyTensorBoardLogger(tmp_path, name="per_key", version=0))
    assert sorted(scalars) == sorted(per_key[0]) and {"Data/x/p50", "val/Data/x/p50"} <= set(scalars)
    for tag, series in scalars.items():  # the same steps and values (the flush's own time aside)
        assert [s for s, _ in series] == [s for s, _ in per_key[0][tag]], tag
        if not tag.startswith("Timing/"):
            assert series == per_key[0][tag], tag
    assert [s for s, _ in scalars["Data/x"]] == [1, 3, 5, 7], sorted(scalars)
    assert histograms == per_key[1]
    assert len(histograms["Data/x/hist"]) == 4 and len(histograms["val/Data/x/hist"]) == 1
    assert events == 6  # every 2 steps, the validation's end and the epoch's end (the last flush's time)
    assert per_key[2] == sum(map(len, scalars.values())) + sum(map(len, histograms.values()))
    # A prefix (Lightning's log_metrics adds it): written through log_metrics, prefixed alike
    prefixed = _tensorboard_run(pl.loggers.TensorBoardLogger(tmp_path, name="p", version=0, prefix="run"))
    assert sorted(prefixed[0]) == sorted(f"run-{tag}" for tag in scalars) and prefixed[1] == histograms


def test_tensorboard_checksums_records_in_c_with_its_own_checksums(tmp_path: Path, monkeypatch):
    """With a ``TensorBoardLogger``, ``setup`` (rank zero) has TensorBoard's writer checksum records with
    google-crc32c: a run's event file reads back through TensorBoard's reader, which checks every
    record against TensorBoard's own pure-Python CRC32C, and both give the same masked checksums of
    random bytes. Without google-crc32c nothing changes."""
    crc32c = pytest.importorskip("google_crc32c")
    if getattr(crc32c, "implementation", None) != "c":
        pytest.skip("google-crc32c without its C extension here")
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    from lightning_ext.callbacks import training_stats

    decide = training_stats._fast_tensorboard_checksums
    monkeypatch.setattr(record_writer, "masked_crc32c", pywrap_tensorflow.masked_crc32c)  # (undone after)
    monkeypatch.setitem(sys.modules, "google_crc32c", None)  # not installed
    decide.cache_clear()
    assert not decide() and record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c
    monkeypatch.setitem(sys.modules, "google_crc32c", crc32c)
    decide.cache_clear()
    try:
        scalars, histograms, events = _tensorboard_run(pl.loggers.TensorBoardLogger(tmp_path, name="c"))
        assert record_writer.masked_crc32c.func is training_stats._masked_crc32c  # set by setup
        assert decide.cache_clear() is None and decide()  # (in effect: said so again)
        assert events == 6 and len(histograms["Data/x/hist"]) == 4 and scalars["Data/x"]
        generator = np.random.default_rng(0)
        for size in (0, 1, 7, 1023, 1 << 16):
            data = generator.bytes(size)
            assert record_writer.masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data), size
    finally:
        decide.cache_clear()  # (the next setup decides again, the stub's function restored)


def test_tensorboard_histograms_write_a_run_of_empty_buckets_as_one_bucket() -> None:
    import numpy as np

    from lightning_ext.callbacks.training_stats import _histogram_fields
    from lightning_ext.stats import Collector

    clear_statistics()
    collector = Collector(quantiles="x")
    report("x", [1e-3, 1.1e-3, 0.5, 0.51, 0.52, 40.0])  # three clusters, runs of empty buckets between
    collector.update()
    counts, edges = collector.histogram("x")
    fields = _histogram_fields(collector, "x")
    limits, written = np.array(fields["bucket_limits"]), np.array(fields["bucket_counts"])
    assert written.sum() == counts.sum() == fields["num"] == 6 and len(written) < len(counts) / 20
    assert not np.any((written[:-1] == 0) & (written[1:] == 0))  # no two empty buckets in a row
    at = np.searchsorted(edges[1:], limits)  # each written limit is one of the sketch's,
    assert np.array_equal(edges[1:][at], limits)  # holding what the sketch holds up to it
    assert np.array_equal(np.cumsum(written), np.cumsum(counts)[at])
    clear_statistics()


def test_a_histogram_of_float64_values_beyond_float32_reaches_tensorboard() -> None:
    # Its sum of squares overflowed a Python float power (OverflowError: the flush raised on rank zero
    # alone, its TensorBoardLogger writing nothing); it is inf, as TensorBoard takes it.
    from lightning_ext.callbacks.training_stats import _histogram_fields
    from lightning_ext.stats import Collector

    clear_statistics()
    collector = Collector(quantiles="Grad/norm")
    report("Grad/norm", [1e200])
    collector.update()
    fields = _histogram_fields(collector, "Grad/norm")
    assert (fields["num"], fields["sum"], fields["sum_squares"]) == (1, 1e200, math.inf)
    clear_statistics()


def test_histograms_reach_tensorboard_and_unmatched_patterns_are_said_once(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clear_statistics()
    logger = pl.loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [
        TrainingStats(every_n_train_steps=2, stats=("mean", "p50"), quantiles="Data/.*"),
        TrainingStats(every_n_train_steps=2, regex="Dta/.*"),  # a misspelt regex
        TrainingStats(every_n_train_steps=2, stats=("p50",), quantiles="Dat/.*"),  # and quantiles
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=8, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="matched none") as caught:
        trainer.fit(_Spread())
    said = sorted(str(w.message) for w in caught if "matched none" in str(w.message))
    assert len(said) == 2, said  # once each, after the third flush, not again at the epoch ends
    assert said[0].startswith("TrainingStats: `quantiles`='Dat/.*' matched none of the names reported")
    assert said[1].startswith("TrainingStats: `regex`='Dta/.*' matched none of the names reported")
    assert "'Data/x'" in said[1]  # the names this process reported, to pick from
    events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0})
    events.Reload()
    histograms = events.Histograms("Data/x/hist")
    # One per flush, at the steps of the scalars: every 2 iterations (each with 8 values and, after
    # the second one, a NaN), none at the epoch ends (no new values).
    assert [h.step for h in histograms] == [1, 3, 5, 7, 9, 11, 13, 15]
    for h in histograms:
        value = h.histogram_value
        assert sum(value.bucket) == value.num == 16  # 17 reported, the NaN not counted
        assert value.min < value.bucket_limit[0] and list(value.bucket_limit) == sorted(value.bucket_limit)


class _NonFinite(pl.LightningModule):
    """Reports 4 finite values per step into ``Grad/norm``, a NaN and an inf every second step, and only
    NaN into ``Loss/nan`` at step 3."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        bad = [math.nan, math.inf] * (batch_idx % 2)
        report("Grad/norm", [float(batch_idx)] * 4 + bad)
        if batch_idx == 3:
            report("Loss/nan", [math.nan, math.nan])
        return torch.nn.functional.mse_loss(self.lin(x - 1e4), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)


def test_non_finite_values_are_counted_beside_the_statistics_of_the_finite_ones() -> None:
    """Issue 44's case: a NaN among an interval's values no longer hides the name: its statistics are
    those of the finite values, ``name/nonfinite`` counts the others, a warning says so once per name;
    a name with only non-finite values is written with ``num`` 0 and NaN statistics."""
    clear_statistics()
    logger = _Steps()
    stats = TrainingStats(every_n_train_steps=2, regex="(Grad|Loss)/.*", stats=("mean", "max", "num"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=logger, callbacks=[stats],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="non-finite") as caught:
        trainer.fit(_NonFinite())
    said = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(said) == 2 and said[0].startswith(
        "TrainingStats: 'Grad/norm' had 2 non-finite values (NaN or ±inf) at iteration=1 beside 8 finite ones"
    ), said
    rows = [m for _, m in logger.logged if "Grad/norm" in m]
    assert [r["Grad/norm"] for r in rows] == [0.5, 2.5, 4.5] and [r["Grad/norm/num"] for r in rows] == [
        8.0
    ] * 3
    assert [r["Grad/norm/nonfinite"] for r in rows] == [2.0] * 3 and rows[1]["Grad/norm/max"] == 3.0
    (nan_row,) = [m for _, m in logger.logged if "Loss/nan/nonfinite" in m]
    assert (
        nan_row["Loss/nan/num"] == 0
        and nan_row["Loss/nan/nonfinite"] == 2
        and math.isnan(nan_row["Loss/nan"])
    )


class _NanOnce(_NonFinite):
    def training_step(self, batch, batch_idx):
        report("V", math.nan if batch_idx == 1 else float(batch_idx))
        return super().training_step(batch, batch_idx)


def test_a_count_of_non_finite_values_no_longer_true_is_0_in_callback_metrics() -> None:
    # ModelCheckpoint and EarlyStopping read callback_metrics: the NaN of the first interval must not
    # stay beside the later intervals' statistics there (it did, until another interval had one)
    clear_statistics()
    logger = _Steps()
    stats = TrainingStats(every_n_train_steps=2, regex="V", stats=("mean",))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=logger, callbacks=[stats],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.fit(_NanOnce())
    assert [(step, m["V/nonfinite"]) for step, m in logger.logged if "V/nonfinite" in m] == [(1, 1.0)]
    assert trainer.callback_metrics["V"] == 4.5 and trainer.callback_metrics["V/nonfinite"] == 0.0


class _Colliding(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin, self.name = torch.nn.Linear(2, 1), name

    def training_step(self, batch, batch_idx):
        report("Loss", 1.0)
        report(self.name, 2.0)
        return self.lin(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)


@pytest.mark.parametrize("name", ["Loss/std", "Loss/nonfinite", "Loss/straggler_rank"])
def test_a_reported_name_equal_to_a_derived_key_raises(name: str) -> None:
    clear_statistics()
    stats = TrainingStats(every_n_train_steps=2, stats=("mean", "std"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, callbacks=[stats],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=rf"TrainingStats: the keys '{name}' \(reported, and derived from 'Loss'\)"
    ):
        trainer.fit(_Colliding(name))
    TrainingStats(
        every_n_train_steps=2, stats=("mean",), stragglers=None
    )  # without "std": no clash for Loss/std


class _FailingValidation(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        raise RuntimeError("validation failed")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_dataset(), batch_size=4)


def test_a_failing_validation_leaves_no_stage_behind() -> None:
    clear_statistics()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False,
        callbacks=[TrainingStats(every_n_train_steps=1)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="validation failed"):
        trainer.fit(_FailingValidation())
    from lightning_ext.stats import set_stage

    assert set_stage(None) is None  # training's stage again: report() after the failure is training's


class _Disagreeing(Callback):
    """Gives rank 1's TrainingStats another period before its setup (as a per-rank config would)."""

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank == 1:
            next(c for c in trainer.callbacks if isinstance(c, TrainingStats)).every_n_train_steps = 3


def _setup_error(rank: int, world: int, case: str) -> str:
    """A fit (Lightning's ``"ddp"`` on the harness's workers) whose ranks' callbacks differ: ``"period"``,
    rank 1's TrainingStats has another period; ``"throughput"``, rank 0 alone has a Throughput, which
    two TrainingStats collect (the error of rank 0's own check, run before the agreement, left rank 1
    waiting in it). The error it raised on this rank."""
    from lightning_ext.callbacks import Throughput

    clear_statistics()
    if case == "period":
        callbacks = [_Disagreeing(), TrainingStats(every_n_train_steps=2)]
    else:
        stats = [TrainingStats(every_n_train_steps=1), TrainingStats(every_n_train_steps=4)]
        callbacks = ([Throughput(flops_fn=None)] if rank == 0 else []) + stats
    trainer = ddp_trainer(
        rank, world, max_steps=6, logger=False, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(_Colliding("Other"))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(240)
def test_ranks_with_other_arguments_raise_at_setup_naming_them() -> None:
    """Issue 44's case: every_n_train_steps=2 on rank 0 and 3 on rank 1 would flush at other steps, where
    DDP's gradient all-reduce stands in between (a hang to the timeout): setup raises on every rank
    first, naming the ranks and their arguments."""
    for message in run_distributed(_setup_error, 2, "period", timeout=200):
        assert re.match(
            r"TrainingStats: the ranks' arguments differ: "
            r"every_n_train_steps=2 on ranks \[0\], 3 on ranks \[1\]; their flushes would not meet",
            message,
        ), message


@pytest.mark.timeout(240)
def test_a_check_of_one_rank_waits_for_the_agreement_of_all() -> None:
    for message in run_distributed(_setup_error, 2, "throughput", timeout=200):
        assert message.startswith("TrainingStats: the ranks' arguments differ: contributors="), message


class _Iterations(pl.LightningModule):
    """Reports the iteration it runs (``global_step``), 8 batches an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        report("Batch/iteration", float(self.global_step))
        return self.lin(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.ones(16, 2)), batch_size=2)


@pytest.mark.skipif(
    not at_least(pl.__version__, "2.5"),
    reason="Lightning 2.4 restores its count of the batches that stepped one lower after a mid-epoch "
    "resume, for the whole run (its log steps too); from 2.5 its epoch loop corrects it",
)
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_mid_epoch_resume_without_the_callbacks_state_flushes_as_the_straight_run(tmp_path: Path) -> None:
    # The count was read in on_train_start, before Lightning corrects a mid-epoch resume's: every flush
    # came one iteration late and the last was lost ([(8, 7.0), (12, 10.5)] for the rows below)
    def fit(every: int, ckpt_path: Path | None = None) -> list[tuple[int, float, float]]:
        clear_statistics()
        logger, stats = _Steps(), TrainingStats(every, stats=("mean", "num"), on_epoch=False)
        saving = ModelCheckpoint(tmp_path, every_n_train_steps=6, save_top_k=-1, filename="{step}")
        pl.Trainer(
            accelerator="cpu", devices=1, max_steps=16, logger=logger, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[stats, saving] if ckpt_path is None else [stats],
        ).fit(_Iterations(), ckpt_path=ckpt_path)  # fmt: skip
        rows = [(step, m) for step, m in logger.logged if "Batch/iteration" in m]
        return [(step, m["Batch/iteration"], m["Batch/iteration/num"]) for step, m in rows]

    fit(3)  # its checkpoint at step 6 holds TrainingStats(3)'s state, not TrainingStats(4)'s
    straight, resumed = fit(4), fit(4, tmp_path / "step=6.ckpt")
    assert straight == [(3, 1.5, 4), (7, 5.5, 4), (11, 9.5, 4), (15, 13.5, 4)]
    assert resumed == [(7, 6.5, 2), (11, 9.5, 4), (15, 13.5, 4)]  # (the first interval from the resume)
