"""``HookRunner``: drive ``HookBase`` hooks from a Fabric or plain PyTorch loop (detectron2's TrainerBase)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.callbacks.throughput import Throughput
from lightning_ext.distributed import get_rank, get_world_size

__all__ = ["HookRunner"]


class HookRunner:
    """Run :class:`HookBase` hooks (IterationTimer, LossMonitor, PreciseBN, your own) without a Trainer.

    detectron2's ``TrainerBase`` calls its hooks from its own loop; a ``HookRunner`` is that driver for
    a loop you write (``lightning.Fabric`` or plain PyTorch). The loop calls::

        runner.before_train()                  # once (or `with runner:` around the whole loop)
        for epoch in range(max_epochs):
            runner.before_epoch()              # restarts the data-time clocks
            for i, batch in enumerate(loader):
                runner.before_step()           # once the batch is fetched: the wait for it is data time
                loss = ...; backward           # with accumulation: several micro-batches
                runner.after_backward()        # after EVERY backward
                optimizer step                 # taken or skipped (AMP): an iteration either way
                runner.after_step(loss, is_last_batch=i + 1 == len(loader))
        runner.after_train(exception)          # once: None on success, else the exception

    Each call runs, on every hook in order, the Lightning hook the Trainer would call (``on_train_start``,
    ``on_train_epoch_start``, ``on_train_batch_start``, ``on_after_backward``, ``on_train_batch_end``
    with ``outputs=loss``, ``on_train_end`` or ``on_exception``), so a hook behaves as under a Trainer:
    one iteration is one ``before_step``/``after_step`` pair, and :attr:`HookBase.iter` reads the
    runner's :attr:`iter` (detectron2's ``trainer.iter``), the one count all hooks share. It is also
    the step of the rows the hooks write (``LossMonitor``'s): log your own rows of iteration ``i`` at
    step ``i`` too (``runner.iter`` until its :meth:`after_step` returns), as a Trainer's ``self.log``
    does, so that the steps of a logger never go backwards.

    Inside the hooks ``self.trainer`` is (a weak proxy to) this runner, as detectron2's hooks see their
    trainer, and ``self.pl_module`` is ``module``. The runner offers the Trainer attributes the hooks
    read: :attr:`global_step`, :attr:`is_last_batch`, :attr:`loggers`, :attr:`callback_metrics`,
    :attr:`train_dataloader`, :attr:`global_rank`, :attr:`world_size`, :attr:`is_global_zero`,
    :attr:`callbacks` (the hooks), ``strategy.batch_to_device(batch)``,
    ``strategy.precision_plugin.forward_context()`` and ``convert_input(batch)`` (the batch as is).

    Errors: as in a Trainer (see :class:`HookBase`): an exception from a hook carries a PEP 678 note
    naming the hook and method; :meth:`after_train` runs each started hook's ``after_train`` once, on
    failure with ``self.exception`` set and the errors of those ``after_train`` noted on the original
    exception, which the caller re-raises (``with runner:`` does).

    Collectives and syncs: the runner adds none; the hooks run theirs (``LossMonitor``: its collector's
    two all-reduces every ``every_n_train_steps`` iterations and at a successful ``after_train``, with
    :attr:`iter` as the step the ranks must share, so a rank a step ahead raises on every rank;
    ``PreciseBN``: its updates), so every rank must make the same calls in the same order.
    Checkpoints: :meth:`state_dict`.

    Source: detectron2 ``engine/train_loop.py`` (``TrainerBase.train``: ``before_train``, then
    ``before_step``/``run_step``/``after_step`` per iteration, ``after_train`` in ``finally``).

    Args:
        hooks: :class:`HookBase` instances, called in this order (put ``IterationTimer`` first).
        module: the model being trained (a Fabric-wrapped one too): the hooks' ``pl_module``, the model
            whose BatchNorm layers ``PreciseBN`` updates.
        fabric: a launched ``lightning.Fabric``, or ``None``. It gives the rank and world size, the
            loggers, ``fabric.to_device`` and ``fabric.autocast()``; without it: ``torch.distributed``'s
            rank, no loggers, batches moved to ``module``'s device, no autocast.
        loggers: Lightning or Fabric loggers the hooks write to (default: ``fabric.loggers``, or none).
        train_dataloader: the training loader: the data of a ``PreciseBN`` without ``data_loader``.

    Raises:
        TypeError: a hook is not a :class:`HookBase`, or is a ``Throughput`` (it needs a Trainer), or
            ``module`` not an ``nn.Module``.
        ValueError: a hook is given twice.

    Example::

        >>> from lightning_ext.callbacks import IterationTimer
        >>> model = nn.Linear(3, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> timer = IterationTimer(warmup_iter=0)
        >>> with HookRunner([timer], model) as runner:
        ...     for x in torch.ones(4, 2, 3):
        ...         runner.before_step()
        ...         loss = model(x).square().mean()
        ...         loss.backward()
        ...         runner.after_backward()
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...         runner.after_step(loss)
        >>> runner.global_step, timer.timed_iters
        (4, 4)
    """

    def __init__(
        self,
        hooks: Sequence[HookBase],
        module: nn.Module,
        *,
        fabric: Any = None,
        loggers: Sequence[Any] | None = None,
        train_dataloader: Any = None,
    ) -> None:
        hooks = list(hooks)
        for hook in hooks:
            if not isinstance(hook, HookBase):
                raise TypeError(f"HookRunner: `hooks` must hold HookBase instances, got {hook!r}")
            if isinstance(hook, Throughput):
                raise TypeError(
                    "HookRunner: Throughput needs a Lightning Trainer (the batches it hands its callbacks, "
                    "and the flush of a TrainingStats). HINT: in a plain loop, lightning_ext.perf "
                    "(count_flops, mfu, GoodputLedger) gives the same figures to report()"
                )
        if len({id(h) for h in hooks}) != len(hooks):
            raise ValueError(f"HookRunner: each hook may be given once, got {hooks!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"HookRunner: `module` must be a torch.nn.Module, got {module!r}")
        #: the hooks, in call order (Lightning's name is ``trainer.callbacks``).
        self.callbacks: list[HookBase] = hooks
        self.module = module
        self.fabric = fabric
        #: the loggers ``LossMonitor`` writes to on rank zero.
        self.loggers: list[Any] = list(loggers if loggers is not None else getattr(fabric, "loggers", ()))
        #: the loader ``PreciseBN`` reads when it has no ``data_loader``.
        self.train_dataloader = train_dataloader
        #: iterations completed (``after_step`` calls, skipped AMP steps included); restored by
        #: :meth:`load_state_dict`.
        self.global_step = 0
        #: the iteration that :attr:`HookBase.iter` reads (detectron2's ``trainer.iter``): ``i`` from
        #: the end of the previous :meth:`after_step` (before the loop fetches the batch) through
        #: iteration ``i``'s own, so after a failure the iteration that failed; ``global_step`` at
        #: :meth:`before_train` and after the last iteration.
        self.iter = 0
        #: the last ``after_step`` ended an epoch (``PreciseBN(every_n_train_steps=None)`` updates then).
        self.is_last_batch = False
        #: metrics the hooks publish (``LossMonitor/<key>``, ``Timing/data_sec_max``): 0-dim tensors.
        self.callback_metrics: dict[str, torch.Tensor] = {}
        #: what ``PreciseBN`` reads from ``trainer.strategy``.
        self.strategy = types.SimpleNamespace(
            batch_to_device=self._batch_to_device,
            precision_plugin=types.SimpleNamespace(
                forward_context=self._forward_context, convert_input=lambda batch: batch
            ),
        )
        self._running = False  # before_train ran and after_train has not yet
        self._in_step = False  # between before_step and after_step
        self._batch_idx = 0  # iterations since before_epoch (the batch_idx the hooks receive)
        for hook in hooks:
            hook.setup(self, module, "fit")  # state keys by position, like a Trainer's callbacks

    # ------------------------------------------------------------------ the Trainer attributes
    @property
    def global_rank(self) -> int:
        """This process's rank (Fabric's, else ``torch.distributed``'s; 0 without it)."""
        return self.fabric.global_rank if self.fabric is not None else get_rank()

    @property
    def world_size(self) -> int:
        """Number of processes (Fabric's, else ``torch.distributed``'s; 1 without it)."""
        return self.fabric.world_size if self.fabric is not None else get_world_size()

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank zero."""
        return self.global_rank == 0

    def _batch_to_device(self, batch: Any) -> Any:
        if self.fabric is not None:
            return self.fabric.to_device(batch)
        tensor = next(iter(self.module.parameters()), None)
        return batch if tensor is None else move_data_to_device(batch, tensor.device)

    def _forward_context(self) -> contextlib.AbstractContextManager:
        return self.fabric.autocast() if self.fabric is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ the loop's calls
    def before_train(self) -> None:
        """Start training: each hook's ``before_train`` (``iter = start_iter = global_step``).

        If a hook raises, the hooks that started get their ``after_train`` (with the exception)
        before it propagates.

        Raises:
            RuntimeError: training already started (no ``after_train`` since).
        """
        if self._running:
            raise RuntimeError("HookRunner.before_train() called twice without after_train() in between")
        self._running, self._in_step, self._batch_idx, self.is_last_batch = True, False, 0, False
        self.iter = self.global_step
        try:
            self._dispatch("on_train_start")
        except BaseException as exc:
            self.after_train(exc)
            raise

    def before_epoch(self) -> None:
        """Start an epoch: the data-time clocks restart (what ran since the last step is not data time).

        Optional: without it, an epoch's first data time also counts the work since the previous step
        (e.g. a validation).

        Raises:
            RuntimeError: outside ``before_train``/``after_train`` or inside an iteration.
        """
        self._check("before_epoch", in_step=False)
        self._batch_idx = 0
        self._dispatch("on_train_epoch_start")

    def before_step(self) -> None:
        """Start an iteration (call it once the batch is fetched): each hook's ``before_step``.

        Raises:
            RuntimeError: outside ``before_train``/``after_train`` or inside an iteration.
        """
        self._check("before_step", in_step=False)
        self._in_step, self.iter = True, self.global_step  # (already so unless an after_step raised)
        self._dispatch("on_train_batch_start", None, self._batch_idx)

    def after_backward(self) -> None:
        """After each backward of the iteration (each micro-batch's): each hook's ``after_backward``.

        Raises:
            RuntimeError: outside an iteration.
        """
        self._check("after_backward", in_step=True)
        self._dispatch("on_after_backward")

    def after_step(self, loss: Any = None, *, is_last_batch: bool = False) -> None:
        """End the iteration (after the optimizer step, taken or skipped): each hook's ``after_step``.

        Args:
            loss: the iteration's loss, as ``LossMonitor`` reads it: a one-element tensor (any float
                dtype, on any device; kept without host sync), or a dict with that under ``"loss"``
                and other one-element tensors under keys starting with ``"loss"``. With gradient
                accumulation, the iteration's mean. Required with a ``LossMonitor``.
            is_last_batch: this iteration ends an epoch (``PreciseBN(every_n_train_steps=None)``
                updates then).

        Raises:
            RuntimeError: outside an iteration.
            ValueError: from ``LossMonitor``, when ``loss`` is ``None``.
            FloatingPointError: from ``LossMonitor`` (a non-finite loss, on every rank alike).
        """
        self._check("after_step", in_step=True)
        self._in_step = False
        self.global_step += 1
        self.is_last_batch = bool(is_last_batch)
        self._dispatch("on_train_batch_end", loss, None, self._batch_idx)
        self._batch_idx += 1
        self.iter = self.global_step  # the next iteration: its loop body starts here

    def after_train(self, exception: BaseException | None = None) -> None:
        """End training, once: each started hook's ``after_train`` (:attr:`iter` as it stands).

        Args:
            exception: ``None`` after success; else the exception that stopped the loop (the hooks
                see it as ``self.exception`` and skip their collectives). It is NOT raised here.

        Raises:
            Exception: on success, the first exception of a hook's ``after_train`` (the later hooks'
                ``after_train`` still run, with it as ``self.exception``).
        """
        if not self._running:
            return
        self._running = self._in_step = False
        if exception is not None:
            self._dispatch("on_exception", exception)
            return
        try:
            self._dispatch("on_train_end")
        except BaseException as exc:
            self._dispatch("on_exception", exc)  # the hooks that have not finished
            raise

    def __enter__(self) -> HookRunner:
        self.before_train()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> bool:
        self.after_train(exc)
        return False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"global_step": int, "hooks": {hook.state_key: hook.state_dict()}}``; no collective."""
        return {
            "global_step": self.global_step,
            "hooks": {h.state_key: h.state_dict() for h in self.callbacks},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before ``before_train`` (hooks absent from it keep theirs).

        Raises:
            RuntimeError: called during training.
        """
        if self._running:
            raise RuntimeError("HookRunner.load_state_dict() must be called before before_train()")
        self.global_step = self.iter = int(state_dict["global_step"])
        for hook in self.callbacks:
            if hook.state_key in state_dict["hooks"]:
                hook.load_state_dict(state_dict["hooks"][hook.state_key])

    # ------------------------------------------------------------------ internals
    def _check(self, method: str, in_step: bool) -> None:
        if not self._running:
            raise RuntimeError(f"HookRunner.{method}() called outside before_train() ... after_train()")
        if self._in_step != in_step:
            where = "outside an iteration" if in_step else "inside an iteration (before after_step())"
            raise RuntimeError(f"HookRunner.{method}() called {where}")

    def _dispatch(self, name: str, *args: Any) -> None:
        for hook in self.callbacks:
            getattr(hook, name)(self, self.module, *args)
