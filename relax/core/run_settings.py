"""Settings derived from the config that the builders share: the device, the dtype, the prompt format, the LoRA and loss settings."""

from __future__ import annotations

import dataclasses
import os

import torch

from relax.algorithms.advantages import AdvantageFn, AdvantageInputs, raw_rewards
from relax.algorithms.policy_loss import PolicyLoss, PolicyLossSettings
from relax.algorithms.spec import AlgorithmSpec, get_algorithm
from relax.backends.inference.answer_room import answer_room
from relax.backends.inference.base import SamplingParams
from relax.backends.models.family import model_positions
from relax.backends.training.liger import liger_unavailable_reason
from relax.backends.training.lora import LoraSettings, parse_targets
from relax.backends.training.settings import TrainSettings
from relax.config import ConfigError, RelaxConfig, flag
from relax.data.dataset import PromptFormat
from relax.rollout.agentic.tools import prompt_tool_settings
from relax.rollout.rewards.remote import REMOTE_RM_TYPE
from relax.utils.dotted_path import load_dotted_function


def resolve_device(cfg: RelaxConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag('device')} cuda: no CUDA device is available")
        # Under torchrun each rank takes the GPU of its LOCAL_RANK.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def use_liger_kernel(cfg: RelaxConfig, device: torch.device) -> bool:
    if cfg.liger_kernel == "off":
        return False
    reason = liger_unavailable_reason(device)
    if reason and cfg.liger_kernel == "on":
        raise ConfigError(f"{flag('liger_kernel')} on: {reason}")
    return reason is None


def resolve_dtype(cfg: RelaxConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def prompt_format(cfg: RelaxConfig) -> PromptFormat:
    return PromptFormat(
        input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template, apply_chat_template_kwargs=cfg.apply_chat_template_kwargs,
        system_prompt=cfg.system_prompt, max_prompt_len=cfg.rollout_max_prompt_len,
        answer_room=answer_room(cfg), model_positions=model_positions(cfg.hf_checkpoint),
        multimodal_keys=cfg.multimodal_keys or None, skip_bad_samples=cfg.skip_bad_samples,
        # A rule reward compares every response with the row's label: a row without one is refused at load.
        required_label_for=cfg.rm_type if not cfg.trains_on_dataset and cfg.rm_type != REMOTE_RM_TYPE else None,
        **prompt_tool_settings(cfg),
    )


def lora_settings(cfg: RelaxConfig) -> LoraSettings:
    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, parse_targets(cfg.target_modules), cfg.lora_scope)


def eval_sampling(cfg: RelaxConfig) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.eval_max_response_len or cfg.rollout_max_response_len,
        temperature=cfg.eval_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
        stop=list(cfg.rollout_stop), stop_token_ids=list(cfg.rollout_stop_token_ids),
    )


def algorithm_spec(cfg: RelaxConfig) -> AlgorithmSpec:
    """--advantage-estimator's spec, its advantages computed by --custom-advantage-function-path when one is set
    (on the raw rewards, over the whole step: the function may read every group)."""
    spec = get_algorithm(cfg.advantage_estimator)
    if cfg.custom_advantage_function_path is None:
        return spec
    name = f"{flag('custom_advantage_function_path')} {cfg.custom_advantage_function_path}"
    function = checked_advantage_function(_custom_function(cfg, "custom_advantage_function_path"), name)
    return dataclasses.replace(spec, name=f"{spec.name} + {cfg.custom_advantage_function_path}",
                               reward_normalizer=raw_rewards, advantage_fn=function, group_local=False)


