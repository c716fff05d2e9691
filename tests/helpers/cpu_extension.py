"""``require_cpu_extension()``: the compiled CPU kernels of SyncBatchNorm, or a skip where they cannot exist.

Where a C++ compiler and ninja are installed (CI), the extension must build and load: a source that
no longer compiles fails the tests instead of silently leaving every test on the Python path. Without
a toolchain the tests that need the extension are skipped (the Python path is tested either way).
"""

from __future__ import annotations

import os
import shutil
from types import ModuleType

import pytest

__all__ = ["require_cpu_extension"]


def require_cpu_extension() -> ModuleType:
    from lightning_ext.kernels import cpu_extension

    if not cpu_extension.enabled():
        pytest.skip(f"{cpu_extension.ENV_VAR} disables the CPU extension")
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or not is_ninja_available():
        pytest.skip(f"no C++ toolchain ({compiler!r} and ninja) to build the CPU extension")
    module = cpu_extension.load()
    assert module is not None, "the CPU extension did not build or load: see the RuntimeWarning"
    return module
