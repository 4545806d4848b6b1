"""``kvtier serve``: the command-line entry of the node-level cache server.

    kvtier serve --port 65432 --max-local-cpu-size 40 --local-disk /var/cache/kvtier \\
                 --max-local-disk-size 500 --remote-url redis://cache:6379/0 --admin-port 8900

The tier flags mirror config keys (``--max-local-cpu-size`` is ``max_local_cpu_size``,
...), and ``--config FILE`` reads the same YAML an engine reads; a flag beats the file,
and ``KVTIER_*`` variables apply as everywhere. The token is the ``server_token`` key
(``--auth-token``, ``KVTIER_SERVER_TOKEN``).

On SIGTERM or SIGINT the server stops accepting, finishes the requests it is executing,
drops frames still arriving (nothing half-received is stored), finishes or drops queued
remote writes, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import logging
import signal
import sys

from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.metrics import Stats
from kvtier.server.admin import AdminHooks, AdminServer
from kvtier.server.cache import BlobCache
from kvtier.server.lookup import lookup
from kvtier.server.server import KVTierServer
from kvtier.storage.node_protocol import DEFAULT_MAX_FRAME_BYTES
from kvtier.storage.remote import space_of

logger = logging.getLogger("kvtier.server")

DEFAULT_PORT = 65432  # LMCache's server port: lm://host:65432 configs point here as they are

# flag dest -> config key
_CONFIG_FLAGS = {
    "max_local_cpu_size": "max_local_cpu_size",
    "local_disk": "local_disk",
    "max_local_disk_size": "max_local_disk_size",
    "remote_url": "remote_url",
    "chunk_size": "chunk_size",
    "auth_token": "server_token",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (the keys an engine reads)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")
    parser.add_argument(
        "--admin-port", type=int, help="serve /health, /stats, /metrics, /clear here (0: any)"
    )
    parser.add_argument(
        "--chunk-size", type=int, help="the engines' chunk_size, for /lookup by tokens"
    )
    parser.add_argument("--max-local-cpu-size", type=float, help="memory tier in GB")
    parser.add_argument("--local-disk", help="disk tier directory (kept across restarts)")
    parser.add_argument("--max-local-disk-size", type=float, help="disk tier in GB")
    parser.add_argument("--remote-url", help="write-through remote (redis://, s3://, ...)")
    parser.add_argument(
        "--auth-token",
        help="token clients must send (or KVTIER_SERVER_TOKEN); required off loopback",
    )
    parser.add_argument(
        "--max-frame-mb",
        type=float,
        default=DEFAULT_MAX_FRAME_BYTES / 2**20,
        help="largest payload of one frame in MiB",
    )
    parser.add_argument("--max-clients", type=int, default=256, help="connections held at once")
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="refuse clients' shared-memory segments: every client moves bytes over TCP",
    )
    parser.add_argument(
        "--max-shm-mb",
        type=float,
        default=DEFAULT_MAX_FRAME_BYTES / 2**20,
        help="largest shared-memory segment a same-host client may offer, in MiB",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_config(args: argparse.Namespace) -> KVTierConfig:
    """The config of ``args``: flags over ``--config`` over ``KVTIER_*`` over defaults.

    Raises:
        ConfigError: a bad value, or a non-loopback address without a token.
    """
    flags = {key: getattr(args, dest) for dest, key in _CONFIG_FLAGS.items()}
    overrides = {key: value for key, value in flags.items() if value is not None}
    config = load_config(overrides=overrides, config_file=args.config)
    if not is_loopback(args.host) and config.server_token is None:
        raise ConfigError(
            f"--host {args.host} is not a loopback address: give --auth-token (or "
            "KVTIER_SERVER_TOKEN), the token every client must send"
        )
    if not 0 <= args.port <= 65535 or args.max_frame_mb <= 0 or args.max_clients < 1:
        raise ConfigError("--port must be 0..65535, --max-frame-mb > 0, --max-clients >= 1")
    if args.max_shm_mb <= 0:
        raise ConfigError("--max-shm-mb must be > 0 (--no-shm turns shared memory off)")
    return config


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean stop, 2 on a bad setting."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = server_config(args)
        return asyncio.run(_serve(config, args))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2


async def _serve(config: KVTierConfig, args: argparse.Namespace) -> int:
    stats = Stats()
    cache = BlobCache(config, stats)
    server = KVTierServer(
        cache,
        stats,
        host=args.host,
        port=args.port,
        token=config.server_token,
        max_frame_bytes=int(args.max_frame_mb * 2**20),
        max_clients=args.max_clients,
        max_shm_bytes=0 if args.no_shm else int(args.max_shm_mb * 2**20),
    )
    try:
        await server.start()
    except OSError:
        cache.close(0)
        raise
    admin = None
    if args.admin_port is not None:
        hooks = AdminHooks(
            snapshot=server.snapshot,
            tiers=lambda: _tiers(cache),
            clear=lambda model: cache.clear(None if model is None else space_of(model)),
            lookup=functools.partial(_lookup, cache, config),
            token=config.server_token,
        )
        admin = AdminServer(args.host, args.admin_port, hooks)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    where = f"kvtier://{args.host}:{server.port}"
    admin_at = f", admin http://{args.host}:{admin.port}" if admin else ""
    auth = "token required" if config.server_token else "no token"
    auth += (
        ", shared memory off" if args.no_shm else f", shared memory up to {args.max_shm_mb:g} MiB"
    )
    logger.info("kvtier server listening on %s%s (%s)", where, admin_at, auth)
    logger.info("kvtier server tiers: %s", "; ".join(cache.describe()))
    await stop.wait()
    logger.info("kvtier server stopping")
    await server.stop()
    if admin is not None:
        admin.close()
    cache.close()
    logger.info("kvtier server stopped")
    return 0


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
