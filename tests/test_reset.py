"""``lightning_ext.reset()``: every process-wide cache of the package is filled, then emptied by it.

The module-level state of the package is found in the sources (an empty mutable container at module
top, or a name a ``global`` statement rebinds): each must be cleared by the reset and checked
below, or be listed in ``KEPT`` with the reason it outlives a reset.
"""

from __future__ import annotations

import ast
import importlib
import logging
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lightning_ext
from lightning_ext.distributed import all_reduce as all_reduce_module
from lightning_ext.kernels import (
    BACKEND_ENV_VAR,
    _triton,
    available_backends,
    backend,
    cpu,
    get_backend,
    registry,
    unscale,
)
from lightning_ext.perf import peaks
from lightning_ext.stats import Collector, init_multiprocessing, report, reporting

PACKAGE = Path(lightning_ext.__file__).parent

# (module, name) of the state lightning_ext.reset() empties: test_reset_empties_every_cache checks each.
CLEARED = {
    ("lightning_ext.stats.reporting", "_state"),
    ("lightning_ext.kernels.registry", "_built"),
    ("lightning_ext.kernels.registry", "_cache"),
    ("lightning_ext.kernels.registry", "_entry_points_loaded"),
    ("lightning_ext.kernels.registry", "_from_entry_points"),
    ("lightning_ext.kernels.registry", "_fallback_warned"),
    ("lightning_ext.kernels.unscale", "_META_CACHE"),
    ("lightning_ext.kernels._triton", "_SM_COUNT"),
    ("lightning_ext.kernels.cpu", "_announced"),
    ("lightning_ext.distributed.all_reduce", "_routes"),
    ("lightning_ext.perf.peaks", "_measured"),
}
# (module, name) -> why it outlives lightning_ext.reset().
KEPT = {
    ("lightning_ext.kernels.registry", "_entries"): "registrations (built-in and register_backend's) stay",
    ("lightning_ext.kernels.cpu", "_module"): "a compiled extension module cannot be unloaded",
    ("lightning_ext.kernels.cpu", "_DEFER_TO_REFERENCE"): "the defer table: configuration, never written at "
    "run time (empty: no op defers)",
    ("lightning_ext.kernels.backend", "OPS"): "op registrations (define_op, at import) stay, as torch's "
    "custom ops do",
    ("lightning_ext.kernels.backend", "_LIVE"): "the latest instance of each backend, which the custom ops "
    "run: a graph traced before a reset still runs; a backend built again replaces it",
    ("lightning_ext.callbacks.hook_base", "_instance_ids"): "hooks alive across a reset keep distinct ids",
    ("lightning_ext.callbacks.loss_monitor", "_RUNS"): "a LossMonitor run alive across a reset keeps a stage "
    "no later run takes (every rank counts the same runs)",
    ("lightning_ext.nn.sync_batch_norm", "_untraced_warned"): "weak: holds no backend a reset dropped; a "
    "backend built after a reset warns again",
}

_EMPTY_FACTORIES = {"dict", "list", "set", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "count"}


def _module_state(path: Path) -> set[str]:
    """Module-level names of ``path`` that hold process-wide state: bound at module top to an empty
    container (or a counter), or rebound by a ``global`` statement."""
    tree = ast.parse(path.read_text())
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    state = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        display = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, ast.List | ast.Set) and not value.elts
        )
        empty = display or (
            isinstance(value, ast.Call)
            and not value.args
            and (getattr(value.func, "attr", None) or getattr(value.func, "id", None)) in _EMPTY_FACTORIES
        )
        for target in targets:
            if (
                isinstance(target, ast.Name)
                and not target.id.startswith("__")
                and (empty or target.id in rebound)
            ):
                state.add(target.id)
    return state


def test_every_process_wide_state_is_cleared_or_kept_for_a_reason() -> None:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found |= {(module, name) for name in _module_state(path)}
    known = CLEARED | set(KEPT)
    assert found == known, (
        f"state that lightning_ext.reset() neither clears nor keeps for a reason: {sorted(found - known)}; "
        f"listed here but gone: {sorted(known - found)}"
    )


class _Group:
    """Stands for a process group: the weak key of a route."""


