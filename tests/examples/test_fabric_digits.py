"""The Fabric job end to end on 2 processes, a non-finite loss on one of them, and a skipped step.

The job with a non-finite loss runs the job's own ``build_fabric`` and ``train`` in the test
harness's 2 gloo workers, as under torchrun (Fabric starts no process there); the end-to-end test
starts the job's own processes.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import MixedPrecision

from examples.common import read_metrics_csv, start_run
from examples.digits import ConvNet, load_digits_tensors
from examples.fabric_digits import build_fabric, parse_args, train, training_step
from lightning_ext.amp import DynamicLossScaler
from lightning_ext.callbacks.hook_runner import HookRunner
from tests.helpers.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]  # the repository, whose examples/ the jobs run from


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # Fabric starts rank 1 as a child that inherits the pipes: this returns once both ranks exited.
    return subprocess.run(
        [sys.executable, *command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow  # a whole job in new processes
@pytest.mark.timeout(600)
def test_fabric_job_trains_on_two_processes(tmp_path):
    args = ["--max-epochs", "2", "--min-accuracy", "0.8", "--precise-bn-iters", "4"]
    result = _run(["-m", "examples.fabric_digits", *args, "--root", str(tmp_path)], tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert "Overall training speed:" in out  # IterationTimer's summary, driven by the HookRunner
    assert "Validation accuracy:" in out and "Traceback" not in out and "terminate called" not in out
    series = read_metrics_csv(tmp_path / "fabric_digits" / "metrics.csv")
    keys = ("Loss/train", "Accuracy/val", "AMP/loss_scale_log2", "LossMonitor/loss", "Timing/iteration_sec")
    for key in keys:
        assert key in series, f"{key} missing from metrics.csv: {sorted(series)}"
    # 2 epochs of 22 steps, rows of iteration i at step i (as a Trainer's self.log): the Collector
    # flushed every 5 iterations and after each validation, and LossMonitor wrote at its agreement
    # points (every 20 iterations) and at the end (at the number of iterations).
    assert [step for step, _ in series["Accuracy/val"]] == [21, 43]
    assert [step for step, _ in series["LossMonitor/loss"]] == [19, 39, 44]
    steps = [step for values in series.values() for step, _ in values]
    assert max(steps) == 44
    # The scale starts at 2**20: the first steps overflow, are skipped, and the scale backs off.
    assert series["AMP/loss_scale_log2"][0][1] < 20.0
    assert max(v for _, v in series["AMP/overflow"]) > 0


class _NanOnRank1(ConvNet):
    """Returns NaN logits from its 4th training forward (iteration 3) on rank 1 only."""

    def __init__(self) -> None:
        super().__init__(width=4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 4 and dist.get_rank() == 1:
                logits = logits * math.nan
        return logits


def _nan_on_rank1_job(rank: int, world_size: int, root: str) -> str:
    """The job (``build_fabric``, ``train``) as under torchrun: Fabric's DDP in the harness's process
    group, one epoch of ``_NanOnRank1``; what this rank's ``train`` raised."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    args = parse_args(["--max-epochs", "1", "--precise-bn-iters", "0", "--root", root])
    fabric = build_fabric(args, start_run(args))
    try:
        fabric.launch(train, args, _NanOnRank1())
    except FloatingPointError as err:
        return f"{type(err).__name__}: {err}"
    finally:
        for logger in fabric.loggers:
            logger.finalize("failed")
    return "no exception"


@pytest.mark.timeout(300)
def test_a_nan_loss_on_one_rank_stops_both_ranks(tmp_path):
    # LossMonitor's agreement point (iteration 19 of 22) raised on both ranks, naming the first
    # bad iteration and the rank that saw it; neither rank hung in a collective (the timeout).
    raised = run_distributed(_nan_on_rank1_job, 2, str(tmp_path), timeout=240)
    message = "FloatingPointError: Loss became infinite or NaN at iteration=3 on rank(s) [1]!"
    assert all(text.startswith(message) for text in raised), raised


def test_a_skipped_step_leaves_weights_and_lr_schedule_unchanged():
    # Fabric's MixedPrecision drives the DynamicLossScaler: at 2**30 the scaled fp16 gradients
    # overflow, the step is skipped and the scale halves (log2 schedule, decrement 1), until it fits.
    scaler = DynamicLossScaler("cpu", init_scale=2.0**30, schedule="log2", telemetry=False)
    fabric = L.Fabric(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    torch.manual_seed(0)
    net = ConvNet(width=4)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    images, labels = load_digits_tensors()[0].tensors
    batch = (images[:32], labels[:32])
    skipped = 0
    with HookRunner([], model) as runner:
        while True:
            weights = [p.detach().clone() for p in model.parameters()]
            lr, epoch, scale = optimizer.param_groups[0]["lr"], scheduler.last_epoch, scaler.get_scale()
            runner.before_step()
            loss = training_step(fabric, model, optimizer, scheduler, batch, runner)
            runner.after_step(loss)
            assert torch.isfinite(loss)  # the overflow is in the scaled gradients only
            if not scaler.last_step_skipped:
                break
            skipped += 1
            assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
            assert len(optimizer.state) == 0  # AdamW's moments and step count untouched
            assert (optimizer.param_groups[0]["lr"], scheduler.last_epoch) == (lr, epoch)
            assert scaler.get_scale() == scale / 2
    assert skipped >= 5 and scaler.skipped_steps == skipped and scaler.steps == skipped + 1
    # the first step taken moves the weights and the schedule, once
    assert not all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert scheduler.last_epoch == epoch + 1 and optimizer.param_groups[0]["lr"] == pytest.approx(lr / 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--devices", "0"], "--devices must be >= 1"), (["--width", "0"], "--width must be >= 1")],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
