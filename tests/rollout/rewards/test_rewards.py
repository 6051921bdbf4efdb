"""The reward layer: every rule reward on hand-written responses, custom functions loaded by
dotted path (they live in this module), and how RewardComputer reports failing rewards."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from types import SimpleNamespace

import pytest

from relax.data.sample import Sample
from relax.rollout.rewards import RewardComputer, get_reward_fn, load_custom_reward, register_reward, registry
from relax.rollout.rewards.boxed import last_boxed_content
from relax.rollout.rewards.text_rewards import extract_choice, token_f1


def score(rm_type: str, response: str, label) -> float:
    return get_reward_fn(rm_type)(response, label, {})


def run_scoring(computer: RewardComputer, samples: list[Sample]) -> list:
    asyncio.run(computer.score(samples))
    return [sample.reward for sample in samples]


# --- boxed extraction -----------------------------------------------------------------------------


def test_last_boxed_content_takes_the_last_box_with_nested_braces():
    assert last_boxed_content(r"first \boxed{1}, finally \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed_content("no box here") is None
    assert last_boxed_content(r"cut off \boxed{\frac{1}{2") is None


# --- math -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label",
    [
        (r"Adding them gives $\frac{2}{4}$, so the answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"Some scratch work: 3, 7. Final: \boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{x^2 + 1}", "1 + x^2"),
        ("The answer is 42.", 42),
    ],
)
def test_math_accepts_equivalent_answers(response, label):
    assert score("math", response, label) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"I first thought \boxed{7} but it is \boxed{8}", "7"),  # only the last box counts
        ("I don't know.", "3"),  # no answer at all
        (r"truncated \boxed{\frac{1}{", "0.5"),  # the box is never closed
    ],
)
def test_math_rejects_wrong_or_missing_answers(response, label):
    assert score("math", response, label) == 0.0


def test_math_raises_on_a_label_it_cannot_read():
    with pytest.raises(ValueError, match="cannot parse the label"):
        score("math", r"\boxed{1}", "")


def test_math_works_off_the_main_thread():
    """math-verify's signal-based timeout cannot run in worker threads; the reward must still grade there."""
    results = []
    worker = threading.Thread(target=lambda: results.append(score("math", r"\boxed{\frac{6}{4}}", "1.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


# --- gsm8k ----------------------------------------------------------------------------------------

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "response, label",
    [
        ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", GSM8K_SOLUTION),
        ("48 + 24 = 72 clips", "72"),  # no ####: the last number
        ("The total is $1,200.00\n#### $1,200", "1200"),
        ("#### -3.5", "-3.50"),
    ],
)
def test_gsm8k_accepts_the_right_number(response, label):
    assert score("gsm8k", response, label) == 1.0


@pytest.mark.parametrize(
    "response",
    ["48 + 24 = 72, then minus 2 gives 70", "#### 71", "#### none", "I cannot solve this."],
)
def test_gsm8k_rejects_wrong_or_missing_numbers(response):
    assert score("gsm8k", response, GSM8K_SOLUTION) == 0.0


def test_gsm8k_raises_on_a_label_without_a_number():
    with pytest.raises(ValueError, match="no number"):
        score("gsm8k", "#### 3", "#### unknown")


# --- dapo -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, label",
    [
        ("Let me compute.\nAnswer: 18", "18"),
        ("So x = 1000.\nAnswer: $1,000$ dollars", "1000"),
        ("Answer: 3\nWait, I made a mistake.\nAnswer: \\frac12", r"\frac{1}{2}"),  # the last Answer line
        ("answer : x = 5", "5"),
    ],
)
def test_dapo_rewards_a_matching_answer_line_with_one(response, label):
    assert score("dapo", response, label) == 1.0


@pytest.mark.parametrize("response", ["Answer: 17", "The answer is 18.", "Answer: 18\nAnswer: 19", ""])
def test_dapo_penalizes_wrong_or_missing_answer_lines_with_minus_one(response):
    assert score("dapo", response, "18") == -1.0


# --- multiple_choice ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, choice",
    [
        (r"Options (A) and (C) fail, so \boxed{B}", "B"),
        (r"\boxed{\text{D}}", "D"),
        ("(A) is too small. Answer: C", "C"),
        ("After checking each option, the answer is (E).", "E"),
        ("Option A is wrong; it must be\nB", "B"),
        ("Only (J) satisfies all three constraints, as shown.", "J"),
        ("I have no idea.", None),
        (r"\boxed{42}", None),
    ],
)
def test_extract_choice(response, choice):
    assert extract_choice(response) == choice


