"""The Hugging Face decode loop of the embedded engine: batches decoded by the model's own forward with a
``DynamicCache``, one token step at a time.

It serves what the engine core does not (`relax.backends.inference.engine_core.decoder.unsupported_reason`: MoE
layers, Qwen3-VL's deepstack features, linear-attention layers, routing-replay capture) and every model with
``--engine-core off``, the default on CPU. `EmbeddedEngine` owns the engine's face (pause, abort, weights, memory);
this loop owns a batch's device state and steps.

Cost per step. One forward and one host synchronization (reading the sampled tokens back, which
stop checks need); log-probs come back in the same copy. Rows that finish stop costing compute
once enough of them have finished (`COMPACT_WHEN_FINISHED_FRACTION`). Decoding a small model is
bound by the Python of the Hugging Face forward, so this loop matches ``model.generate`` there.

Prefill sharing. Requests with the same prompt (the samples of one GRPO group) share one prefill row, and every
row gets its own copy of the prompt's cache after the first forward.

Reproducibility. The requests of one call that carry the same ``sampling_params.seed`` draw their randomness from
one ``torch.Generator`` on the model's device, seeded with it and consumed by their rows in batch order; the
requests without a seed share one randomly seeded generator. A batch with several seeds fills each seed's rows of
the sampling noise from its generator (one small draw per seed and step) and samples in one pass.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from relax.backends.inference.base import FinishReason, GenerationOutput, GenerationRequest, SamplingParams
from relax.backends.inference.sampling import BatchSampling, RowGenerators, sample_next_tokens
from relax.backends.inference.stopping import finish_on_stop_strings, stop_token_ids, stop_window_tokens
from relax.backends.models.family import MediaTokens, concat_inputs, forward_inputs, rope_positions
from relax.backends.models.routing_replay import RoutingRecorder

# A batch drops its finished rows (and their KV cache) once at least this fraction of its rows
# has finished. Dropping costs one copy of the cache, about what one decode step's cache append
# costs, so it pays off only when it removes a good share of the per-step work. Measured with
# max_new_tokens uniform in 1..64 (tiny Qwen3, batch 64, CPU): 1,880 tok/s never dropping,
# 3,130 at 0.25, 3,160 at 0.5, 2,940 dropping at every finish. On an H200 (Qwen3-0.6B shape, bf16)
# decoding is bound by Python, not by batch size, and the four choices measured the same.
COMPACT_WHEN_FINISHED_FRACTION = 0.25


# On CUDA, torch's SDPA may pick cuDNN attention, which builds an execution graph per attention
# shape, cached per thread (tens of milliseconds each on an H200). Decoding meets a new shape at every step
# (the KV length grows; batches and prompt lengths vary), so the engine's forwards use the
# backends that need no per-shape build.
DECODE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _RowState:
    """The progress of one request inside a decode batch."""

    request: GenerationRequest
    stop_token_ids: frozenset[int]
    # Stop strings are searched in the decoded text of the last `stop_window_tokens` output ids.
    stop_window_tokens: int
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    output_weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # [n, L, k] host tensors: the experts of the tokens fed so far (prompt, then each fed output token)
    routed_experts: list[torch.Tensor] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling_params


def select_cache_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep (or repeat) the cache rows at ``index``, for every kind of layer: attention layers' keys and values
    and linear-attention layers' convolution and recurrent states (Qwen3.5, Qwen3-Next), which
    ``DynamicCache.batch_select_indices`` leaves out (its linear layers have no such method)."""
    for layer in cache.layers:
        layer.reorder_cache(index)


@dataclass
class _SeedGroup:
    """The rows of a decode batch that share a sampling seed, and so a generator."""

    generator: torch.Generator
    rows: torch.Tensor  # (R,) int64 batch positions