def checked_advantage_function(function: AdvantageFn, name: str) -> AdvantageFn:
    """``function`` whose result is checked at every call: one tensor per sample of its response's shape, finite
    numbers (a list one short, another shape or a NaN had failed deep in the trainer, or trained the weights into
    NaN); the tensors come back as float32. A violation is a ConfigError naming the flag (exit 2: a restart would
    repeat it)."""
    def advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
        result = function(inputs)
        masks = inputs.response_masks
        if not isinstance(result, (list, tuple)) or len(result) != len(masks):
            what = f"{len(result)} items" if isinstance(result, (list, tuple)) else type(result).__name__
            raise ConfigError(f"{name}: returned {what}; expected a list of {len(masks)} tensors, one per sample")
        checked = []
        for index, (values, mask) in enumerate(zip(result, masks)):
            if not isinstance(values, torch.Tensor) or values.is_complex() or values.dtype == torch.bool:
                kind = f"a {values.dtype} tensor" if isinstance(values, torch.Tensor) else type(values).__name__
                raise ConfigError(f"{name}: sample {index}'s advantages are {kind}, not a tensor of real numbers")
            if values.shape != mask.shape:
                raise ConfigError(f"{name}: sample {index}'s advantages have shape {list(values.shape)}, its "
                                  f"response mask {list(mask.shape)}")
            values = values.float()
            if not torch.isfinite(values).all():
                raise ConfigError(f"{name}: sample {index}'s advantages hold NaN or infinite values")
            checked.append(values)
        return checked

    return advantages


def custom_policy_loss(cfg: RelaxConfig) -> PolicyLoss | None:
    """The --custom-policy-loss-function-path function, or None (the estimator's own policy loss)."""
    if cfg.custom_policy_loss_function_path is None:
        return None
    return _custom_function(cfg, "custom_policy_loss_function_path")


def _custom_function(cfg: RelaxConfig, name: str):
    try:
        return load_dotted_function(getattr(cfg, name), flag(name))
    except (ValueError, ImportError, TypeError) as err:
        raise ConfigError(str(err)) from None


def policy_loss_settings(cfg: RelaxConfig, spec: AlgorithmSpec) -> PolicyLossSettings:
    return PolicyLossSettings(
        policy_loss=spec.policy_loss, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high or cfg.eps_clip,
        eps_clip_c=cfg.eps_clip_c,
        aggregation=cfg.loss_aggregation, kl_loss_coef=cfg.kl_loss_coef, kl_loss_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coef, use_kl_loss=cfg.use_kl_loss, max_response_len=cfg.rollout_max_response_len,
        sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg, m2po_kl2_budget=cfg.m2po_kl2_budget,
        m2po_miniclip_low=cfg.m2po_miniclip_low, m2po_miniclip_high=cfg.m2po_miniclip_high,
        use_tis=cfg.use_tis, tis_clip=cfg.tis_clip, tis_clip_low=cfg.tis_clip_low,
        opd_loss_coef=cfg.opd_loss_coef if cfg.use_opd else 0.0, opd_kl_type=cfg.opd_kl_type,
        opd_norm_mode=cfg.opd_norm_mode,
    )


def train_settings(cfg: RelaxConfig, device: torch.device, dtype: torch.dtype, pad_token_id: int,
                   total_steps: int) -> TrainSettings:
    """The trainer's settings: every field of `TrainSettings` named as a setting of the run is taken from it; the
    rest are derived here."""
    same_name = {field.name: getattr(cfg, field.name) for field in dataclasses.fields(TrainSettings)
                 if field.name in type(cfg).model_fields}
    budget = cfg.use_dynamic_batch_size
    return TrainSettings(**{
        **same_name,
        "device": device, "compute_dtype": dtype, "pad_token_id": pad_token_id,
        # log-probs of the distribution the engine samples from; SFT and DPO score the dataset's own text
        "temperature": 1.0 if cfg.trains_on_dataset else cfg.rollout_temperature,
        "total_optimizer_steps": total_steps * cfg.steps_per_rollout,
        "adam_betas": (cfg.adam_beta1, cfg.adam_beta2),
        "entropy_grad": cfg.entropy_coef > 0,  # only an entropy bonus needs the entropy's gradient
        "max_tokens_per_gpu": cfg.max_tokens_per_gpu if budget else None,
        "log_probs_max_tokens_per_gpu": cfg.log_probs_max_tokens_per_gpu if budget else None,
        "liger_kernel": use_liger_kernel(cfg, device),
        # `auto` starts off: the memory plan turns it on where it measures room (`phase_memory.plan_for_run`)
        "log_probs_keep_logits": cfg.log_probs_keep_logits == "on",
        "lora": lora_settings(cfg) if cfg.lora_rank else None,
    })


def actor_train_settings(cfg: RelaxConfig, settings: TrainSettings) -> TrainSettings:
    """The policy's settings: it replays the rollout's routing (R3); the frozen reference routes by itself."""
    return dataclasses.replace(settings, routing_replay=cfg.use_rollout_routing_replay)
