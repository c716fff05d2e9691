"""DynamicLossScaler: schedules vs hand-computed sequences and Megatron-LM, GradScaler equivalence,
counters, skip-only mode, bounds, telemetry, state, pickling, process groups, per-optimizer scales."""

from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
import random
import re
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lightning_ext.amp import DynamicLossScaler, PerOptimizerLossScaler, schedules
from lightning_ext.stats import Collector
from tests.helpers.distributed import run_distributed

INF, NAN = float("inf"), float("nan")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    return model, x, y


def _train(scaler, optimizer_fn, poison_steps, steps=10, seed=0, poison=INF):
    """A plain GradScaler loop; ``poison`` is written into one gradient on ``poison_steps``."""
    model, x, y = _model_and_data(seed)
    opt = optimizer_fn(model.parameters())
    scales = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in poison_steps:
            model[0].weight.grad[0, 0] = poison
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, opt, scales


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}


def _count_step_calls(opt):
    """Wrap ``opt.step`` (instance attribute) to count how often the scaler calls it."""
    calls = []
    step = opt.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    opt.step = counted
    return calls


# ------------------------------------------------------------------------------------------------
# Pure schedule maths (lightning_ext.amp.schedules)
# ------------------------------------------------------------------------------------------------


def _run_schedule(found_infs, init, schedule="exponential", min_scale=None, max_scale=None, **cfg):
    """Scales, floor hits and log2 scales along ``found_infs`` through the pure schedule functions."""
    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, increment=0.25, decrement=1.0)
    kw.update(cfg)
    hysteresis, consecutive = kw.pop("hysteresis", 1), kw.pop("consecutive", False)
    scale = torch.tensor(float(init))
    log2_scale = torch.log2(scale.double())
    growth_tracker = torch.tensor(0, dtype=torch.int32)
    hysteresis_tracker = torch.tensor(hysteresis, dtype=torch.int32)
    scales, floors, log2s = [], [], []
    for f in found_infs:
        found_inf = torch.tensor(float(f))
        if schedule == "log2":
            back_off = schedules._log2_(scale, log2_scale, growth_tracker, hysteresis_tracker, found_inf,
                                       kw["increment"], kw["decrement"], hysteresis,
                                       kw["growth_interval"])  # fmt: skip
        else:
            back_off = schedules._exponential_(
                scale, growth_tracker, hysteresis_tracker, found_inf,
                kw["growth_factor"], kw["backoff_factor"], kw["growth_interval"], hysteresis, consecutive,
            )  # fmt: skip
        assert back_off.dtype == torch.bool and back_off.dim() == 0
        log2 = log2_scale if schedule == "log2" else None
        hit = schedules._clamp_(scale, log2, back_off, min_scale, max_scale)
        scales.append(scale.item())
        floors.append(bool(hit))
        log2s.append(log2_scale.item())
        if schedule == "log2":
            assert scale.item() == float(torch.exp2(log2_scale).float())
    return scales, floors, log2s


def test_exponential_schedule_matches_hand_computed_sequence():
    scales, floors, _ = _run_schedule([0, 0, 0, 1, 0, 0, 0, 0, 1, 1], init=8)
    assert scales == [8, 8, 16, 8, 8, 8, 16, 16, 8, 4]
    assert not any(floors)


def test_log2_schedule_matches_hand_computed_sequence_and_floor():
    _, floors, log2s = _run_schedule([0, 0, 1, 0, 1, 1, 1], init=8, schedule="log2", min_scale=1.0)
    # Increments of 0.25 and 1 are exact in binary: the float64 log2 values are exact.
    assert log2s == [3.25, 3.5, 2.5, 2.75, 1.75, 0.75, 0.0]
    # 0.75 - 1 < log2(min_scale) = 0: the last overflow hit the floor and was clamped.
    assert floors == [False] * 6 + [True]


def test_log2_hysteresis_counts_consecutive_overflows():
    """log2: the tracker refills on every clean step, so only ``hysteresis`` overflows in a row back off."""
    _, _, log2s = _run_schedule([1, 0, 1, 1], init=8, schedule="log2", hysteresis=2)
    assert log2s == [3.0, 3.25, 3.25, 2.25]


def test_max_scale_clamps_growth_and_min_scale_clamps_backoff():
    scales, floors, _ = _run_schedule([0, 0, 0], init=512, growth_interval=1, max_scale=1024.0)
    assert scales == [1024, 1024, 1024] and not any(floors)
    scales, floors, _ = _run_schedule([1, 1, 1], init=4, min_scale=2.0)
    assert scales == [2, 2, 2]
    assert floors == [False, True, True]
    scales, _, log2s = _run_schedule([0] * 4, init=8, schedule="log2", increment=0.5, max_scale=16.0)
    assert log2s == [3.5, 4.0, 4.0, 4.0] and scales[1:] == [16, 16, 16]


@pytest.mark.parametrize("telemetry", [False, True])
def test_update_launches_few_kernels(telemetry):
    """Each ATen op of ``update()`` is a kernel launch on a GPU, about 10 us of host time each on an
    H200 (GradScaler's update is one): ours stays at 8 without telemetry (the counters, the flag and
    GradScaler's own op), counted through the dispatcher on CPU, where the same ops run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", telemetry=telemetry)
    for _ in range(2):
        scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        with Count() as count:
            scaler.update()
    assert len(count.ops) <= (12 if telemetry else 8), count.ops


def test_count_counts_steps_skips_and_runs():
    steps, skipped, run = (torch.zeros((), dtype=torch.float64) for _ in range(3))
    seen = []
    for f in [1, 1, 0, 1, 0, 0, 1, 1, 1]:
        schedules._count_(steps, skipped, run, torch.tensor(float(f)))
        seen.append(int(run))
    assert seen == [1, 2, 0, 1, 0, 0, 1, 2, 3]
    assert int(steps) == 9 and int(skipped) == 6


def _megatron_scales(found_infs, init, growth_factor, backoff_factor, growth_interval, hysteresis):
    """Megatron-LM's ``DynamicGradScaler.update`` (megatron/core/optimizer/grad_scaler.py), transcribed
    without its min_scale (ours is unbounded unless ``min_scale`` is given); float32 scale as there."""
    scale = torch.tensor(float(init))
    growth_tracker, hysteresis_tracker = 0, hysteresis
    scales = []
    for found_inf in found_infs:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = scale * backoff_factor
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = scale * growth_factor
        scales.append(scale.item())
    return scales


@pytest.mark.parametrize("hysteresis", [1, 2, 3, 5])
def test_exponential_hysteresis_equals_megatron_on_random_patterns(hysteresis):
    """Bitwise: the factors are exact in float32, so each multiply rounds once in both. The patterns
    keep the scale a normal float32 (Megatron has no overflow guard on growth)."""
    rng = random.Random(hysteresis)
    for trial, (p, interval) in enumerate(zip([0.05, 0.1, 0.2, 0.3, 0.4, 0.45], [8, 6, 4, 3, 2, 2])):
        found = [rng.random() < p for _ in range(300)]
        cfg = dict(growth_factor=[2.0, 3.0][trial % 2], backoff_factor=[0.5, 0.375][trial % 2],
                   growth_interval=interval, hysteresis=hysteresis)  # fmt: skip
        ours, _, _ = _run_schedule(found, init=2.0**12, **cfg)
        reference = _megatron_scales(found, 2.0**12, **cfg)
        assert ours == reference, (trial, cfg)
        assert all(2.0**-126 <= s < 2.0**128 for s in reference), (trial, cfg)
        moves = [b / a for a, b in zip([2.0**12, *reference], reference)]
        assert cfg["growth_factor"] in moves and cfg["backoff_factor"] in moves, (trial, cfg)


def _deepspeed_scales(found_infs, init, scale_factor, scale_window, delayed_shift, consecutive_hysteresis):
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py, Apache-2.0),
    transcribed with ``min_scale=0`` and ``raise_error_at_min_scale=False``; float32 scale as ours."""
    scale = torch.tensor(float(init))
    cur_iter, last_overflow_iter, cur_hysteresis = 0, -1, delayed_shift
    scales = []
    for overflow in found_infs:
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                scale = scale / scale_factor
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive_hysteresis:
                cur_hysteresis = delayed_shift
            if (cur_iter - last_overflow_iter) % scale_window == 0:
                if not consecutive_hysteresis:
                    cur_hysteresis = delayed_shift
                scale = scale * scale_factor
        cur_iter += 1
        scales.append(scale.item())
    return scales


@pytest.mark.parametrize("consecutive", [False, True], ids=["hysteresis", "consecutive_hysteresis"])
@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_exponential_hysteresis_equals_deepspeed_on_random_and_burst_patterns(hysteresis, consecutive):
    """Bitwise against DeepSpeed (delayed_shift=hysteresis, scale_window=growth_interval, factor 2):
    random overflows and bursts of them separated by clean runs, where the two hysteresis modes differ."""
    rng = random.Random(10 * hysteresis + consecutive)
    patterns = [[rng.random() < p for _ in range(300)] for p in (0.1, 0.3, 0.45)]
    patterns.append([i % 7 in (0, 2, 4) for i in range(300)])  # overflows with one clean step between
    for found in patterns:
        cfg = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=hysteresis)
        ours, _, _ = _run_schedule(found, init=2.0**12, consecutive=consecutive, **cfg)
        reference = _deepspeed_scales(found, 2.0**12, 2.0, 3, hysteresis, consecutive)
        assert ours == reference
        assert all(2.0**-126 <= s < 2.0**128 for s in reference)
    burst = patterns[-1]  # tolerated overflows add up across clean steps unless consecutive
    if hysteresis > 1:
        plain = _run_schedule(burst, init=2.0**12, consecutive=False, **cfg)[0]
        assert plain != _run_schedule(burst, init=2.0**12, consecutive=True, **cfg)[0]


def test_consecutive_hysteresis_through_the_scaler_and_its_state_dict():
    cfg = dict(init_scale=2.0**12, growth_interval=3, hysteresis=2, consecutive_hysteresis=True)
    scaler = DynamicLossScaler("cpu", **cfg, telemetry=False)
    history = [(NAN,), (None,), (NAN,), (None,), (NAN,), (NAN,)]
    _Loop(scaler, 1).run(history)
    expected = _deepspeed_scales([h[0] is not None for h in history], 2.0**12, 2.0, 3, 2, True)
    assert scaler.get_scale() == expected[-1] == 2.0**11  # only the two in a row backed off
    assert scaler.state_dict()["consecutive_hysteresis"] is True
    with pytest.raises(TypeError, match="`consecutive_hysteresis` must be a bool, got 1"):
        DynamicLossScaler("cpu", consecutive_hysteresis=1)


