"""``IterationTimer``: the parts of an iteration add up to its wall time (exactly on a fake clock, within
the time inside the timer's hooks on the real one), the wait in DDP's gradient all-reduce leaves
``compute_sec``, and a rank slow in its backward is named in DDP Trainer jobs on 2 and 3 ranks."""

import csv
import itertools
import re
import time
import types
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_ext import _clock as timestamps
from lightning_ext.callbacks import HookRunner, IterationTimer, TrainingStats, hook_base, iteration_timer
from lightning_ext.distributed.ddp_sync_timer import DDPSyncTimer
from lightning_ext.plugins import SyncBatchNormPlugin
from lightning_ext.stats import Collector, init_multiprocessing
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import broadcast_sigterm_flag, ddp_trainer, rank_zero_output

# The timer reads a fake clock that only the data set, the training step, the backward, the optimizer
# step, a later callback and a fake collective advance, by these exact binary fractions: the measured
# times are exact, whatever the machine's load (no timing-dependent test).
DATA_SEC = 2.0**-5  # per batch in the data loader
STEP_SEC = 2.0**-6  # per training_step, its collective's wait excluded
WAIT_SEC = 2.0**-10  # per training_step, in a (fake) collective of the package
BACKWARD_SEC = 2.0**-7  # per backward, in a tensor hook
OPTIMIZER_SEC = 2.0**-8  # per optimizer step, in on_before_optimizer_step
HOOK_SEC = 2.0**-9  # per micro-batch, in a callback's on_train_batch_end after the timer
SYNC_SEC = 2.0**-11  # per batch, in Lightning's SIGTERM broadcast before the fetch (several ranks)


class FakeClock:
    """``time.perf_counter`` for the timer, and ``collective_seconds``: seconds advanced by hand."""

    def __init__(self) -> None:
        self.now, self.waited = 1000.0, 0.0

    def perf_counter(self) -> float:
        return self.now

    def collective_seconds(self) -> float:
        return self.waited

    def advance(self, seconds: float, waited: float = 0.0) -> None:
        self.now += seconds + waited
        self.waited += waited


