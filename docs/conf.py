"""Sphinx configuration of the lightning_ext documentation (see docs/README.md).

Strict by design: built with ``sphinx-build -W --keep-going`` and ``nitpicky = True``, so a broken
cross-reference, a docstring that does not parse, a failing notebook or a public name missing from
the API reference stops the build. The build needs no network: intersphinx is off unless
``LIGHTNING_EXT_DOCS_INTERSPHINX=1`` (then the Python, PyTorch and Lightning inventories are fetched
and their names become links); references to third-party names are otherwise accepted by the
documented ``nitpick_ignore_regex`` below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's lightning_ext, also without an editable install
sys.path.insert(0, str(DOCS / "_ext"))

# Without a GPU, the Triton backend runs in Triton's interpreter (as in the test suite's conftest.py);
# it must be set before anything imports triton.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lightning_ext  # noqa: E402

# -- Project -------------------------------------------------------------------------------------
project = "lightning_ext"
author = "the lightning_ext authors"
copyright = "the lightning_ext authors, Apache-2.0"
release = lightning_ext.__version__
version = ".".join(release.split(".")[:2])

# -- General ---------------------------------------------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.viewcode",
    "myst_nb",  # MyST Markdown pages and executed notebooks (includes myst_parser)
    "api_coverage",  # docs/_ext/api_coverage.py: every name of every `__all__` is in the reference
]
root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
nitpicky = True
suppress_warnings: list[str] = []  # nothing is silenced: every warning fails the build

# -- MyST / MyST-NB --------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Notebooks (docs/notebooks/*.ipynb link to notebooks/) run at every build; an error fails it.
# LIGHTNING_EXT_DOCS_EXECUTE=off|cache|force overrides the mode (``off`` for quick local edits).
nb_execution_mode = os.environ.get("LIGHTNING_EXT_DOCS_EXECUTE", "force")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_allow_errors = False
nb_merge_streams = True

# -- autodoc / napoleon ----------------------------------------------------------------------------
autodoc_default_options = {"member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = False  # True rewrites __defaults__ in this process: the doctests would see it
autoclass_content = "class"
autodoc_inherit_docstrings = False  # Lightning's hook docstrings (its own roles and labels) stay out
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
napoleon_custom_sections = ["Shape"]  # torch's BatchNorm-style `Shape:` section, rendered as written

# -- doctest (the guides' ``testcode`` blocks; run with ``sphinx-build -b doctest``) --------------
# The setup leaves no name a reader's copy of a block would lack (a block imports what it uses) but the
# docs' own helpers, run_script and quiet_lightning.
doctest_global_setup = """
import os as _os
_os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch as _torch
_torch.manual_seed(0)
_torch.set_num_threads(1)
import lightning_ext as _lightning_ext
_lightning_ext.reset()
from docs_helpers import run_script, quiet_lightning
quiet_lightning()
del _os, _torch
"""
doctest_global_cleanup = """
_lightning_ext.reset()
"""
doctest_test_doctest_blocks = ""  # the docstrings' ``>>>`` examples run under pytest --doctest-modules

# -- intersphinx (opt-in: the build must not need the network) -------------------------------------
if os.environ.get("LIGHTNING_EXT_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
        "lightning": ("https://lightning.ai/docs/pytorch/stable", None),
    }
    intersphinx_timeout = 10

# Third-party names without an inventory in the offline build, by package (with
# LIGHTNING_EXT_DOCS_INTERSPHINX=1 most of them become links). A reference to any `lightning_ext`
# name that does not resolve is still an error.
nitpick_ignore_regex = [
    (r"py:.*", r"torch(\..+)?"),  # torch.Tensor, torch.device, torch.nn.Module, torch.optim.Optimizer, ...
    (r"py:.*", r"lightning(\..+)?"),  # lightning.pytorch.Trainer, LightningModule, Precision, Fabric, ...
    (r"py:.*", r"numpy(\..+)?"),  # numpy.ndarray
    # the standard library: collections.abc.Sequence, argparse.Namespace, pathlib.Path, re.Pattern, ...
    (r"py:.*", r"(abc|argparse|collections|contextlib|pathlib|re|types|weakref)\..+"),
]
# Generic signatures: their TypeVars are private to their modules and have no entry.
nitpick_ignore_regex.append((r"py:class", r"lightning_ext(\.\w+)*\.(T|_B)"))
# DynamicLossScaler's private base, which only carries the __new__ of DynamicLossScaler(per_optimizer=True).
nitpick_ignore_regex.append((r"py:class", r"lightning_ext\.amp\.dynamic_loss_scaler\._PerOptimizerNew"))

# -- HTML ------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"lightning_ext {release}"
html_static_path = ["_static"]
html_css_files = ["side_by_side.css", "tables.css"]  # "Coming from" columns; tables that fit the page
html_show_sourcelink = False
html_copy_source = False
