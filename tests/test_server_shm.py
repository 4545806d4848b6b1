"""The same-host shared-memory path of ``kvtier serve``: blobs round-trip bit-exactly
through a segment (and through the server's memory tier, which such clients map),
clients fall back to TCP when the server cannot (or may not) map it, bad
references are rejected and counted while the server keeps serving, a byte changed in
the server's memory is a miss, and no segment outlives its connection in ``/dev/shm`` or
in the server's mappings."""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cbor2
import pytest
from support.kvtier_server import KVTierServerProcess
from support.tiers import key, make_pool, remote_manager, same_bytes, store_chunks, wait_until

from kvtier.config.node_address import parse_server_address
from kvtier.observability.stats import Counter, Stats, TierCounter, tier_counter
from kvtier.server import shm as server_shm
from kvtier.server.blobs import open_memory, put_in_memory, read_in_memory
from kvtier.storage import node_protocol as protocol
from kvtier.storage import node_shm as shm
from kvtier.storage.blob_store import StoreUnavailable
from kvtier.storage.node_protocol import Op
from kvtier.storage.node_store import KVTierStore

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="no writable /dev/shm")

SEGMENT = 1 << 20  # the tests' segments: 1 MiB


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server():
    with KVTierServerProcess(admin=True) as server:
        yield server


def client(server, namespace: str = "test", **options) -> KVTierStore:
    return KVTierStore("127.0.0.1", server.port, namespace=namespace, timeout_s=5.0, **options)


def stats(server) -> dict:
    return server.admin("/stats")[1]


def segments_in_dev_shm() -> set[str]:
    return {p.name for p in Path(shm.SHM_DIR).glob(f"{shm.NAME_PREFIX}*")}


def mapped_segments(pid: int) -> list[str]:
    """The kvtier segments process ``pid`` holds (deleted names included): mapped (a
    client), or open (the server, which never maps one)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    held = [line for line in maps.splitlines() if f"/{shm.NAME_PREFIX}" in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith(os.path.join(shm.SHM_DIR, shm.NAME_PREFIX)):
                held.append(link)
    return held


def mapped_arenas(pid: int) -> list[str]:
    """The servers' memory tiers (memfds) process ``pid`` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in maps.splitlines() if "/memfd:kvtier-pool-" in line]


def server_arena(pid: int) -> str:
    """``/proc/<pid>/fd/<n>`` of the memory tier of the server ``pid``."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        with contextlib.suppress(OSError):
            if os.readlink(path).startswith("/memfd:kvtier-pool-"):
                return path
    raise AssertionError("the server keeps no memory tier in a memfd")


def blobs(count: int, size: int) -> list[tuple[str, bytes]]:
    return [(f"b{i}", os.urandom(size)) for i in range(count)]


# -- the round trip ----------------------------------------------------------------------


def test_engines_share_chunks_bit_exactly_through_shared_memory(server, pool):
    before = stats(server)
    writer_stats, reader_stats = Stats(), Stats()
    writer = remote_manager(server.url, writer_stats)
    objs = store_chunks(writer, pool, range(4))
    reader = remote_manager(server.url, reader_stats)
    got = reader.get_many([key(i) for i in range(5)])
    assert all(same_bytes(got[i], objs[i]) for i in range(4)), "bit-exact through shm"
    assert got[4] is None
    assert reader_stats.get(tier_counter("kvtier", TierCounter.GET_HITS)) == 4
    after = stats(server)
    moved = sum(obj.data_nbytes for obj in objs.values())
    assert after["bytes_shm_in"] - before.get("bytes_shm_in", 0) > moved
    assert after["bytes_shm_out"] - before.get("bytes_shm_out", 0) > moved
    # only frames' headers crossed the socket
    assert after["bytes_in"] - before["bytes_in"] < moved // 10
    assert after["bytes_out"] - before["bytes_out"] < moved // 10
    for obj in got[:4]:
        obj.ref_down()
    writer.close()
    reader.close()


def test_chunks_read_in_batches_out_of_the_servers_memory_keep_their_places(server, pool):
    """Reading the server's memory, the remote tier asks for ``read_batch`` chunks per
    request; each lands in its key's place, absent ones in between included."""
    writer = remote_manager(server.url)
    seeds = range(40, 52)  # no other test's chunks
    stored = [i for i in seeds[:-1] if i not in (42, 49)]
    objs = store_chunks(writer, pool, stored)
    reader = remote_manager(server.url)
    got = dict(zip(seeds, reader.get_many([key(i) for i in seeds]), strict=True))
    assert [i for i, obj in got.items() if obj is not None] == stored
    assert all(same_bytes(got[i], objs[i]) for i in stored)
    probe = client(server)
    probe.ping()
    assert 1 < probe.read_batch < 12, "two batches, the first with an absent chunk"
    probe.close()
    for obj in got.values():
        if obj is not None:
            obj.ref_down()
    writer.close()
    reader.close()


