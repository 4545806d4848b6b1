"""Peers between ``kvtier serve`` processes: chunks an engine stored through server a are
served to an engine on server b, pulled with NIXL (where it is installed) or over TCP,
verified and kept; every fault (a peer killed, restarted, stopped, refusing the token) is
a miss within the timeout, and server b goes on serving."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import cbor2
import pytest
import torch
from support.kvtier_server import NIXL_MISSING, KVTierServerProcess, free_port, nixl_installed
from support.tiers import check_served as served
from support.tiers import (
    in_a_newer_format,
    key,
    make_pool,
    remote_manager,
    store_chunks,
    wait_until,
)

from kvtier.observability.stats import Stats
from kvtier.server.peers import Peers
from kvtier.server.stores import MAX_OPEN_STORES
from kvtier.storage import node_protocol as protocol
from kvtier.storage.cpu import LocalCPUTier
from kvtier.storage.node_connection import recv
from kvtier.storage.serde import make_serde
from kvtier.storage.wire import encode

TIMEOUT_MS = 1000  # the servers' remote_timeout_ms, under their readers' (READER_TIMEOUT_MS)
READER_TIMEOUT_MS = 3000  # a loaded 2-core CI machine: a peer's answer may take a second


TRANSPORTS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason=NIXL_MISSING)),
]


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def server(
    *args: str,
    peers=(),
    transport: str = "tcp",
    token: str | None = None,
    port: int | None = None,
) -> KVTierServerProcess:
    """A server with peers ``peers`` (on ``port``: a free one by default), whose calls to
    them are bounded by ``TIMEOUT_MS``."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
        config.write(f"remote_timeout_ms: {TIMEOUT_MS}\nremote_reconnect_max_ms: 200\n")
    flags = [f"--peer={p.url}" for p in peers]
    return KVTierServerProcess(
        "--config",
        config.name,
        *args,
        *flags,
        "--peer-transport",
        transport,
        admin=True,
        token=token,
        port=port,
    )


def stats(server: KVTierServerProcess) -> dict:
    with urllib.request.urlopen(server.admin_url + "/stats", timeout=5) as reply:
        return json.load(reply)


def health(server: KVTierServerProcess) -> dict:
    with urllib.request.urlopen(server.admin_url + "/health", timeout=5) as reply:
        return json.load(reply)


def lookup(server: KVTierServerProcess, hashes: list[str], query: str = "") -> int:
    body = json.dumps({"model": "org/model-a", "hashes": hashes}).encode()
    request = urllib.request.Request(server.admin_url + "/lookup" + query, data=body)
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.load(reply)["cached_chunks"]


def check_served(reader_url: str, objs: dict) -> None:
    served(reader_url, objs, remote_timeout_ms=READER_TIMEOUT_MS)


def check_misses_in_time(reader_url: str, seeds, budget_s: float) -> None:
    reader = remote_manager(reader_url, remote_timeout_ms=READER_TIMEOUT_MS)
    try:
        started = time.monotonic()
        assert reader.get_many([key(i) for i in seeds]) == [None] * len(seeds)
        assert time.monotonic() - started < budget_s
    finally:
        reader.close()


# -- pulls -----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_b_serves_what_only_a_holds_and_keeps_it(transport, pool):
    with server(transport=transport) as a, server(peers=[a], transport=transport) as b:
        writer = remote_manager(a.url)
        objs = store_chunks(writer, pool, range(6))
        writer.close()
        check_served(b.url, objs)
        values = stats(b)
        assert values["peer_hits"] == 6 and values.get("peer_corrupt", 0) == 0
        assert values[f"peer_bytes_{transport}"] > 6 * 8192
        assert values['peer_up{peer="' + a.url + '"}'] == 1
        pulls = values["peer_pulls"]
        check_served(b.url, objs)  # from b's own memory now
        assert stats(b)["peer_pulls"] == pulls
        assert health(b)["tiers"]["peers"][a.url]["transport"] == transport
        assert (stats(a).get("requests_lease", 0) > 0) == (transport == "nixl")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_larger_than_the_peers_names_limit_comes_in_requests_it_takes(transport, pool):
    with (
        server("--max-names", "2", transport=transport) as a,
        server(peers=[a], transport=transport) as b,
    ):
        writer = remote_manager(a.url)
        objs = store_chunks(writer, pool, range(5))
        writer.close()
        check_served(b.url, objs)
        assert stats(b)["peer_hits"] == 5 and stats(b).get("peer_errors", 0) == 0
        held = stats(a)
        assert held.get("rejects_too_many_names", 0) == 0 and held["request_errors"] == 0
        assert (held.get("requests_lease", 0) >= 3) == (transport == "nixl")


