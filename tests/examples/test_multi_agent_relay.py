"""The multi-agent relay example (issue 33): the environment hands first's sum to second and rewards each agent for
what it controls, for every answer the model could write; the data is disjoint and inside the range the quickstart
model knows; the config runs without a reward function (the environment's rewards are the samples')."""

from __future__ import annotations

import importlib.util
import json
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from relax.cli.args import parse_config
from relax.core.rollout_parts import build_reward_computer
from relax.data.sample import Sample
from tests.support.runs import ROOT

EXAMPLE = ROOT / "examples" / "multi_agent_relay"
sys.path.insert(0, str(EXAMPLE))
import relay_env  # noqa: E402

_spec = importlib.util.spec_from_file_location("relay_build_task", EXAMPLE / "build_task.py")
build_task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_task)

answers = st.one_of(st.integers(0, 2000).map(str), st.text(max_size=6), st.integers(0, 999).map(lambda n: f" {n}\n"),
                    st.sampled_from(["²", "1²", "١٢٣", "12 3", "-5", "+7"]))


@settings(max_examples=300, deadline=None)
@given(a=st.integers(100, 399), b=st.integers(100, 499), c=st.integers(100, 499), first=answers, second=answers)
def test_each_agent_is_rewarded_for_what_it_controls(a, b, c, first, second):
    env = relay_env.build_env(Sample(prompt=f"{a}+{b}+{c}", label=str(a + b + c)), None)
    opening, speaker = env.reset()
    assert speaker == "first" and opening == {"first": [{"role": "user", "content": f"{a}+{b}="}], "second": []}
    turn = env.step("first", first)
    value = relay_env.read_number(first)
    assert turn.rewards == {"first": float(value == a + b)}
    if value is None:  # not a number: second never speaks
        assert turn.next_agent is None and not turn.observations
        return
    assert turn.next_agent == "second" and turn.observations == {"second": {"role": "user", "content": f"{value}+{c}="}}
    last = env.step("second", second)
    assert last.next_agent is None and last.rewards == {"second": float(relay_env.read_number(second) == a + b + c)}


def test_the_data_is_disjoint_and_in_the_quickstart_range(tmp_path):
    build_task.build(tmp_path)
    rows = {split: [json.loads(line) for line in (tmp_path / "data" / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "test")}
    assert len(rows["train"]) == build_task.NUM_TRAIN and len(rows["test"]) == build_task.NUM_TEST
    assert not {r["input"] for r in rows["train"]} & {r["input"] for r in rows["test"]}
    for row in rows["train"] + rows["test"]:
        a, b, c = map(int, row["input"].split("+"))
        assert 100 <= a and 100 <= b and a + b <= 499 and 100 <= c <= 499 and row["label"] == str(a + b + c)
    tokenizer_config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer_config or (tmp_path / "model" / "chat_template.jinja").exists()


def test_the_config_runs_without_a_reward_function():
    config = parse_config(["--config", str(EXAMPLE / "config.yaml")])
    assert config.rm_type is None and config.custom_rm_path is None
    build_reward_computer(config)  # the environment rewards the samples
