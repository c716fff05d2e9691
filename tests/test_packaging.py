"""The wheel: the package with its C++ source and PEP 561 marker, nothing from examples/, benchmarks/
or tests/; the library needs none of the examples' packages."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_ONLY = {"torchmetrics", "sklearn", "matplotlib", "tensorboard", "google_crc32c", "rich", "examples"}
# What a build must not see or write: environments, outputs and caches of the checkout
NOT_SOURCES = (
    ".git", ".venv*", "runs", "build", "dist", "*.egg-info", "__pycache__", "lightning_logs", "_build"
)


@pytest.mark.timeout(300)
def test_wheel_ships_the_package_source_and_marker_only(tmp_path: Path):
    # Built from a copy of the sources: setuptools writes build/ and *.egg-info next to what it builds,
    # which must not land in the checkout (nor a stale one there leak into the wheel).
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lightning_ext-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert {n.split("/")[0] for n in names} == {"lightning_ext", dist_info}
    assert "lightning_ext/csrc/kernels_cpu.cpp" in names and "lightning_ext/py.typed" in names
    assert not [n for n in names if "examples" in n.split("/")]
    assert "License-Expression: Apache-2.0" in metadata
    torchmetrics = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torchmetrics")]
    assert torchmetrics and all('extra == "examples"' in line for line in torchmetrics), torchmetrics


def _guarded(tree: ast.AST) -> set[ast.AST]:
    """The import statements of ``tree`` inside a ``try`` that catches ``ImportError``: optional ones."""
    guarded = set()
    for node in ast.walk(tree):
        caught = [h.type for h in getattr(node, "handlers", []) if isinstance(node, ast.Try)]
        if any(isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in caught):
            imports = (n for body in node.body for n in ast.walk(body))
            guarded |= {n for n in imports if isinstance(n, ast.Import | ast.ImportFrom)}
    return guarded


def test_the_library_imports_none_of_the_examples_packages():
    """Outside a ``try`` that falls back when they are missing (``TrainingStats`` uses TensorBoard's
    writer and google-crc32c where installed)."""
    imported = {}
    for path in sorted((ROOT / "lightning_ext").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if node in guarded:
                continue
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                if module.split(".")[0] in EXAMPLES_ONLY:
                    imported[f"{path.relative_to(ROOT)}:{node.lineno}"] = module
    assert not imported, f"the library imports packages only the examples extra installs: {imported}"
