"""The remote tier on real servers, configured the way an operator does (``remote_url``
and friends): a real ``redis-server`` (killed, hung and restarted mid-run) and a real
S3-compatible server (moto, as its own process). Chunks written by one storage manager are
found and loaded, bit-exact, by another — as a second engine on another machine would."""

from __future__ import annotations

import logging
import sys
import time

import pytest
from support.redis_server import REDIS_MISSING, RedisServer, redis_available
from support.s3_server import ErrorAnswers, ListingDenied, S3Server, isolate_aws_environment
from support.tiers import (
    check_remote_down,
    fill,
    key,
    make_pool,
    remote_manager,
    same_bytes,
    store_chunks,
    wait_until,
)

from kvtier.config import ConfigError, load_config
from kvtier.config.remote import REMOTE_SCHEMES
from kvtier.observability.stats import Counter, Stats, TierCounter, tier_counter
from kvtier.storage import schemes, wire
from kvtier.storage.blob_store import join_parts
from kvtier.storage.manager import StorageManager
from kvtier.storage.redis_store import PART_SEP, RedisStore
from kvtier.storage.serde import NaiveSerde

needs_redis = pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING)


@pytest.fixture
def pool():
    pool = make_pool(64)
    yield pool
    pool.close()


def share_and_load(url: str, pool, tier: str, **settings) -> None:
    """One manager stores 4 chunks; a second (another engine) finds and loads them."""
    writer_stats, reader_stats = Stats(), Stats()
    writer = remote_manager(url, writer_stats, **settings)
    objs = store_chunks(writer, pool, range(4))
    assert writer_stats.get(tier_counter(tier, TierCounter.PUT_CHUNKS)) == 4
    raw = sum(obj.data_nbytes for obj in objs.values())
    assert writer_stats.get(tier_counter(tier, TierCounter.PUT_RAW_BYTES)) == raw
    assert writer_stats.get(tier_counter(tier, TierCounter.PUT_BYTES)) > raw  # + headers
    reader = remote_manager(url, reader_stats, **settings)
    keys = [key(i) for i in range(6)]
    assert reader.lookup_prefix(keys) == 4
    got = reader.get_many(keys)
    assert all(same_bytes(got[i], objs[i]) for i in range(4)), "bit-exact across engines"
    assert got[4:] == [None, None]
    assert reader_stats.get(tier_counter(tier, TierCounter.GET_HITS)) == 4
    assert reader_stats.get(Counter.WRITEBACK_CHUNKS) == 4
    assert reader.cpu.prefix_length(keys) == 4  # now served from memory
    for obj in got[:4]:
        obj.ref_down()
    reader.clear()  # the model's namespace is emptied
    assert writer.lookup_prefix(keys[:1]) == 1  # still in the writer's CPU tier
    writer.cpu.clear()
    assert writer.lookup_prefix(keys[:1]) == 0
    writer.close()
    reader.close()


# -- Redis --------------------------------------------------------------------------


@pytest.fixture
def redis():
    if not redis_available():
        pytest.skip(REDIS_MISSING)
    with RedisServer() as server:
        yield server


@needs_redis
@pytest.mark.redis
def test_redis_shares_chunks_between_engines(redis, pool):
    share_and_load(redis.url, pool, "redis")


@needs_redis
@pytest.mark.redis
def test_redis_with_password_and_ttl(pool):
    with RedisServer(password="s3cret") as server:
        share_and_load(server.url, pool, "redis", remote_password="s3cret")
        manager = remote_manager(server.url, remote_password="s3cret", remote_ttl_secs=0.3)
        store_chunks(manager, pool, [9])
        manager.cpu.clear()
        assert manager.lookup_prefix([key(9)]) == 1
        wait_until(lambda: manager.lookup_prefix([key(9)]) == 0, timeout=5)
        manager.close()


@needs_redis
@pytest.mark.redis
def test_redis_wrong_password_is_a_miss_not_a_crash(pool, caplog):
    with RedisServer(password="right") as server:
        stats = Stats()
        manager = remote_manager(server.url, stats, remote_password="wrong")
        with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
            assert manager.lookup_prefix([key(1)]) == 0
            obj = fill(pool, 1)
            manager.put(key(1), obj)  # kept in the CPU tier, dropped for the remote
        assert manager.lookup_prefix([key(1)]) == 1
        assert stats.get(tier_counter("redis", TierCounter.ERRORS)) >= 1
        assert any("Authentication" in r.getMessage() for r in caplog.records)
        manager.close()


