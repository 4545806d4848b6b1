"""``KVTierHiCacheStorage``: kvtier's tiers as an SGLang HiCache storage backend.

SGLang (0.5.23) builds it through its dynamic backend factory,
``backend_class(storage_config, kwargs)``, then hands it the host KV pool
(``register_mem_pool_host``) and, for models with extra state pools, those pools too
(``register_mem_host_pool_v2``). Its cache controller then calls, from its prefetch and
backup threads::

    prefetch  batch_exists(keys)               → leading pages some tier holds
              batch_get_v1(keys, host_indices) → pages into the host pool (interface_v1)
              batch_get(keys, flat_pages)      → the generic path otherwise
    backup    batch_set_v1(keys, host_indices) / batch_set(keys, flat_pages)
    hybrid    batch_exists_v2 / batch_get_v2 / batch_set_v2 with PoolTransfers

One page is one kvtier chunk (``pages.py``): copied between the host pool and a chunk
buffer of kvtier's CPU pool, kept in the CPU tier and written through to the disk and
remote tiers; or, where the disk tier is the only tier, written from and read into the
host pool directly (``page_store.py``). A store returns once the lower tiers have it.

NOTE: SGLang calls ``close()`` only when storage is detached at run time, never at
shutdown, so nothing may wait for it: every ``batch_set*`` flushes its pages to the disk
and remote tiers before it returns. A page that is missing, corrupt (checksum, header,
shape) or in a tier that is down is reported absent — never wrong data, and no call
raises into SGLang's cache controller (a fault is logged once and answered as a miss).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.config import KVTierConfig, load_config
from kvtier.integration.sglang.page_store import Moved, PageBuffers, PageStore
from kvtier.integration.sglang.pages import HostPool, PageFormat, PageKeys, split_extra_config
from kvtier.logs import set_kvtier_log_level
from kvtier.observability.prometheus import ANNOUNCED_EVENT_COUNTERS, MetricsServer, export
from kvtier.observability.stats import Counter, Stats
from kvtier.storage.manager import StorageManager
from kvtier.storage.split_disk import SharedDisk
from kvtier.warn import warn_once

logger = logging.getLogger(__name__)

KV = str(PoolName.KV)

KV_EVENT_COUNTERS = (*ANNOUNCED_EVENT_COUNTERS, Counter.KV_EVENTS_DROPPED)

T = TypeVar("T")


def _absent_on_error(answer: Callable[..., T]):
    """Decorate a method so that an exception becomes ``answer(*args)``: a miss, logged
    once. SGLang's cache controller must never see kvtier raise."""

    def decorate(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                warn_once(logger, f"kvtier {method.__name__} failed ({exc!r}): answered as a miss")
                logger.debug("kvtier %s failed", method.__name__, exc_info=True)
                return answer(*args, **kwargs)

        return wrapper

    return decorate


def disk_dirs(c: HiCacheStorageConfig) -> tuple[str | None, str | None]:
    """The local disk's directories of one rank (under ``local_disk``; None: that
    directory itself): its own pages', ``rank<r>of<n>`` among the TP x PP ranks (after
    ``dp<d>-`` for a data-parallel attention rank d > 0), and the shared pages' of an MLA
    model, one per shard of the key (``pp0of2-dcp1of2``; none: ``local_disk``)."""
    dp = [f"dp{c.dp_rank}"] if c.dp_rank else []
    ranks = c.tp_size * c.pp_size
    rank = c.pp_rank * c.tp_size + c.tp_rank
    own = "-".join([*dp, f"rank{rank}of{ranks}"]) if ranks > 1 or dp else None
    shared = "-".join([*dp, *(f"{name}{r}of{n}" for name, r, n in _shards(c) if n > 1)])
    return own, shared or None


def _shards(c: HiCacheStorageConfig) -> list[tuple[str, int, int]]:
    """The shards a page key has besides its TP rank: (name, rank, size)."""
    return [
        ("pp", c.pp_rank, c.pp_size),
        ("cp", c.attn_cp_rank, c.attn_cp_size),
        ("dcp", c.dcp_rank, c.dcp_size),
    ]


def _all_false(keys: Sequence[Any], *args: Any, **kwargs: Any) -> list[bool]:
    return [False] * len(keys)


def _per_pool_false(transfers: Sequence[PoolTransfer], *args: Any, **kwargs: Any):
    return {t.name: [False] * len(t.keys or []) for t in transfers}


class KVTierHiCacheStorage(HiCacheStorage):
    """kvtier as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``).

    Args:
        storage_config: what SGLang's cache controller passes: ranks, model, MLA or not,
            and ``extra_config`` — the JSON of ``--hicache-storage-backend-extra-config``,
            whose kvtier keys (and ``config_file``) configure kvtier; SGLang's own keys
            there (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``)
            are accepted and left to SGLang.
        kwargs: the factory's extra keyword arguments (unused).

    Raises:
        ConfigError: an unknown kvtier key or a bad value (the message names it).
        ValueError: ``KVTIER_LOG_LEVEL`` is not a log level.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        set_kvtier_log_level()  # SGLang configures the logging; kvtier's level is its own
        self.storage_config = storage_config
        self.config: KVTierConfig = load_config(
            overrides=split_extra_config(storage_config.extra_config)
        )
        if "enable_storage_metrics" in (storage_config.extra_config or {}):
            logger.warning(
                "kvtier HiCache storage: enable_storage_metrics in the storage backend's "
                "extra config does nothing (SGLang does not read it there); SGLang's "
                "storage metrics, kvtier's get_stats among them, follow --enable-metrics"
            )
        c = storage_config
        model = self.config.model_name or c.model_name or "default"
        shard = tuple((name, f"{r}of{n}") for name, r, n in _shards(c) if n > 1)
        self.keys = PageKeys(
            model, c.tp_rank, c.tp_size, c.is_mla_model, self.config.key_salt, shard
        )
        self.stats = Stats()
        # SGLang's own writer (HiCacheStorageConfig.is_storage_writer): of the TP ranks
        # that hold the same MLA pages, the one in the first DCP group
        self.writer = not c.is_mla_model or c.tp_rank == c.dcp_rank
        own_dir, shared_dir = disk_dirs(c)
        self.storage = StorageManager(
            self.config,
            self.stats,
            namespace=model,
            disk_shard=own_dir,
            write_shared=True if self.writer else self.keys.owns,
            shared_disk=(
                SharedDisk(shared_dir, self.keys.owns, self.writer)
                if c.is_mla_model and c.tp_size > 1
                else None
            ),
        )
        self.pages = PageStore(
            self.storage, self.stats, self.keys, verify_checksums=self.config.verify_checksums
        )
        self._pools: dict[str, tuple[HostPool, PageFormat]] = {}
        self._recent = StorageMetrics()
        self._metrics_server: MetricsServer | None = None
        if self.config.metrics_port is not None:
            port = self.config.metrics_port and self.config.metrics_port + c.tp_rank
            self._metrics_server = MetricsServer(
                self.config.metrics_host, port, lambda: [self.metrics()]
            )
        logger.info(
            "kvtier HiCache storage: model %s, tp rank %d/%d, tiers %s (%s)",
            model,
            c.tp_rank,
            c.tp_size,
            ", ".join(self.storage.tier_names) or "none",
            self.config.summary(),
        )

    # -- host pools ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: HostPool) -> None:
        """The host KV pool the v1 and generic paths move pages in and out of."""
        super().register_mem_pool_host(mem_pool_host)
        self._pools[KV] = (mem_pool_host, PageFormat.of(mem_pool_host))
        fmt = self._pools[KV][1]
        logger.info(
            "kvtier HiCache storage: %s %s pool, %d-token pages of %s %s (%d bytes)",
            "MLA" if fmt.is_mla else "MHA",
            fmt.layout,
            fmt.page_size,
            list(fmt.shape),
            fmt.dtype,
            fmt.nbytes,
        )

    def register_mem_host_pool_v2(self, host_pool: HostPool, host_pool_name) -> None:
        """A pool of the v2 path (``PoolTransfer.name``); the KV pool keeps its canonical
        pages, every other pool is stored as its own flat pages."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV and KV in self._pools and self._pools[KV][0] is host_pool:
            return
        try:
            self._pools[name] = (host_pool, PageFormat.of(host_pool, flat=name != KV))
        except Exception as exc:  # e.g. an allocator-only pool with no pages of its own
            logger.warning("kvtier: the %s pool's pages cannot be stored (%r): misses", name, exc)

    def _pool(self, name: str) -> tuple[HostPool, PageFormat]:
        entry = self._pools.get(str(name))
        if entry is None:
            raise RuntimeError(f"no host pool named {name!r} was registered with kvtier")
        return entry

    # -- the zero-copy v1 path -------------------------------------------------------

    @_absent_on_error(_all_false)
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load each page into the host pool at ``host_indices[i * page_size]``; True
        for each page loaded (a run from the first: a page after a miss is not loaded)."""
        return self._load_pages(KV, keys, host_indices)

    @_absent_on_error(_all_false)
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store each page of the host pool at ``host_indices[i * page_size]``; True for
        each page stored (or already held). Returns once the lower tiers have it."""
        return self._store_pages(KV, keys, host_indices)

    @staticmethod
    def _starts(fmt: PageFormat, n: int, host_indices: torch.Tensor | None) -> list[int]:
        """The host slot of each of ``n`` pages: every ``fmt.page_size``-th index."""
        size = fmt.page_size
        if host_indices is None or host_indices.numel() < n * size:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(f"{n} pages need {n * size} host indices, got {got}")
        return [int(i) for i in host_indices[: n * size : size].tolist()]

    def _load_pages(self, pool_name: str, keys: Sequence[str], host_indices) -> list[bool]:
        pool, fmt = self._pool(pool_name)
        starts = self._starts(fmt, len(keys), host_indices)

        def write(i: int, data: torch.Tensor) -> None:
            if fmt.canonical:
                fmt.page(pool, starts[i]).copy_(data)
            else:
                pool.set_from_flat_data_page(starts[i], data)

        return self._load(pool_name, fmt, keys, write, lambda i: fmt.buffers(pool, starts[i]))

    def _store_pages(self, pool_name: str, keys: Sequence[str], host_indices) -> list[bool]:
        pool, fmt = self._pool(pool_name)
        starts = self._starts(fmt, len(keys), host_indices)
        return self._store(
            pool_name,
            fmt,
            keys,
            lambda i: fmt.page(pool, starts[i]),
            lambda i: fmt.buffers(pool, starts[i]),
        )

    # -- the generic path ------------------------------------------------------------

    @_absent_on_error(lambda *args, **kwargs: None)
    def get(
        self,
        key: str,
        target_location: torch.Tensor | None = None,
        target_sizes: Any = None,
    ) -> torch.Tensor | None:
        """One page as a flat data page of the host pool's layout (into
        ``target_location`` when given), or None."""
        return self.batch_get([key], [target_location])[0]

    @_absent_on_error(lambda keys, *args, **kwargs: [None] * len(keys))
    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor | None] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each page as a flat data page of the host pool's layout (SGLang's generic
        prefetch path), or None from the first page not held."""
        _, fmt = self._pool(KV)
        targets = list(target_locations or [None] * len(keys))
        for i, target in enumerate(targets):
            if target is None:
                targets[i] = torch.empty(fmt.numel, dtype=fmt.dtype)
        loaded = self._load(KV, fmt, keys, lambda i, data: fmt.from_flat(targets[i]).copy_(data))
        return [t if ok else None for t, ok in zip(targets, loaded, strict=True)]

    @_absent_on_error(lambda *args, **kwargs: False)
    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat data page of the host pool's layout."""
        return self.batch_set([key], [value])

    @_absent_on_error(lambda *args, **kwargs: False)
    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat data pages (SGLang's generic backup path); True if all were."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many pages")
        _, fmt = self._pool(KV)
        return all(self._store(KV, fmt, keys, lambda i: fmt.from_flat(values[i])))

    # -- lookups ---------------------------------------------------------------------

    @_absent_on_error(lambda *args, **kwargs: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_absent_on_error(lambda *args, **kwargs: 0)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, some tier holds; those found only in a
        lower tier start moving into the CPU tier (the load that follows finds them), as
        many as one load stages there at once: a load of these pages fetches them all
        into the CPU pool before writing any into SGLang's host pool."""
        _, fmt = self._pool(KV)
        hits = self.storage.lookup_prefix(
            [self.keys.key(k, fmt) for k in keys],
            prefetch=True,
            prefetch_most=self.storage.cpu.fitting(fmt.shape, fmt.dtype),
        )
        self.stats.inc(Counter.LOOKUP_REQUESTS)
        self.stats.inc(Counter.LOOKUP_TOKENS, len(keys) * fmt.page_size)
        self.stats.inc(Counter.LOOKUP_HIT_TOKENS, hits * fmt.page_size)
        return hits

    # -- the v2 pool-transfer path ---------------------------------------------------

    @_absent_on_error(lambda *args, **kwargs: PoolTransferResult.empty())
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of ``keys``: KV pages held from the first, cut by each extra
        pool's hit policy (``PoolHitPolicy``), as SGLang's own backends compute it."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            if name in self._pools:
                _, fmt = self._pools[name]
                held = self.storage.contains_many(
                    [self.keys.key(k, fmt, name) for k in keys[:kv_pages]]
                )
            else:
                held = [False] * kv_pages
            policy = PoolHitPolicy(transfer.hit_policy)
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = held.index(False) if False in held else kv_pages
                allowed = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()) or 1)
                allowed = {n for n in range(1, kv_pages + 1) if all(held[max(0, n - window) : n])}
                boundary = max(allowed, default=0)
            else:  # BLOCK_GROUPS: its own verdict (leading whole groups), never a gate
                group = max(1, transfer.group_pages or 1)
                run = held.index(False) if False in held else kv_pages
                boundary, allowed = run // group * group, set(restorable)
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    @_absent_on_error(_per_pool_false)
    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages into its pool; per pool, True for each page loaded."""
        return {t.name: self._per_transfer(t, self._load_pages) for t in transfers}

    @_absent_on_error(_per_pool_false)
    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool; per pool, True for each page stored."""
        return {t.name: self._per_transfer(t, self._store_pages) for t in transfers}

    @staticmethod
    def _per_transfer(transfer: PoolTransfer, move: Callable[..., list[bool]]) -> list[bool]:
        """``move(name, keys, host_indices)`` for one transfer; a fault fails that pool only."""
        if not transfer.keys:
            return []
        try:
            return move(str(transfer.name), transfer.keys, transfer.host_indices)
        except Exception as exc:
            warn_once(logger, f"kvtier {transfer.name} pool transfer failed ({exc!r}): a miss")
            return [False] * len(transfer.keys)

    # -- moving pages ----------------------------------------------------------------

    def _load(
        self,
        pool_name: str,
        fmt: PageFormat,
        page_keys: Sequence[str],
        write: Callable[[int, torch.Tensor], Any],
        buffers: PageBuffers | None = None,
    ) -> list[bool]:
        """``PageStore.load``, noted for SGLang's storage metrics."""
        moved = self.pages.load(pool_name, fmt, page_keys, write, buffers)
        self._note(self._recent.prefetch_pgs, self._recent.prefetch_bandwidth, moved, fmt)
        return moved.ok

    def _store(
        self,
        pool_name: str,
        fmt: PageFormat,
        page_keys: Sequence[str],
        read: Callable[[int], torch.Tensor],
        buffers: PageBuffers | None = None,
    ) -> list[bool]:
        """``PageStore.store``, noted for SGLang's storage metrics."""
        moved = self.pages.store(pool_name, fmt, page_keys, read, buffers)
        self._note(self._recent.backup_pgs, self._recent.backup_bandwidth, moved, fmt)
        return moved.ok

    def _note(self, pages: list, bandwidth: list, moved: Moved, fmt: PageFormat) -> None:
        if self.storage_config.enable_storage_metrics and moved.pages:
            pages.append(moved.pages)
            bandwidth.append(moved.pages * fmt.nbytes / 1e9 / max(moved.seconds, 1e-9))

    # -- management ------------------------------------------------------------------

    def get_stats(self) -> StorageMetrics:
        """Pages per call and GB/s of the loads (prefetch) and stores (backup) since the
        last call, for SGLang's storage metrics (``--enable-metrics``, which sets
        ``HiCacheStorageConfig.enable_storage_metrics``; without it none are noted)."""
        recent, self._recent = self._recent, StorageMetrics()
        return recent

    def metrics(self) -> dict:
        """kvtier's counters, histograms and tier gauges (``prometheus.export``), under the
        same names as in vLLM, labelled with the TP rank. The KV-event counters are left
        out (kvtier announces no KV events to SGLang, so nothing here counts them), and
        those the tiers cannot move (``StorageManager.uncounted``)."""
        return export(
            self.stats,
            gauges=self.storage.gauges(),
            tiers=self.storage.lower_tier_names,
            omit=(*KV_EVENT_COUNTERS, *self.storage.uncounted()),
            rank=str(self.storage_config.tp_rank),
        )

    def clear(self) -> None:
        """Drop every page from every tier (a shared tier: this model's namespace)."""
        try:
            self.storage.clear()
        except Exception as exc:
            warn_once(logger, f"kvtier clear failed ({exc!r})")

    def close(self) -> None:
        """Finish queued writes (bounded) and release the tiers (SGLang calls it when
        storage is detached at run time)."""
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        self.storage.close()
