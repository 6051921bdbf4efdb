"""The trainer's speed on RL-shaped batches: the previous path beside the new one, on the same batches.

A randomly initialised Qwen3-shaped model (0.6B and/or 4B) is trained by `FSDPTrainBackend` with the PPO-clip
loss on one GPU. A batch is 256 sequences of a 256-token prompt and a response whose length is drawn (fixed
seed) uniformly between 32 and 1024 tokens, as RL responses vary. Two trainer settings run on the same batch:

- ``previous``: right-padded micro-batches of ``--micro-batch-size`` samples and full float32 logits (the path
  before sequence packing: ``--no-sequence-packing --log-probs-chunk-size 0``), float32 parameters under
  autocast, foreach AdamW;
- ``packed``: packed micro-batches of at most ``--max-tokens-per-gpu`` tokens (``--use-dynamic-batch-size``),
  FlashAttention varlen, the LM head in chunks of 4096 tokens with one-pass Triton kernels over each chunk's
  logits, inputs staged through pinned memory (no host synchronization inside the micro-batch loop),
  liger-kernel's RMSNorm/SwiGLU/RoPE, fused AdamW, float32 weights cast to bf16 once per step and weight
  gradients summed in float32 by the GEMMs (gradient-accumulation fusion, `relax/backends/training/master_weights.py`)
  (``--fsdp``: bf16 parameters through FSDP2's mixed precision instead of float32 ones under autocast);
- ``packed_keep_logits`` (named in ``--variants``): ``packed`` with ``--log-probs-keep-logits on``, each head chunk's
  logits kept from the forward for the backward instead of recomputed there (``keep_logits_speedup`` over
  ``packed``);
- ``packed_qk_separate`` and ``packed_qk_separate_keep_logits``: ``packed`` (with kept logits) with Qwen3's per-head
  query/key norms and the RoPE after them as three kernels each way instead of one compiled kernel
  (`relax/backends/training/fused_qk_rope.py`; ``fused_qk_speedup[_keep_logits]``: the fused path over them);
- ``packed_keep_logits_unshared``: ``packed_keep_logits`` with the input gradient of the projections of one input
  added by autograd instead of inside their GEMMs (``shared_input_linears_speedup``: the shared path over it).

For each: seconds per optimizer step (after ``--warmup-steps`` untimed ones; each timed step's too), real (unpadded) tokens/s, model FLOP/s counted as
6 * parameters * tokens, MFU against the H200's dense bf16 datasheet figure (989 TFLOP/s, what the field quotes)
and against what the card measures on bf16 matrix products (~790 TFLOP/s), and peak memory; then the speedup.
Writes ``benchmarks/results/train_gpu.json``.

    python -m benchmarks.train_gpu                       # both shapes on the H200
    python -m benchmarks.train_gpu --shapes 0.6b --steps 1
    python -m benchmarks.train_gpu --tiny --device cpu   # smoke test of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

from benchmarks.grpo_step_gpu import QWEN3_0_6B, QWEN3_4B, QWEN3_30B_A3B, TINY, active_params
from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.distributed.process_group import barrier

RESULTS = Path(__file__).resolve().parent / "results"
DATASHEET_TFLOPS = 989.0
MEASURED_TFLOPS = 790.0
TINY_MOE = dict(TINY, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True)
SHAPES = {"0.6b": QWEN3_0_6B, "4b": QWEN3_4B, "30b-a3b": QWEN3_30B_A3B, "tiny": TINY, "tiny-moe": TINY_MOE}
DEFAULT_BUDGET = {"0.6b": 32768, "4b": 8192, "30b-a3b": 16384, "tiny": 64, "tiny-moe": 64}
LOSS = build_policy_loss_fn(PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.28,
                                               eps_clip_c=None, aggregation="token-mean"))


def rl_batch(num_samples: int, prompt_len: int, min_response: int, max_response: int, vocab: int,
             seed: int = 0) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_response, max_response + 1, (num_samples,), generator=generator).tolist()
    tokens = [torch.randint(2, vocab, (prompt_len + n,), generator=generator).tolist() for n in lengths]
    fields = {"advantages": [torch.randn(n, generator=generator) for n in lengths],
              "old_log_probs": [-torch.rand(n, generator=generator) for n in lengths]}
    return TrainBatch(tokens, lengths, [[1] * n for n in lengths], fields)


def profile_step(backend: FSDPTrainBackend, batch: TrainBatch, rows: int = 30, stacks: bool = False) -> dict:
    """One step under the torch profiler: the kernels by total CUDA time, and how busy the GPU was (``stacks``: also
    the copies by the Python lines that made them)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    # verbose: the operators get their Python stacks (PyTorch 2.11+ records none without it)
    config = torch._C._profiler._ExperimentalConfig(verbose=True) if stacks else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=stacks,
                 experimental_config=config) as prof:
        backend.train_step(batch, LOSS)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    if stacks:
        copies = [e for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=8) if e.key in ("aten::copy_", "aten::clone",
                                                                               "aten::contiguous", "aten::to")]
        for event in sorted(copies, key=lambda e: -e.device_time_total)[:12]:
            print(f"{event.key} {event.device_time_total / 1e3:.1f} ms, {event.count} calls, shapes "
                  f"{event.input_shapes}", flush=True)
            print("    " + "\n    ".join(event.stack[:8]), flush=True)
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70), flush=True)
    # the same operators by input shape: which tensors the copies and elementwise passes are made of
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=rows,
                                                             max_name_column_width=40, max_shapes_column_width=90),
          flush=True)
    # the kernels' own rows: an operator's row repeats its kernels' device time (summing both counted it twice)
    kernel_s = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return {"profiled_wall_s": round(wall, 3), "kernel_s": round(kernel_s, 3),
            "gpu_busy": round(kernel_s / wall, 3)}


