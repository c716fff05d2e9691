"""Bad arguments across the public API: a ``TypeError``/``ValueError`` naming the argument at the call,
never a late crash inside; and the numbers the drop-ins' originals take (NumPy scalars, 0-dim tensors)
taken alike."""

import numpy as np
import pytest
import torch

from lightning_ext.amp import DynamicLossScaler
from lightning_ext.callbacks import PreciseBN, TrainingStats
from lightning_ext.nn import SyncBatchNorm, sync_batch_norm_stats, update_bn_stats
from lightning_ext.perf import GoodputLedger, count_flops, measure_peak_flops, peak_flops


def test_the_drop_ins_take_numpy_numbers_and_0_dim_tensors_as_their_originals_do():
    numbers = {"init_scale": torch.tensor(4.0), "growth_factor": np.float32(2), "growth_interval": np.int8(3)}
    ours, theirs = DynamicLossScaler("cpu", **numbers), torch.amp.GradScaler("cpu", **numbers)
    assert (ours.get_scale(), ours.get_growth_interval()) == (4.0, 3) == (float(theirs.get_scale()), 3)
    options = {"hysteresis": np.int64(2), "min_scale": np.float32(1.0), "max_scale": torch.tensor(8.0)}
    scaler = DynamicLossScaler("cpu", init_scale=4.0, **options)
    assert (scaler.hysteresis, scaler.min_scale, scaler.max_scale) == (2, 1.0, 8.0)
    for layer in (SyncBatchNorm, torch.nn.SyncBatchNorm):
        bn = layer(torch.tensor(3), eps=np.float32(1e-3), momentum=np.float64(0.25))
        assert bn.num_features == 3 and bn.eps == pytest.approx(1e-3) and bn.momentum == 0.25
    with pytest.raises(TypeError, match=r"`num_features` must be an int >= 1, got True \(bool\)"):
        SyncBatchNorm(np.True_)


def _bn():
    return torch.nn.BatchNorm1d(2)


def _forward(model, batch):
    return model(batch)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: update_bn_stats(_bn(), [], 0, _forward), ValueError, r"`num_iter` must be an int >= 1"),
        (lambda: update_bn_stats(3, [], 1, _forward), TypeError, r"`model` must be a torch.nn.Module, got 3"),
        (lambda: update_bn_stats(_bn(), 3, 1, _forward), TypeError, r"`batches` must be an iterable"),
        (lambda: update_bn_stats(_bn(), [], 1, None), TypeError, r"`forward_fn` must be callable"),
        (lambda: sync_batch_norm_stats(torch.ones(4, 2), sync="no"), TypeError, r"`sync` must be a bool"),
        (lambda: sync_batch_norm_stats(torch.ones(4, 2), process_group=1), TypeError, r"`process_group`"),
        (lambda: PreciseBN(data_loader="batches"), TypeError, r"`data_loader` must be an iterable of"),
        (lambda: TrainingStats(stats=None), TypeError, r"`stats` must be a sequence of names, not None"),
        (lambda: peak_flops(torch.float32, 3), TypeError, r"`device_name` must be a str or None, got 3"),
        (lambda: measure_peak_flops(device=None), TypeError, r"`device` must be a torch.device or a device"),
        (lambda: measure_peak_flops(device="foo"), ValueError, r"`device` must be a torch.device or a"),
        (lambda: measure_peak_flops(device="meta"), ValueError, r"`device` must be a CPU or an available"),
        (lambda: count_flops(3, torch.ones(1)), TypeError, r"`fn` must be callable"),
        (lambda: count_flops(_bn(), torch.ones(2, 2), backward="no"), TypeError, r"`backward` must be a"),
        (lambda: GoodputLedger(clock=None), TypeError, r"`clock` must be callable"),
    ],
)
def test_a_bad_argument_is_refused_at_the_call_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()
