"""Quantiles and the straggler of ``Collector``: against NumPy's exact quantiles of the union of every
rank's values (float64, ``method="inverted_cdf"``), across flushes, ranks without values and a resume;
the sketch's window on the wire (at most 5 KiB per name) and its accuracy where it collapses."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
import torch

from lightning_ext.stats import Collector, LogHistogram, clear_statistics, report
from lightning_ext.stats import collector as collector_module
from tests.helpers.distributed import run_distributed

ALPHA = 0.01
LOW, HIGH = 1e-6, 1e6
QS = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)
DISTRIBUTIONS = ("lognormal", "uniform", "heavy")
FLUSHES = 4


def _draw(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    if kind == "lognormal":
        return rng.lognormal(mean=-2.0, sigma=2.5, size=n)  # spans ~1e-5 .. 1e2
    if kind == "uniform":  # negatives and exact zeros
        x = rng.uniform(-3.0, 3.0, size=n)
        x[rng.random(n) < 0.05] = 0.0
        return x
    return rng.standard_t(df=1.5, size=n) * 10.0  # heavy tails, both signs


def _values(rank: int, flush: int) -> dict[str, np.ndarray]:
    """What ``rank`` reports in interval ``flush``: its own distribution as ``Q/mixed`` (rank ``r``
    draws distribution ``r``), and every distribution under its own name; rank 1 reports nothing in
    interval 1, rank 2 nothing in interval 2; ``Q/solo`` only rank 0 reports."""
    rng = np.random.default_rng(1000 * flush + rank)
    if (rank, flush) in ((1, 1), (2, 2)):
        return {}
    n = 400 + 300 * rank
    out = {"Q/mixed": _draw(DISTRIBUTIONS[rank % 3], rng, n)}
    for kind in DISTRIBUTIONS:
        out[f"Q/{kind}"] = _draw(kind, rng, n // 2)
    if rank == 0:
        out["Q/solo"] = _draw("lognormal", rng, 50)
    return out


def _flushes(rank: int, world_size: int) -> dict:
    collector = Collector(regex="Q/.*", quantiles="Q/(mixed|lognormal|uniform|heavy|solo)")
    results = []
    for flush in range(FLUSHES):
        if flush == 3:  # resume: a new process's collector from the checkpoint of the previous one
            state = pickle.loads(pickle.dumps(collector.state_dict()))
            clear_statistics()
            collector = Collector(regex="Q/.*", quantiles="Q/(mixed|lognormal|uniform|heavy|solo)")
            collector.load_state_dict(state)
            collector.update()  # nothing new on any rank: keep_previous serves the checkpoint's
            results.append({n: [collector.quantile(n, q) for q in QS] for n in collector.names()})
        for name, values in _values(rank, flush).items():
            for part in np.array_split(values, 3):  # several reports, a tensor and a list
                report(name, torch.from_numpy(part) if len(part) % 2 else part.tolist())
        collector.update()
        results.append({n: collector.quantile(n, QS) for n in collector.names()})  # one pass for all
        for n, quantiles in results[-1].items():  # the same as one call per q
            np.testing.assert_equal(quantiles, [collector.quantile(n, q) for q in QS])
    return {"results": results, "names": collector.names()}


def _exact(name: str, flush: int, world_size: int) -> np.ndarray:
    union = np.concatenate([_values(r, flush).get(name, np.zeros(0)) for r in range(world_size)])
    return np.quantile(union, QS, method="inverted_cdf")


def _relative_errors(got: list[float], exact: np.ndarray) -> np.ndarray:
    """Relative error of each quantile, 0 where both are exactly 0 (the zero bucket)."""
    got_array = np.asarray(got)
    errors = np.abs(got_array - exact) / np.where(exact == 0, 1.0, np.abs(exact))
    return np.where((exact == 0) & (got_array == 0), 0.0, errors)


def test_quantiles_of_three_ranks_are_within_alpha_of_numpy_across_flushes_and_a_resume() -> None:
    outputs = run_distributed(_flushes, 3, timeout=150)
    assert all(out["results"] == outputs[0]["results"] for out in outputs)  # identical on every rank
    results = outputs[0]["results"]
    worst = {}
    # results: flushes 0, 1, 2, then the resumed update (flush 2's quantiles kept), then flush 3
    for index, flush in enumerate([0, 1, 2, 2, 3]):
        for name, got in results[index].items():
            exact = _exact(name, flush, 3)
            assert np.all((np.abs(exact) >= LOW) & (np.abs(exact) <= HIGH) | (exact == 0)), name  # in range
            errors = _relative_errors(got, exact)
            assert np.all(errors <= ALPHA * (1 + 1e-9)), f"flush {flush} {name}: {errors.max()}"
            worst[name] = max(worst.get(name, 0.0), float(errors.max()))
    print("worst relative error per distribution:", {k: f"{v:.5f}" for k, v in sorted(worst.items())})
    assert set(worst) == {"Q/mixed", "Q/lognormal", "Q/uniform", "Q/heavy", "Q/solo"}
    assert max(worst.values()) <= ALPHA  # every window fits 5 KiB here: no collapse, alpha itself


# Per name, values of both signs or one, over wide (12 decades) and narrow ranges, drawn by each rank.
RANGES = {
    "pos/narrow": lambda rng, n: rng.lognormal(0.0, 0.2, n),  # about 0.5 .. 2
    "pos/wide": lambda rng, n: 10.0 ** rng.uniform(-6.0, 6.0, n),  # 1e-6 .. 1e6: the whole range
    "both/narrow": lambda rng, n: rng.normal(3.0, 1.0, n),  # mostly positive, a few negatives
    "both/wide": lambda rng, n: 10.0 ** rng.uniform(-6.0, 6.0, n) * rng.choice([-1.0, 1.0], n),
    "neg/wide": lambda rng, n: -(10.0 ** rng.uniform(-3.0, 5.0, n)),
}


def _draws(rank: int, per_rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rank)
    return {name: draw(rng, per_rank) for name, draw in RANGES.items()}


def _ranged(rank: int, world_size: int, per_rank: int) -> dict:
    """Each name's quantiles after one flush of ``per_rank`` values per rank, and the bytes of the SUM."""
    sums = []
    real = collector_module.all_reduce_

    def all_reduce_(tensor, op, **kwargs):
        if op == torch.distributed.ReduceOp.SUM:
            sums.append(tensor.numel())
        return real(tensor, op=op, **kwargs)

    collector_module.all_reduce_ = all_reduce_
    c = Collector(quantiles=".*")
    for name, values in _draws(rank, per_rank).items():
        report(name, values)
    c.update()
    levels = {}
    for name in RANGES:  # the collapse level, from a whole group's inner edges: gamma ** (2 ** level)
        inner = c.histogram(name)[1][1:-1]
        ratio = max(max(b / a, a / b) for a, b in itertools.pairwise(inner) if a * b > 0)
        levels[name] = round(math.log2(math.log(ratio) / math.log(c.sketch.gamma)))
    return {"q": {n: [c.quantile(n, q) for q in QS] for n in RANGES}, "sum_words": sums[-1], "levels": levels}


