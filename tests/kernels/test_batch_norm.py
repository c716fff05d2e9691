"""Batch-norm ops of every backend against float64 maths and against ``reference`` (STYLE.md rule 8)."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from lightning_ext.kernels import KernelBackend
from tests.kernels.conftest import backend_device

# (dtype, atol, rtol) of an op's result in that dtype, relative to the scale of its terms.
DTYPES = [
    (torch.float64, 1e-12, 1e-12),
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]
# (shape, memory format, slice) — C in {1, 3, 7, 16, 33}, odd N*S, several tiles, empty tensors.
CASES = [
    ((5, 7), torch.contiguous_format, False),
    ((3, 33, 5, 3), torch.contiguous_format, False),
    ((3, 33, 5, 3), torch.channels_last, False),
    ((3, 1, 5, 7), torch.channels_last, False),
    ((4, 3, 8, 9), torch.channels_last, False),  # several row blocks of 3 channels (lcm(3, 8) = 24)
    ((2, 16, 5, 7), torch.channels_last, False),  # rows of whole vectors, two row blocks
    ((1, 7, 3, 5, 3), torch.channels_last_3d, False),
    ((2, 7, 3, 5, 3), torch.contiguous_format, False),
    ((2101, 7), torch.contiguous_format, False),
    ((4, 9, 64, 33), torch.contiguous_format, False),  # >= 64Ki elements: several blocks per channel
    ((3, 7, 9, 5), torch.contiguous_format, True),  # x[..., ::2]: spatial dims not collapsible
    ((0, 7, 5, 3), torch.contiguous_format, False),
    ((3, 7, 0), torch.contiguous_format, False),
    ((4, 0, 3), torch.contiguous_format, False),  # no channel (reference's moments divided by C)
]


def _make(shape, fmt, sliced, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5 + 0.7
    x = x.to(dtype).contiguous(memory_format=fmt)
    if sliced:
        x = x[..., ::2]
    return x


def _vec(c, gen, lo=-1.0, hi=1.0, dtype=torch.float32):
    return (torch.rand(c, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)


def _bc(t, ndim):
    return t.view(-1, *([1] * (ndim - 2)))


def _err(actual, truth):
    return (actual.double() - truth).abs()


def assert_close_scaled(actual, truth, scale, atol, rtol, what):
    """|actual - truth| <= atol + rtol * scale elementwise; the message says where and by how much."""
    assert actual.shape == truth.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(truth.shape)}"
    if truth.numel() == 0:
        return
    err = _err(actual, truth)
    bad = err > atol + rtol * scale
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ; first at {idx}: "
            f"got {actual[idx].item()!r}, expected {truth[idx].item()!r}, max error {err.max().item():.3g}"
        )


def _truths(x, dy, shift, mean, invstd, weight, bias, sums, count, dtype=torch.float64):
    """Ground truth of every op computed in ``dtype`` (float64: the truth; the input dtype: the
    "reference run in that dtype" of the low-precision rule), with the scale of the summed terms.
    """
    nd, c = x.dim(), x.shape[1]
    dims = [0, *range(2, nd)]
    xd, dyd = x.to(dtype), dy.to(dtype)
    mu, inv, w, b = (_bc(t.to(dtype), nd) for t in (mean, invstd, weight, bias))
    sums, count = sums.to(dtype), count.to(dtype)
    n = xd.numel() // max(c, 1)
    xs = xd - _bc(shift.to(dtype), nd)
    a = _bc(sums[:c], nd) / count
    bb = _bc(sums[c:], nd) * inv * inv / count
    scale = inv * w
    head = torch.full((1,), float(n), dtype=dtype)
    return {
        "moments": (
            torch.cat([head, xs.sum(dims), (xs * xs).sum(dims)]),
            torch.cat([head, xs.abs().sum(dims), (xs * xs).sum(dims)]),
        ),
        "y": ((xd - mu) * inv * w + b, (xd - mu).abs() * (inv * w).abs() + b.abs()),
        "sums": (
            torch.cat([dyd.sum(dims), (dyd * (xd - mu)).sum(dims)]),
            torch.cat([dyd.abs().sum(dims), (dyd * (xd - mu)).abs().sum(dims)]),
        ),
        "dx": (
            (dyd - a - (xd - mu) * bb) * scale,
            (dyd.abs() + a.abs() + (xd - mu).abs() * bb.abs()) * scale.abs(),
        ),
    }


def _run(be: KernelBackend, x, dy, shift, mean, invstd, weight, bias, sums, count):
    return {
        "moments": be.run("batch_norm_moments", x, shift),
        "y": be.run("batch_norm_elemt", x, mean, invstd, weight, bias),
        "sums": be.run("batch_norm_backward_reduce", dy, x, mean),
        "dx": be.run("batch_norm_backward_elemt", dy, x, mean, invstd, weight, sums, count),
    }


def _args(shape, fmt, sliced, dtype, device):
    x = _make(shape, fmt, sliced, dtype, seed=1)
    # dy in another layout than x for the 4-d cases: the kernels take both strides.
    dy = _make(shape, torch.contiguous_format, sliced, dtype, seed=2)
    c = x.shape[1]
    gen = torch.Generator().manual_seed(3)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    shift = _vec(c, gen, 0.0, 1.5, torch.float64)  # near the data's mean 0.7, as the running mean
    mean, invstd = _vec(c, gen, -0.5, 0.5, torch.float64), _vec(c, gen, 0.5, 2.0, torch.float64)
    weight, bias = _vec(c, gen, dtype=sdt), _vec(c, gen, dtype=sdt)
    sums = _vec(2 * c, gen, -30, 30, sdt)
    count = torch.tensor(float(x.numel() // max(c, 1) + 5), dtype=torch.float64)  # this shard and others
    return [t.to(device) for t in (x, dy, shift, mean, invstd, weight, bias, sums, count)]


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize(("shape", "fmt", "sliced"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_batch_norm_ops(backend, reference, shape, fmt, sliced, dtype, atol, rtol):
    args = _args(shape, fmt, sliced, dtype, backend_device(backend))
    x, c = args[0], args[0].shape[1]
    out = {k: v.cpu() for k, v in _run(backend, *args).items()}
    args = [t.cpu() for t in args]
    truth = _truths(*args)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32

    # Contract: dtypes, shapes, memory format.
    assert out["moments"].dtype == torch.float64 and out["moments"].shape == (2 * c + 1,)
    assert out["sums"].dtype == sdt and out["sums"].shape == (2 * c,)
    for k in ("y", "dx"):
        assert out[k].dtype == dtype and out[k].shape == x.shape, k
        if x.numel() and not sliced:
            assert out[k].stride() == x.stride(), f"{k} lost the memory format of x"
    if x.numel() == 0:
        assert torch.equal(out["moments"], torch.zeros(2 * c + 1, dtype=torch.float64))
        assert torch.equal(out["sums"], torch.zeros(2 * c, dtype=sdt))
        return

    # Sums of exact inputs: float32 tolerances whatever the input dtype (accumulated in float32 at least).
    s_atol, s_rtol = (atol, rtol) if dtype == torch.float64 else (1e-5, 1e-5)
    for k in ("moments", "sums"):
        assert_close_scaled(out[k], *truth[k], s_atol, s_rtol, f"{backend.name} {k}")
    for k in ("y", "dx"):
        assert_close_scaled(out[k], *truth[k], atol, rtol, f"{backend.name} {k}")
    if backend.name != "reference":  # close to the reference backend
        ref = _run(reference, *args)
        for k, v in ref.items():
            assert_close_scaled(out[k], v.double(), 2 * truth[k][1], 4 * s_atol, 4 * s_rtol + 2 * rtol, k)
    if dtype in (torch.float16, torch.bfloat16):
        # Low precision: error vs float64 at most 2x that of the maths run in the input dtype.
        lowp = _truths(*args, dtype=dtype)
        for k in ("y", "dx"):
            t, scale = truth[k]
            err_k, err_l = _err(out[k], t).max().item(), _err(lowp[k][0], t).max().item()
            tiny = 1e-6 * scale.max().item()
            assert err_k <= 2 * err_l + tiny, (
                f"{backend.name} {k}: error {err_k:.3g} > 2x {dtype} maths {err_l:.3g}"
            )


def _moments_to_stats(payload: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = shift.shape[0]
    n, s1, s2 = payload[0], payload[1 : c + 1], payload[c + 1 :]
    return shift + s1 / n, s2 - s1 * s1 / n


@pytest.mark.parametrize("outlier", [False, True], ids=["", "outlier"])
@pytest.mark.parametrize("autocast", [False, True], ids=["", "autocast"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("shape", [(4, 9, 64, 33), (2, 3, 40000), (3, 5, 7, 9, 60)])
def test_moments_stable_when_the_mean_dominates(backend, shape, fmt, autocast, outlier):
    """The mean and ``M2`` from the moments stay exact to float32 rounding when |mean| / std ~ 1e3,
    about a shift far from the data (zero: the first step) and near it (the running mean), also for
    float32 input under bfloat16 autocast, which must not lower the sums' precision, and with the
    first element of every channel at 0 (1000 standard deviations off: summed about it, the cpu and
    triton kernels lost 3e-3 of ``M2``)."""
    gen = torch.Generator().manual_seed(7)
    x = (1e3 + torch.randn(shape, generator=gen, dtype=torch.float64)).float()
    if outlier:
        x[(0, slice(None), *([0] * (x.dim() - 2)))] = 0.0
    if x.dim() == 4:
        x = x.contiguous(memory_format=fmt)
    elif fmt == torch.channels_last:
        pytest.skip("channels_last needs 4 dims")
    xd = x.double()
    dims = [0, *range(2, x.dim())]
    t_mean = xd.mean(dims)
    t_m2 = ((xd - _bc(t_mean, x.dim())) ** 2).sum(dims)
    device = backend_device(backend)
    for shift in (torch.zeros_like(t_mean), t_mean + 0.5):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            payload = backend.run("batch_norm_moments", x.to(device), shift.to(device)).cpu()
        mean, m2 = _moments_to_stats(payload, shift)
        assert_close_scaled(mean, t_mean, t_mean.abs(), 0.0, 1e-6, "mean")
        # ATen's float32 statistics (reference) sum in float32: 2e-5 of M2; the kernels: float32 blocks.
        assert_close_scaled(m2, t_m2, t_m2, 0.0, 2e-5, "m2")


def test_weight_bias_none_and_the_local_batch_gradient(backend):
    """Without weight and bias, and with the batch's own statistics and count, the ops give ATen's
    training-mode batch norm output and input gradient."""
    device = backend_device(backend)
    x = _make((4, 7, 3, 3), torch.channels_last, False, torch.float32, seed=4).to(device)
    dy = _make((4, 7, 3, 3), torch.channels_last, False, torch.float32, seed=5).to(device)
    payload = backend.run("batch_norm_moments", x, torch.zeros(7, dtype=torch.float64, device=device))
    mean, m2 = _moments_to_stats(payload, torch.zeros(7, dtype=torch.float64, device=device))
    invstd = (m2 / 36 + 1e-5).rsqrt()
    y = backend.run("batch_norm_elemt", x, mean, invstd, None, None)
    xr = x.detach().clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(xr, None, None, training=True, eps=1e-5)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    sums = backend.run("batch_norm_backward_reduce", dy, x, mean)
    dx = backend.run("batch_norm_backward_elemt", dy, x, mean, invstd, None, sums, payload[0])
    torch.testing.assert_close(dx, xr.grad, atol=1e-4, rtol=1e-4)


# (dtype, tolerance relative to the scale of dx's terms) for the sharded backward.
GROUP_DTYPES = [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)]


@pytest.mark.parametrize(("dtype", "tol"), GROUP_DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize(
    ("shape", "fmt", "shards"),
    [
        ((4, 33, 5, 3), torch.contiguous_format, (3, 1)),
        ((4, 33, 5, 3), torch.channels_last, (1, 3)),
        ((2101, 7), torch.contiguous_format, (2000, 101)),
        ((6, 7, 3, 5, 3), torch.channels_last_3d, (0, 2, 4)),  # an empty shard
        ((5, 3, 9), torch.contiguous_format, (5,)),  # one shard: no group
    ],
    ids=str,
)
def test_sharded_backward_matches_whole_batch(backend, shape, fmt, shards, dtype, tol):
    """Each shard's ``backward_reduce``, summed over the shards (what the all_reduce does), then each
    shard's ``backward_elemt`` with the global count equal float64 batch-norm maths on the whole batch."""
    device = backend_device(backend)
    x = _make(shape, fmt, False, dtype, seed=11).to(device)
    dy = _make(shape, fmt, False, dtype, seed=12).to(device)
    gen = torch.Generator().manual_seed(13)
    c, nd = x.shape[1], x.dim()
    weight = _vec(c, gen, 0.5, 1.5).to(device)
    dims = [0, *range(2, nd)]
    xd, dyd = x.double().cpu(), dy.double().cpu()
    mean = xd.mean(dims).to(device)
    invstd = (xd.var(dims, unbiased=False) + 1e-5).rsqrt().to(device)
    n = xd.numel() // c
    count = torch.tensor(float(n), dtype=torch.float64, device=device)
    parts = list(zip(x.split(list(shards)), dy.split(list(shards))))
    total = sum(backend.run("batch_norm_backward_reduce", d, xs, mean) for xs, d in parts)
    outs = [
        backend.run("batch_norm_backward_elemt", d, xs, mean, invstd, weight, total, count) for xs, d in parts
    ]
    for (xs, _), dx in zip(parts, outs):
        assert dx.dtype == xs.dtype and dx.shape == xs.shape
        if xs.dim() > 2 and xs.numel():
            assert dx.is_contiguous(memory_format=fmt)
    dx = torch.cat(outs).cpu()
    mu, inv, w = (_bc(t.double().cpu(), nd) for t in (mean, invstd, weight))
    a = _bc(dyd.sum(dims), nd) / n
    b = _bc((dyd * (xd - mu)).sum(dims), nd) * inv * inv / n
    truth = (dyd - a - (xd - mu) * b) * inv * w
    scale = (dyd.abs() + a.abs() + (xd - mu).abs() * b.abs()) * (inv * w).abs()
    assert_close_scaled(dx, truth, scale, tol, tol, f"dx {dtype} shards {shards}")


