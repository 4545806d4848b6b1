"""``kvtier serve`` on the same host: put/get of 256-token chunks through the server, over
its shared-memory path and over TCP, against the in-process CPU tier and raw Redis.

Shape: 32 layers, 8 KV heads, head size 128, bf16 — one 256-token chunk is 32 MiB; every
round moves 8 chunks (256 MiB). The server is a real ``kvtier serve`` process on
loopback (memory tier only); the client is the remote tier an engine opens for
``remote_url: kvtier://127.0.0.1:PORT`` (``?shm=0`` for TCP), so a put includes the wire
header, the checksum and the existence check, and a get includes verifying and decoding
into pool buffers:

- server put = queue 8 chunks + wait until the server holds them (emptied before each
  round); server get = one batched get of the 8 chunks into pool buffers;
- baselines, measured in the same run: the in-process CPU tier (``LocalCPUTier``: put =
  allocate + copy in + index, get = look up + copy out into a buffer per chunk), raw redis-py
  pipelined SET / GET of the same payloads to a local ``redis-server``, and (for TCP) a
  raw loopback socket moving the same bytes to and from another process, which
  ``recv_into`` a buffer it keeps (put = send the 8 chunks + a one-byte answer; get = one
  byte asked, 256 MiB ``recv_into`` a buffer of this process).

Each figure is recorded against each baseline (``... vs redis``, ``... vs raw socket``).

Lookup: ``StorageManager.lookup_prefix`` of a 32768-token prompt (128 chunk keys) held by
the server only (the client's CPU tier cleared), over shared memory (a lookup is one
EXISTS frame, so the transport hardly matters), against raw redis-py pipelined EXISTS of
128 keys; lookups/s with the latency in ``latency_ms``.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

import pytest
import torch
from conftest import median_seconds

from kvtier.chunker import Chunker
from kvtier.config import load_config
from kvtier.hashing import ChunkHasher
from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool
from kvtier.observability.stats import Stats
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.node_store import KVTierStore
from kvtier.storage.remote import RemoteTier
from kvtier.storage.serde import NaiveSerde, tensor_bytes
from kvtier.storage.wire import checksum_of

LAYERS, HEADS, HEAD_SIZE, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
SHAPE = (2, LAYERS, CHUNK, HEADS * HEAD_SIZE)
NBYTES = 2 * LAYERS * CHUNK * HEADS * HEAD_SIZE * DTYPE.itemsize
CHUNKS = 8
ROUNDS = 7
PROMPT_TOKENS = 32768
LOOKUP_SHAPE = (2, 2, 16, 64)
LOOKUP_CALLS = 200


def _key(i: int) -> CacheKey:
    return CacheKey("bench", 1, 0, "bfloat16", ChunkHasher().hash_chunk(b"", [i]))


KEYS = [_key(i) for i in range(CHUNKS)]


def _support():
    import support.kvtier_server
    import support.redis_server

    return support.kvtier_server, support.redis_server


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


@pytest.fixture(scope="module")
def server():
    kvtier_server, _ = _support()
    with kvtier_server.KVTierServerProcess("--max-local-cpu-size", "1") as server:
        yield server


@pytest.fixture(scope="module")
def redis_url():
    _, redis_server = _support()
    if not redis_server.redis_available():
        pytest.skip(redis_server.REDIS_MISSING)
    with redis_server.RedisServer(extra_args=["--maxmemory", "0"]) as redis:
        yield redis.url


def _median_gbps(fn, setup=None) -> float:
    """GB/s of the median of ``ROUNDS`` timed calls (after one warm-up), each after
    ``setup`` (untimed)."""
    return CHUNKS * NBYTES / median_seconds(fn, repeat=ROUNDS, warmup=1, setup=setup) / 1e9


@pytest.fixture(scope="module")
def cpu_tier_gbps(chunks) -> dict[str, float]:
    """The in-process CPU tier's put and get GB/s of the same chunks."""
    tier = LocalCPUTier(CHUNKS * NBYTES + 2**20, "LRU")
    # a buffer of its own for each chunk, as the server's get fills the pool's (one
    # reused 32 MiB buffer stays partly in a 32 MiB L3 and flatters the copy)
    outs = [torch.empty(SHAPE, dtype=DTYPE) for _ in KEYS]

    def put():
        for key, chunk in zip(KEYS, chunks, strict=True):
            obj = tier.allocate(SHAPE, DTYPE)
            obj.tensor.copy_(chunk.tensor)
            tier.put(key, obj)
            obj.ref_down()

    def get():
        for key, out in zip(KEYS, outs, strict=True):
            got = tier.get(key)
            out.copy_(got.tensor)
            got.ref_down()

    figures = {"put": _median_gbps(put, setup=tier.clear)}
    put()
    figures["get"] = _median_gbps(get)
    tier.close()
    return figures