# The collapse level each name's window needs (0: none) with 2 ranks' counts packed 4 (1000 values per
# rank) and 2 (1.25 million) to a float64: 2560 and 1280 buckets fit 5 KiB. A name of both signs spans
# every magnitude down to value_range[0] on both sides.
LEVELS = {
    1000: {"pos/narrow": 0, "pos/wide": 0, "both/narrow": 0, "both/wide": 1, "neg/wide": 0},
    1_250_000: {"pos/narrow": 0, "pos/wide": 1, "both/narrow": 1, "both/wide": 2, "neg/wide": 0},
}


@pytest.mark.parametrize("per_rank", sorted(LEVELS))
def test_windows_fit_5_kib_per_name_and_quantiles_keep_their_accuracy(per_rank: int) -> None:
    """2 ranks, five names over narrow and wide ranges of one sign or both: at most 640 float64 words
    (5 KiB) per name in the SUM; every quantile within the relative accuracy of the collapse level its
    window needed (``LEVELS``; ``alpha`` itself at level 0), against NumPy on the union of both ranks'
    values."""
    outputs = run_distributed(_ranged, 2, per_rank, timeout=150)  # <= 240: the pool serves it
    assert outputs[0] == outputs[1]
    out, sketch = outputs[0], LogHistogram()
    assert out["sum_words"] <= 5 * len(RANGES) + 640 * len(RANGES)  # at most 5 KiB per sketched name
    k = 53 // (2 * per_rank).bit_length()  # counts per word: of at most 2 * per_rank, bits enough
    draws = [_draws(r, per_rank) for r in range(2)]
    for name in RANGES:
        union = np.concatenate([d[name] for d in draws])
        exact = np.quantile(union, QS, method="inverted_cdf")
        level = out["levels"][name]
        errors = _relative_errors(out["q"][name], exact)
        print(
            f"{name}: {per_rank} values per rank, counts {k} per word, level {level}: "
            f"worst {errors.max():.5f}"
        )
        assert level == LEVELS[per_rank][name]
        assert np.all(errors <= sketch.accuracy(level) * (1 + 1e-9)), (name, level, errors.max())


