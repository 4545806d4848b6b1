"""What every tier below the CPU offers, and the bounded write queue they share.

The storage manager talks to the disk tier and the remote tier through ``LowerTier``.
All calls are safe from any thread and never raise on a store fault: a tier that cannot
answer says "absent" (a miss) and counts why.

Writes are asynchronous: ``submit_put`` only queues the chunk (taking a reference on its
buffer so it stays valid) and returns at once; worker threads write it. A full queue
drops the write and counts it, so a slow tier never blocks the engine's step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.metrics import Stats, TierCounter, tier_counter
from kvtier.storage.wire import Allocate

logger = logging.getLogger(__name__)

PendingWrite = tuple[CacheKey, MemoryObj]


class LowerTier(Protocol):
    #: tier name in logs and counters (``disk``, ``fs``, ``redis``, ``s3``)
    name: str

    def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key is stored (one batched round trip; False on a fault)."""
        ...

    def get_many(self, keys: Sequence[CacheKey], allocate: Allocate) -> list[MemoryObj | None]:
        """Each chunk in a fresh buffer from ``allocate`` (the caller owns the reference),
        or None: absent, corrupt (counted, removed), no memory, or the tier is down."""
        ...

    def submit_put(self, key: CacheKey, obj: MemoryObj) -> bool:
        """Queue a write of ``obj``; False when it was dropped (counted)."""
        ...

    def remove(self, key: CacheKey) -> bool: ...

    def clear(self) -> None: ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        ...

    @property
    def pending_writes(self) -> int:
        """Writes queued or in flight."""
        ...

    def close(self) -> None:
        """Finish queued writes (bounded wait), then release everything."""
        ...


class WriteQueue:
    """A bounded queue of pending writes drained by worker threads.

    Args:
        name: the tier's name (thread names, counters).
        handler: writes a batch of ``(key, obj)``; runs on a worker thread. It must not
            release the objects (the queue does, after it returns or raises).
        stats: where dropped writes are counted.
        workers: worker threads.
        capacity: most writes queued or in flight; more are dropped.
        max_batch: most writes handed to one ``handler`` call.
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[list[PendingWrite]], None],
        stats: Stats,
        *,
        workers: int,
        capacity: int,
        max_batch: int = 1,
    ):
        self.name = name
        self._handler = handler
        self._stats = stats
        self._capacity = capacity
        self._max_batch = max_batch
        self._items: deque[PendingWrite] = deque()
        self._pending = 0  # queued + being written
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-{name}-writer-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: CacheKey, obj: MemoryObj) -> bool:
        with self._cond:
            if self._closed or self._pending >= self._capacity:
                self._stats.inc(tier_counter(self.name, TierCounter.DROPPED_QUEUE_FULL))
                return False
            obj.ref_up()
            self._items.append((key, obj))
            self._pending += 1
            self._cond.notify()
            return True

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                batch = [
                    self._items.popleft() for _ in range(min(self._max_batch, len(self._items)))
                ]
            try:
                self._handler(batch)
            except Exception:
                logger.exception("kvtier %s tier: a write batch failed", self.name)
            finally:
                for _, obj in batch:
                    obj.ref_down()
                with self._cond:
                    self._pending -= len(batch)
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Let queued writes finish (up to ``timeout``), then stop the workers; writes
        still queued after that are dropped."""
        finished = self.flush(timeout)
        with self._cond:
            self._closed = True
            dropped = list(self._items)
            self._items.clear()
            self._pending -= len(dropped)
            self._cond.notify_all()
        for _, obj in dropped:
            obj.ref_down()
        if not finished:
            logger.warning(
                "kvtier %s tier: %d queued writes dropped at shutdown", self.name, len(dropped)
            )
        for thread in self._threads:
            thread.join(timeout=5.0)