def test_without_peer_cache_every_load_pulls_and_lookup_counts_peers_on_request(pool):
    with server() as a, server("--peer-cache", "off", peers=[a]) as b:
        writer = remote_manager(a.url)
        objs = store_chunks(writer, pool, [1, 2])
        for i in (1, 2):  # the chunks' other rank (key() is of a world of 2)
            assert writer.put(key(i, rank=1), objs[i])
        assert writer.flush(30)
        writer.close()
        check_served(b.url, objs)
        check_served(b.url, objs)
        assert stats(b)["peer_hits"] == 4, "pulled twice: nothing kept"
        reader = remote_manager(b.url)
        assert all(reader.get_many([key(1, rank=1), key(2, rank=1)]))
        reader.close()
        hashes = [key(i).to_string().split("@")[5] for i in (1, 2)]
        assert lookup(b, hashes) == 0
        assert lookup(b, hashes, "?peers=1") == 2, "the shapes b has pulled, held by a"


def test_three_servers_find_a_chunk_on_whichever_peer_holds_it(pool):
    with server() as a, server() as c, server(peers=[a, c]) as b:
        objs = {}
        for holder, seeds in ((a, [1]), (c, [2])):
            writer = remote_manager(holder.url)
            objs |= store_chunks(writer, pool, seeds)
            writer.close()
        check_served(b.url, objs)
        assert stats(b)["peer_hits"] == 2


def test_a_peer_answers_from_its_memory_and_disk_alone_so_no_request_loops():
    """b writes through to a (its remote) and a and b are each other's peers: a miss at a
    asks b once, b answers it from its memory and disk without asking its remote (a),
    so it never comes back to a: one request at each, no peer timed out."""
    port_b = free_port()
    url_b = f"kvtier://127.0.0.1:{port_b}"
    with (
        server("--peer", url_b) as a,
        server("--remote-url", a.url, peers=[a], port=port_b) as b,
    ):
        client = a.client()
        assert client.get_many(["chunk-3"]) == [None]
        assert client.exists_many(["chunk-4"]) == [False]
        client.close()
        values_a, values_b = stats(a), stats(b)
        assert values_a["requests_get"] == values_b["requests_get"] == 1
        assert values_a["requests_exists"] == values_b["requests_exists"] == 1
        assert values_a.get("peer_errors", 0) == 0 and values_a["peers_up"] == 1


def test_a_list_of_peers_shared_by_every_server_leaves_each_server_out_of_its_own():
    ports = free_port(), free_port()
    flags = [f"--peer=kvtier://127.0.0.1:{port}" for port in ports]
    with server(*flags, port=ports[0]) as a, server(*flags, port=ports[1]) as b:
        assert set(health(a)["tiers"]["peers"]) == {b.url}
        assert set(health(b)["tiers"]["peers"]) == {a.url}


def sockets_of(process) -> int:
    fds = Path(f"/proc/{process.pid}/fd")
    return sum(os.readlink(fd).startswith("socket:") for fd in fds.iterdir())


def test_namespaces_asked_once_keep_no_connection_to_the_peer_past_its_idle_timeout():
    with server("--idle-timeout", "1") as a, server(peers=[a]) as b:
        clients = [b.client(namespace=f"model-{i}") for i in range(11)]
        try:
            first, *others = clients
            assert first.exists_many(["0" * 32]) == [False]  # b dials a for model-0
            before = sockets_of(b.process)
            for client in others:
                assert client.exists_many(["0" * 32]) == [False]
                client.close()
            time.sleep(1.2)  # a closed its ends of b's idle connections
            assert first.exists_many(["0" * 32]) == [False]
            assert sockets_of(b.process) <= before
        finally:
            for client in clients:
                client.close()


