"""Throughput of `relax serve` over HTTP beside the in-process engine on the same work.

Both sides serve the quickstart model (`examples/quickstart/model`) on CPU with one torch thread and the same
requests: the first prompts of `examples/quickstart/data/train.jsonl` as token ids, each answered with exactly
``--new-tokens`` sampled tokens (temperature 1, EOS ignored, no seed, so every request can share engine batches).
At each level of concurrency N (1, 8, 32), N clients issue requests back to back until a fixed number of requests
is done (``--requests-per-client`` x N, at least ``--min-requests``: 64, 128 and 512 by default):

- HTTP: `relax serve` runs as a subprocess on 127.0.0.1; the clients are `httpx.AsyncClient` tasks posting SGLang's
  `/generate` (one prompt per request);
- in-process: N asyncio tasks call the same `RequestBatcher` the server puts in front of its engine, with the same
  batching window, on an `EmbeddedEngine` in this process.

So the difference is HTTP: connections, JSON, uvicorn and FastAPI, and the client running in another process. Each
level is measured ``--rounds`` times, alternating the two sides, after a warm-up; the result is the median round.

    python benchmarks/serve_cpu.py                      # about 2 minutes; writes benchmarks/results/serve_cpu.json

Prints requests/s and tokens/s per level and `http_overhead_ratio` = in-process tokens/s / HTTP tokens/s at 32
clients. The machine may be shared: the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "quickstart" / "model"
DATA = ROOT / "examples" / "quickstart" / "data" / "train.jsonl"
RESULT = ROOT / "benchmarks" / "results" / "serve_cpu.json"
LEVELS = (1, 8, 32)
BATCH_WINDOW_MS = 5.0  # `relax serve`'s default, used by both sides

# One request: token ids in, the number of generated tokens out.
Generate = Callable[[list[int]], Awaitable[int]]
# The batcher's counters: {"engine_calls": ..., "batched_requests": ...}.
Stats = Callable[[], Awaitable[dict[str, int]]]


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    lines = DATA.read_text().splitlines()[:count]
    return [tokenizer(json.loads(line)["input"])["input_ids"] for line in lines]


async def run_level(generate: Generate, stats: Stats, prompts: list[list[int]], clients: int, requests: int) -> dict:
    """``clients`` callers issue ``requests`` requests back to back in total; returns the figures of the round,
    with the mean number of requests per engine call (how well the batcher merged them)."""
    before = await stats()
    latencies: list[float] = []
    tokens = 0
    next_index = 0

    async def client() -> None:
        nonlocal tokens, next_index
        while next_index < requests:
            prompt = prompts[next_index % len(prompts)]
            next_index += 1
            started = time.perf_counter()
            generated = await generate(prompt)  # not `tokens += await ...`: that reads tokens before the await
            tokens += generated
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - started
    after = await stats()
    engine_calls = after["engine_calls"] - before["engine_calls"]
    return {"wall_s": wall, "requests_per_s": requests / wall, "tokens_per_s": tokens / wall,
            "requests_per_engine_call": (after["batched_requests"] - before["batched_requests"]) / engine_calls,
            "latency_p50_s": statistics.median(latencies),
            "latency_p95_s": statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 1 else latencies[0]}


def in_process_generate(batcher, new_tokens: int) -> Generate:
    from relax.backends.inference.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)
    counter = iter(range(10**12))

    async def generate(prompt: list[int]) -> int:
        (output,) = await batcher.generate([GenerationRequest(f"r{next(counter)}", prompt, params)])
        assert len(output.output_ids) == new_tokens, output.finish_reason
        return len(output.output_ids)

    return generate


def http_generate(client, new_tokens: int) -> Generate:
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def generate(prompt: list[int]) -> int:
        response = await client.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
        response.raise_for_status()
        completion_tokens = response.json()["meta_info"]["completion_tokens"]
        assert completion_tokens == new_tokens, response.text
        return completion_tokens

    return generate


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, env: dict[str, str], *extra: str, model: Path = MODEL) -> subprocess.Popen:
    """`relax serve` on 127.0.0.1:``port`` (CPU unless ``extra`` says otherwise), once it answers /health."""
    import httpx

    command = [sys.executable, "-m", "relax.cli.main", "serve", "--hf-checkpoint", str(model), "--port", str(port),
               "--device", "cpu", "--batch-window-ms", str(BATCH_WINDOW_MS), "--log-level", "warning", *extra]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"relax serve exited:\n{server.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("relax serve did not answer /health within 120 s")


async def measure(args: argparse.Namespace, base_url: str) -> dict[str, dict[str, list[dict]]]:
    import httpx
    import torch

    from relax.backends.inference.batcher import RequestBatcher  # what relax.serving.app puts before its engine
    from relax.backends.inference.embedded import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(str(MODEL))
    prompts = load_prompts(engine.tokenizer, 256)
    batcher = RequestBatcher(engine, window_s=BATCH_WINDOW_MS / 1000)
    batcher.start()
    limits = httpx.Limits(max_connections=max(LEVELS), max_keepalive_connections=max(LEVELS))
    sides: dict[str, dict[str, list[dict]]] = {"in_process": {}, "http": {}}
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            async def local_stats() -> dict[str, int]:
                return batcher.stats()

            async def server_stats() -> dict[str, int]:
                return (await client.get("/health")).json()

            generators = {"in_process": (in_process_generate(batcher, args.new_tokens), local_stats),
                          "http": (http_generate(client, args.new_tokens), server_stats)}
            for generate, stats in generators.values():  # warm-up: first calls, connections, allocator
                await run_level(generate, stats, prompts, max(LEVELS), 2 * max(LEVELS))
            for clients in LEVELS:
                requests = max(args.min_requests, args.requests_per_client * clients)
                for round_index in range(args.rounds):
                    order = list(generators) if round_index % 2 == 0 else list(reversed(generators))
                    for name in order:
                        figures = await run_level(*generators[name], prompts, clients, requests)
                        sides[name].setdefault(str(clients), []).append(figures)
                        print(f"  {name:>10} x{clients:<2} round {round_index}: {figures['requests_per_s']:7.1f} req/s "
                              f"{figures['tokens_per_s']:8.1f} tok/s, "
                              f"{figures['requests_per_engine_call']:.1f} requests/engine call", flush=True)
    finally:
        await batcher.stop()
    return sides


def median_round(rounds: list[dict]) -> dict:
    ordered = sorted(rounds, key=lambda figures: figures["tokens_per_s"])
    return {key: round(value, 4) for key, value in ordered[len(ordered) // 2].items()}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "fastapi", "uvicorn", "httpx")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests-per-client", type=int, default=16, help="requests per client, level and round")
    parser.add_argument("--min-requests", type=int, default=64, help="at least this many requests per level and round")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated tokens per request (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level, alternating the two sides")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    if not MODEL.is_dir():
        raise SystemExit("build the quickstart first: python examples/quickstart/build_quickstart.py")
    # One compute thread on both sides: the server process and this one (set before torch is imported).
    os.environ["OMP_NUM_THREADS"] = "1"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    load_before = os.getloadavg()[0]
    port = free_port()
    server = start_server(port, env)
    try:
        sides = asyncio.run(measure(args, f"http://127.0.0.1:{port}"))
    finally:
        server.terminate()
        server.wait(30)
    load_after = os.getloadavg()[0]

    levels = {clients: {name: median_round(sides[name][str(clients)]) for name in sides} for clients in LEVELS}
    for figures in levels.values():
        figures["in_process_over_http_tokens_per_s"] = round(
            figures["in_process"]["tokens_per_s"] / figures["http"]["tokens_per_s"], 3)
    ratio = levels[max(LEVELS)]["in_process_over_http_tokens_per_s"]
    report = {
        "benchmark": "relax serve (HTTP /generate) vs the in-process engine behind the same RequestBatcher",
        "http_overhead_ratio": ratio,
        "levels": {str(clients): figures for clients, figures in levels.items()},
        "rounds": {name: rounds for name, rounds in sides.items()},
        "config": {"model": "examples/quickstart/model", "prompts": "first 256 of examples/quickstart/data/train.jsonl",
                   "new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True,
                   "requests_per_round": {str(n): max(args.min_requests, args.requests_per_client * n)
                                          for n in LEVELS},
                   "rounds": args.rounds,
                   "figure": "median round by tokens/s", "batch_window_ms": BATCH_WINDOW_MS,
                   "torch_threads": 1, "server": "relax serve subprocess on 127.0.0.1, OMP_NUM_THREADS=1",
                   "client": "httpx.AsyncClient in the benchmark process"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m_before_after": [round(load_before, 2), round(load_after, 2)],
                    "note": "shared development machine: other jobs ran at the same time, so figures are noisy; "
                            "compare the two sides within a level"},
        "versions": versions(),
        "date": date.today().isoformat(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for clients, figures in levels.items():
        http, local = figures["http"], figures["in_process"]
        print(f"{clients:>2} clients: HTTP {http['requests_per_s']:7.1f} req/s {http['tokens_per_s']:8.1f} tok/s | "
              f"in-process {local['requests_per_s']:7.1f} req/s {local['tokens_per_s']:8.1f} tok/s | "
              f"ratio {figures['in_process_over_http_tokens_per_s']:.2f}")
    print(f"http_overhead_ratio (in-process / HTTP tokens/s at {max(LEVELS)} clients): {ratio:.2f}  -> {args.out}")


if __name__ == "__main__":
    main()
