import math
import re
import types
import weakref

import lightning as L
import pytest
import torch
from torch import nn
from typing_extensions import override

from lightning_ext import _clock as timestamps
from lightning_ext.callbacks import (
    HookBase,
    IterationTimer,
    LossMonitor,
    PreciseBN,
    ResourceStats,
    hook_base,
    iteration_timer,
)
from lightning_ext.callbacks.hook_runner import HookRunner
from lightning_ext.stats import Collector
from tests.helpers.hooks import one_iteration

# ---------------------------------------------------------------------------------------------
# A plain PyTorch loop driving the hooks
# ---------------------------------------------------------------------------------------------


def batches(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randn(n, 4, 3, generator=g))


def run_loop(runner, model, epochs=2, per_epoch=3, accumulate=1, loss_at=None, between_epochs=None):
    """The loop of HookRunner's docstring; ``loss_at(iteration, loss)`` may replace the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = batches(epochs * per_epoch * accumulate)
    with runner:
        for epoch in range(epochs):
            runner.before_epoch()
            for i in range(per_epoch):
                runner.before_step()
                losses = []
                for k in range(accumulate):
                    loss = model(data[(epoch * per_epoch + i) * accumulate + k]).square().mean()
                    (loss / accumulate).backward()
                    runner.after_backward()
                    losses.append(loss.detach())
                optimizer.step()
                optimizer.zero_grad()
                loss = torch.stack(losses).mean()
                if loss_at is not None:
                    loss = loss_at(runner.global_step, loss)
                runner.after_step(loss, is_last_batch=i + 1 == per_epoch)
            if between_epochs is not None:
                between_epochs()


class Recorder(HookBase):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.after_train_exceptions: list[BaseException | None] = []

    def before_train(self):
        assert isinstance(self.trainer, weakref.ProxyType)
        self.events.append(("before_train", self.iter, self.start_iter))

    def before_step(self):
        assert self.trainer.global_step == self.iter
        self.events.append(("before_step", self.iter))

    def after_backward(self):
        self.events.append(("after_backward", self.iter))

    def after_step(self):
        assert self.trainer.global_step == self.iter + 1
        self.events.append(("after_step", self.iter, self.trainer.is_last_batch))

    def after_train(self):
        self.events.append(("after_train", self.iter))
        self.after_train_exceptions.append(self.exception)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_call_order_and_iteration_counts(accumulate):
    hook, model = Recorder(), nn.Linear(3, 1)
    runner = HookRunner([hook], model)
    run_loop(runner, model, epochs=2, per_epoch=3, accumulate=accumulate)
    expected = [("before_train", 0, 0)]
    for it in range(6):
        last = it % 3 == 2
        expected += [("before_step", it)] + [("after_backward", it)] * accumulate
        expected += [("after_step", it, last)]
    expected += [("after_train", 6)]  # detectron2's: the iteration after the last one
    assert hook.events == expected
    assert hook.after_train_exceptions == [None]
    assert hook.pl_module is model and runner.global_step == 6
    assert (runner.global_rank, runner.world_size, runner.is_global_zero) == (0, 1, True)


class FailInAfterStep(HookBase):
    def after_step(self):
        if self.iter == 1:
            raise RuntimeError("boom in after_step")


class FailInAfterTrain(Recorder):
    def after_train(self):
        super().after_train()
        raise ValueError("after_train failed too")


def test_failure_notes_and_after_train_once_per_hook():
    first, failing_after_train, last = Recorder(), FailInAfterTrain(), Recorder()
    model = nn.Linear(3, 1)
    runner = HookRunner([first, FailInAfterStep(), failing_after_train, last], model)
    with pytest.raises(RuntimeError, match="boom in after_step") as info:
        run_loop(runner, model)
    notes = "\n".join(info.value.__notes__)
    assert "raised in hook FailInAfterStep.after_step() at iteration=1" in notes
    assert "FailInAfterTrain.after_train() also raised ValueError('after_train failed too')" in notes
    for hook in (first, failing_after_train, last):
        assert [e for e in hook.events if e[0] == "after_train"] == [("after_train", 1)]
        assert hook.after_train_exceptions == [info.value]
    # the failing iteration's after_step of later hooks never ran
    assert ("after_step", 1, False) in first.events and ("after_step", 1, False) not in last.events
    runner.after_train(info.value)  # once: a second call runs nothing
    assert len(first.after_train_exceptions) == 1


def test_after_train_raising_on_success_still_runs_the_others():
    failing, other = FailInAfterTrain(), Recorder()
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="after_train failed too") as info:
        run_loop(HookRunner([failing, other], model), model, epochs=1, per_epoch=2)
    assert "FailInAfterTrain.after_train() at iteration=2" in "\n".join(info.value.__notes__)
    assert failing.after_train_exceptions == [None]  # ran once, on the success path
    assert other.after_train_exceptions == [info.value]  # ran once, with the exception


class FailInBeforeStepAt3(HookBase):
    def before_step(self):
        if self.iter == 3:
            raise ValueError("boom in before_step")


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        ("before_step", 3),  # a hook raises in before_step at iteration 3
        ("loader", 4),  # the loop fails fetching the batch of iteration 4
        ("after_train", 5),  # after 5 iterations, the first hook's after_train raises
    ],
)
def test_every_hook_sees_the_driver_iteration_in_after_train(failure, expected):
    # One count for all hooks (detectron2's trainer.iter): the hooks after the one that failed, and
    # those after an after_train that raised, see the iteration the others see.
    first = FailInAfterTrain() if failure == "after_train" else Recorder()
    last = Recorder()
    hooks = [first, FailInBeforeStepAt3(), last] if failure == "before_step" else [first, last]
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    runner = HookRunner(hooks, model)
    error = OSError if failure == "loader" else ValueError
    with pytest.raises(error), runner:
        for i, x in enumerate(batches(5 if failure == "after_train" else 10)):
            if failure == "loader" and i == 4:
                raise OSError("cannot read the batch of iteration 4")  # before runner.before_step()
            one_iteration(runner, model, optimizer, x)
    for hook in (first, last):
        assert [e for e in hook.events if e[0] == "after_train"] == [("after_train", expected)]
    assert runner.iter == expected


class FailInBeforeTrain(Recorder):
    def before_train(self):
        raise OSError("cannot start")


def test_failure_in_before_train_ends_the_started_hooks():
    first, failing, never = Recorder(), FailInBeforeTrain(), Recorder()
    runner = HookRunner([first, failing, never], nn.Linear(3, 1))
    with pytest.raises(OSError, match="cannot start") as info, runner:
        pytest.fail("the body must not run")
    assert "FailInBeforeTrain.before_train() at iteration=0" in "\n".join(info.value.__notes__)
    assert first.after_train_exceptions == [info.value] and failing.after_train_exceptions == [info.value]
    assert never.events == []  # never started, never ended


def test_calls_out_of_order_raise():
    runner = HookRunner([Recorder()], nn.Linear(3, 1))
    with pytest.raises(RuntimeError, match=r"HookRunner.before_step\(\) called outside before_train"):
        runner.before_step()
    runner.before_train()
    with pytest.raises(RuntimeError, match=r"HookRunner.after_step\(\) called outside an iteration"):
        runner.after_step()
    runner.before_step()
    with pytest.raises(RuntimeError, match=r"HookRunner.before_step\(\) called inside an iteration"):
        runner.before_step()
    with pytest.raises(RuntimeError, match=r"HookRunner.before_train\(\) called twice"):
        runner.before_train()
    runner.after_step()
    runner.after_train()


@pytest.mark.parametrize(
    ("hooks", "kwargs", "error", "match"),
    [
        ([object()], {}, TypeError, r"`hooks` must hold HookBase instances, got <object"),
        (["twice"], {}, ValueError, r"each hook may be given once"),
        ([], {"module": "net"}, TypeError, r"`module` must be a torch.nn.Module, got 'net'"),
    ],
)
def test_bad_arguments(hooks, kwargs, error, match):
    if hooks == ["twice"]:
        hook = Recorder()
        hooks = [hook, hook]
    with pytest.raises(error, match=match):
        HookRunner(hooks, kwargs.get("module", nn.Linear(3, 1)))


class Counter(HookBase):
    def __init__(self, increment: int) -> None:
        super().__init__()
        self.increment, self.count = increment, 0

    def after_step(self):
        self.count += self.increment

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        self.count = state_dict["count"]


def test_state_dict_round_trip_continues_the_iterations():
    model = nn.Linear(3, 1)
    first = HookRunner([Counter(1), Counter(10)], model)
    run_loop(first, model, epochs=1, per_epoch=3)
    state = first.state_dict()
    assert state == {
        "global_step": 3,
        "hooks": {"Counter{'index': 0}": {"count": 3}, "Counter{'index': 1}": {"count": 30}},
    }
    a, b, recorder = Counter(1), Counter(10), Recorder()
    resumed = HookRunner([a, b, recorder], model)
    resumed.load_state_dict(state)
    run_loop(resumed, model, epochs=1, per_epoch=2)
    assert (a.count, b.count, a.start_iter, resumed.global_step) == (5, 50, 3, 5)
    assert recorder.events[0] == ("before_train", 3, 3) and recorder.events[-1] == ("after_train", 5)


# ---------------------------------------------------------------------------------------------
# IterationTimer: data and step time on a fake clock (exact whatever the machine's load)
# ---------------------------------------------------------------------------------------------


def test_iteration_timer_data_time_step_time_and_summary(monkeypatch, caplog):
    now = [1000.0]
    for module in (iteration_timer, hook_base, timestamps):  # step and phase times, the hooks' data time
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    data_sec, step_sec, validation_sec = 2.0**-5, 2.0**-6, 4.0

    class TimedModel(nn.Linear):
        def forward(self, x):
            now[0] += step_sec
            return super().forward(x)

    collector = Collector(regex="Timing/.*")
    timer, model = IterationTimer(warmup_iter=2), TimedModel(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with caplog.at_level("INFO"), HookRunner([timer], model) as runner:
        for _epoch in range(2):
            runner.before_epoch()
            for x in batches(4):
                now[0] += data_sec  # fetching the batch
                one_iteration(runner, model, optimizer, x)
            now[0] += validation_sec  # epoch-boundary work: neither data nor step time
    collector.update()
    assert collector.num("Timing/data_sec") == collector.num("Timing/iteration_sec") == 6  # warm-up
    for stat in ("min", "max"):
        assert getattr(collector, stat)("Timing/data_sec") == data_sec, stat
        assert getattr(collector, stat)("Timing/iteration_sec") == data_sec + step_sec, stat
    assert (timer.timed_iters, timer.timed_seconds) == (6, 6 * (data_sec + step_sec))
    lines = timer.summary.splitlines()
    assert lines[0] == f"Overall training speed: 6 iterations in 0:00:00 ({data_sec + step_sec:.4f} s / it)"
    assert lines[1] == "Total training time: 0:00:08 (0:00:08 on hooks)"  # the two validations
    assert lines[0] in caplog.text


# ---------------------------------------------------------------------------------------------
# LossMonitor: the loss comes through after_step
# ---------------------------------------------------------------------------------------------


class RecordingLogger:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.records.append((step, dict(metrics)))


class TinyLightningModule(L.LightningModule):
    """A LightningModule (automatic_optimization=True) used in a plain loop, as a Fabric user may."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    @override
    def forward(self, x):
        return self.net(x)


