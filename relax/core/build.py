"""Build the roles of a run from its configuration.

Each role has one builder (`ROLE_BUILDERS`), taking the process's `BuildContext`: the in-process placement builds
them all (`build_roles`); a Ray worker builds only its own role, and only what that role needs is loaded (the prompt
set is read where the rollout runs, never in the critic's or the reference's process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from relax.algorithms.loss import (
    build_policy_loss_fn,
    build_preference_loss_fn,
    build_reward_model_loss_fn,
    build_sft_loss_fn,
    build_value_loss_fn,
)
from relax.algorithms.spec import AlgorithmSpec
from relax.backends.inference.base import SamplingParams
from relax.backends.inference.data_parallel import DataParallelEngine
from relax.backends.inference.router import EngineRouter
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.components.actor import Actor
from relax.components.actor_fwd import ActorFwd
from relax.components.advantages import Advantages
from relax.components.critic import Critic
from relax.components.distillation import EngineTeacher, OnPolicyDistillation, TrainerTeacher
from relax.components.rollout import DynamicSampling, Rollout
from relax.config import ConfigError, RelaxConfig, flag
from relax.core.engines.embedded import build_engine
from relax.core.engines.factory import build_external_engine, build_serve_engine, check_data_parallel_rollout
from relax.core.preflight import check_model_path, check_teacher_path
from relax.core.roles import Roles
from relax.core.rollout_parts import (
    build_dynamic_sampling,
    build_eval_reward_computer,
    build_generation,
    build_overlong_penalty,
    build_reward_computer,
    load_eval_sets,
    load_pairs,
    remote_reward,
)
from relax.core.run_settings import (
    actor_train_settings,
    algorithm_spec,
    custom_policy_loss,
    eval_sampling,
    policy_loss_settings,
    prompt_format,
    resolve_device,
    resolve_dtype,
    train_settings,
)
from relax.data.dataset import load_prompt_samples
from relax.data.sft_dataset import load_sft_samples
from relax.distributed.process_group import world_size
from relax.rollout.generation.data_source import PromptDataSource
from relax.rollout.rewards.compute import RewardComputer
from relax.rollout.rewards.genrm import GenerativeReward
from relax.rollout.rewards.remote import RemoteReward
from relax.utils.cpu_threads import set_cpu_threads

logger = logging.getLogger("relax")


def build_distillation(cfg: RelaxConfig, tokenizer, settings: TrainSettings, device: torch.device,
                       dtype: torch.dtype) -> OnPolicyDistillation:
    path = check_teacher_path(cfg, tokenizer)
    if cfg.opd_type == "trainer":
        teacher = TrainerTeacher(FSDPTrainBackend(path, settings, trainable=False))
    else:
        teacher = EngineTeacher(build_engine(path, tokenizer, cfg, device, dtype), cfg.rollout_temperature)
    return OnPolicyDistillation(teacher, cfg.opd_kl_type, cfg.opd_norm_mode, cfg.opd_log_prob_top_k,
                                advantage_coef=cfg.opd_kl_coef)


@dataclass
class BuildContext:
    """What every role builder needs, resolved and validated once per process."""

    cfg: RelaxConfig
    model_path: Path
    tokenizer: object
    total_steps: int
    spec: AlgorithmSpec
    device: torch.device
    dtype: torch.dtype
    settings: TrainSettings
    _prompts: list | None = None

    @property
    def prompts(self) -> list:
        """The training prompts (or SFT samples), read on first use: only the rollout's builder needs them."""
        if self._prompts is None:
            self._prompts = load_training_samples(self.cfg, self.tokenizer)
        return self._prompts


def load_training_samples(cfg: RelaxConfig, tokenizer) -> list:
    if cfg.trains_on_pairs:
        return load_pairs(cfg, cfg.prompt_data, tokenizer)
    load = load_sft_samples if cfg.loss_type == "sft" else load_prompt_samples
    return load(cfg.prompt_data, tokenizer, prompt_format(cfg))


