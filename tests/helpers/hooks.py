"""One iteration of ``HookRunner``'s docstring loop, shared by the hook tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def one_iteration(
    runner: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    before_after_step: Callable[[torch.Tensor], None] | None = None,
    **after_step_kwargs: Any,
) -> torch.Tensor:
    """``before_step``, a squared-output loss, backward, ``after_backward``, the optimizer step, then
    ``before_after_step(loss)`` if given and ``after_step(loss, **after_step_kwargs)``; the loss."""
    runner.before_step()
    loss = model(x).square().mean()
    loss.backward()
    runner.after_backward()
    optimizer.step()
    optimizer.zero_grad()
    if before_after_step is not None:
        before_after_step(loss)
    runner.after_step(loss, **after_step_kwargs)
    return loss
