"""``GradientSyncTimer``: when this rank's backward launched its last gradient all-reduce (pure torch)."""

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
    """A DDP communication hook that records when this rank launched the last gradient all-reduce of
    each backward pass, so that the wait in DDP's gradient all-reduce can be told from the backward.

    DDP all-reduces the gradients bucket by bucket while the backward runs and, before the backward
    returns, waits until every bucket is reduced, which lasts until the slowest rank has produced its
    gradients: every rank's backward is as long as the slowest one's, and the rank slow in its
    backward is the one that waits least. This rank's wait is the time from :attr:`last_launch` (the
    launch of the bucket DDP reduces last, ``GradBucket.is_last()``: this rank's gradients are all
    computed then) to the end of its backward. :class:`~lightning_ext.callbacks.IterationTimer`
    subtracts it from ``Timing/compute_sec``, as it subtracts
    :func:`~lightning_ext.distributed.collective_seconds`.

    :attr:`last_launch` is the host's ``time.perf_counter()``, or for gradients on a CUDA device, a
    CUDA event recorded on the stream of the backward (no host sync): with NCCL, whose all-reduces
    complete on the device, the wait is then the device's, from that event to an event recorded on
    the caller's stream after the backward.

    The hook wraps another (``hook``, default torch's ``allreduce_hook``: the mean of the gradients
    over the process group ``state``, DDP's built-in reduction up to rounding) and returns its
    future, so it adds no collective and nothing the ranks must agree on.

    Register :meth:`hook` with DDP (``ddp_model.register_comm_hook(state, timer.hook)``, Lightning's
    ``DDPStrategy(ddp_comm_hook=timer.hook, ddp_comm_state=state)``), or let :meth:`install` do it.

    Args:
        hook: the communication hook to wrap, ``hook(state, bucket) -> Future[Tensor]`` (PowerSGD,
            compression, ...); ``None``: ``allreduce_hook``.

    Raises:
        TypeError: ``hook`` is neither ``None`` nor callable.

    Source: torch ``DistributedDataParallel.register_comm_hook`` and ``default_hooks.allreduce_hook``.

    Example::

        >>> timer = GradientSyncTimer()
        >>> timer.launches, timer.last_launch
        (0, None)
    """

    def __init__(self, hook: Callable | None = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(
                "GradientSyncTimer: `hook` must be None or a DDP communication hook, a callable "
                f"(state, bucket) -> Future[Tensor], got {hook!r} ({type(hook).__name__})"
            )
        self.inner = allreduce_hook if hook is None else hook
        #: The number of backward passes that launched their last bucket (each sets :attr:`last_launch`).
        self.launches = 0
        #: When the latest of them launched its last bucket, as ``perf_counter()`` or a CUDA event.
        self.last_launch: float | torch.cuda.Event | None = None

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook DDP calls for each bucket: ``self.inner(state, bucket)``."""
        if bucket.is_last():
            if bucket.buffer().is_cuda:
                self.last_launch = torch.cuda.Event(enable_timing=True)
                self.last_launch.record()
            else:
                self.last_launch = time.perf_counter()
            self.launches += 1
        return self.inner(state, bucket)

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
