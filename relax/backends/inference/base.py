"""The `InferenceEngine` contract shared by the embedded engine and the HTTP adapters."""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["stop", "length", "abort"]


# Temperatures below this are greedy decoding (as vLLM's 1e-5): dividing logits by 1e-38 overflows float32 to
# infinity, and the "samples" and log-probs of such a step are NaN, not the greedy tokens they approach.
GREEDY_TEMPERATURE = 1e-5


def occurrence_seed(seed: int, occurrence: int) -> int:
    """The sampling seed of the ``occurrence``-th request (from 0) of one call that carry the same ``seed``: distinct
    streams for the samples of a group. A caller that spreads one call's requests over several engines gives each
    request this seed itself, so that the split changes no token."""
    seed %= 2**63
    return seed if occurrence == 0 else (seed * 1_000_003 + 7919 * occurrence) % (2**63)


@dataclass
class SamplingParams:
    """How to sample one request. ``top_k <= 0`` and ``top_p >= 1`` disable those filters;
    ``temperature == 0`` (or below `GREEDY_TEMPERATURE`, which is taken as 0) means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # An empty stop string "matches" after the first token; no client means that, so it is no stop string.
        self.stop = [stop for stop in self.stop if stop]
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0


# Who paused an engine. An engine stays paused while any owner holds a pause, so a weight update (which pauses
# around its copy) never lifts the pause an operator set with /pause_generation, nor the other way round.
PAUSE_OPERATOR = "operator"


class PauseHolds:
    """The owners currently pausing an engine; truthy while any holds."""

    def __init__(self) -> None:
        self._owners: set[str] = set()

    def hold(self, owner: str) -> bool:
        """Add ``owner``'s hold; True when this paused an engine that ran."""
        was_running = not self._owners
        self._owners.add(owner)
        return was_running

    def release(self, owner: str) -> bool:
        """Drop ``owner``'s hold; True when this let a paused engine run again."""
        was_paused = bool(self._owners)
        self._owners.discard(owner)
        return was_paused and not self._owners

    def __bool__(self) -> bool:
        return bool(self._owners)


@dataclass
class GenerationRequest:
    request_id: str
    input_ids: list[int]
    sampling_params: SamplingParams
    multimodal_inputs: dict[str, Any] | None = None
    # Called with (token id, log-prob) as each token is generated, for streaming responses; in-process engines
    # call it between decode steps, HTTP adapters ignore it.
    on_token: Callable[[int, float], None] | None = field(default=None, compare=False, repr=False)
    # Also return the experts each MoE layer chose for every token fed to the model (rollout routing replay).
    return_routed_experts: bool = False
    # An agent session this request is a turn of: an in-process engine keeps the session's K/V (prompt and answer)
    # for its next turn until `close_session` or an idle timeout (`engine_core.scheduler`); others ignore it.
    session_id: str | None = None


@dataclass
class GenerationOutput:
    """``output_ids`` are the generated ids (a matched stop string or stop token is kept, EOS too);
    ``output_log_probs[i]`` is log p(output_ids[i]) under the sampling distribution after
    temperature scaling and before top-p/top-k filtering; ``weight_version`` is the version of the
    weights that produced the last token, and ``output_weight_versions[i]`` (when the engine
    reports it) the version that produced token i, which differs only if the weights were updated
    while the request was in flight. ``routed_experts`` (asked for with ``return_routed_experts``)
    holds the experts of every token of input + output but the last, ``[T - 1, L, k]`` from an
    in-process engine, flattened from an HTTP one (`relax.backends.models.routing_replay`)."""

    request_id: str
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: FinishReason
    weight_version: int
    text: str = ""
    output_weight_versions: list[int] | None = None
    routed_experts: torch.Tensor | None = None


@dataclass
class ScoreRequest:
    """Score the last ``response_length`` tokens of ``input_ids`` (a teacher's view of a sample)."""

    input_ids: list[int]
    response_length: int
    temperature: float = 1.0
    top_k: int = 0  # also return the top_k most likely tokens at each response position


