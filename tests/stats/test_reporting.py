"""report(), report0(), clear_statistics() and init_multiprocessing() in one process."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from lightning_ext.stats import Collector, clear_statistics, init_multiprocessing, report, report0, set_stage
from tests.helpers.float64_reference import assert_moments_close


@pytest.fixture(autouse=True)
def _clean_state():
    clear_statistics()
    yield
    clear_statistics()


def _check(c: Collector, name: str, values: list[float] | torch.Tensor, lanes: bool = False) -> None:
    """The collector's statistics of ``name`` against the correctly rounded moments of ``values``.

    In one process every value of an interval goes into ONE float64 accumulator per device (no
    merge), so the tolerance is the rounding bound of one shifted summation in any order
    (``tests/helpers/float64_reference.py``).
    """
    got = {stat: getattr(c, stat)(name) for stat in ("num", "mean", "std", "min", "max")}
    assert_moments_close(got, torch.as_tensor(values, dtype=torch.float64), name, lanes=lanes)


def test_report_returns_value_itself_for_every_kind() -> None:
    Collector()
    t = torch.randn(3, 4)
    arr = np.arange(6).reshape(2, 3)
    for value in (1.5, 3, True, np.float32(2.5), [1.0, 2.0], (4, 5), arr, t, torch.tensor(7), []):
        assert report("V", value) is value


def test_every_value_kind_accumulates_to_the_float64_moments_of_its_numbers() -> None:
    """Every kind of value becomes the same float64 numbers in the one accumulator of its device.

    Python and NumPy numbers, sequences and arrays, tensors of every dtype, large ones and
    non-contiguous views all land in the kernel backend's ``accumulate_moments_``, which sums
    ``x - shift`` and ``(x - shift)²`` in float64 in its own order (lanes, blocks, threads). The
    reference sums the same numbers with ``math.fsum``; the tolerance is the bound derived in
    ``tests/helpers/float64_reference.py``: about ``N·eps·Σ|x - c|/N`` on the mean and
    ``5·N·eps·Σ(x - c)²`` on ``m2`` (``N`` about 1e6 here, so ~1e-9 of ``m2``), not one CPU's rounding.
    """
    c = Collector()
    gen = torch.Generator().manual_seed(3)
    grid = torch.randn(6, 7, generator=gen, dtype=torch.float64) * 100
    values: list[object] = [
        1.5,
        3,
        True,
        np.float32(2.5),
        np.int64(-7),
        np.float64(0.1),
        [1.0, 2.0],
        (4, 5),
        np.arange(6).reshape(2, 3),
        np.array([[0.25, -0.5]], dtype=np.float32),
        torch.tensor([[0.1, 0.2]], dtype=torch.float16),
        torch.tensor([-1e3, 1e3, 3.3], dtype=torch.bfloat16),
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.arange(-20, 20, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(7.25),  # 0-dim
        torch.linspace(-3, 7, 101, dtype=torch.float16).reshape(1, 101),
        (torch.rand(1_000_003, generator=gen) * 2e3 - 1e3).to(torch.float32),  # several blocks/threads
        grid.t(),  # non-contiguous: transposed
        grid[::2, 1::3],  # non-contiguous: strided
        torch.tensor([2.0, -1.0]).expand(4, 2),  # stride 0
        torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1)[1:],
    ]
    numbers: list[float] = []
    for value in values:
        assert report("V", value) is value
        as_tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        numbers += as_tensor.to(torch.float64).reshape(-1).tolist()  # exact: every dtype fits float64
    c.update()
    _check(c, "V", numbers)


@pytest.mark.parametrize("order", ["bad first", "bad last"])
@pytest.mark.parametrize(
    "bad",
    [[math.inf], [-math.inf], [math.inf, -math.inf], [math.nan], [math.nan, math.inf, -math.inf]],
    ids=["inf", "-inf", "both", "nan", "all"],
)
def test_non_finite_values_are_counted_apart_whatever_their_position(bad, order) -> None:
    """NaN and ±inf count in ``nonfinite`` only: ``num``, ``mean``, ``std``, ``min`` and ``max`` are those
    of the finite values, also when the name's first value (the accumulator's shift) is not finite."""
    c = Collector()
    finite = torch.tensor([2.0, 5.0, 3.0])
    parts = [torch.tensor(bad), finite] if order == "bad first" else [finite, torch.tensor(bad)]
    for part in parts:
        report("X", part)
    report("X", 4.0)
    report("X", math.nan)  # a Python number too
    c.update()
    assert (c.num("X"), c.nonfinite("X")) == (4, len(bad) + 1)
    _check(c, "X", [2.0, 5.0, 3.0, 4.0])
    report("Only/bad", [math.nan, math.inf])
    c.update()
    assert (c.num("Only/bad"), c.nonfinite("Only/bad")) == (0, 2)
    assert all(math.isnan(getattr(c, stat)("Only/bad")) for stat in ("mean", "std", "min", "max"))
    # X kept (keep_previous: its whole row, the non-finite count too), not updated
    assert c.updated() == ["Only/bad"] and (c.mean("X"), c.nonfinite("X")) == (3.5, len(bad) + 1)


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
            self.lin = torch.nn.Linear(4, 16)

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
    _check(c, "Act/lin", torch.cat([o.double().reshape(-1) for o in outs]), lanes=True)  # float32 tensors


def test_stable_std_when_mean_dominates() -> None:
    """1e9 + N(0, 1): std within the shifted-sum bound (~1e-10 relative here), where the textbook
    ``Σx² - (Σx)²/n`` in float64 loses everything (its rounding, ~eps·Σx², is ~1e6 times ``m2``)."""
    gen = torch.Generator().manual_seed(0)
    x = 1e9 + torch.randn(4000, generator=gen, dtype=torch.float64)
    c = Collector()
    for v in x[:1000].tolist():  # Python numbers, one at a time
        report("Big/py", v)
    report("Big/t", x[:2000])
    report("Big/t", x[2000:])
    c.update()
    _check(c, "Big/py", x[:1000])
    _check(c, "Big/t", x)
    naive_m2 = float(x.square().sum() - x.sum() ** 2 / x.numel())
    assert abs(naive_m2 - c.std("Big/t") ** 2 * x.numel()) > 1e-3 * x.numel()  # the check discriminates


def test_a_non_finite_first_value_keeps_the_std_of_the_rest() -> None:
    """An interval whose first value is NaN: its shift was 0, and float32 values far from 0 (squared in
    float32 by the ``cpu`` backend) published a std of 0.0 for a batch whose std is 0.816, and one
    0.44 % low for a run of scalar losses."""
    gen = torch.Generator().manual_seed(0)
    batch = 1e4 + torch.arange(1000, dtype=torch.float32) % 3
    losses = [float("nan"), *(2.0 + 1e-3 * torch.randn(200, generator=gen)).float()]  # 0-dim float32
    c = Collector()
    report("Loss/batch", torch.cat([torch.tensor([float("nan")]), batch]))
    for loss in losses:
        report("Loss/step", loss if isinstance(loss, torch.Tensor) else torch.tensor(loss))
    c.update()
    _check(c, "Loss/batch", batch.double(), lanes=True)
    _check(c, "Loss/step", torch.stack(losses[1:]).double(), lanes=True)
    assert c.nonfinite("Loss/batch") == c.nonfinite("Loss/step") == 1


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
        (3, 1.0, r"report\(name, value\): `name` must be a str, got int 3"),
        (["a"], 1.0, r"report\(name, value\): `name` must be a str, got list \['a'\]"),
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
    clear_statistics()  # also when nobody collects the name
    with pytest.raises(TypeError, match=match):
        report(name, value)


@pytest.mark.parametrize("name", ["", "a\x1fb", "Loss\n", "x\ty", "\x00"])
def test_names_with_control_characters_are_refused_once_per_name(name, monkeypatch) -> None:
    """An empty name or one with a control character (the old stage separator ``\\x1f``, a newline, ...)
    raises a ``ValueError`` naming it, on every path (wanted or not, staged, report0); a good name is
    checked at its first report in a stage only."""
    match = r"^report\(name, value\): `name` must be a non-empty str of printable characters, without control"
    for fn in (report, report0):
        with pytest.raises(ValueError, match=match):
            fn(name, 1.0)
    Collector()
    with pytest.raises(ValueError, match=match):
        report(name, 1.0)
    previous = set_stage("validate")
    with pytest.raises(ValueError, match=match):
        report(name, 1.0)
    set_stage(previous)
    from lightning_ext.stats import reporting

    report("Good", 1.0)
    monkeypatch.setattr(reporting, "check_label", lambda *args: pytest.fail("checked again"))
    report("Good", 2.0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"])
def test_every_real_dtype_is_accepted_and_converted_exactly(dtype) -> None:
    """The dtypes the kernels do not read are converted (uint16/32/64 to float64, float8 to float32:
    exactly, below 2^53) on every backend path."""
    values = torch.tensor([0.0, 1.0, 2.0, 3.0, 96.0]).to(getattr(torch, dtype))
    c = Collector(quantiles="V")
    report("V", values)
    c.update()
    _check(c, "V", [0.0, 1.0, 2.0, 3.0, 96.0])
    assert c.histogram("V")[0].sum() == 5


def test_a_python_int_beyond_float_range_names_the_statistic() -> None:
    for wanted in (False, True):
        if wanted:
            Collector()
        for fn in (report, report0):
            with pytest.raises(
                OverflowError, match=r"^report\('Big', value\): 1000000.* beyond float64's range"
            ):
                fn("Big", 10**400)
    report("Big", 10**300)  # a large int within range: a float
    with pytest.raises(TypeError, match=r"report\('Big', value\): value must be a number"):
        report("Big", [10**400])  # NumPy reads it as an object: not a number


def _uncountable() -> dict[str, torch.Tensor]:
    """Tensors whose elements ``report()`` cannot count: no strided storage of real numbers."""
    pair = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    return {
        "meta": torch.ones(3, device="meta"),
        "sparse_coo": torch.eye(2).to_sparse(),
        "sparse_csr": torch.eye(2).to_sparse_csr(),
        "mkldnn": torch.ones(2).to_mkldnn(),
        "nested": torch.nested.nested_tensor(pair),
        "jagged": torch.nested.nested_tensor(pair, layout=torch.jagged),
        "quantized": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
        # sub-byte and bits dtypes: the kernel raised NotImplementedError, the name already registered
        **{n: torch.empty(2, dtype=getattr(torch, n)) for n in ("uint4", "int3", "bits8", "float4_e2m1fn_x2")
           if hasattr(torch, n)},
    }


@pytest.mark.parametrize("kind", sorted(_uncountable()))
def test_a_tensor_without_real_strided_storage_is_refused_and_nothing_else_is_lost(kind: str) -> None:
    bad = _uncountable()[kind]
    match = (
        rf"^report\('Bad', value\): value must be a tensor of real numbers in strided storage, got an? ?\w* "
        rf"{re.escape(str(bad.dtype))} tensor on device {bad.device} with layout {bad.layout}\. HINT: report"
    )
    c = Collector()
    report("Good", 1.0)
    for fn in (report, report0):
        with pytest.raises(TypeError, match=match):
            fn("Bad", bad)
    report("Good", torch.tensor([2.0, 3.0]))
    c.update()
    assert c.names() == ["Good"] and c.num("Good") == 3 and c.mean("Good") == 2.0
    report("Good", 4.0)
    c.update()  # the next interval too
    assert c.num("Good") == 1 and c.mean("Good") == 4.0
    clear_statistics()  # also when nobody collects the name
    with pytest.raises(TypeError, match=match):
        report("Bad", bad)


def test_report0_keeps_only_rank_zero_values_and_registers_elsewhere() -> None:
    c = Collector()
    assert report0("LR", 0.5) == 0.5
    init_multiprocessing(rank=1, sync_device=None)
    assert report0("LR", 0.25) == 0.25
    report0("Only1", 3.0)
    c.update()
    assert c.num("LR") == 1 and c.mean("LR") == 0.5
    assert "Only1" in c.names() and c.num("Only1") == 0


def test_report0_off_rank_zero_registers_for_collectors_and_stages_that_come_later() -> None:
    """Off rank zero a name is registered once per stage: a collector created later (a validation
    collector made at the first validation) and another stage still get it, and a bad value still
    raises after the name is known."""
    init_multiprocessing(rank=1, sync_device=None)
    train = Collector()
    for _ in range(3):
        report0("LR", 0.25)
    train.update()
    late, val = Collector(), Collector(stage="validate")
    report0("LR", 0.25)
    previous = set_stage("validate")
    report0("LR", 0.25)
    set_stage(previous)
    for collector in (train, late, val):
        collector.update()
        assert collector.names() == ["LR"] and collector.num("LR") == 0
    with pytest.raises(TypeError, match="report\\('LR', value\\)"):
        report0("LR", "0.25")


def test_init_multiprocessing_validates_arguments() -> None:
    with pytest.raises(TypeError, match=r"^init_multiprocessing: `rank` must be an int >= 0, got '0' \(str"):
        init_multiprocessing("0", None)
    with pytest.raises(TypeError, match=r"`rank` must be an int >= 0, got True \(bool\)$"):
        init_multiprocessing(True, None)
    with pytest.raises(ValueError, match=r"^init_multiprocessing: `rank` must be an int >= 0, got -1$"):
        init_multiprocessing(-1, None)
    allowed = r"must be a torch.device or a device str such as 'cpu' or 'cuda:0' or None, got"
    with pytest.raises(TypeError, match=rf"^init_multiprocessing: `sync_device` {allowed} 3 \(int\)$"):
        init_multiprocessing(0, 3)
    with pytest.raises(ValueError, match=rf"^init_multiprocessing: `sync_device` {allowed} 'gpu0'$"):
        init_multiprocessing(0, "gpu0")  # (torch's own RuntimeError before)
    init_multiprocessing(0, "cpu")  # a world of one: update() still works without collectives
    c = Collector()
    report("A", 1.0)
    c.update()
    assert c.mean("A") == 1.0


def test_a_collector_dying_while_a_name_is_routed_loses_the_others_nothing() -> None:
    """A collector dies when the garbage collector frees it, in any allocation: here while report()
    routes a new name (the name's routes are made then). The live collector after it still gets the
    name, at once and later (the route is kept)."""
    import gc

    dying, live = Collector(regex="x"), Collector(regex="x")
    held = [dying]
    del dying

    def wants(name: str) -> bool:  # the dying collector is asked first: the collection happens here
        held.clear()
        gc.collect()
        return True

    held[0]._store._wants = wants
    report("x", 1.0)
    report("x", 3.0)
    live.update()
    assert live.names() == ["x"] and (live.num("x"), live.mean("x")) == (2, 2.0)


def test_clear_statistics_detaches_collectors_and_clears_pending() -> None:
    c = Collector()
    report("A", 1.0)
    clear_statistics()
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_and_python_numbers_of_one_process_publish_every_name_right() -> None:
    """A one-GPU job reports CUDA tensors (its loss) and Python numbers (a rate, a peak): the rows of
    both devices merge at the flush, and every name comes out as one accumulator over all its values
    would give (the merged means were once read as a strided view: only the first name was right)."""
    clear_statistics()
    c = Collector(quantiles="Loss/.*")
    gen = torch.Generator(device="cuda").manual_seed(0)
    loss = 3.0 + torch.rand(64, device="cuda", generator=gen, dtype=torch.float64)
    values = {"Loss/train": [*loss.tolist(), 2.5], "Peak/flops": [989.4e12], "Rate/samples": [1e15, 2e15]}
    report("Loss/train", loss)
    for name, numbers in values.items():
        for v in numbers[-1:] if name == "Loss/train" else numbers:
            report(name, v)
    report("Other/cuda", loss[:3].float())
    values["Other/cuda"] = loss[:3].float().tolist()
    c.update()
    for name, v in values.items():
        assert_moments_close(
            {stat: getattr(c, stat)(name) for stat in ("num", "mean", "std", "min", "max")},
            torch.tensor(v, dtype=torch.float64), name, merges=1,
        )  # fmt: skip
    median = float(torch.tensor(values["Loss/train"]).median())  # of 65 values: the middle one
    assert c.quantile("Loss/train", 0.5) == pytest.approx(median, rel=0.01)
    # The next interval holds its own values only: the merged rows' devices were emptied, sketch too
    report("Loss/train", loss[:5] + 1.0)
    report("Loss/train", 9.0)
    c.update()
    again = torch.tensor([*(loss[:5] + 1.0).tolist(), 9.0], dtype=torch.float64)
    second = {stat: getattr(c, stat)("Loss/train") for stat in ("num", "mean", "std", "min", "max")}
    assert_moments_close(second, again, "Loss/train, second interval", merges=1)
    assert c.histogram("Loss/train")[0].sum() == 6
    clear_statistics()


def test_rows_are_reused_across_intervals_for_changing_name_sets() -> None:
    """Each interval's statistics are exactly its own values, whatever the names do between drains:
    the same names again (rows reused), a subset (rows gathered), more names than a block holds
    (blocks added, then merged), and a mostly idle set (rows forgotten)."""
    c = Collector(keep_previous=False)
    gen = torch.Generator().manual_seed(0)
    for interval, names in enumerate(
        [range(10), range(10), range(0, 10, 3), range(300), range(300), range(5), [7, 2, 250]]
    ):
        values = {n: (torch.randn(3, generator=gen) * 10 + interval).tolist() for n in names}
        for n in reversed(list(names)):  # not in sorted order: the drain permutes the rows
            report(f"N/{n}", values[n][0])  # a Python number first: the shift of this interval
            report(f"N/{n}", torch.tensor(values[n][1:], dtype=torch.float64))
        c.update()
        for n, v in values.items():
            _check(c, f"N/{n}", v)
        assert set(c.names()) >= {f"N/{n}" for n in names}
        assert all(c.num(name) == 0 for name in c.names() if int(name[2:]) not in values)


def test_backend_is_resolved_once_per_device_until_clear_statistics(monkeypatch) -> None:
    from lightning_ext.kernels import BACKEND_ENV_VAR

    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")
    c = Collector()
    report("A", 1.0)  # the CPU backend of this collector's values is resolved here
    monkeypatch.setenv(BACKEND_ENV_VAR, "no-such-backend")  # not looked up again by report()
    report("A", torch.ones(3))
    c.update()
    report("A", 2.0)
    c.update()
    assert c.mean("A") == 2.0
    clear_statistics()  # forgets the choice: the next report looks the backend up again
    c = Collector()
    with pytest.raises(ValueError, match="no-such-backend"):
        report("A", 1.0)
    monkeypatch.setenv(BACKEND_ENV_VAR, "reference")
    c = Collector()
    report("A", torch.tensor([3.0, 5.0]))
    c.update()
    assert c.mean("A") == 4.0


def test_rows_grown_and_drained_in_inference_mode_serve_training_afterwards() -> None:
    """New names in Lightning's validation (inference mode) grow and reorder the rows there; the
    accumulators made then still take training values (normal tensors), and every interval is exact."""
    clear_statistics()
    c = Collector(keep_previous=False)
    with torch.inference_mode():
        for n in reversed(range(150)):  # more than a block, out of order: merged and sorted at the drain
            report(f"N/{n:03d}", float(n))
        c.update()
    assert c.num("N/149") == 1 and c.mean("N/007") == 7.0
    x = torch.ones(3, requires_grad=True)
    for n in range(150):
        report(f"N/{n:03d}", x * n)  # training: outside inference mode
    c.update()
    assert [c.num(f"N/{n:03d}") for n in (0, 77, 149)] == [3, 3, 3] and c.mean("N/077") == 77.0
