"""Agent sessions in the engine core (`engine_core.scheduler`, `BlockManager.key_prefix`): a session's next turn
prefills only its new tokens; its K/V is let go when the session closes (explicitly, at the episode's end through
the gateway, after an idle timeout), on a weight update, and under pool pressure before any running request is
preempted; the pool then returns to its idle level. Real tiny engine on CPU, paged runner."""

from __future__ import annotations

import asyncio

import pytest

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from tests.backends.inference.test_embedded_engine import make_model, make_tokenizer

PAGE = 16


def _engine(**settings) -> EmbeddedEngine:
    return EmbeddedEngine(make_model(seed=0), make_tokenizer(), core=CoreSettings(mode="on", page_size=PAGE,
                                                                                  **settings))


def _turn(engine, tokens: list[int], session: str | None, new_tokens: int = 12, name: str = "t"):
    request = GenerationRequest(name, list(tokens), SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                                                   ignore_eos=True), session_id=session)
    before = engine.core.runner.prefill_tokens
    [output] = asyncio.run(engine.generate([request]))
    return output, engine.core.runner.prefill_tokens - before


def _prompt(offset: int, length: int = 40) -> list[int]:
    return [3 + (offset + 7 * i) % 50 for i in range(length)]


def _free(engine) -> int:
    return engine.core.blocks.num_free


@pytest.mark.parametrize("session", [None, "agent-1"])
def test_a_next_turn_prefills_only_its_new_tokens(session):
    """Turn 1: 40 prompt tokens + 12 answered; turn 2 sends those 52 and 6 new ones. The first 48 (three full
    blocks, K/V written by turn 1's prefill and decode) are taken from the pool: 10 tokens are computed, not 58
    (without keying the answer's blocks it would be 26: only the prompt's two full blocks were shared)."""
    engine = _engine()
    first, computed_1 = _turn(engine, _prompt(0), session)
    assert computed_1 == 40
    history = _prompt(0) + list(first.output_ids) + [5, 6, 7, 8, 9, 10]
    second, computed_2 = _turn(engine, history, session, name="t2")
    assert computed_2 == len(history) - 3 * PAGE == 10
    # the same answer as a cold engine computing the whole history
    cold, computed_cold = _turn(_engine(), history, None, name="cold")
    assert computed_cold == len(history)
    assert second.output_ids == cold.output_ids
    assert second.output_log_probs == pytest.approx(cold.output_log_probs, abs=1e-4)


def test_a_pinned_session_survives_other_traffic_and_is_let_go_when_it_closes():
    engine = _engine(max_total_tokens=512)  # 32 blocks
    idle = _free(engine)
    first, _ = _turn(engine, _prompt(0), "agent-1")
    assert engine.pinned_sessions == 1 and _free(engine) == idle - engine.core.scheduler.pinned_blocks
    # other requests churn through the free blocks; the pinned ones are not theirs to take
    for index in range(6):
        _turn(engine, _prompt(100 + index * 11), None, name=f"other-{index}")
    history = _prompt(0) + list(first.output_ids) + [5, 6]
    _, computed = _turn(engine, history, "agent-1", name="t2")
    assert computed == len(history) - 3 * PAGE
    asyncio.run(engine.close_session("agent-1"))
    assert engine.pinned_sessions == 0 and _free(engine) == idle


def test_an_idle_session_is_let_go_without_any_further_request():
    engine = _engine(session_idle_s=0.3)
    idle = _free(engine)

    async def turn_then_wait():
        request = GenerationRequest("t", _prompt(0), SamplingParams(max_new_tokens=4, temperature=0.0),
                                    session_id="agent-1")
        await engine.generate([request])
        pinned = engine.pinned_sessions
        await asyncio.sleep(1.0)  # the engine's own timer, no request
        return pinned

    assert asyncio.run(turn_then_wait()) == 1
    assert engine.pinned_sessions == 0 and _free(engine) == idle


def test_a_weight_update_lets_every_session_go_and_nothing_stale_is_reused():
    engine = _engine()
    idle = _free(engine)
    first, _ = _turn(engine, _prompt(0), "agent-1")
    weights = dict(make_model(seed=1).named_parameters())
    asyncio.run(engine.update_weights(weights.items(), version=1))
    assert engine.pinned_sessions == 0 and _free(engine) == idle
    history = _prompt(0) + list(first.output_ids) + [5, 6]
    _, computed = _turn(engine, history, "agent-1", name="t2")
    assert computed == len(history)  # computed afresh with the new weights


def test_sessions_share_only_what_is_the_same_token_for_token():
    engine = _engine()
    first, _ = _turn(engine, _prompt(0), "agent-1")
    other = _prompt(0)[:32] + _prompt(9)[32:]  # the same first two blocks, then different
    _, computed = _turn(engine, other + list(first.output_ids), "agent-2", name="b")
    assert computed == len(other) + len(first.output_ids) - 2 * PAGE


def test_pinned_sessions_give_way_before_any_running_request_is_preempted():
    engine = _engine(max_total_tokens=256)  # 16 blocks
    for index in range(3):
        _turn(engine, _prompt(index * 13), f"agent-{index}")
    scheduler = engine.core.scheduler
    assert engine.pinned_sessions == 3
    preemptions = scheduler.preemptions
    requests = [GenerationRequest(f"big-{i}", _prompt(200 + i, 60), SamplingParams(max_new_tokens=40,
                                                                                   temperature=0.0,
                                                                                   ignore_eos=True))
                for i in range(2)]
    outputs = asyncio.run(engine.generate(requests))
    assert all(len(o.output_ids) == 40 for o in outputs)
    assert scheduler.sessions_evicted >= 1 and scheduler.preemptions == preemptions
