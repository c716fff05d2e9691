"""LossScalingPrecision in Trainer runs: fault injection, accumulation, manual optimization, resume, DDP."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.amp import DynamicLossScaler
from lightning_ext.plugins import LossScalingPrecision
from lightning_ext.stats import Collector
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import ddp_trainer


def _data(n=96, batch_size=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _sgd_momentum(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class _Regression(LightningModule):
    """Tiny MLP; ``poison`` maps global_step (``batch_idx`` with ``poison_by="batch_idx"``) -> value
    injected into this rank's local gradient of net[0]."""

    def __init__(
        self,
        poison: dict[int, float] | None = None,
        poison_rank: int | None = None,
        lr=0.05,
        optimizer_fn=None,
        poison_by: str = "global_step",
    ):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.poison = poison or {}
        self.poison_rank = poison_rank
        self.poison_by = poison_by
        self.lr = lr
        self.optimizer_fn = optimizer_fn or _sgd_momentum
        self.losses: list[float] = []
        self.output_dtypes: set[torch.dtype] = set()

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[0](x)
        value = self.poison.get(batch_idx if self.poison_by == "batch_idx" else self.global_step)
        if value is not None and (self.poison_rank is None or self.global_rank == self.poison_rank):
            # Poisons this rank's local gradient before DDP reduces it.
            h.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), value))
        out = self.net[2](self.net[1](h))
        self.output_dtypes.add(out.dtype)
        loss = nn.functional.mse_loss(out.float(), y)
        self.losses.append(loss.item())
        return loss

    @override
    def configure_optimizers(self):
        opt = self.optimizer_fn(self.parameters(), self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Recorder(Callback):
    """Per batch: were params / optimizer state / LR left untouched, and the scale after the step."""

    def __init__(self):
        self.rows: list[dict] = []
        self._grad_norm = torch.tensor(math.nan)  # no optimizer step yet (accumulation)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        opt = trainer.optimizers[0]
        self._params = [p.detach().clone() for p in pl_module.parameters()]
        self._state = copy.deepcopy(opt.state_dict()["state"])
        self._lr = opt.param_groups[0]["lr"]

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Unscaled already: the gradient norm is the true one (finite unless poisoned).
        self._grad_norm = torch.linalg.vector_norm(
            torch.cat([p.grad.flatten() for p in pl_module.parameters()])
        )

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        state = opt.state_dict()["state"]
        scaler = trainer.precision_plugin.scaler
        self.rows.append(
            {
                "skipped": scaler.last_step_skipped,
                "params_same": all(torch.equal(p, q) for p, q in zip(pl_module.parameters(), self._params)),
                "state_same": all(
                    torch.equal(state[k][name], value)
                    for k, v in self._state.items()
                    for name, value in v.items()
                )
                and len(state) == len(self._state),
                "lr_before": self._lr,
                "lr_after": opt.param_groups[0]["lr"],
                "scale": scaler.get_scale(),
                "grad_norm": float(self._grad_norm),
            }
        )


def _trainer(plugin, callbacks=(), **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return Trainer(plugins=[plugin], callbacks=list(callbacks), **defaults)


# ------------------------------------------------------------------------------------------------


def test_fault_injection_skips_holds_lr_backs_off_and_converges():
    poison = {0: float("inf"), 7: float("nan"), 8: float("inf"), 15: float("nan")}
    model = _Regression(poison=poison)
    recorder = _Recorder()
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=4)
    plugin = LossScalingPrecision("16-mixed", scaler=scaler)
    collector = Collector(regex="AMP/.*")
    steps = 30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(plugin, [recorder], max_steps=steps).fit(model, _data())
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert model.output_dtypes == {torch.float16}  # real fp16 autocast on CPU

    rows = recorder.rows
    assert len(rows) == steps
    for step, row in enumerate(rows):
        skipped = step in poison
        assert row["skipped"] == skipped, step
        assert row["params_same"] == skipped, step
        assert row["state_same"] == skipped, step
        expected_lr = row["lr_before"] if skipped else row["lr_before"] * 0.97
        assert row["lr_after"] == pytest.approx(expected_lr, rel=1e-12), step
        assert math.isfinite(row["grad_norm"]) != skipped
        if skipped:
            before = rows[step - 1]["scale"] if step else 2.0**10
            assert row["scale"] == before / 2, step
    sched = model.trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == steps - len(poison)
    assert scaler.steps == steps and scaler.skipped_steps == len(poison)
    assert model.trainer.global_step == steps  # skipped steps count toward global_step
    assert sum(model.losses[-6:]) / 6 < 0.3 * sum(model.losses[:6]) / 6

    collector.update()
    assert collector.num("AMP/overflow") == steps
    assert collector.mean("AMP/overflow") == pytest.approx(len(poison) / steps)
    assert collector.max("AMP/skipped_steps") == len(poison)
    assert collector.max("AMP/loss_scale_log2") <= 10 + 2 and collector.min("AMP/loss_scale_log2") >= 8


@pytest.mark.parametrize(
    "optimizer_fn",
    [
        lambda params, lr: torch.optim.Adam(params, lr=lr / 10, fused=True),
        lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True),
    ],
    ids=["adam-fused", "sgd-fused"],
)
def test_fused_optimizers_skip_on_the_device_and_hold_lr(optimizer_fn):
    poison = {1: float("inf"), 2: float("nan"), 5: float("inf")}
    model = _Regression(poison=poison, optimizer_fn=optimizer_fn)
    recorder = _Recorder()
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=100, telemetry=False)
    steps = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(LossScalingPrecision("16-mixed", scaler=scaler), [recorder], max_steps=steps).fit(
            model, _data()
        )
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert model.output_dtypes == {torch.float16}
    for step, row in enumerate(recorder.rows):
        skipped = step in poison
        assert row["skipped"] == row["params_same"] == row["state_same"] == skipped, step
        expected_lr = row["lr_before"] if skipped else row["lr_before"] * 0.97
        assert row["lr_after"] == pytest.approx(expected_lr, rel=1e-12), step
        # Fused optimizers unscale inside their step: on_before_optimizer_step sees scaled gradients.
        assert math.isfinite(row["grad_norm"]) != skipped, step
    assert scaler.steps == steps and scaler.skipped_steps == len(poison)
    assert scaler.get_scale() == 2.0 ** (10 - len(poison))
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == steps - len(poison)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _ScaleAtBatchStart(Callback):
    def __init__(self):
        self.scales: list[float] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def test_gradient_accumulation_changes_scale_only_at_boundary():
    rec = _ScaleAtBatchStart()
    scaler = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=1, telemetry=False)
    _trainer(
        LossScalingPrecision("16-mixed", scaler=scaler), [rec], max_steps=3, accumulate_grad_batches=2
    ).fit(_Regression(), _data())
    assert rec.scales == [4.0, 4.0, 8.0, 8.0, 16.0, 16.0]
    assert scaler.steps == 3 and scaler.get_scale() == 32.0


