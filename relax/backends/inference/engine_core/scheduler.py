"""Which sequences run in the next step: continuous batching over a paged KV pool (`Scheduler`), or over the
model's own cache (`CohortScheduler`, the cache runner's).

Requests join the waiting queue at any time and leave when they finish or are aborted; every step is either a
*prefill* (new sequences' prompts, packed, within a token budget) or a *decode* (one token for every running
sequence). Waiting sequences are admitted first, between decode steps, as long as

- fewer than ``max_running`` sequences run,
- their prompt tokens still to compute fit the step's budget ``max_prefill_tokens`` (a single prompt longer than
  the budget runs in a step of its own), and
- the pool has blocks for their prompt plus ``reserve_tokens`` slots of growth (so that admitted sequences do not
  at once preempt each other).

A decode step needs one free slot per running sequence (lengths count a token sampled on the device that the
host has not read yet, `Sequence.num_tokens`); when the pool runs out, the youngest running sequence
is preempted: its blocks are freed and it goes back to the front of the waiting queue with every token it has
(prompt and outputs), to be prefilled again (recomputed) when blocks free up. Its outputs so far are kept.

Agent sessions. A finished sequence's blocks are keyed by their tokens (`BlockManager.key_prefix`), so a next turn
that extends them prefills only its new tokens while the blocks are still in the pool. A request of a session
(``GenerationRequest.session_id``) goes further: its finished blocks stay held for the session (pinned; the
previous turn's are let go) until `release_session`, or until the session has been idle ``session_idle_s``
(`release_idle_sessions`). When the pool runs short, pinned sessions are let go, least recently used first, before
any running sequence is preempted: a pin keeps K/V that is likely to be used again, never blocks live work.
"""

from __future__ import annotations

import operator
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from relax.backends.inference.engine_core.block_manager import BlockManager
from relax.backends.inference.engine_core.sequence import Sequence, SequenceStatus

_arrival = operator.attrgetter("arrival")


def pool_refusal(request_id: str, prompt_tokens: int, max_sequence_tokens: int | None) -> str | None:
    """Why a prompt of ``prompt_tokens`` can never run in a pool of ``max_sequence_tokens`` slots, or None."""
    if max_sequence_tokens is not None and prompt_tokens >= max_sequence_tokens:
        return (f"request {request_id!r}: {prompt_tokens} prompt tokens leave no room for an answer in the engine's "
                f"KV pool of {max_sequence_tokens} token slots (--max-total-tokens)")
    return None


