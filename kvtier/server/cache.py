"""What a ``kvtier serve`` holds: memory, then an optional disk directory, then an
optional remote blob store behind it, all of opaque blobs by ``(namespace, name)``.

::

    put  ──▶ memory (bounded LRU) ──▶ disk (bounded, synchronous) ──▶ remote (queued)
    get  ◀── memory ◀── disk (copied up to memory) ◀── remote (copied up to memory, disk)

Memory and disk are the engine's tier classes (``kvtier.server.blobs``); the path through
them is the server's own. NOTE: an engine's ``StorageManager`` reads through tiers that
hand back decoded, verified chunks of a ``CacheKey``, writes to them from a queue and
copies a hit back to memory only; the server holds blobs it never decodes under names it
never parses, writes its disk within the request and copies a remote hit to memory and
disk. One loop for both would need a blob flavour of each lower tier and a switch per
difference.

The remote is written through from a bounded queue by one writer thread: a full queue or
a remote that is down drops the write (counted), never blocks a client. A remote that
fails or is slower than ``remote_timeout_ms`` is down, as an engine's remote tier would
be (``kvtier.storage.health``): every call a miss and every write dropped until a
background ping answers (0.1 s doubling, up to ``remote_reconnect_max_ms``).

The remote is any scheme whose module defines ``open_store`` (Redis/Valkey, S3): for each
client namespace the server opens the store that an engine of that namespace would open
itself, so engines that reach the remote directly and engines behind a server share the
same objects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.config import KVTierConfig
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Counter, Stats
from kvtier.server.blobs import (
    MEMORY_ALIGNMENT,
    BlobId,
    allocate_in_memory,
    clear_memory,
    disk_name,
    namespace_prefix,
    open_disk,
    open_memory,
    put_in_memory,
    read_from_disk,
    read_in_memory,
    view_of,
    write_to_disk,
)
from kvtier.server.lookup import KeyShapes
from kvtier.server.peers import Peers
from kvtier.server.shm import open_arena
from kvtier.server.stores import OpenStores
from kvtier.storage import schemes
from kvtier.storage.blob_store import BlobStore, Buffer, Throttled, WriteRefused
from kvtier.storage.health import Health, fault_reason
from kvtier.storage.remote import RemoteRequest, space_of_namespace
from kvtier.storage.schemes import redact_url
from kvtier.storage.serde import make_serde
from kvtier.storage.tier import BatchQueue
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

T = TypeVar("T")


PING_NAMESPACE = "kvtier-ping"  # a store opened only to ping the remote
HEALTH_INTERVAL_S = 5.0  # how often a server pings a remote that is up


class RemoteBlobs:
    """The remote behind the server: a ``BlobStore`` per client namespace (a bounded
    number open: ``kvtier.server.stores``), each call bounded by a timeout, with the
    tiers' health policy (``kvtier.storage.health``) and a write-through queue (one writer).

    Args:
        open_store: the store of a namespace.
        describe: how logs name the remote (a URL without credentials).
        stats: the server's counters (``remote_errors``, ``remote_puts``,
            ``remote_puts_dropped``).
        timeout_s: the longest a client request waits on the remote.
        reconnect_max_s: the longest pause between pings while the remote is down.
        queue_capacity: most writes queued; more are dropped (counted).
    """

    def __init__(
        self,
        open_store: Callable[[str], BlobStore],
        *,
        describe: str,
        stats: Stats,
        timeout_s: float,
        reconnect_max_s: float,
        queue_capacity: int,
    ):
        self._open_store = open_store
        self.describe = describe
        self._stats = stats
        self.timeout_s = timeout_s
        self._stores = OpenStores(open_store)
        self._ping_store: BlobStore | None = None  # while no client's namespace is open
        self._lock = threading.Lock()
        self.health = Health(
            "server-remote",
            f"kvtier server: remote {describe}",
            self._ping,
            reconnect_max_s=reconnect_max_s,
            logger=logger,
        )
        self._calls = ThreadPoolExecutor(8, thread_name_prefix="kvtier-server-remote")
        self._stopped = threading.Event()
        self._watcher: threading.Thread | None = None
        self._writes: BatchQueue[tuple[str, str, bytes]] = BatchQueue(
            "server-remote",
            self._write,
            stats,
            workers=1,
            capacity=queue_capacity,
            dropped_counter="remote_puts_dropped",
        )

    def _on(self, namespace: str, method: str, *args: Any) -> Any:
        """``method(*args)`` of the store of ``namespace``."""
        with self._stores.using(namespace) as store:
            return getattr(store, method)(*args)

    def _ping(self) -> None:
        """Ping the remote through a store already open, else through one kept for pings
        (opened once: the server pings every few seconds, and opening a store costs a
        client and its connections)."""
        namespace = self._stores.latest()
        if namespace is not None:
            with self._stores.using(namespace) as store:
                store.ping()
            return
        with self._lock:
            store = self._ping_store
        if store is None:
            opened = self._open_store(PING_NAMESPACE)
            with self._lock:
                if self._ping_store is None:
                    self._ping_store = opened
                    opened = None
                store = self._ping_store
            if opened is not None:  # another thread kept its own first
                opened.close()
        store.ping()

    @property
    def is_up(self) -> bool:
        return self.health.is_up

    def watch(self, interval_s: float = HEALTH_INTERVAL_S) -> None:
        """Ping the remote now and then every ``interval_s`` while it is up, each ping
        bounded by the remote timeout: a remote that is down at start-up is warned about
        at once, and one that goes down later is seen without waiting for a failed call,
        so ``/health`` and ``kvtier status`` say what the remote is doing now."""
        self.check()
        self._watcher = threading.Thread(
            target=self._watch, args=(interval_s,), name="kvtier-server-remote-watch", daemon=True
        )
        self._watcher.start()

    def check(self) -> bool:
        """One bounded ping while up (down: the reconnect thread pings); whether it is up."""
        if self.is_up:
            self._call("ping", self._ping)
        return self.is_up

    def _watch(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            self.check()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` within the timeout; None when the remote is down, throttles the
        call, or fails (then it is down until a ping answers)."""
        if not self.is_up:
            return None
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except Throttled as exc:  # back-pressure, not an outage: a miss
            self._warn_throttled(exc)
            return None
        except Exception as exc:
            future.cancel()
            self._stats.inc("remote_errors")
            self.health.mark_down(fault_reason(what, exc, self.timeout_s))
            return None

    def exists_many(self, namespace: str, names: Sequence[str]) -> list[bool]:
        found = self._call("exists", self._on, namespace, "exists_many", names)
        return list(found) if found is not None else [False] * len(names)

    def get(self, namespace: str, name: str) -> bytes | None:
        found = self._call("get", self._on, namespace, "get_many", [name])
        return None if found is None else found[0]

    def submit_put(self, namespace: str, name: str, data: bytes) -> None:
        if not self.is_up:
            self._stats.inc("remote_puts_dropped")
            return
        self._writes.offer((namespace, name, data))

    def _write(self, batch: list[tuple[str, str, bytes]]) -> None:
        for namespace, name, data in batch:
            if not self.is_up:
                self._stats.inc("remote_puts_dropped")
                continue
            try:
                self._on(namespace, "put_many", [(name, [data])])
            except WriteRefused as exc:  # full, not down: reads go on
                self._stats.inc("remote_puts_dropped")
                warn_once(
                    logger,
                    f"kvtier server: remote {self.describe} refuses stores ({exc}): "
                    "those chunks are not written through; reads go on",
                    key=f"server remote {self.describe} refuses: {exc.cause}",
                )
                continue
            except Throttled as exc:
                self._stats.inc("remote_puts_dropped")
                self._warn_throttled(exc)
                continue
            except Exception as exc:
                self._stats.inc("remote_puts_dropped")
                self._stats.inc("remote_errors")
                self.health.mark_down(fault_reason("put", exc, self.timeout_s))
                continue
            self._stats.inc("remote_puts")

    def _warn_throttled(self, exc: Throttled) -> None:
        warn_once(
            logger,
            f"kvtier server: remote {self.describe} throttles requests ({exc}): throttled "
            "reads are misses, throttled writes are not written through; it stays up",
            key=f"server remote {self.describe} throttles",
        )

    def delete(self, namespace: str, names: Sequence[str]) -> None:
        self._call("delete", self._on, namespace, "delete_many", names)

    def clear(self, namespace: str | None) -> None:
        spaces = self._stores.namespaces() if namespace is None else [namespace]
        for space in spaces:
            self._call("clear", self._on, space, "clear")

    @property
    def pending(self) -> int:
        return self._writes.pending

    def close(self, timeout: float) -> None:
        """Finish queued writes for at most ``timeout`` seconds, drop the rest, close."""
        self._stopped.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.timeout_s + 1)
        self._stats.inc("remote_puts_dropped", self._writes.close(timeout))
        self.health.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._stores.close()
        if self._ping_store is not None:
            self._ping_store.close()