# ------------------------------------------------------------------------------------------------
# Schedules through the scaler, in a training loop
# ------------------------------------------------------------------------------------------------


def test_hysteresis_in_a_training_loop_follows_megatron_by_hand():
    """hysteresis=3, growth_interval=2, init 8 (Megatron-LM's DynamicGradScaler, worked by hand):
    every overflow is skipped; the 3rd overflow since the last growth backs off, and once the tracker is
    exhausted so does every further one, until a growth refills it; a tolerated overflow restarts the
    growth count; the overflows need not be consecutive (steps 15, 17, 19)."""
    poison = {0, 1, 2, 5, 6, 7, 8, 12, 15, 17, 19}
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=3, telemetry=False)
    _, _, scales = _train(scaler, _sgd, poison, steps=20)
    #           s0 s1 s2 s3 s4 s5 s6 s7 s8 s9 10 11 12 13 14 15 16 17 18 19
    assert scales == [8, 8, 4, 4, 8, 8, 8, 4, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8, 8, 4]
    assert scaler.steps == 20 and scaler.skipped_steps == len(poison)
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 0 and state["_growth_tracker"] == 0


def test_log2_schedule_in_a_training_loop():
    scaler = DynamicLossScaler("cpu", init_scale=8.0, schedule="log2", log2_increment=0.25, telemetry=False)
    _, _, scales = _train(scaler, _sgd, poison_steps={2, 4, 5}, steps=7)
    expected = [3.25, 3.5, 2.5, 2.75, 1.75, 0.75, 1.0]  # exact binary fractions
    for s, e in zip(scales, expected, strict=True):
        # The scale is float32(2 ** log2) from float64 exp2: within one float32 rounding of 2 ** e.
        assert s == pytest.approx(2.0**e, rel=2**-24)
    assert scaler.state_dict()["log2_scale"] == expected[-1]


def test_bounds_are_opt_in():
    """GradScaler's arguments only: no floor below 1 and no cap, as GradScaler."""
    low = DynamicLossScaler("cpu", init_scale=1.0, telemetry=False)
    _, _, scales = _train(low, _sgd, poison_steps={0, 1, 2}, steps=3)
    assert scales == [0.5, 0.25, 0.125]
    high = DynamicLossScaler("cpu", init_scale=2.0**24, growth_interval=1, telemetry=False)
    _, _, scales = _train(high, _sgd, poison_steps=set(), steps=2)
    assert scales == [2.0**25, 2.0**26]
    capped = DynamicLossScaler(
        "cpu", init_scale=2.0**24, growth_interval=1, max_scale=2.0**25, telemetry=False
    )
    _, _, scales = _train(capped, _sgd, poison_steps=set(), steps=2)
    assert scales == [2.0**25, 2.0**25]


def test_on_min_scale_policies():
    def run(policy):
        scaler = DynamicLossScaler("cpu", init_scale=4.0, min_scale=1.0, on_min_scale=policy, telemetry=False)
        _train(scaler, _sgd, poison_steps={0, 1, 2}, steps=3)  # 4 -> 2 -> 1 -> floor
        return scaler

    with pytest.raises(FloatingPointError, match=r"hit its floor min_scale=1\.0 after 3 consecutive"):
        run("raise")
    with pytest.warns(RuntimeWarning, match=r"hit its floor min_scale=1\.0 after 3 consecutive"):
        assert run("warn").get_scale() == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clamped = run("clamp")
        assert clamped.get_scale() == 1.0 and clamped.skipped_steps == 3
        # Without min_scale the policy has nothing to act on (no floor, no warning).
        free = DynamicLossScaler("cpu", init_scale=4.0, on_min_scale="raise", telemetry=False)
        _train(free, _sgd, poison_steps={0, 1, 2, 3}, steps=4)
        assert free.get_scale() == 0.25


