"""kvtier as SGLang's HiCache storage backend, driven through SGLang's own code: the
dynamic backend factory, ``HiCacheStorageConfig`` and the real MHA / MLA host pools (on a
CPU), calling what SGLang's cache controller calls (docs/sglang.md).

Runs in .venv-sglang (``make test-sglang``); skipped where SGLang is not installed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang is not installed here: these tests run in .venv-sglang (make test-sglang)",
)

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.observability.metrics_collector import StorageMetrics
from support.redis_server import REDIS_MISSING, RedisServer, redis_available
from support.sglang_hicache import (
    LAYOUTS,
    assert_pages_equal,
    make_backend,
    mha_pool,
    mla_pool,
    page_indices,
    randomize,
)
from support.tiers import wait_until

from kvtier.config import ConfigError
from kvtier.integration.sglang import KVTierHiCacheStorage
from kvtier_kernels.dtypes import bits

KEYS = [f"{i:064x}" for i in range(1, 9)]  # SGLang's page keys are sha256 hex digests
POOLS = {"mha": mha_pool, "mla": mla_pool}


def disk(tmp_path: Path, **extra) -> dict:
    return {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 1, **extra}


@pytest.fixture
def cpu_only() -> dict:
    return {"max_local_cpu_size": 0.05}


def test_the_factory_builds_it_with_sglangs_own_keys(tmp_path):
    pool = mha_pool("page_first")
    backend = make_backend(pool, disk(tmp_path))
    assert isinstance(backend, KVTierHiCacheStorage) and isinstance(backend, HiCacheStorage)
    assert backend.config.local_disk == str(tmp_path / "disk")
    backend.close()


def test_an_unknown_kvtier_key_is_rejected_by_name():
    with pytest.raises(ConfigError, match="chunk_sise"):
        make_backend(mha_pool("page_first"), {"chunk_sise": 64})


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_v1_round_trip_is_bit_exact(tmp_path, kind, layout, tiers):
    pool = POOLS[kind](layout)
    extra = disk(tmp_path, local_cpu=False) if tiers == "disk" else {}
    backend = make_backend(pool, extra)
    assert backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])) == [True] * 3
    assert backend.batch_get_v1(KEYS[:3], page_indices(pool, [9, 10, 11])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 3], pool, [9, 10, 11])
    backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_stored_from_one_layout_load_into_another(tmp_path, kind):
    """Pages are stored in kvtier's canonical layout, not the host pool's."""
    source = POOLS[kind]("page_first")
    writer = make_backend(source, disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:2], page_indices(source, [3, 4])))
    for layout in ("layer_first", "page_first_direct"):
        target = POOLS[kind](layout)
        randomize(target, seed=7)
        reader = make_backend(target, disk(tmp_path))
        assert reader.batch_get_v1(KEYS[:2], page_indices(target, [5, 6])) == [True, True]
        assert_pages_equal(source, [3, 4], target, [5, 6])
        reader.close()
    writer.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_dcp_ranks_store_their_share_of_logical_pages(tmp_path, layout, tiers):
    """Under decode context parallelism SGLang's host indices run a logical page
    (``logical_page_size``) to a page, of which each DCP rank's pool holds its share:
    each page loads bit-exact, each DCP rank has its own pages, and the same DCP rank
    of another DCP group shares them (MLA)."""
    extra = disk(tmp_path, local_cpu=False) if tiers == "disk" else {}
    rank0 = mla_pool(layout, page_size=8, dcp_size=2, dcp_rank=0)
    rank1 = mla_pool(layout, page_size=8, dcp_size=2, dcp_rank=1)
    randomize(rank1, seed=1)
    backend0 = make_backend(rank0, extra, tp_rank=0, tp_size=4)
    backend1 = make_backend(rank1, extra, tp_rank=1, tp_size=4)
    assert backend0.batch_set_v1(KEYS[:3], page_indices(rank0, [1, 2, 3])) == [True] * 3
    assert backend1.batch_exists(KEYS[:3]) == 0  # rank 1 holds the other half of each page
    assert backend0.batch_get_v1(KEYS[:3], page_indices(rank0, [9, 10, 11])) == [True] * 3
    assert_pages_equal(rank0, [1, 2, 3], rank0, [9, 10, 11])
    if tiers == "disk":
        rank2 = mla_pool(layout, page_size=8, dcp_size=2, dcp_rank=0)
        randomize(rank2, seed=2)
        backend2 = make_backend(rank2, extra, tp_rank=2, tp_size=4)
        assert backend2.batch_get_v1(KEYS[:3], page_indices(rank2, [4, 5, 6])) == [True] * 3
        assert_pages_equal(rank0, [1, 2, 3], rank2, [4, 5, 6])
        backend2.close()
    counters = backend0.metrics()["counters"]
    assert counters["retrieve_hit_tokens"] == 3 * 8 and counters["stored_tokens"] == 3 * 8
    backend0.close()
    backend1.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_path_round_trip_and_mixes_with_v1(cpu_only, kind, layout):
    """SGLang's generic path (flat data pages; ``_generic_page_set`` / ``_generic_page_get``)
    stores the same pages as the v1 path."""
    pool = POOLS[kind](layout)
    backend = make_backend(pool, cpu_only)
    size = pool.page_size
    assert backend.batch_set(KEYS[:2], [pool.get_data_page(p * size) for p in (1, 2)])
    assert backend.set(KEYS[2], pool.get_data_page(3 * size))
    pages = backend.batch_get(KEYS[:3], [pool.get_dummy_flat_data_page() for _ in range(3)])
    for page, dst in zip(pages, (7, 8, 9), strict=True):
        pool.set_from_flat_data_page(dst * size, page)
    assert_pages_equal(pool, [1, 2, 3], pool, [7, 8, 9])
    # v1 reads what the generic path wrote, and the other way round
    assert backend.batch_get_v1(KEYS[:3], page_indices(pool, [10, 11, 12])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 3], pool, [10, 11, 12])
    assert backend.batch_set_v1([KEYS[5]], page_indices(pool, [4]))
    pool.set_from_flat_data_page(13 * size, backend.get(KEYS[5], pool.get_dummy_flat_data_page()))
    assert_pages_equal(pool, [4], pool, [13])
    assert backend.get(KEYS[7]) is None
    backend.close()


def test_batch_exists_counts_leading_pages(cpu_only):
    pool = mha_pool("layer_first")
    backend = make_backend(pool, cpu_only)
    assert backend.batch_exists(KEYS[:4]) == 0
    backend.batch_set_v1([KEYS[0], KEYS[1], KEYS[3]], page_indices(pool, [1, 2, 3]))
    assert backend.batch_exists(KEYS[:4]) == 2  # KEYS[2] is missing: KEYS[3] does not count
    assert backend.batch_exists([KEYS[3], KEYS[0]]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.exists(KEYS[3]) and not backend.exists(KEYS[2])
    counters = backend.metrics()["counters"]
    assert counters["lookup_requests"] == 6 and counters["lookup_hit_tokens"] == 5 * pool.page_size
    backend.close()


def test_a_lookup_prefetches_no_more_pages_than_one_load_can_stage(tmp_path):
    """A lookup moves at most as many pages into the CPU pool as it holds (here 3 of 6):
    a load reads no more at once."""
    pool = mha_pool("layer_first")
    writer = make_backend(pool, disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:6], page_indices(pool, [1, 2, 3, 4, 5, 6])))
    page_bytes = 2 * 2 * 4 * 160 * 2  # K/V x layers x tokens x heads*head size x bf16
    reader = make_backend(pool, disk(tmp_path, max_local_cpu_size=3 * page_bytes / 2**30))
    disk_tier = reader.storage.lower[0]
    read, disk_get_many = [], disk_tier.get_many
    disk_tier.get_many = lambda keys, allocate: read.extend(keys) or disk_get_many(keys, allocate)
    assert reader.batch_exists(KEYS[:6]) == 6
    wait_until(lambda: reader.metrics()["counters"]["prefetched_chunks"] == 3)
    time.sleep(0.2)  # nothing more is on its way
    assert len(read) == 3, f"the lookup read {len(read)} pages for a pool of 3"
    assert reader.batch_get_v1(KEYS[:3], page_indices(pool, [11, 12, 13])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 3], pool, [11, 12, 13])
    writer.close()
    reader.close()


def test_lookups_in_a_row_prefetch_no_more_pages_than_the_pool_holds(tmp_path):
    """SGLang's prefetch thread looks up request after request before their loads: the
    pages in flight of all those lookups together stay within the CPU pool (here 3 of 9),
    and every load still finds its pages."""
    pool = mha_pool("layer_first")
    writer = make_backend(pool, disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:6], page_indices(pool, [1, 2, 3, 4, 5, 6])))
    assert all(writer.batch_set_v1(KEYS[6:], page_indices(pool, [7, 7])))
    page_bytes = 2 * 2 * 4 * 160 * 2
    reader = make_backend(pool, disk(tmp_path, max_local_cpu_size=3 * page_bytes / 2**30))
    disk_tier = reader.storage.lower[0]
    disk_get_many, reads = disk_tier.get_many, threading.Event()

    def slow_get_many(keys, allocate):
        reads.wait(5)  # the lookups all come before a prefetch has read anything
        return disk_get_many(keys, allocate)

    disk_tier.get_many = slow_get_many
    assert [reader.batch_exists(KEYS[i : i + 3]) for i in (0, 3, 6)] == [3, 3, 2]
    in_flight = len(reader.storage._prefetching)
    reads.set()
    assert in_flight == 3, f"{in_flight} pages in flight for a pool of 3"
    wait_until(lambda: not reader.storage._prefetching)
    counters = reader.metrics()["counters"]
    assert counters["prefetched_chunks"] == 3 and counters["allocation_failures"] == 0
    for first in (0, 3):
        slots = [11 + first, 12 + first, 13 + first]
        assert reader.batch_get_v1(KEYS[first : first + 3], page_indices(pool, slots)) == [True] * 3
        assert_pages_equal(pool, [1 + first, 2 + first, 3 + first], pool, slots)
    writer.close()
    reader.close()


PAGE_BYTES = 2 * 2 * 4 * 160 * 2  # mha_pool's: K/V x layers x tokens x heads*head size x bf16


def test_a_store_of_more_pages_than_the_cpu_pool_holds_is_whole(tmp_path):
    """SGLang's controller stores many pages per call (``STORAGE_BATCH_SIZE``): each goes
    to the disk, however few of them the CPU pool holds at once (here 3 of 8)."""
    pool = mha_pool("layer_first")
    writer = make_backend(pool, disk(tmp_path, max_local_cpu_size=3 * PAGE_BYTES / 2**30))
    assert writer.batch_set_v1(KEYS, page_indices(pool, range(1, 9))) == [True] * 8
    assert writer.metrics()["counters"]["disk_put_chunks"] == 8
    writer.close()


def test_a_load_of_more_pages_than_the_cpu_pool_holds_is_whole(tmp_path):
    """A load reads its disk pages into the CPU pool in rounds it holds (here 3 of 8),
    each written into the host pool before the next, so no page past the pool's size
    fails."""
    pool = mha_pool("layer_first")
    writer = make_backend(pool, disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS, page_indices(pool, range(1, 9))))
    reader = make_backend(pool, disk(tmp_path, max_local_cpu_size=3 * PAGE_BYTES / 2**30))
    assert reader.batch_exists(KEYS) == 8
    assert reader.batch_get_v1(KEYS, page_indices(pool, range(11, 19))) == [True] * 8
    assert_pages_equal(pool, range(1, 9), pool, range(11, 19))
    assert reader.metrics()["counters"]["retrieve_hit_tokens"] == 8 * 4
    writer.close()
    reader.close()


@pytest.mark.parametrize("tiers", ["cpu", "cpu+disk", "disk"])
def test_a_page_twice_in_one_batch_is_stored_once_and_reported_stored(tmp_path, tiers):
    """SGLang's backup counts a batch as written only if every page reports True."""
    extra = {"cpu": {}, "cpu+disk": disk(tmp_path), "disk": disk(tmp_path, local_cpu=False)}
    pool = mha_pool("page_first")
    backend = make_backend(pool, extra[tiers])
    keys = [KEYS[0], KEYS[1], KEYS[0]]
    assert backend.batch_set_v1(keys, page_indices(pool, [1, 2, 1])) == [True] * 3
    assert backend.metrics()["counters"]["stored_chunks"] == 2
    assert backend.batch_get_v1(keys, page_indices(pool, [5, 6, 7])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 1], pool, [5, 6, 7])
    assert backend.batch_set(keys, [pool.get_data_page(p * pool.page_size) for p in (3, 4, 3)])
    backend.close()


