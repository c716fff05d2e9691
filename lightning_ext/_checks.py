"""Argument checks of the public entry points: one rule, one message format (private; no Lightning import).

The rule: ``TypeError`` for a value of the wrong type — anything but an integer (a Python or NumPy
one) where an int is asked (``True`` is an ``int`` to Python, never to these checks), NaN or ±inf where
a finite number is asked —
and ``ValueError`` for a value of the right type outside what is allowed. Every message names the owner
(the class, function or method the user called), the argument, what is allowed and the value received
(its type too on a ``TypeError``), then a ``HINT:`` where the caller gives one::

    LossMonitor: `every_n_train_steps` must be an int >= 1, got 0
    DynamicLossScaler: `init_scale` must be a finite number > 0.0, got inf (float)

The checks are for the simple kinds only (int, finite number, bool, one of a few choices); contextual
checks (shapes, devices, state-dict consistency, process groups) stay where they are, with their own
messages in the same spirit.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Collection
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "check_regex"]

_REPR_LIMIT = 80  # characters of a received value's repr kept in a message
_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}  # a bound's keyword (an `operator` name) => its sign
_COMPARE = {key: getattr(operator, key) for key in _SIGNS}


def _fail(
    error: type[Exception], owner: str, name: str, allowed: str, value: Any, hint: str | None
) -> NoReturn:
    """Raise ``error`` with the message of the module docstring (the received value cut to a readable
    length, with its type on a ``TypeError``)."""
    got = repr(value)
    got = got if len(got) <= _REPR_LIMIT else got[: _REPR_LIMIT - 3] + "..."
    got += f" ({type(value).__name__})" if error is TypeError and value is not None else ""
    message = f"{owner}: `{name}` must be {allowed}, got {got}"
    raise error(f"{message}. HINT: {hint}" if hint else message)


def _in_words(bounds: dict[str, float]) -> str:
    """The bounds in words: ``" >= 1"``, ``" < 1.0"``, ``" in (0.0, 1.0]"`` or ``""``."""
    assert not {"gt", "ge"} <= bounds.keys() and not {"lt", "le"} <= bounds.keys(), "one bound per side"
    if len(bounds) < 2:
        return "".join(f" {_SIGNS[key]} {bound!r}" for key, bound in bounds.items())
    low, high = ("gt" if "gt" in bounds else "ge"), ("lt" if "lt" in bounds else "le")
    return f" in {'(' if low == 'gt' else '['}{bounds[low]!r}, {bounds[high]!r}{')' if high == 'lt' else ']'}"


def check_int(owner: str, name: str, value: Any, **bounds: Any) -> None:
    """Raise unless ``value`` is an ``int`` (not a ``bool``) within the bounds, or ``None`` if ``optional``.

    Args:
        owner: what the user called, as they wrote it: ``"LossMonitor"``, ``"create_process_groups"``.
        name: the argument's name.
        value: the value received.
        bounds: keywords ``gt``, ``ge``, ``lt``, ``le`` (``>``, ``>=``, ``<``, ``<=``; at most one
            lower and one upper), ``optional`` (``None`` is allowed too) and ``hint`` (appended as
            ``HINT: ...`` to either error).

    Raises:
        TypeError: ``value`` is not an integer (an ``int`` or a NumPy integer; a ``bool`` or a float with
            an integral value included), nor ``None`` where ``optional``.
        ValueError: ``value`` is outside the bounds.

    Example::

        >>> check_int("LossMonitor", "every_n_train_steps", 0, ge=1)
        Traceback (most recent call last):
        ...
        ValueError: LossMonitor: `every_n_train_steps` must be an int >= 1, got 0
        >>> check_int("LossMonitor", "every_n_train_steps", True, ge=1)
        Traceback (most recent call last):
        ...
        TypeError: LossMonitor: `every_n_train_steps` must be an int >= 1, got True (bool)
    """

    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    _check_bounded("an int", is_int, owner, name, value, **bounds)


def check_number(owner: str, name: str, value: Any, **bounds: Any) -> None:
    """Raise unless ``value`` is a finite ``int`` or ``float`` (not a ``bool``) within the bounds.

    Args:
        owner, name, value, bounds: as :func:`check_int`'s.

    Raises:
        TypeError: ``value`` is not a real number (Python's or NumPy's), is a ``bool``, NaN or ±inf, nor
            ``None`` where ``optional``.
        ValueError: ``value`` is outside the bounds.

    Example::

        >>> check_number("SyncBatchNorm", "momentum", 1.5, ge=0.0, le=1.0)
        Traceback (most recent call last):
        ...
        ValueError: SyncBatchNorm: `momentum` must be a finite number in [0.0, 1.0], got 1.5
        >>> check_number("SyncBatchNorm", "eps", float("nan"), gt=0.0)
        Traceback (most recent call last):
        ...
        TypeError: SyncBatchNorm: `eps` must be a finite number > 0.0, got nan (float)
    """

    try:
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int beyond float64's range
        finite = False
    _check_bounded("a finite number", finite, owner, name, value, **bounds)


def _check_bounded(
    kind: str,
    of_kind: bool,
    owner: str,
    name: str,
    value: Any,
    *,
    optional: bool = False,
    hint: str | None = None,
    **bounds: float | None,
) -> None:
    """:func:`check_int` and :func:`check_number`: ``kind`` names the type, ``of_kind`` says whether
    ``value`` is of it."""
    assert bounds.keys() <= _SIGNS.keys(), f"unknown bounds {sorted(bounds)}"
    if value is None and optional:
        return
    if of_kind:  # (a plain loop, the message built on failure only: a check runs in every flush and step)
        for key, bound in bounds.items():
            if bound is not None and not _COMPARE[key](value, bound):
                break
        else:
            return
    bounds = {key: bound for key, bound in bounds.items() if bound is not None}
    allowed = f"{kind}{_in_words(bounds)}{' or None' if optional else ''}"
    _fail(ValueError if of_kind else TypeError, owner, name, allowed, value, hint)


def as_number(value: Any) -> Any:
    """A NumPy scalar or a 0-dim tensor as the Python number it holds (the originals of the drop-ins
    take them: a number read from a config or computed by torch), anything else as it is (then checked).

    Example::

        >>> as_number(np.float32(0.5)), as_number(torch.tensor(3)), as_number("3")
        (0.5, 3, '3')
    """
    scalar = isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.ndim == 0)
    return value.item() if scalar else value


def check_bool(owner: str, name: str, value: Any, *, hint: str | None = None) -> None:
    """Raise unless ``value`` is ``True`` or ``False`` (``0``, ``1`` and ``None`` are not).

    Args:
        owner, name, value, hint: as :func:`check_int`'s.

    Raises:
        TypeError: ``value`` is not a ``bool``.

    Example::

        >>> check_bool("LossMonitor", "async_write", "yes")
        Traceback (most recent call last):
        ...
        TypeError: LossMonitor: `async_write` must be a bool, got 'yes' (str)
    """
    if not isinstance(value, bool):
        _fail(TypeError, owner, name, "a bool", value, hint)


def check_regex(owner: str, name: str, value: Any) -> re.Pattern[str]:
    """``re.compile(value)``, else raise naming ``owner`` and ``name``.

    Raises:
        TypeError: ``value`` is not a ``str``.
        ValueError: ``value`` is not a regular expression (the ``re.error`` said).

    Example::

        >>> check_regex("Collector", "regex", 3)
        Traceback (most recent call last):
        ...
        TypeError: Collector: `regex` must be a str, got 3 (int)
    """
    if not isinstance(value, str):
        raise TypeError(f"{owner}: `{name}` must be a str, got {value!r} ({type(value).__name__})")
    try:
        return re.compile(value)
    except re.error as err:
        raise ValueError(f"{owner}: `{name}` must be a regular expression, got {value!r} ({err})") from None


def check_device(owner: str, name: str, value: Any, *, optional: bool = False) -> torch.device | None:
    """``value``, a ``torch.device`` or a str torch reads as one (``"cuda:1"``, ``"cpu"``), as a
    ``torch.device`` (``None`` stays ``None`` when ``optional``); else ``TypeError`` (another type) or
    ``ValueError`` (a str that names no device), naming ``owner`` and ``name``."""
    if value is None and optional:
        return None
    allowed = f"a torch.device or a device str such as 'cpu' or 'cuda:0'{' or None' if optional else ''}"
    if not isinstance(value, str | torch.device):
        _fail(TypeError, owner, name, allowed, value, None)
    try:
        return torch.device(value)
    except RuntimeError:
        _fail(ValueError, owner, name, allowed, value, None)


def check_label(owner: str, arg: str, value: Any) -> None:
    """``TypeError``/``ValueError`` naming ``owner`` and ``arg`` unless ``value`` is a non-empty str of
    printable characters (a statistic's name, a stage): no control character such as ``"\\n"``."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}: `{arg}` must be a str, got {type(value).__name__} {value!r:.80}")
    if not value or not value.isprintable():
        raise ValueError(
            f"{owner}: `{arg}` must be a non-empty str of printable characters, without control "
            f"characters such as '\\n' or '\\x1f', got {value!r:.80}"
        )


def check_choice(
    owner: str, name: str, value: Any, choices: Collection[Any], *, hint: str | None = None
) -> None:
    """Raise unless ``value`` is one of ``choices``.

    Args:
        owner, name, value, hint: as :func:`check_int`'s.
        choices: the allowed values (hashable or not; compared with ``==``).

    Raises:
        TypeError: ``value`` is of none of the choices' types (a ``bool`` counts as one only where a
            choice is a ``bool``).
        ValueError: ``value`` is of a choice's type but none of them.

    Example::

        >>> check_choice("DynamicLossScaler", "schedule", "linear", ("exponential", "log2"))
        Traceback (most recent call last):
        ...
        ValueError: DynamicLossScaler: `schedule` must be one of ('exponential', 'log2'), got 'linear'
    """
    choices = tuple(choices)
    allowed = f"one of {choices!r}"
    types = {type(c) for c in choices}
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, tuple(types)):
        _fail(TypeError, owner, name, allowed, value, hint)
    if not any(value == c for c in choices):
        _fail(ValueError, owner, name, allowed, value, hint)