def test_on_min_scale_warn_warns_once_per_stay_at_the_floor():
    scaler = DynamicLossScaler(
        "cpu", init_scale=4.0, growth_interval=1, min_scale=1.0, on_min_scale="warn", telemetry=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, scales = _train(scaler, _sgd, poison_steps=set(range(50)), steps=50)  # 4 -> 2 -> 1, floor
        assert scales[-1] == 1.0 and len(caught) == 1 and "after 3 consecutive" in str(caught[0].message)
        # A clean step leaves the floor (1 -> 2), overflows come back to it: one warning more.
        _, _, scales = _train(scaler, _sgd, poison_steps={1, 2, 3, 4}, steps=5)
        assert scales == [2.0, 1.0, 1.0, 1.0, 1.0] and len(caught) == 2
        assert "after 2 consecutive" in str(caught[1].message)


def test_update_new_scale_respects_explicit_bounds():
    scaler = DynamicLossScaler("cpu", init_scale=4.0, min_scale=1.0, max_scale=1024.0, telemetry=False)
    _train(scaler, _sgd, poison_steps=set(), steps=1)
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    allowed = r"DynamicLossScaler\.update: `new_scale` must be a finite number in \[1\.0, 1024\.0\], got "
    with pytest.raises(ValueError, match=allowed + r"0\.5$"):
        scaler.update(new_scale=0.5)
    with pytest.raises(TypeError, match=allowed + r"True \(bool\)$"):
        scaler.update(new_scale=True)
    scaler.update(new_scale=torch.tensor(4096.0))  # a tensor is GradScaler's path, then clamped
    assert scaler.get_scale() == 1024.0 and scaler.state_dict()["log2_scale"] == 10.0


# ------------------------------------------------------------------------------------------------
# Against torch.amp.GradScaler
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_fn", list(_OPTIMIZERS.values()), ids=list(_OPTIMIZERS))
def test_exponential_schedule_equals_grad_scaler(optimizer_fn):
    poison = {1, 4, 5}
    cfg = dict(init_scale=2.0**4, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", **cfg)
    ref_model, ref_opt, ref_scales = _train(ref, optimizer_fn, poison)
    ours = DynamicLossScaler("cpu", **cfg, telemetry=False)
    model, opt, scales = _train(ours, optimizer_fn, poison)
    assert scales == ref_scales
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
    assert ours.steps == 10 and ours.skipped_steps == 3
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]


def test_skipped_step_leaves_params_and_optimizer_state_bit_identical():
    model, x, y = _model_and_data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler("cpu", init_scale=256.0, telemetry=False)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 2:
            model[2].bias.grad[1] = NAN
            params = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(opt.state_dict())
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped == (step == 2)
    assert scaler.last_step_skipped and bool(scaler.last_step_skipped_tensor)
    assert scaler.get_scale() == 128.0 and scaler.consecutive_overflows == 1
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    after = opt.state_dict()["state"]
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(after[k][name], t), name


def test_sparse_gradients_are_unscaled_and_checked():
    """``nn.Embedding(sparse=True)`` gradients: their values are unscaled, an inf among them skips."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([*emb.parameters(), *dense.parameters()], lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=8.0, telemetry=False)
    idx = torch.tensor([1, 4, 4])
    scaler.scale(dense(emb(idx)).sum()).backward()
    expected = emb.weight.grad.coalesce().values() / 8.0
    scaler.unscale_(opt)
    assert torch.equal(emb.weight.grad.coalesce().values(), expected)  # division by a power of two
    before = emb.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and not torch.equal(emb.weight, before)
    opt.zero_grad()
    scaler.scale(dense(emb(idx)).sum()).backward()
    emb.weight.grad._values()[0, 0] = INF
    before = emb.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and torch.equal(emb.weight, before)


def test_unscale_before_step_gives_true_gradients_bitwise():
    """A power-of-two scale commutes exactly with every op of the backward (no overflow or
    denormals at this size), so the unscaled gradients equal the unscaled backward's bit for bit."""
    model, x, y = _model_and_data()
    ref = copy.deepcopy(model)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, telemetry=False)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def _two_models_scaled_backward():
    """Two Linear(3, 3) with an SGD each, and one scaled backward through both (scale 64)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    opt_a, opt_b = _sgd(a.parameters()), _sgd(b.parameters())
    scaler = DynamicLossScaler("cpu", init_scale=64.0, growth_interval=1, telemetry=False)
    x = torch.randn(4, 3)
    scaler.scale((a(x) + b(x)).square().mean()).backward()
    return a, b, opt_a, opt_b, scaler


def test_several_optimizers_skip_only_the_overflowing_one_and_update_once():
    a, b, opt_a, opt_b, scaler = _two_models_scaled_backward()
    a.weight.grad[0, 0] = INF
    wa, wb = a.weight.detach().clone(), b.weight.detach().clone()
    assert scaler.step(opt_a) is None
    scaler.step(opt_b)
    scaler.update()
    assert torch.equal(a.weight, wa) and not torch.equal(b.weight, wb)
    # One scale move for both (combined found_inf); each optimizer step counted.
    assert scaler.get_scale() == 32.0 and scaler.steps == 2 and scaler.skipped_steps == 1
    # The update skipped (the first optimizer's step) and the run of overflows ended (the last one's
    # step): its checkpoint loads, into a new scaler and back into its own (it was refused).
    state = scaler.state_dict()
    assert state["last_step_skipped"] and state["consecutive_overflows"] == 0
    resumed = DynamicLossScaler("cpu", telemetry=False)
    resumed.load_state_dict(state)
    scaler.load_state_dict(state)
    assert resumed.state_dict() == scaler.state_dict() == state


def test_update_with_optimizer_moves_a_shared_scale_once_for_all_steps():
    _, b, opt_a, opt_b, scaler = _two_models_scaled_backward()
    b.weight.grad[0, 0] = INF
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update(optimizer=opt_a)  # a shared scale ignores `optimizer`: b's overflow backs off
    assert scaler.get_scale() == 32.0 and scaler.steps == 2 and scaler.skipped_steps == 1
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


# ------------------------------------------------------------------------------------------------
# Counters and fused optimizers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_counters_over_runs_of_overflows_and_clean_steps(optimizer):
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=100, telemetry=False)
    poison = {1, 2, 3, 6, 9, 10}
    model, x, y = _model_and_data()
    opt = _OPTIMIZERS[optimizer](model.parameters())
    calls = _count_step_calls(opt)
    expected_run, run, seen = [], 0, []
    for step in range(12):
        run = run + 1 if step in poison else 0
        expected_run.append(run)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step in poison:
            model[0].weight.grad[0, 0] = INF if step % 2 else NAN
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert same == (step in poison), step
        assert bool(scaler.last_step_skipped_tensor) == (step in poison) == scaler.last_step_skipped, step
        seen.append(scaler.consecutive_overflows)
    assert seen == expected_run
    assert scaler.steps == 12 and scaler.skipped_steps == len(poison)
    assert scaler.get_scale() == 2.0 ** (10 - len(poison))
    # Fused optimizers take found_inf and skip on the device: called on every step; the others are
    # not called when the step is skipped (the skip decision read on the host).
    assert len(calls) == (12 if optimizer.endswith("fused") else 12 - len(poison))


# ------------------------------------------------------------------------------------------------
# Skip-only mode: enabled=False, skip_nonfinite=True
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_skip_only_mode_skips_nonfinite_steps_bitwise(optimizer):
    model, x, y = _model_and_data()
    opt = _OPTIMIZERS[optimizer](model.parameters())
    calls = _count_step_calls(opt)
    scaler = DynamicLossScaler("cpu", enabled=False, skip_nonfinite=True, telemetry=False)
    for step in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        assert scaler.scale(loss) is loss
        loss.backward()
        if step == 2:
            model[0].bias.grad[0] = NAN
        params = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict()["state"])
        scaler.step(opt)
        scaler.update()
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        assert same == (step == 2) == scaler.last_step_skipped, step
        if step == 2:
            after = opt.state_dict()["state"]
            assert all(torch.equal(after[k][n], t) for k, v in state.items() for n, t in v.items())
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.steps == 4 and scaler.skipped_steps == 1
    assert len(calls) == (4 if optimizer.endswith("fused") else 3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_disabled_scaler_without_skip_nonfinite_is_grad_scalers_pass_through():
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())
    scaler = DynamicLossScaler("cpu", enabled=False, telemetry=False)
    assert not scaler.skip_nonfinite
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[0].bias.grad[0] = NAN
    scaler.unscale_(opt)  # no-op
    scaler.step(opt)
    scaler.update()  # no-op, no error
    assert torch.isnan(model[0].bias).any()
    assert scaler.state_dict() == {} == torch.amp.GradScaler("cpu", enabled=False).state_dict()
    assert scaler.steps == 0 and not scaler.last_step_skipped


def test_skip_only_checks_without_changing_gradients(monkeypatch):
    """Skip-only, unscale_ is the inf/NaN check alone: gradients bitwise as they were, a clean step
    taken (the read-only ``check_finite`` path, not a multiply by 1)."""
    from lightning_ext.kernels import KernelBackend

    run = KernelBackend.run

    def no_rewrite(self, op, *args, **kwargs):
        assert op != "unscale_and_check_", "the skip-only mode must not run the multiply-and-check op"
        return run(self, op, *args, **kwargs)

    monkeypatch.setattr(KernelBackend, "run", no_rewrite)
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())
    scaler = DynamicLossScaler("cpu", enabled=False, skip_nonfinite=True, telemetry=False)
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[0].weight.grad[0, 0] = -0.0  # a multiply would keep it too; the values must not move at all
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g) and torch.equal(p.grad.signbit(), g.signbit())
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(opt) is None  # SGD.step returns None too: check that it stepped
    scaler.update()
    assert scaler.skipped_steps == 0 and scaler.steps == 1
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_skip_only_protocol_misuse_raises_grad_scalers_errors():
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())
    scaler = DynamicLossScaler("cpu", enabled=False, skip_nonfinite=True, telemetry=False)
    torch.nn.functional.mse_loss(model(x), y).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(device=0), TypeError, r"`device` must be a torch.device or a device str such as 'cpu' or "
         r"'cuda:0', got 0 \(int\)"),
        (dict(device="gpu"), ValueError, r"`device` must be a torch.device or a device str .*got 'gpu'"),
        (dict(enabled=2), TypeError, r"`enabled` must be a bool, got 2"),
        (dict(init_scale="1"), TypeError,
         r"^DynamicLossScaler: `init_scale` must be a finite number > 0\.0, got '1' \(str\)$"),
        (dict(init_scale=math.inf), TypeError, r"`init_scale` must be a finite number > 0\.0, got inf \(fl"),
        (dict(init_scale=math.nan), TypeError, r"`init_scale` must be a finite number > 0\.0, got nan"),
        (dict(init_scale=0.0), ValueError,
         r"^DynamicLossScaler: `init_scale` must be a finite number > 0\.0, got 0\.0$"),
        (dict(growth_factor=1.0), ValueError, r"`growth_factor` must be a finite number > 1\.0, got 1\.0"),
        (dict(growth_factor=None), TypeError, r"`growth_factor` must be a finite number > 1\.0, got None"),
        (dict(backoff_factor=1.0), ValueError,
         r"`backoff_factor` must be a finite number in \(0\.0, 1\.0\), got 1\.0"),
        (dict(backoff_factor=0.0), ValueError,
         r"`backoff_factor` must be a finite number in \(0\.0, 1\.0\), got 0\.0"),
        (dict(growth_interval=0), ValueError, r"`growth_interval` must be an int >= 1, got 0"),
        (dict(growth_interval=2.5), TypeError, r"`growth_interval` must be an int >= 1, got 2\.5 \(float\)"),
        (dict(enabled="yes"), TypeError, r"`enabled` must be a bool, got 'yes'"),
        (dict(schedule="linear"), ValueError, r"`schedule` must be one of \('exponential', 'log2'\), got 'l"),
        (dict(schedule=2), TypeError, r"`schedule` must be one of \('exponential', 'log2'\), got 2 \(int\)"),
        (dict(log2_increment=0.0), ValueError, r"`log2_increment` must be a finite number > 0\.0, got 0\.0"),
        (dict(log2_decrement=-1.0), ValueError, r"`log2_decrement` must be a finite number > 0\.0, got -1\."),
        (dict(log2_decrement="1"), TypeError, r"`log2_decrement` must be a finite number > 0\.0, got '1'"),
        (dict(hysteresis=0), ValueError, r"`hysteresis` must be an int in \[1, 2147483647\], got 0"),
        (dict(hysteresis=True), TypeError, r"`hysteresis` must be an int in \[1, 2147483647\], got True \("),
        (dict(hysteresis=2**31), ValueError, r"`hysteresis` must be an int in \[1, 2147483647\], got 21474"),
        (dict(min_scale="1"), TypeError, r"`min_scale` must be a finite number > 0\.0 or None, got '1'"),
        (dict(min_scale=0.0), ValueError, r"`min_scale` must be a finite number > 0\.0 or None, got 0\.0"),
        (dict(max_scale=-1.0), ValueError, r"`max_scale` must be a finite number > 0\.0 or None, got -1\.0"),
        (
            dict(min_scale=8.0, max_scale=4.0, init_scale=4.0),
            ValueError,
            r"need min_scale <= init_scale <= max_scale, got min_scale=8\.0, init_scale=4\.0, max_scale=4\.0",
        ),
        (dict(max_scale=2.0**10), ValueError, r"need min_scale <= init_scale <= max_scale, .*=65536\.0"),
        (dict(on_min_scale="no"), ValueError,
         r"`on_min_scale` must be one of \('warn', 'raise', 'clamp'\), got 'no'"),
        (dict(skip_nonfinite=1), TypeError, r"`skip_nonfinite` must be a bool, got 1"),
        (dict(process_group="w"), TypeError,
         r"`process_group` must be a torch\.distributed\.ProcessGroup or None, got 'w'"),
        (dict(telemetry=None), TypeError, r"`telemetry` must be a bool, got None"),
        (dict(per_optimizer="yes"), TypeError, r"`per_optimizer` must be a bool, got 'yes'"),
    ],
)  # fmt: skip
def test_bad_arguments_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScaler(**{"device": "cpu", **kwargs})


@pytest.mark.parametrize("enabled", [True, False])
def test_unscale_and_step_refuse_a_non_optimizer(enabled):
    scaler = DynamicLossScaler("cpu", enabled=enabled, skip_nonfinite=not enabled, telemetry=False)
    for method in (scaler.unscale_, scaler.step):
        with pytest.raises(TypeError, match=r"`optimizer` must be a torch\.optim\.Optimizer, got str 'sgd'"):
            method("sgd")


def test_cuda_device_without_cuda_disables_with_our_warning():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the scaler stays enabled")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = DynamicLossScaler()
    messages = [str(w.message) for w in caught]
    assert messages == [
        "DynamicLossScaler('cuda') is enabled, but CUDA is not available: disabling it (as "
        "torch.amp.GradScaler does). HINT: use DynamicLossScaler('cpu') to scale losses on CPU."
    ], messages  # ours alone: not GradScaler's, which names torch.cuda.amp.GradScaler
    assert caught[0].filename == __file__  # points at the caller's line
    assert not scaler.is_enabled() and not scaler.skip_nonfinite


# ------------------------------------------------------------------------------------------------
# State dict
# ------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_continues_identically():
    cfg = dict(init_scale=2.0**6, growth_interval=2, hysteresis=2, schedule="exponential", telemetry=False)
    first = DynamicLossScaler("cpu", **cfg)
    _train(first, _sgd, poison_steps={1, 2, 3}, steps=5)
    state = first.state_dict()
    second = DynamicLossScaler("cpu", telemetry=False)  # other settings: the state dict carries the config
    second.load_state_dict(copy.deepcopy(state))
    assert second.state_dict() == state
    assert state["steps"] == 5 and state["skipped_steps"] == 3 and state["hysteresis"] == 2
    assert state["log2_scale"] == math.log2(state["scale"])
    _, _, s1 = _train(first, _sgd, poison_steps={0, 3}, steps=6)
    _, _, s2 = _train(second, _sgd, poison_steps={0, 3}, steps=6)
    assert s1 == s2 and first.state_dict() == second.state_dict()


@pytest.mark.parametrize("last_skipped", [True, False])
def test_last_step_skipped_survives_a_load_a_pickle_and_a_copy_before_the_next_step(last_skipped):
    # Before its first step a loaded scaler said False whatever the state said (its counters were right).
    scaler = DynamicLossScaler("cpu", telemetry=False)
    _train(scaler, _sgd, poison_steps={2} if last_skipped else {1}, steps=3)
    assert scaler.last_step_skipped is last_skipped
    loaded = DynamicLossScaler("cpu", telemetry=False)
    loaded.load_state_dict(scaler.state_dict())
    for other in (loaded, pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert other.last_step_skipped is last_skipped
        assert bool(other.last_step_skipped_tensor) is last_skipped


def test_log2_state_dict_round_trip():
    log2 = DynamicLossScaler("cpu", schedule="log2", log2_increment=1e-3, telemetry=False)
    _train(log2, _sgd, poison_steps={2}, steps=4)
    assert log2.state_dict()["log2_scale"] == pytest.approx(16 + 3e-3 - 1, abs=1e-12)
    copied = DynamicLossScaler("cpu", telemetry=False)
    copied.load_state_dict(log2.state_dict())
    assert copied.state_dict() == log2.state_dict() and copied.schedule == "log2"
    _, _, s1 = _train(log2, _sgd, poison_steps={1}, steps=3)
    _, _, s2 = _train(copied, _sgd, poison_steps={1}, steps=3)
    assert s1 == s2 and copied.state_dict() == log2.state_dict()


def test_skip_only_state_dict_round_trip():
    first = DynamicLossScaler("cpu", enabled=False, skip_nonfinite=True, telemetry=False)
    _train(first, _sgd, poison_steps={1, 2}, steps=3)
    state = first.state_dict()
    assert "scale" not in state and state["steps"] == 3 and state["skipped_steps"] == 2
    second = DynamicLossScaler("cpu", enabled=False, skip_nonfinite=True, telemetry=False)
    second.load_state_dict(state)
    assert second.state_dict() == state


def test_grad_scaler_state_dicts_load_both_ways():
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    _train(ref, _sgd, poison_steps={0}, steps=3)
    ours = DynamicLossScaler("cpu", hysteresis=2, telemetry=False)
    ours.load_state_dict(ref.state_dict())
    state = ours.state_dict()
    assert state["scale"] == ref.get_scale() == 2.0**7
    assert state["_growth_tracker"] == 2 and state["growth_interval"] == 3
    assert state["hysteresis"] == 2 and state["_hysteresis_tracker"] == 2 and state["steps"] == 0
    # Both continue identically from there (hysteresis aside: no overflow follows).
    _, _, ours_scales = _train(ours, _sgd, poison_steps=set(), steps=4)
    _, _, ref_scales = _train(ref, _sgd, poison_steps=set(), steps=4)
    assert ours_scales == ref_scales == [2.0**8, 2.0**8, 2.0**8, 2.0**9]
    # GradScaler reads ours back.
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == ref.state_dict()
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        ours.load_state_dict({})


def test_a_log2_state_loads_into_grad_scaler_which_goes_on_growing():
    # The log2 schedule's tracker counted clean steps without bound: GradScaler, which grows when its
    # tracker reaches growth_interval - 1, never grew again after loading one past it.
    ours = DynamicLossScaler("cpu", schedule="log2", growth_interval=10, telemetry=False)
    _train(ours, _sgd, poison_steps=set(), steps=25)
    state = ours.state_dict()
    assert state["_growth_tracker"] == 25 % 10
    ref = torch.amp.GradScaler("cpu")
    ref.load_state_dict(state)
    _, _, scales = _train(ref, _sgd, poison_steps=set(), steps=15)
    assert scales[-1] == 4 * state["scale"]  # grown after 5 and after 15 more clean steps
    copied = DynamicLossScaler("cpu", telemetry=False)
    copied.load_state_dict(state)  # our own round trip stays lossless
    assert copied.state_dict() == state


# Every state the scaler can reach, as (config, history): each history row is one iteration, a value
# per optimizer (None: clean gradients, else written into them) or ("new_scale", value) for one clean
# step followed by update(new_scale=value).
_F32_MAX = torch.finfo(torch.float32).max
_REACHABLE = {
    "fresh": (dict(), []),
    "exponential-scale-0": (dict(init_scale=2.0**-149), [(NAN,)]),
    "log2-scale-0": (dict(init_scale=2.0**-149, schedule="log2"), [(NAN,), (INF,)]),
    "exponential-subnormal": (dict(init_scale=2.0**-140), [(NAN,)]),
    "log2-subnormal": (dict(init_scale=2.0**-140, schedule="log2"), [(None,), (NAN,)]),
    "exponential-float32-max": (dict(init_scale=_F32_MAX, growth_interval=1), [(None,), (None,)]),
    "log2-float32-max": (dict(init_scale=_F32_MAX, schedule="log2", log2_increment=0.5), [(None,)]),
    "new-scale-float": (dict(), [("new_scale", 3.0)]),
    "new-scale-tensor-0": (dict(), [("new_scale", torch.tensor(0.0))]),
    "new-scale-tensor-max": (dict(schedule="log2"), [("new_scale", torch.tensor(_F32_MAX))]),
    "hysteresis-midway": (
        dict(hysteresis=3, consecutive_hysteresis=True, growth_interval=2), [(NAN,), (None,), (NAN,)]
    ),
    "bounds-at-floor": (
        dict(init_scale=2.0, min_scale=1.0, max_scale=2.0**20, on_min_scale="clamp"), [(NAN,), (NAN,)]
    ),
    "skip-only": (dict(enabled=False, skip_nonfinite=True), [(NAN,), (None,)]),
    "per-optimizer": (dict(init_scale=2.0**-149, per_optimizer=True), [(NAN, None)]),
}


class _Loop:
    """One linear model and SGD optimizer per scale; :meth:`run` plays a history on a scaler."""

    def __init__(self, scaler, n):
        torch.manual_seed(0)
        self.models = [torch.nn.Linear(3, 1) for _ in range(n)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in self.models]
        self.scaler = scaler
        self.per_optimizer = getattr(scaler, "per_optimizer", False)  # GradScaler has none
        if self.per_optimizer:
            for i, opt in enumerate(self.opts):
                scaler.register_optimizer(opt, f"opt{i}")

    def run(self, history):
        for row in history:
            new_scale = row[1] if row[0] == "new_scale" else None
            values = (None,) * len(self.opts) if new_scale is not None else row
            for model, opt, value in zip(self.models, self.opts, values):
                opt.zero_grad()
                kw = {"optimizer": opt} if self.per_optimizer else {}
                self.scaler.scale(model(torch.ones(2, 3)).square().mean(), **kw).backward()
                if value is not None:
                    model.weight.grad.fill_(value)
                self.scaler.step(opt)
            self.scaler.update(new_scale)
        return self


@pytest.mark.parametrize("case", list(_REACHABLE))
def test_every_reachable_state_round_trips_and_continues_identically(case, tmp_path):
    cfg, history = _REACHABLE[case]
    n = len(history[0]) if history and history[0][0] != "new_scale" else 1
    loop = _Loop(DynamicLossScaler("cpu", **cfg, telemetry=False), n).run(history)
    state = loop.scaler.state_dict()
    torch.save({"scaler": state}, tmp_path / "ckpt.pt")  # as a Lightning checkpoint stores it
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)["scaler"]
    assert loaded == state
    flags = {k: cfg[k] for k in ("enabled", "skip_nonfinite", "per_optimizer", "on_min_scale") if k in cfg}
    resumed = _Loop(DynamicLossScaler("cpu", **flags, telemetry=False), n)  # the state carries the rest
    resumed.scaler.load_state_dict(loaded)
    assert resumed.scaler.state_dict() == state
    clone = pickle.loads(pickle.dumps(loop.scaler))
    assert clone.state_dict() == state
    for model, ref in zip(resumed.models, loop.models):
        model.load_state_dict(ref.state_dict())
    for opt, ref in zip(resumed.opts, loop.opts):
        opt.load_state_dict(ref.state_dict())
    after = [(None,) * n, (NAN,) * n, (None,) * n]
    assert resumed.run(after).scaler.state_dict() == loop.run(after).scaler.state_dict()
    if not cfg.get("per_optimizer") and loop.scaler.is_enabled():
        back = torch.amp.GradScaler("cpu")  # GradScaler reads every one of them too
        back.load_state_dict(loop.scaler.state_dict())
        assert back.get_scale() == loop.scaler.get_scale()


@pytest.mark.parametrize("optimizer", ["sgd", "adam-fused"])
@pytest.mark.parametrize("schedule", ["exponential", "log2"])
def test_below_2_to_the_minus_128_every_step_is_skipped_and_weights_kept(schedule, optimizer):
    """The documented end of a diverged run without min_scale: 1/scale is inf in float32, so every step
    counts as an overflow and the weights stay finite (GradScaler steps with the inf/NaN products);
    the scale only backs off, to 0 (log2 keeps counting back-offs)."""
    scaler = DynamicLossScaler("cpu", init_scale=2.0**-127, schedule=schedule, telemetry=False)
    loop = _Loop(scaler, 1)
    loop.opts = [_OPTIMIZERS[optimizer](loop.models[0].parameters())]
    weights = copy.deepcopy(loop.models[0].state_dict())
    loop.run([(NAN,)] + [(None,)] * 24)  # 2**-127 -> 2**-128 -> ... -> 0 (from 2**-150)
    assert scaler.get_scale() == 0.0 and scaler.skipped_steps == 25 == scaler.consecutive_overflows
    for name, value in loop.models[0].state_dict().items():
        assert torch.equal(value, weights[name]), name
    state = scaler.state_dict()
    assert state["log2_scale"] == (-math.inf if schedule == "exponential" else -152.0)

def test_grad_scaler_state_at_scale_0_loads():
    ref = _Loop(torch.amp.GradScaler("cpu", init_scale=2.0**-149), 1).run([(NAN,)])
    ours = DynamicLossScaler("cpu", telemetry=False)
    ours.load_state_dict(ref.scaler.state_dict())
    assert ours.state_dict()["scale"] == 0.0 and ours.state_dict()["log2_scale"] == -math.inf
    assert _Loop(ours, 1).run([(None,)]).scaler.get_scale() == 0.0


@pytest.mark.parametrize("schedule", ["exponential", "log2"])
def test_growth_stops_at_the_largest_float32_scale(schedule):
    scales, _, _ = _run_schedule([0, 0, 0], _F32_MAX / 2, schedule, growth_interval=1, increment=0.75)
    assert scales[-2:] == [_F32_MAX, _F32_MAX]

def test_load_state_dict_refuses_inconsistent_overflow_counters_and_loads_nothing():
    scaler = DynamicLossScaler("cpu", init_scale=8.0, telemetry=False)
    _train(scaler, _sgd, poison_steps={1}, steps=3)
    state = scaler.state_dict()
    bad = dict(
        state, scale=1024.0, _growth_tracker=5, steps=9, consecutive_overflows=2, last_step_skipped=False
    )
    with pytest.raises(ValueError, match="consecutive_overflows=2 with last_step_skipped=False"):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == state  # nothing half-loaded
    missing = {k: v for k, v in state.items() if k != "steps"}
    with pytest.raises(ValueError, match=r"`state_dict` misses the keys \['steps'\]"):
        scaler.load_state_dict(missing)
    assert scaler.state_dict() == state


_OWNER = "DynamicLossScaler.load_state_dict: "
_CONSTRUCTOR_ARGUMENTS = inspect.signature(DynamicLossScaler).parameters
_BAD_ENTRIES = {  # entry -> (error, message after the owner); each comes with scale 1024 (was 8)
    "steps": ("abc", TypeError, "`steps` must be an int >= 0, got 'abc' (str)"),
    "log2_scale": (None, TypeError, "`log2_scale` must be a finite number, got None"),
    "_growth_tracker": (-1, ValueError, "`_growth_tracker` must be an int >= 0, got -1"),
    "scale": (-1.0, ValueError, "`scale` must be a finite number >= 0.0, got -1.0"),
    "growth_factor": (1.0, ValueError, "`growth_factor` must be a finite number > 1.0, got 1.0"),
    "backoff_factor": (NAN, TypeError, "`backoff_factor` must be a finite number in (0.0, 1.0), got nan"),
    "growth_interval": (0, ValueError, "`growth_interval` must be an int >= 1, got 0"),
    "schedule": ("bogus", ValueError, "`schedule` must be one of ('exponential', 'log2'), got 'bogus'"),
    "hysteresis": (-1, ValueError, "`hysteresis` must be an int in [1, 2147483647], got -1"),
    "log2_increment": (INF, TypeError, "`log2_increment` must be a finite number > 0.0, got inf (float)"),
    "consecutive_hysteresis": (1, TypeError, "`consecutive_hysteresis` must be a bool, got 1 (int)"),
    "min_scale": (2048.0, ValueError, "need min_scale <= scale <= max_scale, got min_scale=2048.0, "),
    "skipped_steps": (-2, ValueError, "`skipped_steps` must be an int >= 0, got -2"),
    "_hysteresis_tracker": (2, ValueError, "`_hysteresis_tracker` must be an int <= 1, got 2"),
    "last_step_skipped": ("no", TypeError, "`last_step_skipped` must be a bool, got 'no' (str)"),
}


@pytest.mark.parametrize("key", list(_BAD_ENTRIES))
def test_load_state_dict_checks_every_entry_as_the_constructor_before_loading_any(key):
    scaler = DynamicLossScaler("cpu", init_scale=8.0, max_scale=4096.0, telemetry=False)
    _train(scaler, _sgd, poison_steps={1}, steps=3)
    state = scaler.state_dict()
    value, error, message = _BAD_ENTRIES[key]
    with pytest.raises(error, match="^" + re.escape(_OWNER + message)):
        scaler.load_state_dict({**state, "scale": 1024.0, key: value})
    assert scaler.state_dict() == state  # nothing changed
    if key in _CONSTRUCTOR_ARGUMENTS:  # the constructor's message, word for word
        message = message.replace("<= scale <=", "<= init_scale <=")  # the argument's name
        with pytest.raises(error, match="^" + re.escape("DynamicLossScaler: " + message)):
            DynamicLossScaler("cpu", **{"init_scale": 1024.0, "max_scale": 4096.0, key: value})
    changed = {k: v for k, v in {**state, "scale": 1024.0, "steps": 9}.items() if k != key}
    with pytest.raises(ValueError, match=re.escape(f"{_OWNER}`state_dict` misses the keys ['{key}']")):
        scaler.load_state_dict(changed)
    assert scaler.state_dict() == state


def test_load_state_dict_refuses_a_grad_scaler_state_it_could_not_construct():
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    ours = DynamicLossScaler("cpu", init_scale=4.0, min_scale=1.0, max_scale=64.0, telemetry=False)
    before = ours.state_dict()
    with pytest.raises(ValueError, match=r"need min_scale <= scale <= max_scale, .* scale=256\.0, max_sc"):
        ours.load_state_dict(ref.state_dict())
    assert ours.state_dict() == before
    bad = {**ref.state_dict(), "growth_interval": "3"}
    with pytest.raises(TypeError, match=r"load_state_dict: `growth_interval` must be an int >= 1, got '3'"):
        DynamicLossScaler("cpu", telemetry=False).load_state_dict(bad)


def test_per_optimizer_load_state_dict_checks_every_scale_before_loading_any():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, telemetry=False)
    gan.step(scaler, 0)
    state = scaler.state_dict()
    bad = copy.deepcopy(state)
    bad["per_optimizer"]["D"]["scale"] = 1.0
    bad["per_optimizer"]["G"]["steps"] = "1"
    match = r"^PerOptimizerLossScaler\.load_state_dict \(the scale 'G'\): `steps` must be an int >= 0"
    with pytest.raises(TypeError, match=match):
        scaler.load_state_dict(bad)
    fresh = _per_optimizer_scaler(_Gan(), telemetry=False)
    with pytest.raises(TypeError, match=match):
        fresh.load_state_dict(bad)
    assert scaler.state_dict() == state and fresh.state_dict() == {"per_optimizer": {}}
    with pytest.raises(TypeError, match=r"`state_dict\['per_optimizer'\]` must map names to state dicts"):
        scaler.load_state_dict({"per_optimizer": {"D": 1.0}})


# ------------------------------------------------------------------------------------------------
# Pickling
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        dict(init_scale=2.0**6, hysteresis=2),
        dict(init_scale=2.0**6, schedule="log2", log2_increment=0.125),
        dict(enabled=False, skip_nonfinite=True),
    ],
    ids=["exponential", "log2", "skip-only"],
)
def test_pickled_copy_is_independent_and_keeps_state(cfg):
    fresh = pickle.loads(pickle.dumps(DynamicLossScaler("cpu", **cfg, telemetry=False)))
    assert fresh.state_dict() == DynamicLossScaler("cpu", **cfg, telemetry=False).state_dict()
    scaler = DynamicLossScaler("cpu", **cfg, telemetry=False)
    _train(scaler, _sgd, poison_steps={0, 1}, steps=3)
    clone = pickle.loads(pickle.dumps(scaler))  # after use
    assert clone.state_dict() == scaler.state_dict()
    _, _, s1 = _train(clone, _sgd, poison_steps={0}, steps=2)
    assert scaler.steps == 3 and clone.steps == 5
    _, _, s2 = _train(scaler, _sgd, poison_steps={0}, steps=2)
    assert s1 == s2 and clone.state_dict() == scaler.state_dict()


def test_pickling_mid_iteration_is_refused_as_grad_scaler():
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())
    scaler = DynamicLossScaler("cpu", telemetry=False)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    with pytest.raises(AssertionError, match="may only be pickled at the beginning of an iteration"):
        pickle.dumps(scaler)


# ------------------------------------------------------------------------------------------------
# Telemetry
# ------------------------------------------------------------------------------------------------


def _per_step_telemetry(names, run_step, steps):
    """Each step's reported value per name (a collector updated after every step)."""
    collector = Collector(regex="AMP/.*", keep_previous=False)
    collector.update()  # drop what earlier code reported
    values = {name: [] for name in names}
    for step in range(steps):
        run_step(step)
        collector.update()
        for name in names:
            assert collector.num(name) == 1, (name, step)
            values[name].append(collector.mean(name))
    return values, collector


