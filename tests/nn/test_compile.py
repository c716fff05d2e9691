"""SyncBatchNorm under ``torch.compile(fullgraph=True)`` with the default (inductor) backend.

Two spawned gloo ranks with uneven shards of different data (one step with an empty shard, one with
no sample at all) train a small conv net whose batch norms are SyncBatchNorm
(``convert_sync_batchnorm``), once eager and once compiled, from the same weights: outputs, every
gradient, running statistics and ``num_batches_tracked`` agree step by step, in training and in eval
mode. A compiled net that skipped the collective would normalize with its shard's statistics, far
outside the tolerance; one whose ranks took different paths (a host read on the empty rank only)
would hang. A backend without compile support falls back to eager.

Tolerance: the SyncBatchNorm kernels are the same functions in both runs (the compiled graph calls
them as custom ops), but inductor generates its own code around them (convolution bias gradients,
ReLU masks, the loss's sum) and may sum float32 terms in another order: ``n·u·Σ|terms|`` with
``u = 2**-24`` and at most a few hundred terms per sum, below ``1e-5`` of the largest magnitude. The
collective differs too: eager ranks reduce through shared memory, the compiled graph through gloo
(float64 payload, last bits only).

The workers run with ``groups_outlive=True``: dynamo keeps each compiled function as a global of
``torch._dynamo.external_utils``, and the graph holds the process group (``torch._dynamo.reset()``
does not drop them).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import lightning_ext
from lightning_ext.kernels import ReferenceBackend, registry
from lightning_ext.nn import SyncBatchNorm, convert_sync_batchnorm
from tests.helpers.distributed import run_distributed
from tests.helpers.simulated_group import simulate_a_group

C = 4
# Per step, the batch of rank 0 and of rank 1. The conv net gets no empty shard: inductor's code for
# ATen's convolution backward of an empty batch fails its own stride check (torch 2.13), so the empty
# shards go through a Linear net.
SHARDS = {"conv": [(3, 5), (4, 2)], "linear": [(3, 0), (0, 0)]}
STEPS = 2
RTOL, ATOL = 1e-5, 1e-6  # relative to the largest magnitude of each tensor (module docstring)


def _net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(nn.Linear(2, C), SyncBatchNorm(C), nn.ReLU(), nn.Linear(C, 3))
    net = nn.Sequential(
        nn.Conv2d(2, C, 3), nn.BatchNorm2d(C), nn.ReLU(),
        nn.Conv2d(C, C, 3, bias=False), nn.BatchNorm2d(C, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(C, 3),
    )  # fmt: skip
    return convert_sync_batchnorm(net)


def _record(model: nn.Module, y: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"y": y.detach().clone()}
    out.update({f"grad.{k}": p.grad.clone() for k, p in model.named_parameters()})
    out.update({f"buffer.{k}": b.clone() for k, b in model.named_buffers()})
    return out


def _compiled_vs_eager_worker(rank: int, world_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Per net: ``STEPS`` SGD steps and one eval forward, eager and compiled; this rank's records."""
    return {f"{kind}.{label}": out for kind in SHARDS for label, out in _compare(kind, rank).items()}


def _compare(kind: str, rank: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(100 + rank)
    shape = (2, 7, 7) if kind == "conv" else (2,)
    # Shards of different data: the statistics must be global.
    batches = [1.5 * torch.randn(n[rank], *shape) + rank for n in [*SHARDS[kind], (3, 3)]]
    eager = _net(kind)
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True)
    runs = {"eager": (eager, eager), "compiled": (compiled_module, compiled)}
    records: dict[str, list[dict[str, torch.Tensor]]] = {}
    for label, (module, call) in runs.items():
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        records[label] = []
        for x in batches[:STEPS]:
            y = call(x)
            y.square().sum().backward()
            records[label].append(_record(module, y))
            optimizer.step()
            optimizer.zero_grad()
        module.eval()
        records[label].append({"y": call(batches[STEPS]).detach().clone()})
    return records


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not actual.is_floating_point() or not actual.numel():
        assert torch.equal(actual, expected), what
        return
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL + RTOL * scale, msg=what)


