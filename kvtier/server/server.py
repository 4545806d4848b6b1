"""``KVTierServer``: the asyncio TCP server behind ``kvtier serve``.

One coroutine per client connection reads frames (``protocol``), one at a time, and
answers each with one reply frame. The blob work (``kvtier.server.handlers``) runs on a
small thread pool (``BlobCache`` may touch the disk or a remote), so a slow disk never
stalls the event loop or the other clients. Blobs cross the socket without copies of
the server's own (``kvtier.server.sockets``, ``kvtier.server.transfer``): a PUT's blobs
are read straight into memory-tier buffers, and a GET is sent from the buffers the blobs
are kept in.

NOTE: a connection that sends anything the protocol forbids — a bad magic, another
version, an unknown op, a frame over the size limit, a header that is not a CBOR map, a
wrong token, a request before HELLO — gets one error reply and is closed: the stream
cannot be trusted past that point. It is counted under ``rejects`` (each reason logged
once, not per connection) and never touches another connection. Nothing is allocated
for a connection before its HELLO but that frame (at most ``MAX_HELLO_HEADER_BYTES``, no
payload), which must arrive within ``frame_timeout_s`` of connecting; after it, a
connection may idle between frames for ``idle_timeout_s`` (then it is closed, counted
under ``connections_idle_closed``: the client dials again when it next needs one), but a
frame once begun must arrive whole within ``frame_timeout_s``. So a client that stalls
or idles holds its slot among ``max_clients`` for a bounded time. A slot is taken by a
valid HELLO, not by connecting: connections yet to send theirs (or being refused) are at
most ``max_clients`` too, and a new one closes one refused already, else the one waiting
longest (counted under ``rejects_crowded_out``), so sockets that never say HELLO, or
clients without the token dialling in a loop, cannot keep out a client that says it at
once. A request whose frame
is well formed but whose fields are wrong (names that are not strings, sizes that do not
add up, more than ``max_names`` names) is an error reply on a connection that stays open.

Memory is bounded whatever clients do: the blob tiers by their sizes, and what is in
flight by ``max_clients`` frames of at most ``max_frame_bytes`` each; the work of one
request by its ``max_names`` names. The HELLO reply announces these limits, so clients
split their batches to fit and leave connections that idled too long.

Same host: a client may offer a shared-memory segment in its HELLO (``shm``); once the
server has opened it, that connection's PUT and GET frames may carry ``(offset, size)``
references into the segment instead of payload bytes, and the server copies between
the segment and its memory tier directly. A reference outside the segment (or on a
connection without one) is an error reply, counted under ``rejects_bad_shm_ref``; the
segment is closed when its connection ends. See ``kvtier.server.shm``.

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
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.observability.stats import Stats
from kvtier.server import shm, sockets
from kvtier.server.cache import BlobCache
from kvtier.server.handlers import RequestHandlers
from kvtier.server.leases import Leases
from kvtier.server.nixl import NixlPlane
from kvtier.server.shm import ShmRefused
from kvtier.server.transfer import Received, Reply, Session, carries_blobs, let_go
from kvtier.storage import node_protocol as protocol
from kvtier.storage.node_protocol import Frame, Op, ProtocolError, TooManyNames

logger = logging.getLogger(__name__)

FRAME_READ_TIMEOUT_S = 60.0  # the most a started frame (or a HELLO) may take to arrive
LEASE_SWEEP_S = 1.0  # how often leases past their time are let go of
MAX_HELLO_HEADER_BYTES = 64 << 10  # a token, a namespace and a shared-memory offer
# The counters of requests, bytes, gets and puts (docs/server.md): exported from the start,
# at 0 until something happens.
COUNTERS = (
    "connections",
    "connections_idle_closed",
    "requests",
    "request_errors",
    "rejects",
    "bytes_in",
    "bytes_out",
    "get_hits",
    "get_misses",
    "puts",
    "puts_refused",
)


class NotAHello(ProtocolError):
    """A connection's first frame is not a HELLO of the size one can have."""


class IdleConnection(Exception):
    """An authenticated connection sent nothing for the server's idle timeout."""


