"""``accumulate_moments_`` of every backend against float64 maths."""

from __future__ import annotations

import math

import pytest
import torch


def _fresh():
    return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64], ids=str
)
def test_accumulate_moments(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(4099, generator=gen, dtype=torch.float64) * 3 + 1000,  # large offset: shift matters
        # 5 interpreted blocks on 3 programs: several blocks per program, a partial last one.
        torch.randn(16389, generator=gen, dtype=torch.float64) * 2 + 990,
        torch.randn(7, 3, generator=gen, dtype=torch.float64).t() + 1000,  # non-contiguous
        torch.randn(1, generator=gen, dtype=torch.float64) + 1000,
        torch.randn(0, 5, generator=gen, dtype=torch.float64),  # empty: adds nothing
    ]
    xs = [(x * 10).round().to(dtype) if dtype == torch.int64 else x.to(dtype) for x in xs]
    shift = xs[0].reshape(-1)[0].to(torch.float64)
    acc = _fresh()
    for x in xs:
        backend.accumulate_moments_(acc, x, shift)
    allv = torch.cat([x.reshape(-1).double() for x in xs])
    d = allv - shift
    assert acc[0].item() == allv.numel()
    torch.testing.assert_close(acc[1], d.sum(), rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(acc[2], (d * d).sum(), rtol=1e-12, atol=1e-9)
    assert acc[3].item() == allv.min().item() and acc[4].item() == allv.max().item()
    # The variance from the shifted sums is accurate despite the offset of 1000.
    n = acc[0]
    var = (acc[2] - acc[1] ** 2 / n) / n
    torch.testing.assert_close(var, allv.var(unbiased=False), rtol=1e-9, atol=1e-12)


def test_accumulate_moments_keeps_previous_extremes_and_checks(backend):
    acc = torch.tensor([2.0, 1.0, 5.0, -50.0, 50.0], dtype=torch.float64)
    backend.accumulate_moments_(acc, torch.tensor([3.0, 4.0]), torch.tensor(0.0, dtype=torch.float64))
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0]
    backend.accumulate_moments_(acc, torch.tensor([]), torch.tensor(0.0, dtype=torch.float64))
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0]
    backend.accumulate_moments_(acc, torch.tensor([float("nan")]), torch.tensor(0.0, dtype=torch.float64))
    assert acc[0].item() == 5.0 and math.isnan(acc[1].item()) and math.isnan(acc[2].item())
    z = torch.tensor(0.0, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`acc` must be a float64 tensor of shape \(5,\), got torch.float32"):
        backend.accumulate_moments_(torch.zeros(5), torch.ones(2), z)
    with pytest.raises(ValueError, match=r"`acc` must have shape \(5,\), got shape \(3,\)"):
        backend.accumulate_moments_(torch.zeros(3, dtype=torch.float64), torch.ones(2), z)
    with pytest.raises(TypeError, match=r"`x` must be a real \(float or integer\) tensor, got torch.bool"):
        backend.accumulate_moments_(acc, torch.ones(2, dtype=torch.bool), z)
    with pytest.raises(TypeError, match=r"`shift` must be a float64 0-dim tensor, got torch.float32"):
        backend.accumulate_moments_(acc, torch.ones(2), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"`shift` must be 0-dim, got shape \(1,\)"):
        backend.accumulate_moments_(acc, torch.ones(2), torch.zeros(1, dtype=torch.float64))
