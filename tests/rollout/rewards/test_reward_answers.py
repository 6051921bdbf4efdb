"""Rule rewards against math-verify on generated answers, cut-off answers, and reward timeouts (issue 14, items
7-11): each reported pair pinned, and a property test for the class it belongs to."""

from __future__ import annotations

import asyncio
import json
import threading
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify import parse, verify

from relax.data.sample import Sample
from relax.rollout.rewards import RewardComputer, get_reward_fn, registry
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax, tiny_train_args


def score(rm_type: str, response: str, label) -> float:
    return get_reward_fn(rm_type)(response, label, {})


# ---- 8. boxed_math hands math-verify a LaTeX box -----------------------------------------------------
EQUIVALENT = [(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"), (r"\dfrac{3}{4}", "0.75"), ("(1, 2)", "(1, 2)"),
              ("x^2+2x+1", "(x+1)^2"), (r"\{1, 2\}", r"\{2, 1\}"), ("[0, 1)", "[0,1)"), (r"\infty", r"\infty"),
              (r"2\sqrt{3}", r"\sqrt{12}")]
DIFFERENT = [("(1, 2)", "2"), ("[0, 1)", "(0, 1)"), (r"\frac{1}{3}", "0.33"), ("x^2", "x^3")]


@pytest.mark.parametrize("rm_type", ["math", "boxed_math"])
@pytest.mark.parametrize("answer, label", EQUIVALENT)
def test_math_rewards_accept_equivalent_latex(rm_type, answer, label):
    assert score(rm_type, rf"so the answer is \boxed{{{answer}}}.", label) == 1.0


@pytest.mark.parametrize("rm_type", ["math", "boxed_math"])
@pytest.mark.parametrize("answer, label", DIFFERENT)
def test_math_rewards_reject_different_latex(rm_type, answer, label):
    assert score(rm_type, rf"\boxed{{{answer}}}", label) == 0.0


def _latex_numbers():
    integers = st.integers(-50, 50).map(lambda n: (str(n), Fraction(n)))
    fractions = st.tuples(st.integers(-20, 20), st.integers(1, 12)).map(
        lambda p: (rf"\frac{{{p[0]}}}{{{p[1]}}}" if p[0] >= 0 else rf"-\frac{{{-p[0]}}}{{{p[1]}}}", Fraction(*p)))
    decimals = st.integers(-999, 999).map(lambda n: (f"{n / 100:.2f}", Fraction(n, 100)))
    return st.one_of(integers, fractions, decimals)


@settings(max_examples=60, deadline=None)
@given(_latex_numbers(), _latex_numbers(), st.sampled_from(["math", "boxed_math"]))
def test_math_rewards_agree_with_math_verify(answer, label, rm_type):
    """math-verify is the oracle: the reward of a boxed answer is its verdict on the two expressions in math mode."""
    (answer_tex, _), (label_tex, _) = answer, label
    expected = float(verify(parse(f"${label_tex}$"), parse(f"${answer_tex}$")))
    assert score(rm_type, rf"The total is \boxed{{{answer_tex}}}", label_tex) == expected


@settings(max_examples=60, deadline=None)
@given(_latex_numbers(), _latex_numbers())
def test_math_reward_is_exact_on_rationals(answer, label):
    (answer_tex, answer_value), (label_tex, label_value) = answer, label
    assert score("math", rf"\boxed{{{answer_tex}}}", label_tex) == float(answer_value == label_value)


# ---- 9. boxed_dapo grades the box ------------------------------------------------------------------
def test_boxed_dapo_grades_the_box_content():
    assert score("dapo", r"Answer: \boxed{42}", "42") == 1.0
    assert score("boxed_dapo", r"so \boxed{42}", "42") == 1.0
    assert score("boxed_dapo", r"so \boxed{41}", "42") == -1.0
    assert score("boxed_dapo", "Answer: 42", "42") == -1.0  # boxed_dapo needs a box


# ---- 10. a cut-off revised answer has no answer ---------------------------------------------------
BOX_GRADED = ["math", "gsm8k", "multiple_choice"] + [registry.BOXED_PREFIX + name for name in registry._RULE_REWARDS]


def test_a_cut_off_revision_does_not_score_the_stale_box():
    assert score("math", r"I think \boxed{3}. Wait, actually it is \boxed{4", "3") == 0.0


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(BOX_GRADED), st.text(alphabet="0123456789 +-.,\\frac{", max_size=12),
       st.text(alphabet="0123456789abc ,.(", max_size=8))
def test_an_unclosed_last_box_is_no_answer(rm_type, middle, cut):
    """Whatever came before, a response that ends inside an unclosed box gets the reward's no-answer value."""
    label = {"multiple_choice": "B", "boxed_multiple_choice": "B"}.get(rm_type, "7")
    stale = "(B)" if "multiple_choice" in rm_type else "7"
    response = rf"First \boxed{{{stale}}} and Answer: {stale}. {middle} Wait, no: \boxed{{{cut}"
    reward = get_reward_fn(rm_type)
    assert reward(response, label, {}) == reward.no_answer