def test_a_server_asked_for_many_namespaces_keeps_few_stores_open_to_its_peer():
    # past the peer's --max-clients, a store per namespace asked would be refused (down)
    with server("--max-clients", str(MAX_OPEN_STORES + 16)) as a, server(peers=[a]) as b:
        writer = a.client(namespace="model-0")
        writer.put_many([("held", [b"v" * 100])])
        writer.close()
        for i in range(MAX_OPEN_STORES + 40):
            client = b.client(namespace=f"model-{i}")
            try:
                assert client.exists_many(["0" * 32]) == [False]
            finally:
                client.close()
        assert health(b)["tiers"]["peers"][a.url]["up"]
        assert stats(a)["clients_connected"] <= MAX_OPEN_STORES + 1
        assert sockets_of(b.process) <= MAX_OPEN_STORES + 8
        client = b.client(namespace="model-0")  # its store closed: opened again
        try:
            assert client.exists_many(["held"]) == [True]
        finally:
            client.close()


# -- faults ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_killed_peer_is_a_miss_and_its_restart_is_found_again(tmp_path, transport, pool):
    disk = ["--local-disk", str(tmp_path), "--max-local-disk-size", "1"]
    with server(*disk, transport=transport) as a, server(peers=[a], transport=transport) as b:
        writer = remote_manager(a.url)
        objs = store_chunks(writer, pool, range(3))
        writer.close()
        a.kill()
        check_misses_in_time(b.url, range(3), budget_s=3 * TIMEOUT_MS / 1000 + 1)
        assert stats(b)["peers_up"] == 0
        a.start()  # the same port, a new process (a new NIXL agent); its disk kept
        wait_until(lambda: stats(b)["peers_up"] == 1)
        check_served(b.url, objs)
        assert b.process.poll() is None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_blob_corrupt_on_the_peers_disk_is_one_miss_and_the_peer_drops_it(
    tmp_path, transport, pool
):
    disk = ["--local-disk", str(tmp_path), "--max-local-disk-size", "1"]
    with server(*disk, transport=transport) as a, server(peers=[a], transport=transport) as b:
        writer = remote_manager(a.url)
        objs = store_chunks(writer, pool, [1])
        before = set(tmp_path.rglob("*.kvt"))
        store_chunks(writer, pool, [0])
        writer.close()
        (file,) = set(tmp_path.rglob("*.kvt")) - before
        data = bytearray(file.read_bytes())
        data[-100] ^= 0x01  # a bit of the payload, under its checksum
        file.write_bytes(data)
        a.kill()
        a.start()  # memory empty: a serves the file as it is on disk
        wait_until(lambda: stats(b)["peers_up"] == 1)
        check_misses_in_time(b.url, [0], budget_s=3 * TIMEOUT_MS / 1000 + 1)
        assert stats(b)["peer_corrupt"] == 1
        wait_until(lambda: stats(a).get("corrupt_dropped", 0) == 1)
        assert not file.exists() and stats(b)["peer_corrupt_reported"] == 1
        check_misses_in_time(b.url, [0], budget_s=3 * TIMEOUT_MS / 1000 + 1)
        assert stats(b)["peer_corrupt"] == 1  # a plain miss now: a holds it no more
        check_served(b.url, objs)  # the intact blob of a stays
        assert stats(a)["corrupt_dropped"] == 1


def test_a_report_of_corrupt_blobs_drops_only_those_whose_bytes_fail_on_the_holder(tmp_path):
    names = [f"kvtier1@org%2Fmodel-a@1@0@bfloat16@{i:032x}" for i in range(3)]
    tensor = torch.ones((2, 1, 64, 128), dtype=torch.bfloat16)
    intact = b"".join(bytes(p) for p in encode(names[0], tensor, make_serde("naive")))
    flipped = bytearray(intact)
    flipped[-100] ^= 0x01
    with server("--local-disk", str(tmp_path)) as a:
        client = a.client("org%2Fmodel-a")
        client.put_many([(names[0], [intact]), (names[1], [bytes(flipped)])])
        reply = client.call(protocol.Op.CORRUPT, {"names": names})  # names[2]: never stored
        assert reply["dropped"] == 1
        assert client.exists_many(names) == [True, False, False]
        assert len(list(tmp_path.rglob("*.kvt"))) == 1  # the intact blob's file
        assert bytes(client.get_many([names[0]])[0]) == intact
        client.close()
        assert stats(a)["corrupt_dropped"] == 1


