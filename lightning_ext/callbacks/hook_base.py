"""detectron2-style training hooks as a Lightning callback.

:class:`HookBase` gives a :class:`lightning.pytorch.Callback` the small, loop-shaped interface of
detectron2's ``HookBase`` (``detectron2/engine/train_loop.py``): ``before_train``, ``after_train``,
``before_step``, ``after_backward``, ``after_step``, ``state_dict`` and ``load_state_dict``, with
``self.trainer``, ``self.pl_module`` and ``self.iter`` available inside them. Unlike detectron2, two
instances of one hook class keep distinct checkpoint state, and ``after_train`` of every hook runs
(once) when training fails, even if another hook's ``after_train`` raised.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["HookBase"]

log = logging.getLogger(__name__)

_instance_ids = itertools.count()  # provisional state-key ids, unique within the process


class HookBase(Callback):
    """Base class for detectron2-style hooks, registered like any Lightning callback.

    Subclasses override any of the methods below; each maps onto Lightning hooks as follows::

        detectron2 (HookBase)     Lightning (Callback)              when
        ------------------------  --------------------------------  ---------------------------------
        before_train()            on_train_start                    once, before the first batch
        before_step()             on_train_batch_start              first micro-batch of an iteration
        after_backward()          on_after_backward                 EVERY micro-batch's backward
        after_step()              on_train_batch_end                micro-batch that stepped the optimizer
        after_train()             on_train_end  OR  on_exception    once, success or failure
        state_dict()              state_dict                        checkpoint save
        load_state_dict(state)    load_state_dict                   checkpoint restore

    An *iteration* is one optimizer step: with ``accumulate_grad_batches=k`` the hook sees one
    ``before_step``/``after_step`` pair around ``k`` micro-batches (``after_step`` fires on the
    micro-batch whose ``optimizer.step()`` advanced ``trainer.global_step``, skipped AMP steps
    included) and ``k`` calls of ``after_backward``. ``before_step`` runs on the critical path of
    every iteration: keep it cheap (no host–device synchronization, no I/O).

    Inside the methods:

    - ``self.trainer`` is a :func:`weakref.proxy` to the Lightning ``Trainer`` (the hook does not
      keep it alive) and ``self.pl_module`` the ``LightningModule``;
    - ``self.iter`` is the current iteration: ``trainer.global_step`` at ``before_step`` (0-based,
      like detectron2's ``trainer.iter``), unchanged through ``after_step``; ``self.start_iter`` is
      its value at ``before_train`` (non-zero after a resume);
    - ``self.exception`` is ``None`` in an ``after_train`` that follows a successful run and the
      exception otherwise, so a hook can skip work (above all collectives, which the other ranks
      may never join) when training failed.

    Errors: an exception raised by a hook method propagates with a note naming the hook class and
    method (``PEP 678`` notes appear in the traceback). On failure Lightning calls ``on_exception``
    on every callback; ``after_train`` of each hook that started runs exactly once; an exception
    from it there is logged and attached as a note to the original exception, which keeps
    propagating, so the remaining hooks' ``after_train`` still run. Caveat: with
    ``strategy="ddp_spawn"``/``"ddp_notebook"`` Lightning calls ``on_exception`` only in the
    launching process (on its own copies of the callbacks), not in the worker processes, so there
    ``after_train`` does not run in the workers when training fails; with ``strategy="ddp"``
    (subprocess launcher or ``torchrun``) it does.

    Checkpoints: the state of each hook is stored under its :attr:`state_key`, made distinct per
    instance as ``ClassName{'index': i}`` where ``i`` counts the instances of the same class in
    ``trainer.callbacks`` (so construct them in the same order when resuming). Before the hook is
    attached to a trainer the key is a provisional, process-unique one.

    The protocol follows detectron2's ``TrainerBase.train`` (``try: before_train; loop; finally:
    after_train``) and ``engine/hooks.py``.

    Example::

        >>> import lightning as L
        >>> class CountSteps(HookBase):
        ...     def before_train(self):
        ...         self.steps = 0
        ...     def after_step(self):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state_dict):
        ...         self.steps = state_dict["steps"]
        >>> hook = CountSteps()
        >>> trainer = L.Trainer(callbacks=[hook], max_steps=1, logger=False)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer_ref: Any = None
        self.pl_module: pl.LightningModule | None = None
        self.exception: BaseException | None = None
        self.start_iter: int = 0
        self._iter: int = 0
        self._running = False  # before_train ran and after_train has not yet
        self._in_step = False  # between before_step and after_step
        self._step_global_step = 0  # trainer.global_step when the current iteration began
        self._key_index: int | None = None  # position among same-class hooks of the trainer
        self._instance_id = next(_instance_ids)

    # ------------------------------------------------------------------ detectron2 interface

    def before_train(self) -> None:
        """Called once before the first training iteration (``on_train_start``)."""

    def after_train(self) -> None:
        """Called once after the last iteration, or after training raised (see ``self.exception``)."""

    def before_step(self) -> None:
        """Called before each iteration (first micro-batch). Must stay cheap."""

    def after_backward(self) -> None:
        """Called after every micro-batch's backward pass, before the optimizer step."""

    def after_step(self) -> None:
        """Called after each iteration, once its optimizer step ran."""

    @override
    def state_dict(self) -> dict[str, Any]:
        """State saved in Lightning checkpoints under :attr:`state_key`; empty by default."""
        return {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # ------------------------------------------------------------------ attributes

    @property
    def trainer(self) -> pl.Trainer:
        """Weak proxy to the Lightning ``Trainer`` this hook is attached to.

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
        """The current iteration (optimizer step), 0-based; see the class docstring."""
        return self._iter

    @property
    @override
    def state_key(self) -> str:
        if self._key_index is None:
            return self._generate_state_key(instance=self._instance_id)
        return self._generate_state_key(index=self._key_index)

    def __getstate__(self) -> dict[str, Any]:
        # Weak proxies and modules of a finished run do not travel to spawned workers.
        state = self.__dict__.copy()
        state["_trainer_ref"] = None
        state["pl_module"] = None
        return state

    # ------------------------------------------------------------------ Lightning plumbing

    def _call(self, name: str) -> None:
        try:
            getattr(self, name)()
        except BaseException as exc:
            _add_note(exc, f"raised in hook {type(self).__qualname__}.{name}() at iteration={self._iter}")
            raise

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
        self.start_iter = self._iter = trainer.global_step
        self._in_step = False
        self._running = True
        self._call("before_train")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._in_step:
            self._in_step = True
            self._step_global_step = self._iter = trainer.global_step
            self._call("before_step")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._call("after_backward")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._in_step and trainer.global_step != self._step_global_step:
            self._in_step = False
            self._call("after_step")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._running:
            self._running = False
            self.exception = None
            self._call("after_train")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not self._running:
            return
        self._running = False
        self._in_step = False
        self.exception = exception
        try:
            self.after_train()
        except Exception as exc:  # the original exception keeps propagating; let the other hooks run
            log.exception("%s.after_train() raised while handling %r", type(self).__qualname__, exception)
            _add_note(exception, f"{type(self).__qualname__}.after_train() also raised {exc!r}")


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678; shown in the traceback) once."""
    if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
