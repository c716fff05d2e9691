"""The ``cpu`` backend's build: both code paths in the binary, stale locks, the build notice, fallback.

Its ops are checked against ``reference`` with every other backend in ``test_batch_norm.py``,
``test_unscale.py`` and ``test_moments.py``.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import threading
import time
import warnings

import pytest
import torch

from lightning_ext.kernels import cpu, get_backend, registry
from tests.helpers.cpu_extension import require_cpu_backend


def test_loops_are_built_for_avx2_and_the_baseline():
    """The loops are compiled twice (GCC function multi-versioning: an x86-64-v3 clone, i.e. AVX2 and
    FMA, and a baseline one, picked by the CPU at load time), so a build shared by several machines
    runs on any x86-64 CPU."""
    if platform.machine() != "x86_64" or platform.system() != "Linux" or shutil.which("nm") is None:
        pytest.skip("multi-versioning applies to x86-64 Linux builds; needs nm to read the symbols")
    require_cpu_backend()
    compiler = os.environ.get("CXX", "c++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:  # the clones are a GCC attribute (see the .cpp)
        pytest.skip(f"built with {compiler} ({version.splitlines()[:1]}), not GCC")
    symbols = subprocess.run(["nm", "-C", cpu.load().__file__], capture_output=True, text=True, check=True)
    for kernel in ("channel_terms", "channel_affine", "rows_terms", "rows_affine", "moments_range"):
        lines = [line for line in symbols.stdout.splitlines() if f"{kernel}<" in line]
        assert any("[clone .arch_x86_64_v3]" in line for line in lines), kernel
        assert any("[clone .default]" in line for line in lines), kernel


def test_stale_build_lock_is_removed_and_a_fresh_one_waited_for(monkeypatch, tmp_path, caplog):
    """torch's build lock has no time limit: a lock left by a killed build must not hang later runs."""
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "_get_build_directory", lambda *a, **k: str(tmp_path))
    lock = tmp_path / "lock"
    cpu._clear_stale_lock()  # no lock: returns at once
    lock.write_text("")
    old = time.time() - cpu._STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        cpu._clear_stale_lock()
    assert "stale build lock" in caplog.text and not lock.exists()
    lock.write_text("")  # a build in progress: waited for until its lock goes
    threading.Timer(1.0, lock.unlink).start()
    start = time.perf_counter()
    cpu._clear_stale_lock()
    assert 0.9 < time.perf_counter() - start < 30


def test_a_build_in_progress_is_announced(monkeypatch, caplog):
    """A load that takes longer than a few seconds (a first build, ~30 s) says why the first use stalls;
    a cached load says nothing."""
    import torch.utils.cpp_extension

    monkeypatch.setattr(cpu, "_ANNOUNCE_AFTER_SECONDS", 0.2)
    monkeypatch.setattr(cpu, "_clear_stale_lock", lambda: None)
    for delay, announced in ((1.0, True), (0.0, False)):
        monkeypatch.setattr(cpu, "_module", None)
        module = object()
        monkeypatch.setattr(
            torch.utils.cpp_extension, "load", lambda d=delay, m=module, **kw: time.sleep(d) or m
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            assert cpu.load() is module
            time.sleep(0.3)  # a timer that was not cancelled would have fired by now
        assert ("building the compiled CPU kernels" in caplog.text) == announced


def test_a_failed_build_falls_back_to_reference_with_one_warning(monkeypatch):
    """Automatic selection on CPU takes ``reference`` when the build fails (one warning, not retried);
    asking for ``cpu`` by name raises."""
    import torch.utils.cpp_extension

    attempts = []

    def broken(**kwargs):
        attempts.append(kwargs["name"])
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_clear_stale_lock", lambda: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.reset()
    try:
        with pytest.warns(
            RuntimeWarning, match=r"'cpu' \(RuntimeError\('no compiler here'\)\).*using 'reference'"
        ):
            assert get_backend(device="cpu").name == "reference"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert get_backend(device="cpu").name == "reference"
        with pytest.raises(RuntimeError, match=r"kernel backend .cpu. .* failed to load"):
            get_backend("cpu", device="cpu")
        assert len(attempts) == 1
    finally:
        registry.reset()


def test_auto_selects_the_cpu_backend_on_cpu():
    require_cpu_backend()
    registry.reset()
    assert get_backend(device="cpu").name == "cpu"
    x = torch.randn(3, 2)
    assert get_backend(device="cpu").batch_norm_moments(x, torch.zeros(2)).dtype == torch.float64
