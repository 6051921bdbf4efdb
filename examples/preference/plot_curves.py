"""Plot a run of examples/preference from its metrics.jsonl and print its held-out table: DPO (held-out greedy
accuracy; the training pairs' reward accuracy and loss), the reward model (held-out pair accuracy; the same on the
training pairs) or RL against it (held-out accuracy graded by the rule; the reward model's mean score).

Usage: python examples/preference/plot_curves.py RUN_DIR [--out docs/curves] [--name preference_dpo]
       python examples/preference/plot_curves.py RUN_DIR RUN_DIR ... --name NAME   # held-out accuracy of each run
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure

from relax.telemetry.metrics_file import read_metrics


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if row.get(key) is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("docs/curves"), help="folder of the PNG file")
    parser.add_argument("--name", default="preference_dpo", help="the PNG's file stem")
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 1:
        return compare(args.run_dirs, args.out / f"{args.name}.png")
    rows = read_metrics(args.run_dirs[0] / "metrics.jsonl")
    reward_model = bool(series(rows, "eval/held_out/pair_accuracy"))
    held_out_key = "eval/held_out/pair_accuracy" if reward_model else "eval/held_out/accuracy"
    figure = Figure(figsize=(9.6, 3.8))
    held_out, rewards = figure.subplots(1, 2)
    held_out.plot(*zip(*series(rows, held_out_key)), marker="o", markersize=3)
    held_out.set(title="Held-out pair accuracy (chosen scores higher)" if reward_model else "Held-out greedy accuracy",
                 xlabel="step", ylabel="share of pairs" if reward_model else "exact match", ylim=(0, 1))
    if series(rows, "train/rewards_accuracy"):
        for key, label in (("train/rewards_accuracy", "reward accuracy (chosen > rejected)"),
                           ("train/loss", "Bradley-Terry loss" if reward_model else "preference loss")):
            rewards.plot(*zip(*series(rows, key)), label=label)
        rewards.set(title="Training pairs (each step's batch, before its update)", xlabel="step")
    else:  # RL against the reward model
        rewards.plot(*zip(*series(rows, "rollout/reward_mean")), label="reward model's mean score")
        rewards.set(title="Rollout reward (the reward model's score)", xlabel="step")
    rewards.legend(fontsize="small")
    for axes in (held_out, rewards):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out / f"{args.name}.png", dpi=100)
    name = "held-out pair accuracy" if reward_model else "held-out accuracy"
    print(f"| step | {name} |\n|---|---|")
    for step, accuracy in series(rows, held_out_key):
        print(f"| {step} | {accuracy:.3f} |")

def compare(run_dirs: list[Path], out: Path) -> None:
    """The held-out accuracy of several runs on one plot, and their table (a column per run)."""
    figure = Figure(figsize=(7.2, 4.2))
    axes = figure.subplots()
    columns = {}
    for run_dir in run_dirs:
        columns[run_dir.name] = dict(series(read_metrics(run_dir / "metrics.jsonl"), "eval/held_out/accuracy"))
        axes.plot(*zip(*columns[run_dir.name].items()), marker="o", markersize=3, label=run_dir.name)
    axes.set(title="Held-out accuracy (graded by the rule)", xlabel="step", ylabel="exact match")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    steps = sorted({step for column in columns.values() for step in column})
    print("| run | " + " | ".join(map(str, steps)) + " |\n|---|" + "---|" * len(steps))
    for name, column in columns.items():
        print(f"| {name} | " + " | ".join(f"{column[step]:.3f}" if step in column else "" for step in steps) + " |")


if __name__ == "__main__":
    main()
