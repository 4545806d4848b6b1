"""Leases on blobs in the server's memory tier, for peers that read its pool one-sidedly
(``kvtier.server.nixl``).

A lease holds a reference on each leased blob's buffer: the tier evicts nothing being
held, and a blob replaced or deleted meanwhile keeps its old buffer, unchanged, until the
lease lets go. So bytes read under a lease are the blob as it was when leased. A lease
lasts at most ``ttl_s`` (a puller that died must not pin memory forever); one that
expired before its RELEASE answers ``held: false`` there, and the puller drops what it
read (a miss, never wrong bytes).

``busy`` tells the NIXL plane when to progress its agent: while a lease is out, and for
``LINGER_S`` after the last was granted (a read may still be in flight when its lease
has expired, and some UCX transports need the target to progress for it to end).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

from kvtier.memory import MemoryObj

LINGER_S = 1.0


class Leases:
    """Leases by id; thread-safe."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._held: dict[int, tuple[float, list[MemoryObj]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.expired = 0
        self._last_grant = float("-inf")

    def grant(self, objs: Sequence[MemoryObj]) -> int:
        """A lease on ``objs``, taking over the caller's reference on each."""
        with self._lock:
            lease = next(self._ids)
            self._last_grant = time.monotonic()
            self._held[lease] = (time.monotonic() + self.ttl_s, list(objs))
            return lease

    def release(self, lease: int) -> bool:
        """End ``lease``; whether it was held until now (not expired, not unknown)."""
        with self._lock:
            entry = self._held.pop(lease, None)
        if entry is None:
            return False
        deadline, objs = entry
        for obj in objs:
            obj.ref_down()
        return time.monotonic() <= deadline

    def expire(self) -> None:
        """Drop every lease past its time."""
        now = time.monotonic()
        with self._lock:
            gone = [lease for lease, (deadline, _) in self._held.items() if deadline < now]
            entries = [self._held.pop(lease) for lease in gone]
            self.expired += len(gone)
        for _, objs in entries:
            for obj in objs:
                obj.ref_down()

    def busy(self) -> bool:
        """Whether a lease is out, or was granted within ``LINGER_S``."""
        return bool(self._held) or time.monotonic() - self._last_grant < LINGER_S

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        with self._lock:
            entries, self._held = list(self._held.values()), {}
        for _, objs in entries:
            for obj in objs:
                obj.ref_down()
