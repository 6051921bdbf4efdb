"""Generation, rewards and evaluation (sections: rollout, reward, eval)"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, field_validator, model_validator

from relax.config.base import ToolCallParserName, flag, setting


class RolloutSettings(BaseModel):
    """Generation, rewards and evaluation."""
    rollout_max_prompt_len: int | None = setting(
        None, "Prompts longer than this many tokens are dropped at load time (and counted). Unset or not, a "
        "prompt that leaves no room for an answer within the model's positions (max_position_embeddings) is dropped "
        "too (upstream's default: the context less one).", "rollout", ge=1
    )
    rollout_max_response_len: int = setting(1024, "Maximum new tokens per response.", "rollout", ge=1)
    rollout_temperature: float = setting(1.0, "Sampling temperature for training rollouts.", "rollout", gt=0)
    rollout_top_p: float = setting(1.0, "Nucleus sampling threshold (1.0 disables it).", "rollout", gt=0, le=1)
    rollout_top_k: int = setting(-1, "Sample among the k most likely tokens (-1 disables it).", "rollout")
    rollout_stop: list[str] = setting([], "Stop strings; the match is kept in the response.", "rollout")
    rollout_stop_token_ids: list[int] = setting([], "Token ids that end a response besides EOS.", "rollout")
    rollout_max_batch_size: int | None = setting(
        None, "Most sequences the embedded engine decodes at once (default: all requests of a step).", "rollout", ge=1
    )
    engine_core: Literal["auto", "on", "off"] = setting(
        "auto",
        "The embedded engine core's runner (docs/engines.md): `auto` the paged one (the core's decoder over a paged KV "
        "pool, CUDA graphs on CUDA) for the families it runs and the model's own forward and cache for the others; "
        "`on` the paged one only (a model it cannot run is refused, saying why); `off` the model's own forward for "
        "every model.",
        "rollout",
    )
    rollout_fp8: bool = setting(
        False, "The embedded engine core's decoder projections in FP8 (e4m3, a scale per output channel, activations "
        "scaled per token, torch._scaled_mm), requantised from the synced weights at every weight sync; embeddings, "
        "attention, the KV cache and the LM head stay in the model's dtype. Halves the weight bytes decoding reads "
        "(Hopper or newer on CUDA). The rollout then differs from the bf16 trainer by more than rounding: use "
        "--use-tis, which corrects it and reports it (train/tis_mismatch_kl). Paged engine core only "
        "(docs/engines.md).",
        "rollout",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = setting(
        "auto",
        "The embedded engine core's KV pool: `auto` in the model's dtype; `fp8_e4m3` (SGLang's and vLLM's name) one "
        "byte per entry with a float32 scale per head vector computed as it is written (no calibration): the pool holds "
        "nearly twice the tokens and decode reads half the K/V bytes (not faster yet on an H200: the decode kernel "
        "is not bandwidth-bound on FP8, docs/engines.md). Ada/Hopper or newer on CUDA. The "
        "rollout then differs from the trainer by more than rounding: use --use-tis, which corrects and reports it "
        "(train/tis_mismatch_kl). Paged engine core only (docs/engines.md).",
        "rollout",
    )
    mem_fraction_static: float = setting(
        0.4,
        "On CUDA, the share of the device memory free when the engine starts (after its weights, a colocated "
        "trainer's and other engines') that its KV pool takes. SGLang's flag counts a share of the whole device, "
        "weights included, which suits a server alone on its GPU but fails or starves a colocated trainer. The "
        "default leaves room for training.",
        "rollout", gt=0, lt=1,
    )
    max_total_tokens: int | None = setting(
        None, "The KV pool's size in tokens, instead of --mem-fraction-static (CPU default: 65,536 tokens, at most "
        "256 MiB). A sequence ends with finish reason length at the pool's end, as at the model's last position; "
        "prompts that fill it are dropped at load.", "rollout", ge=64,
    )
    max_prefill_tokens: int = setting(
        8192, "Most prompt tokens the engine prefills in one step (a longer single prompt runs alone).", "rollout",
        ge=16,
    )
    page_size: int = setting(16, "Token slots per block of the engine's KV pool.", "rollout", ge=1, le=256)
    cuda_graph_max_bs: int = setting(
        256, "Largest decode batch captured in a CUDA graph (larger batches decode eagerly).", "rollout", ge=1,
        le=512,
    )
    disable_cuda_graph: bool = setting(False, "Decode without CUDA graphs (for debugging).", "rollout")
    dynamic_sampling_filter_path: str | None = setting(
        None,
        "DAPO dynamic sampling: dotted path `module:function` of a group filter `fn(args, samples) -> bool | "
        "DynamicFilterOutput(keep, reason)`, called on each scored prompt group. Rejected groups are dropped "
        "and refilled from the next prompts until --rollout-batch-size groups are kept. Built-in: "
        "`relax.rollout.filters.dynamic_sampling:check_reward_nonzero_std` (keep groups whose rewards differ).",
        "rollout",
    )
    max_dynamic_sampling_rounds: int = setting(
        8,
        "Most generation rounds per step with dynamic sampling; past it the step trains on the groups kept "
        "so far (a warning is logged).",
        "rollout",
        ge=1,
    )
    custom_generate_function_path: str | None = setting(
        None,
        "Dotted path `module:function` of a per-sample generate function `async def generate(args, sample, "
        "sampling_params) -> Sample | list[Sample]` used instead of the built-in one (training and eval); see "
        "docs/agentic.md.",
        "rollout",
    )
    rollout_interaction_env_path: str | None = setting(
        None,
        "Module (`pkg.module`, or `pkg.module:function`) whose `build_env(sample, args)` makes one interaction "
        "environment per sample; samples are then generated by the multi-turn loop "
        "(relax.rollout.agentic.multi_turn.generate) unless --custom-generate-function-path is set.",
        "rollout",
    )
    max_turns: int = setting(5, "Most model turns of a multi-turn episode.", "rollout", ge=1)
    rollout_max_context_len: int | None = setting(
        None,
        "Most tokens (prompt + every turn's model and environment tokens) of a multi-turn episode; each turn's "
        "new tokens are capped by what is left. Default: the prompt's length + --rollout-max-response-len.",
        "rollout",
        ge=1,
    )
    env_step_timeout: float = setting(
        60.0,
        "Seconds an environment's reset or step may take; past it the sample is marked failed (and left out "
        "of the loss) and the run goes on.",
        "rollout",
        gt=0,
    )
    env_workers: int = setting(
        0, "Run the --rollout-interaction-env-path environments in this many worker processes instead of threads of "
        "the rollout's process: an environment that crashes its process (a segfault, os._exit, the OOM killer) "
        "fails only the episodes of its worker, which is replaced; each episode stays in one worker. 0: threads "
        "(docs/agentic.md).", "rollout", ge=0,
    )
    env_worker_memory_mb: int | None = setting(
        None, "Address-space cap (MiB, on top of what the worker holds once started) of each --env-workers "
        "process: an environment that leaks fails there with MemoryError.", "rollout", ge=64,
    )

    @model_validator(mode="after")
    def _check_env_workers(self) -> Self:
        if self.env_workers and self.rollout_interaction_env_path is None:
            raise ValueError(f"{flag('env_workers')} needs {flag('rollout_interaction_env_path')}")
        if self.env_worker_memory_mb is not None and not self.env_workers:
            raise ValueError(f"{flag('env_worker_memory_mb')} needs {flag('env_workers')}")
        return self
    agent_command: str | None = setting(
        None,
        "The external agent program of `--custom-generate-function-path relax.rollout.agentic.agent_rollout:generate`"
        ", split like a shell would (no shell runs it), e.g. `python my_agent.py --tries 2`. It runs once per sample "
        "and talks to the policy through the agent gateway's /v1/chat/completions, /v1/responses or /v1/messages "
        "(RELAX_BASE_URL, RELAX_SESSION_ID); see docs/agentic.md.",
        "rollout",
    )
    agentic_session_lifecycle: bool = setting(
        False,
        "The embedded engine keeps each agent session's K/V (its prompt and answers) from one turn to the next, so a "
        "turn prefills only its new messages, and lets go of it when the session ends (the agent program's or the "
        "multi-turn episode's end), after --agentic-session-idle-timeout, on a weight update, or for room before any "
        "running request would be preempted (upstream's flag; docs/agentic.md).",
        "rollout",
    )
    agentic_program_admission: bool = setting(
        False,
        "Start agent programs only when their context budget fits the embedded engine's KV pool: a FIFO ledger of "
        "reservations within --agentic-admission-headroom of the pool, none admitted while the pool's use is above "
        "--agentic-admission-pressure; a program that waited --agentic-admission-max-wait seconds starts anyway "
        "(fails open). Upstream's flag and thresholds (docs/agentic.md).",
        "rollout",
    )
    agentic_admission_headroom: float = setting(
        0.90, "Share of the KV pool the admitted programs' reservations may take (--agentic-program-admission).",
        "rollout", gt=0, le=1,
    )
    agentic_admission_pressure: float = setting(
        0.92, "Share of the KV pool in use above which no program is admitted (--agentic-program-admission).",
        "rollout", gt=0, le=1,
    )
    agentic_admission_max_wait: float = setting(
        30.0, "Seconds a program waits for admission before it starts anyway, counted as a bypass "
        "(--agentic-program-admission).", "rollout", gt=0,
    )
    agentic_session_idle_timeout: float = setting(
        300.0, "Seconds without a turn after which a session's kept K/V is let go (--agentic-session-lifecycle).",
        "rollout", gt=0,
    )
    agent_timeout: float = setting(
        600.0,
        "Seconds an agent program may run; past it its process group is killed and the sample is marked failed.",
        "rollout",
        gt=0,
    )
    tools: list[str] = setting(
        [],
        "Tools of rows without a --tool-key column, and user tools: built-in names (`python`, `calculator`) or "
        "dotted paths `pkg.module:function` of functions with type hints and a Google-style docstring.",
        "rollout",
    )
    tool_call_parser: ToolCallParserName = setting(
        "hermes", "How tool calls are read from the model's text: `hermes` (`<tool_call>{json}</tool_call>`; "
        "aliases `qwen`, `qwen25`, `qwen3`).", "rollout"
    )
    tool_timeout: float = setting(10.0, "Seconds one tool call may take (the python tool is killed after it).",
                                 "rollout", gt=0)
    python_tool_memory_mb: int = setting(512, "Address-space limit of the python tool's process (MiB).", "rollout",
                                        ge=64)
    rm_type: str | None = setting(
        None,
        "Built-in reward: math, gsm8k, dapo, multiple_choice, f1, exact_match; prefix `boxed_` to grade the "
        "last \\boxed{} answer. A sample's metadata.rm_type overrides it.",
        "reward",
    )
    custom_rm_path: str | None = setting(
        None, "Dotted path `module:function` of a custom reward `fn(args, sample)` (sync or async).", "reward"
    )
    group_rm: bool = setting(
        False, "Call the custom reward once per prompt group: `fn(args, samples) -> list`.", "reward"
    )
    rm_url: str | None = setting(
        None, "URL of a reward server (upstream's remote_rm; `--rm-type remote_rm` names it too): each sample is "
        "POSTed as {prompt, response, label, metadata} and the answer is a number or {\"reward\": x}. Refused "
        "connections, timeouts, 5xx and 429 are retried with exponential backoff (0.5 s doubling to 30 s, 10 "
        "attempts) within --reward-timeout; retries are logged in reward/remote_retries. A secret (it may hold a "
        "token): logs show scheme, host and path only.", "reward", secret=True,
    )
    rm_path: list[str] | None = setting(
        None, "A trained reward model folder (`relax export` of a --loss-type rm run, or any "
        "AutoModelForSequenceClassification with one label): it scores each sample's prompt and response in the "
        "scoring process (the rollout's), concurrent samples in one batched forward, each call bounded by "
        "--reward-timeout; the score is the reward. Device and dtype: the run's. Several folders make an ensemble: "
        "each member's score is standardised by its running mean and standard deviation over the run's scores, and "
        "--rm-ensemble-reduce combines them.", "reward", path=True,
    )
    rm_ensemble_reduce: Literal["mean", "min", "mean_minus_std"] = setting(
        "mean", "How the standardised scores of several --rm-path models make the reward: their mean, their minimum "
        "(the most pessimistic member), or their mean minus --rm-ensemble-std-coef times their standard deviation "
        "(a penalty where the members disagree, which is where a policy exploits a reward model's errors).",
        "reward",
    )
    rm_ensemble_std_coef: float = setting(
        1.0, "--rm-ensemble-reduce mean_minus_std: the weight of the members' disagreement.", "reward", ge=0,
    )
    genrm_model_path: str | None = setting(
        None, "A judge model (GenRM, LLM-as-judge) folder: an embedded engine in the scoring process generates a "
        "verdict per sample from --genrm-prompt-template; the number in its last \\boxed{}, after its last "
        "`score:`, or a leading yes/no is the reward.", "reward", path=True,
    )
    genrm_prompt_template: str | None = setting(
        None, "The judge's prompt (or a file holding it), with the fields {prompt}, {response} and {label}; "
        "default: asks for a score in \\boxed{}.", "reward",
    )
    genrm_sampling_config: dict[str, Any] | None = setting(
        None, "JSON: the judge's sampling, keys temperature (0.1), top_p (1.0), top_k (-1), max_response_len "
        "(4096), upstream's defaults.", "reward",
    )
    genrm_engine_config: dict[str, Any] | None = setting(
        None, "JSON: the judge's engine, keys device and dtype (default: the run's), engine_core, "
        "mem_fraction_static, max_batch_size.", "reward",
    )
    custom_rm_workers: int = setting(
        0, "Run a synchronous --custom-rm-path function in this many worker processes instead of threads of the "
        "trainer: a crash or a leak costs only its worker (replaced; the sample scored 0 and counted in "
        "reward/num_errors) and --reward-timeout kills a hung call. 0: threads.", "reward", ge=0,
    )
    reward_worker_memory_mb: int | None = setting(
        None, "Address-space cap (MiB) of each --custom-rm-workers process: a reward that leaks fails there with "
        "MemoryError.", "reward", ge=64,
    )
    reward_timeout: float = setting(
        5.0,
        "Seconds one reward call (one sample, or one group with --group-rm) may take; past it the sample gets 0, "
        "is counted in reward/num_timeouts and the step goes on. The math rewards run in worker processes that "
        "are killed at the limit; other rewards are abandoned (a thread cannot be killed).",
        "reward",
        gt=0,
        allow_inf_nan=False,
    )
    overlong_buffer_len: int | None = setting(
        None,
        "DAPO soft overlong punishment: a response of l tokens longer than M - L (M = --rollout-max-response-len, "
        "L = this) gets (M - L - l) / L * --overlong-penalty-factor added to its reward. Default: off.",
        "reward",
        ge=1,
    )
    overlong_penalty_factor: float = setting(
        1.0, "Penalty of a response of the maximum length under --overlong-buffer-len.", "reward", ge=0
    )
    eval_prompt_data: dict[str, str] = setting(
        {},
        "Held-out sets, as `name path` pairs on the command line or a name: path mapping in YAML.",
        "eval", path=True,
    )
    eval_interval: int | None = setting(
        None, "Evaluate every this many rollout steps. With --eval-prompt-data the run is always evaluated before "
        "the first step (unless --skip-eval-before-train) and after the last.", "eval", ge=1)
    eval_temperature: float = setting(
        0.0, "Sampling temperature for evaluation (0: greedy, a stable accuracy measure).", "eval", ge=0
    )
    eval_max_response_len: int | None = setting(
        None, "Maximum new tokens in evaluation (default --rollout-max-response-len).", "eval", ge=1
    )
    n_samples_per_eval_prompt: int = setting(1, "Responses per evaluation prompt.", "eval", ge=1)
    eval_rm_type: str | None = setting(
        None, "A rule reward (an --rm-type name) that grades the held-out sets instead of the training reward: "
        "with a learned reward (--rm-path, --genrm-model-path, --rm-url) the held-out accuracy is then the real "
        "one. Default: the training reward.", "eval",
    )
    skip_eval_before_train: bool = setting(False, "Do not evaluate before the first training step.", "eval")

    @field_validator("eval_prompt_data", mode="before")
    @classmethod
    def _pairs_to_mapping(cls, value: Any) -> Any:
        """Accept upstream's `--eval-prompt-data name path [name path ...]` list form."""
        if isinstance(value, (list, tuple)):
            if len(value) % 2:
                raise ValueError("expects `name path` pairs, got an odd number of values")
            return {value[i]: value[i + 1] for i in range(0, len(value), 2)}
        return value

    @field_validator("rollout_stop")
    @classmethod
    def _no_empty_stop_string(cls, value: list[str]) -> list[str]:
        """An empty stop string would end every response after its first token (the engine drops it, so the flag
        would do nothing): refused."""
        if any(stop == "" for stop in value):
            raise ValueError("an empty stop string matches after any token; give the text that ends a response")
        return value

    @field_validator("rollout_stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int]) -> list[int]:
        """Ids below 0 are no token (ids past the vocabulary are refused once the model is known, in preflight)."""
        negative = [token for token in value if token < 0]
        if negative:
            raise ValueError(f"{negative[0]} is no token id (ids start at 0)")
        return value

    @field_validator("rm_path", mode="before")
    @classmethod
    def _one_or_more_folders(cls, value: Any) -> Any:
        """One folder (a string, as in a --config file) or several; none given is unset."""
        if isinstance(value, str):
            return [value]
        return value or None

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
