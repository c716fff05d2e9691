"""Compiled Triton kernels on a real GPU against ``reference`` (skipped without CUDA).

The CPU suite runs the same kernels in Triton's interpreter; this file checks the compiled path at
ResNet-50-like shapes in every dtype and memory format.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)"),
]

SHAPES = [(8, 64, 56, 56), (8, 256, 14, 14), (5, 33, 7, 9), (1000, 7), (0, 64, 7, 7)]
FORMATS = [torch.contiguous_format, torch.channels_last]
DTYPES = [(torch.float32, 1e-4, 1e-4), (torch.float16, 2e-3, 2e-3), (torch.bfloat16, 1.6e-2, 1.6e-2)]


@pytest.fixture(scope="module")
def backends():
    from lightning_ext.kernels import get_backend

    return get_backend("reference", "cuda"), get_backend("triton", "cuda")


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference_on_gpu(backends, shape, fmt, dtype, atol, rtol):
    """Every op, both backends, against float64 maths on the same inputs: the Triton kernel's error is
    within twice the reference backend's (ATen's CUDA kernels) plus a float32-rounding allowance."""
    from tests.kernels.test_batch_norm import _err, _run, _truths

    ref, tri = backends
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", generator=gen) * 2 + 1).to(dtype)
    dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    if x.dim() == 4:
        x = x.contiguous(memory_format=fmt)
    c = shape[1]
    shift = torch.rand(c, device="cuda", generator=gen, dtype=torch.float64) * 2  # the running mean
    mean = torch.randn(c, device="cuda", generator=gen)
    invstd = torch.rand(c, device="cuda", generator=gen) + 0.5
    weight, bias = torch.randn(c, device="cuda", generator=gen), torch.randn(c, device="cuda", generator=gen)
    sums = torch.randn(2 * c, device="cuda", generator=gen) * 30  # [sum dy, sum dy * (x - mean)] of a group
    n = max(x.numel() // c, 1)
    count = torch.tensor(float(n + 5), device="cuda")
    args = (x, dy, shift, mean, invstd, weight, bias, sums, count)
    out_t, out_r = _run(tri, *args), _run(ref, *args)
    truth = _truths(*(a.cpu() for a in args))
    for k in ("y", "dx"):
        assert out_t[k].stride() == x.stride(), f"{k} lost the memory format of x"
    assert out_t["moments"].dtype == torch.float64 and out_t["moments"][0].item() == x.numel() // c
    assert torch.equal(out_t["moments"][:1], out_r["moments"][:1])  # the count is exact
    for k, (t, scale) in truth.items():
        if t.numel() == 0:  # y and dx of an empty input
            assert out_t[k].shape == t.shape, k
            continue
        err_t, err_r = _err(out_t[k].cpu(), t).max().item(), _err(out_r[k].cpu(), t).max().item()
        allowance = 1e-5 * scale.max().item() if x.numel() else 0.0
        assert err_t <= 2 * err_r + allowance, f"{k}: triton error {err_t:.3g} > 2x reference {err_r:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_triton_multi_tensor_unscale_compiled(dtype):
    """The compiled multi-tensor kernel over every tensor: full and partial blocks, views of one storage
    on either side of the base tensor, a transposed (dense, not contiguous) tensor, a poison in the first
    element of a full block, the last element of a tensor or nowhere; bit-identical to ATen's op (for
    bfloat16, which ATen's CUDA op does not take, to its float32 arithmetic), the check read-only."""
    from lightning_ext.kernels.unscale import _BLOCK, _check_finite_triton, _unscale_and_check_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    shared = torch.randn(4 * _BLOCK + 8000, device="cuda", generator=gen).to(dtype)
    sizes = [3 * _BLOCK, _BLOCK + 1, 1, 999, 2 * _BLOCK - 8, 123_457]
    tensors = [shared[2 * _BLOCK : 4 * _BLOCK + 4000]]
    tensors += [(torch.randn(n, device="cuda", generator=gen) * 1e3).to(dtype) for n in sizes]
    tensors += [shared[: _BLOCK + 5], torch.randn(64, 70, device="cuda", generator=gen).to(dtype).t()]
    inv = torch.tensor(0.0625, device="cuda")
    for poison in [None, (1, _BLOCK), (2, _BLOCK), (7, _BLOCK + 4), (8, 0), (0, 0), None]:
        for t in tensors:
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen) * 1e3)
        if poison is not None:
            i, k = poison
            value = float("inf") if i % 2 else float("nan")
            if tensors[i].is_contiguous():
                tensors[i].view(-1)[k] = value
            else:
                tensors[i][0, k] = value
        expected = [t.clone() for t in tensors]
        flag = torch.zeros((), device="cuda")
        if dtype == torch.bfloat16:  # ATen's CUDA op takes no bfloat16: its arithmetic, in float32
            flag.fill_(float(not all(t.isfinite().all() for t in expected)))
            expected = [(t.float() * inv).to(dtype) for t in expected]
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(expected, flag, inv)
        before = [t.clone() for t in tensors]
        assert _check_finite_triton(tensors, torch.device("cuda")).item() == flag.item()
        for t, b in zip(tensors, before):
            torch.testing.assert_close(t, b, atol=0, rtol=0, equal_nan=True)
        assert _unscale_and_check_triton(tensors, inv).item() == flag.item() == (poison is not None)
        for i, (t, e) in enumerate(zip(tensors, expected)):
            torch.testing.assert_close(t, e, atol=0, rtol=0, equal_nan=True, msg=lambda m, i=i: f"{i}: {m}")


