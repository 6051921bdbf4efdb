"""Curves of a SmolLM2 math run: a `relax train` run directory (metrics.jsonl) or a result JSON of
benchmarks/time_to_accuracy_gpu.py (held-out accuracy, total and per level).

    python examples/smollm2_math/plot_curves.py runs/smollm2_math_cpu --out docs/curves/smollm2_math_cpu.png
    python examples/smollm2_math/plot_curves.py benchmarks/results/smollm2_math_gpu.json \
        --versus benchmarks/results/time_to_accuracy_trl_longer_gpu.json --out docs/curves/smollm2_math_gpu.png

A run directory gives two panels against wall-clock minutes: the rollout reward (each step, and its mean over 5
steps) and the held-out accuracy at each evaluation. It also prints them as a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def run_dir_curves(run: Path, out: Path) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    elapsed, minutes, reward, steps, evals = 0.0, [], [], [], []
    for row in rows:
        elapsed += row.get("perf/step_s", 0.0) + row.get("perf/eval_s", 0.0)
        if "rollout/reward_mean" in row:
            steps.append(row["step"])
            minutes.append(elapsed / 60)
            reward.append(row["rollout/reward_mean"])
        if "eval/accuracy" in row:
            evals.append((row["step"], elapsed / 60, row["eval/accuracy"]))
    window = [sum(reward[max(0, i - 4):i + 1]) / len(reward[max(0, i - 4):i + 1]) for i in range(len(reward))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(minutes, reward, ".", color="tab:grey", alpha=0.6, label="each step")
    left.plot(minutes, window, "-", color="tab:blue", label="mean of 5 steps")
    left.set_title("rollout reward (math)", fontsize=10)
    right.plot([e[1] for e in evals], [100 * e[2] for e in evals], "o-", color="tab:green")
    right.set_title("held-out accuracy (greedy), %", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("wall-clock minutes (training and evaluation)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, GRPO: {run.name}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print("step  minutes  reward(5-step mean)")
    for step, minute, mean in zip(steps, minutes, window):
        print(f"{step:4d}  {minute:7.1f}  {mean:.3f}")
    print("held-out: " + ", ".join(f"step {s}: {100 * a:.1f}% ({m:.1f} min)" for s, m, a in evals))


def result_curves(result: Path, versus: Path | None, out: Path) -> None:
    data = json.loads(result.read_text())
    name, run = next(iter(data["systems"].items()))
    curve = run["curve"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot([p["seconds"] for p in curve], [100 * p["accuracy"] for p in curve], "o-", color="tab:blue",
              label=f"Relax ({curve[-1]['step']} steps)")
    if versus is not None:
        other = next(iter(json.loads(versus.read_text())["systems"].values()))["curve"]
        left.plot([p["seconds"] for p in other], [100 * p["accuracy"] for p in other], "o-", color="tab:orange",
                  label=f"TRL 1.16 GRPOTrainer ({other[-1]['step']} steps, a separate run)")
    left.set_xlabel("training seconds (evaluation excluded)")
    left.set_title("held-out accuracy, %", fontsize=10)
    left.legend(fontsize=8)
    for level in sorted(curve[0]["by_level"]):
        right.plot([p["step"] for p in curve], [100 * p["by_level"][level] for p in curve], "o-", ms=3,
                   label=f"level {level}")
    right.set_xlabel("GRPO step")
    right.set_title("held-out accuracy by difficulty level, %", fontsize=10)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct on {data.get('device', '?')}: {name}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run directory, or a result JSON")
    parser.add_argument("--versus", type=Path, help="a second result JSON (a TRL run) on the same time axis")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.source.is_dir():
        run_dir_curves(args.source, args.out)
    else:
        result_curves(args.source, args.versus, args.out)


if __name__ == "__main__":
    main()
