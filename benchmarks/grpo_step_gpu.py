"""One colocated GRPO step on a GPU, in-process (no Ray), beside plain `model.generate`.

A randomly initialised Qwen3-0.6B-shaped model (bf16 inference and forward, fp32 master
weights) runs Relax's real loop (`SyncController.train_step`: embedded-engine rollout, reward,
advantages, FSDP2 training, weight sync) on random prompts; every response is exactly
``--new-tokens`` long (EOS ignored) so both generators do the same work. Writes
``benchmarks/results/grpo_step_gpu.json`` with rollout tokens/s, training tokens/s, seconds per
step and peak GPU memory, and prints the ratio of the engine's rollout throughput to
`model.generate` on the same prompts.

    python -m benchmarks.grpo_step_gpu                 # on the H200
    python -m benchmarks.grpo_step_gpu --tiny --device cpu   # smoke test of the script itself

``--compare-overlap`` runs instead, on RL-like response lengths (each sample's length drawn from a log-normal
with mean ``--mean-response-len``, capped at ``--new-tokens``; fixed seeds, so both runs see the same lengths),
``relax train`` three times in processes of their own on the same workspace: the synchronous loop (``--colocate``
with ``--colocate``), the overlapped ``--colocate-async``, and the overlapped mode with partial rollout across steps
(``--partial-rollout --over-sampling-batch-size`` ``--over-sampling`` x the prompts, ``--max-staleness`` 2: each step
takes the first groups to finish, the stragglers go on into the next), ``--steps`` steps each, and writes seconds
per step, the ratios to sync and the peak memory per phase to ``benchmarks/results/grpo_step_overlap_gpu.json``:

    python -m benchmarks.grpo_step_gpu --compare-overlap --steps 20 --mean-response-len 256 --new-tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from relax.config import RelaxConfig
from relax.core.build import build_roles
from relax.core.loops.sync import SyncController
from relax.core.placement.in_process import InProcessPlacement
from relax.telemetry.tracking import Tracker

RESULTS = Path(__file__).resolve().parent / "results"

QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                  tie_word_embeddings=True)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=True)
# Qwen3-30B-A3B's layer (128 experts, 8 per token) with fewer layers (--layers, default 4): 3.1B parameters
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=4096, tie_word_embeddings=False)
SHAPES = {"0.6b": QWEN3_0_6B, "4b": QWEN3_4B, "30b-a3b": QWEN3_30B_A3B}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)


def parity_reward(args, sample) -> float:
    """A cheap dense reward: the share of even token ids in the response."""
    response = sample.tokens[sample.prompt_length:]
    return sum(token % 2 == 0 for token in response) / max(len(response), 1)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer whose token i (from 2) is the word ``t<i>``, so prompts can be written as text;
    0 and 1 are pad and EOS (named so that no word contains them)."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def build_workspace(root: Path, shape: dict, num_prompts: int, prompt_len: int,
                    device: str = "cpu", mean_response_len: int | None = None,
                    reuse_model: bool = False) -> tuple[Path, Path]:
    """A random model of ``shape`` with its tokenizer, and ``num_prompts`` random prompts. ``mean_response_len``:
    responses end at varied lengths about that long on average (`end_responses_early`), as RL responses do,
    instead of running to the length limit (a random model almost never samples EOS). ``reuse_model``: a model
    that an earlier call left in ``root`` for the same shape is kept (a 4B one takes a minute to write)."""
    model_dir, data = root / "model", root / "prompts.jsonl"
    # what the weights depend on (the EOS calibration reads prompts of prompt_len; the seed draws per device)
    recipe = json.dumps({"shape": shape, "mean_response_len": mean_response_len, "prompt_len": prompt_len,
                         "device": device}, sort_keys=True)
    if reuse_model and (root / "model.json").is_file() and (root / "model.json").read_text() == recipe:
        write_prompts(data, shape["vocab_size"], num_prompts, prompt_len)
        return model_dir, data
    torch.manual_seed(0)
    shape = dict(shape)
    config = transformers.CONFIG_MAPPING[shape.pop("model_type", "qwen3")](**shape, pad_token_id=0, eos_token_id=1,
                                                                            bos_token_id=None)
    with torch.device(device):  # a few billion parameters initialise in seconds on the GPU, minutes on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if mean_response_len:
            end_responses_early(model, eos_id=1, mean_response_len=mean_response_len, prompt_len=prompt_len)
        model.save_pretrained(model_dir)
        del model
    if device == "cuda":  # the runs are processes of their own: the cache must not keep the model's memory here
        torch.cuda.empty_cache()
    word_tokenizer(shape["vocab_size"]).save_pretrained(model_dir)
    (root / "model.json").write_text(recipe)
    write_prompts(data, shape["vocab_size"], num_prompts, prompt_len)
    return model_dir, data


def write_prompts(data: Path, vocab_size: int, num_prompts: int, prompt_len: int) -> None:
    generator = torch.Generator().manual_seed(1)
    with data.open("w") as handle:
        for _ in range(num_prompts):
            ids = torch.randint(2, vocab_size, (prompt_len,), generator=generator).tolist()
            handle.write(json.dumps({"input": " ".join(f"t{i}" for i in ids), "label": ""}) + "\n")


@torch.no_grad()
def end_responses_early(model, eos_id: int, mean_response_len: int, prompt_len: int) -> None:
    """Give EOS a direction of its own in the LM head, scaled so that a sampled token is EOS with probability about
    ``1 / mean_response_len``: response lengths then spread geometrically, so a step's groups finish one after the
    other. Calibrated on the final hidden states of random prompts: EOS wins when its logit exceeds the log of the
    vocabulary's total mass, ``ln V`` for near-uniform logits."""
    head = model.get_output_embeddings().weight
    vocab = head.shape[0]
    generator = torch.Generator(device=head.device).manual_seed(2)
    ids = torch.randint(2, vocab, (4, prompt_len), generator=generator, device=head.device)
    hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1).float()
    direction = torch.randn(head.shape[1], generator=generator, device=head.device)
    direction /= direction.norm()
    projections = hidden @ direction
    threshold = torch.quantile(projections, 1.0 - 1.0 / mean_response_len)
    head[eos_id] = (math.log(vocab) / threshold * direction).to(head.dtype)


