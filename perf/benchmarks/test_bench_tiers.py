"""Tier benchmarks against raw client calls measured in the same run.

Put/get: disk, Redis and S3 tier put/get of 256-token chunks against raw I/O of the same
bytes. Shape: 32 layers, 8 KV heads, head size 128, bf16 — one 256-token chunk is 32 MiB;
every round moves 8 chunks (256 MiB). Figures are GB/s of chunk bytes with the ratio
against a baseline measured in the same run:

- disk put = queue 8 chunks + wait until they are on disk (wire header, checksum, temp
  file, rename) vs raw ``open().write()`` of the same payloads into fresh files;
- disk get = 8 chunks read, verified and placed in pool buffers vs raw ``readinto`` of
  the same files into preallocated buffers (both from the page cache);
- redis put / get = the remote tier (existence check, wire format, pipelined SET; parallel
  GETs, verify, decode) vs raw redis-py pipelined SET / GET of the same payloads;
- s3 put / get = the remote tier over ``S3Store`` (existence check by HEAD, wire format,
  one PutObject per chunk; one GetObject per chunk, verify, decode) vs raw boto3
  ``put_object`` / ``get_object(...)["Body"].read()`` of the same payloads, 8 requests at
  once on a 16-thread pool — the tier's default concurrency (``remote_max_concurrency``)
  — with a client configured like the store's (16 connections, no botocore CRC pass,
  which the wire checksum replaces). The server is moto in its own process on loopback,
  so these figures measure kvtier's overhead over boto3 and moto, not a real S3; the full
  8 × 32 MiB shape is kept (a round takes about 1.5 s to put, 0.4 s to get).

Lookups: ``StorageManager.lookup_prefix`` (no prefetch) of a 32768-token prompt, i.e. 128
chunk keys at chunk_size 256, in lookups (of the whole prompt) per second, with all 128
chunks in exactly one tier (the CPU tier; else only on the local disk, only in Redis or
only in S3, the CPU tier cleared). The chunks are small (a lookup never reads one) and
the baselines are the bare client calls that answer the same question:

- cpu: a Python dict membership loop over the 128 key objects;
- disk: ``os.stat`` of the 128 chunk files (paths precomputed);
- redis: one redis-py pipeline of 128 EXISTS;
- s3: 128 ``head_object`` calls on a 16-thread pool (the tier's concurrency).

Each figure is the median of 15 timed batches of calls (a batch lasts about 20 ms, or
one call when a call is longer), for the tier and its baseline alike; their batches
alternate, so a change in the machine's load weighs on both.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import median_seconds

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool
from kvtier.observability.stats import Stats
from kvtier.storage.disk import FileTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.remote import RemoteTier
from kvtier.storage.serde import NaiveSerde, tensor_bytes
from kvtier.storage.wire import checksum_of

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
SHAPE = (2, LAYERS, CHUNK, HEADS * HEAD_SIZE)
NBYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize
CHUNKS = 8
ROUNDS = 5
# The remote tier's default parallel requests (remote_max_concurrency); the S3 baselines
# use as many threads and connections.
REMOTE_CONCURRENCY = 16
S3_BUCKET = "kvtier-bench"
# Lookups: a 32k-token prompt is 128 chunks; the chunks themselves are small.
PROMPT_TOKENS = 32768
PROMPT_CHUNKS = PROMPT_TOKENS // CHUNK
LOOKUP_SHAPE = (2, 2, 16, 64)
LOOKUP_ROUNDS = 15
LOOKUP_BATCH_S = 0.02


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
        obj.checksum = checksum_of(tensor_bytes(obj.tensor))
        objs.append(obj)
    yield objs
    for obj in objs:
        obj.ref_down()


def _gbps(benchmark) -> float:
    return CHUNKS * NBYTES / benchmark.stats.stats.median / 1e9


def _median_gbps(fn, setup=None) -> float:
    """GB/s of the median of ``ROUNDS`` timed calls (after one warm-up), each after
    ``setup`` (untimed)."""
    return CHUNKS * NBYTES / median_seconds(fn, repeat=ROUNDS, warmup=1, setup=setup) / 1e9


def _release(objs) -> None:
    for obj in objs:
        assert obj is not None
        obj.ref_down()


def _fill(tier, chunks) -> None:
    """Write the round's chunks into ``tier`` and wait until they are there."""
    for key, obj in zip(KEYS, chunks, strict=True):
        assert tier.submit_put(key, obj)
    assert tier.flush(120)


