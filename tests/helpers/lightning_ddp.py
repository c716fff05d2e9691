"""Lightning's ``"ddp"`` strategy on the workers of ``run_distributed`` (as under torchrun).

A ``ddp_spawn`` fit pays for new interpreters, imports and a process group each time; a function run by
:func:`tests.helpers.distributed.run_distributed` builds its Trainer with :func:`ddp_trainer` instead:
Lightning then takes the worker's rank from the environment (``LOCAL_RANK`` & co., as torchrun sets
them), launches no process and keeps the process group the harness initialized (Lightning initializes
one only when none exists). The training loop, DDP and the callbacks are those of any DDP job; the
harness restores the environment variables after the call.

Rank zero's lines (Lightning's ``rank_zero_info``, which our callbacks log through) and warnings stay in
the worker's process: :func:`rank_zero_output` records them there, for the test function to return.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl

__all__ = ["broadcast_sigterm_flag", "ddp_trainer", "rank_zero_output"]


def ddp_trainer(rank: int, world_size: int, strategy: str = "ddp", **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer of ``world_size`` devices with ``strategy`` (a DDP one) for the harness's rank
    ``rank``; ``kwargs`` go to ``pl.Trainer``."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, **kwargs)
    assert trainer.global_rank == rank and trainer.world_size == world_size
    return trainer


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def rank_zero_output() -> Iterator[tuple[list[str], list[str]]]:
    """Record what Lightning logs (``rank_zero_info`` & co.: one entry per call) and every warning
    (each one, not once per place) while the block runs; yields the two lists ``(logged, warned)``,
    ``warned`` filled when the block ends."""
    logged: list[str] = []
    handler, logger = _Lines(logged), logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warned: list[str] = []
            yield logged, warned
            warned.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)


def broadcast_sigterm_flag(monkeypatch: Any, broadcast: Any) -> None:
    """Have the training epoch loop of a one-process Trainer call ``broadcast()`` where Lightning's
    (2.5.2+) with several ranks calls its SIGTERM broadcast (``_broadcast_sigterm_tensor``, before each
    batch's fetch), as that broadcast: where the fast ranks wait for a rank slow after its last
    collective of an iteration."""
    loop = pl.loops.training_epoch_loop._TrainingEpochLoop
    advance = loop.advance

    def advance_after_the_broadcast(self: Any, data_fetcher: Any) -> None:
        self._broadcast_sigterm_tensor()
        advance(self, data_fetcher)

    monkeypatch.setattr(loop, "advance", advance_after_the_broadcast)
    monkeypatch.setattr(loop, "_broadcast_sigterm_tensor", lambda self: broadcast(), raising=False)
