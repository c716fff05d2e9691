"""``HookBase``: detectron2's loop-shaped hook interface as a Lightning callback."""

from __future__ import annotations

import itertools
import logging
import time
import types
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_ext._compat import batches_that_stepped
from lightning_ext.distributed import collective_seconds

__all__ = ["HookBase"]

log = logging.getLogger(__name__)

_instance_ids = itertools.count()  # provisional state-key ids; never reset: live hooks must keep distinct ids


class HookBase(Callback):
    """Base class for detectron2-style hooks, registered like any Lightning callback.

    Subclasses override any of these methods, called from these Lightning hooks::

        detectron2 (HookBase)     Lightning (Callback)              when
        ------------------------  --------------------------------  ---------------------------------
        before_train()            on_train_start                    once, before the first batch
        before_step()             on_train_batch_start              first micro-batch of an iteration
        after_backward()          on_after_backward                 EVERY micro-batch's backward
        after_step()              on_train_batch_end                micro-batch that stepped the optimizer
        after_train()             on_train_end  OR  on_exception    once, success or failure
        state_dict()              state_dict                        checkpoint save (default: {})
        load_state_dict(state)    load_state_dict                   checkpoint restore

    An *iteration* is one training step that stepped the optimizers: in automatic optimization one
    optimizer step (with ``accumulate_grad_batches=k``, one ``before_step``/``after_step`` pair
    around ``k`` micro-batches and ``k`` ``after_backward`` calls), in manual optimization one
    ``training_step`` however many ``optimizer.step()`` calls it makes (a GAN's D and G steps).
    ``after_step`` fires on the micro-batch that advanced ``trainer.global_step`` (skipped AMP steps
    included). ``before_step`` is on the critical path: keep it cheap (no host–device
    synchronization, no I/O).

    Outside a Trainer (a Fabric or plain PyTorch loop),
    :class:`~lightning_ext.callbacks.HookRunner` calls the same Lightning hooks.

    The driver (a ``Trainer`` or a ``HookRunner``) is what ``self.trainer`` points to. The hooks of
    this package read from it only: ``global_step``, the iteration count behind ``self.iter``,
    ``is_last_batch``, ``loggers``, ``callback_metrics``, ``callbacks``, ``global_rank``,
    ``world_size``, ``is_global_zero``, ``train_dataloader``, ``strategy.batch_to_device(batch)``,
    ``strategy.precision_plugin.forward_context()`` and ``convert_input(batch)``, and, when there
    are, ``max_steps``, ``max_epochs`` and ``current_epoch`` (``PreciseBN``'s last iteration),
    ``strategy.model`` (the wrapped model: ``IterationTimer`` looks for DDP in it) and
    ``progress_bar_callback``;
    and ``on_train_batch_end``'s ``outputs`` (the loss). A hook checks what it needs itself, with
    an error that names the fix (``PreciseBN`` a training loader at ``before_train``,
    ``LossMonitor`` the loss at every step): the driver knows no hook class.

    Inside the methods: ``self.trainer`` (a :func:`weakref.proxy`), ``self.pl_module``, ``self.iter``
    (the iteration, 0-based like detectron2's ``trainer.iter``, continued on resume),
    ``self.start_iter`` (``self.iter`` at the first ``before_step``; at ``before_train`` too, except
    right after a mid-epoch resume, where Lightning's count is one lower until its epoch loop starts),
    and ``self.exception``: in an
    ``after_train`` after a failure, the exception (else ``None``), so that a hook can skip work,
    above all collectives that other ranks may never join.

    ``self.iter`` has one source, the driver (Lightning's count of the iterations done, or
    :attr:`HookRunner.iter <lightning_ext.callbacks.HookRunner.iter>`), so all hooks read the same value,
    whichever hook or loader failed. As detectron2's, it becomes ``i`` when iteration ``i``'s loop
    body starts, before its batch is fetched and before any ``before_step``, and stays ``i``
    through its ``after_step``. So ``after_train`` sees, after success, the number of iterations
    run (detectron2's ``max_iter``), also when another hook's ``after_train`` raised; after a
    failure, the iteration whose loop body failed (a hook raising in ``before_step`` or
    ``after_step`` of iteration ``i``, or the loader raising on iteration ``i``'s batch: ``i``).
    Lightning fetches a loader without ``__len__`` one batch ahead, batch ``i + 1`` before
    iteration ``i``'s ``before_step``: that fetch failing gives ``i``, the iterations completed.
    ``self.iter`` is also the step at which Lightning logs iteration ``i``'s ``self.log`` values,
    and that of every row this package's callbacks write. The periods of this package's hooks
    (``every_n_train_steps``) count iterations, from ``start_iter``: in manual optimization Lightning's
    count, and so ``self.iter``, counts every batch, also one that stepped no optimizer.

    ``self.data_sec``: the seconds the current iteration waited for data, host wall time from the end
    of the previous micro-batch (or the start of the epoch, or the end of a validation run) to the
    start of each of its micro-batches, summed over them; set before ``before_step`` (the one
    measurement of data time, which ``IterationTimer`` and ``LossMonitor`` read), less ``self.sync_sec``:
    the seconds of those waits spent in collectives, where the fast ranks wait for a rank slow after
    its last collective of an iteration (in its optimizer step), a synchronization and not data:
    Lightning's SIGTERM broadcast (2.5.2+, with several ranks: the epoch loop's
    ``_broadcast_sigterm_tensor`` before each fetch, which the hook times while it trains) and the
    package's (:func:`~lightning_ext.distributed.collective_seconds`: a ``TrainingStats`` flush's
    all-reduces at a batch's end, ``LossMonitor``'s agreement). A micro-batch after
    a checkpoint's save (which ``ModelCheckpoint`` runs in its ``on_validation_end`` or
    ``on_train_batch_end``, after every other callback's) adds nothing: the save is not data, and the
    time until the batch cannot be split into the save and the loading of the batch fetched then.

    Errors: an exception from a hook method propagates with a ``PEP 678`` note naming the hook
    class and method. On failure the ``after_train`` of each hook that started runs once; an
    exception from it is logged and noted on the original exception, which keeps propagating, so
    the other hooks' ``after_train`` still run. With ``strategy="ddp_spawn"``/``"ddp_notebook"``
    Lightning calls ``on_exception`` only in the launching process, so ``after_train`` does not
    run in the workers when training fails; with ``strategy="ddp"`` it does.

    Checkpoints: each hook's state is stored under its :attr:`state_key`, ``ClassName{'index': i}``
    with ``i`` its position among the instances of its class in ``trainer.callbacks`` (so construct
    them in the same order when resuming); before ``setup`` the key is provisional, process-unique.

    Source: detectron2 ``engine/train_loop.py`` (``TrainerBase.train``: ``try: before_train; loop;
    finally: after_train``) and ``engine/hooks.py``.

    Example::

        >>> import lightning as L
        >>> class CountSteps(HookBase):
        ...     def before_train(self):
        ...         self.steps = 0
        ...     def after_step(self):
        ...         self.steps += 1
        >>> trainer = L.Trainer(callbacks=[CountSteps()], max_steps=1, logger=False)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer_ref: Any = None
        self.pl_module: pl.LightningModule | None = None
        self.exception: BaseException | None = None
        self.start_iter: int = 0
        self._running = False  # before_train ran and after_train has not yet
        self._in_step = False  # between before_step and after_step
        self._step_global_step = 0  # trainer.global_step when the current iteration began
        self._step_batches = 0  # micro-batches of the current iteration that ended
        self._steps_done = 0  # iterations done (from start_iter), the periodic hooks' count
        self._first_batch = False  # no micro-batch of this run started yet
        self._last_batch_end: float | None = None  # perf_counter at the end of the last micro-batch
        #: seconds the current iteration waited for data (see the class docstring).
        self.data_sec = 0.0
        #: seconds the current iteration's data waits spent in collectives (class docstring).
        self.sync_sec = 0.0
        self._synced = 0.0  # seconds in that broadcast since _last_batch_end
        self._waited = 0.0  # collective_seconds() at _last_batch_end
        self._key_index: int | None = None  # position among same-class hooks of the trainer
        self._instance_id = next(_instance_ids)

    def before_train(self) -> None: ...

    def after_train(self) -> None: ...

    def before_step(self) -> None: ...

    def after_backward(self) -> None: ...

    def after_step(self) -> None: ...

    @property
    def trainer(self) -> pl.Trainer:
        """Weak proxy to the Lightning ``Trainer`` this hook is attached to (outside a Trainer: to the
        :class:`~lightning_ext.callbacks.HookRunner` that drives it).

        Raises:
            RuntimeError: the hook has not been attached yet (``Trainer.fit`` not started).
        """
        if self._trainer_ref is None:
            raise RuntimeError(
                f"{type(self).__name__}.trainer is only available once the hook is attached to a "
                "Trainer (from `setup` on)"
            )
        return self._trainer_ref

    @property
    def iter(self) -> int:
        """The current iteration, 0-based, read from the driver (see the class docstring);
        ``start_iter`` before the hook is attached."""
        return self.start_iter if self._trainer_ref is None else _iterations_done(self._trainer_ref)

    @property
    @override
    def state_key(self) -> str:
        key = {"instance": self._instance_id} if self._key_index is None else {"index": self._key_index}
        return self._generate_state_key(**key)

    def __getstate__(self) -> dict[str, Any]:
        # Weak proxies and modules of a finished run do not travel to spawned workers.
        return {**self.__dict__, "_trainer_ref": None, "pl_module": None}

    def _call(self, name: str) -> None:
        try:
            getattr(self, name)()
        except BaseException as exc:
            _add_note(exc, f"raised in hook {type(self).__qualname__}.{name}() at iteration={self.iter}")
            raise

    def _warn(self, message: str) -> None:
        """Warn once (rank zero) on a line of its own: above the trainer's progress bar when it shows one
        (Lightning's ``ProgressBar.print``; a warning would land inside the bar's line), else
        ``rank_zero_warn`` (a ``UserWarning``)."""
        bar = getattr(self.trainer, "progress_bar_callback", None)  # a HookRunner has none
        if bar is None:
            rank_zero_warn(message)
        elif self.trainer.is_global_zero:
            bar.print(f"UserWarning: {message}")

    def _time_lightnings_broadcast(self, install: bool) -> None:
        """Run the trainer's SIGTERM broadcast (class docstring) inside ``_in_lightnings_broadcast``
        (``install``), or no longer."""
        loop = getattr(getattr(self._trainer_ref, "fit_loop", None), "epoch_loop", None)
        broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
        if broadcast is None or not install:
            if getattr(broadcast, "__self__", None) is self:  # ours: the loop's own method again
                del loop._broadcast_sigterm_tensor  # (another hook's wrapper inside ours goes too)
            return
        inside = self._in_lightnings_broadcast
        loop._broadcast_sigterm_tensor = types.MethodType(lambda hook: inside(broadcast), self)

    def _in_lightnings_broadcast(self, broadcast: Any) -> None:
        start = time.perf_counter()
        try:
            broadcast()
        finally:
            self._synced += time.perf_counter() - start

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer_ref = trainer if isinstance(trainer, weakref.ProxyType) else weakref.proxy(trainer)
        self.pl_module = pl_module

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        same_class = [cb for cb in trainer.callbacks if type(cb) is type(self)]
        self._key_index = next(i for i, cb in enumerate(same_class) if cb is self)
        self._attach(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(trainer, pl_module)
        self.exception = None
        self.start_iter = self._steps_done = _iterations_done(trainer)
        self._in_step, self._last_batch_end, self._first_batch = False, None, True
        self._running = True
        self._time_lightnings_broadcast(install=True)
        self._call("before_train")

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open_data_window()  # epoch-boundary work is not data

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open_data_window()  # nor is a validation run between batches

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._last_batch_end = None  # nor is a checkpoint's save (the next fetch is not told apart)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_batch:  # Lightning's count of a mid-epoch resume, corrected after on_train_start
            self._first_batch, self.start_iter = False, _iterations_done(trainer)
            self._steps_done = self.start_iter
        synced = 0.0 if self._last_batch_end is None else self._synced + collective_seconds() - self._waited
        wait = 0.0 if self._last_batch_end is None else time.perf_counter() - self._last_batch_end - synced
        if self._in_step:  # a later micro-batch of the same iteration
            self.data_sec, self.sync_sec = self.data_sec + wait, self.sync_sec + synced
            return
        self.data_sec, self.sync_sec = wait, synced
        self._in_step, self._step_global_step, self._step_batches = True, trainer.global_step, 0
        self._call("before_step")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("after_backward")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_batches += 1
        if self._in_step and trainer.global_step != self._step_global_step:
            self._in_step, self._steps_done = False, self._steps_done + 1
            self._call("after_step")
        self._open_data_window()

    def _open_data_window(self) -> None:
        self._last_batch_end, self._synced, self._waited = time.perf_counter(), 0.0, collective_seconds()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._step_batches:  # the module cancelled the iteration's only batch (-1 from its
            self._in_step = False  # on_train_batch_start, after ours): the next batch begins another

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._running:  # (self.exception is None: on_exception would have ended the run)
            self._running = False
            self._time_lightnings_broadcast(install=False)
            self._call("after_train")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not self._running:
            return
        self._running = self._in_step = False
        self._time_lightnings_broadcast(install=False)
        self.exception = exception
        try:
            self.after_train()
        except Exception as exc:  # the original exception keeps propagating; let the other hooks run
            log.exception("%s.after_train() raised while handling %r", type(self).__qualname__, exception)
            _add_note(exception, f"{type(self).__qualname__}.after_train() also raised {exc!r}")


def _module_device(module: torch.nn.Module) -> torch.device:
    """``module.device`` (a LightningModule's), else that of its first parameter or buffer (a plain
    module under :class:`~lightning_ext.callbacks.HookRunner`), else the CPU."""
    device = getattr(module, "device", None)
    if device is None:
        device = next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
    return torch.device(device)


def _iterations_done(trainer: pl.Trainer) -> int:
    """Iterations completed before the current batch: what ``HookBase.iter`` reads, and the log step.

    With a Lightning ``Trainer``, its count of training batches that stepped the optimizers
    (``trainer.global_step`` in automatic optimization, restored on resume). Lightning advances it
    after a batch's ``on_train_batch_end`` and validation, before it fetches the next batch, and
    writes a batch's ``self.log`` values at it: batch ``i``'s at step ``i`` (and those of a
    training epoch's end at the step of its last batch, one below the count). Every row this package
    writes to a logger uses Lightning's step for it, so the steps of one logger never go backwards.

    Under a :class:`~lightning_ext.callbacks.HookRunner`: its
    :attr:`~lightning_ext.callbacks.HookRunner.iter`, the same count kept by the runner.

    Reads Lightning's private count through ``lightning_ext._compat.batches_that_stepped``.
    """
    return trainer.iter if getattr(trainer, "fit_loop", None) is None else batches_that_stepped(trainer)


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678; shown in the traceback) once."""
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
