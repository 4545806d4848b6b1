"""Render the benchmark report: ``perf/report.md`` and its plots, from ``perf/results/``.

    python perf/report.py [--results perf/results] [--out perf]

Reads every kvtier results file in ``--results`` (``<device>.json``,
``<device>-<suffix>.json``, as ``perf/benchmarks/conftest.py`` writes them; pytest-benchmark's raw
``latest.json`` is ignored, any other file without a ``results`` list is named as not
read) and writes ``<out>/report.md`` with PNG plots in ``<out>/plots/`` (matplotlib, Agg,
no pyplot state). Rows are
grouped by the device their file's ``machine`` names, so results committed from a GPU
machine (``nvidia-h100-80gb-hbm3.json``, …) get their own subsection and plot in every
section they have rows for.

Sections, and the rows that feed them:

- time to first token, cold vs warm — ``ttft_warm_kvtier_<N>_tokens`` (baseline: cold
  prefill) from ``perf/benchmarks/test_bench_vllm_ttft.py``;
- miss overhead — ``ttft_miss_kvtier_<N>_tokens`` (baseline: no connector), with the
  per-round ratios;
- throughput — every row in GB/s, by tier and op (``"<tier> tier <op>"``,
  ``"engine <op> (…)"``, anything else as it is named);
- lookups — every row in lookups/s, the tier in the metric's parentheses;
- chunk hashing — rows named ``chunk hashing`` (Mtokens/s, per ``algorithm``);
- compression ratio vs error — rows whose metric starts with ``compression``: ``value`` is
  the compression ratio (unit ``x``), ``error`` the reconstruction error, ``error_metric``
  its name, ``codec`` an optional label; "no results yet" until a benchmark records one;
- other results — any row no section takes, so that none is dropped silently.

NOTE: the output depends only on the JSON inputs (and the matplotlib version for the
PNG pixels): no clock is read, files and devices are sorted, and PNGs carry no
``Software`` stamp. PNGs in ``<out>/plots/`` that this render did not write are removed,
so a plot never outlives its data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.style
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

HERE = Path(__file__).resolve().parent
TIER_ORDER = ["cpu", "engine", "disk", "server", "redis", "s3"]
OP_ORDER = ["put", "store", "get", "retrieve"]
KVTIER_COLOR, BASELINE_COLOR = "#1f77b4", "#aaaaaa"
NO_RESULTS = "_No results yet._"


# -- the data -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One result row and the device and file it came from."""

    device: str
    source: str
    fields: dict

    @property
    def metric(self) -> str:
        return str(self.fields["metric"])

    @property
    def value(self) -> float:
        return float(self.fields["value"])

    @property
    def unit(self) -> str:
        return str(self.fields.get("unit", ""))

    @property
    def baseline(self) -> str:
        return str(self.fields.get("baseline", "")) or "—"

    @property
    def baseline_value(self) -> float | None:
        value = self.fields.get("baseline_value")
        return float(value) if _is_number(value) else None

    @property
    def ratio(self) -> float | None:
        """The row's ratio (value ÷ baseline_value), as recorded or computed."""
        if _is_number(self.fields.get("ratio")):
            return float(self.fields["ratio"])
        if self.baseline_value:
            return self.value / self.baseline_value
        return None


@dataclass(frozen=True, slots=True)
class Source:
    """A results file that was read: its device, machine description and row count."""

    name: str
    device: str
    machine: dict
    rows: int
    dropped: int


@dataclass(slots=True)
class Results:
    sources: list[Source] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file name, why)
    rows: list[Row] = field(default_factory=list)

    def devices(self) -> list[str]:
        """Devices in report order: the CPU first, then by name."""
        return sorted({s.device for s in self.sources}, key=lambda d: (d != "cpu", d.lower()))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def load_results(results_dir: Path) -> Results:
    """Every kvtier results file in ``results_dir``, in file-name order."""
    results = Results()
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            results.skipped.append((path.name, f"unreadable: {type(err).__name__}"))
            continue
        if isinstance(data, dict) and "benchmarks" in data and "results" not in data:
            continue  # pytest-benchmark's raw data (latest.json, not committed)
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            results.skipped.append((path.name, "not a kvtier results file: no `results` list"))
            continue
        machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
        device = str(machine.get("device") or path.stem)
        rows = [
            Row(device, path.name, row)
            for row in data["results"]
            if isinstance(row, dict) and isinstance(row.get("metric"), str)
            if _is_number(row.get("value"))
        ]
        dropped = len(data["results"]) - len(rows)
        results.sources.append(Source(path.name, device, machine, len(rows), dropped))
        results.rows.extend(rows)
    return results


