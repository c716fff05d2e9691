"""What :func:`~lightning_ext.kernels.get_backend` runs while ``torch.compile`` traces. Imported only
then (marking a function for dynamo imports ``torch._dynamo``, which an eager process never needs)."""

from __future__ import annotations

import torch

from lightning_ext.kernels import registry


@torch.compiler.assume_constant_result
def backend_name(name: str | None, device_type: str) -> str:
    """The name of the backend :func:`~lightning_ext.kernels.get_backend` selects. ``torch.compile``
    calls it outside the graph and keeps the value: dynamo cannot trace loading (a first lookup in a
    fresh worker process, after a reset, on a new device). The graph then takes the live instance
    the custom ops also find, guarded: a reset makes it trace again."""
    return registry._lookup(name, torch.device(device_type)).name