def test_backward_takes_a_stride_zero_gradient(backend):
    """The gradient of ``y.sum()`` arrives expanded (all strides 0): same result as a dense one."""
    device = backend_device(backend)
    x = _make((4, 5, 3, 3), torch.channels_last, False, torch.bfloat16, seed=21).to(device)
    mean, invstd = torch.zeros(5, device=device), torch.ones(5, device=device)
    count = torch.tensor(36.0, device=device)
    expanded = torch.ones((), dtype=x.dtype, device=device).expand(x.shape)
    dense = torch.ones_like(x)
    for dy in (expanded, dense):
        sums = backend.run("batch_norm_backward_reduce", dy, x, mean)
        dx = backend.run("batch_norm_backward_elemt", dy, x, mean, invstd, None, sums, count)
        assert dx.is_contiguous(memory_format=torch.channels_last)
        if dy is expanded:
            got = (sums, dx)
    torch.testing.assert_close(got[0], sums)
    torch.testing.assert_close(got[1], dx)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda b: b.run("batch_norm_moments", torch.zeros(3), torch.zeros(3)),
            ValueError,
            r"`x` must have shape \(N, C, \*\).*\(3,\)",
        ),
        (
            lambda b: b.run("batch_norm_moments", [1.0], torch.zeros(1)),
            TypeError,
            r"`x` must be a torch.Tensor.*list",
        ),
        (
            lambda b: b.run("batch_norm_moments", torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3)),
            TypeError,
            r"`x` must be.*int64",
        ),
        (
            lambda b: b.run("batch_norm_moments", torch.zeros(2, 3), torch.zeros(3, dtype=torch.float16)),
            TypeError,
            r"`shift` must be a float32/float64 tensor of shape \(3,\), got torch.float16",
        ),
        (
            lambda b: b.run("batch_norm_moments", torch.zeros(2, 3), torch.zeros(4)),
            ValueError,
            r"`shift` must have shape \(3,\) on cpu, got \(4,\) on cpu",
        ),
    ],
)
def test_bad_input_raises(reference, call, error, match):
    """``run(..., check=True)`` names the argument, the value and what is allowed: the check of
    ``batch_norm_moments``, the op a user reaches with tensors of their own (``sync_batch_norm_stats``).
    The other ops take arguments this package builds and have no check."""
    with pytest.raises(error, match=match):
        call(SimpleNamespace(run=functools.partial(reference.run, check=True)))


