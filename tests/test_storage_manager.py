"""The storage manager across tiers, through the cache engine: CPU + local disk (real
files), and the remote tier's fault handling against a store that fails on command.

Real Redis and S3 servers are exercised in test_remote_tiers.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from support.tiers import FlakyStore, fill, in_a_newer_format, key, make_pool, same_bytes
from test_engine import assert_kv_equal, kv_at, make_engine

from kvtier.config import load_config
from kvtier.engine import CacheEngine
from kvtier.observability.stats import Counter, Stats, TierCounter, tier_counter
from kvtier.storage import wire
from kvtier.storage.blob_store import join_parts
from kvtier.storage.manager import StorageManager
from kvtier.storage.remote import RemoteTier
from kvtier.storage.serde import NaiveSerde

# -- CPU + disk, through the engine -----------------------------------------------------


def test_a_cpu_tier_larger_than_the_machine_names_max_local_cpu_size(monkeypatch):
    import kvtier.machine
    from kvtier.machine import PoolTooLarge
    from kvtier.storage.manager import StorageManager

    monkeypatch.setattr(kvtier.machine, "host_memory", lambda: (1 << 30, 2 << 30))
    config = load_config({"max_local_cpu_size": 4}, env={})
    with pytest.raises(
        PoolTooLarge, match=r"^max_local_cpu_size=4 \(GiB, .*\): cannot .*lower it$"
    ):
        StorageManager(config)


def test_a_new_engine_loads_what_a_previous_one_stored_on_disk(tmp_path):
    first = make_engine(local_disk=str(tmp_path), seed=0)
    tokens, src = torch.arange(40), torch.arange(40)
    reference = kv_at(first, src)
    assert first.store(tokens, slot_mapping=src).stored_chunks == 5
    first.close()  # flushes the disk writes: the process could exit now

    second = make_engine(local_disk=str(tmp_path), seed=1)
    assert second.storage.cpu.keys() == []
    dst = torch.arange(100, 140)
    assert second.lookup(tokens) == 40
    assert second.retrieve(tokens, slot_mapping=dst) == 40
    assert_kv_equal(second, dst, reference, "loaded from disk after a restart")
    snap = second.stats.snapshot()
    assert snap[tier_counter("disk", TierCounter.GET_HITS)] == 5
    assert snap[Counter.HIT_TOKENS] == 40
    second.close()


@pytest.mark.parametrize("geometry", [{"num_layers": 2}, {"head_size": 16}])
def test_a_model_of_another_geometry_under_the_same_name_neither_loads_nor_deletes(
    tmp_path, geometry
):
    tokens, src, dst = torch.arange(40), torch.arange(40), torch.arange(100, 140)
    owner = make_engine(local_disk=str(tmp_path))
    reference = kv_at(owner, src)
    owner.store(tokens, slot_mapping=src)
    assert owner.flush(30)
    other = make_engine(local_disk=str(tmp_path), seed=1, **geometry)  # one shared directory
    untouched = kv_at(other, dst)
    assert other.retrieve(tokens, slot_mapping=dst) == 0
    assert_kv_equal(other, dst, untouched, "the other model's cache")
    assert other.stats.get(Counter.CORRUPT_CHUNKS) == 1
    other.close()
    owner.storage.cpu.clear()
    assert owner.retrieve(tokens, slot_mapping=dst) == 40, "its chunks were deleted"
    assert_kv_equal(owner, dst, reference, "loaded from the shared directory")
    owner.close()


def test_without_a_cpu_tier_the_disk_alone_serves(tmp_path):
    engine = make_engine(local_disk=str(tmp_path), local_cpu=False)
    tokens, src = torch.arange(24), torch.arange(24)
    reference = kv_at(engine, src)
    assert engine.store(tokens, slot_mapping=src).stored_chunks == 3
    assert engine.storage.flush(30)
    assert engine.storage.cpu.keys() == []
    assert engine.storage.cpu.used_bytes == 0  # staging buffers went back to the pool
    dst = torch.arange(200, 224)
    assert engine.lookup(tokens) == 24
    assert engine.retrieve(tokens, slot_mapping=dst) == 24
    assert_kv_equal(engine, dst, reference, "disk only")
    assert engine.storage.cpu.used_bytes == 0
    engine.close()


def test_prefix_spans_tiers_and_lower_hits_are_written_back(tmp_path):
    engine = make_engine(local_disk=str(tmp_path))
    tokens, src = torch.arange(40), torch.arange(40)
    reference = kv_at(engine, src)
    engine.store(tokens, slot_mapping=src)
    assert engine.storage.flush(30)
    chunks = engine.chunker.chunks(tokens)
    for chunk in chunks[2:]:
        engine.storage.cpu.remove(chunk.key)  # CPU keeps chunks 0-1, the disk has all 5
    assert engine.storage.cpu.prefix_length([c.key for c in chunks]) == 2
    dst = torch.arange(200, 240)
    assert engine.retrieve(tokens, slot_mapping=dst) == 40
    assert_kv_equal(engine, dst, reference, "CPU prefix + disk rest")
    assert engine.stats.get(Counter.WRITEBACK_CHUNKS) == 3
    assert engine.storage.cpu.prefix_length([c.key for c in chunks]) == 5
    engine.close()


def test_a_lookup_counts_memory_chunks_past_one_only_a_lower_tier_holds(tmp_path):
    """The CPU tier first, then the lower tiers for every chunk still missing: chunk 1
    only on disk, chunk 2 only in memory (its disk copy gone) is a 3-chunk hit, as the
    load that follows reads."""
    engine = make_engine(local_disk=str(tmp_path))
    tokens, src = torch.arange(24), torch.arange(24)
    reference = kv_at(engine, src)
    engine.store(tokens, slot_mapping=src)
    assert engine.storage.flush(30)
    keys = engine.chunk_keys(tokens)
    engine.storage.cpu.remove(keys[1])
    engine.storage.lower[0].remove(keys[2])
    assert engine.lookup(tokens) == 24
    dst = torch.arange(200, 224)
    assert engine.retrieve(tokens, slot_mapping=dst) == 24
    assert_kv_equal(engine, dst, reference, "memory, disk, memory")
    engine.close()


def test_lookup_prefetches_lower_tier_chunks_into_memory(tmp_path):
    first = make_engine(local_disk=str(tmp_path))
    tokens = torch.arange(32)
    first.store(tokens, slot_mapping=torch.arange(32))
    first.close()
    second = make_engine(local_disk=str(tmp_path))
    assert second.lookup(tokens) == 32
    keys = [c.key for c in second.chunker.chunks(tokens)]
    deadline = time.monotonic() + 10
    while second.storage.cpu.prefix_length(keys) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert second.storage.cpu.prefix_length(keys) == 4
    assert second.stats.get(Counter.PREFETCHED_CHUNKS) == 4
    disk_reads = second.stats.get(tier_counter("disk", TierCounter.GET_HITS))
    second.retrieve(tokens, slot_mapping=torch.arange(100, 132))
    assert second.stats.get(tier_counter("disk", TierCounter.GET_HITS)) == disk_reads
    second.close()


@pytest.mark.parametrize(("load_from", "prefetched"), [(None, [0, 1]), (3, [3, 4]), (5, [5])])
def test_a_lookup_prefetches_only_what_one_load_can_take(
    tmp_path, monkeypatch, load_from, prefetched
):
    """A load takes at most ``max_load_chunks`` chunks past vLLM's own prefix (from the
    start where that prefix is not known): a lookup reads no lower-tier chunk beyond."""
    first = make_engine(local_disk=str(tmp_path))
    tokens = torch.arange(48)
    first.store(tokens, slot_mapping=torch.arange(48))
    first.close()
    monkeypatch.setattr(CacheEngine, "max_load_chunks", property(lambda self: 2))
    second = make_engine(local_disk=str(tmp_path))
    keys = [c.key for c in second.chunker.chunks(tokens)]
    if load_from is None:
        assert second.lookup(tokens) == 48
    else:
        assert second.lookup_hashes(second.chunker.chunk_hashes(tokens), load_from) == 6
    deadline = time.monotonic() + 10
    while (
        second.stats.get(Counter.PREFETCHED_CHUNKS) < len(prefetched)
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    time.sleep(0.1)  # a prefetch of more chunks would have landed by now
    held = [i for i, k in enumerate(keys) if second.storage.cpu.contains(k)]
    assert held == prefetched
    assert second.stats.get(Counter.PREFETCHED_CHUNKS) == len(prefetched)
    assert second.stats.get(tier_counter("disk", TierCounter.GET_HITS)) == len(prefetched)
    second.close()


def test_a_prefetch_counts_only_the_chunks_it_put_into_memory(tmp_path, monkeypatch):
    """A chunk another reader puts into memory while the prefetch reads it from disk
    is read, but not prefetched: memory keeps the other reader's copy."""
    first = make_engine(local_disk=str(tmp_path))
    tokens = torch.arange(32)
    first.store(tokens, slot_mapping=torch.arange(32))
    first.close()
    second = make_engine(local_disk=str(tmp_path))
    storage, disk = second.storage, second.storage.lower[0]
    read_from_disk = disk.get_many

    def another_reader_first(keys, allocate):
        objs = read_from_disk(keys, allocate)
        for k, obj in zip(keys[:1], objs, strict=False):
            storage.cpu.put(k, obj)
        return objs

    monkeypatch.setattr(disk, "get_many", another_reader_first)
    keys = [c.key for c in second.chunker.chunks(tokens)]
    assert second.lookup(tokens) == 32
    wait_until(lambda: storage.cpu.prefix_length(keys) == 4)
    wait_until(lambda: not storage._prefetching)
    assert second.stats.get(tier_counter("disk", TierCounter.GET_HITS)) == 4
    assert second.stats.get(Counter.PREFETCHED_CHUNKS) == 3
    assert second.stats.get(Counter.WRITEBACK_CHUNKS) == 3
    second.close()


