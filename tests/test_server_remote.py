"""The remote behind a ``kvtier serve`` (``RemoteBlobs``) keeps the engines' health
policy (``kvtier.storage.health``): a fault makes it down (misses, dropped writes) until
a background ping answers, never back on a timer while the remote still fails."""

from __future__ import annotations

import logging
import time

from support.tiers import FlakyStore, wait_until

from kvtier.observability.stats import Stats
from kvtier.server.cache import RemoteBlobs
from kvtier.server.stores import MAX_OPEN_STORES, OpenStores
from kvtier.storage.remote import space_of, space_of_namespace

RECONNECT_MAX_S = 0.2


def remote_blobs(store: FlakyStore, stats: Stats) -> RemoteBlobs:
    return RemoteBlobs(
        lambda namespace: store,
        describe="flaky://test",
        stats=stats,
        timeout_s=0.3,
        reconnect_max_s=RECONNECT_MAX_S,
        queue_capacity=8,
    )


def remote_holding_a(store: FlakyStore, stats: Stats, blob: bytes = b"1") -> RemoteBlobs:
    """A remote on ``store`` that has written ``a`` (``blob``) through: its namespace's
    store is open, so pings use it."""
    remote = remote_blobs(store, stats)
    remote.submit_put("ns", "a", blob)
    wait_until(lambda: stats.get("remote_puts") == 1)
    return remote


def test_a_failing_remote_is_down_until_a_ping_answers(caplog):
    store, stats = FlakyStore(), Stats()
    remote = remote_holding_a(store, stats, b"123")
    store.mode = "down"
    with caplog.at_level(logging.WARNING, logger="kvtier.server.cache"):
        assert remote.get("ns", "a") is None
        assert not remote.is_up and stats.get("remote_errors") == 1
        time.sleep(5 * RECONNECT_MAX_S)  # its pings fail meanwhile
        assert not remote.is_up, "still down: no timer brings a failing remote back"
        assert remote.exists_many("ns", ["a"]) == [False]  # answered without the remote
        remote.submit_put("ns", "b", b"4")
        assert stats.get("remote_puts_dropped") == 1
        assert stats.get("remote_errors") == 1, "one fault: calls stop while it is down"
        store.mode = "ok"
        wait_until(lambda: remote.is_up)  # the background ping, no request needed
    assert remote.get("ns", "a") == b"123"
    messages = [r.message for r in caplog.records]
    assert sum("kvtier server: remote flaky://test is unavailable" in m for m in messages) == 1
    assert any("available again" in m for m in messages)
    remote.close(1.0)


def test_a_failed_write_takes_the_remote_down_too():
    store, stats = FlakyStore(), Stats()
    remote = remote_blobs(store, stats)
    store.mode = "down"
    remote.submit_put("ns", "a", b"1")
    wait_until(lambda: not remote.is_up)
    assert stats.get("remote_puts_dropped") == 1 and stats.get("remote_errors") == 1
    store.mode = "ok"
    wait_until(lambda: remote.is_up)
    remote.submit_put("ns", "a", b"2")
    wait_until(lambda: stats.get("remote_puts") == 1)
    assert store.blobs == {"a": b"2"}
    remote.close(1.0)


def test_a_write_refused_for_room_is_dropped_and_the_remote_stays_up(caplog):
    store, stats = FlakyStore(), Stats()
    remote = remote_holding_a(store, stats)
    store.mode = "full"
    with caplog.at_level(logging.WARNING, logger="kvtier.server.cache"):
        remote.submit_put("ns", "b", b"2")
        remote.submit_put("ns", "c", b"3")
        wait_until(lambda: stats.get("remote_puts_dropped") == 2)
    assert remote.is_up and stats.get("remote_errors") == 0
    assert remote.get("ns", "a") == b"1"  # reads go on
    messages = [r.message for r in caplog.records]
    assert sum("refuses stores" in m for m in messages) == 1, messages
    assert not any("unavailable" in m for m in messages), messages
    remote.close(1.0)


