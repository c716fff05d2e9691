"""``DDPSyncTimer``: when this rank waits in DistributedDataParallel's synchronizations (pure torch)."""

# No ``from __future__ import annotations`` here: DDP checks a communication hook's annotations and
# refuses them as strings.
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_ext._clock import now
from lightning_ext._compat import ddp_comm_hooks

__all__ = ["DDPSyncTimer"]


class DDPSyncTimer:
    """Record when this rank waits in DistributedDataParallel's two synchronizations: the buffer
    broadcast at the start of each forward and the gradient all-reduce at the end of each backward.

    A rank that arrives late at either makes the others wait there, so their phases last as long as
    the late rank's: DDP makes every rank's backward as long as the slowest one's, and the rank slow
    in its backward is the one that waits least. The timer records

    - :attr:`forward_waits`: per forward, ``(start, end)`` of DDP's work before the model's own
      forward (the buffer broadcast, where a rank slow before its forward, in its data or its
      optimizer step, makes the others wait), from forward pre-hooks on the DDP model and on its
      ``module``;
    - :attr:`last_launch`: per backward, when this rank launched the last bucket of the gradient
      all-reduce (``GradBucket.is_last()``: its gradients are all computed then), as its
      communication hook; the wait runs from there to the end of the backward (DDP waits for every
      bucket before the backward returns).

    :class:`~lightning_ext.callbacks.IterationTimer` subtracts both from ``Timing/compute_sec``, as it
    subtracts :func:`~lightning_ext.distributed.collective_seconds`. The times are the host's
    ``time.perf_counter()`` or, for a model on a CUDA device, CUDA events recorded on the current
    stream (no host sync): with NCCL, whose collectives complete on the device, the waits are then
    the device's.

    The communication hook wraps another (``hook``, default torch's ``allreduce_hook``: the mean of
    the gradients over the process group ``state``, DDP's built-in reduction up to rounding) and
    returns its future, so the timer adds no collective and nothing the ranks must agree on.
    :meth:`install` registers the hooks; to time your own communication hook, register
    ``DDPSyncTimer(your_hook).hook`` with DDP (``ddp_model.register_comm_hook(state, timer.hook)``,
    Lightning's ``DDPStrategy(ddp_comm_hook=timer.hook, ddp_comm_state=state)``) before ``install``.

    Args:
        hook: the communication hook to wrap, ``hook(state, bucket) -> Future[Tensor]`` (PowerSGD,
            compression, ...); ``None``: ``allreduce_hook``.

    Raises:
        TypeError: ``hook`` is neither ``None`` nor callable.

    Source: torch ``DistributedDataParallel`` (``register_comm_hook``, ``default_hooks.allreduce_hook``,
    the buffer broadcast of its forward).

    Example::

        >>> timer = DDPSyncTimer()
        >>> timer.launches, timer.last_launch, timer.forward_waits
        (0, None, [])
    """

    def __init__(self, hook: Callable | None = None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(
                "DDPSyncTimer: `hook` must be None or a DDP communication hook, a callable "
                f"(state, bucket) -> Future[Tensor], got {hook!r} ({type(hook).__name__})"
            )
        self.inner = allreduce_hook if hook is None else hook
        #: The number of backward passes that launched their last bucket (each sets :attr:`last_launch`).
        self.launches = 0
        #: When the latest of them launched its last bucket, as ``perf_counter()`` or a CUDA event.
        self.last_launch: float | torch.cuda.Event | None = None
        #: ``(start, end)`` of DDP's work before each forward since the list was last emptied (its reader
        #: empties it).
        self.forward_waits: list[tuple[Any, Any]] = []
        self._forward_start: Any = None
        self._models: weakref.WeakSet = weakref.WeakSet()  # the DDP models whose forwards are timed

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The communication hook DDP calls for each bucket: ``self.inner(state, bucket)``."""
        if bucket.is_last():
            self.last_launch = now(bucket.buffer().is_cuda)
            self.launches += 1
        return self.inner(state, bucket)

    @classmethod
    def install(cls, model: DistributedDataParallel) -> "DDPSyncTimer | None":
        """The timer of ``model``: the one registered as its communication hook, else a new one
        registered now (with ``model.process_group``), its forwards timed; ``None`` when ``model`` has
        another communication hook (DDP takes one only: then nothing changes).

        Raises:
            TypeError: ``model`` is not a ``DistributedDataParallel``.
        """
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"DDPSyncTimer.install: `model` must be a DistributedDataParallel, got {type(model).__name__}"
            )
        hooks = ddp_comm_hooks(model)
        timer = getattr(hooks[0][0], "__self__", None) if hooks else cls()
        if not isinstance(timer, cls):
            return None
        if not hooks:
            model.register_comm_hook(model.process_group, timer.hook)
        if model not in timer._models:
            timer._models.add(model)
            cuda = next(model.parameters()).is_cuda
            model.register_forward_pre_hook(lambda *_: timer._forward(now(cuda), start=True))
            model.module.register_forward_pre_hook(lambda *_: timer._forward(now(cuda), start=False))
        return timer

    def _forward(self, now: Any, start: bool) -> None:
        """DDP's forward begins (``start``), or the model's own forward in it."""
        if not start and self._forward_start is not None:
            self.forward_waits.append((self._forward_start, now))
        self._forward_start = now if start else None
