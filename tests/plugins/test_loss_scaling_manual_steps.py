"""LossScalingPrecision when an optimizer steps several times per training_step (GAN training).

A WGAN-GP-style critic loop (``n_critic`` critic steps, then one generator step) and StyleGAN2-ADA's
lazy regularization (a second critic phase, ``Dreg``, every ``reg_interval``-th batch) in manual
optimization, with one scale per optimizer; inf is injected into the critic's local gradients on
chosen steps, on one DDP rank only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.amp import DynamicLossScaler
from lightning_ext.plugins import LossScalingPrecision
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import ddp_trainer

INIT_SCALE = 2.0**12


def _data(n=96, batch_size=8):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 2, generator=g) + 2), batch_size=batch_size)


class _Gan(LightningModule):
    """Manual optimization: per batch ``n_critic`` critic steps (phase ``"Dmain"``), on every
    ``reg_interval``-th batch one more critic step on a regularization loss (``"Dreg"``, ProGAN's
    drift penalty), then one generator step (``"G"``).

    ``poison`` holds ``(batch_idx, phase, i)`` critic steps (``batch_idx`` counted over epochs) whose
    local gradients get an inf, on rank ``poison_rank`` only (before DDP reduces them). ``records``
    lists, per optimizer step, ``(batch_idx, phase, i, skipped, params_moved)``.
    """

    def __init__(self, n_critic=1, reg_interval=0, poison=(), poison_rank=0, toggle=True):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.D = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
        self.n_critic, self.reg_interval = n_critic, reg_interval
        self.poison, self.poison_rank, self.toggle = set(poison), poison_rank, toggle
        self.records: list[tuple] = []

    def _critic(self, x: torch.Tensor, poisoned: bool) -> torch.Tensor:
        h = self.D[0](x)
        if poisoned:
            h.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
        return self.D[2](self.D[1](h)).float()

    def _fake(self, batch_idx: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * batch_idx + self.global_rank)
        return self.G(torch.randn(n, 4, generator=g))

    def _step(self, optimizer, params, loss_fn, key) -> None:
        if self.toggle:
            self.toggle_optimizer(optimizer)
        before = [p.detach().clone() for p in params]
        optimizer.zero_grad()
        self.manual_backward(loss_fn())
        optimizer.step()
        scaler = self.trainer.precision_plugin.scaler.optimizer_scaler(optimizer.optimizer)
        moved = not all(torch.equal(p, q) for p, q in zip(params, before))
        self.records.append((*key, scaler.last_step_skipped, moved))
        if self.toggle:
            self.untoggle_optimizer(optimizer)

    @override
    def training_step(self, batch, batch_idx):
        (real,) = batch
        batch_idx += self.current_epoch * self.trainer.num_training_batches  # counted over epochs
        opt_g, opt_d = self.optimizers()
        d_params, g_params = list(self.D.parameters()), list(self.G.parameters())
        phases = [("Dmain", i) for i in range(self.n_critic)]
        if self.reg_interval and batch_idx % self.reg_interval == 0:
            phases.append(("Dreg", 0))
        for phase, i in phases:
            poisoned = (batch_idx, phase, i) in self.poison and self.global_rank == self.poison_rank

            def loss_d(phase=phase, poisoned=poisoned):
                if phase == "Dreg":
                    return 1e-3 * self._critic(real, poisoned).square().mean()
                fake = self._fake(batch_idx, len(real)).detach()
                return self._critic(fake, poisoned).mean() - self._critic(real, False).mean()

            self._step(opt_d, d_params, loss_d, (batch_idx, phase, i))
        self._step(opt_g, g_params, lambda: -self._critic(self._fake(batch_idx, len(real)), False).mean(),
                   (batch_idx, "G", 0))  # fmt: skip

    @override
    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.G.parameters(), lr=1e-3, betas=(0.5, 0.9)),
            torch.optim.Adam(self.D.parameters(), lr=1e-3, betas=(0.5, 0.9)),
        )

    @override
    def on_train_end(self):
        out = getattr(self, "out_dir", None)
        if out is not None:
            scaler = self.trainer.precision_plugin.scaler
            torch.save(
                {
                    "records": self.records,
                    "state": scaler.state_dict(),
                    "weights": [p.detach().clone() for p in self.parameters()],
                },
                Path(out) / f"rank{self.global_rank}.pt",
            )


def _plugin():
    scaler = DynamicLossScaler("cpu", init_scale=INIT_SCALE, per_optimizer=True, telemetry=False)
    return LossScalingPrecision("16-mixed", scaler=scaler, optimizer_names=["G", "D"])


def _trainer(plugin, batches, **kwargs):
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=batches, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return Trainer(plugins=[plugin], **{**defaults, **kwargs})


def _check_records(records, poison):
    """Exactly the poisoned critic steps were skipped, and left the weights bit-identical."""
    skipped = {(b, phase, i) for b, phase, i, s, _ in records if s}
    assert skipped == set(poison)
    for b, phase, i, s, moved in records:
        assert moved is not s, (b, phase, i)


def _check_scales(state, d_steps, poison, g_steps):
    d, g = state["per_optimizer"]["D"], state["per_optimizer"]["G"]
    assert d["steps"] == d_steps and d["skipped_steps"] == len(poison)
    assert d["scale"] == INIT_SCALE / 2 ** len(poison)  # one back-off per skipped step
    assert g["steps"] == g_steps and g["skipped_steps"] == 0 and g["scale"] == INIT_SCALE


def _ddp_fit(rank: int, world: int, out_dir: str, batches: int, **gan: object) -> None:
    """One rank of a DDP fit of ``_Gan(**gan)`` (Lightning's ``"ddp"`` on the harness's workers)."""
    model = _Gan(**gan)
    model.out_dir = out_dir
    trainer = ddp_trainer(
        rank, world, "ddp_find_unused_parameters_true", plugins=[_plugin()], max_epochs=1,
        limit_train_batches=batches, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, _data())


def _ddp_run(tmp_path: Path, batches: int, **gan: object):
    run_distributed(_ddp_fit, 2, str(tmp_path), batches, timeout=200, **gan)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["state"] == r1["state"]
    for p, q in zip(r0["weights"], r1["weights"]):
        assert torch.equal(p, q) and torch.isfinite(p).all()
    assert r0["records"] == r1["records"]
    return r0


@pytest.mark.timeout(240)
def test_critic_loop_on_two_ranks_skips_exactly_the_poisoned_critic_steps(tmp_path: Path):
    poison = {(0, "Dmain", 1), (1, "Dmain", 4), (2, "Dmain", 0), (2, "Dmain", 3)}
    r0 = _ddp_run(tmp_path, batches=3, n_critic=5, poison=poison, poison_rank=1)
    _check_records(r0["records"], poison)
    _check_scales(r0["state"], d_steps=15, poison=poison, g_steps=3)


@pytest.mark.timeout(240)
def test_lazy_regularization_on_two_ranks_skips_exactly_the_poisoned_steps(tmp_path: Path):
    poison = {(0, "Dreg", 0), (3, "Dmain", 0), (4, "Dreg", 0)}
    r0 = _ddp_run(tmp_path, batches=6, reg_interval=4, poison=poison, poison_rank=0)
    assert [b for b, phase, *_ in r0["records"] if phase == "Dreg"] == [0, 4]
    _check_records(r0["records"], poison)
    _check_scales(r0["state"], d_steps=6 + 2, poison=poison, g_steps=6)


def test_one_shared_scale_moves_between_critic_steps():
    poison = {(0, "Dmain", 2)}
    scaler = DynamicLossScaler("cpu", init_scale=1.0, growth_interval=1, telemetry=False)
    model = _Gan(n_critic=3, poison=poison)
    model._step = _shared_step.__get__(model)
    _trainer(LossScalingPrecision("16-mixed", scaler=scaler), batches=2).fit(model, _data())
    _check_records(model.records, poison)
    # 8 steps, one update each (the scale moves before the next backward): 7 growths, 1 back-off.
    assert scaler.steps == 8 and scaler.skipped_steps == 1
    assert scaler.get_scale() == 2.0**7 / 2


def _shared_step(self, optimizer, params, loss_fn, key):
    """_Gan._step for one shared scale."""
    before = [p.detach().clone() for p in params]
    optimizer.zero_grad()
    self.manual_backward(loss_fn())
    found_inf = not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    optimizer.step()
    moved = not all(torch.equal(p, q) for p, q in zip(params, before))
    self.records.append((*key, found_inf, moved))


def test_ambiguous_owner_of_a_backward_raises_and_backward_for_resolves_it():
    model = _Gan(toggle=False)
    with pytest.raises(ValueError, match=r"optimizers \['G', 'D'\] require grad. HINT: call self.toggle"):
        _trainer(_plugin(), batches=1).fit(model, _data())

    class _Named(_Gan):
        def _step(self, optimizer, params, loss_fn, key):
            with self.trainer.precision_plugin.backward_for(optimizer):
                super()._step(optimizer, params, loss_fn, key)

    model = _Named(toggle=False, poison={(0, "Dmain", 0)})
    plugin = _plugin()
    _trainer(plugin, batches=2).fit(model, _data())
    _check_records(model.records, {(0, "Dmain", 0)})
    _check_scales(plugin.scaler.state_dict(), d_steps=2, poison={(0, "Dmain", 0)}, g_steps=2)


@pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_restores_both_scales_and_equals_the_uninterrupted_run(tmp_path: Path):
    # One batch per epoch, so a step's data does not depend on how Lightning re-enters an epoch.
    poison = {(1, "Dmain", 0), (4, "Dmain", 1)}
    full = _Gan(n_critic=2, poison=poison)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    kwargs = dict(batches=1, max_epochs=6)
    full_trainer = _trainer(_plugin(), enable_checkpointing=True, callbacks=[checkpoint], **kwargs)
    full_trainer.fit(full, _data(n=8))
    ckpt = tmp_path / "epoch=2-step=9.ckpt"  # 3 optimizer steps per batch: global_step counts each
    saved = torch.load(ckpt, weights_only=False)["LossScalingPrecision"]["per_optimizer"]
    assert saved["D"]["skipped_steps"] == 1 and saved["D"]["scale"] == INIT_SCALE / 2

    resumed = _Gan(n_critic=2, poison=poison)
    plugin = _plugin()
    _trainer(plugin, **kwargs).fit(resumed, _data(n=8), ckpt_path=ckpt)
    assert plugin.scaler.state_dict() == full_trainer.precision_plugin.scaler.state_dict()
    assert plugin.scaler.skipped_steps == 2
    for p, q in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, q)


_X = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


class _OneAccumulates(LightningModule):
    """Manual optimization with one shared scale: ``a`` steps every batch (overflowing at ``poison``),
    ``b`` accumulates over two; records each step of ``b``'s applied gradient (lr 1)."""

    def __init__(self, poison: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.poison, self.applied = nn.Linear(8, 1), nn.Linear(8, 1), poison, []
        self.automatic_optimization = False

    @override
    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        (x,) = batch
        self.manual_backward(self.b(x).float().square().mean())
        loss_a = self.a(x).float().square().mean()
        self.manual_backward(loss_a * float("inf") if batch_idx == self.poison else loss_a)
        opt_a.step()
        opt_a.zero_grad()
        if batch_idx % 2 == 1:
            before = self.b.weight.detach().clone()
            opt_b.step()
            opt_b.zero_grad()
            self.applied.append(before - self.b.weight.detach())

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.0), torch.optim.SGD(self.b.parameters(), lr=1.0)


@pytest.mark.parametrize("poison", [0, None])  # the scale backs off, or grows, under b's gradients
def test_a_shared_scale_moving_under_another_optimizers_accumulated_gradients_keeps_them_right(poison):
    # b's gradients of batch 0 were scaled by the scale before a's update and unscaled by the one
    # after: b applied 2 g0 + g1 after a back-off (g0 / 2 + g1 after a growth), silently.
    model = _OneAccumulates(poison)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**4, growth_interval=1, telemetry=False)
    Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[LossScalingPrecision("16-mixed", scaler=scaler)],
    ).fit(model, DataLoader(TensorDataset(_X[:4]), batch_size=2))
    reference = _OneAccumulates(poison)
    for x in _X[:4].split(2):
        with torch.autocast("cpu", dtype=torch.float16):
            out = reference.b(x)
        out.float().square().mean().backward()
    torch.testing.assert_close(model.applied[0], reference.b.weight.grad, rtol=1e-3, atol=1e-5)
