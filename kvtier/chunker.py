"""Tokens → chunks → chained chunk hashes → keys.

A prompt of N tokens is cut into ``chunk_size`` chunks; chunk ``i`` covers tokens
``[i * chunk_size, min((i + 1) * chunk_size, N))``::

    tokens  |<---- chunk 0 ---->|<---- chunk 1 ---->|<- partial ->|
    hash         h_0 = H(root)      h_1 = H(h_0)       h_2 = H(h_1)
    mask    |F F F F F F F F F F|T T T T T T T T T T|T T T T T T T|
             already cached:        processed

A partial last chunk is produced only when asked (``save_unfull_chunk`` for stores).
A store mask marks an already-cached prefix (False) that is skipped; it must cover whole
chunks, since a chunk is the unit of storage. Hashes always chain from the first token,
whatever is skipped.

Extra keys follow vLLM's ``generate_block_hash_extra_keys`` exactly (LoRA, multimodal
items overlapping the chunk, the cache salt on the first chunk, the digest of the chunk's
prompt embeddings), so with
``chunk_size == block_size`` and ``sha256_cbor`` a chunk hash equals vLLM's block hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.hashing import ChunkHasher, ExtraKeys, TokenIds, token_array
from kvtier.keys import CacheKey


@dataclass(frozen=True, slots=True)
class MultiModalSpan:
    """A multimodal item's placeholder tokens: ``[offset, offset + length)``."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True, eq=False)
class PromptEmbeds:
    """A request's prompt embeddings, one row per token position (vLLM's
    ``Request.prompt_embeds``): its token ids are placeholders, so its KV is named by
    these. Equal only to itself (the tensor is not compared)."""

    tensor: torch.Tensor

    def digest(self, start: int, end: int) -> bytes:
        """SHA-256 of the raw bytes of rows ``[start, end)`` (vLLM's per-block
        ``hashlib.sha256(tensor_data(...))``; rows past the prompt: none)."""
        rows = self.tensor[start:end].flatten().cpu().contiguous()
        return hashlib.sha256(rows.view(torch.uint8).numpy().data).digest()