def test_loss_monitor_means_from_a_reused_loss_buffer():
    # The loss handed to after_step is copied: overwriting the same tensor at the next iteration
    # (here a reused buffer) must not change the kept values; the loss is the one given (no
    # division by Lightning's accumulate_grad_batches), also for a LightningModule.
    logger, monitor, model = RecordingLogger(), LossMonitor(every_n_train_steps=3), TinyLightningModule()
    buffer, aux, seen = torch.zeros(()), torch.zeros(()), []

    def reuse(step, loss):
        buffer.copy_(loss)
        aux.fill_(step)
        seen.append((loss.item(), float(step)))
        return {"loss": buffer, "loss_aux": aux}

    runner = HookRunner([monitor], model, loggers=[logger])
    run_loop(runner, model, epochs=2, per_epoch=3, accumulate=2, loss_at=reuse)
    seen = torch.tensor(seen, dtype=torch.float64)
    assert [step for step, _ in logger.records] == [2, 5]  # the step of iterations 2 and 5
    for (_, metrics), lo in zip(logger.records, [0, 3]):
        assert metrics["LossMonitor/loss"] == pytest.approx(seen[lo : lo + 3, 0].mean().item(), rel=1e-6)
        assert metrics["LossMonitor/loss_aux"] == pytest.approx(seen[lo : lo + 3, 1].mean().item())
    assert runner.callback_metrics["LossMonitor/loss"].item() == pytest.approx(seen[3:, 0].mean().item())


