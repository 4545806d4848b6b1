"""How a request's blobs travel between a client and the server's memory tier without
more copies than the transport needs: an inline PUT's blobs received straight into
memory-tier buffers (``Received``), a same-host client's PUT written by the client
itself into buffers set aside in the shared memory tier (``Reservation``), and a GET's
blobs lent where they lie in the shared tier, placed into the client's shared-memory
segment or sent from the tier's own buffers (``Placement``), held until the reply is out
(``Reply``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.memory import MemoryObj
from kvtier.server.blobs import view_of
from kvtier.server.cache import BlobCache
from kvtier.server.leases import Leases
from kvtier.server.shm import SegmentFile, SharedArena, ShmRefError
from kvtier.storage.blob_store import Buffer
from kvtier.storage.node_protocol import Frame, Op


@dataclass(slots=True)
class Reply:
    """A handler's answer: the reply's header and payload parts, and the memory-tier
    objects those parts view (released once the reply is sent)."""

    header: dict[str, Any]
    parts: Sequence[Buffer] = ()
    held: Sequence[MemoryObj] = ()


@dataclass(slots=True)
class Session:
    """One authenticated connection: its namespace, its shared-memory segment, the leases
    of its reads from the shared memory tier and the buffers set aside for its next
    PUT there (both let go of when it ends)."""

    namespace: str
    segment: SegmentFile | None = None
    peer: bool = False  # another server: never passed on to this server's peers
    leases: set[int] = field(default_factory=set)
    reserved: Reservation | None = None

    def reserve(self, cache: BlobCache, names: list[str], sizes: list[int]) -> list[int]:
        """Set buffers aside for a PUT of these blobs (instead of any set aside before):
        where each lies in the shared tier, -1 where memory has no room."""
        assert cache.arena is not None
        if self.reserved is not None:
            self.reserved.release()
        self.reserved = Reservation.make(cache, names, sizes)
        return self.reserved.offsets(cache.arena)

    def commit(self, cache: BlobCache, names: list[str], sizes: list[int]) -> tuple[int, int]:
        """Store what was reserved for these very blobs: ``(blobs reserved, stored)``.

        Raises:
            ShmRefError: nothing was reserved, or for other names or sizes.
        """
        reserved, self.reserved = self.reserved, None
        if reserved is None:
            raise ShmRefError("a commit without a reservation")
        try:
            if (reserved.names, reserved.sizes) != (names, sizes):
                raise ShmRefError("a commit of blobs other than those reserved")
            return reserved.commit(cache, self.namespace)
        finally:
            reserved.release()

    def end(self, leases: Leases | None) -> None:
        """Let go of what the connection holds in the memory tier."""
        if self.reserved is not None:
            self.reserved.release()
            self.reserved = None
        for lease in self.leases if leases is not None else ():
            leases.release(lease)  # those let go of already: nothing to do
        self.leases.clear()


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


@dataclass(slots=True)
class Reservation:
    """Memory-tier buffers set aside for a same-host client's PUT, one per blob (None
    where memory had no room), which the client fills itself through its mapping of the
    shared tier (``SharedArena``) before it commits them. Until then no reader sees them;
    after, a reader verifies them as any blob."""

    names: list[str]
    sizes: list[int]
    blobs: list[Received | None]

    @classmethod
    def make(cls, cache: BlobCache, names: list[str], sizes: list[int]) -> Reservation:
        objs = [cache.allocate(size) for size in sizes]
        return cls(
            names,
            sizes,
            [
                None if o is None else Received(view_of(o)[:s], o)
                for o, s in zip(objs, sizes, strict=True)
            ],
        )

    def offsets(self, arena: SharedArena) -> list[int]:
        """Where each buffer lies in the shared tier (-1: none)."""
        return [-1 if b is None or b.obj is None else arena.offset_of(b.obj) for b in self.blobs]

    def commit(self, cache: BlobCache, namespace: str) -> tuple[int, int]:
        """Store the filled buffers as they are: ``(blobs reserved, blobs stored)``."""
        kept = [(n, b) for n, b in zip(self.names, self.blobs, strict=True) if b is not None]
        return len(kept), sum(cache.put_received(namespace, n, b.obj, b.view) for n, b in kept)

    def release(self) -> None:
        let_go([b for b in self.blobs if b is not None])


def carries_blobs(frame: Frame, payload_len: int) -> bool:
    """Whether ``frame`` is a PUT whose blobs come in its payload of ``payload_len`` bytes
    (not by reference into shared memory)."""
    return frame.op == Op.PUT and payload_len > 0 and not {"shm", "pool"} & frame.header.keys()


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
        segment: SegmentFile | None,
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
            self._segment.write(offset, blob)
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
