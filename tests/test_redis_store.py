"""RedisStore against real redis-server processes (see ``support/redis_server.py``).

Covers the ``BlobStore`` contract (batched round trips, misses, namespaces, clear), TTL,
split values, authentication, TLS, Unix sockets, Redis Cluster, concurrency and the
failure paths: a killed, paused or absent server raises ``StoreUnavailable`` quickly and
the same store object works again once the server is back.
"""

from __future__ import annotations

import array
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest
import redis
from support.redis_server import (
    CLUSTER_MISSING,
    REDIS_MISSING,
    TLS_MISSING,
    LocalRedisCluster,
    RedisServer,
    TlsFiles,
    free_port,
    make_tls_files,
    redis_available,
    redis_cluster_available,
    redis_tls_available,
)

from kvtier.config.redis_url import parse_url
from kvtier.storage.blob_store import BlobStore, StoreUnavailable, WriteDenied
from kvtier.storage.redis_store import MANIFEST_MAGIC, PART_SEP, RedisStore

pytestmark = [
    pytest.mark.redis,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not redis_available(), reason=REDIS_MISSING),
]

needs_tls = pytest.mark.skipif(
    not (redis_available() and redis_tls_available()), reason=TLS_MISSING
)
needs_cluster = pytest.mark.skipif(not redis_cluster_available(), reason=CLUSTER_MISSING)

ALL_BYTES = bytes(range(256))


# -- fixtures and helpers ------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A plain server shared by the module; tests isolate themselves by namespace."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def make_store(request):
    """``make_store(url, **kwargs)``: a RedisStore in a namespace unique to the test."""
    stores: list[RedisStore] = []

    def make(url: str, **kwargs) -> RedisStore:
        kwargs.setdefault("namespace", f"t:{request.node.name}:{len(stores)}:")
        stores.append(RedisStore(url, **kwargs))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


def blob_of(parts: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """What the store must give back for ``parts``: their bytes, concatenated."""
    return b"".join(memoryview(p).tobytes() for p in parts)


def blob_cases() -> dict[str, list]:
    """Blobs as the layer above may hand them over: header + payload, odd buffers."""
    rng = random.Random(7)
    return {
        "no-parts": [],
        "one-empty-part": [b""],
        "only-empty-parts": [b"", b"", b""],
        "every-byte-value": [ALL_BYTES * 4],
        "header-and-payload": [b"HDR\x00\x01", memoryview(rng.randbytes(10_000))],
        "empty-parts-between": [b"a", b"", memoryview(b"b"), b""],
        "bytearray": [bytearray(b"xyz\x00\xff")],
        "memoryview-int32": [memoryview(array.array("i", range(-500, 500)))],
        "memoryview-2d-uint16": [memoryview(np.arange(12, dtype=np.uint16).reshape(3, 4))],
        "memoryview-strided": [memoryview(ALL_BYTES)[::3]],
        "starts-with-manifest-magic": [MANIFEST_MAGIC, b"but not a manifest"],
        "three-mib": [rng.randbytes(3 * 2**20)],
    }


def assert_blobs(names: Sequence[str], got: Sequence[bytes | None], want: Sequence) -> None:
    """Compare per name; say which name differs and where."""
    assert len(got) == len(want), f"{len(got)} answers for {len(want)} names"
    for name, g, w in zip(names, got, want, strict=True):
        if g == w:
            assert w is None or type(g) is bytes, f"{name}: got a {type(g).__name__}"
            continue
        if g is None or w is None:
            sizes = ["None" if b is None else f"{len(b)} bytes" for b in (g, w)]
            pytest.fail(f"{name}: got {sizes[0]}, want {sizes[1]}")
        pairs = zip(g, w, strict=False)  # compare the common length
        at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(g), len(w)))
        pytest.fail(f"{name}: {len(g)} bytes vs {len(w)} expected, first difference at {at}")


