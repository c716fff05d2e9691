"""Batch-norm ops of every backend against float64 maths and against ``reference`` (STYLE.md rule 8)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_ext.kernels import KernelBackend

# (dtype, atol, rtol) of an op's result in that dtype, relative to the scale of its terms.
DTYPES = [
    (torch.float64, 1e-12, 1e-12),
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]
# (shape, memory format, slice) — C in {1, 7, 33}, odd N*S, several tiles, empty tensors.
CASES = [
    ((5, 7), torch.contiguous_format, False),
    ((3, 33, 5, 3), torch.contiguous_format, False),
    ((3, 33, 5, 3), torch.channels_last, False),
    ((3, 1, 5, 7), torch.channels_last, False),
    ((1, 7, 3, 5, 3), torch.channels_last_3d, False),
    ((2, 7, 3, 5, 3), torch.contiguous_format, False),
    ((2101, 7), torch.contiguous_format, False),
    ((4, 9, 64, 33), torch.contiguous_format, False),  # >= 64Ki elements: reference's two-pass stats
    ((3, 7, 9, 5), torch.contiguous_format, True),  # x[..., ::2]: spatial dims not collapsible
    ((0, 7, 5, 3), torch.contiguous_format, False),
    ((3, 7, 0), torch.contiguous_format, False),
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


def _truths(x, dy, mean, invstd, weight, bias, sum_dy, sum_dy_xmu, count, dtype=torch.float64):
    """Ground truth of every op computed in ``dtype`` (float64: the truth; the input dtype: the
    "reference run in that dtype" of the low-precision rule), with the scale of the summed terms.
    """
    nd = x.dim()
    dims = [0, *range(2, nd)]
    xd, dyd = x.to(dtype), dy.to(dtype)
    mu, inv, w, b = (_bc(t.to(dtype), nd) for t in (mean, invstd, weight, bias))
    sum_dy, sum_dy_xmu, count = sum_dy.to(dtype), sum_dy_xmu.to(dtype), count.to(dtype)
    n = xd.numel() // xd.shape[1]
    t_mean = xd.mean(dims) if n else torch.zeros(x.shape[1], dtype=dtype)
    xm = xd - _bc(t_mean, nd)
    a = _bc(sum_dy, nd) / count
    bb = _bc(sum_dy_xmu, nd) * inv * inv / count
    c = inv * w
    return {
        "mean": (t_mean, xd.abs().sum(dims) / max(n, 1)),
        "m2": ((xm * xm).sum(dims), (xd * xd).sum(dims)),
        "y": ((xd - mu) * inv * w + b, (xd - mu).abs() * (inv * w).abs() + b.abs()),
        "sum_dy": (dyd.sum(dims), dyd.abs().sum(dims)),
        "sum_dy_xmu": ((dyd * (xd - mu)).sum(dims), (dyd * (xd - mu)).abs().sum(dims)),
        "dx": ((dyd - a - (xd - mu) * bb) * c, (dyd.abs() + a.abs() + (xd - mu).abs() * bb.abs()) * c.abs()),
    }


def _run(be: KernelBackend, x, dy, mean, invstd, weight, bias, sum_dy, sum_dy_xmu, count):
    cnt, m, m2 = be.batch_norm_stats(x)
    y = be.batch_norm_elemt(x, mean, invstd, weight, bias)
    s1, s2 = be.batch_norm_backward_reduce(dy, x, mean, invstd)
    dx = be.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
    return {"count": cnt, "mean": m, "m2": m2, "y": y, "sum_dy": s1, "sum_dy_xmu": s2, "dx": dx}


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize(("shape", "fmt", "sliced"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_batch_norm_ops(backend, reference, shape, fmt, sliced, dtype, atol, rtol):
    x = _make(shape, fmt, sliced, dtype, seed=1)
    # dy in another layout than x for the 4-d cases: the kernels take both strides.
    dy = _make(shape, torch.contiguous_format, sliced, dtype, seed=2)
    c = x.shape[1]
    gen = torch.Generator().manual_seed(3)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    mean, invstd = _vec(c, gen, -0.5, 0.5, sdt), _vec(c, gen, 0.5, 2.0, sdt)
    weight, bias = _vec(c, gen, dtype=sdt), _vec(c, gen, dtype=sdt)
    sum_dy, sum_dy_xmu = _vec(c, gen, -30, 30, sdt), _vec(c, gen, -30, 30, sdt)
    n = x.numel() // c
    count = torch.tensor(float(n + 5), dtype=sdt)  # global count: this shard and others
    args = (x, dy, mean, invstd, weight, bias, sum_dy, sum_dy_xmu, count)

    out = _run(backend, *args)
    truth = _truths(*args)

    # Contract: dtypes, shapes, memory format.
    for k in ("count", "mean", "m2", "sum_dy", "sum_dy_xmu"):
        assert out[k].dtype == sdt and out[k].shape == (c,), k
    for k in ("y", "dx"):
        assert out[k].dtype == dtype and out[k].shape == x.shape, k
        if x.numel() and not sliced:
            assert out[k].stride() == x.stride(), f"{k} lost the memory format of x"
    assert torch.equal(out["count"], torch.full((c,), float(n), dtype=sdt))
    if x.numel() == 0:
        for k in ("mean", "m2", "sum_dy", "sum_dy_xmu"):
            assert torch.equal(out[k], torch.zeros(c, dtype=sdt)), k
        return

    # Statistics are float32 whatever the input dtype: fp32 tolerances (inputs are exact).
    s_atol, s_rtol = (atol, rtol) if dtype == torch.float64 else (1e-5, 1e-5)
    for k in ("mean", "m2", "sum_dy", "sum_dy_xmu"):
        assert_close_scaled(out[k], *truth[k], s_atol, s_rtol, f"{backend.key} {k}")
    for k in ("y", "dx"):
        assert_close_scaled(out[k], *truth[k], atol, rtol, f"{backend.key} {k}")

    if backend.key != "reference":
        # Close to the reference backend.
        ref = _run(reference, *args)
        for k, v in ref.items():
            if k in truth:
                assert_close_scaled(out[k], v.double(), 2 * truth[k][1], 4 * s_atol, 4 * s_rtol + 2 * rtol, k)
    if dtype in (torch.float16, torch.bfloat16):
        # Low precision: error vs float64 at most 2x that of the maths run in the input dtype.
        lowp = _truths(*args, dtype=dtype)
        for k, (t, scale) in truth.items():
            err_k, err_l = _err(out[k], t).max().item(), _err(lowp[k][0], t).max().item()
            tiny = 1e-6 * scale.max().item()
            assert err_k <= 2 * err_l + tiny, (
                f"{backend.key} {k}: error {err_k:.3g} > 2x {dtype} maths {err_l:.3g}"
            )


@pytest.mark.parametrize("autocast", [False, True], ids=["", "autocast"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("shape", [(4, 9, 64, 33), (2, 3, 40000), (3, 5, 7, 9, 60)])
def test_stats_stable_when_the_mean_dominates(backend, shape, fmt, autocast):
    """float32 ``m2`` stays exact to float32 rounding when |mean| / std ~ 1e3 (no E[x^2] - E[x]^2),
    also for float32 input under bfloat16 autocast (a SyncBatchNorm after a float32 op in an
    autocast region), which must not lower the statistics' precision."""
    gen = torch.Generator().manual_seed(7)
    x = (1e3 + torch.randn(shape, generator=gen, dtype=torch.float64)).float()
    if x.dim() == 4:
        x = x.contiguous(memory_format=fmt)
    elif fmt == torch.channels_last:
        pytest.skip("channels_last needs 4 dims")
    if backend.key == "reference" and fmt == torch.channels_last:
        pytest.skip("ATen's channels-last CPU statistics sum the mean in float32 (1.2e-6 relative here)")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        _, mean, m2 = backend.batch_norm_stats(x)
    xd = x.double()
    dims = [0, *range(2, x.dim())]
    t_mean = xd.mean(dims)
    t_m2 = ((xd - _bc(t_mean, x.dim())) ** 2).sum(dims)
    assert_close_scaled(mean, t_mean, t_mean.abs(), 0.0, 1e-6, "mean")
    assert_close_scaled(m2, t_m2, t_m2, 0.0, 1e-5, "m2")


