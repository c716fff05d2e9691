"""The main job end to end: 2 DDP processes on CPU, every feature on, then a resume that fails its
accuracy gate."""

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.common import metrics_files, read_metrics_csv
from examples.digits import parse_args, plot_summary

ROOT = Path(__file__).resolve().parents[2]  # the repository, whose examples/ the jobs run from


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "examples.digits", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
        # A narrow terminal: the summary lines must not wrap (rich wraps at COLUMNS by default).
        env={**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT), "COLUMNS": "60"},
    )


FIRST_EPOCHS = 2  # the first run's; the resumed run trains one more
GATE_LINE = re.compile(r"accuracy (\d\.\d+) < --min-accuracy 1\.01")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """The main job on 2 processes, then resumed from its last checkpoint for one more epoch with an
    accuracy gate it cannot pass (1.01): the run directory, the first run's ``metrics.csv`` (the
    resumed run writes its own) and the two finished processes. The resumed run draws no figure (the
    first one did)."""
    root = tmp_path_factory.mktemp("digits")
    common = ["--root", str(root), "--name", "run", "--precise-bn-iters", "4"]
    first = _run(["--max-epochs", str(FIRST_EPOCHS), "--min-accuracy", "0.85", *common], root)
    last, metrics = root / "run" / "checkpoints" / "last.ckpt", root / "first_metrics.csv"
    resumed = None
    if first.returncode == 0 and last.is_file():
        shutil.copyfile(root / "run" / "metrics.csv", metrics)
        resume = ["--max-epochs", str(FIRST_EPOCHS + 1), "--min-accuracy", "1.01", "--resume", str(last)]
        resumed = _run([*resume, "--no-plot", *common], root)
    return root / "run", metrics, first, resumed


@pytest.mark.slow  # a whole job in new processes
@pytest.mark.timeout(900)
def test_main_job_trains_on_two_processes_and_resumes(main_job):
    run_dir, first_metrics, first, resumed = main_job
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout + first.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert "Overall training speed:" in out
    assert "Validation accuracy:" in out
    throughput = r"^Throughput \(last interval\): \d+ samples/s, \d+ per device, ranks \d+-\d+; MFU [\d.]+%$"
    assert re.search(throughput, out, re.MULTILINE), out[-3000:]
    goodput = (  # the parts in the ledger's order, the start-up named
        r"^Goodput: [\d.]+% of the wall time since the first launch, productive [\d.]+ s, startup [\d.]+ s, "
        r".*, other -?[\d.]+ s$"
    )
    assert re.search(goodput, out, re.MULTILINE), out[-3000:]
    png = run_dir / "summary.png"
    assert png.is_file() and png.stat().st_size > 10_000
    with open(first_metrics, newline="") as f:
        columns = set(next(csv.reader(f)))
    expected = ("Loss/train", "val/Accuracy", "AMP/loss_scale_log2", "AMP/overflow", "Timing/iteration_sec",
                "Grad/norm", "Grad/update_ratio", "Throughput/samples_per_sec", "Throughput/mfu",
                "Throughput/rank_samples_per_sec/min", "Goodput/goodput", "Goodput/restart_sec")  # fmt: skip
    for key in expected:
        assert key in columns, f"{key} missing from metrics.csv columns {sorted(columns)}"
    series = read_metrics_csv(first_metrics)
    scale_log2 = [v for _, v in series["AMP/loss_scale_log2"]]
    assert scale_log2[0] < 20.0, "the scale starts at 2**20 and must back off from the first overflows"
    assert max(v for _, v in series["AMP/overflow"]) > 0
    assert (run_dir / "tensorboard").is_dir()
    # last.ckpt is the end of training whatever the accuracy did (the monitored one's stayed at the
    # best epoch: after a plateau a resume retrained epochs and booked them as a restart)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == FIRST_EPOCHS
    assert len(list((run_dir / "checkpoints").glob("best-*.ckpt"))) == 1

    # Resume for one more epoch: the run continues from the checkpoint's step, to an accuracy that
    # passes the first run's gate (its own, 1.01, no run passes: the test below).
    assert resumed is not None
    gate = GATE_LINE.search(resumed.stdout)
    assert gate and float(gate[1]) >= 0.85, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    series = read_metrics_csv(run_dir / "metrics.csv")
    steps = [s for s, _ in series["Loss/train"]]
    assert max(steps) > FIRST_EPOCHS * 22, "the resumed run must train past the first run's last step"
    # The first launch's CSV is kept (Lightning's CSVLogger deletes the metrics.csv it finds): the
    # summary figure of a resumed run draws every launch's steps.
    assert metrics_files(run_dir) == [run_dir / "metrics-1.csv", run_dir / "metrics.csv"]
    assert (run_dir / "metrics-1.csv").read_bytes() == first_metrics.read_bytes()
    whole = [s for s, _ in read_metrics_csv(*metrics_files(run_dir))["Loss/train"]]
    assert whole == sorted(whole) and min(whole) < FIRST_EPOCHS * 22 < max(whole)
    # Goodput carries on from the first launch: the resumed run books the time since the checkpoint
    # (the first run's end, the relaunch) as a restart.
    assert series["Goodput/restart_sec"][-1][1] > 0.0
    assert 0.0 < series["Throughput/mfu"][-1][1] < 1.0


@pytest.mark.slow  # a whole job in new processes
@pytest.mark.timeout(900)
def test_accuracy_gate_exits_non_zero(main_job):
    # The resumed run of the main job asks for 101% validation accuracy: the job must report failure.
    resumed = main_job[-1]
    assert resumed is not None, "the main job's first run failed (the test above says why)"
    assert resumed.returncode == 1, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert GATE_LINE.search(resumed.stdout) and "Traceback" not in resumed.stderr, resumed.stderr[-2000:]


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
