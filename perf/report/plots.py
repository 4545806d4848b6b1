"""The report's figures: matplotlib's object API on the Agg canvas (no pyplot state), written
as PNGs without a ``Software`` stamp so the same rows give the same bytes."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .formatting import fmt, fmt_ratio
from .results import Row, is_number
from .sections import TTFT_MISS, TTFT_WARM, compression_label, paired_ratios, prompt_tokens

KVTIER_COLOR, BASELINE_COLOR = "#1f77b4", "#aaaaaa"


class Plots:
    """Writes figures into ``<out>/plots``; remembers what it wrote."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.dir = out_dir / "plots"
        self.written: list[Path] = []

    def save(self, fig: Figure, name: str) -> str:
        """Writes ``fig`` as ``plots/<name>.png``; returns its link relative to the report."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{name}.png"
        fig.tight_layout()
        FigureCanvasAgg(fig).print_png(str(path), metadata={"Software": None})
        self.written.append(path)
        return f"plots/{name}.png"

    def remove_stale(self) -> None:
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("*.png")):
            if path not in self.written:
                path.unlink()


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=100)


def paired_bars(
    labels: list[str],
    values: list[float],
    baselines: list[float | None],
    ratios: list[float | None],
    unit: str,
    title: str,
    series: tuple[str, str] = ("kvtier", "baseline (same run)"),
) -> Figure:
    """Horizontal bars, each figure next to its same-run baseline, the ratio beside."""
    n = len(labels)
    fig = _figure(8, 1.2 + 0.55 * n)
    ax = fig.add_subplot()
    ys = list(range(n))
    base = [b if b is not None else 0.0 for b in baselines]
    ax.barh([y - 0.2 for y in ys], values, 0.38, color=KVTIER_COLOR, label=series[0])
    ax.barh([y + 0.2 for y in ys], base, 0.38, color=BASELINE_COLOR, label=series[1])
    positive = [v for v in values + base if v > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_xscale("log")
    for y, value, ratio in zip(ys, values, ratios, strict=True):
        ax.annotate(
            f" {fmt(value)}  ({fmt_ratio(ratio)})",
            (value, y - 0.2),
            va="center",
            fontsize=8,
        )
    # room right of the longest bar for its label: the bars take 70% of the axis
    left, longest = ax.get_xlim()[0], max(positive, default=1.0)
    if ax.get_xscale() == "log":
        ax.set_xlim(left, left * (longest / left) ** (1 / 0.7))
    else:
        ax.set_xlim(left, left + (longest - left) / 0.7)
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


def _spread_err(rows: list[Row], key: str, values: list[float]) -> list[list[float]] | None:
    """Error bars (below, above) from every row's ``key`` = [min, max]; None unless all
    rows have one."""
    spreads = [r.fields.get(key) for r in rows]
    if not all(isinstance(s, list) and len(s) == 2 and all(map(is_number, s)) for s in spreads):
        return None
    return [
        [max(0.0, v - s[0]) for v, s in zip(values, spreads, strict=True)],
        [max(0.0, s[1] - v) for v, s in zip(values, spreads, strict=True)],
    ]


def ttft_figure(device: str, rows: list[Row]) -> Figure:
    tokens = [prompt_tokens(r, TTFT_WARM) for r in rows]
    warm = [r.value for r in rows]
    cold = [r.baseline_value or math.nan for r in rows]
    fig = _figure(7, 4.2)
    ax = fig.add_subplot()
    ax.errorbar(
        tokens, cold, _spread_err(rows, "baseline_spread", cold), marker="o", capsize=3,
        color=BASELINE_COLOR, label="cold prefill (baseline)",
    )  # fmt: skip
    ax.errorbar(
        tokens, warm, _spread_err(rows, "spread", warm), marker="o", capsize=3,
        color=KVTIER_COLOR, label="warm: kvtier hit",
    )  # fmt: skip
    for x, y, row in zip(tokens, warm, rows, strict=True):
        ax.annotate(
            fmt_ratio(row.ratio), (x, y), textcoords="offset points", xytext=(6, 6),
            ha="left", va="bottom", fontsize=8,
        )  # fmt: skip
    ax.set_yscale("log")
    ax.margins(x=0.12)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{device}: TTFT, kvtier hit vs cold prefill (ratio = hit ÷ cold)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig


def miss_figure(device: str, rows: list[Row]) -> Figure:
    tokens = [prompt_tokens(r, TTFT_MISS) for r in rows]
    kvtier = [r.value for r in rows]
    none = [r.baseline_value or math.nan for r in rows]
    fig = _figure(10, 4.2)
    left, right = fig.subplots(1, 2)
    xs = list(range(len(rows)))
    left.bar(
        [x + 0.2 for x in xs], none, 0.38, yerr=_spread_err(rows, "baseline_spread", none),
        capsize=3, color=BASELINE_COLOR, label="no connector (baseline)",
    )  # fmt: skip
    left.bar(
        [x - 0.2 for x in xs], kvtier, 0.38, yerr=_spread_err(rows, "spread", kvtier),
        capsize=3, color=KVTIER_COLOR, label="kvtier, pure miss",
    )  # fmt: skip
    left.set_xticks(xs, [str(t) for t in tokens])
    left.set_xlabel("prompt tokens")
    left.set_ylabel("time to first token (s)")
    left.set_title("TTFT on a pure miss", fontsize=10)
    left.legend(fontsize=8, loc="upper left")
    left.grid(axis="y", alpha=0.3)
    right.axhline(1.0, color=BASELINE_COLOR, linestyle="--", label="no connector = 1")
    for x, row in zip(xs, rows, strict=True):
        per_round = paired_ratios(row)
        right.scatter(
            [x] * len(per_round), per_round, color=KVTIER_COLOR, alpha=0.5, s=18,
            label="per round" if x == 0 else None,
        )  # fmt: skip
        right.scatter(
            [x], [row.ratio or math.nan], color="black", marker="_", s=400,
            label="ratio of medians" if x == 0 else None,
        )  # fmt: skip
        right.annotate(
            fmt_ratio(row.ratio), (x, row.ratio or 1.0), textcoords="offset points",
            xytext=(14, 0), fontsize=8, va="center",
        )  # fmt: skip
    right.set_xticks(xs, [str(t) for t in tokens])
    right.set_xlim(-0.6, len(xs) - 0.4)
    right.set_xlabel("prompt tokens")
    right.set_ylabel("kvtier ÷ no connector")
    right.set_title("Miss overhead ratio", fontsize=10)
    right.legend(fontsize=8, loc="upper right")
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{device}: what a miss costs (kvtier vs no connector)", fontsize=11)
    return fig


def compression_figure(device: str, rows: list[Row]) -> Figure:
    fig = _figure(7, 4.2)
    ax = fig.add_subplot()
    points = [(r, r.fields.get("error")) for r in rows if is_number(r.fields.get("error"))]
    ax.scatter([e for _, e in points], [r.value for r, _ in points], color=KVTIER_COLOR)
    for row, error in points:
        ax.annotate(
            f" {compression_label(row)}", (error, row.value), fontsize=8, va="center",
        )  # fmt: skip
    errors = [e for _, e in points if e > 0]
    if errors and max(errors) / min(errors) > 20:
        ax.set_xscale("log")
    ax.margins(x=0.2, y=0.1)
    metrics = sorted({str(r.fields.get("error_metric", "error")) for r, _ in points})
    ax.set_xlabel(", ".join(metrics) or "error")
    ax.set_ylabel("compression ratio (uncompressed ÷ compressed)")
    ax.axhline(1.0, color=BASELINE_COLOR, linestyle="--", label="uncompressed = 1")
    ax.set_title(f"{device}: compression ratio vs error", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig
