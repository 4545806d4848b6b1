"""Chunks as files: the local disk tier (``local_disk``) and the shared-filesystem tier
(``remote_url: fs:///mnt/shared``).

One file per chunk, in the wire format (``wire.py``), under a sharded tree::

    <root>/kvtier-v1/<h[0:2]>/<h[2:4]>/<h>.kvt      h = xxh3-128 hex of the key string

File names are fixed-length hashes because key strings can be longer than a file name may
be; the header inside holds the full key and a reader checks it.

NOTE: a file appears only complete. A writer writes ``.<h>.<pid>.<thread>.tmp`` in the
same directory and renames it over the final name (atomic on POSIX), so a crash leaves at
worst a stray ``.tmp`` file (removed at a later start-up once it is old) and never a torn
``.kvt`` file; a torn or otherwise damaged file would fail its checksum anyway and be a
miss. Several processes may share one tree: identical keys hold the same chunk (in
either byte order of ``wire``'s layouts), a rename over an existing file is harmless, and
a file deleted by another process is a miss.

Chunks come in and go out as buffers of kvtier's pool (``submit_put``, queued, and
``get_many``), or straight from and into memory the caller owns (``put_buffers`` and
``get_into``, synchronous: an engine's host pool, with no staging copy in between).

The files themselves are a ``file_store.FileStore`` (the byte store a ``kvtier serve``
keeps its disk in too). The local disk tier is capacity-bounded: its index (name → size,
in eviction-policy order) is rebuilt at start-up from the files present, oldest first,
and files written by another process are adopted when a lookup finds them. Each process
enforces the bound on the files it knows. The shared-filesystem tier has no bound and no
index (the directory is the index; many machines write to it).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import xxhash

from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Histogram, Stats, TierCounter, tier_counter
from kvtier.observability.tier_events import TierEventLog
from kvtier.storage import files, wire
from kvtier.storage.blob_store import Buffer
from kvtier.storage.file_store import FileStore
from kvtier.storage.serde import CorruptObject, Serde
from kvtier.storage.tier import PendingWrite, WriteQueue, count_refused
from kvtier.storage.wire import Allocate, ChunkBuffers
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

TREE = "kvtier-v1"

T = TypeVar("T")


class DirectRead(enum.Enum):
    """What ``FileTier.get_into`` did with one chunk."""

    LOADED = "loaded"  # its bytes are in the buffers, verified
    MISSING = "missing"  # absent, corrupt (counted, deleted) or unreadable: a miss
    OTHER_FORMAT = "other_format"  # stored otherwise than the buffers hold it: get_many


class FileTier:
    """Chunk files under ``root``.

    Args:
        root: the directory (created if missing).
        name: ``disk`` (local disk tier) or ``fs`` (shared filesystem); names counters.
        capacity_bytes: bound on the bytes of files kept (None: unbounded, no index).
        serde: the codec new files are written with.
        stats: counters.
        policy: eviction order (LRU | LFU | FIFO | MRU).
        o_direct: bypass the page cache (falls back to buffered I/O, with one warning,
            where the filesystem refuses O_DIRECT).
        workers: writer threads, and reader threads for batched gets.
        queue_capacity: most writes queued; more are dropped and counted.
        config_key: the config key that named ``root`` (for error messages).
        events: where the tier records the chunks it wrote and later lost (evicted,
            removed as corrupt, cleared); None: no records. Files found at start-up or
            written by another process are not announced (the CPU tier announces them
            once they are loaded).

    Raises:
        ValueError: ``root`` cannot be created or written to.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        name: str = "disk",
        capacity_bytes: int | None,
        serde: Serde,
        stats: Stats,
        policy: str = "LRU",
        o_direct: bool = False,
        workers: int = 2,
        queue_capacity: int = 256,
        config_key: str = "local_disk",
        events: TierEventLog | None = None,
    ):
        self.name = name
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.serde = serde
        self.stats = stats
        self.events = events
        self._lock = threading.Lock()  # guards _announced
        self._announced: dict[str, bytes] = {}  # file name -> chunk hash (events only)
        try:
            self.files = FileStore(
                root,
                TREE,
                capacity_bytes=capacity_bytes,
                policy=policy,
                o_direct=o_direct,
                describe=f"kvtier {name} tier",
                on_evict=self._evicted,
                on_full=self._evicted_for_space,
            )
        except OSError as exc:
            raise ValueError(
                f"{config_key}: cannot use {str(self.root)!r} as a kvtier {name} "
                f"directory: {exc.strerror or exc}"
            ) from None
        self.dir = self.files.dir
        self._readers = ThreadPoolExecutor(workers, thread_name_prefix=f"kvtier-{name}-reader")
        self._writes = WriteQueue(
            name, self._write_batch, stats, workers=workers, capacity=queue_capacity
        )

    def __repr__(self) -> str:
        return f"FileTier({self.name}, {str(self.root)!r})"

    # -- layout ----------------------------------------------------------------------

    @staticmethod
    @functools.lru_cache(maxsize=1 << 14)  # the recent prompts' chunks: lookups repeat them
    def file_name(key: CacheKey) -> str:
        """The file of ``key``: xxh3-128 of its canonical string, in hex."""
        return xxhash.xxh3_128_hexdigest(key.to_string().encode())

    def path_of(self, file_name: str) -> Path:
        return Path(self.files.path(file_name))

    def _evicted(self, file_name: str) -> None:
        """The store evicted ``file_name`` (under its lock)."""
        with self._lock:
            self._record_removed(file_name)
        self.stats.inc(tier_counter(self.name, TierCounter.EVICTIONS))

    def _evicted_for_space(self, files: int) -> None:
        """The store evicted ``files`` because the filesystem was full before its bound."""
        self.stats.inc(tier_counter(self.name, TierCounter.EVICTIONS_NO_SPACE), files)

    # -- reads -----------------------------------------------------------------------

    def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether each key's file is there. A capacity-bounded tier answers from its
        in-memory index (a use, for eviction order) and asks the filesystem only about
        names it does not know (written by another process sharing the directory).

        NOTE: a file deleted behind the index's back is a hit here and a miss at the read
        (the index forgets it then): the load fails and vLLM recomputes those blocks.
        """
        present = self.files.contains_many([self.file_name(key) for key in keys])
        self.stats.inc(tier_counter(self.name, TierCounter.LOOKUP_HITS), sum(present))
        return present

    def indexed(self, key: CacheKey) -> bool:
        """Whether this tier's index holds ``key``'s file, answered from memory (no I/O):
        False for an unbounded tier, which has no index, and for a file another process
        wrote that no lookup has adopted yet. A hit is a use, for eviction order, as a
        write of a file already there is."""
        return self.files.touch(self.file_name(key))

    def get_many(self, keys: Sequence[CacheKey], allocate: Allocate) -> list[MemoryObj | None]:
        with self._batched_get(keys):
            return self._map(lambda key: self._read(key, allocate), keys)

    def _read(self, key: CacheKey, allocate: Allocate) -> MemoryObj | None:
        file_name = self.file_name(key)
        obj = self._attempt(
            file_name,
            lambda path: files.read_object(
                path, key.to_string(), allocate, self.serde, o_direct=self.files.o_direct
            ),
        )
        self._count_get(file_name, None if obj is None else obj.data_nbytes)
        return obj

    def get_into(self, items: Sequence[tuple[CacheKey, ChunkBuffers]]) -> list[DirectRead]:
        """Read each chunk straight into its buffers (memory the caller owns, such as an
        engine's host pool) and verify it there; in parallel across chunks.

        LOADED only once the bytes in the buffers matched the stored checksum. After
        MISSING the buffers may hold part of a damaged file (the caller must not use
        them). OTHER_FORMAT: nothing was read; the chunk is stored in another layout or
        codec, which ``get_many`` decodes. A fault is a miss (counted), never raised.
        """
        with self._batched_get(items):
            return self._map(lambda item: self._read_into(*item), items)

    def _read_into(self, key: CacheKey, chunk: ChunkBuffers) -> DirectRead:
        file_name = self.file_name(key)
        done = self._attempt(
            file_name,
            lambda path: files.read_object_into(
                path, key.to_string(), chunk, o_direct=self.files.o_direct
            ),
        )
        if done is False:
            return DirectRead.OTHER_FORMAT
        self._count_get(file_name, chunk.nbytes if done else None)
        return DirectRead.LOADED if done else DirectRead.MISSING

    def _map(self, fn: Callable[[T], object], items: Sequence[T]) -> list:
        """``fn`` of each item, on the tier's reader threads when there are several."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(self._readers.map(fn, items))

    def _attempt(self, file_name: str, read: Callable[[str], T]) -> T | None:
        """``read(path)`` of a chunk file; None when it failed: the file is gone (then
        forgotten), corrupt (counted, deleted) or unreadable (counted)."""
        path = self.files.path(file_name)
        try:
            return read(path)
        except FileNotFoundError:  # deleted behind the index's back: forget it
            self.files.forget(file_name)
            with self._lock:
                self._record_removed(file_name)
        except CorruptObject as exc:
            self._reject(file_name, Path(path), exc)
        except OSError as exc:
            self.stats.inc(tier_counter(self.name, TierCounter.ERRORS))
            self._warn_per_cause("read", path, exc, "those chunks are misses")
        return None

    @contextlib.contextmanager
    def _batched_get(self, items: Sequence[object]) -> Iterator[None]:
        """Time one batched read of ``items`` (its chunks are read in parallel): one
        latency observation per batch, as every tier counts its gets."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if items:
                elapsed = time.perf_counter() - started
                self.stats.inc(tier_counter(self.name, TierCounter.GET_SECONDS), elapsed)
                self.stats.observe(tier_counter(self.name, Histogram.TIER_GET), elapsed)

    def _count_get(self, file_name: str, nbytes: int | None) -> None:
        """Count one chunk read: a hit of ``nbytes`` (a use, for eviction order), or a
        miss."""
        if nbytes is None:
            self.stats.inc(tier_counter(self.name, TierCounter.GET_MISSES))
            return
        self.files.touch(file_name)
        self.stats.inc(tier_counter(self.name, TierCounter.GET_HITS))
        self.stats.inc(tier_counter(self.name, TierCounter.GET_BYTES), nbytes)

    def _reject(self, file_name: str, path: Path, exc: CorruptObject) -> None:
        count_refused(self.stats, self.name, str(path), exc)
        with contextlib.suppress(OSError):
            self.files.delete(file_name)
        with self._lock:
            self._record_removed(file_name)

    def _record_removed(self, file_name: str) -> None:
        """Under the lock: a file this tier announced is gone."""
        chunk_hash = self._announced.pop(file_name, None)
        if chunk_hash is not None and self.events is not None:
            self.events.removed(self.name, chunk_hash)

    # -- writes ----------------------------------------------------------------------

    def submit_put(self, key: CacheKey, obj: MemoryObj) -> bool:
        return self._writes.submit(key, obj)

    def put_buffers(self, items: Sequence[tuple[CacheKey, ChunkBuffers]]) -> list[bool]:
        """Write each chunk straight from its buffers (memory the caller owns, such as an
        engine's host pool: no staging copy, no queue), one after another in the calling
        thread (two threads were no faster into the page cache), and return once every
        file is complete as a queued write completes it. The payload is the buffers'
        bytes verbatim (naive codec) and the checksum is computed over those same bytes,
        so they must not change until this returns.

        Returns True for each chunk stored or already there, False for one dropped
        (counted: no space, a write error). Never raises on a store fault.
        """
        return [
            self._write(
                key, functools.partial(wire.encode_buffers, key.to_string(), chunk), chunk.nbytes
            )
            for key, chunk in items
        ]

    def _write_batch(self, batch: list[PendingWrite]) -> None:
        for key, obj in batch:
            encode = functools.partial(
                wire.encode, key.to_string(), obj.tensor, self.serde, checksum=obj.checksum
            )
            self._write(key, encode, obj.data_nbytes)

    def _write(self, key: CacheKey, encode: Callable[[], list[Buffer]], raw_nbytes: int) -> bool:
        """Write the object ``encode()`` makes (called only when the key's file is not
        there yet); True once the file is complete or was already there."""
        started = time.perf_counter()
        file_name = self.file_name(key)
        if os.path.isfile(self.files.path(file_name)):
            # already stored (by us or by another process sharing the tree); stored again
            # is a use, for eviction order (a producer that never loads keeps hot prefixes)
            self.files.touch(file_name)
            return True
        parts = encode()
        size = sum(len(p) for p in parts)
        try:
            written = self._write_file(file_name, parts)
        except OSError as exc:
            if exc.errno in files.NO_SPACE:
                self.stats.inc(tier_counter(self.name, TierCounter.DROPPED_NO_SPACE))
                warn_once(logger, f"kvtier {self.name} tier: {self.root} is full; stores skipped")
            else:
                self.stats.inc(tier_counter(self.name, TierCounter.DROPPED_ERROR))
                path = self.files.path(file_name)
                self._warn_per_cause("write", path, exc, "those stores are skipped")
            return False
        if not written:  # larger than the whole bound
            self.stats.inc(tier_counter(self.name, TierCounter.DROPPED_NO_SPACE))
            warn_once(
                logger,
                f"kvtier {self.name} tier: a chunk file of {size} bytes is larger than the "
                f"whole bound on {self.root} ({self.capacity_bytes} bytes); such stores are "
                "skipped (raise max_local_disk_size or lower chunk_size)",
            )
            return False
        if self.events is not None and key.layer is None:
            with self._lock:
                if file_name not in self._announced:
                    self._announced[file_name] = key.chunk_hash
                    self.events.stored(self.name, key.chunk_hash)
        self.stats.inc(tier_counter(self.name, TierCounter.PUT_CHUNKS))
        self.stats.inc(tier_counter(self.name, TierCounter.PUT_BYTES), size)
        self.stats.inc(tier_counter(self.name, TierCounter.PUT_RAW_BYTES), raw_nbytes)
        elapsed = time.perf_counter() - started
        self.stats.inc(tier_counter(self.name, TierCounter.PUT_SECONDS), elapsed)
        self.stats.observe(tier_counter(self.name, Histogram.TIER_PUT), elapsed)
        return True

    def _warn_per_cause(self, doing: str, path: str, exc: OSError, outcome: str) -> None:
        """Log a failed file operation once per cause (a read-only or failing disk fails
        every file alike: one warning, not one per chunk); each file at DEBUG."""
        cause = exc.strerror or type(exc).__name__
        warn_once(
            logger, f"kvtier {self.name} tier: cannot {doing} in {self.root} ({cause}); {outcome}"
        )
        logger.debug("kvtier %s tier: cannot %s %s: %s", self.name, doing, path, exc)

    def _write_file(self, file_name: str, parts: list[Buffer]) -> bool:
        """Write the file of ``file_name`` whole (``FileStore.write``); False when it is
        larger than the whole bound.

        Raises:
            OSError: it cannot be written.
        """
        return self.files.write(file_name, parts)

    # -- management ------------------------------------------------------------------

    def remove(self, key: CacheKey) -> bool:
        """Forget ``key`` and delete its file; whether there was one. A file the tree
        does not let kvtier delete (read-only) is warned about once, not raised: the
        caller is a load dropping a corrupt chunk."""
        file_name = self.file_name(key)
        with self._lock:
            self._record_removed(file_name)
        try:
            return self.files.delete(file_name)
        except OSError as exc:
            warn_once(logger, f"kvtier {self.name} tier: cannot delete {file_name} ({exc})")
            return False

    def clear(self) -> None:
        """Delete every chunk file in the tree (queued writes finish first)."""
        self._writes.flush(30.0)
        self.files.clear()
        with self._lock:
            self._announced.clear()
            if self.events is not None:
                self.events.cleared(self.name)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writes.flush(timeout)

    @property
    def pending_writes(self) -> int:
        """Writes queued or in flight."""
        return self._writes.pending

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunk files this process knows (bounded tier only)."""
        return self.files.used_bytes

    @property
    def directories(self) -> int:
        """Directories of the tier's tree (``FileStore.directories``)."""
        return self.files.directories

    def __len__(self) -> int:
        return len(self.files)

    def close(self) -> None:
        self._writes.close()
        self._readers.shutdown(wait=True)
