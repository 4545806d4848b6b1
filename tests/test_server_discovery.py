"""Peer discovery's parts, in one process: the membership of ``Peers`` (static peers and
the servers found, merged, this server left out), ``Discovery``'s refresh over a store
that answers or not, the names and flags it takes, and ``RedisStore.names`` on a real
redis-server. The servers finding each other are tests/test_server_peers_discovery.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import pytest
from support.redis_server import (
    CLUSTER_MISSING,
    REDIS_MISSING,
    LocalRedisCluster,
    RedisServer,
    redis_available,
    redis_cluster_available,
)

from kvtier.cli import main
from kvtier.commands.status import render
from kvtier.config import load_config
from kvtier.observability.stats import Stats
from kvtier.server.blobs import open_memory
from kvtier.server.discovery import Discovery, advertised, check_group, open_registry, peer_url
from kvtier.server.peers import Peers
from kvtier.storage.blob_store import Buffer, StoreUnavailable

A, B, C, SELF = (f"kvtier://10.0.0.{i}:65432" for i in (1, 2, 3, 9))


@pytest.fixture
def peers():
    memory = open_memory(1 << 20)
    peers = Peers(
        [A, "kvtier://10.0.0.9:65432?shm=0"],  # this server among its static peers
        memory=memory,
        stats=Stats(),
        token=None,
        timeout_s=0.2,
        reconnect_max_s=0.2,
        plane=None,
        self_url=SELF,
    )
    yield peers
    peers.close()
    memory.close()


def urls(peers: Peers) -> list[str]:
    return [p.url for p in peers.peers]


# -- membership ------------------------------------------------------------------------


def test_the_peers_are_the_static_ones_and_those_found_less_this_server(peers):
    assert urls(peers) == [A]
    peers.update({B, SELF, "kvtier://10.0.0.3:65432/", A})
    assert urls(peers) == [A, B, C]
    status = peers.status()
    assert [status[u]["source"] for u in (A, B, C)] == ["static", "discovery", "discovery"]
    found = peers.peers
    peers.update({B, C})  # the same set: the same peers, not new ones
    assert peers.peers == found


def test_a_server_no_longer_found_is_dropped_and_closed_but_a_static_one_stays(peers):
    peers.update({A, B, C})
    b = next(p for p in peers.peers if p.url == B)
    peers.update(set())
    assert urls(peers) == [A]
    assert b.closed and not b.stores
    with pytest.raises(StoreUnavailable, match="no longer a peer"), peers._store(b, "ns"):
        pass
    assert peers.exists_many("ns", ["x"]) == [False]  # a lookup in flight: a miss
    peers.update({B})
    assert urls(peers) == [A, B] and peers.peers[1] is not b  # found again: a new peer


def test_an_address_that_is_not_a_server_is_skipped_with_one_warning(peers, caplog):
    with caplog.at_level(logging.WARNING):
        peers.update({B, "http://10.0.0.5:80", "garbage"})
        peers.update({B, "http://10.0.0.5:80", "garbage"})
    assert urls(peers) == [A, B]
    assert sum("is no address" in r.message for r in caplog.records) == 2  # once per address


def test_gauges_and_description_show_the_discovered_peers(peers):
    peers.discovery = Discovery(
        FakeRegistry(), advertise=SELF, group="g", ttl_s=3, on_members=peers.update, stats=Stats()
    )
    peers.update({B})
    gauges = peers.gauges()
    assert gauges["peers_configured"] == 2 and gauges["peers_discovered"] == 1
    assert gauges[f'peer_up{{peer="{B}"}}'] == 1 and gauges["discovery_registered"] == 0
    assert peers.describe().endswith(f"peer discovery fake://r group g as {SELF}")


def test_peer_urls_are_canonical():
    assert peer_url("kvtier://10.0.0.1:65432?shm=0") == A
    assert peer_url("lm://[::1]:7") == "kvtier://[::1]:7"
    assert peer_url(peer_url("kvtier://[::1]:7")) == "kvtier://[::1]:7"
    assert peer_url("kvtier://[0:0::1]:7") == peer_url("KVTIER://[::1]:7") == "kvtier://[::1]:7"
    assert peer_url("kvtier://Node-A:1") == "kvtier://node-a:1"
    with pytest.raises(ValueError):
        peer_url("kvtier://10.0.0.1")


# -- the registration --------------------------------------------------------------------


class FakeRegistry:
    """The group's keys in a dict; ``down`` makes every call fail as Redis down would."""

    url = "fake://r"

    def __init__(self, *names: str):
        self.keys: dict[str, bytes] = {n: n.encode() for n in names}
        self.down = False
        self.closed = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("redis store fake://r: connection refused")

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        self._check()
        for name, parts in items:
            self.keys[name] = b"".join(bytes(p) for p in parts)

    def names(self) -> list[str]:
        self._check()
        return list(self.keys)

    def delete_many(self, names: Sequence[str]) -> int:
        self._check()
        return sum(self.keys.pop(n, None) is not None for n in names)

    def close(self) -> None:
        self.closed = True


