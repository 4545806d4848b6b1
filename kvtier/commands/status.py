"""``kvtier status --server HOST:PORT``: a running server's health and counters, read
over its cache protocol (the ``STATS`` request), so it works without the admin port.

    $ kvtier status --server 127.0.0.1:65432
    kvtier server 127.0.0.1:65432: ok
      clients connected   2
      memory              1234 blobs, 3.10 GiB of 40.00 GiB, 12 evictions
      ...

``--json`` prints the raw counters instead (the admin API's ``/stats``). Exit codes: 0
healthy, 1 degraded (the remote behind the server is down), 2 unreachable or refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvtier.commands.serve import DEFAULT_PORT
from kvtier.config import ConfigError, load_config
from kvtier.config.node_address import SCHEMES, host_port, parse_server_url
from kvtier.storage.blob_store import StoreUnavailable
from kvtier.storage.node_store import KVTierStore

HELP = "a running kvtier serve's health, tiers and counters"
DESCRIPTION = (
    "Read a kvtier server's counters over its cache port. Exit 0: ok, "
    "1: degraded (its remote is down), 2: unreachable or refused."
)

STATUS_NAMESPACE = "kvtier-status"  # a namespace no engine uses; STATS reads no blobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        required=True,
        help="HOST:PORT (or kvtier://HOST:PORT) of a kvtier serve's cache port",
    )
    parser.add_argument(
        "--auth-token", help="the server's token (default: server_token / KVTIER_SERVER_TOKEN)"
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait (default %(default)g)"
    )
    parser.add_argument("--json", action="store_true", help="print the raw counters as JSON")


def server_address(given: str) -> tuple[str, int]:
    """``(host, port)`` of ``--server``: ``HOST:PORT``, ``kvtier://HOST:PORT`` or
    ``lm://HOST:PORT``.

    Raises:
        ValueError: anything else (another scheme too), naming ``--server``.
    """
    url = given if "://" in given else f"kvtier://{given}"
    try:
        return parse_server_url(url)
    except ValueError:
        scheme = url.partition("://")[0].lower()
        hint = ""
        if scheme in ("http", "https"):
            hint = f"; {scheme}:// is the admin API's (--admin-port), which this does not read"
        elif scheme not in SCHEMES:
            hint = f"; {scheme}:// is not a kvtier serve's scheme"
        raise ValueError(
            f"--server {given!r}: expected HOST:PORT (or kvtier://HOST:PORT) of a kvtier "
            f"serve's cache port{hint}"
        ) from None


def run(args: argparse.Namespace) -> int:
    try:
        host, port = server_address(args.server)
    except ValueError as exc:
        print(f"kvtier status: {exc}", file=sys.stderr)
        return 2
    if not 0 < args.timeout < math.inf:  # nan too
        print(f"kvtier status: --timeout {args.timeout:g}: expected seconds > 0", file=sys.stderr)
        return 2
    try:
        token = args.auth_token or load_config().server_token
    except ConfigError as exc:
        print(f"kvtier status: {exc}", file=sys.stderr)
        return 2
    shown = host_port(host, port)
    store = KVTierStore(  # one small frame: no shared-memory segment worth making
        host, port, namespace=STATUS_NAMESPACE, token=token, timeout_s=args.timeout, shm=False
    )
    try:
        values = store.stats()
    except StoreUnavailable as exc:
        print(f"kvtier status: {exc}", file=sys.stderr)
        print(f"  {_what_to_check(str(exc), shown)}", file=sys.stderr)
        return 2
    finally:
        store.close()
    healthy = values.get("remote_up", 1) == 1
    if args.json:
        print(json.dumps(values, indent=1, sort_keys=True))
    else:
        print(render(shown, values))
    return 0 if healthy else 1


def _what_to_check(error: str, address: str) -> str:
    if "unauthenticated" in error:
        return (
            "the server wants a token: give --auth-token, or set server_token / "
            "KVTIER_SERVER_TOKEN to the one kvtier serve was started with"
        )
    return (
        f"is `kvtier serve` running and listening on {address}? --server takes its cache "
        f"port (kvtier serve --port, default {DEFAULT_PORT}), not its --admin-port"
    )


def size(nbytes: float) -> str:
    """``nbytes`` in GiB, or in MiB below one GiB (so a small tier does not read 0.00)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def render(address: str, values: dict[str, Any]) -> str:
    """The human summary of a server's counters."""

    def v(name: str) -> float:
        return float(values.get(name, 0))

    status = "ok" if v("remote_up") == 1 or "remote_up" not in values else "degraded"
    lines = [
        f"kvtier server {address}: {status}",
        f"  clients connected   {int(v('clients_connected'))}"
        f" ({int(v('connections'))} connections since start)",
        f"  requests            {int(v('requests'))}"
        f" ({int(v('request_errors'))} errors, {int(v('rejects'))} frames rejected)",
        f"  gets                {int(v('get_hits'))} hits, {int(v('get_misses'))} misses",
        f"  puts                {int(v('puts'))} stored, {int(v('puts_refused'))} refused",
        f"  bytes in / out      {v('bytes_in') / 2**30:.2f} / {v('bytes_out') / 2**30:.2f} GiB",
    ]
    for tier in ("memory", "disk"):
        if f"{tier}_bytes_capacity" in values:
            directories = f"{int(v('disk_directories'))} directories, " * (tier == "disk")
            lines.append(
                f"  {tier:<20}{int(v(f'{tier}_blobs'))} blobs, "
                f"{size(v(f'{tier}_bytes_used'))} of {size(v(f'{tier}_bytes_capacity'))}, "
                f"{directories}{int(v(f'{tier}_evictions'))} evictions"
            )
    if "remote_up" in values:
        state = "up" if v("remote_up") == 1 else "DOWN"
        lines.append(
            f"  remote              {state}, {int(v('remote_queued'))} writes queued, "
            f"{int(v('remote_puts'))} written, {int(v('remote_puts_dropped'))} dropped"
        )
    if "peers_configured" in values:
        lines.append(
            f"  peers               {int(v('peers_up'))} of {int(v('peers_configured'))} up, "
            f"{int(v('peer_hits'))} chunks pulled ({v('peer_bytes_nixl') / 2**30:.2f} GiB "
            f"NIXL, {v('peer_bytes_tcp') / 2**30:.2f} GiB TCP), "
            f"{int(v('peer_misses'))} misses"
        )
        for name in sorted(values):
            if name.startswith('peer_up{peer="'):
                url = name[len('peer_up{peer="') : -2]
                lines.append(f"    {url:<30}{'up' if values[name] == 1 else 'DOWN'}")
    if "discovery_registered" in values:
        state = "registered" if v("discovery_registered") == 1 else "NOT registered"
        lines.append(
            f"  peer discovery      {state}, {int(v('peers_discovered'))} peers found, "
            f"{int(v('discovery_refreshes'))} refreshes, {int(v('discovery_errors'))} failed"
            + ("" if v("discovery_registered") == 1 else " (why: /health, tiers.discovery)")
        )
    return "\n".join(lines)