def test_accumulation_overflow_in_one_micro_batch_skips_that_step_and_counts_one():
    # k=4: the inf in micro-batch 2 of step 3 (batch_idx 9) reaches the accumulated gradient, which
    # is checked once at the boundary: step 3 skipped, one overflow, weights untouched across it.
    recorder = _Recorder()
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8, telemetry=False)
    model = _Regression(poison={9: float("inf")}, poison_by="batch_idx")
    plugin = LossScalingPrecision("16-mixed", scaler=scaler)
    _trainer(plugin, [recorder], max_steps=4, accumulate_grad_batches=4).fit(model, _data(n=256))
    rows = recorder.rows
    assert len(rows) == 16
    assert [i for i, r in enumerate(rows) if not r["params_same"]] == [3, 7, 15]
    assert rows[11]["skipped"] and rows[11]["lr_after"] == rows[11]["lr_before"]
    assert [r["scale"] for r in rows[3::4]] == [2.0**8, 2.0**8, 2.0**7, 2.0**7]
    assert scaler.steps == 4 and scaler.skipped_steps == 1


class _ManualAccumulation(LightningModule):
    """Manual optimization accumulating ``k`` micro-batches per step; inf on micro-batch ``poison``."""

    def __init__(self, k: int, poison: int):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.k, self.poison = k, poison
        self.weights: list[torch.Tensor] = []
        self.skipped: list[bool] = []  # last_step_skipped read right after each step, as the guide says

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y) / self.k)
        if batch_idx == self.poison:
            self.net.weight.grad[0, 0] = float("inf")
        if (batch_idx + 1) % self.k == 0:
            opt.step()
            opt.zero_grad()
            self.weights.append(self.net.weight.detach().clone())
            scaler = self.trainer.precision_plugin.scaler
            scaler = scaler.optimizer_scaler(opt) if scaler.per_optimizer else scaler
            self.skipped.append(scaler.last_step_skipped)

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("per_optimizer", [False, True])
def test_manual_accumulation_overflow_skips_that_step_and_counts_one(per_optimizer):
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8, per_optimizer=per_optimizer, telemetry=False)
    model = _ManualAccumulation(k=4, poison=9)
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), max_epochs=1, max_steps=-1).fit(
        model, _data(n=256)
    )
    assert len(model.weights) == 4
    assert torch.equal(model.weights[2], model.weights[1])
    assert not torch.equal(model.weights[1], model.weights[0])
    assert not torch.equal(model.weights[3], model.weights[2])
    assert scaler.steps == 4 and scaler.skipped_steps == 1
    # The step just taken's, also before a shared scale's update (at the next backward): it read the
    # previous step's, and a scheduler held on it moved after the skip and stopped after the next step.
    assert model.skipped == [False, False, True, False]
    if per_optimizer:
        scaler = scaler.optimizer_scaler(model.trainer.optimizers[0])
    assert scaler.get_scale() == 2.0**7


