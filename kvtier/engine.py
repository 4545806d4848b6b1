"""The cache engine: store, retrieve and look up a prompt's KV by chunks.

``CacheEngine`` ties the token database (tokens → chunk keys), the storage manager
(tiers) and the paged-KV connector (engine pages ↔ chunk buffers) together. It is
engine-agnostic: the vLLM integration calls it with token ids and slot mappings.

    tokens        |<-- chunk 0 -->|<-- chunk 1 -->|<-- chunk 2 -->|
    slot_mapping   s0 s1 ...       (one engine slot per token; < 0 = not in the cache)
    store          gather slots → chunk buffer → tiers (keyed by the chained hash)
    retrieve       tiers → chunk buffer → scatter into slots, stopping at the first miss
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.config import KVTierConfig
from kvtier.gpu_connector import PagedKVConnector
from kvtier.hashing import ChunkHasher, TokenIds
from kvtier.keys import CacheKey
from kvtier.memory import MemoryObj
from kvtier.metrics import Counter, Stats
from kvtier.storage.manager import StorageManager
from kvtier.token_db import Chunk, ChunkedTokenDatabase, RequestExtras
from kvtier_kernels import PagedKV

logger = logging.getLogger(__name__)

Mask = torch.Tensor | np.ndarray | Sequence[bool] | None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the form used in keys)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class EngineMetadata:
    """Who produced the KV: separates caches of different models and shards."""

    model_name: str
    world_size: int = 1
    rank: int = 0
    kv_dtype: str | None = None  # None: taken from the KV cache when it is bound


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
    """

    def __init__(
        self,
        config: KVTierConfig,
        metadata: EngineMetadata,
        paged: PagedKV | None = None,
        *,
        stats: Stats | None = None,
        pin_memory: bool | None = None,
    ):
        self.config = config
        self.metadata = metadata
        self.stats = stats or Stats()
        self.storage = StorageManager(config, self.stats, pin_memory=pin_memory)
        self.hasher = ChunkHasher(config.hash_algorithm, config.hash_seed)
        self.connector: PagedKVConnector | None = None
        self.token_db: ChunkedTokenDatabase | None = None
        if metadata.kv_dtype is not None:
            self._make_token_db(metadata.kv_dtype)
        if paged is not None:
            self.bind(paged)

    def _make_token_db(self, kv_dtype: str) -> None:
        m = self.metadata
        template = CacheKey(
            self.config.model_name or m.model_name, m.world_size, m.rank, kv_dtype, b""
        )
        self.token_db = ChunkedTokenDatabase(self.config.chunk_size, self.hasher, template)

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
        self.connector = PagedKVConnector(paged, self.config.kernel_backend)
        if self.token_db is None:
            self._make_token_db(kv_dtype)

    def _require_token_db(self) -> ChunkedTokenDatabase:
        if self.token_db is None:
            raise RuntimeError(
                "CacheEngine does not know the KV dtype: give metadata.kv_dtype or bind(paged)"
            )
        return self.token_db

    def _require_bound(self) -> tuple[PagedKVConnector, ChunkedTokenDatabase]:
        if self.connector is None:
            raise RuntimeError("CacheEngine has no KV cache bound: call bind(paged) first")
        return self.connector, self._require_token_db()

    @staticmethod
    def _slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
            raise ValueError(
                f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected one slot per "
                f"token, at least ({num_tokens},)"
            )
        return slot_mapping.to(torch.int64)

    def _chunks(self, tokens: TokenIds, mask: Mask, extras: RequestExtras | None) -> list[Chunk]:
        return self._require_token_db().chunks(
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
        connector, _ = self._require_bound()
        result = StoreResult()
        start_time = time.perf_counter()
        chunks = self._chunks(tokens, mask, extras)
        slots = self._slots(slot_mapping, chunks[-1].end if chunks else 0)
        held: list[MemoryObj] = []
        pinned_existing: list[CacheKey] = []
        try:
            for chunk in chunks:
                if self.storage.contains(chunk.key):
                    result.skipped_existing += 1
                    pinned_existing += self.storage.pin([chunk.key])
                    continue
                chunk_slots = slots[chunk.start : chunk.end]
                if bool((chunk_slots < 0).any()):
                    break
                obj = self.storage.allocate(
                    connector.chunk_shape(chunk.num_tokens), connector.dtype
                )
                if obj is None:
                    result.skipped_no_memory = sum(
                        1
                        for c in chunks
                        if c.index >= chunk.index and not self.storage.contains(c.key)
                    )
                    break
                # NOTE: chunks of this request (new and already stored) stay pinned until
                # the call ends, so a prompt larger than the tier cannot evict its own
                # prefix while being stored.
                obj.pin()
                held.append(obj)
                connector.from_engine(obj.tensor, chunk_slots)
                if self.storage.put(chunk.key, obj):
                    result.stored_chunks += 1
                    result.stored_tokens += chunk.num_tokens
                    result.stored_bytes += obj.data_nbytes
        finally:
            for obj in held:
                obj.unpin()
                obj.ref_down()
            self.storage.unpin(pinned_existing)
        result.seconds = time.perf_counter() - start_time
        s = self.stats
        s.inc(Counter.STORE_REQUESTS)
        s.inc(Counter.STORED_CHUNKS, result.stored_chunks)
        s.inc(Counter.STORED_TOKENS, result.stored_tokens)
        s.inc(Counter.STORED_BYTES, result.stored_bytes)
        s.inc(Counter.STORE_SECONDS, result.seconds)
        s.inc(Counter.STORE_SKIPPED_EXISTING, result.skipped_existing)
        s.inc(Counter.STORE_SKIPPED_NO_MEMORY, result.skipped_no_memory)
        return result

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
        connector, token_db = self._require_bound()
        start_time = time.perf_counter()
        chunks = self._chunks(tokens, mask, extras)
        skipped = token_db.masked_prefix(mask, len(tokens))
        filled = skipped
        slots = self._slots(slot_mapping, chunks[-1].end if chunks else 0)
        loaded_bytes = 0
        for chunk in chunks:
            obj = self.storage.get(chunk.key)
            if obj is None:
                break
            try:
                expected = connector.chunk_shape(chunk.num_tokens)
                if tuple(obj.shape) != expected or obj.dtype != connector.dtype:
                    logger.warning(
                        "stored chunk %s has shape %s %s, expected %s %s: treated as a miss",
                        chunk.key,
                        tuple(obj.shape),
                        obj.dtype,
                        expected,
                        connector.dtype,
                    )
                    break
                connector.to_engine(obj.tensor, slots[chunk.start : chunk.end])
                loaded_bytes += obj.data_nbytes
            finally:
                obj.ref_down()
            filled = chunk.end
        seconds = time.perf_counter() - start_time
        s = self.stats
        s.inc(Counter.RETRIEVE_REQUESTS)
        s.inc(Counter.REQUESTED_TOKENS, len(tokens) - skipped)
        s.inc(Counter.HIT_TOKENS, filled - skipped)
        s.inc(Counter.LOADED_BYTES, loaded_bytes)
        s.inc(Counter.LOAD_SECONDS, seconds)
        return filled

    # -- lookup ----------------------------------------------------------------------

    def lookup(self, tokens: TokenIds, extras: RequestExtras | None = None) -> int:
        """How many leading tokens of ``tokens`` some tier holds (chunk-aligned, plus a
        stored partial last chunk when ``save_unfull_chunk``)."""
        chunks = self._chunks(tokens, None, extras)
        hits = self.storage.lookup_prefix([c.key for c in chunks])
        self.stats.inc(Counter.LOOKUP_REQUESTS)
        self.stats.inc(Counter.LOOKUP_TOKENS, len(tokens))
        hit_tokens = chunks[hits - 1].end if hits else 0
        self.stats.inc(Counter.LOOKUP_HIT_TOKENS, hit_tokens)
        return hit_tokens

    def close(self) -> None:
        """Release every stored chunk and the memory pool."""
        self.storage.close()