# -- formatting -----------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    """A figure with about three significant digits: 44,716 → ``44,716``, 17.25 → ``17.3``,
    4.597 → ``4.60``, 0.06463 → ``0.0646``; None → ``—``."""
    if value is None:
        return "—"
    if value != 0 and abs(value) < 100:
        value = float(f"{value:.3g}")  # 0.99963 → 1.0 prints as 1.00, not 1.000
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude == 0:
        return "0"
    return f"{value:.{2 - math.floor(math.log10(magnitude))}f}"


def fmt_ratio(ratio: float | None) -> str:
    """``0.912×``, ``62.5×``; None → ``—``."""
    return "—" if ratio is None else f"{fmt(ratio)}×"


def fmt_spread(value: float | None, spread: object) -> str:
    """``1.24 (1.16–1.26)`` when ``spread`` is a [min, max] pair, else the value alone."""
    if isinstance(spread, list) and len(spread) == 2 and all(map(_is_number, spread)):
        return f"{fmt(value)} ({fmt(spread[0])}–{fmt(spread[1])})"
    return fmt(value)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: Iterable[list[object]], align: str = "") -> list[str]:
    """A GitHub markdown table; ``align`` holds ``l`` or ``r`` per column (default ``l``)."""
    marks = ["---:" if (align[i : i + 1] == "r") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
    return lines


# -- sections: which rows each takes ----------------------------------------------------------

TTFT_WARM = re.compile(r"^ttft_warm_kvtier_(\d+)_tokens$")
TTFT_MISS = re.compile(r"^ttft_miss_kvtier_(\d+)_tokens$")


def _tokens(row: Row, pattern: re.Pattern) -> int:
    match = pattern.match(row.metric)
    assert match is not None
    return int(match.group(1))


def _is_compression(row: Row) -> bool:
    return row.metric.lower().startswith("compression")


def _is_hashing(row: Row) -> bool:
    return row.metric.startswith("chunk hashing")


TTFT_SHARED = re.compile(r"^ttft_(engine_b_via_server|pd_consumer)_(\d+)_tokens$")


SECTION_OF: list[tuple[str, Callable[[Row], bool]]] = [
    ("ttft", lambda r: bool(TTFT_WARM.match(r.metric))),
    ("shared_ttft", lambda r: bool(TTFT_SHARED.match(r.metric))),
    ("proxy", lambda r: r.metric.startswith("proxy_")),
    ("miss", lambda r: bool(TTFT_MISS.match(r.metric))),
    ("compression", _is_compression),
    ("blend", lambda r: r.metric.startswith("blend")),
    ("hashing", _is_hashing),
    ("lookups", lambda r: r.unit == "lookups/s"),
    ("throughput", lambda r: r.unit == "GB/s"),
]


def section_of(row: Row) -> str:
    for name, takes in SECTION_OF:
        if takes(row):
            return name
    return "other"


def tier_and_op(metric: str) -> tuple[str, str]:
    """``"disk tier put"`` → (disk, put); ``"engine store (gather + put)"`` → (engine,
    store (gather + put)); anything else → ("—", metric)."""
    if match := re.match(r"^(\S+) tier (.+)$", metric):
        return match.group(1), match.group(2)
    if metric.startswith("engine "):
        return "engine", metric.removeprefix("engine ")
    return "—", metric


def _rank(name: str, order: list[str]) -> int:
    first = name.split()[0] if name.split() else name
    return order.index(first) if first in order else len(order)


def lookup_tier(metric: str) -> str:
    match = re.search(r"\(([^)]+)\)\s*$", metric)
    return match.group(1) if match else metric


def hashing_label(row: Row) -> str:
    if "algorithm" in row.fields:
        return str(row.fields["algorithm"])
    match = re.search(r"\[(.+)\]$", str(row.fields.get("benchmark", "")))
    return match.group(1) if match else row.metric


# -- plots ------------------------------------------------------------------------------------


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
    if not all(isinstance(s, list) and len(s) == 2 and all(map(_is_number, s)) for s in spreads):
        return None
    return [
        [max(0.0, v - s[0]) for v, s in zip(values, spreads, strict=True)],
        [max(0.0, s[1] - v) for v, s in zip(values, spreads, strict=True)],
    ]


def ttft_figure(device: str, rows: list[Row]) -> Figure:
    tokens = [_tokens(r, TTFT_WARM) for r in rows]
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


def paired_ratios(row: Row) -> list[float]:
    """Per-round ratios kvtier ÷ no connector, from the rows' per-round figures."""
    rounds, baseline_rounds = row.fields.get("rounds"), row.fields.get("baseline_rounds")
    if not (isinstance(rounds, list) and isinstance(baseline_rounds, list)):
        return []
    if len(rounds) != len(baseline_rounds) or not all(map(_is_number, rounds + baseline_rounds)):
        return []
    return [k / n for k, n in zip(rounds, baseline_rounds, strict=True) if n]


