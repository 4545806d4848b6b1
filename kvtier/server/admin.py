"""The admin and health HTTP API of ``kvtier serve`` (``--admin-port``), on the standard
library's HTTP server in a thread of its own:

    GET  /health    200 {"status": "ok" | "degraded", "tiers": {...}} ("degraded": the
                    remote behind the server is down; memory and disk still serve)
    GET  /stats     200 the server's counters and gauges, as JSON
    GET  /metrics   200 the same in Prometheus text format (``kvtier_server_*``)
    POST /clear     200 {"deleted": n}: empties every tier, every namespace; with a body
                    {"model": "<model>"}, that model's chunks only
    POST /lookup    200 {"cached_tokens": n, "cached_chunks": k, "total_chunks": t,
                    "chunk_size": c}: how long a prefix of a prompt the server holds
                    (body: {"model": ..., "tokens": [...]} or {"model": ..., "hashes":
                    [...]}; see ``lookup``); 400 naming the bad field

NOTE: with a token set (``--auth-token``), the POST endpoints need ``Authorization: Bearer
<token>``: /clear drops data, and /lookup tells whether a prompt was served (an oracle
on other tenants' prompts). The GET endpoints only read counters and stay open, as
health checks and Prometheus scrapers carry no secrets.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 64 << 20  # a /lookup of a 1M-token prompt is about 7 MiB of JSON

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
)


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
    """``values`` as Prometheus text: ``kvtier_server_<name>`` (``_total`` for counters)."""
    lines = []
    for name in sorted(values):
        counter = name.startswith(_COUNTER_PREFIXES) and not name.endswith("_capacity")
        metric = f"kvtier_server_{name}" + ("_total" if counter else "")
        lines.append(f"# TYPE {metric} {'counter' if counter else 'gauge'}")
        lines.append(f"{metric} {float(values[name])!r}")
    return "\n".join(lines) + "\n"


def _handler(hooks: AdminHooks) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvtier-server"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes every few seconds would flood the log

        def _reply(self, status: int, body: str, content_type: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self, status: int, body: Any) -> None:
            self._reply(status, json.dumps(body, indent=1) + "\n", "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                tiers = hooks.tiers()
                healthy = all(t.get("up", True) for t in tiers.values())
                status = {"status": "ok" if healthy else "degraded", "tiers": tiers}
                self._json(200, status)
            elif path == "/stats":
                self._json(200, dict(hooks.snapshot()))
            elif path == "/metrics":
                self._reply(200, prometheus_text(hooks.snapshot()), "text/plain; version=0.0.4")
            else:
                self._json(404, {"error": f"no such endpoint {path}"})

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in ("/clear", "/lookup"):
                self._json(404, {"error": f"no such endpoint {path}"})
                return
            if hooks.token is not None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {hooks.token}".encode()):
                    self._json(401, {"error": f"POST {path} needs Authorization: Bearer <token>"})
                    return
            try:
                body = self._body()
                if path == "/clear":
                    model = body.get("model")
                    if model is not None and not (isinstance(model, str) and model):
                        raise ValueError("'model' must be a non-empty string")
                    self._json(200, {"deleted": hooks.clear(model)})
                else:
                    self._json(200, hooks.lookup(body))
            except ValueError as exc:
                self._json(400, {"error": str(exc)})

        def _body(self) -> dict[str, Any]:
            """The JSON object sent ({} when there is no body).

            Raises:
                ValueError: too long, not JSON, or not an object.
            """
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise ValueError("Content-Length is not a number") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                raise ValueError(f"the body must be at most {MAX_BODY_BYTES} bytes")
            if length == 0:
                return {}
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise ValueError("the body is not JSON") from None
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            return body

    return Handler


class AdminServer:
    """The admin API on ``host:port`` (port 0: any free port; see ``port``)."""

    def __init__(self, host: str, port: int, hooks: AdminHooks):
        self._http = ThreadingHTTPServer((host, port), _handler(hooks))
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="kvtier-server-admin", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