LENGTH_SIGMA = 1.2  # the log-normal's spread: with a mean of 256 about 1% of responses reach 2,048 tokens


def response_length(key: str, mean: float, cap: int) -> int:
    """A response length drawn from a log-normal of mean ``mean`` (before the cap), seeded by ``key``: RL responses
    are mostly short with a long tail that sets the rollout's time while the batch thins out."""
    import random

    draw = random.Random(key).gauss(math.log(mean) - LENGTH_SIGMA ** 2 / 2, LENGTH_SIGMA)
    return max(1, min(cap, math.ceil(math.exp(draw))))


async def rl_lengths_generate(args, sample, sampling_params):
    """A per-sample generate function (``--custom-generate-function-path``) that decodes each sample to its
    `response_length` (EOS ignored; the mean from ``$RELAX_BENCH_MEAN_RESPONSE_LEN``, the cap
    ``--rollout-max-response-len``), keyed by the sample's seed: the same lengths in every run of one config."""
    import os

    from relax.backends.inference.base import GenerationRequest
    from relax.rollout.generation.generate import apply_output

    key = f"{sampling_params.seed}-{sample.group_index}-{sample.index}"
    length = response_length(key, float(os.environ["RELAX_BENCH_MEAN_RESPONSE_LEN"]), args.rollout_max_response_len)
    request = GenerationRequest(request_id=f"bench-{key}", input_ids=list(sample.tokens),
                                sampling_params=replace(sampling_params, max_new_tokens=length, ignore_eos=True))
    (output,) = await args.engine.generate([request])
    apply_output(sample, output)
    return sample


