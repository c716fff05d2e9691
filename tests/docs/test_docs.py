"""The documentation site builds strictly, documents every public name and links every page.

One strict build (``sphinx-build -W --keep-going``: HTML with the notebooks executed, then the guides'
examples as doctests, from the environment the first build read) into a temporary directory, shared by
the tests of this module. Skipped when the ``docs`` extra (Sphinx, myst-nb, furo) is not installed.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

for _module in ("sphinx", "myst_nb", "furo"):
    pytest.importorskip(_module, reason=f"the docs extra is not installed ({_module} is missing)")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from api_coverage import missing_entries, public_names  # noqa: E402

# On an idle 2-core machine the HTML build takes ~170 s (the notebooks ~135 s) and the doctests ~100 s;
# conftest.py starts this module first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _sphinx(builder: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``sphinx-build -b builder`` into ``out/builder``, its environment in ``out/doctrees`` (read by the
    first build, the notebooks executed; the next builds reuse it), run to its end."""
    command = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", builder,
        "-d", str(out / "doctrees"), str(DOCS), str(out / builder),
    ]  # fmt: skip
    # MPLBACKEND=Agg as in CI (.ci/run exports it): the notebooks' figures must render even so.
    env = {**os.environ, "LIGHTNING_EXT_DOCS_EXECUTE": "force", "MPLBACKEND": "Agg"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: ``<dir>/html`` (the notebooks executed), ``<dir>/doctrees`` and
    ``<dir>/doctest``: ``make docs``'s two builds, one after the other, the doctests from the environment
    the HTML build read (the site's pages as built, without reading them again)."""
    out = tmp_path_factory.mktemp("docs")
    for builder in ("html", "doctest"):
        build = _sphinx(builder, out)
        problems = [line for line in build.stderr.splitlines() if "WARNING" in line or "ERROR:" in line]
        failed = build.stdout.find("Failed example:")  # a doctest's failure, whole: a flaky one is read once
        first = f"\n--- the first failed example ---\n{build.stdout[max(0, failed - 300) : failed + 8000]}"
        assert build.returncode == 0, (
            f"sphinx-build -b {builder} failed ({build.returncode}); warnings are errors:\n"
            + "\n".join(problems)
            + (first if failed >= 0 else "")
            + f"\n--- stdout (end) ---\n{build.stdout[-4000:]}"
            + f"\n--- stderr (end) ---\n{build.stderr[-4000:]}"
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


# pyplot functions that make a new figure; each figure a notebook makes is one image output.
_FIGURE_FUNCTIONS = {"figure", "subplots", "subplot_mosaic"}


def _figures_made(source: str) -> int:
    """Number of ``plt.figure``/``plt.subplots``/``plt.subplot_mosaic`` calls in a code cell's source
    (IPython magics and shell lines dropped). A figure made in a loop counts once: such a cell fails
    the check below until it is counted otherwise."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    return sum(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _FIGURE_FUNCTIONS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "plt"
        for node in ast.walk(ast.parse(code))
    )


class _OutputImages(HTMLParser):
    """The ``src`` of every ``<img>`` inside a ``div.cell_output`` (a rendered notebook output)."""

    def __init__(self) -> None:
        super().__init__()
        self._divs: list[bool] = []  # per open <div>: whether it is or is inside a cell output
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div":
            classes = (dict(attrs).get("class") or "").split()
            self._divs.append(bool(self._divs and self._divs[-1]) or "cell_output" in classes)
        elif tag == "img" and self._divs and self._divs[-1]:
            self.sources.append(dict(attrs).get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._divs:
            self._divs.pop()


def test_notebook_pages_show_every_figure(site: Path):
    """Every figure a notebook makes is an image/png output of its cell in the executed notebook and
    an image on its page, also with ``MPLBACKEND=Agg`` in the environment (see ``_sphinx``)."""
    made_total = 0
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = [c for c in json.loads(source.read_text())["cells"] if c["cell_type"] == "code"]
        executed = json.loads((site / "jupyter_execute" / "notebooks" / source.name).read_text())
        ran = [c for c in executed["cells"] if c["cell_type"] == "code"]
        assert len(ran) == len(code), f"{source.name}: the executed notebook has other cells"
        made = 0
        for index, (cell, run) in enumerate(zip(code, ran)):
            expected = _figures_made("".join(cell["source"]))
            shown = sum("image/png" in output.get("data", {}) for output in run.get("outputs", []))
            assert shown == expected, (
                f"{source.name}, code cell {index}: makes {expected} figure(s) but its executed outputs "
                f"hold {shown} image/png; HINT: `%matplotlib inline` in the first code cell (a kernel "
                "inherits MPLBACKEND, and Agg shows nothing), and no `matplotlib.use(...)` after it"
            )
            made += expected
        page = site / "html" / "notebooks" / f"{source.stem}.html"
        parser = _OutputImages()
        parser.feed(page.read_text())
        assert len(parser.sources) == made, (
            f"{page.name}: {len(parser.sources)} image(s) in its cell outputs, its notebook makes {made}"
        )
        for src in parser.sources:
            image = (page.parent / src).resolve()
            assert image.is_file() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{page.name}: {src}"
        uses_pyplot = any("pyplot" in "".join(c["source"]) for c in code)
        assert made > 0 or not uses_pyplot, f"{source.name} imports pyplot but no figure was counted"
        made_total += made
    assert made_total > 0, "no notebook makes a figure: was _FIGURE_FUNCTIONS outgrown?"


def test_benchmark_results_are_included(site: Path):
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    first_section = re.search(r"^## (.+)$", results, re.MULTILINE).group(1)
    html = (site / "html" / "benchmarks.html").read_text()
    words = re.findall(r"[A-Za-z]{4,}", first_section)[:3]
    assert all(word in html for word in words), f"benchmarks.html lacks {first_section!r}"
