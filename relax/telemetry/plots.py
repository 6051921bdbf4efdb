"""PNG plots of a run's main curves, drawn from its ``metrics.jsonl``.

The plots exist so that a run directory can be judged at a glance (on a machine without TensorBoard, or attached to
a report). To plot a new metric, add its key (or an ``fnmatch`` pattern) to a group in :data:`CURVE_GROUPS`, or add a
group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from relax.telemetry.metrics_file import METRICS_FILE, read_metrics

PLOTS_DIR = "plots"


@dataclass(frozen=True)
class CurveGroup:
    """One figure: the metrics whose keys match ``key_patterns`` (``fnmatch`` syntax), drawn against the step."""

    title: str
    y_label: str
    key_patterns: tuple[str, ...]


CURVE_GROUPS: dict[str, CurveGroup] = {
    "reward": CurveGroup("Rollout reward", "mean reward", ("rollout/reward_mean",)),
    "accuracy": CurveGroup("Evaluation accuracy", "accuracy", ("eval/*accuracy*",)),
    "loss": CurveGroup("Training loss", "loss", ("train/loss", "train/pg_loss")),
    "kl": CurveGroup("KL divergence", "KL", ("train/kl_loss", "train/ppo_kl")),
    "clip_fraction": CurveGroup("Clipped fraction of tokens", "fraction", ("train/clipfrac",)),
    "response_length": CurveGroup("Response length", "mean tokens", ("rollout/response_length_mean",)),
    "entropy": CurveGroup("Policy entropy", "entropy (nats per token)", ("train/entropy",)),
}


def plot_run(run_dir: Path) -> list[Path]:
    """Draw one PNG per group of :data:`CURVE_GROUPS` that has data into ``run_dir/plots/``; return their paths.

    Keys may be sparse (an eval metric every k steps): each curve uses only the steps that logged it. Values that
    are not finite numbers (null, NaN, strings) are skipped, so odd data gives a plot with a gap, never an error.
    """
    rows = read_metrics(Path(run_dir) / METRICS_FILE)
    plots_dir = Path(run_dir) / PLOTS_DIR
    written = []
    for group_name, group in CURVE_GROUPS.items():
        curves = _informative(_curves_matching(rows, group.key_patterns))
        if not curves:
            continue
        plots_dir.mkdir(exist_ok=True)
        plot_path = plots_dir / f"{group_name}.png"
        _draw(group, curves, plot_path)
        written.append(plot_path)
    return written


def _curves_matching(rows: list[dict[str, Any]], key_patterns: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """Map each key matching a pattern to its ``(step, value)`` points; keys without a plottable point are left out."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        step = row.get("step")
        if not _is_finite_number(step):
            continue
        # An evaluation run beside training (--fully-async) is logged when it lands; it is drawn at its version.
        eval_step = row.get("eval/weight_version", step)
        for key, value in row.items():
            if key != "step" and _is_finite_number(value) and any(fnmatchcase(key, p) for p in key_patterns):
                curves.setdefault(key, []).append((eval_step if key.startswith("eval/") else step, value))
    return curves


def _informative(curves: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    """The curves worth drawing: not zero at every step (the PPO KL of one update per rollout is 0 by construction),
    and each once (with one held-out set, ``eval/accuracy`` and ``eval/<set>/accuracy`` are the same points)."""
    kept: dict[str, list[tuple[float, float]]] = {}
    for key, points in curves.items():
        if all(value == 0 for _, value in points) or any(points == other for other in kept.values()):
            continue
        kept[key] = points
    return kept


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _draw(group: CurveGroup, curves: dict[str, list[tuple[float, float]]], plot_path: Path) -> None:
    # matplotlib.figure without pyplot: no global backend switch, no display needed, and savefig renders with Agg.
    # Imported here: a quarter of a second that every process importing this module (a role's Ray process, a
    # server) would pay without ever drawing.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4))
    # Fixed margins instead of a layout engine: constrained layout would double the drawing time of a figure.
    figure.subplots_adjust(left=0.12, right=0.97, bottom=0.12, top=0.91)
    axes = figure.add_subplot()
    for key, points in sorted(curves.items()):
        steps, values = zip(*sorted(points))
        # Markers keep a curve with a single point (an eval run once so far) visible.
        axes.plot(steps, values, marker="o", markersize=2.5, linewidth=1.2, label=key)
    axes.set_title(group.title)
    axes.set_xlabel("step")
    axes.set_ylabel(group.y_label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(plot_path, dpi=100)


def plot_comparison(runs: dict[str, Path], key: str, title: str, plot_path: Path) -> Path:
    """One metric of several runs in one PNG (a run against its control), labelled by the ``runs`` keys."""
    curves = {}
    for label, run_dir in runs.items():
        points = _curves_matching(read_metrics(Path(run_dir) / METRICS_FILE), (key,)).get(key)
        if points:
            curves[label] = points
    if not curves:
        raise ValueError(f"none of the runs logged {key!r}")
    _draw(CurveGroup(title, key, (key,)), curves, Path(plot_path))
    return Path(plot_path)
