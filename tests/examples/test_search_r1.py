"""The Search-R1-style recipe (issue 33): the BM25 tool finds every town's own passage and nothing unrelated, runs as a
relax tool through the tool environment, refuses bad queries and bad corpora with clear errors; the task's held-out
towns are never named in training; the reward grades only the model's last turn; the shared reward log draws its
curves."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relax.cli.args import parse_config
from relax.data.sample import Sample
from relax.rollout.agentic.tool_env import ToolEnv
from relax.rollout.agentic.tool_parser import get_tool_call_parser
from relax.rollout.agentic.tools import ToolError, load_user_tool
from tests.support.runs import ROOT

RECIPE = ROOT / "examples" / "search_r1"
sys.path.insert(0, str(RECIPE))
import search_tool  # noqa: E402


def _load(name: str, path):
    """An example module by file (the examples each have a build_task.py and a reward.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_task = _load("search_r1_build_task", RECIPE / "build_task.py")
reward = _load("search_r1_reward", RECIPE / "reward.py")
reward_log = _load("agentic_reward_log", ROOT / "examples" / "agentic_common" / "reward_log.py")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(2, 60))
@example(seed=275048, count=26)  # towns "Diqui" and "Diquive": a name inside another one
def test_a_search_for_a_town_returns_its_passage_first_and_only_passages_naming_it(seed, count):
    towns = build_task.build_towns(random.Random(seed), count)
    index = search_tool.CorpusIndex([build_task.passage(name, town) for name, town in towns.items()], list(towns))
    for name, town in towns.items():
        results = index.search(name)
        assert results[0] == build_task.passage(name, town)  # the title ranks the subject's own passage first
        # A passage names the town as a word: a town "Diqui" is not named by "Twin town: Diquive." (BM25 matches words)
        word = re.compile(rf"\b{re.escape(name)}\b")
        assert all(word.search(text) for text in results)
        naming = sum(bool(word.search(build_task.passage(other, t))) for other, t in towns.items())
        assert len(results) == min(naming, search_tool.TOP_K)


def test_the_tool_runs_through_the_tool_environment_and_refuses_bad_queries(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": n, "text": t}) for n, t in [
        ("Velorn", "Velorn: code 48213. Twin town: Quashi."), ("Quashi", "Quashi: code 11111. Twin town: Velorn.")]))
    monkeypatch.setenv("SEARCH_R1_CORPUS", str(corpus))
    tool = load_user_tool("search_tool:search")
    assert tool.name == "search" and tool.parameters["required"] == ["query"]
    env = ToolEnv([tool], get_tool_call_parser("hermes"), timeout_s=5.0)
    call = '<tool_call>{"name":"search","arguments":{"query":"Velorn"}}</tool_call>'
    observation, done, info = asyncio.run(env.step(call))
    text = json.dumps(env.format_observation(observation))
    assert not done and "code 48213" in text and "code 11111" in text
    assert info["tool_stats"]["successful_calls"] == 1
    assert search_tool.search("nobody") == "no results"
    for bad in ("", "   ", "x" * (search_tool.MAX_QUERY_CHARS + 1)):
        with pytest.raises(ToolError, match="search:"):
            search_tool.search(bad)
    bad_call = '<tool_call>{"name":"search","arguments":{"query":""}}</tool_call>'
    _, _, info = asyncio.run(env.step(bad_call))
    assert info["tool_stats"]["successful_calls"] == 1 and info["tool_stats"]["calls"] == 2  # the error is shown


@pytest.mark.parametrize("line, problem", [("not json", "expected a JSON object"), ('{"id": 1}', "'text'"),
                                           ('{"text": ""}', "non-empty"), ('[1, 2]', "expected a JSON object")])
