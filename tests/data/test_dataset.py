"""Prompt datasets: formats, slices, chat templates, filtering, and errors that name file/row/field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.data.dataset import AnswerRoom, DatasetError, PromptFormat, load_prompt_samples, parse_data_spec
from relax.data.preference_dataset import load_preference_pairs
from relax.data.sft_dataset import load_sft_samples
from relax.rollout.generation.data_source import PromptDataSource
from tests.support.tiny_assets import REFUSING_CHATML, build_qwen3_tokenizer, build_tokenizer


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
    with pytest.raises(DatasetError, match=r"no prompt left after dropping 2 longer than --rollout-max-prompt-len "
                                           r"\(2 tokens\)"):
        load_prompt_samples(str(path), tokenizer, PromptFormat(max_prompt_len=2))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8), positions=st.integers(2, 32),
       max_prompt_len=st.one_of(st.none(), st.integers(1, 32)))
def test_a_prompt_is_kept_exactly_when_it_fits_both_bounds_and_leaves_room_for_an_answer(tmp_path, tokenizer, lengths,
                                                                                       positions, max_prompt_len):
    """A prompt that fills the model's positions had been loaded and refused by the engine mid-run (a ValueError
    that ended the run: "403 prompt tokens leave no room for an answer"); now it is dropped at load and counted,
    as upstream's default --rollout-max-prompt-len (the context less one) drops it."""
    rows = [{"input": "1" * length} for length in lengths]  # one token a character
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    fmt = PromptFormat(max_prompt_len=max_prompt_len, answer_room=AnswerRoom.of_positions(positions))
    kept = [i for i, n in enumerate(lengths) if n < positions and (max_prompt_len is None or n <= max_prompt_len)]
    if not kept:
        with pytest.raises(DatasetError, match="no prompt left after dropping"):
            load_prompt_samples(str(path), tokenizer, fmt)
        return
    assert [sample.index for sample in load_prompt_samples(str(path), tokenizer, fmt)] == kept


def test_the_dropped_prompts_name_the_room_they_did_not_fit(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "1" * 40}])
    room = AnswerRoom(32, "the engine's KV pool of 32 token slots (--max-total-tokens)")
    with pytest.raises(DatasetError, match=r"no prompt left after dropping 1 that leave no room for an answer within "
                                           r"the engine's KV pool of 32 token slots \(--max-total-tokens\)"):
        load_prompt_samples(str(path), tokenizer, PromptFormat(answer_room=room))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=6),
       positions=st.integers(2, 36), loader=st.sampled_from(["sft", "preference"]))
def test_a_training_row_is_kept_exactly_when_its_sequences_fit_the_model_s_positions(tmp_path, tokenizer, rows,
                                                                                   positions, loader):
    """An SFT row, or a preference pair's completion, longer than the model's positions had trained on positions the
    model never saw (RoPE models compute them without complaint): dropped at load and counted, as prompts that leave
    no room for an answer are."""
    data = [{"input": "1" * prompt, "label": "2" * target, "chosen": "2" * target, "rejected": "3" * other}
            for prompt, target, other in rows]  # one token a character; each completion ends with EOS
    path = write_jsonl(tmp_path / "rows.jsonl", data)
    fmt = PromptFormat(model_positions=positions)
    longest = [prompt + max(target, other if loader == "preference" else 0) + 1 for prompt, target, other in rows]
    kept = [index for index, length in enumerate(longest) if length <= positions]
    load = (lambda: load_sft_samples(str(path), tokenizer, fmt)) if loader == "sft" else \
        (lambda: load_preference_pairs(str(path), tokenizer, fmt, "chosen", "rejected"))
    if not kept:
        with pytest.raises(DatasetError, match=f"rows.jsonl: no (row|pair) left after dropping {len(rows)} .*longer "
                                               f"than the model's {positions} positions"):
            load()
        return
    samples = load()
    assert [sample.index for sample in samples] == kept
    assert all(len(sample.tokens) <= positions for sample in samples)


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
        assert samples and all(isinstance(sample.prompt, str) and sample.tokens for sample in samples)


# Rows whose messages, per-row template variables and tools take any shape: what the chat-template path is handed.
_MESSAGES = st.lists(_JSON_VALUES | st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | _JSON_VALUES},
    optional={"content": st.text(max_size=5) | _JSON_VALUES}), max_size=4)
_TEMPLATE_KWARGS = _JSON_VALUES | st.dictionaries(
    st.sampled_from(["enable_thinking", "tokenize", "add_generation_prompt", "tools", "return_dict", "x"]),
    _JSON_VALUES, max_size=2)
