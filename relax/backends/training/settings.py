"""What a training backend is built with (`TrainSettings`): device and precision, the optimizer and its schedule,
micro-batching, and the model options (LoRA, packing, kernels, MoE losses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from relax.backends.training.lora import LoraSettings


@dataclass(frozen=True)
class TrainSettings:
    device: torch.device
    compute_dtype: torch.dtype  # dtype of the forward; master weights stay float32
    micro_batch_size: int
    temperature: float  # logits are divided by it so log-probs match the sampling distribution
    pad_token_id: int
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    total_optimizer_steps: int = 1
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    gradient_checkpointing: bool = False
    entropy_grad: bool = False  # backpropagate through the entropy (only an entropy bonus needs it)
    freeze_vision_tower: bool = False
    freeze_audio_tower: bool = False
    sequence_packing: bool = True  # micro-batches as packed rows (False: right-padded rows, the old layout)
    lora: LoraSettings | None = None  # train LoRA adapters only (`relax.backends.training.lora`)
    moe_aux_loss_coef: float | None = None  # None: the MoE family's own (`relax.backends.training.moe`)
    # MoE experts as grouped GEMMs in the compute dtype from float32 master weights (`grouped_experts`). False:
    # transformers' own implementation, which multiplies in the weights' dtype (float32 outside FSDP: the path
    # before, kept as `benchmarks/train_gpu.py`'s baseline).
    moe_grouped_gemm: bool = True
    routing_replay: bool = False  # forwards route tokens to a batch's recorded experts (`routing_replay`, R3)
    log_probs_chunk_size: int = 4096  # response tokens per LM-head chunk (0: full logits at once)
    # the chunks' logits kept for the backward instead of recomputed (`--log-probs-keep-logits on`; `auto`: the memory
    # plan turns it on where it has room, `FSDPTrainBackend.keep_logits`)
    log_probs_keep_logits: bool = False
    max_tokens_per_gpu: int | None = None  # a token budget per training micro-batch instead of micro_batch_size
    log_probs_max_tokens_per_gpu: int | None = None  # the same for forwards without gradient
    tensor_model_parallel_size: int = 1  # ranks that split each layer's heads and MLP columns (`mesh`)
    expert_model_parallel_size: int = 1  # data ranks that split each MoE layer's experts among them
    context_parallel_size: int = 1  # ranks that split each packed row's tokens (Ulysses attention)
    sequence_parallel: bool = False  # tensor-parallel ranks hold slices of the tokens between blocks (`parallelize`)
    data_parallel_replicate_size: int = 1  # replicas of the FSDP2 sharding (HSDP; `mesh`)
    pipeline_model_parallel_size: int = 1  # ranks that hold the decoder's layers in stages (`pipeline`)
    decoder_first_pipeline_num_layers: int | None = None  # layers of the first stage (None: an even split)
    decoder_last_pipeline_num_layers: int | None = None  # layers of the last stage
    balance_data: bool = False  # give ranks equal token counts instead of a strided share of samples
    fused_optimizer: bool = True  # fused AdamW kernels on CUDA (foreach elsewhere)
    liger_kernel: bool = False  # liger-kernel's RMSNorm, SwiGLU and RoPE on the language model (CUDA)
    # With liger_kernel: the RMSNorms from torch.compile ("compiled", `compiled_norm`: faster on the H200) or from
    # liger-kernel ("liger", the path before, kept as `benchmarks/train_gpu.py`'s baseline).
    rms_norm_kernel: Literal["compiled", "liger"] = "compiled"
    # With liger_kernel and the compiled norms: Qwen3's per-head query/key norms and the RoPE after them in one
    # Triton pass each way (`fused_qk_rope`). False: three kernels each way (the path before; the benchmark's).
    fused_qk_norm_rope: bool = True
    # Under gradient-accumulation fusion: the input gradient of a layer's q/k/v (and gate/up) projections summed
    # inside their GEMMs (`master_weights.shared_input_linears`). False: autograd adds them (the path before).
    shared_input_linears: bool = True
    # Grouped-query attention with the keys and values repeated to the query heads before the packed attention
    # kernel (the path before; `benchmarks/train_gpu.py`'s baseline). False: the kernel reads them per group.
    attention_repeat_kv: bool = False
    # Outside FSDP in low precision: the embedding's output cast to compute_dtype, so the residual stream and the
    # activations are in it (as under FSDP's mixed precision; `master_weights.embed_in_compute_dtype`). False: the
    # float32 embedding keeps them in float32 under autocast (the path before; `benchmarks/train_gpu.py`'s baseline).
    activations_in_compute_dtype: bool = True
    # One process on CUDA through FSDP2 too, for its mixed precision (bf16 parameters in the forward and backward,
    # float32 master weights and gradients) instead of float32 parameters under autocast. Off: on the H200 it
    # measured 0.83x the autocast path's tokens/s on the Qwen3-0.6B shape (FSDP's per-layer gathers and hooks
    # cost more than the casts they save), for 5 GiB less peak memory (benchmarks/results/train_gpu.json).
    fsdp_single_process: bool = False
    # Outside FSDP in low precision: linears and the LM head cast their float32 weights once per step and sum
    # their weight gradients in float32 inside the GEMM (`master_weights`), instead of autocast's per-micro-batch
    # casts and bf16 gradients cast and added to .grad.
    gradient_accumulation_fusion: bool = True