def test_store_of_a_chunk_already_on_disk_rewrites_nothing(tmp_path):
    first = make_engine(local_disk=str(tmp_path))
    first.store(torch.arange(16), slot_mapping=torch.arange(16))
    first.close()
    second = make_engine(local_disk=str(tmp_path))
    second.store(torch.arange(16), slot_mapping=torch.arange(16))
    assert second.storage.flush(30)
    assert second.stats.get(tier_counter("disk", TierCounter.PUT_CHUNKS)) == 0
    second.close()


@pytest.mark.parametrize("tiers", ["fs", "disk+fs"])
def test_without_a_cpu_tier_a_disk_beside_another_tier_or_no_index_gets_every_chunk(
    tmp_path, tiers
):
    """Only a local disk that is the only tier lets a store skip what its index holds:
    the shared-filesystem tier has no index (a lookup per chunk would be I/O), and a
    tier beside the disk may lack what the disk holds. The disk still writes no chunk
    twice."""
    disk = {"local_disk": str(tmp_path / "disk")} if tiers == "disk+fs" else {}
    engine = make_engine(local_cpu=False, remote_url=f"fs://{tmp_path}/fs", **disk)
    tokens, slots = torch.arange(16), torch.arange(16)
    for _ in range(2):
        result = engine.store(tokens, slot_mapping=slots)
        assert (result.stored_chunks, result.skipped_existing) == (2, 0)
        assert engine.storage.flush(30)
    assert engine.stats.get(tier_counter("fs", TierCounter.PUT_CHUNKS)) == 2
    if disk:
        assert engine.stats.get(tier_counter("disk", TierCounter.PUT_CHUNKS)) == 2
    engine.close()


