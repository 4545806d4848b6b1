"""The node-level cache server, assembled: the blob cache, the TCP server and the admin
API (both on one event loop), run until SIGTERM or SIGINT (``kvtier serve``).

On the signal the server stops accepting, finishes the requests it is executing, drops
frames still arriving (nothing half-received is stored), and finishes or drops queued
remote writes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from dataclasses import dataclass

from kvtier.config import KVTierConfig
from kvtier.observability.stats import Stats
from kvtier.server.admin import AdminHooks, AdminServer
from kvtier.server.cache import BlobCache
from kvtier.server.discovery import (
    DEFAULT_GROUP,
    DEFAULT_TTL_S,
    Discovery,
    advertised,
    open_registry,
)
from kvtier.server.leases import Leases
from kvtier.server.lookup import lookup
from kvtier.server.nixl import NixlPlane, NixlUnavailable
from kvtier.server.peers import Peers
from kvtier.server.server import KVTierServer
from kvtier.storage.remote import space_of

logger = logging.getLogger("kvtier.server")


@dataclass(frozen=True, slots=True)
class PeerOptions:
    """How a server works with its peers (``kvtier serve --peer ...``).

    Attributes:
        urls: ``kvtier://host:port`` of each peer (the ``server_peers`` key and
            ``--peer``).
        transport: ``auto`` (NIXL where it can be set up, else TCP, warned once),
            ``nixl`` (NIXL or refuse to start) or ``tcp``.
        keep: keep pulled chunks in the memory tier (``--peer-cache on``).
        lookup: /lookup counts what peers hold (``--lookup-peers``; per request:
            ``/lookup?peers=1``).
        discovery: the Redis/Valkey URL where servers find each other
            (``--peer-discovery``, the ``server_peer_discovery`` key), or None.
        advertise: ``kvtier://host:port`` the others reach this server at
            (``--advertise``); None: the bind address.
        group: the servers that find each other (``--peer-group``).
        discovery_ttl_s: how long a registration outlives its server
            (``--peer-discovery-ttl``).
    """

    urls: tuple[str, ...] = ()
    transport: str = "auto"
    keep: bool = True
    lookup: bool = False
    discovery: str | None = None
    advertise: str | None = None
    group: str = DEFAULT_GROUP
    discovery_ttl_s: float = DEFAULT_TTL_S


def open_plane(cache: BlobCache, leases: Leases, options: PeerOptions) -> NixlPlane | None:
    """The NIXL plane over the memory pool, or None (``tcp``, or NIXL unavailable under
    ``auto``: one warning).

    Raises:
        NixlUnavailable: ``transport`` is ``nixl`` and NIXL cannot be set up.
    """
    if options.transport == "tcp":
        return None
    try:
        return NixlPlane(cache.memory.pool.buffer, busy=leases.busy, on_idle=leases.expire)
    except NixlUnavailable as exc:
        if options.transport == "nixl":
            raise
        logger.warning("kvtier server: NIXL unavailable (%s): peers pull over TCP", exc)
        return None


async def serve(
    config: KVTierConfig,
    *,
    host: str,
    port: int,
    admin_port: int | None,
    max_frame_mb: float,
    max_clients: int,
    max_names: int,
    idle_timeout_s: float,
    max_shm_mb: float | None,
    peers: PeerOptions = PeerOptions(),
) -> None:
    """Serve ``config``'s tiers on ``host:port`` (0: any free port), and the admin API on
    ``admin_port`` when given, until SIGTERM or SIGINT.
    ``max_shm_mb`` None refuses clients' shared-memory segments; ``idle_timeout_s`` 0
    keeps idle connections for ever.

    Raises:
        OSError: a port cannot be bound.
        NixlUnavailable: ``--peer-transport nixl`` and NIXL cannot be set up.
        ValueError: discovery without redis-py, or a bind address that names no host
            without ``advertise``.
    """
    registry = None
    if peers.discovery is not None:
        advertised(host, port, peers.advertise)  # before anything starts
        registry = open_registry(peers.discovery, config, peers.group, peers.discovery_ttl_s)
    stats = Stats()
    cache = BlobCache(config, stats, shared_memory=max_shm_mb is not None)
    timeout_s = config.remote_timeout_ms / 1000
    leases = Leases(ttl_s=max(2 * timeout_s, 1.0))
    plane, deferred = None, None
    if peers.urls or registry or peers.transport == "nixl":  # pulls need it, or NIXL or nothing
        try:
            plane = open_plane(cache, leases, peers)
        except NixlUnavailable:
            cache.close(0)
            raise
    elif peers.transport == "auto":  # serving pulls only: set up at the first handshake
        deferred = functools.partial(open_plane, cache, leases, peers)
    if peers.urls or registry:
        cache.peers = Peers(
            peers.urls,
            memory=cache.memory,
            stats=stats,
            token=config.server_token,
            timeout_s=timeout_s,
            reconnect_max_s=config.remote_reconnect_max_ms / 1000,
            plane=plane,
            keep=peers.keep,
            self_url=_own_url(host, port, peers.advertise),
        )
    server = KVTierServer(
        cache,
        stats,
        host=host,
        port=port,
        token=config.server_token,
        max_frame_bytes=int(max_frame_mb * 2**20),
        max_clients=max_clients,
        max_names=max_names,
        idle_timeout_s=idle_timeout_s,
        max_shm_bytes=0 if max_shm_mb is None else int(max_shm_mb * 2**20),
        plane=plane,
        leases=leases,
        open_plane=deferred,
    )
    if cache.remote is not None:
        # A remote that is down is warned about now, before the server answers anything:
        # not at the first store, and never reported healthy meanwhile.
        await asyncio.to_thread(cache.remote.watch)
    try:
        await server.start()
    except OSError:
        _close(cache, server.plane, leases, 0)
        if registry is not None:
            registry.close()
        raise
    if registry is not None:
        assert cache.peers is not None
        discovery = Discovery(
            registry,
            advertise=advertised(host, server.port, peers.advertise),
            group=peers.group,
            ttl_s=peers.discovery_ttl_s,
            on_members=cache.peers.update,
            stats=stats,
        )
        cache.peers.discovery = discovery  # closed (deregistered) with the peers
        discovery.start()
    admin = None
    if admin_port is not None:
        hooks = AdminHooks(
            snapshot=server.snapshot,
            tiers=lambda: _tiers(cache),
            clear=lambda model: cache.clear(None if model is None else space_of(model)),
            lookup=functools.partial(_lookup, cache, config, peers.lookup),
            token=config.server_token,
        )
        admin = AdminServer(hooks)
        try:
            await admin.start(host, admin_port)
        except OSError as error:
            await server.stop()
            _close(cache, server.plane, leases, 0)
            raise OSError(error.errno, f"--admin-port: {error.strerror or error}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    where = f"kvtier://{host}:{server.port}"
    admin_at = f", admin http://{host}:{admin.port}" if admin else ""
    auth = "token required" if config.server_token else "no token"
    auth += (
        ", shared memory off" if max_shm_mb is None else f", shared memory up to {max_shm_mb:g} MiB"
    )
    logger.info("kvtier server listening on %s%s (%s)", where, admin_at, auth)
    logger.info("kvtier server tiers: %s", "; ".join(cache.describe()))
    await stop.wait()
    logger.info("kvtier server stopping")
    if cache.peers is not None and cache.peers.discovery is not None:
        await asyncio.to_thread(cache.peers.discovery.close)  # the others drop it at once
    await server.stop()
    if admin is not None:
        await admin.close()
    _close(cache, server.plane, leases)
    logger.info("kvtier server stopped")


def _close(
    cache: BlobCache, plane: NixlPlane | None, leases: Leases, timeout: float = 10.0
) -> None:
    if cache.peers is not None:  # first: no pull may be reading into the pool
        cache.peers.close()
    leases.close()
    if plane is not None:
        plane.close()
    cache.close(timeout)


def _own_url(host: str, port: int, advertise: str | None) -> str | None:
    """This server's own address as its peers name it (a list of peers shared by every
    node names it too: never its own peer), or None where it is not known before the
    server starts (port 0, or a bind to every address with no ``advertise``)."""
    if not port:
        return None
    try:
        return advertised(host, port, advertise)
    except ValueError:
        return None


def _lookup(cache: BlobCache, config: KVTierConfig, peers: bool, request: dict) -> dict[str, int]:
    peers = bool(request.pop("peers", peers))
    result = lookup(
        request,
        cache.shapes,
        functools.partial(cache.exists_many, peers=peers),
        chunk_size=config.chunk_size,
        hash_algorithm=config.hash_algorithm,
        hash_seed=config.hash_seed,
    )
    return result.as_json()


def _tiers(cache: BlobCache) -> dict[str, dict]:
    tiers: dict[str, dict] = {
        "memory": {"up": True, "blobs": len(cache.memory), "bytes": cache.memory.used_bytes}
    }
    if cache.disk is not None:
        tiers["disk"] = {"up": True, "blobs": len(cache.disk), "bytes": cache.disk.used_bytes}
    if cache.remote is not None:
        tiers["remote"] = {"up": cache.remote.is_up, "url": cache.remote.describe}
    if cache.peers is not None:
        # each peer's state; a peer down never makes this node degraded (a miss there is
        # a miss here, as without peers)
        tiers["peers"] = cache.peers.status()
        if cache.peers.discovery is not None:
            # where this node registers and why the last refresh failed, if it did
            tiers["discovery"] = cache.peers.discovery.status()
    return tiers