def test_a_store_asks_no_lower_tier_and_fills_the_one_that_lacks_a_page(tmp_path):
    """What a store leaves out is answered from memory (no lookup on SGLang's backup
    thread); each tier's writer leaves out what it has. So a remote added beside a disk
    that holds pages gets them at their next store."""
    pool = mha_pool("page_first")
    first = make_backend(pool, disk(tmp_path))
    assert first.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])) == [True] * 3
    first.close()
    fs = f"fs://{tmp_path}/fs"
    second = make_backend(pool, disk(tmp_path, remote_url=fs))  # restarted, with a remote
    assert second.batch_set_v1(KEYS[:4], page_indices(pool, [1, 2, 3, 4])) == [True] * 4
    counters = second.metrics()["counters"]
    assert counters["disk_lookup_hit_chunks"] == counters["fs_lookup_hit_chunks"] == 0
    assert counters["disk_put_chunks"] == 1 and counters["fs_put_chunks"] == 4
    second.close()
    third = make_backend(pool, {"local_cpu": False, "remote_url": fs})
    assert third.batch_set_v1(KEYS[:4], page_indices(pool, [1, 2, 3, 4])) == [True] * 4
    counters = third.metrics()["counters"]
    assert counters["fs_lookup_hit_chunks"] == counters["fs_put_chunks"] == 0, "held: not sent"
    assert third.batch_get_v1(KEYS[:4], page_indices(pool, [9, 10, 11, 12])) == [True] * 4
    assert_pages_equal(pool, [1, 2, 3, 4], pool, [9, 10, 11, 12])
    third.close()


