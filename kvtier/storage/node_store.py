"""The client of ``kvtier serve``: a ``BlobStore`` for ``remote_url: kvtier://host:port``
(and LMCache's spelling ``lm://host:port``, read the same way).

Each batched call is one request frame and one reply frame (``node_protocol``) on a pooled
TCP connection, or a few in a row where the batch has more names than the server takes in
one request (``max_names``, announced in its HELLO reply). A connection starts with
HELLO, which carries the token (``server_token``) and the namespace (the model), so the
server keeps this client's blobs apart from every other model's. ``RemoteTier`` wraps the store with timeouts, the
down state and reconnects (``open_blob_tier``); the store itself only turns every
failure into ``StoreUnavailable`` and drops its connections, so the next call (the
tier's reconnect ping) dials afresh. A pooled connection idle for half the server's
idle timeout (also in the HELLO reply) is closed here and another dialled, so a request
never goes out on a connection the server is closing.

Same host: each connection offers the server a shared-memory segment of its own in
HELLO (``kvtier.storage.node_shm``). When the server maps it, PUT and GET frames on that
connection carry ``(offset, size)`` references into the segment and the blobs never
cross the socket; when it does not (another host, ``kvtier serve --no-shm``, no
``/dev/shm``), the connection carries them inline, as before. Such a connection also maps
the server's memory tier where offered (``node_shm``): PUTs write their blobs into
buffers set aside there, GETs copy them straight out; one copy each instead of two. ``?shm=0`` in the URL turns
the offer off; ``?shm_mb=N`` sizes the segment (default 64 MiB; a blob larger than that
goes inline).

NOTE: ``lm://`` names LMCache's server *address*, not its protocol: an LMCache config
pointing at ``lm://host:65432`` works once ``kvtier serve --port 65432`` runs there; an
LMCache server does not answer this protocol.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier.config.node_address import DEFAULT_SEGMENT_BYTES, parse_server_address
from kvtier.storage import node_protocol as protocol
from kvtier.storage import node_shm as shm
from kvtier.storage.blob_store import Buffer, StoreUnavailable, batches
from kvtier.storage.node_connection import Connection, recv
from kvtier.storage.node_protocol import Op, ProtocolError
from kvtier.storage.node_shm import Arenas, Segment, shm_available
from kvtier.storage.remote import RemoteRequest, RemoteTier, open_blob_tier
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)
T = TypeVar("T")
READ_BATCH = 8  # blobs per read while reading the server's memory (``read_batch``)


class KVTierStore:
    """A ``BlobStore`` on a ``kvtier serve`` at ``host:port``.

    Args:
        namespace: the namespace every name lives in (the model); see ``protocol``.
        token: sent in HELLO (the server's ``--auth-token``), or None.
        timeout_s: connect timeout and the longest wait on one socket operation.
        max_connections: connections pooled (and calls running at once).
        shm: offer each connection a shared-memory segment (used when the server is on
            this host and maps it; else the connection stays on TCP).
        shm_bytes: the size of each connection's segment.
        peer: connect as another server (HELLO ``peer: true``): the server answers from
            its own memory and disk only, never asking its own peers.
    """

    name = "kvtier"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        namespace: str,
        token: str | None = None,
        timeout_s: float = 1.0,
        max_connections: int = 16,
        shm: bool = True,
        shm_bytes: int = DEFAULT_SEGMENT_BYTES,
        peer: bool = False,
    ):
        if not protocol.valid_namespace(namespace):
            raise ValueError(f"namespace {namespace!r}: 1 to 256 characters, no '/'")
        self.host, self.port = host, port
        self.url = f"kvtier://{host}:{port}"  # no options: as logs and errors name it
        self.namespace = namespace
        self._token = token
        self._timeout_s = timeout_s
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._ids = itertools.count(1)
        self._closed = False
        self._shm = shm and shm_available()
        self._shm_bytes = shm_bytes
        self._peer = peer
        self._arenas = Arenas()
        self.shm_active = False  # whether the latest connection got a segment
        # the most names per request, as the latest HELLO reply said (None: no limit, or
        # no connection yet); every batched call here keeps to it by itself
        self.max_names: int | None = None
        self._ops = protocol.UNANNOUNCED_OPS  # what the latest HELLO reply says it answers
        self._in_place = False  # whether it maps the server's memory tier

    # -- connections -------------------------------------------------------------------

    def _connect(self) -> Connection:
        sock = socket.create_connection((self.host, self.port), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, protocol.DEFAULT_MAX_FRAME_BYTES, self._arenas)
        hello: dict[str, Any] = {"token": self._token, "namespace": self.namespace}
        if self._peer:
            hello["peer"] = True
        offered = None
        try:
            if self._shm:
                try:
                    conn.segment, offered = shm.create_segment(self._shm_bytes)
                    hello["shm"] = offered.as_header()
                except OSError as exc:  # no room in /dev/shm: this connection uses TCP
                    warn_once(logger, f"kvtier server {self.url}: no shared memory ({exc})")
            try:
                reply, _ = self._exchange(conn, Op.HELLO, hello, ())
            except ProtocolError as exc:
                raise _hello_refused(exc, sent_token=self._token is not None) from None
            conn.max_frame = int(reply.get("max_frame", conn.max_frame))
            conn.max_names, conn.idle_timeout_s = _limits(reply)
            self.max_names, self._ops = conn.max_names, protocol.ops_of(reply)
            if conn.segment is not None and reply.get("shm") is not True:
                logger.debug("kvtier server %s: TCP only (%s)", self.url, reply.get("shm_error"))
                conn.segment.close()
                conn.segment = None
            elif conn.segment is not None and "pool" in reply:
                conn.arena = self._arenas.acquire(reply["pool"])
            self.shm_active = conn.segment is not None
            self._in_place = conn.arena is not None
        except BaseException:
            conn.close()
            raise
        finally:
            if offered is not None:  # mapped by both ends (or refused): the name can go
                shm.unlink(offered.name)
        return conn

    def _reusable_idle(self) -> Connection | None:
        """A pooled connection the server has not closed (those it has, after a restart,
        are closed here rather than failing the request), or None. Every pooled
        connection past half the server's idle timeout is closed here too, with its
        segment: the server is about to close it."""
        while True:
            self.close_stale()
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None or self._settled(conn):
                return conn
            conn.close()

    def close_stale(self) -> None:
        """Close every pooled connection idle past half the server's idle timeout, with
        its segment: the server closes its end at the timeout, and a store nobody calls
        would otherwise hold the socket until its next call."""
        with self._lock:
            stale = [conn for conn in self._idle if conn.stale()]
            self._idle = [conn for conn in self._idle if conn not in stale]
        for conn in stale:
            conn.close()

    def _settled(self, conn: Connection) -> bool:
        """Whether the idle ``conn`` can carry another request, once the replies still
        owed on it (``_tell``; they arrived while it idled) are read: otherwise they
        would read as bytes no request asked for."""
        owed, conn.owed = conn.owed, []
        try:
            for earlier in owed:
                conn.receive(self._reply(conn, earlier)[1])
        except (OSError, ProtocolError):
            return False
        return conn.reusable()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _request(
        self, op: Op, header: dict[str, Any], parts: Sequence[Buffer] = ()
    ) -> dict[str, Any]:
        """One round trip on a pooled connection (see ``_on_connection``); the reply's
        header."""
        return self._on_connection(op, lambda conn: self._exchange(conn, op, header, parts)[0])

    def _on_connection(self, op: Op, call: Callable[[Connection], T]) -> T:
        """``call(conn)`` on a pooled connection, which goes back to the pool after.

        Raises:
            StoreUnavailable: the server is closed, unreachable, slow, or answered with an
                error; every pooled connection is dropped (the server may have restarted).
        """
        if self._closed:
            raise StoreUnavailable(f"kvtier server {self.url}: the store is closed")
        if not self._slots.acquire(timeout=self._timeout_s):
            raise StoreUnavailable(f"kvtier server {self.url}: no free connection")
        conn = None
        try:
            conn = self._reusable_idle()
            if conn is None:
                conn = self._connect()
            result = call(conn)
            conn.last_used = time.monotonic()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._idle.append(conn)
            if closed:  # closed meanwhile: nothing may keep the socket and segment
                conn.close()
            return result
        except (OSError, ProtocolError) as exc:
            if conn is not None:
                conn.close()
            self._drop_idle()
            raise StoreUnavailable(
                f"kvtier server {self.url}: {op.name} failed: {type(exc).__name__}: {exc}"
            ) from None
        except BaseException:
            if conn is not None:  # the stream may be mid-frame: never reuse it
                conn.close()
            raise
        finally:
            self._slots.release()

    def _exchange(
        self, conn: Connection, op: Op, header: dict[str, Any], parts: Sequence[Buffer]
    ) -> tuple[dict[str, Any], memoryview]:
        """One request and its reply: the reply's header and payload (valid until the
        connection's next exchange)."""
        reply, payload_len = self._ask(conn, op, header, parts)
        return reply, conn.receive(payload_len)

    def _ask(
        self, conn: Connection, op: Op, header: dict[str, Any], parts: Sequence[Buffer]
    ) -> tuple[dict[str, Any], int]:
        """Send a request and read its reply's header: that and the length of the payload
        that follows it on the connection (for the caller to read). The replies still
        owed to requests sent without waiting (``_tell``) are read first."""
        request_id = next(self._ids)
        conn.send(protocol.encode(op, request_id, header, parts))
        owed, conn.owed = conn.owed, []
        for earlier in owed:
            conn.receive(self._reply(conn, earlier)[1])
        return self._reply(conn, request_id)

    def _tell(self, conn: Connection, op: Op, header: dict[str, Any]) -> None:
        """Send a request without waiting for its reply: the server answers in order, so
        the next request on the connection reads it (``_ask``)."""
        request_id = next(self._ids)
        conn.send(protocol.encode(op, request_id, header, ()))
        conn.owed.append(request_id)

    def _reply(self, conn: Connection, request_id: int) -> tuple[dict[str, Any], int]:
        """The header of the reply to ``request_id``, next on the connection, and the
        length of its payload."""
        prefix = protocol.decode_prefix(recv(conn.sock, protocol.PREFIX_SIZE), conn.max_frame)
        reply = protocol.decode_header(recv(conn.sock, prefix.header_len))
        if "error" in reply:
            raise ProtocolError(f"the server answered: {reply['error']}")
        if prefix.request_id != request_id or not prefix.flags & protocol.REPLY:
            raise ProtocolError("a reply to another request")
        return reply, prefix.payload_len

    # -- BlobStore ---------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store the blobs, in as few frames as the server's frame and names limits
        allow; a blob larger than one frame is skipped (logged once)."""
        limit = self._frame_limit()
        fitting = []
        for name, parts in items:
            if _blob_bytes(parts) > limit:
                warn_once(logger, f"kvtier server {self.url}: a blob exceeds the frame limit")
                continue
            fitting.append((name, parts))
        for batch in batches(fitting, limit, _blob_bytes):
            self._put_batch(batch)

    def _frame_limit(self) -> int:
        """The most bytes one PUT frame carries: the server's frame limit, and the segment
        when the last connection got one but not the server's memory (a larger blob goes
        inline on its own)."""
        with self._lock:
            limit = self._idle[0].max_frame if self._idle else protocol.DEFAULT_MAX_FRAME_BYTES
        return min(limit, self._shm_bytes) if self.shm_active and not self._in_place else limit

    def _put_batch(self, batch: list[tuple[str, Sequence[Buffer]]]) -> None:
        def put(conn: Connection) -> None:
            for _, part in _slices(batch, conn.max_names):
                rest = self._put_in_place(conn, conn.arena, part) if conn.arena else part
                if rest:
                    self._put_sent(conn, list(rest))

        self._on_connection(Op.PUT, put)

    def _put_in_place(
        self, conn: Connection, arena: Segment, batch: list[tuple[str, Sequence[Buffer]]]
    ) -> list[tuple[str, Sequence[Buffer]]]:
        """Write the blobs into buffers the server sets aside in its memory tier, then
        commit them; returns those it had no room for."""
        sizes = [_blob_bytes(parts) for _, parts in batch]
        header = {"names": [name for name, _ in batch], "sizes": sizes, "pool": "reserve"}
        reply, _ = self._exchange(conn, Op.PUT, header, ())
        offsets = shm.placed_of(reply.get("pool"), sizes, (0, arena.size))
        for (_, parts), offset in zip(batch, offsets, strict=True):
            if offset >= 0:
                arena.write(offset, parts)
        self._exchange(conn, Op.PUT, {**header, "pool": "commit"}, ())
        return [item for item, offset in zip(batch, offsets, strict=True) if offset < 0]

    def _put_sent(self, conn: Connection, batch: list[tuple[str, Sequence[Buffer]]]) -> None:
        """The blobs through the connection's segment when they fit there, else inline."""
        names = [name for name, _ in batch]
        sizes = [_blob_bytes(parts) for _, parts in batch]
        segment = conn.segment
        if segment is None or sum(sizes) > segment.size:
            parts = [p for _, blob in batch for p in blob if len(p)]
            self._exchange(conn, Op.PUT, {"names": names, "sizes": sizes}, parts)
            return
        offsets, end = [], 0
        for _, blob in batch:
            offsets.append(end)
            end = segment.write(end, blob)
        self._exchange(conn, Op.PUT, {"names": names, "sizes": sizes, "shm": offsets}, ())

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        return self.read_many(names, bytes)

    def read_many(self, names: Sequence[str], consume: Callable[[memoryview], T]) -> list[T | None]:
        """``consume(view of the blob)`` for each name present (None where absent): the
        view is of the reply (or of the shared segment, or of the server's memory),
        valid only during the call, so a caller that decodes it saves the copy
        ``get_many`` makes.

        Raises:
            StoreUnavailable: as every call; an exception from ``consume`` propagates.
        """
        return self.read_each(names, lambda _, blob: consume(blob))

    def read_each(
        self, names: Sequence[str], consume: Callable[[int, memoryview], T]
    ) -> list[T | None]:
        """``read_many`` with each blob's index in ``names`` (``consume(i, view)``)."""
        if not names:
            return []

        def read(conn: Connection) -> list[T | None]:
            out: list[T | None] = []
            for start, part in _slices(list(names), conn.max_names):
                # a part's indexes count from its start in ``names``
                out += self._read(conn, list(part), lambda i, b, at=start: consume(at + i, b))
            return out

        return self._on_connection(Op.GET, read)

    @property
    def read_batch(self) -> int:
        """Blobs per ``read_each`` (``ReadingStore``): ``READ_BATCH`` while connections
        copy blobs out of the server's memory (a read waits on no network), else 1."""
        return READ_BATCH if self._in_place else 1

    def _read(
        self, conn: Connection, names: list[str], consume: Callable[[int, memoryview], T]
    ) -> list[T | None]:
        header: dict[str, Any] = {"names": names}
        segment, arena = conn.segment, conn.arena
        if segment is not None:
            header["shm"] = [0, segment.size]
        if arena is not None:
            header["pool"] = True
        reply, payload_len = self._ask(conn, Op.GET, header, ())
        sizes = protocol.sizes_of(reply, len(names), None, absent_ok=True)
        offsets = lent = [-1] * len(names)
        if segment is not None:
            offsets = shm.placed_of(reply.get("shm"), sizes, (0, segment.size))
        if arena is not None and "pool" in reply:
            lent = shm.placed_of(reply["pool"], sizes, (0, arena.size))
        inline = [
            s if o < 0 and p < 0 else -1 for s, o, p in zip(sizes, offsets, lent, strict=True)
        ]
        if sum(s for s in inline if s > 0) != payload_len:
            raise ProtocolError(f"GET: the reply's sizes do not add up to {payload_len} bytes")
        if any(o >= 0 and p >= 0 for o, p in zip(offsets, lent, strict=True)):
            raise ProtocolError("GET: a blob placed in both the segment and the memory tier")
        out: list[T | None] = []
        with contextlib.ExitStack() as views:
            whole = views.enter_context(memoryview(segment.mm)) if segment else None
            tier = views.enter_context(memoryview(arena.mm)) if arena else None
            for i, (size, offset, at) in enumerate(zip(sizes, offsets, lent, strict=True)):
                if size < 0:
                    out.append(None)
                    continue
                if at >= 0:  # copied out of the server's memory and verified by ``consume``
                    assert tier is not None
                    blob = views.enter_context(tier[at : at + size])
                elif offset >= 0:
                    assert whole is not None
                    blob = views.enter_context(whole[offset : offset + size])
                else:  # the payload's blobs one at a time, each consumed before the next
                    blob = conn.receive(size)
                out.append(consume(i, blob))
        lease = reply.get("lease")
        if type(lease) is int and lease > 0:
            # what was read is verified already: an expired lease ("held": false) is moot
            self._tell(conn, Op.RELEASE, {"lease": lease})
        return out

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        def exists(conn: Connection) -> list[bool]:
            out: list[bool] = []
            for _, part in _slices(list(names), conn.max_names):
                reply, _ = self._exchange(conn, Op.EXISTS, {"names": list(part)}, ())
                present = reply.get("present")
                if not isinstance(present, list) or len(present) != len(part):
                    raise ProtocolError("EXISTS: a malformed reply")
                out += (bool(p) for p in present)
            return out

        return self._on_connection(Op.EXISTS, exists) if names else []

    def delete_many(self, names: Sequence[str]) -> int:
        def delete(conn: Connection) -> int:
            return sum(
                int(self._exchange(conn, Op.DELETE, {"names": list(part)}, ())[0].get("deleted", 0))
                for _, part in _slices(list(names), conn.max_names)
            )

        return self._on_connection(Op.DELETE, delete) if names else 0

    def clear(self) -> int:
        return int(self._request(Op.CLEAR, {}).get("deleted", 0))

    def ping(self) -> None:
        self._request(Op.PING, {})

    def answers(self, op: Op) -> bool:
        """Whether the server answers ``op``, as its HELLO reply said (else every server's)."""
        return op in self._ops

    def call(self, op: Op, header: dict[str, Any]) -> dict[str, Any]:
        """One request without payload and the reply's header (the peer requests).

        Raises:
            StoreUnavailable: as every call.
        """
        return self._request(op, header)

    def stats(self) -> dict[str, float]:
        """The server's counters and gauges."""
        return self._request(Op.STATS, {})

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()  # a connection still in use unmaps the memory tier as it closes

    def __repr__(self) -> str:
        return f"KVTierStore({self.url!r}, namespace={self.namespace!r})"


