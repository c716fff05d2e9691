"""SyncBatchNorm's training path on every kernel backend against the ``reference`` backend.

All backends compute the same thing with different summation orders and rounding points: outputs,
input/weight/bias gradients and running statistics must agree to a few units in the last place of
their dtype, ``num_batches_tracked`` and the collectives exactly, over several training steps, for
every input rank, dtype and memory format, empty local batches, rows longer than a summation block,
``momentum=None``, float64 modules and non-dense upstream gradients. The group is simulated in one
process by an ``all_reduce_`` that adds a fixed "other rank" to every reduction (its moments payload
is a consistent one for any shift: mean = shift, M2 > 0), so the global-count arithmetic is exercised,
not only the one-rank case. Multi-process runs against one-process float64 BatchNorm are in
``test_sync_batch_norm.py`` and ``test_sync_batch_norm_upstream.py``.
"""

from __future__ import annotations

import pytest
import torch

import lightning_ext.nn.sync_batch_norm as sbn
from lightning_ext.nn import SyncBatchNorm
from tests.kernels.conftest import BACKENDS, make_backend

C = 3
OTHER_COUNT = 7.0  # elements per channel of the simulated other rank

# (shape, dtype, channels_last, momentum, affine, module dtype)
CASES = [
    ((5, C), torch.float32, False, 0.1, True, torch.float32),
    ((4, C, 7), torch.bfloat16, False, None, True, torch.float32),
    ((3, C, 5, 4), torch.float16, False, 0.1, False, torch.float32),
    ((3, C, 5, 4), torch.bfloat16, True, 0.1, True, torch.float32),
    ((2, C, 3, 2, 4), torch.float32, True, None, True, torch.float32),
    ((4, C, 2, 3), torch.float64, False, 0.1, True, torch.float64),
    ((8, C, 64, 48), torch.float32, False, 0.1, True, torch.float32),
    ((0, C, 4, 4), torch.bfloat16, False, 0.1, True, torch.float32),  # empty on this rank
    ((0, C), torch.float32, False, None, True, torch.float32),
    ((1, C), torch.float32, False, 0.1, True, torch.float32),  # one value here, more in the group
    ((3, C, 4099), torch.float32, False, 0.1, True, torch.float32),  # rows longer than a 2048 block
    ((5, C, 9, 17), torch.bfloat16, True, 0.1, True, torch.float32),  # 765 rows: several row tasks
]

# Largest difference allowed between two backends, relative to the largest magnitude of the tensor:
# a few units in the last place of its dtype (the backends round at different points).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 2e-5, torch.float64: 1e-12}