def step_seconds(backend: FSDPTrainBackend, batch: TrainBatch, steps: int, cuda: bool) -> list[float]:
    """The time of each of ``steps`` training steps, the peak-memory counter reset before them and every rank
    starting together (the backend has taken its warm-up steps). A step ends with the host reading its metrics, so
    timing each one adds no synchronisation."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    barrier()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        backend.train_step(batch, LOSS)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def release(backend: FSDPTrainBackend, cuda: bool) -> None:
    """Free the backend's memory before the next variant builds its own."""
    backend.release()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_variant(model_dir: Path, settings: TrainSettings, batch: TrainBatch, steps: int, num_params: int,
                profile: str | None = None, warmup_steps: int = 1) -> dict:
    cuda = settings.device.type == "cuda"
    backend = FSDPTrainBackend(model_dir, settings)
    for _ in range(warmup_steps):  # allocator, kernels' autotuning and compilation
        backend.train_step(batch, LOSS)
    profiled = profile_step(backend, batch, stacks=profile == "stacks") if profile and cuda else {}
    times = step_seconds(backend, batch, steps, cuda)
    seconds = sum(times) / len(times)
    tokens = sum(len(t) for t in batch.tokens)
    flops = 6 * num_params * tokens / seconds
    result = {
        "s_per_step": round(seconds, 3), "step_seconds": [round(t, 3) for t in times], "tokens_per_step": tokens, "tokens_per_s": round(tokens / seconds),
        "model_tflops": round(flops / 1e12, 1),
        "mfu_989": round(flops / (DATASHEET_TFLOPS * 1e12), 4), "mfu_790": round(flops / (MEASURED_TFLOPS * 1e12), 4),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        **profiled,
    }
    release(backend, cuda)
    return result


