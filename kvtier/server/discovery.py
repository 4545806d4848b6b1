"""Peers found in a shared Redis/Valkey, where each server registers its own address with
a TTL and lists the others of its group (``kvtier serve --peer-discovery URL``):
Redis/Valkey, an existing engine, keeps the membership.

::

    kvtier-peers:<group>:kvtier://10.0.0.1:65432    value: the same address
    kvtier-peers:<group>:kvtier://10.0.0.2:65432    each key expires after ttl_s

One daemon thread per server does every call: each ``ttl_s / 3`` it SCANs the group's
keys (MATCH, never KEYS), SETs its own with the TTL and hands the others' addresses to
``on_members`` (``Peers.update``, which merges them with the static ``--peer``s). A
server that stops cleanly deletes its key; one that dies drops out of every list once its
key expires. With Redis unreachable the peers known stay as they are, one warning is
logged, and the next refresh tries again; a Redis restarted empty drops no one (the
others register again at their next refresh). No request ever waits on discovery (the
calls run on the thread, each bounded by the store's socket timeout).

Discovery shares addresses only: peers still talk to each other with the servers'
``--auth-token``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.config import KVTierConfig
from kvtier.config.node_address import host_port, parse_server_address
from kvtier.config.redis_url import parse_url
from kvtier.observability.stats import Stats
from kvtier.storage.blob_store import Buffer, StoreUnavailable
from kvtier.storage.schemes import load_module, redact_url

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvtier-peers:"  # outside the Redis tier's "kvtier:<model>:" keys
DEFAULT_TTL_S = 15.0
MIN_TTL_S = 1.0  # a refresh every third of it: shorter would only load the store
DEFAULT_GROUP = "default"
GROUP_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def peer_url(url: str) -> str:
    """The canonical ``kvtier://host:port`` of a server's URL: how peers are named in
    discovery keys, logs and metrics (options such as ``?shm=0`` dropped, the host in
    lower case, an IP address in its shortest form: ``[0:0::1]`` is ``[::1]``).

    Raises:
        ValueError: not a ``kvtier://host:port`` URL.
    """
    address = parse_server_address(url)
    return _canonical_url(address.host, address.port)


def _canonical_url(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):  # a name, not an address
        host = ipaddress.ip_address(host).compressed
    return f"kvtier://{host_port(host.lower(), port)}"


def advertised(host: str, port: int, advertise: str | None) -> str:
    """The address a server registers: ``advertise``, else its bind address.

    Raises:
        ValueError: naming ``--advertise``, when the server binds every address
            (``0.0.0.0``, ``::``), which names no one host, or ``advertise`` is not a
            ``kvtier://host:port``.
    """
    if advertise is not None:
        try:
            return peer_url(advertise)
        except ValueError:
            raise ValueError(f"--advertise {advertise!r}: expected kvtier://host:port") from None
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(
            f"--host {host!r} binds every address: give --advertise kvtier://HOST:PORT, "
            "the address the other servers reach this one at (peer discovery registers it)"
        )
    # Not through peer_url: before the server binds, port 0 stands for the port it gets.
    return _canonical_url(host, port)


def check_group(group: str) -> str:
    """``group``, checked.

    Raises:
        ValueError: naming ``--peer-group`` and the characters allowed.
    """
    if not GROUP_PATTERN.fullmatch(group):
        raise ValueError(
            f"--peer-group {group!r}: 1 to 64 letters, digits, '_', '.' or '-' (it sits "
            "in a Redis key)"
        )
    return group


class Registry(Protocol):
    """Where the group's keys live: a ``RedisStore`` under ``KEY_PREFIX + group + ':'``,
    whose names are the servers' addresses and whose TTL is the registrations'."""

    url: str

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None: ...

    def names(self) -> list[str]: ...

    def delete_many(self, names: Sequence[str]) -> int: ...

    def close(self) -> None: ...


def open_registry(url: str, config: KVTierConfig, group: str, ttl_s: float) -> Registry:
    """The store of ``group``'s registrations on the Redis/Valkey of ``url``, reached as
    the Redis tier is (credentials in the URL or ``remote_username`` /
    ``remote_password``, ``remote_tls_*`` for TLS, ``remote_timeout_ms`` per call). It
    does not connect yet.

    Raises:
        ValueError: a bad URL (naming ``--peer-discovery``) or redis-py missing.
    """
    endpoint = parse_url(url, "--peer-discovery")
    tls: dict[str, Any] = {}
    if endpoint.tls:
        tls = {
            "tls_ca_file": config.remote_tls_ca_file,
            "tls_cert_file": config.remote_tls_cert_file,
            "tls_key_file": config.remote_tls_key_file,
        }
    try:
        module = load_module(url)
    except ValueError as exc:
        raise ValueError(f"--peer-discovery: {exc}") from None
    return module.RedisStore(
        url,
        namespace=f"{KEY_PREFIX}{group}:",
        timeout_s=config.remote_timeout_ms / 1000,
        username=config.remote_username,
        password=config.remote_password,
        ttl_s=ttl_s,
        max_connections=2,
        **tls,
    )


class Discovery:
    """This server's registration in its group, and the others' addresses (see the
    module docstring). Thread-safe.

    Args:
        registry: the group's keys (``open_registry``).
        advertise: this server's canonical ``kvtier://host:port``, as the others reach it.
        group: the group's name (``--peer-group``).
        ttl_s: how long a registration lives unrefreshed; refreshed every ``ttl_s / 3``.
        on_members: given the others' addresses after each refresh that reached the store.
        stats: the server's counters (``discovery_refreshes``, ``discovery_errors``).
    """

    def __init__(
        self,
        registry: Registry,
        *,
        advertise: str,
        group: str,
        ttl_s: float,
        on_members: Callable[[frozenset[str]], object],
        stats: Stats,
    ):
        if not ttl_s >= MIN_TTL_S:
            raise ValueError(f"--peer-discovery-ttl must be >= {MIN_TTL_S:g} s, got {ttl_s:g}")
        self.registry = registry
        self.advertise = advertise
        self.group = group
        self.ttl_s = ttl_s
        self.stats = stats
        self._on_members = on_members
        self._lock = threading.Lock()
        self._members: frozenset[str] = frozenset()
        self._registered = False
        self._error: str | None = None
        self._last_refresh: float | None = None  # time.monotonic() of the last success
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Register now, then every ``ttl_s / 3`` on a daemon thread."""
        self._thread = threading.Thread(target=self._run, name="kvtier-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug must not end the refreshes (the key would expire)
                logger.exception("kvtier server: peer discovery: a refresh failed")
            self._stop.wait(self.ttl_s / 3)

    def refresh(self) -> bool:
        """Register this server again and hand the others' addresses on; False (and the
        members as they were) when the store cannot be reached.

        A store without this server's key (restarted empty, flushed, or out of reach
        until the key expired) lost the others' too, who register again at their next
        refresh: no one known is dropped before that (one refresh later)."""
        try:
            names = self.registry.names()
            self.registry.put_many([(self.advertise, [self.advertise.encode()])])
        except StoreUnavailable as exc:
            self.stats.inc("discovery_errors")
            with self._lock:
                first, self._error, self._registered = self._error is None, str(exc), False
            if first:
                logger.warning(
                    "kvtier server: peer discovery: %s (keeping the %d peers found so far; "
                    "trying again every %.1f s)",
                    exc,
                    len(self._members),
                    self.ttl_s / 3,
                )
            return False
        members = frozenset(n for n in names if n != self.advertise)
        with self._lock:
            if self.advertise not in names:  # the others are kept until they register again
                members |= self._members
            back, self._error, self._registered = self._error is not None, None, True
            self._members, self._last_refresh = members, time.monotonic()
        if back:
            logger.warning("kvtier server: peer discovery through %s works again", self.where)
        self.stats.inc("discovery_refreshes")
        self._on_members(members)
        return True

    @property
    def where(self) -> str:
        return redact_url(self.registry.url)

    def status(self) -> dict[str, Any]:
        """The registration's state, for /health: where, as what, the others found, and
        why the last refresh failed (``error``: None when it worked)."""
        with self._lock:
            age = None if self._last_refresh is None else time.monotonic() - self._last_refresh
            return {
                "url": self.where,
                "group": self.group,
                "advertise": self.advertise,
                "ttl_s": self.ttl_s,
                "registered": self._registered,
                "members": sorted(self._members),
                "last_refresh_s_ago": None if age is None else round(age, 3),
                "error": self._error,
            }

    def gauges(self) -> dict[str, float]:
        with self._lock:
            return {"discovery_registered": int(self._registered)}

    def describe(self) -> str:
        return f"peer discovery {self.where} group {self.group} as {self.advertise}"

    def close(self) -> None:
        """Stop refreshing and delete this server's key (idempotent; a store that does not
        answer leaves the key to expire)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.ttl_s)
        try:
            self.registry.delete_many([self.advertise])
        except StoreUnavailable as exc:
            logger.info("kvtier server: peer discovery: not deregistered (%s)", exc)
        self.registry.close()