def test_multiple_choice_compares_letters():
    assert score("multiple_choice", "Answer: B", "(b)") == 1.0
    assert score("multiple_choice", "Answer: C", "B") == 0.0
    assert score("multiple_choice", "No letter here.", "B") == 0.0


def test_multiple_choice_raises_on_a_label_that_is_not_a_letter():
    with pytest.raises(ValueError, match="one letter A-J"):
        score("multiple_choice", "Answer: B", "Paris")


# --- f1 and exact_match ---------------------------------------------------------------------------


def test_f1_is_squad_token_f1():
    assert score("f1", "The Eiffel Tower!", "eiffel tower") == 1.0  # case, punctuation and articles ignored
    # prediction {eiffel, tower, in, paris} vs reference {eiffel, tower}: precision 1/2, recall 1 -> F1 2/3.
    assert score("f1", "Eiffel Tower in Paris", "Eiffel Tower") == pytest.approx(2 / 3)
    assert score("f1", "Big Ben", "Eiffel Tower") == 0.0
    assert score("f1", "", "Eiffel Tower") == 0.0
    assert token_f1("the", "a") == 1.0  # both normalize to nothing


def test_f1_takes_the_best_of_several_reference_answers():
    assert score("f1", "Paris", ["the capital", "Paris"]) == 1.0


def test_exact_match_ignores_surrounding_whitespace_only():
    assert score("exact_match", "  42\n", 42) == 1.0
    assert score("exact_match", "42.", "42") == 0.0
    assert score("exact_match", "Yes", "yes") == 0.0


# --- boxed_ prefix and the registry ---------------------------------------------------------------


def test_boxed_prefix_grades_only_the_last_box():
    assert score("boxed_exact_match", r"Reasoning... \boxed{yes}", "yes") == 1.0
    assert score("boxed_exact_match", "yes", "yes") == 0.0  # no box: an empty answer
    assert score("boxed_gsm8k", r"7 apples, so \boxed{12}", "12") == 1.0
    assert score("boxed_gsm8k", r"\boxed{7} apples and 12 pears", "12") == 0.0


def test_unknown_reward_type_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown reward type 'boxed_nope'") as error:
        get_reward_fn("boxed_nope")
    for name in ("math", "gsm8k", "dapo", "multiple_choice", "f1", "exact_match"):
        assert name in str(error.value)


def test_register_reward_adds_a_name_and_refuses_duplicates(monkeypatch):
    monkeypatch.setattr(registry, "_RULE_REWARDS", dict(registry._RULE_REWARDS))

    @register_reward("length_at_most_5")
    def short(response, label, metadata):
        return float(len(response) <= 5)

    assert get_reward_fn("length_at_most_5")("hello", None, {}) == 1.0
    assert get_reward_fn("length_at_most_5")("hello world", None, {}) == 0.0
    assert get_reward_fn("boxed_length_at_most_5")(r"\boxed{hi}", None, {}) == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math")(short)


# --- custom reward functions (loaded by dotted path from this module) -----------------------------

NOT_A_FUNCTION = 3


def sync_reward(args, sample):
    return {
        "score": float(sample.response == sample.label) + args.bonus,
        "thread_is_main": float(threading.current_thread() is threading.main_thread()),
    }