def test_quantile_edge_cases_single_process() -> None:
    clear_statistics()
    c = Collector(quantiles="x|z", relative_accuracy=0.05, value_range=(1e-3, 1e3))
    report("x", [0.0, 0.0, -1e-4, 5e-4, 2.0, 1e9, float("inf"), float("nan")])
    report("z", [])  # registered, no values
    c.update()
    assert (c.num("x"), c.nonfinite("x")) == (6, 2)  # NaN and inf count apart, in no statistic
    # The 6 finite values: below low -> 0, above high -> the exact max
    assert c.quantile("x", 0.1) == 0.0 and c.quantile("x", 0.6) == 0.0
    assert c.quantile("x", 0.7) == pytest.approx(2.0, rel=0.05)
    assert c.quantile("x", 0.99) == 1e9  # the overflow bucket reads as the max
    assert math.isnan(c.quantile("z", 0.5)) and np.isnan(c.quantile("z", [0.5, 0.9])).all()
    assert c.quantile("x", [0.1, 0.7, 0.99]) == [0.0, c.quantile("x", 0.7), 1e9]  # one pass, in order
    with pytest.raises(KeyError, match=r"'y' is not matched by Collector\(quantiles='x\|z'\)"):
        report("y", 1.0), c.update(), c.quantile("y", 0.5)
    for bad, error in ((0.0, ValueError), (1.0, ValueError), (1.5, ValueError), ("0.5", TypeError)):
        with pytest.raises(error, match=r"Collector.quantile: .*`q`"):
            c.quantile("x", bad)
        with pytest.raises(error, match=r"Collector.quantile: .*`q`"):
            c.quantile("x", [0.5, bad])


@pytest.mark.parametrize("other", [{"relative_accuracy": 0.05}, {"value_range": (1e-3, 1e3)}])
def test_a_sketch_saved_with_other_settings_is_not_restored(other: dict) -> None:
    # Its buckets are others: restored, it read [200, 200] for the quartiles of [100, 200]
    clear_statistics()
    saved = Collector(quantiles="q")
    report("q", [100.0, 200.0])
    saved.update()
    state = saved.state_dict()
    same, changed = Collector(quantiles="q"), Collector(quantiles="q", **other)
    same.load_state_dict(state), changed.load_state_dict(state)
    assert same.quantile("q", [0.25, 0.75]) == saved.quantile("q", [0.25, 0.75])
    assert np.isnan(changed.quantile("q", [0.25, 0.75])).all() and changed.mean("q") == 150.0


def test_the_zero_bucket_reads_within_the_exact_extremes() -> None:
    # Values all below the range's low end read 0 (the zero bucket), below their exact min
    clear_statistics()
    c = Collector(quantiles="x", value_range=(1e-3, 1e3))
    report("x", [1e-9, 2e-9, 3e-9])
    c.update()
    assert c.quantile("x", [0.01, 0.5, 0.99]) == [1e-9, 1e-9, 1e-9]
    report("x", [-3e-9, -1e-9])
    c.update()
    assert c.quantile("x", [0.01, 0.99]) == [-1e-9, -1e-9]