@pytest.fixture(scope="module")
def redis_gbps(chunks, redis_url) -> dict[str, float]:
    """Raw redis-py pipelined SET and GET GB/s of the same payloads."""
    import redis

    client = redis.Redis.from_url(redis_url)
    payloads = [tensor_bytes(obj.tensor) for obj in chunks]

    def raw_set():
        pipe = client.pipeline(transaction=False)
        for i, payload in enumerate(payloads):
            pipe.set(f"raw:{i}", payload)
        pipe.execute()

    def raw_get():
        pipe = client.pipeline(transaction=False)
        for i in range(CHUNKS):
            pipe.get(f"raw:{i}")
        assert all(v is not None for v in pipe.execute())

    figures = {"put": _median_gbps(raw_set, setup=client.flushdb)}
    raw_set()
    figures["get"] = _median_gbps(raw_get)
    client.flushdb()
    client.close()
    return figures


RAW_PEER = r"""
import socket, sys
size = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buffer = memoryview(bytearray(size))
while op := conn.recv(1):
    if op == b"p":
        got = 0
        while got < size:
            got += conn.recv_into(buffer[got:])
        conn.sendall(b"k")
    else:
        conn.sendall(buffer)
"""


@pytest.fixture(scope="module")
def raw_socket_gbps(chunks) -> dict[str, float]:
    """A raw loopback socket's put and get GB/s of the same bytes, to and from a process
    that keeps them in a buffer of its own."""
    peer = subprocess.Popen(
        [sys.executable, "-c", RAW_PEER, str(CHUNKS * NBYTES)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None
        sock = socket.create_connection(("127.0.0.1", int(peer.stdout.readline())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payloads = [tensor_bytes(obj.tensor) for obj in chunks]
        sink = memoryview(bytearray(CHUNKS * NBYTES))

        def put():
            sock.sendall(b"p")
            for payload in payloads:
                sock.sendall(payload)
            assert sock.recv(1) == b"k"

        def get():
            sock.sendall(b"g")
            got = 0
            while got < len(sink):
                got += sock.recv_into(sink[got:])

        figures = {"put": _median_gbps(put), "get": _median_gbps(get)}
        sock.close()
    finally:
        peer.kill()
        peer.wait()
    return figures


def _server_tier(server, shm: bool) -> RemoteTier:
    store = KVTierStore("127.0.0.1", server.port, namespace="bench", timeout_s=30.0, shm=shm)
    return RemoteTier(store, describe=server.url, serde=NaiveSerde(), stats=Stats(), timeout_s=30.0)


def _fill(tier: RemoteTier, chunks) -> None:
    for key, obj in zip(KEYS, chunks, strict=True):
        assert tier.submit_put(key, obj)
    assert tier.flush(120)


def _record_all(record, benchmark, metric, op, baselines) -> None:
    cpu_tier_gbps, redis_gbps, raw_socket_gbps = baselines
    value = CHUNKS * NBYTES / benchmark.stats.stats.median / 1e9
    record(
        metric=metric,
        value=value,
        unit="GB/s",
        baseline=f"in-process CPU tier {op}",
        baseline_value=cpu_tier_gbps[op],
        shape="2 x 32 layers x 256 tokens x 8 heads x 128, bf16 (32 MiB/chunk)",
    )
    redis_op = "SET" if op == "put" else "GET"
    record(
        metric=f"{metric} vs redis",
        value=value,
        unit="GB/s",
        baseline=f"raw redis-py pipelined {redis_op}",
        baseline_value=redis_gbps[op],
    )
    if raw_socket_gbps is not None:
        record(
            metric=f"{metric} vs raw socket",
            value=value,
            unit="GB/s",
            baseline=f"raw loopback socket {op}, same bytes",
            baseline_value=raw_socket_gbps[op],
        )


TRANSPORTS = [pytest.param(True, id="shm"), pytest.param(False, id="tcp")]


@pytest.mark.redis
@pytest.mark.parametrize("shm", TRANSPORTS)
def test_server_put(benchmark, record, request, chunks, server, shm, cpu_tier_gbps, redis_gbps):
    tier = _server_tier(server, shm)
    tier.store.ping()
    assert tier.store.shm_active is shm
    benchmark.pedantic(
        lambda: _fill(tier, chunks), setup=tier.clear, rounds=ROUNDS, warmup_rounds=1
    )
    assert all(tier.contains_many(KEYS)), "every chunk landed"
    transport = "shm" if shm else "tcp"
    raw = None if shm else request.getfixturevalue("raw_socket_gbps")
    baselines = cpu_tier_gbps, redis_gbps, raw
    _record_all(record, benchmark, f"server tier put ({transport})", "put", baselines)
    tier.close()


@pytest.mark.redis
@pytest.mark.parametrize("shm", TRANSPORTS)
def test_server_get(
    benchmark, record, request, pool, chunks, server, shm, cpu_tier_gbps, redis_gbps
):
    tier = _server_tier(server, shm)
    tier.clear()
    _fill(tier, chunks)
    assert tier.store.shm_active is shm

    def get():
        got = tier.get_many(KEYS, pool.allocate)
        assert all(obj is not None for obj in got)
        for obj in got:
            obj.ref_down()

    benchmark.pedantic(get, rounds=ROUNDS, warmup_rounds=1)
    check = tier.get_many(KEYS[:1], pool.allocate)[0]
    assert torch.equal(check.tensor.view(torch.int16), chunks[0].tensor.view(torch.int16))
    check.ref_down()
    transport = "shm" if shm else "tcp"
    raw = None if shm else request.getfixturevalue("raw_socket_gbps")
    baselines = cpu_tier_gbps, redis_gbps, raw
    _record_all(record, benchmark, f"server tier get ({transport})", "get", baselines)
    tier.clear()
    tier.close()


@pytest.mark.redis
def test_server_lookup_32k_prompt(benchmark, record, server, redis_url):
    import redis

    tokens = torch.randint(0, 128_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    template = CacheKey("bench-lookup", 1, 0, "bfloat16", b"")
    keys = [c.key for c in Chunker(CHUNK, ChunkHasher(), template).chunks(tokens.tolist())]
    config = load_config(
        {"max_local_cpu_size": 0.0625, "remote_url": server.url, "remote_timeout_ms": 30_000},
        env={},
    )
    manager = StorageManager(config, Stats(), pin_memory=False, namespace="bench-lookup")
    manager.clear()
    for i, key in enumerate(keys):
        obj = manager.allocate(LOOKUP_SHAPE, DTYPE)
        obj.tensor.fill_(i)
        assert manager.put(key, obj)
        obj.ref_down()
    assert manager.flush(60)
    manager.cpu.clear()

    client = redis.Redis.from_url(redis_url)
    names = [f"raw:lookup:{i}" for i in range(len(keys))]
    client.mset({name: b"x" for name in names})

    def raw_exists():
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        assert sum(pipe.execute()) == len(names)

    def lookup():
        for _ in range(LOOKUP_CALLS):
            assert manager.lookup_prefix(keys) == len(keys)

    baseline_s = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        for _ in range(LOOKUP_CALLS):
            raw_exists()
        baseline_s.append((time.perf_counter() - started) / LOOKUP_CALLS)
    benchmark.extra_info["calls_per_round"] = LOOKUP_CALLS
    benchmark.pedantic(lookup, rounds=ROUNDS, warmup_rounds=1)
    per_call = benchmark.stats.stats.median / LOOKUP_CALLS
    record(
        metric="lookup 32k-token prompt (server)",
        value=1 / per_call,
        unit="lookups/s",
        baseline="raw redis-py pipelined EXISTS",
        baseline_value=1 / statistics.median(baseline_s),
        latency_ms=per_call * 1000,
    )
    client.delete(*names)
    client.close()
    manager.clear()
    manager.close()
