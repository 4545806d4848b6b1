"""Eviction policies: which stored key goes first when a tier is full.

A policy only orders keys; the tier decides whether a candidate may go (an object that is
pinned or being read is skipped). All operations are O(1) except iteration.

- ``LRU``: least recently used first (an access moves a key to the back).
- ``MRU``: most recently used first (good for one-pass scans larger than the tier).
- ``FIFO``: insertion order; accesses do not reorder.
- ``LFU``: least frequently used first; ties broken by least recent use.

``SizedIndex`` puts a policy under a byte bound: the index of a bounded ``FileStore``
(the disk tier's files and the node server's disk) and the one place that decides which
files go when a new one must fit. The CPU tier, bounded by its memory pool rather than a
byte count, orders its objects with a policy directly.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Iterator

POLICIES = ("LRU", "LFU", "FIFO", "MRU")


class EvictionPolicy:
    """Orders the keys of one tier for eviction. Not thread-safe: the tier locks."""

    name = ""

    def add(self, key: Hashable) -> None:
        raise NotImplementedError

    def touch(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def candidates(self) -> Iterator[Hashable]:
        """Keys in eviction order (first = evict first). Do not mutate while iterating:
        collect what to evict, then remove."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class _OrderedPolicy(EvictionPolicy):
    reorder_on_touch = True
    evict_newest = False

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if self.reorder_on_touch and key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[Hashable]:
        return iter(reversed(self._order) if self.evict_newest else self._order)

    def __len__(self) -> int:
        return len(self._order)


class LRUPolicy(_OrderedPolicy):
    name = "LRU"


class MRUPolicy(_OrderedPolicy):
    name = "MRU"
    evict_newest = True


class FIFOPolicy(_OrderedPolicy):
    name = "FIFO"
    reorder_on_touch = False


class LFUPolicy(EvictionPolicy):
    """Frequency buckets, each an insertion-ordered set: O(1) add/touch/remove."""

    name = "LFU"

    def __init__(self) -> None:
        self._freq: dict[Hashable, int] = {}
        self._buckets: defaultdict[int, OrderedDict[Hashable, None]] = defaultdict(OrderedDict)

    def add(self, key: Hashable) -> None:
        self.remove(key)
        self._freq[key] = 1
        self._buckets[1][key] = None

    def _unlink(self, key: Hashable) -> int | None:
        """Take ``key`` out of its bucket; returns its frequency (None if absent)."""
        freq = self._freq.pop(key, None)
        if freq is not None:
            bucket = self._buckets[freq]
            del bucket[key]
            if not bucket:
                del self._buckets[freq]
        return freq

    def touch(self, key: Hashable) -> None:
        freq = self._unlink(key)
        if freq is not None:
            self._freq[key] = freq + 1
            self._buckets[freq + 1][key] = None

    def remove(self, key: Hashable) -> None:
        self._unlink(key)

    def candidates(self) -> Iterator[Hashable]:
        for freq in sorted(self._buckets):
            yield from list(self._buckets[freq])

    def __len__(self) -> int:
        return len(self._freq)


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name (case-insensitive).

    Raises:
        ValueError: naming the policy and the allowed ones.
    """
    classes = {"LRU": LRUPolicy, "LFU": LFUPolicy, "FIFO": FIFOPolicy, "MRU": MRUPolicy}
    try:
        return classes[name.upper()]()
    except KeyError:
        raise ValueError(
            f"cache_policy={name!r} is not supported; choose one of {', '.join(POLICIES)}"
        ) from None


class SizedIndex:
    """Names with their sizes in bytes, in one policy's eviction order, within a bound.
    Not thread-safe: the store that owns it locks.

    NOTE: adding a name that is indexed already replaces its entry: the new size counts,
    the old one no longer does, and the entry starts over as a new one in policy order
    (it names new bytes). ``used`` is then always the sum of what the entries name.

    Args:
        capacity_bytes: the bound (None: unbounded, nothing is ever evicted).
        policy: the eviction order (LRU | LFU | FIFO | MRU).
    """

    def __init__(self, capacity_bytes: int | None, policy: str = "LRU"):
        self.capacity_bytes = capacity_bytes
        self.used = 0
        self._sizes: dict[Hashable, int] = {}
        self._policy = make_policy(policy)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def names(self) -> list[Hashable]:
        return list(self._sizes)

    def add(self, name: Hashable, size: int) -> None:
        """Index ``name`` of ``size`` bytes (replacing its entry, if any); no eviction."""
        self.drop(name)
        self._sizes[name] = size
        self._policy.add(name)
        self.used += size

    def touch(self, name: Hashable) -> bool:
        """A use of ``name`` (for the eviction order); whether it is indexed."""
        if name not in self._sizes:
            return False
        self._policy.touch(name)
        return True

    def drop(self, name: Hashable) -> bool:
        """Forget ``name``; whether it was indexed."""
        size = self._sizes.pop(name, None)
        if size is None:
            return False
        self._policy.remove(name)
        self.used -= size
        return True

    def clear(self) -> None:
        for name in self.names():
            self.drop(name)

    def first(self) -> Hashable | None:
        """The entry the policy evicts next, or None when the index is empty."""
        return next(iter(self._policy.candidates()), None)

    def make_room(self, size: int) -> list[Hashable] | None:
        """Drop entries in policy order until ``size`` more bytes fit within the bound;
        the names dropped (the caller deletes what they name), or None when ``size`` is
        larger than the whole bound (then nothing is dropped)."""
        if self.capacity_bytes is None:
            return []
        if size > self.capacity_bytes:
            return None
        victims = []
        free = self.capacity_bytes - self.used
        for name in self._policy.candidates():
            if free >= size:
                break
            victims.append(name)
            free += self._sizes[name]
        for name in victims:
            self.drop(name)
        return victims

    def shed(self, size: int, keep: Hashable, *, at_least: int = 1) -> list[Hashable]:
        """Drop entries other than ``keep`` in policy order until they add up to ``size``
        bytes or more and number ``at_least`` or more (fewer when the others are fewer);
        the names dropped (the caller deletes what they name)."""
        victims, freed = [], 0
        for name in self._policy.candidates():
            if freed >= size and len(victims) >= at_least:
                break
            if name != keep:
                victims.append(name)
                freed += self._sizes[name]
        for name in victims:
            self.drop(name)
        return victims

    def reserve(self, name: Hashable, size: int) -> list[Hashable] | None:
        """Index ``name`` of ``size`` bytes, making room for it first (its own old entry
        counts as room); the names evicted, or None when it can never fit (then the
        index is unchanged)."""
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return None
        self.drop(name)
        victims = self.make_room(size)
        assert victims is not None
        self.add(name, size)
        return victims
