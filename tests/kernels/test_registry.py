"""Registry: resolution order, explicit failures, one-warning auto fallback, entry points, validation,
``clear_backend_cache()``."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from lightning_ext import _compat
from lightning_ext.kernels import (
    BACKEND_ENV_VAR,
    BackendEntry,
    CpuBackend,
    KernelBackend,
    ReferenceBackend,
    available_backends,
    clear_backend_cache,
    get_backend,
    register_backend,
    registry,
)
from tests.helpers.cpu_extension import require_cpu_backend


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    """Each test sees the built-in registry, no cache, no warning issued yet; restored afterwards."""
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    saved = dict(registry._entries)
    saved_ep = registry._entry_points_loaded
    for name in set(saved) - {"reference", "cpu", "triton"}:  # e.g. a doctest's registration
        del registry._entries[name]
    clear_backend_cache()
    yield
    registry._entries.clear()
    registry._entries.update(saved)
    registry._entry_points_loaded = saved_ep
    clear_backend_cache()


def _broken():
    raise ImportError("libfancy.so: cannot open shared object file")


class _CpuReference(ReferenceBackend):
    name = "cpu_ref"


class _CudaOnly(ReferenceBackend):
    name = "cuda_only"

    def supports(self, device_type: str) -> bool:
        return device_type == "cuda"


def test_builtin_backends_and_resolution(monkeypatch):
    entries = available_backends()
    assert list(entries)[:3] == ["triton", "cpu", "reference"]  # highest priority first
    assert entries["triton"].devices == ("cuda",) and entries["triton"].priority == 10
    assert entries["cpu"].devices == ("cpu",) and entries["cpu"].priority == 5
    assert entries["reference"].priority == 0 and "meta" in entries["reference"].devices
    # Auto on a device only `reference` supports; cached per process and device type.
    backend = get_backend(device=torch.device("meta"))
    assert type(backend) is ReferenceBackend
    assert get_backend(device="meta") is backend is get_backend("reference", "meta")
    # The environment variable beats auto; the explicit argument beats the environment variable.
    register_backend("cpu_ref", _CpuReference, devices=("cpu",), priority=-1)
    monkeypatch.setenv(BACKEND_ENV_VAR, "cpu_ref")
    assert isinstance(get_backend(device="cpu"), _CpuReference)
    assert type(get_backend("reference", device="cpu")) is ReferenceBackend
    monkeypatch.setenv(BACKEND_ENV_VAR, "auto")
    assert type(get_backend(device="meta")) is ReferenceBackend


def test_auto_selects_the_compiled_cpu_backend_on_cpu():
    """On CPU, `cpu` (priority 5) beats `reference` (0); `triton` (CUDA only) is not a candidate even
    where its interpreter could run CPU tensors."""
    require_cpu_backend()
    backend = get_backend(device="cpu")
    assert type(backend) is CpuBackend and backend.name == "cpu"
    assert get_backend(device="cpu") is backend is get_backend("cpu", "cpu")
    assert type(get_backend("reference", "cpu")) is ReferenceBackend


def test_clear_backend_cache_forgets_instances_failures_cache_and_the_warning():
    """After `clear_backend_cache()` the next lookup builds backends again (a failed factory is
    retried) and the fallback warns again; registrations stay."""
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise ImportError("not yet")
        return _CpuReference()

    register_backend("flaky", flaky, devices=("meta",), priority=100)
    with pytest.warns(RuntimeWarning, match=r"'flaky' failed to load \(not yet\)"):
        assert type(get_backend(device="meta")) is ReferenceBackend
    registry._cache.clear()
    assert type(get_backend(device="meta")) is ReferenceBackend and len(calls) == 1  # failure cached
    first = get_backend("reference", "meta")
    clear_backend_cache()
    assert "flaky" in available_backends()
    assert type(get_backend(device="meta")) is _CpuReference and len(calls) == 2  # retried
    assert get_backend("reference", "meta") is not first  # built again
    register_backend("broken", _broken, devices=("xpu",), priority=100)
    clear_backend_cache()
    with pytest.warns(RuntimeWarning, match=r"'broken' failed to load .*; using 'reference' for xpu tensors"):
        assert type(get_backend(device="xpu")) is ReferenceBackend


def test_explicit_failures_raise(monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"unknown kernel backend 'nope' \(from argument `name`\); "
        r"registered backends: \['cpu', 'reference', 'triton'\]",
    ):
        get_backend("nope", "cpu")
    monkeypatch.setenv(BACKEND_ENV_VAR, "nope")
    with pytest.raises(
        ValueError, match=r"unknown kernel backend 'nope' \(from environment variable LIGHTNING_EXT_KERNELS\)"
    ):
        get_backend(device="cpu")
    monkeypatch.delenv(BACKEND_ENV_VAR)
    register_backend("cuda_only", _CudaOnly, devices=("cuda",))
    with pytest.raises(
        ValueError,
        match=r"kernel backend 'cuda_only' \(from argument `name`\) supports devices \('cuda',\), not 'cpu'; "
        r"registered backends: \['cpu', 'cuda_only', 'reference', 'triton'\]",
    ):
        get_backend("cuda_only", "cpu")
    register_backend("broken", _broken, devices=("cpu",), priority=100)
    with pytest.raises(
        RuntimeError,
        match=r"kernel backend 'broken' \(from argument `name`\) failed to load: "
        r"ImportError\('libfancy.so.*registered backends: \['broken'",
    ) as info:
        get_backend("broken", "cpu")
    assert isinstance(info.value.__cause__, ImportError)
    register_backend("not_a_backend", lambda: object(), devices=("cpu",))
    with pytest.raises(
        RuntimeError, match=r"factory of kernel backend 'not_a_backend' returned <object.*not a KernelBackend"
    ):
        get_backend("not_a_backend", "cpu")
    with pytest.raises(TypeError, match=r"`name` must be a backend name \(str\) or None, got 3"):
        get_backend(3, "cpu")


def test_auto_fallback_warns_once_per_process():
    register_backend("broken", _broken, devices=("meta", "xpu"), priority=100)
    with pytest.warns(
        RuntimeWarning,
        match=r"^lightning_ext: kernel backend 'broken' failed to load \(libfancy.so: cannot open "
        r"shared object file\); using 'reference' for meta tensors \(warned once per process; "
        r"LIGHTNING_EXT_KERNELS=reference silences it\)$",
    ):
        assert type(get_backend(device="meta")) is ReferenceBackend
    registry._cache.clear()  # even when resolution runs again, or for another device: no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(get_backend(device="meta")) is ReferenceBackend
        assert type(get_backend(device="xpu")) is ReferenceBackend


def test_register_and_validate_entries():
    entry = register_backend("cpu_ref", _CpuReference, devices=["cpu"], priority=3)
    assert entry == BackendEntry("cpu_ref", _CpuReference, ("cpu",), 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.priority = 4
    with pytest.raises(
        ValueError, match=r"kernel backend 'cpu_ref' is already registered; pass replace=True"
    ):
        register_backend("cpu_ref", _CpuReference, devices=("cpu",))
    register_backend("cpu_ref", _CpuReference, devices=("cpu",), priority=7, replace=True)
    assert available_backends()["cpu_ref"].priority == 7
    with pytest.raises(ValueError, match=r"`name` must match .* got 'Bad Name'"):
        register_backend("Bad Name", _CpuReference, devices=("cpu",))
    with pytest.raises(TypeError, match=r"`factory` must be callable returning a KernelBackend, got 42"):
        register_backend("x", 42, devices=("cpu",))
    with pytest.raises(ValueError, match=r"`devices` must name at least one device type, got \(\)"):
        register_backend("x", _CpuReference, devices=())
    with pytest.raises(ValueError, match=r"`devices` contains 'warp', which is not a torch device type"):
        register_backend("x", _CpuReference, devices=("warp",))
    with pytest.raises(TypeError, match=r"`priority` must be an int, got 'high'"):
        register_backend("x", _CpuReference, devices=("cpu",), priority="high")
    assert "x" not in available_backends()


def test_entry_point_backends(tmp_path, monkeypatch):
    """A package installed with entry points in group `lightning_ext.kernels` is found lazily."""
    pkg = tmp_path / "lx_plugin_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from lightning_ext.kernels import ReferenceBackend, register_backend

            class PluginBackend(ReferenceBackend):
                name = "plugin"
                devices = ("cpu",)
                priority = -5

            def register():
                register_backend("plugin_hook", PluginBackend, devices=("cpu",), priority=-6)
            """
        )
    )
    dist = tmp_path / "lx_plugin_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lx-plugin-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[lightning_ext.kernels]\n"
        "plugin = lx_plugin_pkg:PluginBackend\n"
        "plugin_hook = lx_plugin_pkg:register\n"
        "plugin_broken = lx_plugin_pkg:does_not_exist\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    registry._entry_points_loaded = False
    with pytest.warns(
        RuntimeWarning, match=r"entry point 'plugin_broken' \(lx_plugin_pkg:does_not_exist\) failed to load"
    ):
        names = available_backends()
    assert names["plugin"].priority == -5 and names["plugin"].devices == ("cpu",)
    assert "plugin_hook" in names and "plugin_broken" not in names
    backend = get_backend("plugin", device="cpu")
    assert isinstance(backend, KernelBackend) and type(backend).__name__ == "PluginBackend"
    moments = backend.run("batch_norm_moments", torch.tensor([[1.0], [3.0]]), torch.zeros(1))
    assert moments.tolist() == [2.0, 4.0, 10.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_triton_without_gpu_raises_unless_interpreting(monkeypatch):
    """Without a GPU, `triton` fails to load (explicitly: raises; automatically: `reference` with the
    warning) unless TRITON_INTERPRET=1, which `TritonBackend.__init__` reads: then it runs CPU tensors."""
    pytest.importorskip("triton")
    if _compat.triton_interpreter_limit():
        pytest.skip(_compat.triton_interpreter_limit())
    from lightning_ext.kernels import TritonBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        RuntimeError,
        match=r"kernel backend 'triton' \(from argument `name`\) failed to load: "
        r"RuntimeError\(.*needs a CUDA device",
    ):
        get_backend("triton", "cuda")
    clear_backend_cache()
    with pytest.warns(
        RuntimeWarning,
        match=r"'triton' failed to load \(the 'triton' kernel backend needs a CUDA device.*"
        r"using 'reference' for cuda",
    ):
        assert type(get_backend(device="cuda")) is ReferenceBackend
    with pytest.raises(
        RuntimeError,
        match=r"needs a CUDA device \(torch.cuda.is_available\(\) is False\). "
        r"HINT: TRITON_INTERPRET=1, set before triton is imported, runs its kernels on CPU tensors.",
    ):
        TritonBackend()

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = TritonBackend()
    assert backend.name == "triton" and backend.supports("cpu") and backend.supports("cuda")
    moments = backend.run("batch_norm_moments", torch.tensor([[1.0], [3.0]]), torch.zeros(1))
    assert moments.dtype == torch.float64 and moments.tolist() == [2.0, 4.0, 10.0]
    clear_backend_cache()
    assert type(get_backend("triton", "cpu")) is TritonBackend  # named explicitly: serves CPU tensors
    with pytest.raises(
        ValueError, match=r"kernel backend 'triton' .* supports devices \('cuda',\), not 'meta'"
    ):
        get_backend("triton", "meta")  # but no device it does not support
    assert get_backend(device="cpu").name != "triton"  # automatic selection never picks the interpreter


