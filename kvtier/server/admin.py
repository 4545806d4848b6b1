"""The admin and health HTTP API of ``kvtier serve`` (``--admin-port``), on aiohttp, served
from the server's own event loop:

    GET  /health    200 {"status": "ok" | "degraded", "tiers": {...}} ("degraded": the
                    remote behind the server is down; memory and disk still serve)
    GET  /stats     200 the server's counters and gauges, as JSON
    GET  /metrics   200 the same in Prometheus text format (``kvtier_server_*``)
    POST /clear     200 {"deleted": n}: empties every tier, every namespace; with a body
                    {"model": "<model>"}, that model's chunks only
    POST /lookup    200 {"cached_tokens": n, "cached_chunks": k, "total_chunks": t,
                    "chunk_size": c}: how long a prefix of a prompt the server holds
                    (body: {"model": ..., "tokens": [...]} or {"model": ..., "hashes":
                    [...]}; see ``lookup``); 400 naming the bad field. With
                    ``?peers=1`` (or ``kvtier serve --lookup-peers``) a chunk a peer
                    holds counts as held

Every answer is JSON but /metrics; an error is ``{"error": "<what is wrong>"}``: 404 for
an unknown path, 405 (with ``Allow``) for a method the endpoint does not take, 400 for a
body over ``MAX_BODY_BYTES``, not JSON, or not an object.

NOTE: with a token set (``--auth-token``), the POST endpoints need ``Authorization: Bearer
<token>``: /clear drops data, and /lookup tells whether a prompt was served (an oracle
on other tenants' prompts). The GET endpoints only read counters and stay open, as
health checks and Prometheus scrapers carry no secrets.

NOTE: the hooks run on worker threads, never on the event loop: a clear or a lookup may
wait on the disk or the remote, and the loop also serves the cache protocol.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtier.web import has_bearer_token, start_app

MAX_BODY_BYTES = 64 << 20  # a /lookup of a 1M-token prompt is about 7 MiB of JSON
PROMETHEUS_TEXT = "text/plain; version=0.0.4"

# Counters (monotonic) among the server's values; everything else is a gauge.
_COUNTER_PREFIXES = (
    "requests",
    "bytes_",
    "rejects",
    "connections",
    "get_",
    "puts",
    "remote_puts",
    "remote_errors",
    "request_errors",
    "peer_",
    "corrupt_dropped",
    "discovery_refreshes",
    "discovery_errors",
    "shm_attached",
    "shm_refused",
)
_COUNTERS = ("memory_evictions", "disk_evictions")  # among the tiers' gauges

# Each family's # HELP line (the names docs/server.md lists); families with a suffix of
# their own (``requests_<op>``, ``rejects_<reason>``, ``shm_refused_<reason>``) are
# described by the text of their prefix, with the suffix filled in.
HELP = {
    "clients_connected": "Client connections open now.",
    "shm_clients_connected": "Client connections with a shared-memory segment open now.",
    "connections": "Client connections accepted since start.",
    "connections_idle_closed": "Connections closed after --idle-timeout without a frame.",
    "requests": "Requests answered, every op.",
    "requests_": "Requests answered of op {}.",
    "request_errors": "Requests answered with an error (bad fields; the connection stays open).",
    "rejects": "Frames or connections rejected (bad frame, authentication, timeout, limit).",
    "rejects_": "Frames or connections rejected for {}.",
    "bytes_in": "Bytes received on client sockets (whole frames).",
    "bytes_out": "Bytes sent on client sockets (whole frames).",
    "bytes_shm_in": "Blob bytes received through shared memory.",
    "bytes_shm_out": "Blob bytes sent through shared memory.",
    "get_hits": "Blobs a GET found.",
    "get_misses": "Blobs a GET did not find.",
    "puts": "Blobs a PUT stored.",
    "puts_refused": "Blobs a PUT did not store (larger than the memory tier, or no room).",
    "shm_attached": "Clients' shared-memory segments mapped.",
    "shm_refused": "Clients' shared-memory segments refused (the client stays on TCP).",
    "shm_refused_": "Clients' shared-memory segments refused as {}.",
    "memory_blobs": "Blobs in the memory tier.",
    "memory_bytes_used": "Bytes the memory tier's blobs take.",
    "memory_bytes_capacity": "The memory tier's size in bytes (--max-local-cpu-size).",
    "memory_evictions": "Blobs evicted from the memory tier (least recently used) for room.",
    "disk_blobs": "Blob files in the disk tier.",
    "disk_bytes_used": "Bytes the disk tier's files take.",
    "disk_directories": "Directories of the disk tier's tree, beside its files' bytes.",
    "disk_bytes_capacity": "The disk tier's bound in bytes (max_local_disk_size).",
    "disk_evictions": "Blob files deleted to stay under max_local_disk_size.",
    "remote_up": "1 while the remote behind the server answers, else 0.",
    "remote_queued": "Writes to the remote queued now.",
    "remote_puts": "Blobs written through to the remote.",
    "remote_puts_dropped": "Writes to the remote dropped (queue full, remote down, error).",
    "remote_errors": "Calls to the remote that failed.",
    "peers_configured": "Peers of the moment, static and discovered.",
    "peers_up": "Peers that answer now.",
    "peer_up": "1 while this peer answers, else 0.",
    "peers_discovered": "Peers found through discovery now.",
    "peer_lookups": "Lookups asked of peers.",
    "peer_lookup_hits": "Blobs a peer's lookup found.",
    "peer_pulls": "Pulls of missed blobs from peers.",
    "peer_hits": "Blobs pulled from peers.",
    "peer_misses": "Blobs asked of peers that none held.",
    "peer_bytes_nixl": "Bytes pulled from peers with NIXL READs.",
    "peer_bytes_tcp": "Bytes pulled from peers over TCP.",
    "peer_errors": "Calls to peers that failed.",
    "peer_corrupt": "Blobs pulled from peers that failed verification.",
    "peer_corrupt_reported": "Corrupt pulls reported to the peer that held them.",
    "corrupt_dropped": "Blobs dropped here after a peer found them corrupt and they failed here.",
    "peer_lease_lost": "Blobs read with NIXL whose lease had lapsed (dropped).",
    "peer_nixl_failed": "NIXL READs from peers that failed.",
    "peer_nixl_stuck": "Blobs of a NIXL READ that could not be cancelled (buffers kept).",
    "peer_no_room": "Blobs pulled from peers the memory tier had no room for.",
    "peer_handshakes": "NIXL handshakes with peers.",
    "peer_fallbacks": "Pulls that fell back from NIXL to TCP.",
    "peer_leases": "Leases granted to peers for NIXL reads.",
    "peer_leased_blobs": "Blobs leased to peers for NIXL reads.",
    "discovery_refreshes": "Peer discovery refreshes that reached Redis/Valkey.",
    "discovery_errors": "Peer discovery refreshes that did not reach Redis/Valkey.",
    "discovery_registered": "1 while the last discovery refresh registered this server.",
}


def is_counter(name: str) -> bool:
    """Whether the server's value ``name`` (without labels) only grows."""
    return name in _COUNTERS or (
        name.startswith(_COUNTER_PREFIXES) and not name.endswith("_capacity")
    )


