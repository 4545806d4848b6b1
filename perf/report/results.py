"""The results files a report is rendered from: every row with the device and file it came
from, and the files that could not be read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


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
        return float(value) if is_number(value) else None

    @property
    def ratio(self) -> float | None:
        """The row's ratio (value ÷ baseline_value), as recorded or computed."""
        if is_number(self.fields.get("ratio")):
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


def is_number(value: object) -> bool:
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
            if is_number(row.get("value"))
        ]
        dropped = len(data["results"]) - len(rows)
        results.sources.append(Source(path.name, device, machine, len(rows), dropped))
        results.rows.extend(rows)
    return results
