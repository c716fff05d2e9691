"""The argument checks of ``lightning_ext._checks``: TypeError vs ValueError, and one message format."""

import math
import re

import numpy as np
import pytest
import torch

from lightning_ext._checks import check_bool, check_choice, check_int, check_number

# ------------------------------------------------------------------------------------------ check_int


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (0, {}),
        (-5, {}),
        (1, {"ge": 1}),
        (7, {"ge": 1, "le": 7}),
        (3, {"gt": 2, "lt": 4}),
        (None, {"optional": True}),
        (np.int64(3), {"ge": 1}),  # NumPy's integers are integers (a config's), as numbers.Integral says
        (np.uint8(3), {"ge": 1}),
    ],
)
def test_check_int_accepts(value, kwargs):
    assert check_int("Owner", "n", value, **kwargs) is None


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (True, "True (bool)"),  # a bool is an int to Python, not to us
        (False, "False (bool)"),
        (2.0, "2.0 (float)"),  # an integral float too
        ("3", "'3' (str)"),
        (None, "None"),
        (np.True_, f"{np.True_!r} ({type(np.True_).__name__})"),  # NumPy's bool is no int either
        (torch.tensor(3), "tensor(3) (Tensor)"),  # (the drop-ins take one: lightning_ext._checks.as_number)
    ],
)
def test_check_int_wrong_type_is_a_type_error(value, got):
    with pytest.raises(TypeError) as info:
        check_int("LossMonitor", "every_n_train_steps", value, ge=1)
    assert str(info.value) == f"LossMonitor: `every_n_train_steps` must be an int >= 1, got {got}"


@pytest.mark.parametrize(
    ("value", "kwargs", "allowed"),
    [
        (0, {"ge": 1}, "an int >= 1"),
        (-1, {"ge": 0}, "an int >= 0"),
        (1, {"gt": 1}, "an int > 1"),
        (9, {"le": 8}, "an int <= 8"),
        (8, {"lt": 8}, "an int < 8"),
        (9, {"ge": 1, "le": 8}, "an int in [1, 8]"),
        (1, {"gt": 1, "lt": 8}, "an int in (1, 8)"),
        (0, {"ge": 1, "optional": True}, "an int >= 1 or None"),
    ],
)
def test_check_int_out_of_bounds_is_a_value_error(value, kwargs, allowed):
    with pytest.raises(ValueError) as info:
        check_int("create_process_groups", "group_size", value, **kwargs)
    assert str(info.value) == f"create_process_groups: `group_size` must be {allowed}, got {value!r}"


def test_check_int_none_needs_optional():
    with pytest.raises(TypeError, match=r"^O: `n` must be an int >= 1, got None$"):
        check_int("O", "n", None, ge=1)
    with pytest.raises(TypeError, match=r"^O: `n` must be an int >= 1 or None, got 1\.5 \(float\)$"):
        check_int("O", "n", 1.5, ge=1, optional=True)


# --------------------------------------------------------------------------------------- check_number


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (0.5, {"gt": 0.0, "lt": 1.0}),
        (1, {"gt": 0.0}),
        (0.0, {"ge": 0.0}),
        (1e300, {}),
        (None, {"optional": True}),
        (np.float32(0.5), {"gt": 0.0}),  # every NumPy width alike (np.float64 is a float)
        (np.int8(2), {"gt": 0.0}),
    ],
)
def test_check_number_accepts(value, kwargs):
    assert check_number("Owner", "x", value, **kwargs) is None


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (math.nan, "nan (float)"),
        (math.inf, "inf (float)"),
        (-math.inf, "-inf (float)"),
        (True, "True (bool)"),
        ("1", "'1' (str)"),
        (None, "None"),
        (np.float32("nan"), f"{np.float32('nan')!r} (float32)"),
        ([1.0], "[1.0] (list)"),
    ],
)
def test_check_number_non_finite_or_wrong_type_is_a_type_error(value, got):
    with pytest.raises(TypeError) as info:
        check_number("DynamicLossScaler", "init_scale", value, gt=0.0)
    assert str(info.value) == f"DynamicLossScaler: `init_scale` must be a finite number > 0.0, got {got}"


