"""The trainer's layouts on several GPUs of one host: each parallel axis against one GPU, on the same global batch.

Run under torchrun with N processes (N GPUs); every layout that N allows is timed on the same RL-shaped batch
(`benchmarks.train_gpu.rl_batch`): data parallel alone (FSDP2 over N), tensor parallel (``--tensor-model-parallel-size``
2..N, data parallel over the rest) and, for the MoE shape, expert parallel (``--expert-model-parallel-size`` 2..N).
The one-GPU figure is the same script at N = 1 (``--baseline-json`` gives it to a run on N GPUs so the JSON holds
the scaling: tokens/s of the layout / tokens/s of one GPU, and that over N as the efficiency).

    torchrun --nproc-per-node 1 -m benchmarks.parallel_gpu --shape 0.6b --output results/parallel_gpu_1.json
    torchrun --nproc-per-node 8 -m benchmarks.parallel_gpu --shape 30b-a3b \\
        --baseline-json results/parallel_gpu_1.json        # on a host of 8 GPUs
    python -m benchmarks.parallel_gpu --tiny --device cpu    # smoke test (one process, gloo)

Writes ``benchmarks/results/parallel_gpu.json``: per layout seconds per step, tokens/s, MFU on active parameters
(989 TFLOP/s basis) and peak memory per GPU; headline fields at the top level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM

from benchmarks.grpo_step_gpu import active_params
from benchmarks.train_gpu import DATASHEET_TFLOPS, LOSS, SHAPES, release, rl_batch, step_seconds
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.distributed.process_group import ensure_process_group, shutdown_process_group

RESULTS = Path(__file__).resolve().parent / "results"


def layouts(world: int, moe: bool, tied: bool) -> list[dict[str, int]]:
    """Every (tp, ep, pp) that ``world`` processes allow, data parallel alone first (pipeline stages with FSDP over
    the rest; not for a model that ties its embeddings, which pipelining does not take yet)."""
    sizes = [n for n in (2, 4, 8, 16) if n <= world and world % n == 0]
    found = [{"tp": 1, "ep": 1, "pp": 1}] + [{"tp": n, "ep": 1, "pp": 1} for n in sizes]
    if moe:
        found += [{"tp": 1, "ep": n, "pp": 1} for n in sizes]
    if not tied:
        found += [{"tp": 1, "ep": 1, "pp": n} for n in sizes]
    return found


def layout_key(layout: dict[str, int]) -> str:
    return f"tp{layout['tp']}_ep{layout['ep']}" + (f"_pp{layout['pp']}" if layout["pp"] > 1 else "")


def time_layout(model_dir: str, base: TrainSettings, layout: dict[str, int], batch, steps: int) -> dict:
    settings = dataclasses.replace(base, tensor_model_parallel_size=layout["tp"],
                                   expert_model_parallel_size=layout["ep"], pipeline_model_parallel_size=layout["pp"])
    cuda = settings.device.type == "cuda"
    backend = FSDPTrainBackend(model_dir, settings)
    backend.train_step(batch, LOSS)  # warm-up
    times = step_seconds(backend, batch, steps, cuda)
    seconds = sum(times) / len(times)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=settings.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    release(backend, cuda)
    return {"s_per_step": round(seconds, 3), "peak_memory_gib_per_gpu": round(float(peak), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="0.6b", choices=sorted(set(SHAPES) - {"tiny", "tiny-moe"}))
    parser.add_argument("--tiny", action="store_true", help="the tiny MoE shape and batch (smoke test)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--baseline-json", type=Path, default=None, help="this script's JSON from one GPU")
    parser.add_argument("--output", type=Path, default=RESULTS / "parallel_gpu.json")
    args = parser.parse_args()
    name = "tiny-moe" if args.tiny else args.shape
    shape = dict(SHAPES[name])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    ensure_process_group(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    prompt, low, high = (8, 2, 24) if args.tiny else (256, 32, 1024)
    batch = rl_batch(16 if args.tiny else args.samples, prompt, low, high, shape["vocab_size"])
    tokens = sum(len(t) for t in batch.tokens)
    cuda = device.type == "cuda"
    base = TrainSettings(device=device, compute_dtype=torch.bfloat16 if cuda else torch.float32, micro_batch_size=8,
                         temperature=1.0, pad_token_id=0, lr=1e-6, total_optimizer_steps=100,
                         max_tokens_per_gpu=64 if args.tiny else args.max_tokens_per_gpu, fused_optimizer=cuda,
                         gradient_checkpointing=name == "4b")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        config = transformers.CONFIG_MAPPING[shape.get("model_type", "qwen3")](
            **{k: v for k, v in shape.items() if k != "model_type"}, pad_token_id=0, eos_token_id=1,
            bos_token_id=None)
        if rank == 0:
            with torch.device(device):
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
        paths = [str(model_dir)]
        dist.broadcast_object_list(paths, src=0)  # one host: the folder is shared
        dist.barrier()
        for layout in layouts(world, "num_experts" in shape, config.tie_word_embeddings):
            key = layout_key(layout)
            timed = time_layout(paths[0], base, layout, batch, args.steps)
            timed["tokens_per_s"] = round(tokens / timed["s_per_step"])
            timed["mfu_989_per_gpu"] = round(6 * active_params(shape) * tokens / timed["s_per_step"] / world
                                             / (DATASHEET_TFLOPS * 1e12), 4)
            results[key] = timed
            if rank == 0:
                print(name, world, key, json.dumps(timed), flush=True)
        dist.barrier()
    if rank == 0:
        one = json.loads(args.baseline_json.read_text()) if args.baseline_json else None
        one_tps = one["layouts"]["tp1_ep1"]["tokens_per_s"] if one else (results["tp1_ep1"]["tokens_per_s"]
                                                                          if world == 1 else None)
        for timed in results.values():
            if one_tps:
                timed["scaling_vs_one_gpu"] = round(timed["tokens_per_s"] / one_tps, 3)
                timed["efficiency"] = round(timed["scaling_vs_one_gpu"] / world, 3)
        best = max(results.items(), key=lambda item: item[1]["tokens_per_s"])
        out = {"benchmark": "parallel_gpu", "shape": name, "world_size": world,
               "device": torch.cuda.get_device_name() if cuda else "cpu", "best_layout": best[0],
               "best_tokens_per_s": best[1]["tokens_per_s"], "best_scaling_vs_one_gpu": best[1].get(
                   "scaling_vs_one_gpu"), "tokens_per_step": tokens, "layouts": results,
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=2) + "\n")
        print(json.dumps({k: v for k, v in out.items() if k != "layouts"}, indent=2))
    shutdown_process_group()


if __name__ == "__main__":
    main()
