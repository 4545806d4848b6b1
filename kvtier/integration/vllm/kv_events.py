"""KV events: kvtier's tiers as vLLM ``BlockStored`` / ``BlockRemoved`` events.

With vLLM's ``kv_events_config`` enabled, a KV-aware router learns from one event stream
what vLLM's prefix cache holds (``medium="GPU"``) and, through these, what kvtier holds.
The path of one event::

    worker rank r   CPU / disk tier put/evict/clear ─▶ TierEventLog (kvtier.observability.tier_events)
                    get_kv_connector_kv_cache_events: the step's records as RankTierEvents
    vLLM            KVOutputAggregator concatenates every rank's records into one
                    KVTierKVEvents (KVConnectorOutput.kv_cache_events)
    scheduler       update_connector_output ─▶ KVEventTracker.add: merge the ranks,
                    translate chunk hashes to vLLM block hashes
                    take_events ─▶ vLLM's publisher (ZMQ)

Events name vLLM's block hashes (``Request.block_hashes``, what routers key on and what
vLLM's own prefix-cache events carry), not kvtier's chunk hashes. A chunk's event covers
the vLLM blocks whose last token lies in the chunk::

    tokens    0        32       64       96       128      (block_size 32, chunk_size 64)
    blocks    |   b0   |   b1   |   b2   |   b3   |
    chunks    |       c0        |       c1        |
    c1's BlockStored: block_hashes [b2, b3], parent_block_hash b1, token_ids tokens[64:128]

The worker does not know those hashes; the scheduler snapshots each chunk's event payload
(``record_chunks``) when it plans the chunk's save or sees it in a lookup hit, while the
request is alive, and keeps it in a bounded LRU.

Merging ranks (tensor/pipeline parallel): every rank stores its own shard, and a chunk is
a hit only when every rank holds it. So ``BlockStored`` goes out once the last rank has
recorded the chunk, and ``BlockRemoved`` as soon as the first rank loses it (any later
lookup misses it). Ranks' records may arrive in different steps; the tracker keeps, per
(tier, chunk), the set of ranks holding it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvtier.config import KVTierConfig
from kvtier.integration.vllm import facts
from kvtier.integration.vllm.common import RankContext, SchedulerExtension, WorkerExtension
from kvtier.observability.stats import Counter
from kvtier.observability.tier_events import (
    CLEARED,
    OWNERSHIP,
    PLACEMENTS,
    REMOVED,
    STORED,
    TierEvent,
)
from kvtier.warn import warn_once

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

MAX_PAYLOADS = 8192  # chunks whose event payload the scheduler keeps (LRU)
MAX_EVENTS = 65_536  # events waiting for take_events; more drop the oldest (counted)


class RankTierEvent(KVCacheEvent):
    """One worker rank's ``TierEvent``, as it travels to the scheduler. Never published."""

    rank: int
    kind: str
    tier: str
    chunk_hash: bytes | None = None


def rank_events(rank: int, records: Sequence[TierEvent]) -> KVTierKVEvents | None:
    """The step's records of worker ``rank`` for ``KVConnectorOutput`` (None: none)."""
    if not records:
        return None
    return KVTierKVEvents([RankTierEvent(rank, r.kind, r.tier, r.chunk_hash) for r in records])


class KVTierKVEvents(KVConnectorKVEvents):
    """The ``RankTierEvent`` records of one engine step, from one or more ranks.

    vLLM's ``KVOutputAggregator`` appends every rank's records to the first rank's object
    (``add_events`` + ``increment_workers``). Nothing is dropped here: merging needs
    state across steps (a rank may record a chunk a step after another), so the
    scheduler's ``KVEventTracker`` does it.
    """

    def __init__(self, records: list[KVCacheEvent] | None = None, num_workers: int = 1):
        self._records: list[KVCacheEvent] = list(records or [])
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._records.extend(events)

    def aggregate(self) -> KVTierKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._records)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._records.clear()
        self._num_workers = 1

    def __repr__(self) -> str:
        return f"<KVTierKVEvents {len(self._records)} records from {self._num_workers} ranks>"


@dataclass(slots=True)
class _Payload:
    """What a chunk's ``BlockStored`` says besides its placement (see the module
    docstring); empty ``block_hashes``: no vLLM block ends in the chunk. Its lists go
    into events as they are and are never changed."""

    # vLLM's ExternalBlockHash: bytes (int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list | None
    session_id: str | None


