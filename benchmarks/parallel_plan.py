"""Per-GPU memory of the trainer's layouts for machines we do not have, by simulation.

Each model is built at its real shape on the meta device (no memory, no weights) in a process that holds a fake
process group of N ranks (`torch.testing._internal.distributed.fake_pg`: collectives do nothing). The trainer's
own code then lays it out exactly as a run of N processes would: `FSDPTrainBackend`'s mesh (`ParallelDims`), the
family's tensor-parallel plan, expert parallelism and FSDP2 (`relax.backends.training.parallelize`). What one rank
holds is read off its parameters' local shards:

- parameters, gradients and AdamW's two moments, float32 each (the trainer's master weights), exact;
- activations, an estimate for ``--max-tokens-per-gpu`` tokens in a micro-batch (bf16 tensors the backward keeps per
  token and layer: the norms' inputs, q/k/v and the attention output, the MLP's inputs, gate/up and activation
  outputs, k copies of each in a MoE layer, heads and intermediate sizes divided by the tensor-parallel size), plus
  the LM head's float32 chunk of logits (4096 tokens) and one layer's FSDP gather in bf16;
- the sum, against the H200's 141 GB (131 GiB usable after the CUDA context, measured).

The estimate is checked against a measured peak on one GPU: the Qwen3-30B-A3B layer (4 layers, one process, budget
16,384; `benchmarks/train_gpu.py --shapes 30b-a3b`), whose measured peak is passed in with ``--measured-gib``.

    python -m benchmarks.parallel_plan                      # the table; writes results/parallel_plan.json
    python -m benchmarks.parallel_plan --measured-gib 66.5  # with the one-GPU check
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.testing._internal.distributed.fake_pg import FakeStore

from benchmarks.grpo_step_gpu import QWEN3_4B, QWEN3_30B_A3B
from relax.backends.training.grouped_experts import use_grouped_experts
from relax.backends.training.mesh import ParallelDims
from relax.backends.training.parallelize import apply_expert_parallel, apply_tensor_parallel, shard_model
from relax.backends.training.response_model import ResponseLogitsModel, language_model

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
H200_USABLE_GIB = 131.0
HEAD_CHUNK = 4096  # --log-probs-chunk-size

QWEN3_235B_A22B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                       num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                       max_position_embeddings=4096, tie_word_embeddings=False)
SHAPES = {
    "Qwen3-4B": dict(QWEN3_4B, model_type="qwen3"),
    "Qwen3-30B-A3B": dict(QWEN3_30B_A3B, num_hidden_layers=48),
    "Qwen3-235B-A22B": QWEN3_235B_A22B,
    "Qwen3-Omni-30B-A3B thinker": "omni",
}
# (world, tp, ep) per model: data parallel alone, then the axes that help it
LAYOUTS = {
    "Qwen3-4B": [(8, 1, 1), (8, 2, 1), (16, 1, 1), (16, 4, 1), (64, 1, 1), (64, 8, 1)],
    "Qwen3-30B-A3B": [(8, 1, 1), (8, 1, 8), (8, 2, 4), (16, 1, 8), (64, 1, 8), (64, 2, 32)],
    "Qwen3-235B-A22B": [(16, 1, 16), (16, 4, 4), (64, 1, 64), (64, 2, 32), (64, 4, 16)],  # 4 KV heads: TP <= 4
    "Qwen3-Omni-30B-A3B thinker": [(8, 1, 1), (8, 1, 8), (16, 2, 8), (64, 1, 8)],
}


def build_config(name: str):
    shape = SHAPES[name]
    if shape == "omni":  # Qwen3-30B-A3B's language model beside the omni thinker's own vision and audio towers
        text = {k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"}
        return transformers.Qwen3OmniMoeThinkerConfig(text_config=dict(text, num_hidden_layers=48,
                                                                       vocab_size=152064))
    shape = dict(shape)
    return transformers.CONFIG_MAPPING[shape.pop("model_type")](**shape)


def activation_bytes(config, tokens: int, tp: int, layers_on_rank: int) -> int:
    """The estimate of the module docstring, in bytes."""
    text = config.get_text_config()
    h, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    q, kvd = heads * head_dim // tp, kv * head_dim // tp
    experts = getattr(text, "num_experts", None)
    if experts:
        copies, inner = text.num_experts_per_tok, text.moe_intermediate_size  # experts are not split by TP
    else:
        copies, inner = 1, text.intermediate_size // tp
    per_token_layer = 2 * (4 * h + q + 2 * kvd + 2 * q + copies * (2 * h + 3 * inner))
    head = HEAD_CHUNK * text.vocab_size * 4 * 2  # float32 logits of a chunk and their gradient
    return per_token_layer * tokens * layers_on_rank + head


def largest_unit_bytes(model) -> int:
    """bf16 bytes of the largest FSDP unit once gathered (one decoder layer, or the embedding / head)."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in language_model(model).layers]
    sizes.append(model.get_input_embeddings().weight.numel())
    return 2 * max(sizes)