def test_telemetry_reports_scale_overflow_and_skipped_steps_per_step():
    scaler = DynamicLossScaler("cpu", init_scale=2.0**4, growth_interval=2)
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())

    def run_step(step):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step in (1, 3):
            model[0].weight.grad[0, 0] = INF
        scaler.step(opt)
        scaler.update()

    names = ("AMP/loss_scale_log2", "AMP/overflow", "AMP/skipped_steps")
    values, collector = _per_step_telemetry(names, run_step, 6)
    assert values["AMP/loss_scale_log2"] == [4, 3, 3, 2, 2, 3]
    assert values["AMP/overflow"] == [0, 1, 0, 1, 0, 0]
    assert values["AMP/skipped_steps"] == [0, 1, 1, 2, 2, 2]
    assert collector.names() == sorted(names)


def _nan_at_step_1(scaler):
    model, x, y = _model_and_data()
    opt = _sgd(model.parameters())

    def run_step(step):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = NAN
        scaler.step(opt)
        scaler.update()

    return run_step


@pytest.mark.parametrize(
    ("cfg", "expected_log2"),
    [
        (dict(init_scale=8.0, schedule="log2", log2_increment=0.25), [3.25, 2.25, 2.5]),
        (dict(enabled=False, skip_nonfinite=True), [0.0, 0.0, 0.0]),  # scale 1
    ],
    ids=["log2", "skip-only"],
)
def test_telemetry_of_log2_schedule_and_skip_only_mode(cfg, expected_log2):
    run_step = _nan_at_step_1(DynamicLossScaler("cpu", **cfg))
    values, _ = _per_step_telemetry(("AMP/loss_scale_log2", "AMP/overflow", "AMP/skipped_steps"), run_step, 3)
    assert values["AMP/loss_scale_log2"] == expected_log2
    assert values["AMP/overflow"] == [0, 1, 0] and values["AMP/skipped_steps"] == [0, 1, 1]