def compare_overlap(args) -> None:
    """Sync against ``--colocate-async`` on the RL-like lengths (module doc), each in a `relax train` process."""
    from benchmarks.modes_gpu import environment, run
    from benchmarks.modes_learning_gpu import mode_flags

    shape = dict(TINY if args.tiny else SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    warmup = 2 if args.steps > 4 else 1
    modes = mode_flags(args.prompts, args.over_sampling, args.carry_max_staleness)
    if args.colocate:  # sync with the trainer and the engine taking turns on the GPU (the 4B shape's memory)
        modes["sync"] = ["--colocate"]
    modes = {mode: modes[mode] for mode in args.modes}  # in the order asked
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if args.work_dir is None else args.work_dir
        root.mkdir(parents=True, exist_ok=True)
        model_dir, data = build_workspace(root, shape, args.prompts * args.steps, args.prompt_len, args.device,
                                          reuse_model=args.work_dir is not None)
        env = {**environment(""), "RELAX_BENCH_MEAN_RESPONSE_LEN": str(args.mean_response_len)}
        for mode, flags in modes.items():
            out = root / mode
            if mode in args.measured:  # run by an earlier call in this --work-dir: read, not rerun
                results[mode] = mode_summary(args, out, warmup)
                print(mode, "(measured earlier)", json.dumps(results[mode]), flush=True)
                report = overlap_report(args, results, modes, warmup)
                continue
            command = [sys.executable, "-m", "relax.cli.main", "train", "--hf-checkpoint", str(model_dir),
                       "--prompt-data", str(data), "--input-key", "input", "--label-key", "label",
                       "--custom-rm-path", "benchmarks.grpo_step_gpu:parity_reward",
                       "--custom-generate-function-path", "benchmarks.grpo_step_gpu:rl_lengths_generate",
                       "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt",
                       str(args.samples_per_prompt), "--rollout-max-response-len", str(args.new_tokens),
                       "--rollout-max-prompt-len", str(args.prompt_len), "--lr", "1e-6", "--rollout-seed", "1",
                       "--num-rollout", str(args.steps), "--device", args.device, "--use-dynamic-batch-size",
                       "--max-tokens-per-gpu", str(args.max_tokens_per_gpu), "--use-tis",
                       "--save-interval", str(10 * args.steps), "--dump-samples", "0", "--no-use-tensorboard",
                       "--skip-eval-before-train", "--output-dir", str(out), *flags,
                       *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
                       *(["--mem-fraction-static", str(args.mem_fraction_static)] if args.mem_fraction_static else [])]
            try:
                run(command, env, mode, timeout=args.mode_timeout)
            except subprocess.TimeoutExpired:  # keep what it measured: the steps it finished
                print(f"{mode}: stopped after {args.mode_timeout:g} s (--mode-timeout)", flush=True)
            except SystemExit as failure:  # a failed run (out of memory, say) still leaves the others to run
                print(failure, flush=True)
            results[mode] = mode_summary(args, out, warmup)
            if results[mode].get("unfinished"):
                print(mode, "finished no measured step", json.dumps(results[mode]["rows"])[-3000:], flush=True)
            else:
                print(mode, json.dumps(results[mode]), flush=True)
            report = overlap_report(args, results, modes, warmup)  # after each mode: a call cut short keeps it
    for mode in results:
        if mode != "sync" and "sync" in results:
            print(f"{mode}: {report[f'{mode}_s_per_step']} s/step against sync {report['sync_s_per_step']} -> "
                  f"{report[f'{mode}_speedup']}x")


def mode_summary(args, out: Path, warmup: int) -> dict:
    """One mode's seconds per step, peak memory per phase and trained groups, from its run directory's metrics."""
    from benchmarks.modes_gpu import summarize

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    if len([row for row in rows if "perf/step_s" in row]) <= warmup:
        return {"s_per_step": float("nan"), "unfinished": True, "rows": rows[-3:]}
    summary = summarize(out, warmup)
    summary["peak_gib"] = {key.removeprefix("perf/gpu_peak_gib_"): max(r[key] for r in rows if key in r)
                           for key in sorted({k for r in rows for k in r if k.startswith("perf/gpu_peak")})}
    summary["response_length_mean"] = statistics.fmean(r["rollout/response_length_mean"] for r in rows
                                                       if "rollout/response_length_mean" in r)
    summary["response_length_max"] = max(r["rollout/response_length_max"] for r in rows
                                         if "rollout/response_length_max" in r)
    # What partial rollout across steps carried and what the staleness bound dropped (all steps).
    summary["carried_groups"] = sum(r.get("rollout/carried_groups", 0) for r in rows)
    summary["dropped_stale_groups"] = sum(r.get("data/dropped_stale_groups", 0) for r in rows)
    # Steps per second flatter a mode that drops groups (stale stragglers): the work trained per second too.
    # (The sync loop has no data plane to count them: it trains every prompt of its step.)
    steps = [r for r in rows if "perf/step_s" in r]
    summary["trained_groups"] = sum(r.get("data/consumed_groups", args.prompts) for r in steps)
    summary["trained_groups_per_s"] = sum(r.get("data/consumed_groups", args.prompts)
                                          for r in steps[warmup:]) / sum(r["perf/step_s"] for r in steps[warmup:])
    return summary


def overlap_report(args, results: dict, modes: dict[str, list[str]], warmup: int) -> dict:
    """The comparison's JSON from the modes measured so far, written to ``--output``."""
    report = {
        "benchmark": "grpo_step_gpu --compare-overlap",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "model": f"Qwen3-{args.shape.upper()} shape, random init" if not args.tiny else "tiny Qwen3",
        **{f"{mode}_s_per_step": round(result["s_per_step"], 3) for mode, result in results.items()},
        **{f"{mode}_speedup": round(results["sync"]["s_per_step"] / result["s_per_step"], 3)
           for mode, result in results.items() if mode != "sync" and "sync" in results},
        **{f"{mode}_trained_groups_speedup": round(result["trained_groups_per_s"]
                                                   / results["sync"]["trained_groups_per_s"], 3)
           for mode, result in results.items()
           if mode != "sync" and "trained_groups_per_s" in result and "trained_groups_per_s" in results.get("sync", {})},
        "details": results,
        "config": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                   "prompt_len": args.prompt_len, "mean_response_len": args.mean_response_len,
                   "max_response_len": args.new_tokens, "length_sigma": LENGTH_SIGMA, "steps": args.steps,
                   "warmup_steps": warmup, "modes": {mode: " ".join(flags) or "sync, both resident"
                                                     for mode, flags in modes.items()},
                   "max_tokens_per_gpu": args.max_tokens_per_gpu,
                   "gradient_checkpointing": args.gradient_checkpointing},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "date": time.strftime("%Y-%m-%d"),
    }
    output = args.output if args.output != RESULTS / "grpo_step_gpu.json" else RESULTS / "grpo_step_overlap_gpu.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({key: value for key, value in report.items() if key != "details"}, indent=2), flush=True)
    return report


