"""Which section of the report takes each row, and the labels rows are shown under."""

from __future__ import annotations

import re
from collections.abc import Callable

from .results import Row, is_number

TIER_ORDER = ["cpu", "engine", "disk", "server", "redis", "s3"]
OP_ORDER = ["put", "store", "get", "retrieve"]

TTFT_WARM = re.compile(r"^ttft_warm_kvtier_(\d+)_tokens$")
TTFT_MISS = re.compile(r"^ttft_miss_kvtier_(\d+)_tokens$")


def prompt_tokens(row: Row, pattern: re.Pattern) -> int:
    match = pattern.match(row.metric)
    assert match is not None
    return int(match.group(1))


def _is_compression(row: Row) -> bool:
    return row.metric.lower().startswith("compression")


def _is_hashing(row: Row) -> bool:
    return row.metric.startswith("chunk hashing")


TTFT_SHARED = re.compile(r"^ttft_(engine_b_via_server|engine_b_via_peer|pd_consumer)_(\d+)_tokens$")


SECTION_OF: list[tuple[str, Callable[[Row], bool]]] = [
    ("ttft", lambda r: bool(TTFT_WARM.match(r.metric))),
    ("shared_ttft", lambda r: bool(TTFT_SHARED.match(r.metric))),
    ("proxy", lambda r: r.metric.startswith("proxy_")),
    ("routing", lambda r: r.metric.startswith("routing_")),
    ("miss", lambda r: bool(TTFT_MISS.match(r.metric))),
    ("compression", _is_compression),
    ("blend", lambda r: r.metric.startswith("blend")),
    ("hashing", _is_hashing),
    ("launch", lambda r: r.metric.startswith(("host_us_per_", "wall_us_per_", "host_us_before_"))),
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


def rank(name: str, order: list[str]) -> int:
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


def paired_ratios(row: Row) -> list[float]:
    """Per-round ratios kvtier ÷ no connector, from the rows' per-round figures."""
    rounds, baseline_rounds = row.fields.get("rounds"), row.fields.get("baseline_rounds")
    if not (isinstance(rounds, list) and isinstance(baseline_rounds, list)):
        return []
    if len(rounds) != len(baseline_rounds) or not all(map(is_number, rounds + baseline_rounds)):
        return []
    return [k / n for k, n in zip(rounds, baseline_rounds, strict=True) if n]


def compression_label(row: Row) -> str:
    return str(row.fields.get("codec") or row.metric.removeprefix("compression").strip(" :"))
