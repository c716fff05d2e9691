"""The examples of ``docs/guides/adding_a_kernel_op.md`` and ``kernel_backends.md`` run and print
what the pages say (without building the docs).

Each page in a fresh process: the first registers an op, the second a backend, which must not join
this process's tables (the other tests list every op and backend)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parents[2] / "docs" / "guides"


def _blocks(page: Path, kind: str) -> str:
    return "".join(re.findall(rf"```{{{kind}}}\n(.*?)```", page.read_text(), flags=re.DOTALL))


@pytest.mark.parametrize("page", ["adding_a_kernel_op.md", "kernel_backends.md"])
def test_the_page_examples_run_and_print_their_output(page):
    path = GUIDES / page
    code = "import torch\nimport lightning_ext\nlightning_ext.reset()\n" + _blocks(path, "testcode")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == _blocks(path, "testoutput")
