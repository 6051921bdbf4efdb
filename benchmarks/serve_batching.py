"""Continuous batching in `relax serve`: throughput at 1 and at 64 concurrent clients, and the engine steps they
take, with the engine core's paged runner and with its runner over the model's own forward (``--engine-core off``;
until 2026-12-03 a decode loop of its own, which results from before that date measured).

`relax serve` runs as a subprocess on 127.0.0.1 with the quickstart model (or ``--model``); N clients post
SGLang's ``/generate`` back to back (one prompt each, ``--new-tokens`` sampled tokens, EOS ignored) until
``--requests`` requests are done. ``engine_steps`` is the growth of `/health`'s ``decode_steps`` over the level:
with the core, 64 concurrent requests of 16 tokens share one running batch, about 17 steps for all of them
(a prefill and the decodes), where one client alone takes 17 steps per request.

    python -m benchmarks.serve_batching                       # CPU, both engine paths; results/serve_batching.json
    python -m benchmarks.serve_batching --device cuda --engine-core auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from benchmarks.serve_cpu import DATA, MODEL, free_port, start_server

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "serve_batching.json"


async def level(client: httpx.AsyncClient, prompts: list[list[int]], clients: int, requests: int,
                new_tokens: int) -> dict:
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    steps_before = (await client.get("/health")).json()["decode_steps"]
    done, tokens = 0, 0

    async def caller() -> None:
        nonlocal done, tokens
        while done < requests:
            prompt = prompts[done % len(prompts)]
            done += 1
            response = await client.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
            response.raise_for_status()
            tokens += response.json()["meta_info"]["completion_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    wall = time.perf_counter() - started
    steps = (await client.get("/health")).json()["decode_steps"] - steps_before
    return {"clients": clients, "requests": requests, "wall_s": wall, "tokens_per_s": tokens / wall,
            "engine_steps": steps, "engine_steps_per_request": steps / requests}


async def measure(port: int, prompts: list[list[int]], args) -> list[dict]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300, limits=limits) as client:
        await level(client, prompts, 8, 16, args.new_tokens)  # warm-up
        return [await level(client, prompts, clients, args.requests, args.new_tokens) for clients in (1, 64)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-core", nargs="*", default=None, help="default: on and off (CPU), auto (CUDA)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(json.loads(line)["input"])["input_ids"] for line in DATA.read_text().splitlines()[:256]]
    modes = args.engine_core or (["on", "off"] if args.device == "cpu" else ["auto", "off"])
    result: dict = {"device": args.device, "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT)
                                                        else args.model), "new_tokens": args.new_tokens}
    for mode in modes:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        server = start_server(port, env, "--device", args.device, "--engine-core", mode, model=args.model)
        try:
            rows = asyncio.run(measure(port, prompts, args))
        finally:
            server.terminate()
            server.wait(30)
        one, many = rows
        result[f"engine_core_{mode}"] = rows
        result[f"engine_core_{mode}_throughput_64_vs_1"] = round(many["tokens_per_s"] / one["tokens_per_s"], 2)
        print(f"engine core {mode}: 1 client {one['tokens_per_s']:,.0f} tok/s ({one['engine_steps_per_request']:.1f} "
              f"steps/request), 64 clients {many['tokens_per_s']:,.0f} tok/s ({many['engine_steps_per_request']:.2f} "
              f"steps/request): {many['tokens_per_s'] / one['tokens_per_s']:.1f}x", flush=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
