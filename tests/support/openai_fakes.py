"""Fake OpenAI-compatible engines for the proxy's tests and benchmark, and a thread that
runs an aiohttp application (a fake engine, or the proxy itself) beside a test.

``FakeOpenAI`` answers /v1/completions and /v1/chat/completions (JSON, or SSE with
``stream: true``), /v1/models, /tokenize (``fake_tokens``) and /health, records every request it gets (path,
headers, raw body) and is steered through ``behaviour``: an error status, a delay, a
stream cut mid-way, a failing health check. ``stop()`` closes its port (connections are
refused, as with a dead engine) and ``start()`` brings it back on the same port.

Run as a script it serves one fake engine until killed, printing its port:

    python tests/support/openai_fakes.py --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web


class AppThread:
    """An aiohttp application served on ``127.0.0.1`` from an event loop in a thread;
    ``handler_cancellation``: a handler is cancelled when its client disconnects (as
    ``kvtier proxy`` serves)."""

    def __init__(self, app: web.Application, port: int = 0, handler_cancellation: bool = False):
        self.app = app
        self.port = port
        self.handler_cancellation = handler_cancellation
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 10.0):
        """Run ``coro`` on the thread's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> AppThread:
        async def start():
            self._runner = web.AppRunner(
                self.app,
                access_log=None,
                shutdown_timeout=0.5,
                handler_cancellation=self.handler_cancellation,
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
            await site.start()
            self.port = self._runner.addresses[0][1]

        self.call(start())
        return self

    def stop(self) -> None:
        """Close the port and every connection (the application can start again)."""
        if self._runner is not None:
            self.call(self._runner.cleanup())
            self._runner = None

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Behaviour:
    """How a ``FakeOpenAI`` answers; tests change it between requests."""

    status: int = 200  # of the completion endpoints
    delay_s: float = 0.0  # before the answer's headers
    chunks: int = 3  # SSE events before [DONE] with stream: true
    chunk_delay_s: float = 0.0  # between SSE events
    cut_after: int | None = None  # drop the connection after this many SSE events
    health_status: int = 200
    models_status: int = 200  # of /v1/models
    models_delay_s: float = 0.0  # before the /v1/models answer
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens in answers


@dataclass
class Received:
    path: str
    headers: Mapping[str, str]  # case-insensitive, as received
    raw: bytes

    @property
    def body(self) -> dict:
        return json.loads(self.raw)


@dataclass
class FakeOpenAI:
    """One fake engine; ``name`` appears in its answers (``"model"`` and the text)."""

    name: str
    behaviour: Behaviour = field(default_factory=Behaviour)
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    health_checks: int = 0
    abandoned_streams: int = 0  # streams whose reader went away before the end
    abandoned_answers: int = 0  # answers whose client went away during ``delay_s``

    def __post_init__(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        self.server = AppThread(app)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> FakeOpenAI:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        self.server.close()

    def events(self, request_id: str, include_usage: bool = False) -> list[bytes]:
        """The SSE events this engine streams for ``request_id``, [DONE] last; with
        ``include_usage`` (the request's ``stream_options``) and ``cached_tokens``, a usage
        chunk before it, as vLLM sends one."""
        events = []
        for i in range(self.behaviour.chunks):
            choice = {"index": 0, "text": f"{self.name}-{i} ", "finish_reason": None}
            chunk = {"id": f"cmpl-{request_id}", "model": self.name, "choices": [choice]}
            events.append(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = self.usage()
        if include_usage and usage is not None:
            chunk = {"id": f"cmpl-{request_id}", "model": self.name, "choices": [], **usage}
            events.append(f"data: {json.dumps(chunk)}\n\n".encode())
        return [*events, b"data: [DONE]\n\n"]

    def usage(self) -> dict | None:
        if self.behaviour.cached_tokens is None:
            return None
        return {"usage": {"prompt_tokens_details": {"cached_tokens": self.behaviour.cached_tokens}}}

    def answer(self, request_id: str) -> dict:
        text = "".join(f"{self.name}-{i} " for i in range(self.behaviour.chunks))
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        answer = {"id": f"cmpl-{request_id}", "model": self.name, "choices": [choice]}
        return {**answer, **(self.usage() or {})}

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append(Received(request.path, request.headers.copy(), raw))
        self.in_flight += 1
        try:
            return await self._respond(request, raw)
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        behaviour = self.behaviour
        request_id = request.headers.get("X-Request-Id", "none")
        if behaviour.delay_s:
            await asyncio.sleep(behaviour.delay_s)
            if request.transport is None or request.transport.is_closing():
                self.abandoned_answers += 1
        if behaviour.status != 200:
            error = {"message": f"{self.name} says no", "type": "BadRequestError"}
            return web.json_response({"error": error}, status=behaviour.status)
        body = json.loads(raw)
        if not body.get("stream"):
            return web.json_response(self.answer(request_id))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for i, event in enumerate(self.events(request_id, include_usage)):
            if behaviour.cut_after is not None and i == behaviour.cut_after:
                request.transport.close()
                return response
            try:
                await response.write(event)
            except ConnectionResetError:
                self.abandoned_streams += 1
                return response
            if behaviour.chunk_delay_s:
                await asyncio.sleep(behaviour.chunk_delay_s)
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        if self.behaviour.models_delay_s:
            await asyncio.sleep(self.behaviour.models_delay_s)
        if self.behaviour.models_status != 200:
            error = {"message": f"{self.name} has no models", "type": "InternalServerError"}
            return web.json_response({"error": error}, status=self.behaviour.models_status)
        model = {"id": self.name, "object": "model", "owned_by": "kvtier-tests"}
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.received.append(Received(request.path, request.headers.copy(), raw))
        tokens = fake_tokens(json.loads(raw))
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=self.behaviour.health_status)


def fake_tokens(body: dict) -> list[int]:
    """A fake engine's token ids for a /tokenize body: the prompt's bytes (chat: the
    messages' contents joined by newlines)."""
    if "messages" in body:
        text = "\n".join(str(m.get("content", "")) for m in body["messages"])
    else:
        text = body["prompt"]
    return list(text.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--chunks", type=int, default=3)
    args = parser.parse_args()
    fake = FakeOpenAI(args.name, Behaviour(chunks=args.chunks)).start()
    print(fake.server.port, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
