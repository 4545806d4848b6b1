"""KV events checked against scripted workloads.

Core (no vLLM): the tiers' event log and what the CPU tier and the cache engine record.
vLLM side (vLLM's own classes, no engine): the scheduler's tracker turns the workers'
records into ``BlockStored`` / ``BlockRemoved`` events that carry vLLM's block hashes,
field for field what vLLM's prefix cache emits for the same blocks; ranks are merged
through vLLM's ``KVOutputAggregator``; buffers are bounded.

    tokens   0   4   8   12  16  20  24      (BLOCK 4, CHUNK 8, a 24-token prompt)
    blocks   |b0 |b1 |b2 |b3 |b4 |b5 |
    chunks   |  c0   |  c1   |  c2   |       c1 -> BlockStored([b2, b3], parent b1)
"""

from __future__ import annotations

import copy
import pickle
import random
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.kv import fill_random_
from test_vllm_scheduler_side import new_step
from test_vllm_worker_side import run_step

from kvtier.config import load_config
from kvtier.engine import CacheEngine, EngineMetadata
from kvtier.integration.vllm.scheduler import SchedulerSide
from kvtier.integration.vllm.worker import WorkerSide
from kvtier.keys import CacheKey
from kvtier.observability.stats import Counter, Stats
from kvtier.observability.tier_events import CLEARED, REMOVED, STORED, TierEvent, TierEventLog
from kvtier.storage.cpu import LocalCPUTier
from kvtier_kernels import PagedKV

BLOCK = 4
CHUNK = 8
LAYERS, HEADS, HEAD = 2, 2, 8
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD * 2  # K and V planes, bf16: 1 KiB
NUM_BLOCKS = 64


def tokens_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


# -- core: the log, the CPU tier, the engine -----------------------------------------


def test_log_keeps_order_and_drops_the_oldest_when_full():
    stats = Stats()
    log = TierEventLog(capacity=3, stats=stats)
    for i in range(5):
        log.stored("cpu", bytes([i]))
    assert log.drain() == [TierEvent(STORED, "cpu", bytes([i])) for i in (2, 3, 4)]
    assert stats.get(Counter.KV_EVENTS_DROPPED) == 2
    assert log.drain() == []
    log.removed("cpu", b"x")
    log.cleared("cpu")
    assert log.drain() == [TierEvent(REMOVED, "cpu", b"x"), TierEvent(CLEARED, "cpu")]
    with pytest.raises(ValueError, match="capacity"):
        TierEventLog(capacity=0)


def cpu_key(i: int, layer: int | None = None) -> CacheKey:
    return CacheKey("m", 1, 0, "float32", bytes([i]) * 4, layer)


def put_new(tier: LocalCPUTier, key: CacheKey) -> bool:
    obj = tier.allocate((256,), torch.float32)  # 1 KiB
    assert obj is not None
    took = tier.put(key, obj)
    obj.ref_down()
    return took


def test_cpu_tier_records_what_it_starts_and_stops_holding():
    log = TierEventLog()
    tier = LocalCPUTier(3 * 1024, "LRU", events=log)  # room for three objects
    assert put_new(tier, cpu_key(1)) and put_new(tier, cpu_key(2))
    assert not put_new(tier, cpu_key(1))  # already held: no record, but touched (LRU)
    assert log.drain() == [TierEvent(STORED, "cpu", cpu_key(i).chunk_hash) for i in (1, 2)]

    assert put_new(tier, cpu_key(3))
    assert put_new(tier, cpu_key(4))  # full: evicts 2, the least recently used
    assert log.drain() == [
        TierEvent(STORED, "cpu", cpu_key(3).chunk_hash),
        TierEvent(REMOVED, "cpu", cpu_key(2).chunk_hash),
        TierEvent(STORED, "cpu", cpu_key(4).chunk_hash),
    ]
    assert tier.remove(cpu_key(1)) and not tier.remove(cpu_key(1))
    assert log.drain() == [TierEvent(REMOVED, "cpu", cpu_key(1).chunk_hash)]

    assert put_new(tier, cpu_key(5, layer=0))  # layer-wise objects are not chunks
    assert log.drain() == []
    tier.clear()
    assert log.drain() == [TierEvent(CLEARED, "cpu")]  # one record, not one per chunk
    tier.close()


def make_paged(seed: int = 0, *, mla: bool = False) -> PagedKV:
    """A random cache; ``mla``: one latent head of the same bytes a token."""
    paged = PagedKV.empty(
        "mla" if mla else "vllm_hnd",
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        num_heads=1 if mla else HEADS,
        head_size=2 * HEADS * HEAD if mla else HEAD,
        dtype=torch.bfloat16,
    )
    gen = torch.Generator().manual_seed(seed)
    for tensor in paged.tensors:
        fill_random_(tensor, gen)
    return paged


class ReadableCheckingLog(TierEventLog):
    """Asserts that a chunk is readable from the tiers when its ``stored`` is recorded."""

    engine: CacheEngine | None = None

    def stored(self, tier: str, chunk_hash: bytes) -> None:
        assert self.engine is not None
        key = self.engine.chunker.key(chunk_hash)
        obj = self.engine.storage.get(key)
        assert obj is not None, "stored was recorded before the chunk became readable"
        obj.ref_down()
        super().stored(tier, chunk_hash)


def test_engine_records_each_new_chunk_once_its_store_committed():
    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.001}, env={})
    log = ReadableCheckingLog()
    engine = CacheEngine(config, EngineMetadata("test-model"), make_paged(), events=log)
    log.engine = engine
    tokens = torch.tensor(tokens_of(40, seed=1))
    hashes = engine.chunker.chunk_hashes(tokens)

    transfer = engine.begin_store(engine.chunker.chunks(tokens), torch.arange(40))
    transfer.gather()
    assert log.drain() == []  # staged and copied, not yet readable: nothing to announce
    assert transfer.commit().stored_chunks == 5
    assert log.drain() == [TierEvent(STORED, "cpu", h) for h in hashes]

    engine.store(tokens, slot_mapping=torch.arange(40))  # all held already
    other = torch.tensor(tokens_of(16, seed=2))
    aborted = engine.begin_store(engine.chunker.chunks(other), torch.arange(16))
    aborted.gather()
    aborted.abort()
    assert log.drain() == []
    engine.close()


def test_engine_without_a_log_records_nothing():
    config = load_config({"chunk_size": CHUNK, "max_local_cpu_size": 0.001}, env={})
    engine = CacheEngine(config, EngineMetadata("test-model"), make_paged())
    assert engine.storage.cpu.events is None
    engine.close()


# -- vLLM side -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ev() -> SimpleNamespace:
    """The vLLM-side pieces, with vLLM's block hasher seeded as its engine seeds it."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.integration.vllm import kv_events as events

    init_none_hash(sha256)

    def request(req_id: str, tokens: list[int], block_size: int = BLOCK, **kwargs: Any):
        return Request(
            req_id,
            list(tokens),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(block_size, sha256),
            **kwargs,
        )

    def vllm_block_event(req, block_size: int = BLOCK):
        """vLLM's own prefix-cache BlockStored for every full block of ``req``."""
        pool = BlockPool(NUM_BLOCKS, True, block_size, enable_kv_cache_events=True)
        n = len(req.all_token_ids) // block_size
        pool.cache_full_blocks(req, pool.get_new_blocks(n), 0, n, block_size, 0)
        (event,) = pool.take_events()
        return event

    def ship(tracker, workers: Sequence[WorkerSide]) -> list:
        """One engine step's records, the way vLLM moves them: each rank's
        ``KVConnectorOutput`` (pickled across processes), ``KVOutputAggregator``, then
        the scheduler connector's ``update_connector_output`` and ``take_events``."""
        outputs = []
        for worker in workers:
            output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            records = events.rank_events(worker.metadata.worker_rank, worker.take_tier_events())
            output.kv_connector_output = KVConnectorOutput(kv_cache_events=records)
            outputs.append(pickle.loads(pickle.dumps(output)))
        merged = KVOutputAggregator(len(workers)).aggregate(outputs).kv_connector_output
        if isinstance(merged.kv_cache_events, events.KVTierKVEvents):
            tracker.add(merged.kv_cache_events.get_all_events())
        return tracker.take()

    return SimpleNamespace(
        events=events,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        request=request,
        vllm_block_event=vllm_block_event,
        ship=ship,
        convert=maybe_convert_block_hash,
    )


def describe(events: list) -> str:
    return "\n".join(
        f"  {type(e).__name__}({len(e.block_hashes)} blocks, medium={e.medium})" for e in events
    )


