"""Build the roles of a run from its configuration (in-process placement)."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from transformers import AutoConfig, AutoTokenizer

from relax.algorithms.loss import PolicyLossSettings, build_policy_loss_fn, build_sft_loss_fn, build_value_loss_fn
from relax.algorithms.spec import AlgorithmSpec, get_algorithm
from relax.backends.inference.base import SamplingParams
from relax.backends.inference.data_parallel import DataParallelEngine
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.inference.http_broadcast import BroadcastWeightTransport
from relax.backends.inference.http_openai import OpenAIHTTPEngine
from relax.backends.inference.http_sglang import SGLangHTTPEngine
from relax.backends.inference.relax_server import RelaxServerEngine, RelaxServerSettings
from relax.backends.inference.router import EngineRouter
from relax.backends.inference.vllm_server import VLLMServerEngine, VLLMServerSettings
from relax.backends.model_family import is_qwen3_omni, load_model, model_config_problem, model_files_problem
from relax.backends.model_registry import UnsupportedModelError, check_supported
from relax.backends.training.fsdp import FSDPTrainBackend, TrainSettings
from relax.backends.training.liger import liger_unavailable_reason
from relax.backends.training.lora import LoraSettings, parse_targets
from relax.components.actor import Actor
from relax.components.actor_fwd import ActorFwd
from relax.components.advantages import Advantages
from relax.components.critic import Critic
from relax.components.distillation import EngineTeacher, OnPolicyDistillation, TrainerTeacher
from relax.components.rollout import DynamicSampling, OverlongPenalty, Rollout
from relax.config import ConfigError, RelaxConfig, flag
from relax.core import checkpoint
from relax.core.run_dir import loads_a_run_without_checkpoints
from relax.data.dataset import DatasetError, PromptFormat, load_prompt_samples, parse_data_spec
from relax.data.multimodal import MultimodalSettings
from relax.data.sft_dataset import load_sft_samples
from relax.distributed.process_group import world_size
from relax.engine.agentic import multi_turn
from relax.engine.agentic.env import load_env_builder
from relax.engine.agentic.env_workers import EnvWorkerPool
from relax.engine.agentic.tools import prompt_tool_settings
from relax.engine.rewards.compute import RewardComputer
from relax.engine.rewards.custom import load_dotted_function
from relax.engine.rewards.genrm import GenerativeReward, GenRMSettings
from relax.engine.rewards.remote import REMOTE_RM_TYPE, RemoteReward
from relax.engine.rollout.context import GenerateFunction, PerSampleGeneration
from relax.engine.rollout.data_source import PromptDataSource
from relax.engine.rollout.multimodal import MultimodalPreparer
from relax.utils.cpu_threads import set_cpu_threads
from relax.utils.notify import invalid_url_positions, split_urls

logger = logging.getLogger("relax")


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


def check_model_path(cfg: RelaxConfig) -> Path:
    if not cfg.hf_checkpoint:
        raise ConfigError(f"{flag('hf_checkpoint')} is required")
    problem = model_config_problem(cfg.hf_checkpoint)
    if problem is not None:
        raise ConfigError(f"{flag('hf_checkpoint')} {problem}")
    return Path(cfg.hf_checkpoint)


def check_model_files(cfg: RelaxConfig) -> None:
    """The model folder holds weights and a tokenizer (after the family check: an unsupported family is refused
    with its own reason first)."""
    problem = model_files_problem(cfg.hf_checkpoint)
    if problem is not None:
        raise ConfigError(f"{flag('hf_checkpoint')} {problem}")


def check_data_files(cfg: RelaxConfig, training: bool = True) -> None:
    """Every data file named exists (a slice spec is parsed, so a malformed one is named as such)."""
    specs = dict(cfg.eval_prompt_data)
    if training:
        if not cfg.prompt_data:
            raise ConfigError(f"{flag('prompt_data')} is required for training")
        specs = {"": cfg.prompt_data, **specs}
    for name, spec in specs.items():
        where = flag("prompt_data") if not name else f"{flag('eval_prompt_data')} {name}"
        try:
            path, _ = parse_data_spec(spec)
        except DatasetError as error:
            raise ConfigError(f"{where}: {error}") from None
        if not path.is_file():
            raise ConfigError(f"{where}: {path}: file not found")


def check_model_family(config, model_path: Path) -> None:
    """A family that cannot work yet is refused with its reason (docs/models.md); one Relax does not know is tried
    on the Hugging Face paths, with a warning."""
    try:
        family = check_supported(config, f"{flag('hf_checkpoint')} {model_path}")
    except UnsupportedModelError as error:
        raise ConfigError(str(error)) from None
    if family is None:
        logger.warning("model_type %r (%s) is not in docs/models.md: it runs on the Hugging Face paths, untested",
                       config.model_type, model_path)


def check_model_options(cfg: RelaxConfig, config, model_path: Path) -> None:
    """Options that depend on the model's modules, checked on a weightless copy of it: --target-modules and
    --lora-scope match modules, --moe-aux-loss-coef has a loss to weigh, --use-rollout-routing-replay has
    routers."""
    from relax.backends.model_family import model_from_config
    from relax.backends.routing_replay import routing_shape
    from relax.backends.training.lora import inject
    from relax.backends.training.moe import moe_aux_loss

    with torch.device("meta"):
        model = model_from_config(config, torch.float32)
    try:
        if cfg.moe_aux_loss_coef:
            moe_aux_loss(model, cfg.moe_aux_loss_coef)
        if cfg.use_rollout_routing_replay:
            routing_shape(model)
        if cfg.lora_rank:
            inject(model, lora_settings(cfg))
    except ValueError as error:
        raise ConfigError(f"{error} (the model at {model_path})") from None


def check_context_length(cfg: RelaxConfig, config, model_path: Path) -> None:
    """The lengths asked for fit the model's positions (beyond them a forward fails deep inside, or quietly
    computes garbage with positions it was never trained on)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not limit:
        return
    for name in ("rollout_max_response_len", "eval_max_response_len", "rollout_max_context_len"):
        value = getattr(cfg, name)
        if value is not None and value >= limit:
            raise ConfigError(f"{flag(name)} {value}: the model at {model_path} has {limit} positions "
                              "(max_position_embeddings), which must hold the prompt too")
    if cfg.rollout_max_prompt_len is not None and cfg.rollout_max_prompt_len + cfg.rollout_max_response_len > limit:
        raise ConfigError(f"{flag('rollout_max_prompt_len')} {cfg.rollout_max_prompt_len} + "
                          f"{flag('rollout_max_response_len')} {cfg.rollout_max_response_len} exceed the "
                          f"{limit} positions of the model at {model_path}")


