"""The local CPU tier: objects kept in one host memory pool (pinned when a GPU is present).
The engine keeps its chunks here (by ``CacheKey``), and a ``kvtier serve`` its memory
tier of blobs (by ``(namespace, name)``, ``kvtier.server.blobs``).

The tier owns the pool it allocates buffers from, so it can make room: when an
allocation fails it evicts, in policy order, stored objects that nobody is using, until
the allocation fits or nothing more can go. A request larger than the whole pool is
refused at once, evicting nothing.

NOTE: an object is evictable only while the tier holds the sole reference and it is not
pinned. A reader holds a reference (``get`` returns one) and a writer pins (a store
pins its prompt's stored prefix too); neither can lose its object underneath it. A
lookup pins nothing. This is the rule for every user: evicting an object
in use would free nothing until the use ends (the memory stays the user's), so it would
only lose a hit and push out more objects for the same room. It never makes a writer
wait either: ``allocate`` evicts what is idle and, when that is not enough, fails at
once (counted); a server refuses that one put and goes on.

With an event log (``kvtier.observability.tier_events``) the tier records each chunk it
starts holding (after the put, so it is readable), each chunk it stops holding (evicted
or removed) and each clear, under the tier's lock, so the records follow the order of
its contents.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Hashable, Sequence

import torch

from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool, MemoryObj
from kvtier.observability.stats import Counter, Stats
from kvtier.observability.tier_events import TierEventLog
from kvtier.storage.policy import make_policy

logger = logging.getLogger(__name__)


class LocalCPUTier:
    """Capacity-bounded object store in host memory, by any hashable key (chunks are
    recorded in ``events`` only under a ``CacheKey``).

    Args:
        capacity_bytes: size of the pool.
        policy: eviction policy name (LRU | LFU | FIFO | MRU).
        alignment: buffer alignment in bytes.
        pin_memory: pin the pool (None: when a GPU is present).
        stats: where evictions and allocation failures are counted.
        events: where changes of its contents are recorded (None: not recorded).
        memory: what to carve the pool from (``HostMemoryPool``'s ``memory``).
    """

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        policy: str = "LRU",
        *,
        alignment: int = 256,
        pin_memory: bool | None = None,
        stats: Stats | None = None,
        events: TierEventLog | None = None,
        memory: torch.Tensor | None = None,
    ):
        self.pool = HostMemoryPool(
            capacity_bytes, alignment=alignment, pin_memory=pin_memory, memory=memory
        )
        self.policy = make_policy(policy)
        self.stats = stats or Stats()
        self.events = events
        self._objects: dict[Hashable, MemoryObj] = {}
        self._lock = threading.RLock()

    # -- allocation ------------------------------------------------------------------

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer for a new object, evicting idle objects if needed.

        Returns None (counted as an allocation failure) when even after evicting every
        evictable object there is no room, or at once when the buffer would be larger
        than the whole pool; the caller skips the store.
        """
        if not self.fits(shape, dtype):
            self.stats.inc(Counter.ALLOC_FAILURES)
            return None
        with self._lock:
            obj = self.pool.allocate(shape, dtype)
            while obj is None and self._evict_one():
                obj = self.pool.allocate(shape, dtype)
            if obj is None:
                self.stats.inc(Counter.ALLOC_FAILURES)
            return obj

    def fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        """Whether a buffer of ``shape`` and ``dtype`` fits in the whole pool at all."""
        return self.fitting(shape, dtype) > 0

    def fit_together(self, buffers: Sequence[tuple[Sequence[int], torch.dtype]]) -> bool:
        """Whether buffers of these shapes and dtypes fit in the whole pool at once (the
        parts of one object, allocated while holding one another)."""
        nbytes = (self._aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in buffers)
        return sum(nbytes) <= self.pool.capacity

    def fitting(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """How many buffers of ``shape`` and ``dtype`` the whole pool holds at once."""
        return self.pool.capacity // self._aligned(math.prod(shape) * dtype.itemsize)

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.pool.alignment) * self.pool.alignment

    def _evict_one(self) -> bool:
        for key in self.policy.candidates():
            obj = self._objects[key]
            if obj.ref_count == 1 and not obj.is_pinned:
                break
        else:
            return False
        self._drop(key)
        self.stats.inc(Counter.EVICTIONS)
        return True

    def _drop(self, key: Hashable, *, record: bool = True) -> None:
        obj = self._objects.pop(key)
        self.policy.remove(key)
        obj.ref_down()  # the memory returns now, or when its last user lets go
        if record and self.events is not None and _whole_chunk(key):
            self.events.removed(self.name, key.chunk_hash)

    # -- contents --------------------------------------------------------------------

    def put(self, key: Hashable, obj: MemoryObj) -> bool:
        """Keep ``obj`` under ``key`` (the tier takes its own reference).

        Returns False, keeping the existing object, when the key is already stored (a
        chunk key names the same bytes whoever stores them: the one readers may hold
        stays).
        """
        with self._lock:
            if key in self._objects:
                self.policy.touch(key)
                return False
            self._add(key, obj)
            return True

    def replace(self, key: Hashable, obj: MemoryObj) -> None:
        """Keep ``obj`` under ``key``, in place of the object stored there if any (a blob
        store's put: the last one wins). The old object's memory returns to the pool once
        its readers let go; ``obj`` starts over in policy order."""
        with self._lock:
            if key in self._objects:
                self._drop(key)
            self._add(key, obj)

    def _add(self, key: Hashable, obj: MemoryObj) -> None:
        obj.ref_up()
        self._objects[key] = obj
        self.policy.add(key)
        if self.events is not None and _whole_chunk(key):
            self.events.stored(self.name, key.chunk_hash)

    def get(self, key: Hashable) -> MemoryObj | None:
        """The object under ``key`` with a reference taken for the caller (who must
        ``ref_down`` it), or None."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return None
            obj.ref_up()
            self.policy.touch(key)
            return obj

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._objects

    def prefix_length(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are stored."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._objects:
                    return i
            return len(keys)

    def remove(self, key: Hashable) -> bool:
        """Forget ``key``; its memory returns to the pool once no reader holds it."""
        with self._lock:
            if key not in self._objects:
                return False
            self._drop(key)
            return True

    def pin(self, key: Hashable) -> MemoryObj | None:
        """Protect the object under ``key`` from eviction; returns it (None if not
        stored). The caller unpins that object (``MemoryObj.unpin``): by then the key may
        name another one (removed or cleared, then stored again)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.pin()
            return obj

    def unpin(self, key: Hashable) -> None:
        """Undo a ``pin`` of the object stored under ``key`` now."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is not None:
                obj.unpin()

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def pinned_count(self) -> int:
        """Stored objects pinned right now (being written or read)."""
        with self._lock:
            return sum(obj.is_pinned for obj in self._objects.values())

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes()

    def clear(self) -> None:
        with self._lock:
            for key in list(self._objects):
                self._drop(key, record=False)
            if self.events is not None:
                self.events.cleared(self.name)

    def close(self) -> None:
        self.clear()
        self.pool.close()


def _whole_chunk(key: Hashable) -> bool:
    """Whether ``key`` names a whole chunk (what the event log records)."""
    return isinstance(key, CacheKey) and key.layer is None