def assert_stored(ev, event, req, blocks: range, *, block_size: int = BLOCK) -> None:
    """``event`` announces blocks ``blocks`` of ``req`` in kvtier's CPU tier."""
    where = f"BlockStored for blocks {blocks.start}..{blocks.stop - 1} of {req.request_id}"
    assert isinstance(event, ev.BlockStored), f"{where}: got {type(event).__name__}"
    hashes = req.block_hashes
    assert event.block_hashes == [ev.convert(hashes[i]) for i in blocks], f"{where}: hashes"
    parent = ev.convert(hashes[blocks.start - 1]) if blocks.start else None
    assert event.parent_block_hash == parent, f"{where}: parent_block_hash"
    tokens = list(req.all_token_ids[blocks.start * block_size : blocks.stop * block_size])
    assert event.token_ids == tokens, f"{where}: token_ids"
    assert event.block_size == block_size, f"{where}: block_size"
    assert (event.medium, event.locality, event.ownership) == ("CPU", "LOCAL", "kvtier"), where
    assert event.group_idx == 0, where


def assert_removed(ev, event, req_blocks: list[tuple[Any, range]]) -> None:
    """``event`` withdraws exactly the given blocks (any order) from the CPU tier."""
    assert isinstance(event, ev.BlockRemoved), f"expected BlockRemoved, got {event!r}"
    want = [ev.convert(req.block_hashes[i]) for req, blocks in req_blocks for i in blocks]
    assert sorted(event.block_hashes) == sorted(want), "BlockRemoved: block hashes"
    assert len(set(event.block_hashes)) == len(event.block_hashes), "BlockRemoved: duplicates"
    assert (event.medium, event.locality, event.ownership) == ("CPU", "LOCAL", "kvtier")


def records(hashes: list[bytes], kind: str = STORED) -> list[TierEvent]:
    """One rank's CPU-tier records of ``kind`` for ``hashes``."""
    return [TierEvent(kind, "cpu", h) for h in hashes]


def add(ev, tracker, rank: int, records: list[TierEvent]) -> list:
    tracker.add(ev.events.rank_events(rank, records).get_all_events())
    return tracker.take()


CHUNKS = [b"c0", b"c1", b"c2", b"c3"]