def test_a_throttling_remote_stays_up_its_writes_dropped_and_reads_missed(caplog):
    store, stats = FlakyStore(), Stats()
    remote = remote_holding_a(store, stats)
    store.mode = "throttled"
    with caplog.at_level(logging.WARNING, logger="kvtier.server.cache"):
        remote.submit_put("ns", "b", b"2")
        wait_until(lambda: stats.get("remote_puts_dropped") == 1)
        assert remote.get("ns", "a") is None  # a miss
        assert remote.exists_many("ns", ["a"]) == [False]
        assert remote.check()
    assert remote.is_up and stats.get("remote_errors") == 0
    messages = [r.message for r in caplog.records]
    assert sum("throttles requests" in m for m in messages) == 1, messages
    assert not any("unavailable" in m for m in messages), messages
    store.mode = "ok"
    assert remote.get("ns", "a") == b"1"
    remote.close(1.0)


def test_a_remote_down_at_start_up_is_warned_about_before_any_request(caplog):
    store, stats = FlakyStore(), Stats()
    store.mode = "down"
    remote = remote_blobs(store, stats)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.cache"):
        remote.watch(interval_s=60.0)
        assert not remote.is_up  # at once: the first ping is part of watch()
    assert [r.message for r in caplog.records if "is unavailable" in r.message]
    store.mode = "ok"
    wait_until(lambda: remote.is_up)
    remote.close(1.0)


def test_a_remote_that_goes_down_while_idle_is_seen_without_a_request():
    """The periodic ping: ``/health`` and ``kvtier status`` (both read ``is_up``) follow
    the remote, not the last request that happened to touch it."""
    store, stats = FlakyStore(), Stats()
    remote = remote_holding_a(store, stats)
    remote.watch(interval_s=0.05)
    assert remote.is_up
    store.mode = "down"
    wait_until(lambda: not remote.is_up)
    assert stats.get("remote_puts") == 1 and stats.get("remote_puts_dropped") == 0  # no request
    store.mode = "ok"
    wait_until(lambda: remote.is_up)
    store.mode = "hang"  # a ping that never answers is bounded by the remote timeout
    wait_until(lambda: not remote.is_up, timeout=5.0)
    store.released.set()
    remote.close(1.0)


def test_each_namespace_keeps_a_prefix_of_its_own_in_the_remote():
    """Redis keys are ``kvtier:<space>:<name>``: a namespace ``a:b`` kept as it is would
    read as namespace ``a`` (and its name ``x`` as ``b:x``)."""
    engine = space_of("org/Llama-3.1 8B:é")
    assert space_of_namespace(engine) == engine  # engines behind a server and on the remote
    namespaces = ["a", "a:b", "a%3Ab", "!a%3Ab", "a/b", "a*b", "é", "e\u0301", "~"]
    spaces = [space_of_namespace(ns) for ns in namespaces]
    assert len(set(spaces)) == len(namespaces)
    assert not any(c in s for s in spaces for c in ":/*\x00")


class Closing:
    """A store that only notes its closing."""

    def __init__(self, namespace: str):
        self.namespace, self.closed = namespace, False

    def close(self) -> None:
        self.closed = True


def test_a_server_keeps_a_bounded_number_of_remote_stores_open():
    """One store per namespace holds a client of the remote and its connections: past
    the bound the one used longest ago is closed (once no call uses it), and opened
    again when its namespace is next asked for."""
    opened: list[Closing] = []
    stores = OpenStores(lambda ns: opened.append(Closing(ns)) or opened[-1], capacity=2)
    with stores.using("a") as a:
        for i in range(10):
            with stores.using(f"ns-{i}"):
                pass
        assert not a.closed  # in use
    assert a.closed and len(stores) == 2
    assert sum(not s.closed for s in opened) == 2
    with stores.using("a") as again:
        assert again is not a and stores.namespaces()[0] == "a"
    stores.close()
    assert all(s.closed for s in opened)


def test_a_client_naming_many_namespaces_leaves_few_remote_stores_open():
    stats, opened = Stats(), []
    remote = RemoteBlobs(
        lambda namespace: opened.append(FlakyStore()) or opened[-1],
        describe="flaky://test",
        stats=stats,
        timeout_s=1.0,
        reconnect_max_s=RECONNECT_MAX_S,
        queue_capacity=8,
    )
    try:
        for i in range(3 * MAX_OPEN_STORES):
            assert remote.exists_many(f"model-{i}", ["a"]) == [False]
        assert len(opened) == 3 * MAX_OPEN_STORES
        assert sum(not store.released.is_set() for store in opened) <= MAX_OPEN_STORES
    finally:
        remote.close(1.0)
