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

from kvtier.config import KVTierConfig
from kvtier.observability.stats import Stats
from kvtier.server.admin import AdminHooks, AdminServer
from kvtier.server.cache import BlobCache
from kvtier.server.lookup import lookup
from kvtier.server.server import KVTierServer
from kvtier.storage.remote import space_of

logger = logging.getLogger("kvtier.server")


async def serve(
    config: KVTierConfig,
    *,
    host: str,
    port: int,
    admin_port: int | None,
    max_frame_mb: float,
    max_clients: int,
    max_shm_mb: float | None,
) -> None:
    """Serve ``config``'s tiers on ``host:port`` (0: any free port), and the admin API on
    ``admin_port`` when given, until SIGTERM or SIGINT.
    ``max_shm_mb`` None refuses clients' shared-memory segments.

    Raises:
        OSError: a port cannot be bound.
    """
    stats = Stats()
    cache = BlobCache(config, stats)
    server = KVTierServer(
        cache,
        stats,
        host=host,
        port=port,
        token=config.server_token,
        max_frame_bytes=int(max_frame_mb * 2**20),
        max_clients=max_clients,
        max_shm_bytes=0 if max_shm_mb is None else int(max_shm_mb * 2**20),
    )
    if cache.remote is not None:
        # A remote that is down is warned about now, before the server answers anything:
        # not at the first store, and never reported healthy meanwhile.
        await asyncio.to_thread(cache.remote.watch)
    try:
        await server.start()
    except OSError:
        cache.close(0)
        raise
    admin = None
    if admin_port is not None:
        hooks = AdminHooks(
            snapshot=server.snapshot,
            tiers=lambda: _tiers(cache),
            clear=lambda model: cache.clear(None if model is None else space_of(model)),
            lookup=functools.partial(_lookup, cache, config),
            token=config.server_token,
        )
        admin = AdminServer(hooks)
        try:
            await admin.start(host, admin_port)
        except OSError:
            await server.stop()
            cache.close(0)
            raise
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
    await server.stop()
    if admin is not None:
        await admin.close()
    cache.close()
    logger.info("kvtier server stopped")


def _lookup(cache: BlobCache, config: KVTierConfig, request: dict) -> dict[str, int]:
    result = lookup(
        request,
        cache.shapes,
        cache.exists_many,
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
    return tiers