def test_loss_monitor_rows_share_the_loop_rows_steps():
    # The loop logs iteration i's row at step runner.iter (= i), as a Trainer's self.log does;
    # LossMonitor writes the iterations it averaged at the step of the last of them, and the rest at
    # after_train at the iterations run: one logger, steps never going backwards.
    logger, model = RecordingLogger(), nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with HookRunner([LossMonitor(every_n_train_steps=2)], model, loggers=[logger]) as runner:
        for x in batches(7):
            log = lambda loss: logger.log_metrics({"loop/loss": loss.item()}, step=runner.iter)
            one_iteration(runner, model, optimizer, x, before_after_step=log)
    steps = [step for step, _ in logger.records]
    assert steps == sorted(steps)
    assert [step for step, m in logger.records if "LossMonitor/loss" in m] == [1, 3, 5, 7]
    assert [step for step, m in logger.records if "loop/loss" in m] == list(range(7))


@pytest.mark.parametrize(("every_n_train_steps", "raised_at"), [(1, 2), (4, 3)])
def test_loss_monitor_raises_on_a_non_finite_loss(every_n_train_steps, raised_at):
    recorder, model = Recorder(), nn.Linear(3, 1)
    runner = HookRunner([LossMonitor(every_n_train_steps=every_n_train_steps), recorder], model)
    nan_at_2 = lambda step, loss: loss * math.nan if step == 2 else loss
    with pytest.raises(
        FloatingPointError, match=r"NaN at iteration=2 on rank\(s\) \[0\]!\nloss_dict = "
    ) as e:
        run_loop(runner, model, epochs=2, per_epoch=3, loss_at=nan_at_2)
    assert f"LossMonitor.after_step() at iteration={raised_at}" in "\n".join(e.value.__notes__)
    assert recorder.after_train_exceptions == [e.value]


