"""The remote tier: a ``BlobStore`` (Redis/Valkey, S3) behind timeouts, health tracking
and reconnects, holding chunks in the wire format.

States (``kvtier.storage.health``)::

          call fails or times out                  ping answers
    UP ──────────────────────────────▶ DOWN ──────────────────────▶ UP
    lookups, gets, puts go to the      lookups and gets are misses at once,
    store, each bounded by             puts are dropped (counted); a background
    remote_timeout_ms                  thread pings with backoff (0.1 s doubling,
                                       up to remote_reconnect_max_ms)

NOTE: a write the store answers but refuses for want of room (``WriteRefused``: Redis out
of memory, an S3 quota) is a failed store, counted as ``puts_dropped_no_space`` and warned
once per cause; the tier stays up, so lookups and loads go on. So is one refused for want
of permission (``WriteDenied``: a read-only ACL user), counted as ``puts_dropped_error``.

NOTE: a request the store throttles past its own retries (``Throttled``: S3's ``SlowDown``,
``Throttling``, ``RequestLimitExceeded``) is back-pressure, not an outage: a throttled
put is a failed store (``puts_dropped_throttled``), a throttled lookup or get a miss
(``throttled``), each warned once; the tier stays up.

NOTE: nothing the store does can stall or crash the engine: every call the engine waits
on runs on the tier's I/O threads and is abandoned after ``remote_timeout_ms``; writes
run on their own threads from a bounded queue. One warning is logged per outage and one
line when service returns; every failure is counted.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kvtier.config import KVTierConfig
from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Histogram, Stats, TierCounter, tier_counter
from kvtier.storage import wire
from kvtier.storage.blob_store import (
    BlobStore,
    Buffer,
    ReadingStore,
    StoreUnavailable,
    Throttled,
    WriteDenied,
    WriteRefused,
)
from kvtier.storage.health import Health, fault_reason
from kvtier.storage.schemes import redact_url
from kvtier.storage.serde import CorruptObject, Serde
from kvtier.storage.tier import LowerTier, PendingWrite, WriteQueue, count_refused
from kvtier.storage.wire import Allocate
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

# beyond twice the timeout: how long close waits for calls a hung store still runs (a
# call may take the store's connect timeout and then its read timeout)
CLOSE_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class RemoteRequest:
    """What a remote scheme's ``open_remote`` is given (the schemes: ``storage.schemes``).

    Attributes:
        url: the ``remote_url``.
        config: the validated config (timeouts, credentials, queue sizes).
        serde: the codec new objects are written with.
        stats: counters.
        space: the namespace (the model name) percent-encoded, to sit in a key prefix.
    """

    url: str
    config: KVTierConfig
    serde: Serde
    stats: Stats
    space: str


def space_of(model: str) -> str:
    """The ``space`` of a model's remotes: its name percent-encoded (a ``kvtier serve``
    namespace, a Redis key prefix, an S3 prefix)."""
    return quote(model.encode("utf-8", "surrogateescape"), safe="-_.")


_SPACE = re.compile(r"[A-Za-z0-9_.~%-]+")  # the characters ``space_of`` leaves


def space_of_namespace(namespace: str) -> str:
    """The ``space`` of a ``kvtier serve`` client's namespace in the remote behind the
    server: the namespace as it is when an engine could have declared it (``space_of``'s
    characters only), so that engines behind the server and engines on the remote share
    objects; any other, from a client of another kind, percent-encoded after a ``!``
    (which no engine's space holds).

    NOTE: every space must be a key prefix of its own: Redis keys ``kvtier:<space>:<name>``
    would read namespace ``a:b`` and name ``x`` as namespace ``a`` and name ``b:x``, and
    clearing ``a`` would clear ``a:b``.
    """
    return namespace if _SPACE.fullmatch(namespace) else "!" + quote(namespace, safe="")


# ``open_remote`` of a scheme's module: the tier of ``request.url``. Raises ValueError for a
# bad URL or setting (the message names the config key).
RemoteOpener = Callable[[RemoteRequest], LowerTier]


class _Down(Exception):
    """Answer with a miss: the tier is down (or just went down), or the store throttled
    the call."""


class RemoteTier:
    """A remote store as a kvtier tier.

    Args:
        store: the byte store (its ``name`` names the tier's counters).
        describe: how logs name the store (a URL without credentials).
        serde: the codec new objects are written with.
        stats: counters.
        timeout_s: the longest the engine waits on one lookup or chunk get.
        reconnect_max_s: the longest pause between reconnect attempts.
        concurrency: I/O threads for lookups and parallel chunk gets.
        queue_capacity: most writes queued; more are dropped and counted.
        writers: writer threads; each sends batches of up to ``max_batch`` chunks.
    """

    def __init__(
        self,
        store: BlobStore,
        *,
        describe: str,
        serde: Serde,
        stats: Stats,
        timeout_s: float,
        reconnect_max_s: float = 5.0,
        concurrency: int = 16,
        queue_capacity: int = 256,
        writers: int = 2,
        max_batch: int = 8,
    ):
        self.name = store.name
        self.store = store
        self.describe = describe
        self.serde = serde
        self.stats = stats
        self.timeout_s = timeout_s
        self.health = Health(
            self.name,
            f"kvtier {self.name} tier {describe}",
            store.ping,
            reconnect_max_s=reconnect_max_s,
            logger=logger,
            on_reconnect=lambda: self._count(TierCounter.RECONNECTS),
        )
        self._concurrency = concurrency
        self._io = ThreadPoolExecutor(concurrency, thread_name_prefix=f"kvtier-{self.name}-io")
        # NOTE: lookups get their own threads: queued behind a long load (or prefetch) on
        # the I/O threads they would time out and mark a healthy remote down.
        self._meta = ThreadPoolExecutor(2, thread_name_prefix=f"kvtier-{self.name}-meta")
        # calls on either pool not yet settled, abandoned ones included (waited for at close)
        self._running: set[Future] = set()
        self._running_lock = threading.Lock()
        self._writes = WriteQueue(
            self.name,
            self._write_batch,
            stats,
            workers=writers,
            capacity=queue_capacity,
            max_batch=max_batch,
        )

    def __repr__(self) -> str:
        return f"RemoteTier({self.describe})"

    # -- health ----------------------------------------------------------------------

    @property
    def is_up(self) -> bool:
        return self.health.is_up

    def _count(self, what: str, amount: float = 1) -> None:
        self.stats.inc(tier_counter(self.name, what), amount)

    def check_at_start(self) -> bool:
        """Ping the store once, waiting at most ``timeout_s``: one that does not answer is
        reported now, in one line, and is down (misses, dropped stores) until it answers,
        rather than discovered at the first store. Returns whether it answered."""
        future = self._submit(self._meta, self.store.ping)
        try:
            future.result(timeout=self.timeout_s)
        except Exception as exc:
            future.cancel()
            if isinstance(exc, StoreUnavailable):
                exc = StoreUnavailable(f"at start-up: {exc}")
            self._fault("the start-up ping", exc)
            return False
        logger.info("kvtier %s tier %s answers", self.name, self.describe)
        return True

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a lookup thread, waiting at most ``timeout_s``.

        Raises:
            _Down: the tier is down, or the call failed or timed out (it is now down).
        """
        if not self.is_up:
            raise _Down
        return self._wait(self._submit(self._meta, fn, *args), self.timeout_s, what)

    def _submit(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on ``pool``, tracked until it settles (``close`` waits for it)."""
        future = pool.submit(fn, *args)
        with self._running_lock:
            self._running.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: Future) -> None:
        with self._running_lock:
            self._running.discard(future)

    def _wait(self, future: Future, timeout: float, what: str) -> Any:
        """``future``'s result within ``timeout``; a failure or timeout marks the tier
        down and raises _Down, as does a throttled call, which leaves the tier up."""
        try:
            return future.result(timeout=timeout)
        except Throttled as exc:
            self._throttled(what, exc, TierCounter.THROTTLED)
            raise _Down from None
        except WriteRefused as exc:  # a delete the store refuses: it still reads
            self._refused(exc)
            raise _Down from None
        except Exception as exc:  # a timeout, StoreUnavailable, or an unwrapped client error
            if isinstance(exc, FutureTimeout):
                future.cancel()
            self._fault(what, exc)
            raise _Down from None

    def _fault(self, what: str, exc: Exception) -> None:
        """Count a failed call (timeout or error) and mark the tier down."""
        timed_out = isinstance(exc, FutureTimeout)
        self._count(TierCounter.TIMEOUTS if timed_out else TierCounter.ERRORS)
        self.health.mark_down(fault_reason(what, exc, self.timeout_s))

    def _refused(self, exc: WriteRefused) -> None:
        """Warn once per cause of a write the store refuses (the tier stays up)."""
        warn_once(
            logger,
            f"kvtier {self.name} tier {self.describe} refuses stores ({exc}): those "
            "chunks are not stored; lookups and loads go on",
            key=f"{self.name} {self.describe} refuses: {exc.cause}",
        )

    def _throttled(self, what: str, exc: Throttled, counter: str, amount: int = 1) -> None:
        """Count what the store throttled (the tier stays up) and warn once."""
        self._count(counter, amount)
        warn_once(
            logger,
            f"kvtier {self.name} tier {self.describe} throttles requests ({what}: {exc}): "
            "throttled lookups and loads are misses, throttled stores are dropped; the "
            "tier stays up",
            key=f"{self.name} {self.describe} throttles",
        )

    # -- reads -----------------------------------------------------------------------

    def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        if not keys:
            return []
        try:
            present = self._call("lookup", self.store.exists_many, [k.to_string() for k in keys])
        except _Down:
            return [False] * len(keys)
        self._count(TierCounter.LOOKUP_HITS, sum(present))
        return list(present)

    def get_many(self, keys: Sequence[CacheKey], allocate: Allocate) -> list[MemoryObj | None]:
        """The chunks, fetched in parallel: one request per chunk (per ``read_batch``
        chunks, for a store that reads from memory), ``concurrency`` at a time, each wave
        of requests allowed ``timeout_s``."""
        if not self.is_up:
            self._count(TierCounter.GET_MISSES, len(keys))
            return [None] * len(keys)
        started = time.perf_counter()
        if isinstance(self.store, ReadingStore):
            # decoded on the I/O threads, straight from the store's buffer
            size = max(self.store.read_batch, 1)
            groups = [list(keys[i : i + size]) for i in range(0, len(keys), size)]
            futures = [self._submit(self._io, self._read_group, g, allocate) for g in groups]
        else:
            groups = [[k] for k in keys]
            futures = [self._submit(self._io, self.store.get_many, [k.to_string()]) for k in keys]
        waves = -(-len(futures) // self._concurrency)
        deadline = time.monotonic() + self.timeout_s * waves
        out: list[MemoryObj | None] = []
        for group, future in zip(groups, futures, strict=True):
            for key, found in zip(group, self._results(future, deadline, len(group)), strict=True):
                if found is None or isinstance(found, MemoryObj):
                    out.append(found)
                else:
                    out.append(self._decode(key, found, allocate))
        hits = [obj for obj in out if obj is not None]
        self._count(TierCounter.GET_HITS, len(hits))
        self._count(TierCounter.GET_MISSES, len(out) - len(hits))
        self._count(TierCounter.GET_BYTES, sum(obj.data_nbytes for obj in hits))
        elapsed = time.perf_counter() - started
        self._count(TierCounter.GET_SECONDS, elapsed)
        self.stats.observe(tier_counter(self.name, Histogram.TIER_GET), elapsed)
        return out

    def _read_group(self, keys: list[CacheKey], allocate: Allocate) -> list[MemoryObj | None]:
        assert isinstance(self.store, ReadingStore)
        return self.store.read_each(
            [key.to_string() for key in keys],
            lambda i, blob: self._decode(keys[i], blob, allocate),
        )

    def _results(self, future: Future, deadline: float, count: int) -> list:
        """What ``future`` found for its ``count`` keys (None each where the tier is down
        or the wait timed out: the future frees what it decodes late)."""
        try:
            return self._wait(future, max(deadline - time.monotonic(), 0.0), "a get")
        except _Down:
            future.add_done_callback(_release_late)
            return [None] * count

    def _decode(self, key: CacheKey, blob: Buffer, allocate: Allocate) -> MemoryObj | None:
        name = key.to_string()
        try:
            return wire.decode(blob, name, allocate, self.serde)
        except CorruptObject as exc:
            count_refused(self.stats, self.name, f"object {name}", exc)
            with contextlib.suppress(RuntimeError):  # closed meanwhile: deleted another time
                self._submit(self._io, self._delete_quietly, [name])
            return None

    def _delete_quietly(self, names: list[str]) -> None:
        with contextlib.suppress(Exception):  # a failed cleanup costs another miss later
            self.store.delete_many(names)

    # -- writes ----------------------------------------------------------------------

    def submit_put(self, key: CacheKey, obj: MemoryObj) -> bool:
        if not self.is_up:
            self._count(TierCounter.DROPPED_UNAVAILABLE)
            return False
        return self._writes.submit(key, obj)

    def _write_batch(self, batch: list[PendingWrite]) -> None:
        if not self.is_up:
            self._count(TierCounter.DROPPED_UNAVAILABLE, len(batch))
            return
        started = time.perf_counter()
        names = [key.to_string() for key, _ in batch]
        unsent = len(batch)  # dropped on a failure: those the store does not hold yet
        try:
            # One round trip saves re-sending chunks another engine already stored.
            present = self.store.exists_many(names)
            kept = [
                (name, obj)
                for name, (_, obj), there in zip(names, batch, present, strict=True)
                if not there
            ]
            unsent = len(kept)
            items = [
                (name, wire.encode(name, obj.tensor, self.serde, checksum=obj.checksum))
                for name, obj in kept
            ]
            if items:
                self.store.put_many(items)
        except WriteRefused as exc:
            denied = isinstance(exc, WriteDenied)
            counter = TierCounter.DROPPED_ERROR if denied else TierCounter.DROPPED_NO_SPACE
            self._count(counter, unsent)
            self._refused(exc)
            return
        except Throttled as exc:
            self._throttled("put", exc, TierCounter.DROPPED_THROTTLED, unsent)
            return
        except Exception as exc:
            self._count(TierCounter.DROPPED_UNAVAILABLE, unsent)
            self._fault("put", exc)
            return
        self._count(TierCounter.PUT_CHUNKS, len(items))
        self._count(TierCounter.PUT_BYTES, sum(len(p) for _, parts in items for p in parts))
        self._count(TierCounter.PUT_RAW_BYTES, sum(obj.data_nbytes for _, obj in kept))
        elapsed = time.perf_counter() - started
        self._count(TierCounter.PUT_SECONDS, elapsed)
        self.stats.observe(tier_counter(self.name, Histogram.TIER_PUT), elapsed)

    # -- management ------------------------------------------------------------------

    def remove(self, key: CacheKey) -> bool:
        try:
            return bool(self._call("delete", self.store.delete_many, [key.to_string()]))
        except _Down:
            return False

    def clear(self) -> None:
        """Delete every object in this tier's namespace (queued writes finish first)."""
        self._writes.flush(30.0)
        if not self.is_up:
            return
        try:
            self.store.clear()
        except Throttled as exc:
            self._throttled("clear", exc, TierCounter.THROTTLED)
        except WriteRefused as exc:
            self._refused(exc)
        except Exception as exc:
            self._fault("clear", exc)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writes.flush(timeout)

    @property
    def pending_writes(self) -> int:
        """Writes queued or in flight."""
        return self._writes.pending

    def close(self) -> None:
        """Finish queued writes (bounded), then stop every thread of the tier. A call the
        engine gave up on (timed out) may still be running on a hung store: the store's
        own socket timeouts end it, and close waits for that (bounded) so that no thread
        of the tier outlives it."""
        self._writes.close(timeout=max(10 * self.timeout_s, 10.0))
        self.health.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._meta.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        with self._running_lock:
            running = list(self._running)
        _, stuck = wait(running, timeout=2 * self.timeout_s + CLOSE_GRACE_S)
        if stuck:
            logger.warning(
                "kvtier %s tier: %d calls to %s still running at close",
                self.name,
                len(stuck),
                self.describe,
            )
            return
        self._io.shutdown(wait=True)
        self._meta.shutdown(wait=True)


def _release_late(future: Future) -> None:
    """A get that finished after its caller gave up on it: free the chunk it decoded."""
    if future.cancelled() or future.exception() is not None:
        return
    for obj in future.result():
        if isinstance(obj, MemoryObj):
            obj.ref_down()


def open_blob_tier(store: BlobStore, request: RemoteRequest) -> RemoteTier:
    """``store``, opened for ``request``, as a tier with the config's remote timeouts,
    concurrency and queue size."""
    config = request.config
    tier = RemoteTier(
        store,
        describe=redact_url(request.url),
        serde=request.serde,
        stats=request.stats,
        timeout_s=config.remote_timeout_ms / 1000,
        reconnect_max_s=config.remote_reconnect_max_ms / 1000,
        concurrency=config.remote_max_concurrency,
        queue_capacity=config.store_queue_size,
    )
    tier.check_at_start()
    return tier
