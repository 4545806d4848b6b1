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

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.chunker import Chunk, Chunker, RequestExtras
from kvtier.config import KVTierConfig
from kvtier.hashing import ChunkHasher, TokenIds
from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.observability.prometheus import export
from kvtier.observability.stats import Counter, Histogram, Stats
from kvtier.observability.tier_events import TierEventLog
from kvtier.paged_io import PagedIO
from kvtier.storage.checked import CheckedChunks
from kvtier.storage.manager import StorageManager
from kvtier_kernels import PagedKV
from kvtier_kernels.dtypes import dtype_name

Mask = torch.Tensor | np.ndarray | Sequence[bool] | None


@dataclass(frozen=True, slots=True)
class EngineMetadata:
    """Who produced the KV: separates caches of different models and shards."""

    model_name: str
    world_size: int = 1
    rank: int = 0
    kv_dtype: str | None = None  # None: taken from the KV cache when it is bound
    tags: tuple[tuple[str, str], ...] = ()  # e.g. the engine layout, when chunks depend on it


@dataclass(slots=True)
class StoreResult:
    """What one ``store`` call did."""

    stored_chunks: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    skipped_existing: int = 0
    skipped_no_memory: int = 0
    seconds: float = 0.0


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
        self.storage = StorageManager(
            config,
            self.stats,
            pin_memory=pin_memory,
            namespace=config.model_name or metadata.model_name,
            events=events,
        )
        self.checked = CheckedChunks(self.storage, verify=config.verify_checksums)
        self.hasher = ChunkHasher(config.hash_algorithm, config.hash_seed)
        self.paged_io: PagedIO | None = None
        self.chunker: Chunker | None = None
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

    def _require_chunker(self) -> Chunker:
        if self.chunker is None:
            raise RuntimeError(
                "CacheEngine does not know the KV dtype: give metadata.kv_dtype or bind(paged)"
            )
        return self.chunker

    def _require_bound(self) -> tuple[PagedIO, Chunker]:
        if self.paged_io is None:
            raise RuntimeError("CacheEngine has no KV cache bound: call bind(paged) first")
        return self.paged_io, self._require_chunker()

    @staticmethod
    def _slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
            raise ValueError(
                f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected one slot per "
                f"token, at least ({num_tokens},)"
            )
        return slot_mapping.to(torch.int64)

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
        return self.store_chunks(self._chunks(tokens, mask, extras), slot_mapping)

    def store_chunks(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> StoreResult:
        """``store`` for chunks named elsewhere (``chunker.chunks_from_hashes``).

        ``slot_mapping[t]`` is the engine slot of token ``t`` (absolute position).
        """
        paged_io, _ = self._require_bound()
        # each chunk's gather is queued as soon as its buffer is staged: on a GPU the copy
        # of the first chunk runs while the next ones are staged
        transfer = StoreTransfer(self, paged_io, list(chunks), slot_mapping, gather_now=True)
        return transfer.commit()

    def begin_store(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> StoreTransfer:
        """Phase one of a store: stage a buffer for each chunk not yet stored.

        The buffers are filled by ``gather`` (all layers, or one layer at a time while the
        engine computes the next) and published by ``commit``; ``abort`` drops them.
        """
        paged_io, _ = self._require_bound()
        return StoreTransfer(self, paged_io, list(chunks), slot_mapping)

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
        chunks = self._chunks(tokens, mask, extras)
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
        transfer = RetrieveTransfer(self, paged_io, list(chunks), slot_mapping, scatter_now=True)
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
        return RetrieveTransfer(self, paged_io, list(chunks), slot_mapping)

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

    def lookup_hashes(self, hashes: Sequence[bytes]) -> int:
        """How many leading chunks of a chain of chunk hashes some tier holds; those found
        only in a lower tier start moving into memory (prefetch).

        NOTE: the one lookup path: ``lookup`` and vLLM's scheduler (whose hashes come over
        the lookup socket) both end here. It counts nothing: ``lookup`` counts its own
        calls, and in vLLM the scheduler counts once for all ranks.
        """
        chunker = self._require_chunker()
        return self._held_prefix([chunker.key(h) for h in hashes])

    def _held_prefix(self, keys: list[CacheKey]) -> int:
        return self.storage.lookup_prefix(keys, prefetch=True)

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
        process counts for it (a vLLM worker's lookups are counted by the scheduler)."""
        exported = export(
            self.stats,
            gauges=self.storage.gauges(),
            tiers=self.storage.lower_tier_names,
            rank=str(self.metadata.rank),
        )
        for name in omit:
            exported["counters"].pop(name, None)
        return exported

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
        """Release every stored chunk and the memory pool."""
        self.storage.close()


def _layer_part(obj: MemoryObj, layer: int | None) -> tuple[torch.Tensor, range | None]:
    """The chunk buffer's view of ``layer`` and the engine layers it holds (None: all)."""
    if layer is None:
        return obj.tensor, None
    return obj.tensor[:, layer : layer + 1], range(layer, layer + 1)


class StoreTransfer:
    """A store in flight: staged buffers for the chunks not yet stored.

    ``gather_now``: gather each chunk as soon as it is staged (``gather`` is then a no-op).

    NOTE: every staged buffer and every already-stored chunk of the request stays pinned
    until ``commit``/``abort``, so a prompt larger than the tier cannot evict its own
    prefix while it is being stored.
    """

    def __init__(
        self,
        engine: CacheEngine,
        paged_io: PagedIO,
        chunks: list[Chunk],
        slot_mapping: torch.Tensor,
        gather_now: bool = False,
    ):
        self.engine = engine
        self.paged_io = paged_io
        self.result = StoreResult()
        self._busy = 0.0
        self._gathered = gather_now
        self._staged: list[tuple[Chunk, MemoryObj, torch.Tensor]] = []
        self._pinned_existing: list[CacheKey] = []
        started = time.perf_counter()
        try:
            with paged_io.storing() if gather_now else contextlib.nullcontext():
                self._stage(chunks, slot_mapping)
        except BaseException:
            self.abort()  # nothing staged stays pinned
            raise
        self._busy += time.perf_counter() - started

    def _stage(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> None:
        engine, paged_io = self.engine, self.paged_io
        storage = engine.storage
        end = chunks[-1].end if chunks else 0
        slots = CacheEngine._slots(slot_mapping, end)
        placed = paged_io.device_slots(slots[:end])  # checked and moved once, for every copy
        for chunk in chunks:
            if storage.contains(chunk.key):
                self.result.skipped_existing += 1
                self._pinned_existing += storage.pin([chunk.key])
                continue
            if bool((slots[chunk.start : chunk.end] < 0).any()):
                break
            chunk_slots = placed[chunk.start : chunk.end]
            obj = storage.allocate(paged_io.chunk_shape(chunk.num_tokens), paged_io.dtype)
            if obj is None:
                self.result.skipped_no_memory = sum(
                    1 for c in chunks if c.index >= chunk.index and not storage.contains(c.key)
                )
                break
            obj.pin()
            self._staged.append((chunk, obj, chunk_slots))
            if self._gathered:
                paged_io.from_engine(obj.tensor, chunk_slots)

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def gather(self, layer: int | None = None) -> None:
        """Copy one layer (or every layer) of the staged chunks out of the engine."""
        if self._gathered:
            return
        started = time.perf_counter()
        with self.paged_io.storing():
            for _, obj, chunk_slots in self._staged:
                part, layers = _layer_part(obj, layer)
                self.paged_io.from_engine(part, chunk_slots, layers)
        self._busy += time.perf_counter() - started

    def commit(self) -> StoreResult:
        """Publish the staged chunks to the tiers (every layer must have been gathered)."""
        started = time.perf_counter()
        engine, result = self.engine, self.result
        try:
            self.paged_io.stores_done()  # the gathers have landed: read, publish, release
            for chunk, obj, _ in self._staged:
                if engine.checked.put(chunk.key, obj):
                    result.stored_chunks += 1
                    result.stored_tokens += chunk.num_tokens
                    result.stored_bytes += obj.data_nbytes
        finally:
            self._release()
        result.seconds = self._busy + time.perf_counter() - started
        s = engine.stats
        s.inc(Counter.STORE_REQUESTS)
        s.inc(Counter.STORED_CHUNKS, result.stored_chunks)
        s.inc(Counter.STORED_TOKENS, result.stored_tokens)
        s.inc(Counter.STORED_BYTES, result.stored_bytes)
        s.inc(Counter.STORE_SECONDS, result.seconds)
        s.observe(Histogram.STORE, result.seconds)
        s.inc(Counter.STORE_SKIPPED_EXISTING, result.skipped_existing)
        s.inc(Counter.STORE_SKIPPED_NO_MEMORY, result.skipped_no_memory)
        return result

    def abort(self) -> None:
        """Drop the staged buffers without storing anything."""
        self.paged_io.stores_done()  # no gather may still write a released buffer
        self._release()

    def _release(self) -> None:
        for _, obj, _ in self._staged:
            obj.unpin()
            obj.ref_down()
        self._staged = []
        self.engine.storage.unpin(self._pinned_existing)
        self._pinned_existing = []


class RetrieveTransfer:
    """A load in flight: the verified chunk objects of the longest available run.

    ``end`` is the token position the run reaches (``chunks[0].start`` for none). A chunk
    whose shape or dtype (or, with ``verify_checksums``, checksum) disagrees with what was
    asked ends the run: it is rejected (``CheckedChunks.accept``) and never written into
    the engine. A chunk a lower tier returned was verified by that tier as it was read.

    ``scatter_now``: scatter each chunk as soon as it is accepted (``scatter`` is a no-op).
    """

    def __init__(
        self,
        engine: CacheEngine,
        paged_io: PagedIO,
        chunks: list[Chunk],
        slot_mapping: torch.Tensor,
        scatter_now: bool = False,
    ):
        self.engine = engine
        self.paged_io = paged_io
        self._scattered = scatter_now
        self._held: list[tuple[Chunk, MemoryObj]] = []
        started = time.perf_counter()
        try:
            with paged_io.loading() if scatter_now else contextlib.nullcontext():
                self._accept(chunks, slot_mapping)
        except BaseException:
            self._release_held()
            raise
        self._busy = time.perf_counter() - started

    def _accept(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> None:
        engine, paged_io = self.engine, self.paged_io
        self.end = chunks[0].start if chunks else 0
        end = chunks[-1].end if chunks else 0
        slots = CacheEngine._slots(slot_mapping, end)
        self._slots = paged_io.device_slots(slots[:end])  # checked and moved once, for every copy
        objs = engine.checked.get_many([chunk.key for chunk in chunks])
        usable = True
        for chunk, obj in zip(chunks, objs, strict=True):
            if obj is None:
                usable = False
            elif not usable:
                obj.ref_down()  # after a gap: not loadable, the engine needs a prefix
            elif not engine.checked.accept(
                chunk.key, obj, paged_io.chunk_shape(chunk.num_tokens), paged_io.dtype
            ):
                obj.ref_down()
                usable = False
            else:
                self._held.append((chunk, obj))
                self.end = chunk.end
                if self._scattered:
                    paged_io.to_engine(obj.tensor, self._slots[chunk.start : chunk.end])

    @property
    def num_chunks(self) -> int:
        return len(self._held)

    def scatter(self, layer: int | None = None) -> None:
        """Write one layer (or every layer) of the held chunks into the engine."""
        if self._scattered:
            return
        started = time.perf_counter()
        with self.paged_io.loading():
            for chunk, obj in self._held:
                chunk_slots = self._slots[chunk.start : chunk.end]
                part, layers = _layer_part(obj, layer)
                self.paged_io.to_engine(part, chunk_slots, layers)
        self._busy += time.perf_counter() - started

    def _release_held(self) -> None:
        self.paged_io.loads_done()  # no scatter may still read a released buffer
        for _, obj in self._held:
            obj.ref_down()
        self._held = None

    def close(self) -> None:
        """Release the held chunks and count the load (idempotent)."""
        if self._held is None:
            return
        loaded = sum(obj.data_nbytes for _, obj in self._held)
        hit_tokens = sum(chunk.num_tokens for chunk, _ in self._held)
        self._release_held()
        s = self.engine.stats
        s.inc(Counter.RETRIEVE_REQUESTS)
        s.inc(Counter.HIT_TOKENS, hit_tokens)
        s.inc(Counter.LOADED_BYTES, loaded)
        s.inc(Counter.LOAD_SECONDS, self._busy)
        s.observe(Histogram.LOAD, self._busy)
