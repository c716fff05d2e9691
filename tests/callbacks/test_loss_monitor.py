import math
import os
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import LossMonitor
from lightning_ext.callbacks.loss_monitor import _extract_losses
from lightning_ext.stats import Collector
from tests.helpers.distributed import run_distributed


class NanModule(L.LightningModule):
    """Returns {"loss", "loss_aux", "acc"}; the loss becomes NaN from ``nan_step`` on ``nan_rank``."""

    def __init__(self, nan_step: int | None = None, nan_rank: int = 0, return_loss: bool = True) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.nan_step, self.nan_rank, self.return_loss = nan_step, nan_rank, return_loss
        self.seen: list[tuple[float, float]] = []  # (loss, loss_aux) per micro-batch, float64

    @override
    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).square().mean()
        if (
            self.nan_step is not None
            and self.global_step >= self.nan_step
            and self.global_rank == self.nan_rank
        ):
            loss = loss * math.nan
        aux = x.abs().mean()
        self.seen.append((loss.item(), aux.item()))
        if not self.return_loss:
            return None
        return {"loss": loss, "loss_aux": aux, "acc": torch.tensor(0.5)}

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 4, generator=g)), batch_size=2)


class RecordingLogger(Logger):
    def __init__(self, fail_with: BaseException | None = None) -> None:
        super().__init__()
        self.records: list[tuple[int, dict, str]] = []
        self.fail_with = fail_with

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if self.fail_with is not None:
            raise self.fail_with
        if "LossMonitor/loss" in metrics:
            self.records.append((step, dict(metrics), threading.current_thread().name))


