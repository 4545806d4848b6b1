"""S3Store against a real S3-compatible server (moto, in its own process; see support/s3_server.py)."""

from __future__ import annotations

import array
import logging
import socket
import threading
import time
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from support.s3_server import ErrorAnswers, S3Server, free_port, isolate_aws_environment

from kvtier.config.remote_urls import parse_s3_url
from kvtier.keys import CacheKey
from kvtier.storage import s3_parts
from kvtier.storage.blob_store import BlobStore, StoreUnavailable, Throttled, WriteRefused
from kvtier.storage.s3_store import S3Store

pytestmark = pytest.mark.s3

ALL_BYTES = bytes(range(256))
# Names as kvtier makes them (CacheKey strings: '@', '%', '=', ':', '+', '.') and a few more.
NAMES = [
    CacheKey("org/Llama 3:8b+x=1", 2, 1, "bfloat16", bytes(range(16))).to_string(),
    CacheKey("m", 1, 0, "float16", b"\xff" * 8, layer=3, tags=(("lora", "a=b@c"),)).to_string(),
    "plain",
    "with space & ampersand",
    "tilde~star*quote'(paren)",
    "%2F%25already-encoded",
    "unicode-\u00e9\u4e2d",
]


@pytest.fixture(autouse=True)
def _no_developer_aws(monkeypatch):
    isolate_aws_environment(monkeypatch)


@pytest.fixture(scope="module")
def server():
    with S3Server() as server:
        yield server


@pytest.fixture
def bucket(server) -> str:
    name = f"kvtier-{uuid.uuid4().hex[:12]}"
    server.create_bucket(name)
    return name


@pytest.fixture
def make_store(server, bucket):
    """``make_store(url=None, **kwargs)``: an S3Store on this test's bucket, closed after."""
    stores: list[S3Store] = []

    def make(url: str | None = None, **kwargs) -> S3Store:
        store = S3Store(url or f"s3://{bucket}", **{**server.store_kwargs(), **kwargs})
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def blob_of(parts) -> bytes:
    return b"".join(bytes(memoryview(part).cast("B")) for part in parts)


def assert_blobs(got: list[bytes | None], expected: list[bytes | None], names: list[str]):
    """Equal blob by blob; a mismatch names the name, the sizes and the first bad byte."""
    assert len(got) == len(expected), f"{len(got)} answers for {len(expected)} names"
    for name, g, e in zip(names, got, expected, strict=True):
        if g == e:
            continue
        if g is None or e is None:
            pytest.fail(f"{name!r}: got {'None' if g is None else len(g)}, expected {e!r:.40}")
        first = next(
            (i for i, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), min(len(g), len(e))
        )
        pytest.fail(f"{name!r}: {len(g)} bytes vs {len(e)} expected, first difference at {first}")


def object_keys(server, bucket) -> list[str]:
    client = server.client()
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))
    finally:
        client.close()


def kvtier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvtier-s3")]


# -- round trips -----------------------------------------------------------------------


def test_is_a_blob_store(make_store):
    store = make_store()
    assert isinstance(store, BlobStore)
    assert store.name == "s3"
    store.ping()


def test_batched_round_trip(make_store):
    store = make_store()
    floats = array.array("f", [1.5, -2.25, 3.0])  # a non-byte buffer format
    blobs = {
        "empty-no-parts": [],
        "empty-part": [b""],
        "all-bytes": [ALL_BYTES],
        "header-and-payload": [b"hdr", memoryview(ALL_BYTES * 64)],
        "empty-parts-between": [b"", memoryview(b"a"), b"", bytearray(b"bc"), memoryview(b"")],
        "slice": [memoryview(ALL_BYTES)[7:200]],
        "floats": [b"f", memoryview(floats)],
    }
    blobs |= {f"many-{i}": [bytes([i]) * i, ALL_BYTES[i:]] for i in range(40)}
    store.put_many(list(blobs.items()))

    names = [n for name in blobs for n in (name, f"absent-{name}")]
    expected = [blob_of(blobs[n]) if n in blobs else None for n in names]
    assert_blobs(store.get_many(names), expected, names)
    assert store.exists_many(names) == [n in blobs for n in names]
    assert blob_of(blobs["floats"])[1:] == floats.tobytes()