@pytest.mark.parametrize(
    ("value", "kwargs", "allowed"),
    [
        (0.0, {"gt": 0.0}, "a finite number > 0.0"),
        (-0.1, {"ge": 0.0, "le": 1.0}, "a finite number in [0.0, 1.0]"),
        (1.5, {"ge": 0.0, "le": 1.0}, "a finite number in [0.0, 1.0]"),
        (1.0, {"gt": 0.0, "lt": 1.0}, "a finite number in (0.0, 1.0)"),
        (0, {"gt": 0.0, "le": 1.0}, "a finite number in (0.0, 1.0]"),
        (-1, {"gt": 0.0, "optional": True}, "a finite number > 0.0 or None"),
    ],
)
def test_check_number_out_of_bounds_is_a_value_error(value, kwargs, allowed):
    with pytest.raises(ValueError) as info:
        check_number("SyncBatchNorm", "momentum", value, **kwargs)
    assert str(info.value) == f"SyncBatchNorm: `momentum` must be {allowed}, got {value!r}"


# ----------------------------------------------------------------------------------------- check_bool


def test_check_bool():
    assert check_bool("O", "flag", True) is None and check_bool("O", "flag", False) is None
    for value, got in ((1, "1 (int)"), (0, "0 (int)"), ("yes", "'yes' (str)"), (None, "None")):
        with pytest.raises(TypeError) as info:
            check_bool("LossMonitor", "async_write", value)
        assert str(info.value) == f"LossMonitor: `async_write` must be a bool, got {got}"
    with pytest.raises(TypeError, match=re.escape(f"must be a bool, got {np.True_!r} (")):
        check_bool("O", "flag", np.True_)  # numpy's bool is not a bool


# --------------------------------------------------------------------------------------- check_choice


def test_check_choice():
    schedules = ("exponential", "log2")
    assert check_choice("O", "schedule", "log2", schedules) is None
    with pytest.raises(ValueError) as info:
        check_choice("DynamicLossScaler", "schedule", "linear", schedules)
    assert str(info.value) == (
        "DynamicLossScaler: `schedule` must be one of ('exponential', 'log2'), got 'linear'"
    )
    with pytest.raises(TypeError) as info:  # not even of a choice's type
        check_choice("DynamicLossScaler", "schedule", 2, schedules)
    assert str(info.value) == (
        "DynamicLossScaler: `schedule` must be one of ('exponential', 'log2'), got 2 (int)"
    )
    assert check_choice("O", "n", 2, (1, 2)) is None  # any choices, a list or a set included
    assert check_choice("O", "n", 2, [1, 2]) is None
    with pytest.raises(TypeError, match=r"must be one of \(0, 1\), got True \(bool\)$"):
        check_choice("O", "n", True, (0, 1))  # a bool is not an int choice
    assert check_choice("O", "b", True, (True, 0)) is None  # unless a choice is a bool


# ------------------------------------------------------------------------------------- message format


def test_hint_is_appended_to_both_errors():
    hint = "None updates after every epoch."
    with pytest.raises(ValueError) as info:
        check_int("PreciseBN", "every_n_train_steps", 0, ge=1, optional=True, hint=hint)
    assert str(info.value) == (
        "PreciseBN: `every_n_train_steps` must be an int >= 1 or None, got 0. HINT: " + hint
    )
    with pytest.raises(TypeError, match=re.escape("got 'x' (str). HINT: " + hint)):
        check_int("PreciseBN", "every_n_train_steps", "x", ge=1, optional=True, hint=hint)
    with pytest.raises(TypeError, match=r"got 1 \(int\)\. HINT: pass True$"):
        check_bool("O", "flag", 1, hint="pass True")


def test_a_long_value_is_cut_in_the_message():
    with pytest.raises(TypeError) as info:
        check_number("O", "x", "v" * 500)
    message = str(info.value)
    assert message.startswith("O: `x` must be a finite number, got 'vvv") and message.endswith("... (str)")
    assert len(message) < 150