def preflight(cfg: RelaxConfig, training: bool = True) -> Path:
    """The checks a run's settings allow without loading a model or data, done before a run directory exists:
    the model folder and its context length, the data files, the checkpoint to load, the reward and the plugin
    paths. Returns the model folder."""
    check_optional_dependencies(cfg)
    model_path = check_model_path(cfg)
    config = AutoConfig.from_pretrained(model_path)  # read once for the checks below
    check_model_family(config, model_path)
    check_model_files(cfg)
    if training and (cfg.lora_rank or cfg.moe_aux_loss_coef or cfg.use_rollout_routing_replay):
        check_model_options(cfg, config, model_path)
    if cfg.use_audio_in_video and not is_qwen3_omni(config):
        raise ConfigError(f"{flag('use_audio_in_video')}: the model at {model_path} ({config.model_type}) does not "
                          "take video with its sound track here; the Qwen3-Omni thinker does (Qwen2.5-Omni "
                          "interleaves by chunks of seconds, not built yet)")
    check_context_length(cfg, config, model_path)
    check_data_files(cfg, training)
    if cfg.load and not loads_a_run_without_checkpoints(cfg):
        try:
            checkpoint.resolve_checkpoint_root(cfg.load)
        except checkpoint.CheckpointError as error:
            raise ConfigError(f"{flag('load')} {error}") from None
    build_reward_computer(cfg).close()
    build_dynamic_sampling(cfg)
    load_generate_function(cfg)
    check_notify_urls(cfg)
    return model_path