@contextmanager
def unavailable_within(seconds: float, *fragments: str) -> Iterator[None]:
    """Expect StoreUnavailable within ``seconds``, its message holding ``fragments``."""
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        yield
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"StoreUnavailable after {elapsed:.2f}s, want < {seconds}s"
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def raw_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key starting with ``prefix``, as stored (test names hold glob characters)."""
    literal = "".join("\\" + c if c in "\\*?[]" else c for c in prefix)
    return sorted(client.scan_iter(match=literal + "*"))


# -- the contract --------------------------------------------------------------------


def test_is_a_blob_store(server, make_store):
    store = make_store(server.url)
    assert isinstance(store, BlobStore)
    assert store.name == "redis"
    store.ping()


def test_round_trip_of_many_blobs_in_one_batch(server, make_store):
    store = make_store(server.url)
    cases = list(blob_cases().items()) * 4
    items = [(f"blob-{i}-{label}", parts) for i, (label, parts) in enumerate(cases)]
    store.put_many(items)

    absent = [f"absent-{i}" for i in range(5)]
    names = [name for name, _ in items] + absent
    random.Random(3).shuffle(names)
    want = {name: blob_of(parts) for name, parts in items}
    assert_blobs(names, store.get_many(names), [want.get(n) for n in names])
    assert store.exists_many(names) == [n in want for n in names]


def test_absent_names_and_empty_batches(server, make_store):
    store = make_store(server.url)
    assert store.get_many(["nope", "nope-2"]) == [None, None]
    assert store.exists_many(["nope"]) == [False]
    assert store.delete_many(["nope"]) == 0
    assert store.get_many([]) == []
    assert store.exists_many([]) == []
    assert store.delete_many([]) == 0
    store.put_many([])


def test_overwrite_and_delete(server, make_store):
    store = make_store(server.url)
    store.put_many([("a", [b"one"]), ("b", [b"two"])])
    store.put_many([("a", [b"uno"])])
    assert store.get_many(["a", "b"]) == [b"uno", b"two"]
    assert store.delete_many(["a", "missing", "b"]) == 2
    assert store.get_many(["a", "b"]) == [None, None]


def test_batched_calls_are_one_round_trip(server, make_store, monkeypatch):
    executes = []
    original = redis.client.Pipeline.execute

    def counting_execute(pipe, *args, **kwargs):
        executes.append(len(pipe.command_stack))
        return original(pipe, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting_execute)
    store = make_store(server.url, max_value_bytes=1000)
    names = [f"n{i}" for i in range(50)]

    for call, expected in [
        (lambda: store.put_many([(n, [b"x" * 10]) for n in names]), [50]),
        (lambda: store.get_many(names), [50]),
        (lambda: store.exists_many(names), []),  # all present: one multi-key EXISTS
        (lambda: store.exists_many(["absent", *names]), [51]),  # mixed: then per key
        (lambda: store.put_many([("big", [b"y" * 2500])]), [4]),  # 3 parts + manifest
        (lambda: store.get_many([*names, "big"]), [51, 3]),  # the parts: a second trip
        (lambda: store.delete_many([*names, "big"]), [51, 54]),  # probe, then delete
    ]:
        executes.clear()
        call()
        assert executes == expected


def test_namespaces_isolate_two_stores_on_one_server(server, make_store):
    a = make_store(server.url, namespace="model-a:")
    b = make_store(server.url, namespace="model-b:")
    a.put_many([("same", [b"from a"]), ("only-a", [b"1"])])
    b.put_many([("same", [b"from b"])])
    assert a.get_many(["same", "only-a"]) == [b"from a", b"1"]
    assert b.get_many(["same", "only-a"]) == [b"from b", None]
    assert b.delete_many(["same"]) == 1
    assert a.get_many(["same"]) == [b"from a"]
    a.clear()


def test_clear_only_touches_its_namespace(server, make_store):
    # The glob characters must be matched literally: unescaped, "x*[1]?:*" would also
    # match the neighbour's keys "xyz1a:...".
    store = make_store(server.url, namespace="x*[1]?:", max_value_bytes=100)
    neighbour = make_store(server.url, namespace="xyz1a:")
    store.put_many([(f"k{i}", [b"v" * 10]) for i in range(2500)])  # several SCAN pages
    store.put_many([("split", [b"s" * 450])])  # 5 parts, counted as one blob
    neighbour.put_many([("k1", [b"theirs"])])
    client = server.client()
    client.set("unrelated", b"keep")

    assert store.clear() == 2501
    assert raw_keys(client, "x*[1]?:") == []
    assert neighbour.get_many(["k1"]) == [b"theirs"]
    assert client.get("unrelated") == b"keep"
    assert store.clear() == 0
    client.delete("unrelated")


def test_ttl_expires_blobs_and_their_parts(server, make_store):
    store = make_store(server.url, ttl_s=0.3, max_value_bytes=100)
    store.put_many([("small", [b"s"]), ("split", [b"p" * 250])])
    client = server.client()
    keys = [f"{store.namespace}small", f"{store.namespace}split"]
    keys += [f"{store.namespace}split{PART_SEP}{i}" for i in range(3)]
    for key in keys:
        assert 0 < client.pttl(key) <= 300, key

    deadline = time.monotonic() + 5
    while store.exists_many(["small", "split"]) != [False, False]:
        assert time.monotonic() < deadline, "blobs did not expire"
        time.sleep(0.05)
    assert store.get_many(["small", "split"]) == [None, None]
    assert raw_keys(client, store.namespace) == []


def test_no_ttl_means_no_expiry(server, make_store):
    store = make_store(server.url)
    store.put_many([("k", [b"v"])])
    assert server.client().pttl(f"{store.namespace}k") == -1


# -- split values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "parts"),
    [(0, 0), (1, 0), (999, 0), (1000, 0), (1001, 2), (2000, 2), (3500, 4), (5000, 5)],
)
def test_split_values_round_trip(server, make_store, size, parts):
    store = make_store(server.url, max_value_bytes=1000)
    blob = (ALL_BYTES * 20)[:size]
    # Hand it over as three pieces, so the store has to join them before splitting.
    store.put_many([("v", [blob[:7], memoryview(blob[7:500]), blob[500:]])])
    assert_blobs(["v"], store.get_many(["v"]), [blob])
    assert store.exists_many(["v"]) == [True]

    client = server.client()
    stored = client.get(f"{store.namespace}v")
    assert stored.startswith(MANIFEST_MAGIC) == (parts > 0)
    assert len(raw_keys(client, f"{store.namespace}v{PART_SEP}")) == parts

    assert store.delete_many(["v"]) == 1
    assert raw_keys(client, store.namespace) == []


def test_a_missing_or_damaged_part_is_a_miss(server, make_store):
    store = make_store(server.url, max_value_bytes=100)
    store.put_many([(name, [bytes([i]) * 350]) for i, name in enumerate("abcd")])
    client = server.client()
    ns = store.namespace
    client.delete(f"{ns}a{PART_SEP}1")  # evicted part
    client.set(f"{ns}b{PART_SEP}3", b"short")  # wrong length
    client.set(f"{ns}c", MANIFEST_MAGIC + b"\xff not cbor")  # malformed manifest

    # Incomplete blobs read as empty ones, which the layer above deletes as corrupt: while
    # the manifest is there, the name answers EXISTS and is never stored again.
    assert store.get_many(["a", "b", "c", "d"]) == [b"", b"", b"", bytes([3]) * 350]
    assert store.exists_many(["a", "b"]) == [True, True]
    assert store.delete_many(["a", "b", "c", "d"]) == 4
    assert raw_keys(client, ns) == [f"{ns}c{PART_SEP}{i}".encode() for i in range(4)]


def test_a_key_holding_another_kind_of_value_is_an_empty_blob(server, make_store):
    """Not kvtier's (a list, a hash), in a blob's place or a part's: an empty blob, which
    the layer above rejects; never a failure of the whole batch. It can be deleted."""
    store = make_store(server.url, max_value_bytes=100)
    store.put_many([(name, [bytes([i]) * 150]) for i, name in enumerate("abc")])
    client, ns = server.client(), store.namespace
    client.delete(f"{ns}a", f"{ns}b{PART_SEP}1")
    client.rpush(f"{ns}a", b"x")
    client.hset(f"{ns}b{PART_SEP}1", "f", b"x")
    assert store.get_many(["a", "b", "c"]) == [b"", b"", bytes([2]) * 150]
    assert store.exists_many(["a", "b"]) == [True, True]
    assert store.delete_many(["a", "b"]) == 2
    assert store.get_many(["a", "b"]) == [None, None]


def test_a_blob_starting_with_the_manifest_magic_is_not_misread(server, make_store):
    store = make_store(server.url)
    blob = MANIFEST_MAGIC + b"\xa0"  # the magic and an empty CBOR map
    store.put_many([("tricky", [blob])])
    assert store.get_many(["tricky"]) == [blob]
    assert store.clear() == 1


# -- authentication ------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    with RedisServer(password="topsecret", users={"alice": "wonder land"}) as srv:
        yield srv


def test_password_from_keyword_or_url(auth_server, make_store):
    port = auth_server.port
    make_store(auth_server.url, password="topsecret").ping()
    make_store(f"redis://:topsecret@127.0.0.1:{port}/0").ping()
    # The keyword wins over the URL.
    make_store(f"redis://:wrong@127.0.0.1:{port}/0", password="topsecret").ping()


@pytest.mark.parametrize("password", ["wrong", None])
def test_a_wrong_or_missing_password_is_unavailable_not_a_hang(auth_server, make_store, password):
    store = make_store(auth_server.url, password=password, timeout_s=0.5)
    with unavailable_within(2.5, auth_server.url, "ping", "Authentication"):
        store.ping()
    with unavailable_within(2.5, "put_many"):
        store.put_many([("k", [b"v"])])


def test_an_authentication_failure_names_the_credential_keys(auth_server, make_store):
    for password in ("wrong", None):
        store = make_store(auth_server.url, password=password, timeout_s=0.5)
        with unavailable_within(2.5, "remote_password", "remote_username", "remote_url"):
            store.ping()


def test_acl_user(auth_server, make_store):
    port = auth_server.port
    make_store(f"redis://alice:wonder%20land@127.0.0.1:{port}/0").ping()
    store = make_store(auth_server.url, username="alice", password="wonder land")
    store.put_many([("k", [b"v"])])
    assert store.get_many(["k"]) == [b"v"]
    wrong = make_store(auth_server.url, username="alice", password="topsecret")
    with unavailable_within(2.5, "Authentication"):
        wrong.ping()


def test_acl_users_denied_commands(auth_server, make_store):
    """A user denied writes (and PING) gets ``WriteDenied`` for them, and is up; one
    denied a read is unavailable, ping included, told the commands kvtier needs."""
    space = {"namespace": "acl:"}
    make_store(auth_server.url, password="topsecret", **space).put_many([("k", [b"v"])])
    admin = auth_server.client()
    for user, commands in [("reader", ["+@read"]), ("blind", ["+@all", "-exists", "-ping"])]:
        admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["~*"], commands=commands)
    reader = make_store(auth_server.url, username="reader", password="pw", **space)
    reader.ping()
    assert reader.get_many(["k"]) == [b"v"] and reader.exists_many(["k"]) == [True]
    for write in (lambda: reader.put_many([("k2", [b"v"])]), lambda: reader.delete_many(["k"])):
        with pytest.raises(WriteDenied, match=r"'(set|del)' command"):
            write()
    blind = make_store(auth_server.url, username="blind", password="pw", **space)
    for call in (blind.ping, lambda: blind.exists_many(["k"])):
        with unavailable_within(2.5, "'exists' command", "remote_username", "EXISTS"):
            call()


def test_a_read_only_replica_denies_writes_and_serves_reads(server, make_store):
    with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(server.port)]) as replica:
        make_store(server.url, namespace="rep:").put_many([("k", [b"v"])])
        store = make_store(replica.url, namespace="rep:")
        replica.wait_synced()
        assert store.get_many(["k"]) == [b"v"]
        with pytest.raises(WriteDenied, match="read only replica"):
            store.put_many([("k2", [b"v"])])
        store.ping()


def test_repr_and_errors_hide_the_password(auth_server, make_store):
    url = f"redis://alice:wonder%20land@127.0.0.1:{auth_server.port}/0"
    store = make_store(url, password="hunter2")
    for text in (repr(store), str(store), store.url):
        assert "wonder" not in text and "hunter2" not in text, text
    with pytest.raises(StoreUnavailable) as info:
        store.ping()  # alice's password is "wonder land", not hunter2
    assert "hunter2" not in str(info.value) and "wonder" not in str(info.value)


# -- failures and recovery -----------------------------------------------------------


def test_killed_server_raises_quickly_then_the_same_store_recovers(make_store):
    timeout = 0.5
    with RedisServer() as srv:
        store = make_store(srv.url, timeout_s=timeout, max_value_bytes=100)
        store.put_many([("k", [b"v"]), ("split", [b"s" * 300])])
        assert store.get_many(["k"]) == [b"v"]

        srv.stop()
        calls = {
            "put_many": lambda: store.put_many([("k", [b"v2"])]),
            "get_many": lambda: store.get_many(["k", "split"]),
            "exists_many": lambda: store.exists_many(["k"]),
            "delete_many": lambda: store.delete_many(["k"]),
            "clear": store.clear,
            "ping": store.ping,
        }
        for op, call in calls.items():
            with unavailable_within(5 * timeout, srv.url, op):
                call()

        srv.start()
        store.ping()  # the pool reconnects by itself; nothing was persisted
        assert store.get_many(["k", "split"]) == [None, None]
        store.put_many([("k", [b"back"]), ("split", [b"t" * 300])])
        assert store.get_many(["k", "split"]) == [b"back", b"t" * 300]


def test_a_hung_server_times_out_once_without_retries(make_store):
    timeout = 0.5
    with RedisServer() as srv:
        store = make_store(srv.url, timeout_s=timeout)
        store.put_many([("k", [b"v"])])
        srv.pause()
        try:
            # A single attempt takes one timeout; redis-py's default retries would take
            # at least two more.
            for op, call in [("get_many", lambda: store.get_many(["k"])), ("ping", store.ping)]:
                with unavailable_within(1.9 * timeout, op, "Timeout"):
                    call()
        finally:
            srv.resume()
        assert store.get_many(["k"]) == [b"v"]


def test_nothing_listening_is_unavailable(make_store):
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = make_store(url, timeout_s=0.5)  # the constructor does not connect
    with unavailable_within(2.5, url, "ping"):
        store.ping()
    with unavailable_within(2.5, "get_many"):
        store.get_many(["k"])


def test_server_errors_are_wrapped(make_store):
    with RedisServer(extra_args=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"]) as srv:
        store = make_store(srv.url)
        stored = 0
        with pytest.raises(StoreUnavailable, match="put_many failed: OutOfMemoryError"):
            for i in range(20):
                store.put_many([(f"k{i}", [bytes(2**20)])])
                stored += 1
        assert stored > 0
        assert store.get_many(["k0"]) == [bytes(2**20)]  # reads still work


def test_a_closed_store_raises(server):
    store = RedisStore(server.url)
    store.ping()
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.get_many(["k"])


def test_callers_beyond_max_connections_wait_at_most_timeout(server, make_store):
    store = make_store(server.url, max_connections=1, timeout_s=0.3)
    store._slots.acquire()  # another caller holds the only connection
    try:
        with unavailable_within(1.5, "no free connection", "max_connections=1"):
            store.ping()
    finally:
        store._slots.release()
    store.ping()


def test_concurrent_use_from_threads(server, make_store):
    store = make_store(server.url, max_connections=3, timeout_s=10, max_value_bytes=4096)
    shared = {f"shared-{i}": random.Random(i).randbytes(i * 700) for i in range(10)}
    store.put_many([(name, [blob]) for name, blob in shared.items()])
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            rng = random.Random(t)
            for round_ in range(30):
                mine = {f"w{t}-{round_}-{j}": rng.randbytes(rng.randrange(9000)) for j in range(4)}
                store.put_many([(name, [blob]) for name, blob in mine.items()])
                names = [*mine, *shared]
                assert store.get_many(names) == [*mine.values(), *shared.values()]
                assert store.exists_many(list(mine)) == [True] * 4
                assert store.delete_many(list(mine)) == 4
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert store.clear() == len(shared)


# -- addresses: URLs, databases, Unix sockets ----------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379",
        "127.0.0.1:6379",
        "redis//127.0.0.1",
        "redis://",
        "redis://:secret@",
        "redis://h:0",
        "redis://h:70000",
        "redis://h:port",
        "redis://h:1/x",
        "redis://h:1/-1",
        "redis://h:1?db=2",
        "redis://h1:1,h2:2",
        "redis-cluster://h:1/2",
        "unix://",
        "unix://host/path.sock",
        "unix:///path.sock?db=x",
        "unix:///path.sock?timeout=1",
        "redis://u:hunter2@h:99999",
    ],
)
def test_bad_urls_raise_value_error_naming_remote_url(url):
    with pytest.raises(ValueError, match="remote_url") as info:
        RedisStore(url)
    message = str(info.value)
    assert "redis://" in message and "redis-cluster://" in message  # the accepted forms
    assert "hunter2" not in message


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("redis://h", dict(nodes=(("h", 6379),), db=0, tls=False, cluster=False)),
        ("REDISS://u:p%40ss@h:7/3", dict(tls=True, db=3, username="u", password="p@ss")),
        ("valkey://:pw@h:1/2", dict(nodes=(("h", 1),), db=2, username=None, password="pw")),
        ("valkeys://h:1", dict(tls=True)),
        ("unix:///run/r.sock?db=2", dict(unix_path="/run/r.sock", db=2, nodes=())),
        ("redis-cluster://a:1,b:2", dict(cluster=True, nodes=(("a", 1), ("b", 2)))),
        ("valkey-cluster://[::1]:7000", dict(cluster=True, nodes=(("::1", 7000),))),
        ("rediss-cluster://a:1", dict(cluster=True, tls=True)),
    ],
)
def test_good_urls_parse(url, want):
    endpoint = parse_url(url)
    for field, value in want.items():
        assert getattr(endpoint, field) == value, field
    assert "@" not in endpoint.display and "pw" not in endpoint.display


def test_bad_arguments_raise_value_error(server):
    for kwargs, fragment in [
        ({"namespace": ""}, "namespace"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_value_bytes": 0}, "max_value_bytes"),
        ({"tls_ca_file": "/ca.pem"}, "tls_ca_file"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            RedisStore(server.url, **kwargs)


def test_database_number_in_the_url_isolates(server, make_store):
    db0 = make_store(f"redis://127.0.0.1:{server.port}/0", namespace="same:")
    db3 = make_store(f"redis://127.0.0.1:{server.port}/3", namespace="same:")
    db0.put_many([("k", [b"zero"])])
    db3.put_many([("k", [b"three"])])
    assert db0.get_many(["k"]) == [b"zero"]
    assert db3.get_many(["k"]) == [b"three"]
    assert db3.clear() == 1
    assert db0.get_many(["k"]) == [b"zero"]
    db0.clear()


def test_unix_socket(server, make_store):
    if server.unix_socket is None:
        pytest.skip("temporary directory too deep for a Unix socket path")
    store = make_store(server.unix_url + "?db=1")
    store.put_many([("k", [b"over a unix socket"])])
    assert store.get_many(["k"]) == [b"over a unix socket"]
    assert server.client(db=1).exists(f"{store.namespace}k") == 1
    assert store.clear() == 1


# -- TLS -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(tls_files) -> Iterator[RedisServer]:
    with RedisServer(tls=tls_files, tls_auth_clients=True, password="pw") as srv:
        yield srv


@needs_tls
def test_tls_round_trip_with_client_certificate(tls_server, make_store):
    tls = tls_server.tls
    store = make_store(
        tls_server.url,
        password="pw",
        tls_ca_file=tls.ca_file,
        tls_cert_file=tls.cert_file,
        tls_key_file=tls.key_file,
        max_value_bytes=1000,
    )
    assert store.url.startswith("rediss://")
    items = [(f"k{i}", [ALL_BYTES * i]) for i in range(10)]
    store.put_many(items)
    assert_blobs(
        [n for n, _ in items], store.get_many([n for n, _ in items]), [p[0] for _, p in items]
    )
    assert store.clear() == 10


@needs_tls
def test_tls_without_verification(tls_server, make_store):
    tls = tls_server.tls
    store = make_store(
        tls_server.url.replace("rediss", "valkeys"),
        password="pw",
        tls_cert_file=tls.cert_file,
        tls_key_file=tls.key_file,
        tls_verify=False,
    )
    store.ping()


@needs_tls
def test_tls_failures_are_unavailable(tls_server, make_store):
    tls = tls_server.tls
    unknown_ca = make_store(tls_server.url, password="pw", timeout_s=0.5)
    with unavailable_within(2.5, "ping", "CERTIFICATE_VERIFY_FAILED"):
        unknown_ca.ping()
    no_client_cert = make_store(tls_server.url, password="pw", tls_ca_file=tls.ca_file)
    with unavailable_within(2.5, "ping"):
        no_client_cert.ping()
    plain = make_store(f"redis://127.0.0.1:{tls_server.port}/0", password="pw", timeout_s=0.5)
    with unavailable_within(2.5, "ping"):
        plain.ping()


@needs_tls
@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({"tls_ca_file": "/no/such/ca.pem"}, "remote_tls_ca_file"),
        ({"tls_ca_file": "{garbage}"}, "remote_tls_ca_file"),
        ({"tls_key_file": "{key}"}, "remote_tls_key_file"),
        ({"tls_cert_file": "{cert}", "tls_key_file": "{garbage}"}, "remote_tls_cert_file"),
        ({"tls_cert_file": "{cert}", "tls_key_file": "/no/such/key"}, "remote_tls_key_file"),
    ],
    ids=["missing-ca", "ca-not-pem", "key-without-cert", "key-not-pem", "missing-key"],
)
def test_tls_files_that_cannot_be_loaded_are_value_errors(tls_files, tmp_path, files, named):
    """At start, naming the key, rather than an outage at every connection."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    paths = {"{garbage}": str(garbage), "{key}": tls_files.key_file, "{cert}": tls_files.cert_file}
    kwargs = {name: paths.get(value, value) for name, value in files.items()}
    with pytest.raises(ValueError, match=named):
        RedisStore("rediss://127.0.0.1:1/0", **kwargs)


