"""The cache engine: store, retrieve and look up a prompt's KV by chunks.

``CacheEngine`` ties the chunker (tokens → chunk keys), the storage manager
(tiers) and the paged I/O (engine pages ↔ chunk buffers) together. It is
engine-agnostic: the vLLM integration calls it with token ids and slot mappings.

    tokens        |<-- chunk 0 -->|<-- chunk 1 -->|<-- chunk 2 -->|
    slot_mapping   s0 s1 ...       (one engine slot per token; < 0 = not in the cache)
    store          gather slots → chunk buffer → tiers (keyed by the chained hash)
    retrieve       tiers → chunk buffer → scatter into slots, stopping at the first miss
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtier.chunker import Chunk, Chunker, RequestExtras
from kvtier.config import KVTierConfig
from kvtier.hashing import ChunkHasher, TokenIds
from kvtier.keys import CacheKey
from kvtier.observability.prometheus import ANNOUNCED_EVENT_COUNTERS, export
from kvtier.observability.stats import Counter, Stats
from kvtier.observability.tier_events import TierEventLog
from kvtier.paged_io import PagedIO
from kvtier.storage.checked import CheckedChunks
from kvtier.storage.manager import StorageManager
from kvtier.transfers import RetrieveTransfer, StoreResult, StoreTransfer
from kvtier_kernels import PagedKV
from kvtier_kernels.dtypes import dtype_name

Mask = torch.Tensor | np.ndarray | Sequence[bool] | None

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineMetadata:
    """Who produced the KV: separates caches of different models and shards.

    ``world_size`` and ``rank`` name the shard; both are part of every key. Where several
    ranks hold the same shard (each tensor-parallel rank of an MLA engine holds the whole
    latent cache; with fewer KV heads than ranks, vLLM gives each head to several),
    ``replicas`` says how many and ``replica`` which one this is: they share keys, replica
    0 alone writes the shared tiers, and each keeps its own memory and local disk tiers.
    """

    model_name: str
    world_size: int = 1
    rank: int = 0
    kv_dtype: str | None = None  # None: taken from the KV cache when it is bound
    tags: tuple[tuple[str, str], ...] = ()  # e.g. the engine layout, when chunks depend on it
    replicas: int = 1
    replica: int = 0

    @property
    def worker_rank(self) -> int:
        """This process's rank among the engine's ``world_size * replicas`` ranks."""
        return self.rank * self.replicas + self.replica

    @property
    def worker_count(self) -> int:
        """The engine's ranks, replicas included."""
        return self.world_size * self.replicas

    @property
    def writes_shared_tiers(self) -> bool:
        """Whether this rank writes the tiers other processes see (remote, shared
        filesystem): every rank of its own shard, one replica of a replicated one."""
        return self.replica == 0

    def replicated(self, replicas: int) -> EngineMetadata:
        """This rank's metadata when each run of ``replicas`` consecutive ranks holds the
        same KV (an MLA engine's tensor-parallel ranks, ``rank = stage * tp + tp_rank``, or
        those vLLM gives one KV head): the shard is the run's (``rank // replicas`` of
        ``world_size // replicas``), the replica this rank's place in it.

        Raises:
            ValueError: ``replicas`` does not divide ``world_size``, or this metadata is
                already replicated.
        """
        if replicas == 1:
            return self
        if self.replicas != 1 or replicas < 1 or self.world_size % replicas:
            raise ValueError(
                f"cannot split world_size={self.world_size} (replicas={self.replicas}) "
                f"into runs of {replicas} replicas"
            )
        stage, replica = divmod(self.rank, replicas)
        return replace(
            self,
            world_size=self.world_size // replicas,
            rank=stage,
            replicas=replicas,
            replica=replica,
        )


def disk_shard(metadata: EngineMetadata) -> str | None:
    """The local disk tier's subdirectory for one rank of a tensor- or pipeline-parallel
    engine (``rank1of2``), replicas included, since a rank's directory is its own; None
    with a single rank, whose files are the tree itself."""
    if metadata.worker_count == 1:
        return None
    return f"rank{metadata.worker_rank}of{metadata.worker_count}"


