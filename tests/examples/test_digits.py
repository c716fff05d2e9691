"""The main job end to end: 2 DDP processes on CPU, every feature on, then a resume."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.common import read_metrics_csv
from examples.digits import parse_args, plot_summary

ROOT = Path(__file__).resolve().parents[2]  # the repository, whose examples/ the jobs run from


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "examples.digits", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow  # a whole job in new processes
@pytest.mark.timeout(900)
def test_main_job_trains_on_two_processes_and_resumes(tmp_path):
    common = ["--root", str(tmp_path), "--name", "run", "--precise-bn-iters", "4"]
    first = _run(["--max-epochs", "3", "--min-accuracy", "0.85", *common], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout + first.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert "Overall training speed:" in out
    assert "Validation accuracy:" in out
    assert "Throughput (last interval):" in out and "; MFU " in out and "Goodput: " in out
    run_dir = tmp_path / "run"
    png = run_dir / "summary.png"
    assert png.is_file() and png.stat().st_size > 10_000
    with open(run_dir / "metrics.csv", newline="") as f:
        columns = set(next(csv.reader(f)))
    expected = ("Loss/train", "val/Accuracy", "AMP/loss_scale_log2", "AMP/overflow", "Timing/iteration_sec",
                "Grad/norm", "Grad/update_ratio", "Throughput/samples_per_sec", "Throughput/mfu",
                "Throughput/rank_samples_per_sec/min", "Goodput/goodput", "Goodput/restart_sec")  # fmt: skip
    for key in expected:
        assert key in columns, f"{key} missing from metrics.csv columns {sorted(columns)}"
    series = read_metrics_csv(run_dir / "metrics.csv")
    scale_log2 = [v for _, v in series["AMP/loss_scale_log2"]]
    assert scale_log2[0] < 20.0, "the scale starts at 2**20 and must back off from the first overflows"
    assert max(v for _, v in series["AMP/overflow"]) > 0
    assert (run_dir / "tensorboard").is_dir()
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()

    # Resume for one more epoch: the run continues from the checkpoint's step.
    resumed = _run(["--max-epochs", "4", "--min-accuracy", "0.85", "--resume", str(last), *common], tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    series = read_metrics_csv(run_dir / "metrics.csv")
    steps = [s for s, _ in series["Loss/train"]]
    assert max(steps) > 3 * 22, "the resumed run must train past the first run's last step"
    # Goodput carries on from the first launch: the resumed run books the time since the checkpoint
    # (the first run's end, the relaunch) as a restart.
    assert series["Goodput/restart_sec"][-1][1] > 0.0
    assert 0.0 < series["Throughput/mfu"][-1][1] < 1.0


@pytest.mark.slow  # a whole job in new processes
def test_accuracy_gate_exits_non_zero(tmp_path):
    # One epoch cannot reach 100% validation accuracy: the job must report failure.
    result = _run(
        [
            "--devices",
            "1",
            "--max-epochs",
            "1",
            "--min-accuracy",
            "1.01",
            "--precise-bn-iters",
            "0",
            "--precision",
            "bf16-mixed",
            "--no-plot",
            "--root",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "--min-accuracy" in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--max-epochs", "0"], "--max-epochs must be >= 1"),
        (["--resume", "/no/such.ckpt"], "no checkpoint file"),
        (["--precision", "fp8"], "invalid choice"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_plot_summary_reads_lightning_csv(tmp_path):
    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text(
        "epoch,step,Loss/train,AMP/loss_scale_log2,AMP/overflow\n"
        "0,5,2.0,19.0,0.2\n0,10,1.0,18.5,0.0\n0,10,,,\n"
    )
    series = read_metrics_csv(csv_path)
    assert series["Loss/train"] == [(5, 2.0), (10, 1.0)]
    png = plot_summary(csv_path, tmp_path / "summary.png")
    assert png.stat().st_size > 10_000
