"""Upstream Relax's flags that Relax does not take, each with the reason and what to use instead.

Upstream's recipe scripts carry three kinds of flags: Relax's own (most of them are Relax's too, same names and
meaning), Megatron-LM's (model parallelism, recomputation, precision, the model's shape) and SGLang's (``--sglang-*``).
A flag of a script that Relax does not have is refused, never ignored: `explain` says why and names the Relax
setting that does the job, so a user bringing a script knows what changes. `tests/cli/test_upstream_recipes.py` feeds
the flags of upstream's text, vision-language and omni recipes through `relax train`'s parser.
"""

from __future__ import annotations

_FSDP = ("Megatron's data-parallel and communication knobs: Relax trains with FSDP2, which shards parameters, "
         "gradients and optimizer state over the data-parallel ranks (`torchrun --nproc-per-node N relax train ...`); "
         "nothing to set")
_PARALLEL_LATER = ("not built in Relax yet: the trainer's mesh has data (FSDP2), tensor (--tensor-model-parallel-size), "
                   "expert (--expert-model-parallel-size), context (--context-parallel-size) and pipeline "
                   "(--pipeline-model-parallel-size) axes, and sequence parallelism (--sequence-parallel); expert tensor "
                   "parallelism and virtual pipeline stages are to come (docs/parallelism.md)")
_SHAPE = "Megatron's description of the model: Relax reads the architecture from --hf-checkpoint's config.json"
_RECOMPUTE = "Megatron's activation recomputation: use --gradient-checkpointing"
_PRECISION = ("Megatron's precision switches: Relax computes in --dtype (bf16 on CUDA) with float32 master weights, "
              "gradients and softmax")
_GPUS = ("Relax places roles with --resource '{\"actor\": [replicas, gpus], \"rollout\": [replicas, gpus], ...}' "
         "under --placement ray, and across the GPUs of one host with torchrun")
_TQ = "a TransferQueue knob Relax sets itself (one storage unit, event-driven reads of whole groups)"
_EXPORT = "relax export RUN_DIR OUT_DIR writes a Hugging Face folder from any checkpoint (bf16 or float32)"
_SCALING = "the scaling API's settings are --scale-in-drain-timeout and --scale-out-max-engines (docs/serving.md)"
_NOT_BUILT = "not built in Relax yet"