def bench_shape(name: str, args: argparse.Namespace, root: Path) -> dict:
    shape = dict(SHAPES[name])
    if "num_experts" in shape:
        shape["num_hidden_layers"] = args.moe_layers or shape["num_hidden_layers"]
    model_dir = root / name
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING[shape.get("model_type", "qwen3")](
        **{k: v for k, v in shape.items() if k != "model_type"}, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    with torch.device(device):  # a few billion parameters initialise in seconds on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(model_dir)
    # what a token goes through (a MoE layer counts its chosen experts): the FLOPs that MFU counts
    num_params = active_params(shape)
    del model
    batch = rl_batch(args.samples, args.prompt_len, args.min_response, args.max_response, shape["vocab_size"])
    cuda = device.type == "cuda"
    base = TrainSettings(device=device, compute_dtype=torch.bfloat16 if cuda else torch.float32,
                         micro_batch_size=args.micro_batch_size or (4 if name == "4b" else 8), temperature=1.0,
                         pad_token_id=0, lr=1e-6, total_optimizer_steps=100,
                         gradient_checkpointing=name == "4b" or args.checkpointing)
    variants = {
        "previous": dataclasses.replace(base, sequence_packing=False, log_probs_chunk_size=0, fused_optimizer=False,
                                        fsdp_single_process=False, liger_kernel=False,
                                        gradient_accumulation_fusion=False, moe_grouped_gemm=False),
        # today's packed trainer with transformers' own experts (float32 expert GEMMs under the master weights)
        "hf_experts": dataclasses.replace(base, max_tokens_per_gpu=args.max_tokens_per_gpu or DEFAULT_BUDGET[name],
                                          fused_optimizer=cuda, log_probs_chunk_size=args.log_probs_chunk_size,
                                          liger_kernel=cuda and not args.no_liger, moe_grouped_gemm=False),
        "packed": dataclasses.replace(base, max_tokens_per_gpu=args.max_tokens_per_gpu or DEFAULT_BUDGET[name],
                                      fused_optimizer=cuda,
                                      log_probs_chunk_size=args.log_probs_chunk_size,
                                      gradient_checkpointing=base.gradient_checkpointing and not args.no_checkpointing,
                                      liger_kernel=cuda and not args.no_liger, fsdp_single_process=args.fsdp),
    }
    # the packed trainer with the LM head's chunk logits kept for the backward (one head matmul a chunk less)
    variants["packed_keep_logits"] = dataclasses.replace(variants["packed"], log_probs_keep_logits=True)
    # the packed trainer with Qwen3's query/key norms and RoPE as three kernels each way (the path before
    # `fused_qk_rope`), with and without kept logits
    variants["packed_qk_separate"] = dataclasses.replace(variants["packed"], fused_qk_norm_rope=False)
    variants["packed_qk_separate_keep_logits"] = dataclasses.replace(variants["packed_qk_separate"],
                                                                     log_probs_keep_logits=True)
    # kept logits, the projections of one input each adding its input gradient by autograd (the path before
    # `master_weights.shared_input_linears`)
    variants["packed_keep_logits_unshared"] = dataclasses.replace(variants["packed_keep_logits"],
                                                                  shared_input_linears=False)
    # the packed trainer before the compiled RMSNorms and the grouped-query attention without repeated keys/values
    variants["packed_kernels_before"] = dataclasses.replace(variants["packed"], rms_norm_kernel="liger",
                                                            attention_repeat_kv=True,
                                                            activations_in_compute_dtype=False)
    results = {}
    unknown = set(args.variants.split(",")) - set(variants)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {', '.join(variants)}")
    for variant in dict.fromkeys(args.variants.split(",")):  # in the order given (the first runs on a cold card)
        settings = variants[variant]
        results[variant] = {"settings": {"sequence_packing": settings.sequence_packing,
                                         "log_probs_chunk_size": settings.log_probs_chunk_size,
                                         "log_probs_keep_logits": settings.log_probs_keep_logits,
                                         "micro_batch_size": None if settings.max_tokens_per_gpu else
                                         settings.micro_batch_size,
                                         "max_tokens_per_gpu": settings.max_tokens_per_gpu,
                                         "gradient_checkpointing": settings.gradient_checkpointing,
                                         "fused_optimizer": settings.fused_optimizer,
                                         "liger_kernel": settings.liger_kernel,
                                         "gradient_accumulation_fusion": settings.gradient_accumulation_fusion,
                                         "bf16_parameters_fsdp": settings.fsdp_single_process and cuda,
                                         "moe_grouped_gemm": settings.moe_grouped_gemm,
                                         "rms_norm_kernel": settings.rms_norm_kernel,
                                         "fused_qk_norm_rope": settings.fused_qk_norm_rope,
                                         "shared_input_linears": settings.shared_input_linears,
                                         "attention_repeat_kv": settings.attention_repeat_kv,
                                         "activations_in_compute_dtype": settings.activations_in_compute_dtype},
                            **run_variant(model_dir, settings, batch, args.steps, num_params, args.profile,
                                          args.warmup_steps)}
        print(name, variant, json.dumps(results[variant]), flush=True)
    lengths = batch.response_lengths
    return {"parameters": num_params, "batch": {"samples": len(batch), "prompt_len": args.prompt_len,
                                                "response_len_min": min(lengths), "response_len_max": max(lengths),
                                                "response_len_mean": sum(lengths) / len(lengths)},
            **results, **{f"speedup_over_{base}": round(results[base]["s_per_step"] / results["packed"]["s_per_step"], 2)
                          for base in ("previous", "hf_experts", "packed_kernels_before")
                          if base in results and "packed" in results},
            **({"keep_logits_speedup": round(results["packed"]["s_per_step"]
                                             / results["packed_keep_logits"]["s_per_step"], 3)}
               if "packed" in results and "packed_keep_logits" in results else {}),
            **{f"fused_qk_speedup{suffix}": round(results[f"packed_qk_separate{suffix}"]["s_per_step"]
                                                  / results[f"packed{suffix}"]["s_per_step"], 3)
               for suffix in ("", "_keep_logits")
               if f"packed{suffix}" in results and f"packed_qk_separate{suffix}" in results},
            **({"shared_input_linears_speedup": round(results["packed_keep_logits_unshared"]["s_per_step"]
                                                      / results["packed_keep_logits"]["s_per_step"], 3)}
               if "packed_keep_logits" in results and "packed_keep_logits_unshared" in results else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shapes", default="0.6b,4b", help="comma-separated: 0.6b, 4b, 30b-a3b")
    parser.add_argument("--moe-layers", type=int, default=None, help="layers of the 30b-a3b shape (default 4)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke test)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--min-response", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="previous path (default 8; 4 for 4b)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None,
                        help="packed path's micro-batch budget (default: 32768 for 0.6b, 8192 for 4b, whose float32 "
                             "weights and AdamW state take 64 GiB)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing on 0.6b too")
    parser.add_argument("--no-checkpointing", action="store_true", help="packed path without checkpointing on 4b")
    parser.add_argument("--variants", default="previous,packed",
                        help="comma-separated: previous, hf_experts (MoE: the packed trainer with transformers' own "
                             "experts, the path before grouped_experts), packed_kernels_before (packed with "
                             "liger's RMSNorm, keys/values repeated for grouped-query attention and a float32 "
                             "residual stream), packed, packed_keep_logits (packed with --log-probs-keep-logits on), "
                             "packed_qk_separate[_keep_logits] (Qwen3's query/key norms and RoPE unfused), "
                             "packed_keep_logits_unshared (projections' input gradients added by autograd)")
    parser.add_argument("--no-liger", action="store_true", help="packed path without liger-kernel's kernels")
    parser.add_argument("--log-probs-chunk-size", type=int, default=4096, help="packed path's LM-head chunk")
    parser.add_argument("--fsdp", action="store_true",
                        help="packed path with FSDP2's bf16 parameters at one process instead of float32 ones under "
                             "autocast (TrainSettings.fsdp_single_process)")
    parser.add_argument("--profile", nargs="?", const="tables", choices=["tables", "stacks"], default=None,
                        help="print torch-profiler tables of one step per variant (stacks: also the copies by the "
                             "Python lines that made them)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant (after the warm-up)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="untimed steps per variant before them")
    parser.add_argument("--output", type=Path, default=RESULTS / "train_gpu.json")
    args = parser.parse_args()
    shapes = ["tiny", "tiny-moe"] if args.tiny else args.shapes.split(",")
    if args.tiny:
        args.samples, args.prompt_len, args.min_response, args.max_response = 16, 8, 2, 24
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        per_shape = {name: bench_shape(name, args, Path(tmp)) for name in shapes}
    headline = {f"{name}_{key}": value for name, result in per_shape.items()
                for key, value in (("speedup", result.get("speedup_over_previous")),
                                   ("speedup_over_hf_experts", result.get("speedup_over_hf_experts")),
                                   ("speedup_over_kernels_before", result.get("speedup_over_packed_kernels_before")),
                                   ("mfu_989", result.get("packed", {}).get("mfu_989")),
                                   ("keep_logits_mfu_989", result.get("packed_keep_logits", {}).get("mfu_989")),
                                   ("keep_logits_speedup", result.get("keep_logits_speedup")),
                                   ("fused_qk_speedup", result.get("fused_qk_speedup")),
                                   ("fused_qk_speedup_keep_logits", result.get("fused_qk_speedup_keep_logits")),
                                   ("shared_input_linears_speedup", result.get("shared_input_linears_speedup")),
                                   ("tokens_per_s", result.get("packed", {}).get("tokens_per_s")))}
    out = {
        "benchmark": "train_gpu", **headline,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "shapes": per_shape, "timed_steps": args.steps, "total_s": round(time.perf_counter() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(headline, indent=2))


if __name__ == "__main__":
    main()