def _page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvt"))


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "delete"])
def test_missing_or_corrupt_page_is_absent_never_wrong(tmp_path, damage):
    pool = mha_pool("page_first")
    writer = make_backend(pool, disk(tmp_path))
    assert all(writer.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])))
    # A restarted instance with no CPU tier reads the files; damage the second page's.
    reader = make_backend(pool, disk(tmp_path, local_cpu=False))
    target = next(p for p in _page_files(tmp_path) if KEYS[1] in _key_in(p))
    if damage == "flip_payload_byte":
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    else:
        target.unlink()
    before = bits(pool.get_data_page(20 * pool.page_size, flat=False)).clone()
    loaded = reader.batch_get_v1(KEYS[:3], page_indices(pool, [19, 20, 21]))
    assert loaded == [True, False, False]
    assert_pages_equal(pool, [1], pool, [19])
    after = bits(pool.get_data_page(20 * pool.page_size, flat=False))
    assert torch.equal(before, after), "a damaged page was written into the host pool"
    assert reader.batch_exists(KEYS[:3]) == 1  # the damaged file was dropped (or is gone)
    writer.close()
    reader.close()


def _key_in(path: Path) -> str:
    """The page key (hash hex) recorded in a page file's header."""
    return path.read_bytes()[:400].decode("latin-1")


