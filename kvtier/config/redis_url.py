"""Redis / Valkey ``remote_url`` forms and their parser (the store:
``kvtier.storage.redis_store``).

URL forms (Valkey speaks the same protocol; ``valkey*`` schemes are aliases)::

    redis://[user:password@]host[:port][/db]          plain TCP, default port 6379
    rediss://[user:password@]host[:port][/db]         TLS
    unix://[user:password@]/path/to/redis.sock[?db=N] Unix domain socket
    redis-cluster://[user:password@]host:port[,host:port...]   Redis Cluster
    rediss-cluster://...                              Redis Cluster over TLS
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from kvtier.config.remote import redact_url

ACCEPTED_URL_FORMS = (
    "redis://[user:password@]host[:port][/db], rediss://... (TLS), "
    "unix://[user:password@]/path/to/redis.sock[?db=N], "
    "redis-cluster://[user:password@]host:port[,host:port...], rediss-cluster://... (TLS); "
    "valkey://, valkeys://, valkey-cluster://, valkeys-cluster:// are aliases"
)

# scheme -> (tls, cluster); "unix" is handled apart.
_TCP_SCHEMES = {
    "redis": (False, False),
    "valkey": (False, False),
    "rediss": (True, False),
    "valkeys": (True, False),
    "redis-cluster": (False, True),
    "valkey-cluster": (False, True),
    "rediss-cluster": (True, True),
    "valkeys-cluster": (True, True),
}


@dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """A parsed ``remote_url``.

    Attributes:
        scheme: the URL scheme as written (lower case).
        tls: whether to connect with TLS.
        cluster: whether the target is a Redis Cluster (``nodes`` are startup nodes).
        nodes: ``(host, port)`` pairs; empty for a Unix socket.
        unix_path: the socket path for ``unix://``, else None.
        db: the database number (always 0 for a cluster).
        username, password: credentials from the URL, or None.
    """

    scheme: str
    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    unix_path: str | None
    db: int
    username: str | None
    password: str | None

    @property
    def display(self) -> str:
        """The URL without credentials, for logs and error messages."""
        if self.unix_path is not None:
            return f"unix://{self.unix_path}" + (f"?db={self.db}" if self.db else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{self.scheme}://{hosts}" + ("" if self.cluster else f"/{self.db}")

    def __repr__(self) -> str:
        return f"RedisEndpoint({self.display!r})"


def parse_url(url: str, setting: str = "remote_url") -> RedisEndpoint:
    """Parse a Redis/Valkey ``remote_url`` (see the module docstring for the forms).

    Raises:
        ValueError: naming ``setting`` (``remote_url``, or the flag that gave the URL),
            the URL (password hidden) and the accepted forms.
    """

    def bad(problem: str) -> ValueError:
        return ValueError(
            f"{setting} {redact_url(url)!r}: {problem}; accepted forms: {ACCEPTED_URL_FORMS}"
        )

    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if not sep or (scheme != "unix" and scheme not in _TCP_SCHEMES):
        raise bad(f"unknown scheme {scheme!r}" if sep else "missing scheme")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if parts.fragment:
        raise bad("a fragment (#...) is not allowed")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, has_colon, secret = userinfo.partition(":")
    username = unquote(user) or None
    password = unquote(secret) if has_colon else None
    query = parse_qs(parts.query, keep_blank_values=True)

    if scheme == "unix":
        if hosts:
            raise bad(f"unix:// takes no host (got {hosts!r}); write unix:///path/to/sock")
        if not parts.path:
            raise bad("missing socket path")
        if set(query) - {"db"}:
            raise bad(f"unsupported query parameters {sorted(set(query) - {'db'})}")
        db = _parse_db(query.get("db", ["0"])[-1], bad)
        return RedisEndpoint(scheme, False, False, (), parts.path, db, username, password)

    tls, cluster = _TCP_SCHEMES[scheme]
    if parts.query:
        raise bad("query parameters are not supported")
    if not hosts:
        raise bad("missing host")
    nodes = tuple(_parse_host_port(item, bad) for item in hosts.split(","))
    if len(nodes) > 1 and not cluster:
        raise bad(f"several hosts need a cluster scheme ({scheme}-cluster://)")
    path = parts.path.strip("/")
    if cluster and path not in ("", "0"):
        raise bad("a cluster has only database 0")
    db = _parse_db(path or "0", bad)
    return RedisEndpoint(scheme, tls, cluster, nodes, None, db, username, password)


def _parse_host_port(text: str, bad: Callable[[str], ValueError]) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise bad(f"missing host in {text!r}")
    if not port_text:
        return host, 6379
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"bad port {port_text!r} (want 1..65535)")
    return host, int(port_text)


def _parse_db(text: str, bad: Callable[[str], ValueError]) -> int:
    if not text.isdigit():
        raise bad(f"bad database {text!r} (want a number >= 0)")
    return int(text)


def check_tls_files(ca_file: str | None, cert_file: str | None, key_file: str | None) -> None:
    """Load the TLS files (of ``rediss://``, of an https S3 endpoint) once, as a connection
    would, so that one that is missing, unreadable, not PEM, or a key that does not match
    its certificate is an error at start naming its config key, not an outage at every
    connection.

    Raises:
        ValueError: naming ``remote_tls_ca_file``, ``remote_tls_cert_file`` or
            ``remote_tls_key_file``.
    """
    if key_file is not None and cert_file is None:
        raise ValueError(
            f"remote_tls_key_file {key_file!r} is set without remote_tls_cert_file, the "
            "client certificate it belongs to"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"remote_tls_ca_file {ca_file!r}: cannot load a CA bundle from it ({exc})"
            ) from None
    if cert_file is not None:
        try:
            # an empty password: an encrypted key fails here rather than prompting
            context.load_cert_chain(cert_file, key_file, password=b"")
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"remote_tls_cert_file {cert_file!r} (remote_tls_key_file {key_file!r}): "
                f"cannot load the client certificate and its key ({exc})"
            ) from None
