"""One pooled connection of ``KVTierStore`` to a ``kvtier serve``.

It holds the socket, the shared-memory segment it offered the server (when the server
mapped it) and the server's memory tier it maps (when offered); its sends are gathered
into as few ``sendmsg`` calls as the kernel allows, its reads are exact.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Sequence

from kvtier.config.node_address import DEFAULT_SEGMENT_BYTES
from kvtier.storage.blob_store import Buffer
from kvtier.storage.files import advance, byte_views
from kvtier.storage.node_shm import Arenas, Segment

IOV_MAX = 512  # parts per sendmsg (Linux allows 1024)
REUSED_BYTES = DEFAULT_SEGMENT_BYTES  # a connection's reply buffer, kept between replies


class Connection:
    """One TCP connection that has said HELLO, with its shared-memory segment when the
    server mapped one, and the server's memory tier when it offered it (``arenas``).

    The server's limits come with its HELLO reply: ``max_frame`` (payload bytes per
    frame), ``max_names`` (names per request; None: any number) and ``idle_timeout_s``
    (how long it keeps a connection that sends nothing; 0: for ever)."""

    def __init__(self, sock: socket.socket, max_frame: int, arenas: Arenas):
        self.sock = sock
        self.max_frame = max_frame
        self.max_names: int | None = None
        self.idle_timeout_s = 0.0
        self.last_used = time.monotonic()  # when its latest reply was read
        self.segment: Segment | None = None
        self.arena: Segment | None = None
        self.owed: list[int] = []  # requests sent whose replies are still to be read
        self._arenas = arenas
        self._inbox = bytearray()  # reply payloads, reused (see ``receive``)

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send ``parts`` in order with as few ``sendmsg`` calls as the kernel allows
        (none of them copied or joined)."""
        views = byte_views(parts)
        while views:
            views = advance(views, self.sock.sendmsg(views[:IOV_MAX]))

    def receive(self, size: int) -> memoryview:
        """The next ``size`` bytes, in a buffer the connection reuses up to
        ``REUSED_BYTES`` (so a large reply does not fault in fresh pages each time): valid
        until the next call."""
        if size > REUSED_BYTES:
            buffer = bytearray(size)
        else:
            if len(self._inbox) < size:
                self._inbox = bytearray(size)
            buffer = self._inbox
        view = memoryview(buffer)[:size]
        recv_into(self.sock, view)
        return view

    def reusable(self) -> bool:
        """Whether this idle connection can carry another request: it has idled less
        than half the server's idle timeout (so the server cannot be closing it as the
        request goes out), and nothing is readable on it, so the server has neither
        closed it (a restart) nor sent bytes no request asked for. One ``poll`` that
        does not wait."""
        if self.stale():
            return False
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return not poller.poll(0)

    def stale(self) -> bool:
        """Whether this idle connection has idled past half the server's idle timeout:
        the server may be closing it, so it is not used again."""
        idle_s = time.monotonic() - self.last_used
        return bool(self.idle_timeout_s) and idle_s > self.idle_timeout_s / 2

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.segment is not None:
            self.segment.close()
        if self.arena is not None:
            self._arenas.release(self.arena)
            self.arena = None


def recv(sock: socket.socket, size: int) -> bytearray:
    """The next ``size`` bytes on ``sock``, in a buffer of their own."""
    buffer = bytearray(size)
    recv_into(sock, memoryview(buffer))
    return buffer


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        ConnectionResetError: the server closed the connection first.
    """
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("the server closed the connection")
        got += n