@dataclass
class _DecodeBatch:
    """The device state of a batch; row i of every tensor is batch position i."""

    input_ids: torch.Tensor  # (B, S) int64: the left-padded prompts, then (B, 1) the last tokens
    # (B, S) int64 aligned with input_ids; (3, B, S) for multimodal rope (temporal, height, width)
    position_ids: torch.Tensor
    # (B, longest prompt + longest max_new_tokens) int64, 0 on left padding; a step reads its first
    # `sequence_length` columns, so no step reallocates it.
    attention_mask: torch.Tensor
    sequence_length: int  # cached tokens + input tokens of the next step, padding included
    cache: DynamicCache
    sampling: BatchSampling
    # Set before the first step when requests share prompts (a GRPO group): the prompts are
    # prefilled once each, then row i of the batch takes prompt `prefill_source[i]`, cache included.
    prefill_source: torch.Tensor | None = None
    # Extra forward arguments of the first step only: the media tensors of a multimodal prefill.
    prefill_kwargs: dict[str, torch.Tensor] | None = None
    # The call's generators by seed (None: the unseeded requests'), shared by all its batches.
    generators: dict[int | None, torch.Generator] = field(default_factory=dict)
    _seed_groups: list[_SeedGroup] | None = field(default=None, init=False, repr=False)

    def seed_groups(self) -> list[_SeedGroup]:
        """The batch rows grouped by seed, each with its generator."""
        if self._seed_groups is None:
            rows_by_seed: dict[int | None, list[int]] = {}
            for row, params in enumerate(self.sampling.params):
                rows_by_seed.setdefault(params.seed, []).append(row)
            device = self.input_ids.device
            self._seed_groups = [
                _SeedGroup(self.generators[seed], torch.tensor(rows, device=device))
                for seed, rows in rows_by_seed.items()
            ]
        return self._seed_groups

    def expand_after_prefill(self) -> None:
        """Give every request its own copy of its prompt's prefill state."""
        index, self.prefill_source = self.prefill_source, None
        select_cache_rows(self.cache, index)
        self.position_ids = self.position_ids.index_select(-2, index)
        self.attention_mask = self.attention_mask[index]

    def advance(self, next_tokens: torch.Tensor) -> None:
        """Make the sampled tokens, (B,) int64, the next step's inputs."""
        self.input_ids = next_tokens[:, None]
        self.position_ids = self.position_ids[..., -1:] + 1
        self.sequence_length += 1
        self.prefill_kwargs = None

    def select(self, positions: list[int]) -> None:
        """Keep only the rows at ``positions``, in that order, cache included."""
        index = torch.tensor(positions, device=self.input_ids.device)
        select_cache_rows(self.cache, index)
        self.input_ids = self.input_ids[index]
        self.position_ids = self.position_ids.index_select(-2, index)
        self.attention_mask = self.attention_mask[index]
        self.sampling = self.sampling.select_rows(positions)
        self._seed_groups = None


