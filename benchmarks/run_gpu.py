"""The CUDA tests and the GPU sections of the benchmarks, on a machine with a CUDA GPU (``make bench-gpu``).

Runs, each in its own process and in this order: ``pytest -m cuda`` over ``tests`` (every test marked
``cuda``, ``tests/kernels/test_cuda.py`` among them), the main job on one GPU for two epochs
(``python -m examples.digits --accelerator gpu --devices 1``, its run in ``runs/digits_gpu``),
``bench_kernels.py --gpu-only``,
``bench_syncbn.py --gpu-only``, ``bench_loss_scaling.py --device cuda`` and ``bench_mfu_gpu.py``. The
benchmarks print their tables and write their GPU sections of ``benchmarks/RESULTS.md``. Without
CUDA it says so and exits 0. The checkout is put on ``PYTHONPATH``, so any Python with a CUDA build of
torch, Triton, Lightning, torchmetrics and pytest runs it without installing the package.

Usage: ``python benchmarks/run_gpu.py [--quick] [--skip-tests] [--only NAME ...] [--timeout 1800]``;
``NAME`` is ``tests``, ``main_job``, ``kernels``, ``syncbn``, ``loss_scaling`` or ``mfu``; ``--quick`` passes
``--quick`` to the benchmarks (smoke run: they write only where ``$BENCH_RESULTS`` points). Exits
non-zero when a step failed, after running the others.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _common import run_each  # benchmarks/ is sys.path[0] when a script runs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PYTEST_NO_TESTS = 5  # pytest's exit status when it collected nothing
TEST_PATHS = ("tests/kernels/test_cuda.py", "tests")  # pytest collects a file named twice once
MAIN_JOB_ARGS = "--accelerator gpu --devices 1 --max-epochs 2 --min-accuracy 0 --name digits_gpu".split()


def steps(quick: bool) -> dict[str, list[str]]:
    """Step name -> command (run from the repository root)."""
    flag = ["--quick"] if quick else []
    py = sys.executable
    return {
        "tests": [py, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q", "-rfE", *TEST_PATHS],
        "main_job": [py, "-m", "examples.digits", *MAIN_JOB_ARGS],
        "kernels": [py, str(HERE / "bench_kernels.py"), "--gpu-only", *flag],
        "syncbn": [py, str(HERE / "bench_syncbn.py"), "--gpu-only", *flag],
        "loss_scaling": [py, str(HERE / "bench_loss_scaling.py"), "--device", "cuda", *flag],
        "mfu": [py, str(HERE / "bench_mfu_gpu.py"), *flag],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks")
    parser.add_argument("--skip-tests", action="store_true", help="only the main job and the benchmarks")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these steps")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            "run_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False): no CUDA test or GPU "
            "benchmark was run. The CPU benchmarks: `make bench`."
        )
        return 0
    commands = steps(args.quick)
    if args.only:
        unknown = set(args.only) - set(commands)
        if unknown:
            parser.error(f"unknown step(s) {sorted(unknown)}; have {list(commands)}")
        commands = {k: v for k, v in commands.items() if k in args.only}
    if args.skip_tests:
        commands.pop("tests", None)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True
    )
    return run_each(commands, ROOT, env=env, timeout=args.timeout, accepted={"tests": {PYTEST_NO_TESTS}})


if __name__ == "__main__":
    raise SystemExit(main())
