"""``torch.library`` registration: opcheck of every custom op, and ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ext.kernels import get_backend


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    x = r(3, 5, 4, 3).to(memory_format=torch.channels_last)
    return {
        "x": x,
        "dy": r(3, 5, 4, 3),
        "mean": r(5),
        "invstd": r(5).abs() + 0.5,
        "weight": r(5),
        "bias": r(5),
        "grads": [r(7), r(2, 3).half()],
        "inv_scale": torch.tensor(0.25),
        "acc": torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64),
        "shift": torch.tensor(0.5, dtype=torch.float64),
    }


def test_opcheck_custom_ops(backend):
    """Schemas, fake (meta) implementations and dispatch of each op, checked by torch itself."""
    key = backend.key
    i = _inputs()
    count = torch.full((5,), 36.0)
    s1, s2 = torch.randn(5), torch.randn(5)
    ops = torch.ops.lightning_ext
    cases = [
        (ops.batch_norm_stats, (i["x"], key)),
        (ops.batch_norm_elemt, (i["x"], i["mean"], i["invstd"], i["weight"], i["bias"], key)),
        (ops.batch_norm_elemt, (i["x"], i["mean"], i["invstd"], None, None, key)),
        (ops.batch_norm_backward_reduce, (i["dy"], i["x"], i["mean"], i["invstd"], key)),
        (
            ops.batch_norm_backward_elemt,
            (i["dy"], i["x"], i["mean"], i["invstd"], i["weight"], s1, s2, count, key),
        ),
        (ops.unscale_and_check_, (i["grads"], i["inv_scale"], key)),
        (ops.accumulate_moments_, (i["acc"], i["x"], i["shift"], key)),
    ]
    for op, args in cases:
        torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )


def _all_ops(backend, x, dy, mean, invstd, weight, bias, grads, inv_scale, acc, shift):
    count, m, m2 = backend.batch_norm_stats(x)
    y = backend.batch_norm_elemt(x, mean, invstd, weight, bias)
    s1, s2 = backend.batch_norm_backward_reduce(dy, x, mean, invstd)
    dx = backend.batch_norm_backward_elemt(dy, x, mean, invstd, weight, s1, s2, count)
    found = backend.unscale_and_check_(grads, inv_scale)
    backend.accumulate_moments_(acc, y, shift)
    return count, m, m2, y, s1, s2, dx, found


@pytest.mark.parametrize("compiler", ["graph", "aot_eager"])
def test_compile_fullgraph_calls_custom_ops(compiler):
    """Every op traces as one custom-op node: no graph break (fullgraph=True) and no decomposition."""
    torch._dynamo.reset()
    backend = get_backend("reference", "cpu")
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        if compiler == "graph":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    compiled = torch.compile(lambda **kw: _all_ops(backend, **kw), fullgraph=True, backend=record)
    eager_in, comp_in = _inputs(), _inputs()
    expected = _all_ops(backend, **eager_in)
    got = compiled(**comp_in)
    for name in ("batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce",
                 "batch_norm_backward_elemt", "unscale_and_check_", "accumulate_moments_"):  # fmt: skip
        assert any(f"lightning_ext.{name}" in s for s in seen), f"{name} not in graph: {seen}"
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(comp_in["acc"], eager_in["acc"])  # mutations happened in place
    for e, g in zip(eager_in["grads"], comp_in["grads"]):
        torch.testing.assert_close(g, e)


def test_compile_fullgraph_through_autograd():
    """The autograd.Functions around stats/elemt trace too; gradients match eager."""
    torch._dynamo.reset()
    backend = get_backend("reference", "cpu")

    def loss(x, w, b):
        count, mean, m2 = backend.batch_norm_stats(x)
        invstd = (m2 / count + 1e-5).rsqrt()
        return backend.batch_norm_elemt(x, mean, invstd, w, b).square().sum()

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 5, 5, generator=gen).requires_grad_()
    w, b = torch.randn(3, generator=gen).requires_grad_(), torch.randn(3, generator=gen).requires_grad_()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    expected = torch.autograd.grad(loss(x, w, b), (x, w, b))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    # Cross-check the maths against torch's own batch norm.
    xr = x.detach().clone().requires_grad_()
    torch.nn.functional.batch_norm(xr, None, None, w, b, training=True, eps=1e-5).square().sum().backward()
    torch.testing.assert_close(expected[0], xr.grad, atol=1e-4, rtol=1e-4)
