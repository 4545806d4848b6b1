"""In-process counters for what kvtier did.

Every component counts into one ``Stats`` object (thread-safe, cheap: a dict under a
lock). Byte rates are computed from measured intervals only — the time a store or
retrieve really took — never from an estimate. Exporters (Prometheus, vLLM's stats hook)
read snapshots of it.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Counter:
    """Names of the counters kvtier keeps."""

    # NOTE: names are part of the public surface (metrics, `kvtier info`); do not rename.
    STORE_REQUESTS = "store_requests"
    STORED_CHUNKS = "stored_chunks"
    STORED_TOKENS = "stored_tokens"
    STORED_BYTES = "stored_bytes"
    STORE_SECONDS = "store_seconds"
    STORE_SKIPPED_EXISTING = "store_skipped_existing_chunks"
    STORE_SKIPPED_NO_MEMORY = "store_skipped_no_memory_chunks"
    RETRIEVE_REQUESTS = "retrieve_requests"
    REQUESTED_TOKENS = "retrieve_requested_tokens"
    HIT_TOKENS = "retrieve_hit_tokens"
    LOADED_BYTES = "loaded_bytes"
    LOAD_SECONDS = "load_seconds"
    LOOKUP_REQUESTS = "lookup_requests"
    LOOKUP_TOKENS = "lookup_tokens"
    LOOKUP_HIT_TOKENS = "lookup_hit_tokens"
    CORRUPT_CHUNKS = "corrupt_chunks_rejected"
    EVICTIONS = "evictions"
    ALLOC_FAILURES = "allocation_failures"
    PREFETCHED_CHUNKS = "prefetched_chunks"
    WRITEBACK_CHUNKS = "cpu_writeback_chunks"


class TierCounter:
    """Per-tier counters of the tiers below the CPU. The full name is
    ``tier_counter(tier, what)``, e.g. ``disk_get_hits`` or ``redis_reconnects``."""

    PUT_CHUNKS = "put_chunks"
    PUT_BYTES = "put_bytes"
    PUT_SECONDS = "put_seconds"
    GET_HITS = "get_hits"
    GET_MISSES = "get_misses"
    GET_BYTES = "get_bytes"
    GET_SECONDS = "get_seconds"
    LOOKUP_HITS = "lookup_hit_chunks"
    DROPPED_QUEUE_FULL = "puts_dropped_queue_full"
    DROPPED_UNAVAILABLE = "puts_dropped_unavailable"
    DROPPED_NO_SPACE = "puts_dropped_no_space"
    DROPPED_ERROR = "puts_dropped_error"
    ERRORS = "errors"
    TIMEOUTS = "timeouts"
    RECONNECTS = "reconnects"
    EVICTIONS = "evictions"
    CORRUPT = "corrupt_rejected"


def tier_counter(tier: str, what: str) -> str:
    """The counter name of ``what`` (a ``TierCounter``) for tier ``tier``."""
    return f"{tier}_{what}"


class Stats:
    """Thread-safe named counters (ints or float seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)

    def inc(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def get(self, name: str) -> float:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter, plus derived rates computed from measured time."""
        with self._lock:
            values = dict(self._values)
        for bytes_key, seconds_key, rate_key in (
            (Counter.STORED_BYTES, Counter.STORE_SECONDS, "store_gbps"),
            (Counter.LOADED_BYTES, Counter.LOAD_SECONDS, "load_gbps"),
        ):
            seconds = values.get(seconds_key, 0.0)
            if seconds > 0:
                values[rate_key] = values.get(bytes_key, 0.0) / seconds / 1e9
        requested = values.get(Counter.REQUESTED_TOKENS, 0.0)
        if requested > 0:
            values["retrieve_hit_ratio"] = values.get(Counter.HIT_TOKENS, 0.0) / requested
        return values

    def reset(self) -> None:
        with self._lock:
            self._values.clear()
