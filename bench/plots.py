"""PNG plots of the multi-tenant benchmark: memory held per tenant over time, and TTFT distributions.

Every figure says what produced it (a caption line: machine and model, see
``machine_caption`` and ``model_caption``) and keeps its legend outside the
axes, so no curve hides behind it. The memory plot labels the capacity and
the static shares on their lines; the TTFT plot marks each mode's p50 and p99.

Needs matplotlib (``pip install -e ".[bench]"``); imported on the first call.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from report import quantile

MiB = 1 << 20
GiB = 1 << 30
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}


def available() -> bool:
    """Whether matplotlib can be imported (the plots are skipped, with a note, when not)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit('the plots need matplotlib: pip install -e ".[bench]"') from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine_caption() -> str:
    """``machine: <cpu model>, N cores, M GiB RAM (Python x.y)``, from /proc and os."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as stream:
            names = [line.split(":", 1)[1].strip() for line in stream if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:
        ram = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM"
    except (ValueError, OSError):
        ram = ""
    return f"machine: {cpu}, {os.cpu_count()} cores{ram} (Python {platform.python_version()})"


def model_caption(config: Any, count: int = 1, dtype: str = "fp32") -> str:
    """``model: 3 x Llama, 4 layers, 8 query / 4 KV heads of 32, fp32`` from a transformers config."""
    family = str(getattr(config, "model_type", "model")).capitalize()
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    times = f"{count} x " if count > 1 else ""
    return (
        f"model: {times}{family}, {config.num_hidden_layers} layers, {heads} query / "
        f"{config.num_key_value_heads} KV heads of {head_dim}, {dtype}, random weights"
    )


def _caption(fig: Any, caption: str) -> None:
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=7, color="dimgray", ha="left", va="bottom")


def memory_plot(
    path: Path, timelines: dict[str, dict[str, Any]], capacity_bytes: int, caption: str = ""
) -> None:
    """Stacked areas of each tenant's mapped bytes over time, one panel per mode.

    The capacity and each static share (a third, two thirds with three
    tenants) are lines labelled at their right end.
    """
    plt = _pyplot()
    num_panels = len(timelines)
    fig, axes = plt.subplots(num_panels, 1, figsize=(10, 3.2 * num_panels + 0.4), sharex=True,
                             squeeze=False)  # fmt: skip
    capacity_mib = capacity_bytes / MiB
    for ax, (mode, timeline) in zip(axes[:, 0], timelines.items()):
        times = timeline["t"]
        stacks = [[b / MiB for b in series] for series in timeline["mapped"]]
        num_tenants = len(stacks)
        ax.stackplot(times, *stacks, labels=[f"tenant {i}" for i in range(num_tenants)], alpha=0.85)
        ax.axhline(capacity_mib, color="black", linewidth=1, linestyle="--")
        _line_label(ax, capacity_mib, "capacity")
        for i in range(1, num_tenants):
            share = capacity_mib * i / num_tenants
            ax.axhline(share, color="grey", linewidth=0.8, linestyle=":")
            _line_label(ax, share, f"static {i}/{num_tenants}")
        ax.set_title(f"{mode}: KV memory mapped per tenant (stacked)")
        ax.set_ylabel("MiB mapped")
        ax.set_ylim(0, capacity_mib * 1.12)
        ax.legend(fontsize=8, **LEGEND_OUTSIDE)
    axes[-1, 0].set_xlabel("seconds since the trace started")
    _caption(fig, caption)
    fig.tight_layout(rect=(0, 0.03 if caption else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _line_label(ax: Any, y: float, text: str) -> None:
    """``text`` just above the horizontal line at ``y``, at the right end of the axes."""
    ax.annotate(text, xy=(1.0, y), xycoords=("axes fraction", "data"), xytext=(-4, 2),
                textcoords="offset points", ha="right", va="bottom", fontsize=8,
                color="dimgray")  # fmt: skip


def ttft_plot(path: Path, ttfts: dict[str, list[float]], caption: str = "") -> None:
    """Empirical CDF of time to first token, one line per mode, log time axis;
    each mode's p50 and p99 marked and labelled with their values (each mode's
    labels one line lower than the one before, so modes with equal quantiles stay readable)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for index, (mode, values) in enumerate(ttfts.items()):
        ordered = sorted(values)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        (line,) = ax.step(ordered, fractions, where="post", label=f"{mode} (n={len(ordered)})")
        for q, marker, offset, align in ((0.5, "o", 6, "left"), (0.99, "s", -6, "right")):
            x = quantile(ordered, q)  # p50 labelled right of its mark, p99 left (inside the axes)
            ax.plot([x], [q], marker=marker, color=line.get_color(), markersize=6, zorder=3)
            ax.annotate(f"{mode} p{round(q * 100)} {x:.2f} s", xy=(x, q), xytext=(offset, -11 - 11 * index),
                        textcoords="offset points", fontsize=8, ha=align, color=line.get_color(),
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                              "alpha": 0.85})  # fmt: skip
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.04)
    ax.set_title("TTFT distribution, same bursty traces (● p50, ■ p99)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, **LEGEND_OUTSIDE)
    _caption(fig, caption)
    fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