def test_empty_batches(make_store):
    store = make_store()
    store.put_many([])
    assert store.get_many([]) == []
    assert store.exists_many([]) == []
    assert store.delete_many([]) == 0


def test_overwrite_and_last_of_a_batch_wins(make_store):
    store = make_store()
    store.put_many([("k", [b"first"])])
    store.put_many([("k", [b"second"]), ("j", [b"x"]), ("k", [b"third"])])
    assert store.get_many(["k", "j"]) == [b"third", b"x"]


def test_names_round_trip_as_object_keys(make_store, server, bucket):
    store = make_store(f"s3://{bucket}/deploy", namespace="ns/")
    store.put_many([(name, [name.encode()]) for name in NAMES])
    assert store.get_many(NAMES) == [name.encode() for name in NAMES]
    assert store.exists_many(NAMES) == [True] * len(NAMES)
    # Stored under exactly prefix/ + namespace + name: no double encoding on the way.
    assert object_keys(server, bucket) == sorted(f"deploy/ns/{name}" for name in NAMES)
    assert store.delete_many(NAMES) == len(NAMES)
    assert object_keys(server, bucket) == []


def test_absent_names_are_none_and_false(make_store):
    store = make_store()
    assert store.get_many(NAMES) == [None] * len(NAMES)
    assert store.exists_many(NAMES) == [False] * len(NAMES)
    assert store.delete_many(NAMES) == 0


# -- namespaces, delete, clear ---------------------------------------------------------


def test_prefix_and_namespace_isolation(make_store, server, bucket):
    stores = {
        "bucket a/": make_store(f"s3://{bucket}", namespace="a/"),
        "p1 a/": make_store(f"s3://{bucket}/p1", namespace="a/"),
        "p1 b/": make_store(f"s3://{bucket}/p1/", namespace="b/"),
        "p1/sub a/": make_store(f"s3://{bucket}/p1/sub", namespace="a/"),
        "p2 a/": make_store(f"s3://{bucket}/p2", namespace="a/"),
    }
    for label, store in stores.items():
        store.put_many([("shared", [label.encode()]), (f"own-{label}", [b"x"])])
    for label, store in stores.items():
        assert store.get_many(["shared"]) == [label.encode()], label
        others = [f"own-{other}" for other in stores if other != label]
        assert store.exists_many(others) == [False] * len(others), label

    assert stores["p1 a/"].clear() == 2
    for label, store in stores.items():
        assert store.exists_many(["shared"]) == [label != "p1 a/"], label
    assert len(object_keys(server, bucket)) == 8


def test_delete_many_counts_present_names_in_batches(make_store):
    store = make_store()
    store.delete_batch_size = 3
    names = [f"n{i}" for i in range(10)]
    store.put_many([(name, [b"v"]) for name in names])
    asked = [*names[:7], "absent", names[0], "absent-too"]  # duplicates count once
    assert store.delete_many(asked) == 7
    assert store.exists_many(names) == [False] * 7 + [True] * 3


@pytest.mark.parametrize("page_size, batch_size", [(7, 3), (5, 1000), (1000, 1000)])
def test_clear_pages_through_its_own_objects_only(make_store, page_size, batch_size):
    mine = make_store(namespace="mine/")
    # "mine/" sorts between these neighbours, so a listing that strays would reach them.
    neighbours = [make_store(namespace=ns) for ns in ("mina/", "mine", "minf/", "")]
    mine.list_page_size, mine.delete_batch_size = page_size, batch_size
    names = [f"chunk-{i:03d}" for i in range(41)]
    mine.put_many([(name, [b"x"]) for name in names])
    for store in neighbours:
        store.put_many([("keep", [b"y"])])

    assert mine.clear() == len(names)
    assert mine.exists_many(names) == [False] * len(names)
    assert mine.clear() == 0
    for store in neighbours:
        assert store.get_many(["keep"]) == [b"y"], store


