"""Where a decode step of the engine core goes on the GPU: the engine's wall time per decode step beside the
device time of the same step's CUDA graph replayed back to back (no host in between), with the graph's kernels
(``--profile``) and the sampler's device time per block size and warp count.

    python -m benchmarks.decode_anatomy_gpu --settings qwen3-0.6b:256,qwen3-4b:256
    python -m benchmarks.decode_anatomy_gpu --settings qwen3-4b:256 --fp8 --kv-cache-dtype fp8_e4m3 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks.engine_gpu import SHAPES, build_model, requests_for
from benchmarks.grpo_step_gpu import word_tokenizer
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine

RESULTS = Path(__file__).resolve().parent / "results"


def cuda_ms(fn, repeats: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def sampling_variants(batch: int, vocab: int) -> dict:
    """The sampling kernel's device time over ``[batch, vocab]`` bf16 logits per (block, warps): the tokens must
    not depend on the variant (the noise is keyed by the vocabulary index, not the chunk)."""
    from relax.backends.inference.triton_sampling import sample_tokens

    logits = torch.randn(batch, vocab, device="cuda").to(torch.bfloat16)
    temperature = torch.ones(batch, device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64)
    counters = torch.full((batch,), 300, device="cuda", dtype=torch.int64)
    tokens = torch.empty(batch, dtype=torch.int64, device="cuda")
    log_probs = torch.empty(batch, dtype=torch.float32, device="cuda")
    timings, reference = {}, None
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            microseconds = 1000 * cuda_ms(lambda block=block, warps=warps: sample_tokens(
                logits, temperature, seeds, counters, tokens, log_probs, block=block, num_warps=warps), 20)
            reference = tokens.clone() if reference is None else reference
            timings[f"block{block}_warps{warps}"] = (round(microseconds, 1), bool((tokens == reference).all()))
    return timings


def run(shape_name: str, batch: int, args) -> dict:
    model = build_model(SHAPES[shape_name], "cuda", torch.bfloat16)
    tokenizer = word_tokenizer(model.config.vocab_size)
    prompts = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(batch)).tolist()
    pool = batch * (args.prompt_len + args.new_tokens + 16) + 4096
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=batch,
                            core=CoreSettings(mode="on", max_total_tokens=pool, max_graph_batch=512, fp8=args.fp8,
                                              kv_cache_dtype=args.kv_cache_dtype))
    asyncio.run(engine.generate(requests_for(prompts[:8], 8, "warm")))
    core = engine.core
    first_calls = []
    for repeat in range(args.repeats - 1):  # earlier calls of the same size: what the first call pays once
        other = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len),
                              generator=torch.Generator().manual_seed(1000 + repeat)).tolist()
        core.host_seconds.clear()
        torch.cuda.synchronize()
        started = time.perf_counter()
        asyncio.run(engine.generate(requests_for(other, args.new_tokens, f"repeat{repeat}")))
        torch.cuda.synchronize()
        first_calls.append({"seconds": round(time.perf_counter() - started, 3),
                            "prefill_s": round(core.host_seconds["prefill"], 3)})
    core.host_seconds.clear()
    core.decode_steps = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    asyncio.run(engine.generate(requests_for(prompts, args.new_tokens, "timed")))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    decode_steps = core.decode_steps
    host = {phase: round(1000 * s / decode_steps, 3) for phase, s in core.host_seconds.items()}
    runner = core.runner
    # the buffers hold the last step's inputs (contexts ~ prompt + new tokens): the graph's device time alone
    graph = runner.graphs[batch]
    replay_ms = cuda_ms(graph.replay, 30)
    launch_started = time.perf_counter()
    for _ in range(30):
        graph.replay()
    launch_host_ms = (time.perf_counter() - launch_started) / 30 * 1000
    torch.cuda.synchronize()
    result = {"shape": shape_name, "batch": batch, "fp8": args.fp8, "kv_cache_dtype": args.kv_cache_dtype,
              "earlier_calls": first_calls, "seconds": round(seconds, 3),
              "prefill_s": round(core.host_seconds["prefill"], 3),
              "tokens_per_s": round(batch * args.new_tokens / seconds),
              "wall_ms_per_engine_step": round(1000 * seconds / core.steps, 3) if core.steps else None,
              "decode_steps": decode_steps, "host_ms_per_decode_step": host,
              "graph_replay_device_ms_at_final_context": round(replay_ms, 3),
              "graph_replay_host_ms": round(launch_host_ms, 3),
              "sampling_us_by_variant": sampling_variants(batch, model.config.vocab_size)}
    if args.prefill_profile:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        started = time.perf_counter()
        fresh = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len),
                              generator=torch.Generator().manual_seed(batch + 1)).tolist()  # nothing cached
        steps_before, prefill_before = core.steps, core.host_seconds["prefill"]
        asyncio.run(engine.generate(requests_for(fresh, 1, "prefill-timed")))
        torch.cuda.synchronize()
        result["prefill_only_call_s"] = round(time.perf_counter() - started, 3)
        result["prefill_steps"] = core.steps - steps_before
        result["prefill_host_phase_s"] = round(core.host_seconds["prefill"] - prefill_before, 3)
        fresh = torch.randint(2, model.config.vocab_size, (batch, args.prompt_len),
                              generator=torch.Generator().manual_seed(batch + 2)).tolist()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            asyncio.run(engine.generate(requests_for(fresh, 1, "prefill")))
            torch.cuda.synchronize()
        averages = prof.key_averages()
        result["prefill_by_device"] = [(e.key[:70], e.count, round(e.device_time_total / 1000, 2))
                                       for e in sorted(averages, key=lambda e: -e.device_time_total)[:15]]
        result["prefill_by_host"] = [(e.key[:70], e.count, round(e.cpu_time_total / 1000, 2))
                                     for e in sorted(averages, key=lambda e: -e.cpu_time_total)[:25]]
        texts = [list(range(2, 514))] * batch
        started = time.perf_counter()
        for ids in texts:
            tokenizer.decode(ids, skip_special_tokens=True)
        result["decode_text_s"] = round(time.perf_counter() - started, 3)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages()]
        events.sort(key=lambda e: -e.device_time_total)
        result["graph_kernels"] = [(e.key[:80], e.count // 5, round(e.device_time_total / 5, 1)) for e in events[:25]]
    print(json.dumps(result, indent=1), flush=True)
    del engine, model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="qwen3-0.6b:256,qwen3-4b:256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--prefill-profile", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls (the last one reported in full)")
    parser.add_argument("--fp8", action="store_true", help="the engine with --rollout-fp8's FP8 projections")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [run(name, int(batch), args) for name, batch in (s.split(":") for s in args.settings.split(","))]
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "settings": rows}, indent=1))


if __name__ == "__main__":
    main()
