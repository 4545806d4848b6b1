"""The server's sockets on its event loop: frames read with sized reads into buffers the
caller gives, and written as their parts with ``sendmsg``, so a blob's bytes are never
copied between the socket and the memory tier.

asyncio's streams copy each incoming frame twice (into the reader's buffer, then out of
it) and join a reply's parts into one new bytes before writing it, keeping what the
kernel does not take at once in yet another buffer: for a 32 MiB chunk on loopback those
copies cost more than the kernel's own. Here a read is ``recv_into`` a view of the
destination, and a write is ``sendmsg`` of the parts (the frame's prefix and header, then
the blobs themselves), resumed where the kernel stopped.

Receive buffers come from a ``BufferPool``: reused, so a large frame does not fault in
fresh pages each time (that costs as much as the copy it avoids).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Sequence

from kvtier.storage.blob_store import Buffer
from kvtier.storage.files import advance, byte_views

SEND_BUFFER_BYTES = 4 << 20  # per connection; the kernel caps it at net.core.wmem_max
IOV_MAX = 512  # parts per sendmsg (Linux allows 1024)
BACKLOG = 128
LINGER_S, LINGER_BYTES = 1.0, 1 << 20  # what a connection closed for an error waits for
POOLED_BYTES = 1 << 20  # a smaller receive buffer is allocated afresh


def listen(host: str, port: int) -> list[socket.socket]:
    """Non-blocking listening sockets on every address ``host`` resolves to (port 0: one
    free port, the first address's, for them all), as ``asyncio.start_server`` binds.

    Raises:
        OSError: the address cannot be resolved or bound (the message names it).
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        raise OSError(error.errno, f"cannot resolve host {host!r}: {error.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException as error:
        for sock in sockets:
            sock.close()
        if isinstance(error, OSError) and not isinstance(error, BlockingIOError):
            raise OSError(
                error.errno, f"cannot listen on {host or '*'} port {port}: {error.strerror}"
            ) from None
        raise
    return sockets


def tune(sock: socket.socket) -> None:
    """A client's connection as the loop needs it: non-blocking, no Nagle delay (a reply
    is one write), a send buffer that holds a few MiB of a large reply."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview):
    """Fill ``view`` from ``sock``.

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection first.
    """
    got, size = 0, len(view)
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise asyncio.IncompleteReadError(bytes(view[:got]), size)
        got += n


async def send_parts(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: Sequence[Buffer]
) -> None:
    """Send ``parts`` in order, as many as the kernel takes per ``sendmsg``, waiting for
    room in between (no part is copied)."""
    views = byte_views(parts)
    while views:
        try:
            sent = sock.sendmsg(views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
            continue
        views = advance(views, sent)


async def linger(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """End the sending side and discard what the client still sends, until it closes
    (at most ``LINGER_S`` and ``LINGER_BYTES``): closing a socket with unread bytes
    resets the connection, which can destroy the reply the client has yet to read."""
    scratch = bytearray(1 << 16)

    async def drain() -> None:
        left = LINGER_BYTES
        while left > 0 and (n := await loop.sock_recv_into(sock, scratch)):
            left -= n

    with contextlib.suppress(OSError, TimeoutError, asyncio.TimeoutError):
        sock.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(drain(), LINGER_S)  # Python 3.10 has no asyncio.timeout


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)


class BufferPool:
    """Receive buffers, reused: ``take`` one of at least n bytes, ``give`` it back when
    nothing views it any more. At most ``keep_bytes`` are kept between frames.
    Thread-safe."""

    def __init__(self, keep_bytes: int):
        self._keep = keep_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        if size < POOLED_BYTES:
            return bytearray(size)
        with self._lock:
            fitting = [b for b in self._free if len(b) >= size]
            if fitting:
                best = min(fitting, key=len)
                self._free.remove(best)
                return best
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        if len(buffer) < POOLED_BYTES:
            return
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=len, reverse=True)
            while sum(len(b) for b in self._free) > self._keep:
                self._free.pop()
