"""Fixtures for the kernel tests: every backend that can run here, on CPU.

The Triton backend runs in Triton's interpreter (``TritonBackend(interpret=True)``), chosen per
backend instance, so no ``TRITON_INTERPRET`` environment variable has to be set before ``import
triton`` and the other tests of the session keep compiled Triton untouched.
"""

from __future__ import annotations

import pytest

from lightning_ext.kernels import KernelBackend, get_backend
from lightning_ext.kernels._triton import HAS_TRITON

BACKENDS = ["reference", "triton-interpret"]


def make_backend(name: str) -> KernelBackend:
    if name == "reference":
        return get_backend("reference", device="cpu")
    if not HAS_TRITON:
        pytest.skip("triton is not installed (extra `triton`)")
    from lightning_ext.kernels.triton_backend import TritonBackend

    return TritonBackend(interpret=True)


@pytest.fixture(params=BACKENDS)
def backend(request) -> KernelBackend:
    return make_backend(request.param)


@pytest.fixture
def reference() -> KernelBackend:
    return get_backend("reference", device="cpu")