@pytest.mark.timeout(600)
def test_compiled_fullgraph_inductor_matches_eager_on_two_ranks():
    # inductor builds on both ranks of a 2-core host: ~40 s idle, past 200 s on a loaded one
    results = run_distributed(_compiled_vs_eager_worker, 2, timeout=560, groups_outlive=True)
    for rank, records in enumerate(results):
        for kind in SHARDS:
            compiled, eager = records[f"{kind}.compiled"], records[f"{kind}.eager"]
            for step, (ours, theirs) in enumerate(zip(compiled, eager, strict=True)):
                assert ours.keys() == theirs.keys()
                for key in ours:
                    _assert_close(ours[key], theirs[key], f"{kind} net, rank {rank}, step {step}: {key}")
    # Every rank holds the same running statistics, which the eval forward used.
    for kind in SHARDS:
        last = [records[f"{kind}.compiled"][STEPS - 1] for records in results]
        for key, value in last[0].items():
            if key.startswith("buffer."):
                torch.testing.assert_close(value, last[1][key], rtol=0, atol=0, msg=f"{kind}: {key}")


@pytest.mark.timeout(120)
def test_first_backend_lookup_inside_the_graph(monkeypatch):
    """With the backend cache empty (a fresh ``ddp_spawn`` worker, a new device, here a reset) the
    graph's first lookup selects and loads the backend outside the graph: no break, same results."""
    simulate_a_group(monkeypatch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, C), SyncBatchNorm(C, momentum=None), nn.ReLU())
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    for step in range(2):
        lightning_ext.reset()
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(step))
        y = compiled(x)
        torch.testing.assert_close(y, eager(x), rtol=0, atol=0)
    torch.testing.assert_close(model[1].running_var, eager[1].running_var, rtol=0, atol=0)
    torch._dynamo.reset()


class _EagerOnlyBackend(ReferenceBackend):
    """``reference``'s ops, declared unable to run under ``torch.compile``."""

    name = "eager-only-test"
    supports_compile = False


@pytest.fixture
def eager_only_backend():
    registry.register_backend(_EagerOnlyBackend.name, _EagerOnlyBackend, devices=("cpu",), priority=-1)
    try:
        yield _EagerOnlyBackend.name
    finally:
        registry._entries.pop(_EagerOnlyBackend.name, None)
        registry.clear_backend_cache()


@pytest.mark.timeout(120)
def test_backend_without_compile_support_runs_eagerly_with_one_warning(eager_only_backend, monkeypatch):
    """One process as a rank (:func:`simulate_a_group`: the kernels' path): without ``fullgraph`` the
    layers run eagerly at a graph break, with ONE warning for both layers and all steps, and the same
    results as eager; with ``fullgraph=True`` torch.compile raises instead of breaking the graph."""
    simulate_a_group(monkeypatch)
    torch._dynamo.reset()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(3, C), SyncBatchNorm(C, momentum=None, backend=eager_only_backend), nn.ReLU(),
            nn.Linear(C, C), SyncBatchNorm(C, momentum=None, backend=eager_only_backend),
        )  # fmt: skip

    eager, compiled = net(), net()
    call = torch.compile(compiled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(6, 3, generator=torch.Generator().manual_seed(step))
            y, expected = call(x), eager(x)
            y.sum().backward()
            expected.sum().backward()
            torch.testing.assert_close(y, expected, rtol=0, atol=0)
    fallbacks = [w for w in caught if "does not support torch.compile" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "'eager-only-test'" in str(fallbacks[0].message)
    assert fallbacks[0].category is RuntimeWarning
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(compiled[1].running_var, eager[1].running_var, rtol=0, atol=0)

    torch._dynamo.reset()  # else the graph of the first compile, breaks included, serves the second
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_untraced_function"):
        torch.compile(net(), fullgraph=True)(torch.randn(6, 3))
    torch._dynamo.reset()
