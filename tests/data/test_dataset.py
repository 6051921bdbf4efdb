"""Prompt datasets: formats, slices, chat templates, filtering, and errors that name file/row/field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.data.dataset import DatasetError, PromptFormat, load_prompt_samples, parse_data_spec
from relax.data.preference_dataset import load_preference_pairs
from relax.data.sft_dataset import load_sft_samples
from relax.rollout.generation.data_source import PromptDataSource
from tests.support.tiny_assets import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_rows_become_prompt_samples(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "1+2=", "label": "3", "metadata": {"rm_type": "math"}},
                                              {"input": "2+2=", "label": "4"}])
    samples = load_prompt_samples(str(path), tokenizer, PromptFormat())
    assert [s.prompt for s in samples] == ["1+2=", "2+2="]
    assert samples[0].label == "3" and samples[0].metadata == {"rm_type": "math"}
    assert tokenizer.decode(samples[1].tokens) == "2+2=" and samples[1].index == 1
    assert samples[0].response_length == 0


def test_parquet_and_row_slices(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]), path)
    fmt = PromptFormat(input_key="question", label_key="answer")
    samples = load_prompt_samples(f"{path}@[2:5]", tokenizer, fmt)
    assert [s.index for s in samples] == [2, 3, 4] and samples[0].label == "3"
    assert parse_data_spec("x.jsonl@[:-2]")[1] == slice(None, -2)


def test_chat_template_with_system_prompt_and_message_lists(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "hi"}, {"input": [{"role": "user", "content": "yo"}]}])
    fmt = PromptFormat(apply_chat_template=True, system_prompt="be brief")
    samples = load_prompt_samples(str(path), tokenizer, fmt)
    assert samples[0].prompt == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    assert samples[1].prompt.endswith("<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n")


def test_long_prompts_are_dropped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "1+1="}, {"input": "123456789+1="}])
    samples = load_prompt_samples(str(path), tokenizer, PromptFormat(max_prompt_len=5))
    assert [s.prompt for s in samples] == ["1+1="]
    with pytest.raises(DatasetError, match="every prompt is longer"):
        load_prompt_samples(str(path), tokenizer, PromptFormat(max_prompt_len=2))


def test_missing_prompt_key_names_file_row_and_field(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "1+1="}, {"question": "2+2="}])
    with pytest.raises(DatasetError, match=r"d.jsonl: row 2: missing prompt field 'input' \(set --input-key\)"):
        load_prompt_samples(str(path), tokenizer, PromptFormat())


def test_empty_file_invalid_json_and_unreadable_parquet(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="empty.jsonl: the file holds no rows"):
        load_prompt_samples(str(empty), tokenizer, PromptFormat())
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input": "a"}\n{"input": \n')
    with pytest.raises(DatasetError, match="broken.jsonl: line 2: invalid JSON"):
        load_prompt_samples(str(broken), tokenizer, PromptFormat())
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match="bad.parquet: unreadable parquet file"):
        load_prompt_samples(str(bad_parquet), tokenizer, PromptFormat())
    with pytest.raises(DatasetError, match="missing.jsonl: file not found"):
        load_prompt_samples(str(tmp_path / "missing.jsonl"), tokenizer, PromptFormat())


def test_message_list_without_chat_template_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DatasetError, match="row 1: field 'input': a message-list prompt needs --apply-chat-template"):
        load_prompt_samples(str(path), tokenizer, PromptFormat())


def test_data_source_epochs_and_seeded_shuffle(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": f"{i}="} for i in range(5)])
    prompts = load_prompt_samples(str(path), tokenizer, PromptFormat())
    plain = PromptDataSource(prompts, rollout_batch_size=2, shuffle=False, seed=0)
    assert [[s.index for s in plain.prompts_for_step(step)] for step in range(3)] == [[0, 1], [2, 3], [4, 0]]
    assert plain.epoch_of_position(4) == 0 and plain.epoch_of_position(6) == 1
    shuffled = PromptDataSource(prompts, rollout_batch_size=5, shuffle=True, seed=7)
    epoch0, epoch1 = (sorted(s.index for s in shuffled.prompts_for_step(e)) for e in (0, 1))
    assert epoch0 == epoch1 == [0, 1, 2, 3, 4]  # each epoch is a permutation
    again = PromptDataSource(prompts, rollout_batch_size=5, shuffle=True, seed=7)
    assert [s.index for s in again.prompts_for_step(1)] == [s.index for s in shuffled.prompts_for_step(1)]
    # steps hand out copies: filling one in does not touch the dataset
    shuffled.prompts_for_step(0)[0].tokens.append(99)
    assert 99 not in prompts[0].tokens


_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_JSON_VALUES = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_LINES = st.one_of(
    st.builds(lambda text: json.dumps({"input": text, "label": "1"}).encode(), st.text(min_size=1, max_size=20)),
    st.builds(lambda value: json.dumps({"input": value}).encode(), _JSON_VALUES),
    st.builds(lambda value: json.dumps(value).encode(), _JSON_VALUES),
    st.binary(max_size=24).filter(lambda raw: b"\n" not in raw and b"\r" not in raw),
    st.just(b""),
)


_ROW_FIELDS = st.dictionaries(st.sampled_from(["input", "label", "chosen", "rejected", "metadata"]), _JSON_VALUES,
                              max_size=5)
_LOADERS = {
    "prompts": lambda path, tokenizer: load_prompt_samples(path, tokenizer, PromptFormat(label_key=None)),
    "sft": lambda path, tokenizer: load_sft_samples(path, tokenizer, PromptFormat()),
    "preference": lambda path, tokenizer: load_preference_pairs(path, tokenizer, PromptFormat(), "chosen",
                                                                "rejected"),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINES | st.builds(lambda row: json.dumps(row).encode(), _ROW_FIELDS), min_size=1, max_size=6),
       loader=st.sampled_from(sorted(_LOADERS)), suffix=st.sampled_from([".jsonl", ".json"]))
def test_any_jsonl_file_loads_or_is_refused_naming_the_file(tmp_path, tokenizer, lines, loader, suffix):
    """Whatever bytes a .jsonl holds (text that is not UTF-8, JSON that is not an object, a prompt, target or
    completion that is a number, a list or null), loading it for RL prompts, SFT or preference pairs gives samples
    or a DatasetError that names the file: never another exception, which would end a run with a traceback instead
    of the place to fix."""
    path = tmp_path / f"data{suffix}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    try:
        samples = _LOADERS[loader](str(path), tokenizer)
    except DatasetError as err:
        assert str(err).startswith(f"{path}"), err
    else:
        assert samples and all(isinstance(sample.prompt, str) for sample in samples)


def test_a_json_file_may_be_one_array_of_rows_and_a_bom_is_no_error(tmp_path, tokenizer):
    rows = [{"input": "1+1=", "label": "2"}, {"input": "2+2=", "label": "4"}]
    array = tmp_path / "rows.json"
    array.write_text("\ufeff" + json.dumps(rows, indent=2))
    lines = tmp_path / "rows.jsonl"
    lines.write_text("\ufeff" + "".join(json.dumps(row) + "\r\n" for row in rows))
    for path in (array, lines):
        samples = load_prompt_samples(str(path), tokenizer, PromptFormat())
        assert [sample.label for sample in samples] == ["2", "4"] and [s.index for s in samples] == [0, 1]
    sliced = load_prompt_samples(f"{array}@[1:]", tokenizer, PromptFormat())
    assert [sample.label for sample in sliced] == ["4"]
    (tmp_path / "bad.json").write_text(json.dumps(rows[:1], indent=2)[:-2])
    with pytest.raises(DatasetError, match=r"bad.json: line \d+: invalid JSON"):
        load_prompt_samples(str(tmp_path / "bad.json"), tokenizer, PromptFormat())
    (tmp_path / "scalars.json").write_text(json.dumps([rows[0], 3]))
    with pytest.raises(DatasetError, match="scalars.json: row 2: expected a JSON object, got int"):
        load_prompt_samples(str(tmp_path / "scalars.json"), tokenizer, PromptFormat())