# Exact flags.
UPSTREAM_ONLY: dict[str, str] = {
    **dict.fromkeys(("--expert-tensor-parallel-size", "--virtual-pipeline-model-parallel-size",
                     "--num-layers-per-virtual-pipeline-stage"), _PARALLEL_LATER),
    **dict.fromkeys(("--use-distributed-optimizer",
                     "--overlap-grad-reduce", "--overlap-param-gather", "--distributed-timeout-minutes"), _FSDP),
    **dict.fromkeys(("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                     "--recompute-activations"), _RECOMPUTE),
    **dict.fromkeys(("--bf16", "--fp16", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
                     "--attention-backend", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion"),
                    _PRECISION),
    **dict.fromkeys(("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                     "--group-query-attention", "--num-query-groups", "--kv-channels", "--seq-length",
                     "--max-position-embeddings", "--normalization", "--norm-epsilon", "--swiglu",
                     "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
                     "--position-embedding-type", "--rotary-base", "--use-rotary-position-embeddings",
                     "--vocab-size", "--make-vocab-size-divisible-by", "--qk-layernorm", "--num-experts",
                     "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-token-dispatcher-type",
                     "--moe-router-load-balancing-type", "--moe-router-score-function", "--moe-layer-freq",
                     "--moe-shared-expert-intermediate-size", "--moe-router-pre-softmax", "--mrope-section",
                     "--attention-dropout", "--hidden-dropout"), _SHAPE),
    "--moe-aux-loss-coeff": "use --moe-aux-loss-coef (the family's auxiliary load-balancing loss)",
    "--optimizer": "Relax uses AdamW: --lr, --min-lr, --adam-beta1, --adam-beta2, --adam-eps, --weight-decay",
    "--train-backend": "Relax's trainer is FSDP2 (there is no Megatron backend)",
    "--ref-load": "the reference is the run's initial weights (--hf-checkpoint); a separate reference checkpoint is "
                  + _NOT_BUILT,
    "--ref-update-interval": "the reference stays the initial model; refreshing it is " + _NOT_BUILT,
    "--ref-actor-config": "the reference and the old-policy forward use the actor's settings; nothing to set",
    "--megatron-to-hf-mode": _EXPORT, "--save-hf": _EXPORT, "--save-hf-dtype": _EXPORT,
    "--save-hf-post-hook-path": _EXPORT,
    **dict.fromkeys(("--actor-num-nodes", "--actor-num-gpus-per-node", "--critic-num-nodes",
                     "--critic-num-gpus-per-node", "--num-gpus-per-node", "--rollout-num-gpus",
                     "--rollout-num-gpus-per-engine", "--genrm-num-gpus", "--genrm-num-gpus-per-engine"), _GPUS),
    **dict.fromkeys(("--num-data-storage-units", "--polling-mode", "--per-rank-fetch",
                     "--num-iters-per-train-update"), _TQ),
    "--true-on-policy-mode": "automatic: with one optimizer step per rollout the current log-probs are the old ones",
    **dict.fromkeys(("--use-streaming-dataset", "--streaming-buffer-size"),
                    "datasets are read whole; row slices (file@[a:b]) select parts"),
    "--rollout-function-path": "--custom-generate-function-path (per sample) or --rollout-interaction-env-path "
                               "(multi-turn environments)",
    "--custom-prompt-path": "write prompts as chat-message lists, or use --system-prompt and --apply-chat-template",
    "--conversation-key-map": "SFT rows are {role, content} messages under --input-key",
    "--eval-config": "--eval-prompt-data NAME PATH [NAME PATH ...] with --eval-interval",
    "--use-agentic-rollout": "--agent-command runs an external agent against the run's agent gateway "
                             "(docs/agentic.md)",
    **dict.fromkeys(("--agent-cwd", "--agent-env", "--agentic-concurrency", "--agentic-prelaunch",
                     "--agentic-reasoning-parser"),
                    "the agent gateway's settings are --agent-command and --agent-timeout (docs/agentic.md)"),
    "--agentic-tool-call-parser": "use --tool-call-parser",
    **dict.fromkeys(("--buffer-filter-path", "--rollout-sample-filter-path"), "use --dynamic-sampling-filter-path"),
    "--over-sampling-batch-size": "dynamic sampling refills missing groups round after round "
                                  "(--max-dynamic-sampling-rounds)",
    "--partial-rollout-max-aborted-count": "with --partial-rollout requests keep generating across weight updates "
                                           "instead of being aborted and resent",
    "--update-weights-interval": "weights reach the engines after every training step",
    "--checkpoint-engine-backend": "--weight-sync-transport broadcast|disk (NCCL on GPU, gloo on CPU)",
    "--use-rollout-logprobs": "--use-tis weighs the loss with the engine's log-probs",
    "--use-routing-replay": "use --use-rollout-routing-replay (the engine's routing replayed in every policy forward)",
    "--optimize-routing-replay": "--use-rollout-routing-replay records routes on the engine's own forward; nothing "
                                 "to set",
    **dict.fromkeys(("--use-opsm", "--opsm-delta", "--use-unbiased-kl", "--custom-tis-function-path",
                     "--rm-type-fallback", "--rm-type-infer"), _NOT_BUILT),
    "--custom-loss-function-path": "use --custom-policy-loss-function-path (the policy term; TIS, the KL loss and the "
                                   "entropy bonus stay) or --custom-advantage-function-path (docs/algorithms.md)",
    "--custom-pg-loss-reducer-function-path": "--loss-agg-mode names the reduction (four modes, docs/algorithms.md)",
    "--normalize-advantages": "group estimators normalise within each group; --disable-grpo-std-normalization "
                              "turns the std off",
    "--disable-rewards-normalization": "use --disable-grpo-std-normalization (Dr.GRPO), or an estimator without "
                                       "group normalisation",
    "--reward-key": "a reward function may return a dict: its \"score\" entry trains",
    **dict.fromkeys(("--custom-reward-post-process-path", "--defer-reward-to-post-process"),
                    "use --group-rm with --custom-rm-path (a function over each prompt group)"),
    **dict.fromkeys(("--reward-max-concurrency", "--reward-num-workers"),
                    "rewards run 16 at a time on threads, or in --custom-rm-workers processes"),
    **dict.fromkeys(("--lora-merge-mode", "--lora-adapter-mode"),
                    "engines get the merged weights; relax export --adapter writes the adapter folder"),
    "--rotate-ckpt": "use --max-checkpoints K (it works with every save, not only --async-save)",
    **dict.fromkeys(("--rollout-result-dir", "--save-debug-rollout-data", "--dump-details"),
                    "--dump-samples N writes samples/rollout_*.jsonl in the run directory"),
    **dict.fromkeys(("--rollout-http-timeout", "--rollout-engine-init-timeout", "--rollout-health-check-first-wait"),
                    "use --rollout-health-check-interval / -timeout / -max-consecutive-failures"),
    **dict.fromkeys(("--scale-out-timeout", "--scale-out-partial-success-policy", "--scale-weight-sync-precheck",
                     "--scale-in-shutdown-timeout", "--autoscaler-config", "--enable-affinity"), _SCALING),
    "--selective-offload": "use --offload-train / --offload-rollout",
    "--num-steps-per-rollout": "use --global-batch-size (samples per optimizer step; rollout samples / steps)",
    "--sglang-server-concurrency": "the embedded engine batches every request of a step; set --rollout-max-batch-size",
    "--debug-rollout-only": _NOT_BUILT, "--debug-train-only": _NOT_BUILT, "--load-debug-rollout-data": _NOT_BUILT,
    "--skip-hf-validate": "a checkpoint is always checked before it loads (docs/models.md)",
    "--custom-config-path": "use --config FILE.yaml (flags override it)",
}

# The embedded engine's settings that SGLang names with a prefix.
SGLANG_EQUIVALENTS = {"--sglang-mem-fraction-static": "--mem-fraction-static",
                      "--sglang-cuda-graph-max-bs": "--cuda-graph-max-bs",
                      "--sglang-disable-cuda-graph": "--disable-cuda-graph",
                      "--sglang-max-total-tokens": "--max-total-tokens",
                      "--sglang-chunked-prefill-size": "--max-prefill-tokens",
                      "--sglang-max-prefill-tokens": "--max-prefill-tokens",
                      "--sglang-page-size": "--page-size",
                      "--sglang-max-running-requests": "--rollout-max-batch-size"}


def explain(flag: str) -> str | None:
    """Why ``flag`` (upstream Relax's, Megatron's or SGLang's) is not a Relax flag, and what to use instead; None
    for a flag upstream does not have either."""
    if flag in UPSTREAM_ONLY:
        return UPSTREAM_ONLY[flag]
    if flag in SGLANG_EQUIVALENTS:
        return f"use {SGLANG_EQUIVALENTS[flag]} (the embedded engine's setting of the same name in SGLang)"
    if flag.startswith("--sglang-"):
        return ("an SGLang server setting: Relax's embedded engine takes --engine-core, --mem-fraction-static, "
                "--max-total-tokens, --max-prefill-tokens, --page-size, --cuda-graph-max-bs, --disable-cuda-graph; "
                "an SGLang server of your own joins with --rollout-external")
    if flag.startswith("--prefetch-"):
        return UPSTREAM_ONLY["--use-streaming-dataset"]
    return None