async def async_reward(args, sample):
    await args.all_started.wait()  # every sample's call must be running before any finishes
    return float(len(sample.response))


def group_reward(args, samples):
    """1.0 for the shortest response of the group, 0.0 for the others."""
    shortest = min(len(sample.response) for sample in samples)
    args.group_sizes.append(len(samples))
    return [float(len(sample.response) == shortest) for sample in samples]


def failing_reward(args, sample):
    if sample.response == "boom":
        raise RuntimeError("reward server said boom")
    if sample.response == "nan":
        return math.nan
    if sample.response == "none":
        return None
    return 1.0


def group_reward_with_wrong_length(args, samples):
    return [1.0]


@pytest.mark.parametrize("path", ["tests.rollout.rewards.test_rewards:sync_reward", "tests.rollout.rewards.test_rewards.sync_reward"])
def test_load_custom_reward_accepts_both_path_forms(path):
    assert load_custom_reward(path) is sync_reward


@pytest.mark.parametrize(
    "path, error, reason",
    [
        ("tests.no_such_module:fn", ImportError, "No module named 'tests.no_such_module'"),
        ("tests.rollout.rewards.test_rewards:no_such_fn", ImportError, "has no attribute 'no_such_fn'"),
        ("tests.rollout.rewards.test_rewards:NOT_A_FUNCTION", TypeError, "is a int, not a function"),
        ("no_separator", ValueError, "expected 'package.module:function'"),
    ],
)
def test_a_bad_custom_path_fails_at_construction_naming_the_path(path, error, reason):
    with pytest.raises(error) as raised:
        RewardComputer(custom_rm_path=path)
    assert repr(path) in str(raised.value)
    assert reason in str(raised.value)


def test_custom_sync_reward_runs_in_a_worker_thread_with_args():
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_rewards:sync_reward", args=SimpleNamespace(bonus=0.5))
    samples = [Sample(index=0, response="4", label="4"), Sample(index=1, response="5", label="4")]
    rewards = run_scoring(computer, samples)
    assert rewards == [{"score": 1.5, "thread_is_main": 0.0}, {"score": 0.5, "thread_is_main": 0.0}]
    assert computer.pop_metrics() == {"reward/num_errors": 0, "reward/num_timeouts": 0}


def test_custom_async_reward_is_awaited_concurrently():
    samples = [Sample(index=i, response="x" * i) for i in range(4)]

    async def scenario():
        args = SimpleNamespace(all_started=asyncio.Barrier(len(samples)))
        computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_rewards:async_reward", args=args)
        await asyncio.wait_for(computer.score(samples), timeout=10)  # sequential awaiting would deadlock

    asyncio.run(scenario())
    assert [sample.reward for sample in samples] == [0.0, 1.0, 2.0, 3.0]


def test_group_reward_gets_samples_grouped_by_group_index():
    args = SimpleNamespace(group_sizes=[])
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_rewards:group_reward", group_rm=True, args=args)
    samples = [
        Sample(index=0, group_index=0, response="aaa"),
        Sample(index=1, group_index=1, response="b"),
        Sample(index=2, group_index=0, response="a"),
        Sample(index=3, group_index=1, response="bb"),
        Sample(index=4, group_index=1, response="bbb"),
    ]
    assert run_scoring(computer, samples) == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert sorted(args.group_sizes) == [2, 3]


def test_group_reward_of_the_wrong_length_fails_the_whole_group(caplog):
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_rewards:group_reward_with_wrong_length", group_rm=True)
    samples = [Sample(index=i, group_index=7, response="x", reward=5.0) for i in range(3)]
    with caplog.at_level(logging.ERROR, logger="relax.rewards"):
        assert run_scoring(computer, samples) == [0.0, 0.0, 0.0]
    assert computer.pop_metrics() == {"reward/num_errors": 3, "reward/num_timeouts": 0}
    assert "samples 0, 1, 2 (group 7)" in caplog.text