@pytest.mark.parametrize("count", [0.0, 2.0, 37.0])
@pytest.mark.parametrize("buffers", [torch.float32, torch.float64, None], ids=str)
def test_gather_stats(backend, count, buffers):
    """Mean and invstd from summed moments, and the running update, against float64 maths; an empty
    group gives mean = shift and invstd = 1/sqrt(eps). The maths is float64 on every backend: equal
    to the truth within a few float64 roundings of the terms (1e-12 relative, far above 8 eps)."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(9)
    c = 7
    shift = (torch.randn(c, generator=gen, dtype=torch.float64) * 3).to(device)
    s1 = torch.randn(c, generator=gen, dtype=torch.float64) * count
    s2 = s1 * s1 / max(count, 1.0) + torch.rand(c, generator=gen, dtype=torch.float64) * count
    payload = torch.cat([torch.tensor([count], dtype=torch.float64), s1, s2]).to(device)
    running = None
    if buffers is not None:
        running = [torch.randn(c, generator=gen, dtype=buffers).to(device) for _ in range(2)]
        before = [r.clone() for r in running]
    momentum = torch.tensor(0.3, dtype=torch.float64)
    mean, invstd = backend.run(
        "batch_norm_gather_stats", payload, shift, *(running or [None, None]), momentum, 1e-5
    )
    n = max(count, 1.0)
    t_mean = (shift.cpu() + s1 / n) if count else shift.cpu()
    t_var = (s2 / n - (s1 / n) ** 2).clamp_min(0.0) if count else torch.zeros(c, dtype=torch.float64)
    torch.testing.assert_close(mean.cpu(), t_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(invstd.cpu(), (t_var + 1e-5).rsqrt(), rtol=1e-12, atol=0)
    if running is not None and count > 1:
        t_rm = 0.7 * before[0].cpu().double() + 0.3 * t_mean
        t_rv = 0.7 * before[1].cpu().double() + 0.3 * t_var * count / (count - 1)
        tol = 1e-12 if buffers == torch.float64 else 1e-6  # rounded to float32 buffers
        torch.testing.assert_close(running[0].cpu().double(), t_rm, rtol=tol, atol=tol)
        torch.testing.assert_close(running[1].cpu().double(), t_rv, rtol=tol, atol=tol)


@pytest.mark.parametrize("magnitude", [1e15, 1e19, 3e38])
def test_moments_of_huge_values(backend, magnitude):
    """``batch_norm_moments`` of float32 values up to float32's largest: the ``cpu`` backend redoes a
    float32 pass whose sums overflow in float64 (finite, float64's accuracy); ``reference`` and
    ``triton`` sum squares in float32 (ATen's accumulation), finite while they stay below float32's
    largest value (here 1e15)."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 3, 8, 8, generator=gen, dtype=torch.float64) * magnitude).clamp(-3e38, 3e38).float()
    shift = torch.zeros(3)
    payload = backend.run("batch_norm_moments", x.to(device), shift.to(device)).cpu()
    if backend.name != "cpu" and magnitude > 1e15:
        return  # documented: float32 sums of squares
    v = x.double().transpose(0, 1).reshape(3, -1)
    assert torch.isfinite(payload).all()
    # float32 terms in blocks (the local shift's deviations), float64 totals: a few float32 ulps
    torch.testing.assert_close(payload[1:4], v.sum(1), rtol=1e-6, atol=1e-6 * v.abs().sum(1).max().item())
    torch.testing.assert_close(payload[4:], (v * v).sum(1), rtol=1e-6, atol=0)


def test_float16_conversions_of_the_cpu_kernels_are_torchs():
    """The cpu kernels convert float16 with F16C where the CPU has it (8 elements an instruction), else
    and in the tails by bit operations that vectorize: every float16 value reads back as itself, and
    float32 results round to float16 as torch does (to nearest even: the ties between neighbouring
    float16 values and a step either side of them, subnormals, overflow to inf, NaN), on both paths."""
    from tests.helpers.cpu_extension import require_cpu_backend

    backend = require_cpu_backend()
    ones, zeros = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)

    def same(got: torch.Tensor, expected: torch.Tensor) -> bool:  # bit for bit, any NaN for a NaN
        got, nan = got.reshape(-1), expected.isnan()
        return torch.equal(got.isnan(), nan) and torch.equal(
            got[~nan].view(torch.int16), expected[~nan].view(torch.int16)
        )

    for scale in (1.0, 1.0 + 2**-11, 1.0 - 2**-12 - 2**-20, 3.0, 2**-10):  # one channel: the vector path
        y = backend.run("batch_norm_elemt", every.reshape(1, 1, -1), zeros, ones, ones * scale, None)
        assert same(y, (every.float() * scale + 0.0).half()), scale  # (the kernel's float32 arithmetic)
    finite = every[every.isfinite()].float().unique()
    ties = ((finite[:-1].double() + finite[1:].double()) / 2).float()  # exact in float32
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-9, 6e-8, 1e-5, 1.0, 6.5e4, 1e5])
    values = torch.cat([
        ties, ties.nextafter(torch.tensor(-math.inf)), ties.nextafter(torch.tensor(math.inf)),
        (torch.randn(6, 4096, generator=gen) * magnitudes[:, None]).reshape(-1),
        torch.tensor([math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 1e30, 2**-25, 3 * 2**-26]),
    ])  # fmt: skip
    for chunk in values.split(2**16):  # a channel per value (the scalar tail): y = 1 * 0 + bias
        c = chunk.numel()
        x = torch.ones(1, c, 1, dtype=torch.float16)
        y = backend.run(
            "batch_norm_elemt", x, zeros.expand(c), ones.expand(c), zeros.expand(c), chunk.double()
        )
        assert same(y, chunk.half())
    for chunk in values.split(2**16):  # channels last, 8 channels a vector: y = 1 * 0 + bias again
        c = chunk.numel() // 8 * 8
        x = torch.ones(1, c, 1, 1, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        bias = chunk[:c].double()
        y = backend.run("batch_norm_elemt", x, zeros.expand(c), ones.expand(c), zeros.expand(c), bias)
        assert same(y, chunk[:c].half())


@pytest.mark.parametrize(
    ("dtype", "fmt"),
    [(dtype, fmt) for dtype in (torch.float16, torch.bfloat16, torch.float32)
     for fmt in (torch.contiguous_format, torch.channels_last)],
)  # fmt: skip
def test_the_large_normalize_of_the_cpu_kernels_is_the_reference_ops(reference, dtype, fmt):
    """At 2^22 elements (several thread chunks, the F16C body for float16) the cpu kernel's normalize is
    the reference op's."""
    from tests.helpers.cpu_extension import require_cpu_backend

    backend = require_cpu_backend()
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 4, 2**9, 2**9, generator=gen) * 3 + 1).to(dtype).contiguous(memory_format=fmt)
    mean, invstd = torch.randn(4, generator=gen), torch.rand(4, generator=gen) + 0.5
    weight, bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    y = backend.run("batch_norm_elemt", x, mean, invstd, weight, bias)
    expected = reference.run("batch_norm_elemt", x, mean, invstd, weight, bias)
    assert y.dtype == dtype and y.is_contiguous(memory_format=fmt)
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]  # one rounding
    torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(400003, 3), (400003, 3, 1), (31250, 3, 64)])
