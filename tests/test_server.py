"""``kvtier serve`` as engines meet it: a real server process, reached through
``remote_url: kvtier://…`` by storage managers (as engines' tiers), killed, restarted,
stopped with SIGTERM, fed malformed frames, and watched through its admin API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import subprocess
import threading
import time

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kvtier_server import KVTierServerProcess, free_port, serve_command
from support.redis_server import REDIS_MISSING, RedisServer, redis_available
from support.tiers import (
    check_remote_down,
    key,
    make_pool,
    remote_manager,
    same_bytes,
    store_chunks,
    wait_until,
)

from kvtier.config import load_config
from kvtier.config.node_address import parse_server_url
from kvtier.observability.stats import Stats, TierCounter, tier_counter
from kvtier.server.cache import BlobCache
from kvtier.server.leases import Leases
from kvtier.server.server import KVTierServer
from kvtier.storage import node_protocol as protocol
from kvtier.storage import schemes
from kvtier.storage.blob_store import StoreUnavailable
from kvtier.storage.node_protocol import Op
from kvtier.storage.node_store import KVTierStore

TIMEOUT_MS = 500


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server():
    with KVTierServerProcess("--max-frame-mb", "4", admin=True) as server:
        yield server


# -- engines sharing one server --------------------------------------------------------


def test_a_second_engine_loads_what_the_first_stored_bit_exactly(server, pool):
    writer_stats, reader_stats = Stats(), Stats()
    writer = remote_manager(server.url, writer_stats)
    objs = store_chunks(writer, pool, range(4))
    assert writer_stats.get(tier_counter("kvtier", TierCounter.PUT_CHUNKS)) == 4
    reader = remote_manager(server.url, reader_stats)  # an empty CPU tier
    keys = [key(i) for i in range(6)]
    assert reader.lookup_prefix(keys) == 4
    got = reader.get_many(keys)
    assert all(same_bytes(got[i], objs[i]) for i in range(4)), "bit-exact across engines"
    assert got[4:] == [None, None]
    assert reader_stats.get(tier_counter("kvtier", TierCounter.GET_HITS)) == 4
    writer.close()
    reader.close()


def test_models_do_not_see_each_other(server, pool):
    a = remote_manager(server.url, namespace="org/model-x")
    store_chunks(a, pool, [11])
    b = remote_manager(server.url, namespace="org/model-y")
    assert b.lookup_prefix([key(11)]) == 0
    assert b.get_many([key(11)]) == [None]
    b.clear()  # clears model-y's namespace only
    a.cpu.clear()
    assert a.lookup_prefix([key(11)]) == 1
    a.close()
    b.close()


def test_a_model_name_too_long_for_a_namespace_is_refused_naming_model_name(server):
    """A vLLM engine's model name is its --model as given: a deep local path, or one in
    another script, can be longer percent-encoded than a namespace may be."""
    with pytest.raises(ValueError, match=r"model_name: .* at most 256 characters .* not 600"):
        remote_manager(server.url, namespace="é" * 100)  # %C3%A9 each
    remote_manager(server.url, namespace="é" * 42).close()  # 252 characters: it fits


def test_lm_and_kvtier_urls_are_accepted_and_parsed():
    for url in ("kvtier://127.0.0.1:65432", "lm://localhost:65432", "KVTIER://[::1]:7000"):
        assert load_config({"remote_url": url}, env={}).remote_url == url
        assert schemes.load_module(url).__name__ == "kvtier.storage.node_store"
    assert parse_server_url("lm://localhost:65432") == ("localhost", 65432)
    assert parse_server_url("kvtier://[::1]:7000/") == ("::1", 7000)
    for bad in (
        "kvtier://host",
        "kvtier://:80",
        "kvtier://h:1/path",
        "kvtier://h:99999",
        "http://h:80",
        "redis://h:6379",
    ):
        with pytest.raises(ValueError, match=r"remote_url .*kvtier://host:port"):
            parse_server_url(bad)


# -- faults: crash, restart, stop ------------------------------------------------------


def test_killed_server_is_a_miss_and_a_restart_resumes_hits(tmp_path, pool):
    disk = str(tmp_path / "disk")
    with KVTierServerProcess("--local-disk", disk, "--max-local-disk-size", "1") as server:
        stats = Stats()
        manager = remote_manager(server.url, stats)
        store_chunks(manager, pool, [1, 2])
        manager.cpu.clear()
        assert manager.lookup_prefix([key(1), key(2)]) == 2

        server.kill()
        check_remote_down(manager, pool, "kvtier", budget_s=3 * TIMEOUT_MS / 1000 + 1.0)

        server.start()  # the same port; memory is empty, the disk index is reopened
        remote = manager.lower[0]
        wait_until(lambda: remote.is_up)
        manager.cpu.clear()
        assert manager.lookup_prefix([key(1), key(2)]) == 2, "hits resume, same client"
        assert stats.get(tier_counter("kvtier", TierCounter.RECONNECTS)) == 1
        manager.close()


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_a_server_restarted_while_the_client_idles_is_not_an_outage(tmp_path, pool, shm):
    disk = str(tmp_path / "disk")
    with KVTierServerProcess("--local-disk", disk, "--max-local-disk-size", "1") as server:
        stats = Stats()
        url = server.url if shm else f"{server.url}?shm=0"
        manager = remote_manager(url, stats)
        objs = store_chunks(manager, pool, [1, 2])
        manager.cpu.clear()
        server.kill()
        server.start()  # between two requests: the pooled connections are closed
        assert manager.lookup_prefix([key(1), key(2)]) == 2
        got = manager.get_many([key(1), key(2)])
        assert all(same_bytes(g, objs[i]) for g, i in zip(got, (1, 2), strict=True))
        assert stats.get(tier_counter("kvtier", TierCounter.ERRORS)) == 0
        assert manager.lower[0].is_up
        manager.close()


def test_sigterm_stops_cleanly_with_exit_code_0(pool):
    with KVTierServerProcess("--max-local-cpu-size", "0.1") as server:
        manager = remote_manager(server.url)
        store_chunks(manager, pool, [1])
        assert server.terminate() == 0
        log = server.log()
        assert f"listening on kvtier://127.0.0.1:{server.port}" in log
        assert "tiers: memory 0.10 GiB" in log and "stopped" in log
        assert "Traceback" not in log
        manager.close()


def test_a_non_loopback_address_needs_a_token():
    done = subprocess.run(
        serve_command("--host", "0.0.0.0", "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--auth-token" in done.stderr and "loopback" in done.stderr


# -- authentication and the protocol ---------------------------------------------------


def test_clients_must_send_the_token(pool):
    with KVTierServerProcess("--auth-token", "s3cret", admin=True, token="s3cret") as server:
        wrong = KVTierStore("127.0.0.1", server.port, namespace="m", token="nope")
        with pytest.raises(StoreUnavailable, match="unauthenticated"):
            wrong.ping()
        none = KVTierStore("127.0.0.1", server.port, namespace="m")
        with pytest.raises(StoreUnavailable, match="unauthenticated"):
            none.exists_many(["a"])
        manager = remote_manager(server.url, server_token="s3cret")
        store_chunks(manager, pool, [1])
        manager.cpu.clear()
        assert manager.lookup_prefix([key(1)]) == 1
        manager.close()
        stats = server.admin("/stats")[1]
        assert stats["rejects_unauthenticated"] == 2
        assert server.admin("/clear", "POST")[0] == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert server.admin("/clear", "POST", auth) == (200, {"deleted": 1})


def test_a_refused_token_names_the_setting_that_sends_it():
    with KVTierServerProcess("--auth-token", "s3cret", token="s3cret") as server:
        for token, sent in (("nope", "sent one it does not take"), (None, "sent none")):
            client = KVTierStore("127.0.0.1", server.port, namespace="m", token=token)
            with pytest.raises(StoreUnavailable, match=f"{sent}: set server_token") as error:
                client.exists_many(["a"])
            assert "s3cret" not in str(error.value)
            client.close()


def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; what comes back until the server closes it
    (or 2 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def frame(op: int, header: object, payload: bytes = b"", version: int = protocol.VERSION) -> bytes:
    head = cbor2.dumps(header)
    return protocol.PREFIX.pack(protocol.MAGIC, version, op, 0, 7, len(head), len(payload)) + (
        head + payload
    )


HELLO = frame(Op.HELLO, {"namespace": "fuzz"})


def error_of(reply: bytes) -> str:
    prefix = protocol.decode_prefix(reply[: protocol.PREFIX_SIZE], 1 << 30)
    body = reply[protocol.PREFIX_SIZE :][: prefix.header_len]
    return protocol.decode_header(body).get("error", "")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "malformed: bad magic"),
        (frame(Op.HELLO, {"namespace": "x"}, version=9), "unsupported protocol version 9"),
        (frame(99, {}), "unknown op 99"),
        (HELLO + struct.pack("<4sBBHQII", b"KVTS", 1, Op.PUT, 0, 1, 0, 5 << 20), "exceeds"),
        (frame(Op.HELLO, ["not", "a", "map"]), "not a CBOR map"),
        (frame(Op.PING, {}), "unauthenticated"),
        (frame(Op.HELLO, {"namespace": "a/b"}), "unauthenticated"),
        (frame(Op.HELLO, {"namespace": "x"}, b"payload"), "no payload"),
        (frame(Op.PUT, {"names": ["a"], "sizes": [3]}, b"abc"), "starts with a HELLO"),
    ],
    ids=[
        "http",
        "version",
        "op",
        "oversized",
        "header",
        "no-hello",
        "namespace",
        "hello-payload",
        "put-before-hello",
    ],
)
def test_bad_frames_are_rejected_and_the_server_keeps_serving(server, data, reason):
    before = server.admin("/stats")[1].get("rejects", 0)
    replies = raw_exchange(server.port, data)
    assert reason in error_of(replies[-_last_reply_len(replies) :])
    assert server.admin("/stats")[1]["rejects"] == before + 1
    server.client().ping()


def _last_reply_len(replies: bytes) -> int:
    """The length of the last frame in ``replies`` (frames back to back)."""
    offset = last = 0
    while offset < len(replies):
        prefix = protocol.decode_prefix(replies[offset : offset + protocol.PREFIX_SIZE], 1 << 30)
        last = protocol.PREFIX_SIZE + prefix.header_len + prefix.payload_len
        offset += last
    return last


@pytest.mark.parametrize(
    ("sizes", "reason"),
    [
        ([3], "add up"),
        # CBOR carries it, and Python cannot format an int of more than 4300 digits
        ([1 << 20000], "list of 1 integers"),
    ],
    ids=["not-adding-up", "huge"],
)
def test_bad_fields_are_an_error_reply_on_a_connection_that_stays_open(server, sizes, reason):
    bad = frame(Op.PUT, {"names": ["a"], "sizes": sizes}, b"12")
    replies = raw_exchange(server.port, HELLO + bad + frame(Op.PING, {}))
    assert replies.count(protocol.MAGIC) == 3  # HELLO, the error, then the PING's answer
    assert reason in error_of(replies[protocol.PREFIX_SIZE + _hello_len(replies) :])


def _hello_len(replies: bytes) -> int:
    return protocol.decode_prefix(replies[: protocol.PREFIX_SIZE], 1 << 30).header_len


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    garbage=st.binary(max_size=256),
    cut=st.integers(min_value=0, max_value=64),
    authed=st.booleans(),
)
def test_fuzzed_frames_never_hurt_the_server(server, garbage, cut, authed):
    good = frame(Op.PUT, {"names": ["k"], "sizes": [4]}, b"abcd")
    data = (HELLO if authed else b"") + good[:cut] + garbage
    raw_exchange(server.port, data)
    server.client().ping()


class InProcessServer:
    """A ``KVTierServer`` on an event loop of its own in this process, for bounds too
    slow to reach in a subprocess (``frame_timeout_s``)."""

    def __init__(self, **options):
        config = load_config({"max_local_cpu_size": 0.004}, env={})
        self.cache = BlobCache(config, Stats())
        self.server = KVTierServer(
            self.cache, self.cache.stats, host="127.0.0.1", port=0, token=None, **options
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.port = self.server.port

    def client(self) -> KVTierStore:
        return KVTierStore("127.0.0.1", self.port, namespace="in-process", timeout_s=2.0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1.0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.cache.close(0)


def test_a_client_over_the_limit_is_told_which_flag_refused_it():
    """An engine whose connection is refused marks the server down: its log must say
    that the server is full (``--max-clients``), not show a bare connection reset."""
    holder = InProcessServer(max_clients=1)
    try:
        held = holder.client()
        held.ping()
        wait_until(lambda: holder.server.clients == 1)
        with pytest.raises(
            StoreUnavailable, match=r"more than 1 clients \(kvtier serve --max-clients"
        ):
            holder.client().ping()
        assert holder.server.stats.get("rejects_too_many_clients") == 1
        held.close()
        wait_until(lambda: holder.server.clients == 0)
        holder.client().ping()
    finally:
        holder.close()


def test_a_client_that_stalls_loses_its_slot_but_an_idle_one_keeps_it():
    holder = InProcessServer(max_clients=3, frame_timeout_s=0.5)
    try:
        silent = socket.create_connection(("127.0.0.1", holder.port))  # never says HELLO
        stalled = socket.create_connection(("127.0.0.1", holder.port))
        stalled.sendall(HELLO + frame(Op.PING, {})[:10])  # half a frame, then nothing
        idle = holder.client()
        idle.ping()  # then nothing: a pooled connection may idle (up to --idle-timeout)
        other = holder.client()
        other.ping()  # the silent connection holds no slot: this one takes the last
        wait_until(lambda: holder.server.clients == 3)
        late = holder.client()
        with pytest.raises(StoreUnavailable):
            late.ping()  # every slot held
        wait_until(lambda: holder.server.stats.get("rejects_timeout") == 2, timeout=5)
        late.ping()
        time.sleep(0.6)
        idle.ping()
        assert holder.server.stats.get("rejects_timeout") == 2
        for sock in (silent, stalled):
            sock.close()
        for client in (idle, other, late):
            client.close()
    finally:
        holder.close()


def test_connections_without_a_hello_never_keep_a_client_out():
    """A slot is taken by a HELLO: sockets that never send one, and clients that dial in
    a loop and are refused theirs (no token), leave room for one that says it at once."""
    holder = InProcessServer(max_clients=4)
    stop = threading.Event()

    def refused_in_a_loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):  # closed to make room for another
                raw_exchange(holder.port, frame(Op.HELLO, {"namespace": "a/b"}))

    loops = [threading.Thread(target=refused_in_a_loop) for _ in range(2)]
    silent = [socket.create_connection(("127.0.0.1", holder.port)) for _ in range(5)]
    try:
        wait_until(lambda: holder.server.stats.get("rejects_crowded_out") == 1, timeout=5)
        for thread in loops:
            thread.start()
        for _ in range(20):  # a new connection each time
            client = holder.client()
            client.ping()
            client.close()
    finally:
        stop.set()
        for thread in loops:
            if thread.is_alive():
                thread.join(10)
        for sock in silent:
            sock.close()
        holder.close()


def test_a_lease_past_its_time_lets_go_without_another_request():
    """Blobs leased and never released (a client stuck, idling on its connection) are
    let go of once the lease expires, so a PUT finds room again."""
    holder = InProcessServer(leases=Leases(ttl_s=0.1))
    try:
        client = holder.client()
        client.put_many([("a", [b"1" * 1000])])
        leases = holder.server.leases
        leases.grant(holder.cache.lease("in-process", ["a"]))
        assert len(leases) == 1
        wait_until(lambda: len(leases) == 0, timeout=5)
        client.close()
    finally:
        holder.close()


def test_a_lease_is_let_go_of_when_its_connection_ends():
    holder = InProcessServer(leases=Leases(ttl_s=600), plane=Plane())
    try:
        client = holder.client()
        client.put_many([("a", [b"1" * 1000])])
        assert client.call(Op.LEASE, {"names": ["a"]})["sizes"] == [1000]
        assert len(holder.server.leases) == 1
        client.close()
        wait_until(lambda: len(holder.server.leases) == 0, timeout=5)
    finally:
        holder.close()


class Plane:
    """What a LEASE asks of a NIXL plane."""

    name, epoch = "fake", 0

    def wake(self) -> None:
        pass


def test_a_reason_to_reject_is_logged_once_and_counted_every_time(caplog):
    holder = InProcessServer()
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.server"):
            for _ in range(5):
                raw_exchange(holder.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                raw_exchange(holder.port, frame(Op.HELLO, {"namespace": "a/b"}))
        assert holder.server.stats.get("rejects_malformed") == 5
        assert holder.server.stats.get("rejects_unauthenticated") == 5
        logged = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert len(logged) == 2 and "bad magic" in logged[0] and "namespace" in logged[1]
    finally:
        holder.close()


# -- bounds, admin API, remote behind --------------------------------------------------


def test_memory_stays_within_its_bound(tmp_path):
    with KVTierServerProcess("--max-local-cpu-size", "0.001", admin=True) as server:
        client = server.client()
        bound = round(0.001 * 2**30)  # GB are 2**30 bytes
        blob = bytes(200_000)
        for i in range(20):  # 4 MB into a 1 MiB tier
            client.put_many([(f"b{i}", [blob])])
            assert server.admin("/stats")[1]["memory_bytes_used"] <= bound
        client.put_many([("huge", [bytes(bound + 1)])])  # larger than the tier: refused
        stats = server.admin("/stats")[1]
        assert stats["memory_evictions"] >= 15 and stats["puts_refused"] == 1
        assert client.exists_many(["b19", "b0", "huge"]) == [True, False, False]
        client.close()


def test_admin_api_reports_and_clears(server):
    client = server.client("admin-test")
    client.put_many([("x", [b"1234"]), ("y", [b"56"])])
    status, health = server.admin("/health")
    assert status == 200 and health["status"] == "ok" and health["tiers"]["memory"]["up"]
    stats = server.admin("/stats")[1]
    assert stats["clients_connected"] >= 1 and stats["memory_blobs"] >= 2
    status, metrics = server.admin("/metrics")
    assert status == 200
    for name in ("requests_total", "bytes_in_total", "bytes_out_total", "rejects_total"):
        assert f"kvtier_server_{name} " in metrics
    assert "kvtier_server_memory_bytes_used " in metrics
    assert "kvtier_server_clients_connected " in metrics
    assert server.admin("/clear", "POST")[0] == 200
    assert client.exists_many(["x", "y"]) == [False, False]
    assert server.admin("/nope")[0] == 404
    client.close()


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_a_server_writes_through_to_redis_and_a_fresh_one_reads_it(pool):
    with RedisServer() as redis:
        remote = ["--remote-url", redis.url]
        with KVTierServerProcess(*remote) as first:
            writer = remote_manager(first.url)
            objs = store_chunks(writer, pool, [1, 2])
            raw_key = f"kvtier:org%2Fmodel-a:{key(1).to_string()}"
            wait_until(lambda: redis.client().exists(raw_key))  # an engine's own Redis key
            writer.close()
            spaces = {ns: first.client(ns) for ns in ("a", "a:b")}  # clients of their own
            spaces["a"].put_many([("b:x", [b"a's"])])
            spaces["a:b"].put_many([("x", [b"a:b's"])])
            wait_until(lambda: len(redis.client().keys("kvtier:[a!]*")) == 2)
            for client in spaces.values():
                client.close()
        with KVTierServerProcess(*remote) as second:  # empty memory, same Redis
            reader = remote_manager(second.url)
            assert reader.lookup_prefix([key(1), key(2)]) == 2
            got = reader.get_many([key(1), key(2)])
            assert same_bytes(got[0], objs[1]) and same_bytes(got[1], objs[2])
            reader.close()
            spaces = {ns: second.client(ns) for ns in ("a", "a:b")}
            assert spaces["a:b"].get_many(["x", "b:x"]) == [b"a:b's", None]
            assert spaces["a"].get_many(["x", "b:x"]) == [None, b"a's"]
            spaces["a"].clear()  # namespace a's blobs only
            assert spaces["a:b"].exists_many(["x"]) == [True]
            for client in spaces.values():
                client.close()


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_batch_read_from_memory_and_disk_comes_back_in_the_order_asked(tmp_path, shm):
    disk = str(tmp_path / "disk")
    args = ("--local-disk", disk, "--max-local-cpu-size", "0.001")  # room for one blob
    with KVTierServerProcess(*args) as server:
        client = KVTierStore("127.0.0.1", server.port, namespace="order", shm=shm)
        first, second = bytes([1]) * 600_000, bytes([2]) * 600_000
        client.put_many([("first", [first])])
        client.put_many([("second", [second])])  # evicts the first from memory, not disk
        assert client.get_many(["first", "second"]) == [first, second]
        assert client.get_many(["second", "first"]) == [second, first]
        client.close()


# -- limits: names per request, idle connections -------------------------------------


@pytest.fixture(scope="module")
def limited():
    with KVTierServerProcess("--max-names", "8", "--idle-timeout", "3", admin=True) as server:
        yield server


def _replies(data: bytes) -> list[dict]:
    """The headers of the frames in ``data`` (frames back to back)."""
    headers, offset = [], 0
    while offset < len(data):
        prefix = protocol.decode_prefix(data[offset : offset + protocol.PREFIX_SIZE], 1 << 30)
        start = offset + protocol.PREFIX_SIZE
        headers.append(protocol.decode_header(data[start : start + prefix.header_len]))
        offset = start + prefix.header_len + prefix.payload_len
    return headers


def test_a_request_over_the_names_limit_is_an_error_reply_on_an_open_connection(limited):
    names = [f"n{i}" for i in range(9)]
    put = frame(Op.PUT, {"names": names, "sizes": [1] * 9}, b"x" * 9)
    data = HELLO + frame(Op.EXISTS, {"names": names}) + put + frame(Op.PING, {})
    hello, exists, stored, ping = _replies(raw_exchange(limited.port, data))
    assert hello["max_names"] == 8 and hello["idle_timeout_s"] == 3
    for reply in (exists, stored):
        assert "9 names in one request, over the server's limit of 8" in reply["error"]
    assert ping == {}  # the connection stayed open, the PUT's payload read past
    stats = limited.admin("/stats")[1]
    assert stats["rejects_too_many_names"] == 2
    assert stats.get("puts", 0) == 0


def test_a_client_knows_the_ops_its_server_announced(limited):
    """The HELLO reply lists the ops the server answers; a server that lists none is one
    from before the list, which answers every op but those added since (CORRUPT)."""
    client = limited.client()
    assert not client.answers(Op.CORRUPT)  # no HELLO yet: only what every server answers
    client.ping()
    assert client.answers(Op.CORRUPT) and client.answers(Op.GET)
    client.close()
    assert protocol.ops_of({}) == protocol.UNANNOUNCED_OPS == frozenset(Op) - {Op.CORRUPT}
    assert protocol.ops_of({"ops": [1, 4, 99]}) == {Op.HELLO, Op.GET}  # 99: a newer op
    with pytest.raises(protocol.ProtocolError, match="'ops'"):
        protocol.ops_of({"ops": "all"})


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_clients_split_their_batches_to_the_servers_names_limit(limited, shm):
    client = KVTierStore("127.0.0.1", limited.port, namespace=f"split-{shm}", shm=shm)
    names = [f"blob{i}" for i in range(21)]
    before = limited.admin("/stats")[1]
    client.put_many([(name, [name.encode() * 3]) for name in names])
    assert client.exists_many([*names, "absent"]) == [True] * 21 + [False]
    assert client.get_many(names[::-1]) == [name.encode() * 3 for name in names[::-1]]
    seen = client.read_each(names, lambda i, blob: (i, bytes(blob)))
    assert seen == [(i, name.encode() * 3) for i, name in enumerate(names)]
    assert client.delete_many(names) == 21
    client.close()
    after = limited.admin("/stats")[1]
    assert after["request_errors"] == before["request_errors"]
    assert after["puts"] - before.get("puts", 0) == 21


def test_an_idle_connection_is_closed_and_the_client_dials_again_unnoticed(limited):
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as sock:
        sock.sendall(HELLO)
        started = time.monotonic()
        got = b""
        while chunk := sock.recv(65536):  # the HELLO reply, then the server's close
            got += chunk
        assert 2.5 < time.monotonic() - started < 9
    assert _replies(got) == [
        {
            "max_frame": 256 << 20,
            "max_names": 8,
            "idle_timeout_s": 3.0,
            "version": 1,
            "ops": [int(op) for op in Op],
        }
    ]
    wait_until(lambda: limited.admin("/stats")[1].get("connections_idle_closed", 0) >= 1)
    client = limited.client()
    client.ping()
    first = limited.admin("/stats")[1]
    time.sleep(1.6)  # over half the idle timeout: the client dials afresh, not racing a close
    client.ping()
    second = limited.admin("/stats")[1]
    assert second["connections"] == first["connections"] + 1
    assert second["request_errors"] == first["request_errors"]
    wait_until(  # the server closed the connection the client left
        lambda: (
            limited.admin("/stats")[1]["connections_idle_closed"]
            == first["connections_idle_closed"] + 1
        ),
        timeout=10,
    )
    client.ping()
    third = limited.admin("/stats")[1]["connections"]
    client.ping()  # within half the timeout: the same connection
    assert limited.admin("/stats")[1]["connections"] == third
    client.close()


def test_pooled_connections_past_half_the_idle_timeout_are_all_let_go(limited):
    client = limited.client(namespace="pool-prune")
    client.put_many([("blob", [b"abc"])])
    both = threading.Barrier(2, timeout=10)  # two reads at once: two pooled connections
    readers = [
        threading.Thread(target=client.read_each, args=(["blob"], lambda i, b: both.wait()))
        for _ in range(2)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(10)
    before = limited.admin("/stats")[1]
    time.sleep(0.9)
    client.ping()  # one of the two is used again; the other idles on
    time.sleep(0.7)  # that one past half the idle timeout (3 s), under the server's close
    client.ping()  # on the one used since; the other is closed by the client, not left
    wait_until(
        lambda: limited.admin("/stats")[1]["clients_connected"] == before["clients_connected"] - 1,
        timeout=0.8,
    )
    after = limited.admin("/stats")[1]
    assert after["connections"] == before["connections"]  # no connection dialled
    assert after["connections_idle_closed"] == before["connections_idle_closed"]
    client.close()