# --- rule rewards inside RewardComputer -----------------------------------------------------------


def test_rule_reward_with_a_per_sample_override():
    computer = RewardComputer(rm_type="math")
    samples = [
        Sample(index=0, response=r"\boxed{\frac{1}{2}}", label="0.5"),
        Sample(index=1, response=r"\boxed{3}", label="4"),
        Sample(index=2, response="Answer: C", label="C", metadata={"rm_type": "multiple_choice"}),
        Sample(index=3, response="Answer: 18", label="18", metadata={"rm_type": "dapo"}),
    ]
    assert run_scoring(computer, samples) == [1.0, 0.0, 1.0, 1.0]


def test_constructor_rejects_a_missing_or_ambiguous_configuration():
    with pytest.raises(ValueError, match="no reward configured"):
        RewardComputer()
    with pytest.raises(ValueError, match="both given"):
        RewardComputer(rm_type="math", custom_rm_path="tests.rollout.rewards.test_rewards:sync_reward")
    with pytest.raises(ValueError, match="--group-rm .* needs a --custom-rm-path"):
        RewardComputer(rm_type="math", group_rm=True)
    with pytest.raises(ValueError, match="unknown reward type 'maths'"):
        RewardComputer(rm_type="maths")


def test_a_missing_label_is_a_counted_error_naming_the_sample(caplog):
    computer = RewardComputer(rm_type="gsm8k")
    samples = [Sample(index=0, response="#### 3", label="3"), Sample(index=5, response="#### 3", label=None)]
    with caplog.at_level(logging.ERROR, logger="relax.rewards"):
        assert run_scoring(computer, samples) == [1.0, 0.0]
    assert computer.pop_metrics() == {"reward/num_errors": 1, "reward/num_timeouts": 0}
    [record] = caplog.records
    assert "sample 5" in record.getMessage()
    assert "'gsm8k' compares the response with a label" in record.getMessage()


def test_an_unknown_per_sample_rm_type_is_a_counted_error():
    computer = RewardComputer(rm_type="math")
    samples = [Sample(index=0, response="1", label="1", metadata={"rm_type": "nope"})]
    assert run_scoring(computer, samples) == [0.0]
    [message] = computer.error_counts
    assert message.startswith("ValueError: unknown reward type 'nope'; known types: dapo, exact_match, f1, gsm8k")


def test_failing_rewards_give_zero_are_counted_and_each_message_is_logged_once(caplog):
    computer = RewardComputer(custom_rm_path="tests.rollout.rewards.test_rewards:failing_reward", max_workers=2)
    responses = ["ok", "boom", "boom", "nan", "none", "ok", "boom"]
    samples = [Sample(index=i, response=response) for i, response in enumerate(responses)]
    with caplog.at_level(logging.ERROR, logger="relax.rewards"):
        assert run_scoring(computer, samples) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert computer.pop_metrics() == {"reward/num_errors": 5, "reward/num_timeouts": 0}
        assert computer.error_counts == {
            "RuntimeError: reward server said boom": 3,
            "ValueError: a reward must be finite, got nan": 1,
            "TypeError: a reward must be a float or a dict of floats, got NoneType": 1,
        }
        assert len(caplog.records) == 3  # one per distinct message, not one per failing sample
        boom_record = next(record for record in caplog.records if "boom" in record.getMessage())
        assert re.search(r"reward failed for sample [12],", boom_record.getMessage())  # whichever failed first
        assert boom_record.exc_info is not None  # the traceback points into the user's function

        caplog.clear()
        again = [Sample(index=10, response="boom")]
        assert run_scoring(computer, again) == [0.0]
    assert caplog.records == []  # already reported: counted only
    assert computer.pop_metrics() == {"reward/num_errors": 1, "reward/num_timeouts": 0}
    assert computer.pop_metrics() == {"reward/num_errors": 0, "reward/num_timeouts": 0}
    assert computer.error_counts["RuntimeError: reward server said boom"] == 4
