"""The local disk tier (and the shared-filesystem tier, the same class unbounded) on real
files: round trips, restart, eviction, damaged files, several processes, a full disk."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from support.tiers import counter, fill, in_a_newer_format, key, make_pool, make_tier, same_bytes

from kvtier.observability.stats import Counter, Histogram, Stats, TierCounter, tier_counter
from kvtier.server.blobs import disk_name, open_disk, read_from_disk, write_to_disk
from kvtier.storage import files, wire
from kvtier.storage.disk import FileTier
from kvtier.storage.file_store import FileStore
from kvtier.storage.files import SUFFIX
from kvtier.storage.serde import tensor_bytes
from kvtier.storage.tier import WriteQueue
from kvtier.storage.wire import checksum_of

CHUNK_FILE_BYTES = 2 * 3 * 16 * 64 * 2 + 400  # payload + prefix/header, roughly


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def put_all(tier: FileTier, pool, seeds) -> dict[int, object]:
    objs = {}
    for seed in seeds:
        objs[seed] = fill(pool, seed)
        assert tier.submit_put(key(seed), objs[seed])
    assert tier.flush(30)
    return objs


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*" + SUFFIX))


def test_round_trip_and_lookup(tmp_path, pool):
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    objs = put_all(tier, pool, range(5))
    assert tier.contains_many([key(i) for i in range(7)]) == [True] * 5 + [False] * 2
    got = tier.get_many([key(i) for i in range(7)], pool.allocate)
    for i in range(5):
        assert got[i] is not None and same_bytes(got[i], objs[i]), f"chunk {i}"
        assert got[i].checksum == objs[i].checksum
    assert got[5:] == [None, None]
    assert counter(stats, TierCounter.PUT_CHUNKS) == 5
    assert counter(stats, TierCounter.GET_HITS) == 5
    assert counter(stats, TierCounter.GET_MISSES) == 2
    assert counter(stats, TierCounter.GET_BYTES) == 5 * objs[0].data_nbytes
    assert len(chunk_files(tmp_path)) == 5
    assert not list(tmp_path.rglob("*.tmp"))
    tier.close()


def test_a_batched_get_is_one_latency_observation(tmp_path, pool):
    """Like every tier, the disk times a batched get as a whole (its chunks are read in
    parallel): one histogram observation per batch, hits and misses counted per chunk."""
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    put_all(tier, pool, range(3))
    for obj in tier.get_many([key(i) for i in range(4)], pool.allocate):
        if obj is not None:
            obj.ref_down()
    assert tier.get_many([key(9)], pool.allocate) == [None]
    latency = stats.histograms()[tier_counter("disk", Histogram.TIER_GET)]
    assert latency["count"] == 2
    assert latency["sum"] == counter(stats, TierCounter.GET_SECONDS)
    assert (counter(stats, TierCounter.GET_HITS), counter(stats, TierCounter.GET_MISSES)) == (3, 2)
    tier.close()


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_chunk_read_is_hashed_once_then_checked_again(tmp_path, pool, o_direct, monkeypatch):
    """The tier verifies a chunk's bytes as it reads them; the first load after that takes
    its word (no second hash), every later check hashes the bytes again."""
    tier = make_tier(tmp_path, o_direct=o_direct)
    put_all(tier, pool, [1])
    (got,) = tier.get_many([key(1)], pool.allocate)
    assert got is not None and got.verified
    hashed = []
    monkeypatch.setattr(wire, "checksum_of", lambda *b: hashed.append(1) or checksum_of(*b))
    assert wire.checksum_holds(got) and not hashed
    assert wire.checksum_holds(got) and hashed == [1]
    tensor_bytes(got.tensor)[0] ^= 0xFF  # changed after it was read
    assert not wire.checksum_holds(got)
    got.ref_down()
    tier.close()


def test_writes_hold_the_buffer_until_written(tmp_path, pool):
    tier = make_tier(tmp_path)
    obj = fill(pool, 1)
    expected = bytes(tensor_bytes(obj.tensor))
    assert tier.submit_put(key(1), obj)
    obj.ref_down()  # the caller lets go at once; the queue keeps its own reference
    assert tier.flush(30)
    (back,) = tier.get_many([key(1)], pool.allocate)
    assert bytes(tensor_bytes(back.tensor)) == expected
    tier.close()
    assert pool.used_bytes() == back.nbytes


def test_restart_rebuilds_the_index(tmp_path, pool):
    first = make_tier(tmp_path)
    objs = put_all(first, pool, range(4))
    used = first.used_bytes
    first.close()
    second = make_tier(tmp_path)
    assert len(second) == 4 and second.used_bytes == used
    got = second.get_many([key(i) for i in range(4)], pool.allocate)
    assert all(same_bytes(g, objs[i]) for i, g in enumerate(got))
    second.close()


def test_a_bounded_tier_answers_lookups_from_its_index(tmp_path, pool, monkeypatch):
    """No filesystem call for a name the index knows; a name it does not know (another
    process's file) is asked for; a file deleted behind its back is one failed read, then
    forgotten."""
    tier = make_tier(tmp_path, capacity_bytes=10 * CHUNK_FILE_BYTES)
    put_all(tier, pool, range(3))
    other = make_tier(tmp_path / "other")
    put_all(other, pool, [7])
    (only,) = chunk_files(tmp_path / "other")
    target = tier.path_of(tier.file_name(key(7)))
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(only, target)  # as if another process sharing the directory wrote it
    stats_seen = []
    real_stat = os.stat
    monkeypatch.setattr(
        os, "stat", lambda path, *a, **k: stats_seen.append(path) or real_stat(path, *a, **k)
    )
    assert tier.contains_many([key(0), key(1), key(2)]) == [True] * 3
    assert stats_seen == []
    assert tier.contains_many([key(7), key(9)]) == [True, False]
    assert len(stats_seen) == 2
    assert tier.contains_many([key(7)]) == [True] and len(stats_seen) == 2  # now indexed
    monkeypatch.undo()
    tier.path_of(tier.file_name(key(1))).unlink()  # deleted behind the index's back
    assert tier.contains_many([key(1)]) == [True]
    assert tier.get_many([key(1)], pool.allocate) == [None]
    assert tier.contains_many([key(1)]) == [False]
    other.close()
    tier.close()


def test_capacity_evicts_in_lru_order(tmp_path, pool):
    stats = Stats()
    tier = make_tier(tmp_path, stats, capacity_bytes=int(3.5 * CHUNK_FILE_BYTES))
    for seed in range(3):  # one at a time: two writer threads may finish in any order
        put_all(tier, pool, [seed])
    tier.get_many([key(0)], pool.allocate)  # 0 becomes the most recently used
    put_all(tier, pool, [3])
    assert tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
    assert counter(stats, TierCounter.EVICTIONS) == 1
    assert tier.used_bytes <= tier.capacity_bytes
    assert sum(p.stat().st_size for p in chunk_files(tmp_path)) == tier.used_bytes
    tier.close()


def test_the_tree_s_directories_are_counted_beside_the_files_bytes(tmp_path, pool):
    """The bound is on the files' bytes; the directories, which stay as files are
    evicted or deleted, are counted as they are on disk, after a restart too."""

    def on_disk() -> int:
        return sum(len(dirs) for _, dirs, _ in os.walk(tmp_path / "kvtier-v1"))

    tier = make_tier(tmp_path, capacity_bytes=int(2.5 * CHUNK_FILE_BYTES))
    for seed in range(6):
        put_all(tier, pool, [seed])
    assert len(chunk_files(tmp_path)) == 2
    assert tier.directories == on_disk() > 2 * 2, "the evicted files' too"
    tier.remove(key(5))
    assert tier.directories == on_disk()
    tier.close()
    restarted = make_tier(tmp_path, capacity_bytes=int(2.5 * CHUNK_FILE_BYTES))
    assert restarted.directories == on_disk()
    put_all(restarted, pool, [6])
    assert restarted.directories == on_disk()
    restarted.close()


def test_a_chunk_stored_again_is_a_use_for_eviction_order(tmp_path, pool):
    """A prefill engine that never loads stores its hot prefix again and again: each
    store is a use, so the prefix outlives chunks stored once since."""
    tier = make_tier(tmp_path, capacity_bytes=int(3.5 * CHUNK_FILE_BYTES))
    for seed in range(3):
        put_all(tier, pool, [seed])
    put_all(tier, pool, [0])  # stored again: 0 becomes the most recently used
    put_all(tier, pool, [3])
    assert tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
    tier.close()


def test_a_chunk_written_again_is_indexed_at_its_new_size(tmp_path, pool):
    """A file deleted behind the index's back and written again, now larger: the index
    holds the new file's size (``SizedIndex`` replaces an entry), so ``used_bytes``
    stays the bytes on disk."""
    tier = make_tier(tmp_path, capacity_bytes=10 * CHUNK_FILE_BYTES)
    small = pool.allocate((2, 3, 8, 64), torch.bfloat16)
    small.tensor.zero_()
    assert tier.submit_put(key(1), small) and tier.flush(30)
    small.ref_down()
    tier.path_of(tier.file_name(key(1))).unlink()
    put_all(tier, pool, [1])  # a whole chunk under the same key
    assert len(tier) == 1
    assert tier.used_bytes == sum(p.stat().st_size for p in chunk_files(tmp_path))
    tier.close()


def test_restart_enforces_a_smaller_capacity(tmp_path, pool):
    first = make_tier(tmp_path)
    put_all(first, pool, range(4))
    for i in range(4):  # chunk i was written i minutes after chunk 0
        path = first.path_of(first.file_name(key(i)))
        os.utime(path, (time.time() - 600 + 60 * i,) * 2)
    first.close()
    second = make_tier(tmp_path, capacity_bytes=int(2.5 * CHUNK_FILE_BYTES))
    assert len(second) == 2 and len(chunk_files(tmp_path)) == 2
    assert second.contains_many([key(i) for i in range(4)]) == [False, False, True, True]
    second.close()


def test_chunk_larger_than_the_disk_is_skipped(tmp_path, pool, caplog):
    stats = Stats()
    tier = make_tier(tmp_path, stats, capacity_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
        put_all(tier, pool, [1, 2])
    assert counter(stats, TierCounter.DROPPED_NO_SPACE) == 2
    assert chunk_files(tmp_path) == []
    # A bound that can hold no chunk at all is said once, not left to a counter.
    [warning] = caplog.records
    assert "larger than the whole bound" in warning.message
    assert "max_local_disk_size" in warning.message
    tier.close()


@pytest.mark.parametrize(
    "damage", ["bit_flip", "truncated", "empty", "other_key", "garbage", "empty_shape"]
)
def test_damaged_file_is_a_counted_miss_and_deleted(tmp_path, pool, damage, caplog):
    stats = Stats()
    tier = make_tier(tmp_path, stats)
    put_all(tier, pool, [1, 2])
    path = tier.path_of(tier.file_name(key(1)))
    data = bytearray(path.read_bytes())
    if damage == "bit_flip":
        data[-10] ^= 0x40
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "empty_shape":  # a consistent object of no bytes, with a dimension of 0
        name = key(1).to_string()
        empty = wire.encode_header(
            name, wire.CHUNK_LAYOUT, torch.bfloat16, (2, 0, 16, 64), "naive", {},
            payload_len=0, checksum=checksum_of(b""),
        )  # fmt: skip
        data = bytearray(empty)
    else:
        data = bytearray(tier.path_of(tier.file_name(key(2))).read_bytes())
    path.write_bytes(bytes(data))
    used = pool.used_bytes()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
        assert tier.get_many([key(1)], pool.allocate) == [None]
    assert pool.used_bytes() == used
    assert counter(stats, TierCounter.CORRUPT) == 1
    assert stats.get(Counter.CORRUPT_CHUNKS) == 1
    assert not path.exists()
    assert tier.contains_many([key(1), key(2)]) == [False, True]
    assert any("corrupt" in r.message for r in caplog.records)
    tier.close()


@pytest.mark.parametrize("capacity", [1 << 30, None], ids=["disk", "fs"])
def test_files_of_a_newer_kvtier_are_misses_said_once_and_deleted(tmp_path, pool, capacity, caplog):
    """A disk written by a newer kvtier (a downgrade, or an fs:// tree a newer engine
    shares): every file is a miss and is deleted, counted apart from damage, with one
    warning for all of them."""
    stats = Stats()
    name = "fs" if capacity is None else "disk"  # each warned once in the process
    tier = make_tier(tmp_path, stats, capacity_bytes=capacity, name=name)
    put_all(tier, pool, range(4))
    paths = [tier.path_of(tier.file_name(key(i))) for i in range(4)]
    for path in paths:
        path.write_bytes(in_a_newer_format(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.get_many([key(i) for i in range(4)], pool.allocate) == [None] * 4
    assert counter(stats, TierCounter.NEWER_FORMAT, tier.name) == 4
    assert counter(stats, TierCounter.CORRUPT, tier.name) == 0
    assert stats.get(Counter.CORRUPT_CHUNKS) == 0
    assert not any(path.exists() for path in paths)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "stored by a newer kvtier" in warnings[0], warnings
    tier.close()


def test_a_chunk_file_that_cannot_be_deleted_is_warned_about_not_raised(
    tmp_path, pool, monkeypatch, caplog
):
    """Dropping a chunk (a load found it corrupt) from a tree that refuses the delete: a
    warning, and the chunk is forgotten; no exception reaches the load."""
    tier = make_tier(tmp_path)
    put_all(tier, pool, [0])

    def refused(name):
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(tier.files, "delete", refused)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
        assert tier.remove(key(0)) is False
    assert "cannot delete" in caplog.text and "Permission denied" in caplog.text
    tier.close()


@pytest.mark.parametrize("capacity", [1 << 30, None], ids=["disk", "fs"])
def test_a_directory_in_a_chunk_files_place_is_a_miss(tmp_path, pool, capacity):
    """Something else at a chunk's path (here a directory) is no chunk: a lookup misses,
    and a store of the chunk is tried (and counted when it fails), not skipped as done."""
    stats = Stats()
    writer = make_tier(tmp_path, capacity_bytes=capacity)
    put_all(writer, pool, [1])
    writer.close()
    path = writer.path_of(writer.file_name(key(1)))
    path.unlink()
    path.mkdir()
    tier = make_tier(tmp_path, stats, capacity_bytes=capacity)
    assert tier.contains_many([key(1)]) == [False]
    put_all(tier, pool, [1])
    assert counter(stats, TierCounter.DROPPED_ERROR) == 1
    assert tier.contains_many([key(1)]) == [False]
    tier.close()


def test_a_writer_never_writes_into_a_temp_file_it_did_not_create(tmp_path):
    """``write_whole``, how the disk tier and the node server write files, creates its
    temp file exclusively: on a directory shared by several machines or containers, a
    writer whose pid and thread id repeat another's fails its write rather than mixing
    its bytes into the other's file."""
    path = tmp_path / "ab" / "cd" / "abcd.kvt"
    path.parent.mkdir(parents=True)
    theirs = path.parent / f".abcd.{os.getpid()}.{threading.get_ident()}.tmp"
    theirs.write_bytes(b"another writer's bytes")
    with pytest.raises(FileExistsError):
        files.write_whole(path, [b"mine"])
    assert theirs.read_bytes() == b"another writer's bytes" and not path.exists()
    theirs.unlink()
    assert files.write_whole(path, [b"mi", b"ne"]) is None
    assert path.read_bytes() == b"mine" and list(path.parent.iterdir()) == [path]


def test_stale_temp_files_are_cleaned_at_start(tmp_path, pool):
    tier = make_tier(tmp_path)
    put_all(tier, pool, [1])
    tier.close()
    shard = chunk_files(tmp_path)[0].parent
    stale, fresh = shard / ".abc.1.2.tmp", shard / ".def.1.2.tmp"
    stale.write_bytes(b"half a chunk")
    fresh.write_bytes(b"a write in progress elsewhere")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    make_tier(tmp_path).close()
    assert not stale.exists() and fresh.exists()


def test_files_of_another_writer_are_adopted(tmp_path, pool):
    reader = make_tier(tmp_path)
    writer = make_tier(tmp_path)
    objs = put_all(writer, pool, [1, 2])
    assert len(reader) == 0
    assert reader.contains_many([key(1), key(2)]) == [True, True]
    assert len(reader) == 2
    (got,) = reader.get_many([key(2)], pool.allocate)
    assert same_bytes(got, objs[2])
    reader.close()
    writer.close()


def test_files_of_another_writer_are_adopted_within_the_bound(tmp_path, pool):
    """Each process bounds the files it knows: adopting another writer's file evicts in
    policy order as a write does, and a file this lookup evicted is absent in its answer."""
    stats = Stats()
    reader = make_tier(tmp_path, stats, capacity_bytes=int(2.5 * CHUNK_FILE_BYTES))
    writer = make_tier(tmp_path)
    put_all(reader, pool, [0])
    put_all(writer, pool, [1, 2, 3])
    assert reader.contains_many([key(0), key(1), key(2), key(3)]) == [False, False, True, True]
    assert len(reader) == 2 and reader.used_bytes <= reader.capacity_bytes
    assert counter(stats, TierCounter.EVICTIONS) == 2
    assert reader.contains_many([key(0), key(1)]) == [False, False]  # evicted: deleted
    reader.close()
    writer.close()


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from support.tiers import fill, key, make_pool
    from kvtier.observability.stats import Stats
    from kvtier.storage.disk import FileTier
    from kvtier.storage.serde import NaiveSerde
    tier = FileTier({root!r}, capacity_bytes=1 << 30, serde=NaiveSerde(), stats=Stats(),
                    workers=4)
    pool = make_pool(64)
    for round in range(3):
        for seed in range({first}, {last}):
            obj = fill(pool, seed)
            tier.submit_put(key(seed), obj)
            obj.ref_down()
        tier.flush(60)
        tier.clear() if round < 2 and {clears} else None
    tier.close()
    """
)


def test_two_processes_share_one_directory(tmp_path, pool):
    tests = str(Path(__file__).parent)
    scripts = [
        WRITER.format(tests=tests, root=str(tmp_path), first=0, last=30, clears=False),
        WRITER.format(tests=tests, root=str(tmp_path), first=10, last=40, clears=False),
    ]
    procs = [subprocess.Popen([sys.executable, "-c", s]) for s in scripts]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    tier = make_tier(tmp_path)
    assert len(tier) == 40
    got = tier.get_many([key(i) for i in range(40)], pool.allocate)
    for i, obj in enumerate(got):
        expected = fill(pool, i)
        assert obj is not None and same_bytes(obj, expected), f"chunk {i}"
        obj.ref_down()
        expected.ref_down()
    assert not list(tmp_path.rglob("*.tmp"))
    tier.close()


ENDLESS_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from support.tiers import fill, key, make_pool
    from kvtier.observability.stats import Stats
    from kvtier.storage.disk import FileTier
    from kvtier.storage.serde import NaiveSerde
    tier = FileTier({root!r}, capacity_bytes=1 << 30, serde=NaiveSerde(), stats=Stats(),
                    workers=2)
    pool = make_pool(256)
    shape = (2, 8, 256, 512)  # 4 MiB chunks: each write takes a while
    print("ready", flush=True)
    for seed in range(10_000):
        obj = fill(pool, seed, shape=shape)
        while not tier.submit_put(key(seed), obj):
            tier.flush(1)
        obj.ref_down()
    """
)


