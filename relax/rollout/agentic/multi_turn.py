"""The multi-turn generate loop (upstream's DeepEyes rollout): a model talks with an environment.

`generate` is itself a per-sample generate function (`relax.rollout.generation.context`); the rollout
uses it when ``--rollout-interaction-env-path`` is set. One call plays one episode:

1. build the sample's environment (``build_env(sample, args)``) and ``reset`` it;
2. per turn: generate from the whole token list so far, with ``max_new_tokens`` capped by what is
   left of ``--rollout-max-context-len``; append the model's tokens with loss mask 1 and their
   log-probs; pass the turn's text to ``env.step``; unless the episode ends, encode the observation
   message and append its tokens with loss mask 0 (log-prob 0.0);
3. stop on the first of: ``env_done`` (step said done), ``max_turns`` (``--max-turns`` model
   turns), ``budget_exhausted`` (no context left for another model token, or the turn was cut by
   the context cap), ``finish_length`` (the turn hit ``max_new_tokens``), ``finish_abort`` (the
   engine aborted the turn) or ``env_error`` (the environment raised or hung);
4. ``close`` the environment, always.

Token-in/token-out: earlier tokens are never re-tokenized. An observation is encoded alone, as the
difference between the chat template of dummy messages plus the observation and the template of
the dummy messages alone; the assistant message the model wrote is closed with the template's
end-of-turn tokens first (those the model did not write itself). Observation images are processed
into the same tensors as prompt images and extend the engine's and the trainer's media inputs.

The finished sample: ``tokens`` = prompt + every turn's tokens; ``response_length`` counts all
tokens after the prompt; ``loss_mask``/``rollout_log_probs`` have one entry per response token;
``metadata`` holds ``rollout_turns``, ``rollout_stop_reason`` and ``rollout_traces`` (per turn:
text, finish reason, token counts, ``done`` and the env's ``info``); a failed episode also holds
``error``, keeps the tokens it made, and has an all-zero loss mask.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from relax.backends.inference.answer_room import answer_room
from relax.backends.inference.base import GenerationOutput, GenerationRequest, SamplingParams
from relax.backends.models.family import concat_inputs
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic.env import BaseInteractionEnv, EnvCallError, call_env, load_env_builder

STATUS_OF_STOP_REASON = {
    "env_done": SampleStatus.COMPLETED,
    "max_turns": SampleStatus.COMPLETED,
    "budget_exhausted": SampleStatus.TRUNCATED,
    "finish_length": SampleStatus.TRUNCATED,
    "finish_abort": SampleStatus.ABORTED,
    "env_error": SampleStatus.FAILED,
}
_DUMMY_MESSAGES = [{"role": "user", "content": "D"}]
_TURN_MARKER = "MARKER"


@dataclass
class Trajectory:
    """The growing token list of one episode. ``loss_mask``, ``log_probs`` and ``versions`` have one
    entry per token after the prompt; ``media`` holds the prompt's and each observation's tensors."""

    tokens: list[int]
    prompt_length: int
    media: list[dict[str, torch.Tensor]] = field(default_factory=list)  # processor tensors, sequence order
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)
    # The last turn's routed experts (R3): its request held the whole history, so they cover every token but the
    # last one of the finished trajectory, which always ends with that turn's output.
    routed_experts: torch.Tensor | None = None

    @classmethod
    def of_prompt(cls, sample: Sample) -> Trajectory:
        media = [sample.multimodal_train_inputs] if sample.multimodal_train_inputs else []
        return cls(tokens=list(sample.tokens), prompt_length=len(sample.tokens), media=media)

    def media_inputs(self) -> dict[str, torch.Tensor] | None:
        """The engine's and the trainer's media tensors for the whole token list so far. Until an
        observation adds media this is the prompt's own dict, shared by its group (no copy; the
        engine prefills a group's shared prompt once)."""
        if len(self.media) <= 1:
            return self.media[0] if self.media else None
        return concat_inputs(self.media)

    def add_model_tokens(self, output: GenerationOutput) -> None:
        self.tokens += output.output_ids
        self.loss_mask += [1] * len(output.output_ids)
        self.log_probs += output.output_log_probs
        self.versions += output.output_weight_versions or [output.weight_version] * len(output.output_ids)
        self.routed_experts = output.routed_experts

    def add_observation_tokens(self, ids: list[int], media: dict[str, torch.Tensor] | None) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        # Environment tokens carry the version of the model tokens before them (per-token versions stay aligned).
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        if media:
            self.media.append(media)

    def write_to(self, sample: Sample, stop_reason: str, tokenizer: Any) -> Sample:
        response = self.tokens[self.prompt_length:]
        sample.tokens = self.tokens
        sample.response_length = len(response)
        sample.response = tokenizer.decode(response, skip_special_tokens=True)
        failed = stop_reason == "env_error"
        sample.loss_mask = [0] * len(response) if failed else self.loss_mask
        sample.rollout_log_probs = self.log_probs
        sample.rollout_routed_experts = self.routed_experts
        sample.multimodal_train_inputs = self.media_inputs()
        sample.status = STATUS_OF_STOP_REASON[stop_reason]
        distinct_versions = set(self.versions)
        sample.weight_version = list(self.versions) if len(distinct_versions) > 1 else next(iter(distinct_versions), None)
        sample.metadata.update(rollout_turns=len(self.traces), rollout_stop_reason=stop_reason,
                               rollout_traces=self.traces)
        return sample