_clock = FakeClock()


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    global _clock
    _clock = FakeClock()
    fake = types.SimpleNamespace(perf_counter=_clock.perf_counter)
    for module in (iteration_timer, hook_base, timestamps):  # step and phase times, the hooks' data time
        monkeypatch.setattr(module, "time", fake)
    monkeypatch.setattr(iteration_timer, "collective_seconds", _clock.collective_seconds)
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
        _clock.advance(STEP_SEC, waited=WAIT_SEC)
        loss = self.net(batch).square().mean()
        loss.register_hook(lambda grad: _clock.advance(BACKWARD_SEC))
        return loss

    @override
    def on_before_optimizer_step(self, optimizer):
        _clock.advance(OPTIMIZER_SEC)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class EndOfBatchWork(L.Callback):
    """After the timer: works ``HOOK_SEC`` at the end of each micro-batch and records the clock at the
    end of each iteration (a user's wall clock)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.ends.append(_clock.now)
        _clock.advance(HOOK_SEC)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("broadcast", [False, True])
def test_the_parts_of_an_iteration_add_up_to_its_wall_time(accumulate, broadcast, monkeypatch):
    if broadcast:  # the fast ranks wait there for a slow one: a collective's wait, not data
        broadcast_sigterm_flag(monkeypatch, lambda: _clock.advance(SYNC_SEC))
    collector = Collector(regex="Timing/.*")
    timer, work = IterationTimer(warmup_iter=2), EndOfBatchWork()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8,
        accumulate_grad_batches=accumulate,
        callbacks=[timer, work],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    k, sync = accumulate, SYNC_SEC if broadcast else 0.0
    # Per iteration (micro-batches summed), exact: the times are sums of binary fractions. The later
    # callback's work at the end of a micro-batch is in the wait before the next one: data time.
    expected = {
        "data": k * (DATA_SEC + HOOK_SEC),
        "forward": k * (STEP_SEC + WAIT_SEC + sync),
        "backward": k * BACKWARD_SEC,
        "optimizer": OPTIMIZER_SEC,
        "collective": k * (WAIT_SEC + sync),
        "compute": k * (STEP_SEC + BACKWARD_SEC) + OPTIMIZER_SEC,
    }
    expected["iteration"] = sum(expected[p] for p in ("data", "forward", "backward", "optimizer"))
    assert expected["iteration"] == expected["data"] + expected["compute"] + expected["collective"]
    for part, seconds in expected.items():
        name = f"Timing/{part}_sec"
        assert collector.num(name) == 6, name  # warm-up excluded
        assert collector.min(name) == collector.max(name) == seconds, name
    # The iteration is the wall time between the ends of consecutive iterations.
    assert {b - a for a, b in itertools.pairwise(work.ends)} == {expected["iteration"]}
    assert timer.timed_iters == 6
    assert timer.timed_seconds == 6 * expected["iteration"]
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)  # the loop's own again
    lines = timer.summary.splitlines()
    assert lines[0] == f"Overall training speed: 6 iterations in 0:00:00 ({expected['iteration']:.4f} s / it)"
    assert lines[1] == "Total training time: 0:00:00 (0:00:00 on hooks)"  # hooks took no (fake) time


class ValidatedModule(SlowModule):
    """Validation runs of one batch, each ``VAL_SEC`` (a fake clock's)."""

    @override
    def validation_step(self, batch, batch_idx):
        _clock.advance(VAL_SEC)

    @override
    def val_dataloader(self):
        return DataLoader(torch.zeros(2, 4), batch_size=2)


VAL_SEC = 2.0**-3  # per validation run


def test_a_validation_run_between_the_micro_batches_of_an_iteration_is_not_its_time():
    # Validation every 3 batches, 2 micro-batches an iteration: every other run lands inside an
    # iteration, between its micro-batches. It is neither data time nor the iteration's time in the
    # summary (it counted there, doubling the s / it of this job), but "hooks" time.
    collector = Collector(regex="Timing/iteration_sec")
    timer = IterationTimer(warmup_iter=1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, accumulate_grad_batches=2, val_check_interval=3,
        num_sanity_val_steps=0, callbacks=[timer], enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(ValidatedModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    iteration = 2 * (DATA_SEC + STEP_SEC + WAIT_SEC + BACKWARD_SEC) + OPTIMIZER_SEC
    assert collector.min("Timing/iteration_sec") == collector.max("Timing/iteration_sec") == iteration
    assert timer.timed_iters == 5 and timer.timed_seconds == 5 * iteration
    assert timer.summary.splitlines()[0].endswith(f"({iteration:.4f} s / it)")


class CancellingModule(SlowModule):
    """Cancels batch 3 of each epoch (-1 from its ``on_train_batch_start``, which Lightning calls after
    the callbacks'), and works ``VAL_SEC`` at each epoch's end."""

    @override
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 3 else None

    @override
    def on_train_epoch_end(self):
        _clock.advance(VAL_SEC)


def test_a_batch_the_module_cancelled_is_not_the_next_iterations_time():
    # The cancelled batch's start began an iteration that the next epoch's first batch continued: its
    # forward_sec ran from the cancelled batch across the epoch's end (VAL_SEC more).
    collector = Collector(regex="Timing/.*")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=3, callbacks=[IterationTimer(warmup_iter=0)], enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(CancellingModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    assert collector.num("Timing/forward_sec") == 9  # 3 batches an epoch ran
    assert collector.max("Timing/forward_sec") == STEP_SEC + WAIT_SEC
    iteration = DATA_SEC + STEP_SEC + WAIT_SEC + BACKWARD_SEC + OPTIMIZER_SEC
    assert collector.max("Timing/iteration_sec") == iteration


SAVE_SEC = 2.0**-2  # per checkpoint save


class SlowCheckpoint(L.Callback):
    """A checkpoint saved at the end of each validation run, ``SAVE_SEC`` (as ``ModelCheckpoint``, which
    Lightning runs after every other callback)."""

    def on_validation_end(self, trainer, pl_module):
        trainer.save_checkpoint(trainer.default_root_dir + "/last.ckpt")
        _clock.advance(SAVE_SEC)


def test_a_checkpoint_saved_after_validation_is_not_data_time(tmp_path):
    # The save ran after the timer's on_validation_end: it was booked as the next batch's wait for
    # data (a rank-zero save then named rank zero slow in its data). The batch Lightning fetches after
    # the save is not told apart from it: that iteration's data time is 0.
    collector = Collector(regex="Timing/data_sec")
    timer = IterationTimer(warmup_iter=1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=7, val_check_interval=3, num_sanity_val_steps=0,
        default_root_dir=tmp_path, callbacks=[timer, SlowCheckpoint()], enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(ValidatedModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    assert collector.num("Timing/data_sec") == 6  # iterations 2 to 7; saves after 3 and 6
    assert (collector.min("Timing/data_sec"), collector.max("Timing/data_sec")) == (0.0, DATA_SEC)
    iteration = DATA_SEC + STEP_SEC + WAIT_SEC + BACKWARD_SEC + OPTIMIZER_SEC
    assert timer.timed_seconds == 6 * iteration - 2 * DATA_SEC  # the saves count as hooks


class ManualEveryOtherBatch(SlowModule):
    """Manual optimization stepping every other batch (Lightning's documented way to accumulate)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    @override
    def training_step(self, batch, batch_idx):
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()


def test_manual_optimization_stepping_every_other_batch_warms_up_in_iterations():
    # Lightning's step counter moves every batch under manual optimization: the warm-up ended after one
    # iteration instead of 3, the first timed iteration held one micro-batch, the summary no total.
    collector = Collector(regex="Timing/iteration_sec")
    timer = IterationTimer(warmup_iter=3)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=6, callbacks=[timer], enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(ManualEveryOtherBatch(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    iteration = 2 * (DATA_SEC + STEP_SEC + WAIT_SEC + BACKWARD_SEC) + OPTIMIZER_SEC
    assert collector.num("Timing/iteration_sec") == timer.timed_iters == 3
    assert collector.min("Timing/iteration_sec") == collector.max("Timing/iteration_sec") == iteration
    assert timer.timed_seconds == 3 * iteration


def test_a_plain_loop_accumulating_books_every_micro_batch_as_forward():
    # Without on_before_backward (a HookRunner), the second and third micro-batches' forward and
    # backward came after the first after_backward: they were booked as optimizer time.
    collector = Collector(regex="Timing/.*")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with HookRunner([IterationTimer(warmup_iter=1)], model) as runner:
        for _ in range(3):
            runner.before_step()
            for _ in range(3):  # micro-batches
                _clock.advance(STEP_SEC)
                model(torch.ones(2, 4)).sum().backward()
                _clock.advance(BACKWARD_SEC)
                runner.after_backward()
            _clock.advance(OPTIMIZER_SEC)
            optimizer.step()
            optimizer.zero_grad()
            runner.after_step()
    collector.update()
    assert collector.num("Timing/forward_sec") == 2
    assert collector.max("Timing/forward_sec") == 3 * (STEP_SEC + BACKWARD_SEC)
    assert collector.max("Timing/optimizer_sec") == OPTIMIZER_SEC


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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_plain_loop_logs_the_summary_on_rank_zero_only(rank, caplog, monkeypatch):
    # Under a HookRunner in workers torch.multiprocessing started, Lightning's rank_zero_info does not
    # know the rank (no RANK variable): every rank logged the summary.
    monkeypatch.setattr(HookRunner, "global_rank", property(lambda self: rank))
    timer, model = IterationTimer(warmup_iter=0), nn.Linear(3, 1)
    with caplog.at_level("INFO"), HookRunner([timer], model) as runner:
        for _ in range(2):
            runner.before_step()
            runner.after_step(model(torch.ones(3)).sum())
    assert "Total training time" in timer.summary
    assert ("Total training time" in caplog.text) == (rank == 0)


@pytest.mark.parametrize(
    ("bad", "error", "got"),
    [(-1, ValueError, "-1"), (1.5, TypeError, r"1\.5 \(float\)"), (True, TypeError, r"True \(bool\)"),
     ("3", TypeError, r"'3' \(str\)")],
)  # fmt: skip
def test_bad_warmup(bad, error, got):
    with pytest.raises(error, match=rf"^IterationTimer: `warmup_iter` must be an int >= 0, got {got}$"):
        IterationTimer(warmup_iter=bad)


class _TimedTimer(IterationTimer):
    """An IterationTimer that measures the time spent inside its own Lightning hooks (``inside``) and
    reads the clock as its ``on_train_batch_end`` returns (``ends``: a user's wall clock)."""

    def __init__(self, warmup_iter: int) -> None:
        super().__init__(warmup_iter)
        self.inside, self.ends = 0.0, []

    def _timed_call(self, name, *args):
        start = time.perf_counter()
        getattr(super(), name)(*args)
        end = time.perf_counter()
        self.inside += end - start
        return end

    def on_train_batch_start(self, *args):
        self._timed_call("on_train_batch_start", *args)

    def on_before_backward(self, *args):
        self._timed_call("on_before_backward", *args)

    def on_after_backward(self, *args):
        self._timed_call("on_after_backward", *args)

    def on_train_batch_end(self, *args):
        self.ends.append(self._timed_call("on_train_batch_end", *args))


def test_the_iterations_add_up_to_the_wall_clock(monkeypatch):
    monkeypatch.undo()  # the real clock
    collector = Collector(regex="Timing/iteration_sec")
    timer = _TimedTimer(warmup_iter=3)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=30,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(SlowModule(), DataLoader(SlowDataset(), batch_size=2))
    collector.update()
    timed = collector.num("Timing/iteration_sec") * collector.mean("Timing/iteration_sec")
    wall = timer.ends[-1] - timer.ends[2]  # from the end of the warm-up to the end of training
    # What the iterations leave out of the wall time between their ends is the timer's own work
    # between its clock readings, all inside its hooks: the difference is at most the time in them.
    assert abs(wall - timed) <= timer.inside, (wall, timed, timer.inside)
    print(f"wall {wall:.6f} s, iterations {timed:.6f} s, inside the timer {timer.inside:.6f} s")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for event timing")
def test_cuda_events_reported_lazily():
    collector = Collector(regex="Timing/.*")
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
    parts = ("data", "forward", "backward", "optimizer", "compute", "collective", "iteration")
    assert all(collector.num(f"Timing/{part}_sec") == 4 for part in parts)  # the rest read at after_train
    assert collector.min("Timing/iteration_sec") > 0
    # The collective waits come from collective_seconds() (the fake clock here: WAIT_SEC a training_step),
    # not from events: exactly the module's wait in every iteration.
    assert collector.min("Timing/collective_sec") == collector.max("Timing/collective_sec") == WAIT_SEC


# ---------------------------------------------------------------------------------------------
# DDP: the rank slow in its backward (the fast ranks wait in DDP's gradient all-reduce) named
# ---------------------------------------------------------------------------------------------
SLOW_RANK, SLEEP = 1, 0.2  # HookRunner jobs: the rank sleeping in its backward, for so many seconds
EXTRA_SEC = 0.04  # Trainer jobs: the slow rank's sleep in its backward per step (issue 46's job)
EVERY, WARMUP, STEPS, BATCH = 5, 3, 80, 16  # 16 flushes
SLOW_FROM = 40  # Trainer jobs: quiet for 8 flushes, then the slow rank sleeps in its backward
LINE = re.compile(r"Straggler at iteration=(\d+): rank (\d+) \(host [^)]*\), (\S+) ")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 1))


def _sleep_in_backward(out: torch.Tensor, seconds: float) -> None:
    """Sleep ``seconds`` in the backward of ``out``, before any parameter's gradient is computed."""
    out.register_hook(lambda grad: time.sleep(seconds))


def _foreign_hook(state, bucket):  # no annotations: DDP refuses them as strings (future annotations)
    return allreduce_hook(state, bucket)


WAITS = "Timing/collective_sec"


def _runner_job(rank: int, world_size: int, hook: str, slow_in: str) -> tuple[float, float, list[str]]:
    """8 iterations of a DDP model (with BatchNorm buffers, which DDP broadcasts before each forward)
    under a HookRunner, rank SLOW_RANK sleeping ``SLEEP`` in its data, its backward or before its
    optimizer step (``slow_in``), with the timer's hook (``"timer"``), the user's own (``"own"``) or
    the user's wrapped in a timer (``"wrapped"``); this rank's mean compute and collective seconds,
    and the warnings."""
    torch.manual_seed(rank)
    model = DistributedDataParallel(_net())
    if hook != "timer":
        model.register_comm_hook(None, _foreign_hook if hook == "own" else DDPSyncTimer(_foreign_hook).hook)
    optimizer, collector = torch.optim.SGD(model.parameters(), lr=0.01), Collector(regex="Timing/.*")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with HookRunner([IterationTimer(warmup_iter=2)], model) as runner:
            for _ in range(8):
                if rank == SLOW_RANK and slow_in == "data":
                    time.sleep(SLEEP)
                runner.before_step()
                out = model(torch.randn(16, 32))
                if rank == SLOW_RANK and slow_in == "backward":
                    _sleep_in_backward(out, SLEEP)
                loss = out.square().mean()
                loss.backward()
                runner.after_backward()
                if rank == SLOW_RANK and slow_in == "optimizer":
                    time.sleep(SLEEP)  # the others wait in the next backward's all-reduce
                optimizer.step()
                optimizer.zero_grad()
                runner.after_step(loss)
    init_multiprocessing(rank=rank, sync_device=None)  # this rank's values: nothing reduced
    collector.update()
    return (
        *(collector.mean(n) if n in collector.names() else None for n in ("Timing/compute_sec", WAITS)),
        [str(w.message) for w in caught if "IterationTimer" in str(w.message)],
    )


@pytest.mark.smoke
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("hook", "slow_in"),
    [("timer", "backward"), ("wrapped", "backward"), ("timer", "optimizer"), ("timer", "data")],
)
def test_the_waits_in_ddps_synchronizations_leave_the_compute_time(hook, slow_in):
    (fast_compute, fast_waits, warned), (slow_compute, slow_waits, _) = run_distributed(
        _runner_job, 2, hook, slow_in, timeout=90
    )
    # The fast rank waits about SLEEP for the slow one: at the end of its backward (slow in its
    # backward), or in DDP's buffer broadcast at the start of its next forward (slow in its data or
    # optimizer step: 5 of the 6 timed iterations for the latter). Margins of SLEEP / 2 absorb the
    # scheduling of two processes.
    assert fast_waits > SLEEP / 2 > slow_waits, (fast_waits, slow_waits)
    if slow_in == "data":  # neither rank computes longer
        assert abs(slow_compute - fast_compute) < SLEEP / 2, (slow_compute, fast_compute)
    else:
        assert slow_compute - fast_compute > SLEEP / 2, (slow_compute, fast_compute)
    assert warned == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow_in", ["backward", "data"])
def test_a_users_own_comm_hook_is_left_alone_and_the_compute_time_not_reported(slow_in):
    # The fast rank's wait in DDP's all-reduce is not timed: it would count as its compute time, the
    # longest when the other rank is slow in its data, and TrainingStats would name the fast rank.
    (fast_compute, fast_waits, warned), (slow_compute, slow_waits, _) = run_distributed(
        _runner_job, 2, "own", slow_in, timeout=90
    )
    assert warned == [
        "IterationTimer: the DDP model has a communication hook of its own, so the waits in the model's "
        "synchronizations are not timed: Timing/compute_sec and Timing/collective_sec are not reported (a "
        "fast rank's wait would count as its compute, naming it the slowest rank). HINT: with DDP, register "
        "DDPSyncTimer(your_hook).hook (lightning_ext.distributed) instead."
    ]
    assert fast_compute is fast_waits is slow_compute is slow_waits is None


class _Data(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(4 * STEPS * BATCH, 32)  # one epoch on up to 4 ranks

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


class _Model(L.LightningModule):
    def __init__(self, slow_in: str) -> None:
        super().__init__()
        self.net, self.slow_in = _net(), slow_in

    def _slow(self, where: str) -> bool:
        return self.slow_in == where and self.global_step >= SLOW_FROM and self.global_rank == SLOW_RANK

    def training_step(self, batch, batch_idx):
        out = self.net(batch)
        if self._slow("backward"):
            _sleep_in_backward(out, EXTRA_SEC)  # the others wait in SyncBatchNorm's and DDP's all-reduce
        return out.square().mean()

    def on_before_optimizer_step(self, optimizer):
        if self._slow("optimizer"):  # the others wait in the next iteration's first collective:
            time.sleep(EXTRA_SEC)  # Lightning's (>= 2.5.2) SIGTERM broadcast before the fetch, else DDP's

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_Data(), batch_size=BATCH)


def _trainer_job(rank: int, world: int, sync_bn: bool, log_dir: str, slow_in: str, every: int) -> list[str]:
    """Train ``STEPS`` steps on ``world`` ranks (Lightning's ``"ddp"`` on the harness's workers),
    logging to a CSV file in ``log_dir``; what this rank logged (rank zero's straggler lines)."""
    trainer = ddp_trainer(
        rank,
        world,
        plugins=[SyncBatchNormPlugin()] if sync_bn else None,
        max_steps=STEPS,
        callbacks=[IterationTimer(warmup_iter=WARMUP), TrainingStats(every_n_train_steps=every)],
        logger=CSVLogger(log_dir, name="csv", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with rank_zero_output() as (logged, _):
        trainer.fit(_Model(slow_in))
    return logged


def run_job(tmp_path: Path, world: int, sync_bn: bool, slow_in: str = "backward", every: int = EVERY):
    """Train ``STEPS`` steps on ``world`` DDP ranks; the steps of the flushes' CSV rows and their
    straggler ranks, and the straggler lines ``(iteration, rank, name)`` printed on rank zero."""
    logged = run_distributed(_trainer_job, world, sync_bn, str(tmp_path), slow_in, every, timeout=200)
    assert all(lines == [] for lines in logged[1:])  # rank zero's lines only
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        key = "Timing/compute_sec/straggler_rank"
        rows = [(int(row["step"]), int(float(row[key]))) for row in csv.DictReader(f) if row.get(key)]
    return rows, [(int(i), int(r), name) for text in logged[0] for i, r, name in LINE.findall(text)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "sync_bn", "slow_in"), [(2, False, "backward"), (3, True, "backward"),
                                                           (2, False, "optimizer")])  # fmt: skip
def test_a_rank_slow_in_its_backward_is_named_and_a_quiet_job_names_nobody(tmp_path, world, sync_bn, slow_in):
    rows, lines = run_job(tmp_path, world, sync_bn, slow_in)
    assert [step for step, _ in rows] == list(range(EVERY - 1, STEPS, EVERY)), rows
    assert [line for line in lines if line[0] < SLOW_FROM] == [], (rows, lines)  # quiet: no line
    # Slow: its rank is the straggler of every flush, named from the second such flush (patience 2)
    # at nearly every flush then, and nobody else is.
    slow = [step for step, _ in rows if step >= SLOW_FROM]
    assert all(rank == SLOW_RANK for step, rank in rows if step in slow), rows
    named = [i for i, rank, name in lines if (rank, name) == (SLOW_RANK, "Timing/compute_sec")]
    assert len(named) == len(lines) and len(named) >= len(slow) - 3, (slow, lines)
    print(f"{world} ranks, SyncBatchNorm {sync_bn}, slow in its {slow_in}: named at {len(named)} of "
          f"{len(slow) - 1} flushes")  # fmt: skip


@pytest.mark.timeout(300)
def test_a_fast_ranks_wait_in_a_flush_after_a_slow_optimizer_step_is_no_data_time(tmp_path):
    # The fast ranks wait for one slow in its optimizer step in the first collective after the batch's
    # end: with a flush at that batch, its all-reduce; it was their data time, which named a fast rank
    # in Timing/data_sec at every flush
    rows, lines = run_job(tmp_path, 2, False, "optimizer", every=2)
    slow = [step for step, _ in rows if step >= SLOW_FROM]
    assert [line for line in lines if line[0] >= SLOW_FROM and line[1] != SLOW_RANK] == [], lines
    named = [i for i, rank, name in lines if (rank, name) == (SLOW_RANK, "Timing/compute_sec")]
    assert len(named) >= len(slow) - 3, (slow, lines)