def open_remote_blobs(config: KVTierConfig, stats: Stats) -> RemoteBlobs:
    """The remote of ``config.remote_url`` behind a server: for each client namespace, the
    store an engine of that namespace would open itself (``space_of_namespace``).

    Raises:
        ValueError: the URL's scheme cannot sit behind a server, or the URL is malformed
            (naming ``--remote-url``).
    """
    url = config.remote_url
    assert url is not None
    module = schemes.load_module(url)
    if not hasattr(module, "open_store"):
        raise ValueError(
            f"--remote-url {redact_url(url)!r}: this scheme is not a blob store a server "
            "can write through (use redis://, valkey:// or s3://; for a directory use "
            "--local-disk)"
        )
    open_store: Callable[[RemoteRequest], BlobStore] = module.open_store
    serde = make_serde("naive")
    try:  # a store parses its URL when opened, and connects on its first call
        open_store(RemoteRequest(url, config, serde, stats, PING_NAMESPACE)).close()
    except ValueError as exc:  # a URL no retry can mend: refused now, not "down" forever
        raise ValueError(f"--remote-url: {exc}") from None
    return RemoteBlobs(
        lambda namespace: open_store(
            RemoteRequest(url, config, serde, stats, space_of_namespace(namespace))
        ),
        describe=redact_url(url),
        stats=stats,
        timeout_s=config.remote_timeout_ms / 1000,
        reconnect_max_s=config.remote_reconnect_max_ms / 1000,
        queue_capacity=config.store_queue_size,
    )


