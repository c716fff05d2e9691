import types

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_ext.callbacks import IterationTimer, hook_base, iteration_timer
from lightning_ext.stats import Collector

# The timer reads a fake clock that only the data set and the training step advance, by these exact
# binary fractions: the measured times are exact, whatever the machine's load (no timing-dependent test).
DATA_SEC = 2.0**-5  # per batch in the data loader
STEP_SEC = 2.0**-6  # per training_step


class FakeClock:
    """``time.perf_counter`` for the timer: seconds advanced by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_clock = FakeClock()


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    global _clock
    _clock = FakeClock()
    fake = types.SimpleNamespace(perf_counter=_clock.perf_counter)
    for module in (iteration_timer, hook_base):  # step time and the hooks' one data-time clock
        monkeypatch.setattr(module, "time", fake)
    return _clock


class SlowDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        _clock.advance(DATA_SEC / 2)  # batch_size 2 -> DATA_SEC per batch
        return torch.full((4,), float(index))


class SlowModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    @override
    def training_step(self, batch, batch_idx):
        _clock.advance(STEP_SEC)
        return self.net(batch).square().mean()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_timer_against_slow_loader_and_step(accumulate):
    collector = Collector(regex="Timing/.*")
    timer = IterationTimer(warmup_iter=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8,
        accumulate_grad_batches=accumulate,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    assert collector.num("Timing/data_sec") == 8
    assert collector.num("Timing/step_sec") == 6  # warm-up excluded
    # Every micro-batch's loading counts as data time, every training_step as step time, nothing
    # else (the clock only moves there): exact, as the times are sums of binary fractions.
    data_per_iter = DATA_SEC * accumulate
    step_per_iter = STEP_SEC * accumulate
    for stat in ("mean", "min", "max"):
        assert getattr(collector, stat)("Timing/data_sec") == data_per_iter, stat
        assert getattr(collector, stat)("Timing/step_sec") == step_per_iter, stat
    # Per timed micro-batch, the training_step; no collective ran in it, so nothing is subtracted.
    assert collector.num("Timing/compute_sec") == collector.num("Timing/forward_sec") == 6 * accumulate
    assert collector.max("Timing/compute_sec") == collector.min("Timing/forward_sec") == STEP_SEC
    assert timer.timed_iters == 6
    assert timer.timed_seconds == 6 * (data_per_iter + step_per_iter)
    per_iter = data_per_iter + step_per_iter
    lines = timer.summary.splitlines()
    assert lines[0] == f"Overall training speed: 6 iterations in 0:00:00 ({per_iter:.4f} s / it)"
    assert lines[1] == "Total training time: 0:00:00 (0:00:00 on hooks)"  # hooks took no (fake) time


def test_summary_logged_when_training_fails(caplog):
    class Boom(SlowModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 4:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    timer = IterationTimer(warmup_iter=1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=10,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    with caplog.at_level("INFO"), pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), DataLoader(SlowDataset(), batch_size=2))
    assert timer.summary.startswith("Overall training speed: 3 iterations in")
    assert "Overall training speed: 3 iterations" in caplog.text


@pytest.mark.parametrize(
    ("bad", "error", "got"),
    [(-1, ValueError, "-1"), (1.5, TypeError, r"1\.5 \(float\)"), (True, TypeError, r"True \(bool\)"),
     ("3", TypeError, r"'3' \(str\)")],
)  # fmt: skip
def test_bad_warmup(bad, error, got):
    with pytest.raises(error, match=rf"^IterationTimer: `warmup_iter` must be an int >= 0, got {got}$"):
        IterationTimer(warmup_iter=bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for event timing")
def test_cuda_events_reported_lazily():
    collector = Collector(regex="Timing/(step|forward|compute)_sec")
    timer = IterationTimer(warmup_iter=1)
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=5,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    assert collector.num("Timing/step_sec") == 4  # the rest flushed at after_train
    assert collector.min("Timing/step_sec") > 0
    assert collector.num("Timing/compute_sec") == collector.num("Timing/forward_sec") == 4
    assert collector.max("Timing/compute_sec") <= collector.max("Timing/forward_sec")  # no collective here
