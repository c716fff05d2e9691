"""The ``cpu`` backend's build and its cache: both code paths in the binary, the build key, what is
verified before a load (truncated, garbage, foreign-owned and loose files; a prebuilt cache without a
compiler, read-only, and with another ``ninja``), the build lock, the build notice, the ahead-of-time
entry point, fallback.

Its ops are checked against ``reference`` with every other backend in ``test_batch_norm.py``,
``test_unscale.py`` and ``test_moments.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
    for kernel in ("channel_terms", "planes_affine", "rows_terms", "rows_affine", "moments_range"):
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


def test_two_environments_share_the_cache_without_rebuilding_each_other(tmp_path, forks):
    """Two virtual environments with the same torch at different paths (here: this interpreter, and
    a venv of it that sees the same packages) build under different names in one shared cache."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    paths = [p for p in sys.path if p]
    script = f"import sys; sys.path[:0] = {paths!r}; from lightning_ext.kernels import cpu; "
    script += "print(cpu._extension_name())"
    here = _python(forks, script, dict(os.environ))  # another process of this interpreter
    python = venv / "bin" / "python"
    there = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    assert here.returncode == there.returncode == 0, here.stderr + there.stderr
    names = {here.stdout, there.stdout}
    assert len(names) == 2 and all(n.startswith("lightning_ext_kernels_cpu_") for n in names), names
    assert cpu._extension_name() + "\n" in names


# ---------------------------------------------------------------------------------- what is verified
_LOAD = (
    "import torch\n"
    "from lightning_ext.kernels import get_backend\n"
    "x = torch.tensor([[1.0], [3.0]])\n"
    "print(get_backend('cpu', device='cpu').run('batch_norm_moments', x, torch.zeros(1)).tolist())\n"
)
_LOADED = "[2.0, 4.0, 10.0]\n"  # what _LOAD prints
_UNOPTIMIZED = (  # a build of this process compiles without optimization
    "import torch.utils.cpp_extension as ext\n"
    "load = ext.load\n"
    "flags = lambda kw: ['-O0' if f == '-O3' else f for f in kw['extra_cflags']]\n"
    "ext.load = lambda **kw: load(**{**kw, 'extra_cflags': flags(kw)})\n"
)
_AUTO = (  # the automatic selection, and its warnings, one per line
    "import warnings\n"
    "from lightning_ext.kernels import get_backend\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    print(get_backend(device='cpu').name)\n"
    "print(*(str(w.message) for w in caught), sep='\\n')\n"
)
_NO_CXX = "lightning-ext-no-such-c++"


def _cache_copy(tmp_path: Path) -> Path:
    """A copy of this environment's verified build in a cache of its own, ``tmp_path/cache`` (mode
    755, files as the original's): its build directory."""
    require_cpu_backend()
    source = Path(cpu._load().__file__).parent
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    return Path(shutil.copytree(source, root / source.name, ignore=shutil.ignore_patterns("*.lock", "lock")))


def _library(directory: Path) -> Path:
    return directory / f"{directory.name}.so"


def _environ(directory: Path, **env: str) -> dict[str, str]:
    """This process's environment with the cache of the build directory ``directory``, plus ``env``."""
    environ = {**os.environ, "TORCH_EXTENSIONS_DIR": str(directory.parent), **env}
    environ.pop(registry.BACKEND_ENV_VAR, None)
    return environ


# A new interpreter spends seconds importing torch and tearing it down, a fork milliseconds: this server
# imports torch once (with one OpenMP thread: it forks no other thread), then runs each ``[script,
# environment]`` it reads in a child forked from it, which behaves as ``python -c script`` started in
# that environment with torch imported first, except that a script that succeeds exits without the
# interpreter's teardown; it answers ``[exit status, stdout, stderr]`` (``-N``: killed by signal N).
_FORK_SERVER = """
import json, os, sys, tempfile
import torch
for line in sys.stdin:
    script, environ = json.loads(line)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    if os.fork() == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.environ.clear()
        os.environ.update(environ)
        exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    returncode = os.waitstatus_to_exitcode(os.wait()[1])
    out.seek(0), err.seek(0)
    print(json.dumps([returncode, out.read().decode(), err.read().decode()]), flush=True)
    out.close(), err.close()
"""


