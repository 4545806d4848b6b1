"""``KVTierServer``: the asyncio TCP server behind ``kvtier serve``.

One coroutine per client connection reads frames (``protocol``), one at a time, and
answers each with one reply frame. The blob work runs on a small thread pool
(``BlobCache`` may touch the disk or a remote), so a slow disk never stalls the event
loop or the other clients.

NOTE: a connection that sends anything the protocol forbids — a bad magic, another
version, an unknown op, a frame over the size limit, a header that is not a CBOR map, a
wrong token, a request before HELLO — gets one error reply and is closed: the stream
cannot be trusted past that point. It is counted under ``rejects`` and never touches
another connection. A request whose frame is well formed but whose fields are wrong
(names that are not strings, sizes that do not add up) is an error reply on a
connection that stays open.

Memory is bounded whatever clients do: the blob tiers by their sizes, and what is in
flight by ``max_clients`` frames of at most ``max_frame_bytes`` each.

Same host: a client may offer a shared-memory segment in its HELLO (``shm``); once the
server has mapped it, that connection's PUT and GET frames may carry ``(offset, size)``
references into the segment instead of payload bytes, and the server copies between
the segment and its memory tier directly. A reference outside the segment (or on a
connection without one) is an error reply, counted under ``rejects_bad_shm_ref``; the
segment is unmapped when its connection ends. See ``kvtier.server.shm``.

Peers: a HELLO with ``peer: true`` comes from another server (``kvtier.server.peers``):
its EXISTS and GET are answered from this server's memory and disk only, and it may ask
for this server's NIXL handshake (PEER) and lease blobs for one-sided reads (LEASE,
RELEASE; ``kvtier.server.leases``). Without NIXL, PEER and LEASE answer ``nixl: false``
with the reason, and the peer pulls with GET.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.observability.stats import Stats
from kvtier.server import shm
from kvtier.server.cache import BlobCache
from kvtier.server.leases import Leases
from kvtier.server.nixl import NixlPlane
from kvtier.server.shm import ShmRefused
from kvtier.storage import node_protocol as protocol
from kvtier.storage.node_protocol import Frame, Op, ProtocolError
from kvtier.storage.node_shm import Segment

logger = logging.getLogger(__name__)

FRAME_READ_TIMEOUT_S = 60.0  # the most a started frame may take to arrive


@dataclass(slots=True)
class Session:
    """One authenticated connection: its namespace and its shared-memory segment."""

    namespace: str
    segment: Segment | None = None
    peer: bool = False  # another server: never passed on to this server's peers


class KVTierServer:
    """Serve ``cache`` on ``host:port`` (port 0: any free port; see ``port`` once started).

    Args:
        cache: the blob tiers.
        stats: the server's counters (shared with the admin API).
        token: the token every client must send in HELLO, or None for none.
        max_frame_bytes: the largest payload accepted in a frame (and sent in a reply).
        max_clients: connections held at once; more are closed at once (counted).
        max_shm_bytes: the largest shared-memory segment a client may offer; 0 turns the
            same-host path off (every client stays on TCP).
        plane: the NIXL plane peers read the memory pool through (None: no NIXL).
        open_plane: called at the first peer handshake when ``plane`` is None, for the
            plane then (None: no NIXL).
        leases: the leases of those reads (with ``plane``).
    """

    def __init__(
        self,
        cache: BlobCache,
        stats: Stats,
        *,
        host: str,
        port: int,
        token: str | None,
        max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES,
        max_clients: int = 256,
        max_shm_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES,
        plane: NixlPlane | None = None,
        leases: Leases | None = None,
        open_plane: Callable[[], NixlPlane | None] | None = None,
    ):
        self.cache = cache
        self.stats = stats
        self.host = host
        self.port = port
        self._token = token.encode() if token else None
        self.max_frame_bytes = max_frame_bytes
        self.max_clients = max_clients
        self.max_shm_bytes = max_shm_bytes
        self.plane = plane
        self.leases = leases
        self._open_plane = open_plane
        self.clients = 0
        self.shm_clients = 0
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvtier-server-io")

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve_client, self.host, self.port, limit=2**20
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let requests being executed finish (up to ``grace_s``), close
        every connection. A request still arriving is dropped whole: nothing is stored
        from a frame that was not received completely."""
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        for writer in list(self._writers):
            writer.close()  # its coroutine sees the end of the stream and returns
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=grace_s)
        self._pool.shutdown(wait=True)

    # -- one connection ----------------------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if self.clients >= self.max_clients:
            self._reject("too_many_clients", f"more than {self.max_clients} clients")
            writer.close()
            return
        self.clients += 1
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.stats.inc("connections")
        session: Session | None = None
        try:
            while True:
                try:
                    frame = await self._read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away (between or inside a frame)
                except TimeoutError:
                    self._reject("timeout", "a frame took too long to arrive")
                    return
                except ProtocolError as exc:
                    await self._fail(writer, 0, "malformed", str(exc))
                    return
                if session is None:
                    namespace = self._hello(frame)
                    if namespace is None:
                        await self._fail(writer, frame.request_id, "unauthenticated", "bad HELLO")
                        return
                    session = Session(namespace, peer=frame.header.get("peer") is True)
                    reply = {"max_frame": self.max_frame_bytes, "version": protocol.VERSION}
                    if "shm" in frame.header:
                        reply |= await self._attach(session, frame.header["shm"])
                    await self._send(writer, frame, reply, ())
                    continue
                await self._answer(writer, frame, session)
        except ConnectionError:
            pass
        finally:
            if session is not None and session.segment is not None:
                session.segment.close()
                self.shm_clients -= 1
            self.clients -= 1
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _read_frame(self, reader: asyncio.StreamReader) -> Frame:
        head = await reader.readexactly(protocol.PREFIX_SIZE)
        prefix = protocol.decode_prefix(head, self.max_frame_bytes)
        async with asyncio.timeout(FRAME_READ_TIMEOUT_S):
            header = await reader.readexactly(prefix.header_len)
            payload = await reader.readexactly(prefix.payload_len)
        self.stats.inc("bytes_in", len(head) + len(header) + len(payload))
        return Frame(prefix.op, prefix.request_id, protocol.decode_header(header), payload)

    def _hello(self, frame: Frame) -> str | None:
        """The namespace a HELLO declares, or None (counted) when it is not a valid HELLO
        with the right token."""
        if frame.op != Op.HELLO:
            return None
        token = frame.header.get("token")
        if self._token is not None and not (
            isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)
        ):
            logger.warning("kvtier server: a client sent a wrong token; connection closed")
            return None
        namespace = frame.header.get("namespace")
        return namespace if protocol.valid_namespace(namespace) else None

    async def _attach(self, session: Session, offer: object) -> dict[str, Any]:
        """Map the segment a HELLO offers; the HELLO reply's ``shm`` fields. A refusal
        (off, malformed, too large, another host's) is counted and leaves the client on
        TCP."""
        try:
            if not self.max_shm_bytes:
                raise ShmRefused("disabled: the server runs with --no-shm")
            try:
                parsed = shm.offer_of(offer)
            except ProtocolError as exc:
                raise ShmRefused(f"malformed: {exc}") from None
            loop = asyncio.get_running_loop()
            segment = await loop.run_in_executor(
                self._pool, shm.attach_segment, parsed, self.max_shm_bytes
            )
        except ShmRefused as exc:
            reason = str(exc).partition(":")[0]
            self.stats.inc("shm_refused")
            self.stats.inc(f"shm_refused_{reason}")
            logger.info("kvtier server: a client's shared memory was refused (%s)", exc)
            return {"shm": False, "shm_error": str(exc)}
        session.segment = segment
        self.shm_clients += 1
        self.stats.inc("shm_attached")
        return {"shm": True}

    async def _answer(self, writer: asyncio.StreamWriter, frame: Frame, session: Session) -> None:
        handler = _HANDLERS.get(frame.op)
        if handler is None:  # a second HELLO
            await self._fail(writer, frame.request_id, "malformed", f"unexpected {frame.op.name}")
            raise ConnectionError
        self.stats.inc("requests")
        self.stats.inc(f"requests_{frame.op.name.lower()}")
        self._in_flight += 1
        self._idle.clear()
        try:
            loop = asyncio.get_running_loop()
            header, parts = await loop.run_in_executor(self._pool, handler, self, frame, session)
        except ProtocolError as exc:
            self.stats.inc("request_errors")
            if isinstance(exc, shm.ShmRefError):
                self._reject("bad_shm_ref", str(exc))
            header, parts = {"error": str(exc)}, ()
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        await self._send(writer, frame, header, parts)

    async def _send(self, writer, frame: Frame, header: dict[str, Any], parts) -> None:
        data = protocol.encode(frame.op, frame.request_id, header, parts, flags=protocol.REPLY)
        self.stats.inc("bytes_out", sum(len(p) for p in data))
        writer.writelines(data)
        await writer.drain()

    def _reject(self, reason: str, detail: str) -> None:
        self.stats.inc("rejects")
        self.stats.inc(f"rejects_{reason}")
        logger.info("kvtier server: rejected a frame (%s): %s", reason, detail)

    async def _fail(self, writer, request_id: int, reason: str, detail: str) -> None:
        """Count a rejected frame, answer it with an error and let the caller close."""
        self._reject(reason, detail)
        error = {"error": f"{reason}: {detail}"}
        data = protocol.encode(Op.PING, request_id, error, flags=protocol.REPLY)
        with contextlib.suppress(ConnectionError):
            writer.writelines(data)
            await writer.drain()

    # -- requests (on the thread pool) -------------------------------------------------

    def _ping(self, frame: Frame, session: Session):
        return {}, ()

    def _exists(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header)
        present = self.cache.exists_many(session.namespace, names, peers=not session.peer)
        return {"present": present}, ()

    def _get(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header)
        region = None
        if "shm" in frame.header:
            region = shm.region_of(frame.header["shm"], session.segment)
        place = _Placement(session.segment, region, self.max_frame_bytes)
        found = self.cache.read_many(session.namespace, names, place.take, peers=not session.peer)
        sizes = [size for size, _ in (f or (-1, -1) for f in found)]
        offsets = [offset for _, offset in (f or (-1, -1) for f in found)]
        hits = sum(s >= 0 for s in sizes)
        self.stats.inc("get_hits", hits)
        self.stats.inc("get_misses", len(names) - hits)
        self.stats.inc("bytes_shm_out", place.shm_bytes)
        header: dict[str, Any] = {"sizes": sizes}
        if region is not None:
            header["shm"] = offsets
        return header, place.parts

    def _put(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header)
        if "shm" in frame.header:
            sizes = protocol.sizes_of(frame.header, len(names), None, absent_ok=False)
            if frame.payload:
                raise shm.ShmRefError("a PUT with shm references carries no payload")
            extents = shm.extents_of(frame.header["shm"], sizes, session.segment)
            assert session.segment is not None
            with memoryview(session.segment.mm) as view:
                blobs = [view[offset : offset + size] for offset, size in extents]
                try:
                    stored = self._store(session.namespace, names, blobs)
                finally:  # no view of the segment may outlive the request: it blocks unmap
                    for blob in blobs:
                        blob.release()
            self.stats.inc("bytes_shm_in", sum(sizes))
        else:
            sizes = protocol.sizes_of(frame.header, len(names), len(frame.payload), absent_ok=False)
            stored = self._store(
                session.namespace, names, protocol.split_payload(frame.payload, sizes)
            )
        self.stats.inc("puts", stored)
        self.stats.inc("puts_refused", len(names) - stored)
        return {"stored": stored}, ()

    def _store(self, namespace: str, names: list[str], blobs) -> int:
        return sum(
            self.cache.put(namespace, name, blob)
            for name, blob in zip(names, blobs, strict=True)
            if blob is not None
        )

    def _delete(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header)
        return {"deleted": self.cache.delete(session.namespace, names)}, ()

    def _clear(self, frame: Frame, session: Session):
        return {"deleted": self.cache.clear(session.namespace)}, ()

    def _peer(self, frame: Frame, session: Session):
        if self.plane is None and self._open_plane is not None:
            # a server without peers of its own sets up NIXL when a peer first asks
            # (a fraction of a second, once), not at start
            self.plane, self._open_plane = self._open_plane(), None
        if self.plane is None:
            return _NO_NIXL, ()
        return self.plane.handshake(), ()

    def _lease(self, frame: Frame, session: Session):
        names = protocol.names_of(frame.header)
        if self.plane is None or self.leases is None:
            return _NO_NIXL, ()
        objs = self.cache.lease(session.namespace, names)
        held = [obj for obj in objs if obj is not None]
        lease = self.leases.grant(held)
        self.plane.wake()
        self.stats.inc("peer_leases")
        self.stats.inc("peer_leased_blobs", len(held))
        return {
            "lease": lease,
            "agent": self.plane.name,
            "epoch": self.plane.epoch,
            "sizes": [-1 if obj is None else obj.data_nbytes - 1 for obj in objs],
            "offsets": [-1 if obj is None else obj.offset for obj in objs],
        }, ()

    def _release(self, frame: Frame, session: Session):
        lease = frame.header.get("lease")
        if type(lease) is not int or self.leases is None:
            raise ProtocolError("'lease' must be an integer")
        return {"held": self.leases.release(lease)}, ()

    def _stats(self, frame: Frame, session: Session):
        return self.snapshot(), ()

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge (thread-safe: the admin API reads it)."""
        return {
            **self.stats.snapshot(),
            **self.cache.gauges(),
            "clients_connected": self.clients,
            "shm_clients_connected": self.shm_clients,
        }


class _Placement:
    """Where a GET reply puts each blob: into the client's region of its segment while it
    fits, else into the frame's payload while that fits (a copy), else nowhere (-1, a
    miss). ``take`` is called with each blob's view while the cache holds it pinned."""

    def __init__(self, segment: Segment | None, region: tuple[int, int] | None, room: int):
        self._segment = segment
        self._next, self._end = (0, 0) if region is None else (region[0], sum(region))
        self._room = room
        self.parts: list[bytes] = []
        self.shm_bytes = 0

    def take(self, blob: memoryview) -> tuple[int, int]:
        """``(size, offset in the segment or -1)``; ``(-1, -1)`` when it fits nowhere."""
        size = len(blob)
        if self._segment is not None and self._next + size <= self._end:
            offset = self._next
            self._segment.mm[offset : offset + size] = blob
            self._next += size
            self.shm_bytes += size
            return size, offset
        if size <= self._room:
            self.parts.append(bytes(blob))
            self._room -= size
            return size, -1
        return -1, -1


_NO_NIXL = {"nixl": False, "reason": "the peer runs without NIXL"}
_Handler = Callable[[KVTierServer, Frame, Session], tuple[dict[str, Any], Any]]
_HANDLERS: dict[Op, _Handler] = {
    Op.PING: KVTierServer._ping,
    Op.EXISTS: KVTierServer._exists,
    Op.GET: KVTierServer._get,
    Op.PUT: KVTierServer._put,
    Op.DELETE: KVTierServer._delete,
    Op.CLEAR: KVTierServer._clear,
    Op.STATS: KVTierServer._stats,
    Op.PEER: KVTierServer._peer,
    Op.LEASE: KVTierServer._lease,
    Op.RELEASE: KVTierServer._release,
}
