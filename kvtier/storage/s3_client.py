"""The boto3 client an S3 store talks through: one attempt per request, a connection per
worker thread, the endpoint's addressing style and TLS files, and no checksum pass of
botocore's own.

The store (``s3_store``) retries and judges failures itself and checksums every payload
in the wire format, so the client is configured to make one attempt, send bodies as they
are (memoryviews, unvalidated) and compute checksums only where S3 requires one.

NOTE: S3 requires a checksum of a DeleteObjects request. botocore >= 1.36 sends a CRC32
where it used to send Content-MD5, and S3-compatible stores (older MinIO releases, OVH,
CubeFS, Dell PowerScale among them) refuse a DeleteObjects without Content-MD5
(``MissingContentMD5``); the client sends Content-MD5, which every store accepts.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import boto3
from botocore.config import Config

__all__ = ["ADDRESSING_STYLES", "make_client"]

ADDRESSING_STYLES = ("auto", "path", "virtual")
# Connections kept beside the workers' for requests made on callers' threads.
_CALLER_CONNECTIONS = 8


def make_client(
    *,
    endpoint_url: str | None,
    region: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    session_token: str | None,
    timeout_s: float,
    workers: int,
    addressing_style: str | None,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> Any:
    """A boto3 S3 client (see ``S3Store`` for the arguments) for a store whose requests
    run on ``workers`` threads of its own, and a few on its callers' threads.

    Raises:
        ValueError: ``addressing_style`` is not one of ``ADDRESSING_STYLES``.
        BotoCoreError: boto3 cannot configure the client (e.g. a profile named in the
            environment is missing).
    """
    if addressing_style is not None and addressing_style not in ADDRESSING_STYLES:
        raise ValueError(
            f"addressing_style must be one of {ADDRESSING_STYLES} or None, got {addressing_style!r}"
        )
    options: dict[str, Any] = dict(
        connect_timeout=timeout_s,
        read_timeout=timeout_s,
        # One attempt: a failed request is RemoteTier's to judge (an outage costs one
        # timeout, not several); the store retries a throttled one itself.
        retries={"total_max_attempts": 1, "mode": "standard"},
        # A connection kept for each worker, and for the requests made on callers' threads
        # meanwhile (a ping, clear's listing, a multipart upload's create and complete):
        # urllib3 closes one that finds the pool full, warning each time.
        max_pool_connections=workers + _CALLER_CONNECTIONS,
        # botocore's validator rejects memoryview bodies, which the rest of it sends as
        # they are; validating would cost a copy of every payload. The store builds
        # every other parameter itself.
        parameter_validation=False,
        s3={"addressing_style": addressing_style} if addressing_style else None,
        client_cert=cert_file if key_file is None else (cert_file, key_file),
    )
    flexible_checksums = "request_checksum_calculation" in Config.OPTION_DEFAULTS
    if flexible_checksums:
        # botocore >= 1.36 CRCs every body by default: a second pass over each blob
        # that the wire format's checksum makes redundant, and trailing aws-chunked
        # checksums that several S3-compatible servers reject.
        options.update(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
    session = boto3.session.Session(
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        aws_session_token=session_token,
        region_name=region,
    )
    client = session.client(
        "s3", endpoint_url=endpoint_url, config=Config(**options), verify=ca_file
    )
    if flexible_checksums:
        # after botocore's own before-call handlers, which may still rewrite the body
        client.meta.events.register("before-call.s3.DeleteObjects", _content_md5)
    return client


def _content_md5(params: dict[str, Any], **_: Any) -> None:
    """Give a DeleteObjects request (botocore's request dict) a Content-MD5 header in
    place of the CRC32 botocore would add; S3 Express directory buckets, which take no
    MD5, keep the CRC32."""
    context = params["context"]
    if context.get("endpoint_properties", {}).get("backend") == "S3Express":
        return
    digest = hashlib.md5(params["body"], usedforsecurity=False).digest()
    params["headers"]["Content-MD5"] = base64.b64encode(digest).decode("ascii")
    context.pop("checksum", None)  # what botocore would add: the CRC32 and its algorithm
