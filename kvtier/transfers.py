"""Stores and loads in flight: a prompt's chunks between the engine's pages and the tiers.

``CacheEngine`` opens one per ``store`` / ``retrieve`` (and the vLLM worker one per
request and step, filled layer by layer)::

    StoreTransfer     stage a pool buffer per chunk not yet stored ─▶ gather ─▶ commit
                      (publish to the tiers) or abort
    RetrieveTransfer  fetch + accept the longest held run ─▶ scatter ─▶ close (release)

With ``gather_now`` / ``scatter_now`` each chunk's copy is queued as soon as its buffer is
staged (fetched): given a ``PromptChunks``, the first chunk's copy is queued after hashing
that chunk alone, and the rest are hashed, checked and staged while it runs. A store's
"already stored?" check is answered from memory (``StorageManager.stored``: the CPU tier,
or without one the index of a local disk that is the only tier; no disk or network
access), so checking chunk by chunk costs no round trip; a load fetches a first chunk
that the CPU tier holds on its own and every other chunk in one ``get_many`` (one batched
call per lower tier).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.chunker import Chunk, PromptChunks
from kvtier.memory import MemoryObj
from kvtier.observability.stats import Counter, Histogram
from kvtier.paged_io import PagedIO
from kvtier.storage.checked import CheckedChunks


@dataclass(slots=True)
class StoreResult:
    """What one ``store`` call did."""

    stored_chunks: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    skipped_existing: int = 0
    skipped_no_memory: int = 0
    seconds: float = 0.0


def _checked_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``slot_mapping`` as int64, checked to hold one slot per token of ``num_tokens``."""
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping has shape {tuple(slot_mapping.shape)}; expected one slot per "
            f"token, at least ({num_tokens},)"
        )
    return slot_mapping.to(torch.int64)


def _layer_part(obj: MemoryObj, layer: int | None) -> tuple[torch.Tensor, range | None]:
    """The chunk buffer's view of ``layer`` and the engine layers it holds (None: all)."""
    if layer is None:
        return obj.tensor, None
    return obj.tensor[:, layer : layer + 1], range(layer, layer + 1)


def _end_of(chunks: Sequence[Chunk]) -> int:
    """Where the last of ``chunks`` ends (0: none), without hashing ``PromptChunks``."""
    if isinstance(chunks, PromptChunks):
        return chunks.end
    return chunks[-1].end if chunks else 0


