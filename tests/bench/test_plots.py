"""bench/plots.py: the figures say what produced them, label the static shares, keep the
legend off the data, and mark p50/p99. Skipped without matplotlib (the ``bench`` extra)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import plots  # noqa: E402

MiB = 1 << 20


class Captured:
    """pyplot, but figures are kept open for the test to read instead of closed."""

    def __init__(self) -> None:
        self.plt = plots._pyplot()
        self.figures: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plt, name)

    def subplots(self, *args: Any, **kwargs: Any) -> Any:
        fig, axes = self.plt.subplots(*args, **kwargs)
        self.figures.append(fig)
        return fig, axes

    def close(self, _fig: Any) -> None:
        pass


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    keep = Captured()
    monkeypatch.setattr(plots, "_pyplot", lambda: keep)
    return keep


def texts(fig: Any) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text"))]


def legend_is_outside(fig: Any, ax: Any) -> bool:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    return legend.x0 >= ax.get_window_extent(renderer).x1


def test_memory_plot(tmp_path: Path, captured: Captured) -> None:
    timeline = {"t": [0.0, 1.0, 2.0], "mapped": [[2 * MiB] * 3, [4 * MiB] * 3, [MiB] * 3]}
    path = tmp_path / "memory.png"
    plots.memory_plot(path, {"static": timeline, "elastic": timeline}, 36 * MiB, "machine: m · model: x")
    assert path.stat().st_size > 0
    (fig,) = captured.figures
    shown = texts(fig)
    assert shown.count("capacity") == 2 and shown.count("static 1/3") == 2 and shown.count("static 2/3") == 2
    assert "machine: m · model: x" in shown
    assert all(legend_is_outside(fig, ax) for ax in fig.axes)


def test_ttft_plot_marks_p50_and_p99(tmp_path: Path, captured: Captured) -> None:
    values = [float(i) for i in range(1, 101)]
    plots.ttft_plot(tmp_path / "ttft.png", {"static": values, "elastic": [v / 4 for v in values]}, "cap")
    (fig,) = captured.figures
    shown = texts(fig)
    for label in ("static p50 50.00 s", "static p99 99.00 s", "elastic p50 12.50 s",
                  "elastic p99 24.75 s", "cap"):  # fmt: skip
        assert label in shown
    assert legend_is_outside(fig, fig.axes[0])


def test_ttft_labels_of_modes_with_equal_quantiles_do_not_overlap(tmp_path: Path, captured: Captured) -> None:
    values = [float(i) for i in range(1, 101)]
    plots.ttft_plot(tmp_path / "ttft.png", {"elastic": values, "floor": list(values)})
    (fig,) = captured.figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = {t.get_text(): t.get_window_extent(renderer) for t in fig.axes[0].texts}
    for q in ("p50 50.00 s", "p99 99.00 s"):
        first, second = labels[f"elastic {q}"], labels[f"floor {q}"]
        assert not first.overlaps(second)


def test_captions_name_the_machine_and_the_model() -> None:
    class Config:
        model_type, num_hidden_layers, num_attention_heads = "llama", 4, 8
        num_key_value_heads, hidden_size = 4, 256

    assert plots.model_caption(Config(), 3) == (
        "model: 3 x Llama, 4 layers, 8 query / 4 KV heads of 32, fp32, random weights"
    )
    assert plots.machine_caption().startswith("machine: ") and " cores" in plots.machine_caption()