def test_two_stores_of_the_same_prompt_at_once_count_it_stored_once(tmp_path):
    """Two threads stage the same new chunks before either commits (both see them
    missing): the second commit finds them held, so they count as skipped, not as
    stored twice, and are not queued to the disk again."""
    engine = make_engine(local_disk=str(tmp_path))
    tokens, slots = torch.arange(16), torch.arange(16)
    chunks = engine.chunker.chunks(tokens)
    first, second = engine.begin_store(chunks, slots), engine.begin_store(chunks, slots)
    for transfer in (first, second):
        transfer.gather()
    assert (first.commit().stored_chunks, first.result.skipped_existing) == (2, 0)
    assert (second.commit().stored_chunks, second.result.skipped_existing) == (0, 2)
    assert engine.storage.flush(30)
    assert engine.stats.get(Counter.STORED_CHUNKS) == 2
    assert engine.stats.get(Counter.STORE_SKIPPED_EXISTING) == 2
    assert engine.stats.get(tier_counter("disk", TierCounter.PUT_CHUNKS)) == 2
    engine.close()


def test_clear_empties_every_tier(tmp_path):
    engine = make_engine(local_disk=str(tmp_path))
    engine.store(torch.arange(16), slot_mapping=torch.arange(16))
    engine.storage.clear()
    assert engine.lookup(torch.arange(16)) == 0
    assert not list(tmp_path.rglob("*.kvt"))
    engine.close()