def miss_figure(device: str, rows: list[Row]) -> Figure:
    tokens = [_tokens(r, TTFT_MISS) for r in rows]
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
    points = [(r, r.fields.get("error")) for r in rows if _is_number(r.fields.get("error"))]
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


def compression_label(row: Row) -> str:
    return str(row.fields.get("codec") or row.metric.removeprefix("compression").strip(" :"))


# -- the report ---------------------------------------------------------------------------------


def _machine_line(machine: dict) -> str:
    parts = []
    if machine.get("cpu"):
        cores = f", {machine['cpu_count']} cores" if machine.get("cpu_count") else ""
        parts.append(f"{machine['cpu']}{cores}")
    for key in ("python", "torch", "triton"):
        if machine.get(key):
            parts.append(f"{key} {machine[key]}")
    return ", ".join(parts) or "—"


def _caption(text: str) -> list[str]:
    return ["", f"*{text}*", ""]


def _ratio_list(items: Iterable[tuple[str, float | None]]) -> str:
    return "; ".join(f"{label} {fmt_ratio(ratio)}" for label, ratio in items)


def _baselines_by_name(items: Iterable[tuple[str, str]]) -> str:
    """ "raw torch copy for cpu put, cpu get; raw file write for disk put"."""
    grouped: dict[str, list[str]] = {}
    for label, baseline in items:
        grouped.setdefault(baseline, []).append(label)
    return "; ".join(f"{baseline} for {', '.join(labels)}" for baseline, labels in grouped.items())


