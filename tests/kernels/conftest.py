"""Fixtures for the kernel tests: every backend that can run here.

``triton`` runs on CUDA when a GPU is present, else on CPU tensors in Triton's interpreter (the root
``conftest.py`` sets ``TRITON_INTERPRET=1`` before ``triton`` is imported).
"""

from __future__ import annotations

import pytest
import torch

from lightning_ext import _compat
from lightning_ext.kernels import KernelBackend, get_backend
from lightning_ext.kernels._triton import HAS_TRITON
from tests.helpers.cpu_extension import require_cpu_backend

BACKENDS = ["reference", "cpu", "triton"]


def make_backend(name: str) -> KernelBackend:
    if name == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed (extra `triton`)")
    if name == "triton" and not torch.cuda.is_available() and _compat.triton_interpreter_limit():
        pytest.skip(_compat.triton_interpreter_limit())
    if name == "triton":
        from lightning_ext.kernels import TritonBackend

        return TritonBackend()
    if name == "cpu":
        return require_cpu_backend()
    return get_backend(name, device="cpu")  # reference, or a backend registered to be tested here


def backend_device(backend: KernelBackend) -> torch.device:
    """Where the backend's test tensors live: CUDA for compiled Triton, else the CPU."""
    if backend.name == "triton" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture(params=BACKENDS)
def backend(request) -> KernelBackend:
    return make_backend(request.param)


@pytest.fixture
def reference() -> KernelBackend:
    return get_backend("reference", device="cpu")
