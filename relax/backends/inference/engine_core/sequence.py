"""One request inside the engine core: its tokens, blocks and outputs."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.backends.inference.base import FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from relax.backends.inference.engine_core.media import MediaPrompt


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV in the pool (new, or preempted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` are the prompt then the outputs; the K/V of the first ``num_cached`` of them are in the pool.

    ``seed`` drives the sampling noise of every token of this sequence (with the token's position), so the
    tokens do not depend on which other sequences share a step. ``stop_token_ids`` includes EOS unless the
    request ignores it.
    """

    request: GenerationRequest
    seed: int
    stop_token_ids: frozenset[int]
    stop_window_tokens: int  # stop strings are searched in the decoded text of this many last output tokens
    arrival: int  # admission order: the youngest running sequence is preempted first
    future: asyncio.Future | None = None
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    output_log_probs: list[float] = field(default_factory=list)
    output_weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # In a prefill step: the sequence whose prompt this one shares whole, whose logits it samples from.
    prefill_twin_of: Sequence | None = None
    # Tokens sampled on the device that the host has not read yet (0 or 1: the engine reads step t while the
    # device runs step t + 1); they count in `num_tokens`, not in `token_ids`.
    pending: int = 0
    media: MediaPrompt | None = None  # a multimodal prompt's features, 3D rope and block keys
    # [n, L, k] host tensors: the routed experts of the tokens fed so far, in order (when the request asks for them)
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    cohort: Any = None  # the cache runner's batch that holds this sequence's cache row (`cache_runner.Cohort`)
    cache_generation: int = -1  # the pool's prefix-cache generation when its K/V began (`BlockManager.generation`)
    # Facts of the request read at every step, computed once (`__post_init__`): the token count at which it ends
    # with "length" (the engine lowers it to the model's last position), and whether its sampling filters the
    # distribution (top-k/top-p), which the decode graph's sampler does not.
    length_limit: int = 0
    filters: bool = False
    # Its `GenerationOutput`, built once when it finished (`EngineCore._output`): the streamed report and the call's
    # return share it, so the output's text is decoded once.
    output: GenerationOutput | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.input_ids)
            self.num_prompt_tokens = len(self.token_ids)
        params = self.params
        self.length_limit = self.num_prompt_tokens + params.max_new_tokens
        self.filters = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens so far, a sampled one the host has not read yet included."""
        return len(self.token_ids) + self.pending

    @property
    def rope_delta(self) -> int:
        """A token at index i past the prompt sits at rope position i + rope_delta (0 for text)."""
        return self.media.rope_delta if self.media is not None else 0

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens that key this sequence's blocks: its own, media placeholders replaced by the media's hash."""
        if self.media is None:
            return self.token_ids
        return list(self.media.key_tokens) + self.token_ids[self.num_prompt_tokens:]

    def routed_experts_output(self) -> torch.Tensor | None:
        """``[T - 1, L, k]``: the experts of every token fed to the model but the last one (`routing_replay`); a
        token computed past the sequence's end (the core runs one step ahead) is cut off."""
        if not self.request.return_routed_experts or not self.routed_experts:
            return None
        return torch.cat(self.routed_experts)[:len(self.token_ids) - 1]

    def __len__(self) -> int:
        return len(self.token_ids)
