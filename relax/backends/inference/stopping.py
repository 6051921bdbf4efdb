"""When a response stops: stop token ids (EOS unless ignored) and stop strings, for both decode paths of the
embedded engine's core (either runner) and the servers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from relax.backends.inference.base import SamplingParams


class Stoppable(Protocol):
    params: SamplingParams
    output_ids: list[int]
    stop_window_tokens: int
    finish_reason: str | None


def stop_token_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)


def stop_window_tokens(params: SamplingParams) -> int:
    """How many output tokens to decode to find a stop string that ends in the newest one: a token decodes to at
    least one UTF-8 byte (special tokens aside), so a stop string of n bytes ends within the last n tokens; one
    more covers decoders that strip the leading space of the first token, one more a partial character."""
    return max((len(stop.encode()) for stop in params.stop), default=0) + 2


def finish_on_stop_strings(rows: Sequence[Stoppable], tokenizer: Any) -> None:
    """Finish with "stop" the rows (rows that just got a token) whose output text now holds one of their stop
    strings; a stop string beats "length" on the same token. Only the tail of each output is decoded, in one
    batched call: a match found now ends in the newest token, since the previous step's tail had none. The
    matching token is kept."""
    candidates = [row for row in rows if row.params.stop and row.finish_reason != "stop"]
    if not candidates:
        return
    tails = tokenizer.batch_decode([row.output_ids[-row.stop_window_tokens:] for row in candidates],
                                   skip_special_tokens=True)
    for row, tail in zip(candidates, tails):
        if any(stop in tail for stop in row.params.stop):
            row.finish_reason = "stop"
