"""The local disk tier of ranks that share chunks (``storage.split_disk``): two ranks on
one directory, each with its own chunks in its own directory and one writer of the
shared ones, opened as ``StorageManager`` opens them."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tiers import counter, fill, key, make_pool, same_bytes

from kvtier.config import load_config
from kvtier.observability.stats import Stats, TierCounter
from kvtier.storage.files import SUFFIX
from kvtier.storage.manager import open_lower_tiers
from kvtier.storage.split_disk import SharedDisk, SplitDisk

CHUNK_FILE_BYTES = 2 * 3 * 16 * 64 * 2 + 700  # support.tiers.CHUNK_SHAPE in bf16, and more


def owns(k) -> bool:
    """Keys of rank 1 are a rank's own; those of rank 0 are shared."""
    return k.rank == 1


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def open_rank(root: Path, rank: int, stats: Stats, chunks: float) -> SplitDisk:
    config = load_config(
        {"local_disk": str(root), "max_local_disk_size": chunks * CHUNK_FILE_BYTES / 2**30}, env={}
    )
    shared = SharedDisk(None, owns, writer=rank == 0)
    (tier,) = open_lower_tiers(config, stats, "m", disk_shard=f"rank{rank}of2", shared_disk=shared)
    assert isinstance(tier, SplitDisk)
    return tier


def files(root: Path) -> int:
    return len(list(root.glob("kvtier-v1/**/*" + SUFFIX)))


def test_one_rank_writes_and_bounds_the_shared_chunks_every_rank_reads(tmp_path, pool):
    stats = [Stats(), Stats()]
    writer, reader = (open_rank(tmp_path, r, stats[r], chunks=3.5) for r in (0, 1))
    objs = {seed: fill(pool, seed) for seed in range(6)}
    assert all(writer.submit_put(key(i, rank=0), objs[i]) for i in range(3))
    assert all(reader.submit_put(key(i, rank=0), objs[i]) for i in range(3, 6))  # skipped
    assert reader.submit_put(key(9, rank=1), objs[5])  # its own
    assert writer.flush(30) and reader.flush(30)
    assert counter(stats[1], TierCounter.SKIPPED_REPLICA) == 3
    assert counter(stats[1], TierCounter.PUT_CHUNKS) == 1
    assert files(tmp_path) == 3 and files(tmp_path / "rank1of2") == 1
    # the reader finds the writer's chunks, and adopts none into its bound: nothing evicted
    shared = [key(i, rank=0) for i in range(3)]
    assert reader.contains_many([*shared, key(9, rank=1)]) == [True] * 4
    got = reader.get_many(shared, pool.allocate)
    assert all(g is not None and same_bytes(g, objs[i]) for i, g in enumerate(got))
    assert counter(stats[1], TierCounter.EVICTIONS) == 0 and files(tmp_path) == 3
    assert reader.shared.capacity_bytes is None  # no index of the writer's files to bound
    assert reader.used_bytes == reader.own.used_bytes
    reader.clear()  # its own files; the shared ones are the writer's to clear
    assert files(tmp_path) == 3 and files(tmp_path / "rank1of2") == 0
    writer.close()
    reader.close()


def test_a_rank_indexes_its_own_chunks_and_the_writer_the_shared_ones(tmp_path, pool):
    """``indexed`` (what a store without a CPU tier skips) answers from a rank's own
    index: the writer's for shared chunks; a reader, which indexes none of them, stores
    (and its disk skips) them as before."""
    writer, reader = (open_rank(tmp_path, r, Stats(), chunks=3.5) for r in (0, 1))
    obj = fill(pool, 0)
    assert writer.submit_put(key(0, rank=0), obj) and reader.submit_put(key(9, rank=1), obj)
    assert writer.flush(30) and reader.flush(30)
    assert [writer.indexed(key(0, rank=0)), writer.indexed(key(1, rank=0))] == [True, False]
    assert [reader.indexed(key(0, rank=0)), reader.indexed(key(9, rank=1))] == [False, True]
    writer.close()
    reader.close()
