"""Steps run by the model's own Hugging Face forward over its own cache: the core's runner for the families its
paged decoder does not run (mixture-of-experts layers, linear-attention and MLA layers, sliding windows,
Qwen3-VL's deepstack features; `decoder.unsupported_reason`), for routing-replay capture, and for every model with
``--engine-core off``.

Cohorts. The sequences one prefill step admits (`scheduler.CohortScheduler`) form a `Cohort`: their distinct
prompts (a GRPO group's samples share one), left-padded, go through one forward that fills a ``DynamicCache`` with
whatever state each of the family's layers keeps (keys and values, convolution and recurrent states, compressed
latents), and then every sequence gets a cache row of its own. A decode step runs one forward per cohort that has a
sequence in the step, one token per row. Rows of finished sequences are fed padding until a good share of the
cohort has finished (`COMPACT_WHEN_FINISHED_FRACTION`), then dropped with their cache. Cohorts admitted at
different steps decode side by side (continuous batching); they are not merged, since their caches have other
lengths.

Everything above the forward is the core's (`core.EngineCore`): scheduling, sampling with per-request noise
streams, stop checks, aborts, pauses, weight versions, the one-step-ahead pipeline, recovery. So a model served here
samples what it would on the paged runner, up to the forward's numerics.

Routing capture. With a `RoutingRecorder` (a MoE model), a step of a cohort with a request that asks for routed
experts records every router's choice for every fed token, appended to each sequence's ``routed_experts``.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel

from relax.backends.inference.engine_core.sequence import Sequence
from relax.backends.inference.engine_core.step_runner import StepOutput, StepRunner
from relax.backends.models.family import MediaTokens, concat_inputs, forward_inputs, rope_positions
from relax.backends.models.routing_replay import RoutingRecorder

# A cohort drops its finished rows (and their cache) once at least this fraction of its rows has finished.
# Dropping costs one copy of the cache, about what one decode step's cache append costs, so it pays off only when
# it removes a good share of the per-step work. Measured with max_new_tokens uniform in 1..64 (tiny Qwen3, batch
# 64, CPU): 1,880 tok/s never dropping, 3,130 at 0.25, 3,160 at 0.5, 2,940 dropping at every finish.
COMPACT_WHEN_FINISHED_FRACTION = 0.25

# On CUDA, torch's SDPA may pick cuDNN attention, which builds an execution graph per attention shape, cached per
# thread (tens of milliseconds each on an H200). Decoding meets a new shape at every step, so the forwards use the
# backends that need no per-shape build.
DECODE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def select_cache_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep (or repeat) the cache rows at ``index``, for every kind of layer: attention layers' keys and values
    and linear-attention layers' convolution and recurrent states (Qwen3.5, Qwen3-Next), which
    ``DynamicCache.batch_select_indices`` leaves out (its linear layers have no such method)."""
    for layer in cache.layers:
        layer.reorder_cache(index)


@dataclass(eq=False)
class Cohort:
    """The cache of sequences prefilled together; row i of every tensor is ``rows[i]``."""

    rows: list[Sequence]  # finished sequences keep their row until the cohort compacts
    cache: DynamicCache
    # (B, 1) int64, or (3, B, 1) for multimodal rope: the position of each row's last fed token
    positions: torch.Tensor
    # (B, longest prompt + longest max_new_tokens), 0 on left padding; a step reads its first `length` columns
    attention_mask: torch.Tensor
    length: int  # columns of the cache (padding included)

    def keep(self, live: list[Sequence]) -> None:
        """Drop the rows of sequences not in ``live`` once enough have finished to pay for a cache copy."""
        alive = {id(s) for s in live}
        if len(self.rows) - len(alive) < COMPACT_WHEN_FINISHED_FRACTION * len(self.rows):
            return
        kept = [row for row, sequence in enumerate(self.rows) if id(sequence) in alive]
        index = torch.tensor(kept, device=self.attention_mask.device)
        select_cache_rows(self.cache, index)
        self.positions = self.positions.index_select(-2, index)
        self.attention_mask = self.attention_mask[index]
        self.rows = [self.rows[row] for row in kept]


