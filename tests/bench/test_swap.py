"""bench/swap.py's figure: the median of each round's baseline over its sleep+wake, round 0 out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import swap  # noqa: E402


def test_the_figure_pairs_each_round_and_leaves_the_first_out() -> None:
    base = [0.10, 0.05, 0.10, 0.10, 0.20]  # the machine ran fast in round 1 only
    ours = [0.50, 0.10, 0.125, 0.125, 0.25]  # the sleep+wake of round 0 also made the host buffer
    assert swap.paired_ratio(base, ours) == pytest.approx(0.8)  # best over best would say 0.5


def test_one_round_is_its_own_figure() -> None:
    assert swap.paired_ratio([0.1], [0.2]) == pytest.approx(0.5)