class _ManualClipping(LightningModule):
    """Manual optimization clipping the gradient norm to ``CLIP`` before each SGD(lr=1) step: the
    weights move by exactly ``CLIP`` (the true gradient norm is far larger)."""

    CLIP = 0.01

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.moved: list[float] = []

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        before = torch.cat([p.detach().flatten().clone() for p in self.parameters()])
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=self.CLIP, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        after = torch.cat([p.detach().flatten() for p in self.parameters()])
        self.moved.append(float((after - before).double().norm()))

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
def test_manual_optimization_clips_the_unscaled_gradients(precision):
    # Clipping before opt.step() saw the gradients still scaled (2**10 here), so the threshold acted
    # as CLIP / 2**10 (as it does with Lightning's MixedPrecision); and the norm reported is the one
    # before clipping.
    collector = Collector(regex="Grad/norm")
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=100, telemetry=False)
    model = _ManualClipping()
    plugin = LossScalingPrecision(precision, scaler=scaler if precision == "16-mixed" else None)
    _trainer(plugin, max_steps=3).fit(model, _data())
    collector.update()
    assert model.moved == [pytest.approx(_ManualClipping.CLIP, rel=1e-5)] * 3
    assert collector.num("Grad/norm") == 3 and collector.min("Grad/norm") > 100 * _ManualClipping.CLIP


class _ClippingBeforeAccumulating(_ManualClipping):
    """Clips at every batch but steps at every other one: the second backward would add scaled
    gradients to the ones the first clip unscaled."""

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="norm")
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()


class _SkippingBatchOne(_Regression):
    """Automatic optimization; training_step returns None on batch 1 (Lightning's skip)."""

    @override
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_a_clip_that_no_step_follows_raises_and_a_skipped_batch_with_clipping_trains():
    # Manual: the clip unscaled, the next backward would have stepped gradients half scaled (1.4
    # instead of 0.004 here), silently: it raises, naming the fix. Automatic: a training_step that
    # returns None skips the step; the clipping Lightning still runs must not unscale (the next
    # batch's unscale_ raised "already been called").
    plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", 2.0**10, telemetry=False))
    with pytest.raises(RuntimeError, match=r"clip_gradients\(opt\) unscaled the gradients of an optimizer "
                       r"that has not stepped since.*HINT: clip once per step"):  # fmt: skip
        _trainer(plugin, max_steps=4).fit(_ClippingBeforeAccumulating(), _data())
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, telemetry=False)
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), max_steps=4, gradient_clip_val=1.0).fit(
        _SkippingBatchOne(), _data()
    )
    assert scaler.steps == 3 and scaler.skipped_steps == 0


class _TwoOptimizers(LightningModule):
    def __init__(self, poison_step: int | None = None):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
        self.poison_step = poison_step
        self.weights_a: list[torch.Tensor] = []

    @override
    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss = nn.functional.mse_loss((self.a(x) + self.b(x)).float(), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        if self.global_step // 2 == self.poison_step:
            self.a.weight.grad[0, 0] = float("inf")
        opt_a.step()
        opt_b.step()
        self.weights_a.append(self.a.weight.detach().clone())

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.05)


