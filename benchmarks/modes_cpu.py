"""Colocated (sync) against fully-async step time on the quickstart, in one run.

Both modes run the quickstart configuration (16 prompts x 8 samples per step, the same model and data) for the same
number of steps with the roles in separate Ray processes (`--placement ray`: actor and rollout each in their own
process, one torch thread each), so the only difference is the mode: in sync the rollout of step s+1 waits for the
update of step s; in fully-async (`--max-staleness 1`) it runs while step s trains. The in-process colocated loop (the
default placement) is measured too, for reference, and fully-async with the trainer in this process and the engine a
Ray Serve replica (`--rollout-serve-replicas 1`), whose weight push overlaps the generation in flight; and, with a KL
loss (a reference role), hybrid (reference log-probs and advantages in the trainer's step) against fully-async (the
streaming roles: the reference in its own process reads each group from TransferQueue as it lands). Seconds per step
are the mean of the trainer's `perf/step_s` over the steps after the first few (start-up and warm-ups excluded).

    python benchmarks/modes_cpu.py [--steps 80] [--warmup 5]

Writes benchmarks/results/modes_cpu.json with {"colocate_s_per_step", "fully_async_s_per_step", "speedup"}
(speedup = colocate / fully_async).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "modes_cpu.json"
CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"

KL = ["--use-kl-loss", "--kl-loss-coef", "0.01"]
ON_POLICY_WAVES = ["--placement", "ray", "--fully-async", "--max-staleness", "0", "--rollout-max-batch-size", "8",
                   "--micro-batch-size", "32"]
RUNS = {
    "colocate": ["--placement", "ray"],
    "fully_async": ["--placement", "ray", "--fully-async", "--max-staleness", "1"],
    "colocate_in_process": [],
    # the trainer in this process, the engine a Ray Serve replica: the push overlaps the generation in flight
    "fully_async_serve": ["--fully-async", "--max-staleness", "1", "--rollout-serve-replicas", "1"],
    # with a KL loss (a reference role): hybrid computes the reference's log-probs and the advantages in the
    # trainer's step; fully-async streams them (the reference in its own process reads each group from TransferQueue)
    "hybrid_kl": ["--placement", "ray", "--hybrid", "--max-staleness", "1", *KL],
    "fully_async_kl": ["--placement", "ray", "--fully-async", "--max-staleness", "1", *KL],
    # on-policy fully-async (--max-staleness 0: rollout waits for each update) with groups finishing one after the
    # other (one group decodes at a time): the trainer waits for the whole step (--train-stream-chunks 1), or trains
    # each quarter of it as it lands (the default), overlapping the updates with the rest of the rollout; both in
    # micro-batches of a quarter step, so that only the overlap differs
    "on_policy_whole_step": [*ON_POLICY_WAVES, "--train-stream-chunks", "1"],
    "on_policy_streamed": [*ON_POLICY_WAVES, "--train-stream-chunks", "4"],
}


def run(name: str, extra: list[str], steps: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "relax.cli.main", "train", "--config", str(CONFIG), "--num-rollout", str(steps),
               "--skip-eval-before-train", "--eval-interval", str(10 * steps), "--save-interval", str(10 * steps),
               "--dump-samples", "0", "--no-use-tensorboard", "--output-dir", str(out), *extra]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--runs", default=",".join(RUNS), help="a subset of the runs, to try a change (the JSON's "
                        "headline fields need all of them)")
    args = parser.parse_args()
    selected = args.runs.split(",")
    unknown = set(selected) - set(RUNS)
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; known: {', '.join(RUNS)}")
    if not (ROOT / "examples" / "quickstart" / "model").is_dir():
        raise SystemExit("build the quickstart first: python examples/quickstart/build_quickstart.py")
    load_before = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in ((name, RUNS[name]) for name in selected):
            print(f"running {name} ({args.steps} steps) ...", flush=True)
            outcome = run(name, extra, args.steps, Path(tmp) / name)
            steps = [r for r in outcome["rows"] if "perf/step_s" in r][args.warmup:]
            results[name] = {
                "s_per_step": statistics.fmean(r["perf/step_s"] for r in steps),
                "rollout_s": statistics.fmean(r.get("perf/rollout_s", 0.0) for r in steps),
                "train_s": statistics.fmean(r.get("perf/train_s", 0.0) for r in steps),
                "wait_for_rollout_s": statistics.fmean(r.get("perf/wait_for_rollout_s", 0.0) for r in steps),
                "weight_sync_s": statistics.fmean(r.get("perf/weight_sync_s", 0.0) for r in steps),
                "weight_push_wait_s": statistics.fmean(r.get("perf/weight_push_wait_s", 0.0) for r in steps),
                # the step's log-probs and advantages before the updates (less what the streaming roles did)
                "prepare_s": statistics.fmean(r.get("perf/prepare_s", 0.0) for r in steps),
                "train_chunks": statistics.fmean(r.get("perf/train_chunks", 1.0) for r in steps),
                "wall_s_including_startup": round(outcome["wall_s"], 1),
                "steps_measured": len(steps),
            }
    if set(selected) != set(RUNS):
        for name, r in results.items():
            print(f"{name:22s} {json.dumps({k: round(v, 4) for k, v in r.items()})}")
        return
    report = {
        "benchmark": "modes_cpu",
        "colocate_s_per_step": round(results["colocate"]["s_per_step"], 4),
        "fully_async_s_per_step": round(results["fully_async"]["s_per_step"], 4),
        "speedup": round(results["colocate"]["s_per_step"] / results["fully_async"]["s_per_step"], 3),
        "colocate_in_process_s_per_step": round(results["colocate_in_process"]["s_per_step"], 4),
        "fully_async_serve_s_per_step": round(results["fully_async_serve"]["s_per_step"], 4),
        "serve_speedup_vs_colocate_in_process": round(results["colocate_in_process"]["s_per_step"]
                                                      / results["fully_async_serve"]["s_per_step"], 3),
        # the trainer's wait for the generation in flight before each push: what the overlapped push removes
        "fully_async_push_wait_s": round(results["fully_async"]["weight_push_wait_s"], 4),
        "fully_async_serve_push_wait_s": round(results["fully_async_serve"]["weight_push_wait_s"], 4),
        "fully_async_serve_wait_for_rollout_s": round(results["fully_async_serve"]["wait_for_rollout_s"], 4),
        # streaming roles: the reference and the advantages off the trainer's step
        "hybrid_kl_s_per_step": round(results["hybrid_kl"]["s_per_step"], 4),
        "fully_async_kl_s_per_step": round(results["fully_async_kl"]["s_per_step"], 4),
        "streaming_roles_speedup": round(results["hybrid_kl"]["s_per_step"] / results["fully_async_kl"]["s_per_step"],
                                         3),
        # the reference's forwards in hybrid's step (a step trained as it arrives counts them in its updates)
        "hybrid_kl_prepare_s": round(results["hybrid_kl"]["prepare_s"], 4),
        "fully_async_kl_wait_for_rollout_s": round(results["fully_async_kl"]["wait_for_rollout_s"], 4),
        # the trainer's streamed reading: on-policy, the updates overlap the step's last groups
        "on_policy_whole_step_s_per_step": round(results["on_policy_whole_step"]["s_per_step"], 4),
        "on_policy_streamed_s_per_step": round(results["on_policy_streamed"]["s_per_step"], 4),
        "streamed_train_speedup": round(results["on_policy_whole_step"]["s_per_step"]
                                        / results["on_policy_streamed"]["s_per_step"], 3),
        "on_policy_whole_step_wait_for_rollout_s": round(results["on_policy_whole_step"]["wait_for_rollout_s"], 4),
        "on_policy_streamed_wait_for_rollout_s": round(results["on_policy_streamed"]["wait_for_rollout_s"], 4),
        "details": results,
        "config": {"steps": args.steps, "warmup_steps_excluded": args.warmup, "workload": "quickstart: 16 prompts x 8",
                   "placement": "ray: actor and rollout in separate processes, 1 torch thread each",
                   "fully_async": "--max-staleness 1"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:22s} {r['s_per_step']:.3f} s/step (rollout {r['rollout_s']:.3f}, log-probs and advantages "
              f"{r['prepare_s']:.3f}, updates {r['train_s']:.3f}, "
              f"waiting for rollout {r['wait_for_rollout_s']:.3f}, weight sync {r['weight_sync_s']:.3f} after "
              f"waiting {r['weight_push_wait_s']:.3f} for the generation in flight)")
    print(f"speedup fully-async vs colocate: {report['speedup']:.2f}x  -> {args.out}")


if __name__ == "__main__":
    main()