def _blob_bytes(parts: Sequence[Buffer]) -> int:
    return sum(len(p) for p in parts)


def _hello_refused(error: ProtocolError, *, sent_token: bool) -> ProtocolError:
    """``error``, the server's answer to HELLO, naming the setting to fix when it refused
    the token."""
    if "unauthenticated" not in str(error) or "token" not in str(error):
        return error
    sent = "this client sent one it does not take" if sent_token else "this client sent none"
    return ProtocolError(
        f"{error} ({sent}: set server_token, or KVTIER_SERVER_TOKEN, to kvtier serve's "
        "--auth-token)"
    )


def _limits(hello: dict[str, Any]) -> tuple[int | None, float]:
    """The names per request and the idle timeout a HELLO reply announces (a server
    that leaves one out has no such limit).

    Raises:
        ProtocolError: a value of the wrong type.
    """
    max_names = hello.get("max_names")
    idle_s = hello.get("idle_timeout_s", 0.0)
    if not (max_names is None or (type(max_names) is int and max_names > 0)):
        raise ProtocolError(f"HELLO: 'max_names' {max_names!r} is not a count")
    if type(idle_s) not in (int, float) or not 0 <= idle_s < float("inf"):
        raise ProtocolError(f"HELLO: 'idle_timeout_s' {idle_s!r} is not seconds")
    return max_names, float(idle_s)


