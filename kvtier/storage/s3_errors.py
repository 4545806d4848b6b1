"""What an S3 error answer means to the S3 store: an absent object or bucket, a write
refused for want of room, a throttled request, or else a failure.

botocore raises every error answer as a ``ClientError`` carrying S3's error code
(``NoSuchKey``, ``SlowDown``) or, for a HEAD request, whose answer has no body, the bare
HTTP status as the code (``"404"``).

NOTE: a throttled HEAD is a bare 503: S3 throttles with ``503 Slow Down``, and its code
goes with the body HEAD has not. A bare 503 is therefore read as throttling; a GET or PUT
answered 503 carries its code (``SlowDown``, or ``ServiceUnavailable``: a failure).
"""

from __future__ import annotations

from botocore.exceptions import ClientError

# Error codes that mean "no such object" (HEAD answers a bare status, GET a code).
NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
NO_BUCKET = frozenset({"NoSuchBucket", "NotFound", "404"})
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
_SLOW_DOWN = 503  # AWS's status for SlowDown; alone (a HEAD's answer), read as throttling


def error_code(exc: ClientError) -> str:
    """S3's error code of the answer (the bare HTTP status for a HEAD request)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int | None:
    """The HTTP status of the answer."""
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


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