def test_telemetry_off_reports_nothing():
    collector = Collector(regex="AMP/.*")
    collector.update()
    run_step = _nan_at_step_1(DynamicLossScaler("cpu", init_scale=8.0, telemetry=False))
    for step in range(3):
        run_step(step)
    collector.update()
    assert collector.names() == []


# ------------------------------------------------------------------------------------------------
# Sharded gradients: process_group agreement
# ------------------------------------------------------------------------------------------------


def _sharded_worker(rank, world_size):
    torch.manual_seed(rank)
    shard = torch.nn.Linear(4, 4)  # each rank owns a different shard of the "model"
    results = {}
    for use_group in (True, False):
        opt = torch.optim.SGD(shard.parameters(), lr=0.1)
        scaler = DynamicLossScaler(
            "cpu", init_scale=8.0, process_group=dist.group.WORLD if use_group else None, telemetry=False
        )
        scaler.scale(shard(torch.ones(2, 4)).sum()).backward()
        if rank == 1:
            shard.weight.grad[0, 0] = INF
        before = shard.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        results[use_group] = (scaler.last_step_skipped, torch.equal(before, shard.weight), scaler.get_scale())
        shard.zero_grad()
    return results


@pytest.mark.smoke
@pytest.mark.timeout(180)
def test_process_group_makes_every_rank_skip_when_one_shard_overflows():
    results = run_distributed(_sharded_worker, 2, timeout=120)
    for rank in range(2):
        assert results[rank][True] == (True, True, 4.0)
    # Without the group each rank decides alone: proof the agreement came from the all_reduce.
    assert results[0][False] == (False, False, 8.0)
    assert results[1][False] == (True, True, 4.0)