class BlobCache:
    """The server's tiers. Thread-safe; every call is synchronous (the server runs them
    off its event loop).

    Reads go memory → disk → peers (``peers``, set by whoever assembles the server) →
    remote; the peers and the remote are asked only where a call says so: another
    server's requests are answered from memory and disk alone (a peer asking its remote
    on a peer's behalf would double every remote lookup, and loop through a remote that
    is a server peering back).

    ``shared_memory``: keep the memory tier in a ``SharedArena`` (``arena``), which
    same-host clients read blobs from.
    """

    def __init__(self, config: KVTierConfig, stats: Stats, *, shared_memory: bool = False):
        self.stats = stats
        capacity = config.max_local_cpu_bytes
        self.arena = open_arena(capacity + MEMORY_ALIGNMENT) if shared_memory else None
        self.memory = open_memory(capacity, None if self.arena is None else self.arena.tensor)
        self.disk = (
            open_disk(config.local_disk, config.max_local_disk_bytes) if config.local_disk else None
        )
        self.remote = open_remote_blobs(config, stats) if config.remote_url else None
        # what /lookup needs to name a chunk's blobs (kept with the disk's files)
        self.shapes = KeyShapes(self.disk.dir if self.disk is not None else None)
        self.peers: Peers | None = None

    def describe(self) -> list[str]:
        """One line per tier, for the start-up log and /health."""
        lines = [f"memory {self.memory.pool.capacity / 2**30:.2f} GiB"]
        if self.disk is not None:
            lines.append(f"disk {self.disk.root} {self.disk.capacity_bytes / 2**30:.2f} GiB")
        if self.peers is not None:
            lines.append(self.peers.describe())
        if self.remote is not None:
            lines.append(f"remote {self.remote.describe} (write-through)")
        return lines

    def exists_many(
        self, namespace: str, names: Sequence[str], *, peers: bool = True, remote: bool = True
    ) -> list[bool]:
        """Which of ``names`` some tier holds (asking the peers too with ``peers``, the
        remote with ``remote``)."""
        present = [self.memory.contains((namespace, n)) for n in names]
        missing = [i for i, there in enumerate(present) if not there]
        if missing and self.disk is not None:
            found = self.disk.contains_many([disk_name((namespace, names[i])) for i in missing])
            for i, there in zip(missing, found, strict=True):
                present[i] = there
            missing = [i for i, there in enumerate(present) if not there]
        if missing and peers and self.peers is not None:
            found = self.peers.exists_many(namespace, [names[i] for i in missing])
            for i, there in zip(missing, found, strict=True):
                present[i] = there
            missing = [i for i, there in enumerate(present) if not there]
        if missing and remote and self.remote is not None:
            found = self.remote.exists_many(namespace, [names[i] for i in missing])
            for i, there in zip(missing, found, strict=True):
                present[i] = there
        return present

    def get(self, namespace: str, name: str, *, remote: bool = True) -> bytes | None:
        blob_id: BlobId = (namespace, name)
        data = read_in_memory(self.memory, blob_id, bytes)
        if data is not None:
            return data
        if self.disk is not None:
            data = read_from_disk(self.disk, blob_id)
            if data is not None:
                put_in_memory(self.memory, blob_id, data)
                return data
        if remote and self.remote is not None:
            data = self.remote.get(namespace, name)
            if data is not None:
                put_in_memory(self.memory, blob_id, data)
                if self.disk is not None:
                    write_to_disk(self.disk, blob_id, data)
        return data

    def read(
        self,
        namespace: str,
        name: str,
        consume: Callable[[memoryview], T],
        *,
        remote: bool = True,
    ) -> T | None:
        """``consume(view of the blob)``, None when no tier has it (the remote asked only
        with ``remote``). From memory the view is of the tier's own buffer (no copy;
        valid only during the call)."""
        found = read_in_memory(self.memory, (namespace, name), consume)
        if found is not None:
            return found
        data = self.get(namespace, name, remote=remote)
        return None if data is None else consume(memoryview(data))

    def read_many(
        self,
        namespace: str,
        names: Sequence[str],
        consume: Callable[[memoryview], T],
        *,
        peers: bool = True,
        remote: bool = True,
    ) -> list[T | None]:
        """``read`` of each name, the names no local tier holds pulled from the peers in
        one batch first (with ``peers``), then asked of the remote (with ``remote``)."""
        out: list[T | None] = [read_in_memory(self.memory, (namespace, n), consume) for n in names]
        missing = [n for n, got in zip(names, out, strict=True) if got is None]
        if missing and self.disk is not None:
            on_disk = self.disk.contains_many([disk_name((namespace, n)) for n in missing])
            missing = [n for n, there in zip(missing, on_disk, strict=True) if not there]
        pulled = {}
        if missing and peers and self.peers is not None:
            pulled = self.peers.pull(namespace, missing)
            for name in pulled:
                self.shapes.learn(namespace, name)
        try:
            for i, name in enumerate(names):
                if out[i] is not None:
                    continue
                obj = pulled.get(name)
                if obj is not None:
                    out[i] = consume(view_of(obj))
                else:
                    out[i] = self.read(namespace, name, consume, remote=remote)
        finally:
            for obj in pulled.values():
                obj.ref_down()
        return out

    def hold_many(self, namespace: str, names: Sequence[str]) -> list[MemoryObj | None]:
        """Each blob's memory buffer (``view_of``) with a reference for the caller, or
        None where memory does not hold it: a blob to send from where it lies."""
        return [self.memory.get((namespace, name)) for name in names]

    def lease(self, namespace: str, names: Sequence[str]) -> list[MemoryObj | None]:
        """Each blob's memory buffer with a reference for the caller (a blob only on
        disk is read into memory first), or None: what a peer's LEASE holds."""
        out = []
        for name in names:
            blob_id: BlobId = (namespace, name)
            obj = self.memory.get(blob_id)
            if obj is None and self.disk is not None:
                data = read_from_disk(self.disk, blob_id)
                if data is not None and put_in_memory(self.memory, blob_id, data):
                    obj = self.memory.get(blob_id)
            out.append(obj)
        return out

    def put(self, namespace: str, name: str, data: Buffer) -> bool:
        """Store ``data``; whether some tier kept it."""
        blob_id: BlobId = (namespace, name)
        self.shapes.learn(namespace, name)
        kept = put_in_memory(self.memory, blob_id, data)
        if self.disk is not None:
            kept = write_to_disk(self.disk, blob_id, data) or kept
        if self.remote is not None:
            self.remote.submit_put(namespace, name, bytes(data))
            kept = True
        return kept

    def allocate(self, size: int) -> MemoryObj | None:
        """A memory buffer for a blob of ``size`` bytes about to arrive (``view_of`` it
        to fill it, then ``put_received``), or None when memory has no room for it."""
        return allocate_in_memory(self.memory, size)

    def put_received(
        self, namespace: str, name: str, obj: MemoryObj | None, data: memoryview
    ) -> bool:
        """``put`` of ``data``, a blob that arrived in ``obj`` (from ``allocate``; memory
        keeps that buffer as it is, the caller keeps its reference), or in a buffer of
        its own when ``obj`` is None."""
        if obj is None:
            return self.put(namespace, name, data)
        blob_id: BlobId = (namespace, name)
        self.shapes.learn(namespace, name)
        self.memory.replace(blob_id, obj)  # a concurrent put of the same name: the last wins
        if self.disk is not None:
            write_to_disk(self.disk, blob_id, data)
        if self.remote is not None:
            self.remote.submit_put(namespace, name, bytes(data))
        return True

    def delete(self, namespace: str, names: Sequence[str]) -> int:
        deleted = 0
        for name in names:
            found = self.memory.remove((namespace, name))
            if self.disk is not None:
                found = self.disk.delete(disk_name((namespace, name))) or found
            deleted += found
        if self.remote is not None:
            self.remote.delete(namespace, names)
        return deleted

    def clear(self, namespace: str | None = None) -> int:
        """Delete every blob (of ``namespace``, when given) from every tier."""
        deleted = clear_memory(self.memory, namespace)
        if self.disk is not None:
            prefix = None if namespace is None else namespace_prefix(namespace)
            deleted = max(deleted, self.disk.clear(prefix))
        if self.remote is not None:
            self.remote.clear(namespace)
        return deleted

    def gauges(self) -> dict[str, float]:
        out = {
            "memory_blobs": len(self.memory),
            "memory_bytes_used": self.memory.used_bytes,
            "memory_bytes_capacity": self.memory.pool.capacity,
            "memory_evictions": self.memory.stats.get(Counter.EVICTIONS),
        }
        if self.disk is not None:
            out |= {
                "disk_blobs": len(self.disk),
                "disk_bytes_used": self.disk.used_bytes,
                "disk_directories": self.disk.directories,
                "disk_bytes_capacity": self.disk.capacity_bytes,
                "disk_evictions": self.disk.evictions,
            }
        if self.remote is not None:
            out |= {"remote_up": int(self.remote.is_up), "remote_queued": self.remote.pending}
        if self.peers is not None:
            out |= self.peers.gauges()
        return out

    def close(self, timeout: float = 10.0) -> None:
        if self.peers is not None:
            self.peers.close()
        if self.remote is not None:
            self.remote.close(timeout)
        self.shapes.close()
        self.memory.close()
        if self.arena is not None:
            self.arena.close()
