"""The proxy's health probe: every ``min(retry_after_s, 1 s)``, GET ``/health`` of each
instance marked down whose retry delay has passed; ``200`` brings it back up, anything
else keeps it down for another delay (not counted as a failed request).

NOTE: an instance is probed only while marked down. One that dies while up is found by
the next request that picks it (a connection error marks it down).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvtier.proxy.instances import Instance, Pool
from kvtier.proxy.messages import describe_error
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger("kvtier.proxy")


class HealthProbe:
    """Probes the down instances of ``pools`` through ``session`` from ``start()`` to
    ``stop()``; each probe's whole time is at most ``timeout``."""

    def __init__(self, pools: list[Pool], retry_after_s: float, timeout: aiohttp.ClientTimeout):
        self.pools = pools
        self.interval_s = max(min(retry_after_s, 1.0), 0.05)
        self.timeout = timeout
        self._task: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._loop(session))

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            due = [
                (pool, instance)
                for pool in self.pools
                for instance in pool.down()
                if instance.eligible(pool.clock())
            ]
            if due:
                await asyncio.gather(*(self._probe(session, pool, i) for pool, i in due))

    async def _probe(self, session: aiohttp.ClientSession, pool: Pool, instance: Instance) -> None:
        try:
            async with session.get(instance.url + "/health", timeout=self.timeout) as response:
                await response.read()
                healthy = response.status == 200
                error = f"health probe: HTTP {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            healthy, error = False, f"health probe: {describe_error(exc)}"
        if not instance.is_down:
            return  # a request brought it back meanwhile
        if healthy:
            pool.mark_up(instance)
            logger.info("%s instance %s is back up", pool.role, instance.url)
        else:
            pool.mark_down(instance, error, count=False)
