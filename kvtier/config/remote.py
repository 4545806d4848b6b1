"""The remote tier as users name it: the ``remote_url`` schemes kvtier accepts, how a URL
is shown without its password, and the keys of how a remote is reached (timeouts,
reconnects, credentials, TLS, the ``kvtier serve`` token, S3).

``REMOTE_SCHEMES`` is the contract; ``kvtier.storage.schemes`` maps each scheme to the
module that opens it, and a test holds the two to the same schemes.
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from kvtier.config.keys import KeySpec, empty_as

# Every scheme a remote_url may have, lower case, in the order messages list them.
# Valkey speaks the Redis protocol: its schemes are aliases of Redis's. lm:// is LMCache's
# spelling of kvtier://.
REMOTE_SCHEMES: tuple[str, ...] = (
    *("redis", "rediss", "redis-cluster", "rediss-cluster"),
    *("valkey", "valkeys", "valkey-cluster", "valkeys-cluster"),
    "unix",
    "s3",
    "fs",
    *("kvtier", "lm"),
)


def url_scheme(url: str) -> str | None:
    """The scheme of ``url``, lower case, or None when it has no ``scheme://``."""
    name, sep, _ = url.partition("://")
    return name.lower() if sep else None


def is_remote_url(url: str) -> bool:
    """Whether ``url`` has one of ``REMOTE_SCHEMES`` (its rest is checked when it is
    opened)."""
    return url_scheme(url) in REMOTE_SCHEMES


def check_s3_endpoint_url(url: str) -> None:
    """Return if ``url`` is ``http(s)://host[:port][/path]``, as boto3 takes an endpoint.

    Raises:
        ValueError: naming ``s3_endpoint_url`` and the accepted form.
    """
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number, or out of range
        port_ok = False
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port_ok
        or "@" in parts.netloc
        or parts.query
        or parts.fragment
        or url != url.strip()
    ):
        raise ValueError(
            f"s3_endpoint_url must be http://host[:port][/path] or https://..., without "
            f"credentials (those go in s3_access_key_id and s3_secret_access_key), got {redact_url(url)!r}"
        )


def redact_url(url: str) -> str:
    """``url`` with the password in its user-info replaced by ``***`` (logs, tables)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = rest.find("/")
    authority, tail = (rest, "") if end < 0 else (rest[:end], rest[end:])
    userinfo, at, hosts = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{tail}"


# How a remote is reached: waits, reconnects, parallelism, credentials, TLS, S3.
REMOTE_ACCESS: tuple[KeySpec, ...] = (
    KeySpec(
        "remote_timeout_ms",
        int,
        1000,
        "Remote tier: the longest a lookup or a chunk get waits; slower is a miss and "
        "marks the remote down until it answers again.",
        check=lambda v: 1 <= v <= 600_000,
        allowed="an integer from 1 to 600000 (milliseconds)",
    ),
    KeySpec(
        "remote_reconnect_max_ms",
        int,
        5000,
        "Remote tier: the longest pause between reconnect attempts while it is down "
        "(attempts start 100 ms apart and back off by doubling).",
        check=lambda v: 100 <= v <= 3_600_000,
        allowed="an integer from 100 to 3600000 (milliseconds)",
    ),
    KeySpec(
        "remote_max_concurrency",
        int,
        16,
        "Remote tier: parallel requests (Redis connection pool size, S3 request threads).",
        check=lambda v: 1 <= v <= 1024,
        allowed="an integer from 1 to 1024",
    ),
    KeySpec(
        "remote_username",
        str,
        None,
        "Redis/Valkey ACL user name (overrides one in remote_url).",
        nullable=True,
    ),
    KeySpec(
        "remote_password",
        str,
        None,
        "Redis/Valkey password (overrides one in remote_url); never printed.",
        nullable=True,
        secret=True,
    ),
    KeySpec(
        "remote_ttl_secs",
        float,
        None,
        "Redis/Valkey: expire stored chunks after this many seconds; null keeps them "
        "until the server evicts them.",
        check=lambda v: math.isfinite(v) and v > 0,
        allowed="a finite number > 0",
        nullable=True,
    ),
    KeySpec(
        "remote_tls_ca_file",
        str,
        None,
        "rediss:// and an https s3_endpoint_url: CA bundle that verifies the server "
        "(null: the system's; for S3, boto3's, which AWS_CA_BUNDLE may name).",
        nullable=True,
    ),
    KeySpec(
        "remote_tls_cert_file",
        str,
        None,
        "rediss:// and an https s3_endpoint_url: client certificate (mutual TLS).",
        nullable=True,
    ),
    KeySpec(
        "remote_tls_key_file",
        str,
        None,
        "rediss:// and an https s3_endpoint_url: client private key (mutual TLS).",
        nullable=True,
    ),
    KeySpec(
        "server_token",
        str,
        None,
        "kvtier serve (--auth-token) and kvtier:// clients: the shared token; never shown.",
        normalize=empty_as(None),
        nullable=True,
        secret=True,
    ),
    KeySpec(
        "server_peers",
        str,
        None,
        "kvtier serve (--peer): the other servers it pulls missed chunks from, as "
        "comma-separated kvtier://host:port URLs.",
        normalize=empty_as(None),
        nullable=True,
    ),
    KeySpec(
        "server_peer_discovery",
        str,
        None,
        "kvtier serve (--peer-discovery): a Redis/Valkey URL where the servers register "
        "themselves and find each other as peers, or 'remote' for the server's own "
        "Redis/Valkey remote_url; null: no discovery.",
        normalize=empty_as(None),
        nullable=True,
        redact=redact_url,
    ),
    KeySpec(
        "s3_endpoint_url",
        str,
        None,
        "s3://: endpoint of an S3-compatible store (MinIO, Ceph RGW, R2, ...) as "
        "http(s)://host[:port][/path]; null is AWS.",
        normalize=empty_as(None),
        parse=check_s3_endpoint_url,
        nullable=True,
    ),
    KeySpec(
        "s3_addressing_style",
        str,
        None,
        "s3://: how requests name the bucket: path (endpoint/bucket/key: MinIO, Ceph RGW "
        "without a DNS name), virtual (bucket.endpoint/key: Alibaba OSS, stores that "
        "refuse path style) or auto; null: botocore's choice (path with s3_endpoint_url, "
        "virtual on AWS).",
        choices=("auto", "path", "virtual"),
        normalize=empty_as(None),
        nullable=True,
    ),
    KeySpec(
        "s3_region",
        str,
        None,
        "s3://: region name.",
        nullable=True,
    ),
    KeySpec(
        "s3_access_key_id",
        str,
        None,
        "s3://: access key; null uses boto3's credential chain.",
        nullable=True,
    ),
    KeySpec(
        "s3_secret_access_key",
        str,
        None,
        "s3://: secret key; never printed.",
        nullable=True,
        secret=True,
    ),
)