class ObservationEncoder:
    """Token ids (and media tensors) of chat messages appended after a model turn, without
    re-tokenizing anything before them."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any], processor: Any = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--rollout-interaction-env-path: the tokenizer has no chat template to encode "
                             "observation messages with")
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.processor = processor
        self._base_text = self._render(_DUMMY_MESSAGES, add_generation_prompt=False)
        self.end_of_turn_ids = self._end_of_turn_ids()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _end_of_turn_ids(self) -> list[int]:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        text = self._render([*_DUMMY_MESSAGES, {"role": "assistant", "content": _TURN_MARKER}],
                            add_generation_prompt=False)
        return self._ids(text[text.rindex(_TURN_MARKER) + len(_TURN_MARKER):])

    def close_turn(self, model_ids: list[int]) -> list[int]:
        """The end-of-turn tokens the model's turn lacks: the rest of them after its end-of-turn
        token (EOS), or all of them when a stop string or stop token ended the turn."""
        end = self.end_of_turn_ids
        if end and model_ids and model_ids[-1] == end[0]:
            return end[1:]
        return list(end)

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """The messages' tokens up to the next assistant generation prompt (their text; images: `encode`)."""
        text = self._render([*_DUMMY_MESSAGES, *messages], add_generation_prompt=True)
        if not text.startswith(self._base_text):
            raise ValueError("the chat template renders earlier messages differently once a message follows them; "
                             "observations cannot be encoded token-in/token-out with it")
        return self._ids(text[len(self._base_text):])

    def encode(self, message: dict[str, Any]) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """The message's tokens up to the next assistant generation prompt, and its images' tensors."""
        ids = self.encode_messages([message])
        images = [item["image"] for item in _content_items(message) if item.get("type") == "image"]
        if not images:
            return ids, None
        if self.processor is None:
            raise ValueError("an observation carries images, but the run has no media processor: set "
                             "--multimodal-keys (and use a vision-language model)")
        return self.processor.expand_media(ids, self.processor.process_images(images))


def _content_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A fresh random stream per turn, reproducible from the sample's seed."""
    return None if seed is None else (seed * 1_000_003 + turn) % (2**63)


