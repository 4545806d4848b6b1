"""The free-space bookkeeping of a `HostMemoryPool`: a best-fit allocator of byte extents
``(offset, size)`` within a fixed capacity.

Free space is a list of extents kept sorted by offset, plus a second index of the same
extents sorted by ``(size, offset)``::

    pool:  |##A##|.....free.....|##B##|##C##|..free..|####D####|...free...|
            0                                                           capacity
    free by offset: [(5, 14), (32, 8), (49, 10)]
    free by size:   [(8, 32), (10, 49), (14, 5)]

* ``take`` is **best-fit**: one bisect in the size index finds the smallest extent that
  is large enough (lowest offset among equal sizes), which is split; the remainder goes
  back to the free list. Why best-fit: most requests are full chunks of one size, so a freed
  chunk-sized hole is reused exactly and larger extents stay intact for the odd larger
  request (layer-wise groups, a different model's chunks), while partial last chunks are
  placed in the smallest hole that holds them instead of chipping the front of a big one.
  The size index also makes the search O(log n) rather than a first-fit scan.
* ``release`` finds the neighbours with one bisect in the offset list (O(log n)) and merges
  with the left and/or right neighbour, so the free list is always fully coalesced.

List insertions/deletions are O(n) memmoves of machine words, which is negligible for the
few thousand extents a pool holds. An ``Extents`` is not thread-safe: its pool's lock
guards it.
"""

from __future__ import annotations

import bisect


class Extents:
    """Which byte extents of ``capacity`` bytes are free and which are live.

    Sizes and offsets are the caller's (the pool rounds them to its alignment);
    ``alignment`` is only checked by `check_invariants`.
    """

    def __init__(self, capacity: int, alignment: int) -> None:
        self.capacity = capacity
        self.alignment = alignment
        self.reset()

    def reset(self) -> None:
        """Everything free again."""
        # Free extents, sorted by offset, and the same extents sorted by (size, offset).
        self._free_offsets: list[int] = [0]
        self._free_size_at: dict[int, int] = {0: self.capacity}
        self._free_by_size: list[tuple[int, int]] = [(self.capacity, 0)]
        # Live extents: offset -> size.
        self._live: dict[int, int] = {}
        self.used = 0  # bytes in live extents

    @property
    def num_live(self) -> int:
        return len(self._live)

    def largest_free(self) -> int:
        """Size of the largest free extent (0 when none is free)."""
        return self._free_by_size[-1][0] if self._free_by_size else 0

    def take(self, size: int) -> int | None:
        """The offset of a new live extent of ``size`` bytes (best-fit), or None when no
        free extent is large enough."""
        i = bisect.bisect_left(self._free_by_size, (size, -1))
        if i == len(self._free_by_size):
            return None
        extent_size, offset = self._free_by_size[i]
        self._remove_free(offset, extent_size, size_index=i)
        if extent_size > size:
            self._insert_free(offset + size, extent_size - size)
        self._live[offset] = size
        self.used += size
        return offset

    def release(self, offset: int, size: int) -> bool:
        """Free the live extent ``(offset, size)``, merging it with both neighbours.

        Returns False (and frees nothing) when no live extent of that size starts there."""
        if self._live.pop(offset, None) != size:
            return False
        self.used -= size
        end = offset + size
        # Right first: removing it leaves the left neighbour's index (i - 1) unchanged.
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == end:
            right_size = self._free_size_at[end]
            self._remove_free(end, right_size)
            size += right_size
        if i > 0:
            left = self._free_offsets[i - 1]
            left_size = self._free_size_at[left]
            if left + left_size == offset:
                self._remove_free(left, left_size)
                offset, size = left, size + left_size
        self._insert_free(offset, size)
        return True

    def _insert_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_size_at[offset] = size
        bisect.insort(self._free_by_size, (size, offset))

    def _remove_free(self, offset: int, size: int, *, size_index: int | None = None) -> None:
        del self._free_offsets[bisect.bisect_left(self._free_offsets, offset)]
        del self._free_size_at[offset]
        if size_index is None:
            size_index = bisect.bisect_left(self._free_by_size, (size, offset))
        del self._free_by_size[size_index]

    def check_invariants(self) -> None:
        """Check the bookkeeping.

        Raises:
            AssertionError: the free list is not sorted, overlaps itself or a live
                extent, is not fully coalesced, the two free indexes disagree, an
                offset is misaligned, or free + used != capacity.
        """
        _check(
            self._free_offsets == sorted(self._free_size_at),
            "free offsets are not sorted / disagree with the size map",
        )
        _check(
            self._free_by_size == sorted((s, o) for o, s in self._free_size_at.items()),
            "size index disagrees with the free extents",
        )
        extents = [(o, s, "free") for o, s in self._free_size_at.items()]
        extents += [(o, s, "used") for o, s in self._live.items()]
        extents.sort()
        cursor = 0
        prev_kind = None
        for offset, size, kind in extents:
            _check(size > 0, f"empty {kind} extent at offset {offset}")
            _check(offset % self.alignment == 0, f"{kind} offset {offset} is misaligned")
            _check(offset >= cursor, f"{kind} extent at {offset} overlaps one ending at {cursor}")
            _check(
                not (kind == prev_kind == "free" and offset == cursor),
                f"free extents not coalesced at offset {offset}",
            )
            cursor = offset + size
            prev_kind = kind
        _check(cursor <= self.capacity, f"extent ends at {cursor} > capacity {self.capacity}")
        used = sum(self._live.values())
        free = sum(self._free_size_at.values())
        _check(used == self.used, f"used counter {self.used} != {used}")
        _check(
            free + used == self.capacity, f"free {free} + used {used} != capacity {self.capacity}"
        )


def _check(condition: bool, message: str) -> None:
    # Explicit raise rather than `assert`, so the check still runs under `python -O`.
    if not condition:
        raise AssertionError(f"Extents invariant violated: {message}")
