"""Plot a preference run's held-out accuracy and implicit-reward figures from its metrics.jsonl; print the table.

Usage: python examples/preference/plot_curves.py RUN_DIR [--out docs/curves] [--name preference_dpo]
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
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/curves"), help="folder of the PNG file")
    parser.add_argument("--name", default="preference_dpo", help="the PNG's file stem")
    args = parser.parse_args(argv)
    rows = read_metrics(args.run_dir / "metrics.jsonl")
    figure = Figure(figsize=(9.6, 3.8))
    held_out, rewards = figure.subplots(1, 2)
    held_out.plot(*zip(*series(rows, "eval/held_out/accuracy")), marker="o", markersize=3)
    held_out.set(title="Held-out greedy accuracy", xlabel="step", ylabel="exact match", ylim=(0, 1))
    for key, label in (("train/rewards_accuracy", "reward accuracy (chosen > rejected)"),
                       ("train/loss", "preference loss")):
        rewards.plot(*zip(*series(rows, key)), label=label)
    rewards.set(title="Training pairs (each step's new pairs)", xlabel="step")
    rewards.legend(fontsize="small")
    for axes in (held_out, rewards):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out / f"{args.name}.png", dpi=100)
    print("| step | held-out accuracy |\n|---|---|")
    for step, accuracy in series(rows, "eval/held_out/accuracy"):
        print(f"| {step} | {accuracy:.3f} |")


if __name__ == "__main__":
    main()