def _monitors_at_other_periods(rank: int, world_size: int) -> str:
    """A plain loop on every rank, with a LossMonitor agreeing every 2 iterations on rank 0 and every 3
    on the others: their first agreement points meet at iterations 1 and 2."""
    model = nn.Linear(3, 1)
    runner = HookRunner([LossMonitor(every_n_train_steps=2 if rank == 0 else 3)], model)
    with pytest.raises(RuntimeError) as e:
        run_loop(runner, model, epochs=1, per_epoch=6)
    return str(e.value)


def test_a_loss_monitor_agreeing_at_another_iteration_raises_on_every_rank():
    """HookRunner's iteration is the step of LossMonitor's agreement point: ranks at different
    iterations raise on every rank, naming the steps, instead of reducing each other's losses."""
    from tests.helpers.distributed import run_distributed

    for message in run_distributed(_monitors_at_other_periods, 2, timeout=120):
        assert re.search(r"the ranks disagree \(ranks \[0\]: Collector\(.*\) at step=1; ranks \[1\]: "
                         r"Collector\(.*\) at step=2\)", message), message  # fmt: skip


def test_hooks_check_what_they_need_from_the_runner_themselves():
    """The runner knows no hook class: LossMonitor says it needs the loss, PreciseBN a loader."""
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"pass it to `runner.after_step\(loss\)`"):
        run_loop(HookRunner([LossMonitor()], model), model, loss_at=lambda step, loss: None)
    recorder = Recorder()
    runner = HookRunner([recorder, PreciseBN()], model)  # no train_dataloader: fine until it starts
    with pytest.raises(ValueError, match=r"PreciseBN\(data_loader=None\) reads the training loader, but"):
        runner.before_train()
    assert len(recorder.after_train_exceptions) == 1  # the hook that started was told


