"""How much generation one client may ask of `relax serve`, and how much the server holds at once.

A request's sequences (prompts x ``n``) and tokens (each sequence's prompt plus the new tokens it may generate)
are bounded: past a bound the request is answered 400 naming the bound and its flag, before any work. The
sequences in flight on the server are bounded too: a request that would pass that bound is answered 429 with
``Retry-After`` (the server is busy, not the request wrong), so a flood of requests queues in the clients, not in the
server's memory. The HTTP bounds every server shares (body size, connections, read deadlines) are
`relax.utils.http_server.HTTPLimits`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from starlette.exceptions import HTTPException

RETRY_AFTER_S = 1


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