def test_moments_of_many_samples_per_channel(backend, shape, dtype):
    """(N, C) input (BatchNorm1d's shape) and float16/bfloat16 input with many elements per channel: the
    reference backend's ATen statistics kept float32 (narrower) running sums there, the variance off
    15x (350x) and the mean by 16 at 1e3 +- 1 over 1M elements."""
    if backend.name == "triton" and len(shape) > 2 and shape[2] > 1 and not torch.cuda.is_available():
        pytest.skip("interpreted Triton takes minutes per case at this size (smaller ones: above)")
    gen = torch.Generator().manual_seed(3)
    x = (1e3 + torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    xd, dims = x.double(), [0, *range(2, x.dim())]
    t_mean = xd.mean(dims)
    t_m2 = ((xd - _bc(t_mean, x.dim())) ** 2).sum(dims)
    shift, device = torch.zeros_like(t_mean), backend_device(backend)
    payload = backend.run("batch_norm_moments", x.to(device), shift.to(device)).cpu()
    mean, m2 = _moments_to_stats(payload, shift)
    assert_close_scaled(mean, t_mean, t_mean.abs(), 0.0, 1e-6, "mean")
    assert_close_scaled(m2, t_m2, t_m2, 0.0, 2e-5, "m2")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "channels_last chunk", "sliced"])
