"""``torch.library`` registration: opcheck of every custom op for every backend, and
``torch.compile(fullgraph=True)`` through the ops and through :class:`~lightning_ext.nn.SyncBatchNorm`."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch

from lightning_ext.kernels import OPS as REGISTERED
from lightning_ext.kernels import KernelBackend
from lightning_ext.nn import SyncBatchNorm
from tests.helpers.simulated_group import simulate_a_group
from tests.kernels.conftest import backend_device

OPS = [
    "batch_norm_moments",
    "batch_norm_gather_stats",
    "batch_norm_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
    "unscale_and_check_",
    "check_finite",
    "accumulate_moments_",
    "moments_payload_",
    "moments_finish_",
    "accumulate_histogram_",
    "pack_windows_",
]


def _inputs(device: torch.device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    values = {
        "x": r(3, 5, 4, 3).to(memory_format=torch.channels_last),
        "dy": r(3, 5, 4, 3),
        "shift_c": r(5).double(),
        "mean": r(5),
        "invstd": r(5).abs() + 0.5,
        "weight": r(5),
        "bias": r(5),
        "grads": [r(7), r(2, 3).half()],
        "inv_scale": torch.tensor(0.25),
        "acc": torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf, 0.0], dtype=torch.float64),
        "shift": torch.tensor(0.5, dtype=torch.float64),
        # a flush of 3 names: their accumulator rows and shifts, both payloads (random, as after the
        # all-reduces; the MAX with a head of 2), what was published before, the idle counts
        "table": torch.cat([torch.tensor([[2.0], [0.0], [3.0]]), r(3, 4), torch.ones(3, 1)], 1).double(),
        "shifts": r(3).double(),
        "max_payload": r(3 + 5 * 3).double(),
        "sum_payload": torch.cat([torch.tensor([[2.0], [0.0], [3.0]]), r(3, 4).abs()], 1).double(),
        "published": r(3, 6).double(),
        "next_shift": r(3).double(),
        "idle": torch.tensor([0.0, 4.0, 1.0]).double(),
        "flags": torch.zeros(2).double(),
        # two sketch rows (name 0's values, name 2's rank means) of a histogram of 3 edges
        "at": torch.tensor([0, 2]),
        "hist": torch.zeros(1, 7).double(),
    }
    return {k: [t.to(device) for t in v] if isinstance(v, list) else v.to(device) for k, v in values.items()}


def test_every_op_is_registered():
    """The op list below covers every op of a backend: a new op cannot skip the opcheck."""
    assert sorted(OPS) == sorted(REGISTERED)
    for name in OPS:
        assert hasattr(torch.ops.lightning_ext, name), name


def test_eager_use_imports_no_dynamo():
    """A process that imports the package (``lightning_ext.nn`` included) and runs the ops and a
    SyncBatchNorm forward and backward eagerly never imports ``torch._dynamo`` (only tracing needs it)."""
    script = (
        "import sys, torch, lightning_ext, lightning_ext.nn\n"
        "from lightning_ext.kernels import get_backend\n"
        "for backend in (get_backend(device='cpu'), get_backend('reference', device='cpu')):\n"
        "    x = torch.randn(4, 3)\n"
        "    backend.run('batch_norm_moments', x, torch.zeros(3), check=True)\n"
        "    backend.run('check_finite', [x], x.device)\n"
        "    acc = torch.tensor([0.0, 0.0, 0.0, float('inf'), -float('inf'), 0.0], dtype=torch.float64)\n"
        "    backend.run('accumulate_moments_', acc, x, torch.tensor(0.0, dtype=torch.float64))\n"
        "    sbn = lightning_ext.nn.sync_batch_norm  # a rank of a group whose others add nothing\n"
        "    sbn.is_distributed, sbn.get_world_size = lambda: True, lambda group=None: 2\n"
        "    sbn.all_reduce_ = lambda tensor, group=None: None\n"
        "    layer = lightning_ext.nn.SyncBatchNorm(3, momentum=None, backend=backend.name)\n"
        "    layer(torch.randn(5, 3, 2, requires_grad=True)).sum().backward()  # through the kernels\n"
        "print(backend.name, 'torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False", result.stdout


def test_a_custom_op_of_a_backend_this_process_never_built_names_the_fix():
    """A graph traced in another process may name a backend this one never built (the ops find the
    live instance by name): the op says which and how to build it, rather than a KeyError."""
    with pytest.raises(
        RuntimeError,
        match=r"^torch.ops.lightning_ext.check_finite runs kernel backend 'never_built', which this process "
        r"has not built \(a graph traced in another process\)\. HINT: call "
        r"lightning_ext.kernels.get_backend\('never_built', device\) before running it$",
    ):
        torch.ops.lightning_ext.check_finite([torch.ones(2)], torch.device("cpu"), "never_built")


def test_opcheck_custom_ops(backend: KernelBackend):
    """Schemas, fake (meta) implementations and dispatch of each op, checked by torch itself."""
    key, device = backend.name, backend_device(backend)
    i = _inputs(device)
    gen = torch.Generator().manual_seed(1)
    sums = torch.randn(10, generator=gen).to(device)
    count = torch.tensor(36.0, dtype=torch.float64, device=device)
    lib = torch.ops.lightning_ext
    payload = torch.cat(
        [torch.tensor([36.0]), torch.randn(5, generator=gen), 40 + torch.rand(5, generator=gen)]
    )
    payload = payload.double().to(device)
    running = [torch.zeros(5, device=device), torch.ones(5, device=device)]
    momentum = torch.tensor(0.1, dtype=torch.float64)
    payloads = (i["max_payload"], i["sum_payload"])
    flushed = (i["published"], i["next_shift"], i["idle"], i["flags"])
    edges = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, device=device)
    cases = [
        (lib.batch_norm_moments, (i["x"], i["shift_c"], key)),
        (lib.batch_norm_gather_stats, (payload, i["shift_c"], *running, momentum, 1e-5, key)),
        (lib.batch_norm_gather_stats, (payload, i["shift_c"], None, None, momentum, 1e-5, key)),
        (lib.batch_norm_elemt, (i["x"], i["mean"], i["invstd"], i["weight"], i["bias"], key)),
        (lib.batch_norm_elemt, (i["x"], i["mean"], i["invstd"], None, None, key)),
        (lib.batch_norm_backward_reduce, (i["dy"], i["x"], i["mean"], key)),
        (
            lib.batch_norm_backward_elemt,
            (i["dy"], i["x"], i["mean"], i["invstd"], i["weight"], sums, count, key),
        ),
        (lib.batch_norm_backward_elemt, (i["dy"], i["x"], i["mean"], i["invstd"], None, sums, count, key)),
        (lib.unscale_and_check_, (i["grads"], i["inv_scale"], key)),
        (lib.check_finite, (i["grads"], device, key)),
        (lib.accumulate_moments_, (i["acc"], i["x"], i["shift"], key)),
        (
            lib.moments_payload_,
            (*payloads, i["table"], i["shifts"], i["shifts"], [7.0, -7.0], i["at"][:1], 1, 1, key),
        ),
        (
            lib.moments_finish_,
            (*flushed, i["table"].clone(), i["shifts"].clone(), i["max_payload"][3:], i["sum_payload"],
             i["shifts"], True, 3, key),
        ),
        (lib.accumulate_histogram_, (torch.zeros(7, dtype=torch.float64, device=device), i["x"], edges, key)),
        (
            lib.pack_windows_,
            (
                torch.zeros(99, dtype=torch.float64, device=device),
                i["hist"],
                torch.zeros(3 * i["at"].numel() + 2, dtype=torch.int64, device=device),
                i["table"],
                i["shifts"],
                i["max_payload"][3:],
                i["at"],
                edges,
                5,
                16,
                key,
            ),
        ),
    ]
    assert {op._qualified_op_name.split("::")[1] for op, _ in cases} == set(OPS)
    for op, args in cases:
        torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )


def _all_ops(backend, x, dy, shift_c, mean, invstd, weight, bias, grads, inv_scale, acc, shift, **flush):
    table, shifts, published, next_shift, idle, flags = (
        flush[k] for k in ("table", "shifts", "published", "next_shift", "idle", "flags")
    )
    max_payload, sum_payload = flush["max_payload"], flush["sum_payload"]
    payload = backend.run("batch_norm_moments", x, shift_c)
    running = [torch.zeros_like(mean), torch.ones_like(mean)]
    momentum = torch.tensor(0.1, dtype=torch.float64)
    gathered_mean, _ = backend.run("batch_norm_gather_stats", payload, shift_c, *running, momentum, 1e-5)
    y = backend.run("batch_norm_elemt", x, mean, invstd, weight, bias)
    sums = backend.run("batch_norm_backward_reduce", dy, x, mean)
    dx = backend.run("batch_norm_backward_elemt", dy, x, mean, invstd, weight, sums, payload[0])
    finite = backend.run("check_finite", grads, x.device)
    found = backend.run("unscale_and_check_", grads, inv_scale)
    backend.run("accumulate_moments_", acc, y, shift)
    extremes = max_payload[3:]
    flushed, emptied = (published, next_shift, idle, flags), (table.clone(), shifts.clone())
    backend.run("moments_finish_", *flushed, *emptied, extremes, sum_payload, shifts, False, 3)
    at = flush["at"]
    backend.run(
        "moments_payload_", max_payload, sum_payload, table, shifts, shifts, [7.0, -7.0], at[:1], 1, 1
    )
    flush = (max_payload.clone(), sum_payload.clone(), *(t.clone() for t in (*flushed, *emptied)))
    hist, edges = torch.zeros(7, dtype=torch.float64, device=x.device), table.new_tensor([0.5, 1.0, 2.0])
    backend.run("accumulate_histogram_", hist, y, edges)
    words = torch.zeros(2 * 16, dtype=torch.float64, device=x.device)
    layout = torch.zeros(3 * at.numel() + 2, dtype=torch.int64, device=x.device)
    backend.run("pack_windows_", words, hist.clone()[None], layout, table, shifts, extremes, at, edges, 5, 16)
    return payload, gathered_mean, *running, y, sums, dx, *flush, hist, words, layout, finite, found


@pytest.mark.parametrize("compiler", ["graph", "aot_eager"])
def test_compile_fullgraph_calls_custom_ops(backend: KernelBackend, compiler: str):
    """Every op traces as one custom-op node: no graph break (fullgraph=True), no decomposition, and
    the compiled function gives eager's results bit for bit (the same kernels on the same inputs)."""
    torch._dynamo.reset()
    device = backend_device(backend)
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        if compiler == "graph":
            return gm.forward
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    compiled = torch.compile(lambda **kw: _all_ops(backend, **kw), fullgraph=True, backend=record)
    eager_in, comp_in = _inputs(device), _inputs(device)
    comp_in["grads"][1][1, 2] = eager_in["grads"][1][1, 2] = math.inf  # a found_inf of 1
    expected = _all_ops(backend, **eager_in)
    got = compiled(**comp_in)
    for name in OPS:
        assert any(f"lightning_ext.{name}" in s for s in seen), f"{name} not in graph: {seen}"
    assert got[-1].item() == got[-2].item() == 1.0
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
    # The mutations happened in place, on the caller's tensors.
    torch.testing.assert_close(comp_in["acc"], eager_in["acc"], atol=0, rtol=0)
    for e, g in zip(eager_in["grads"], comp_in["grads"]):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_compile_sync_batch_norm_training_matches_eager(backend: KernelBackend, monkeypatch):
    """``SyncBatchNorm``'s training path through the kernels (one process as a rank:
    :func:`simulate_a_group`; ``momentum=None``, the cumulative average) compiles whole under AOT
    autograd: output, every gradient and the running statistics equal eager's over three steps."""
    simulate_a_group(monkeypatch)
    torch._dynamo.reset()
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(2)
    eager = SyncBatchNorm(5, momentum=None, backend=backend.name, device=device)
    with torch.no_grad():
        eager.weight.copy_(torch.rand(5, generator=gen) + 0.5)
        eager.bias.copy_(torch.randn(5, generator=gen))
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for step in range(3):
        x = (torch.randn(6, 5, 4, 3, generator=gen) * (step + 1) + step).to(device)
        x = x.contiguous(memory_format=torch.channels_last)
        dy = torch.randn(x.shape, generator=gen).to(device)
        outs = []
        for m, fn in ((eager, eager), (module, compiled)):
            xi = x.clone().requires_grad_()
            y = fn(xi)
            y.backward(dy)
            outs.append((y, xi.grad, m.weight.grad, m.bias.grad))
            m.weight.grad = m.bias.grad = None
        # Eager and compiled call the same kernels on the same inputs; only the scalar glue around them
        # (invstd, the running-statistics update) goes through AOT's decompositions, which may round
        # each of its few elementwise ops differently: a few float32 ulps of the values' scale.
        for what, e, c in zip(("y", "dx", "grad_weight", "grad_bias"), *outs):
            tol = 8 * torch.finfo(torch.float32).eps * e.abs().max().item()
            torch.testing.assert_close(c, e, atol=tol, rtol=0, msg=lambda m, w=what, s=step: f"{w} {s}: {m}")
    # The running statistics are float32 buffers updated from float64 statistics: 8 ulps of float32.
    for name in ("running_mean", "running_var"):
        e, c = getattr(eager, name), getattr(module, name)
        torch.testing.assert_close(c, e, atol=0, rtol=8 * torch.finfo(torch.float32).eps, msg=name)
    assert int(module.num_batches_tracked) == int(eager.num_batches_tracked) == 3


