"""Run the proxy's application on an address until SIGTERM or SIGINT, then stop it
gracefully (the requests in flight may finish)."""

from __future__ import annotations

import asyncio
import logging
import signal

from kvtier.proxy.app import Proxy
from kvtier.web import start_app

logger = logging.getLogger("kvtier.proxy")


async def serve(proxy: Proxy, host: str, port: int, shutdown_grace_s: float) -> int:
    """Serve ``proxy`` on ``host:port`` until SIGTERM or SIGINT, then let the requests in
    flight finish for up to ``shutdown_grace_s``. Returns 0.

    Raises:
        OSError: the address cannot be bound.
    """
    # No access log: the proxy logs one line per request itself, with its request id.
    runner = await start_app(
        proxy.build_app(),
        host,
        port,
        shutdown_timeout_s=shutdown_grace_s,
        handler_cancellation=True,  # a client gone: its requests to the instances close
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bound_host, bound_port = runner.addresses[0][:2]
    logger.info("kvtier proxy listening on http://%s:%d", bound_host, bound_port)
    logger.info(
        "prefill: %s; decode: %s; policy %s",
        ", ".join(i.url for i in proxy.prefill.instances) or "none (decode alone)",
        ", ".join(i.url for i in proxy.decode.instances),
        proxy.settings.policy,
    )
    await stop.wait()
    logger.info("kvtier proxy stopping")
    await runner.cleanup()
    logger.info("kvtier proxy stopped")
    return 0