def build_context(cfg: RelaxConfig, total_steps: int | None = None) -> BuildContext:
    """Validate the run's inputs and resolve device, tokenizer and trainer settings. ``total_steps`` is the run's
    length when the caller knows it (a Ray worker gets it from the driver); otherwise the prompt set is read to count
    it."""
    model_path = check_model_path(cfg)
    if not cfg.prompt_data:
        raise ConfigError(f"{flag('prompt_data')} is required for training")
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if device.type == "cpu":
        set_cpu_threads(AutoConfig.from_pretrained(model_path).get_text_config().hidden_size, cfg.cpu_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = None
    if total_steps is None:
        prompts = load_training_samples(cfg, tokenizer)
        total_steps = cfg.total_rollout_steps(len(prompts))
    spec = algorithm_spec(cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = train_settings(cfg, device, dtype, pad_id, total_steps)
    return BuildContext(cfg, model_path, tokenizer, total_steps, spec, device, dtype, settings, prompts)


def build_actor(ctx: BuildContext) -> Actor:
    cfg = ctx.cfg
    torch.manual_seed(cfg.seed)
    if cfg.loss_type == "sft":
        loss_fn = build_sft_loss_fn(cfg.loss_aggregation, cfg.rollout_max_response_len)
    elif cfg.loss_type == "dpo":
        loss_fn = build_preference_loss_fn()
    elif cfg.loss_type == "rm":
        loss_fn = build_reward_model_loss_fn()
    else:
        loss_fn = build_policy_loss_fn(policy_loss_settings(cfg, ctx.spec), custom=custom_policy_loss(cfg))
    backend = FSDPTrainBackend(ctx.model_path, actor_train_settings(cfg, ctx.settings),
                               score_head=cfg.loss_type == "rm")
    return Actor(backend, loss_fn, cfg.train_batch_size,
                 routing_replay=cfg.use_rollout_routing_replay, loss_aggregation=cfg.loss_aggregation)


def build_advantages(ctx: BuildContext) -> Advantages:
    cfg = ctx.cfg
    return Advantages(ctx.spec, cfg.n_samples_per_prompt, normalize_std=not cfg.disable_grpo_std_normalization,
                      kl_coef=cfg.kl_coef, gamma=cfg.gamma, lambd=cfg.lambd)


def build_critic(ctx: BuildContext) -> Critic:
    """PPO's value model, initialised from the policy checkpoint, with its own learning rate."""
    cfg = ctx.cfg
    critic_lr = cfg.critic_lr or cfg.lr
    critic_settings = replace(ctx.settings, lr=critic_lr, min_lr=cfg.min_lr * critic_lr / cfg.lr, entropy_grad=False)
    loss_fn = build_value_loss_fn(cfg.value_clip, cfg.loss_aggregation, cfg.rollout_max_response_len)
    return Critic(FSDPTrainBackend(ctx.model_path, critic_settings, value_head=True), loss_fn, cfg.train_batch_size)


def build_reference(ctx: BuildContext) -> ActorFwd:
    """The frozen initial model: it serves the KL loss and the KL in the reward alike."""
    return ActorFwd(FSDPTrainBackend(ctx.model_path, ctx.settings, trainable=False))


def build_rollout(ctx: BuildContext, rewards: RewardComputer | None = None,
                  dynamic_sampling: DynamicSampling | None = None,
                  eval_rewards: RewardComputer | None = None) -> Rollout:
    cfg, tokenizer = ctx.cfg, ctx.tokenizer
    data_source = PromptDataSource(ctx.prompts, cfg.rollout_batch_size, cfg.rollout_shuffle, cfg.rollout_seed)
    if cfg.loss_type == "rm":  # a reward model generates nothing: no engine, no reward; pairs and held-out pairs
        return Rollout(engine=None, data_source=data_source, rewards=None, sampling=SamplingParams(),
                       n_samples_per_prompt=1, seed=cfg.rollout_seed, eval_sets=load_eval_sets(cfg, tokenizer))
    rewards = rewards or build_reward_computer(cfg)
    if dynamic_sampling is None:
        dynamic_sampling = build_dynamic_sampling(cfg)
    sampling = SamplingParams(
        max_new_tokens=cfg.rollout_max_response_len, temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p,
        top_k=cfg.rollout_top_k, stop=list(cfg.rollout_stop), stop_token_ids=list(cfg.rollout_stop_token_ids),
    )
    if cfg.rollout_external:
        engine = build_external_engine(cfg, tokenizer)
    elif cfg.rollout_serve_replicas:
        engine = build_serve_engine(cfg)
    else:
        engine = build_engine(ctx.model_path, tokenizer, cfg, ctx.device, ctx.dtype)
        if cfg.rollout_api_port is not None:  # engines come and go through the scaling API: route through a router
            engine = EngineRouter([engine])
        if world_size() > 1:  # torchrun: each rank generates its share of the groups on its own GPU
            engine = DataParallelEngine(engine)
    return Rollout(
        engine=engine,
        data_source=data_source, rewards=rewards, eval_rewards=eval_rewards or build_eval_reward_computer(cfg),
        sampling=sampling, n_samples_per_prompt=cfg.n_samples_per_prompt, seed=cfg.rollout_seed,
        eval_sets=load_eval_sets(cfg, tokenizer), eval_sampling=eval_sampling(cfg),
        n_samples_per_eval_prompt=cfg.n_samples_per_eval_prompt,
        dynamic_sampling=dynamic_sampling, overlong=build_overlong_penalty(cfg),
        routing_replay=cfg.use_rollout_routing_replay, **build_generation(cfg, ctx.model_path, tokenizer),
    )


def build_judge(ctx: BuildContext) -> RemoteReward | GenerativeReward | None:
    """The generative reward model's judge (``--resource genrm``): the rollout's rewards ask it for verdicts."""
    return remote_reward(ctx.cfg)


# One builder per role, shared by the in-process placement (`build_roles`) and the Ray workers.
ROLE_BUILDERS: dict[str, Callable[[BuildContext], object]] = {
    "actor": build_actor, "advantages": build_advantages, "reference": build_reference, "critic": build_critic,
    "rollout": build_rollout, "genrm": build_judge,
}


def needs_critic(cfg: RelaxConfig, spec: AlgorithmSpec) -> bool:
    return spec.needs_critic and not cfg.trains_on_dataset


def needs_reference(cfg: RelaxConfig, advantages: Advantages) -> bool:
    if cfg.loss_type == "dpo":  # the preference loss's baseline, except for the reference-free SimPO
        return cfg.dpo_loss != "simpo"
    return cfg.use_kl_loss or advantages.needs_kl


def build_roles(cfg: RelaxConfig) -> Roles:
    """Everything a colocated run needs, validated before any training work starts."""
    # Reward, filter and generate-function settings fail before the (slow) model loads (the reward computer loads
    # the generate function: whether it sets the rewards itself decides which reward settings are allowed).
    rewards = build_reward_computer(cfg) if cfg.loss_type != "rm" else None
    eval_rewards = build_eval_reward_computer(cfg)
    dynamic_sampling = build_dynamic_sampling(cfg)
    ctx = build_context(cfg)
    actor = build_actor(ctx)  # joins the default process group (torchrun: all ranks)
    check_data_parallel_rollout(cfg)
    advantages = build_advantages(ctx)
    critic = build_critic(ctx) if needs_critic(cfg, ctx.spec) else None
    distillation = build_distillation(cfg, ctx.tokenizer, ctx.settings, ctx.device, ctx.dtype) if cfg.use_opd else None
    reference = build_reference(ctx) if needs_reference(cfg, advantages) else None
    rollout = build_rollout(ctx, rewards, dynamic_sampling, eval_rewards)
    logger.info("%d training prompts, %d rollout steps, device %s, dtype %s", len(ctx.prompts), ctx.total_steps,
                ctx.device, ctx.dtype)
    return Roles(ctx.tokenizer, rollout, actor, advantages, reference, ctx.total_steps, ctx.device, ctx.dtype, critic,
                 distillation)
