# Copyright (c) Facebook, Inc. and its affiliates. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
# http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Modified for lightning_ext (Apache-2.0, section 4(b)): ported to pytest and to this project's
# ``update_bn_stats`` and ``PreciseBN``; every change is marked "ADAPTED:" below.

"""fvcore's PreciseBN tests, ported against ``update_bn_stats`` and the ``PreciseBN`` hook.

Ported from facebookresearch/fvcore ``tests/test_precise_bn.py``, which tests
``fvcore/nn/precise_bn.py``; the licence notice above
is fvcore's (``LICENSE``: Apache-2.0, "Copyright 2019, Facebook, Inc", and the file's own header).

Upstream test -> test here, each run through three entries (``ENTRIES``): our ``update_bn_stats``
(the plain-loop/functional entry), a ``PreciseBN`` hook driven by ``HookRunner`` in a plain loop, and
a ``PreciseBN`` hook in a ``lightning.Trainer``:

- ``TestPreciseBN.compute_bn_stats`` -> ``compute_bn_stats`` (the same maths)
- ``test_precise_bn`` -> same name, parametrized over its three BatchNorm types and the entries
- ``test_precise_bn_insufficient_data`` -> same name, parametrized over the entries

What changed, and only that (each marked ``ADAPTED:``): ``unittest.TestCase`` -> pytest functions, the
loop over BatchNorm types -> a parametrization that replays upstream's random stream (seed 42), so each
case sees upstream's exact data; float32 -> float64 (the data drawn as upstream in float32, then widened
exactly) so that the comparison is exact up to rounding, with a tolerance derived from the summation
bound instead of ``np.allclose``'s float32 defaults; our call signature; and, where ours differs on
purpose (see ``update_bn_stats``), our documented behaviour: the running variance is the UNBIASED
variance of all elements (fvcore: biased), ``num_batches_tracked`` is restored (fvcore: advanced by
``num_iters``), and a loader shorter than ``num_iter`` gives the statistics of the batches it has
(fvcore: ``AssertionError``, momenta left at 1).

Not ported: nothing (the upstream file has these two tests). fvcore's tests are single-process; the
union-of-ranks statistic of ``SyncBatchNorm`` layers over uneven ranks is
``tests/nn/test_precise_bn.py::test_sync_batchnorm_population_over_two_ranks``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_ext.callbacks import HookRunner, PreciseBN
from lightning_ext.nn import update_bn_stats
from tests.helpers.hooks import one_iteration

# ADAPTED: upstream's loop over these three lists -> one parametrized case per BatchNorm type.
_bn_types = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d]
_stats_dims = [[0, 2], [0, 2, 3], [0, 2, 3, 4]]
_input_dims = [(16, 8, 24), (16, 8, 24, 8), (16, 8, 4, 12, 6)]
assert len({len(_bn_types), len(_stats_dims), len(_input_dims)}) == 1
# Number of batches to test.
NB = 8

# ADAPTED: the three entries under test (upstream has one: fvcore's update_bn_stats).
ENTRIES = ["update_bn_stats", "HookRunner", "Trainer"]

U64 = 2.0**-53  # float64 unit roundoff


def upstream_tensors(case: int) -> list[torch.Tensor]:
    """ADAPTED: the ``NB`` tensors upstream's ``test_precise_bn`` draws for its ``case``-th BatchNorm
    type: its ``setUp`` seeds 42, then its loop draws ``NB`` float32 ``randn`` tensors per type in order
    (the models draw nothing). Widened to float64 (exactly)."""
    torch.manual_seed(42)
    drawn = [[torch.randn(input_dim) for _ in range(NB)] for input_dim in _input_dims]
    return [t.double() for t in drawn[case]]


def compute_bn_stats(
    tensors: list[torch.Tensor], dims: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    Given a list of random initialized tensors, compute the mean and
        variance.
    Args:
        tensors (list): list of randomly initialized tensors.
        dims (list): list of dimensions to compute the mean and variance.

    ADAPTED: returns tensors (upstream: numpy arrays), compared with ``torch.testing.assert_close``.
    """
    mean = torch.stack([tensor.mean(dim=dims) for tensor in tensors]).mean(dim=0)
    mean_of_batch_var = torch.stack([tensor.var(dim=dims, unbiased=True) for tensor in tensors]).mean(dim=0)
    var = torch.cat(tensors, dim=0).var(dim=dims, unbiased=False)
    return mean, mean_of_batch_var, var


def assert_exact(got: torch.Tensor, want: torch.Tensor, count: int) -> None:
    """ADAPTED (upstream: ``np.allclose`` with its float32-sized defaults ``rtol=1e-5, atol=1e-8``):
    float64 ``got`` and ``want`` are the same quantity, each computed from ``count`` elements per
    channel by sums of at most ``count`` terms, whose rounding error is at most ``count·u·Σ|term|``
    (Higham 2002, §4.2); merging a few batch statistics adds a few ``u``. So a variance is off by at
    most ``count·u`` relatively on each side, and a mean of standard-normal data (``mean|x| < 1``) by
    at most ``count·u`` absolutely: ``rtol = atol = 2·count·u``. That is ``< 1e-11`` here, far below the
    ``1/(count-1) > 2.7e-5`` between the biased and the unbiased variance."""
    tol = 2 * count * U64
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


