"""Kernel backends: time, effective bandwidth and ratios to ATen and to a copy, per op and backend.

CPU (always): the ``cpu`` backend (compiled C++, when it builds) and ``reference`` at a BatchNorm2d
shape (fp32/bf16/fp16, NCHW and channels last, and a bf16 layer of the digits demo; and each case the
``cpu`` backend's defer table sends to ``reference``, also on the compiled kernel it bypasses) against ATen's
fused BatchNorm (``torch.batch_norm_update_stats`` for the moments, eval ``torch.batch_norm`` for
``elemt``, training ``torch.batch_norm`` for the forward pair, ``native_batch_norm_backward`` for the
backward; the ``torch.batch_norm_stats`` building blocks are CUDA-only); ``unscale_and_check_`` and
``check_finite`` against ``torch.amp.GradScaler("cpu")`` on 12M parameters; ``accumulate_moments_``
against ATen's reductions; ``accumulate_histogram_`` (geometric edges of relative accuracy 0.01) against
ATen's ``bucketize``. Triton's interpreter is not timed (it is a debugging tool).

GPU (only with CUDA): ``triton`` and ``reference`` at ResNet-50 shapes against ATen's CUDA building
blocks (``torch.batch_norm_stats``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
``batch_norm_backward_elemt``, ``_amp_foreach_non_finite_check_and_unscale_``): device time from CUDA
graph replays over input sets larger than L2 (launch cost excluded), and per-call time with
``triton.testing.do_bench`` (launch cost included). Targets: every Triton op >= 0.80 of copy
bandwidth and <= 1.0x ATen's time; ``unscale_and_check_`` >= 0.85 of copy.

Usage: ``python benchmarks/bench_kernels.py [--quick] [--gpu-only]``.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the iteration that defines it)
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.utils.benchmark as tb

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _common import write_result  # noqa: E402

from lightning_ext.kernels import get_backend  # noqa: E402

ROWS: list[tuple] = []  # CPU rows: (section, op, backend, case, ms, GB/s, vs ATen, vs copy)
# The guard: every (op, case) timed for the automatically chosen CPU backend and for `reference`, as
# (op, case, auto seconds, reference seconds, A/A, "reference"): A/A is |second / first - 1| of the
# reference op timed twice in the same run, the noise the guard allows that pair (at least MIN_NOISE).
# A pair that looks slower is timed again at once, interleaved, and those timings are recorded (a
# confirmation). Each rule of the cpu backend's defer table is timed on a case it defers, against the
# compiled kernel it bypasses (the row's last field says so): a rule the kernel has outgrown fails too.
GUARD: list[tuple[str, str, float, float, float, str]] = []
CONFIRM_ROUNDS = 3  # interleaved re-timings of a pair that looks slower: the best of each counts
MIN_NOISE = 0.10  # two timings of one op in one run differ by up to ~9% (measured on float16 pairs)
MIN_RUN_TIME = 0.5  # seconds per CPU timing (--quick: less)


def cpu_time(fn) -> float:
    """Median seconds per call (torch.utils.benchmark at the default thread count, warm-up included)."""
    return (
        tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        .blocked_autorange(min_run_time=MIN_RUN_TIME)
        .median
    )


def gpu_time(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e-3


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def add(section, op, backend, case, seconds, bytes_moved, aten_seconds, copy_gbs):
    gbs = bytes_moved / seconds / 1e9
    vs_aten = seconds / aten_seconds if aten_seconds else math.nan
    ROWS.append((section, op, backend, case, seconds * 1e3, gbs, vs_aten, gbs / copy_gbs))
    print(f"{section:4} {op:28} {backend:10} {case:34} {seconds * 1e3:9.3f} ms {gbs:8.1f} GB/s "
          f"x{vs_aten:5.2f} ATen {gbs / copy_gbs:5.2f} of copy", flush=True)  # fmt: skip


def copy_bandwidth(device, timer, mib: int = 64) -> float:
    """GB/s of a ``mib``-MiB float32 device-to-device copy, counting bytes read + written."""
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes(src) / timer(lambda: dst.copy_(src)) / 1e9


# ---------------------------------------------------------------------------- CPU


def cpu_backends() -> list:
    """The ``cpu`` backend when it builds, then ``reference``."""
    backends = []
    try:
        backends.append(get_backend("cpu", "cpu"))
    except Exception as err:  # no compiler or ninja: only reference serves CPU tensors
        print(f"the cpu kernel backend is not available ({err}); timing reference only")
    backends.append(get_backend("reference", "cpu"))
    return backends


def _statistics(payload: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """count (0-dim), mean and invstd (float64 ``(C,)``) from ``batch_norm_moments``, as SyncBatchNorm."""
    c = shift.numel()
    count = payload[0]
    dev = payload[1 : c + 1] / count
    var = payload[c + 1 :] / count - dev * dev
    return count, shift + dev, (var + 1e-5).rsqrt()


def bench_cpu(quick: bool) -> None:
    backends = cpu_backends()
    ref = backends[-1]
    copy_gbs = copy_bandwidth("cpu", cpu_time)
    print(f"CPU copy bandwidth: {copy_gbs:.1f} GB/s")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    cases = [
        ((32, 64, 32, 32), dtype, fmt)
        for dtype in dtypes
        for fmt in (torch.contiguous_format, torch.channels_last)
    ] + [((32, 64, 8, 8), torch.bfloat16, torch.contiguous_format)]  # a layer of the digits demo
    cases += [((32, 4, 64, 64), torch.float16, torch.channels_last)]  # channels last, a row under a vector
    cases += [((2, 8, 3, 3), dtype, torch.contiguous_format) for dtype in dtypes]  # per-call overhead
    for shape, dtype, fmt in cases[:1] if quick else cases:
        x = (torch.randn(shape) * 2 + 1).to(dtype).contiguous(memory_format=fmt)
        dy = torch.randn(shape).to(dtype).contiguous(memory_format=fmt)
        c = shape[1]
        case = f"{tuple(shape)} {str(dtype)[6:]} {'CL' if fmt == torch.channels_last else 'NCHW'}"
        shift = torch.zeros(c, dtype=torch.float64)  # the running mean at the first step
        count, mean, invstd = _statistics(ref.run("batch_norm_moments", x, shift), shift)
        pdt = torch.float64 if dtype == torch.float64 else torch.float32  # parameters (ATen: same)
        w, b = torch.randn(c, dtype=pdt), torch.randn(c, dtype=pdt)
        sums = ref.run("batch_norm_backward_reduce", dy, x, mean)
        # ATen's fused BatchNorm pieces, with float32 statistics (float64 for float64 input): moments
        # (batch_norm_update_stats), training forward (moments + normalize), eval forward (normalize),
        # backward (the two sums alone; the whole input gradient).
        mean32, invstd32 = mean.to(pdt), invstd.to(pdt)
        rm, rv = torch.zeros(c, dtype=pdt), torch.ones(c, dtype=pdt)
        t_moments = cpu_time(lambda: torch.batch_norm_update_stats(x, rm, rv, 0.0))
        t_fwd = cpu_time(lambda: torch.batch_norm(x, w, b, None, None, True, 0.0, 1e-5, False))
        rvar = invstd32.pow(-2)
        t_eval = cpu_time(lambda: torch.batch_norm(x, w, b, mean32, rvar, False, 0.0, 0.0, False))
        aten_bwd = torch.ops.aten.native_batch_norm_backward
        t_red = cpu_time(
            lambda: aten_bwd(dy, x, w, None, None, mean32, invstd32, True, 1e-5, [False, True, True])
        )
        t_bwd = cpu_time(
            lambda: aten_bwd(dy, x, w, None, None, mean32, invstd32, True, 1e-5, [True, True, True])
        )
        nb = nbytes(x)
        calls = {
            "batch_norm_moments": lambda be: be.run("batch_norm_moments", x, shift),
            "batch_norm_elemt": lambda be: be.run("batch_norm_elemt", x, mean, invstd, w, b),
            "batch_norm_backward_reduce": lambda be: be.run("batch_norm_backward_reduce", dy, x, mean),
            "batch_norm_backward_elemt": (
                lambda be: be.run("batch_norm_backward_elemt", dy, x, mean, invstd, w, sums, count)
            ),
        }
        times = guarded(backends, calls, case)
        for be in backends:
            t_m, t_e, t_r, t_be = (times[be.name][op] for op in calls)
            add("cpu", "batch_norm_moments", be.name, case, t_m, nb, t_moments, copy_gbs)
            add("cpu", "batch_norm_elemt", be.name, case, t_e, 2 * nb, t_eval, copy_gbs)
            add("cpu", "moments+elemt (fwd)", be.name, case, t_m + t_e, 3 * nb, t_fwd, copy_gbs)
            add("cpu", "batch_norm_backward_reduce", be.name, case, t_r, 2 * nb, t_red, copy_gbs)
            add("cpu", "batch_norm_backward_elemt", be.name, case, t_be, 3 * nb, None, copy_gbs)
            add("cpu", "reduce+elemt (bwd)", be.name, case, t_r + t_be, 5 * nb, t_bwd, copy_gbs)
    bench_deferred(copy_gbs)

    # unscale_and_check_ vs GradScaler("cpu").unscale_ on 12M parameters with realistic gradients
    # (N(0, 1e-3), as after a few steps; no denormals). Scale 1.0 so repeated unscaling is stable.
    gen = torch.Generator().manual_seed(0)
    shapes = [(512, 512, 3, 3)] * 4 + [(2048, 1024)] * 1 + [(1000, 512)] * 1 + [(512,)] * 40
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    n_params = sum(p.numel() for p in params)
    case = f"{n_params / 1e6:.1f}M fp32 params, {len(params)} tensors"
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as in a training step

    def gradscaler_unscale():
        scaler._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
        scaler.unscale_(opt)

    grads = [p.grad for p in params]
    inv = torch.tensor(1.0)
    found = torch.zeros(())
    t_gs = cpu_time(gradscaler_unscale)
    # The fused-optimizer check: GradScaler runs its unscale op at scale 1 (rewrites every gradient).
    t_gs_check = cpu_time(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))
    t_read = cpu_time(lambda: torch._foreach_norm(grads, 1))
    add("cpu", "GradScaler.unscale_ (anchor)", "aten", case, t_gs, 2 * nbytes(*grads), t_gs, copy_gbs)
    add("cpu", "GradScaler check at scale 1 (anchor)", "aten", case, t_gs_check, 2 * nbytes(*grads),
        t_gs_check, copy_gbs)  # fmt: skip
    add("cpu", "read grads once (foreach_norm)", "aten", case, t_read, nbytes(*grads), None, copy_gbs)
    calls = {
        "unscale_and_check_": lambda be: be.run("unscale_and_check_", grads, inv),
        "check_finite": lambda be: be.run("check_finite", grads, torch.device("cpu")),
    }
    times = guarded(backends, calls, case)
    for be in backends:
        t_us, t_check = times[be.name]["unscale_and_check_"], times[be.name]["check_finite"]
        add("cpu", "unscale_and_check_", be.name, case, t_us, 2 * nbytes(*grads), t_gs, copy_gbs)
        add("cpu", "check_finite (fused optimizers)", be.name, case, t_check, nbytes(*grads), t_gs_check,
            copy_gbs)  # fmt: skip

    # batch_norm_gather_stats: statistics and running update from a summed 64-channel payload.
    x = torch.randn(32, 64, 8, 8)
    shift, rm, rv = torch.zeros(64), torch.zeros(64), torch.ones(64)
    payload, momentum = ref.run("batch_norm_moments", x, shift), torch.tensor(0.1, dtype=torch.float64)
    args = (payload, shift, rm, rv, momentum, 1e-5)
    gather = {"batch_norm_gather_stats": lambda be: be.run("batch_norm_gather_stats", *args)}
    times = guarded(backends, gather, "C=64 payload")
    for be in backends:
        t_g = times[be.name]["batch_norm_gather_stats"]
        add("cpu", "batch_norm_gather_stats", be.name, "C=64 payload", t_g, nbytes(payload), None, copy_gbs)

    # accumulate_moments_ (report()) vs the ATen reductions it needs, on a 1M-element activation of
    # each dtype, and on a scalar (per-call overhead).
    shift = torch.tensor(3.0, dtype=torch.float64)
    inputs = [(f"1M {str(d)[6:]} (float64 sums)", (torch.randn(2**20) + 3).to(d)) for d in dtypes]
    for case, x in [*(inputs[:1] if quick else inputs), ("scalar (per-call overhead)", torch.ones(()))]:
        xf = x if x.dtype == torch.float64 else x.float()
        t_a = cpu_time(lambda: (xf.sum(), (xf * xf).sum(), torch.aminmax(xf))) if x.dim() else None
        acc = torch.tensor([0, 0, 0, math.inf, -math.inf, 0], dtype=torch.float64)  # an empty row
        times = guarded(backends, {"acc": lambda be: be.run("accumulate_moments_", acc, x, shift)}, case)
        for be in backends:
            add("cpu", "accumulate_moments_", be.name, case, times[be.name]["acc"], nbytes(x), t_a, copy_gbs)

    # accumulate_histogram_ (report()'s quantile sketches) vs ATen's bucketize of the float64 magnitudes
    # (the binary search alone), on a 1M-element activation counted into DDSketch's buckets of
    # relative accuracy 0.01 over (1e-6, 1e6), and on a scalar (per-call overhead).
    from lightning_ext.stats import LogHistogram

    edges = LogHistogram(0.01, (1e-6, 1e6)).edges()
    hist = torch.zeros(2 * edges.numel() + 1, dtype=torch.float64)
    m = edges.numel() - 1
    inputs = [(f"1M {str(d)[6:]}, {m} buckets/sign", torch.randn(2**20).to(d)) for d in dtypes]
    for case, x in [*(inputs[:1] if quick else inputs), ("scalar (per-call overhead)", torch.ones(()))]:
        t_a = cpu_time(lambda: torch.bucketize(x.double().abs(), edges)) if x.dim() else None
        times = guarded(backends, {"hist": lambda be: be.run("accumulate_histogram_", hist, x, edges)}, case)
        for be in backends:
            t = times[be.name]["hist"]
            add("cpu", "accumulate_histogram_", be.name, case, t, nbytes(x), t_a, copy_gbs)


def guarded(backends: list, calls: dict, case: str) -> dict[str, dict[str, float]]:
    """Time each call on each backend (``{backend: {op: seconds}}``); record, for the guard, each op's
    automatic-backend time against reference's, and an A/A second timing of reference."""
    times = {be.name: {op: cpu_time(lambda: call(be)) for op, call in calls.items()} for be in backends}
    auto = get_backend(device="cpu").name
    if auto != "reference" and auto in times:
        ref = next(be for be in backends if be.name == "reference")
        for op, call in calls.items():
            again = cpu_time(lambda: call(ref))
            noise = abs(again / times["reference"][op] - 1.0)
            a, r = times[auto][op], times["reference"][op]
            if a > r * (1.0 + max(MIN_NOISE, noise)):  # looks slower: confirm, interleaved
                a, r = _interleaved(call, next(be for be in backends if be.name == auto), ref)
            GUARD.append((op, case, a, r, noise, "reference"))
    return times


