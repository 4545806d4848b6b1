"""What a ``kvtier serve`` holds: memory, then an optional disk directory, then an
optional remote blob store behind it, all of opaque blobs by ``(namespace, name)``.

::

    put  ──▶ memory (bounded LRU) ──▶ disk (bounded, synchronous) ──▶ remote (queued)
    get  ◀── memory ◀── disk (copied up to memory) ◀── remote (copied up to memory, disk)

The remote is written through from a bounded queue by one writer thread: a full queue or
a remote that is down drops the write (counted), never blocks a client. A remote that
fails or is slower than ``remote_timeout_ms`` is a miss and is skipped until a ping
answers (checked at most every ``remote_reconnect_max_ms``).

The remote is any scheme whose module defines ``open_store`` (Redis/Valkey, S3): for each
client namespace the server opens the store that an engine of that namespace would open
itself, so engines that reach the remote directly and engines behind a server share the
same objects.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.config import KVTierConfig
from kvtier.metrics import Stats
from kvtier.server.blobs import BlobId, DiskBlobs, MemoryBlobs
from kvtier.server.lookup import KeyShapes
from kvtier.storage import remotes
from kvtier.storage.backend import BlobStore, Buffer
from kvtier.storage.remote import RemoteRequest
from kvtier.storage.remotes import redact_url
from kvtier.storage.serde import make_serde

logger = logging.getLogger(__name__)

_STOP = object()
T = TypeVar("T")


class RemoteBlobs:
    """The remote behind the server: one ``BlobStore`` per client namespace, with
    timeouts, a down state and a write-through queue.

    Raises:
        ValueError: the URL's scheme cannot sit behind a server (naming ``--remote-url``).
    """

    def __init__(self, config: KVTierConfig, stats: Stats):
        url = config.remote_url
        assert url is not None
        module = remotes.load_module(url)
        if not hasattr(module, "open_store"):
            raise ValueError(
                f"--remote-url {redact_url(url)!r}: this scheme is not a blob store a server "
                "can write through (use redis://, valkey:// or s3://; for a directory use "
                "--local-disk)"
            )
        self._open_store: Callable[[RemoteRequest], BlobStore] = module.open_store
        self.describe = redact_url(url)
        self._config = config
        self._stats = stats
        self._serde = make_serde("naive")
        self._stores: dict[str, BlobStore] = {}
        self._lock = threading.Lock()
        self.timeout_s = config.remote_timeout_ms / 1000
        self._retry_s = config.remote_reconnect_max_ms / 1000
        self._down_until = 0.0
        self._calls = ThreadPoolExecutor(8, thread_name_prefix="kvtier-server-remote")
        self._queue: queue.Queue[Any] = queue.Queue(config.store_queue_size)
        self._writer = threading.Thread(target=self._drain, name="kvtier-server-writer")
        self._writer.start()

    def _store(self, namespace: str) -> BlobStore:
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                request = RemoteRequest(
                    self._config.remote_url or "", self._config, self._serde, self._stats, namespace
                )
                store = self._stores[namespace] = self._open_store(request)
            return store

    @property
    def is_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` within the timeout; None when the remote is down or fails."""
        if not self.is_up:
            return None
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except Exception as exc:
            future.cancel()
            self._stats.inc("remote_errors")
            if self.is_up:
                logger.warning(
                    "kvtier server: remote %s failed (%s: %s); skipped for %.1f s",
                    self.describe,
                    what,
                    type(exc).__name__ or "timeout",
                    self._retry_s,
                )
            self._down_until = time.monotonic() + self._retry_s
            return None

    def exists_many(self, namespace: str, names: Sequence[str]) -> list[bool]:
        found = self._call("exists", lambda: self._store(namespace).exists_many(names))
        return list(found) if found is not None else [False] * len(names)

    def get(self, namespace: str, name: str) -> bytes | None:
        found = self._call("get", lambda: self._store(namespace).get_many([name]))
        return None if found is None else found[0]

    def submit_put(self, namespace: str, name: str, data: bytes) -> None:
        if not self.is_up:
            self._stats.inc("remote_puts_dropped")
            return
        try:
            self._queue.put_nowait((namespace, name, data))
        except queue.Full:
            self._stats.inc("remote_puts_dropped")

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            namespace, name, data = item
            try:
                if self.is_up:
                    self._store(namespace).put_many([(name, [data])])
                    self._stats.inc("remote_puts")
                else:
                    self._stats.inc("remote_puts_dropped")
            except Exception as exc:
                self._stats.inc("remote_puts_dropped")
                self._stats.inc("remote_errors")
                self._down_until = time.monotonic() + self._retry_s
                logger.warning("kvtier server: remote write failed: %s", exc)
            finally:
                self._queue.task_done()

    def delete(self, namespace: str, names: Sequence[str]) -> None:
        self._call("delete", lambda: self._store(namespace).delete_many(names))

    def clear(self, namespace: str | None) -> None:
        with self._lock:
            spaces = list(self._stores) if namespace is None else [namespace]
        for space in spaces:
            self._call("clear", lambda s=space: self._store(s).clear())

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float) -> None:
        """Finish queued writes for at most ``timeout`` seconds, drop the rest, close."""
        deadline = time.monotonic() + timeout
        while self._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        while True:  # drop what is left: whole writes, never a part of one
            try:
                self._queue.get_nowait()
                self._queue.task_done()
                self._stats.inc("remote_puts_dropped")
            except queue.Empty:
                break
        self._queue.put(_STOP)
        self._writer.join(timeout=max(deadline - time.monotonic(), 0) + self.timeout_s)
        self._calls.shutdown(wait=False, cancel_futures=True)
        for store in self._stores.values():
            store.close()