class Report:
    def __init__(self, results: Results, out_dir: Path, results_dir: Path):
        self.results = results
        self.plots = Plots(out_dir)
        self.out_dir = out_dir
        self.results_dir = results_dir
        self.by_section: dict[str, dict[str, list[Row]]] = {}
        for row in results.rows:
            self.by_section.setdefault(section_of(row), {}).setdefault(row.device, []).append(row)
        self.lines: list[str] = []

    def rows(self, section: str) -> list[tuple[str, list[Row]]]:
        """(device, rows) for every device with rows in ``section``, in device order."""
        per_device = self.by_section.get(section, {})
        return [(d, per_device[d]) for d in self.results.devices() if d in per_device]

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def figure(self, fig: Figure, name: str, alt: str) -> None:
        self.add("", f"![{alt}]({self.plots.save(fig, name)})")

    def render(self) -> str:
        self.header()
        self.headlines()
        self.ttft()
        self.miss()
        self.throughput()
        self.lookups()
        self.hashing()
        self.compression()
        self.shared_ttft()
        self.proxy()
        self.blend()
        self.other()
        self.plots.remove_stale()
        text = "\n".join(self.lines).rstrip("\n") + "\n"
        return re.sub(r"\n{3,}", "\n\n", text)

    # -- sections ------------------------------------------------------------------------------

    def _source_name(self, name: str) -> str:
        """A link to the results file when it lies under the report's folder."""
        try:
            relative = (self.results_dir.resolve() / name).relative_to(self.out_dir.resolve())
        except ValueError:
            return f"`{name}`"
        return f"[`{relative.as_posix()}`]({relative.as_posix()})"

    def header(self) -> None:
        self.add(
            "# kvtier benchmark report",
            "",
            "Generated by `make bench` (the `perf/` suite, then `python perf/report.py`) from "
            "the result files below; do not edit by hand. Every figure is measured next to a "
            "baseline **in the same run**, and the ratio is kvtier ÷ baseline: compare ratios "
            "rather than absolute figures across runs or machines. How each benchmark works: "
            "[docs/performance.md](../docs/performance.md).",
            "",
            "## Sources",
            "",
        )
        if not self.results.sources:
            self.add(NO_RESULTS)
        else:
            self.add(
                *table(
                    ["File", "Device", "Machine", "Latest run (UTC)", "Rows"],
                    (
                        [
                            self._source_name(s.name),
                            s.device,
                            _machine_line(s.machine),
                            s.machine.get("date", "—"),
                            f"{s.rows}" + (f" ({s.dropped} unreadable)" if s.dropped else ""),
                        ]
                        for s in self.results.sources
                    ),
                    "lllll",
                )
            )
        if self.results.skipped:
            skipped = "; ".join(f"`{name}` ({why})" for name, why in self.results.skipped)
            self.add("", f"Not read: {skipped}.")

    def headlines(self) -> None:
        self.add("", "## Headlines", "")
        items: list[list[object]] = []
        for device in self.results.devices():
            warm = sorted(
                self.by_section.get("ttft", {}).get(device, []), key=lambda r: _tokens(r, TTFT_WARM)
            )
            if warm:
                row = warm[-1]
                speedup = f" ({fmt(1 / row.ratio)}× faster)" if row.ratio else ""
                items.append(
                    [
                        device,
                        f"TTFT, {_tokens(row, TTFT_WARM)}-token prompt: kvtier hit",
                        f"{fmt(row.value)} s",
                        f"cold prefill {fmt(row.baseline_value)} s",
                        fmt_ratio(row.ratio) + speedup,
                    ]
                )
            for row in sorted(
                self.by_section.get("miss", {}).get(device, []), key=lambda r: _tokens(r, TTFT_MISS)
            ):
                items.append(
                    [
                        device,
                        f"TTFT on a pure miss, {_tokens(row, TTFT_MISS)} tokens: kvtier",
                        f"{fmt(row.value)} s",
                        f"no connector {fmt(row.baseline_value)} s",
                        fmt_ratio(row.ratio),
                    ]
                )
        if items:
            self.add(*table(["Device", "Measure", "kvtier", "Baseline (same run)", "Ratio"], items))
        else:
            self.add(NO_RESULTS)

    def ttft(self) -> None:
        self.add(
            "",
            "## Time to first token: cold vs warm (kvtier hit) vs prompt length",
            "",
            "A real vLLM engine (`perf/benchmarks/test_bench_vllm_ttft.py`). Warm: the prompt served again "
            "after vLLM's prefix cache was reset, so its KV comes from kvtier. Baseline: the "
            "same prompts' cold prefill in the same engine processes. Medians over rounds, "
            "min–max in parentheses.",
        )
        sections = self.rows("ttft")
        if not sections:
            self.add("", NO_RESULTS)
        for device, rows in sections:
            rows = sorted(rows, key=lambda r: _tokens(r, TTFT_WARM))
            self.add("", f"### {device}", "")
            self.add(
                *table(
                    ["Prompt tokens", "Warm: kvtier hit (s)", "Baseline: cold prefill (s)",
                     "Ratio hit ÷ cold", "Speedup", "Prompts × rounds"],
                    (
                        [
                            _tokens(r, TTFT_WARM),
                            fmt_spread(r.value, r.fields.get("spread")),
                            fmt_spread(r.baseline_value, r.fields.get("baseline_spread")),
                            fmt_ratio(r.ratio),
                            f"{fmt(1 / r.ratio)}×" if r.ratio else "—",
                            _prompts_rounds(r),
                        ]
                        for r in rows
                    ),
                    "rrrrrr",
                )
            )  # fmt: skip
            self.figure(ttft_figure(device, rows), f"ttft-{slug(device)}", f"TTFT on {device}")
            ratios = ((f"{_tokens(r, TTFT_WARM)} tokens", r.ratio) for r in rows)
            self.add(
                *_caption(
                    f"TTFT vs prompt length on {device}. Baseline: cold prefill of the same "
                    "prompts (same runs); medians over rounds, error bars min–max. "
                    f"Ratio hit ÷ cold: {_ratio_list(ratios)}."
                )
            )

    def miss(self) -> None:
        self.add(
            "",
            "## Miss overhead: kvtier vs no connector",
            "",
            "What kvtier costs when it cannot help: never-seen prompts (vLLM reports 0 cached "
            "tokens), in engines with kvtier and with no connector, alternating in fresh "
            "processes. Per-round ratio: each round's kvtier median ÷ the same round's "
            "no-connector median; their median and min–max show the run-to-run spread.",
        )
        sections = self.rows("miss")
        if not sections:
            self.add("", NO_RESULTS)
        for device, rows in sections:
            rows = sorted(rows, key=lambda r: _tokens(r, TTFT_MISS))
            self.add("", f"### {device}", "")
            self.add(
                *table(
                    ["Prompt tokens", "kvtier, pure miss (s)", "Baseline: no connector (s)",
                     "Ratio", "Per-round ratio", "Prompts × rounds"],
                    (
                        [
                            _tokens(r, TTFT_MISS),
                            fmt_spread(r.value, r.fields.get("spread")),
                            fmt_spread(r.baseline_value, r.fields.get("baseline_spread")),
                            fmt_ratio(r.ratio),
                            _paired(r),
                            _prompts_rounds(r),
                        ]
                        for r in rows
                    ),
                    "rrrrrr",
                )
            )  # fmt: skip
            self.figure(
                miss_figure(device, rows), f"miss-{slug(device)}", f"Miss overhead on {device}"
            )
            ratios = ((f"{_tokens(r, TTFT_MISS)} tokens", r.ratio) for r in rows)
            self.add(
                *_caption(
                    f"Pure-miss TTFT on {device}. Baseline: vLLM with no connector (same "
                    f"prompts, alternating runs). Ratio kvtier ÷ no connector: "
                    f"{_ratio_list(ratios)}; dots are the per-round ratios, error bars min–max."
                )
            )

    def _bars_section(
        self,
        section: str,
        title: str,
        intro: str,
        label_header: list[str],
        labels_of: Callable[[Row], list[str]],
        order: Callable[[Row], tuple],
        what: str,
        plot_label: Callable[[Row], str] | None = None,
        series: tuple[str, str] = ("kvtier", "baseline (same run)"),
    ) -> None:
        self.add("", f"## {title}", "", intro)
        sections = self.rows(section)
        if not sections:
            self.add("", NO_RESULTS)
        for device, rows in sections:
            rows = sorted(rows, key=order)
            unit = rows[0].unit if len({r.unit for r in rows}) == 1 else "value"
            self.add("", f"### {device}", "")
            self.add(
                *table(
                    [*label_header, f"{series[0].capitalize()} ({unit})", "Baseline (same run)",
                     f"Baseline ({unit})", "Ratio"],
                    (
                        [*labels_of(r), fmt(r.value), r.baseline, fmt(r.baseline_value),
                         fmt_ratio(r.ratio)]
                        for r in rows
                    ),
                    "l" * len(label_header) + "rlrr",
                )
            )  # fmt: skip
            labels = [
                plot_label(r) if plot_label else " ".join(x for x in labels_of(r) if x != "—")
                for r in rows
            ]
            fig = paired_bars(
                labels,
                [r.value for r in rows],
                [r.baseline_value for r in rows],
                [r.ratio for r in rows],
                unit,
                f"{device}: {what} (ratio = {series[0]} ÷ baseline)",
                series,
            )
            self.figure(fig, f"{section}-{slug(device)}", f"{what} on {device}")
            baselines = _baselines_by_name(zip(labels, (r.baseline for r in rows), strict=True))
            ratios = zip(labels, (r.ratio for r in rows), strict=True)
            self.add(
                *_caption(
                    f"{what[0].upper()}{what[1:]} on {device}. Baselines, measured in the same "
                    f"run: {baselines}. Ratio {series[0]} ÷ baseline: {_ratio_list(ratios)}."
                )
            )

    def throughput(self) -> None:
        def order(row: Row) -> tuple:
            tier, op = tier_and_op(row.metric)
            return (_rank(tier, TIER_ORDER), _rank(op, OP_ORDER))

        self._bars_section(
            "throughput",
            "Throughput: GB/s per op and tier",
            "Bytes of KV chunks moved per second (`perf/benchmarks/test_bench_cpu_tier.py`, "
            "`perf/benchmarks/test_bench_tiers.py`, `perf/benchmarks/test_bench_server.py`), each against the raw "
            "equivalent of the same bytes measured in the same run (a `torch` copy, raw file "
            "I/O, raw client calls; for `kvtier serve`, the in-process CPU tier and raw Redis).",
            ["Tier", "Op"],
            lambda r: list(tier_and_op(r.metric)),
            order,
            "GB/s per op and tier",
        )

    def lookups(self) -> None:
        self._bars_section(
            "lookups",
            "Lookups per second per tier",
            "Prefix lookups of a long prompt (`perf/benchmarks/test_bench_tiers.py`, "
            "`perf/benchmarks/test_bench_server.py`), each against the "
            "bare client calls that answer the same question, batches alternating.",
            ["Tier", "Lookup"],
            lambda r: [lookup_tier(r.metric), re.sub(r"\s*\([^)]*\)\s*$", "", r.metric)],
            lambda r: (_rank(lookup_tier(r.metric), TIER_ORDER),),
            "lookups per second per tier",
            plot_label=lambda r: lookup_tier(r.metric),
        )

    def hashing(self) -> None:
        self._bars_section(
            "hashing",
            "Chunk hashing: tokens/s",
            "Prefix-chained chunk hashes of a long prompt (`perf/benchmarks/test_bench_hashing.py`), each "
            "against a baseline measured in the same run: the other algorithm, or vLLM's own "
            "`hash_block_tokens` over the same tokens (identical bytes).",
            ["Algorithm"],
            lambda r: [hashing_label(r)],
            lambda r: (),
            "chunk hashing throughput",
            series=("kvtier", "baseline (same run)"),
        )

    def compression(self) -> None:
        self.add(
            "",
            "## Compression ratio vs error",
            "",
            "KV compression (the CacheGen-style codec): how many times smaller a chunk gets, "
            "against the error of its reconstruction. Baseline: the uncompressed chunk.",
        )
        sections = self.rows("compression")
        if not sections:
            self.add(
                "",
                f"{NO_RESULTS} Rows whose metric starts with `compression` (value: the "
                "compression ratio; `error`, `error_metric`: the reconstruction error) appear "
                "here once a benchmark records them.",
            )
        for device, rows in sections:
            rows = sorted(rows, key=lambda r: (_num_or_inf(r.fields.get("error")), r.metric))
            self.add("", f"### {device}", "")
            self.add(
                *table(
                    ["Codec / setting", "Compression ratio", "Error", "Error metric",
                     "Baseline (same run)", "Baseline value", "Ratio"],
                    (
                        [compression_label(r), f"{fmt(r.value)} {r.unit}".strip(),
                         fmt(_num_or_none(r.fields.get("error"))),
                         r.fields.get("error_metric", "—"), r.baseline, fmt(r.baseline_value),
                         fmt_ratio(r.ratio)]
                        for r in rows
                    ),
                    "lrrllrr",
                )
            )  # fmt: skip
            self.figure(
                compression_figure(device, rows),
                f"compression-{slug(device)}",
                f"Compression ratio vs error on {device}",
            )
            baselines = sorted({r.baseline for r in rows})
            ratios = ((compression_label(r), r.ratio) for r in rows)
            self.add(
                *_caption(
                    f"Compression ratio vs error on {device}. Baseline: "
                    f"{', '.join(baselines)}. Ratio: {_ratio_list(ratios)}."
                )
            )

    def shared_ttft(self) -> None:
        self._table(
            "shared_ttft",
            "## TTFT through a shared cache and disaggregated prefill",
            "Real vLLM engines, each a fresh process, behind one `kvtier serve` "
            "(`perf/benchmarks/test_bench_server_ttft.py`): engine B on prompts only engine A served vs "
            "A's cold prefill; a `kv_consumer` on prompts a `kv_producer` just served vs the "
            "consumer's own cold prefill ([docs/disaggregated.md](../docs/disaggregated.md)).",
        )

    def proxy(self) -> None:
        self._table(
            "proxy",
            "## Proxy overhead",
            "`kvtier proxy` in front of fake OpenAI engines (`perf/benchmarks/test_bench_proxy.py`): "
            "per-request latency through the proxy vs the same calls made directly, "
            "interleaved in one run ([docs/proxy.md](../docs/proxy.md)).",
        )

    def blend(self) -> None:
        sections = self.rows("blend")
        if not sections:
            return
        self.add(
            "",
            "## CacheBlend: blend vs cold prefill",
            "",
            "`perf/benchmarks/test_bench_blend.py`: 4 cached 1k-token documents in a new order plus a new "
            "100-token question, blended at ratio 0.15 (kvtier's blend outside vLLM, "
            "docs/cacheblend.md). Baseline: cold prefill through the same layer code, same run. "
            "`perf/benchmarks/test_bench_blend_ttft.py`: the same prompt shape through vLLM with kvtier's "
            "connector; time to first token against a cold prefill in the same engine.",
        )
        for device, rows in sections:
            outside = [r for r in rows if not r.metric.startswith("blend TTFT")]
            in_vllm = [r for r in rows if r.metric.startswith("blend TTFT")]
            self.add("", f"### {device}", "")
            if outside:
                self.add(
                    *table(
                        ["Prompt tokens", "Blend (ms)", "Cold prefill (ms)", "Ratio blend ÷ cold",
                         "RoPE (ms)", "RoPE share of load"],
                        (
                            [r.fields.get("num_tokens", "—"), fmt(r.value), fmt(r.baseline_value),
                             fmt_ratio(r.ratio), fmt(r.fields.get("rope_ms")),
                             fmt(r.fields.get("rope_share_of_load"))]
                            for r in outside
                        ),
                        "rrrrrr",
                    )
                )  # fmt: skip
            if in_vllm:
                self.add("", "In vLLM (time to first token):", "")
                self.add(
                    *table(
                        ["Prompt tokens", "Claimed by kvtier", "Blend TTFT (ms)",
                         "Cold TTFT (ms)", "Ratio blend ÷ cold", "Blend in the worker (ms)"],
                        (
                            [r.fields.get("num_tokens", "—"), r.fields.get("claimed_tokens", "—"),
                             fmt(r.value), fmt(r.baseline_value), fmt_ratio(r.ratio),
                             fmt(r.fields.get("blend_total_ms"))]
                            for r in in_vllm
                        ),
                        "rrrrrr",
                    )
                )  # fmt: skip

    def other(self) -> None:
        self._table("other", "## Other results", "Rows that no section above takes, as recorded.")

    def _table(self, section: str, title: str, intro: str) -> None:
        sections = self.rows(section)
        if not sections:
            return
        self.add("", title, "", intro)
        for device, rows in sections:
            self.add("", f"### {device}", "")
            self.add(
                *table(
                    ["Metric", "Value", "Unit", "Baseline (same run)", "Baseline value", "Ratio"],
                    (
                        [r.metric, fmt(r.value), r.unit, r.baseline, fmt(r.baseline_value),
                         fmt_ratio(r.ratio)]
                        for r in rows
                    ),
                    "lrllrr",
                )
            )  # fmt: skip


