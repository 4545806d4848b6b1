"""Prometheus metrics: kvtier's counters, gauges and latency histograms over HTTP.

Every process that does kvtier work keeps a ``Stats`` (``stats.py``); ``export``
turns one into plain data (counters, histograms, gauges of the tiers) that can cross a
process boundary. ``KVTierCollector`` turns a list of such exports — one per worker rank,
plus the scheduler's — into Prometheus metric families at scrape time, so the numbers are
always the live ones and no shared files or multiprocess directories are needed. Inside
vLLM the scheduler process serves the endpoint and asks each worker rank for its export
over the connector's lookup socket (``integration/vllm/scheduler_setup.py``).

Names: engine counters are ``kvtier_<counter>_total`` (e.g. ``kvtier_stored_bytes_total``),
counters of the tiers below the CPU are ``kvtier_tier_<what>_total{tier="disk"}``; every
sample carries a ``rank`` label. See docs/observability.md for the full list.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from kvtier.observability.stats import LATENCY_BUCKETS, Counter, Histogram, Stats, TierCounter

logger = logging.getLogger(__name__)

TIER_NAMES = ("cpu", "disk", "fs", "redis", "s3", "kvtier")
_ENGINE_COUNTERS = [v for k, v in vars(Counter).items() if not k.startswith("_")]
_TIER_COUNTERS = [v for k, v in vars(TierCounter).items() if not k.startswith("_")]
_TIER_WHATS = {*_TIER_COUNTERS, Histogram.TIER_GET, Histogram.TIER_PUT}
_DERIVED = ("store_gbps", "load_gbps", "retrieve_hit_ratio")

# Counted only by vLLM's scheduler, as it announces kvtier's KV events
# (``integration.vllm.kv_events``): every other process leaves them out of its metrics.
ANNOUNCED_EVENT_COUNTERS = (
    Counter.KV_EVENTS_BLOCKS_STORED,
    Counter.KV_EVENTS_BLOCKS_REMOVED,
    Counter.KV_EVENTS_UNANNOUNCED,
)

# Engine counters and histograms, and the scheduler's; the tiers' are in TIER_HELP (both
# have an "evictions").
HELP = {
    Counter.STORE_REQUESTS: (
        "Store operations (one per request step with chunks to save, stored or already held)."
    ),
    Counter.STORED_CHUNKS: "Chunks stored (new to the CPU tier or queued for a lower tier).",
    Counter.STORED_TOKENS: "Tokens in the chunks stored.",
    Counter.STORED_BYTES: "Bytes of KV stored.",
    Counter.STORE_SECONDS: "Time spent storing (gather + commit), measured.",
    Counter.STORE_SKIPPED_EXISTING: "Chunks not stored because they were already held.",
    Counter.STORE_SKIPPED_NO_MEMORY: "Chunks not stored because the CPU pool was full.",
    "store_skipped_load_failed_chunks": (
        "Chunks not stored: computed in a step where a block they attend to failed to load."
    ),
    Counter.RETRIEVE_REQUESTS: "Load operations.",
    Counter.REQUESTED_TOKENS: "Tokens asked for by loads.",
    Counter.HIT_TOKENS: "Tokens loaded into the engine.",
    Counter.LOADED_BYTES: "Bytes of KV loaded into the engine.",
    Counter.LOAD_SECONDS: "Time spent loading (fetch + verify + scatter), measured.",
    Counter.LOOKUP_REQUESTS: "Lookups answered by this process.",
    Counter.LOOKUP_TOKENS: "Tokens looked up.",
    Counter.LOOKUP_HIT_TOKENS: "Tokens found by lookups.",
    Counter.CORRUPT_CHUNKS: "Stored chunks refused (checksum, header, shape): misses.",
    Counter.EVICTIONS: "Chunks evicted from the CPU tier.",
    Counter.ALLOC_FAILURES: (
        "CPU pool allocations that failed: no room after evicting, or larger than the pool."
    ),
    Counter.PREFETCHED_CHUNKS: "Chunks fetched from a lower tier into memory at lookup time.",
    Counter.WRITEBACK_CHUNKS: "Lower-tier hits copied into the CPU tier.",
    "pd_waits": "Lookups of kv_consumer requests told to look again later (pd_wait_ms).",
    "producer_store_timeouts": (
        "kv_producer steps whose stores had not reached every tier within "
        "producer_store_timeout_ms."
    ),
    Counter.KV_EVENTS_DROPPED: (
        "Tier records (worker ranks) or KV events (scheduler) dropped by a full buffer."
    ),
    Counter.KV_EVENTS_BLOCKS_STORED: "vLLM blocks announced by kvtier's BlockStored events.",
    Counter.KV_EVENTS_BLOCKS_REMOVED: "vLLM blocks withdrawn by kvtier's BlockRemoved events.",
    Counter.KV_EVENTS_UNANNOUNCED: (
        "Chunks every rank held that could not be announced: their payload was unknown."
    ),
    # CacheBlend (enable_blending): the scheduler's claims, a worker rank's blends.
    "blend_requests": (
        "CacheBlend: prompts blended (rank scheduler: claims vLLM accepted, those whose "
        "blend later failed or never ran included; a worker rank: blends that wrote their KV)."
    ),
    "blend_claimed_tokens": (
        "CacheBlend: tokens claimed by accepted claims, failed blends included (all but each "
        "prompt's last)."
    ),
    "blend_reused_tokens": (
        "CacheBlend: tokens of cached segments reused (rank scheduler: as claimed, failed "
        "blends included; a worker rank: as placed by blends that wrote their KV, segment "
        "misses left out)."
    ),
    "blend_recomputed_tokens": (
        "CacheBlend: tokens of blends computed through every layer (those in no cached "
        "segment, and the reused ones picked for recompute)."
    ),
    "blend_segment_misses": (
        "CacheBlend: claimed segments a worker could not read (evicted, corrupt, other "
        "shape): computed afresh."
    ),
    "blend_stored_segments": "CacheBlend: segments stored.",
    "blend_failed_requests": (
        "CacheBlend: blends that failed (an error in the worker): reported to vLLM as failed loads."
    ),
    "blend_failed_blocks": "CacheBlend: vLLM blocks of failed blends, reported as failed loads.",
    "blend_failed_segment_stores": "CacheBlend: segment stores that failed with an error.",
    "blend_skipped_too_large_segments": (
        "CacheBlend: segments not stored because their KV and positions outsize the whole CPU pool."
    ),
    "blend_skipped_no_memory_segments": (
        "CacheBlend: segments not stored because the CPU pool had no room (after evicting)."
    ),
    "blend_seconds": "CacheBlend: time spent in the blend computation, measured.",
    "blend_rope_seconds": "CacheBlend: time spent re-rotating segment keys, measured.",
    "blend_total_seconds": (
        "CacheBlend: time spent on blends (read, place, re-rotate, blend, write), measured."
    ),
    "blend_check_deviation": (
        "CacheBlend: squared KV deviation of the placed tokens at the first check layer."
    ),
    "blend_check_norm": (
        "CacheBlend: squared norm of the placed segments' KV at the first check layer."
    ),
    Histogram.STORE: "Seconds per store operation.",
    Histogram.LOAD: "Seconds per load operation.",
}
# The tiers' series (``kvtier_tier_<what>{tier=...}``): counters, histograms and gauges.
TIER_HELP = {
    TierCounter.PUT_CHUNKS: "Objects written to the tier.",
    TierCounter.PUT_BYTES: "Bytes written to the tier (headers included).",
    TierCounter.PUT_RAW_BYTES: "KV bytes of the objects written, before the codec "
    "(put_raw_bytes / put_bytes: the compression ratio).",
    TierCounter.PUT_SECONDS: "Time spent writing to the tier, measured.",
    TierCounter.GET_HITS: "Chunk reads the tier served.",
    TierCounter.GET_MISSES: "Chunk reads the tier could not serve.",
    TierCounter.GET_BYTES: "Bytes of KV read from the tier (after decoding).",
    TierCounter.GET_SECONDS: "Time spent reading from the tier, measured.",
    TierCounter.LOOKUP_HITS: "Chunks lookups found in the tier.",
    TierCounter.DROPPED_QUEUE_FULL: "Stores dropped because the tier's write queue was full.",
    TierCounter.DROPPED_UNAVAILABLE: "Stores dropped because the tier was down.",
    TierCounter.DROPPED_NO_SPACE: "Stores dropped because the disk was full.",
    TierCounter.DROPPED_THROTTLED: "Stores dropped because the remote throttled them.",
    TierCounter.DROPPED_ERROR: "Stores dropped on another write error.",
    TierCounter.SKIPPED_REPLICA: "Stores left to the rank that writes the same shard "
    "(an MLA engine's tensor-parallel rank 0).",
    TierCounter.ERRORS: "Failed calls to the tier.",
    TierCounter.TIMEOUTS: "Calls to the tier abandoned after remote_timeout_ms.",
    TierCounter.THROTTLED: "Lookups and reads the remote throttled (misses; it stays up).",
    TierCounter.RECONNECTS: "Times the tier came back after being down.",
    TierCounter.EVICTIONS: "Objects evicted from the tier to stay under its size.",
    TierCounter.EVICTIONS_NO_SPACE: "Files evicted because the disk was full before the bound.",
    TierCounter.CORRUPT: "Objects refused by the wire-format checks.",
    TierCounter.NEWER_FORMAT: "Objects of a format a newer kvtier writes (misses, deleted).",
    Histogram.TIER_GET: "Seconds per batched get from the tier.",
    Histogram.TIER_PUT: "Seconds per batch of writes to the tier.",
    "hit_ratio": "Chunk reads served / asked of the tier.",
    "chunks": "Chunks held in memory.",
    "pinned_chunks": "Chunks being read or written now.",
    "pool_used_bytes": "Bytes of the CPU pool in use.",
    "pool_capacity_bytes": "Bytes of the CPU pool.",
    "used_bytes": "Bytes of chunk files the tier holds.",
    "directories": "Directories of the tier's file tree (beside the chunk files' bytes).",
    "up": "1 while the tier answers, 0 while it is down.",
    "pending_writes": "Writes queued or in flight.",
}


def export(
    stats: Stats,
    *,
    gauges: Mapping[str, float] | None = None,
    tiers: Sequence[str] = (),
    omit: Iterable[str] = (),
    **labels: str,
) -> dict:
    """One process's metrics as plain data: ``{"labels", "counters", "histograms",
    "gauges"}``. ``tiers`` (the lower tiers' names) get every tier counter, at 0 until
    something happens; ``gauges`` come from ``StorageManager.gauges``; ``omit``: the
    counters left out, those this process never counts (or another counts for it)."""
    # Every counter the process counts is exported from the start, at 0 until something
    # happens.
    left_out = set(omit)
    counters: dict[str, float] = {name: 0 for name in _ENGINE_COUNTERS if name not in left_out}
    for tier in tiers:
        counters.update(dict.fromkeys((f"{tier}_{what}" for what in _TIER_COUNTERS), 0))
    counters.update(
        {k: v for k, v in stats.snapshot().items() if k not in _DERIVED and k not in left_out}
    )
    return {
        "labels": dict(labels),
        "counters": counters,
        "histograms": stats.histograms(),
        "gauges": dict(gauges or {}),
    }


def _split_tier(name: str) -> tuple[str | None, str]:
    """``disk_get_hits`` → ("disk", "get_hits"); an engine counter → (None, name)."""
    for tier in TIER_NAMES:
        if name.startswith(tier + "_") and name[len(tier) + 1 :] in _TIER_WHATS:
            return tier, name[len(tier) + 1 :]
    return None, name


class KVTierCollector:
    """A prometheus_client collector over ``sources()``: a list of ``export`` results,
    read at every scrape."""

    def __init__(self, sources: Callable[[], Sequence[dict]]):
        self._sources = sources

    def describe(self) -> list:
        return []  # unchecked collector: families are known only at scrape time

    def collect(self) -> Iterable:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        counters: dict[str, CounterMetricFamily] = {}
        gauges: dict[str, GaugeMetricFamily] = {}
        histograms: dict[str, HistogramMetricFamily] = {}

        def family(table, cls, name, tier):
            labels = ["rank", "tier"] if tier else ["rank"]
            full = f"kvtier_tier_{name}" if tier else f"kvtier_{name}"
            if full not in table:
                text = (TIER_HELP if tier else HELP).get(name, full.replace("_", " "))
                table[full] = cls(full, text, labels=labels)
            return table[full]

        for source in self._sources():
            rank = str(source.get("labels", {}).get("rank", "0"))
            hits_misses: dict[str, list[float]] = {}
            for name, value in sorted(source.get("counters", {}).items()):
                tier, what = _split_tier(name)
                labels = [rank, tier] if tier else [rank]
                family(counters, CounterMetricFamily, what, tier).add_metric(labels, value)
                if tier and what in (TierCounter.GET_HITS, TierCounter.GET_MISSES):
                    pair = hits_misses.setdefault(tier, [0.0, 0.0])
                    pair[what == TierCounter.GET_MISSES] += value
            for tier, (hits, misses) in hits_misses.items():
                if hits + misses:
                    family(gauges, GaugeMetricFamily, "hit_ratio", tier).add_metric(
                        [rank, tier], hits / (hits + misses)
                    )
            for name, value in sorted(source.get("gauges", {}).items()):
                tier, what = _gauge_tier(name)
                labels = [rank, tier] if tier else [rank]
                family(gauges, GaugeMetricFamily, what, tier).add_metric(labels, value)
            for name, hist in sorted(source.get("histograms", {}).items()):
                tier, what = _split_tier(name)
                labels = [rank, tier] if tier else [rank]
                cumulative, buckets = 0, []
                for bound, count in zip(LATENCY_BUCKETS, hist["counts"], strict=False):
                    cumulative += count
                    buckets.append((str(bound), cumulative))
                buckets.append(("+Inf", hist["count"]))
                family(histograms, HistogramMetricFamily, what, tier).add_metric(
                    labels, buckets, hist["sum"]
                )
        yield from counters.values()
        yield from gauges.values()
        yield from histograms.values()


def _gauge_tier(name: str) -> tuple[str | None, str]:
    for tier in TIER_NAMES:
        if name.startswith(tier + "_"):
            return tier, name[len(tier) + 1 :]
    return None, name


class MetricsServer:
    """An HTTP endpoint (``/metrics``) serving ``KVTierCollector(sources)``.

    Args:
        host: address to bind (``metrics_host``; localhost by default).
        port: port to bind (``metrics_port``); 0 picks a free one (see ``port``).
        sources: the exports to serve, read at each scrape.

    Raises:
        OSError: the port cannot be bound (the message names ``metrics_port``).
    """

    def __init__(self, host: str, port: int, sources: Callable[[], Sequence[dict]]):
        from prometheus_client import CollectorRegistry, start_http_server

        if not 0 <= port <= 65535:  # metrics_port + a data-parallel rank can pass 65535
            raise OSError(
                errno.EINVAL, f"metrics_port {port} on {host} cannot be served: not a port"
            )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KVTierCollector(sources))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno, f"metrics_port {port} on {host} cannot be served: {exc.strerror}"
            ) from None
        self._server.set_app(_metrics_path_only(self._server.get_app()))
        self.host = host
        self.port = self._server.server_port
        logger.info("kvtier metrics at http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _metrics_path_only(metrics: Callable) -> Callable:
    """prometheus_client's WSGI application on ``/metrics`` alone (404 elsewhere, as the
    admin API and the proxy answer), answering HEAD with GET's headers and no body."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"404: Not Found (kvtier serves /metrics)\n"]
        if environ["REQUEST_METHOD"] == "HEAD":
            answered = []
            get = {**environ, "REQUEST_METHOD": "GET"}
            body = b"".join(metrics(get, lambda *status_headers: answered.append(status_headers)))
            status, headers = answered[0][:2]
            start_response(status, [*headers, ("Content-Length", str(len(body)))])
            return []
        return metrics(environ, start_response)

    return app


class MetricsSource(Protocol):
    """What ``serve_engine_metrics`` reads: ``CacheEngine.metrics``."""

    def metrics(self) -> dict: ...


def serve_engine_metrics(
    engine: MetricsSource, host: str = "127.0.0.1", port: int = 0
) -> MetricsServer:
    """Serve one in-process ``CacheEngine``'s metrics (kvtier without vLLM)."""
    return MetricsServer(host, port, lambda: [engine.metrics()])