@pytest.mark.parametrize("size", [0, 1, 4097, SEGMENT // 2, SEGMENT + 10])
def test_store_round_trip_of_any_size_in_shm_or_inline(server, size):
    store = client(server, shm_bytes=SEGMENT)
    items = blobs(3, size)
    store.put_many([(name, [data[:7], data[7:]]) for name, data in items])
    assert store.shm_active
    assert store.get_many([n for n, _ in items] + ["absent"]) == [d for _, d in items] + [None]
    lengths = store.read_many([n for n, _ in items], len)
    assert lengths == [size] * 3
    store.close()


def test_a_corrupt_blob_in_the_segment_is_a_miss(server, pool):
    """What a client wrote is stored as it is; the reader's checksum catches a bad one."""
    writer = remote_manager(server.url)
    store_chunks(writer, pool, [7])
    name = key(7).to_string()
    raw = client(server, namespace="org%2Fmodel-a")
    blob = bytearray(raw.get_many([name])[0])
    blob[-1] ^= 0xFF
    raw.put_many([(name, [bytes(blob)])])
    reader_stats = Stats()
    reader = remote_manager(server.url, reader_stats)
    assert reader.get_many([key(7)]) == [None]
    assert reader_stats.get(tier_counter("kvtier", TierCounter.CORRUPT)) == 1
    raw.close()
    writer.close()
    reader.close()


def test_a_get_copies_straight_out_of_the_servers_memory_and_lets_go_of_it():
    """A same-host client maps the server's memory tier, writes its blobs into buffers
    set aside there and copies each blob out of it under a lease; released after the
    get, the blob is evicted as any other."""
    with KVTierServerProcess("--max-local-cpu-size", str(4.5 / 1024), admin=True) as server:
        store = client(server, shm_bytes=SEGMENT)
        items = blobs(5, 1 << 20)
        store.put_many([(n, [d]) for n, d in items[:1]])
        assert store.get_many([items[0][0], "absent"]) == [items[0][1], None]
        assert store.read_many([items[0][0]], len) == [1 << 20]
        assert len(mapped_arenas(os.getpid())) == 1
        store.put_many([(n, [d]) for n, d in items[1:]])  # 4 MiB more: b0 (the oldest) goes
        assert store.get_many([n for n, _ in items]) == [None] + [d for _, d in items[1:]]
        # a client gone without letting go: the end of its connection ends its lease
        connected = stats(server)["shm_clients_connected"]
        segment, offer = shm.create_segment(SEGMENT)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(frame(Op.HELLO, {"namespace": "test", "shm": offer.as_header()}))
            assert "pool" in read_reply(sock)
            sock.sendall(frame(Op.GET, {"names": ["b1"], "pool": True}))
            assert read_reply(sock)["lease"] > 0
        segment.close()
        wait_until(lambda: stats(server)["shm_clients_connected"] == connected)
        assert store.read_many(["b2", "b3", "b4"], len) == [1 << 20] * 3  # b1 is the oldest
        store.put_many([(n, [d]) for n, d in items[:1]])
        assert store.read_many(["b0", "b1", "b2"], len) == [1 << 20, None, 1 << 20]
        store.close()
        assert not mapped_arenas(os.getpid())


def test_a_connection_that_released_a_lease_is_used_again(server):
    """The RELEASE after a get from the server's memory goes without waiting; its reply,
    read when the connection is next taken from the pool, does not make it look like a
    connection the server closed."""
    store = client(server, namespace="lease-reuse")
    store.put_many([("blob", [b"x" * 4096])])
    dialled = stats(server)["connections"]
    for _ in range(3):
        assert store.read_many(["blob"], len) == [4096]
        time.sleep(0.2)  # the RELEASE's reply arrives while the connection idles
    assert store.exists_many(["blob"]) == [True]
    assert stats(server)["connections"] == dialled
    assert stats(server)["requests_release"] >= 3
    store.close()


def test_without_memfd_the_memory_tier_stays_private(monkeypatch):
    arena = server_shm.open_arena(1 << 20)
    assert arena is not None and arena.offer()["size"] == 1 << 20
    arena.close()
    monkeypatch.delattr(os, "memfd_create")
    assert server_shm.open_arena(1 << 20) is None


def test_a_byte_changed_in_the_servers_memory_is_a_miss(server, pool):
    writer = remote_manager(server.url)
    store_chunks(writer, pool, [8])
    name = key(8).to_string()
    raw = client(server, namespace="org%2Fmodel-a")
    blob = raw.get_many([name])[0]
    with open(server_arena(server.process.pid), "r+b") as f, mmap.mmap(f.fileno(), 0) as tier:
        at = tier.find(blob)
        assert at >= 0
        tier[at + len(blob) - 1] ^= 0xFF
    reader_stats = Stats()
    reader = remote_manager(server.url, reader_stats)
    assert reader.get_many([key(8)]) == [None]
    assert reader_stats.get(tier_counter("kvtier", TierCounter.CORRUPT)) == 1
    raw.close()
    writer.close()
    reader.close()


def test_a_segment_its_client_truncates_is_an_error_reply_not_a_dead_server(server):
    """The client owns its segment's file and may truncate it after the server opened
    it: a server that mapped it would die of SIGBUS at its next copy."""
    segment, offer = shm.create_segment(SEGMENT)
    path = os.path.join(shm.SHM_DIR, offer.name)
    fd = os.open(path, os.O_RDWR)
    before = stats(server).get("rejects_bad_shm_ref", 0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(frame(Op.HELLO, {"namespace": "truncated", "shm": offer.as_header()}))
            assert read_reply(sock)["shm"] is True
            os.ftruncate(fd, 0)
            sock.sendall(frame(Op.PUT, {"names": ["a"], "sizes": [4096], "shm": [8192]}))
            assert "truncated" in read_reply(sock)["error"]
            sock.sendall(frame(Op.PUT, {"names": ["b"], "sizes": [3]}, b"abc"))
            assert read_reply(sock) == {"stored": 1}
            sock.sendall(frame(Op.GET, {"names": ["b"], "shm": [4096, 4096]}))
            assert read_reply(sock)["sizes"] == [3]  # written past the end: the file grows
    finally:
        os.close(fd)
        segment.close()
    assert stats(server)["rejects_bad_shm_ref"] == before + 1
    other = client(server, "truncated")
    assert other.get_many(["a", "b"]) == [None, b"abc"]
    other.close()


def test_the_servers_memory_can_be_written_but_never_resized(server):
    """A same-host client may write the memory tier's file, never shrink it: a mapping
    past the file's end kills the server, and every client mapping it, with SIGBUS."""
    raw = client(server, "sealed")
    raw.put_many([("kept", [b"still here"])])
    with open(server_arena(server.process.pid), "r+b") as f:
        for size in (0, os.fstat(f.fileno()).st_size + mmap.PAGESIZE):
            with pytest.raises(PermissionError):
                os.ftruncate(f.fileno(), size)
    assert raw.get_many(["kept"]) == [b"still here"]
    raw.close()


def test_a_memory_tier_the_client_cannot_map_leaves_it_on_its_segment(server, monkeypatch):
    """As for a client in another pid namespace: ``/proc/<pid>/fd/<fd>`` is not the file."""
    offers, attach = [], shm.attach_arena
    monkeypatch.setattr(shm, "attach_arena", lambda offer: offers.append(offer))
    store = client(server)
    store.put_many([("seg", [b"s" * 5000])])
    assert store.get_many(["seg"]) == [b"s" * 5000] and store.shm_active
    assert len(offers) == 1 and not mapped_arenas(os.getpid())
    store.close()
    offer = offers[0]
    assert attach({**offer, "name": "kvtier-pool-" + "0" * 32}) is None
    assert attach({**offer, "size": offer["size"] + 1}) is None
    assert attach({**offer, "fd": -1}) is None
    assert attach("pool") is None
    arena = attach(offer)
    assert arena is not None and arena.size == offer["size"]
    arena.close()


def test_namespaces_stay_apart_on_shared_memory(server):
    a, b = client(server, "model-x"), client(server, "model-y")
    a.put_many([("k", [b"only x"])])
    assert b.get_many(["k"]) == [None] and b.exists_many(["k"]) == [False]
    assert a.get_many(["k"]) == [b"only x"]
    assert a.shm_active and b.shm_active
    a.close()
    b.close()


# -- falling back to TCP ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "reason"),
    [(("--no-shm",), "disabled"), (("--max-shm-mb", "0.5"), "too_large")],
    ids=["no-shm", "too-large"],
)
def test_a_server_that_refuses_shared_memory_serves_over_tcp(flags, reason):
    before = segments_in_dev_shm()
    with KVTierServerProcess(*flags, admin=True) as server:
        store = client(server, shm_bytes=SEGMENT)
        items = blobs(2, 100_000)
        store.put_many([(n, [d]) for n, d in items])
        assert store.get_many([n for n, _ in items]) == [d for _, d in items]
        assert not store.shm_active
        counters = stats(server)
        assert counters[f"shm_refused_{reason}"] >= 1 and "bytes_shm_in" not in counters
        assert counters["shm_clients_connected"] == 0
        store.close()
        if reason == "disabled":
            assert "shared memory off" in server.log()
    assert segments_in_dev_shm() == before, "a refused segment is unlinked too"


def test_shm_0_in_the_url_keeps_a_client_on_tcp(server):
    before = stats(server).get("shm_attached", 0)
    address = parse_server_address(f"{server.url}?shm=0")
    store = client(server, shm=address.shm)
    store.put_many([("tcp", [b"x" * 1000])])
    assert store.get_many(["tcp"]) == [b"x" * 1000] and not store.shm_active
    assert stats(server).get("shm_attached", 0) == before
    store.close()


def test_a_segment_the_server_cannot_open_falls_back_to_tcp(server, monkeypatch):
    """As for a client on another host: the name or the nonce does not match there."""

    create = shm.create_segment

    def elsewhere(size):
        segment, offer = create(size)
        return segment, shm.ShmOffer(offer.name, offer.size, bytes(shm.NONCE_BYTES))

    monkeypatch.setattr(shm, "create_segment", elsewhere)
    before = stats(server).get("shm_refused_mismatch", 0)
    store = client(server)
    store.put_many([("far", [b"12345"])])
    assert store.get_many(["far"]) == [b"12345"] and not store.shm_active
    assert stats(server)["shm_refused_mismatch"] == before + 1
    store.close()


def test_server_address_options():
    address = parse_server_address("kvtier://127.0.0.1:7000?shm=0&shm_mb=8")
    assert (address.host, address.port, address.shm, address.shm_bytes) == (
        "127.0.0.1",
        7000,
        False,
        8 << 20,
    )
    assert parse_server_address("lm://h:1").shm
    for bad in (
        "kvtier://h:1?shm=2",
        "kvtier://h:1?shm_mb=0",
        "kvtier://h:1?x=1",
        "kvtier://h:1?shm=1&shm=0",
    ):
        with pytest.raises(ValueError, match="shm=0"):
            parse_server_address(bad)


# -- references the server must not trust -----------------------------------------------


def frame(op: int, header: object, payload: bytes = b"") -> bytes:
    head = cbor2.dumps(header)
    return protocol.PREFIX.pack(
        protocol.MAGIC, protocol.VERSION, op, 0, 7, len(head), len(payload)
    ) + (head + payload)


def read_reply(sock: socket.socket) -> dict:
    prefix = protocol.decode_prefix(_recv(sock, protocol.PREFIX_SIZE), 1 << 30)
    header = protocol.decode_header(_recv(sock, prefix.header_len))
    _recv(sock, prefix.payload_len)
    return header


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


HUGE = 1 << 20000  # CBOR carries it; Python cannot format an int of more than 4300 digits
BAD_REFERENCES = [
    (Op.PUT, {"names": ["a"], "sizes": [10], "shm": [SEGMENT - 5]}, "out of range"),
    (Op.PUT, {"names": ["a"], "sizes": [10], "shm": [-1]}, "out of range"),
    (Op.PUT, {"names": ["a"], "sizes": [10], "shm": ["0"]}, "out of range"),
    (Op.PUT, {"names": ["a", "b"], "sizes": [1, 1], "shm": [0]}, "list of 2 offsets"),
    (Op.PUT, {"names": ["a"], "sizes": [1 << 40], "shm": [0]}, "out of range"),
    (Op.PUT, {"names": ["a"], "sizes": [10], "shm": [HUGE]}, "out of range"),
    (Op.GET, {"names": ["a"], "shm": [0, SEGMENT + 1]}, "region out of range"),
    (Op.GET, {"names": ["a"], "shm": [HUGE, 1]}, "region out of range"),
    (Op.GET, {"names": ["a"], "shm": [SEGMENT, 1]}, "region out of range"),
    (Op.GET, {"names": ["a"], "shm": {"offset": 0}}, "region out of range"),
]


@pytest.mark.parametrize("with_segment", [True, False], ids=["segment", "no-segment"])
def test_bad_references_are_rejected_counted_and_harmless(server, with_segment):
    before = stats(server).get("rejects_bad_shm_ref", 0)
    hello: dict = {"namespace": "fuzz"}
    segment = None
    if with_segment:
        segment, offer = shm.create_segment(SEGMENT)
        hello["shm"] = offer.as_header()
    other = client(server, "fuzz")
    other.put_many([("kept", [b"still here"])])
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(frame(Op.HELLO, hello))
        assert read_reply(sock).get("shm", False) is with_segment
        for op, header, reason in BAD_REFERENCES:
            sock.sendall(frame(op, header))
            error = read_reply(sock)["error"]
            assert (reason if with_segment else "without a shared-memory segment") in error
        sock.sendall(frame(Op.PUT, {"names": ["a"], "sizes": [1], "shm": [0]}, b"x"))
        assert "error" in read_reply(sock)  # a payload and references at once
        sock.sendall(frame(Op.PING, {}))
        assert "error" not in read_reply(sock), "the connection stays usable"
        sock.sendall(frame(Op.GET, {"names": ["kept"], "pool": True}))
        got = read_reply(sock)  # a lent blob only where the client proved it is on this host
        assert ("pool" in got) is with_segment and got["sizes"] == [len(b"still here")]
    counted = stats(server)["rejects_bad_shm_ref"] - before
    assert counted == len(BAD_REFERENCES) + 1
    assert other.get_many(["kept", "a"]) == [b"still here", None], "nothing stored, others fine"
    other.close()
    if segment is not None:
        segment.close()


def test_puts_into_memory_out_of_order_are_rejected_counted_and_harmless(server):
    before = stats(server).get("rejects_bad_shm_ref", 0)
    blob = {"names": ["in-place"], "sizes": [10]}
    steps = [
        ({**blob, "pool": "commit"}, b"", "without a reservation"),
        ({**blob, "pool": "reserve"}, b"", None),
        ({"names": ["other"], "sizes": [10], "pool": "commit"}, b"", "other than those reserved"),
        ({**blob, "pool": "commit"}, b"", "without a reservation"),  # the bad one dropped it
        ({**blob, "pool": "send"}, b"", "'reserve' or 'commit'"),
        ({**blob, "pool": HUGE}, b"", "'reserve' or 'commit'"),
        ({**blob, "pool": "reserve"}, b"0123456789", "no payload"),
    ]
    segment, offer = shm.create_segment(SEGMENT)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(frame(Op.HELLO, {"namespace": "fuzz", "shm": offer.as_header()}))
        assert "pool" in read_reply(sock)
        for header, payload, reason in steps:
            sock.sendall(frame(Op.PUT, header, payload))
            reply = read_reply(sock)
            assert reason in reply["error"] if reason else reply["pool"][0] >= 0
        sock.sendall(frame(Op.PING, {}))
        assert "error" not in read_reply(sock), "the connection stays usable"
    segment.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(frame(Op.HELLO, {"namespace": "fuzz"}))
        assert "pool" not in read_reply(sock)
        sock.sendall(frame(Op.PUT, {**blob, "pool": "reserve"}))
        assert "needs shared memory" in read_reply(sock)["error"]
    assert stats(server)["rejects_bad_shm_ref"] - before == 7
    other = client(server, "fuzz")
    assert other.get_many(["in-place", "other"]) == [None, None], "nothing stored"
    other.close()


def test_a_put_memory_has_no_room_for_goes_by_the_segment_or_inline(tmp_path):
    """Memory sets no buffer aside for a blob larger than it: the blob goes the other
    way (to disk, here), and a reservation its client never commits is let go of."""
    args = ("--max-local-cpu-size", str(2.5 / 1024), "--local-disk", str(tmp_path))
    with KVTierServerProcess(*args, admin=True) as server:
        store = client(server, shm_bytes=SEGMENT)
        small, large = b"s" * (1 << 20), os.urandom(3 << 20)
        store.put_many([("small", [small]), ("large", [large])])
        assert store.get_many(["small", "large"]) == [small, large]
        connected = stats(server)["shm_clients_connected"]
        segment, offer = shm.create_segment(SEGMENT)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(frame(Op.HELLO, {"namespace": "test", "shm": offer.as_header()}))
            assert "pool" in read_reply(sock)
            sock.sendall(frame(Op.PUT, {"names": ["x"], "sizes": [2 << 20], "pool": "reserve"}))
            assert read_reply(sock)["pool"][0] >= 0  # "small" evicted for it (on disk still)
        segment.close()
        wait_until(lambda: stats(server)["shm_clients_connected"] == connected)
        fresh = os.urandom(2 << 20)
        store.put_many([("fresh", [fresh])])  # room again: the reservation was let go of
        assert store.get_many(["fresh", "x"]) == [fresh, None]
        gauges = stats(server)
        assert gauges["memory_blobs"] == 1 and gauges["memory_bytes_used"] >= 2 << 20
        store.close()


def test_a_malformed_offer_is_refused_and_the_client_stays_on_tcp(server):
    huge = {"name": f"kvtier-1-{'0' * 32}", "size": HUGE, "nonce": bytes(16)}
    for offer in ({"name": "../../etc/passwd", "size": SEGMENT, "nonce": bytes(16)}, huge, "x", {}):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(frame(Op.HELLO, {"namespace": "fuzz", "shm": offer}))
            reply = read_reply(sock)
            assert reply["shm"] is False and reply["shm_error"].startswith("malformed")
            sock.sendall(frame(Op.EXISTS, {"names": ["a"]}))
            assert read_reply(sock)["present"] == [False]
    assert stats(server)["shm_refused_malformed"] >= 4


# -- cleanup ----------------------------------------------------------------------------


def test_no_segment_outlives_its_connection(server):
    before = segments_in_dev_shm()
    stores = [client(server, f"m{i}") for i in range(3)]
    threads = [threading.Thread(target=s.put_many, args=([("k", [b"v" * 5000])],)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(s.shm_active for s in stores)
    assert segments_in_dev_shm() == before, "names are unlinked once both ends map them"
    pid = server.process.pid
    assert len(mapped_segments(pid)) >= 3
    for store in stores:
        store.close()
    wait_until(lambda: not mapped_segments(pid))
    assert stats(server)["shm_clients_connected"] == 0


CLIENT_SCRIPT = """
import sys, time
from kvtier.storage.node_store import KVTierStore
store = KVTierStore("127.0.0.1", int(sys.argv[1]), namespace="killed", timeout_s=5.0)
store.put_many([("k", [b"v" * 100000])])
assert store.shm_active
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_client_leaves_nothing_behind(server):
    before = segments_in_dev_shm()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, str(server.port)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        assert mapped_segments(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        child.kill()
    wait_until(lambda: not mapped_segments(server.process.pid))
    assert segments_in_dev_shm() == before
    client(server).ping()


def test_a_killed_server_leaves_nothing_behind_and_clients_reconnect():
    before = segments_in_dev_shm()
    with KVTierServerProcess() as server:
        store = client(server)
        store.put_many([("k", [b"v" * 1000])])
        assert store.shm_active and mapped_segments(os.getpid())
        server.kill()
        with pytest.raises(StoreUnavailable):
            store.get_many(["k"])
        assert not mapped_segments(os.getpid()), "the client unmapped its dead connections"
        assert not mapped_arenas(os.getpid()), "and the dead server's memory tier"
        server.start()
        assert store.get_many(["k"]) == [None]  # a fresh, empty server
        assert store.shm_active and len(mapped_arenas(os.getpid())) == 1
        store.close()
        assert not mapped_segments(os.getpid()) and not mapped_arenas(os.getpid())
    assert segments_in_dev_shm() == before


# -- the memory tier under concurrent readers -------------------------------------------


def test_a_blob_being_read_is_never_evicted_and_never_overwritten_under_its_reader():
    """The memory tier's rule (``kvtier.storage.cpu``): a put evicts idle blobs, never
    one being read (that frees nothing until the read ends), and is refused at once when
    what is idle is not enough; a blob overwritten while it is read keeps its bytes for
    the reader and returns its memory when the read ends."""
    memory = open_memory(3000)  # room for two 1000-byte blobs beside "a"
    assert put_in_memory(memory, ("ns", "a"), b"a" * 1000)

    def write_meanwhile(view: memoryview) -> bytes:
        for i in range(4):  # each put past the second evicts an idle blob, never "a"
            assert put_in_memory(memory, ("ns", f"b{i}"), bytes([i]) * 1000)
        assert memory.contains(("ns", "a"))
        assert not put_in_memory(memory, ("ns", "big"), bytes(2000))  # a's room is in use
        assert put_in_memory(memory, ("ns", "a"), b"z" * 1000)  # the last put wins
        return bytes(view)

    assert read_in_memory(memory, ("ns", "a"), write_meanwhile) == b"a" * 1000
    assert read_in_memory(memory, ("ns", "a"), bytes) == b"z" * 1000
    assert memory.used_bytes <= 3000 and memory.stats.get(Counter.EVICTIONS) >= 3
    assert put_in_memory(memory, ("ns", "big"), bytes(2000))  # the read ended: room again
    assert read_in_memory(memory, ("ns", "big"), bytes) == bytes(2000)
    memory.close()
