"""A real chat template (issue 18): Qwen3's, with thinking on and off through `--apply-chat-template-kwargs`, on a
tokenizer that carries it (`tests.support.tiny_assets.build_qwen3_tokenizer`), through every place a prompt is rendered:
the dataset loader, a training run (its rollout samples and its evaluation), and the multi-turn observation encoder.
"""

from __future__ import annotations

import json

import pytest
import yaml

from relax.cli.main import main
from relax.data.dataset import PromptFormat, load_prompt_samples
from relax.rollout.agentic.multi_turn import ObservationEncoder
from tests.support.tiny_assets import build_qwen3_tokenizer, build_tiny_model_dir

EMPTY_THINKING = "<think>\n\n</think>\n\n"
HISTORY = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n3"},
           {"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


@pytest.mark.parametrize("kwargs, opened", [({}, ""), ({"enable_thinking": True}, ""),
                                            ({"enable_thinking": False}, EMPTY_THINKING)])
def test_the_template_opens_an_empty_reasoning_block_only_when_thinking_is_off(tokenizer, kwargs, opened):
    text = tokenizer.apply_chat_template(HISTORY, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.endswith("<|im_start|>assistant\n" + opened)
    assert "add" not in text  # reasoning of turns before the last question is dropped, as Qwen3's template does
    last_turn = tokenizer.apply_chat_template(HISTORY[:2], tokenize=False)
    assert "<think>\nadd\n</think>\n\n3" in last_turn  # ... and kept after it


@pytest.mark.parametrize("thinking", [True, False])
def test_the_loader_renders_rows_with_the_runs_template_kwargs(tokenizer, tmp_path, thinking):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"input": "1+2=", "label": "3"}) + "\n" + json.dumps({"input": HISTORY, "label": "7"})
                    + "\n")
    fmt = PromptFormat(apply_chat_template=True, apply_chat_template_kwargs={"enable_thinking": thinking})
    samples = load_prompt_samples(str(data), tokenizer, fmt)
    suffix = tokenizer("<|im_start|>assistant\n" + ("" if thinking else EMPTY_THINKING),
                       add_special_tokens=False)["input_ids"]
    for sample in samples:
        assert sample.tokens[-len(suffix):] == suffix
        assert (tokenizer.convert_tokens_to_ids("<think>") in sample.tokens) == (not thinking)


def test_a_run_with_thinking_off_rolls_out_and_evaluates_after_an_empty_reasoning_block(tokenizer, tmp_path,
                                                                                          tiny_workspace):
    model = build_tiny_model_dir(tmp_path / "model", tokenizer=tokenizer)
    run_dir = tmp_path / "run"
    assert main(["train", "--hf-checkpoint", str(model), "--prompt-data", str(tiny_workspace / "train.jsonl"),
                 "--eval-prompt-data", "held_out", str(tiny_workspace / "test.jsonl"), "--apply-chat-template",
                 "--apply-chat-template-kwargs", '{"enable_thinking": false}', "--custom-rm-path",
                 "tests.support.e2e_rewards:digit_fraction", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "3", "--num-rollout", "1", "--output-dir", str(run_dir),
                 "--dump-samples", "4", "--no-use-tensorboard"]) == 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["apply_chat_template_kwargs"] == \
        {"enable_thinking": False}  # a re-run of the saved config renders the same prompts
    opened = tokenizer(EMPTY_THINKING, add_special_tokens=False)["input_ids"]
    dumped = [json.loads(line) for line in (run_dir / "samples" / "rollout_000001.jsonl").read_text().splitlines()]
    for sample in dumped:
        prompt = sample["tokens"][:len(sample["tokens"]) - sample["response_length"]]
        assert prompt[-len(opened):] == opened
    assert "eval/accuracy" in (run_dir / "metrics.jsonl").read_text()


def test_observations_of_a_multi_turn_episode_open_the_next_turn_as_the_template_does(tokenizer):
    encoder = ObservationEncoder(tokenizer, {"enable_thinking": False})
    ids, media = encoder.encode({"role": "user", "content": "now 5+5="})
    text = tokenizer.decode(ids)
    assert media is None and text.startswith("<|im_start|>user\nnow 5+5=<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n" + EMPTY_THINKING)
    assert encoder.close_turn(tokenizer("3<|im_end|>", add_special_tokens=False)["input_ids"]) == \
        tokenizer("\n", add_special_tokens=False)["input_ids"]
