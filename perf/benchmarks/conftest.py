"""Shared helpers for kvtier's benchmarks.

Every benchmark reports its figure next to a baseline measured in the same run (raw copy,
the other hash algorithm, …) and the ratio between them. ``record`` collects those rows;
at the end of the session they are merged into ``perf/results/<device>.json`` together with
the machine (with a GPU: its driver and CUDA/ROCm) and library versions
(``machine_info.py``), so results are data that reports and plots read. A benchmark module
that sets ``RESULTS_NAME = "x"`` writes to ``<device>-x.json`` instead.

Only a run asked to save (``--save-results``, which ``make bench`` passes) writes the
committed files in ``perf/results/``. Any other run (one benchmark file, a ``-k``
selection, an experiment) merges its rows into ``perf/results/scratch/`` (not
committed), so a partial run never replaces the figures the report is rendered from;
``python -m perf.report --results perf/results/scratch --out perf/results/scratch``
renders a report of it.

NOTE: a results file holds the latest figure of every benchmark that ever wrote to it.
A run replaces the rows it re-measured (same benchmark name and metric) and keeps every
other row, so running one benchmark file never erases another's figures. Each row carries
the date it was measured; the file's ``machine`` describes the latest run.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from machine_info import describe_machine, device_slug

PERF = Path(__file__).resolve().parents[1]
RESULTS_DIR = PERF / "results"
SCRATCH_DIR = RESULTS_DIR / "scratch"
# The benchmarks share the tests' helpers (``tests/support``), imported as ``support``.
sys.path.insert(0, str(PERF.parent / "tests"))
# Rows measured in this session, per results-file suffix ("" for ``<device>.json``).
_ROWS: dict[str, list[dict]] = {}


def median_seconds(
    fn: Callable[[], object],
    *,
    repeat: int = 15,
    warmup: int = 3,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after ``warmup`` runs; ``setup``
    (untimed) runs before every run, warm-ups included."""
    times = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fn: Callable[[], object],
    baseline: Callable[[], object],
    *,
    repeat: int = 15,
    warmup: int = 2,
    setup: Callable[[], object] | None = None,
    baseline_setup: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Median wall times of ``fn`` and of ``baseline``, timed in alternation (one call of
    each per round), so that load from elsewhere on the machine weighs on both alike.
    ``setup`` / ``baseline_setup`` (untimed) run before every call of their function."""
    fn_times, baseline_times = [], []
    for i in range(warmup + repeat):
        if baseline_setup is not None:
            baseline_setup()
        t0 = time.perf_counter()
        baseline()
        t1 = time.perf_counter()
        if setup is not None:
            setup()
        t2 = time.perf_counter()
        fn()
        t3 = time.perf_counter()
        if i >= warmup:
            fn_times.append(t3 - t2)
            baseline_times.append(t1 - t0)
    return statistics.median(fn_times), statistics.median(baseline_times)


@pytest.fixture
def record(request):
    """``record(metric=..., value=..., unit=..., baseline=..., baseline_value=...)``."""

    def _record(**row):
        row.setdefault("benchmark", request.node.name)
        if row.get("baseline_value"):
            row["ratio"] = row["value"] / row["baseline_value"]
        row["date"] = _now()
        suffix = getattr(request.module, "RESULTS_NAME", "")
        _ROWS.setdefault(f"-{suffix}" if suffix else "", []).append(row)

    return _record


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _row_key(row: dict) -> tuple[str, str]:
    return row.get("benchmark", ""), str(row.get("metric", ""))


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row re-measured in ``new`` (same benchmark and metric) replaced in
    place, then ``new``'s other rows appended; rows of benchmarks that did not run stay."""
    fresh = {_row_key(row): row for row in new}
    merged = [fresh.pop(_row_key(row), row) for row in old]
    return merged + [row for row in new if _row_key(row) in fresh]


def _read_rows(path: Path) -> list[dict] | None:
    """The rows already in ``path`` ([] when there is none); None when it is unreadable."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())["results"]
    except (ValueError, KeyError, TypeError):
        return None
    return rows if isinstance(rows, list) else None


def pytest_sessionfinish(session, exitstatus):
    if not _ROWS:
        return
    machine = describe_machine(_now())
    save = session.config.getoption("--save-results")
    results_dir = RESULTS_DIR if save else SCRATCH_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    if not save:
        print(
            f"\nkvtier: figures go to {results_dir}; the committed results are untouched "
            "(pass --save-results, as make bench does, to update them)"
        )
    device = device_slug(machine["device"])
    for suffix, rows in _ROWS.items():
        out = results_dir / f"{device}{suffix}.json"
        old = _read_rows(out)
        if old is None:  # never overwrite figures that could not be read back
            print(f"\nkvtier: {out} is not a results file; this run's rows go beside it")
            out, old = out.with_suffix(".new.json"), []
        merged = merge_rows(old, rows)
        out.write_text(json.dumps({"machine": machine, "results": merged}, indent=2) + "\n")
        print(f"\nkvtier benchmark results merged into {out} ({len(rows)} rows re-measured)")
        for row in rows:
            ratio = f"  ratio {row['ratio']:.3f} vs {row['baseline']}" if "ratio" in row else ""
            print(f"  {row['benchmark']:<48} {row['value']:>12.3f} {row['unit']}{ratio}")
