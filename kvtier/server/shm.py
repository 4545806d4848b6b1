"""The server's side of the same-host path (the segment and the client's side:
``kvtier.storage.node_shm``): a HELLO's offer checked, the client's segment opened, the
references that PUT and GET frames make into it checked, and the memory tier kept in a
memfd (``SharedArena``) that such clients map.

NOTE: nothing in a segment is trusted: the server never maps it, but reads and writes
it through its descriptor (``SegmentFile``), since its client may truncate the file at
any time and a mapping past the file's end kills the process that touches it (SIGBUS);
a read there comes back short, an error reply. The server copies a PUT's bytes out before
storing them (a blob is a wire-format object whose checksum its reader verifies), and
every reference is checked against the segment's bounds before it is used. Nor is the
memory tier, once clients map it: they write their PUTs' blobs into it themselves, and a
client reading it copies a blob out and verifies the copy, so a blob changed under it (a
lease that expired, another client's stray write) is a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import stat

import torch

from kvtier.config.node_address import MIN_SEGMENT_BYTES
from kvtier.machine import check_host_memory
from kvtier.memory import MemoryObj
from kvtier.storage.blob_store import Buffer
from kvtier.storage.node_protocol import ProtocolError, is_int, shown
from kvtier.storage.node_shm import (
    ARENA_PATTERN,
    NAME_PATTERN,
    NONCE_BYTES,
    SHM_DIR,
    ShmOffer,
    unlink,
)

logger = logging.getLogger(__name__)


def offer_of(value: object) -> ShmOffer:
    """The ``shm`` field of a HELLO, checked.

    Raises:
        ProtocolError: not a map of a valid ``name``, an int ``size`` and a 16-byte ``nonce``.
    """
    if not isinstance(value, dict) or set(value) != {"name", "size", "nonce"}:
        raise ProtocolError("'shm' must be a map of name, size and nonce")
    name, size, nonce = value["name"], value["size"], value["nonce"]
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ProtocolError("'shm.name' must be kvtier-<pid>-<32 hex digits>")
    if not is_int(size, MIN_SEGMENT_BYTES):
        raise ProtocolError(f"'shm.size' must be an integer >= {MIN_SEGMENT_BYTES}")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"'shm.nonce' must be {NONCE_BYTES} bytes")
    return ShmOffer(name, size, nonce)


class ShmRefError(ProtocolError):
    """A reference into a segment that is out of range, or on a connection without one."""


class ShmRefused(Exception):
    """The server will not map the offered segment; the client stays on TCP. The message
    is the reason (a counter suffix first: ``too_large: ...``)."""


class SegmentFile:
    """A client's segment as the server holds it: the open file, read with ``pread`` and
    written with ``pwrite`` at the offsets that frames name (checked against ``size``
    first), never mapped."""

    def __init__(self, name: str, fd: int, size: int):
        self.name = name
        self.size = size
        self._fd = fd

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset``.

        Raises:
            ShmRefError: the file ends first (its client truncated it).
        """
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise ShmRefError(f"the segment ends before {offset + len(view)} (truncated)")
            done += n

    def write(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset``."""
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return f"SegmentFile({self.name!r}, {self.size} bytes)"


def attach_segment(offer: ShmOffer, max_bytes: int) -> SegmentFile:
    """Open the client's segment (the server's side) and unlink its name.

    Raises:
        ShmRefused: larger than ``max_bytes``, absent (another host), not a regular file of
            the offered size, or without the offered nonce.
    """
    if offer.size > max_bytes:
        raise ShmRefused(f"too_large: {offer.size} bytes offered, at most {max_bytes}")
    path = os.path.join(SHM_DIR, offer.name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmRefused(f"unreachable: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != offer.size:
            raise ShmRefused("mismatch: not a regular file of the offered size")
        if os.pread(fd, NONCE_BYTES, 0) != offer.nonce:
            raise ShmRefused("mismatch: the nonce differs (another host's segment?)")
    except OSError as exc:
        os.close(fd)
        raise ShmRefused(f"unreachable: {exc.strerror or exc}") from None
    except BaseException:
        os.close(fd)
        raise
    unlink(offer.name)
    return SegmentFile(offer.name, fd, offer.size)


# -- references in request and reply headers --------------------------------------------


def extents_of(
    value: object, sizes: list[int], segment: SegmentFile | None
) -> list[tuple[int, int]]:
    """A PUT's ``shm`` field: one offset per blob, each ``[offset, offset + size)`` inside
    the connection's segment.

    Raises:
        ProtocolError: no segment on this connection, or offsets of the wrong type, count
            or range.
    """
    if segment is None:
        raise ShmRefError("shm reference on a connection without a shared-memory segment")
    if not isinstance(value, list) or len(value) != len(sizes):
        raise ShmRefError(f"'shm' must be a list of {len(sizes)} offsets")
    out = []
    for offset, size in zip(value, sizes, strict=True):
        if not is_int(offset) or offset + size > segment.size:
            raise ShmRefError(
                f"shm reference out of range: offset {shown(offset)} size {size} "
                f"(segment of {segment.size} bytes)"
            )
        out.append((offset, size))
    return out


def region_of(value: object, segment: SegmentFile | None) -> tuple[int, int]:
    """A GET's ``shm`` field: ``[offset, capacity]``, the part of the segment the reply's
    blobs may fill.

    Raises:
        ProtocolError: no segment on this connection, or not two ints inside it.
    """
    if segment is None:
        raise ShmRefError("shm reference on a connection without a shared-memory segment")
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(is_int(v) for v in value)
        or value[0] + value[1] > segment.size
    ):
        raise ShmRefError(
            f"shm region out of range: {shown(value)} (segment of {segment.size} bytes)"
        )
    return value[0], value[1]


# -- the memory tier, shared -------------------------------------------------------------


def open_arena(size: int) -> SharedArena | None:
    """A ``SharedArena`` of ``size`` bytes, or None (logged) where this system has no
    memfd: the memory tier then stays private and clients use their segments.

    Raises:
        PoolTooLarge: ``size`` is more than the machine's available memory.
    """
    if not hasattr(os, "memfd_create"):
        logger.info("kvtier server: no memfd here; same-host clients copy through segments")
        return None
    try:
        return SharedArena(size)
    except OSError as exc:
        logger.warning("kvtier server: cannot share the memory tier (%s); segments only", exc)
        return None


class SharedArena:
    """Memory for the server's memory tier in a memfd, which a same-host client (one whose
    segment the server mapped) opens through ``/proc/<pid>/fd/<fd>`` and maps.

    The file has no name in any directory: it goes when the server exits and no client
    maps it any more. NOTE: it is sealed against shrinking and growing: a client opens it
    writable, and one that truncated it would kill every process mapping it (the server
    first) with SIGBUS at its next access past the new end.

    Raises:
        PoolTooLarge: ``size`` is more than the machine's available memory.
    """

    def __init__(self, size: int):
        check_host_memory(size)
        self.name = f"kvtier-pool-{secrets.token_hex(16)}"
        assert ARENA_PATTERN.fullmatch(self.name)
        self.size = size
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals)
            self._mm = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._base = self.tensor.data_ptr()

    def offer(self) -> dict:
        """A HELLO reply's ``pool``: where a client on this host finds the file."""
        return {"pid": os.getpid(), "fd": self._fd, "name": self.name, "size": self.size}

    def offset_of(self, obj: MemoryObj) -> int:
        """Where ``obj``'s bytes start in the file."""
        return obj.tensor.data_ptr() - self._base

    def close(self) -> None:
        """Unmap and close (once the pool carved from ``tensor`` is closed)."""
        self.tensor = None
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1