def test_resource_stats_reports_from_a_plain_module():
    # A plain nn.Module has no .device (a LightningModule's): the first report raised AttributeError.
    model, resources = nn.Linear(3, 1), ResourceStats(every_n_train_steps=1)
    run_loop(HookRunner([resources], model), model, epochs=1, per_epoch=1)
    assert resources.last_report["cpu_mem_gb"] > 0 and "peak_gpu_mem_gb" not in resources.last_report


# ---------------------------------------------------------------------------------------------
# PreciseBN: population statistics of the training loader
# ---------------------------------------------------------------------------------------------


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, momentum=0.1))


def population_stats(model: nn.Module, data: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        features = model[0](torch.cat(data)).double()
    return features.mean(0), features.var(0)  # unbiased, as BatchNorm's running_var


@pytest.mark.parametrize("last_batch_flag", [True, False])
def test_precise_bn_sets_population_statistics(last_batch_flag):
    model = bn_model()
    loader = [(x, torch.zeros(4)) for x in batches(5, seed=1)]  # tuple batches: model(batch[0])
    hook = PreciseBN(num_iter=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookRunner([hook], model, train_dataloader=loader) as runner:
        for i, (x, _) in enumerate(loader):
            one_iteration(runner, model, optimizer, x, is_last_batch=last_batch_flag and i + 1 == len(loader))
        # at the epoch's last iteration; without is_last_batch, at the end (the statistics are older)
        assert hook.batches_used == ([5] if last_batch_flag else [])
    assert hook.batches_used == [5]
    mean, var = population_stats(model, [x for x, _ in loader])
    bn = model[1]
    torch.testing.assert_close(bn.running_mean.double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert bn.momentum == 0.1 and model.training


def test_precise_bn_runs_under_fabric_autocast_and_writes_to_fabric_loggers():
    # With a Fabric, the runner moves PreciseBN's batches with fabric.to_device, runs its forwards
    # under fabric.autocast() and gives LossMonitor the Fabric's loggers.
    logger = RecordingLogger()
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", loggers=[logger])
    autocast = []

    def forward_fn(model, batch):
        autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return model(batch)

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    hooks = [PreciseBN(num_iter=2, forward_fn=forward_fn), LossMonitor(every_n_train_steps=2)]
    runner = HookRunner(hooks, model, fabric=fabric, train_dataloader=batches(3))
    assert runner.loggers == [logger]
    run_loop(runner, model, epochs=1, per_epoch=2)
    assert autocast == [(True, torch.bfloat16)] * 2
    assert [step for step, _ in logger.records] == [1]  # iteration 1


def test_throughput_in_a_plain_loop_is_refused_naming_what_to_use():
    # It was taken, then failed at the first after_step inside Lightning's batch-size inference
    # (MisconfigurationException: "We could not infer the batch_size...").
    from lightning_ext.callbacks import Throughput

    with pytest.raises(TypeError, match=r"Throughput needs a Lightning Trainer .* HINT: .*perf"):
        HookRunner([Throughput()], nn.Linear(2, 1))
