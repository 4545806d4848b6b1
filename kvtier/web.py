"""What kvtier's two HTTP servers (``kvtier serve``'s admin API and ``kvtier proxy``) share
on aiohttp: starting an application on an address, and the bearer-token check."""

from __future__ import annotations

import hmac

from aiohttp import web


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
    cancelled when its client disconnects.

    Raises:
        OSError: the address cannot be bound.
    """
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        handler_cancellation=handler_cancellation,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def has_bearer_token(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>`` (compared in constant
    time)."""
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode())
