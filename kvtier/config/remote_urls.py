"""The form of every ``remote_url`` scheme, checked when the config is built: a URL no
retry could mend (``redis://h:bad``, ``s3://`` with no bucket, ``fs://relative``,
``kvtier://h`` with no port) is refused at start-up, naming ``remote_url``, by every entry
point that loads a config (an engine, ``kvtier serve``, SGLang), rather than opened as a
remote that stays down.

The Redis/Valkey forms are parsed by ``redis_url``, the ``kvtier serve`` ones by
``node_address``; the S3 and shared-filesystem forms here. The stores parse their URL with
the same functions.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from kvtier.config.node_address import SCHEMES as SERVER_SCHEMES
from kvtier.config.node_address import parse_server_address
from kvtier.config.redis_url import parse_url
from kvtier.config.remote import REMOTE_SCHEMES, is_remote_url, redact_url, url_scheme

S3_URL_FORM = "s3://bucket[/prefix]"
# S3's naming rules: 3-63 of lowercase letters, digits, dots and hyphens, starting and ending
# with a letter or digit (no "..", not an IP address; checked separately).
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+")
# LMCache's S3 form names the bucket's virtual-host endpoint, s3://BUCKET.ENDPOINT
# (s3://b.s3.us-east-1.amazonaws.com, s3://b.t3.storage.dev); kvtier's names the bucket
# alone, with the region in s3_region and another store's endpoint in s3_endpoint_url. A
# bucket name may hold dots, so only the hosts of known S3 services are told apart.
_AWS_ENDPOINT_HOST = re.compile(r"(?P<bucket>[^.]+?)\.s3(?:express)?[.-].*amazonaws\.com")
_S3_SERVICE_HOST = re.compile(
    r"(?P<bucket>[^.]+)\.(?P<endpoint>(?:[^.]+\.)*(?:t3\.storage\.dev|storage\.googleapis\.com"
    r"|r2\.cloudflarestorage\.com|digitaloceanspaces\.com|wasabisys\.com|backblazeb2\.com"
    r"|aliyuncs\.com|myqcloud\.com))"
)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket[/prefix]``; the prefix is ``""`` or ends in ``/``.

    Raises:
        ValueError: naming ``remote_url`` and the accepted form; also for LMCache's form,
            whose host is the bucket's endpoint at AWS or another known S3 service
            (``s3://b.s3.us-east-1.amazonaws.com``), so that it is not read as a bucket of
            that name.
    """
    parts = urlsplit(url)
    bucket = parts.netloc
    if host := _AWS_ENDPOINT_HOST.fullmatch(bucket):
        instead = "give the region as s3_region"
    elif host := _S3_SERVICE_HOST.fullmatch(bucket):
        instead = f"give the endpoint as s3_endpoint_url: https://{host['endpoint']}"
    if host:
        raise ValueError(
            f"remote_url {url!r} names an S3 endpoint host (LMCache's s3://BUCKET.ENDPOINT), "
            f"not a bucket; write it as s3://{host['bucket']}[/prefix] and {instead}"
        )
    if (
        parts.scheme != "s3"
        or parts.query
        or parts.fragment
        or not _BUCKET_NAME.fullmatch(bucket)
        or ".." in bucket
        or _IP_ADDRESS.fullmatch(bucket)
    ):
        raise ValueError(
            f"remote_url must be {S3_URL_FORM} with a valid S3 bucket name "
            f"(3-63 of a-z, 0-9, '.', '-'), got {url!r}"
        )
    prefix = "/".join(segment for segment in parts.path.split("/") if segment)
    return bucket, prefix + "/" if prefix else ""


def parse_fs_url(url: str) -> str:
    """The directory of ``fs:///path``.

    Raises:
        ValueError: naming ``remote_url``: no absolute path, or a host before it.
    """
    parts = urlsplit(url)
    if parts.netloc or not parts.path:
        raise ValueError(
            f"remote_url {redact_url(url)!r}: give an absolute path after fs://, e.g. fs:///mnt/shared/kvtier"
        )
    return parts.path


# LMCache's remote backends kvtier does not have: scheme -> the backend, named in the error.
LMCACHE_REMOTE_BACKENDS: dict[str, str] = {
    "redis-sentinel": "Redis Sentinel",
    "mooncakestore": "Mooncake Store",
    "infinistore": "InfiniStore",
    "blackhole": "blackhole (a remote that stores nothing)",
    "audit": "audit",
    "mock": "mock",
    "external": "external connector",
}


def is_remote_or_lmcache_url(url: str) -> bool:
    """Whether ``url`` has a scheme of kvtier's or of an LMCache backend (whose error
    :func:`check_remote_url` gives)."""
    return is_remote_url(url) or url_scheme(url) in LMCACHE_REMOTE_BACKENDS


def check_remote_url(url: str) -> None:
    """Return if ``url`` has the form of its scheme (whether its store answers is seen
    when it is opened); a scheme kvtier does not know is the key's ``check``.

    Raises:
        ValueError: naming ``remote_url``, what is wrong and the accepted form.
    """
    scheme = url_scheme(url)
    if scheme in LMCACHE_REMOTE_BACKENDS:
        raise ValueError(
            f"remote_url {redact_url(url)!r} is LMCache's {LMCACHE_REMOTE_BACKENDS[scheme]} "
            f"backend, which kvtier does not have; its remote schemes are "
            f"{', '.join(REMOTE_SCHEMES)} (lm:// is kvtier serve)"
        )
    if scheme == "s3":
        parse_s3_url(url)
    elif scheme == "fs":
        parse_fs_url(url)
    elif scheme in SERVER_SCHEMES:
        parse_server_address(url)
    elif scheme is not None:
        parse_url(url)