def _imports(path, package: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module at ``path`` imports, at its top or in a function (not
    under ``if TYPE_CHECKING``); ``from a import b`` imports ``a.b`` when that is a module, else ``a``."""
    name = ".".join(path.relative_to(path.parents[len(package.split("."))]).with_suffix("").parts)
    base = name.removesuffix(".__init__") if path.name == "__init__.py" else name.rpartition(".")[0]
    found, stack = set(), [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parent = base.rsplit(".", node.level - 1)[0] if node.level else ""
            origin = ".".join(p for p in (parent, node.module) if p)
            found |= {f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names}
        stack.extend(ast.iter_child_nodes(node))
    return found & modules


def test_the_kernels_package_has_no_import_cycle():
    """No module of ``lightning_ext.kernels`` imports, through any chain of imports at module top or
    in functions, a module that imports it back (each cache owns its reset; the registry reaches into
    no other module's state)."""
    import lightning_ext.kernels as package

    root = Path(package.__file__).parent
    paths = {
        ".".join((package.__name__, *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph = {name: _imports(path, package.__name__, set(paths)) - {name} for name, path in paths.items()}
    for start in graph:
        seen, frontier = set(), set(graph[start])
        while frontier:
            module = frontier.pop()
            assert module != start, f"{start} imports itself back through {sorted(seen)}"
            if module not in seen:
                seen.add(module)
                frontier |= graph[module]


def test_replace_must_be_a_bool():
    # replace="no" (truthy) replaced the built-in reference backend, its devices with it.
    from lightning_ext.kernels import ReferenceBackend, registry

    with pytest.raises(TypeError, match=r"register_backend: `replace` must be a bool"):
        registry.register_backend("reference", ReferenceBackend, ("cpu",), replace="no")
    assert "cuda" in registry._entries["reference"].devices


class _Scaled(ReferenceBackend):
    """``check_finite``'s reference times ``factor`` (two registrations of one class, two factors)."""

    name, devices = "scaled", ("cpu",)

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def kernel(self, op):
        reference = super().kernel(op)
        if op != "check_finite":
            return reference
        return lambda tensors, device: reference(tensors, device) * self.factor


def test_a_backend_below_reference_is_never_chosen_and_a_subclass_keeps_to_its_devices():
    register_backend("below", _CpuReference, devices=("cpu", "meta"), priority=-1)
    assert get_backend(device="meta").name == "reference"  # (it was "below": reference sorted last)
    register_backend("cpu_only", _Scaled, devices=("cpu",))
    with pytest.raises(ValueError, match=r"supports devices \('cpu',\), not 'meta'"):
        get_backend("cpu_only", device="meta")  # (ReferenceBackend's subclasses supported every device)


def test_compiled_graphs_run_the_backend_registered_under_the_name_they_use():
    # The ops under torch.compile found their backend by the class's name: two registrations of one
    # class ran the last one's kernels, and a subclass that kept "reference" replaced reference
    scaled = ("scaled1", "scaled2")
    register_backend("scaled1", lambda: _Scaled(1.0), devices=("cpu",), priority=-1)
    register_backend("scaled2", lambda: _Scaled(2.0), devices=("cpu",), priority=-1)
    register_backend("forgot_its_name", lambda: type("Mine", (_Scaled,), {"name": "reference"})(100.0),
                     devices=("cpu",), priority=-1)  # fmt: skip
    x = torch.tensor([1.0, float("inf"), 3.0])
    backends = [get_backend(n, device="cpu") for n in ("scaled1", "scaled2", "forgot_its_name", "reference")]
    for backend in backends:  # (all built before any graph runs)
        compiled = torch.compile(lambda t, b=backend: b.run("check_finite", [t], t.device), fullgraph=True)
        torch.testing.assert_close(compiled(x), backend.run("check_finite", [x], x.device))
    found = {n: float(get_backend(n, device="cpu").run("check_finite", [x], x.device)) for n in scaled}
    assert found == {"scaled1": 1.0, "scaled2": 2.0}  # (check_finite: 1.0 where a value is not finite)