def _fully_sharded_worker(rank, world_size):
    """FSDP2 (``fully_shard``): DTensor gradients, an inf in rank 1's shard; per configuration, whether
    this rank skipped and kept its weights."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    for name, scaler, fused in (
        ("skip-only", dict(enabled=False, skip_nonfinite=True), False),
        ("fp16 scale", dict(init_scale=8.0), False),
        ("fused Adam", dict(init_scale=8.0), True),
    ):
        torch.manual_seed(0)
        model = fully_shard(torch.nn.Linear(8, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if fused else torch.optim.SGD(
            model.parameters(), lr=0.1)  # fmt: skip
        scaler = DynamicLossScaler("cpu", **scaler, telemetry=False)
        scaler.scale(model(torch.ones(2, 8)).square().sum()).backward()
        if rank == 1:
            model.weight.grad.to_local().view(-1)[0] = INF
        before = model.weight.to_local().clone()
        scaler.step(opt)
        scaler.update()
        results[name] = (scaler.last_step_skipped, torch.equal(before, model.weight.to_local()))
    return results


@pytest.mark.timeout(180)
def test_dtensor_gradients_are_checked_on_every_shard_and_every_rank_skips():
    # The compiled finite check read a DTensor's memory: the process died (SIGSEGV) and the others hung.
    pytest.importorskip("torch.distributed.fsdp", minversion=None)
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    # (FSDP2 keeps its device mesh, and the process group in it, referenced: torch's, not ours)
    results = run_distributed(_fully_sharded_worker, 2, timeout=120, groups_outlive=True)
    for rank in range(2):
        assert results[rank] == dict.fromkeys(("skip-only", "fp16 scale", "fused Adam"), (True, True)), rank


# ------------------------------------------------------------------------------------------------
# per_optimizer=True: one scale per optimizer (StyleGAN2-ADA)
# ------------------------------------------------------------------------------------------------


class _Gan:
    """A tiny GAN-like setup: G maps noise to samples, D scores them; each has its own optimizer."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.D = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.opt_G = torch.optim.Adam(self.G.parameters(), lr=1e-3)
        self.opt_D = torch.optim.Adam(self.D.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g) + 1) for _ in range(16)]

    def step(self, scaler, step, poison_D=(), per_step_update=True):
        """One D step (inf written into D's gradient on ``poison_D`` steps), then one G step. Returns
        whether D's and G's parameters changed."""
        z, real = self.data[step % len(self.data)]
        d_before = [p.detach().clone() for p in self.D.parameters()]
        g_before = [p.detach().clone() for p in self.G.parameters()]
        self.opt_D.zero_grad()
        loss_D = torch.nn.functional.softplus(self.D(self.G(z).detach())).mean()
        loss_D = loss_D + torch.nn.functional.softplus(-self.D(real)).mean()
        scaler.scale(loss_D, optimizer=self.opt_D).backward()
        if step in poison_D:
            self.D[0].weight.grad[0, 0] = INF
        scaler.step(self.opt_D)
        if per_step_update:
            scaler.update(optimizer=self.opt_D)
        self.opt_G.zero_grad()
        loss_G = torch.nn.functional.softplus(-self.D(self.G(z))).mean()
        scaler.scale(loss_G, optimizer=self.opt_G).backward()
        scaler.step(self.opt_G)
        if per_step_update:
            scaler.update(optimizer=self.opt_G)
        else:
            scaler.update()
        d_moved = not all(torch.equal(p, q) for p, q in zip(self.D.parameters(), d_before))
        g_moved = not all(torch.equal(p, q) for p, q in zip(self.G.parameters(), g_before))
        return d_moved, g_moved


def _per_optimizer_scaler(gan, register=True, **kw):
    scaler = DynamicLossScaler(
        "cpu", **{"init_scale": 2.0**10, "growth_interval": 100, **kw}, per_optimizer=True
    )
    if register:
        scaler.register_optimizer(gan.opt_G, "G")
        scaler.register_optimizer(gan.opt_D, "D")
    return scaler


@pytest.mark.parametrize("per_step_update", [True, False], ids=["update-per-optimizer", "update-all"])
def test_per_optimizer_gan_skips_and_backs_off_only_d(per_step_update):
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, telemetry=False)
    poison_D = {1, 2, 5}
    for step in range(8):
        d_moved, g_moved = gan.step(scaler, step, poison_D, per_step_update)
        assert d_moved == (step not in poison_D) and g_moved, step
        assert scaler.optimizer_scaler(gan.opt_D).last_step_skipped == (step in poison_D)
    scaler_D, scaler_G = scaler.optimizer_scaler(gan.opt_D), scaler.optimizer_scaler(gan.opt_G)
    assert scaler_D.get_scale() == 2.0 ** (10 - len(poison_D))  # backed off exactly 3 times
    assert scaler_G.get_scale() == 2.0**10
    assert (scaler_D.steps, scaler_D.skipped_steps) == (8, len(poison_D))
    assert (scaler_G.steps, scaler_G.skipped_steps) == (8, 0)
    assert scaler.steps == 16 and scaler.skipped_steps == len(poison_D)
    assert all(torch.isfinite(p).all() for p in [*gan.G.parameters(), *gan.D.parameters()])


def test_per_optimizer_scales_follow_their_own_schedules_when_both_grow():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, growth_interval=2, telemetry=False)
    scales = []
    for step in range(6):
        gan.step(scaler, step, poison_D={2})
        scales.append(
            (scaler.optimizer_scaler(gan.opt_D).get_scale(), scaler.optimizer_scaler(gan.opt_G).get_scale())
        )
    k = 2.0**10
    assert scales == [(k, k), (2 * k, 2 * k), (k, 2 * k), (k, 4 * k), (2 * k, 4 * k), (2 * k, 8 * k)]


def test_per_optimizer_telemetry_names_and_values():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan)
    names = [f"AMP/{n}/{k}" for n in ("D", "G") for k in ("loss_scale_log2", "overflow", "skipped_steps")]
    values, collector = _per_step_telemetry(names, lambda step: gan.step(scaler, step, poison_D={1, 2}), 4)
    assert collector.names() == sorted(names)  # no shared AMP/loss_scale_log2
    assert values["AMP/D/overflow"] == [0, 1, 1, 0] and values["AMP/G/overflow"] == [0, 0, 0, 0]
    assert values["AMP/D/loss_scale_log2"] == [10, 9, 8, 8] and values["AMP/G/loss_scale_log2"] == [10] * 4
    assert values["AMP/D/skipped_steps"] == [0, 1, 2, 2] and values["AMP/G/skipped_steps"] == [0] * 4


def test_register_optimizer_names_and_errors():
    gan = _Gan()
    auto = _per_optimizer_scaler(gan, register=False, telemetry=False)
    gan.step(auto, 0)
    assert sorted(auto.state_dict()["per_optimizer"]) == ["0", "1"]  # in order of first use: D, G
    assert auto.optimizer_scaler(gan.opt_D)._name == "0"
    named = _per_optimizer_scaler(gan, telemetry=False)
    named.register_optimizer(gan.opt_G, "G")  # the same name again: fine
    gan.step(named, 0)
    assert sorted(named.state_dict()["per_optimizer"]) == ["D", "G"]
    with pytest.raises(ValueError, match="`name` 'G' already names another optimizer's scale"):
        named.register_optimizer(gan.opt_D, "G")
    with pytest.raises(TypeError, match="`name` must be a non-empty str, got ''"):
        named.register_optimizer(gan.opt_D, "")
    with pytest.raises(TypeError, match=r"`optimizer` must be a torch\.optim\.Optimizer, got str"):
        named.register_optimizer("D", "D")
    shared = DynamicLossScaler("cpu", telemetry=False)
    with pytest.raises(
        ValueError, match=r"register_optimizer\(\) needs DynamicLossScaler\(per_optimizer=True\)"
    ):
        shared.register_optimizer(gan.opt_D, "D")
    with pytest.raises(
        ValueError, match=r"optimizer_scaler\(\) needs DynamicLossScaler\(per_optimizer=True\)"
    ):
        shared.optimizer_scaler(gan.opt_D)



def test_per_optimizer_true_makes_a_per_optimizer_loss_scaler_with_the_same_api():
    scaler = DynamicLossScaler("cpu", init_scale=2.0**4, per_optimizer=True, telemetry=False)
    assert type(scaler) is PerOptimizerLossScaler and isinstance(scaler, DynamicLossScaler)
    assert scaler.per_optimizer and scaler.get_scale() == 2.0**4
    assert type(pickle.loads(pickle.dumps(scaler))) is PerOptimizerLossScaler
    assert type(copy.deepcopy(scaler)) is PerOptimizerLossScaler
    assert type(PerOptimizerLossScaler("cpu")) is PerOptimizerLossScaler
    with pytest.raises(ValueError, match=r"PerOptimizerLossScaler takes per_optimizer=True, got False"):
        PerOptimizerLossScaler("cpu", per_optimizer=False)

    class Shared(DynamicLossScaler):  # a subclass of the shared scaler stays one
        pass

    with pytest.raises(ValueError, match=r"Shared takes per_optimizer=False, got True. HINT"):
        Shared("cpu", per_optimizer=True)
    assert type(DynamicLossScaler("cpu", telemetry=False)) is DynamicLossScaler
    # The signature stays __init__'s (inspect, jsonargparse and so LightningCLI read it).
    assert list(inspect.signature(DynamicLossScaler).parameters)[:6] == list(
        inspect.signature(torch.amp.GradScaler).parameters
    )

