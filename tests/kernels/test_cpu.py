"""The ``cpu`` backend's build: both code paths in the binary, the build key, stale locks, the build
notice, the ahead-of-time entry point, fallback.

Its ops are checked against ``reference`` with every other backend in ``test_batch_norm.py``,
``test_unscale.py`` and ``test_moments.py``.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from lightning_ext import _compat
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
    symbols = subprocess.run(["nm", "-C", cpu._load().__file__], capture_output=True, text=True, check=True)
    for kernel in ("channel_terms", "channel_affine", "rows_terms", "rows_affine", "moments_range"):
        lines = [line for line in symbols.stdout.splitlines() if f"{kernel}<" in line]
        assert any("[clone .arch_x86_64_v3]" in line for line in lines), kernel
        assert any("[clone .default]" in line for line in lines), kernel


_TORCH = "/venv/lib/python3.11/site-packages/torch"
_ENVIRONMENT = ("2.13.0+cpu", _TORCH, "1", "/venv", ".cpython-311-x86_64-linux-gnu.so")


@pytest.mark.parametrize(
    "changed",
    [
        ("2.12.1+cpu", _TORCH, "1", "/venv", ".cpython-311-x86_64-linux-gnu.so"),  # another torch
        ("2.13.0+cu126", _TORCH, "1", "/venv", ".cpython-311-x86_64-linux-gnu.so"),  # its CUDA build
        (
            "2.13.0+cpu",
            "/venv2/lib/python3.11/site-packages/torch",
            "1",
            "/venv",
            ".cpython-311-x86_64-linux-gnu.so",
        ),
        ("2.13.0+cpu", _TORCH, "0", "/venv", ".cpython-311-x86_64-linux-gnu.so"),  # the old C++ ABI
        ("2.13.0+cpu", _TORCH, "1", "/venv2", ".cpython-311-x86_64-linux-gnu.so"),  # another prefix
        ("2.13.0+cpu", _TORCH, "1", "/venv", ".cpython-312-x86_64-linux-gnu.so"),  # another Python
        ("2.13.0+cpu", _TORCH, "1", "/venv", ".cpython-313t-x86_64-linux-gnu.so"),  # free-threaded
        ("2.13.0+cpu", _TORCH, "1", "/venv", ".pypy311-pp73-x86_64-linux-gnu.so"),  # PyPy
    ],
)
def test_the_build_key_separates_environments(changed):
    """Environments that must not share a build get different keys (so directories side by side),
    among them two venvs with the same torch at different paths; the same environment gets the same
    key in every process (so the cache is found); another source another key."""
    key = cpu._build_key(_ENVIRONMENT, b"// kernels")
    assert re.fullmatch(r"[0-9a-f]{12}", key)
    assert cpu._build_key(_ENVIRONMENT, b"// kernels") == key
    assert cpu._build_key(changed, b"// kernels") != key
    assert cpu._build_key(_ENVIRONMENT, b"// kernels v2") != key


def test_the_extension_name_follows_this_environment(monkeypatch, tmp_path):
    """The name torch builds under is ``lightning_ext_kernels_cpu_<key>`` of this process's torch
    version, location and ABI, Python prefix and suffix and the source's location (two checkouts of
    one source sharing a venv: torch rebuilds when its build file names another source path): a valid
    module name, stable while they are."""
    name = cpu._extension_name()
    assert name.isidentifier() and re.fullmatch(r"lightning_ext_kernels_cpu_[0-9a-f]{12}", name)
    assert cpu._extension_name() == name
    abi = torch.compiled_with_cxx11_abi()
    copy = tmp_path / "kernels_cpu.cpp"
    copy.write_bytes(cpu._SOURCE.read_bytes())
    for target, attr, value in [
        (torch, "__version__", "2.4.1+cu121"),
        (torch, "__file__", "/elsewhere/site-packages/torch/__init__.py"),
        (torch, "compiled_with_cxx11_abi", lambda: not abi),
        (cpu.sys, "prefix", "/another/venv"),
        (cpu.sysconfig, "get_config_var", lambda var: ".cpython-399-x86_64-linux-gnu.so"),
        (cpu, "_SOURCE", copy),  # the same bytes in another checkout
    ]:
        with monkeypatch.context() as m:
            m.setattr(target, attr, value)
            assert cpu._extension_name() != name, attr
    assert cpu._extension_name() == name


def test_two_environments_share_the_cache_without_rebuilding_each_other(tmp_path):
    """Two virtual environments with the same torch at different paths (here: this interpreter, and
    a venv of it that sees the same packages) build under different names in one shared cache."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    script = "import sys; sys.path[:0] = sys.argv[1:]; from lightning_ext.kernels import cpu; "
    script += "print(cpu._extension_name())"
    run = [script, *(p for p in sys.path if p)]
    names = {
        subprocess.run([python, "-c", *run], capture_output=True, text=True, check=True, timeout=120).stdout
        for python in (sys.executable, str(venv / "bin" / "python"))
    }
    assert len(names) == 2 and all(n.startswith("lightning_ext_kernels_cpu_") for n in names), names
    assert cpu._extension_name() + "\n" in names