def test_a_writer_killed_mid_write_leaves_only_whole_files(tmp_path, pool):
    import signal

    script = ENDLESS_WRITER.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 60
    while len(chunk_files(tmp_path)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-run: writes are in flight
    proc.wait(timeout=30)
    written = chunk_files(tmp_path)
    assert len(written) >= 5

    stats = Stats()
    restarted = make_tier(tmp_path, stats)  # a restart indexes only complete files
    assert len(restarted) == len(written)
    seeds = range(len(written) + 40)
    present = restarted.contains_many([key(i) for i in seeds])
    big = make_pool(256)
    for i, there in zip(seeds, present, strict=True):
        if not there:
            continue
        (got,) = restarted.get_many([key(i)], big.allocate)
        expected = fill(big, i, shape=(2, 8, 256, 512))
        assert got is not None and same_bytes(got, expected), f"chunk {i} is not whole"
        got.ref_down()
        expected.ref_down()
    assert stats.get(tier_counter("disk", TierCounter.CORRUPT)) == 0
    # The restarted tier goes on writing; a stray temp file of the killed writer is ignored.
    objs = put_all(restarted, pool, [100_000])
    (got,) = restarted.get_many([key(100_000)], pool.allocate)
    assert same_bytes(got, objs[100_000])
    restarted.close()
    big.close()


@pytest.mark.parametrize("o_direct", [False, True])
def test_o_direct_round_trip(tmp_path, pool, o_direct, caplog):
    tier = make_tier(tmp_path, o_direct=o_direct)
    objs = put_all(tier, pool, range(3))
    got = tier.get_many([key(i) for i in range(3)], pool.allocate)
    assert all(same_bytes(g, objs[i]) for i, g in enumerate(got))
    # O_DIRECT writes whole 4 KiB blocks; the file is cut back to the object's length.
    put_bytes = counter(tier.stats, TierCounter.PUT_BYTES)
    assert sum(p.stat().st_size for p in chunk_files(tmp_path)) == put_bytes
    assert put_bytes % 4096 != 0
    tier.close()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_disk_smaller_than_the_bound_evicts_when_full(tmp_path, pool, caplog):
    stats = Stats()
    with small_tmpfs(tmp_path / "small", "64k") as root:
        # The tier believes it has 1 GiB; the filesystem runs out after a few chunks. A
        # full filesystem evicts the oldest files as a full bound does: new chunks are
        # stored, none dropped.
        tier = make_tier(root, stats)
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
            objs = put_all(tier, pool, range(20))
        assert counter(stats, TierCounter.PUT_CHUNKS) == 20
        assert counter(stats, TierCounter.DROPPED_NO_SPACE) == 0
        evicted = counter(stats, TierCounter.EVICTIONS)
        assert evicted > 0 and counter(stats, TierCounter.EVICTIONS_NO_SPACE) == evicted
        assert [r.message for r in caplog.records if "is full before its bound" in r.message]
        assert len(caplog.records) == 1 and not list(root.rglob("*.tmp"))  # warned once
        present = tier.contains_many([key(i) for i in range(20)])
        assert present[-1] and not present[0]
        assert tier.used_bytes == sum(p.stat().st_size for p in chunk_files(root))
        assert len(tier) == sum(present)
        [got] = tier.get_many([key(19)], pool.allocate)
        assert same_bytes(got, objs[19])
        tier.close()


def test_a_disk_full_of_other_files_skips_stores(tmp_path, pool, caplog):
    stats = Stats()
    with small_tmpfs(tmp_path / "small", "64k") as root:
        tier = make_tier(root, stats)
        with contextlib.suppress(OSError), open(root / "ballast", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        # The tier holds no file whose eviction would make room: the stores are dropped.
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
            put_all(tier, pool, range(5))
        assert counter(stats, TierCounter.PUT_CHUNKS) == 0
        assert counter(stats, TierCounter.DROPPED_NO_SPACE) == 5
        assert sum("full" in r.message for r in caplog.records) == 1  # logged once
        assert not list(root.rglob("*.tmp"))
        assert tier.used_bytes == 0 and len(tier) == 0
        # Once there is room again, stores go through and are served.
        (root / "ballast").unlink()
        objs = put_all(tier, pool, [0])
        [got] = tier.get_many([key(0)], pool.allocate)
        assert same_bytes(got, objs[0])
        tier.close()


def test_a_read_only_disk_is_one_warning_and_keeps_serving(tmp_path, pool, caplog):
    stats = Stats()
    with small_tmpfs(tmp_path / "small", "1m") as root:
        tier = make_tier(root, stats)
        objs = put_all(tier, pool, [0])
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.disk"):
            put_all(tier, pool, range(1, 6))
        assert counter(stats, TierCounter.DROPPED_ERROR) == 5
        assert len(caplog.records) == 1, "one warning for the cause, not one per chunk"
        assert "Read-only file system" in caplog.records[0].message
        [got] = tier.get_many([key(0)], pool.allocate)
        assert same_bytes(got, objs[0])
        tier.close()


def test_unusable_directory_names_the_key(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="local_disk"):
        make_tier(blocker / "sub")


def test_full_write_queue_drops_and_counts(pool):
    stats = Stats()
    release = threading.Event()
    written = []

    def slow_handler(batch):
        release.wait(10)
        written.extend(k for k, _ in batch)

    queue = WriteQueue("disk", slow_handler, stats, workers=1, capacity=2)
    objs = [fill(pool, i) for i in range(4)]
    accepted = [queue.submit(key(i), objs[i]) for i in range(4)]
    assert accepted == [True, True, False, False]
    assert counter(stats, TierCounter.DROPPED_QUEUE_FULL) == 2
    assert objs[0].ref_count == 2 and objs[3].ref_count == 1  # queued items hold a ref
    release.set()
    assert queue.flush(10)
    queue.close()
    assert written == [key(0), key(1)]
    assert all(obj.ref_count == 1 for obj in objs)


def test_shared_fs_tier_is_unbounded_and_sees_every_writer(tmp_path, pool):
    writer = make_tier(tmp_path, name="fs", capacity_bytes=None)
    reader = make_tier(tmp_path, name="fs", capacity_bytes=None)
    objs = put_all(writer, pool, range(3))
    assert reader.contains_many([key(i) for i in range(4)]) == [True, True, True, False]
    got = reader.get_many([key(i) for i in range(3)], pool.allocate)
    assert all(same_bytes(g, objs[i]) for i, g in enumerate(got))
    reader.clear()
    assert chunk_files(tmp_path) == []
    writer.close()
    reader.close()


# -- the byte store under the disk tier and the server's disk ---------------------------


def test_a_file_store_keeps_names_under_prefixes_across_a_restart(tmp_path):
    """The server's disk names a blob ``<namespace hash>/<name hash>``: its file sits in
    the sharded tree under the prefix, a restart indexes it under the same name, and a
    clear of one prefix deletes that prefix's files only."""
    a, b = "aa/" + "0123" * 8, "bb/" + "4567" * 8
    first = FileStore(tmp_path, "t", capacity_bytes=10_000, describe="test")
    assert first.write(a, [b"x" * 100]) and first.write(b, [b"y" * 200])
    assert Path(first.path(a)) == tmp_path / "t" / "aa" / "01" / "23" / f"{'0123' * 8}.kvt"
    second = FileStore(tmp_path, "t", capacity_bytes=10_000, describe="test")
    assert len(second) == 2 and second.used_bytes == 300
    assert second.clear("aa") == 1
    assert second.contains_many([a, b]) == [False, True] and second.used_bytes == 200
    assert not second.write("cc/" + "89ab" * 8, [bytes(10_001)])  # larger than the bound


def test_a_killed_server_s_temp_file_is_removed_at_a_later_start_once_old(tmp_path):
    """`kvtier serve --local-disk` killed mid-write leaves its temp file in the blob's
    shard (under the namespace's directory): the next start removes it once it is an hour
    old, and leaves a younger one (another process's write in progress) alone."""
    disk = open_disk(str(tmp_path), 1 << 20)
    assert write_to_disk(disk, ("ns", "k"), b"blob")
    shard = Path(disk.path(disk_name(("ns", "k")))).parent
    stale, fresh = shard / ".dead.1.2.tmp", shard / ".live.3.4.tmp"
    stale.write_bytes(b"half a blob")
    fresh.write_bytes(b"a write in progress elsewhere")
    old = time.time() - files.STALE_TMP_SECONDS - 60
    os.utime(stale, (old, old))
    restarted = open_disk(str(tmp_path), 1 << 20)
    assert not stale.exists() and fresh.exists()
    assert read_from_disk(restarted, ("ns", "k")) == b"blob" and len(restarted) == 1


def test_the_server_disk_finds_a_blob_file_it_did_not_index(tmp_path):
    """Settled once for every bounded file store: a name the index does not know is
    asked of the filesystem and adopted (the engine's disk tier always did; the server's
    disk answered from its index alone). One ``stat`` per such miss."""
    server_disk = open_disk(str(tmp_path), 1 << 20)
    other = open_disk(str(tmp_path), 1 << 20)  # another writer on the same directory
    assert write_to_disk(other, ("ns", "k"), b"blob")
    assert read_from_disk(server_disk, ("ns", "k")) == b"blob"
    assert len(server_disk) == 1
    assert server_disk.delete(disk_name(("ns", "k")))
    assert read_from_disk(other, ("ns", "k")) is None and len(other) == 0


@pytest.mark.parametrize("meanwhile", ["evicted", "deleted"])
def test_a_file_evicted_or_deleted_while_written_does_not_stay_behind(
    tmp_path, monkeypatch, meanwhile
):
    """Writes run on several threads (the disk tier's writers, the server's request
    threads): one may evict (or a client delete) a name whose file another is still
    writing. That file must not land afterwards outside the index, where it would hold
    disk beyond the bound, unseen, until a restart."""
    from kvtier.storage import file_store

    slow, go = "a" * 32, threading.Event()
    writing = threading.Event()

    def write_whole(path, parts, **kwargs):
        if path.stem == slow:
            writing.set()
            go.wait(10)
        return files.write_whole(path, parts, **kwargs)

    monkeypatch.setattr(file_store, "write_whole", write_whole)
    store = FileStore(tmp_path, "t", capacity_bytes=2_500, describe="test")
    writer = threading.Thread(target=store.write, args=(slow, [b"1" * 1000]))
    writer.start()
    assert writing.wait(10)
    if meanwhile == "evicted":  # the oldest, the slow one, makes room for the third
        assert store.write("b" * 32, [b"2" * 1000]) and store.write("c" * 32, [b"3" * 1000])
    else:
        store.delete(slow)
    go.set()
    writer.join(10)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "t").rglob(f"*{SUFFIX}"))
    assert on_disk == store.used_bytes <= store.capacity_bytes
    assert not Path(store.path(slow)).exists()
