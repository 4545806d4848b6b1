"""S3Store against what S3-compatible stores and restrictive bucket policies ask of a
client (moto's server, with stand-ins where a store or a policy answers differently)."""

from __future__ import annotations

import logging
import shutil
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from support.redis_server import make_tls_files
from support.s3_server import (
    ErrorAnswers,
    ListingDenied,
    RequireContentMD5,
    S3Server,
    isolate_aws_environment,
)

from kvtier.config import load_config
from kvtier.observability.stats import Stats
from kvtier.storage import s3_store
from kvtier.storage.blob_store import StoreUnavailable, Throttled, WriteDenied
from kvtier.storage.remote import RemoteRequest
from kvtier.storage.s3_store import S3Store
from kvtier.storage.serde import NaiveSerde

pytestmark = pytest.mark.s3


@pytest.fixture(autouse=True)
def _no_developer_aws(monkeypatch):
    isolate_aws_environment(monkeypatch)


def open_store(settings: dict) -> S3Store:
    """The store an engine of model ``m`` opens for these config settings."""
    config = load_config(settings, env={})
    return s3_store.open_store(RemoteRequest(config.remote_url, config, NaiveSerde(), Stats(), "m"))


@pytest.fixture(scope="module")
def server():
    with S3Server() as server:
        yield server


@pytest.fixture
def make_store(server):
    """``make_store(**kwargs)``: an S3Store on a new bucket of its own, closed after."""
    stores: list[S3Store] = []

    def make(**kwargs) -> S3Store:
        bucket = f"kvtier-{uuid.uuid4().hex[:12]}"
        server.create_bucket(bucket)
        store = S3Store(f"s3://{bucket}/p", **{**server.store_kwargs(), **kwargs})
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.mark.parametrize(
    ("style", "endpoint", "url"),
    [
        (None, "http://minio.internal:9000", "http://minio.internal:9000/kvtier-cache/p/"),
        ("path", "https://s3.example.com/base", "https://s3.example.com/base/kvtier-cache/p/"),
        ("virtual", "http://oss.internal", "http://kvtier-cache.oss.internal/p/"),
        ("auto", None, "https://kvtier-cache.s3.eu-west-1.amazonaws.com/p/"),
    ],
)
def test_addressing_style_and_endpoint_from_the_config(style, endpoint, url):
    store = open_store(
        {
            "remote_url": "s3://kvtier-cache/p",
            "s3_endpoint_url": endpoint,
            "s3_addressing_style": style,
            "s3_region": "eu-west-1",
            "s3_access_key_id": "k",
            "s3_secret_access_key": "s",
        }
    )
    absent = ErrorAnswers(404, None)  # answered here, the endpoint is never reached
    absent.install(store._client, "HeadObject")
    assert store.exists_many(["k"]) == [False]
    store.close()
    assert absent.urls == [url + "kvtier/m/k"]


def test_deletes_carry_content_md5(make_store):
    """Stores that predate botocore's CRC32 checksums refuse a DeleteObjects without
    Content-MD5: delete_many and clear must send it."""
    store = make_store()
    require_md5 = RequireContentMD5()
    require_md5.install(store._client)
    store.put_many([(f"n{i}", [b"v"]) for i in range(5)])
    assert store.delete_many(["n0", "n1", "absent"]) == 2
    assert store.clear() == 3
    assert require_md5.seen == 2
    assert store.exists_many(["n0", "n2", "n4"]) == [False, False, False]


def test_a_store_without_multi_object_delete(make_store):
    """Stores without DeleteObjects (Google Cloud Storage's XML API until 2026, Riak CS,
    MEGA S4) answer it NotImplemented: deletes go one DeleteObject each from then on."""
    store = make_store()
    no_bulk = ErrorAnswers(501, "NotImplemented", "A header or query you provided requested")
    no_bulk.install(store._client, "DeleteObjects")
    store.put_many([(f"n{i}", [b"v"]) for i in range(5)])
    assert store.delete_many(["n0", "n1", "absent"]) == 2
    assert store.clear() == 3
    assert no_bulk.attempts == 1
    assert store.exists_many(["n0", "n2", "n4"]) == [False, False, False]


# -- a policy without s3:ListBucket ------------------------------------------------------


def test_without_list_permission_absent_objects_are_misses(server, make_store, caplog):
    """S3 answers 403, not 404, for an absent object to a client that may not list the
    bucket: the ping finds that out, warns once, and a 403 then reads as absent."""
    store = make_store()
    store.put_many([("here", [b"v"])])
    denied = ListingDenied(server)
    denied.install(store._client)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.s3_listing"):
        store.ping()  # HeadBucket: 403, then the listing: AccessDenied
        store.ping()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "s3:ListBucket" in warnings[0], warnings
    assert store.listing.denied
    assert store.exists_many(["here", "absent"]) == [True, False]
    assert store.get_many(["here", "absent"]) == [b"v", None]
    store.put_many([("new", [b"w"])])
    assert store.delete_many(["new", "absent"]) == 1
    with pytest.raises(WriteDenied, match="s3:ListBucket"):
        store.clear()  # it lists; the store still reads and writes
    denied.remove(store._client)
    slow_down = ErrorAnswers(503, "SlowDown")
    slow_down.install(store._client, "ListObjectsV2")
    with pytest.raises(Throttled):
        store.clear()  # a refusal for want of ListBucket is only an AccessDenied
    slow_down.remove(store._client, "ListObjectsV2")
    store.ping()  # the policy now grants listing: a 403 is a failure again
    assert not store.listing.denied