class CacheRunner(StepRunner):
    """Prefill and decode steps by ``model``'s own forward (module docstring). ``suppressed_ids``: token ids whose
    logits are masked (media placeholders); ``routing``: the recorder of a MoE model's routers."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, suppressed_ids: torch.Tensor,
                 routing: RoutingRecorder | None = None, max_batch: int = 1024) -> None:
        device = next(model.parameters()).device
        super().__init__(device, max_batch)
        self.model = model
        self.pad_token_id = pad_token_id
        self.suppressed_ids = suppressed_ids if suppressed_ids.numel() else None
        self.media_tokens = MediaTokens.of(model.config)
        self.routing = routing
        self.records_routing = routing is not None
        self.released = False
        self.prefill_tokens = 0  # prompt tokens computed (a prompt shared by several sequences once)
        # transformers 5.24 names the KV-cache argument `cache`; earlier 5.x releases call it `past_key_values`.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def release(self) -> None:
        """Nothing is held between generations (a cohort's cache goes with its last sequence): only refuse steps
        until `restore`, as the paged runner does."""
        self.released = True

    def restore(self) -> None:
        self.released = False

    # ---- steps ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, sequences: list[Sequence], version: int) -> StepOutput:
        """Prefill the distinct prompts of ``sequences`` as one new cohort and sample each sequence's first token."""
        first_of_prompt: dict[tuple, int] = {}
        prompts: list[list[int]] = []
        media: list[dict[str, torch.Tensor] | None] = []
        prompt_of_row = []
        for sequence in sequences:
            inputs = sequence.request.multimodal_inputs or None
            # Equal token ids with other images are other prompts: the media object is part of the key.
            key = (tuple(sequence.token_ids), id(inputs) if inputs else None)
            if key not in first_of_prompt:
                first_of_prompt[key] = len(prompts)
                prompts.append(sequence.token_ids)
                media.append(inputs)
            prompt_of_row.append(first_of_prompt[key])
        longest = max(len(prompt) for prompt in prompts)
        room = max(s.params.max_new_tokens - s.num_outputs for s in sequences)
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.ones(len(prompts), longest + room, dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, longest - len(prompt):] = torch.tensor(prompt)
            attention_mask[index, :longest - len(prompt)] = 0
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        prompt_mask = attention_mask[:, :longest]
        # Positions count real tokens only, as in `model.generate`; pad positions are masked anyway.
        positions = (prompt_mask.cumsum(dim=-1) - 1).masked_fill(prompt_mask == 0, 1)
        extra: dict[str, torch.Tensor] = {}
        if self.media_tokens.ids:
            merged = concat_inputs(media)
            positions_3d = rope_positions(self.model, input_ids, prompt_mask, merged)
            if positions_3d is not None:
                positions = positions_3d
            if merged:
                extra = forward_inputs(self.model, merged, input_ids, self.device, self.model.dtype)
        self.prefill_tokens += sum(len(prompt) for prompt in prompts)
        cache = DynamicCache(config=self.model.config)
        logits, routes = self._forward(sequences, input_ids, attention_mask[:, :longest], positions, cache, extra)
        index = torch.tensor(prompt_of_row, device=self.device)
        if len(prompts) < len(sequences):  # every sample gets its own copy of its prompt's cache
            select_cache_rows(cache, index)
        cohort = Cohort(rows=list(sequences), cache=cache, positions=positions[..., -1:].index_select(-2, index),
                        attention_mask=attention_mask[index], length=longest)
        if routes is not None:
            routes = routes.view(len(prompts), longest, *routes.shape[1:])
            for sequence, prompt in zip(sequences, prompt_of_row):
                sequence.routed_experts.append(routes[prompt, longest - len(sequence.token_ids):])
        for sequence in sequences:
            sequence.cohort = cohort
        return self._finish(sequences, *self._sample(logits[index], sequences, self._step_keys(sequences)), version)

    @torch.inference_mode()
    def decode(self, sequences: list[Sequence], previous: StepOutput | None, version: int) -> StepOutput:
        """Feed each sequence its newest token (from ``previous`` on the device when the host has not read it) and
        sample the next: one forward per cohort."""
        keys = self._step_keys(sequences, previous, decode=True)
        inputs = keys.inputs
        members: dict[int, tuple[Cohort, list[int]]] = {}
        for position, sequence in enumerate(sequences):
            members.setdefault(id(sequence.cohort), (sequence.cohort, []))[1].append(position)
        order, parts = [], []
        for cohort, positions in members.values():
            fed_sequences = [sequences[p] for p in positions]
            cohort.keep(fed_sequences)
            whole = len(positions) == len(cohort.rows) and all(a is b for a, b in zip(fed_sequences, cohort.rows))
            if whole:  # the common case: every row of the cohort decodes, in its order
                rows = None
                fed = inputs if len(members) == 1 else inputs[self._to_device(positions)]
            else:  # finished rows (not dropped yet) are fed padding
                row_of = {id(s): row for row, s in enumerate(cohort.rows)}
                rows = self._to_device([row_of[id(s)] for s in fed_sequences])
                fed = torch.full((len(cohort.rows),), self.pad_token_id, dtype=torch.long, device=self.device)
                fed[rows] = inputs[self._to_device(positions)]
            cohort.positions = cohort.positions + 1
            cohort.length += 1
            logits, routes = self._forward(fed_sequences, fed[:, None], cohort.attention_mask[:, :cohort.length],
                                           cohort.positions, cohort.cache)
            if routes is not None:
                row_list = rows.tolist() if rows is not None else range(len(positions))
                for p, row in zip(positions, row_list):
                    sequences[p].routed_experts.append(routes[row:row + 1])
            order.extend(positions)
            parts.append(logits if rows is None else logits[rows])
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order != sorted(order):
            logits = logits[self._to_device(order).argsort()]
        return self._finish(sequences, *self._sample(logits, sequences, keys), version)

    def _forward(self, sequences: list[Sequence], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 positions: torch.Tensor, cache: DynamicCache,
                 extra: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last position's float32 logits of each row, and (when a sequence asks) the routes of every input
        token as ``[B * S, L, k]`` host int16."""
        recorder = self.routing if self.routing and any(s.request.return_routed_experts for s in sequences) else None
        # `sdpa_kernel` sets process-wide flags for the duration of the forward, so it is used only where it
        # matters (CUDA).
        backends = sdpa_kernel(DECODE_ATTENTION_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()
        with backends, recorder.recording() if recorder else contextlib.nullcontext():
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                use_cache=True, logits_to_keep=1, **{self._cache_argument: cache},
                                **(extra or {})).logits[:, -1, :].float()
        if self.suppressed_ids is not None:
            logits.index_fill_(-1, self.suppressed_ids, float("-inf"))
        routes = recorder.take().to("cpu", torch.int16) if recorder is not None else None
        return logits, routes