class KVTierServer:
    """Serve ``cache`` on ``host:port`` (port 0: any free port; see ``port`` once started).

    Args:
        cache: the blob tiers.
        stats: the server's counters (shared with the admin API).
        token: the token every client must send in HELLO, or None for none.
        max_frame_bytes: the largest payload accepted in a frame (and sent in a reply).
        max_clients: connections past their HELLO held at once (the HELLO of one more
            is answered with an error naming the limit), and connections before it.
        frame_timeout_s: the most a frame may take to arrive once begun, and a new
            connection to send its HELLO.
        idle_timeout_s: the most an authenticated connection may wait between frames
            before the server closes it (0: for ever).
        max_names: the most names one request may carry.
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
        frame_timeout_s: float = FRAME_READ_TIMEOUT_S,
        idle_timeout_s: float = protocol.DEFAULT_IDLE_TIMEOUT_S,
        max_names: int = protocol.DEFAULT_MAX_NAMES,
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
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_names = max_names
        self._logged: set[str] = set()  # the reasons of rejects logged already
        self.max_shm_bytes = max_shm_bytes
        self.leases = leases
        self.clients = 0  # connections past their HELLO
        # connections yet to send their HELLO, oldest first: whether each was refused
        self._greeting: dict[asyncio.Task, bool] = {}
        self.shm_clients = 0
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task] = []
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvtier-server-io")
        self._handlers = RequestHandlers(
            cache,
            stats,
            max_frame_bytes=max_frame_bytes,
            max_names=max_names,
            plane=plane,
            leases=leases,
            open_plane=open_plane,
            snapshot=self.snapshot,
        )

    @property
    def plane(self) -> NixlPlane | None:
        """The NIXL plane peers read the memory pool through, once set up (None: none)."""
        return self._handlers.plane

    async def start(self) -> None:
        self._listeners = sockets.listen(self.host, self.port)
        self.port = self._listeners[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        self._accepting = [loop.create_task(self._accept(sock)) for sock in self._listeners]
        if self.leases is not None:
            self._accepting.append(loop.create_task(self._expire_leases()))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let requests being executed finish (up to ``grace_s``), close
        every connection. A request still arriving is dropped whole: nothing is stored
        from a frame that was not received completely."""
        for task in self._accepting:
            task.cancel()
        for sock in self._listeners:
            sock.close()
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        for task in list(self._tasks):
            task.cancel()  # its coroutine closes its connection
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=grace_s)
        self._pool.shutdown(wait=True)

    async def _expire_leases(self) -> None:
        """Let go of leases past their time, whether or not a request comes: a client
        that leases blobs and never releases them pins their memory (where a PUT finds
        no room) for ``ttl_s`` and ``LEASE_SWEEP_S`` at most."""
        assert self.leases is not None
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            self.leases.expire()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, a connection reset meanwhile
                logger.warning("kvtier server: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve_client(sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- one connection ----------------------------------------------------------------

    async def _serve_client(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._greeting[task] = False
        if len(self._greeting) > self.max_clients:  # one refused already, else the oldest
            answered = (waiting for waiting, refused in self._greeting.items() if refused)
            victim = next(answered, next(iter(self._greeting)))
            if not self._greeting.pop(victim):
                self._reject("crowded_out", "a connection sent no HELLO while new ones came")
            victim.cancel()
        with sock:
            try:
                sockets.tune(sock)
                await self._converse(sock)
            except ConnectionError:
                pass
            finally:
                self._greeting.pop(task, None)

    async def _converse(self, sock: socket.socket) -> None:
        """Frames and their answers until the client goes away or breaks the protocol."""
        self.stats.inc("connections")
        session: Session | None = None
        try:
            while True:
                try:
                    frame, blobs = await self._read_frame(sock, session)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away (between or inside a frame)
                except IdleConnection:
                    self.stats.inc("connections_idle_closed")
                    logger.debug(
                        "kvtier server: closed a connection idle for %gs", self.idle_timeout_s
                    )
                    return
                except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11
                    self._reject("timeout", "a frame took too long to arrive")
                    return
                except NotAHello as exc:
                    await self._fail(sock, 0, "unauthenticated", str(exc))
                    return
                except ProtocolError as exc:
                    await self._fail(sock, 0, "malformed", str(exc))
                    return
                if session is None:
                    try:
                        namespace = self._hello(frame)
                    except NotAHello as exc:
                        await self._fail(sock, frame.request_id, "unauthenticated", str(exc))
                        return
                    if self.clients >= self.max_clients:
                        detail = (
                            f"more than {self.max_clients} clients (kvtier serve --max-clients)"
                        )
                        await self._fail(sock, frame.request_id, "too_many_clients", detail)
                        return
                    task = asyncio.current_task()
                    if task not in self._greeting:  # closed to make room meanwhile
                        return
                    del self._greeting[task]
                    self.clients += 1
                    session = Session(namespace, peer=frame.header.get("peer") is True)
                    reply = {
                        "max_frame": self.max_frame_bytes,
                        "max_names": self.max_names,
                        "idle_timeout_s": self.idle_timeout_s,
                        "version": protocol.VERSION,
                        "ops": [int(op) for op in protocol.Op],
                    }
                    if "shm" in frame.header:
                        reply |= await self._attach(session, frame.header["shm"])
                    await self._send(sock, frame, Reply(reply))
                    continue
                await self._answer(sock, frame, session, blobs)
        finally:
            if session is not None:
                self.clients -= 1
                session.end(self.leases)
            if session is not None and session.segment is not None:
                session.segment.close()
                self.shm_clients -= 1

    async def _read_frame(
        self, sock: socket.socket, session: Session | None
    ) -> tuple[Frame, list[Received] | None]:
        """The next frame. An inline PUT's blobs go straight into memory-tier buffers (the
        returned ``Received``, which the caller stores or releases); any other payload
        into one buffer of its own.

        An authenticated connection waits for a frame's first bytes up to
        ``idle_timeout_s``; from there (from connecting, for the HELLO) the frame has
        ``frame_timeout_s``.

        Raises:
            NotAHello: the first frame is not a HELLO, or too large for one.
            IdleConnection: no frame began within ``idle_timeout_s``.
        """
        loop = asyncio.get_running_loop()
        head = bytearray(protocol.PREFIX_SIZE)
        rest = memoryview(head)
        if session is not None:
            try:
                got = await asyncio.wait_for(
                    loop.sock_recv_into(sock, rest), self.idle_timeout_s or None
                )
            except (TimeoutError, asyncio.TimeoutError):
                raise IdleConnection from None
            if got == 0:
                raise asyncio.IncompleteReadError(b"", protocol.PREFIX_SIZE)
            rest = rest[got:]
        # wait_for: Python 3.10 has no asyncio.timeout
        frame, blobs = await asyncio.wait_for(
            self._read_rest(loop, sock, session, head, rest), self.frame_timeout_s
        )
        return frame, blobs

    async def _read_rest(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        session: Session | None,
        head: bytearray,
        rest: memoryview,
    ) -> tuple[Frame, list[Received] | None]:
        await sockets.recv_exactly(loop, sock, rest)
        prefix = protocol.decode_prefix(head, self.max_frame_bytes)
        if session is None and (
            prefix.op != Op.HELLO
            or prefix.payload_len
            or prefix.header_len > MAX_HELLO_HEADER_BYTES
        ):
            raise NotAHello(
                f"bad HELLO: a connection starts with a HELLO of at most "
                f"{MAX_HELLO_HEADER_BYTES} header bytes and no payload, not "
                f"{prefix.op.name} of {prefix.header_len} + {prefix.payload_len} bytes"
            )
        raw = bytearray(prefix.header_len)
        await sockets.recv_exactly(loop, sock, memoryview(raw))
        frame = Frame(prefix.op, prefix.request_id, protocol.decode_header(raw))
        blobs = self._receivers(frame, session, prefix.payload_len)
        try:
            if blobs is None:
                payload = bytearray(prefix.payload_len)
                await sockets.recv_exactly(loop, sock, memoryview(payload))
                frame.payload = payload
            else:
                for blob in blobs:
                    await sockets.recv_exactly(loop, sock, blob.view)
        except BaseException:
            let_go(blobs)
            raise
        self.stats.inc("bytes_in", protocol.PREFIX_SIZE + prefix.header_len + prefix.payload_len)
        return frame, blobs

    def _receivers(
        self, frame: Frame, session: Session | None, payload_len: int
    ) -> list[Received] | None:
        """Where an inline PUT's blobs go as they arrive: a memory-tier buffer each (a
        scratch one where memory has no room), or None for any other frame, or one
        whose fields are wrong (its handler answers the error)."""
        if session is None or not carries_blobs(frame, payload_len):
            return None
        try:
            names = protocol.names_of(frame.header, self.max_names)
            sizes = protocol.sizes_of(frame.header, len(names), payload_len, absent_ok=False)
        except ProtocolError:
            return None
        return [Received.allocate(self.cache, size) for size in sizes]

    def _hello(self, frame: Frame) -> str:
        """The namespace a valid HELLO with the right token declares.

        Raises:
            NotAHello: not one (the message says why, never what the token should be).
        """
        token = frame.header.get("token")
        if self._token is not None and not (
            isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)
        ):
            raise NotAHello("bad HELLO: a wrong or missing token")
        namespace = frame.header.get("namespace")
        if not protocol.valid_namespace(namespace):
            raise NotAHello(
                f"bad HELLO: 'namespace' must be 1 to {protocol.MAX_NAMESPACE_CHARS} "
                "characters without '/' or NUL"
            )
        return namespace

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
        arena = self.cache.arena if self.leases is not None else None
        return {"shm": True} if arena is None else {"shm": True, "pool": arena.offer()}

    async def _answer(
        self, sock: socket.socket, frame: Frame, session: Session, blobs: list[Received] | None
    ) -> None:
        if not self._handlers.knows(frame.op):  # a second HELLO
            let_go(blobs)
            await self._fail(sock, frame.request_id, "malformed", f"unexpected {frame.op.name}")
            raise ConnectionError
        self.stats.inc("requests")
        self.stats.inc(f"requests_{frame.op.name.lower()}")
        self._in_flight += 1
        self._idle.clear()
        try:
            loop = asyncio.get_running_loop()
            if blobs is None:
                reply = await loop.run_in_executor(
                    self._pool, self._handlers.answer, frame, session
                )
            else:
                reply = await loop.run_in_executor(
                    self._pool, self._handlers.put_received, frame, session, blobs
                )
        except ProtocolError as exc:
            self.stats.inc("request_errors")
            if isinstance(exc, shm.ShmRefError):
                self._reject("bad_shm_ref", str(exc))
            elif isinstance(exc, TooManyNames):
                self._reject("too_many_names", str(exc))
            reply = Reply({"error": str(exc)})
        finally:
            let_go(blobs)
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        try:
            await self._send(sock, frame, reply)
        finally:
            for obj in reply.held:
                obj.ref_down()

    async def _send(self, sock: socket.socket, frame: Frame, reply: Reply) -> None:
        parts = protocol.encode(
            frame.op, frame.request_id, reply.header, reply.parts, flags=protocol.REPLY
        )
        self.stats.inc("bytes_out", sum(len(p) for p in parts))
        await sockets.send_parts(asyncio.get_running_loop(), sock, parts)

    def _reject(self, reason: str, detail: str) -> None:
        """Count a rejected frame or connection; log the first of each ``reason`` (a
        client that repeats it must not flood the log: the counter says how often)."""
        self.stats.inc("rejects")
        self.stats.inc(f"rejects_{reason}")
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(
                "kvtier server: rejected a frame (%s): %s (more of these are counted in "
                "rejects_%s, not logged)",
                reason,
                detail,
                reason,
            )

    async def _fail(self, sock: socket.socket, request_id: int, reason: str, detail: str) -> None:
        """Count a rejected frame, answer it with an error and let the caller close."""
        self._reject(reason, detail)
        task = asyncio.current_task()
        if task in self._greeting:  # answered: the first to make room for a new one
            self._greeting[task] = True
        error = {"error": f"{reason}: {detail}"}
        parts = protocol.encode(Op.PING, request_id, error, flags=protocol.REPLY)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            await sockets.send_parts(loop, sock, parts)
            await sockets.linger(loop, sock)

    def snapshot(self) -> dict[str, float]:
        """Every counter and gauge (thread-safe: the admin API reads it)."""
        return {
            **dict.fromkeys(COUNTERS, 0.0),
            **self.stats.snapshot(),
            **self.cache.gauges(),
            "clients_connected": self.clients,
            "shm_clients_connected": self.shm_clients,
        }
