"""The trainer's compute off the event loop (`relax.core.placement.compute_thread`)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from relax.core.placement.compute_thread import ComputeThread, OffLoopRole


class BlockingRole:
    """A role whose coroutine methods compute synchronously, as the in-process roles do."""

    def __init__(self):
        self.released = threading.Event()
        self.threads: list[int] = []

    async def train(self, samples: list[int]) -> float:
        self.threads.append(threading.get_ident())
        # Blocks its thread until the event loop sets the event: on the loop's own thread this never returns.
        released = self.released.wait(timeout=30)
        return float(sum(samples)) if released else float("nan")

    async def compute_log_probs(self, samples: list[int]) -> torch.Tensor:
        self.threads.append(threading.get_ident())
        return torch.tensor(samples, dtype=torch.float32).log()

    async def fail(self) -> None:
        raise ValueError("bad batch at row 3")

    def weight_buckets(self):
        yield threading.get_ident()

    name = "actor"


def test_the_event_loop_runs_while_a_role_computes():
    role = BlockingRole()
    thread = ComputeThread(torch.device("cpu"))
    loop_ticks = []

    async def producer():
        for _ in range(3):  # the producer's work, interleaved with the training step
            loop_ticks.append(threading.get_ident())
            await asyncio.sleep(0)
        role.released.set()

    async def scenario():
        result, _ = await asyncio.gather(OffLoopRole(role, thread).train([1, 2, 3]), producer())
        return result

    try:
        assert asyncio.run(scenario()) == 6.0
    finally:
        thread.close()
    assert len(loop_ticks) == 3 and role.threads[0] not in loop_ticks


def test_calls_run_in_order_on_one_thread_and_errors_propagate():
    role = BlockingRole()
    role.released.set()
    thread = ComputeThread(torch.device("cpu"))
    wrapped = OffLoopRole(role, thread)

    async def scenario():
        first = await wrapped.train([4])
        log_probs = await wrapped.compute_log_probs([1.0, 2.0])
        with pytest.raises(ValueError, match="row 3"):
            await wrapped.fail()
        return first, log_probs

    try:
        first, log_probs = asyncio.run(scenario())
    finally:
        thread.close()
    assert first == 4.0 and torch.allclose(log_probs, torch.tensor([1.0, 2.0]).log())
    assert len(set(role.threads)) == 1 and role.threads[0] != threading.get_ident()
    # Plain methods and attributes stay the role's own, on the caller's thread.
    assert next(wrapped.weight_buckets()) == threading.get_ident() and wrapped.name == "actor"


def test_the_gil_switch_interval_is_short_while_the_thread_exists_and_restored_after():
    """The trainer's thread beside the loop thread's engine: a 1 ms GIL switch interval (module doc: the convoy),
    never raised above what the process had, and given back on close."""
    import sys

    from relax.core.placement.compute_thread import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    try:
        for start in (0.005, 0.0002):
            sys.setswitchinterval(start)
            thread = ComputeThread(torch.device("cpu"))
            assert sys.getswitchinterval() == pytest.approx(min(start, SWITCH_INTERVAL_S), rel=0.01)  # (kept in µs)
            thread.close()
            assert sys.getswitchinterval() == pytest.approx(start, rel=0.01)
    finally:
        sys.setswitchinterval(before)