def fit(module, monitor, max_steps, logger=None, **kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=logger if logger is not None else False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(module, loader())
    return trainer


@pytest.mark.parametrize("async_write", [False, True])
def test_periodic_means_in_order(async_write):
    module, logger = NanModule(), RecordingLogger()
    monitor = LossMonitor(every_n_train_steps=3, async_write=async_write)
    trainer = fit(module, monitor, max_steps=7, logger=logger, accumulate_grad_batches=2)
    seen = torch.tensor(module.seen, dtype=torch.float64)  # 14 micro-batches
    # agreement points after iterations 2 and 5, at their steps, + the final flush at the iterations run
    assert [r[0] for r in logger.records] == [2, 5, 7]
    # Means of <= 6 float32 losses summed in float64 in another order: off by <= 6·eps·Σ|x|, about
    # 1e-15 of the mean; callback_metrics hold float32 (2**-24 of it). rel=1e-6 covers both.
    for (step, metrics, thread), lo in zip(logger.records, [0, 6, 12]):
        hi = min(lo + 6, 14)
        assert metrics["LossMonitor/loss"] == pytest.approx(seen[lo:hi, 0].mean().item(), rel=1e-6)
        assert metrics["LossMonitor/loss_aux"] == pytest.approx(seen[lo:hi, 1].mean().item(), rel=1e-6)
        assert "LossMonitor/acc" not in metrics
        assert 0 <= metrics["Timing/data_sec_max"] < 1.0
        # async: ordered jobs on the single writer thread; the final flush runs on the training thread
        assert thread.startswith("LossMonitor-writer") == (async_write and step != 7)
    assert trainer.callback_metrics["LossMonitor/loss"].item() == pytest.approx(seen[12:, 0].mean().item())


class ReusedBufferModule(NanModule):
    """Returns its losses in tensors it overwrites in place at the next step (a reused buffer)."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.loss_buffer = torch.zeros(())
        self.aux_buffer = torch.zeros(())

    @override
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(out["loss"])
            optimizer.step()
            self.loss_buffer.copy_(out["loss"].detach())  # the user's own tensor, returned as "loss"
        self.aux_buffer.copy_(out["loss_aux"])
        return {
            "loss": self.loss_buffer if not self.automatic_optimization else out["loss"],
            "loss_aux": self.aux_buffer,
        }


@pytest.mark.parametrize("manual", [False, True])
def test_losses_kept_until_the_agreement_point_are_not_changed_by_later_in_place_writes(manual):
    # The monitor keeps each step's losses until the agreement point; the user's tensors must be
    # copied, not referenced, or every kept row would read the last step's values.
    module, logger = ReusedBufferModule(manual), RecordingLogger()
    fit(module, LossMonitor(every_n_train_steps=4), max_steps=4, logger=logger)
    seen = torch.tensor(module.seen, dtype=torch.float64)
    assert seen[:, 1].std() > 0  # the aux values differ between steps
    ((step, metrics, _),) = logger.records
    assert step == 3  # Lightning's step of iteration 3, the last of the period
    # float64 means of 4 float32 losses, two summation orders: off by <= 4·eps·Σ|x| << rel 1e-6.
    assert metrics["LossMonitor/loss"] == pytest.approx(seen[:, 0].mean().item(), rel=1e-6)
    assert metrics["LossMonitor/loss_aux"] == pytest.approx(seen[:, 1].mean().item(), rel=1e-6)


@pytest.mark.parametrize(("async_write", "raised_at"), [(False, 7), (True, 8)])
def test_nan_raises_naming_first_bad_iteration(async_write, raised_at):
    module = NanModule(nan_step=5)
    with pytest.raises(
        FloatingPointError, match=r"Loss became infinite or NaN at iteration=5 on rank\(s\) \[0\]!"
    ) as e:
        fit(module, LossMonitor(every_n_train_steps=4, async_write=async_write), max_steps=20)
    assert "loss_dict = {'loss': nan, 'loss_aux': " in str(e.value)
    assert f"LossMonitor.after_step() at iteration={raised_at}" in "\n".join(e.value.__notes__)


def test_inf_is_named_with_its_value_and_the_losses_stay_out_of_other_collectors():
    others = Collector()  # e.g. TrainingStats's: the monitor reports on a stage of its own
    match = r"iteration=2 on rank\(s\) \[0\]!\nloss_dict = \{'loss': inf, 'loss_aux': "
    with pytest.raises(FloatingPointError, match=match):
        fit(InfModule(inf_step=2), LossMonitor(every_n_train_steps=3), max_steps=6)
    others.update()
    assert others.names() == []


class InfModule(NanModule):
    def __init__(self, inf_step: int) -> None:
        super().__init__()
        self.inf_step = inf_step

    @override
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_step == self.inf_step:
            out["loss"] = out["loss"] + math.inf
        return out


def test_nan_at_the_end_caught_by_final_flush():
    with pytest.raises(FloatingPointError, match="iteration=5 on rank"):
        fit(NanModule(nan_step=5), LossMonitor(every_n_train_steps=100), max_steps=7)


def test_nan_warns_when_not_raising():
    with pytest.warns(UserWarning, match="Loss became infinite or NaN at iteration=2"):
        fit(NanModule(nan_step=2), LossMonitor(every_n_train_steps=3, raise_on_nonfinite=False), max_steps=6)


def test_async_writer_exception_reraised_at_next_step():
    logger = RecordingLogger(fail_with=OSError("disk full"))
    with pytest.raises(OSError, match="disk full") as e:
        fit(NanModule(), LossMonitor(every_n_train_steps=2, async_write=True), max_steps=10, logger=logger)
    assert "LossMonitor.after_step() at iteration=2" in "\n".join(e.value.__notes__)


def test_sync_writer_exception_raised_at_once():
    logger = RecordingLogger(fail_with=OSError("disk full"))
    with pytest.raises(OSError, match="disk full") as e:
        fit(NanModule(), LossMonitor(every_n_train_steps=2), max_steps=10, logger=logger)
    assert "LossMonitor.after_step() at iteration=1" in "\n".join(e.value.__notes__)


def test_no_loss_returned():
    with pytest.raises(
        ValueError,
        match=r"LossMonitor: `training_step` returned no loss \(its output reached `on_train_batch_end`",
    ):
        fit(NanModule(return_loss=False), LossMonitor(), max_steps=2)


def test_extract_losses():
    out = _extract_losses({"loss": torch.tensor(3.0), "loss_b": torch.tensor([1.0]), "lossy": 2.0, "x": 1}, 4)
    assert out == {"loss": torch.tensor(12.0), "loss_b": torch.tensor(1.0)}
    assert list(_extract_losses(torch.tensor(2.0))) == ["loss"]
    with pytest.raises(
        TypeError, match="the 'loss' returned by `training_step` must be a tensor with one element"
    ):
        _extract_losses({"loss": torch.ones(3)})
    with pytest.raises(
        ValueError, match=r"returned no loss \(its output reached `on_train_batch_end` as \{'acc': 1\}\)"
    ):
        _extract_losses({"acc": 1})


STEPS = r"LossMonitor: `every_n_train_steps` must be an int >= 1, got "


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n_train_steps": 0}, ValueError, rf"^{STEPS}0$"),
        ({"every_n_train_steps": 2.0}, TypeError, rf"^{STEPS}2\.0 \(float\)$"),
        ({"every_n_train_steps": True}, TypeError, rf"^{STEPS}True \(bool\)$"),
        ({"async_write": "yes"}, TypeError, r"^LossMonitor: `async_write` must be a bool, got 'yes' \(str"),
        ({"raise_on_nonfinite": 1}, TypeError, r"`raise_on_nonfinite` must be a bool, got 1 \(int\)$"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossMonitor(**kwargs)


# ------------------------------------------------------------------------------------------ 2 processes


@pytest.mark.smoke
@pytest.mark.timeout(180)
def test_nan_on_rank1_reaches_the_ddp_spawn_parent():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=16,
        callbacks=[LossMonitor(every_n_train_steps=4)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    pattern = r"FloatingPointError: Loss became infinite or NaN at iteration=5 on rank\(s\) \[1\]!"
    with pytest.raises(Exception, match=pattern):
        trainer.fit(NanModule(nan_step=5, nan_rank=1), loader())


def _fit_with_nan_on_rank1(rank: int, world_size: int) -> list[tuple[str, int]]:
    """Lightning DDP inside the harness's process group (as under torchrun); both LossMonitor modes."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    outcomes = []
    for async_write in (False, True):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            max_steps=16,
            callbacks=[LossMonitor(every_n_train_steps=4, async_write=async_write)],
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
        )
        assert trainer.global_rank == rank
        try:
            trainer.fit(NanModule(nan_step=5, nan_rank=1), loader())
            outcomes.append(("no exception", trainer.global_step))
        except FloatingPointError as exc:
            outcomes.append((str(exc).splitlines()[0], trainer.global_step))
    # rank 0's logger fails at the first write (iteration 3); with max_steps=4 it is the last one, after
    # which rank 0 alone ran another agreement (its collectives): rank 1 left, rank 0 waited out the
    # group's timeout and its error was lost
    for async_write, max_steps in ((False, 16), (True, 16), (False, 4), (True, 4)):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            max_steps=max_steps,
            callbacks=[LossMonitor(every_n_train_steps=4, async_write=async_write)],
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=RecordingLogger(fail_with=OSError("disk full")),
            enable_checkpointing=False,
        )
        try:
            trainer.fit(NanModule(), loader())
            outcomes.append(("no exception", trainer.global_step))
        except (OSError, RuntimeError) as exc:
            outcomes.append((f"{type(exc).__name__}: {exc}", trainer.global_step))
    return outcomes