_CHAT_ROWS = st.fixed_dictionaries({}, optional={
    "input": st.text(max_size=5) | _MESSAGES | _JSON_VALUES, "label": _JSON_VALUES,
    "chosen": st.text(max_size=5) | _MESSAGES | _JSON_VALUES, "rejected": st.text(max_size=5) | _MESSAGES,
    "metadata": st.fixed_dictionaries({}, optional={"apply_chat_template_kwargs": _TEMPLATE_KWARGS}) | _JSON_VALUES,
    "tools": _JSON_VALUES | st.lists(st.sampled_from(["calculator", "unknown"]) | _JSON_VALUES, max_size=2)})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_CHAT_ROWS, min_size=1, max_size=3), loader=st.sampled_from(["prompts", "sft", "preference"]),
       template=st.sampled_from(["chatml", "qwen3", "refusing"]), system_prompt=st.sampled_from([None, "be brief"]),
       rule_reward=st.sampled_from([None, "math"]), tool_key=st.sampled_from([None, "tools"]))
def test_any_row_through_a_chat_template_loads_or_is_refused_naming_the_row(tmp_path, rows, loader, template,
                                                                          system_prompt, rule_reward, tool_key):
    """With --apply-chat-template, whatever a row's messages, its metadata's apply_chat_template_kwargs and its
    tools are, and whatever the template refuses, loading gives samples or a DatasetError naming the file: never a
    TypeError from template variables that are not an object or that name `tokenize`, nor the template's own
    jinja error, which would end a run with a traceback instead of the row to fix."""
    tokenizer = build_qwen3_tokenizer() if template == "qwen3" else build_tokenizer()
    if template == "refusing":
        tokenizer.chat_template = REFUSING_CHATML
    fmt = PromptFormat(apply_chat_template=True, system_prompt=system_prompt, required_label_for=rule_reward,
                       tool_key=tool_key, tool_specs={"calculator": {"type": "function", "function": {"name": "calculator"}}})
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    try:
        if loader == "prompts":
            samples = load_prompt_samples(str(path), tokenizer, fmt)
        elif loader == "sft":
            samples = load_sft_samples(str(path), tokenizer, fmt)
        else:
            samples = load_preference_pairs(str(path), tokenizer, fmt, "chosen", "rejected")
    except DatasetError as err:
        assert str(err).startswith(f"{path}"), err
    else:
        assert samples and all(isinstance(sample.prompt, str) and sample.tokens for sample in samples)


@pytest.mark.parametrize("loader", sorted(_LOADERS))
def test_an_empty_prompt_is_refused_naming_the_row(tmp_path, tokenizer, loader):
    """A prompt of no tokens had loaded, and the first rollout then failed in the engine, after the model loaded,
    with a traceback: refused at load instead (SFT and preference pairs too: a first response token would have
    nothing it is predicted from)."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "1+1=", "label": "2", "chosen": "2", "rejected": "3"},
                                                 {"input": "", "label": "2", "chosen": "2", "rejected": "3"}])
    with pytest.raises(DatasetError, match="rows.jsonl: row 2: field 'input': the prompt is empty"):
        _LOADERS[loader](str(path), tokenizer)


@pytest.mark.parametrize("loader", [*sorted(_LOADERS), "media prompts"])
@pytest.mark.parametrize("metadata", [[1], "rm_type=math", 0])
def test_metadata_that_is_not_an_object_is_refused_by_every_loader(tmp_path, tokenizer, loader, metadata):
    """The metadata carries a row's reward type and template variables: SFT, preference pairs and media prompts
    had dropped one that was not an object without a word (the prompts refused it)."""
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "1+1=", "label": "2", "chosen": "2", "rejected": "3",
                                                  "images": [], "metadata": metadata}])
    load = _LOADERS.get(loader) or (lambda spec, tok: load_prompt_samples(spec, tok, PromptFormat(
        multimodal_keys={"image": "images"})))
    with pytest.raises(DatasetError, match="rows.jsonl: row 1: field 'metadata' must be an object"):
        load(str(path), tokenizer)


def test_template_variables_that_are_call_arguments_are_refused_naming_the_row(tmp_path, tokenizer):
    fmt = PromptFormat(apply_chat_template=True)
    for kwargs, named in (({"tokenize": True}, "'tokenize'"), ([1], "got list"),
                          ({"add_generation_prompt": False, "return_dict": True}, "'add_generation_prompt', 'return_dict'")):
        path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "1+1=", "label": "2"},
                                                     {"input": "hi", "metadata": {"apply_chat_template_kwargs": kwargs}}])
        with pytest.raises(DatasetError, match=f"rows.jsonl: row 2: field 'metadata': apply_chat_template_kwargs .*{named}"):
            load_prompt_samples(str(path), tokenizer, fmt)
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": "hi", "metadata": {"apply_chat_template_kwargs": None}}])
    assert load_prompt_samples(str(path), tokenizer, fmt)[0].prompt.endswith("assistant\n")  # null: none given
    path = write_jsonl(tmp_path / "rows.jsonl", [{"input": [{"role": "system", "content": "s"}]}])
    refusing = build_tokenizer()
    refusing.chat_template = REFUSING_CHATML
    with pytest.raises(DatasetError, match="rows.jsonl: row 1: field 'input': the chat template refused the "
                                           "messages: No user query found in messages."):
        load_prompt_samples(str(path), refusing, fmt)


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