@pytest.mark.parametrize(
    ("chunk", "num_tokens", "extras"),
    [
        (8, 24, {}),  # chunks of two blocks
        (6, 24, {}),  # not a multiple: a block belongs to the chunk holding its last token
        (8, 22, {}),  # a partial last chunk announces its whole blocks only
        (8, 24, {"cache_salt": "tenant-a"}),
        (8, 24, {"lora": True}),
        (4, 24, {"session_id": "s-1"}),  # one block per chunk
    ],
    ids=["8/24", "6/24", "8/22-partial", "salt", "lora", "4/24-session"],
)
def test_chunk_events_carry_what_vllms_own_block_events_carry(ev, chunk, num_tokens, extras):
    if extras.pop("lora", False):
        from vllm.lora.request import LoRARequest

        extras["lora_request"] = LoRARequest("adapter-a", 7, "/adapters/a")
    req = ev.request("r", tokens_of(num_tokens, seed=3), **extras)
    tracker = ev.events.KVEventTracker(1, chunk, BLOCK)
    num_chunks = -(-num_tokens // chunk)
    hashes = [bytes([i]) for i in range(num_chunks)]
    tracker.record_chunks(req, 0, hashes, num_tokens)
    ours = add(ev, tracker, 0, records(hashes))

    theirs = ev.vllm_block_event(req)  # vLLM's prefix cache, same request, medium GPU
    expected_blocks = [
        range(start * chunk // BLOCK, min((start + 1) * chunk, num_tokens) // BLOCK)
        for start in range(num_chunks)
    ]
    expected_blocks = [blocks for blocks in expected_blocks if blocks]
    assert len(ours) == len(expected_blocks), describe(ours)
    for event, blocks in zip(ours, expected_blocks, strict=True):
        assert_stored(ev, event, req, blocks)
        # Every field but the placement equals vLLM's event for the same blocks.
        first, last = blocks.start, blocks.stop
        assert event.block_hashes == theirs.block_hashes[first:last]
        assert event.token_ids == theirs.token_ids[first * BLOCK : last * BLOCK]
        assert event.extra_keys == theirs.extra_keys[first:last]
        assert (event.lora_id, event.lora_name, event.session_id) == (
            theirs.lora_id,
            theirs.lora_name,
            theirs.session_id,
        )
    assert sum(len(e.block_hashes) for e in ours) == len(theirs.block_hashes)
    assert tracker.counters[Counter.KV_EVENTS_BLOCKS_STORED] == len(theirs.block_hashes)


def test_tensor_parallel_ranks_merge_into_what_every_rank_holds(ev):
    """A chunk is announced once the last rank holds it and withdrawn once the first
    rank loses it: ``lookup`` is the minimum over ranks."""
    req = ev.request("r", tokens_of(24, seed=4))
    tracker = ev.events.KVEventTracker(2, CHUNK, BLOCK)
    c0, c1, c2 = CHUNKS[:3]
    tracker.record_chunks(req, 0, [c0, c1, c2], 24)

    assert add(ev, tracker, 0, records([c0, c1])) == []  # rank 1 not yet
    (event,) = add(ev, tracker, 1, records([c0]))  # a step later
    assert_stored(ev, event, req, range(0, 2))
    events = add(ev, tracker, 1, records([c1]))
    events += add(ev, tracker, 0, records([c2]))
    assert len(events) == 1, describe(events)
    assert_stored(ev, events[0], req, range(2, 4))

    (event,) = add(ev, tracker, 1, records([c0], REMOVED))  # rank 1 evicted c0
    assert_removed(ev, event, [(req, range(0, 2))])
    assert add(ev, tracker, 0, records([c0], REMOVED)) == []  # already withdrawn
    assert add(ev, tracker, 1, records([c0])) == []  # rank 0 lacks it now
    (event,) = add(ev, tracker, 0, records([c0]))
    assert_stored(ev, event, req, range(0, 2))
    (event,) = add(ev, tracker, 1, records([c2]))
    assert_stored(ev, event, req, range(4, 6))

    (event,) = add(ev, tracker, 0, [TierEvent(CLEARED, "cpu")])  # one event for all
    assert_removed(ev, event, [(req, range(0, 6))])
    assert add(ev, tracker, 1, [TierEvent(CLEARED, "cpu")]) == []
    assert add(ev, tracker, 5, records([c0])) == []  # no such rank: ignored
    assert tracker.counters[Counter.KV_EVENTS_BLOCKS_STORED] == 8
    assert tracker.counters[Counter.KV_EVENTS_BLOCKS_REMOVED] == 8


def test_a_chunk_without_payload_is_counted_not_announced(ev):
    req = ev.request("r", tokens_of(24, seed=5))
    tracker = ev.events.KVEventTracker(1, CHUNK, BLOCK, max_payloads=2)
    tracker.record_chunks(req, 0, CHUNKS[:3], 24)  # c0's payload falls out of the LRU
    events = add(ev, tracker, 0, records(CHUNKS[:3]))
    assert len(events) == 2, describe(events)
    assert_stored(ev, events[0], req, range(2, 4))
    assert tracker.counters[Counter.KV_EVENTS_UNANNOUNCED] == 1
    assert add(ev, tracker, 0, records([CHUNKS[0]], REMOVED)) == []  # never told


def test_events_nobody_takes_are_bounded(ev):
    req = ev.request("r", tokens_of(32, seed=6))
    tracker = ev.events.KVEventTracker(1, CHUNK, BLOCK, max_events=2)
    tracker.record_chunks(req, 0, CHUNKS, 32)
    tracker.add(ev.events.rank_events(0, records(CHUNKS)).get_all_events())
    events = tracker.take()  # the two newest of four
    assert len(events) == 2, describe(events)
    assert_stored(ev, events[0], req, range(4, 6))
    assert_stored(ev, events[1], req, range(6, 8))
    assert tracker.counters[Counter.KV_EVENTS_DROPPED] == 2
    assert tracker.take() == []


# -- a scripted workload: scheduler side + worker ranks + vLLM's aggregation ----------


def make_worker(
    rank: int = 0, world: int = 1, *, mla: bool = False, **overrides: Any
) -> WorkerSide:
    """Rank ``rank`` of ``world`` tensor-parallel ranks; ``mla``: of an MLA cache, whose
    ranks hold the same latent under the same keys, each in its own CPU tier."""
    config = load_config(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": 3 * CHUNK_BYTES / 2**30,  # room for three chunks
            "kernel_backend": "torch",
            **overrides,
        },
        env={},
    )
    worker = WorkerSide(
        config,
        EngineMetadata("test-model", world, rank),
        None,
        record_events=True,
        mla_replicas=world,
    )
    paged = make_paged(seed=0 if mla else rank, mla=mla)
    backend = "FLASHMLA" if mla else "FLASH_ATTN"
    worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(paged.tensors)}, backend)
    return worker


