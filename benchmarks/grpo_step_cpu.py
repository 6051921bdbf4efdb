"""Seconds per GRPO step on CPU: Relax's colocated `SyncController.train_step` against TRL's `GRPOTrainer`.

Both frameworks run the same GRPO configuration on the quickstart model (a ~2.4 M-parameter Qwen3 with a character
tokenizer, task ``123+456=`` -> ``579<|im_end|>``): the same prompts in the same order (the first rows of
``train.jsonl``, unshuffled), 8 prompts x 8 samples per step, one optimizer step per rollout, 8 new tokens at
temperature 1.0 (no top-k/top-p), AdamW at a constant lr of 3e-5, gradient clipping at 1.0, beta/KL 0, no entropy
bonus, per-sequence token-mean loss (TRL ``loss_type="grpo"``, Relax's default seq-mean-token-mean), GRPO std
normalisation of the rewards, and an exact-match reward of the completion text against the label. The micro-batch
(samples per forward/backward) is the same in both (``--micro-batch-size``, default: the whole step in one pass).

Each framework runs in its own subprocess with the same ``torch.set_num_threads``; a step's time is the wall time
between the ends of consecutive steps (rollout, rewards, advantages, training and, for Relax, the weight sync into
the engine and the metrics line), and its process CPU time is recorded beside it. The first ``--warmup`` steps are
excluded. ``--rounds`` repeats the pair, alternating which framework goes first, and pools the timed steps of all
rounds. Prints a table and the ratio baseline/Relax and writes a JSON result.

Threads default to 1. The CPU machines are shared: with 2 threads on 2 cores, any other busy process turns each
OpenMP barrier into a wait for a scheduler time slice, and a plain Hugging Face forward+backward of this model went
from 0.18 s to 5.1 s (TRL GRPO steps to ~10 s), which measures the neighbours rather than the frameworks. Pass
``--threads 2`` on an otherwise idle 2-core machine.

    python benchmarks/grpo_step_cpu.py                       # quickstart assets, 4 rounds x (3 warm-up + 15 timed)
    python benchmarks/grpo_step_cpu.py --model DIR --data FILE --threads 2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grpo_step_cpu.json"

# The shared GRPO configuration; each worker maps these onto its framework's own settings.
CONFIG = {
    "prompts_per_step": 8,
    "samples_per_prompt": 8,
    "optimizer_steps_per_rollout": 1,
    "max_new_tokens": 8,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": "off",
    "lr": 3e-5,
    "lr_schedule": "constant",
    "adam_betas": [0.9, 0.999],
    "adam_eps": 1e-8,
    "weight_decay": 0.0,
    "clip_grad_norm": 1.0,
    "ppo_clip_eps": 0.2,
    "kl_beta": 0.0,
    "entropy_coef": 0.0,
    "loss_aggregation": "per-sequence token mean (TRL loss_type=grpo, Relax seq-mean-token-mean)",
    "reward_normalisation": "group mean and std (TRL scale_rewards=group, Relax GRPO std normalisation)",
    "reward": "exact match of the stripped completion text (special tokens skipped) against the label",
    "prompt_order": "train.jsonl rows in file order, no shuffle",
    "dtype": "float32",
    "seed": 1234,
}


# ------------------------------------------------------------------------------------------------------ workers


def exact_match(completion: str, label: str) -> float:
    return 1.0 if completion.strip() == str(label).strip() else 0.0


class StepClock:
    """Wall and process CPU seconds (all threads) between consecutive `tick`s, from `start` on.

    CPU time is reported beside wall time because on a shared machine other processes stretch wall time
    without adding work; with one torch thread it tracks the work a step does.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._last: tuple[float, float] | None = None

    def start(self) -> None:
        self._last = (time.perf_counter(), time.process_time())

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self._last = now