def assert_agree(
    a: torch.Tensor, b: torch.Tensor, what: str = "", rounding: torch.dtype | None = None
) -> None:
    """``rounding``: a lower precision the values inherit (float32 gradients of bfloat16 data)."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), what
    if a.dtype == torch.int64 or a.numel() == 0:
        assert torch.equal(a, b), what
        return
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), what
    scale = b.double().abs().max().item()
    err = (a.double() - b.double()).abs().max().item()
    tol = max(TOLERANCE[a.dtype], TOLERANCE[rounding or a.dtype])
    assert err <= tol * max(scale, 1e-6), f"{what}: max difference {err:.3g} (scale {scale:.3g})"


def _fake_group(monkeypatch, channels: int) -> list[str]:
    """Simulate a second rank: every all_reduce adds its fixed contribution; returns the call log."""
    g = torch.Generator().manual_seed(7)
    moments = torch.zeros(2 * channels + 1, dtype=torch.float64)
    moments[0] = OTHER_COUNT
    moments[channels + 1 :] = OTHER_COUNT * (0.5 + torch.rand(channels, generator=g, dtype=torch.float64))
    grad_sums = torch.randn(2 * channels, generator=g)
    calls: list[str] = []

    def all_reduce_(t, group=None):
        forward = t.numel() == 2 * channels + 1
        calls.append("moments" if forward else "grad_sums")
        other = moments if forward else grad_sums
        t.add_(other.to(t.device, t.dtype))  # in place, as torch.distributed.all_reduce

    monkeypatch.setattr(sbn, "all_reduce_", all_reduce_)
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "get_process_group", lambda group=None: object())
    monkeypatch.setattr(sbn, "get_world_size", lambda group=None: 2)
    return calls


def _train(case, backend: str, monkeypatch, steps: int = 3, dense_dy: bool = True):
    shape, dtype, channels_last, momentum, affine, module_dtype = case
    calls = _fake_group(monkeypatch, C)
    bn = SyncBatchNorm(C, momentum=momentum, affine=affine, backend=backend).to(module_dtype)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = (2.0 + 3.0 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        x.requires_grad_(True)
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        y = bn(x)
        if dense_dy:
            y.backward(dy)
        else:
            y.sum().backward()  # an expanded, stride-0 upstream gradient
        grads = [x.grad] + [p.grad.clone() for p in bn.parameters()]
        bn.zero_grad(set_to_none=True)
        out.append([y.detach(), *grads])
        if step == 0:
            assert y.dtype == dtype and y.shape == x.shape
            if channels_last and x.numel():
                fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
                assert y.is_contiguous(memory_format=fmt)
    state = [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]
    return out, state, calls


def _compare(case, backend, monkeypatch, **kwargs) -> None:
    make_backend(backend)  # skips where the backend cannot exist here
    with monkeypatch.context() as m:
        out_b, state_b, calls_b = _train(case, backend, m, **kwargs)
    with monkeypatch.context() as m:
        out_r, state_r, calls_r = _train(case, "reference", m, **kwargs)
    assert calls_b == calls_r  # the same collectives in the same order
    assert len(calls_b) == 2 * len(out_b)  # one per direction and step
    for step, (step_b, step_r) in enumerate(zip(out_b, out_r)):
        for what, a, b in zip(("y", "dx", "dweight", "dbias"), step_b, step_r):
            assert_agree(a, b, f"step {step} {what}")
    for what, a, b in zip(("running_mean", "running_var", "num_batches_tracked"), state_b, state_r):
        assert_agree(a, b, what)
    assert int(state_b[2]) == len(out_b)


OTHERS = [b for b in BACKENDS if b != "reference"]


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{tuple(c[0])}-{c[1]}-cl{int(c[2])}-m{c[3]}-{c[5]}")
def test_backends_agree_with_reference(case, backend, monkeypatch):
    _compare(case, backend, monkeypatch)


@pytest.mark.parametrize("backend", OTHERS)
def test_non_dense_upstream_gradient(backend, monkeypatch):
    case = ((3, C, 5, 4), torch.bfloat16, True, 0.1, True, torch.float32)
    _compare(case, backend, monkeypatch, steps=1, dense_dy=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_collective_in_backward_without_input_gradient(backend, monkeypatch):
    """A layer whose input needs no gradient (e.g. the first layer) skips the backward all_reduce on
    every rank alike, and still returns the local weight/bias gradients."""
    make_backend(backend)
    calls = _fake_group(monkeypatch, C)
    bn = SyncBatchNorm(C, backend=backend)
    x = torch.randn(4, C, 3, generator=torch.Generator().manual_seed(1))
    bn(x).pow(2).sum().backward()
    assert calls == ["moments"]
    assert bn.weight.grad is not None and bn.bias.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_is_refused_not_silently_wrong(backend, monkeypatch):
    """The backward is not itself differentiable: ``create_graph=True`` raises instead of returning
    gradients whose second derivatives would silently be missing."""
    make_backend(backend)
    _fake_group(monkeypatch, C)
    bn = SyncBatchNorm(C, backend=backend)
    x = torch.randn(4, C, 3, generator=torch.Generator().manual_seed(6), requires_grad=True)
    (grad,) = torch.autograd.grad(bn(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()
    (grad,) = torch.autograd.grad(bn(x).pow(2).sum(), x)  # a plain backward works
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_raises_on_one_value_per_channel_in_the_group(backend, monkeypatch):
    make_backend(backend)
    monkeypatch.setattr(sbn, "all_reduce_", lambda t, group=None: None)
    monkeypatch.setattr(sbn, "is_distributed", lambda: True)
    monkeypatch.setattr(sbn, "get_process_group", lambda group=None: object())
    monkeypatch.setattr(sbn, "get_world_size", lambda group=None: 2)
    bn = SyncBatchNorm(C, backend=backend)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, C))
    assert torch.equal(bn.running_mean, torch.zeros(C))  # nothing updated
    assert int(bn.num_batches_tracked) == 1  # counted before the check, as torch's BatchNorm does


@pytest.mark.parametrize("backend", OTHERS)
def test_strided_buffers_and_weight(backend, monkeypatch):
    """Running buffers and parameters that are views with a stride are read and updated in place."""
    make_backend(backend)
    results = {}
    for name in (backend, "reference"):
        with monkeypatch.context() as m:
            _fake_group(m, C)
            bn = SyncBatchNorm(C, backend=name)
            storage = torch.arange(4.0 * C).view(C, 4)  # columns are strided (C,) views
            bn._buffers["running_mean"] = storage[:, 1]
            bn._buffers["running_var"] = storage[:, 2]
            with torch.no_grad():
                storage[:, 2] += 1.0
            weight = torch.randn(C, 2, generator=torch.Generator().manual_seed(3))[:, 0]
            bn.weight = torch.nn.Parameter(weight)
            x = torch.randn(5, C, 4, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
            x.requires_grad_(True)
            y = bn(x)
            y.float().pow(2).sum().backward()
            assert not bn.running_mean.is_contiguous()
            results[name] = (y.detach(), x.grad, bn.weight.grad, storage.clone())
    # The upstream gradient 2y is bfloat16: the float32 weight gradient inherits its rounding.
    for what, a, b in zip(("y", "dx", "dweight", "buffers"), results[backend], results["reference"]):
        assert_agree(a, b, what, rounding=torch.bfloat16 if what == "dweight" else None)
    assert not torch.equal(results[backend][3][:, 1], torch.arange(1.0, 4.0 * C, 4))  # updated in place
