"""The tool-use examples' grading and their per-sample reward log, and the curves drawn from it.

The rollout logs only a reward's ``score``; an example's reward function also appends each scored sample's figures
(accuracy, tool calls, ...) to a JSONL file in the run directory, with the weight version that produced it and its
split (``metadata["split"] == "test"`` marks held-out rows). ``plot_log`` groups those rows by weight version, which
is the training step of an evaluation, and draws the curves.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from relax.data.sample import Sample

ANSWER_PATTERN = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)

_log_lock = threading.Lock()  # rewards are scored in a thread pool; one line per write, never interleaved


def final_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of ``text``, or None."""
    matches = ANSWER_PATTERN.findall(text)
    return matches[-1] if matches else None


def last_model_turn(sample: Sample) -> str:
    """The text of the model's last turn (the whole response for a single-turn sample). Only the model's own turn is
    graded, never text the environment inserted: a tool result may contain the answer or tags."""
    traces = sample.metadata.get("rollout_traces") or []
    return traces[-1]["response_text"] if traces else sample.response


def record_reward(args: Any, sample: Sample, reward: dict[str, float], log_name: str) -> None:
    version = sample.weight_version
    row = {"split": sample.metadata.get("split", "train"), "index": sample.index,
           "weight_version": max(version) if isinstance(version, list) else version, **reward}
    path = Path(args.output_dir) / log_name
    with _log_lock, open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps(row) + "\n")


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


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


def plot_log(rows: list[dict], figures: dict[str, tuple[str, str, dict[str, tuple[str, str]]]], out: Path) -> None:
    """One PNG per entry of ``figures``: file stem -> (title, y label, curves: legend label -> (split, reward key));
    training curves are smoothed by ``moving_average``."""
    out.mkdir(parents=True, exist_ok=True)
    for stem, (title, y_label, series) in figures.items():
        curves = {label: mean_by_version(rows, split, key) for label, (split, key) in series.items()}
        curves = {label: moving_average(points) if series[label][0] == "train" else points
                  for label, points in curves.items()}
        draw(out / f"{stem}.png", title, y_label, curves)


def print_table(rows: list[dict], columns: dict[str, str], train_key: str, train_title: str, window: int = 10) -> None:
    """Held-out figures per evaluation (``columns``: reward key -> column title), and the training rollouts' mean of
    ``train_key`` (sampled at T=1) over the ``window`` steps up to it (one step's episodes alone are too noisy)."""
    held_out = {key: mean_by_version(rows, "test", key) for key in columns}
    train_figure = mean_by_version(rows, "train", train_key)
    print("| step | " + " | ".join(columns.values()) + f" | training rollouts' {train_title} (last {window} steps) |")
    print("|---" * (len(columns) + 2) + "|")
    first = next(iter(columns))
    for step in held_out[first]:
        recent = [value for version, value in train_figure.items() if step - window < version <= step]
        figures = " | ".join(f"{held_out[key][step]:.3f}" for key in columns)
        print(f"| {step} | {figures} | {statistics.fmean(recent):.3f} |" if recent else f"| {step} | {figures} | - |")


def plot_main(argv: list[str] | None, description: str, log_name: str,
              figures: dict[str, tuple[str, str, dict[str, tuple[str, str]]]], columns: dict[str, str],
              train_key: str, train_title: str) -> None:
    """The command line of an example's ``plot_curves.py``: ``RUN_DIR [--out docs/curves]``; draws ``figures`` from
    the run's reward log ``log_name`` and prints the table of ``columns``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/curves"), help="folder of the PNG files")
    args = parser.parse_args(argv)
    rows = read_log(args.run_dir / log_name)
    plot_log(rows, figures, args.out)
    print_table(rows, columns, train_key, train_title)
