"""Test-session set-up shared by ``lightning_ext`` doctests, ``examples``, ``tests`` and the notebooks.

Without a GPU, Triton's kernels run on CPU tensors in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects; it must be set before anything imports ``triton``.

Test tiers (CONTRIBUTING.md): a test that starts processes through ``run_distributed``
(tests/helpers/distributed.py) or a Trainer strategy that starts them (``"ddp_spawn"``,
``"ddp_notebook"``, ...) or directly (``subprocess``, ``multiprocessing``'s ``spawn``), itself or through a
function of its module, is marked ``slow`` here; other tests that start processes (a whole job through a
helper of another module) carry ``@pytest.mark.slow`` themselves.
``make test-fast`` runs ``-m "not slow or smoke"``.
"""

import inspect
import os
import re
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A result must not depend on the shell the tests run from (these reach the processes tests start too):
# with FORCE_COLOR or TTY_COMPATIBLE set, rich treats a pipe as a terminal (colours the numbers a test
# matches, re-wraps printed lines); the package's switches pick the backend and the collectives' path,
# which the tests choose themselves.
_SHELL_SWITCHES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LIGHTNING_EXT_KERNELS",
                   "LIGHTNING_EXT_SHM_COLLECTIVES", "LIGHTNING_EXT_CHECK_COLLECTIVES")  # fmt: skip
for _switch in _SHELL_SWITCHES:
    os.environ.pop(_switch, None)

# run_distributed, a spawning strategy, or a process started directly (subprocess, multiprocessing)
_STARTS_PROCESSES = re.compile(
    r"run_distributed|ddp_(spawn|fork|notebook)\w*|subprocess|Popen|spawn|start_processes"
)


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names and the strings ``code`` uses, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
        elif isinstance(const, str):
            names.add(const)
    return names


def _starts_processes(function: types.FunctionType, depth: int = 2) -> bool:
    names = _names(function.__code__)
    if any(_STARTS_PROCESSES.fullmatch(name) for name in names):
        return True
    module = sys.modules.get(function.__module__)
    helpers = [getattr(module, name, None) for name in names if name.isidentifier()]
    return depth > 0 and any(
        inspect.isfunction(helper)
        and helper.__module__ == function.__module__
        and _starts_processes(helper, depth - 1)
        for helper in helpers
    )


# The longest test files (pytest's `--durations=0` under `make test`, summed per file), longest first:
# run first (`make test` keeps pytest-xdist's queue in this order, `--no-loadscope-reorder`), so that the
# two workers end together, the many short files filling the end (longest-processing-time-first).
_LONGEST_FIRST = (
    "tests/docs/test_docs.py",  # ~320 s
    "tests/nn/test_compile_resnet.py",  # ~70 s
    "tests/kernels/test_cpu.py",
    "tests/examples/test_digits.py",
    "tests/callbacks/test_throughput.py",
    "tests/examples/test_gan.py",
    "tests/kernels/test_batch_norm.py",
    "tests/examples/test_fabric_digits.py",
    "tests/nn/test_compile.py",
    "tests/plugins/test_compiled_training.py",  # ~35 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if inspect.isfunction(function) and _starts_processes(function):
            item.add_marker(pytest.mark.slow)
    first = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # (stable)
