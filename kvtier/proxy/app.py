"""The proxy's HTTP server: OpenAI-compatible endpoints in front of prefill and decode
instances, on aiohttp (server and one pooled, keep-alive client session).

    POST /v1/completions, /v1/chat/completions   prefill leg, then decode leg (below)
    GET  /v1/models                              forwarded to a decode instance (a 5xx
                                                 or no answer in ``MODELS_TIMEOUT_S``
                                                 marks it down; the next one is asked)
    GET  /health                                 the proxy's and every instance's state
    GET  /metrics                                Prometheus text (``counters.py``)

A completion request, in order:

    client ──body──▶ proxy ──body, max_tokens=1, stream=false──▶ prefill instance
                       │        (waits for the whole answer, drops it)
                       └────── the client's body, byte for byte ──▶ decode instance
    client ◀── the decode instance's status, headers and bytes (SSE chunks as they come)

Both legs carry the request id as ``X-Request-Id`` (the client's, or a new one), the
header vLLM's OpenAI server takes its request id from; the client's ``Authorization``,
``traceparent`` and ``tracestate`` headers are passed on too.

With ``--policy cache_aware`` the prefill instance (the decode instance when there is no
prefill pool) is the one whose KV events show the request's longest cached prefix
(``cache_aware.py``); the other leg goes to the least loaded instance.

Failures (NOTE: the decode instance always gets the request unless none is up):
- prefill: a connection error tries the next prefill instance; a timeout or a 5xx marks
  the instance down and the request goes to decode without a prefill leg; a 4xx (the
  request is bad, or bad with ``max_tokens=1``) goes to decode too, which gives the
  verdict the client sees. With every prefill instance down the request goes to decode
  alone: the decode instance computes the prompt itself (counted in
  ``kvtier_proxy_prefill_skipped_total``).
- decode: a connection error marks the instance down and tries the next one; with none
  left the proxy answers 503 with ``Retry-After`` (at once, without a prefill leg, when
  none is up or due for a retry as the request comes). A 5xx marks it down and is passed
  to the client as it is (not retried: the request may be what failed). A timeout
  answers 504, or ends a stream that already started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from kvtier.proxy.counters import CONTENT_TYPE, ProxyMetrics, SkipReason
from kvtier.proxy.health_probe import HealthProbe
from kvtier.proxy.instances import Instance, Pool, check_roles
from kvtier.proxy.messages import (
    EVENT_STREAM,
    FORWARDED_HEADERS,
    REQUEST_ID_HEADER,
    describe_error,
    error_response,
    passed_headers,
    prefill_body,
)
from kvtier.proxy.prompts import cached_tokens_in_json, cached_tokens_in_sse
from kvtier.web import has_bearer_token

if TYPE_CHECKING:
    from kvtier.proxy.cache_aware import CacheAwareRouter, Decision, RoutingSettings

logger = logging.getLogger("kvtier.proxy")

# Below uvicorn's (and so vLLM's) 5 s keep-alive, so the proxy never reuses a connection
# the instance is closing.
KEEPALIVE_S = 4.0
MAX_BODY_BYTES = 256 << 20  # a long multimodal prompt; aiohttp's default is 1 MiB
USAGE_TAIL_BYTES = 16 << 10  # the end of a stream kept to read its usage chunk
CLIENT_GONE_STATUS = "499"  # requests_total's status of a request its client left
# requests_total's status of a stream the decode instance broke off after its 200 went out:
# the status a failed non-streamed answer gets
STREAM_CUT_STATUS = "504"
# Set on a request whose answer's stream was cut (aiohttp >= 3.12 types request keys).
STREAM_CUT = web.RequestKey("stream_cut", bool) if hasattr(web, "RequestKey") else "stream_cut"
# An instance's /v1/models answers from memory, at once even under load: past this it is
# marked down and the next decode instance is asked.
MODELS_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What ``kvtier proxy`` is given (see :mod:`kvtier.commands.proxy` for the flags)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    policy: str = "round_robin"
    retry_after_s: float = 5.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0  # the whole prefill leg
    decode_timeout_s: float = 300.0  # the longest wait for the next bytes of a decode answer
    models_timeout_s: float = MODELS_TIMEOUT_S  # the whole GET /v1/models of one instance
    api_key: str | None = None
    routing: RoutingSettings | None = None  # cache_aware's flags


class LegFailed(Exception):
    """An instance could not be used: no connection, a timeout, a broken answer."""


class Proxy:
    """The proxy's state (instance pools, metrics, client session) and its handlers.

    ``build_app()`` returns the aiohttp application; the client session is opened when
    the application starts and closed when it stops, with the health probe beside it.
    """

    def __init__(self, settings: ProxySettings):
        if not settings.decode:
            raise ValueError("at least one decode instance is needed (--decode URL)")
        self.settings = settings
        prefill_policy = decode_policy = settings.policy
        if settings.policy == "cache_aware":
            # by cache where the prompt is computed; by load for the decode leg of PD
            decode_policy = "least_loaded" if settings.prefill else "cache_aware"
        self.prefill = Pool("prefill", settings.prefill, prefill_policy, settings.retry_after_s)
        self.decode = Pool("decode", settings.decode, decode_policy, settings.retry_after_s)
        check_roles(self.prefill, self.decode)
        self.metrics = ProxyMetrics([self.prefill, self.decode])
        self.routing: CacheAwareRouter | None = None
        if settings.policy == "cache_aware":
            # NOTE: imported here: pyzmq and msgspec (kvtier[routing]) are needed by
            # this policy only.
            from kvtier.proxy.cache_aware import CacheAwareRouter, RoutingSettings

            scored = self.prefill if settings.prefill else self.decode
            self.routing = CacheAwareRouter(
                settings.routing or RoutingSettings(),
                scored,
                [self.prefill, self.decode],
                self.metrics.registry,
            )
        self.session: aiohttp.ClientSession | None = None
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=settings.prefill_timeout_s, sock_connect=settings.connect_timeout_s
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.decode_timeout_s,
        )
        self._models_timeout = aiohttp.ClientTimeout(
            total=settings.models_timeout_s, sock_connect=settings.connect_timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=settings.connect_timeout_s)
        self._health_probe = HealthProbe(
            [self.prefill, self.decode], settings.retry_after_s, self._probe_timeout
        )

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, skip_auto_headers=("User-Agent",))
        self._health_probe.start(self.session)
        if self.routing is not None:
            self.routing.start()

    async def _stop(self, app: web.Application) -> None:
        if self.routing is not None:
            await self.routing.stop()
        await self._health_probe.stop()
        if self.session is not None:
            await self.session.close()

    # -- completions ---------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = request.path
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        refused = self._check_key(request, request_id)
        if refused is not None:
            self.metrics.requests.labels(endpoint, str(refused.status)).inc()
            return refused
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.metrics.requests.labels(endpoint, "400").inc()
            return error_response(
                400, "the request body is not a JSON object", "BadRequestError", request_id
            )
        if self.decode.next_retry_s() > 0:
            # NOTE: no decode instance to try: a prefill leg now would compute KV that
            # nothing loads, and keep the client waiting for its 503 as long.
            self.metrics.requests.labels(endpoint, "503").inc()
            return self._unavailable("no decode instance is up", request_id)
        headers = self._leg_headers(request, request_id)
        try:
            decision = None
            if self.routing is not None:
                timeout = self._probe_timeout
                decision = await self.routing.decide(self.session, endpoint, body, headers, timeout)
            prefilled_on, prefill_s = await self._prefill(
                endpoint, body, headers, request_id, decision
            )
            response, decoded_on, decode_s = await self._decode(
                request, raw, headers, request_id, decision
            )
        except asyncio.CancelledError:
            # NOTE: ``serving.serve`` cancels the handler of a client that went away; the legs'
            # connections close with it, which makes vLLM abort the request.
            self.metrics.requests.labels(endpoint, CLIENT_GONE_STATUS).inc()
            logger.info(
                "%s %s: the client went away; the request is abandoned", request_id, endpoint
            )
            raise
        total_s = time.perf_counter() - started
        status = STREAM_CUT_STATUS if request.get(STREAM_CUT) else str(response.status)
        self.metrics.requests.labels(endpoint, status).inc()
        self.metrics.overhead_seconds.observe(max(0.0, total_s - prefill_s - decode_s))
        logger.info(
            "%s %s prefill=%s (%.1f ms) decode=%s %d (%.1f ms)",
            request_id,
            endpoint,
            prefilled_on,
            prefill_s * 1e3,
            decoded_on,
            response.status,
            decode_s * 1e3,
        )
        return response

    def _check_key(self, request: web.Request, request_id: str) -> web.Response | None:
        key = self.settings.api_key
        if key is None:
            return None
        if has_bearer_token(request, key):
            return None
        return error_response(401, "Unauthorized", "AuthenticationError", request_id)

    @staticmethod
    def _leg_headers(request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def _pick(self, pool: Pool, tried: list[Instance], decision: Decision | None):
        if decision is None:
            return pool.pick(exclude=tried)
        return self.routing.pick(pool, decision, tried)

    async def _prefill(
        self,
        path: str,
        body: dict,
        headers: dict[str, str],
        request_id: str,
        decision: Decision | None = None,
    ) -> tuple[str, float]:
        """Run the prefill leg. Returns where it ran (a URL, or why it was skipped) and
        its seconds."""
        payload = json.dumps(prefill_body(body)).encode()
        tried: list[Instance] = []
        seconds = 0.0
        while (instance := self._pick(self.prefill, tried, decision)) is not None:
            tried.append(instance)
            leg_started = time.perf_counter()
            try:
                with self.prefill.in_flight(instance):
                    status, answer = await self._post_and_read(instance, path, payload, headers)
            except aiohttp.ClientConnectionError as exc:
                seconds += time.perf_counter() - leg_started
                if isinstance(exc, aiohttp.ServerTimeoutError):
                    return self._prefill_failed(instance, exc, request_id), seconds
                self._instance_failed(self.prefill, instance, exc, request_id)
                continue  # nothing was computed there: the next instance
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                seconds += time.perf_counter() - leg_started
                return self._prefill_failed(instance, exc, request_id), seconds
            seconds += time.perf_counter() - leg_started
            self.metrics.prefill_seconds.observe(seconds)
            if status >= 500:
                return self._prefill_failed(instance, f"HTTP {status}", request_id), seconds
            self.prefill.mark_up(instance)
            if status < 400 and decision is not None:
                cached = cached_tokens_in_json(answer)
                self.routing.answered(self.prefill, instance, decision, cached)
            if status >= 400:
                logger.warning(
                    "%s prefill on %s answered %d; decode gives the verdict",
                    request_id,
                    instance.url,
                    status,
                )
                self.metrics.prefill_skipped.labels(SkipReason.PREFILL_REJECTED).inc()
                return SkipReason.PREFILL_REJECTED, seconds
            return instance.url, seconds
        reason = SkipReason.PREFILL_FAILED if tried else SkipReason.NO_PREFILL_INSTANCE
        self.metrics.prefill_skipped.labels(reason).inc()
        return reason, seconds

    async def _post_and_read(
        self, instance: Instance, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        async with self.session.post(
            instance.url + path, data=payload, headers=headers, timeout=self._prefill_timeout
        ) as response:
            return response.status, await response.read()

    def _prefill_failed(self, instance: Instance, error: object, request_id: str) -> str:
        self._instance_failed(self.prefill, instance, error, request_id)
        self.metrics.prefill_skipped.labels(SkipReason.PREFILL_FAILED).inc()
        return SkipReason.PREFILL_FAILED

    def _instance_failed(
        self, pool: Pool, instance: Instance, error: object, request_id: str
    ) -> None:
        text = describe_error(error) if isinstance(error, BaseException) else str(error)
        pool.mark_down(instance, text)
        logger.warning(
            "%s %s instance %s failed (%s); skipped for %.1f s",
            request_id,
            pool.role,
            instance.url,
            text,
            pool.retry_after_s,
        )

    async def _decode(
        self,
        request: web.Request,
        raw: bytes,
        headers: dict[str, str],
        request_id: str,
        decision: Decision | None = None,
    ) -> tuple[web.StreamResponse, str, float]:
        """Run the decode leg and answer the client. Returns the response, the decode
        instance's URL (or "none") and the leg's seconds."""
        tried: list[Instance] = []
        scored = decision is not None and self.routing.scored is self.decode
        while (instance := self._pick(self.decode, tried, decision)) is not None:
            tried.append(instance)
            leg_started = time.perf_counter()
            with self.decode.in_flight(instance):
                try:
                    response, cached = await self._relay(
                        request, instance, raw, headers, request_id, watch_usage=scored
                    )
                except LegFailed:
                    continue
                answered = response.status < 400 and not request.get(STREAM_CUT)
                if answered and decision is not None:
                    self.routing.answered(self.decode, instance, decision, cached)
                return response, instance.url, time.perf_counter() - leg_started
        message = "no decode instance is up" if not tried else "every decode instance failed"
        unavailable = self._unavailable(message, request_id)
        return unavailable, "none", 0.0

    async def _relay(
        self,
        request: web.Request,
        instance: Instance,
        raw: bytes,
        headers: dict[str, str],
        request_id: str,
        watch_usage: bool = False,
    ) -> tuple[web.StreamResponse, int | None]:
        """Send the client's body to ``instance`` and pass its answer on. Returns the
        response and, with ``watch_usage``, the cached tokens the answer reports.

        Raises:
            LegFailed: no answer at all from ``instance`` (try another one).
        """
        leg_started = time.perf_counter()
        try:
            upstream = await self.session.post(
                instance.url + request.path,
                data=raw,
                headers=headers,
                timeout=self._decode_timeout,
            )
        except aiohttp.ServerTimeoutError as exc:  # the instance may be working on it
            self._instance_failed(self.decode, instance, exc, request_id)
            timed_out = error_response(504, "the decode instance timed out", "Timeout", request_id)
            return timed_out, None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._instance_failed(self.decode, instance, exc, request_id)
            raise LegFailed from exc
        cached = None
        async with upstream:
            self.metrics.decode_first_byte_seconds.observe(time.perf_counter() - leg_started)
            if upstream.status >= 500:
                self._instance_failed(self.decode, instance, f"HTTP {upstream.status}", request_id)
            else:
                self.decode.mark_up(instance)
            passed = passed_headers(upstream, request_id)
            if upstream.content_type == EVENT_STREAM:
                response, tail = await self._stream(
                    request, instance, upstream, passed, watch_usage
                )
                cached = cached_tokens_in_sse(tail) if watch_usage else None
            else:
                try:
                    body = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    self._instance_failed(self.decode, instance, exc, request_id)
                    message = f"the decode instance failed: {describe_error(exc)}"
                    return error_response(504, message, "Timeout", request_id), None
                response = web.Response(status=upstream.status, body=body, headers=passed)
                cached = cached_tokens_in_json(body) if watch_usage else None
        self.metrics.decode_seconds.observe(time.perf_counter() - leg_started)
        return response, cached

    async def _stream(
        self,
        request: web.Request,
        instance: Instance,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        keep_tail: bool = False,
    ) -> tuple[web.StreamResponse, bytes]:
        """Pass an SSE answer on as its bytes arrive. Returns the response and, with
        ``keep_tail``, the stream's last ``USAGE_TAIL_BYTES`` (where its usage is).

        NOTE: when the instance fails mid-stream the status has gone out already; the
        client's connection is then cut (no closing chunk), so the client sees a broken
        stream rather than a short answer that looks complete.
        """
        request_id = headers[REQUEST_ID_HEADER]
        response = web.StreamResponse(status=upstream.status, headers=headers)
        tail = b""
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if keep_tail:
                    tail = (tail + chunk)[-USAGE_TAIL_BYTES:]
            await response.write_eof()
        except ConnectionResetError:
            # The client went away (before the answer's headers, or perhaps right after
            # the last event, before the stream's end); leaving ``upstream`` unread
            # closes its connection, which makes vLLM abort the generation.
            logger.info("%s client disconnected before the end of the stream", request_id)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._instance_failed(self.decode, instance, exc, request_id)
            request[STREAM_CUT] = True
            if request.transport is not None:
                request.transport.abort()
        return response, tail

    # -- other endpoints -----------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        response = self._check_key(request, request_id)
        if response is None:
            response = await self._models(request, request_id)
        self.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    async def _models(self, request: web.Request, request_id: str) -> web.Response:
        headers = self._leg_headers(request, request_id)
        headers.pop("Content-Type")
        tried: list[Instance] = []
        failed: web.Response | None = None  # the last 5xx answer
        while (instance := self.decode.pick(exclude=tried)) is not None:
            tried.append(instance)
            try:
                with self.decode.in_flight(instance):
                    async with self.session.get(
                        instance.url + "/v1/models", headers=headers, timeout=self._models_timeout
                    ) as upstream:
                        body = await upstream.read()
                        passed = passed_headers(upstream, request_id)
                        answer = web.Response(status=upstream.status, body=body, headers=passed)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._instance_failed(self.decode, instance, exc, request_id)
                continue
            if answer.status < 500:
                self.decode.mark_up(instance)
                return answer
            # a GET without a body: the instance failed, not the request; ask the next one
            self._instance_failed(self.decode, instance, f"HTTP {answer.status}", request_id)
            failed = answer
        if failed is not None:
            return failed  # the last instance's 5xx, as it came
        return self._unavailable("no decode instance is up", request_id)

    def _unavailable(self, message: str, request_id: str) -> web.Response:
        """503: no decode instance to send to; ``Retry-After``: when one may be retried."""
        retry_after_s = self.decode.next_retry_s()
        kind = "ServiceUnavailableError"
        return error_response(503, message, kind, request_id, retry_after_s=retry_after_s)

    async def health(self, request: web.Request) -> web.Response:
        """200 while a decode instance is up ("ok", or "degraded" when an instance is
        down), 503 when none is."""
        decode_up = self.decode.up_count()
        everything_up = decode_up == len(self.decode) and self.prefill.up_count() == len(
            self.prefill
        )
        status = "ok" if everything_up else "degraded" if decode_up else "down"
        body = {
            "status": status,
            "policy": self.settings.policy,
            "prefill": self.prefill.as_json(),
            "decode": self.decode.as_json(),
        }
        if self.routing is not None:
            for role in ("prefill", "decode"):
                for row in body[role]:
                    row["kv_events"] = self.routing.stream_json(row["url"])
        return web.json_response(body, status=200 if decode_up else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