@dataclass
class Step:
    """One step's work: ``prefill`` sequences (each computes tokens ``num_cached..len``) or ``decode`` ones."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy) blocks to copy before the step

    @property
    def sequences(self) -> list[Sequence]:
        return self.prefill or self.decode


@dataclass
class _Pin:
    block_table: list[int]
    last_used: float


class Scheduler:
    def __init__(self, blocks: BlockManager, max_running: int, max_prefill_tokens: int,
                 reserve_tokens: int = 0, session_idle_s: float = 300.0) -> None:
        if max_running < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_running {max_running} and max_prefill_tokens {max_prefill_tokens} must be >= 1")
        self.blocks = blocks
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.reserve_tokens = reserve_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.session_idle_s = session_idle_s
        self.pinned: OrderedDict[str, _Pin] = OrderedDict()  # by session id, least recently used first
        self.sessions_evicted = 0  # pins let go for room before their session ended

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens one sequence can hold: the whole pool but its reserved block. The engine ends a sequence
        there with "length", as at the model's last position (SGLang caps max_new_tokens at its pool alike)."""
        return (self.blocks.num_blocks - 1) * self.blocks.block_size

    def refusal(self, sequence: Sequence) -> str | None:
        """Why ``sequence`` can never run here (its prompt fills the pool), or None."""
        return pool_refusal(sequence.request_id, len(sequence), self.max_sequence_tokens)

    def add(self, sequence: Sequence) -> None:
        if (problem := self.refusal(sequence)) is not None:
            raise ValueError(problem)
        self.waiting.append(sequence)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        if self.pinned:
            self.release_idle_sessions()
        step = Step(prefill=self._admit())
        if step.prefill:
            return step
        step.decode, step.preempted, step.copies = self._decode_set()
        return step

    def finish(self, sequences: Iterable[Sequence]) -> None:
        """Release the blocks of finished (or aborted) sequences, running or waiting: keyed for a next turn, and
        held for the sequence's session if it has one."""
        done = {id(s) for s in sequences}
        for sequence in [s for s in self.running if id(s) in done]:
            self.running.remove(sequence)
            if sequence.cache_generation == self.blocks.generation and sequence.block_table:
                self.blocks.key_prefix(sequence.block_table, sequence.cache_tokens, sequence.num_cached)
                session = sequence.request.session_id
                if session is not None and sequence.finish_reason != "abort":
                    self.release_session(session)
                    self.pinned[session] = _Pin(sequence.block_table, time.monotonic())
                    sequence.block_table, sequence.num_cached = [], 0
                    continue
            self._release(sequence)
        self.waiting = deque(s for s in self.waiting if id(s) not in done)
        for sequence in sequences:
            sequence.status = SequenceStatus.FINISHED

    # ---- sessions ------------------------------------------------------------------------
    def release_session(self, session_id: str) -> int:
        """Let go of the session's pinned blocks (its K/V stays keyed until the blocks are reused); how many."""
        pin = self.pinned.pop(session_id, None)
        if pin is None:
            return 0
        self.blocks.free(pin.block_table)
        return len(pin.block_table)

    def release_idle_sessions(self, now: float | None = None) -> list[str]:
        """Let go of the sessions idle for ``session_idle_s`` or more; their ids."""
        now = time.monotonic() if now is None else now
        idle = []
        for session, pin in self.pinned.items():  # least recently used first: the idle ones lead
            if now - pin.last_used < self.session_idle_s:
                break
            idle.append(session)
        for session in idle:
            self.release_session(session)
        return idle

    def release_all_sessions(self) -> None:
        for session in list(self.pinned):
            self.release_session(session)

    @property
    def pinned_blocks(self) -> int:
        return sum(len(pin.block_table) for pin in self.pinned.values())

    def _evict_a_session(self) -> bool:
        """Let go of the least recently used session's blocks to make room; False when none is pinned."""
        if not self.pinned:
            return False
        self.release_session(next(iter(self.pinned)))
        self.sessions_evicted += 1
        return True

    # ---- internals -----------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        leaders: dict[tuple[int, ...], Sequence] = {}  # prompts admitted this step, by their tokens
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running:
            sequence = self.waiting[0]
            share = sequence.num_outputs == 0  # a recomputed sequence's outputs are not a prompt to share
            prompt = sequence.cache_tokens if share else sequence.token_ids
            # Room to grow, no more than it ever will: a prompt within a reserve of its pool's end never fit with a
            # whole reserve, and waited at the head of the queue, every request behind it too, for good.
            reserve = min(self.reserve_tokens, max(sequence.length_limit - len(prompt), 0)) if share else 0
            leader = leaders.get(tuple(prompt)) if share else None
            if leader is not None:  # a sample of a prompt prefilled this step: its blocks and logits
                if self.blocks.num_free < self.blocks.blocks_for(reserve):
                    break
                self.waiting.popleft()
                sequence.block_table, sequence.num_cached = self.blocks.fork(leader.block_table), len(prompt)
                sequence.prefill_twin_of = leader
                sequence.cache_generation = self.blocks.generation
            else:
                while not self.blocks.can_allocate(prompt, reserve, share=share) and self._evict_a_session():
                    pass
                if not self.blocks.can_allocate(prompt, reserve, share=share):
                    break
                cached = self.blocks.cached_prefix_blocks(prompt) if share else 0
                to_compute = len(prompt) - cached * self.blocks.block_size
                if admitted and to_compute > budget:
                    break
                self.waiting.popleft()
                sequence.block_table, sequence.num_cached = self.blocks.allocate(prompt, share=share)
                sequence.prefill_twin_of = None
                sequence.cache_generation = self.blocks.generation
                budget -= to_compute
                if share:
                    leaders[tuple(prompt)] = sequence
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
        return admitted

    def _decode_set(self) -> tuple[list[Sequence], list[Sequence], list[tuple[int, int]]]:
        preempted: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        page, refcount = self.blocks.block_size, self.blocks.refcount
        self.running.sort(key=_arrival)  # in place: already in order but after a preempted sequence's return
        for sequence in self.running:
            if sequence.status is not SequenceStatus.RUNNING:
                continue  # preempted below to make room for an older one
            num_tokens = len(sequence.token_ids) + sequence.pending
            if num_tokens >= sequence.length_limit:
                continue  # its last token is on the way: it finishes when the host reads it
            table, index = sequence.block_table, (num_tokens - 1) // page
            if index < len(table) and refcount[table[index]] == 1:
                continue  # the newest token's slot is in a block of its own already (most steps)
            while not self._has_slot(sequence):
                if self._evict_a_session():
                    continue
                victim = max((s for s in self.running if s.status is SequenceStatus.RUNNING and s is not sequence),
                             key=_arrival, default=None)
                if victim is None:
                    raise RuntimeError(f"the KV pool cannot hold request {sequence.request_id!r} alone")
                self._preempt(victim)
                preempted.append(victim)
            copy = self.blocks.append_slot(sequence.block_table, sequence.num_tokens)
            if copy is not None:
                copies.append(copy)
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        decoding = [s for s in self.running
                    if len(s.token_ids) + s.pending < s.length_limit]
        return decoding, preempted, copies

    def _has_slot(self, sequence: Sequence) -> bool:
        """A free block is needed when the newest token opens a block, or lands in a block held with others."""
        index = (sequence.num_tokens - 1) // self.blocks.block_size
        own = index < len(sequence.block_table) and self.blocks.refcount[sequence.block_table[index]] == 1
        return own or self.blocks.num_free > 0

    def _preempt(self, sequence: Sequence) -> None:
        self.preemptions += 1
        self._release(sequence)
        sequence.status = SequenceStatus.WAITING
        self.waiting.appendleft(sequence)

    def _release(self, sequence: Sequence) -> None:
        if sequence.block_table:
            self.blocks.free(sequence.block_table)
        sequence.block_table, sequence.num_cached = [], 0