def plan(name: str, world: int, tp: int, ep: int, tokens: int) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        config = build_config(name)
        dims = ParallelDims(world, tp=tp, ep=ep)
        dims.check(config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config) if SHAPES[name] != "omni" else \
                transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config)
        use_grouped_experts(model)
        total = sum(p.numel() for p in model.parameters())
        unit = largest_unit_bytes(model)
        if tp > 1:
            apply_tensor_parallel(model, dims)
        if ep > 1:
            apply_expert_parallel(model, dims)
        wrapped = ResponseLogitsModel(model)
        shard_model(wrapped, torch.bfloat16, dims)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in wrapped.parameters())
        layers = config.get_text_config().num_hidden_layers
        state = 4 * local * 4  # float32 parameters, gradients and two AdamW moments
        activations = activation_bytes(config, tokens, tp, layers)
        checkpointed = activation_bytes(config, tokens, tp, 1) + 2 * config.get_text_config().hidden_size * \
            tokens * layers
        return {"model": name, "world": world, "tp": tp, "ep": ep, "dp": dims.dp,
                "parameters_total_b": round(total / 1e9, 2), "parameters_per_gpu_b": round(local / 1e9, 3),
                "weights_grads_adam_gib": round(state / GIB, 1), "fsdp_gather_gib": round(2 * unit / GIB, 1),
                "activations_gib": round(activations / GIB, 1),
                "activations_checkpointed_gib": round(checkpointed / GIB, 1),
                "peak_gib": round((state + 2 * unit + activations) / GIB, 1),
                "peak_checkpointed_gib": round((state + 2 * unit + checkpointed) / GIB, 1)}
    finally:
        dist.destroy_process_group()


def one_gpu_check(measured_gib: float | None, tokens: int) -> dict:
    """The single-process path of `benchmarks/train_gpu.py --shapes 30b-a3b` (4 layers, no FSDP): float32 weights,
    gradients and AdamW plus the bf16 copy of every weight cast once per step, and the activations."""
    config = transformers.CONFIG_MAPPING["qwen3_moe"](**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"})
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    estimate = (16 * total + 2 * total + activation_bytes(config, tokens, 1, config.num_hidden_layers)) / GIB
    check = {"layout": "Qwen3-30B-A3B layer, 4 layers, 1 GPU, no FSDP", "tokens_per_micro_batch": tokens,
             "estimated_peak_gib": round(estimate, 1), "measured_peak_gib": measured_gib}
    if measured_gib:
        check["estimate_over_measured"] = round(estimate / measured_gib, 3)
    return check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="--max-tokens-per-gpu of a micro-batch")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--measured-gib", type=float, default=None,
                        help="peak of `train_gpu.py --shapes 30b-a3b` on one GPU, for the check")
    parser.add_argument("--output", type=Path, default=RESULTS / "parallel_plan.json")
    args = parser.parse_args()
    rows = [plan(name, *layout, args.tokens) for name in args.models.split(",") for layout in LAYOUTS[name]]
    header = ("model", "world", "tp", "ep", "dp", "parameters_per_gpu_b", "weights_grads_adam_gib",
              "activations_gib", "peak_gib", "peak_checkpointed_gib")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[key]) for key in header))
    check = one_gpu_check(args.measured_gib, args.tokens)
    print(json.dumps(check))
    fits = [row for row in rows if row["peak_checkpointed_gib"] <= H200_USABLE_GIB]
    out = {"benchmark": "parallel_plan", "tokens_per_micro_batch": args.tokens, "h200_usable_gib": H200_USABLE_GIB,
           "layouts": len(rows), "layouts_fitting_h200_with_checkpointing": len(fits), "one_gpu_check": check,
           "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