@needs_redis
@pytest.mark.redis
def test_models_do_not_see_each_other(redis, pool):
    a = remote_manager(redis.url)
    store_chunks(a, pool, [1])
    config = load_config({"max_local_cpu_size": 0.05, "remote_url": redis.url}, env={})
    b = StorageManager(config, Stats(), namespace="org/model-b")
    assert b.lookup_prefix([key(1)]) == 0
    assert any(k.startswith(b"kvtier:org%2Fmodel-a:") for k in redis.client().keys("*"))
    a.close()
    b.close()


@needs_redis
@pytest.mark.redis
def test_redis_killed_and_restarted_mid_run(redis, pool, caplog):
    stats = Stats()
    manager = remote_manager(redis.url, stats)
    store_chunks(manager, pool, [1, 2])
    manager.cpu.clear()
    assert manager.lookup_prefix([key(1), key(2)]) == 2

    redis.stop()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        check_remote_down(manager, pool, "redis", budget_s=3.0)

        redis.start()  # an empty server (no persistence): it lost everything
        remote = manager.lower[0]
        wait_until(lambda: remote.is_up)
    assert stats.get(tier_counter("redis", TierCounter.RECONNECTS)) == 1
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    store_chunks(manager, pool, [7])
    manager.cpu.clear()
    assert manager.lookup_prefix([key(7)]) == 1
    manager.close()


def check_refused_stores_keep_the_tier_up(
    manager, stats, pool, tier, caplog, dropped: str = TierCounter.DROPPED_NO_SPACE
) -> None:
    """Chunk 1 is stored; the store now refuses writes (for room, or the ``dropped``
    cause): chunks 2 and 3 are failed stores (counted, warned once), not an outage: chunk
    1 is still found and loaded."""
    remote = manager.lower[0]
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        for i in (2, 3):
            manager.put(key(i), fill(pool, i))
            assert manager.flush(10)
    assert remote.is_up
    assert stats.get(tier_counter(tier, dropped)) == 2
    assert stats.get(tier_counter(tier, TierCounter.DROPPED_UNAVAILABLE)) == 0
    assert stats.get(tier_counter(tier, TierCounter.ERRORS)) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("refuses stores" in m for m in messages) == 1, messages
    assert not any("unavailable" in m for m in messages), messages
    manager.cpu.clear()
    assert manager.lookup_prefix([key(1), key(2)]) == 1
    got = manager.get_many([key(1)])
    assert got[0] is not None
    got[0].ref_down()
    assert remote.is_up


@needs_redis
@pytest.mark.redis
def test_redis_out_of_memory_is_a_failed_store_not_an_outage(redis, pool, caplog):
    stats = Stats()
    manager = remote_manager(redis.url, stats)
    store_chunks(manager, pool, [1])
    client = redis.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # every SET is refused with OOM; reads go on
    check_refused_stores_keep_the_tier_up(manager, stats, pool, "redis", caplog)
    client.config_set("maxmemory", 0)
    manager.close()


@needs_redis
@pytest.mark.redis
def test_a_read_only_acl_user_is_refused_stores_not_an_outage(redis, pool, caplog):
    """An ACL user that may read but not write (nor PING): stores are failed stores
    (``puts_dropped_error``), a removal is refused, and lookups and loads go on."""
    store_chunks(remote_manager(redis.url), pool, [1])
    redis.client().acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["~*"],
                               commands=["+@read", "-ping"])  # fmt: skip
    stats = Stats()
    manager = remote_manager(redis.url, stats, remote_username="reader", remote_password="pw")
    check_refused_stores_keep_the_tier_up(
        manager, stats, pool, "redis", caplog, dropped=TierCounter.DROPPED_ERROR
    )
    assert "'set' command" in caplog.text
    remote = manager.lower[0]
    assert not remote.remove(key(1))
    assert remote.is_up and manager.lookup_prefix([key(1)]) == 1
    manager.close()


