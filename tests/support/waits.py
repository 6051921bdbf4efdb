"""How tests wait for what another thread or process does: a bounded poll whose bound is a hang guard, never a
speed check.

The suite runs three workers on two cores beside Ray clusters that each start several processes, and the same
tests have taken five to seven times as long there as alone (the Serve rollout test: 48 s alone, 268-355 s in the
suite). A wait for a process to start, load a model or train a step therefore waits `PROCESS_PATIENCE_S`, as a
subprocess gets `tests.support.runs.SUBPROCESS_TIMEOUT_S`: a loaded machine slows such a test down and never fails
it, and a hung one still ends. A wait watching a process fails at once, with the process's output, when the
process ends first, and with its output when the bound passes (the process is killed then, to read it).
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

PROCESS_PATIENCE_S = 900.0  # a process starting, loading a model, serving, training a few steps
OUTPUT_TAIL_CHARS = 4000


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "condition", *,
               process: Any = None, interval_s: float = 0.01) -> T:
    """Poll ``condition`` until it returns something true, and return that. A condition raising
    `httpx.TransportError` counts as not yet (a server not listening yet). With ``process`` (`subprocess.Popen` or
    `tests.support.runs.ForkedRelax`), fails as soon as it exits, with its output."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except httpx.TransportError:
            value = None
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process exited ({process.returncode}) while waiting for {what}:\n"
                                 f"{output_tail(process)}")
        if time.monotonic() > deadline:
            if process is None:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            process.kill()
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; the process, killed:\n"
                                 f"{output_tail(process)}")
        time.sleep(interval_s)



async def wait_until_async(condition: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition", *,
                           interval_s: float = 0.02) -> Any:
    """`wait_until` inside an event loop, which the blocking one would stall: ``condition`` may be a coroutine
    function (awaited at each poll); the loop runs between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except httpx.TransportError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)

def output_tail(process: Any) -> str:
    """The end of an ended process's stderr (or of its stdout where stderr goes there)."""
    try:
        stdout, stderr = process.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError, OSError) as error:  # still running, or its pipes already read
        return f"(no output: {error})"
    return (stderr or stdout or "")[-OUTPUT_TAIL_CHARS:]
