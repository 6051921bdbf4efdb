"""The rollout's parts built from the config: the reward, dynamic sampling, the generate function (built-in, multi-turn, custom), the media preparer, the overlong penalty and the eval sets."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from relax.backends.inference.answer_room import answer_room
from relax.components.rollout import DynamicSampling, OverlongPenalty
from relax.config import ConfigError, RelaxConfig, flag
from relax.core.run_settings import prompt_format, resolve_device, resolve_dtype
from relax.data.dataset import load_prompt_samples
from relax.data.multimodal import MultimodalSettings
from relax.data.preference_dataset import load_preference_pairs
from relax.rollout.agentic import multi_turn
from relax.rollout.agentic.env import load_env_builder
from relax.rollout.agentic.env_workers import EnvWorkerPool
from relax.rollout.generation.context import GenerateFunction, PerSampleGeneration
from relax.rollout.generation.multimodal import MultimodalPreparer
from relax.rollout.rewards.compute import RewardComputer
from relax.rollout.rewards.genrm import GenerativeReward, GenRMSettings
from relax.rollout.rewards.remote import REMOTE_RM_TYPE, RemoteReward
from relax.rollout.rewards.reward_model import RewardModelEnsemble, RewardModelScorer
from relax.utils.dotted_path import load_dotted_function


def build_multimodal(cfg: RelaxConfig, model_path: Path, tokenizer) -> MultimodalPreparer | None:
    if not cfg.multimodal_keys:
        return None
    try:
        return MultimodalPreparer(
            tokenizer, AutoConfig.from_pretrained(model_path), model_path, MultimodalSettings.from_config(cfg),
            cfg.system_prompt, cfg.apply_chat_template_kwargs, cfg.mm_processor_pool_size, cfg.skip_bad_samples,
            answer_room(cfg),
        )
    except ValueError as err:
        raise ConfigError(f"{flag('multimodal_keys')}: {err}") from None


def build_reward_computer(cfg: RelaxConfig, remote: Any = None) -> RewardComputer:
    """The rewards of ``cfg``; ``remote`` stands in for the judge or reward server `remote_reward` would build (the
    judge in its own Ray process)."""
    try:
        rm_type = cfg.rm_type
        if rm_type == REMOTE_RM_TYPE:  # upstream's name of the reward server's reward
            if cfg.rm_url is None:
                raise ValueError(f"--rm-type {REMOTE_RM_TYPE} needs {flag('rm_url')}")
            rm_type = None
        generate = load_generate_function(cfg)
        sets_rewards = generate is not None and getattr(generate[0], "sets_rewards", False)
        return RewardComputer(rm_type, cfg.custom_rm_path, group_rm=cfg.group_rm, args=cfg,
                              timeout_s=cfg.reward_timeout, custom_workers=cfg.custom_rm_workers,
                              worker_memory_mb=cfg.reward_worker_memory_mb,
                              remote=remote if remote is not None else remote_reward(cfg),
                              rewards_set_by=f"{flag('custom_generate_function_path')} {generate[1]}"
                              if sets_rewards else None)
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from None


def remote_reward(
        cfg: RelaxConfig) -> RemoteReward | GenerativeReward | RewardModelScorer | RewardModelEnsemble | None:
    """The reward server (--rm-url), the judge model (--genrm-model-path) or the trained reward model(s) (--rm-path,
    checked against the policy's tokenizer; several: an ensemble), if the run names one."""
    given = [name for name in ("rm_url", "genrm_model_path", "rm_path") if getattr(cfg, name) is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(flag(name) for name in given)} both given; set one")
    if cfg.rm_url is not None:
        return RemoteReward(cfg.rm_url)
    if not given:
        return None
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if cfg.rm_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
        members = [RewardModelScorer(path, device, dtype, tokenizer) for path in cfg.rm_path]
        if len(members) == 1:
            return members[0]
        return RewardModelEnsemble(members, cfg.rm_ensemble_reduce, cfg.rm_ensemble_std_coef)
    return GenerativeReward(GenRMSettings.from_flags(
        cfg.genrm_model_path, cfg.genrm_prompt_template, cfg.genrm_sampling_config, cfg.genrm_engine_config,
        str(device), str(dtype).removeprefix("torch.")))


def build_eval_reward_computer(cfg: RelaxConfig) -> RewardComputer | None:
    """The held-out sets' grader when it is not the training reward (--eval-rm-type)."""
    if cfg.eval_rm_type is None:
        return None
    try:
        return RewardComputer(cfg.eval_rm_type, timeout_s=cfg.reward_timeout)
    except ValueError as err:
        raise ConfigError(f"{flag('eval_rm_type')}: {err}") from None


def build_dynamic_sampling(cfg: RelaxConfig) -> DynamicSampling | None:
    if cfg.dynamic_sampling_filter_path is None:
        return None
    try:
        filter_fn = load_dotted_function(cfg.dynamic_sampling_filter_path, flag("dynamic_sampling_filter_path"))
    except (ValueError, ImportError, TypeError) as err:
        raise ConfigError(str(err)) from None
    return DynamicSampling(filter_fn, cfg.max_dynamic_sampling_rounds, args=cfg)


MULTI_TURN_PATH = "relax.rollout.agentic.multi_turn:generate"


def load_generate_function(cfg: RelaxConfig) -> tuple[GenerateFunction, str] | None:
    """The per-sample generate function and its path: --custom-generate-function-path, else the
    multi-turn loop when --rollout-interaction-env-path is set, else None (one engine call per
    step). Both paths are imported here, so a bad one fails before any model loads."""
    try:
        if cfg.rollout_interaction_env_path is not None:
            load_env_builder(cfg.rollout_interaction_env_path)
        if cfg.custom_generate_function_path is None:
            return (multi_turn.generate, MULTI_TURN_PATH) if cfg.rollout_interaction_env_path is not None else None
        function = load_dotted_function(cfg.custom_generate_function_path, flag("custom_generate_function_path"))
    except (ValueError, ImportError, TypeError) as err:
        raise ConfigError(str(err)) from None
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"{flag('custom_generate_function_path')} {cfg.custom_generate_function_path!r}: must be an "
                          "`async def generate(args, sample, sampling_params)`")
    return function, cfg.custom_generate_function_path