def test_a_bad_corpus_row_is_named_by_file_and_line(tmp_path, line, problem):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "Velorn: code 1."}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=problem) as err:
        search_tool.read_corpus(corpus)
    assert f"{corpus}:2" in str(err.value)
    corpus.write_text(json.dumps({"text": "Velorn: code 1.", "title": 7}) + "\n")
    with pytest.raises(ValueError, match="'title' must be a string") as err:
        search_tool.read_corpus(corpus)
    assert f"{corpus}:1" in str(err.value)
    corpus.write_text(json.dumps({"text": "Velorn: code 1.", "title": "Velorn"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=problem) as err:
        search_tool.read_corpus(corpus)
    assert f"{corpus}:2" in str(err.value)
    with pytest.raises(ValueError, match="empty"):
        search_tool.CorpusIndex([])


def test_held_out_towns_are_never_named_in_training_and_codes_are_unguessable(tmp_path, monkeypatch):
    monkeypatch.setattr(build_task, "NUM_TRAIN", 60)
    monkeypatch.setattr(build_task, "NUM_TEST", 20)
    towns = build_task.build_towns(random.Random(build_task.SEED), 60 + 20 + 20)
    names = list(towns)
    held_out = set(names[60:80])
    training_text = json.dumps([build_task.prompt_row(n, towns[n], _FakeTool) for n in names[:60]]
                               + [build_task.direct_row(n, towns[n], _FakeTool) for n in names[80:]])
    assert not any(name in training_text for name in held_out)
    assert len({town["code"] for town in towns.values()}) > 0.95 * len(towns)
    assert all(town["twin"] != name and town["twin"] in towns for name, town in towns.items())


class _FakeTool:
    name = "search"


def _sample(turns: list[str], label: str) -> Sample:
    traces = [{"response_text": text, "env_info": {}} for text in turns]
    sample = Sample(prompt="q", label=label, response="".join(turns), metadata={"rollout_traces": traces})
    sample.index = 3
    sample.weight_version = 2
    return sample


def test_the_reward_grades_the_last_turn_and_reruns_the_searches(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "Velorn: code 48213. Twin town: Quashi."}) + "\n")
    monkeypatch.setenv("SEARCH_R1_CORPUS", str(corpus))
    args = type("Args", (), {"output_dir": str(tmp_path)})()
    call = '<tool_call>{"name":"search","arguments":{"query":"Velorn"}}</tool_call>'
    right = reward.search_reward(args, _sample([call, "<answer>48213</answer>"], "48213"))
    assert right["score"] == 1.0 and right["found"] == 1.0
    # the answer appears only in the tool's output, not in the model's last turn: not correct
    wrong = reward.search_reward(args, _sample([call, "I do not know"], "48213"))
    assert wrong["score"] == 0.0 and wrong["found"] == 1.0
    missed = reward.search_reward(args, _sample(['<tool_call>{"name":"search","arguments":{"query":"Quux"}}'
                                                 '</tool_call>', "<answer>1</answer>"], "48213"))
    assert missed["found"] == 0.0 and missed["score"] == 0.0
    rows = reward_log.read_log(tmp_path / reward.REWARD_LOG_NAME)
    assert [row["correct"] for row in rows] == [1.0, 0.0, 0.0] and {row["weight_version"] for row in rows} == {2}


def test_the_reward_log_draws_its_curves(tmp_path, capsys):
    rows = [{"split": split, "index": i, "weight_version": step, "correct": float(i % 2), "called_tool": 1.0}
            for step in (0, 10) for split in ("test", "train") for i in range(4)]
    figures = {"curve": ("title", "share", {"held-out": ("test", "correct"), "train": ("train", "called_tool")})}
    reward_log.plot_log(rows, figures, tmp_path / "png")
    assert (tmp_path / "png" / "curve.png").read_bytes()[:4] == b"\x89PNG"
    reward_log.print_table(rows, {"correct": "accuracy"}, "called_tool", "search rate")
    table = capsys.readouterr().out.splitlines()
    assert table[2] == "| 0 | 0.500 | 1.000 |" and table[3] == "| 10 | 0.500 | 1.000 |"


def test_the_config_loads():
    config = parse_config(["--config", str(RECIPE / "config.yaml")])
    assert config.tools == ["search_tool:search"] and config.max_turns == 2
    assert config.rollout_max_context_len <= 512  # the tiny model's positions
