"""Tier events: a record of what kvtier's tiers hold, for KV-aware routers.

A router that sends each request to the engine already holding its prefix has to know
what every engine holds. The tiers that take part record, at the moment their contents
change::

    stored(tier, chunk_hash)     the chunk became readable (recorded after the put committed)
    removed(tier, chunk_hash)    it stopped being readable (evicted, removed as corrupt)
    cleared(tier)                every chunk of the tier is gone

The vLLM integration ships each worker's records to the scheduler every engine step and
turns them into vLLM's ``BlockStored`` / ``BlockRemoved`` events keyed by vLLM's block
hashes (``integration/vllm/kv_events.py``; fields in docs/observability.md#kv-events).

NOTE: per (tier, chunk) the records of one process alternate stored, removed, stored, …
A tier records ``stored`` only for a chunk it did not hold, and ``removed`` only for one it
did. The scheduler side relies on this to merge the ranks of a tensor-parallel engine.

The CPU tier and the local disk tier record (the disk tier for the files it wrote
itself, when the rename landed and when it evicts, removes or clears them). The shared
tiers (fs, redis, s3) record nothing: other engines and the store itself change them out
of this engine's sight. Their placement below is what their events would carry.

The log is bounded: when nobody drains it, the oldest records are dropped and counted
(``kv_events_dropped``). Without a log (the default) the tiers do no event work at all.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvtier.observability.stats import Counter, Stats

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"

# Values of vLLM's ``BlockStored.medium`` / ``.locality`` (vllm.distributed.kv_events).
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"
OWNERSHIP = "kvtier"  # ``ownership`` of every kvtier event: tells them from vLLM's own


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a tier keeps its chunks, as a router sees it."""

    medium: str  # MEDIUM_CPU | MEDIUM_STORAGE
    locality: str  # LOCAL: only this engine reads it; REMOTE: shared with other engines


PLACEMENTS: dict[str, Placement] = {
    "cpu": Placement(MEDIUM_CPU, LOCAL),
    "disk": Placement(MEDIUM_STORAGE, LOCAL),
    "fs": Placement(MEDIUM_STORAGE, REMOTE),
    "redis": Placement(MEDIUM_STORAGE, REMOTE),
    "s3": Placement(MEDIUM_STORAGE, REMOTE),
}

DEFAULT_CAPACITY = 65_536


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One change of one tier: ``kind`` is STORED, REMOVED or CLEARED (``chunk_hash``
    None)."""

    kind: str
    tier: str
    chunk_hash: bytes | None = None


class TierEventLog:
    """A bounded, thread-safe log of ``TierEvent`` records, drained by its reader.

    Args:
        capacity: most records kept; a record beyond it drops the oldest (counted in
            ``stats`` as ``kv_events_dropped``).
        stats: where drops are counted.

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, stats: Stats | None = None):
        if capacity < 1:
            raise ValueError(f"TierEventLog capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.stats = stats or Stats()
        self._records: deque[TierEvent] = deque()
        self._lock = threading.Lock()

    def stored(self, tier: str, chunk_hash: bytes) -> None:
        self._add(TierEvent(STORED, tier, chunk_hash))

    def removed(self, tier: str, chunk_hash: bytes) -> None:
        self._add(TierEvent(REMOVED, tier, chunk_hash))

    def cleared(self, tier: str) -> None:
        self._add(TierEvent(CLEARED, tier))

    def _add(self, record: TierEvent) -> None:
        with self._lock:
            if len(self._records) >= self.capacity:
                self._records.popleft()
                self.stats.inc(Counter.KV_EVENTS_DROPPED)
            self._records.append(record)

    def drain(self) -> list[TierEvent]:
        """Every record since the last drain, oldest first."""
        with self._lock:
            records = list(self._records)
            self._records.clear()
        return records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