def _slices(items: Sequence[T], limit: int | None) -> list[tuple[int, Sequence[T]]]:
    """``items`` cut into runs of at most ``limit`` (None: one run), each with the index
    of its first item."""
    step = limit or max(len(items), 1)
    return [(start, items[start : start + step]) for start in range(0, len(items), step)]


def open_store(request: RemoteRequest) -> KVTierStore:
    """The blob store of a ``kvtier://`` (or ``lm://``) ``remote_url``: one server may
    write through to another.

    Raises:
        ValueError: a bad URL, or a model name too long for a namespace (naming the key).
    """
    address = parse_server_address(request.url)
    if not protocol.valid_namespace(request.space):
        raise ValueError(
            f"model_name: a kvtier:// remote_url takes a model name of at most "
            f"{protocol.MAX_NAMESPACE_CHARS} characters once percent-encoded (the server's "
            f"namespace), not {len(request.space)} ({request.space[:60]}...); set "
            "model_name to a shorter name for this model"
        )
    return KVTierStore(
        address.host,
        address.port,
        namespace=request.space,
        token=request.config.server_token,
        timeout_s=request.config.remote_timeout_ms / 1000,
        max_connections=request.config.remote_max_concurrency,
        shm=address.shm,
        shm_bytes=address.shm_bytes,
    )


def open_remote(request: RemoteRequest) -> RemoteTier:
    """A ``kvtier://`` ``remote_url`` as a tier (its ``RemoteOpener``, see ``schemes``)."""
    return open_blob_tier(open_store(request), request)