def check_optional_dependencies(cfg: RelaxConfig) -> None:
    """Every setting that needs an optional extra of relax-rl finds it installed, or fails naming the command that
    installs it (before anything starts: a missing Ray used to end in three chained tracebacks)."""
    needs = []  # (the setting, its modules, the extra)
    if cfg.placement == "ray":
        needs.append((f"{flag('placement')} ray", ["ray"], "ray"))
        if cfg.fully_async or cfg.hybrid:
            needs.append((f"{flag('fully_async' if cfg.fully_async else 'hybrid')} under {flag('placement')} ray "
                          "(its TransferQueue data plane)", ["transfer_queue", "tensordict"], "ray"))
    if cfg.rollout_serve_replicas:
        needs.append((flag("rollout_serve_replicas"), ["ray"], "ray"))
    if cfg.use_wandb:
        needs.append((flag("use_wandb"), ["wandb"], "wandb"))
    if cfg.use_clearml:
        needs.append((flag("use_clearml"), ["clearml"], "clearml"))
    if cfg.liger_kernel == "on":
        needs.append((f"{flag('liger_kernel')} on", ["liger_kernel"], "gpu"))
    for setting, modules, extra in needs:
        missing = [module for module in modules if importlib.util.find_spec(module) is None]
        if missing:
            raise ConfigError(f"{setting} needs {', '.join(missing)}, from relax-rl's `{extra}` extra, which is not "
                              f"installed: pip install -e \".[{extra}]\" in a clone (pip install \"relax-rl[{extra}]\" "
                              "otherwise)")


def check_notify_urls(cfg: RelaxConfig) -> None:
    urls = split_urls(cfg.notify_urls)
    if not urls:
        return
    bad = invalid_url_positions(urls)
    if bad:  # by position: the text may hold a token
        raise ConfigError(f"{flag('notify_urls')}: URL {', '.join(map(str, bad))} of {len(urls)} is not one Apprise "
                          "knows (https://github.com/caronc/apprise/wiki; the URL is not shown: it may hold a token)")


def prompt_format(cfg: RelaxConfig) -> PromptFormat:
    return PromptFormat(
        input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
        apply_chat_template=cfg.apply_chat_template, apply_chat_template_kwargs=cfg.apply_chat_template_kwargs,
        system_prompt=cfg.system_prompt, max_prompt_len=cfg.rollout_max_prompt_len,
        multimodal_keys=cfg.multimodal_keys or None, skip_bad_samples=cfg.skip_bad_samples,
        # A rule reward compares every response with the row's label: a row without one is refused at load.
        required_label_for=cfg.rm_type if cfg.loss_type != "sft" and cfg.rm_type != REMOTE_RM_TYPE else None,
        **prompt_tool_settings(cfg),
    )


def lora_settings(cfg: RelaxConfig) -> LoraSettings:
    return LoraSettings(cfg.lora_rank, cfg.lora_alpha, parse_targets(cfg.target_modules), cfg.lora_scope)


def core_settings(cfg: RelaxConfig) -> CoreSettings:
    return CoreSettings(mode=cfg.engine_core, mem_fraction_static=cfg.mem_fraction_static,
                        max_total_tokens=cfg.max_total_tokens, max_prefill_tokens=cfg.max_prefill_tokens,
                        page_size=cfg.page_size, cuda_graphs=not cfg.disable_cuda_graph,
                        max_graph_batch=cfg.cuda_graph_max_bs)


def build_engine(model_path: Path, tokenizer, cfg: RelaxConfig, device: torch.device, dtype: torch.dtype):
    model = load_model(model_path, dtype).to(device)
    return EmbeddedEngine(model, tokenizer, max_batch_size=cfg.rollout_max_batch_size, core=core_settings(cfg),
                          max_recoveries=cfg.rollout_engine_max_relaunches if cfg.use_fault_tolerance else 0)


def rollout_weights_dir(cfg: RelaxConfig) -> Path:
    """Where versioned weights for engines outside the trainer's process go (--rollout-weights-dir)."""
    return Path(cfg.rollout_weights_dir or Path(cfg.output_dir) / "engine_weights").resolve()


