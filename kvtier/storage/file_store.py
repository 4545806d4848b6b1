"""A directory of byte files by name, each written whole, optionally within a byte bound:
the store under the disk tier (``storage.disk.FileTier``, one file per chunk) and under
a ``kvtier serve``'s disk (one file per blob).

A name is ``[<prefix>/]<h>`` (``h`` a hex hash); its file is, in a sharded tree so that no
directory grows huge::

    <root>/<tree>/[<prefix>/]<h[0:2]>/<h[2:4]>/<h>.kvt

A bounded store keeps an index (``policy.SizedIndex``: name → size, in eviction-policy
order), rebuilt at start-up from the files present, oldest first, and evicts in policy
order to stay within the bound; a file larger than the whole bound is refused. The index
answers for the names it knows without a filesystem call; a name it does not know is
looked up on the filesystem and, when found (another process wrote it into the
directory), adopted within the bound (evicting as a write does). An unbounded store has
no index: the directory is the index.

The bound is on the files' bytes. The tree's directories stay once made (``directories``
counts them, beside ``used_bytes``).

NOTE: a file appears only complete (``files.write_whole``: a temp file renamed over its
name), so a reader sees a whole file or none; ``clear`` deletes only whole files and
leaves other writers' temp files alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.storage.blob_store import Buffer
from kvtier.storage.files import (
    NO_SPACE,
    SUFFIX,
    probe_writable,
    scan_tree,
    sharded_path,
    write_whole,
)
from kvtier.storage.policy import SizedIndex
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)


class FileStore:
    """Files by name under ``<root>/<tree>``. Thread-safe (one lock).

    Args:
        root: the directory (created if missing).
        tree: the store's directory inside ``root`` (the format's version).
        capacity_bytes: the bound on the bytes of files kept (None: unbounded, no index).
        policy: the eviction order (LRU | LFU | FIFO | MRU).
        o_direct: write (and let readers read) with O_DIRECT; given up, with one warning,
            where the filesystem refuses it.
        describe: how logs name the store (``kvtier disk tier``).
        on_evict: called with each name the store evicts, as it does (under its lock).
        on_full: called with how many files the store evicted because the filesystem was
            full before its bound (after ``on_evict`` for each).

    Raises:
        OSError: ``root`` cannot be created or written to.
    """

    def __init__(
        self,
        root: str | Path,
        tree: str,
        *,
        capacity_bytes: int | None,
        policy: str = "LRU",
        o_direct: bool = False,
        describe: str,
        on_evict: Callable[[str], object] | None = None,
        on_full: Callable[[int], object] | None = None,
    ):
        self.root = Path(root)
        self.dir = self.root / tree
        self._dir_str = str(self.dir)
        self.capacity_bytes = capacity_bytes
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.describe = describe
        self.evictions = 0
        self._on_evict, self._on_full = on_evict, on_full
        self._index = SizedIndex(capacity_bytes, policy)  # bounded store only
        self._directories: set[str] = set()  # relative to ``dir``: those known to exist
        self._lock = threading.Lock()
        probe_writable(self.dir)
        if self.bounded:
            self._scan()

    def __repr__(self) -> str:
        return f"FileStore({str(self.dir)!r})"

    @property
    def bounded(self) -> bool:
        return self.capacity_bytes is not None

    def path(self, name: str) -> str:
        """The file of ``name`` (plain strings, not pathlib: a lookup of a 32k-token
        prompt is 128 of these)."""
        prefix, _, hashed = name.rpartition("/")
        return sharded_path(f"{self._dir_str}/{prefix}" if prefix else self._dir_str, hashed)

    def _scan(self) -> None:
        """Rebuild the index from the files present, oldest first (start-up)."""
        started = time.monotonic()
        found, directories = scan_tree(self.dir)
        with self._lock:
            self._directories |= {os.path.relpath(d, self.dir) for d in directories}
        for _, name, size in found:
            self._index.add(name, size)
        if found:
            logger.info(
                "%s: %d files (%.1f MiB) found in %s in %.1f s",
                self.describe,
                len(found),
                self._index.used / 2**20,
                self.dir,
                time.monotonic() - started,
            )
        with self._lock:
            self._evict(self._index.make_room(0) or [])

    def _evict(self, victims: list) -> None:
        """Under the lock: delete the files the index evicted."""
        for name in victims:
            with contextlib.suppress(OSError):  # another process removed it
                os.unlink(self.path(name))
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(name)

    # -- lookups ---------------------------------------------------------------------

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name's file is there: from the index (a use, for eviction order)
        for the names it knows, from the filesystem (one ``os.stat`` each, the file then
        adopted) for the others.

        An adopted file counts toward the bound as a written one does: files are evicted
        in policy order to make room for it (a name this call evicts is absent in its
        answer), and one larger than the whole bound is not indexed.

        NOTE: a file deleted behind the index's back is a hit here and a miss at the read
        (``forget`` it then).
        """
        present = [False] * len(names)
        unknown: Sequence[int] = range(len(names))
        if self.bounded:
            with self._lock:
                unknown = []
                for i, name in enumerate(names):
                    if self._index.touch(name):
                        present[i] = True
                    else:
                        unknown.append(i)
        evicted: set[str] = set()
        for i in unknown:
            try:
                found = os.stat(self.path(names[i]))
            except OSError:
                continue
            if not stat.S_ISREG(found.st_mode):  # a directory or device in a file's place
                continue
            size = found.st_size
            present[i] = True
            if self.bounded:
                with self._lock:
                    victims = self._index.reserve(names[i], size) or []
                    self._evict(victims)
                evicted.update(victims)
        if evicted:
            present = [
                there and name not in evicted for there, name in zip(present, names, strict=True)
            ]
        return present

    def touch(self, name: str) -> bool:
        """A use of ``name`` (a read), for eviction order; whether the index knows it,
        from memory alone (always False for an unbounded store, which has no index)."""
        if not self.bounded:
            return False
        with self._lock:
            return self._index.touch(name)

    def forget(self, name: str) -> None:
        """``name``'s file is gone (deleted behind the index's back)."""
        with self._lock:
            self._index.drop(name)

    # -- changes ---------------------------------------------------------------------

    def write(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Write ``parts`` as the file of ``name`` (in place of any file there), evicting
        in policy order to stay within the bound. False (nothing written, nothing
        evicted) when the file would be larger than the whole bound. A bounded store
        whose filesystem is full (``ENOSPC``, ``EDQUOT``) evicts its file's size in
        policy order and writes it again, once: a disk smaller than the bound keeps
        taking new files as a full bound does.

        Raises:
            OSError: it cannot be written (its room in the index is given back).
        """
        size = sum(len(p) for p in parts)
        if self.bounded:
            with self._lock:
                victims = self._index.reserve(name, size)
                if victims is None:
                    return False
                self._evict(victims)
        path = self.path(name)
        try:
            try:
                refused = write_whole(Path(path), parts, o_direct=self.o_direct)
            except OSError as exc:
                if exc.errno not in NO_SPACE or not self._shed(name, size):
                    raise
                refused = write_whole(Path(path), parts, o_direct=self.o_direct)
                warn_once(
                    logger,
                    f"{self.describe}: {self.root} is full before its bound of "
                    f"{self.capacity_bytes} bytes; files evicted to make room (a bound no "
                    "larger than the free space keeps the tier from filling the filesystem)",
                )
        except OSError:
            self.forget(name)
            raise
        self._made_directories(path)
        if self.bounded:
            self._drop_if_gone(name)
        if refused is not None:
            self.o_direct = False
            warn_once(
                logger,
                f"{self.describe}: {self.root} does not support O_DIRECT ({refused}); "
                "using buffered I/O",
            )
        return True

    def _shed(self, name: str, size: int) -> bool:
        """The filesystem is full before the bound is reached (it is smaller than the
        bound, or other files fill it): evict files in policy order to free ``size``
        bytes for ``name``'s, and three inodes (its file and two shard directories);
        whether any was evicted (then the write is tried again)."""
        if not self.bounded:
            return False
        with self._lock:
            victims = self._index.shed(size, keep=name, at_least=3)
            self._evict(victims)
        if victims and self._on_full is not None:
            self._on_full(len(victims))
        return bool(victims)

    def _made_directories(self, path: str) -> None:
        """Note the directories of ``path``, a file just written, below ``dir`` (the
        write made those that were missing)."""
        parent = os.path.dirname(path[len(self._dir_str) + 1 :])
        with self._lock:
            while parent and parent not in self._directories:
                self._directories.add(parent)
                parent = os.path.dirname(parent)

    def _drop_if_gone(self, name: str) -> None:
        """Delete the file of ``name``, just written, if another thread evicted or deleted
        the name while it was being written: it would stay on disk outside the index
        and the bound (evicting it removed no file yet)."""
        with self._lock:
            if name not in self._index:
                with contextlib.suppress(OSError):
                    os.unlink(self.path(name))

    def delete(self, name: str) -> bool:
        """Delete ``name``'s file; whether there was one."""
        self.forget(name)
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            return False
        return True

    def clear(self, prefix: str | None = None) -> int:
        """Delete every file (of the names under ``prefix/`` only, when given); returns
        how many."""
        top = self.dir if prefix is None else self.dir / prefix
        deleted = 0
        for dirpath, _, files in os.walk(top):
            for file in files:
                if file.endswith(SUFFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(dirpath, file))
                        deleted += 1
        with self._lock:
            for name in self._index.names():
                if prefix is None or name.startswith(f"{prefix}/"):
                    self._index.drop(name)
        return deleted

    @property
    def used_bytes(self) -> int:
        """Bytes of the files this store knows (bounded store only)."""
        with self._lock:
            return self._index.used

    @property
    def directories(self) -> int:
        """Directories of the tree, each a filesystem block beside the files: those found
        at start-up (bounded store) and those writes made since. They are not removed
        as their files go: a bounded tree keeps up to 65,792 per prefix
        (``<h[0:2]>/`` and ``<h[0:2]>/<h[2:4]>/``)."""
        with self._lock:
            return len(self._directories)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)
