"""How the server keeps a blob in the engine's own tier classes: in memory, a byte object
of the CPU tier (``kvtier.storage.cpu.LocalCPUTier``, where an engine keeps its chunks);
on disk, a file of a ``kvtier.storage.file_store.FileStore`` (the store under the disk
tier).

A blob is addressed by ``(namespace, name)``: the namespace is the one a client declared
when it connected (its model, percent-encoded), the name is the client's (a kvtier key
string). Neither tier looks inside a blob; kvtier clients send wire-format objects
(``kvtier.storage.wire``), which carry their own checksums and are verified by the
client that reads them (a peer's pull verifies them too, and asks the holder to drop a
blob that fails: ``drop_corrupt``, which checks the bytes itself first; a blob in a
newer kvtier's format passes both, unchecked: ``damaged``). On disk a blob is the file
``<root>/kvtier-server-v1/<ns>/<h[0:2]>/<h[2:4]>/<h>.kvt`` (``disk_name``).

Both tiers are thread-safe and never hold more than their bound: a blob larger than the
whole bound is refused, anything else evicts least recently used blobs until it fits
(never one being read, in memory: ``kvtier.storage.cpu``). A put of a name stored
already replaces its blob.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import xxhash

from kvtier.memory import MemoryObj
from kvtier.storage.blob_store import Buffer
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.file_store import FileStore
from kvtier.storage.serde import CorruptObject, NewerFormat, tensor_bytes
from kvtier.storage.wire import split, verify_payload

logger = logging.getLogger(__name__)

BlobId = tuple[str, str]  # (namespace, name)
TREE = "kvtier-server-v1"
MEMORY_ALIGNMENT = 64  # bytes: every blob in memory starts at a cache line
T = TypeVar("T")


def put_in_memory(tier: LocalCPUTier, blob_id: BlobId, data: Buffer) -> bool:
    """Keep a copy of ``data`` in ``tier`` under ``blob_id``, in place of what was there;
    False when the tier has no room for it (larger than the tier, or what would have to
    go is being read).

    A blob of n bytes is a uint8 object of n + 1 bytes (the pool has no empty buffers),
    its first n; the copy in is made outside the tier's lock, so other clients' reads and
    puts go on meanwhile.
    """
    size = len(data)
    obj = allocate_in_memory(tier, size)
    if obj is None:
        return False
    try:
        if size:
            view_of(obj)[:size] = memoryview(data).cast("B")
        tier.replace(blob_id, obj)  # a concurrent put of the same name: the last one wins
    finally:
        obj.ref_down()
    return True


def allocate_in_memory(tier: LocalCPUTier, size: int) -> MemoryObj | None:
    """A buffer of ``tier`` for a blob of ``size`` bytes (to fill, then ``tier.replace``),
    or None when the tier has no room for it."""
    return tier.allocate((size + 1,), torch.uint8)


def view_of(obj: MemoryObj) -> memoryview:
    """The blob that a memory-tier object holds: its bytes but the last."""
    return tensor_bytes(obj.tensor)[:-1]


def read_in_memory(
    tier: LocalCPUTier, blob_id: BlobId, consume: Callable[[memoryview], T]
) -> T | None:
    """``consume(view of the blob)`` while this read holds it (the tier evicts nothing
    being read); None when absent. The view is valid only during the call."""
    obj = tier.get(blob_id)
    if obj is None:
        return None
    try:
        return consume(view_of(obj))
    finally:
        obj.ref_down()


def clear_memory(tier: LocalCPUTier, namespace: str | None) -> int:
    """Drop every blob (of ``namespace`` only, when given); returns how many."""
    stored = tier.keys()  # a copy: removing as we go is safe
    return sum(tier.remove(b) for b in stored if namespace is None or b[0] == namespace)


def open_memory(capacity_bytes: int, memory: torch.Tensor | None = None) -> LocalCPUTier:
    """The server's memory tier: an LRU ``LocalCPUTier`` of ``capacity_bytes`` in pageable
    memory (no GPU copies from it), with counters of its own (``memory_evictions``).
    ``memory``: the bytes to carve it from (``capacity_bytes + MEMORY_ALIGNMENT``), or
    None for its own."""
    return LocalCPUTier(
        capacity_bytes, "LRU", alignment=MEMORY_ALIGNMENT, pin_memory=False, memory=memory
    )


def open_disk(root: str, capacity_bytes: int) -> FileStore:
    """The server's disk tier: an LRU ``FileStore`` under ``<root>/kvtier-server-v1`` of
    at most ``capacity_bytes``, its index rebuilt from the files present.

    Raises:
        ValueError: ``root`` cannot be created or written to (naming ``--local-disk``).
    """
    try:
        return FileStore(root, TREE, capacity_bytes=capacity_bytes, describe="kvtier server disk")
    except OSError as exc:
        path = str(Path(root))
        raise ValueError(f"--local-disk: cannot use {path!r}: {exc.strerror or exc}") from None


def disk_name(blob_id: BlobId) -> str:
    """The file name of ``blob_id``: ``<ns>/<h>``, the xxh3-64 hex of the namespace and
    the xxh3-128 hex of the name (a file holds the blob exactly)."""
    namespace, name = blob_id
    return f"{namespace_prefix(namespace)}/{xxhash.xxh3_128_hexdigest(name.encode())}"


def namespace_prefix(namespace: str) -> str:
    """Where ``namespace``'s files are in the server's disk: the xxh3-64 hex of it."""
    return xxhash.xxh3_64_hexdigest(namespace.encode())


def read_from_disk(disk: FileStore, blob_id: BlobId) -> bytes | None:
    """The blob's bytes, or None when its file is not there (one gone behind the index's
    back is forgotten)."""
    name = disk_name(blob_id)
    if not disk.contains_many([name])[0]:
        return None
    try:
        with open(disk.path(name), "rb") as f:
            return f.read()
    except OSError:
        disk.forget(name)
        return None


def write_to_disk(disk: FileStore, blob_id: BlobId, data: Buffer) -> bool:
    """Write ``data`` as the file of ``blob_id``; False when it does not fit or cannot be
    written (a full disk, an I/O error: logged)."""
    name = disk_name(blob_id)
    try:
        return disk.write(name, [data])
    except OSError as exc:
        logger.warning("kvtier server: cannot write %s: %s", disk.path(name), exc)
        return False


def damaged(blob: memoryview, name: str) -> bool:
    """Whether ``blob`` fails the checks of a wire-format object of key ``name``. An
    object in a newer kvtier's format (``NewerFormat``) is not taken for damaged: this
    server cannot check it, and the engines that read it check it themselves."""
    try:
        header, payload = split(blob, name)
        verify_payload(header, payload)
    except NewerFormat:
        return False
    except CorruptObject:
        return True
    return False


def drop_corrupt(memory: LocalCPUTier, disk: FileStore | None, blob_id: BlobId) -> bool:
    """Remove the copy of ``blob_id`` in memory and the one on disk, each only if its own
    bytes are ``damaged`` (whoever reported it corrupt is not trusted: the bytes may have
    been damaged on their way); whether one was removed."""
    name = blob_id[1]
    dropped = False
    if read_in_memory(memory, blob_id, lambda blob: damaged(blob, name)):
        dropped = memory.remove(blob_id)
    if disk is not None:
        data = read_from_disk(disk, blob_id)
        if data is not None and damaged(memoryview(data), name):
            dropped = disk.delete(disk_name(blob_id)) or dropped
    return dropped
