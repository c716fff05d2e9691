"""What :class:`~lightning_ext.nn.SyncBatchNorm` calls while ``torch.compile`` traces a layer whose kernel
backend cannot be traced. Imported only then: marking a function for dynamo imports ``torch._dynamo``,
which an eager process never needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []  # the layer's private helper


@torch.compiler.disable
def _untraced_function(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` outside the graph: ``torch.compile`` breaks the graph here (with
    ``fullgraph=True`` it raises instead, naming this function)."""
    return function(*args)