def _time_put(benchmark, tier, chunks, setup) -> None:
    """Time ``_fill`` (queue + wait until written), ``setup`` emptying the tier first."""
    benchmark.pedantic(lambda: _fill(tier, chunks), setup=setup, rounds=ROUNDS, warmup_rounds=1)


def _time_get(benchmark, pool, tier) -> None:
    """Time one batched get of the round's chunks into pool buffers."""
    benchmark.pedantic(
        lambda: _release(tier.get_many(KEYS, pool.allocate)), rounds=ROUNDS, warmup_rounds=1
    )


def _record_gbps(record, benchmark, metric: str, baseline: str, baseline_value: float) -> None:
    record(
        metric=metric,
        value=_gbps(benchmark),
        unit="GB/s",
        baseline=baseline,
        baseline_value=baseline_value,
    )


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
    _time_put(benchmark, tier, chunks, setup=tier.clear)
    _record_gbps(record, benchmark, "disk tier put", "raw file write", baseline)
    tier.close()


def test_disk_tier_get(benchmark, record, pool, chunks, disk_dir):
    tier = FileTier(disk_dir / "tier", capacity_bytes=None, serde=NaiveSerde(), stats=Stats())
    _fill(tier, chunks)
    files = [tier.path_of(tier.file_name(key)) for key in KEYS]
    buffers = [bytearray(f.stat().st_size) for f in files]

    def raw_read():
        for path, buffer in zip(files, buffers, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(buffer)

    baseline = _median_gbps(raw_read)
    _time_get(benchmark, pool, tier)
    _record_gbps(record, benchmark, "disk tier get", "raw file readinto", baseline)
    tier.close()


# -- redis --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url():
    from support.redis_server import REDIS_MISSING, RedisServer, redis_available

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
    _time_put(benchmark, tier, chunks, setup=empty)
    _record_gbps(record, benchmark, "redis tier put", "raw redis-py pipelined SET", baseline)
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
    _fill(tier, chunks)
    _time_get(benchmark, pool, tier)
    _record_gbps(record, benchmark, "redis tier get", "raw redis-py pipelined GET", baseline)
    tier.close()
    client.close()


# -- s3 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server (its own process) with bucket ``S3_BUCKET``; boto3 sees none of the
    developer's AWS variables or config files while it runs."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from support.s3_server import S3Server, isolate_aws_environment

    with pytest.MonkeyPatch.context() as env:
        isolate_aws_environment(env)
        with S3Server() as server:
            server.create_bucket(S3_BUCKET)
            yield server


def _raw_s3_client(server):
    """A boto3 client configured like ``S3Store``'s: as many connections as threads, and
    no CRC pass over bodies (the store turns it off; the wire format checksums)."""
    return server.client(
        max_pool_connections=REMOTE_CONCURRENCY,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def _s3_tier(server) -> RemoteTier:
    from kvtier.storage.s3_store import S3Store

    store = S3Store(
        f"s3://{S3_BUCKET}",
        namespace="bench/",
        timeout_s=30.0,
        max_concurrency=REMOTE_CONCURRENCY,
        **server.store_kwargs(),
    )
    return RemoteTier(
        store,
        describe=f"s3://{S3_BUCKET}",
        serde=NaiveSerde(),
        stats=Stats(),
        timeout_s=30.0,
        concurrency=REMOTE_CONCURRENCY,
    )


def _delete_raw(client, names: list[str]) -> None:
    client.delete_objects(
        Bucket=S3_BUCKET, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True}
    )


@pytest.mark.s3
def test_s3_tier_put(benchmark, record, chunks, s3_server):
    client = _raw_s3_client(s3_server)
    names = [f"raw/{i}" for i in range(CHUNKS)]
    payloads = [bytes(tensor_bytes(obj.tensor)) for obj in chunks]

    with ThreadPoolExecutor(REMOTE_CONCURRENCY) as workers:

        def raw_put():
            puts = workers.map(
                lambda i: client.put_object(Bucket=S3_BUCKET, Key=names[i], Body=payloads[i]),
                range(CHUNKS),
            )
            assert len(list(puts)) == CHUNKS

        baseline = _median_gbps(raw_put, setup=lambda: _delete_raw(client, names))
    _delete_raw(client, names)
    payloads.clear()  # moto holds its own copies; free ours
    tier = _s3_tier(s3_server)
    _time_put(benchmark, tier, chunks, setup=tier.clear)
    # A failed write only marks the tier down (and is counted): check that all landed.
    assert tier.is_up and all(tier.contains_many(KEYS))
    _record_gbps(record, benchmark, "s3 tier put", "raw boto3 put_object", baseline)
    tier.clear()
    tier.close()
    client.close()


@pytest.mark.s3
def test_s3_tier_get(benchmark, record, pool, chunks, s3_server):
    client = _raw_s3_client(s3_server)
    names = [f"raw/{i}" for i in range(CHUNKS)]
    for name, obj in zip(names, chunks, strict=True):
        client.put_object(Bucket=S3_BUCKET, Key=name, Body=bytes(tensor_bytes(obj.tensor)))

    with ThreadPoolExecutor(REMOTE_CONCURRENCY) as workers:

        def raw_get():
            blobs = workers.map(
                lambda name: client.get_object(Bucket=S3_BUCKET, Key=name)["Body"].read(), names
            )
            assert all(len(blob) == NBYTES for blob in blobs)

        baseline = _median_gbps(raw_get)
    _delete_raw(client, names)
    tier = _s3_tier(s3_server)
    _fill(tier, chunks)
    _time_get(benchmark, pool, tier)
    _record_gbps(record, benchmark, "s3 tier get", "raw boto3 get_object", baseline)
    tier.clear()
    tier.close()
    client.close()


# -- lookups of a 32k-token prompt ----------------------------------------------------------

# A baseline: its label and a call that returns how many of the 128 chunks it found.
Baseline = tuple[str, Callable[[], int]]


def _prompt_keys() -> list[CacheKey]:
    """The 128 chunk keys of a random 32768-token prompt, chained as the engine makes them."""
    tokens = torch.randint(0, 128_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    template = CacheKey("bench-lookup", 1, 0, "bfloat16", b"")
    chunks = Chunker(CHUNK, ChunkHasher(), template).chunks(tokens.tolist())
    assert len(chunks) == PROMPT_CHUNKS
    return [chunk.key for chunk in chunks]


@contextlib.contextmanager
def _manager_holding(keys: list[CacheKey], **overrides) -> Iterator[StorageManager]:
    """A manager built from ``overrides`` (no ``KVTIER_*`` variables) with a small chunk
    stored under every key; with lower tiers, only they keep them (the CPU tier cleared)."""
    config = load_config(
        {"max_local_cpu_size": 0.0625, "remote_timeout_ms": 30_000, **overrides}, env={}
    )
    manager = StorageManager(config, Stats(), pin_memory=False, namespace="bench-lookup")
    try:
        manager.clear()
        for i, key in enumerate(keys):
            obj = manager.allocate(LOOKUP_SHAPE, DTYPE)
            assert obj is not None
            obj.tensor.fill_(i)
            assert manager.put(key, obj)
            obj.ref_down()
        assert manager.flush(60)
        if manager.lower:
            manager.cpu.clear()
        assert manager.cpu.prefix_length(keys) == (0 if manager.lower else len(keys))
        yield manager
    finally:
        manager.clear()
        manager.close()


@contextlib.contextmanager
def _cpu_lookup(request, keys) -> Iterator[tuple[StorageManager, Baseline]]:
    stored = dict.fromkeys(keys)

    def dict_lookup() -> int:
        for i, key in enumerate(keys):
            if key not in stored:
                return i
        return len(keys)

    with _manager_holding(keys) as manager:
        yield manager, ("dict membership loop", dict_lookup)


@contextlib.contextmanager
def _disk_lookup(request, keys) -> Iterator[tuple[StorageManager, Baseline]]:
    directory = request.getfixturevalue("disk_dir")
    with _manager_holding(keys, local_disk=str(directory), max_local_disk_size=1.0) as manager:
        (disk,) = manager.lower
        assert isinstance(disk, FileTier)
        paths = [str(disk.path_of(disk.file_name(key))) for key in keys]

        def stat_all() -> int:
            for path in paths:
                os.stat(path)
            return len(paths)

        yield manager, ("raw os.stat of the chunk files", stat_all)


@contextlib.contextmanager
def _redis_lookup(request, keys) -> Iterator[tuple[StorageManager, Baseline]]:
    import redis

    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url)
    names = [f"raw:lookup:{i}" for i in range(len(keys))]
    client.mset({name: b"x" for name in names})

    def exists_all() -> int:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return sum(pipe.execute())

    try:
        with _manager_holding(keys, remote_url=url) as manager:
            yield manager, ("raw redis-py pipelined EXISTS", exists_all)
    finally:
        client.delete(*names)
        client.close()


@contextlib.contextmanager
def _s3_lookup(request, keys) -> Iterator[tuple[StorageManager, Baseline]]:
    server = request.getfixturevalue("s3_server")
    client = _raw_s3_client(server)
    names = [f"raw-lookup/{i}" for i in range(len(keys))]
    for name in names:
        client.put_object(Bucket=S3_BUCKET, Key=name, Body=b"x")
    s3_keys = {
        "remote_url": f"s3://{S3_BUCKET}",
        "s3_endpoint_url": server.endpoint_url,
        "s3_region": server.region,
        "s3_access_key_id": server.access_key_id,
        "s3_secret_access_key": server.secret_access_key,
        "remote_max_concurrency": REMOTE_CONCURRENCY,
    }
    with ThreadPoolExecutor(REMOTE_CONCURRENCY) as workers:

        def head_all() -> int:
            heads = workers.map(lambda name: client.head_object(Bucket=S3_BUCKET, Key=name), names)
            return len(list(heads))

        try:
            with _manager_holding(keys, **s3_keys) as manager:
                yield manager, ("raw boto3 head_object", head_all)
        finally:
            _delete_raw(client, names)
            client.close()


LOOKUP_SETUPS = {"cpu": _cpu_lookup, "disk": _disk_lookup, "redis": _redis_lookup, "s3": _s3_lookup}


def _batch_size(fn: Callable[[], object]) -> int:
    """Calls per timed batch: about ``LOOKUP_BATCH_S`` of them (at least one)."""
    fn()
    started = time.perf_counter()
    fn()
    return max(1, round(LOOKUP_BATCH_S / (time.perf_counter() - started)))


def _interleaved_per_second(
    benchmark, fn: Callable[[], object], baseline: Callable[[], object]
) -> tuple[float, float]:
    """Calls per second of ``fn`` and of ``baseline``: the medians of ``LOOKUP_ROUNDS``
    timed batches of each (after one), a baseline batch right before each ``fn`` batch,
    so that load from elsewhere on the machine weighs on both alike.

    NOTE: pytest-benchmark times whole ``fn`` batches here (it cannot time batches with
    a setup step per round); ``extra_info["calls_per_round"]`` says how many calls each.
    """
    calls, baseline_calls = _batch_size(fn), _batch_size(baseline)
    baseline_times: list[float] = []

    def baseline_batch() -> None:
        started = time.perf_counter()
        for _ in range(baseline_calls):
            baseline()
        baseline_times.append((time.perf_counter() - started) / baseline_calls)

    def batch() -> None:
        for _ in range(calls):
            fn()

    benchmark.extra_info["calls_per_round"] = calls
    benchmark.pedantic(batch, setup=baseline_batch, rounds=LOOKUP_ROUNDS, warmup_rounds=1)
    per_call = benchmark.stats.stats.median / calls
    return 1 / per_call, 1 / statistics.median(baseline_times[-LOOKUP_ROUNDS:])


@pytest.mark.parametrize(
    "tier",
    [
        "cpu",
        "disk",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("s3", marks=pytest.mark.s3),
    ],
)
def test_lookup_32k_prompt(benchmark, record, request, tier):
    keys = _prompt_keys()
    with LOOKUP_SETUPS[tier](request, keys) as (manager, (baseline_name, raw_lookup)):

        def baseline_lookup():
            assert raw_lookup() == PROMPT_CHUNKS

        def lookup():
            # NOTE: a remote tier that went down would answer every lookup with a miss,
            # fast; asserting the full run keeps such a figure out of the results.
            assert manager.lookup_prefix(keys) == PROMPT_CHUNKS

        value, baseline = _interleaved_per_second(benchmark, lookup, baseline_lookup)
    record(
        metric=f"lookup 32k-token prompt ({tier})",
        value=value,
        unit="lookups/s",
        baseline=baseline_name,
        baseline_value=baseline,
    )