@pytest.fixture
def plugin_path(tmp_path):
    """A package on ``sys.path`` whose distribution registers a backend through the entry-point group;
    the registry as it was afterwards."""
    (tmp_path / "lx_reset_plugin.py").write_text(
        textwrap.dedent(
            """
            from lightning_ext.kernels import ReferenceBackend

            class ResetPlugin(ReferenceBackend):
                name = "reset_plugin"
                devices = ("cpu",)
                priority = -5
            """
        )
    )
    dist = tmp_path / "lx_reset_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lx-reset-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[lightning_ext.kernels]\nreset_plugin = lx_reset_plugin:ResetPlugin\n"
    )
    saved = dict(registry._entries)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    lightning_ext.reset()  # the group is read again at the next lookup
    yield
    sys.path.remove(str(tmp_path))
    importlib.invalidate_caches()
    registry._entries.clear()
    registry._entries.update(saved)
    lightning_ext.reset()


def test_reset_empties_every_cache(plugin_path, monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")  # report() needs no compiled backend here
    # stats: settings, a collector, a pending value of a name it wants
    reporting._sync_settings()  # resolved from torch.distributed (not initialized: single process)
    init_multiprocessing(0, None)
    collector = Collector(regex="Loss/.*")
    report("Loss/a", 1.0)
    collector.update()  # a drain: counted
    del collector  # a dead collector: its names are pruned at the next drain
    collector = Collector(regex="Loss/.*", quantiles="Loss/a")
    report("Loss/a", 1.0)  # with a sketch (its edges cached)
    report("Loss/b", [])  # a name registered without values
    reporting.set_stage("validate")  # and a stage left set
    # kernels: a selection and a build, the live instance, the entry points, the fallback warning
    assert "reset_plugin" in available_backends()
    get_backend("reference", device="cpu")
    registry._fallback_warned = True  # what the first failed automatic selection sets
    unscale._bucket_metadata([torch.ones(5)], 1024)  # the launch metadata of the Triton kernel
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132)
    )
    assert _triton.sm_count(torch.device("cuda", 0)) == 132
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        cpu._announce(tmp_path)  # a process that blocked on a build said so (once)
    extension = object()  # stands for the loaded extension: kept
    monkeypatch.setattr(cpu, "_module", extension)
    # distributed: a group's route (a real one sets a segment up: tests/distributed/test_all_reduce.py)
    group = _Group()
    all_reduce_module._routes[group] = all_reduce_module._Route(torch.device("cpu"), None)
    # perf: a measured matmul rate
    peaks.measure_peak_flops(torch.float32, "cpu", size=16)

    filled = {
        "_state": reporting._state != reporting._State(),
        "_built": bool(registry._built),
        "_cache": bool(registry._cache),
        "_entry_points_loaded": registry._entry_points_loaded,
        "_from_entry_points": "reset_plugin" in registry._from_entry_points,
        "_fallback_warned": registry._fallback_warned,
        "_META_CACHE": bool(unscale._META_CACHE),
        "_SM_COUNT": bool(_triton._SM_COUNT),
        "_announced": cpu._announced,
        "_routes": group in all_reduce_module._routes,
        "_measured": bool(peaks._measured),
    }
    assert {name for _, name in CLEARED} == set(filled)
    assert all(filled.values()), filled

    lightning_ext.reset()

    stats = reporting._state
    assert stats == reporting._State(), stats  # the one object of report()'s state, replaced
    assert not registry._built and not registry._cache and not registry._fallback_warned
    assert not registry._entry_points_loaded and not registry._from_entry_points
    assert "reset_plugin" not in registry._entries  # read again from the group at the next lookup
    assert {"reference", "cpu", "triton"} <= set(registry._entries)  # registrations stay
    assert not unscale._META_CACHE and not _triton._SM_COUNT
    assert "reference" in backend._LIVE  # kept: see KEPT
    assert not peaks._measured
    assert not cpu._announced
    assert cpu._module is extension  # kept: see KEPT
    assert group not in all_reduce_module._routes

    # Everything comes back on demand.
    report("Loss/a", 2.0)
    collector.update()
    assert collector.names() == []  # detached by the reset: it received nothing (a new collector would)
    assert "reset_plugin" in available_backends()
    assert get_backend("reference", device="cpu") is backend._LIVE["reference"]
