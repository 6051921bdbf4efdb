"""How much generation one client may ask of `relax serve`, and how much the server holds at once.

A request's sequences (prompts x ``n``) and tokens (each sequence's prompt plus the new tokens it may generate)
are bounded: past a bound the request is answered 400 naming the bound and its flag, before any work. The
sequences in flight on the server are bounded too: a request that would pass that bound is answered 429 with
``Retry-After`` (the server is busy, not the request wrong), so a flood of requests queues in the clients, not in the
server's memory. A prompt must fit the model too (`ModelLimits`: token ids in its vocabulary, prompt and new tokens
within its context), checked before the engine sees it. The HTTP bounds every server shares (body size,
connections, read deadlines) are `relax.utils.http_server.HTTPLimits`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

from relax.backends.inference.base import InferenceEngine
from relax.serving.protocol import NEW_TOKEN_FIELDS, TOKEN_ID_MARKER

RETRY_AFTER_S = 1


class BadRequest(HTTPException):
    """HTTP 400 with a message naming the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


@dataclass(frozen=True)
class GenerationLimits:
    """Bounds on generation work (see the module doc); each has a flag on `relax serve`."""

    max_sequences_per_request: int = 1024
    max_tokens_per_request: int = 4 * 1024 * 1024
    max_inflight_sequences: int = 16384

    def __post_init__(self) -> None:
        for name in ("max_sequences_per_request", "max_tokens_per_request", "max_inflight_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LimitExceeded(HTTPException):
    """400 (the request alone asks too much) or 429 (the server is full now), naming the bound."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
        super().__init__(status, message, headers=headers)
        self.param = param


class Admission:
    """The sequences in flight on one server, admitted against `GenerationLimits`."""

    def __init__(self, limits: GenerationLimits) -> None:
        self.limits = limits
        self.inflight_sequences = 0

    def check(self, prompt_lengths: Sequence[int], samples_per_prompt: int, max_new_tokens: int,
              prompt_field: str) -> None:
        """Raise 400 when the request alone passes a per-request bound."""
        sequences = len(prompt_lengths) * samples_per_prompt
        if sequences > self.limits.max_sequences_per_request:
            raise LimitExceeded(400, f"{prompt_field}: the request asks for {sequences} sequences (prompts x n); "
                                f"this server takes at most {self.limits.max_sequences_per_request} per request "
                                "(--max-sequences-per-request)", prompt_field)
        tokens = samples_per_prompt * sum(length + max_new_tokens for length in prompt_lengths)
        if tokens > self.limits.max_tokens_per_request:
            raise LimitExceeded(400, f"{prompt_field}: the request asks for {tokens} tokens (prompt and new tokens "
                                f"of every sequence); this server takes at most {self.limits.max_tokens_per_request} "
                                "per request (--max-tokens-per-request)", prompt_field)

    def check_room(self, sequences: int) -> None:
        """429 when the server cannot take ``sequences`` more now."""
        if self.inflight_sequences + sequences > self.limits.max_inflight_sequences:
            raise LimitExceeded(429, f"the server is full ({self.inflight_sequences} sequences in flight, at most "
                                f"{self.limits.max_inflight_sequences}: --max-inflight-sequences); retry after "
                                f"{RETRY_AFTER_S} s")

    @contextmanager
    def admit(self, sequences: int) -> Iterator[None]:
        """Hold ``sequences`` in flight for the block; 429 when the server cannot take them now."""
        self.check_room(sequences)
        with self.hold(sequences):
            yield

    @contextmanager
    def hold(self, sequences: int) -> Iterator[None]:
        """Count ``sequences`` in flight for the block (a streamed answer, checked by `check_room` before its
        response started)."""
        self.inflight_sequences += sequences
        try:
            yield
        finally:
            self.inflight_sequences -= sequences


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt must fit: token ids below ``vocab_size`` and prompt + new tokens within ``context_length``
    (None: unknown, not checked). Outside them the engine fails deep inside a forward (an index error, or a
    mask of max_new_tokens columns allocated up front), which would be a 500 or an out-of-memory."""

    vocab_size: int | None = None
    context_length: int | None = None
    # The most characters one token stands for (its vocabulary entry's length bounds it; byte-level entries count
    # bytes, which are at least the characters): a text longer than context_length x this cannot fit, whatever
    # it tokenizes to, and is refused without tokenizing it.
    max_token_chars: int | None = None

    @classmethod
    def of(cls, engine: InferenceEngine, tokenizer: Any = None) -> ModelLimits:
        model = getattr(engine, "model", None)  # the embedded engine's Hugging Face model
        if model is None:
            return cls()
        text_config = model.config.get_text_config()
        vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        return cls(model.get_input_embeddings().num_embeddings,
                   getattr(text_config, "max_position_embeddings", None),
                   max((len(entry) for entry in vocabulary), default=None))

    def check_text(self, text: str, field: str) -> None:
        """Refuse a text that cannot fit the context, by its length alone (before the tokenizer sees it)."""
        if self.context_length is None or self.max_token_chars is None:
            return
        bound = self.context_length * self.max_token_chars
        if len(text) > bound:
            raise BadRequest(f"{field}: {len(text)} characters cannot fit the model's context of "
                             f"{self.context_length} tokens (at most {self.max_token_chars} characters a token)",
                             field)

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, prompt_field: str,
              length_field: str) -> None:
        """Raise `BadRequest` naming ``prompt_field`` or ``length_field`` for the first prompt that does not fit."""
        for index, prompt in enumerate(prompts):
            if self.vocab_size is not None:
                bad = next((token for token in prompt if not 0 <= token < self.vocab_size), None)
                if bad is not None:
                    raise BadRequest(f"{prompt_field}: token id {bad} of prompt {index} is outside the "
                                     f"vocabulary [0, {self.vocab_size})", prompt_field)
            if self.context_length is None:
                continue
            if len(prompt) >= self.context_length:
                raise BadRequest(f"{prompt_field}: prompt {index} has {len(prompt)} tokens; the model's context "
                                 f"length is {self.context_length}", prompt_field)
            if len(prompt) + max_new_tokens > self.context_length:
                raise BadRequest(f"{length_field}: {len(prompt)} prompt tokens + {max_new_tokens} new tokens exceed "
                                 f"the model's context length {self.context_length}", length_field)

    def publish(self, openapi: dict[str, Any]) -> None:
        """Write the limits into the app's OpenAPI document, so that clients and fuzzers see the bounds this
        server enforces."""
        _publish_token_id_maximum(openapi, None if self.vocab_size is None else self.vocab_size - 1)
        if self.context_length is None:
            return
        schemas = openapi.get("components", {}).get("schemas", {})
        for model, fields in NEW_TOKEN_FIELDS.items():
            for name in fields:
                field = schemas.get(model, {}).get("properties", {}).get(name, {})
                for option in field.get("anyOf", [field]):
                    if option.get("type") == "integer":
                        option["maximum"] = self.context_length - 1  # the prompt takes at least one token


def _publish_token_id_maximum(node: Any, maximum: int | None) -> None:
    """Replace each token-id marker of a JSON schema by ``maximum`` (None: drop the marker)."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID_MARKER, False) and maximum is not None:
            node["maximum"] = maximum
        children = list(node.values())
    else:
        children = node if isinstance(node, list) else []
    for child in children:
        _publish_token_id_maximum(child, maximum)
