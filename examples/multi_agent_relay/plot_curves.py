"""Plot the relay run's per-agent curves from its metrics.jsonl, and print the held-out figures as a table.

Held-out (greedy, 200 problems): ``first`` is the share of correct a + b, ``second`` the share of correct a + b + c,
the team's result. Training rollouts (T=1): the same per agent, a 10-step trailing mean.

Usage: python examples/multi_agent_relay/plot_curves.py RUN_DIR [--out docs/curves]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from matplotlib.figure import Figure

from relax.telemetry.metrics_file import read_metrics

AGENTS = {"first": "first (a+b)", "second": "second (+c): the team's result"}


def trailing_mean(points: list[tuple[int, float]], window: int = 10) -> list[tuple[int, float]]:
    return [(step, statistics.fmean(v for _, v in points[max(0, i - window + 1) : i + 1]))
            for i, (step, _) in enumerate(points)]


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if key in row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/curves"), help="folder of the PNG file")
    args = parser.parse_args(argv)
    rows = read_metrics(args.run_dir / "metrics.jsonl")
    figure = Figure(figsize=(6.4, 4.0))
    axes = figure.subplots()
    for (agent, label), color in zip(AGENTS.items(), ("tab:blue", "tab:green")):
        held_out = series(rows, f"eval/held_out/agent/{agent}/accuracy")
        axes.plot(*zip(*held_out), marker="o", markersize=3, color=color, label=f"{label}, held-out (greedy)")
        sampled = trailing_mean(series(rows, f"rollout/agent/{agent}/accuracy"))
        axes.plot(*zip(*sampled), linestyle="--", alpha=0.7, color=color,
                  label=f"{label}, training rollouts (T=1, mean of 10 steps)")
    axes.set(title="Two-agent relay: held-out accuracy per agent", xlabel="GRPO step", ylabel="accuracy",
             ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out / "multi_agent_relay.png", dpi=100)
    print("| step | first: a+b correct | second: a+b+c correct (team) |")
    print("|---|---|---|")
    first = dict(series(rows, "eval/held_out/agent/first/accuracy"))
    for step, team in series(rows, "eval/held_out/agent/second/accuracy"):
        print(f"| {step} | {first.get(step, float('nan')):.3f} | {team:.3f} |")


if __name__ == "__main__":
    main()