def _num_or_none(value: object) -> float | None:
    return float(value) if _is_number(value) else None


def _num_or_inf(value: object) -> float:
    return float(value) if _is_number(value) else math.inf


def _prompts_rounds(row: Row) -> str:
    prompts = row.fields.get("prompts_per_round")
    rounds = row.fields.get("rounds")
    if not isinstance(prompts, int) or not isinstance(rounds, list):
        return "—"
    return f"{prompts} × {len(rounds)}"


def _paired(row: Row) -> str:
    paired = row.fields.get("paired_ratio")
    if isinstance(paired, dict) and _is_number(paired.get("median")):
        return fmt_spread(paired["median"], paired.get("spread"))
    per_round = paired_ratios(row)
    if per_round:
        ordered = sorted(per_round)
        median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2
        return fmt_spread(median, [ordered[0], ordered[-1]])
    return "—"


def render(results_dir: Path, out_dir: Path) -> Path:
    """Writes ``<out_dir>/report.md`` and ``<out_dir>/plots/*.png``; returns the report."""
    if not results_dir.is_dir():
        raise FileNotFoundError(f"results folder {results_dir} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    # matplotlib's defaults, whatever a matplotlibrc or the caller set
    with matplotlib.style.context("default"):
        text = Report(load_results(results_dir), out_dir, results_dir).render()
    path = out_dir / "report.md"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    try:
        path = render(args.results, args.out)
    except FileNotFoundError as err:
        print(f"perf/report.py: {err}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.relpath(path)} and {os.path.relpath(path.parent / 'plots')}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
