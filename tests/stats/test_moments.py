"""Pure moment helpers against correctly rounded float64 moments, within the derived rounding bounds."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ext.kernels.moments import (
    _moments_from_allreduce,
    _needs_recentering,
    _shifted_for_allreduce,
    moments_from_shifted,
)
from lightning_ext.stats.moments import _empty_moments, _fingerprint, _moments_of, merge_moments
from tests.helpers.float64_reference import assert_moments_close


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
    row = _moments_of(torch.tensor([1.0, 2.0, 4.0]))
    empty = _empty_moments(1)[0]
    torch.testing.assert_close(merge_moments(row, empty), row)
    torch.testing.assert_close(merge_moments(empty, row), row)
    both = merge_moments(empty, empty)
    assert both.tolist() == [0.0, 0.0, 0.0, math.inf, -math.inf]


def test_allreduce_formulae_reproduce_global_moments_with_large_offset() -> None:
    # Three "ranks" with far-apart means around 1e8: the shared shift (largest mean) keeps the rounding
    # bound small (the naive formula below is off by more than 1e-3 of m2).
    gen = torch.Generator().manual_seed(1)
    shards = [1e8 + torch.randn(n, generator=gen, dtype=torch.float64) + k for k, n in enumerate([5, 0, 300])]
    rows = torch.stack([_exact_row(s) for s in shards])  # (W, 5) for one name
    means = torch.where(rows[:, 0] > 0, rows[:, 1], torch.full_like(rows[:, 1], -math.inf))
    shift = means.max().reshape(1)
    spread = (means.max() - rows[rows[:, 0] > 0, 1].min()).reshape(1)
    lo, hi = rows[:, 3].min().reshape(1), rows[:, 4].max().reshape(1)
    sums = sum(_shifted_for_allreduce(rows[w : w + 1], shift) for w in range(3))
    got = _moments_from_allreduce(sums, shift, lo, hi, spread)[0]
    # One merge of 3 rows around a shift inside the data: within the derived rounding bound.
    assert_moments_close(_stats(got), torch.cat(shards), "all-reduce", merges=1, ways=3)
    ref = _exact_row(torch.cat(shards))
    distance = (means.max() - rows[rows[:, 0] > 0, 1].min()).reshape(1)
    assert not _needs_recentering(got.reshape(1, 5), spread, distance).any()
    # Around a shift far outside the data (0 instead of ~1e8) the bound flags the row.
    far = torch.zeros(1, dtype=torch.float64)
    sums_far = sum(_shifted_for_allreduce(rows[w : w + 1], far) for w in range(3))
    got_far = _moments_from_allreduce(sums_far, far, lo, hi, spread)
    assert _needs_recentering(got_far, spread, means.max().reshape(1)).all()
    # One rank with values (spread 0): the between-rank term is exactly 0 whatever the shift.
    single = _moments_of(torch.tensor([5.0, 5.0], dtype=torch.float64)).reshape(1, 5)
    one = _moments_from_allreduce(_shifted_for_allreduce(single, far + 3.0), far + 3.0, lo, hi, far)
    assert one[0, 2] == 0.0 and one[0, 1] == 5.0
    # The textbook E[x²] - E[x]² from raw sums loses everything at this offset: the test discriminates.
    x = torch.cat(shards)
    naive_m2 = x.square().sum() - x.sum() ** 2 / x.numel()
    assert abs(float(naive_m2 - ref[2])) > 1e-3 * float(ref[2])


def test_fingerprint_is_exact_in_float64_and_order_sensitive() -> None:
    fp = _fingerprint(["a", "b"])
    assert fp == float(int(fp)) and 0 < fp < 2**53
    assert _fingerprint(["a", "b"]) != _fingerprint(["b", "a"])
    assert _fingerprint([]) != _fingerprint([""])


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
