"""The shipped quickstart assets (built by examples/quickstart/build_quickstart.py) load and behave as the RL
quickstart expects: a tokenizer that round-trips arithmetic exactly, a model that generates, and disjoint data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.runs import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUICKSTART = ROOT / "examples" / "quickstart"
MODEL_DIR = QUICKSTART / "model"
DATA_DIR = QUICKSTART / "data"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_tokenizer_round_trips_arithmetic_one_token_per_character(tokenizer):
    text = "123+456=579"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert "<|im_start|>" in tokenizer.get_vocab()


def test_model_and_generation_config_agree_with_tokenizer(model, tokenizer):
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_train_and_test_rows_parse_and_are_disjoint():
    train, test = read_jsonl(DATA_DIR / "train.jsonl"), read_jsonl(DATA_DIR / "test.jsonl")
    assert len(train) >= 1000 and len(test) == 200
    for row in train + test:
        a, b = row["input"].removesuffix("=").split("+")
        assert row["input"].endswith("=") and row["label"] == str(int(a) + int(b))
    assert not {row["input"] for row in train} & {row["input"] for row in test}


def test_greedy_generation_on_test_prompts_yields_strings(model, tokenizer):
    prompts = [row["input"] for row in read_jsonl(DATA_DIR / "test.jsonl")[:8]]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        generated = model.generate(**encoded, do_sample=False, max_new_tokens=6)
    completions = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(completions) == len(prompts)
    assert all(isinstance(text, str) for text in completions)