# -- the remote tier's fault handling, against a store that misbehaves on command ------


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def remote(store, stats=None, **kwargs) -> RemoteTier:
    kwargs.setdefault("timeout_s", 0.3)
    kwargs.setdefault("reconnect_max_s", 0.2)
    return RemoteTier(
        store, describe="flaky://test", serde=NaiveSerde(), stats=stats or Stats(), **kwargs
    )


def count(stats, what):
    return stats.get(tier_counter("flaky", what))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_remote_round_trip_and_batched_lookup(pool):
    store, stats = FlakyStore(), Stats()
    tier = remote(store, stats)
    objs = [fill(pool, i) for i in range(4)]
    for i, obj in enumerate(objs):
        assert tier.submit_put(key(i), obj)
    assert tier.flush(10)
    calls = store.calls
    assert tier.contains_many([key(i) for i in range(6)]) == [True] * 4 + [False] * 2
    assert store.calls == calls + 1  # one round trip for the whole lookup
    got = tier.get_many([key(i) for i in range(5)], pool.allocate)
    assert all(same_bytes(got[i], objs[i]) for i in range(4)) and got[4] is None
    assert count(stats, TierCounter.PUT_CHUNKS) == 4
    assert count(stats, TierCounter.GET_HITS) == 4
    tier.close()


def test_remote_down_is_a_miss_then_reconnects(pool, caplog):
    store, stats = FlakyStore(), Stats()
    tier = remote(store, stats)
    obj = fill(pool, 1)
    tier.submit_put(key(1), obj)
    tier.flush(10)
    store.mode = "down"
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        assert tier.contains_many([key(1)]) == [False]
        assert not tier.is_up
        assert tier.get_many([key(1)], pool.allocate) == [None]
        assert not tier.submit_put(key(2), obj)  # dropped at once while down
        assert count(stats, TierCounter.DROPPED_UNAVAILABLE) == 1
        time.sleep(0.5)  # several reconnect attempts fail
        assert not tier.is_up
        store.mode = "ok"
        wait_until(lambda: tier.is_up)
    assert count(stats, TierCounter.RECONNECTS) == 1
    assert tier.contains_many([key(1)]) == [True]
    unavailable = [r for r in caplog.records if "unavailable" in r.message]
    assert len(unavailable) == 1, "one warning per outage, not one per call"
    assert any("available again" in r.message for r in caplog.records)
    tier.close()


