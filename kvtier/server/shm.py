"""Shared-memory segments for the same-host path between ``kvtier serve`` and a client.

A client on the server's host moves blob bytes through a segment it shares with the
server instead of through the TCP socket; the socket still carries every frame, with
``(offset, size)`` references into the segment where the payload would be.

Life of a segment (one per client connection)::

    client: create /dev/shm/kvtier-<pid>-<random>  (O_EXCL, mode 0600, sparse)
            write a random 16-byte nonce at offset 0, map it
            HELLO {shm: {name, size, nonce}}  ───▶  server: open the name (O_NOFOLLOW),
                                                     check it is a regular file of that
                                                     size holding that nonce, map it,
                                                     unlink the name
            ◀─── HELLO reply {shm: true}  (or false + shm_error: the client goes on TCP)
    client: unlink the name (if the server did not), keep the mapping
    either side closes its mapping when the connection ends

NOTE: once HELLO is answered the segment has no name left in ``/dev/shm``: the memory
belongs to the two mappings only and the kernel frees it when both are closed, even if
either process is killed. The nonce proves that the server mapped the very segment the
client created, so a server on another host (whose ``/dev/shm`` has no such file, or an
unrelated one) refuses and the client falls back to TCP. Only the short window between
the client's create and the HELLO reply can leave a name behind (a client killed there).

Nothing in a segment is trusted: the server copies a PUT's bytes out before storing
them (a blob is a wire-format object whose checksum its reader verifies), and every
reference is checked against the segment's bounds before it is used.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass

from kvtier.server.protocol import ProtocolError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvtier-"
NAME_PATTERN = re.compile(r"kvtier-[0-9]{1,10}-[0-9a-f]{32}")
NONCE_BYTES = 16
MIN_SEGMENT_BYTES = 1 << 16
DEFAULT_SEGMENT_BYTES = 64 << 20  # the client's default (``?shm_mb=``)


@dataclass(frozen=True, slots=True)
class ShmOffer:
    """What a client's HELLO offers: the segment's name in ``/dev/shm``, its size and the
    nonce written at its offset 0."""

    name: str
    size: int
    nonce: bytes

    def as_header(self) -> dict:
        return {"name": self.name, "size": self.size, "nonce": self.nonce}


class Segment:
    """A mapped segment. ``mm`` is the mapping (slice it to read and write)."""

    def __init__(self, name: str, mm: mmap.mmap):
        self.name = name
        self.mm = mm
        self.size = len(mm)

    def write(self, offset: int, parts) -> int:
        """Copy ``parts`` back to back from ``offset``; the bytes written."""
        for part in parts:
            n = len(part)
            if n:
                self.mm[offset : offset + n] = part
                offset += n
        return offset

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes at ``offset`` (the caller checked the bounds)."""
        return self.mm[offset : offset + size]

    def close(self) -> None:
        """Unmap (idempotent). A view still exported keeps the mapping until it goes."""
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes)"


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def create_segment(size: int) -> tuple[Segment, ShmOffer]:
    """A fresh segment of ``size`` bytes (the client's side) and the offer naming it.

    Raises:
        OSError: ``/dev/shm`` is missing, full or not writable.
    """
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    nonce = secrets.token_bytes(NONCE_BYTES)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    mm[:NONCE_BYTES] = nonce
    return Segment(name, mm), ShmOffer(name, size, nonce)


def unlink(name: str) -> None:
    """Remove the segment's name from ``/dev/shm`` (absent already: nothing to do)."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(SHM_DIR, name))


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
    if type(size) is not int or size < MIN_SEGMENT_BYTES:
        raise ProtocolError(f"'shm.size' must be an integer >= {MIN_SEGMENT_BYTES}")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"'shm.nonce' must be {NONCE_BYTES} bytes")
    return ShmOffer(name, size, nonce)


class ShmRefError(ProtocolError):
    """A reference into a segment that is out of range, or on a connection without one."""


class ShmRefused(Exception):
    """The server will not map the offered segment; the client stays on TCP. The message
    is the reason (a counter suffix first: ``too_large: ...``)."""


def attach_segment(offer: ShmOffer, max_bytes: int) -> Segment:
    """Map the client's segment (the server's side) and unlink its name.

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
        mm = mmap.mmap(fd, offer.size)
    except OSError as exc:
        raise ShmRefused(f"unreachable: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if mm[:NONCE_BYTES] != offer.nonce:
        mm.close()
        raise ShmRefused("mismatch: the nonce differs (another host's segment?)")
    unlink(offer.name)
    return Segment(offer.name, mm)


# -- references in request and reply headers --------------------------------------------


def extents_of(value: object, sizes: list[int], segment: Segment | None) -> list[tuple[int, int]]:
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
        if type(offset) is not int or offset < 0 or offset + size > segment.size:
            raise ShmRefError(
                f"shm reference out of range: offset {offset!r} size {size} "
                f"(segment of {segment.size} bytes)"
            )
        out.append((offset, size))
    return out


def region_of(value: object, segment: Segment | None) -> tuple[int, int]:
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
        or not all(type(v) is int and v >= 0 for v in value)
        or value[0] + value[1] > segment.size
    ):
        raise ShmRefError(f"shm region out of range: {value!r} (segment of {segment.size} bytes)")
    return value[0], value[1]


def placed_of(value: object, sizes: list[int], region: tuple[int, int]) -> list[int]:
    """A GET reply's ``shm`` field (the client's check): one offset per blob, -1 where the
    blob is absent or in the payload, every placed blob inside ``region``.

    Raises:
        ProtocolError: of the wrong type, count or range.
    """
    start, capacity = region
    if not isinstance(value, list) or len(value) != len(sizes):
        raise ProtocolError(f"'shm' must be a list of {len(sizes)} offsets")
    for offset, size in zip(value, sizes, strict=True):
        if type(offset) is not int or not (
            offset == -1 or (size >= 0 and start <= offset and offset + size <= start + capacity)
        ):
            raise ProtocolError(f"shm offset {offset!r} of a {size}-byte blob is out of range")
    return value