def _file_baton(monkeypatch) -> None:
    """The lock of torch before 2.14 (a file that exists while a build runs), whatever torch runs."""
    monkeypatch.setattr(cpu, "BUILD_LOCK_IS_ADVISORY", False)
    monkeypatch.setattr(cpu, "build_lock_held", lambda lock: lock.exists())


def test_stale_build_lock_is_removed_and_a_fresh_one_waited_for(monkeypatch, tmp_path, caplog):
    """torch's build lock has no time limit: a lock left by a killed build must not hang later runs."""
    _file_baton(monkeypatch)
    lock = tmp_path / "lock"
    cpu._clear_stale_lock(tmp_path)  # no lock: returns at once
    lock.write_text("")
    old = time.time() - cpu._STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        cpu._clear_stale_lock(tmp_path)
    assert "stale build lock" in caplog.text and not lock.exists()
    lock.write_text("")  # a build in progress: waited for until its lock goes
    threading.Timer(1.0, lock.unlink).start()
    start = time.perf_counter()
    cpu._clear_stale_lock(tmp_path)
    assert 0.9 < time.perf_counter() - start < 30


def test_an_advisory_build_lock_is_waited_for_while_held_and_never_removed(monkeypatch, tmp_path):
    """torch 2.14's lock (filelock): the file stays after the build; only a held lock means a build."""
    import fcntl

    monkeypatch.setattr(_compat, "BUILD_LOCK_IS_ADVISORY", True)
    monkeypatch.setattr(cpu, "BUILD_LOCK_IS_ADVISORY", True)
    monkeypatch.setattr(cpu, "build_lock_held", _compat.build_lock_held)
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - cpu._STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    start = time.perf_counter()
    cpu._clear_stale_lock(tmp_path)  # a file nobody holds: no build, returns at once, kept
    assert time.perf_counter() - start < 0.4 and lock.exists()
    holder = os.open(lock, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a build in progress (an old file: still not stale)
    threading.Timer(1.0, os.close, (holder,)).start()
    start = time.perf_counter()
    cpu._clear_stale_lock(tmp_path)
    assert 0.9 < time.perf_counter() - start < 30 and lock.exists()


def _mock_build(monkeypatch, delay: float) -> list[dict]:
    """Replace torch's build by one that takes ``delay`` seconds; the list collects its arguments."""
    import torch.utils.cpp_extension

    calls = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw) or time.sleep(delay) or object()
    )
    return calls


def test_the_build_uses_the_keyed_name_and_its_lock(monkeypatch, tmp_path):
    """torch builds under the keyed name, and the stale-lock check looks in that name's directory."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    checked = []
    monkeypatch.setattr(cpu, "_clear_stale_lock", checked.append)
    calls = _mock_build(monkeypatch, 0.0)
    cpu._load()
    assert [call["name"] for call in calls] == [cpu._extension_name()]
    assert checked == [tmp_path / cpu._extension_name()] and checked[0].is_dir()


def test_a_blocking_build_is_announced_once_on_every_rank(monkeypatch, tmp_path, caplog):
    """A load that blocks longer than a few seconds (a first build, ~30 s) says why and where, once per
    process, on any rank (the ranks that wait for rank 0's build stall as long); a cached load says
    nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")  # not rank zero: it speaks too
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cpu, "_ANNOUNCE_AFTER_SECONDS", 0.2)
    monkeypatch.setattr(cpu, "_clear_stale_lock", lambda directory: None)
    monkeypatch.setattr(cpu, "_announced", False)
    directory = tmp_path / cpu._extension_name()
    for delay, announced in ((0.0, 0), (1.0, 1), (1.0, 1)):  # cached, a build, a second build: once
        monkeypatch.setattr(cpu, "_module", None)
        _mock_build(monkeypatch, delay)
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            cpu._load()
            time.sleep(0.3)  # a timer that was not cancelled would have fired by now
        messages = [r.getMessage() for r in caplog.records if "compiled CPU kernels" in r.getMessage()]
        assert len(messages) == announced, messages
    assert messages == [
        f"lightning_ext: building the compiled CPU kernels (or waiting for the process that builds them) "
        f"in {directory}, about 30 s once per environment. `python -m lightning_ext.kernels` builds them "
        "ahead of time."
    ]


