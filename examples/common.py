"""What the example jobs share: the launch options, the loggers, the metrics CSV, the progress bar."""

from __future__ import annotations

import argparse
import csv
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override


def add_run_args(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the options of every job: where it runs (accelerator, devices per node, nodes, strategy),
    the seed, and where it writes (``<root>/<name>/``, ``name`` being the default run name)."""
    parser.add_argument("--accelerator", default="cpu", help="cpu | gpu | auto (default: cpu)")
    parser.add_argument("--devices", type=int, default=2, help="processes/GPUs per node (default: 2)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (torchrun/SLURM launches)")
    parser.add_argument("--strategy", default=None, help="default: ddp when several processes, else auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default="runs", help="directory for runs (default: runs)")
    parser.add_argument("--name", default=name, help="run name: logs in <root>/<name>/")


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit through ``parser.error`` unless each integer option in ``names`` (dest names) is >= 1."""
    for name in ("devices", "num_nodes", *names):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def start_run(args: argparse.Namespace) -> Path:
    """Seed everything with ``args.seed``, quiet the dependencies' warnings, create and return the
    run directory ``<root>/<name>``."""
    quiet_dependency_warnings()
    L.seed_everything(args.seed, workers=True)
    run_dir = Path(args.root) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def loggers(run_dir: Path, resume: bool = False) -> list[Any]:
    """CSV logs in ``run_dir``; TensorBoard logs in ``run_dir/tensorboard`` when it is installed.

    Lightning's ``CSVLogger`` deletes the ``metrics.csv`` it finds: a resumed run (``resume``) first
    keeps the earlier launches' as ``metrics-<k>.csv``, a fresh one drops those (:func:`metrics_files`)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    _keep_earlier_launches(run_dir, resume)
    loggers: list[Any] = [CSVLogger(run_dir, name="", version="")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        loggers.append(TensorBoardLogger(run_dir, name="", version="tensorboard"))
    return loggers


def metrics_files(run_dir: Path) -> list[Path]:
    """The run's CSV logs in launch order: the earlier launches' ``metrics-<k>.csv`` (kept by a resume),
    then ``metrics.csv``."""
    earlier = sorted(run_dir.glob("metrics-*.csv"), key=lambda path: int(path.stem.split("-")[1]))
    return earlier + [path for path in [run_dir / "metrics.csv"] if path.is_file()]


@rank_zero_only
def _keep_earlier_launches(run_dir: Path, resume: bool) -> None:
    earlier = [path for path in metrics_files(run_dir) if path.name != "metrics.csv"]
    if not resume:  # a new run in the directory: no launch of an earlier one in its logs
        for path in earlier:
            path.unlink()
    elif (run_dir / "metrics.csv").is_file():
        (run_dir / "metrics.csv").rename(run_dir / f"metrics-{len(earlier) + 1}.csv")


def read_metrics_csv(*paths: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Read Lightning ``metrics.csv`` files (one run's launches, in order) into ``{column: [(step,
    value), ...]}`` (empty cells skipped)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(float(row.get("step") or 0))
                for key, value in row.items():
                    if key in ("step", "epoch") or value in (None, ""):
                        continue
                    series.setdefault(key, []).append((step, float(value)))
    return series


def quiet_dependency_warnings() -> None:
    """Filter the warnings that come from dependencies and that a user of a job cannot act on."""
    # Lightning's model summary knows no mixed precision (its own MixedPrecision warns alike).
    warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class ProgressBar(RichProgressBar):
    """Lightning's rich progress bar without the logger version (``v_num``), meaningless here."""

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
