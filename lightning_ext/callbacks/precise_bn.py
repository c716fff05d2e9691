"""Recompute BatchNorm running statistics as true population statistics during training
(detectron2's PreciseBN hook), with :func:`lightning_ext.nn.update_bn_stats`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_ext._checks import check_int
from lightning_ext.callbacks.hook_base import HookBase
from lightning_ext.nn import update_bn_stats

__all__ = ["PreciseBN"]


class PreciseBN(HookBase):
    """Recompute BatchNorm running statistics with true population averages during training.

    Running statistics average batches whose weights kept changing;
    :func:`~lightning_ext.nn.update_bn_stats` (see it for the collectives and syncs,
    and for how it differs from fvcore's function behind detectron2's hook) re-estimates them with
    frozen weights: the mean and unbiased variance of all the batches' elements. Source: Wu & Johnson,
    "Rethinking 'Batch' in BatchNorm", 2021; detectron2 ``hooks.PreciseBN``.

    When: with ``every_n_train_steps=None`` after the last iteration of each training epoch (before
    the end-of-epoch validation, which thus sees the new statistics); with ``every_n_train_steps=k``
    after every ``k``-th iteration; after the run's last iteration (``max_steps`` reached, or the last
    batch of the ``max_epochs``-th epoch), as detectron2's final update, before the checkpoint and the
    validation of that iteration; and at the end of a successful run if the statistics are older than
    the last iteration (a stop before the end: early stopping). Never after a failed run: the
    forwards of synchronized layers are collectives.

    Data: batches from ``data_loader`` (an iterable, or a zero-argument callable returning one at
    each update; ``None``: ``trainer.train_dataloader`` with its distributed sampler), moved by the
    precision plugin's ``convert_input`` (``"bf16-true"`` & co.: the dtype training sees) and the
    strategy's ``batch_to_device``, forwarded under the precision plugin's ``forward_context()``.
    With ``every_n_train_steps`` set and ``persistent_workers=True``, pass a separate loader:
    restarting the training loader mid-epoch would reset its workers. Values ``report()``-ed in the
    forward count.

    Args:
        every_n_train_steps: iterations between updates, or ``None`` for once per epoch.
        num_iter: number of batches per update (fewer if the loader runs out; a warning says so).
        data_loader: iterable or zero-argument callable returning an iterable, or ``None``.
        forward_fn: ``(pl_module, batch) -> Any``; ``None`` runs ``pl_module(batch[0])`` for
            tuple/list batches and ``pl_module(batch)`` otherwise.

    Raises:
        ValueError: ``every_n_train_steps`` or ``num_iter`` is ``< 1``.
        TypeError: ``every_n_train_steps`` is neither an int nor ``None``, ``num_iter`` is not an int,
            ``data_loader`` is neither iterable nor callable, a callable ``data_loader``
            returned a non-iterable, or ``forward_fn`` is not callable.

    Example::

        >>> import torch
        >>> hook = PreciseBN(every_n_train_steps=100, num_iter=50, data_loader=[torch.ones(4, 2)])
    """

    def __init__(
        self,
        every_n_train_steps: int | None = None,
        num_iter: int = 200,
        data_loader: Iterable[Any] | Callable[[], Iterable[Any]] | None = None,
        forward_fn: Callable[[pl.LightningModule, Any], Any] | None = None,
    ) -> None:
        super().__init__()
        steps, per_epoch = every_n_train_steps, "None updates after every epoch."
        check_int("PreciseBN", "every_n_train_steps", steps, ge=1, optional=True, hint=per_epoch)
        check_int("PreciseBN", "num_iter", num_iter, ge=1)
        if data_loader is not None and (isinstance(data_loader, str | bytes) or not (
            callable(data_loader) or isinstance(data_loader, Iterable))):  # fmt: skip
            raise TypeError(
                "PreciseBN: `data_loader` must be an iterable of batches, a zero-argument callable "
                f"returning one, or None (the training loader), got {data_loader!r}"
            )
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"PreciseBN: `forward_fn` must be callable or None, got {forward_fn!r}")
        self.every_n_train_steps = every_n_train_steps
        self.num_iter = num_iter
        self.data_loader = data_loader
        self.forward_fn = forward_fn
        self._last_update_step: int | None = None  # trainer.global_step of the last update
        #: number of batches used by each update so far (for inspection).
        self.batches_used: list[int] = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_update_step": self._last_update_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_update_step = state_dict["last_update_step"]

    @override
    def before_train(self) -> None:
        if self.data_loader is None and getattr(self.trainer, "train_dataloader", None) is None:
            raise ValueError(
                "PreciseBN(data_loader=None) reads the training loader, but the trainer's "
                "`train_dataloader` is None. HINT: pass HookRunner(..., train_dataloader=loader) or "
                "PreciseBN(data_loader=...)."
            )

    def _loader(self) -> Iterable[Any]:
        if self.data_loader is None:
            return self.trainer.train_dataloader
        loader = self.data_loader() if callable(self.data_loader) else self.data_loader
        if not isinstance(loader, Iterable):
            raise TypeError(f"PreciseBN: `data_loader()` must return an iterable of batches, got {loader!r}")
        return loader

    def update_stats(self) -> int:
        """Run the update now on every rank (collectives when distributed); returns the batches used."""
        strategy, loaded = self.trainer.strategy, itertools.islice(self._loader(), self.num_iter)
        batches = (strategy.batch_to_device(strategy.precision_plugin.convert_input(b)) for b in loaded)

        def run(model: nn.Module, batch: Any) -> Any:
            with strategy.precision_plugin.forward_context():
                if self.forward_fn is not None:
                    return self.forward_fn(model, batch)
                return model(batch[0] if isinstance(batch, (tuple, list)) else batch)

        used = update_bn_stats(self.pl_module, batches, self.num_iter, run)
        self._last_update_step = self.trainer.global_step
        self.batches_used.append(used)
        if used < self.num_iter:
            self._warn(
                f"PreciseBN: only {used} of num_iter={self.num_iter} batches were available on every rank"
            )
        return used

    @override
    def after_step(self) -> None:
        steps, trainer = self.every_n_train_steps, self.trainer
        if (trainer.is_last_batch if steps is None else self._steps_done % steps == 0) or _final(trainer):
            self.update_stats()

    @override
    def after_train(self) -> None:
        if self.exception is None and self._last_update_step != self.trainer.global_step:
            self.update_stats()


def _final(trainer: Any) -> bool:
    """Whether the iteration that just ended is the run's last one: ``max_steps`` reached, or the last
    batch of the last of ``max_epochs`` (a ``HookRunner`` has neither)."""
    max_steps, max_epochs = getattr(trainer, "max_steps", -1), getattr(trainer, "max_epochs", None)
    if max_steps is not None and 0 <= max_steps <= trainer.global_step:
        return True
    return max_epochs is not None and max_epochs >= 0 and bool(trainer.is_last_batch) and (
        trainer.current_epoch + 1 >= max_epochs)