def test_a_blob_of_a_newer_kvtier_passes_between_peers_and_is_never_dropped_as_corrupt():
    """A blob in a format newer than this kvtier's (engines of a newer version share the
    servers) is no damage: a pull passes it on as it is, for the engine that reads it to
    check, and a report naming it leaves it where it is."""
    name = "kvtier1@org%2Fmodel-a@1@0@bfloat16@" + "7" * 32
    tensor = torch.ones((2, 1, 64, 128), dtype=torch.bfloat16)
    newer = in_a_newer_format(b"".join(bytes(p) for p in encode(name, tensor, make_serde("naive"))))
    with server() as a, server(peers=[a]) as b:
        holder, puller = a.client("org%2Fmodel-a"), b.client("org%2Fmodel-a")
        holder.put_many([(name, [newer])])
        assert bytes(puller.get_many([name])[0]) == newer
        assert stats(b).get("peer_corrupt", 0) == 0 and stats(b)["peer_hits"] == 1
        assert holder.call(protocol.Op.CORRUPT, {"names": [name]})["dropped"] == 0
        assert holder.exists_many([name]) == [True]
        holder.close()
        puller.close()


def test_a_peer_killed_mid_pull_is_a_miss_in_time(pool):
    with server() as a, server("--peer-cache", "off", peers=[a]) as b:
        writer = remote_manager(a.url)
        store_chunks(writer, pool, range(24))
        writer.close()
        reader = remote_manager(b.url, local_cpu=False)  # every get asks b, b asks a
        killer = threading.Timer(0.005, a.kill)
        killer.start()
        started, after_death = time.monotonic(), 0
        while after_death < 2:  # hits until a dies, then misses; pulls run when it dies
            began = time.monotonic()
            reader.get_many([key(i) for i in range(24)])
            assert time.monotonic() - began < 3 * TIMEOUT_MS / 1000 + 2  # each in time
            after_death += a.process.poll() is not None
            assert time.monotonic() - started < 60
        killer.join()
        reader.close()
        assert b.process.poll() is None
        assert stats(b)["peers_up"] == 0


def test_a_corrupt_pull_is_not_reported_to_a_peer_of_an_earlier_kvtier(caplog):
    """An earlier ``kvtier serve`` lists no ops in its HELLO reply and takes one it does
    not know (CORRUPT) for a broken frame, closing the connection. A corrupt blob pulled
    from it is a miss, and no report is sent, so it sees only ops it answers."""
    name = "kvtier1@ns@1@0@bfloat16@" + "5" * 32
    tensor = torch.ones((2, 1, 16, 64), dtype=torch.bfloat16)
    blob = bytearray(b"".join(bytes(p) for p in encode(name, tensor, make_serde("naive"))))
    blob[-1] ^= 0x01
    listener = socket.create_server(("127.0.0.1", 0))
    ops = []

    def answer() -> None:  # HELLO (no ops), a GET of the corrupt blob, then whatever comes
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            for header, payload in (({"max_frame": 1 << 20}, b""), ({"sizes": [len(blob)]}, blob)):
                prefix = protocol.decode_prefix(bytes(recv(conn, protocol.PREFIX_SIZE)), 1 << 20)
                recv(conn, prefix.header_len + prefix.payload_len)
                ops.append(prefix.op)
                head = cbor2.dumps(header)
                reply = protocol.encode_prefix(
                    prefix.op, prefix.request_id, len(head), len(payload), protocol.REPLY
                )
                conn.sendall(reply + head + bytes(payload))
            with contextlib.suppress(OSError):
                ops.append(protocol.decode_prefix(bytes(recv(conn, protocol.PREFIX_SIZE)), 0).op)

    peer = threading.Thread(target=answer)
    peer.start()
    stats, url = Stats(), f"kvtier://127.0.0.1:{listener.getsockname()[1]}"
    memory = LocalCPUTier(8 << 20, "LRU", alignment=64, pin_memory=False)
    peers = Peers(
        [url], memory=memory, stats=stats, token=None, timeout_s=2.0, reconnect_max_s=0.2,
        plane=None,
    )  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.server.peers"):
            assert peers.pull("ns", [name]) == {}
            wait_until(lambda: "takes no reports of corrupt blobs" in caplog.text)
        assert stats.get("peer_corrupt") == 1 and stats.get("peer_corrupt_reported") == 0
    finally:
        peers.close()
        peer.join(10)
        listener.close()
    assert ops == [protocol.Op.HELLO, protocol.Op.GET]


