"""The goodput ledger (lightning_ext.perf.goodput): parts that add up, state across a SIGKILL and resume."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_ext.perf import LOST_TIME_CAUSES, GoodputLedger

ROOT = Path(__file__).resolve().parents[2]


class _Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _parts_add_up(summary: dict) -> None:
    parts = [summary["productive"], *(summary[c] for c in LOST_TIME_CAUSES), summary["other"]]
    assert math.fsum(parts) == pytest.approx(summary["wall"], rel=1e-12, abs=1e-9), summary


def test_parts_add_up_to_the_wall_time_the_rest_being_other():
    clock = _Clock()
    ledger = GoodputLedger(clock=clock)
    assert math.isnan(ledger.summary()["goodput"])  # no wall time yet
    clock.now += 100.0
    ledger.productive(60.0)
    ledger.add("data_wait", 10.0)
    ledger.add("validation", 5.0)
    ledger.add("checkpointing", 2.0)
    ledger.add("skipped_steps", 1.0)
    summary = ledger.summary()
    assert summary["wall"] == 100.0 and summary["goodput"] == 0.6
    assert summary["other"] == 100.0 - 78.0
    _parts_add_up(summary)


def test_restart_gap_is_the_time_since_the_checkpointed_moment():
    clock = _Clock()
    ledger = GoodputLedger(clock=clock)
    clock.now += 50.0
    ledger.productive(40.0)
    state = ledger.state_dict()  # saved at +50
    clock.now += 30.0  # work after the checkpoint, the crash, the queue: lost
    ledger.productive(25.0)  # what the dead process booked after the checkpoint is not in `state`
    resumed = GoodputLedger(clock=clock)  # relaunched at +80
    clock.now += 5.0  # start-up until the checkpoint is loaded, at +85
    resumed.load_state_dict(state)
    clock.now += 15.0
    resumed.productive(15.0)
    summary = resumed.summary()
    assert summary["wall"] == 100.0  # since the FIRST launch
    assert summary["restart"] == 35.0 and summary["restarts"] == 1
    assert summary["productive"] == 55.0 and summary["goodput"] == 0.55
    _parts_add_up(summary)
    resumed.load_state_dict(resumed.state_dict())  # a second restart (at once)
    assert resumed.summary()["restarts"] == 2


def test_a_state_saved_before_a_cause_existed_loads_with_that_cause_at_zero():
    clock = _Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.add("startup", 3.0)
    ledger.add("data_wait", 2.0)
    state = ledger.state_dict()
    del state["lost"]["startup"]  # as an earlier version saved it
    clock.now += 10.0
    resumed = GoodputLedger(clock=clock)
    resumed.load_state_dict(state)
    summary = resumed.summary()
    assert summary["startup"] == 0.0 and summary["data_wait"] == 2.0 and summary["restart"] == 10.0
    _parts_add_up(summary)


def test_bad_input_is_refused_with_the_argument_named():
    ledger = GoodputLedger(clock=_Clock())
    with pytest.raises(ValueError, match=r"GoodputLedger.add: `cause` must be one of .*got 'other'"):
        ledger.add("other", 1.0)
    with pytest.raises(
        ValueError, match=r"GoodputLedger.productive: `seconds` must be a finite number >= 0.0, got -1.0"
    ):
        ledger.productive(-1.0)
    with pytest.raises(
        TypeError, match=r"GoodputLedger.add: `seconds` must be a finite number >= 0.0, got inf"
    ):
        ledger.add("validation", math.inf)
    state = ledger.state_dict()
    with pytest.raises(ValueError, match=r"`state_dict` must have the keys .*\(missing \['saved_at'\]\)"):
        ledger.load_state_dict({k: v for k, v in state.items() if k != "saved_at"})
    with pytest.raises(ValueError, match=r"`lost` causes of \('startup', .*and the causes \['coffee'\]"):
        ledger.load_state_dict({**state, "lost": {**state["lost"], "coffee": 1.0}})
    with pytest.raises(TypeError, match=r"`lost` must be a mapping of causes to seconds, got \[1.0\]"):
        ledger.load_state_dict({**state, "lost": [1.0]})
    with pytest.raises(TypeError, match=r"load_state_dict: `restarts` must be an int >= 0, got 1.5"):
        ledger.load_state_dict({**state, "restarts": 1.5})
    with pytest.raises(ValueError, match=r"`productive` must be a finite number >= 0.0, got -5"):
        ledger.load_state_dict({**state, "productive": -5.0})  # (a goodput of -72067 before)
    assert ledger.state_dict()["restarts"] == 0  # nothing was loaded


_TRAIN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from lightning_ext.perf import GoodputLedger

    checkpoint, last_step = sys.argv[1], int(sys.argv[2])
    ledger, step = GoodputLedger(), 0
    print("LAUNCHED", ledger.first_launch, flush=True)
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        ledger.load_state_dict(state["ledger"])
        step = state["step"]
        print("LOADED", time.time(), flush=True)
    while step < last_step:
        start = time.perf_counter(); time.sleep(0.02)  # waiting for data
        ledger.add("data_wait", time.perf_counter() - start)
        start = time.perf_counter(); time.sleep(0.05)  # a training step
        ledger.productive(time.perf_counter() - start)
        step += 1
        if step % 2 == 0:
            start = time.perf_counter()
            torch.save({"ledger": ledger.state_dict(), "step": step}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
            ledger.add("checkpointing", time.perf_counter() - start)
            print("SAVED", step, flush=True)
    print("SUMMARY", json.dumps(ledger.summary()), flush=True)
    """
)


