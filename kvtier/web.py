"""What kvtier's two HTTP servers (``kvtier serve``'s admin API and ``kvtier proxy``) share
on aiohttp: starting an application on an address, and the bearer-token check."""

from __future__ import annotations

import hmac
import os

from aiohttp import web

# How long a connection may stay open without a request in progress: before its first
# request (or while its headers trickle in) and between requests. aiohttp's own default
# is an hour, which lets anyone who reaches the port hold a file descriptor of the
# process per connection for that long (a kvtier serve shares them with its cache port
# and its disk). Above the 60 s a load balancer commonly keeps an idle connection.
IDLE_CONNECTION_S = 75.0


async def start_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout_s: float,
    handler_cancellation: bool = False,
) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (0: any free port) from the running event loop.
    Returns the runner: its ``addresses`` say where it listens, and ``cleanup()`` stops
    it, letting requests in flight finish for up to ``shutdown_timeout_s``. No access
    log: each server logs what it wants itself. ``handler_cancellation``: a handler is
    cancelled when its client disconnects. A connection without a request in progress
    for ``IDLE_CONNECTION_S`` is closed.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        handler_cancellation=handler_cancellation,
        keepalive_timeout=IDLE_CONNECTION_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        reason = os.strerror(error.errno) if (error.errno or 0) > 0 else error.strerror or error
        raise OSError(error.errno, f"cannot listen on {host} port {port}: {reason}") from None
    return runner


def has_bearer_token(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (compared in constant
    time)."""
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode())
