"""How a request's blobs travel between a client and the server's memory tier without
more copies than the transport needs: an inline PUT's blobs received straight into
memory-tier buffers (``Received``), and a GET's blobs placed into the client's
shared-memory segment or sent from the tier's own buffers (``Placement``), held until the
reply is out (``Reply``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.memory import MemoryObj
from kvtier.server.blobs import view_of
from kvtier.server.cache import BlobCache
from kvtier.server.shm import SharedArena
from kvtier.storage.blob_store import Buffer
from kvtier.storage.node_shm import Segment


@dataclass(slots=True)
class Reply:
    """A handler's answer: the reply's header and payload parts, and the memory-tier
    objects those parts view (released once the reply is sent)."""

    header: dict[str, Any]
    parts: Sequence[Buffer] = ()
    held: Sequence[MemoryObj] = ()


@dataclass(slots=True)
class Received:
    """One blob of an inline PUT as it arrives: into a buffer of the memory tier
    (``obj``, kept as it is once the frame is whole), or into a scratch buffer where
    memory has no room for it (``obj`` None)."""

    view: memoryview
    obj: MemoryObj | None

    @classmethod
    def allocate(cls, cache: BlobCache, size: int) -> Received:
        obj = cache.allocate(size)
        if obj is None:
            return cls(memoryview(bytearray(size)), None)
        return cls(view_of(obj)[:size], obj)


def let_go(blobs: list[Received] | None) -> None:
    """Drop the references to the buffers ``blobs`` arrived in (memory keeps its own to
    what it stored)."""
    for blob in blobs or ():
        if blob.obj is not None:
            blob.obj.ref_down()
            blob.obj = None


class Placement:
    """Where a GET reply puts each blob: where it lies in the shared memory tier when the
    client reads that (``arena``: no copy; the object is lent, ``lent``, until the client
    lets go of the lease), else into the client's region of its segment while it fits (a
    copy), else into the frame's payload while that fits (the blob's own buffer, held
    until the reply is sent), else nowhere (-1, a miss)."""

    def __init__(
        self,
        segment: Segment | None,
        region: tuple[int, int] | None,
        room: int,
        arena: SharedArena | None = None,
    ):
        self._segment = segment
        self._next, self._end = (0, 0) if region is None else (region[0], sum(region))
        self._room = room
        self._arena = arena
        self.parts: list[Buffer] = []
        self.held: list[MemoryObj] = []
        self.lent: list[MemoryObj] = []
        self.lent_at: list[int] = []  # per blob (taken or missed): where in the arena, or -1
        self.shm_bytes = 0

    def miss(self) -> tuple[int, int]:
        """A blob found nowhere: ``(-1, -1)``."""
        self.lent_at.append(-1)
        return -1, -1

    def take(self, blob: Buffer, obj: MemoryObj | None = None) -> tuple[int, int]:
        """``(size, offset in the segment or -1)``; ``(-1, -1)`` when it fits nowhere.
        ``obj``: the memory-tier object ``blob`` views, with a reference that the
        placement now owns."""
        size = len(blob)
        self.lent_at.append(-1)
        if self._arena is not None and obj is not None:
            self.lent_at[-1] = self._arena.offset_of(obj)
            self.lent.append(obj)
            self.shm_bytes += size
            return size, -1
        if self._segment is not None and self._next + size <= self._end:
            offset = self._next
            self._segment.mm[offset : offset + size] = blob
            self._next += size
            self.shm_bytes += size
            placed = size, offset
        elif size <= self._room:
            self.parts.append(blob)
            self._room -= size
            if obj is not None:
                self.held.append(obj)
                obj = None
            placed = size, -1
        else:
            placed = -1, -1
        if obj is not None:
            obj.ref_down()
        return placed


def take_data(place: Placement, data: bytes | None) -> tuple[int, int]:
    """``place.take(data)``, or a miss when ``data`` is None."""
    return place.miss() if data is None else place.take(data)
