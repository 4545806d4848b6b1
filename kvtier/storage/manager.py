"""The storage manager: one entry point over the tiers.

::

    engine ──put──▶ CPU tier ──(queued, asynchronous)──▶ disk tier, remote tier
    engine ◀─get── CPU tier ◀──(on a CPU miss; written back to the CPU tier)── lower tiers

- ``put`` keeps the chunk in the CPU tier (when ``local_cpu``) and queues a write to each
  lower tier; it never waits for a disk or the network.
- ``lookup_prefix`` finds the longest run of chunks present across tiers with one
  batched call per tier, and can start fetching the lower-tier part into the CPU tier
  right away (prefetch) so that the load that follows finds it in memory.
- ``get_many`` reads each chunk from the fastest tier that has it, the lower tiers in
  parallel across chunks, and writes lower-tier hits back to the CPU tier.

The CPU tier's pool also stages every chunk on its way to and from the lower tiers, so it
exists even with ``local_cpu: false``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvtier.config import KVTierConfig
from kvtier.keys import CacheKey
from kvtier.machine import PoolTooLarge
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Counter, Stats, TierCounter, tier_counter
from kvtier.observability.tier_events import TierEventLog
from kvtier.storage import schemes
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.disk import FileTier
from kvtier.storage.remote import RemoteOpener, RemoteRequest, space_of
from kvtier.storage.serde import Serde, make_serde
from kvtier.storage.split_disk import SharedDisk, SplitDisk
from kvtier.storage.tier import LowerTier

logger = logging.getLogger(__name__)

PREFETCH_WAIT_S = 5.0
MAX_PREFETCHING = 1024
LOCAL_DISK = "disk"  # the local disk tier's name; every other lower tier is shared


class StorageManager:
    """Routes chunk objects to and from the enabled tiers.

    Args:
        config: the validated kvtier config.
        stats: shared counters.
        pin_memory: pin the host pool (None: when a GPU is present).
        namespace: separates this model's objects in shared stores (the model name).
        lower_tiers: the tiers below the CPU (None: opened from ``config``).
        events: where the CPU and local disk tiers record what they hold
            (``kvtier.observability.tier_events``; None: no records).
        disk_shard: the local disk tier's subdirectory (``open_lower_tiers``).
        write_shared: write the shared tiers (every lower tier but the local disk), or,
            per key, whether to. False for a replica whose peer writes the same bytes
            under the same keys (an MLA engine's tensor-parallel rank > 0, or one that
            holds a KV head a rank before it holds too): its puts skip them (counted as
            ``<tier>_puts_skipped_replica``), and it reads what the peer wrote.
        shared_disk: where the local disk keeps the chunks this rank shares with
            replicas on its machine (``split_disk``); None: one directory, its own.
    """

    def __init__(
        self,
        config: KVTierConfig,
        stats: Stats | None = None,
        *,
        pin_memory=None,
        namespace: str | None = None,
        lower_tiers: Sequence[LowerTier] | None = None,
        events: TierEventLog | None = None,
        disk_shard: str | None = None,
        write_shared: bool | Callable[[CacheKey], bool] = True,
        shared_disk: SharedDisk | None = None,
    ):
        self.config = config
        self.write_shared = write_shared
        self.stats = stats or Stats()
        try:
            self.cpu = LocalCPUTier(
                config.max_local_cpu_bytes,
                config.cache_policy,
                alignment=config.pool_alignment,
                pin_memory=pin_memory,
                stats=self.stats,
                events=events,
            )
        except PoolTooLarge as exc:
            raise PoolTooLarge(
                f"max_local_cpu_size={config.max_local_cpu_size:g} (GiB, kvtier's CPU pool): "
                f"{exc}; lower it"
            ) from None
        self.retain_in_cpu = config.local_cpu
        if lower_tiers is None:
            try:
                lower_tiers = open_lower_tiers(
                    config,
                    self.stats,
                    namespace or config.model_name or "default",
                    events,
                    disk_shard=disk_shard,
                    shared_disk=shared_disk,
                )
            except BaseException:
                self.cpu.close()
                raise
        self.lower: list[LowerTier] = list(lower_tiers)
        self._prefetching: dict[CacheKey, Future] = {}
        self._prefetch_lock = threading.Lock()
        self._fetcher = (
            ThreadPoolExecutor(2, thread_name_prefix="kvtier-prefetch") if self.lower else None
        )
        if not self.retain_in_cpu and not self.lower:
            logger.warning(
                "local_cpu=false and no other tier is configured: kvtier will not keep "
                "any KV (stores are staged and dropped)"
            )

    @property
    def tier_names(self) -> list[str]:
        return (["cpu"] if self.retain_in_cpu else []) + self.lower_tier_names

    @property
    def lower_tier_names(self) -> list[str]:
        """Names of the tiers below memory (disk, remote), in lookup order."""
        return [t.name for t in self.lower]

    def uncounted(self) -> tuple[str, ...]:
        """The engine counters these tiers can never move: copies from a lower tier into
        the CPU tier (``prefetched_chunks``, ``cpu_writeback_chunks``) need both, and
        evictions from the CPU tier need it to keep chunks (``local_cpu``)."""
        copies = (Counter.PREFETCHED_CHUNKS, Counter.WRITEBACK_CHUNKS)
        if not self.retain_in_cpu:
            return (*copies, Counter.EVICTIONS)
        return () if self.lower else copies

    @property
    def sole_disk(self) -> FileTier | SplitDisk | None:
        """The file tier when it is the only tier (no CPU tier, nothing else below) and
        stores chunks verbatim: a caller may then move chunks between its own memory and
        the files directly (``FileTier.put_buffers`` / ``get_into``), as no tier needs a
        copy in kvtier's pool."""
        tier = self._only_files
        return tier if tier is not None and tier.serde.verbatim else None

    @property
    def _only_files(self) -> FileTier | SplitDisk | None:
        """The file tier when it is the only tier (no CPU tier, nothing else below)."""
        if self.retain_in_cpu or len(self.lower) != 1:
            return None
        tier = self.lower[0]
        return tier if isinstance(tier, FileTier | SplitDisk) else None

    def gauges(self) -> dict[str, float]:
        """What the tiers hold now: the CPU pool's capacity and use, chunks (and pinned
        ones) in memory, and per lower tier whether it is up, its queued writes and (when
        capped) the bytes of its files and the directories of their tree."""
        pool = self.cpu.pool
        gauges = {
            "cpu_pool_capacity_bytes": float(pool.capacity),
            "cpu_pool_used_bytes": float(pool.used_bytes()),
            "cpu_chunks": float(len(self.cpu)),
            "cpu_pinned_chunks": float(self.cpu.pinned_count()),
        }
        for tier in self.lower:
            gauges[f"{tier.name}_up"] = float(getattr(tier, "is_up", True))
            gauges[f"{tier.name}_pending_writes"] = float(tier.pending_writes)
            if isinstance(tier, FileTier | SplitDisk) and tier.capacity_bytes is not None:
                gauges[f"{tier.name}_used_bytes"] = float(tier.used_bytes)
                gauges[f"{tier.name}_directories"] = float(tier.directories)
        return gauges

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryObj | None:
        """A staging buffer for one chunk, or None when memory is exhausted."""
        return self.cpu.allocate(shape, dtype)

    # -- writes ----------------------------------------------------------------------

    def put(self, key: CacheKey, obj: MemoryObj) -> bool:
        """Store ``obj`` under ``key`` in every enabled tier (lower tiers asynchronously).
        The caller keeps its own reference. Returns whether any tier took it.

        NOTE: a key the CPU tier already holds is not written again anywhere: whoever
        stored it first (another thread storing the same prompt) queued its lower-tier
        writes, so this put takes nothing and returns False.
        """
        if self.retain_in_cpu and not self.cpu.put(key, obj):
            return False
        took = self.retain_in_cpu
        write_shared = self._writes_shared(key)
        for tier in self.lower:
            if not write_shared and is_shared(tier):
                # NOTE: the peer replica writes these bytes under this key; a put skipped
                # here is not a failed one
                self.stats.inc(tier_counter(tier.name, TierCounter.SKIPPED_REPLICA))
                took = True
                continue
            took = tier.submit_put(key, obj) or took
        return took

    def skip_for_replica(self, key: CacheKey) -> bool:
        """Skip a store of ``key`` that no tier of this rank would keep, as a replica peer
        writes it: no CPU tier (``local_cpu: false``), and every lower tier is one the peer
        writes (a replica rank, as of an MLA engine's latent, whose tiers are all shared).
        Returns whether it was skipped; each tier then counts the put it left to the peer
        (``<tier>_puts_skipped_replica``), as ``put`` does, and the caller need not copy
        the chunk out of the engine at all."""
        if self.retain_in_cpu or not self.lower:
            return False
        write_shared = self._writes_shared(key)
        for tier in self.lower:
            if isinstance(tier, SplitDisk):
                if not tier.leaves_to_writer(key):
                    return False
            elif write_shared or not is_shared(tier):
                return False
        for tier in self.lower:
            self.stats.inc(tier_counter(tier.name, TierCounter.SKIPPED_REPLICA))
        return True

    def _writes_shared(self, key: CacheKey) -> bool:
        write_shared = self.write_shared
        return write_shared if isinstance(write_shared, bool) else write_shared(key)

    # -- reads -----------------------------------------------------------------------

    def contains(self, key: CacheKey) -> bool:
        """Whether the CPU tier holds ``key`` (no disk or network access)."""
        return self.cpu.contains(key)

    def stored(self, key: CacheKey) -> bool:
        """Whether a store may leave ``key`` out: the CPU tier holds it, or, with no CPU
        tier, the only tier is a file tier whose index holds it (``FileTier.indexed``: a
        use, for eviction order). Answered from memory, never a disk or network access.
        With several lower tiers a chunk is stored again even where the disk holds it,
        as each of them must get it (the disk then finds its file and marks the use)."""
        if self.cpu.contains(key):
            return True
        files = self._only_files
        return files is not None and files.indexed(key)

    def held_everywhere(self, key: CacheKey) -> bool:
        """Whether a store of ``key`` would add nothing, answered from memory: the CPU
        tier holds it (whoever put it there queued its lower-tier writes), or every lower
        tier is a file tier whose index holds it (a use, for eviction order). A remote
        tier keeps no index in memory, so a chunk it may lack is never held everywhere:
        its writer leaves out what it has already, one batched lookup per write."""
        if self.cpu.contains(key):
            return True
        return bool(self.lower) and all(
            isinstance(tier, FileTier | SplitDisk) and tier.indexed(key) for tier in self.lower
        )

    def lookup_prefix(
        self,
        keys: Sequence[CacheKey],
        *,
        prefetch: bool = False,
        prefetch_from: int = 0,
        prefetch_most: int | None = None,
    ) -> int:
        """How many of ``keys``, from the first, some tier holds.

        One batched call per lower tier for the keys the CPU tier lacks (past the CPU
        tier's own run too: a chunk only a lower tier holds may be followed by ones only
        memory holds). With ``prefetch``, the lower-tier part of the run starts moving
        into the CPU tier: the keys from index ``prefetch_from`` on (those before it the
        engine has already), at most ``prefetch_most`` of them (what one load can take;
        None: the rest of the run), so a lookup reads no chunk a load will not use; and no
        more than keep every prefetch in flight within ``prefetch_most`` chunks together.
        """
        in_cpu = self.cpu.prefix_length(keys)
        rest = list(keys[in_cpu:])
        if not rest or not self.lower:
            return in_cpu
        present = self._held_below(rest, [self.cpu.contains(k) for k in rest])
        run = next((i for i, p in enumerate(present) if not p), len(present))
        if prefetch and run:
            start = max(prefetch_from, in_cpu)
            end = in_cpu + run
            if prefetch_most is not None:
                end = min(end, prefetch_from + prefetch_most)
            if start < end:
                self._prefetch(list(keys[start:end]), prefetch_most)
        return in_cpu + run

    def contains_many(self, keys: Sequence[CacheKey]) -> list[bool]:
        """Whether some tier holds each of ``keys``: the CPU tier, then one batched call
        per lower tier for the keys still missing."""
        return self._held_below(keys, [self.cpu.contains(k) for k in keys])

    def _held_below(self, keys: Sequence[CacheKey], held: list[bool]) -> list[bool]:
        """``held`` with each key it lacks looked up in the lower tiers, in order, one
        batched call per tier for the keys still missing."""
        for tier in self.lower:
            missing = [i for i, there in enumerate(held) if not there]
            if not missing:
                break
            found = tier.contains_many([keys[i] for i in missing])
            for i, there in zip(missing, found, strict=True):
                held[i] = there
        return held

    def get(self, key: CacheKey) -> MemoryObj | None:
        """The chunk under ``key`` with a reference for the caller, or None on a miss."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[CacheKey]) -> list[MemoryObj | None]:
        """Each chunk with a reference for the caller (who must ``ref_down`` it), or None.

        The CPU tier first; then chunks still being prefetched are waited for; the rest
        come from the lower tiers in order, in parallel across chunks.
        """
        out: list[MemoryObj | None] = [self.cpu.get(key) for key in keys]
        missing = [i for i, obj in enumerate(out) if obj is None]
        if not missing or not self.lower:
            return out
        if self._wait_prefetch([keys[i] for i in missing]):
            for i in missing:
                out[i] = self.cpu.get(keys[i])
            missing = [i for i in missing if out[i] is None]
        self._read_below(keys, out, missing)
        return out

    def _read_below(
        self, keys: Sequence[CacheKey], out: list[MemoryObj | None], missing: list[int]
    ) -> int:
        """Read ``keys[i]`` of each ``i`` in ``missing`` into ``out[i]`` from the lower
        tiers in order, each hit written back to the CPU tier; returns how many of those
        write-backs the CPU tier took (not one whose key another thread put there first)."""
        landed = 0
        for tier in self.lower:
            if not missing:
                break
            objs = tier.get_many([keys[i] for i in missing], self.cpu.allocate)
            for i, obj in zip(missing, objs, strict=True):
                if obj is not None:
                    out[i] = obj
                    landed += self._write_back(keys[i], obj)
            missing = [i for i in missing if out[i] is None]
        return landed

    def _write_back(self, key: CacheKey, obj: MemoryObj) -> bool:
        if self.retain_in_cpu and self.cpu.put(key, obj):
            self.stats.inc(Counter.WRITEBACK_CHUNKS)
            return True
        return False

    # -- prefetch --------------------------------------------------------------------

    def _prefetch(self, keys: list[CacheKey], most: int | None = None) -> None:
        """Start moving ``keys`` (present in a lower tier) into the CPU tier: the first of
        them, as many as keep the chunks of every prefetch in flight within ``most`` (what
        the CPU pool holds of them) and ``MAX_PREFETCHING``.

        NOTE: a prefetch holds all of its chunks in the CPU pool until the last is read.
        Lookups in a row (one per request) would otherwise have more in flight than the
        pool holds: their allocations fail, and a load then finds no room either.
        """
        if not self.retain_in_cpu or self._fetcher is None:
            return  # NOTE: without a CPU tier there is nowhere to keep a prefetched chunk
        bound = MAX_PREFETCHING if most is None else min(most, MAX_PREFETCHING)
        with self._prefetch_lock:
            todo = [k for k in keys if k not in self._prefetching]
            todo = todo[: max(bound - len(self._prefetching), 0)]
            if not todo:
                return
            future = self._fetcher.submit(self._fetch_into_cpu, todo)
            for key in todo:
                self._prefetching[key] = future
        future.add_done_callback(lambda _: self._prefetch_done(todo))

    def _fetch_into_cpu(self, keys: list[CacheKey]) -> None:
        """Read ``keys`` the CPU tier lacks from the lower tiers into it; counts as
        prefetched the chunks that landed there (a read whose key another thread put
        there meanwhile is not one)."""
        keys = [k for k in keys if not self.cpu.contains(k)]
        out: list[MemoryObj | None] = [None] * len(keys)
        landed = self._read_below(keys, out, list(range(len(keys))))
        self.stats.inc(Counter.PREFETCHED_CHUNKS, landed)
        for obj in out:
            if obj is not None:
                obj.ref_down()  # the CPU tier keeps its own reference

    def _prefetch_done(self, keys: list[CacheKey]) -> None:
        with self._prefetch_lock:
            for key in keys:
                self._prefetching.pop(key, None)

    def _wait_prefetch(self, keys: Sequence[CacheKey]) -> bool:
        """Wait (bounded) for prefetches of ``keys``; whether there were any."""
        with self._prefetch_lock:
            futures = {self._prefetching[k] for k in keys if k in self._prefetching}
        if futures and threading.current_thread().name.startswith("kvtier-prefetch"):
            return False  # a prefetch never waits for itself
        if futures:
            wait(futures, timeout=PREFETCH_WAIT_S)
        return bool(futures)

    # -- management ------------------------------------------------------------------

    def pin(self, keys: Sequence[CacheKey]) -> list[MemoryObj]:
        """Pin what the CPU tier holds among ``keys``; returns the objects pinned, for
        ``unpin`` (a key may name another object by then)."""
        pinned = (self.cpu.pin(key) for key in keys)
        return [obj for obj in pinned if obj is not None]

    def unpin(self, objs: Sequence[MemoryObj]) -> None:
        for obj in objs:
            obj.unpin()

    def remove(self, key: CacheKey) -> bool:
        """Forget ``key`` in every tier."""
        removed = self.cpu.remove(key)
        for tier in self.lower:
            removed = tier.remove(key) or removed
        return removed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write is done; False on timeout."""
        return all(tier.flush(timeout) for tier in self.lower)

    def clear(self) -> None:
        """Drop every chunk in every tier (shared tiers included: their namespace)."""
        self.cpu.clear()
        for tier in self.lower:
            tier.clear()

    def close(self) -> None:
        """Finish queued writes (bounded), then release every tier."""
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True, cancel_futures=True)
        for tier in self.lower:
            try:
                tier.close()
            except Exception:
                logger.exception("kvtier %s tier did not close cleanly", tier.name)
        self.cpu.close()