# ---- 11. Unicode minus, answer tags and percent signs ---------------------------------------------
@pytest.mark.parametrize("minus", ["\u2212", "\ufe63", "\uff0d", "-"])
def test_gsm8k_and_dapo_read_a_unicode_minus(minus):
    assert score("gsm8k", rf"\boxed{{{minus}3}}", "3") == 0.0
    assert score("gsm8k", rf"\boxed{{{minus}3}}", "-3") == 1.0
    assert score("boxed_gsm8k", rf"\boxed{{{minus}3}}", "-3") == 1.0
    assert score("dapo", f"Answer: {minus}3", "-3") == 1.0


def test_math_reads_answer_tags_and_percent_signs():
    assert score("math", "<think>it is 41</think><answer>42</answer>", "42") == 1.0
    assert score("math", "<answer>42", "42") == 0.0  # cut off inside the tag
    assert score("math", r"\boxed{50\%}", "50") == 1.0
    assert score("boxed_math", r"\boxed{50\%}", "50") == 1.0
    assert score("math", r"\boxed{50}", r"50\%") == 1.0
    assert score("math", r"\boxed{0.5}", "50") == 0.0  # a percent is the number, not a fraction


# ---- 7. every reward call is bounded -------------------------------------------------------------
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"


def _sample(response: str, label: str, index: int = 0) -> Sample:
    return Sample(index=index, prompt="p", label=label, response=response)


def test_a_pathological_math_answer_times_out_off_the_main_thread():
    computer = RewardComputer(rm_type="math", timeout_s=1.0)
    samples = [_sample(PATHOLOGICAL, "1", 0), _sample(r"\boxed{1}", "1", 1)]

    def score_in_thread():
        asyncio.run(computer.score(samples))

    thread = threading.Thread(target=score_in_thread)
    thread.start()
    thread.join(timeout=60)
    try:
        assert not thread.is_alive(), "scoring hung"
        assert [s.reward for s in samples] == [0.0, 1.0]
        assert computer.pop_metrics() == {"reward/num_errors": 1, "reward/num_timeouts": 1}
        # the killed worker was replaced: the pool still scores
        again = [_sample(r"\boxed{2}", "2")]
        asyncio.run(computer.score(again))
        assert again[0].reward == 1.0
    finally:
        computer.close()


_release = threading.Event()


def blocking_reward(args, sample):
    """A custom reward that blocks until the test releases it (a hung remote reward model)."""
    if sample.metadata.get("hang"):
        _release.wait(30)
    return 1.0


@settings(max_examples=8, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=10), st.integers(1, 3))
def test_hung_sync_rewards_in_threads_time_out_and_never_starve_the_pool(hangs, workers):
    _release.clear()
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_reward_answers:blocking_reward", timeout_s=0.2,
                              max_workers=workers)
    try:
        samples = [Sample(index=i, prompt="p", response="r", metadata={"hang": hang}) for i, hang in enumerate(hangs)]
        asyncio.run(asyncio.wait_for(computer.score(samples), 30))
        assert [s.reward for s in samples] == [0.0 if hang else 1.0 for hang in hangs]
        assert computer.pop_metrics()["reward/num_timeouts"] == sum(hangs)
        after = [Sample(index=99, prompt="p", response="r")]
        asyncio.run(asyncio.wait_for(computer.score(after), 30))
        assert after[0].reward == 1.0
    finally:
        _release.set()
        computer.close()


async def slow_async_reward(args, sample):
    await asyncio.sleep(30)
    return 1.0


def test_an_async_reward_past_the_timeout_gets_zero():
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_reward_answers:slow_async_reward", timeout_s=0.1)
    samples = [_sample("r", "l")]
    asyncio.run(asyncio.wait_for(computer.score(samples), 10))
    assert samples[0].reward == 0.0 and computer.pop_metrics()["reward/num_timeouts"] == 1


def test_a_pathological_label_times_out_through_the_training_loop(tiny_workspace, tmp_path):
    """`relax train --rm-type math` where every comparison hangs in math-verify: the run finishes, every
    answer that parses is counted as a timeout, and nothing waits past the limit."""
    data = tmp_path / "tower.jsonl"
    rows = [json.loads(line) for line in (tiny_workspace / "train.jsonl").read_text().splitlines()]
    data.write_text("".join(json.dumps({**row, "label": "9^{9^{9^{9}}}"}) + "\n" for row in rows))
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2")
    args[args.index("--prompt-data") + 1] = str(data)
    at = args.index("--custom-rm-path")
    args[at:at + 2] = ["--rm-type", "math", "--reward-timeout", "1"]
    at = args.index("--eval-prompt-data")
    del args[at:at + 3]
    result = run_relax("train", *args)  # bounded: a reward that hung the run would end in run_relax's timeout
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    timeouts = sum(row.get("reward/num_timeouts", 0) for row in metrics)
    assert timeouts > 0
    assert all(row["rollout/reward_mean"] == 0.0 for row in metrics if "rollout/reward_mean" in row)