def test_faults_are_misses_not_exceptions(cpu_only):
    pool = mha_pool("page_first")
    backend = make_backend(pool, cpu_only)
    short = torch.arange(pool.page_size)  # one page of indices for two keys
    assert backend.batch_set_v1(KEYS[:2], short) == [False, False]
    assert backend.batch_get_v1(KEYS[:2], short) == [False, False]
    assert backend.batch_set(KEYS[:1], [torch.zeros(3)]) is False
    assert backend.get(KEYS[0], torch.zeros(3)) is None
    unknown = PoolTransfer(name=PoolName.MAMBA, host_indices=short, keys=KEYS[:1])
    assert backend.batch_get_v2([unknown]) == {PoolName.MAMBA: [False]}
    backend.close()


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_unreachable_remote_tier_is_a_miss(tmp_path):
    pool = mha_pool("page_first")
    with RedisServer() as server:
        extra = {"remote_url": server.url, "local_cpu": False, "remote_timeout_ms": 300}
        backend = make_backend(pool, extra)
        assert all(backend.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])))
        server.stop()
        assert backend.batch_exists(KEYS[:2]) == 0
        assert backend.batch_get_v1(KEYS[:2], page_indices(pool, [5, 6])) == [False, False]
        assert backend.batch_set_v1(KEYS[2:3], page_indices(pool, [3])) in ([False], [True])
        backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_restarted_instance_finds_pages_on_a_shared_disk(tmp_path, kind):
    """Stores are durable without close(): SGLang never calls it at shutdown."""
    pool = POOLS[kind]("page_first_direct")
    first = make_backend(pool, disk(tmp_path))
    assert all(first.batch_set_v1(KEYS[:4], page_indices(pool, [1, 2, 3, 4])))
    # no first.close(): a second instance (a restarted SGLang) shares the directory
    second = make_backend(pool, disk(tmp_path))
    assert second.batch_exists(KEYS[:5]) == 4
    assert second.batch_get_v1(KEYS[:4], page_indices(pool, [11, 12, 13, 14])) == [True] * 4
    assert_pages_equal(pool, [1, 2, 3, 4], pool, [11, 12, 13, 14])
    first.close()
    second.close()


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_two_instances_share_a_redis_tier(tmp_path, kind):
    pool = POOLS[kind]("layer_first")
    with RedisServer() as server:
        a = make_backend(pool, {"remote_url": server.url})
        assert all(a.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])))
        b = make_backend(pool, {"remote_url": server.url, "local_cpu": False})
        assert b.batch_exists(KEYS[:3]) == 3
        assert b.batch_get_v1(KEYS[:3], page_indices(pool, [7, 8, 9])) == [True] * 3
        assert_pages_equal(pool, [1, 2, 3], pool, [7, 8, 9])
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("kind", "reader", "sees"),
    [
        ("mha", {"extra": {"key_salt": "tenant-b"}}, False),
        ("mha", {"model": "org/other-model"}, False),
        ("mha", {"tp_rank": 1, "tp_size": 2}, False),  # each MHA rank holds its own heads
        ("mla", {"tp_rank": 1, "tp_size": 2}, True),  # MLA KV is the same on every rank
        ("mla", {"extra": {"key_salt": "tenant-b"}}, False),
    ],
)
def test_namespaces_separate_deployments(tmp_path, kind, reader, sees):
    pool = POOLS[kind]("page_first")
    writer = make_backend(pool, disk(tmp_path, key_salt="tenant-a"))
    assert all(writer.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])))
    extra = {"key_salt": "tenant-a", **reader.pop("extra", {})}
    other = make_backend(pool, disk(tmp_path, **extra), **reader)
    assert other.batch_exists(KEYS[:2]) == (2 if sees else 0)
    writer.close()
    other.close()