def _launch(script: Path, checkpoint: Path, last_step: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(checkpoint), str(last_step)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


GAP = 0.2  # seconds between the kill and the relaunch


@pytest.mark.slow  # two training processes, one killed
@pytest.mark.smoke  # the cheapest (and only) multi-process test of the goodput ledger
@pytest.mark.timeout(180)
def test_ledger_survives_sigkill_and_resume(tmp_path):
    script, checkpoint = tmp_path / "train.py", tmp_path / "last.ckpt"
    script.write_text(_TRAIN)
    first = _launch(script, checkpoint, last_step=10_000)  # runs until killed
    try:
        first_launch = float(first.stdout.readline().split()[1])
        while first.stdout.readline().split() != ["SAVED", "4"]:  # two checkpoints written
            assert first.poll() is None, "the first process ended before its second checkpoint"
        time.sleep(0.1)  # it trains on past the checkpoint: work the restart loses
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    killed = time.time()
    saved = torch.load(checkpoint)
    time.sleep(GAP)  # before the relaunch
    relaunched = time.time()
    second = _launch(script, checkpoint, last_step=saved["step"] + 2)
    out, _ = second.communicate(timeout=120)
    ended = time.time()
    assert second.returncode == 0, out
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    loaded = float(lines["LOADED"])
    summary = json.loads(lines["SUMMARY"])

    _parts_add_up(summary)
    assert summary["restarts"] == 1
    saved_at = saved["ledger"]["saved_at"]
    # The gap runs from the checkpointed moment to the load: the work after it, the kill, the wait, the
    # relaunched process's start-up.
    assert killed - saved_at + GAP <= relaunched - saved_at <= summary["restart"] <= loaded - saved_at
    assert first_launch <= killed and relaunched - first_launch <= summary["wall"] <= ended - first_launch
    steps = saved["step"] + 2  # the steps after the checkpoint in the killed process are not booked
    assert summary["productive"] >= steps * 0.05 and summary["data_wait"] >= steps * 0.02
    assert summary["checkpointing"] > 0.0
    assert summary["goodput"] == pytest.approx(summary["productive"] / summary["wall"], rel=1e-12)
