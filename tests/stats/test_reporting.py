"""report(), report0(), reset() and init_multiprocessing() in one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_ext.stats import Collector, init_multiprocessing, report, report0, reset
from lightning_ext.stats.moments import moments_of


@pytest.fixture(autouse=True)
def _clean_state():
    reset()
    yield
    reset()


def _check(c: Collector, name: str, values: list[float] | torch.Tensor) -> None:
    ref = moments_of(torch.as_tensor(values, dtype=torch.float64))
    n, mean, m2, lo, hi = ref.tolist()
    assert c.num(name) == n
    assert c.mean(name) == pytest.approx(mean, rel=1e-12, abs=1e-12)
    assert c.std(name) == pytest.approx(math.sqrt(m2 / n), rel=1e-9, abs=1e-12)
    assert (c.min(name), c.max(name)) == (lo, hi)


def test_report_returns_value_itself_for_every_kind() -> None:
    Collector()
    t = torch.randn(3, 4)
    arr = np.arange(6).reshape(2, 3)
    for value in (1.5, 3, True, np.float32(2.5), [1.0, 2.0], (4, 5), arr, t, torch.tensor(7), []):
        assert report("V", value) is value


def test_every_value_kind_accumulates_in_float64() -> None:
    c = Collector()
    report("V", 1.5)
    report("V", 3)
    report("V", True)
    report("V", np.float32(2.5))
    report("V", [1.0, 2.0])
    report("V", (4, 5))
    report("V", np.arange(6).reshape(2, 3))
    report("V", torch.tensor([[0.1, 0.2]], dtype=torch.float16))
    report("V", torch.tensor([1, 2, 3], dtype=torch.int32))
    report("V", torch.tensor([True, False]))
    report("V", torch.tensor([-1e3, 1e3], dtype=torch.bfloat16))
    # Larger CPU tensors take NumPy on the host, the largest the kernel backend's accumulate_moments_.
    big_half = torch.linspace(-3, 7, 101, dtype=torch.float16).reshape(1, 101)
    big_int = torch.arange(-20, 20, dtype=torch.int64)
    huge = torch.linspace(-1, 2, 70_001, dtype=torch.float32)
    report("V", big_half)
    report("V", big_int)
    report("V", huge)
    c.update()
    half = torch.tensor([0.1, 0.2], dtype=torch.float16).double().tolist()
    values = [1.5, 3, 1, 2.5, 1, 2, 4, 5, 0, 1, 2, 3, 4, 5, *half, 1, 2, 3, 1, 0, -1e3, 1e3]
    _check(
        c,
        "V",
        values + big_half.double().reshape(-1).tolist() + big_int.double().tolist() + huge.double().tolist(),
    )


def test_host_path_and_kernel_path_agree() -> None:
    c = Collector()
    gen = torch.Generator().manual_seed(3)
    x = 5e5 + torch.randn(64, generator=gen, dtype=torch.float64)
    for chunk in x.split(4):  # 4 elements: host path
        report("Host", chunk)
    report("Kernel", x)  # 64 elements: kernel path
    c.update()
    for stat in ("num", "mean", "std", "min", "max"):
        assert getattr(c, stat)("Host") == pytest.approx(getattr(c, stat)("Kernel"), rel=1e-12)


@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_numpy_host_path_equals_kernel_path(monkeypatch, dtype, bad) -> None:
    """CPU tensors of 17..65536 elements (NumPy on the host) give what the kernel backend gives,
    inf and NaN included, mixed with numbers and small tensors under the same name."""
    from lightning_ext.stats import reporting

    gen = torch.Generator().manual_seed(5)
    chunks = [(3e2 + torch.randn(n, generator=gen, dtype=torch.float64) * 7) for n in (17, 300, 4099)]
    chunks = [x.round().to(dtype) if dtype == torch.int64 else x.to(dtype) for x in chunks]
    if bad is not None and dtype != torch.int64:
        chunks[1][123] = bad
    results = {}
    for path, limit in (("numpy", 1 << 16), ("kernel", 16)):
        reset()
        monkeypatch.setattr(reporting, "_HOST_ARRAY_MAX_NUMEL", limit)
        c = Collector()
        report("X", 2.5)
        for x in chunks:
            report("X", x.reshape(-1, 1) if x.numel() == 300 else x)  # any shape
        report("X", torch.tensor([1.0, -4.0]))
        c.update()
        results[path] = [getattr(c, stat)("X") for stat in ("num", "mean", "std", "min", "max")]
    for a, b in zip(results["numpy"], results["kernel"]):
        assert a == pytest.approx(b, rel=1e-12, nan_ok=True)


def test_empty_value_registers_name_and_adds_nothing() -> None:
    c = Collector()
    report("Empty/list", [])
    report("Empty/tensor", torch.zeros(0, 3))
    report("Empty/array", np.zeros((2, 0)))
    c.update()
    assert c.names() == ["Empty/array", "Empty/list", "Empty/tensor"]
    for name in c.names():
        assert c.num(name) == 0 and math.isnan(c.mean(name)) and math.isnan(c.std(name))
        assert math.isnan(c.min(name)) and math.isnan(c.max(name))


def test_report_inside_forward_under_no_grad_autocast_and_inference_mode() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 16)  # 80 outputs: the kernel path

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            report("Act/lin", y)
            return y

    c = Collector()
    net = Net()
    x = torch.randn(5, 4)
    outs = []
    with torch.inference_mode():  # first report happens in inference mode (as in Lightning validation)
        outs.append(net(x))
    with torch.no_grad():
        outs.append(net(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs.append(net(x))
    out = net(x)
    out.sum().backward()  # the graph is intact: report() detached its copy
    outs.append(out.detach())
    assert net.lin.weight.grad is not None
    c.update()
    _check(c, "Act/lin", torch.cat([o.double().reshape(-1) for o in outs]))


def test_stable_std_when_mean_dominates() -> None:
    gen = torch.Generator().manual_seed(0)
    x = 1e9 + torch.randn(4000, generator=gen, dtype=torch.float64)
    c = Collector()
    for v in x[:1000].tolist():  # Python fast path
        report("Big/py", v)
    report("Big/t", x[:2000])
    report("Big/t", x[2000:])
    c.update()
    for name, part in (("Big/py", x[:1000]), ("Big/t", x)):
        ref = moments_of(part)
        assert c.mean(name) == pytest.approx(float(ref[1]), rel=1e-15)
        assert c.std(name) == pytest.approx(math.sqrt(float(ref[2] / ref[0])), rel=1e-6)


def test_names_nobody_collects_are_not_accumulated_but_still_checked() -> None:
    report("Early", 1.0)  # before any collector: nobody will see it
    c = Collector(regex="Loss/.*")
    report("Other", 2.0)
    with pytest.raises(TypeError, match=r"report\('Other', value\): value must be a number"):
        report("Other", "text")
    report("Loss/x", 3.0)
    late = Collector()  # created after: sees only what follows
    report("Loss/x", 5.0)
    report("Early", 7.0)
    c.update()
    late.update()
    assert c.names() == ["Loss/x"] and c.num("Loss/x") == 2
    assert late.names() == ["Early", "Loss/x"] and late.mean("Loss/x") == 5.0 and late.mean("Early") == 7.0


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (3, 1.0, r"name must be a str, got int 3"),
        (["a"], 1.0, r"name must be a str, got list \['a'\]"),
        ("S", "1.0", r"report\('S', value\): value must be a number.*got str '1.0'"),
        ("S", object(), r"report\('S', value\): value must be a number.*got object"),
        ("S", ["a", "b"], r"report\('S', value\): value must be a number"),
        ("S", [1.0, [2.0, 3.0]], r"report\('S', value\): cannot read"),
        ("S", 1 + 2j, r"report\('S', value\): value must be a number.*complex"),
        (
            "S",
            torch.ones(2, dtype=torch.complex64),
            r"report\('S', value\): complex tensors are not supported",
        ),
        ("S", None, r"report\('S', value\): value must be a number.*NoneType"),
    ],
)
def test_bad_input_raises_type_error_naming_the_name(name, value, match) -> None:
    Collector()
    for fn in (report, report0):
        with pytest.raises(TypeError, match=match):
            fn(name, value)
    reset()  # also when nobody collects the name
    with pytest.raises(TypeError, match=match):
        report(name, value)


def test_report0_keeps_only_rank_zero_values_and_registers_elsewhere() -> None:
    c = Collector()
    assert report0("LR", 0.5) == 0.5
    init_multiprocessing(rank=1, sync_device=None)
    assert report0("LR", 0.25) == 0.25
    report0("Only1", 3.0)
    c.update()
    assert c.num("LR") == 1 and c.mean("LR") == 0.5
    assert "Only1" in c.names() and c.num("Only1") == 0


def test_init_multiprocessing_validates_arguments() -> None:
    with pytest.raises(TypeError, match=r"rank=\.\.\.\) must be an int, got '0'"):
        init_multiprocessing("0", None)
    with pytest.raises(ValueError, match=r"rank=\.\.\.\) must be >= 0, got -1"):
        init_multiprocessing(-1, None)
    with pytest.raises(
        TypeError, match=r"sync_device=\.\.\.\) must be a torch.device, a string or None, got 3"
    ):
        init_multiprocessing(0, 3)
    init_multiprocessing(0, "cpu")  # a world of one: update() still works without collectives
    c = Collector()
    report("A", 1.0)
    c.update()
    assert c.mean("A") == 1.0


def test_reset_detaches_collectors_and_clears_pending() -> None:
    c = Collector()
    report("A", 1.0)
    reset()
    report("A", 2.0)  # no live registered collector any more
    c.update()
    assert c.names() == []
    fresh = Collector()
    report("A", 3.0)
    fresh.update()
    c.update()
    assert fresh.mean("A") == 3.0 and c.names() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_report_of_cuda_tensors_never_syncs_host_and_device() -> None:
    c = Collector()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = 1e3 + torch.randn(1000, device="cuda", generator=gen, dtype=torch.float32)  # fp16-representable
    report("G", x[:1])  # first call creates the device accumulators and picks the backend
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        for _ in range(3):
            report("G", x)
            report("G", x[:1])  # small CUDA tensors stay on the device too
            with torch.autocast("cuda", dtype=torch.float16):
                report("G", x.half())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    c.update()
    values = torch.cat([x[:1], *[torch.cat([x, x[:1], x.half().float()]) for _ in range(3)]])
    _check(c, "G", values.double().cpu())