def test_v2_pool_transfers_and_hit_policies(cpu_only):
    """The v2 path: the KV pool plus an extra pool (here SGLang's MHA pool class standing in
    for an SWA pool), stored as its own flat pages under the KV page's key."""
    kv = mha_pool("page_first")
    swa = mha_pool("page_first_direct", layers=1, heads=1, head_dim=16)
    backend = make_backend(kv, cpu_only)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    written = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=page_indices(kv, [1, 2, 3]), keys=KEYS[:3]),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [2]), keys=KEYS[1:2]),
        ]
    )
    assert written == {PoolName.KV: [True] * 3, PoolName.SWA: [True]}

    def exists(policy, window_keys):
        transfer = PoolTransfer(name=PoolName.SWA, keys=window_keys, hit_policy=policy)
        return backend.batch_exists_v2(KEYS[:4], [transfer])

    result = exists(PoolHitPolicy.ALL_PAGES, KEYS[:3])
    assert result.kv_hit_pages == 0 and result.extra_pool_hit_pages == {PoolName.KV: 3}
    result = exists(PoolHitPolicy.TRAILING_PAGES, KEYS[1:2])  # a one-page window
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [2]
    assert result.extra_pool_hit_pages == {PoolName.KV: 3, PoolName.SWA: 2}
    assert backend.batch_exists_v2(KEYS[:4]).kv_hit_pages == 3

    loaded = backend.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=page_indices(kv, [7, 8]), keys=KEYS[:2]),
            PoolTransfer(name=PoolName.SWA, host_indices=page_indices(swa, [9]), keys=KEYS[1:2]),
        ]
    )
    assert loaded == {PoolName.KV: [True, True], PoolName.SWA: [True]}
    assert_pages_equal(kv, [1, 2], kv, [7, 8])
    assert_pages_equal(swa, [2], swa, [9])
    backend.close()


