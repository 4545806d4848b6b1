"""NIXL pulls between two servers in one process, where the holder can be driven: its
blobs evicted and overwritten while a peer reads them one-sidedly (a miss, never wrong
bytes), its leases expiring under the read, its pool registered again, its READs failing
(pulled over TCP instead)."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
import torch

from kvtier.config import load_config
from kvtier.observability.stats import Stats
from kvtier.server.cache import BlobCache
from kvtier.server.leases import Leases
from kvtier.server.nixl import NixlPlane, NixlUnavailable, import_nixl
from kvtier.server.peers import Peers
from kvtier.server.server import KVTierServer
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.serde import make_serde, tensor_bytes
from kvtier.storage.wire import encode

NS = "org%2Fmodel-a"
NAME = "kvtier1@org%2Fmodel-a@1@0@bfloat16@{:032x}"

try:
    import_nixl()
except NixlUnavailable as exc:
    pytest.skip(f"{exc} (make test installs nixl-cu13 --no-deps)", allow_module_level=True)


@functools.cache
def blob(i: int, version: int = 0) -> bytes:
    """A wire-format object of ``NAME.format(i)``, 64 KiB of payload, per version (made
    once: its header records when)."""
    tensor = torch.full((2, 2, 16, 512), float(i * 100 + version), dtype=torch.bfloat16)
    return b"".join(bytes(p) for p in encode(NAME.format(i), tensor, make_serde("naive")))


class Holder:
    """A server (cache, leases, NIXL plane, TCP server) on an event loop of its own."""

    def __init__(self, ttl_s: float = 5.0, memory_gb: float = 0.004):
        config = load_config({"max_local_cpu_size": memory_gb}, env={})
        self.stats = Stats()
        self.cache = BlobCache(config, self.stats)
        self.leases = Leases(ttl_s)
        self.plane = NixlPlane(
            self.cache.memory.pool.buffer,
            busy=self.leases.busy,
            on_idle=self.leases.expire,
        )
        self.server = KVTierServer(
            self.cache, self.stats, host="127.0.0.1", port=0, token=None,
            plane=self.plane, leases=self.leases,
        )  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.url = f"kvtier://127.0.0.1:{self.server.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1.0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.leases.close()
        self.plane.close()
        self.cache.close(0)


@pytest.fixture
def holder():
    holder = Holder()
    yield holder
    holder.close()


def puller(holder: Holder, keep: bool = False) -> tuple[Peers, Stats]:
    memory = LocalCPUTier(8 << 20, "LRU", alignment=64, pin_memory=False)
    stats = Stats()
    plane = NixlPlane(memory.pool.buffer)
    peers = Peers(
        [holder.url], memory=memory, stats=stats, token=None, timeout_s=2.0,
        reconnect_max_s=0.2, plane=plane, keep=keep,
    )  # fmt: skip
    return peers, stats


def pulled_bytes(peers: Peers, names: list[str]) -> dict[str, bytes]:
    got = peers.pull(NS, names)
    out = {name: bytes(tensor_bytes(obj.tensor)[:-1]) for name, obj in got.items()}
    for obj in got.values():
        obj.ref_down()
    return out


def close(peers: Peers) -> None:
    plane = peers.plane
    peers.close()
    assert plane is not None
    plane.close()
    peers.memory.close()


def test_a_pull_reads_the_blobs_with_nixl_and_a_re_registered_pool_is_found_again(holder):
    for i in range(4):
        assert holder.cache.put(NS, NAME.format(i), blob(i))
    peers, stats = puller(holder)
    names = [NAME.format(i) for i in range(6)]
    assert pulled_bytes(peers, names) == {NAME.format(i): blob(i) for i in range(4)}
    assert stats.get("peer_bytes_nixl") == 4 * len(blob(0)) and stats.get("peer_handshakes") == 1
    holder.plane.reregister()
    assert pulled_bytes(peers, names[:1]) == {names[0]: blob(0)}
    assert stats.get("peer_handshakes") == 2, "the new epoch: metadata loaded again"
    assert len(holder.leases) == 0, "every lease released"
    close(peers)


def test_a_lease_lost_before_its_release_is_a_miss_never_the_bytes_read():
    holder = Holder(ttl_s=0.0)  # every lease has expired by the time the puller releases it
    try:
        assert holder.cache.put(NS, NAME.format(1), blob(1))
        peers, stats = puller(holder)
        assert pulled_bytes(peers, [NAME.format(1)]) == {}
        assert stats.get("peer_lease_lost") == 1 and stats.get("peer_hits") == 0
        close(peers)
    finally:
        holder.close()


def test_a_read_that_fails_from_a_peer_that_answers_falls_back_to_tcp(holder):
    """READs that fail while the peer answers (UCX cannot reach it, say): the pull goes
    over TCP (counted, one warning) and so do the next ones, never a miss each time."""
    for i in range(2):
        assert holder.cache.put(NS, NAME.format(i), blob(i))
    peers, stats = puller(holder)
    assert peers.plane is not None
    peers.plane.read = lambda remote, extents, deadline: "failed"
    assert pulled_bytes(peers, [NAME.format(0)]) == {NAME.format(0): blob(0)}
    assert pulled_bytes(peers, [NAME.format(1)]) == {NAME.format(1): blob(1)}
    assert stats.get("peer_nixl_failed") == 1 and stats.get("peer_fallbacks") == 1
    assert stats.get("peer_bytes_tcp") == 2 * len(blob(0)) and stats.get("peer_handshakes") == 1
    assert peers.status()[holder.url]["transport"] == "tcp" and len(holder.leases) == 0
    close(peers)


def test_a_pull_reads_with_the_pool_it_handshook_though_another_forgets_it(holder):
    """The peer's pool forgotten by another thread while a pull sets up its READ (another
    pull's READ failed, the peer reconnected): this pull reads with the pool it loaded,
    leaving no buffer behind and its peer up."""
    assert holder.cache.put(NS, NAME.format(0), blob(0))
    peers, stats = puller(holder)
    allocate = peers._allocate

    def allocate_meanwhile_forgotten(size: int):
        peers.peers[0].remote = None
        return allocate(size)

    peers._allocate = allocate_meanwhile_forgotten
    assert pulled_bytes(peers, [NAME.format(0)]) == {NAME.format(0): blob(0)}
    assert stats.get("peer_errors") == 0 and peers.peers[0].is_up
    assert peers.memory.pool.used_bytes() == 0 and len(holder.leases) == 0
    close(peers)


@pytest.mark.parametrize("ttl_s", [5.0, 0.0])
def test_eviction_and_overwrites_racing_the_reads_give_misses_or_the_right_bytes(ttl_s):
    holder = Holder(ttl_s=ttl_s, memory_gb=0.001)  # 1 MB: about 15 blobs
    versions = {NAME.format(0): {blob(0, v) for v in range(8)}}
    stop = threading.Event()

    def churn() -> None:  # overwrite the target and evict with fillers, without pause
        n = 0
        while not stop.is_set():
            n += 1
            holder.cache.put(NS, NAME.format(0), blob(0, n % 8))
            holder.cache.put(NS, NAME.format(100 + n % 40), blob(100 + n % 40))

    racer = threading.Thread(target=churn)
    racer.start()
    peers, stats = puller(holder)
    try:
        hits = 0
        for _ in range(60):
            for name, data in pulled_bytes(peers, [NAME.format(0)]).items():
                assert data in versions[name], "wrong bytes handed out"
                hits += 1
    finally:
        stop.set()
        racer.join()
        close(peers)
        holder.close()
    assert stats.get("peer_corrupt") == 0
    if ttl_s == 0.0:
        assert hits == 0 and stats.get("peer_lease_lost") >= 1
    else:
        assert hits > 0