@needs_redis
@pytest.mark.redis
def test_an_acl_user_denied_a_read_command_is_down_once_not_flapping(redis, pool, caplog):
    redis.client().acl_setuser("blind", enabled=True, passwords=["+pw"], keys=["~*"],
                               commands=["+@all", "-exists"])  # fmt: skip
    stats = Stats()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        manager = remote_manager(redis.url, stats, remote_username="blind", remote_password="pw")
        for _ in range(5):
            assert manager.lookup_prefix([key(1)]) == 0
            time.sleep(0.25)  # past a reconnect attempt (remote_reconnect_max_ms=200)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "'exists' command" in line and "remote_username" in line
    assert stats.get(tier_counter("redis", TierCounter.ERRORS)) == 1
    assert not manager.lower[0].is_up
    manager.close()


@needs_redis
@pytest.mark.redis
def test_a_read_only_replica_is_refused_stores_not_an_outage(redis, pool, caplog):
    store_chunks(remote_manager(redis.url), pool, [1])
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(redis.port)]) as replica:
        replica.wait_synced()
        assert replica.client().dbsize() == 1
        stats = Stats()
        manager = remote_manager(replica.url, stats)
        check_refused_stores_keep_the_tier_up(
            manager, stats, pool, "redis", caplog, dropped=TierCounter.DROPPED_ERROR
        )
        manager.close()


@needs_redis
@pytest.mark.redis
def test_hung_redis_costs_at_most_the_timeout(redis, pool):
    stats = Stats()
    manager = remote_manager(redis.url, stats, remote_timeout_ms=300)
    store_chunks(manager, pool, [1])
    manager.cpu.clear()
    redis.pause()
    try:
        started = time.monotonic()
        assert manager.lookup_prefix([key(1)]) == 0
        assert time.monotonic() - started < 1.5
        started = time.monotonic()
        assert manager.get_many([key(1)]) == [None]  # down: answered at once
        assert time.monotonic() - started < 0.2
    finally:
        redis.resume()
    wait_until(lambda: manager.lookup_prefix([key(1)]) == 1)
    manager.close()


@needs_redis
@pytest.mark.redis
def test_corrupt_redis_value_is_a_miss_and_removed(redis, pool):
    stats = Stats()
    manager = remote_manager(redis.url, stats)
    obj = fill(pool, 1)
    blob = bytearray(join_parts(wire.encode(key(1).to_string(), obj.tensor, NaiveSerde())))
    blob[-3] ^= 0xFF
    raw_key = f"kvtier:org%2Fmodel-a:{key(1).to_string()}"
    redis.client().set(raw_key, bytes(blob))
    assert manager.lookup_prefix([key(1)]) == 1  # present, but ...
    assert manager.get_many([key(1)]) == [None]  # ... refused
    assert stats.get(Counter.CORRUPT_CHUNKS) == 1
    wait_until(lambda: not redis.client().exists(raw_key))
    manager.close()


@needs_redis
@pytest.mark.redis
def test_a_split_redis_value_missing_a_part_is_removed_and_stored_again(redis, pool):
    """A part evicted on its own: the chunk is a corrupt miss whose manifest goes too, so
    the name stops answering EXISTS and the next store writes it again."""
    stats = Stats()
    manager = remote_manager(redis.url, stats)
    obj = fill(pool, 1)
    blob = join_parts(wire.encode(key(1).to_string(), obj.tensor, NaiveSerde()))
    splitting = RedisStore(redis.url, namespace="kvtier:org%2Fmodel-a:", max_value_bytes=4096)
    splitting.put_many([(key(1).to_string(), [blob])])
    splitting.close()
    raw_key = f"kvtier:org%2Fmodel-a:{key(1).to_string()}"
    redis.client().delete(f"{raw_key}{PART_SEP}1")
    assert manager.get_many([key(1)]) == [None]
    assert stats.get(Counter.CORRUPT_CHUNKS) == 1
    wait_until(lambda: not redis.client().keys(f"{raw_key}*"))
    objs = store_chunks(manager, pool, [1])
    manager.cpu.clear()
    (got,) = manager.get_many([key(1)])
    assert same_bytes(got, objs[1])
    got.ref_down()
    obj.ref_down()
    manager.close()


