"""``accumulate_moments_`` of every backend against float64 maths, within the bound of summing in
another order."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.conftest import backend_device

EPS64 = torch.finfo(torch.float64).eps
U32 = 2.0**-24  # float32 unit roundoff


def _fresh():
    return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)


def _order_bound(terms: torch.Tensor) -> float:
    """How far two float64 sums of ``terms`` in different orders (or trees) may differ: each has error at
    most (n - 1) * eps/2 * sum|terms| (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2),
    plus eps/2 * |term| each where a kernel rounds the term itself differently (e.g. an FMA for
    ``d * d``): n * eps * sum|terms| in all."""
    return terms.numel() * EPS64 * terms.abs().sum().item()


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64], ids=str
)
def test_accumulate_moments(backend, dtype):
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(4099, generator=gen, dtype=torch.float64) * 3 + 1000,  # large offset: shift matters
        # 5 interpreted blocks on 3 programs: several blocks per program, a partial last one.
        torch.randn(16389, generator=gen, dtype=torch.float64) * 2 + 990,
        torch.randn(7, 3, generator=gen, dtype=torch.float64).t() + 1000,  # non-contiguous
        torch.randn(1, generator=gen, dtype=torch.float64) + 1000,
        torch.randn(0, 5, generator=gen, dtype=torch.float64),  # empty: adds nothing
    ]
    xs = [((x * 10).round().to(dtype) if dtype == torch.int64 else x.to(dtype)).to(device) for x in xs]
    shift = xs[0].reshape(-1)[0].to(torch.float64)
    acc = _fresh().to(device)
    for x in xs:
        backend.accumulate_moments_(acc, x, shift)
    acc, shift = acc.cpu(), shift.cpu()
    allv = torch.cat([x.reshape(-1).double().cpu() for x in xs])
    d = allv - shift  # exact (Sterbenz: every value is within a factor 2 of the shift), on every backend
    assert acc[0].item() == allv.numel()
    # The kernels sum the same float64 terms as this truth in another order (blocks, lanes, atomics).
    b1, b2 = _order_bound(d), _order_bound(d * d)
    if backend.name == "cpu" and dtype.is_floating_point and dtype != torch.float64:
        # Float32 element arithmetic: d is exact here (Sterbenz), d*d is off by u*d^2, and a lane
        # sums at most 32 terms in float32 before float64 takes them (31u of their magnitudes).
        b1, b2 = b1 + 31 * U32 * d.abs().sum().item(), b2 + 32 * U32 * (d * d).sum().item()
    torch.testing.assert_close(acc[1], d.sum(), rtol=0, atol=b1)
    torch.testing.assert_close(acc[2], (d * d).sum(), rtol=0, atol=b2)
    assert acc[3].item() == allv.min().item() and acc[4].item() == allv.max().item()
    # The variance from the shifted sums is accurate despite the offset of 1000: var = (S2 - S1^2/n)/n
    # with |dS1| <= b1, |dS2| <= b2 gives |dvar| <= (b2 + (2|S1| b1 + b1^2) / n) / n, and the truth
    # (two-pass, float64) is within n * eps * var of the exact variance.
    n = acc[0].item()
    s1 = acc[1].item()
    var = (acc[2] - acc[1] ** 2 / n) / n
    truth = allv.var(unbiased=False)
    bound = (b2 + (2 * abs(s1) * b1 + b1 * b1) / n) / n + n * EPS64 * truth.item()
    torch.testing.assert_close(var, truth, rtol=0, atol=bound)


def test_accumulate_moments_keeps_previous_extremes_and_checks(backend):
    device = backend_device(backend)
    f64 = lambda *v: torch.tensor(v, dtype=torch.float64, device=device)
    z = f64(0.0).reshape(())
    acc = f64(2.0, 1.0, 5.0, -50.0, 50.0)
    backend.accumulate_moments_(acc, torch.tensor([3.0, 4.0], device=device), z)
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0]
    backend.accumulate_moments_(acc, torch.tensor([], device=device), z)
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0]
    backend.accumulate_moments_(acc, torch.tensor([float("nan")], device=device), z)
    assert acc[0].item() == 5.0 and math.isnan(acc[1].item()) and math.isnan(acc[2].item())
    z = torch.tensor(0.0, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`acc` must be a float64 tensor of shape \(5,\), got torch.float32"):
        backend.accumulate_moments_(torch.zeros(5), torch.ones(2), z)
    with pytest.raises(TypeError, match=r"`acc` must be a float64 tensor of shape \(5,\), got 'list'"):
        backend.accumulate_moments_([0.0] * 5, torch.ones(2), z)
    with pytest.raises(ValueError, match=r"`acc` must have shape \(5,\), got shape \(3,\)"):
        backend.accumulate_moments_(torch.zeros(3, dtype=torch.float64), torch.ones(2), z)
    with pytest.raises(TypeError, match=r"`x` must be a real \(float or integer\) tensor, got torch.bool"):
        backend.accumulate_moments_(_fresh(), torch.ones(2, dtype=torch.bool), z)
    with pytest.raises(TypeError, match=r"`shift` must be a float64 0-dim tensor, got torch.float32"):
        backend.accumulate_moments_(_fresh(), torch.ones(2), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"`shift` must be 0-dim, got shape \(1,\)"):
        backend.accumulate_moments_(_fresh(), torch.ones(2), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"`acc` \(meta\) and `shift` \(cpu\) must be on cpu"):
        backend.accumulate_moments_(_fresh().to("meta"), torch.ones(2), z)
