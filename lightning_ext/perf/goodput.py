"""``GoodputLedger``: productive training time over wall time since the first launch, losses by cause."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightning_ext._checks import check_choice, check_int, check_number

__all__ = ["LOST_TIME_CAUSES", "GoodputLedger"]

# The causes of lost time an adapter reports; "other" (what nobody reported) is computed, never added.
LOST_TIME_CAUSES = ("startup", "data_wait", "validation", "checkpointing", "skipped_steps", "restart")
_STATE_KEYS = ("first_launch", "saved_at", "productive", "lost", "restarts")


class GoodputLedger:
    """Wall time since a job's first launch, split into productive time and time lost by cause.

    Goodput = productive seconds ÷ wall seconds since the first launch. An adapter (or a plain loop) feeds
    the ledger with what it timed: :meth:`productive` for training steps that updated the model,
    :meth:`add` for time lost to a cause of :data:`LOST_TIME_CAUSES` (``"startup"``: from the first launch
    to the first training step, ``"skipped_steps"``: steps the loss scaler skipped). Carried across
    restarts in a checkpoint: :meth:`state_dict` stamps the moment it is taken, and
    :meth:`load_state_dict` in the relaunched job books everything since then as ``"restart"`` (the crash,
    the work after the checkpoint, the queue, the start-up up to the load). The parts add up to the wall
    time by construction: what nobody reported is ``"other"``, negative only when the reports overlapped
    (the same seconds reported twice).

    Local to a process, no collective: each rank keeps its own; wall times are ``clock()`` (default
    ``time.time``, which agrees across processes and restarts on one machine, and across machines as
    far as their clocks do).

    Args:
        clock: seconds since a fixed origin; the first launch is its value at construction (make the
            ledger early in the job: what precedes it is not counted).

    Raises:
        TypeError: ``clock`` is not callable.

    Example::

        >>> now = iter([100.0, 130.0, 185.0, 190.0, 200.0]).__next__
        >>> ledger = GoodputLedger(clock=now)  # first launch at 100
        >>> ledger.productive(20.0); ledger.add("data_wait", 5.0)
        >>> state = ledger.state_dict()  # checkpointed at 130; the job dies, is relaunched at 185
        >>> resumed = GoodputLedger(clock=now); resumed.load_state_dict(state)  # loaded at 190
        >>> parts = resumed.summary()  # at 200: 100 s since the first launch
        >>> parts["wall"], parts["productive"], parts["data_wait"], parts["restart"], parts["other"]
        (100.0, 20.0, 5.0, 60.0, 15.0)
        >>> parts["goodput"], parts["restarts"]
        (0.2, 1)
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        if not callable(clock):
            raise TypeError(f"GoodputLedger: `clock` must be callable (seconds), got {clock!r}")
        self._clock = clock
        self.first_launch = float(clock())
        self.restarts = 0
        self._productive = 0.0
        self._lost = dict.fromkeys(LOST_TIME_CAUSES, 0.0)

    def productive(self, seconds: float) -> None:
        """Book ``seconds`` of productive training (steps that updated the model).

        Raises:
            TypeError, ValueError: ``seconds`` not a finite number >= 0.
        """
        check_number("GoodputLedger.productive", "seconds", seconds, ge=0.0)
        self._productive += seconds

    def add(self, cause: str, seconds: float) -> None:
        """Book ``seconds`` lost to ``cause``, one of :data:`LOST_TIME_CAUSES`.

        Raises:
            ValueError: an unknown ``cause`` (``"other"`` included: it is what nobody booked), or
                ``seconds`` < 0.
            TypeError: ``seconds`` not a finite number.
        """
        check_choice("GoodputLedger.add", "cause", cause, LOST_TIME_CAUSES)
        check_number("GoodputLedger.add", "seconds", seconds, ge=0.0)
        self._lost[cause] += seconds

    def summary(self) -> dict[str, float]:
        """Seconds by part at ``clock()``: ``wall``, ``productive``, each cause, ``other``; then
        ``goodput`` (``productive / wall``, NaN while ``wall`` is 0) and ``restarts`` (an int).
        ``productive`` + the causes + ``other`` == ``wall`` (up to float rounding)."""
        wall = self._clock() - self.first_launch
        other = wall - self._productive - math.fsum(self._lost.values())
        goodput = self._productive / wall if wall > 0 else math.nan
        return {"wall": wall, "productive": self._productive, **self._lost, "other": other,
                "goodput": goodput, "restarts": self.restarts}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries: the first launch, the totals, and ``saved_at`` (``clock()`` now)."""
        return {
            "first_launch": self.first_launch,
            "saved_at": float(self._clock()),
            "productive": self._productive,
            "lost": dict(self._lost),
            "restarts": self.restarts,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the job of ``state_dict``: its first launch and totals replace this ledger's, and
        the time from its ``saved_at`` to now is booked as ``"restart"`` (one more restart). A cause
        that ``lost`` lacks (a state saved before the cause existed) starts at 0.

        Raises:
            ValueError: a key missing, a ``lost`` cause unknown, or ``productive``, a ``lost`` value or
                ``restarts`` negative.
            TypeError: ``lost`` not a mapping, a value not a finite number (``restarts``: not an int).
        """
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        owner, lost = "GoodputLedger.load_state_dict", state_dict.get("lost", {})
        if not isinstance(lost, Mapping):
            raise TypeError(f"{owner}: `lost` must be a mapping of causes to seconds, got {lost!r}")
        unknown = sorted(set(lost) - set(LOST_TIME_CAUSES))
        if missing or unknown:
            raise ValueError(
                f"{owner}: `state_dict` must have the keys {_STATE_KEYS} and `lost` causes of "
                f"{LOST_TIME_CAUSES}, got {sorted(state_dict)} (missing {missing}) and the causes {unknown}"
            )
        for key in ("first_launch", "saved_at"):
            check_number(owner, key, state_dict[key])
        check_number(owner, "productive", state_dict["productive"], ge=0.0)  # (seconds, as every cause's)
        for cause, seconds in lost.items():
            check_number(owner, f"lost[{cause!r}]", seconds, ge=0.0)
        check_int(owner, "restarts", state_dict["restarts"], ge=0)
        self.first_launch = float(state_dict["first_launch"])
        self._productive = float(state_dict["productive"])
        self._lost = {cause: float(lost.get(cause, 0.0)) for cause in LOST_TIME_CAUSES}
        # 0 when this clock reads earlier than the saving one did (clocks of two machines disagree).
        self._lost["restart"] += max(self._clock() - state_dict["saved_at"], 0.0)
        self.restarts = int(state_dict["restarts"]) + 1