class StoreTransfer:
    """A store in flight: staged buffers for the chunks not yet stored. A chunk that no
    tier of this rank keeps, as a replica peer writes it (``StorageManager.skip_for_replica``),
    is neither staged nor copied out of the engine.

    ``gather_now``: gather each chunk as soon as it is staged (``gather`` is then a no-op).

    NOTE: every staged buffer and every already-stored chunk of the request stays pinned
    until ``commit``/``abort``, so a prompt larger than the tier cannot evict its own
    prefix while it is being stored.
    """

    def __init__(
        self,
        checked: CheckedChunks,
        paged_io: PagedIO,
        chunks: Sequence[Chunk],
        slot_mapping: torch.Tensor,
        gather_now: bool = False,
    ):
        self.checked = checked
        self.paged_io = paged_io
        self.result = StoreResult()
        self._busy = 0.0
        self._gathered = gather_now
        self._staged: list[tuple[Chunk, MemoryObj, torch.Tensor]] = []
        self._pinned_existing: list[MemoryObj] = []
        started = time.perf_counter()
        try:
            with paged_io.storing() if gather_now else contextlib.nullcontext():
                self._stage(chunks, slot_mapping)
        except BaseException:
            self.abort()  # nothing staged stays pinned
            raise
        self._busy += time.perf_counter() - started

    def _stage(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> None:
        storage, paged_io = self.checked.storage, self.paged_io
        end = _end_of(chunks)
        slots = _checked_slots(slot_mapping, end)
        placed = paged_io.device_slots(slots[:end])  # checked and moved once, for every copy
        for chunk in chunks:
            if storage.stored(chunk.key):
                self.result.skipped_existing += 1
                self._pinned_existing += storage.pin([chunk.key])
                continue
            if storage.skip_for_replica(chunk.key):  # counted per tier, never copied out
                continue
            if bool((slots[chunk.start : chunk.end] < 0).any()):
                break
            chunk_slots = placed[chunk.start : chunk.end]
            obj = storage.allocate(paged_io.chunk_shape(chunk.num_tokens), paged_io.dtype)
            if obj is None:
                self.result.skipped_no_memory = sum(
                    1 for c in chunks if c.index >= chunk.index and not storage.stored(c.key)
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
        result = self.result
        try:
            self.paged_io.stores_done()  # the gathers have landed: read, publish, release
            for chunk, obj, _ in self._staged:
                if self.checked.put(chunk.key, obj):
                    result.stored_chunks += 1
                    result.stored_tokens += chunk.num_tokens
                    result.stored_bytes += obj.data_nbytes
                elif self.checked.storage.contains(chunk.key):
                    result.skipped_existing += 1  # another store put it there since staging
        finally:
            self._release()
        result.seconds = self._busy + time.perf_counter() - started
        s = self.checked.storage.stats
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
        self.checked.storage.unpin(self._pinned_existing)
        self._pinned_existing = []


class RetrieveTransfer:
    """A load in flight: the verified chunk objects of the longest available run.

    ``end`` is the token position the run reaches (``chunks[0].start`` for none). A chunk
    whose shape or dtype (or, with ``verify_checksums``, checksum) disagrees with what was
    asked ends the run: it is rejected (``CheckedChunks.accept``) and never written into
    the engine. A chunk a lower tier returned was verified by that tier as it was read.

    ``scatter_now``: scatter each chunk as soon as it is accepted (``scatter`` is a no-op);
    a run longer than the CPU pool stages at once then comes in rounds, each released once
    written. Without it every chunk is held until ``close``: the caller asks for no more
    than the pool holds (``CacheEngine.max_load_chunks``).
    """

    def __init__(
        self,
        checked: CheckedChunks,
        paged_io: PagedIO,
        chunks: Sequence[Chunk],
        slot_mapping: torch.Tensor,
        scatter_now: bool = False,
    ):
        self.checked = checked
        self.paged_io = paged_io
        self._scattered = scatter_now
        self._held: list[tuple[Chunk, MemoryObj]] = []
        self._released = (0, 0, 0)  # chunks, tokens, bytes of the rounds already released
        started = time.perf_counter()
        try:
            self._accept(chunks, slot_mapping)
        except BaseException:
            self._release_held()
            self._held = None
            raise
        self._busy = time.perf_counter() - started

    def _accept(self, chunks: Sequence[Chunk], slot_mapping: torch.Tensor) -> None:
        paged_io = self.paged_io
        self.end = chunks[0].start if chunks else 0
        end = _end_of(chunks)
        slots = _checked_slots(slot_mapping, end)
        self._slots = paged_io.device_slots(slots[:end])  # checked and moved once, for every copy
        usable = True
        for i, part in enumerate(self._rounds(chunks)):
            if i:
                self._release_held()
            with paged_io.loading() if self._scattered else contextlib.nullcontext():
                for group in self._groups(part):
                    usable = self._take_group(group, usable)
            if not usable:
                return

    def _rounds(self, chunks: Sequence[Chunk]) -> list[Sequence[Chunk]]:
        """The chunks in rounds of what the CPU pool stages at once, with ``scatter_now``
        (each round is written into the engine and released before the next is fetched);
        else, or when they fit, all in one.

        NOTE: a load holds every chunk it fetches in the pool, those the CPU tier holds
        included, so a run longer than the pool holds would leave no room to read the
        lower tiers' part into it: with the pool holding the prompt's later chunks, the
        load would find not even its first chunk.
        """
        if not chunks:
            return [chunks]
        shape = self.paged_io.chunk_shape(chunks[0].num_tokens)
        most = max(self.checked.storage.cpu.fitting(shape, self.paged_io.dtype), 1)
        if not self._scattered or len(chunks) <= most:
            return [chunks]
        return [chunks[start : start + most] for start in range(0, len(chunks), most)]

    def _take_group(self, group: Sequence[Chunk], usable: bool) -> bool:
        """Fetch ``group`` and take its chunks in order; whether the run goes on."""
        objs = self.checked.get_many([chunk.key for chunk in group])
        for i, (chunk, obj) in enumerate(zip(group, objs, strict=True)):
            try:
                usable = self._take(chunk, obj, usable)
            except BaseException:
                for later in objs[i + 1 :]:  # fetched, never looked at
                    if later is not None:
                        later.ref_down()
                raise
        return usable

    def _release_held(self) -> None:
        """Release the held chunks, counted in ``_released``, once no copy may still read
        them (the rounds scattered so far, or the whole run when it closes)."""
        self.paged_io.loads_done()
        chunks, tokens, nbytes = self._released
        self._released = (
            chunks + len(self._held),
            tokens + sum(chunk.num_tokens for chunk, _ in self._held),
            nbytes + sum(obj.data_nbytes for _, obj in self._held),
        )
        held, self._held = self._held, []
        for _, obj in held:
            obj.ref_down()

    def _groups(self, chunks: Sequence[Chunk]) -> list[Sequence[Chunk]]:
        """The chunks in the order they are fetched: a first chunk the CPU tier holds
        alone, so that its copy is queued before the rest are hashed and fetched; the rest
        (or all, when the first is not in memory) in one ``get_many``: one batched call
        per lower tier."""
        if chunks and self.checked.storage.contains(chunks[0].key):
            return [chunks[:1], chunks[1:]]
        return [chunks]

    def _take(self, chunk: Chunk, obj: MemoryObj | None, usable: bool) -> bool:
        """Hold ``obj`` (scattered now with ``scatter_now``) when the run is still
        ``usable`` and it is accepted, else release it; whether the run goes on."""
        if obj is None:
            return False
        paged_io = self.paged_io
        try:
            # after a gap a chunk is not loadable: the engine needs a prefix
            taken = usable and self.checked.accept(
                chunk.key, obj, paged_io.chunk_shape(chunk.num_tokens), paged_io.dtype
            )
        except BaseException:
            obj.ref_down()
            raise
        if not taken:
            obj.ref_down()
            return False
        self._held.append((chunk, obj))  # released with the rest held, whatever happens
        self.end = chunk.end
        if self._scattered:
            paged_io.to_engine(obj.tensor, self._slots[chunk.start : chunk.end])
        return True

    @property
    def num_chunks(self) -> int:
        """Chunks of the run: held, or (in rounds) already written and released."""
        return self._released[0] + len(self._held)

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

    def close(self) -> None:
        """Release the held chunks and count the load (idempotent)."""
        if self._held is None:
            return
        self._release_held()
        self._held = None
        _, hit_tokens, loaded = self._released
        s = self.checked.storage.stats
        s.inc(Counter.RETRIEVE_REQUESTS)
        s.inc(Counter.HIT_TOKENS, hit_tokens)
        s.inc(Counter.LOADED_BYTES, loaded)
        s.inc(Counter.LOAD_SECONDS, self._busy)
        s.observe(Histogram.LOAD, self._busy)