def test_weight_bias_none_and_vector_count(backend):
    x = _make((4, 7, 3, 3), torch.channels_last, False, torch.float32, seed=4)
    dy = _make((4, 7, 3, 3), torch.channels_last, False, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    mean, invstd = _vec(7, gen), _vec(7, gen, 0.5, 2.0)
    y = backend.batch_norm_elemt(x, mean, invstd, None, None)
    torch.testing.assert_close(y, (x - mean.view(-1, 1, 1)) * invstd.view(-1, 1, 1), atol=1e-5, rtol=1e-5)
    s1, s2 = backend.batch_norm_backward_reduce(dy, x, mean, invstd)
    count = torch.full((7,), 36.0)
    dx_vec = backend.batch_norm_backward_elemt(dy, x, mean, invstd, None, s1, s2, count)
    dx_0d = backend.batch_norm_backward_elemt(dy, x, mean, invstd, None, s1, s2, torch.tensor(36.0))
    torch.testing.assert_close(dx_vec, dx_0d)
    # Local training-mode batch norm: with the batch's own statistics this is ATen's input gradient.
    _, bmean, m2 = backend.batch_norm_stats(x)
    binv = (m2 / 36 + 1e-5).rsqrt()
    xr = x.detach().clone().requires_grad_()
    torch.nn.functional.batch_norm(xr, None, None, training=True, eps=1e-5).backward(dy)
    s1, s2 = backend.batch_norm_backward_reduce(dy, x, bmean, binv)
    dx = backend.batch_norm_backward_elemt(dy, x, bmean, binv, None, s1, s2, count)
    torch.testing.assert_close(dx, xr.grad, atol=1e-4, rtol=1e-4)


# (dtype, tolerance relative to the scale of dx's terms) for the group backward: fp32 and below add
# the rounding of the local gradient and of the correction (reference backend on the CPU).
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
def test_group_backward_matches_whole_batch(backend, shape, fmt, shards, dtype, tol):
    """``batch_norm_backward`` of each shard, its sums added over the shards by ``sum_over_group``,
    equals float64 training-mode batch-norm maths on the whole batch (global statistics and count)."""
    x = _make(shape, fmt, False, dtype, seed=11)
    dy = _make(shape, fmt, False, dtype, seed=12)
    gen = torch.Generator().manual_seed(13)
    c, nd = x.shape[1], x.dim()
    weight = _vec(c, gen, 0.5, 1.5)
    dims = [0, *range(2, nd)]
    xd, dyd = x.double(), dy.double()
    mean64 = xd.mean(dims)
    invstd64 = (xd.var(dims, unbiased=False) + 1e-5).rsqrt()
    mean, invstd = mean64.float(), invstd64.float()
    n = xd.numel() // c
    count = torch.tensor(float(n))
    parts = list(zip(x.split(list(shards)), dy.split(list(shards))))
    # Every shard's local sums first (what the other ranks would contribute), then each shard's call.
    local = [backend.batch_norm_backward_reduce(d, xs, mean, invstd) for xs, d in parts]
    packed = [torch.cat(s) for s in local]
    outs = []
    for i, (xs, d) in enumerate(parts):
        others = sum((p for j, p in enumerate(packed) if j != i), torch.zeros_like(packed[i]))
        group = (lambda mine, others=others: mine + others) if len(parts) > 1 else None
        dx, sum_dy, sum_dy_xmu = backend.batch_norm_backward(d, xs, mean, invstd, weight, count, group)
        assert dx.dtype == xs.dtype and dx.shape == xs.shape
        if xs.dim() > 2 and xs.numel():
            assert dx.is_contiguous(memory_format=fmt)
        for got, want, what in zip((sum_dy, sum_dy_xmu), local[i], ("sum_dy", "sum_dy_xmu")):
            assert_close_scaled(got, want.double(), want.abs().double(), 1e-4, 1e-5, what)
        outs.append(dx)
    dx = torch.cat(outs)
    mu, inv, w = (_bc(t, nd) for t in (mean.double(), invstd.double(), weight.double()))
    a = _bc(dyd.sum(dims), nd) / n
    b = _bc((dyd * (xd - mu)).sum(dims), nd) * inv * inv / n
    truth = (dyd - a - (xd - mu) * b) * inv * w
    scale = (dyd.abs() + a.abs() + (xd - mu).abs() * b.abs()) * (inv * w).abs()
    assert_close_scaled(dx, truth, scale, tol, tol, f"dx {dtype} shards {shards}")


def test_group_backward_takes_a_stride_zero_gradient(backend):
    """The gradient of ``y.sum()`` arrives expanded (all strides 0): same result as a dense one."""
    x = _make((4, 5, 3, 3), torch.channels_last, False, torch.bfloat16, seed=21)
    mean, invstd, count = torch.zeros(5), torch.ones(5), torch.tensor(36.0)
    expanded = torch.ones((), dtype=x.dtype).expand(x.shape)
    dense = torch.ones_like(x)
    got = backend.batch_norm_backward(expanded, x, mean, invstd, None, count)
    want = backend.batch_norm_backward(dense, x, mean, invstd, None, count)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got[0].is_contiguous(memory_format=torch.channels_last)


def test_group_backward_rejects_a_non_callable(reference):
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match=r"`sum_over_group` must be a callable or None, got int"):
        reference.batch_norm_backward(x, x, torch.zeros(3), torch.ones(3), None, torch.tensor(4.0), 5)