@pytest.mark.parametrize(
    "kwargs",
    [dict(device=torch.device("cpu")), dict(device="cpu:0"), dict(device="cpu", enabled=1),
     dict(device="cpu", enabled=0), dict(device="cpu", enabled=np.bool_(True)),
     dict(device="cpu", init_scale=np.float32(1024.0), growth_factor=np.float64(4.0),
          backoff_factor=np.float32(0.25), growth_interval=np.int64(3))],
)  # fmt: skip
def test_what_grad_scaler_takes_builds_the_same_scaler(kwargs):
    # GradScaler(device=torch.device(...)), an argparse 0/1 flag, numbers read with NumPy: code
    # written for GradScaler runs unchanged (each raised TypeError); the state holds Python numbers.
    ours, theirs = DynamicLossScaler(**kwargs, telemetry=False), torch.amp.GradScaler(**kwargs)
    assert ours.is_enabled() == bool(theirs.is_enabled())
    steps = [(None,), (INF,), (None,), (None,), (None,)]
    _Loop(ours, 1).run(steps), _Loop(theirs, 1).run(steps)
    assert ours.get_scale() == theirs.get_scale()
    assert ours.state_dict().get("scale") == theirs.state_dict().get("scale")
    state = ours.state_dict()
    assert all(type(v) in (int, float, bool, str, type(None)) for v in state.values()), state
    torch.save(state, buffer := io.BytesIO())
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_per_optimizer_scale_needs_the_optimizer():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan)
    with pytest.raises(
        ValueError, match=r"scale\(outputs, optimizer=\.\.\.\) needs the optimizer that will step"
    ):
        scaler.scale(torch.ones(()))


def test_per_optimizer_update_for_one_optimizer_moves_only_its_scale():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, growth_interval=1, telemetry=False)
    gan.step(scaler, 0, per_step_update=False)  # both grow once: 2**11 each
    _, real = gan.data[0]
    for opt, net in ((gan.opt_D, gan.D), (gan.opt_G, gan.G)):
        opt.zero_grad()
        scaler.scale(net(real).square().mean(), optimizer=opt).backward()
        scaler.step(opt)
    scaler.update(optimizer=gan.opt_D)
    scaler_D, scaler_G = scaler.optimizer_scaler(gan.opt_D), scaler.optimizer_scaler(gan.opt_G)
    assert scaler_D.get_scale() == 2.0**12 and scaler_G.get_scale() == 2.0**11
    assert scaler_D.steps == 2 and scaler_G.steps == 1
    scaler.update(optimizer=gan.opt_G)
    assert scaler_G.get_scale() == 2.0**12 and scaler_G.steps == 2


def test_per_optimizer_state_dict_round_trip_restores_scales_at_first_use():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, growth_interval=3, telemetry=False)
    for step in range(5):
        gan.step(scaler, step, poison_D={1, 2})
    state = scaler.state_dict()
    assert state["per_optimizer"]["D"]["scale"] == 2.0**8 and state["per_optimizer"]["G"]["scale"] == 2.0**11
    assert state["per_optimizer"]["D"]["skipped_steps"] == 2 and state["per_optimizer"]["G"]["steps"] == 5

    resumed_gan = copy.deepcopy(gan)
    fresh = _per_optimizer_scaler(resumed_gan, telemetry=False)  # other settings: the states carry them
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.state_dict() == state  # pending until each optimizer's first use
    assert fresh.optimizer_scaler(resumed_gan.opt_D).get_scale() == 2.0**8  # restored at first use
    assert fresh.optimizer_scaler(resumed_gan.opt_G).get_scale() == 2.0**11
    assert fresh.state_dict() == state
    for step in range(5, 10):  # both continue identically, overflows included
        assert gan.step(scaler, step, poison_D={6}) == resumed_gan.step(fresh, step, poison_D={6})
    assert fresh.state_dict() == scaler.state_dict()
    for p, q in zip(gan.D.parameters(), resumed_gan.D.parameters()):
        assert torch.equal(p, q)

    # Loaded into a scaler already in use: applied to the existing per-optimizer scales at once.
    used_gan = _Gan()
    used = _per_optimizer_scaler(used_gan, telemetry=False)
    used_gan.step(used, 0)
    used.load_state_dict(state)
    assert used.state_dict() == state

    with pytest.raises(ValueError, match=r"`state_dict` lacks per-optimizer scales .* per_optimizer=True"):
        fresh.load_state_dict(DynamicLossScaler("cpu").state_dict())
    with pytest.raises(ValueError, match=r"`state_dict` has per-optimizer scales .* per_optimizer=False"):
        DynamicLossScaler("cpu").load_state_dict(state)


def test_per_optimizer_pickle_after_use():
    gan = _Gan()
    scaler = _per_optimizer_scaler(gan, register=False, telemetry=False)
    for step in range(3):
        gan.step(scaler, step, poison_D={1})
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    clone_gan = copy.deepcopy(gan)
    # Auto names map back by order of first use (D, then G).
    for step in range(3, 6):
        assert gan.step(scaler, step, poison_D={4}) == clone_gan.step(clone, step, poison_D={4})
    assert clone.state_dict() == scaler.state_dict()
    # Registered names: optimizer ids mean nothing after unpickling, so the names are registered again.
    named = _per_optimizer_scaler(gan, telemetry=False)
    gan.step(named, 0, poison_D={0})
    clone = pickle.loads(pickle.dumps(named))
    clone_gan = copy.deepcopy(gan)
    clone.register_optimizer(clone_gan.opt_G, "G")
    clone.register_optimizer(clone_gan.opt_D, "D")
    assert gan.step(named, 1) == clone_gan.step(clone, 1)
    assert sorted(clone.state_dict()["per_optimizer"]) == ["D", "G"]
    assert clone.state_dict() == named.state_dict()


# ------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_lives_on_the_device_and_matches_grad_scaler():
    poison = {1, 2}
    cfg = dict(init_scale=2.0**4, growth_interval=2)

    def train(scaler):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        x = torch.randn(8, 6, device="cuda")
        for step in range(5):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            if step in poison:
                model.weight.grad[0, 0] = NAN
            scaler.step(opt)
            scaler.update()
        return model, scaler

    ref_model, ref = train(torch.amp.GradScaler("cuda", **cfg))
    model, ours = train(DynamicLossScaler("cuda", **cfg, telemetry=False))
    assert ours.scale_tensor.device.type == "cuda" and ours.last_step_skipped_tensor.device.type == "cuda"
    assert ours.get_scale() == ref.get_scale() and ours.skipped_steps == 2
    assert torch.equal(model.weight, ref_model.weight)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(schedule="exponential", growth_interval=2),
        dict(schedule="exponential", growth_interval=2, hysteresis=2, min_scale=4.0, on_min_scale="clamp"),
        dict(schedule="log2", log2_decrement=1.5, hysteresis=2, min_scale=2.0**6, on_min_scale="warn"),
    ],
    ids=["exponential", "hysteresis", "log2"],
)
def test_cuda_schedule_and_counters_match_the_cpu_state(cfg, fused):
    """The same update on CUDA and on CPU state gives the same scale, trackers and counters for one
    overflow pattern, with the skip decision on the host (non-fused) or on the device (fused)."""
    poison = {1, 2, 3, 6, 7, 8, 9}

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, **({"fused": True} if fused else {}))
        scaler = DynamicLossScaler(device, init_scale=2.0**8, telemetry=False, **cfg)
        x = torch.randn(8, 6, device=device)
        for step in range(12):
            opt.zero_grad()
            scaler.scale(model(x).square().mean()).backward()
            if step in poison:
                model.weight.grad[0, 0] = INF
            scaler.step(opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                scaler.update()
        return scaler

    cuda, cpu = run("cuda"), run("cpu")
    assert cuda.scale_tensor.device.type == "cuda"
    assert cuda.state_dict() == cpu.state_dict()
    assert cuda.skipped_steps == len(poison) and cuda.last_step_skipped == cpu.last_step_skipped


def test_per_optimizer_scales_follow_the_setters_and_say_their_own_scale():
    # set_growth_factor & co. reached the parent only (whose scale no optimizer uses); get_scale()
    # could only give that one.
    scaler = DynamicLossScaler("cpu", init_scale=8.0, growth_interval=1, per_optimizer=True, telemetry=False)
    loop = _Loop(scaler, 1).run([(None,)])
    opt = loop.opts[0]
    assert scaler.get_scale(opt) == 16.0 and scaler.get_scale() == 8.0  # the one each scale starts from
    scaler.set_growth_factor(4.0), scaler.set_backoff_factor(0.25), scaler.set_growth_interval(1)
    loop.run([(None,)])
    assert scaler.get_scale(opt) == 64.0
    loop.run([(NAN,)])
    assert scaler.get_scale(opt) == 16.0


def test_a_resume_says_which_settings_the_checkpoint_replaced_and_which_scales_it_lacks():
    saved = _Loop(DynamicLossScaler("cpu", telemetry=False), 1).run([(None,)]).scaler.state_dict()
    tighter = DynamicLossScaler("cpu", init_scale=2.0**12, max_scale=2.0**12, hysteresis=4, telemetry=False)
    with pytest.warns(UserWarning, match=r"the checkpoint's settings replace those given to the constructor: "
                      r"hysteresis=1 \(given 4\), max_scale=None \(given 4096\.0\)"):  # fmt: skip
        tighter.load_state_dict(saved)
    named = _Loop(DynamicLossScaler("cpu", per_optimizer=True, telemetry=False), 1)  # "opt0"
    state = named.run([(None,)]).scaler.state_dict()
    renamed = DynamicLossScaler("cpu", per_optimizer=True, telemetry=False)
    renamed.load_state_dict(state)
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    renamed.register_optimizer(optimizer, "G")
    with pytest.warns(UserWarning, match=r"holds no scale named 'G' \(it holds \['opt0'\]\)"):
        renamed.optimizer_scaler(optimizer)


@pytest.mark.parametrize("used_before_load", [False, True])
def test_per_optimizer_settings_set_after_a_resume_hold_for_every_optimizer(used_before_load):
    # The settings set on the scaler after load_state_dict (as its warning's HINT says) were reverted by
    # the checkpoint's when an optimizer's scale was first used (its state loaded then), and a setting
    # set on the scaler reached no optimizer's scale already made; the warning came at that first use.
    saved = _Loop(DynamicLossScaler("cpu", per_optimizer=True, telemetry=False), 2).run([(None, None)])
    state = saved.scaler.state_dict()  # max_scale=None, hysteresis=1
    resumed = _Loop(DynamicLossScaler("cpu", init_scale=4.0, max_scale=8.0, per_optimizer=True,
                                      telemetry=False), 2)  # fmt: skip
    if used_before_load:
        resumed.run([(None, None)])
    with pytest.warns(UserWarning, match=r"constructor: max_scale=None \(given 8\.0\)"):
        resumed.scaler.load_state_dict(state)
    assert resumed.scaler.max_scale is None  # the checkpoint's, as a shared scale's
    resumed.scaler.max_scale, resumed.scaler.hysteresis = 2.0**15, 3  # below the loaded scale, 2**16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, at the load
        resumed.run([(None, None)] * 3)
    for opt in resumed.opts:
        child = resumed.scaler.optimizer_scaler(opt)
        assert (child.max_scale, child.hysteresis, child.get_scale()) == (2.0**15, 3, 2.0**15)
    assert resumed.scaler.state_dict()["per_optimizer"]["opt1"]["max_scale"] == 2.0**15


def _scaled_step(scaler, model, optimizer, bad: bool) -> None:
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    if bad:
        model.weight.grad.fill_(float("inf"))
    scaler.step(optimizer)
    scaler.update()


def test_a_scale_set_by_hand_after_a_skipped_step_saves_a_state_that_loads():
    # update(new_scale) without a step since the last update wrote found_inf=0 over the skipped step's
    # flag, so the state said "a run of 1 overflow, last step not skipped": load_state_dict refused the
    # checkpoint the scaler had written (GradScaler's own loads).
    model = torch.nn.Linear(3, 1)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, telemetry=False)
    _scaled_step(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), bad=True)
    scaler.update(512.0)
    state = scaler.state_dict()
    assert (state["scale"], state["last_step_skipped"], state["consecutive_overflows"]) == (512.0, True, 1)
    resumed = DynamicLossScaler("cpu", telemetry=False)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state