class CacheEngine:
    """Stores and retrieves a paged KV cache chunk by chunk.

    Args:
        config: the validated kvtier config.
        metadata: model name and parallel rank (part of every key).
        paged: the engine's KV cache; may be bound later with ``bind``.
        stats: counters to update (a fresh ``Stats`` by default).
        pin_memory: pin the host pool (None: when a GPU is present).
        events: where the tiers record what they hold, for KV events (``kvtier.observability.tier_events``;
            None: nothing is recorded).
    """

    def __init__(
        self,
        config: KVTierConfig,
        metadata: EngineMetadata,
        paged: PagedKV | None = None,
        *,
        stats: Stats | None = None,
        pin_memory: bool | None = None,
        events: TierEventLog | None = None,
    ):
        self.config = config
        self.metadata = metadata
        self.stats = stats or Stats()
        self.events = events
        self.storage = StorageManager(
            config,
            self.stats,
            pin_memory=pin_memory,
            namespace=config.model_name or metadata.model_name,
            events=events,
            disk_shard=disk_shard(metadata),
            write_shared=metadata.writes_shared_tiers,
        )
        self.checked = CheckedChunks(self.storage, verify=config.verify_checksums)
        self.hasher = ChunkHasher(config.hash_algorithm, config.hash_seed)
        self.paged_io: PagedIO | None = None
        self.chunker: Chunker | None = None
        self._closed = False
        if metadata.kv_dtype is not None:
            self._make_chunker(metadata.kv_dtype)
        if paged is not None:
            self.bind(paged)

    def _make_chunker(self, kv_dtype: str) -> None:
        m = self.metadata
        template = CacheKey(
            self.config.model_name or m.model_name,
            m.world_size,
            m.rank,
            kv_dtype,
            b"",
            None,
            m.tags,
        )
        self.chunker = Chunker(self.config.chunk_size, self.hasher, template)

    def bind(self, paged: PagedKV) -> None:
        """Attach the engine's KV cache.

        Raises:
            ValueError: the cache's dtype differs from ``metadata.kv_dtype``.
        """
        kv_dtype = dtype_name(paged.dtype)
        if self.metadata.kv_dtype not in (None, kv_dtype):
            raise ValueError(
                f"KV cache dtype {kv_dtype} differs from metadata.kv_dtype={self.metadata.kv_dtype}"
            )
        self.paged_io = PagedIO(paged, self.config.kernel_backend)
        if self.chunker is None:
            self._make_chunker(kv_dtype)
        self._warn_if_no_chunk_fits()

    def _warn_if_no_chunk_fits(self) -> None:
        """One warning when the CPU pool, which stages every chunk (``local_cpu: false``
        too), is smaller than one whole chunk of the bound cache: nothing is ever stored
        or loaded then (each try is counted as an allocation failure)."""
        assert self.paged_io is not None
        shape, dtype = self.paged_io.chunk_shape(self.config.chunk_size), self.paged_io.dtype
        if not self.storage.cpu.fits(shape, dtype):
            chunk_bytes = math.prod(shape) * dtype.itemsize
            logger.warning(
                "kvtier: max_local_cpu_size=%g GB (%d bytes) is smaller than one chunk of "
                "this KV cache (%d bytes): no chunk can be stored or loaded; raise it",
                self.config.max_local_cpu_size,
                self.storage.cpu.pool.capacity,
                chunk_bytes,
            )

    def _require_chunker(self) -> Chunker:
        if self._closed:
            raise RuntimeError("CacheEngine is closed: build a new one to store or load")
        if self.chunker is None:
            raise RuntimeError(
                "CacheEngine does not know the KV dtype: give metadata.kv_dtype or bind(paged)"
            )
        return self.chunker

    def _require_bound(self) -> tuple[PagedIO, Chunker]:
        if self.paged_io is None:
            raise RuntimeError("CacheEngine has no KV cache bound: call bind(paged) first")
        return self.paged_io, self._require_chunker()

    def _chunks(self, tokens: TokenIds, mask: Mask, extras: RequestExtras | None) -> list[Chunk]:
        return self._require_chunker().chunks(
            tokens, mask, extras, include_partial=self.config.save_unfull_chunk
        )

    # -- store -----------------------------------------------------------------------

    def store(
        self,
        tokens: TokenIds,
        mask: Mask = None,
        *,
        slot_mapping: torch.Tensor,
        extras: RequestExtras | None = None,
    ) -> StoreResult:
        """Copy the KV of ``tokens`` out of the engine's pages into the tiers.

        Args:
            tokens: the prompt's token ids.
            mask: optional ``F…F T…T`` booleans; the False prefix (whole chunks) is
                already stored and is skipped.
            slot_mapping: ``[len(tokens)]`` engine slot of each token.
            extras: LoRA / multimodal / cache-salt keys.

        Returns:
            What was stored and skipped. Chunks already stored are skipped; a chunk with
            a token that is not in the engine's cache (slot < 0) ends the store, as does
            memory exhaustion (counted; a later chunk is useless without its prefix).
        """
        chunks = self._require_chunker().prompt_chunks(
            tokens, mask, extras, include_partial=self.config.save_unfull_chunk
        )
        return self.store_chunks(chunks, slot_mapping)

    def store_chunks(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> StoreResult:
        """``store`` for chunks named elsewhere (``chunker.chunks_from_hashes``).

        ``slot_mapping[t]`` is the engine slot of token ``t`` (absolute position).
        """
        paged_io, _ = self._require_bound()
        # each chunk's gather is queued as soon as its buffer is staged: on a GPU the copy
        # of the first chunk runs while the next ones are hashed (PromptChunks) and staged
        transfer = StoreTransfer(self.checked, paged_io, chunks, slot_mapping, gather_now=True)
        return transfer.commit()

    def begin_store(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> StoreTransfer:
        """Phase one of a store: stage a buffer for each chunk not yet stored.

        The buffers are filled by ``gather`` (all layers, or one layer at a time while the
        engine computes the next) and published by ``commit``; ``abort`` drops them.
        """
        paged_io, _ = self._require_bound()
        return StoreTransfer(self.checked, paged_io, list(chunks), slot_mapping)

    # -- retrieve --------------------------------------------------------------------

    def retrieve(
        self,
        tokens: TokenIds,
        mask: Mask = None,
        *,
        slot_mapping: torch.Tensor,
        extras: RequestExtras | None = None,
    ) -> int:
        """Load the cached prefix of ``tokens`` into the engine's pages.

        Args:
            tokens: the prompt's token ids.
            mask: optional ``F…F T…T``; the False prefix (whole chunks) is already in the
                engine and is not loaded.
            slot_mapping: ``[len(tokens)]`` slot to write each token to (< 0: skip it).
            extras: LoRA / multimodal / cache-salt keys.

        Returns:
            ``n`` such that ``tokens[:n]`` are now in the engine's cache (the masked
            prefix counts as present); loading stops at the first chunk no tier has.
        """
        chunker = self._require_chunker()
        skipped = chunker.masked_prefix(mask, len(tokens))
        chunks = chunker.prompt_chunks(
            tokens, mask, extras, include_partial=self.config.save_unfull_chunk
        )
        self.stats.inc(Counter.REQUESTED_TOKENS, len(tokens) - skipped)
        filled = self.retrieve_chunks(chunks, slot_mapping, count_requested=False)
        return max(filled, skipped)

    def retrieve_chunks(
        self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor, *, count_requested=True
    ) -> int:
        """``retrieve`` for chunks named elsewhere; returns the end of the loaded run
        (``chunks[0].start`` when nothing was loaded)."""
        paged_io, _ = self._require_bound()
        # each chunk's scatter is queued as soon as it is accepted (see store_chunks)
        transfer = RetrieveTransfer(self.checked, paged_io, chunks, slot_mapping, scatter_now=True)
        transfer.close()
        if count_requested and chunks:
            self.stats.inc(Counter.REQUESTED_TOKENS, chunks[-1].end - chunks[0].start)
        return transfer.end

    def begin_retrieve(
        self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor
    ) -> RetrieveTransfer:
        """Phase one of a load: fetch and verify the longest run of ``chunks`` the tiers
        hold (held until ``close``); ``scatter`` then writes them into the engine."""
        paged_io, _ = self._require_bound()
        chunks = list(chunks)
        transfer = RetrieveTransfer(self.checked, paged_io, chunks, slot_mapping)
        if chunks:
            self.stats.inc(Counter.REQUESTED_TOKENS, chunks[-1].end - chunks[0].start)
        return transfer

    # -- lookup ----------------------------------------------------------------------

    def lookup(self, tokens: TokenIds, extras: RequestExtras | None = None) -> int:
        """How many leading tokens of ``tokens`` some tier holds (chunk-aligned, plus a
        stored partial last chunk when ``save_unfull_chunk``). Counted as one lookup."""
        chunks = self._chunks(tokens, None, extras)
        hits = self._held_prefix([c.key for c in chunks])
        self.stats.inc(Counter.LOOKUP_REQUESTS)
        self.stats.inc(Counter.LOOKUP_TOKENS, len(tokens))
        hit_tokens = chunks[hits - 1].end if hits else 0
        self.stats.inc(Counter.LOOKUP_HIT_TOKENS, hit_tokens)
        return hit_tokens

    @property
    def max_load_chunks(self) -> int:
        """Whole chunks one load can stage at once: what the CPU pool holds of them.

        NOTE: a two-phase load (``begin_retrieve``) holds every chunk it fetches in the
        CPU pool (lower tiers' chunks are read into it) until the last one is written into
        the engine, so one of more chunks than this fails partway, every time, or at its
        first chunk when the pool holds the run's tail (``retrieve`` loads a longer run
        in rounds of this many). The pool is shared (other loads, stores in flight), so
        this bounds a load; it does not promise one.
        """
        paged_io, _ = self._require_bound()
        return self.storage.cpu.fitting(
            paged_io.chunk_shape(self.config.chunk_size), paged_io.dtype
        )

    def lookup_hashes(self, hashes: Sequence[bytes], load_from: int = 0) -> int:
        """How many leading chunks of a chain of chunk hashes some tier holds; those found
        only in a lower tier start moving into memory (prefetch): from chunk ``load_from``
        (the first a load would take: vLLM's own prefix is loaded by nobody) on, at most
        ``max_load_chunks`` of them.

        NOTE: the one lookup path: ``lookup`` and vLLM's scheduler (whose hashes come over
        the lookup socket) both end here. It counts nothing: ``lookup`` counts its own
        calls, and in vLLM the scheduler counts once for all ranks.
        """
        chunker = self._require_chunker()
        return self._held_prefix([chunker.key(h) for h in hashes], load_from)

    def held_chunks(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether some tier holds each chunk of a chain of chunk hashes, wherever a gap
        lies (vLLM's scheduler, for a model that attends to a window only). Prefetches
        nothing, counts nothing."""
        chunker = self._require_chunker()
        return self.storage.contains_many([chunker.key(h) for h in hashes])

    def _held_prefix(self, keys: list[CacheKey], load_from: int = 0) -> int:
        """How many of ``keys`` some tier holds, prefetching what one load from chunk
        ``load_from`` can take (from the start when the caller knows no prefix)."""
        most = self.max_load_chunks if self.paged_io is not None else None
        return self.storage.lookup_prefix(
            keys, prefetch=True, prefetch_from=load_from, prefetch_most=most
        )

    def chunks_from_hashes(
        self, first_chunk: int, hashes: Sequence[bytes], end: int
    ) -> list[Chunk]:
        """The chunks named by ``hashes`` (chunk ``first_chunk`` onwards), the last one ending
        at token ``end`` at most: what ``begin_store`` / ``begin_retrieve`` take when the
        tokens were hashed elsewhere (vLLM's scheduler)."""
        return self._require_chunker().chunks_from_hashes(first_chunk, list(hashes), end)

    def chunk_keys(self, tokens: TokenIds, extras: RequestExtras | None = None) -> list[CacheKey]:
        """The storage key of each chunk of ``tokens`` (whole chunks, plus a partial last
        chunk when ``save_unfull_chunk``)."""
        return [chunk.key for chunk in self._chunks(tokens, None, extras)]

    def metrics(self, omit: Iterable[str] = ()) -> dict:
        """This engine's counters, histograms and tier gauges as plain data
        (``prometheus.export``), labelled with its rank; ``omit``: counters another
        process counts for it (a vLLM worker's lookups are counted by the scheduler).
        The counters an engine never counts are left out: those of the KV events vLLM's
        scheduler announces, without ``events`` the tier records dropped, and those its
        tiers cannot move (``StorageManager.uncounted``)."""
        uncounted = [*ANNOUNCED_EVENT_COUNTERS, *omit, *self.storage.uncounted()]
        if self.events is None:
            uncounted.append(Counter.KV_EVENTS_DROPPED)
        return export(
            self.stats,
            gauges=self.storage.gauges(),
            tiers=self.storage.lower_tier_names,
            omit=uncounted,
            rank=str(self.metadata.worker_rank),
        )

    @property
    def tier_names(self) -> list[str]:
        """The tiers, fastest first (``["cpu", "disk", "redis"]``)."""
        return self.storage.tier_names

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes to the disk and remote tiers are done; False on timeout."""
        return self.storage.flush(timeout)

    def clear(self) -> None:
        """Drop every chunk from every tier (chunks in use are released when their users
        are done)."""
        self.storage.clear()

    def close(self) -> None:
        """Release every stored chunk and the memory pool. A store, load or lookup after
        it raises ``RuntimeError``."""
        self._closed = True
        self.storage.close()
