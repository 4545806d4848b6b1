"""Alias of :mod:`kvtier.observability.stats`, the path earlier releases documented
(``kvtier.metrics.Counter``, ``Stats``)."""

from kvtier.observability.stats import Counter, Histogram, Stats, TierCounter

__all__ = ["Counter", "Histogram", "Stats", "TierCounter"]