def test_the_elementwise_ops_give_the_strides_their_fakes_say(backend, layout):
    """``torch.compile`` checks a custom op's output strides against its fake's (``_output``): the
    reference's ATen ops gave a channel chunk of a channels-last tensor channels-last strides where
    the fake says contiguous (an AssertionError inside a compiled SyncBatchNorm)."""
    from lightning_ext.kernels.batch_norm import _output

    device = backend_device(backend)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 8, 6, 6, generator=gen).to(device)
    x = {"contiguous": full, "channels_last": full.contiguous(memory_format=torch.channels_last),
         "channels_last chunk": full.contiguous(memory_format=torch.channels_last).chunk(2, dim=1)[0],
         "sliced": full[:, :4, ::2]}[layout]  # fmt: skip
    c = x.shape[1]
    mean, invstd = torch.randn(c, generator=gen).to(device), (torch.rand(c, generator=gen) + 0.5).to(device)
    sums, count = torch.randn(2 * c, generator=gen).to(device), torch.tensor(x.numel() / c, device=device)
    y = backend.run("batch_norm_elemt", x, mean, invstd, None, None)
    dx = backend.run("batch_norm_backward_elemt", torch.randn_like(x), x, mean, invstd, None, sums, count)
    assert y.stride() == dx.stride() == _output(x).stride(), (layout, y.stride(), dx.stride())