def build_per_sample_generation(cfg: RelaxConfig, tokenizer, multimodal: MultimodalPreparer | None
                                ) -> PerSampleGeneration | None:
    loaded = load_generate_function(cfg)
    if loaded is None:
        return None
    function, path = loaded
    if function is multi_turn.generate and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"{flag('rollout_interaction_env_path')}: the tokenizer of {flag('hf_checkpoint')} has no "
                          "chat template, which the multi-turn loop encodes observations with")
    pool = None
    if cfg.env_workers and function is multi_turn.generate:
        pool = EnvWorkerPool(cfg.rollout_interaction_env_path, cfg, tokenizer, cfg.env_workers,
                             cfg.env_worker_memory_mb)
    return PerSampleGeneration(function, path, cfg, tokenizer, multimodal, pool)


def build_generation(cfg: RelaxConfig, model_path: Path, tokenizer) -> dict:
    """The rollout's media preparer (--multimodal-keys) and per-sample generate function (multi-turn environment
    or custom generate), as `Rollout` keyword arguments: training and `relax eval` generate the same way."""
    multimodal = build_multimodal(cfg, model_path, tokenizer)
    return {"multimodal": multimodal, "per_sample": build_per_sample_generation(cfg, tokenizer, multimodal)}


def build_overlong_penalty(cfg: RelaxConfig) -> OverlongPenalty | None:
    if cfg.overlong_buffer_len is None:
        return None
    return OverlongPenalty(cfg.rollout_max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)


def load_pairs(cfg: RelaxConfig, spec: str, tokenizer) -> list:
    """The preference pairs of ``spec`` with the run's keys and token budget (`load_preference_pairs`)."""
    return load_preference_pairs(spec, tokenizer, prompt_format(cfg), cfg.chosen_key, cfg.rejected_key,
                                 cfg.max_tokens_per_gpu, cfg.margin_key)


def load_eval_sets(cfg: RelaxConfig, tokenizer) -> dict:
    """The held-out sets: prompts, or preference pairs for a reward model (its evaluation ranks them)."""
    if cfg.loss_type == "rm":
        return {name: load_pairs(cfg, spec, tokenizer) for name, spec in cfg.eval_prompt_data.items()}
    return {name: load_prompt_samples(spec, tokenizer, prompt_format(cfg)) for name, spec in cfg.eval_prompt_data.items()}