@dataclass
class ScoreOutput:
    log_probs: list[float]  # log p(token) of each response token
    top_ids: list[list[int]] | None = None  # [response_length][top_k]
    top_log_probs: list[list[float]] | None = None


# A rollout names each request g{group}-i{index}-{position} (`relax.rollout.generation.generate`): the samples of a
# GRPO group share the prefix, so engines keep a group together (one batch shares its prompt's prefill).
GROUP_PREFIX = re.compile(r"^g(\d+)-")


def group_key(request_id: str) -> str:
    """``g3-i12-0`` -> ``g3``; any other id is its own group."""
    match = GROUP_PREFIX.match(request_id)
    return f"g{match.group(1)}" if match else request_id


def positions_by_group(requests: Sequence[GenerationRequest]) -> dict[str, list[int]]:
    """The positions of ``requests`` per prompt group, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for position, request in enumerate(requests):
        groups.setdefault(group_key(request.request_id), []).append(position)
    return groups


OutputCallback = Callable[[int, "GenerationOutput"], None]


class OutputReporter:
    """``on_output`` once per position of a call, with the first output reported for it: an engine that retries a
    call (a recovery, another engine) may produce a position twice; the caller keeps what it was told first."""

    def __init__(self, count: int, on_output: OutputCallback | None) -> None:
        self.count = count
        self.on_output = on_output
        self.outputs: dict[int, GenerationOutput] = {}

    def __call__(self, position: int, output: GenerationOutput) -> None:
        if position not in self.outputs:
            self.outputs[position] = output
            if self.on_output is not None:
                self.on_output(position, output)

    def finish(self, outputs: Sequence[GenerationOutput]) -> list[GenerationOutput]:
        """Report what is left of the call's ``outputs``; the outputs as reported, in request order."""
        for position, output in enumerate(outputs):
            self(position, output)
        return [self.outputs[position] for position in range(self.count)]


class InferenceEngine(abc.ABC):
    """Async engine API. All methods are coroutines so that local and remote engines are
    called the same way."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Generate every request; outputs come back in request order."""

    async def generate_streaming(self, requests: Sequence[GenerationRequest],
                                 on_output: OutputCallback) -> list[GenerationOutput]:
        """`generate`, calling ``on_output(position, output)`` once per request as soon as this engine knows that
        request finished, so a caller can act on early finishers (a rollout writes a GRPO group to training the
        moment its last sample ends). An engine that only knows at the end of the call (this default) reports
        every request then. The returned outputs are the reported ones."""
        return OutputReporter(len(requests), on_output).finish(await self.generate(requests))

    def check_requests(self, requests: Sequence[GenerationRequest]) -> None:
        """Raise ValueError or TypeError, naming the request, for one this engine cannot serve, before any work
        (a batcher checks each caller's requests alone, so one caller's bad request fails no other caller)."""

    async def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreOutput]:
        """Log-probs of given tokens under the served weights (a teacher for on-policy distillation)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score tokens")

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop the named in-flight requests; they finish with ``finish_reason == "abort"``."""

    @abc.abstractmethod
    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        """Stop admitting new work and let in-flight work reach a safe point. Pauses are held per ``owner``
        (`PauseHolds`): the engine runs again once every owner that paused it resumed it."""

    @abc.abstractmethod
    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        """Drop ``owner``'s pause."""

    @abc.abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load tensors in Hugging Face naming and start serving ``version``."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]:
        """A small status dict; raises if the engine cannot serve."""

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Free device memory while another phase uses the device (SGLang's name and tags: ``weights``,
        ``kv_cache``; None: all). The engine is idle meanwhile; `resume_memory_occupation` undoes it."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Allocate what `release_memory_occupation` freed. Released weights come back unloaded: the caller
        sends them (`update_weights`) before the next generation, which refuses to run until then."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    # The publisher (trainer process) of the served weights, when they came from a versioned directory: a new one
    # may restart the version sequence (`relax.distributed.weight_sync.goes_backwards`).
    weight_run: str | None = None

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version of the weights currently served."""
