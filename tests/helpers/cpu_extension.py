"""``require_cpu_backend()``: the compiled ``cpu`` kernel backend, or a skip where it cannot exist.

Where a C++ compiler and ninja are installed (CI), the extension must build and load: a source that
no longer compiles fails the tests instead of silently leaving every test on ``reference``. Without
a toolchain the tests that need it are skipped (``reference`` is tested either way).
"""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["require_cpu_backend"]


def require_cpu_backend():
    from torch.utils.cpp_extension import is_ninja_available

    from lightning_ext.kernels import CpuBackend

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or not is_ninja_available():
        pytest.skip(f"no C++ toolchain ({compiler!r} and ninja) to build the cpu kernel backend")
    return CpuBackend()
