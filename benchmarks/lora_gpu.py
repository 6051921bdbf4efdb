"""GPU memory and speed of a LoRA training step beside a full one (issue 18), on the same RL-shaped batches.

A randomly initialised Qwen3-4B-shaped model is trained by `FSDPTrainBackend` (bf16 compute, packed token-budget
micro-batches, the trainer's fast path of `benchmarks/train_gpu.py`) twice, one after the other in one process:
full fine-tuning (float32 master weights, gradients and AdamW state for every weight) and LoRA rank 16 on every
linear layer (peft; only the adapters have gradients and optimizer state). Peak memory is
`torch.cuda.max_memory_allocated` over the timed steps. Writes ``benchmarks/results/lora_gpu.json`` with
``full_peak_gib``, ``lora_peak_gib``, ``memory_ratio`` and both step times at the top.

    python -m benchmarks.lora_gpu                           # on the H200
    python -m benchmarks.lora_gpu --tiny --device cpu       # smoke test of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.train_gpu import DEFAULT_BUDGET, SHAPES, rl_batch, run_variant
from relax.backends.training.lora import LoraSettings
from relax.backends.training.settings import TrainSettings

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="4b", choices=["0.6b", "4b"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke test)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--output", type=Path, default=RESULTS / "lora_gpu.json")
    args = parser.parse_args()
    name = "tiny" if args.tiny else args.shape
    shape = SHAPES[name]
    cuda = args.device == "cuda"
    samples, prompt_len, max_response = (8, 8, 24) if args.tiny else (args.samples, 256, 1024)
    batch = rl_batch(samples, prompt_len, min(32, max_response), max_response, shape["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / name
        torch.manual_seed(0)
        with torch.device(args.device):  # initialises in seconds on the GPU
            model = Qwen3ForCausalLM(Qwen3Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None))
        num_params = sum(p.numel() for p in model.parameters())
        model.to(torch.bfloat16).save_pretrained(model_dir)
        del model
        if cuda:
            torch.cuda.empty_cache()
        base = TrainSettings(device=torch.device("cuda", 0) if cuda else torch.device("cpu"),
                             compute_dtype=torch.bfloat16 if cuda else torch.float32, micro_batch_size=4,
                             temperature=1.0, pad_token_id=0, lr=1e-6, total_optimizer_steps=100,
                             max_tokens_per_gpu=DEFAULT_BUDGET[name], liger_kernel=cuda, fused_optimizer=cuda)
        lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, target_modules=("all-linear",))
        results = {}
        for variant, settings in (("full", base), ("lora", dataclasses.replace(base, lora=lora))):
            # the forward of a full step (a LoRA step adds the adapters' small products): FLOPs counted alike
            results[variant] = run_variant(model_dir, settings, batch, args.steps, num_params)
            print(variant, json.dumps(results[variant]), flush=True)
    out = {
        "benchmark": "lora_gpu",
        "full_peak_gib": results["full"]["peak_memory_gib"], "lora_peak_gib": results["lora"]["peak_memory_gib"],
        "memory_ratio": (round(results["lora"]["peak_memory_gib"] / results["full"]["peak_memory_gib"], 3)
                         if cuda else None),
        "full_s_per_step": results["full"]["s_per_step"], "lora_s_per_step": results["lora"]["s_per_step"],
        "model": f"Qwen3-{name.upper()} shape, random init", "parameters": num_params,
        "lora": {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"},
        "batch": {"samples": samples, "prompt_len": prompt_len, "response_len": f"U[{min(32, max_response)}, "
                  f"{max_response}]", "tokens": sum(len(t) for t in batch.tokens)},
        "device": torch.cuda.get_device_name() if cuda else "cpu", "variants": results,
        "command": "python -m benchmarks.lora_gpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