def is_shared(tier: LowerTier) -> bool:
    """Whether other processes see ``tier``: every lower tier but the local disk (named
    ``disk``; the shared filesystem's file tier is ``fs``)."""
    return tier.name != LOCAL_DISK


def open_lower_tiers(
    config: KVTierConfig,
    stats: Stats,
    namespace: str,
    events: TierEventLog | None = None,
    *,
    disk_shard: str | None = None,
    shared_disk: SharedDisk | None = None,
) -> list[LowerTier]:
    """The disk and remote tiers ``config`` enables, fastest first. ``events`` receives
    the local disk tier's records (shared tiers record none: other engines and the
    store itself change them out of this engine's sight). ``disk_shard``: the local disk
    tier's subdirectory of ``local_disk`` (one worker rank's, so that each rank bounds and
    rebuilds its own files: with all ranks in one tree, a restarted rank would index its
    peers' files too and evict them within its own bound). ``shared_disk``: the chunks
    this rank shares with replicas on its machine go to their own directory, which one
    of them writes and bounds (``split_disk``).

    Raises:
        ValueError: a tier cannot be set up (the message names the config key).
    """
    serde = make_serde(config.remote_serde, config)
    tiers: list[LowerTier] = []
    if config.local_disk:
        own = _open_local_disk(config, stats, serde, disk_shard, events)
        tiers.append(own)
        if shared_disk is not None:
            try:
                bounded = shared_disk.writer
                shared = _open_local_disk(config, stats, serde, shared_disk.subdir, events, bounded)
            except BaseException:
                own.close()
                raise
            tiers[0] = SplitDisk(
                own, shared, shared_disk.owns, writer=shared_disk.writer, stats=stats
            )
    if config.remote_url:
        try:
            tiers.append(_open_remote(config, stats, namespace))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
    return tiers


def _open_local_disk(
    config: KVTierConfig,
    stats: Stats,
    serde: Serde,
    subdir: str | None,
    events: TierEventLog | None,
    bounded: bool = True,
) -> FileTier:
    """The local disk tier in ``subdir`` of ``local_disk``; ``bounded`` by
    ``max_local_disk_size``, or with no bound and no index (a directory another process
    bounds)."""
    assert config.local_disk is not None
    return FileTier(
        os.path.join(config.local_disk, subdir) if subdir else config.local_disk,
        name=LOCAL_DISK,
        capacity_bytes=config.max_local_disk_bytes if bounded else None,
        serde=serde,
        stats=stats,
        policy=config.cache_policy,
        o_direct=config.local_disk_o_direct,
        queue_capacity=config.store_queue_size,
        events=events,
    )


def _open_remote(config: KVTierConfig, stats: Stats, namespace: str) -> LowerTier:
    """The tier of ``config.remote_url``, opened by its scheme's module (``schemes``)."""
    url = config.remote_url
    assert url is not None
    open_remote: RemoteOpener = schemes.load_module(url).open_remote
    serde = make_serde(config.remote_serde, config)
    return open_remote(RemoteRequest(url, config, serde, stats, space_of(namespace)))
