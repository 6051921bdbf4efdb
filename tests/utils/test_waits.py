"""The suite's wait on other processes (`tests.support.waits`): what a failed wait says decides whether a CI failure
can be read, so it is checked with real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from tests.support.waits import wait_until, wait_until_async


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_wait_returns_what_the_condition_found_and_counts_an_unanswered_request_as_not_yet():
    answers = iter([None, 0, "", "found"])
    assert wait_until(lambda: next(answers), 10, "an answer", interval_s=0) == "found"
    calls = []

    def server_not_up_yet():
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("refused")
        return True

    assert wait_until(server_not_up_yet, 10, "the server", interval_s=0) is True


def test_a_process_that_ends_first_fails_the_wait_with_its_output():
    process = _python("import sys; print('the reason it ended', file=sys.stderr); sys.exit(3)")
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: False, 600, "the API", process=process)
    assert "exited (3) while waiting for the API" in str(failed.value)
    assert "the reason it ended" in str(failed.value)


def test_a_wait_past_its_bound_kills_the_process_and_shows_what_it_wrote(tmp_path):
    wrote = tmp_path / "wrote"
    process = _python("import pathlib, sys, time; print('still loading', file=sys.stderr, flush=True); "
                      f"pathlib.Path({str(wrote)!r}).touch(); time.sleep(600)")
    wait_until(wrote.exists, 600, "the process to write", process=process)
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: False, 1.0, "the model", process=process)
    assert "timed out after 1 s waiting for the model" in str(failed.value)
    assert "still loading" in str(failed.value) and process.poll() is not None


def test_the_async_wait_awaits_a_coroutine_condition_lets_the_loop_run_and_fails_past_its_bound():
    """Inside an event loop: the condition may be a coroutine function, a task scheduled beside the wait runs
    (the blocking wait would stall it), an unanswered request counts as not yet, and the bound fails with what."""
    async def scenario():
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, done.set)
        calls = []

        async def answer():
            calls.append(1)
            if len(calls) == 1:
                raise httpx.ConnectError("refused")
            return "found" if done.is_set() else None

        found = await wait_until_async(answer, 10, "an answer", interval_s=0.01)
        with pytest.raises(AssertionError, match="timed out after 0.05 s waiting for never"):
            await wait_until_async(lambda: False, 0.05, "never", interval_s=0.01)
        return found

    assert asyncio.run(scenario()) == "found"