def test_overflow_reads_as_the_exact_extreme() -> None:
    clear_statistics()
    c = Collector(quantiles="x", value_range=(1e-3, 1e3))
    report("x", [1.0, 2.0, 5e4, 7e4])
    c.update()
    assert c.quantile("x", 0.99) == 7e4 and c.quantile("x", 0.01) == pytest.approx(1.0, rel=0.01)
    report("x", [-7e4, -1.0])
    c.update()
    assert c.quantile("x", 0.01) == -7e4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"quantiles": "("}, ValueError, r"Collector: `quantiles` must be a regular expression, got '\('"),
        ({"quantiles": 3}, TypeError, r"Collector: `quantiles` must be a str, got 3"),
        ({"stragglers": "["}, ValueError, r"Collector: `stragglers` must be a regular expression"),
        (
            {"relative_accuracy": 0.0},
            ValueError,
            r"`relative_accuracy` must be a finite number in \(0.0, 0.5\), got 0.0",
        ),
        (
            {"relative_accuracy": 0.5},
            ValueError,
            r"`relative_accuracy` must be a finite number in \(0.0, 0.5\), got 0.5",
        ),
        (
            {"relative_accuracy": "1%"},
            TypeError,
            r"`relative_accuracy` must be a finite number in \(0.0, 0.5\), got '1%'",
        ),
        (
            {"value_range": (1.0, 1.0)},
            ValueError,
            r"`value_range\[1\]` must be a finite number > 1.0, got 1.0",
        ),
        (
            {"value_range": (0.0, 1.0)},
            ValueError,
            r"`value_range\[0\]` must be a finite number > 0.0, got 0.0",
        ),
        (
            {"value_range": (1.0, math.inf)},
            TypeError,
            r"`value_range\[1\]` must be a finite number > 1.0, got inf",
        ),
        ({"value_range": 5.0}, TypeError, r"`value_range` must be a pair \(low, high\), got 5.0"),
        (
            {"relative_accuracy": 1e-9},
            ValueError,
            r"relative_accuracy=1e-09 over value_range=\(1e-06, "
            r"1000000.0\) needs 27631018863 counts \(2.108e\+05 MiB per name and device\); at most 1048576",
        ),
    ],
)
def test_bad_sketch_arguments_name_the_argument(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        Collector(**kwargs)


def test_sketch_size_and_memory() -> None:
    sketch = LogHistogram()
    assert sketch.size == 2767 and sketch.size * 8 < 23_000  # bytes per tracked name and device
    edges = sketch.edges()
    assert edges.dtype == torch.float64 and edges.numel() == sketch.buckets + 1
    ratios = edges[1:] / edges[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, sketch.gamma), rtol=1e-12)
    assert edges[0] < LOW <= edges[1] and edges[-2] < HIGH <= edges[-1]


# ------------------------------------------------------------------------------------------------
# The straggler.


def _straggler(rank: int, world_size: int) -> list:
    collector = Collector(regex="Timing/.*", stragglers="Timing/step_sec")
    out = []
    for interval in range(3):
        for step in range(5):
            extra = 0.05 if rank == 1 and interval > 0 else 0.0  # the straggler, after warm-up
            report("Timing/step_sec", 0.01 * (1 + 0.1 * rank) + extra + 1e-4 * step)
        collector.update()
        out.append(tuple(collector.straggler("Timing/step_sec")))
    return out


def test_the_straggler_is_named_without_one_name_per_rank() -> None:
    outputs = run_distributed(_straggler, 3, timeout=120)
    assert all(out == outputs[0] for out in outputs)
    first, *later = outputs[0]
    assert first[0] == 2  # 1.2x the base time: rank 2 is slowest in the warm-up interval
    for rank, mean, median, ratio in later:
        assert rank == 1
        assert mean == pytest.approx(0.011 + 0.05 + 2e-4, rel=1e-9)
        assert median == pytest.approx(0.012 + 2e-4, rel=ALPHA)  # rank 2's time is the median now
        assert ratio == pytest.approx(mean / median) and ratio > 5


