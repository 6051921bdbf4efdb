"""asyncio helpers."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task, *, retry_s: float = 0.5, max_attempts: int = 120) -> None:
    """Cancel ``task`` and wait until it has finished, cancelling again while it has not.

    One ``cancel()`` can be lost: Python 3.11's ``asyncio.wait_for`` returns the inner result instead of raising
    when the inner future completes in the same loop iteration as the cancellation (CPython gh-86296, fixed in
    3.12). A task that loops over ``wait_for`` (the fully-async rollout producer waiting for a staleness slot) then
    carries on, and a single ``await`` of it can wait forever. Its exception, if any, is retrieved and dropped.
    """
    for _ in range(max_attempts):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.done():
        raise RuntimeError(f"task {task.get_name()} still runs after {max_attempts} cancellations")
    if not task.cancelled():
        task.exception()
