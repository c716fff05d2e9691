"""``unscale_and_check_`` and ``check_finite`` of every backend against float64 maths and GradScaler's
ATen op; the Triton launcher's multi-tensor table."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.conftest import backend_device, make_backend


def _triton_device() -> torch.device:
    """Where the Triton launcher tests run: CUDA, else CPU tensors in Triton's interpreter."""
    return backend_device(make_backend("triton"))


def _grads(seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 100 + 3
    return [
        r(1023).float(),  # odd size, several blocks in the compiled kernel
        r(7, 33).half(),
        r(5, 3).bfloat16().t(),  # transposed: dense, not contiguous
        r(9, 6).float()[:, ::2],  # sliced: not dense (reference path)
        r(0).float(),  # empty
        r(4, 3, 5, 2).float().to(memory_format=torch.channels_last),
        r(3).double(),
        r(1).float(),
    ]


POISONS = [(None, 0)] + [(p, w) for p in ("inf", "-inf", "nan") for w in (0, 1, 2, 3, 6)]


@pytest.mark.parametrize(("poison", "where"), POISONS)
def test_unscale_and_check(backend, poison, where):
    device = backend_device(backend)
    grads = [g.to(device) for g in _grads(seed=where)]
    if poison is not None:
        g = grads[where]
        g[tuple(int(i) for i in torch.unravel_index(torch.tensor(g.numel() // 2), g.shape))] = float(poison)
    expected_grads = [g.clone() for g in grads]
    strides = [g.stride() for g in grads]
    originals = [g.double().cpu().clone() for g in grads]
    inv_scale = torch.tensor(1.0 / 3.0, device=device)

    found = backend.run("unscale_and_check_", grads, inv_scale)

    assert found.dtype == torch.float32 and found.shape == () and found.device == inv_scale.device
    assert found.item() == (0.0 if poison is None else 1.0)
    # The same product as GradScaler's op, element by element, incl. inf/NaN propagation.
    flag = torch.zeros((), device=device)
    for g in expected_grads:
        torch._amp_foreach_non_finite_check_and_unscale_([g], flag, inv_scale)
    assert flag.item() == found.item()
    interpreted = backend.name == "triton" and device.type == "cpu"
    for i, (g, e, o) in enumerate(zip(grads, expected_grads, originals)):
        assert g.dtype == e.dtype and g.stride() == strides[i], i
        # Triton's interpreter converts float32 -> bfloat16 by truncation (numpy has no bfloat16; GPUs
        # round to nearest even): there, one bfloat16 ulp apart from ATen is the expected result.
        rtol = torch.finfo(g.dtype).eps if g.dtype == torch.bfloat16 and interpreted else 0
        torch.testing.assert_close(
            g, e, atol=0, rtol=rtol, equal_nan=True, msg=lambda m, i=i: f"tensor {i}: {m}"
        )
        finite = o.isfinite()
        ulp = torch.finfo(g.dtype).eps
        truth = o * inv_scale.double().cpu()
        err = (g.double().cpu() - truth)[finite].abs()
        assert bool((err <= ulp * truth[finite].abs()).all()), f"tensor {i}: error {err.max()}"


def test_unscale_empty_list(backend):
    device = backend_device(backend)
    found = backend.run("unscale_and_check_", [], torch.tensor(0.5, device=device))
    assert found.item() == 0.0 and found.dtype == torch.float32 and found.device == device


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["large", "small"])
def test_check_finite_reads_without_writing(backend, dtype, bad, where):
    """``check_finite`` flags exactly the inf/NaN that GradScaler's op flags and leaves values untouched."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(5)
    # A large tensor (many blocks of a kernel), odd-sized small ones (one partial block), an empty one.
    tensors = [
        (torch.randn(70_001, generator=gen, dtype=torch.float64) * 100).to(dtype),
        (torch.randn(7, 3, generator=gen, dtype=torch.float64) * 100).to(dtype),
        torch.randn(1, generator=gen, dtype=torch.float64).to(dtype),
        torch.empty(0, dtype=dtype),
    ]
    tensors = [t.to(device) for t in tensors]
    if bad is not None:
        target = tensors[0] if where == "large" else tensors[1]
        target.view(-1)[target.numel() // 2 + 1] = bad
    before = [t.clone() for t in tensors]
    found = backend.run("check_finite", tensors, device)
    assert found.dtype == torch.float32 and found.shape == () and found.device == device
    assert found.item() == (0.0 if bad is None else 1.0)
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8) if t.numel() else t, b.view(torch.uint8) if b.numel() else b)
    ref = torch.zeros((), device=device)
    copies = [b.clone() for b in before if b.numel()]
    torch._amp_foreach_non_finite_check_and_unscale_(copies, ref, torch.ones((), device=device))
    assert found.item() == ref.item()


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_check_finite_takes_tensors_it_could_not_write(backend, bad):
    """Read-only means it also takes what an in-place op refuses: an expanded (stride-0, overlapping)
    tensor, a leaf that requires grad, a tensor made in inference mode."""
    device = backend_device(backend)
    with torch.inference_mode():
        inference = torch.ones(5, 3, device=device)
    value = 2.0 if bad is None else bad
    tensors = [
        torch.full((), value, device=device).expand(4, 1023),
        torch.ones(7, device=device, dtype=torch.float64, requires_grad=True),
        inference,
    ]
    found = backend.run("check_finite", tensors, device)
    assert found.item() == (0.0 if bad is None else 1.0)
    expected = [torch.full((4, 1023), value), torch.ones(7, dtype=torch.float64), torch.ones(5, 3)]
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t.detach().cpu(), e, atol=0, rtol=0, equal_nan=True)


def test_check_finite_empty(backend):
    device = backend_device(backend)
    found = backend.run("check_finite", [], device)
    assert found.item() == 0.0 and found.dtype == torch.float32 and found.device == device


@pytest.mark.parametrize("check_only", [False, True])
def test_triton_multi_tensor_launch_covers_every_element(check_only):
    """One launch per dtype: tensors of many blocks and partial blocks, a misaligned view (ATen path),
    the metadata cache on a second call with new values, a poison in any tensor."""
    from lightning_ext.kernels.unscale import _check_finite_triton, _unscale_and_check_triton

    device = _triton_device()
    gen = torch.Generator().manual_seed(11)
    storage = torch.randn(6000, generator=gen).to(device)
    sizes = [5000, 1024, 1023, 1, 3001, 2048]
    tensors = [(torch.randn(n, generator=gen) * 100).to(device) for n in sizes]
    tensors.append(storage[1:4001])  # misaligned
    # Two aligned views of one storage, the second below the first: offsets from the kernel's base
    # pointer (the first tensor's address) of either sign.
    shared = torch.randn(9000, generator=gen).to(device)
    tensors = [shared[4096:9000], *tensors, shared[:4000]]
    for poison in [None, 0, 2, 3, 4, 6, 7, 8, None]:  # the same tensors each time: cached metadata
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen) * 100)
        if poison is not None:
            tensors[poison].view(-1)[tensors[poison].numel() - 1] = math.nan
        expected = [t.clone() for t in tensors]
        flag = torch.zeros((), device=device)
        inv = torch.tensor(0.25, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(expected, flag, inv)
        before = [t.clone() for t in tensors]
        if check_only:
            found = _check_finite_triton(tensors, device)
            expected = before
        else:
            found = _unscale_and_check_triton(tensors, inv)
        assert found.item() == flag.item() == (0.0 if poison is None else 1.0)
        for i, (t, e) in enumerate(zip(tensors, expected)):
            torch.testing.assert_close(t, e, atol=0, rtol=0, equal_nan=True, msg=lambda m, i=i: f"{i}: {m}")


def test_triton_tensors_beyond_the_table_offset_take_atens_op(monkeypatch):
    """A table word holds a signed element offset in 39 bits; a tensor farther from the bucket's first
    one than that must not be addressed by the kernel (it would wrap), but still be unscaled."""
    from lightning_ext.kernels import unscale as us

    device = _triton_device()
    monkeypatch.setattr(us, "_MAX_OFFSET", 6000)
    monkeypatch.setattr(us, "_META_CACHE", {})
    shared = torch.randn(20000, generator=torch.Generator().manual_seed(3)).to(device)
    tensors = [shared[8192:12000], shared[:3000], shared[16384:]]  # offsets 0, -8192, +8192
    tensors[2][-1] = math.inf
    # A tensor of >= _MAX_OFFSET elements goes to ATen too, and does not become the base.
    tensors = [torch.randn(7000, generator=torch.Generator().manual_seed(4)).to(device), *tensors]
    _, fast, _ = us._bucket_metadata(tensors, 1024)
    assert fast == [1]  # |offset| + numel >= 6000 for the other two
    expected = [t.clone() for t in tensors]
    flag, inv = torch.zeros((), device=device), torch.tensor(0.125, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, flag, inv)
    found = us._unscale_and_check_triton(tensors, inv)
    assert found.item() == flag.item() == 1.0
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e, atol=0, rtol=0, equal_nan=True)
