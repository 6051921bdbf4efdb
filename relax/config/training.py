"""Batches, the optimizer and LoRA adapters (sections: batch, optimizer, lora)"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, model_validator

from relax.config.base import flag, setting


class TrainingSettings(BaseModel):
    """Batches, the optimizer and LoRA adapters."""
    rollout_batch_size: int = setting(8, "Prompts per rollout step.", "batch", ge=1)
    n_samples_per_prompt: int = setting(
        8,
        "Responses sampled per prompt (the GRPO group size). Upstream defaults to 1, which leaves group-relative "
        "estimators without a baseline; 8 is a working default.",
        "batch",
        ge=1,
    )
    global_batch_size: int | None = setting(
        None,
        "Samples per optimizer step. Default: all samples of a rollout step (one update per step). "
        "Must divide rollout_batch_size * n_samples_per_prompt.",
        "batch",
        ge=1,
    )
    micro_batch_size: int = setting(1, "Samples per forward/backward pass (gradients accumulate).", "batch", ge=1)
    use_dynamic_batch_size: bool = setting(
        False, "Fill each micro-batch with whole samples up to --max-tokens-per-gpu tokens instead of "
        "--micro-batch-size samples (balanced, so none is a small remainder). The gradient is the same.", "batch"
    )
    max_tokens_per_gpu: int | None = setting(
        None, "Token budget of a training micro-batch with --use-dynamic-batch-size (prompt + response tokens); "
        "must hold the longest sample.", "batch", ge=1,
    )
    log_probs_max_tokens_per_gpu: int | None = setting(
        None, "Token budget of a micro-batch of the forwards without gradient (old, reference and teacher "
        "log-probs, values) with --use-dynamic-batch-size. Default: --max-tokens-per-gpu.", "batch", ge=1,
    )
    balance_data: bool = setting(
        False, "With several training processes, give each an equal number of tokens instead of a strided "
        "share of the samples.", "batch"
    )
    sequence_packing: bool = setting(
        True, "Micro-batches are packed rows of whole samples attended apart (no padding); --no-sequence-packing "
        "right-pads them instead (the previous layout, kept for comparison).", "batch"
    )
    log_probs_chunk_size: int = setting(
        4096, "Response tokens per chunk of the LM head and log-softmax, so that no full float32 logits exist "
        "(0: compute the logits of a micro-batch at once, the previous path). 4096 measured 4 percent faster than 1024 "
        "per training step on an H200 (Qwen3-0.6B shape) for 2.6 GB more peak memory.", "batch", ge=0,
    )
    log_probs_keep_logits: Literal["auto", "on", "off"] = setting(
        "auto", "Keep each LM-head chunk's logits from the forward for the backward instead of recomputing them: one "
        "head matmul a chunk less (1.04-1.05x the Qwen3-0.6B shape's training step on H100s), for the logits of a "
        "micro-batch's response tokens held from the head's forward to its backward (bf16 on CUDA, 2 bytes x the "
        "vocabulary a token: 3.2 GiB more peak on that shape). `auto`: kept where the memory plan of a run whose "
        "trainer and embedded engine share one GPU measures room for them, recomputed elsewhere; `on`: kept (the plan "
        "names turning it off among its remedies); `off`: recomputed. Needs --log-probs-chunk-size above 0.", "batch"
    )
    num_rollout: int | None = setting(None, "Rollout steps to train for.", "batch", ge=1)
    num_epoch: int | None = setting(
        None, "Passes over the prompt data; with --num-rollout too, the smaller wins.", "batch", ge=1
    )

    @model_validator(mode="after")
    def _check_lora(self) -> Self:
        if not self.lora_rank:
            set_flags = [flag(name) for name in ("lora_alpha", "target_modules", "lora_scope") if self.changed(name)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('lora_rank')} > 0")
        elif not any(name.strip() for name in self.target_modules):
            raise ValueError(f"{flag('target_modules')} names no module")
        return self

    @model_validator(mode="after")
    def _check_kept_logits(self) -> Self:
        if self.log_probs_keep_logits == "on" and not self.log_probs_chunk_size:
            raise ValueError(f"{flag('log_probs_keep_logits')} on needs {flag('log_probs_chunk_size')} above 0 (0 "
                             "computes a micro-batch's whole logits at once and keeps them anyway)")
        return self
    lr: float = setting(1e-6, "Peak learning rate (AdamW).", "optimizer", gt=0)
    moe_aux_loss_coef: float | None = setting(
        None, "Weight of a mixture-of-experts model's auxiliary load-balancing loss in the training loss. Default: "
        "the family's own (its config's router_aux_loss_coef when its output_router_logits is on, else none); 0 "
        "turns it off. Refused for models that define no such loss (DeepSeek-V3 balances with routing biases).",
        "optimizer", ge=0)
    tensor_model_parallel_size: int = setting(
        1, "Training processes that split each decoder layer: attention heads and MLP columns (Megatron's tensor "
        "parallelism, put on the Hugging Face model by PyTorch's DTensor; each family's plan in docs/models.md). "
        "Must divide the training processes, the heads and the key-value heads; the other factor of the processes "
        "is data parallel (FSDP2). The LM head is split by vocabulary (no rank holds full-vocabulary logits) unless "
        "it is the token embedding; embeddings, experts and vision/audio towers stay whole (docs/parallelism.md).",
        "parallel", ge=1)
    data_parallel_replicate_size: int = setting(
        1, "Replicas of the data-parallel sharding (HSDP, FSDP2's hybrid sharding): the data-parallel processes form "
        "this many groups, FSDP2 shards parameters, gradients and optimizer state within each group (one node, "
        "say) and keeps the groups as replicas, so gradients are reduce-scattered within a group and all-reduced "
        "across groups, and the weights' all-gathers stay inside a group. Must divide the data-parallel processes; "
        "not yet with expert parallelism (docs/parallelism.md).", "parallel", ge=1)
    sequence_parallel: bool = setting(
        False, "With --tensor-model-parallel-size > 1, also split the activations between the blocks' projections "
        "(norms, residuals, the embedding's output) by token over the tensor-parallel ranks (Megatron's sequence "
        "parallelism): each block all-gathers its input and reduce-scatters its output instead of one all-reduce, "
        "and those activations take 1/T of the memory. Packed rows are padded to a multiple of the tensor-parallel "
        "size. For Llama-, Qwen2.5-, Qwen3- and Qwen3-MoE-style decoders; not yet with images/video/audio, "
        "pipeline or context parallelism (docs/parallelism.md).", "parallel")
    expert_model_parallel_size: int = setting(
        1, "Data-parallel training processes that split each mixture-of-experts layer's experts among them: each holds "
        "its share of the experts, and tokens go to the process of their expert and back by all-to-all (torchtitan's "
        "layout: the expert axis is borrowed from the data axis). Must divide the data-parallel processes and the "
        "model's experts; needs --moe-grouped-gemm.", "parallel", ge=1)
    context_parallel_size: int = setting(
        1, "Training processes that split each packed micro-batch's tokens (long responses): every layer but "
        "attention works on its slice, and attention trades tokens for heads by all-to-all (Ulysses) so that it sees "
        "the whole row. Must divide the training processes (with the tensor-parallel size) and the heads of a "
        "tensor-parallel rank; needs sequence packing. Not yet with images/video/audio, routing replay or an MoE "
        "auxiliary loss (docs/parallelism.md).", "parallel", ge=1)
    pipeline_model_parallel_size: int = setting(
        1, "Training processes that hold the decoder's layers in contiguous stages, one each (pipeline parallelism, "
        "torch.distributed.pipelining's 1F1B schedule over packed micro-batches; the first stage also holds the "
        "embedding, the last the final norm and LM head). Must divide the training processes (with the tensor- and "
        "context-parallel sizes) and be at most the model's layers; each micro-batch of a step is padded to the "
        "longest, and a step has at least this many. Needs sequence packing; not yet with "
        "images/video/audio, LoRA, a critic, routing replay, an MoE auxiliary loss, or context parallelism "
        "(docs/parallelism.md).", "parallel", ge=1)
    decoder_first_pipeline_num_layers: int | None = setting(
        None, "Decoder layers of the first pipeline stage (it also runs the embedding); the other stages share the "
        "rest evenly. Default: an even split.", "parallel", ge=1)
    decoder_last_pipeline_num_layers: int | None = setting(
        None, "Decoder layers of the last pipeline stage (it also runs the LM head and the loss); the other stages "
        "share the rest evenly. Default: an even split.", "parallel", ge=1)
    lora_rank: int = setting(
        0, "Train LoRA adapters of this rank (peft) instead of every weight; 0: full fine-tuning. Only the adapters "
        "are in the optimizer and the checkpoint; the engines get merged weights (docs/lora.md).", "lora", ge=0)
    lora_alpha: float = setting(32.0, "LoRA scaling numerator: the adapters' update is scaled by alpha / rank.",
                               "lora", gt=0)
    target_modules: list[str] = setting(
        ["linear_qkv", "linear_proj"], "Modules that get adapters: Hugging Face names (q_proj, down_proj, ...), "
        "upstream's Megatron names (linear_qkv = q/k/v, linear_proj = attention output, linear_fc1 = gate/up, "
        "linear_fc2 = down) or all-linear.", "lora")
    lora_scope: Literal["all", "language", "vision"] = setting(
        "all", "Where adapters go: language (not the vision and audio encoders), vision (only the vision encoder) "
        "or all.", "lora")
    min_lr: float = setting(0.0, "Final learning rate of the cosine schedule.", "optimizer", ge=0)
    lr_warmup_steps: int = setting(0, "Optimizer steps of linear warmup from 0 to --lr.", "optimizer", ge=0)
    lr_decay_style: Literal["constant", "cosine"] = setting(
        "constant", "Schedule after warmup: constant, or cosine decay to --min-lr at the last step.", "optimizer"
    )
    weight_decay: float = setting(0.0, "AdamW weight decay.", "optimizer", ge=0)

    adam_beta1: float = setting(0.9, "AdamW beta1.", "optimizer", ge=0, lt=1)

    adam_beta2: float = setting(0.999, "AdamW beta2.", "optimizer", ge=0, lt=1)
    adam_eps: float = setting(1e-8, "AdamW epsilon.", "optimizer", gt=0)
    clip_grad: float = setting(1.0, "Clip the global gradient norm to this (0 disables clipping).", "optimizer", ge=0)
    seed: int = setting(1234, "Seed of model-side randomness (dropout, initialisation of new heads).", "optimizer")