def test_hanging_remote_costs_at_most_the_timeout(pool):
    store = FlakyStore()
    tier = remote(store, timeout_s=0.2)
    store.mode = "hang"
    started = time.monotonic()
    assert tier.contains_many([key(1), key(2)]) == [False, False]
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert tier.get_many([key(1)], pool.allocate) == [None]  # down now: immediate
    assert time.monotonic() - started < 0.1
    store.released.set()
    store.mode = "ok"
    wait_until(lambda: tier.is_up)
    tier.close()


def test_close_waits_for_the_calls_a_slow_store_still_runs(pool):
    store = FlakyStore()
    tier = remote(store, timeout_s=0.2)
    store.delay = 0.6  # every call outlives the timeout, and ends by itself
    assert tier.contains_many([key(1)]) == [False]  # given up on; still running
    tier.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvtier-flaky")]
    assert left == [], "a thread of the tier outlived close()"


def test_a_long_load_gets_the_timeout_per_wave_of_requests(pool):
    store = FlakyStore()
    tier = remote(store, timeout_s=0.3, concurrency=2)
    objs = [fill(pool, i) for i in range(6)]
    for i, obj in enumerate(objs):
        tier.submit_put(key(i), obj)
    assert tier.flush(10)
    store.delay = 0.15  # 6 gets, 2 at a time: 0.45 s in all, 0.15 s per request
    got = tier.get_many([key(i) for i in range(6)], pool.allocate)
    assert all(same_bytes(g, objs[i]) for i, g in enumerate(got))
    assert tier.is_up
    tier.close()


def test_a_lookup_is_not_queued_behind_a_long_load(pool):
    store = FlakyStore()
    tier = remote(store, timeout_s=0.5, concurrency=2)
    objs = [fill(pool, i) for i in range(8)]
    for i, obj in enumerate(objs):
        tier.submit_put(key(i), obj)
    assert tier.flush(10)
    store.delay = 0.2  # 8 gets on 2 I/O threads: 0.8 s in all
    loading = threading.Thread(
        target=tier.get_many, args=([key(i) for i in range(8)], pool.allocate)
    )
    loading.start()
    time.sleep(0.05)
    assert tier.contains_many([key(0)]) == [True]  # answered in 0.2 s, not after the load
    assert tier.is_up
    loading.join()
    tier.close()


@pytest.mark.parametrize(
    ("mode", "dropped"),
    [
        ("full", TierCounter.DROPPED_NO_SPACE),
        ("throttled", TierCounter.DROPPED_THROTTLED),
        ("down", TierCounter.DROPPED_UNAVAILABLE),
    ],
)
def test_a_failed_store_counts_only_the_chunks_the_remote_lacked(pool, mode, dropped):
    """Chunks 0-3 are there; a batch of 0-5 whose write fails dropped 4 and 5 alone."""
    store, stats = FlakyStore(), Stats()
    tier = remote(store, stats, writers=1)
    objs = [fill(pool, i) for i in range(6)]
    for i in range(4):
        tier.submit_put(key(i), objs[i])
    assert tier.flush(10)
    real_exists = store.exists_many

    def exists_then_fail(names):  # answers; a put of what it lacks then fails
        present = real_exists(names)
        if not all(present):
            store.mode = mode
        return present

    store.exists_many = exists_then_fail
    store.delay = 0.1  # the first batch is still running while the others queue up
    for i in range(6):
        tier.submit_put(key(i), objs[i])
    assert tier.flush(10)
    assert count(stats, dropped) == 2
    tier.close()


def test_corrupt_remote_object_is_a_counted_miss_and_deleted(pool):
    store, stats = FlakyStore(), Stats()
    tier = remote(store, stats)
    tier.submit_put(key(1), fill(pool, 1))
    tier.flush(10)
    name = key(1).to_string()
    store.blobs[name] = store.blobs[name][:-1] + bytes([store.blobs[name][-1] ^ 1])
    assert tier.get_many([key(1)], pool.allocate) == [None]
    assert count(stats, TierCounter.CORRUPT) == 1 and stats.get(Counter.CORRUPT_CHUNKS) == 1
    wait_until(lambda: name not in store.blobs)
    assert tier.is_up  # a bad object is not a bad server
    tier.close()


