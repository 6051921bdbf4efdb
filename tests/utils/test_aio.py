"""`relax.utils.aio.cancel_and_wait` against a lost cancellation."""

from __future__ import annotations

import asyncio

from relax.utils.aio import cancel_and_wait


def test_a_task_whose_cancellation_is_lost_is_still_stopped():
    """The fully-async producer's pattern: a loop over wait_for. When the awaited future completes in the same loop
    iteration as cancel(), Python 3.11's wait_for returns its result and the loop goes on to wait again."""
    rounds: list[asyncio.Future] = []

    async def producer():
        loop = asyncio.get_running_loop()
        while True:
            slot = loop.create_future()
            rounds.append(slot)
            await asyncio.wait_for(slot, timeout=1e6)

    async def scenario():
        task = asyncio.create_task(producer())
        await asyncio.sleep(0)  # the producer waits in its first round
        rounds[-1].set_result(None)  # the slot opens ...
        await asyncio.wait_for(cancel_and_wait(task, retry_s=0.05), timeout=10)  # ... as the task is cancelled
        return task

    task = asyncio.run(scenario())
    assert task.cancelled()


def test_a_finished_or_failing_task_is_left_as_it_is():
    async def fails():
        raise ValueError("boom")

    async def scenario():
        done = asyncio.create_task(asyncio.sleep(0, result=7))
        failed = asyncio.create_task(fails())
        await asyncio.sleep(0.01)
        await cancel_and_wait(done)
        await cancel_and_wait(failed)  # the exception is retrieved, not raised
        return done, failed

    done, failed = asyncio.run(scenario())
    assert done.result() == 7 and isinstance(failed.exception(), ValueError)