@needs_redis
@pytest.mark.redis
def test_a_redis_key_of_another_kind_is_a_corrupt_miss_not_an_outage(redis, pool):
    """Someone else's list under a chunk's key: a miss, counted and removed; the tier
    stays up and the other chunks of the batch load."""
    stats = Stats()
    manager = remote_manager(redis.url, stats)
    objs = store_chunks(manager, pool, [1, 2])
    manager.cpu.clear()
    raw_key = f"kvtier:org%2Fmodel-a:{key(1).to_string()}"
    redis.client().delete(raw_key)
    redis.client().rpush(raw_key, b"not kvtier's")
    got = manager.get_many([key(1), key(2)])
    assert got[0] is None and same_bytes(got[1], objs[2])
    got[1].ref_down()
    assert manager.lower[0].is_up
    assert stats.get(Counter.CORRUPT_CHUNKS) == 1
    assert stats.get(tier_counter("redis", TierCounter.ERRORS)) == 0
    wait_until(lambda: not redis.client().exists(raw_key))
    manager.close()


def test_unreachable_remote_at_start_up_does_not_stop_the_engine(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        manager = remote_manager("redis://127.0.0.1:1/0")  # nothing listens on port 1
    # Said once at start-up, not at the first store: the tier, its URL, misses until it answers.
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvtier.storage.remote"]
    assert "redis://127.0.0.1:1/0" in line and "at start-up" in line
    assert "misses" in line and "until it answers" in line
    started = time.monotonic()
    assert manager.lookup_prefix([key(1)]) == 0
    assert time.monotonic() - started < 2.0
    obj = fill(pool, 1)
    manager.put(key(1), obj)
    assert manager.lookup_prefix([key(1)]) == 1
    manager.close()


@needs_redis
@pytest.mark.redis
def test_disk_and_remote_together(tmp_path, pool, redis):
    stats = Stats()
    manager = remote_manager(redis.url, stats, local_disk=str(tmp_path))
    assert [t.name for t in manager.lower] == ["disk", "redis"]
    store_chunks(manager, pool, range(3))
    assert stats.get(tier_counter("disk", TierCounter.PUT_CHUNKS)) == 3
    assert stats.get(tier_counter("redis", TierCounter.PUT_CHUNKS)) == 3
    for path in list(tmp_path.rglob("*.kvt"))[:1]:
        path.unlink()  # the disk lost one chunk; the remote still has it
    manager.cpu.clear()
    assert manager.lookup_prefix([key(i) for i in range(3)]) == 3
    got = manager.get_many([key(i) for i in range(3)])
    assert all(g is not None for g in got)
    assert stats.get(tier_counter("disk", TierCounter.GET_HITS)) == 2
    assert stats.get(tier_counter("redis", TierCounter.GET_HITS)) == 1
    for obj in got:
        obj.ref_down()
    manager.close()


# -- S3 -----------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch):
    isolate_aws_environment(monkeypatch)
    with S3Server() as server:
        server.create_bucket("kvtier-cache")
        yield server


def s3_settings(server: S3Server) -> dict:
    return {
        "s3_endpoint_url": server.endpoint_url,
        "s3_region": server.region,
        "s3_access_key_id": server.access_key_id,
        "s3_secret_access_key": server.secret_access_key,
        "remote_timeout_ms": 2000,
    }


@pytest.mark.s3
def test_s3_shares_chunks_between_engines(s3, pool):
    share_and_load("s3://kvtier-cache/deployment-1", pool, "s3", **s3_settings(s3))
    names = [
        o["Key"] for o in s3.client().list_objects_v2(Bucket="kvtier-cache").get("Contents", [])
    ]
    assert names == []  # clear() removed this model's objects


@pytest.mark.s3
def test_s3_objects_are_named_by_prefix_model_and_key(s3, pool):
    manager = remote_manager("s3://kvtier-cache/deployment-1", **s3_settings(s3))
    store_chunks(manager, pool, [1])
    listing = s3.client().list_objects_v2(Bucket="kvtier-cache")["Contents"]
    assert [o["Key"] for o in listing] == [
        f"deployment-1/kvtier/org%2Fmodel-a/{key(1).to_string()}"
    ]
    manager.close()


@pytest.mark.s3
def test_s3_missing_bucket_is_a_miss_with_a_clear_warning(s3, pool, caplog):
    stats = Stats()
    manager = remote_manager("s3://no-such-bucket", stats, **s3_settings(s3))
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        obj = fill(pool, 1)
        manager.put(key(1), obj)
        assert manager.flush(10)
    assert stats.get(tier_counter("s3", TierCounter.DROPPED_UNAVAILABLE)) == 1
    assert any("no-such-bucket" in r.getMessage() for r in caplog.records)
    manager.cpu.clear()
    assert manager.lookup_prefix([key(1)]) == 0
    manager.close()


@pytest.mark.s3
@pytest.mark.parametrize(
    ("status", "code"), [(507, "XMinioStorageFull"), (403, "QuotaExceeded"), (507, "")]
)
def test_s3_quota_or_full_store_is_a_failed_store_not_an_outage(s3, pool, caplog, status, code):
    stats = Stats()
    manager = remote_manager("s3://kvtier-cache", stats, **s3_settings(s3))
    store_chunks(manager, pool, [1])
    client = manager.lower[0].store._client
    refuse = ErrorAnswers(status, code, "no room")
    refuse.install(client, "PutObject")
    check_refused_stores_keep_the_tier_up(manager, stats, pool, "s3", caplog)
    refuse.remove(client, "PutObject")
    manager.close()


@pytest.mark.s3
def test_s3_denied_puts_are_failed_stores_not_an_outage(s3, pool, caplog):
    """A policy that lets this client read the bucket but not write to it."""
    stats = Stats()
    manager = remote_manager("s3://kvtier-cache", stats, **s3_settings(s3))
    store_chunks(manager, pool, [1])
    ErrorAnswers(403, "AccessDenied").install(manager.lower[0].store._client, "PutObject")
    check_refused_stores_keep_the_tier_up(
        manager, stats, pool, "s3", caplog, dropped=TierCounter.DROPPED_ERROR
    )
    manager.close()


@pytest.mark.s3
def test_s3_policy_without_list_permission_serves_with_a_warning(s3, pool, caplog):
    """Credentials that may not list the bucket: S3 answers 403 for a chunk not stored
    yet. The tier starts up (one warning naming s3:ListBucket), such a chunk is a miss,
    stored chunks are found and loaded, and nothing counts as a failure."""
    stats = Stats()
    manager = remote_manager("s3://kvtier-cache/no-list", stats, **s3_settings(s3))
    remote = manager.lower[0]
    ListingDenied(s3).install(remote.store._client)
    with caplog.at_level(logging.WARNING):
        assert remote.check_at_start()  # as the tier starts: the ping learns the policy
        objs = store_chunks(manager, pool, [1, 2])
        manager.cpu.clear()
        assert manager.lookup_prefix([key(1), key(2), key(3)]) == 2
        got = manager.get_many([key(1), key(3)])
    assert same_bytes(got[0], objs[1]) and got[1] is None
    got[0].ref_down()
    assert remote.is_up
    assert stats.get(tier_counter("s3", TierCounter.ERRORS)) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "s3:ListBucket" in m] == messages and len(messages) == 1
    manager.close()


