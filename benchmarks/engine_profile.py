"""Where a decode step of `EmbeddedEngine` spends its time, per batch size.

Times one ``generate`` call per batch size (``--batches``; prompts of ``--prompt-len`` ± 25 %
tokens, ``--new-tokens`` new tokens each, EOS ignored) and reports seconds per decode step, then
profiles one call at the largest batch with ``torch.profiler`` and prints the operators with the
most device time and the most host time. A decode step whose time grows with the batch spends
it on per-row work (cache copies, attention, sampling); one that does not is bound by the host
(Python and kernel launches).

    python -m benchmarks.engine_profile --device cuda --dtype bfloat16 --shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.engine_cpu import PAD_ID, SHAPES, make_char_tokenizer, random_prompts
from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine


def generate(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    requests = [GenerationRequest(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    asyncio.run(engine.generate(requests))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=25, help="operators listed per table")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[args.shape], pad_token_id=PAD_ID, eos_token_id=2, bos_token_id=None,
                         tie_word_embeddings=True)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    engine = EmbeddedEngine(model, make_char_tokenizer())
    prompt_generator = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: random_prompts(b, args.prompt_len, config.vocab_size, prompt_generator) for b in batches}
    generate(engine, prompts[batches[0]], 4)  # warm-up
    timings = {}
    for batch in batches:
        short = generate(engine, prompts[batch], 2)  # prefill + one step: subtracted to leave decode steps
        full = generate(engine, prompts[batch], args.new_tokens)
        timings[batch] = {"call_s": round(full, 3), "prefill_s": round(short, 3),
                          "ms_per_decode_step": round(1000 * (full - short) / (args.new_tokens - 2), 2)}
        print(f"batch {batch}: {json.dumps(timings[batch])}", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as profiler:
        generate(engine, prompts[batches[-1]], args.new_tokens)
    table = profiler.key_averages()
    device_key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(table.table(sort_by=device_key, row_limit=args.rows))
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(json.dumps({"per_batch": timings, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}))


if __name__ == "__main__":
    main()
