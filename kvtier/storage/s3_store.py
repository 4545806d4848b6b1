"""The S3-compatible object-store remote: one object per blob, under ``[prefix/]namespace``.

``S3Store`` is a thin ``BlobStore`` (see ``blob_store``) over boto3's low-level client. The
object key of a name is ``<prefix from the URL>/`` + ``namespace`` + ``name``, so several
models and deployments share one bucket. Batched calls fan out, one request per name, on a
bounded thread pool the store owns (S3 has no multi-get); the client's connection pool
keeps a connection alive for every worker, and for requests made on callers' threads.

What the store leaves to the layer above (``RemoteTier``): retries of a failed request
(botocore makes one attempt), health, integrity (the wire format checksums every payload,
so botocore's own CRC pass is turned off: see ``s3_client``) and asynchrony.

A throttled request (``SlowDown``, ``Throttling``, ``RequestLimitExceeded``, HTTP 429, a
HEAD's bare 503: back-pressure from a store that answers) is the one the store retries itself,
``throttle_retries`` times with a jittered doubling backoff that sleeps at most
``throttle_backoff_s`` in all (botocore's retries would rewind the body, which they cannot
for the memoryviews the store sends uncopied); still throttled, it raises ``Throttled``,
no outage: the store answers. A throttled ``ping`` returns (the bucket answered).

NOTE: a HEAD request cannot tell a missing object from a missing bucket (both are a bare
404), so on a deleted bucket ``exists_many`` answers False and ``delete_many`` 0; ``ping``,
``get_many``, ``put_many`` and ``clear`` report the missing bucket as ``StoreUnavailable``.

NOTE: to a client whose policy does not let it list the bucket (no ``s3:ListBucket``), S3
answers 403, not 404, for an absent object. ``ping`` (a HeadBucket refused, then a listing
of the prefix refused) or the first read refused finds that out, warns once, and lookups
and loads then read a 403 as absent; ``clear``, which lists, raises ``WriteDenied``.

A write refused for room (a quota, a full backend: ``QuotaExceeded``, MinIO's
``XMinioStorageFull``, HTTP 507, an object over the size limit) raises ``WriteRefused``:
the bucket still reads.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError

from kvtier.config.redis_url import check_tls_files
from kvtier.config.remote_urls import parse_s3_url
from kvtier.storage import s3_errors
from kvtier.storage.blob_store import Buffer, StoreUnavailable, WriteDenied
from kvtier.storage.remote import RemoteRequest, RemoteTier, open_blob_tier
from kvtier.storage.s3_client import make_client
from kvtier.storage.s3_listing import ListPermission
from kvtier.storage.s3_parts import byte_view, joined, part_size_for, pieces

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["S3Store", "open_remote"]

# Everything the client stack raises for a failed request: botocore's own errors (which
# wrap most urllib3 and socket errors), the few urllib3 errors it lets through, and OSError.
_CLIENT_ERRORS = (BotoCoreError, ClientError, HTTPError, OSError)
# S3 limit: DeleteObjects takes at most 1000 keys.
_MAX_DELETE_KEYS = 1000


class S3Store:
    """Blobs as objects in an S3-compatible bucket. Thread-safe.

    Args:
        url: ``s3://bucket[/prefix]``.
        namespace: key prefix under the URL's prefix; it should end with ``/`` so that one
            store's names never read as another namespace's (names contain no ``/``).
        timeout_s: connect and read timeout of every request.
        endpoint_url: an S3-compatible server (MinIO, Ceph, moto); None for AWS.
        region: signing region; None for boto3's default chain (and us-east-1 after it).
        access_key_id, secret_access_key, session_token: explicit credentials; when
            absent, boto3's default chain (environment, profile, instance role).
        max_concurrency: requests in flight at once (worker threads and connections).
        multipart_threshold: blobs of at least this many bytes go as a multipart upload.
        multipart_part_size: bytes per uploaded part (S3 requires at least 5 MiB).
        addressing_style: ``"path"``, ``"virtual"`` or ``"auto"`` (None: botocore's).
        ca_file: CA bundle that verifies an https endpoint (None: boto3's, which
            ``AWS_CA_BUNDLE`` may name).
        cert_file, key_file: client certificate and its key, for an endpoint that asks
            for one (mutual TLS); the key may be in ``cert_file``.
        throttle_retries: retries of a throttled request before it fails (``Throttled``).
        throttle_backoff_s: the longest those retries of one request sleep in all; keep
            it below the tier's wait (``remote_timeout_ms``), or a throttled read times out.

    Raises:
        ValueError: a bad URL (naming ``remote_url``), TLS file (naming its ``remote_tls_*``
            key) or argument. The constructor does not contact the endpoint (an unreachable
            one shows first in ``ping``); only boto3's default credential chain, when used,
            may ask an instance metadata service for a role's credentials.

    Every call raises ``StoreUnavailable`` when the store fails (see ``blob_store``),
    including after ``close``.
    """

    name = "s3"

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "kvtier/",
        timeout_s: float = 5.0,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrency: int = 16,
        multipart_threshold: int = 64 * 2**20,
        multipart_part_size: int = 16 * 2**20,
        addressing_style: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        throttle_retries: int = 3,
        throttle_backoff_s: float = 0.5,
    ):
        self.bucket, self.prefix = parse_s3_url(url)
        _check_positive(
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            multipart_threshold=multipart_threshold,
            multipart_part_size=multipart_part_size,
        )
        if throttle_retries < 0 or throttle_backoff_s < 0:
            raise ValueError(
                "throttle_retries and throttle_backoff_s must not be negative, got "
                f"{throttle_retries!r} and {throttle_backoff_s!r}"
            )
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key must be given together")
        check_tls_files(ca_file, cert_file, key_file)
        self.key_prefix = self.prefix + namespace
        self.multipart_threshold = multipart_threshold
        self.multipart_part_size = multipart_part_size
        self.throttle_retries = throttle_retries
        # the first pause: the retries' pauses double, adding up to throttle_backoff_s
        self._throttle_pause_s = throttle_backoff_s / max(2**throttle_retries - 1, 1)
        # Keys per ListObjectsV2 page and per DeleteObjects: S3's maxima, smaller in tests.
        self.list_page_size = 1000
        self.delete_batch_size = _MAX_DELETE_KEYS
        self.bulk_delete = True  # False once the store answered a DeleteObjects NotImplemented

        try:
            self._client = make_client(
                endpoint_url=endpoint_url,
                region=region,
                access_key_id=access_key_id,
                secret_access_key=secret_access_key,
                session_token=session_token,
                timeout_s=timeout_s,
                workers=max_concurrency,
                addressing_style=addressing_style,
                ca_file=ca_file,
                cert_file=cert_file,
                key_file=key_file,
            )
        except BotoCoreError as exc:  # e.g. a profile named in the environment is missing
            raise ValueError(f"cannot configure the s3 client for {url!r}: {exc}") from exc
        self.endpoint = self._client.meta.endpoint_url
        self.listing = ListPermission(
            f"s3 bucket {self.bucket!r} at {self.endpoint}, prefix {self.key_prefix!r}",
            lambda: self._send(
                self._client.list_objects_v2, Bucket=self.bucket, Prefix=self.key_prefix, MaxKeys=1
            ),
            _CLIENT_ERRORS,
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvtier-s3")
        self._closed = False
        self._close_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.bucket}/{self.key_prefix} at {self.endpoint})"

    # -- BlobStore ---------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store each ``(name, parts)`` as one object (parts concatenated). Overwrites.

        Small blobs go as one PutObject each, concurrently; a blob of at least
        ``multipart_threshold`` bytes as a multipart upload whose parts go concurrently
        and are slices of the caller's buffers (only a part spanning two buffers is
        copied). A failed upload is aborted.
        """
        self._check_open()
        # The last blob of a name wins, as it would if they were put one after another.
        blobs = {self._key(name): [byte_view(part) for part in parts] for name, parts in items}
        small, large = [], []
        for key, views in blobs.items():
            size = sum(view.nbytes for view in views)
            if size >= self.multipart_threshold:
                large.append((key, views, size))
            else:
                small.append((self._put_object, key, views))
        self._run_all(small)
        for key, views, size in large:
            self._put_multipart(key, views, size)

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """The blob under each name (one concurrent GetObject each), or None where absent."""
        self._check_open()
        return self._run_all([(self._get_object, self._key(name)) for name in names])

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name is present (one concurrent HeadObject each)."""
        self._check_open()
        return self._run_all([(self._head_object, self._key(name)) for name in names])

    def delete_many(self, names: Sequence[str]) -> int:
        """Delete the names (absent ones are ignored); returns how many were present.

        S3 reports every key of a DeleteObjects as deleted, present or not, so the
        present ones are found first (HeadObject) and only they are deleted.
        """
        self._check_open()
        keys = list(dict.fromkeys(self._key(name) for name in names))
        present = self._run_all([(self._head_object, key) for key in keys])
        return self._delete_keys([key for key, here in zip(keys, present, strict=True) if here])

    def clear(self) -> int:
        """Delete every object under this store's ``prefix + namespace``; returns how many.

        Lists a page, deletes it, lists on after its last key (``StartAfter`` rather than
        a continuation token, so deleting never shifts what the next page holds).
        """
        self._check_open()
        deleted, start_after = 0, ""
        while True:
            after = {"StartAfter": start_after} if start_after else {}
            try:
                page = self._send(
                    self._client.list_objects_v2,
                    Bucket=self.bucket,
                    Prefix=self.key_prefix,
                    MaxKeys=self.list_page_size,
                    **after,
                )
            except _CLIENT_ERRORS as exc:
                failure = self._failure("list_objects_v2", self.key_prefix, exc)
                if isinstance(exc, ClientError) and self.listing.is_denied_listing(exc):
                    cause = f"s3 {s3_errors.error_code(exc)}"
                    message = f"{failure}; clear lists, which needs s3:ListBucket"
                    raise WriteDenied(message, cause) from exc
                raise failure from exc
            keys = [obj["Key"] for obj in page.get("Contents", [])]
            deleted += self._delete_keys(keys)
            if not keys or not page.get("IsTruncated"):
                return deleted
            start_after = keys[-1]

    def ping(self) -> None:
        """Return if the bucket answers, else raise StoreUnavailable.

        Asks HeadBucket; one refused (403, which is also S3's answer to a client not
        allowed to list the bucket) is asked again as a listing of this store's prefix,
        which learns whether the client may list it (see the NOTE on s3:ListBucket).
        """
        self._check_open()
        try:
            self._send(self._client.head_bucket, Bucket=self.bucket)
        except ClientError as exc:
            if s3_errors.is_throttled(exc):  # past the retries: the bucket answers
                return
            self._check_bucket_exists(exc)
            if s3_errors.error_code(exc) != str(s3_errors.FORBIDDEN):
                raise self._failure("head_bucket", None, exc) from exc
            self._ping_by_listing()
            return
        except _CLIENT_ERRORS as exc:
            raise self._failure("head_bucket", None, exc) from exc
        self.listing.denied = False

    def _ping_by_listing(self) -> None:
        try:
            self.listing.learn()
        except ClientError as exc:
            if s3_errors.is_throttled(exc):
                return
            self._check_bucket_exists(exc)
            raise self._failure("list_objects_v2", self.key_prefix, exc) from exc
        except _CLIENT_ERRORS as exc:
            raise self._failure("list_objects_v2", self.key_prefix, exc) from exc

    def _check_bucket_exists(self, exc: ClientError) -> None:
        if s3_errors.error_code(exc) in s3_errors.NO_BUCKET:
            raise StoreUnavailable(
                f"s3 bucket {self.bucket!r} does not exist at {self.endpoint} "
                "(kvtier does not create buckets)"
            ) from exc

    def close(self) -> None:
        """Stop the worker threads and close the connections; idempotent.

        Requests in flight finish (within ``timeout_s``); queued ones, and every later
        call, raise StoreUnavailable.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._client.close()

    # -- one request each --------------------------------------------------------------

    def _put_object(self, key: str, views: list[memoryview]) -> None:
        # Joined here, in the worker, so a batch holds at most one joined copy per worker.
        try:
            self._send(self._client.put_object, Bucket=self.bucket, Key=key, Body=joined(views))
        except _CLIENT_ERRORS as exc:
            raise self._failure("put_object", key, exc) from exc

    def _get_object(self, key: str) -> bytes | None:
        try:
            response = self._send(self._client.get_object, Bucket=self.bucket, Key=key)
            body = response["Body"]
            try:
                return body.read()
            finally:
                body.close()  # NOTE: a half-read body must not go back to the pool
        except ClientError as exc:
            if self.listing.is_absent(exc):
                return None
            raise self._failure("get_object", key, exc) from exc
        except _CLIENT_ERRORS as exc:
            raise self._failure("get_object", key, exc) from exc

    def _head_object(self, key: str) -> bool:
        try:
            self._send(self._client.head_object, Bucket=self.bucket, Key=key)
            return True
        except ClientError as exc:
            if self.listing.is_absent(exc):
                return False
            raise self._failure("head_object", key, exc) from exc
        except _CLIENT_ERRORS as exc:
            raise self._failure("head_object", key, exc) from exc

    def _delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` concurrently: DeleteObjects batches, or one DeleteObject each
        where the store has no multi-object delete (it answers ``NotImplemented``)."""
        if self.bulk_delete:
            size = self.delete_batch_size
            batches = [
                (self._delete_objects, keys[i : i + size]) for i in range(0, len(keys), size)
            ]
            if None not in (deleted := self._run_all(batches)):
                return sum(deleted)
            self.bulk_delete = False
        self._run_all([(self._delete_object, key) for key in keys])
        return len(keys)

    def _delete_object(self, key: str) -> None:
        try:
            self._send(self._client.delete_object, Bucket=self.bucket, Key=key)
        except _CLIENT_ERRORS as exc:
            raise self._failure("delete_object", key, exc) from exc

    def _delete_objects(self, keys: list[str]) -> int | None:
        """How many of ``keys`` one DeleteObjects deleted; None where the store has none."""
        try:
            response = self._send(
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
            )
        except _CLIENT_ERRORS as exc:
            if isinstance(exc, ClientError) and s3_errors.is_not_implemented(exc):
                return None
            operation = f"delete_objects ({len(keys)} keys from {keys[0]!r})"
            raise self._failure(operation, None, exc) from exc
        # A 200 answer may still carry per-key failures (e.g. AccessDenied on one key).
        if errors := response.get("Errors"):
            first = errors[0]
            raise StoreUnavailable(
                f"s3 bucket {self.bucket!r} at {self.endpoint}: delete_objects failed for "
                f"{len(errors)} of {len(keys)} keys, first {first.get('Key')!r}: "
                f"{first.get('Code')}: {first.get('Message')}"
            )
        return len(keys)

    def _put_multipart(self, key: str, views: list[memoryview], size: int) -> None:
        part_size = part_size_for(size, self.multipart_part_size)
        try:
            upload_id = self._send(
                self._client.create_multipart_upload, Bucket=self.bucket, Key=key
            )["UploadId"]
        except _CLIENT_ERRORS as exc:
            raise self._failure("create_multipart_upload", key, exc) from exc
        try:
            uploads = [
                (self._upload_part, key, upload_id, number, body)
                for number, body in enumerate(pieces(views, part_size), start=1)
            ]
            parts = self._run_all(uploads)
            self._send(
                self._client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException as exc:
            self._abort_upload(key, upload_id)
            if isinstance(exc, _CLIENT_ERRORS):
                raise self._failure("complete_multipart_upload", key, exc) from exc
            raise

    def _upload_part(
        self, key: str, upload_id: str, number: int, body: bytes | memoryview
    ) -> dict[str, Any]:
        try:
            response = self._send(
                self._client.upload_part,
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
            )
        except _CLIENT_ERRORS as exc:
            raise self._failure(f"upload_part {number}", key, exc) from exc
        return {"ETag": response["ETag"], "PartNumber": number}

    def _abort_upload(self, key: str, upload_id: str) -> None:
        # Best effort: when the store is down this fails too, and the incomplete upload
        # stays until the bucket's lifecycle rule (AbortIncompleteMultipartUpload) ends it.
        try:
            self._send(
                self._client.abort_multipart_upload, Bucket=self.bucket, Key=key, UploadId=upload_id
            )
        except _CLIENT_ERRORS as exc:
            logger.warning("s3: could not abort the upload of %r: %s", key, exc)

    def _send(self, request: Callable[..., T], **params: Any) -> T:
        """``request(**params)`` (a client method), a throttled answer retried
        ``throttle_retries`` times after a jittered pause that doubles each time."""
        attempt = 0
        while True:
            try:
                return request(**params)
            except ClientError as exc:
                if attempt == self.throttle_retries or not s3_errors.is_throttled(exc):
                    raise
            time.sleep(random.uniform(0.5, 1.0) * self._throttle_pause_s * 2**attempt)
            attempt += 1

    # -- helpers -----------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self.key_prefix + name

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"s3 store for bucket {self.bucket!r} is closed")

    def _run_all(self, calls: Sequence[tuple[Callable[..., Any], ...]]) -> list[Any]:
        """Run each ``(fn, *args)`` on the pool; their results in order.

        NOTE: when one call fails, the calls not started are cancelled and the running
        ones are waited for before the first failure is raised, so no request of a failed
        batch is still running (or touching the caller's buffers) after it returns.
        """
        futures: list[Future] = []
        try:
            for fn, *args in calls:
                futures.append(self._pool.submit(self._call_if_open, fn, *args))
        except RuntimeError as exc:  # close() shut the pool down meanwhile
            _cancel_and_wait(futures)
            raise StoreUnavailable(f"s3 store for bucket {self.bucket!r} is closed") from exc
        if not futures:
            return []
        _, pending = wait(futures, return_when=FIRST_EXCEPTION)
        if pending:
            _cancel_and_wait(pending)
        for future in futures:
            if not future.cancelled() and (exc := future.exception()) is not None:
                raise exc
        return [future.result() for future in futures]

    def _call_if_open(self, fn: Callable[..., Any], *args: Any) -> Any:
        # close() lets the pool drain rather than cancelling its queue: a future cancelled
        # by shutdown(cancel_futures=True) never wakes a wait() on it. Draining is fast,
        # as a call queued before close() fails here without a request.
        self._check_open()
        return fn(*args)

    def _failure(self, operation: str, key: str | None, exc: BaseException) -> StoreUnavailable:
        store = f"s3 bucket {self.bucket!r} at {self.endpoint}"
        return s3_errors.failure(store, operation, key, exc, self.throttle_retries)


def open_store(request: RemoteRequest) -> S3Store:
    """The blob store of an ``s3://`` ``remote_url`` (a ``kvtier serve`` writes through
    it), under the prefix ``kvtier/<space>/``."""
    config = request.config
    # The remote_tls_* keys verify an endpoint of one's own (AWS's certificates are public;
    # the keys may be there for a kvtier serve's rediss:// peer discovery).
    own_endpoint = config.s3_endpoint_url is not None
    return S3Store(
        request.url,
        timeout_s=max(config.remote_timeout_ms / 1000, 1.0),
        namespace=f"kvtier/{request.space}/",
        endpoint_url=config.s3_endpoint_url,
        region=config.s3_region,
        access_key_id=config.s3_access_key_id,
        secret_access_key=config.s3_secret_access_key,
        max_concurrency=config.remote_max_concurrency,
        addressing_style=config.s3_addressing_style,
        ca_file=config.remote_tls_ca_file if own_endpoint else None,
        cert_file=config.remote_tls_cert_file if own_endpoint else None,
        key_file=config.remote_tls_key_file if own_endpoint else None,
        # a throttled read's retries must end before the tier stops waiting for it
        throttle_backoff_s=min(0.5, config.remote_timeout_ms / 1000 / 2),
    )


def open_remote(request: RemoteRequest) -> RemoteTier:
    """An ``s3://`` ``remote_url`` as a tier (its ``RemoteOpener``, see ``remotes``)."""
    return open_blob_tier(open_store(request), request)


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be positive, got {value!r}")


def _cancel_and_wait(futures: Sequence[Future] | set[Future]) -> None:
    for future in futures:
        future.cancel()
    wait(futures)