class CohortScheduler:
    """The cache runner's scheduling (`cache_runner`): the same steps over the model's own cache, which has no
    pool to count. Waiting sequences are admitted, up to ``max_running`` running ones, as one prefill step (a
    cohort); otherwise every running sequence decodes. Nothing is preempted: the cache grows as the model's does,
    and running out of memory is the engine's in-place recovery's to handle."""

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    max_sequence_tokens = None  # the model's own cache grows as it needs

    def refusal(self, sequence: Sequence) -> str | None:
        return None

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            sequence = self.waiting.popleft()
            sequence.status = SequenceStatus.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
        if admitted:
            return Step(prefill=admitted)
        decoding = [s for s in self.running if len(s.token_ids) + s.pending < s.length_limit]
        return Step(decode=sorted(decoding, key=lambda s: s.arrival))

    def finish(self, sequences: Iterable[Sequence]) -> None:
        """Take finished (or aborted) sequences out, running or waiting; a cohort's cache goes with its last one."""
        sequences = list(sequences)
        done = {id(s) for s in sequences}
        self.running = [s for s in self.running if id(s) not in done]
        self.waiting = deque(s for s in self.waiting if id(s) not in done)
        for sequence in sequences:
            sequence.status = SequenceStatus.FINISHED
            sequence.cohort = None