@pytest.fixture(scope="module")
def forks() -> Iterator[subprocess.Popen]:
    """The fork server of this module's tests (``_python`` sends it scripts)."""
    server = subprocess.Popen(
        [sys.executable, "-c", _FORK_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    yield server
    server.stdin.close()  # it leaves at the end of its input
    try:
        server.wait(timeout=60)
    finally:
        server.kill()  # (a no-op once it left)


def _python(forks: subprocess.Popen, script: str, environ: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -c script`` in ``environ``, as a child of the fork server ``forks``."""
    forks.stdin.write(json.dumps([script, environ]) + "\n")
    forks.stdin.flush()
    answer = forks.stdout.readline()
    if not answer:
        raise RuntimeError(f"the fork server exited with status {forks.wait(timeout=60)}")
    returncode, stdout, stderr = json.loads(answer)
    return subprocess.CompletedProcess(["python", "-c", script], returncode, stdout, stderr)


def _ninja(directory: Path, log: Path, real: bool = True) -> str:
    """``directory`` holding a ``ninja`` that appends its arguments to ``log``, then runs the real one
    (else fails): ``PATH`` with it first."""
    directory.mkdir()
    then = f'exec {shutil.which("ninja")} "$@"' if real else "exit 1"
    (directory / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {log}\n{then}\n')
    (directory / "ninja").chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}" if real else str(directory)


def test_a_prebuilt_cache_loads_without_a_compiler_or_ninja(tmp_path, forks):
    """A verified build loads with neither a compiler nor ``ninja`` on ``PATH`` (only a ``ninja``
    that fails, and logs that it was asked)."""
    directory = _cache_copy(tmp_path)
    log = tmp_path / "ninja.log"
    result = _python(forks, _LOAD, _environ(directory, PATH=_ninja(tmp_path / "bin", log, real=False)))
    assert (result.returncode, result.stdout) == (0, _LOADED), result.stderr
    assert not log.exists() and shutil.which("c++", path=str(tmp_path / "bin")) is None


@pytest.mark.slow
def test_a_truncated_build_is_rebuilt_then_loads_whichever_ninja_is_on_path(tmp_path, forks):
    """A truncated library (an interrupted copy) where a build can run is rebuilt, through the first
    ``ninja`` on ``PATH``, not loaded; the rebuilt cache then loads with ANOTHER ``ninja`` first on
    ``PATH`` without calling it (torch's own load rebuilds at each switch of ``ninja``). Under umask 002
    (the default of many distributions) the build's files are still writable by their owner only, so
    the next process trusts them. The rebuild compiles at ``-O0`` (a third of ``-O3``'s time): what is
    tested is the decision to rebuild and what follows it, not the optimizer."""
    directory = _cache_copy(tmp_path)
    library = _library(directory)
    library.write_bytes(library.read_bytes()[:200_000])
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    script = "import os; os.umask(0o002)\n" + _UNOPTIMIZED + _LOAD
    result = _python(forks, script, _environ(directory, PATH=_ninja(tmp_path / "1", first)))
    assert (result.returncode, result.stdout) == (0, _LOADED), result.stderr
    assert first.read_text().strip(), "rebuilt without calling the ninja first on PATH"
    assert "-O0" in (directory / "build.ninja").read_text(), "not the build of this test"
    data, manifest = library.read_bytes(), directory / "manifest.json"
    assert json.loads(manifest.read_text()) == {
        "name": directory.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()
    }  # fmt: skip
    assert not (library.stat().st_mode | manifest.stat().st_mode) & 0o022
    built = library.stat().st_mtime_ns
    result = _python(forks, _LOAD, _environ(directory, PATH=_ninja(tmp_path / "2", second)))
    assert (result.returncode, result.stdout) == (0, _LOADED), result.stderr
    assert not second.exists() and library.stat().st_mtime_ns == built


def _read_only(root: Path) -> list[str] | None:
    """The command prefix of a process that sees ``root`` read-only: as root (who writes through any
    mode) a read-only bind mount in a mount namespace of its own (None without ``unshare -m``); else
    ``root`` made read-only."""
    if os.geteuid() != 0:
        for path in (root, *root.rglob("*")):
            path.chmod(path.stat().st_mode & ~0o222)
        return []
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode:
        return None
    mount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    return ["unshare", "-m", "sh", "-c", mount, str(root)]


_PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


@pytest.fixture(scope="module")
def entry_point(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """``python -m lightning_ext.kernels`` in new interpreters that run side by side: with ``-W default``
    on this environment's cache (``"ahead of time"``), on a read-only copy of its build
    (``"complete"``), and on a read-only one whose library is truncated to 200000 bytes
    (``"truncated"``); each run (None: no read-only mount here) with the build directory it was given."""
    require_cpu_backend()
    command = [sys.executable, "-W", "default", "-m", "lightning_ext.kernels"]
    directory = _compat.extension_build_directory(cpu._extension_name())
    runs = {"ahead of time": (subprocess.Popen(command, **_PIPES), directory)}
    for case in ("complete", "truncated"):
        directory = _cache_copy(tmp_path_factory.mktemp(case))
        if case == "truncated":
            _library(directory).write_bytes(_library(directory).read_bytes()[:200_000])
        prefix = _read_only(directory.parent)
        command = [*(prefix or []), sys.executable, "-m", "lightning_ext.kernels"]
        process = None if prefix is None else subprocess.Popen(command, env=_environ(directory), **_PIPES)
        runs[case] = (process, directory)
    results = {}
    for case, (process, directory) in runs.items():
        if process is not None:
            stdout, stderr = process.communicate(timeout=600)
            process = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        results[case] = (process, directory)
    return results


@pytest.mark.slow  # its fixture starts processes
@pytest.mark.parametrize("truncated", [False, True], ids=["complete", "truncated"])
def test_a_read_only_cache_loads_a_complete_build_and_refuses_a_truncated_one(entry_point, truncated):
    """A shared cache is usually read-only: a verified build loads from it (no lock, nothing written);
    a truncated one cannot be rebuilt there, and ``python -m lightning_ext.kernels`` says so in one line
    naming the file and why, exit status 1 (never SIGBUS)."""
    result, directory = entry_point["truncated" if truncated else "complete"]
    if result is None:
        pytest.skip("running as root without `unshare -m`: no read-only mount to test with")
    if not truncated:
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("lightning_ext: cpu kernels cached, loaded in "), result.stdout
        assert (
            result.stdout.endswith(f" s from {directory}\n")
            and not (directory / "lightning_ext.lock").exists()
        )
        return
    library, size = _library(directory), _library(entry_point["complete"][1]).stat().st_size
    # torch's own line (printed, or logged with a prefix) when torch.utils.cpp_extension is imported on a
    # CUDA build without CUDA
    lines = result.stderr.splitlines(True)
    ours = "".join(line for line in lines if "No CUDA runtime is found" not in line)
    assert result.returncode == 1 and ours.count("\n") == 1, result
    assert ours.startswith(
        f"lightning_ext: cannot build the cpu kernels: {library} is 200000 bytes, {size} when built "
        f"(truncated or incomplete); cannot rebuild: {directory} is read-only (its owner builds there: "
        "`python -m lightning_ext.kernels`). "
    ), result.stderr


def _damage(directory: Path, damage: str) -> str:
    """Damage the build in ``directory``; the reason the load gives."""
    library, manifest = _library(directory), directory / "manifest.json"
    data = library.read_bytes()
    if damage == "truncated":
        library.write_bytes(data[:200_000])
        return rf"is 200000 bytes, {len(data)} when built \(truncated or incomplete\)"
    if damage == "garbage":
        library.write_bytes(os.urandom(len(data)))
        return r"does not match the SHA-256 of its build \(damaged or replaced\)"
    if damage == "no manifest":
        manifest.unlink()
        return r"has no manifest.json \(a build of another release, or an interrupted build or copy\)"
    if damage == "garbage manifest":
        manifest.write_text('{"name": ')
        return r"has an unreadable manifest.json \(JSONDecodeError\)"
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "name": "lightning_ext_kernels_cpu_000000000000"}))
    return r"has the manifest.json of another build \('lightning_ext_kernels_cpu_000000000000'\)"


@pytest.mark.parametrize(
    "damage", ["truncated", "garbage", "no manifest", "garbage manifest", "foreign manifest"]
)
def test_a_damaged_build_never_reaches_the_loader_and_is_refused_in_one_line(tmp_path, forks, damage):
    """Where no build can run (no compiler), a damaged build is refused: automatic selection takes
    ``reference`` with ONE warning naming the file and why, whole, from a cache deep in directories
    (a checkout deep in a home directory, a test runner's temporary directory); nothing is loaded (the
    truncated library itself, loaded, kills the process with SIGBUS)."""
    deep = tmp_path.joinpath(*["a-deep-directory"] * 12)
    deep.mkdir(parents=True)
    directory = _cache_copy(deep)
    library = _library(directory)
    reason = _damage(directory, damage)
    result = _python(forks, _AUTO, _environ(directory, CXX=_NO_CXX))
    assert result.returncode == 0, result.stderr
    name, *lines = result.stdout.splitlines()
    assert name == "reference" and len(lines) == 1, result.stdout
    assert re.match(
        rf"lightning_ext: kernel backend 'cpu' failed to load \({re.escape(str(library))} {reason}; cannot "
        rf"rebuild: C\+\+ compiler '{re.escape(_NO_CXX)}' not found",
        lines[0],
    ), lines[0]
    if damage == "truncated":  # what the verification prevents
        spec = f"u.spec_from_file_location('m', {str(library)!r})"
        load = f"import torch, importlib.util as u; u.module_from_spec({spec})"
        assert _python(forks, load, _environ(directory)).returncode == -signal.SIGBUS


def _refusing_to_read(read, root: Path):
    """``Path.read_bytes``/``read_text`` that fails the test for a file under ``root``."""

    def guarded(self, *args, **kwargs):
        assert root not in self.parents, f"read {self}"
        return read(self, *args, **kwargs)

    return guarded


@pytest.mark.parametrize("target", ["cache directory", "build directory", "library", "manifest"])
@pytest.mark.parametrize("problem", ["another owner", "group-writable", "world-writable"])
def test_an_untrusted_cache_is_refused_before_anything_is_read(tmp_path, monkeypatch, target, problem):
    """Like ssh with ``~/.ssh``: a cache directory, build directory or file that belongs to another user
    (not root), or that others may write, is refused with one line naming the path, its owner and mode
    and a HINT, before anything is read, loaded or built."""
    directory = _cache_copy(tmp_path)
    path = {"cache directory": directory.parent, "build directory": directory}.get(target)
    path = path or (_library(directory) if target == "library" else directory / "manifest.json")
    me = os.geteuid()
    if problem == "another owner" and me == 0:
        os.chown(path, 65534, -1)  # nobody: a real foreign owner
        why, hint = (
            "owned by uid 65534",
            f"set TORCH_EXTENSIONS_DIR to a directory of your own, or `chown -R 0 {path}`",
        )
    elif problem == "another owner":  # without root no file can be given away: this user looks foreign
        if target != "cache directory":
            pytest.skip("giving a file to another user needs root")
        monkeypatch.setattr(cpu.os, "geteuid", lambda: me + 1)
        why, hint = f"owned by uid {me}", "set TORCH_EXTENSIONS_DIR to a directory of your own"
        me += 1
    else:
        path.chmod(path.stat().st_mode | (0o020 if problem == "group-writable" else 0o002))
        why, hint = "writable by group or others", f"`chmod go-w {path}`"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory.parent))
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_import", lambda name, library: pytest.fail("loaded"))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: pytest.fail("built"))
    for read in ("read_bytes", "read_text"):  # nothing of the cache is read
        monkeypatch.setattr(Path, read, _refusing_to_read(getattr(Path, read), directory.parent))
    with pytest.raises(RuntimeError) as info:
        cpu.CpuBackend()
    mode = re.escape(stat.filemode(path.stat().st_mode))
    assert re.fullmatch(
        rf"refusing the kernel cache {re.escape(str(path))}: {why} \({mode}\); it must belong to you "
        rf"\(uid {me}\) or root and be writable by its owner only\. HINT: {re.escape(hint)}.*",
        str(info.value),
    ), str(info.value)


# ---------------------------------------------------------------------------------- builds
def _mock_build(monkeypatch, delay: float = 0.0) -> list[dict]:
    """Replace torch's build by one that takes ``delay`` seconds and writes a library readable by
    all (as under umask 000), and the import of a library by a stand-in; the list collects the
    build's arguments."""
    import torch.utils.cpp_extension

    calls = []

    def build(**kwargs):
        calls.append(kwargs)
        time.sleep(delay)
        library = Path(kwargs["build_directory"]) / f"{kwargs['name']}.so"
        library.write_bytes(b"\x7fELF built")
        library.chmod(0o777)
        return SimpleNamespace(__file__=str(library))

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    monkeypatch.setattr(cpu, "_import", lambda name, library: SimpleNamespace(__file__=str(library)))
    monkeypatch.setattr(cpu, "_cannot_build", lambda directory: None)
    return calls


def test_a_build_takes_the_lock_and_leaves_a_manifest_that_the_next_load_trusts(monkeypatch, tmp_path):
    """torch builds under the keyed name in its build directory while this process holds the build
    lock, after removing the lock file a killed torch build left; the library is made writable by its
    owner only and the manifest records it, so the next load reads it without building."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    name = cpu._extension_name()
    directory = tmp_path / name
    directory.mkdir(mode=0o755)
    (directory / _compat.BUILD_LOCK_FILE).write_text("")  # torch's, left by a killed build
    calls, held = _mock_build(monkeypatch), []

    def build(load=torch.utils.cpp_extension.load, **kwargs):
        fd = os.open(directory / "lightning_ext.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):  # held by the builder
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        held.append(not (directory / _compat.BUILD_LOCK_FILE).exists())
        return load(**kwargs)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    cpu._load()
    assert [(c["name"], c["build_directory"]) for c in calls] == [(name, str(directory))] and held == [True]
    library = directory / f"{name}.so"
    assert stat.S_IMODE(library.stat().st_mode) == 0o755
    assert json.loads((directory / "manifest.json").read_text()) == {
        "name": name, "bytes": 10, "sha256": hashlib.sha256(b"\x7fELF built").hexdigest()
    }  # fmt: skip
    monkeypatch.setattr(cpu, "_module", None)
    assert cpu._load().__file__ == str(library) and len(calls) == 1  # verified: not built again


def test_a_build_in_another_process_is_waited_for_and_announced_once(monkeypatch, tmp_path, caplog):
    """A process that finds another one building (its lock held) waits, says so once, where."""
    monkeypatch.setenv("RANK", "1")  # not rank zero: it speaks too
    monkeypatch.setattr(cpu, "_ANNOUNCE_AFTER_SECONDS", 0.2)
    monkeypatch.setattr(cpu, "_announced", False)
    holder = os.open(tmp_path / "lightning_ext.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(1.5, os.close, (holder,)).start()
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        with cpu._build_lock(tmp_path):
            assert time.perf_counter() - start > 1.4
        cpu._announce(tmp_path)  # a later build of the same process: silent
    assert [r.getMessage() for r in caplog.records] == [
        f"lightning_ext: waiting for another process to build the compiled CPU kernels in {tmp_path}, "
        "about 30 s once per environment. `python -m lightning_ext.kernels` builds them ahead of time."
    ]


def test_a_killed_build_leaves_no_lock(tmp_path):
    """The build lock is advisory: the kernel releases it when its holder dies, so the next build
    starts at once (torch 2.13's lock file would make it wait forever)."""
    take = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / 'lightning_ext.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(120)\n"
    )
    builder = subprocess.Popen([sys.executable, "-c", take], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline() == "locked\n"
    finally:
        builder.kill()  # SIGKILL: no clean-up of its own
        builder.wait(timeout=60)
    start = time.perf_counter()
    with cpu._build_lock(tmp_path):
        assert time.perf_counter() - start < 1.0


def test_a_blocking_build_is_announced_once_on_every_rank(monkeypatch, tmp_path, caplog):
    """A load that blocks longer than a few seconds (a first build, ~30 s) says why and where, once per
    process, on any rank (the ranks that wait for rank 0's build stall as long); a verified load says
    nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cpu, "_ANNOUNCE_AFTER_SECONDS", 0.2)
    monkeypatch.setattr(cpu, "_announced", False)
    directory = tmp_path / cpu._extension_name()
    for delay, announced in ((0.0, 0), (1.0, 1), (0.0, 1), (1.0, 1)):  # built, rebuilt, verified, rebuilt
        monkeypatch.setattr(cpu, "_module", None)
        if delay:
            (directory / "manifest.json").unlink(missing_ok=True)  # a build that fails verification
        _mock_build(monkeypatch, delay)
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            cpu._load()
            time.sleep(0.3)  # a timer that was not cancelled would have fired by now
        messages = [r.getMessage() for r in caplog.records if "compiled CPU kernels" in r.getMessage()]
        assert len(messages) == announced, messages
    assert messages == [
        f"lightning_ext: building the compiled CPU kernels in {directory}, about 30 s once per environment. "
        "`python -m lightning_ext.kernels` builds them ahead of time."
    ]


@pytest.mark.slow  # its fixture starts processes
def test_the_ahead_of_time_build_runs_cleanly(entry_point):
    """``python -m lightning_ext.kernels`` (the build is cached here, so it is quick) exits 0 without
    runpy's RuntimeWarning and prints the build directory and the time it took."""
    result, directory = entry_point["ahead of time"]
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr, result.stderr  # (torch 2.5's dynamo import leaves a
    # ResourceWarning of its own under -W default)
    directory = re.escape(str(directory))
    printed = rf"lightning_ext: cpu kernels (built|cached, loaded) in \d+\.\d s (in|from) {directory}\n"
    assert re.fullmatch(printed, result.stdout), result.stdout


def test_the_ahead_of_time_build_without_a_compiler_says_so(monkeypatch, tmp_path, capsys):
    """Without a C++ compiler (and no build in the cache) the entry point exits 1 naming what is
    missing, and builds nothing."""
    import torch.utils.cpp_extension

    from lightning_ext.kernels.__main__ import main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
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


def test_a_missing_compiler_is_one_short_warning_with_the_cause_first(tmp_path, forks):
    """A fresh process whose compiler is missing (and whose cache holds no build) selects ``reference``
    with ONE line of at most 300 characters that names the cause early, without torch's banner (torch
    is not asked to build)."""
    directory = tmp_path / cpu._extension_name()
    result = _python(forks, _AUTO, _environ(directory, CXX=_NO_CXX))
    assert result.returncode == 0, result.stderr
    name, *lines = result.stdout.splitlines()
    assert name == "reference" and len(lines) == 1, result.stdout
    assert len(lines[0]) <= 300 and lines[0].index(f"C++ compiler '{_NO_CXX}' not found") < 80, lines[0]
    assert "!! WARNING !!" not in result.stderr and not list(tmp_path.glob("*/*.so"))


def test_a_failed_compilation_is_one_line_and_the_output_is_logged_at_debug(monkeypatch, tmp_path, caplog):
    """A compiler error: the error line in the exception, the whole output at DEBUG."""
    output = (
        "[1/2] c++ -MMD " + "-isystem /long/include " * 40 + "\nkernels_cpu.cpp:7:1: error: expected ';'\n"
    )

    def failing(**kwargs):
        raise RuntimeError(f"Error building extension '{kwargs['name']}': {output}ninja: build stopped")

    message = _failed_build(monkeypatch, tmp_path, caplog, failing)
    assert message == "building the cpu kernels failed: kernels_cpu.cpp:7:1: error: expected ';'"
    assert output.strip() in caplog.text


def _failed_build(monkeypatch, tmp_path, caplog, failing) -> str:
    """The error of ``cpu._load()`` when torch's build is ``failing`` (its output logged at DEBUG)."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_cannot_build", lambda directory: None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing)
    with caplog.at_level(logging.DEBUG, logger=cpu.__name__), pytest.raises(RuntimeError) as info:
        cpu._load()
    return str(info.value)


def test_a_compiler_that_runs_but_fails_its_check_is_one_line(monkeypatch, tmp_path, caplog):
    """torch's compiler check raises CalledProcessError (a shim with no compiler selected): it escaped as
    that, with a traceback, where a failed build is one RuntimeError line."""
    import subprocess

    def failing(**kwargs):
        output = b"mise ERROR: no c++ selected\n"
        raise subprocess.CalledProcessError(126, ["c++", "--version"], output=output)

    message = _failed_build(monkeypatch, tmp_path, caplog, failing)
    assert message == "building the cpu kernels failed: mise ERROR: no c++ selected"


def test_a_build_writes_nothing_a_group_member_may_change_and_relinks_nothing_earlier(monkeypatch, tmp_path):
    """Under umask 002 torch's build left its object file and ninja's records group-writable: a group's
    member replaced the object file, and the next (re)build linked it, vouched for by the manifest."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    name = cpu._extension_name()
    directory = tmp_path / name
    directory.mkdir(mode=0o755)
    for planted in ("kernels_cpu.o", ".ninja_deps", ".ninja_log", "build.ninja"):
        (directory / planted).write_bytes(b"a group member's")
    _mock_build(monkeypatch)
    seen = []

    def build(load=torch.utils.cpp_extension.load, **kwargs):
        umask = os.umask(0)
        os.umask(umask)
        seen.append((umask & 0o022, sorted(p.name for p in directory.iterdir())))
        return load(**kwargs)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    previous = os.umask(0o002)
    try:
        cpu._load()
    finally:
        os.umask(previous)
    assert seen == [(0o022, ["lightning_ext.lock"])]  # the build under umask 022, from the source alone


def test_a_failed_build_falls_back_to_reference_with_one_warning(monkeypatch, tmp_path):
    """Automatic selection on CPU takes ``reference`` when the build fails (one warning, not retried);
    asking for ``cpu`` by name raises."""
    import torch.utils.cpp_extension

    attempts = []

    def broken(**kwargs):
        attempts.append(kwargs["name"])
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_cannot_build", lambda directory: None)
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


def test_the_defer_table_sends_its_cases_to_reference_and_nothing_else(monkeypatch):
    """Where a compiled kernel loses to ATen (bench_kernels.py's guard), the backend hands the call to
    the reference op, by one table, asked from 2^22 elements on. The table is empty: every op, dtype,
    layout and size runs the kernels (float16 with F16C); a rule in it sends exactly its large cases."""
    require_cpu_backend()
    from lightning_ext.kernels import OPS

    ops = (
        "batch_norm_moments",
        "batch_norm_elemt",
        "batch_norm_backward_reduce",
        "batch_norm_backward_elemt",
    )
    calls: list[str] = []
    for op in ops:
        original = OPS[op].impls["reference"]
        spy = lambda *args, _fn=original, _op=op: calls.append(_op) or _fn(*args)
        monkeypatch.setitem(OPS[op].impls, "reference", spy)
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    shift, mean, invstd = torch.zeros(4), torch.zeros(4), torch.ones(4)

    def deferred(backend) -> dict:  # {(dtype, format): ops sent to reference at 40 and 2^22 elements}
        out = {}
        for dtype in dtypes:
            for fmt in (torch.contiguous_format, torch.channels_last):
                calls.clear()
                xd = torch.randn(4, 4, 5, 2).to(dtype).contiguous(memory_format=fmt)
                backend.run("batch_norm_moments", xd, shift)
                backend.run("batch_norm_elemt", xd, mean, invstd, None, None)
                sums = backend.run("batch_norm_backward_reduce", xd, xd, mean)
                backend.run("batch_norm_backward_elemt", xd, xd, mean, invstd, None, sums, torch.tensor(40.0))
                large = torch.ones(4, 4, 2**9, 2**9, dtype=dtype).contiguous(memory_format=fmt)  # 2^22
                backend.run("batch_norm_elemt", large, mean, invstd, None, None)
                out[dtype, fmt] = list(calls)
        return out

    try:
        assert cpu._DEFER_TO_REFERENCE == {}
        assert not any(deferred(cpu.CpuBackend()).values())
        rule = {"batch_norm_elemt": lambda x: x.dtype == torch.float16 and x.is_contiguous()}
        monkeypatch.setattr(cpu, "_DEFER_TO_REFERENCE", rule)
        sent = {case: ops for case, ops in deferred(cpu.CpuBackend()).items() if ops}
        assert sent == {(torch.float16, torch.contiguous_format): ["batch_norm_elemt"]}  # the large one only
    finally:
        monkeypatch.undo()
        cpu.CpuBackend()  # the live instance the custom ops find is an unpatched one again


@pytest.mark.parametrize("size", [5, 7])
def test_accumulate_moments_refuses_a_row_of_another_size(size):
    """The kernel writes six float64 through a raw pointer: a row of another size (a benchmark kept the
    five-element row of an older layout) raises instead of writing past its end."""
    backend = require_cpu_backend()
    acc, shift = torch.zeros(size, dtype=torch.float64), torch.tensor(float("nan"), dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"`acc` must be a contiguous float64 row of 6 .*\[{size}\]"):
        backend.run("accumulate_moments_", acc, torch.ones(3), shift)


@pytest.mark.parametrize("op", ["moments_payload_", "moments_finish_", "pack_windows_"])
def test_the_flush_kernels_refuse_a_strided_tensor_naming_it(op):
    """The flush's compiled kernels read raw pointers: a strided view (a column of a table) would be read
    as the wrong elements, so each raises instead, naming the argument."""
    backend = require_cpu_backend()
    f64 = {"dtype": torch.float64}
    r = 3
    strided = torch.zeros(r, 5, **f64)[:, 1]  # a column: stride 5
    rows = torch.zeros(r, 6, **f64)
    calls = {
        "moments_payload_": lambda: backend.run(
            op, torch.zeros(1 + 5 * r, **f64), torch.zeros(r, 5, **f64), rows, strided,
            torch.zeros(r, **f64), [], torch.zeros(0, dtype=torch.int64), 0, 1,
        ),
        "moments_finish_": lambda: backend.run(
            op, torch.zeros(r, 6, **f64), strided, torch.zeros(r, **f64), torch.zeros(2, **f64), rows,
            torch.zeros(r, **f64), torch.zeros(4 * r, **f64), torch.zeros(r, 5, **f64), torch.zeros(r, **f64),
            True, 0,
        ),
        "pack_windows_": lambda: backend.run(
            op, torch.zeros(8, **f64), torch.zeros(1, 7, **f64), torch.zeros(5, dtype=torch.int64), rows,
            strided, torch.zeros(4 * r, **f64), torch.zeros(1, dtype=torch.int64), torch.ones(3, **f64), 8, 2,
        ),
    }  # fmt: skip
    argument = {"moments_payload_": "shifts", "moments_finish_": "next_shift", "pack_windows_": "shifts"}[op]
    with pytest.raises(RuntimeError, match=rf"{op}: `{argument}` must be a contiguous Double CPU tensor"):
        calls[op]()
