"""What the proxy writes and rewrites: the prefill leg's body, the headers passed on each
way, and OpenAI-style error answers (the shape of vLLM's ``ErrorResponse``)."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
from aiohttp import web

REQUEST_ID_HEADER = "X-Request-Id"  # vLLM's OpenAI server takes the request id from it
FORWARDED_HEADERS = ("Authorization", "traceparent", "tracestate")
# Response headers of an instance that are not passed on: hop-by-hop ones and those the
# proxy's own server writes.
DROPPED_RESPONSE_HEADERS = frozenset(
    (
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "x-request-id",
    )
)
EVENT_STREAM = "text/event-stream"


def prefill_body(body: dict) -> dict:
    """The prefill leg's request: one token, no streaming, nothing that would make vLLM
    refuse one token (``min_tokens``)."""
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    return leg


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error object (vLLM's ``ErrorResponse``)."""
    error = {"message": message, "type": kind, "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def error_response(
    status: int, message: str, kind: str, request_id: str = "", retry_after_s: float | None = None
) -> web.Response:
    """An OpenAI-style error answer; ``retry_after_s``: a ``Retry-After`` header (whole
    seconds, at least 1)."""
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    body = error_body(status, message, kind)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def describe_error(exc: BaseException) -> str:
    """A failure as logs and /health show it."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def passed_headers(response: aiohttp.ClientResponse, request_id: str) -> dict[str, str]:
    """The headers of an instance's answer that go to the client, with the request id."""
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS
    }
    headers[REQUEST_ID_HEADER] = request_id
    return headers