async def generate(args: Any, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """Play one episode of the ``--rollout-interaction-env-path`` environment (see the module doc)."""
    encoder = ObservationEncoder(args.tokenizer, args.chat_template_kwargs, args.processor)
    trajectory = Trajectory.of_prompt(sample)
    env: BaseInteractionEnv | None = None
    try:
        pool = getattr(args, "env_pool", None)
        if pool is not None:  # --env-workers: the environment lives in a worker process
            env = await call_env(pool.open, sample, timeout=args.env_step_timeout)
        else:
            env = await call_env(load_env_builder(args.rollout_interaction_env_path), sample, args,
                                 timeout=args.env_step_timeout)
        await call_env(env.reset, timeout=args.env_step_timeout)
        stop_reason = await _play(args, env, encoder, trajectory, sampling_params, sample)
    except EnvCallError as err:
        stop_reason = "env_error"
        sample.metadata["error"] = str(err)
    finally:
        if env is not None:
            await _close(env, args.env_step_timeout, sample)
    return trajectory.write_to(sample, stop_reason, args.tokenizer)


def context_budget(args: Any, prompt_length: int) -> int:
    """Most tokens of the episode: ``--rollout-max-context-len``, else prompt + ``--rollout-max-response-len``; never
    past the room a prompt and its answer share on the engine (the model's positions, a smaller --max-total-tokens
    pool): a long prompt's default budget could pass them, and after a turn and an observation the engine refused
    the next turn's prompt, ending the run."""
    budget = args.rollout_max_context_len or prompt_length + args.rollout_max_response_len
    room = answer_room(args)
    return budget if room is None else min(budget, room.tokens)


async def _play(args: Any, env: BaseInteractionEnv, encoder: ObservationEncoder, trajectory: Trajectory,
                sampling: SamplingParams, sample: Sample) -> str:
    """Run the turns; returns the stop reason."""
    budget = context_budget(args, trajectory.prompt_length)
    request_prefix = f"mt-{sample.group_index}-{sample.index}-{uuid.uuid4().hex[:8]}"
    # --agentic-session-lifecycle: the engine keeps the episode's K/V between turns, let go at its end
    session = f"{request_prefix}-session" if getattr(args, "agentic_session_lifecycle", False) else None
    try:
        return await _play_turns(args, env, encoder, trajectory, sampling, budget, request_prefix, session)
    finally:
        close = getattr(args.engine, "close_session", None)
        if session is not None and close is not None:
            await close(session)


async def _play_turns(args: Any, env: BaseInteractionEnv, encoder: ObservationEncoder, trajectory: Trajectory,
                      sampling: SamplingParams, budget: int, request_prefix: str, session: str | None) -> str:
    for turn in range(args.max_turns):
        room = budget - len(trajectory.tokens)
        if room <= 0:
            return "budget_exhausted"
        max_new_tokens = min(sampling.max_new_tokens, room)
        request = GenerationRequest(
            request_id=f"{request_prefix}-t{turn}", input_ids=list(trajectory.tokens),
            sampling_params=replace(sampling, max_new_tokens=max_new_tokens, seed=turn_seed(sampling.seed, turn)),
            multimodal_inputs=trajectory.media_inputs(),
            return_routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)), session_id=session,
        )
        output = (await args.engine.generate([request]))[0]
        trajectory.add_model_tokens(output)
        trace = {"turn": turn, "response_text": output.text, "finish_reason": output.finish_reason,
                 "model_tokens": len(output.output_ids), "observation_tokens": 0}
        trajectory.traces.append(trace)
        if output.finish_reason == "abort":
            return "finish_abort"
        if output.finish_reason == "length":
            return "budget_exhausted" if max_new_tokens < sampling.max_new_tokens else "finish_length"
        observation, done, info = _checked_step(await call_env(env.step, output.text, timeout=args.env_step_timeout))
        trace.update(done=done, env_info=info)
        if done:
            return "env_done"
        if turn + 1 == args.max_turns:
            break
        ids, media = _encode_observation(env, encoder, observation, output.output_ids)
        if len(trajectory.tokens) + len(ids) >= budget:
            return "budget_exhausted"  # no room for a model token after it: the observation is left out
        trajectory.add_observation_tokens(ids, media)
        trace["observation_tokens"] = len(ids)
    return "max_turns"


def _checked_step(result: Any) -> tuple[dict[str, Any], bool, Any]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise EnvCallError(f"step must return (observation, done, info), got {type(result).__name__}")
    observation, done, info = result
    return observation, bool(done), info


def _encode_observation(env: BaseInteractionEnv, encoder: ObservationEncoder, observation: Any,
                        model_ids: list[int]) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    try:
        message = env.format_observation(observation)
    except Exception as err:
        raise EnvCallError(f"format_observation raised {type(err).__name__}: {err}") from err
    ids, media = encoder.encode(message)
    return encoder.close_turn(model_ids) + ids, media


async def _close(env: BaseInteractionEnv, timeout: float, sample: Sample) -> None:
    """``close`` never fails an episode that went well; its error is recorded beside the others."""
    try:
        await call_env(env.close, timeout=timeout)
    except EnvCallError as err:
        sample.metadata["close_error"] = str(err)
