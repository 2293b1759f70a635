"""PNG plots of the multi-tenant benchmark: memory held per tenant over time, and TTFT distributions.

Needs matplotlib (``pip install -e ".[bench]"``); imported on the first call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MiB = 1 << 20


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit('the plots need matplotlib: pip install -e ".[bench]"') from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_plot(path: Path, timelines: dict[str, dict[str, Any]], capacity_bytes: int) -> None:
    """Stacked areas of each tenant's mapped bytes over time, one panel per mode."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 3.2 * len(timelines)), sharex=True)
    for ax, (mode, timeline) in zip(axes, timelines.items()):
        times = timeline["t"]
        stacks = [[b / MiB for b in series] for series in timeline["mapped"]]
        labels = [f"tenant {i}" for i in range(len(stacks))]
        ax.stackplot(times, *stacks, labels=labels, alpha=0.85)
        ax.axhline(capacity_bytes / MiB, color="black", linewidth=1, linestyle="--", label="capacity")
        for i in range(1, len(stacks)):
            ax.axhline(capacity_bytes * i / len(stacks) / MiB, color="grey", linewidth=0.6, linestyle=":")
        ax.set_title(f"{mode}: KV memory held per tenant")
        ax.set_ylabel("MiB mapped")
        ax.set_ylim(0, capacity_bytes / MiB * 1.08)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the trace started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_plot(path: Path, ttfts: dict[str, list[float]]) -> None:
    """Empirical CDF of time to first token, one line per mode, log time axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, values in ttfts.items():
        ordered = sorted(values)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, fractions, where="post", label=f"{mode} (n={len(ordered)})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution, same bursty traces")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
