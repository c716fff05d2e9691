"""The compiled CPU kernels of SyncBatchNorm (``lightning_ext.kernels.cpu_extension``) against its
pure-torch path (the ``reference`` backend's ATen ops).

Both paths compute the same thing, with different summation orders and rounding points: outputs,
input/weight/bias gradients and running statistics must agree to a few units in the last place of
their dtype, ``num_batches_tracked`` and the collectives exactly, over several training steps, for
every input rank, dtype and memory format, empty local batches, rows longer than a summation block,
more channels-last rows than one parallel task, ``momentum=None``, float64 modules and non-dense
upstream gradients. The group is simulated in one process by a ``_sum_over_group`` that adds a
fixed "other rank" to every all_reduce (its moments payload is a consistent one for any shift:
mean = shift, M2 > 0), so the global-count and correction arithmetic is exercised, not only the
one-rank case. The multi-process runs against one-process float64 BatchNorm are in
``tests/nn/test_sync_batch_norm.py`` (both paths).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lightning_ext.nn.sync_batch_norm as sbn
from lightning_ext.kernels import cpu_extension
from lightning_ext.nn import SyncBatchNorm
from tests.helpers.cpu_extension import require_cpu_extension

C = 3
OTHER_COUNT = 7.0  # elements per channel of the simulated other rank

# (shape, dtype, channels_last, momentum, affine, module dtype)
CASES = [
    ((5, C), torch.float32, False, 0.1, True, torch.float32),
    ((4, C, 7), torch.bfloat16, False, None, True, torch.float32),
    ((3, C, 5, 4), torch.float16, False, 0.1, False, torch.float32),
    ((3, C, 5, 4), torch.bfloat16, True, 0.1, True, torch.float32),
    ((2, C, 3, 2, 4), torch.float32, True, None, True, torch.float32),
    ((4, C, 2, 3), torch.float64, False, 0.1, True, torch.float64),
    ((8, C, 64, 48), torch.float32, False, 0.1, True, torch.float32),  # the two-pass float32 statistics
    ((0, C, 4, 4), torch.bfloat16, False, 0.1, True, torch.float32),  # empty on this rank
    ((0, C), torch.float32, False, None, True, torch.float32),
    ((1, C), torch.float32, False, 0.1, True, torch.float32),  # one value here, more in the group
    ((3, C, 4099), torch.float32, False, 0.1, True, torch.float32),  # rows longer than a 2048 block
    ((5, C, 9, 17), torch.bfloat16, True, 0.1, True, torch.float32),  # 765 rows: several row tasks
]

# Largest difference allowed between the two paths, relative to the largest magnitude of the
# tensor: a few units in the last place of its dtype (the paths round at different points). For
# float64 input the pure-torch path normalizes with float32 mean/invstd (ATen's convention), the
# compiled one with float64: float32 precision bounds the difference.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 2e-5, torch.float64: 1e-6}


def assert_paths_agree(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    if a.dtype == torch.int64 or a.numel() == 0:
        assert torch.equal(a, b), what
        return
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), what
    scale = b.double().abs().max().item()
    err = (a.double() - b.double()).abs().max().item()
    assert err <= TOLERANCE[a.dtype] * max(scale, 1e-6), (
        f"{what}: max difference {err:.3g} (scale {scale:.3g})"
    )


def _fake_group(monkeypatch, channels: int) -> list[str]:
    """Simulate a second rank: every all_reduce adds its fixed contribution; returns the call log."""
    g = torch.Generator().manual_seed(7)
    moments = torch.zeros(2 * channels + 1, dtype=torch.float64)
    moments[0] = OTHER_COUNT
    moments[channels + 1 :] = OTHER_COUNT * (0.5 + torch.rand(channels, generator=g, dtype=torch.float64))
    grad_sums = torch.randn(2 * channels, generator=g)
    calls: list[str] = []

    def sum_over_group(t, group):
        forward = t.numel() == 2 * channels + 1
        calls.append("moments" if forward else "grad_sums")
        other = moments if forward else grad_sums.to(t.dtype)
        return t.add_(other)  # in place, as torch.distributed.all_reduce

    monkeypatch.setattr(sbn, "_sum_over_group", sum_over_group)
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "get_world_size", lambda group=None: 2)
    return calls


def _train(case, compiled: bool, monkeypatch, steps: int = 3, dense_dy: bool = True):
    shape, dtype, channels_last, momentum, affine, module_dtype = case
    calls = _fake_group(monkeypatch, C)
    if not compiled:
        monkeypatch.setattr(SyncBatchNorm, "_cpu_extension", lambda self, ops: None)
    used = []
    original = SyncBatchNorm._forward_compiled
    monkeypatch.setattr(
        SyncBatchNorm, "_forward_compiled", lambda self, *a: used.append(1) or original(self, *a)
    )
    bn = SyncBatchNorm(C, momentum=momentum, affine=affine).to(module_dtype)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = (2.0 + 3.0 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        x.requires_grad_(True)
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        y = bn(x)
        if dense_dy:
            y.backward(dy)
        else:
            y.sum().backward()  # an expanded, stride-0 upstream gradient
        grads = [x.grad] + [p.grad.clone() for p in bn.parameters()]
        bn.zero_grad(set_to_none=True)
        out.append([y.detach(), *grads])
        if step == 0:
            assert y.dtype == dtype and y.shape == x.shape
            if channels_last and x.numel():
                assert y.is_contiguous(
                    memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                )
    assert bool(used) == compiled
    state = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    return out, state, calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{tuple(c[0])}-{c[1]}-cl{int(c[2])}-m{c[3]}-{c[5]}")
def test_compiled_and_python_paths_agree(case, monkeypatch):
    require_cpu_extension()
    with monkeypatch.context() as m:
        out_c, state_c, calls_c = _train(case, True, m)
    with monkeypatch.context() as m:
        out_p, state_p, calls_p = _train(case, False, m)
    assert calls_c == calls_p  # the same collectives in the same order
    assert len(calls_c) == 6  # one per direction and step
    for step, (step_c, step_p) in enumerate(zip(out_c, out_p)):
        for what, a, b in zip(("y", "dx", "dweight", "dbias"), step_c, step_p):
            assert_paths_agree(a, b, f"step {step} {what}")
    for what, a, b in zip(("running_mean", "running_var", "num_batches_tracked"), state_c, state_p):
        assert_paths_agree(a, b, what)
    assert int(state_c[2]) == 3


def test_non_dense_upstream_gradient(monkeypatch):
    require_cpu_extension()
    case = ((3, C, 5, 4), torch.bfloat16, True, 0.1, True, torch.float32)
    with monkeypatch.context() as m:
        out_c, _, _ = _train(case, True, m, steps=1, dense_dy=False)
    with monkeypatch.context() as m:
        out_p, _, _ = _train(case, False, m, steps=1, dense_dy=False)
    for what, a, b in zip(("y", "dx", "dweight", "dbias"), out_c[0], out_p[0]):
        assert_paths_agree(a, b, what)


def test_no_collective_in_backward_without_input_gradient(monkeypatch):
    """A layer whose input needs no gradient (e.g. the first layer) skips the backward all_reduce on
    every rank alike, and still returns the local weight/bias gradients, as the Python path does."""
    require_cpu_extension()
    results = {}
    for compiled in (True, False):
        with monkeypatch.context() as m:
            calls = _fake_group(m, C)
            if not compiled:
                m.setattr(SyncBatchNorm, "_cpu_extension", lambda self, ops: None)
            bn = SyncBatchNorm(C)
            x = torch.randn(4, C, 3, generator=torch.Generator().manual_seed(1))
            bn(x).pow(2).sum().backward()
            results[compiled] = (calls, bn.weight.grad, bn.bias.grad)
    assert results[True][0] == results[False][0] == ["moments"]
    assert_paths_agree(results[True][1], results[False][1], "dweight")
    assert_paths_agree(results[True][2], results[False][2], "dbias")


def test_compiled_choice_follows_what_decides_it(monkeypatch):
    """The per-module memo of the choice (compiled kernels or pure-torch path) is redone when what
    decides it changes between forwards: the running buffers' dtype, the extension being turned
    off and on again."""
    require_cpu_extension()
    _fake_group(monkeypatch, C)
    used = []
    original = SyncBatchNorm._forward_compiled
    monkeypatch.setattr(
        SyncBatchNorm, "_forward_compiled", lambda self, *a: used.append(1) or original(self, *a)
    )
    bn = SyncBatchNorm(C)
    x = torch.randn(4, C, 3, generator=torch.Generator().manual_seed(5))

    def compiled() -> bool:
        used.clear()
        bn(x)
        return bool(used)

    assert compiled()
    bn.running_mean = bn.running_mean.to(torch.bfloat16)  # NumPy cannot view it: pure-torch path
    bn.running_var = bn.running_var.to(torch.bfloat16)
    assert not compiled()
    bn.running_mean = bn.running_mean.float()
    bn.running_var = bn.running_var.float()
    assert compiled()
    try:
        monkeypatch.setenv(cpu_extension.ENV_VAR, "0")
        cpu_extension._reset_for_tests()
        assert not compiled()
    finally:
        monkeypatch.delenv(cpu_extension.ENV_VAR)
        cpu_extension._reset_for_tests()
    assert compiled()


def test_double_backward_is_refused_not_silently_wrong(monkeypatch):
    """The compiled backward records no graph: create_graph=True must raise, not return gradients
    whose second derivatives would silently be missing."""
    require_cpu_extension()
    _fake_group(monkeypatch, C)
    bn = SyncBatchNorm(C)
    x = torch.randn(4, C, 3, generator=torch.Generator().manual_seed(6), requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(bn(x).pow(2).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(bn(x).pow(2).sum(), x)  # a plain backward still works
    assert torch.isfinite(grad).all()


def test_loops_are_built_for_avx2_and_the_baseline():
    """The per-channel loops are compiled twice (GCC function multi-versioning: an AVX2 clone and a
    baseline one, picked by the CPU at load time), so a build shared by several machines runs on
    any x86-64 CPU and uses AVX2 where there is one."""
    import os
    import platform
    import shutil
    import subprocess

    if platform.machine() != "x86_64" or platform.system() != "Linux" or shutil.which("nm") is None:
        pytest.skip("multi-versioning applies to x86-64 Linux builds; needs nm to read the symbols")
    ext = require_cpu_extension()
    compiler = os.environ.get("CXX", "c++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:  # the clones are a GCC attribute (see the .cpp)
        pytest.skip(f"built with {compiler} ({version.splitlines()[:1]}), not GCC")
    symbols = subprocess.run(["nm", "-C", ext.__file__], capture_output=True, text=True, check=True).stdout
    for kernel in ("channel_terms", "channel_affine", "rows_terms", "rows_affine"):
        lines = [line for line in symbols.splitlines() if f"{kernel}<" in line]
        assert any("[clone .avx2]" in line for line in lines), kernel
        assert any("[clone .default]" in line for line in lines), kernel


def test_raises_on_one_value_per_channel_in_the_group(monkeypatch):
    require_cpu_extension()
    monkeypatch.setattr(sbn, "_sum_over_group", lambda t, g: t)
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "get_world_size", lambda group=None: 2)
    used = []
    original = SyncBatchNorm._forward_compiled
    monkeypatch.setattr(
        SyncBatchNorm, "_forward_compiled", lambda self, *a: used.append(1) or original(self, *a)
    )
    bn = SyncBatchNorm(C)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, C))
    assert used
    assert torch.equal(bn.running_mean, torch.zeros(C))  # nothing updated
    assert int(bn.num_batches_tracked) == 1  # counted before the check, as torch's BatchNorm does


def test_disabled_and_failed_builds_fall_back_to_python(monkeypatch):
    """``LIGHTNING_EXT_CPU_EXTENSION=0`` and a build that fails both leave the Python path; a failure
    warns once per process and is not retried."""
    import torch.utils.cpp_extension

    try:
        monkeypatch.setenv(cpu_extension.ENV_VAR, "0")
        cpu_extension._reset_for_tests()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_extension.load() is None

        monkeypatch.setenv(cpu_extension.ENV_VAR, "1")
        cpu_extension._reset_for_tests()
        attempts = []

        def broken_load(**kwargs):
            attempts.append(kwargs["name"])
            raise RuntimeError("no compiler here")

        monkeypatch.setattr(torch.utils.cpp_extension, "load", broken_load)
        with pytest.warns(RuntimeWarning, match="could not be built or loaded.*no compiler here"):
            assert cpu_extension.load() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_extension.load() is None
        assert len(attempts) == 1
        # SyncBatchNorm keeps working, on the Python path.
        monkeypatch.setattr(sbn, "_sum_over_group", lambda t, g: t)
        bn = SyncBatchNorm(C)
        x = torch.randn(6, C, 2)
        y = bn._forward_synced(x, sync=True, update_stats=True)
        torch.testing.assert_close(y, torch.nn.functional.batch_norm(x, None, None, training=True))
    finally:
        monkeypatch.undo()
        cpu_extension._reset_for_tests()


def test_strided_buffers_and_weight(monkeypatch):
    """Running buffers and parameters that are views with a stride are read and updated in place
    correctly (the C++ loops address memory directly)."""
    require_cpu_extension()
    results = {}
    for compiled in (True, False):
        with monkeypatch.context() as m:
            _fake_group(m, C)
            if not compiled:
                m.setattr(SyncBatchNorm, "_cpu_extension", lambda self, ops: None)
            bn = SyncBatchNorm(C)
            storage = torch.arange(4.0 * C).view(C, 4)  # columns are strided (C,) views
            bn._buffers["running_mean"] = storage[:, 1]
            bn._buffers["running_var"] = storage[:, 2]
            with torch.no_grad():
                storage[:, 2] += 1.0
            bn.weight = torch.nn.Parameter(
                torch.randn(C, 2, generator=torch.Generator().manual_seed(3))[:, 0]
            )
            x = torch.randn(5, C, 4, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
            x.requires_grad_(True)
            y = bn(x)
            y.float().pow(2).sum().backward()
            assert not bn.running_mean.is_contiguous()
            results[compiled] = (y.detach(), x.grad, bn.weight.grad, storage.clone())
    for what, a, b in zip(("y", "dx", "dweight", "buffers"), results[True], results[False]):
        assert_paths_agree(a, b, what)
    assert not torch.equal(results[True][3][:, 1], torch.arange(1.0, 4.0 * C, 4))  # updated in place


def test_stale_build_lock_is_removed_and_a_fresh_one_waited_for(monkeypatch, tmp_path):
    """torch's build lock has no time limit: a lock left by a killed build must not hang later runs."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    monkeypatch.setattr(cpu_extension, "_lock_path", lambda: lock)
    cpu_extension._clear_stale_lock()  # no lock: returns at once

    lock.write_text("")
    old = time.time() - cpu_extension.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        cpu_extension._clear_stale_lock()
    assert not lock.exists()

    lock.write_text("")  # a build in progress: waited for until its lock goes
    threading.Timer(1.0, lock.unlink).start()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cpu_extension._clear_stale_lock()
    assert 0.9 < time.perf_counter() - start < 30