class BlobCache:
    """The server's tiers. Thread-safe; every call is synchronous (the server runs them
    off its event loop)."""

    def __init__(self, config: KVTierConfig, stats: Stats):
        self.stats = stats
        self.memory = MemoryBlobs(config.max_local_cpu_bytes)
        self.disk = (
            DiskBlobs(config.local_disk, config.max_local_disk_bytes) if config.local_disk else None
        )
        self.remote = RemoteBlobs(config, stats) if config.remote_url else None
        # what /lookup needs to name a chunk's blobs (kept with the disk's files)
        self.shapes = KeyShapes(self.disk.dir if self.disk is not None else None)

    def describe(self) -> list[str]:
        """One line per tier, for the start-up log and /health."""
        lines = [f"memory {self.memory.capacity_bytes / 2**30:.2f} GiB"]
        if self.disk is not None:
            lines.append(f"disk {self.disk.root} {self.disk.capacity_bytes / 2**30:.2f} GiB")
        if self.remote is not None:
            lines.append(f"remote {self.remote.describe} (write-through)")
        return lines

    def exists_many(self, namespace: str, names: Sequence[str]) -> list[bool]:
        present = [
            self.memory.contains((namespace, n))
            or (self.disk is not None and self.disk.contains((namespace, n)))
            for n in names
        ]
        missing = [i for i, there in enumerate(present) if not there]
        if missing and self.remote is not None:
            found = self.remote.exists_many(namespace, [names[i] for i in missing])
            for i, there in zip(missing, found, strict=True):
                present[i] = there
        return present

    def get(self, namespace: str, name: str) -> bytes | None:
        blob_id: BlobId = (namespace, name)
        data = self.memory.get(blob_id)
        if data is not None:
            return data
        if self.disk is not None:
            data = self.disk.get(blob_id)
            if data is not None:
                self.memory.put(blob_id, data)
                return data
        if self.remote is not None:
            data = self.remote.get(namespace, name)
            if data is not None:
                self.memory.put(blob_id, data)
                if self.disk is not None:
                    self.disk.put(blob_id, data)
        return data

    def read(self, namespace: str, name: str, consume: Callable[[memoryview], T]) -> T | None:
        """``consume(view of the blob)``, None when no tier has it. From memory the view
        is of the tier's own buffer (no copy; valid only during the call)."""
        found = self.memory.read((namespace, name), consume)
        if found is not None:
            return found
        data = self.get(namespace, name)
        return None if data is None else consume(memoryview(data))

    def put(self, namespace: str, name: str, data: Buffer) -> bool:
        """Store ``data``; whether some tier kept it."""
        blob_id: BlobId = (namespace, name)
        self.shapes.learn(namespace, name)
        kept = self.memory.put(blob_id, data)
        if self.disk is not None:
            kept = self.disk.put(blob_id, data) or kept
        if self.remote is not None:
            self.remote.submit_put(namespace, name, bytes(data))
            kept = True
        return kept

    def delete(self, namespace: str, names: Sequence[str]) -> int:
        deleted = 0
        for name in names:
            found = self.memory.delete((namespace, name))
            if self.disk is not None:
                found = self.disk.delete((namespace, name)) or found
            deleted += found
        if self.remote is not None:
            self.remote.delete(namespace, names)
        return deleted

    def clear(self, namespace: str | None = None) -> int:
        """Delete every blob (of ``namespace``, when given) from every tier."""
        deleted = self.memory.clear(namespace)
        if self.disk is not None:
            deleted = max(deleted, self.disk.clear(namespace))
        if self.remote is not None:
            self.remote.clear(namespace)
        return deleted

    def gauges(self) -> dict[str, float]:
        out = {
            "memory_blobs": len(self.memory),
            "memory_bytes_used": self.memory.used_bytes,
            "memory_bytes_capacity": self.memory.capacity_bytes,
            "memory_evictions": self.memory.evictions,
        }
        if self.disk is not None:
            out |= {
                "disk_blobs": len(self.disk),
                "disk_bytes_used": self.disk.used_bytes,
                "disk_bytes_capacity": self.disk.capacity_bytes,
                "disk_evictions": self.disk.evictions,
            }
        if self.remote is not None:
            out |= {"remote_up": int(self.remote.is_up), "remote_queued": self.remote.pending}
        return out

    def close(self, timeout: float = 10.0) -> None:
        if self.remote is not None:
            self.remote.close(timeout)
        self.memory.close()
