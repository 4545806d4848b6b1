"""Disk and Redis tier put/get of 256-token chunks against raw I/O of the same bytes.

Shape: 32 layers, 8 KV heads, head size 128, bf16 — one 256-token chunk is 32 MiB; every
round moves 8 chunks (256 MiB). Figures are GB/s of chunk bytes with the ratio against a
baseline measured in the same run:

- disk put = queue 8 chunks + wait until they are on disk (wire header, checksum, temp
  file, rename) vs raw ``open().write()`` of the same payloads into fresh files;
- disk get = 8 chunks read, verified and placed in pool buffers vs raw ``readinto`` of
  the same files into preallocated buffers (both from the page cache);
- redis put / get = the remote tier (existence check, wire format, pipelined SET; parallel
  GETs, verify, decode) vs raw redis-py pipelined SET / GET of the same payloads.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool
from kvtier.metrics import Stats
from kvtier.storage.disk import FileTier
from kvtier.storage.remote import RemoteTier
from kvtier.storage.serde import NaiveSerde, tensor_bytes
from kvtier.storage.wire import checksum_of

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
SHAPE = (2, LAYERS, CHUNK, HEADS * HEAD_SIZE)
NBYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize
CHUNKS = 8
ROUNDS = 5


def _key(i: int) -> CacheKey:
    return CacheKey("bench", 1, 0, "bfloat16", ChunkHasher().hash_chunk(b"", [i]))


KEYS = [_key(i) for i in range(CHUNKS)]


@pytest.fixture(scope="module")
def pool():
    pool = HostMemoryPool((2 * CHUNKS + 2) * NBYTES, pin_memory=False)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def chunks(pool):
    objs = []
    for i in range(CHUNKS):
        obj = pool.allocate(SHAPE, DTYPE)
        obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)))
        obj.metadata = checksum_of(tensor_bytes(obj.tensor))
        objs.append(obj)
    yield objs
    for obj in objs:
        obj.ref_down()


def _gbps(benchmark) -> float:
    return CHUNKS * NBYTES / benchmark.stats.stats.median / 1e9


def _median_gbps(fn, setup=None) -> float:
    """GB/s of the median of ``ROUNDS`` timed calls (after one warm-up), each after
    ``setup`` (untimed)."""
    times = []
    for _ in range(ROUNDS + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return CHUNKS * NBYTES / statistics.median(times[1:]) / 1e9


def _release(objs) -> None:
    for obj in objs:
        assert obj is not None
        obj.ref_down()


# -- disk ---------------------------------------------------------------------------------


@pytest.fixture
def disk_dir():
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=os.environ.get("BENCH_DIR")) as d:
        yield Path(d)


def _raw_write(directory: Path, chunks) -> None:
    for i, obj in enumerate(chunks):
        with open(directory / f"raw-{i}.bin", "wb") as f:
            f.write(tensor_bytes(obj.tensor))


def _wipe(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            path.unlink()


def test_disk_tier_put(benchmark, record, chunks, disk_dir):
    raw = disk_dir / "raw"
    raw.mkdir()
    baseline = _median_gbps(lambda: _raw_write(raw, chunks), setup=lambda: _wipe(raw))
    tier = FileTier(disk_dir / "tier", capacity_bytes=None, serde=NaiveSerde(), stats=Stats())

    def put():
        for key, obj in zip(KEYS, chunks, strict=True):
            assert tier.submit_put(key, obj)
        assert tier.flush(120)

    benchmark.pedantic(put, setup=tier.clear, rounds=ROUNDS, warmup_rounds=1)
    record(
        metric="disk tier put",
        value=_gbps(benchmark),
        unit="GB/s",
        baseline="raw file write",
        baseline_value=baseline,
    )
    tier.close()


def test_disk_tier_get(benchmark, record, pool, chunks, disk_dir):
    tier = FileTier(disk_dir / "tier", capacity_bytes=None, serde=NaiveSerde(), stats=Stats())
    for key, obj in zip(KEYS, chunks, strict=True):
        tier.submit_put(key, obj)
    assert tier.flush(120)
    files = [tier.path_of(tier.file_name(key)) for key in KEYS]
    buffers = [bytearray(f.stat().st_size) for f in files]

    def raw_read():
        for path, buffer in zip(files, buffers, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(buffer)

    baseline = _median_gbps(raw_read)
    benchmark.pedantic(
        lambda: _release(tier.get_many(KEYS, pool.allocate)), rounds=ROUNDS, warmup_rounds=1
    )
    record(
        metric="disk tier get",
        value=_gbps(benchmark),
        unit="GB/s",
        baseline="raw file readinto",
        baseline_value=baseline,
    )
    tier.close()


# -- redis --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url():
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the test-server helper
    from redis_server import REDIS_MISSING, RedisServer, redis_available

    if not redis_available():
        pytest.skip(REDIS_MISSING)
    with RedisServer(extra_args=["--maxmemory", "0"]) as server:
        yield server.url


def _redis_tier(url: str) -> RemoteTier:
    from kvtier.storage.redis_store import RedisStore

    return RemoteTier(
        RedisStore(url, namespace="bench:", timeout_s=30.0),
        describe=url,
        serde=NaiveSerde(),
        stats=Stats(),
        timeout_s=30.0,
    )


@pytest.mark.redis
def test_redis_tier_put(benchmark, record, chunks, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    payloads = [tensor_bytes(obj.tensor) for obj in chunks]

    def raw_set():
        pipe = client.pipeline(transaction=False)
        for i, payload in enumerate(payloads):
            pipe.set(f"raw:{i}", payload)
        pipe.execute()

    def empty() -> None:
        client.flushdb()

    baseline = _median_gbps(raw_set, setup=empty)
    tier = _redis_tier(redis_url)

    def put():
        for key, obj in zip(KEYS, chunks, strict=True):
            assert tier.submit_put(key, obj)
        assert tier.flush(120)

    benchmark.pedantic(put, setup=empty, rounds=ROUNDS, warmup_rounds=1)
    record(
        metric="redis tier put",
        value=_gbps(benchmark),
        unit="GB/s",
        baseline="raw redis-py pipelined SET",
        baseline_value=baseline,
    )
    tier.close()
    client.close()


@pytest.mark.redis
def test_redis_tier_get(benchmark, record, pool, chunks, redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    pipe = client.pipeline(transaction=False)
    for i, obj in enumerate(chunks):
        pipe.set(f"raw:{i}", tensor_bytes(obj.tensor))
    pipe.execute()

    def raw_get():
        pipe = client.pipeline(transaction=False)
        for i in range(CHUNKS):
            pipe.get(f"raw:{i}")
        assert all(v is not None for v in pipe.execute())

    baseline = _median_gbps(raw_get)
    tier = _redis_tier(redis_url)
    for key, obj in zip(KEYS, chunks, strict=True):
        tier.submit_put(key, obj)
    assert tier.flush(120)
    benchmark.pedantic(
        lambda: _release(tier.get_many(KEYS, pool.allocate)), rounds=ROUNDS, warmup_rounds=1
    )
    record(
        metric="redis tier get",
        value=_gbps(benchmark),
        unit="GB/s",
        baseline="raw redis-py pipelined GET",
        baseline_value=baseline,
    )
    tier.close()
    client.close()
