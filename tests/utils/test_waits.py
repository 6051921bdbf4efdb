"""The suite's wait on other processes (`tests.support.waits`): what a failed wait says decides whether a CI failure
can be read, so it is checked with real processes."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.support.waits import wait_until


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