def test_manual_optimization_with_two_optimizers_updates_once_per_training_step():
    scaler = DynamicLossScaler("cpu", init_scale=4.0, growth_interval=1, telemetry=False)
    model = _TwoOptimizers(poison_step=2)
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), max_steps=8).fit(model, _data())
    # 4 training steps (global_step counts both optimizers), one update each at the end of
    # training_step: grow, grow, back off, grow. The scaler counts every optimizer step (2 per update).
    assert scaler.steps == 8 and scaler.skipped_steps == 1
    assert scaler.get_scale() == 4.0 * 2 * 2 / 2 * 2
    assert torch.equal(model.weights_a[2], model.weights_a[1])  # a's step skipped
    assert not torch.equal(model.weights_a[3], model.weights_a[2])


def test_a_checkpoint_of_lightnings_mixed_precision_resumes_with_its_scale(tmp_path: Path):
    # Moving a run from MixedPrecision (GradScaler) to LossScalingPrecision: Lightning reads the plugin
    # state under the plugin's class name, so the scale went back to init_scale, with nothing said.
    from lightning.pytorch.plugins import MixedPrecision

    theirs = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
    _trainer(theirs, max_steps=6, default_root_dir=tmp_path, enable_checkpointing=True).fit(
        _Regression(poison={2: float("inf")}), _data()
    )
    path = next(tmp_path.rglob("*.ckpt"))
    saved = torch.load(path, weights_only=False)["MixedPrecision"]
    assert saved["scale"] == 2.0**11  # one back-off
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, telemetry=False)
    resumed = _trainer(LossScalingPrecision("16-mixed", scaler=scaler), max_steps=7)
    resumed.fit(_Regression(), _data(), ckpt_path=str(path))
    assert scaler.get_scale() == 2.0**11 and scaler.steps == 1  # one more step, no growth yet
    # One scale per optimizer: the checkpoint's one scale is not theirs; they start at init_scale.
    per_optimizer = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True, telemetry=False)
    with pytest.warns(UserWarning, match="the per-optimizer scales start at init_scale"):
        _trainer(LossScalingPrecision("16-mixed", scaler=per_optimizer), max_steps=7).fit(
            _Regression(), _data(), ckpt_path=str(path)
        )
    assert per_optimizer.steps == 1


class _AnotherLossScalingPrecision(LossScalingPrecision):
    """A user's subclass (or LossScalingFSDPPrecision): a plugin of another class name."""


def test_a_checkpoint_of_another_of_our_plugins_resumes_with_its_scale(tmp_path: Path):
    # LossScalingPrecision's state went unread under another plugin: the scale restarted at init_scale.
    scaler = DynamicLossScaler("cpu", init_scale=2.0**12, telemetry=False)
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), max_steps=6, default_root_dir=tmp_path,
             enable_checkpointing=True).fit(_Regression(poison={2: float("inf")}), _data())  # fmt: skip
    path = next(tmp_path.rglob("*.ckpt"))
    resumed = DynamicLossScaler("cpu", telemetry=False)
    _trainer(_AnotherLossScalingPrecision("16-mixed", scaler=resumed), max_steps=7).fit(
        _Regression(), _data(), ckpt_path=str(path)
    )
    assert resumed.get_scale() == 2.0**11 and resumed.skipped_steps == 1 and resumed.steps == 7


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path: Path):
    poison = {2: float("inf"), 7: float("nan")}

    def plugin():
        return LossScalingPrecision(
            "16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8, growth_interval=3)
        )

    # One batch per epoch, so the data of a step does not depend on how Lightning re-enters the
    # epoch on resume (it restarts a non-stateful loader); the checkpoint is the end of step 6.
    full = _Regression(poison=poison)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1
    )
    full_trainer = _trainer(plugin(), [checkpoint], max_steps=12, enable_checkpointing=True)
    full_trainer.fit(full, _data(n=16))
    ckpt = tmp_path / "epoch=5-step=6.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["LossScalingPrecision"]["steps"] == 6 and saved["LossScalingPrecision"]["skipped_steps"] == 1

    resumed = _Regression(poison=poison)
    resumed_plugin = plugin()
    _trainer(resumed_plugin, max_steps=12).fit(resumed, _data(n=16), ckpt_path=ckpt)
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q)
    assert resumed_plugin.scaler.state_dict() == full_trainer.precision_plugin.scaler.state_dict()
    assert resumed_plugin.scaler.skipped_steps == 2