def test_straggler_of_one_process_and_of_a_name_without_values() -> None:
    clear_statistics()
    c = Collector(stragglers="t")
    report("t", [1.0, 3.0])
    c.update()
    assert c.straggler("t") == (0, 2.0, pytest.approx(2.0, rel=ALPHA), pytest.approx(1.0, rel=ALPHA))
    c.update()
    assert c.straggler("t") is None
    with pytest.raises(KeyError, match=r"'u' is not matched by Collector\(stragglers='t'\)"):
        report("u", 1.0), c.update(), c.straggler("u")


@pytest.mark.parametrize("bits", [1, 2, 5, 13, 26, 53])
def test_the_sparse_reading_of_a_window_is_its_dense_unpacking(bits) -> None:
    # straggler() reads its rank means' window sparsely in Python, quantile() the values' window densely
    # with NumPy: the same counts in the same slots, for any bits a count, fields empty or full
    rng = np.random.default_rng(bits)
    k = 53 // bits
    counts = rng.integers(0, 1 << bits, size=7 * k) * (rng.random(7 * k) < 0.3)
    counts[-1] = (1 << bits) - 1  # the last field of the last word, full
    words = [
        float(sum(int(c) << (bits * f) for f, c in enumerate(counts[w * k : (w + 1) * k]))) for w in range(7)
    ]
    dense = (np.array(words).astype(np.int64)[:, None] >> collector_module._field_shifts(bits)) & (
        (1 << bits) - 1
    )
    assert np.array_equal(dense.reshape(-1), counts)
    expected = [(int(slot), int(counts[slot])) for slot in np.flatnonzero(counts)]
    assert list(collector_module._nonzero(words, bits)) == expected


