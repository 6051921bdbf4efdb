"""Supervised fine-tuning data (``--loss-type sft``): rows become samples whose response is the
target text, with a loss mask over exactly the tokens the model should learn to write.

Two row forms:
- a prompt (``--input-key``, a string or messages) and a target (``--label-key``): the response is
  the target followed by EOS;
- a conversation (``--input-key`` holds messages with assistant turns, ``--apply-chat-template``):
  the response starts at the first assistant turn; assistant turns have mask 1, the turns between
  them (user, tool) mask 0. Each turn is rendered by the chat template and tokenized on its own,
  so a turn's tokens never depend on what follows it.
"""

from __future__ import annotations

from typing import Any

from relax.data.chat_template import apply_template, render_prompt
from relax.data.dataset import (
    DatasetError,
    PromptFormat,
    encode_prompt,
    kept_or_refused,
    past_positions,
    read_spec_rows,
    row_label,
    row_metadata,
)
from relax.data.sample import Sample, SampleStatus


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation_segments(messages: list[dict[str, Any]], tokenizer: Any,
                          template_kwargs: dict[str, Any]) -> list[tuple[str, bool]]:
    """The conversation's text cut into ``(text, is_assistant_turn)`` segments, in order.

    An assistant turn's text is what the template adds between the conversation up to it (with
    the generation prompt) and the conversation including it, so the generation prompt belongs to
    the context and the turn's closing token to the turn.
    """
    segments: list[tuple[str, bool]] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = apply_template(tokenizer, messages[:index], add_generation_prompt=True, **template_kwargs)
        after = apply_template(tokenizer, messages[: index + 1], **template_kwargs)
        if not before.startswith(rendered) or not after.startswith(before):
            raise ValueError(f"the chat template does not render message {index} as an extension of the "
                             "messages before it; multi-turn SFT needs a prefix-stable template")
        segments.append((before[len(rendered):], False))
        segments.append((after[len(before):], True))
        rendered = after
    if not segments:
        raise ValueError("the conversation has no assistant turn to learn from")
    return segments


def _conversation_sample(messages: list[dict[str, Any]], tokenizer: Any, fmt: PromptFormat) -> Sample:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("a conversation row needs a tokenizer with a chat template")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("a conversation is a list of {role, content} messages (each role a string)")
    if fmt.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    segments = conversation_segments(messages, tokenizer, fmt.apply_chat_template_kwargs or {})
    prompt_text = segments[0][0]
    prompt_tokens = encode_prompt(tokenizer, prompt_text)
    response_tokens, loss_mask = [], []
    for text, learn in segments[1:]:
        ids = _encode(tokenizer, text)
        response_tokens += ids
        loss_mask += [int(learn)] * len(ids)
    return Sample(prompt=prompt_text, tokens=prompt_tokens + response_tokens,
                  response="".join(text for text, _ in segments[1:]), response_length=len(response_tokens),
                  loss_mask=loss_mask)


def _target_sample(row: dict[str, Any], tokenizer: Any, fmt: PromptFormat) -> Sample:
    if not fmt.label_key or row.get(fmt.label_key) is None:
        raise KeyError(fmt.label_key)
    prompt_text = render_prompt(row[fmt.input_key], tokenizer, fmt.apply_chat_template, fmt.system_prompt,
                                fmt.apply_chat_template_kwargs)
    target = str(row[fmt.label_key])
    response_tokens = _encode(tokenizer, target) + [tokenizer.eos_token_id]
    prompt_tokens = encode_prompt(tokenizer, prompt_text)
    return Sample(prompt=prompt_text, label=row[fmt.label_key], tokens=prompt_tokens + response_tokens,
                  response=target, response_length=len(response_tokens), loss_mask=[1] * len(response_tokens))


def load_sft_samples(spec: str, tokenizer: Any, fmt: PromptFormat) -> list[Sample]:
    """SFT samples of a data spec; ``Sample.index`` is the row number in the file."""
    path, indexed = read_spec_rows(spec)
    if tokenizer.eos_token_id is None:
        raise DatasetError(f"{spec}: the tokenizer has no EOS token to end the SFT targets with")
    samples, too_long, too_long_for_the_model = [], 0, 0
    for row_index, row in indexed:
        where = row_label(path, row_index)
        if fmt.input_key not in row:
            raise DatasetError(f"{where}: missing field {fmt.input_key!r} (set --input-key); row has {sorted(row)}")
        value = row[fmt.input_key]
        is_conversation = isinstance(value, list) and any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in value)
        try:
            sample = _conversation_sample(value, tokenizer, fmt) if is_conversation else _target_sample(row, tokenizer, fmt)
        except KeyError:
            raise DatasetError(f"{where}: missing target field {fmt.label_key!r} (set --label-key, or give "
                               f"{fmt.input_key!r} as a conversation with assistant turns)") from None
        except ValueError as err:
            raise DatasetError(f"{where}: field {fmt.input_key!r}: {err}") from None
        if fmt.max_prompt_len is not None and sample.prompt_length > fmt.max_prompt_len:
            too_long += 1
            continue
        if fmt.model_positions is not None and len(sample.tokens) > fmt.model_positions:
            too_long_for_the_model += 1
            continue
        sample.index, sample.status = row_index, SampleStatus.COMPLETED
        sample.metadata = row_metadata(row, fmt, where)
        samples.append(sample)
    return kept_or_refused(spec, path, samples, "row", [
        (too_long, f"whose prompt is longer than --rollout-max-prompt-len ({fmt.max_prompt_len} tokens)"),
        (too_long_for_the_model, past_positions(fmt))])
