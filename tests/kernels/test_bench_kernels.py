"""``benchmarks/bench_kernels.py`` calls every CPU op by its contract, outside the package: its quick
run goes here, so that a changed contract fails a test instead of the next benchmark run (a row of an
older layout once kept the CPU section from being regenerated, and hid a slower kernel). Its guard
judges speed in full runs only: the quick run's short timings, beside the other tests, judge nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_kernel_benchmark_runs_every_op(tmp_path):
    results = tmp_path / "RESULTS.md"
    env = dict(os.environ, BENCH_RESULTS=str(results))
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--quick"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    written = results.read_text()
    for op in ("batch_norm_moments", "unscale_and_check_", "accumulate_moments_", "accumulate_histogram_"):
        assert f"| cpu | {op} | cpu |" in written, op
