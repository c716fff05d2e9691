"""``GradientSyncTimer``: the seconds this rank waits in DDP's gradient all-reduce (pure torch)."""

# No ``from __future__ import annotations`` here: DDP checks a communication hook's annotations and
# refuses them as strings.
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_ext._compat import ddp_comm_hooks

__all__ = ["GradientSyncTimer"]


class GradientSyncTimer:
    """A DDP communication hook that times how long this rank waits in the gradient all-reduce.

    DDP all-reduces the gradients bucket by bucket while the backward runs, then waits at the end of
    the backward until every bucket is reduced, which lasts until the slowest rank has produced its
    gradients: DDP makes every rank's backward as long as the slowest one's, and the rank slow in its
    backward is the one that waits least. Per backward pass, the wait is the host time from the launch
    of the last bucket (``GradBucket.is_last()``, when this rank's gradients are all computed) to the
    completion of the last all-reduce (its future's callback). :meth:`seconds` sums them;
    :class:`~lightning_ext.callbacks.IterationTimer` subtracts them from ``Timing/compute_sec``, as it
    subtracts :func:`~lightning_ext.distributed.collective_seconds`.

    The hook wraps another (``hook``, default torch's ``allreduce_hook``: the mean of the gradients
    over the process group ``state``, DDP's built-in reduction up to rounding) and passes its result
    through unchanged, so it adds no collective and nothing the ranks must agree on. On gloo
    a future completes when the all-reduce is done, so the wait is what the host waited. On NCCL
    (CUDA) a future completes when the all-reduce is enqueued: the wait is then nearly zero and the
    device's wait is not counted. No host sync.

    Register :meth:`hook` with DDP (``ddp_model.register_comm_hook(state, timer.hook)``, Lightning's
    ``DDPStrategy(ddp_comm_hook=timer.hook, ddp_comm_state=state)``), or let :meth:`install` do it.

    Args:
        hook: the communication hook to time, ``hook(state, bucket) -> Future[Tensor]`` (PowerSGD,
            compression, ...); ``None``: ``allreduce_hook``.

    Raises:
        TypeError: ``hook`` is neither ``None`` nor callable.

    Source: torch ``DistributedDataParallel.register_comm_hook`` and ``default_hooks.allreduce_hook``.

    Example::

        >>> timer = GradientSyncTimer()
        >>> timer.seconds()
        0.0
    """

    def __init__(self, hook: Callable | None = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(
                "GradientSyncTimer: `hook` must be None or a DDP communication hook, a callable "
                f"(state, bucket) -> Future[Tensor], got {hook!r} ({type(hook).__name__})"
            )
        self.inner = allreduce_hook if hook is None else hook
        self._waited = 0.0  # seconds waited in the backward passes before the current one
        self._current = 0.0  # seconds waited in the current (or last) backward pass
        self._last_launch: float | None = None  # perf_counter at the current pass's last bucket

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook DDP calls for each bucket: ``self.inner(state, bucket)``, timed."""
        if self._last_launch is not None:  # the first bucket of a new backward pass
            self._waited, self._current, self._last_launch = self._waited + self._current, 0.0, None
        if bucket.is_last():
            self._last_launch = time.perf_counter()
        return self.inner(state, bucket).then(self._done)

    def _done(self, future: torch.futures.Future) -> Any:
        if self._last_launch is not None:  # a bucket completed after this rank launched its last
            self._current = max(self._current, time.perf_counter() - self._last_launch)
        return future.value()

    def seconds(self) -> float:
        """Host seconds this rank has waited in the gradient all-reduce so far (monotonic; the current
        backward pass counts once it ended)."""
        return self._waited + self._current

    @classmethod
    def install(cls, model: DistributedDataParallel) -> "GradientSyncTimer | None":
        """The timer of ``model``'s gradient all-reduce: the one registered as its communication hook,
        else a new one registered now (with ``model.process_group``); ``None`` when ``model`` has another
        communication hook (DDP takes one only: then nothing changes).

        Raises:
            TypeError: ``model`` is not a ``DistributedDataParallel``.
        """
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "GradientSyncTimer.install: `model` must be a DistributedDataParallel, "
                f"got {type(model).__name__}"
            )
        hooks = ddp_comm_hooks(model)
        if hooks:
            timer = getattr(hooks[0][0], "__self__", None)
            return timer if isinstance(timer, cls) else None
        timer = cls()
        model.register_comm_hook(model.process_group, timer.hook)
        return timer