class _Compiled:
    """The cpu backend's compiled kernels called directly, past its defer table (a backend for ``call``)."""

    name = "cpu, compiled"

    def __init__(self, backend) -> None:
        self.extension = backend._extension

    def run(self, op: str, *args):
        return getattr(self.extension, op)(*args)


# A case per rule of the cpu backend's defer table, (op, shape, dtype) in NCHW, that the rule sends to
# reference, at the table's size threshold (2^22 elements, e.g. (64, 64, 32, 32)); none: it is empty
DEFERRED: list[tuple[str, tuple[int, ...], torch.dtype]] = []


def bench_deferred(copy_gbs: float) -> None:
    """Each case of ``DEFERRED`` on the automatic backend (reference's op, by the defer table) and on the
    compiled kernel it bypasses, against ATen's eval BatchNorm; recorded for the guard. Exits when a
    rule of the table has no case here, or a case is not deferred (the table changed: update them)."""
    from lightning_ext.kernels import cpu as cpu_kernels

    auto = get_backend(device="cpu")
    if auto.name != "cpu":
        return
    table, compiled = cpu_kernels._DEFER_TO_REFERENCE, _Compiled(auto)
    if set(table) != {op for op, _, _ in DEFERRED}:
        raise SystemExit(f"bench_kernels.py: DEFERRED covers {DEFERRED}, the defer table {sorted(table)}")
    for op, shape, dtype in DEFERRED:
        if op != "batch_norm_elemt":
            raise SystemExit(f"bench_kernels.py: bench_deferred times batch_norm_elemt: add {op}'s call")
        x, c = (torch.randn(shape) * 2 + 1).to(dtype), shape[1]
        if x.numel() < cpu_kernels._LARGE or not table[op](x):
            raise SystemExit(f"bench_kernels.py: DEFERRED's {op} {shape} {dtype} is not deferred")
        mean, invstd = torch.randn(c, dtype=torch.float64), torch.rand(c, dtype=torch.float64) + 0.5
        w, b, case = torch.randn(c), torch.randn(c), f"{shape} {str(dtype)[6:]} NCHW"
        rvar = invstd.float().pow(-2)
        t_aten = cpu_time(lambda: torch.batch_norm(x, w, b, mean.float(), rvar, False, 0.0, 0.0, False))
        call = lambda be: be.run(op, x, mean, invstd, w, b)
        a, k = cpu_time(lambda: call(auto)), cpu_time(lambda: call(compiled))
        noise = abs(cpu_time(lambda: call(compiled)) / k - 1.0)
        add("cpu", op, "cpu", case + " (deferred)", a, 2 * nbytes(x), t_aten, copy_gbs)
        add("cpu", op, compiled.name, case, k, 2 * nbytes(x), t_aten, copy_gbs)
        if a > k * (1.0 + max(MIN_NOISE, noise)):  # looks slower: confirm, interleaved
            a, k = _interleaved(call, auto, compiled)
        GUARD.append((op, case, a, k, noise, "the compiled kernel"))