@pytest.mark.s3
@pytest.mark.parametrize(
    ("status", "code"),
    [(503, "SlowDown"), (503, "RequestLimitExceeded"), (400, "Throttling"), (429, "")],
)
def test_s3_throttling_is_back_pressure_not_an_outage(s3, pool, caplog, status, code):
    """A request S3 still throttles after botocore's retries: a put is a failed store
    (counted, warned once), a get a miss, and the tier stays up."""
    stats = Stats()
    # a prefix of its own: the warning is given once per tier
    manager = remote_manager(f"s3://kvtier-cache/{code or status}", stats, **s3_settings(s3))
    store_chunks(manager, pool, [1])
    remote = manager.lower[0]
    client = remote.store._client
    slow_down = ErrorAnswers(status, code, "Please reduce your request rate.")
    slow_down.install(client, "PutObject", "GetObject")
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.remote"):
        for i in (2, 3):
            manager.put(key(i), fill(pool, i))
            assert manager.flush(10)
        assert slow_down.attempts == 2 * (remote.store.throttle_retries + 1)
        manager.cpu.clear()
        assert manager.lookup_prefix([key(1), key(2)]) == 1
        assert manager.get_many([key(1)]) == [None]
    assert remote.is_up

    def count(what: str) -> float:
        return stats.get(tier_counter("s3", what))

    assert count(TierCounter.DROPPED_THROTTLED) == 2
    assert count(TierCounter.THROTTLED) == 1
    assert count(TierCounter.DROPPED_UNAVAILABLE) == count(TierCounter.ERRORS) == 0
    assert count(TierCounter.TIMEOUTS) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("throttles requests" in m for m in messages) == 1, messages
    assert not any("unavailable" in m for m in messages), messages
    slow_down.remove(client, "PutObject", "GetObject")
    got = manager.get_many([key(1)])
    assert got[0] is not None
    got[0].ref_down()
    manager.close()


