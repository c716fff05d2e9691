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
import torch

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


def test_the_kernel_guard_fails_a_defer_rule_the_compiled_kernel_outgrew(monkeypatch, capsys):
    """The guard compares the automatic choice with ``reference``, and on a case the defer table sends to
    ``reference`` with the compiled kernel it bypasses: a slower automatic choice fails either way, each
    named with what beat it; one within the run's noise does not."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_kernels

    rows = [("batch_norm_moments", "(2, 8, 3, 3) float32 NCHW", 1.05e-3, 1.0e-3, 0.02, "reference")]
    monkeypatch.setattr(bench_kernels, "GUARD", rows)
    assert bench_kernels.check_guard() == 0  # 5 % slower: within the 10 % the guard allows
    rows.append(
        ("batch_norm_elemt", "(64, 64, 32, 32) float16 NCHW", 1.3e-3, 1.0e-3, 0.02, "the compiled kernel")
    )
    assert bench_kernels.check_guard() == 1
    out = capsys.readouterr().out
    assert "vs the compiled kernel on 1 its defer table sends to reference" in out
    assert (
        "SLOWER batch_norm_elemt (64, 64, 32, 32) float16 NCHW" in out
        and "the compiled kernel 1.0000 ms" in out
    )
    assert "SLOWER batch_norm_moments" not in out


def test_the_kernel_benchmark_times_each_deferred_case_against_the_compiled_kernel(monkeypatch):
    """A rule in the cpu backend's defer table needs its case in ``DEFERRED`` (the benchmark stops
    without one), which is timed on the automatic backend (the reference op there) and on the compiled
    kernel, for the guard."""
    from tests.helpers.cpu_extension import require_cpu_backend

    require_cpu_backend()
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_kernels

    from lightning_ext.kernels import cpu

    monkeypatch.setattr(bench_kernels, "MIN_RUN_TIME", 0.001)
    guard, rows = [], []
    monkeypatch.setattr(bench_kernels, "GUARD", guard)
    monkeypatch.setattr(bench_kernels, "ROWS", rows)
    rule = {"batch_norm_elemt": lambda x: x.dtype == torch.float16 and x.is_contiguous()}
    monkeypatch.setattr(cpu, "_DEFER_TO_REFERENCE", rule)
    backend = cpu.CpuBackend()  # built with the rule
    monkeypatch.setattr(bench_kernels, "get_backend", lambda *args, **kwargs: backend)
    with pytest.raises(SystemExit, match="DEFERRED covers"):
        bench_kernels.bench_deferred(copy_gbs=10.0)
    case = ("batch_norm_elemt", (64, 64, 32, 32), torch.float16)
    monkeypatch.setattr(bench_kernels, "DEFERRED", [case])
    try:
        bench_kernels.bench_deferred(copy_gbs=10.0)
    finally:
        monkeypatch.undo()
        cpu.CpuBackend()  # the live instance the custom ops find is one without the rule again
    ((op, label, auto_s, compiled_s, _, other),) = guard
    assert (op, label, other) == ("batch_norm_elemt", "(64, 64, 32, 32) float16 NCHW", "the compiled kernel")
    assert auto_s > 0 and compiled_s > 0
    assert [row[2] for row in rows] == ["cpu", "cpu, compiled"]