def discovery(registry: FakeRegistry, seen: list, stats: Stats | None = None) -> Discovery:
    return Discovery(
        registry,
        advertise=SELF,
        group="g",
        ttl_s=3,
        on_members=seen.append,
        stats=stats or Stats(),
    )


def test_a_refresh_registers_this_server_and_hands_on_the_others():
    registry, seen, stats = FakeRegistry(A, B), [], Stats()
    found = discovery(registry, seen, stats)
    assert found.refresh()
    assert registry.keys[SELF] == SELF.encode()
    assert seen == [frozenset({A, B})]
    status = found.status()
    assert status["registered"] and status["error"] is None and status["members"] == [A, B]
    assert stats.get("discovery_refreshes") == 1
    found.close()
    assert SELF not in registry.keys and registry.closed


def test_with_the_store_down_the_members_stay_one_warning_and_the_next_refresh_works(caplog):
    registry, seen, stats = FakeRegistry(A), [], Stats()
    found = discovery(registry, seen, stats)
    found.refresh()
    registry.down = True
    with caplog.at_level(logging.WARNING):
        assert not found.refresh() and not found.refresh()
    assert seen == [frozenset({A})], "nothing handed on while down"
    status = found.status()
    assert not status["registered"] and "connection refused" in status["error"]
    assert status["members"] == [A] and found.gauges() == {"discovery_registered": 0}
    assert stats.get("discovery_errors") == 2
    assert sum("peer discovery" in r.message for r in caplog.records) == 1
    registry.down = False
    registry.keys[B] = b""
    assert found.refresh() and seen[-1] == frozenset({A, B})
    assert found.status()["error"] is None
    registry.down = True
    found.close()  # the key left to expire; no raise
    assert registry.closed


def test_a_store_restarted_empty_drops_no_one_before_the_others_register_again():
    registry, seen = FakeRegistry(A, B), []
    found = discovery(registry, seen)
    assert found.refresh() and seen[-1] == frozenset({A, B})
    registry.keys = {B: B.encode()}  # restarted: only B registered again so far
    assert found.refresh() and seen[-1] == frozenset({A, B}), "A kept until it can register"
    assert found.refresh() and seen[-1] == frozenset({B}), "A never came back: dropped"
    found.close()


def test_the_thread_refreshes_every_third_of_the_ttl_and_close_deregisters():
    registry, seen = FakeRegistry(A), []
    found = Discovery(
        registry, advertise=SELF, group="g", ttl_s=1.0, on_members=seen.append, stats=Stats()
    )
    found.start()
    try:
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(seen) >= 3
    finally:
        found.close()
    assert SELF not in registry.keys
    found.close()  # idempotent


