"""Plot the calculator run's held-out accuracy and tool-call success, and print them as a table.

The rollout logs only the reward's ``score``; the per-sample tool figures come from the reward log that
``reward.py`` writes into the run directory (``calculator_rewards.jsonl``). Held-out rows are grouped by the weight
version that produced them, which is the training step of the evaluation; training rollouts are grouped the same way
(their version is the step whose weights sampled them).

Usage: python examples/agentic_calculator/plot_curves.py RUN_DIR [--out docs/curves]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure
from reward import REWARD_LOG_NAME

FIGURES = {  # file stem -> (title, y label, curves: legend label -> (split, reward key))
    "agentic_calculator_accuracy": ("Held-out accuracy (200 problems)", "exact-match accuracy", {
        "held-out (greedy)": ("test", "correct"),
        "training rollouts (T=1, mean of 5 steps)": ("train", "correct"),
    }),
    "agentic_calculator_tool_success": ("Tool calls", "share", {
        "tool-call success, held-out (greedy)": ("test", "tool_call_success"),
        "tool-call success, training rollouts (T=1, mean of 5 steps)": ("train", "tool_call_success"),
        "calls with the right operands, held-out (greedy)": ("test", "correct_call"),
    }),
}


def mean_by_version(rows: list[dict], split: str, key: str) -> dict[int, float]:
    """The mean of ``key`` over the rows of ``split``, per weight version (= step)."""
    values: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if row["split"] == split and row["weight_version"] is not None:
            values[int(row["weight_version"])].append(row[key])
    return {version: statistics.fmean(values[version]) for version in sorted(values)}


def moving_average(points: dict[int, float], window: int = 5) -> dict[int, float]:
    """The training rollouts have only 64 episodes a step: a trailing mean shows their trend."""
    steps = list(points)
    return {step: statistics.fmean(points[s] for s in steps[max(0, i - window + 1) : i + 1])
            for i, step in enumerate(steps)}


def draw(path: Path, title: str, y_label: str, curves: dict[str, dict[int, float]]) -> None:
    figure = Figure(figsize=(6.4, 4.0))
    axes = figure.subplots()
    for label, points in curves.items():
        axes.plot(list(points), list(points.values()), marker="o" if "held-out" in label else None,
                  markersize=3, label=label)
    axes.set(title=title, xlabel="GRPO step", ylabel=y_label, ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/curves"), help="folder of the PNG files")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in (args.run_dir / REWARD_LOG_NAME).read_text().splitlines() if line]
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, (title, y_label, series) in FIGURES.items():
        curves = {label: mean_by_version(rows, split, key) for label, (split, key) in series.items()}
        curves = {label: moving_average(points) if series[label][0] == "train" else points
                  for label, points in curves.items()}
        draw(args.out / f"{stem}.png", title, y_label, curves)
    print_table(rows)


def print_table(rows: list[dict], window: int = 10) -> None:
    """Held-out figures per evaluation, and the training rollouts' tool-call success (sampled at T=1) over the
    ``window`` steps up to it (one step's 64 episodes alone are too noisy)."""
    keys = ("correct", "tool_call_success", "called_tool", "correct_call")
    held_out = {key: mean_by_version(rows, "test", key) for key in keys}
    train_success = mean_by_version(rows, "train", "tool_call_success")
    print("| step | held-out accuracy | tool-call success | episodes with a call | calls with the right operands |"
          f" training rollouts' tool-call success (last {window} steps) |")
    print("|---|---|---|---|---|---|")
    for step in held_out["correct"]:
        recent = [value for version, value in train_success.items() if step - window < version <= step]
        figures = " | ".join(f"{held_out[key][step]:.3f}" for key in keys)
        print(f"| {step} | {figures} | {statistics.fmean(recent):.3f} |" if recent else f"| {step} | {figures} | - |")

if __name__ == "__main__":
    main()
