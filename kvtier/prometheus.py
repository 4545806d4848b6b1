"""Alias of :mod:`kvtier.observability.prometheus`, the path earlier releases documented
(``kvtier.prometheus.serve_engine_metrics``)."""

from kvtier.observability.prometheus import (
    KVTierCollector,
    MetricsServer,
    export,
    serve_engine_metrics,
)

__all__ = ["KVTierCollector", "MetricsServer", "export", "serve_engine_metrics"]