def test_objects_of_a_newer_kvtier_are_misses_said_once_and_not_counted_corrupt(pool, caplog):
    """A rolling upgrade: a newer engine stored these chunks in a format this kvtier does
    not read. Each is a miss, deleted (so this kvtier stores it again in a format both
    read), counted as a newer format rather than as damage, and logged once, not per
    chunk."""
    store, stats = FlakyStore(), Stats()
    tier = remote(store, stats)
    for i in range(5):
        tier.submit_put(key(i), fill(pool, i))
    assert tier.flush(10)
    store.blobs = {name: in_a_newer_format(blob) for name, blob in store.blobs.items()}
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.get_many([key(i) for i in range(5)], pool.allocate) == [None] * 5
    assert count(stats, TierCounter.NEWER_FORMAT) == 5
    assert count(stats, TierCounter.CORRUPT) == 0 and stats.get(Counter.CORRUPT_CHUNKS) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "newer kvtier (format version 2" in warnings[0], warnings
    wait_until(lambda: not store.blobs)
    assert tier.is_up
    tier.close()


def test_an_object_stored_under_another_key_is_refused(pool):
    store = FlakyStore()
    tier = remote(store)
    obj = fill(pool, 1)
    store.blobs[key(2).to_string()] = bytes(
        join_parts(wire.encode(key(1).to_string(), obj.tensor, NaiveSerde()))
    )
    assert tier.get_many([key(2)], pool.allocate) == [None]
    tier.close()


def test_manager_keeps_serving_from_cpu_while_the_remote_is_down(pool):
    store, stats = FlakyStore(), Stats()
    config = load_config({"max_local_cpu_size": 0.05}, env={})
    manager = StorageManager(config, stats, lower_tiers=[remote(store, stats)])
    objs = [fill(pool, i) for i in range(3)]
    for i, obj in enumerate(objs):
        assert manager.put(key(i), obj)
    assert manager.flush(10)
    manager.cpu.remove(key(2))
    store.mode = "down"
    assert manager.lookup_prefix([key(0), key(1), key(2)]) == 2
    assert manager.contains_many([key(2), key(0), key(3)]) == [False, True, False]
    got = manager.get_many([key(0), key(1), key(2)])
    assert same_bytes(got[0], objs[0]) and same_bytes(got[1], objs[1]) and got[2] is None
    for obj in got[:2]:
        obj.ref_down()
    store.mode = "ok"
    wait_until(lambda: manager.lookup_prefix([key(0), key(1), key(2)]) == 3)
    # key(2) only in the remote, key(0) in the CPU tier, key(3) nowhere
    assert manager.contains_many([key(2), key(0), key(3)]) == [True, True, False]
    manager.close()


def test_put_never_waits_for_a_hanging_remote(pool):
    store, stats = FlakyStore(), Stats()
    config = load_config({"max_local_cpu_size": 0.05}, env={})
    tier = remote(store, stats, writers=1, max_batch=1, queue_capacity=2)
    manager = StorageManager(config, stats, lower_tiers=[tier])
    store.mode = "hang"
    started = time.monotonic()
    for i in range(6):
        manager.put(key(i), fill(pool, i))
    assert time.monotonic() - started < 0.5
    assert count(stats, TierCounter.DROPPED_QUEUE_FULL) == 4  # 2 queued or in flight
    store.released.set()
    store.mode = "ok"
    manager.close()