def help_of(name: str) -> str:
    """The # HELP text of the server's value ``name`` (without labels)."""
    if name in HELP:
        return HELP[name]
    for prefix in ("requests_", "rejects_", "shm_refused_"):
        if name.startswith(prefix):
            return HELP[prefix].format(name.removeprefix(prefix).replace("_", " "))
    return f"kvtier serve's {name.replace('_', ' ')} (docs/server.md)."


@dataclass(frozen=True, slots=True)
class AdminHooks:
    """What the API reads and does: the server's values, its tiers' status, a clear (of
    one model, or of all when given None) and a prefix lookup (raising ValueError with
    the message to return on a bad request)."""

    snapshot: Callable[[], Mapping[str, float]]
    tiers: Callable[[], dict[str, Any]]
    clear: Callable[[str | None], int]
    lookup: Callable[[dict[str, Any]], dict[str, int]]
    token: str | None


def prometheus_text(values: Mapping[str, float]) -> str:
    """``values`` as Prometheus text: ``kvtier_server_<name>`` (``_total`` for counters),
    each family with its # HELP and # TYPE lines, once. A name with labels
    (``peer_up{peer="..."}``) is a gauge."""
    lines = []
    typed = set()
    for name in sorted(values):
        base, brace, labels = name.partition("{")
        counter = is_counter(base) and not brace
        metric = f"kvtier_server_{base}" + ("_total" if counter else "")
        if metric not in typed:
            typed.add(metric)
            lines.append(f"# HELP {metric} {help_of(base)}")
            lines.append(f"# TYPE {metric} {'counter' if counter else 'gauge'}")
        lines.append(f"{metric}{brace}{labels} {float(values[name])!r}")
    return "\n".join(lines) + "\n"


