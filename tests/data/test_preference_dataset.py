"""Preference pairs (`--loss-type dpo`, issue 34): both completions share the prompt's tokens; a string completion ends
with EOS, a message completion is what the chat template adds after the prompt; bad rows are refused naming the file,
the row and the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.data.dataset import DatasetError, PromptFormat
from relax.data.preference_dataset import load_preference_pairs, pair_samples
from tests.backends.inference.test_embedded_engine import make_tokenizer

CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@settings(max_examples=40, deadline=None)
@given(prompt=st.text("0123456789+=", min_size=1, max_size=8), chosen=st.text("0123456789", min_size=1, max_size=5),
       rejected=st.text("0123456789", min_size=1, max_size=5))
def test_string_pairs_share_the_prompt_and_end_with_eos(tmp_path_factory, tokenizer, prompt, chosen, rejected):
    path = tmp_path_factory.mktemp("p") / "pairs.jsonl"
    row = {"input": prompt, "chosen": chosen, "rejected": rejected}
    if chosen == rejected:
        with pytest.raises(DatasetError, match=r"row 1: fields 'chosen' and 'rejected' are the same completion"):
            load_preference_pairs(_write(path, [row]), tokenizer, PromptFormat(), "chosen", "rejected")
        return
    (pair,) = load_preference_pairs(_write(path, [row]), tokenizer, PromptFormat(), "chosen", "rejected")
    first, second = pair_samples([pair])
    assert first.metadata["preferred"] and not second.metadata["preferred"] and "rejected" not in first.metadata
    prompt_tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for sample, text in ((first, chosen), (second, rejected)):
        assert sample.tokens[:len(prompt_tokens)] == prompt_tokens
        response = sample.tokens[len(prompt_tokens):]
        assert response == tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert sample.response_length == len(response) and sample.loss_mask == [1] * len(response)


def test_message_completions_are_what_the_chat_template_adds(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML
    rows = [{"input": [{"role": "user", "content": "1+2="}],
             "chosen": [{"role": "assistant", "content": "3"}], "rejected": [{"role": "assistant", "content": "4"}]}]
    fmt = PromptFormat(apply_chat_template=True)
    (pair,) = load_preference_pairs(_write(tmp_path / "p.jsonl", rows), tokenizer, fmt, "chosen", "rejected")
    chosen, rejected = pair_samples([pair])
    assert chosen.response == "3<|im_end|>" and rejected.response == "4<|im_end|>"
    assert chosen.prompt == rejected.prompt == "<|im_start|>user\n1+2=<|im_end|><|im_start|>assistant\n"
    rows[0]["input"] = "1+2="  # a string prompt without the template: the message completion is refused
    with pytest.raises(DatasetError, match=r"p.jsonl: row 1: field 'chosen' is a message list: it needs "
                                           r"--apply-chat-template"):
        load_preference_pairs(_write(tmp_path / "p.jsonl", rows), tokenizer, PromptFormat(), "chosen", "rejected")


@pytest.mark.parametrize("row, problem", [
    ({"input": "1+2=", "rejected": "4"}, r"row 1: missing field 'chosen'"),
    ({"input": "1+2=", "chosen": "3"}, r"row 1: missing field 'rejected'"),
    ({"chosen": "3", "rejected": "4"}, r"row 1: missing field 'input'"),
    ({"input": "1+2=", "chosen": "  ", "rejected": "4"}, r"row 1: field 'chosen' is empty"),
    ({"input": "1+2=", "chosen": "3", "rejected": 4}, r"row 1: field 'rejected' must be a non-empty string"),
    ({"input": "1+2=", "chosen": "3", "rejected": [{"role": "user", "content": "4"}]}, r"field 'rejected'"),
    ({"input": "1+2=", "chosen": "3", "rejected": "3"}, r"are the same completion"),
    ({"input": "1+2=", "chosen": "3" * 40, "rejected": "4"}, r"field 'chosen': prompt and completion take 45 tokens"),
])
def test_bad_rows_are_refused_naming_file_row_and_field(tmp_path, tokenizer, row, problem):
    spec = _write(tmp_path / "pairs.jsonl", [row])
    with pytest.raises(DatasetError, match=problem) as err:
        load_preference_pairs(spec, tokenizer, PromptFormat(apply_chat_template=False), "chosen", "rejected",
                              max_tokens=32)
    assert "pairs.jsonl" in str(err.value)
