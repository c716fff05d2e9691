"""``accumulate_moments_`` of every backend against float64 maths, within the bound of summing in
another order; non-finite values counted apart; the flush ops ``moments_payload_`` and
``moments_finish_`` of every backend bit for bit against ``reference``."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.conftest import backend_device

EPS64 = torch.finfo(torch.float64).eps
U32 = 2.0**-24  # float32 unit roundoff


def _fresh():
    return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf, 0.0], dtype=torch.float64)


def _order_bound(terms: torch.Tensor) -> float:
    """How far two float64 sums of ``terms`` in different orders (or trees) may differ: each has error at
    most (n - 1) * eps/2 * sum|terms| (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2),
    plus eps/2 * |term| each where a kernel rounds the term itself differently (e.g. an FMA for
    ``d * d``): n * eps * sum|terms| in all."""
    return terms.numel() * EPS64 * terms.abs().sum().item()


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64], ids=str
)
def test_accumulate_moments(backend, dtype):
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(4099, generator=gen, dtype=torch.float64) * 3 + 1000,  # large offset: shift matters
        # 5 interpreted blocks on 3 programs: several blocks per program, a partial last one.
        torch.randn(16389, generator=gen, dtype=torch.float64) * 2 + 990,
        torch.randn(7, 3, generator=gen, dtype=torch.float64).t() + 1000,  # non-contiguous
        # one stride throughout: reshape(-1) is a strided view, not a copy (a kernel must not read stride 1)
        (torch.randn(2 * 3001, generator=gen, dtype=torch.float64) + 1000)[::2],
        torch.randn(1, generator=gen, dtype=torch.float64) + 1000,
        torch.randn(0, 5, generator=gen, dtype=torch.float64),  # empty: adds nothing
    ]
    xs = [((x * 10).round().to(dtype) if dtype == torch.int64 else x.to(dtype)).to(device) for x in xs]
    shift = xs[0].reshape(-1)[0].to(torch.float64)
    acc = _fresh().to(device)
    for x in xs:
        backend.run("accumulate_moments_", acc, x, shift)
    acc, shift = acc.cpu(), shift.cpu()
    allv = torch.cat([x.reshape(-1).double().cpu() for x in xs])
    d = allv - shift  # exact (Sterbenz: every value is within a factor 2 of the shift), on every backend
    assert acc[0].item() == allv.numel()
    # The kernels sum the same float64 terms as this truth in another order (blocks, lanes, atomics).
    b1, b2 = _order_bound(d), _order_bound(d * d)
    if backend.name == "cpu" and dtype.is_floating_point and dtype != torch.float64:
        # Float32 element arithmetic: d is exact here (Sterbenz), d*d is off by u*d^2, and a lane
        # sums at most 32 terms in float32 before float64 takes them (31u of their magnitudes).
        b1, b2 = b1 + 31 * U32 * d.abs().sum().item(), b2 + 32 * U32 * (d * d).sum().item()
    torch.testing.assert_close(acc[1], d.sum(), rtol=0, atol=b1)
    torch.testing.assert_close(acc[2], (d * d).sum(), rtol=0, atol=b2)
    assert acc[3].item() == allv.min().item() and acc[4].item() == allv.max().item() and acc[5].item() == 0
    # The variance from the shifted sums is accurate despite the offset of 1000: var = (S2 - S1^2/n)/n
    # with |dS1| <= b1, |dS2| <= b2 gives |dvar| <= (b2 + (2|S1| b1 + b1^2) / n) / n, and the truth
    # (two-pass, float64) is within n * eps * var of the exact variance.
    n = acc[0].item()
    s1 = acc[1].item()
    var = (acc[2] - acc[1] ** 2 / n) / n
    truth = allv.var(unbiased=False)
    bound = (b2 + (2 * abs(s1) * b1 + b1 * b1) / n) / n + n * EPS64 * truth.item()
    torch.testing.assert_close(var, truth, rtol=0, atol=bound)


def _published(backend, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """One rank's ``[n, mean, std, min, max]`` of ``x`` as ``report()`` and a flush publish it:
    ``accumulate_moments_``, then ``moments_payload_`` and ``moments_finish_`` (no collective)."""
    f64 = {"dtype": torch.float64, "device": x.device}
    acc = _fresh().to(x.device)
    backend.run("accumulate_moments_", acc, x, shift)
    center = shift.reshape(1)
    max_payload, sum_payload = torch.zeros(8, **f64), torch.zeros(1, 5, **f64)
    none = torch.zeros(0, dtype=torch.int64, device=x.device)
    backend.run(
        "moments_payload_", max_payload, sum_payload, acc.view(1, 6), center, center, [1.0, -1.0], none, 0, 1
    )
    published, next_shift, idle = torch.zeros(1, 6, **f64), torch.zeros(1, **f64), torch.zeros(1, **f64)
    flags, none = torch.zeros(2, **f64), torch.zeros(0, 6, **f64)
    backend.run("moments_finish_", published, next_shift, idle, flags, none, none[:, 0], max_payload[3:],
                sum_payload, center, False, 0)  # fmt: skip
    return published[0, :5].cpu()


def _magnitudes(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` values of random sign and log-uniform magnitude in [1e-30, 3e38], clipped to ``dtype``'s max."""
    gen = torch.Generator().manual_seed(seed)
    exponent = torch.rand(n, generator=gen, dtype=torch.float64) * (math.log10(3e38) + 30) - 30
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    return (sign * 10**exponent).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)


