"""LossScalingFSDPPrecision: found_inf agreed over sharded gradients (torch FSDP on 2 gloo ranks, CPU),
and the Lightning FSDPStrategy integration (CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

from lightning_ext.amp import DynamicLossScaler
from lightning_ext.plugins import LossScalingFSDPPrecision
from tests.helpers.distributed import run_distributed

POISON_STEP, STEPS = 1, 3


def _train(scaler, rank: int) -> dict:
    """3 steps of an FSDP-sharded MLP; at POISON_STEP rank 1 writes inf into ITS gradient shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
        device_id=torch.device("cpu"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(STEPS, 4, 8, generator=torch.Generator().manual_seed(rank))
    shards, scales = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(model(data[step]).square().mean()).backward()
        (flat,) = model.parameters()  # this rank's shard of the flattened parameters
        if step == POISON_STEP and rank == 1:
            flat.grad[0] = float("inf")
        before = flat.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        shards.append((before, flat.detach().clone()))
        scales.append(scaler.get_scale())
    del model, optimizer
    return {"moved": [not torch.equal(a, b) for a, b in shards], "final": shards[-1][1], "scales": scales}


def _compare(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    kwargs = dict(init_scale=2.0**10, growth_interval=1)
    return {
        "anchor": _train(ShardedGradScaler("cpu", **kwargs), rank),
        "ours": _train(
            DynamicLossScaler("cpu", **kwargs, process_group=dist.group.WORLD, telemetry=False), rank
        ),
        "unagreed": _train(DynamicLossScaler("cpu", **kwargs, telemetry=False), rank),
        "plugin_group": _connected_group(),
    }


def _connected_group():
    plugin = LossScalingFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cpu", telemetry=False))
    model = torch.nn.Linear(2, 1)
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    return plugin.scaler.process_group is dist.group.WORLD


@pytest.mark.timeout(240)
def test_sharded_overflow_on_one_rank_skips_on_every_rank_like_sharded_grad_scaler():
    results = run_distributed(_compare, 2, timeout=200)
    expected_moved = [step != POISON_STEP for step in range(STEPS)]
    for rank, result in enumerate(results):
        anchor, ours = result["anchor"], result["ours"]
        assert anchor["moved"] == ours["moved"] == expected_moved, rank
        assert ours["scales"] == anchor["scales"] == [2.0**11, 2.0**10, 2.0**11]
        assert torch.equal(ours["final"], anchor["final"]), rank  # same unscaling, same steps
        assert result["plugin_group"]
    # Without the group the clean rank never hears of the other's overflow and steps alone.
    assert results[0]["unagreed"]["moved"] == [True] * STEPS
    assert results[1]["unagreed"]["moved"] == expected_moved


def test_is_an_fsdp_precision_with_our_scaler():
    plugin = LossScalingFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cpu", schedule="log2"))
    assert isinstance(plugin, FSDPPrecision) and plugin.scaler.schedule == "log2"
    assert plugin.mixed_precision_config.reduce_dtype == torch.float16
    bf16 = LossScalingFSDPPrecision("bf16-mixed")
    # FSDP's dtypes are Lightning's own for the precision (they differ between Lightning versions).
    assert bf16.mixed_precision_config == FSDPPrecision("bf16-mixed").mixed_precision_config
    assert bf16.mixed_precision_config.reduce_dtype == torch.bfloat16 and not bf16.scaler.is_enabled()
    with pytest.raises(ValueError, match=r"LossScalingFSDPPrecision: `precision` must be one of"):
        LossScalingFSDPPrecision("16-true")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs a CUDA device")
def test_fsdp_strategy_trains_with_our_scaling_and_skips_a_poisoned_step(tmp_path):
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.snapshots = []
            self.trace = []  # (global_step after the batch, skipped, scale): said when an assert fails

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.net[0](x)
            if self.global_step == POISON_STEP:
                h.register_hook(lambda g: g.index_fill(1, torch.tensor([0], device=g.device), float("inf")))
            return torch.nn.functional.mse_loss(self.net[2](self.net[1](h)).float(), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.snapshots.append([p.detach().clone() for p in self.parameters()])
            scaler = self.trainer.strategy.precision_plugin.scaler
            self.trace.append((self.global_step, scaler.last_step_skipped, scaler.get_scale()))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    plugin = LossScalingFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cuda", init_scale=2.0**8))
    model = Module()
    trainer = Trainer(
        accelerator="gpu", devices=1, strategy="fsdp", plugins=[plugin], max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, loader)
    trace = model.trace
    assert plugin.scaler.steps == STEPS and plugin.scaler.skipped_steps == 1, trace
    assert plugin.scaler.get_scale() == 2.0**7, trace
    assert all(
        torch.equal(a, b) for a, b in zip(model.snapshots[POISON_STEP - 1], model.snapshots[POISON_STEP])
    )
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** (STEPS - 1))


def _gradient_norms(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    """Per sharding strategy: the gradient norm the plugin reports (this rank's squares reduced as it
    reduces them) and the norm of the whole model's gradient, one process."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    norms = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        torch.manual_seed(0)
        model = FSDP(torch.nn.Linear(8, 4), device_id=torch.device("cpu"), sharding_strategy=strategy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        plugin = LossScalingFSDPPrecision("16-mixed", scaler=DynamicLossScaler("cpu", telemetry=False))
        plugin.connect(model, [optimizer], [])
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
        model(x).square().sum().backward()
        squares, _ = plugin._health_before_step(optimizer)
        torch.manual_seed(0)
        reference = torch.nn.Linear(8, 4)
        reference(x).square().sum().backward()
        true = torch.sqrt(sum(p.grad.double().square().sum() for p in reference.parameters())).item()
        norms[strategy.name] = (plugin._reduce_squares(squares[None]).sqrt().item(), true)
        del model, optimizer
    return norms


@pytest.mark.timeout(240)
def test_the_gradient_norm_sums_over_the_ranks_that_split_the_gradients():
    # Under NO_SHARD every rank holds the whole gradient: the norm summed over the world was sqrt(2)
    # times too large on 2 ranks.
    for norms in run_distributed(_gradient_norms, 2, timeout=200):
        for strategy, (reported, true) in norms.items():
            assert reported == pytest.approx(true, rel=1e-5), strategy
