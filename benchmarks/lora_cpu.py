"""LoRA against full fine-tuning on the CPU quickstart (issue 18): held-out accuracy over a run of each, side by
side, and the size of each run's checkpoint and optimizer state.

    python -m benchmarks.lora_cpu [--steps 200] [--eval-interval 25]

Writes benchmarks/results/lora_cpu.json (headline: ``lora_final_accuracy``, ``full_final_accuracy``,
``checkpoint_size_ratio``, ``optimizer_state_ratio``) and docs/curves/lora_quickstart_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from matplotlib.figure import Figure

from relax.telemetry.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# rank 16 on every linear layer; LoRA takes a learning rate about ten times full fine-tuning's
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear", "--lr", "5e-4",
        "--min-lr", "5e-5"]


def run(name: str, out: Path, steps: int, eval_interval: int, extra: list[str]) -> dict:
    run_dir = out / name
    started = time.time()
    subprocess.run([sys.executable, "-m", "relax.cli.main", "train", "--config", "examples/quickstart/config.yaml",
                    "--num-rollout", str(steps), "--eval-interval", str(eval_interval), "--save-interval",
                    str(steps), "--output-dir", str(run_dir), "--no-use-tensorboard", *extra],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = {row["step"]: row["eval/accuracy"] for row in rows if "eval/accuracy" in row}
    step_dir = run_dir / "checkpoints" / f"iter_{steps:07d}" / "model_optim"
    return {"accuracy": evals, "wall_s": round(time.time() - started, 1),
            "checkpoint_bytes": sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()),
            "optimizer_state_bytes": optimizer_bytes(step_dir)}


def optimizer_bytes(checkpoint: Path) -> int:
    """The bytes of the optimizer state's tensors in a DCP checkpoint (from its metadata)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    total = 0
    for key, item in metadata.items():
        if key.startswith("optim.state.") and hasattr(item, "size"):
            count = 1
            for dim in item.size:
                count *= dim
            total += count * item.properties.dtype.itemsize
    return total


def plot(path: Path, results: dict[str, dict]) -> None:
    figure = Figure(figsize=(6.4, 4.0))
    axes = figure.subplots()
    for label, result in results.items():
        points = result["accuracy"]
        axes.plot(list(points), list(points.values()), marker="o", markersize=3, label=label)
    axes.set(title="Quickstart held-out accuracy: LoRA vs full fine-tuning", xlabel="GRPO step",
             ylabel="exact-match accuracy", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        full = run("full", out, args.steps, args.eval_interval, [])
        lora = run("lora", out, args.steps, args.eval_interval, LORA)
    last = max(full["accuracy"])
    result = {
        "lora_final_accuracy": lora["accuracy"][last], "full_final_accuracy": full["accuracy"][last],
        "initial_accuracy": full["accuracy"][0],
        "checkpoint_size_ratio": round(lora["checkpoint_bytes"] / full["checkpoint_bytes"], 4),
        "optimizer_state_ratio": round(lora["optimizer_state_bytes"] / full["optimizer_state_bytes"], 4),
        "steps": args.steps, "lora_flags": " ".join(LORA), "lora": lora, "full": full,
        "command": f"python -m benchmarks.lora_cpu --steps {args.steps} --eval-interval {args.eval_interval}",
    }
    (ROOT / "benchmarks" / "results" / "lora_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(ROOT / "docs" / "curves" / "lora_quickstart_accuracy.png",
         {f"full fine-tuning (lr 5e-5), {full['wall_s']:.0f} s": full,
          f"LoRA rank 16, all linear layers (lr 5e-4), {lora['wall_s']:.0f} s": lora})
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
