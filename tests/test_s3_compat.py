"""S3Store against what S3-compatible stores and restrictive bucket policies ask of a
client (moto's server, with stand-ins where a store or a policy answers differently)."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from support.s3_server import RequireContentMD5, S3Server, isolate_aws_environment

from kvtier.storage.s3_store import S3Store

pytestmark = pytest.mark.s3


@pytest.fixture(autouse=True)
def _no_developer_aws(monkeypatch):
    isolate_aws_environment(monkeypatch)


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