@pytest.mark.parametrize("ranks", [28, 29, 30])
def test_the_straggler_median_is_the_mean_of_the_two_middle_ranks(ranks) -> None:
    # one rank mean per bucket: the median is the mean of buckets (n + 1) // 2 and n // 2 + 1 (1-based);
    # NumPy's inverted_cdf at 0.5 + 0.5 / n rounds up to the bucket (n + 3) / 2 for n = 29
    clear_statistics()
    c = Collector(stragglers="s")
    report("s", [1.0, 1000.0])
    c.update()
    j, bits = c._row["stragglers", "s"], 5
    k = 53 // bits
    counts = [1] * ranks + [0] * (-ranks % k)
    words = [
        float(sum(x << (bits * f) for f, x in enumerate(counts[w * k : (w + 1) * k])))
        for w in range(len(counts) // k)
    ]
    c._words = np.zeros((1, len(words)))
    c._words[j] = words
    c._windows[2, j] = bits
    c._memo = {}
    level, start = int(c._windows[0, j]), int(c._windows[1, j])
    middle = [c.sketch.value(level, start + slot, 1.0, 1000.0) for slot in ((ranks + 1) // 2 - 1, ranks // 2)]
    assert c.straggler("s").median == sum(middle) / 2


def test_every_straggler_name_of_an_update_is_read_at_its_first_query() -> None:
    clear_statistics()
    c = Collector(stragglers="s/.*", quantiles="s/b")
    report("s/a", [1.0, 3.0]), report("s/b", -4.0), report("s/c", [])  # s/c: registered, no value
    c.update()
    assert c.straggler("s/b") == (0, -4.0, pytest.approx(-4.0, rel=ALPHA), pytest.approx(1.0, rel=ALPHA))
    assert c.straggler("s/a") == (0, 2.0, pytest.approx(2.0, rel=ALPHA), pytest.approx(1.0, rel=ALPHA))
    assert c.straggler("s/c") is None and c.quantile("s/b", 0.5) == pytest.approx(-4.0, rel=ALPHA)


def test_updated_reads_the_idle_counts_once_per_update(monkeypatch) -> None:
    # on CUDA each read of a buffer is a device-to-host copy: TrainingStats and Throughput both ask
    clear_statistics()
    c = Collector()
    report("t", 1.0)
    c.update()
    reads, host = [], c._host
    monkeypatch.setattr(c, "_host", lambda key: reads.append(key) or host(key))
    assert c.updated() == c.updated() == ["t"] and reads == ["idle"]


def test_the_reads_of_an_update_are_those_of_the_last_update() -> None:
    # straggler(), updated() and the statistics are read once per update (TrainingStats and Throughput
    # both read them): the next update, and a caller's changes to a returned list, must not go stale
    clear_statistics()
    c = Collector(stragglers="t", quantiles="t")
    report("t", [1.0, 3.0])
    c.update()
    first, names = c.straggler("t"), c.updated()
    names.append("x")
    assert c.straggler("t") == first and c.updated() == ["t"]
    assert c.quantile("t", 0.5) == pytest.approx(1.0, rel=ALPHA)
    report("t", 8.0)
    c.update()
    assert c.straggler("t") == (0, 8.0, pytest.approx(8.0, rel=ALPHA), pytest.approx(1.0, rel=ALPHA))
    assert c.quantile("t", 0.5) == pytest.approx(8.0, rel=ALPHA) and c.mean("t") == 8.0
    c.update()
    assert c.straggler("t") is None
    assert c.updated() == [] and c.mean("t") == 8.0  # keep_previous


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_drain_in_inference_mode_leaves_the_sketches_writable(backend, monkeypatch) -> None:
    # Lightning validates in inference mode: a validation collector's update drains the training
    # values too, and training then reports into the sketches again (in place, outside it).
    from lightning_ext.kernels import BACKEND_ENV_VAR
    from tests.helpers.cpu_extension import require_cpu_backend

    if backend == "cpu":
        require_cpu_backend()
    monkeypatch.setenv(BACKEND_ENV_VAR, backend)
    clear_statistics()
    train, val = Collector(quantiles="x"), Collector(stage="validate")
    with torch.inference_mode():
        report("y", 1.0)  # the first sketch edges may be asked for here too
    report("x", 1.0)
    with torch.inference_mode():
        val.update()
    report("x", torch.tensor([2.0, 3.0]))
    train.update()
    assert train.num("x") == 3 and train.quantile("x", 0.5) == pytest.approx(2.0, rel=ALPHA)


def test_histogram_is_the_sketch_between_its_edges_and_unmatched_patterns_are_named() -> None:
    clear_statistics()
    c = Collector(quantiles="x|z", stragglers="none", relative_accuracy=0.05, value_range=(1e-3, 1e3))
    values = [-2.0, -0.5, 0.0, 1e-4, 0.7, 0.7, 3.0, 5e3]  # the zero bucket, both signs, an overflow
    report("x", values)
    report("z", [])
    c.update()
    counts, edges = c.histogram("x")
    assert (edges[0], edges[-1]) == (-2.0, 5e3) and np.all(np.diff(edges) > 0)  # clipped to min, max
    assert counts.tolist() == np.histogram(values, edges)[0].tolist()  # no value on an edge here
    assert counts[0] > 0 and counts[-1] > 0  # trimmed to the buckets with values
    assert [a.size for a in c.histogram("z")] == [0, 0]
    report("x", [1.5, float("nan"), float("inf")])
    c.update()
    counts, edges = c.histogram("x")
    assert counts.sum() == c.num("x") == 1 and np.isfinite(edges).all()  # NaN and inf are not counted
    assert c.unmatched() == {"stragglers": ["x", "z"]}  # a pattern that matched no name
    with pytest.raises(KeyError, match=r"'y' is not matched by Collector\(quantiles='x\|z'\)"):
        report("y", 1.0), c.update(), c.histogram("y")
    misspelt = Collector(regex="Los/.*")
    report("Loss/a", 1.0)
    misspelt.update()
    assert misspelt.unmatched() == {"regex": ["Loss/a"]}  # the names reported here, for a hint