_HUGE = [  # the cases of the issue: float32 sums of squares (or of values) would overflow
    ([1e20, 2e20, 3e20], torch.float32),
    ([3e38, 3e38, -3e38], torch.float32),
    ([3e38, 3.3e38, -3e38, 1.0], torch.bfloat16),
    ([65504.0, -65504.0, 6e-8, 65504.0], torch.float16),
    ([1e-30, 3e-30, 2e-30], torch.float32),  # squares below float32's smallest normal
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [3, 1023, 4099])
@pytest.mark.parametrize("shift_at", ["first", "zero"])
def test_every_backend_publishes_finite_moments_of_any_finite_values(backend, reference, dtype, n, shift_at):
    """Values of every magnitude up to the dtype's largest, both signs: every backend publishes the
    float64 mean and std (finite), within the bound of its documented arithmetic, and agrees with
    ``reference`` within twice that bound."""
    device = backend_device(backend)
    cases = [(_magnitudes(n, dtype, seed=n), dtype)] + [(torch.tensor(v).to(d), d) for v, d in _HUGE]
    for x, dt in cases:
        if dt != dtype:
            continue
        v = x.double()
        shift = v[0] if shift_at == "first" else torch.zeros((), dtype=torch.float64)
        got = _published(backend, x.to(device), shift.to(device))
        ref = _published(reference, x, shift)
        # float64 truth, correctly rounded sums (math.fsum)
        values = v.tolist()
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((a - mean) ** 2 for a in values) / len(values))
        # The documented arithmetic: float64 terms summed in any order (n eps of the summed
        # magnitudes), or float32 terms in runs of 32 (34 u of them) for low-precision input; the mean
        # takes S1 / n, the std (S2 - S1^2 / n) / n to first order (plus the final roundings).
        d = v - shift
        b1 = (len(values) * EPS64 + 34 * U32) * d.abs().sum().item()
        b2 = (len(values) * EPS64 + 34 * U32) * (d * d).sum().item()
        s1 = d.sum().item()
        m2_bound = b2 + (2 * abs(s1) * b1 + b1 * b1) / len(values)
        mean_tol = b1 / len(values) + 4 * EPS64 * abs(mean)
        std_tol = (
            m2_bound / (2 * len(values) * std) + 4 * EPS64 * std if std else math.sqrt(m2_bound / len(values))
        )
        where = (
            f"{backend.name} {dt} n={len(values)} shift={shift_at}: got {got.tolist()}, float64 {mean}, {std}"
        )
        assert torch.isfinite(got).all(), where
        assert (
            got[0].item() == len(values)
            and got[3].item() == v.min().item()
            and got[4].item() == v.max().item()
        )
        assert abs(got[1].item() - mean) <= mean_tol, where
        assert abs(got[2].item() - std) <= std_tol, where
        assert abs(got[1].item() - ref[1].item()) <= 2 * mean_tol, where
        assert abs(got[2].item() - ref[2].item()) <= 2 * std_tol, where


def test_accumulate_moments_keeps_previous_extremes(backend):
    device = backend_device(backend)
    f64 = lambda *v: torch.tensor(v, dtype=torch.float64, device=device)
    z = f64(0.0).reshape(())
    acc = f64(2.0, 1.0, 5.0, -50.0, 50.0, 1.0)
    backend.run("accumulate_moments_", acc, torch.tensor([3.0, 4.0], device=device), z)
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0, 1.0]
    backend.run("accumulate_moments_", acc, torch.tensor([], device=device), z)
    assert acc.tolist() == [4.0, 8.0, 30.0, -50.0, 50.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [1, 7, 1023, 4099])
