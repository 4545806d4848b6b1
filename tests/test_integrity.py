"""Integrity where the threat model puts it (docs/reliability.md): with the default config
a chunk in kvtier's own memory is neither checksummed when stored nor hashed when loaded,
yet every chunk that leaves the process carries the checksum of its bytes, computed by the
tier that writes it, and a byte changed on disk, in Redis or in ``kvtier serve`` (over TCP
or shared memory) is a counted miss: never loaded into the engine."""

from __future__ import annotations

import pytest
import torch
from support.kvtier_server import KVTierServerProcess
from support.redis_server import REDIS_MISSING, RedisServer, redis_available
from test_engine import assert_kv_equal, kv_at, make_engine

from kvtier.engine import CacheEngine
from kvtier.observability.stats import Counter, TierCounter, tier_counter
from kvtier.storage import checked, node_shm, wire
from kvtier.storage.disk import FileTier
from kvtier.storage.node_store import KVTierStore
from kvtier.storage.serde import tensor_bytes

TOKENS = torch.arange(40)  # five chunks of 8 tokens
SRC, DST = torch.arange(40), torch.arange(100, 140)
BAD = 2  # the chunk whose stored bytes are damaged


@pytest.fixture
def count_hashing(monkeypatch):
    """The chunk checksums computed from here on (every ``checksum_of`` call)."""
    calls: list[int] = []
    original = wire.checksum_of

    def counting(*buffers):
        calls.append(sum(len(b) for b in buffers))
        return original(*buffers)

    monkeypatch.setattr(wire, "checksum_of", counting)
    monkeypatch.setattr(checked, "checksum_of", counting)
    return calls


def test_the_default_config_trusts_kvtier_s_own_memory(count_hashing):
    engine = make_engine()
    reference = kv_at(engine, SRC)
    assert engine.store(TOKENS, slot_mapping=SRC).stored_chunks == 5
    assert engine.retrieve(TOKENS, slot_mapping=DST) == 40
    assert_kv_equal(engine, DST, reference, "loaded from the CPU tier")
    assert count_hashing == [], "a store or load through the CPU tier hashed chunk bytes"
    for key in engine.chunk_keys(TOKENS):
        obj = engine.storage.cpu.get(key)
        assert obj is not None and obj.checksum is None
        obj.ref_down()
    engine.close()


def test_verify_checksums_seals_and_verifies_kvtier_s_own_memory(count_hashing):
    engine = make_engine(verify_checksums=True)
    chunk = torch.empty(engine.paged_io.chunk_shape(8), dtype=engine.paged_io.dtype)
    engine.store(TOKENS, slot_mapping=SRC)
    assert count_hashing == [chunk.nbytes] * 5, "one seal per stored chunk"
    assert engine.retrieve(TOKENS, slot_mapping=DST) == 40
    assert count_hashing == [chunk.nbytes] * 10, "and one verification per loaded chunk"
    engine.close()


def _file_of(engine: CacheEngine, index: int) -> str:
    (disk,) = [t for t in engine.storage.lower if isinstance(t, FileTier)]
    key = engine.chunk_keys(TOKENS)[index]
    return disk.files.path(disk.file_name(key))


def _holds_its_checksum(blob: bytes, name: str, obj_bytes: bytes) -> bool:
    """Whether the object ``blob`` carries ``obj_bytes`` and their checksum."""
    header, payload = wire.split(blob, name)
    wire.verify_payload(header, payload)  # raises CorruptObject otherwise
    return bytes(payload) == obj_bytes and header.checksum == wire.checksum_of(obj_bytes)


def _chunk_bytes(engine: CacheEngine, index: int) -> bytes:
    obj = engine.storage.cpu.get(engine.chunk_keys(TOKENS)[index])
    assert obj is not None
    try:
        return bytes(tensor_bytes(obj.tensor))
    finally:
        obj.ref_down()


