"""``kvtier serve`` processes that find their peers through a real redis-server
(``--peer-discovery``, no ``--peer``): b pulls what only a holds (over TCP, or with NIXL
in ``auto``), a server stopped or killed leaves the others' peer lists (at once, or once
its key expires), groups keep clusters apart, and a Redis down at start-up is one warning,
shown by /health, and discovery works once it is back."""

from __future__ import annotations

import json
import tempfile
import urllib.request

import pytest
from support.kvtier_server import NIXL_MISSING, KVTierServerProcess, free_port, nixl_installed
from support.redis_server import REDIS_MISSING, RedisServer, redis_available
from support.tiers import check_served, make_pool, remote_manager, store_chunks, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)]

TTL_S = 2  # --peer-discovery-ttl: refreshed every 0.67 s


TOKEN = "peers-token"
PASSWORD = "s3cret-pw"


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def server(
    discovery: str, *args: str, transport: str = "tcp", port: int | None = None
) -> KVTierServerProcess:
    """A server that registers in ``discovery`` (the peers' calls bounded by 1 s)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as config:
        config.write("remote_timeout_ms: 1000\nremote_reconnect_max_ms: 200\n")
    return KVTierServerProcess(
        "--config",
        config.name,
        "--peer-discovery",
        discovery,
        "--peer-discovery-ttl",
        str(TTL_S),
        "--peer-transport",
        transport,
        "--auth-token",
        TOKEN,
        *args,
        admin=True,
        token=TOKEN,
        port=port,
    )


def get(server: KVTierServerProcess, path: str) -> dict:
    with urllib.request.urlopen(server.admin_url + path, timeout=5) as reply:
        return json.load(reply)


def peer_urls(server: KVTierServerProcess) -> set[str]:
    return set(get(server, "/health")["tiers"]["peers"])


def test_servers_registered_in_redis_pull_from_each_other_and_leave_when_stopped(pool):
    with RedisServer(password=PASSWORD) as redis:
        url = f"redis://:{PASSWORD}@127.0.0.1:{redis.port}/0"
        with (
            server(url) as a,
            server(url) as b,
            server(url) as c,
            server(url, "--peer-group", "other") as d,
        ):
            wait_until(lambda: peer_urls(b) == {a.url, c.url}, timeout=3 * TTL_S + 5)
            writer = remote_manager(a.url, server_token=TOKEN)
            objs = store_chunks(writer, pool, range(6))
            writer.close()
            check_served(b.url, objs, remote_timeout_ms=3000, server_token=TOKEN)
            values = get(b, "/stats")
            assert values["peer_hits"] == 6 and values["peers_discovered"] == 2
            assert values['peer_up{peer="' + a.url + '"}'] == 1
            assert values["discovery_registered"] == 1 and values["discovery_refreshes"] >= 1
            health = get(b, "/health")
            assert health["status"] == "ok"
            assert health["tiers"]["peers"][a.url] == {
                "up": True,
                "transport": "tcp",
                "source": "discovery",
            }
            found = health["tiers"]["discovery"]
            assert found["registered"] and found["error"] is None and found["group"] == "default"
            assert (
                found["advertise"] == b.url and found["url"] == f"redis://127.0.0.1:{redis.port}/0"
            )
            assert PASSWORD not in json.dumps(health) + b.log()
            metrics = urllib.request.urlopen(b.admin_url + "/metrics", timeout=5).read().decode()
            assert "kvtier_server_discovery_refreshes_total " in metrics
            assert "# TYPE kvtier_server_peers_discovered gauge" in metrics

            # groups: d is alone in its own, and in no one's list of the default group
            assert peer_urls(d) == set() and get(d, "/stats")["peers_discovered"] == 0
            assert d.url not in peer_urls(a) | peer_urls(c)
            keys = {k.decode() for k in redis.client().scan_iter(match="kvtier-peers:*")}
            assert f"kvtier-peers:other:{d.url}" in keys and len(keys) == 4

            assert c.terminate() == 0  # a clean stop deletes its key: gone at b's next refresh
            assert not redis.client().exists(f"kvtier-peers:default:{c.url}")
            wait_until(lambda: peer_urls(b) == {a.url}, timeout=TTL_S + 5)

            a.kill()  # its key stays until it expires
            assert redis.client().pttl(f"kvtier-peers:default:{a.url}") > 0
            wait_until(lambda: peer_urls(b) == set(), timeout=2 * TTL_S + 5)
            assert get(b, "/stats")["peers_configured"] == 0
            assert "is no longer registered: dropped" in b.log()
            assert b.process.poll() is None


def test_an_advertise_given_again_in_another_form_registers_once():
    port = free_port()
    forms = [f"lm://[::1]:{port}?shm=0", f"KVTIER://[::1]:{port}", f"kvtier://[0:0::1]:{port}"]
    with RedisServer() as redis:
        url = f"redis://127.0.0.1:{redis.port}/0"
        with server(url, *(f for form in forms for f in ("--advertise", form)), port=port) as a:
            assert get(a, "/health")["tiers"]["discovery"]["advertise"] == f"kvtier://[::1]:{port}"
            keys = {k.decode() for k in redis.client().scan_iter(match="kvtier-peers:*")}
            assert keys == {f"kvtier-peers:default:kvtier://[::1]:{port}"}


def test_a_redis_down_at_start_is_one_warning_and_discovery_works_once_it_is_back():
    with RedisServer() as redis:
        url = redis.url
        redis.stop()
        with (
            server(url) as x,
            server("remote", "--remote-url", url) as y,  # the server's own Redis remote
        ):
            wait_until(lambda: get(x, "/stats").get("discovery_errors", 0) >= 3)
            found = get(x, "/health")["tiers"]["discovery"]
            assert not found["registered"] and "Connection refused" in found["error"]
            assert get(x, "/stats")["discovery_registered"] == 0
            assert x.log().count("peer discovery:") == 1, x.log()
            redis.start()  # the same port
            wait_until(lambda: peer_urls(x) == {y.url}, timeout=3 * TTL_S + 5)
            wait_until(lambda: peer_urls(y) == {x.url}, timeout=3 * TTL_S + 5)
            assert get(x, "/health")["tiers"]["discovery"]["error"] is None
            assert "peer discovery through" in x.log() and "works again" in x.log()


@pytest.mark.skipif(not nixl_installed(), reason=NIXL_MISSING)
def test_discovered_peers_pull_with_nixl_and_a_peer_that_leaves_takes_its_pool(pool):
    """Discovery finds a peer as ``--peer`` names one: in ``auto`` its pulls are NIXL
    READs; a peer that leaves is dropped with its NIXL pool, and one that joins later is
    pulled with NIXL in turn."""
    with RedisServer() as redis, server(redis.url, transport="auto") as b:

        def pulls_with_nixl(holder: KVTierServerProcess, chunks: range) -> None:
            wait_until(lambda: peer_urls(b) == {holder.url}, timeout=3 * TTL_S + 5)
            before = get(b, "/stats")
            writer = remote_manager(holder.url, server_token=TOKEN)
            objs = store_chunks(writer, pool, chunks)
            writer.close()
            check_served(b.url, objs, remote_timeout_ms=3000, server_token=TOKEN)
            values = get(b, "/stats")
            assert values["peer_hits"] - before.get("peer_hits", 0) == len(chunks), values
            assert values.get("peer_fallbacks", 0) == 0, values
            assert values["peer_bytes_nixl"] > before.get("peer_bytes_nixl", 0), values
            assert get(b, "/health")["tiers"]["peers"][holder.url]["transport"] == "nixl"

        with server(redis.url, transport="auto") as a:
            pulls_with_nixl(a, range(4))
            assert a.terminate() == 0
            wait_until(lambda: peer_urls(b) == set(), timeout=TTL_S + 5)
            assert "is no longer registered: dropped" in b.log()
        with server(redis.url, transport="auto") as c:
            pulls_with_nixl(c, range(4, 8))
        assert get(b, "/health")["status"] == "ok" and b.process.poll() is None
