"""``kvtier proxy``: run the prefill/decode proxy of :mod:`kvtier.proxy`.

    kvtier proxy --prefill http://10.0.0.1:8100 --prefill http://10.0.0.2:8100 \\
                 --decode http://10.0.0.3:8200 --policy least_loaded --port 8000

The proxy runs on aiohttp, a dependency of kvtier (vLLM brings it too). This module
imports it only when the command runs, so ``kvtier --help`` works without it, and an
install that lacks it gets a message naming the fix.

On SIGTERM or SIGINT the proxy stops accepting, lets the requests in flight finish (up
to ``--shutdown-grace-s``) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import sys

from kvtier.proxy.instances import POLICIES, normalize_url

HELP = "an OpenAI-compatible prefill/decode router in front of vLLM instances"
DESCRIPTION = (
    "Serve /v1/completions and /v1/chat/completions: each request runs "
    "on a prefill instance with max_tokens=1 (its KV goes to the kvtier tier the "
    "engines share), then goes unchanged to a decode instance, whose answer "
    "(streamed or not) is passed back. Also /v1/models, /health and /metrics. "
    "See docs/proxy.md."
)

DEFAULT_PORT = 8000  # vLLM's: clients point at the proxy as they would at one engine
MISSING_AIOHTTP = (
    "kvtier proxy: aiohttp is not installed; install it with: pip install 'kvtier[proxy]'"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill instance (http://host:port); repeat for several. None: every "
        "request goes to decode alone",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        required=True,
        metavar="URL",
        help="a decode instance (http://host:port); repeat for several (at least one)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="round_robin",
        help="how an instance is picked: in turn, or the one with the fewest requests "
        "in flight (default round_robin)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: any free port"
    )
    parser.add_argument(
        "--retry-after-s",
        type=float,
        default=5.0,
        help="how long a failed instance is skipped before it is tried again (default 5)",
    )
    parser.add_argument(
        "--connect-timeout-s", type=float, default=5.0, help="TCP connect timeout (default 5)"
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=300.0,
        help="the whole prefill leg; past it the request goes to decode alone (default 300)",
    )
    parser.add_argument(
        "--decode-timeout-s",
        type=float,
        default=300.0,
        help="the longest wait for the next bytes of a decode answer (default 300)",
    )
    parser.add_argument(
        "--api-key",
        help="clients must send 'Authorization: Bearer KEY' (the instances' --api-key); "
        "the header is passed on to the instances",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long requests in flight may take to finish (default 30)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="info logs one line per request with its request id (default info)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the proxy until SIGTERM/SIGINT; 0 on a clean stop, 2 on a bad setting or a
    missing aiohttp."""
    try:
        check_arguments(args)
    except ValueError as exc:
        print(f"kvtier proxy: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("aiohttp") is None:
        print(MISSING_AIOHTTP, file=sys.stderr)
        return 2
    # NOTE: imported here, not at the top: ``kvtier`` must run (and --help) without aiohttp.
    from kvtier.proxy.app import Proxy, ProxySettings, serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        settings = ProxySettings(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            policy=args.policy,
            retry_after_s=args.retry_after_s,
            connect_timeout_s=args.connect_timeout_s,
            prefill_timeout_s=args.prefill_timeout_s,
            decode_timeout_s=args.decode_timeout_s,
            api_key=args.api_key,
        )
        proxy = Proxy(settings)
        return asyncio.run(serve(proxy, args.host, args.port, args.shutdown_grace_s))
    except (ValueError, OSError) as exc:
        print(f"kvtier proxy: {exc}", file=sys.stderr)
        return 2


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag that is wrong."""
    for role in ("prefill", "decode"):
        for url in getattr(args, role):
            try:
                normalize_url(url)
            except ValueError as exc:
                raise ValueError(f"--{role} {url!r}: {exc}") from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    for flag in ("retry_after_s", "shutdown_grace_s"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
