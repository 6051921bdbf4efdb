"""The bodies of `relax serve`'s answers: SGLang's ``/generate`` result, OpenAI's usage, log-probs as JSON allows
them, and each generated token's share of the text (OpenAI's ``logprobs.tokens`` and ``text_offset``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from relax.backends.inference.base import GenerationOutput, GenerationRequest
from relax.backends.models.routing_replay import encode_routes
from relax.serving.protocol import SGLangSamplingParams


def token_pieces(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token's share of the decoded text (special tokens skipped): joined, the pieces are
    ``tokenizer.decode(token_ids, skip_special_tokens=True)``. A token that ends inside a character gets "" and the
    character goes to the token that completes it; a special token (EOS) gets "". Two short decodes per token."""
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    pieces: list[str] = []
    context, start = 0, 0  # decode from `context` (so a piece keeps its leading space); emitted up to `start`
    for end in range(1, len(token_ids) + 1):
        before, text = decode(token_ids[context:start]), decode(token_ids[context:end])
        if len(text) > len(before) and text.startswith(before) and not text.endswith("\ufffd"):
            pieces.append(text[len(before):])
            context, start = start, end
        else:
            pieces.append("")
    full = decode(token_ids)
    joined = "".join(pieces)
    if joined != full:  # a decoder whose pieces do not add up (rare): exact prefix differences instead
        pieces, before = [], ""
        for end in range(1, len(token_ids) + 1):
            text = decode(token_ids[:end])
            pieces.append(text[len(before):] if text.startswith(before) else "")
            before = text if text.startswith(before) else before
        if pieces:
            pieces[-1] += full[len("".join(pieces)):] if full.startswith("".join(pieces)) else ""
    return pieces


def text_tokens(pieces: Sequence[str], text: str) -> tuple[list[str], list[int]]:
    """The tokens (pieces) that make up ``text``, a prefix of the pieces' join (the output cut at a stop string),
    and each one's offset: they join to ``text`` exactly. Tokens past its end, such as a final EOS that the text
    leaves out, are not listed; one that straddles the end is cut at it."""
    tokens, offsets, position = [], [], 0
    for piece in pieces:
        if position >= len(text):
            break
        tokens.append(piece[:len(text) - position])
        offsets.append(position)
        position += len(tokens[-1])
    return tokens, offsets


def json_log_probs(output: GenerationOutput) -> list[float | None]:
    """Log-probs as JSON allows them: a non-finite one (only broken weights give one) becomes null, not the
    `NaN` literal that no JSON parser accepts."""
    return [lp if math.isfinite(lp) else None for lp in output.output_log_probs]


def usage(prompts: list[list[int]], outputs: list[GenerationOutput]) -> dict[str, int]:
    # Every prompt of the request counts, repeated ones too; n samples of one prompt count it once, as OpenAI does.
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(output.output_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sglang_result(output: GenerationOutput, request: GenerationRequest, params: SGLangSamplingParams,
                   return_logprob: bool, latency_s: float, trimmed_text) -> dict[str, Any]:
    finish: dict[str, Any] = {"type": output.finish_reason}
    stop_ids = set(request.sampling_params.stop_token_ids)
    if output.finish_reason == "length":
        finish["length"] = len(output.output_ids)
    elif output.finish_reason == "stop":
        last = output.output_ids[-1] if output.output_ids else None
        matched = next((s for s in request.sampling_params.stop if s in output.text), None)
        finish["matched"] = matched if matched is not None and last not in stop_ids else last
    else:
        finish["message"] = "aborted"
    stop = [] if params.no_stop_trim else request.sampling_params.stop
    meta: dict[str, Any] = {
        "id": request.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(output.output_ids),
        "cached_tokens": 0,
        "weight_version": output.weight_version,
        "e2e_latency": latency_s,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, token, None]
                                         for lp, token in zip(json_log_probs(output), output.output_ids)]
        if output.output_weight_versions is not None:
            meta["output_token_weight_versions"] = output.output_weight_versions
    if output.routed_experts is not None:
        meta["routed_experts"] = encode_routes(output.routed_experts)
    return {"text": trimmed_text(output, stop), "output_ids": output.output_ids, "meta_info": meta}
