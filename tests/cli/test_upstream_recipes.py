"""Upstream Relax's recipe scripts through `relax train`'s parser (issue 19): every flag is either honoured (it sets
the Relax setting of the same name) or refused with the reason and the Relax equivalent, never ignored.

The flag lists are those of upstream's text (Qwen3-4B fully async GRPO), vision-language (Qwen3-VL-30B-A3B DeepEyes,
MoE) and omni (Qwen3-Omni-30B-A3B) recipes: Relax's own flags, Megatron-LM's and SGLang's, as
shared/reference/relax-upstream.md lists them.
"""

from __future__ import annotations

import pytest

from relax.cli.args import UPSTREAM_PREFIX, build_parser, parse_flags
from relax.cli.upstream_flags import explain
from relax.config import ConfigError, RelaxConfig, flag

MEGATRON = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--context-parallel-size",
            "1", "--sequence-parallel", "--use-distributed-optimizer", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1", "--bf16",
            "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--attention-backend", "flash",
            "--optimizer", "adam", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--megatron-to-hf-mode", "bridge", "--ref-load", "/ckpt/ref"]
TEXT = [
    "--hf-checkpoint", "/models/Qwen3-4B", "--prompt-data", "/data/dapo-math-17k.jsonl", "--input-key", "prompt",
    "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "dapo",
    "--num-rollout", "3000", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "8192", "--rollout-temperature", "1.0", "--global-batch-size", "256",
    "--balance-data", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216", "--advantage-estimator", "grpo",
    "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.00",
    "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--use-tis", "--lr", "1e-6", "--lr-decay-style", "constant",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--fully-async", "--max-staleness", "1",
    "--resource", '{"actor":[1,1],"rollout":[1,1],"reference":[1,1],"actor_fwd":[1,1],"advantages":[1,0]}',
    "--num-data-storage-units", "1", "--eval-prompt-data", "aime", "/data/aime-2024.jsonl", "--eval-interval", "20",
    "--n-samples-per-eval-prompt", "16", "--save", "/ckpt/qwen3-4b", "--save-interval", "20",
    "--use-health-check", "--use-fault-tolerance", "--max-global-restart", "3", "--use-tensorboard",
    "--use-metrics-service", "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
    "--sglang-server-concurrency", "512", *MEGATRON,
]
VL = [
    "--hf-checkpoint", "/models/Qwen3-VL-30B-A3B-Instruct", "--prompt-data", "/data/deepeyes.parquet",
    "--input-key", "prompt", "--label-key", "reward_model", "--multimodal-keys", '{"image": "images"}',
    "--apply-chat-template", "--image-max-token-num", "1024", "--rollout-batch-size", "16",
    "--n-samples-per-prompt", "8", "--rollout-max-response-len", "4096", "--rollout-interaction-env-path",
    "examples.deepeyes.env:build_env", "--max-turns", "6", "--global-batch-size", "128", "--use-rollout-routing-replay",
    "--use-routing-replay", "--advantage-estimator", "grpo", "--fully-async", "--max-staleness", "1",
    "--freeze-vision-tower", "--lora-rank", "0", "--expert-model-parallel-size", "8", "--moe-grouped-gemm",
    "--moe-aux-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall", "--sglang-cuda-graph-max-bs", "256",
    "--sglang-enable-dp-attention", *MEGATRON,
]
OMNI = [
    "--hf-checkpoint", "/models/Qwen3-Omni-30B-A3B-Instruct", "--prompt-data", "/data/echo-ink.jsonl",
    "--multimodal-keys", '{"audio": "audios", "video": "videos"}', "--use-audio-in-video", "--apply-chat-template",
    "--video-fps", "2", "--audio-sample-rate", "16000", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "2048", "--custom-rm-path", "examples.echo_ink.reward:score",
    "--freeze-audio-tower", "--hybrid", "--max-staleness", "1", "--colocate", "--notify-urls", "json://localhost",
    "--timeline-dump-dir", "/tmp/timeline", "--rollout-num-gpus", "8", "--actor-num-gpus-per-node", "8",
    "--sglang-page-size", "16", "--use-opsm", "--rotate-ckpt", *MEGATRON,
]


def _flags(argv: list[str]) -> list[str]:
    return [token for token in argv if token.startswith("--")]


@pytest.mark.parametrize("recipe", [TEXT, VL, OMNI], ids=["text", "vision-language", "omni"])
def test_every_flag_of_an_upstream_recipe_is_honoured_or_refused_with_its_reason(recipe):
    parser = build_parser()
    with pytest.raises(ConfigError) as refused:
        parse_flags(parser, recipe)
    message = str(refused.value)
    known = {flag(name) for name in RelaxConfig.model_fields}
    for name in _flags(recipe):
        if name in known:
            assert f" {name}:" not in message, name  # honoured: not refused
        else:
            reason = explain(name)
            assert reason, f"{name} is neither a Relax flag nor explained"
            assert f"{UPSTREAM_PREFIX}{name}: {reason}" in message
    assert "unknown flag" not in message and "unexpected argument" not in message  # values went with their flags

    # Without the refused flags (and their values) the recipe parses into Relax's settings of the same names.
    kept, skipping = [], False
    for token in recipe:
        if token.startswith("--"):
            skipping = token not in known
        if not skipping:
            kept.append(token)
    settings = parse_flags(parser, kept)
    assert {flag(name) for name in settings} == {name for name in _flags(kept)}


def test_a_yaml_config_of_upstream_settings_is_refused_with_the_reason(tmp_path):
    from relax.cli.args import read_yaml_settings

    path = tmp_path / "recipe.yaml"
    path.write_text("expert_tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="upstream Relax's setting 'expert_tensor_parallel_size': not built in Relax "
                                          "yet"):
        read_yaml_settings(path)
    path.write_text("tensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n")  # honoured: Relax settings
    assert read_yaml_settings(path) == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


def test_every_flag_upstream_documents_is_a_relax_flag_or_explained():
    """The flag list of shared/reference/relax-upstream.md's argument section, as the repository snapshot of it
    (no flag of upstream's is silently unknown)."""
    documented = ["--actor-num-gpus-per-node", "--agentic-concurrency", "--buffer-filter-path",
                  "--checkpoint-engine-backend", "--custom-reward-post-process-path", "--eval-config",
                  "--genrm-num-gpus", "--lora-merge-mode", "--normalize-advantages", "--num-steps-per-rollout",
                  "--over-sampling-batch-size", "--partial-rollout-max-aborted-count", "--ref-actor-config",
                  "--reward-num-workers", "--rm-type-infer", "--rollout-function-path", "--rollout-http-timeout",
                  "--scale-out-timeout", "--selective-offload", "--true-on-policy-mode", "--update-weights-interval",
                  "--use-streaming-dataset", "--use-unbiased-kl", "--prefetch-factor", "--sglang-router-policy"]
    known = {flag(name) for name in RelaxConfig.model_fields}
    assert all(name in known or explain(name) for name in documented)
