"""Stopping a background asyncio task: cancel it, then wait until it has ended."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel ``task`` and return once it has ended (at once if it had).

    NOTE: the task's own cancellation is not raised here, but the caller's is: a stop that
    is itself cancelled while the task winds down raises ``CancelledError`` (awaiting the
    task under ``suppress(CancelledError)`` would swallow it and go on as if not cancelled).

    Raises:
        Exception: what the task ended with, other than its cancellation.
        asyncio.CancelledError: the caller was cancelled while waiting.
    """
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.result()