@pytest.mark.timeout(180)
def test_nan_on_rank1_raises_on_every_rank_at_the_same_step():
    results = run_distributed(_fit_with_nan_on_rank1, 2, timeout=150)
    message = "Loss became infinite or NaN at iteration=5 on rank(s) [1]!"
    # sync: raised after iteration 7 (global_step 8); async: collected one iteration later
    assert results[0][:2] == results[1][:2] == [(message, 8), (message, 9)]
    # a writer failure on rank 0 is agreed at the next agreement point (iteration 7) and raised on
    # both ranks: rank 0 re-raises its own error, rank 1 names it; async one iteration later
    disk_full = "OSError: disk full"
    assert results[0][2:] == [(disk_full, 8), (disk_full, 9), (disk_full, 4), (disk_full, 4)]
    failed = "RuntimeError: LossMonitor: the writer failed on rank(s) [0]; see that rank's error"
    assert results[1][2:] == [(failed, 8), (failed, 9), (failed, 4), (failed, 4)]


def test_two_monitors_driven_side_by_side_each_publish_their_own_losses():
    # Each run's stage was its state_key alone, LossMonitor{'index': 0} for both: each published the
    # mean of both models' losses (50.5 here)
    from lightning_ext.callbacks import HookRunner

    monitors = [LossMonitor(every_n_train_steps=2), LossMonitor(every_n_train_steps=2)]
    runners = [HookRunner([monitor], nn.Linear(4, 1)) for monitor in monitors]
    with runners[0], runners[1]:
        for step in range(4):
            for runner, loss in zip(runners, (1.0, 100.0)):
                runner.before_step()
                runner.after_step(torch.tensor(loss if step != 3 else 2 * loss))
    assert [r.callback_metrics["LossMonitor/loss"].item() for r in runners] == [1.5, 150.0]
    assert [m._collector for m in monitors] == [None, None]  # finished runs take no more values
