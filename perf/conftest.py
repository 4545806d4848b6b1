"""Shared helpers for kvtier's benchmarks.

Every benchmark reports its figure next to a baseline measured in the same run (raw copy,
the other hash algorithm, …) and the ratio between them. ``record`` collects those rows;
at the end of the session they are written to ``perf/results/<device>.json`` together with
the machine and library versions, so results are data that reports and plots read.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

RESULTS_DIR = Path(__file__).parent / "results"
_ROWS: list[dict] = []


def median_seconds(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.fixture
def record(request):
    """``record(metric=..., value=..., unit=..., baseline=..., baseline_value=...)``."""

    def _record(**row):
        row.setdefault("benchmark", request.node.name)
        if row.get("baseline_value"):
            row["ratio"] = row["value"] / row["baseline_value"]
        _ROWS.append(row)

    return _record


def _machine() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


def pytest_sessionfinish(session, exitstatus):
    if not _ROWS:
        return
    machine = _machine()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = machine["device"].lower().replace(" ", "-")
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps({"machine": machine, "results": _ROWS}, indent=2) + "\n")
    print(f"\nkvtier benchmark results written to {out}")
    for row in _ROWS:
        ratio = f"  ratio {row['ratio']:.3f} vs {row['baseline']}" if "ratio" in row else ""
        print(f"  {row['benchmark']:<48} {row['value']:>12.3f} {row['unit']}{ratio}")
