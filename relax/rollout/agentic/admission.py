"""Admission of agent programs by the engines' KV capacity (``--agentic-program-admission``, upstream's semantics).

A step may start hundreds of agent programs at once; each holds a growing context for minutes. Started all at once
they overfill the KV pool, and the engine then preempts and recomputes running requests over and over. Admission
keeps a FIFO ledger of token reservations instead: a program is admitted when

- the reservations of the programs running, plus its own, stay within ``headroom`` (0.90) of the pool's tokens, and
- the pool's actual use is below ``pressure`` (0.92) of it (K/V held beyond the reservations: other requests,
  sessions' kept K/V);

otherwise it waits, in arrival order (a program never overtakes an earlier one). A program that waited
``max_wait_s`` (30 s) is admitted anyway and counted as a bypass: admission fails open, it never deadlocks a step (a
pool that stays full of other work). An engine whose pool cannot be read (one in another process) admits everything.
The reservation of a program is its context budget (``--rollout-max-context-len``, else the prompt plus one response
length), at most the ceiling: no program can hold more, and a larger reservation had never fitted, so each such
program waited the whole ``max_wait_s`` even on an idle pool, one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCapacity:
    """An engine's KV pool in tokens: ``total()`` and ``used()`` now."""

    total: Callable[[], int]
    used: Callable[[], int]


def kv_capacity_of(engine) -> KVCapacity | None:
    """The KV pool of an in-process engine (through a `RequestBatcher`); None when it cannot be read."""
    engine = getattr(engine, "engine", engine)  # a RequestBatcher's engine
    blocks = getattr(getattr(engine, "core", None), "blocks", None)
    if blocks is None:
        return None
    usable = blocks.num_blocks - 1  # block 0 is never handed out
    return KVCapacity(total=lambda: usable * blocks.block_size,
                      used=lambda: (usable - blocks.num_free) * blocks.block_size)


@dataclass
class Admitted:
    """How one program got in: after ``wait_s`` seconds, past ``max_wait_s`` (``bypassed``) or not."""

    wait_s: float = 0.0
    bypassed: bool = False


@dataclass
class AdmissionStats:
    admitted: int = 0
    waited: int = 0  # admitted after waiting
    wait_s: float = 0.0
    bypassed: int = 0  # admitted past max_wait_s
    peak_reserved_tokens: int = 0


class ProgramAdmission:
    """The FIFO token ledger of the module doc."""

    def __init__(self, capacity: KVCapacity | None, headroom: float = 0.90, pressure: float = 0.92,
                 max_wait_s: float = 30.0, poll_s: float = 0.05) -> None:
        if not 0 < headroom <= 1 or not 0 < pressure <= 1:
            raise ValueError(f"headroom {headroom} and pressure {pressure} must be in (0, 1]")
        self.capacity = capacity
        self.headroom, self.pressure, self.max_wait_s, self.poll_s = headroom, pressure, max_wait_s, poll_s
        self.reserved = 0
        self.stats = AdmissionStats()
        self._queue: deque[object] = deque()
        self._changed = asyncio.Event()

    def _fits(self, tokens: int) -> bool:
        total = self.capacity.total()
        return (self.reserved + tokens <= self.headroom * total
                and self.capacity.used() < self.pressure * total)

    @contextlib.asynccontextmanager
    async def admit(self, tokens: int) -> AsyncIterator[Admitted]:
        """Inside: the program runs with ``tokens`` reserved (at once when there is room, else after its turn in
        the queue, at most ``max_wait_s``)."""
        if self.capacity is None:
            self.stats.admitted += 1
            yield Admitted()
            return
        tokens = min(tokens, int(self.headroom * self.capacity.total()))  # (the module doc)
        ticket = object()
        self._queue.append(ticket)
        started, waited, admitted = time.monotonic(), False, Admitted()
        try:
            while not (self._queue[0] is ticket and self._fits(tokens)):
                waited = True
                if time.monotonic() - started >= self.max_wait_s:
                    self.stats.bypassed += 1
                    admitted.bypassed = True
                    break
                self._changed.clear()
                # woken by a release; polled too, since the pool's use changes with every engine step
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.poll_s)
        finally:
            self._queue.remove(ticket)
            self._changed.set()  # the next in line may fit now
        if waited:
            admitted.wait_s = time.monotonic() - started
            self.stats.waited += 1
            self.stats.wait_s += admitted.wait_s
        self.stats.admitted += 1
        self.reserved += tokens
        self.stats.peak_reserved_tokens = max(self.stats.peak_reserved_tokens, self.reserved)
        try:
            yield admitted
        finally:
            self.reserved -= tokens
            self._changed.set()
