"""Shared-memory segments for the same-host path between ``kvtier serve`` and a client.

A client on the server's host moves blob bytes through a segment it shares with the
server instead of through the TCP socket; the socket still carries every frame, with
``(offset, size)`` references into the segment where the payload would be.

Life of a segment (one per client connection)::

    client: create /dev/shm/kvtier-<pid>-<random>  (O_EXCL, mode 0600, sparse)
            write a random 16-byte nonce at offset 0, map it
            HELLO {shm: {name, size, nonce}}  ───▶  server: open the name (O_NOFOLLOW),
                                                     check it is a regular file of that
                                                     size holding that nonce, keep it
                                                     open (never mapped), unlink the name
            ◀─── HELLO reply {shm: true}  (or false + shm_error: the client goes on TCP)
    client: unlink the name (if the server did not), keep the mapping
    either side closes its end when the connection ends

NOTE: once HELLO is answered the segment has no name left in ``/dev/shm``: the memory
belongs to the client's mapping and the server's descriptor only and the kernel frees it
when both are closed, even if either process is killed. The server reads and writes it
with ``pread``/``pwrite`` (``kvtier.server.shm.SegmentFile``): the client could truncate
the file under a mapping, which would kill the server with SIGBUS at its next copy. The
nonce proves that the server opened the very segment the
client created, so a server on another host (whose ``/dev/shm`` has no such file, or an
unrelated one) refuses and the client falls back to TCP. Only the short window between
the client's create and the HELLO reply can leave a name behind (a client killed there).

A client whose segment the server mapped may also reach the server's memory tier itself:
the HELLO reply's ``pool`` names the memory file (a memfd) that the tier's pool lives in,
by the server's pid and descriptor. The client opens it through ``/proc``, checks that it
is the named memfd of the offered size, and maps it (``attach_arena``). A GET then names
where each blob lies in it, under a lease, and the client copies the blob straight into
its own buffer (verified there); a PUT asks for buffers there, writes its blobs into them
and commits them. Each makes one copy instead of two. Where the file cannot be opened
(another pid namespace, another user) the connection goes on with its segment.

NOTE: every such client can write the whole memory tier, not only its own blobs, so a
bug in one engine can damage another's. Every reader verifies every blob
it reads (``kvtier.storage.wire``), so such damage is a miss, never wrong KV; the blobs
were never trusted (docs/reliability.md), the mapping only widens who could spoil them.

This module is the segment itself and the client's side; the server's side (checking
an offer, mapping it, checking references, the shared memory tier) is
``kvtier.server.shm``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass

from kvtier.storage.node_protocol import ProtocolError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvtier-"
NAME_PATTERN = re.compile(r"kvtier-[0-9]{1,10}-[0-9a-f]{32}")
ARENA_PATTERN = re.compile(r"kvtier-pool-[0-9a-f]{32}")
NONCE_BYTES = 16


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


def attach_arena(offer: object) -> Segment | None:
    """Map the server's memory tier from a HELLO reply's ``pool`` offer (``{pid, fd,
    name, size}``); None when the offer is malformed or the file is not the named memfd
    of that size (another host or pid namespace, another user)."""
    if not isinstance(offer, dict):
        return None
    pid, fd, name, size = (offer.get(k) for k in ("pid", "fd", "name", "size"))
    if not (
        all(type(v) is int and v >= 0 for v in (pid, fd, size))
        and isinstance(name, str)
        and ARENA_PATTERN.fullmatch(name)
    ):
        return None
    try:
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # checked on the descriptor opened, so a file swapped in meanwhile cannot pass
        if os.readlink(f"/proc/self/fd/{own}") != f"/memfd:{name} (deleted)":
            return None
        if os.fstat(own).st_size != size or size == 0:
            return None
        return Segment(name, mmap.mmap(own, size))
    except OSError:
        return None
    finally:
        os.close(own)


class Arenas:
    """The servers' memory tiers a client maps (``attach_arena``): one mapping per file,
    however many connections use it, unmapped when the last lets go (a restarted
    server's old file is freed then). Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[str, list] = {}  # name -> [Segment, connections using it]
        self._lock = threading.Lock()

    def acquire(self, offer: object) -> Segment | None:
        """The mapping of the file a HELLO reply's ``pool`` offers, or None."""
        name = offer.get("name") if isinstance(offer, dict) else None
        with self._lock:
            entry = self._maps.get(name) if isinstance(name, str) else None
            if entry is not None:
                entry[1] += 1
                return entry[0]
        arena = attach_arena(offer)
        if arena is None:
            return None
        with self._lock:
            entry = self._maps.setdefault(arena.name, [arena, 0])
            entry[1] += 1
        if entry[0] is not arena:  # another connection mapped it meanwhile
            arena.close()
        return entry[0]

    def release(self, arena: Segment) -> None:
        with self._lock:
            entry = self._maps[arena.name]
            entry[1] -= 1
            if entry[1]:
                return
            del self._maps[arena.name]
        arena.close()


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
