"""bench/report.py: one nearest-rank rule for every percentile a bench prints or plots."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import report  # noqa: E402


def test_quantile_is_nearest_rank() -> None:
    assert [report.quantile([3.0, 1.0, 2.0, 4.0], q) for q in (0.0, 0.25, 0.5, 0.99, 1.0)] == [
        1.0, 1.0, 2.0, 4.0, 4.0]


def test_quantile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        report.quantile([], 0.5)
    with pytest.raises(ValueError, match="no values"):
        report.percentile_us([], 99)


def test_percentile_takes_the_rank_up_where_it_falls_between_two() -> None:
    # 150 samples: the p99 rank is 148.5, so nearest rank is the 149th value (round() gave the 148th).
    samples = [i / 1e6 for i in range(1, 151)]
    assert report.percentile_us(samples, 99) == pytest.approx(149.0)
    assert report.percentile_us(samples, 50) == pytest.approx(75.0)


def test_percentile_and_quantile_agree() -> None:
    samples = [((i * 37) % 101) / 1e3 for i in range(101)]
    for pct in (1, 50, 90, 99, 100):
        assert report.percentile_us(samples, pct) == pytest.approx(report.quantile(samples, pct / 100) * 1e6)


def test_ratio_interval_is_the_geometric_mean_with_a_t_interval_over_the_logs() -> None:
    mean, low, high = report.ratio_interval([0.5, 2.0])
    assert mean == pytest.approx(1.0)
    half = 12.706 * math.log(2.0) * math.sqrt(2) / math.sqrt(2)  # t(1 df) * stdev of (-ln2, ln2) / sqrt(2)
    assert (low, high) == (pytest.approx(math.exp(-half)), pytest.approx(math.exp(half)))
    mean, low, high = report.ratio_interval([1.02] * 10)
    assert (mean, low, high) == (pytest.approx(1.02), pytest.approx(1.02), pytest.approx(1.02))
    assert report.ratio_interval([0.9]) == (0.9, 0.9, 0.9)


def test_ratio_interval_narrows_with_more_pairs_of_the_same_spread() -> None:
    few = report.ratio_interval([0.98, 1.02] * 2)
    many = report.ratio_interval([0.98, 1.02] * 20)
    assert few[1] < many[1] < 1.0 < many[2] < few[2]


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -2.0], [float("nan")]])
def test_ratio_interval_refuses_no_ratios_and_ones_that_are_not_positive(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="paired ratios must be positive"):
        report.ratio_interval(bad)
