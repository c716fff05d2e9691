"""The GAN job end to end (2 DDP processes, per-optimizer fp16 scales, FID gate) and its parts."""

import csv
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import lightning_ext
from examples.gan import DigitsFeatures, GanModule, load_gan_digits, main, parse_args

ROOT = Path(__file__).resolve().parents[2]  # the repository, whose examples/ the jobs run from

# Epochs of the whole job: enough for its FID gate to tell a job that learns from one that does not.
# After 2 epochs the final FID is about 0.18x the initial one, well under the gate's 0.5x; a job whose
# networks do not learn (--lr 0) ends at about 0.83x and fails it.
EPOCHS = 2


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "examples.gan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
        # One intra-op thread per process: the two ranks would otherwise oversubscribe a 2-core machine.
        env={**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow  # a whole job in new processes
@pytest.mark.timeout(600)
def test_gan_job_trains_two_scales_and_passes_its_fid_gate(tmp_path):
    result = _run(["--max-epochs", str(EPOCHS), "--root", str(tmp_path), "--name", "run"], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert "FID:" in out
    run_dir = tmp_path / "run"
    for png in ("samples.png", "loss_scales.png"):
        assert (run_dir / png).stat().st_size > 10_000
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    with open(run_dir / "metrics.csv", newline="") as f:
        columns = set(next(csv.reader(f)))
    expected = [f"AMP/{n}/{k}" for n in ("G", "D") for k in ("loss_scale_log2", "overflow", "skipped_steps")]
    expected += ["Resources/cpu_mem_gb", "Throughput/samples_per_sec", "Goodput/goodput", "Loss/D", "Loss/G"]
    expected += ["Loss/R1"]
    expected += ["FID/start", "lr-Adam", "lr-Adam-1", "Timing/iteration_sec"]
    assert not [k for k in expected if k not in columns], sorted(columns)
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["LossScalingPrecision"]
    assert set(state["per_optimizer"]) == {"G", "D"}
    # Every batch steps D and G, every 4th D once more (R1): 14 batches per epoch on each rank.
    steps = {n: s["steps"] for n, s in state["per_optimizer"].items()}
    assert steps == {"G": EPOCHS * 14, "D": EPOCHS * (14 + 4)}


@pytest.mark.slow  # trains the FID's classifier and a GAN step
def test_fid_gate_exits_non_zero(tmp_path, capsys):
    """``main`` returns the status ``python -m examples.gan`` exits with: 1 when the gate fails.
    In this process, one batch per epoch (the gate cannot pass at 0.001x, however long the run)."""
    argv = ["--devices", "1", "--max-epochs", "1", "--batch-size", "1024", "--max-fid-ratio", "0.001"]
    try:
        with mock.patch.dict(os.environ):  # seed_everything sets PL_GLOBAL_SEED, PL_SEED_WORKERS
            status = main([*argv, "--no-plot", "--root", str(tmp_path)])
    finally:
        lightning_ext.reset()  # the callbacks' process-wide state
    assert status == 1
    assert "--max-fid-ratio" in capsys.readouterr().out


@pytest.mark.slow  # trains the FID's classifier to its accuracy
def test_feature_extractor_classifies_the_digits():
    images, labels = load_gan_digits()
    assert images.shape == (1797, 1, 8, 8) and images.min() == -1 and images.max() == 1
    extractor = DigitsFeatures()
    assert extractor.fit(images, labels) > 0.97
    assert extractor(images[:5]).shape == (5, DigitsFeatures.num_features)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "--devices must be >= 1"),
        (["--num-nodes", "0"], "--num-nodes must be >= 1"),
        (["--fid-samples", "0"], "--fid-samples must be >= 1"),
        (["--arch", "vit"], "invalid choice"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_default_architecture_follows_the_accelerator():
    assert parse_args([]).arch == "mlp"
    assert parse_args(["--accelerator", "gpu"]).arch == "conv"


@pytest.mark.parametrize("arch", ["mlp", "conv"])
def test_architectures_map_noise_to_digits_and_digits_to_logits(arch):
    model = GanModule(arch)
    images = model.sample(6, torch.Generator().manual_seed(0))
    assert images.shape == (6, 1, 8, 8) and images.abs().max() <= 1
    assert model.D(images).shape == (6, 1)


def test_the_loss_scale_figure_draws_a_shared_scale(tmp_path):
    # --shared-scale logs AMP/loss_scale_log2 and AMP/overflow (no G/ or D/): the figure was empty
    import matplotlib.image

    from examples.gan import plot_loss_scales

    def ink(columns: list[str]) -> float:
        path = tmp_path / f"{len(columns)}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", *columns])
            writer.writerows([[step, *[16.0 + step / 10] * len(columns)] for step in range(0, 20, 5)])
        pixels = matplotlib.image.imread(plot_loss_scales(path, tmp_path / f"{len(columns)}.png"))
        return float((pixels[..., :3].mean(-1) < 0.5).mean())  # the share of dark pixels

    assert ink(["AMP/loss_scale_log2", "AMP/overflow"]) > ink([]) + 1e-3
