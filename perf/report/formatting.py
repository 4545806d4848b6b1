"""How figures and tables are written: numbers to about three significant digits, ratios,
min–max spreads, file-name slugs and GitHub markdown tables."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from .results import is_number


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
    if isinstance(spread, list) and len(spread) == 2 and all(map(is_number, spread)):
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
