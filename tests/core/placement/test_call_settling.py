"""Calls that meet in one collective name the process that died, not the survivor that noticed
(`relax.core.placement.ray.proxies.settle_calls`).

A killed process makes its collective peers fail as well (gloo's "connection closed by peer"), often before Ray
reports the death; the run's error must name the dead role (the chaos test's attribution)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.core.placement.ray.proxies import RoleDiedError, named_call, settle_calls

GRACE_S = 0.2
HANG_S = 30.0  # longer than any test waits: a call that never settles on its own


async def _outcome(kind: str, delay: float, index: int, finished: set | None = None):
    await asyncio.sleep(HANG_S if kind == "hang" else delay)
    if finished is not None:
        finished.add(index)
    if kind == "error":
        raise RuntimeError(f"call {index}: connection closed by peer")
    if kind == "death":
        raise RoleDiedError(f"the role {index}'s Ray process died")
    return index


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ok", "error", "death", "hang"]), st.sampled_from([0.0, 0.02, 0.1])),
                min_size=1, max_size=4))
def test_a_death_among_the_calls_is_raised_before_its_peers_errors(calls):
    """Whatever the order the outcomes arrive in: all well, the results in order; one failure, a death among the
    calls that settle within the grace (it explains its peers' errors), else the first failure; never a wait past
    the grace for a call still hanging."""
    failures = [(delay, kind, i) for i, (kind, delay) in enumerate(calls) if kind in ("error", "death")]
    hangs = any(kind == "hang" for kind, _ in calls)
    if hangs and not failures:
        return  # a collective that never settles and never fails is the caller's timeout's business

    finished: set[int] = set()

    async def run():
        try:
            return await settle_calls([_outcome(kind, delay, i, finished) for i, (kind, delay) in enumerate(calls)],
                                      grace_s=GRACE_S), None
        except (RuntimeError, RoleDiedError) as err:
            return None, err

    results, error = asyncio.run(run())
    if not failures:
        assert results == list(range(len(calls)))
        return
    first = min(failures)[0]
    # bounded by the grace after the first failure: no hanging call was waited out
    assert not finished & {i for i, (kind, _) in enumerate(calls) if kind == "hang"}
    deaths = [i for delay, kind, i in failures if kind == "death" and delay <= first + GRACE_S]
    if deaths:
        assert isinstance(error, RoleDiedError) and any(f"role {i}'s" in str(error) for i in deaths), error
    else:
        assert isinstance(error, RuntimeError) and not isinstance(error, RoleDiedError)


def test_cancelling_the_caller_leaves_no_waiting_call_behind():
    async def run():
        waits = [_outcome("hang", 0, 0), _outcome("hang", 0, 1)]
        task = asyncio.ensure_future(settle_calls(waits, grace_s=GRACE_S))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(run()) == []


class Sender:
    """Waits for its peer's bytes on a socket, as a broadcast's sender waits on its receiver."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))

    def port(self) -> int:
        return self.server.getsockname()[1]

    def send(self) -> str:
        connection, _ = self.server.accept()
        if not connection.recv(1):
            raise RuntimeError("[gloo] connection closed by peer")
        return "sent"


class Receiver:
    def receive(self, port: int) -> str:
        connection = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.05)  # the sender is waiting on this connection: the peer dies mid-collective
        os.kill(os.getpid(), signal.SIGKILL)
        connection.sendall(b"x")
        return "received"


@pytest.mark.xdist_group("ray")
def test_a_real_process_killed_mid_collective_is_named_rather_than_its_peers_error():
    """Real Ray processes and a real SIGKILL: the sender's error (the peer closed its socket) surfaces at once,
    the receiver's death a moment later through Ray; the call names the receiver's role."""
    ray = pytest.importorskip("ray")
    from relax.utils.local_ray import start_local_ray

    start_local_ray(num_cpus=2)
    try:
        sender = ray.remote(num_cpus=0)(Sender).remote()
        receiver = ray.remote(num_cpus=0, max_restarts=0)(Receiver).remote()
        port = ray.get(sender.port.remote(), timeout=60)

        async def broadcast():
            return await settle_calls([named_call("actor", sender.send.remote()),
                                       named_call("rollout", receiver.receive.remote(port))])

        with pytest.raises(RoleDiedError, match="the rollout role's Ray process died"):
            asyncio.run(asyncio.wait_for(broadcast(), 60))
    finally:
        ray.shutdown()
