"""Issue 28, items 11-13 and 17: rewards that cannot be gamed and cannot escape their bounds.

- hedges (several candidates where the label is one value) score 0 under ``math``, ``boxed_math`` and ``gsm8k``;
  a set label still matches the same set;
- correct answers in common notations (digit-group separators, scientific notation, Unicode fractions,
  superscripts, full-width digits, infinity) score 1, with math-verify as the oracle on the plain forms;
- ``gsm8k`` gives 1 only to a final answer that is a single number;
- an async reward that blocks, sync rewards that never return and a worker that ran out of memory stay bounded.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from relax.data.sample import Sample
from relax.rollout.rewards import RewardComputer, get_reward_fn
from relax.rollout.rewards.compute import MAX_ABANDONED_THREADS
from relax.rollout.rewards.notation import normalize_notation

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
MATH_REWARDS = ["math", "boxed_math"]
NUMBER = st.integers(-999, 9999)


def score(rm_type: str, response: str, label) -> float:
    return get_reward_fn(rm_type)(response, label, {})


# ---- item 11: hedged answers --------------------------------------------------------------------------------------
HEDGES = [r"\boxed{{{a} \lor {b}}}", r"\boxed{{{a} \vee {b}}}", r"\boxed{{{a} \text{{ or }} {b}}}",
          r"\boxed{{{a} = {b}}}", r"\boxed{{{a}, {b}}}", "The answer is {a} or {b}.", "So it is {a} = {b}.",
          r"$ {a} \lor {b} $", "It is {b} or {a}", r"\boxed{{\pm {b}}}"]


@PROPERTY
@given(a=NUMBER, b=NUMBER, form=st.sampled_from(HEDGES), rm_type=st.sampled_from(MATH_REWARDS))
def test_a_hedge_scores_0_where_the_label_is_one_value(a, b, form, rm_type):
    if a == b or (form.endswith(r"\pm {b}}}") and b == 0) or (rm_type == "boxed_math" and "boxed" not in form):
        return
    assert score(rm_type, form.format(a=a, b=b), str(b)) == 0.0
    assert score(rm_type, form.format(a=a, b=b), str(a)) == 0.0


@PROPERTY
@given(a=NUMBER, b=NUMBER, form=st.sampled_from([r"\boxed{{{a} \lor {b}}}", r"\boxed{{{a} \text{{ or }} {b}}}",
                                                 r"\boxed{{{a}, {b}}}", r"\boxed{{\{{{a}, {b}\}}}}"]))
def test_a_set_label_is_matched_by_the_same_set_only(a, b, form):
    if a == b:
        return
    answer = form.format(a=a, b=b)
    assert score("math", answer, rf"\{{{a}, {b}\}}") == 1.0
    assert score("math", answer, rf"\{{{a}, {b}, {a + b + 1000}\}}") == 0.0


@pytest.mark.parametrize("rm_type", [*MATH_REWARDS, "gsm8k"])
@pytest.mark.parametrize("response", [r"\boxed{3 \lor 4}", r"\boxed{3 = 4}"])
def test_the_reported_hedges(rm_type, response):
    assert score(rm_type, response, "4") == 0.0


@pytest.mark.parametrize("response", ["3 or 4", "The answer is 3 or 4.", "3 = 4"])
def test_the_reported_free_text_hedges(response):
    assert score("math", response, "4") == 0.0
    assert score("gsm8k", response, "4") == 0.0


def test_honest_answers_still_score():
    assert score("math", r"\boxed{x = 4}", "4") == 1.0
    assert score("math", r"so $2 + 2 = 4$", "4") == 1.0
    assert score("gsm8k", "48 + 24 = 72 clips", "72") == 1.0
    assert score("math", r"\boxed{\{3, 4\}}", r"\{4, 3\}") == 1.0


# ---- item 12: notations ---------------------------------------------------------------------------------------------
def _thin(n: int, separator: str) -> str:
    return f"{n:,}".replace(",", separator)


SEPARATORS = ["\u2009", "\u202f", "\u00a0", r"\,", r"\;", r"\!", "{,}", ","]
FULLWIDTH = str.maketrans("0123456789-", "０１２３４５６７８９－")


@PROPERTY
@given(n=st.integers(1000, 10**9), separator=st.sampled_from(SEPARATORS), rm_type=st.sampled_from(MATH_REWARDS))
def test_digit_group_separators_read_as_separators(n, separator, rm_type):
    assert score(rm_type, rf"\boxed{{{_thin(n, separator)}}}", str(n)) == 1.0
    assert score(rm_type, rf"\boxed{{{_thin(n, separator)}}}", str(n + 1)) == 0.0
    assert score("gsm8k", f"#### {_thin(n, separator)}", str(n)) == 1.0


@PROPERTY
@given(mantissa=st.integers(1, 99), exponent=st.integers(-3, 6), rm_type=st.sampled_from(MATH_REWARDS))
def test_scientific_notation(mantissa, exponent, rm_type):
    value = Fraction(mantissa, 10) * Fraction(10) ** exponent
    label = str(value.numerator) if value.denominator == 1 else rf"\frac{{{value.numerator}}}{{{value.denominator}}}"
    assert score(rm_type, rf"\boxed{{{mantissa / 10}e{exponent}}}", label) == 1.0
    assert score(rm_type, rf"\boxed{{{mantissa / 10}E{exponent}}}", label) == 1.0


VULGAR = {"½": (1, 2), "⅓": (1, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅛": (1, 8), "⅔": (2, 3)}


@pytest.mark.parametrize("rm_type", MATH_REWARDS)
@pytest.mark.parametrize("char", sorted(VULGAR))
def test_unicode_fractions(rm_type, char):
    numerator, denominator = VULGAR[char]
    assert score(rm_type, rf"\boxed{{{char}}}", rf"\frac{{{numerator}}}{{{denominator}}}") == 1.0
    assert score(rm_type, rf"\boxed{{2{char}}}", rf"\frac{{{2 * denominator + numerator}}}{{{denominator}}}") == 1.0


@PROPERTY
@given(base=st.integers(2, 12), power=st.integers(2, 9), rm_type=st.sampled_from(MATH_REWARDS))
def test_superscripts(base, power, rm_type):
    superscript = str(power).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
    assert score(rm_type, rf"\boxed{{{base}{superscript}}}", str(base**power)) == 1.0


@PROPERTY
@given(n=st.integers(-9999, 99999), rm_type=st.sampled_from([*MATH_REWARDS, "gsm8k"]))
def test_fullwidth_digits(n, rm_type):
    assert score(rm_type, rf"\boxed{{{str(n).translate(FULLWIDTH)}}}", str(n)) == 1.0


@pytest.mark.parametrize("rm_type", MATH_REWARDS)
@pytest.mark.parametrize("answer", ["∞", r"\infty", "+∞"])
def test_infinity(rm_type, answer):
    assert score(rm_type, rf"\boxed{{{answer}}}", r"\infty") == 1.0


@PROPERTY
@given(p=st.integers(-50, 50), q=st.integers(1, 20), r=st.integers(-50, 50), s=st.integers(1, 20))
def test_math_agrees_with_math_verify_on_plain_answers(p, q, r, s):
    """Where math-verify is right (plain LaTeX fractions), the notation layer changes nothing."""
    answer, label = rf"\frac{{{p}}}{{{q}}}", rf"\frac{{{r}}}{{{s}}}"
    expected = float(verify(parse(f"${label}$"), parse(rf"\boxed{{{answer}}}")))
    assert score("math", rf"\boxed{{{answer}}}", label) == expected == float(Fraction(p, q) == Fraction(r, s))


def test_notation_normalization_is_idempotent():
    for text in ["12\u2009345", "½ + 2³", "４２", "∞", r"12\,345", "1.5e3"]:
        once = normalize_notation(text)
        assert normalize_notation(once) == once


# ---- item 13: gsm8k takes one number -------------------------------------------------------------------------------
@pytest.mark.parametrize(("response", "label"), [("(1, 2)", "2"), ("[0, 1)", "1"), (r"\pm 3", "3"), ("0/0", "0"),
                                                 ("1,2", "12"), ("1-2", "2"), ("3 or 4", "4"), ("#### 3 or 4", "4"),
                                                 (r"\boxed{(1, 2)}", "2"), ("It is 5 and 7", "7")])
def test_gsm8k_refuses_an_answer_that_is_not_one_number(response, label):
    assert score("gsm8k", response, label) == 0.0


@pytest.mark.parametrize(("response", "label"), [(r"12\,345", "12345"), ("#### 1,234,567", "1234567"),
                                                 ("She pays $18.", "18"), ("So 9 * 2 = 18 dollars.", "18"),
                                                 ("The answer is −3.", "-3"), (r"\boxed{12{,}345}", "12345")])
def test_gsm8k_reads_separators_as_separators(response, label):
    assert score("gsm8k", response, label) == 1.0


@PROPERTY
@given(a=NUMBER, b=NUMBER, joint=st.sampled_from([", ", " or ", " - ", "/", " and "]),
       brackets=st.sampled_from(["{}", "({})", "[{})", r"\{{{}\}}"]))
def test_gsm8k_never_credits_a_pair(a, b, joint, brackets):
    if a == b:
        return
    response = brackets.format(f"{a}{joint}{b}")
    assert score("gsm8k", response, str(b)) == 0.0


# ---- item 17: rewards that escape their bounds ----------------------------------------------------------------------
def _samples(count: int) -> list[Sample]:
    return [Sample(index=i, tokens=[1, 2, 3], response_length=1, response=str(i), group_index=i, label="1")
            for i in range(count)]


def test_an_async_reward_that_blocks_is_bounded_and_the_rollout_s_loop_runs_on():
    computer = RewardComputer(custom_rm_path="tests.support.e2e_rewards:blocks_its_loop", timeout_s=0.5)
    ticks = []

    async def main() -> list:
        async def ticker():
            for _ in range(200):
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        samples = _samples(2)
        await computer.score(samples)
        tick.cancel()
        return [s.reward for s in samples]

    try:
        assert asyncio.run(main()) == [0.0, 0.0]
        assert computer.pop_metrics() == {"reward/num_errors": 2, "reward/num_timeouts": 2}
        assert len(ticks) > 5  # the rollout's loop kept running while the reward blocked its own
    finally:
        computer.close()


def test_stuck_reward_threads_are_bounded():
    """Calls that never return: at most max_workers run at once, and once MAX_ABANDONED_THREADS are stuck no new
    thread starts (the call fails at once, counted, saying what to do); before, each call left one more thread."""
    workers = 8
    computer = RewardComputer(custom_rm_path="tests.support.e2e_rewards:sleeps_forever", timeout_s=0.05, max_workers=workers)
    threads_before = threading.active_count()
    for _ in range(6):  # 96 calls in all
        samples = _samples(16)
        asyncio.run(computer.score(samples))
        assert all(s.reward == 0.0 for s in samples)
    assert threading.active_count() - threads_before <= MAX_ABANDONED_THREADS + workers
    assert any("--custom-rm-workers" in message for message in computer.error_counts)


def test_a_worker_that_ran_out_of_memory_is_replaced(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    computer = RewardComputer(custom_rm_path="tests.support.e2e_rewards:leaks_into_a_global", custom_workers=1,
                              worker_memory_mb=700, timeout_s=60)
    try:
        rewards = []
        for _ in range(10):
            samples = _samples(1)
            asyncio.run(computer.score(samples))
            rewards.append(samples[0].reward)
        assert 0.0 in rewards, rewards  # the leak ran out of the worker's memory at least once
        after_first_failure = rewards[rewards.index(0.0) + 1:]
        assert 1.0 in after_first_failure, rewards  # a fresh worker took over: later calls succeed again
        assert any("MemoryError" in message for message in computer.error_counts)
    finally:
        computer.close()
