"""``kvtier serve``: run the node-level cache server of :mod:`kvtier.server`.

    kvtier serve --port 65432 --max-local-cpu-size 40 --local-disk /var/cache/kvtier \\
                 --max-local-disk-size 500 --remote-url redis://cache:6379/0 --admin-port 8900

The tier flags mirror config keys (``--max-local-cpu-size`` is ``max_local_cpu_size``,
...), and ``--config FILE`` reads the same YAML an engine reads; a flag beats the file,
and ``KVTIER_*`` variables apply as everywhere. The token is the ``server_token`` key
(``--auth-token``, ``KVTIER_SERVER_TOKEN``); the peers are the ``server_peers`` key
(``--peer``, repeatable: the flags replace the key's list) and, with
``--peer-discovery`` (the ``server_peer_discovery`` key), the servers of the same
``--peer-group`` registered in a shared Redis/Valkey.

On SIGTERM or SIGINT the server stops accepting, finishes the requests it is executing,
drops frames still arriving (nothing half-received is stored), finishes or drops queued
remote writes, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import socket
import sys

from kvtier.config import CONFIG_KEYS, ConfigError, KVTierConfig, load_config
from kvtier.config.keys import coerce
from kvtier.config.node_address import parse_server_address
from kvtier.config.redis_url import parse_url
from kvtier.machine import PoolTooLarge
from kvtier.server.discovery import (
    DEFAULT_GROUP,
    DEFAULT_TTL_S,
    MIN_TTL_S,
    advertised,
    check_group,
)
from kvtier.storage.node_protocol import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_NAMES,
)

PEER_TRANSPORTS = ("auto", "nixl", "tcp")

HELP = "a node-level cache server shared by the engines (remote_url: kvtier://host:port)"
DESCRIPTION = (
    "Hold chunks for every engine of this node: a bounded memory tier, "
    "optionally a disk tier and a remote written through. Engines use it with "
    "remote_url: kvtier://HOST:PORT. See docs/server.md."
)

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


def _key_default(key: str) -> str:
    """A config key's default as help shows it: a flag left out leaves the key to the
    config file, then its ``KVTIER_*`` variable, then the key's default."""
    spec = CONFIG_KEYS[key]
    return f"default: {key} from --config or {spec.env_var}, else {spec.default:g}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (the keys an engine reads)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: any free port"
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        help="serve the admin HTTP API here: GET /health, /stats, /metrics; POST /clear, "
        "/lookup (0: any free port; default: no admin API)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        help=f"the engines' chunk_size, for /lookup by tokens ({_key_default('chunk_size')})",
    )
    parser.add_argument(
        "--max-local-cpu-size",
        type=float,
        help=f"memory tier in GB ({_key_default('max_local_cpu_size')})",
    )
    parser.add_argument("--local-disk", help="disk tier directory (kept across restarts)")
    parser.add_argument(
        "--max-local-disk-size",
        type=float,
        help=f"disk tier in GB ({_key_default('max_local_disk_size')})",
    )
    parser.add_argument("--remote-url", help="write-through remote (redis://, s3://, ...)")
    parser.add_argument(
        "--auth-token",
        help="token clients must send (or KVTIER_SERVER_TOKEN); required off loopback",
    )
    parser.add_argument(
        "--max-frame-mb",
        type=float,
        default=DEFAULT_MAX_FRAME_BYTES / 2**20,
        help="largest payload of one frame in MiB (default %(default)g)",
    )
    parser.add_argument(
        "--max-clients", type=int, default=256, help="connections held at once (default 256)"
    )
    parser.add_argument(
        "--max-names",
        type=int,
        default=DEFAULT_MAX_NAMES,
        help="most chunk names in one request (lookup, get, put, delete, a peer's lease); "
        "clients split larger batches to fit (default %(default)d)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="close a client connection that sends nothing for this long; the client "
        "dials again when it needs one (0: never; default %(default)g)",
    )
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="refuse clients' shared-memory segments: every client moves bytes over TCP",
    )
    parser.add_argument(
        "--peer",
        action="append",
        metavar="kvtier://HOST:PORT",
        help="another kvtier serve to pull missed chunks from (repeatable; the server_peers key)",
    )
    parser.add_argument(
        "--peer-transport",
        choices=PEER_TRANSPORTS,
        default="auto",
        help="how pulled bytes move: nixl (one-sided reads), tcp, or auto: NIXL where it "
        "can be set up, else TCP (default auto)",
    )
    parser.add_argument(
        "--peer-cache",
        choices=("on", "off"),
        help="keep chunks pulled from peers in the memory tier (default on); needs peers",
    )
    parser.add_argument(
        "--lookup-peers",
        action="store_true",
        help="POST /lookup counts chunks the peers hold (per request: /lookup?peers=1); "
        "needs peers",
    )
    parser.add_argument(
        "--peer-discovery",
        metavar="redis://HOST:PORT[/DB]",
        help="find peers in this Redis/Valkey (the Redis tier's URL forms), where each "
        "server registers itself with a TTL; 'remote': the server's own Redis/Valkey "
        "--remote-url (the server_peer_discovery key; default: no discovery)",
    )
    parser.add_argument(
        "--advertise",
        action="append",
        metavar="kvtier://HOST:PORT",
        help="the address other servers reach this one at, as discovery registers it "
        "(default: --host and --port; required when --host binds every address); given "
        "more than once, each must name the same address",
    )
    parser.add_argument(
        "--peer-group",
        default=DEFAULT_GROUP,
        help="the servers that find each other: one group per cluster sharing a Redis "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--peer-discovery-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        metavar="SECONDS",
        help="how long a server stays registered after it stops refreshing (every third "
        f"of it); at least {MIN_TTL_S:g} (default %(default)g)",
    )
    parser.add_argument(
        "--max-shm-mb",
        type=float,
        default=DEFAULT_MAX_FRAME_BYTES / 2**20,
        help="largest shared-memory segment a same-host client may offer, in MiB "
        "(default %(default)g)",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unresolvable(host: str) -> str | None:
    """Why ``host`` names no address to bind (an empty name, or a name the resolver does
    not know), or None."""
    if not host.strip():
        return "empty: give an address or a name to bind (0.0.0.0: every address)"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return f"the name does not resolve ({getattr(exc, 'strerror', None) or exc})"
    return None


def _given(flags: list[tuple[str, bool]]) -> str:
    """``"--a, --b and --c need"`` of the flags given (``"--a needs"``), "" for none."""
    given = [flag for flag, set_ in flags if set_]
    if not given:
        return ""
    named = " and ".join([", ".join(given[:-1]), given[-1]] if given[:-1] else given)
    return f"{named} need{'s' * (len(given) == 1)}"


def server_config(args: argparse.Namespace) -> KVTierConfig:
    """The config of ``args``: flags over ``--config`` over ``KVTIER_*`` over defaults.

    Raises:
        ConfigError: a bad value (naming its flag), or a non-loopback address without a
            token.
    """
    overrides, problems = {}, []
    for dest, key in _CONFIG_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:  # checked here, so that a problem names the flag
            flag = "--" + dest.replace("_", "-")
            coerce(CONFIG_KEYS[key], value, origin=flag, problems=problems)
            overrides[key] = value
    if problems:
        raise ConfigError(problems)
    config = load_config(overrides=overrides, config_file=args.config)
    problem = unresolvable(args.host)
    if problem is not None:
        raise ConfigError(f"--host {args.host!r}: {problem}")
    if not is_loopback(args.host) and config.server_token is None:
        raise ConfigError(
            f"--host {args.host} is not a loopback address: give --auth-token (or "
            "KVTIER_SERVER_TOKEN), the token every client must send"
        )
    problems = [
        f"{flag} {value:g}: expected {allowed}"
        for flag, value, ok, allowed in (
            ("--port", args.port, 0 <= args.port <= 65535, "0..65535 (0: any free port)"),
            (
                "--admin-port",
                args.admin_port,
                args.admin_port is None or 0 <= args.admin_port <= 65535,
                "0..65535 (0: any free port)",
            ),
            ("--max-frame-mb", args.max_frame_mb, 0 < args.max_frame_mb < math.inf, "MiB > 0"),
            ("--max-clients", args.max_clients, args.max_clients >= 1, "an integer >= 1"),
            ("--max-names", args.max_names, args.max_names >= 1, "an integer >= 1"),
            (
                "--idle-timeout",
                args.idle_timeout,
                0 <= args.idle_timeout < math.inf,
                "seconds >= 0 (0: never)",
            ),
            (
                "--max-shm-mb",
                args.max_shm_mb,
                0 < args.max_shm_mb < math.inf,
                "MiB > 0 (--no-shm turns shared memory off)",
            ),
        )
        if not ok
    ]
    if problems:
        raise ConfigError(problems)
    peers, discovery = peer_urls(args, config), discovery_url(args, config)
    for url in peers:
        try:
            parse_server_address(url)
        except ValueError:
            raise ConfigError(
                f"--peer / server_peers {url!r}: expected kvtier://host:port"
            ) from None
    needs_peers = _given(
        [("--peer-cache", args.peer_cache is not None), ("--lookup-peers", args.lookup_peers)]
    )
    if needs_peers and not peers and discovery is None:
        raise ConfigError(
            f"{needs_peers} peers: --peer (or the server_peers key) or --peer-discovery (or "
            "the server_peer_discovery key)"
        )
    if discovery is None:
        if flags := _given(
            [
                ("--advertise", args.advertise is not None),
                ("--peer-group", args.peer_group != DEFAULT_GROUP),
                ("--peer-discovery-ttl", args.peer_discovery_ttl != DEFAULT_TTL_S),
            ]
        ):
            raise ConfigError(f"{flags} --peer-discovery")
        return config
    try:
        advertised(args.host, args.port, advertise_of(args))
        check_group(args.peer_group)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not args.peer_discovery_ttl >= MIN_TTL_S:
        raise ConfigError(f"--peer-discovery-ttl must be >= {MIN_TTL_S:g} (seconds)")
    return config


def advertise_of(args: argparse.Namespace) -> str | None:
    """The one address of ``--advertise`` (given more than once: each time the same
    address, in any of its forms), canonical; None when not given.

    Raises:
        ValueError: naming ``--advertise``: not a ``kvtier://host:port``, or two
            different addresses (a server registers one).
    """
    if not args.advertise:
        return None
    urls = list(dict.fromkeys(advertised(args.host, args.port, url) for url in args.advertise))
    if len(urls) > 1:
        raise ValueError(
            f"--advertise given {len(urls)} different addresses ({', '.join(urls)}): a "
            "server registers one, the address the other servers reach it at"
        )
    return urls[0]


def discovery_url(args: argparse.Namespace, config: KVTierConfig) -> str | None:
    """The Redis/Valkey of peer discovery: ``--peer-discovery``, else the
    ``server_peer_discovery`` key; ``remote`` is the server's own ``remote_url``.

    Raises:
        ConfigError: not a Redis/Valkey URL (naming the flag), or ``remote`` with a
            remote that is none.
    """
    url = args.peer_discovery if args.peer_discovery is not None else config.server_peer_discovery
    if not url:
        return None
    setting = "--peer-discovery / server_peer_discovery"
    if url == "remote":
        remote = config.remote_url
        try:
            if remote is None:
                raise ValueError("no remote_url is set")
            parse_url(remote)
        except ValueError as exc:
            raise ConfigError(
                f"{setting} remote: the server's remote_url must be a Redis/Valkey URL "
                f"({exc}); or give --peer-discovery redis://HOST:PORT"
            ) from None
        return remote
    try:
        parse_url(url, setting)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return url


def peer_urls(args: argparse.Namespace, config: KVTierConfig) -> tuple[str, ...]:
    """The peers: ``--peer`` flags, else the ``server_peers`` key (comma-separated)."""
    if args.peer:
        return tuple(args.peer)
    listed = config.server_peers or ""
    return tuple(url.strip() for url in listed.split(",") if url.strip())


def run(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean stop, 2 on a bad setting."""
    # NOTE: imported here, not at the top: the admin API runs on aiohttp, which the other
    # commands (and --help) neither need nor pay the import of.
    from kvtier.server.nixl import NixlUnavailable
    from kvtier.server.serve import PeerOptions, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = server_config(args)
        asyncio.run(
            serve(
                config,
                host=args.host,
                port=args.port,
                admin_port=args.admin_port,
                max_frame_mb=args.max_frame_mb,
                max_clients=args.max_clients,
                max_names=args.max_names,
                idle_timeout_s=args.idle_timeout,
                max_shm_mb=None if args.no_shm else args.max_shm_mb,
                peers=PeerOptions(
                    peer_urls(args, config),
                    transport=args.peer_transport,
                    keep=args.peer_cache != "off",
                    lookup=args.lookup_peers,
                    discovery=discovery_url(args, config),
                    advertise=advertise_of(args),
                    group=args.peer_group,
                    discovery_ttl_s=args.peer_discovery_ttl,
                ),
            )
        )
    except PoolTooLarge as exc:
        given = args.max_local_cpu_size is not None
        print(
            f"kvtier serve: {'--max-local-cpu-size' if given else 'max_local_cpu_size'} "
            f"{config.max_local_cpu_size:g} (GiB, the server's memory tier): {exc}; lower it",
            file=sys.stderr,
        )
        return 2
    except NixlUnavailable as exc:
        print(f"kvtier serve: --peer-transport nixl: NIXL cannot be used: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    return 0
