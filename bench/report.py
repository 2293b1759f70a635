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


# Student's t at 97.5% (a two-sided 95% interval) for 1..30 degrees of freedom; 1.96 past them.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its two-sided 95% interval ``(mean, low, high)``:
    Student's t over the logs. With one ratio the interval is that ratio alone (no spread to
    read). ``ValueError`` for no ratios or one that is not positive. O(n)."""
    if not ratios or any(not r > 0 for r in ratios):
        raise ValueError(f"paired ratios must be positive numbers, got {ratios!r}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) == 1:
        return ratios[0], ratios[0], ratios[0]
    df = len(logs) - 1
    half = (_T975[df - 1] if df <= len(_T975) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


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
