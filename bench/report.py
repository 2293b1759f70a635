"""Printing a benchmark's figures next to its baseline and saving them as JSON."""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def median_us(samples_s: list[float]) -> float:
    """Median of ``samples_s`` (seconds) in microseconds."""
    return statistics.median(samples_s) * 1e6


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank rule: the smallest value with at least
    ``q`` of the values at or below it. ``ValueError`` for no values. Cost: one sort."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def percentile_us(samples_s: list[float], pct: float) -> float:
    """The ``pct`` percentile (0-100, nearest rank, as ``quantile``) of ``samples_s`` in microseconds."""
    return quantile(samples_s, pct / 100) * 1e6


def verdict(ratio: float, target: float, lower_is_better: bool = True) -> str:
    """``PASS``/``MISS`` of ``ratio`` against ``target``."""
    ok = ratio <= target if lower_is_better else ratio >= target
    return "PASS" if ok else "MISS"


def save(name: str, figures: dict[str, object]) -> Path:
    """Write ``figures`` (plus machine and time) to ``bench/results/NAME.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    record = {
        "bench": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": platform.platform(),
        **figures,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
