"""``benchmarks/tune_unscale_gpu.py`` runs only on a GPU, which few sessions have: this runs it on
CPU in Triton's interpreter (tiny tensors, timings stubbed) so that the next GPU lease does not find
it broken, and so that its bit-for-bit checks of every kernel version against ATen's op run here too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import sys
sys.path.insert(0, {bench!r}); sys.path.insert(0, {root!r})
import tune_unscale_gpu as tu
tu.DEVICE = "cpu"
tu.SHAPES = [(64, 130)] * 3 + [(512,)] * 4 + [(8,)]
timed = []
def fake_time(fn, sets):
    for inputs in sets:
        fn(inputs)
    timed.append(fn)
    return 1e-3
tu.gpu_device_time = fake_time
tu._n_sets = lambda nbytes: 2
tu.copy_gbs = lambda: 3e12
tu.kernel_us = lambda fn, sets, reps=20: (fake_time(fn, sets), {{"kernel": 1.0}})[1]
tu.main()
print("timed", len(timed))
"""


@pytest.mark.timeout(120)
def test_tune_unscale_script_runs_in_the_interpreter():
    pytest.importorskip("triton")
    code = DRIVER.format(bench=str(ROOT / "benchmarks"), root=str(ROOT))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # Two dtypes x (4 reference rows + 5 launch configurations x 4 rows + 6 kernel-only rows).
    assert proc.stdout.strip().endswith("timed 60"), proc.stdout[-2000:]
    assert "v3 block 16384 warps 16 (no fill)" in proc.stdout
