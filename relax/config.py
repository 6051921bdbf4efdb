"""The typed run configuration.

One pydantic model holds every setting. YAML files (`--config`) and command-line flags both
fill it; `relax train --help` and `docs/config.md` are generated from the field descriptions
below, so the reference cannot drift from the code. Field names follow upstream Relax
(`--rollout-batch-size` is `rollout_batch_size`) wherever the concept is the same.

This module sits beside the layers (like `relax.data`): every layer reads the config, so it
may not live in the entrypoint layer that fills it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.algorithms import ALGORITHM_SPECS
from relax.algorithms.aggregation import LossAggregation

KLType = Literal["k1", "k2", "k3", "low_var_kl"]


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and the rule it broke."""


def flag(field_name: str) -> str:
    """The command-line spelling of a config field: ``rollout_batch_size`` → ``--rollout-batch-size``."""
    return "--" + field_name.replace("_", "-")


# Sections group the fields in --help and docs/config.md; the order here is the order shown.
SECTIONS = ("model", "data", "multimodal", "batch", "mode", "rollout", "engines", "algorithm", "critic", "distillation", "optimizer", "lora", "reward",
            "eval",
            "run", "placement")
CRITIC_FIELDS = ("critic_lr", "num_critic_only_steps", "value_clip", "lambd")
OPD_FIELDS = ("opd_type", "teacher_hf_checkpoint", "opd_kl_type", "opd_kl_coef", "opd_loss_coef",
              "opd_log_prob_top_k", "opd_norm_mode")
OPD_TYPE_ALIASES = {"sglang": "engine", "megatron": "trainer"}  # upstream's names for the same placements


def _field(default: Any, help: str, section: str, *, secret: bool = False, **kwargs: Any) -> Any:
    """A setting. ``secret`` marks a value that never leaves the process: it is logged as set or unset, and the saved
    config leaves it out (`RelaxConfig.shareable_settings`)."""
    return Field(default, description=help, json_schema_extra={"section": section, "secret": secret}, **kwargs)


class RelaxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    # --- model ---------------------------------------------------------------------------
    hf_checkpoint: str | None = _field(
        None, "Hugging Face model folder (config, weights, tokenizer) that the run starts from.", "model"
    )
    dtype: Literal["auto", "float32", "bfloat16"] = _field(
        "auto",
        "Parameter dtype for inference and the training forward. `auto`: bfloat16 on CUDA, float32 on CPU. "
        "Training keeps float32 master weights and optimizer state in every case.",
        "model",
    )
    device: Literal["auto", "cpu", "cuda"] = _field("auto", "Where to run. `auto`: CUDA when available.", "model")
    cpu_threads: int = _field(
        0, "Threads torch computes with on CPU. 0: chosen at start by measuring the model's matrix products at 1, 2, "
        "4, ... threads within the cores the machine's load leaves free (a tiny model is fastest on one; a busy "
        "machine gets fewer); $OMP_NUM_THREADS, when set, is taken instead.", "model", ge=0, le=1024,
    )
    gradient_checkpointing: bool = _field(
        False, "Recompute activations in the backward pass to save memory.", "model"
    )
    liger_kernel: Literal["auto", "on", "off"] = _field(
        "auto", "liger-kernel's fused RMSNorm, SwiGLU and RoPE kernels in the trainer's language model (Qwen2/3, "
        "Llama, Mistral families): `auto` uses them on CUDA when liger-kernel is installed, `on` requires them.",
        "model",
    )

    # --- data ----------------------------------------------------------------------------
    prompt_data: str | None = _field(
        None,
        "Training prompts: a .jsonl or .parquet file, optionally sliced as `file.jsonl@[0:100]`.",
        "data",
    )
    input_key: str = _field("input", "Row field holding the prompt (a string or a list of chat messages).", "data")
    label_key: str | None = _field("label", "Row field holding the reference answer given to the reward.", "data")
    metadata_key: str = _field("metadata", "Row field holding a dict copied into `Sample.metadata`.", "data")
    apply_chat_template: bool = _field(
        False, "Render prompts with the tokenizer's chat template (a string prompt becomes one user message).", "data"
    )
    apply_chat_template_kwargs: dict[str, Any] = _field(
        {}, "Extra keyword arguments for `apply_chat_template` (JSON), e.g. `{\"enable_thinking\": false}`.", "data"
    )
    system_prompt: str | None = _field(None, "A system message put before every prompt (needs the chat template).", "data")
    tool_key: str | None = _field(
        None,
        "Row field listing the tools the prompt offers: tool names (`python`, `calculator`, a --tools function's "
        "name) or OpenAI-style function specs, as a list or a JSON string. The chat template shows them to the "
        "model and they go into `Sample.metadata[\"tools\"]` for relax.engine.agentic.tool_env (docs/agentic.md).",
        "data",
    )
    rollout_shuffle: bool = _field(False, "Shuffle the prompts, with a new order each epoch.", "data")
    rollout_seed: int = _field(42, "Seed of the prompt order and of rollout sampling.", "data")

    # --- multimodal ----------------------------------------------------------------------
    multimodal_keys: dict[str, str] = _field(
        {},
        "Media columns by type (JSON), e.g. `{\"image\": \"images\", \"audio\": \"audios\"}`. `<image>`, `<video>`, "
        "`<audio>` in prompts take the next item of that column; inline typed message items work too. Media may be "
        "paths (relative to the data file), file:// URLs, bytes, base64, data URIs or {bytes|base64|path} dicts.",
        "multimodal",
    )
    image_min_token_num: int = _field(4, "Fewest tokens per image (smart resize).", "multimodal", ge=1)
    image_max_token_num: int = _field(16384, "Most tokens per image (smart resize).", "multimodal", ge=1)
    image_resize_scale_factor: int | None = _field(
        None, "Image sides are resized to multiples of this (default patch x merge of the model; 0: off).",
        "multimodal", ge=0,
    )
    video_min_token_num: int = _field(128, "Fewest tokens per video frame budget.", "multimodal", ge=1)
    video_max_token_num: int = _field(768, "Most tokens per video frame budget.", "multimodal", ge=1)
    video_fps: float = _field(2.0, "Frames sampled per second of video.", "multimodal", gt=0)
    video_fps_min_frames: int = _field(4, "Fewest frames sampled from a video.", "multimodal", ge=1)
    video_fps_max_frames: int = _field(768, "Most frames sampled from a video.", "multimodal", ge=1)
    frame_factor: int = _field(2, "Sampled frame counts are multiples of this.", "multimodal", ge=1)
    audio_sample_rate: int = _field(16000, "Audio is resampled to this rate (Hz).", "multimodal", ge=1)
    use_audio_in_video: bool = _field(
        False, "Give an omni model each video's sound track too, inside the video's tokens and interleaved with its "
        "frames by time (the Qwen3-Omni thinker's use_audio_in_video); a video without sound gets silence of its "
        "length. Needs video in --multimodal-keys.", "multimodal")
    mm_processor_pool_size: int = _field(
        2, "Worker threads that decode and process media off the rollout loop.", "multimodal", ge=1
    )
    skip_bad_samples: bool = _field(
        False, "Skip (and count) rows whose media cannot be read instead of stopping with an error.", "multimodal"
    )
    freeze_vision_tower: bool = _field(False, "Do not train the vision encoder.", "multimodal")
    freeze_audio_tower: bool = _field(False, "Do not train the audio encoder.", "multimodal")

    # --- batch ---------------------------------------------------------------------------
    rollout_batch_size: int = _field(8, "Prompts per rollout step.", "batch", ge=1)
    n_samples_per_prompt: int = _field(
        8,
        "Responses sampled per prompt (the GRPO group size). Upstream defaults to 1, which leaves group-relative "
        "estimators without a baseline; 8 is a working default.",
        "batch",
        ge=1,
    )
    global_batch_size: int | None = _field(
        None,
        "Samples per optimizer step. Default: all samples of a rollout step (one update per step). "
        "Must divide rollout_batch_size * n_samples_per_prompt.",
        "batch",
        ge=1,
    )
    micro_batch_size: int = _field(1, "Samples per forward/backward pass (gradients accumulate).", "batch", ge=1)
    use_dynamic_batch_size: bool = _field(
        False, "Fill each micro-batch with whole samples up to --max-tokens-per-gpu tokens instead of "
        "--micro-batch-size samples (balanced, so none is a small remainder). The gradient is the same.", "batch"
    )
    max_tokens_per_gpu: int | None = _field(
        None, "Token budget of a training micro-batch with --use-dynamic-batch-size (prompt + response tokens); "
        "must hold the longest sample.", "batch", ge=1,
    )
    log_probs_max_tokens_per_gpu: int | None = _field(
        None, "Token budget of a micro-batch of the forwards without gradient (old, reference and teacher "
        "log-probs, values) with --use-dynamic-batch-size. Default: --max-tokens-per-gpu.", "batch", ge=1,
    )
    balance_data: bool = _field(
        False, "With several training processes, give each an equal number of tokens instead of a strided "
        "share of the samples.", "batch"
    )
    sequence_packing: bool = _field(
        True, "Micro-batches are packed rows of whole samples attended apart (no padding); --no-sequence-packing "
        "right-pads them instead (the previous layout, kept for comparison).", "batch"
    )
    log_probs_chunk_size: int = _field(
        4096, "Response tokens per chunk of the LM head and log-softmax, so that no full float32 logits exist "
        "(0: compute the logits of a micro-batch at once, the previous path). 4096 measured 4 percent faster than 1024 "
        "per training step on an H200 (Qwen3-0.6B shape) for 2.6 GB more peak memory.", "batch", ge=0,
    )
    num_rollout: int | None = _field(None, "Rollout steps to train for.", "batch", ge=1)
    num_epoch: int | None = _field(
        None, "Passes over the prompt data; with --num-rollout too, the smaller wins.", "batch", ge=1
    )

    # --- mode ----------------------------------------------------------------------------
    colocate: bool = _field(
        False, "Synchronous colocated training with the trainer and the engine time-sharing the device: turns on "
        "--offload-train and --offload-rollout unless they are set (as upstream's). Without it the sync mode "
        "keeps both resident; refused with the async modes.", "mode"
    )
    offload: bool = _field(
        False, "Both --offload-train and --offload-rollout (unless set on their own).", "mode"
    )
    offload_train: bool | None = _field(
        None, "Move the trainers' weights, gradients and optimizer state (actor, reference, critic, trainer teacher) "
        "to pinned host memory while rolling out; they come back for training (default: --offload or --colocate).",
        "mode",
    )
    offload_rollout: bool | None = _field(
        None, "Free the embedded engine's KV pool, CUDA graphs and weights while training; its weights are re-sent "
        "with the next weight sync (default: --offload or --colocate).", "mode",
    )
    fully_async: bool = _field(
        False,
        "Rollout runs ahead of training through the data plane, by at most --max-staleness weight versions.",
        "mode",
    )
    hybrid: bool = _field(
        False,
        "Rollout runs ahead as in --fully-async, while the reference, old-policy forwards and advantages run over "
        "whole steps inside the trainer's step (under --placement ray the reference lives in the actor's "
        "processes), as upstream's hybrid; --partial-rollout is refused. Exclusive with --fully-async "
        "(docs/modes.md).",
        "mode",
    )
    max_staleness: int = _field(
        0,
        "How many weight versions rollout may run ahead of training (0: each step waits for the previous "
        "update). Samples older than this when trained on are dropped and counted (data/dropped_stale_groups).",
        "mode",
        ge=0,
    )
    partial_rollout: bool = _field(
        False,
        "Let a weight update land while responses are being generated (they continue with the new weights; "
        "each token records its version) instead of waiting for the generation in flight.",
        "mode",
    )
    data_wait_timeout: float = _field(
        3600.0,
        "Longest wait (seconds) in the async modes for a rollout step's data, a staleness slot or the end of the "
        "generation before a weight push; past it the run stops with an error naming what it waited for.",
        "mode",
        gt=0,
    )
    train_stream_chunks: int = _field(
        4,
        "--fully-async: the trainer reads a step's groups as they land and trains on them in up to this many chunks "
        "before the last group arrives (one optimizer step; the loss's global denominators are rescaled at the end, "
        "so the update equals training on the whole step). 1 waits for the whole step. Steps that need the whole "
        "batch first (old-policy log-probs, a critic, whitened or KL-shaped advantages) always wait.",
        "mode",
        ge=1,
    )
    mask_offpolicy_in_partial_rollout: bool = _field(
        False, "With --partial-rollout, keep only the tokens of the newest weight version in the loss.", "mode"
    )

    # --- rollout -------------------------------------------------------------------------
    rollout_max_prompt_len: int | None = _field(
        None, "Prompts longer than this many tokens are dropped at load time (and counted).", "rollout", ge=1
    )
    rollout_max_response_len: int = _field(1024, "Maximum new tokens per response.", "rollout", ge=1)
    rollout_temperature: float = _field(1.0, "Sampling temperature for training rollouts.", "rollout", gt=0)
    rollout_top_p: float = _field(1.0, "Nucleus sampling threshold (1.0 disables it).", "rollout", gt=0, le=1)
    rollout_top_k: int = _field(-1, "Sample among the k most likely tokens (-1 disables it).", "rollout")
    rollout_stop: list[str] = _field([], "Stop strings; the match is kept in the response.", "rollout")
    rollout_stop_token_ids: list[int] = _field([], "Token ids that end a response besides EOS.", "rollout")
    rollout_max_batch_size: int | None = _field(
        None, "Most sequences the embedded engine decodes at once (default: all requests of a step).", "rollout", ge=1
    )
    engine_core: Literal["auto", "on", "off"] = _field(
        "auto",
        "The embedded engine's core (paged KV pool, continuous batching, CUDA graphs; docs/engines.md): `auto` uses "
        "it on CUDA for the text models it supports, `on` on every device, `off` keeps the Hugging Face decode loop.",
        "rollout",
    )
    mem_fraction_static: float = _field(
        0.4,
        "On CUDA, the share of the device memory free when the engine starts (after its weights, a colocated "
        "trainer's and other engines') that its KV pool takes. SGLang's flag counts a share of the whole device, "
        "weights included, which suits a server alone on its GPU but fails or starves a colocated trainer. The "
        "default leaves room for training.",
        "rollout", gt=0, lt=1,
    )
    max_total_tokens: int | None = _field(
        None, "The KV pool's size in tokens, instead of --mem-fraction-static (CPU default: 65,536 tokens, at most "
        "256 MiB).", "rollout", ge=64,
    )
    max_prefill_tokens: int = _field(
        8192, "Most prompt tokens the engine prefills in one step (a longer single prompt runs alone).", "rollout",
        ge=16,
    )
    page_size: int = _field(16, "Token slots per block of the engine's KV pool.", "rollout", ge=1, le=256)
    cuda_graph_max_bs: int = _field(
        256, "Largest decode batch captured in a CUDA graph (larger batches decode eagerly).", "rollout", ge=1,
        le=512,
    )
    disable_cuda_graph: bool = _field(False, "Decode without CUDA graphs (for debugging).", "rollout")
    dynamic_sampling_filter_path: str | None = _field(
        None,
        "DAPO dynamic sampling: dotted path `module:function` of a group filter `fn(args, samples) -> bool | "
        "DynamicFilterOutput(keep, reason)`, called on each scored prompt group. Rejected groups are dropped "
        "and refilled from the next prompts until --rollout-batch-size groups are kept. Built-in: "
        "`relax.engine.filters.dynamic_sampling:check_reward_nonzero_std` (keep groups whose rewards differ).",
        "rollout",
    )
    max_dynamic_sampling_rounds: int = _field(
        8,
        "Most generation rounds per step with dynamic sampling; past it the step trains on the groups kept "
        "so far (a warning is logged).",
        "rollout",
        ge=1,
    )
    custom_generate_function_path: str | None = _field(
        None,
        "Dotted path `module:function` of a per-sample generate function `async def generate(args, sample, "
        "sampling_params) -> Sample | list[Sample]` used instead of the built-in one (training and eval); see "
        "docs/agentic.md.",
        "rollout",
    )
    rollout_interaction_env_path: str | None = _field(
        None,
        "Module (`pkg.module`, or `pkg.module:function`) whose `build_env(sample, args)` makes one interaction "
        "environment per sample; samples are then generated by the multi-turn loop "
        "(relax.engine.agentic.multi_turn.generate) unless --custom-generate-function-path is set.",
        "rollout",
    )
    max_turns: int = _field(5, "Most model turns of a multi-turn episode.", "rollout", ge=1)
    rollout_max_context_len: int | None = _field(
        None,
        "Most tokens (prompt + every turn's model and environment tokens) of a multi-turn episode; each turn's "
        "new tokens are capped by what is left. Default: the prompt's length + --rollout-max-response-len.",
        "rollout",
        ge=1,
    )
    env_step_timeout: float = _field(
        60.0,
        "Seconds an environment's reset or step may take; past it the sample is marked failed (and left out "
        "of the loss) and the run goes on.",
        "rollout",
        gt=0,
    )
    env_workers: int = _field(
        0, "Run the --rollout-interaction-env-path environments in this many worker processes instead of threads of "
        "the rollout's process: an environment that crashes its process (a segfault, os._exit, the OOM killer) "
        "fails only the episodes of its worker, which is replaced; each episode stays in one worker. 0: threads "
        "(docs/agentic.md).", "rollout", ge=0,
    )
    env_worker_memory_mb: int | None = _field(
        None, "Address-space cap (MiB, on top of what the worker holds once started) of each --env-workers "
        "process: an environment that leaks fails there with MemoryError.", "rollout", ge=64,
    )

    @model_validator(mode="after")
    def _check_lora(self) -> RelaxConfig:
        if not self.lora_rank:
            set_flags = [flag(name) for name in ("lora_alpha", "target_modules", "lora_scope") if self.changed(name)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('lora_rank')} > 0")
        elif not any(name.strip() for name in self.target_modules):
            raise ValueError(f"{flag('target_modules')} names no module")
        return self

    @model_validator(mode="after")
    def _check_env_workers(self) -> RelaxConfig:
        if self.env_workers and self.rollout_interaction_env_path is None:
            raise ValueError(f"{flag('env_workers')} needs {flag('rollout_interaction_env_path')}")
        if self.env_worker_memory_mb is not None and not self.env_workers:
            raise ValueError(f"{flag('env_worker_memory_mb')} needs {flag('env_workers')}")
        return self

    agent_command: str | None = _field(
        None,
        "The external agent program of `--custom-generate-function-path relax.engine.agentic.agent_rollout:generate`"
        ", split like a shell would (no shell runs it), e.g. `python my_agent.py --tries 2`. It runs once per sample "
        "and talks to the policy through the agent gateway's /v1/chat/completions (RELAX_BASE_URL, "
        "RELAX_SESSION_ID); see docs/agentic.md.",
        "rollout",
    )
    agent_timeout: float = _field(
        600.0,
        "Seconds an agent program may run; past it its process group is killed and the sample is marked failed.",
        "rollout",
        gt=0,
    )

    tools: list[str] = _field(
        [],
        "Tools of rows without a --tool-key column, and user tools: built-in names (`python`, `calculator`) or "
        "dotted paths `pkg.module:function` of functions with type hints and a Google-style docstring.",
        "rollout",
    )
    tool_call_parser: str = _field(
        "hermes", "How tool calls are read from the model's text: `hermes` (`<tool_call>{json}</tool_call>`; "
        "aliases `qwen`, `qwen25`, `qwen3`).", "rollout"
    )
    tool_timeout: float = _field(10.0, "Seconds one tool call may take (the python tool is killed after it).",
                                 "rollout", gt=0)
    python_tool_memory_mb: int = _field(512, "Address-space limit of the python tool's process (MiB).", "rollout",
                                        ge=64)

    # --- engines (external inference servers) ------------------------------------------------
    rollout_external: bool = _field(
        False,
        "Generate with inference servers started outside the run (`relax serve`, SGLang, vLLM) at "
        "--rollout-external-engine-addrs instead of an in-process engine; requests go through a router "
        "(least outstanding requests, one prompt group per server, retry on another server when one fails). "
        "See docs/engines.md.",
        "engines",
    )
    rollout_external_engine_addrs: list[str] = _field(
        [], "Base URLs of the external servers, e.g. `http://10.0.0.5:30000 http://10.0.0.6:30000`.", "engines"
    )
    rollout_engine_protocol: Literal["sglang", "openai", "vllm", "relax"] = _field(
        "sglang",
        "Protocol of the external servers: `sglang` (native /generate; `relax serve` and SGLang), `openai` "
        "(/v1/completions; weight updates need the server's /update_weights_from_disk), `vllm` (relax starts a "
        "vLLM server at each address, which must be http://127.0.0.1:PORT, from .venv-vllm or $RELAX_VLLM_PYTHON, "
        "and reloads its weights in place) or `relax` (relax starts a `relax serve` process at each "
        "http://127.0.0.1:PORT, on the trainer's device and dtype: each engine in a process of its own; "
        "docs/engines.md).",
        "engines",
    )
    rollout_health_check_interval: float = _field(
        30.0, "Seconds between health checks of an external engine while it has requests in flight (upstream's "
        "default); one that fails --rollout-health-check-max-consecutive-failures of them in a row (hung, stopped, "
        "unreachable) is given up on and its request groups go to another engine.", "engines", gt=0,
    )
    rollout_health_check_timeout: float = _field(
        30.0, "Seconds a health check may take before it counts as failed.", "engines", gt=0,
    )
    rollout_health_check_max_consecutive_failures: int = _field(
        2, "Failed health checks in a row after which an engine with requests in flight is given up on.", "engines",
        ge=1,
    )
    use_fault_tolerance: bool = _field(
        False, "Relaunch the rollout engines this run starts (--rollout-engine-protocol relax or vllm) when they die "
        "or stop answering health checks: the process group is killed, started again and loaded with the current "
        "weights before it gets work, while its request groups go to the other engines (or wait for it; "
        "upstream's flag; docs/fault_tolerance.md). The embedded engine recovers in place from an out-of-memory "
        "error instead (its core rebuilt, the failed requests decoded again with their seeds). Servers started "
        "outside the run are routed around and probed again without it.", "engines",
    )
    rollout_engine_max_relaunches: int = _field(
        3, "Relaunches per engine (in-place recoveries of the embedded engine) under --use-fault-tolerance; after "
        "them a failing engine stays down.", "engines",
        ge=1,
    )
    rollout_engine_api_key: str | None = _field(
        None, "Bearer token of the external servers' control endpoints (never logged, never saved).",
        "engines", secret=True,
    )
    rollout_weights_dir: str | None = _field(
        None,
        "Where the trainer writes new weights (versioned safetensors) for the external servers to load; they "
        "must read it at the same path (a shared filesystem). Default: <output-dir>/engine_weights.",
        "engines",
    )
    rollout_weight_sync_address: str = _field(
        "127.0.0.1",
        "With --rollout-external and --weight-sync-transport broadcast: the trainer's address the servers "
        "connect to for the weight-sync group (the trainer binds it).",
        "engines",
    )

    rollout_api_port: int | None = _field(
        None,
        "Serve the rollout engines' elastic-scaling REST API (/scale_out, /scale_in, /engines; docs/engines.md) on "
        "127.0.0.1:PORT while training, so engines can be added and removed during the run (`relax scale`); under "
        "--placement ray the rollout role's process serves it, on its node.",
        "engines",
        ge=1,
        le=65535,
    )
    rollout_serve_replicas: int = _field(
        0,
        "Run the rollout engines as a Ray Serve deployment of this many replicas (each an embedded engine in a Ray "
        "process of its own; a local Ray on 127.0.0.1 is started when none runs): Serve routes the calls (one per "
        "replica, whole prompt groups) to replicas, health-checks them every --rollout-health-check-interval s and "
        "replaces a dead one (its calls are sent again), and the scaling API's num_replicas sets the replica count. Weights reach the "
        "replicas as versioned safetensors under --rollout-weights-dir. 0: the engine in the trainer's process. "
        "docs/placement.md.",
        "engines",
        ge=0,
        le=1024,
    )
    rollout_num_gpus_per_engine: float = _field(
        1.0, "GPUs each Serve replica reserves on CUDA (upstream's flag; a fraction shares a GPU between replicas, "
        "or with the trainer).", "engines", gt=0,
    )
    rollout_api_key: str | None = _field(
        None, "Bearer token the scaling API's control endpoints require (default: $RELAX_API_KEY, as `relax serve` "
        "and `relax scale`; never logged, never saved).",
        "engines", secret=True,
    )
    scale_out_max_engines: int = _field(
        32,
        "Most rollout engines a scale-out may bring the run to (each embedded engine holds a copy of the model); "
        "a larger num_replicas is rejected.",
        "engines",
        ge=1,
        le=1024,
    )
    scale_in_drain_timeout: float = _field(
        60.0, "Seconds a scale-in waits for an engine's requests before it leaves the router (they still finish).",
        "engines",
        gt=0,
    )

    @model_validator(mode="after")
    def _check_external_engines(self) -> RelaxConfig:
        if self.rollout_api_port is None:
            set_flags = [flag(name) for name in ("rollout_api_key", "scale_out_max_engines", "scale_in_drain_timeout")
                         if self.changed(name)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('rollout_api_port')}")
        if self.rollout_serve_replicas:
            serve = flag("rollout_serve_replicas")
            if self.rollout_external:
                raise ValueError(f"{serve} and {flag('rollout_external')} both name the rollout engines; external "
                                 "servers join a Serve run through the scaling API (/scale_out with engine_urls)")
            if self.colocate:
                raise ValueError(f"{serve} keeps each engine in a Ray process of its own, whose memory is not "
                                 f"handed to the trainer between phases: drop {flag('colocate')}")
        elif self.changed("rollout_num_gpus_per_engine"):
            raise ValueError(f"{flag('rollout_num_gpus_per_engine')} needs {flag('rollout_serve_replicas')}")
        if self.changed("rollout_engine_max_relaunches") and not self.use_fault_tolerance:
            raise ValueError(f"{flag('rollout_engine_max_relaunches')} needs {flag('use_fault_tolerance')}")
        if (self.use_fault_tolerance and self.rollout_external
                and self.rollout_engine_protocol not in ("relax", "vllm")):
            protocol = flag("rollout_engine_protocol")
            raise ValueError(f"{flag('use_fault_tolerance')} relaunches the engines this run starts ({protocol} "
                             f"relax or vllm) or recovers the embedded one in place; servers started outside the run "
                             f"({protocol} {self.rollout_engine_protocol}) are routed around and probed again "
                             "without it")
        if not self.rollout_external:
            set_flags = [flag(name) for name in ("rollout_external_engine_addrs", "rollout_engine_api_key",
                                                 "rollout_weights_dir", "rollout_engine_protocol",
                                                 "rollout_weight_sync_address")
                         if self.changed(name) and not (name == "rollout_weights_dir" and self.rollout_serve_replicas)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('rollout_external')}")
            return self
        if not self.rollout_external_engine_addrs:
            raise ValueError(f"{flag('rollout_external')} needs {flag('rollout_external_engine_addrs')} (one base URL "
                             "or more)")
        for address in self.rollout_external_engine_addrs:
            if not address.startswith(("http://", "https://")) or len(address.split("://", 1)[1].strip("/")) == 0:
                raise ValueError(f"{flag('rollout_external_engine_addrs')}: {address!r} is not a base URL "
                                 "(http://host:port)")
        if len({a.rstrip("/") for a in self.rollout_external_engine_addrs}) != len(self.rollout_external_engine_addrs):
            raise ValueError(f"{flag('rollout_external_engine_addrs')}: an address is listed twice")
        if self.rollout_engine_protocol in ("vllm", "relax"):
            for address in self.rollout_external_engine_addrs:
                if not re.fullmatch(r"http://127\.0\.0\.1:\d{1,5}/?", address) or not 0 < int(
                        address.rstrip("/").rsplit(":", 1)[1]) < 65536:
                    raise ValueError(f"{flag('rollout_engine_protocol')} {self.rollout_engine_protocol} starts the "
                                     f"servers on this machine: {flag('rollout_external_engine_addrs')} {address!r} "
                                     "must be http://127.0.0.1:PORT")
        if self.weight_sync_transport == "broadcast" and self.rollout_engine_protocol not in ("sglang", "relax"):
            raise ValueError(f"{flag('weight_sync_transport')} broadcast needs {flag('rollout_engine_protocol')} "
                             "sglang or relax (OpenAI-protocol servers have no /init_weights_update_group)")
        if self.use_fault_tolerance and self.weight_sync_transport == "broadcast":
            raise ValueError(f"{flag('use_fault_tolerance')} needs {flag('weight_sync_transport')} disk: a relaunched "
                             "engine loads the current weights from --rollout-weights-dir (a new process cannot "
                             "join the running broadcast group)")
        if self.multimodal_keys:
            raise ValueError(f"{flag('rollout_external')} does not take {flag('multimodal_keys')} yet (media are not "
                             "sent over HTTP)")
        return self

    # --- algorithm -----------------------------------------------------------------------
    advantage_estimator: str = _field("grpo", "RL algorithm (see docs/algorithms.md).", "algorithm")
    eps_clip: float = _field(0.2, "PPO clip range below 1: ratio ≥ 1 - eps_clip.", "algorithm", gt=0, lt=1)
    eps_clip_high: float | None = _field(
        None, "PPO clip range above 1 (DAPO clip-higher); default eps_clip.", "algorithm", gt=0
    )
    eps_clip_c: float | None = _field(
        None, "Dual-clip constant (> 1): bounds the loss of negative-advantage tokens at -eps_clip_c * A.", "algorithm", gt=1
    )
    use_kl_loss: bool = _field(False, "Add a KL penalty against the frozen initial model to the loss.", "algorithm")
    kl_loss_coef: float = _field(0.0, "Weight of the KL loss.", "algorithm", ge=0)
    kl_loss_type: KLType = _field("k1", "KL estimator: k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10]).", "algorithm")
    entropy_coef: float = _field(0.0, "Weight of the entropy bonus (subtracted from the loss).", "algorithm", ge=0)
    calculate_per_token_loss: bool = _field(
        False,
        "Average the loss over all tokens of the batch (token-mean) instead of per sample first "
        "(seq-mean-token-mean, the default). Upstream's alias for `--loss-agg-mode token-mean`.",
        "algorithm",
    )
    loss_agg_mode: LossAggregation | None = _field(
        None,
        "How per-token losses become one loss: seq-mean-token-mean (mean per sample, then over samples), "
        "token-mean (over all tokens), seq-mean-token-sum (sum per sample, mean over samples) or "
        "seq-mean-token-sum-norm (Dr.GRPO: sum per sample divided by --rollout-max-response-len). "
        "Default: token-mean with --calculate-per-token-loss, else seq-mean-token-mean.",
        "algorithm",
    )
    kl_coef: float = _field(
        0.0,
        "Weight of the KL penalty put in the reward (per token, -kl_coef * k1 KL against the initial model); "
        "used by reinforce_plus_plus. Exclusive with --kl-loss-coef.",
        "algorithm",
        ge=0,
    )
    gamma: float = _field(1.0, "Discount of the REINFORCE++ return G_t = r_t + gamma * G_{t+1}.", "algorithm",
                          ge=0, le=1)
    sapo_tau_pos: float = _field(1.0, "SAPO gate temperature for positive-advantage tokens.", "algorithm", gt=0)
    sapo_tau_neg: float = _field(1.05, "SAPO gate temperature for non-positive-advantage tokens.", "algorithm", gt=0)
    m2po_kl2_budget: float = _field(
        0.01, "M2PO budget on the mean squared log-ratio of harmful tokens.", "algorithm", gt=0
    )
    m2po_miniclip_low: float = _field(0.3, "M2PO: smallest clip range below 1.", "algorithm", gt=0, lt=1)
    m2po_miniclip_high: float = _field(0.5, "M2PO: smallest clip range above 1.", "algorithm", gt=0)
    use_tis: bool = _field(
        False,
        "Truncated importance sampling: weight each token's policy loss by clamp(exp(old - rollout log-prob), "
        "--tis-clip-low, --tis-clip), correcting the inference engine / trainer mismatch.",
        "algorithm",
    )
    tis_clip: float = _field(2.0, "Upper bound of the TIS weight.", "algorithm", gt=0)
    tis_clip_low: float = _field(0.0, "Lower bound of the TIS weight.", "algorithm", ge=0)
    use_rollout_routing_replay: bool = _field(
        False,
        "Rollout routing replay (R3), for mixture-of-experts models: the engine records the experts each MoE layer "
        "chose for every token, and the actor's forwards (old log-probs and training) route each token to those "
        "experts, so the trained policy is the one that sampled (routing weights still come from the trainer's "
        "router scores). Needs an in-process engine on the Hugging Face path (MoE families run there) or relax "
        "serve / SGLang servers that return routed experts.",
        "algorithm",
    )
    disable_grpo_std_normalization: bool = _field(
        False, "Dr.GRPO: subtract the group mean but do not divide by the group std.", "algorithm"
    )
    loss_type: Literal["policy_loss", "sft"] = _field(
        "policy_loss",
        "policy_loss: RL with --advantage-estimator. sft: supervised fine-tuning (negative log-likelihood of "
        "the dataset's responses, --label-key or the assistant turns of chat rows) on the same trainer.",
        "algorithm",
    )

    # --- critic (PPO) ---------------------------------------------------------------------
    critic_lr: float | None = _field(None, "Learning rate of the critic (default --lr).", "critic", gt=0)
    num_critic_only_steps: int = _field(
        0, "Rollout steps at the start that train only the critic (the policy waits for fitted values).",
        "critic", ge=0,
    )
    value_clip: float | None = _field(
        0.2, "Clip range of the value update around the old values (PPO value clipping).", "critic", ge=0
    )
    lambd: float = _field(1.0, "GAE's lambda (1: Monte-Carlo returns minus the value baseline).", "critic",
                          ge=0, le=1)

    # --- on-policy distillation -------------------------------------------------------------
    use_opd: bool = _field(
        False,
        "On-policy distillation: penalise the student's divergence from a teacher on the student's own "
        "samples, in the advantage (--opd-kl-coef) or as a loss term (--opd-loss-coef).",
        "distillation",
    )
    opd_type: Literal["trainer", "engine", "megatron", "sglang"] = _field(
        "trainer",
        "Where the teacher runs: `trainer` (a frozen forward beside the policy, sharded like it) or `engine` (an "
        "inference engine that scores the tokens). Upstream's names `megatron` and `sglang` are accepted for them.",
        "distillation",
    )
    teacher_hf_checkpoint: str | None = _field(
        None, "Hugging Face folder of the teacher; it must share the student's tokenizer.", "distillation"
    )
    opd_kl_type: Literal["reverse_kl", "forward_kl", "low_var_kl"] = _field(
        "reverse_kl",
        "Divergence per response token: reverse_kl (log p_s - log p_t on the sampled token), low_var_kl (k3 "
        "estimator of the reverse KL, clamped to [-10, 10]), forward_kl (KL(teacher || student) over the "
        "teacher's top --opd-log-prob-top-k tokens).",
        "distillation",
    )
    opd_kl_coef: float = _field(
        1.0, "Advantage mode: A_t <- A_t - opd_kl_coef * KL_t (detached).", "distillation", ge=0
    )
    opd_loss_coef: float = _field(
        0.0, "Loss mode: loss += opd_loss_coef * agg(KL_t). Setting it alone switches --opd-kl-coef to 0.",
        "distillation", ge=0,
    )
    opd_log_prob_top_k: int = _field(20, "Teacher top-k of forward_kl.", "distillation", ge=1)
    opd_norm_mode: Literal["tail", "norm", "trunc"] = _field(
        "tail",
        "forward_kl over the top-k: tail (one extra bucket holds the rest of the mass: an exact KL of the "
        "coarsened distributions), norm (renormalise both over the top-k) or trunc (top-k terms only).",
        "distillation",
    )

    # --- optimizer -----------------------------------------------------------------------
    lr: float = _field(1e-6, "Peak learning rate (AdamW).", "optimizer", gt=0)
    moe_aux_loss_coef: float | None = _field(
        None, "Weight of a mixture-of-experts model's auxiliary load-balancing loss in the training loss. Default: "
        "the family's own (its config's router_aux_loss_coef when its output_router_logits is on, else none); 0 "
        "turns it off. Refused for models that define no such loss (DeepSeek-V3 balances with routing biases).",
        "optimizer", ge=0)
    lora_rank: int = _field(
        0, "Train LoRA adapters of this rank (peft) instead of every weight; 0: full fine-tuning. Only the adapters "
        "are in the optimizer and the checkpoint; the engines get merged weights (docs/lora.md).", "lora", ge=0)
    lora_alpha: float = _field(32.0, "LoRA scaling numerator: the adapters' update is scaled by alpha / rank.",
                               "lora", gt=0)
    target_modules: list[str] = _field(
        ["linear_qkv", "linear_proj"], "Modules that get adapters: Hugging Face names (q_proj, down_proj, ...), "
        "upstream's Megatron names (linear_qkv = q/k/v, linear_proj = attention output, linear_fc1 = gate/up, "
        "linear_fc2 = down) or all-linear.", "lora")
    lora_scope: Literal["all", "language", "vision"] = _field(
        "all", "Where adapters go: language (not the vision and audio encoders), vision (only the vision encoder) "
        "or all.", "lora")
    min_lr: float = _field(0.0, "Final learning rate of the cosine schedule.", "optimizer", ge=0)
    lr_warmup_steps: int = _field(0, "Optimizer steps of linear warmup from 0 to --lr.", "optimizer", ge=0)
    lr_decay_style: Literal["constant", "cosine"] = _field(
        "constant", "Schedule after warmup: constant, or cosine decay to --min-lr at the last step.", "optimizer"
    )
    weight_decay: float = _field(0.0, "AdamW weight decay.", "optimizer", ge=0)
    adam_beta1: float = _field(0.9, "AdamW beta1.", "optimizer", ge=0, lt=1)
    adam_beta2: float = _field(0.999, "AdamW beta2.", "optimizer", ge=0, lt=1)
    adam_eps: float = _field(1e-8, "AdamW epsilon.", "optimizer", gt=0)
    clip_grad: float = _field(1.0, "Clip the global gradient norm to this (0 disables clipping).", "optimizer", ge=0)
    seed: int = _field(1234, "Seed of model-side randomness (dropout, initialisation of new heads).", "optimizer")

    # --- reward --------------------------------------------------------------------------
    rm_type: str | None = _field(
        None,
        "Built-in reward: math, gsm8k, dapo, multiple_choice, f1, exact_match; prefix `boxed_` to grade the "
        "last \\boxed{} answer. A sample's metadata.rm_type overrides it.",
        "reward",
    )
    custom_rm_path: str | None = _field(
        None, "Dotted path `module:function` of a custom reward `fn(args, sample)` (sync or async).", "reward"
    )
    group_rm: bool = _field(
        False, "Call the custom reward once per prompt group: `fn(args, samples) -> list`.", "reward"
    )
    rm_url: str | None = _field(
        None, "URL of a reward server (upstream's remote_rm; `--rm-type remote_rm` names it too): each sample is "
        "POSTed as {prompt, response, label, metadata} and the answer is a number or {\"reward\": x}. Refused "
        "connections, timeouts, 5xx and 429 are retried with exponential backoff (0.5 s doubling to 30 s, 10 "
        "attempts) within --reward-timeout; retries are logged in reward/remote_retries. A secret (it may hold a "
        "token): logs show scheme, host and path only.", "reward", secret=True,
    )
    genrm_model_path: str | None = _field(
        None, "A judge model (GenRM, LLM-as-judge) folder: an embedded engine in the scoring process generates a "
        "verdict per sample from --genrm-prompt-template; the number in its last \\boxed{}, after its last "
        "`score:`, or a leading yes/no is the reward.", "reward",
    )
    genrm_prompt_template: str | None = _field(
        None, "The judge's prompt (or a file holding it), with the fields {prompt}, {response} and {label}; "
        "default: asks for a score in \\boxed{}.", "reward",
    )
    genrm_sampling_config: dict[str, Any] | None = _field(
        None, "JSON: the judge's sampling, keys temperature (0.1), top_p (1.0), top_k (-1), max_response_len "
        "(4096), upstream's defaults.", "reward",
    )
    genrm_engine_config: dict[str, Any] | None = _field(
        None, "JSON: the judge's engine, keys device and dtype (default: the run's), engine_core, "
        "mem_fraction_static, max_batch_size.", "reward",
    )
    custom_rm_workers: int = _field(
        0, "Run a synchronous --custom-rm-path function in this many worker processes instead of threads of the "
        "trainer: a crash or a leak costs only its worker (replaced; the sample scored 0 and counted in "
        "reward/num_errors) and --reward-timeout kills a hung call. 0: threads.", "reward", ge=0,
    )
    reward_worker_memory_mb: int | None = _field(
        None, "Address-space cap (MiB) of each --custom-rm-workers process: a reward that leaks fails there with "
        "MemoryError.", "reward", ge=64,
    )
    reward_timeout: float = _field(
        5.0,
        "Seconds one reward call (one sample, or one group with --group-rm) may take; past it the sample gets 0, "
        "is counted in reward/num_timeouts and the step goes on. The math rewards run in worker processes that "
        "are killed at the limit; other rewards are abandoned (a thread cannot be killed).",
        "reward",
        gt=0,
        allow_inf_nan=False,
    )
    overlong_buffer_len: int | None = _field(
        None,
        "DAPO soft overlong punishment: a response of l tokens longer than M - L (M = --rollout-max-response-len, "
        "L = this) gets (M - L - l) / L * --overlong-penalty-factor added to its reward. Default: off.",
        "reward",
        ge=1,
    )
    overlong_penalty_factor: float = _field(
        1.0, "Penalty of a response of the maximum length under --overlong-buffer-len.", "reward", ge=0
    )

    # --- eval ----------------------------------------------------------------------------
    eval_prompt_data: dict[str, str] = _field(
        {},
        "Held-out sets, as `name path` pairs on the command line or a name: path mapping in YAML.",
        "eval",
    )
    eval_interval: int | None = _field(
        None, "Evaluate every this many rollout steps. With --eval-prompt-data the run is always evaluated before "
        "the first step (unless --skip-eval-before-train) and after the last.", "eval", ge=1)
    eval_temperature: float = _field(
        0.0, "Sampling temperature for evaluation (0: greedy, a stable accuracy measure).", "eval", ge=0
    )
    eval_max_response_len: int | None = _field(
        None, "Maximum new tokens in evaluation (default --rollout-max-response-len).", "eval", ge=1
    )
    n_samples_per_eval_prompt: int = _field(1, "Responses per evaluation prompt.", "eval", ge=1)
    skip_eval_before_train: bool = _field(False, "Do not evaluate before the first training step.", "eval")

    # --- run -----------------------------------------------------------------------------
    output_dir: str = _field(
        "runs/latest", "Run directory: resolved config, metrics.jsonl, TensorBoard, plots, samples, run.log.", "run"
    )
    save: str | None = _field(None, "Checkpoint directory (default: <output-dir>/checkpoints).", "run")
    load: str | None = _field(
        None, "Resume from the newest checkpoint in this checkpoint directory or run directory.", "run"
    )
    save_interval: int | None = _field(
        None, "Save a checkpoint every this many rollout steps. The last step is always saved.", "run", ge=1)
    max_checkpoints: int | None = _field(
        None, "Keep only the newest this many checkpoints, deleting older ones after each save (default: keep all). "
        "Upstream's --rotate-ckpt rotates only with --async-save; this works with every save.", "run", ge=1,
    )
    async_save: bool = _field(
        False, "Write checkpoints in the background: the trainer's state is copied to host memory when the step is "
        "saved and written to disk while the next steps run; the checkpoint is sealed (manifest, rename, latest "
        "pointer, --max-checkpoints rotation) once its files are written. One save at a time (the next waits for "
        "it); the run waits for the last one before it ends. One trainer process (not under torchrun).", "run",
    )
    max_global_restart: int = _field(
        0, "Supervise the run from a parent process and restart it, at most this many times, when its process dies "
        "(killed, out of memory, a crash), resuming from its newest intact checkpoint (docs/fault_tolerance.md). "
        "Upstream's default is 3 with its health manager; 0 here runs without a supervisor.", "run", ge=0,
    )
    no_save_optim: bool = _field(False, "Save model weights only (such a checkpoint cannot resume training).", "run")
    overwrite: bool = _field(
        False,
        "Start afresh in an --output-dir that holds an earlier run, deleting that run's files (config, metrics, "
        "logs, plots, samples, TensorBoard events, checkpoints). Without it, such a directory is refused unless "
        "--load resumes the run in it.",
        "run",
    )
    notify_urls: str | None = _field(
        None, "Apprise URLs, comma separated (tgram://, slack://, mailto://, json:// ...), told when the run starts, "
        "finishes, is stopped or fails. Secret: never logged or saved, and redacted from the messages.", "run",
        secret=True,
    )
    stall_warning_s: float | None = _field(
        600.0, "Report a phase of a step (rollout, training, weight sync, evaluation, checkpoint, a wait for data) "
        "that has run this long, in the log and to --notify-urls, and again at every further multiple; none: never.",
        "run", gt=0,
    )
    use_health_check: bool = _field(
        False, "Watch the run's processes: roles in Ray processes send heartbeats, TransferQueue's actors are probed, "
        "and the state is kept in <output-dir>/health.json (`relax health`, --use-metrics-service). A role that is "
        "dead or sends no heartbeat for --heartbeat-timeout-s ends the run naming it, so --max-global-restart "
        "restarts it (upstream's HealthManager; docs/fault_tolerance.md).", "run",
    )
    heartbeat_timeout_s: float = _field(
        120.0, "Seconds without a heartbeat after which a role counts as hung (--use-health-check; upstream's "
        "HEARTBEAT_TIMEOUT).", "run", gt=0,
    )
    timeline_dump_dir: str | None = _field(
        None, "Write each step's phases as a Chrome trace (timeline.json, for Perfetto or chrome://tracing) here.",
        "run",
    )
    use_metrics_service: bool = _field(
        False, "Serve the run's metrics, restart count and engine health in Prometheus format on "
        "http://127.0.0.1:<--metrics-service-port>/metrics.", "run",
    )
    metrics_service_port: int = _field(9108, "Port of --use-metrics-service (127.0.0.1 only).", "run", ge=1,
                                       le=65535)
    use_tensorboard: bool = _field(True, "Write TensorBoard events into <output-dir>/tensorboard.", "run")
    use_wandb: bool = _field(False, "Log to Weights & Biases (set WANDB_MODE=offline to stay local).", "run")
    wandb_project: str | None = _field(None, "W&B project name.", "run")
    use_clearml: bool = _field(
        False, "Log to ClearML (a task named after --output-dir in --clearml-project; its server comes from "
        "~/.clearml.conf or CLEARML_* variables; CLEARML_OFFLINE_MODE=1 keeps a local session instead). "
        "pip install relax-rl[clearml].", "run",
    )
    clearml_project: str = _field("relax", "ClearML project of --use-clearml's task.", "run")
    dump_samples: int = _field(8, "Samples per rollout step written to <output-dir>/samples (0: none).", "run", ge=0)

    # --- placement -------------------------------------------------------------------------
    placement: Literal["in_process", "ray"] = _field(
        "in_process",
        "Where the roles run. `in_process`: every role is an object in the trainer's process (no Ray). `ray`: "
        "actor, rollout, critic and reference each run in their own Ray actor process, in placement groups sized "
        "by --resource; the controller drives them over the same async API (docs/placement.md).",
        "placement",
    )
    resource: dict[str, list[float]] = _field(
        {},
        "With --placement ray: JSON mapping a role (actor, rollout, critic, reference, advantages, genrm) to "
        "[replicas, gpus_per_replica], e.g. '{\"actor\": [1, 1], \"rollout\": [1, 1]}'. On a machine without GPUs "
        "the second number is CPUs per replica. Roles left out get [1, 1]. actor, critic and reference take N "
        "replicas as N processes of one FSDP2 process group (each trains on its share of every batch); rollout "
        "takes 1. advantages (default: the controller's process) and genrm (the --genrm-model-path judge; default: "
        "the rollout's process) get a process of their own only when named. actor_fwd is refused: the actor's "
        "processes compute the old-policy log-probs.",
        "placement",
    )
    ray_address: str | None = _field(
        None, "With --placement ray: join this running Ray cluster (e.g. `auto` or `127.0.0.1:6379`) instead of "
        "starting a local Ray bound to 127.0.0.1.", "placement",
    )
    weight_sync_transport: Literal["broadcast", "disk"] | None = _field(
        None,
        "How new weights reach engines in other processes. `broadcast`: torch.distributed broadcast over a "
        "dedicated group (gloo on CPU, NCCL on GPU; external servers join it through /init_weights_update_group); "
        "`disk`: versioned safetensors (under <output-dir>/weight_sync with --placement ray, under "
        "--rollout-weights-dir for external servers, which must see that path). Default: `broadcast` with "
        "--placement ray, `disk` with --rollout-external.",
        "placement",
    )

    update_weight_buffer_size: int = _field(
        512 * 1024 * 1024,
        "Bytes per bucket of a weight sync (upstream's flag and default, 512 MiB): the trainer gathers and sends "
        "its weights one bucket at a time, so this bounds the extra memory a sync takes and the size of each "
        "collective or safetensors file.",
        "placement",
        ge=1,
    )

    @field_validator("resource", mode="before")
    @classmethod
    def _resource_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"--resource is not valid JSON: {err}") from None
        return value

    @model_validator(mode="after")
    def _check_placement(self) -> RelaxConfig:
        placeable = ("actor", "rollout", "critic", "reference", "advantages", "genrm")
        for role, value in self.resource.items():
            if role == "actor_fwd":
                raise ValueError("--resource actor_fwd: Relax computes the old-policy log-probs in the actor's own "
                                 "processes, with the weights the update starts from (a separate actor_fwd holds "
                                 "the version it last received, so its ratio would measure the sync lag); leave "
                                 "the entry out, the actor's resources cover it (docs/placement.md)")
            if role not in placeable:
                raise ValueError(f"--resource: unknown role {role!r}; choose among {list(placeable)}")
            if len(value) != 2 or value[0] != int(value[0]) or value[0] < 1 or value[1] < 0:
                raise ValueError(f"--resource {role}: expects [replicas >= 1, gpus_per_replica >= 0], got {value}")
            if value[0] != 1 and role == "rollout":
                raise ValueError(f"--resource rollout: one rollout process (it holds the prompt cursor and the "
                                 f"rewards), got {int(value[0])}; several engines: --rollout-serve-replicas with "
                                 "the in-process placement, or --rollout-external servers")
            if value[0] != 1 and role in ("advantages", "genrm"):
                raise ValueError(f"--resource {role}: one process (it reads each step's groups once, in order), "
                                 f"got {int(value[0])}")
        if "genrm" in self.resource and self.genrm_model_path is None:
            raise ValueError("--resource genrm: places the judge model of --genrm-model-path, which is not set")
        if self.placement != "ray":
            for name in ("resource", "ray_address"):
                if getattr(self, name):
                    raise ValueError(f"{flag(name)} needs --placement ray")
            if self.weight_sync_transport is not None and not self.rollout_external:
                raise ValueError(f"{flag('weight_sync_transport')} needs --placement ray or --rollout-external")
        elif self.loss_type == "sft" or self.use_opd:
            raise ValueError(f"--placement ray does not support {'--loss-type sft' if self.loss_type == 'sft' else '--use-opd'} "
                             "yet; use --placement in_process")
        return self

    # --------------------------------------------------------------------------------------
    @field_validator("eval_prompt_data", mode="before")
    @classmethod
    def _pairs_to_mapping(cls, value: Any) -> Any:
        """Accept upstream's `--eval-prompt-data name path [name path ...]` list form."""
        if isinstance(value, (list, tuple)):
            if len(value) % 2:
                raise ValueError("expects `name path` pairs, got an odd number of values")
            return {value[i]: value[i + 1] for i in range(0, len(value), 2)}
        return value

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        if value not in ALGORITHM_SPECS:
            raise ValueError(f"unknown estimator {value!r}; choose one of {sorted(ALGORITHM_SPECS)}")
        return value

    @field_validator("opd_type", mode="before")
    @classmethod
    def _upstream_opd_type(cls, value: Any) -> Any:
        return OPD_TYPE_ALIASES.get(value, value)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, value: str) -> str:
        from relax.engine.agentic.tool_parser import TOOL_CALL_PARSERS  # pure (json, re): cheap to import here

        if value not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown parser {value!r}; choose one of {sorted(TOOL_CALL_PARSERS)}")
        return value

    @field_validator("agent_command")
    @classmethod
    def _agent_argv(cls, value: str | None) -> str | None:
        if value is not None:
            import shlex

            try:
                argv = shlex.split(value)
            except ValueError as err:  # an unclosed quote
                raise ValueError(f"cannot split into arguments: {err}") from None
            if not argv:
                raise ValueError("names no program")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> RelaxConfig:
        spec = ALGORITHM_SPECS[self.advantage_estimator]
        self._check_critic_and_distillation(spec)
        if self.loss_type == "policy_loss" and self.n_samples_per_prompt < spec.min_group_size:
            raise ValueError(
                f"{flag('advantage_estimator')} {spec.name} needs {flag('n_samples_per_prompt')} >= "
                f"{spec.min_group_size}, got {self.n_samples_per_prompt}"
            )
        samples_per_step = self.samples_per_step
        if self.global_batch_size is not None and samples_per_step % self.global_batch_size:
            raise ValueError(
                f"{flag('global_batch_size')} ({self.global_batch_size}) must divide {flag('rollout_batch_size')} x "
                f"{flag('n_samples_per_prompt')} ({samples_per_step})"
            )
        self._check_dynamic_batch_size()
        if self.changed("heartbeat_timeout_s") and not self.use_health_check:
            raise ValueError(f"{flag('heartbeat_timeout_s')} needs {flag('use_health_check')}")
        if self.changed("metrics_service_port") and not self.use_metrics_service:
            raise ValueError(f"{flag('metrics_service_port')} needs {flag('use_metrics_service')}")
        if not self.use_dynamic_batch_size and self.train_batch_size % self.micro_batch_size:
            raise ValueError(
                f"{flag('micro_batch_size')} ({self.micro_batch_size}) must divide the global batch size "
                f"({self.train_batch_size})"
            )
        if self.kl_coef > 0 and self.kl_loss_coef > 0:
            raise ValueError(
                f"{flag('kl_coef')} (KL in the reward) and {flag('kl_loss_coef')} (KL in the loss) are exclusive; "
                "set one of them to 0"
            )
        if self.kl_coef > 0 and not spec.uses_reward_kl:
            raise ValueError(
                f"{flag('kl_coef')} has no effect with {flag('advantage_estimator')} {spec.name}; "
                "use reinforce_plus_plus or --use-kl-loss"
            )
        if spec.requires_on_policy_updates and self.steps_per_rollout != 1:
            raise ValueError(
                f"{flag('advantage_estimator')} {spec.name} needs one optimizer step per rollout: "
                f"{flag('global_batch_size')} ({self.global_batch_size}) must equal {flag('rollout_batch_size')} x "
                f"{flag('n_samples_per_prompt')} ({samples_per_step})"
            )
        if (self.calculate_per_token_loss and self.loss_agg_mode is not None
                and self.loss_agg_mode != "token-mean"):
            raise ValueError(
                f"{flag('calculate_per_token_loss')} means {flag('loss_agg_mode')} token-mean, "
                f"but {flag('loss_agg_mode')} is {self.loss_agg_mode}; set only one of them"
            )
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(
                f"{flag('tis_clip_low')} ({self.tis_clip_low}) is above {flag('tis_clip')} ({self.tis_clip})"
            )
        if self.rm_type and self.loss_type != "sft" and not self.label_key:
            raise ValueError(f"{flag('rm_type')} {self.rm_type} compares every response with a label: set "
                             f"{flag('label_key')}")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise ValueError(f"{flag('kl_loss_coef')} > 0 has no effect without {flag('use_kl_loss')}")
        if self.rollout_top_k == 0 or self.rollout_top_k < -1:
            raise ValueError(f"{flag('rollout_top_k')} must be -1 (off) or a positive number, got {self.rollout_top_k}")
        if self.eval_interval is not None and not self.eval_prompt_data:
            raise ValueError(f"{flag('eval_interval')} needs {flag('eval_prompt_data')}")
        if self.system_prompt and not self.apply_chat_template:
            raise ValueError(f"{flag('system_prompt')} needs {flag('apply_chat_template')}")
        if self.overlong_buffer_len is not None and self.overlong_buffer_len > self.rollout_max_response_len:
            raise ValueError(
                f"{flag('overlong_buffer_len')} ({self.overlong_buffer_len}) is above "
                f"{flag('rollout_max_response_len')} ({self.rollout_max_response_len})"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"{flag('min_lr')} ({self.min_lr}) is above {flag('lr')} ({self.lr})")
        return self

    @property
    def _embedded_rollout(self) -> bool:
        """The embedded engine shares the trainer's device and process: what offloading between phases needs."""
        return self.placement == "in_process" and not self.rollout_external and self.rollout_api_port is None

    @property
    def resolved_offload_train(self) -> bool:
        if self.offload_train is not None:
            return self.offload_train
        return self.offload or (self.colocate and self.placement == "in_process")

    @property
    def resolved_offload_rollout(self) -> bool:
        if self.offload_rollout is not None:
            return self.offload_rollout
        return self.offload or (self.colocate and self._embedded_rollout)

    def _check_offload(self, asynchronous: bool) -> None:
        asked = [flag(n) for n in ("offload", "offload_train", "offload_rollout") if getattr(self, n)]
        if not asked:
            return
        if self.loss_type == "sft":
            raise ValueError(f"{', '.join(asked)}: {flag('loss_type')} sft has no rollout phase to offload around")
        if self.placement != "in_process":
            raise ValueError(f"{', '.join(asked)}: offloading between phases needs the in-process placement (the "
                             f"roles share the device in one process); drop them with {flag('placement')} ray")
        if asynchronous:
            raise ValueError(f"{', '.join(asked)}: the async modes overlap rollout and training, so there is no "
                             "idle phase to offload; drop them or use the sync mode")
        if self.resolved_offload_rollout and not self._embedded_rollout:
            raise ValueError(f"{flag('offload_rollout')} (also set by {flag('offload')}) frees the embedded engine's "
                             f"memory; with {flag('rollout_external')} or {flag('rollout_api_port')} rollout runs "
                             "elsewhere or on engines added at any time: pass --no-offload-rollout")

    def _check_dynamic_batch_size(self) -> None:
        if not self.use_dynamic_batch_size:
            set_budget = [flag(n) for n in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu") if self.changed(n)]
            if set_budget:
                raise ValueError(f"{', '.join(set_budget)} need {flag('use_dynamic_batch_size')}")
            return
        if self.max_tokens_per_gpu is None:
            raise ValueError(f"{flag('use_dynamic_batch_size')} needs {flag('max_tokens_per_gpu')}")
        if self.changed("micro_batch_size"):
            raise ValueError(f"{flag('use_dynamic_batch_size')} sizes micro-batches by tokens: drop "
                             f"{flag('micro_batch_size')}")
        longest = self.rollout_max_context_len or (
            self.rollout_max_prompt_len + self.rollout_max_response_len if self.rollout_max_prompt_len else None)
        for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            budget = getattr(self, name)
            if budget is not None and longest is not None and budget < longest:
                raise ValueError(f"{flag(name)} ({budget}) must hold the longest sample ({longest} tokens: "
                                 "--rollout-max-context-len, or --rollout-max-prompt-len + "
                                 "--rollout-max-response-len)")

    def _check_critic_and_distillation(self, spec) -> None:
        set_critic = [flag(name) for name in CRITIC_FIELDS if self.changed(name)]
        if set_critic and not spec.needs_critic:
            raise ValueError(
                f"PPO critic options ({', '.join(set_critic)}) need {flag('advantage_estimator')} ppo, "
                f"not {spec.name}"
            )
        set_opd = [flag(name) for name in OPD_FIELDS if self.changed(name)]
        if set_opd and not self.use_opd:
            raise ValueError(f"distillation options ({', '.join(set_opd)}) need {flag('use_opd')}")
        if self.use_opd:
            if not self.teacher_hf_checkpoint:
                raise ValueError(f"{flag('use_opd')} needs {flag('teacher_hf_checkpoint')}")
            if self.opd_loss_coef > 0 and "opd_kl_coef" not in self.model_fields_set:
                self.opd_kl_coef = 0.0  # naming only the loss coefficient selects the loss mode
            if (self.opd_kl_coef > 0) == (self.opd_loss_coef > 0):
                raise ValueError(
                    f"on-policy distillation runs in one mode: set exactly one of {flag('opd_kl_coef')} (advantage "
                    f"mode, now {self.opd_kl_coef}) and {flag('opd_loss_coef')} (loss mode, now {self.opd_loss_coef})"
                )
        if self.multimodal_keys:
            unknown = sorted(set(self.multimodal_keys) - {"image", "video", "audio"})
            if unknown:
                raise ValueError(f"{flag('multimodal_keys')}: unknown media type(s) {unknown}; use image, video, audio")
            if not self.apply_chat_template:
                raise ValueError(f"{flag('multimodal_keys')} needs {flag('apply_chat_template')}: the chat template "
                                 "renders each media item as the model's placeholder tokens")
            if self.loss_type == "sft":
                raise ValueError(f"{flag('loss_type')} sft does not take {flag('multimodal_keys')} yet")
        if self.use_audio_in_video and "video" not in (self.multimodal_keys or {}):
            raise ValueError(f"{flag('use_audio_in_video')} gives each video its sound track: it needs video in "
                             f"{flag('multimodal_keys')}")
        if self.image_min_token_num > self.image_max_token_num:
            raise ValueError(f"{flag('image_min_token_num')} is above {flag('image_max_token_num')}")
        self._check_mode(spec)
        if self.loss_type == "sft" and self.use_opd:
            raise ValueError(f"{flag('loss_type')} sft trains on dataset responses; it cannot use {flag('use_opd')}")

    def _check_mode(self, spec) -> None:
        asynchronous = self.fully_async or self.hybrid
        if self.fully_async and self.hybrid:
            raise ValueError(f"{flag('fully_async')} and {flag('hybrid')} are exclusive (hybrid is its own mode)")
        if self.colocate and asynchronous:
            raise ValueError(f"{flag('colocate')} is the synchronous mode; drop it for "
                             f"{flag('hybrid') if self.hybrid else flag('fully_async')}")
        if self.max_staleness and not asynchronous:
            raise ValueError(f"{flag('max_staleness')} needs {flag('fully_async')} or {flag('hybrid')}")
        if self.partial_rollout and not self.fully_async:
            raise ValueError(f"{flag('partial_rollout')} needs {flag('fully_async')}")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError(f"{flag('mask_offpolicy_in_partial_rollout')} needs {flag('partial_rollout')}")
        if asynchronous and spec.requires_on_policy_updates:
            raise ValueError(f"{flag('advantage_estimator')} {spec.name} is on-policy by construction; it cannot run "
                             f"with {flag('fully_async')} or {flag('hybrid')}")
        if asynchronous and self.loss_type == "sft":
            raise ValueError(f"{flag('loss_type')} sft has no rollout to run asynchronously")
        if self.use_rollout_routing_replay and self.loss_type == "sft":
            raise ValueError(f"{flag('use_rollout_routing_replay')} replays a rollout's routing; "
                             f"{flag('loss_type')} sft has no rollout")
        if self.use_rollout_routing_replay and self.rollout_external and self.rollout_engine_protocol in (
                "openai", "vllm"):
            raise ValueError(f"{flag('use_rollout_routing_replay')}: {self.rollout_engine_protocol} servers do not "
                             f"return routed experts; use {flag('rollout_engine_protocol')} relax or sglang")
        self._check_offload(asynchronous)

    # Settings as given ---------------------------------------------------------------------
    def changed(self, name: str) -> bool:
        """Whether setting ``name`` was given a value other than its default. A rule that a setting needs some
        feature asks this, not whether it was named: a saved config spells out every default, and re-running it
        must not count the defaults of switched-off features as set."""
        return name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default

    @classmethod
    def secret_fields(cls) -> tuple[str, ...]:
        return tuple(name for name, info in cls.model_fields.items() if info.json_schema_extra.get("secret"))

    def shareable_settings(self) -> tuple[dict[str, Any], list[str]]:
        """Every setting with the secret ones emptied (None), and the names of the secrets that were set: what
        config.yaml, the console and the trackers get. Only the fields marked secret are hidden, so the dump
        keeps every other setting and re-runs as it is."""
        settings = self.model_dump()
        set_secrets = [name for name in self.secret_fields() if settings[name] is not None]
        for name in set_secrets:
            settings[name] = None
        return settings, set_secrets

    # Derived values ------------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        """Samples trained on per step: every response of the step's prompts, or one per SFT row."""
        if self.loss_type == "sft":
            return self.rollout_batch_size
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def train_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.global_batch_size or self.samples_per_step

    @property
    def loss_aggregation(self) -> LossAggregation:
        """--loss-agg-mode, or what --calculate-per-token-loss implies when it is unset."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "token-mean" if self.calculate_per_token_loss else "seq-mean-token-mean"

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps taken on each rollout batch."""
        return self.samples_per_step // self.train_batch_size

    @property
    def resolved_weight_sync_transport(self) -> str:
        """--weight-sync-transport, or its default: disk for external servers, broadcast for Ray processes."""
        if self.weight_sync_transport is not None:
            return self.weight_sync_transport
        return "disk" if self.rollout_external else "broadcast"

    @property
    def save_dir(self) -> Path:
        return Path(self.save) if self.save else Path(self.output_dir) / "checkpoints"

    def total_rollout_steps(self, num_prompts: int) -> int:
        """Rollout steps of the run: --num-rollout, --num-epoch over `num_prompts`, or the smaller of both."""
        steps_per_epoch = max(num_prompts // self.rollout_batch_size, 1)
        candidates = [n for n in (self.num_rollout, self.num_epoch and self.num_epoch * steps_per_epoch) if n]
        if not candidates:
            raise ConfigError(f"set {flag('num_rollout')} or {flag('num_epoch')}")
        return min(candidates)


def fields_by_section() -> dict[str, list[str]]:
    """Field names grouped by the section shown in --help and docs/config.md."""
    grouped: dict[str, list[str]] = {section: [] for section in SECTIONS}
    for name, info in RelaxConfig.model_fields.items():
        grouped[info.json_schema_extra["section"]].append(name)  # type: ignore[index]
    return grouped