def _interleaved(call, auto, ref) -> tuple[float, float]:
    """The best of ``CONFIRM_ROUNDS`` interleaved timings of ``call`` on each backend (auto, reference)."""
    pairs = [(cpu_time(lambda: call(auto)), cpu_time(lambda: call(ref))) for _ in range(CONFIRM_ROUNDS)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def check_guard() -> int:
    """Print every (op, case) where the automatic CPU backend is slower than ``reference`` (or, on a case
    its defer table sends to reference, than the compiled kernel) by more than the run's A/A noise; 1
    when there is one (the defer table must change), else 0."""
    slower = [row for row in GUARD if row[2] > row[3] * (1.0 + max(MIN_NOISE, row[4]))]
    auto = get_backend(device="cpu").name
    deferred = sum(row[5] != "reference" for row in GUARD)
    print(f"guard: automatic CPU backend {auto!r} vs reference on {len(GUARD) - deferred} (op, case) pairs, "
          f"vs the compiled kernel on {deferred} its defer table sends to reference, each allowed "
          f"max({MIN_NOISE:.0%}, its A/A noise): {len(slower)} slower")  # fmt: skip
    for op, case, a, r, noise, other in slower:
        print(f"  SLOWER {op} {case}: {auto} {a * 1e3:.4f} ms, {other} {r * 1e3:.4f} ms "
              f"({a / r:.2f}x; A/A {noise:.1%})")  # fmt: skip
    return 1 if slower else 0


# ---------------------------------------------------------------------------- GPU


def gpu_device_time(fn, sets: list) -> float:
    """Device seconds per call of ``fn(inputs)``: a CUDA graph calls it once per input set (the sets
    together exceed the L2 cache, so every call reads from device memory); median over replays of the
    graph's time (CUDA events) divided by the number of sets. Launch costs on the host are excluded."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for inputs in sets:  # warm-up outside the capture: compilation, metadata caches
            fn(inputs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for inputs in sets:
            fn(inputs)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(sets))
    del graph
    return sorted(times)[len(times) // 2]


def _n_sets(nbytes_per_set: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(2, min(16, -(-3 * l2 // max(nbytes_per_set, 1))))


GPU_ROWS: list[tuple] = []  # (op, backend, case, device ms, per-call ms, GB/s, vs ATen, of copy)


def add_gpu(op, backend, case, device_s, call_s, bytes_moved, aten_device_s, copy_gbs):
    gbs = bytes_moved / device_s / 1e9
    GPU_ROWS.append(
        (op, backend, case, device_s * 1e3, call_s * 1e3, gbs, device_s / aten_device_s, gbs / copy_gbs)
    )
    print(
        f"gpu {op:28} {backend:10} {case:34} {device_s * 1e6:8.1f} us device {call_s * 1e6:8.1f} us per call "
        f"{gbs:7.0f} GB/s x{device_s / aten_device_s:5.2f} ATen {gbs / copy_gbs:5.2f} of copy",
        flush=True,
    )


def bench_gpu(quick: bool) -> None:
    ref = get_backend("reference", "cuda")
    tri = get_backend("triton", "cuda")
    copy_gbs = copy_bandwidth("cuda", gpu_time, mib=1024)  # far beyond L2 (50-60 MB on H100/H200)
    print(f"GPU copy bandwidth: {copy_gbs:.1f} GB/s")
    shapes = [(64, c, h, h) for c, h in ((64, 56), (256, 56), (256, 14), (1024, 14))]
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    for shape in shapes[:2] if quick else shapes:
        for dtype in dtypes[:1] if quick else dtypes:
            for fmt in (torch.contiguous_format, torch.channels_last):
                c = shape[1]
                numel = math.prod(shape)
                case = f"{tuple(shape)} {str(dtype)[6:]} {'CL' if fmt == torch.channels_last else 'NCHW'}"
                sets = []
                for _ in range(_n_sets(2 * numel * torch.finfo(dtype).bits // 8)):
                    x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
                    dy = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
                    mean, invstd = torch.batch_norm_stats(x, 1e-5)
                    w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
                    cnt = torch.full((c,), numel // c, device="cuda", dtype=torch.int32)
                    s1, s2, _, _ = torch.batch_norm_backward_reduce(
                        dy, x, mean, invstd, w, True, False, False
                    )
                    count = torch.tensor(float(numel // c), device="cuda")
                    sums = torch.cat([s1, s2]).float()
                    shift = torch.zeros(c, device="cuda", dtype=torch.float64)
                    sets.append((x, dy, mean, invstd, w, b, cnt, count, s1, s2, sums, shift))
                aten_calls = {
                    "batch_norm_moments": lambda a: torch.batch_norm_stats(a[0], 1e-5),
                    "batch_norm_elemt": lambda a: torch.batch_norm_elemt(a[0], a[4], a[5], a[2], a[3], 1e-5),
                    "batch_norm_backward_reduce": lambda a: torch.batch_norm_backward_reduce(
                        a[1], a[0], a[2], a[3], a[4], True, False, False
                    ),
                    "batch_norm_backward_elemt": lambda a: torch.batch_norm_backward_elemt(
                        a[1], a[0], a[2], a[3], a[4], a[8], a[9], a[6]
                    ),
                }
                nb = numel * torch.finfo(dtype).bits // 8
                moved = {
                    "batch_norm_moments": nb,
                    "batch_norm_elemt": 2 * nb,
                    "batch_norm_backward_reduce": 2 * nb,
                    "batch_norm_backward_elemt": 3 * nb,
                }
                aten = {op: gpu_device_time(fn, sets) for op, fn in aten_calls.items()}
                for op, fn in aten_calls.items():
                    add_gpu(
                        op,
                        "ATen",
                        case,
                        aten[op],
                        gpu_time(lambda fn=fn: fn(sets[0])),
                        moved[op],
                        aten[op],
                        copy_gbs,
                    )
                for be in (tri, ref):
                    calls = {
                        "batch_norm_moments": lambda a, be=be: be.run("batch_norm_moments", a[0], a[11]),
                        "batch_norm_elemt": lambda a, be=be: be.run(
                            "batch_norm_elemt", a[0], a[2], a[3], a[4], a[5]
                        ),
                        "batch_norm_backward_reduce": lambda a, be=be: be.run(
                            "batch_norm_backward_reduce", a[1], a[0], a[2]
                        ),
                        "batch_norm_backward_elemt": lambda a, be=be: be.run(
                            "batch_norm_backward_elemt", a[1], a[0], a[2], a[3], a[4], a[10], a[7]
                        ),
                    }
                    for op, fn in calls.items():
                        device_s = gpu_device_time(fn, sets)
                        call_s = gpu_time(lambda fn=fn: fn(sets[0]))
                        add_gpu(op, be.name, case, device_s, call_s, moved[op], aten[op], copy_gbs)
                del sets
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.float16):
        shapes_g = [(2048, 1024)] * 5 + [(512,)] * 40
        nb = sum(math.prod(sh) for sh in shapes_g) * torch.finfo(dtype).bits // 8
        sets = [
            [torch.randn(sh, device="cuda", generator=gen).to(dtype) * 1e-3 for sh in shapes_g]
            for _ in range(_n_sets(nb))
        ]
        found = torch.zeros((), device="cuda")
        inv = torch.tensor(1.0, device="cuda")
        case = f"{nb / (torch.finfo(dtype).bits // 8) / 1e6:.1f}M {str(dtype)[6:]}, {len(shapes_g)} tensors"
        aten_fn = lambda g: torch._amp_foreach_non_finite_check_and_unscale_(g, found, inv)
        t_a = gpu_device_time(aten_fn, sets)
        add_gpu(
            "unscale_and_check_", "ATen", case, t_a, gpu_time(lambda: aten_fn(sets[0])), 2 * nb, t_a, copy_gbs
        )
        # What a pass over these tensors can reach: a multi-tensor copy of the same bytes.
        pairs = [(g, [torch.empty_like(t) for t in g]) for g in sets]
        copy_fn = lambda p: torch._foreach_copy_(p[1], p[0])
        add_gpu("copy (same tensors)", "ATen", case, gpu_device_time(copy_fn, pairs),
                gpu_time(lambda p=pairs[0]: copy_fn(p)), 2 * nb, t_a, copy_gbs)  # fmt: skip
        for be in (tri, ref):
            fn = lambda g, be=be: be.run("unscale_and_check_", g, inv)
            add_gpu("unscale_and_check_", be.name, case, gpu_device_time(fn, sets),
                    gpu_time(lambda fn=fn: fn(sets[0])), 2 * nb, t_a, copy_gbs)  # fmt: skip
            fn = lambda g, be=be: be.run("check_finite", g, g[0].device)
            add_gpu("check_finite (read only)", be.name, case, gpu_device_time(fn, sets),
                    gpu_time(lambda fn=fn: fn(sets[0])), nb, t_a, copy_gbs)  # fmt: skip
        del sets
    sets = [(torch.randn(2**24, device="cuda"),) for _ in range(_n_sets(2**26))]
    shift = torch.tensor(0.0, device="cuda", dtype=torch.float64)
    acc = torch.tensor([0, 0, 0, math.inf, -math.inf, 0], device="cuda", dtype=torch.float64)  # an empty row
    aten_fn = lambda a: (a[0].sum(), (a[0] * a[0]).sum(), torch.aminmax(a[0]))
    t_a = gpu_device_time(aten_fn, sets)
    for be in (tri, ref):
        fn = lambda a, be=be: be.run("accumulate_moments_", acc, a[0], shift)
        add_gpu("accumulate_moments_", be.name, "16M fp32", gpu_device_time(fn, sets),
                gpu_time(lambda fn=fn: fn(sets[0])), 2**26, t_a, copy_gbs)  # fmt: skip
    # accumulate_histogram_ (the percentile sketches) on the same 16M float32 values, DDSketch's buckets
    # of relative accuracy 0.01 over (1e-6, 1e6), against ATen's bucketize of the float64 magnitudes
    # (the search alone) and torch.histc (equal-width buckets over the same range: the cheapest
    # histogram ATen has).
    from lightning_ext.stats import LogHistogram

    edges = LogHistogram(0.01, (1e-6, 1e6)).edges().cuda()
    hist = torch.zeros(2 * edges.numel() + 1, device="cuda", dtype=torch.float64)
    case = f"16M fp32, {edges.numel() - 1} buckets/sign"
    bucketize = lambda a: torch.bucketize(a[0].double().abs(), edges)
    # (with its range given: histc's default reads the data's min and max on the host, not capturable)
    histc = lambda a: torch.histc(a[0], bins=2 * edges.numel() + 1, min=-1e6, max=1e6)
    t_b = gpu_device_time(bucketize, sets)
    for name, fn in (("ATen bucketize", bucketize), ("ATen histc", histc)):
        add_gpu("accumulate_histogram_", name, case, gpu_device_time(fn, sets),
                gpu_time(lambda fn=fn: fn(sets[0])), 2**26, t_b, copy_gbs)  # fmt: skip
    for be in (tri, ref):
        fn = lambda a, be=be: be.run("accumulate_histogram_", hist, a[0], edges)
        add_gpu("accumulate_histogram_", be.name, case, gpu_device_time(fn, sets),
                gpu_time(lambda fn=fn: fn(sets[0])), 2**26, t_b, copy_gbs)  # fmt: skip


def _gpu_table() -> str:
    lines = [
        "## Kernel backends, GPU (`bench_kernels.py`)",
        "",
        f"{torch.cuda.get_device_name()}. Device time per call: a CUDA graph replays the op over enough",
        "input sets to exceed the L2 cache three times (every call reads device memory), median of 30",
        "replays, launch costs excluded; 'per call' is `triton.testing.do_bench` around one eager call",
        "(L2 flushed), which includes the host's launch cost when that exceeds the device time. GB/s =",
        "bytes read + written / device time; 'of copy' relative to a 1 GiB device-to-device copy; 'vs ATen'",
        "= device time / the ATen building block's (`torch.batch_norm_stats` & co.,",
        "`_amp_foreach_non_finite_check_and_unscale_`; for `accumulate_moments_`, sum + sum of squares +",
        "aminmax). Targets: every Triton op >= 0.80 of copy and <= 1.00x ATen;",
        "`unscale_and_check_` >= 0.85 of copy.",
        "",
        "| op | backend | case | device us | per call us | GB/s | vs ATen | of copy |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for op, be, case, dev_ms, call_ms, gbs, va, vc in GPU_ROWS:
        lines.append(
            f"| {op} | {be} | {case} | {dev_ms * 1e3:.1f} | {call_ms * 1e3:.1f} | {gbs:.0f} "
            f"| {va:.2f}x | {vc:.2f} |"
        )
    return "\n".join(lines)


def _cpu_table() -> str:
    lines = [
        "## Kernel backends, CPU (`bench_kernels.py`)",
        "",
        f"Time per call (`torch.utils.benchmark` median, {torch.get_num_threads()} threads), effective",
        "bandwidth (bytes read + written / time), time relative to the ATen op doing the same work (< 1 is",
        "faster: `batch_norm_update_stats` for the moments, eval BatchNorm for `elemt`, training BatchNorm",
        "for the forward pair, `native_batch_norm_backward` for the sums and the whole backward,",
        "`GradScaler.unscale_` for `unscale_and_check_`, its multi-tensor op at scale 1 for `check_finite`,",
        "sum + sum of squares + aminmax for `accumulate_moments_`, `bucketize` of the float64 magnitudes",
        "for `accumulate_histogram_`) and bandwidth relative to a 64 MiB copy.",
        "Backends: `cpu` (compiled C++) and `reference` (ATen ops from Python).",
        "",
        "| dev | op | backend | case | ms | GB/s | vs ATen | of copy |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for sec, op, be, case, ms, gbs, va, vc in ROWS:
        va_s = "" if math.isnan(va) else f"{va:.2f}x"
        lines.append(f"| {sec} | {op} | {be} | {case} | {ms:.3f} | {gbs:.1f} | {va_s} | {vc:.2f} |")
    return "\n".join(lines)


def main() -> int:
    global MIN_RUN_TIME
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer cases, shorter timings (smoke run: the guard only prints)"
    )
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU section")
    args = parser.parse_args()
    if args.quick:
        MIN_RUN_TIME = 0.05
    torch.manual_seed(0)
    if torch.cuda.is_available():
        bench_gpu(args.quick)
        markdown = _gpu_table()
        print(markdown, flush=True)
        write_result("kernels_gpu", markdown, quick=args.quick)
    elif args.gpu_only:
        print("bench_kernels.py --gpu-only: no CUDA device, nothing to run")
    if args.gpu_only:
        return 0
    bench_cpu(args.quick)
    markdown = _cpu_table()
    print(markdown)
    write_result("kernels", markdown, quick=args.quick)
    slower = check_guard()
    return 0 if args.quick else slower  # a smoke run's short timings on a loaded machine judge nothing


if __name__ == "__main__":
    raise SystemExit(main())
