"""Observability in one place: the counters every component keeps, what the tiers record
for KV events, and their export to Prometheus (docs/observability.md)."""
