"""Files in a sharded tree, written and read whole through lists of buffers: the layout
and writes of ``file_store.FileStore`` (under the disk tier and the node server's disk),
and the reading of one wire-format chunk file (``read_object``, ``read_object_into``).

A file's bytes go out with ``writev`` and come back with ``preadv`` from and into the
caller's buffers (a wire header, then a payload that may be several runs of an engine's
memory), so nothing is joined into one buffer on the way. With ``O_DIRECT`` a file goes
through one aligned buffer instead (the kernel's rule for direct I/O).

NOTE: a file appears only complete: ``write_whole`` writes ``.<name>.<pid>.<thread>.tmp``
in the same directory and renames it over the final name. ``scan_tree`` removes temp
files that a crashed writer left behind, once they are old.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

from kvtier.memory import MemoryObj
from kvtier.storage import wire
from kvtier.storage.blob_store import Buffer
from kvtier.storage.serde import CorruptObject, NaiveSerde, Serde, tensor_bytes
from kvtier.storage.wire import Allocate, ChunkBuffers, Header

SUFFIX = ".kvt"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 3600.0
DIRECT_ALIGN = 4096
IOV_MAX = 1024  # buffers per writev / preadv call (Linux's limit)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem (bytes or inodes) or quota

T = TypeVar("T")


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def sharded_path(directory: str, file_name: str) -> str:
    """Where ``file_name`` (a hex hash) lives in the sharded tree under ``directory``."""
    return f"{directory}/{file_name[:2]}/{file_name[2:4]}/{file_name}{SUFFIX}"


def scan_tree(directory: Path) -> tuple[list[tuple[float, str, int]], set[str]]:
    """``(mtime, name, size)`` of every file in a sharded tree, oldest first, where
    ``name`` is the file's as ``sharded_path`` places it (``<prefix>/<h>`` for
    ``<directory>/<prefix>/<h[0:2]>/<h[2:4]>/<h>.kvt``, ``<h>`` without a prefix); a file
    elsewhere is not one of the tree's. And the paths of the directories below
    ``directory``, empty ones too. Temp files older than ``STALE_TMP_SECONDS`` (left
    behind by a writer that crashed) are removed."""
    found: list[tuple[float, str, int]] = []
    directories: set[str] = set()
    now = time.time()
    for dirpath, subdirs, files in os.walk(directory):
        directories.update(os.path.join(dirpath, d) for d in subdirs)
        parts = Path(dirpath).relative_to(directory).parts
        prefix, shards = "/".join(parts[:-2]), parts[-2:]
        for file in files:
            path = os.path.join(dirpath, file)
            try:
                if file.endswith(SUFFIX):
                    hashed = file[: -len(SUFFIX)]
                    if shards == (hashed[:2], hashed[2:4]):
                        name = f"{prefix}/{hashed}" if prefix else hashed
                        st = os.stat(path)
                        found.append((st.st_mtime, name, st.st_size))
                elif file.endswith(TMP_SUFFIX) and now - os.stat(path).st_mtime > STALE_TMP_SECONDS:
                    os.unlink(path)
            except OSError:
                continue
    return sorted(found), directories


def write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """``writev`` every byte of ``parts`` (retrying partial writes)."""
    views = byte_views(parts)
    while views:
        views = advance(views, os.writev(fd, views[:IOV_MAX]))


def read_into(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """``preadv`` from ``offset`` until ``buffers`` are full or the file ends; returns the
    bytes read (fewer than the buffers hold: the file is shorter)."""
    views = byte_views(buffers)
    total = 0
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset + total)
        if not n:
            break
        total += n
        views = advance(views, n)
    return total


def write_direct(fd: int, parts: Sequence[Buffer], size: int) -> None:
    """Write ``parts`` (``size`` bytes) to a file opened with ``O_DIRECT``: staged through
    one aligned buffer, padded to ``DIRECT_ALIGN``, then truncated to ``size``."""
    buffer = mmap.mmap(-1, max(round_up(size, DIRECT_ALIGN), DIRECT_ALIGN))
    try:
        offset = 0
        for part in parts:
            buffer[offset : offset + len(part)] = part
            offset += len(part)
        with memoryview(buffer) as view:
            write_all(fd, [view[: round_up(size, DIRECT_ALIGN)]])
        os.ftruncate(fd, size)
    finally:
        buffer.close()


def probe_writable(directory: Path) -> None:
    """Create ``directory`` (with its parents) and check that a file can be made in it.

    Raises:
        OSError: it cannot.
    """
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    probe.write_bytes(b"")
    probe.unlink()


def write_whole(path: Path, parts: Sequence[Buffer], *, o_direct: bool = False) -> OSError | None:
    """Write ``parts`` as the file at ``path``, which appears only complete: they go to
    ``.<name>.<pid>.<thread>.tmp`` beside it (created exclusively: a writer never shares
    a temp file with another process on a shared directory), renamed over ``path``.

    With ``o_direct`` the file is written with ``O_DIRECT``, or buffered where the
    filesystem refuses it. Returns the error ``O_DIRECT`` was refused with, or None (the
    caller may stop asking for it).

    Raises:
        FileExistsError: the temp file exists (another writer's; left as it is).
        OSError: the file cannot be written (no temp file of this call is left behind).
    """
    tmp = path.parent / f".{path.stem}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    refused: OSError | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if o_direct:
            try:
                _write_new(tmp, flags | os.O_DIRECT, parts, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                refused = exc
                _unlink_quietly(tmp)
        if not o_direct or refused is not None:
            _write_new(tmp, flags, parts, direct=False)
        os.replace(tmp, path)
    except FileExistsError:
        raise  # the temp file is another writer's: never touched
    except OSError:
        _unlink_quietly(tmp)
        raise
    return refused


def _write_new(path: Path, flags: int, parts: Sequence[Buffer], *, direct: bool) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        if direct:
            write_direct(fd, parts, sum(len(p) for p in parts))
        else:
            write_all(fd, parts)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def read_object(
    path: str, key: str, allocate: Allocate, serde: Serde, *, o_direct: bool
) -> MemoryObj | None:
    """The chunk in the file at ``path``, stored under ``key``, in a fresh buffer from
    ``allocate`` (None when none could be had), verified, its ``checksum`` set.

    Raises:
        FileNotFoundError: no such file.
        CorruptObject: anything wrong in it (``wire``).
        OSError: it cannot be read.
    """
    if o_direct:
        return _read_whole_direct(path, lambda blob: wire.decode(blob, key, allocate, serde))
    with open(path, "rb", buffering=0) as f:
        header, offset = _read_header(f, key)
        obj = allocate(header.shape, header.dtype)
        if obj is None:
            return None
        try:
            if header.codec == NaiveSerde.name and header.layout == wire.CHUNK_LAYOUT:
                # The payload is the tensor's bytes: read it straight into the buffer.
                _read_payload(f.fileno(), header, offset, [tensor_bytes(obj.tensor)])
                obj.checksum, obj.verified = header.checksum, True
            else:
                wire.decode_into(header, f.read(), obj, serde)
        except BaseException:
            obj.ref_down()
            raise
        return obj


def read_object_into(path: str, key: str, chunk: ChunkBuffers, *, o_direct: bool) -> bool:
    """Read the chunk in the file at ``path``, stored under ``key``, into ``chunk.buffers``
    and verify it; False (nothing read) when it is stored in another format than
    ``chunk``'s (layout, codec, shape or dtype).

    NOTE: when this raises, the buffers may hold part of the file's (unverified) bytes.

    Raises:
        FileNotFoundError, CorruptObject, OSError: as ``read_object``.
    """
    if o_direct:
        return _read_whole_direct(path, lambda blob: _copy_into(blob, key, chunk))
    with open(path, "rb", buffering=0) as f:
        header, offset = _read_header(f, key)
        if not _stored_as(header, chunk):
            return False
        _read_payload(f.fileno(), header, offset, chunk.buffers)
        return True


def _stored_as(header: Header, chunk: ChunkBuffers) -> bool:
    """Whether the object of ``header`` is ``chunk``'s bytes as they are."""
    return (header.layout, header.codec, header.shape, header.dtype) == (
        chunk.layout,
        NaiveSerde.name,
        chunk.shape,
        chunk.dtype,
    )


def _read_header(f: BinaryIO, key: str) -> tuple[Header, int]:
    """The header of the object in the file ``f`` (at its start) and its payload offset."""
    header_len, header_checksum = wire.read_prefix(f.read(wire.PREFIX_SIZE))
    header = wire.parse_header(f.read(header_len), key, header_checksum)
    return header, wire.PREFIX_SIZE + header_len


def _read_payload(fd: int, header: Header, offset: int, buffers: Sequence[Buffer]) -> None:
    """The payload at ``offset`` into ``buffers`` (exactly its length), then verified."""
    if header.payload_len != sum(len(b) for b in buffers):
        raise CorruptObject(f"payload of {header.payload_len} bytes disagrees with its shape")
    got = read_into(fd, buffers, offset)
    if got < header.payload_len or os.fstat(fd).st_size != offset + header.payload_len:
        raise CorruptObject("file length disagrees with its header")
    wire.verify_payload(header, *buffers)


def _copy_into(blob: memoryview, key: str, chunk: ChunkBuffers) -> bool:
    header, payload = wire.split(blob, key)
    if not _stored_as(header, chunk):
        return False
    wire.verify_payload(header, payload)
    if len(payload) != chunk.nbytes:
        raise CorruptObject(f"payload of {len(payload)} bytes disagrees with its shape")
    offset = 0
    for target in byte_views(chunk.buffers):
        target[:] = payload[offset : offset + len(target)]
        offset += len(target)
    return True


def _read_whole_direct(path: str, consume: Callable[[memoryview], T]) -> T:
    """``consume`` the bytes of the file at ``path``, read with ``O_DIRECT``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        buffer = mmap.mmap(-1, max(round_up(size, DIRECT_ALIGN), DIRECT_ALIGN))
        try:
            got = os.preadv(fd, [buffer], 0)
            with memoryview(buffer) as view:
                return consume(view[: min(got, size)])
        finally:
            buffer.close()
    finally:
        os.close(fd)


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """A flat byte view of each non-empty buffer (what ``writev`` / ``sendmsg`` take)."""
    return [memoryview(b).cast("B") for b in buffers if len(b)]


def advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` after their first ``n`` bytes were moved."""
    skip = 0
    while skip < len(views) and n >= len(views[skip]):
        n -= len(views[skip])
        skip += 1
    views = views[skip:]
    if n:
        views[0] = views[0][n:]
    return views