def make_scheduler(ev, workers: list[WorkerSide]):
    def lookup(hashes: list[bytes], load_from: int = 0) -> int:
        return min(
            w.engine.storage.lookup_prefix([w.engine.chunker.key(h) for h in hashes], prefetch=True)
            for w in workers
        )

    tracker = ev.events.KVEventTracker(len(workers), CHUNK, BLOCK)
    extension = ev.events.KVEventScheduling(tracker)
    side = SchedulerSide(workers[0].config, lookup, block_size=BLOCK, extensions=[extension])
    return side, tracker


def serve(side: SchedulerSide, workers: list[WorkerSide], req, blocks: list[int]) -> None:
    """One request, prefilled in one step the way vLLM drives both connector halves."""
    matched, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks, matched)
    scheduled = req.num_prompt_tokens - matched
    plan = side.build_plan(new_step(req.request_id, blocks, matched, scheduled))
    for worker in workers:
        run_step(worker, plan)
    side.request_finished(req)


@pytest.mark.parametrize(
    ("world", "mla"), [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2-mla"]
)
def test_store_evict_clear_give_exact_events(ev, world, mla):
    workers = [make_worker(rank, world, mla=mla) for rank in range(world)]
    try:
        side, tracker = make_scheduler(ev, workers)
        a = ev.request("a", tokens_of(24, seed=7))
        b = ev.request("b", tokens_of(16, seed=8))

        serve(side, workers, a, list(range(10, 16)))  # three chunks fill the pool
        events = ev.ship(tracker, workers)
        assert len(events) == 3, describe(events)
        for i, event in enumerate(events):
            assert_stored(ev, event, a, range(2 * i, 2 * i + 2))

        serve(side, workers, b, list(range(20, 24)))  # staging b evicts a's c0, c1 (LRU)
        events = ev.ship(tracker, workers)
        assert len(events) == 4, describe(events)
        assert_removed(ev, events[0], [(a, range(0, 2))])
        assert_removed(ev, events[1], [(a, range(2, 4))])
        assert_stored(ev, events[2], b, range(0, 2))
        assert_stored(ev, events[3], b, range(2, 4))

        for worker in workers:  # what reset_cache does on every rank
            worker.engine.storage.clear()
        (event,) = ev.ship(tracker, workers)
        assert_removed(ev, event, [(a, range(4, 6)), (b, range(0, 4))])
        assert tracker.counters[Counter.KV_EVENTS_BLOCKS_STORED] == 10
        assert tracker.counters[Counter.KV_EVENTS_BLOCKS_REMOVED] == 10
        assert ev.ship(tracker, workers) == []
    finally:
        for worker in workers:
            worker.shutdown()


def test_every_rank_cleared_then_storing_in_one_step_announces_only_what_all_hold(ev):
    """A reset empties every rank between steps; in the next step each rank records its
    clear, then the prompt stored again. The chunks are withdrawn once and announced once:
    rank 0's new stores are not announced while rank 1's clear is still to be merged."""
    workers = [make_worker(rank, 2) for rank in range(2)]
    try:
        side, tracker = make_scheduler(ev, workers)
        a = ev.request("a", tokens_of(24, seed=7))
        serve(side, workers, a, list(range(10, 16)))
        assert len(ev.ship(tracker, workers)) == 3
        for worker in workers:  # what reset_cache does on every rank
            worker.engine.storage.clear()
        again = ev.request("a2", list(a.all_token_ids))
        serve(side, workers, again, list(range(20, 26)))
        events = ev.ship(tracker, workers)
        assert len(events) == 4, describe(events)
        assert_removed(ev, events[0], [(a, range(0, 6))])
        for i, event in enumerate(events[1:]):
            assert_stored(ev, event, again, range(2 * i, 2 * i + 2))
    finally:
        for worker in workers:
            worker.shutdown()


def test_one_rank_losing_a_chunk_withdraws_it(ev):
    workers = [make_worker(rank, 2) for rank in range(2)]
    try:
        side, tracker = make_scheduler(ev, workers)
        a = ev.request("a", tokens_of(24, seed=9))
        serve(side, workers[:1], a, list(range(10, 16)))  # rank 1's pool took nothing
        assert ev.ship(tracker, workers) == []
        hashes = workers[0].engine.chunker.chunk_hashes(list(a.all_token_ids))
        rank1 = workers[1].engine
        rank1.store_chunks(rank1.chunker.chunks_from_hashes(0, hashes, 24), torch.arange(40, 64))
        assert len(ev.ship(tracker, workers)) == 3  # now both hold all three
        workers[1].engine.storage.remove(workers[1].engine.chunker.key(hashes[1]))
        (event,) = ev.ship(tracker, workers)
        assert_removed(ev, event, [(a, range(2, 4))])
        assert workers[0].engine.storage.contains(workers[0].engine.chunker.key(hashes[1]))
    finally:
        for worker in workers:
            worker.shutdown()


def test_a_chunk_copied_up_from_disk_is_announced_from_the_lookup_hit(ev, tmp_path):
    """A scheduler that never planned a chunk's save learns its payload from the lookup
    that found it on disk; the prefetch into the CPU tier is then announced."""
    worker = make_worker(local_disk=str(tmp_path))
    try:
        side, tracker = make_scheduler(ev, [worker])
        a = ev.request("a", tokens_of(24, seed=10))
        serve(side, [worker], a, list(range(10, 16)))
        assert worker.engine.storage.flush(30)
        stored = ev.ship(tracker, [worker])  # in memory, and on the local disk
        assert sorted(e.medium for e in stored) == ["CPU"] * 3 + ["STORAGE"] * 3
        assert {e.locality for e in stored} == {"LOCAL"}
        hashes = worker.engine.chunker.chunk_hashes(list(a.all_token_ids))
        for h in hashes:
            worker.engine.storage.cpu.remove(worker.engine.chunker.key(h))
        withdrawn = ev.ship(tracker, [worker])  # from memory only: the disk keeps them
        assert [e.medium for e in withdrawn] == ["CPU"] * 3

        side, tracker = make_scheduler(ev, [worker])  # a fresh scheduler: no payloads
        again = ev.request("a2", list(a.all_token_ids))
        matched, _ = side.get_num_new_matched_tokens(again, 0)
        assert matched == 23  # the hit, up to the last token
        deadline = time.monotonic() + 10
        while not all(worker.engine.storage.contains(worker.engine.chunker.key(h)) for h in hashes):
            assert time.monotonic() < deadline, "prefetch into the CPU tier did not finish"
            time.sleep(0.01)
        events = ev.ship(tracker, [worker])
        assert len(events) == 3, describe(events)
        for i, event in enumerate(events):
            assert_stored(ev, event, again, range(2 * i, 2 * i + 2))
        assert tracker.counters[Counter.KV_EVENTS_UNANNOUNCED] == 0
    finally:
        worker.shutdown()


def test_local_disk_records_writes_and_losses(tmp_path):
    """The disk tier announces what it wrote and withdraws what it evicts, removes or
    clears; files it did not write itself are never announced by it."""
    from support.tiers import fill, key, make_pool

    from kvtier.storage.disk import FileTier
    from kvtier.storage.serde import NaiveSerde

    log = TierEventLog()
    pool = make_pool(16)
    one_file = 2 * 3 * 16 * 64 * 2 + 400
    tier = FileTier(
        tmp_path,
        capacity_bytes=int(2.5 * one_file),
        serde=NaiveSerde(),
        stats=Stats(),
        events=log,
    )
    for seed in range(3):  # the third write evicts the first
        tier.submit_put(key(seed), fill(pool, seed))
        assert tier.flush(30)
    assert log.drain() == [
        TierEvent(STORED, "disk", key(0).chunk_hash),
        TierEvent(STORED, "disk", key(1).chunk_hash),
        TierEvent(REMOVED, "disk", key(0).chunk_hash),
        TierEvent(STORED, "disk", key(2).chunk_hash),
    ]
    tier.remove(key(1))
    assert log.drain() == [TierEvent(REMOVED, "disk", key(1).chunk_hash)]
    other = FileTier(tmp_path, capacity_bytes=None, serde=NaiveSerde(), stats=Stats())
    other.submit_put(key(7), fill(pool, 7))
    assert other.flush(30)
    tier.contains_many([key(7)])  # adopted into the index, but not announced by this tier
    tier.clear()
    assert log.drain() == [TierEvent(CLEARED, "disk")]
    other.close()
    tier.close()
    pool.close()
