"""Sampling throughput: `EmbeddedEngine.generate` on each of its core's runners against Hugging Face `model.generate`.

All sample (temperature 1, no top-k/top-p) the same batch of random prompts for exactly ``new_tokens`` tokens per
row (EOS ignored), on a randomly initialized Qwen3 (or, ``--shape tiny-moe``, Qwen3-MoE) built from a config. The
engine runs once per ``--engine-core`` mode: ``on`` (the paged runner: the core's decoder over a paged KV pool) and
``off`` (the cache runner: the model's own forward and cache, what every family the paged decoder does not run
gets). Each setting (``--settings``, default: batch 64 x 8 new tokens and batch 16 x 64 new tokens, prompts of ~8
tokens) is timed ``--repeats`` times, alternating the implementations, after one warm-up call each; the median
wall time gives tokens/s (generated tokens only). Prints one line per setting with each engine's ratio to
`model.generate` and writes a JSON result (headline: the geometric mean of each ratio over the settings).

    python benchmarks/engine_cpu.py                                   # tiny Qwen3 on CPU, fp32
    python benchmarks/engine_cpu.py --shape tiny-moe --engine-core off
    python benchmarks/engine_cpu.py --device cuda --dtype bfloat16 --shape qwen3-0.6b --settings 64x8x8,64x256x128

Wall times on a shared machine are noisy; compare the per-call times in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import string
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine

SHAPES = {
    # ~2.6 M parameters, the CPU quickstart model (environment-notes §12).
    "tiny": {
        "vocab_size": 64,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    # The tiny shape with 8 experts, 2 per token, in every layer (a family the paged decoder does not run).
    "tiny-moe": {
        "vocab_size": 64,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    # The GPU baseline model of environment-notes §11.
    "qwen3-0.6b": {
        "vocab_size": 151_936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
# BATCHxPROMPTxNEW: batch size, prompt length in tokens, new tokens per row.
DEFAULT_SETTINGS = "64x8x8,16x8x64"
PAD_ID = 0


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A 64-token char-level tokenizer (the engine only decodes with it; ids past 63 decode to "")."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    characters = string.digits + string.ascii_lowercase + " +-=*/.,:;!?()'\"#<>[]{}_@"
    tokenizer = Tokenizer(
        models.WordLevel({t: i for i, t in enumerate(specials + list(characters))}, unk_token=specials[0])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def random_prompts(batch_size: int, prompt_length: int, vocab_size: int, generator: torch.Generator) -> list[list[int]]:
    """Prompts of ``prompt_length`` ± 25 % tokens (so the batch is padded), ids past the specials."""
    spread = max(1, prompt_length // 4)
    lengths = torch.randint(prompt_length - spread, prompt_length + spread + 1, (batch_size,), generator=generator)
    return [torch.randint(3, vocab_size, (int(n),), generator=generator).tolist() for n in lengths]


def time_engine(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int, seed: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=seed)
    requests = [GenerationRequest(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    start = time.perf_counter()
    outputs = asyncio.run(engine.generate(requests))
    elapsed = time.perf_counter() - start
    assert all(len(output.output_ids) == new_tokens for output in outputs)
    return elapsed


def time_hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    longest = max(len(prompt) for prompt in prompts)
    input_ids = torch.tensor([[PAD_ID] * (longest - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert generated.shape[1] == longest + new_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="Qwen3 model shape")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated BATCHxPROMPTxNEW")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per setting and implementation")
    parser.add_argument("--engine-core", default="on,off", help="comma-separated modes of the engine to time "
                        "(on: the paged runner, off: the cache runner; a MoE shape runs only on off)")
    parser.add_argument("--out", type=Path, default=None, help="JSON result path (default benchmarks/results/...)")
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    moe = "num_experts" in SHAPES[args.shape]
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_class(
        **SHAPES[args.shape], pad_token_id=PAD_ID, eos_token_id=2, bos_token_id=None, tie_word_embeddings=True
    )
    with torch.device(args.device):
        model = model_class(config).to(dtype).eval()
    tokenizer = make_char_tokenizer()
    modes = args.engine_core.split(",")
    engines = {mode: EmbeddedEngine(model, tokenizer, core=CoreSettings(mode=mode)) for mode in modes}
    parameter_count = sum(p.numel() for p in model.parameters())
    print(
        f"{model_class.__name__} {args.shape}: {parameter_count / 1e6:.2f} M parameters, {args.device}, {args.dtype}, "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}"
    )

    results = []
    prompt_generator = torch.Generator().manual_seed(0)
    settings = [tuple(int(n) for n in setting.split("x")) for setting in args.settings.split(",")]
    for batch_size, prompt_length, new_tokens in settings:
        prompts = random_prompts(batch_size, prompt_length, config.vocab_size, prompt_generator)
        for engine in engines.values():
            time_engine(engine, prompts, new_tokens, seed=0)
        time_hf_generate(model, prompts, new_tokens, args.device)
        engine_times: dict[str, list[float]] = {mode: [] for mode in modes}
        hf_times = []
        for repeat in range(args.repeats):
            for mode, engine in engines.items():
                engine_times[mode].append(time_engine(engine, prompts, new_tokens, seed=repeat))
            hf_times.append(time_hf_generate(model, prompts, new_tokens, args.device))
        generated_tokens = batch_size * new_tokens
        hf_tps = generated_tokens / statistics.median(hf_times)
        row = {"batch_size": batch_size, "prompt_length": prompt_length, "new_tokens": new_tokens,
               "hf_generate_tokens_per_s": hf_tps, "hf_generate_seconds": hf_times}
        line = f"batch {batch_size:3d}, prompt ~{prompt_length}, {new_tokens:3d} new tokens: "
        for mode in modes:
            tps = generated_tokens / statistics.median(engine_times[mode])
            row[f"engine_{mode}_tokens_per_s"] = tps
            row[f"engine_{mode}_ratio"] = tps / hf_tps
            row[f"engine_{mode}_seconds"] = engine_times[mode]
            line += f"engine --engine-core {mode} {tps:8.0f} tok/s ({tps / hf_tps:.2f}x), "
        results.append(row)
        print(line + f"model.generate {hf_tps:8.0f} tok/s")

    out = (
        args.out
        or Path(__file__).parent / "results" / f"engine_{args.shape}_{args.device.split(':')[0]}_{args.dtype}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    headline = {f"engine_{mode}_vs_generate": statistics.geometric_mean(r[f"engine_{mode}_ratio"] for r in results)
                for mode in modes}
    out.write_text(
        json.dumps(
            {
                "benchmark": "engine_generate_vs_hf_generate",
                **headline,
                "shape": args.shape,
                "parameters": parameter_count,
                "device": args.device,
                "dtype": args.dtype,
                "torch": torch.__version__,
                "cpu_threads": torch.get_num_threads(),
                "host": platform.node(),
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}: " + ", ".join(f"{key} {value:.2f}" for key, value in headline.items()))


if __name__ == "__main__":
    main()