def test_waiting_for_another_process_build_is_announced_once(monkeypatch, tmp_path, caplog):
    """A process that finds another one's build lock says it waits, where, once."""
    _file_baton(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cpu, "_ANNOUNCE_AFTER_SECONDS", 0.2)
    monkeypatch.setattr(cpu, "_announced", False)
    lock = tmp_path / "lock"
    lock.write_text("")
    threading.Timer(1.5, lock.unlink).start()
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        cpu._clear_stale_lock(tmp_path)
        cpu._announce(tmp_path)  # a later build of the same process: silent
    assert [r.getMessage() for r in caplog.records] == [
        f"lightning_ext: waiting for another process to build the compiled CPU kernels in {tmp_path}, "
        "about 30 s once per environment. `python -m lightning_ext.kernels` builds them ahead of time."
    ]


def test_the_ahead_of_time_build_runs_cleanly():
    """``python -m lightning_ext.kernels`` (the build is cached here, so it is quick) exits 0 without
    runpy's RuntimeWarning and prints the build directory and the time it took."""
    require_cpu_backend()
    result = subprocess.run(
        [sys.executable, "-W", "default", "-m", "lightning_ext.kernels"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr, result.stderr  # (torch 2.5's dynamo import leaves a
    # ResourceWarning of its own under -W default)
    directory = re.escape(str(_compat.extension_build_directory(cpu._extension_name())))
    printed = rf"lightning_ext: cpu kernels (built|cached, loaded) in \d+\.\d s (in|from) {directory}\n"
    assert re.fullmatch(printed, result.stdout), result.stdout


def test_the_ahead_of_time_build_without_a_compiler_says_so(monkeypatch, capsys):
    """Without a C++ compiler the entry point exits 1 naming what is missing, and builds nothing."""
    import torch.utils.cpp_extension

    from lightning_ext.kernels.__main__ import main

    monkeypatch.setenv("CXX", "lightning-ext-no-such-compiler")
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda **kw: pytest.fail("built without a compiler")
    )
    assert main([]) == 1
    assert re.match(
        r"lightning_ext: cannot build the cpu kernels: C\+\+ compiler 'lightning-ext-no-such-compiler' "
        r"not found \(install g\+\+, or set CXX\)",
        capsys.readouterr().err,
    )


def test_a_missing_compiler_is_one_short_warning_with_the_cause_first(tmp_path):
    """A fresh process whose compiler is missing selects ``reference`` with ONE line of at most 300
    characters that names the cause early, without torch's banner (torch is not asked to build)."""
    env = {**os.environ, "CXX": "lightning-ext-no-such-c++", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop(registry.BACKEND_ENV_VAR, None)
    script = (
        "import warnings, torch\n"
        "from lightning_ext.kernels import get_backend\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(get_backend(device='cpu').name)\n"
        "print(*(str(w.message) for w in caught), sep='\\n')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    name, *lines = result.stdout.splitlines()
    assert name == "reference" and len(lines) == 1, result.stdout
    assert (
        len(lines[0]) <= 300 and lines[0].index("C++ compiler 'lightning-ext-no-such-c++' not found") < 80
    ), lines[0]
    assert "!! WARNING !!" not in result.stderr and not list(tmp_path.glob("lightning_ext_kernels_cpu_*"))


def test_a_failed_compilation_is_one_line_and_the_output_is_logged_at_debug(monkeypatch, caplog):
    """A compiler error: the error line in the exception, the whole output at DEBUG."""
    import torch.utils.cpp_extension

    output = (
        "[1/2] c++ -MMD " + "-isystem /long/include " * 40 + "\nkernels_cpu.cpp:7:1: error: expected ';'\n"
    )

    def failing(**kwargs):
        raise RuntimeError(f"Error building extension '{kwargs['name']}': {output}ninja: build stopped")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_clear_stale_lock", lambda directory: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing)
    with caplog.at_level(logging.DEBUG, logger=cpu.__name__), pytest.raises(RuntimeError) as info:
        cpu._load()
    assert str(info.value) == "building the cpu kernels failed: kernels_cpu.cpp:7:1: error: expected ';'"
    assert output.strip() in caplog.text


def test_the_former_entry_point_names_the_new_one():
    """`python -m lightning_ext.kernels.cpu` (runpy warns: the package imports the module) fails and
    names the new command, rather than doing nothing."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ext.kernels.cpu"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "moved: run `python -m lightning_ext.kernels`" in result.stderr


def test_a_failed_build_falls_back_to_reference_with_one_warning(monkeypatch):
    """Automatic selection on CPU takes ``reference`` when the build fails (one warning, not retried);
    asking for ``cpu`` by name raises."""
    import torch.utils.cpp_extension

    attempts = []

    def broken(**kwargs):
        attempts.append(kwargs["name"])
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_clear_stale_lock", lambda directory: None)
    monkeypatch.setattr(cpu.shutil, "which", lambda compiler: compiler)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.delenv(registry.BACKEND_ENV_VAR, raising=False)
    registry.clear_backend_cache()
    try:
        with pytest.warns(
            RuntimeWarning,
            match=r"'cpu' failed to load \(building the cpu kernels failed: "
            r"no compiler here\); using 'reference' for cpu tensors",
        ):
            assert get_backend(device="cpu").name == "reference"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert get_backend(device="cpu").name == "reference"
        with pytest.raises(RuntimeError, match=r"kernel backend .cpu. .* failed to load"):
            get_backend("cpu", device="cpu")
        assert len(attempts) == 1
    finally:
        registry.clear_backend_cache()


def test_auto_selects_the_cpu_backend_on_cpu():
    require_cpu_backend()
    registry.clear_backend_cache()
    assert get_backend(device="cpu").name == "cpu"
    x = torch.randn(3, 2)
    assert get_backend(device="cpu").run("batch_norm_moments", x, torch.zeros(2)).dtype == torch.float64


def test_the_one_defer_rule_sends_float16_batch_norm_ops_to_reference(monkeypatch):
    """Where a compiled kernel loses to ATen (bench_kernels.py's guard), the backend hands the call to
    the reference op, by one table: float16 batch-norm ops but the channels-last backward_elemt (the
    kernel wins there), float64 normalize and channels-last backward_reduce, and nothing else for
    small bfloat16/float32 tensors."""
    require_cpu_backend()
    from lightning_ext.kernels import OPS

    calls: list[str] = []
    for op in cpu._DEFER_TO_REFERENCE:
        original = OPS[op].impls["reference"]
        spy = lambda *args, _fn=original, _op=op: calls.append(_op) or _fn(*args)
        monkeypatch.setitem(OPS[op].impls, "reference", spy)
    backend = cpu.CpuBackend()
    try:
        x = torch.randn(4, 3, 5, 2)
        shift, mean, invstd = torch.zeros(3), torch.zeros(3), torch.ones(3)
        four = sorted(cpu._DEFER_TO_REFERENCE)  # backward_elemt, backward_reduce, elemt, moments
        for dtype, fmt, expected in [
            (torch.float32, torch.contiguous_format, []),
            (torch.float32, torch.channels_last, ["batch_norm_backward_reduce"]),
            (torch.bfloat16, torch.contiguous_format, []),
            (torch.bfloat16, torch.channels_last, []),
            (torch.float64, torch.contiguous_format, ["batch_norm_elemt"]),
            (torch.float64, torch.channels_last, ["batch_norm_backward_reduce", "batch_norm_elemt"]),
            (torch.float16, torch.contiguous_format, four),
            (torch.float16, torch.channels_last, four[1:]),  # backward_elemt: the kernel's
        ]:
            calls.clear()
            xd = x.to(dtype).contiguous(memory_format=fmt)
            backend.run("batch_norm_moments", xd, shift)
            backend.run("batch_norm_elemt", xd, mean, invstd, None, None)
            sums = backend.run("batch_norm_backward_reduce", xd, xd, mean)
            backend.run("batch_norm_backward_elemt", xd, xd, mean, invstd, None, sums, torch.tensor(40.0))
            assert sorted(calls) == expected, (dtype, fmt)
        calls.clear()
        large = torch.randn(1, 3, 2**19 // 3 + 1, 2).bfloat16()  # >= _LARGE elements: ATen's normalize
        backend.run("batch_norm_elemt", large, mean, invstd, None, None)
        backend.run(
            "batch_norm_elemt", large.float(), mean, invstd, None, None
        )  # float32: only above 2 * _LARGE
        backend.run("batch_norm_elemt", torch.cat([large.float()] * 2, 2), mean, invstd, None, None)
        assert calls == ["batch_norm_elemt"] * 2
    finally:
        monkeypatch.undo()
        cpu.CpuBackend()  # the live instance the custom ops find is an unpatched one again