@dataclass(frozen=True, slots=True)
class RequestExtras:
    """What, besides the tokens, must separate one request's cache from another's.

    Attributes:
        lora_name / lora_path: the LoRA adapter, if any (both go into the hash).
        mm: multimodal items, sorted by offset.
        cache_salt: a tenant's salt; it enters the first chunk's hash and, through the
            chain, every later one.
        prompt_embeds: the prompt's embeddings when it was given as embeddings; each
            chunk's hash covers the digest of its rows.
    """

    lora_name: str | None = None
    lora_path: str | None = None
    mm: tuple[MultiModalSpan, ...] = ()
    cache_salt: str | None = None
    prompt_embeds: PromptEmbeds | None = None

    def chunk_extra_keys(self, start: int, end: int) -> ExtraKeys:
        """The extra keys of the chunk ``[start, end)``, tagged as vLLM tags them."""
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path))
        for item in self.mm:
            if item.offset >= end:
                break
            if start < item.offset + item.length:
                keys.append(("mm", item.identifier, item.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        if self.prompt_embeds is not None:
            keys.append(("prompt_embeds", self.prompt_embeds.digest(start, end)))
        return tuple(keys) if keys else None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a prompt: tokens ``[start, end)`` and the key it is stored under."""

    index: int
    start: int
    end: int
    key: CacheKey

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class HashChain:
    """The chained hashes of one token sequence's chunks, extended as its tokens become
    known: each chunk is hashed once however often the sequence is asked for.

    The sequence only grows (vLLM's ``Request.all_token_ids``): a call converts and hashes
    only the tokens of chunks it has not hashed yet, and a partial last chunk is hashed
    again only when the sequence's length has changed.

    Args:
        hasher: the chained hash (algorithm + seed).
        chunk_size: tokens per chunk.
        extras: LoRA / multimodal / cache-salt keys of the sequence.
    """

    def __init__(self, hasher: ChunkHasher, chunk_size: int, extras: RequestExtras | None = None):
        self.hasher = hasher
        self.chunk_size = chunk_size
        self.extras = extras
        self.full: list[bytes] = []
        self._partial: tuple[int, bytes] | None = None  # (num_tokens, its partial chunk's hash)

    def _chain(self, tokens: Sequence[int] | np.ndarray, bounds: list[tuple[int, int]], parent):
        """Hashes of the chunks ``bounds`` of ``tokens``, chained on ``parent``."""
        if not bounds:
            return []
        first, last = bounds[0][0], bounds[-1][1]
        extras = None
        if self.extras is not None:
            extras = [self.extras.chunk_extra_keys(s, e) for s, e in bounds]
        local = [(s - first, e - first) for s, e in bounds]
        return self.hasher.chain_array(tokens[first:last], local, extras, parent)

    def upto(self, tokens: TokenIds, num_tokens: int, *, partial: bool) -> list[bytes]:
        """Hashes of the chunks of ``tokens[:num_tokens]``: every full chunk, plus the
        partial last one when ``partial``."""
        cs = self.chunk_size
        done = len(self.full)
        if num_tokens // cs > done:
            bounds = [(i * cs, (i + 1) * cs) for i in range(done, num_tokens // cs)]
            self.full += self._chain(tokens, bounds, self.full[-1] if self.full else None)
        hashes = self.full[: num_tokens // cs]
        if partial and num_tokens % cs:
            if self._partial is None or self._partial[0] != num_tokens:
                bounds = [(num_tokens // cs * cs, num_tokens)]
                tail = self._chain(tokens, bounds, hashes[-1] if hashes else None)
                self._partial = (num_tokens, tail[0])
            hashes = [*hashes, self._partial[1]]
        return hashes


class Chunker:
    """Cuts token sequences into chunks and names each chunk with a storage key.

    Args:
        chunk_size: tokens per chunk.
        hasher: the chained hash (algorithm + seed).
        key_template: a key whose model/world/rank/dtype/tags every chunk key shares
            (its ``chunk_hash`` is replaced per chunk).
    """

    def __init__(self, chunk_size: int, hasher: ChunkHasher, key_template: CacheKey):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.hasher = hasher
        self.key_template = key_template

    def key(self, chunk_hash: bytes) -> CacheKey:
        """The storage key of the chunk whose chained hash is ``chunk_hash``."""
        t = self.key_template
        return CacheKey(t.model_name, t.world_size, t.rank, t.kv_dtype, chunk_hash, None, t.tags)

    def chunks_from_hashes(
        self, first_index: int, hashes: Sequence[bytes], num_tokens: int
    ) -> list[Chunk]:
        """Chunks ``first_index, first_index + 1, ...`` named by hashes computed elsewhere
        (e.g. by vLLM's scheduler process, which holds the tokens).

        Chunk ``i`` covers ``[i * chunk_size, min((i + 1) * chunk_size, num_tokens))``.

        Raises:
            ValueError: the hashes do not fit in ``num_tokens`` tokens (a chunk would be
                empty or the last one would extend past ``num_tokens``).
        """
        cs = self.chunk_size
        last = first_index + len(hashes)
        if first_index < 0 or (hashes and not (last - 1) * cs < num_tokens <= last * cs):
            raise ValueError(
                f"{len(hashes)} chunk hashes from chunk {first_index} do not cover "
                f"{num_tokens} tokens with chunk_size={cs}"
            )
        return [
            Chunk(i, i * cs, min((i + 1) * cs, num_tokens), self.key(h))
            for i, h in enumerate(hashes, start=first_index)
        ]

    def chunk_bounds(self, num_tokens: int, include_partial: bool) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk of a ``num_tokens`` prompt."""
        cs = self.chunk_size
        full = num_tokens // cs
        bounds = [(i * cs, (i + 1) * cs) for i in range(full)]
        if include_partial and num_tokens % cs:
            bounds.append((full * cs, num_tokens))
        return bounds

    def chunk_hashes(
        self,
        tokens: TokenIds,
        extras: RequestExtras | None = None,
        *,
        include_partial: bool = False,
    ) -> list[bytes]:
        """The chained hash of every (full, plus optionally the partial) chunk."""
        array = token_array(tokens)
        chain = HashChain(self.hasher, self.chunk_size, extras)
        return chain.upto(array, len(array), partial=include_partial)

    def chunks(
        self,
        tokens: TokenIds,
        mask: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
        extras: RequestExtras | None = None,
        *,
        include_partial: bool = False,
    ) -> list[Chunk]:
        """The chunks of ``tokens`` to process, with their keys.

        Args:
            tokens: the prompt's token ids.
            mask: optional booleans, one per token: False for an already-cached prefix
                to skip, True for tokens to process. Must be ``F…F T…T`` with the
                False run a multiple of ``chunk_size``.
            extras: LoRA / multimodal / cache-salt keys of the request.
            include_partial: also return the partial last chunk.

        Raises:
            ValueError: a mask of the wrong length, not of the form ``F…F T…T``, or
                whose skipped prefix is not whole chunks.
        """
        num_tokens = len(tokens)
        skip = self.masked_prefix(mask, num_tokens)
        hashes = self.chunk_hashes(tokens, extras, include_partial=include_partial)
        bounds = self.chunk_bounds(num_tokens, include_partial)
        return [
            Chunk(i, s, e, self.key(h))
            for i, ((s, e), h) in enumerate(zip(bounds, hashes, strict=True))
            if s >= skip
        ]

    def prompt_chunks(
        self,
        tokens: TokenIds,
        mask: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
        extras: RequestExtras | None = None,
        *,
        include_partial: bool = False,
    ) -> PromptChunks:
        """``chunks`` hashed as they are asked for (:class:`PromptChunks`); the same
        arguments, checks and chunks."""
        return PromptChunks(self, tokens, mask, extras, include_partial)

    def masked_prefix(self, mask, num_tokens: int) -> int:
        """Length of the mask's False prefix (0 without a mask), validated."""
        if mask is None:
            return 0
        m = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        m = m.astype(bool, copy=False)
        if m.shape != (num_tokens,):
            raise ValueError(f"mask has shape {tuple(m.shape)}, expected ({num_tokens},)")
        skip = int(np.argmax(m)) if m.any() else num_tokens
        if not m[skip:].all():
            raise ValueError("mask must be a False prefix followed by True only (F…F T…T)")
        if skip % self.chunk_size and skip != num_tokens:
            raise ValueError(
                f"mask skips {skip} tokens, which is not a multiple of chunk_size="
                f"{self.chunk_size}: a chunk is stored or skipped whole"
            )
        return skip


class PromptChunks(Sequence[Chunk]):
    """The chunks ``Chunker.chunks`` returns for a prompt, each hashed when it (or a later
    one) is first asked for: a store or a load queues the first chunk's copy after hashing
    that chunk alone, and hashes the rest while the copy runs. ``end``, where the last
    chunk ends, is known without hashing anything.

    Raises (at construction): what ``Chunker.chunks`` raises for a bad mask.
    """

    def __init__(
        self,
        chunker: Chunker,
        tokens: TokenIds,
        mask: torch.Tensor | np.ndarray | Sequence[bool] | None,
        extras: RequestExtras | None,
        include_partial: bool,
    ):
        skip = chunker.masked_prefix(mask, len(tokens))
        bounds = chunker.chunk_bounds(len(tokens), include_partial)
        self._bounds = [(i, s, e) for i, (s, e) in enumerate(bounds) if s >= skip]
        self._tokens = token_array(tokens)
        self._chain = HashChain(chunker.hasher, chunker.chunk_size, extras)
        self._chunker = chunker
        self._chunks: list[Chunk] = []

    @property
    def end(self) -> int:
        return self._bounds[-1][2] if self._bounds else 0

    def __len__(self) -> int:
        return len(self._bounds)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and the IndexError
        while len(self._chunks) <= i:
            index, start, end = self._bounds[len(self._chunks)]
            hashes = self._chain.upto(self._tokens, end, partial=True)
            self._chunks.append(Chunk(index, start, end, self._chunker.key(hashes[-1])))
        return self._chunks[i]

    def __iter__(self) -> Iterator[Chunk]:
        return (self[i] for i in range(len(self)))
