"""``kvtier.tasks.cancel_and_wait``: a background task's stop, which ends the task, raises
what the task failed with, and never swallows the stopper's own cancellation."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.tasks import cancel_and_wait


async def forever() -> None:
    await asyncio.Event().wait()


def test_a_running_task_is_cancelled_and_ended():
    async def main() -> asyncio.Task:
        task = asyncio.create_task(forever())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task

    assert asyncio.run(main()).cancelled()


def test_a_task_that_failed_raises_its_error_and_an_ended_one_returns():
    async def fail() -> None:
        raise RuntimeError("the subscriber broke")

    async def main() -> None:
        failed = asyncio.create_task(fail())
        done = asyncio.create_task(asyncio.sleep(0))
        await asyncio.sleep(0.01)
        await cancel_and_wait(done)
        with pytest.raises(RuntimeError, match="the subscriber broke"):
            await cancel_and_wait(failed)

    asyncio.run(main())


def test_the_stoppers_own_cancellation_is_raised():
    async def slow_to_stop(started: asyncio.Event) -> None:
        try:
            await forever()
        finally:
            started.set()
            await asyncio.sleep(10)  # cleanup that outlasts the stopper's patience

    async def main() -> tuple[bool, asyncio.Task]:
        started = asyncio.Event()
        task = asyncio.create_task(slow_to_stop(started))
        await asyncio.sleep(0)
        stopper = asyncio.create_task(cancel_and_wait(task))
        await started.wait()
        stopper.cancel()
        try:
            await stopper
        except asyncio.CancelledError:
            cancelled = True
        else:
            cancelled = False
        task.cancel()
        await asyncio.wait([task])
        return cancelled, task

    cancelled, task = asyncio.run(main())
    assert cancelled, "a cancelled stop goes on as if it had not been"
    assert task.done()
