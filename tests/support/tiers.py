"""Helpers shared by the tier tests: chunk keys, chunk buffers with known bytes, a
check that a buffer holds exactly what was stored, an object in a newer kvtier's format,
a disk tier and its counters, a
storage manager on a remote configured as an operator would (``remote_manager``), and
an in-memory remote store that misbehaves on command (``FlakyStore``)."""

from __future__ import annotations

import threading
import time

import torch

from kvtier.config import load_config
from kvtier.keys import CacheKey
from kvtier.memory import HostMemoryPool, MemoryObj
from kvtier.observability.stats import Stats, TierCounter, tier_counter
from kvtier.storage.blob_store import StoreUnavailable, Throttled, WriteRefused, join_parts
from kvtier.storage.disk import FileTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.serde import NaiveSerde, tensor_bytes
from kvtier.storage.wire import PREFIX, VERSION, checksum_of

CHUNK_SHAPE = (2, 3, 16, 64)  # [K/V, layers, tokens, heads * head_size]


def key(i: int, *, model: str = "org/model-a", rank: int = 0, layer: int | None = None):
    return CacheKey(model, 2, rank, "bfloat16", i.to_bytes(16, "big"), layer, (("isa", "vec"),))


def make_pool(mib: int = 64) -> HostMemoryPool:
    return HostMemoryPool(mib * 2**20, alignment=256, pin_memory=False)


def make_tier(root, stats: Stats | None = None, **kwargs) -> FileTier:
    """A disk tier at ``root`` (naive codec, 1 GiB cap unless ``capacity_bytes`` is given)."""
    kwargs.setdefault("capacity_bytes", 1 << 30)
    return FileTier(root, serde=NaiveSerde(), stats=stats or Stats(), **kwargs)


def counter(stats: Stats, what: str, tier: str = "disk") -> float:
    return stats.get(tier_counter(tier, what))


def fill(pool: HostMemoryPool, seed: int, shape=CHUNK_SHAPE, dtype=torch.bfloat16) -> MemoryObj:
    """A chunk buffer full of random bit patterns (NaNs included), checksummed as a
    store does with ``verify_checksums``."""
    obj = pool.allocate(shape, dtype)
    assert obj is not None, "test pool exhausted"
    gen = torch.Generator().manual_seed(seed)
    raw = tensor_bytes(obj.tensor)
    raw[:] = torch.randint(0, 256, (len(raw),), generator=gen, dtype=torch.uint8).numpy().data
    obj.checksum = checksum_of(raw)
    return obj


def same_bytes(a: MemoryObj, b: MemoryObj) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bytes(tensor_bytes(a.tensor)) == bytes(tensor_bytes(b.tensor))
    )


def in_a_newer_format(blob: bytes) -> bytes:
    """``blob`` (a wire-format object) as a kvtier of the next format version would write
    it: a version this kvtier does not read."""
    magic, _, *rest = PREFIX.unpack_from(blob)
    return PREFIX.pack(magic, VERSION + 1, *rest) + blob[PREFIX.size :]


def remote_manager(
    url: str, stats: Stats | None = None, namespace: str = "org/model-a", **settings
) -> StorageManager:
    """A storage manager (an engine's tiers) with a small CPU tier and ``remote_url``,
    timing out after 500 ms and retrying every 200 ms."""
    config = load_config(
        {
            "max_local_cpu_size": 0.05,
            "remote_url": url,
            "remote_timeout_ms": 500,
            "remote_reconnect_max_ms": 200,
            **settings,
        },
        env={},
    )
    return StorageManager(config, stats or Stats(), namespace=namespace)


def store_chunks(manager: StorageManager, pool: HostMemoryPool, seeds) -> dict[int, MemoryObj]:
    """Store a chunk per seed under ``key(seed)`` and wait until every tier wrote it."""
    objs = {i: fill(pool, i) for i in seeds}
    for i, obj in objs.items():
        assert manager.put(key(i), obj)
    assert manager.flush(30)
    return objs


def check_served(reader_url: str, objs: dict[int, MemoryObj], **settings) -> None:
    """An engine's tiers on ``reader_url`` (``remote_manager(reader_url, **settings)``)
    find every chunk of ``objs`` (as ``store_chunks`` returns them) and read its bytes."""
    reader = remote_manager(reader_url, **settings)
    keys = [key(i) for i in objs]
    try:
        assert reader.lookup_prefix(keys) == len(keys)
        got = reader.get_many(keys)
        assert all(same_bytes(g, objs[i]) for g, i in zip(got, objs, strict=True))
    finally:
        reader.close()


def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def check_remote_down(manager: StorageManager, pool: HostMemoryPool, tier: str, budget_s: float):
    """With the remote gone after ``store_chunks(manager, pool, [1, 2])``: lookups and
    gets are misses and stores go on (their remote copies dropped, counted), all within
    ``budget_s``; chunk 3 is then served by the CPU tier."""
    started = time.monotonic()
    assert manager.lookup_prefix([key(1), key(2)]) == 0
    assert manager.get_many([key(1)]) == [None]
    for i in range(3, 6):
        obj = fill(pool, i)
        manager.put(key(i), obj)  # the engine keeps going; the remote copy is dropped
        obj.ref_down()
    assert time.monotonic() - started < budget_s
    assert manager.flush(10)
    assert manager.stats.get(tier_counter(tier, TierCounter.DROPPED_UNAVAILABLE)) >= 3
    assert manager.lookup_prefix([key(3)]) == 1  # from the CPU tier


class FlakyStore:
    """An in-memory BlobStore that can be switched to refuse, hang, corrupt, (``full``)
    refuse writes for room while it still reads, or (``throttled``) throttle every call
    but ``ping``."""

    name = "flaky"

    def __init__(self):
        self.blobs: dict[str, bytes] = {}
        self.mode = "ok"  # ok | down | hang | full | throttled
        self.delay = 0.0  # seconds every call takes
        self.calls = 0
        self.released = threading.Event()

    def _enter(self):
        self.calls += 1
        time.sleep(self.delay)
        if self.mode == "down":
            raise StoreUnavailable("flaky: connection refused")
        if self.mode == "hang":
            self.released.wait(30)
        if self.mode == "throttled":
            raise Throttled("flaky: SlowDown")

    def put_many(self, items):
        self._enter()
        if self.mode == "full":
            raise WriteRefused("flaky: out of memory", "flaky out of memory")
        for name, parts in items:
            self.blobs[name] = bytes(join_parts(parts))

    def get_many(self, names):
        self._enter()
        return [self.blobs.get(n) for n in names]

    def exists_many(self, names):
        self._enter()
        return [n in self.blobs for n in names]

    def delete_many(self, names):
        self._enter()
        return sum(self.blobs.pop(n, None) is not None for n in names)

    def clear(self):
        self._enter()
        n = len(self.blobs)
        self.blobs.clear()
        return n

    def ping(self):
        if self.mode != "throttled":  # a throttled store answers
            self._enter()

    def close(self):
        self.released.set()
