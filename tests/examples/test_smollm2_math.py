"""The SmolLM2 math recipe (issue 31): its procedural data is deterministic, its held-out set never seen in training and
balanced by level in any prefix, every answer is the problem's arithmetic, the math reward grades it, and both
configurations load with the model named by --hf-checkpoint and --gguf-file."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.cli.args import parse_config
from tests.support.runs import ROOT

RECIPE = ROOT / "examples" / "smollm2_math"
sys.path.insert(0, str(RECIPE))
import build_data  # noqa: E402
import prepare  # noqa: E402


def test_the_data_is_deterministic_and_the_held_out_set_is_unseen(tmp_path):
    train, test = build_data.build(tmp_path / "a", num_train=2000, num_test=200)
    again, test_again = build_data.build(tmp_path / "b", num_train=2000, num_test=200)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    assert (tmp_path / "a" / "test.jsonl").read_bytes() == (tmp_path / "b" / "test.jsonl").read_bytes()
    assert len(train) == 2000 and len(test) == 200
    seen = {row["input"][0]["content"] for row in train}
    assert not seen & {row["input"][0]["content"] for row in test}
    levels = [row["metadata"]["level"] for row in test]
    for size in (4, 100, 200):  # any prefix is balanced
        assert all(levels[:size].count(level) == size // 4 for level in (1, 2, 3, 4)), size
    easy = [json.loads(line) for line in (tmp_path / "a" / "test_level1.jsonl").read_text().splitlines()]
    assert easy == [row for row in test if row["metadata"]["level"] == 1] and easy
    assert len(seen) > 0.9 * len(train)  # few repeats among the training prompts (small level-1 products repeat)


def _arithmetic(question: str) -> int:
    a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question).groups()
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), level=st.sampled_from([1, 2, 3, 4]))
def test_every_problem_has_a_whole_non_negative_answer_that_is_its_arithmetic(seed, level):
    question, answer = build_data.LEVELS[level](random.Random(seed))
    assert isinstance(answer, int) and answer >= 0, (question, answer)
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    assert numbers, question
    if level == 1:
        assert answer == _arithmetic(question)
    elif "shares" in question:  # equal shares come out whole
        total, friends = numbers
        assert total % friends == 0 and answer == total // friends
    elif "gives" in question and level == 2:
        assert answer == numbers[0] - numbers[1]
    elif "trays of" in question:
        trays, per_tray, eaten = numbers
        assert answer == trays * per_tray - eaten


def test_the_math_reward_grades_the_recipes_answers():
    from relax.rollout.rewards.math_rewards import extract_math_answer, grade_math

    def score(response: str, label: str) -> float:
        answer = extract_math_answer(response)
        return 0.0 if answer is None else grade_math(answer, label, {})

    for row in build_data.problems(8, seed=5):
        label = row["label"]
        assert score(label, label) == 1.0
        assert score(f"The answer is {label}.", label) == 1.0
        assert score(f"\\boxed{{{label}}}", label) == 1.0
        assert score(str(int(label) + 1), label) == 0.0


@pytest.mark.parametrize("name", ["config_cpu.yaml", "config_gpu.yaml"])
def test_the_configurations_load_and_name_the_gguf_file(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = parse_config(["--config", str(RECIPE / name)])
    assert cfg.model_source == f"examples/smollm2_math/model/{prepare.GGUF_NAME}"
    assert cfg.rm_type == "math" and cfg.apply_chat_template and "held_out" in cfg.eval_prompt_data


def test_prepare_refuses_a_partial_model_file(tmp_path):
    partial = tmp_path / prepare.GGUF_NAME
    partial.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(SystemExit, match="expected 98362432"):
        prepare.link_model(partial, tmp_path / "model")
