"""What an S3 error answer means to the S3 store: an absent object or bucket, a write
refused for want of room or of permission, a throttled request, or else a failure (with a
hint naming the credential keys where the credentials are missing or refused); and the
``StoreUnavailable`` that reports it (``failure``).

botocore raises every error answer as a ``ClientError`` carrying S3's error code
(``NoSuchKey``, ``SlowDown``) or, for a HEAD request, whose answer has no body, the bare
HTTP status as the code (``"404"``).

NOTE: S3 answers a read of an absent object with 403 (``AccessDenied``; a HEAD: a bare
``403``), not 404, to a client whose policy does not let it list the bucket
(``s3:ListBucket``): for such a client (the store finds out by listing) that answer is
an absent object (``is_absent``).

NOTE: a throttled HEAD is a bare 503: S3 throttles with ``503 Slow Down``, and its code
goes with the body HEAD has not. A bare 503 is therefore read as throttling; a GET or PUT
answered 503 carries its code (``SlowDown``, or ``ServiceUnavailable``: a failure).
"""

from __future__ import annotations

from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

from kvtier.storage.blob_store import StoreUnavailable, Throttled, WriteDenied, WriteRefused

# Error codes that mean "no such object" (HEAD answers a bare status, GET a code).
NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
NO_BUCKET = frozenset({"NoSuchBucket", "NotFound", "404"})
ACCESS_DENIED = "AccessDenied"
FORBIDDEN = 403
# A read refused for want of permission (HEAD answers the bare status, GET a code).
_DENIED = frozenset({ACCESS_DENIED, str(FORBIDDEN)})
# Error codes (and the HTTP status) of a write the store refuses for want of room.
_NO_ROOM = frozenset(
    {
        "QuotaExceeded",
        "InsufficientStorage",
        "EntityTooLarge",
        "XMinioStorageFull",
        "XMinioAdminBucketQuotaExceeded",
    }
)
_INSUFFICIENT_STORAGE = 507
# Error codes (and the HTTP status) of a request the store throttles: back-pressure from
# a store that answers (AWS's 503 Slow Down, a request-rate limit).
_THROTTLED = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
    }
)
_TOO_MANY_REQUESTS = 429
_NOT_IMPLEMENTED = 501
_SLOW_DOWN = 503  # AWS's status for SlowDown; alone (a HEAD's answer), read as throttling
# Error codes of a request whose credentials are refused (besides any HTTP 403 Forbidden).
_BAD_CREDENTIALS = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)
_CREDENTIALS_HINT = (
    " (check s3_access_key_id and s3_secret_access_key, or boto3's credential chain when "
    "they are null)"
)
_FORBIDDEN_HINT = (
    " (check s3_access_key_id and s3_secret_access_key, and that their policy allows "
    "s3:GetObject, s3:PutObject and s3:DeleteObject on the objects, and s3:ListBucket on "
    "the bucket or its prefix)"
)
# The store's calls that write (the multipart ones, and deletes); an operation is named
# by its call, with what it is about after a space (``upload_part 3``).
_WRITES = frozenset(
    {
        "put_object",
        "create_multipart_upload",
        "upload_part",
        "complete_multipart_upload",
        "delete_object",
        "delete_objects",
    }
)


def error_code(exc: ClientError) -> str:
    """S3's error code of the answer (the bare HTTP status for a HEAD request)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int | None:
    """The HTTP status of the answer."""
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_denied(exc: ClientError) -> bool:
    """Whether the store refused the request for want of permission (403)."""
    return error_code(exc) in _DENIED


def is_absent(exc: ClientError, listing_denied: bool) -> bool:
    """Whether the answer to a read of one object (GET, HEAD) means it is absent: S3's
    "no such key" or, to a client that may not list the bucket (``listing_denied``),
    "access denied"."""
    return error_code(exc) in NOT_FOUND or (listing_denied and is_denied(exc))


def is_not_implemented(exc: ClientError) -> bool:
    """Whether the store does not implement the request (an S3-compatible store without
    an operation of S3's, e.g. multi-object delete)."""
    return error_code(exc) == "NotImplemented" or http_status(exc) == _NOT_IMPLEMENTED


def is_out_of_room(exc: ClientError) -> bool:
    """Whether the store refused a write for want of room (a quota, a full backend, an
    object over the size limit)."""
    return error_code(exc) in _NO_ROOM or http_status(exc) == _INSUFFICIENT_STORAGE


def is_throttled(exc: ClientError) -> bool:
    """Whether the store throttled the request (a bare 503, a HEAD's, counts)."""
    code, status = error_code(exc), http_status(exc)
    return (
        code in _THROTTLED
        or status == _TOO_MANY_REQUESTS
        or (status == _SLOW_DOWN and code == str(_SLOW_DOWN))
    )


def is_write_denied(exc: ClientError, operation: str) -> bool:
    """Whether the store refused ``operation``, a write, for want of permission (a policy
    that lets this client read but not write)."""
    return error_code(exc) == "AccessDenied" and operation.split(" ")[0] in _WRITES


def credentials_hint(exc: BaseException) -> str:
    """A hint naming the keys that give the credentials, for a failure of missing or
    refused credentials; else ``""``."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return _CREDENTIALS_HINT
    if not isinstance(exc, ClientError):
        return ""
    if error_code(exc) in _BAD_CREDENTIALS:
        return _CREDENTIALS_HINT
    return _FORBIDDEN_HINT if http_status(exc) == FORBIDDEN else ""


def failure(
    store: str, operation: str, key: str | None, exc: BaseException, throttle_retries: int
) -> StoreUnavailable:
    """The StoreUnavailable for ``exc``, the failure of ``operation`` (on ``key``) in
    ``store`` (its bucket and endpoint): a ``WriteRefused`` where the store refused for
    want of room, a ``WriteDenied`` for want of permission, ``Throttled`` where it still
    throttled after ``throttle_retries`` retries."""
    where = f"{store}: {operation}" + (f" of {key!r}" if key is not None else "")
    if not isinstance(exc, ClientError):
        return StoreUnavailable(
            f"{where} failed: {type(exc).__name__}: {exc}{credentials_hint(exc)}"
        )
    code, status = error_code(exc), http_status(exc)
    message = exc.response.get("Error", {}).get("Message") or ""
    error = f"{code} (HTTP {status}) {message}".rstrip()
    if is_out_of_room(exc):
        return WriteRefused(f"{where} refused: {error}", f"s3 {code or status}")
    if is_write_denied(exc, operation):
        return WriteDenied(f"{where} denied: {error}", f"s3 {code}")
    if is_throttled(exc):
        return Throttled(f"{where} throttled after {throttle_retries} retries: {error}")
    return StoreUnavailable(f"{where} failed: {error}{credentials_hint(exc)}")