@pytest.mark.parametrize("layout", ["(N, L, C) transposed", "NCHW with H and W swapped", "channels_last"])
def test_the_elementwise_ops_fakes_have_the_kernels_strides(backend: KernelBackend, layout: str):
    """The output of ``batch_norm_elemt`` and ``batch_norm_backward_elemt`` has the strides their fakes
    say, in any dense layout: inductor checks them (a SyncBatchNorm over ``h.transpose(1, 2)``, the
    BatchNorm1d-over-a-sequence pattern, failed to compile: the fakes kept the input's strides, the
    kernels write contiguous outputs there)."""
    device, key = backend_device(backend), backend.name
    gen = torch.Generator().manual_seed(3)
    x = {
        "(N, L, C) transposed": lambda: torch.randn(3, 7, 4, generator=gen).transpose(1, 2),
        "NCHW with H and W swapped": lambda: torch.randn(2, 4, 5, 3, generator=gen).transpose(2, 3),
        "channels_last": lambda: torch.randn(2, 4, 3, 5, generator=gen).to(memory_format=torch.channels_last),
    }[layout]().to(device)
    dy = torch.randn(x.shape, generator=gen).to(device)
    mean, invstd, weight = (torch.rand(4, generator=gen).to(device) + 0.5 for _ in range(3))
    sums = torch.randn(8, generator=gen).to(device)
    count = torch.tensor(21.0, dtype=torch.float64, device=device)
    lib = torch.ops.lightning_ext
    for op, args in (
        (lib.batch_norm_elemt, (x, mean, invstd, weight, None, key)),
        (lib.batch_norm_backward_elemt, (dy, x, mean, invstd, weight, sums, count, key)),
    ):
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert fake.stride() == op(*args).stride(), (op, layout)