def test_a_build_in_progress_is_announced(monkeypatch):
    """A load that takes longer than ``ANNOUNCE_AFTER_SECONDS`` (a first build, ~40 s) says why the
    first SyncBatchNorm forward stalls (Lightning's ``rank_zero_info``); a cached load says nothing."""
    import time

    import lightning.pytorch.utilities
    import torch.utils.cpp_extension

    messages = []
    try:
        monkeypatch.setenv(cpu_extension.ENV_VAR, "1")
        monkeypatch.setattr(cpu_extension, "ANNOUNCE_AFTER_SECONDS", 0.2)
        monkeypatch.setattr(cpu_extension, "_clear_stale_lock", lambda: None)
        monkeypatch.setattr(lightning.pytorch.utilities, "rank_zero_info", messages.append)
        for delay, announced in ((1.0, True), (0.0, False)):
            cpu_extension._reset_for_tests()
            messages.clear()
            module = object()
            monkeypatch.setattr(
                torch.utils.cpp_extension,
                "load",
                lambda delay=delay, module=module, **kw: time.sleep(delay) or module,
            )
            assert cpu_extension.load() is module
            time.sleep(0.3)  # a timer that was not cancelled would have fired by now
            assert any("building the compiled CPU SyncBatchNorm kernels" in m for m in messages) == announced
    finally:
        monkeypatch.undo()
        cpu_extension._reset_for_tests()
