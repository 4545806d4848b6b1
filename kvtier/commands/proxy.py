"""``kvtier proxy``: run the prefill/decode proxy of :mod:`kvtier.proxy`.

    kvtier proxy --prefill http://10.0.0.1:8100 --prefill http://10.0.0.2:8100 \\
                 --decode http://10.0.0.3:8200 --policy least_loaded --port 8000
    kvtier proxy --decode http://10.0.0.1:8000 --decode http://10.0.0.2:8000 \\
                 --policy cache_aware --kv-events http://10.0.0.1:8000=tcp://10.0.0.1:5557 \\
                 --kv-events http://10.0.0.2:8000=tcp://10.0.0.2:5557

``--policy cache_aware`` needs pyzmq and msgspec (``kvtier[routing]``); see docs/routing.md.

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
import math
import sys

from kvtier.logs import KVTIER_LOGGER
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
MISSING_ROUTING = (
    "kvtier proxy: --policy cache_aware needs pyzmq and msgspec; install them with: "
    "pip install 'kvtier[routing]'"
)
HASH_ALGOS = ("auto", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # vLLM's, and auto
WEIGHT_FLAGS = (("gpu", 1.0), ("cpu", 0.8), ("local_storage", 0.5), ("remote", 0.3))


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
        help="how an instance is picked: in turn, the one with the fewest requests "
        "in flight, or the one holding the longest prefix of the request per the "
        "engines' KV events, against its load (default round_robin)",
    )
    add_routing_arguments(parser)
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
        choices=("debug", "info", "warning", "error"),
        help="info logs one line per request with its request id (default info; "
        "KVTIER_LOG_LEVEL, when set, for kvtier's own loggers); given, it wins over "
        "KVTIER_LOG_LEVEL",
    )


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``--policy cache_aware`` (docs/routing.md)."""
    group = parser.add_argument_group("cache_aware (docs/routing.md)")
    group.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="an instance's vLLM KV event stream: INSTANCE_URL (as given to --prefill / "
        "--decode) = its --kv-events-config endpoint, tcp://host:port, optionally "
        "followed by ';replay=tcp://host:port' (its replay_endpoint); repeat per instance",
    )
    group.add_argument(
        "--remote-group",
        action="append",
        default=[],
        metavar="URL=NAME",
        help="the group of instances sharing a remote tier (default: one per role); a "
        "REMOTE block counts for every instance of its group",
    )
    group.add_argument(
        "--index-blocks",
        type=int,
        default=1_000_000,
        help="block hashes the index keeps, least recently used out (default 1000000)",
    )
    for name, default in WEIGHT_FLAGS:
        group.add_argument(
            f"--weight-{name.replace('_', '-')}",
            type=float,
            default=default,
            help=f"worth of a block held in {name.replace('_', ' ')} (default {default})",
        )
    group.add_argument(
        "--load-weight",
        type=float,
        default=0.1,
        help="score cost of one request in flight, in shares of a fully cached prompt "
        "(default 0.1: a full GPU hit outweighs 10 requests)",
    )
    group.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="auto",
        help="the engines' --prefix-caching-hash-algo; auto (the default): learnt from the "
        "first block an event announces, vLLM's own default (sha256) until then",
    )
    group.add_argument(
        "--hash-seed",
        help="the engines' PYTHONHASHSEED, when they run with one (default: vLLM's seed "
        "without it, 'vllm-none-hash')",
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
    cache_aware = args.policy == "cache_aware"
    if cache_aware and not all(importlib.util.find_spec(m) for m in ("zmq", "msgspec")):
        print(MISSING_ROUTING, file=sys.stderr)
        return 2
    # NOTE: imported here, not at the top: ``kvtier`` must run (and --help) without aiohttp.
    from kvtier.proxy.app import Proxy, ProxySettings
    from kvtier.proxy.serving import serve

    level = (args.log_level or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.log_level is not None:  # over the level KVTIER_LOG_LEVEL gave kvtier's loggers
        logging.getLogger(KVTIER_LOGGER).setLevel(level)
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
            routing=routing_settings(args) if cache_aware else None,
        )
        proxy = Proxy(settings)
        return asyncio.run(serve(proxy, args.host, args.port, args.shutdown_grace_s))
    except (ValueError, OSError) as exc:
        print(f"kvtier proxy: {exc}", file=sys.stderr)
        return 2


def routing_settings(args: argparse.Namespace):
    """The ``RoutingSettings`` of the flags (pyzmq and msgspec are installed)."""
    from kvtier.proxy.cache_aware import RoutingSettings
    from kvtier.routing.scoring import Weights

    weights = Weights(**{name: getattr(args, f"weight_{name}") for name, _ in WEIGHT_FLAGS})
    return RoutingSettings(
        kv_events=url_pairs(args.kv_events, "--kv-events"),
        remote_groups=url_pairs(args.remote_group, "--remote-group"),
        index_blocks=args.index_blocks,
        weights=weights,
        load_weight=args.load_weight,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
    )


def url_pairs(values: list[str], flag: str) -> dict[str, str]:
    """``URL=VALUE`` flags -> {normalized URL: VALUE}.

    Raises:
        ValueError: no ``=``, an empty value, a bad URL, or a URL given twice.
    """
    pairs: dict[str, str] = {}
    for value in values:
        url, sep, rest = value.partition("=")
        if not sep or not rest.strip():
            raise ValueError(f"{flag} {value!r}: expected INSTANCE_URL=VALUE")
        try:
            url = normalize_url(url)
        except ValueError as exc:
            raise ValueError(f"{flag} {value!r}: {exc}") from None
        if url in pairs:
            raise ValueError(f"{flag}: {url} given twice")
        pairs[url] = rest.strip()
    return pairs


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag that is wrong."""
    for role in ("prefill", "decode"):
        for url in getattr(args, role):
            try:
                normalize_url(url)
            except ValueError as exc:
                raise ValueError(f"--{role} {url!r}: {exc}") from None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(
            "--api-key is empty: give the key clients must send, or leave the flag out "
            "(no key asked)"
        )
    if args.hash_seed is not None and not args.hash_seed:
        raise ValueError(
            "--hash-seed is empty: give the engines' PYTHONHASHSEED, or leave the flag out "
            "(engines started without one)"
        )
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    for flag in ("retry_after_s", "shutdown_grace_s"):
        if not 0 <= getattr(args, flag) < math.inf:  # nan too
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("connect_timeout_s", "prefill_timeout_s", "decode_timeout_s"):
        if not 0 < getattr(args, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    routing_flags = args.kv_events or args.remote_group
    if args.policy != "cache_aware" and routing_flags:
        raise ValueError("--kv-events and --remote-group need --policy cache_aware")
    if args.policy == "cache_aware" and not args.kv_events:
        raise ValueError(
            "--policy cache_aware needs each instance's KV events: "
            "--kv-events INSTANCE_URL=tcp://host:port (repeat per instance)"
        )
    if args.index_blocks < 1:
        raise ValueError("--index-blocks must be >= 1")
    for name, _ in (*WEIGHT_FLAGS, ("load", 0)):
        weight = getattr(args, f"{name}_weight" if name == "load" else f"weight_{name}")
        if not 0 <= weight < math.inf:
            flag = "--load-weight" if name == "load" else f"--weight-{name.replace('_', '-')}"
            raise ValueError(f"{flag} must be >= 0, got {weight}")
    url_pairs(args.kv_events, "--kv-events")
    url_pairs(args.remote_group, "--remote-group")