# -- multipart ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part_sizes",
    [[4096], [4097], [1, 4095, 1], [3000, 0, 2000, 5000], [10_000]],
    ids=["at-threshold", "one-over", "tiny-edges", "with-empty", "ten-parts"],
)
def test_multipart_round_trip(make_store, server, bucket, part_sizes):
    store = make_store(multipart_threshold=4096, multipart_part_size=1024)
    parts = [
        memoryview((ALL_BYTES * (n // 256 + 1))[i % 256 : i % 256 + n])
        for i, n in enumerate(part_sizes)
    ]
    blob = blob_of(parts)
    store.put_many([("big", parts), ("small", [b"s"])])
    assert_blobs(store.get_many(["big", "small"]), [blob, b"s"], ["big", "small"])

    client = server.client()
    head = client.head_object(Bucket=bucket, Key="kvtier/big")
    client.close()
    parts_used = -(-len(blob) // 1024)
    assert head["ETag"].strip('"').endswith(f"-{parts_used}"), "not a multipart upload"


def test_pieces_slice_without_copies():
    a, b = memoryview(bytes(range(10))), memoryview(bytes(range(10, 15)))
    pieces = s3_parts.pieces([a, b], 4)
    assert [bytes(p) for p in pieces] == [bytes(range(i, min(i + 4, 15))) for i in (0, 4, 8, 12)]
    # Pieces inside one buffer are views of it; only the one spanning both is a copy.
    assert [isinstance(p, memoryview) for p in pieces] == [True, True, False, True]
    assert pieces[0].obj is a.obj
    assert s3_parts.pieces([memoryview(b"")], 4) == []


def test_failed_multipart_upload_is_aborted(make_store, server, bucket):
    # Parts below the server's minimum (1 KiB for S3Server) fail at completion.
    store = make_store(multipart_threshold=1000, multipart_part_size=500)
    with pytest.raises(
        StoreUnavailable, match=r"complete_multipart_upload of 'kvtier/big'.*EntityTooSmall"
    ):
        store.put_many([("big", [ALL_BYTES * 8])])
    assert store.exists_many(["big"]) == [False]
    client = server.client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    client.close()


# -- failures ----------------------------------------------------------------------------


def test_missing_bucket_is_unavailable(server, make_store):
    store = make_store("s3://kvtier-no-such-bucket")
    with pytest.raises(StoreUnavailable, match=r"'kvtier-no-such-bucket' does not exist"):
        store.ping()
    with pytest.raises(StoreUnavailable, match=r"get_object of 'kvtier/k' failed: NoSuchBucket"):
        store.get_many(["k"])
    with pytest.raises(StoreUnavailable, match=r"put_object.*NoSuchBucket"):
        store.put_many([("k", [b"v"])])
    with pytest.raises(StoreUnavailable, match=r"list_objects_v2.*NoSuchBucket"):
        store.clear()


@pytest.mark.parametrize(
    ("status", "code"),
    [(503, "SlowDown"), (503, "RequestLimitExceeded"), (400, "Throttling"), (429, "")],
)
def test_throttled_requests_are_retried_with_backoff(make_store, status, code):
    store = make_store(throttle_retries=3, throttle_backoff_s=0.2)
    slow_down = ErrorAnswers(status, code, "Please reduce your request rate.", times=2)
    slow_down.install(store._client, "PutObject", "GetObject")
    store.put_many([("k", [b"v"])])
    assert store.get_many(["k"]) == [b"v"]
    assert slow_down.attempts == 2 + 1 + 1  # the put's retries end in a stored blob


@pytest.mark.parametrize(
    ("status", "code"),
    [(503, "SlowDown"), (503, "RequestLimitExceeded"), (400, "Throttling"), (429, "")],
)
def test_throttled_past_the_retries_is_throttled_not_an_outage(make_store, status, code):
    store = make_store(throttle_retries=2, throttle_backoff_s=0.3)
    store.put_many([("k", [b"v"])])
    slow_down = ErrorAnswers(status, code, "Please reduce your request rate.")
    slow_down.install(store._client, "PutObject", "GetObject", "HeadBucket")
    for call in (lambda: store.put_many([("k", [b"w"])]), lambda: store.get_many(["k"])):
        started, before = time.monotonic(), slow_down.attempts
        with pytest.raises(Throttled, match=rf"throttled after 2 retries: {code}.*HTTP {status}"):
            call()
        assert slow_down.attempts - before == 3
        assert time.monotonic() - started < 0.3 + 1.0  # at most throttle_backoff_s asleep
    store.ping()  # the bucket answers, throttling or not
    slow_down.remove(store._client, "PutObject", "GetObject", "HeadBucket")
    assert store.get_many(["k"]) == [b"v"]


def test_a_throttled_head_is_throttled_not_an_outage(make_store):
    """S3 answers a throttled HEAD with a bare 503 (its SlowDown code goes with the body a
    HEAD answer has not): retried, then ``Throttled``; a throttled HeadBucket pings."""
    store = make_store(throttle_retries=2, throttle_backoff_s=0.2)
    store.put_many([("k", [b"v"])])
    slow_down = ErrorAnswers(503, None, times=2)
    slow_down.install(store._client, "HeadObject")
    assert store.exists_many(["k"]) == [True]
    assert slow_down.attempts == 2 + 1
    slow_down.remove(store._client, "HeadObject")
    slow_down = ErrorAnswers(503, None)
    slow_down.install(store._client, "HeadObject", "HeadBucket")
    with pytest.raises(Throttled, match=r"head_object of 'kvtier/k' throttled after 2 retries"):
        store.exists_many(["k"])
    store.ping()


@pytest.mark.parametrize(("status", "code"), [(503, "ServiceUnavailable"), (500, "InternalError")])
def test_a_failing_server_is_not_retried(make_store, status, code):
    store = make_store()
    failing = ErrorAnswers(status, code)
    failing.install(store._client, "PutObject")
    with pytest.raises(StoreUnavailable, match=rf"put_object of 'kvtier/k' failed: {code}") as e:
        store.put_many([("k", [b"v"])])
    assert not isinstance(e.value, Throttled | WriteRefused)
    assert failing.attempts == 1  # an outage costs one request: RemoteTier decides


def test_missing_credentials_are_unavailable(server, bucket, make_store):
    # moto accepts any key by default; a store with no credentials at all cannot sign.
    store = S3Store(f"s3://{bucket}", endpoint_url=server.endpoint_url, region="us-east-1")
    try:
        with pytest.raises(StoreUnavailable, match="NoCredentialsError"):
            store.get_many(["k"])
    finally:
        store.close()


@pytest.mark.parametrize(("status", "code"), [(403, "InvalidAccessKeyId"), (403, "")])
def test_missing_or_refused_credentials_name_their_keys(server, bucket, make_store, status, code):
    unsigned = S3Store(f"s3://{bucket}", endpoint_url=server.endpoint_url, region="us-east-1")
    refused = make_store()
    ErrorAnswers(status, code).install(refused._client, "GetObject", "HeadBucket", "ListObjectsV2")
    try:
        for call in (lambda: unsigned.get_many(["k"]), lambda: refused.get_many(["k"])):
            with pytest.raises(StoreUnavailable, match="s3_access_key_id and s3_secret_acc"):
                call()
        with pytest.raises(StoreUnavailable, match="s3_access_key_id") as info:
            refused.ping()  # HEAD: a bare 403
        assert ("s3:ListBucket" in str(info.value)) == (code == "")  # forbidden: a policy?
    finally:
        unsigned.close()


@pytest.mark.parametrize("operation", ["ping", "get", "exists", "put", "delete", "clear"])
def test_nothing_listening_is_unavailable_quickly(operation):
    port = free_port()
    started = time.monotonic()
    store = S3Store(
        "s3://kvtier-test",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        access_key_id="k",
        secret_access_key="s",
        timeout_s=1.0,
    )
    calls = {
        "ping": store.ping,
        "get": lambda: store.get_many(["a", "b"]),
        "exists": lambda: store.exists_many(["a"]),
        "put": lambda: store.put_many([("a", [b"x"]), ("b", [b"y"])]),
        "delete": lambda: store.delete_many(["a"]),
        "clear": store.clear,
    }
    try:
        with pytest.raises(StoreUnavailable, match=rf"'kvtier-test' at http://127.0.0.1:{port}"):
            calls[operation]()
    finally:
        store.close()
    assert time.monotonic() - started < 10.0


def test_silent_server_times_out():
    """A server that accepts connections and never answers: the read timeout ends it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel completes handshakes; nobody ever reads
        port = listener.getsockname()[1]
        store = S3Store(
            "s3://kvtier-test",
            endpoint_url=f"http://127.0.0.1:{port}",
            region="us-east-1",
            access_key_id="k",
            secret_access_key="s",
            timeout_s=0.5,
        )
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable, match=r"get_object.*(Timeout|timed out)"):
                store.get_many(["a", "b", "c"])
        finally:
            store.close()
        assert time.monotonic() - started < 10.0


def test_failed_batch_returns_after_every_request_settled(make_store):
    store = make_store(max_concurrency=4)
    real_head = store._client.head_object
    in_flight, most = 0, 0
    lock = threading.Lock()

    def head_object(**kwargs):
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            time.sleep(0.02)
            if kwargs["Key"].endswith("bad"):
                raise OSError("injected failure")
            return real_head(**kwargs)
        finally:
            with lock:
                in_flight -= 1

    store._client.head_object = head_object
    names = [f"n{i}" for i in range(12)] + ["bad"] + [f"m{i}" for i in range(12)]
    with pytest.raises(StoreUnavailable, match=r"head_object of 'kvtier/bad'.*injected failure"):
        store.exists_many(names)
    assert in_flight == 0
    assert most <= 4
    store._client.head_object = real_head
    assert store.exists_many(["n0"]) == [False]


def test_killed_server_then_restarted():
    with S3Server() as server:
        server.create_bucket("kvtier-crash")
        store = S3Store("s3://kvtier-crash", timeout_s=2.0, **server.store_kwargs())
        try:
            store.put_many([("k", [b"before"])])
            outcome: list[BaseException] = []

            def keep_working():
                try:
                    for i in range(100_000):
                        store.put_many([(f"n{i}", [b"v"])])
                        store.get_many([f"n{i}", "k"])
                except BaseException as exc:
                    outcome.append(exc)

            worker = threading.Thread(target=keep_working)
            worker.start()
            time.sleep(0.3)
            server.stop()
            worker.join(timeout=15)
            assert not worker.is_alive(), "a request hung after the server died"
            assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable), outcome
            with pytest.raises(StoreUnavailable, match=r"head_bucket.*EndpointConnectionError"):
                store.ping()

            server.start()  # same port, empty
            with pytest.raises(StoreUnavailable, match="does not exist"):
                store.ping()
            server.create_bucket("kvtier-crash")
            store.ping()
            assert store.get_many(["k"]) == [None]
            store.put_many([("k", [b"after"])])
            assert store.get_many(["k"]) == [b"after"]
        finally:
            store.close()
    assert not server.running, "the server process outlived its context"


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "",
        "bucket",
        "bucket/prefix",
        "http://bucket/prefix",
        "s3:/bucket",
        "s3://",
        "s3:///prefix",
        "s3://Upper-Case",
        "s3://under_score",
        "s3://ab",
        "s3://" + "a" * 64,
        "s3://-leading-hyphen",
        "s3://double..dot",
        "s3://192.168.1.10",
        "s3://user@bucket",
        "s3://bucket:9000",
        "s3://bucket/prefix?versionId=1",
        "s3://bucket#fragment",
    ],
)
def test_bad_url_is_value_error(url):
    with pytest.raises(ValueError, match=r"remote_url must be s3://bucket\[/prefix\]"):
        S3Store(url)


@pytest.mark.parametrize(
    "url, bucket, prefix",
    [
        ("s3://bkt", "bkt", ""),
        ("s3://bkt/", "bkt", ""),
        ("s3://my.bucket-1/a", "my.bucket-1", "a/"),
        ("s3://bkt/a/b/", "bkt", "a/b/"),
        ("s3://bkt//a//b", "bkt", "a/b/"),
    ],
)
def test_url_parsing(url, bucket, prefix):
    assert parse_s3_url(url) == (bucket, prefix)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"multipart_part_size": -1}, "multipart_part_size"),
        ({"multipart_threshold": 0}, "multipart_threshold"),
        ({"addressing_style": "sideways"}, "addressing_style"),
        ({"access_key_id": "k"}, "access_key_id and secret_access_key"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S3Store("s3://kvtier-test", **kwargs)


def test_path_addressing(make_store):
    store = make_store(addressing_style="path")
    store.put_many([("k", [b"v"])])
    assert store.get_many(["k"]) == [b"v"]


# -- threads -----------------------------------------------------------------------------


def test_concurrent_callers(make_store):
    store = make_store(max_concurrency=4)
    errors: list[BaseException] = []

    def work(thread: int):
        try:
            for round_ in range(6):
                names = [f"t{thread}-r{round_}-{i}" for i in range(5)]
                blobs = [bytes([thread, round_, i]) * (i + 1) for i in range(5)]
                store.put_many([(n, [b]) for n, b in zip(names, blobs, strict=True)])
                assert_blobs(store.get_many(names), blobs, names)
                assert store.exists_many(names) == [True] * 5
                assert store.delete_many(names[:2]) == 2
                assert store.get_many(names[:2]) == [None, None]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    assert len(kvtier_threads()) <= 4


def test_every_connection_goes_back_to_the_pool(make_store, bucket, caplog):
    """Every worker's request in flight and, meanwhile, requests on callers' threads (a
    ping, a multipart upload's create and complete): each connection is kept for the
    next request, not closed with urllib3's "Connection pool is full" warning."""
    store = make_store(max_concurrency=2)
    store.put_many([("k", [b"v"])])
    in_flight = 2 + 3  # the workers', and a ping and two writers' multipart calls
    with caplog.at_level(logging.WARNING, logger="urllib3"):
        bodies = [
            store._client.get_object(Bucket=bucket, Key="kvtier/k")["Body"]
            for _ in range(in_flight)
        ]  # each holds its connection until read
        for body in bodies:
            assert body.read() == b"v"
            body.close()
    assert not [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()]


def test_close_stops_worker_threads_and_is_idempotent(make_store):
    before = set(kvtier_threads())
    store = make_store(max_concurrency=5)
    store.put_many([(f"n{i}", [b"v"]) for i in range(20)])
    assert set(kvtier_threads()) - before, "the batch ran on no worker thread"
    store.close()
    assert set(kvtier_threads()) <= before
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.get_many(["n0"])
    with pytest.raises(StoreUnavailable, match="closed"):
        store.ping()


def test_close_during_a_batch_fails_it_cleanly(make_store):
    store = make_store(max_concurrency=1)
    outcome: list[BaseException] = []

    def read_many():
        try:
            store.get_many([f"n{i}" for i in range(500)])
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read_many)
    reader.start()
    time.sleep(0.1)
    store.close()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable), outcome
    assert "closed" in str(outcome[0])
    assert not kvtier_threads()
