"""Preference pairs (``--loss-type dpo`` and ``rm``): a prompt (``--input-key``) with a chosen and a rejected
completion (``--chosen-key``, ``--rejected-key``), and for a reward model an optional margin (``--margin-key``, a
number: how much the chosen completion must outscore the rejected one).

A completion is a string (the prompt is rendered as for RL, the completion follows it and ends with EOS) or a list of
assistant messages (TRL's conversational form; needs ``--apply-chat-template``: the template renders the prompt and
the completion together, and the completion is what follows the prompt's rendering with its generation prompt).
The prompt and each completion are tokenized apart, so both completions of a pair share the prompt's tokens exactly.

Every pair becomes one `Sample` (the chosen completion) carrying its rejected twin in ``metadata["rejected"]``, so
the data stream shuffles and counts pairs; the DPO loop lays them out as ``[chosen, rejected]``. Refused at load,
naming the file, the row and the field: a missing or empty field, a chosen completion equal to its rejected one (no
preference to learn), a pair longer than ``--max-tokens-per-gpu`` (it could not fit a micro-batch), and a margin that
is not a finite number.
"""

from __future__ import annotations

import math
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


def _completion_text(prompt: Any, completion: Any, prompt_text: str, tokenizer: Any, fmt: PromptFormat) -> str:
    """The text of a completion after ``prompt_text`` (module doc); raises ValueError naming what is wrong."""
    if isinstance(completion, str):
        if not completion.strip():
            raise ValueError("is empty")
        return completion
    if not isinstance(completion, list) or not completion:
        raise ValueError("must be a non-empty string or a list of assistant messages")
    if not fmt.apply_chat_template:
        raise ValueError("is a message list: it needs --apply-chat-template")
    if not all(isinstance(m, dict) and m.get("role") == "assistant" and str(m.get("content") or "").strip()
               for m in completion):
        raise ValueError("must hold only assistant messages with non-empty content")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if fmt.system_prompt and messages[0].get("role") != "system":  # render_prompt took it: non-empty, dicts
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    full = apply_template(tokenizer, [*messages, *completion], **(fmt.apply_chat_template_kwargs or {}))
    if not full.startswith(prompt_text):
        raise ValueError("the chat template renders the prompt differently with the completion after it; the "
                         "completion's tokens cannot be told apart")
    return full[len(prompt_text):]


def _completion_sample(prompt_text: str, prompt_tokens: list[int], text: str, ends_with_eos: bool,
                       tokenizer: Any) -> Sample:
    response = _encode(tokenizer, text) + ([tokenizer.eos_token_id] if ends_with_eos else [])
    return Sample(prompt=prompt_text, tokens=prompt_tokens + response, response=text, response_length=len(response),
                  loss_mask=[1] * len(response), status=SampleStatus.COMPLETED)


def load_preference_pairs(spec: str, tokenizer: Any, fmt: PromptFormat, chosen_key: str, rejected_key: str,
                          max_tokens: int | None = None, margin_key: str | None = None) -> list[Sample]:
    """One `Sample` per pair (module doc); ``Sample.index`` is the row number in the file; the margin, when
    ``margin_key`` is given, in the chosen sample's ``metadata["margin"]``."""
    path, indexed = read_spec_rows(spec)
    if tokenizer.eos_token_id is None:
        raise DatasetError(f"{spec}: the tokenizer has no EOS token to end the completions with")
    pairs, too_long, too_long_for_the_model = [], 0, 0
    for row_index, row in indexed:
        where = row_label(path, row_index)
        for key in (fmt.input_key, chosen_key, rejected_key, *([margin_key] if margin_key else [])):
            if row.get(key) is None:
                raise DatasetError(f"{where}: missing field {key!r}; row has {sorted(row)}")
        try:
            prompt_text = render_prompt(row[fmt.input_key], tokenizer, fmt.apply_chat_template, fmt.system_prompt,
                                        fmt.apply_chat_template_kwargs)
            prompt_tokens = encode_prompt(tokenizer, prompt_text)
        except ValueError as err:
            raise DatasetError(f"{where}: field {fmt.input_key!r}: {err}") from None
        completions = []
        for key in (chosen_key, rejected_key):
            value = row[key]
            try:
                text = _completion_text(row[fmt.input_key], value, prompt_text, tokenizer, fmt)
            except ValueError as err:
                raise DatasetError(f"{where}: field {key!r} {err}") from None
            completion = _completion_sample(prompt_text, prompt_tokens, text, isinstance(value, str), tokenizer)
            if max_tokens is not None and len(completion.tokens) > max_tokens:
                raise DatasetError(f"{where}: field {key!r}: prompt and completion take {len(completion.tokens)} "
                                   f"tokens, more than --max-tokens-per-gpu {max_tokens} (one sequence must fit a "
                                   "micro-batch)")
            completions.append(completion)
        chosen, rejected = completions
        if chosen.tokens == rejected.tokens:
            raise DatasetError(f"{where}: fields {chosen_key!r} and {rejected_key!r} are the same completion: there "
                               "is no preference to learn")
        if fmt.max_prompt_len is not None and len(prompt_tokens) > fmt.max_prompt_len:
            too_long += 1
            continue
        if fmt.model_positions is not None and max(len(c.tokens) for c in completions) > fmt.model_positions:
            too_long_for_the_model += 1
            continue
        metadata = row_metadata(row, fmt, where)
        for completion in completions:
            completion.index = row_index
            completion.metadata = dict(metadata)
        chosen.metadata["rejected"] = rejected
        if margin_key is not None:
            chosen.metadata["margin"] = _margin(row[margin_key], where, margin_key)
        pairs.append(chosen)
    return kept_or_refused(spec, path, pairs, "pair", [
        (too_long, f"whose prompt is longer than --rollout-max-prompt-len ({fmt.max_prompt_len} tokens)"),
        (too_long_for_the_model, f"with a completion {past_positions(fmt)}")])


def _margin(value: Any, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DatasetError(f"{where}: field {key!r} must be a finite number (the pair's margin), got {value!r}")
    return float(value)


def pair_samples(pairs: list[Sample]) -> list[Sample]:
    """The completions of ``pairs`` laid out ``[chosen_0, rejected_0, chosen_1, ...]`` (the rejected twins taken
    out of the chosen samples' metadata), each marked ``metadata["preferred"]``."""
    samples = []
    for chosen in pairs:
        rejected = chosen.metadata.pop("rejected")
        chosen.metadata["preferred"], rejected.metadata["preferred"] = True, False
        samples += [chosen, rejected]
    return samples