def engine_router(cfg: RelaxConfig, engines: list, transport=None) -> EngineRouter:
    """A router in front of engines outside the trainer's process, with the run's health-check settings."""
    return EngineRouter(engines, weight_transport=transport, bucket_bytes=cfg.update_weight_buffer_size,
                        health_check_interval_s=cfg.rollout_health_check_interval,
                        health_check_timeout_s=cfg.rollout_health_check_timeout,
                        health_check_max_failures=cfg.rollout_health_check_max_consecutive_failures,
                        relaunch_limit=cfg.rollout_engine_max_relaunches if cfg.use_fault_tolerance else 0)


def build_serve_engine(cfg: RelaxConfig) -> EngineRouter:
    """`--rollout-serve-replicas N`: the engines as a Ray Serve deployment (`relax.core.serve_rollout`), behind a
    router so that external servers can join it through the scaling API. Versions a previous process published
    are removed first: the trainer publishes its own weights at its first sync, and a replica must not start from
    a version number this run will publish again with other weights."""
    from relax.core.serve_rollout import EngineDeployment, ServeEngine

    if world_size() > 1:
        raise ConfigError(f"{flag('rollout_serve_replicas')} runs the engines in Ray processes; under torchrun each "
                          "rank generates on its own GPU instead: drop one of them")
    weights_dir = rollout_weights_dir(cfg)
    shutil.rmtree(weights_dir, ignore_errors=True)
    return engine_router(cfg, [ServeEngine(EngineDeployment(cfg, weights_dir), weights_dir)])


def build_external_engine(cfg: RelaxConfig, tokenizer) -> EngineRouter:
    """`--rollout-external`: HTTP adapters for the servers at --rollout-external-engine-addrs behind a router
    (also for one server: the router retries and health-checks). They load new weights from
    --rollout-weights-dir (default <output-dir>/engine_weights), which they must see at the same path."""
    weights_dir = rollout_weights_dir(cfg)
    key = cfg.rollout_engine_api_key
    if cfg.rollout_engine_protocol == "openai":
        model_name = Path(cfg.hf_checkpoint).name if cfg.hf_checkpoint else "default"
        engines = [OpenAIHTTPEngine(address, model_name, api_key=key, tokenizer=tokenizer, weights_dir=weights_dir)
                   for address in cfg.rollout_external_engine_addrs]
    elif cfg.rollout_engine_protocol == "vllm":
        engines = [build_vllm_server_engine(cfg, address, tokenizer, weights_dir)
                   for address in cfg.rollout_external_engine_addrs]
    elif cfg.rollout_engine_protocol == "relax":
        engines = [build_relax_server_engine(cfg, address, weights_dir)
                   for address in cfg.rollout_external_engine_addrs]
    else:
        engines = [SGLangHTTPEngine(address, api_key=key, weights_dir=weights_dir)
                   for address in cfg.rollout_external_engine_addrs]
    transport = None
    if cfg.resolved_weight_sync_transport == "broadcast":
        backend = "nccl" if resolve_device(cfg).type == "cuda" else "gloo"
        transport = BroadcastWeightTransport(cfg.rollout_weight_sync_address, backend)
    logger.info("rollout on %d external %s engine(s): %s; weights via %s", len(engines), cfg.rollout_engine_protocol,
                ", ".join(cfg.rollout_external_engine_addrs),
                f"{transport.backend} broadcast" if transport else weights_dir)
    return engine_router(cfg, engines, transport)


def build_vllm_server_engine(cfg: RelaxConfig, address: str, tokenizer, weights_dir: Path) -> VLLMServerEngine:
    """`--rollout-engine-protocol vllm`: a vLLM server this run starts on ``address`` (127.0.0.1:PORT) at its
    first use and stops at exit, serving in the trainer's compute dtype so log-probs match the trainer's."""
    dtype = str(resolve_dtype(cfg, resolve_device(cfg))).removeprefix("torch.")
    return VLLMServerEngine(check_model_path(cfg), weights_dir, port=urlsplit(address).port,
                            served_model_name=Path(cfg.hf_checkpoint).name, tokenizer=tokenizer,
                            settings=VLLMServerSettings(dtype=dtype), api_key=cfg.rollout_engine_api_key)


