"""``python -m perf.report``: renders ``perf/report.md`` and ``perf/plots/`` from
``perf/results/`` (``--results`` and ``--out`` choose other folders)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .markdown import render

PERF = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    """Renders the report; 0 when written, 2 when the results folder does not exist."""
    parser = argparse.ArgumentParser(
        prog="python -m perf.report",
        description="Render the benchmark report: perf/report.md and its plots, from "
        "perf/results/.",
    )
    parser.add_argument("--results", type=Path, default=PERF / "results")
    parser.add_argument("--out", type=Path, default=PERF)
    args = parser.parse_args(argv)
    try:
        path = render(args.results, args.out)
    except FileNotFoundError as err:
        print(f"perf.report: {err}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.relpath(path)} and {os.path.relpath(path.parent / 'plots')}/")
    return 0