def test_a_peer_gone_mid_reply_is_a_miss_and_takes_no_buffer_along():
    """A peer whose GET reply stops after two of its four blobs: a miss, and the buffers
    the two took in the puller's memory go back to its pool."""
    size = 64 << 10
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:  # HELLO, then a GET reply cut off in its third blob
        conn, _ = listener.accept()
        with conn:
            for header, sent in (
                ({"max_frame": 1 << 20}, 0),
                ({"sizes": [size] * 4}, 2 * size + 9),
            ):
                prefix = protocol.decode_prefix(bytes(recv(conn, protocol.PREFIX_SIZE)), 1 << 20)
                recv(conn, prefix.header_len + prefix.payload_len)
                head = cbor2.dumps(header)
                total = sum(header.get("sizes", []))
                reply = protocol.encode_prefix(
                    prefix.op, prefix.request_id, len(head), total, protocol.REPLY
                )
                conn.sendall(reply + head + bytes(sent))

    peer = threading.Thread(target=answer)
    peer.start()
    memory = LocalCPUTier(8 << 20, "LRU", alignment=64, pin_memory=False)
    stats = Stats()
    url = f"kvtier://127.0.0.1:{listener.getsockname()[1]}"
    peers = Peers(
        [url], memory=memory, stats=stats, token=None, timeout_s=2.0, reconnect_max_s=0.2,
        plane=None,
    )  # fmt: skip
    try:
        assert peers.pull("ns", [f"blob-{i}" for i in range(4)]) == {}
        assert stats.get("peer_errors") == 1 and stats.get("peer_misses") == 4
        assert memory.pool.used_bytes() == 0, "the blobs that arrived were let go"
    finally:
        peer.join(5)
        listener.close()
        peers.close()
        memory.close()


def test_a_stopped_peer_is_a_miss_within_the_timeout(pool):
    with server() as a, server(peers=[a]) as b:
        writer = remote_manager(a.url)
        store_chunks(writer, pool, [5])
        writer.close()
        a.process.send_signal(signal.SIGSTOP)
        try:
            check_misses_in_time(b.url, [5], budget_s=3 * TIMEOUT_MS / 1000 + 1)
        finally:
            a.process.send_signal(signal.SIGCONT)
        wait_until(lambda: stats(b).get("peer_errors", 0) >= 1)


def test_a_peer_refusing_the_token_is_a_miss(pool):
    with (
        server("--auth-token", "a-secret", token="a-secret") as a,
        server("--auth-token", "b-secret", peers=[a], token="b-secret") as b,
    ):
        writer = remote_manager(a.url, server_token="a-secret")
        store_chunks(writer, pool, [7])
        writer.close()
        reader = remote_manager(b.url, server_token="b-secret")
        assert reader.get_many([key(7)]) == [None]
        reader.close()
        assert "peer kvtier://127.0.0.1" in b.log() and "unauthenticated" in b.log()
        assert b.process.poll() is None


def test_a_found_peer_whose_address_needs_escaping_keeps_metrics_parseable():
    """Discovery takes any ``kvtier://host:port`` a server registered; its ``peer_up``
    label must not break the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.server.admin import prometheus_text

    memory = LocalCPUTier(1 << 20, "LRU", alignment=64, pin_memory=False)
    peers = Peers(
        [], memory=memory, stats=Stats(), token=None, timeout_s=0.5, reconnect_max_s=0.2,
        plane=None,
    )  # fmt: skip
    try:
        peers.update(['kvtier://a"b\\c:1'])
        text = prometheus_text(peers.gauges())
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert [s.labels for s in samples if s.name == "kvtier_server_peer_up"] == [
            {"peer": 'kvtier://a"b\\c:1'}
        ]
    finally:
        peers.close()
        memory.close()
