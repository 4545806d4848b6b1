"""What every tier below the CPU offers, and the bounded write queue they share.

The storage manager talks to the disk tier and the remote tier through ``LowerTier``.
All calls are safe from any thread and never raise on a store fault: a tier that cannot
answer says "absent" (a miss) and counts why.

Writes are asynchronous: ``submit_put`` only queues the chunk (``WriteQueue``, taking a
reference on its buffer so it stays valid) and returns at once; worker threads write it.
A full queue drops the write and counts it, so a slow tier never blocks the engine's step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Counter, Stats, TierCounter, tier_counter
from kvtier.storage.serde import CorruptObject, NewerFormat
from kvtier.storage.wire import Allocate
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

PendingWrite = tuple[CacheKey, MemoryObj]
T = TypeVar("T")


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


def count_refused(stats: Stats, tier: str, what: str, exc: CorruptObject) -> None:
    """Count and log an object tier ``tier`` read and refuses (a miss, which the tier
    then deletes); ``what`` names it in the log (a path, a key).

    A corrupt object is logged once per object. One in a newer kvtier's format
    (``NewerFormat``) is logged once per tier and cause: during a rolling upgrade every
    chunk a newer engine stored is one. Deleting it lets this kvtier store the chunk in
    a format both read, so engines of the two versions still share it."""
    if isinstance(exc, NewerFormat):
        stats.inc(tier_counter(tier, TierCounter.NEWER_FORMAT))
        warn_once(
            logger,
            f"kvtier {tier} tier: chunks stored by a newer kvtier ({exc}) are misses here, "
            "deleted so that this kvtier stores them again; upgrade it to read them",
        )
        return
    stats.inc(tier_counter(tier, TierCounter.CORRUPT))
    stats.inc(Counter.CORRUPT_CHUNKS)
    warn_once(logger, f"kvtier {tier} tier: {what} is corrupt ({exc}): deleted, a miss")


class BatchQueue(Generic[T]):
    """A bounded queue of pending writes drained in batches by worker threads: the write
    path of every tier that writes behind its caller's back (the disk and remote tiers,
    and the remote behind a ``kvtier serve``).

    Args:
        name: the tier's name (thread names, logs, the default drop counter).
        handler: writes a batch of items; runs on a worker thread. It must not release
            the items (the queue does, after it returns or raises).
        stats: where dropped writes are counted.
        workers: worker threads.
        capacity: most writes queued or in flight; more are dropped.
        max_batch: most writes handed to one ``handler`` call.
        dropped_counter: the counter of writes dropped for a full queue (default: the
            tier's ``dropped_queue_full``).
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[list[T]], None],
        stats: Stats,
        *,
        workers: int,
        capacity: int,
        max_batch: int = 1,
        dropped_counter: str | None = None,
    ):
        self.name = name
        self._handler = handler
        self._stats = stats
        self._capacity = capacity
        self._max_batch = max_batch
        self._dropped = dropped_counter or tier_counter(name, TierCounter.DROPPED_QUEUE_FULL)
        self._items: deque[T] = deque()
        self._pending = 0  # queued + being written
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvtier-{name}-writer-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _hold(self, item: T) -> None:
        """Keep what ``item`` needs alive while it waits (nothing, for plain data)."""

    def _release(self, item: T) -> None:
        """Undo ``_hold`` once ``item`` is written or dropped."""

    def offer(self, item: T) -> bool:
        """Queue ``item``; False when the queue is full or closed (counted)."""
        with self._cond:
            if self._closed or self._pending >= self._capacity:
                self._stats.inc(self._dropped)
                return False
            self._hold(item)
            self._items.append(item)
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
                for item in batch:
                    self._release(item)
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

    def close(self, timeout: float | None = 30.0) -> int:
        """Let queued writes finish (up to ``timeout``), then stop the workers; writes
        still queued after that are dropped. Returns how many were."""
        finished = self.flush(timeout)
        with self._cond:
            self._closed = True
            dropped = list(self._items)
            self._items.clear()
            self._pending -= len(dropped)
            self._cond.notify_all()
        for item in dropped:
            self._release(item)
        if not finished:
            logger.warning(
                "kvtier %s tier: %d queued writes dropped at shutdown", self.name, len(dropped)
            )
        for thread in self._threads:
            thread.join(timeout=5.0)
        return len(dropped)


class WriteQueue(BatchQueue[PendingWrite]):
    """The chunk writes of a lower tier: a queued chunk holds a reference on its buffer,
    so the buffer stays valid until it is written."""

    def submit(self, key: CacheKey, obj: MemoryObj) -> bool:
        """Queue a write of ``obj`` under ``key``; False when it was dropped (counted)."""
        return self.offer((key, obj))

    def _hold(self, item: PendingWrite) -> None:
        item[1].ref_up()

    def _release(self, item: PendingWrite) -> None:
        item[1].ref_down()