def admin_app(hooks: AdminHooks) -> web.Application:
    """The admin API as an aiohttp application over ``hooks``."""
    api = _AdminAPI(hooks)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app.router.add_get("/health", api.health)
    app.router.add_get("/stats", api.stats)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_post("/clear", api.clear)
    app.router.add_post("/lookup", api.lookup)
    return app


class AdminServer:
    """The admin API on ``host:port`` (port 0: any free port; see ``port`` once started),
    served from the running event loop."""

    def __init__(self, hooks: AdminHooks):
        self.app = admin_app(hooks)
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        """Raises OSError: the address cannot be bound."""
        self._runner = await start_app(self.app, host, port, shutdown_timeout_s=2.0)
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class _AdminAPI:
    def __init__(self, hooks: AdminHooks):
        self.hooks = hooks

    async def health(self, request: web.Request) -> web.Response:
        tiers = await asyncio.to_thread(self.hooks.tiers)
        healthy = all(t.get("up", True) for t in tiers.values())
        return _json(200, {"status": "ok" if healthy else "degraded", "tiers": tiers})

    async def stats(self, request: web.Request) -> web.Response:
        return _json(200, dict(await asyncio.to_thread(self.hooks.snapshot)))

    async def metrics(self, request: web.Request) -> web.Response:
        text = prometheus_text(await asyncio.to_thread(self.hooks.snapshot))
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TEXT})

    async def clear(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized(request)
        try:
            model = (await _body(request)).get("model")
            if model is not None and not (isinstance(model, str) and model):
                raise ValueError("'model' must be a non-empty string")
            deleted = await asyncio.to_thread(self.hooks.clear, model)
        except ValueError as exc:
            return _error(400, str(exc))
        return _json(200, {"deleted": deleted})

    async def lookup(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized(request)
        try:
            body = await _body(request)
            if "peers" in request.query:
                body["peers"] = request.query["peers"].lower() in ("1", "true", "yes")
            result = await asyncio.to_thread(self.hooks.lookup, body)
        except ValueError as exc:
            return _error(400, str(exc))
        return _json(200, result)

    def _authorized(self, request: web.Request) -> bool:
        return self.hooks.token is None or has_bearer_token(request, self.hooks.token)

    @staticmethod
    def _unauthorized(request: web.Request) -> web.Response:
        return _error(401, f"POST {request.path} needs Authorization: Bearer <token>")


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object sent ({} when there is no body).

    Raises:
        ValueError: too long, not JSON (or nested too deeply to parse), or not an object.
    """
    too_long = f"the body must be at most {MAX_BODY_BYTES} bytes"
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise ValueError(too_long)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body, past the limit
        raise ValueError(too_long) from None
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise ValueError("the body is not JSON") from None
    except RecursionError:  # "[[[[...": the parser recurses once per level
        raise ValueError("the body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    return body


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 answers, in the API's JSON shape."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} {request.path} is not allowed: it takes {allowed}"
        return _error(405, message, headers={"Allow": exc.headers["Allow"]})
    except web.HTTPNotFound:
        return _error(404, f"no such endpoint {request.path}")


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    data = (json.dumps(body, indent=1) + "\n").encode()
    return web.Response(
        status=status, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json(status, {"error": message}, headers)
