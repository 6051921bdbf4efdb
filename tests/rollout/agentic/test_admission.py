"""Admission of agent programs by the engine's KV capacity (`relax.rollout.agentic.admission`,
``--agentic-program-admission``): 100 concurrent agent sessions on a real engine with a small KV pool keep the pool's
use under the ceiling, are admitted in arrival order and wait (counted) rather than overfill it; a pool full of other
work lets a program in after the maximum wait (a bypass, counted): admission fails open. A program whose budget
passes the ceiling reserves the ceiling: it goes in at once on an idle pool (it had waited the whole maximum)."""

from __future__ import annotations

import asyncio

import pytest

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.rollout.agentic.admission import ProgramAdmission, kv_capacity_of
from relax.rollout.agentic.agent_rollout import _admission
from relax.rollout.generation.context import GenerateArgs
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer

PAGE = 16
POOL_TOKENS = 2048


def _engine() -> EmbeddedEngine:
    return EmbeddedEngine(make_model(seed=0), make_tokenizer(),
                          core=CoreSettings(mode="on", page_size=PAGE, max_total_tokens=POOL_TOKENS))


def _params(tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)


async def _agent(engine, admission: ProgramAdmission, index: int, order: list[int], reserve: int) -> list[int]:
    """An agent session of two turns that keeps its K/V between them (as --agentic-session-lifecycle does)."""
    session = f"agent-{index}"
    async with admission.admit(reserve):
        order.append(index)
        prompt = [3 + (index * 7 + j) % 50 for j in range(30)]
        [first] = await engine.generate([GenerationRequest(f"{session}-t0", prompt, _params(10), session_id=session)])
        await asyncio.sleep(0.01)  # the agent's tool call between turns
        history = prompt + list(first.output_ids) + [5, 6, 7, 8, 9]
        [second] = await engine.generate([GenerationRequest(f"{session}-t1", history, _params(10),
                                                            session_id=session)])
        await engine.close_session(session)
        return list(first.output_ids) + list(second.output_ids)


def test_a_hundred_concurrent_sessions_stay_under_the_ceiling_in_arrival_order():
    engine = _engine()
    capacity = kv_capacity_of(RequestBatcher(engine))  # read through the batcher, as the rollout hands it
    # Each session holds at most 5 blocks (prompt + 2 answers + the new tokens, in two block tables while its second
    # turn runs): 96 reserved tokens cover it, and 100 of them need 4.7 pools: most must wait.
    reserve = 96
    admission = ProgramAdmission(capacity, headroom=0.90, pressure=0.92, max_wait_s=600, poll_s=0.01)
    idle = capacity.used()
    peak = 0

    async def main():
        nonlocal peak
        order: list[int] = []
        agents = [asyncio.create_task(_agent(engine, admission, i, order, reserve)) for i in range(100)]
        while not all(agent.done() for agent in agents):
            peak = max(peak, capacity.used())
            await asyncio.sleep(0)
        return order, [agent.result() for agent in agents]

    order, outputs = asyncio.run(main())
    assert all(len(tokens) == 20 for tokens in outputs)  # every session ran both turns
    assert order == list(range(100))  # first come, first admitted
    assert peak <= 0.90 * capacity.total(), (peak, capacity.total())
    assert peak > 0.5 * capacity.total()  # and the pool was used, not starved
    stats = admission.stats
    assert stats.admitted == 100 and stats.waited > 50 and stats.bypassed == 0 and stats.wait_s > 0
    assert stats.peak_reserved_tokens <= 0.90 * capacity.total()
    assert capacity.used() == idle and admission.reserved == 0 and engine.pinned_sessions == 0


def test_admission_fails_open_after_the_maximum_wait():
    engine = _engine()
    capacity = kv_capacity_of(engine)
    admission = ProgramAdmission(capacity, max_wait_s=0.3, poll_s=0.01)

    async def main():
        order: list[int] = []
        # larger than the ceiling: it reserves the ceiling, and goes in at once on the idle pool
        too_big = await _agent(engine, admission, 0, order, reserve=10 * POOL_TOKENS)
        assert admission.reserved == 0 and admission.stats.waited == 0 and admission.stats.bypassed == 0
        # a pool kept above the pressure line by K/V held elsewhere (pinned sessions of no admitted program)
        for index in range(30):
            [_] = await engine.generate([GenerationRequest(f"held-{index}", [3 + index] * 58, _params(4),
                                                           session_id=f"held-{index}")])
        used = capacity.used() / capacity.total()
        pressed = await _agent(engine, admission, 1, order, reserve=64)
        return too_big, used, pressed

    too_big, used, pressed = asyncio.run(main())
    assert len(too_big) == len(pressed) == 20
    assert used >= 0.92
    assert admission.stats.bypassed == 1 and admission.stats.waited == 1


def test_an_engine_whose_pool_cannot_be_read_admits_every_program_at_once():
    admission = ProgramAdmission(None)

    async def main():
        async with admission.admit(10**9) as admitted:
            return admitted

    admitted = asyncio.run(main())
    assert admitted.wait_s == 0 and not admitted.bypassed and admission.stats.admitted == 1


def test_the_rollout_builds_admission_from_the_flags_and_refuses_thresholds_without_it():
    engine = _engine()
    cfg = parse_config(["--agentic-program-admission", "--agentic-admission-headroom", "0.5",
                        "--agentic-admission-max-wait", "7"])

    # what a per-sample generate function receives: the config's fields and the (batched) engine
    admission = _admission(GenerateArgs(cfg, RequestBatcher(engine), engine.tokenizer))
    assert admission.capacity is not None and admission.headroom == 0.5 and admission.max_wait_s == 7
    assert admission.capacity.total() == (engine.core.blocks.num_blocks - 1) * PAGE
    with pytest.raises(ConfigError, match="--agentic-admission-pressure needs --agentic-program-admission"):
        parse_config(["--agentic-admission-pressure", "0.8"])