def build_relax_server_engine(cfg: RelaxConfig, address: str, weights_dir: Path) -> RelaxServerEngine:
    """`--rollout-engine-protocol relax`: a `relax serve` process this run starts on ``address``
    (127.0.0.1:PORT) at its first use and stops at exit, on the trainer's device and compute dtype."""
    device = resolve_device(cfg)
    settings = RelaxServerSettings(device=str(device), dtype=str(resolve_dtype(cfg, device)).removeprefix("torch."),
                                   engine_core=cfg.engine_core, mem_fraction_static=cfg.mem_fraction_static,
                                   max_batch_size=cfg.rollout_max_batch_size)
    return RelaxServerEngine(check_model_path(cfg), weights_dir, port=urlsplit(address).port,
                             log_dir=Path(cfg.output_dir) / "engines", settings=settings,
                             api_key=cfg.rollout_engine_api_key)


def eval_sampling(cfg: RelaxConfig) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.eval_max_response_len or cfg.rollout_max_response_len,
        temperature=cfg.eval_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
        stop=list(cfg.rollout_stop), stop_token_ids=list(cfg.rollout_stop_token_ids),
    )


def build_multimodal(cfg: RelaxConfig, model_path: Path, tokenizer) -> MultimodalPreparer | None:
    if not cfg.multimodal_keys:
        return None
    try:
        return MultimodalPreparer(
            tokenizer, AutoConfig.from_pretrained(model_path), model_path, MultimodalSettings.from_config(cfg),
            cfg.system_prompt, cfg.apply_chat_template_kwargs, cfg.mm_processor_pool_size, cfg.skip_bad_samples,
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
        return RewardComputer(rm_type, cfg.custom_rm_path, group_rm=cfg.group_rm, args=cfg,
                              timeout_s=cfg.reward_timeout, custom_workers=cfg.custom_rm_workers,
                              worker_memory_mb=cfg.reward_worker_memory_mb,
                              remote=remote if remote is not None else remote_reward(cfg))
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from None


def remote_reward(cfg: RelaxConfig) -> RemoteReward | GenerativeReward | None:
    """The reward server (--rm-url) or the judge model (--genrm-model-path), if the run names one."""
    if cfg.rm_url is not None and cfg.genrm_model_path is not None:
        raise ValueError(f"{flag('rm_url')} and {flag('genrm_model_path')} both given; set one")
    if cfg.rm_url is not None:
        return RemoteReward(cfg.rm_url)
    if cfg.genrm_model_path is None:
        return None
    device = resolve_device(cfg)
    return GenerativeReward(GenRMSettings.from_flags(
        cfg.genrm_model_path, cfg.genrm_prompt_template, cfg.genrm_sampling_config, cfg.genrm_engine_config,
        str(device), str(resolve_dtype(cfg, device)).removeprefix("torch.")))


def build_dynamic_sampling(cfg: RelaxConfig) -> DynamicSampling | None:
    if cfg.dynamic_sampling_filter_path is None:
        return None
    try:
        filter_fn = load_dotted_function(cfg.dynamic_sampling_filter_path, flag("dynamic_sampling_filter_path"))
    except (ValueError, ImportError, TypeError) as err:
        raise ConfigError(str(err)) from None
    return DynamicSampling(filter_fn, cfg.max_dynamic_sampling_rounds, args=cfg)


MULTI_TURN_PATH = "relax.engine.agentic.multi_turn:generate"


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


def load_eval_sets(cfg: RelaxConfig, tokenizer) -> dict:
    return {name: load_prompt_samples(spec, tokenizer, prompt_format(cfg)) for name, spec in cfg.eval_prompt_data.items()}


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


@dataclass
class Roles:
    tokenizer: object
    rollout: Rollout
    actor: Actor
    advantages: Advantages
    reference: ActorFwd | None
    total_steps: int
    device: torch.device
    inference_dtype: torch.dtype
    critic: Critic | None = None
    distillation: OnPolicyDistillation | None = None


def build_critic(cfg: RelaxConfig, model_path: Path, settings: TrainSettings) -> Critic:
    """PPO's value model, initialised from the policy checkpoint, with its own learning rate."""
    critic_lr = cfg.critic_lr or cfg.lr
    critic_settings = replace(settings, lr=critic_lr, min_lr=cfg.min_lr * critic_lr / cfg.lr, entropy_grad=False)
    loss_fn = build_value_loss_fn(cfg.value_clip, cfg.loss_aggregation, cfg.rollout_max_response_len)
    return Critic(FSDPTrainBackend(model_path, critic_settings, value_head=True), loss_fn, cfg.train_batch_size)


def check_teacher_path(cfg: RelaxConfig, tokenizer) -> Path:
    path = Path(cfg.teacher_hf_checkpoint)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {path}: not a Hugging Face model folder (no config.json)")
    teacher_vocab = AutoConfig.from_pretrained(path).vocab_size
    if teacher_vocab != AutoConfig.from_pretrained(cfg.hf_checkpoint).vocab_size:
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {path}: vocabulary of {teacher_vocab} tokens differs from "
                          f"the student's; distillation compares log-probs token by token")
    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {path}: its tokenizer differs from the student's")
    return path


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
    prompts: list
    total_steps: int
    spec: AlgorithmSpec
    device: torch.device
    dtype: torch.dtype
    settings: TrainSettings


