"""FSDP2 across GPUs: a 2-GPU training step equals the 1-GPU step on the same global batch; tokens/s per GPU.

A randomly initialised Qwen3-0.6B-shaped model is trained by `FSDPTrainBackend` (Relax's trainer)
with the PPO-clip loss on one fixed global batch of random sequences, once in one process on one
GPU and once sharded over ``--gpus`` processes (NCCL; each rank trains on its share of the batch
and FSDP reduces the gradients). Two measurements:

- equality: one step in float32 compute (TF32 off) from the same initial weights; the loss and
  gradient norm of the two runs and every parameter after the AdamW step are compared (the largest
  absolute difference, next to the largest change the step made);
- throughput: ``--steps`` timed steps (after one warm-up) in bfloat16 compute with activation
  checkpointing; tokens/s of the whole run and per GPU, and the scaling efficiency
  (per-GPU tokens/s on N GPUs / tokens/s on 1 GPU).

    python -m benchmarks.fsdp_gpu                        # on a 2-GPU machine; writes results/fsdp_gpu.json
    python -m benchmarks.fsdp_gpu --tiny --device cpu    # smoke test of the script (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.grpo_step_gpu import QWEN3_0_6B, TINY
from relax.algorithms.loss import build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.backends.training.base import TrainBatch
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.settings import TrainSettings
from relax.distributed.process_group import free_loopback_port

RESULTS = Path(__file__).resolve().parent / "results"
LOSS = build_policy_loss_fn(PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2,
                                               eps_clip_c=None, aggregation="token-mean"))


def make_batch(num_samples: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> TrainBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (num_samples, prompt_len + response_len), generator=generator).tolist()
    advantages = [torch.randn(response_len, generator=generator) for _ in range(num_samples)]
    return TrainBatch(tokens, [response_len] * num_samples, [[1] * response_len for _ in range(num_samples)],
                      {"advantages": advantages})


def _run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, model_dir: str, mode: str,
              out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    equality = mode == "equality"
    settings = TrainSettings(device=device, compute_dtype=torch.float32 if equality or not cuda else torch.bfloat16,
                             micro_batch_size=args.micro_batch_size, temperature=1.0, pad_token_id=0, lr=1e-5,
                             total_optimizer_steps=100, gradient_checkpointing=not equality)
    backend = FSDPTrainBackend(model_dir, settings)
    shape = TINY if args.tiny else QWEN3_0_6B
    samples = args.equality_samples if equality else args.samples
    batch = make_batch(samples, args.prompt_len, args.response_len, shape["vocab_size"])
    if equality:
        metrics = backend.train_step(batch, LOSS)
        state = backend.full_state_dict()
        if rank == 0:
            torch.save({"metrics": metrics, "state": state}, out)
    else:
        backend.train_step(batch, LOSS)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for _ in range(args.steps):
            backend.train_step(batch, LOSS)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / args.steps
        if rank == 0:
            tokens = samples * (args.prompt_len + args.response_len)
            torch.save({"s_per_step": seconds, "tokens_per_s": tokens / seconds,
                        "tokens_per_s_per_gpu": tokens / seconds / world_size,
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}, out)
    torch.distributed.destroy_process_group()


def launch(world_size: int, args: argparse.Namespace, model_dir: str, mode: str, out: str) -> dict:
    mp.start_processes(_run_rank, args=(world_size, free_loopback_port(), args, model_dir, mode, out),
                       nprocs=world_size, join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


def compare(single: dict, sharded: dict, initial: dict[str, torch.Tensor]) -> dict:
    """Largest parameter difference between the two runs, beside the largest change one step made."""
    max_diff = max_change = 0.0
    worst = ""
    for name, tensor in single["state"].items():
        diff = (sharded["state"][name].float() - tensor.float()).abs().max().item()
        if diff > max_diff:
            max_diff, worst = diff, name
        if name in initial:
            max_change = max(max_change, (tensor.float() - initial[name].float()).abs().max().item())
    metrics = {key: {"one_gpu": single["metrics"][key], "sharded": sharded["metrics"][key],
                     "abs_diff": abs(single["metrics"][key] - sharded["metrics"][key])}
               for key in ("loss", "pg_loss", "grad_norm") if key in single["metrics"]}
    return {"max_abs_param_diff": max_diff, "worst_param": worst, "max_abs_param_change_of_the_step": max_change,
            "metrics": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the sharded run")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--samples", type=int, default=32, help="sequences per global batch (throughput)")
    parser.add_argument("--equality-samples", type=int, default=8, help="sequences per global batch (equality)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=768)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS / "fsdp_gpu.json")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    shape = TINY if args.tiny else QWEN3_0_6B
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=None))
        model.save_pretrained(model_dir)
        initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        del model
        single = launch(1, args, str(model_dir), "equality", f"{tmp}/single.pt")
        sharded = launch(args.gpus, args, str(model_dir), "equality", f"{tmp}/sharded.pt")
        equality = compare(single, sharded, initial)
        del single, sharded, initial
        one = launch(1, args, str(model_dir), "throughput", f"{tmp}/one.pt")
        many = launch(args.gpus, args, str(model_dir), "throughput", f"{tmp}/many.pt")
    result = {
        "benchmark": "fsdp_gpu",
        "model": "tiny Qwen3" if args.tiny else "Qwen3-0.6B shape, random init",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": args.gpus,
        "equality": {"compute_dtype": "float32 (TF32 off)", "global_batch": args.equality_samples,
                     "prompt_len": args.prompt_len, "response_len": args.response_len, **equality},
        "throughput": {"compute_dtype": "bfloat16" if args.device == "cuda" else "float32",
                       "gradient_checkpointing": True, "global_batch": args.samples,
                       "tokens_per_step": args.samples * (args.prompt_len + args.response_len),
                       "micro_batch_size": args.micro_batch_size, "timed_steps": args.steps,
                       "one_gpu": one, f"{args.gpus}_gpus": many,
                       "speedup": one["s_per_step"] / many["s_per_step"],
                       "scaling_efficiency": many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]},
        "total_s": time.perf_counter() - started,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"equality: max |param diff| {equality['max_abs_param_diff']:.3g} (the step moved params by up to "
          f"{equality['max_abs_param_change_of_the_step']:.3g}); throughput: {args.gpus} GPUs "
          f"{result['throughput']['speedup']:.2f}x one GPU, {many['tokens_per_s_per_gpu']:.0f} tokens/s per GPU")


if __name__ == "__main__":
    main()