@pytest.mark.parametrize("schedule", ["exponential", "log2"])
def test_checkpoint_of_a_diverged_run_at_scale_0_saves_and_resumes(tmp_path: Path, schedule):
    """Gradients NaN at every step with no min_scale (GradScaler's default): the scale underflows to 0
    and the checkpoint saved then, the one needed to debug the divergence, saves and resumes."""

    def plugin():
        scaler = DynamicLossScaler("cpu", init_scale=2.0**-148, schedule=schedule, telemetry=False)
        return LossScalingPrecision("16-mixed", scaler=scaler)

    poison = dict.fromkeys(range(12), float("nan"))
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1
    )
    full = _Regression(poison=poison)
    full_trainer = _trainer(plugin(), [checkpoint], max_steps=6, enable_checkpointing=True)
    full_trainer.fit(full, _data(n=16))
    saved = torch.load(tmp_path / "epoch=3-step=4.ckpt", weights_only=True)["LossScalingPrecision"]
    assert saved["scale"] == 0.0 and saved["skipped_steps"] == 4
    assert saved["log2_scale"] == (-math.inf if schedule == "exponential" else -152.0)
    resumed, resumed_plugin = _Regression(poison=poison), plugin()
    ckpt = tmp_path / "epoch=3-step=4.ckpt"
    _trainer(resumed_plugin, max_steps=6).fit(resumed, _data(n=16), ckpt_path=ckpt)
    assert resumed_plugin.scaler.state_dict() == full_trainer.precision_plugin.scaler.state_dict()
    assert resumed_plugin.scaler.skipped_steps == 6
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q) and torch.isfinite(p).all()


