"""``update_bn_stats``: population statistics in float32 within bounds derived from the summation, the
state it restores, and on 2 ranks the union of the ranks' batches for synchronized layers and an error
raised on every rank at once. fvcore's own tests: ``tests/callbacks/test_fvcore_precise_bn_upstream.py``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ext.distributed import all_reduce_
from lightning_ext.nn import SyncBatchNorm, update_bn_stats
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


U32 = 2.0**-24  # float32 unit roundoff


def float32_bounds(conv: nn.Conv2d, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, how far float32 population statistics built from ``batches`` may be from
    :func:`population`: ``(tol_mean, tol_var)``, float64 ``(C,)``.

    The model: float32 conv outputs ``y``; per batch, BatchNorm's float32 mean and unbiased variance
    (summed in ANY order, around any shift ``|c| <= Y = max|y|``, e.g. a running mean), rounded to
    float32; merged across batches in float64; written back in float32. With ``u = 2**-24`` and a
    sum of ``k`` terms off by at most ``k·u·Σ|term|`` (Higham 2002, §4.2), per batch of ``n`` values:
    the conv (3 roundings of terms summing to at most ``S``) moves ``y`` by ``3u·S``; the mean is off by
    ``u·(Σ(|y| + Y) + 3S + 3Y)`` (sum, conv, shift/division/storage); ``m2`` by
    ``(n + 2)·u·Σ(|y - mean| + 2Y)² + 6u·S·n·max|y - mean|`` (shifted squares and cancellation, conv),
    the variance by that over ``n - 1`` plus ``u·var`` (storage). The merge's between-batch term takes
    the batch means' errors with weight ``2·n·|mean_b - mean|``; the result is stored with ``u``.
    """
    with torch.no_grad():
        w, b = conv.weight.double(), conv.bias.double()
        ys = [conv.double()(x.double()) for x in batches]  # (n, C, H, W) float64
        terms = [nn.functional.conv2d(x.double().abs(), w.abs(), b.abs()) for x in batches]  # sum of |terms|
    conv.float()
    flat = [y.transpose(0, 1).reshape(y.shape[1], -1) for y in ys]  # (C, n_b)
    big_s = torch.stack([t.transpose(0, 1).reshape(t.shape[1], -1).amax(1) for t in terms]).amax(0)
    big_y = torch.stack([f.abs().amax(1) for f in flat]).amax(0)
    mean, var = population(conv, batches)
    count = sum(f.shape[1] for f in flat)
    tol_means, weighted = [], torch.zeros_like(mean)
    for f in flat:
        n, mean_b = f.shape[1], f.mean(1, keepdim=True)
        dev = (f - mean_b).abs()
        d_mean = U32 * ((f.abs() + big_y[:, None]).sum(1) + 3 * big_s + 3 * big_y)
        d_m2 = (n + 2) * U32 * (dev + 2 * big_y[:, None]).square().sum(1) + 6 * U32 * big_s * n * dev.amax(1)
        d_var = d_m2 / (n - 1) + U32 * f.var(1, unbiased=True)
        weighted += (n - 1) * d_var + 2 * n * (mean_b[:, 0] - mean).abs() * d_mean
        tol_means.append(d_mean)
    tol_mean = torch.stack(tol_means).amax(0) + U32 * mean.abs()
    tol_var = weighted / (count - 1) + U32 * var
    return tol_mean, tol_var


def assert_population(layer: nn.Module, conv: nn.Conv2d, batches: list[torch.Tensor]) -> None:
    """``layer``'s running statistics are the population statistics within :func:`float32_bounds`."""
    mean, var = population(conv, batches)
    tol_mean, tol_var = float32_bounds(conv, batches)
    for name, got, want, tol in (
        ("running_mean", layer.running_mean, mean, tol_mean),
        ("running_var", layer.running_var, var, tol_var),
    ):
        error = (got.double() - want).abs()
        assert (error <= tol).all(), (
            f"{name}: {got.tolist()} vs {want.tolist()}, error {error.tolist()} > {tol.tolist()}"
        )


def forward_first(model, batch):
    return model(batch)


def test_update_bn_stats_gives_population_statistics_and_restores_state():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, momentum=0.3), nn.Dropout(0.5), nn.BatchNorm2d(3),
        nn.InstanceNorm2d(3, track_running_stats=True),
    )
    frozen = model[3].eval()  # eval-mode BatchNorm: not updated (as fvcore), stays in eval
    model[2].eval()
    model[4].eval()  # another norm layer with running statistics, frozen: stays so
    model[4].running_mean.uniform_()
    frozen_stats = [(m.running_mean.clone(), m.running_var.clone()) for m in (frozen, model[4])]
    batches = make_batches([5, 7, 3, 9, 4], seed=1)
    used = update_bn_stats(model, batches, num_iter=4, forward_fn=forward_first)
    assert used == 4
    bn = model[1]
    assert_population(bn, model[0], batches[:4])
    # An equal-weight mean of batch variances would be far off here (beyond the bound)
    _, var = population(model[0], batches[:4])
    naive_var = torch.stack([population(model[0], [b])[1] for b in batches[:4]]).mean(0)
    assert ((naive_var - var).abs() > 10 * float32_bounds(model[0], batches[:4])[1]).all()
    assert bn.momentum == 0.3 and int(bn.num_batches_tracked) == 0
    assert [m.training for m in model] == [True, True, False, False, False] and model.training
    torch.testing.assert_close([(m.running_mean, m.running_var) for m in (frozen, model[4])], frozen_stats)


