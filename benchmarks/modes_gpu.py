"""Colocated against fully-async GRPO on 2 GPUs, on the same work, in one run.

A randomly initialised Qwen3-0.6B-shaped model runs `relax train` (GRPO, bf16 engine, fp32 master
weights, activation checkpointing) on random prompts, twice:

- **colocate**: ``torchrun --nproc-per-node 2 relax train``: both GPUs time-share rollout and
  training; each rank holds an FSDP shard of the policy and an embedded engine, generates half of
  the prompt groups (`DataParallelEngine`), and the two ranks train together; weights are copied
  in-process into each rank's engine after every step;
- **fully_async**: rollout on GPU 1 in a `relax serve` process, training on GPU 0 in
  ``relax train --fully-async --max-staleness 1 --rollout-external``; the server generates step
  s+1 while the trainer trains step s, and weights reach it over an NCCL broadcast group
  (``--weight-sync-transport broadcast``).

Seconds per step are the mean of the trainer's ``perf/step_s`` after ``--warmup`` steps. The
speedup is colocate / fully_async. Decoding is memory-bound, so half the batch per GPU decodes
in about the time of the whole batch on one GPU, while training splits over the GPUs: fully
async wins when training and rollout take similar time on one GPU, which ``--prompt-len`` and
``--new-tokens`` set (the per-phase times are in the result).

    NCCL_NVLS_ENABLE=0 python -m benchmarks.modes_gpu      # writes benchmarks/results/modes_gpu.json

``--gpus 1`` runs both layouts on one GPU (the server beside the trainer: a smoke test of the script, and the
one-GPU figures). ``--kl`` adds a KL loss, so a reference role; ``--modes hybrid,fully_async`` then compares the
reference and advantages in the trainer's step (``--hybrid``) against the streaming roles (``--fully-async``: the
reference reads each group as the server's answers come in), reported as ``streaming_speedup``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.grpo_step_gpu import QWEN3_0_6B, TINY, build_workspace
from relax.distributed.process_group import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "modes_gpu.json"
PHASES = ("perf/rollout_s", "perf/prepare_s", "perf/train_s", "perf/wait_for_rollout_s", "perf/weight_sync_s",
          "perf/train_chunks")


def train_args(model_dir: Path, data: Path, out: Path, args: argparse.Namespace) -> list[str]:
    kl = ["--use-kl-loss", "--kl-loss-coef", "0.001"] if args.kl else []
    return ["train", *kl, "--hf-checkpoint", str(model_dir), "--prompt-data", str(data), "--input-key", "input",
            "--label-key", "label", "--custom-rm-path", "benchmarks.grpo_step_gpu:parity_reward",
            "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples_per_prompt),
            "--rollout-max-response-len", str(args.new_tokens), "--micro-batch-size", str(args.micro_batch_size),
            "--gradient-checkpointing", "--lr", "1e-6", "--num-rollout", str(args.steps), "--device", args.device,
            "--save-interval", str(10 * args.steps), "--dump-samples", "0", "--no-use-tensorboard",
            "--output-dir", str(out)]


def environment(devices: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0", "HF_HUB_OFFLINE": "1"}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def run(command: list[str], env: dict[str, str], name: str, timeout: float) -> None:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        errors = [line for line in result.stderr.splitlines() if "Error" in line or "error:" in line]
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stderr[:3000]}\n...\n"
                         + "\n".join(errors[-20:]))
    print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)


def run_colocate(model_dir: Path, data: Path, out: Path, args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus),
               "--master-addr", "127.0.0.1", "--master-port", str(free_loopback_port()), "-m", "relax.cli.main",
               *train_args(model_dir, data, out, args)]
    run(command, environment(",".join(str(i) for i in range(args.gpus)) if args.device == "cuda" else ""),
        "colocate", args.timeout)


def run_fully_async(model_dir: Path, data: Path, out: Path, args: argparse.Namespace, mode: str = "--fully-async",
                    extra: tuple[str, ...] = ()) -> None:
    """Rollout in a `relax serve` process (on GPU 1; with ``--gpus 1`` beside the trainer on GPU 0), training here;
    ``mode`` ``--hybrid`` keeps the reference and the advantages in the trainer's step (no streaming roles)."""
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    serve_device = ("1" if args.gpus > 1 else "0") if args.device == "cuda" else ""
    # NCCL refuses two ranks on one GPU: with --gpus 1 the weights go through files the server reads
    weights = ([] if args.gpus > 1
               else ["--weight-sync-transport", "disk", "--rollout-weights-dir", str(out.parent / f"{out.name}_weights")])
    if weights:
        (out.parent / f"{out.name}_weights").mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [sys.executable, "-m", "relax.cli.main", "serve", "--hf-checkpoint", str(model_dir), "--port", str(port),
         "--device", args.device, "--batch-window-ms", str(args.batch_window_ms), "--log-level", "warning",
         *(["--weight-update-root", weights[-1]] if weights else [])],
        cwd=ROOT, env=environment(serve_device), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_server(url, server, args.timeout)
        command = [sys.executable, "-m", "relax.cli.main", *train_args(model_dir, data, out, args), mode, *extra,
                   "--max-staleness", str(args.max_staleness), "--rollout-external",
                   "--rollout-external-engine-addrs", url,
                   *(weights or ["--weight-sync-transport", "broadcast"])]
        try:
            run(command, environment("0" if args.device == "cuda" else ""), out.name, args.timeout)
        finally:
            (out / "server_health.json").write_text(httpx.get(f"{url}/health", timeout=10).text)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def wait_for_server(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"relax serve exited with {server.returncode}:\n{server.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"relax serve at {url} did not answer /health within {timeout} s")


def summarize(out: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "perf/step_s" in row][warmup:]
    summary = {"s_per_step": statistics.fmean(row["perf/step_s"] for row in steps), "steps_measured": len(steps),
               "steps_s": [round(row["perf/step_s"], 3) for row in steps]}
    if (out / "server_health.json").is_file():  # engine calls per step show whether the server batched each step
        health = json.loads((out / "server_health.json").read_text())
        summary["server"] = {key: health.get(key) for key in ("engine_calls", "batched_requests", "weight_version")}
    for phase in PHASES:
        values = [row[phase] for row in steps if phase in row]
        if values:
            summary[phase.removeprefix("perf/")] = statistics.fmean(values)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the colocated run")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of the script)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-window-ms", type=float, default=200.0,
                        help="relax serve: how long the first request waits to batch the step's other requests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--output", type=Path, default=RESULT)
    parser.add_argument("--runs-dir", type=Path, default=None, help="keep the two run directories here")
    parser.add_argument("--modes", default="colocate,fully_async",
                        help="which runs among colocate, fully_async, hybrid, fully_async_whole_step (speedup: "
                             "colocate / fully_async; streaming_speedup: hybrid / fully_async; "
                             "streamed_train_speedup: fully_async_whole_step / fully_async)")
    parser.add_argument("--max-staleness", type=int, default=1, help="of the fully_async and hybrid runs")
    parser.add_argument("--mean-response-len", type=int, default=None,
                        help="responses end at varied lengths about this long (default: all run to --new-tokens)")
    parser.add_argument("--kl", action="store_true",
                        help="a KL loss, so a reference role: in fully_async it streams, in hybrid it is in the step")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    shape = TINY if args.tiny else QWEN3_0_6B
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        runs = args.runs_dir or root
        model_dir, data = build_workspace(root, shape, args.prompts * args.steps, args.prompt_len,
                                          mean_response_len=args.mean_response_len)

        def run_hybrid(*launch_args) -> None:
            run_fully_async(*launch_args, mode="--hybrid")

        def run_whole_step(*launch_args) -> None:  # the trainer waits for each step's whole batch
            run_fully_async(*launch_args, extra=("--train-stream-chunks", "1"))

        launches = (("colocate", run_colocate), ("fully_async", run_fully_async), ("hybrid", run_hybrid),
                    ("fully_async_whole_step", run_whole_step))
        for mode, launch in launches:
            if mode in args.modes.split(","):
                launch(model_dir, data, runs / mode, args)
                results[mode] = summarize(runs / mode, args.warmup)
                print(mode, json.dumps(results[mode]), flush=True)
    report = {"benchmark": "modes_gpu"}
    for mode, summary in results.items():
        report[f"{mode}_s_per_step"] = round(summary["s_per_step"], 3)
    if "colocate" in results and "fully_async" in results:
        report["speedup"] = round(results["colocate"]["s_per_step"] / results["fully_async"]["s_per_step"], 3)
    if "hybrid" in results and "fully_async" in results:  # the streaming roles (with --kl: the reference)
        report["streaming_speedup"] = round(results["hybrid"]["s_per_step"] / results["fully_async"]["s_per_step"], 3)
    if "fully_async_whole_step" in results and "fully_async" in results:  # the trainer's streamed reading
        report["streamed_train_speedup"] = round(results["fully_async_whole_step"]["s_per_step"]
                                                 / results["fully_async"]["s_per_step"], 3)
    report.update({
        "details": results,
        "config": {"model": "tiny Qwen3" if args.tiny else "Qwen3-0.6B shape, random init",
                   "gpus": args.gpus, "prompts_per_step": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                   "prompt_len": args.prompt_len, "new_tokens_max": args.new_tokens,
                   "micro_batch_size": args.micro_batch_size, "steps": args.steps, "warmup_steps": args.warmup,
                   "colocate": f"torchrun --nproc-per-node {args.gpus}, sync loop, DataParallelEngine, FSDP2",
                   "fully_async": f"relax serve on GPU {1 if args.gpus > 1 else 0} + relax train --fully-async "
                                  f"--max-staleness {args.max_staleness} on GPU 0, "
                                  + ("NCCL weight broadcast" if args.gpus > 1 else "weights through files (NCCL "
                                     "refuses two ranks on one GPU)"),
                   "hybrid": "as fully_async with --hybrid: reference and advantages in the trainer's step",
                   "fully_async_whole_step": "as fully_async with --train-stream-chunks 1: the trainer waits for "
                                             "each step's whole batch",
                   "mean_response_len": args.mean_response_len,
                   "kl_loss": args.kl,
                   "batch_window_ms": args.batch_window_ms},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
    })
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(", ".join(f"{mode} {report[f'{mode}_s_per_step']} s/step" for mode in results)
          + (f" -> speedup {report['speedup']}" if "speedup" in report else ""))


if __name__ == "__main__":
    main()