def test_shared_filesystem_remote_through_config(tmp_path, pool):
    url = f"fs://{tmp_path}/shared"
    config = load_config({"max_local_cpu_size": 0.05, "remote_url": url}, env={})
    writer = StorageManager(config, Stats(), namespace="m")
    reader = StorageManager(config, Stats(), namespace="m")
    assert [t.name for t in writer.lower] == ["fs"]
    objs = [fill(pool, i) for i in range(3)]
    for i, obj in enumerate(objs):
        writer.put(key(i), obj)
    assert writer.flush(30)
    assert reader.lookup_prefix([key(i) for i in range(4)]) == 3
    got = reader.get_many([key(i) for i in range(3)])
    assert all(same_bytes(g, objs[i]) for i, g in enumerate(got))
    for obj in got:
        obj.ref_down()
    writer.close()
    reader.close()


def test_held_everywhere_is_answered_from_memory(tmp_path, pool, monkeypatch):
    """Memory, or the index of every lower tier; a remote (no index) is never sure."""
    disk = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 1}
    fs = {"remote_url": f"fs://{tmp_path}/fs"}
    writer = StorageManager(load_config({**disk, **fs}, env={}), Stats(), pin_memory=False)
    obj = fill(pool, 0)
    assert not writer.held_everywhere(key(0))
    writer.put(key(0), obj)
    assert writer.held_everywhere(key(0)), "in memory"
    writer.close()
    for settings, held in (({**disk, **fs}, False), (disk, True), (fs, False)):
        config = load_config({"local_cpu": False, **settings}, env={})
        restarted = StorageManager(config, Stats(), pin_memory=False)
        for tier in restarted.lower:
            monkeypatch.setattr(tier, "contains_many", None)  # no lookup
        assert restarted.held_everywhere(key(0)) is held, settings
        restarted.close()


def test_unusable_local_disk_is_a_clear_error_at_start_up(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="local_disk"):
        make_engine(local_disk=str(blocker / "kvtier"))


@pytest.mark.parametrize("url", ["fs://relative/dir", "fs://"])
def test_shared_filesystem_url_needs_an_absolute_path(url):
    with pytest.raises(ValueError, match="remote_url"):  # refused by the config already
        config = load_config({"max_local_cpu_size": 0.05, "remote_url": url}, env={})
        StorageManager(config, Stats(), namespace="m")


def test_cachegen_on_disk_loads_close_to_what_was_stored(tmp_path):
    first = make_engine(local_disk=str(tmp_path), remote_serde="cachegen", seed=0)
    tokens, src = torch.arange(40), torch.arange(40)
    paged = first.paged_io.paged
    reference = torch.stack([paged.layer_view(i)[:, src // 4, src % 4] for i in range(3)])
    first.store(tokens, slot_mapping=src)
    first.close()
    files = list(tmp_path.rglob("*.kvt"))
    assert len(files) == 5 and all(b"cachegen" in f.read_bytes()[:400] for f in files)
    written = first.stats.get(tier_counter("disk", TierCounter.PUT_BYTES))
    raw = first.stats.get(tier_counter("disk", TierCounter.PUT_RAW_BYTES))
    assert written == sum(f.stat().st_size for f in files)
    # the KV the objects hold before the codec (at 8 tokens a chunk its tables outweigh it)
    assert raw == 5 * reference[:, :, :8].numel() * reference.element_size()

    second = make_engine(local_disk=str(tmp_path), seed=1)  # reads whatever codec was used
    dst = torch.arange(100, 140)
    assert second.retrieve(tokens, slot_mapping=dst) == 40
    paged = second.paged_io.paged
    got = torch.stack([paged.layer_view(i)[:, dst // 4, dst % 4] for i in range(3)])
    # per token, the error is bounded by its absmax over the layer's K (or V) channels
    want = reference.float()
    scale = want.abs().flatten(-2).amax(-1)[..., None, None]
    assert bool(((got.float() - want).abs() <= scale / 16 + scale * 2**-8).all())
    assert second.stats.get(Counter.CORRUPT_CHUNKS) == 0
    second.close()
