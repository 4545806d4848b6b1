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
    # KV events (docs/observability.md#kv-events). Workers: tier records dropped by a
    # full log. Scheduler: events dropped by a full queue, blocks announced and
    # withdrawn, chunks every rank holds that could not be announced (no payload).
    KV_EVENTS_DROPPED = "kv_events_dropped"
    KV_EVENTS_BLOCKS_STORED = "kv_events_blocks_stored"
    KV_EVENTS_BLOCKS_REMOVED = "kv_events_blocks_removed"
    KV_EVENTS_UNANNOUNCED = "kv_events_unannounced_chunks"


class TierCounter:
    """Per-tier counters of the tiers below the CPU. The full name is
    ``tier_counter(tier, what)``, e.g. ``disk_get_hits`` or ``redis_reconnects``."""

    PUT_CHUNKS = "put_chunks"
    PUT_BYTES = "put_bytes"
    PUT_RAW_BYTES = "put_raw_bytes"
    PUT_SECONDS = "put_seconds"
    GET_HITS = "get_hits"
    GET_MISSES = "get_misses"
    GET_BYTES = "get_bytes"
    GET_SECONDS = "get_seconds"
    LOOKUP_HITS = "lookup_hit_chunks"
    DROPPED_QUEUE_FULL = "puts_dropped_queue_full"
    DROPPED_UNAVAILABLE = "puts_dropped_unavailable"
    DROPPED_NO_SPACE = "puts_dropped_no_space"
    DROPPED_THROTTLED = "puts_dropped_throttled"
    DROPPED_ERROR = "puts_dropped_error"
    SKIPPED_REPLICA = "puts_skipped_replica"
    ERRORS = "errors"
    TIMEOUTS = "timeouts"
    THROTTLED = "throttled"
    RECONNECTS = "reconnects"
    EVICTIONS = "evictions"
    EVICTIONS_NO_SPACE = "evictions_no_space"
    CORRUPT = "corrupt_rejected"
    NEWER_FORMAT = "newer_format_rejected"


def tier_counter(tier: str, what: str) -> str:
    """The counter name of ``what`` (a ``TierCounter``) for tier ``tier``."""
    return f"{tier}_{what}"


# Upper bounds (seconds) of the latency histograms: 1 ms .. 10 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Names of the latency histograms kvtier keeps (seconds per operation)."""

    STORE = "store_latency_seconds"  # one engine store (gather + commit)
    LOAD = "load_latency_seconds"  # one engine load (fetch + verify + scatter)
    TIER_GET = "get_latency_seconds"  # per tier: one batched get (tier_counter name)
    TIER_PUT = "put_latency_seconds"  # per tier: one batch of writes


class Stats:
    """Thread-safe named counters (ints or float seconds) and latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: defaultdict[str, float] = defaultdict(float)
        # name -> [count per bucket (+Inf last), sum, count]
        self._histograms: dict[str, list] = {}

    def inc(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def observe(self, name: str, seconds: float) -> None:
        """Add one observation to histogram ``name`` (buckets ``LATENCY_BUCKETS``)."""
        index = next(
            (i for i, bound in enumerate(LATENCY_BUCKETS) if seconds <= bound),
            len(LATENCY_BUCKETS),
        )
        with self._lock:
            hist = self._histograms.get(name)
            if hist is None:
                hist = self._histograms[name] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0, 0]
            hist[0][index] += 1
            hist[1] += seconds
            hist[2] += 1

    def histograms(self) -> dict[str, dict]:
        """``{name: {"counts": per-bucket counts (last: above the top bound), "sum": s,
        "count": n}}`` — plain data, safe to send between processes."""
        with self._lock:
            return {
                name: {"counts": list(counts), "sum": total, "count": n}
                for name, (counts, total, n) in self._histograms.items()
            }

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
            self._histograms.clear()