def test_running_statistics_a_diverged_run_left_nan_are_recomputed():
    # PreciseBN is how a run repairs its BatchNorm statistics; at momentum 1 BatchNorm's own update is
    # 0 * old + batch, which kept every NaN (fvcore's too), with the batches counted as used.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    model[1].running_mean.fill_(float("nan"))
    model[1].running_var[1] = float("inf")
    batches = make_batches([5, 7, 3, 9], seed=2)
    assert update_bn_stats(model, batches, num_iter=4, forward_fn=forward_first) == 4
    assert_population(model[1], model[0], batches)


def test_update_bn_stats_without_batches_or_layers_changes_nothing():
    bn = nn.BatchNorm1d(2)
    assert update_bn_stats(bn, [], num_iter=5, forward_fn=forward_first) == 0
    assert torch.equal(bn.running_mean, torch.zeros(2)) and torch.equal(bn.running_var, torch.ones(2))
    assert update_bn_stats(nn.Linear(2, 2), [torch.ones(3, 2)], num_iter=5, forward_fn=forward_first) == 0


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
    # Synchronized: each step's batch statistics are those of both ranks' batches together.
    global_batches = [torch.cat(pair) for pair in zip(shards[0], shards[1])]
    for rank in (0, 1):
        used, running_mean, running_var, momentum = out[rank]["sync"]
        assert used == 3 and momentum == 0.2
        layer = nn.BatchNorm2d(3)
        layer.running_mean, layer.running_var = running_mean, running_var
        assert_population(layer, conv, global_batches)
        # plain BatchNorm: each rank's own population, same number of batches
        used, layer.running_mean, layer.running_var, _ = out[rank]["plain"]
        assert used == 3
        assert_population(layer, conv, shards[rank])


def _subgroup_worker(rank: int, world_size: int) -> tuple:
    """A SyncBatchNorm synchronized over a group of rank 0 alone: rank 1 is outside it (``new_group``
    gives it ``NON_GROUP_MEMBER``, which the layer takes, as torch's does)."""
    group = dist.new_group([0])
    torch.manual_seed(0)
    layer = SyncBatchNorm(3, momentum=0.2, process_group=group)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), layer)
    batches = make_batches(SIZES[rank], seed=10 + rank)
    used = update_bn_stats(model, batches, num_iter=10, forward_fn=forward_first)
    ones = torch.ones(2)
    all_reduce_(ones, group=group, async_op=True).wait()  # outside the group: nothing, as torch's all_reduce
    return used, layer.running_mean.clone(), layer.running_var.clone(), ones


@pytest.mark.timeout(180)
def test_a_rank_outside_a_synchronized_layers_group_takes_its_own_population():
    # Rank 1 raised "Invalid process group specified" (its all_reduce_ with the non-member group), and
    # rank 0 went on to wait in its next collective until the timeout.
    out = run_distributed(_subgroup_worker, 2, timeout=150)
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 1)
    for rank, (used, running_mean, running_var, ones) in enumerate(out):
        layer = nn.BatchNorm2d(3)
        layer.running_mean, layer.running_var = running_mean, running_var
        assert used == 3 and torch.equal(ones, torch.ones(2))  # (the ranks agree on their batches)
        assert_population(layer, conv, make_batches(SIZES[rank], seed=10 + rank)[:3])


def _skipped_layer_worker(rank: int, world_size: int) -> str:
    """Rank 1 skips its plain BatchNorm layer in the second forward: both ranks must raise there."""
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3))
    calls = itertools.count()

    def forward(m, batch):
        return m[0](batch) if rank == 1 and next(calls) == 1 else m(batch)

    with pytest.raises(RuntimeError) as info:
        update_bn_stats(model, make_batches([4, 4, 4], seed=rank), num_iter=3, forward_fn=forward)
    return str(info.value)


@pytest.mark.timeout(180)
def test_a_layer_failing_on_one_rank_raises_on_every_rank_without_a_hang():
    out = run_distributed(_skipped_layer_worker, 2, timeout=150)
    assert out[1] == (
        "PreciseBN: BatchNorm layer 0 (BatchNorm2d) ran 0 times in one forward; each layer must run once"
    )
    assert out[0] == "PreciseBN: a BatchNorm layer failed on another rank"


@pytest.mark.parametrize("failure", ["forward", "twice"])
def test_a_failed_update_leaves_the_running_statistics_it_found(failure):
    # The first batches' statistics (written at momentum 1) stayed in the buffers, and an
    # OnExceptionCheckpoint saved them as the trained model's.
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    bn.running_mean.fill_(10.0), bn.running_var.fill_(4.0)
    data = [torch.randn(8, 3) for _ in range(4)]

    def forward(model, batch):
        if failure == "forward" and batch is data[2]:
            raise KeyboardInterrupt  # (Ctrl-C during a long update)
        model(batch)
        if failure == "twice":
            model(batch)

    with pytest.raises(KeyboardInterrupt if failure == "forward" else RuntimeError):
        update_bn_stats(bn, data, num_iter=4, forward_fn=forward)
    assert torch.equal(bn.running_mean, torch.full((3,), 10.0))
    assert torch.equal(bn.running_var, torch.full((3,), 4.0))
    assert bn.momentum == 0.1 and bn.training