class KVEventTracker:
    """Scheduler side: snapshots payloads, merges ranks, queues vLLM events.

    Args:
        world_size: worker ranks (tp * pp); a chunk is announced once all of them hold it.
        chunk_size: kvtier's chunk size.
        block_size: vLLM's block size (the granularity of ``Request.block_hashes``).
        max_payloads: chunk payloads kept (LRU); a chunk whose payload is gone when every
            rank holds it is not announced (counted: ``kv_events_unannounced_chunks``).
        max_events: events kept until ``take``; more drop the oldest (counted:
            ``kv_events_dropped``).
    """

    def __init__(
        self,
        world_size: int,
        chunk_size: int,
        block_size: int,
        *,
        max_payloads: int = MAX_PAYLOADS,
        max_events: int = MAX_EVENTS,
    ):
        if world_size < 1 or chunk_size < 1 or block_size < 1:
            raise ValueError(
                f"KVEventTracker needs world_size, chunk_size and block_size >= 1; got "
                f"{world_size}, {chunk_size}, {block_size}"
            )
        self.world_size = world_size
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.max_payloads = max_payloads
        self.max_events = max_events
        self._all_ranks = (1 << world_size) - 1
        self._payloads: OrderedDict[bytes, _Payload] = OrderedDict()
        # (tier, chunk hash) -> bit mask of the ranks holding it
        self._held: dict[tuple[str, bytes], int] = {}
        # (tier, chunk hash) -> the block hashes its BlockStored announced
        self._announced: dict[tuple[str, bytes], list[Any]] = {}
        self._events: deque[KVCacheEvent] = deque()
        self.counters = dict.fromkeys(
            (
                Counter.KV_EVENTS_BLOCKS_STORED,
                Counter.KV_EVENTS_BLOCKS_REMOVED,
                Counter.KV_EVENTS_UNANNOUNCED,
                Counter.KV_EVENTS_DROPPED,
            ),
            0,
        )

    # -- payloads (called from the scheduler's planning) ------------------------------

    def record_chunks(self, request: Any, first_chunk: int, hashes: list[bytes], end: int) -> None:
        """Snapshot the payloads of chunks ``first_chunk, ...`` of ``request`` (their
        tokens end at ``end``); chunks already known are only touched."""
        cs = self.chunk_size
        for i, chunk_hash in enumerate(hashes):
            if chunk_hash in self._payloads:
                self._payloads.move_to_end(chunk_hash)
                continue
            start = (first_chunk + i) * cs
            try:
                payload = self._payload(request, start, min(start + cs, end))
            except Exception as exc:  # NOTE: an event must never fail a request
                warn_once(logger, f"kvtier KV events: no payload for a chunk ({exc!r})")
                continue
            if payload is None:
                continue
            self._payloads[chunk_hash] = payload
            if len(self._payloads) > self.max_payloads:
                self._payloads.popitem(last=False)

    def _payload(self, request: Any, start: int, end: int) -> _Payload | None:
        """The payload of the chunk of tokens ``[start, end)``: the blocks ending in it.
        None when vLLM has not hashed those blocks."""
        bs = self.block_size
        first, last = start // bs, end // bs
        block_hashes = request.block_hashes
        if len(block_hashes) < last:
            return None
        if last <= first:
            return _Payload([], None, [], None, None, None, None)
        extra_keys, mm_index = [], 0
        for block in range(first, last):
            keys, mm_index = generate_block_hash_extra_keys(
                request, block * bs, (block + 1) * bs, mm_index
            )
            extra_keys.append(keys)
        lora = request.lora_request
        return _Payload(
            block_hashes=[maybe_convert_block_hash(h) for h in block_hashes[first:last]],
            parent_block_hash=(
                maybe_convert_block_hash(block_hashes[first - 1]) if first > 0 else None
            ),
            token_ids=list(request.all_token_ids[first * bs : last * bs]),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra_keys),
            session_id=getattr(request, "session_id", None),
        )

    # -- records from the workers -----------------------------------------------------

    def add(self, records: Iterable[KVCacheEvent]) -> None:
        """Merge one step's ``RankTierEvent`` records of the workers (each rank's in its
        order, rank after rank) and queue the events they complete.

        A rank that emptied a tier in the step (``CLEARED``) lost whatever it recorded
        there before, so every rank's last clear of a tier applies first, then what each
        rank recorded after it. Taken rank after rank instead, rank 0's stores after a
        reset would announce chunks that rank 1, whose clear comes later in the list, no
        longer holds, and withdraw them again.
        """
        valid = []
        for record in records:
            if not isinstance(record, RankTierEvent) or record.tier not in PLACEMENTS:
                continue
            if not 0 <= record.rank < self.world_size:
                warn_once(logger, f"kvtier KV events: rank {record.rank} of {self.world_size}?")
                continue
            valid.append(record)
        last_clear = {(r.rank, r.tier): i for i, r in enumerate(valid) if r.kind == CLEARED}
        for rank, tier in last_clear:
            self._clear(tier, 1 << rank)
        for i, record in enumerate(valid):
            if i <= last_clear.get((record.rank, record.tier), -1):
                continue
            bit = 1 << record.rank
            key = (record.tier, record.chunk_hash)
            if record.kind == STORED:
                held = self._held[key] = self._held.get(key, 0) | bit
                if held == self._all_ranks and key not in self._announced:
                    self._announce(key)
            elif record.kind == REMOVED:
                held = self._held.pop(key, 0) & ~bit
                if held:
                    self._held[key] = held
                self._withdraw(record.tier, self._announced.pop(key, None))

    def _announce(self, key: tuple[str, bytes]) -> None:
        tier, chunk_hash = key
        payload = self._payloads.get(chunk_hash)
        if payload is None:
            self.counters[Counter.KV_EVENTS_UNANNOUNCED] += 1
            return
        self._payloads.move_to_end(chunk_hash)
        self._announced[key] = payload.block_hashes
        if not payload.block_hashes:
            return
        placement = PLACEMENTS[tier]
        self._emit(
            BlockStored(
                block_hashes=payload.block_hashes,
                parent_block_hash=payload.parent_block_hash,
                token_ids=payload.token_ids,
                block_size=self.block_size,
                lora_id=payload.lora_id,
                medium=placement.medium,
                lora_name=payload.lora_name,
                extra_keys=payload.extra_keys,
                group_idx=0,
                locality=placement.locality,
                ownership=OWNERSHIP,
                session_id=payload.session_id,
            )
        )
        self.counters[Counter.KV_EVENTS_BLOCKS_STORED] += len(payload.block_hashes)

    def _withdraw(self, tier: str, block_hashes: list[Any] | None) -> None:
        if not block_hashes:
            return
        placement = PLACEMENTS[tier]
        self._emit(
            BlockRemoved(
                block_hashes=block_hashes,
                medium=placement.medium,
                group_idx=0,
                locality=placement.locality,
                ownership=OWNERSHIP,
            )
        )
        self.counters[Counter.KV_EVENTS_BLOCKS_REMOVED] += len(block_hashes)

    def _clear(self, tier: str, bit: int) -> None:
        """One rank emptied ``tier``: whatever was announced there is withdrawn, in one
        event."""
        withdrawn: list[Any] = []
        for key in [key for key in self._held if key[0] == tier]:
            held = self._held.pop(key) & ~bit
            if held:
                self._held[key] = held
            withdrawn.extend(self._announced.pop(key, None) or ())
        self._withdraw(tier, withdrawn)

    def _emit(self, event: KVCacheEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.counters[Counter.KV_EVENTS_DROPPED] += 1
        self._events.append(event)

    # -- to vLLM's publisher ----------------------------------------------------------

    def take(self) -> list[KVCacheEvent]:
        """The queued events, oldest first; the queue is empty after."""
        events = list(self._events)
        self._events.clear()
        return events


class KVEventScheduling(SchedulerExtension):
    """The scheduler's hooks, passed to a ``KVEventTracker``."""

    name = "kv_events"

    def __init__(self, tracker: KVEventTracker):
        self.tracker = tracker

    def on_chunks(self, request: Any, first_chunk: int, hashes: list[bytes], end: int) -> None:
        self.tracker.record_chunks(request, first_chunk, hashes, end)

    def add_worker_events(self, events: Any) -> None:
        if isinstance(events, KVTierKVEvents):
            self.tracker.add(events.get_all_events())

    def take_events(self) -> list[KVCacheEvent]:
        return self.tracker.take()

    def counters(self) -> dict[str, float]:
        return dict(self.tracker.counters)


class KVEventWorking(WorkerExtension):
    """A rank's hooks: its tiers' records of each step, for ``KVConnectorOutput``."""

    name = "kv_events"

    def __init__(self) -> None:
        self.rank: RankContext | None = None

    def attach(self, rank: RankContext) -> None:
        self.rank = rank

    def take_events(self) -> KVTierKVEvents | None:
        if self.rank is None:
            return None
        return rank_events(self.rank.engine.metadata.worker_rank, self.rank.take_tier_events())


def scheduler_extension(
    config: KVTierConfig, vllm_config: VllmConfig, client: Any
) -> KVEventScheduling:
    tracker = KVEventTracker(
        facts.world_size(vllm_config), config.chunk_size, vllm_config.cache_config.block_size
    )
    return KVEventScheduling(tracker)


def worker_extension(config: KVTierConfig, vllm_config: VllmConfig) -> KVEventWorking:
    return KVEventWorking()