def _flip_payload_byte(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[-5] ^= 0xFF
    return bytes(damaged)


def _load_stops_at_the_damaged_chunk(engine: CacheEngine, reference, tier: str) -> None:
    """From the lower tier alone: chunks before ``BAD`` load, the damaged one is a counted
    miss, and the engine's slots of it and after it keep what they held."""
    engine.storage.cpu.clear()
    untouched = kv_at(engine, DST[8 * BAD :])
    assert engine.retrieve(TOKENS, slot_mapping=DST) == 8 * BAD
    assert_kv_equal(engine, DST[: 8 * BAD], reference[:, :, : 8 * BAD], "chunks before it")
    assert_kv_equal(engine, DST[8 * BAD :], untouched, "slots of the damaged chunk and after")
    assert engine.stats.get(Counter.CORRUPT_CHUNKS) == 1
    assert engine.stats.get(tier_counter(tier, TierCounter.CORRUPT)) == 1


def test_an_unsealed_chunk_is_checksummed_in_its_file_and_verified_when_read(tmp_path):
    engine = make_engine(local_disk=str(tmp_path))
    reference = kv_at(engine, SRC)
    engine.store(TOKENS, slot_mapping=SRC)
    assert engine.flush(30)
    keys = engine.chunk_keys(TOKENS)
    for i, key in enumerate(keys):
        with open(_file_of(engine, i), "rb") as f:
            blob = f.read()
        assert _holds_its_checksum(blob, key.to_string(), _chunk_bytes(engine, i))
    path = _file_of(engine, BAD)
    with open(path, "rb") as f:
        damaged = _flip_payload_byte(f.read())
    with open(path, "wb") as f:
        f.write(damaged)
    _load_stops_at_the_damaged_chunk(engine, reference, "disk")
    engine.close()


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_an_unsealed_chunk_is_checksummed_in_redis_and_verified_when_read():
    with RedisServer() as redis:
        engine = make_engine(remote_url=redis.url)
        reference = kv_at(engine, SRC)
        engine.store(TOKENS, slot_mapping=SRC)
        assert engine.flush(30)
        client = redis.client()
        keys = engine.chunk_keys(TOKENS)
        stored = {k.decode(): k for k in client.keys("*")}
        names = [next(s for s in stored if s.endswith(key.to_string())) for key in keys]
        for i, (key, name) in enumerate(zip(keys, names, strict=True)):
            blob = client.get(name)
            assert _holds_its_checksum(blob, key.to_string(), _chunk_bytes(engine, i))
        client.set(names[BAD], _flip_payload_byte(client.get(names[BAD])))
        _load_stops_at_the_damaged_chunk(engine, reference, "redis")
        engine.close()


@pytest.fixture(scope="module")
def server():
    with KVTierServerProcess() as server:
        yield server


@pytest.mark.parametrize(
    "shm",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not node_shm.shm_available(), reason="no /dev/shm"),
        ),
    ],
    ids=["tcp", "shm"],
)
def test_an_unsealed_chunk_is_checksummed_in_kvtier_serve_and_verified_when_read(server, shm):
    url = server.url + ("" if shm else "?shm=0")
    engine = make_engine(remote_url=url, model_name=f"integrity-{shm}")
    reference = kv_at(engine, SRC)
    engine.store(TOKENS, slot_mapping=SRC)
    assert engine.flush(30)
    (tier,) = engine.storage.lower
    assert tier.store.shm_active == shm
    raw = KVTierStore("127.0.0.1", server.port, namespace=f"integrity-{shm}", timeout_s=5.0)
    names = [key.to_string() for key in engine.chunk_keys(TOKENS)]
    for i, (name, blob) in enumerate(zip(names, raw.get_many(names), strict=True)):
        assert blob is not None and _holds_its_checksum(blob, name, _chunk_bytes(engine, i))
    (blob,) = raw.get_many([names[BAD]])
    raw.delete_many([names[BAD]])
    raw.put_many([(names[BAD], [_flip_payload_byte(blob)])])
    raw.close()
    _load_stops_at_the_damaged_chunk(engine, reference, "kvtier")
    engine.close()
