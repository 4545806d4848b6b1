"""The client of ``kvtier serve``: a ``BlobStore`` for ``remote_url: kvtier://host:port``
(and LMCache's spelling ``lm://host:port``, read the same way).

Each batched call is one request frame and one reply frame (``protocol``) on a pooled
TCP connection. A connection starts with HELLO, which carries the token
(``server_token``) and the namespace (the model), so the server keeps this client's
blobs apart from every other model's. ``RemoteTier`` wraps the store with timeouts, the
down state and reconnects (``open_blob_tier``); the store itself only turns every
failure into ``StoreUnavailable`` and drops its connections, so the next call (the
tier's reconnect ping) dials afresh.

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
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvtier.server import protocol
from kvtier.server.protocol import Op, ProtocolError
from kvtier.storage.backend import Buffer, StoreUnavailable, batches
from kvtier.storage.remote import RemoteRequest, RemoteTier, open_blob_tier
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)


def parse_server_url(url: str) -> tuple[str, int]:
    """``(host, port)`` of ``kvtier://host:port`` or ``lm://host:port``.

    Raises:
        ValueError: naming ``remote_url`` and the accepted form.
    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None or parts.path not in ("", "/") or parts.query:
        raise ValueError(
            f"remote_url {url!r}: expected kvtier://host:port (or lm://host:port), "
            "e.g. kvtier://127.0.0.1:65432"
        )
    return host, port


class _Connection:
    """One TCP connection that has said HELLO."""

    def __init__(self, sock: socket.socket, max_frame: int):
        self.sock = sock
        self.max_frame = max_frame

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class KVTierStore:
    """A ``BlobStore`` on a ``kvtier serve`` at ``host:port``.

    Args:
        namespace: the namespace every name lives in (the model); see ``protocol``.
        token: sent in HELLO (the server's ``--auth-token``), or None.
        timeout_s: connect timeout and the longest wait on one socket operation.
        max_connections: connections pooled (and calls running at once).
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
    ):
        if not protocol.valid_namespace(namespace):
            raise ValueError(f"namespace {namespace!r}: 1 to 256 characters, no '/'")
        self.host, self.port = host, port
        self.url = f"kvtier://{host}:{port}"
        self.namespace = namespace
        self._token = token
        self._timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._ids = itertools.count(1)
        self._closed = False

    # -- connections -------------------------------------------------------------------

    def _connect(self) -> _Connection:
        sock = socket.create_connection((self.host, self.port), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(sock, protocol.DEFAULT_MAX_FRAME_BYTES)
        try:
            hello = {"token": self._token, "namespace": self.namespace}
            reply, _ = self._exchange(conn, Op.HELLO, hello, ())
            conn.max_frame = int(reply.get("max_frame", conn.max_frame))
        except BaseException:
            conn.close()
            raise
        return conn

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _request(
        self, op: Op, header: dict[str, Any], parts: Sequence[Buffer] = ()
    ) -> tuple[dict[str, Any], bytearray]:
        """One round trip on a pooled connection.

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
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            result = self._exchange(conn, op, header, parts)
            with self._lock:
                self._idle.append(conn)
            return result
        except (OSError, ProtocolError) as exc:
            if conn is not None:
                conn.close()
            self._drop_idle()
            raise StoreUnavailable(
                f"kvtier server {self.url}: {op.name} failed: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            self._slots.release()

    def _exchange(
        self, conn: _Connection, op: Op, header: dict[str, Any], parts: Sequence[Buffer]
    ) -> tuple[dict[str, Any], bytearray]:
        request_id = next(self._ids)
        prefix, head, *payload = protocol.encode(op, request_id, header, parts)
        conn.sock.sendall(prefix + head)
        for part in payload:
            conn.sock.sendall(part)
        prefix = protocol.decode_prefix(_recv(conn.sock, protocol.PREFIX_SIZE), conn.max_frame)
        reply = protocol.decode_header(_recv(conn.sock, prefix.header_len))
        payload = _recv(conn.sock, prefix.payload_len)
        if "error" in reply:
            raise ProtocolError(f"the server answered: {reply['error']}")
        if prefix.request_id != request_id or not prefix.flags & protocol.REPLY:
            raise ProtocolError("a reply to another request")
        return reply, payload

    # -- BlobStore ---------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store the blobs, in as few frames as the server's frame limit allows; a blob
        larger than one frame is skipped (logged once)."""
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
        with self._lock:
            return self._idle[0].max_frame if self._idle else protocol.DEFAULT_MAX_FRAME_BYTES

    def _put_batch(self, batch: list[tuple[str, Sequence[Buffer]]]) -> None:
        names = [name for name, _ in batch]
        sizes = [_blob_bytes(parts) for _, parts in batch]
        parts = [p for _, blob in batch for p in blob if len(p)]
        self._request(Op.PUT, {"names": names, "sizes": sizes}, parts)

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        if not names:
            return []
        reply, payload = self._request(Op.GET, {"names": list(names)})
        try:
            sizes = protocol.sizes_of(reply, len(names), len(payload), absent_ok=True)
        except ProtocolError as exc:
            raise StoreUnavailable(f"kvtier server {self.url}: GET: {exc}") from None
        return [None if b is None else bytes(b) for b in protocol.split_payload(payload, sizes)]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        present = self._request(Op.EXISTS, {"names": list(names)})[0].get("present")
        if not isinstance(present, list) or len(present) != len(names):
            raise StoreUnavailable(f"kvtier server {self.url}: EXISTS: a malformed reply")
        return [bool(p) for p in present]

    def delete_many(self, names: Sequence[str]) -> int:
        if not names:
            return 0
        return int(self._request(Op.DELETE, {"names": list(names)})[0].get("deleted", 0))

    def clear(self) -> int:
        return int(self._request(Op.CLEAR, {})[0].get("deleted", 0))

    def ping(self) -> None:
        self._request(Op.PING, {})

    def stats(self) -> dict[str, float]:
        """The server's counters and gauges."""
        return self._request(Op.STATS, {})[0]

    def close(self) -> None:
        self._closed = True
        self._drop_idle()

    def __repr__(self) -> str:
        return f"KVTierStore({self.url!r}, namespace={self.namespace!r})"


def _blob_bytes(parts: Sequence[Buffer]) -> int:
    return sum(len(p) for p in parts)


def _recv(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        got += n
    return buffer


def open_store(request: RemoteRequest) -> KVTierStore:
    """The blob store of a ``kvtier://`` (or ``lm://``) ``remote_url``: one server may
    write through to another."""
    host, port = parse_server_url(request.url)
    return KVTierStore(
        host,
        port,
        namespace=request.space,
        token=request.config.server_token,
        timeout_s=request.config.remote_timeout_ms / 1000,
        max_connections=request.config.remote_max_concurrency,
    )


def open_remote(request: RemoteRequest) -> RemoteTier:
    """A ``kvtier://`` ``remote_url`` as a tier (its ``RemoteOpener``, see ``remotes``)."""
    return open_blob_tier(open_store(request), request)