def test_non_finite_values_are_counted_apart_and_hide_nothing(backend, dtype, n):
    """NaN, +inf and -inf anywhere (first, last, in every lane and block) are counted in the sixth column
    and leave the count, sums and extremes of the finite values exactly as without them."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(n)
    finite = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 10).to(dtype)
    bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype).repeat(n)[: max(1, n // 3)]
    mixed = torch.cat([bad[:1], finite, bad[1:]])[torch.randperm(n + bad.numel(), generator=gen)]
    mixed = torch.cat([bad[:1], mixed, bad[:1]])  # first and last too
    shift = finite[0].double().to(device)
    with_bad, without = _fresh().to(device), _fresh().to(device)
    backend.run("accumulate_moments_", with_bad, mixed.to(device), shift)
    backend.run("accumulate_moments_", without, finite.to(device), shift)
    assert with_bad[5].item() == mixed.numel() - n
    assert with_bad[0].item() == n and with_bad[3:5].tolist() == without[3:5].tolist()
    # The same terms (and zeros for the non-finite) in other lanes and blocks: twice the order bound,
    # and float32 runs of at most 32 terms on the cpu backend.
    d = finite.double() - finite[0].double()
    for k, terms in ((1, d), (2, d * d)):
        bound = 2 * (_order_bound(terms) + 32 * U32 * terms.abs().sum().item())
        assert abs(with_bad[k].item() - without[k].item()) <= bound, (k, with_bad.tolist(), without.tolist())
    only_bad = _fresh().to(device)
    backend.run("accumulate_moments_", only_bad, bad.to(device), shift)
    assert only_bad.tolist() == [0.0, 0.0, 0.0, math.inf, -math.inf, float(bad.numel())]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int64], ids=str)
def test_a_nan_shift_becomes_the_first_value(backend, dtype):
    """A row's shift is NaN until its first finite value: the op sets it to the first finite element of
    ``x`` and sums about it (a shift of 0 for data far from 0 lost the variance to float32 squares); an
    empty ``x``, or one without a finite element, leaves the shift NaN."""
    device = backend_device(backend)
    cases = [([3.0, 5.0], 3.0, [2.0, 2.0, 4.0, 3.0, 5.0, 0.0]), ([], math.nan, _fresh().tolist())]
    if dtype.is_floating_point:
        cases.append(([math.inf, 1.0, 2.0], 1.0, [2.0, 1.0, 1.0, 1.0, 2.0, 1.0]))
        cases.append(([math.nan, -math.inf], math.nan, [0.0, 0.0, 0.0, math.inf, -math.inf, 2.0]))
    for values, shift_want, acc_want in cases:
        acc, shift = _fresh().to(device), torch.tensor(math.nan, dtype=torch.float64, device=device)
        backend.run("accumulate_moments_", acc, torch.tensor(values, dtype=dtype, device=device), shift)
        assert shift.item() == shift_want or (math.isnan(shift_want) and math.isnan(shift.item())), values
        assert acc.tolist() == acc_want, (values, acc.tolist())


# ---------------------------------------------------------------------------- the flush ops


def _flush_inputs(r: int, seed: int) -> dict[str, torch.Tensor]:
    """Random accumulator rows of ``r`` names (some empty, some with non-finite values only, one jump of
    1e9) and the state of a previous flush."""
    gen = torch.Generator().manual_seed(seed)
    f64 = {"dtype": torch.float64, "generator": gen}
    n = torch.randint(0, 5, (r,), generator=gen).double() * (torch.rand(r, generator=gen) > 0.2)
    shifts = torch.randn(r, **f64) * 100
    s1 = torch.randn(r, **f64) * n
    s2 = s1 * s1 / n.clamp_min(1) + torch.rand(r, **f64) * n  # S2 >= S1^2 / n
    lo = shifts - torch.rand(r, **f64)
    nonfinite = torch.randint(0, 3, (r,), generator=gen).double() * (torch.rand(r, generator=gen) > 0.5)
    rows = torch.stack([n, s1, s2, lo, lo + 2 * torch.rand(r, **f64), nonfinite], 1)
    rows[n == 0, :5] = torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)
    if r >= 4:
        shifts[3] += 1e9  # far from the previous center
    center = torch.randn(r, **f64) * 100
    center[: min(r, 1)] = math.nan  # a non-finite center counts as 0
    published, next_shift = torch.randn(r, 6, **f64), torch.randn(r, **f64)
    idle = torch.randint(0, 4, (r,), generator=gen).double()
    return dict(rows=rows, shifts=shifts, center=center, published=published, next_shift=next_shift,
                idle=idle)  # fmt: skip


def _flush(backend, i: dict[str, torch.Tensor], keep_previous: bool, device) -> list[torch.Tensor]:
    i = {k: v.to(device, copy=True) for k, v in i.items()}  # the state is updated in place
    r, head = i["rows"].shape[0], [7.0, -7.0, 2.0**52, -(2.0**52)]
    max_payload = torch.empty(len(head) + 1 + 5 * r, dtype=torch.float64, device=device)
    sum_payload = torch.empty(r, 5, dtype=torch.float64, device=device)
    counted = torch.arange(0, r, 2, device=device)  # the bound: the largest count of every other row
    args = (i["rows"], i["shifts"], i["center"], head, counted, 5, 3)
    backend.run("moments_payload_", max_payload, sum_payload, *args)
    payloads = (max_payload.clone(), sum_payload.clone())
    state = (i["published"], i["next_shift"], i["idle"], torch.zeros(2, dtype=torch.float64, device=device))
    rows = (i["rows"], i["shifts"])  # emptied unless again
    backend.run("moments_finish_", *state, *rows, max_payload[5:], sum_payload, i["center"], keep_previous, 2)
    return [t.cpu() for t in (*payloads, *state, *rows)]


@pytest.mark.parametrize("r", [0, 1, 7, 300])
@pytest.mark.parametrize("keep_previous", [True, False])
def test_flush_ops_match_reference_bitwise(backend, reference, r, keep_previous):
    """The same float64 operations in the same order (no FMA): equal bit for bit, NaN where NaN, but the
    published std within one unit in the last place (torch's float64 ``sqrt`` on CPU is not always
    correctly rounded; ``std::sqrt`` is)."""
    for seed in range(3):
        i = _flush_inputs(r, seed)
        got = _flush(backend, i, keep_previous, backend_device(backend))
        want = _flush(reference, i, keep_previous, torch.device("cpu"))
        torch.testing.assert_close(got[2][:, 2], want[2][:, 2], rtol=EPS64, atol=0, equal_nan=True)
        got[2][:, 2] = want[2][:, 2]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        emptied = [_fresh().expand(r, 6), torch.full((r,), math.nan, dtype=torch.float64)]
        torch.testing.assert_close(want[6:], emptied, rtol=0, atol=0, equal_nan=True)  # (one rank: no again)


def test_finish_keeps_the_rows_when_a_name_must_be_reduced_again(backend):
    """Two ranks' payloads about a center far from both rank means (cancellation): ``again``, and the
    accumulator rows stay for the second reduction; about the largest rank mean, published and emptied."""
    device = backend_device(backend)
    f64 = {"dtype": torch.float64, "device": device}
    ranks = [torch.tensor([[2.0, 0.0, 2.0, 1e9 - 1, 1e9 + 1, 0.0]], **f64),  # values 1e9 +- 1
             torch.tensor([[2.0, 0.0, 8.0, 1e9 + 8, 1e9 + 12, 0.0]], **f64)]  # 1e9 + 10 +- 2
    shifts = [torch.tensor([1e9], **f64), torch.tensor([1e9 + 10], **f64)]
    for center, again in ((torch.zeros(1, **f64), True), (torch.tensor([1e9 + 10], **f64), False)):
        payloads = []
        for rank, (rows, shift) in enumerate(zip(ranks, shifts)):
            max_payload, sum_payload = torch.empty(3 + 5, **f64), torch.empty(1, 5, **f64)
            none = torch.zeros(0, dtype=torch.int64, device=device)
            backend.run("moments_payload_", max_payload, sum_payload, rows, shift, center, [1.0, -1.0], none,
                        rank, 1)  # fmt: skip
            payloads.append((max_payload, sum_payload))
        max_payload = torch.maximum(payloads[0][0], payloads[1][0])
        sum_payload = payloads[0][1] + payloads[1][1]
        published, next_shift, idle = torch.zeros(1, 6, **f64), torch.zeros(1, **f64), torch.zeros(1, **f64)
        flags = torch.zeros(2, **f64)
        rows, shift = ranks[0].clone(), shifts[0].clone()
        backend.run("moments_finish_", published, next_shift, idle, flags, rows, shift, max_payload[3:],
                    sum_payload, center, True, 0)  # fmt: skip
        assert flags.tolist() == [float(again), 0.0]
        if again:
            assert rows.equal(ranks[0]) and shift.equal(shifts[0])
        else:
            assert rows.tolist() == [_fresh().tolist()] and shift.isnan().all()
            assert published.tolist()[0][:2] == [4.0, 1e9 + 5]


def test_flush_ops_publish_non_finite_counts_forget_idle_rows_and_pack_ranks(backend):
    """A row whose values were all non-finite publishes ``num = 0``, NaN statistics and its count (not
    the previous values); a row without values keeps them (``keep_previous``) and counts one more idle
    flush; the packed rank mean carries the rank in its low bits, ``-inf`` without values."""
    device = backend_device(backend)
    f64 = {"dtype": torch.float64, "device": device}
    inf = math.inf
    rows = torch.tensor([[2, 0, 2, 1, 3, 0], [0, 0, 0, inf, -inf, 4], [0, 0, 0, inf, -inf, 0]], **f64)
    shifts, center = torch.tensor([2.0, 0.0, 0.0], **f64), torch.zeros(3, **f64)
    max_payload, sum_payload = torch.empty(3 + 15, **f64), torch.empty(3, 5, **f64)
    counted = torch.tensor([0, 1], device=device)
    args = (rows, shifts, center, [1.0, -1.0], counted, 3, 2)
    backend.run("moments_payload_", max_payload, sum_payload, *args)
    packed = max_payload[-3:].cpu()
    assert max_payload[2].item() == 2.0  # the bound: the largest count of rows 0 and 1
    assert packed[1:].tolist() == [-inf, -inf] and packed[0].view(torch.int64).item() & 3 == 3
    assert abs(packed[0].item() - 2.0) <= 4 * 2.0**-52 * 2.0
    published = torch.full((3, 6), 9.0, **f64)
    next_shift, idle = torch.zeros(3, **f64), torch.tensor([5.0, 5.0, 1.0], **f64)
    out = torch.zeros(2, **f64)
    args = (rows, shifts, max_payload[3:], sum_payload, center, True, 2)
    backend.run("moments_finish_", published, next_shift, idle, out, *args)
    got = published.cpu().tolist()
    assert got[0] == [2.0, 2.0, 1.0, 1.0, 3.0, 0.0] and got[2] == [9.0] * 6
    assert got[1][0] == 0.0 and all(math.isnan(v) for v in got[1][1:5]) and got[1][5] == 4.0
    assert idle.cpu().tolist() == [0.0, 0.0, 2.0] and out.cpu().tolist() == [0.0, 1.0]
    assert next_shift.cpu().tolist() == [2.0, 0.0, 0.0]


def test_flush_ops_give_the_moments_of_one_rank(backend):
    """One rank: the payloads reduce to themselves; count, mean (exactly), std, extremes of the data."""
    device = backend_device(backend)
    x = torch.tensor([[3.0, 5.0, 10.0], [1e9 + 1, 1e9 + 2, 1e9 + 6]], dtype=torch.float64)
    shifts = x[:, 0].clone()
    d = x - shifts[:, None]
    three, zero = torch.full((2,), 3.0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    rows = torch.stack([three, d.sum(1), (d * d).sum(1), x[:, 0], x[:, 2], zero], 1)
    published = torch.zeros(2, 6, dtype=torch.float64)
    inputs = {"rows": rows, "shifts": shifts, "center": zero, "published": published, "next_shift": zero,
              "idle": zero}  # fmt: skip
    _, _, published, next_shift, _, out, emptied, shifts = _flush(backend, inputs, True, device)
    mean = x.mean(1)
    std = (x - mean[:, None]).square().mean(1).sqrt()
    want = torch.stack([three, mean, std, x[:, 0], x[:, 2], zero], 1)
    torch.testing.assert_close(published, want, rtol=4 * EPS64, atol=0)
    assert published[:, 1].tolist() == mean.tolist() and next_shift.tolist() == mean.tolist()
    assert out.tolist() == [0.0, 0.0]  # one rank: nothing to reduce again, nothing idle
    assert emptied.tolist() == [[0.0, 0.0, 0.0, math.inf, -math.inf, 0.0]] * 2 and shifts.isnan().all()
