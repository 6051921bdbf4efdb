"""Every check a run's settings allow before any model or data is loaded and before a run directory exists: the model folder, the data files, the checkpoint to load, the optional extras, the reward and plugin paths. Each failure names the flag and what is wrong."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig

from relax.backends.inference.answer_room import pool_tokens
from relax.backends.inference.engine_core.kv_cache import kv_bytes_per_token, pool_problem
from relax.backends.models.family import (
    is_qwen3_omni,
    model_config_problem,
    model_files_problem,
    model_folder_problem,
    model_from_config,
    model_positions,
    read_tokenizer,
)
from relax.backends.models.registry import UnsupportedModelError, check_supported, traits
from relax.backends.models.routing_replay import routing_shape
from relax.backends.training import lora
from relax.backends.training.layout import check_layout, trainer_uses
from relax.backends.training.lora import inject
from relax.backends.training.mesh import ParallelDims
from relax.backends.training.moe import moe_aux_loss
from relax.config import ConfigError, RelaxConfig, flag
from relax.core.roles import roles_for_config
from relax.core.rollout_parts import (
    build_dynamic_sampling,
    build_eval_reward_computer,
    build_reward_computer,
    load_generate_function,
)
from relax.core.run_settings import (
    actor_train_settings,
    algorithm_spec,
    custom_policy_loss,
    lora_settings,
    resolve_device,
    resolve_dtype,
    train_settings,
)
from relax.core.state import checkpoint
from relax.core.state.run_dir import loads_a_run_without_checkpoints
from relax.data.chat_template import template_syntax_problem
from relax.data.dataset import DatasetError, parse_data_spec
from relax.rollout.agentic.tools import BUILTIN_TOOLS, load_user_tool
from relax.telemetry.notify import invalid_url_positions, split_urls
from relax.telemetry.tracking import wandb_credentials_problem
from relax.utils.http_server import ListenError, listening_socket

logger = logging.getLogger("relax")


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
    load_as = "new_score_head" if cfg.loss_type == "rm" else "generation"  # (a reward model's head may be new)
    problem = model_files_problem(cfg.hf_checkpoint, load_as=load_as)
    if problem is not None:
        raise ConfigError(f"{flag('hf_checkpoint')} {problem}")


def check_stop_token_ids(cfg: RelaxConfig, config, model_path: Path) -> None:
    """--rollout-stop-token-ids name tokens the model can sample: an id past its embedding rows could never match
    (a typo, or another model's id), so the flag had done nothing."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    beyond = [token for token in cfg.rollout_stop_token_ids if rows is not None and token >= rows]
    if beyond:
        raise ConfigError(f"{flag('rollout_stop_token_ids')} {beyond[0]}: the model at {model_path} has {rows} "
                          f"tokens (ids 0 to {rows - 1}); no response could ever end with it")


def check_chat_template(cfg: RelaxConfig, model_path: Path) -> None:
    """--apply-chat-template's template compiles: one that does not had been reported against the first row, as if
    the row were wrong."""
    if cfg.apply_chat_template:
        problem = template_syntax_problem(read_tokenizer(model_path))
        if problem is not None:
            raise ConfigError(f"{flag('apply_chat_template')}: the model at {model_path}: {problem}")


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
    with torch.device("meta"):  # the adapters too: peft makes them on the default device
        _check_model_options(cfg, model_from_config(config, torch.float32), model_path)


def _check_model_options(cfg: RelaxConfig, model, model_path: Path) -> None:
    try:
        if cfg.moe_aux_loss_coef:
            moe_aux_loss(model, cfg.moe_aux_loss_coef)
        if cfg.use_rollout_routing_replay:
            routing_shape(model)
        if cfg.lora_rank:
            adapters = inject(model, lora_settings(cfg))
            own = sum(parameter.numel() for name, parameter in model.named_parameters() if not lora.is_adapter(name))
            if adapters > own:  # (a rank of 10**8 failed in the allocator once the model loaded)
                raise ValueError(f"{flag('lora_rank')} {cfg.lora_rank}: {adapters:,} adapter parameters, more than "
                                 f"the model's own {own:,}; a full fine-tune (no {flag('lora_rank')}) trains fewer")
    except ValueError as error:
        raise ConfigError(f"{error} (the model at {model_path})") from None


def check_context_length(cfg: RelaxConfig, config, model_path: Path) -> None:
    """The lengths asked for fit the model's positions (beyond them a forward fails deep inside, or quietly
    computes garbage with positions it was never trained on)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not limit or cfg.loss_type == "rm":  # (a reward model generates nothing; its pairs are checked at load)
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


def trainer_processes(cfg: RelaxConfig, role: str) -> int:
    """The processes that hold ``role``'s model together (one FSDP2 process group): its --resource replicas with
    --placement ray (the reference of --hybrid lives in the actor's), torchrun's WORLD_SIZE in process."""
    if cfg.placement == "ray":
        if role == "reference" and cfg.hybrid:
            role = "actor"
        return int(cfg.resource.get(role, [1, 1])[0])
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_parallel_layout(cfg: RelaxConfig, config, model_path: Path) -> None:
    """The parallel sizes fit each trainer's processes and the model (heads, key-value heads, experts, layers, a
    tensor-parallel plan), and what each trainer does is built for its layout: the trainer's own check
    (`layout.check_layout`) on the settings it will get, which failed after the model loaded, with a traceback and
    exit status 1."""
    roles = roles_for_config(cfg)
    device = resolve_device(cfg)
    settings = train_settings(cfg, device, resolve_dtype(cfg, device), pad_token_id=0, total_steps=1)
    for role in ("actor", "critic", "reference"):
        if role not in roles:
            continue
        trainable, value_head = role != "reference", role == "critic" or cfg.loss_type == "rm"
        uses = trainer_uses(actor_train_settings(cfg, settings) if role == "actor" else settings, config,
                            trainable, value_head)
        processes = trainer_processes(cfg, role)
        dims = ParallelDims(processes, tp=cfg.tensor_model_parallel_size, ep=cfg.expert_model_parallel_size,
                            cp=cfg.context_parallel_size, pp=cfg.pipeline_model_parallel_size,
                            dp_replicate=cfg.data_parallel_replicate_size)
        try:
            check_layout(dims, config, uses)
        except ValueError as error:
            where = f"--resource {role}: {processes} processes" if cfg.placement == "ray" else \
                f"{processes} process{'es' if processes > 1 else ''}"
            raise ConfigError(f"{error} (the {role} of the model at {model_path}, {where})") from None


def check_kv_pool(cfg: RelaxConfig, config, model_path: Path) -> None:
    """A --max-total-tokens pool that cannot fit the device (a CUDA device's whole memory, the host's free memory),
    even before anything else takes some, failed inside torch's allocator with a traceback when the engine started
    (the engine checks again, for the engines that start later). Only where the engine is this machine's embedded
    one: an external server or a Ray cluster elsewhere sizes its own."""
    if not cfg.max_total_tokens or cfg.loss_type == "rm" or cfg.rollout_external or cfg.ray_address \
            or not traits(config).engine_core:
        return
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    device = resolve_device(cfg)
    token_bytes = kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, head_dim,
                                     resolve_dtype(cfg, device), cfg.kv_cache_dtype)
    problem = pool_problem(cfg.max_total_tokens, token_bytes, device, whole_device=True)
    if problem is not None:
        raise ConfigError(f"{flag('max_total_tokens')} {cfg.max_total_tokens}: {problem} (the model at "
                          f"{model_path}); give a smaller pool, or leave it unset for the engine to size it "
                          f"({flag('mem_fraction_static')} of the free memory on CUDA)")


def check_pool_holds_a_response(cfg: RelaxConfig, model_path: Path) -> None:
    """A --max-total-tokens pool smaller than one prompt token and a whole response: the engine ends every sequence
    at its pool with "length", so no response could reach --rollout-max-response-len (the positions bound such
    responses anyway where they are the smaller)."""
    pool = pool_tokens(cfg)
    if pool is None or cfg.trains_on_dataset or cfg.loss_type == "rm":
        return
    responses = max(cfg.rollout_max_response_len, cfg.eval_max_response_len or 0)
    need = min(1 + responses, model_positions(model_path) or 1 + responses)
    if pool < need:
        name = "rollout_max_response_len" if responses == cfg.rollout_max_response_len else "eval_max_response_len"
        raise ConfigError(f"{flag('max_total_tokens')} {cfg.max_total_tokens}: the engine's KV pool holds {pool} "
                          f"token slots (whole pages of {flag('page_size')} {cfg.page_size}), fewer than a prompt "
                          f"token and a response of {flag(name)} {responses}: every response would end at the pool; "
                          f"give at least {need}, or leave it unset for the engine to size it")


def preflight(cfg: RelaxConfig, training: bool = True) -> Path:
    """The checks a run's settings allow without loading a model or data, done before a run directory exists:
    the model folder and its context length, the data files, the checkpoint to load, the reward and the plugin
    paths. Returns the model folder."""
    check_optional_dependencies(cfg)
    model_path = check_model_path(cfg)
    config = AutoConfig.from_pretrained(model_path)  # read once for the checks below
    check_model_family(config, model_path)
    check_model_files(cfg)
    check_chat_template(cfg, model_path)
    check_stop_token_ids(cfg, config, model_path)
    if training and (cfg.lora_rank or cfg.moe_aux_loss_coef or cfg.use_rollout_routing_replay):
        check_model_options(cfg, config, model_path)
    if cfg.use_audio_in_video and not is_qwen3_omni(config):
        raise ConfigError(f"{flag('use_audio_in_video')}: the model at {model_path} ({config.model_type}) does not "
                          "take video with its sound track here; the Qwen3-Omni thinker does (Qwen2.5-Omni "
                          "interleaves by chunks of seconds, not built yet)")
    check_context_length(cfg, config, model_path)
    if training:
        check_parallel_layout(cfg, config, model_path)
        check_kv_pool(cfg, config, model_path)
        check_pool_holds_a_response(cfg, model_path)
    check_data_files(cfg, training)
    if cfg.load and not loads_a_run_without_checkpoints(cfg):
        try:
            root = checkpoint.resolve_checkpoint_root(cfg.load)
        except checkpoint.CheckpointError as error:
            raise ConfigError(f"{flag('load')} {error}") from None
        check_load_matches_model(cfg, root, config, model_path)
    if cfg.loss_type != "rm":  # (a reward model's run rewards nothing)
        build_reward_computer(cfg).close()
    eval_rewards = build_eval_reward_computer(cfg)
    if eval_rewards is not None:
        eval_rewards.close()
    build_dynamic_sampling(cfg)
    load_generate_function(cfg)
    check_user_tools(cfg)
    check_ports(cfg)
    algorithm_spec(cfg)  # the custom advantage and policy-loss functions import
    custom_policy_loss(cfg)
    check_notify_urls(cfg)
    if cfg.use_wandb and (problem := wandb_credentials_problem()):
        raise ConfigError(f"{flag('use_wandb')}: {problem}")
    return model_path


# The fields of a text config that fix the shapes of the weights a checkpoint holds.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size",
                "tie_word_embeddings")


def check_load_matches_model(cfg: RelaxConfig, root: Path, config, model_path: Path) -> None:
    """--load's checkpoints were written for a model of --hf-checkpoint's shapes (the config they keep in ``hf/``):
    a different model failed inside torch's checkpoint reader, after the model loaded, as a size mismatch with
    exit status 1 (which a supervised run takes for a fault and restarts)."""
    try:
        saved = AutoConfig.from_pretrained(root / checkpoint.HF_DIR).get_text_config()
    except Exception:  # noqa: BLE001 - none yet, or a write cut short, which the next save repairs: the reader
        saved = None  # checks the shapes then
    ours = config.get_text_config()
    differ = [f"{name} {getattr(saved, name, None)} there, {getattr(ours, name, None)} here" for name in SHAPE_FIELDS
              if saved is not None and getattr(saved, name, None) != getattr(ours, name, None)]
    if differ:
        raise ConfigError(f"{flag('load')} {cfg.load}: its checkpoints are of another model than "
                          f"{flag('hf_checkpoint')} {model_path} ({'; '.join(differ)}); resume with the model the run "
                          "started from")
    check_load_matches_adapters(cfg, root, model_path)


def check_load_matches_adapters(cfg: RelaxConfig, root: Path, model_path: Path) -> None:
    """A LoRA run resumes as a LoRA run with the same adapters, on the base model they were trained on; a full
    fine-tune resumes without adapters (either way round, the checkpoint reader failed on missing or resized
    weights after the model loaded)."""
    adapters_saved = (root / lora.METADATA_FILE).is_file()
    if not adapters_saved and not cfg.lora_rank:
        return
    if not adapters_saved:
        raise ConfigError(f"{flag('lora_rank')} {cfg.lora_rank}: the checkpoints of {flag('load')} {cfg.load} hold "
                          f"a full fine-tune, not adapters; resume without {flag('lora_rank')}")
    try:
        saved, _ = lora.read_metadata(root, model_path)
    except lora.BaseModelChangedError as error:
        raise ConfigError(f"{flag('load')} {error}") from None
    if not cfg.lora_rank:
        raise ConfigError(f"{flag('load')} {cfg.load}: its checkpoints hold LoRA adapters (rank {saved.rank}); resume "
                          f"with {flag('lora_rank')} {saved.rank} and the run's other LoRA settings")
    asked = lora_settings(cfg)
    names = {"rank": "lora_rank", "alpha": "lora_alpha", "target_modules": "target_modules", "scope": "lora_scope"}
    differ = [f"{flag(option)} {getattr(saved, field)} there, {getattr(asked, field)} here"
              for field, option in names.items() if getattr(saved, field) != getattr(asked, field)]
    if differ:
        raise ConfigError(f"{flag('load')} {cfg.load}: its adapters were trained with other LoRA settings "
                          f"({'; '.join(differ)}); resume with the run's own")


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


def check_user_tools(cfg: RelaxConfig) -> None:
    """Every user tool of --tools imports and can be described to the model (its failure used to surface at the
    first prompt that offered it, as a traceback)."""
    for entry in cfg.tools:
        if entry not in BUILTIN_TOOLS:
            try:
                load_user_tool(entry)
            except (ValueError, ImportError) as err:
                raise ConfigError(str(err)) from None


def check_ports(cfg: RelaxConfig) -> None:
    """The ports the run will listen on are free now (a probe: listened on and let go), so that a taken one fails
    before the model loads rather than minutes into the run."""
    ports = {"rollout_api_port": cfg.rollout_api_port,
             "metrics_service_port": cfg.metrics_service_port if cfg.use_metrics_service else None}
    for name, port in ports.items():
        if port:  # (0: the OS picks one)
            try:
                listening_socket("127.0.0.1", port, flag(name)).close()
            except ListenError as err:
                raise ConfigError(str(err)) from None


def check_notify_urls(cfg: RelaxConfig) -> None:
    urls = split_urls(cfg.notify_urls)
    if not urls:
        return
    bad = invalid_url_positions(urls)
    if bad:  # by position: the text may hold a token
        raise ConfigError(f"{flag('notify_urls')}: URL {', '.join(map(str, bad))} of {len(urls)} is not one Apprise "
                          "knows (https://github.com/caronc/apprise/wiki; the URL is not shown: it may hold a token)")


def check_teacher_path(cfg: RelaxConfig, tokenizer) -> Path:
    path = Path(cfg.teacher_hf_checkpoint)
    problem = model_folder_problem(path, needs_tokenizer=False)  # its tokenizer is read below, once
    if problem is not None:
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {problem}")
    teacher_vocab = AutoConfig.from_pretrained(path).vocab_size
    if teacher_vocab != AutoConfig.from_pretrained(cfg.hf_checkpoint).vocab_size:
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {path}: vocabulary of {teacher_vocab} tokens differs from "
                          f"the student's; distillation compares log-probs token by token")
    try:
        teacher_tokenizer = read_tokenizer(path)
    except ValueError as error:
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {error}") from None
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{flag('teacher_hf_checkpoint')} {path}: its tokenizer differs from the student's")
    return path
