"""The proxy's Prometheus metrics (``GET /metrics``), in a registry of its own.

    kvtier_proxy_requests_total{endpoint, status}        requests answered, by HTTP status
    kvtier_proxy_prefill_skipped_total{reason}           requests sent to decode without a
                                                         prefill leg (see ``SkipReason``)
    kvtier_proxy_instance_up{role, instance}             1 up, 0 marked down
    kvtier_proxy_instance_in_flight{role, instance}      requests in flight through the proxy
    kvtier_proxy_instance_requests_total{role, instance} requests sent to the instance
    kvtier_proxy_instance_failures_total{role, instance} connection errors, timeouts, 5xx
    kvtier_proxy_prefill_seconds                         prefill leg, send to last byte
    kvtier_proxy_decode_first_byte_seconds               decode leg, send to first byte
    kvtier_proxy_decode_seconds                          decode leg, send to last byte
    kvtier_proxy_overhead_seconds                        the proxy's own time per request:
                                                         total minus the two legs

The instance series are read from the pools at scrape time, so they are always current.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.proxy.instances import Pool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine legs: from a few ms (a one-token prefill of a short prompt) to minutes (a long
# decode).
LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The proxy's own share: tens of microseconds to a few milliseconds.
OVERHEAD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class SkipReason:
    """Why a request went to decode without a prefill leg (the decode instance then
    computes the whole prompt itself)."""

    NO_PREFILL_INSTANCE = "no_prefill_instance"  # every prefill instance is down
    PREFILL_FAILED = "prefill_failed"  # connection error, timeout or 5xx
    PREFILL_REJECTED = "prefill_rejected"  # 4xx: the decode instance gives the verdict


class _PoolCollector:
    """The per-instance series of the pools, read at scrape time."""

    def __init__(self, pools: Sequence[Pool]):
        self._pools = pools

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable:
        labels = ["role", "instance"]
        up = GaugeMetricFamily(
            "kvtier_proxy_instance_up", "1 if the instance is up, 0 if marked down.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "kvtier_proxy_instance_in_flight",
            "Requests in flight on the instance through this proxy.",
            labels=labels,
        )
        requests = CounterMetricFamily(
            "kvtier_proxy_instance_requests", "Requests sent to the instance.", labels=labels
        )
        failures = CounterMetricFamily(
            "kvtier_proxy_instance_failures",
            "Failed requests to the instance (connection error, timeout, 5xx).",
            labels=labels,
        )
        for pool in self._pools:
            for instance in pool.instances:
                key = [instance.role, instance.url]
                up.add_metric(key, 0.0 if instance.is_down else 1.0)
                in_flight.add_metric(key, instance.in_flight)
                requests.add_metric(key, instance.requests)
                failures.add_metric(key, instance.failures)
        yield from (up, in_flight, requests, failures)


class ProxyMetrics:
    """The proxy's counters and histograms. One per proxy (its own registry, so several
    proxies in one process, as in the tests, do not share series)."""

    def __init__(self, pools: Sequence[Pool]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "kvtier_proxy_requests",
            "Requests answered by the proxy, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prefill_skipped = Counter(
            "kvtier_proxy_prefill_skipped",
            "Requests sent to decode without a prefill leg, by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in (v for k, v in vars(SkipReason).items() if not k.startswith("_")):
            self.prefill_skipped.labels(reason)  # exported at 0 from the start
        self.prefill_seconds = Histogram(
            "kvtier_proxy_prefill_seconds",
            "Seconds of the prefill leg (request sent to response read).",
            buckets=LEG_BUCKETS,
            registry=self.registry,
        )
        self.decode_first_byte_seconds = Histogram(
            "kvtier_proxy_decode_first_byte_seconds",
            "Seconds from sending the decode leg to its first response byte.",
            buckets=LEG_BUCKETS,
            registry=self.registry,
        )
        self.decode_seconds = Histogram(
            "kvtier_proxy_decode_seconds",
            "Seconds of the decode leg (request sent to last byte passed on).",
            buckets=LEG_BUCKETS,
            registry=self.registry,
        )
        self.overhead_seconds = Histogram(
            "kvtier_proxy_overhead_seconds",
            "The proxy's own seconds per request: total time minus the prefill and decode legs.",
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pools))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (without the ``*_created``
        timestamps prometheus_client adds to counters and histograms: they are not
        kvtier's series)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """``registry``'s families without their ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self) -> Iterable:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
