"""Chan's moment merge (``lightning_ext.kernels.merge_moments``, with the kernels' ``moments_from_shifted``)
against correctly rounded float64 moments, within the derived rounding bounds; a collector's values on
two devices merged."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ext.kernels import merge_moments, moments_from_shifted
from lightning_ext.stats import Collector, clear_statistics, report
from tests.helpers.float64_reference import assert_moments_close

EMPTY = (0.0, 0.0, 0.0, math.inf, -math.inf)


def _empty_moments(rows: int) -> torch.Tensor:
    return torch.tensor(EMPTY, dtype=torch.float64).repeat(rows, 1)


def _exact_row(x: torch.Tensor) -> torch.Tensor:
    """Moment row of ``x`` from ``math.fsum`` (correctly rounded sums): a leaf with no summation error."""
    v = x.to(torch.float64).reshape(-1).tolist()
    if not v:
        return _empty_moments(1)[0]
    mean = math.fsum(v) / len(v)
    return torch.tensor(
        [len(v), mean, math.fsum((a - mean) ** 2 for a in v), min(v), max(v)], dtype=torch.float64
    )


def _stats(row: torch.Tensor) -> dict[str, float]:
    n, mean, m2, lo, hi = row.tolist()
    return {"num": n, "mean": mean, "std": math.sqrt(m2 / n), "min": lo, "max": hi}


def _shifted(x: torch.Tensor, shift: float) -> torch.Tensor:
    d = x.to(torch.float64) - shift
    return torch.stack(
        [torch.tensor(float(x.numel()), dtype=torch.float64), d.sum(), d.square().sum(), x.min(), x.max()]
    )


@pytest.mark.parametrize("offset", [0.0, 1e6, -1e9])
def test_shifted_then_merge_matches_direct(offset: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = offset + torch.randn(1001, generator=gen, dtype=torch.float64)
    parts = [x[:1], x[1:400], x[400:401], x[401:]]
    rows = [
        moments_from_shifted(_shifted(p, float(p[0])), torch.tensor(float(p[0]), dtype=torch.float64))
        for p in parts
    ]
    merged = _empty_moments(1)[0]
    for row in rows:
        merged = merge_moments(merged, row)
    # Four leaves summed around their first value, three real merges (the first, into the empty
    # row, is exact): within the derived bound, dominated by the spacing of the mean (|offset|·eps)
    # entering the merges' between-part terms, not by cancellation.
    assert_moments_close(_stats(merged), x, f"offset {offset}", merges=3)


def test_merge_with_empty_is_identity_and_empty_with_empty_is_empty() -> None:
    row = _exact_row(torch.tensor([1.0, 2.0, 4.0]))
    empty = _empty_moments(1)[0]
    torch.testing.assert_close(merge_moments(row, empty), row)
    torch.testing.assert_close(merge_moments(empty, row), row)
    both = merge_moments(empty, empty)
    assert both.tolist() == [0.0, 0.0, 0.0, math.inf, -math.inf]


def test_rows_of_another_device_than_the_collectives_merge_about_each_mean() -> None:
    """Values that lived on another device than the collectives' (CUDA values and Python numbers on
    the CPU, reduced on CUDA; here ``cpu`` values reduced on ``cpu:0``, another device to torch) are
    merged into one row per name about its mean (Chan's merge), the sketch counts added: the same
    statistics and quantiles as on one device, for every name (the merged means are a strided view:
    the compiled kernels once read them as the wrong elements, and only the first name came out
    right)."""
    from lightning_ext.stats import init_multiprocessing

    clear_statistics()
    init_multiprocessing(0, "cpu:0")  # a world of one whose collective device differs from the values'
    c = Collector(quantiles="x")
    gen = torch.Generator().manual_seed(0)
    values = {
        "x": 1e6 + torch.randn(101, generator=gen, dtype=torch.float64),
        "y": -5.0 + torch.randn(7, generator=gen, dtype=torch.float64),
        "z": 3e14 * (1 + torch.rand(3, generator=gen, dtype=torch.float64)),
    }
    for name, x in values.items():
        report(name, x[:50])
        report(name, [float(v) for v in x[50:]] + [math.inf])
    c.update()
    for name, x in values.items():
        assert_moments_close(
            {k: getattr(c, k)(name) for k in ("num", "mean", "std", "min", "max")}, x, name, merges=1
        )
        assert c.nonfinite(name) == 1
    assert c.histogram("x")[0].sum() == 101
    assert c.quantile("x", 0.5) == pytest.approx(float(values["x"].median()), rel=0.01)
    clear_statistics()


@settings(max_examples=60, deadline=None)
@given(
    # no subnormals: after inductor's fast-math code loads (torch 2.5) a process flushes them to zero,
    # and hypothesis refuses to draw them there
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    offset=st.sampled_from([0.0, 1e6, -3e7]),
)
def test_any_split_merges_to_the_direct_moments(values, cuts, offset) -> None:
    x = torch.tensor(values, dtype=torch.float64) + offset
    bounds = sorted({0, len(values), *(min(c, len(values)) for c in cuts)})
    merged = _empty_moments(1)[0]
    for lo, hi in itertools.pairwise(bounds):
        merged = merge_moments(merged, _exact_row(x[lo:hi]))
    if not values:
        assert merged.tolist() == [0.0, 0.0, 0.0, math.inf, -math.inf]
        return
    # Exact leaves, at most len(bounds) - 1 merges: only merge_moments' rounding is measured.
    assert_moments_close(_stats(merged), x, merges=len(bounds) - 1)
