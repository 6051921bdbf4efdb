"""The rollout engine of a run: embedded, external servers (SGLang, OpenAI/vLLM, launched `relax serve` or vLLM) or a Ray Serve deployment, behind the router."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from urllib.parse import urlsplit

from relax.backends.inference.remote.broadcast import BroadcastWeightTransport
from relax.backends.inference.remote.launched_relax import RelaxServerEngine, RelaxServerSettings
from relax.backends.inference.remote.launched_vllm import VLLMServerEngine, VLLMServerSettings
from relax.backends.inference.remote.openai import OpenAIHTTPEngine
from relax.backends.inference.remote.sglang import SGLangHTTPEngine
from relax.backends.inference.router import EngineRouter
from relax.config import ConfigError, RelaxConfig, flag
from relax.core.engines.embedded import core_settings
from relax.core.preflight import check_model_path
from relax.core.run_settings import resolve_device, resolve_dtype
from relax.distributed.process_group import world_size

logger = logging.getLogger("relax")


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
    """`--rollout-serve-replicas N`: the engines as a Ray Serve deployment (`relax.core.engines.serve_deployment`), behind a
    router so that external servers can join it through the scaling API. Versions a previous process published
    are removed first: the trainer publishes its own weights at its first sync, and a replica must not start from
    a version number this run will publish again with other weights."""
    from relax.core.engines.serve_deployment import EngineDeployment, ServeEngine

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
                                   core=core_settings(cfg), max_batch_size=cfg.rollout_max_batch_size)
    return RelaxServerEngine(check_model_path(cfg), weights_dir, port=urlsplit(address).port,
                             log_dir=Path(cfg.output_dir) / "engines", settings=settings,
                             api_key=cfg.rollout_engine_api_key)


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