class HFDecodeLoop:
    """Batches decoded to completion by the model's own Hugging Face forward (module docstring). ``step_boundary``
    is the engine's: it yields, holds the batch while the engine is paused and says which requests were aborted;
    ``weight_version`` reads the version the engine serves, recorded per token."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int],
                 suppressed_ids: torch.Tensor, media_tokens: MediaTokens, routing: RoutingRecorder | None,
                 step_boundary: Callable[[set[str]], Awaitable[set[str]]], weight_version: Callable[[], int]) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self._eos_token_ids = eos_token_ids
        self._suppressed_ids = suppressed_ids
        self._media_tokens = media_tokens
        self._routing = routing
        self._step_boundary = step_boundary
        self._weight_version = weight_version
        self._pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # transformers 5.24 names the KV-cache argument `cache`; earlier 5.x releases call it
        # `past_key_values` (5.24 still accepts that, with a deprecation warning).
        forward_parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self.steps = 0  # decode steps so far, the prefill included (the engine's liveness signal)

    async def generate_batch(
        self, requests: list[GenerationRequest], generators: dict[int | None, torch.Generator]
    ) -> list[GenerationOutput]:
        """Decode one batch to completion; outputs in request order."""
        rows = [self._new_row_state(request) for request in requests]
        batch = self._prefill_inputs(rows)
        batch.generators = generators
        recorder = self._routing if any(request.return_routed_experts for request in requests) else None
        # Batch position i holds rows[live_rows[i]]; finished rows stay (their tokens ignored)
        # until enough have finished to make dropping them worth a cache copy.
        live_rows = list(range(len(rows)))
        prefilled = False
        while True:
            unfinished_ids = {rows[row].request.request_id for row in live_rows if rows[row].finish_reason is None}
            aborted_ids = await self._step_boundary(unfinished_ids)
            if aborted_ids:
                for row in live_rows:
                    if rows[row].finish_reason is None and rows[row].request.request_id in aborted_ids:
                        rows[row].finish_reason = "abort"
            else:
                version = self._weight_version()
                # which prompt row each batch row reads in the prefill step (which expands them), None after it
                prompt_of_row = None if prefilled else (batch.prefill_source.tolist() if batch.prefill_source
                                                        is not None else list(range(len(live_rows))))
                with torch.inference_mode(), recorder.recording() if recorder else contextlib.nullcontext():
                    next_tokens, tokens_host, log_probs_host = self._decode_step(batch)
                self.steps += 1
                if recorder is not None:
                    _keep_routes(recorder.take(), [rows[row] for row in live_rows], prompt_of_row)
                prefilled = True
                stepped_rows = []
                for batch_position, row in enumerate(live_rows):
                    if rows[row].finish_reason is None:
                        self._append_token(
                            rows[row], int(tokens_host[batch_position]), log_probs_host[batch_position], version
                        )
                        stepped_rows.append(rows[row])
                finish_on_stop_strings(stepped_rows, self.tokenizer)
                batch.advance(next_tokens)

            keep = [position for position, row in enumerate(live_rows) if rows[row].finish_reason is None]
            if not keep:
                return [self._to_output(row) for row in rows]
            if len(live_rows) - len(keep) >= COMPACT_WHEN_FINISHED_FRACTION * len(live_rows):
                batch.select(keep)
                live_rows = [live_rows[position] for position in keep]

    def _prefill_inputs(self, rows: list[_RowState]) -> _DecodeBatch:
        """Left-pad the distinct prompts into the first step's inputs.

        Requests with the same prompt (the samples of one GRPO group) share one prefill row: with
        short answers the prefill is about half of a rollout's compute, so a group of 8 saves most
        of it. Sampling settings cover every request; rows expand after the first forward."""
        first_row_of_prompt: dict[tuple, int] = {}
        prompts: list[list[int]] = []
        prompt_media: list[dict[str, torch.Tensor] | None] = []
        source_of_row = []
        for row in rows:
            media = row.request.multimodal_inputs or None
            # Equal token ids with different images are different prompts: the media object is part of the key.
            key = (tuple(row.request.input_ids), id(media) if media else None)
            if key not in first_row_of_prompt:
                first_row_of_prompt[key] = len(prompts)
                prompts.append(row.request.input_ids)
                prompt_media.append(media)
            source_of_row.append(first_row_of_prompt[key])
        longest_prompt = max(len(prompt) for prompt in prompts)
        longest_output = max(row.params.max_new_tokens for row in rows)
        input_ids = torch.full((len(prompts), longest_prompt), self._pad_token_id, dtype=torch.long)
        attention_mask = torch.ones(len(prompts), longest_prompt + longest_output, dtype=torch.long)
        for index, prompt in enumerate(prompts):
            padding = longest_prompt - len(prompt)
            input_ids[index, padding:] = torch.tensor(prompt)
            attention_mask[index, :padding] = 0
        attention_mask = attention_mask.to(self.device)
        prompt_mask = attention_mask[:, :longest_prompt]
        input_ids = input_ids.to(self.device)
        # Positions count real tokens only, as in `model.generate`; pad positions are masked anyway.
        position_ids = (prompt_mask.cumsum(dim=-1) - 1).masked_fill(prompt_mask == 0, 1)
        prefill_kwargs = None
        if self._media_tokens.ids:
            media = concat_inputs(prompt_media)
            position_ids = rope_positions(self.model, input_ids, prompt_mask, media)
            if position_ids is None:
                position_ids = (prompt_mask.cumsum(dim=-1) - 1).masked_fill(prompt_mask == 0, 1)
            prefill_kwargs = forward_inputs(self.model, media, input_ids, self.device, self.model.dtype) if media else None
        shared = len(prompts) < len(rows)
        return _DecodeBatch(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            sequence_length=longest_prompt,
            cache=DynamicCache(config=self.model.config),
            sampling=BatchSampling.from_params([row.params for row in rows], self.device),
            prefill_source=torch.tensor(source_of_row, device=self.device) if shared else None,
            prefill_kwargs=prefill_kwargs,
        )

    def _decode_step(self, batch: _DecodeBatch) -> tuple[torch.Tensor, list[float], list[float]]:
        """One forward over the batch inputs (filling the cache) and one sampled token per row.

        Returns the tokens on the device, (B,) int64, and tokens and log-probs on the host.
        """
        # `sdpa_kernel` sets process-wide flags for the duration of the forward, so it is used only
        # where it matters (CUDA); SDPA calls of other threads meanwhile also skip cuDNN.
        attention_backends = (
            sdpa_kernel(DECODE_ATTENTION_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()
        )
        with attention_backends:
            logits = self.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask[:, : batch.sequence_length],
                position_ids=batch.position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_argument: batch.cache},
                **(batch.prefill_kwargs or {}),
            ).logits[:, -1, :]
        if self._suppressed_ids.numel():
            logits = logits.index_fill(-1, self._suppressed_ids, float("-inf"))
        if batch.prefill_source is not None:
            logits = logits[batch.prefill_source]
            batch.expand_after_prefill()
        next_tokens, log_probs = _sample_by_seed(logits, batch.sampling, batch.seed_groups())
        # The step's one host synchronization: stop checks need the tokens. Float64 holds ids exactly.
        tokens_host, log_probs_host = torch.stack((next_tokens.to(torch.float64), log_probs.to(torch.float64))).tolist()
        return next_tokens, tokens_host, log_probs_host

    def _append_token(self, row: _RowState, token: int, log_prob: float, version: int) -> None:
        row.output_ids.append(token)
        row.output_log_probs.append(log_prob)
        row.output_weight_versions.append(version)
        if row.request.on_token is not None:
            row.request.on_token(token, log_prob)
        if token in row.stop_token_ids:
            row.finish_reason = "stop"
        elif len(row.output_ids) >= row.params.max_new_tokens:
            row.finish_reason = "length"

    def _new_row_state(self, request: GenerationRequest) -> _RowState:
        params = request.sampling_params
        return _RowState(request=request, stop_token_ids=stop_token_ids(params, self._eos_token_ids),
                         stop_window_tokens=stop_window_tokens(params))

    def _to_output(self, row: _RowState) -> GenerationOutput:
        routed = None
        if row.request.return_routed_experts and row.routed_experts:
            fed = len(row.request.input_ids) + len(row.output_ids) - 1
            routed = torch.cat(row.routed_experts)[:fed]
        return GenerationOutput(
            request_id=row.request.request_id,
            output_ids=row.output_ids,
            output_log_probs=row.output_log_probs,
            finish_reason=row.finish_reason or "abort",
            weight_version=row.output_weight_versions[-1] if row.output_weight_versions else self._weight_version(),
            text=self.tokenizer.decode(row.output_ids, skip_special_tokens=True),
            output_weight_versions=row.output_weight_versions,
            routed_experts=routed,
        )


def _keep_routes(routes: torch.Tensor, batch_rows: list[_RowState], prompt_of_row: list[int] | None) -> None:
    """Append a step's routed experts (``routes`` ``[N, L, k]``, N = the step's input tokens) to the rows still
    decoding: the prefill's left-padded prompt rows (``prompt_of_row[i]``: the prompt row of batch row i), or
    one token per batch row in a decode step."""
    routes = routes.to("cpu", torch.int16)
    if prompt_of_row is None:
        for position, row in enumerate(batch_rows):
            if row.finish_reason is None:
                row.routed_experts.append(routes[position:position + 1])
        return
    routes = routes.view(max(prompt_of_row) + 1, -1, *routes.shape[1:])
    for row, prompt in zip(batch_rows, prompt_of_row, strict=True):
        if row.finish_reason is None:
            row.routed_experts.append(routes[prompt, routes.shape[1] - len(row.request.input_ids):])


def _sample_by_seed(logits: torch.Tensor, batch_sampling: BatchSampling,
                    groups: list[_SeedGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next_tokens` over (B, V) logits, each seed group's rows drawing noise from its own generator."""
    if len(groups) == 1:
        return sample_next_tokens(logits, batch_sampling, groups[0].generator)
    return sample_next_tokens(logits, batch_sampling, RowGenerators([(g.generator, g.rows) for g in groups]))
