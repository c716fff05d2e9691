"""``report()`` called inside a ``torch.compile``-d module's forward, collected by ``Collector.update()``.

A tiny module reports a per-sample tensor and a Python number from its forward; ``FLUSHES`` intervals
of ``STEPS`` forward/backward steps each end with ``Collector.update()``, compiled (inductor, the
default backend) and eager on the same inputs. More flushes than dynamo's recompile limit (8), so
a compiled forward that is traced again at every flush shows.

Tolerance of the means: the reported tensor is computed by inductor's fused code in the compiled
run and by ATen in the eager one (float32, ``u = 2**-24``, a 4-term mean and a square root): a few
``u`` relative; the counts are exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ext.stats import Collector, clear_statistics, report

FLUSHES, STEPS = 10, 2
NAMES = ("Activation/rms", "Const/one")


@pytest.fixture(autouse=True)
def _clean_state():
    clear_statistics()
    torch._dynamo.reset()
    yield
    clear_statistics()
    torch._dynamo.reset()


class _Reporting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        report("Activation/rms", y.detach().square().mean(dim=1).sqrt())
        report("Const/one", 1.0)
        return y


def _collect(call) -> list[dict[str, tuple[int, float]]]:
    """Per flush: ``(num, mean)`` of each name."""
    clear_statistics()
    collector = Collector(regex=".*")
    flushes = []
    for flush in range(FLUSHES):
        for step in range(STEPS):
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * flush + step))
            call(x).sum().backward()
        collector.update()
        flushes.append({name: (collector.num(name), collector.mean(name)) for name in NAMES})
    return flushes


def _assert_same(compiled: list[dict], eager: list[dict]) -> None:
    for flush, (ours, theirs) in enumerate(zip(compiled, eager, strict=True)):
        for name in NAMES:
            assert ours[name][0] == theirs[name][0] == (5 * STEPS if name != "Const/one" else STEPS), (
                f"flush {flush}, {name}: num {ours[name][0]} compiled vs {theirs[name][0]} eager"
            )
            assert ours[name][1] == pytest.approx(theirs[name][1], rel=1e-6), f"flush {flush}, {name}"


@pytest.mark.timeout(180)
def test_values_reported_in_a_compiled_forward_match_eager():
    """Default ``torch.compile`` (graph breaks allowed): the same counts and means at every flush."""
    eager = _collect(_Reporting())
    _assert_same(_collect(torch.compile(_Reporting())), eager)


@pytest.mark.timeout(180)
def test_report_compiles_with_fullgraph_once_for_every_flush():
    """``fullgraph=True``: no graph break, no trace per flush, the same values as eager."""
    eager = _collect(_Reporting())
    _assert_same(_collect(torch.compile(_Reporting(), fullgraph=True)), eager)


@pytest.mark.timeout(180)
def test_the_stage_of_a_compiled_report_is_read_when_it_runs():
    """One compiled graph serves training and validation: the stage is the one set at run time."""
    from lightning_ext.stats import set_stage

    model = torch.compile(_Reporting(), fullgraph=True)
    train, val = Collector(regex="Const/.*"), Collector(regex="Const/.*", stage="validate")
    x = torch.randn(5, 3)
    model(x)
    set_stage("validate")
    try:
        with torch.no_grad():
            model(x)
            model(x)
    finally:
        set_stage(None)
    train.update()
    val.update()
    assert (train.num("Const/one"), val.num("Const/one")) == (1, 2)


@pytest.mark.timeout(180)
def test_numpy_scalars_are_one_node_under_fullgraph():
    # dynamo traces a NumPy scalar as a 0-dim array: report() read its dtype, which dynamo cannot trace
    # (fullgraph=True raised; without it, the graph broke)
    import numpy as np

    clear_statistics()
    collector = Collector()
    def step(x, v):
        report("v", v)
        return x * 2

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for value in (np.float64(0.5), np.float32(1.5), np.int64(4)):
        compiled(torch.ones(3), value)
    collector.update()
    assert (collector.num("v"), collector.mean("v")) == (3, 2.0)


@pytest.mark.timeout(180)
def test_set_stage_inside_a_compiled_function_breaks_the_graph():
    # Traced, set_stage took effect after the graph had run: the values reported after it inside the
    # graph went to the stage outside (a validation value into training statistics).
    from lightning_ext.stats import set_stage

    def step(x):
        previous = set_stage("validate")
        report("v", x)
        set_stage(previous)
        report("t", x)
        return x * 2

    clear_statistics()
    train, val = Collector(), Collector(stage="validate")
    torch.compile(step, backend="eager")(torch.ones(2))
    train.update(), val.update()
    assert (train.names(), val.names()) == (["t"], ["v"])
    torch._dynamo.reset()  # (else the frames compiled above serve the call)
    with pytest.raises(Exception, match="graph_break"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.ones(2))
    set_stage(None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rank", [0, 1])
def test_report0_compiles_with_fullgraph_on_every_rank(rank):
    """``report0`` on a rank other than 0 registers the name only: it did so with a list, which broke
    the graph there (``fullgraph=True`` raised on those ranks while rank 0 waited in the flush)."""
    from lightning_ext.stats import init_multiprocessing, report0

    clear_statistics()
    init_multiprocessing(rank, None)  # (as TrainingStats' setup on that rank; nothing reduced)
    collector = Collector()

    @torch.compile(fullgraph=True)
    def step(x):
        report0("Opt/lr", torch.tensor(0.1))
        return x * 2

    try:
        for _ in range(3):
            step(torch.ones(3))
        collector.update()
        assert collector.names() == ["Opt/lr"] and collector.num("Opt/lr") == (3 if rank == 0 else 0)
    finally:
        clear_statistics()
