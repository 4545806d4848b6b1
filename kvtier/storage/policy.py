"""Eviction policies: which stored key goes first when a tier is full.

A policy only orders keys; the tier decides whether a candidate may go (an object that is
pinned or being read is skipped). All operations are O(1) except iteration.

- ``LRU``: least recently used first (an access moves a key to the back).
- ``MRU``: most recently used first (good for one-pass scans larger than the tier).
- ``FIFO``: insertion order; accesses do not reorder.
- ``LFU``: least frequently used first; ties broken by least recent use.
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