# -- Redis Cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(primaries=3) as c:
        yield c


@needs_cluster
def test_cluster_round_trip_delete_and_clear(cluster, make_store):
    store = make_store(cluster.url, max_value_bytes=2000)
    other = make_store(cluster.url.replace("redis-", "valkey-"), namespace="other:")
    items = [(f"k{i}", [ALL_BYTES * (i % 7), b"tail"]) for i in range(300)]
    items.append(("split", [ALL_BYTES * 30]))  # 4 parts, spread over the nodes
    names = [name for name, _ in items]
    store.put_many(items)
    other.put_many([("k1", [b"theirs"])])

    assert_blobs(
        [*names, "absent"],
        store.get_many([*names, "absent"]),
        [*(blob_of(p) for _, p in items), None],
    )
    assert store.exists_many(["k0", "split", "absent"]) == [True, True, False]
    per_node = [len(raw_keys(client, store.namespace)) for client in cluster.clients()]
    assert all(count > 0 for count in per_node), per_node
    assert sum(per_node) == 301 + 4

    assert store.delete_many(["k0", "split", "absent"]) == 2
    assert store.get_many(["k0", "split"]) == [None, None]
    assert store.clear() == 299  # scans every primary
    assert [raw_keys(client, store.namespace) for client in cluster.clients()] == [[]] * 3
    assert other.get_many(["k1"]) == [b"theirs"]
    other.clear()


