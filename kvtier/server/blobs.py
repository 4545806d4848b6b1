"""The server's blobs in the tiers' stores: in memory, a byte object of the CPU tier
(``kvtier.storage.cpu.LocalCPUTier``, the class an engine keeps its chunks in); on disk,
a bounded directory of files.

A blob is addressed by ``(namespace, name)``: the namespace is the one a client declared
when it connected (its model, percent-encoded), the name is the client's (a kvtier key
string). Neither store looks inside a blob; kvtier clients send wire-format objects
(``kvtier.storage.wire``), which carry their own checksums and are verified by the
client that reads them.

Both stores are thread-safe and never hold more than their bound: a blob larger than
the whole bound is refused, anything else evicts least recently used blobs until it
fits (never one being read, in memory: ``kvtier.storage.cpu``). The disk's index is the
tiers' own (``kvtier.storage.policy.SizedIndex``): an overwritten blob is a new entry of
its new size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import xxhash

from kvtier.storage.blob_store import Buffer
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.files import probe_writable, scan_tree, sharded_path, write_whole
from kvtier.storage.policy import SizedIndex
from kvtier.storage.serde import tensor_bytes

logger = logging.getLogger(__name__)

BlobId = tuple[str, str]  # (namespace, name)
TREE = "kvtier-server-v1"
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
    obj = tier.allocate((size + 1,), torch.uint8)
    if obj is None:
        return False
    try:
        if size:
            tensor_bytes(obj.tensor)[:size] = memoryview(data).cast("B")
        tier.replace(blob_id, obj)  # a concurrent put of the same name: the last one wins
    finally:
        obj.ref_down()
    return True


def read_in_memory(
    tier: LocalCPUTier, blob_id: BlobId, consume: Callable[[memoryview], T]
) -> T | None:
    """``consume(view of the blob)`` while this read holds it (the tier evicts nothing
    being read); None when absent. The view is valid only during the call."""
    obj = tier.get(blob_id)
    if obj is None:
        return None
    try:
        return consume(tensor_bytes(obj.tensor)[:-1])
    finally:
        obj.ref_down()


def clear_memory(tier: LocalCPUTier, namespace: str | None) -> int:
    """Drop every blob (of ``namespace`` only, when given); returns how many."""
    stored = tier.keys()  # a copy: removing as we go is safe
    return sum(tier.remove(b) for b in stored if namespace is None or b[0] == namespace)


def open_memory(capacity_bytes: int) -> LocalCPUTier:
    """The server's memory tier: an LRU ``LocalCPUTier`` of ``capacity_bytes`` in pageable
    memory (no GPU copies from it), with counters of its own (``memory_evictions``)."""
    return LocalCPUTier(capacity_bytes, "LRU", alignment=64, pin_memory=False)


class DiskBlobs:
    """Blobs as files under ``root``, at most ``capacity_bytes`` of them.

    Layout: ``<root>/kvtier-server-v1/<ns>/<h[0:2]>/<h[2:4]>/<h>.kvt`` where ``ns`` is the
    xxh3-64 hex of the namespace and ``h`` the xxh3-128 hex of the name; a file holds the
    blob exactly (for kvtier clients, a wire-format object: the disk tier's file format).

    NOTE: a file appears only complete: it is written as the disk tier writes its files
    (``storage.files.write_whole``: a temp file renamed over its name). The directory belongs to this server
    alone, so the index (rebuilt from the files at start-up, oldest first) is the truth
    and lookups never touch the disk.

    Raises:
        ValueError: ``root`` cannot be created or written to (naming ``--local-disk``).
    """

    def __init__(self, root: str | Path, capacity_bytes: int):
        self.root = Path(root)
        self.dir = self.root / TREE
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index = SizedIndex(capacity_bytes, "LRU")  # "<ns>/<h>" -> bytes
        self.evictions = 0
        try:
            probe_writable(self.dir)
        except OSError as exc:
            raise ValueError(
                f"--local-disk: cannot use {str(self.root)!r}: {exc.strerror or exc}"
            ) from None
        for ns_dir in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            for _, file_name, size in scan_tree(ns_dir):
                self._index.add(f"{ns_dir.name}/{file_name}", size)
        with self._lock:
            self._evict(self._index.make_room(0) or [])
        if self._index:
            logger.info(
                "kvtier server: %d blobs (%.1f MiB) found in %s",
                len(self._index),
                self._index.used / 2**20,
                self.dir,
            )

    @staticmethod
    def file_id(blob_id: BlobId) -> str:
        namespace, name = blob_id
        ns = xxhash.xxh3_64_hexdigest(namespace.encode())
        return f"{ns}/{xxhash.xxh3_128_hexdigest(name.encode())}"

    def _path(self, file_id: str) -> str:
        ns, _, file_name = file_id.partition("/")
        return sharded_path(f"{self.dir}/{ns}", file_name)

    def _evict(self, victims: list) -> None:
        """Under the lock: delete the files the index evicted."""
        for file_id in victims:
            with contextlib.suppress(OSError):
                os.unlink(self._path(file_id))
            self.evictions += 1

    def put(self, blob_id: BlobId, data: Buffer) -> bool:
        """Write ``data`` under ``blob_id``; False when it does not fit or cannot be written
        (a full disk, an I/O error: logged once per cause)."""
        size = len(data)
        file_id = self.file_id(blob_id)
        path = Path(self._path(file_id))
        with self._lock:
            victims = self._index.reserve(file_id, size)  # undone on failure
            if victims is None:
                return False
            self._evict(victims)
        try:
            write_whole(path, [data])
        except OSError as exc:
            with self._lock:
                self._index.drop(file_id)
            logger.warning("kvtier server: cannot write %s: %s", path, exc)
            return False
        return True

    def get(self, blob_id: BlobId) -> bytes | None:
        file_id = self.file_id(blob_id)
        with self._lock:
            if not self._index.touch(file_id):
                return None
        try:
            with open(self._path(file_id), "rb") as f:
                return f.read()
        except OSError:
            with self._lock:
                self._index.drop(file_id)
            return None

    def contains(self, blob_id: BlobId) -> bool:
        with self._lock:
            return self.file_id(blob_id) in self._index

    def delete(self, blob_id: BlobId) -> bool:
        file_id = self.file_id(blob_id)
        with self._lock:
            present = self._index.drop(file_id)
        with contextlib.suppress(OSError):
            os.unlink(self._path(file_id))
        return present

    def clear(self, namespace: str | None = None) -> int:
        """Delete every blob (of ``namespace`` only, when given); returns how many."""
        prefix = None if namespace is None else self.file_id((namespace, ""))[:16] + "/"
        with self._lock:
            doomed = [f for f in self._index.names() if prefix is None or f.startswith(prefix)]
            for file_id in doomed:
                self._index.drop(file_id)
            ns_dirs = {f.partition("/")[0] for f in doomed}
            if prefix is not None:
                ns_dirs.add(prefix[:-1])
            for ns in ns_dirs:
                shutil.rmtree(self.dir / ns, ignore_errors=True)
        return len(doomed)

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def __len__(self) -> int:
        return len(self._index)
