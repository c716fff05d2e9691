import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import PreciseBN
from lightning_ext.callbacks.precise_bn import update_bn_stats
from lightning_ext.nn import SyncBatchNorm
from tests.helpers.distributed import run_distributed


def make_batches(sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Batches of shape (n, 2, 4, 4) whose means differ, so the between-batch spread matters."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, 4, 4, generator=g) * (1 + i) + 3 * i for i, n in enumerate(sizes)]


def population(conv: nn.Conv2d, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance per channel of the conv outputs over all batches, in float64."""
    with torch.no_grad():
        y = torch.cat([conv.double()(b.double()) for b in batches])
    conv.float()
    flat = y.transpose(0, 1).reshape(y.shape[1], -1)
    return flat.mean(1), flat.var(1, unbiased=True)


def forward_first(model, batch):
    return model(batch)


def test_update_bn_stats_gives_population_statistics_and_restores_state():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, momentum=0.3), nn.Dropout(0.5), nn.BatchNorm2d(3)
    )
    frozen = model[3].eval()  # eval-mode BatchNorm: not updated (as fvcore), stays in eval
    model[2].eval()
    frozen_stats = (frozen.running_mean.clone(), frozen.running_var.clone())
    batches = make_batches([5, 7, 3, 9, 4], seed=1)
    used = update_bn_stats(model, batches, num_iter=4, forward_fn=forward_first)
    assert used == 4
    mean, var = population(model[0], batches[:4])
    bn = model[1]
    torch.testing.assert_close(bn.running_mean.double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_var.double(), var, atol=1e-5, rtol=1e-5)
    # fvcore's equal-weight average of batch statistics would be far off here
    naive_var = torch.stack([population(model[0], [b])[1] for b in batches[:4]]).mean(0)
    assert (naive_var - var).abs().max() > 1.0
    assert bn.momentum == 0.3 and int(bn.num_batches_tracked) == 0
    assert [m.training for m in model] == [True, True, False, False] and model.training
    torch.testing.assert_close((frozen.running_mean, frozen.running_var), frozen_stats)


def test_update_bn_stats_without_batches_or_layers_changes_nothing():
    bn = nn.BatchNorm1d(2)
    assert update_bn_stats(bn, [], num_iter=5, forward_fn=forward_first) == 0
    assert torch.equal(bn.running_mean, torch.zeros(2)) and torch.equal(bn.running_var, torch.ones(2))
    assert update_bn_stats(nn.Linear(2, 2), [torch.ones(3, 2)], num_iter=5, forward_fn=forward_first) == 0


class BNModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 1)
        self.bn = nn.BatchNorm2d(3)

    @override
    def forward(self, x):
        return self.bn(self.conv(x))

    @override
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).square().mean()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(hook, max_steps=-1, max_epochs=None):
    data = torch.cat(make_batches([6] * 5, seed=2))
    module = BNModule()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        max_epochs=max_epochs,
        callbacks=[hook],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=6))
    return module, data


def test_hook_every_epoch_on_the_training_loader():
    hook = PreciseBN(num_iter=5)
    module, data = fit(hook, max_epochs=2)
    assert hook.batches_used == [5, 5]  # after the last batch of each epoch; nothing left at train end
    mean, var = population(module.conv, [data])
    torch.testing.assert_close(module.bn.running_mean.double(), mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(module.bn.running_var.double(), var, atol=1e-5, rtol=1e-5)
    assert module.bn.momentum == 0.1 and module.training


def test_hook_with_period_and_callable_loader():
    batches = make_batches([4, 8, 5], seed=3)
    hook = PreciseBN(period=3, num_iter=2, data_loader=lambda: [(b,) for b in batches])
    module, _ = fit(hook, max_steps=7)
    assert hook.batches_used == [2, 2, 2]  # after iterations 2 and 5, and at train end (step 7)
    assert hook.state_dict() == {"last_update_step": 7}
    mean, var = population(module.conv, batches[:2])
    torch.testing.assert_close(module.bn.running_var.double(), var, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(module.bn.running_mean.double(), mean, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"period": 0},
            ValueError,
            r"`period` must be a positive int or None \(every epoch\), got 0",
        ),
        ({"num_iter": -2}, ValueError, r"PreciseBN: `num_iter` must be a positive int, got -2"),
        (
            {"data_loader": 5},
            TypeError,
            r"PreciseBN: `data_loader` must be an iterable of batches, .* got 5$",
        ),
        (
            {"forward_fn": "model"},
            TypeError,
            r"`forward_fn` must be callable or None, got 'model'",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        PreciseBN(**kwargs)


def test_callable_loader_returning_non_iterable():
    with pytest.raises(
        TypeError, match=r"PreciseBN: `data_loader\(\)` must return an iterable of batches, got 3"
    ):
        fit(PreciseBN(period=2, data_loader=lambda: 3), max_steps=2)


# ------------------------------------------------------------------------------------------ 2 processes

SIZES = {0: [4, 2, 5], 1: [6, 3, 1, 7]}  # rank 1's fourth batch has no partner: it must be skipped


def _precise_bn_worker(rank: int, world_size: int) -> dict:
    results = {}
    for name, layer in (("sync", SyncBatchNorm(3, momentum=0.2)), ("plain", nn.BatchNorm2d(3, momentum=0.2))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 1), layer)
        used = update_bn_stats(
            model, make_batches(SIZES[rank], seed=10 + rank), num_iter=10, forward_fn=forward_first
        )
        results[name] = (used, layer.running_mean.clone(), layer.running_var.clone(), layer.momentum)
    return results


@pytest.mark.timeout(180)
def test_sync_batchnorm_population_over_two_ranks():
    out = run_distributed(_precise_bn_worker, 2, timeout=150)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 1)
    shards = {r: make_batches(SIZES[r], seed=10 + r)[:3] for r in (0, 1)}
    mean, var = population(conv, shards[0] + shards[1])
    for rank in (0, 1):
        used, running_mean, running_var, momentum = out[rank]["sync"]
        assert used == 3 and momentum == 0.2
        torch.testing.assert_close(running_mean.double(), mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(running_var.double(), var, atol=1e-5, rtol=1e-5)
        # plain BatchNorm: each rank's own population, same number of batches
        used, running_mean, running_var, _ = out[rank]["plain"]
        local_mean, local_var = population(conv, shards[rank])
        assert used == 3
        torch.testing.assert_close(running_mean.double(), local_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(running_var.double(), local_var, atol=1e-5, rtol=1e-5)
