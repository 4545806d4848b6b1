"""What ``kvtier serve`` does for each request: ``RequestHandlers``, one handler per op,
each turning a well-formed frame of an authenticated connection into its reply.

``KVTierServer`` reads the frames and sends the replies on its event loop and runs these
handlers on its thread pool (``BlobCache`` may touch the disk, a remote or a peer). A
handler raises ``ProtocolError`` for a frame whose fields are wrong (an error reply on a
connection that stays open), ``ShmRefError`` for a bad reference into shared memory.

Peers: EXISTS and GET from another server (``Session.peer``) are answered from this
server's memory and disk only; PEER hands out this server's NIXL handshake, LEASE and
RELEASE pin and unpin blobs for one-sided reads (``kvtier.server.leases``); CORRUPT drops
the named blobs whose copies here fail their checksum (``kvtier.server.blobs.drop_corrupt``),
a peer's report of a corrupt pull, so no puller finds them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.observability.stats import Stats
from kvtier.server import shm
from kvtier.server.blobs import drop_corrupt, view_of
from kvtier.server.cache import BlobCache
from kvtier.server.leases import Leases
from kvtier.server.nixl import NixlPlane
from kvtier.server.transfer import Placement, Received, Reply, Session, let_go, take_data
from kvtier.storage import node_protocol as protocol
from kvtier.storage.node_protocol import Frame, Op, ProtocolError


class RequestHandlers:
    """The reply to each request op on ``cache`` (thread-safe: the server's pool runs them).

    Args:
        cache: the blob tiers.
        stats: the server's counters.
        max_frame_bytes: the largest payload sent in a reply.
        max_names: the most names one request may carry (more: ``TooManyNames``).
        plane: the NIXL plane peers read the memory pool through (None: no NIXL).
        leases: the leases of those reads (with ``plane``).
        open_plane: called at the first PEER or LEASE when ``plane`` is None, for the
            plane then (None: no NIXL).
        snapshot: the server's counters and gauges (the STATS reply).
    """

    def __init__(
        self,
        cache: BlobCache,
        stats: Stats,
        *,
        max_frame_bytes: int,
        max_names: int,
        plane: NixlPlane | None,
        leases: Leases | None,
        open_plane: Callable[[], NixlPlane | None] | None,
        snapshot: Callable[[], dict[str, float]],
    ):
        self.cache = cache
        self.stats = stats
        self.max_frame_bytes = max_frame_bytes
        self.max_names = max_names
        self.plane = plane
        self.leases = leases
        self._open_plane = open_plane
        self._snapshot = snapshot

    def knows(self, op: Op) -> bool:
        """Whether ``op`` is a request (HELLO is not: it opens a connection)."""
        return op in _HANDLERS

    def answer(self, frame: Frame, session: Session) -> Reply:
        """The reply to ``frame`` (its op one that ``knows``).

        Raises:
            ProtocolError: the frame's fields are wrong (``ShmRefError``: its references
                into shared memory).
        """
        return _HANDLERS[frame.op](self, frame, session)

    def _ping(self, frame: Frame, session: Session):
        return Reply({})

    def _exists(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        others = not session.peer  # a peer's request: this server's memory and disk only
        present = self.cache.exists_many(session.namespace, names, peers=others, remote=others)
        return Reply({"present": present})

    def _get(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        region = None
        if "shm" in frame.header:
            region = shm.region_of(frame.header["shm"], session.segment)
        lend = frame.header.get("pool") is True and session.segment is not None
        arena = self.cache.arena if lend and self.leases is not None else None
        place = Placement(session.segment, region, self.max_frame_bytes, arena)
        # blobs in memory are lent where they lie or sent from their own buffers, held
        # until sent; the rest (disk, peers, remote) are read into bytes of their own
        held = self.cache.hold_many(session.namespace, names)
        missing = [name for name, obj in zip(names, held, strict=True) if obj is None]
        others = not session.peer  # a peer's request: this server's memory and disk only
        fetched = iter(
            self.cache.read_many(session.namespace, missing, bytes, peers=others, remote=others)
        )
        found = [
            place.take(view_of(obj), obj) if obj is not None else take_data(place, next(fetched))
            for obj in held
        ]
        sizes = [size for size, _ in found]
        hits = sum(s >= 0 for s in sizes)
        self.stats.inc("get_hits", hits)
        self.stats.inc("get_misses", len(names) - hits)
        self.stats.inc("bytes_shm_out", place.shm_bytes)
        header: dict[str, Any] = {"sizes": sizes}
        if region is not None:
            header["shm"] = [offset for _, offset in found]
        if arena is not None and self.leases is not None:
            self.leases.expire()  # one past its time (a client stuck mid-copy) lets go here
            header["pool"], header["lease"] = place.lent_at, 0
            if place.lent:
                header["lease"] = self.leases.grant(place.lent)
                session.leases.add(header["lease"])
        return Reply(header, place.parts, place.held)

    def _put(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        if "pool" in frame.header:
            return self._put_in_place(frame, session, names)
        if "shm" in frame.header:
            sizes = protocol.sizes_of(frame.header, len(names), None, absent_ok=False)
            if frame.payload:
                raise shm.ShmRefError("a PUT with shm references carries no payload")
            extents = shm.extents_of(frame.header["shm"], sizes, session.segment)
            assert session.segment is not None
            blobs = [Received.allocate(self.cache, size) for size in sizes]
            try:
                for blob, (offset, _) in zip(blobs, extents, strict=True):
                    session.segment.read_into(offset, blob.view)
                reply = self.put_received(frame, session, blobs)
            finally:
                let_go(blobs)
            self.stats.inc("bytes_shm_in", sum(sizes))
            return reply
        sizes = protocol.sizes_of(frame.header, len(names), len(frame.payload), absent_ok=False)
        stored = self._store(session.namespace, names, protocol.split_payload(frame.payload, sizes))
        return self._stored(len(names), stored)

    def _put_in_place(self, frame: Frame, session: Session, names: list[str]) -> Reply:
        """A same-host client's PUT into the shared memory tier (``Session.reserve``: the
        client writes its blobs there itself, then ``Session.commit`` stores them)."""
        sizes = protocol.sizes_of(frame.header, len(names), None, absent_ok=False)
        step = frame.header["pool"]
        if self.cache.arena is None or session.segment is None or frame.payload:
            raise shm.ShmRefError("a PUT into memory needs shared memory and no payload")
        if step == "reserve":
            return Reply({"pool": session.reserve(self.cache, names, sizes)})
        if step != "commit":
            raise shm.ShmRefError(
                f"'pool' must be 'reserve' or 'commit', not {protocol.shown(step)}"
            )
        count, stored = session.commit(self.cache, names, sizes)
        self.stats.inc("bytes_shm_in", sum(sizes))
        return self._stored(count, stored)

    def put_received(self, frame: Frame, session: Session, blobs: list[Received]) -> Reply:
        """A PUT whose blobs the server read straight into memory-tier buffers: kept as
        they are, not copied again."""
        names = protocol.names_of(frame.header, self.max_names)
        stored = sum(
            self.cache.put_received(session.namespace, name, blob.obj, blob.view)
            for name, blob in zip(names, blobs, strict=True)
        )
        return self._stored(len(names), stored)

    def _stored(self, count: int, stored: int) -> Reply:
        self.stats.inc("puts", stored)
        self.stats.inc("puts_refused", count - stored)
        return Reply({"stored": stored})

    def _store(self, namespace: str, names: list[str], blobs) -> int:
        return sum(
            self.cache.put(namespace, name, blob)
            for name, blob in zip(names, blobs, strict=True)
            if blob is not None
        )

    def _delete(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        return Reply({"deleted": self.cache.delete(session.namespace, names)})

    def _clear(self, frame: Frame, session: Session):
        return Reply({"deleted": self.cache.clear(session.namespace)})

    def _ready_plane(self) -> NixlPlane | None:
        """The NIXL plane; a server without peers of its own sets it up when a peer first
        asks for it (its first PEER or LEASE; a fraction of a second, once), not at start."""
        if self.plane is None and self._open_plane is not None:
            self.plane, self._open_plane = self._open_plane(), None
        return self.plane

    def _peer(self, frame: Frame, session: Session):
        plane = self._ready_plane()
        if plane is None:
            return Reply(_NO_NIXL)
        return Reply(plane.handshake())

    def _lease(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        if self._ready_plane() is None or self.leases is None:
            return Reply(_NO_NIXL)
        objs = self.cache.lease(session.namespace, names)
        held = [obj for obj in objs if obj is not None]
        lease = self.leases.grant(held)
        session.leases.add(lease)  # let go of when the connection ends
        self.plane.wake()
        self.stats.inc("peer_leases")
        self.stats.inc("peer_leased_blobs", len(held))
        return Reply(
            {
                "lease": lease,
                "agent": self.plane.name,
                "epoch": self.plane.epoch,
                "sizes": [-1 if obj is None else obj.data_nbytes - 1 for obj in objs],
                "offsets": [-1 if obj is None else obj.offset for obj in objs],
            }
        )

    def _release(self, frame: Frame, session: Session):
        lease = frame.header.get("lease")
        if type(lease) is not int or self.leases is None:
            raise ProtocolError("'lease' must be an integer")
        session.leases.discard(lease)
        return Reply({"held": self.leases.release(lease)})

    def _corrupt(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header, self.max_names)
        cache = self.cache
        dropped = sum(drop_corrupt(cache.memory, cache.disk, (session.namespace, n)) for n in names)
        self.stats.inc("corrupt_dropped", dropped)
        return Reply({"dropped": dropped})

    def _stats(self, frame: Frame, session: Session):
        return Reply(self._snapshot())


_NO_NIXL = {"nixl": False, "reason": "the peer runs without NIXL"}
_Handler = Callable[[RequestHandlers, Frame, Session], Reply]
_HANDLERS: dict[Op, _Handler] = {
    Op.PING: RequestHandlers._ping,
    Op.EXISTS: RequestHandlers._exists,
    Op.GET: RequestHandlers._get,
    Op.PUT: RequestHandlers._put,
    Op.DELETE: RequestHandlers._delete,
    Op.CLEAR: RequestHandlers._clear,
    Op.STATS: RequestHandlers._stats,
    Op.PEER: RequestHandlers._peer,
    Op.LEASE: RequestHandlers._lease,
    Op.RELEASE: RequestHandlers._release,
    Op.CORRUPT: RequestHandlers._corrupt,
}