def active_params(shape: dict) -> int:
    """Parameters a token goes through (the LM head, not the embedding): a MoE layer counts its chosen experts."""
    hidden, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    head_dim, kv_heads = shape["head_dim"], shape["num_key_value_heads"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    if "num_experts" in shape:
        mlp = 3 * hidden * shape["moe_intermediate_size"] * shape["num_experts_per_tok"] + hidden * shape["num_experts"]
    else:
        mlp = 3 * hidden * shape["intermediate_size"]
    return layers * (attention + mlp) + hidden * shape["vocab_size"]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_plain_generate(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype) -> float:
    """Seconds for `model.generate` to sample ``new_tokens`` for every prompt in one batch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    input_ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(input_ids[:2], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        synchronize(device)
        started = time.perf_counter()
        model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize(device)
    elapsed = time.perf_counter() - started
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the Qwen3-0.6B shape")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES), help="the Qwen3 shape (random init)")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's number of layers")
    parser.add_argument("--routing-replay", action="store_true", help="--use-rollout-routing-replay (MoE shapes)")
    parser.add_argument("--no-moe-grouped-gemm", action="store_true",
                        help="transformers' own experts in the trainer (the path before grouped_experts; MoE shapes)")
    parser.add_argument("--use-tis", action="store_true",
                        help="--use-tis: also logs the engine/trainer log-prob mismatch (train/tis_mismatch_*)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="fixed micro-batches of this many samples (the previous trainer setting: 8)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384,
                        help="token-budget micro-batches (--use-dynamic-batch-size), unless --micro-batch-size")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--colocate", action="store_true",
                        help="--colocate: offload the trainer while rolling out and the engine while training")
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps; the first is warm-up")
    parser.add_argument("--output", type=Path, default=RESULTS / "grpo_step_gpu.json")
    parser.add_argument("--engine-core", default="auto", choices=["auto", "on", "off"],
                        help="off: the core's runner over the model's own forward and cache (auto: the paged "
                        "runner for this model)")
    parser.add_argument("--baseline", default="generate", choices=["generate", "none"],
                        help="time model.generate on the same prompts too")
    parser.add_argument("--compare-overlap", action="store_true",
                        help="sync against --colocate-async on RL-like lengths (module doc)")
    parser.add_argument("--mean-response-len", type=int, default=256,
                        help="--compare-overlap: the mean of the drawn response lengths (capped at --new-tokens)")
    parser.add_argument("--modes", nargs="+", default=["sync", "overlapped", "carry_over"],
                        choices=["sync", "overlapped", "carry_over"], help="--compare-overlap: the runs to compare")
    parser.add_argument("--over-sampling", type=float, default=1.5,
                        help="--compare-overlap, carry_over: --over-sampling-batch-size as a multiple of --prompts")
    parser.add_argument("--mode-timeout", type=float, default=3600.0,
                        help="--compare-overlap: seconds each run may take; a run stopped keeps its finished steps")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="--compare-overlap: the model, prompts and each mode's run directory (run.log, "
                        "metrics.jsonl) go here and stay (default: a temporary directory)")
    parser.add_argument("--measured", nargs="*", default=[], choices=["sync", "overlapped", "carry_over"],
                        help="--compare-overlap: modes an earlier call ran in the same --work-dir; their metrics "
                        "are read into the report, not rerun (a comparison longer than one call)")
    parser.add_argument("--carry-max-staleness", type=int, default=2,
                        help="--compare-overlap, carry_over: its --max-staleness (how long a straggler may decode)")
    args = parser.parse_args()
    if args.compare_overlap:
        return compare_overlap(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = dict(TINY if args.tiny else SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    batching = ({"micro_batch_size": args.micro_batch_size} if args.micro_batch_size else
                {"use_dynamic_batch_size": True, "max_tokens_per_gpu": args.max_tokens_per_gpu})
    extra = {"mem_fraction_static": args.mem_fraction_static} if args.mem_fraction_static else {}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, data = build_workspace(root, shape, args.prompts * args.steps, args.prompt_len, args.device)
        cfg = RelaxConfig(
            hf_checkpoint=str(model_dir), prompt_data=str(data), custom_rm_path="benchmarks.grpo_step_gpu:parity_reward",
            rollout_batch_size=args.prompts, n_samples_per_prompt=args.samples_per_prompt,
            rollout_max_response_len=args.new_tokens, lr=1e-6, rollout_max_prompt_len=args.prompt_len,
            num_rollout=args.steps, gradient_checkpointing=args.gradient_checkpointing, device=args.device,
            use_tensorboard=False, dump_samples=0, output_dir=str(root / "run"), engine_core=args.engine_core,
            colocate=args.colocate, use_rollout_routing_replay=args.routing_replay, use_tis=args.use_tis,
            moe_grouped_gemm=not args.no_moe_grouped_gemm, **batching, **extra,
        )
        roles = build_roles(cfg)
        roles.rollout.sampling = replace(roles.rollout.sampling, ignore_eos=True)
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), Tracker(root / "run", use_tensorboard=False))
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps = []
        for rollout_id in range(args.steps):
            metrics = asyncio.run(controller.train_step(rollout_id))
            synchronize(args.device)
            steps.append(metrics)
            memory = " ".join(f"{k.removeprefix('perf/gpu_')} {v:.1f}" for k, v in metrics.items()
                              if k.startswith("perf/gpu_"))
            print(f"step {rollout_id + 1}: {metrics['perf/step_s']:.2f} s (rollout {metrics['perf/rollout_s']:.2f} s, "
                  f"train {metrics['perf/train_s']:.2f} s, sync {metrics['perf/weight_sync_s']:.2f} s, offload "
                  f"{metrics.get('perf/offload_s', 0):.2f} s) {memory}", flush=True)
        # the controller resets the peak counter at each phase: the run's peak is the largest phase peak
        peak_gib = max([torch.cuda.max_memory_allocated() / 2**30] + [v for m in steps for k, v in m.items()
                       if k.startswith("perf/gpu_peak_gib")]) if args.device == "cuda" else None
        prompts = [s.tokens for s in roles.rollout.data_source.prompts_for_step(0)]
        repeated = [p for p in prompts for _ in range(args.samples_per_prompt)]
        del controller, roles
        if args.device == "cuda":
            torch.cuda.empty_cache()
        plain_s = time_plain_generate(model_dir, repeated, args.new_tokens, args.device, dtype) \
            if args.baseline == "generate" else None

    timed = steps[1:] or steps
    mean = lambda key: sum(m[key] for m in timed) / len(timed)  # noqa: E731
    sequences = args.prompts * args.samples_per_prompt
    generated = sequences * args.new_tokens
    trained = sequences * (args.prompt_len + args.new_tokens)
    step_s = [round(m["perf/step_s"], 3) for m in steps]
    phase_keys = sorted({k for m in steps for k in m if k.startswith("perf/gpu_") or k == "perf/offload_s"})
    result = {
        "model": (f"Qwen3-{args.shape.upper()} shape, {shape['num_hidden_layers']} layers, random init"
                  if not args.tiny else "tiny Qwen3"),
        "active_params": active_params(shape), "routing_replay": args.routing_replay,
        "moe_grouped_gemm": not args.no_moe_grouped_gemm,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "sequences_per_step": sequences, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "s_per_step": mean("perf/step_s"),
        "last_to_second_step_ratio": step_s[-1] / step_s[1] if len(step_s) > 2 else None,
        **{key.removeprefix("perf/"): max(m.get(key, 0.0) for m in timed) for key in phase_keys},
        "batching": batching, "gradient_checkpointing": args.gradient_checkpointing, "colocate": args.colocate,
        "timed_steps": len(timed), "step_s": step_s,
        "rollout_s": mean("perf/rollout_s"), "train_s": mean("perf/train_s"),
        "weight_sync_s": mean("perf/weight_sync_s"),
        "rollout_tokens_per_s": generated / mean("perf/rollout_s"),
        "train_tokens_per_s": trained / mean("perf/train_s"),
        # 6 x active parameters x tokens (the forward of old log-probs, when computed, is not counted)
        "train_mfu_989": 6 * active_params(shape) * trained / mean("perf/train_s") / 989e12,
        **{key.removeprefix("train/"): mean(key) for key in ("train/tis_mismatch_kl", "train/tis_mismatch_abs")
           if args.use_tis},
        "peak_gpu_memory_gib": peak_gib,
        "engine_core": args.engine_core,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if plain_s is not None:
        result.update(baseline_generate_s=plain_s, baseline_generate_tokens_per_s=generated / plain_s,
                      rollout_vs_generate_speedup=plain_s / mean("perf/rollout_s"))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if plain_s is not None:
        print(f"rollout: Relax engine {result['rollout_tokens_per_s']:.0f} tok/s vs model.generate "
              f"{result['baseline_generate_tokens_per_s']:.0f} tok/s -> ratio "
              f"{result['rollout_vs_generate_speedup']:.2f}")


if __name__ == "__main__":
    main()