def test_an_mla_models_sidecar_pools_written_by_one_rank_serve_every_rank(tmp_path):
    """An MLA model's indexer pool is backed up by the writer rank only, as its KV is
    (SGLang's ``should_backup``): another rank finds both; Mamba states stay per rank."""
    kv = mla_pool("page_first")
    indexer = mha_pool("page_first_direct", layers=1, heads=1, head_dim=16)
    mamba = mha_pool("page_first_direct", layers=1, heads=1, head_dim=8)
    backends = [make_backend(kv, disk(tmp_path), tp_rank=r, tp_size=2) for r in (0, 1)]
    for backend in backends:
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    written = backends[0].batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=page_indices(kv, [1, 2]), keys=KEYS[:2]),
            PoolTransfer(
                name=PoolName.INDEXER, host_indices=page_indices(indexer, [1, 2]), keys=KEYS[:2]
            ),
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=page_indices(mamba, [2]), keys=KEYS[1:2]
            ),
        ]
    )
    assert all(all(ok) for ok in written.values())
    reader = backends[1]
    needs = PoolTransfer(name=PoolName.INDEXER, keys=KEYS[:2], hit_policy=PoolHitPolicy.ALL_PAGES)
    result = reader.batch_exists_v2(KEYS[:2], [needs])
    assert result.kv_hit_pages == 2 and result.extra_pool_hit_pages[PoolName.INDEXER] == 2
    loaded = reader.batch_get_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=page_indices(kv, [5, 6]), keys=KEYS[:2]),
            PoolTransfer(
                name=PoolName.INDEXER, host_indices=page_indices(indexer, [5, 6]), keys=KEYS[:2]
            ),
        ]
    )
    assert loaded == {PoolName.KV: [True, True], PoolName.INDEXER: [True, True]}
    assert_pages_equal(kv, [1, 2], kv, [5, 6])
    assert_pages_equal(indexer, [1, 2], indexer, [5, 6])
    state = PoolTransfer(
        name=PoolName.MAMBA, keys=KEYS[1:2], hit_policy=PoolHitPolicy.TRAILING_PAGES
    )
    assert reader.batch_exists_v2(KEYS[:2], [state]).kv_hit_pages == 0  # rank 1's own states
    assert backends[0].batch_exists_v2(KEYS[:2], [state]).kv_hit_pages == 2
    for backend in backends:
        backend.close()


def page_file_bytes(tmp_path: Path, pool) -> int:
    """The size of one page's file on the local disk."""
    probe = make_backend(pool, disk(tmp_path / "probe", local_cpu=False))
    assert probe.batch_set_v1(KEYS[:1], page_indices(pool, [1])) == [True]
    probe.close()
    (file,) = (tmp_path / "probe").rglob("*.kvt")
    return file.stat().st_size


def test_ranks_sharing_a_local_disk_keep_their_own_pages(tmp_path):
    """Each rank of a multi-rank engine keeps its pages in its own directory of
    ``local_disk`` (``rank<r>of<n>``), within its own bound: a restarted rank neither
    indexes its peer's pages nor evicts them to make room for them."""
    pool = mha_pool("page_first")
    bound = 4.5 * page_file_bytes(tmp_path, pool) / 2**30  # one rank's 3 pages fit, not 6
    extra = disk(tmp_path, local_cpu=False, max_local_disk_size=bound)
    ranks = [make_backend(pool, extra, tp_rank=r, tp_size=2) for r in (0, 1)]
    for backend in ranks:
        assert backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])) == [True] * 3
    ranks[0].close()
    ranks[0] = make_backend(pool, extra, tp_rank=0, tp_size=2)  # restarted
    for backend in ranks:
        assert backend.batch_get_v1(KEYS[:3], page_indices(pool, [5, 6, 7])) == [True] * 3
        assert backend.metrics()["counters"]["disk_evictions"] == 0
        backend.close()
    assert [len(list(tmp_path.glob(f"disk/rank{r}of2/**/*.kvt"))) for r in (0, 1)] == [3, 3]