def test_bf16_and_fp32_skip_nonfinite_steps_without_scaling():
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)):
        model = _Regression(poison={1: float("nan")})
        plugin = LossScalingPrecision(precision)
        recorder = _Recorder()
        _trainer(plugin, [recorder], max_steps=3).fit(model, _data())
        assert model.output_dtypes == {dtype}
        assert [r["skipped"] for r in recorder.rows] == [False, True, False]
        assert all(r["scale"] == 1.0 for r in recorder.rows)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"^LossScalingPrecision: `precision` must be one of .*'16-true'$"):
        LossScalingPrecision("16-true")
    with pytest.raises(TypeError, match=r"`precision` must be one of \('16-mixed', .*got 16 \(int\)$"):
        LossScalingPrecision(16)
    with pytest.raises(TypeError, match=r"LossScalingPrecision: `skip_nonfinite` must be a bool, got 1 \("):
        LossScalingPrecision("bf16-mixed", skip_nonfinite=1)
    with pytest.raises(
        ValueError, match=r"needs an enabled scaler.*HINT: on CPU build it as DynamicLossScaler\('cpu'\)"
    ):
        LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match="does not scale the loss"):
        LossScalingPrecision("bf16-mixed", scaler=DynamicLossScaler("cpu"))
    with pytest.raises(
        TypeError, match=r"`scaler` must be a lightning_ext\.amp\.DynamicLossScaler, got GradScaler"
    ):
        LossScalingPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    assert LossScalingPrecision("32-true", skip_nonfinite=False).scaler is None
    for device in (0, torch.device("cpu"), ""):  # 0 was taken as no device: CPU autocast on a GPU model
        with pytest.raises(TypeError, match=r"`device` must be a device type str \('cuda', 'cpu': torch"):
            LossScalingPrecision("16-mixed", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults")
def test_default_scalers_on_cpu():
    """GradScaler's default device 'cuda' would disable the scaler without CUDA: the plugin builds its
    default on 'cpu' (GradScaler's schedule, enabled) and the skip-only scaler for the others."""
    default = LossScalingPrecision("16-mixed").scaler
    assert default.is_enabled() and default._device == "cpu" and default.schedule == "exponential"
    assert (default.get_scale(), default.min_scale, default.max_scale) == (2.0**16, None, None)
    for precision in ("bf16-mixed", "32-true"):
        skip_only = LossScalingPrecision(precision).scaler
        assert not skip_only.is_enabled() and skip_only.skip_nonfinite and skip_only._device == "cpu"


def test_clipping_with_fused_optimizer_is_refused():
    plugin = LossScalingPrecision("16-mixed")
    opt = torch.optim.Adam(nn.Linear(2, 2).parameters(), fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        plugin.clip_gradients(opt, clip_val=1.0)


def test_lbfgs_is_refused():
    model = _Regression()
    plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", telemetry=False))
    with pytest.raises(TypeError, match="LossScalingPrecision cannot step LBFGS: its closure re-evaluates"):
        plugin.optimizer_step(torch.optim.LBFGS(model.parameters()), model, closure=lambda: None)


# ------------------------------------------------------------------------------------------------
# DDP: one rank's local gradient poisoned before reduction
# ------------------------------------------------------------------------------------------------


class _RankResults(Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.skipped: list[bool] = []

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.skipped.append(trainer.precision_plugin.scaler.last_step_skipped)

    @override
    def on_train_end(self, trainer, pl_module):
        torch.save(
            {
                "skipped": self.skipped,
                "scaler": trainer.precision_plugin.scaler.state_dict(),
                "weights": [p.detach().clone() for p in pl_module.parameters()],
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
            },
            Path(self.out_dir) / f"rank{trainer.global_rank}.pt",
        )


def _poisoned_fit(rank: int, world: int, out_dir: str) -> None:
    """One rank of a 2-rank DDP fit (Lightning's ``"ddp"`` on the harness's workers), rank 1's local
    gradient poisoned at steps 1 and 2."""
    model = _Regression(poison={1: float("inf"), 2: float("nan")}, poison_rank=1)
    plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    trainer = ddp_trainer(
        rank, world, plugins=[plugin], callbacks=[_RankResults(out_dir)], max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, _data(n=64))


@pytest.mark.timeout(240)
def test_ddp_one_poisoned_rank_skips_on_both(tmp_path: Path):
    run_distributed(_poisoned_fit, 2, str(tmp_path), timeout=200)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["skipped"] == r1["skipped"] == [False, True, True, False]
    assert r0["scaler"] == r1["scaler"] and r0["scaler"]["scale"] == 2.0**6
    assert r0["lr"] == r1["lr"] == pytest.approx(0.05 * 0.97**2)
    for p, q in zip(r0["weights"], r1["weights"]):
        assert torch.equal(p, q) and torch.isfinite(p).all()


class _PoisonedAfterReduction(_Regression):
    """Rank 1 writes inf into its gradient AFTER DDP's all-reduce (a callback editing ``.grad``): the ranks'
    gradients differ; with ``agree`` the scaler is given the group in ``setup``, as the plugin's docstring
    says."""

    def __init__(self, agree: bool):
        super().__init__()
        self.agree = agree

    @override
    def setup(self, stage):
        if self.agree:
            self.trainer.precision_plugin.scaler.process_group = torch.distributed.group.WORLD

    @override
    def on_after_backward(self):
        if self.global_rank == 1 and self.global_step == 1:
            self.net[0].weight.grad[0, 0] = float("inf")


def _fit_poisoned_after_reduction(rank: int, world: int, out_dir: str, agree: bool) -> None:
    plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", init_scale=2.0**8))
    trainer = ddp_trainer(
        rank, world, plugins=[plugin], callbacks=[_RankResults(out_dir)], max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_PoisonedAfterReduction(agree), _data(n=64))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("agree", [False, True])
def test_ddp_gradients_that_differ_after_the_reduction_need_the_scalers_group(tmp_path: Path, agree):
    # DDP leaves every rank the same gradients, so no collective decides the skip (GradScaler's way);
    # a rank-local edit after the reduction parts the replicas unless the scaler agrees over the group
    run_distributed(_fit_poisoned_after_reduction, 2, str(tmp_path), agree, timeout=200)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r1["skipped"] == [False, True, False]
    assert (r0["skipped"] == r1["skipped"]) == agree
    assert all(torch.equal(p, q) for p, q in zip(r0["weights"], r1["weights"])) == agree


def test_scaler_drops_into_lightnings_own_mixed_precision_plugin():
    from lightning.pytorch.plugins import MixedPrecision

    scaler = DynamicLossScaler("cpu", init_scale=2.0**8, telemetry=False)
    model = _Regression(poison={1: float("inf")})
    recorder = _Recorder()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)")
        _trainer(MixedPrecision("16-mixed", "cpu", scaler=scaler), [recorder], max_steps=3).fit(
            model, _data()
        )
    assert model.output_dtypes == {torch.float16}
    assert scaler.steps == 3 and scaler.skipped_steps == 1 and scaler.get_scale() == 2.0**7
    # The anchor's weakness that LossScalingPrecision fixes: Lightning's MixedPrecision still
    # advances the step-interval LR scheduler on the skipped step (Lightning #5558, #16228).
    skipped = recorder.rows[1]
    assert skipped["skipped"] and skipped["params_same"]
    assert skipped["lr_after"] < skipped["lr_before"]


# ------------------------------------------------------------------------------------------------
# Gradient health: the norm unscaled and before clipping, the update-to-weight ratio
# ------------------------------------------------------------------------------------------------


class _HealthRecorder(Callback):
    """Per batch: the float64 norm of the gradients Lightning's hook sees (before clipping), the
    update-to-weight ratio of the step, and what the plugin reported for it."""

    def __init__(self, scaled_by: float = 1.0):
        self.scaled_by = scaled_by  # a fused optimizer's hook sees scaled gradients
        self.collector = Collector(regex="Grad/.*", keep_previous=False)
        self.rows: list[dict] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().double().clone() for p in pl_module.parameters()]

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = torch.cat([p.grad.double().flatten() for p in pl_module.parameters()])
        self._norm = float(torch.linalg.vector_norm(grads)) / self.scaled_by

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = torch.cat([p.detach().double().flatten() for p in pl_module.parameters()])
        before = torch.cat([p.flatten() for p in self._before])
        self.collector.update()
        self.rows.append(
            {
                "skipped": trainer.precision_plugin.scaler.last_step_skipped,
                "norm": self._norm,
                "ratio": float(torch.linalg.vector_norm(after - before) / torch.linalg.vector_norm(before)),
                "reported": (self.collector.num("Grad/norm"), self.collector.mean("Grad/norm")),
                "reported_ratio": self.collector.as_dict().get("Grad/update_ratio", {}).get("mean"),
            }
        )


def test_gradient_norm_is_unscaled_before_clipping_and_skipped_steps_report_nothing():
    # fp16 at a scale of 2**12 with poisoned steps, and clipping far below the true norm: the reported
    # norm is the true one (not 2**12 times it, not the clipped one), the ratio is that of the step.
    poison = {2: float("inf"), 5: float("nan")}
    recorder = _HealthRecorder()
    scaler = DynamicLossScaler("cpu", init_scale=2.0**12, growth_interval=100)
    plugin = LossScalingPrecision("16-mixed", scaler=scaler, update_ratio=True)
    _trainer(plugin, [recorder], max_steps=8, gradient_clip_val=1e-3).fit(_Regression(poison=poison), _data())
    for step, row in enumerate(recorder.rows):
        assert row["skipped"] == (step in poison), step
        if step in poison:
            assert row["reported"][0] == 0 and math.isnan(row["reported_ratio"]), step  # no values
            continue
        num, norm = row["reported"]
        assert num == 1 and row["norm"] > 10 * 1e-3  # clipping was active
        # float32 norms of float32 gradients: relative error ~ sqrt(n) * 2**-24.
        assert norm == pytest.approx(row["norm"], rel=1e-5), step
        assert row["reported_ratio"] == pytest.approx(row["ratio"], rel=1e-4), step


def test_fused_optimizers_report_the_unscaled_norm():
    scale = 2.0**10
    recorder = _HealthRecorder(scaled_by=scale)  # the hook sees the fused optimizer's scaled gradients
    scaler = DynamicLossScaler("cpu", init_scale=scale, growth_interval=100, telemetry=False)
    model = _Regression(optimizer_fn=lambda params, lr: torch.optim.Adam(params, lr=lr / 10, fused=True))
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), [recorder], max_steps=3).fit(model, _data())
    for row in recorder.rows:
        assert row["reported"][0] == 1 and row["reported"][1] == pytest.approx(row["norm"], rel=1e-5)
        assert row["reported_ratio"] is None  # update_ratio is off by default


