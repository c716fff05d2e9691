"""``accumulate_histogram_`` of every backend against ``reference``, count for count: random signed
log-normal values with zeros, infinities, NaN and the edges themselves, over every real dtype, odd sizes,
non-contiguous views and three kinds of edges; every float16/bfloat16 bit pattern; the argument checks;
``torch.compile(fullgraph=True)`` through the custom op. The flush's ``pack_windows_`` by hand and against
``reference``, word for word."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lightning_ext.kernels import KernelBackend, get_backend
from tests.kernels.conftest import backend_device, make_backend

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8]
OTHER_DTYPES = [torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64]
OTHER_DTYPES += [torch.float8_e4m3fn, torch.float8_e5m2]
SIZES = [0, 1, 7, 1000, 2**17 + 3]  # 2^17 + 3: odd, several thread chunks of the cpu kernel
TRITON_LARGE = 2 * 4096 + 5  # Triton's interpreter: 3 blocks of 4096 (a partial one), in seconds


def _geometric_edges(alpha: float = 0.01, low: float = 1e-6, high: float = 1e6) -> torch.Tensor:
    """DDSketch's edges ``gamma^k``, ``gamma = (1 + alpha) / (1 - alpha)``, ``k`` from
    ``ceil(log_gamma(low)) - 1`` to ``ceil(log_gamma(high))`` (as ``stats.LogHistogram.edges``)."""
    log_gamma = math.log((1 + alpha) / (1 - alpha))
    first, last = math.ceil(math.log(low) / log_gamma), math.ceil(math.log(high) / log_gamma)
    return (torch.arange(first - 1, last + 1, dtype=torch.float64) * log_gamma).exp_()


def _irregular_edges(count: int = 300) -> torch.Tensor:
    """``count`` increasing edges over ~2e-9..4e8, clustered at the low end (some closer than float32's
    spacing): a guess from ``e_1 / e_0`` misses by many buckets (the cpu kernel's binary search)."""
    u = torch.rand(count, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (u**3 * 40 - 20).exp().sort().values


EDGES = {
    "geometric": _geometric_edges(),  # m = 1382, 2767 counts
    "hand-made": torch.tensor([0.1, 0.2, 5.0, 7.0], dtype=torch.float64),  # far from geometric
    "irregular": _irregular_edges(),
    "one edge": torch.tensor([1.0], dtype=torch.float64),  # m = 0: zero bucket and two overflows
}


def _values(n: int, edges: torch.Tensor, seed: int) -> torch.Tensor:
    """float64 ``(n,)``: log-normal magnitudes over ~1e-9..1e9 with random signs, and (up to half of
    them) specials at random places: 0, -0, +-inf, NaN, then the edges, their negatives and their
    float64 neighbours."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=gen, dtype=torch.float64).mul_(7).exp_()
    v *= torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    near = torch.cat([torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges / 2)])
    extra = torch.cat([edges, -edges, near, -near])
    extra = extra[torch.randperm(extra.numel(), generator=gen)]
    first = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    specials = torch.cat([first, extra])
    k = min(n if n < 16 else n // 2, specials.numel())
    v[torch.randperm(n, generator=gen)[:k]] = specials[:k]
    return v


def _as(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v`` in ``dtype``: integers saturate (NaN to 0) and truncate toward 0."""
    if dtype.is_floating_point:
        return v.to(dtype)
    bound = {torch.uint8: (0.0, 255.0), torch.int32: (-(2.0**31), 2.0**31 - 128)}.get(dtype, (-1e18, 1e18))
    return v.nan_to_num(0.0, posinf=bound[1], neginf=bound[0]).clamp(*bound).to(dtype)


def _check(backend: KernelBackend, reference: KernelBackend, x: torch.Tensor, edges: torch.Tensor,
           start: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``backend``'s counts of ``x`` (added to ``start``) equal reference's exactly; returns them."""
    device = backend_device(backend)
    start = torch.zeros(2 * edges.numel() + 1, dtype=torch.float64) if start is None else start
    got, want = start.to(device, copy=True), start.clone()
    backend.run("accumulate_histogram_", got, x.to(device), edges.to(device))
    reference.run("accumulate_histogram_", want, x, edges)
    got = got.cpu()
    differ = (got != want).nonzero().flatten()[:10].tolist()
    assert torch.equal(got, want), f"{backend.name}: buckets {differ} got {got[differ]} want {want[differ]}"
    return got


@functools.cache
def _case(dtype: torch.dtype, edges: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of ``n`` values in ``dtype`` and reference's counts of it (computed once for every backend)."""
    x = _as(_values(n, EDGES[edges], seed=n), dtype)
    counts = torch.zeros(2 * EDGES[edges].numel() + 1, dtype=torch.float64)
    get_backend("reference", device="cpu").run("accumulate_histogram_", counts, x, EDGES[edges])
    return x, counts


@pytest.mark.parametrize("edges", list(EDGES), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_counts_equal_reference(backend, dtype, edges):
    device = backend_device(backend)
    for n in SIZES:
        if backend.name == "triton" and device.type == "cpu":
            n = min(n, TRITON_LARGE)
        x, want = _case(dtype, edges, n)
        counts = torch.zeros_like(want, device=device)
        backend.run("accumulate_histogram_", counts, x.to(device), EDGES[edges].to(device))
        counts = counts.cpu()
        differ = (counts != want).nonzero().flatten()[:10].tolist()
        assert torch.equal(counts, want), f"n={n}: buckets {differ} got {counts[differ]} want {want[differ]}"
        assert counts.sum().item() == x.isfinite().sum().item()  # NaN and +-inf are not counted
        if n == SIZES[-1] and edges == "geometric" and dtype.is_floating_point and dtype != torch.float16:
            # Every part of the layout is exercised: both overflows (finite values above the last
            # edge: not in float16), the zero bucket, both signs.
            m1 = EDGES[edges].numel()
            assert counts[0] > 0 and counts[-1] > 0 and counts[m1] > 0
            assert counts[1:m1].sum() > 0 and counts[m1 + 1 : -1].sum() > 0


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
def test_other_real_dtypes(backend, reference, dtype):
    """The rest of the real dtypes (the cpu kernel reads int8/int16 itself, converts the others)."""
    if dtype.itemsize == 1 and dtype.is_floating_point and backend.name == "triton":
        if backend_device(backend).type == "cpu":
            pytest.skip("Triton's interpreter cannot load float8 (it casts `other=0` with NumPy)")
    v = _values(3000, EDGES["hand-made"], seed=6)
    if not dtype.is_floating_point:
        v = v.nan_to_num(0.0).clamp(-120.0 if dtype.is_signed else 0.0, 120.0)
    x = v.to(dtype)
    _check(backend, reference, x, EDGES["hand-made"])
    _check(backend, reference, x, EDGES["geometric"])


def test_layout_by_hand(backend):
    """Buckets ``m + 1 +- j``, ``j`` = the edges below ``|v|``: an edge belongs to the bucket it ends; the
    overflow buckets count finite values only (NaN and +-inf are not counted)."""
    device = backend_device(backend)
    edges = torch.tensor([0.1, 0.2, 5.0, 7.0], dtype=torch.float64, device=device)
    x = [-8.0, -7.0, -0.15, -0.0, 0.0, 0.1, 0.2, 5.5, 7.0, math.inf, -math.inf, math.nan, 1e300, -1e300]
    x = torch.tensor(x, dtype=torch.float64)  # float32 0.1 would be above the edge 0.1
    hist = torch.zeros(9, dtype=torch.float64, device=device)
    backend.run("accumulate_histogram_", hist, x.to(device), edges)
    assert hist.tolist() == [2.0, 1.0, 0.0, 1.0, 3.0, 1.0, 0.0, 2.0, 1.0]


# Triton's interpreter converts signaling NaNs with NumPy, which warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern(backend, reference, dtype):
    """All 65536 values (subnormals, infinities, NaNs included): the cpu kernel converts float16 itself.
    Triton's interpreter takes every third (seconds otherwise)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    if backend.name == "triton" and backend_device(backend).type == "cpu":
        x = x[::3].contiguous()
    _check(backend, reference, x, EDGES["geometric"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_non_contiguous_and_accumulating(backend, reference, dtype):
    """A transposed view counts like its values; counts add to a non-zero ``hist``; an empty ``x`` adds
    nothing."""
    gen = torch.Generator().manual_seed(1)
    edges = EDGES["geometric"]
    v = _as(_values(3000, edges, seed=3), dtype)
    start = torch.randint(0, 1000, (2 * edges.numel() + 1,), generator=gen).double()
    once = _check(backend, reference, v.reshape(60, 50).t(), edges, start)  # transposed
    assert torch.equal(once - start, _check(backend, reference, v, edges))  # added to start
    device = backend_device(backend)
    hist = start.to(device, copy=True)
    backend.run(
        "accumulate_histogram_", hist, torch.empty(0, 5, dtype=dtype, device=device), edges.to(device)
    )
    assert torch.equal(hist.cpu(), start)


def test_strided_view(backend, reference):
    """A slice with one stride throughout (``reshape(-1)`` is a strided view, not a copy) counts like its
    values."""
    v = _values(3000, EDGES["geometric"], seed=4).float()
    _check(backend, reference, v.reshape(100, 30)[:, 1::3], EDGES["geometric"])


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_compile_fullgraph_calls_custom_op(name):
    """The op traces as one custom-op node (no graph break, no decomposition) and mutates the caller's
    ``hist`` in place as eager does; torch's opcheck accepts its schema and fake implementation."""
    backend = make_backend(name)
    torch._dynamo.reset()
    seen: list[str] = []

    def record(gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return aot_eager(gm, example_inputs)

    def count(hist, x, edges):
        backend.run("accumulate_histogram_", hist, x * 2, edges)
        return hist.sum()

    edges = EDGES["hand-made"]
    x = _values(1000, edges, seed=5).float()
    eager, compiled = torch.zeros(9, dtype=torch.float64), torch.zeros(9, dtype=torch.float64)
    total = torch.compile(count, fullgraph=True, backend=record)(compiled, x, edges)
    count(eager, x, edges)
    assert any("lightning_ext.accumulate_histogram_" in s for s in seen), seen
    assert torch.equal(compiled, eager) and total.item() == eager.sum().item()
    hist = torch.zeros(9, dtype=torch.float64)
    torch.library.opcheck(
        torch.ops.lightning_ext.accumulate_histogram_,
        (hist, x, edges, backend.name),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


# ---------------------------------------------------------------------------- pack_windows_


def _pack(backend: KernelBackend, hist, rows, shifts, extremes, at, edges, bits, max_words):
    """``backend``'s words, layout and zeroed counts (on the CPU) of one ``pack_windows_``."""
    device = backend_device(backend)
    words, hist = (
        torch.full((len(at) * max_words,), -1.0, dtype=torch.float64, device=device),
        hist.to(device, copy=True),  # zeroed in place
    )
    layout = torch.full((3 * len(at) + 2,), -1, dtype=torch.int64, device=device)
    args = (rows, shifts, extremes, at, edges, bits, max_words)
    backend.run(
        "pack_windows_", words, hist, layout, *(a.to(device) if torch.is_tensor(a) else a for a in args)
    )
    w = int(layout[-2])
    return words[: len(at) * w].cpu(), layout.cpu(), hist.cpu()


def test_pack_windows_by_hand(backend):
    """Edges 1, 2, .., 128 (8 positions a sign), values -3, 1.5 and 100 of name 0 and one rank mean
    of 1.5 (name 1): with 8 slots the values' window (positions 6 to 15) collapses to level 1
    (positions 4 to 9: -3, the zero bucket, 1.5, .., 100), the rank mean's fits at level 0; 2 fields
    of 26 bits a word, 4 words a row (the power of two that holds 6 slots)."""
    edges = 2.0 ** torch.arange(8, dtype=torch.float64)
    hist = torch.zeros(1, 17, dtype=torch.float64)
    get_backend("reference", device="cpu").run(
        "accumulate_histogram_", hist[0], torch.tensor([-3.0, 1.5, 100.0]), edges
    )
    rows = torch.tensor(
        [[3.0, 0.0, 0.0, -3.0, 100.0, 0.0], [2.0, 1.0, 0.5, 1.0, 2.0, 0.0]], dtype=torch.float64
    )
    shifts = torch.tensor([0.0, 1.0], dtype=torch.float64)  # name 1: mean 1 + 1 / 2
    extremes = torch.tensor([100.0, 2.0, 3.0, -1.0, 0, 1.5, 0, -1.5, 0, 0], dtype=torch.float64)
    words, layout, zeroed = _pack(backend, hist, rows, shifts, extremes, torch.tensor([0, 1]), edges, 26, 4)
    assert layout.tolist() == [1, 0, 4, 9, 26, 26, 4, 2]  # levels, starts, bits; W, rows with values
    assert words.tolist() == [1.0, 1.0, 2.0**26, 0.0, 1.0, 0.0, 0.0, 0.0] and not zeroed.any()


@pytest.mark.parametrize(("bits", "collapsed"), [(7, False), (13, True), (27, True)])
def test_pack_windows_equals_reference(backend, reference, bits, collapsed):
    """Two ranks' values of five names over narrow and wide ranges of one sign or both (windows collapse
    with 4 and 1 fields a word), a name without values, and the rank means of four names: rank 0's
    packed words, layout and zeroed counts equal reference's (80 values a name: 7 bits hold a count),
    its rows holding its own extremes, narrower than all ranks'."""
    gen = torch.Generator().manual_seed(bits)
    edges = _geometric_edges()
    spans = [(0.5, 2.0, 1), (1e-6, 1e6, 1), (1e-6, 1e6, -1), (1e-3, 1e6, 0), (1.0, 1.0, 1)]
    ranks = []
    for _ in range(2):
        values = [lo * (hi / lo) ** torch.rand(40, generator=gen, dtype=torch.float64) for lo, hi, _ in spans]
        values = [v * (s or 1) * (torch.randint(0, 2, v.shape, generator=gen) * 2 - 1 if not s else 1)
                  for v, (_, _, s) in zip(values, spans)]  # fmt: skip
        values.append(torch.zeros(0, dtype=torch.float64))  # name 5: no values
        ranks.append(values)
    hist = torch.zeros(6, 2 * edges.numel() + 1, dtype=torch.float64)
    for row, v in zip(hist, ranks[0]):
        reference.run("accumulate_histogram_", row, v, edges)
    stats = [[torch.cat([r[i] for r in ranks]) for i in range(6)]]
    means = torch.stack(
        [torch.stack([v.mean() if v.numel() else torch.tensor(math.nan) for v in r]) for r in ranks]
    )
    hi = torch.tensor([v.max() if v.numel() else -math.inf for v in stats[0]], dtype=torch.float64)
    lo = torch.tensor([v.min() if v.numel() else math.inf for v in stats[0]], dtype=torch.float64)
    mean_hi, mean_lo = means.nan_to_num(-math.inf).amax(0), means.nan_to_num(math.inf).amin(0)
    extremes = torch.cat([hi, -lo, mean_hi, -mean_lo, torch.zeros(6, dtype=torch.float64)])
    n = torch.tensor([float(v.numel()) for v in ranks[0]], dtype=torch.float64)
    own_lo, own_hi = (  # rank 0's own extremes: its counts lie between them (the kernel reads there)
        torch.tensor([f(v) if v.numel() else inf for v in ranks[0]], dtype=torch.float64)
        for f, inf in ((torch.min, math.inf), (torch.max, -math.inf))
    )
    assert ((own_lo > lo) | (own_hi < hi)).any()  # narrower than all ranks' somewhere
    rows = torch.stack([n, torch.zeros(6, dtype=torch.float64), n, own_lo, own_hi, n * 0], 1)
    shifts = means[0].nan_to_num(0.0)  # rank 0's mean: its shift, S1 = 0
    at = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 4, 5])
    got = _pack(backend, hist, rows, shifts, extremes, at, edges, bits, 640 if bits < 27 else 8)
    want = _pack(reference, hist, rows, shifts, extremes, at, edges, bits, 640 if bits < 27 else 8)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g, w)
    assert (got[1][:10].max() > 0) == collapsed and not got[2].any()  # every count read and zeroed
