"""What a per-sample generate function receives as ``args``, and how the rollout calls it.

A per-sample generate function (``--custom-generate-function-path``, or the multi-turn loop that
``--rollout-interaction-env-path`` selects) is ``async def generate(args, sample, sampling_params)
-> Sample | list[Sample]``. The rollout calls it once per sample of a step, all samples
concurrently, with:

- ``args``: a `GenerateArgs` (every `RelaxConfig` field as an attribute, plus the engine, the
  tokenizer, the processor and the chat-template keyword arguments);
- ``sample``: a copy of the prompt sample (``tokens`` are the prompt ids, ``response_length`` 0);
- ``sampling_params``: the step's `SamplingParams` with a seed of the sample's own (derived from
  the step seed and the sample's position, so a resumed run samples the same again);
- ``evaluation=True`` in evaluation, for functions whose signature has upstream's optional
  ``evaluation`` parameter (the others get the three arguments only).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from relax.backends.inference.base import SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.data.sample import Sample

GenerateFunction = Callable[[Any, Sample, SamplingParams], Awaitable[Sample | list[Sample]]]


class GenerateFunctionError(RuntimeError):
    """A per-sample generate function raised or returned something that is not a sample."""


class GenerateArgs:
    """``args`` of a per-sample generate function.

    ``engine`` takes ``await engine.generate([GenerationRequest(...)])``; the concurrent calls of a
    step's samples are merged into few engine calls (`RequestBatcher`). ``tokenizer`` is the
    policy's tokenizer; ``processor`` the multimodal preparer (`MultimodalPreparer`, None for text
    runs); ``chat_template_kwargs`` the ``--apply-chat-template-kwargs``. Any other attribute is
    the run's config field of that name (``args.max_turns``, ``args.rollout_max_context_len``).
    """

    def __init__(self, config: Any, engine: Any, tokenizer: Any, processor: Any = None, env_pool: Any = None) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.processor = processor
        self.env_pool = env_pool  # --env-workers: where the multi-turn loop builds its environments
        self.chat_template_kwargs = dict(getattr(config, "apply_chat_template_kwargs", None) or {})

    def __getattr__(self, name: str) -> Any:
        # Only called for names not set in __init__: the config's fields (and derived values).
        if name != "config" and hasattr(self.config, name):
            return getattr(self.config, name)
        raise AttributeError(f"generate args have no {name!r}: not engine, tokenizer, processor, "
                             "chat_template_kwargs or a config field")


def sample_seed(step_seed: int | None, position: int) -> int | None:
    """The seed of the sample at ``position`` of a round: distinct per sample, so the samples of a
    group (same prompt) differ and an engine call may merge them."""
    if step_seed is None:
        return None
    return (step_seed * 1_000_003 + 7919 * (position + 1)) % (2**63)


@dataclass(frozen=True)
class PerSampleGeneration:
    """A loaded per-sample generate function and what the rollout needs to call it."""

    function: GenerateFunction
    path: str  # the dotted path (or the built-in's name), for error messages
    config: Any
    tokenizer: Any
    processor: Any = None
    env_pool: Any = None  # `EnvWorkerPool` of --env-workers

    async def run(self, engine: Any, samples: list[Sample], sampling: SamplingParams,
                  evaluation: bool = False) -> list[Sample]:
        """Generate every sample concurrently through one request batcher; returns the samples in
        order, a list return spliced in place of its sample (see `splice_group_members`).
        ``evaluation`` reaches functions that take upstream's optional ``evaluation`` argument."""
        extra = {"evaluation": evaluation} if "evaluation" in inspect.signature(self.function).parameters else {}
        batcher = RequestBatcher(engine)
        batcher.start()
        try:
            args = GenerateArgs(self.config, batcher, self.tokenizer, self.processor, self.env_pool)
            results = await asyncio.gather(*(
                self._call(args, sample, replace(sampling, seed=sample_seed(sampling.seed, position)), extra)
                for position, sample in enumerate(samples)
            ))
        finally:
            await batcher.stop()
        return splice_group_members(samples, results, self.path)

    async def _call(self, args: GenerateArgs, sample: Sample, sampling: SamplingParams, extra: dict[str, Any]) -> Any:
        try:
            return await self.function(args, sample, sampling, **extra)
        except Exception as err:
            # A broken function stops the run; failures it can recover from it reports as FAILED samples.
            raise GenerateFunctionError(f"{self.path}: failed on sample {sample.index}: "
                                        f"{type(err).__name__}: {err}") from err


def splice_group_members(samples: list[Sample], results: list[Any], path: str) -> list[Sample]:
    """Each result in its sample's place. A list return puts all its samples there, in the sample's
    group (its ``group_index``); every sample of a call must then return a list of the same length
    k, so each prompt group grows from n to k·n adjacent samples and still splits into groups of n
    that answer one prompt, as the group-relative estimators need."""
    lengths = {len(result) if isinstance(result, list) else 1 for result in results}
    if 0 in lengths:
        raise GenerateFunctionError(f"{path}: returned an empty list; return the sample (status FAILED if it failed)")
    if len(lengths) > 1:
        raise GenerateFunctionError(f"{path}: returned lists of different lengths {sorted(lengths)} for one step's "
                                    "samples; every sample must return one Sample or lists of one common length")
    spliced = []
    for sample, result in zip(samples, results):
        for member in result if isinstance(result, list) else [result]:
            if not isinstance(member, Sample):
                raise GenerateFunctionError(f"{path}: returned {type(member).__name__}, expected a Sample or a list "
                                            "of Samples")
            member.group_index = sample.group_index
            spliced.append(member)
    return spliced