def run_relax(args: argparse.Namespace, run_dir: Path) -> dict:
    import asyncio

    from relax.config import RelaxConfig
    from relax.core.build import build_roles
    from relax.core.loops.sync import SyncController
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.tracking import Tracker

    steps = args.warmup + args.steps
    cfg = RelaxConfig(
        hf_checkpoint=str(args.model), prompt_data=str(args.data), input_key="input", label_key="label",
        device="cpu", dtype="float32", rollout_shuffle=False,
        rollout_batch_size=CONFIG["prompts_per_step"], n_samples_per_prompt=CONFIG["samples_per_prompt"],
        micro_batch_size=args.micro_batch_size, num_rollout=steps,
        rollout_max_response_len=CONFIG["max_new_tokens"], rollout_temperature=CONFIG["temperature"],
        lr=CONFIG["lr"], lr_decay_style="constant", clip_grad=CONFIG["clip_grad_norm"], eps_clip=CONFIG["ppo_clip_eps"],
        use_kl_loss=False, entropy_coef=0.0, calculate_per_token_loss=False, disable_grpo_std_normalization=False,
        rm_type="exact_match", seed=CONFIG["seed"], output_dir=str(run_dir), use_tensorboard=False, dump_samples=0,
    )
    setup_started = time.perf_counter()
    roles = build_roles(cfg)

    # Record each step's prompts and mean reward (a check that both runs see the same data and behave alike).
    prompts_per_step: list[list[str]] = []
    generate = roles.rollout.generate

    async def recording_generate(rollout_id: int):
        samples, metrics = await generate(rollout_id)
        prompts_per_step.append([s.prompt for s in samples[:: cfg.n_samples_per_prompt]])
        return samples, metrics

    roles.rollout.generate = recording_generate
    clock, rewards, phases = StepClock(), [], []
    with Tracker(run_dir, use_tensorboard=False) as tracker:
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        setup_s = time.perf_counter() - setup_started

        async def loop() -> None:  # SyncController.run's loop, without eval and checkpoints
            clock.start()
            for rollout_id in range(steps):
                metrics = await controller.train_step(rollout_id)
                tracker.log(rollout_id + 1, metrics)
                clock.tick()
                rewards.append(metrics["rollout/reward_mean"])
                phases.append({k.removeprefix("perf/"): metrics[k]
                               for k in ("perf/rollout_s", "perf/train_s", "perf/weight_sync_s")})

        asyncio.run(loop())
    return {"step_times": clock.wall, "step_cpu_times": clock.cpu, "rewards": rewards, "prompts": prompts_per_step,
            "setup_s": setup_s, "phases": phases}


def run_trl(args: argparse.Namespace, run_dir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps = args.warmup + args.steps
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": row["input"], "label": row["label"]} for row in rows])
    samples_per_step = CONFIG["prompts_per_step"] * CONFIG["samples_per_prompt"]
    prompts_per_step: list[list[str]] = []
    rewards: list[float] = []

    def exact_match_reward(prompts, completions, label, **kwargs):
        scores = [exact_match(c, lab) for c, lab in zip(completions, label)]
        prompts_per_step.append(list(prompts[:: CONFIG["samples_per_prompt"]]))  # each prompt's group is adjacent
        rewards.append(sum(scores) / len(scores))
        return scores

    clock = StepClock()

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    config = GRPOConfig(
        output_dir=str(run_dir), max_steps=steps, seed=CONFIG["seed"],
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=samples_per_step // args.micro_batch_size,
        num_generations=CONFIG["samples_per_prompt"], num_iterations=1, shuffle_dataset=False,
        max_completion_length=CONFIG["max_new_tokens"], temperature=CONFIG["temperature"], top_p=1.0, top_k=0,
        learning_rate=CONFIG["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=CONFIG["clip_grad_norm"],
        epsilon=CONFIG["ppo_clip_eps"], beta=0.0, entropy_coef=0.0, loss_type="grpo", scale_rewards="group",
        bf16=False, gradient_checkpointing=False, use_cpu=True, use_vllm=False, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    setup_started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=exact_match_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()])
    # Time TRL's rollout phase (generation, rewards, advantages), to set beside Relax's perf/rollout_s.
    rollout_times: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*call_args, **call_kwargs):
        started = time.perf_counter()
        output = generate_and_score(*call_args, **call_kwargs)
        rollout_times.append(time.perf_counter() - started)
        return output

    trainer._generate_and_score_completions = timed_generate_and_score
    setup_s = time.perf_counter() - setup_started
    trainer.train()
    assert len(clock.wall) == steps and len(rewards) == steps, (len(clock.wall), len(rewards))
    phases = [{"rollout_s": r, "rest_s": t - r} for r, t in zip(rollout_times, clock.wall)]
    return {"step_times": clock.wall, "step_cpu_times": clock.cpu, "rewards": rewards, "prompts": prompts_per_step,
            "setup_s": setup_s, "phases": phases}