@pytest.mark.parametrize("schedule", ["exponential", "log2"])
def test_hysteresis_lowered_during_a_run_holds_at_once_and_its_state_loads(schedule):
    # The tracker kept the old tolerance (3) after hysteresis was lowered to 1 (as the load's HINT
    # says to change it): the log2 schedule tolerated the next overflows instead of backing off, and
    # every later checkpoint (tracker 3 > hysteresis 1) was refused by load_state_dict.
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, hysteresis=3, schedule=schedule, telemetry=False)
    _scaled_step(scaler, model, optimizer, bad=False)
    scaler.hysteresis = 1
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 1
    DynamicLossScaler("cpu", schedule=schedule, telemetry=False).load_state_dict(state)
    before = scaler.get_scale()
    _scaled_step(scaler, model, optimizer, bad=True)
    assert scaler.get_scale() < before  # backed off at the first overflow
    DynamicLossScaler("cpu", schedule=schedule, telemetry=False).load_state_dict(scaler.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"init_scale": 1e-50}, "init_scale"), ({"min_scale": 1e-50}, "min_scale"),
     ({"max_scale": 1e39}, "max_scale"), ({"init_scale": 1e39}, "init_scale"),
     ({"init_scale": 10**400}, "init_scale")],
)  # fmt: skip
def test_a_scale_float32_cannot_hold_is_refused_at_construction(kwargs, name):
    # 1e-50 became a float32 scale of 0: every step skipped, without a word; 1e39 failed at the first
    # scale() or update() ("value cannot be converted to type float without overflow"), naming nothing;
    # an int beyond float64 raised OverflowError from the check itself.
    with pytest.raises((ValueError, TypeError), match=rf"`{name}` must be a finite number"):
        DynamicLossScaler("cpu", **kwargs)


@pytest.mark.parametrize("per_optimizer", [False, True])
@pytest.mark.parametrize(
    ("setter", "bad", "error"),
    [("set_growth_factor", 1.0, ValueError), ("set_growth_factor", 0.5, ValueError),
     ("set_backoff_factor", 1.0, ValueError), ("set_backoff_factor", 2.0, ValueError),
     ("set_growth_interval", 0, ValueError), ("set_growth_interval", 2.5, TypeError)],
)  # fmt: skip
def test_setters_refuse_what_the_scaler_would_refuse_to_load(setter, bad, error, per_optimizer):
    # GradScaler's setters take anything: a run then saved a checkpoint its own scaler refused at resume
    scaler = DynamicLossScaler("cpu", per_optimizer=per_optimizer)
    before = scaler.state_dict()
    with pytest.raises(error, match=rf"^{type(scaler).__name__}\.{setter}: `\w+` must be"):
        getattr(scaler, setter)(bad)
    assert scaler.state_dict() == before
    good = {"set_growth_factor": np.float64(3.0), "set_backoff_factor": np.float32(0.25)}
    good = good.get(setter, np.int64(7))
    getattr(scaler, setter)(good)  # a NumPy number, as GradScaler's setters take it
    DynamicLossScaler("cpu", per_optimizer=per_optimizer).load_state_dict(scaler.state_dict())


def test_update_with_new_scale_before_first_use_raises_grad_scalers_assertion():
    with pytest.raises(AssertionError) as theirs:
        torch.amp.GradScaler("cpu").update(8.0)
    with pytest.raises(AssertionError) as ours:
        DynamicLossScaler("cpu").update(8.0)
    assert str(ours.value).split() == str(theirs.value).split()


def _overflowing_step(scaler, optimizer, module):
    scaler.scale(module(torch.ones(1, 2)).sum(), optimizer=optimizer).backward()
    module.weight.grad.fill_(float("inf"))
    scaler.step(optimizer)
    scaler.update()


def test_per_optimizer_names_default_to_free_ones_and_a_late_name_keeps_the_scale():
    # str(len(names)) as the default could be a name already given: two optimizers shared one scale;
    # a name given after the first use started a fresh scale and orphaned the trained one
    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True, telemetry=False)
    scaler.register_optimizer(opt_d, "1")
    assert scaler.optimizer_scaler(opt_g) is not scaler.optimizer_scaler(opt_d)
    _overflowing_step(scaler, opt_d, d)
    assert (scaler.get_scale(opt_g), scaler.get_scale(opt_d)) == (2.0**10, 2.0**9)
    assert sorted(scaler.state_dict()["per_optimizer"]) == ["0", "1"]
    scaler.register_optimizer(opt_d, "D")  # after its first use: its scale moves along
    assert scaler.get_scale(opt_d) == 2.0**9 and scaler.optimizer_scaler(opt_d).skipped_steps == 1
    assert sorted(scaler.state_dict()["per_optimizer"]) == ["0", "D"]
    scaler.unregister_optimizer(opt_d)  # released: the next optimizer named "D" carries its scale on
    opt_d2 = torch.optim.SGD(d.parameters(), lr=0.1)
    scaler.register_optimizer(opt_d2, "D")
    assert scaler.get_scale(opt_d2) == 2.0**9


@pytest.mark.parametrize("per_optimizer", [False, True])
def test_options_set_as_attributes_are_checked_and_a_switch_to_log2_starts_at_the_scale(per_optimizer):
    # The load warning tells to change settings as attributes: a typo ran the exponential schedule and
    # saved a checkpoint the scaler refused to load; a switch to log2 started from its initial log2
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8, per_optimizer=per_optimizer, telemetry=False)
    for key, bad, error in (("schedule", "Log2", ValueError), ("hysteresis", 0, ValueError),
                            ("min_scale", -5.0, ValueError), ("telemetry", "yes", TypeError)):  # fmt: skip
        with pytest.raises(error, match=rf"^\w+LossScaler\.{key}: `{key}` must be"):
            setattr(scaler, key, bad)
    scaler.hysteresis = np.int64(2)  # a NumPy number: taken, as the constructor takes it
    assert scaler.hysteresis == 2 and type(scaler.hysteresis) is int
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=1, telemetry=False)
    for _ in range(3):
        _overflowing_step(scaler, optimizer, module)
    assert scaler.get_scale() == 2.0**5
    scaler.schedule, scaler.log2_increment = "log2", 0.25
    optimizer.zero_grad()
    scaler.scale(module(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == pytest.approx(2.0**5.25, rel=1e-6)  # (2**8.25 before: the stale log2)
    DynamicLossScaler("cpu").load_state_dict(scaler.state_dict())


def test_per_optimizer_update_without_a_step_raises_grad_scalers_assertion():
    scaler = DynamicLossScaler("cpu", per_optimizer=True, telemetry=False)
    with pytest.raises(AssertionError, match="Attempted update but _scale is None"):
        scaler.update()
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler.scale(module(torch.ones(1, 2)).sum(), optimizer=optimizer).backward()
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()  # (it did nothing, silently)


@pytest.mark.parametrize("schedule", ["exponential", "log2"])
def test_a_compiled_training_step_moves_the_scale_and_counts_as_eager(schedule):
    # Inductor dropped the in-place updates of the scaler's 0-dim float64 device state (torch 2.13):
    # compiled, the counters stayed 0 and the log2 schedule's scale fell to 1.0
    def train(compiled: bool) -> tuple:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=2, schedule=schedule)

        def step(x, factor):
            scaler.scale(net(x).pow(2).mean() * factor).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        run = torch.compile(step) if compiled else step
        for i in range(6):  # step 3 overflows
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            run(x, torch.tensor(math.inf if i == 3 else 1.0))
        return scaler.get_scale(), scaler.steps, scaler.skipped_steps, scaler.state_dict()["log2_scale"]

    torch._dynamo.reset()
    assert train(True) == train(False)