def test_a_403_is_a_failure_while_listing_is_allowed(server, make_store):
    store = make_store()
    store.ping()
    denied = ListingDenied(server)
    denied.install(store._client)  # a policy changed since the ping
    with pytest.raises(StoreUnavailable, match=r"head_object of 'p/kvtier/absent'.*403"):
        store.exists_many(["absent"])
    with pytest.raises(StoreUnavailable, match=r"get_object of 'p/kvtier/absent'.*AccessDen"):
        store.get_many(["absent"])


def test_a_refused_read_before_any_ping_learns_the_policy(server, make_store, caplog):
    """A store opened after the ping (a kvtier serve opens one per namespace) learns the
    policy at its first refused read: a 403 is then a miss, or, where the listing is
    allowed (a policy denying s3:GetObject), a failure."""
    no_list, no_get = make_store(), make_store()
    ListingDenied(server).install(no_list._client)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.s3_listing"):
        assert no_list.exists_many(["absent", "absent-too"]) == [False, False]
        assert no_list.get_many(["absent"]) == [None]
    assert no_list.listing.denied
    assert sum("s3:ListBucket" in r.getMessage() for r in caplog.records) == 1
    ErrorAnswers(403, None).install(no_get._client, "HeadObject")
    with pytest.raises(StoreUnavailable, match=r"head_object of 'p/kvtier/absent'.*403"):
        no_get.exists_many(["absent"])
    assert no_get.listing.denied is False


def test_list_permission_on_the_prefix_only(server, make_store, caplog):
    """A policy granting s3:ListBucket on kvtier's prefix only (an s3:prefix condition):
    HeadBucket is refused, the listing of the prefix is not, and absent objects are 404s."""
    store = make_store()
    ListingDenied(server, listable_prefix="p/").install(store._client)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.s3_listing"):
        store.ping()
    assert not store.listing.denied and not caplog.records
    assert store.exists_many(["absent"]) == [False]
    store.put_many([("here", [b"v"])])
    assert store.clear() == 1


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_refused_credentials_are_not_a_policy_without_listing(make_store, code):
    store = make_store()
    ErrorAnswers(403, None).install(store._client, "HeadBucket")
    ErrorAnswers(403, code).install(store._client, "ListObjectsV2")
    with pytest.raises(StoreUnavailable, match=rf"list_objects_v2.*{code}.*s3_access_key_id"):
        store.ping()
    assert not store.listing.denied


# -- TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is missing")
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("client_certs", [False, True], ids=["https", "mutual-tls"])
def test_an_https_endpoint_with_its_own_ca(tls_files, client_certs):
    """A store behind a private CA (MinIO, Ceph RGW with their own certificates), which
    may also ask for a client certificate: remote_tls_ca_file, remote_tls_cert_file and
    remote_tls_key_file."""
    with S3Server(tls=tls_files, client_certs=client_certs) as server:
        server.create_bucket("kvtier-tls")
        settings = {
            "remote_url": "s3://kvtier-tls/p",
            "s3_endpoint_url": server.endpoint_url,
            "s3_access_key_id": server.access_key_id,
            "s3_secret_access_key": server.secret_access_key,
            "s3_region": server.region,
        }
        tls = {
            "remote_tls_ca_file": tls_files.ca_file,
            **({"remote_tls_cert_file": tls_files.cert_file} if client_certs else {}),
            **({"remote_tls_key_file": tls_files.key_file} if client_certs else {}),
        }
        store = open_store({**settings, **tls})
        store.ping()
        store.put_many([("k", [b"v"])])
        assert store.get_many(["k"]) == [b"v"]
        store.close()
        ca_only = {"remote_tls_ca_file": tls_files.ca_file}
        for short in ({}, ca_only) if client_certs else ({},):  # no CA; no client certificate
            store = open_store({**settings, **short})
            with pytest.raises(StoreUnavailable, match=r"head_bucket failed: (SSLError|.*SSL)"):
                store.ping()
            store.close()


def test_unusable_tls_files_are_named(tmp_path):
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate")
    for tls, key in (
        ({"remote_tls_ca_file": str(tmp_path / "missing.pem")}, "remote_tls_ca_file"),
        ({"remote_tls_ca_file": str(not_pem)}, "remote_tls_ca_file"),
        ({"remote_tls_cert_file": str(not_pem)}, "remote_tls_cert_file"),
        ({"remote_tls_key_file": str(not_pem)}, "remote_tls_key_file"),
    ):
        with pytest.raises(ValueError, match=key):
            open_store({"remote_url": "s3://kvtier-tls", "s3_endpoint_url": "https://h", **tls})
        # AWS's certificates are public: the keys are another remote's (a kvtier serve's
        # rediss:// peer discovery)
        open_store({"remote_url": "s3://kvtier-tls", **tls}).close()