def test_one_rank_writes_the_pages_an_mla_models_ranks_share(tmp_path):
    """TP ranks of an MLA model hold the same KV pages: the writer (SGLang's
    ``is_storage_writer``) alone stores them, on the local disk (in one directory it
    bounds) and in the remote tier; another rank reads them there, its own writes of them
    skipped and counted. What each rank holds of its own (Mamba states) it stores."""
    pool = mla_pool("page_first")
    mamba = mha_pool("page_first_direct", layers=1, heads=1, head_dim=8)
    remote = f"fs://{tmp_path}/fs"
    extra = disk(tmp_path, local_cpu=False, remote_url=remote)
    writer, reader = (make_backend(pool, extra, tp_rank=r, tp_size=2) for r in (0, 1))
    assert reader.batch_set_v1(KEYS[3:6], page_indices(pool, [4, 5, 6])) == [True] * 3
    reader.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    state = PoolTransfer(name=PoolName.MAMBA, host_indices=page_indices(mamba, [2]), keys=KEYS[1:2])
    assert reader.batch_set_v2([state]) == {PoolName.MAMBA: [True]}
    counters = reader.metrics()["counters"]
    assert counters["disk_puts_skipped_replica"] == counters["fs_puts_skipped_replica"] == 3
    assert counters["disk_put_chunks"] == counters["fs_put_chunks"] == 1  # its Mamba state
    assert writer.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3])) == [True] * 3
    assert reader.batch_get_v1(KEYS[:3], page_indices(pool, [9, 10, 11])) == [True] * 3
    assert_pages_equal(pool, [1, 2, 3], pool, [9, 10, 11])
    assert writer.metrics()["counters"]["fs_put_chunks"] == 3
    assert len(list(tmp_path.glob("disk/kvtier-v1/**/*.kvt"))) == 3  # the writer's
    assert len(list(tmp_path.glob("disk/rank1of2/**/*.kvt"))) == 1  # the reader's state
    assert len(list(tmp_path.glob("disk/rank0of2/**/*.kvt"))) == 0
    writer.close()
    reader.close()


def test_storage_metrics_follow_sglangs_flag_not_the_extra_config(cpu_only, caplog):
    """SGLang reads no ``enable_storage_metrics`` from the extra config: kvtier says so."""
    pool = mha_pool("page_first")
    backend = make_backend(pool, {**cpu_only, "enable_storage_metrics": True}, metrics=False)
    assert "enable_storage_metrics" in caplog.text and "--enable-metrics" in caplog.text
    assert backend.batch_set_v1(KEYS[:2], page_indices(pool, [1, 2])) == [True] * 2
    assert backend.get_stats().backup_pgs == [], "SGLang runs without --enable-metrics"
    backend.close()


def test_stats_and_metrics_keep_kvtiers_names(cpu_only):
    pool = mla_pool("page_first")
    backend = make_backend(pool, cpu_only)
    backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3]))
    backend.batch_set_v1(KEYS[:3], page_indices(pool, [1, 2, 3]))  # already held
    backend.batch_get_v1(KEYS[:4], page_indices(pool, [5, 6, 7, 8]))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # reset by each call, as SGLang expects
    counters = backend.metrics()["counters"]
    page_bytes = 2 * 4 * 576 * 2  # layers x tokens x latent width x bf16
    assert counters["stored_chunks"] == 3 and counters["stored_bytes"] == 3 * page_bytes
    assert counters["store_skipped_existing_chunks"] == 3
    assert counters["retrieve_hit_tokens"] == 12 and counters["retrieve_requested_tokens"] == 16
    assert not [name for name in counters if name.startswith("kv_events_")]  # none counted
    backend.clear()
    assert backend.batch_exists(KEYS[:1]) == 0
    backend.close()