@pytest.mark.s3
def test_s3_killed_and_restarted_mid_run(s3, pool):
    stats = Stats()
    manager = remote_manager("s3://kvtier-cache", stats, **s3_settings(s3))
    store_chunks(manager, pool, [1])
    manager.cpu.clear()
    assert manager.lookup_prefix([key(1)]) == 1
    s3.stop()
    started = time.monotonic()
    assert manager.lookup_prefix([key(1)]) == 0
    assert manager.get_many([key(1)]) == [None]
    assert time.monotonic() - started < 5.0
    s3.start()  # moto restarts empty
    s3.create_bucket("kvtier-cache")
    wait_until(lambda: manager.lower[0].is_up)
    assert stats.get(tier_counter("s3", TierCounter.RECONNECTS)) == 1
    store_chunks(manager, pool, [2])
    manager.cpu.clear()
    assert manager.lookup_prefix([key(2)]) == 1
    manager.close()


# -- the registry of remote stores ---------------------------------------------------


@pytest.mark.parametrize("scheme", schemes.remote_schemes())
def test_every_registered_scheme_opens_through_its_module(scheme):
    assert schemes.scheme_of(f"{scheme.upper()}://somewhere").name == scheme
    assert callable(schemes.load_module(f"{scheme}://somewhere").open_remote)


def test_every_url_form_the_redis_parser_documents_is_a_registered_scheme():
    from kvtier.config.redis_url import parse_url

    for scheme in ("redis", "rediss", "redis-cluster", "rediss-cluster", "valkeys-cluster"):
        url = f"{scheme}://h:6379"
        assert schemes.scheme_of(url) is not None, scheme
        assert load_config({"remote_url": url}, env={}).remote_url == url
        parse_url(url)  # and the store's own parser takes it


def test_the_config_takes_exactly_the_registered_schemes():
    # a URL of each scheme's form (each is checked when the config is built)
    forms = {"unix": "/x.sock", "s3": "bucket/x", "fs": "/x", "kvtier": "h:1", "lm": "h:1"}
    for scheme in schemes.remote_schemes():
        url = f"{scheme}://{forms.get(scheme, 'h/0')}"
        assert load_config({"remote_url": url}, env={}).remote_url
    allowed = "expected a URL with scheme " + ", ".join(schemes.remote_schemes())
    for url in ("memcached://localhost:11211", "redis:/h", "localhost:6379"):
        with pytest.raises(ConfigError, match=allowed):
            load_config({"remote_url": url}, env={})
    with pytest.raises(ValueError, match=allowed):
        schemes.load_module("memcached://localhost:11211")


def test_the_registry_covers_exactly_the_declared_schemes():
    assert schemes.remote_schemes() == REMOTE_SCHEMES


def test_a_missing_client_library_names_its_pip_extra(monkeypatch):
    for module in [name for name in sys.modules if name.startswith("kvtier.storage.s3_")]:
        monkeypatch.delitem(sys.modules, module)  # imported again, and boto3 with them
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now fails
    with pytest.raises(ValueError, match=r"\(boto3\): pip install 'kvtier\[s3\]'"):
        schemes.load_module("s3://bucket/prefix")


def test_a_scheme_is_registered_once():
    with pytest.raises(ValueError, match="'redis' is registered already"):
        schemes.register("Redis", "kvtier.storage.elsewhere")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@h:1/0", "redis://user:***@h:1/0"),
        ("redis-cluster://:p@ss@a:1,b:2", "redis-cluster://:***@a:1,b:2"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
        ("s3://bucket/a:b@c", "s3://bucket/a:b@c"),
        ("no scheme", "no scheme"),
    ],
)
def test_redact_url_hides_only_the_password(url, shown):
    assert schemes.redact_url(url) == shown