def test_names_and_settings_are_checked():
    assert advertised("10.0.0.9", 65432, None) == SELF
    assert advertised("::1", 7, None) == "kvtier://[::1]:7"
    assert advertised("0.0.0.0", 7, "kvtier://node-a:65432?shm=0") == "kvtier://node-a:65432"
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="give --advertise"):
            advertised(host, 7, None)
    with pytest.raises(ValueError, match="--advertise 'node-a'"):
        advertised("127.0.0.1", 7, "node-a")
    assert check_group("team-a.v2_1") == "team-a.v2_1"
    for bad in ("", "a:b", "a*", "x" * 65):
        with pytest.raises(ValueError, match="--peer-group"):
            check_group(bad)
    with pytest.raises(ValueError, match="--peer-discovery-ttl must be >= 1"):
        Discovery(
            FakeRegistry(), advertise=SELF, group="g", ttl_s=0.5, on_members=print, stats=Stats()
        )
    with pytest.raises(ValueError, match=r"^--peer-discovery 's3://b"):
        open_registry("s3://b/p", None, "g", 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--peer-discovery", "remote", "--remote-url", "s3://bucket/p"], "must be a Redis"),
        (["--peer-discovery", "remote"], "no remote_url is set"),
        (["--peer-discovery", "http://x"], "--peer-discovery / server_peer_discovery 'http"),
        (["--peer-discovery", "redis://u:hidden@h:1", "--host", "0.0.0.0"], "--advertise"),
        (["--peer-discovery", "redis://h", "--peer-group", "a b"], "--peer-group"),
        (["--peer-discovery", "redis://h", "--peer-discovery-ttl", "0.5"], "--peer-discovery-ttl"),
        (["--advertise", "kvtier://h:1", "--peer-group", "g"], "--advertise and --peer-group"),
        (
            [
                "--peer-discovery",
                "redis://h",
                "--advertise",
                "kvtier://a:1",
                "--advertise",
                "lm://b:1",
            ],
            "--advertise given 2 different addresses (kvtier://a:1, kvtier://b:1)",
        ),
    ],
)
def test_serve_refuses_a_bad_discovery_setting_naming_its_flag(flags, message, capsys):
    argv = ["serve", "--port", "0", "--auth-token", "t", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "hidden" not in err, err


# -- the store -------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)
def test_redis_names_lists_one_namespace_with_scan_and_registrations_expire():
    with RedisServer(password="pw") as server:
        url = f"redis://:pw@127.0.0.1:{server.port}/0"
        store = open_registry(url, load_config(), "g", ttl_s=1)
        other = open_registry(url, load_config(), "g2", ttl_s=1)
        try:
            store.put_many([(A, [A.encode()]), (B, [b""])])
            other.put_many([(C, [b"x"])])
            assert sorted(store.names()) == [A, B] and other.names() == [C]
            assert server.client().pttl(f"kvtier-peers:g:{A}") > 0
            assert store.delete_many([A]) == 1 and store.names() == [B]
        finally:
            store.close()
            other.close()


@pytest.mark.redis
@pytest.mark.skipif(not redis_cluster_available(), reason=CLUSTER_MISSING)
def test_redis_names_scans_every_primary_of_a_cluster():
    with LocalRedisCluster(primaries=3) as cluster:
        store = open_registry(cluster.url, load_config(), "g", ttl_s=5)
        try:
            members = [f"kvtier://10.0.1.{i}:65432" for i in range(12)]
            store.put_many([(m, [m.encode()]) for m in members])
            per_node = [len(list(c.scan_iter(match="kvtier-peers:g:*"))) for c in cluster.clients()]
            assert sum(per_node) == 12 and sum(n > 0 for n in per_node) >= 2, per_node
            assert sorted(store.names()) == sorted(members)
        finally:
            store.close()


def test_kvtier_status_shows_whether_the_server_is_registered():
    values = {"peers_configured": 1, "peers_up": 1, "peers_discovered": 1}
    values |= {"discovery_registered": 0, "discovery_refreshes": 4, "discovery_errors": 2}
    line = render("h:1", values).splitlines()[-1]
    assert line.split() == [
        "peer",
        "discovery",
        "NOT",
        "registered,",
        "1",
        "peers",
        "found,",
        "4",
        "refreshes,",
        "2",
        "failed",
        "(why:",
        "/health,",
        "tiers.discovery)",
    ]
    assert "peer discovery" not in render("h:1", {"peers_configured": 0, "peers_up": 0})