class _SparseEmbedding(LightningModule):
    """A sparse embedding looked up with repeated indices: its gradient is uncoalesced. Records the
    dense gradient's norm before each step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.norms: list[float] = []

    @override
    def training_step(self, batch, batch_idx):
        return self.embedding(torch.tensor([1, 1, 1, 2])).sum() * batch[0].sum() ** 0

    @override
    def on_before_optimizer_step(self, optimizer):
        self.norms.append(float(self.embedding.weight.grad.to_dense().double().norm()))

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
def test_the_norm_of_a_sparse_gradient_sums_its_repeated_indices_first(precision):
    # Rows 1 (three times) and 2 of the lookup: the dense gradient holds 3 in row 1 and 1 in row 2
    # (norm sqrt(4 * 9 + 4) = 6.32); the values of the uncoalesced one squared apart gave sqrt(16) = 4.
    collector = Collector(regex="Grad/norm")
    model = _SparseEmbedding()
    _trainer(LossScalingPrecision(precision), max_steps=2).fit(model, _data(n=32))
    collector.update()
    assert model.norms == [pytest.approx(40**0.5)] * 2
    assert collector.num("Grad/norm") == 2 and collector.mean("Grad/norm") == pytest.approx(40**0.5, rel=1e-6)


def test_two_optimizers_report_under_their_names():
    collector = Collector(regex="Grad/.*", keep_previous=False)
    plugin = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", 4.0, telemetry=False))
    _trainer(plugin, max_steps=4).fit(_TwoOptimizers(), _data())
    collector.update()
    assert collector.names() == ["Grad/0/norm", "Grad/1/norm"]
    assert collector.num("Grad/0/norm") == 2  # two training steps, each steps both optimizers
    no_health = LossScalingPrecision("16-mixed", scaler=DynamicLossScaler("cpu", 4.0), grad_norm=False)
    _trainer(no_health, max_steps=2).fit(_Regression(), _data())
    collector.update()
    assert collector.num("Grad/0/norm") == 0 and "Grad/norm" not in collector.names()
    with pytest.raises(TypeError, match=r"LossScalingPrecision: `update_ratio` must be a bool, got 'yes'"):
        LossScalingPrecision("16-mixed", update_ratio="yes")


def test_repr_names_every_setting_and_errors_name_the_plugin():
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, schedule="log2", hysteresis=2)
    plugin = LossScalingPrecision(scaler=scaler, optimizer_names=["g", "d"], update_ratio=True)
    assert repr(plugin) == (
        f"LossScalingPrecision(precision='16-mixed', scaler={scaler!r}, device=None, "
        "optimizer_names=['g', 'd'], grad_norm=True, update_ratio=True)"
    )
    with pytest.raises(TypeError, match=r"^LossScalingPrecision: `optimizer_names` must be distinct"):
        LossScalingPrecision(optimizer_names=["g", "g"])
    with pytest.raises(TypeError, match=r"^LossScalingPrecision: `scaler` must be"):
        LossScalingPrecision(scaler=torch.amp.GradScaler("cpu"))


class _Players(LightningModule):
    """Two optimizers, each backward scaled by its own scale (a GAN's pattern, manual optimization)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)

    @override
    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_d)
        opt_d.zero_grad()
        self.manual_backward(self.d(x).mean() - self.d(self.g(x)).mean())
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        opt_g.zero_grad()
        with self.trainer.precision_plugin.backward_for(opt_g):
            self.manual_backward(self.d(self.g(x)).mean())
        opt_g.step()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)


@pytest.mark.parametrize("names", [None, ["G", "D"]])
def test_per_optimizer_scales_carry_on_into_a_second_fit(names):
    # configure_optimizers makes new optimizers for every fit: connect() registered their names again
    # and register_optimizer refused them ("already names another optimizer's scale")
    scaler = DynamicLossScaler("cpu", init_scale=2.0**10, per_optimizer=True, telemetry=False)
    trainer = _trainer(LossScalingPrecision(scaler=scaler, optimizer_names=names), max_steps=-1, max_epochs=1)
    model = _Players()
    trainer.fit(model, _data(n=32))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, _data(n=32))
    assert sorted(scaler.state_dict()["per_optimizer"]) == sorted(names or ["0", "1"])
    assert [scaler.optimizer_scaler(o).steps for o in trainer.optimizers] == [4, 4]  # 2 steps per fit each
