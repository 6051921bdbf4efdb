"""The default generate function: sample ``n`` responses per prompt from an inference engine."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

from relax.backends.inference.base import (
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    occurrence_seed,
)
from relax.data.sample import Sample, SampleStatus

_STATUS_OF_FINISH = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


def expand_groups(prompts: list[Sample], n_samples_per_prompt: int, first_group_index: int = 0) -> list[Sample]:
    """``n`` copies of each prompt; the copies of one prompt share a ``group_index`` and are
    adjacent, which the group-wise advantage estimators rely on."""
    samples = []
    for offset, prompt in enumerate(prompts):
        # The copies share the prompt's media and processor tensors (read-only, possibly large).
        shared = {id(m): m for m in (prompt.multimodal_inputs, prompt.multimodal_train_inputs) if m is not None}
        for _ in range(n_samples_per_prompt):
            sample = copy.deepcopy(prompt, memo=dict(shared))
            sample.group_index = first_group_index + offset
            samples.append(sample)
    return samples


def apply_output(sample: Sample, output: GenerationOutput) -> None:
    """Fill a prompt sample with the engine's response."""
    sample.tokens = sample.tokens + list(output.output_ids)
    sample.response_length = len(output.output_ids)
    sample.response = output.text
    sample.rollout_log_probs = list(output.output_log_probs)
    sample.loss_mask = [1] * sample.response_length
    sample.status = _STATUS_OF_FINISH[output.finish_reason]
    versions = output.output_weight_versions
    # Per-token versions only when a weight update landed mid-response; otherwise one number.
    sample.weight_version = list(versions) if versions and len(set(versions)) > 1 else output.weight_version
    sample.rollout_routed_experts = output.routed_experts


async def generate_samples(engine: InferenceEngine, samples: list[Sample], sampling: SamplingParams,
                           return_routed_experts: bool = False,
                           on_sample: Callable[[Sample], None] | None = None) -> list[Sample]:
    """Generate one response for every sample (in place) in a single engine call; with ``return_routed_experts``
    each sample also keeps the experts the engine routed its tokens to (rollout routing replay). ``on_sample``:
    called with each sample once its response is in, as the engine reports it (`generate_streaming`)."""
    requests = [
        GenerationRequest(
            request_id=f"g{sample.group_index}-i{sample.index}-{position}",
            input_ids=list(sample.tokens),
            # each its own stream, as one engine call would give them, so that spreading the call over several
            # engines (one per rank under torchrun, or a router) samples the same tokens
            sampling_params=replace(sampling, seed=None if sampling.seed is None else occurrence_seed(sampling.seed,
                                                                                                     position)),
            # The processor tensors, shared with the trainer (HTTP engines take sample.multimodal_inputs' raw media).
            multimodal_inputs=sample.multimodal_train_inputs,
            return_routed_experts=return_routed_experts,
        )
        for position, sample in enumerate(samples)
    ]
    if on_sample is None:
        for sample, output in zip(samples, await engine.generate(requests)):
            apply_output(sample, output)
        return samples

    def on_output(position: int, output: GenerationOutput) -> None:
        apply_output(samples[position], output)
        on_sample(samples[position])

    await engine.generate_streaming(requests, on_output)
    return samples
