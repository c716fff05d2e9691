"""SyncBatchNormPlugin: a Trainer on 2 CPU processes (where sync_batchnorm=True fails) vs one process."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from lightning import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ext.kernels import available_backends
from lightning_ext.nn import SyncBatchNorm
from lightning_ext.plugins import SyncBatchNormPlugin
from tests.helpers.distributed import run_distributed
from tests.helpers.lightning_ddp import ddp_trainer

N, F = 16, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = 5.0 + 3.0 * torch.randn(N, F, generator=g)
    return x, x.sum(1, keepdim=True) / 10


class BatchNormRegressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.BatchNorm1d(F), nn.Linear(F, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data()), batch_size=3, shuffle=False)


class PerturbedOnRank1(BatchNormRegressor):
    """Rank 1 starts with other running statistics than rank 0 (set before the strategy's setup)."""

    def setup(self, stage):
        if self.trainer.global_rank == 1:
            self.net[0].running_mean.fill_(7.0)
            self.net[0].running_var.fill_(3.0)
            self.net[0].num_batches_tracked.fill_(5)


class RecordStats(Callback):
    """Each rank writes its layer classes and running stats (the main process only sees rank 0)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_start(self, trainer, pl_module):
        self.classes = [type(m).__name__ for m in pl_module.net]
        self.batches = []
        # DDP's per-forward buffer broadcast: which buffers it still syncs.
        self.ddp_buffers = sorted(trainer.strategy.model.named_module_buffers)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch[0].clone())

    def on_train_end(self, trainer, pl_module):
        bn = pl_module.net[0]
        torch.save(
            {
                "classes": self.classes,
                "batches": self.batches,
                "ddp_buffers": self.ddp_buffers,
                "running_mean": bn.running_mean.clone(),
                "running_var": bn.running_var.clone(),
                "num_batches_tracked": bn.num_batches_tracked.clone(),
            },
            Path(self.directory) / f"rank{trainer.global_rank}.pt",
        )


def _reference_running_stats(per_rank_batches):
    """One process, float64 BatchNorm1d on each global batch (the concatenation of the ranks' batches)."""
    bn = nn.BatchNorm1d(F).double()
    for step_batches in zip(*per_rank_batches):
        bn(torch.cat(step_batches).double())
    return bn


U32 = 2.0**-24  # float32 unit roundoff


def _float32_bounds(per_rank_batches, momentum: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per feature, how far float32 running statistics may be from :func:`_reference_running_stats`.

    Each step's global batch of ``n`` values per feature gives float32 batch statistics computed in
    any summation order around any shift ``|c| <= Y = max|x|`` (a sum of ``k`` terms is off by at
    most ``k·u·Σ|term|``, Higham 2002 §4.2; ``u = 2**-24``): the mean by ``u·(Σ(|x| + Y) + 3Y)``, the
    unbiased variance by ``(n + 2)·u·Σ(|x - mean| + 2Y)²/(n - 1) + u·var``. The update
    ``r = (1 - m)·r + m·stat`` shrinks earlier errors by ``1 - m``, adds ``m`` times the batch
    statistic's, and rounds (``m`` itself, two products and the sum): ``4u·(|r| + |stat|)``.
    Returns ``(tol_mean, tol_var)``, float64 ``(F,)``.
    """
    x_max = torch.cat([b for batches in per_rank_batches for b in batches]).double().abs().amax(0)
    mean, var = torch.zeros(F, dtype=torch.float64), torch.ones(F, dtype=torch.float64)
    tol_mean, tol_var = torch.zeros_like(mean), torch.zeros_like(var)
    for step_batches in zip(*per_rank_batches):
        x = torch.cat(step_batches).double()
        n, batch_mean, batch_var = x.shape[0], x.mean(0), x.var(0, unbiased=True)
        d_mean = U32 * ((x.abs() + x_max).sum(0) + 3 * x_max)
        d_var = (n + 2) * U32 * ((x - batch_mean).abs() + 2 * x_max).square().sum(0) / (n - 1)
        d_var = d_var + U32 * batch_var
        tol_mean = (1 - momentum) * tol_mean + momentum * d_mean + 4 * U32 * (mean.abs() + batch_mean.abs())
        tol_var = (1 - momentum) * tol_var + momentum * d_var + 4 * U32 * (var + batch_var)
        mean = (1 - momentum) * mean + momentum * batch_mean
        var = (1 - momentum) * var + momentum * batch_var
    return tol_mean, tol_var


def _plugin_fit(rank: int, world: int, out_dir: str) -> dict:
    """One rank of a 2-rank DDP fit with the plugin (Lightning's ``"ddp"`` on the harness's workers);
    what the user's module holds after it."""
    model = PerturbedOnRank1()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ddp_trainer(
        rank,
        world,
        plugins=[SyncBatchNormPlugin(group_size=2)],
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[RecordStats(out_dir)],
    )
    trainer.fit(model)
    return {
        "classes": [type(m) for m in model.net],
        "running_var": model.net[0].running_var.clone(),
        "trained": not torch.equal(model.net[1].weight, initial["net.1.weight"]),
        "finite": bool(torch.isfinite(model.net[3].weight).all()),
    }


@pytest.mark.timeout(240)
def test_trainer_ddp_on_cpu_synchronizes_and_reverts(tmp_path):
    # Rank 1 starts from other running stats: the plugin broadcasts rank 0's once at apply and
    # removes the layers' buffers from DDP's per-forward broadcast (they stay equal by themselves).
    models = run_distributed(_plugin_fit, 2, str(tmp_path), timeout=200)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = _reference_running_stats([rec["batches"] for rec in ranks])
    tol_mean, tol_var = _float32_bounds([rec["batches"] for rec in ranks])
    assert [len(b) for b in ranks[0]["batches"]] == [3, 3, 2]  # each rank has 8 of the 16 samples
    assert not torch.equal(ranks[0]["batches"][0], ranks[1]["batches"][0])
    for rec in ranks:
        assert rec["classes"] == ["SyncBatchNorm", "Linear", "SyncBatchNorm", "Linear"]
        assert rec["ddp_buffers"] == []  # DDP broadcasts nothing at forward
        assert int(rec["num_batches_tracked"]) == 3
        assert ((rec["running_mean"].double() - reference.running_mean).abs() <= tol_mean).all()
        assert ((rec["running_var"].double() - reference.running_var).abs() <= tol_var).all()
    assert torch.equal(ranks[0]["running_var"], ranks[1]["running_var"])
    # The user's module, on every rank, has its classes back (reverted) and the trained state.
    for model, rec in zip(models, ranks):
        assert model["classes"] == [nn.BatchNorm1d, nn.Linear, nn.BatchNorm1d, nn.Linear]
        torch.testing.assert_close(model["running_var"], rec["running_var"])
        assert model["trained"] and model["finite"]


class WithExtraBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(F, 8), nn.BatchNorm1d(8))
        self.register_buffer("extra", torch.zeros(2))


def _ddp_buffers_worker(rank: int, world_size: int) -> dict:
    """apply() on 2 gloo ranks whose BN buffers differ; which buffers a DDP wrapper still syncs."""
    out = {}
    for label, kwargs, user_ignore in [
        ("default", {}, None),
        ("user_ignore", {}, ["extra"]),
        ("subgroups", {"group_size": 1}, None),
        ("opt_out", {"ddp_broadcast_buffers": True}, None),
    ]:
        torch.manual_seed(0)
        model = WithExtraBuffer()
        bn = model.net[1]
        bn.running_mean.fill_(float(rank + 1))
        bn.num_batches_tracked.fill_(rank + 3)
        if user_ignore is not None:
            model._ddp_params_and_buffers_to_ignore = list(user_ignore)
        plugin = SyncBatchNormPlugin(**kwargs)
        model = plugin.apply(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        synced = sorted(ddp.named_module_buffers)
        ignore = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        model = plugin.revert(model)
        out[label] = {
            "synced": synced,
            "ignore": ignore,
            "after_revert": getattr(model, "_ddp_params_and_buffers_to_ignore", None),
            "running_mean": model.net[1].running_mean.clone(),
            "num_batches_tracked": int(model.net[1].num_batches_tracked),
        }
    return out


@pytest.mark.timeout(120)
def test_apply_excludes_world_synchronized_buffers_from_ddp_broadcast():
    outs = run_distributed(_ddp_buffers_worker, 2, timeout=90)
    bn_buffers = ["net.1.num_batches_tracked", "net.1.running_mean", "net.1.running_var"]
    for out in outs:
        # Default: broadcast once from rank 0 at apply, then only the other buffer stays in DDP's sync.
        assert out["default"]["synced"] == ["extra"]
        assert sorted(out["default"]["ignore"]) == bn_buffers
        assert out["default"]["after_revert"] is None
        assert out["default"]["num_batches_tracked"] == 3
        # A user's own ignore list is kept, extended, and given back as it was.
        assert out["user_ignore"]["synced"] == []
        assert sorted(out["user_ignore"]["ignore"]) == sorted(["extra", *bn_buffers])
        assert out["user_ignore"]["after_revert"] == ["extra"]
        # Layers synchronized within subgroups, or the opt-out: DDP keeps broadcasting everything.
        for label in ("subgroups", "opt_out"):
            assert out[label]["synced"] == sorted(["extra", *bn_buffers]), label
            assert out[label]["after_revert"] is None
    for label in out:
        # Either our broadcast at apply or DDP's own at construction made rank 1 take rank 0's values.
        assert torch.equal(outs[1][label]["running_mean"], torch.ones(8)), label
        assert outs[1][label]["num_batches_tracked"] == 3, label


def test_apply_and_revert_without_trainer():
    plugin = SyncBatchNormPlugin(backend="reference")
    model = BatchNormRegressor()
    converted = plugin.apply(model)
    assert isinstance(converted.net[0], SyncBatchNorm) and converted.net[0].backend == "reference"
    reverted = plugin.revert(converted)
    assert type(reverted.net[0]) is nn.BatchNorm1d and reverted.net[0].weight is model.net[0].weight


def test_revert_leaves_the_sync_batch_norm_layers_the_model_was_built_with():
    # They became local _BatchNormXd layers after the fit: the next fit synchronized them over the
    # whole world with the default backend, not over the user's group with theirs.
    plugin = SyncBatchNormPlugin()
    model = nn.Sequential(nn.BatchNorm1d(4), SyncBatchNorm(4, backend="reference"))
    own = model[1]
    converted = plugin.apply(model)
    pickle.loads(pickle.dumps(plugin))  # (ddp_spawn sends the plugin to its workers)
    reverted = plugin.revert(converted)
    assert type(reverted[0]) is nn.BatchNorm1d and reverted[1] is own and own.backend == "reference"


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"pass either `process_group` or `group_size`, not both"):
        SyncBatchNormPlugin(process_group=object(), group_size=2)
    with pytest.raises(
        ValueError, match=r"^SyncBatchNormPlugin: `group_size` must be an int >= 1 or None, got 0$"
    ):
        SyncBatchNormPlugin(group_size=0)
    with pytest.raises(TypeError, match=r"`group_size` must be an int >= 1 or None, got '2' \(str\)$"):
        SyncBatchNormPlugin(group_size="2")
    with pytest.raises(TypeError, match=r"`backend` must be a kernel backend name \(str\) or None, got 5"):
        SyncBatchNormPlugin(backend=5)
    with pytest.raises(TypeError, match=r"Plugin: `ddp_broadcast_buffers` must be a bool, got 'yes' \(str\)"):
        SyncBatchNormPlugin(ddp_broadcast_buffers="yes")
    with pytest.raises(
        TypeError, match=r"`process_group` must be a torch\.distributed\.ProcessGroup or None, got 'world'"
    ):
        SyncBatchNormPlugin(process_group="world")


@pytest.mark.parametrize("backend", ["nope", "auto", "Reference"])
def test_unknown_backend_raises_at_construction(backend):
    registered = sorted(available_backends())
    with pytest.raises(ValueError, match=r"`backend` must be a registered kernel backend \[") as info:
        SyncBatchNormPlugin(backend=backend)
    message = str(info.value)
    assert f"got {backend!r}" in message and "or None (automatic selection)" in message
    assert all(repr(name) in message for name in registered), message


def test_registered_backends_and_none_are_accepted():
    assert SyncBatchNormPlugin().backend is None
    for name in available_backends():  # validated by name only: nothing is built before apply
        assert SyncBatchNormPlugin(backend=name).backend == name