class _Wrapper(L.LightningModule):
    """ADAPTED: the LightningModule a Trainer needs around upstream's bare BatchNorm model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self(x).square().mean()

    @override
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # lr=0: training leaves the weights alone


def run_precise_bn(
    entry: str, model: nn.Module, make_loader: Callable[[], Iterable[torch.Tensor]], num_iters: int
) -> int:
    """ADAPTED: upstream's ``update_bn_stats(model, data_loader, num_iters)`` through one of ``ENTRIES``;
    returns the number of batches used. The hooks run ``PreciseBN(every_n_train_steps=None)`` once,
    after the last iteration of a one-iteration epoch (one training forward of the loader's first
    batch, lr=0, so ``num_batches_tracked`` gains 1 and the weights stay), with
    ``data_loader=make_loader``."""
    if entry == "update_bn_stats":
        return update_bn_stats(model, make_loader(), num_iters, forward_fn=lambda m, batch: m(batch))
    hook = PreciseBN(num_iter=num_iters, data_loader=make_loader)
    x = next(iter(make_loader()))
    if entry == "HookRunner":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with HookRunner([hook], model) as runner:
            runner.before_epoch()
            one_iteration(runner, model, optimizer, x, is_last_batch=True)
    else:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision="64-true",
            max_epochs=1,
            callbacks=[hook],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(_Wrapper(model), DataLoader(TensorDataset(x), batch_size=len(x)))
    assert len(hook.batches_used) == 1  # once at the epoch's end; none more at train end
    return hook.batches_used[0]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", range(len(_bn_types)), ids=[t.__name__ for t in _bn_types])
def test_precise_bn(case: int, entry: str) -> None:
    # ADAPTED: one BatchNorm type per case (upstream: a loop), in float64 (upstream: float32).
    bn, stats_dim, input_dim = _bn_types[case], _stats_dims[case], _input_dims[case]
    model = bn(input_dim[1]).double()
    model.train()
    tensors = upstream_tensors(case)
    # ADAPTED: `_mean_of_batch_var` (fvcore's former estimator) is unused, as upstream.
    mean, _mean_of_batch_var, var = compute_bn_stats(tensors, stats_dim)
    # ADAPTED: the elements per channel of all batches, for the tolerance and the unbiased variance.
    count = NB * (torch.Size(input_dim).numel() // input_dim[1])
    # ADAPTED (deliberate difference): our running_var is the UNBIASED variance of all elements, what
    # BatchNorm's running_var estimates; fvcore writes the biased `var`.
    unbiased_var = var * count / (count - 1)
    trained = 0 if entry == "update_bn_stats" else 1  # ADAPTED: training forwards per run_precise_bn

    old_weight = model.weight.detach().clone()

    used = run_precise_bn(entry, model, lambda: itertools.cycle(tensors), len(tensors))
    assert used == len(tensors)  # ADAPTED: ours returns the number of batches used
    assert_exact(model.running_mean, mean, count)
    assert_exact(model.running_var, unbiased_var, count)
    # ADAPTED (deliberate difference): ours restores num_batches_tracked and momentum (fvcore restores
    # the momentum and advances num_batches_tracked by num_iters).
    assert int(model.num_batches_tracked) == trained and model.momentum == 0.1

    # Test that the new estimator can handle varying batch size
    # It should obtain same results as earlier if the same input data are
    # split into different batch sizes.
    tensors = torch.split(torch.cat(tensors, dim=0), [2, 2, 4, 8, 16, 32, 64])
    used = run_precise_bn(entry, model, lambda: itertools.cycle(tensors), len(tensors))
    assert used == len(tensors)
    assert_exact(model.running_mean, mean, count)
    assert_exact(model.running_var, unbiased_var, count)
    assert int(model.num_batches_tracked) == 2 * trained and model.momentum == 0.1
    torch.testing.assert_close(model.weight.detach(), old_weight, rtol=0, atol=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_precise_bn_insufficient_data(entry: str) -> None:
    input_dim = (16, 32, 24, 24)
    model = nn.BatchNorm2d(input_dim[1]).double()  # ADAPTED: float64, as above
    model.train()
    torch.manual_seed(42)  # ADAPTED: upstream's setUp
    tensor = torch.randn(input_dim).double()
    # ADAPTED (deliberate difference): fvcore raises AssertionError after the 10 forwards, before it
    # writes the statistics or restores the momenta (left at 1.0). Ours uses the 10 batches there are:
    # update_bn_stats returns 10, the hook also warns; the statistics are those of the 10 batches and
    # the momentum is restored.
    if entry == "update_bn_stats":
        used = run_precise_bn(entry, model, lambda: itertools.repeat(tensor, 10), 20)
    else:
        with pytest.warns(UserWarning, match=r"PreciseBN: only 10 of num_iter=20 batches were available"):
            used = run_precise_bn(entry, model, lambda: itertools.repeat(tensor, 10), 20)
    assert used == 10
    union = torch.cat([tensor] * 10)
    count = union.numel() // input_dim[1]
    assert_exact(model.running_mean, union.mean(dim=[0, 2, 3]), count)
    assert_exact(model.running_var, union.var(dim=[0, 2, 3], unbiased=True), count)
    assert model.momentum == 0.1