def test_triton_unscale_check_and_moments_on_gpu(backends):
    ref, tri = backends
    grads = [torch.randn(11_000_003, device="cuda"), torch.randn(257, 3, device="cuda").half().t()]
    grads2 = [g.clone() for g in grads]
    inv = torch.tensor(0.125, device="cuda")
    assert (
        ref.run("unscale_and_check_", grads, inv).item()
        == tri.run("unscale_and_check_", grads2, inv).item()
        == 0.0
    )
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    grads2[1][1, 7] = float("nan")
    assert (
        ref.run("check_finite", grads2, "cuda").item()
        == tri.run("check_finite", grads2, "cuda").item()
        == 1.0
    )
    assert tri.run("unscale_and_check_", grads2, inv).item() == 1.0
    x = torch.randn(1_000_003, device="cuda", dtype=torch.float64) + 5
    shift = torch.tensor(5.0, device="cuda", dtype=torch.float64)
    acc_r = torch.tensor([0, 0, 0, float("inf"), -float("inf")], device="cuda", dtype=torch.float64)
    acc_t = acc_r.clone()
    ref.run("accumulate_moments_", acc_r, x, shift)
    tri.run("accumulate_moments_", acc_t, x, shift)
    assert torch.equal(acc_t[[0, 3, 4]], acc_r[[0, 3, 4]])  # the count and the extremes are exact
    # The sums add the same float64 terms in other orders: each within (n - 1) * eps/2 * sum|terms| of the
    # exact sum (Higham 4.2), so within n * eps * sum|terms| of each other.
    d = x - shift
    eps = torch.finfo(torch.float64).eps
    for i, terms in ((1, d), (2, d * d)):
        bound = x.numel() * eps * terms.abs().sum().item()
        torch.testing.assert_close(acc_t[i], acc_r[i], rtol=0, atol=bound)


def test_every_op_is_captured_in_a_cuda_graph_and_replays_its_eager_result():
    """A training step captured in a CUDA graph (``torch.compile(mode="reduce-overhead")``, or by hand)
    captures the ``triton`` backend's ops too (the one CUDA tensors get): none may copy between host and
    device (batch_norm_moments once wrote its count from the host and broke capture); each replay gives
    the eager result."""
    from lightning_ext.kernels import get_backend
    from lightning_ext.stats import LogHistogram

    be = get_backend("triton", "cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8, 16, 5, 5, device="cuda", generator=gen) + 1
    dy = torch.randn(8, 16, 5, 5, device="cuda", generator=gen)
    mean, invstd = torch.batch_norm_stats(x, 1e-5)
    w, b = torch.randn(16, device="cuda", generator=gen), torch.randn(16, device="cuda", generator=gen)
    count = torch.tensor(float(x.numel() // 16), device="cuda")
    s1, s2, _, _ = torch.batch_norm_backward_reduce(dy, x, mean, invstd, w, True, False, False)
    sums, shift = torch.cat([s1, s2]).float(), torch.zeros(16, device="cuda", dtype=torch.float64)
    grads = [torch.randn(1000, device="cuda", generator=gen), torch.randn(7, 3, device="cuda", generator=gen)]
    inv = torch.tensor(0.5, device="cuda")
    edges = LogHistogram(0.01, (1e-3, 1e3)).edges().cuda()
    hist = torch.zeros(2 * edges.numel() + 1, device="cuda", dtype=torch.float64)
    empty = torch.tensor([0, 0, 0, float("inf"), -float("inf")], device="cuda", dtype=torch.float64)
    acc, center = empty.clone(), torch.tensor(1.0, device="cuda", dtype=torch.float64)
    work = [g.clone() for g in grads]  # static addresses, as a captured step's gradients have

    def unscale():
        for w, g in zip(work, grads):
            w.copy_(g)
        return be.run("unscale_and_check_", work, inv), *(w.clone() for w in work)

    calls = {
        "batch_norm_moments": lambda: be.run("batch_norm_moments", x, shift),
        "batch_norm_elemt": lambda: be.run("batch_norm_elemt", x, mean, invstd, w, b),
        "batch_norm_backward_reduce": lambda: be.run("batch_norm_backward_reduce", dy, x, mean),
        "batch_norm_backward_elemt": lambda: be.run(
            "batch_norm_backward_elemt", dy, x, mean, invstd, w, sums, count
        ),
        "unscale_and_check_": unscale,
        "check_finite": lambda: be.run("check_finite", grads, torch.device("cuda")),
        "accumulate_moments_": lambda: (
            acc.copy_(empty),
            be.run("accumulate_moments_", acc, x, center),
            acc.clone(),
        )[-1],
        "accumulate_histogram_": lambda: (
            hist.zero_(),
            be.run("accumulate_histogram_", hist, x, edges),
            hist.clone(),
        )[-1],
    }
    for op, call in calls.items():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager = call()  # warm-up outside the capture: compilation, caches
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, msg=lambda m, op=op: f"{op}: {m}")
