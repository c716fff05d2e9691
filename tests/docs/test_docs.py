"""The documentation site builds strictly, documents every public name and links every page.

One strict build (``sphinx-build -W --keep-going``: HTML with the notebooks executed, then the guides'
examples as doctests) into a temporary directory, shared by the tests of this module. Skipped when
the ``docs`` extra (Sphinx, myst-nb, furo) is not installed.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

for _module in ("sphinx", "myst_nb", "furo"):
    pytest.importorskip(_module, reason=f"the docs extra is not installed ({_module} is missing)")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from api_coverage import missing_entries, public_names  # noqa: E402

# The notebooks take ~60 s and the guides' examples ~60 s on 2 cores; Sphinx itself ~30 s.
pytestmark = pytest.mark.timeout(900)


def _sphinx(builder: str, out: Path, doctrees: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", builder,
        "-d", str(doctrees), str(DOCS), str(out / builder),
    ]  # fmt: skip
    env = {**os.environ, "LIGHTNING_EXT_DOCS_EXECUTE": "force", "MPLBACKEND": "Agg"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: ``<dir>/html``, ``<dir>/doctest`` and ``<dir>/doctrees``."""
    out = tmp_path_factory.mktemp("docs")
    doctrees = out / "doctrees"
    for builder in ("html", "doctest"):  # doctest reuses the environment pickled by the html build
        result = _sphinx(builder, out, doctrees)
        problems = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR:" in line]
        assert result.returncode == 0, (
            f"sphinx-build -b {builder} failed ({result.returncode}); warnings are errors:\n"
            + "\n".join(problems)
            + f"\n--- stdout (end) ---\n{result.stdout[-4000:]}"
            + f"\n--- stderr (end) ---\n{result.stderr[-4000:]}"
        )
    return out


def _inventory(path: Path) -> dict[str, set[str]]:
    """``{domain:role: {name, ...}}`` from a Sphinx ``objects.inv`` (version 2)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):  # "# Sphinx inventory version 2", project, version, "zlib" line
        header_end = data.index(b"\n", header_end) + 1
    assert data.startswith(b"# Sphinx inventory version 2"), data[:60]
    entries: dict[str, set[str]] = {}
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        match = re.match(r"(.+?)\s+(\S+)\s+(-?\d+)\s+?(\S*)\s+(.*)", line)
        if match:
            entries.setdefault(match.group(2), set()).add(match.group(1))
    return entries


def test_site_builds_strictly_and_the_examples_pass(site: Path):
    report = (site / "doctest" / "output.txt").read_text()
    assert re.search(r"\b0 failures in tests", report), report[-3000:]
    tests = int(re.search(r"(\d+) tests", report.split("Doctest summary")[-1]).group(1))
    assert tests >= 20, f"only {tests} doctests ran; were the testcode blocks found?\n{report[-2000:]}"
    assert (site / "html" / "index.html").is_file()


def test_every_public_name_has_a_reference_entry(site: Path):
    inventory = _inventory(site / "html" / "objects.inv")
    objects = set().union(*(names for role, names in inventory.items() if role.startswith("py:")))
    missing = missing_entries(objects, inventory.get("py:module", set()))
    assert not missing, "public names without an API reference entry: " + ", ".join(
        f"{n.module}.{n.name} (document it as {' or '.join(n.targets)})" for n in missing
    )
    # The packages' own __all__ are documented under the package path itself.
    packages = ("lightning_ext", *(f"lightning_ext.{p}" for p in (
        "stats", "callbacks", "amp", "plugins", "nn", "kernels", "distributed")))  # fmt: skip
    for name in public_names():
        if name.module in packages and not name.is_module:
            target = f"{name.module}.{name.name}"
            assert target in objects, f"{target} is not in the reference"


def _reachable(env_pickle: Path) -> tuple[set[str], set[str]]:
    """(docnames reachable from the root document through toctrees, all docnames)."""
    with env_pickle.open("rb") as f:
        env = pickle.load(f)
    seen, todo = set(), [env.config.root_doc]
    while todo:
        doc = todo.pop()
        if doc not in seen:
            seen.add(doc)
            todo.extend(env.toctree_includes.get(doc, ()))
    return seen, set(env.found_docs)


def test_every_page_is_reachable_from_the_index(site: Path):
    reachable, found = _reachable(site / "doctrees" / "environment.pickle")
    guides = {d for d in found if d.startswith(("guides/", "coming_from/", "notebooks/", "api/"))}
    assert {"getting_started", "benchmarks", "guides/index", "coming_from/index"} <= found
    assert len([d for d in guides if d.startswith("guides/")]) >= 7, sorted(guides)
    assert found <= reachable, f"pages no toctree reaches from the index: {sorted(found - reachable)}"


def test_notebooks_are_rendered_with_their_outputs(site: Path):
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for name in notebooks:
        page = site / "html" / "notebooks" / f"{name}.html"
        assert page.is_file(), f"notebooks/{name}.ipynb is not in the site: link it from docs/notebooks/"
        html = page.read_text()
        assert 'class="cell_output' in html, f"{name}: no cell outputs rendered (was it executed?)"
    assert "all checks passed" in (site / "html" / "notebooks" / "02_loss_scaling.html").read_text()


def test_benchmark_results_are_included(site: Path):
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    first_section = re.search(r"^## (.+)$", results, re.MULTILINE).group(1)
    html = (site / "html" / "benchmarks.html").read_text()
    words = re.findall(r"[A-Za-z]{4,}", first_section)[:3]
    assert all(word in html for word in words), f"benchmarks.html lacks {first_section!r}"