@needs_cluster
def test_cluster_node_killed_then_back(cluster, make_store):
    timeout = 0.5
    store = make_store(cluster.url, timeout_s=timeout)
    names = [f"k{i}" for i in range(100)]
    store.put_many([(name, [name.encode()]) for name in names])
    node = cluster.servers[1]
    node.stop()
    try:
        with unavailable_within(5 * timeout, "ping"):
            store.ping()  # every primary must answer
        with unavailable_within(5 * timeout, "get_many", f"{node.port}"):
            store.get_many(names)
    finally:
        node.start()  # it rejoins from its nodes.conf, empty
    deadline = time.monotonic() + 15
    while True:
        try:
            got = store.get_many(names)
            break
        except StoreUnavailable:  # ClusterDownError until the cluster agrees again
            assert time.monotonic() < deadline, "the cluster did not recover"
            time.sleep(0.1)
    store.ping()
    assert 0 < sum(value is None for value in got) < len(names)  # the killed node's share
    assert all(value in (None, name.encode()) for name, value in zip(names, got, strict=True))


@needs_cluster
def test_a_cluster_node_named_as_one_server_is_unavailable_naming_the_scheme(cluster, make_store):
    """Such a node answers for its own slots alone; every other key is MOVED."""
    store = make_store(f"redis://127.0.0.1:{cluster.servers[0].port}/0")
    with unavailable_within(2.5, "remote_url names a node of a Redis Cluster", "redis-cluster://"):
        store.ping()
    for call in (store.exists_many, store.get_many):  # CROSSSLOT, MOVED
        with unavailable_within(2.5, "redis-cluster://"):
            call([f"k{i}" for i in range(20)])


@needs_cluster
def test_cluster_down_is_unavailable_and_the_constructor_does_not_connect(make_store):
    url = f"redis-cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    store = make_store(url, timeout_s=0.5)
    with unavailable_within(2.5, "ping"):
        store.ping()
    with unavailable_within(2.5, "get_many"):
        store.get_many(["k"])


@needs_tls
@needs_cluster
def test_tls_cluster(tls_files, make_store):
    with LocalRedisCluster(tls=tls_files) as tls_cluster:
        store = make_store(
            tls_cluster.url,
            tls_ca_file=tls_files.ca_file,
            tls_cert_file=tls_files.cert_file,
            tls_key_file=tls_files.key_file,
        )
        assert store.url.startswith("rediss-cluster://")
        names = [f"k{i}" for i in range(100)]
        store.put_many([(name, [name.encode()]) for name in names])
        assert store.get_many(names) == [name.encode() for name in names]
        store.ping()
        assert store.clear() == 100