def build_context(cfg: RelaxConfig) -> BuildContext:
    """Validate the run's inputs and resolve device, tokenizer, prompts and trainer settings."""
    model_path = check_model_path(cfg)
    if not cfg.prompt_data:
        raise ConfigError(f"{flag('prompt_data')} is required for training")
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    if device.type == "cpu":
        set_cpu_threads(AutoConfig.from_pretrained(model_path).get_text_config().hidden_size, cfg.cpu_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    load_training_samples = load_sft_samples if cfg.loss_type == "sft" else load_prompt_samples
    prompts = load_training_samples(cfg.prompt_data, tokenizer, prompt_format(cfg))
    total_steps = cfg.total_rollout_steps(len(prompts))
    spec = get_algorithm(cfg.advantage_estimator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = TrainSettings(
        device=device, compute_dtype=dtype, micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.rollout_temperature, pad_token_id=pad_id, lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_style=cfg.lr_decay_style,
        total_optimizer_steps=total_steps * cfg.steps_per_rollout, weight_decay=cfg.weight_decay,
        adam_betas=(cfg.adam_beta1, cfg.adam_beta2), adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad,
        gradient_checkpointing=cfg.gradient_checkpointing, entropy_grad=cfg.entropy_coef > 0,
        freeze_vision_tower=cfg.freeze_vision_tower, freeze_audio_tower=cfg.freeze_audio_tower,
        sequence_packing=cfg.sequence_packing, log_probs_chunk_size=cfg.log_probs_chunk_size,
        max_tokens_per_gpu=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
        log_probs_max_tokens_per_gpu=cfg.log_probs_max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
        balance_data=cfg.balance_data, liger_kernel=use_liger_kernel(cfg, device),
        lora=lora_settings(cfg) if cfg.lora_rank else None, moe_aux_loss_coef=cfg.moe_aux_loss_coef,
    )
    return BuildContext(cfg, model_path, tokenizer, prompts, total_steps, spec, device, dtype, settings)


def build_actor(ctx: BuildContext) -> Actor:
    cfg = ctx.cfg
    torch.manual_seed(cfg.seed)
    if cfg.loss_type == "sft":
        loss_fn = build_sft_loss_fn(cfg.loss_aggregation, cfg.rollout_max_response_len)
    else:
        loss_fn = build_policy_loss_fn(policy_loss_settings(cfg, ctx.spec))
    # The policy replays the rollout's routing (R3); the frozen reference routes by itself.
    settings = replace(ctx.settings, routing_replay=cfg.use_rollout_routing_replay)
    return Actor(FSDPTrainBackend(ctx.model_path, settings), loss_fn, cfg.train_batch_size,
                 routing_replay=cfg.use_rollout_routing_replay, loss_aggregation=cfg.loss_aggregation)


def build_advantages(ctx: BuildContext) -> Advantages:
    cfg = ctx.cfg
    return Advantages(ctx.spec, cfg.n_samples_per_prompt, normalize_std=not cfg.disable_grpo_std_normalization,
                      kl_coef=cfg.kl_coef, gamma=cfg.gamma, lambd=cfg.lambd)


def build_reference(ctx: BuildContext) -> ActorFwd:
    """The frozen initial model: it serves the KL loss and the KL in the reward alike."""
    return ActorFwd(FSDPTrainBackend(ctx.model_path, ctx.settings, trainable=False))


def build_rollout(ctx: BuildContext, rewards: RewardComputer | None = None,
                  dynamic_sampling: DynamicSampling | None = None) -> Rollout:
    cfg, tokenizer = ctx.cfg, ctx.tokenizer
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
        data_source=PromptDataSource(ctx.prompts, cfg.rollout_batch_size, cfg.rollout_shuffle, cfg.rollout_seed),
        rewards=rewards, sampling=sampling, n_samples_per_prompt=cfg.n_samples_per_prompt, seed=cfg.rollout_seed,
        eval_sets=load_eval_sets(cfg, tokenizer), eval_sampling=eval_sampling(cfg),
        n_samples_per_eval_prompt=cfg.n_samples_per_eval_prompt,
        dynamic_sampling=dynamic_sampling, overlong=build_overlong_penalty(cfg),
        routing_replay=cfg.use_rollout_routing_replay, **build_generation(cfg, ctx.model_path, tokenizer),
    )


def needs_critic(cfg: RelaxConfig, spec: AlgorithmSpec) -> bool:
    return spec.needs_critic and cfg.loss_type != "sft"


def needs_reference(cfg: RelaxConfig, advantages: Advantages) -> bool:
    return cfg.use_kl_loss or advantages.needs_kl


def check_data_parallel_rollout(cfg: RelaxConfig) -> None:
    """Under torchrun every rank runs the loop and generates its share of each call's groups in lockstep
    (`DataParallelEngine`): only the colocated sync loop with in-process single-call rollouts does that."""
    if world_size() == 1:
        return
    unsupported = [flag(name) for name in ("fully_async", "hybrid", "rollout_external", "rollout_api_port",
                                           "rollout_interaction_env_path", "custom_generate_function_path")
                   if getattr(cfg, name)]
    if unsupported:
        raise ConfigError(f"{', '.join(unsupported)}: not supported with {world_size()} training ranks (torchrun); "
                          "multi-GPU colocated runs use the sync loop, and fully-async runs keep the trainer on "
                          "its own GPUs with the rollout in `relax serve` servers (docs/modes.md)")


def build_roles(cfg: RelaxConfig) -> Roles:
    """Everything a colocated run needs, validated before any training work starts."""
    # Reward and filter settings fail before the (slow) model loads.
    rewards = build_reward_computer(cfg)
    dynamic_sampling = build_dynamic_sampling(cfg)
    load_generate_function(cfg)
    ctx = build_context(cfg)
    actor = build_actor(ctx)  # joins the default process group (torchrun: all ranks)
    check_data_parallel_rollout(cfg)
    advantages = build_advantages(ctx)
    critic = build_critic(cfg, ctx.model_path, ctx.settings) if needs_critic(cfg, ctx.spec) else None
    distillation = build_distillation(cfg, ctx.tokenizer, ctx.settings, ctx.device, ctx.dtype) if cfg.use_opd else None
    reference = build_reference(ctx) if needs_reference(cfg, advantages) else None
    rollout = build_rollout(ctx, rewards, dynamic_sampling)
    logger.info("%d training prompts, %d rollout steps, device %s, dtype %s", len(ctx.prompts), ctx.total_steps,
                ctx.device, ctx.dtype)
    return Roles(ctx.tokenizer, rollout, actor, advantages, reference, ctx.total_steps, ctx.device, ctx.dtype, critic,
                 distillation)