def test_gradcheck_float64(backend):
    """Autograd of batch_norm_stats and batch_norm_elemt (built from the backend's own ops)."""
    gradcheck = functools.partial(torch.autograd.gradcheck, fast_mode=True)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4, 2, 3, generator=gen, dtype=torch.float64).to(memory_format=torch.channels_last)
    x.requires_grad_()
    mean = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    invstd = (torch.rand(4, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    weight = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda *a: backend.batch_norm_elemt(*a), (x, mean, invstd, weight, bias))
    assert gradcheck(lambda *a: backend.batch_norm_elemt(a[0], a[1], a[2], None, None), (x, mean, invstd))
    assert gradcheck(lambda t: backend.batch_norm_stats(t)[1:], (x,))
    cnt, _, _ = backend.batch_norm_stats(x)
    assert not cnt.requires_grad


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda b: b.batch_norm_stats(torch.zeros(3)),
            ValueError,
            r"`x` must have shape \(N, C, \*\).*\(3,\)",
        ),
        (lambda b: b.batch_norm_stats([1.0]), TypeError, r"`x` must be a torch.Tensor.*list"),
        (
            lambda b: b.batch_norm_stats(torch.zeros(2, 3, dtype=torch.int64)),
            TypeError,
            r"`x` must be.*int64",
        ),
        (
            lambda b: b.batch_norm_elemt(torch.zeros(2, 3), torch.zeros(4), torch.ones(3), None, None),
            ValueError,
            r"`mean` must have shape \(C,\)=\(3,\), got shape \(4,\)",
        ),
        (
            lambda b: b.batch_norm_elemt(torch.zeros(2, 3), torch.zeros(3), torch.ones(3), 1.0, None),
            TypeError,
            r"`weight` must be a torch.Tensor or None",
        ),
        (
            lambda b: b.batch_norm_backward_reduce(
                torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(3), torch.ones(3)
            ),
            ValueError,
            r"`dy` must have the shape of `x` \(2, 3\), got shape \(2, 4\)",
        ),
        (
            lambda b: b.batch_norm_backward_elemt(
                *[torch.zeros(2, 3)] * 2, *[torch.ones(3)] * 2, None, *[torch.ones(3)] * 2, torch.ones(2)
            ),
            ValueError,
            r"`count` must be a tensor of shape \(\) or \(C,\)=\(3,\), got \(2,\)",
        ),
    ],
)
def test_bad_input_raises(reference, call, error, match):
    with pytest.raises(error, match=match):
        call(reference)