def worker_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix=f"grpo_step_{args.worker}_") as tmp:
        result = (run_relax if args.worker == "relax" else run_trl)(args, Path(tmp))
    result["torch_threads"] = torch.get_num_threads()
    Path(args.worker_out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------------- driver


def run_worker(framework: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    command = [
        sys.executable, __file__, "--worker", framework, "--worker-out", str(out), "--model", str(args.model),
        "--data", str(args.data), "--threads", str(args.threads), "--warmup", str(args.warmup),
        "--steps", str(args.steps), "--micro-batch-size", str(args.micro_batch_size),
    ]
    threads = str(args.threads)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        sys.stderr.write(completed.stdout[-4000:] + completed.stderr[-8000:])
        raise SystemExit(f"{framework} worker failed with exit code {completed.returncode}")
    result = json.loads(out.read_text())
    out.unlink()
    result["process_s"] = time.perf_counter() - started
    return result


def summarize(times: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(times), "median": statistics.median(times), "min": min(times), "max": max(times),
            "stdev": statistics.stdev(times) if len(times) > 1 else 0.0}


def shown_path(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (results stay comparable across checkouts)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "trl", "accelerate", "datasets", "relax-rl"):
        try:
            found[package] = version(package)
        except Exception:  # noqa: BLE001  (a missing package is reported, not fatal)
            found[package] = "not installed"
    return found


def timed(rounds: list[dict], framework: str, field: str, warmup: int) -> list[float]:
    """The post-warm-up values of ``field`` of ``framework``, pooled over rounds."""
    return [value for r in rounds for value in r[framework][field][warmup:]]


def phase_means(rounds: list[dict], framework: str, warmup: int) -> dict[str, float]:
    steps = [phase for r in rounds for phase in r[framework]["phases"][warmup:]]
    return {name: statistics.fmean(step[name] for step in steps) for name in steps[0]}


def driver_main(args: argparse.Namespace) -> None:
    rounds = []
    for round_index in range(args.rounds):
        order = ("relax", "trl") if round_index % 2 == 0 else ("trl", "relax")
        results = {}
        for framework in order:
            results[framework] = run_worker(framework, args)
            wall = results[framework]["step_times"][args.warmup :]
            print(f"round {round_index + 1}/{args.rounds} {framework:5s}: mean {statistics.fmean(wall):.3f} s/step, "
                  f"median {statistics.median(wall):.3f} (process {results[framework]['process_s']:.1f} s)",
                  flush=True)
        rounds.append({"order": list(order), **results})

    same_prompts = all(r["relax"]["prompts"] == r["trl"]["prompts"] for r in rounds)
    if not same_prompts:
        print("warning: the two frameworks saw different prompts", file=sys.stderr)
    relax_stats = summarize(timed(rounds, "relax", "step_times", args.warmup))
    trl_stats = summarize(timed(rounds, "trl", "step_times", args.warmup))
    relax_cpu = summarize(timed(rounds, "relax", "step_cpu_times", args.warmup))
    trl_cpu = summarize(timed(rounds, "trl", "step_cpu_times", args.warmup))
    speedup = trl_stats["mean"] / relax_stats["mean"]
    speedup_median = trl_stats["median"] / relax_stats["median"]
    speedup_cpu = trl_cpu["mean"] / relax_cpu["mean"]
    per_round = [
        statistics.fmean(r["trl"]["step_times"][args.warmup :])
        / statistics.fmean(r["relax"]["step_times"][args.warmup :])
        for r in rounds
    ]
    relax_phases, trl_phases = phase_means(rounds, "relax", args.warmup), phase_means(rounds, "trl", args.warmup)
    relax_phases["rest_s"] = relax_stats["mean"] - sum(relax_phases.values())

    print()
    print(f"{'framework':<24}{'mean s/step':>12}{'median':>9}{'min':>8}{'max':>8}{'cpu s/step':>12}  steps")
    rows = (("relax (SyncController)", relax_stats, relax_cpu), ("trl GRPOTrainer", trl_stats, trl_cpu))
    for name, wall, cpu in rows:
        print(f"{name:<24}{wall['mean']:>12.3f}{wall['median']:>9.3f}{wall['min']:>8.3f}{wall['max']:>8.3f}"
              f"{cpu['mean']:>12.3f}  {args.rounds * args.steps}")
    print(f"speedup (trl / relax): {speedup:.2f}x on the mean, {speedup_median:.2f}x on the median, "
          f"{speedup_cpu:.2f}x on CPU time; per round {', '.join(f'{x:.2f}' for x in per_round)}")
    print("relax phases (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in relax_phases.items()))
    print("trl phases (mean s):   " + ", ".join(f"{k} {v:.3f}" for k, v in trl_phases.items()))

    result = {
        "benchmark": "grpo_step_cpu",
        "relax_s_per_step": relax_stats["mean"],
        "baseline_s_per_step": trl_stats["mean"],
        "speedup": speedup,
        "relax_median_s_per_step": relax_stats["median"],
        "baseline_median_s_per_step": trl_stats["median"],
        "speedup_median": speedup_median,
        "speedup_per_round": per_round,
        "relax_cpu_s_per_step": relax_cpu["mean"],
        "baseline_cpu_s_per_step": trl_cpu["mean"],
        "speedup_cpu_time": speedup_cpu,
        "baseline": f"trl.GRPOTrainer {versions().get('trl')}",
        "relax_first_step_s": statistics.fmean(r["relax"]["step_times"][0] for r in rounds),
        "baseline_first_step_s": statistics.fmean(r["trl"]["step_times"][0] for r in rounds),
        "relax_stats": relax_stats,
        "baseline_stats": trl_stats,
        "relax_cpu_stats": relax_cpu,
        "baseline_cpu_stats": trl_cpu,
        "relax_phase_means_s": relax_phases,
        "baseline_phase_means_s": trl_phases,
        "phase_notes": "rollout_s: generation and rewards (TRL: also advantages); train_s: Relax's actor update; "
                       "weight_sync_s: Relax's copy of the weights into its engine; rest_s: the rest of the step "
                       "(TRL: log-prob forward, loss, backward, optimizer step and logging)",
        "config": {**CONFIG, "micro_batch_size": args.micro_batch_size, "model": shown_path(args.model),
                   "data": shown_path(args.data), "warmup_steps": args.warmup, "timed_steps": args.steps,
                   "rounds": args.rounds},
        "torch_threads": args.threads,
        "worker_torch_threads": {name: rounds[0][name]["torch_threads"] for name in ("relax", "trl")},
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "load_average_at_end": os.getloadavg(),
        "versions": versions(),
        "same_prompts": same_prompts,
        "rounds": [
            {
                "order": r["order"],
                **{
                    f"{name}_{field}": r[framework][field]
                    for framework, name in (("relax", "relax"), ("trl", "baseline"))
                    for field in ("step_times", "step_cpu_times", "rewards", "setup_s", "process_s")
                },
            }
            for r in rounds
        ],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", os.path.relpath(__file__, REPO)] + sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=QUICKSTART / "model", help="Hugging Face model folder")
    parser.add_argument("--data", type=Path, default=QUICKSTART / "data" / "train.jsonl",
                        help="prompt rows {\"input\", \"label\"}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (and OMP/MKL_NUM_THREADS) in both workers; see the module doc")
    parser.add_argument("--warmup", type=int, default=3, help="steps per run excluded from the timing")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=4, help="runs per framework, alternating which goes first")
    parser.add_argument("--micro-batch-size", type=int, default=64,
                        help="samples per forward/backward in both frameworks (must divide 64)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    parser.add_argument("--worker", choices=["relax", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    samples_per_step = CONFIG["prompts_per_step"] * CONFIG["samples_per_prompt"]
    if samples_per_step % args.micro_batch_size:
        parser.error(f"--micro-batch-size must divide {samples_per_step}")
    if args.worker:
        worker_main(args)
        return
    for path in (args.model / "config.json", args.data):
        if not path.is_file():
            parser.error(f"{path} not found (build it: python examples/quickstart/build_quickstart.py)")
    driver_main(args)


if __name__ == "__main__":
    main()
